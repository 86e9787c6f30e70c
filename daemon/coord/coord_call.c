/* Call plumbing (coord_impl.h): what every handler of the coordinator goes
 * through. coord__begin identifies the caller, decodes and checks the
 * request (ctl_decode.h), asks the policy whether the caller may make it
 * (authz.c) and marks a changing call for the audit log; only then does a
 * handler see the request. coord__finish_* answer unary calls, and
 * coord__add_methods registers a file's methods. Loop thread only. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "coord_impl.h"
#include "ctl_decode.h"
#include "log.h"

void coord__finish_message(rpc_call *call, const ProtobufCMessage *msg) {
  size_t len = protobuf_c_message_get_packed_size(msg);
  if (len > RPC_MAX_MESSAGE_BYTES) {
    char err[128];
    snprintf(err, sizeof err, "reply would be %zu bytes (at most %u)", len, RPC_MAX_MESSAGE_BYTES);
    rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, err, NULL, 0);
    return;
  }
  uint8_t *buf = malloc(len ? len : 1);
  if (buf == NULL) {
    rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory", NULL, 0);
    return;
  }
  protobuf_c_message_pack(msg, buf);
  rpc_call_finish(call, RPC_OK, NULL, buf, len);
  free(buf);
}

void coord__finish_error(rpc_call *call, int status, const char *fmt, ...) {
  char message[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof message, fmt, ap);
  va_end(ap);
  rpc_call_finish(call, status, message, NULL, 0);
}

void *coord__begin(coord *c, rpc_call *call, const char *path, const uint8_t *request,
                   size_t request_bytes) {
  coord_caller who;
  return coord__begin_as(c, call, path, request, request_bytes, &who);
}

void *coord__begin_as(coord *c, rpc_call *call, const char *path, const uint8_t *request,
                      size_t request_bytes, coord_caller *caller) {
  if (c->shutting_down) {
    rpc_call_finish(call, RPC_UNAVAILABLE, "coordinator shutting down", NULL, 0);
    return NULL;
  }
  char err[512];
  coord_caller who;
  int status = coord__caller(c, call, &who);
  if (status != 0) {
    rpc_call_finish(call, status, "no credentials", NULL, 0);
    return NULL;
  }
  ProtobufCMessage *msg = NULL;
  status = ctl_decode(path, request, request_bytes, &msg, err, sizeof err);
  if (status != 0) {
    rpc_call_finish(call, status, err, NULL, 0);
    return NULL;
  }
  char audit[512];
  status = coord__authorize(c, &who, path, msg, audit, sizeof audit, err, sizeof err);
  if (status != 0) {
    LOG_WARNF("call refused", "method=%s principal=%s status=%s reason=\"%s\"", path, who.name,
              rpc_status_name(status), err);
    if (audit[0] != '\0')
      rpc_call_audit(call, who.name, audit);
    rpc_call_finish(call, status, err, NULL, 0);
    ctl_free(msg);
    return NULL;
  }
  if (audit[0] != '\0')
    rpc_call_audit(call, who.name, audit);
  *caller = who;
  return msg;
}

int coord__add_methods(coord *c, rpc_server *server, const coord_method *methods, size_t count) {
  for (size_t i = 0; i < count; i++) {
    int rc = rpc_server_add_method(server, methods[i].path, methods[i].kind, methods[i].handler, c);
    if (rc != 0)
      return rc;
  }
  return 0;
}
