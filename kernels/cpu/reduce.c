/* reduce.c - CPU drivers of gradient accumulation, loss-scale removal and
 * the sum of squares behind the global gradient norm. */
#include <errno.h>
#include <stdlib.h>

#include "internal.h"

/* An element is non-finite when its exponent bits are all ones; OR-ing that
 * test into an int keeps the loops free of early exits, so they vectorise. */
#define NONFINITE(x) ((zk_f32_bits(x) & 0x7f800000u) == 0x7f800000u)

/* ---- accumulate and scale ---------------------------------------------- */

typedef int (*acc_loop_fn)(float *restrict acc, const void *restrict src, size_t begin, size_t end);

#define ACC_LOOP(G)                                                                                \
  ZK_VECTOR_LOOP static int acc_loop_##G(float *restrict acc, const void *restrict src,            \
                                         size_t begin, size_t end) {                               \
    int bad = 0;                                                                                   \
    for (size_t i = begin; i < end; i++) {                                                         \
      float g = zk_load_f32(src, ZK_##G, i);                                                       \
      float sum = acc[i] + g;                                                                      \
      bad |= NONFINITE(g);                                                                         \
      bad |= NONFINITE(sum);                                                                       \
      acc[i] = sum;                                                                                \
    }                                                                                              \
    return bad;                                                                                    \
  }
ACC_LOOP(F32)
ACC_LOOP(BF16)
ACC_LOOP(F16)
static const acc_loop_fn acc_loops[3] = {acc_loop_F32, acc_loop_BF16, acc_loop_F16};

ZK_VECTOR_LOOP static int scale_loop(float *restrict x, float factor, size_t begin, size_t end) {
  int bad = 0;
  for (size_t i = begin; i < end; i++) {
    float y = x[i] * factor;
    bad |= NONFINITE(x[i]);
    bad |= NONFINITE(y);
    x[i] = y;
  }
  return bad;
}

typedef struct elementwise_job {
  acc_loop_fn acc_loop; /* NULL for scale */
  float *dst;
  const void *src;
  float factor;
  size_t numel;
  int nonfinite[ZK_POOL_MAX_THREADS]; /* one flag per task, OR-ed after the join */
} elementwise_job;

static void elementwise_task(void *ctx, int task, int n_tasks) {
  elementwise_job *job = ctx;
  size_t begin, end;
  zk_split(job->numel, task, n_tasks, &begin, &end);
  if (begin >= end)
    return;
  job->nonfinite[task] = job->acc_loop != NULL ? job->acc_loop(job->dst, job->src, begin, end)
                                               : scale_loop(job->dst, job->factor, begin, end);
}

static void elementwise_run(zk_pool *pool, elementwise_job *job, int *nonfinite_out) {
  int n_tasks = zk_task_count(pool, job->numel);
  for (int t = 0; t < n_tasks; t++)
    job->nonfinite[t] = 0;
  zk_pool_run(pool, n_tasks, elementwise_task, job);
  int bad = 0;
  for (int t = 0; t < n_tasks; t++)
    bad |= job->nonfinite[t];
  if (nonfinite_out != NULL)
    *nonfinite_out = bad;
}

int zk_accumulate(zk_pool *pool, float *acc, const void *src, zk_dtype src_dtype, size_t numel,
                  int *nonfinite_out) {
  if (!zk_is_float_dtype(src_dtype) || (numel > 0 && (acc == NULL || src == NULL)))
    return -EINVAL;
  elementwise_job job = {.acc_loop = acc_loops[src_dtype], .dst = acc, .src = src, .numel = numel};
  elementwise_run(pool, &job, nonfinite_out);
  return 0;
}

int zk_scale(zk_pool *pool, float *x, float factor, size_t numel, int *nonfinite_out) {
  if (numel > 0 && x == NULL)
    return -EINVAL;
  elementwise_job job = {.dst = x, .factor = factor, .numel = numel};
  elementwise_run(pool, &job, nonfinite_out);
  return 0;
}

/* ---- sum of squares ---------------------------------------------------- */

/* The array is cut into fixed superblocks; each superblock is summed by
 * pairwise recursion down to leaves of SUMSQ_LEAF elements, whose squares
 * go into eight double accumulators. The superblock sums are stored by index
 * and summed pairwise after the join, so the result is the same for any
 * number of threads. Squares of fp32 values are exact in double; the
 * relative error is bounded by about (log2(n) + 64) * 2^-53. */
#define SUMSQ_LEAF       ((size_t)512)
#define SUMSQ_SUPERBLOCK ((size_t)1 << 16)

#define SUMSQ_LEAF_FN(G)                                                                           \
  ZK_VECTOR_LOOP static double sumsq_leaf_##G(const void *restrict x, size_t begin, size_t n) {    \
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                      \
    size_t i = 0;                                                                                  \
    for (; i + 8 <= n; i += 8)                                                                     \
      for (size_t j = 0; j < 8; j++) {                                                             \
        double v = zk_load_f32(x, ZK_##G, begin + i + j);                                          \
        acc[j] += v * v;                                                                           \
      }                                                                                            \
    for (; i < n; i++) {                                                                           \
      double v = zk_load_f32(x, ZK_##G, begin + i);                                                \
      acc[i % 8] += v * v;                                                                         \
    }                                                                                              \
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));      \
  }
SUMSQ_LEAF_FN(F32)
SUMSQ_LEAF_FN(BF16)
SUMSQ_LEAF_FN(F16)

typedef double (*sumsq_leaf_fn)(const void *restrict x, size_t begin, size_t n);
static const sumsq_leaf_fn sumsq_leaves[3] = {sumsq_leaf_F32, sumsq_leaf_BF16, sumsq_leaf_F16};

static double sumsq_pairwise(sumsq_leaf_fn leaf, const void *x, size_t begin, size_t n) {
  if (n <= SUMSQ_LEAF)
    return leaf(x, begin, n);
  /* Split on a leaf boundary so that leaves stay whole and aligned. */
  size_t half = (n / 2 + SUMSQ_LEAF - 1) / SUMSQ_LEAF * SUMSQ_LEAF;
  return sumsq_pairwise(leaf, x, begin, half) + sumsq_pairwise(leaf, x, begin + half, n - half);
}

static double sum_pairwise(const double *values, size_t n) {
  if (n == 0)
    return 0.0;
  if (n == 1)
    return values[0];
  size_t half = n / 2;
  return sum_pairwise(values, half) + sum_pairwise(values + half, n - half);
}

typedef struct sumsq_job {
  sumsq_leaf_fn leaf;
  const void *x;
  size_t numel;
  size_t n_super;
  double *super_sums;
} sumsq_job;

static void sumsq_task(void *ctx, int task, int n_tasks) {
  sumsq_job *job = ctx;
  size_t first = job->n_super * (size_t)task / (size_t)n_tasks;
  size_t last = job->n_super * (size_t)(task + 1) / (size_t)n_tasks;
  for (size_t s = first; s < last; s++) {
    size_t begin = s * SUMSQ_SUPERBLOCK;
    size_t n = job->numel - begin < SUMSQ_SUPERBLOCK ? job->numel - begin : SUMSQ_SUPERBLOCK;
    job->super_sums[s] = sumsq_pairwise(job->leaf, job->x, begin, n);
  }
}

int zk_sumsq(zk_pool *pool, const void *x, zk_dtype dtype, size_t numel, double *sum_out) {
  if (sum_out == NULL || !zk_is_float_dtype(dtype) || (numel > 0 && x == NULL))
    return -EINVAL;
  sumsq_job job = {.leaf = sumsq_leaves[dtype],
                   .x = x,
                   .numel = numel,
                   .n_super = (numel + SUMSQ_SUPERBLOCK - 1) / SUMSQ_SUPERBLOCK};
  if (job.n_super <= 1) {
    *sum_out = numel == 0 ? 0.0 : sumsq_pairwise(job.leaf, x, 0, numel);
    return 0;
  }
  job.super_sums = malloc(job.n_super * sizeof(double));
  if (job.super_sums == NULL)
    return -ENOMEM;
  int n_tasks = zk_pool_size(pool);
  if ((size_t)n_tasks > job.n_super)
    n_tasks = (int)job.n_super;
  zk_pool_run(pool, n_tasks, sumsq_task, &job);
  *sum_out = sum_pairwise(job.super_sums, job.n_super);
  free(job.super_sums);
  return 0;
}
