/* The executor: each rank's ordered queue and the thread that runs it,
 * ops submitted by the loop and run there or inline on the loop (exec.h);
 * the rank's device, opened and closed by its thread. The requests'
 * handlers are in the files named for them (exec_impl.h lists them). */
#include "exec.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt_job.h"
#include "clock.h"
#include "exec_impl.h"
#include "offload.h"
#include "tier.h"
#include "log.h"
#include "pin.h"
#include "pool.h"
#include "rank_metrics.h"

exec_op *exec_op_new(op_kind kind, rank_state *rank) {
  exec_op *op = calloc(1, sizeof *op);
  if (op == NULL)
    return NULL;
  op->kind = kind;
  op->rank = rank;
  op->in_fd = -1;
  op->reply_fd = -1;
  op->made_at = clock_now_s();
  if (kind == OP_STEP) /* its collective time is the step's exposed communication */
    op->comm_busy_at = comm_activity_busy_ns(&rank->activity, clock_now_ns());
  return op;
}

void exec_op_free(exec_op *op) {
  if (op == NULL)
    return;
  if (op->request != NULL)
    protobuf_c_message_free_unpacked(op->request, NULL);
  if (op->in_fd >= 0)
    close(op->in_fd);
  if (op->reply_fd >= 0)
    close(op->reply_fd);
  free(op->reply_frame);
  free(op->ckpt_source);
  free(op->warning);
  free(op);
}

/* An op is answered: its latency, or its error, in the rank's metrics. */
static void metered(const exec_op *op) {
  rank_timer timer;
  switch (op->kind) {
  case OP_GATHER:
    timer = RANK_GATHER;
    break;
  case OP_REDUCE:
    timer = RANK_REDUCE;
    break;
  case OP_STEP:
    timer = RANK_STEP;
    break;
  case OP_REGISTER:
  case OP_LOAD:
  case OP_READ_STATE:
    timer = RANK_REGISTER;
    break;
  default:
    timer = RANK_UNTIMED;
    break;
  }
  rank_metrics_op(op->rank, timer, op->status, op->made_at);
}

static void finish(exec_op *op) {
  const exec_settings *settings = op->rank->job->exec;
  metered(op);
  if (op->kind == OP_SESSION_BEGIN)
    rank_metrics_waits_reset(op->rank);
  else if (op->kind == OP_STEP && op->status == ZEROD__V1__STATUS__STATUS_OK)
    rank_metrics_step_waits(op->rank, ((const Zerod__V1__StepRequest *)op->request)->worker_wait_ns,
                            op->made_at, op->comm_busy_at);
  if (op->session != NULL)
    settings->complete(settings->ctx, op);
  else
    exec_op_free(op);
}

const char *exec_op_name(int kind) {
  static const char *const names[] = {
      [OP_COMM_INIT] = "comm_init",
      [OP_SESSION_BEGIN] = "attach",
      [OP_SESSION_END] = "detach",
      [OP_REGISTER] = "register_unit",
      [OP_GATHER] = "gather",
      [OP_PREFETCH] = "prefetch",
      [OP_RELEASE] = "release",
      [OP_GRAD_BUFFER] = "grad_buffer",
      [OP_REDUCE] = "reduce",
      [OP_STEP] = "step",
      [OP_LOAD] = "load_unit",
      [OP_READ_STATE] = "read_state",
      [OP_SET_GROUPS] = "set_groups",
      [OP_GRAD_NORM] = "grad_norm",
      [OP_PIN] = "pin",
      [OP_WATCH] = "watch",
      [OP_TRIM] = "trim",
      [OP_FREEZE] = "freeze",
      [OP_SAVE] = "save",
      [OP_RESTORE_READ] = "restore",
      [OP_RESTORE_COMMIT] = "restore_commit",
      [OP_RESTORE_ABORT] = "restore_abort",
      [OP_CKPT_PARK] = "checkpoint",
      [OP_CKPT_UNPARK] = "checkpoint_end",
      [OP_STOP] = "stop",
  };
  return kind >= 0 && kind < (int)(sizeof names / sizeof names[0]) && names[kind] != NULL
             ? names[kind]
             : "?";
}

static void run_op(rank_state *rs, exec_op *op) {
  int64_t next = -1;
  atomic_store(&rs->last_op, (int)op->kind);
  atomic_store(&rs->last_op_ns, clock_now_ns());
  rs->failed_on_device = 0;
  /* Whatever the worker sends after a checkpoint call means it is over. */
  if (rs->ckpt_parked != 0 && op->session != NULL && op->kind != OP_CKPT_PARK)
    exec__ckpt_unpark(rs);
  switch (op->kind) {
  case OP_COMM_INIT:
    exec__handle_comm_init(rs, op);
    break;
  case OP_SESSION_BEGIN:
    exec__handle_session_begin(rs, op);
    break;
  case OP_SESSION_END:
    exec__handle_session_end(rs, op);
    break;
  case OP_REGISTER:
    exec__handle_register(rs, op);
    break;
  case OP_GATHER:
    exec__handle_gather(rs, op, 0, &next);
    break;
  case OP_PREFETCH:
    next = op->prefetch_unit;
    break;
  case OP_RELEASE:
    exec__handle_release(rs, op);
    break;
  case OP_GRAD_BUFFER:
    exec__handle_grad_buffer(rs, op, 0);
    break;
  case OP_REDUCE:
    exec__handle_reduce(rs, op);
    break;
  case OP_STEP:
    exec__handle_step(rs, op);
    break;
  case OP_LOAD:
    exec__handle_load(rs, op);
    break;
  case OP_READ_STATE:
    exec__handle_read_state(rs, op);
    break;
  case OP_SET_GROUPS:
    exec__handle_set_groups(rs, op);
    break;
  case OP_GRAD_NORM:
    exec__handle_grad_norm(rs, op);
    break;
  case OP_PIN: /* read-only sessions' ops never reach an executor */
  case OP_WATCH:
    break;
  case OP_TRIM:
    pool_trim(rs);
    break;
  case OP_FREEZE:
    exec__handle_freeze(rs);
    break;
  case OP_SAVE:
    exec__handle_save(rs, op);
    break;
  case OP_RESTORE_READ:
    exec__handle_restore_read(rs, op);
    break;
  case OP_RESTORE_COMMIT:
    exec__handle_restore_commit(rs, op);
    break;
  case OP_RESTORE_ABORT:
    ckpt_staged_free(rs->ckpt_staged);
    rs->ckpt_staged = NULL;
    break;
  case OP_CKPT_PARK:
    exec__handle_ckpt_park(rs, op);
    break;
  case OP_CKPT_UNPARK:
    exec__ckpt_unpark(rs);
    break;
  case OP_STOP:
    break;
  }
  /* The reply goes out before the prefetch starts: the worker computes on
   * this unit while the next one is gathered. */
  finish(op);
  rank_metrics_state(rs);
  rs->failed_on_device = 0;
  if (next >= 0)
    exec__prefetch_unit(rs, (uint32_t)next);
}

/* Opens the rank's device on its executor thread: a GPU rank's device is
 * current on this thread from here on. A failure is kept for the
 * communicator's creation, which fails the job with it. */
static void open_device(rank_state *rs) {
  int rc;
  if (rs->job->exec->device != NULL && strcmp(rs->job->exec->device, "cuda") == 0) {
    /* Local rank i binds GPU i (docs/architecture.md). */
    int ordinal = rs->rank - rs->job->first_rank;
    rc = device_cuda_open(ordinal, &rs->dev, rs->device_error, sizeof rs->device_error);
    if (rc == 0)
      LOG_INFOF("rank on GPU", "job=%s rank=%d device=%d", rs->job->name, rs->rank, ordinal);
  } else {
    rc = device_host_open(rs->pool, &rs->dev);
    if (rc != 0)
      snprintf(rs->device_error, sizeof rs->device_error, "host device: %s", strerror(-rc));
  }
  if (rc != 0) {
    rs->dev = NULL;
    LOG_ERRORF("device failed", "job=%s rank=%d err=\"%s\"", rs->job->name, rs->rank,
               rs->device_error);
  }
}

/* Frees everything that lives in the device's memory, then the device, on
 * the executor thread that owns it. Readers of the rank's shards are kept
 * out by its lock (the daemon is stopping: they give up). */
static void close_device(rank_state *rs) {
  if (rs->dev == NULL)
    return;
  device_sync(rs->dev);
  pin_lock_shards(rs);
  for (uint32_t u = 0; u < rs->nshards; u++)
    if (rs->shards[u].present)
      exec__shard_free(rs, &rs->shards[u]);
  pin_unlock_shards(rs);
  tier_close(rs);
  offload_close(rs);
  pool_free_all(rs);
  device_free(rs->dev, rs->scratch);
  device_free(rs->dev, rs->shard_scratch);
  device_free(rs->dev, rs->staging);
  rs->scratch = rs->shard_scratch = NULL;
  rs->staging = NULL;
  rs->scratch_numel = rs->shard_scratch_numel = 0;
  rs->staging_bytes = 0;
  device_close(rs->dev);
  rs->dev = NULL;
}

static void *exec_main(void *arg) {
  rank_state *rs = arg;
  /* Named so that an operator (top -H, gdb) and the tests tell a job's
   * threads from the daemon's. */
  pthread_setname_np(pthread_self(), "zd-exec");
  open_device(rs);
  for (;;) {
    pthread_mutex_lock(&rs->queue_mutex);
    while (rs->queue_head == NULL)
      pthread_cond_wait(&rs->queue_cond, &rs->queue_mutex);
    exec_op *op = rs->queue_head;
    rs->queue_head = op->next;
    if (rs->queue_head == NULL)
      rs->queue_tail = NULL;
    pthread_mutex_unlock(&rs->queue_mutex);
    op->next = NULL;
    if (op->kind == OP_STOP) {
      /* Closing the communicator's connections wakes any peer rank blocked
       * on this one at once, instead of at its timeout. */
      exec__set_comm(rs, NULL);
      close_device(rs);
      exec_op_free(op);
      atomic_fetch_sub(&rs->busy, 1);
      atomic_store(&rs->stopped, 1);
      if (rs->job->exec->stopped != NULL)
        rs->job->exec->stopped(rs->job->exec->ctx);
      return NULL;
    }
    run_op(rs, op);
    atomic_fetch_sub(&rs->busy, 1);
  }
}

int exec_rank_start(rank_state *rs) {
  int rc = zk_pool_create(rs->job->exec->threads_per_rank, &rs->pool);
  if (rc != 0)
    return rc;
  rc = pthread_create(&rs->thread, NULL, exec_main, rs);
  if (rc != 0)
    return -rc;
  rs->thread_started = 1;
  return 0;
}

void exec_submit(exec_op *op) {
  rank_state *rs = op->rank;
  atomic_fetch_add(&rs->busy, 1);
  pthread_mutex_lock(&rs->queue_mutex);
  if (rs->queue_tail != NULL)
    rs->queue_tail->next = op;
  else
    rs->queue_head = op;
  rs->queue_tail = op;
  pthread_cond_signal(&rs->queue_cond);
  pthread_mutex_unlock(&rs->queue_mutex);
}

int exec_try_inline(exec_op *op) {
  rank_state *rs = op->rank;
  if (atomic_load(&rs->busy) != 0)
    return 0;
  int64_t next = -1;
  switch (op->kind) {
  case OP_GATHER:
    if (!exec__handle_gather(rs, op, 1, &next))
      return 0;
    break;
  case OP_RELEASE:
    exec__handle_release(rs, op);
    break;
  case OP_GRAD_BUFFER:
    if (!exec__handle_grad_buffer(rs, op, 1))
      return 0;
    break;
  default:
    return 0;
  }
  metered(op);
  rank_metrics_state(rs);
  if (next >= 0) {
    /* The executor is idle, so this prefetch runs right after the gather,
     * exactly where the executor would have run it. */
    exec_op *prefetch = exec_op_new(OP_PREFETCH, rs);
    if (prefetch != NULL) {
      prefetch->prefetch_unit = (uint32_t)next;
      exec_submit(prefetch);
    }
  }
  return 1;
}

void exec_rank_abort_comm(rank_state *rs) {
  /* comm_abort only raises flags and wakes waiters, so the loop can call
   * it; the collective under way returns now, not at its timeout. */
  pthread_mutex_lock(&rs->comm_lock);
  comm_abort(rs->comm);
  pthread_mutex_unlock(&rs->comm_lock);
  /* A local communicator still in its rendezvous has no comm to abort. */
  pthread_mutex_lock(&rs->job->mutex);
  if (rs->job->local_group != NULL)
    comm_local_group_cancel(rs->job->local_group);
  pthread_mutex_unlock(&rs->job->mutex);
  /* Nor has one still connecting to its peers. */
  exec__cancel_build_if_over(rs);
}

void exec_rank_stop(rank_state *rs) {
  if (!rs->thread_started)
    return;
  atomic_store(&rs->stopping, 1);
  pthread_mutex_lock(&rs->queue_mutex);
  exec_op *dropped = rs->queue_head;
  rs->queue_head = rs->queue_tail = NULL;
  pthread_mutex_unlock(&rs->queue_mutex);
  while (dropped != NULL) {
    exec_op *next = dropped->next;
    dropped->next = NULL;
    exec_error(dropped, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "zerod is shutting down");
    atomic_fetch_sub(&rs->busy, 1);
    finish(dropped);
    dropped = next;
  }
  /* An op still running may be a collective whose peers will not come
   * (their executors are stopping too, or they are on nodes whose workers
   * are gone). A communicator still being built gives up in its
   * rendezvous once the store is stopped (cluster_stop), or is aborted by
   * exec__set_comm when it is done. */
  exec_rank_abort_comm(rs);
  exec_op *stop = exec_op_new(OP_STOP, rs);
  if (stop != NULL)
    exec_submit(stop);
}

void exec_rank_join(rank_state *rs) {
  if (!rs->thread_started)
    return;
  pthread_join(rs->thread, NULL);
  rs->thread_started = 0;
}

void exec_rank_free(rank_state *rs) {
  if (rs->comm != NULL)
    comm_destroy(rs->comm);
  rs->comm = NULL;
  /* The executor closed its device when it stopped (close_device); what
   * is left is host memory. */
  free(rs->shards);
  rs->shards = NULL;
  free(rs->bufs);
  free(rs->dropped_ids);
  rs->bufs = NULL;
  rs->dropped_ids = NULL;
  free(rs->order);
  rs->order = NULL;
  free(rs->qgather);
  free(rs->qdequant);
  free(rs->groups);
  rs->qgather = NULL;
  rs->qdequant = NULL;
  rs->qgather_bytes = rs->qdequant_numel = 0;
  ckpt_staged_free(rs->ckpt_staged);
  rs->ckpt_staged = NULL;
  zk_pool_destroy(rs->pool);
  rs->pool = NULL;
}
