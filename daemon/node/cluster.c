/* cluster - a node daemon's membership in a cluster (see cluster.h). */
#include "cluster.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "activity.h"
#include "ckpt_node.h"
#include "coord.h"
#include "ctl_decode.h"
#include "daemon.h"
#include "jobs.h"
#include "digest.h"
#include "health.h"
#include "log.h"
#include "replica.h"
#include "rpc.h"
#include "store.h"
#include "zerod/v1/control.pb-c.h"

#define NODE_CALL_MS        5000 /* deadline of Join and Heartbeat */
#define NODE_LEAVE_MS       1000 /* Leave at shutdown: best effort */
#define NODE_BACKOFF_MIN_MS 100  /* join retry: doubles up to the max */
#define NODE_BACKOFF_MAX_MS 3000
#define NODE_WATCH_RETRY_MS 500 /* a watch that ended while still a member */
#define NODE_SETTLE_POLL_MS 10  /* while a job's ranks are being built */
#define NODE_DRAIN_POLL_MS  100 /* heartbeats while the node drains */

typedef enum node_state { NODE_JOINING, NODE_MEMBER, NODE_STOPPED } node_state;

typedef struct cluster_agent {
  zdaemon *d;
  rpc_channel *channel;
  store *rendezvous;
  node_state state;
  uint64_t session;
  int lease_ttl_ms;
  int backoff_ms;
  int last_status; /* of the last failed call, to log changes only */

  uv_timer_t timer; /* join retry, heartbeats */
  uv_timer_t watch_timer;
  /* Polls, while some hosted job is neither ready nor failed, for one that
   * becomes so, and then sends a heartbeat at once: the coordinator learns
   * that a job is ready without waiting for the next lease renewal. */
  uv_timer_t settle_timer;
  size_t reported_settled; /* jobs_settled() when the last heartbeat was built */

  /* The one blocking call in flight on the threadpool. */
  uv_work_t work;
  int work_busy;
  int report_again; /* cluster_report while a call was in flight */
  const char *method;
  void (*done)(struct cluster_agent *a);
  uint8_t *request, *reply;
  size_t request_bytes, reply_bytes;
  rpc_result result;

  /* The Watch stream, read by a thread of its own (rpc_follow); NULL when
   * not watching. */
  rpc_follower *watch;
  uint64_t watch_session;

  /* The drain before a stop (cluster_drain): heartbeats say draining until
   * the coordinator answers that no save of this node's jobs is left (or
   * cannot be reached), then drain_done. */
  int draining, drain_done;
} cluster_agent;

static void schedule(cluster_agent *a, int delay_ms);
static void start_watch(cluster_agent *a);
static void on_watch_retry(uv_timer_t *t);

/* ------------------------------------------------------------------------ */
/* Blocking calls on the threadpool                                         */
/* ------------------------------------------------------------------------ */

static void work_run(uv_work_t *w) {
  cluster_agent *a = w->data;
  a->reply = NULL;
  a->reply_bytes = 0;
  rpc_unary(a->channel, a->method, a->request, a->request_bytes, NODE_CALL_MS, &a->reply,
            &a->reply_bytes, &a->result);
}

static void on_join_done(cluster_agent *a);
static void on_heartbeat_done(cluster_agent *a);

static void work_done(uv_work_t *w, int status) {
  cluster_agent *a = w->data;
  a->work_busy = 0;
  free(a->request);
  a->request = NULL;
  if (status == UV_ECANCELED)
    a->result.status = RPC_CANCELLED;
  if (a->state != NODE_STOPPED)
    a->done(a);
  free(a->reply);
  a->reply = NULL;
}

/* Runs method on the threadpool; done(a) follows on the loop with the
 * result in a->result and a->reply. */
static int start_call(cluster_agent *a, const char *method, const ProtobufCMessage *req,
                      void (*done)(cluster_agent *a)) {
  size_t len = protobuf_c_message_get_packed_size(req);
  a->request = malloc(len ? len : 1);
  if (a->request == NULL)
    return -ENOMEM;
  protobuf_c_message_pack(req, a->request);
  a->request_bytes = len;
  a->method = method;
  a->done = done;
  a->work.data = a;
  int rc = uv_queue_work(a->d->loop, &a->work, work_run, work_done);
  if (rc != 0) {
    free(a->request);
    a->request = NULL;
    return rc;
  }
  a->work_busy = 1;
  return 0;
}

/* Logs a failed call once per change of its status. */
static void log_failure(cluster_agent *a, const char *what) {
  if (a->result.status == a->last_status)
    return;
  a->last_status = a->result.status;
  char msg[600];
  LOG_WARNF("coordinator call failed", "call=%s coordinator=%s status=%s error=%s", what,
            a->d->options.coordinator, rpc_status_name(a->result.status),
            log_quote(a->result.message, msg, sizeof msg));
}

/* ------------------------------------------------------------------------ */
/* Join                                                                     */
/* ------------------------------------------------------------------------ */

static void node_info(zdaemon *d, Zerod__V1__NodeInfo *info) {
  zerod__v1__node_info__init(info);
  info->name = d->options.node_name;
  info->address = d->options.comm_host;
  info->ranks = (uint32_t)d->options.max_ranks; /* a node's: its --ranks */
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  info->memory_bytes = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
  info->version = "0.1.0";
  info->replica_port = (uint32_t)replica_port(d);
}

static void send_join(cluster_agent *a) {
  Zerod__V1__NodeInfo info;
  node_info(a->d, &info);
  Zerod__V1__JoinRequest req = ZEROD__V1__JOIN_REQUEST__INIT;
  req.node = &info;
  if (start_call(a, "/zerod.v1.Cluster/Join", &req.base, on_join_done) != 0)
    schedule(a, a->backoff_ms);
}

static void on_join_done(cluster_agent *a) {
  Zerod__V1__JoinReply *r = NULL;
  if (a->result.status == RPC_OK) {
    char why[320];
    ProtobufCMessage *decoded = NULL;
    if (ctl_decode_message(&zerod__v1__join_reply__descriptor, a->reply, a->reply_bytes, &decoded,
                           why, sizeof why) == 0)
      r = (Zerod__V1__JoinReply *)decoded;
    else
      snprintf(a->result.message, sizeof a->result.message, "unreadable JoinReply: %s", why);
  }
  if (r == NULL) {
    log_failure(a, "join");
    a->backoff_ms =
        a->backoff_ms * 2 > NODE_BACKOFF_MAX_MS ? NODE_BACKOFF_MAX_MS : a->backoff_ms * 2;
    schedule(a, a->backoff_ms);
    return;
  }
  a->session = r->session;
  a->lease_ttl_ms = r->lease_ttl_ms > 0 ? (int)r->lease_ttl_ms : 10000;
  a->state = NODE_MEMBER;
  health_set(a->d->health, 1);
  a->backoff_ms = NODE_BACKOFF_MIN_MS;
  a->last_status = RPC_OK;
  LOG_INFOF("joined the cluster",
            "node=%s coordinator=%s session=%llu epoch=%llu members=%zu "
            "lease_ttl_ms=%d",
            a->d->options.node_name, a->d->options.coordinator, (unsigned long long)a->session,
            r->view != NULL ? (unsigned long long)r->view->epoch : 0ULL,
            r->view != NULL ? r->view->n_members : 0, a->lease_ttl_ms);
  ctl_free(&r->base);
  start_watch(a);
  schedule(a, a->lease_ttl_ms / 3);
}

/* ------------------------------------------------------------------------ */
/* Heartbeat                                                                */
/* ------------------------------------------------------------------------ */

static int job_ready(job *j) {
  for (int r = 0; r < j->nranks; r++)
    if (atomic_load(&j->ranks[r].comm_ready) != j->generation + 1)
      return 0;
  return 1;
}

/* Hosted jobs that are ready or failed, and (in *njobs) all hosted jobs. */
static size_t jobs_settled(zdaemon *d, size_t *njobs) {
  size_t settled = 0, n = 0;
  for (job *j = d->jobs; j != NULL; j = j->next, n++)
    settled += job_failed(j, j->generation, NULL, 0) || job_ready(j);
  if (njobs != NULL)
    *njobs = n;
  return settled;
}

static void on_settle_poll(uv_timer_t *t) {
  cluster_agent *a = t->data;
  size_t njobs, settled = jobs_settled(a->d, &njobs);
  if (settled != a->reported_settled && !a->work_busy && a->state == NODE_MEMBER)
    schedule(a, 0);
  if (settled == njobs)
    uv_timer_stop(t);
}

static void send_heartbeat(cluster_agent *a) {
  zdaemon *d = a->d;
  size_t njobs = 0;
  for (job *j = d->jobs; j != NULL; j = j->next)
    njobs += !j->deleted;
  Zerod__V1__JobStatus *statuses = calloc(njobs ? njobs : 1, sizeof *statuses);
  Zerod__V1__JobStatus **ptrs = calloc(njobs ? njobs : 1, sizeof *ptrs);
  char(*errors)[512] = calloc(njobs ? njobs : 1, sizeof *errors);
  void **ckpt_reports = calloc(njobs ? njobs : 1, sizeof *ckpt_reports);
  void **activities = calloc(njobs ? njobs : 1, sizeof *activities);
  void **replicas = calloc(njobs ? njobs : 1, sizeof *replicas);
  if (statuses == NULL || ptrs == NULL || errors == NULL || ckpt_reports == NULL ||
      activities == NULL || replicas == NULL) {
    free(statuses);
    free(ptrs);
    free(errors);
    free(ckpt_reports);
    free(activities);
    free(replicas);
    schedule(a, a->lease_ttl_ms / 3);
    return;
  }
  size_t i = 0;
  for (job *j = d->jobs; j != NULL; j = j->next) {
    if (j->deleted)
      continue;
    Zerod__V1__JobStatus *st = &statuses[i];
    zerod__v1__job_status__init(st);
    st->job = j->name;
    if (job_failed(j, j->generation, errors[i], sizeof errors[i])) {
      ctl_text_sanitize(errors[i], CTL_ERROR_MAX_BYTES);
      st->error = errors[i];
    }
    st->ready = job_ready(j) && st->error[0] == '\0';
    /* Completed steps, as control.proto says, of the node's first rank
     * (the ranks are at most one step apart); the version would count
     * loads and restores as steps. */
    st->step = atomic_load(&j->ranks[0].step);
    pthread_mutex_lock(&j->mutex);
    st->units = j->nunits;
    pthread_mutex_unlock(&j->mutex);
    st->epoch = j->built_epoch;
    st->sessions = (uint32_t)j->sessions;
    ckpt_node_reports(j, st, &ckpt_reports[i]);
    activity_reports(j, st, &activities[i]);
    if (j->redundancy_every != 0)
      replicas[i] = replica_report(d, j->id, st);
    ptrs[i++] = st;
  }
  a->reported_settled = jobs_settled(d, NULL);
  Zerod__V1__HeartbeatRequest req = ZEROD__V1__HEARTBEAT_REQUEST__INIT;
  req.node = d->options.node_name;
  req.session = a->session;
  req.n_jobs = njobs;
  req.jobs = ptrs;
  req.draining = a->draining;
  if (start_call(a, "/zerod.v1.Cluster/Heartbeat", &req.base, on_heartbeat_done) != 0)
    schedule(a, a->lease_ttl_ms / 3);
  for (size_t k = 0; k < i; k++) {
    ckpt_node_reports_free(ckpt_reports[k]);
    activity_reports_free(activities[k]);
    replica_report_free(replicas[k]);
  }
  free(ckpt_reports);
  free(activities);
  free(replicas);
  free(statuses);
  free(ptrs);
  free(errors);
}

static void stop_watch(cluster_agent *a);

/* A heartbeat of a draining node came back: whether its drain is over (the
 * coordinator saw it and no save is left, or cannot say). */
static int drain_over(cluster_agent *a) {
  if (a->result.status != RPC_OK) {
    LOG_WARNF("drain: the coordinator is unreachable; stopping without its saves", "coordinator=%s",
              a->d->options.coordinator);
    return 1;
  }
  ProtobufCMessage *decoded = NULL;
  char why[256];
  if (ctl_decode_message(&zerod__v1__heartbeat_reply__descriptor, a->reply, a->reply_bytes,
                         &decoded, why, sizeof why) != 0)
    return 1;
  const Zerod__V1__HeartbeatReply *r = (const Zerod__V1__HeartbeatReply *)decoded;
  int over = r->drain_seen && r->drain_saves == 0;
  if (!over)
    LOG_DEBUGF("drain: saves in flight", "saves=%u", r->drain_saves);
  ctl_free(decoded);
  return over;
}

static void on_heartbeat_done(cluster_agent *a) {
  if (a->draining && !a->drain_done) {
    a->drain_done = drain_over(a);
    if (!a->drain_done)
      schedule(a, NODE_DRAIN_POLL_MS);
    return;
  }
  if (a->result.status == RPC_NOT_FOUND) {
    char msg[600];
    LOG_WARNF("lease lost; joining again", "node=%s error=%s", a->d->options.node_name,
              log_quote(a->result.message, msg, sizeof msg));
    stop_watch(a);
    a->state = NODE_JOINING;
    health_set(a->d->health, 0);
    a->last_status = RPC_OK;
    schedule(a, 0);
    return;
  }
  if (a->result.status != RPC_OK)
    log_failure(a, "heartbeat");
  else if (a->last_status != RPC_OK) {
    LOG_INFOF("coordinator reachable again", "coordinator=%s", a->d->options.coordinator);
    a->last_status = RPC_OK;
  }
  int again = a->report_again && a->result.status == RPC_OK;
  a->report_again = 0;
  schedule(a, again ? 0 : a->lease_ttl_ms / 3);
}

void cluster_job_added(zdaemon *d) {
  cluster_agent *a = d->cluster;
  if (a != NULL && a->state != NODE_STOPPED)
    uv_timer_start(&a->settle_timer, on_settle_poll, NODE_SETTLE_POLL_MS, NODE_SETTLE_POLL_MS);
}

int cluster_drain(zdaemon *d) {
  cluster_agent *a = d->cluster;
  if (a == NULL || a->state != NODE_MEMBER)
    return 0;
  a->draining = 1;
  cluster_report(d);
  return 1;
}

int cluster_drained(const zdaemon *d) {
  const cluster_agent *a = d->cluster;
  return a == NULL || a->drain_done;
}

void cluster_report(zdaemon *d) {
  cluster_agent *a = d->cluster;
  if (a == NULL || a->state != NODE_MEMBER)
    return;
  if (a->work_busy)
    a->report_again = 1; /* the heartbeat in flight may predate the news */
  else
    schedule(a, 0);
}

static void on_timer(uv_timer_t *t) {
  cluster_agent *a = t->data;
  if (a->work_busy || a->state == NODE_STOPPED)
    return;
  if (a->state == NODE_JOINING)
    send_join(a);
  else
    send_heartbeat(a);
}

static void schedule(cluster_agent *a, int delay_ms) {
  if (a->state != NODE_STOPPED)
    uv_timer_start(&a->timer, on_timer, (uint64_t)(delay_ms > 0 ? delay_ms : 0), 0);
}

/* ------------------------------------------------------------------------ */
/* Watch                                                                    */
/* ------------------------------------------------------------------------ */

static void on_watch_event(void *ctx, const uint8_t *bytes, size_t len);
static void on_watch_end(void *ctx, const rpc_result *result);

static void start_watch(cluster_agent *a) {
  if (a->watch != NULL || a->state != NODE_MEMBER)
    return;
  Zerod__V1__WatchRequest req = ZEROD__V1__WATCH_REQUEST__INIT;
  req.node = a->d->options.node_name;
  req.session = a->session;
  size_t len = protobuf_c_message_get_packed_size(&req.base);
  uint8_t buf[512];
  if (len > sizeof buf)
    return;
  protobuf_c_message_pack(&req.base, buf);
  if (rpc_follow(a->d->loop, a->channel, "/zerod.v1.Cluster/Watch", buf, len, "zd-watch",
                 on_watch_event, on_watch_end, a, &a->watch) != 0) {
    a->watch = NULL;
    uv_timer_start(&a->watch_timer, on_watch_retry, NODE_WATCH_RETRY_MS, 0);
    return;
  }
  a->watch_session = a->session;
}

/* Cancels the stream; its thread ends at once. */
static void stop_watch(cluster_agent *a) {
  rpc_follow_stop(a->watch);
  a->watch = NULL;
}

static void on_watch_retry(uv_timer_t *t) {
  start_watch(t->data);
}

/* A job the coordinator froze (FreezeJob) is a base from now on: the
 * executors refuse whatever would write its state (docs/bases.md). A
 * freeze is never undone. */
static void follow_frozen(job *j, const Zerod__V1__Job *pj) {
  if (!pj->frozen || atomic_load(&j->frozen))
    return;
  atomic_store(&j->frozen, 1);
  LOG_INFOF("job frozen: it is a base now", "job=%s", j->name);
  /* Behind whatever its ranks have queued: the moments and accumulators
   * go (rank/shard.c); a save or restore ordered from now on comes after. */
  for (int r = 0; r < j->nranks; r++) {
    exec_op *op = exec_op_new(OP_FREEZE, &j->ranks[r]);
    if (op != NULL)
      exec_submit(op);
  }
}

/* In-memory redundancy (docs/redundancy.md): how often j's ranks copy
 * their state, and to which node. Before the first step: the job was just
 * built, or had its copies on already. */
static void follow_redundancy(job *j, const Zerod__V1__Job *pj, const Zerod__V1__Assignment *as) {
  const Zerod__V1__CheckpointPolicy *p = pj->checkpoint_policy;
  int on = p != NULL && p->redundancy != 0 && as->replica_key.len == REPLICA_KEY_BYTES &&
           ((zdaemon *)j->owner)->replicas != NULL;
  if (on && j->redundancy_every == 0)
    j->redundancy_every = p->redundancy_every_steps != 0 ? p->redundancy_every_steps : 1;
  ckpt_node_set_buddy(j, on ? as->replica_buddy : "");
}

/* The coordinator failed j's stalled operation (docs/daemon.md, "Stalls"):
 * every rank here fails it with who waits for whom, at once. */
static void follow_abort(job *j, const Zerod__V1__Assignment *as) {
  if (as->abort_id <= j->abort_seen)
    return;
  j->abort_seen = as->abort_id;
  const char *why = as->abort_reason != NULL ? as->abort_reason : "";
  char msg[600];
  LOG_WARNF("stalled operation failed by the coordinator", "job=%s stalled=%s", j->name,
            log_quote(why, msg, sizeof msg));
  job_fail(j, j->generation, "job '%s' stalled: %s (failed by the coordinator's stall timeout)",
           j->name, why);
  for (int r = 0; r < j->nranks; r++)
    exec_rank_abort_comm(&j->ranks[r]);
}

/* Whether j, a job across nodes, is to be rebuilt here: the coordinator
 * says its nodes are all back after one left, and j was built before
 * (its communicators' generation is an older epoch). */
static int rebuilt_here(const job *j, const Zerod__V1__Assignment *as) {
  return as->rebuild && !j->deleted && job_spans_nodes(j) &&
         j->generation != (unsigned)as->job->epoch;
}

/* Lets go of j for its rebuild: as a deleted job, failed for its workers
 * (who attach again to the new one once it is recovered), gone once the
 * last of them has detached. */
static void drop_for_rebuild(zdaemon *d, job *j) {
  LOG_INFOF("job rebuilt: its ranks here start afresh", "job=%s", j->name);
  ckpt_node_orders(j, NULL);
  job_fail(j, j->generation,
           "job '%s' is rebuilt on its nodes (a node was lost, the job moved, or its ranks "
           "failed): attach again once it is recovered",
           j->name);
  for (int r = 0; r < j->nranks; r++) /* a collective with the lost node ends now */
    exec_rank_abort_comm(&j->ranks[r]);
  j->deleted = 1;
  if (j->sessions == 0)
    jobs_retire(d, j);
}

/* Makes the local jobs follow the coordinator's assignments. */
static void reconcile(cluster_agent *a, const Zerod__V1__WatchEvent *ev) {
  zdaemon *d = a->d;
  for (size_t i = 0; i < ev->n_assignments; i++) {
    const Zerod__V1__Assignment *as = ev->assignments[i];
    const Zerod__V1__Job *pj = as->job;
    if (pj == NULL || pj->name == NULL)
      continue;
    /* Before the restore below may need it. */
    replica_set_key(d, pj->id, as->replica_key.data, as->replica_key.len);
    job *j = jobs_find(d, pj->name);
    if (j != NULL && rebuilt_here(j, as)) {
      drop_for_rebuild(d, j);
      j = NULL;
    }
    if (j != NULL && j->deleted && j->id == pj->id && as->rebuild)
      j = NULL; /* dropped for the rebuild, its workers not all gone yet */
    if (j == NULL) {
      /* A job that is not (or no longer) healthy is not built here: its
       * other ranks are gone or failed, so a rendezvous could only time
       * out. One whose ranks are all here is, degraded or not: this node
       * left (a restart, an expired lease) and the coordinator waits for it
       * to build the ranks again; nobody else has to be there. */
      int all_here = as->first_rank == 0 && as->ranks == pj->world_size;
      if (pj->state != ZEROD__V1__JOB_STATE__JOB_STATE_CREATING &&
          pj->state != ZEROD__V1__JOB_STATE__JOB_STATE_READY &&
          !(pj->state == ZEROD__V1__JOB_STATE__JOB_STATE_DEGRADED && (all_here || as->rebuild)))
        continue;
      job_config config;
      char err[256] = "";
      /* The token's hash; an older coordinator sends the token itself. */
      char token_sha256[DIGEST_HEX_BYTES];
      if (digest_is_hex(as->token_sha256))
        memcpy(token_sha256, as->token_sha256, sizeof token_sha256);
      else
        digest_sha256_hex(as->token, token_sha256);
      uint64_t max_live = pj->quotas != NULL && pj->quotas->max_live_bytes != 0
                              ? pj->quotas->max_live_bytes
                              : d->options.max_live_bytes;
      int rc = job_config_from_proto(pj->config, &config, err, sizeof err);
      if (rc == 0)
        rc = job_config_finish(&config, max_live, err, sizeof err);
      if (rc == 0)
        rc = jobs_start(d, pj->name, token_sha256, &config, (int)pj->world_size, (int)as->ranks,
                        (int)as->first_rank, pj->id, (unsigned)pj->epoch, &j, err, sizeof err);
      if (rc == 0 && pj->quotas != NULL) {
        /* Before any worker can attach: this loop turn made the job. */
        j->quota_host_bytes = pj->quotas->max_host_bytes;
        j->quota_device_bytes = pj->quotas->max_device_bytes;
        j->quota_sessions = pj->quotas->max_sessions;
      }
      if (rc == 0)
        jobs_set_read_tokens(j, as->read_token_sha256, as->n_read_token_sha256);
      if (rc == 0)
        follow_redundancy(j, pj, as);
      if (rc == 0)
        j->abort_seen = as->abort_id; /* a fresh job is in no stall */
      if (rc == 0)
        follow_frozen(j, pj);
      /* A job that existed before this node built it (after a restart of
       * the node, or of the coordinator too): its ranks here have lost
       * their state, which the coordinator may restore (ckpt_recover.c).
       * A job created since the coordinator started is never pending. */
      if (rc == 0 && as->recovery_pending) {
        j->awaiting_recovery = 1;
        LOG_INFOF("job rebuilt here after its state was lost: no worker until it is recovered",
                  "job=%s", j->name);
      }
      if (rc == 0)
        cluster_job_added(d);
      if (rc != 0) {
        char msg[300];
        LOG_ERRORF("cannot host the job's ranks", "job=%s error=%s", pj->name,
                   log_quote(err, msg, sizeof msg));
      }
      continue;
    }
    if (j->id != pj->id) {
      job_fail(j, j->generation, "job '%s' was deleted and re-created on the coordinator", j->name);
      continue;
    }
    if (jobs_set_read_tokens(j, as->read_token_sha256, as->n_read_token_sha256) != 0)
      LOG_WARNF("read tokens not updated (out of memory)", "job=%s", j->name);
    follow_frozen(j, pj);
    follow_redundancy(j, pj, as);
    follow_abort(j, as);
    if (j->awaiting_recovery && !as->recovery_pending) {
      j->awaiting_recovery = 0;
      LOG_INFOF("job recovered: workers may attach", "job=%s", j->name);
    }
    ckpt_node_orders(j, as);
    /* A job with ranks here only is degraded by nothing but this node's own
     * report of its failure, which it already knows; it resets locally, and
     * a stale event must not fail the reset generation. */
    /* (A job being rebuilt is degraded by the loss it is rebuilt from.) */
    if (pj->state == ZEROD__V1__JOB_STATE__JOB_STATE_DEGRADED && job_spans_nodes(j) &&
        !as->rebuild && !job_failed(j, j->generation, NULL, 0)) {
      char msg[600];
      LOG_WARNF("job degraded", "job=%s reason=%s", j->name,
                log_quote(pj->reason != NULL ? pj->reason : "", msg, sizeof msg));
      job_fail(j, j->generation, "job degraded: %s", pj->reason != NULL ? pj->reason : "");
      /* A rank waiting in a collective for a live peer (itself waiting for
       * the lost node) would wait out its timeout: it fails now. */
      for (int r = 0; r < j->nranks; r++)
        exec_rank_abort_comm(&j->ranks[r]);
    }
  }
  job *next;
  for (job *j = d->jobs; j != NULL; j = next) {
    next = j->next;
    int assigned = 0;
    for (size_t i = 0; i < ev->n_assignments && !assigned; i++)
      assigned =
          ev->assignments[i]->job != NULL && strcmp(ev->assignments[i]->job->name, j->name) == 0;
    if (assigned || j->deleted || j->id >= ev->next_job_id)
      continue;
    ckpt_node_orders(j, NULL); /* its checkpoint work ends */
    replica_forget(d, j->id);
    LOG_INFOF("job deleted on the coordinator", "job=%s", j->name);
    job_fail(j, j->generation, "job '%s' was deleted", j->name);
    /* Its workers get the reason; the job goes once the last one has
     * detached, and is no longer reported, so the deletion completes. */
    j->deleted = 1;
    if (j->sessions == 0) {
      jobs_retire(d, j);
      cluster_report(d); /* the coordinator hears at once that it has gone */
    }
  }
}

static void on_watch_event(void *ctx, const uint8_t *bytes, size_t len) {
  cluster_agent *a = ctx;
  /* Job names from the event become local jobs, so a name cut short at a
   * NUL byte must not be taken for another job's: the event is checked
   * like any bytes from outside (ctl_decode_message). */
  char why[320];
  ProtobufCMessage *decoded = NULL;
  if (ctl_decode_message(&zerod__v1__watch_event__descriptor, bytes, len, &decoded, why,
                         sizeof why) != 0) {
    char quoted[400];
    LOG_WARNF("unreadable watch event", "bytes=%zu error=%s", len,
              log_quote(why, quoted, sizeof quoted));
    return;
  }
  Zerod__V1__WatchEvent *ev = (Zerod__V1__WatchEvent *)decoded;
  LOG_DEBUGF("watch event", "epoch=%llu assignments=%zu",
             ev->view != NULL ? (unsigned long long)ev->view->epoch : 0ULL, ev->n_assignments);
  if (a->state == NODE_MEMBER)
    reconcile(a, ev);
  ctl_free(decoded);
}

static void on_watch_end(void *ctx, const rpc_result *result) {
  cluster_agent *a = ctx;
  a->watch = NULL; /* the follower is gone */
  /* NOT_FOUND: the lease is gone; the next heartbeat joins again and
   * starts a new watch. */
  if (a->state == NODE_MEMBER && result->status != RPC_CANCELLED &&
      result->status != RPC_NOT_FOUND) {
    char msg[600];
    LOG_WARNF("watch ended", "status=%s error=%s", rpc_status_name(result->status),
              log_quote(result->message, msg, sizeof msg));
    uv_timer_start(&a->watch_timer, on_watch_retry, NODE_WATCH_RETRY_MS, 0);
  }
}

/* ------------------------------------------------------------------------ */
/* Lifecycle                                                                */
/* ------------------------------------------------------------------------ */

int cluster_create(zdaemon *d, store *local_store, store **rendezvous, char *err,
                   size_t err_bytes) {
  cluster_agent *a = calloc(1, sizeof *a);
  if (a == NULL) {
    snprintf(err, err_bytes, "out of memory");
    return -ENOMEM;
  }
  a->d = d;
  a->backoff_ms = NODE_BACKOFF_MIN_MS;
  a->last_status = RPC_OK;
  const daemon_options *o = &d->options;
  rpc_channel_options channel = {.tls = o->use_tls ? &o->tls : NULL, .token = o->token};
  int rc = rpc_channel_create_with(o->coordinator, &channel, &a->channel, err, err_bytes);
  if (rc == 0 && local_store != NULL)
    a->rendezvous = local_store;
  else if (rc == 0)
    rc = store_grpc_create(a->channel, &a->rendezvous);
  if (rc != 0) {
    if (a->channel != NULL)
      rpc_channel_destroy(a->channel);
    free(a);
    return rc;
  }
  /* uv_timer_init only fills in the handle; it cannot fail. */
  uv_timer_init(d->loop, &a->timer);
  uv_timer_init(d->loop, &a->watch_timer);
  uv_timer_init(d->loop, &a->settle_timer);
  a->timer.data = a->watch_timer.data = a->settle_timer.data = a;
  d->cluster = a;
  d->control_channel = a->channel;
  *rendezvous = a->rendezvous;
  return 0;
}

void cluster_start(zdaemon *d) {
  cluster_agent *a = d->cluster;
  if (d->coord != NULL) {
    /* The coordinator runs in this process: join it directly, so that the
     * node is a member before the first worker attaches; the lease is then
     * renewed over gRPC like any node's. */
    Zerod__V1__NodeInfo info;
    node_info(d, &info);
    char err[512];
    int status = coord_join_local(d->coord, &info, &a->session, &a->lease_ttl_ms, err, sizeof err);
    if (status == 0) {
      a->state = NODE_MEMBER;
      health_set(d->health, 1);
      start_watch(a);
      schedule(a, a->lease_ttl_ms / 3);
      return;
    }
    LOG_WARNF("cannot join the in-process coordinator; joining over gRPC", "error=\"%s\"", err);
  }
  LOG_INFOF("joining the cluster", "node=%s coordinator=%s", d->options.node_name,
            d->options.coordinator);
  schedule(a, 0);
}

void cluster_stop(zdaemon *d) {
  cluster_agent *a = d->cluster;
  if (a == NULL || a->state == NODE_STOPPED)
    return;
  /* The in-process coordinator is stopping too; a blocking Leave from the
   * loop thread could not be answered (its handlers run on this loop). */
  int was_member = a->state == NODE_MEMBER && d->coord == NULL;
  a->state = NODE_STOPPED;
  health_set(a->d->health, 0);
  /* Ranks in a rendezvous give up rather than wait for peers that stop. */
  if (d->coord == NULL)
    store_grpc_stop(a->rendezvous);
  else
    store_mem_stop(a->rendezvous);
  stop_watch(a);
  if (was_member) {
    Zerod__V1__LeaveRequest req = ZEROD__V1__LEAVE_REQUEST__INIT;
    req.node = d->options.node_name;
    req.session = a->session;
    uint8_t buf[256];
    size_t len = protobuf_c_message_get_packed_size(&req.base);
    if (len <= sizeof buf) {
      protobuf_c_message_pack(&req.base, buf);
      uint8_t *reply = NULL;
      size_t reply_bytes = 0;
      rpc_result result;
      rpc_unary(a->channel, "/zerod.v1.Cluster/Leave", buf, len, NODE_LEAVE_MS, &reply,
                &reply_bytes, &result);
      free(reply);
      LOG_INFOF("left the cluster", "node=%s status=%s", d->options.node_name,
                rpc_status_name(result.status));
    }
  }
  uv_close((uv_handle_t *)&a->timer, NULL);
  uv_close((uv_handle_t *)&a->watch_timer, NULL);
  uv_close((uv_handle_t *)&a->settle_timer, NULL);
}

void cluster_destroy(zdaemon *d) {
  cluster_agent *a = d->cluster;
  if (a == NULL)
    return;
  a->rendezvous->ops->destroy(a->rendezvous);
  rpc_channel_destroy(a->channel);
  d->control_channel = NULL;
  free(a);
  d->cluster = NULL;
}
