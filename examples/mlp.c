/* mlp.c - the example MLP: options, deterministic data and initialisation,
 * and the fp32 forward and backward passes shared by the zerod worker
 * (mlp_train.c) and the single-process reference (mlp_reference.c).
 *
 * The three matrix products of a Linear layer are written as blocked loops
 * that gcc -O3 vectorises without reassociating anything: each output
 * element is one accumulator that sums its terms in ascending order of the
 * reduction index, and the vector lanes run over independent outputs. So
 * the result of every element is the same whatever the blocking, the tail
 * handling, the vector width, or the batch split: the reference, emulating
 * W ranks, reproduces the workers' gradients to the bit.
 */
#include "mlp.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "zk.h"

/* ------------------------------------------------------------------------
 * Options
 * ------------------------------------------------------------------------ */

void mlp_config_defaults(mlp_config *config) {
  memset(config, 0, sizeof *config);
  config->input_dim = 256;
  config->hidden_dim = 1024;
  config->output_dim = 16;
  config->layers = 4;
  config->seed = 1234;
  config->steps = 100;
  config->global_batch = 64;
  config->log_every = 10;
  config->optimizer = MLP_ADAMW;
  config->lr = 1e-3;
  config->beta1 = 0.9;
  config->beta2 = 0.999;
  config->eps = 1e-8;
  config->weight_decay = -1.0;
  config->momentum = 0.0;
  config->max_grad_norm = 0.0;
}

double mlp_config_weight_decay(const mlp_config *config) {
  if (config->weight_decay >= 0)
    return config->weight_decay;
  return config->optimizer == MLP_ADAMW ? 0.01 : 0.0;
}

static int parse_long(const char *value, long min, long max, long *out) {
  char *end;
  errno = 0;
  long parsed = strtol(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || parsed < min || parsed > max)
    return -1;
  *out = parsed;
  return 0;
}

static int parse_double(const char *value, double min, double *out) {
  char *end;
  errno = 0;
  double parsed = strtod(value, &end);
  if (errno != 0 || end == value || *end != '\0' || !(parsed >= min) || isinf(parsed))
    return -1;
  *out = parsed;
  return 0;
}

int mlp_config_option(mlp_config *config, int opt, const char *value, const char *prog) {
  long number = 0;
  switch (opt) {
  case MLP_OPT_STEPS:
    if (parse_long(value, 0, 100000000, &number) != 0)
      goto bad_value;
    config->steps = (int)number;
    return 1;
  case MLP_OPT_BATCH:
    if (parse_long(value, 1, 1 << 20, &number) != 0)
      goto bad_value;
    config->global_batch = (int)number;
    return 1;
  case MLP_OPT_LR:
    if (parse_double(value, 0.0, &config->lr) != 0)
      goto bad_value;
    return 1;
  case MLP_OPT_OPTIMIZER:
    if (strcmp(value, "adamw") == 0)
      config->optimizer = MLP_ADAMW;
    else if (strcmp(value, "adam") == 0)
      config->optimizer = MLP_ADAM;
    else if (strcmp(value, "sgd") == 0)
      config->optimizer = MLP_SGD;
    else
      goto bad_value;
    return 1;
  case MLP_OPT_WEIGHT_DECAY:
    if (parse_double(value, 0.0, &config->weight_decay) != 0)
      goto bad_value;
    return 1;
  case MLP_OPT_MOMENTUM:
    if (parse_double(value, 0.0, &config->momentum) != 0)
      goto bad_value;
    return 1;
  case MLP_OPT_MAX_GRAD_NORM:
    if (parse_double(value, 0.0, &config->max_grad_norm) != 0)
      goto bad_value;
    return 1;
  case MLP_OPT_SEED: {
    char *end;
    errno = 0;
    unsigned long long seed = strtoull(value, &end, 0);
    if (errno != 0 || end == value || *end != '\0')
      goto bad_value;
    config->seed = seed;
    return 1;
  }
  case MLP_OPT_HIDDEN:
    if (parse_long(value, 1, 1 << 16, &number) != 0)
      goto bad_value;
    config->hidden_dim = (int)number;
    return 1;
  case MLP_OPT_LAYERS:
    if (parse_long(value, 1, 64, &number) != 0)
      goto bad_value;
    config->layers = (int)number;
    return 1;
  case MLP_OPT_LOG_EVERY:
    if (parse_long(value, 1, 1 << 30, &number) != 0)
      goto bad_value;
    config->log_every = (int)number;
    return 1;
  case MLP_OPT_BF16:
    config->bf16 = 1;
    return 1;
  default:
    return 0;
  }
bad_value:
  fprintf(stderr, "%s: bad value '%s' for an option (see --help)\n", prog, value);
  return -1;
}

void mlp_config_usage(FILE *out) {
  fprintf(out, "Model and data:\n"
               "  --hidden N          width of the hidden layers (default 1024)\n"
               "  --layers N          number of Linear layers, one zerod unit each (default 4:\n"
               "                      256 -> N -> N -> N -> 16, about 2.4M parameters)\n"
               "  --seed N            seed of the initial weights, the teacher and the data\n"
               "                      (default 1234)\n"
               "  --batch N           global batch: samples per step over all ranks (default 64;\n"
               "                      must divide evenly by the number of ranks)\n"
               "  --steps N           optimizer steps (default 100)\n"
               "  --log-every N       print every N steps, and the first and last (default 10)\n"
               "  --bf16              working dtype bf16: weights are gathered and gradients\n"
               "                      written in bf16 (math stays fp32); default fp32\n"
               "Optimizer (torch.optim semantics):\n"
               "  --optimizer NAME    adamw (default), adam or sgd\n"
               "  --lr X              learning rate (default 1e-3)\n"
               "  --weight-decay X    default 0.01 for adamw, 0 for adam and sgd\n"
               "  --momentum X        sgd momentum (default 0)\n"
               "  --max-grad-norm X   clip the global gradient L2 norm to X (default: off)\n"
               "  (adam/adamw betas 0.9/0.999, eps 1e-8)\n");
}

/* ------------------------------------------------------------------------
 * Shapes
 * ------------------------------------------------------------------------ */

int mlp_layer_in(const mlp_config *config, int layer) {
  return layer == 0 ? config->input_dim : config->hidden_dim;
}

int mlp_layer_out(const mlp_config *config, int layer) {
  return layer == config->layers - 1 ? config->output_dim : config->hidden_dim;
}

size_t mlp_layer_params(const mlp_config *config, int layer) {
  size_t in = (size_t)mlp_layer_in(config, layer);
  size_t out = (size_t)mlp_layer_out(config, layer);
  return out * in + out;
}

size_t mlp_total_params(const mlp_config *config) {
  size_t total = 0;
  for (int l = 0; l < config->layers; l++)
    total += mlp_layer_params(config, l);
  return total;
}

/* ------------------------------------------------------------------------
 * Counter-based random numbers
 * ------------------------------------------------------------------------ */

/* Every random stream is keyed by (seed, domain, a, b) and generated by
 * splitmix64 from a hash of the key, so any sample or tensor can be produced
 * on its own, in any process, without generating what comes before it. */
enum { DOMAIN_DATA = 1, DOMAIN_INIT = 2, DOMAIN_TEACHER = 3 };

static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

typedef struct rng {
  uint64_t state;
} rng;

static rng rng_for(uint64_t seed, uint64_t domain, uint64_t a, uint64_t b) {
  uint64_t h = mix64(seed + 0x9e3779b97f4a7c15ull);
  h = mix64(h ^ (domain * 0xd1b54a32d192ed03ull));
  h = mix64(h ^ (a + 0x632be59bd9b4e019ull));
  h = mix64(h ^ (b + 0x8cb92ba72f3d8dd7ull));
  rng r = {h};
  return r;
}

static uint64_t rng_next(rng *r) {
  r->state += 0x9e3779b97f4a7c15ull;
  return mix64(r->state);
}

/* Uniform in [0, 1) with 53 random bits. */
static double rng_uniform(rng *r) {
  return (double)(rng_next(r) >> 11) * 0x1p-53;
}

/* Standard normal pairs by Box-Muller; u1 is kept away from 0. */
static void rng_normal_fill(rng *r, float *out, size_t count, double scale) {
  const double two_pi = 6.283185307179586;
  for (size_t i = 0; i < count; i += 2) {
    double u1 = ((double)(rng_next(r) >> 11) + 1.0) * 0x1p-53;
    double u2 = rng_uniform(r);
    double radius = sqrt(-2.0 * log(u1));
    out[i] = (float)(scale * radius * cos(two_pi * u2));
    if (i + 1 < count)
      out[i + 1] = (float)(scale * radius * sin(two_pi * u2));
  }
}

/* ------------------------------------------------------------------------
 * Initialisation and data
 * ------------------------------------------------------------------------ */

void mlp_init_layer(const mlp_config *config, int layer, float *weight, float *bias) {
  int in = mlp_layer_in(config, layer);
  int out = mlp_layer_out(config, layer);
  double bound = 1.0 / sqrt((double)in);
  rng weight_rng = rng_for(config->seed, DOMAIN_INIT, (uint64_t)layer, 0);
  for (size_t i = 0; i < (size_t)out * (size_t)in; i++)
    weight[i] = (float)((2.0 * rng_uniform(&weight_rng) - 1.0) * bound);
  rng bias_rng = rng_for(config->seed, DOMAIN_INIT, (uint64_t)layer, 1);
  for (int o = 0; o < out; o++)
    bias[o] = (float)((2.0 * rng_uniform(&bias_rng) - 1.0) * bound);
}

int mlp_teacher_init(mlp_teacher *teacher, const mlp_config *config) {
  teacher->input_dim = config->input_dim;
  teacher->output_dim = config->output_dim;
  teacher->w1 = malloc(sizeof(float) * MLP_TEACHER_HIDDEN * (size_t)config->input_dim);
  teacher->w2 = malloc(sizeof(float) * MLP_TEACHER_HIDDEN * (size_t)config->output_dim);
  if (teacher->w1 == NULL || teacher->w2 == NULL) {
    mlp_teacher_free(teacher);
    return -1;
  }
  /* Scaled so that the hidden pre-activations and the targets have about
   * unit variance: the initial loss is near 1 and a good fit is near 0. */
  rng w1_rng = rng_for(config->seed, DOMAIN_TEACHER, 1, 0);
  rng_normal_fill(&w1_rng, teacher->w1, MLP_TEACHER_HIDDEN * (size_t)config->input_dim,
                  1.0 / sqrt((double)config->input_dim));
  rng w2_rng = rng_for(config->seed, DOMAIN_TEACHER, 2, 0);
  rng_normal_fill(&w2_rng, teacher->w2, MLP_TEACHER_HIDDEN * (size_t)config->output_dim,
                  1.6 / sqrt((double)MLP_TEACHER_HIDDEN));
  return 0;
}

void mlp_teacher_free(mlp_teacher *teacher) {
  free(teacher->w1);
  free(teacher->w2);
  teacher->w1 = NULL;
  teacher->w2 = NULL;
}

void mlp_make_batch(const mlp_teacher *teacher, const mlp_config *config, int step, int first,
                    int count, float *inputs, float *targets) {
  int in = config->input_dim;
  int out = config->output_dim;
  float hidden[MLP_TEACHER_HIDDEN];
  for (int s = 0; s < count; s++) {
    float *x = inputs + (size_t)s * (size_t)in;
    float *y = targets + (size_t)s * (size_t)out;
    rng sample_rng = rng_for(config->seed, DOMAIN_DATA, (uint64_t)step, (uint64_t)(first + s));
    rng_normal_fill(&sample_rng, x, (size_t)in, 1.0);
    for (int h = 0; h < MLP_TEACHER_HIDDEN; h++) {
      const float *w = teacher->w1 + (size_t)h * (size_t)in;
      float acc = 0.0f;
      for (int i = 0; i < in; i++)
        acc += w[i] * x[i];
      hidden[h] = tanhf(acc);
    }
    for (int o = 0; o < out; o++) {
      const float *w = teacher->w2 + (size_t)o * MLP_TEACHER_HIDDEN;
      float acc = 0.0f;
      for (int h = 0; h < MLP_TEACHER_HIDDEN; h++)
        acc += w[h] * hidden[h];
      y[o] = acc;
    }
  }
}

/* ------------------------------------------------------------------------
 * The three products of a Linear layer
 * ------------------------------------------------------------------------ */

/* Block sizes: 4 rows of broadcast scalars times 8 vector lanes keeps 8
 * SSE accumulators (4 AVX) and their operands in the 16 vector registers
 * of x86-64. */
#define ROWS  4
#define LANES 8

/* output_t[o][n] = (sum over i ascending of weight[o][i] * input_t[i][n]) +
 * bias[o], then ReLU. Vectorised along the batch n. */
static void linear_forward(const float *weight, const float *bias, const float *input_t,
                           float *output_t, int in, int out, int batch, int relu) {
  int o = 0;
  for (; o + ROWS <= out; o += ROWS) {
    const float *w0 = weight + (size_t)o * in;
    const float *w1 = w0 + in;
    const float *w2 = w1 + in;
    const float *w3 = w2 + in;
    int n = 0;
    for (; n + LANES <= batch; n += LANES) {
      float acc0[LANES] = {0}, acc1[LANES] = {0}, acc2[LANES] = {0}, acc3[LANES] = {0};
      for (int i = 0; i < in; i++) {
        const float *x = input_t + (size_t)i * batch + n;
        float a0 = w0[i], a1 = w1[i], a2 = w2[i], a3 = w3[i];
        for (int k = 0; k < LANES; k++) {
          acc0[k] += a0 * x[k];
          acc1[k] += a1 * x[k];
          acc2[k] += a2 * x[k];
          acc3[k] += a3 * x[k];
        }
      }
      float *accs[ROWS] = {acc0, acc1, acc2, acc3};
      for (int r = 0; r < ROWS; r++) {
        float *y = output_t + (size_t)(o + r) * batch + n;
        for (int k = 0; k < LANES; k++) {
          float v = accs[r][k] + bias[o + r];
          y[k] = relu && !(v > 0.0f) ? 0.0f : v;
        }
      }
    }
    for (; n < batch; n++) {
      for (int r = 0; r < ROWS; r++) {
        const float *w = weight + (size_t)(o + r) * in;
        float acc = 0.0f;
        for (int i = 0; i < in; i++)
          acc += w[i] * input_t[(size_t)i * batch + n];
        float v = acc + bias[o + r];
        output_t[(size_t)(o + r) * batch + n] = relu && !(v > 0.0f) ? 0.0f : v;
      }
    }
  }
  for (; o < out; o++) {
    const float *w = weight + (size_t)o * in;
    for (int n = 0; n < batch; n++) {
      float acc = 0.0f;
      for (int i = 0; i < in; i++)
        acc += w[i] * input_t[(size_t)i * batch + n];
      float v = acc + bias[o];
      output_t[(size_t)o * batch + n] = relu && !(v > 0.0f) ? 0.0f : v;
    }
  }
}

/* weight_grad[o][i] = sum over n ascending of grad_out[n][o] * input[n][i];
 * bias_grad[o] = sum over n ascending of grad_out[n][o]. Vectorised along
 * the features i. */
static void linear_weight_grad(const float *grad_out, const float *input, float *weight_grad,
                               float *bias_grad, int in, int out, int batch) {
  int o = 0;
  for (; o + ROWS <= out; o += ROWS) {
    int i = 0;
    for (; i + LANES <= in; i += LANES) {
      float acc0[LANES] = {0}, acc1[LANES] = {0}, acc2[LANES] = {0}, acc3[LANES] = {0};
      for (int n = 0; n < batch; n++) {
        const float *x = input + (size_t)n * in + i;
        const float *g = grad_out + (size_t)n * out + o;
        float g0 = g[0], g1 = g[1], g2 = g[2], g3 = g[3];
        for (int k = 0; k < LANES; k++) {
          acc0[k] += g0 * x[k];
          acc1[k] += g1 * x[k];
          acc2[k] += g2 * x[k];
          acc3[k] += g3 * x[k];
        }
      }
      float *accs[ROWS] = {acc0, acc1, acc2, acc3};
      for (int r = 0; r < ROWS; r++)
        memcpy(weight_grad + (size_t)(o + r) * in + i, accs[r], sizeof acc0);
    }
    for (; i < in; i++) {
      for (int r = 0; r < ROWS; r++) {
        float acc = 0.0f;
        for (int n = 0; n < batch; n++)
          acc += grad_out[(size_t)n * out + o + r] * input[(size_t)n * in + i];
        weight_grad[(size_t)(o + r) * in + i] = acc;
      }
    }
  }
  for (; o < out; o++) {
    for (int i = 0; i < in; i++) {
      float acc = 0.0f;
      for (int n = 0; n < batch; n++)
        acc += grad_out[(size_t)n * out + o] * input[(size_t)n * in + i];
      weight_grad[(size_t)o * in + i] = acc;
    }
  }
  for (o = 0; o < out; o++) {
    float acc = 0.0f;
    for (int n = 0; n < batch; n++)
      acc += grad_out[(size_t)n * out + o];
    bias_grad[o] = acc;
  }
}

/* grad_in[n][i] = (sum over o ascending of grad_out[n][o] * weight[o][i]),
 * zeroed where the layer's input (a ReLU output) was not positive.
 * Vectorised along the features i. */
static void linear_input_grad(const float *grad_out, const float *weight, const float *input,
                              float *grad_in, int in, int out, int batch) {
  int i = 0;
  for (; i + LANES <= in; i += LANES) {
    int n = 0;
    for (; n + ROWS <= batch; n += ROWS) {
      float acc0[LANES] = {0}, acc1[LANES] = {0}, acc2[LANES] = {0}, acc3[LANES] = {0};
      const float *g0 = grad_out + (size_t)n * out;
      const float *g1 = g0 + out;
      const float *g2 = g1 + out;
      const float *g3 = g2 + out;
      for (int o = 0; o < out; o++) {
        const float *w = weight + (size_t)o * in + i;
        float a0 = g0[o], a1 = g1[o], a2 = g2[o], a3 = g3[o];
        for (int k = 0; k < LANES; k++) {
          acc0[k] += a0 * w[k];
          acc1[k] += a1 * w[k];
          acc2[k] += a2 * w[k];
          acc3[k] += a3 * w[k];
        }
      }
      float *accs[ROWS] = {acc0, acc1, acc2, acc3};
      for (int r = 0; r < ROWS; r++) {
        const float *x = input + (size_t)(n + r) * in + i;
        float *dx = grad_in + (size_t)(n + r) * in + i;
        for (int k = 0; k < LANES; k++)
          dx[k] = x[k] > 0.0f ? accs[r][k] : 0.0f;
      }
    }
    for (; n < batch; n++) {
      float acc[LANES] = {0};
      const float *g = grad_out + (size_t)n * out;
      for (int o = 0; o < out; o++) {
        const float *w = weight + (size_t)o * in + i;
        for (int k = 0; k < LANES; k++)
          acc[k] += g[o] * w[k];
      }
      const float *x = input + (size_t)n * in + i;
      float *dx = grad_in + (size_t)n * in + i;
      for (int k = 0; k < LANES; k++)
        dx[k] = x[k] > 0.0f ? acc[k] : 0.0f;
    }
  }
  for (; i < in; i++) {
    for (int n = 0; n < batch; n++) {
      float acc = 0.0f;
      for (int o = 0; o < out; o++)
        acc += grad_out[(size_t)n * out + o] * weight[(size_t)o * in + i];
      grad_in[(size_t)n * in + i] = input[(size_t)n * in + i] > 0.0f ? acc : 0.0f;
    }
  }
}

static void transpose(const float *src, float *dst, int rows, int cols) {
  for (int r = 0; r < rows; r++) {
    for (int c = 0; c < cols; c++)
      dst[(size_t)c * rows + r] = src[(size_t)r * cols + c];
  }
}

/* ------------------------------------------------------------------------
 * Work buffers, forward, loss, backward
 * ------------------------------------------------------------------------ */

int mlp_work_init(mlp_work *work, const mlp_config *config, int batch) {
  memset(work, 0, sizeof *work);
  work->config = config;
  work->batch = batch;
  int layers = config->layers;
  size_t widest = (size_t)config->hidden_dim;
  if ((size_t)config->input_dim > widest)
    widest = (size_t)config->input_dim;
  if ((size_t)config->output_dim > widest)
    widest = (size_t)config->output_dim;
  work->act_t = calloc((size_t)layers + 1, sizeof *work->act_t);
  work->act = calloc((size_t)layers + 1, sizeof *work->act);
  if (work->act_t == NULL || work->act == NULL)
    goto fail;
  for (int l = 0; l <= layers; l++) {
    size_t dim = (size_t)(l < layers ? mlp_layer_in(config, l) : config->output_dim);
    work->act_t[l] = malloc(sizeof(float) * dim * (size_t)batch);
    work->act[l] = malloc(sizeof(float) * dim * (size_t)batch);
    if (work->act_t[l] == NULL || work->act[l] == NULL)
      goto fail;
  }
  work->grad_out = malloc(sizeof(float) * widest * (size_t)batch);
  work->grad_in = malloc(sizeof(float) * widest * (size_t)batch);
  work->weight_fp32 = malloc(sizeof(float) * widest * widest);
  work->bias_fp32 = malloc(sizeof(float) * widest);
  work->weight_grad = malloc(sizeof(float) * widest * widest);
  work->bias_grad = malloc(sizeof(float) * widest);
  if (work->grad_out == NULL || work->grad_in == NULL || work->weight_fp32 == NULL ||
      work->bias_fp32 == NULL || work->weight_grad == NULL || work->bias_grad == NULL)
    goto fail;
  return 0;
fail:
  mlp_work_free(work);
  return -1;
}

void mlp_work_free(mlp_work *work) {
  if (work->config != NULL) {
    for (int l = 0; l <= work->config->layers; l++) {
      if (work->act_t != NULL)
        free(work->act_t[l]);
      if (work->act != NULL)
        free(work->act[l]);
    }
  }
  free(work->act_t);
  free(work->act);
  free(work->grad_out);
  free(work->grad_in);
  free(work->weight_fp32);
  free(work->bias_fp32);
  free(work->weight_grad);
  free(work->bias_grad);
  memset(work, 0, sizeof *work);
}

void mlp_set_inputs(mlp_work *work, const float *inputs) {
  int in = work->config->input_dim;
  memcpy(work->act[0], inputs, sizeof(float) * (size_t)in * (size_t)work->batch);
  transpose(inputs, work->act_t[0], work->batch, in);
}

void mlp_forward_layer(mlp_work *work, int layer, const float *weight, const float *bias) {
  const mlp_config *config = work->config;
  int in = mlp_layer_in(config, layer);
  int out = mlp_layer_out(config, layer);
  int last = layer == config->layers - 1;
  linear_forward(weight, bias, work->act_t[layer], work->act_t[layer + 1], in, out, work->batch,
                 !last);
  transpose(work->act_t[layer + 1], work->act[layer + 1], out, work->batch);
}

double mlp_loss(mlp_work *work, const float *targets, int global_batch) {
  int out = work->config->output_dim;
  const float *y = work->act[work->config->layers];
  /* d/dy of (1/global_batch) * mean over outputs of (y - t)^2. */
  float grad_scale = (float)(2.0 / ((double)out * (double)global_batch));
  double loss_sum = 0.0;
  for (int n = 0; n < work->batch; n++) {
    double sample_loss = 0.0;
    for (int o = 0; o < out; o++) {
      size_t index = (size_t)n * out + o;
      float diff = y[index] - targets[index];
      sample_loss += (double)diff * diff;
      work->grad_out[index] = diff * grad_scale;
    }
    loss_sum += sample_loss / out;
  }
  return loss_sum;
}

void mlp_backward_layer(mlp_work *work, int layer, const float *weight, float *weight_grad,
                        float *bias_grad) {
  const mlp_config *config = work->config;
  int in = mlp_layer_in(config, layer);
  int out = mlp_layer_out(config, layer);
  linear_weight_grad(work->grad_out, work->act[layer], weight_grad, bias_grad, in, out,
                     work->batch);
  if (layer > 0) {
    linear_input_grad(work->grad_out, weight, work->act[layer], work->grad_in, in, out,
                      work->batch);
    float *swap = work->grad_out;
    work->grad_out = work->grad_in;
    work->grad_in = swap;
  }
}

/* ------------------------------------------------------------------------
 * Utilities
 * ------------------------------------------------------------------------ */

/* zk_cast is the daemon's own conversion, so both programs round exactly
 * as the daemon does when it casts the master weights. */
void mlp_bf16_to_f32(const uint16_t *src, float *dst, size_t numel) {
  zk_cast(NULL, dst, ZK_F32, src, ZK_BF16, numel);
}

void mlp_f32_to_bf16(const float *src, uint16_t *dst, size_t numel) {
  zk_cast(NULL, dst, ZK_BF16, src, ZK_F32, numel);
}

/* The dump format is little-endian fp32 whatever the host is. */
static int host_is_little_endian(void) {
  const uint16_t probe = 1;
  uint8_t first;
  memcpy(&first, &probe, 1);
  return first == 1;
}

static uint32_t byte_swap32(uint32_t x) {
  return (x >> 24) | ((x >> 8) & 0xff00u) | ((x << 8) & 0xff0000u) | (x << 24);
}

int mlp_write_f32(FILE *out, const float *values, size_t count) {
  if (host_is_little_endian())
    return fwrite(values, sizeof(float), count, out) == count ? 0 : -1;
  for (size_t i = 0; i < count; i++) {
    uint32_t bits;
    memcpy(&bits, &values[i], sizeof bits);
    bits = byte_swap32(bits);
    if (fwrite(&bits, sizeof bits, 1, out) != 1)
      return -1;
  }
  return 0;
}

int mlp_read_f32(FILE *in, float *values, size_t count) {
  if (fread(values, sizeof(float), count, in) != count)
    return -1;
  if (!host_is_little_endian()) {
    for (size_t i = 0; i < count; i++) {
      uint32_t bits;
      memcpy(&bits, &values[i], sizeof bits);
      bits = byte_swap32(bits);
      memcpy(&values[i], &bits, sizeof bits);
    }
  }
  return 0;
}

double mlp_now_s(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}
