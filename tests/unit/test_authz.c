/* The control plane's policy (coord/authz.c), rule by rule: for each row
 * of the table at the top of authz.c, a caller the rule lets through and
 * one it refuses, against a fixed set of jobs found through the policy's
 * job lookup. No coordinator runs: authz_check is a function of the
 * caller, the method and its decoded request.
 *
 * The jobs: "a1" of tenant team-a on nodes n1 and n2, "b1" of team-b on
 * n3, "adm" of no tenant (an admin's alone) on n1, and "base", team-a's
 * base (a frozen job) on n1, shared with team-c. The callers: an admin,
 * tenants alice (team-a), bob (team-b) and carol (team-c), reader dash
 * (team-a), nodes n1 and n3, the any-node principal "*", and a trusted
 * caller (the Unix socket, or no principals configured). */
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "authz.h"
#include "ctl_decode.h"
#include "rpc.h"

/* ------------------------------------------------------------------------ */
/* The jobs and the callers                                                 */
/* ------------------------------------------------------------------------ */

typedef struct test_job {
  Zerod__V1__Job msg;
  Zerod__V1__RankPlacement placement[2];
  Zerod__V1__RankPlacement *placement_ptrs[2];
} test_job;

static test_job jobs[4];
static char *base_shared_with[] = {"team-c"};
static int lookups; /* how many times the policy asked for a job */

static void job_init(test_job *t, const char *name, const char *tenant, const char *node0,
                     const char *node1) {
  zerod__v1__job__init(&t->msg);
  t->msg.name = (char *)name;
  t->msg.tenant = (char *)tenant;
  const char *nodes[2] = {node0, node1};
  size_t n = 0;
  for (size_t i = 0; i < 2; i++) {
    if (nodes[i] == NULL)
      continue;
    zerod__v1__rank_placement__init(&t->placement[n]);
    t->placement[n].node = (char *)nodes[i];
    t->placement[n].first_rank = (uint32_t)n;
    t->placement[n].ranks = 1;
    t->placement_ptrs[n] = &t->placement[n];
    n++;
  }
  t->msg.n_placement = n;
  t->msg.placement = t->placement_ptrs;
}

static const Zerod__V1__Job *find_job(void *arg, const char *name) {
  (void)arg;
  lookups++;
  for (size_t i = 0; i < sizeof jobs / sizeof jobs[0]; i++)
    if (strcmp(jobs[i].msg.name, name) == 0)
      return &jobs[i].msg;
  return NULL;
}

static char roots[2][PATH_MAX] = {"/exports", "/mnt/more"};
static authz_env env = {.find_job = find_job, .export_roots = roots, .n_export_roots = 2};
static const authz_env no_roots = {.find_job = find_job, .n_export_roots = 0};

static coord_caller caller(auth_role role, const char *name, const char *tenant) {
  coord_caller who;
  memset(&who, 0, sizeof who);
  who.role = role;
  who.index = 0;
  who.any_node = role == AUTH_NODE && strcmp(name, "*") == 0;
  snprintf(who.name, sizeof who.name, "%s", name);
  snprintf(who.tenant, sizeof who.tenant, "%s", tenant);
  return who;
}

static coord_caller admin, alice, bob, carol, dash, n1, n3, any_node, trusted;

static int setup(void **state) {
  (void)state;
  job_init(&jobs[0], "a1", "team-a", "n1", "n2");
  job_init(&jobs[1], "b1", "team-b", "n3", NULL);
  job_init(&jobs[2], "adm", "", "n1", NULL);
  job_init(&jobs[3], "base", "team-a", "n1", NULL);
  jobs[3].msg.frozen = 1;
  jobs[3].msg.n_shared_with = 1;
  jobs[3].msg.shared_with = base_shared_with;
  admin = caller(AUTH_ADMIN, "ops", "");
  alice = caller(AUTH_TENANT, "alice", "team-a");
  bob = caller(AUTH_TENANT, "bob", "team-b");
  carol = caller(AUTH_TENANT, "carol", "team-c");
  dash = caller(AUTH_READER, "dash", "team-a");
  n1 = caller(AUTH_NODE, "n1", "");
  n3 = caller(AUTH_NODE, "n3", "");
  any_node = caller(AUTH_NODE, "*", "");
  trusted = caller(AUTH_ADMIN, "local", "");
  trusted.trusted = 1;
  trusted.index = -1;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Checks                                                                   */
/* ------------------------------------------------------------------------ */

static char audit[1024], err[1024];

static int check_in(const authz_env *e, const coord_caller *who, const char *path,
                    const void *msg) {
  memset(audit, 'x', sizeof audit);
  err[0] = '\0';
  return authz_check(e, who, path, (const ProtobufCMessage *)msg, audit, sizeof audit, err,
                     sizeof err);
}

/* Asserts that who may make the request, and that nothing was refused. */
static void allowed_in(const authz_env *e, const coord_caller *who, const char *path,
                       const void *msg, int line) {
  int status = check_in(e, who, path, msg);
  if (status != 0)
    fail_msg("line %d: %s refused %s: %s", line, who->name, path, err);
}

/* Asserts that who may not make the request: PERMISSION_DENIED, with a
 * reason that names the caller and contains want. */
static void denied_in(const authz_env *e, const coord_caller *who, const char *path,
                      const void *msg, const char *want, int line) {
  int status = check_in(e, who, path, msg);
  if (status != RPC_PERMISSION_DENIED)
    fail_msg("line %d: %s allowed %s (status %d)", line, who->name, path, status);
  if (strstr(err, who->name) == NULL || strstr(err, want) == NULL)
    fail_msg("line %d: reason \"%s\" should name %s and say \"%s\"", line, err, who->name, want);
}

#define ALLOWED(who, path, msg)      allowed_in(&env, &(who), (path), (msg), __LINE__)
#define DENIED(who, path, msg, want) denied_in(&env, &(who), (path), (msg), (want), __LINE__)

/* ------------------------------------------------------------------------ */
/* Cluster                                                                  */
/* ------------------------------------------------------------------------ */

/* Join, Heartbeat, Watch: a node principal of the request's node name
 * ("*": any name); not even an admin. */
static void test_join_heartbeat_watch_are_the_nodes_own(void **state) {
  (void)state;
  Zerod__V1__NodeInfo info = ZEROD__V1__NODE_INFO__INIT;
  info.name = "n1";
  Zerod__V1__JoinRequest join = ZEROD__V1__JOIN_REQUEST__INIT;
  join.node = &info;
  Zerod__V1__HeartbeatRequest heartbeat = ZEROD__V1__HEARTBEAT_REQUEST__INIT;
  heartbeat.node = "n1";
  Zerod__V1__WatchRequest watch = ZEROD__V1__WATCH_REQUEST__INIT;
  watch.node = "n1";
  ALLOWED(n1, CTL_JOIN, &join);
  ALLOWED(any_node, CTL_JOIN, &join);
  DENIED(n3, CTL_JOIN, &join, "join as node 'n1'");
  DENIED(admin, CTL_JOIN, &join, "join as node 'n1'");
  DENIED(alice, CTL_JOIN, &join, "join as node 'n1'");

  ALLOWED(n1, CTL_HEARTBEAT, &heartbeat);
  ALLOWED(any_node, CTL_HEARTBEAT, &heartbeat);
  DENIED(n3, CTL_HEARTBEAT, &heartbeat, "heartbeat as node 'n1'");
  DENIED(admin, CTL_HEARTBEAT, &heartbeat, "heartbeat as node 'n1'");

  ALLOWED(n1, CTL_WATCH, &watch);
  ALLOWED(any_node, CTL_WATCH, &watch);
  DENIED(n3, CTL_WATCH, &watch, "watch as node 'n1'");
  DENIED(admin, CTL_WATCH, &watch, "watch as node 'n1'");
  DENIED(dash, CTL_WATCH, &watch, "watch as node 'n1'");
}

/* Leave: that node, or an admin. */
static void test_leave_is_the_nodes_or_an_admins(void **state) {
  (void)state;
  Zerod__V1__LeaveRequest leave = ZEROD__V1__LEAVE_REQUEST__INIT;
  leave.node = "n1";
  ALLOWED(n1, CTL_LEAVE, &leave);
  ALLOWED(admin, CTL_LEAVE, &leave);
  DENIED(n3, CTL_LEAVE, &leave, "leave as node 'n1'");
  DENIED(alice, CTL_LEAVE, &leave, "leave as node 'n1'");
}

/* GetView and ListJobs: anyone authenticated (the handlers filter what
 * each sees); no role is refused. */
static void test_get_view_and_list_jobs_are_anyones(void **state) {
  (void)state;
  Zerod__V1__GetViewRequest view = ZEROD__V1__GET_VIEW_REQUEST__INIT;
  Zerod__V1__ListJobsRequest list = ZEROD__V1__LIST_JOBS_REQUEST__INIT;
  const coord_caller *everyone[] = {&admin, &alice, &bob, &dash, &n1, &any_node};
  for (size_t i = 0; i < sizeof everyone / sizeof everyone[0]; i++) {
    allowed_in(&env, everyone[i], CTL_GET_VIEW, &view, __LINE__);
    allowed_in(&env, everyone[i], CTL_LIST_JOBS, &list, __LINE__);
  }
}

/* ------------------------------------------------------------------------ */
/* Jobs                                                                     */
/* ------------------------------------------------------------------------ */

/* CreateJob: a tenant, for its own tenant (or none: its own), or an
 * admin, for any. */
static void test_create_job_is_a_tenants_or_an_admins(void **state) {
  (void)state;
  Zerod__V1__CreateJobRequest own = ZEROD__V1__CREATE_JOB_REQUEST__INIT;
  own.name = "new";
  Zerod__V1__CreateJobRequest for_a = own, for_b = own;
  for_a.tenant = "team-a";
  for_b.tenant = "team-b";
  ALLOWED(alice, CTL_CREATE_JOB, &own);
  ALLOWED(alice, CTL_CREATE_JOB, &for_a);
  ALLOWED(admin, CTL_CREATE_JOB, &for_b);
  ALLOWED(admin, CTL_CREATE_JOB, &own);
  DENIED(alice, CTL_CREATE_JOB, &for_b, "create a job for tenant team-b");
  DENIED(dash, CTL_CREATE_JOB, &own, "create jobs (tenants and admins may)");
  DENIED(n1, CTL_CREATE_JOB, &own, "create jobs");
}

/* GetJob and IssueReadToken: a reader of the job's tenant and up; a job
 * of no tenant is an admin's alone; a missing job is the handler's
 * NOT_FOUND. */
static void test_get_job_and_read_tokens_are_the_readers(void **state) {
  (void)state;
  Zerod__V1__GetJobRequest get_a = ZEROD__V1__GET_JOB_REQUEST__INIT;
  get_a.name = "a1";
  Zerod__V1__GetJobRequest get_adm = get_a, get_missing = get_a;
  get_adm.name = "adm";
  get_missing.name = "nope";
  ALLOWED(dash, CTL_GET_JOB, &get_a);
  ALLOWED(alice, CTL_GET_JOB, &get_a);
  ALLOWED(admin, CTL_GET_JOB, &get_a);
  ALLOWED(admin, CTL_GET_JOB, &get_adm);
  ALLOWED(bob, CTL_GET_JOB, &get_missing);
  DENIED(bob, CTL_GET_JOB, &get_a, "read job 'a1'");
  DENIED(alice, CTL_GET_JOB, &get_adm, "read job 'adm'");
  DENIED(n1, CTL_GET_JOB, &get_a, "read job 'a1'");

  Zerod__V1__IssueReadTokenRequest token = ZEROD__V1__ISSUE_READ_TOKEN_REQUEST__INIT;
  token.job = "a1";
  ALLOWED(dash, CTL_ISSUE_READ_TOKEN, &token);
  ALLOWED(admin, CTL_ISSUE_READ_TOKEN, &token);
  DENIED(bob, CTL_ISSUE_READ_TOKEN, &token, "get read tokens of job 'a1'");
  DENIED(n1, CTL_ISSUE_READ_TOKEN, &token, "get read tokens of job 'a1'");
}

/* DeleteJob: the job's tenant or an admin; a reader may not. */
static void test_delete_job_is_the_owners(void **state) {
  (void)state;
  Zerod__V1__DeleteJobRequest del = ZEROD__V1__DELETE_JOB_REQUEST__INIT;
  del.name = "a1";
  ALLOWED(alice, CTL_DELETE_JOB, &del);
  ALLOWED(admin, CTL_DELETE_JOB, &del);
  DENIED(dash, CTL_DELETE_JOB, &del, "delete job 'a1'");
  DENIED(bob, CTL_DELETE_JOB, &del, "delete job 'a1'");
  DENIED(n1, CTL_DELETE_JOB, &del, "delete job 'a1'");
}

/* FreezeJob: the job's tenant or an admin, as DeleteJob; a tenant the
 * base is shared with may not freeze it over (change its sharing). */
static void test_freeze_job_is_the_owners(void **state) {
  (void)state;
  Zerod__V1__FreezeJobRequest freeze = ZEROD__V1__FREEZE_JOB_REQUEST__INIT;
  freeze.name = "a1";
  ALLOWED(alice, CTL_FREEZE_JOB, &freeze);
  ALLOWED(admin, CTL_FREEZE_JOB, &freeze);
  DENIED(dash, CTL_FREEZE_JOB, &freeze, "freeze job 'a1'");
  DENIED(bob, CTL_FREEZE_JOB, &freeze, "freeze job 'a1'");
  DENIED(n1, CTL_FREEZE_JOB, &freeze, "freeze job 'a1'");
  assert_string_equal(audit, "job=a1");
  freeze.name = "base";
  ALLOWED(alice, CTL_FREEZE_JOB, &freeze);
  DENIED(carol, CTL_FREEZE_JOB, &freeze, "freeze job 'base'");
  Zerod__V1__DeleteJobRequest del = ZEROD__V1__DELETE_JOB_REQUEST__INIT;
  del.name = "base";
  DENIED(carol, CTL_DELETE_JOB, &del, "delete job 'base'");
  /* A missing job is the handler's NOT_FOUND. */
  freeze.name = "nope";
  ALLOWED(bob, CTL_FREEZE_JOB, &freeze);
}

/* A base is read, and built on, by its own tenant, the tenants it is
 * shared with (every tenant when public) and admins; not by a reader of
 * another tenant's, nor a node. Sharing means nothing on a job that is
 * not frozen. */
static void test_a_base_is_read_and_built_on_by_whom_it_is_shared_with(void **state) {
  (void)state;
  const Zerod__V1__Job *base = &jobs[3].msg;
  Zerod__V1__GetJobRequest get = ZEROD__V1__GET_JOB_REQUEST__INIT;
  get.name = "base";
  ALLOWED(alice, CTL_GET_JOB, &get);
  ALLOWED(carol, CTL_GET_JOB, &get);
  DENIED(bob, CTL_GET_JOB, &get, "read job 'base'");
  assert_true(authz_may_build_on(&alice, "team-a", base));
  assert_true(authz_may_build_on(&carol, "team-c", base));
  assert_true(authz_may_build_on(&admin, "team-b", base));
  assert_true(authz_may_build_on(&admin, "", base));
  assert_false(authz_may_build_on(&bob, "team-b", base));
  assert_false(authz_may_build_on(&dash, "team-a", base)); /* readers create no jobs */
  assert_false(authz_may_build_on(&n1, "", base));

  jobs[3].msg.public_ = 1;
  ALLOWED(bob, CTL_GET_JOB, &get);
  assert_true(authz_may_build_on(&bob, "team-b", base));
  jobs[3].msg.public_ = 0;

  /* The same sharing on a job that is not a base grants nothing. */
  jobs[3].msg.frozen = 0;
  DENIED(carol, CTL_GET_JOB, &get, "read job 'base'");
  assert_false(authz_may_build_on(&carol, "team-c", base));
  jobs[3].msg.frozen = 1;
}

/* ------------------------------------------------------------------------ */
/* Rendezvous                                                               */
/* ------------------------------------------------------------------------ */

/* Put, Get, Delete: a node the job is placed on, or an admin; a missing
 * job is the handler's NOT_FOUND. */
static void test_rendezvous_is_the_jobs_nodes(void **state) {
  (void)state;
  Zerod__V1__PutRequest put = ZEROD__V1__PUT_REQUEST__INIT;
  put.job = "a1";
  put.key = "k";
  Zerod__V1__GetRequest get = ZEROD__V1__GET_REQUEST__INIT;
  get.job = "a1";
  get.key = "k";
  Zerod__V1__DeleteRequest del = ZEROD__V1__DELETE_REQUEST__INIT;
  del.job = "a1";
  del.key = "k";
  Zerod__V1__PutRequest put_missing = put;
  put_missing.job = "nope";
  const char *paths[] = {CTL_PUT, CTL_GET, CTL_DELETE};
  const void *msgs[] = {&put, &get, &del};
  for (size_t i = 0; i < 3; i++) {
    allowed_in(&env, &n1, paths[i], msgs[i], __LINE__);
    allowed_in(&env, &any_node, paths[i], msgs[i], __LINE__);
    allowed_in(&env, &admin, paths[i], msgs[i], __LINE__);
    denied_in(&env, &n3, paths[i], msgs[i], "use the rendezvous of job 'a1'", __LINE__);
    denied_in(&env, &alice, paths[i], msgs[i], "only its nodes may", __LINE__);
  }
  ALLOWED(n3, CTL_PUT, &put_missing);
  DENIED(alice, CTL_PUT, &put_missing, "use the rendezvous of job 'nope'");
}

/* ------------------------------------------------------------------------ */
/* Checkpoints                                                              */
/* ------------------------------------------------------------------------ */

/* Save: the job's tenant or an admin, or a node the job is placed on (its
 * workers asked). */
static void test_save_is_the_owners_or_its_nodes(void **state) {
  (void)state;
  Zerod__V1__SaveRequest save = ZEROD__V1__SAVE_REQUEST__INIT;
  save.job = "a1";
  ALLOWED(alice, CTL_SAVE, &save);
  ALLOWED(admin, CTL_SAVE, &save);
  ALLOWED(n1, CTL_SAVE, &save);
  ALLOWED(any_node, CTL_SAVE, &save);
  DENIED(dash, CTL_SAVE, &save, "save job 'a1'");
  DENIED(bob, CTL_SAVE, &save, "save job 'a1'");
  DENIED(n3, CTL_SAVE, &save, "save job 'a1'");
}

/* Delete checkpoint: the job's tenant or an admin; not its nodes. */
static void test_delete_checkpoint_is_the_owners(void **state) {
  (void)state;
  Zerod__V1__DeleteCheckpointRequest del = ZEROD__V1__DELETE_CHECKPOINT_REQUEST__INIT;
  del.job = "a1";
  del.name = "c";
  ALLOWED(alice, CTL_DELETE_CHECKPOINT, &del);
  ALLOWED(admin, CTL_DELETE_CHECKPOINT, &del);
  DENIED(dash, CTL_DELETE_CHECKPOINT, &del, "delete checkpoints of job 'a1'");
  DENIED(bob, CTL_DELETE_CHECKPOINT, &del, "delete checkpoints of job 'a1'");
  DENIED(n1, CTL_DELETE_CHECKPOINT, &del, "delete checkpoints of job 'a1'");
}

/* Restore: the job's tenant or an admin, who must also be able to read
 * the source (another job's checkpoint: that job; a path: admins only);
 * a node the job is placed on, from the job's own checkpoints only. */
static void test_restore_needs_the_job_and_its_source(void **state) {
  (void)state;
  Zerod__V1__RestoreRequest own = ZEROD__V1__RESTORE_REQUEST__INIT;
  own.job = "a1";
  own.checkpoint = "c";
  Zerod__V1__RestoreRequest other_b = own, deleted = own, path = own;
  other_b.checkpoint = "b1/c";
  deleted.checkpoint = "gone@7/c";
  path.checkpoint = "/exports/team-a/c";
  ALLOWED(alice, CTL_RESTORE, &own);
  ALLOWED(admin, CTL_RESTORE, &own);
  ALLOWED(n1, CTL_RESTORE, &own);
  ALLOWED(admin, CTL_RESTORE, &other_b);
  ALLOWED(admin, CTL_RESTORE, &path);
  /* A deleted job's checkpoints are checked by their owner as they are
   * read (ckpt_owner.c), not here. */
  ALLOWED(alice, CTL_RESTORE, &deleted);
  DENIED(dash, CTL_RESTORE, &own, "restore job 'a1'");
  DENIED(bob, CTL_RESTORE, &own, "restore job 'a1'");
  DENIED(n3, CTL_RESTORE, &own, "restore job 'a1'");
  DENIED(alice, CTL_RESTORE, &other_b, "read the checkpoints of job 'b1'");
  DENIED(alice, CTL_RESTORE, &path, "restore or export from a path (an admin may)");
  DENIED(n1, CTL_RESTORE, &other_b, "read the checkpoints of job 'b1'");
  DENIED(n1, CTL_RESTORE, &deleted, "read the checkpoints of job 'gone@7'");
}

/* Export: a reader of the job's tenant and up, with Restore's rule for
 * the source; a tenant's or a reader's file goes in <export
 * root>/<tenant>/ (relative: in the first root), an admin's anywhere. */
static void test_export_needs_a_reader_and_the_tenants_directory(void **state) {
  (void)state;
  Zerod__V1__ExportRequest ex = ZEROD__V1__EXPORT_REQUEST__INIT;
  ex.job = "a1";
  ex.path = "team-a/model.safetensors";
  Zerod__V1__ExportRequest absolute = ex, second_root = ex, other_dir = ex, stored = ex,
                           other_job = ex, from_path = ex;
  absolute.path = "/exports/team-a/model.safetensors";
  second_root.path = "/mnt/more/team-a/model.safetensors";
  other_dir.path = "team-b/model.safetensors";
  stored.checkpoint = "c";
  other_job.checkpoint = "b1/c";
  from_path.checkpoint = "/exports/team-a/c";
  ALLOWED(dash, CTL_EXPORT, &ex);
  ALLOWED(alice, CTL_EXPORT, &absolute);
  ALLOWED(alice, CTL_EXPORT, &second_root);
  ALLOWED(dash, CTL_EXPORT, &stored);
  ALLOWED(admin, CTL_EXPORT, &other_dir);
  ALLOWED(admin, CTL_EXPORT, &from_path);
  DENIED(bob, CTL_EXPORT, &ex, "export job 'a1'");
  DENIED(n1, CTL_EXPORT, &ex, "export job 'a1'");
  DENIED(dash, CTL_EXPORT, &other_dir, "a tenant's exports go in /exports/team-a/");
  DENIED(alice, CTL_EXPORT, &other_job, "read the checkpoints of job 'b1'");
  DENIED(alice, CTL_EXPORT, &from_path, "restore or export from a path");
  /* Without export roots a tenant cannot export at all. */
  denied_in(&no_roots, &alice, CTL_EXPORT, &ex, "no --export-root for tenants", __LINE__);
  allowed_in(&no_roots, &admin, CTL_EXPORT, &ex, __LINE__);
  /* Another job's checkpoint is exported by its own rule: the job named
   * plays no part then. */
  Zerod__V1__ExportRequest of_b = other_job;
  of_b.job = "b1";
  of_b.path = "team-b/x.safetensors";
  of_b.checkpoint = "b1/c";
  ALLOWED(bob, CTL_EXPORT, &of_b);
}

/* List checkpoints: of a job, a reader of it; of every job, anyone (each
 * sees those it may read). */
static void test_list_checkpoints_is_a_readers(void **state) {
  (void)state;
  Zerod__V1__ListCheckpointsRequest one = ZEROD__V1__LIST_CHECKPOINTS_REQUEST__INIT;
  one.job = "a1";
  Zerod__V1__ListCheckpointsRequest all = ZEROD__V1__LIST_CHECKPOINTS_REQUEST__INIT;
  ALLOWED(dash, CTL_LIST_CHECKPOINTS, &one);
  ALLOWED(admin, CTL_LIST_CHECKPOINTS, &one);
  ALLOWED(bob, CTL_LIST_CHECKPOINTS, &all);
  ALLOWED(n3, CTL_LIST_CHECKPOINTS, &all);
  DENIED(bob, CTL_LIST_CHECKPOINTS, &one, "list checkpoints of job 'a1'");
  DENIED(n1, CTL_LIST_CHECKPOINTS, &one, "list checkpoints of job 'a1'");
}

/* ------------------------------------------------------------------------ */
/* Across the table                                                         */
/* ------------------------------------------------------------------------ */

/* A trusted caller passes every rule, even a node's own; the policy does
 * not even look a job up for it. */
static void test_trusted_callers_pass_every_rule(void **state) {
  (void)state;
  Zerod__V1__WatchRequest watch = ZEROD__V1__WATCH_REQUEST__INIT;
  watch.node = "n9";
  Zerod__V1__DeleteJobRequest del = ZEROD__V1__DELETE_JOB_REQUEST__INIT;
  del.name = "b1";
  Zerod__V1__RestoreRequest restore = ZEROD__V1__RESTORE_REQUEST__INIT;
  restore.job = "b1";
  restore.checkpoint = "/anywhere/c";
  lookups = 0;
  ALLOWED(trusted, CTL_WATCH, &watch);
  ALLOWED(trusted, CTL_DELETE_JOB, &del);
  ALLOWED(trusted, CTL_RESTORE, &restore);
  assert_int_equal(lookups, 0);
}

/* A method without a rule is refused, whoever calls (but the trusted). */
static void test_a_method_without_a_rule_is_refused(void **state) {
  (void)state;
  Zerod__V1__GetViewRequest any = ZEROD__V1__GET_VIEW_REQUEST__INIT;
  assert_int_equal(check_in(&env, &admin, "/zerod.v1.Jobs/Rename", &any), RPC_PERMISSION_DENIED);
  assert_string_equal(err, "no authorization rule for /zerod.v1.Jobs/Rename");
  assert_int_equal(check_in(&env, &trusted, "/zerod.v1.Jobs/Rename", &any), 0);
}

/* The audit line names what a changing call is about, whatever the
 * verdict; calls that change nothing (and the nodes' rendezvous traffic)
 * get none. */
static void test_audit_names_what_a_call_changes(void **state) {
  (void)state;
  Zerod__V1__CreateJobRequest create = ZEROD__V1__CREATE_JOB_REQUEST__INIT;
  create.name = "new";
  check_in(&env, &alice, CTL_CREATE_JOB, &create);
  assert_string_equal(audit, "job=new tenant=team-a");
  Zerod__V1__ExportRequest ex = ZEROD__V1__EXPORT_REQUEST__INIT;
  ex.job = "a1";
  ex.checkpoint = "c";
  ex.path = "team-b/my file.safetensors";
  assert_int_equal(check_in(&env, &alice, CTL_EXPORT, &ex), RPC_PERMISSION_DENIED);
  assert_string_equal(audit, "job=a1 source=c path=\"team-b/my file.safetensors\"");
  Zerod__V1__PutRequest put = ZEROD__V1__PUT_REQUEST__INIT;
  put.job = "a1";
  put.key = "k";
  check_in(&env, &n1, CTL_PUT, &put);
  assert_string_equal(audit, "");
  Zerod__V1__GetJobRequest get = ZEROD__V1__GET_JOB_REQUEST__INIT;
  get.name = "a1";
  check_in(&env, &dash, CTL_GET_JOB, &get);
  assert_string_equal(audit, "");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_join_heartbeat_watch_are_the_nodes_own),
      cmocka_unit_test(test_leave_is_the_nodes_or_an_admins),
      cmocka_unit_test(test_get_view_and_list_jobs_are_anyones),
      cmocka_unit_test(test_create_job_is_a_tenants_or_an_admins),
      cmocka_unit_test(test_get_job_and_read_tokens_are_the_readers),
      cmocka_unit_test(test_delete_job_is_the_owners),
      cmocka_unit_test(test_freeze_job_is_the_owners),
      cmocka_unit_test(test_a_base_is_read_and_built_on_by_whom_it_is_shared_with),
      cmocka_unit_test(test_rendezvous_is_the_jobs_nodes),
      cmocka_unit_test(test_save_is_the_owners_or_its_nodes),
      cmocka_unit_test(test_delete_checkpoint_is_the_owners),
      cmocka_unit_test(test_restore_needs_the_job_and_its_source),
      cmocka_unit_test(test_export_needs_a_reader_and_the_tenants_directory),
      cmocka_unit_test(test_list_checkpoints_is_a_readers),
      cmocka_unit_test(test_trusted_callers_pass_every_rule),
      cmocka_unit_test(test_a_method_without_a_rule_is_refused),
      cmocka_unit_test(test_audit_names_what_a_call_changes),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}
