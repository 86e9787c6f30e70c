/* Read-only sessions (see reader.h). */
#include "reader.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "frame.h"
#include "log.h"
#include "pin.h"
#include "shm.h"

#include "reader_impl.h"

int reader_create(reader_env *env, job *j, uint64_t session_id, int pin, reader **out) {
  reader *r = calloc(1, sizeof *r);
  if (r == NULL)
    return -ENOMEM;
  r->env = env;
  r->job = j;
  r->session_id = session_id;
  atomic_init(&r->cancel, 0);
  r->work.data = r;
  if (pin) {
    int rc = reader__pin_latest(r);
    if (rc != 0) {
      free(r);
      return rc;
    }
  }
  *out = r;
  return 0;
}

job *reader_job(const reader *r) {
  return r->job;
}

uint64_t reader_version(const reader *r, int *pinned) {
  *pinned = r->pin != NULL;
  return r->pin != NULL ? r->pin->version : pin_latest_version(r->job);
}

/* ------------------------------------------------------------------------ */
/* Buffers                                                                  */
/* ------------------------------------------------------------------------ */

static uint64_t page_round(uint64_t bytes) {
  long page = sysconf(_SC_PAGESIZE);
  uint64_t p = page > 0 ? (uint64_t)page : 4096;
  return bytes == 0 ? p : (bytes + p - 1) / p * p;
}

static void remember_dropped(reader *r, uint32_t id) {
  if (r->ndropped == r->dropped_cap) {
    size_t cap = r->dropped_cap ? r->dropped_cap * 2 : 16;
    uint32_t *grown = realloc(r->dropped_ids, cap * sizeof *grown);
    if (grown == NULL)
      return; /* the client keeps a stale mapping; its id is never reused */
    r->dropped_ids = grown;
    r->dropped_cap = cap;
  }
  r->dropped_ids[r->ndropped++] = id;
}

static void buf_destroy(reader *r, reader_buf *b) {
  if (b->id == 0)
    return;
  if (b->sent)
    remember_dropped(r, b->id);
  r->buffer_bytes -= b->region.bytes;
  shm_region_destroy(&b->region);
  free(b->changed);
  memset(b, 0, sizeof *b);
}

/* The unit's buffer slot, growing the table; NULL when out of memory. */
static reader_buf *buf_slot(reader *r, uint32_t unit_id) {
  if (unit_id >= r->nbufs) {
    uint32_t cap = r->nbufs ? r->nbufs : 16;
    while (cap <= unit_id)
      cap *= 2;
    reader_buf *grown = realloc(r->bufs, cap * sizeof *grown);
    if (grown == NULL)
      return NULL;
    memset(grown + r->nbufs, 0, (cap - r->nbufs) * sizeof *grown);
    r->bufs = grown;
    r->nbufs = cap;
  }
  return &r->bufs[unit_id];
}

static reader_buf *buf_of(reader *r, uint32_t unit_id) {
  return unit_id < r->nbufs && r->bufs[unit_id].id != 0 ? &r->bufs[unit_id] : NULL;
}

/* Makes room for `need` more bytes under the cap by evicting released
 * buffers, least recently used first, but only once it is known that
 * enough can be freed: a refusal changes nothing. */
static int make_room(reader *r, uint64_t need, uint64_t cap) {
  if (r->held_bytes + need > cap)
    return -ENOSPC;
  while (r->buffer_bytes + need > cap) {
    reader_buf *victim = NULL;
    for (uint32_t u = 0; u < r->nbufs; u++) {
      reader_buf *b = &r->bufs[u];
      if (b->id != 0 && !b->held && (victim == NULL || b->last_use < victim->last_use))
        victim = b;
    }
    if (victim == NULL)
      return -ENOSPC; /* cannot happen: unheld bytes cover the excess */
    buf_destroy(r, victim);
  }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Requests                                                                 */
/* ------------------------------------------------------------------------ */

/* The version a gather serves now: the pinned one, or the latest. */
static uint64_t target_version(reader *r) {
  return r->pin != NULL ? r->pin->version : pin_latest_version(r->job);
}

/* Answers the gather from the unit's buffer (values of the target version
 * in it, or just refilled): hold it, send the descriptor the first time,
 * list dropped buffers. */
static void gather_reply(reader *r, exec_op *op, reader_buf *b, uint32_t unit_id) {
  if (!b->sent) {
    op->reply_fd = dup(b->region.fd);
    if (op->reply_fd < 0) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                 "cannot pass the buffer to the worker: %s", strerror(errno));
      return;
    }
  }
  Zerod__V1__GatherReply reply = ZEROD__V1__GATHER_REPLY__INIT;
  reply.unit_id = unit_id;
  reply.buffer_id = b->id;
  reply.buffer_bytes = b->region.bytes;
  reply.version = b->valid_version;
  reply.dropped_buffer_ids = r->dropped_ids;
  reply.n_dropped_buffer_ids = r->ndropped;
  if (((Zerod__V1__GatherRequest *)op->request)->delta) {
    reply.delta = b->delta;
    reply.delta_from = b->delta ? b->delta_from : 0;
    reply.block_bytes = PIN_DELTA_BLOCK_BYTES;
    reply.changed_blocks.data = b->changed;
    reply.changed_blocks.len = b->delta ? b->changed_bytes : 0;
  }
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, &reply.base);
  if (op->status != ZEROD__V1__STATUS__STATUS_OK)
    return;
  /* With NO_REPLY nothing went out: the client keeps not knowing the
   * descriptor, and the dropped ids wait for the next reply. */
  if (op->reply_frame != NULL) {
    b->sent = 1;
    r->ndropped = 0;
  }
  b->held = 1;
  r->held_bytes += b->region.bytes;
  b->last_use = ++r->tick;
}

/* The checks every gather makes first. Returns the unit, or NULL with the
 * op answered. */
static unit_layout *gather_checks(reader *r, exec_op *op) {
  job *j = r->job;
  Zerod__V1__GatherRequest *req = (Zerod__V1__GatherRequest *)op->request;
  char reason[512];
  if (job_failed(j, op->generation, reason, sizeof reason)) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_ABORTED,
               "job '%s' failed: %s; reads resume when it has reset", j->name, reason);
    return NULL;
  }
  unit_layout *l = job_unit(j, req->unit_id);
  if (l == NULL || atomic_load(&l->ready_ranks) < j->nranks) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_NOT_FOUND,
               "unknown unit id %u (not registered on every rank of job '%s')", req->unit_id,
               j->name);
    return NULL;
  }
  reader_buf *b = buf_of(r, req->unit_id);
  if (b != NULL && b->held) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
               "unit '%s' is already gathered by this session; release it first", l->name);
    return NULL;
  }
  return l;
}

/* A delta gather (docs/subscribe.md, "Deltas") into b, which holds
 * valid_version's values (UINT64_MAX: none, so it is filled whole): its
 * bitmap, zeroed. Returns the bitmap pin_read_unit marks, or NULL for a
 * whole fill; -ENOMEM in *rc when the bitmap cannot be had. */
static uint8_t *delta_begin(const job *j, const unit_layout *l, reader_buf *b, int *rc) {
  size_t bytes = pin_delta_bitmap_bytes(l->padded_numel * zk_dtype_size(j->config.working_dtype));
  *rc = 0;
  if (b->changed_bytes != bytes) {
    uint8_t *grown = realloc(b->changed, bytes ? bytes : 1);
    if (grown == NULL) {
      *rc = -ENOMEM;
      return NULL;
    }
    b->changed = grown;
    b->changed_bytes = bytes;
  }
  memset(b->changed, 0, b->changed_bytes);
  b->delta = b->valid_version != UINT64_MAX;
  b->delta_from = b->valid_version;
  return b->delta ? b->changed : NULL;
}

/* Threadpool: a gather that copies. */
static void gather_copy(reader *r, exec_op *op) {
  job *j = r->job;
  Zerod__V1__GatherRequest *req = (Zerod__V1__GatherRequest *)op->request;
  unit_layout *l = gather_checks(r, op);
  if (l == NULL)
    return;
  const uint64_t cap = j->config.max_live_bytes;
  uint64_t need = page_round(l->padded_numel * zk_dtype_size(j->config.working_dtype));
  reader_buf *b = buf_of(r, req->unit_id);
  if (b == NULL) {
    if (make_room(r, need, cap) != 0) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                 "gathering unit '%s' needs %" PRIu64 " bytes but %" PRIu64
                 " of the job's max_live_bytes %" PRIu64
                 " are held by this read-only session; release units first",
                 l->name, need, r->held_bytes, cap);
      return;
    }
    b = buf_slot(r, req->unit_id);
    if (b == NULL) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
      return;
    }
    /* The name shows in /proc/<pid>/fd, which makes leaks easy to see. */
    char name[96];
    snprintf(name, sizeof name, "zerod-%.64s-ro%llu-gather", j->name,
             (unsigned long long)r->session_id);
    int rc = shm_region_create(&b->region, name, need);
    if (rc != 0) {
      memset(b, 0, sizeof *b);
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                 "cannot create %" PRIu64 " bytes of shared memory for unit '%s': %s", need,
                 l->name, strerror(-rc));
      return;
    }
    b->id = ++r->next_buf_id;
    b->valid_version = UINT64_MAX;
    r->buffer_bytes += b->region.bytes;
  }
  pin_read_control control = {
      .generation = op->generation, .cancel = &r->cancel, .timeout_ms = r->env->timeout_ms};
  if (req->delta) {
    int rc;
    control.changed = delta_begin(j, l, b, &rc);
    if (rc != 0) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
      return;
    }
  }
  char err[512] = "";
  uint64_t served = UINT64_MAX;
  int status = pin_read_unit(j, r->pin, l, b->region.base, b->valid_version, &control, &served, err,
                             sizeof err);
  if (status != 0) {
    b->valid_version = UINT64_MAX; /* possibly half refilled */
    exec_error(op, status, "%s", err);
    return;
  }
  b->valid_version = served;
  gather_reply(r, op, b, req->unit_id);
}

/* Loop: a gather served from the unit's buffer. Returns 0 when it must be
 * copied (on the threadpool). */
static int gather_inline(reader *r, exec_op *op) {
  Zerod__V1__GatherRequest *req = (Zerod__V1__GatherRequest *)op->request;
  unit_layout *l = gather_checks(r, op);
  if (l == NULL)
    return 1;
  reader_buf *b = buf_of(r, req->unit_id);
  if (b == NULL || b->valid_version != target_version(r))
    return 0;
  int rc = 0;
  if (req->delta)
    delta_begin(r->job, l, b, &rc);
  if (rc != 0)
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
  else
    gather_reply(r, op, b, req->unit_id);
  return 1;
}

static void release(reader *r, exec_op *op) {
  Zerod__V1__ReleaseRequest *req = (Zerod__V1__ReleaseRequest *)op->request;
  unit_layout *l = job_unit(r->job, req->unit_id);
  if (l == NULL) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_NOT_FOUND, "unknown unit id %u", req->unit_id);
    return;
  }
  reader_buf *b = buf_of(r, req->unit_id);
  if (b == NULL || !b->held) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
               "release of unit '%s', which this session does not hold", l->name);
    return;
  }
  b->held = 0;
  r->held_bytes -= b->region.bytes;
  Zerod__V1__ReleaseReply reply = ZEROD__V1__RELEASE_REPLY__INIT;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY, &reply.base);
}

/* Moves the session's pin to the latest version (reader__pin_latest).
 * Buffers of the old version are refilled on their next gather. */
static void repin(reader *r, exec_op *op) {
  int rc = reader__pin_latest(r);
  if (rc != 0) {
    reader__pin_error(r, op, rc);
    return;
  }
  job_pin *pin = r->pin;
  Zerod__V1__PinReply reply = ZEROD__V1__PIN_REPLY__INIT;
  reply.version = pin->version;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_PIN_REPLY, &reply.base);
  LOG_DEBUGF("reader pinned", "job=%s session=%llu version=%llu", r->job->name,
             (unsigned long long)r->session_id, (unsigned long long)pin->version);
}

/* Runs op on the loop if it can; returns 0 when it needs the threadpool,
 * -1 when it waits (a WATCH parked: reader_watch.c answers it later). */
static int run_inline(reader *r, exec_op *op) {
  switch (op->kind) {
  case OP_GATHER:
    return gather_inline(r, op);
  case OP_RELEASE:
    release(r, op);
    return 1;
  case OP_PIN:
    repin(r, op);
    return 1;
  case OP_WATCH:
    return reader__watch(r, op) ? 1 : -1;
  case OP_SESSION_END: {
    /* The buffers and the pin go when the session is freed. */
    Zerod__V1__DetachReply reply = ZEROD__V1__DETACH_REPLY__INIT;
    exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_DETACH_REPLY, &reply.base);
    return 1;
  }
  default:
    exec_error(op, ZEROD__V1__STATUS__STATUS_INTERNAL, "not a read-only request");
    return 1;
  }
}

/* ------------------------------------------------------------------------ */
/* Ordering                                                                 */
/* ------------------------------------------------------------------------ */

static void pump(reader *r);
static void cancel_watch(reader *r);

static void work_run(uv_work_t *req) {
  reader *r = req->data;
  gather_copy(r, r->running);
}

/* Hands back an op that ran off the queue (a copy, a parked watch) and
 * runs what queued behind it. Each queued op holds a reference on the
 * session; without any, handing this op back may free the session and the
 * reader with it, which is then not touched again. */
static void hand_back(reader *r, exec_op *op) {
  if (r->queue_head == NULL) {
    r->env->done(r->env->ctx, op);
    return;
  }
  r->env->done(r->env->ctx, op);
  pump(r);
}

static void work_done(uv_work_t *req, int status) {
  reader *r = req->data;
  exec_op *op = r->running;
  r->running = NULL;
  if (status != 0)
    exec_error(op, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "the read was cancelled");
  hand_back(r, op);
}

/* Runs queued ops in order until one needs the threadpool or waits. The
 * reader is not touched after handing back the last queued op (see
 * hand_back). */
static void pump(reader *r) {
  while (r->running == NULL && r->watching == NULL && r->queue_head != NULL) {
    exec_op *op = r->queue_head;
    r->queue_head = op->next;
    if (r->queue_head == NULL)
      r->queue_tail = NULL;
    op->next = NULL;
    int last = r->queue_head == NULL;
    int ran = run_inline(r, op);
    if (ran < 0)
      return; /* parked: the watch holds a reference on the session */
    if (ran == 0) {
      r->running = op;
      int rc = uv_queue_work(r->env->loop, &r->work, work_run, work_done);
      if (rc == 0)
        return;
      r->running = NULL;
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "cannot queue the read: %s",
                 uv_strerror(rc));
    }
    r->env->done(r->env->ctx, op);
    if (last)
      return;
  }
}

void reader_submit(reader *r, exec_op *op) {
  op->next = NULL;
  if (r->queue_tail != NULL)
    r->queue_tail->next = op;
  else
    r->queue_head = op;
  r->queue_tail = op;
  pump(r);
}

void reader_close(reader *r) {
  atomic_store(&r->cancel, 1);
  if (r->running != NULL)
    pin_wake(r->job);
  exec_op *op = r->queue_head;
  r->queue_head = r->queue_tail = NULL;
  while (op != NULL) {
    exec_op *next = op->next;
    op->next = NULL;
    exec_error(op, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "the session is closing");
    r->env->done(r->env->ctx, op);
    op = next;
  }
  cancel_watch(r); /* last: handing it back may free the reader */
}

void reader_destroy(reader *r) {
  if (r == NULL)
    return;
  for (uint32_t u = 0; u < r->nbufs; u++) {
    if (r->bufs[u].id != 0)
      shm_region_destroy(&r->bufs[u].region);
    free(r->bufs[u].changed);
  }
  free(r->bufs);
  free(r->listed);
  free(r->dropped_ids);
  pin_release(r->job, r->pin);
  free(r);
}

/* ------------------------------------------------------------------------ */
/* Waiting WATCHes (reader_watch.c answers them)                            */
/* ------------------------------------------------------------------------ */

/* Hands the parked op back (answered, or unanswered for a closing
 * session); the reader may be freed by it (hand_back). */
static void finish_watch(reader *r) {
  exec_op *op = r->watching;
  r->watching = NULL;
  hand_back(r, op);
}

static void cancel_watch(reader *r) {
  if (r->watching == NULL)
    return;
  reader__watch_unlink(r);
  exec_error(r->watching, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "the session is closing");
  finish_watch(r);
}

void reader_poll_watches(reader_env *env) {
  reader *r = env->watchers;
  while (r != NULL) {
    reader *next = r->watch_next; /* finish_watch may free r */
    if (reader__watch_try(r))
      finish_watch(r);
    r = next;
  }
}

static void on_watch_timer(uv_timer_t *timer) {
  reader_poll_watches(timer->data);
}

int reader_env_init(reader_env *env, uv_loop_t *loop, void (*done)(void *ctx, exec_op *op),
                    void *ctx, int timeout_ms, int max_pins) {
  *env = (reader_env){.loop = loop,
                      .done = done,
                      .ctx = ctx,
                      .timeout_ms = timeout_ms,
                      .on_watch_timer = on_watch_timer,
                      .max_pins = max_pins};
  int rc = uv_timer_init(loop, &env->watch_timer);
  env->watch_timer.data = env;
  return rc;
}

void reader_env_close(reader_env *env) {
  uv_timer_stop(&env->watch_timer);
  uv_close((uv_handle_t *)&env->watch_timer, NULL);
}
