/* tls: transport security material (see tls.h and docs/security.md).
 *
 * gRPC's C core takes TLS material as PEM strings in memory; this file
 * reads the operator's files (bounded, so a wrong path to a huge file is
 * an error, not an allocation), which rpc_credentials.c turns into
 * credentials. It also says which addresses are local enough for plain transport, and
 * reads bearer tokens from files. */
#include "tls.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A certificate chain or a key is a few KiB; a CA bundle can be a few
 * hundred. Anything larger is not what the flag meant. */
#define TLS_MAX_PEM_BYTES (4u << 20)

int tls_read_pem(const char *path, const char *what, char **out, char *err, size_t err_bytes) {
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (f == NULL) {
    int rc = -errno;
    snprintf(err, err_bytes, "cannot read the %s %s: %s", what, path, strerror(-rc));
    return rc;
  }
  char *buf = malloc(TLS_MAX_PEM_BYTES + 1);
  if (buf == NULL) {
    fclose(f);
    snprintf(err, err_bytes, "out of memory reading %s", path);
    return -ENOMEM;
  }
  size_t n = fread(buf, 1, TLS_MAX_PEM_BYTES + 1, f);
  int read_error = ferror(f);
  fclose(f);
  if (read_error) {
    free(buf);
    snprintf(err, err_bytes, "cannot read the %s %s: read error", what, path);
    return -EIO;
  }
  if (n > TLS_MAX_PEM_BYTES) {
    free(buf);
    snprintf(err, err_bytes, "the %s %s is larger than %u bytes", what, path, TLS_MAX_PEM_BYTES);
    return -EFBIG;
  }
  buf[n] = '\0';
  if (strstr(buf, "-----BEGIN ") == NULL) {
    free(buf);
    snprintf(err, err_bytes, "the %s %s is not PEM (no -----BEGIN line)", what, path);
    return -EINVAL;
  }
  *out = buf;
  return 0;
}

int rpc_address_is_local(const char *addr) {
  if (addr == NULL)
    return 0;
  if (strncmp(addr, "unix:", 5) == 0)
    return 1;
  /* "ipv4:" and "dns:" prefixes, as gRPC targets allow. */
  if (strncmp(addr, "ipv4:", 5) == 0)
    addr += 5;
  else if (strncmp(addr, "ipv6:", 5) == 0)
    addr += 5;
  else if (strncmp(addr, "dns:///", 7) == 0)
    addr += 7;
  else if (strncmp(addr, "dns:", 4) == 0)
    addr += 4;
  char host[256];
  const char *end;
  if (addr[0] == '[') {
    end = strchr(addr, ']');
    if (end == NULL)
      return 0;
    addr++;
  } else {
    end = strrchr(addr, ':');
    if (end == NULL)
      end = addr + strlen(addr);
  }
  size_t n = (size_t)(end - addr);
  if (n == 0 || n >= sizeof host)
    return 0;
  memcpy(host, addr, n);
  host[n] = '\0';
  if (strcmp(host, "localhost") == 0)
    return 1;
  struct in_addr v4;
  if (inet_pton(AF_INET, host, &v4) == 1)
    return (ntohl(v4.s_addr) >> 24) == 127;
  struct in6_addr v6;
  if (inet_pton(AF_INET6, host, &v6) == 1)
    return memcmp(&v6, &in6addr_loopback, sizeof v6) == 0;
  return 0;
}

int rpc_read_token_file(const char *path, char *out, size_t out_bytes, char *err,
                        size_t err_bytes) {
  FILE *f = fopen(path, "r");
  if (f == NULL) {
    int rc = -errno;
    snprintf(err, err_bytes, "cannot read the token file %s: %s", path, strerror(-rc));
    return rc;
  }
  char line[RPC_MAX_TOKEN_BYTES + 64];
  int got = fgets(line, sizeof line, f) != NULL;
  fclose(f);
  size_t n = got ? strlen(line) : 0;
  while (n > 0 &&
         (line[n - 1] == '\n' || line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t'))
    line[--n] = '\0';
  const char *start = line;
  while (*start == ' ' || *start == '\t')
    start++;
  size_t len = got ? strlen(start) : 0;
  int printable = len > 0;
  for (size_t i = 0; i < len; i++)
    printable &= start[i] > 0x20 && start[i] < 0x7f;
  if (!printable || len > RPC_MAX_TOKEN_BYTES || len >= out_bytes) {
    snprintf(err, err_bytes,
             "the token file %s must hold one token: 1..%d bytes of printable ASCII on its first "
             "line",
             path, RPC_MAX_TOKEN_BYTES);
    return -EINVAL;
  }
  memcpy(out, start, len + 1);
  return 0;
}

static const char *env_or_keep(const char *given, const char *name) {
  return given != NULL ? given : getenv(name);
}

int rpc_client_credentials(rpc_tls *tls, const char *token_file, int *use_tls, char *token,
                           size_t token_bytes, char *err, size_t err_bytes) {
  tls->ca_file = env_or_keep(tls->ca_file, "ZEROD_TLS_CA");
  tls->cert_file = env_or_keep(tls->cert_file, "ZEROD_TLS_CERT");
  tls->key_file = env_or_keep(tls->key_file, "ZEROD_TLS_KEY");
  tls->server_name = env_or_keep(tls->server_name, "ZEROD_TLS_SERVER_NAME");
  *use_tls = tls->ca_file != NULL || tls->cert_file != NULL || tls->key_file != NULL ||
             tls->server_name != NULL;
  token[0] = '\0';
  token_file = env_or_keep(token_file, "ZEROD_AUTH_TOKEN_FILE");
  if (token_file != NULL)
    return rpc_read_token_file(token_file, token, token_bytes, err, err_bytes);
  /* The token itself from the environment, never argv (which every user
   * of the host can read in /proc). */
  const char *env = getenv("ZEROD_AUTH_TOKEN");
  if (env != NULL && env[0] != '\0') {
    if (strlen(env) >= token_bytes || strlen(env) > RPC_MAX_TOKEN_BYTES) {
      snprintf(err, err_bytes, "ZEROD_AUTH_TOKEN is longer than %d bytes", RPC_MAX_TOKEN_BYTES);
      return -EINVAL;
    }
    memcpy(token, env, strlen(env) + 1);
  }
  return 0;
}

int rpc_insecure_from_env(void) {
  const char *v = getenv("ZEROD_INSECURE");
  return v != NULL && (strcmp(v, "1") == 0 || strcmp(v, "true") == 0 || strcmp(v, "yes") == 0);
}
