/* A worker of the previous release (the test abi.old_worker): compiled
 * against the baseline header kept in client/abi/ (zerod-<ABI>.h, the
 * header as this soname began), linked against the library just built, and
 * run against a real `zerod standalone`. It attaches, registers a unit,
 * gathers, releases, writes and reduces a gradient, steps, saves a
 * checkpoint, reads its stats, sets parameter groups and steps again,
 * checking every value against plain SGD; and every struct the library
 * fills lies in a buffer with a canary past its struct_size, which must
 * come back untouched. A library that grew a struct without struct_size,
 * or wrote past the caller's, fails here. Exits 0, or 1 after saying what
 * went wrong. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include ZEROD_BASELINE_HEADER
#include "standalone_daemon.h"

static standalone_daemon daemon_proc;
static int failures;

#define CHECK(cond, ...)                                                                           \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                              \
      fprintf(stderr, __VA_ARGS__);                                                                \
      fprintf(stderr, "\n");                                                                       \
      failures++;                                                                                  \
    }                                                                                              \
  } while (0)

/* A call that must succeed; the worker cannot go on without it. */
#define MUST(call)                                                                                 \
  do {                                                                                             \
    zd_status status_ = (call);                                                                    \
    if (status_ != ZD_OK) {                                                                        \
      fprintf(stderr, "FAIL %s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call,                      \
              zd_strerror(status_), zd_last_error());                                              \
      standalone_daemon_stop(&daemon_proc);                                                        \
      return 1;                                                                                    \
    }                                                                                              \
  } while (0)

#define CANARY       0x5a
#define CANARY_BYTES 64

/* A struct of `type` followed by CANARY_BYTES of canary, struct_size set
 * to the baseline's sizeof. */
#define CANARIED(type, name)                                                                       \
  unsigned char name##_bytes[sizeof(type) + CANARY_BYTES] __attribute__((aligned(16)));            \
  memset(name##_bytes, CANARY, sizeof name##_bytes);                                               \
  type *name = (type *)name##_bytes;                                                               \
  memset(name, 0, sizeof(type));                                                                   \
  name->struct_size = sizeof(type)

static void check_canary(const unsigned char *bytes, size_t struct_bytes, const char *what) {
  for (size_t i = struct_bytes; i < struct_bytes + CANARY_BYTES; i++) {
    if (bytes[i] != CANARY) {
      fprintf(stderr, "FAIL: %s: byte %zu past the caller's %zu-byte struct was written\n", what,
              i - struct_bytes, struct_bytes);
      failures++;
      return;
    }
  }
}

#define CHECK_CANARY(type, name) check_canary(name##_bytes, sizeof(type), #type)

#define W_ROWS  2
#define W_COLS  3
#define B_NUMEL 3
#define NUMEL   (W_ROWS * W_COLS + B_NUMEL)
#define LR      0.5

int main(void) {
  if (standalone_daemon_start(&daemon_proc, ZEROD_BINARY, 1) != 0)
    return 1;
  zd_client *client;
  MUST(zd_connect(daemon_proc.socket, &client));

  zd_job_config config = ZD_JOB_CONFIG_INIT;
  config.optimizer = ZD_SGD;
  config.lr = LR;
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "old-worker";
  options.create = 1;
  options.config = &config;
  zd_job *job;
  MUST(zd_attach(client, &options, &job));
  CHECK(zd_job_world_size(job) == 1, "world size %u", zd_job_world_size(job));
  CANARIED(zd_job_config, effective);
  MUST(zd_job_effective_config(job, effective));
  CHECK(effective->optimizer == ZD_SGD && effective->lr == LR, "optimizer %d lr %g",
        (int)effective->optimizer, effective->lr);
  CHECK_CANARY(zd_job_config, effective);

  /* One unit: w [2, 3] and b [3], from rank 0's values. */
  const uint64_t w_shape[2] = {W_ROWS, W_COLS};
  const uint64_t b_shape[1] = {B_NUMEL};
  zd_tensor_desc tensors[2] = {ZD_TENSOR_DESC_INIT, ZD_TENSOR_DESC_INIT};
  tensors[0].name = "w";
  tensors[0].shape = w_shape;
  tensors[0].ndim = 2;
  tensors[1].name = "b";
  tensors[1].shape = b_shape;
  tensors[1].ndim = 1;
  float values[NUMEL];
  for (int i = 0; i < NUMEL; i++)
    values[i] = 1.0f + (float)i;
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "layer";
  desc.tensors = tensors;
  desc.ntensors = 2;
  desc.init = ZD_INIT_FROM_RANK0;
  desc.init_values = values;
  zd_unit unit;
  MUST(zd_register_unit(job, &desc, &unit));

  CANARIED(zd_unit_info, info);
  MUST(zd_job_unit_info(job, 0, info));
  CHECK(info->unit == unit && strcmp(info->name, "layer") == 0 && info->ntensors == 2,
        "unit %u name %s tensors %u", (unsigned)info->unit, info->name, info->ntensors);
  CHECK_CANARY(zd_unit_info, info);

  /* Gather (asynchronously), read, release. */
  CANARIED(zd_pending, pending);
  MUST(zd_gather_async(job, unit, pending));
  CHECK_CANARY(zd_pending, pending);
  CANARIED(zd_view, view);
  MUST(zd_gather_wait(job, pending, view));
  CHECK_CANARY(zd_view, view);
  CHECK(view->ntensors == 2 && view->dtype == ZD_F32 && view->device == -1,
        "tensors %u dtype %d device %d", view->ntensors, (int)view->dtype, view->device);
  const float *w = view->tensors[0].data, *b = view->tensors[1].data;
  for (int i = 0; i < W_ROWS * W_COLS; i++)
    CHECK(w[i] == values[i], "w[%d] %g", i, w[i]);
  for (int i = 0; i < B_NUMEL; i++)
    CHECK(b[i] == values[W_ROWS * W_COLS + i], "b[%d] %g", i, b[i]);
  MUST(zd_release(job, unit));

  /* A gradient of 1, 2, ... on every element; SGD moves each by -lr * g. */
  CANARIED(zd_view, grad);
  MUST(zd_grad_buffer(job, unit, grad));
  CHECK_CANARY(zd_view, grad);
  memset(grad->base, 0, grad->bytes);
  float grads[NUMEL];
  double norm_squared = 0;
  for (int t = 0, k = 0; t < 2; t++) {
    float *g = grad->tensors[t].data;
    for (uint64_t i = 0; i < grad->tensors[t].numel; i++, k++) {
      grads[k] = (float)(k + 1);
      g[i] = grads[k];
      norm_squared += (double)grads[k] * grads[k];
    }
  }
  MUST(zd_reduce(job, unit));
  CANARIED(zd_step_result, result);
  MUST(zd_step(job, NULL, result));
  CHECK_CANARY(zd_step_result, result);
  CHECK(result->step == 1 && result->skipped == 0, "step %llu skipped %d",
        (unsigned long long)result->step, result->skipped);
  CHECK(fabs(result->grad_norm - sqrt(norm_squared)) < 1e-4, "grad_norm %g, expected %g",
        result->grad_norm, sqrt(norm_squared));
  CHECK(result->loss_scale == 0, "loss_scale %g (no loss scaling)", result->loss_scale);
  CHECK(result->version == zd_job_version(job), "version %llu, the job's %llu",
        (unsigned long long)result->version, (unsigned long long)zd_job_version(job));

  memset(view_bytes, CANARY, sizeof view_bytes);
  memset(view, 0, sizeof(zd_view));
  view->struct_size = sizeof(zd_view);
  MUST(zd_gather(job, unit, view));
  CHECK_CANARY(zd_view, view);
  for (int t = 0, k = 0; t < 2; t++) {
    const float *x = view->tensors[t].data;
    for (uint64_t i = 0; i < view->tensors[t].numel; i++, k++) {
      float expected = values[k] - (float)LR * grads[k];
      CHECK(fabsf(x[i] - expected) <= 1e-6f * fabsf(expected), "element %d: %g, expected %g", k,
            x[i], expected);
    }
  }
  MUST(zd_release(job, unit));

  CANARIED(zd_checkpoint_info, checkpoint);
  MUST(zd_checkpoint_save(job, "old-worker", checkpoint));
  CHECK_CANARY(zd_checkpoint_info, checkpoint);
  CHECK(strcmp(checkpoint->name, "old-worker") == 0 && checkpoint->step == 1, "saved %s at %llu",
        checkpoint->name, (unsigned long long)checkpoint->step);

  CANARIED(zd_rank_stats, stats);
  unsigned nranks = 0;
  MUST(zd_job_stats(job, stats, 1, &nranks));
  CHECK_CANARY(zd_rank_stats, stats);
  CHECK(nranks == 1 && stats->step == 1, "ranks %u step %llu", nranks,
        (unsigned long long)stats->step);

  /* Two parameter groups: b in the second, whose lr the step sets. */
  zd_param_group groups[2] = {ZD_PARAM_GROUP_INIT, ZD_PARAM_GROUP_INIT};
  const unsigned tensor_groups_of_unit[2] = {0, 1};
  const unsigned *tensor_groups[1] = {tensor_groups_of_unit};
  MUST(zd_set_groups(job, groups, 2, &unit, tensor_groups, 1));
  MUST(zd_grad_buffer(job, unit, grad));
  memset(grad->base, 0, grad->bytes);
  MUST(zd_reduce_async(job, unit));
  zd_step_options step_options = ZD_STEP_OPTIONS_INIT;
  const double group_lr[2] = {LR, 0.25};
  step_options.group_lr = group_lr;
  step_options.ngroup_lr = 2;
  memset(result_bytes, CANARY, sizeof result_bytes);
  memset(result, 0, sizeof(zd_step_result));
  result->struct_size = sizeof(zd_step_result);
  MUST(zd_step(job, &step_options, result));
  CHECK_CANARY(zd_step_result, result);
  CHECK(result->step == 2 && result->grad_norm == 0, "step %llu grad_norm %g",
        (unsigned long long)result->step, result->grad_norm);

  MUST(zd_detach(job));
  zd_close(client);
  if (standalone_daemon_stop(&daemon_proc) != 0)
    failures++;
  if (failures != 0) {
    fprintf(stderr, "abi_old_worker: %d check(s) failed\n", failures);
    return 1;
  }
  printf("ok: a worker built against %s attached, gathered, reduced, stepped and saved through "
         "the new libzerod; nothing past its structs was written\n",
         ZEROD_BASELINE_HEADER);
  return 0;
}
