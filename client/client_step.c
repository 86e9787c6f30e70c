/* libzerod: the job's collectives beyond the data path (client_impl.h) -
 * steps, parameter groups, gradient norms, checkpoints - and detach. */
#include "client_impl.h"

/* ------------------------------------------------------------------------
 * Step and detach
 * ------------------------------------------------------------------------ */

zd_status zd_step(zd_job *job, const zd_step_options *caller_options, zd_step_result *out) {
  const char *what = "step";
  zd_status status = client__job_check_writable(job, what);
  if (status != ZD_OK)
    return status;
  if (out != NULL && (status = SIZED_OUT_CHECK(out, zd_step_result, step, "step: result",
                                               "ZD_STEP_RESULT_INIT")) != ZD_OK)
    return status;
  zd_step_options options;
  memset(&options, 0, sizeof options);
  if (caller_options != NULL &&
      (status = client__copy_sized_struct(&options, sizeof options, caller_options,
                                          sizeof options.struct_size, "step: options",
                                          "ZD_STEP_OPTIONS_INIT")) != ZD_OK)
    return status;
  Zerod__V1__StepRequest request = ZEROD__V1__STEP_REQUEST__INIT;
  request.set_lr = options.set_lr != 0;
  request.lr = options.lr;
  request.set_max_grad_norm = options.set_max_grad_norm != 0;
  request.max_grad_norm = options.max_grad_norm;
  request.grad_scale = options.grad_scale;
  if (options.ngroup_lr != 0 && options.group_lr == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "step: group_lr is NULL with ngroup_lr %u",
                             options.ngroup_lr);
  request.n_group_lr = options.ngroup_lr;
  request.group_lr = (double *)options.group_lr;
  /* The stalls since the last step; the step's own wait is the daemon's
   * to see. */
  request.worker_wait_ns = job->client->wait_ns;
  job->client->wait_ns = 0;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(job->client, ZEROD__V1__MSG_TYPE__MSG_STEP, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__StepReply *reply = (const Zerod__V1__StepReply *)reply_msg;
  job->version = reply->version;
  job->loss_scale = reply->loss_scale;
  if (out != NULL) {
    zd_step_result result = ZD_STEP_RESULT_INIT;
    result.step = reply->step;
    result.version = reply->version;
    result.grad_norm = reply->grad_norm;
    result.skipped = reply->skipped;
    result.loss_scale = reply->loss_scale;
    client__sized_out_write(out, &result, sizeof result);
  }
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  return client__finish(job->client);
}

zd_status zd_set_groups(zd_job *job, const zd_param_group *groups, unsigned ngroups,
                        const zd_unit *units, const unsigned *const *tensor_groups,
                        unsigned nunits) {
  const char *what = "set groups";
  zd_status status = client__job_check_writable(job, what);
  if (status != ZD_OK)
    return status;
  if (groups == NULL || ngroups == 0 || (nunits != 0 && (units == NULL || tensor_groups == NULL)))
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "%s: groups, units and tensor_groups must be given", what);
  size_t group_stride;
  if ((status = client__sized_array_stride(groups, ngroups, SIZED_THROUGH(zd_param_group, lr),
                                           sizeof(zd_param_group), what, "groups",
                                           "ZD_PARAM_GROUP_INIT", &group_stride)) != ZD_OK)
    return status;
  /* Every unit's indices are read below, so every pointer is checked
   * first: a NULL one would crash the worker. */
  for (unsigned u = 0; u < nunits; u++) {
    if (tensor_groups[u] == NULL)
      return client__set_error(ZD_E_INVALID_ARGUMENT,
                               "%s: tensor_groups[%u] (unit %u) is NULL; pass the group of each "
                               "of the unit's tensors",
                               what, u, (unsigned)units[u]);
    if (client__job_find_unit(job, units[u]) == NULL)
      return client__set_error(ZD_E_NOT_FOUND, "%s: units[%u]: unit %u is not known to this job",
                               what, u, (unsigned)units[u]);
  }
  Zerod__V1__OptimizerConfig *configs = calloc(ngroups, sizeof *configs);
  Zerod__V1__OptimizerConfig **config_ptrs = calloc(ngroups, sizeof *config_ptrs);
  Zerod__V1__UnitGroups *unit_groups = calloc(nunits + 1, sizeof *unit_groups);
  Zerod__V1__UnitGroups **unit_ptrs = calloc(nunits + 1, sizeof *unit_ptrs);
  uint32_t **indices = calloc(nunits + 1, sizeof *indices);
  if (configs == NULL || config_ptrs == NULL || unit_groups == NULL || unit_ptrs == NULL ||
      indices == NULL) {
    status = client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
    goto done;
  }
  for (unsigned g = 0; g < ngroups; g++) {
    zd_param_group group;
    client__sized_array_element(&group, sizeof group, groups, group_stride, g);
    Zerod__V1__OptimizerConfig *c = &configs[g];
    zerod__v1__optimizer_config__init(c);
    c->lr = group.lr;
    c->beta1 = group.beta1;
    c->beta2 = group.beta2;
    c->eps = group.eps;
    c->weight_decay = group.weight_decay;
    c->has_weight_decay = group.has_weight_decay != 0;
    c->momentum = group.momentum;
    c->dampening = group.dampening;
    c->nesterov = group.nesterov != 0;
    config_ptrs[g] = c;
  }
  for (unsigned u = 0; u < nunits; u++) {
    client_unit *unit = client__job_find_unit(job, units[u]);
    indices[u] = calloc(unit->ntensors + 1, sizeof *indices[u]);
    if (indices[u] == NULL) {
      status = client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
      goto done;
    }
    for (unsigned t = 0; t < unit->ntensors; t++)
      indices[u][t] = tensor_groups[u][t];
    zerod__v1__unit_groups__init(&unit_groups[u]);
    unit_groups[u].unit_id = units[u];
    unit_groups[u].n_tensor_group = unit->ntensors;
    unit_groups[u].tensor_group = indices[u];
    unit_ptrs[u] = &unit_groups[u];
  }
  Zerod__V1__SetGroupsRequest request = ZEROD__V1__SET_GROUPS_REQUEST__INIT;
  request.n_groups = ngroups;
  request.groups = config_ptrs;
  request.n_units = nunits;
  request.units = unit_ptrs;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(job->client, ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS_REPLY, what, &reply_msg, fds, &nfds);
  if (status == ZD_OK) {
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    status = client__finish(job->client);
  }
done:
  for (unsigned u = 0; indices != NULL && u < nunits; u++)
    free(indices[u]);
  free(indices);
  free(unit_ptrs);
  free(unit_groups);
  free(config_ptrs);
  free(configs);
  return status;
}

zd_status zd_grad_norm(zd_job *job, double grad_scale, double *norm) {
  const char *what = "grad_norm";
  zd_status status = client__job_check_writable(job, what);
  if (status != ZD_OK)
    return status;
  if (norm == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "%s: norm must not be NULL", what);
  Zerod__V1__GradNormRequest request = ZEROD__V1__GRAD_NORM_REQUEST__INIT;
  request.grad_scale = grad_scale;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(job->client, ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  *norm = ((const Zerod__V1__GradNormReply *)reply_msg)->grad_norm;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  return client__finish(job->client);
}

static zd_status checkpoint_call(zd_job *job, Zerod__V1__CheckpointAction action, const char *name,
                                 zd_checkpoint_info *info, const char *what) {
  zd_status status = client__job_check_writable(job, what);
  if (status != ZD_OK)
    return status;
  if (info != NULL && (status = SIZED_OUT_CHECK(info, zd_checkpoint_info, name, what,
                                                "ZD_CHECKPOINT_INFO_INIT")) != ZD_OK)
    return status;
  int restore = action == ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_RESTORE;
  /* A restore lets go of the units the worker held gathered once the
   * daemon starts it, which a failed restore may or may not have reached:
   * until it succeeds, a release is left for the daemon to judge. */
  for (size_t u = 0; restore && u < job->unit_count; u++) {
    if (job->units[u].gather_hold == GATHER_HOLD_HELD)
      job->units[u].gather_hold = GATHER_HOLD_UNSURE;
  }
  Zerod__V1__CheckpointRequest request = ZEROD__V1__CHECKPOINT_REQUEST__INIT;
  request.action = action;
  request.name = (char *)(name != NULL ? name : "");
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(job->client, ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__CheckpointReply *reply = (const Zerod__V1__CheckpointReply *)reply_msg;
  if (info != NULL) {
    zd_checkpoint_info result = ZD_CHECKPOINT_INFO_INIT;
    snprintf(result.name, sizeof result.name, "%s", reply->name);
    result.step = reply->step;
    result.stall_ms = reply->stall_ms;
    result.total_ms = reply->total_ms;
    client__sized_out_write(info, &result, sizeof result);
  }
  /* A restore made a new version (0: a daemon that does not say). */
  if (reply->version != 0)
    job->version = reply->version;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  /* A restore let go of the units the worker held gathered: a stable
   * range stops mapping the daemon's buffers, as zd_release does. */
  for (size_t u = 0; restore && u < job->unit_count; u++) {
    client_unit *unit = &job->units[u];
    if (job->stable_addresses && unit->held_gather_buffer != 0)
      (void)client__unit_cover_range(unit, what);
    unit->held_gather_buffer = 0;
    unit->gather_hold = GATHER_HOLD_NONE;
  }
  return client__finish(job->client);
}

zd_status zd_checkpoint_save(zd_job *job, const char *name, zd_checkpoint_info *info) {
  return checkpoint_call(job, ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_SAVE, name, info,
                         "checkpoint save");
}

zd_status zd_checkpoint_restore(zd_job *job, const char *name, zd_checkpoint_info *info) {
  if (name == NULL || name[0] == '\0')
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "checkpoint restore: name the checkpoint to restore");
  return checkpoint_call(job, ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_RESTORE, name, info,
                         "checkpoint restore");
}

zd_status zd_detach(zd_job *job) {
  char what[96];
  snprintf(what, sizeof what, "detach job %s", job != NULL ? job->name : "(null)");
  zd_status status = client__job_check(job, what);
  if (status != ZD_OK)
    return status;
  Zerod__V1__DetachRequest request = ZEROD__V1__DETACH_REQUEST__INIT;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(job->client, ZEROD__V1__MSG_TYPE__MSG_DETACH, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_DETACH_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  job->attached = 0;
  client__close_cuda_buffers(job->client);
  return client__finish(job->client);
}
