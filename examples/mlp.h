/* mlp.h - the example model, its data, and the options both example
 * programs share.
 *
 * The model is a plain MLP (Linear layers with ReLU between them, no
 * activation after the last), trained by mean squared error to imitate a
 * fixed random "teacher" network on Gaussian inputs. Everything is a pure
 * function of the seed: the initial weights (torch's nn.Linear default,
 * uniform in +-1/sqrt(fan_in)), the teacher, and sample i of step s, so
 * every process can produce exactly its share of a batch, and the worker
 * (mlp_train.c, through zerod) and the single-process reference
 * (mlp_reference.c) compute bit-identical gradients from the same weights.
 *
 * The math is fp32 without FMA contraction (the build is C11), and every
 * sum runs in a fixed order that does not depend on blocking or on how a
 * batch is split, so results are reproducible across runs and machines
 * with the same libm.
 */
#ifndef ZEROD_EXAMPLES_MLP_H
#define ZEROD_EXAMPLES_MLP_H

#include <getopt.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* ------------------------------------------------------------------------
 * Configuration shared by the worker and the reference
 * ------------------------------------------------------------------------ */

typedef enum mlp_optimizer { MLP_ADAMW = 1, MLP_ADAM = 2, MLP_SGD = 3 } mlp_optimizer;

typedef struct mlp_config {
  /* Model: `layers` Linear layers, input_dim -> hidden_dim -> ... ->
   * output_dim. */
  int input_dim;
  int hidden_dim;
  int output_dim;
  int layers;
  /* Data and schedule. */
  uint64_t seed;
  int steps;
  int global_batch;
  int log_every;
  /* Optimizer, with torch.optim's meaning and defaults. */
  mlp_optimizer optimizer;
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay; /* negative: the optimizer's default (AdamW 0.01, else 0) */
  double momentum;
  double max_grad_norm; /* 0: no clipping */
  int bf16;             /* working dtype bf16 instead of fp32 */
} mlp_config;

void mlp_config_defaults(mlp_config *config);

/* The effective weight decay (resolving the default). */
double mlp_config_weight_decay(const mlp_config *config);

/* Long options both programs accept; each program appends its own. Their
 * values start at MLP_OPT_BASE so they never collide with short options. */
#define MLP_OPT_BASE 1000
enum {
  MLP_OPT_STEPS = MLP_OPT_BASE,
  MLP_OPT_BATCH,
  MLP_OPT_LR,
  MLP_OPT_OPTIMIZER,
  MLP_OPT_WEIGHT_DECAY,
  MLP_OPT_MOMENTUM,
  MLP_OPT_MAX_GRAD_NORM,
  MLP_OPT_SEED,
  MLP_OPT_HIDDEN,
  MLP_OPT_LAYERS,
  MLP_OPT_LOG_EVERY,
  MLP_OPT_BF16,
  MLP_OPT_COMMON_END
};

#define MLP_COMMON_LONG_OPTIONS                                                                    \
  {"steps", required_argument, NULL, MLP_OPT_STEPS},                                               \
      {"batch", required_argument, NULL, MLP_OPT_BATCH},                                           \
      {"lr", required_argument, NULL, MLP_OPT_LR},                                                 \
      {"optimizer", required_argument, NULL, MLP_OPT_OPTIMIZER},                                   \
      {"weight-decay", required_argument, NULL, MLP_OPT_WEIGHT_DECAY},                             \
      {"momentum", required_argument, NULL, MLP_OPT_MOMENTUM},                                     \
      {"max-grad-norm", required_argument, NULL, MLP_OPT_MAX_GRAD_NORM},                           \
      {"seed", required_argument, NULL, MLP_OPT_SEED},                                             \
      {"hidden", required_argument, NULL, MLP_OPT_HIDDEN},                                         \
      {"layers", required_argument, NULL, MLP_OPT_LAYERS},                                         \
      {"log-every", required_argument, NULL, MLP_OPT_LOG_EVERY}, {                                 \
    "bf16", no_argument, NULL, MLP_OPT_BF16                                                        \
  }

/* Applies one common option. Returns 1 when handled, 0 when opt is not a
 * common option, -1 (after printing "prog: ..." to stderr) for a bad
 * value. */
int mlp_config_option(mlp_config *config, int opt, const char *value, const char *prog);

/* The --help text of the common options. */
void mlp_config_usage(FILE *out);

/* ------------------------------------------------------------------------
 * Model shape and initialisation
 * ------------------------------------------------------------------------ */

int mlp_layer_in(const mlp_config *config, int layer);
int mlp_layer_out(const mlp_config *config, int layer);
/* Parameters of one layer (weight [out, in] then bias [out]) and of all. */
size_t mlp_layer_params(const mlp_config *config, int layer);
size_t mlp_total_params(const mlp_config *config);

/* torch.nn.Linear's default initialisation, deterministic from the seed:
 * weight and bias uniform in [-1/sqrt(in), 1/sqrt(in)). */
void mlp_init_layer(const mlp_config *config, int layer, float *weight, float *bias);

/* ------------------------------------------------------------------------
 * Data
 * ------------------------------------------------------------------------ */

/* The teacher: input -> MLP_TEACHER_HIDDEN (tanh) -> output, drawn from
 * the seed. */
#define MLP_TEACHER_HIDDEN 64

typedef struct mlp_teacher {
  int input_dim;
  int output_dim;
  float *w1; /* [MLP_TEACHER_HIDDEN, input_dim] */
  float *w2; /* [output_dim, MLP_TEACHER_HIDDEN] */
} mlp_teacher;

int mlp_teacher_init(mlp_teacher *teacher, const mlp_config *config);
void mlp_teacher_free(mlp_teacher *teacher);

/* Samples [first, first + count) of step `step` (counting from 0):
 * inputs [count, input_dim] and targets [count, output_dim], sample-major. */
void mlp_make_batch(const mlp_teacher *teacher, const mlp_config *config, int step, int first,
                    int count, float *inputs, float *targets);

/* ------------------------------------------------------------------------
 * Forward and backward of one rank's share of a batch
 * ------------------------------------------------------------------------ */

/* Activations and gradients of `batch` samples. Each layer's input is kept
 * twice: feature-major ([in, batch], read by the forward product, which
 * vectorises along the batch) and sample-major ([batch, in], read by the
 * weight-gradient product, which vectorises along the features). */
typedef struct mlp_work {
  const mlp_config *config;
  int batch;
  float **act_t;      /* act_t[l]: input of layer l, feature-major; act_t[layers]: output */
  float **act;        /* act[l]: input of layer l, sample-major */
  float *grad_out;    /* gradient w.r.t. the current layer's output, [batch, out] */
  float *grad_in;     /* gradient w.r.t. its input, [batch, in] */
  float *weight_fp32; /* scratch: a bf16 layer's weights as fp32 */
  float *bias_fp32;   /* scratch: a bf16 layer's bias as fp32 */
  float *weight_grad; /* scratch: a bf16 gradient computed in fp32 */
  float *bias_grad;   /* scratch */
} mlp_work;

int mlp_work_init(mlp_work *work, const mlp_config *config, int batch);
void mlp_work_free(mlp_work *work);

/* Loads the inputs of the batch (sample-major [batch, input_dim]). */
void mlp_set_inputs(mlp_work *work, const float *inputs);

/* output = input * weight^T + bias (ReLU unless it is the last layer). */
void mlp_forward_layer(mlp_work *work, int layer, const float *weight, const float *bias);

/* Mean squared error over the outputs of each sample. Returns the sum of
 * the batch's per-sample losses, and sets the output gradient to the
 * derivative of (that sum / global_batch), so that the gradients of all
 * ranks add up to the gradient of the global batch's mean loss. */
double mlp_loss(mlp_work *work, const float *targets, int global_batch);

/* Backward through one layer (call from the last layer down): writes the
 * weight and bias gradients, and (below the first layer) turns the output
 * gradient into the previous layer's output gradient. */
void mlp_backward_layer(mlp_work *work, int layer, const float *weight, float *weight_grad,
                        float *bias_grad);

/* bf16 <-> fp32 for the --bf16 path (round to nearest even). */
void mlp_bf16_to_f32(const uint16_t *src, float *dst, size_t numel);
void mlp_f32_to_bf16(const float *src, uint16_t *dst, size_t numel);

/* Parameter files (--dump, --out, --compare): raw little-endian fp32, every
 * layer's weight then bias, in registration order. Return 0 or -1. */
int mlp_write_f32(FILE *out, const float *values, size_t count);
int mlp_read_f32(FILE *in, float *values, size_t count);

/* Seconds on a monotonic clock. */
double mlp_now_s(void);

#endif /* ZEROD_EXAMPLES_MLP_H */
