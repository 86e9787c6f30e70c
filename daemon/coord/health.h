/* health: the standard gRPC health service (grpc.health.v1.Health, Check
 * and Watch; proto/grpc/health/v1/health.proto), for the coordinator's
 * server and a node daemon's probe listener (zerod node --health-listen),
 * which Kubernetes' gRPC probes and grpc_health_probe call.
 *
 * One status for the server and every service it names: SERVING or
 * NOT_SERVING, set by the owner (the coordinator: serving until it shuts
 * down; a node: serving while it is a member of its cluster and not
 * draining). Check answers it; Watch sends it at once and again on every
 * change, and SERVICE_UNKNOWN (without ending) for a service it does not
 * know, as the standard says. Loop thread only. */
#ifndef ZEROD_HEALTH_H
#define ZEROD_HEALTH_H

#include <stddef.h>

#include "rpc.h"

typedef struct health health;

/* Most Watch streams open at once (more are RESOURCE_EXHAUSTED). */
#define HEALTH_MAX_WATCHES 256

/* Registers Check and Watch on server (not yet started) as priority
 * methods that need no credentials (rpc.h), with the service names it knows besides "" (copied
 * pointers: they must outlive h). Starts NOT_SERVING. Returns 0 or a
 * negative errno. */
int health_register(rpc_server *server, const char *const *services, size_t nservices,
                    health **out);

/* An identify function (rpc_server_set_identify) for a server that
 * serves health alone (--health-listen): every caller is one without
 * credentials, held to the server's anonymous budget (rpc.h). */
int health_identify_anonymous(void *arg, const rpc_call *call, long *principal, char *name,
                              size_t name_bytes, char *err, size_t err_bytes);

/* Sets the status; every Watch stream whose service is known gets it if it
 * changed. */
void health_set(health *h, int serving);
int health_serving(const health *h);

/* NOT_SERVING, then every Watch stream ends (UNAVAILABLE, "shutting
 * down"); later Watches end at once. Before the server's shutdown. */
void health_shutdown(health *h);

/* Frees h once its server is done (every call finished). */
void health_free(health *h);

#endif /* ZEROD_HEALTH_H */
