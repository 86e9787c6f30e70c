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

/* A job as JSON: ids as strings, counts as integers, hyper-parameters as
 * numbers (docs/zerodctl.md, "JSON output"). Keys in the order they
 * print. */
static json_t *json_optimizer(const Zerod__V1__OptimizerConfig *opt) {
  json_t *o = json_object();
  json_object_set_new(o, "kind", ctl__json_str(ctl__optimizer_name(opt->kind)));
  json_object_set_new(o, "lr", ctl__json_real(opt->lr));
  json_object_set_new(o, "beta1", ctl__json_real(opt->beta1));
  json_object_set_new(o, "beta2", ctl__json_real(opt->beta2));
  json_object_set_new(o, "eps", ctl__json_real(opt->eps));
  json_object_set_new(o, "weight_decay", ctl__json_real(opt->weight_decay));
  json_object_set_new(o, "has_weight_decay", json_boolean(opt->has_weight_decay));
  json_object_set_new(o, "momentum", ctl__json_real(opt->momentum));
  json_object_set_new(o, "dampening", ctl__json_real(opt->dampening));
  json_object_set_new(o, "nesterov", json_boolean(opt->nesterov));
  return o;
}

/* offload_optimizer and, for a device that has them, its settings. */
static void json_offload(json_t *o, const Zerod__V1__OffloadConfig *off) {
  json_object_set_new(o, "offload_optimizer", ctl__json_str(ctl__offload_name(off)));
  if (off == NULL || (off->device != ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME &&
                      off->device != ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_CPU))
    return;
  if (off->device == ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME)
    json_object_set_new(o, "nvme_path", ctl__json_str(off->nvme_path));
  json_object_set_new(o, "offload_buffer_count", ctl__json_count(off->buffer_count));
  json_object_set_new(o, "offload_buffer_size", ctl__json_count(off->buffer_size));
  json_object_set_new(o, "offload_pin_memory", json_boolean(off->pin_memory));
}

/* The loss scale and its rule. */
static void json_loss_scale(json_t *o, const Zerod__V1__JobConfig *config) {
  json_object_set_new(o, "loss_scale",
                      ctl__json_real(config->loss_scale > 0 ? config->loss_scale : 0));
  json_object_set_new(o, "loss_scale_window", ctl__json_count(config->loss_scale_window));
  json_object_set_new(o, "loss_scale_growth", ctl__json_real(config->loss_scale_growth));
  json_object_set_new(o, "loss_scale_backoff", ctl__json_real(config->loss_scale_backoff));
  json_object_set_new(o, "loss_scale_hysteresis", ctl__json_count(config->loss_scale_hysteresis));
  json_object_set_new(o, "loss_scale_min", ctl__json_real(config->loss_scale_min));
}

static json_t *json_config(const Zerod__V1__Job *job) {
  const Zerod__V1__JobConfig *config = job_config(job);
  json_t *o = json_object();
  json_object_set_new(o, "optimizer", json_optimizer(job_optimizer(job)));
  json_object_set_new(o, "precision", ctl__json_str(ctl__precision_name(config->working_dtype)));
  json_object_set_new(o, "collectives",
                      ctl__json_str(config->collectives == ZEROD__V1__COLLECTIVES__COLLECTIVES_FLAT
                                        ? "flat"
                                        : "hierarchical"));
  json_object_set_new(o, "quantized_weights", json_boolean(config->quantized_weights));
  json_object_set_new(o, "quantization_block", ctl__json_count(config->quantization_block));
  json_object_set_new(o, "quantized_gradients", ctl__json_count(config->quantized_gradients));
  json_object_set_new(o, "gradient_comm_dtype",
                      ctl__json_str(ctl__precision_name(config->gradient_comm_dtype)));
  json_object_set_new(o, "hpz_partition_size", ctl__json_count(config->hpz_partition_size));
  json_object_set_new(o, "onebit_freeze_step", ctl__json_count(config->onebit_freeze_step));
  json_object_set_new(o, "powersgd_rank", ctl__json_count(config->powersgd_rank));
  json_object_set_new(o, "powersgd_start_step", ctl__json_count(config->powersgd_start_step));
  json_offload(o, config->offload_optimizer);
  json_loss_scale(o, config);
  json_object_set_new(o, "max_live_bytes", ctl__json_count(config->max_live_bytes));
  json_object_set_new(o, "max_grad_norm", ctl__json_real(config->max_grad_norm));
  json_object_set_new(o, "base_job", ctl__json_str(config->base_job));
  return o;
}

static json_t *json_quotas(const Zerod__V1__Job *job) {
  static const Zerod__V1__Quotas none = ZEROD__V1__QUOTAS__INIT;
  const Zerod__V1__Quotas *q = job->quotas != NULL ? job->quotas : &none;
  json_t *o = json_object();
  json_object_set_new(o, "max_live_bytes", ctl__json_count(q->max_live_bytes));
  json_object_set_new(o, "max_host_bytes", ctl__json_count(q->max_host_bytes));
  json_object_set_new(o, "max_device_bytes", ctl__json_count(q->max_device_bytes));
  json_object_set_new(o, "max_sessions", ctl__json_count(q->max_sessions));
  return o;
}

/* The checkpoint policy; redundancy_every_steps 0 means every step. */
static json_t *json_policy(const Zerod__V1__Job *job) {
  static const Zerod__V1__CheckpointPolicy none = ZEROD__V1__CHECKPOINT_POLICY__INIT;
  const Zerod__V1__CheckpointPolicy *p =
      job->checkpoint_policy != NULL ? job->checkpoint_policy : &none;
  json_t *o = json_object();
  json_object_set_new(o, "every_steps", ctl__json_count(p->every_steps));
  json_object_set_new(o, "every_seconds", ctl__json_count(p->every_seconds));
  json_object_set_new(o, "keep", ctl__json_count(p->keep));
  json_object_set_new(o, "redundancy", ctl__json_count(p->redundancy));
  json_object_set_new(o, "redundancy_every_steps",
                      ctl__json_count(p->redundancy_every_steps ? p->redundancy_every_steps : 1));
  return o;
}

static json_t *json_placement(const Zerod__V1__Job *job) {
  json_t *a = json_array();
  for (size_t i = 0; i < job->n_placement; i++) {
    const Zerod__V1__RankPlacement *p = job->placement[i];
    json_array_append_new(a, json_pack("{sososo}", "node", ctl__json_str(p->node), "first_rank",
                                       ctl__json_count(p->first_rank), "ranks",
                                       ctl__json_count(p->ranks)));
  }
  return a;
}

/* A base's sharing: frozen, shared_with, public, jobs_on_base. */
static void json_sharing(json_t *o, const Zerod__V1__Job *job) {
  json_t *shared = json_array();
  for (size_t i = 0; i < job->n_shared_with; i++)
    json_array_append_new(shared, ctl__json_str(job->shared_with[i]));
  json_object_set_new(o, "frozen", json_boolean(job->frozen));
  json_object_set_new(o, "shared_with", shared);
  json_object_set_new(o, "public", json_boolean(job->public_));
  json_object_set_new(o, "jobs_on_base", ctl__json_count(job->jobs_on_base));
}

json_t *ctl__json_job(const Zerod__V1__Job *job) {
  json_t *o = json_object();
  json_object_set_new(o, "name", ctl__json_str(job->name));
  json_object_set_new(o, "id", ctl__json_id(job->id));
  json_object_set_new(o, "state", ctl__json_str(zd_job_state_word(job->state)));
  json_object_set_new(o, "reason", ctl__json_str(job->reason));
  json_object_set_new(o, "nodes", ctl__json_count(job->nodes));
  json_object_set_new(o, "ranks_per_node", ctl__json_count(job->ranks_per_node));
  json_object_set_new(o, "world_size", ctl__json_count(job->world_size));
  json_object_set_new(o, "placement", json_placement(job));
  json_object_set_new(o, "config", json_config(job));
  json_object_set_new(o, "quotas", json_quotas(job));
  json_object_set_new(o, "step", ctl__json_count(job->step));
  json_object_set_new(o, "epoch", ctl__json_count(job->epoch)); /* a counter from 1 */
  json_object_set_new(o, "tenant", ctl__json_str(job->tenant));
  json_object_set_new(o, "created_unix_ms", json_integer(job->created_unix_ms));
  json_sharing(o, job);
  json_object_set_new(o, "base_checkpoint", ctl__json_str(job->base_checkpoint));
  json_object_set_new(o, "last_recovery", ctl__json_str(job->last_recovery));
  json_object_set_new(o, "stalled", ctl__json_str(job->stalled));
  json_object_set_new(o, "checkpoint_policy", json_policy(job));
  json_object_set_new(o, "replica_step", ctl__json_count(job->replica_step));
  return o;
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
  if (config->onebit_freeze_step > 0)
    ctl__print_field("1-bit Adam", "after %u exact steps, blocks of %u", config->onebit_freeze_step,
                     config->quantization_block);
  if (config->powersgd_rank > 0)
    ctl__print_field("low-rank", "PowerSGD rank %u between nodes, after %u exact steps",
                     config->powersgd_rank, config->powersgd_start_step);
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
    json_t *jobs = json_array();
    for (size_t i = 0; i < reply->n_jobs; i++)
      if (row(reply->jobs[i], NULL))
        json_array_append_new(jobs, ctl__json_job(reply->jobs[i]));
    zerod__v1__list_jobs_reply__free_unpacked(reply, NULL);
    return ctl__json_print(json_pack("{so}", json_key, jobs));
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
  if (c->json)
    rc = ctl__json_print(ctl__json_job(job));
  else
    ctl__print_job(job);
  zerod__v1__job__free_unpacked(job, NULL);
  return rc;
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
  if (c->json)
    return ctl__json_print(json_pack("{so}", "deleted", ctl__json_str(argv[0])));
  printf("deleted job %s\n", argv[0]);
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
  if (c->json)
    rc = ctl__json_print(json_pack("{soso}", "job", ctl__json_str(argv[0]), "read_token",
                                   ctl__json_str(reply->token)));
  else
    printf("%s\n", reply->token);
  zerod__v1__issue_read_token_reply__free_unpacked(reply, NULL);
  return rc;
}
