/* rpc_call: a server call's context (rpc_server_impl.h): its batches,
 * its status and streamed writes, its free once nothing can touch it (the
 * call lifetime rule in rpc_server.c's opening comment); and the calls'
 * side of rpc.h that handlers use (rpc_call_*). Loop thread. */
#include "rpc.h"
#include "rpc_server_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "admit.h"
#include "log.h"

/* Audit lines carry who and what; longer values are cut. */
#define RPC_MAX_AUDIT_BYTES 256

/* ------------------------------------------------------------------------ */
/* Server: call contexts                                                    */
/* ------------------------------------------------------------------------ */

void rpc__tag_init(rpc_tag *tag, tag_kind kind, rpc_call *call) {
  tag->kind = kind;
  tag->success = 0;
  tag->next = NULL;
  tag->call = call;
}

static void call_drop_writes(rpc_call *call) {
  while (call->write_count > 0) {
    grpc_byte_buffer_destroy(call->write_queue[call->write_head]);
    call->write_queue[call->write_head] = NULL;
    call->write_head = (call->write_head + 1) % RPC_MAX_QUEUED_SENDS;
    call->write_count--;
  }
}

void rpc__call_free(rpc_call *call) {
  rpc_server *s = call->server;

  admit_wait_stop(&s->admit, &call->wait);
  admit_release(&s->admit, rpc_call_peer(call), &call->ticket);
  if (call->on_free != NULL)
    call->on_free(call->on_free_arg);
  free(call->audit_who);
  free(call->audit_what);

  if (call->call != NULL)
    grpc_call_unref(call->call);
  grpc_call_details_destroy(&call->details);
  grpc_metadata_array_destroy(&call->request_metadata);
  if (call->peer != NULL)
    gpr_free(call->peer);
  if (call->request != NULL)
    grpc_byte_buffer_destroy(call->request);
  if (call->reply != NULL)
    grpc_byte_buffer_destroy(call->reply);
  if (call->write_in_flight != NULL)
    grpc_byte_buffer_destroy(call->write_in_flight);
  call_drop_writes(call);
  if (call->has_status_details)
    grpc_slice_unref(call->status_details);
  free(call);

  s->live_calls--;
  if (!s->in_wakeup)
    s->advance_shutdown(s);
}

/* Frees the call once nothing can touch it any more (see the file comment). */
void rpc__call_maybe_free(rpc_call *call) {
  if (call->outstanding > 0 || call->busy > 0)
    return;
  if (call->handed && !call->finished)
    return;
  rpc__call_free(call);
}

/* Starts a batch; on success the tag will come back through the loop. */
int rpc__call_start_batch(rpc_call *call, const grpc_op *ops, size_t n_ops, rpc_tag *tag) {
  grpc_call_error err = grpc_call_start_batch(call->call, ops, n_ops, tag, NULL);
  if (err != GRPC_CALL_OK) {
    LOG_ERRORF("rpc batch refused", "error=%s kind=%d", grpc_call_error_to_string(err),
               (int)tag->kind);
    return -EIO;
  }
  call->outstanding++;
  return 0;
}

/* The call is dead on the wire: drop what was waiting to be sent and tell
 * the handler, once, if it still owns the call. */
void rpc__call_mark_cancelled(rpc_call *call) {
  call->cancelled = 1;
  call->status_pending = 0;
  call_drop_writes(call);
  if (call->handed && !call->finished && !call->cancel_notified) {
    call->cancel_notified = 1;
    if (call->cancel_cb != NULL) {
      call->busy++;
      call->cancel_cb(call, call->cancel_arg);
      call->busy--;
    }
  }
}

/* Sends the status (with initial metadata if none went out, and the unary
 * reply). A refused batch leaves no way to end the call cleanly, so it is
 * cancelled: RECV_CLOSE then completes and frees it. */
void rpc__call_send_status(rpc_call *call) {
  grpc_op ops[3];
  size_t n_ops = 0;

  memset(ops, 0, sizeof ops);
  if (!call->metadata_sent) {
    ops[n_ops].op = GRPC_OP_SEND_INITIAL_METADATA;
    n_ops++;
  }
  if (call->reply != NULL) {
    ops[n_ops].op = GRPC_OP_SEND_MESSAGE;
    ops[n_ops].data.send_message.send_message = call->reply;
    n_ops++;
  }
  ops[n_ops].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n_ops].data.send_status_from_server.status = call->status;
  ops[n_ops].data.send_status_from_server.status_details =
      call->has_status_details ? &call->status_details : NULL;
  n_ops++;

  call->status_pending = 0;
  if (rpc__call_start_batch(call, ops, n_ops, &call->tag_status) == 0) {
    call->metadata_sent = 1;
    call->status_started = 1;
  } else {
    grpc_call_cancel(call->call, NULL);
  }
}

/* Starts the next queued write, or the status once the queue has drained. */
void rpc__call_pump_writes(rpc_call *call) {
  if (call->cancelled || call->write_in_flight != NULL)
    return;
  if (call->write_count == 0) {
    if (call->status_pending)
      rpc__call_send_status(call);
    return;
  }

  grpc_op ops[2];
  size_t n_ops = 0;
  grpc_byte_buffer *message = call->write_queue[call->write_head];

  memset(ops, 0, sizeof ops);
  if (!call->metadata_sent) {
    ops[n_ops].op = GRPC_OP_SEND_INITIAL_METADATA;
    n_ops++;
  }
  ops[n_ops].op = GRPC_OP_SEND_MESSAGE;
  ops[n_ops].data.send_message.send_message = message;
  n_ops++;

  if (rpc__call_start_batch(call, ops, n_ops, &call->tag_write) < 0) {
    grpc_call_cancel(call->call, NULL); /* RECV_CLOSE reports it */
    return;
  }
  call->metadata_sent = 1;
  call->write_queue[call->write_head] = NULL;
  call->write_head = (call->write_head + 1) % RPC_MAX_QUEUED_SENDS;
  call->write_count--;
  call->write_in_flight = message;
}

/* Records the status to send when the writes have drained. */
void rpc__call_set_status(rpc_call *call, int status, const char *message) {
  if (status < 0 || status > RPC_UNAUTHENTICATED)
    status = RPC_UNKNOWN;
  call->status = (grpc_status_code)status;
  if (message != NULL && message[0] != '\0') {
    call->status_details =
        grpc_slice_from_copied_buffer(message, strnlen(message, RPC_MAX_STATUS_BYTES));
    call->has_status_details = 1;
  }
  call->status_pending = 1;
}

int rpc__server_arm_request(rpc_server *s) {
  rpc_call *call = calloc(1, sizeof(*call));
  if (call == NULL)
    return -ENOMEM;
  call->server = s;
  grpc_call_details_init(&call->details);
  grpc_metadata_array_init(&call->request_metadata);
  rpc__tag_init(&call->tag_new, TAG_NEW_CALL, call);
  rpc__tag_init(&call->tag_request, TAG_REQUEST, call);
  rpc__tag_init(&call->tag_close, TAG_CLOSE, call);
  rpc__tag_init(&call->tag_write, TAG_WRITE, call);
  rpc__tag_init(&call->tag_status, TAG_STATUS, call);
  call->principal = RPC_PRINCIPAL_TRUSTED;
  s->live_calls++;

  grpc_call_error err =
      grpc_server_request_call(s->server, &call->call, &call->details, &call->request_metadata,
                               s->cq, s->cq, &call->tag_new);
  if (err != GRPC_CALL_OK) {
    LOG_ERRORF("rpc request_call refused", "error=%s", grpc_call_error_to_string(err));
    rpc__call_free(call);
    return -EIO;
  }
  call->outstanding = 1;
  return 0;
}

const rpc_method *rpc__server_find_method(const rpc_server *s, grpc_slice path) {
  size_t n_bytes = GRPC_SLICE_LENGTH(path);
  for (unsigned i = 0; i < s->method_count; i++) {
    const rpc_method *m = &s->methods[i];
    if (m->path_bytes == n_bytes && memcmp(m->path, GRPC_SLICE_START_PTR(path), n_bytes) == 0)
      return m;
  }
  return NULL;
}

/* Reads what the transport knows of the caller: Unix socket, plain TCP
 * or TLS, and over TLS the common name of a client certificate gRPC has
 * verified (GRPC_SSL_REQUEST_*_AND_VERIFY: a certificate that does not
 * verify never gets this far). */
void rpc__call_read_auth(rpc_call *call) {
  call->transport = RPC_TRANSPORT_PLAIN;
  call->cert_name[0] = '\0';
  if (call->peer != NULL && strncmp(call->peer, "unix:", 5) == 0) {
    call->transport = RPC_TRANSPORT_UNIX;
    return;
  }
  grpc_auth_context *ctx = grpc_call_auth_context(call->call);
  if (ctx == NULL)
    return;
  grpc_auth_property_iterator it =
      grpc_auth_context_find_properties_by_name(ctx, GRPC_TRANSPORT_SECURITY_TYPE_PROPERTY_NAME);
  const grpc_auth_property *p = grpc_auth_property_iterator_next(&it);
  if (p != NULL && p->value_length == strlen(GRPC_SSL_TRANSPORT_SECURITY_TYPE) &&
      memcmp(p->value, GRPC_SSL_TRANSPORT_SECURITY_TYPE, p->value_length) == 0) {
    call->transport = RPC_TRANSPORT_TLS;
    it = grpc_auth_context_find_properties_by_name(ctx, GRPC_X509_CN_PROPERTY_NAME);
    p = grpc_auth_property_iterator_next(&it);
    /* A name with a NUL inside, or one too long to be a principal's, is
     * no name: the call is then as one without a certificate. */
    if (p != NULL && p->value_length > 0 && p->value_length < sizeof call->cert_name &&
        memchr(p->value, '\0', p->value_length) == NULL) {
      memcpy(call->cert_name, p->value, p->value_length);
      call->cert_name[p->value_length] = '\0';
    }
  }
  grpc_auth_context_release(ctx);
}

/* ------------------------------------------------------------------------ */
/* Server: calls                                                            */
/* ------------------------------------------------------------------------ */

void rpc_call_finish(rpc_call *call, int status, const char *message, const void *reply,
                     size_t reply_bytes) {
  if (call == NULL)
    return;
  if (call->finished) {
    LOG_ERRORF("rpc call finished twice", "method=%s", call->method->path);
    return;
  }
  call->finished = 1;
  rpc_server *s = call->server;
  if (s->observer != NULL)
    s->observer(s->observer_arg, call->method->path, call->cancelled ? RPC_CANCELLED : status,
                (double)(uv_hrtime() - call->arrived_ns) * 1e-9);
  if (call->audit_who != NULL) {
    char quoted[RPC_MAX_STATUS_BYTES];
    LOG_INFOF("audit", "method=%s principal=%s %s status=%s message=%s", call->method->path,
              call->audit_who, call->audit_what,
              call->cancelled ? "CANCELLED" : rpc_status_name(status),
              log_quote(call->cancelled   ? "cancelled by the client"
                        : message != NULL ? message
                                          : "",
                        quoted, sizeof quoted));
  }
  if (call->cancelled) {
    rpc__call_maybe_free(call);
    return;
  }

  if (call->method->kind == RPC_UNARY && status == RPC_OK) {
    if (reply_bytes > RPC_MAX_MESSAGE_BYTES) {
      char text[128];
      snprintf(text, sizeof text, "reply of %zu bytes exceeds the %u-byte limit", reply_bytes,
               RPC_MAX_MESSAGE_BYTES);
      LOG_WARNF("rpc reply too large", "method=%s reply_bytes=%zu limit=%u", call->method->path,
                reply_bytes, RPC_MAX_MESSAGE_BYTES);
      rpc__call_set_status(call, RPC_RESOURCE_EXHAUSTED, text);
    } else if (reply == NULL && reply_bytes > 0) {
      rpc__call_set_status(call, RPC_INTERNAL, "reply missing");
    } else {
      call->reply = rpc__buffer_from_bytes(reply, reply_bytes);
      rpc__call_set_status(call, RPC_OK, message);
    }
  } else {
    if (reply != NULL && call->method->kind == RPC_SERVER_STREAM)
      LOG_WARNF("rpc stream finished with a reply; dropped", "method=%s", call->method->path);
    rpc__call_set_status(call, status, message);
  }
  rpc__call_pump_writes(call);
  rpc__call_maybe_free(call);
}

int rpc_call_send(rpc_call *call, const void *message, size_t message_bytes) {
  if (call == NULL || (message == NULL && message_bytes > 0))
    return -EINVAL;
  if (call->method->kind != RPC_SERVER_STREAM || call->finished)
    return -EINVAL;
  if (call->cancelled)
    return -EPIPE;
  if (message_bytes > RPC_MAX_MESSAGE_BYTES)
    return -EMSGSIZE;
  if (call->write_count == RPC_MAX_QUEUED_SENDS)
    return -ENOBUFS;

  unsigned slot = (call->write_head + call->write_count) % RPC_MAX_QUEUED_SENDS;
  call->write_queue[slot] = rpc__buffer_from_bytes(message, message_bytes);
  call->write_count++;
  rpc__call_pump_writes(call);
  return 0;
}

void rpc_call_set_cancel(rpc_call *call, rpc_cancel_cb cb, void *arg) {
  if (call == NULL)
    return;
  call->cancel_cb = cb;
  call->cancel_arg = arg;
}

int rpc_call_cancelled(const rpc_call *call) {
  return call != NULL && call->cancelled;
}

int64_t rpc_call_remaining_ms(const rpc_call *call) {
  if (call->deadline.tv_sec == INT64_MAX)
    return INT64_MAX;
  gpr_timespec left = gpr_time_sub(call->deadline, gpr_now(GPR_CLOCK_MONOTONIC));
  return (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
}

const char *rpc_call_peer(const rpc_call *call) {
  return call->peer != NULL ? call->peer : "unknown";
}

int rpc_call_method_anonymous(const rpc_call *call) {
  return call->method != NULL && call->method->anonymous;
}

long rpc_call_principal(const rpc_call *call) {
  return call->principal;
}

rpc_transport rpc_call_transport(const rpc_call *call) {
  return call->transport;
}

const char *rpc_call_cert_name(const rpc_call *call) {
  return call->cert_name;
}

int rpc_call_metadata(const rpc_call *call, const char *key, char *out, size_t out_bytes) {
  size_t key_bytes = strlen(key);
  for (size_t i = 0; i < call->request_metadata.count; i++) {
    const grpc_metadata *md = &call->request_metadata.metadata[i];
    if (GRPC_SLICE_LENGTH(md->key) != key_bytes ||
        memcmp(GRPC_SLICE_START_PTR(md->key), key, key_bytes) != 0)
      continue;
    size_t n = GRPC_SLICE_LENGTH(md->value);
    if (n >= out_bytes)
      return -E2BIG;
    if (memchr(GRPC_SLICE_START_PTR(md->value), '\0', n) != NULL)
      return -EBADMSG;
    memcpy(out, GRPC_SLICE_START_PTR(md->value), n);
    out[n] = '\0';
    return (int)n;
  }
  return -ENOENT;
}

static char *dup_bounded(const char *s) {
  size_t n = strnlen(s != NULL ? s : "", RPC_MAX_AUDIT_BYTES);
  char *copy = malloc(n + 1);
  if (copy != NULL) {
    memcpy(copy, s != NULL ? s : "", n);
    copy[n] = '\0';
  }
  return copy;
}

void rpc_call_audit(rpc_call *call, const char *who, const char *what) {
  free(call->audit_who);
  free(call->audit_what);
  call->audit_who = dup_bounded(who);
  call->audit_what = dup_bounded(what);
  if (call->audit_who == NULL || call->audit_what == NULL) {
    LOG_ERRORF("audit line lost (out of memory)", "method=%s principal=%s", call->method->path,
               who);
    free(call->audit_who);
    free(call->audit_what);
    call->audit_who = call->audit_what = NULL;
  }
}

void rpc_call_on_free(rpc_call *call, void (*fn)(void *arg), void *arg) {
  call->on_free = fn;
  call->on_free_arg = arg;
}
