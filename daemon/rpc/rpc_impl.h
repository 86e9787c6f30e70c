/* rpc_impl: what the server (rpc_server.c and its parts) and the client
 * (client.c) sides of the rpc library share (rpc_common.c,
 * rpc_credentials.c). Private to daemon/rpc/: with rpc_server_impl.h, the
 * only headers with gRPC types in them. */
#ifndef ZEROD_RPC_IMPL_H
#define ZEROD_RPC_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>

#include "admit.h"
#include "tls.h"
#include "tls_reload.h"

/* Method paths and addresses: short ASCII names. */
#define RPC_MAX_PATH_BYTES 256
#define RPC_MAX_ADDR_BYTES 256
/* How often a client with its own certificate reads its TLS files again
 * (rpc_credentials.c). */
#define RPC_TLS_REFRESH_S 5

/* grpc_init with gRPC's logging routed to log.h (set once per process);
 * balanced by grpc_shutdown. */
void rpc__grpc_init(void);

/* How many times gRPC said it stopped accepting connections (its log
 * line "Failed accept4"): a server whose count moved restarts its
 * listener. */
unsigned rpc__accept_failures(void);

/* A new byte buffer holding a copy of bytes (the caller destroys it). */
grpc_byte_buffer *rpc__buffer_from_bytes(const void *bytes, size_t n_bytes);

/* Flattens buffer into one slice (*out, which the caller unrefs). Returns
 * 0, -EPROTO (unreadable) or -EMSGSIZE (over the limit). */
int rpc__buffer_flatten(grpc_byte_buffer *buffer, grpc_slice *out);

/* Copies buffer into a malloc'd array (NULL for an empty message).
 * Returns 0, -EPROTO (unreadable), -EMSGSIZE (over the limit), -ENOMEM. */
int rpc__buffer_to_malloc(grpc_byte_buffer *buffer, uint8_t **out, size_t *out_bytes);

/* Appends an integer channel arg (key is one of gRPC's constants). */
void rpc__arg_int(grpc_arg *args, size_t *n_args, const char *key, int value);

/* The channel args both sides share (message size limits): args[0..1]. */
void rpc__message_limit_args(grpc_arg *arg_storage, size_t *n_args);

/* The limits every server admits calls by (rpc.h: RPC_MAX_CALLS and the
 * others), as admit.h takes them. */
admit_limits rpc__admit_limits(void);

/* Server credentials for tls (a certificate and its key required; a CA
 * to verify clients with), whose files are read again when they change
 * (*reload: the caller frees it after the server is destroyed). Returns 0
 * with *out (the caller releases it) or a negative errno with a message in
 * err. */
int rpc__server_credentials(const rpc_tls *tls, grpc_server_credentials **out, tls_reload **reload,
                            char *err, size_t err_bytes);

/* Channel credentials for tls (ca_file NULL: the system's roots). Returns
 * 0 with *out (the caller releases it) or a negative errno with a message
 * in err. */
int rpc__channel_credentials(const rpc_tls *tls, grpc_channel_credentials **out, char *err,
                             size_t err_bytes);

#endif /* ZEROD_RPC_IMPL_H */
