/* SET_GROUPS: torch.optim's parameter groups in the daemon. Each group has
 * its own hyper-parameters (the job's algorithm); each tensor of each unit
 * belongs to one, and the step runs every trainable range of a shard with
 * its group's (the ranges are split where the group changes). No
 * collective: every rank gets the same request and makes the same checks,
 * and nothing here moves values between ranks. */
#include "exec_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

void exec__group(const rank_state *rs, uint32_t g, job_group *out) {
  if (rs->ngroups == 0 || g >= rs->ngroups)
    job_group_of_config(&rs->job->config, rs->lr, out);
  else
    *out = rs->groups[g];
  if (g == 0)
    out->lr = rs->lr;
}

void exec__handle_set_groups(rank_state *rs, exec_op *op) {
  Zerod__V1__SetGroupsRequest *req = (Zerod__V1__SetGroupsRequest *)op->request;
  if (exec__op_job_failed(rs, op))
    return;
  if (req->n_groups < 1 || req->n_groups > JOB_MAX_GROUPS) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, "set_groups: %zu groups (1..%d)",
               req->n_groups, JOB_MAX_GROUPS);
    return;
  }
  job_group *groups = calloc(req->n_groups, sizeof *groups);
  if (groups == NULL) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
    goto done;
  }
  /* Everything is checked before anything changes. */
  for (size_t g = 0; g < req->n_groups; g++) {
    char err[256];
    if (job_group_from_proto(&rs->job->config, req->groups[g], &groups[g], err, sizeof err) != 0) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, "set_groups: group %zu: %s", g,
                 err);
      goto done;
    }
  }
  for (size_t u = 0; u < req->n_units; u++) {
    const Zerod__V1__UnitGroups *ug = req->units[u];
    unit_layout *l;
    if (exec__lookup_shard(rs, op, ug->unit_id, &l) == NULL)
      goto done; /* answered: unknown or unregistered unit */
    for (size_t k = 0; k < u; k++)
      if (req->units[k]->unit_id == ug->unit_id) {
        exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                   "set_groups: unit '%s' is listed twice", l->name);
        goto done;
      }
    if (ug->n_tensor_group != l->ntensors) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "set_groups: unit '%s' has %u tensors, and %zu groups are given for it", l->name,
                 l->ntensors, ug->n_tensor_group);
      goto done;
    }
    for (size_t t = 0; t < ug->n_tensor_group; t++)
      if (ug->tensor_group[t] >= req->n_groups) {
        exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                   "set_groups: tensor '%s' of unit '%s' is in group %u of %zu", l->tensors[t].name,
                   l->name, ug->tensor_group[t], req->n_groups);
        goto done;
      }
  }
  /* Units left out go to group 0: every registered shard is recomputed. */
  for (uint32_t id = 0; id < rs->nshards; id++) {
    if (!rs->shards[id].present)
      continue;
    const uint32_t *tensor_group = NULL;
    for (size_t u = 0; u < req->n_units; u++)
      if (req->units[u]->unit_id == id)
        tensor_group = req->units[u]->tensor_group;
    if (exec__shard_set_groups(rs, job_unit(rs->job, id), &rs->shards[id], tensor_group) != 0) {
      /* Ranks may now differ in their ranges: the job stops. */
      job_fail(rs->job, rs->generation, "rank %d: out of memory setting parameter groups",
               rs->rank);
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
      goto done;
    }
  }
  free(rs->groups);
  rs->groups = groups;
  rs->ngroups = (unsigned)req->n_groups;
  rs->lr = groups[0].lr;
  groups = NULL;
  Zerod__V1__SetGroupsReply reply = ZEROD__V1__SET_GROUPS_REPLY__INIT;
  reply.groups = rs->ngroups;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS_REPLY, &reply.base);
done:
  free(groups);
}
