/* zerodctl_create: `jobs create` (zerodctl_impl.h).
 *
 * Turns the options as given (create_options) into a CreateJobRequest,
 * checking each against the same ranges the coordinator and the nodes
 * apply, so that a mistake is a usage error naming the option; then
 * creates the job and prints it with its owner token. A DeepSpeed config
 * (--deepspeed-config) fills the job's config first and the options given
 * override it. Calls zerodctl_deepspeed.c (the file read), zerodctl_jobs.c
 * (how a job prints), zerodctl_args.c, zerodctl_call.c and
 * zerodctl_output.c. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "size.h"
#include "zerodctl_deepspeed.h"
#include "zerodctl_impl.h"

static int bad_create_value(const char *option, const char *value, const char *expected) {
  return ctl__usage_error("jobs create: invalid %s '%s': expected %s", option, value, expected);
}

/* Splits the --node lists into names (checked, no duplicates). */
static int collect_node_names(const create_options *o,
                              char names[CTL_MAX_NODES][CTL_NAME_MAX_BYTES + 1], size_t *n_names) {
  *n_names = 0;
  for (size_t l = 0; l < o->n_node_lists; l++) {
    const char *p = o->node_lists[l];
    for (;;) {
      size_t len = strcspn(p, ",");
      char name[CTL_NAME_MAX_BYTES + 1];
      if (len > CTL_NAME_MAX_BYTES)
        return bad_create_value("--node", o->node_lists[l],
                                "node names of 1..64 characters [A-Za-z0-9._-], comma-separated");
      memcpy(name, p, len);
      name[len] = '\0';
      if (!ctl__valid_name(name))
        return bad_create_value("--node", o->node_lists[l],
                                "node names of 1..64 characters [A-Za-z0-9._-], comma-separated");
      for (size_t k = 0; k < *n_names; k++)
        if (strcmp(names[k], name) == 0)
          return ctl__usage_error("jobs create: node '%s' is named twice", name);
      if (*n_names == CTL_MAX_NODES)
        return ctl__usage_error("jobs create: more than %d nodes", CTL_MAX_NODES);
      memcpy(names[(*n_names)++], name, len + 1);
      if (p[len] == '\0')
        break;
      p += len + 1;
    }
  }
  return 0;
}

/* --nodes, --ranks-per-node and --node: where the job's ranks go. The
 * names are kept in names, which request points into. */
static int create_placement(const create_options *o, Zerod__V1__CreateJobRequest *request,
                            char names[CTL_MAX_NODES][CTL_NAME_MAX_BYTES + 1],
                            char *name_ptrs[CTL_MAX_NODES]) {
  /* On a base, what is not given is the base's (0: the coordinator
   * fills it in). */
  request->nodes = o->base != NULL ? 0 : 1;
  request->ranks_per_node = o->base != NULL ? 0 : 1;
  if (o->nodes != NULL && ctl__parse_u32(o->nodes, 1, CTL_MAX_NODES, &request->nodes) != 0)
    return bad_create_value("--nodes", o->nodes, "an integer 1..64");
  if (o->ranks_per_node != NULL &&
      ctl__parse_u32(o->ranks_per_node, 1, CTL_MAX_RANKS, &request->ranks_per_node) != 0)
    return bad_create_value("--ranks-per-node", o->ranks_per_node, "an integer 1..64");
  size_t n_names = 0;
  int rc = collect_node_names(o, names, &n_names);
  if (rc != 0)
    return rc;
  if (n_names > 0) {
    if (o->nodes == NULL)
      request->nodes = (uint32_t)n_names;
    else if (request->nodes != n_names)
      return ctl__usage_error("jobs create: --nodes %" PRIu32
                              " does not match the %zu nodes named by --node",
                              request->nodes, n_names);
    for (size_t i = 0; i < n_names; i++)
      name_ptrs[i] = names[i];
    request->n_node_names = n_names;
    request->node_names = name_ptrs;
  }
  if ((uint64_t)request->nodes * request->ranks_per_node > CTL_MAX_RANKS)
    return ctl__usage_error("jobs create: %" PRIu32 " nodes x %" PRIu32
                            " ranks is a world of more than %d ranks",
                            request->nodes, request->ranks_per_node, CTL_MAX_RANKS);
  return 0;
}

/* --deepspeed-config: the file read into config and offload (ds keeps
 * what they point into); what it ignores is listed on stderr. */
static int create_deepspeed(const char *file, Zerod__V1__JobConfig *config,
                            Zerod__V1__OffloadConfig *offload, ctl_deepspeed *ds) {
  FILE *f = fopen(file, "rb");
  if (f == NULL)
    return ctl__usage_error("jobs create: --deepspeed-config '%s': %s", file, strerror(errno));
  char *text = malloc(CTL_DS_MAX_BYTES + 1);
  size_t len = text != NULL ? fread(text, 1, CTL_DS_MAX_BYTES + 1, f) : 0;
  int failed = text == NULL || ferror(f);
  fclose(f);
  int rc = 0;
  if (failed)
    rc = ctl__usage_error("jobs create: --deepspeed-config '%s': cannot read it", file);
  else if (len > CTL_DS_MAX_BYTES)
    rc = ctl__usage_error("jobs create: --deepspeed-config '%s': larger than %d bytes", file,
                          CTL_DS_MAX_BYTES);
  else if (ctl__deepspeed_read(text, len, config, offload, ds) != 0)
    rc = ctl__usage_error("jobs create: --deepspeed-config '%s': %s", file, ds->error);
  free(text);
  if (rc != 0)
    return rc;
  if (ds->ignored != NULL) {
    ctl__sanitize_line(ds->ignored);
    fprintf(stderr, "zerodctl: ignored DeepSpeed keys: %s\n", ds->ignored);
  }
  if (ds->note[0] != '\0')
    fprintf(stderr, "zerodctl: note: %s\n", ds->note);
  return 0;
}

/* --optimizer and its hyper-parameters (each kind's own); a DeepSpeed
 * config's kind stays unless --optimizer is given. */
static int create_optimizer(const create_options *o, Zerod__V1__OptimizerConfig *optimizer) {
  if (optimizer->kind == ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_UNSPECIFIED)
    optimizer->kind = ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAMW;
  if (o->optimizer != NULL) {
    if (strcmp(o->optimizer, "adamw") == 0)
      optimizer->kind = ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAMW;
    else if (strcmp(o->optimizer, "adam") == 0)
      optimizer->kind = ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAM;
    else if (strcmp(o->optimizer, "sgd") == 0)
      optimizer->kind = ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD;
    else
      return bad_create_value("--optimizer", o->optimizer, "adamw, adam or sgd");
  }
  bool sgd = optimizer->kind == ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD;
  if (o->lr != NULL && ctl__parse_double(o->lr, 0, 1e6, false, &optimizer->lr) != 0)
    return bad_create_value("--lr", o->lr, "a number > 0");
  if (o->lr != NULL && optimizer->lr == 0)
    return bad_create_value("--lr", o->lr, "a number > 0");
  if (o->weight_decay != NULL) {
    if (ctl__parse_double(o->weight_decay, 0, 1e6, false, &optimizer->weight_decay) != 0)
      return bad_create_value("--weight-decay", o->weight_decay, "a number >= 0");
    optimizer->has_weight_decay = true;
  }
  if (o->betas != NULL) {
    if (sgd)
      return ctl__usage_error("jobs create: --betas applies to adamw and adam, not sgd");
    char betas[64];
    const char *comma = strchr(o->betas, ',');
    if (strlen(o->betas) >= sizeof betas || comma == NULL)
      return bad_create_value("--betas", o->betas, "B1,B2, each in [0, 1)");
    snprintf(betas, sizeof betas, "%s", o->betas);
    betas[comma - o->betas] = '\0';
    if (ctl__parse_double(betas, 0, 1, true, &optimizer->beta1) != 0 ||
        ctl__parse_double(betas + (comma - o->betas) + 1, 0, 1, true, &optimizer->beta2) != 0)
      return bad_create_value("--betas", o->betas, "B1,B2, each in [0, 1)");
  }
  if (o->eps != NULL) {
    if (sgd)
      return ctl__usage_error("jobs create: --eps applies to adamw and adam, not sgd");
    if (ctl__parse_double(o->eps, 0, 1, false, &optimizer->eps) != 0 || optimizer->eps == 0)
      return bad_create_value("--eps", o->eps, "a number in (0, 1]");
  }
  if (o->momentum != NULL) {
    if (!sgd)
      return ctl__usage_error("jobs create: --momentum applies to sgd only (use --optimizer sgd)");
    if (ctl__parse_double(o->momentum, 0, 1, true, &optimizer->momentum) != 0)
      return bad_create_value("--momentum", o->momentum, "a number in [0, 1)");
  }
  return 0;
}

/* How the job computes and communicates: --precision, --collectives, the
 * ZeRO++ options (qwZ, qgZ, hpZ) and --gradient-comm-dtype. */
static int create_numerics(const create_options *o, Zerod__V1__JobConfig *config) {
  /* On a base, the base's unless given (here or in a DeepSpeed config). */
  if (config->working_dtype == ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED && o->base == NULL)
    config->working_dtype = ZEROD__V1__DTYPE__DTYPE_F32;
  if (o->precision != NULL) {
    if (strcmp(o->precision, "fp32") == 0)
      config->working_dtype = ZEROD__V1__DTYPE__DTYPE_F32;
    else if (strcmp(o->precision, "bf16") == 0)
      config->working_dtype = ZEROD__V1__DTYPE__DTYPE_BF16;
    else if (strcmp(o->precision, "fp16") == 0)
      config->working_dtype = ZEROD__V1__DTYPE__DTYPE_F16; /* with dynamic loss scaling */
    else
      return bad_create_value("--precision", o->precision, "fp32, bf16 or fp16");
  }
  if (o->collectives != NULL) {
    if (strcmp(o->collectives, "hierarchical") == 0)
      config->collectives = ZEROD__V1__COLLECTIVES__COLLECTIVES_HIERARCHICAL;
    else if (strcmp(o->collectives, "flat") == 0)
      config->collectives = ZEROD__V1__COLLECTIVES__COLLECTIVES_FLAT;
    else
      return bad_create_value("--collectives", o->collectives, "hierarchical or flat");
  }
  if (o->quantized_weights != NULL)
    config->quantized_weights = true;
  if (o->quantization_block != NULL) {
    double block;
    if (ctl__parse_double(o->quantization_block, 2, 1 << 20, false, &block) != 0 ||
        block != (uint32_t)block || (uint32_t)block % 2 != 0)
      return bad_create_value("--quantization-block", o->quantization_block,
                              "an even number of elements, 2..1048576");
    config->quantization_block = (uint32_t)block;
  }
  if (o->quantized_gradients != NULL) {
    if (strcmp(o->quantized_gradients, "8") == 0)
      config->quantized_gradients = 8;
    else if (strcmp(o->quantized_gradients, "4") == 0)
      config->quantized_gradients = 4;
    else
      return bad_create_value("--quantized-gradients", o->quantized_gradients, "8 or 4 (bits)");
  }
  if (o->gradient_comm_dtype != NULL) {
    if (strcmp(o->gradient_comm_dtype, "fp32") == 0)
      config->gradient_comm_dtype = ZEROD__V1__DTYPE__DTYPE_F32;
    else if (strcmp(o->gradient_comm_dtype, "bf16") == 0)
      config->gradient_comm_dtype = ZEROD__V1__DTYPE__DTYPE_BF16;
    else
      return bad_create_value("--gradient-comm-dtype", o->gradient_comm_dtype, "fp32 or bf16");
  }
  if (o->hpz_partition_size != NULL) {
    if (ctl__parse_u32(o->hpz_partition_size, 1, CTL_MAX_RANKS, &config->hpz_partition_size) != 0)
      return bad_create_value("--hpz-partition-size", o->hpz_partition_size,
                              "1 (off) or the job's ranks per node");
  }
  if (o->onebit_freeze_step != NULL &&
      ctl__parse_u32(o->onebit_freeze_step, 1, UINT32_MAX, &config->onebit_freeze_step) != 0)
    return bad_create_value("--onebit-adam", o->onebit_freeze_step,
                            "the exact steps before compression (1 or more)");
  if (o->powersgd_rank != NULL &&
      ctl__parse_u32(o->powersgd_rank, 1, UINT32_MAX, &config->powersgd_rank) != 0)
    return bad_create_value("--powersgd-rank", o->powersgd_rank,
                            "the rank of the approximation (1 or more)");
  if (o->powersgd_start_step != NULL &&
      ctl__parse_u32(o->powersgd_start_step, 0, UINT32_MAX, &config->powersgd_start_step) != 0)
    return bad_create_value("--powersgd-start", o->powersgd_start_step,
                            "the exact steps before the compression (0 or more)");
  return 0;
}

/* --offload-optimizer and its staging buffers; config points to offload
 * when the option is given. */
static int create_offload(const create_options *o, Zerod__V1__JobConfig *config,
                          Zerod__V1__OffloadConfig *offload) {
  if (o->offload != NULL) {
    if (strcmp(o->offload, "none") == 0)
      offload->device = ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NONE;
    else if (strcmp(o->offload, "cpu") == 0)
      offload->device = ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_CPU;
    else if (strcmp(o->offload, "nvme") == 0)
      offload->device = ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME;
    else
      return bad_create_value("--offload-optimizer", o->offload, "none, cpu or nvme");
    config->offload_optimizer = offload;
  }
  if (o->nvme_path != NULL && offload->device != ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME)
    return ctl__usage_error("jobs create: --nvme-path needs --offload-optimizer nvme");
  if ((o->offload_buffer_count != NULL || o->offload_buffer_size != NULL ||
       o->offload_pin_memory != NULL) &&
      offload->device != ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME &&
      offload->device != ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_CPU)
    return ctl__usage_error("jobs create: --offload-buffer-* and --offload-pin-memory need "
                            "--offload-optimizer cpu or nvme");
  if (o->offload_pin_memory != NULL)
    offload->pin_memory = true;
  if (o->nvme_path != NULL)
    offload->nvme_path = (char *)o->nvme_path;
  if (o->offload_buffer_count != NULL &&
      ctl__parse_u32(o->offload_buffer_count, 2, 64, &offload->buffer_count) != 0)
    return bad_create_value("--offload-buffer-count", o->offload_buffer_count, "2..64");
  if (o->offload_buffer_size != NULL) {
    double elements;
    if (ctl__parse_double(o->offload_buffer_size, 1024, 268435456, false, &elements) != 0 ||
        elements != (double)(uint64_t)elements || (uint64_t)elements % 1024 != 0)
      return bad_create_value("--offload-buffer-size", o->offload_buffer_size,
                              "elements, a multiple of 1024");
    offload->buffer_size = (uint64_t)elements;
  }
  return 0;
}

/* --max-grad-norm, and the per-rank budgets and quotas (request points to
 * quotas when one is given). */
static int create_limits(const create_options *o, Zerod__V1__JobConfig *config,
                         Zerod__V1__Quotas *quotas, Zerod__V1__CreateJobRequest *request) {
  if (o->max_grad_norm != NULL &&
      ctl__parse_double(o->max_grad_norm, 0, 1e12, false, &config->max_grad_norm) != 0)
    return bad_create_value("--max-grad-norm", o->max_grad_norm, "a number >= 0 (0: off)");
  if (o->max_live_bytes != NULL) {
    uint64_t bytes;
    if (size_parse(o->max_live_bytes, &bytes) != 0)
      return bad_create_value("--max-live-bytes", o->max_live_bytes, "a size such as 512M or 4G");
    /* Both fields carry the same per-rank budget (ipc.proto's JobConfig and
     * control.proto's Quotas); set both so that the job's config, as the
     * nodes receive it, agrees with its quota. */
    config->max_live_bytes = bytes;
    quotas->max_live_bytes = bytes;
    request->quotas = quotas;
  }
  const struct {
    const char *value, *flag;
    uint64_t *field;
  } byte_quotas[] = {{o->max_host_bytes, "--max-host-bytes", &quotas->max_host_bytes},
                     {o->max_device_bytes, "--max-device-bytes", &quotas->max_device_bytes}};
  for (size_t i = 0; i < sizeof byte_quotas / sizeof byte_quotas[0]; i++) {
    if (byte_quotas[i].value == NULL)
      continue;
    if (size_parse(byte_quotas[i].value, byte_quotas[i].field) != 0)
      return bad_create_value(byte_quotas[i].flag, byte_quotas[i].value,
                              "a size such as 512M or 4G");
    request->quotas = quotas;
  }
  if (o->max_sessions != NULL) {
    if (ctl__parse_u32(o->max_sessions, 1, 1000000, &quotas->max_sessions) != 0)
      return bad_create_value("--max-sessions", o->max_sessions, "1..1000000");
    request->quotas = quotas;
  }
  return 0;
}

/* --checkpoint-*: the periodic checkpoints (request points to policy when
 * they are on). */
static int create_policy(const create_options *o, Zerod__V1__CheckpointPolicy *policy,
                         Zerod__V1__CreateJobRequest *request) {
  if (o->every_steps != NULL &&
      ctl__parse_u32(o->every_steps, 1, UINT32_MAX, &policy->every_steps) != 0)
    return bad_create_value("--checkpoint-every-steps", o->every_steps, "an integer >= 1");
  if (o->every_seconds != NULL &&
      ctl__parse_u32(o->every_seconds, 1, UINT32_MAX, &policy->every_seconds) != 0)
    return bad_create_value("--checkpoint-every-seconds", o->every_seconds, "an integer >= 1");
  if (o->keep != NULL && ctl__parse_u32(o->keep, 1, UINT32_MAX, &policy->keep) != 0)
    return bad_create_value("--checkpoint-keep", o->keep, "an integer >= 1");
  if (o->keep != NULL && o->every_steps == NULL && o->every_seconds == NULL)
    return ctl__usage_error("jobs create: --checkpoint-keep needs --checkpoint-every-steps or "
                            "--checkpoint-every-seconds");
  if (o->redundancy != NULL && ctl__parse_u32(o->redundancy, 0, 1, &policy->redundancy) != 0)
    return bad_create_value("--redundancy", o->redundancy, "0 or 1");
  if (o->redundancy_every != NULL &&
      ctl__parse_u32(o->redundancy_every, 1, UINT32_MAX, &policy->redundancy_every_steps) != 0)
    return bad_create_value("--redundancy-every-steps", o->redundancy_every, "an integer >= 1");
  if (o->every_steps != NULL || o->every_seconds != NULL || policy->redundancy != 0)
    request->checkpoint_policy = policy;
  return 0;
}

/* --token and --tenant: who owns the job; --base: what it builds on. */
static int create_owner(const create_options *o, Zerod__V1__CreateJobRequest *request) {
  if (o->base != NULL) {
    if (!ctl__valid_name(o->base))
      return bad_create_value("--base", o->base, "a job name: 1..64 of [A-Za-z0-9._-]");
    if (strcmp(o->base, request->name) == 0)
      return ctl__usage_error("jobs create: job '%s' cannot be its own base", o->base);
    request->config->base_job = (char *)o->base;
  }
  if (o->token != NULL) {
    if (!ctl__valid_token(o->token))
      return bad_create_value("--token", o->token, "1..256 printable characters, no spaces");
    request->token = (char *)o->token;
  }
  if (o->tenant != NULL) {
    if (!ctl__valid_name(o->tenant))
      return bad_create_value("--tenant", o->tenant, "1..64 of [A-Za-z0-9._-]");
    request->tenant = (char *)o->tenant;
  }
  return 0;
}

/* Sends the request and prints the job with its owner token. */
static int create_and_print(ctl *c, const Zerod__V1__CreateJobRequest *request) {
  Zerod__V1__CreateJobReply *reply;
  int rc = ctl__call(c, "/zerod.v1.Jobs/CreateJob", &request->base,
                     &zerod__v1__create_job_reply__descriptor, (ProtobufCMessage **)&reply);
  if (rc != 0)
    return rc;
  if (reply->job == NULL) {
    zerod__v1__create_job_reply__free_unpacked(reply, NULL);
    return ctl__fail_line(CTL_EXIT_FAILED, "%s: the coordinator's reply has no job", c->command);
  }
  if (c->json) {
    rc = ctl__json_print(json_pack("{soso}", "job", ctl__json_job(reply->job), "token",
                                   ctl__json_str(reply->token)));
  } else {
    ctl__print_job(reply->job);
    ctl__print_field("token", "%s", reply->token);
  }
  zerod__v1__create_job_reply__free_unpacked(reply, NULL);
  return rc;
}

/* Each step checks its options in the order a user reads them in the
 * help, so the first mistake is the one reported. */
int ctl__cmd_jobs_create(ctl *c, const char *name, const create_options *o) {
  Zerod__V1__OptimizerConfig optimizer = ZEROD__V1__OPTIMIZER_CONFIG__INIT;
  Zerod__V1__JobConfig config = ZEROD__V1__JOB_CONFIG__INIT;
  Zerod__V1__OffloadConfig offload = ZEROD__V1__OFFLOAD_CONFIG__INIT;
  Zerod__V1__Quotas quotas = ZEROD__V1__QUOTAS__INIT;
  Zerod__V1__CheckpointPolicy policy = ZEROD__V1__CHECKPOINT_POLICY__INIT;
  Zerod__V1__CreateJobRequest request = ZEROD__V1__CREATE_JOB_REQUEST__INIT;
  ctl_deepspeed ds = {0};
  char names[CTL_MAX_NODES][CTL_NAME_MAX_BYTES + 1];
  char *name_ptrs[CTL_MAX_NODES];

  request.name = (char *)name;
  config.optimizer = &optimizer;
  request.config = &config;
  int rc = create_placement(o, &request, names, name_ptrs);
  if (rc == 0 && o->deepspeed_config != NULL)
    rc = create_deepspeed(o->deepspeed_config, &config, &offload, &ds);
  if (rc == 0)
    rc = create_optimizer(o, &optimizer);
  if (rc == 0)
    rc = create_numerics(o, &config);
  if (rc == 0)
    rc = create_offload(o, &config, &offload);
  if (rc == 0)
    rc = create_limits(o, &config, &quotas, &request);
  if (rc == 0)
    rc = create_policy(o, &policy, &request);
  if (rc == 0)
    rc = create_owner(o, &request);
  if (rc == 0)
    rc = create_and_print(c, &request);
  ctl__deepspeed_free(&ds);
  return rc;
}
