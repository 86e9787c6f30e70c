/* tls: what the control plane's transport security is made of (rpc.h
 * uses it; docs/security.md): TLS material, which addresses are local
 * enough for plain transport, and bearer tokens read from files. No gRPC
 * here: rpc_credentials.c turns an rpc_tls into gRPC credentials. */
#ifndef ZEROD_RPC_TLS_H
#define ZEROD_RPC_TLS_H

#include <stddef.h>

/* A bearer token: at most this many bytes of printable ASCII. */
#define RPC_MAX_TOKEN_BYTES 512

/* TLS material, as PEM files (docs/security.md).
 * Server: cert_file and key_file are the listener's certificate chain and
 * private key (both required); ca_file, if set, is the CA whose client
 * certificates are verified, and require_client_cert refuses a client
 * without a valid one (mutual TLS); with ca_file but not
 * require_client_cert a client may come without a certificate (and
 * authenticate with a bearer token instead). server_name is unused.
 * Client: ca_file is the CA that signed the server's certificate (NULL:
 * the system's roots); cert_file and key_file, if set (both or neither),
 * are the client's certificate for mutual TLS; server_name, if set, is the
 * name checked in the server's certificate instead of the target's host.
 * The files are read when the credentials are made; a missing or
 * unreadable file is an error then, never a silent downgrade. */
typedef struct rpc_tls {
  const char *ca_file;
  const char *cert_file;
  const char *key_file;
  int require_client_cert;
  const char *server_name;
} rpc_tls;

/* Whether addr ("HOST:PORT", "unix:PATH", "[::1]:7070") names this host
 * only: a Unix socket, localhost, 127.0.0.0/8 or ::1. Plain transport is
 * allowed there without --insecure. */
int rpc_address_is_local(const char *addr);

/* Reads a bearer token from path: its first line, blanks around it
 * dropped, 1..RPC_MAX_TOKEN_BYTES of printable ASCII (tokens are kept in
 * files or the environment, not on command lines, which every user of the
 * host can read). Returns 0 or a negative errno with a message in err. */
int rpc_read_token_file(const char *path, char *out, size_t out_bytes, char *err, size_t err_bytes);

/* A client's credentials (zerod node, zerodctl): the fields of tls not
 * given by flags are read from ZEROD_TLS_CA, ZEROD_TLS_CERT,
 * ZEROD_TLS_KEY and ZEROD_TLS_SERVER_NAME, and *use_tls says whether any
 * is set; the bearer token is read from token_file (NULL:
 * ZEROD_AUTH_TOKEN_FILE), else taken from ZEROD_AUTH_TOKEN, else "".
 * Returns 0 or a negative errno with a message in err. */
int rpc_client_credentials(rpc_tls *tls, const char *token_file, int *use_tls, char *token,
                           size_t token_bytes, char *err, size_t err_bytes);

/* Whether ZEROD_INSECURE is 1, true or yes (--insecure). */
int rpc_insecure_from_env(void);

/* Reads a PEM file (what names it in errors, "certificate") into a
 * malloc'd NUL-terminated string. Returns 0 or a negative errno with a
 * message in err naming the file. */
int tls_read_pem(const char *path, const char *what, char **out, char *err, size_t err_bytes);

#endif /* ZEROD_RPC_TLS_H */
