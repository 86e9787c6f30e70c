/* auth: who a control-plane caller is (docs/security.md).
 *
 * The coordinator knows its principals from a file (--auth-file), one per
 * line:
 *
 *   # name     role    tenant   credential
 *   ops        admin   -        token-sha256:<64 hex digits>
 *   alice      tenant  team-a   token-sha256:<64 hex digits>
 *   dash       reader  team-a   cert:dashboard.team-a
 *   node-1     node    -        cert:node-1
 *   *          node    -        token-sha256:<64 hex digits>
 *
 * A caller is identified by a bearer token ("authorization: Bearer T" in
 * the call's metadata), matched by its SHA-256 (the file never holds a
 * token), or else by the subject common name of a client certificate that
 * TLS has verified. Roles:
 *   admin   the cluster and every job;
 *   node    the Cluster service as the node of its name ("*": any name)
 *           and the rendezvous of the jobs placed on that node;
 *   tenant  creates jobs, which belong to its tenant, and has every right
 *           over its tenant's jobs;
 *   reader  reads its tenant's jobs: get, list, export.
 * What each RPC needs is in coord/authz.c and docs/security.md.
 *
 * A tenant's quotas are a line of their own (every key optional):
 *
 *   quota team-a jobs=4 sessions=64 host-bytes=256G device-bytes=320G live-bytes=64G
 *
 * Checked when a job is created (coord_jobs.c): the tenant's jobs, and the sums
 * over them of each job's per-rank quota times its ranks (sessions: per
 * node, times its nodes). This file parses them; it decides nothing. */
#ifndef ZEROD_COORD_AUTH_H
#define ZEROD_COORD_AUTH_H

#include <stddef.h>
#include <stdint.h>

typedef enum auth_role {
  AUTH_NONE = 0,
  AUTH_READER = 1,
  AUTH_TENANT = 2,
  AUTH_NODE = 3,
  AUTH_ADMIN = 4,
} auth_role;

#define AUTH_NAME_MAX_BYTES 64   /* principal and tenant names: as job names */
#define AUTH_CERT_MAX_BYTES 255  /* a certificate's common name */
#define AUTH_MAX_PRINCIPALS 4096 /* lines of the file that name one */

typedef struct auth_principal {
  char name[AUTH_NAME_MAX_BYTES + 1]; /* "*" for a node: any node name */
  auth_role role;
  char tenant[AUTH_NAME_MAX_BYTES + 1]; /* tenant and reader; "" otherwise */
  int by_cert;                          /* 1: cert_name; 0: token_sha256 */
  uint8_t token_sha256[32];
  char cert_name[AUTH_CERT_MAX_BYTES + 1];
} auth_principal;

/* A tenant's quotas; a field is a limit only where its bit is set in
 * limited (a limit may be 0: jobs=0 allows none). */
typedef enum auth_quota_kind {
  AUTH_QUOTA_JOBS = 0,
  AUTH_QUOTA_SESSIONS,
  AUTH_QUOTA_HOST_BYTES,
  AUTH_QUOTA_DEVICE_BYTES,
  AUTH_QUOTA_LIVE_BYTES,
  AUTH_NQUOTAS,
} auth_quota_kind;

typedef struct auth_quota {
  char tenant[AUTH_NAME_MAX_BYTES + 1];
  unsigned limited; /* 1 << auth_quota_kind */
  uint64_t limit[AUTH_NQUOTAS];
} auth_quota;

/* "jobs", "sessions", "host-bytes", "device-bytes", "live-bytes". */
const char *auth_quota_name(auth_quota_kind kind);

typedef struct auth_table auth_table;

/* Reads the principals file. Returns 0 with the table, or a negative
 * errno with "FILE:LINE: what is wrong" in err: unknown role, bad name,
 * a tenant missing (tenant, reader) or given (admin, node), a credential
 * that is neither token-sha256:<64 hex> nor cert:<name>, a duplicate
 * name or credential. */
int auth_load(const char *path, auth_table **out, char *err, size_t err_bytes);
void auth_free(auth_table *t);
size_t auth_count(const auth_table *t);
/* Principal i, 0 <= i < auth_count(t). */
const auth_principal *auth_at(const auth_table *t, size_t i);

/* The principal whose token's SHA-256 is that of token, or NULL. */
const auth_principal *auth_by_token(const auth_table *t, const char *token, size_t token_bytes);

/* The quotas of tenant, or NULL when it has none. */
const auth_quota *auth_quota_of(const auth_table *t, const char *tenant);

/* The principal with certificate name cn, or NULL. */
const auth_principal *auth_by_cert(const auth_table *t, const char *cn);

/* The index of p (from auth_by_*) in the table, 0..auth_count-1. */
size_t auth_index(const auth_table *t, const auth_principal *p);

/* "admin", "node", "tenant", "reader", "none". */
const char *auth_role_name(auth_role role);

#endif /* ZEROD_COORD_AUTH_H */
