/* zerodctl_call: how zerodctl reaches the coordinator (zerodctl_impl.h).
 *
 * One blocking unary call at a time on the invocation's channel (rpc.h's
 * client half), made on the first call, with the --timeout deadline; a
 * failed call prints the one error line that says what failed and where.
 * The credentials (TLS, bearer token) are settled before any call. Calls
 * zerodctl_output.c only. */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "zerodctl_impl.h"

/* After "cannot reach ...": where zerodctl looked when nothing named the
 * coordinator, and how to name one. */
static const char *looked(const ctl *c, char *buf, size_t bytes) {
  if (!c->coordinator_defaulted)
    return "";
  snprintf(buf, bytes,
           " (no --coordinator or ZEROD_COORDINATOR given; a local zerod's control socket was "
           "looked for at %s; start one with `zerod standalone`, or name one with "
           "--coordinator HOST:PORT or --coordinator unix:PATH)",
           c->looked);
  return buf;
}

/* Prints the one error line for a failed call and returns its exit status. */
static int call_failed(const ctl *c, int status, const rpc_result *result) {
  char hint[1024];
  const char *message = result->message[0] != '\0' ? result->message : "(no message)";
  if (status < 0)
    return ctl__fail_line(CTL_EXIT_FAILED, "%s: %s%s%s", c->command, strerror(-status),
                          result->message[0] != '\0' ? ": " : "", result->message);
  if (status == RPC_UNAVAILABLE)
    return ctl__fail_line(CTL_EXIT_FAILED, "cannot reach the coordinator at %s: %s: %s%s",
                          c->coordinator, rpc_status_name(status), message,
                          looked(c, hint, sizeof hint));
  if (status == RPC_DEADLINE_EXCEEDED)
    return ctl__fail_line(CTL_EXIT_FAILED, "%s: %s: no reply from the coordinator at %s within %gs",
                          c->command, rpc_status_name(status), c->coordinator, c->timeout_s);
  return ctl__fail_line(CTL_EXIT_FAILED, "%s: %s: %s", c->command, rpc_status_name(status),
                        message);
}

/* Makes one unary call: packs request, waits up to the timeout, unpacks
 * the reply as reply_type into *reply (caller frees with
 * protobuf_c_message_free_unpacked). On failure prints the error line and
 * returns the exit status; returns 0 on success. */
int ctl__call(ctl *c, const char *method, const ProtobufCMessage *request,
              const ProtobufCMessageDescriptor *reply_type, ProtobufCMessage **reply) {
  static const uint8_t no_bytes[1];
  rpc_result result;
  memset(&result, 0, sizeof result);
  *reply = NULL;

  if (c->channel == NULL) {
    char err[256] = "";
    rpc_channel_options options = {.tls = c->use_tls ? &c->tls : NULL, .token = c->token};
    int rc = rpc_channel_create_with(c->coordinator, &options, &c->channel, err, sizeof err);
    char hint[1024];
    if (rc != 0)
      return ctl__fail_line(CTL_EXIT_FAILED, "cannot reach the coordinator at %s: %s%s",
                            c->coordinator, err[0] != '\0' ? err : strerror(-rc),
                            looked(c, hint, sizeof hint));
  }

  size_t request_bytes = protobuf_c_message_get_packed_size(request);
  if (request_bytes > RPC_MAX_MESSAGE_BYTES)
    return ctl__fail_line(CTL_EXIT_USAGE, "%s: the request is %zu bytes, over the limit of %u",
                          c->command, request_bytes, (unsigned)RPC_MAX_MESSAGE_BYTES);
  uint8_t *packed = malloc(request_bytes > 0 ? request_bytes : 1);
  if (packed == NULL)
    return ctl__fail_line(CTL_EXIT_FAILED, "%s: %s", c->command, strerror(ENOMEM));
  protobuf_c_message_pack(request, packed);

  uint8_t *reply_buf = NULL;
  size_t reply_bytes = 0;
  int status = rpc_unary(c->channel, method, packed, request_bytes, c->timeout_ms, &reply_buf,
                         &reply_bytes, &result);
  free(packed);
  if (status != RPC_OK) {
    free(reply_buf);
    return call_failed(c, status, &result);
  }
  *reply = protobuf_c_message_unpack(reply_type, NULL, reply_bytes,
                                     reply_buf != NULL ? reply_buf : no_bytes);
  free(reply_buf);
  if (*reply == NULL)
    return ctl__fail_line(CTL_EXIT_FAILED, "%s: the coordinator's reply is not a valid %s message",
                          c->command, reply_type->name);
  return 0;
}

/* The environment fills the TLS flags not given; the token comes from a
 * file or ZEROD_AUTH_TOKEN. Plain transport to another host needs
 * --insecure. Returns 0 or the usage exit status. */
int ctl__security_setup(ctl *c, const char *token_file, bool insecure) {
  char err[PATH_MAX + 128];
  int use_tls = 0;
  if (rpc_client_credentials(&c->tls, token_file, &use_tls, c->token, sizeof c->token, err,
                             sizeof err) != 0)
    return ctl__usage_error("%s", err);
  c->use_tls = use_tls != 0;
  if (!c->use_tls && !insecure && !rpc_insecure_from_env() && !rpc_address_is_local(c->coordinator))
    return ctl__usage_error(
        "the coordinator %s is on another host: reach it over TLS (--tls-ca, and "
        "--tls-cert/--tls-key for mutual TLS) or pass --insecure",
        c->coordinator);
  return 0;
}
