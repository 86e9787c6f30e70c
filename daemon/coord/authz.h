/* authz: who may make which control-plane call (docs/security.md; the
 * rules, by method, are at the top of authz.c).
 *
 * The policy is a pure function of the caller, the method and its decoded
 * request: what it needs of the coordinator's state (a job's tenant and
 * placement, the export roots) comes in through authz_env, so it can be
 * tested rule by rule without a coordinator (tests/unit/test_authz.c).
 * Included by coord_impl.h, for every file of the coordinator, and by that
 * test; it includes nothing of the coordinator's but auth.h. */
#ifndef ZEROD_AUTHZ_H
#define ZEROD_AUTHZ_H

#include <limits.h>
#include <stddef.h>

#include "auth.h"
#include "zerod/v1/control.pb-c.h"

/* The caller of a call as the policy sees it (coord__caller makes it). */
typedef struct coord_caller {
  auth_role role;
  /* Every check passes: a caller on the Unix socket (whose mode is the
   * access control), or any caller when no principals are configured. */
  int trusted;
  int any_node; /* a node principal named "*" */
  long index;   /* the principal's index in the table, or -1 */
  char name[AUTH_NAME_MAX_BYTES + 1];
  char tenant[AUTH_NAME_MAX_BYTES + 1];
} coord_caller;

/* What the policy reads of the coordinator. */
typedef struct authz_env {
  /* The stored job named name (live or being deleted: its tenant and
   * placement are what count), or NULL when there is none. */
  const Zerod__V1__Job *(*find_job)(void *arg, const char *name);
  void *arg;
  /* --export-root, [n_export_roots]: where a tenant's exports go. */
  const char (*export_roots)[PATH_MAX];
  unsigned n_export_roots;
} authz_env;

/* Decides whether who may make the request msg of the method at path.
 * Returns 0 or RPC_PERMISSION_DENIED with the reason in err; a method
 * without a rule is refused. audit receives what a changing call is about
 * ("job=x"), "" for a call that changes nothing, whatever the verdict. */
int authz_check(const authz_env *env, const coord_caller *who, const char *path,
                const ProtobufCMessage *msg, char *audit, size_t audit_bytes, char *err,
                size_t err_bytes);

/* Whether who may read (get, list, export) or own (delete, save,
 * restore, freeze) job. A base is also read by the tenants it is shared
 * with (every tenant when public). */
int authz_may_read_job(const coord_caller *who, const Zerod__V1__Job *job);
int authz_may_own_job(const coord_caller *who, const Zerod__V1__Job *job);
/* Whether who may create a job of tenant (the new job's) on base, a
 * frozen job (docs/bases.md): an admin; a tenant principal for the base's
 * own tenant, a tenant it is shared with, or any when it is public. */
int authz_may_build_on(const coord_caller *who, const char *tenant, const Zerod__V1__Job *base);
/* Whether who is a node principal of one of job's placement nodes. */
int authz_placed_on(const coord_caller *who, const Zerod__V1__Job *job);

#endif /* ZEROD_AUTHZ_H */
