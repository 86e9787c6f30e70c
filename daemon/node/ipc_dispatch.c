/* ipc_dispatch: a session's requests, one complete frame at a time (the
 * handler every session is opened with): checked (a request type, its
 * descriptors, its message, the session's state and in-flight bound),
 * then ATTACH to ipc_attach.c, UNITS and STATS answered on the loop, and
 * every other request made an op for the session's rank, or its reader. */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt_call.h"
#include "clock.h"
#include "daemon.h"
#include "exec.h"
#include "frame.h"
#include "log.h"
#include "pin.h"
#include "rank_metrics.h"
#include "reader.h"

#include "ipc_impl.h"
#include "clock.h"

static op_kind kind_of(uint16_t type) {
  switch (type) {
  case ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT:
    return OP_REGISTER;
  case ZEROD__V1__MSG_TYPE__MSG_GATHER:
    return OP_GATHER;
  case ZEROD__V1__MSG_TYPE__MSG_RELEASE:
    return OP_RELEASE;
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER:
    return OP_GRAD_BUFFER;
  case ZEROD__V1__MSG_TYPE__MSG_REDUCE:
    return OP_REDUCE;
  case ZEROD__V1__MSG_TYPE__MSG_STEP:
    return OP_STEP;
  case ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT:
    return OP_LOAD;
  case ZEROD__V1__MSG_TYPE__MSG_READ_STATE:
    return OP_READ_STATE;
  case ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS:
    return OP_SET_GROUPS;
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM:
    return OP_GRAD_NORM;
  case ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT:
    return OP_CKPT_PARK;
  case ZEROD__V1__MSG_TYPE__MSG_PIN:
    return OP_PIN;
  case ZEROD__V1__MSG_TYPE__MSG_WATCH:
    return OP_WATCH;
  default:
    return OP_SESSION_END; /* DETACH */
  }
}

/* Requests that change the job, which read-only sessions may not send. */
static const char *write_request_name(uint16_t type) {
  switch (type) {
  case ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT:
    return "register_unit";
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER:
    return "grad_buffer";
  case ZEROD__V1__MSG_TYPE__MSG_REDUCE:
    return "reduce";
  case ZEROD__V1__MSG_TYPE__MSG_STEP:
    return "step";
  case ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT:
    return "load_unit";
  case ZEROD__V1__MSG_TYPE__MSG_READ_STATE:
    return "read_state"; /* a collective of the job's ranks */
  case ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS:
    return "set_groups";
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM:
    return "grad_norm"; /* a collective of the job's ranks */
  case ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT:
    return "checkpoint"; /* a collective of the job's ranks */
  default:
    return NULL;
  }
}

static int is_request(uint16_t type) {
  switch (type) {
  case ZEROD__V1__MSG_TYPE__MSG_ATTACH:
  case ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT:
  case ZEROD__V1__MSG_TYPE__MSG_GATHER:
  case ZEROD__V1__MSG_TYPE__MSG_RELEASE:
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER:
  case ZEROD__V1__MSG_TYPE__MSG_REDUCE:
  case ZEROD__V1__MSG_TYPE__MSG_STEP:
  case ZEROD__V1__MSG_TYPE__MSG_DETACH:
  case ZEROD__V1__MSG_TYPE__MSG_UNITS:
  case ZEROD__V1__MSG_TYPE__MSG_PIN:
  case ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT:
  case ZEROD__V1__MSG_TYPE__MSG_STATS:
  case ZEROD__V1__MSG_TYPE__MSG_READ_STATE:
  case ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS:
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM:
  case ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT:
  case ZEROD__V1__MSG_TYPE__MSG_WATCH:
    return 1;
  default:
    return 0;
  }
}

/* UNITS, from any attached session, answered on the loop: the units every
 * rank has registered, in id order, and the latest version. Unit layouts
 * are immutable once published, so only the table is read under the job's
 * mutex. */
static void handle_units(session *s, const zd_frame_header *h) {
  job *j = s->job;
  uint32_t nunits;
  unit_layout **units = job_units_copy(j, &nunits);
  Zerod__V1__RegisterUnitReply *replies = calloc(nunits ? nunits : 1, sizeof *replies);
  Zerod__V1__RegisterUnitReply **listed = calloc(nunits ? nunits : 1, sizeof *listed);
  size_t count = 0;
  int failed = units == NULL || replies == NULL || listed == NULL;
  for (uint32_t u = 0; !failed && u < nunits; u++) {
    if (atomic_load(&units[u]->ready_ranks) < j->nranks)
      continue;
    Zerod__V1__RegisterUnitReply *reply = &replies[count];
    zerod__v1__register_unit_reply__init(reply);
    if (exec_unit_reply(j, units[u], reply) != 0) {
      failed = 1;
      break;
    }
    reply->existed = 1;
    listed[count++] = reply;
  }
  if (failed) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                    "out of memory");
  } else if (!(h->flags & ZD_FRAME_F_NO_REPLY)) {
    Zerod__V1__UnitsReply reply = ZEROD__V1__UNITS_REPLY__INIT;
    reply.n_units = count;
    reply.units = listed;
    reply.version = pin_latest_version(j);
    uint8_t *frame;
    size_t bytes;
    int rc = zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_UNITS_REPLY, h->request_id, 0, 0, &reply.base,
                             &frame, &bytes);
    if (rc == 0)
      ipc__session_send(s, frame, bytes, -1);
    else if (rc == -EMSGSIZE)
      ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                      "the unit table of job '%s' (%zu units) does not fit in one %u-byte frame",
                      j->name, count, ZD_FRAME_MAX_PAYLOAD);
    else
      ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_INTERNAL,
                      "cannot encode the unit table: %s", strerror(-rc));
  }
  for (size_t k = 0; k < count; k++)
    exec_unit_reply_free(&replies[k]);
  free(listed);
  free(replies);
  free(units);
}

/* STATS, from any attached session, answered on the loop from the
 * counters the ranks keep (atomics): every local rank of the job, with
 * its non-zero counters. */
static void handle_stats(session *s, const zd_frame_header *h) {
  job *j = s->job;
  enum { PER_RANK = JOB_COUNTER_LEVELS * JOB_COUNTER_KINDS };
  Zerod__V1__RankStats *ranks = calloc((size_t)j->nranks, sizeof *ranks);
  Zerod__V1__RankStats **listed = calloc((size_t)j->nranks, sizeof *listed);
  Zerod__V1__CollectiveCounter *counters = calloc((size_t)j->nranks * PER_RANK, sizeof *counters);
  Zerod__V1__CollectiveCounter **counter_ptrs =
      calloc((size_t)j->nranks * PER_RANK, sizeof *counter_ptrs);
  if (ranks == NULL || listed == NULL || counters == NULL || counter_ptrs == NULL) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                    "out of memory");
    goto out;
  }
  for (int r = 0; r < j->nranks; r++) {
    rank_state *rs = &j->ranks[r];
    Zerod__V1__RankStats *rank = &ranks[r];
    zerod__v1__rank_stats__init(rank);
    rank->rank = (uint32_t)rs->rank;
    rank->step = atomic_load(&rs->step);
    rank->pool_bytes = atomic_load_explicit(&rs->stat_pool_bytes, memory_order_relaxed);
    rank->secondary_bytes = atomic_load_explicit(&rs->stat_secondary_bytes, memory_order_relaxed);
    rank->state_bytes = atomic_load_explicit(&rs->stat_state_bytes, memory_order_relaxed);
    rank->tier_bytes = atomic_load_explicit(&rs->stat_tier_bytes, memory_order_relaxed);
    rank->host_state_bytes = atomic_load_explicit(&rs->stat_host_state_bytes, memory_order_relaxed);
    rank->comm_seconds = (double)comm_activity_busy_ns(&rs->activity, clock_now_ns()) / 1e9;
    rank->wait_seconds = (double)atomic_load(&rs->stat_wait_ns) / 1e9;
    rank->exposed_comm_seconds = (double)atomic_load(&rs->stat_exposed_comm_ns) / 1e9;
    rank->counters = &counter_ptrs[r * PER_RANK];
    for (int level = 0; level < JOB_COUNTER_LEVELS; level++)
      for (int kind = 0; kind < JOB_COUNTER_KINDS; kind++) {
        uint64_t calls = atomic_load_explicit(&rs->coll_calls[level][kind], memory_order_relaxed);
        if (calls == 0)
          continue;
        Zerod__V1__CollectiveCounter *c = &counters[r * PER_RANK + (int)rank->n_counters];
        zerod__v1__collective_counter__init(c);
        c->level = (char *)rank_level_names[level];
        c->collective = (char *)rank_collective_names[kind];
        c->bytes = atomic_load_explicit(&rs->coll_bytes[level][kind], memory_order_relaxed);
        c->calls = calls;
        rank->counters[rank->n_counters++] = c;
      }
    listed[r] = rank;
  }
  if (!(h->flags & ZD_FRAME_F_NO_REPLY)) {
    Zerod__V1__StatsReply reply = ZEROD__V1__STATS_REPLY__INIT;
    reply.n_ranks = (size_t)j->nranks;
    reply.ranks = listed;
    uint8_t *frame;
    size_t bytes;
    int rc = zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_STATS_REPLY, h->request_id, 0, 0, &reply.base,
                             &frame, &bytes);
    if (rc == 0)
      ipc__session_send(s, frame, bytes, -1);
    else
      ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_INTERNAL,
                      "cannot encode the stats: %s", strerror(-rc));
  }
out:
  free(counter_ptrs);
  free(counters);
  free(listed);
  free(ranks);
}

/* The requests a frozen job (a base) refuses: those that change its
 * state, and the gradient norm (a base keeps no gradients). */
static int changes_state(uint16_t type) {
  return type == ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT ||
         type == ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER || type == ZEROD__V1__MSG_TYPE__MSG_REDUCE ||
         type == ZEROD__V1__MSG_TYPE__MSG_STEP || type == ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT ||
         type == ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS || type == ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM;
}

static void close_fds(int *fds, unsigned nfds) {
  for (unsigned i = 0; i < nfds; i++)
    if (fds[i] >= 0)
      close(fds[i]);
}

/* Handles one complete frame; owns payload and fds. */
void ipc__dispatch(session *s, const zd_frame_header *h, uint8_t *payload, int *fds,
                   unsigned nfds) {
  ProtobufCMessage *msg = NULL;
  const char *why = NULL;
  unsigned min_fds = 0, max_fds = 0;
  if (!is_request(h->type)) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                    "message type %u is not a request this daemon accepts", h->type);
    goto out;
  }
  if (h->request_id == 0) {
    ipc__send_error(s, 0, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                    "request id 0 is reserved for notices");
    goto out;
  }
  if (zd_msg_fd_range(h->type, &min_fds, &max_fds) != 0 || nfds < min_fds || nfds > max_fds) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                    "message type %u carries %u descriptor(s); %u..%u expected", h->type, nfds,
                    min_fds, max_fds);
    goto out;
  }
  if (zd_msg_unpack(h->type, payload, h->payload_bytes, &msg, &why) != 0) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                    "malformed message (type %u): %s", h->type,
                    why != NULL ? why : "does not decode");
    goto out;
  }
  if (s->daemon->stopping) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_UNAVAILABLE,
                    "zerod is shutting down");
    goto out;
  }
  if (h->type == ZEROD__V1__MSG_TYPE__MSG_ATTACH) {
    if (s->attach_pending)
      ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                      "this connection's attach is still in progress");
    else if (s->job != NULL)
      ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                      "this connection is already attached to job '%s'; one job per connection",
                      s->job->name);
    else
      ipc__handle_attach(s, h->request_id, h->flags, (Zerod__V1__AttachRequest *)msg);
    goto out;
  }
  if (s->job == NULL) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                    "attach to a job first");
    goto out;
  }
  if (s->detaching) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                    "the session is detaching");
    goto out;
  }
  if (s->inflight >= SESSION_MAX_INFLIGHT) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                    "more than %d requests in flight", SESSION_MAX_INFLIGHT);
    goto out;
  }
  if (h->type == ZEROD__V1__MSG_TYPE__MSG_UNITS) {
    handle_units(s, h);
    goto out;
  }
  if (h->type == ZEROD__V1__MSG_TYPE__MSG_STATS) {
    handle_stats(s, h);
    goto out;
  }
  if (s->read_only != NULL && write_request_name(h->type) != NULL) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_PERMISSION_DENIED,
                    "%s refused: read-only session (job '%s')", write_request_name(h->type),
                    s->job->name);
    goto out;
  }
  if (atomic_load(&s->job->frozen) && changes_state(h->type)) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                    "%s refused: job '%s' is a frozen base, whose state no longer changes "
                    "(docs/bases.md)",
                    write_request_name(h->type), s->job->name);
    goto out;
  }
  if (s->read_only == NULL &&
      (h->type == ZEROD__V1__MSG_TYPE__MSG_PIN || h->type == ZEROD__V1__MSG_TYPE__MSG_WATCH)) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                    "%s is for read-only sessions; this session is read-write (rank %d)",
                    h->type == ZEROD__V1__MSG_TYPE__MSG_PIN ? "pin" : "watch", s->rank->rank);
    goto out;
  }
  if (s->read_only == NULL && h->type == ZEROD__V1__MSG_TYPE__MSG_GATHER &&
      ((const Zerod__V1__GatherRequest *)msg)->delta) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                    "a delta gather is for read-only sessions; this session is read-write "
                    "(rank %d)",
                    s->rank->rank);
    goto out;
  }
  if (h->type == ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT) {
    char bad[512];
    if (ckpt_call_check((const Zerod__V1__CheckpointRequest *)msg, bad, sizeof bad) != 0) {
      ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, "%s", bad);
      goto out;
    }
  }
  exec_op *op = exec_op_new(kind_of(h->type), s->rank);
  if (op == NULL) {
    ipc__send_error(s, h->request_id, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                    "out of memory");
    goto out;
  }
  op->session = s;
  op->session_id = s->id;
  op->request_id = h->request_id;
  op->flags = h->flags;
  op->request = msg;
  msg = NULL;
  if (nfds > 0) {
    op->in_fd = fds[0];
    fds[0] = -1;
  }
  if (s->read_only != NULL) {
    /* The reader runs the session's requests in order, on the loop or on
     * the threadpool, and hands them back through deliver. */
    if (op->kind == OP_SESSION_END) {
      s->detaching = 1;
      LOG_DEBUGF("reader detaching", "job=%s pid=%d", s->job->name, (int)s->pid);
    }
    op->generation = s->job->generation;
    s->refs++;
    s->inflight++;
    reader_submit(s->read_only, op);
    goto out;
  }
  if (op->kind == OP_SESSION_END) {
    s->detaching = 1;
    LOG_INFOF("worker detaching", "job=%s rank=%d pid=%d", s->job->name, s->rank->rank,
              (int)s->pid);
  }
  ipc__submit(s, op);
out:
  if (msg != NULL)
    protobuf_c_message_free_unpacked(msg, NULL);
  close_fds(fds, nfds);
  free(payload);
}
