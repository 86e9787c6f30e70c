/* Job configs: the protocol's JobConfig turned into a job_config, torch's
 * defaults and the ranges torch.optim accepts (config.h). */
#include "config.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "names.h"

int job_config_from_proto(const Zerod__V1__JobConfig *pc, job_config *c, char *err,
                          size_t err_bytes) {
  /* No config, or one without an optimizer, is AdamW with its default
   * weight decay, as in torch.optim. */
  memset(c, 0, sizeof *c);
  c->optimizer = JOB_ADAMW;
  c->weight_decay = 0.01;
  c->working_dtype = ZK_F32;
  if (pc == NULL)
    return 0;
  if (pc->optimizer != NULL) {
    const Zerod__V1__OptimizerConfig *o = pc->optimizer;
    c->optimizer = o->kind == ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_UNSPECIFIED
                       ? JOB_ADAMW
                       : (job_optimizer)o->kind;
    c->lr = o->lr;
    c->beta1 = o->beta1;
    c->beta2 = o->beta2;
    c->eps = o->eps;
    c->weight_decay =
        o->has_weight_decay ? o->weight_decay : (c->optimizer == JOB_ADAMW ? 0.01 : 0.0);
    c->momentum = o->momentum;
    c->dampening = o->dampening;
    c->nesterov = o->nesterov;
  }
  switch (pc->working_dtype) {
  case ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED:
  case ZEROD__V1__DTYPE__DTYPE_F32:
    c->working_dtype = ZK_F32;
    break;
  case ZEROD__V1__DTYPE__DTYPE_BF16:
    c->working_dtype = ZK_BF16;
    break;
  case ZEROD__V1__DTYPE__DTYPE_F16:
    c->working_dtype = ZK_F16;
    break;
  default:
    snprintf(err, err_bytes, "working precision must be fp32, bf16 or fp16");
    return -EINVAL;
  }
  c->max_live_bytes = pc->max_live_bytes;
  c->loss_scale = pc->loss_scale;
  c->loss_scale_window = pc->loss_scale_window;
  c->loss_scale_growth = pc->loss_scale_growth;
  c->loss_scale_backoff = pc->loss_scale_backoff;
  c->loss_scale_hysteresis = pc->loss_scale_hysteresis;
  c->loss_scale_min = pc->loss_scale_min;
  c->max_grad_norm = pc->max_grad_norm;
  c->quantized_weights = pc->quantized_weights;
  c->quantization_block = pc->quantization_block;
  c->quantized_gradients = pc->quantized_gradients;
  c->hpz_partition_size = pc->hpz_partition_size;
  c->onebit_freeze_step = pc->onebit_freeze_step;
  c->powersgd_rank = pc->powersgd_rank;
  c->powersgd_start_step = pc->powersgd_start_step;
  const Zerod__V1__OffloadConfig *off = pc->offload_optimizer;
  if (off != NULL) {
    switch (off->device) {
    case ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_UNSPECIFIED:
    case ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NONE:
      c->offload_device = JOB_OFFLOAD_NONE;
      break;
    case ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_CPU:
      c->offload_device = JOB_OFFLOAD_CPU;
      break;
    case ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME:
      c->offload_device = JOB_OFFLOAD_NVME;
      break;
    default:
      snprintf(err, err_bytes, "unknown offload_optimizer device %d (none, cpu or nvme)",
               (int)off->device);
      return -EINVAL;
    }
    if (strlen(off->nvme_path) >= sizeof c->nvme_path) {
      snprintf(err, err_bytes, "offload_optimizer nvme_path is longer than %zu bytes",
               sizeof c->nvme_path - 1);
      return -EINVAL;
    }
    snprintf(c->nvme_path, sizeof c->nvme_path, "%s", off->nvme_path);
    c->offload_buffer_count = off->buffer_count;
    c->offload_buffer_size = off->buffer_size;
    c->offload_pin_memory = off->pin_memory;
  }
  if (pc->base_job != NULL && pc->base_job[0] != '\0') {
    if (!zd_valid_name(pc->base_job)) {
      snprintf(err, err_bytes, "base must be a job name: 1..%d bytes of [A-Za-z0-9._-]",
               ZD_NAME_MAX_BYTES);
      return -EINVAL;
    }
    snprintf(c->base, sizeof c->base, "%s", pc->base_job);
  }
  switch (pc->gradient_comm_dtype) {
  case ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED:
  case ZEROD__V1__DTYPE__DTYPE_F32:
    c->gradient_comm_dtype = ZK_F32;
    break;
  case ZEROD__V1__DTYPE__DTYPE_BF16:
    c->gradient_comm_dtype = ZK_BF16;
    break;
  default:
    snprintf(err, err_bytes, "gradient_comm_dtype must be fp32 or bf16");
    return -EINVAL;
  }
  switch (pc->collectives) {
  case ZEROD__V1__COLLECTIVES__COLLECTIVES_UNSPECIFIED:
  case ZEROD__V1__COLLECTIVES__COLLECTIVES_HIERARCHICAL:
    c->collectives = JOB_HIERARCHICAL;
    break;
  case ZEROD__V1__COLLECTIVES__COLLECTIVES_FLAT:
    c->collectives = JOB_FLAT;
    break;
  default:
    snprintf(err, err_bytes, "unknown collectives %d (hierarchical or flat)", (int)pc->collectives);
    return -EINVAL;
  }
  return 0;
}

const char *job_optimizer_name(job_optimizer o) {
  return o == JOB_ADAMW ? "adamw" : o == JOB_ADAM ? "adam" : "sgd";
}

/* Why the cross-node gradient sums cannot be compressed (by 1-bit Adam or
 * low-rank compression) in this job, or NULL: another wire already
 * compresses them, or there is no cross-node half to compress. */
static const char *cross_sums_taken(const job_config *c) {
  if (c->quantized_gradients != 0)
    return "quantized_gradients (qgZ) compresses the same sums; use one of them";
  if (c->gradient_comm_dtype != ZK_F32)
    return "gradient_comm_dtype bf16 sends the same sums in bf16; leave it fp32";
  if (c->collectives == JOB_FLAT)
    return "its collectives are flat (the compressed sums are the cross-node half of a "
           "hierarchical reduce)";
  return NULL;
}

/* 1-bit Adam and what it rules out (its wire replaces qgZ's and bf16's, and
 * its frozen second moment is Adam's). */
static int onebit_check(const job_config *c, char *err, size_t err_bytes) {
  if (c->onebit_freeze_step == 0)
    return 0;
  const char *why = NULL;
  if (c->optimizer != JOB_ADAM && c->optimizer != JOB_ADAMW)
    why = "its optimizer is not Adam or AdamW";
  else if ((why = cross_sums_taken(c)) == NULL && c->quantization_block % 8 != 0)
    why = "quantization_block is not a multiple of 8 (each block's signs start a byte)";
  if (why == NULL)
    return 0;
  snprintf(err, err_bytes, "onebit_freeze_step %u (1-bit Adam) cannot apply: %s",
           c->onebit_freeze_step, why);
  return -EINVAL;
}

/* Low-rank compression and what it rules out (the same sums as 1-bit
 * Adam's). */
static int powersgd_check(const job_config *c, char *err, size_t err_bytes) {
  if (c->powersgd_rank == 0 && c->powersgd_start_step != 0) {
    snprintf(err, err_bytes, "powersgd_start_step %u needs powersgd_rank (low-rank compression)",
             c->powersgd_start_step);
    return -EINVAL;
  }
  if (c->powersgd_rank == 0)
    return 0;
  const char *why = NULL;
  if (c->powersgd_rank > JOB_MAX_POWERSGD_RANK)
    why = "the rank is over " JOB_MAX_POWERSGD_RANK_TEXT;
  else if (c->onebit_freeze_step != 0)
    why = "onebit_freeze_step (1-bit Adam) compresses the same sums; use one of them";
  else
    why = cross_sums_taken(c);
  if (why == NULL)
    return 0;
  snprintf(err, err_bytes, "powersgd_rank %u (low-rank compression) cannot apply: %s",
           c->powersgd_rank, why);
  return -EINVAL;
}

/* The algorithm and how the job's collectives run: defaults, then checks. */
static int finish_collectives(job_config *c, char *err, size_t err_bytes) {
  if (c->optimizer == 0)
    c->optimizer = JOB_ADAMW;
  if (c->optimizer != JOB_ADAMW && c->optimizer != JOB_ADAM && c->optimizer != JOB_SGD) {
    snprintf(err, err_bytes, "unknown optimizer %d", (int)c->optimizer);
    return -EINVAL;
  }
  if (c->collectives == 0)
    c->collectives = JOB_HIERARCHICAL;
  if (c->collectives != JOB_HIERARCHICAL && c->collectives != JOB_FLAT) {
    snprintf(err, err_bytes, "unknown collectives %d (hierarchical or flat)", (int)c->collectives);
    return -EINVAL;
  }
  if (c->quantization_block == 0)
    c->quantization_block = JOB_DEFAULT_QUANTIZATION_BLOCK;
  if (c->quantization_block % 2 != 0 || c->quantization_block > (1u << 20)) {
    snprintf(err, err_bytes, "invalid quantization_block %u (an even number, 2..1048576)",
             c->quantization_block);
    return -EINVAL;
  }
  if (c->quantized_gradients != 0 && c->quantized_gradients != 8 && c->quantized_gradients != 4) {
    snprintf(err, err_bytes, "invalid quantized_gradients %u (0: off, 8 or 4 bits)",
             c->quantized_gradients);
    return -EINVAL;
  }
  if (c->gradient_comm_dtype == 0)
    c->gradient_comm_dtype = ZK_F32;
  if (c->gradient_comm_dtype != ZK_F32 && c->gradient_comm_dtype != ZK_BF16) {
    snprintf(err, err_bytes, "gradient_comm_dtype must be fp32 or bf16");
    return -EINVAL;
  }
  if (c->hpz_partition_size == 0)
    c->hpz_partition_size = 1;
  if (onebit_check(c, err, err_bytes) != 0 || powersgd_check(c, err, err_bytes) != 0)
    return -EINVAL;
  if (c->hpz_partition_size > 1 && c->collectives == JOB_FLAT) {
    snprintf(err, err_bytes,
             "hpz_partition_size %u needs hierarchical collectives (its gathers stay inside "
             "the node); this job's are flat",
             c->hpz_partition_size);
    return -EINVAL;
  }
  return 0;
}

/* offload_optimizer and what it rules out. */
static int finish_offload(job_config *c, char *err, size_t err_bytes) {
  if (c->offload_device == 0)
    c->offload_device = JOB_OFFLOAD_NONE;
  if (c->offload_device < JOB_OFFLOAD_NONE || c->offload_device > JOB_OFFLOAD_NVME) {
    snprintf(err, err_bytes, "unknown offload_optimizer device %d (none, cpu or nvme)",
             (int)c->offload_device);
    return -EINVAL;
  }
  if (c->offload_buffer_count == 0)
    c->offload_buffer_count = JOB_DEFAULT_OFFLOAD_BUFFERS;
  if (c->offload_buffer_size == 0)
    c->offload_buffer_size = JOB_DEFAULT_OFFLOAD_ELEMENTS;
  if (c->offload_buffer_count < 2 || c->offload_buffer_count > JOB_MAX_OFFLOAD_BUFFERS) {
    snprintf(err, err_bytes, "invalid offload_optimizer buffer_count %u (2..%d)",
             c->offload_buffer_count, JOB_MAX_OFFLOAD_BUFFERS);
    return -EINVAL;
  }
  if (c->offload_buffer_size % 1024 != 0 || c->offload_buffer_size < 1024 ||
      c->offload_buffer_size > (1ull << 28)) {
    snprintf(err, err_bytes,
             "invalid offload_optimizer buffer_size %llu (elements per buffer and state: a "
             "multiple of 1024, 1024..268435456)",
             (unsigned long long)c->offload_buffer_size);
    return -EINVAL;
  }
  if (c->offload_device != JOB_OFFLOAD_NVME && c->nvme_path[0] != '\0') {
    snprintf(err, err_bytes, "offload_optimizer nvme_path is for device nvme");
    return -EINVAL;
  }
  if (c->offload_device == JOB_OFFLOAD_NVME && c->quantized_weights) {
    snprintf(err, err_bytes,
             "quantized_weights (qwZ) quantizes the fp32 master weights, which offload_optimizer "
             "nvme keeps on disk: not both yet");
    return -EINVAL;
  }
  if (c->hpz_partition_size > JOB_MAX_HPZ_PARTITION_SIZE) {
    snprintf(err, err_bytes,
             "invalid hpz_partition_size %u (1: off, or the job's ranks per node, at most %d)",
             c->hpz_partition_size, JOB_MAX_HPZ_PARTITION_SIZE);
    return -EINVAL;
  }
  return 0;
}

/* The hyper-parameters' and the loss scaling's defaults, the working
 * precision. */
static int finish_numerics(job_config *c, uint64_t default_max_live_bytes, char *err,
                           size_t err_bytes) {
  if (c->lr == 0)
    c->lr = 1e-3;
  if (c->beta1 == 0)
    c->beta1 = 0.9;
  if (c->beta2 == 0)
    c->beta2 = 0.999;
  if (c->eps == 0)
    c->eps = 1e-8;
  if (c->max_live_bytes == 0)
    c->max_live_bytes = default_max_live_bytes;
  if (c->working_dtype != ZK_F32 && c->working_dtype != ZK_BF16 && c->working_dtype != ZK_F16) {
    snprintf(err, err_bytes, "working precision must be fp32, bf16 or fp16");
    return -EINVAL;
  }
  if (!isfinite(c->loss_scale) || !isfinite(c->loss_scale_growth) ||
      !isfinite(c->loss_scale_backoff) || !isfinite(c->loss_scale_min)) {
    snprintf(err, err_bytes, "the loss scaling settings must be finite");
    return -EINVAL;
  }
  if (c->loss_scale == 0)
    c->loss_scale = c->working_dtype == ZK_F16 ? 65536.0 : -1;
  if (c->loss_scale < 0) {
    /* Off: the other settings stay as given, 0 when unset. */
    c->loss_scale = 0;
  } else {
    if (c->loss_scale_window == 0)
      c->loss_scale_window = 2000;
    if (c->loss_scale_growth == 0)
      c->loss_scale_growth = 2.0;
    if (c->loss_scale_backoff == 0)
      c->loss_scale_backoff = 0.5;
    if (c->loss_scale_hysteresis == 0)
      c->loss_scale_hysteresis = 1;
    if (c->loss_scale_min == 0)
      c->loss_scale_min = 1.0;
    if (c->loss_scale_growth < 1 || !(c->loss_scale_backoff > 0 && c->loss_scale_backoff < 1) ||
        !(c->loss_scale_min > 0) || c->loss_scale < c->loss_scale_min) {
      snprintf(err, err_bytes,
               "invalid loss scaling: growth %g (>= 1), backoff %g (in (0, 1)), min %g (> 0, "
               "at most the initial scale %g)",
               c->loss_scale_growth, c->loss_scale_backoff, c->loss_scale_min, c->loss_scale);
      return -EINVAL;
    }
  }
  return 0;
}

static int check_hyperparameters(const job_config *c, char *err, size_t err_bytes) {
  /* The checks torch.optim makes, so a bad config fails at creation and not
   * at the first step, and finiteness, which torch does not check: an
   * infinite momentum or a NaN dampening turns the weights into NaN, and a
   * checkpoint's manifest (JSON) cannot hold a non-finite number, so every
   * save of such a job would fail. Each message names the field and its
   * range and has no prefix: callers say whose config it is ("job 'x': "). */
  if (!(c->lr > 0) || !isfinite(c->lr)) {
    snprintf(err, err_bytes, "invalid learning rate %g (must be > 0 and finite)", c->lr);
    return -EINVAL;
  }
  if (!(c->beta1 >= 0 && c->beta1 < 1) || !(c->beta2 >= 0 && c->beta2 < 1)) {
    snprintf(err, err_bytes, "invalid betas (%g, %g) (each in [0, 1))", c->beta1, c->beta2);
    return -EINVAL;
  }
  if (!(c->eps >= 0) || !isfinite(c->eps)) {
    snprintf(err, err_bytes, "invalid eps %g (must be >= 0 and finite)", c->eps);
    return -EINVAL;
  }
  if (!(c->weight_decay >= 0) || !isfinite(c->weight_decay)) {
    snprintf(err, err_bytes, "invalid weight decay %g (must be >= 0 and finite)", c->weight_decay);
    return -EINVAL;
  }
  if (!(c->momentum >= 0) || !isfinite(c->momentum)) {
    snprintf(err, err_bytes, "invalid momentum %g (must be >= 0 and finite)", c->momentum);
    return -EINVAL;
  }
  if (!isfinite(c->dampening)) {
    snprintf(err, err_bytes, "invalid dampening %g (must be finite)", c->dampening);
    return -EINVAL;
  }
  if (!(c->max_grad_norm >= 0) || !isfinite(c->max_grad_norm)) {
    snprintf(err, err_bytes, "invalid max_grad_norm %g (must be >= 0 and finite; 0 is off)",
             c->max_grad_norm);
    return -EINVAL;
  }
  if (c->optimizer == JOB_SGD && c->nesterov && (c->momentum <= 0 || c->dampening != 0)) {
    snprintf(err, err_bytes, "nesterov momentum requires a momentum and zero dampening");
    return -EINVAL;
  }
  return 0;
}

int job_config_finish(job_config *c, uint64_t default_max_live_bytes, char *err, size_t err_bytes) {
  int rc = finish_collectives(c, err, err_bytes);
  if (rc == 0)
    rc = finish_offload(c, err, err_bytes);
  if (rc == 0)
    rc = finish_numerics(c, default_max_live_bytes, err, err_bytes);
  return rc == 0 ? check_hyperparameters(c, err, err_bytes) : rc;
}

int job_config_states(const job_config *c, int has[JOB_NSTATES]) {
  has[JOB_STATE_MASTER] = 1;
  has[JOB_STATE_MOMENT1] = c->optimizer != JOB_SGD || c->momentum != 0;
  has[JOB_STATE_MOMENT2] = c->optimizer != JOB_SGD;
  return has[JOB_STATE_MASTER] + has[JOB_STATE_MOMENT1] + has[JOB_STATE_MOMENT2];
}

Zerod__V1__Dtype job_dtype_to_proto(zk_dtype d) {
  switch (d) {
  case ZK_F32:
    return ZEROD__V1__DTYPE__DTYPE_F32;
  case ZK_BF16:
    return ZEROD__V1__DTYPE__DTYPE_BF16;
  case ZK_F16:
    return ZEROD__V1__DTYPE__DTYPE_F16;
  default:
    return ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED;
  }
}

void job_config_to_proto(const job_config *c, job_config_msg *msg) {
  Zerod__V1__JobConfig *out = &msg->config;
  Zerod__V1__OptimizerConfig *opt = &msg->optimizer;
  Zerod__V1__OffloadConfig *off = &msg->offload;
  zerod__v1__optimizer_config__init(opt);
  opt->kind = (Zerod__V1__OptimizerKind)c->optimizer;
  opt->lr = c->lr;
  opt->beta1 = c->beta1;
  opt->beta2 = c->beta2;
  opt->eps = c->eps;
  opt->weight_decay = c->weight_decay;
  opt->has_weight_decay = 1;
  opt->momentum = c->momentum;
  opt->dampening = c->dampening;
  opt->nesterov = c->nesterov;
  zerod__v1__job_config__init(out);
  out->optimizer = opt;
  out->working_dtype = job_dtype_to_proto(c->working_dtype);
  out->max_live_bytes = c->max_live_bytes;
  out->max_grad_norm = c->max_grad_norm;
  out->collectives = (Zerod__V1__Collectives)c->collectives;
  out->quantized_weights = c->quantized_weights != 0;
  out->quantization_block = c->quantization_block;
  out->quantized_gradients = c->quantized_gradients;
  out->gradient_comm_dtype = job_dtype_to_proto(c->gradient_comm_dtype);
  out->hpz_partition_size = c->hpz_partition_size;
  out->onebit_freeze_step = c->onebit_freeze_step;
  out->powersgd_rank = c->powersgd_rank;
  out->powersgd_start_step = c->powersgd_start_step;
  /* A finished config's 0 is off, which the protocol spells negative. */
  out->loss_scale = c->loss_scale > 0 ? c->loss_scale : -1;
  out->loss_scale_window = c->loss_scale_window;
  out->loss_scale_growth = c->loss_scale_growth;
  out->loss_scale_backoff = c->loss_scale_backoff;
  out->loss_scale_hysteresis = c->loss_scale_hysteresis;
  out->loss_scale_min = c->loss_scale_min;
  zerod__v1__offload_config__init(off);
  off->device = (Zerod__V1__OffloadDevice)c->offload_device;
  snprintf(msg->nvme_path, sizeof msg->nvme_path, "%s", c->nvme_path);
  off->nvme_path = msg->nvme_path;
  off->buffer_count = c->offload_buffer_count;
  off->buffer_size = c->offload_buffer_size;
  off->pin_memory = c->offload_pin_memory != 0;
  out->offload_optimizer = off;
  snprintf(msg->base, sizeof msg->base, "%s", c->base);
  out->base_job = msg->base;
}

const char *job_offload_name(job_offload o) {
  return o == JOB_OFFLOAD_NVME ? "nvme" : o == JOB_OFFLOAD_CPU ? "cpu" : "none";
}

const char *job_collectives_name(job_collectives c) {
  return c == JOB_FLAT ? "flat" : "hierarchical";
}

/* Appends ", NAME VALUE (the job's VALUE)" to text and ",NAME" to fields. */
static void append_difference(char *text, size_t text_bytes, char *fields, size_t fields_bytes,
                              const char *name, const char *want, const char *have) {
  size_t len = strlen(text), flen = strlen(fields);
  if (len < text_bytes)
    snprintf(text + len, text_bytes - len, "%s%s %s (the job's %s)", flen ? ", " : "", name, want,
             have);
  if (flen < fields_bytes)
    snprintf(fields + flen, fields_bytes - flen, "%s%s", flen ? "," : "", name);
}

int job_config_diff(const job_config *want, const job_config *have, char *fields,
                    size_t fields_bytes, char *text, size_t text_bytes) {
  char a[64], b[64];
  int n = 0;
  fields[0] = '\0';
  text[0] = '\0';
#define DIFFERS(name, cond, fmt, x, y)                                                             \
  if (cond) {                                                                                      \
    snprintf(a, sizeof a, fmt, x);                                                                 \
    snprintf(b, sizeof b, fmt, y);                                                                 \
    append_difference(text, text_bytes, fields, fields_bytes, name, a, b);                         \
    n++;                                                                                           \
  }
  DIFFERS("optimizer", want->optimizer != have->optimizer, "%s",
          job_optimizer_name(want->optimizer), job_optimizer_name(have->optimizer));
  DIFFERS("lr", want->lr != have->lr, "%g", want->lr, have->lr);
  DIFFERS("beta1", want->beta1 != have->beta1, "%g", want->beta1, have->beta1);
  DIFFERS("beta2", want->beta2 != have->beta2, "%g", want->beta2, have->beta2);
  DIFFERS("eps", want->eps != have->eps, "%g", want->eps, have->eps);
  DIFFERS("weight_decay", want->weight_decay != have->weight_decay, "%g", want->weight_decay,
          have->weight_decay);
  DIFFERS("momentum", want->momentum != have->momentum, "%g", want->momentum, have->momentum);
  DIFFERS("dampening", want->dampening != have->dampening, "%g", want->dampening, have->dampening);
  DIFFERS("nesterov", want->nesterov != have->nesterov, "%s", want->nesterov ? "true" : "false",
          have->nesterov ? "true" : "false");
  DIFFERS("working_dtype", want->working_dtype != have->working_dtype, "%s",
          zk_dtype_name(want->working_dtype), zk_dtype_name(have->working_dtype));
  DIFFERS("max_live_bytes", want->max_live_bytes != have->max_live_bytes, "%llu",
          (unsigned long long)want->max_live_bytes, (unsigned long long)have->max_live_bytes);
  DIFFERS("max_grad_norm", want->max_grad_norm != have->max_grad_norm, "%g", want->max_grad_norm,
          have->max_grad_norm);
  DIFFERS("collectives", want->collectives != have->collectives, "%s",
          job_collectives_name(want->collectives), job_collectives_name(have->collectives));
  DIFFERS("quantized_weights", want->quantized_weights != have->quantized_weights, "%s",
          want->quantized_weights ? "true" : "false", have->quantized_weights ? "true" : "false");
  DIFFERS("quantization_block", want->quantization_block != have->quantization_block, "%u",
          want->quantization_block, have->quantization_block);
  DIFFERS("quantized_gradients", want->quantized_gradients != have->quantized_gradients, "%u",
          want->quantized_gradients, have->quantized_gradients);
  DIFFERS("gradient_comm_dtype", want->gradient_comm_dtype != have->gradient_comm_dtype, "%s",
          zk_dtype_name(want->gradient_comm_dtype), zk_dtype_name(have->gradient_comm_dtype));
  DIFFERS("loss_scale", want->loss_scale != have->loss_scale, "%g", want->loss_scale,
          have->loss_scale);
  DIFFERS("hpz_partition_size", want->hpz_partition_size != have->hpz_partition_size, "%u",
          want->hpz_partition_size, have->hpz_partition_size);
  DIFFERS("onebit_freeze_step", want->onebit_freeze_step != have->onebit_freeze_step, "%u",
          want->onebit_freeze_step, have->onebit_freeze_step);
  DIFFERS("powersgd_rank", want->powersgd_rank != have->powersgd_rank, "%u", want->powersgd_rank,
          have->powersgd_rank);
  DIFFERS("powersgd_start_step", want->powersgd_start_step != have->powersgd_start_step, "%u",
          want->powersgd_start_step, have->powersgd_start_step);
  DIFFERS("offload_optimizer", want->offload_device != have->offload_device, "%s",
          job_offload_name(want->offload_device), job_offload_name(have->offload_device));
#undef DIFFERS
  return n;
}

void job_group_of_config(const job_config *c, double lr, job_group *out) {
  out->lr = lr;
  out->beta1 = c->beta1;
  out->beta2 = c->beta2;
  out->eps = c->eps;
  out->weight_decay = c->weight_decay;
  out->momentum = c->momentum;
  out->dampening = c->dampening;
  out->nesterov = c->nesterov;
}

int job_group_from_proto(const job_config *job, const Zerod__V1__OptimizerConfig *o, job_group *out,
                         char *err, size_t err_bytes) {
  if (o->kind != ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_UNSPECIFIED &&
      (job_optimizer)o->kind != job->optimizer) {
    snprintf(err, err_bytes, "a group's optimizer must be the job's (%s): one algorithm per job",
             job_optimizer_name(job->optimizer));
    return -EINVAL;
  }
  if (job->optimizer == JOB_SGD && job->momentum == 0 && o->momentum != 0) {
    snprintf(err, err_bytes,
             "a group's momentum needs a job that keeps momentum buffers (the job's momentum "
             "is 0: create it with momentum > 0)");
    return -EINVAL;
  }
  job_config c = *job;
  c.lr = o->lr != 0 ? o->lr : job->lr;
  c.beta1 = o->beta1 != 0 ? o->beta1 : job->beta1;
  c.beta2 = o->beta2 != 0 ? o->beta2 : job->beta2;
  c.eps = o->eps != 0 ? o->eps : job->eps;
  c.weight_decay = o->has_weight_decay ? o->weight_decay : job->weight_decay;
  c.momentum = o->momentum;
  c.dampening = o->dampening;
  c.nesterov = o->nesterov;
  int rc = job_config_finish(&c, c.max_live_bytes, err, err_bytes);
  if (rc == 0)
    job_group_of_config(&c, c.lr, out);
  return rc;
}
