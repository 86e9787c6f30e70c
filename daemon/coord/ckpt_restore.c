/* ckpt_restore: Restore (coord_ckpt.h; docs/checkpoints.md). A restore
 * is an order in two phases. Before anything is ordered, the source (a
 * checkpoint directory, or a .safetensors file of weights) is checked on
 * the thread pool: it exists, the caller may read it, its files have the
 * sizes its manifest says. Then the order goes to the job's nodes: every
 * rank reads and checks what it will own (phase 1); once all succeeded
 * the order says commit, and every rank installs it (phase 2). The job is
 * busy from the Restore call on: no Save or other Restore meanwhile, and
 * the source cannot be deleted. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "coord_ckpt.h"
#include "ctl_decode.h"
#include "log.h"

/* The checks of a restore's source before anything is ordered. */
typedef struct preflight_work {
  ckpt_work base;
  ckpt_order *order;
  char source[PATH_MAX];
  ckpt_access access; /* who may read what (ckpt_owner.c) */
  /* Out */
  work_result result;
  Zerod__V1__RestoreFormat format;
  uint64_t step;
  uint32_t world_size;
} preflight_work;

static void preflight_run(ckpt_work *base) {
  preflight_work *w = (preflight_work *)base;
  struct stat st;
  w->result.status = 0;
  if (coord__ckpt_stat_source(w->source, &st, &w->result) != 0)
    return;
  if (S_ISDIR(st.st_mode)) {
    if (coord__ckpt_check_dir(w->source, &w->access, &w->step, &w->world_size, &w->result) == 0)
      w->format = ZEROD__V1__RESTORE_FORMAT__RESTORE_FORMAT_CHECKPOINT;
    return;
  }
  if (!S_ISREG(st.st_mode) || !coord__ckpt_ends_with(w->source, ".safetensors")) {
    coord__ckpt_work_fail(&w->result, RPC_INVALID_ARGUMENT,
                          "%s is neither a checkpoint directory nor a .safetensors file",
                          w->source);
    return;
  }
  /* Weights only. The header is read here so that a file that is not
   * safetensors fails now, not on every rank. */
  st_file f;
  int fd = -1;
  char err[CKPT_MESSAGE_BYTES - 64];
  int rc = st_open(w->source, &f, &fd, err, sizeof err);
  if (rc != 0) {
    if (rc == -EACCES)
      coord__ckpt_work_fail(&w->result, RPC_PERMISSION_DENIED, "cannot read %s: %s", w->source,
                            strerror(-rc));
    else
      coord__ckpt_work_fail(&w->result, rc == -EIO ? RPC_UNAVAILABLE : RPC_DATA_LOSS, "%s", err);
    return;
  }
  st_file_free(&f);
  close(fd);
  w->format = ZEROD__V1__RESTORE_FORMAT__RESTORE_FORMAT_SAFETENSORS;
}

static void preflight_done(ckpt_work *base) {
  preflight_work *w = (preflight_work *)base;
  ckpt_order *o = w->order;
  coord *c = o->c;
  o->work_in_flight = 0;
  cjob *j = coord__ckpt_order_job(c, o);
  if (o->abandoned) {
    coord__ckpt_order_free(c, o); /* already answered */
  } else if (w->result.status != 0) {
    coord__ckpt_order_fail(c, o, w->result.status, "%s", w->result.message);
  } else if (j == NULL) {
    coord__ckpt_order_fail(c, o, RPC_NOT_FOUND, "job '%s' is gone", o->job);
  } else {
    zerod__v1__restore_order__init(&o->restore_msg);
    o->restore_msg.id = o->id;
    o->restore_msg.source = o->dir;
    o->restore_msg.format = w->format;
    o->restore_msg.commit = 0;
    o->phase = PHASE_RUNNING;
    if (w->format == ZEROD__V1__RESTORE_FORMAT__RESTORE_FORMAT_CHECKPOINT)
      LOG_INFOF("checkpoint restore started",
                "job=%s order=%" PRIu64 " source=%s step=%" PRIu64 " saved_world_size=%u", o->job,
                o->id, o->dir, w->step, w->world_size);
    else
      LOG_INFOF("checkpoint restore started",
                "job=%s order=%" PRIu64 " source=%s format=safetensors", o->job, o->id, o->dir);
    coord__mark_job_watches(c, j);
  }
  coord__ckpt_access_free(&w->access);
  free(w);
}

void coord__ckpt_restore_progress(coord *c, ckpt_order *o) {
  uint32_t rank;
  const rank_report *failed = coord__ckpt_first_failure(o, &rank);
  if (failed != NULL) {
    coord__ckpt_fail_with_rank(c, o, rank, failed);
    return;
  }
  if (!o->restore_msg.commit) {
    for (uint32_t r = 0; r < o->world_size; r++)
      if (!o->ranks[r].done)
        return;
    /* Every rank holds what it will own, checked: now they may install it. */
    o->restore_msg.commit = 1;
    cjob *j = coord__ckpt_order_job(c, o);
    if (j != NULL)
      coord__mark_job_watches(c, j);
    LOG_INFOF("checkpoint restore read; committing", "job=%s order=%" PRIu64, o->job, o->id);
    return;
  }
  for (uint32_t r = 0; r < o->world_size; r++)
    if (!o->ranks[r].committed)
      return;
  uint64_t step = o->ranks[0].step;
  for (uint32_t r = 1; r < o->world_size; r++)
    if (o->ranks[r].step != step)
      LOG_WARNF("ranks restored different steps",
                "job=%s order=%" PRIu64 " rank0=%" PRIu64 " rank=%u step=%" PRIu64, o->job, o->id,
                step, r, o->ranks[r].step);
  int64_t total_ms = coord__ckpt_elapsed_ms(o->started_ns);
  LOG_INFOF("checkpoint restored",
            "job=%s order=%" PRIu64 " source=%s step=%" PRIu64 " total_ms=%" PRId64, o->job, o->id,
            o->dir, step, total_ms);
  coord__metrics_checkpoint(c, o->memory ? "memory_restore" : "restore", 1, (double)total_ms / 1e3,
                            0);
  cjob *j = coord__ckpt_order_job(c, o);
  if (j != NULL) {
    /* The job is at the restored step now (its nodes' next reports say so
     * too), and the periodic schedule counts from there. */
    j->step = step;
    j->ckpt.autockpt.last_step = step;
    j->ckpt.autockpt.last_ms = uv_now(c->loop);
    if (o->recovery) /* settled at the next tick (ckpt_recover.c) */
      j->ckpt.recovery_restored = 1;
  }
  if (o->call != NULL) {
    Zerod__V1__RestoreReply reply = ZEROD__V1__RESTORE_REPLY__INIT;
    reply.step = step;
    reply.total_ms = total_ms;
    rpc_call_set_cancel(o->call, NULL, NULL);
    coord__finish_message(o->call, &reply.base);
    o->call = NULL;
  }
  coord__ckpt_order_free(c, o);
}

int coord__ckpt_restore_start(coord *c, cjob *j, const char *source, rpc_call *call,
                              const coord_caller *who, char *err, size_t err_bytes) {
  ckpt_order *o = coord__ckpt_order_new(c, j, ORDER_RESTORE);
  preflight_work *w = calloc(1, sizeof *w);
  if (o == NULL || w == NULL || coord__ckpt_access(c, who, j, &w->access) != 0) {
    if (o != NULL)
      coord__ckpt_order_free(c, o);
    if (w != NULL)
      coord__ckpt_access_free(&w->access);
    free(w);
    snprintf(err, err_bytes, "coordinator out of memory");
    return RPC_RESOURCE_EXHAUSTED;
  }
  /* The job is busy from now on: a Save or another Restore is refused
   * while the source is checked, and the source cannot be deleted. */
  snprintf(o->dir, sizeof o->dir, "%s", source);
  o->phase = PHASE_PREPARING;
  coord__ckpt_order_set_deadline(c, o, call);
  o->work_in_flight = 1;
  if (call != NULL) {
    o->call = call;
    rpc_call_set_cancel(call, coord__ckpt_on_order_cancelled, o);
  }
  w->base.run = preflight_run;
  w->base.done = preflight_done;
  w->order = o;
  snprintf(w->source, sizeof w->source, "%s", source);
  coord__ckpt_queue_work(c, &w->base);
  return 0;
}

static void on_restore(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  coord_caller who;
  Zerod__V1__RestoreRequest *req =
      coord__begin_as(c, call, CTL_RESTORE, request, request_bytes, &who);
  if (req == NULL)
    return;
  char err[PATH_MAX + 256];
  char source[PATH_MAX];
  cjob *j = NULL;
  int status = coord__ckpt_order_precheck(c, req->job, &j, err, sizeof err);
  if (status == 0 && j->msg->frozen) {
    /* Jobs on the base read its shards as they are (docs/bases.md). */
    snprintf(err, sizeof err,
             "job '%s' is a frozen base: its state no longer changes (restore into a new job "
             "and freeze that)",
             req->job);
    status = RPC_FAILED_PRECONDITION;
  }
  if (status == 0)
    status = coord__ckpt_resolve_source(c, req->job, req->checkpoint, source, sizeof source, err,
                                        sizeof err);
  if (status == 0 && rpc_call_remaining_ms(call) <= 0) {
    snprintf(err, sizeof err, "the call's deadline passed before the restore began");
    status = RPC_DEADLINE_EXCEEDED;
  }
  if (status == 0)
    status = coord__ckpt_restore_start(c, j, source, call, &who, err, sizeof err);
  if (status != 0)
    coord__finish_error(call, status, "%s", err);
  ctl_free(&req->base);
}

int coord__ckpt_restore_register(coord *c, rpc_server *server) {
  static const coord_method methods[] = {{CTL_RESTORE, RPC_UNARY, on_restore}};
  return coord__add_methods(c, server, methods, sizeof methods / sizeof methods[0]);
}
