/* Cluster membership and leases (coord_impl.h): the Cluster service (Join,
 * Heartbeat, Leave, GetView, Watch) and the lease sweep.
 *
 * A node joins with a fresh session and lease, renews the lease with each
 * Heartbeat (which also carries its reports on its jobs), and leaves with
 * Leave or by missing its lease; each change bumps the view epoch and is
 * pushed to every Watch stream (coord_registry.c). A node that leaves
 * takes its ranks with it: every job placed there degrades until the node
 * is back and has rebuilt them. Loop thread only. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_impl.h"
#include "ctl_decode.h"
#include "log.h"

static void on_watch_cancelled(rpc_call *call, void *arg) {
  member *m = arg;
  if (m->watch == call) {
    m->watch = NULL;
    m->watch_dirty = 0;
  }
  rpc_call_finish(call, RPC_CANCELLED, "watch cancelled", NULL, 0);
}

/* Finds the member that node and session name, or answers NOT_FOUND. */
static member *member_or_not_found(coord *c, rpc_call *call, const char *node, uint64_t session) {
  member *m = coord__find_member(c, node);
  if (m == NULL || m->session != session) {
    coord__finish_error(
        call, RPC_NOT_FOUND,
        "node '%s' is not a member (lease expired or coordinator restarted); join again", node);
    return NULL;
  }
  return m;
}

/* Removes the member at index i: the view changes, its watch ends, and the
 * jobs placed on it degrade. why: "lease expired" or "left". */
static void member_remove(coord *c, size_t i, const char *why) {
  member *m = c->members[i];
  memmove(&c->members[i], &c->members[i + 1], (c->nmembers - i - 1) * sizeof *c->members);
  c->nmembers--;
  c->epoch++;
  char reason[160];
  snprintf(reason, sizeof reason, "node '%s' left the cluster (%s)", m->info->name, why);
  LOG_INFOF("node left", "node=%s session=%" PRIu64 " why=\"%s\" epoch=%" PRIu64, m->info->name,
            m->session, why, c->epoch);
  char message[200];
  snprintf(message, sizeof message, "%s", reason);
  coord__watch_end(m, RPC_NOT_FOUND, message);
  /* The node's ranks are gone with it: every job placed there must rebuild
   * its communicator, under a new rendezvous epoch so that stale keys of
   * the old world are never read by the new one. */
  for (size_t k = 0; k < c->njobs; k++) {
    cjob *j = c->jobs[k];
    long at = j->deleting ? -1 : coord__placement_of(j, m->info->name);
    if (at < 0)
      continue;
    if (!j->marks[at].departed)
      j->step_at_loss = j->step;
    j->epoch++;
    if (c->hooks.node_lost(c, j, (size_t)at, reason))
      continue;
    j->marks[at].departed = 1;
    snprintf(j->marks[at].reason, sizeof j->marks[at].reason, "%s", reason);
  }
  char name[CTL_NAME_MAX_BYTES + 1];
  snprintf(name, sizeof name, "%s", m->info->name);
  coord__member_free(m);
  coord__reconcile(c, name);
  coord__mark_all_watches(c);
}

/* Adds node as a member with a fresh session and lease. Returns 0 with the
 * member in *out, or an RPC status with the reason in err. */
static int join_member(coord *c, const Zerod__V1__NodeInfo *node, const member **out, char *err,
                       size_t err_bytes) {
  long at = coord__member_index(c, node->name);
  uint64_t now = uv_now(c->loop);
  if (at >= 0) {
    const member *old = c->members[at];
    snprintf(err, err_bytes,
             "node '%s' is already a member (session %" PRIu64 ", lease expires in %" PRIu64 " ms)",
             node->name, old->session,
             old->lease_deadline_ms > now ? old->lease_deadline_ms - now : 0);
    return RPC_ALREADY_EXISTS;
  }
  if (c->nmembers >= COORD_MAX_MEMBERS) {
    snprintf(err, err_bytes, "the cluster has %d members (at most %d)", (int)c->nmembers,
             COORD_MAX_MEMBERS);
    return RPC_RESOURCE_EXHAUSTED;
  }
  size_t info_bytes = zerod__v1__node_info__get_packed_size(node);
  if (info_bytes > COORD_MAX_NODE_INFO) {
    snprintf(err, err_bytes, "node info is %zu bytes (at most %u)", info_bytes,
             COORD_MAX_NODE_INFO);
    return RPC_INVALID_ARGUMENT;
  }
  member **grown = realloc(c->members, (c->nmembers + 1) * sizeof *c->members);
  if (grown != NULL)
    c->members = grown;
  member *m = calloc(1, sizeof *m);
  if (grown == NULL || m == NULL || (m->info = coord__message_copy(&node->base)) == NULL ||
      coord__random_bytes(&m->session, sizeof m->session) != 0) {
    coord__member_free(m);
    snprintf(err, err_bytes, "coordinator out of memory or randomness");
    return RPC_RESOURCE_EXHAUSTED;
  }
  if (m->session == 0)
    m->session = 1; /* 0 is what a request without a session carries */
  m->joined_unix_ms = coord__unix_ms();
  m->lease_deadline_ms = now + (uint64_t)c->options.lease_ttl_ms;
  at = -at - 1;
  memmove(&c->members[at + 1], &c->members[at], (c->nmembers - (size_t)at) * sizeof *c->members);
  c->members[at] = m;
  c->nmembers++;
  c->epoch++;
  char address[600];
  LOG_INFOF("node joined", "node=%s session=%" PRIu64 " address=%s ranks=%u epoch=%" PRIu64,
            node->name, m->session, log_quote(node->address, address, sizeof address), node->ranks,
            c->epoch);
  coord__reconcile(c, node->name);
  coord__mark_all_watches(c);
  *out = m;
  return 0;
}

static void on_join(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__JoinRequest *req = coord__begin(c, call, CTL_JOIN, request, request_bytes);
  if (req == NULL)
    return;
  const member *m;
  char err[512];
  int status = join_member(c, req->node, &m, err, sizeof err);
  view_msg v;
  if (status != 0) {
    coord__finish_error(call, status, "%s", err);
  } else if (coord__view_build(c, &v) != 0) {
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
  } else {
    Zerod__V1__JoinReply reply = ZEROD__V1__JOIN_REPLY__INIT;
    reply.session = m->session;
    reply.lease_ttl_ms = (uint32_t)c->options.lease_ttl_ms;
    reply.view = &v.view;
    coord__finish_message(call, &reply.base);
    coord__view_free(&v);
  }
  ctl_free(&req->base);
}

int coord_join_local(coord *c, const Zerod__V1__NodeInfo *node, uint64_t *session_out,
                     int *lease_ttl_ms_out, char *err, size_t err_bytes) {
  const member *m;
  int status = join_member(c, node, &m, err, err_bytes);
  if (status == 0) {
    *session_out = m->session;
    *lease_ttl_ms_out = c->options.lease_ttl_ms;
  }
  return status;
}

/* The report's copy of what the job's ranks on the node are doing. */
static int copy_activity(job_report *r, const Zerod__V1__JobStatus *s) {
  if (s->n_ranks == 0)
    return 0;
  r->ranks = calloc(s->n_ranks, sizeof *r->ranks);
  if (r->ranks == NULL)
    return -ENOMEM;
  for (size_t k = 0; k < s->n_ranks; k++) {
    const Zerod__V1__RankActivity *a = s->ranks[k];
    rank_activity *to = &r->ranks[k];
    to->rank = a->rank;
    to->collectives = a->collectives;
    to->waiting_ms = a->waiting_ms;
    to->last_op_ms = a->last_op_ms;
    snprintf(to->collective, sizeof to->collective, "%s", a->collective);
    snprintf(to->last_op, sizeof to->last_op, "%s", a->last_op);
  }
  r->nranks = s->n_ranks;
  return 0;
}

/* The node's in-memory copies of the job (checked: ctl_decode.c). */
static void copy_replicas(job_report *r, const Zerod__V1__JobStatus *s) {
  r->nreplicas = 0;
  for (size_t i = 0; i < s->n_replicas && i < CTL_MAX_REPLICA_SETS; i++) {
    const Zerod__V1__ReplicaSet *set = s->replicas[i];
    r->replicas[i].step = set->step;
    r->replicas[i].world_size = set->world_size;
    r->replicas[i].layout = set->layout;
    r->replicas[i].ranks = 0;
    for (size_t k = 0; k < set->n_ranks; k++)
      r->replicas[i].ranks |= 1ull << set->ranks[k];
    r->nreplicas++;
  }
}

static void on_heartbeat(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__HeartbeatRequest *req = coord__begin(c, call, CTL_HEARTBEAT, request, request_bytes);
  if (req == NULL)
    return;
  member *m = member_or_not_found(c, call, req->node, req->session);
  if (m == NULL)
    goto out;
  job_report *reports = calloc(req->n_jobs ? req->n_jobs : 1, sizeof *reports);
  int ok = reports != NULL;
  for (size_t i = 0; ok && i < req->n_jobs; i++) {
    reports[i].job = strdup(req->jobs[i]->job);
    reports[i].error = strdup(req->jobs[i]->error);
    reports[i].ready = req->jobs[i]->ready;
    reports[i].sessions = req->jobs[i]->sessions;
    reports[i].step = req->jobs[i]->step;
    reports[i].units = req->jobs[i]->units;
    reports[i].epoch = req->jobs[i]->epoch;
    copy_replicas(&reports[i], req->jobs[i]);
    ok = ok && copy_activity(&reports[i], req->jobs[i]) == 0;
    ok = ok && reports[i].job != NULL && reports[i].error != NULL;
  }
  if (!ok) {
    coord__free_reports(reports, req->n_jobs);
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
    goto out;
  }
  qsort(reports, req->n_jobs, sizeof *reports, coord__compare_reports);
  coord__free_reports(m->reports, m->nreports);
  m->reports = reports;
  m->nreports = req->n_jobs;
  m->lease_deadline_ms = uv_now(c->loop) + (uint64_t)c->options.lease_ttl_ms;
  coord__reconcile(c, m->info->name);
  coord__ckpt_heartbeat(c, m, req);
  for (size_t i = 0; i < req->n_jobs; i++) {
    cjob *j = coord__find_job(c, req->jobs[i]->job);
    if (j != NULL)
      coord__job_stalls(c, j);
  }

  Zerod__V1__HeartbeatReply reply = ZEROD__V1__HEARTBEAT_REPLY__INIT;
  reply.lease_ttl_ms = (uint32_t)c->options.lease_ttl_ms;
  reply.epoch = c->epoch;
  if (req->draining)
    coord__drain_node(c, m, &reply);
  coord__finish_message(call, &reply.base);
out:
  ctl_free(&req->base);
}

static void on_leave(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__LeaveRequest *req = coord__begin(c, call, CTL_LEAVE, request, request_bytes);
  if (req == NULL)
    return;
  if (member_or_not_found(c, call, req->node, req->session) != NULL) {
    member_remove(c, (size_t)coord__member_index(c, req->node), "left");
    Zerod__V1__LeaveReply reply = ZEROD__V1__LEAVE_REPLY__INIT;
    coord__finish_message(call, &reply.base);
  }
  ctl_free(&req->base);
}

static void on_get_view(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  coord_caller who;
  ProtobufCMessage *req = coord__begin_as(c, call, CTL_GET_VIEW, request, request_bytes, &who);
  if (req == NULL)
    return;
  view_msg v;
  if (coord__view_build(c, &v) == 0) {
    /* A session is what Heartbeat, Leave and Watch take: only nodes and
     * admins see them. */
    if (who.role != AUTH_ADMIN && who.role != AUTH_NODE) {
      for (size_t i = 0; i < v.view.n_members; i++)
        v.members[i].session = 0;
    }
    coord__finish_message(call, &v.view.base);
    coord__view_free(&v);
  } else {
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
  }
  ctl_free(req);
}

static void on_watch(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__WatchRequest *req = coord__begin(c, call, CTL_WATCH, request, request_bytes);
  if (req == NULL)
    return;
  member *m = member_or_not_found(c, call, req->node, req->session);
  if (m != NULL) {
    /* One stream per member: a node that re-opens its watch (after a
     * network blip it may not have noticed) replaces the old one. */
    coord__watch_end(m, RPC_ABORTED, "replaced by a newer Watch of the same node");
    m->watch = call;
    rpc_call_set_cancel(call, on_watch_cancelled, m);
    LOG_DEBUGF("watch opened", "node=%s session=%" PRIu64, m->info->name, m->session);
    coord__watch_send(c, m);
  }
  ctl_free(&req->base);
}

void coord__cluster_sweep(coord *c) {
  uint64_t now = uv_now(c->loop);
  size_t i = 0;
  while (i < c->nmembers) {
    if (c->members[i]->lease_deadline_ms <= now)
      member_remove(c, i, "lease expired");
    else
      i++;
  }
}

int coord__cluster_register(coord *c, rpc_server *server) {
  static const coord_method methods[] = {
      {CTL_JOIN, RPC_UNARY, on_join},           {CTL_HEARTBEAT, RPC_UNARY, on_heartbeat},
      {CTL_LEAVE, RPC_UNARY, on_leave},         {CTL_GET_VIEW, RPC_UNARY, on_get_view},
      {CTL_WATCH, RPC_SERVER_STREAM, on_watch},
  };
  return coord__add_methods(c, server, methods, sizeof methods / sizeof methods[0]);
}
