/* authz: who may make which control-plane call (docs/security.md).
 *
 * coord__identify (coord_call.c) names the caller of every call as it
 * arrives, before its request message (rpc.h: the server admits it by that
 * name, or refuses it); coord__begin then takes that caller
 * (coord__caller), ctl_decode's request and authz_check's verdict,
 * for every request but health checks: a handler only runs for a caller
 * allowed to make its request. Calls that change state are marked for the
 * audit log here too, so that no handler can forget.
 *
 * The rules, by method:
 *   Join, Heartbeat, Watch  a node principal of the request's node name
 *                           (Watch replies carry the owner tokens of the
 *                           node's jobs: not even an admin gets them)
 *   Leave                   that node, or an admin
 *   GetView                 anyone authenticated (sessions only for nodes
 *                           and admins: on_get_view)
 *   CreateJob               a tenant (for its own tenant) or an admin
 *   GetJob                  a reader of the job's tenant and up
 *   ListJobs                anyone; each sees the jobs it may read
 *   DeleteJob               the job's tenant or an admin
 *   FreezeJob               the job's tenant or an admin (docs/bases.md)
 *   ScaleJob                the job's tenant or an admin (docs/redundancy.md)
 *   IssueReadToken          a reader of the job's tenant and up
 *   LocateJob               a node principal (following the job for its
 *                           read-only sessions) or an admin; the handler
 *                           checks that the request's token admits a
 *                           read-only session of the job
 *   Put, Get, Delete (KV)   a node the job is placed on, or an admin
 *   Save, Delete checkpoint the job's tenant or an admin; Save also a
 *                           node the job is placed on (its workers asked:
 *                           CHECKPOINT, node/ckpt_call.c)
 *   Restore                 the job's tenant or an admin, who must also
 *                           be able to read the source (another job's
 *                           checkpoint: that job; a path: admins only);
 *                           also a node the job is placed on, from the
 *                           job's own checkpoints only
 *   Export                  a reader of the job's tenant and up, with the
 *                           same rule for the source; a tenant's or a
 *                           reader's file goes in <export root>/<tenant>/
 *   List checkpoints        of a job: a reader of it; of every job: each
 *                           sees those of the jobs it may read
 * A base (a frozen job) is also read by the tenants it is shared with
 * (every tenant when public), who may create jobs on it (CreateJob's
 * handler asks authz_may_build_on, once it knows the base exists and is
 * frozen). A job with no tenant is an admin's alone. A caller on the Unix socket
 * (zerod standalone's control socket, mode 0600/0660) and any caller of a
 * coordinator without principals (--auth-file) is trusted: every check
 * passes. */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "authz.h"
#include "ctl_decode.h"
#include "log.h"
#include "rpc.h"

/* Whether a base is shared with tenant (or with every tenant). */
static int shared_with(const Zerod__V1__Job *base, const char *tenant) {
  if (!base->frozen || tenant[0] == '\0')
    return 0;
  if (base->public_)
    return 1;
  for (size_t i = 0; i < base->n_shared_with; i++)
    if (strcmp(base->shared_with[i], tenant) == 0)
      return 1;
  return 0;
}

int authz_may_read_job(const coord_caller *who, const Zerod__V1__Job *job) {
  if (who->role == AUTH_ADMIN)
    return 1;
  if (who->role != AUTH_TENANT && who->role != AUTH_READER)
    return 0;
  if (job->tenant[0] != '\0' && strcmp(job->tenant, who->tenant) == 0)
    return 1;
  return shared_with(job, who->tenant);
}

int authz_may_build_on(const coord_caller *who, const char *tenant, const Zerod__V1__Job *base) {
  if (who->role == AUTH_ADMIN)
    return 1;
  if (who->role != AUTH_TENANT || tenant[0] == '\0')
    return 0;
  if (base->tenant[0] != '\0' && strcmp(base->tenant, tenant) == 0)
    return 1;
  return shared_with(base, tenant);
}

int authz_may_own_job(const coord_caller *who, const Zerod__V1__Job *job) {
  if (who->role == AUTH_ADMIN)
    return 1;
  return who->role == AUTH_TENANT && job->tenant[0] != '\0' &&
         strcmp(job->tenant, who->tenant) == 0;
}

/* Whether who is a node principal for the node named node. */
static int is_node(const coord_caller *who, const char *node) {
  return who->role == AUTH_NODE && (who->any_node || strcmp(who->name, node) == 0);
}

static int deny(char *err, size_t err_bytes, const coord_caller *who, const char *what) {
  if (who->tenant[0] != '\0')
    snprintf(err, err_bytes, "%s %s of tenant %s may not %s", auth_role_name(who->role), who->name,
             who->tenant, what);
  else
    snprintf(err, err_bytes, "%s %s may not %s", auth_role_name(who->role), who->name, what);
  return RPC_PERMISSION_DENIED;
}

/* A job-scoped call: the job must exist for the rule to say anything (a
 * missing job is the handler's NOT_FOUND, which says no more than a
 * CreateJob of that name would). */
static int job_rule(const authz_env *env, const coord_caller *who, const char *job, int need_owner,
                    const char *verb, char *err, size_t err_bytes) {
  const Zerod__V1__Job *j = env->find_job(env->arg, job);
  if (j == NULL)
    return 0;
  if (need_owner ? authz_may_own_job(who, j) : authz_may_read_job(who, j))
    return 0;
  char what[160];
  snprintf(what, sizeof what, "%s job '%s'", verb, job);
  return deny(err, err_bytes, who, what);
}

/* The source of a Restore or an Export: another job's checkpoint needs
 * that job to be readable (a deleted job's, an admin); a path, an admin. */
static int source_rule(const authz_env *env, const coord_caller *who, const char *ref, char *err,
                       size_t err_bytes) {
  if (ref == NULL || ref[0] == '\0' || who->role == AUTH_ADMIN)
    return 0;
  char job[CTL_CKPT_DIR_MAX_BYTES + 1], name[CTL_NAME_MAX_BYTES + 1];
  switch (ctl_parse_checkpoint_ref(ref, job, name)) {
  case CTL_REF_JOB_NAME: {
    /* A deleted job's checkpoints (or any not found) are checked by
     * their owner as they are read (ckpt_owner.c); a live job's need the
     * job to be readable, and a node reads no job's but its own. */
    const Zerod__V1__Job *j = env->find_job(env->arg, job);
    if (j == NULL ? who->role != AUTH_NODE : authz_may_read_job(who, j))
      return 0;
    char what[200];
    snprintf(what, sizeof what, "read the checkpoints of job '%s'", job);
    return deny(err, err_bytes, who, what);
  }
  case CTL_REF_PATH:
    return deny(err, err_bytes, who, "restore or export from a path (an admin may)");
  default:
    return 0; /* a name of the job itself, or invalid: the handler says */
  }
}

/* Where a tenant or a reader may export: its tenant's directory in an
 * export root (made at start, coord_create), never the checkpoint
 * directory, where another job's files live. A relative path is taken in
 * the first root, so it must start with "<tenant>/". */
static int export_path_rule(const authz_env *env, const coord_caller *who, const char *path,
                            char *err, size_t err_bytes) {
  if (who->role == AUTH_ADMIN)
    return 0;
  const authz_env *o = env;
  size_t tenant_len = strlen(who->tenant);
  if (o->n_export_roots > 0) {
    if (path[0] != '/') {
      if (strncmp(path, who->tenant, tenant_len) == 0 && path[tenant_len] == '/')
        return 0;
    } else {
      for (unsigned i = 0; i < o->n_export_roots; i++) {
        size_t root_len = strlen(o->export_roots[i]);
        if (strncmp(path, o->export_roots[i], root_len) == 0 && path[root_len] == '/' &&
            strncmp(path + root_len + 1, who->tenant, tenant_len) == 0 &&
            path[root_len + 1 + tenant_len] == '/')
          return 0;
      }
    }
  }
  char what[PATH_MAX + 200];
  if (o->n_export_roots == 0)
    snprintf(what, sizeof what, "export (this coordinator has no --export-root for tenants)");
  else
    snprintf(what, sizeof what, "export to %s: a tenant's exports go in %s/%s/ (or a path %s/...)",
             path, o->export_roots[0], who->tenant, who->tenant);
  return deny(err, err_bytes, who, what);
}

static int node_rule(const coord_caller *who, const char *node, int admin_too, const char *verb,
                     char *err, size_t err_bytes) {
  if (is_node(who, node) || (admin_too && who->role == AUTH_ADMIN))
    return 0;
  char what[160];
  snprintf(what, sizeof what, "%s as node '%s'", verb, node);
  return deny(err, err_bytes, who, what);
}

int authz_placed_on(const coord_caller *who, const Zerod__V1__Job *job) {
  for (size_t i = 0; i < job->n_placement; i++) {
    if (is_node(who, job->placement[i]->node))
      return 1;
  }
  return 0;
}

/* Save and Restore: the job's owner, or a node the job is placed on, which
 * asks for its workers (they hold the job's owner token; a node is
 * trusted with the job's state already). A node's Restore reads the job's
 * own checkpoints only: source_rule refuses it any other source, since a
 * node reads no job. */
static int owner_or_node_rule(const authz_env *env, const coord_caller *who, const char *job,
                              const char *verb, char *err, size_t err_bytes) {
  const Zerod__V1__Job *j = env->find_job(env->arg, job);
  if (j != NULL && who->role == AUTH_NODE && authz_placed_on(who, j))
    return 0;
  return job_rule(env, who, job, 1, verb, err, err_bytes);
}

static int kv_rule(const authz_env *env, const coord_caller *who, const char *job, char *err,
                   size_t err_bytes) {
  if (who->role == AUTH_ADMIN)
    return 0;
  const Zerod__V1__Job *j = env->find_job(env->arg, job);
  if (who->role == AUTH_NODE && (j == NULL || authz_placed_on(who, j)))
    return 0; /* j == NULL: NOT_FOUND from the handler */
  char what[160];
  snprintf(what, sizeof what, "use the rendezvous of job '%s' (only its nodes may)", job);
  return deny(err, err_bytes, who, what);
}

/* "k=v k=v" of the fields that are set, each value quoted as log.h
 * quotes (a path with a space stays one value), for the audit line; ""
 * when none is set (a call that changes nothing). */
static void audit_fields(char *out, size_t out_bytes, const char *const (*fields)[2], size_t n) {
  size_t len = 0;
  out[0] = '\0';
  for (size_t i = 0; i < n; i++) {
    if (fields[i][1] == NULL)
      continue;
    char quoted[512];
    int w = snprintf(out + len, out_bytes - len, "%s%s=%s", len > 0 ? " " : "", fields[i][0],
                     log_quote(fields[i][1], quoted, sizeof quoted));
    if (w < 0 || (size_t)w >= out_bytes - len)
      return;
    len += (size_t)w;
  }
}

#define IS(p) (strcmp(path, (p)) == 0)

/* What the audit line says a changing call was about, into audit; "" for
 * a call that changes nothing. Rendezvous Puts and Deletes are not
 * audited: they are the nodes' own traffic while communicators are built,
 * as heartbeats are their leases (a refused one is logged as refused,
 * coord__begin). */
static void audit_line(const coord_caller *who, const char *path, const ProtobufCMessage *msg,
                       char *audit, size_t audit_bytes) {
  audit[0] = '\0';
  const char *job = NULL, *node = NULL, *checkpoint = NULL, *source = NULL, *target = NULL,
             *tenant = NULL;
  if (IS(CTL_JOIN)) {
    node = ((const Zerod__V1__JoinRequest *)msg)->node->name;
  } else if (IS(CTL_LEAVE)) {
    node = ((const Zerod__V1__LeaveRequest *)msg)->node;
  } else if (IS(CTL_CREATE_JOB)) {
    const Zerod__V1__CreateJobRequest *r = (const void *)msg;
    job = r->name;
    tenant = r->tenant[0] != '\0' ? r->tenant : who->tenant;
  } else if (IS(CTL_DELETE_JOB)) {
    job = ((const Zerod__V1__DeleteJobRequest *)msg)->name;
  } else if (IS(CTL_FREEZE_JOB)) {
    job = ((const Zerod__V1__FreezeJobRequest *)msg)->name;
  } else if (IS(CTL_SCALE_JOB)) {
    job = ((const Zerod__V1__ScaleJobRequest *)msg)->name;
  } else if (IS(CTL_ISSUE_READ_TOKEN)) {
    job = ((const Zerod__V1__IssueReadTokenRequest *)msg)->job;
  } else if (IS(CTL_SAVE)) {
    job = ((const Zerod__V1__SaveRequest *)msg)->job;
    checkpoint = ((const Zerod__V1__SaveRequest *)msg)->name;
  } else if (IS(CTL_DELETE_CHECKPOINT)) {
    job = ((const Zerod__V1__DeleteCheckpointRequest *)msg)->job;
    checkpoint = ((const Zerod__V1__DeleteCheckpointRequest *)msg)->name;
  } else if (IS(CTL_RESTORE)) {
    job = ((const Zerod__V1__RestoreRequest *)msg)->job;
    source = ((const Zerod__V1__RestoreRequest *)msg)->checkpoint;
  } else if (IS(CTL_EXPORT)) {
    job = ((const Zerod__V1__ExportRequest *)msg)->job;
    source = ((const Zerod__V1__ExportRequest *)msg)->checkpoint;
    target = ((const Zerod__V1__ExportRequest *)msg)->path;
  }
  const char *fields[][2] = {{"node", node},     {"job", job},
                             {"tenant", tenant}, {"checkpoint", checkpoint},
                             {"source", source}, {"path", target}};
  audit_fields(audit, audit_bytes, fields, sizeof fields / sizeof fields[0]);
}

/* The rule of the method at path (the table at the top of the file). */
static int method_rule(const authz_env *env, const coord_caller *who, const char *path,
                       const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  if (IS(CTL_JOIN))
    return node_rule(who, ((const Zerod__V1__JoinRequest *)msg)->node->name, 0, "join", err,
                     err_bytes);
  if (IS(CTL_HEARTBEAT))
    return node_rule(who, ((const Zerod__V1__HeartbeatRequest *)msg)->node, 0, "heartbeat", err,
                     err_bytes);
  if (IS(CTL_WATCH))
    return node_rule(who, ((const Zerod__V1__WatchRequest *)msg)->node, 0, "watch", err, err_bytes);
  if (IS(CTL_LEAVE))
    return node_rule(who, ((const Zerod__V1__LeaveRequest *)msg)->node, 1, "leave", err, err_bytes);
  if (IS(CTL_GET_VIEW) || IS(CTL_LIST_JOBS))
    return 0; /* filtered by the handler */
  if (IS(CTL_CREATE_JOB)) {
    const Zerod__V1__CreateJobRequest *r = (const void *)msg;
    if (who->role == AUTH_ADMIN)
      return 0;
    if (who->role != AUTH_TENANT)
      return deny(err, err_bytes, who, "create jobs (tenants and admins may)");
    if (r->tenant[0] != '\0' && strcmp(r->tenant, who->tenant) != 0) {
      char what[160];
      snprintf(what, sizeof what, "create a job for tenant %s", r->tenant);
      return deny(err, err_bytes, who, what);
    }
    return 0;
  }
  if (IS(CTL_GET_JOB))
    return job_rule(env, who, ((const Zerod__V1__GetJobRequest *)msg)->name, 0, "read", err,
                    err_bytes);
  if (IS(CTL_ISSUE_READ_TOKEN))
    return job_rule(env, who, ((const Zerod__V1__IssueReadTokenRequest *)msg)->job, 0,
                    "get read tokens of", err, err_bytes);
  if (IS(CTL_LOCATE_JOB))
    return who->role == AUTH_NODE || who->role == AUTH_ADMIN
               ? 0
               : deny(err, err_bytes, who, "locate jobs (nodes and admins may)");
  if (IS(CTL_DELETE_JOB))
    return job_rule(env, who, ((const Zerod__V1__DeleteJobRequest *)msg)->name, 1, "delete", err,
                    err_bytes);
  if (IS(CTL_FREEZE_JOB))
    return job_rule(env, who, ((const Zerod__V1__FreezeJobRequest *)msg)->name, 1, "freeze", err,
                    err_bytes);
  if (IS(CTL_SCALE_JOB))
    return job_rule(env, who, ((const Zerod__V1__ScaleJobRequest *)msg)->name, 1, "scale", err,
                    err_bytes);
  if (IS(CTL_PUT))
    return kv_rule(env, who, ((const Zerod__V1__PutRequest *)msg)->job, err, err_bytes);
  if (IS(CTL_GET))
    return kv_rule(env, who, ((const Zerod__V1__GetRequest *)msg)->job, err, err_bytes);
  if (IS(CTL_DELETE))
    return kv_rule(env, who, ((const Zerod__V1__DeleteRequest *)msg)->job, err, err_bytes);
  if (IS(CTL_SAVE))
    return owner_or_node_rule(env, who, ((const Zerod__V1__SaveRequest *)msg)->job, "save", err,
                              err_bytes);
  if (IS(CTL_DELETE_CHECKPOINT))
    return job_rule(env, who, ((const Zerod__V1__DeleteCheckpointRequest *)msg)->job, 1,
                    "delete checkpoints of", err, err_bytes);
  if (IS(CTL_LIST_CHECKPOINTS)) {
    const char *listed = ((const Zerod__V1__ListCheckpointsRequest *)msg)->job;
    return listed[0] != '\0' ? job_rule(env, who, listed, 0, "list checkpoints of", err, err_bytes)
                             : 0;
  }
  if (IS(CTL_RESTORE)) {
    const Zerod__V1__RestoreRequest *r = (const void *)msg;
    int rc = owner_or_node_rule(env, who, r->job, "restore", err, err_bytes);
    return rc != 0 ? rc : source_rule(env, who, r->checkpoint, err, err_bytes);
  }
  if (IS(CTL_EXPORT)) {
    /* The job is what is exported unless the checkpoint names another
     * job's directory or a path: then the job plays no part, and the rule
     * is the source's. */
    const Zerod__V1__ExportRequest *r = (const void *)msg;
    char dir[CTL_CKPT_DIR_MAX_BYTES + 1], name[CTL_NAME_MAX_BYTES + 1];
    ctl_checkpoint_ref ref = r->checkpoint[0] != '\0'
                                 ? ctl_parse_checkpoint_ref(r->checkpoint, dir, name)
                                 : CTL_REF_INVALID;
    int rc = ref == CTL_REF_JOB_NAME || ref == CTL_REF_PATH
                 ? 0
                 : job_rule(env, who, r->job, 0, "export", err, err_bytes);
    if (rc == 0)
      rc = source_rule(env, who, r->checkpoint, err, err_bytes);
    return rc != 0 ? rc : export_path_rule(env, who, r->path, err, err_bytes);
  }
  /* A method without a rule is refused: a new method must get one. */
  snprintf(err, err_bytes, "no authorization rule for %s", path);
  return RPC_PERMISSION_DENIED;
}

#undef IS

int authz_check(const authz_env *env, const coord_caller *who, const char *path,
                const ProtobufCMessage *msg, char *audit, size_t audit_bytes, char *err,
                size_t err_bytes) {
  audit_line(who, path, msg, audit, audit_bytes);
  if (who->trusted)
    return 0;
  return method_rule(env, who, path, msg, err, err_bytes);
}
