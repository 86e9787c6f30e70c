/* libzerod's attach (client_impl.h): the job config sent and the
 * effective one read back, the job handle's accessors, and its unit table. */
#include "client_impl.h"

void client__unit_free(client_unit *unit) {
  if (unit->tensor_names != NULL) {
    for (unsigned t = 0; t < unit->ntensors; t++)
      free(unit->tensor_names[t]);
  }
  free(unit->tensor_names);
  free(unit->shapes);
  free(unit->gather_tensors);
  free(unit->grad_tensors);
  free(unit->info_tensors);
  free(unit->name);
  free(unit->delta_bits);
  if (unit->stable_base != NULL)
    munmap(unit->stable_base, unit->stable_bytes);
}

void client__job_free(zd_job *job) {
  for (size_t u = 0; u < job->unit_count; u++)
    client__unit_free(&job->units[u]);
  free(job->units);
  free(job->name);
  free(job->attach_warning);
  free(job->changed);
  free(job);
}

/* ------------------------------------------------------------------------
 * Attach
 * ------------------------------------------------------------------------ */

/* Translates the caller's job config into the protocol's. Every enum is
 * checked here so that a typo fails locally with a message, rather than as
 * an undecodable frame on the daemon's side. */
static zd_status fill_job_config(const zd_job_config *caller_config, Zerod__V1__JobConfig *config,
                                 Zerod__V1__OptimizerConfig *optimizer,
                                 Zerod__V1__OffloadConfig *offload, char *nvme_path,
                                 size_t nvme_path_bytes, char *base_job, size_t base_job_bytes) {
  zd_job_config local;
  zd_status status =
      client__copy_sized_struct(&local, sizeof local, caller_config, sizeof local.struct_size,
                                "attach: config", "ZD_JOB_CONFIG_INIT");
  if (status != ZD_OK)
    return status;
  if ((int)local.optimizer < 0 || local.optimizer > ZD_SGD)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "attach: config.optimizer %d is not ZD_ADAMW, ZD_ADAM or ZD_SGD",
                             (int)local.optimizer);
  if ((int)local.working_dtype < 0 || local.working_dtype > ZD_F16)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "attach: config.working_dtype %d is not ZD_F32, ZD_BF16 or ZD_F16",
                             (int)local.working_dtype);
  optimizer->kind = (Zerod__V1__OptimizerKind)local.optimizer;
  optimizer->lr = local.lr;
  optimizer->beta1 = local.beta1;
  optimizer->beta2 = local.beta2;
  optimizer->eps = local.eps;
  optimizer->weight_decay = local.weight_decay;
  optimizer->has_weight_decay = local.has_weight_decay != 0;
  optimizer->momentum = local.momentum;
  optimizer->dampening = local.dampening;
  optimizer->nesterov = local.nesterov != 0;
  config->optimizer = optimizer;
  config->working_dtype = (Zerod__V1__Dtype)local.working_dtype;
  config->max_live_bytes = local.max_live_bytes;
  config->max_grad_norm = local.max_grad_norm;
  if ((int)local.collectives < 0 || local.collectives > ZD_COLLECTIVES_FLAT)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "attach: config.collectives %d is not ZD_COLLECTIVES_HIERARCHICAL or "
                             "ZD_COLLECTIVES_FLAT",
                             (int)local.collectives);
  config->collectives = (Zerod__V1__Collectives)local.collectives;
  config->quantized_weights = local.quantized_weights != 0;
  config->quantization_block = local.quantization_block;
  config->quantized_gradients = local.quantized_gradients;
  config->gradient_comm_dtype = (Zerod__V1__Dtype)local.gradient_comm_dtype;
  config->hpz_partition_size = local.hpz_partition_size;
  config->onebit_freeze_step = local.onebit_freeze_step;
  config->powersgd_rank = local.powersgd_rank;
  config->powersgd_start_step = local.powersgd_start_step;
  config->loss_scale = local.loss_scale;
  config->loss_scale_window = local.loss_scale_window;
  config->loss_scale_growth = local.loss_scale_growth;
  config->loss_scale_backoff = local.loss_scale_backoff;
  config->loss_scale_hysteresis = local.loss_scale_hysteresis;
  config->loss_scale_min = local.loss_scale_min;
  if ((int)local.offload_device < 0 || local.offload_device > ZD_OFFLOAD_NVME)
    return client__set_error(
        ZD_E_INVALID_ARGUMENT,
        "attach: config.offload_device %d is not ZD_OFFLOAD_NONE, ZD_OFFLOAD_CPU or "
        "ZD_OFFLOAD_NVME",
        (int)local.offload_device);
  if (memchr(local.nvme_path, '\0', sizeof local.nvme_path) == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "attach: config.nvme_path is not NUL-terminated");
  snprintf(nvme_path, nvme_path_bytes, "%s", local.nvme_path);
  offload->device = (Zerod__V1__OffloadDevice)local.offload_device;
  offload->nvme_path = nvme_path;
  offload->buffer_count = local.offload_buffer_count;
  offload->buffer_size = local.offload_buffer_size;
  offload->pin_memory = local.offload_pin_memory != 0;
  config->offload_optimizer = offload;
  if (memchr(local.base_job, '\0', sizeof local.base_job) == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "attach: config.base_job is not NUL-terminated");
  snprintf(base_job, base_job_bytes, "%s", local.base_job);
  config->base_job = base_job;
  return ZD_OK;
}

/* The reverse of fill_job_config: the job's effective config from an
 * AttachReply (a daemon sends it with every default filled in; one that
 * sent none leaves every field zero, which zd_job_config documents as the
 * defaults). */
static void job_config_from_reply(const Zerod__V1__JobConfig *config, zd_job_config *out) {
  memset(out, 0, sizeof *out);
  out->struct_size = sizeof *out;
  if (config == NULL)
    return;
  const Zerod__V1__OptimizerConfig *optimizer = config->optimizer;
  if (optimizer != NULL) {
    out->optimizer = optimizer->kind == ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_UNSPECIFIED
                         ? ZD_ADAMW
                         : (zd_optimizer)optimizer->kind;
    out->lr = optimizer->lr;
    out->beta1 = optimizer->beta1;
    out->beta2 = optimizer->beta2;
    out->eps = optimizer->eps;
    out->weight_decay = optimizer->weight_decay;
    out->has_weight_decay = optimizer->has_weight_decay;
    out->momentum = optimizer->momentum;
    out->dampening = optimizer->dampening;
    out->nesterov = optimizer->nesterov;
  }
  out->working_dtype = config->working_dtype == ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED
                           ? ZD_F32
                           : (zd_dtype)config->working_dtype;
  out->max_live_bytes = config->max_live_bytes;
  out->max_grad_norm = config->max_grad_norm;
  out->collectives = config->collectives == ZEROD__V1__COLLECTIVES__COLLECTIVES_UNSPECIFIED
                         ? ZD_COLLECTIVES_HIERARCHICAL
                         : (zd_collectives)config->collectives;
  out->quantized_weights = config->quantized_weights;
  out->quantization_block = config->quantization_block;
  out->quantized_gradients = config->quantized_gradients;
  out->gradient_comm_dtype = config->gradient_comm_dtype == ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED
                                 ? ZD_F32
                                 : (zd_dtype)config->gradient_comm_dtype;
  out->hpz_partition_size = config->hpz_partition_size;
  out->onebit_freeze_step = config->onebit_freeze_step;
  out->powersgd_rank = config->powersgd_rank;
  out->powersgd_start_step = config->powersgd_start_step;
  out->loss_scale = config->loss_scale;
  out->loss_scale_window = config->loss_scale_window;
  out->loss_scale_growth = config->loss_scale_growth;
  out->loss_scale_backoff = config->loss_scale_backoff;
  out->loss_scale_hysteresis = config->loss_scale_hysteresis;
  out->loss_scale_min = config->loss_scale_min;
  const Zerod__V1__OffloadConfig *offload = config->offload_optimizer;
  if (offload != NULL) {
    out->offload_device = offload->device == ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_UNSPECIFIED
                              ? ZD_OFFLOAD_NONE
                              : (zd_offload_device)offload->device;
    snprintf(out->nvme_path, sizeof out->nvme_path, "%s", offload->nvme_path);
    out->offload_buffer_count = offload->buffer_count;
    out->offload_buffer_size = offload->buffer_size;
    out->offload_pin_memory = offload->pin_memory;
  }
  snprintf(out->base_job, sizeof out->base_job, "%s",
           config->base_job != NULL ? config->base_job : "");
}

/* The owner token an attach sends: the caller's (even ""), else
 * $ZEROD_TOKEN (how Kubernetes hands a worker its job's token), else none
 * (NULL). */
static const char *token_or_env(const char *token) {
  return token != NULL ? token : getenv("ZEROD_TOKEN");
}

zd_status zd_attach(zd_client *client, const zd_attach_options *caller_options, zd_job **out) {
  if (client == NULL || caller_options == NULL || out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "attach: client, options and out must not be NULL");
  *out = NULL;
  zd_attach_options options;
  zd_status status =
      client__copy_sized_struct(&options, sizeof options, caller_options,
                                offsetof(zd_attach_options, job) + sizeof options.job,
                                "attach: options", "ZD_ATTACH_OPTIONS_INIT");
  if (status != ZD_OK)
    return status;
  if (options.job == NULL || options.job[0] == '\0' || strlen(options.job) > ZD_MAX_JOB_NAME_BYTES)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "attach: job name must be 1..%d bytes",
                             ZD_MAX_JOB_NAME_BYTES);
  int from_env = options.token == NULL;
  options.token = token_or_env(options.token);
  if (options.token != NULL && strlen(options.token) > ZD_MAX_TOKEN_BYTES)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "attach: token%s longer than %d bytes",
                             from_env ? " (from ZEROD_TOKEN)" : "", ZD_MAX_TOKEN_BYTES);
  char what[128];
  snprintf(what, sizeof what, "attach job %s", options.job);
  if (client->dead)
    return client__dead_error(client, what);
  for (zd_job *job = client->jobs; job != NULL; job = job->next) {
    if (job->attached)
      return client__set_error(ZD_E_FAILED_PRECONDITION,
                               "%s: this connection is already attached to job %s (one job per "
                               "connection: use zd_connect again)",
                               what, job->name);
  }

  Zerod__V1__AttachRequest request = ZEROD__V1__ATTACH_REQUEST__INIT;
  Zerod__V1__JobConfig config = ZEROD__V1__JOB_CONFIG__INIT;
  Zerod__V1__OptimizerConfig optimizer = ZEROD__V1__OPTIMIZER_CONFIG__INIT;
  Zerod__V1__OffloadConfig offload = ZEROD__V1__OFFLOAD_CONFIG__INIT;
  char nvme_path[256], base_job[ZD_MAX_JOB_NAME_BYTES + 1];
  request.protocol_version = 1;
  request.job = (char *)options.job;
  request.local_rank = options.local_rank;
  request.token = (char *)(options.token != NULL ? options.token : "");
  int read_only = options.read_only != 0;
  request.mode = read_only ? ZEROD__V1__ATTACH_MODE__ATTACH_READ_ONLY
                           : ZEROD__V1__ATTACH_MODE__ATTACH_READ_WRITE;
  request.create = options.create != ZD_ATTACH_EXISTING;
  request.fresh = options.create == ZD_CREATE_FRESH;
  request.world_size = options.world_size;
  request.pin = options.pin != 0;
  if (options.config != NULL) {
    if ((status = fill_job_config(options.config, &config, &optimizer, &offload, nvme_path,
                                  sizeof nvme_path, base_job, sizeof base_job)) != ZD_OK)
      return status;
    request.config = &config;
  }

  zd_job *job = calloc(1, sizeof *job);
  char *name = strdup(options.job);
  if (job == NULL || name == NULL) {
    free(job);
    free(name);
    return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
  }
  job->name = name;

  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(client, ZEROD__V1__MSG_TYPE__MSG_ATTACH, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK) {
    client__job_free(job);
    return status;
  }
  const Zerod__V1__AttachReply *reply = (const Zerod__V1__AttachReply *)reply_msg;
  if ((reply->read_only != 0) != read_only) {
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    client__job_free(job);
    return client__protocol_error(client, what, "asked for a %s attachment, the reply says %s",
                                  read_only ? "read-only" : "read-write",
                                  read_only ? "read-write" : "read-only");
  }
  /* A read-only session takes no rank, so its rank says nothing. */
  if (!read_only && (reply->world_size == 0 || reply->rank >= reply->world_size)) {
    unsigned rank = reply->rank, world_size = reply->world_size;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    client__job_free(job);
    return client__protocol_error(client, what, "rank %u out of world size %u", rank, world_size);
  }
  job->client = client;
  job->attached = 1;
  job->read_only = read_only;
  /* The protocol ignores `pin` for read-write sessions; so does the job. */
  job->pinned = read_only && options.pin;
  job->stable_addresses = options.stable_addresses != 0;
  job->rank = reply->rank;
  job->world_size = reply->world_size;
  job->version = job->pinned ? reply->pinned_version : reply->version;
  job->loss_scale = reply->loss_scale;
  job_config_from_reply(reply->config, &job->config);
  if (reply->warning != NULL && reply->warning[0] != '\0' &&
      (job->attach_warning = strdup(reply->warning)) == NULL) {
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    client__job_free(job);
    return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
  }
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  job->next = client->jobs;
  client->jobs = job;
  *out = job;
  return client__finish(client);
}

unsigned zd_job_rank(const zd_job *job) {
  return job != NULL ? job->rank : 0;
}

unsigned zd_job_world_size(const zd_job *job) {
  return job != NULL ? job->world_size : 0;
}

uint64_t zd_job_version(const zd_job *job) {
  return job != NULL ? job->version : 0;
}

double zd_job_loss_scale(const zd_job *job) {
  return job != NULL ? job->loss_scale : 0;
}

int zd_job_read_only(const zd_job *job) {
  return job != NULL ? job->read_only : 0;
}

zd_status zd_job_effective_config(const zd_job *job, zd_job_config *out) {
  if (job == NULL || out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "job config: job and out must not be NULL");
  /* The caller's struct_size says how much of the struct it has: the
   * fields that fit are written (client_sized.c). */
  zd_status status =
      SIZED_OUT_CHECK(out, zd_job_config, optimizer, "job config", "ZD_JOB_CONFIG_INIT");
  if (status != ZD_OK)
    return status;
  client__sized_out_write(out, &job->config, sizeof job->config);
  return ZD_OK;
}

const char *zd_job_attach_warning(const zd_job *job) {
  return job != NULL ? job->attach_warning : NULL;
}

/* Common entry checks of the calls on an attached job. */
zd_status client__job_check(const zd_job *job, const char *what) {
  if (job == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "%s: job is NULL", what);
  if (job->client->dead)
    return client__dead_error(job->client, what);
  if (!job->attached)
    return client__set_error(ZD_E_FAILED_PRECONDITION, "%s: job %s is detached", what, job->name);
  return ZD_OK;
}

/* The entry check of the calls that change the job (registration,
 * gradients, reduce, step, load): a read-only job is refused here, without
 * a round trip, with the reason. */
zd_status client__job_check_writable(const zd_job *job, const char *what) {
  zd_status status = client__job_check(job, what);
  if (status != ZD_OK)
    return status;
  if (job->read_only)
    return client__set_error(
        ZD_E_PERMISSION_DENIED,
        "%s: job %s is attached read-only; registering units, gradient buffers, "
        "reduce, step and load need a read-write attachment",
        what, job->name);
  return ZD_OK;
}

client_unit *client__job_find_unit(zd_job *job, zd_unit unit_id) {
  /* Daemons hand out small dense ids, so the id is tried as an index first;
   * the table is sorted by id, so a binary search covers any other
   * numbering (a read-only job may list only some units, say). */
  if (unit_id < job->unit_count && job->units[unit_id].unit_id == unit_id)
    return &job->units[unit_id];
  size_t low = 0, high = job->unit_count;
  while (low < high) {
    size_t middle = low + (high - low) / 2;
    if (job->units[middle].unit_id < unit_id)
      low = middle + 1;
    else
      high = middle;
  }
  return low < job->unit_count && job->units[low].unit_id == unit_id ? &job->units[low] : NULL;
}

/* The entry of every call on one unit: names the call in `what` ("<verb>
 * unit N"), checks the job (refusing a read-only one when `writable`) and
 * finds the unit. */
zd_status client__unit_call_begin(zd_job *job, zd_unit unit_id, const char *verb, int writable,
                                  char *what, size_t what_bytes, client_unit **unit) {
  snprintf(what, what_bytes, "%s unit %u", verb, (unsigned)unit_id);
  zd_status status =
      writable ? client__job_check_writable(job, what) : client__job_check(job, what);
  if (status != ZD_OK)
    return status;
  *unit = client__job_find_unit(job, unit_id);
  /* The daemon's answer for an id it does not know (client_status.c). */
  if (*unit == NULL)
    return client__set_error(ZD_E_NOT_FOUND, "%s: no such unit known to this job", what);
  return ZD_OK;
}

/* Makes room for `more` units, before the request whose reply adds them. */
zd_status client__job_reserve_units(zd_job *job, size_t more, const char *what) {
  if (job->unit_capacity - job->unit_count >= more)
    return ZD_OK;
  size_t capacity = job->unit_capacity ? job->unit_capacity : 16;
  while (capacity - job->unit_count < more)
    capacity *= 2;
  client_unit *units = realloc(job->units, capacity * sizeof *units);
  if (units == NULL)
    return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
  job->units = units;
  job->unit_capacity = capacity;
  return ZD_OK;
}

/* Adds a unit in id order (room was reserved). Views never point at a
 * client_unit itself, only at its separately allocated tables, so moving
 * entries is safe. */
void client__job_insert_unit(zd_job *job, const client_unit *unit) {
  size_t at = job->unit_count;
  while (at > 0 && job->units[at - 1].unit_id > unit->unit_id)
    at--;
  memmove(&job->units[at + 1], &job->units[at], (job->unit_count - at) * sizeof *job->units);
  job->units[at] = *unit;
  job->unit_count++;
}

unsigned zd_job_unit_count(const zd_job *job) {
  return job != NULL ? (unsigned)job->unit_count : 0;
}

zd_status zd_job_unit_info(const zd_job *job, unsigned index, zd_unit_info *out) {
  if (job == NULL || out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "unit info: job and out must not be NULL");
  zd_status status = SIZED_OUT_CHECK(out, zd_unit_info, unit, "unit info", "ZD_UNIT_INFO_INIT");
  if (status != ZD_OK)
    return status;
  if (index >= job->unit_count)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "unit info: index %u is past the %zu units job %s knows (see "
                             "zd_job_unit_count)",
                             index, job->unit_count, job->name);
  const client_unit *unit = &job->units[index];
  zd_unit_info info = ZD_UNIT_INFO_INIT;
  info.unit = unit->unit_id;
  info.name = unit->name;
  info.ntensors = unit->ntensors;
  info.tensors = unit->info_tensors;
  info.numel = unit->numel;
  info.padded_numel = unit->padded_numel;
  info.dtype = unit->working_dtype;
  client__sized_out_write(out, &info, sizeof info);
  return ZD_OK;
}
