/* bench_kernels - CPU kernel throughput against the memory system's limit,
 * measured in the same run on the same buffers and threads.
 *
 * The optimizer step is memory-bound, so its baseline is a plain stream that
 * reads and writes exactly the arrays the step does (p, m, v, g in; p, m, v
 * and the bf16 working copy out: 30 bytes per parameter) with no arithmetic.
 * A STREAM triad over the same bytes is printed too, for comparison with
 * published figures; it under-counts write-allocate traffic, so it is not
 * the target's baseline. Each figure is the median of several timed runs
 * after a warm-up. Output: one JSON object per line (docs/benchmarks.md).
 *
 * Usage: bench_kernels [--state-mib N] [--reps N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "zk.h"
#include "../kernels/cpu/internal.h"

static void *alloc_pages(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 4096, bytes) != 0) {
    fprintf(stderr, "bench_kernels: cannot allocate %zu bytes\n", bytes);
    exit(1);
  }
  memset(p, 0, bytes); /* fault the pages in before timing */
  return p;
}

/* ---- the arrays and the baselines -------------------------------------- */

typedef struct arrays {
  size_t n;
  float *p, *m, *v, *g;
  uint16_t *w;
  uint8_t *q; /* the int8 codes of the quantized buffer (after its scales) */
} arrays;

ZK_VECTOR_LOOP static void stream_same_arrays(arrays *a, size_t begin, size_t end) {
  float *restrict p = a->p, *restrict m = a->m, *restrict v = a->v;
  const float *restrict g = a->g;
  uint16_t *restrict w = a->w;
  for (size_t i = begin; i < end; i++) {
    float pi = p[i], mi = m[i], vi = v[i], gi = g[i];
    p[i] = mi;
    m[i] = vi;
    v[i] = gi;
    w[i] = (uint16_t)(zk_f32_bits(pi) >> 16);
  }
}

ZK_VECTOR_LOOP static void triad(arrays *a, size_t begin, size_t end) {
  /* a = b + s * c over p, m and v: 12 bytes per element. */
  float *restrict dst = a->p;
  const float *restrict b = a->m, *restrict c = a->v;
  for (size_t i = begin; i < end; i++)
    dst[i] = b[i] + 3.0f * c[i];
}

/* Baselines for the narrower kernels: the same reads and writes, no math. */
ZK_VECTOR_LOOP static void stream_f32_to_u16(arrays *a, size_t begin, size_t end) {
  const float *restrict src = a->p;
  uint16_t *restrict dst = a->w;
  for (size_t i = begin; i < end; i++)
    dst[i] = (uint16_t)(zk_f32_bits(src[i]) >> 16);
}

static volatile uint32_t read_sink;

ZK_VECTOR_LOOP static void stream_read_f32(arrays *a, size_t begin, size_t end) {
  const float *restrict src = a->g;
  uint32_t acc = 0;
  for (size_t i = begin; i < end; i++)
    acc += zk_f32_bits(src[i]);
  read_sink = acc; /* keeps the loads alive */
}

ZK_VECTOR_LOOP static void stream_f32_to_u8(arrays *a, size_t begin, size_t end) {
  const float *restrict src = a->g;
  uint8_t *restrict dst = a->q;
  for (size_t i = begin; i < end; i++)
    dst[i] = (uint8_t)(zk_f32_bits(src[i]) >> 24);
}

typedef struct loop_job {
  void (*loop)(arrays *, size_t, size_t);
  arrays *a;
  size_t n;
} loop_job;

static void loop_task(void *ctx, int task, int n_tasks) {
  loop_job *job = ctx;
  size_t begin, end;
  zk_split(job->n, task, n_tasks, &begin, &end);
  job->loop(job->a, begin, end);
}

/* ---- timing ------------------------------------------------------------ */

typedef enum bench_op {
  OP_ADAMW,
  OP_STREAM,
  OP_TRIAD,
  OP_CAST_BF16,
  OP_STREAM_F32_U16,
  OP_SUMSQ,
  OP_STREAM_READ,
  OP_QUANT8,
  OP_STREAM_F32_U8
} bench_op;

static void run_loop(zk_pool *pool, void (*loop)(arrays *, size_t, size_t), arrays *a) {
  loop_job job = {loop, a, a->n};
  zk_pool_run(pool, zk_pool_size(pool), loop_task, &job);
}

typedef struct bench_ctx {
  zk_pool *pool;
  arrays *a;
  int64_t step;
  void *qbuf;
  size_t qbytes;
} bench_ctx;

static void run_op(bench_ctx *c, bench_op op) {
  arrays *a = c->a;
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
    if (zk_adam_step(c->pool, &hp, a->p, a->m, a->v, a->g, ZK_F32, a->w, ZK_BF16, a->n) != 0)
      abort();
    break;
  }
  case OP_STREAM:
    run_loop(c->pool, stream_same_arrays, a);
    break;
  case OP_TRIAD:
    run_loop(c->pool, triad, a);
    break;
  case OP_STREAM_F32_U16:
    run_loop(c->pool, stream_f32_to_u16, a);
    break;
  case OP_STREAM_READ:
    run_loop(c->pool, stream_read_f32, a);
    break;
  case OP_STREAM_F32_U8:
    run_loop(c->pool, stream_f32_to_u8, a);
    break;
  case OP_CAST_BF16:
    if (zk_cast(c->pool, a->w, ZK_BF16, a->p, ZK_F32, a->n) != 0)
      abort();
    break;
  case OP_SUMSQ: {
    double sum;
    if (zk_sumsq(c->pool, a->g, ZK_F32, a->n, &sum) != 0)
      abort();
    break;
  }
  case OP_QUANT8: {
    zk_qformat fmt = {8, ZK_QSYM, 2048};
    if (zk_quantize(c->pool, &fmt, a->g, a->n, c->qbuf, c->qbytes, NULL) != 0)
      abort();
    break;
  }
  }
}

/* Times two operations in alternation (A, B, A, B, ...) and returns the
 * median of each, so that both see the same background noise. */
static void median_pair(bench_ctx *c, bench_op op_a, bench_op op_b, int reps, double *t_a,
                        double *t_b) {
  double ta[128], tb[128];
  if (reps > 128)
    reps = 128;
  run_op(c, op_a); /* warm-up */
  run_op(c, op_b);
  for (int r = 0; r < reps; r++) {
    double t0 = bench_now_s();
    run_op(c, op_a);
    double t1 = bench_now_s();
    run_op(c, op_b);
    ta[r] = t1 - t0;
    tb[r] = bench_now_s() - t1;
  }
  *t_a = bench_median(ta, reps);
  *t_b = bench_median(tb, reps);
}

static void print_ratio(const char *bench, int threads, const char *metric, double value,
                        const char *baseline, double baseline_value, double target, size_t numel) {
  printf("{\"bench\":\"%s\",\"threads\":%d,\"numel\":%zu,\"metric\":\"%s\",\"value\":%.2f,"
         "\"baseline\":\"%s\",\"baseline_value\":%.2f,\"ratio\":%.3f",
         bench, threads, numel, metric, value, baseline, baseline_value, value / baseline_value);
  if (target > 0)
    printf(",\"target\":%.2f", target);
  printf("}\n");
  fflush(stdout);
}

int main(int argc, char **argv) {
  size_t state_mib = 256;
  int reps = 21;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--state-mib") == 0 && i + 1 < argc)
      state_mib = strtoull(argv[++i], NULL, 10);
    else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
      reps = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [--state-mib N] [--reps N]\n", argv[0]);
      return 2;
    }
  }
  if (state_mib == 0 || reps < 1) {
    fprintf(stderr, "bench_kernels: --state-mib and --reps must be positive\n");
    return 2;
  }
  /* "State" is what a rank keeps per parameter: fp32 master, m and v. */
  arrays a = {.n = state_mib * 1024 * 1024 / 12};
  a.p = alloc_pages(a.n * 4);
  a.m = alloc_pages(a.n * 4);
  a.v = alloc_pages(a.n * 4);
  a.g = alloc_pages(a.n * 4);
  a.w = alloc_pages(a.n * 2);
  for (size_t i = 0; i < a.n; i++) {
    a.p[i] = (float)(i % 1000) * 1e-3f;
    a.g[i] = (float)(i % 77) * 1e-4f - 3e-3f;
  }
  zk_qformat qfmt = {8, ZK_QSYM, 2048};
  bench_ctx ctx = {.a = &a, .qbytes = zk_quant_bytes(&qfmt, a.n)};
  ctx.qbuf = alloc_pages(ctx.qbytes);
  a.q = (uint8_t *)ctx.qbuf + ctx.qbytes - a.n;

  const double bytes_per_param = 30.0;
  for (int threads = 1; threads <= 2; threads++) {
    zk_pool *pool = NULL;
    if (zk_pool_create(threads, &pool) != 0)
      return 1;
    ctx.pool = pool;
    double t_stream, t_adamw, t_triad, t_unused;
    median_pair(&ctx, OP_STREAM, OP_ADAMW, reps, &t_stream, &t_adamw);
    median_pair(&ctx, OP_TRIAD, OP_TRIAD, 3, &t_triad, &t_unused);
    double gbs = bytes_per_param * (double)a.n / t_adamw / 1e9;
    double stream_gbs = bytes_per_param * (double)a.n / t_stream / 1e9;
    double triad_gbs = 12.0 * (double)a.n / t_triad / 1e9;
    print_ratio("adamw_cpu", threads, "GB/s", gbs, "stream_same_arrays", stream_gbs,
                threads == 2 ? 0.85 : 0.0, a.n);
    print_ratio("adamw_cpu", threads, "GB/s", gbs, "stream_triad", triad_gbs, 0.0, a.n);
    printf("{\"bench\":\"adamw_cpu\",\"threads\":%d,\"metric\":\"Mparams/s\",\"value\":%.1f}\n",
           threads, (double)a.n / t_adamw / 1e6);

    /* The other kernels, each against a stream with its own reads and
     * writes: informative, no target. */
    double t_cast, t_cast_base, t_sumsq, t_sumsq_base, t_quant, t_quant_base;
    median_pair(&ctx, OP_CAST_BF16, OP_STREAM_F32_U16, reps, &t_cast, &t_cast_base);
    median_pair(&ctx, OP_SUMSQ, OP_STREAM_READ, reps, &t_sumsq, &t_sumsq_base);
    median_pair(&ctx, OP_QUANT8, OP_STREAM_F32_U8, reps, &t_quant, &t_quant_base);
    double n = (double)a.n;
    print_ratio("cast_f32_bf16_cpu", threads, "GB/s", 6.0 * n / t_cast / 1e9, "stream_f32_to_u16",
                6.0 * n / t_cast_base / 1e9, 0.0, a.n);
    print_ratio("sumsq_f32_cpu", threads, "GB/s", 4.0 * n / t_sumsq / 1e9, "stream_read_f32",
                4.0 * n / t_sumsq_base / 1e9, 0.0, a.n);
    print_ratio("quantize_int8_cpu", threads, "GB/s", 5.0 * n / t_quant / 1e9, "stream_f32_to_u8",
                5.0 * n / t_quant_base / 1e9, 0.0, a.n);
    zk_pool_destroy(pool);
  }
  free(a.p);
  free(a.m);
  free(a.v);
  free(a.g);
  free(a.w);
  free(ctx.qbuf);
  return 0;
}
