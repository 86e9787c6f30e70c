/* tls_reload.h - a TLS server's certificate, key and client CA, read again
 * when their files change, without a restart (docs/security.md, "Rotating
 * certificates").
 *
 * gRPC asks for the server's certificate config at each new connection's
 * handshake (grpc_ssl_server_credentials_create_options_using_config_fetcher);
 * tls_reload_fetch stats the files and, when one changed (a renewal by
 * cert-manager: the kubelet swaps a Secret's files at once), reads them
 * again. New material is taken only whole and consistent (every file read,
 * the key the certificate's); otherwise the previous stays and a warning
 * says why. Connections made before keep their handshake's certificate. */
#ifndef ZEROD_RPC_TLS_RELOAD_H
#define ZEROD_RPC_TLS_RELOAD_H

#include <stddef.h>

#include <grpc/grpc_security.h>

#include "tls.h"

typedef struct tls_reload tls_reload;

/* Reads tls's files once (they must be usable: else an error in err) and
 * keeps their paths. 0 with *out, or a negative errno. */
int tls_reload_create(const rpc_tls *tls, tls_reload **out, char *err, size_t err_bytes);
/* After the server that fetches from r is destroyed. */
void tls_reload_free(tls_reload *r);

/* The fetcher gRPC calls (any thread): NEW with *config when the files
 * changed since the last fetch (the first fetch: always), else UNCHANGED. */
grpc_ssl_certificate_config_reload_status
tls_reload_fetch(void *r, grpc_ssl_server_certificate_config **config);

#endif /* ZEROD_RPC_TLS_RELOAD_H */
