/* bench_cuda - CUDA kernel throughput against the GPU memory's limit,
 * measured in the same run on the same device.
 *
 * The AdamW step is memory-bound: per parameter it reads p, m, v and an fp32
 * gradient and writes p, m, v and a bf16 working copy, 30 bytes in all. Its
 * baseline is a device-to-device copy (cudaMemcpyAsync) of 15 bytes per
 * parameter, which also moves 30 bytes per parameter (15 read, 15 written):
 * both figures count bytes read plus bytes written, so the ratio says how
 * close the step comes to merely moving its bytes. A few other kernels are
 * printed against the same baseline, without a target.
 *
 * Each figure is the median over several repeats of the time per call,
 * measured with a stream synchronisation and clock_gettime around a batch of
 * calls after a warm-up. Output: one JSON object per line (docs/benchmarks.md); without
 * a usable GPU a single {"bench":"adamw_cuda","skipped":...} line, exit 0.
 *
 * The program links only the CPU kernel library and reaches the GPU through
 * the module's table (zk_cuda_load), as zerod does.
 *
 * Usage: bench_cuda [--numel N] [--reps N] [--iters N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda/zk_cuda.h"
#include "bench_util.h"
#include "zk.h"

/* What a step must reach, as a fraction of the copy's bandwidth. */
#define ADAMW_TARGET_RATIO 0.85

static const zk_cuda_api *cu;

/* Prints s as a JSON string (quotes included). */
static void print_json_string(const char *s) {
  putchar('"');
  for (; *s != '\0'; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\')
      printf("\\%c", c);
    else if (c < 0x20)
      printf("\\u%04x", c);
    else
      putchar(c);
  }
  putchar('"');
}

/* Every CUDA failure ends the benchmark: a figure measured after one would
 * mean nothing. */
static void check(int rc, const char *what) {
  if (rc != 0) {
    fprintf(stderr, "bench_cuda: %s failed (%d): %s\n", what, rc, cu->last_error());
    exit(1);
  }
}

static void *dev_alloc(size_t bytes, int fill_byte) {
  void *ptr = NULL;
  check(cu->alloc(&ptr, bytes), "alloc");
  /* Touches every page before timing, and gives the kernels normal,
   * finite values (0x3c3c3c3c is about 0.0115). */
  check(cu->memset(ptr, fill_byte, bytes), "memset");
  return ptr;
}

/* ---- the operations ---------------------------------------------------- */

typedef enum bench_op { OP_ADAMW, OP_COPY, OP_CAST_BF16, OP_SUMSQ, OP_QUANT8 } bench_op;

typedef struct bench_ctx {
  size_t numel;
  float *p, *m, *v, *g;
  void *w;
  void *copy_src, *copy_dst;
  size_t copy_bytes;
  double *sum;
  zk_qformat qfmt;
  void *qbuf;
  size_t qbytes;
  int64_t step;
} bench_ctx;

static void run_op(bench_ctx *c, bench_op op) {
  switch (op) {
  case OP_ADAMW: {
    zk_adam_hparams hp = {.lr = 1e-3,
                          .beta1 = 0.9,
                          .beta2 = 0.999,
                          .eps = 1e-8,
                          .weight_decay = 1e-2,
                          .decoupled_weight_decay = 1,
                          .step = ++c->step,
                          .grad_scale = 1.0};
    check(cu->adam_step(NULL, &hp, c->p, c->m, c->v, c->g, ZK_F32, c->w, ZK_BF16, c->numel),
          "adam_step");
    break;
  }
  case OP_COPY:
    check(cu->copy_device(c->copy_dst, c->copy_src, c->copy_bytes, NULL), "copy_device");
    break;
  case OP_CAST_BF16:
    check(cu->cast(NULL, c->w, ZK_BF16, c->p, ZK_F32, c->numel), "cast");
    break;
  case OP_SUMSQ:
    check(cu->sumsq(NULL, c->g, ZK_F32, c->numel, c->sum), "sumsq");
    break;
  case OP_QUANT8:
    check(cu->quantize(NULL, &c->qfmt, c->g, c->numel, c->qbuf, c->qbytes, NULL), "quantize");
    break;
  }
}

/* Median seconds per call over `reps` batches of `iters` calls. */
static double median_seconds(bench_ctx *c, bench_op op, int reps, int iters) {
  double t[64];
  if (reps > 64)
    reps = 64;
  for (int i = 0; i < 3; i++)
    run_op(c, op); /* warm-up: first-launch costs, clocks up */
  check(cu->synchronize(NULL), "synchronize");
  for (int r = 0; r < reps; r++) {
    double t0 = bench_now_s();
    for (int i = 0; i < iters; i++)
      run_op(c, op);
    check(cu->synchronize(NULL), "synchronize");
    t[r] = (bench_now_s() - t0) / iters;
  }
  return bench_median(t, reps);
}

static void print_ratio(const char *bench, const char *device, size_t numel, double value,
                        double baseline_value, double target) {
  printf("{\"bench\":\"%s\",\"device\":", bench);
  print_json_string(device);
  printf(",\"numel\":%zu,\"metric\":\"GB/s\",\"value\":%.1f,\"baseline\":\"d2d_copy\","
         "\"baseline_value\":%.1f,\"ratio\":%.3f",
         numel, value, baseline_value, value / baseline_value);
  if (target > 0)
    printf(",\"target\":%.2f,\"direction\":\"min\",\"met\":%s", target,
           value / baseline_value >= target ? "true" : "false");
  printf("}\n");
  fflush(stdout);
}

int main(int argc, char **argv) {
  size_t numel = (size_t)64 << 20;
  int reps = 11, iters = 10;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--numel") == 0 && i + 1 < argc)
      numel = strtoull(argv[++i], NULL, 10);
    else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
      reps = atoi(argv[++i]);
    else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
      iters = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [--numel N] [--reps N] [--iters N]\n", argv[0]);
      return 2;
    }
  }
  if (numel == 0 || reps < 1 || iters < 1) {
    fprintf(stderr, "bench_cuda: --numel, --reps and --iters must be positive\n");
    return 2;
  }

  char why[512] = "";
  if (zk_cuda_load(&cu, why, sizeof why) != 0) {
    printf("{\"bench\":\"adamw_cuda\",\"skipped\":");
    print_json_string(why);
    printf("}\n");
    return 0;
  }
  char device[256] = "";
  check(cu->device_name(0, device, sizeof device), "device_name");

  bench_ctx c = {.numel = numel, .qfmt = {.bits = 8, .mode = ZK_QSYM, .block_numel = 2048}};
  c.p = dev_alloc(numel * 4, 0x3c);
  c.m = dev_alloc(numel * 4, 0);
  c.v = dev_alloc(numel * 4, 0);
  c.g = dev_alloc(numel * 4, 0x3b);
  c.w = dev_alloc(numel * 2, 0);
  const double bytes_per_param = 30.0;
  c.copy_bytes = numel * 15;
  c.copy_src = dev_alloc(c.copy_bytes, 0x3c);
  c.copy_dst = dev_alloc(c.copy_bytes, 0);
  c.sum = dev_alloc(sizeof(double), 0);
  c.qbytes = zk_quant_bytes(&c.qfmt, numel);
  c.qbuf = dev_alloc(c.qbytes, 0);

  /* Interleaved, so that a clock or a neighbour changing during the run
   * affects both sides alike. */
  double t_copy = median_seconds(&c, OP_COPY, reps, iters);
  double t_adamw = median_seconds(&c, OP_ADAMW, reps, iters);
  double t_copy2 = median_seconds(&c, OP_COPY, reps, iters);
  if (t_copy2 < t_copy)
    t_copy = t_copy2;
  double copy_gbs = 2.0 * (double)c.copy_bytes / t_copy / 1e9;
  double adamw_gbs = bytes_per_param * (double)numel / t_adamw / 1e9;
  print_ratio("adamw_cuda", device, numel, adamw_gbs, copy_gbs, ADAMW_TARGET_RATIO);
  printf("{\"bench\":\"adamw_cuda\",\"device\":");
  print_json_string(device);
  printf(",\"metric\":\"Mparams/s\",\"value\":%.1f}\n", (double)numel / t_adamw / 1e6);

  /* The other kernels: bytes read plus written, against the same copy. */
  double t_cast = median_seconds(&c, OP_CAST_BF16, reps, iters);
  double t_sumsq = median_seconds(&c, OP_SUMSQ, reps, iters);
  double t_quant = median_seconds(&c, OP_QUANT8, reps, iters);
  print_ratio("cast_f32_bf16_cuda", device, numel, 6.0 * (double)numel / t_cast / 1e9, copy_gbs,
              0.0);
  print_ratio("sumsq_f32_cuda", device, numel, 4.0 * (double)numel / t_sumsq / 1e9, copy_gbs, 0.0);
  print_ratio("quantize_int8_cuda", device, numel,
              (4.0 * (double)numel + (double)c.qbytes) / t_quant / 1e9, copy_gbs, 0.0);

  void *buffers[] = {c.p, c.m, c.v, c.g, c.w, c.copy_src, c.copy_dst, c.sum, c.qbuf};
  for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++)
    check(cu->free(buffers[i]), "free");
  return 0;
}
