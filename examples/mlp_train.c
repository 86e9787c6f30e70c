/* mlp_train.c - a data-parallel training worker that keeps its model in
 * zerod: one process per rank, each attached to the same job on its node's
 * daemon, each training on its share of every global batch.
 *
 * How to run it (one node, two CPU ranks):
 *
 *   zerod standalone --ranks 2 &   # the daemon with 2 CPU ranks, socket in .zerod/
 *   zerod-mlp-train --local-rank 0 --dump w.bin &   # rank 0 (creates the job)
 *   zerod-mlp-train --local-rank 1                  # rank 1
 *   zerod-mlp-reference --world 2 --compare w.bin   # the same training without zerod
 *
 * Every rank must get the same model, data and optimizer flags. Attaching
 * to a job that already exists continues its training from the daemon's
 * state, so compare with the reference only on a fresh job. The model
 * is the MLP of mlp.h, one zerod unit per Linear layer (tensors
 * "layerN.weight" [out, in] and "layerN.bias" [out]), initialised by rank 0
 * (ZD_INIT_FROM_RANK0). A step, per rank:
 *
 *   forward:  for each layer, gather the unit (the next one is requested
 *             while this one computes), compute straight from the shared
 *             view, release;
 *   backward: for each layer from the last, gather again (served from the
 *             daemon's cache when no step happened since), write the
 *             gradient straight into the unit's gradient buffer, release,
 *             reduce (the daemon sums the ranks' gradients);
 *   step:     the daemon clips and runs the optimizer on its shards.
 *
 * Each rank's gradient is that of (sum of its samples' losses) / (global
 * batch), so the sum over ranks is the gradient of the global mean loss.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mlp.h"
#include "zerod.h"

static const char *prog = "mlp_train";

/* Reports a failed zerod call the same way everywhere, and exits: a worker
 * that lost its daemon or its job has nothing left to do. */
#define ZD_CHECK(call, name)                                                                       \
  do {                                                                                             \
    zd_status check_status_ = (call);                                                              \
    if (check_status_ != ZD_OK) {                                                                  \
      fprintf(stderr, "%s: %s: %s: %s\n", prog, (name), zd_strerror(check_status_),                \
              zd_last_error());                                                                    \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

typedef struct worker {
  mlp_config config;
  zd_job *job;
  zd_unit *units;
  unsigned rank;
  unsigned world_size;
  mlp_work work;
} worker;

static void usage(FILE *out) {
  fprintf(out,
          "Usage: zerod-mlp-train [options]\n"
          "A data-parallel training worker for the example MLP whose parameters, gradients\n"
          "and optimizer state live in zerod. Run one per rank, with the same options.\n\n"
          "  --socket PATH       the daemon's socket (default $ZEROD_SOCKET, else\n"
          "                      .zerod/zerod.sock)\n"
          "  --job NAME          job name (default mlp)\n"
          "  --local-rank N      this worker's rank on its node (default 0)\n"
          "  --create            create the job if it does not exist (the default)\n"
          "  --no-create         attach only to an existing job\n"
          "  --token T           the job's owner token (default $ZEROD_TOKEN; a job made\n"
          "                      with zerodctl jobs create prints it)\n"
          "  --dump FILE         after the last step, write all parameters (raw little-endian\n"
          "                      fp32, every layer's weight then bias) to FILE; rank 0\n"
          "                      writes, every rank takes part in the final gathers\n"
          "  --stats             after the last step, print what the collectives of the\n"
          "                      job's ranks on this daemon moved (zd_job_stats), one\n"
          "                      line per rank, level and collective\n"
          "  --save-at N         after step N, save a service checkpoint (step-<N>; every\n"
          "                      rank calls zd_checkpoint_save)\n"
          "  --restore NAME      before training, restore the job from its checkpoint NAME\n"
          "                      and go on from the checkpoint's step\n"
          "  --help              this text\n\n"
          "Rank 0 prints a line per logged step: the loss is the mean over rank 0's own\n"
          "samples (its share of the global batch), grad_norm is the global gradient norm\n"
          "before clipping, step_ms the step's wall time and samples/s the global batch\n"
          "over it.\n\n");
  mlp_config_usage(out);
}

/* A gathered layer's weight and bias as fp32: the shared view itself, or a
 * conversion into scratch when the working dtype is bf16. */
static void layer_params(worker *w, int layer, const zd_view *view, const float **weight,
                         const float **bias) {
  size_t in = (size_t)mlp_layer_in(&w->config, layer);
  size_t out = (size_t)mlp_layer_out(&w->config, layer);
  if (view->ntensors != 2 || view->tensors[0].numel != out * in || view->tensors[1].numel != out) {
    fprintf(stderr, "%s: unit layer%d does not have the expected tensors\n", prog, layer);
    exit(1);
  }
  if (view->dtype == ZD_F32) {
    *weight = view->tensors[0].data;
    *bias = view->tensors[1].data;
    return;
  }
  if (view->dtype != ZD_BF16) {
    fprintf(stderr, "%s: layer%d: working dtype %d is not supported by this example\n", prog, layer,
            (int)view->dtype);
    exit(1);
  }
  mlp_bf16_to_f32(view->tensors[0].data, w->work.weight_fp32, out * in);
  mlp_bf16_to_f32(view->tensors[1].data, w->work.bias_fp32, out);
  *weight = w->work.weight_fp32;
  *bias = w->work.bias_fp32;
}

/* The daemon reduces the whole gradient buffer, alignment gaps and padding
 * included, so whatever the tensors do not cover must be zero. */
static void zero_gaps(const zd_view *view) {
  size_t elem_bytes = view->dtype == ZD_F32 ? 4 : 2;
  size_t covered_end = 0;
  for (unsigned t = 0; t < view->ntensors; t++) {
    size_t begin = (size_t)view->tensors[t].offset * elem_bytes;
    if (begin < covered_end) {
      /* Not in ascending order: clear everything once, conservatively. */
      memset(view->base, 0, view->bytes);
      return;
    }
    memset((char *)view->base + covered_end, 0, begin - covered_end);
    covered_end = begin + (size_t)view->tensors[t].numel * elem_bytes;
  }
  memset((char *)view->base + covered_end, 0, view->bytes - covered_end);
}

static void register_units(worker *w) {
  const mlp_config *config = &w->config;
  w->units = calloc((size_t)config->layers, sizeof *w->units);
  if (w->units == NULL) {
    fprintf(stderr, "%s: out of memory\n", prog);
    exit(1);
  }
  for (int l = 0; l < config->layers; l++) {
    uint64_t in = (uint64_t)mlp_layer_in(config, l);
    uint64_t out = (uint64_t)mlp_layer_out(config, l);
    char unit_name[32], weight_name[48], bias_name[48];
    snprintf(unit_name, sizeof unit_name, "layer%d", l);
    snprintf(weight_name, sizeof weight_name, "layer%d.weight", l);
    snprintf(bias_name, sizeof bias_name, "layer%d.bias", l);
    uint64_t weight_shape[2] = {out, in};
    uint64_t bias_shape[1] = {out};
    zd_tensor_desc tensors[2] = {
        {.struct_size = sizeof(zd_tensor_desc),
         .name = weight_name,
         .shape = weight_shape,
         .ndim = 2},
        {.struct_size = sizeof(zd_tensor_desc), .name = bias_name, .shape = bias_shape, .ndim = 1},
    };
    /* Only rank 0's values are used; the other ranks skip the work. */
    float *init_values = NULL;
    if (w->rank == 0) {
      init_values = malloc(sizeof(float) * (size_t)(out * in + out));
      if (init_values == NULL) {
        fprintf(stderr, "%s: out of memory\n", prog);
        exit(1);
      }
      mlp_init_layer(config, l, init_values, init_values + out * in);
    }
    zd_unit_desc desc = ZD_UNIT_DESC_INIT;
    desc.name = unit_name;
    desc.tensors = tensors;
    desc.ntensors = 2;
    desc.init = ZD_INIT_FROM_RANK0;
    desc.init_values = init_values;
    char call[64];
    snprintf(call, sizeof call, "zd_register_unit(%s)", unit_name);
    ZD_CHECK(zd_register_unit(w->job, &desc, &w->units[l]), call);
    free(init_values);
  }
}

/* Forward through every layer; the next layer's gather is in flight while
 * this one computes. */
static void forward(worker *w) {
  int layers = w->config.layers;
  zd_pending pending = ZD_PENDING_INIT;
  ZD_CHECK(zd_gather_async(w->job, w->units[0], &pending), "zd_gather_async");
  for (int l = 0; l < layers; l++) {
    zd_view view = ZD_VIEW_INIT;
    ZD_CHECK(zd_gather_wait(w->job, &pending, &view), "zd_gather_wait");
    if (l + 1 < layers)
      ZD_CHECK(zd_gather_async(w->job, w->units[l + 1], &pending), "zd_gather_async");
    const float *weight, *bias;
    layer_params(w, l, &view, &weight, &bias);
    mlp_forward_layer(&w->work, l, weight, bias);
    ZD_CHECK(zd_release(w->job, w->units[l]), "zd_release");
  }
}

static void backward(worker *w) {
  int layers = w->config.layers;
  zd_pending pending = ZD_PENDING_INIT;
  ZD_CHECK(zd_gather_async(w->job, w->units[layers - 1], &pending), "zd_gather_async");
  for (int l = layers - 1; l >= 0; l--) {
    zd_view view = ZD_VIEW_INIT, grad = ZD_VIEW_INIT;
    ZD_CHECK(zd_gather_wait(w->job, &pending, &view), "zd_gather_wait");
    if (l > 0)
      ZD_CHECK(zd_gather_async(w->job, w->units[l - 1], &pending), "zd_gather_async");
    ZD_CHECK(zd_grad_buffer(w->job, w->units[l], &grad), "zd_grad_buffer");
    const float *weight, *bias;
    layer_params(w, l, &view, &weight, &bias);
    size_t out = (size_t)mlp_layer_out(&w->config, l);
    size_t weight_numel = out * (size_t)mlp_layer_in(&w->config, l);
    if (grad.ntensors != 2 || grad.tensors[0].numel != weight_numel ||
        grad.tensors[1].numel != out) {
      fprintf(stderr, "%s: gradient buffer of layer%d has unexpected tensors\n", prog, l);
      exit(1);
    }
    zero_gaps(&grad);
    if (grad.dtype == ZD_F32) {
      mlp_backward_layer(&w->work, l, weight, grad.tensors[0].data, grad.tensors[1].data);
    } else if (grad.dtype == ZD_BF16) {
      /* Computed in fp32, rounded to nearest even into the shared buffer. */
      mlp_backward_layer(&w->work, l, weight, w->work.weight_grad, w->work.bias_grad);
      mlp_f32_to_bf16(w->work.weight_grad, grad.tensors[0].data, weight_numel);
      mlp_f32_to_bf16(w->work.bias_grad, grad.tensors[1].data, out);
    } else {
      fprintf(stderr, "%s: layer%d: gradient dtype %d is not supported by this example\n", prog, l,
              (int)grad.dtype);
      exit(1);
    }
    ZD_CHECK(zd_release(w->job, w->units[l]), "zd_release");
    ZD_CHECK(zd_reduce(w->job, w->units[l]), "zd_reduce");
  }
}

/* Gathers every unit once more (a collective: all ranks take part) and, on
 * rank 0, writes the parameters to path. */
static int dump_params(worker *w, const char *path) {
  FILE *out = NULL;
  if (w->rank == 0 && path != NULL) {
    out = fopen(path, "wb");
    if (out == NULL) {
      fprintf(stderr, "%s: --dump %s: %s\n", prog, path, strerror(errno));
      return -1;
    }
  }
  int failed = 0;
  for (int l = 0; l < w->config.layers; l++) {
    zd_view view = ZD_VIEW_INIT;
    ZD_CHECK(zd_gather(w->job, w->units[l], &view), "zd_gather");
    const float *weight, *bias;
    layer_params(w, l, &view, &weight, &bias);
    if (out != NULL) {
      failed |= mlp_write_f32(out, weight, view.tensors[0].numel) != 0;
      failed |= mlp_write_f32(out, bias, view.tensors[1].numel) != 0;
    }
    ZD_CHECK(zd_release(w->job, w->units[l]), "zd_release");
  }
  if (out != NULL && (fclose(out) != 0 || failed)) {
    fprintf(stderr, "%s: --dump %s: write failed\n", prog, path);
    return -1;
  }
  return 0;
}

/* --stats: "stats rank R level L collective C bytes B calls N" lines. */
static int print_stats(worker *w) {
  zd_rank_stats ranks[64] = {ZD_RANK_STATS_INIT};
  unsigned n = 0;
  if (zd_job_stats(w->job, ranks, 64, &n) != ZD_OK) {
    fprintf(stderr, "%s: zd_job_stats: %s\n", prog, zd_last_error());
    return -1;
  }
  for (unsigned r = 0; r < n && r < 64; r++)
    for (unsigned k = 0; k < ranks[r].ncounters; k++)
      printf("stats rank %u level %s collective %s bytes %llu calls %llu\n", ranks[r].rank,
             ranks[r].counters[k].level, ranks[r].counters[k].collective,
             (unsigned long long)ranks[r].counters[k].bytes,
             (unsigned long long)ranks[r].counters[k].calls);
  fflush(stdout);
  return 0;
}

int main(int argc, char **argv) {
  enum {
    OPT_SOCKET = MLP_OPT_COMMON_END,
    OPT_JOB,
    OPT_LOCAL_RANK,
    OPT_CREATE,
    OPT_NO_CREATE,
    OPT_DUMP,
    OPT_TOKEN,
    OPT_STATS,
    OPT_SAVE_AT,
    OPT_RESTORE,
    OPT_HELP
  };
  static const struct option long_options[] = {
      MLP_COMMON_LONG_OPTIONS,
      {"socket", required_argument, NULL, OPT_SOCKET},
      {"job", required_argument, NULL, OPT_JOB},
      {"local-rank", required_argument, NULL, OPT_LOCAL_RANK},
      {"create", no_argument, NULL, OPT_CREATE},
      {"no-create", no_argument, NULL, OPT_NO_CREATE},
      {"dump", required_argument, NULL, OPT_DUMP},
      {"token", required_argument, NULL, OPT_TOKEN},
      {"stats", no_argument, NULL, OPT_STATS},
      {"save-at", required_argument, NULL, OPT_SAVE_AT},
      {"restore", required_argument, NULL, OPT_RESTORE},
      {"help", no_argument, NULL, OPT_HELP},
      {NULL, 0, NULL, 0},
  };
  worker w;
  memset(&w, 0, sizeof w);
  mlp_config_defaults(&w.config);
  const char *socket_path = NULL;
  const char *job_name = "mlp";
  const char *dump_path = NULL;
  const char *token = NULL; /* libzerod sends $ZEROD_TOKEN */
  const char *restore = NULL;
  unsigned local_rank = 0;
  int create = 1, stats = 0, save_at = 0;
  int opt;
  while ((opt = getopt_long(argc, argv, "h", long_options, NULL)) != -1) {
    int handled = mlp_config_option(&w.config, opt, optarg, prog);
    if (handled < 0)
      return 2;
    if (handled)
      continue;
    char *end;
    switch (opt) {
    case OPT_SOCKET:
      socket_path = optarg;
      break;
    case OPT_JOB:
      job_name = optarg;
      break;
    case OPT_LOCAL_RANK: {
      long value = strtol(optarg, &end, 10);
      if (*end != '\0' || value < 0 || value > 65535) {
        fprintf(stderr, "%s: --local-rank must be 0..65535\n", prog);
        return 2;
      }
      local_rank = (unsigned)value;
      break;
    }
    case OPT_CREATE:
      create = 1;
      break;
    case OPT_NO_CREATE:
      create = 0;
      break;
    case OPT_DUMP:
      dump_path = optarg;
      break;
    case OPT_TOKEN:
      token = optarg;
      break;
    case OPT_STATS:
      stats = 1;
      break;
    case OPT_SAVE_AT: {
      long value = strtol(optarg, &end, 10);
      if (*end != '\0' || value < 1 || value > 1000000000) {
        fprintf(stderr, "%s: --save-at must be a step number >= 1\n", prog);
        return 2;
      }
      save_at = (int)value;
      break;
    }
    case OPT_RESTORE:
      restore = optarg;
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
  const mlp_config *config = &w.config;

  zd_client *client;
  ZD_CHECK(zd_connect(socket_path, &client), "zd_connect");
  zd_job_config job_config = ZD_JOB_CONFIG_INIT;
  job_config.optimizer = config->optimizer == MLP_SGD    ? ZD_SGD
                         : config->optimizer == MLP_ADAM ? ZD_ADAM
                                                         : ZD_ADAMW;
  job_config.lr = config->lr;
  job_config.beta1 = config->beta1;
  job_config.beta2 = config->beta2;
  job_config.eps = config->eps;
  job_config.weight_decay = mlp_config_weight_decay(config);
  job_config.has_weight_decay = 1;
  job_config.momentum = config->momentum;
  job_config.working_dtype = config->bf16 ? ZD_BF16 : ZD_F32;
  job_config.max_grad_norm = config->max_grad_norm;
  zd_attach_options attach = ZD_ATTACH_OPTIONS_INIT;
  attach.job = job_name;
  attach.local_rank = local_rank;
  attach.token = token;
  attach.create = create;
  attach.config = &job_config;
  ZD_CHECK(zd_attach(client, &attach, &w.job), "zd_attach");
  w.rank = zd_job_rank(w.job);
  w.world_size = zd_job_world_size(w.job);
  if (config->global_batch % (int)w.world_size != 0) {
    fprintf(stderr, "%s: the global batch (%d) must divide evenly by the world size (%u)\n", prog,
            config->global_batch, w.world_size);
    zd_close(client);
    return 1;
  }
  int local_batch = config->global_batch / (int)w.world_size;
  mlp_teacher teacher;
  if (mlp_teacher_init(&teacher, config) != 0 || mlp_work_init(&w.work, config, local_batch) != 0) {
    fprintf(stderr, "%s: out of memory\n", prog);
    return 1;
  }
  float *inputs = malloc(sizeof(float) * (size_t)local_batch * (size_t)config->input_dim);
  float *targets = malloc(sizeof(float) * (size_t)local_batch * (size_t)config->output_dim);
  if (inputs == NULL || targets == NULL) {
    fprintf(stderr, "%s: out of memory\n", prog);
    return 1;
  }
  register_units(&w);
  if (w.rank == 0)
    printf("mlp_train: job %s, rank %u of %u, %d layers, %zu parameters, global batch %d "
           "(%d per rank), %s, starting at version %llu\n",
           job_name, w.rank, w.world_size, config->layers, mlp_total_params(config),
           config->global_batch, local_batch, config->bf16 ? "bf16" : "fp32",
           (unsigned long long)zd_job_version(w.job));

  /* Resuming: the job goes back to the checkpoint (a collective of the
   * ranks), and training goes on from its step with the same batches. */
  int first_step = 0;
  if (restore != NULL) {
    zd_checkpoint_info info = ZD_CHECKPOINT_INFO_INIT;
    ZD_CHECK(zd_checkpoint_restore(w.job, restore, &info), "zd_checkpoint_restore");
    first_step = (int)info.step;
    if (w.rank == 0)
      printf("restored checkpoint %s: step %llu (%lld ms)\n", info.name,
             (unsigned long long)info.step, (long long)info.total_ms);
  }

  double first_loss = 0, last_loss = 0, train_s = 0;
  for (int step = first_step; step < config->steps; step++) {
    double start_s = mlp_now_s();
    mlp_make_batch(&teacher, config, step, (int)w.rank * local_batch, local_batch, inputs, targets);
    mlp_set_inputs(&w.work, inputs);
    forward(&w);
    double loss = mlp_loss(&w.work, targets, config->global_batch) / local_batch;
    backward(&w);
    zd_step_result result = ZD_STEP_RESULT_INIT;
    ZD_CHECK(zd_step(w.job, NULL, &result), "zd_step");
    double step_s = mlp_now_s() - start_s;
    train_s += step_s;
    if (step == first_step)
      first_loss = loss;
    last_loss = loss;
    if (w.rank == 0 &&
        (step == 0 || (step + 1) % config->log_every == 0 || step + 1 == config->steps)) {
      printf("step %d/%d loss %.6f grad_norm %.3f step_ms %.1f samples/s %.0f%s\n", step + 1,
             config->steps, loss, result.grad_norm, step_s * 1e3, config->global_batch / step_s,
             result.skipped ? " (skipped: non-finite gradients)" : "");
      fflush(stdout);
    }
    if (step + 1 == save_at) {
      zd_checkpoint_info info = ZD_CHECKPOINT_INFO_INIT;
      ZD_CHECK(zd_checkpoint_save(w.job, NULL, &info), "zd_checkpoint_save");
      if (w.rank == 0)
        printf("saved checkpoint %s: step %llu, training held %lld ms (%lld ms in all)\n",
               info.name, (unsigned long long)info.step, (long long)info.stall_ms,
               (long long)info.total_ms);
    }
  }
  if (w.rank == 0 && config->steps > first_step)
    printf("done: %d steps, loss %.6f -> %.6f (rank 0's samples), %.2f steps/s\n",
           config->steps - first_step, first_loss, last_loss,
           (config->steps - first_step) / train_s);

  int status = dump_params(&w, dump_path) == 0 ? 0 : 1;
  if (stats && print_stats(&w) != 0)
    status = 1;
  ZD_CHECK(zd_detach(w.job), "zd_detach");
  zd_close(client);
  free(inputs);
  free(targets);
  free(w.units);
  mlp_work_free(&w.work);
  mlp_teacher_free(&teacher);
  return status;
}
