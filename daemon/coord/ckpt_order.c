/* ckpt_order: the checkpoint orders (coord_ckpt.h). An order is a job's
 * save or restore in flight: it travels to the job's nodes in their
 * Assignments, every rank reports on it in each heartbeat (ShardReport),
 * and the order keeps the latest report of each rank. A job has at most
 * one order at a time, and only while it is ready. This file makes,
 * fails, detaches and frees orders, answers their calls when they fail,
 * checks what an order requires of its job, and says what the orders and
 * exports in flight are reading (a directory they use cannot move or be
 * deleted). Its state is the service's, coord.ckpt; loop thread only. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_ckpt.h"
#include "job_states.h"
#include "log.h"

const char *coord__ckpt_order_noun(const ckpt_order *o) {
  if (o->kind == ORDER_RESTORE)
    return "restore";
  if (o->is_export)
    return "export";
  return o->periodic ? "periodic checkpoint" : "save";
}

int64_t coord__ckpt_elapsed_ms(uint64_t since_ns) {
  return (int64_t)((uv_hrtime() - since_ns) / 1000000);
}

/* The operation an order counts as in the metrics. */
static const char *order_operation(const ckpt_order *o) {
  if (o->memory) /* only restores: the copies are the ranks' (rank/replicate.c) */
    return "memory_restore";
  return o->kind == ORDER_RESTORE ? "restore" : o->is_export ? "export" : "save";
}

/* The job whose order o is, or NULL once it no longer is. */
cjob *coord__ckpt_order_job(const coord *c, const ckpt_order *o) {
  if (!o->attached)
    return NULL;
  cjob *j = coord__find_job(c, o->job);
  return j != NULL && j->ckpt.order == o ? j : NULL;
}

ckpt_order *coord__ckpt_order_new(coord *c, cjob *j, order_kind kind) {
  ckpt_order *o = calloc(1, sizeof *o);
  uint32_t world = j->msg->world_size;
  if (o == NULL || (o->ranks = calloc(world ? world : 1, sizeof *o->ranks)) == NULL) {
    free(o);
    return NULL;
  }
  o->c = c;
  o->kind = kind;
  o->id = c->ckpt.next_id++;
  snprintf(o->job, sizeof o->job, "%s", j->msg->name);
  o->job_id = j->msg->id;
  snprintf(o->tenant, sizeof o->tenant, "%s", j->msg->tenant);
  o->world_size = world;
  o->started_ns = uv_hrtime();
  o->attached = 1;
  j->ckpt.order = o;
  o->next = c->ckpt.orders;
  c->ckpt.orders = o;
  return o;
}

/* Makes o no longer its job's order; a running order leaves the
 * Assignments, which the job's nodes hear at once. */
void coord__ckpt_order_detach(coord *c, ckpt_order *o) {
  cjob *j = coord__ckpt_order_job(c, o);
  o->attached = 0;
  if (j == NULL)
    return;
  j->ckpt.order = NULL;
  if (o->phase == PHASE_RUNNING)
    coord__mark_job_watches(c, j);
}

void coord__ckpt_order_free(coord *c, ckpt_order *o) {
  coord__ckpt_order_detach(c, o);
  for (ckpt_order **p = &c->ckpt.orders; *p != NULL; p = &(*p)->next) {
    if (*p == o) {
      *p = o->next;
      break;
    }
  }
  if (o->call != NULL) {
    rpc_call_set_cancel(o->call, NULL, NULL);
    rpc_call_finish(o->call, RPC_INTERNAL, "checkpoint order dropped", NULL, 0);
  }
  for (uint32_t r = 0; r < o->world_size; r++) {
    free(o->ranks[r].error);
  }
  free(o->ranks);
  free(o->mem_holders);
  free(o->mem_holder_msgs);
  free(o->mem_holder_ptrs);
  free(o->mem_addrs);
  free(o);
}

/* Answers o's call, if it still has one, with an error. */
static void order_answer_error(ckpt_order *o, int status, const char *message) {
  if (o->call == NULL)
    return;
  rpc_call_set_cancel(o->call, NULL, NULL);
  rpc_call_finish(o->call, status, message, NULL, 0);
  o->call = NULL;
}

/* Ends o with an error: answers its call, takes it out of the Assignments
 * (the nodes drop what they did for it), removes a save's temporary
 * directory and, for a periodic save, holds the next attempt back. The
 * checkpoints that exist are never touched. */
void coord__ckpt_order_fail(coord *c, ckpt_order *o, int status, const char *fmt, ...) {
  char message[CKPT_MESSAGE_BYTES];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof message, fmt, ap);
  va_end(ap);
  char quoted[CKPT_MESSAGE_BYTES + 64];
  LOG_WARNF("checkpoint order failed", "job=%s order=%" PRIu64 " kind=%s status=%s err=%s", o->job,
            o->id, coord__ckpt_order_noun(o), rpc_status_name(status),
            log_quote(message, quoted, sizeof quoted));
  coord__metrics_checkpoint(c, order_operation(o), 0, 0, 0);
  order_answer_error(o, status, message);
  cjob *j = coord__ckpt_order_job(c, o);
  if ((o->periodic || o->for_base || o->recovery) && j != NULL)
    j->ckpt.autockpt.retry_ms =
        uv_now(c->loop) + (o->memory ? CKPT_MEM_RETRY_MS : CKPT_AUTO_RETRY_MS);
  if (o->memory && j != NULL)
    j->ckpt.mem_failed_epoch = j->epoch; /* the next try reads the disk */
  if (o->work_in_flight) {
    /* The thread pool still works for it: it is freed when that reports
     * back, and the job may start another order meanwhile. */
    o->abandoned = 1;
    coord__ckpt_order_detach(c, o);
    return;
  }
  if (o->kind == ORDER_SAVE && o->dir[0] != '\0')
    coord__ckpt_remove_tree(c, o->dir, "failed save");
  coord__ckpt_order_free(c, o);
}

/* The lowest rank that reported a failure, or NULL. A report with an
 * error is a failure whether or not it also says done. */
const rank_report *coord__ckpt_first_failure(const ckpt_order *o, uint32_t *rank) {
  for (uint32_t r = 0; r < o->world_size; r++) {
    if (o->ranks[r].failed) {
      *rank = r;
      return &o->ranks[r];
    }
  }
  return NULL;
}

void coord__ckpt_fail_with_rank(coord *c, ckpt_order *o, uint32_t rank, const rank_report *rr) {
  /* A node's code is taken as given if it is an error status; anything
   * else means the node itself got it wrong. */
  int status = rr->code > RPC_OK && rr->code <= RPC_UNAUTHENTICATED ? rr->code : RPC_INTERNAL;
  coord__ckpt_order_fail(
      c, o, status, "rank %u: %s", rank,
      rr->error != NULL ? rr->error : "(its error text was lost: coordinator out of memory)");
}

/* "ranks 1, 3" (at most 8, then "and N more") of the ranks still owed. */
void coord__ckpt_format_pending(const ckpt_order *o, char *out, size_t out_bytes) {
  size_t len = 0, count = 0;
  out[0] = '\0';
  for (uint32_t r = 0; r < o->world_size; r++) {
    const rank_report *rr = &o->ranks[r];
    int pending = o->kind == ORDER_RESTORE && o->restore_msg.commit ? !rr->committed : !rr->done;
    if (!pending)
      continue;
    if (count < 8 && len < out_bytes) {
      int n = snprintf(out + len, out_bytes - len, "%s%u", count ? ", " : "", r);
      if (n > 0)
        len += (size_t)n;
    }
    count++;
  }
  if (count > 8 && len < out_bytes)
    snprintf(out + len, out_bytes - len, " and %zu more", count - 8);
  if (count == 0)
    snprintf(out, out_bytes, "none");
}

void coord__ckpt_on_order_cancelled(rpc_call *call, void *arg) {
  ckpt_order *o = arg;
  coord *c = o->c;
  int deadline = rpc_call_remaining_ms(call) <= 0;
  int past_return =
      o->phase == PHASE_COMMITTING ||
      (o->kind == ORDER_RESTORE && o->phase == PHASE_RUNNING && o->restore_msg.commit);
  if (!past_return) {
    coord__ckpt_order_fail(c, o, deadline ? RPC_DEADLINE_EXCEEDED : RPC_CANCELLED, "%s",
                           deadline ? "the call's deadline passed"
                                    : "the client cancelled the call");
    return;
  }
  /* Every rank has done its part (a save being committed) or is installing
   * the restored state: the order completes without its caller. gRPC has
   * already ended the call; this only frees it. */
  LOG_INFOF("checkpoint caller went away; the order completes", "job=%s order=%" PRIu64 " kind=%s",
            o->job, o->id, coord__ckpt_order_noun(o));
  o->call = NULL;
  rpc_call_finish(call, deadline ? RPC_DEADLINE_EXCEEDED : RPC_CANCELLED, "call ended", NULL, 0);
}

/* What Save and Restore require of the job: that the coordinator has a
 * checkpoint directory, that the job exists, is ready and has no order in
 * flight. Returns 0 with the job, or a status with the reason in err. */
int coord__ckpt_order_precheck(coord *c, const char *name, cjob **out, char *err,
                               size_t err_bytes) {
  if (c->options.checkpoint_dir[0] == '\0') {
    snprintf(err, err_bytes, "this coordinator has no checkpoint directory");
    return RPC_FAILED_PRECONDITION;
  }
  cjob *j = coord__find_job(c, name);
  if (j == NULL || j->deleting) {
    snprintf(err, err_bytes, j == NULL ? "no job named '%s'" : "job '%s' is being deleted", name);
    return RPC_NOT_FOUND;
  }
  if (j->ckpt.order != NULL) {
    snprintf(err, err_bytes,
             "job '%s' has a %s in flight (order %" PRIu64 "); retry when it is done", name,
             coord__ckpt_order_noun(j->ckpt.order), j->ckpt.order->id);
    return RPC_FAILED_PRECONDITION;
  }
  if (j->state != ZEROD__V1__JOB_STATE__JOB_STATE_READY) {
    snprintf(err, err_bytes, "job '%s' is not ready (%s: %s)", name, zd_job_state_word(j->state),
             j->reason);
    return RPC_FAILED_PRECONDITION;
  }
  *out = j;
  return 0;
}

/* The deadline of an order: the call's, at most --checkpoint-timeout. */
void coord__ckpt_order_set_deadline(const coord *c, ckpt_order *o, rpc_call *call) {
  int64_t limit = c->options.checkpoint_timeout_ms > 0 ? c->options.checkpoint_timeout_ms
                                                       : CKPT_DEFAULT_TIMEOUT_MS;
  if (call != NULL) {
    int64_t remaining = rpc_call_remaining_ms(call);
    if (remaining < limit)
      limit = remaining;
  }
  o->timeout_ms = limit > 0 ? limit : 0;
  o->deadline_ms = uv_now(c->loop) + (uint64_t)o->timeout_ms;
}

/* The export in flight that reads path, or NULL. */
const export_work *coord__ckpt_export_reading(const coord *c, const char *path) {
  for (const export_work *w = c->ckpt.exports; w != NULL; w = w->next)
    if (strcmp(w->source, path) == 0)
      return w;
  return NULL;
}

int coord__ckpt_dir_busy(const coord *c, const char *path) {
  for (const ckpt_order *o = c->ckpt.orders; o != NULL; o = o->next)
    if (o->dir[0] != '\0' && coord__ckpt_path_below(o->dir, path))
      return 1;
  for (const export_work *w = c->ckpt.exports; w != NULL; w = w->next)
    if (coord__ckpt_path_below(w->source, path))
      return 1;
  return 0;
}

void coord__ckpt_record_report(rank_report *rr, const Zerod__V1__ShardReport *r) {
  rr->done = r->done;
  rr->committed = r->committed;
  rr->failed = r->error[0] != '\0';
  rr->code = r->code;
  if (rr->error == NULL || strcmp(rr->error, r->error) != 0) {
    free(rr->error);
    rr->error = rr->failed ? strdup(r->error) : NULL;
  }
  rr->step = r->step;
  rr->bytes = r->bytes;
  rr->xxh64 = r->xxh64;
  rr->stall_ms = r->stall_ms;
  snprintf(rr->file, sizeof rr->file, "%s", r->file);
}

/* The restore in flight that reads path, or NULL. */
const ckpt_order *coord__ckpt_restore_reading(const coord *c, const char *path) {
  for (const ckpt_order *o = c->ckpt.orders; o != NULL; o = o->next)
    if (o->kind == ORDER_RESTORE && !o->abandoned && strcmp(o->dir, path) == 0)
      return o;
  return NULL;
}
