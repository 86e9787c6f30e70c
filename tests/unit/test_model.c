/* The model library's job configs (daemon/model/config.c):
 * job_config_from_proto's defaults (AdamW, weight decay 0.01 for AdamW
 * only unless has_weight_decay), job_config_finish's torch.optim defaults
 * and each of its refusals, with the exact message (no prefix: callers add
 * "job 'x': "), and job_config_states for each optimizer. The unit layouts
 * are test_model_layout.c's. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "config.h"

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

#define DEFAULT_MAX_LIVE ((uint64_t)1 << 30)

/* A config as a worker or zerodctl sends it: every field zero (default). */
typedef struct proto_config {
  Zerod__V1__JobConfig config;
  Zerod__V1__OptimizerConfig optimizer;
} proto_config;

static void proto_init(proto_config *p, Zerod__V1__OptimizerKind kind) {
  zerod__v1__job_config__init(&p->config);
  zerod__v1__optimizer_config__init(&p->optimizer);
  p->optimizer.kind = kind;
  p->config.optimizer = &p->optimizer;
}

static job_config from_proto_ok(const Zerod__V1__JobConfig *pc) {
  job_config c;
  char err[256] = "";
  int rc = job_config_from_proto(pc, &c, err, sizeof err);
  if (rc != 0)
    fail_msg("job_config_from_proto refused: %s", err);
  return c;
}

/* A finished config of the optimizer with every other field at its
 * default, which each refusal test then breaks in one place. */
static job_config finished(job_optimizer o) {
  job_config c;
  memset(&c, 0, sizeof c);
  c.optimizer = o;
  c.working_dtype = ZK_F32;
  char err[256] = "";
  if (job_config_finish(&c, DEFAULT_MAX_LIVE, err, sizeof err) != 0)
    fail_msg("job_config_finish refused the defaults: %s", err);
  return c;
}

/* job_config_finish refuses c with exactly the message want. */
static void expect_refused(job_config c, const char *want) {
  char err[256] = "";
  assert_int_equal(job_config_finish(&c, DEFAULT_MAX_LIVE, err, sizeof err), -EINVAL);
  assert_string_equal(err, want);
}

static void expect_accepted(job_config c) {
  char err[256] = "";
  int rc = job_config_finish(&c, DEFAULT_MAX_LIVE, err, sizeof err);
  if (rc != 0)
    fail_msg("refused: %s", err);
}

/* ------------------------------------------------------------------------
 * job_config_from_proto
 * ------------------------------------------------------------------------ */

static void test_from_proto_null_is_adamw_with_weight_decay(void **state) {
  (void)state;
  job_config c = from_proto_ok(NULL);
  assert_int_equal(c.optimizer, JOB_ADAMW);
  assert_true(c.weight_decay == 0.01);
  assert_int_equal(c.working_dtype, ZK_F32);
  /* The rest is left for job_config_finish. */
  assert_true(c.lr == 0 && c.beta1 == 0 && c.beta2 == 0 && c.eps == 0);
  assert_true(c.momentum == 0 && c.dampening == 0 && c.nesterov == 0);
  assert_true(c.max_live_bytes == 0 && c.max_grad_norm == 0);
}

static void test_from_proto_without_optimizer_is_adamw(void **state) {
  (void)state;
  Zerod__V1__JobConfig pc = ZEROD__V1__JOB_CONFIG__INIT;
  pc.working_dtype = ZEROD__V1__DTYPE__DTYPE_BF16;
  job_config c = from_proto_ok(&pc);
  assert_int_equal(c.optimizer, JOB_ADAMW);
  assert_true(c.weight_decay == 0.01);
  assert_int_equal(c.working_dtype, ZK_BF16);
}

/* A worker that attaches without a config gets what an empty config (and
 * the coordinator's CreateJob without one) gets. */
static void test_from_proto_null_is_an_empty_config(void **state) {
  (void)state;
  Zerod__V1__JobConfig empty = ZEROD__V1__JOB_CONFIG__INIT;
  job_config a = from_proto_ok(NULL), b = from_proto_ok(&empty);
  char err[256] = "";
  assert_int_equal(job_config_finish(&a, DEFAULT_MAX_LIVE, err, sizeof err), 0);
  assert_int_equal(job_config_finish(&b, DEFAULT_MAX_LIVE, err, sizeof err), 0);
  assert_memory_equal(&a, &b, sizeof a);
}

static void test_from_proto_unspecified_kind_is_adamw(void **state) {
  (void)state;
  proto_config p;
  proto_init(&p, ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_UNSPECIFIED);
  job_config c = from_proto_ok(&p.config);
  assert_int_equal(c.optimizer, JOB_ADAMW);
  assert_true(c.weight_decay == 0.01);
}

static void test_from_proto_sgd_and_adam_have_no_default_weight_decay(void **state) {
  (void)state;
  proto_config p;
  proto_init(&p, ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD);
  job_config c = from_proto_ok(&p.config);
  assert_int_equal(c.optimizer, JOB_SGD);
  assert_true(c.weight_decay == 0);
  proto_init(&p, ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAM);
  c = from_proto_ok(&p.config);
  assert_int_equal(c.optimizer, JOB_ADAM);
  assert_true(c.weight_decay == 0);
}

static void test_from_proto_honors_has_weight_decay(void **state) {
  (void)state;
  proto_config p;
  /* An explicit 0 turns AdamW's decay off. */
  proto_init(&p, ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAMW);
  p.optimizer.has_weight_decay = 1;
  p.optimizer.weight_decay = 0;
  assert_true(from_proto_ok(&p.config).weight_decay == 0);
  /* An explicit value is kept for SGD. */
  proto_init(&p, ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD);
  p.optimizer.has_weight_decay = 1;
  p.optimizer.weight_decay = 1e-4;
  assert_true(from_proto_ok(&p.config).weight_decay == 1e-4);
  /* Without has_weight_decay the field is ignored. */
  proto_init(&p, ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD);
  p.optimizer.weight_decay = 1e-4;
  assert_true(from_proto_ok(&p.config).weight_decay == 0);
}

static void test_from_proto_copies_every_field(void **state) {
  (void)state;
  proto_config p;
  proto_init(&p, ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD);
  p.optimizer.lr = 0.5;
  p.optimizer.beta1 = 0.8;
  p.optimizer.beta2 = 0.99;
  p.optimizer.eps = 1e-6;
  p.optimizer.momentum = 0.9;
  p.optimizer.dampening = 0.1;
  p.optimizer.nesterov = 1;
  p.config.working_dtype = ZEROD__V1__DTYPE__DTYPE_F32;
  p.config.max_live_bytes = 12345;
  p.config.max_grad_norm = 2.5;
  job_config c = from_proto_ok(&p.config);
  assert_int_equal(c.optimizer, JOB_SGD);
  assert_true(c.lr == 0.5 && c.beta1 == 0.8 && c.beta2 == 0.99 && c.eps == 1e-6);
  assert_true(c.momentum == 0.9 && c.dampening == 0.1);
  assert_int_equal(c.nesterov, 1);
  assert_int_equal(c.working_dtype, ZK_F32);
  assert_int_equal(c.max_live_bytes, 12345);
  assert_true(c.max_grad_norm == 2.5);
}

static void test_from_proto_rejects_bad_working_dtype(void **state) {
  (void)state;
  Zerod__V1__JobConfig pc = ZEROD__V1__JOB_CONFIG__INIT;
  pc.working_dtype = (Zerod__V1__Dtype)17;
  job_config c;
  char err[256] = "";
  assert_int_equal(job_config_from_proto(&pc, &c, err, sizeof err), -EINVAL);
  assert_string_equal(err, "working precision must be fp32, bf16 or fp16");
}

/* fp16 turns dynamic loss scaling on by default (GradScaler's values);
 * a negative scale turns it off; fp32 has none unless asked. */
static void test_fp16_scales_the_loss_by_default(void **state) {
  (void)state;
  Zerod__V1__JobConfig pc = ZEROD__V1__JOB_CONFIG__INIT;
  pc.working_dtype = ZEROD__V1__DTYPE__DTYPE_F16;
  job_config c;
  char err[256] = "";
  assert_int_equal(job_config_from_proto(&pc, &c, err, sizeof err), 0);
  assert_int_equal(job_config_finish(&c, DEFAULT_MAX_LIVE, err, sizeof err), 0);
  assert_true(c.loss_scale == 65536 && c.loss_scale_growth == 2 && c.loss_scale_backoff == 0.5);
  assert_int_equal(c.loss_scale_window, 2000);
  assert_int_equal(c.loss_scale_hysteresis, 1);
  assert_true(c.loss_scale_min == 1);
  pc.loss_scale = -1;
  assert_int_equal(job_config_from_proto(&pc, &c, err, sizeof err), 0);
  assert_int_equal(job_config_finish(&c, DEFAULT_MAX_LIVE, err, sizeof err), 0);
  assert_true(c.loss_scale == 0);
  job_config f = finished(JOB_ADAMW);
  assert_true(f.loss_scale == 0);
  f.loss_scale = 8;
  f.loss_scale_min = 16;
  expect_refused(f, "invalid loss scaling: growth 2 (>= 1), backoff 0.5 (in (0, 1)), min 16 (> 0, "
                    "at most the initial scale 8)");
}

/* ------------------------------------------------------------------------
 * job_config_finish: defaults
 * ------------------------------------------------------------------------ */

static void test_config_finish_fills_torch_defaults(void **state) {
  (void)state;
  job_config c;
  memset(&c, 0, sizeof c);
  char err[256] = "";
  assert_int_equal(job_config_finish(&c, DEFAULT_MAX_LIVE, err, sizeof err), 0);
  assert_int_equal(c.optimizer, JOB_ADAMW);
  assert_true(c.lr == 1e-3);
  assert_true(c.beta1 == 0.9);
  assert_true(c.beta2 == 0.999);
  assert_true(c.eps == 1e-8);
  assert_int_equal(c.max_live_bytes, DEFAULT_MAX_LIVE);
  assert_int_equal(c.working_dtype, ZK_F32);
  assert_true(c.weight_decay == 0 && c.momentum == 0 && c.max_grad_norm == 0);
}

static void test_config_finish_keeps_set_values(void **state) {
  (void)state;
  job_config c;
  memset(&c, 0, sizeof c);
  c.optimizer = JOB_ADAM;
  c.lr = 3e-4;
  c.beta1 = 0.8;
  c.beta2 = 0.95;
  c.eps = 1e-6;
  c.weight_decay = 0.1;
  c.max_live_bytes = 77;
  c.max_grad_norm = 1;
  c.working_dtype = ZK_BF16;
  char err[256] = "";
  assert_int_equal(job_config_finish(&c, DEFAULT_MAX_LIVE, err, sizeof err), 0);
  assert_int_equal(c.optimizer, JOB_ADAM);
  assert_true(c.lr == 3e-4 && c.beta1 == 0.8 && c.beta2 == 0.95 && c.eps == 1e-6);
  assert_true(c.weight_decay == 0.1 && c.max_grad_norm == 1);
  assert_int_equal(c.max_live_bytes, 77);
  assert_int_equal(c.working_dtype, ZK_BF16);
}

/* The proto path end to end: an empty SGD config finishes as torch.optim.SGD
 * with lr 1e-3 and no decay. */
static void test_config_from_proto_then_finish(void **state) {
  (void)state;
  proto_config p;
  proto_init(&p, ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD);
  job_config c = from_proto_ok(&p.config);
  char err[256] = "";
  assert_int_equal(job_config_finish(&c, DEFAULT_MAX_LIVE, err, sizeof err), 0);
  assert_int_equal(c.optimizer, JOB_SGD);
  assert_true(c.lr == 1e-3 && c.weight_decay == 0 && c.momentum == 0);
  assert_string_equal(job_optimizer_name(c.optimizer), "sgd");
  assert_string_equal(job_optimizer_name(JOB_ADAMW), "adamw");
  assert_string_equal(job_optimizer_name(JOB_ADAM), "adam");
}

/* ------------------------------------------------------------------------
 * job_config_finish: refusals
 * ------------------------------------------------------------------------ */

/* What GetJob and AttachReply show reads back as the same config. */
static void test_config_to_proto_round_trips(void **state) {
  static const job_config configs[] = {
      {.optimizer = JOB_ADAMW,
       .lr = 3e-4,
       .beta1 = 0.8,
       .beta2 = 0.95,
       .eps = 1e-6,
       .weight_decay = 0.1,
       .working_dtype = ZK_BF16,
       .max_live_bytes = 1 << 20,
       .max_grad_norm = 1.0,
       .collectives = JOB_FLAT,
       .quantized_weights = 1,
       .quantization_block = 128,
       .quantized_gradients = 4,
       .gradient_comm_dtype = ZK_F32,
       .hpz_partition_size = 1,
       .offload_device = JOB_OFFLOAD_NONE,
       .offload_buffer_count = 4,
       .offload_buffer_size = 1u << 20},
      {.optimizer = JOB_ADAM,
       .lr = 1e-3,
       .beta1 = 0.9,
       .beta2 = 0.999,
       .eps = 1e-8,
       .working_dtype = ZK_F32,
       .collectives = JOB_HIERARCHICAL,
       .quantization_block = 256,
       .gradient_comm_dtype = ZK_BF16,
       .hpz_partition_size = 2,
       .offload_device = JOB_OFFLOAD_NVME,
       .offload_buffer_count = 3,
       .offload_buffer_size = 4096,
       .nvme_path = "/mnt/nvme0/zerod"},
      {.optimizer = JOB_SGD,
       .lr = 0.1,
       .beta1 = 0.9,
       .beta2 = 0.999,
       .eps = 1e-8,
       .momentum = 0.9,
       .nesterov = 1,
       .working_dtype = ZK_F32,
       .collectives = JOB_FLAT,
       .quantized_weights = 1,
       .quantization_block = 128,
       .quantized_gradients = 4,
       .gradient_comm_dtype = ZK_F32,
       .hpz_partition_size = 1,
       .offload_device = JOB_OFFLOAD_NONE,
       .offload_buffer_count = 4,
       .offload_buffer_size = 1u << 20},
      {.optimizer = JOB_SGD,
       .lr = 0.1,
       .beta1 = 0.9,
       .beta2 = 0.999,
       .eps = 1e-8,
       .momentum = 0.5,
       .dampening = 0.25,
       .weight_decay = 0,
       .working_dtype = ZK_F32,
       .collectives = JOB_HIERARCHICAL,
       .quantization_block = 256,
       .gradient_comm_dtype = ZK_BF16,
       .hpz_partition_size = 1,
       .offload_device = JOB_OFFLOAD_NONE,
       .offload_buffer_count = 4,
       .offload_buffer_size = 1u << 20},
  };
  for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
    job_config_msg msg;
    job_config_to_proto(&configs[i], &msg);
    Zerod__V1__JobConfig proto = msg.config;
    assert_ptr_equal(proto.optimizer, &msg.optimizer);
    assert_true(msg.optimizer.has_weight_decay); /* SGD's 0 must not read back as a default */
    job_config back;
    char err[256] = "";
    if (job_config_from_proto(&proto, &back, err, sizeof err) != 0 ||
        job_config_finish(&back, 0, err, sizeof err) != 0)
      fail_msg("config %zu: %s", i, err);
    if (memcmp(&back, &configs[i], sizeof back) != 0)
      fail_msg("config %zu does not read back the same (lr %g/%g, wd %g/%g, dtype %d/%d)", i,
               back.lr, configs[i].lr, back.weight_decay, configs[i].weight_decay,
               back.working_dtype, configs[i].working_dtype);
  }
}

static void test_config_diff_names_each_differing_field(void **state) {
  job_config have = {.optimizer = JOB_ADAMW,
                     .lr = 1e-3,
                     .beta1 = 0.9,
                     .beta2 = 0.999,
                     .eps = 1e-8,
                     .weight_decay = 0.01,
                     .working_dtype = ZK_F32,
                     .max_live_bytes = 1024};
  job_config want = have;
  char fields[128], text[512];
  assert_int_equal(job_config_diff(&want, &have, fields, sizeof fields, text, sizeof text), 0);
  assert_string_equal(fields, "");
  assert_string_equal(text, "");
  want.lr = 0.5;
  want.working_dtype = ZK_BF16;
  want.nesterov = 1;
  assert_int_equal(job_config_diff(&want, &have, fields, sizeof fields, text, sizeof text), 3);
  assert_string_equal(fields, "lr,nesterov,working_dtype");
  assert_string_equal(text, "lr 0.5 (the job's 0.001), nesterov true (the job's false), "
                            "working_dtype bf16 (the job's f32)");
}

/* hpZ: 0 reads as 1 (off, DeepSpeed's default); flat collectives have no
 * node half to gather from. */
static void test_config_hpz_partition_size(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  assert_int_equal(c.hpz_partition_size, 1);
  c.hpz_partition_size = 8;
  expect_accepted(c);
  c.collectives = JOB_FLAT;
  expect_refused(c, "hpz_partition_size 8 needs hierarchical collectives (its gathers stay "
                    "inside the node); this job's are flat");
  c.collectives = JOB_HIERARCHICAL;
  c.hpz_partition_size = JOB_MAX_HPZ_PARTITION_SIZE + 1;
  expect_refused(c, "invalid hpz_partition_size 4097 (1: off, or the job's ranks per node, at "
                    "most 4096)");
}

static void test_config_rejects_negative_lr(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  c.lr = -1;
  expect_refused(c, "invalid learning rate -1 (must be > 0 and finite)");
}

static void test_config_rejects_infinite_lr(void **state) {
  (void)state;
  job_config c = finished(JOB_SGD);
  c.lr = INFINITY;
  expect_refused(c, "invalid learning rate inf (must be > 0 and finite)");
}

static void test_config_rejects_nan_lr(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAM);
  c.lr = NAN;
  expect_refused(c, "invalid learning rate nan (must be > 0 and finite)");
}

static void test_config_zero_lr_is_the_default(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  c.lr = 0;
  expect_accepted(c);
  c.lr = -0.0;
  expect_accepted(c);
}

static void test_config_rejects_beta1_of_one(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  c.beta1 = 1;
  expect_refused(c, "invalid betas (1, 0.999) (each in [0, 1))");
}

static void test_config_rejects_negative_beta2(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAM);
  c.beta2 = -0.5;
  expect_refused(c, "invalid betas (0.9, -0.5) (each in [0, 1))");
}

static void test_config_rejects_nan_beta(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAM);
  c.beta1 = NAN;
  expect_refused(c, "invalid betas (nan, 0.999) (each in [0, 1))");
}

static void test_config_accepts_betas_just_below_one(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  c.beta1 = nextafter(1.0, 0.0);
  c.beta2 = nextafter(1.0, 0.0);
  expect_accepted(c);
}

static void test_config_rejects_negative_eps(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  c.eps = -1e-8;
  expect_refused(c, "invalid eps -1e-08 (must be >= 0 and finite)");
}

static void test_config_rejects_infinite_eps(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAM);
  c.eps = INFINITY;
  expect_refused(c, "invalid eps inf (must be >= 0 and finite)");
}

static void test_config_rejects_negative_weight_decay(void **state) {
  (void)state;
  job_config c = finished(JOB_SGD);
  c.weight_decay = -0.01;
  expect_refused(c, "invalid weight decay -0.01 (must be >= 0 and finite)");
}

static void test_config_rejects_infinite_weight_decay(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  c.weight_decay = INFINITY;
  expect_refused(c, "invalid weight decay inf (must be >= 0 and finite)");
}

static void test_config_rejects_negative_momentum(void **state) {
  (void)state;
  job_config c = finished(JOB_SGD);
  c.momentum = -0.9;
  expect_refused(c, "invalid momentum -0.9 (must be >= 0 and finite)");
}

static void test_config_rejects_infinite_momentum(void **state) {
  (void)state;
  job_config c = finished(JOB_SGD);
  c.momentum = INFINITY;
  expect_refused(c, "invalid momentum inf (must be >= 0 and finite)");
}

static void test_config_rejects_nan_dampening(void **state) {
  (void)state;
  job_config c = finished(JOB_SGD);
  c.momentum = 0.9;
  c.dampening = NAN;
  expect_refused(c, "invalid dampening nan (must be finite)");
}

static void test_config_accepts_any_finite_dampening(void **state) {
  (void)state;
  /* torch.optim.SGD checks no range for it. */
  job_config c = finished(JOB_SGD);
  c.momentum = 0.9;
  c.dampening = -2;
  expect_accepted(c);
  c.dampening = 3;
  expect_accepted(c);
}

static void test_config_rejects_negative_max_grad_norm(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  c.max_grad_norm = -1;
  expect_refused(c, "invalid max_grad_norm -1 (must be >= 0 and finite; 0 is off)");
}

static void test_config_rejects_nan_max_grad_norm(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  c.max_grad_norm = NAN;
  expect_refused(c, "invalid max_grad_norm nan (must be >= 0 and finite; 0 is off)");
}

static void test_config_rejects_infinite_max_grad_norm(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  c.max_grad_norm = INFINITY;
  expect_refused(c, "invalid max_grad_norm inf (must be >= 0 and finite; 0 is off)");
}

static void test_config_rejects_nesterov_without_momentum(void **state) {
  (void)state;
  job_config c = finished(JOB_SGD);
  c.nesterov = 1;
  expect_refused(c, "nesterov momentum requires a momentum and zero dampening");
}

static void test_config_rejects_nesterov_with_dampening(void **state) {
  (void)state;
  job_config c = finished(JOB_SGD);
  c.nesterov = 1;
  c.momentum = 0.9;
  c.dampening = 0.1;
  expect_refused(c, "nesterov momentum requires a momentum and zero dampening");
}

static void test_config_accepts_nesterov_with_momentum(void **state) {
  (void)state;
  job_config c = finished(JOB_SGD);
  c.nesterov = 1;
  c.momentum = 0.9;
  expect_accepted(c);
  /* Adam ignores nesterov, as it ignores momentum. */
  c = finished(JOB_ADAM);
  c.nesterov = 1;
  expect_accepted(c);
}

static void test_config_rejects_unknown_optimizer(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  c.optimizer = (job_optimizer)9;
  expect_refused(c, "unknown optimizer 9");
  /* From the protocol too: an unknown kind is not taken for AdamW. */
  proto_config p;
  proto_init(&p, (Zerod__V1__OptimizerKind)7);
  c = from_proto_ok(&p.config);
  expect_refused(c, "unknown optimizer 7");
}

static void test_config_rejects_bad_working_dtype(void **state) {
  (void)state;
  job_config c = finished(JOB_ADAMW);
  c.working_dtype = (zk_dtype)9;
  expect_refused(c, "working precision must be fp32, bf16 or fp16");
}

/* ------------------------------------------------------------------------
 * job_config_states
 * ------------------------------------------------------------------------ */

static void expect_states(job_config c, int master, int moment1, int moment2) {
  int has[JOB_NSTATES] = {-1, -1, -1};
  assert_int_equal(job_config_states(&c, has), master + moment1 + moment2);
  assert_int_equal(has[JOB_STATE_MASTER], master);
  assert_int_equal(has[JOB_STATE_MOMENT1], moment1);
  assert_int_equal(has[JOB_STATE_MOMENT2], moment2);
}

static void test_states_of_adamw_and_adam(void **state) {
  (void)state;
  expect_states(finished(JOB_ADAMW), 1, 1, 1);
  expect_states(finished(JOB_ADAM), 1, 1, 1);
}

static void test_states_of_sgd_without_momentum(void **state) {
  (void)state;
  expect_states(finished(JOB_SGD), 1, 0, 0);
}

static void test_states_of_sgd_with_momentum(void **state) {
  (void)state;
  job_config c = finished(JOB_SGD);
  c.momentum = 0.9;
  expect_states(c, 1, 1, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_from_proto_null_is_adamw_with_weight_decay),
      cmocka_unit_test(test_from_proto_without_optimizer_is_adamw),
      cmocka_unit_test(test_from_proto_null_is_an_empty_config),
      cmocka_unit_test(test_from_proto_unspecified_kind_is_adamw),
      cmocka_unit_test(test_from_proto_sgd_and_adam_have_no_default_weight_decay),
      cmocka_unit_test(test_from_proto_honors_has_weight_decay),
      cmocka_unit_test(test_from_proto_copies_every_field),
      cmocka_unit_test(test_from_proto_rejects_bad_working_dtype),
      cmocka_unit_test(test_config_finish_fills_torch_defaults),
      cmocka_unit_test(test_config_finish_keeps_set_values),
      cmocka_unit_test(test_config_from_proto_then_finish),
      cmocka_unit_test(test_config_to_proto_round_trips),
      cmocka_unit_test(test_config_diff_names_each_differing_field),
      cmocka_unit_test(test_config_hpz_partition_size),
      cmocka_unit_test(test_config_rejects_negative_lr),
      cmocka_unit_test(test_config_rejects_infinite_lr),
      cmocka_unit_test(test_config_rejects_nan_lr),
      cmocka_unit_test(test_config_zero_lr_is_the_default),
      cmocka_unit_test(test_config_rejects_beta1_of_one),
      cmocka_unit_test(test_config_rejects_negative_beta2),
      cmocka_unit_test(test_config_rejects_nan_beta),
      cmocka_unit_test(test_config_accepts_betas_just_below_one),
      cmocka_unit_test(test_config_rejects_negative_eps),
      cmocka_unit_test(test_config_rejects_infinite_eps),
      cmocka_unit_test(test_config_rejects_negative_weight_decay),
      cmocka_unit_test(test_config_rejects_infinite_weight_decay),
      cmocka_unit_test(test_config_rejects_negative_momentum),
      cmocka_unit_test(test_config_rejects_infinite_momentum),
      cmocka_unit_test(test_config_rejects_nan_dampening),
      cmocka_unit_test(test_config_accepts_any_finite_dampening),
      cmocka_unit_test(test_config_rejects_negative_max_grad_norm),
      cmocka_unit_test(test_config_rejects_nan_max_grad_norm),
      cmocka_unit_test(test_config_rejects_infinite_max_grad_norm),
      cmocka_unit_test(test_config_rejects_nesterov_without_momentum),
      cmocka_unit_test(test_config_rejects_nesterov_with_dampening),
      cmocka_unit_test(test_config_accepts_nesterov_with_momentum),
      cmocka_unit_test(test_config_rejects_unknown_optimizer),
      cmocka_unit_test(test_config_rejects_bad_working_dtype),
      cmocka_unit_test(test_fp16_scales_the_loss_by_default),
      cmocka_unit_test(test_states_of_adamw_and_adam),
      cmocka_unit_test(test_states_of_sgd_without_momentum),
      cmocka_unit_test(test_states_of_sgd_with_momentum),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
