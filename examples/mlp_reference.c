/* mlp_reference.c - the training that mlp_train runs through zerod, done in
 * one process without the daemon, so the workers' result can be checked.
 *
 * For every step it emulates the W data-parallel ranks in rank order: rank
 * r takes samples [r*B/W, (r+1)*B/W) of the step, computes its gradient with
 * the same code the worker runs (mlp.c), rounded to the gradient dtype as
 * the worker writes it; the ranks' gradients are summed in rank order in
 * fp32, clipped as the daemon clips (global L2 norm in double, coefficient
 * max_norm / (norm + 1e-6) when below 1, as torch.nn.utils.clip_grad_norm_),
 * and applied with the daemon's own optimizer kernels (kernels/zk.h), which
 * also produce the working copy (fp32 or bf16) the next step reads.
 *
 *   zerod-mlp-reference --world 2 --steps 100 --out ref.bin
 *   zerod-mlp-reference --world 2 --steps 100 --compare worker-dump.bin
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mlp.h"
#include "zk.h"

static const char *prog = "mlp_reference";

/* One tensor's optimizer state, as one rank-less shard holding it all. */
typedef struct ref_tensor {
  size_t numel;
  float *master;     /* fp32 master weights */
  float *exp_avg;    /* Adam first moment, or SGD momentum */
  float *exp_avg_sq; /* Adam second moment */
  void *working;     /* the working copy, fp32 or bf16 */
  float *grad_sum;   /* sum of the ranks' gradients */
  float *node_sum;   /* --ranks-per-node: the sum of one node's ranks' gradients */
} ref_tensor;

static void usage(FILE *out) {
  fprintf(out, "Usage: zerod-mlp-reference [options]\n"
               "Trains the example MLP as N data-parallel zerod workers would (zerod-mlp-train),\n"
               "in one process without the daemon, and prints the same log lines. The loss is\n"
               "the mean over the whole global batch.\n\n"
               "  --world N           number of ranks to emulate (default 1)\n"
               "  --out FILE          write the final parameters (raw little-endian fp32, every\n"
               "                      layer's weight then bias, as zerod-mlp-train --dump does)\n"
               "  --compare FILE      compare the final parameters with a worker's --dump: print\n"
               "                      the max of |a-b|/max(|b|,1e-3) (b: this reference) and exit\n"
               "                      1 if it is above the tolerance\n"
               "  --tolerance X       for --compare (default 1e-6)\n"
               "  --ranks-per-node L  sum the gradients as a hierarchical communicator does:\n"
               "                      each node's L ranks in order, then the nodes in order\n"
               "                      (default: every rank in rank order)\n"
               "  --help              this text\n\n");
  mlp_config_usage(out);
}

static void *xcalloc(size_t count, size_t size) {
  void *memory = calloc(count != 0 ? count : 1, size);
  if (memory == NULL) {
    fprintf(stderr, "%s: out of memory\n", prog);
    exit(1);
  }
  return memory;
}

static void tensor_init(ref_tensor *tensor, size_t numel, const float *values, int bf16) {
  tensor->numel = numel;
  tensor->master = xcalloc(numel, sizeof(float));
  tensor->exp_avg = xcalloc(numel, sizeof(float));
  tensor->exp_avg_sq = xcalloc(numel, sizeof(float));
  tensor->grad_sum = xcalloc(numel, sizeof(float));
  tensor->node_sum = xcalloc(numel, sizeof(float));
  memcpy(tensor->master, values, numel * sizeof(float));
  /* The daemon's first working copy is rank 0's values cast once. */
  if (bf16) {
    tensor->working = xcalloc(numel, sizeof(uint16_t));
    mlp_f32_to_bf16(values, tensor->working, numel);
  } else {
    tensor->working = xcalloc(numel, sizeof(float));
    memcpy(tensor->working, values, numel * sizeof(float));
  }
}

static void tensor_free(ref_tensor *tensor) {
  free(tensor->master);
  free(tensor->exp_avg);
  free(tensor->exp_avg_sq);
  free(tensor->grad_sum);
  free(tensor->node_sum);
  free(tensor->working);
}

/* The working copy as fp32: the tensor itself, or a conversion into
 * scratch for bf16. */
static const float *working_f32(const ref_tensor *tensor, int bf16, float *scratch) {
  if (!bf16)
    return tensor->working;
  mlp_bf16_to_f32(tensor->working, scratch, tensor->numel);
  return scratch;
}

/* Adds one rank's gradient into the sum, after rounding it to the dtype
 * the worker writes into its gradient buffer: in rank order, or with
 * ranks_per_node L, into its node's sum, which goes into the total after
 * the node's last rank. */
static void accumulate_grad(ref_tensor *tensor, float *grad, int bf16, uint16_t *bf16_scratch,
                            int rank, int ranks_per_node) {
  if (bf16) {
    mlp_f32_to_bf16(grad, bf16_scratch, tensor->numel);
    mlp_bf16_to_f32(bf16_scratch, grad, tensor->numel);
  }
  if (ranks_per_node <= 1) {
    for (size_t i = 0; i < tensor->numel; i++)
      tensor->grad_sum[i] += grad[i];
    return;
  }
  if (rank % ranks_per_node == 0)
    memcpy(tensor->node_sum, grad, tensor->numel * sizeof(float));
  else
    for (size_t i = 0; i < tensor->numel; i++)
      tensor->node_sum[i] += grad[i];
  if (rank % ranks_per_node == ranks_per_node - 1)
    for (size_t i = 0; i < tensor->numel; i++)
      tensor->grad_sum[i] += tensor->node_sum[i];
}

static int optimizer_step(const mlp_config *config, ref_tensor *tensor, int64_t step,
                          double grad_scale) {
  zk_dtype working_dtype = config->bf16 ? ZK_BF16 : ZK_F32;
  if (config->optimizer == MLP_SGD) {
    zk_sgd_hparams hp = {.lr = config->lr,
                         .momentum = config->momentum,
                         .dampening = 0.0,
                         .weight_decay = mlp_config_weight_decay(config),
                         .nesterov = 0,
                         .step = step,
                         .grad_scale = grad_scale};
    return zk_sgd_step(NULL, &hp, tensor->master, tensor->exp_avg, tensor->grad_sum, ZK_F32,
                       tensor->working, working_dtype, tensor->numel);
  }
  zk_adam_hparams hp = {.lr = config->lr,
                        .beta1 = config->beta1,
                        .beta2 = config->beta2,
                        .eps = config->eps,
                        .weight_decay = mlp_config_weight_decay(config),
                        .decoupled_weight_decay = config->optimizer == MLP_ADAMW,
                        .step = step,
                        .grad_scale = grad_scale};
  return zk_adam_step(NULL, &hp, tensor->master, tensor->exp_avg, tensor->exp_avg_sq,
                      tensor->grad_sum, ZK_F32, tensor->working, working_dtype, tensor->numel);
}

/* The final parameters as a worker's dump has them: the working copy,
 * widened to fp32, every layer's weight then bias. */
static float *final_params(const mlp_config *config, ref_tensor *tensors, size_t total) {
  float *params = xcalloc(total, sizeof(float));
  size_t at = 0;
  for (int t = 0; t < 2 * config->layers; t++) {
    if (config->bf16)
      mlp_bf16_to_f32(tensors[t].working, params + at, tensors[t].numel);
    else
      memcpy(params + at, tensors[t].working, tensors[t].numel * sizeof(float));
    at += tensors[t].numel;
  }
  return params;
}

static int compare_with(const char *path, const float *reference, size_t total, double tolerance) {
  FILE *in = fopen(path, "rb");
  if (in == NULL) {
    fprintf(stderr, "%s: --compare %s: %s\n", prog, path, strerror(errno));
    return -1;
  }
  float *worker = xcalloc(total + 1, sizeof(float));
  int short_file = mlp_read_f32(in, worker, total) != 0;
  int long_file = fread(&worker[total], 1, 1, in) != 0;
  fclose(in);
  if (short_file || long_file) {
    fprintf(stderr, "%s: --compare %s: expected exactly %zu fp32 values (%zu bytes)\n", prog, path,
            total, total * sizeof(float));
    free(worker);
    return -1;
  }
  double max_rel_diff = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < total; i++) {
    double a = worker[i], b = reference[i];
    double rel_diff = fabs(a - b) / fmax(fabs(b), 1e-3);
    if (!(rel_diff <= max_rel_diff)) {
      max_rel_diff = rel_diff;
      worst = i;
    }
  }
  printf("compare %s: %zu parameters, max relative difference %.3g (parameter %zu: worker %.9g "
         "reference %.9g), tolerance %.3g\n",
         path, total, max_rel_diff, worst, (double)worker[worst], (double)reference[worst],
         tolerance);
  free(worker);
  if (!(max_rel_diff <= tolerance)) {
    fprintf(stderr, "%s: the worker's parameters differ from the reference\n", prog);
    return -1;
  }
  return 0;
}

int main(int argc, char **argv) {
  enum {
    OPT_WORLD = MLP_OPT_COMMON_END,
    OPT_OUT,
    OPT_COMPARE,
    OPT_TOLERANCE,
    OPT_RANKS_PER_NODE,
    OPT_HELP
  };
  static const struct option long_options[] = {
      MLP_COMMON_LONG_OPTIONS,
      {"world", required_argument, NULL, OPT_WORLD},
      {"out", required_argument, NULL, OPT_OUT},
      {"compare", required_argument, NULL, OPT_COMPARE},
      {"tolerance", required_argument, NULL, OPT_TOLERANCE},
      {"ranks-per-node", required_argument, NULL, OPT_RANKS_PER_NODE},
      {"help", no_argument, NULL, OPT_HELP},
      {NULL, 0, NULL, 0},
  };
  mlp_config config;
  mlp_config_defaults(&config);
  int world = 1, ranks_per_node = 1;
  const char *out_path = NULL;
  const char *compare_path = NULL;
  double tolerance = 1e-6;
  int opt;
  while ((opt = getopt_long(argc, argv, "h", long_options, NULL)) != -1) {
    int handled = mlp_config_option(&config, opt, optarg, prog);
    if (handled < 0)
      return 2;
    if (handled)
      continue;
    char *end;
    switch (opt) {
    case OPT_WORLD:
      world = (int)strtol(optarg, &end, 10);
      if (*end != '\0' || world < 1 || world > 4096) {
        fprintf(stderr, "%s: --world must be 1..4096\n", prog);
        return 2;
      }
      break;
    case OPT_RANKS_PER_NODE:
      ranks_per_node = (int)strtol(optarg, &end, 10);
      if (*end != '\0' || ranks_per_node < 1 || ranks_per_node > 4096) {
        fprintf(stderr, "%s: --ranks-per-node must be 1..4096\n", prog);
        return 2;
      }
      break;
    case OPT_OUT:
      out_path = optarg;
      break;
    case OPT_COMPARE:
      compare_path = optarg;
      break;
    case OPT_TOLERANCE:
      tolerance = strtod(optarg, &end);
      if (*end != '\0' || !(tolerance >= 0)) {
        fprintf(stderr, "%s: --tolerance must be a number >= 0\n", prog);
        return 2;
      }
      break;
    case 'h':
    case OPT_HELP:
      usage(stdout);
      return 0;
    default:
      usage(stderr);
      return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog, argv[optind]);
    return 2;
  }
  if (config.global_batch % world != 0) {
    fprintf(stderr, "%s: the global batch (%d) must divide evenly by the world size (%d)\n", prog,
            config.global_batch, world);
    return 2;
  }
  if (world % ranks_per_node != 0) {
    fprintf(stderr, "%s: --ranks-per-node (%d) must divide the world size (%d)\n", prog,
            ranks_per_node, world);
    return 2;
  }
  int local_batch = config.global_batch / world;

  mlp_teacher teacher;
  mlp_work work;
  if (mlp_teacher_init(&teacher, &config) != 0 || mlp_work_init(&work, &config, local_batch) != 0) {
    fprintf(stderr, "%s: out of memory\n", prog);
    return 1;
  }
  int layers = config.layers;
  ref_tensor *tensors = xcalloc(2 * (size_t)layers, sizeof *tensors);
  size_t total = mlp_total_params(&config);
  size_t widest_numel = 0;
  for (int l = 0; l < layers; l++) {
    size_t in = (size_t)mlp_layer_in(&config, l), out = (size_t)mlp_layer_out(&config, l);
    float *weight = xcalloc(out * in, sizeof(float));
    float *bias = xcalloc(out, sizeof(float));
    mlp_init_layer(&config, l, weight, bias);
    tensor_init(&tensors[2 * l], out * in, weight, config.bf16);
    tensor_init(&tensors[2 * l + 1], out, bias, config.bf16);
    free(weight);
    free(bias);
    if (out * in > widest_numel)
      widest_numel = out * in;
  }
  uint16_t *bf16_scratch = xcalloc(widest_numel, sizeof(uint16_t));
  float **weights_f32 = xcalloc((size_t)layers, sizeof *weights_f32);
  float **biases_f32 = xcalloc((size_t)layers, sizeof *biases_f32);
  for (int l = 0; l < layers && config.bf16; l++) {
    weights_f32[l] = xcalloc(tensors[2 * l].numel, sizeof(float));
    biases_f32[l] = xcalloc(tensors[2 * l + 1].numel, sizeof(float));
  }
  float *inputs = xcalloc((size_t)local_batch * (size_t)config.input_dim, sizeof(float));
  float *targets = xcalloc((size_t)local_batch * (size_t)config.output_dim, sizeof(float));

  printf("mlp_reference: %d layers, %zu parameters, world %d, global batch %d, %s, %s\n", layers,
         total, world, config.global_batch, config.bf16 ? "bf16" : "fp32",
         config.optimizer == MLP_SGD    ? "sgd"
         : config.optimizer == MLP_ADAM ? "adam"
                                        : "adamw");
  double first_loss = 0, last_loss = 0, train_s = 0;
  for (int step = 0; step < config.steps; step++) {
    double start_s = mlp_now_s();
    for (int t = 0; t < 2 * layers; t++)
      memset(tensors[t].grad_sum, 0, tensors[t].numel * sizeof(float));

    /* The working copy is the same for every rank within a step. */
    const float **weights = xcalloc((size_t)layers, sizeof *weights);
    const float **biases = xcalloc((size_t)layers, sizeof *biases);
    for (int l = 0; l < layers; l++) {
      weights[l] = working_f32(&tensors[2 * l], config.bf16, weights_f32[l]);
      biases[l] = working_f32(&tensors[2 * l + 1], config.bf16, biases_f32[l]);
    }
    double loss_sum = 0;
    for (int rank = 0; rank < world; rank++) {
      mlp_make_batch(&teacher, &config, step, rank * local_batch, local_batch, inputs, targets);
      mlp_set_inputs(&work, inputs);
      for (int l = 0; l < layers; l++)
        mlp_forward_layer(&work, l, weights[l], biases[l]);
      loss_sum += mlp_loss(&work, targets, config.global_batch);
      for (int l = layers - 1; l >= 0; l--) {
        mlp_backward_layer(&work, l, weights[l], work.weight_grad, work.bias_grad);
        accumulate_grad(&tensors[2 * l], work.weight_grad, config.bf16, bf16_scratch, rank,
                        ranks_per_node);
        accumulate_grad(&tensors[2 * l + 1], work.bias_grad, config.bf16, bf16_scratch, rank,
                        ranks_per_node);
      }
    }
    free(weights);
    free(biases);

    /* Global gradient norm, in double over every parameter (the daemon's
     * padding is zero and adds nothing), and torch's clip coefficient. */
    double sumsq = 0;
    for (int t = 0; t < 2 * layers; t++) {
      for (size_t i = 0; i < tensors[t].numel; i++)
        sumsq += (double)tensors[t].grad_sum[i] * tensors[t].grad_sum[i];
    }
    double grad_norm = sqrt(sumsq);
    double grad_scale = 1.0;
    if (config.max_grad_norm > 0) {
      double clip_coef = config.max_grad_norm / (grad_norm + 1e-6);
      if (clip_coef < 1.0)
        grad_scale = clip_coef;
    }
    for (int t = 0; t < 2 * layers; t++) {
      if (optimizer_step(&config, &tensors[t], step + 1, grad_scale) != 0) {
        fprintf(stderr, "%s: the optimizer refused the hyper-parameters\n", prog);
        return 1;
      }
    }
    double step_s = mlp_now_s() - start_s;
    train_s += step_s;

    double loss = loss_sum / config.global_batch;
    if (step == 0)
      first_loss = loss;
    last_loss = loss;
    if (step == 0 || (step + 1) % config.log_every == 0 || step + 1 == config.steps)
      printf("step %d/%d loss %.6f grad_norm %.3f step_ms %.1f samples/s %.0f\n", step + 1,
             config.steps, loss, grad_norm, step_s * 1e3, config.global_batch / step_s);
    fflush(stdout);
  }
  if (config.steps > 0)
    printf("done: %d steps, loss %.6f -> %.6f, %.2f steps/s\n", config.steps, first_loss, last_loss,
           config.steps / train_s);

  int status = 0;
  float *params = final_params(&config, tensors, total);
  if (out_path != NULL) {
    FILE *out = fopen(out_path, "wb");
    if (out == NULL || mlp_write_f32(out, params, total) != 0 || fclose(out) != 0) {
      fprintf(stderr, "%s: --out %s: %s\n", prog, out_path, strerror(errno));
      status = 1;
    }
  }
  if (compare_path != NULL && compare_with(compare_path, params, total, tolerance) != 0)
    status = 1;

  free(params);
  free(inputs);
  free(targets);
  for (int l = 0; l < layers; l++) {
    free(weights_f32[l]);
    free(biases_f32[l]);
  }
  free(weights_f32);
  free(biases_f32);
  free(bf16_scratch);
  for (int t = 0; t < 2 * layers; t++)
    tensor_free(&tensors[t]);
  free(tensors);
  mlp_work_free(&work);
  mlp_teacher_free(&teacher);
  return status;
}
