/* config: a job's optimizer and precision config (docs/architecture.md), one
 * copy of its defaults and rules for the node daemon and the coordinator.
 *
 * The protocol's JobConfig (ipc.proto; control.proto reuses it) becomes a
 * job_config with job_config_from_proto; job_config_finish fills in
 * torch.optim's defaults and refuses what torch.optim would refuse, so a
 * bad config fails when the job is created and never at its first step. */
#ifndef ZEROD_CONFIG_H
#define ZEROD_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "zerod/v1/ipc.pb-c.h"
#include "zk.h"

typedef enum job_optimizer { JOB_ADAMW = 1, JOB_ADAM = 2, JOB_SGD = 3 } job_optimizer;

typedef enum job_collectives { JOB_HIERARCHICAL = 1, JOB_FLAT = 2 } job_collectives;

/* Where the optimizer state lives (OffloadConfig). */
typedef enum job_offload {
  JOB_OFFLOAD_NONE = 1,
  JOB_OFFLOAD_CPU = 2,
  JOB_OFFLOAD_NVME = 3
} job_offload;

#define JOB_NVME_PATH_BYTES          256
#define JOB_DEFAULT_OFFLOAD_BUFFERS  4
#define JOB_MAX_OFFLOAD_BUFFERS      64
#define JOB_DEFAULT_OFFLOAD_ELEMENTS (1u << 20)

typedef struct job_config {
  job_optimizer optimizer;
  double lr, beta1, beta2, eps, weight_decay;
  double momentum, dampening;
  int nesterov;
  zk_dtype working_dtype; /* ZK_F32 or ZK_BF16; gradient buffers use it too */
  uint64_t max_live_bytes;
  double max_grad_norm;
  job_collectives collectives;  /* for a job whose ranks span nodes */
  int quantized_weights;        /* qwZ, for a job whose ranks span nodes */
  uint32_t quantization_block;  /* elements per block; finish: 256 */
  uint32_t quantized_gradients; /* qgZ: 0, 8 or 4 */
  zk_dtype gradient_comm_dtype; /* ZK_F32 or ZK_BF16 (finish: F32) */
  uint32_t hpz_partition_size;  /* hpZ: 1 (off; finish: 0 -> 1) or ranks per node */
  uint32_t onebit_freeze_step;  /* 1-bit Adam after this many exact steps; 0: off */
  uint32_t powersgd_rank;       /* low-rank gradient compression's rank; 0: off */
  uint32_t powersgd_start_step; /* ... after this many exact steps */
  /* Dynamic loss scaling; loss_scale 0 after finish: off. */
  double loss_scale, loss_scale_growth, loss_scale_backoff, loss_scale_min;
  uint32_t loss_scale_window, loss_scale_hysteresis;
  /* offload_optimizer (finish: NONE, 4 buffers of 1 Mi elements). */
  job_offload offload_device;
  uint32_t offload_buffer_count;
  uint64_t offload_buffer_size;
  int offload_pin_memory;
  char nvme_path[JOB_NVME_PATH_BYTES]; /* "": the daemon's first --nvme-dir */
  char base[65];                       /* the base job's name (docs/bases.md); "": none */
} job_config;

/* A parameter group's hyper-parameters (zerod.torch.Optimizer's groups,
 * torch.optim's); the algorithm is the job's. */
typedef struct job_group {
  double lr, beta1, beta2, eps, weight_decay;
  double momentum, dampening;
  int nesterov;
} job_group;

#define JOB_MAX_GROUPS 64

#define JOB_DEFAULT_QUANTIZATION_BLOCK 256
/* Low-rank compression's largest rank: the factors of a slice grow with it,
 * and past a few dozen they are no smaller than the slice. */
#define JOB_MAX_POWERSGD_RANK      64
#define JOB_MAX_POWERSGD_RANK_TEXT "64"
#define JOB_MAX_HPZ_PARTITION_SIZE 4096

/* Converts the protocol's config (NULL: all defaults, as an empty one) to
 * a job_config; call job_config_finish next. Returns 0 or -EINVAL with a
 * message. */
int job_config_from_proto(const Zerod__V1__JobConfig *proto, job_config *config, char *err,
                          size_t err_bytes);

/* Fills in torch.optim's defaults for zero fields; validates ranges: the
 * one copy of them, which the coordinator's CreateJob uses too. Returns 0
 * or -EINVAL with a message in err that names the field and its range,
 * without a prefix (callers add whose config it is: "job 'x': ..."). */
int job_config_finish(job_config *config, uint64_t default_max_live_bytes, char *err,
                      size_t err_bytes);

/* The group a SetGroupsRequest's OptimizerConfig describes for a job of
 * finished config job: zero lr, betas and eps are the job's, weight decay
 * the job's unless has_weight_decay; checked as job_config_finish checks a
 * config. Returns 0 or -EINVAL with a message. */
int job_group_from_proto(const job_config *job, const Zerod__V1__OptimizerConfig *o, job_group *out,
                         char *err, size_t err_bytes);

/* Group 0 of a job that has no groups of its own: its config, lr. */
void job_group_of_config(const job_config *config, double lr, job_group *out);

/* The protocol's JobConfig of a finished config, every field set (weight
 * decay included: has_weight_decay), as GetJob and AttachReply show what
 * will run, in out->config (which points into *out: use it in place);
 * nothing is allocated. */
typedef struct job_config_msg {
  Zerod__V1__JobConfig config; /* points into the rest of this struct */
  Zerod__V1__OptimizerConfig optimizer;
  Zerod__V1__OffloadConfig offload;
  char nvme_path[JOB_NVME_PATH_BYTES];
  char base[65];
} job_config_msg;
void job_config_to_proto(const job_config *config, job_config_msg *out);

/* The protocol's name of a working dtype (UNSPECIFIED for none it has). */
Zerod__V1__Dtype job_dtype_to_proto(zk_dtype d);

/* Compares two finished configs field by field: fields gets the names of
 * those that differ, comma-separated ("lr,max_live_bytes"), and text one
 * "NAME WANT (the job's HAVE)" per field, comma-separated. Returns how many
 * differ (0: the same; both strings then empty). */
int job_config_diff(const job_config *want, const job_config *have, char *fields,
                    size_t fields_bytes, char *text, size_t text_bytes);

/* "hierarchical" or "flat". */
const char *job_collectives_name(job_collectives c);
const char *job_offload_name(job_offload o);

/* "adamw", "adam" or "sgd": the name in logs and checkpoint manifests. */
const char *job_optimizer_name(job_optimizer o);

/* The per-element fp32 states a job keeps for each trainable parameter,
 * in this order (the order of a checkpoint's shard data, ckpt.h):
 *   JOB_STATE_MASTER   the master weights, always;
 *   JOB_STATE_MOMENT1  Adam's first moment, or SGD's momentum buffer when
 *                      the momentum is not zero;
 *   JOB_STATE_MOMENT2  Adam's second moment.
 * This is the one place that says which exist: the ranks allocate them,
 * saves copy them, restores require them, manifests list them. */
enum { JOB_STATE_MASTER = 0, JOB_STATE_MOMENT1 = 1, JOB_STATE_MOMENT2 = 2, JOB_NSTATES = 3 };

/* Sets has[s] to 1 for each state the config keeps, 0 otherwise; returns
 * how many it keeps. */
int job_config_states(const job_config *config, int has[JOB_NSTATES]);

#endif /* ZEROD_CONFIG_H */
