/* Call plumbing (coord_impl.h): what every handler of the coordinator goes
 * through. coord__identify names the caller of a call as it arrives, from
 * its bearer token or client certificate (auth.h), before its request
 * message. coord__begin then takes that caller, decodes and checks the
 * request (ctl_decode.h), asks the policy whether the caller may make it
 * (authz.c) and marks a changing call for the audit log; only then does a
 * handler see the request. coord__finish_* answer unary calls, and
 * coord__add_methods registers a file's methods. Loop thread only. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* The policy's job lookup (authz_env; arg: the coordinator). */
static const Zerod__V1__Job *stored_job(void *arg, const char *name) {
  const cjob *j = coord__find_job(arg, name);
  return j != NULL ? j->msg : NULL;
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
  authz_env env = {.find_job = stored_job,
                   .arg = c,
                   .export_roots = c->options.export_roots,
                   .n_export_roots = c->options.n_export_roots};
  status = authz_check(&env, &who, path, msg, audit, sizeof audit, err, sizeof err);
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

/* ------------------------------------------------------------------------ */
/* Who is calling                                                           */
/* ------------------------------------------------------------------------ */

/* Reads the bearer token of the call. Returns its length, 0 when there
 * is none, or -1 when the header is malformed (err says how). */
static int bearer_token(const rpc_call *call, char *out, size_t out_bytes, char *err,
                        size_t err_bytes) {
  char value[RPC_MAX_TOKEN_BYTES + 32];
  int n = rpc_call_metadata(call, "authorization", value, sizeof value);
  if (n == -ENOENT)
    return 0;
  if (n < 0) {
    snprintf(err, err_bytes, "the authorization header is %s",
             n == -E2BIG ? "too long" : "not text");
    return -1;
  }
  static const char prefix[] = "Bearer ";
  if (strncmp(value, prefix, sizeof prefix - 1) != 0 || value[sizeof prefix - 1] == '\0') {
    snprintf(err, err_bytes, "the authorization header must be 'Bearer <token>'");
    return -1;
  }
  const char *token = value + sizeof prefix - 1;
  size_t len = strlen(token);
  if (len >= out_bytes) {
    snprintf(err, err_bytes, "the bearer token is too long");
    return -1;
  }
  memcpy(out, token, len + 1);
  return (int)len;
}

/* What a caller without credentials is told. It names what the clients
 * of this repository take (tests/integration/test_hints.py runs each). */
#define COORD_NO_CREDENTIALS_HINT                                                                  \
  "no credentials: send a bearer token (zerodctl and zerod node: --auth-token-file FILE or "       \
  "ZEROD_AUTH_TOKEN) or a client certificate (--tls-cert and --tls-key)"

/* The principal of a call, from its bearer token or else its verified
 * client certificate. Returns 0 with *out (NULL: no credentials at all),
 * or RPC_UNAUTHENTICATED and why. */
static int principal_of(const coord *c, const rpc_call *call, const auth_principal **out, char *err,
                        size_t err_bytes) {
  *out = NULL;
  char token[RPC_MAX_TOKEN_BYTES + 1];
  int n = bearer_token(call, token, sizeof token, err, err_bytes);
  if (n < 0)
    return RPC_UNAUTHENTICATED;
  if (n > 0) {
    *out = auth_by_token(c->auth, token, (size_t)n);
    memset(token, 0, sizeof token);
    if (*out == NULL) {
      snprintf(err, err_bytes, "the bearer token is not one of a known principal");
      return RPC_UNAUTHENTICATED;
    }
    return 0;
  }
  const char *cn = rpc_call_cert_name(call);
  if (cn[0] != '\0') {
    *out = auth_by_cert(c->auth, cn);
    if (*out == NULL) {
      snprintf(err, err_bytes, "the client certificate (CN=%s) is not one of a known principal",
               cn);
      return RPC_UNAUTHENTICATED;
    }
  }
  return 0;
}

int coord__identify(void *arg, const rpc_call *call, long *principal, char *name, size_t name_bytes,
                    char *err, size_t err_bytes) {
  const coord *c = arg;
  if (rpc_call_transport(call) == RPC_TRANSPORT_UNIX || c->auth == NULL) {
    *principal = RPC_PRINCIPAL_TRUSTED;
    return 0;
  }
  const auth_principal *p;
  int status = principal_of(c, call, &p, err, err_bytes);
  if (status != 0)
    return status;
  if (p == NULL) {
    if (rpc_call_method_anonymous(call)) {
      *principal = RPC_PRINCIPAL_ANONYMOUS;
      return 0;
    }
    snprintf(err, err_bytes, "%s", COORD_NO_CREDENTIALS_HINT);
    return RPC_UNAUTHENTICATED;
  }
  *principal = (long)auth_index(c->auth, p);
  snprintf(name, name_bytes, "%s", p->name);
  return 0;
}

int coord__caller(const coord *c, const rpc_call *call, coord_caller *out) {
  memset(out, 0, sizeof *out);
  out->index = -1;
  long principal = rpc_call_principal(call);
  if (principal == RPC_PRINCIPAL_TRUSTED) {
    out->role = AUTH_ADMIN;
    out->trusted = 1;
    snprintf(out->name, sizeof out->name, "%s",
             rpc_call_transport(call) == RPC_TRANSPORT_UNIX ? "local" : "anyone");
    return 0;
  }
  if (principal < 0 || c->auth == NULL || (size_t)principal >= auth_count(c->auth))
    return RPC_UNAUTHENTICATED; /* an anonymous call of a method that needs credentials */
  const auth_principal *p = auth_at(c->auth, (size_t)principal);
  out->index = principal;
  out->role = p->role;
  snprintf(out->name, sizeof out->name, "%s", p->name);
  snprintf(out->tenant, sizeof out->tenant, "%s", p->tenant);
  out->any_node = p->role == AUTH_NODE && strcmp(p->name, "*") == 0;
  return 0;
}
