/* Bases (coord_impl.h; docs/bases.md): the Jobs service's FreezeJob, and
 * what CreateJob and DeleteJob check of a job's base.
 *
 * A base is a frozen job: FreezeJob marks a READY job frozen, with the
 * tenants it is shared with (or every tenant), stores it durably and
 * re-sends its nodes their assignment, which now says frozen: from then on
 * the nodes refuse anything that would write its state. A job whose
 * config names a base (config.base_job) is created on the base's nodes,
 * with its world and working dtype, by the base's owner tenant, a tenant
 * it is shared with, or an admin; a base stays while any live job names
 * it. Bases are one level deep: a job on a base cannot be frozen. Loop
 * thread only. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "coord_impl.h"
#include "ctl_decode.h"
#include "job_states.h"
#include "log.h"

/* The working dtype config runs with, as the nodes read it. */
static zk_dtype working_dtype(const Zerod__V1__JobConfig *config) {
  job_config read;
  char err[256];
  if (job_config_from_proto(config, &read, err, sizeof err) != 0)
    return ZK_F32; /* not reached: every config here was checked */
  return read.working_dtype;
}

/* The base a config names, "" for none. */
static const char *config_base(const Zerod__V1__JobConfig *config) {
  return config != NULL && config->base_job != NULL ? config->base_job : "";
}

static const char *base_of(const Zerod__V1__Job *job) {
  return config_base(job->config);
}

/* The live jobs on base: their count, and up to max of their names. */
static size_t jobs_on(const coord *c, const char *base, const char **names, size_t max) {
  size_t n = 0;
  for (size_t i = 0; i < c->njobs; i++) {
    const cjob *j = c->jobs[i];
    if (j->deleting || strcmp(base_of(j->msg), base) != 0)
      continue;
    if (n < max)
      names[n] = j->msg->name;
    n++;
  }
  return n;
}

void coord__base_view(const coord *c, const cjob *j, Zerod__V1__Job *out) {
  coord__job_view(j, out);
  if (j->msg->frozen)
    out->jobs_on_base = (uint32_t)jobs_on(c, j->msg->name, NULL, 0);
}

int coord__base_deletable(const coord *c, const cjob *j, char *err, size_t err_bytes) {
  if (!j->msg->frozen)
    return 0;
  const char *names[8];
  size_t n = jobs_on(c, j->msg->name, names, sizeof names / sizeof names[0]);
  if (n == 0)
    return 0;
  size_t shown = n < sizeof names / sizeof names[0] ? n : sizeof names / sizeof names[0];
  int len = snprintf(err, err_bytes, "base '%s' is used by job%s ", j->msg->name, n > 1 ? "s" : "");
  for (size_t i = 0; i < shown && len >= 0 && (size_t)len < err_bytes; i++)
    len += snprintf(err + len, err_bytes - (size_t)len, "%s%s", i > 0 ? ", " : "", names[i]);
  if (len >= 0 && (size_t)len < err_bytes && n > shown)
    len += snprintf(err + len, err_bytes - (size_t)len, " and %zu more", n - shown);
  if (len >= 0 && (size_t)len < err_bytes)
    snprintf(err + len, err_bytes - (size_t)len, "; delete %s first", n > 1 ? "them" : "it");
  return RPC_FAILED_PRECONDITION;
}

/* ------------------------------------------------------------------------ */
/* CreateJob on a base                                                      */
/* ------------------------------------------------------------------------ */

/* Whether the resolved request r runs as base does: the same nodes in
 * the same order, ranks per node and working dtype (the nodes share the
 * base's units between the jobs rank by rank). */
static int same_shape(const Zerod__V1__CreateJobRequest *r, const Zerod__V1__Job *base, char *err,
                      size_t err_bytes) {
  if (r->nodes != base->n_placement) {
    snprintf(err, err_bytes, "nodes is %" PRIu32 "; base '%s' is on %zu", r->nodes, base->name,
             base->n_placement);
    return RPC_INVALID_ARGUMENT;
  }
  for (size_t i = 0; i < r->n_node_names && i < base->n_placement; i++) {
    if (strcmp(r->node_names[i], base->placement[i]->node) != 0) {
      snprintf(err, err_bytes,
               "node_names[%zu] is '%s'; base '%s' has '%s' there (a job on a base runs on "
               "its nodes, in its order)",
               i, r->node_names[i], base->name, base->placement[i]->node);
      return RPC_INVALID_ARGUMENT;
    }
  }
  if (r->ranks_per_node != base->ranks_per_node) {
    snprintf(err, err_bytes, "ranks_per_node is %" PRIu32 "; base '%s' has %" PRIu32,
             r->ranks_per_node, base->name, base->ranks_per_node);
    return RPC_INVALID_ARGUMENT;
  }
  zk_dtype want = working_dtype(r->config), have = working_dtype(base->config);
  if (want != have) {
    snprintf(err, err_bytes, "config.working_dtype is %s; base '%s' has %s", zk_dtype_name(want),
             base->name, zk_dtype_name(have));
    return RPC_INVALID_ARGUMENT;
  }
  return 0;
}

int coord__base_resolve(const coord *c, const coord_caller *who, const char *tenant,
                        const Zerod__V1__CreateJobRequest *req, base_request *out,
                        const Zerod__V1__CreateJobRequest **use, char *err, size_t err_bytes) {
  *use = req;
  const char *name = config_base(req->config);
  if (name[0] == '\0')
    return 0;
  const cjob *b = coord__find_job(c, name);
  if (b == NULL || b->deleting) {
    snprintf(err, err_bytes, "base job '%s' does not exist", name);
    return RPC_NOT_FOUND;
  }
  const Zerod__V1__Job *base = b->msg;
  if (!base->frozen) {
    snprintf(err, err_bytes, "job '%s' is not a base (zerodctl jobs freeze %s)", name, name);
    return RPC_FAILED_PRECONDITION;
  }
  if (who != NULL && !authz_may_build_on(who, tenant, base)) {
    snprintf(err, err_bytes, "tenant '%s' may not build on base '%s' (owner '%s')",
             tenant[0] != '\0' ? tenant : who->name, name,
             base->tenant[0] != '\0' ? base->tenant : "admins");
    return RPC_PERMISSION_DENIED;
  }
  /* What the request leaves out is the base's. */
  out->request = *req;
  out->config = *req->config;
  out->request.config = &out->config;
  if (out->request.nodes == 0)
    out->request.nodes =
        req->n_node_names != 0 ? (uint32_t)req->n_node_names : (uint32_t)base->n_placement;
  if (out->request.ranks_per_node == 0)
    out->request.ranks_per_node = base->ranks_per_node;
  if (req->n_node_names == 0 && out->request.nodes == base->n_placement &&
      base->n_placement <= CTL_MAX_RANKS) {
    for (size_t i = 0; i < base->n_placement; i++)
      out->node_names[i] = base->placement[i]->node;
    out->request.n_node_names = base->n_placement;
    out->request.node_names = out->node_names;
  }
  if (out->config.working_dtype == ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED && base->config != NULL)
    out->config.working_dtype = base->config->working_dtype;
  int status = same_shape(&out->request, base, err, err_bytes);
  if (status != 0)
    return status;
  /* Checked again whole: hpZ's group, for one, is the ranks per node. */
  if (ctl_check_create_job(&out->request, err, err_bytes) != 0)
    return RPC_INVALID_ARGUMENT;
  *use = &out->request;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* FreezeJob                                                                */
/* ------------------------------------------------------------------------ */

/* Makes j frozen with req's sharing, stored before it counts. Returns 0
 * or an RPC status with err. */
static int freeze(coord *c, cjob *j, const Zerod__V1__FreezeJobRequest *req, char *err,
                  size_t err_bytes) {
  const char *base = base_of(j->msg);
  if (base[0] != '\0') {
    snprintf(err, err_bytes, "job '%s' is on base '%s': a job on a base cannot be a base",
             j->msg->name, base);
    return RPC_FAILED_PRECONDITION;
  }
  /* A base may change its sharing in any state; a job becomes one only
   * while its state is whole on every node. */
  if (!j->msg->frozen && j->state != ZEROD__V1__JOB_STATE__JOB_STATE_READY) {
    snprintf(err, err_bytes, "job '%s' is %s, not ready: only a ready job can be frozen",
             j->msg->name, zd_job_state_word(j->state));
    return RPC_FAILED_PRECONDITION;
  }
  Zerod__V1__Job changed = *j->msg;
  changed.frozen = 1;
  changed.n_shared_with = req->n_shared_with;
  changed.shared_with = req->shared_with;
  changed.public_ = req->public_;
  int status = coord__job_store(c, j, &changed, err, err_bytes);
  if (status != 0)
    LOG_ERRORF("job not frozen", "job=%s err=\"%s\"", req->name, err);
  return status;
}

static void on_freeze_job(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__FreezeJobRequest *req = coord__begin(c, call, CTL_FREEZE_JOB, request, request_bytes);
  if (req == NULL)
    return;
  cjob *j = coord__find_job(c, req->name);
  char err[512];
  int status = RPC_NOT_FOUND;
  if (j == NULL || j->deleting)
    snprintf(err, sizeof err, "no job named '%s'", req->name);
  else
    status = freeze(c, j, req, err, sizeof err);
  if (status != 0) {
    coord__finish_error(call, status, "%s", err);
  } else {
    LOG_INFOF("job frozen", "job=%s shared_with=%zu public=%d", req->name, req->n_shared_with,
              (int)req->public_);
    /* Its nodes learn it with their next Watch event. */
    coord__mark_job_watches(c, j);
    Zerod__V1__Job view;
    coord__base_view(c, j, &view);
    coord__finish_message(call, &view.base);
  }
  ctl_free(&req->base);
}

int coord__bases_register(coord *c, rpc_server *server) {
  static const coord_method methods[] = {
      {CTL_FREEZE_JOB, RPC_UNARY, on_freeze_job},
  };
  return coord__add_methods(c, server, methods, sizeof methods / sizeof methods[0]);
}
