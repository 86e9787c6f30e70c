/* ckpt_scale: ScaleJob (coord_ckpt.h; docs/redundancy.md, "Scaling"): a
 * job with redundancy moves onto another set of nodes (more, fewer or
 * others) through its in-memory copies: the new placement is stored, every
 * node of it builds the job afresh, and the recovery (ckpt_recover.c)
 * restores the newest copy re-sharded onto the new world. A node that
 * leaves the placement drops the job and its copies at once, so one node
 * at most may leave per call: each of its ranks' files is also on its
 * buddy, which stays. Loop thread only. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "coord_ckpt.h"
#include "job_states.h"
#include "log.h"

/* Why j cannot be scaled now, into err; 0 when it can. */
static int scale_check(coord *c, const cjob *j, const Zerod__V1__ScaleJobRequest *req, char *err,
                       size_t err_bytes) {
  if (!coord__mem_enabled(j)) {
    snprintf(err, err_bytes,
             "job '%s' has no redundancy: only a job with in-memory copies can be scaled "
             "(create it with --redundancy 1)",
             j->msg->name);
    return RPC_FAILED_PRECONDITION;
  }
  if (j->msg->frozen) {
    snprintf(err, err_bytes, "job '%s' is a frozen base", j->msg->name);
    return RPC_FAILED_PRECONDITION;
  }
  if (j->state != ZEROD__V1__JOB_STATE__JOB_STATE_READY || j->ckpt.order != NULL ||
      coord__ckpt_recovery_pending(j)) {
    snprintf(err, err_bytes, "job '%s' is %s%s; retry once it is ready", j->msg->name,
             zd_job_state_word(j->state),
             j->ckpt.order != NULL ? " with a checkpoint save or restore in flight" : "");
    return RPC_UNAVAILABLE;
  }
  if (j->ckpt.mem.step == 0) {
    snprintf(err, err_bytes,
             "job '%s' has no complete in-memory copy yet (one is made at the end of a step)",
             j->msg->name);
    return RPC_UNAVAILABLE;
  }
  for (size_t i = 0; i < req->n_node_names; i++) {
    const member *m = coord__find_member(c, req->node_names[i]);
    if (m == NULL || m->info->replica_port == 0 || m->info->ranks < j->msg->ranks_per_node) {
      snprintf(err, err_bytes,
               m == NULL ? "node '%s' is not a member"
               : m->info->replica_port == 0
                   ? "node '%s' keeps no in-memory copies (no replica server)"
                   : "node '%s' cannot host the job's ranks per node",
               req->node_names[i]);
      return RPC_FAILED_PRECONDITION;
    }
  }
  size_t leaving = 0;
  for (size_t i = 0; i < j->msg->n_placement; i++) {
    int stays = 0;
    for (size_t k = 0; k < req->n_node_names && !stays; k++)
      stays = strcmp(j->msg->placement[i]->node, req->node_names[k]) == 0;
    leaving += !stays;
  }
  if (leaving > 1) {
    snprintf(err, err_bytes,
             "%zu of the job's nodes would leave it: one at most may per call (each holds the "
             "only other copy of its peer's state)",
             leaving);
    return RPC_INVALID_ARGUMENT;
  }
  if (req->n_node_names < 2) {
    snprintf(err, err_bytes, "a job with redundancy needs 2 or more nodes");
    return RPC_INVALID_ARGUMENT;
  }
  if ((uint64_t)req->n_node_names * j->msg->ranks_per_node > CTL_MAX_RANKS) {
    snprintf(err, err_bytes, "%zu nodes of %u ranks is more than %d ranks", req->n_node_names,
             j->msg->ranks_per_node, CTL_MAX_RANKS);
    return RPC_INVALID_ARGUMENT;
  }
  return 0;
}

static void on_scale_job(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__ScaleJobRequest *req = coord__begin(c, call, CTL_SCALE_JOB, request, request_bytes);
  if (req == NULL)
    return;
  cjob *j = coord__find_job(c, req->name);
  char err[512];
  int status = RPC_NOT_FOUND;
  if (j == NULL || j->deleting)
    snprintf(err, sizeof err, "no job named '%s'", req->name);
  else
    status = scale_check(c, j, req, err, sizeof err);
  uint32_t before = j != NULL ? j->msg->nodes : 0;
  char why[256];
  if (status == 0) {
    snprintf(why, sizeof why,
             "scaled from %u to %zu nodes; moving from the in-memory copy of step %" PRIu64, before,
             req->n_node_names, j->ckpt.mem.step);
    j->step_at_loss = j->step;
    status = coord__mem_replace(c, j, (const char *const *)req->node_names, req->n_node_names, why,
                                err, sizeof err);
  }
  if (status != 0) {
    coord__finish_error(call, status, "%s", err);
  } else {
    j->epoch++; /* a new rendezvous: nothing of the old world is read */
    LOG_INFOF("job scaled", "job=%s nodes=%u->%zu world_size=%u memory_step=%" PRIu64, req->name,
              before, req->n_node_names, j->msg->world_size, j->ckpt.mem.step);
    coord__reconcile(c, NULL);
    coord__mark_all_watches(c);
    Zerod__V1__Job view;
    coord__job_view(j, &view);
    coord__finish_message(call, &view.base);
  }
  ctl_free(&req->base);
}

int coord__ckpt_scale_register(coord *c, rpc_server *server) {
  static const coord_method methods[] = {{CTL_SCALE_JOB, RPC_UNARY, on_scale_job}};
  return coord__add_methods(c, server, methods, sizeof methods / sizeof methods[0]);
}
