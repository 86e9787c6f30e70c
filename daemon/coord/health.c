/* health: grpc.health.v1.Health, Check and Watch (see health.h). */
#include "health.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ctl_decode.h"
#include "grpc/health/v1/health.pb-c.h"
#include "log.h"

typedef struct health_watch {
  struct health_watch *next, *prev;
  health *h;
  rpc_call *call;
  int known; /* its service is one h serves */
} health_watch;

struct health {
  const char *const *services;
  size_t nservices;
  int serving;
  int shut_down;
  health_watch *watches;
  unsigned nwatches;
};

static int known_service(const health *h, const char *service) {
  if (service[0] == '\0')
    return 1;
  for (size_t i = 0; i < h->nservices; i++)
    if (strcmp(service, h->services[i]) == 0)
      return 1;
  return 0;
}

static Grpc__Health__V1__HealthCheckResponse__ServingStatus status_of(const health *h, int known) {
  if (!known)
    return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
  return h->serving && !h->shut_down
             ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
             : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

/* Packs a response with status into buf (a response is 2 bytes at most). */
static size_t pack_status(Grpc__Health__V1__HealthCheckResponse__ServingStatus status,
                          uint8_t buf[8]) {
  Grpc__Health__V1__HealthCheckResponse reply = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  reply.status = status;
  return grpc__health__v1__health_check_response__pack(&reply, buf);
}

/* Decodes a Check or Watch request; on failure answers the call. */
static Grpc__Health__V1__HealthCheckRequest *decode(rpc_call *call, const char *path,
                                                    const uint8_t *request, size_t request_bytes) {
  ProtobufCMessage *msg = NULL;
  char err[512];
  int status = ctl_decode(path, request, request_bytes, &msg, err, sizeof err);
  if (status != 0) {
    rpc_call_finish(call, status, err, NULL, 0);
    return NULL;
  }
  return (Grpc__Health__V1__HealthCheckRequest *)msg;
}

static void on_check(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  health *h = arg;
  Grpc__Health__V1__HealthCheckRequest *req =
      decode(call, CTL_HEALTH_CHECK, request, request_bytes);
  if (req == NULL)
    return;
  if (!known_service(h, req->service)) {
    /* The standard's answer for a service the server does not know. */
    char message[CTL_TEXT_MAX_BYTES + 32];
    snprintf(message, sizeof message, "unknown service '%s'", req->service);
    rpc_call_finish(call, RPC_NOT_FOUND, message, NULL, 0);
  } else {
    uint8_t buf[8];
    size_t len = pack_status(status_of(h, 1), buf);
    rpc_call_finish(call, RPC_OK, NULL, buf, len);
  }
  ctl_free(&req->base);
}

static void watch_unlink(health_watch *w) {
  health *h = w->h;
  if (w->prev != NULL)
    w->prev->next = w->next;
  else
    h->watches = w->next;
  if (w->next != NULL)
    w->next->prev = w->prev;
  h->nwatches--;
}

static void on_watch_cancelled(rpc_call *call, void *arg) {
  health_watch *w = arg;
  watch_unlink(w);
  free(w);
  rpc_call_finish(call, RPC_CANCELLED, "watch ended", NULL, 0);
}

/* Sends w its status; a stream that cannot take it (a client that does
 * not read, a cancelled call) ends. */
static void watch_send(health_watch *w) {
  uint8_t buf[8];
  size_t len = pack_status(status_of(w->h, w->known), buf);
  int rc = rpc_call_send(w->call, buf, len);
  if (rc == 0 || rc == -EPIPE)
    return; /* -EPIPE: its cancel callback ends it */
  rpc_call_set_cancel(w->call, NULL, NULL);
  rpc_call_finish(w->call, RPC_RESOURCE_EXHAUSTED, "the client does not read its watch", NULL, 0);
  watch_unlink(w);
  free(w);
}

static void on_watch(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  health *h = arg;
  Grpc__Health__V1__HealthCheckRequest *req =
      decode(call, CTL_HEALTH_WATCH, request, request_bytes);
  if (req == NULL)
    return;
  int known = known_service(h, req->service);
  ctl_free(&req->base);
  if (h->shut_down) {
    rpc_call_finish(call, RPC_UNAVAILABLE, "shutting down", NULL, 0);
    return;
  }
  if (h->nwatches >= HEALTH_MAX_WATCHES) {
    rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "too many health watches", NULL, 0);
    return;
  }
  health_watch *w = calloc(1, sizeof *w);
  if (w == NULL) {
    rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory", NULL, 0);
    return;
  }
  w->h = h;
  w->call = call;
  w->known = known;
  w->next = h->watches;
  if (h->watches != NULL)
    h->watches->prev = w;
  h->watches = w;
  h->nwatches++;
  rpc_call_set_cancel(call, on_watch_cancelled, w);
  watch_send(w);
}

int health_register(rpc_server *server, const char *const *services, size_t nservices,
                    health **out) {
  *out = NULL;
  health *h = calloc(1, sizeof *h);
  if (h == NULL)
    return -ENOMEM;
  h->services = services;
  h->nservices = nservices;
  int rc = rpc_server_add_method(server, CTL_HEALTH_CHECK, RPC_UNARY, on_check, h);
  if (rc == 0)
    rc = rpc_server_add_method(server, CTL_HEALTH_WATCH, RPC_SERVER_STREAM, on_watch, h);
  if (rc != 0) {
    free(h);
    return rc;
  }
  /* Probes answer while other clients flood the server (rpc.h), and need
   * no credentials (they carry no secret): Kubernetes sends none. */
  rpc_server_set_priority(server, CTL_HEALTH_CHECK);
  rpc_server_set_priority(server, CTL_HEALTH_WATCH);
  rpc_server_set_anonymous(server, CTL_HEALTH_CHECK);
  rpc_server_set_anonymous(server, CTL_HEALTH_WATCH);
  *out = h;
  return 0;
}

int health_identify_anonymous(void *arg, const rpc_call *call, long *principal, char *name,
                              size_t name_bytes, char *err, size_t err_bytes) {
  (void)arg, (void)call, (void)name, (void)name_bytes, (void)err, (void)err_bytes;
  *principal = RPC_PRINCIPAL_ANONYMOUS;
  return 0;
}

void health_set(health *h, int serving) {
  if (h == NULL || (h->serving != 0) == (serving != 0))
    return;
  h->serving = serving != 0;
  LOG_INFOF("health", "status=%s", h->serving && !h->shut_down ? "SERVING" : "NOT_SERVING");
  for (health_watch *w = h->watches, *next; w != NULL; w = next) {
    next = w->next;
    if (w->known)
      watch_send(w);
  }
}

int health_serving(const health *h) {
  return h != NULL && h->serving && !h->shut_down;
}

void health_shutdown(health *h) {
  if (h == NULL || h->shut_down)
    return;
  health_set(h, 0);
  h->shut_down = 1;
  while (h->watches != NULL) {
    health_watch *w = h->watches;
    watch_unlink(w);
    rpc_call_set_cancel(w->call, NULL, NULL);
    rpc_call_finish(w->call, RPC_UNAVAILABLE, "shutting down", NULL, 0);
    free(w);
  }
}

void health_free(health *h) {
  if (h == NULL)
    return;
  if (h->watches != NULL)
    LOG_ERRORF("health freed with watches open", "watches=%u", h->nwatches);
  free(h);
}
