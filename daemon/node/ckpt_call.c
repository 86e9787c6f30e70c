/* ckpt_call: the checkpoints workers ask for themselves (ckpt_call.h).
 *
 * A call is one CHECKPOINT collective of a job on this node: the ops of
 * the node's ranks that wait for it (each a worker, answered at the end),
 * and one thread. On the leader (the node of global rank 0) the thread
 * makes the Save or Restore call to the coordinator with the node's
 * credentials (docs/security.md: a node may save the jobs placed on it
 * and restore them from their own checkpoints) and publishes the answer
 * under "<job>/<generation>/ckpt-call/<n>" in the rendezvous store, where
 * the threads of the other nodes' calls read it. The thread never touches
 * the loop's state: it hands the result back through an async handle, and
 * the loop answers the waiting workers and lets their ranks go on. */
#include "ckpt_call.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "ctl_decode.h"
#include "daemon.h"
#include "log.h"
#include "rpc.h"
#include "zerod/v1/control.pb-c.h"

/* How long a leader waits for the coordinator's Save or Restore (its own
 * --checkpoint-timeout, 600 s by default, ends them sooner), and another
 * node for the leader's answer. */
#define CALL_RPC_MS  (20 * 60 * 1000)
#define CALL_WAIT_MS (21 * 60 * 1000)
/* Between two looks at whether the job failed or the daemon stops. */
#define CALL_POLL_MS 500
/* How long a leader asks again while the coordinator's refusal is
 * transient (is_transient). */
#define CALL_RETRY_MS (60 * 1000)

#define CALL_NAME_MAX CTL_NAME_MAX_BYTES

typedef struct ckpt_call {
  struct ckpt_call *next;
  zdaemon *d;
  job *j;
  unsigned generation;
  uint64_t number;
  int action; /* Zerod__V1__CheckpointAction */
  char name[CALL_NAME_MAX + 1];
  char job_name[CALL_NAME_MAX * 2 + 1];
  char key[256];
  int leader;  /* this node hosts global rank 0 */
  int publish; /* the job has ranks elsewhere: the answer goes to the store */
  rpc_channel *channel;
  store *rendezvous;

  exec_op **waiting;              /* the node's ranks' parked ops, answered at the end */
  void (*finish_op)(exec_op *op); /* hands an answered op back (ckpt_call_wait) */
  int nwaiting;
  int answered; /* waiting ops answered so far */
  pthread_t thread;
  int finished;  /* the thread was joined: the result is final */
  int64_t t0_ms; /* clock_now_ms() when it started */
  _Atomic int abandon;
  _Atomic int done;

  /* The result, written by the thread before done. */
  int status; /* Zerod__V1__Status */
  char message[768];
  char result_name[CALL_NAME_MAX + 1];
  uint64_t step;
  int64_t stall_ms, total_ms;
} ckpt_call;

int ckpt_call_check(const Zerod__V1__CheckpointRequest *req, char *err, size_t err_bytes) {
  if (req->action != ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_SAVE &&
      req->action != ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_RESTORE) {
    snprintf(err, err_bytes, "action must be save or restore");
    return -EINVAL;
  }
  size_t len = strlen(req->name);
  int restore = req->action == ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_RESTORE;
  if (len == 0 && restore) {
    snprintf(err, err_bytes, "a restore names the checkpoint of this job to restore");
    return -EINVAL;
  }
  /* An empty name saves as step-<step>; any other follows the
   * coordinator's own rule for checkpoint names. */
  if (len != 0 && !ctl_valid_checkpoint_name(req->name)) {
    snprintf(err, err_bytes,
             "checkpoint name '%.80s%s' is not a checkpoint of this job: 1..64 of [A-Za-z0-9._-], "
             "not starting with '.' (%s)",
             req->name, len > 80 ? "..." : "",
             restore ? "other jobs' checkpoints and paths are restored through the control "
                       "plane: zerodctl restore"
                     : "or empty for step-<step>");
    return -EINVAL;
  }
  return 0;
}

int ckpt_call_ipc_status(int rpc_status) {
  switch (rpc_status) {
  case RPC_OK:
    return ZEROD__V1__STATUS__STATUS_OK;
  case RPC_INVALID_ARGUMENT:
  case RPC_OUT_OF_RANGE:
    return ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT;
  case RPC_NOT_FOUND:
    return ZEROD__V1__STATUS__STATUS_NOT_FOUND;
  case RPC_ALREADY_EXISTS:
    return ZEROD__V1__STATUS__STATUS_ALREADY_EXISTS;
  case RPC_FAILED_PRECONDITION:
    return ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION;
  case RPC_RESOURCE_EXHAUSTED:
    return ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED;
  case RPC_PERMISSION_DENIED:
  case RPC_UNAUTHENTICATED:
    return ZEROD__V1__STATUS__STATUS_PERMISSION_DENIED;
  case RPC_UNAVAILABLE:
  case RPC_DEADLINE_EXCEEDED:
  case RPC_CANCELLED:
    return ZEROD__V1__STATUS__STATUS_UNAVAILABLE;
  case RPC_ABORTED:
    return ZEROD__V1__STATUS__STATUS_ABORTED;
  default:
    return ZEROD__V1__STATUS__STATUS_INTERNAL;
  }
}

static const char *verb(const ckpt_call *c) {
  return c->action == ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_RESTORE ? "restore" : "save";
}

/* Refusals that pass by themselves (coord/coord_ckpt.c's words): the
 * coordinator has not yet heard that every node built the job's ranks
 * (the workers attached a moment ago), or another save or restore of the
 * job, e.g. a periodic one, is in flight. The workers wait through them
 * rather than fail on something they cannot see. */
static int is_transient(int status, const char *message) {
  return status == RPC_FAILED_PRECONDITION &&
         (strstr(message, " is not ready (creating:") != NULL ||
          strstr(message, " in flight (order ") != NULL);
}

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

/* The leader: Save or Restore on the coordinator. */
static void ask_coordinator(ckpt_call *c) {
  uint8_t buf[512], *reply = NULL;
  size_t len, reply_bytes = 0;
  const char *method;
  if (c->action == ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_SAVE) {
    Zerod__V1__SaveRequest req = ZEROD__V1__SAVE_REQUEST__INIT;
    req.job = c->job_name;
    req.name = c->name;
    len = zerod__v1__save_request__pack(&req, buf);
    method = CTL_SAVE;
  } else {
    Zerod__V1__RestoreRequest req = ZEROD__V1__RESTORE_REQUEST__INIT;
    req.job = c->job_name;
    req.checkpoint = c->name;
    len = zerod__v1__restore_request__pack(&req, buf);
    method = CTL_RESTORE;
  }
  rpc_result result = {0};
  int rc = RPC_UNAVAILABLE;
  snprintf(result.message, sizeof result.message, "this node has no coordinator");
  int pause = 20;
  for (int waited = 0; c->channel != NULL; waited += pause) {
    rc = rpc_unary(c->channel, method, buf, len, CALL_RPC_MS, &reply, &reply_bytes, &result);
    if (!is_transient(rc, result.message) || waited >= CALL_RETRY_MS || atomic_load(&c->abandon))
      break;
    LOG_DEBUGF("asking the coordinator again", "job=%s action=%s why=\"%s\"", c->job_name, verb(c),
               result.message);
    sleep_ms(pause);
    pause = pause * 2 > 1000 ? 1000 : pause * 2;
  }
  if (rc != RPC_OK) {
    c->status = ckpt_call_ipc_status(rc);
    snprintf(c->message, sizeof c->message, "checkpoint %s of job '%s' failed: %s: %s", verb(c),
             c->job_name, rpc_status_name(rc), result.message);
  } else if (c->action == ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_SAVE) {
    Zerod__V1__SaveReply *r = zerod__v1__save_reply__unpack(NULL, reply_bytes, reply);
    if (r == NULL || r->checkpoint == NULL) {
      c->status = ZEROD__V1__STATUS__STATUS_INTERNAL;
      snprintf(c->message, sizeof c->message, "the coordinator's Save reply does not decode");
    } else {
      snprintf(c->result_name, sizeof c->result_name, "%s", r->checkpoint->name);
      c->step = r->checkpoint->step;
      c->stall_ms = r->stall_ms;
    }
    if (r != NULL)
      zerod__v1__save_reply__free_unpacked(r, NULL);
  } else {
    Zerod__V1__RestoreReply *r = zerod__v1__restore_reply__unpack(NULL, reply_bytes, reply);
    if (r == NULL) {
      c->status = ZEROD__V1__STATUS__STATUS_INTERNAL;
      snprintf(c->message, sizeof c->message, "the coordinator's Restore reply does not decode");
    } else {
      snprintf(c->result_name, sizeof c->result_name, "%s", c->name);
      c->step = r->step;
      zerod__v1__restore_reply__free_unpacked(r, NULL);
    }
  }
  free(reply);
}

/* The answer in the store: a byte 0 and a CheckpointReply, or 1 and an
 * Error. */
static void publish(ckpt_call *c) {
  uint8_t buf[1 + 1024];
  size_t len;
  if (c->status == ZEROD__V1__STATUS__STATUS_OK) {
    Zerod__V1__CheckpointReply r = ZEROD__V1__CHECKPOINT_REPLY__INIT;
    r.name = c->result_name;
    r.step = c->step;
    r.stall_ms = c->stall_ms;
    buf[0] = 0;
    len = 1 + zerod__v1__checkpoint_reply__pack(&r, buf + 1);
  } else {
    Zerod__V1__Error e = ZEROD__V1__ERROR__INIT;
    e.status = (Zerod__V1__Status)c->status;
    e.message = c->message;
    buf[0] = 1;
    len = 1 + zerod__v1__error__pack(&e, buf + 1);
  }
  int rc = c->rendezvous->ops->set(c->rendezvous, c->key, buf, len);
  if (rc != 0)
    LOG_WARNF("cannot hand a worker checkpoint's answer to the other nodes; their workers wait "
              "until the job fails",
              "job=%s key=%s err=\"%s\"", c->job_name, c->key, strerror(-rc));
}

/* Another node: the leader's answer, from the store. */
static void await_leader(ckpt_call *c) {
  void *value = NULL;
  size_t bytes = 0;
  int rc = -ETIMEDOUT;
  char reason[512] = "";
  for (int64_t waited = 0; waited < CALL_WAIT_MS; waited += CALL_POLL_MS) {
    if (atomic_load(&c->abandon)) {
      rc = -ECANCELED;
      break;
    }
    if (job_failed(c->j, c->generation, reason, sizeof reason)) {
      rc = -ECONNABORTED;
      break;
    }
    rc = c->rendezvous->ops->get(c->rendezvous, c->key, &value, &bytes, CALL_POLL_MS);
    if (rc != -ETIMEDOUT)
      break;
  }
  if (rc == 0 && bytes >= 1 && ((uint8_t *)value)[0] == 0) {
    Zerod__V1__CheckpointReply *r =
        zerod__v1__checkpoint_reply__unpack(NULL, bytes - 1, (uint8_t *)value + 1);
    if (r != NULL) {
      snprintf(c->result_name, sizeof c->result_name, "%s", r->name);
      c->step = r->step;
      c->stall_ms = r->stall_ms;
      zerod__v1__checkpoint_reply__free_unpacked(r, NULL);
    } else {
      rc = -EPROTO;
    }
  } else if (rc == 0 && bytes >= 1 && ((uint8_t *)value)[0] == 1) {
    Zerod__V1__Error *e = zerod__v1__error__unpack(NULL, bytes - 1, (uint8_t *)value + 1);
    if (e != NULL) {
      c->status = e->status;
      snprintf(c->message, sizeof c->message, "%s", e->message);
      zerod__v1__error__free_unpacked(e, NULL);
    } else {
      rc = -EPROTO;
    }
  } else if (rc == 0) {
    rc = -EPROTO;
  }
  free(value);
  if (rc == 0)
    return;
  c->status = rc == -ECONNABORTED ? ZEROD__V1__STATUS__STATUS_ABORTED
              : rc == -EPROTO     ? ZEROD__V1__STATUS__STATUS_INTERNAL
                                  : ZEROD__V1__STATUS__STATUS_UNAVAILABLE;
  if (rc == -ECONNABORTED)
    snprintf(c->message, sizeof c->message, "checkpoint %s: job '%s' failed: %s", verb(c),
             c->job_name, reason);
  else if (rc == -ECANCELED)
    snprintf(c->message, sizeof c->message, "checkpoint %s: zerod is shutting down", verb(c));
  else if (rc == -ETIMEDOUT)
    snprintf(c->message, sizeof c->message, "checkpoint %s: no answer from rank 0's node in %d s",
             verb(c), CALL_WAIT_MS / 1000);
  else
    snprintf(c->message, sizeof c->message, "checkpoint %s: rank 0's node's answer: %s", verb(c),
             rc == -EPROTO ? "does not decode" : strerror(-rc));
}

static void *call_thread(void *arg) {
  ckpt_call *c = arg;
  if (c->leader) {
    ask_coordinator(c);
    if (c->publish)
      publish(c);
  } else {
    await_leader(c);
  }
  c->total_ms = clock_now_ms() - c->t0_ms;
  atomic_store(&c->done, 1);
  uv_async_send(&c->d->worker_calls_async);
  return NULL;
}

/* Answers a waiting op with the call's result and lets its rank go on. */
static void answer(ckpt_call *c, exec_op *op) {
  rank_state *rs = op->rank;
  op->ckpt_answered = 1;
  if (c->status == ZEROD__V1__STATUS__STATUS_OK) {
    Zerod__V1__CheckpointReply r = ZEROD__V1__CHECKPOINT_REPLY__INIT;
    r.name = c->result_name;
    r.step = c->step;
    r.stall_ms = c->stall_ms;
    r.total_ms = c->total_ms;
    r.version = atomic_load(&rs->job->latest_version);
    exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT_REPLY, &r.base);
  } else {
    exec_error(op, c->status, "%s", c->message);
  }
  exec_op *unpark = exec_op_new(OP_CKPT_UNPARK, rs);
  if (unpark != NULL) /* else the worker's next request lets the rank go on */
    exec_submit(unpark);
  c->finish_op(op);
}

/* The thread ended: the waiting workers are answered. A rank whose op has
 * not come back yet (its completion is still queued) is answered when it
 * does, from the record, which stays until every rank here was answered,
 * or nobody can come any more (the job failed, or has no worker). */
static void finish(ckpt_call *c) {
  pthread_join(c->thread, NULL);
  c->finished = 1;
  if (c->status == ZEROD__V1__STATUS__STATUS_OK)
    LOG_INFOF(c->action == ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_SAVE
                  ? "workers' checkpoint saved"
                  : "job restored for its workers",
              "job=%s checkpoint=%s step=%llu ms=%lld", c->job_name, c->result_name,
              (unsigned long long)c->step, (long long)c->total_ms);
  else
    LOG_WARNF("workers' checkpoint call failed", "job=%s action=%s err=\"%s\"", c->job_name,
              verb(c), c->message);
}

static void answer_waiting(ckpt_call *c) {
  for (int i = 0; i < c->nwaiting; i++)
    answer(c, c->waiting[i]);
  c->answered += c->nwaiting;
  c->nwaiting = 0;
}

static int over(ckpt_call *c) {
  return c->finished && (c->d->worker_calls_stopping || c->answered >= c->j->nranks ||
                         c->j->sessions == 0 || job_failed(c->j, c->generation, NULL, 0));
}

/* Drops the finished records nobody will come for (of job j; NULL: any). */
static void sweep(zdaemon *d, const job *j) {
  for (ckpt_call **p = &d->worker_calls; *p != NULL;) {
    ckpt_call *c = *p;
    if ((j != NULL && c->j != j) || !over(c)) {
      p = &c->next;
      continue;
    }
    *p = c->next;
    c->j->worker_calls--;
    free(c->waiting);
    free(c);
  }
}

static void close_async(zdaemon *d) {
  if (d->worker_calls_stopping && d->worker_calls == NULL && d->worker_calls_ready) {
    d->worker_calls_ready = 0;
    uv_close((uv_handle_t *)&d->worker_calls_async, NULL);
  }
}

static void on_calls(uv_async_t *handle) {
  zdaemon *d = handle->data;
  for (ckpt_call *c = d->worker_calls; c != NULL; c = c->next)
    if (!c->finished && atomic_load(&c->done)) {
      finish(c);
      answer_waiting(c);
    }
  sweep(d, NULL);
  close_async(d);
}

int ckpt_call_init(zdaemon *d) {
  int rc = uv_async_init(d->loop, &d->worker_calls_async, on_calls);
  d->worker_calls_async.data = d;
  d->worker_calls_ready = rc == 0;
  return rc;
}

void ckpt_call_shutdown(zdaemon *d) {
  d->worker_calls_stopping = 1;
  for (ckpt_call *c = d->worker_calls; c != NULL; c = c->next)
    atomic_store(&c->abandon, 1);
  sweep(d, NULL);
  close_async(d);
}

void ckpt_call_sweep(zdaemon *d) {
  sweep(d, NULL);
}

static ckpt_call *call_new(zdaemon *d, exec_op *op, void (*finish_op)(exec_op *op)) {
  job *j = op->rank->job;
  const Zerod__V1__CheckpointRequest *req = (const Zerod__V1__CheckpointRequest *)op->request;
  ckpt_call *c = calloc(1, sizeof *c);
  if (c == NULL || (c->waiting = calloc((size_t)j->nranks, sizeof *c->waiting)) == NULL) {
    free(c);
    return NULL;
  }
  c->d = d;
  c->finish_op = finish_op;
  c->j = j;
  c->generation = op->generation;
  c->number = op->ckpt_call;
  c->action = (int)req->action;
  snprintf(c->name, sizeof c->name, "%s", req->name);
  snprintf(c->job_name, sizeof c->job_name, "%s", j->name);
  snprintf(c->key, sizeof c->key, "%s/%u/ckpt-call/%llu", j->name, op->generation,
           (unsigned long long)op->ckpt_call);
  c->leader = j->first_rank == 0;
  c->publish = job_spans_nodes(j);
  c->channel = d->control_channel;
  c->rendezvous = d->rendezvous;
  c->t0_ms = clock_now_ms();
  return c;
}

int ckpt_call_wait(zdaemon *d, exec_op *op, void (*finish_op)(exec_op *op)) {
  if (d->worker_calls_stopping || !d->worker_calls_ready)
    return -ECANCELED;
  job *j = op->rank->job;
  sweep(d, j);
  ckpt_call *c = d->worker_calls;
  while (c != NULL && !(c->j == j && c->generation == op->generation && c->number == op->ckpt_call))
    c = c->next;
  if (c == NULL) {
    if ((c = call_new(d, op, finish_op)) == NULL)
      return -ENOMEM;
    /* The collective is over on every rank: the leader may ask at once
     * (every rank waits, so a save's copies are all of this step). */
    if (pthread_create(&c->thread, NULL, call_thread, c) != 0) {
      free(c->waiting);
      free(c);
      return -EAGAIN;
    }
    c->next = d->worker_calls;
    d->worker_calls = c;
    j->worker_calls++;
    LOG_INFOF("workers asked for a checkpoint", "job=%s action=%s name=%s step=%llu leader=%d",
              c->job_name, verb(c), c->name[0] != '\0' ? c->name : "(step)",
              (unsigned long long)op->ckpt_step, c->leader);
  }
  if (c->nwaiting + c->answered >= j->nranks)
    return -EINVAL; /* two ops of one rank for one call: cannot happen */
  c->waiting[c->nwaiting++] = op;
  if (c->finished)
    answer_waiting(c);
  return 0;
}
