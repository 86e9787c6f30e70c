/* SET_GROUPS: torch.optim's parameter groups in the daemon. Each group has
 * its own hyper-parameters (the job's algorithm); each tensor of each unit
 * belongs to one, and the step runs every trainable range of a shard with
 * its group's (the ranges are split where the group changes). Every rank
 * must send the same request: one all-reduce compares them (agree.h), and
 * the groups change on every rank or on none. */
#include "exec_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

void exec__group(const rank_state *rs, uint32_t g, job_group *out) {
  if (rs->ngroups == 0 || g >= rs->ngroups)
    job_group_of_config(&rs->job->config, rs->lr, out);
  else
    *out = rs->groups[g];
  if (g == 0)
    out->lr = rs->lr;
}

/* The request as this rank checks it, before anything changes: the
 * groups in *out, or a refusal in why (with its status). */
static int check_groups(rank_state *rs, const Zerod__V1__SetGroupsRequest *req, job_group **out,
                        Zerod__V1__Status *status, char *why, size_t why_bytes) {
  *status = ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT;
  if (req->n_groups < 1 || req->n_groups > JOB_MAX_GROUPS) {
    snprintf(why, why_bytes, "%zu groups (1..%d)", req->n_groups, JOB_MAX_GROUPS);
    return -1;
  }
  job_group *groups = calloc(req->n_groups, sizeof *groups);
  if (groups == NULL) {
    *status = ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED;
    snprintf(why, why_bytes, "out of memory");
    return -1;
  }
  *out = groups;
  for (size_t g = 0; g < req->n_groups; g++) {
    char err[256];
    if (job_group_from_proto(&rs->job->config, req->groups[g], &groups[g], err, sizeof err) != 0) {
      snprintf(why, why_bytes, "group %zu: %s", g, err);
      return -1;
    }
  }
  for (size_t u = 0; u < req->n_units; u++) {
    const Zerod__V1__UnitGroups *ug = req->units[u];
    unit_layout *l;
    if (exec__find_shard(rs, ug->unit_id, &l, why, why_bytes) == NULL) {
      *status = ZEROD__V1__STATUS__STATUS_NOT_FOUND;
      return -1;
    }
    for (size_t k = 0; k < u; k++)
      if (req->units[k]->unit_id == ug->unit_id) {
        snprintf(why, why_bytes, "unit '%s' is listed twice", l->name);
        return -1;
      }
    if (ug->n_tensor_group != l->ntensors) {
      snprintf(why, why_bytes, "unit '%s' has %u tensors, and %zu groups are given for it", l->name,
               l->ntensors, ug->n_tensor_group);
      return -1;
    }
    for (size_t t = 0; t < ug->n_tensor_group; t++)
      if (ug->tensor_group[t] >= req->n_groups) {
        snprintf(why, why_bytes, "tensor '%s' of unit '%s' is in group %u of %zu",
                 l->tensors[t].name, l->name, ug->tensor_group[t], req->n_groups);
        return -1;
      }
  }
  return 0;
}

/* The groups a unit's tensors are put in (NULL: all in group 0). */
static const uint32_t *unit_tensor_groups(const Zerod__V1__SetGroupsRequest *req, uint32_t id) {
  for (size_t u = 0; u < req->n_units; u++)
    if (req->units[u]->unit_id == id)
      return req->units[u]->tensor_group;
  return NULL;
}

/* What every rank must send alike, named as zd_set_groups names it: the
 * count, each of the JOB_MAX_GROUPS groups' fields (past the count, as
 * absent), and the group of every registered unit's tensors, in unit order
 * whatever order the request listed them in. */
static void groups_fields(const rank_state *rs, const Zerod__V1__SetGroupsRequest *req,
                          agree_set *a) {
  uint64_t n = req->n_groups;
  agree_add(a, &n, sizeof n, "ngroups");
  static const Zerod__V1__OptimizerConfig absent = ZEROD__V1__OPTIMIZER_CONFIG__INIT;
  for (unsigned g = 0; g < JOB_MAX_GROUPS; g++) {
    const Zerod__V1__OptimizerConfig *o =
        g < req->n_groups && req->groups[g] != NULL ? req->groups[g] : &absent;
    double weight_decay[2] = {o->has_weight_decay ? 1.0 : 0.0, o->weight_decay};
    uint32_t flags[2] = {(uint32_t)o->kind, o->nesterov ? 1u : 0u};
    agree_add_f64(a, o->lr, "groups[%u].lr", g);
    agree_add_f64(a, o->beta1, "groups[%u].beta1", g);
    agree_add_f64(a, o->beta2, "groups[%u].beta2", g);
    agree_add_f64(a, o->eps, "groups[%u].eps", g);
    agree_add(a, weight_decay, sizeof weight_decay, "groups[%u].weight_decay", g);
    agree_add_f64(a, o->momentum, "groups[%u].momentum", g);
    agree_add_f64(a, o->dampening, "groups[%u].dampening", g);
    agree_add(a, flags, sizeof flags, "groups[%u].nesterov", g);
  }
  uint64_t units = 0;
  for (uint32_t id = 0; id < rs->nshards; id++) {
    if (!shard_has_state(&rs->shards[id]))
      continue;
    const uint32_t *tensor_group = unit_tensor_groups(req, id);
    uint32_t ntensors = job_unit(rs->job, id)->ntensors;
    units = agree_digest(units, &id, sizeof id);
    for (uint32_t t = 0; t < ntensors; t++) {
      uint32_t grp = tensor_group != NULL ? tensor_group[t] : 0;
      units = agree_digest(units, &grp, sizeof grp);
    }
  }
  agree_add_digest(a, units, "tensor_groups");
}

#define GROUPS_FIELDS (1 + 8 * JOB_MAX_GROUPS + 1)

void exec__handle_set_groups(rank_state *rs, exec_op *op) {
  Zerod__V1__SetGroupsRequest *req = (Zerod__V1__SetGroupsRequest *)op->request;
  if (exec__op_job_failed(rs, op))
    return;
  job_group *groups = NULL;
  agree_field *fields = calloc(GROUPS_FIELDS, sizeof *fields);
  if (fields == NULL) {
    /* Before the collective: the job cannot go on with its ranks split. */
    job_fail(rs->job, rs->generation, "rank %d: out of memory setting parameter groups", rs->rank);
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  /* Everything is checked, and compared with the other ranks, before
   * anything changes. */
  agree_set agreed;
  agree_init(&agreed, fields, GROUPS_FIELDS);
  Zerod__V1__Status status;
  char why[512] = "";
  agreed.refused = check_groups(rs, req, &groups, &status, why, sizeof why) != 0;
  if (!agreed.refused)
    groups_fields(rs, req, &agreed);
  else
    groups_fields(rs, &(Zerod__V1__SetGroupsRequest)ZEROD__V1__SET_GROUPS_REQUEST__INIT, &agreed);
  int rc = exec__all_reduce_agreed(rs, op, NULL, 0, &agreed, (int)status, why, "parameter groups");
  free(fields);
  if (rc < 0) {
    exec__op_comm_failed(rs, op, "all_reduce (parameter groups)", rc);
    goto done;
  }
  if (rc > 0)
    goto done; /* answered: refused here or elsewhere, or different */
  /* Units left out go to group 0: every registered shard is recomputed. */
  for (uint32_t id = 0; id < rs->nshards; id++) {
    if (!shard_has_state(&rs->shards[id]))
      continue;
    if (exec__shard_set_groups(rs, job_unit(rs->job, id), &rs->shards[id],
                               unit_tensor_groups(req, id)) != 0) {
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
