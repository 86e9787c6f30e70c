/* follow_fetch: a mirror's thread (follow.h): where the job is, the
 * connection to the node hosting it, and each version fetched into the
 * mirror's one-rank job.
 *
 * The far side is an ordinary read-only session (follow_relay.c), so the
 * thread speaks the IPC protocol: ATTACH (read-only, pinned, with the
 * token of the attach that started the mirror), then WATCH for a version
 * above the one installed, UNITS for units it has not seen, and a delta
 * GATHER and a RELEASE per changed unit. A version is installed as a
 * rank's executor writes one (pin.h): the changed units marked, the rank's
 * version moved to the upstream version's number under its write lock,
 * the blocks written, the lock let go. Sessions pinned at older versions
 * read the copies pin_begin_write_to took; the first version is written
 * before any session can attach. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ckpt_call.h"
#include "clock.h"
#include "config.h"
#include "ctl_decode.h"
#include "daemon.h"
#include "little_endian.h"
#include "log.h"
#include "pin.h"
#include "replica_net.h"
#include "replica_net_impl.h"
#include "rpc.h"
#include "zerod/v1/control.pb-c.h"

#include "follow_impl.h"

/* Each wait on the far side (a WATCH waits FETCH_WATCH_MS of it). */
#define FETCH_TIMEOUT_MS (FOLLOW_MAX_WATCH_MS + 30000)
#define FETCH_WATCH_MS   1000
#define LOCATE_MS        10000

/* A failure: status (Zerod__V1__Status) and the reason, into the mirror. */
static int fail(mirror *m, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(mirror *m, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m->message, sizeof m->message, fmt, ap);
  va_end(ap);
  m->status = status;
  return -1;
}

/* Where the job is: the coordinator's LocateJob, with the token. */
static int locate(mirror *m, char *addr, size_t addr_bytes) {
  Zerod__V1__LocateJobRequest req = ZEROD__V1__LOCATE_JOB_REQUEST__INIT;
  req.name = m->name;
  req.token = m->token;
  uint8_t buf[512];
  size_t len = zerod__v1__locate_job_request__pack(&req, buf);
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result = {0};
  int rc = rpc_unary(m->d->control_channel, CTL_LOCATE_JOB, buf, len, LOCATE_MS, &reply,
                     &reply_bytes, &result);
  if (rc != RPC_OK)
    return fail(m, ckpt_call_ipc_status(rc),
                "job '%s' is not on this node, and the coordinator "
                "cannot say where to follow it from: %s",
                m->name, result.message);
  Zerod__V1__LocateJobReply *r = zerod__v1__locate_job_reply__unpack(NULL, reply_bytes, reply);
  free(reply);
  if (r == NULL || r->replica_address[0] == '\0' || strlen(r->replica_address) >= addr_bytes) {
    if (r != NULL)
      zerod__v1__locate_job_reply__free_unpacked(r, NULL);
    return fail(m, ZEROD__V1__STATUS__STATUS_INTERNAL, "the coordinator's LocateJob reply is bad");
  }
  snprintf(addr, addr_bytes, "%s", r->replica_address);
  snprintf(m->upstream, sizeof m->upstream, "node '%.64s' (%.200s)", r->node, r->replica_address);
  zerod__v1__locate_job_reply__free_unpacked(r, NULL);
  return 0;
}

/* Sends a request to the far side; its id in *id. */
static int send_request(mirror *m, uint16_t type, const ProtobufCMessage *msg, uint64_t *id) {
  *id = ++m->next_request;
  int rc = zd_frame_send(atomic_load(&m->fd), type, *id, 0, msg, NULL, 0, FETCH_TIMEOUT_MS);
  return rc == 0 ? 0
                 : fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "lost %s: %s", m->upstream,
                        strerror(-rc));
}

/* The reply to request id, the next frame (the far side answers a
 * session's requests in order): of reply_type, or an Error, which fails
 * the mirror with the far side's status and message. */
static int recv_reply(mirror *m, uint64_t id, uint16_t reply_type, ProtobufCMessage **out) {
  const char *why = "closed";
  zd_frame_header h;
  uint8_t *payload;
  int got = zd_frame_read_plain(&m->reader, atomic_load(&m->fd), &h, &payload, &why);
  if (got <= 0)
    return fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "lost %s: %s", m->upstream,
                got == 0 ? "it stopped answering" : why);
  ProtobufCMessage *reply = NULL;
  const char *bad = NULL;
  int unpacked = zd_msg_unpack(h.type, payload, h.payload_bytes, &reply, &bad);
  free(payload);
  if (unpacked != 0)
    return fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "%s sent a bad frame: %s", m->upstream,
                bad);
  int rc = 0;
  if (h.type == ZEROD__V1__MSG_TYPE__MSG_NOTICE)
    rc = fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "%s is shutting down", m->upstream);
  else if (h.type == ZEROD__V1__MSG_TYPE__MSG_ERROR && h.request_id == id)
    rc = fail(m, ((Zerod__V1__Error *)reply)->status, "%s (from %s)",
              ((Zerod__V1__Error *)reply)->message, m->upstream);
  else if (h.type != reply_type || h.request_id != id)
    rc = fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE,
              "%s answered request %" PRIu64 " with message type %u for request %" PRIu64,
              m->upstream, id, h.type, h.request_id);
  if (rc != 0) {
    protobuf_c_message_free_unpacked(reply, NULL);
    return rc;
  }
  *out = reply;
  return 0;
}

/* One request to the far side and its reply. */
static int call(mirror *m, uint16_t type, const ProtobufCMessage *msg, uint16_t reply_type,
                ProtobufCMessage **out) {
  uint64_t id;
  return send_request(m, type, msg, &id) != 0 ? -1 : recv_reply(m, id, reply_type, out);
}

/* ATTACH upstream; the mirror's job is made with the job's config. */
static int attach(mirror *m) {
  Zerod__V1__AttachRequest req = ZEROD__V1__ATTACH_REQUEST__INIT;
  req.protocol_version = 1;
  req.job = m->name;
  req.token = m->token;
  req.mode = ZEROD__V1__ATTACH_MODE__ATTACH_READ_ONLY;
  req.pin = 1;
  ProtobufCMessage *reply;
  if (call(m, ZEROD__V1__MSG_TYPE__MSG_ATTACH, &req.base, ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY,
           &reply) != 0)
    return -1;
  Zerod__V1__AttachReply *a = (Zerod__V1__AttachReply *)reply;
  job_config config;
  char err[512] = "";
  int rc = job_config_from_proto(a->config, &config, err, sizeof err);
  if (rc == 0)
    rc = job_config_finish(&config, m->d->options.max_live_bytes, err, sizeof err);
  uint64_t id = a->job_id;
  protobuf_c_message_free_unpacked(reply, NULL);
  if (rc != 0)
    return fail(m, ZEROD__V1__STATUS__STATUS_INTERNAL,
                "job '%s' of %s has a config this node "
                "cannot take: %s",
                m->name, m->upstream, err);
  job *j;
  if (job_create(&m->d->exec, NULL, m->name, m->token_sha256, &config, 1, 1, 0, id, &j) != 0)
    return fail(m, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
  m->j = j;
  rank_state *rs = &j->ranks[0];
  if (zk_pool_create(1, &rs->pool) != 0 || device_host_open(rs->pool, &rs->dev) != 0)
    return fail(m, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
  return 0;
}

/* A unit of the far side's UNITS reply as a local layout (one rank), whose
 * tensors must sit where they sit there. NULL with the mirror failed. */
static unit_layout *layout_of(mirror *m, const Zerod__V1__RegisterUnitReply *u) {
  tensor_specs specs;
  if (tensor_specs_init(&specs, (unsigned)u->n_tensors) != 0) {
    fail(m, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return NULL;
  }
  for (size_t t = 0; t < u->n_tensors; t++) {
    specs.names[t] = u->tensors[t]->name;
    specs.shapes[t] = u->tensors[t]->shape;
    specs.ndims[t] = (unsigned)u->tensors[t]->n_shape;
  }
  unit_layout *l = NULL;
  char err[512] = "";
  int rc = unit_layout_build_specs(u->name, &specs, 1, 0, &l, err, sizeof err);
  tensor_specs_free(&specs);
  for (size_t t = 0; rc == 0 && t < u->n_tensors; t++)
    if (l->tensors[t].offset != u->tensors[t]->offset)
      rc = -EPROTO;
  if (rc == 0 && l->padded_numel > u->padded_numel)
    rc = -EPROTO;
  if (rc != 0) {
    unit_layout_free(l);
    fail(m, ZEROD__V1__STATUS__STATUS_INTERNAL,
         "unit '%s' of job '%s' is laid out in a way this "
         "node cannot follow: %s",
         u->name, m->name, rc == -EPROTO ? "tensor offsets differ" : err);
    return NULL;
  }
  return l;
}

/* The local layout of upstream unit up, or NULL when not seen yet. */
static unit_layout *known(const mirror *m, uint32_t up) {
  return up < m->nunits ? m->units[up].layout : NULL;
}

/* The layouts of the upstream units in ids[] that the mirror lacks, from
 * UNITS, into fresh[] (by upstream id, NULL where known). */
static int learn_units(mirror *m, const uint32_t *ids, size_t n, unit_layout **fresh) {
  int need = 0;
  for (size_t i = 0; i < n; i++)
    need |= known(m, ids[i]) == NULL;
  if (!need)
    return 0;
  Zerod__V1__UnitsRequest req = ZEROD__V1__UNITS_REQUEST__INIT;
  ProtobufCMessage *reply;
  if (call(m, ZEROD__V1__MSG_TYPE__MSG_UNITS, &req.base, ZEROD__V1__MSG_TYPE__MSG_UNITS_REPLY,
           &reply) != 0)
    return -1;
  Zerod__V1__UnitsReply *r = (Zerod__V1__UnitsReply *)reply;
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    if (known(m, ids[i]) != NULL)
      continue;
    const Zerod__V1__RegisterUnitReply *u = NULL;
    for (size_t k = 0; k < r->n_units && u == NULL; k++)
      u = r->units[k]->unit_id == ids[i] ? r->units[k] : NULL;
    if (u == NULL)
      rc = fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE,
                "%s listed unit %u but has no such "
                "unit",
                m->upstream, ids[i]);
    else if ((fresh[i] = layout_of(m, u)) == NULL)
      rc = -1;
  }
  protobuf_c_message_free_unpacked(reply, NULL);
  return rc;
}

/* Makes room in the mirror's tables and the rank's shard table for
 * upstream unit up (write lock held). */
static int grow(mirror *m, uint32_t up, uint32_t local) {
  if (up >= m->nunits) {
    uint32_t cap = up + 16;
    struct mirror_unit *units = realloc(m->units, cap * sizeof *units);
    if (units == NULL)
      return -ENOMEM;
    for (uint32_t u = m->nunits; u < cap; u++)
      units[u] = (struct mirror_unit){.layout = NULL, .version = UINT64_MAX};
    m->units = units;
    m->nunits = cap;
  }
  rank_state *rs = &m->j->ranks[0];
  if (local >= rs->nshards) {
    uint32_t cap = local + 16;
    shard *grown = realloc(rs->shards, cap * sizeof *grown);
    if (grown == NULL)
      return -ENOMEM;
    memset(grown + rs->nshards, 0, (cap - rs->nshards) * sizeof *grown);
    rs->shards = grown;
    rs->nshards = cap;
  }
  return 0;
}

/* Publishes a new unit in the mirror's job with a zeroed working copy
 * (write lock held; the unit becomes readable once written). */
static unit_layout *add_unit(mirror *m, uint32_t up, unit_layout *fresh, uint64_t version) {
  int existed = 0, conflict = 0;
  unit_layout *l = job_publish_unit(m->j, fresh, &existed, &conflict);
  if (l == NULL || existed) {
    fail(m, ZEROD__V1__STATUS__STATUS_INTERNAL,
         "unit %u of job '%s' conflicts with another of "
         "the same name",
         up, m->name);
    return NULL;
  }
  size_t bytes = l->padded_numel * zk_dtype_size(m->j->config.working_dtype);
  rank_state *rs = &m->j->ranks[0];
  void *working = NULL;
  if (grow(m, up, l->id) != 0 || device_alloc(rs->dev, bytes ? bytes : 1, &working) != 0) {
    fail(m, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
         "out of memory for unit '%s' (%zu "
         "bytes)",
         l->name, bytes);
    return NULL;
  }
  memset(working, 0, bytes);
  shard *sh = &rs->shards[l->id];
  sh->present = 1;
  sh->working = working;
  sh->gather_buf = sh->grad_buf = sh->secondary_buf = -1;
  atomic_store(&l->changed_version, version);
  m->units[up].layout = l;
  return l;
}

/* Raw bytes after a frame: those the frame reader read ahead, then the
 * socket's. */
static int recv_raw(mirror *m, void *dst, size_t n) {
  size_t got = zd_frame_reader_take_bytes(&m->reader, dst, n);
  return got == n ? 0 : replica__recv_all(atomic_load(&m->fd), (uint8_t *)dst + got, n - got);
}

/* Receives n bytes of the gather into dst (the first `keep` of them; the
 * rest, padding of the far side's wider world, are dropped). */
static int recv_part(mirror *m, uint8_t *dst, size_t n, size_t keep) {
  int rc = recv_raw(m, dst, keep < n ? keep : n);
  uint8_t sink[4096];
  for (size_t left = keep < n ? n - keep : 0; rc == 0 && left > 0;) {
    size_t k = left < sizeof sink ? left : sizeof sink;
    rc = recv_raw(m, sink, k);
    left -= k;
  }
  return rc;
}

/* The bytes after a GatherReply into the unit's working copy: the blocks
 * a delta wrote, or the whole buffer. */
static int recv_gathered(mirror *m, const Zerod__V1__GatherReply *g, uint8_t *working,
                         size_t bytes) {
  uint64_t expect = follow_gathered_bytes(g);
  m->fetched += expect;
  uint8_t length[8];
  int rc = recv_raw(m, length, sizeof length);
  if (rc == 0 && le_get64(length) != expect)
    return fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE,
                "%s sent %" PRIu64 " bytes of a gather, %" PRIu64 " expected", m->upstream,
                le_get64(length), expect);
  for (size_t b = 0, at, n; rc == 0 && b < follow_nblocks(g); b++)
    if ((n = follow_block_span(g, b, &at)) > 0)
      rc = recv_part(m, working + (at < bytes ? at : bytes), n, at < bytes ? bytes - at : 0);
  if (rc != 0)
    return fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "lost %s in a gather: %s", m->upstream,
                strerror(-rc));
  return 0;
}

/* The reply to a delta gather of upstream unit up and its bytes, into the
 * unit's working copy. */
static int finish_gather(mirror *m, uint64_t id, uint32_t up, uint64_t version) {
  unit_layout *l = m->units[up].layout;
  ProtobufCMessage *reply;
  if (recv_reply(m, id, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, &reply) != 0)
    return -1;
  Zerod__V1__GatherReply *g = (Zerod__V1__GatherReply *)reply;
  size_t bytes = l->padded_numel * zk_dtype_size(m->j->config.working_dtype);
  int rc = 0;
  if (g->unit_id != up || g->version != version ||
      (g->delta && g->delta_from != m->units[up].version) || g->buffer_bytes < bytes ||
      g->buffer_bytes > bytes + (64u << 20))
    rc = fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE,
              "%s answered a gather of unit '%s' out of step (version %" PRIu64 ", %" PRIu64
              " expected)",
              m->upstream, l->name, g->version, version);
  if (rc == 0)
    rc = recv_gathered(m, g, m->j->ranks[0].shards[l->id].working, bytes);
  protobuf_c_message_free_unpacked(reply, NULL);
  if (rc == 0)
    m->units[up].version = version;
  return rc;
}

/* A request in flight to the far side: a gather or a release of a unit. */
typedef struct in_flight {
  uint64_t id;
  uint32_t up;
  int release;
} in_flight;

static int send_unit_request(mirror *m, uint32_t up, int release, in_flight *slot) {
  Zerod__V1__GatherRequest gather = ZEROD__V1__GATHER_REQUEST__INIT;
  Zerod__V1__ReleaseRequest rel = ZEROD__V1__RELEASE_REQUEST__INIT;
  gather.unit_id = rel.unit_id = up;
  gather.delta = 1;
  *slot = (in_flight){.up = up, .release = release};
  return release ? send_request(m, ZEROD__V1__MSG_TYPE__MSG_RELEASE, &rel.base, &slot->id)
                 : send_request(m, ZEROD__V1__MSG_TYPE__MSG_GATHER, &gather.base, &slot->id);
}

/* Whether two of these units fit the far session's max_live_bytes at once
 * (the gather of the next is then in flight while this one's bytes come). */
static int window_of(mirror *m, const uint32_t *ups, size_t n) {
  uint64_t largest = 0;
  for (size_t i = 0; i < n; i++)
    if (m->units[ups[i]].layout->padded_numel > largest)
      largest = m->units[ups[i]].layout->padded_numel;
  uint64_t bytes = largest * zk_dtype_size(m->j->config.working_dtype) + (64u << 10);
  return 2 * bytes <= m->j->config.max_live_bytes ? 2 : 1;
}

/* The changed units ups[n] of version: delta gathers, each unit's next
 * gather sent before its bytes are read, each released once read. */
static int fetch_units(mirror *m, const uint32_t *ups, size_t n, uint64_t version) {
  in_flight *queue = calloc(2 * n + 1, sizeof *queue);
  if (queue == NULL)
    return fail(m, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
  size_t head = 0, tail = 0, sent = 0;
  int window = window_of(m, ups, n), rc = 0;
  while (rc == 0 && sent < n && (int)sent < window)
    rc = send_unit_request(m, ups[sent++], 0, &queue[tail++]);
  while (rc == 0 && head < tail) {
    in_flight f = queue[head++];
    if (f.release) {
      ProtobufCMessage *reply;
      rc = recv_reply(m, f.id, ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY, &reply);
      if (rc == 0)
        protobuf_c_message_free_unpacked(reply, NULL);
      continue;
    }
    rc = finish_gather(m, f.id, f.up, version);
    if (rc == 0)
      atomic_store(&m->units[f.up].layout->ready_ranks, 1);
    if (rc == 0)
      rc = send_unit_request(m, f.up, 1, &queue[tail++]);
    if (rc == 0 && sent < n)
      rc = send_unit_request(m, ups[sent++], 0, &queue[tail++]);
  }
  free(queue);
  return rc;
}

/* The write of one version: new units published, changed ones fetched,
 * the step taken; the rank's write lock held unless first (no session can
 * read the mirror yet). */
static int install(mirror *m, const Zerod__V1__WatchVersionReply *w, unit_layout **fresh,
                   int first) {
  rank_state *rs = &m->j->ranks[0];
  for (size_t i = 0; i < w->n_changed_units; i++)
    if (fresh[i] == NULL)
      pin_mark_changed_at(m->units[w->changed_units[i]].layout, w->version);
  if (!first)
    pin_begin_write_to(rs, w->version);
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < w->n_changed_units; i++) {
    if (fresh[i] != NULL && add_unit(m, w->changed_units[i], fresh[i], w->version) == NULL)
      rc = -1;
    fresh[i] = NULL; /* published, or freed by job_publish_unit */
  }
  if (rc == 0)
    rc = fetch_units(m, w->changed_units, w->n_changed_units, w->version);
  atomic_store(&rs->step, w->step);
  if (first)
    pin_start_at(rs, w->version);
  if (rc != 0)
    job_fail(m->j, m->j->generation, "following job '%s' from %s failed: %s", m->name, m->upstream,
             m->message);
  if (!first)
    pin_end_write(rs);
  return rc;
}

/* Waits for a version above the mirror's (or, first, any) and installs
 * it. 0 when one was installed or the wait timed out. */
static int fetch_version(mirror *m, int first) {
  Zerod__V1__WatchVersionRequest req = ZEROD__V1__WATCH_VERSION_REQUEST__INIT;
  req.after_version = first ? UINT64_MAX : atomic_load(&m->j->latest_version);
  req.timeout_ms = first ? 0 : FETCH_WATCH_MS;
  ProtobufCMessage *reply;
  if (call(m, ZEROD__V1__MSG_TYPE__MSG_WATCH, &req.base, ZEROD__V1__MSG_TYPE__MSG_WATCH_REPLY,
           &reply) != 0)
    return -1;
  Zerod__V1__WatchVersionReply *w = (Zerod__V1__WatchVersionReply *)reply;
  unit_layout **fresh = calloc(w->n_changed_units + 1, sizeof *fresh);
  m->fetched = 0;
  int64_t t0 = clock_now_ms();
  int rc = 0;
  if (w->timed_out)
    rc = 0;
  else if (fresh == NULL)
    rc = fail(m, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
  else if (!first && w->version <= atomic_load(&m->j->latest_version))
    rc = fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "%s went back to version %" PRIu64,
              m->upstream, w->version);
  else if ((rc = learn_units(m, w->changed_units, w->n_changed_units, fresh)) == 0)
    rc = install(m, w, fresh, first);
  for (size_t i = 0; fresh != NULL && i < w->n_changed_units; i++)
    unit_layout_free(fresh[i]);
  free(fresh);
  if (rc == 0 && !w->timed_out && !first)
    uv_async_send(m->wake); /* the node's watches see the version now */
  if (rc == 0 && !w->timed_out)
    LOG_DEBUGF("follower installed a version", "job=%s version=%llu units=%zu bytes=%llu ms=%lld",
               m->name, (unsigned long long)w->version, w->n_changed_units,
               (unsigned long long)m->fetched, (long long)(clock_now_ms() - t0));
  protobuf_c_message_free_unpacked(reply, NULL);
  return rc;
}

static void set_state(mirror *m, mirror_state state) {
  atomic_store(&m->state, state);
  uv_async_send(m->wake);
}

void *follow__main(void *arg) {
  mirror *m = arg;
  char addr[300];
  int fd = -1;
  zd_frame_reader_init(&m->reader);
  int rc = locate(m, addr, sizeof addr);
  if (rc == 0) {
    char err[512] = "";
    int orc = replica_follow_open(addr, FETCH_TIMEOUT_MS, &fd, err, sizeof err);
    if (orc != 0)
      rc = fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "cannot follow job '%s' from %s: %s",
                m->name, m->upstream, err);
  }
  if (rc == 0) {
    atomic_store(&m->fd, fd);
    if (atomic_load(&m->stop)) /* stopped while connecting: follow_stop missed the fd */
      shutdown(fd, SHUT_RDWR);
    rc = attach(m);
  }
  if (rc == 0)
    rc = fetch_version(m, 1);
  if (rc == 0) {
    LOG_INFOF("following a job", "job=%s from=\"%s\" version=%llu", m->name, m->upstream,
              (unsigned long long)atomic_load(&m->j->latest_version));
    set_state(m, MIRROR_READY);
    while (rc == 0 && !atomic_load(&m->stop))
      rc = fetch_version(m, 0);
  }
  if (atomic_load(&m->stop) && rc != 0)
    fail(m, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "this node stopped following job '%s'", m->name);
  if (rc != 0 && m->j != NULL)
    job_fail(m->j, m->j->generation, "following job '%s' from %s failed: %s", m->name,
             m->upstream[0] ? m->upstream : "its node", m->message);
  if (rc != 0 && !atomic_load(&m->stop))
    LOG_WARNF("following a job failed", "job=%s reason=\"%s\"", m->name, m->message);
  zd_frame_reader_reset(&m->reader);
  set_state(m, MIRROR_FAILED);
  return NULL;
}

void follow__mirror_free(mirror *m) {
  int fd = atomic_exchange(&m->fd, -1);
  if (fd >= 0)
    close(fd);
  job *j = m->j;
  if (j != NULL) {
    rank_state *rs = &j->ranks[0];
    for (uint32_t u = 0; u < rs->nshards; u++)
      if (rs->shards[u].present)
        device_free(rs->dev, rs->shards[u].working);
    free(rs->shards);
    rs->shards = NULL;
    rs->nshards = 0;
    if (rs->dev != NULL)
      device_close(rs->dev);
    if (rs->pool != NULL)
      zk_pool_destroy(rs->pool);
    rs->dev = NULL;
    rs->pool = NULL;
    pin_job_clear(j);
    job_destroy(j);
  }
  free(m->units);
  free(m);
}
