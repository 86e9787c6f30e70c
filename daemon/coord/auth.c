/* auth: the principals file and caller identification (see auth.h). */
#include "auth.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>

#include "ctl_decode.h"
#include "digest.h"
#include "size.h"

/* A line of the file is a few hundred bytes at most; longer is a mistake. */
#define AUTH_LINE_MAX_BYTES 1024

struct auth_table {
  auth_principal *principals;
  size_t count;
  auth_quota *quotas;
  size_t nquotas;
};

static const char *const quota_names[AUTH_NQUOTAS] = {"jobs", "sessions", "host-bytes",
                                                      "device-bytes", "live-bytes"};

const char *auth_quota_name(auth_quota_kind kind) {
  return kind < AUTH_NQUOTAS ? quota_names[kind] : "?";
}

const char *auth_role_name(auth_role role) {
  switch (role) {
  case AUTH_ADMIN:
    return "admin";
  case AUTH_NODE:
    return "node";
  case AUTH_TENANT:
    return "tenant";
  case AUTH_READER:
    return "reader";
  case AUTH_NONE:
    break;
  }
  return "none";
}

static auth_role role_from_name(const char *s) {
  static const auth_role roles[] = {AUTH_ADMIN, AUTH_NODE, AUTH_TENANT, AUTH_READER};
  for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++) {
    if (strcmp(s, auth_role_name(roles[i])) == 0)
      return roles[i];
  }
  return AUTH_NONE;
}

static int hex_value(int c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

static int fail(char *err, size_t err_bytes, const char *path, unsigned line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int fail(char *err, size_t err_bytes, const char *path, unsigned line, const char *fmt,
                ...) {
  int n = snprintf(err, err_bytes, "%s:%u: ", path, line);
  if (n >= 0 && (size_t)n < err_bytes) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err + n, err_bytes - (size_t)n, fmt, ap);
    va_end(ap);
  }
  return -EINVAL;
}

/* Parses "quota TENANT key=value..." (fields after the first) into q.
 * Returns 0 or a negative errno with the message in err. */
static int parse_quota(char **fields, unsigned n, const char *path, unsigned lineno, auth_quota *q,
                       char *err, size_t err_bytes) {
  memset(q, 0, sizeof *q);
  if (n < 2 || !ctl_valid_job_dir_name(fields[1]))
    return fail(err, err_bytes, path, lineno, "a quota line is 'quota TENANT key=value...'");
  snprintf(q->tenant, sizeof q->tenant, "%s", fields[1]);
  for (unsigned i = 2; i < n; i++) {
    char *eq = strchr(fields[i], '=');
    if (eq == NULL)
      return fail(err, err_bytes, path, lineno, "'%s' is not key=value", fields[i]);
    *eq = '\0';
    const char *value = eq + 1;
    int kind = -1;
    for (int k = 0; k < AUTH_NQUOTAS; k++)
      if (strcmp(fields[i], quota_names[k]) == 0)
        kind = k;
    if (kind < 0)
      return fail(err, err_bytes, path, lineno,
                  "unknown quota '%s' (jobs, sessions, host-bytes, device-bytes, live-bytes)",
                  fields[i]);
    if (q->limited & (1u << kind))
      return fail(err, err_bytes, path, lineno, "quota '%s' is given twice", fields[i]);
    uint64_t v = 0;
    if (kind == AUTH_QUOTA_JOBS || kind == AUTH_QUOTA_SESSIONS) {
      char *end;
      errno = 0;
      unsigned long long n_value = strtoull(value, &end, 10);
      if (value[0] < '0' || value[0] > '9' || *end != '\0' || errno != 0 || n_value > 1000000)
        return fail(err, err_bytes, path, lineno, "%s must be a count, 0..1000000, not '%s'",
                    fields[i], value);
      v = n_value;
    } else if (strcmp(value, "0") != 0 && size_parse(value, &v) != 0) {
      return fail(err, err_bytes, path, lineno, "%s must be a size such as 64G, not '%s'",
                  fields[i], value);
    }
    q->limited |= 1u << kind;
    q->limit[kind] = v;
  }
  return 0;
}

/* Parses the credential field into p. Returns 0 or -1. */
static int parse_credential(const char *s, auth_principal *p) {
  static const char token_prefix[] = "token-sha256:";
  static const char cert_prefix[] = "cert:";
  if (strncmp(s, token_prefix, sizeof token_prefix - 1) == 0) {
    const char *hex = s + sizeof token_prefix - 1;
    if (strlen(hex) != 64)
      return -1;
    for (size_t i = 0; i < 32; i++) {
      int hi = hex_value(hex[2 * i]), lo = hex_value(hex[2 * i + 1]);
      if (hi < 0 || lo < 0)
        return -1;
      p->token_sha256[i] = (uint8_t)(hi << 4 | lo);
    }
    p->by_cert = 0;
    return 0;
  }
  if (strncmp(s, cert_prefix, sizeof cert_prefix - 1) == 0) {
    const char *cn = s + sizeof cert_prefix - 1;
    size_t n = strlen(cn);
    if (n == 0 || n > AUTH_CERT_MAX_BYTES)
      return -1;
    memcpy(p->cert_name, cn, n + 1);
    p->by_cert = 1;
    return 0;
  }
  return -1;
}

/* Parses one line with its fields split on blanks into p. Returns 1 for a
 * principal, 0 for a blank or comment line, or a negative errno. */
static int parse_line(char *line, const char *path, unsigned lineno, auth_principal *p,
                      auth_quota *q, char *err, size_t err_bytes) {
  char *fields[2 + AUTH_NQUOTAS + 1];
  unsigned n = 0;
  char *save = NULL;
  for (char *tok = strtok_r(line, " \t\r\n", &save); tok != NULL;
       tok = strtok_r(NULL, " \t\r\n", &save)) {
    if (tok[0] == '#')
      break;
    if (n == sizeof fields / sizeof fields[0] || (n == 4 && strcmp(fields[0], "quota") != 0))
      return fail(err, err_bytes, path, lineno, "more than 4 fields (name role tenant credential)");
    fields[n++] = tok;
  }
  if (n == 0)
    return 0;
  if (strcmp(fields[0], "quota") == 0) {
    int rc = parse_quota(fields, n, path, lineno, q, err, err_bytes);
    return rc != 0 ? rc : 2;
  }
  if (n != 4)
    return fail(err, err_bytes, path, lineno, "expected 4 fields (name role tenant credential)");
  memset(p, 0, sizeof *p);
  p->role = role_from_name(fields[1]);
  if (p->role == AUTH_NONE)
    return fail(err, err_bytes, path, lineno, "unknown role '%s' (admin, node, tenant or reader)",
                fields[1]);
  int wildcard = strcmp(fields[0], "*") == 0;
  if (!(wildcard && p->role == AUTH_NODE) && !ctl_valid_name(fields[0]))
    return fail(err, err_bytes, path, lineno,
                "bad name '%s' (1..64 of [A-Za-z0-9._-]; '*' only for a node)", fields[0]);
  snprintf(p->name, sizeof p->name, "%s", fields[0]);
  int has_tenant = strcmp(fields[2], "-") != 0;
  if (p->role == AUTH_TENANT || p->role == AUTH_READER) {
    if (!has_tenant || !ctl_valid_job_dir_name(fields[2]))
      return fail(err, err_bytes, path, lineno,
                  "a %s needs a tenant name (1..64 of [A-Za-z0-9._-]), not '%s'",
                  auth_role_name(p->role), fields[2]);
    snprintf(p->tenant, sizeof p->tenant, "%s", fields[2]);
  } else if (has_tenant) {
    return fail(err, err_bytes, path, lineno, "a %s has no tenant: write '-', not '%s'",
                auth_role_name(p->role), fields[2]);
  }
  if (parse_credential(fields[3], p) != 0)
    return fail(err, err_bytes, path, lineno,
                "bad credential (token-sha256:<64 hex digits> or cert:<common name>)");
  return 1;
}

int auth_load(const char *path, auth_table **out, char *err, size_t err_bytes) {
  *out = NULL;
  FILE *f = fopen(path, "r");
  if (f == NULL) {
    int rc = -errno;
    snprintf(err, err_bytes, "cannot read the principals file %s: %s", path, strerror(-rc));
    return rc;
  }
  auth_table *t = calloc(1, sizeof *t);
  char *line = malloc(AUTH_LINE_MAX_BYTES + 2);
  int rc = 0;
  if (t == NULL || line == NULL) {
    snprintf(err, err_bytes, "out of memory reading %s", path);
    rc = -ENOMEM;
    goto out;
  }
  size_t cap = 0;
  unsigned lineno = 0;
  while (fgets(line, AUTH_LINE_MAX_BYTES + 2, f) != NULL) {
    lineno++;
    size_t len = strlen(line);
    if (len > AUTH_LINE_MAX_BYTES && line[len - 1] != '\n') {
      rc = fail(err, err_bytes, path, lineno, "line longer than %d bytes", AUTH_LINE_MAX_BYTES);
      goto out;
    }
    auth_principal p;
    auth_quota q;
    int got = parse_line(line, path, lineno, &p, &q, err, err_bytes);
    if (got < 0) {
      rc = got;
      goto out;
    }
    if (got == 0)
      continue;
    if (got == 2) {
      if (auth_quota_of(t, q.tenant) != NULL) {
        rc = fail(err, err_bytes, path, lineno, "tenant %s has two quota lines", q.tenant);
        goto out;
      }
      auth_quota *grown = realloc(t->quotas, (t->nquotas + 1) * sizeof *grown);
      if (grown == NULL || t->nquotas >= AUTH_MAX_PRINCIPALS) {
        if (grown != NULL)
          t->quotas = grown;
        snprintf(err, err_bytes, "too many quota lines in %s", path);
        rc = -ENOMEM;
        goto out;
      }
      t->quotas = grown;
      t->quotas[t->nquotas++] = q;
      continue;
    }
    for (size_t i = 0; i < t->count; i++) {
      const auth_principal *other = &t->principals[i];
      if (strcmp(other->name, p.name) == 0) {
        rc = fail(err, err_bytes, path, lineno, "principal '%s' is defined twice", p.name);
        goto out;
      }
      if (other->by_cert == p.by_cert &&
          (p.by_cert ? strcmp(other->cert_name, p.cert_name) == 0
                     : memcmp(other->token_sha256, p.token_sha256, 32) == 0)) {
        rc = fail(err, err_bytes, path, lineno, "'%s' has the same credential as '%s'", p.name,
                  other->name);
        goto out;
      }
    }
    if (t->count == AUTH_MAX_PRINCIPALS) {
      rc = fail(err, err_bytes, path, lineno, "more than %d principals", AUTH_MAX_PRINCIPALS);
      goto out;
    }
    if (t->count == cap) {
      size_t new_cap = cap == 0 ? 16 : cap * 2;
      auth_principal *grown = realloc(t->principals, new_cap * sizeof *grown);
      if (grown == NULL) {
        snprintf(err, err_bytes, "out of memory reading %s", path);
        rc = -ENOMEM;
        goto out;
      }
      t->principals = grown;
      cap = new_cap;
    }
    t->principals[t->count++] = p;
  }
  if (ferror(f)) {
    snprintf(err, err_bytes, "cannot read the principals file %s: read error", path);
    rc = -EIO;
  }
out:
  fclose(f);
  free(line);
  if (rc != 0) {
    auth_free(t);
    return rc;
  }
  *out = t;
  return 0;
}

void auth_free(auth_table *t) {
  if (t == NULL)
    return;
  if (t->principals != NULL)
    OPENSSL_cleanse(t->principals, t->count * sizeof *t->principals);
  free(t->principals);
  free(t->quotas);
  free(t);
}

const auth_quota *auth_quota_of(const auth_table *t, const char *tenant) {
  for (size_t i = 0; i < t->nquotas; i++)
    if (strcmp(t->quotas[i].tenant, tenant) == 0)
      return &t->quotas[i];
  return NULL;
}

size_t auth_count(const auth_table *t) {
  return t != NULL ? t->count : 0;
}

const auth_principal *auth_by_token(const auth_table *t, const char *token, size_t token_bytes) {
  uint8_t digest[32];
  digest_sha256(token, token_bytes, digest);
  /* Every entry is compared, in constant time each, so the time taken
   * says nothing about which digest bytes matched. */
  const auth_principal *found = NULL;
  for (size_t i = 0; i < t->count; i++) {
    const auth_principal *p = &t->principals[i];
    if (!p->by_cert && CRYPTO_memcmp(p->token_sha256, digest, 32) == 0)
      found = p;
  }
  return found;
}

const auth_principal *auth_at(const auth_table *t, size_t i) {
  return &t->principals[i];
}

size_t auth_index(const auth_table *t, const auth_principal *p) {
  return (size_t)(p - t->principals);
}

const auth_principal *auth_by_cert(const auth_table *t, const char *cn) {
  for (size_t i = 0; i < t->count; i++) {
    const auth_principal *p = &t->principals[i];
    if (p->by_cert && strcmp(p->cert_name, cn) == 0)
      return p;
  }
  return NULL;
}
