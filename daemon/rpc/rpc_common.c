/* rpc_common: what the server and client sides of the rpc library share
 * (rpc_impl.h; rpc.h's rpc_status_name): gRPC's setup with its log lines
 * routed to log.h, message buffers, channel args, and the admission
 * limits every server uses. */
#include "rpc.h"
#include "rpc_impl.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <grpc/support/log.h>

#include "admit.h"
#include "log.h"

static const char *const status_names[] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

const char *rpc_status_name(int code) {
  if (code < 0 || (size_t)code >= sizeof(status_names) / sizeof(status_names[0]))
    return "UNKNOWN";
  return status_names[code];
}

/* ------------------------------------------------------------------------ */
/* gRPC's own log lines                                                     */
/* ------------------------------------------------------------------------ */

/* gRPC logs through gpr_log (to stderr in its own format, from its own
 * threads); send those lines through log.h instead, so the daemon's
 * stderr stays logfmt. */
/* How many times gRPC said it stopped accepting connections. gRPC 1.51
 * closes its acceptor for good on any accept4 error but EAGAIN and EINTR
 * (EMFILE included: one moment without free descriptors and the server
 * never accepts again); it says so only in this log line. Every running
 * server watches the count and, when it moves, restarts its listener. */
static atomic_uint accept_failures;

unsigned rpc__accept_failures(void) {
  return atomic_load(&accept_failures);
}

static void grpc_log_to_logfmt(gpr_log_func_args *args) {
  if (args->message != NULL && strstr(args->message, "Failed accept4") != NULL)
    atomic_fetch_add(&accept_failures, 1);
  log_level level = LOG_DEBUG;
  if (args->severity == GPR_LOG_SEVERITY_ERROR)
    level = LOG_ERROR;
  else if (args->severity == GPR_LOG_SEVERITY_INFO)
    level = LOG_INFO;
  const char *file = args->file != NULL ? strrchr(args->file, '/') : NULL;
  file = file != NULL ? file + 1 : (args->file != NULL ? args->file : "?");
  char quoted[512];
  log_event(level, "grpc", "source=%s:%d detail=%s", file, args->line,
            log_quote(args->message != NULL ? args->message : "", quoted, sizeof quoted));
}

static pthread_once_t grpc_log_once = PTHREAD_ONCE_INIT;

static void grpc_log_install(void) {
  gpr_set_log_function(grpc_log_to_logfmt);
}

/* grpc_init with gRPC's logging routed to log.h (set once per process). */
void rpc__grpc_init(void) {
  pthread_once(&grpc_log_once, grpc_log_install);
  grpc_init();
}

/* ------------------------------------------------------------------------ */
/* Messages                                                                 */
/* ------------------------------------------------------------------------ */

/* Returns a new byte buffer holding a copy of bytes (the caller destroys
 * it). gRPC aborts rather than fail on allocation. */
grpc_byte_buffer *rpc__buffer_from_bytes(const void *bytes, size_t n_bytes) {
  grpc_slice slice = grpc_slice_from_copied_buffer(n_bytes > 0 ? bytes : "", n_bytes);
  grpc_byte_buffer *buffer = grpc_raw_byte_buffer_create(&slice, 1);
  grpc_slice_unref(slice); /* the buffer holds its own reference */
  return buffer;
}

/* Flattens buffer into one slice (*out, which the caller unrefs). Returns 0,
 * -EPROTO when gRPC cannot read it (a bad compressed payload), or -EMSGSIZE
 * when it is over the limit (gRPC enforces the limit first; this is the
 * belt to its braces). */
int rpc__buffer_flatten(grpc_byte_buffer *buffer, grpc_slice *out) {
  grpc_byte_buffer_reader reader;
  if (!grpc_byte_buffer_reader_init(&reader, buffer))
    return -EPROTO;
  *out = grpc_byte_buffer_reader_readall(&reader);
  grpc_byte_buffer_reader_destroy(&reader);
  if (GRPC_SLICE_LENGTH(*out) > RPC_MAX_MESSAGE_BYTES) {
    grpc_slice_unref(*out);
    return -EMSGSIZE;
  }
  return 0;
}

/* Copies buffer into a malloc'd array (NULL for an empty message). */
int rpc__buffer_to_malloc(grpc_byte_buffer *buffer, uint8_t **out, size_t *out_bytes) {
  grpc_slice flat;
  int rc = rpc__buffer_flatten(buffer, &flat);
  if (rc < 0)
    return rc;
  size_t n_bytes = GRPC_SLICE_LENGTH(flat);
  uint8_t *copy = NULL;
  if (n_bytes > 0) {
    copy = malloc(n_bytes);
    if (copy == NULL) {
      grpc_slice_unref(flat);
      return -ENOMEM;
    }
    memcpy(copy, GRPC_SLICE_START_PTR(flat), n_bytes);
  }
  grpc_slice_unref(flat);
  *out = copy;
  *out_bytes = n_bytes;
  return 0;
}

/* Appends an integer channel arg (key is one of gRPC's constants). */
void rpc__arg_int(grpc_arg *args, size_t *n_args, const char *key, int value) {
  args[*n_args].type = GRPC_ARG_INTEGER;
  args[*n_args].key = (char *)key;
  args[*n_args].value.integer = value;
  (*n_args)++;
}

/* Builds the channel args both sides share; args points into arg_storage. */
void rpc__message_limit_args(grpc_arg *arg_storage, size_t *n_args) {
  *n_args = 0;
  rpc__arg_int(arg_storage, n_args, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
               (int)RPC_MAX_MESSAGE_BYTES);
  rpc__arg_int(arg_storage, n_args, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, (int)RPC_MAX_MESSAGE_BYTES);
}

/* ------------------------------------------------------------------------ */
/* Admission limits                                                         */
/* ------------------------------------------------------------------------ */

admit_limits rpc__admit_limits(void) {
  return (admit_limits){.calls = RPC_MAX_CALLS,
                        .reserved_calls = RPC_RESERVED_CALLS,
                        .per_principal = RPC_MAX_CALLS_PER_PRINCIPAL,
                        .principal_reserve = RPC_PRINCIPAL_RESERVED_CALLS,
                        .per_connection = RPC_MAX_STREAMS_PER_CONNECTION,
                        .anonymous_per_connection = RPC_ANONYMOUS_CALLS_PER_CONNECTION,
                        .anonymous_per_address = RPC_ANONYMOUS_CALLS_PER_ADDRESS,
                        .anonymous = RPC_ANONYMOUS_CALLS};
}
