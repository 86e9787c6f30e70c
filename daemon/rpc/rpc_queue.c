/* rpc_queue: the server's completion queue, from both sides (the
 * threading rule is in rpc_server.c's opening comment): the queue thread
 * that hands each finished batch's tag to the loop, and on the loop each
 * event moving its call along (a new call identified and admitted,
 * admit.h, its request handed to the handler, its writes, status and
 * close), with the refusals logged at most once a second and requests that
 * do not come in time cancelled. */
#include "rpc.h"
#include "rpc_server_impl.h"

#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include "admit.h"
#include "log.h"

/* Calls refused as they arrive are logged at most once a second, with a
 * count of those not logged: a flood must not fill the disk with lines. */
#define RPC_REFUSAL_LOG_MS 1000

/* ------------------------------------------------------------------------ */
/* Server: admission (admit.h)                                              */
/* ------------------------------------------------------------------------ */

/* Identifies the caller and takes the call in (admit.h), counted under
 * its peer as gRPC names it. Returns 0, or the status to refuse it with
 * and why. */
static int call_admit(rpc_server *s, rpc_call *call, char *why, size_t why_bytes) {
  char name[RPC_MAX_PATH_BYTES] = "";
  call->principal = RPC_PRINCIPAL_TRUSTED;
  if (s->identify != NULL) {
    int status =
        s->identify(s->identify_arg, call, &call->principal, name, sizeof name, why, why_bytes);
    if (status != 0)
      return status;
  }
  admit_request req = {.peer = rpc_call_peer(call),
                       .anonymous = call->principal == RPC_PRINCIPAL_ANONYMOUS,
                       .principal = call->principal >= 0 ? call->principal : -1,
                       .principal_name = name,
                       .priority = call->method->priority};
  return admit_call(&s->admit, &req, &call->ticket, why, why_bytes) == 0 ? 0
                                                                         : RPC_RESOURCE_EXHAUSTED;
}

/* Logs a refusal, at most one a second (admit_log_due). */
static void refusal_log(rpc_server *s, const rpc_call *call, int status, const char *why) {
  unsigned unlogged;
  if (!admit_log_due(&s->admit, uv_hrtime(), (uint64_t)RPC_REFUSAL_LOG_MS * 1000000u, &unlogged))
    return;
  char quoted[RPC_MAX_STATUS_BYTES + 64];
  LOG_WARNF("call refused", "method=%s peer=%s status=%s reason=%s unlogged_since_last=%u",
            call->method->path, rpc_call_peer(call), rpc_status_name(status),
            log_quote(why, quoted, sizeof quoted), unlogged);
}

/* Answers a call that was not admitted: it held nothing, and ends now. */
static void call_refuse(rpc_server *s, rpc_call *call, int status, const char *why) {
  refusal_log(s, call, status, why);
  if (s->observer != NULL)
    s->observer(s->observer_arg, call->method->path, status, 0);
  rpc__call_set_status(call, status, why);
  rpc__call_send_status(call);
}

/* How long an admitted call may take to send its request message. */
static int request_wait_ms(const rpc_call *call) {
  return call->ticket.anonymous ? RPC_ANONYMOUS_REQUEST_MS : RPC_REQUEST_MS;
}

/* Cancels the calls whose request is overdue (from the listener timer).
 * gRPC then completes their RECV_MESSAGE and RECV_CLOSE, which free them. */
void rpc__sweep_awaiting(rpc_server *s) {
  uint64_t now = uv_hrtime();
  admit_wait *w;
  while ((w = admit_wait_overdue(&s->admit, now)) != NULL) {
    rpc_call *call = (rpc_call *)((char *)w - offsetof(rpc_call, wait));
    call->request_timed_out = 1;
    char why[160];
    snprintf(why, sizeof why, "the request message did not arrive within %d ms of the call",
             request_wait_ms(call));
    refusal_log(s, call, RPC_DEADLINE_EXCEEDED, why);
    grpc_call_cancel_with_status(call->call, GRPC_STATUS_DEADLINE_EXCEEDED, why, NULL);
  }
}

/* ------------------------------------------------------------------------ */
/* Server: events                                                           */
/* ------------------------------------------------------------------------ */

static void on_new_call(rpc_call *call, int success) {
  rpc_server *s = call->server;

  call->outstanding--;
  if (!success || call->call == NULL) {
    /* Pending requests fail this way when the server shuts down. */
    if (s->state == SERVER_RUNNING)
      LOG_WARNF("rpc request_call failed", "addr=%s", s->addr);
    rpc__call_free(call);
    return;
  }
  if (s->state == SERVER_RUNNING && rpc__server_arm_request(s) < 0)
    LOG_ERRORF("rpc cannot re-arm request_call", "addr=%s armed_less_one=1", s->addr);

  call->peer = grpc_call_get_peer(call->call);
  call->arrived_ns = uv_hrtime();
  gpr_timespec deadline = call->details.deadline;
  if (deadline.tv_sec == INT64_MAX)
    call->deadline = gpr_inf_future(GPR_CLOCK_MONOTONIC);
  else
    call->deadline = gpr_convert_clock_type(deadline, GPR_CLOCK_MONOTONIC);
  call->method = rpc__server_find_method(s, call->details.method);
  rpc__call_read_auth(call);

  /* RECV_CLOSE_ON_SERVER goes first and alone: it completes when the call
   * ends for any reason, which is how a cancellation is noticed while the
   * handler is still working. */
  grpc_op close_op;
  memset(&close_op, 0, sizeof close_op);
  close_op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  close_op.data.recv_close_on_server.cancelled = &call->close_cancelled;
  if (rpc__call_start_batch(call, &close_op, 1, &call->tag_close) < 0) {
    grpc_call_cancel(call->call, NULL);
    rpc__call_maybe_free(call);
    return;
  }

  if (s->state != SERVER_RUNNING) {
    /* Matched just before shutdown began: end it like the others. */
    grpc_call_cancel(call->call, NULL);
    return;
  }

  if (call->method == NULL) {
    char message[RPC_MAX_PATH_BYTES + 32];
    snprintf(message, sizeof message, "unknown method %.*s",
             (int)(GRPC_SLICE_LENGTH(call->details.method) < RPC_MAX_PATH_BYTES
                       ? GRPC_SLICE_LENGTH(call->details.method)
                       : RPC_MAX_PATH_BYTES),
             (const char *)GRPC_SLICE_START_PTR(call->details.method));
    rpc__call_set_status(call, RPC_UNIMPLEMENTED, message);
    rpc__call_send_status(call);
    return;
  }

  char why[RPC_MAX_STATUS_BYTES];
  int status = call_admit(s, call, why, sizeof why);
  if (status != 0) {
    call_refuse(s, call, status, why);
    return;
  }
  admit_wait_start(&s->admit, &call->wait, &call->ticket,
                   call->arrived_ns + (uint64_t)request_wait_ms(call) * 1000000u);
  grpc_op recv_op;
  memset(&recv_op, 0, sizeof recv_op);
  recv_op.op = GRPC_OP_RECV_MESSAGE;
  recv_op.data.recv_message.recv_message = &call->request;
  if (rpc__call_start_batch(call, &recv_op, 1, &call->tag_request) < 0)
    grpc_call_cancel(call->call, NULL);
}

static void on_request(rpc_call *call, int success) {
  grpc_byte_buffer *request = call->request;

  call->outstanding--;
  call->request = NULL;
  admit_wait_stop(&call->server->admit, &call->wait);
  if (!success || call->cancelled || call->request_timed_out) {
    /* The call died before its request arrived; RECV_CLOSE will say so. */
    if (request != NULL)
      grpc_byte_buffer_destroy(request);
    rpc__call_maybe_free(call);
    return;
  }
  if (request == NULL) {
    /* The client half-closed without a request message. */
    rpc__call_set_status(call, RPC_INVALID_ARGUMENT, "request message missing");
    rpc__call_send_status(call);
    return;
  }

  grpc_slice flat;
  int rc = rpc__buffer_flatten(request, &flat);
  grpc_byte_buffer_destroy(request);
  if (rc < 0) {
    rpc__call_set_status(call, rc == -EMSGSIZE ? RPC_RESOURCE_EXHAUSTED : RPC_INTERNAL,
                         "cannot read the request message");
    rpc__call_send_status(call);
    return;
  }

  call->handed = 1;
  call->busy++;
  call->method->handler(call, GRPC_SLICE_START_PTR(flat), GRPC_SLICE_LENGTH(flat),
                        call->method->arg);
  call->busy--;
  grpc_slice_unref(flat);
  rpc__call_maybe_free(call);
}

static void on_close(rpc_call *call, int success) {
  call->outstanding--;
  /* RECV_CLOSE_ON_SERVER always succeeds; cancelled says how it ended. */
  if (call->close_cancelled && !call->cancelled)
    rpc__call_mark_cancelled(call);
  rpc__call_maybe_free(call);
}

static void on_write(rpc_call *call, int success) {
  call->outstanding--;
  if (call->write_in_flight != NULL) {
    grpc_byte_buffer_destroy(call->write_in_flight);
    call->write_in_flight = NULL;
  }
  if (!success) {
    if (!call->cancelled)
      rpc__call_mark_cancelled(call);
  } else {
    rpc__call_pump_writes(call);
  }
  rpc__call_maybe_free(call);
}

static void on_status(rpc_call *call, int success) {
  call->outstanding--;
  if (call->reply != NULL) {
    grpc_byte_buffer_destroy(call->reply);
    call->reply = NULL;
  }
  if (call->has_status_details) {
    grpc_slice_unref(call->status_details);
    call->has_status_details = 0;
  }
  rpc__call_maybe_free(call);
}

void rpc__server_handle_event(rpc_server *s, rpc_tag *tag) {
  switch (tag->kind) {
  case TAG_SHUTDOWN:
    s->shutdown_notified = 1;
    break;
  case TAG_NEW_CALL:
    on_new_call(tag->call, tag->success);
    break;
  case TAG_REQUEST:
    on_request(tag->call, tag->success);
    break;
  case TAG_CLOSE:
    on_close(tag->call, tag->success);
    break;
  case TAG_WRITE:
    on_write(tag->call, tag->success);
    break;
  case TAG_STATUS:
    on_status(tag->call, tag->success);
    break;
  }
}

/* The queue thread: never runs a handler, never touches a call. */
void rpc__cq_thread_main(void *arg) {
  rpc_server *s = arg;

  pthread_setname_np(pthread_self(), "zd-rpc-cq");
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN)
      break;
    if (ev.type != GRPC_OP_COMPLETE)
      continue;
    rpc_tag *tag = ev.tag;
    uv_mutex_lock(&s->lock);
    tag->success = ev.success;
    tag->next = NULL;
    if (s->events_tail != NULL)
      s->events_tail->next = tag;
    else
      s->events_head = tag;
    s->events_tail = tag;
    uv_mutex_unlock(&s->lock);
    uv_async_send(s->wakeup);
  }
  uv_mutex_lock(&s->lock);
  s->cq_thread_exited = 1;
  uv_mutex_unlock(&s->lock);
  uv_async_send(s->wakeup);
}
