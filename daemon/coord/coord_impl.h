/* coord_impl: the coordinator's internals, shared by its files. Every .c
 * of daemon/coord includes it but the modules with headers of their own
 * (auth, authz, ctl_decode, health); the checkpoint files include it
 * through their own internal header, coord_ckpt.h. The public API is
 * coord.h.
 *
 * The files work on the state below, on the loop thread, one job each.
 * From the bottom up (a file calls only files below it, never one above):
 *   coord_registry.c  lookups, views, Watch streams, derived job state
 *   coord_call.c      call plumbing: identify, decode, authorize, answer
 *   coord_metrics.c   the Prometheus figures
 *   ckpt_owner.c      who owns a checkpoint; the records of deleted jobs
 *   coord_state.c     the durable state file (coordinator.pb)
 *   ckpt_*.c          the Checkpoints service (coord_ckpt.h), whose hooks
 *                     are coord_ckpt.c; ckpt_retire.c, a deleted job's
 *                     checkpoints
 *   coord_kv.c        the rendezvous KV
 *   coord_cluster.c   membership and leases
 *   coord_bases.c     bases: FreezeJob, a job's base checked at CreateJob
 *   coord_jobs.c      jobs and quotas
 *   coord.c           the lifecycle (coord.h)
 * What the registry and the checkpoints' thread pool must have done by the
 * files above them goes through coord_hooks, set by coord_create.
 *
 * Internal functions shared between the files are named coord__*; those of
 * the Checkpoints service coord__ckpt_*. Each file's are in its section
 * below. */
#ifndef ZEROD_COORD_IMPL_H
#define ZEROD_COORD_IMPL_H

#include <stdint.h>

#include "auth.h"
#include "authz.h"
#include "coord.h"
#include "ctl_decode.h"
#include "digest.h"

/* Limits (docs/control-plane.md, "Limits"). */
#define COORD_MAX_MEMBERS      4096
#define COORD_MAX_JOBS         4096
#define COORD_MAX_WAITERS      4096
#define COORD_MAX_KV_BYTES     (64u << 20) /* keys + values + per-key overhead */
#define COORD_MAX_KV_KEYS      65536
#define COORD_KV_KEY_OVERHEAD  64
#define COORD_MAX_NODE_INFO    (16u << 10) /* a member's packed NodeInfo */
#define COORD_MAX_STATE_BYTES  (64u << 20) /* coordinator.pb */
#define COORD_STATE_FORMAT     1
#define COORD_SWEEP_MAX_MS     250
#define COORD_STALL_MS         5000 /* a rank this long in one collective is stalled */
#define COORD_REASON_BYTES     1024
#define COORD_TOKEN_HEX_DIGITS 32
#define COORD_MAX_READ_TOKENS  64 /* per job: IssueReadToken keeps the newest */

/* What a member's last heartbeat said one rank of a job is doing
 * (RankActivity). */
typedef struct rank_activity {
  uint32_t rank;
  uint64_t collectives, waiting_ms, last_op_ms;
  char collective[33], last_op[33];
} rank_activity;

/* What a member's last heartbeat said about one job. */
typedef struct job_report {
  char *job;   /* owned */
  char *error; /* owned; "" when the job is fine on the node */
  int ready;
  uint64_t step;
  uint32_t units;    /* the job's units on the node */
  uint64_t epoch;    /* the job epoch its ranks there were built at */
  uint32_t sessions; /* workers attached to it there */
  /* The in-memory copies of the job the node holds (JobStatus.replicas):
   * per step, the world that made them and a bit per rank whose file is
   * held (worlds are at most CTL_MAX_RANKS = 64 ranks). */
  struct {
    uint64_t step;
    uint32_t world_size;
    uint64_t ranks;
    int layout;
  } replicas[CTL_MAX_REPLICA_SETS];
  size_t nreplicas;
  rank_activity *ranks; /* owned: what its ranks there are doing */
  size_t nranks;
} job_report;

typedef struct member {
  Zerod__V1__NodeInfo *info; /* owned copy of the Join request's node */
  uint64_t session;
  int64_t joined_unix_ms;
  uint64_t lease_deadline_ms; /* on the loop's clock (uv_now) */
  job_report *reports;        /* owned, sorted by job name */
  size_t nreports;
  rpc_call *watch; /* the member's Watch stream, or NULL */
  int watch_dirty; /* the stream is owed a new event */
  int draining;    /* it asked for its jobs to be saved (coord_drain.c) */
} member;

typedef struct kv_entry {
  struct kv_entry *next;
  uint64_t epoch;
  char *key;      /* owned */
  uint8_t *value; /* owned; NULL when empty */
  size_t value_bytes;
} kv_entry;

/* A Get with wait=true that is waiting for its key. */
typedef struct kv_waiter {
  struct kv_waiter *next;
  struct coord *coord;
  struct cjob *job;
  rpc_call *call;
  uint64_t epoch;
  char *key; /* owned */
} kv_waiter;

/* What the coordinator remembers about one placement node of a job. */
typedef struct node_mark {
  /* The node left the cluster after the job was placed on it; the job
   * stays degraded until the node is back and reports the job ready. */
  int departed;
  char reason[256];
} node_mark;

/* Where a job's periodic checkpoints stand (soft state: after a restart
 * the schedule starts over from the step the job has when it is ready). */
typedef struct auto_ckpt {
  int armed;          /* the job has been ready since this coordinator started */
  int saved;          /* a periodic checkpoint was completed since */
  uint64_t last_step; /* the step the step interval counts from */
  uint64_t last_ms;   /* uv_now of the last periodic checkpoint, or of arming */
  uint64_t retry_ms;  /* after a failed one: no new attempt before this uv_now */
} auto_ckpt;

/* A replica server's address, "host:port" (NodeInfo.address and
 * replica_port). */
#define COORD_ADDR_BYTES        300
#define COORD_REPLICA_KEY_BYTES 32

/* A job's in-memory redundancy (ckpt_memory.c; docs/redundancy.md): its
 * replica key, and the step of its newest complete in-memory copy, from
 * its nodes' reports (0: none). Soft state: a coordinator that restarts
 * makes a new key. */
typedef struct mem_copy {
  uint8_t key[COORD_REPLICA_KEY_BYTES];
  int have_key;
  uint64_t step;
} mem_copy;

/* A job's part of the Checkpoints service's state (soft): the files of
 * the service (coord_ckpt.h) read and write it, no other. */
typedef struct ckpt_of_job {
  struct ckpt_order *order; /* the job's save or restore in flight, or NULL */
  auto_ckpt autockpt;
  /* A base's (ckpt_base.c): the name of its save that completed and is
   * not yet stored in the job ("": none), and whether a base not saved
   * for want of units was logged. */
  char base_saved[CTL_NAME_MAX_BYTES + 24];
  int base_unsaved_logged;
  /* Recovery (ckpt_recover.c): the job epoch whose loss of state is
   * settled (restored, or nothing to restore), whether the newest
   * checkpoint is being looked for, whether its restore just completed,
   * and what the last recovery did, for Job.last_recovery. */
  uint64_t recovered_epoch;
  int recovery_scanning;
  int recovery_restored;
  char last_recovery[256];
  int recovery_from_memory;  /* the recovery in flight restores the in-memory copy */
  uint64_t mem_failed_epoch; /* a restore from memory failed at this epoch: use the disk */
  mem_copy mem;              /* in-memory redundancy (ckpt_memory.c) */
} ckpt_of_job;

/* The Checkpoints service's state (soft): the files of the service
 * (coord_ckpt.h) read and write it, no other. */
typedef struct ckpt_service {
  struct ckpt_order *orders;   /* every order not yet freed, newest first */
  struct export_work *exports; /* exports of checkpoints in flight */
  /* Ids of orders and of the marks of deleted directories (coord__ckpt_init
   * seeds them). */
  uint64_t next_id;
  unsigned work; /* thread-pool requests not yet completed */
} ckpt_service;

/* A deleted job whose checkpoints are kept (ckpt_owner.c): their owner
 * and where they are. Stored in coordinator.pb (RetiredJob). */
typedef struct retired_job {
  char name[CTL_NAME_MAX_BYTES + 1];
  uint64_t id;
  char tenant[AUTH_NAME_MAX_BYTES + 1];
  int64_t deleted_unix_ms;
  /* Its directory <name> was moved to <name>@<id>; until then no job may
   * take the name (its checkpoints would mix with the new job's). */
  int moved;
} retired_job;

typedef struct cjob {
  /* Owned copy of the job as stored; its state, reason, step and epoch
   * fields are unused, the ones below are what replies carry. */
  Zerod__V1__Job *msg;
  char *token_sha256; /* owned: the owner token's SHA-256, 64 hex digits */
  /* SHA-256s of its read tokens, oldest first (NULL until the first):
   * [COORD_MAX_READ_TOKENS] strings, pointers for the messages. */
  char (*read_tokens)[DIGEST_HEX_BYTES];
  char *read_token_ptrs[COORD_MAX_READ_TOKENS];
  size_t n_read_tokens;
  node_mark *marks; /* [msg->n_placement] */
  int deleting;
  Zerod__V1__JobState state;
  char reason[COORD_REASON_BYTES];
  uint64_t step;
  uint64_t epoch;
  /* step when a node of the job last left the cluster (as the state file
   * had it, for a job loaded at start): what a recovery from a checkpoint
   * counts its lost steps from (ckpt_recover.c). */
  uint64_t step_at_loss;
  /* Ranks stalled in a collective and whom they wait for (coord_stalls.c;
   * Job.stalled), "" when none. */
  char stalled[COORD_REASON_BYTES];
  /* The stall the coordinator failed on every rank (coord_stalls.c;
   * Assignment.abort_id/abort_reason): how many so far, the last one's
   * reason, and whether the stall now reported was failed already. */
  uint64_t abort_id;
  char abort_reason[COORD_REASON_BYTES];
  int stall_aborted;
  kv_entry *kv;
  kv_waiter *waiters;
  ckpt_of_job ckpt;
  /* Since when (loop ms) no node has reported a worker attached; 0: one
   * has (coord_idle.c, --job-idle-ttl). */
  uint64_t idle_since_ms;
  int draining; /* saved before the daemon stops (coord_drain.c) */
} cjob;

/* What the registry (coord_registry.c) and the checkpoints' thread pool
 * (ckpt_pool.c) call in the files above them, set by coord_create: they
 * sit below those files and name none of them. */
typedef struct coord_hooks {
  /* Adds j's checkpoint order in flight, if any, to the Assignment a
   * node of it receives, and its in-memory redundancy's fields for
   * placement node at (buddy: a buffer of COORD_ADDR_BYTES for its
   * address, which must live as long as a) (coord__ckpt_assignment). */
  void (*assignment)(const coord *c, cjob *j, size_t at, Zerod__V1__Assignment *a, char *buddy);
  /* j's state was derived again (coord__ckpt_job_changed). */
  void (*job_changed)(coord *c, cjob *j);
  /* Placement node at of j left the cluster: whether j was re-placed on
   * the others (coord__mem_node_lost), else it waits for the node. */
  int (*node_lost)(coord *c, cjob *j, size_t at, const char *reason);
  /* j is being freed: its keys and waiting Gets go (coord__kv_job_freed). */
  void (*job_freed)(coord *c, cjob *j);
  /* Deleting jobs were forgotten: their checkpoints may move aside
   * (coord__ckpt_retire_pending). */
  void (*jobs_forgotten)(coord *c);
  /* The thread pool (ckpt_pool.c) removed the checkpoint directory path:
   * a retired job's directory may go with it (coord__ckpt_removed). */
  void (*ckpt_removed)(coord *c, const char *path);
} coord_hooks;

struct coord {
  uv_loop_t *loop;
  coord_hooks hooks;
  coord_options options;
  char state_path[PATH_MAX + 32];
  char tmp_path[PATH_MAX + 32];

  member **members; /* sorted by name */
  size_t nmembers;
  cjob **jobs; /* sorted by name; deleting jobs included */
  size_t njobs;
  uint64_t epoch; /* the view epoch */
  uint64_t next_job_id;

  size_t kv_bytes, kv_keys, nwaiters;

  ckpt_service ckpt;    /* the Checkpoints service (coord_ckpt.h) */
  retired_job *retired; /* deleted jobs with checkpoints, by id (ckpt_owner.c) */
  size_t nretired;

  /* Principals (--auth-file); NULL: none configured, every caller is
   * trusted. The server counts each one's calls (rpc.h). */
  auth_table *auth;
  struct health *health;         /* grpc.health.v1 (health.h) */
  struct coord_metrics *metrics; /* coord_metrics.c; NULL: none */

  uv_timer_t lease_timer; /* the lease sweep */
  uv_timer_t flush_timer; /* sends the dirty Watch streams their events */
  int open_handles;
  int flush_scheduled;
  int shutting_down;
};

/* ------------------------------------------------------------------------ */
/* coord_registry.c: the members and jobs                                   */
/* ------------------------------------------------------------------------ */

/* The wall clock in milliseconds since 1970. */
int64_t coord__unix_ms(void);

/* A copy of msg made by packing and unpacking it, one protobuf-c
 * allocation tree (freed with ctl_free), or NULL. */
void *coord__message_copy(const ProtobufCMessage *msg);

/* A job record for msg (taken; freed with the job) and its owner token's
 * SHA-256 (64 hex digits: the token itself is never kept), or NULL. */
cjob *coord__job_new(Zerod__V1__Job *msg, const char *token_sha256);
/* Adds a read token's hash (64 hex digits) to j, dropping the oldest when
 * it has COORD_MAX_READ_TOKENS. Returns 0 or -ENOMEM. */
int coord__job_add_read_token(cjob *j, const char *hash);

/* Fills buf[len] with random bytes. Returns 0 or a negative errno. */
int coord__random_bytes(void *buf, size_t len);

/* Lookups by name in the sorted arrays: the index of the match, or
 * -(insertion point) - 1. */
long coord__member_index(const coord *c, const char *name);
long coord__job_index(const coord *c, const char *name);
member *coord__find_member(const coord *c, const char *name);
/* The replica server of the member named node, "host:port", into out;
 * "" when it is not a member or serves none (ckpt_memory.c). */
void coord__replica_address(const coord *c, const char *node, char *out, size_t out_bytes);
/* LocateJob (coord_locate.c). */
int coord__locate_register(coord *c, rpc_server *server);
cjob *coord__find_job(const coord *c, const char *name);
/* Returns the job's placement index of node, or -1. */
long coord__placement_of(const cjob *j, const char *node);

/* Orders job reports by job name (qsort); frees reports[count]. */
int coord__compare_reports(const void *a, const void *b);
/* coord_stalls.c: j's ranks stalled in a collective for longer than
 * COORD_STALL_MS, from its nodes' last reports, into j->stalled (logged
 * when it changes). */
void coord__job_stalls(coord *c, cjob *j);

/* Appends printf output to buf (of buf_bytes) at *len, truncating. */
void coord__append(char *buf, size_t buf_bytes, size_t *len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* What m's last heartbeat said about job, or NULL. */
const job_report *coord__find_report(const member *m, const char *job);
/* What j's i-th placement node last said about it, or NULL (not a member,
 * or no report of j). */
const job_report *coord__placement_report(const coord *c, const cjob *j, size_t i);
void coord__free_reports(job_report *reports, size_t count);
/* Frees a member (its Watch stream must have ended) or a job (its keys
 * and waiting Gets end with it). NULL: nothing. */
void coord__member_free(member *m);
void coord__job_free(coord *c, cjob *j);

/* The job as replies show it: the stored message with the live fields.
 * Points into j; valid until j changes. */
void coord__job_view(const cjob *j, Zerod__V1__Job *out);

/* A View message built from the members; free with coord__view_free. */
typedef struct view_msg {
  Zerod__V1__View view;
  Zerod__V1__Member *members;
  Zerod__V1__Member **pointers;
} view_msg;
int coord__view_build(const coord *c, view_msg *v);
void coord__view_free(view_msg *v);

/* Ends m's Watch stream, if any, with status and message. */
void coord__watch_end(member *m, int status, const char *message);
/* Sends m's stream the current event. */
void coord__watch_send(coord *c, member *m);
/* Owes each live placement node of j (every member) a new WatchEvent,
 * sent on the next turn of the loop. */
void coord__mark_job_watches(coord *c, const cjob *j);
void coord__mark_all_watches(coord *c);

/* Derives j's state, reason and step from the members and their reports,
 * and tells the job's nodes if the state or reason changed. */
void coord__derive_job(coord *c, cjob *j);
/* Re-derives the jobs placed on node (every job when node is NULL), and
 * forgets the deleting ones that no live placement node reports any more. */
void coord__reconcile(coord *c, const char *node);

/* ------------------------------------------------------------------------ */
/* coord_call.c: call plumbing                                              */
/* ------------------------------------------------------------------------ */

/* Answers a unary call with msg, or with RESOURCE_EXHAUSTED when it would
 * be larger than gRPC lets either side send. */
void coord__finish_message(rpc_call *call, const ProtobufCMessage *msg);
void coord__finish_error(rpc_call *call, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Identifies the caller, decodes the request of the method at path and
 * checks that the caller may make it (authz_check, and its calls in
 * flight); on failure (or while the coordinator shuts down) answers the
 * call and returns NULL. A call that changes state is marked for the
 * audit log. coord__begin_as also gives the caller to a handler whose
 * answer depends on it (listings, CreateJob's tenant). */
void *coord__begin(coord *c, rpc_call *call, const char *path, const uint8_t *request,
                   size_t request_bytes);
void *coord__begin_as(coord *c, rpc_call *call, const char *path, const uint8_t *request,
                      size_t request_bytes, coord_caller *caller);

/* The server's identify function (rpc_server_set_identify; arg is the
 * coordinator): the principal of the call's bearer token or verified
 * client certificate, RPC_PRINCIPAL_TRUSTED on the Unix socket or without
 * principals, RPC_PRINCIPAL_ANONYMOUS for a health check without
 * credentials. Returns 0, or RPC_UNAUTHENTICATED with the reason in err
 * (no credentials for a method that needs them, an unknown token or
 * certificate, a malformed header). */
int coord__identify(void *arg, const rpc_call *call, long *principal, char *name, size_t name_bytes,
                    char *err, size_t err_bytes);

/* The caller of an admitted call, as coord__identify named it. Returns 0,
 * or RPC_UNAUTHENTICATED for a call without credentials. */
int coord__caller(const coord *c, const rpc_call *call, coord_caller *out);

/* A method the coordinator serves, for coord__add_methods. */
typedef struct coord_method {
  const char *path;
  rpc_kind kind;
  rpc_handler handler;
} coord_method;

/* Registers methods[count] on server, each called with c. Returns 0 or the
 * first error of rpc_server_add_method. */
int coord__add_methods(coord *c, rpc_server *server, const coord_method *methods, size_t count);

/* ------------------------------------------------------------------------ */
/* coord_metrics.c: the figures the other files report                      */
/* ------------------------------------------------------------------------ */

/* A checkpoint operation ("save", "restore", "export") ended
 * (coord_metrics.c); seconds and bytes count for successes only. */
void coord__metrics_checkpoint(coord *c, const char *operation, int ok, double seconds,
                               uint64_t bytes);

/* ------------------------------------------------------------------------ */
/* coord_state.c: the durable state file (coordinator.pb)                   */
/* ------------------------------------------------------------------------ */

/* Writes the jobs (without the deleting ones and skip, plus add), the
 * retired jobs and next_job_id to coordinator.pb atomically. On failure
 * the old file is intact and err holds the reason. Blocks the loop.
 * Returns 0 or a negative errno. */
int coord__state_write(coord *c, const cjob *add, const cjob *skip, uint64_t next_job_id, char *err,
                       size_t err_bytes);
/* Makes a copy of changed (j's message with some fields changed) j's
 * message and writes coordinator.pb with it; if either fails, j keeps its
 * message. 0, or RPC_RESOURCE_EXHAUSTED or RPC_UNAVAILABLE with err.
 * Blocks the loop. */
int coord__job_store(coord *c, cjob *j, const Zerod__V1__Job *changed, char *err, size_t err_bytes);
/* Writes coordinator.pb as the state is now (jobs, retired jobs, the next
 * job id). Returns 0 or a negative errno with err. Blocks the loop. */
int coord__state_save(coord *c, char *err, size_t err_bytes);
/* Loads coordinator.pb into c's jobs and retired jobs. A missing file is
 * an empty state; one that cannot be read or decoded is an error (err). */
int coord__state_load(coord *c, char *err, size_t err_bytes);

/* ------------------------------------------------------------------------ */
/* coord_cluster.c: membership and leases                                   */
/* ------------------------------------------------------------------------ */

/* The lease sweep: members whose lease passed leave the view. */
void coord__cluster_sweep(coord *c);
/* Registers the Cluster methods (Join, Heartbeat, Leave, GetView, Watch). */
int coord__cluster_register(coord *c, rpc_server *server);

/* ------------------------------------------------------------------------ */
/* coord_bases.c: bases (docs/bases.md)                                     */
/* ------------------------------------------------------------------------ */

/* A CreateJob request on a base, resolved from the base: it points into
 * the request it came from and the base's stored job, so it lives no
 * longer than either (one loop turn). */
typedef struct base_request {
  Zerod__V1__CreateJobRequest request;
  Zerod__V1__JobConfig config;
  char *node_names[CTL_MAX_RANKS];
} base_request;

/* CreateJob: when req->config names a base (config.base_job), checks it
 * (it exists, it is frozen, who may build on it for tenant; who NULL: an
 * in-process create, trusted) and resolves req against it into *out: the
 * base's nodes in its order when node_names is empty, its ranks_per_node
 * and working dtype when they are 0, then the same nodes, ranks_per_node
 * and working dtype as the base's, or INVALID_ARGUMENT naming the field.
 * *use is then &out->request, else req itself. Returns 0, or an RPC status
 * with the reason in err. */
int coord__base_resolve(const coord *c, const coord_caller *who, const char *tenant,
                        const Zerod__V1__CreateJobRequest *req, base_request *out,
                        const Zerod__V1__CreateJobRequest **use, char *err, size_t err_bytes);

/* DeleteJob: 0 when j is no base of a live job, else FAILED_PRECONDITION
 * naming them in err. */
int coord__base_deletable(const coord *c, const cjob *j, char *err, size_t err_bytes);

/* Deletes j (DeleteJob, an idle job's expiry): its state written, its
 * checkpoints retired, its nodes told; `why` ("deleted", "expired: ...")
 * goes into its reason. 0 (also for a job being deleted already), or an
 * RPC status with err. */
int coord__delete_job(coord *c, cjob *j, const char *why, char *err, size_t err_bytes);

/* A heartbeat of m with draining set (coord_drain.c): the first starts a
 * save of every job on m that holds state; every one answers how many are
 * still in flight. */
void coord__drain_node(coord *c, member *m, Zerod__V1__HeartbeatReply *reply);

/* --job-idle-ttl: deletes j once none of its nodes has reported a worker
 * attached for that long (coord_idle.c). From the periodic tick. */
void coord__job_idle_tick(coord *c, cjob *j, uint64_t now_ms);

/* The job as replies show it (coord__job_view), with a base's count of
 * live jobs on it. */
void coord__base_view(const coord *c, const cjob *j, Zerod__V1__Job *out);

/* Registers FreezeJob. */
int coord__bases_register(coord *c, rpc_server *server);

/* ------------------------------------------------------------------------ */
/* coord_jobs.c: jobs and quotas                                            */
/* ------------------------------------------------------------------------ */

/* Registers the Jobs methods (CreateJob, GetJob, ListJobs, DeleteJob,
 * IssueReadToken). */
int coord__jobs_register(coord *c, rpc_server *server);

/* ------------------------------------------------------------------------ */
/* coord_kv.c: the rendezvous KV                                            */
/* ------------------------------------------------------------------------ */

/* Frees j's keys. */
void coord__kv_clear(coord *c, cjob *j);
/* Ends every waiting Get of j with status and message. */
void coord__kv_waiters_end(cjob *j, int status, const char *message);
/* Both, for a job being freed: its Gets end with NOT_FOUND (a hook). */
void coord__kv_job_freed(coord *c, cjob *j);
/* Registers the Rendezvous methods (Put, Get, Delete). */
int coord__kv_register(coord *c, rpc_server *server);

/* ------------------------------------------------------------------------ */
/* coord_ckpt.c: the Checkpoints service's hooks                            */
/* ------------------------------------------------------------------------ */

/* At coord_create: checks the checkpoint directory, removes what a crash
 * left in it (unfinished saves and deletes) and seeds the order ids.
 * Returns 0 or a negative errno with a message in err. */
int coord__ckpt_init(coord *c, char *err, size_t err_bytes);

/* Registers the Checkpoints methods. */
int coord__ckpt_register(coord *c, rpc_server *server);

/* Adds the job's order in flight, if any, to the Assignment a node of it
 * receives. What it adds lives in the order: pack a before anything
 * changes. */
void coord__ckpt_assignment(const coord *c, cjob *j, size_t at, Zerod__V1__Assignment *a,
                            char *buddy);
/* ckpt_memory.c (coord_ckpt.h): a job with in-memory copies is re-placed
 * on the nodes left when one of its nodes leaves. */
int coord__mem_node_lost(coord *c, cjob *j, size_t at, const char *reason);

/* A heartbeat of m was recorded: takes its shard reports (JobStatus.saves
 * and .restores) and moves the orders they concern along. Call after the
 * jobs were re-derived from the heartbeat. */
void coord__ckpt_heartbeat(coord *c, const member *m, const Zerod__V1__HeartbeatRequest *req);

/* j's state was derived again: an order of a job that is no longer ready
 * fails. */
void coord__ckpt_job_changed(coord *c, cjob *j);

/* j is being deleted: its order fails (NOT_FOUND). */
void coord__ckpt_job_deleted(coord *c, cjob *j);

/* From the lease sweep's timer: deadlines of orders, periodic checkpoints. */
void coord__ckpt_tick(coord *c);

/* coord_shutdown: every order in flight fails with UNAVAILABLE. */
void coord__ckpt_shutdown(coord *c);

/* coord_destroy: frees what is left (nothing, once the loop has ended). */
void coord__ckpt_destroy(coord *c);

/* For ckpt_retire.c, from ckpt_order.c: whether a save, restore or export
 * in flight reads or writes below the directory path (a retired job's
 * directory cannot move then). */
int coord__ckpt_dir_busy(const coord *c, const char *path);

/* For ckpt_retire.c, from ckpt_pool.c: removes path recursively on the
 * thread pool (why: for the log). */
void coord__ckpt_remove_tree(coord *c, const char *path, const char *why);

/* ------------------------------------------------------------------------ */
/* ckpt_owner.c: who owns a checkpoint; the records of deleted jobs         */
/* ------------------------------------------------------------------------ */

/* Who may reach which checkpoint, as a copy that any thread may read (a
 * List's scan, an Export's or a Restore's checks run on the thread pool):
 * the caller, the job a node's Restore acts for, and the owner tenant of
 * every job id the coordinator knows, live or deleted. */
typedef struct ckpt_owner {
  uint64_t job_id;
  char tenant[AUTH_NAME_MAX_BYTES + 1];
} ckpt_owner;

typedef struct ckpt_access {
  coord_caller who;
  uint64_t for_job_id; /* the job a Restore is for (0: none) */
  char for_tenant[AUTH_NAME_MAX_BYTES + 1];
  ckpt_owner *owners; /* by job id */
  size_t nowners;
} ckpt_access;

/* Fills a (for_job: the job being restored, or NULL). Returns 0 or
 * -ENOMEM. */
int coord__ckpt_access(const coord *c, const coord_caller *who, const cjob *for_job,
                       ckpt_access *a);
void coord__ckpt_access_free(ckpt_access *a);

/* The tenant that owns a checkpoint whose manifest names job_id and
 * manifest_tenant: the tenant of the job of that id if the coordinator
 * knows it (live or deleted), else the manifest's ("": an admin's). */
const char *coord__ckpt_owner(const ckpt_access *a, uint64_t job_id, const char *manifest_tenant);

typedef enum ckpt_want { CKPT_READ, CKPT_DELETE } ckpt_want;

/* Whether a's caller may read (List, Export, Restore from) or delete the
 * checkpoint. Returns 0; RPC_NOT_FOUND when it may not even read it (its
 * existence is not disclosed); RPC_PERMISSION_DENIED when it may read but
 * not delete it. Any thread. */
int coord__ckpt_allowed(const ckpt_access *a, uint64_t job_id, const char *manifest_tenant,
                        ckpt_want want);

/* Delete checkpoint: whether access may delete the checkpoint at path, by
 * its manifest's owner (read in line: one small file). A directory whose
 * manifest does not decode has no known owner: an admin's to remove.
 * Returns 0, RPC_NOT_FOUND or RPC_PERMISSION_DENIED (coord__ckpt_allowed). */
int coord__ckpt_may_delete(const ckpt_access *access, const char *path);

/* Whether checkpoint name of j's directory was saved by j, by its
 * manifest's job id (a directory not moved aside may hold an earlier
 * job's of the name): periodic retention drops j's own only. */
int coord__ckpt_saved_by(const coord *c, const cjob *j, const char *name);

/* DeleteJob: records j as retired at now (its checkpoints, if any, are
 * kept) before the state is written. Returns 0 or -ENOMEM;
 * coord__ckpt_unretire undoes it when the write fails. */
int coord__ckpt_retire(coord *c, const cjob *j, int64_t now_unix_ms);
void coord__ckpt_unretire(coord *c, uint64_t id);

/* The record of retired job id, or NULL; dropping one (r from find). */
retired_job *coord__retired_find(coord *c, uint64_t id);
void coord__retired_drop(coord *c, retired_job *r);
/* r's directory: <checkpoint-dir>/<name>, or when moved,
 * <checkpoint-dir>/<name>@<id> (it always fits: coord__ckpt_init keeps the
 * checkpoint directory under PATH_MAX - 512 bytes). */
void coord__retired_dir(const coord *c, const retired_job *r, int moved, char out[PATH_MAX]);

/* Loading and storing the records (coordinator.pb). */
int coord__ckpt_retired_load(coord *c, const Zerod__V1__CoordinatorState *state, char *err,
                             size_t err_bytes);
void coord__ckpt_retired_free(coord *c);

/* ------------------------------------------------------------------------ */
/* ckpt_retire.c: what becomes of a deleted job's checkpoints              */
/* ------------------------------------------------------------------------ */

/* Moves the directories of retired jobs that no job and no operation
 * holds any more to <name>@<id>, and forgets retired jobs that left no
 * checkpoint; writes the state if anything changed. */
void coord__ckpt_retire_pending(coord *c);

/* CreateJob: 0 when name is free of a retired job's directory still to be
 * moved, else UNAVAILABLE with why. */
int coord__ckpt_name_free(coord *c, const char *name, char *err, size_t err_bytes);

/* A checkpoint directory was removed (path: what was removed): if it
 * emptied a retired job's directory, that goes and the job is forgotten. */
void coord__ckpt_removed(coord *c, const char *path);

/* A retired job's directory emptied (its last checkpoint deleted), or
 * removed by retention: forgets it. */
void coord__ckpt_retired_gone(coord *c, uint64_t id);

/* From the tick: removes the checkpoints of jobs deleted longer ago than
 * --retain-deleted-checkpoints. */
void coord__ckpt_retention(coord *c, int64_t now_unix_ms);

#endif /* ZEROD_COORD_IMPL_H */
