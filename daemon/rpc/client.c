/* client: the blocking side of rpc.h — channels (TLS, a bearer token),
 * unary calls and server streams, each call with a pluck queue of its own
 * and a deadline. Thread-safe; never on a loop thread. The helpers it
 * shares with the server are in rpc_impl.h. */
#include "rpc.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include "rpc_impl.h"

/* A client reconnects to a restarted daemon within this, instead of gRPC's
 * default backoff that grows to two minutes. */
#define RPC_MAX_RECONNECT_MS 5000

struct rpc_channel {
  grpc_channel *channel;
  grpc_metadata auth; /* "authorization: Bearer ..." */
  size_t n_auth;      /* 1 when auth is set */
};

struct rpc_stream {
  grpc_completion_queue *cq;
  grpc_call *call; /* NULL when the stream failed before it began */
  grpc_metadata_array initial_metadata;
  grpc_metadata_array trailing_metadata;
  grpc_status_code status;
  grpc_slice status_details;
  int start_pending;  /* the send batch's tag is not yet plucked */
  int status_pending; /* RECV_STATUS_ON_CLIENT's tag is not yet plucked */
  int read_tag;       /* address used as the RECV_MESSAGE tag */
  int ended;
  atomic_int cancel_requested;
  rpc_result final;
};

static void result_set(rpc_result *result, int status, const char *message, size_t message_bytes) {
  result->status = status;
  if (message_bytes >= sizeof(result->message))
    message_bytes = sizeof(result->message) - 1;
  if (message_bytes > 0)
    memcpy(result->message, message, message_bytes);
  result->message[message_bytes] = '\0';
}

static void result_from_grpc(rpc_result *result, grpc_status_code status, grpc_slice details) {
  size_t n_bytes = GRPC_SLICE_LENGTH(details);
  if (n_bytes == 0 && status != GRPC_STATUS_OK) {
    const char *name = rpc_status_name((int)status);
    result_set(result, (int)status, name, strlen(name));
  } else {
    result_set(result, (int)status, (const char *)GRPC_SLICE_START_PTR(details), n_bytes);
  }
}

static int method_valid(const char *method) {
  return method != NULL && method[0] == '/' && strlen(method) < RPC_MAX_PATH_BYTES;
}

static gpr_timespec deadline_after(int timeout_ms) {
  if (timeout_ms <= 0)
    return gpr_inf_future(GPR_CLOCK_MONOTONIC);
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

/* Shuts down a pluck queue whose tags have all been plucked, drains it and
 * destroys it. */
static void pluck_queue_destroy(grpc_completion_queue *cq) {
  grpc_completion_queue_shutdown(cq);
  grpc_event ev;
  do {
    ev = grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  } while (ev.type != GRPC_QUEUE_SHUTDOWN);
  grpc_completion_queue_destroy(cq);
}

int rpc_channel_create(const char *target, rpc_channel **out, char *err, size_t err_bytes) {
  return rpc_channel_create_with(target, NULL, out, err, err_bytes);
}

/* A token goes into an HTTP/2 header: printable ASCII only. */
static int token_valid(const char *token) {
  size_t n = strlen(token);
  if (n > RPC_MAX_TOKEN_BYTES)
    return 0;
  for (size_t i = 0; i < n; i++) {
    if (token[i] < 0x21 || token[i] > 0x7e)
      return 0;
  }
  return 1;
}

int rpc_channel_create_with(const char *target, const rpc_channel_options *options,
                            rpc_channel **out, char *err, size_t err_bytes) {
  *out = NULL;
  const char *token = options != NULL ? options->token : NULL;
  if (token != NULL && token[0] != '\0' && !token_valid(token)) {
    snprintf(err, err_bytes,
             "rpc channel: the token must be 1..%d bytes of printable ASCII without spaces",
             RPC_MAX_TOKEN_BYTES);
    return -EINVAL;
  }
  if (target == NULL || target[0] == '\0' || strlen(target) >= RPC_MAX_ADDR_BYTES) {
    snprintf(err, err_bytes, "rpc channel: target missing or longer than %d bytes",
             RPC_MAX_ADDR_BYTES - 1);
    return -EINVAL;
  }
  rpc_channel *ch = calloc(1, sizeof(*ch));
  if (ch == NULL) {
    snprintf(err, err_bytes, "rpc channel: out of memory");
    return -ENOMEM;
  }

  rpc__grpc_init(); /* balanced in rpc_channel_destroy */
  grpc_arg args[4];
  size_t n_args;
  rpc__message_limit_args(args, &n_args);
  rpc__arg_int(args, &n_args, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, RPC_MAX_RECONNECT_MS);
  const rpc_tls *tls = options != NULL ? options->tls : NULL;
  if (tls != NULL && tls->server_name != NULL && tls->server_name[0] != '\0') {
    args[n_args].type = GRPC_ARG_STRING;
    args[n_args].key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
    args[n_args].value.string = (char *)tls->server_name;
    n_args++;
  }
  grpc_channel_args channel_args = {.num_args = n_args, .args = args};
  grpc_channel_credentials *creds = NULL;
  if (tls != NULL) {
    int rc = rpc__channel_credentials(tls, &creds, err, err_bytes);
    if (rc != 0) {
      free(ch);
      grpc_shutdown();
      return rc;
    }
  } else {
    creds = grpc_insecure_credentials_create();
  }
  ch->channel = grpc_channel_create(target, creds, &channel_args);
  grpc_channel_credentials_release(creds);
  if (ch->channel == NULL) {
    snprintf(err, err_bytes, "rpc channel: cannot create a channel to %s", target);
    free(ch);
    grpc_shutdown();
    return -EINVAL;
  }
  if (token != NULL && token[0] != '\0') {
    char value[RPC_MAX_TOKEN_BYTES + 8];
    snprintf(value, sizeof value, "Bearer %s", token);
    ch->auth.key = grpc_slice_from_static_string("authorization");
    ch->auth.value = grpc_slice_from_copied_string(value);
    ch->n_auth = 1;
  }
  *out = ch;
  return 0;
}

void rpc_channel_destroy(rpc_channel *ch) {
  if (ch == NULL)
    return;
  grpc_channel_destroy(ch->channel);
  if (ch->n_auth > 0)
    grpc_slice_unref(ch->auth.value);
  free(ch);
  grpc_shutdown();
}

/* The first four ops of every client call, unary or streaming: the
 * channel's metadata (its bearer token), the one request, the half-close,
 * and the server's initial metadata into initial_metadata. */
static void request_ops(rpc_channel *ch, grpc_byte_buffer *request,
                        grpc_metadata_array *initial_metadata, grpc_op ops[4]) {
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[0].data.send_initial_metadata.count = ch->n_auth;
  ops[0].data.send_initial_metadata.metadata = ch->n_auth > 0 ? &ch->auth : NULL;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = request;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = initial_metadata;
}

int rpc_unary(rpc_channel *ch, const char *method, const void *request, size_t request_bytes,
              int timeout_ms, uint8_t **reply, size_t *reply_bytes, rpc_result *result) {
  rpc_result local_result;
  if (result == NULL)
    result = &local_result;
  if (reply != NULL)
    *reply = NULL;
  if (reply_bytes != NULL)
    *reply_bytes = 0;

  if (ch == NULL || !method_valid(method) || (request == NULL && request_bytes > 0) ||
      reply == NULL || reply_bytes == NULL) {
    static const char text[] = "rpc_unary: bad arguments";
    result_set(result, RPC_INVALID_ARGUMENT, text, sizeof text - 1);
    return result->status;
  }
  if (request_bytes > RPC_MAX_MESSAGE_BYTES) {
    char text[128];
    int n = snprintf(text, sizeof text, "request of %zu bytes exceeds the %u-byte limit",
                     request_bytes, RPC_MAX_MESSAGE_BYTES);
    result_set(result, RPC_RESOURCE_EXHAUSTED, text, (size_t)n);
    return result->status;
  }

  grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
  grpc_slice method_slice = grpc_slice_from_copied_string(method);
  grpc_call *call = grpc_channel_create_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                             method_slice, NULL, deadline_after(timeout_ms), NULL);
  grpc_slice_unref(method_slice);

  grpc_byte_buffer *request_buffer = rpc__buffer_from_bytes(request, request_bytes);
  grpc_byte_buffer *reply_buffer = NULL;
  grpc_metadata_array initial_metadata, trailing_metadata;
  grpc_metadata_array_init(&initial_metadata);
  grpc_metadata_array_init(&trailing_metadata);
  grpc_status_code status = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();

  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  request_ops(ch, request_buffer, &initial_metadata, ops);
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &reply_buffer;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &trailing_metadata;
  ops[5].data.recv_status_on_client.status = &status;
  ops[5].data.recv_status_on_client.status_details = &details;

  int tag;
  grpc_call_error err = grpc_call_start_batch(call, ops, 6, &tag, NULL);
  if (err != GRPC_CALL_OK) {
    char text[128];
    int n =
        snprintf(text, sizeof text, "rpc_unary: batch refused: %s", grpc_call_error_to_string(err));
    result_set(result, RPC_INTERNAL, text, (size_t)n);
  } else {
    /* The call's deadline bounds this wait: RECV_STATUS always completes. */
    grpc_event ev = grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type != GRPC_OP_COMPLETE) {
      static const char text[] = "rpc_unary: completion queue failed";
      result_set(result, RPC_INTERNAL, text, sizeof text - 1);
    } else {
      result_from_grpc(result, status, details);
      if (status == GRPC_STATUS_OK) {
        int rc = reply_buffer == NULL ? -ENODATA
                                      : rpc__buffer_to_malloc(reply_buffer, reply, reply_bytes);
        if (rc < 0) {
          char text[128];
          int n = snprintf(text, sizeof text, "rpc_unary: reply unreadable: %s", strerror(-rc));
          result_set(result, RPC_INTERNAL, text, (size_t)n);
        }
      }
    }
  }

  if (reply_buffer != NULL)
    grpc_byte_buffer_destroy(reply_buffer);
  grpc_byte_buffer_destroy(request_buffer);
  grpc_slice_unref(details);
  grpc_metadata_array_destroy(&initial_metadata);
  grpc_metadata_array_destroy(&trailing_metadata);
  grpc_call_unref(call);
  pluck_queue_destroy(cq);
  return result->status;
}

int rpc_stream_open(rpc_channel *ch, const char *method, const void *request, size_t request_bytes,
                    int timeout_ms, rpc_stream **out) {
  *out = NULL;
  if (ch == NULL || !method_valid(method) || (request == NULL && request_bytes > 0))
    return -EINVAL;
  rpc_stream *st = calloc(1, sizeof(*st));
  if (st == NULL)
    return -ENOMEM;
  atomic_init(&st->cancel_requested, 0);
  grpc_metadata_array_init(&st->initial_metadata);
  grpc_metadata_array_init(&st->trailing_metadata);
  st->status_details = grpc_empty_slice();
  st->status = GRPC_STATUS_UNKNOWN;
  st->cq = grpc_completion_queue_create_for_pluck(NULL);

  if (request_bytes > RPC_MAX_MESSAGE_BYTES) {
    /* Fails at once; rpc_stream_read reports it. */
    char text[128];
    int n = snprintf(text, sizeof text, "request of %zu bytes exceeds the %u-byte limit",
                     request_bytes, RPC_MAX_MESSAGE_BYTES);
    result_set(&st->final, RPC_RESOURCE_EXHAUSTED, text, (size_t)n);
    st->ended = 1;
    *out = st;
    return 0;
  }

  grpc_slice method_slice = grpc_slice_from_copied_string(method);
  st->call = grpc_channel_create_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS, st->cq,
                                      method_slice, NULL, deadline_after(timeout_ms), NULL);
  grpc_slice_unref(method_slice);

  /* The request buffer may be destroyed once the batch has started: the
   * send op took over its slices. */
  grpc_byte_buffer *request_buffer = rpc__buffer_from_bytes(request, request_bytes);
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  request_ops(ch, request_buffer, &st->initial_metadata, ops);
  grpc_call_error err = grpc_call_start_batch(st->call, ops, 4, &st->start_pending, NULL);
  grpc_byte_buffer_destroy(request_buffer);
  if (err == GRPC_CALL_OK)
    st->start_pending = 1;

  grpc_op status_op;
  memset(&status_op, 0, sizeof status_op);
  status_op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  status_op.data.recv_status_on_client.trailing_metadata = &st->trailing_metadata;
  status_op.data.recv_status_on_client.status = &st->status;
  status_op.data.recv_status_on_client.status_details = &st->status_details;
  grpc_call_error status_err = GRPC_CALL_ERROR;
  if (err == GRPC_CALL_OK)
    status_err = grpc_call_start_batch(st->call, &status_op, 1, &st->status_pending, NULL);
  if (status_err == GRPC_CALL_OK)
    st->status_pending = 1;

  if (err != GRPC_CALL_OK || status_err != GRPC_CALL_OK) {
    char text[128];
    int n = snprintf(text, sizeof text, "rpc_stream_open: batch refused: %s",
                     grpc_call_error_to_string(err != GRPC_CALL_OK ? err : status_err));
    grpc_call_cancel(st->call, NULL);
    result_set(&st->final, RPC_INTERNAL, text, (size_t)n);
    st->ended = 1;
  }
  *out = st;
  return 0;
}

static void stream_pluck(rpc_stream *st, int *pending_tag) {
  if (!*pending_tag)
    return;
  grpc_completion_queue_pluck(st->cq, pending_tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  *pending_tag = 0;
}

/* The stream has no more messages: collect its status. */
static void stream_end(rpc_stream *st) {
  int had_status = st->status_pending;
  stream_pluck(st, &st->status_pending);
  stream_pluck(st, &st->start_pending);
  if (had_status)
    result_from_grpc(&st->final, st->status, st->status_details);
  if (atomic_load(&st->cancel_requested)) {
    static const char text[] = "cancelled by the client";
    result_set(&st->final, RPC_CANCELLED, text, sizeof text - 1);
  }
  st->ended = 1;
}

int rpc_stream_read(rpc_stream *st, uint8_t **message, size_t *message_bytes, rpc_result *result) {
  *message = NULL;
  *message_bytes = 0;
  if (!st->ended && atomic_load(&st->cancel_requested))
    stream_end(st);
  while (!st->ended) {
    grpc_byte_buffer *buffer = NULL;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &buffer;
    if (grpc_call_start_batch(st->call, &op, 1, &st->read_tag, NULL) != GRPC_CALL_OK) {
      grpc_call_cancel(st->call, NULL);
      stream_end(st);
      break;
    }
    grpc_completion_queue_pluck(st->cq, &st->read_tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (buffer == NULL) {
      stream_end(st);
      break;
    }
    int rc = rpc__buffer_to_malloc(buffer, message, message_bytes);
    grpc_byte_buffer_destroy(buffer);
    if (rc < 0) {
      /* An unreadable message ends the stream: the caller could not tell
       * which message it lost. */
      grpc_call_cancel(st->call, NULL);
      stream_end(st);
      char text[128];
      int n = snprintf(text, sizeof text, "stream message unreadable: %s", strerror(-rc));
      result_set(&st->final, RPC_INTERNAL, text, (size_t)n);
      break;
    }
    return 1;
  }
  if (result != NULL)
    *result = st->final;
  return 0;
}

void rpc_stream_cancel(rpc_stream *st) {
  if (st == NULL)
    return;
  atomic_store(&st->cancel_requested, 1);
  if (st->call != NULL)
    grpc_call_cancel(st->call, NULL); /* thread-safe, idempotent */
}

void rpc_stream_close(rpc_stream *st) {
  if (st == NULL)
    return;
  if (st->call != NULL) {
    if (!st->ended)
      grpc_call_cancel(st->call, NULL);
    stream_pluck(st, &st->status_pending);
    stream_pluck(st, &st->start_pending);
    grpc_call_unref(st->call);
  }
  pluck_queue_destroy(st->cq);
  grpc_slice_unref(st->status_details);
  grpc_metadata_array_destroy(&st->initial_metadata);
  grpc_metadata_array_destroy(&st->trailing_metadata);
  free(st);
}
