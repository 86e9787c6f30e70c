/* Jobs (coord_impl.h): the Jobs service (CreateJob, GetJob, ListJobs,
 * DeleteJob, IssueReadToken; FreezeJob is coord_bases.c's) and the tenants' quotas a new job is
 * admitted against (auth.h).
 *
 * A job is created placed (on the nodes named, or the first members that
 * can host its ranks), stored durably (coord_state.c) before the reply,
 * and then derived like every job (coord_registry.c) as its nodes report.
 * A deleted job leaves the assignments at once and is forgotten once no
 * node reports it; its checkpoints outlive it (ckpt_owner.c). Loop thread
 * only. */
#include "config.h"
#include "coord_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl_decode.h"
#include "digest.h"
#include "log.h"

/* A new token: COORD_TOKEN_HEX_DIGITS random hex digits into out
 * (COORD_TOKEN_HEX_DIGITS + 1 bytes). Returns 0 or a negative errno
 * (errno set). */
static int random_token(char *out) {
  uint8_t raw[COORD_TOKEN_HEX_DIGITS / 2];
  int rc = coord__random_bytes(raw, sizeof raw);
  if (rc != 0)
    return rc;
  for (size_t i = 0; i < sizeof raw; i++)
    snprintf(out + 2 * i, 3, "%02x", raw[i]);
  return 0;
}

/* Fills an effective config (torch.optim's defaults for zero fields: the
 * node's job_config_finish itself, model/config.c) so that GetJob shows
 * what will run. in has been validated by ctl_check_job_config. */
static void effective_config(const Zerod__V1__JobConfig *in, job_config_msg *out) {
  /* max_live_bytes stays 0 when it is: each node then uses its own
   * default. */
  job_config c;
  char err[256];
  if (job_config_from_proto(in, &c, err, sizeof err) != 0 ||
      job_config_finish(&c, 0, err, sizeof err) != 0) {
    /* Not reached: ctl_check_job_config made the same two calls. */
    job_config_from_proto(NULL, &c, err, sizeof err);
    job_config_finish(&c, 0, err, sizeof err);
  }
  job_config_to_proto(&c, out);
}

/* Picks the job's nodes into chosen[nodes] (names owned by the members),
 * or writes why not to err and returns RPC_FAILED_PRECONDITION. */
static int place_job(coord *c, const Zerod__V1__CreateJobRequest *req, const char **chosen,
                     char *err, size_t err_bytes) {
  if (req->n_node_names != 0) {
    for (size_t i = 0; i < req->n_node_names; i++) {
      const member *m = coord__find_member(c, req->node_names[i]);
      if (m == NULL) {
        snprintf(err, err_bytes, "node '%s' is not a member", req->node_names[i]);
        return RPC_FAILED_PRECONDITION;
      }
      if (m->info->ranks < req->ranks_per_node) {
        snprintf(err, err_bytes, "node '%s' can host %u ranks; the job needs %u per node",
                 m->info->name, m->info->ranks, req->ranks_per_node);
        return RPC_FAILED_PRECONDITION;
      }
      chosen[i] = m->info->name;
    }
    return 0;
  }
  size_t found = 0;
  for (size_t i = 0; i < c->nmembers && found < req->nodes; i++)
    if (c->members[i]->info->ranks >= req->ranks_per_node)
      chosen[found++] = c->members[i]->info->name;
  if (found == req->nodes)
    return 0;
  size_t able = 0;
  for (size_t i = 0; i < c->nmembers; i++)
    able += c->members[i]->info->ranks >= req->ranks_per_node;
  if (able == c->nmembers)
    snprintf(err, err_bytes, "job needs %u nodes that can host %u ranks each; %zu are members",
             req->nodes, req->ranks_per_node, c->nmembers);
  else
    snprintf(err, err_bytes,
             "job needs %u nodes that can host %u ranks each; %zu of the %zu members can",
             req->nodes, req->ranks_per_node, able, c->nmembers);
  return RPC_FAILED_PRECONDITION;
}

/* What a job asks of its tenant's quotas: its per-rank (per-node for
 * sessions) quota times its ranks (nodes). live-bytes falls back to the
 * config's max_live_bytes. */
static uint64_t job_quota_use(auth_quota_kind kind, const Zerod__V1__Quotas *q,
                              const Zerod__V1__JobConfig *config, uint32_t nodes,
                              uint32_t ranks_per_node) {
  uint64_t world = (uint64_t)nodes * ranks_per_node;
  switch (kind) {
  case AUTH_QUOTA_JOBS:
    return 1;
  case AUTH_QUOTA_SESSIONS:
    return q != NULL ? (uint64_t)q->max_sessions * nodes : 0;
  case AUTH_QUOTA_HOST_BYTES:
    return q != NULL ? q->max_host_bytes * world : 0;
  case AUTH_QUOTA_DEVICE_BYTES:
    return q != NULL ? q->max_device_bytes * world : 0;
  case AUTH_QUOTA_LIVE_BYTES: {
    uint64_t live = q != NULL ? q->max_live_bytes : 0;
    if (live == 0 && config != NULL)
      live = config->max_live_bytes;
    return live * world;
  }
  default:
    return 0;
  }
}

/* The per-job quota a tenant's quota of kind needs set, as zerodctl
 * spells it. */
static const char *const quota_flags[AUTH_NQUOTAS] = {
    NULL, "max_sessions (--max-sessions)", "max_host_bytes (--max-host-bytes)",
    "max_device_bytes (--max-device-bytes)", "max_live_bytes (--max-live-bytes)"};

/* Admits a job of tenant against the tenant's quotas (auth.h): each
 * limit must hold with the job's share added. Returns 0, or
 * RESOURCE_EXHAUSTED naming the quota, or INVALID_ARGUMENT when the
 * tenant's limit needs a per-job quota the request leaves unset (a job
 * without it could use any amount). */
static int tenant_admit(const coord *c, const char *tenant, const Zerod__V1__CreateJobRequest *req,
                        char *err, size_t err_bytes) {
  if (c->auth == NULL || tenant[0] == '\0')
    return 0;
  const auth_quota *q = auth_quota_of(c->auth, tenant);
  if (q == NULL)
    return 0;
  for (int k = 0; k < AUTH_NQUOTAS; k++) {
    if (!(q->limited & (1u << k)))
      continue;
    uint64_t want = job_quota_use((auth_quota_kind)k, req->quotas, req->config, req->nodes,
                                  req->ranks_per_node);
    if (want == 0 && k != AUTH_QUOTA_JOBS) {
      snprintf(err, err_bytes, "tenant %s has a %s quota: the job must set quotas.%s", tenant,
               auth_quota_name((auth_quota_kind)k), quota_flags[k]);
      return RPC_INVALID_ARGUMENT;
    }
    uint64_t used = 0;
    for (size_t i = 0; i < c->njobs; i++) {
      const cjob *j = c->jobs[i];
      if (j->deleting || strcmp(j->msg->tenant, tenant) != 0)
        continue;
      used += job_quota_use((auth_quota_kind)k, j->msg->quotas, j->msg->config, j->msg->nodes,
                            j->msg->ranks_per_node);
    }
    if (used + want > q->limit[k]) {
      snprintf(err, err_bytes,
               "tenant %s's %s quota is %" PRIu64 "; its jobs use %" PRIu64
               " and this one asks %" PRIu64,
               tenant, auth_quota_name((auth_quota_kind)k), q->limit[k], used, want);
      return RPC_RESOURCE_EXHAUSTED;
    }
  }
  return 0;
}

/* Creates the job asked describes (decoded and validated), on its base
 * if it names one (coord__base_resolve: who NULL for an in-process
 * create), placed by place_job. An empty token is replaced by a random one
 * unless token_as_given (an in-process create, whose workers attached
 * without one). Returns 0 with the job in *out, or an RPC status with the
 * reason in err and nothing changed. */
static int create_job(coord *c, const Zerod__V1__CreateJobRequest *asked, const char *tenant,
                      const coord_caller *who, int token_as_given, const cjob **out,
                      char *token_out, char *err, size_t err_bytes) {
  long at = coord__job_index(c, asked->name);
  if (at >= 0) {
    snprintf(err, err_bytes, "job '%s' %s", asked->name,
             c->jobs[at]->deleting ? "is still being deleted" : "already exists");
    return RPC_ALREADY_EXISTS;
  }
  if (c->njobs >= COORD_MAX_JOBS) {
    snprintf(err, err_bytes, "the coordinator has %zu jobs (at most %d)", c->njobs, COORD_MAX_JOBS);
    return RPC_RESOURCE_EXHAUSTED;
  }
  base_request on_base;
  const Zerod__V1__CreateJobRequest *req;
  int status = coord__base_resolve(c, who, tenant, asked, &on_base, &req, err, err_bytes);
  if (status == 0)
    status = coord__ckpt_name_free(c, req->name, err, err_bytes);
  if (status != 0)
    return status;
  status = tenant_admit(c, tenant, req, err, err_bytes);
  if (status != 0)
    return status;
  const Zerod__V1__CheckpointPolicy *policy = req->checkpoint_policy;
  if (policy != NULL && (policy->redundancy > 1 || (policy->redundancy != 0 && req->nodes < 2))) {
    snprintf(err, err_bytes,
             policy->redundancy > 1
                 ? "redundancy must be 0 or 1 (one copy in another node's memory)"
                 : "redundancy needs a job on 2 or more nodes (its copies live on another node)");
    return RPC_INVALID_ARGUMENT;
  }
  const char *chosen[CTL_MAX_RANKS];
  status = place_job(c, req, chosen, err, err_bytes);
  if (status != 0)
    return status;

  char token[CTL_TOKEN_MAX_BYTES + 1];
  if (req->token[0] != '\0' || token_as_given) {
    snprintf(token, sizeof token, "%s", req->token);
  } else {
    if (random_token(token) != 0) {
      snprintf(err, err_bytes, "cannot make a token: %s", strerror(errno));
      return RPC_UNAVAILABLE;
    }
  }

  /* The job as stored, built on the stack and copied into one allocation
   * tree. */
  job_config_msg effective;
  effective_config(req->config, &effective);
  Zerod__V1__JobConfig config = effective.config; /* its pointers stay in effective */
  Zerod__V1__Quotas quotas = ZEROD__V1__QUOTAS__INIT;
  if (req->quotas != NULL) {
    quotas.max_live_bytes = req->quotas->max_live_bytes;
    quotas.max_host_bytes = req->quotas->max_host_bytes;
    quotas.max_device_bytes = req->quotas->max_device_bytes;
    quotas.max_sessions = req->quotas->max_sessions;
  }
  Zerod__V1__RankPlacement placement[CTL_MAX_RANKS];
  Zerod__V1__RankPlacement *placement_pointers[CTL_MAX_RANKS];
  for (uint32_t i = 0; i < req->nodes; i++) {
    zerod__v1__rank_placement__init(&placement[i]);
    placement[i].node = (char *)chosen[i];
    placement[i].first_rank = i * req->ranks_per_node;
    placement[i].ranks = req->ranks_per_node;
    placement_pointers[i] = &placement[i];
  }
  Zerod__V1__Job job = ZEROD__V1__JOB__INIT;
  job.name = req->name;
  job.id = c->next_job_id;
  job.config = &config;
  job.nodes = req->nodes;
  job.ranks_per_node = req->ranks_per_node;
  job.world_size = req->nodes * req->ranks_per_node;
  job.quotas = &quotas;
  job.n_placement = req->nodes;
  job.placement = placement_pointers;
  job.created_unix_ms = coord__unix_ms();
  job.epoch = 1;
  job.tenant = (char *)tenant;
  /* Kept with the job (and so in the state file) only when it asks for
   * something: an all-zero policy is no policy. */
  if (policy != NULL &&
      (policy->every_steps != 0 || policy->every_seconds != 0 || policy->redundancy != 0))
    job.checkpoint_policy = (Zerod__V1__CheckpointPolicy *)policy;
  Zerod__V1__Job *copy = coord__message_copy(&job.base);
  char token_sha256[DIGEST_HEX_BYTES];
  digest_sha256_hex(token, token_sha256);
  cjob *j = copy != NULL ? coord__job_new(copy, token_sha256) : NULL;
  if (j != NULL)
    j->ckpt.recovered_epoch = j->epoch; /* a new job has lost nothing */
  if (j == NULL) {
    ctl_free(copy ? &copy->base : NULL);
    snprintf(err, err_bytes, "coordinator out of memory");
    return RPC_RESOURCE_EXHAUSTED;
  }
  cjob **grown = realloc(c->jobs, (c->njobs + 1) * sizeof *c->jobs);
  if (grown == NULL) {
    coord__job_free(c, j);
    snprintf(err, err_bytes, "coordinator out of memory");
    return RPC_RESOURCE_EXHAUSTED;
  }
  c->jobs = grown;

  if (coord__state_write(c, j, NULL, c->next_job_id + 1, err, err_bytes) != 0) {
    LOG_ERRORF("job not created", "job=%s err=\"%s\"", req->name, err);
    coord__job_free(c, j);
    return RPC_UNAVAILABLE;
  }
  c->next_job_id++;
  at = -at - 1;
  memmove(&c->jobs[at + 1], &c->jobs[at], (c->njobs - (size_t)at) * sizeof *c->jobs);
  c->jobs[at] = j;
  c->njobs++;
  LOG_INFOF("job created", "job=%s id=%" PRIu64 " nodes=%u ranks_per_node=%u tenant=%s", req->name,
            j->msg->id, req->nodes, req->ranks_per_node, tenant);
  coord__derive_job(c, j);
  coord__mark_job_watches(c, j);
  memcpy(token_out, token, strlen(token) + 1);
  *out = j;
  return 0;
}

static void on_create_job(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  coord_caller who;
  Zerod__V1__CreateJobRequest *req =
      coord__begin_as(c, call, CTL_CREATE_JOB, request, request_bytes, &who);
  if (req == NULL)
    return;
  /* coord__begin_as let the caller make it: an admin names any tenant or
   * none, a tenant its own (or none, meaning its own). */
  char err[PATH_MAX + 256];
  const char *tenant = req->tenant[0] != '\0' ? req->tenant : who.tenant;
  const cjob *j;
  char token[CTL_TOKEN_MAX_BYTES + 1];
  int status = create_job(c, req, tenant, &who, 0, &j, token, err, sizeof err);
  if (status != 0) {
    coord__finish_error(call, status, "%s", err);
  } else {
    Zerod__V1__Job view;
    coord__job_view(j, &view);
    Zerod__V1__CreateJobReply reply = ZEROD__V1__CREATE_JOB_REPLY__INIT;
    reply.job = &view;
    reply.token = token; /* the only time it leaves the coordinator */
    coord__finish_message(call, &reply.base);
  }
  ctl_free(&req->base);
}

int coord_create_job_local(coord *c, const char *name, const char *token,
                           const Zerod__V1__JobConfig *config, const char *node, uint32_t ranks,
                           uint64_t *id_out, uint64_t *epoch_out, char *err, size_t err_bytes) {
  if (c->shutting_down) {
    snprintf(err, err_bytes, "coordinator shutting down");
    return RPC_UNAVAILABLE;
  }
  Zerod__V1__CreateJobRequest req = ZEROD__V1__CREATE_JOB_REQUEST__INIT;
  req.name = (char *)name;
  req.token = (char *)(token != NULL ? token : "");
  req.config = (Zerod__V1__JobConfig *)config;
  req.nodes = 1;
  req.ranks_per_node = ranks;
  char *nodes[1] = {(char *)node};
  req.n_node_names = 1;
  req.node_names = nodes;
  const cjob *j;
  char given[CTL_TOKEN_MAX_BYTES + 1];
  int status = create_job(c, &req, "", NULL, 1, &j, given, err, err_bytes);
  if (status == 0) {
    *id_out = j->msg->id;
    *epoch_out = j->epoch;
  }
  return status;
}

static void on_get_job(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__GetJobRequest *req = coord__begin(c, call, CTL_GET_JOB, request, request_bytes);
  if (req == NULL)
    return;
  const cjob *j = coord__find_job(c, req->name);
  if (j == NULL) {
    coord__finish_error(call, RPC_NOT_FOUND, "no job named '%s'", req->name);
  } else {
    Zerod__V1__Job view;
    coord__base_view(c, j, &view);
    coord__finish_message(call, &view.base);
  }
  ctl_free(&req->base);
}

/* ListJobs shows each caller the jobs it may read; a node, those placed
 * on it. */
static int job_listed_for(const coord_caller *who, const cjob *j) {
  return who->role == AUTH_NODE ? authz_placed_on(who, j->msg) : authz_may_read_job(who, j->msg);
}

/* A new read token for a job: made here, its hash kept (durably, before
 * the reply) and sent to the job's nodes, the token itself given to the
 * caller alone. */
static void on_issue_read_token(rpc_call *call, const uint8_t *request, size_t request_bytes,
                                void *arg) {
  coord *c = arg;
  Zerod__V1__IssueReadTokenRequest *req =
      coord__begin(c, call, CTL_ISSUE_READ_TOKEN, request, request_bytes);
  if (req == NULL)
    return;
  cjob *j = coord__find_job(c, req->job);
  char token[COORD_TOKEN_HEX_DIGITS + 1], hash[DIGEST_HEX_BYTES], err[512];
  if (j == NULL || j->deleting) {
    coord__finish_error(call, RPC_NOT_FOUND, "no job named '%s'", req->job);
  } else if (random_token(token) != 0) {
    coord__finish_error(call, RPC_UNAVAILABLE, "cannot make a token: %s", strerror(errno));
  } else {
    digest_sha256_hex(token, hash);
    /* Kept only once stored: a token that a restart would forget is no
     * token to give out. */
    char dropped[DIGEST_HEX_BYTES] = "";
    if (j->n_read_tokens == COORD_MAX_READ_TOKENS)
      memcpy(dropped, j->read_tokens[0], sizeof dropped);
    if (coord__job_add_read_token(j, hash) != 0) {
      coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
    } else if (coord__state_write(c, NULL, NULL, c->next_job_id, err, sizeof err) != 0) {
      j->n_read_tokens--;
      if (dropped[0] != '\0') {
        memmove(j->read_tokens[1], j->read_tokens[0], j->n_read_tokens * sizeof j->read_tokens[0]);
        memcpy(j->read_tokens[0], dropped, sizeof dropped);
        j->n_read_tokens++;
      }
      coord__finish_error(call, RPC_UNAVAILABLE, "%s", err);
    } else {
      coord__mark_job_watches(c, j);
      Zerod__V1__IssueReadTokenReply reply = ZEROD__V1__ISSUE_READ_TOKEN_REPLY__INIT;
      reply.token = token;
      coord__finish_message(call, &reply.base);
    }
  }
  memset(token, 0, sizeof token);
  ctl_free(&req->base);
}

static void on_list_jobs(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  coord_caller who;
  ProtobufCMessage *req = coord__begin_as(c, call, CTL_LIST_JOBS, request, request_bytes, &who);
  if (req == NULL)
    return;
  Zerod__V1__Job *views = calloc(c->njobs ? c->njobs : 1, sizeof *views);
  Zerod__V1__Job **pointers = calloc(c->njobs ? c->njobs : 1, sizeof *pointers);
  if (views == NULL || pointers == NULL) {
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
  } else {
    size_t n = 0;
    for (size_t i = 0; i < c->njobs; i++) {
      if (!job_listed_for(&who, c->jobs[i]))
        continue;
      coord__base_view(c, c->jobs[i], &views[n]);
      pointers[n] = &views[n];
      n++;
    }
    Zerod__V1__ListJobsReply reply = ZEROD__V1__LIST_JOBS_REPLY__INIT;
    reply.n_jobs = n;
    reply.jobs = pointers;
    coord__finish_message(call, &reply.base);
  }
  free(views);
  free(pointers);
  ctl_free(req);
}

int coord__delete_job(coord *c, cjob *j, const char *why, char *err, size_t err_bytes) {
  if (j->deleting)
    return 0;
  int status = coord__base_deletable(c, j, err, err_bytes);
  if (status != 0)
    return status;
  /* Its checkpoints outlive it, and their owner is recorded with it
   * (ckpt_owner.c). */
  if (coord__ckpt_retire(c, j, coord__unix_ms()) != 0) {
    snprintf(err, err_bytes, "coordinator out of memory");
    return RPC_RESOURCE_EXHAUSTED;
  }
  if (coord__state_write(c, NULL, j, c->next_job_id, err, err_bytes) != 0) {
    coord__ckpt_unretire(c, j->msg->id);
    LOG_ERRORF("job not deleted", "job=%s err=\"%s\"", j->msg->name, err);
    return RPC_UNAVAILABLE;
  }
  /* The job leaves every assignment now (its nodes tear it down when
   * their watch says so) and stays listed until none reports it. */
  j->deleting = 1;
  j->state = ZEROD__V1__JOB_STATE__JOB_STATE_DELETING;
  snprintf(j->reason, sizeof j->reason, "%s; waiting for its nodes to drop it", why);
  char message[160];
  snprintf(message, sizeof message, "job '%s' was %s", j->msg->name, why);
  coord__kv_waiters_end(j, RPC_NOT_FOUND, message);
  coord__kv_clear(c, j);
  coord__ckpt_job_deleted(c, j);
  LOG_INFOF("job deleting", "job=%s id=%" PRIu64 " why=\"%s\"", j->msg->name, j->msg->id, why);
  coord__mark_job_watches(c, j);
  /* The job may be forgotten at once (no node reports it), so the node
   * name that selects it must not point into it. */
  char node[CTL_NAME_MAX_BYTES + 1];
  snprintf(node, sizeof node, "%s", j->msg->placement[0]->node);
  coord__reconcile(c, node);
  return 0;
}

static void on_delete_job(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__DeleteJobRequest *req = coord__begin(c, call, CTL_DELETE_JOB, request, request_bytes);
  if (req == NULL)
    return;
  cjob *j = coord__find_job(c, req->name);
  if (j == NULL) {
    coord__finish_error(call, RPC_NOT_FOUND, "no job named '%s'", req->name);
    goto out;
  }
  char err[PATH_MAX + 256];
  int status = coord__delete_job(c, j, "deleted", err, sizeof err);
  if (status != 0) {
    coord__finish_error(call, status, "%s", err);
    goto out;
  }
  Zerod__V1__DeleteJobReply reply = ZEROD__V1__DELETE_JOB_REPLY__INIT;
  coord__finish_message(call, &reply.base);
out:
  ctl_free(&req->base);
}

int coord__jobs_register(coord *c, rpc_server *server) {
  static const coord_method methods[] = {
      {CTL_CREATE_JOB, RPC_UNARY, on_create_job},
      {CTL_GET_JOB, RPC_UNARY, on_get_job},
      {CTL_LIST_JOBS, RPC_UNARY, on_list_jobs},
      {CTL_DELETE_JOB, RPC_UNARY, on_delete_job},
      {CTL_ISSUE_READ_TOKEN, RPC_UNARY, on_issue_read_token},
  };
  return coord__add_methods(c, server, methods, sizeof methods / sizeof methods[0]);
}
