/* zerodctl_jobs: the `jobs` commands but create (zerodctl_impl.h).
 *
 * list, get, delete and read-token, and how a job prints: in full, one
 * field per line (get, create), as a row of `jobs list`, or as JSON. A
 * stored zero in a job's optimizer config means torch.optim's default,
 * and prints as that default. Calls zerodctl_call.c and
 * zerodctl_output.c. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "job_states.h"
#include "zerodctl_impl.h"

static const Zerod__V1__OptimizerConfig no_optimizer = ZEROD__V1__OPTIMIZER_CONFIG__INIT;
static const Zerod__V1__JobConfig no_config = ZEROD__V1__JOB_CONFIG__INIT;

static const Zerod__V1__JobConfig *job_config(const Zerod__V1__Job *job) {
  return job->config != NULL ? job->config : &no_config;
}

static const Zerod__V1__OptimizerConfig *job_optimizer(const Zerod__V1__Job *job) {
  const Zerod__V1__JobConfig *config = job_config(job);
  return config->optimizer != NULL ? config->optimizer : &no_optimizer;
}

/* The per-rank live-bytes budget: the quota if set, else the config's. */
static uint64_t job_max_live_bytes(const Zerod__V1__Job *job) {
  if (job->quotas != NULL && job->quotas->max_live_bytes != 0)
    return job->quotas->max_live_bytes;
  return job_config(job)->max_live_bytes;
}

void ctl__json_job(json_out *j, const char *key, const Zerod__V1__Job *job) {
  const Zerod__V1__JobConfig *config = job_config(job);
  const Zerod__V1__OptimizerConfig *opt = job_optimizer(job);
  ctl__json_open(j, key, '{');
  ctl__json_str(j, "name", job->name);
  ctl__json_id(j, "id", job->id);
  ctl__json_str(j, "state", zd_job_state_word(job->state));
  ctl__json_str(j, "reason", job->reason);
  ctl__json_u64(j, "nodes", job->nodes);
  ctl__json_u64(j, "ranks_per_node", job->ranks_per_node);
  ctl__json_u64(j, "world_size", job->world_size);
  ctl__json_open(j, "placement", '[');
  for (size_t i = 0; i < job->n_placement; i++) {
    ctl__json_open(j, NULL, '{');
    ctl__json_str(j, "node", job->placement[i]->node);
    ctl__json_u64(j, "first_rank", job->placement[i]->first_rank);
    ctl__json_u64(j, "ranks", job->placement[i]->ranks);
    ctl__json_close(j, '}');
  }
  ctl__json_close(j, ']');
  ctl__json_open(j, "config", '{');
  ctl__json_open(j, "optimizer", '{');
  ctl__json_str(j, "kind", ctl__optimizer_name(opt->kind));
  ctl__json_f64(j, "lr", opt->lr);
  ctl__json_f64(j, "beta1", opt->beta1);
  ctl__json_f64(j, "beta2", opt->beta2);
  ctl__json_f64(j, "eps", opt->eps);
  ctl__json_f64(j, "weight_decay", opt->weight_decay);
  ctl__json_bool(j, "has_weight_decay", opt->has_weight_decay);
  ctl__json_f64(j, "momentum", opt->momentum);
  ctl__json_f64(j, "dampening", opt->dampening);
  ctl__json_bool(j, "nesterov", opt->nesterov);
  ctl__json_close(j, '}');
  ctl__json_str(j, "precision", ctl__precision_name(config->working_dtype));
  ctl__json_str(j, "collectives",
                config->collectives == ZEROD__V1__COLLECTIVES__COLLECTIVES_FLAT ? "flat"
                                                                                : "hierarchical");
  ctl__json_bool(j, "quantized_weights", config->quantized_weights);
  ctl__json_u64(j, "quantization_block", config->quantization_block);
  ctl__json_u64(j, "quantized_gradients", config->quantized_gradients);
  ctl__json_str(j, "gradient_comm_dtype", ctl__precision_name(config->gradient_comm_dtype));
  ctl__json_u64(j, "hpz_partition_size", config->hpz_partition_size);
  const Zerod__V1__OffloadConfig *off = config->offload_optimizer;
  ctl__json_str(j, "offload_optimizer", ctl__offload_name(off));
  if (off != NULL && off->device == ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME)
    ctl__json_str(j, "nvme_path", off->nvme_path);
  if (off != NULL && (off->device == ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME ||
                      off->device == ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_CPU)) {
    ctl__json_u64(j, "offload_buffer_count", off->buffer_count);
    ctl__json_u64(j, "offload_buffer_size", off->buffer_size);
    ctl__json_bool(j, "offload_pin_memory", off->pin_memory);
  }
  ctl__json_f64(j, "loss_scale", config->loss_scale > 0 ? config->loss_scale : 0);
  ctl__json_u64(j, "loss_scale_window", config->loss_scale_window);
  ctl__json_f64(j, "loss_scale_growth", config->loss_scale_growth);
  ctl__json_f64(j, "loss_scale_backoff", config->loss_scale_backoff);
  ctl__json_u64(j, "loss_scale_hysteresis", config->loss_scale_hysteresis);
  ctl__json_f64(j, "loss_scale_min", config->loss_scale_min);
  ctl__json_u64(j, "max_live_bytes", config->max_live_bytes);
  ctl__json_f64(j, "max_grad_norm", config->max_grad_norm);
  ctl__json_str(j, "base_job", config->base_job != NULL ? config->base_job : "");
  ctl__json_close(j, '}');
  ctl__json_open(j, "quotas", '{');
  ctl__json_u64(j, "max_live_bytes", job->quotas != NULL ? job->quotas->max_live_bytes : 0);
  ctl__json_u64(j, "max_host_bytes", job->quotas != NULL ? job->quotas->max_host_bytes : 0);
  ctl__json_u64(j, "max_device_bytes", job->quotas != NULL ? job->quotas->max_device_bytes : 0);
  ctl__json_u64(j, "max_sessions", job->quotas != NULL ? job->quotas->max_sessions : 0);
  ctl__json_close(j, '}');
  ctl__json_u64(j, "step", job->step);
  ctl__json_u64(j, "epoch", job->epoch);
  ctl__json_str(j, "tenant", job->tenant);
  ctl__json_i64(j, "created_unix_ms", job->created_unix_ms);
  ctl__json_bool(j, "frozen", job->frozen);
  ctl__json_open(j, "shared_with", '[');
  for (size_t i = 0; i < job->n_shared_with; i++)
    ctl__json_str(j, NULL, job->shared_with[i]);
  ctl__json_close(j, ']');
  ctl__json_bool(j, "public", job->public_);
  ctl__json_u64(j, "jobs_on_base", job->jobs_on_base);
  ctl__json_str(j, "base_checkpoint", job->base_checkpoint);
  ctl__json_str(j, "last_recovery", job->last_recovery);
  ctl__json_str(j, "stalled", job->stalled);
  const Zerod__V1__CheckpointPolicy *policy = job->checkpoint_policy;
  ctl__json_open(j, "checkpoint_policy", '{');
  ctl__json_u64(j, "every_steps", policy != NULL ? policy->every_steps : 0);
  ctl__json_u64(j, "every_seconds", policy != NULL ? policy->every_seconds : 0);
  ctl__json_u64(j, "keep", policy != NULL ? policy->keep : 0);
  ctl__json_u64(j, "redundancy", policy != NULL ? policy->redundancy : 0);
  ctl__json_u64(j, "redundancy_every_steps",
                policy != NULL && policy->redundancy_every_steps ? policy->redundancy_every_steps
                                                                 : 1);
  ctl__json_close(j, '}');
  ctl__json_u64(j, "replica_step", job->replica_step);
  ctl__json_close(j, '}');
}

/* A hyper-parameter as stored, or the torch.optim default the daemons use
 * for a zero (ipc.proto's OptimizerConfig). */
static void print_hyper(const char *key, double value, double default_value) {
  if (value != 0)
    ctl__print_field(key, "%g", value);
  else
    ctl__print_field(key, "%g (default)", default_value);
}

/* "every 1000 steps or 600 s, keep 3", or "off". */
static void print_policy(const Zerod__V1__CheckpointPolicy *policy) {
  if (policy != NULL && policy->redundancy != 0)
    ctl__print_field("redundancy", "1 copy in another node's memory, every %" PRIu32 " step%s",
                     policy->redundancy_every_steps ? policy->redundancy_every_steps : 1,
                     policy->redundancy_every_steps > 1 ? "s" : "");
  if (policy == NULL || (policy->every_steps == 0 && policy->every_seconds == 0)) {
    ctl__print_field("checkpoints", "off");
    return;
  }
  char steps[48] = "", seconds[48] = "", keep[48] = "";
  if (policy->every_steps != 0)
    snprintf(steps, sizeof steps, "%" PRIu32 " steps", policy->every_steps);
  if (policy->every_seconds != 0)
    snprintf(seconds, sizeof seconds, "%" PRIu32 " s", policy->every_seconds);
  if (policy->keep != 0)
    snprintf(keep, sizeof keep, ", keep %" PRIu32, policy->keep);
  ctl__print_field("checkpoints", "every %s%s%s%s", steps, steps[0] && seconds[0] ? " or " : "",
                   seconds, keep);
}

/* Bases (docs/bases.md): "frozen: yes (a base), shared with a, b; 2 jobs
 * on it", and a job's base. */
static void print_base(const Zerod__V1__Job *job) {
  const char *base = job_config(job)->base_job;
  if (base != NULL && base[0] != '\0')
    ctl__print_field("base", "%s", base);
  if (!job->frozen)
    return;
  char sharing[TABLE_CELL_BYTES];
  ctl__format_sharing(job, sharing, sizeof sharing);
  ctl__print_field("frozen", "yes (a base), shared with %s; %" PRIu32 " job%s on it", sharing,
                   job->jobs_on_base, job->jobs_on_base == 1 ? "" : "s");
  ctl__print_field("base checkpoint", "%s",
                   job->base_checkpoint[0] != '\0' ? job->base_checkpoint
                                                   : "none yet (a restart cannot restore it)");
}

void ctl__format_sharing(const Zerod__V1__Job *job, char *out, size_t out_bytes) {
  if (job->public_) {
    snprintf(out, out_bytes, "every tenant (public)");
    return;
  }
  if (job->n_shared_with == 0) {
    snprintf(out, out_bytes, "no other tenant");
    return;
  }
  size_t used = 0;
  out[0] = '\0';
  for (size_t i = 0; i < job->n_shared_with; i++) {
    int n = snprintf(out + used, out_bytes - used, "%s%s", i ? "," : "", job->shared_with[i]);
    if (n < 0 || (size_t)n >= out_bytes - used)
      break;
    used += (size_t)n;
  }
}

/* `jobs get` and `jobs create`: one field per line. */
void ctl__print_job(const Zerod__V1__Job *job) {
  const Zerod__V1__JobConfig *config = job_config(job);
  const Zerod__V1__OptimizerConfig *opt = job_optimizer(job);
  char text[64];
  ctl__print_field("name", "%s", job->name);
  ctl__print_field("id", "%" PRIu64, job->id);
  ctl__print_field("state", "%s", zd_job_state_word(job->state));
  ctl__print_field("reason", "%s", job->reason);
  ctl__print_field("world size", "%" PRIu32, job->world_size);
  ctl__print_field("nodes", "%" PRIu32, job->nodes);
  ctl__print_field("ranks per node", "%" PRIu32, job->ranks_per_node);
  printf("placement:%s\n", job->n_placement == 0 ? " -" : "");
  for (size_t i = 0; i < job->n_placement; i++) {
    const Zerod__V1__RankPlacement *p = job->placement[i];
    char key[CTL_NAME_MAX_BYTES + 8];
    snprintf(key, sizeof key, "  %s", p->node);
    ctl__sanitize_line(key);
    if (p->ranks == 1)
      ctl__print_field(key, "rank %" PRIu32, p->first_rank);
    else
      ctl__print_field(key, "ranks %" PRIu32 "-%" PRIu32, p->first_rank,
                       p->first_rank + (p->ranks > 0 ? p->ranks - 1 : 0));
  }
  ctl__print_field("optimizer", "%s", ctl__optimizer_name(opt->kind));
  print_hyper("lr", opt->lr, 1e-3);
  bool sgd = opt->kind == ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD;
  if (sgd) {
    print_hyper("momentum", opt->momentum, 0);
    if (opt->dampening != 0)
      ctl__print_field("dampening", "%g", opt->dampening);
    if (opt->nesterov)
      ctl__print_field("nesterov", "true");
  } else {
    ctl__print_field("betas", "%g,%g%s", opt->beta1 != 0 ? opt->beta1 : 0.9,
                     opt->beta2 != 0 ? opt->beta2 : 0.999,
                     opt->beta1 == 0 && opt->beta2 == 0 ? " (default)" : "");
    print_hyper("eps", opt->eps, 1e-8);
  }
  bool adamw = opt->kind == ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAMW ||
               opt->kind == ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_UNSPECIFIED;
  if (opt->has_weight_decay || opt->weight_decay != 0)
    ctl__print_field("weight decay", "%g", opt->weight_decay);
  else
    ctl__print_field("weight decay", "%g (default)", adamw ? 0.01 : 0.0);
  ctl__print_field("precision", "%s", ctl__precision_name(config->working_dtype));
  ctl__print_field(
      "collectives", "%s",
      config->collectives == ZEROD__V1__COLLECTIVES__COLLECTIVES_FLAT ? "flat" : "hierarchical");
  if (config->quantized_weights)
    ctl__print_field("quantized weights", "int8, blocks of %u", config->quantization_block);
  if (config->quantized_gradients != 0)
    ctl__print_field("quantized gradients", "int%u, blocks of %u", config->quantized_gradients,
                     config->quantization_block);
  else if (config->gradient_comm_dtype == ZEROD__V1__DTYPE__DTYPE_BF16)
    ctl__print_field("gradients between nodes", "bf16");
  if (config->loss_scale > 0)
    ctl__print_field("loss scaling", "from %g, x%g every %u good steps, x%g after %u overflows",
                     config->loss_scale, config->loss_scale_growth, config->loss_scale_window,
                     config->loss_scale_backoff, config->loss_scale_hysteresis);
  if (config->hpz_partition_size > 1)
    ctl__print_field("hpZ", "secondary partition over %u ranks of a node",
                     config->hpz_partition_size);
  const Zerod__V1__OffloadConfig *off = config->offload_optimizer;
  if (off != NULL && off->device == ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME)
    ctl__print_field("optimizer state", "on disk (nvme) in %s, %u buffers of %llu elements%s",
                     off->nvme_path[0] != '\0' ? off->nvme_path : "the nodes' --nvme-dir",
                     off->buffer_count, (unsigned long long)off->buffer_size,
                     off->pin_memory ? ", page-locked on GPU ranks" : "");
  else if (off != NULL && off->device == ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_CPU)
    ctl__print_field("optimizer state",
                     "in host memory (cpu; GPU ranks step on the CPU through %u "
                     "buffers of %llu elements%s)",
                     off->buffer_count, (unsigned long long)off->buffer_size,
                     off->pin_memory ? ", page-locked" : "");
  else
    ctl__print_field("optimizer state", "in memory (%s)", ctl__offload_name(off));
  if (config->max_grad_norm > 0)
    ctl__print_field("max grad norm", "%g", config->max_grad_norm);
  else
    ctl__print_field("max grad norm", "off");
  uint64_t max_live = job_max_live_bytes(job);
  if (max_live != 0)
    ctl__print_field("max live bytes", "%s", ctl__format_bytes(max_live, text, sizeof text));
  else
    ctl__print_field("max live bytes", "node default");
  ctl__print_field("step", "%" PRIu64, job->step);
  ctl__print_field("epoch", "%" PRIu64, job->epoch);
  if (job->quotas != NULL && job->quotas->max_host_bytes != 0)
    ctl__print_field("max host bytes", "%s",
                     ctl__format_bytes(job->quotas->max_host_bytes, text, sizeof text));
  if (job->quotas != NULL && job->quotas->max_device_bytes != 0)
    ctl__print_field("max device bytes", "%s",
                     ctl__format_bytes(job->quotas->max_device_bytes, text, sizeof text));
  if (job->quotas != NULL && job->quotas->max_sessions != 0)
    ctl__print_field("max sessions", "%u", job->quotas->max_sessions);
  ctl__print_field("tenant", "%s", job->tenant[0] != '\0' ? job->tenant : "none (admins only)");
  ctl__print_field("created", "%s", ctl__format_unix_ms(job->created_unix_ms, text, sizeof text));
  print_policy(job->checkpoint_policy);
  print_base(job);
  if (job->replica_step != 0)
    ctl__print_field("in-memory copy", "step %" PRIu64, job->replica_step);
  if (job->last_recovery[0] != '\0')
    ctl__print_field("last recovery", "%s", job->last_recovery);
  if (job->stalled[0] != '\0')
    ctl__print_field("stalled", "%s", job->stalled);
}

void ctl__format_job_nodes(const Zerod__V1__Job *job, char *out, size_t out_bytes) {
  out[0] = '\0';
  size_t used = 0;
  for (size_t i = 0; i < job->n_placement; i++) {
    int n = i < 3 ? snprintf(out + used, out_bytes - used, "%s%s", i ? "," : "",
                             job->placement[i]->node)
                  : snprintf(out + used, out_bytes - used, ",+%zu", job->n_placement - 3);
    if (n < 0 || (size_t)n >= out_bytes - used)
      break;
    used += (size_t)n;
    if (i >= 3)
      break;
  }
}

int ctl__list_jobs(ctl *c, const char *json_key, const char *const *headers, size_t columns,
                   ctl_job_row *row) {
  Zerod__V1__ListJobsRequest request = ZEROD__V1__LIST_JOBS_REQUEST__INIT;
  Zerod__V1__ListJobsReply *reply;
  int rc = ctl__call(c, "/zerod.v1.Jobs/ListJobs", &request.base,
                     &zerod__v1__list_jobs_reply__descriptor, (ProtobufCMessage **)&reply);
  if (rc != 0)
    return rc;

  if (c->json) {
    json_out j = {.out = stdout};
    ctl__json_open(&j, NULL, '{');
    ctl__json_open(&j, json_key, '[');
    for (size_t i = 0; i < reply->n_jobs; i++)
      if (row(reply->jobs[i], NULL))
        ctl__json_job(&j, NULL, reply->jobs[i]);
    ctl__json_close(&j, ']');
    ctl__json_close(&j, '}');
    zerod__v1__list_jobs_reply__free_unpacked(reply, NULL);
    return 0;
  }

  table t;
  ctl__table_init(&t, columns, headers);
  for (size_t i = 0; i < reply->n_jobs && rc == 0; i++) {
    char cells[TABLE_MAX_COLUMNS][TABLE_CELL_BYTES];
    if (row(reply->jobs[i], cells) && ctl__table_add_row(&t, cells) != 0)
      rc = ctl__fail_line(CTL_EXIT_FAILED, "%s: %s", c->command, strerror(ENOMEM));
  }
  if (rc == 0)
    ctl__table_print(&t, stdout);
  ctl__table_free(&t);
  zerod__v1__list_jobs_reply__free_unpacked(reply, NULL);
  return rc;
}

/* A row of `jobs list`: every job. */
static bool job_row(const Zerod__V1__Job *job, char cells[][TABLE_CELL_BYTES]) {
  if (cells == NULL)
    return true;
  snprintf(cells[0], TABLE_CELL_BYTES, "%s", job->name);
  snprintf(cells[1], TABLE_CELL_BYTES, "%s", zd_job_state_word(job->state));
  snprintf(cells[2], TABLE_CELL_BYTES, "%" PRIu32, job->world_size);
  ctl__format_job_nodes(job, cells[3], TABLE_CELL_BYTES);
  snprintf(cells[4], TABLE_CELL_BYTES, "%s", ctl__optimizer_name(job_optimizer(job)->kind));
  snprintf(cells[5], TABLE_CELL_BYTES, "%s", ctl__precision_name(job_config(job)->working_dtype));
  snprintf(cells[6], TABLE_CELL_BYTES, "%" PRIu64, job->step);
  /* BASE: "frozen" for a base, the base of a job on one. */
  const char *base = job_config(job)->base_job;
  snprintf(cells[7], TABLE_CELL_BYTES, "%s",
           job->frozen                       ? "frozen"
           : base != NULL && base[0] != '\0' ? base
                                             : "-");
  snprintf(cells[8], TABLE_CELL_BYTES, "%s", job->reason);
  return true;
}

int ctl__cmd_jobs_list(ctl *c, int argc, char **argv) {
  static const char *const headers[] = {"NAME",      "STATE", "WORLD", "NODES", "OPTIMIZER",
                                        "PRECISION", "STEP",  "BASE",  "REASON"};
  return ctl__list_jobs(c, "jobs", headers, 9, job_row);
}

int ctl__call_job(ctl *c, const char *method, const ProtobufCMessage *request) {
  Zerod__V1__Job *job;
  int rc = ctl__call(c, method, request, &zerod__v1__job__descriptor, (ProtobufCMessage **)&job);
  if (rc != 0)
    return rc;
  if (c->json) {
    json_out j = {.out = stdout};
    ctl__json_job(&j, NULL, job);
  } else {
    ctl__print_job(job);
  }
  zerod__v1__job__free_unpacked(job, NULL);
  return 0;
}

int ctl__cmd_jobs_get(ctl *c, int argc, char **argv) {
  Zerod__V1__GetJobRequest request = ZEROD__V1__GET_JOB_REQUEST__INIT;
  request.name = argv[0];
  return ctl__call_job(c, "/zerod.v1.Jobs/GetJob", &request.base);
}

int ctl__cmd_jobs_delete(ctl *c, int argc, char **argv) {
  Zerod__V1__DeleteJobRequest request = ZEROD__V1__DELETE_JOB_REQUEST__INIT;
  request.name = argv[0];
  Zerod__V1__DeleteJobReply *reply;
  int rc = ctl__call(c, "/zerod.v1.Jobs/DeleteJob", &request.base,
                     &zerod__v1__delete_job_reply__descriptor, (ProtobufCMessage **)&reply);
  if (rc != 0)
    return rc;
  zerod__v1__delete_job_reply__free_unpacked(reply, NULL);
  if (c->json) {
    json_out j = {.out = stdout};
    ctl__json_open(&j, NULL, '{');
    ctl__json_str(&j, "deleted", argv[0]);
    ctl__json_close(&j, '}');
  } else {
    printf("deleted job %s\n", argv[0]);
  }
  return 0;
}

int ctl__cmd_jobs_read_token(ctl *c, int argc, char **argv) {
  (void)argc;
  Zerod__V1__IssueReadTokenRequest request = ZEROD__V1__ISSUE_READ_TOKEN_REQUEST__INIT;
  request.job = argv[0];
  Zerod__V1__IssueReadTokenReply *reply;
  int rc = ctl__call(c, "/zerod.v1.Jobs/IssueReadToken", &request.base,
                     &zerod__v1__issue_read_token_reply__descriptor, (ProtobufCMessage **)&reply);
  if (rc != 0)
    return rc;
  if (c->json) {
    json_out j = {.out = stdout};
    ctl__json_open(&j, NULL, '{');
    ctl__json_str(&j, "job", argv[0]);
    ctl__json_str(&j, "read_token", reply->token);
    ctl__json_close(&j, '}');
  } else {
    printf("%s\n", reply->token);
  }
  zerod__v1__issue_read_token_reply__free_unpacked(reply, NULL);
  return 0;
}
