/* ipc_completion: ops coming back to their sessions (daemon.h's
 * ipc_complete, ipc_drain_completions, ipc_stopped): executors push
 * finished ops onto the daemon's completion queue from their threads; the
 * loop drains it whole on each wakeup, sends each reply to its session,
 * and reaps the deleted jobs whose executors have stopped. A worker's
 * CHECKPOINT parked with its rank waits for its call first (ckpt_call.c). */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "ckpt_call.h"
#include "daemon.h"
#include "exec.h"

#include "ipc_impl.h"

void ipc_complete(void *daemon, exec_op *op) {
  zdaemon *d = daemon;
  pthread_mutex_lock(&d->completion_mutex);
  op->next = NULL;
  if (d->completion_tail != NULL)
    d->completion_tail->next = op;
  else
    d->completion_head = op;
  d->completion_tail = op;
  pthread_mutex_unlock(&d->completion_mutex);
  uv_async_send(&d->completion_async);
}

/* Sends a finished op's reply to its session and frees the op; a worker's
 * CHECKPOINT parked with its rank waits for its call first (ckpt_call.c,
 * which hands the op back here when the call ends). */
static void deliver(exec_op *op) {
  session *s = op->session;
  if (op->kind == OP_CKPT_PARK && op->status == ZEROD__V1__STATUS__STATUS_OK &&
      !op->ckpt_answered) {
    /* The rank waits with its worker for the checkpoint call: the answer
     * comes with the call's end (ckpt_call.c, then deliver again). */
    int rc = ckpt_call_wait(s->daemon, op, deliver);
    if (rc == 0)
      return;
    exec_error(op,
               rc == -ECANCELED ? ZEROD__V1__STATUS__STATUS_UNAVAILABLE
                                : ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
               "%s", rc == -ECANCELED ? "zerod is shutting down" : strerror(-rc));
    exec_op *unpark = exec_op_new(OP_CKPT_UNPARK, op->rank);
    if (unpark != NULL)
      exec_submit(unpark);
  }
  if (op->reply_frame != NULL && !s->closing) {
    ipc__session_send(s, op->reply_frame, op->reply_bytes, op->reply_fd);
    op->reply_frame = NULL;
    op->reply_fd = -1;
  }
  s->inflight--;
  if (op->kind == OP_SESSION_END && s->detaching)
    ipc__session_close(s, NULL);
  ipc__session_unref(s);
  op->session = NULL;
  exec_op_free(op);
}

/* A read-only session's op, finished (reader_env.done). */
void ipc__deliver_reader_op(void *daemon, exec_op *op) {
  deliver(op);
}

void ipc_drain_completions(zdaemon *d) {
  /* Take the whole queue at once: everything finished before this wakeup
   * is handled now (uv_async_send coalesces wakeups). */
  pthread_mutex_lock(&d->completion_mutex);
  exec_op *op = d->completion_head;
  d->completion_head = d->completion_tail = NULL;
  pthread_mutex_unlock(&d->completion_mutex);
  while (op != NULL) {
    exec_op *next = op->next;
    deliver(op);
    op = next;
  }
  /* A step's or a load's reply comes after its write: a newer version. */
  reader_poll_watches(&d->readers);
  /* The same wakeup tells of executors that have stopped (ipc_stopped):
   * only then is there a retired job to look at. */
  if (atomic_exchange(&d->executors_stopped, 0))
    ipc__reap_jobs(d);
}

void ipc_stopped(void *daemon) {
  zdaemon *d = daemon;
  atomic_store(&d->executors_stopped, 1);
  uv_async_send(&d->completion_async);
}

void ipc__on_completion(uv_async_t *handle) {
  ipc_drain_completions(handle->data);
}
