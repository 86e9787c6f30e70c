/* onebit.c - CPU driver of one-bit compression with error feedback (layout
 * and rounding in zk.h).
 *
 * Blocks are independent (the error of an element is its own), so the array
 * is split over the pool by whole blocks; a block is a multiple of 8
 * elements and starts on a byte of the sign bits, so no two threads share a
 * byte.
 */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "internal.h"

static int block_ok(size_t block) {
  return block >= 8 && block <= ZK_QBLOCK_MAX && block % 8 == 0;
}

static size_t onebit_blocks(size_t block, size_t numel) {
  return numel / block + (numel % block != 0);
}

size_t zk_onebit_bytes(size_t block, size_t numel) {
  if (!block_ok(block) || numel > SIZE_MAX / 16)
    return 0;
  return onebit_blocks(block, numel) * sizeof(float) + (numel + 7) / 8;
}

typedef struct onebit_job {
  size_t block, numel, n_blocks;
  const float *x;
  float *error; /* encode */
  float *y;     /* decode */
  uint8_t *scales, *signs;
} onebit_job;

/* The mean of |x + error| over a block, summed in double in element
 * order; NaN when an element is not finite. */
static float block_scale(const float *restrict x, const float *restrict error, size_t n) {
  double sum = 0.0;
  int finite = 1;
  for (size_t i = 0; i < n; i++) {
    float y = x[i] + error[i];
    finite &= isfinite(y) != 0;
    sum += fabs((double)y);
  }
  return finite ? (float)(sum / (double)n) : NAN;
}

static void encode_block(const onebit_job *job, size_t b) {
  const size_t begin = b * job->block;
  const size_t n = job->numel - begin < job->block ? job->numel - begin : job->block;
  const float *x = job->x + begin;
  float *error = job->error + begin;
  const float scale = block_scale(x, error, n);
  memcpy(job->scales + b * sizeof(float), &scale, sizeof scale);
  uint8_t *signs = job->signs + begin / 8;
  memset(signs, 0, (n + 7) / 8);
  const int finite = !isnan(scale);
  for (size_t i = 0; i < n; i++) {
    float y = x[i] + error[i];
    int negative = y < 0.0f;
    signs[i / 8] |= (uint8_t)(negative << (i % 8));
    if (finite)
      error[i] = y - (negative ? -scale : scale);
  }
}

static void encode_task(void *ctx, int task, int n_tasks) {
  onebit_job *job = ctx;
  size_t first = job->n_blocks * (size_t)task / (size_t)n_tasks;
  size_t last = job->n_blocks * (size_t)(task + 1) / (size_t)n_tasks;
  for (size_t b = first; b < last; b++)
    encode_block(job, b);
}

static int onebit_tasks(const zk_pool *pool, size_t numel, size_t n_blocks) {
  int n_tasks = zk_task_count(pool, numel);
  return (size_t)n_tasks > n_blocks ? (int)n_blocks : n_tasks;
}

static int size_ok(size_t block, size_t numel, size_t bytes) {
  size_t need = zk_onebit_bytes(block, numel);
  return block_ok(block) && bytes == need && (need > 0 || numel == 0);
}

int zk_onebit_encode(zk_pool *pool, size_t block, const float *x, float *error, size_t numel,
                     void *out, size_t out_bytes) {
  if (!size_ok(block, numel, out_bytes) ||
      (numel > 0 && (x == NULL || error == NULL || out == NULL)))
    return -EINVAL;
  if (numel == 0)
    return 0;
  onebit_job job = {.block = block,
                    .numel = numel,
                    .n_blocks = onebit_blocks(block, numel),
                    .x = x,
                    .error = error};
  job.scales = out;
  job.signs = job.scales + job.n_blocks * sizeof(float);
  zk_pool_run(pool, onebit_tasks(pool, numel, job.n_blocks), encode_task, &job);
  return 0;
}

static void decode_task(void *ctx, int task, int n_tasks) {
  onebit_job *job = ctx;
  size_t first = job->n_blocks * (size_t)task / (size_t)n_tasks;
  size_t last = job->n_blocks * (size_t)(task + 1) / (size_t)n_tasks;
  for (size_t b = first; b < last; b++) {
    size_t begin = b * job->block;
    size_t n = job->numel - begin < job->block ? job->numel - begin : job->block;
    float scale;
    memcpy(&scale, job->scales + b * sizeof(float), sizeof scale);
    const uint8_t *signs = job->signs + begin / 8;
    for (size_t i = 0; i < n; i++)
      job->y[begin + i] = (signs[i / 8] >> (i % 8)) & 1 ? -scale : scale;
  }
}

int zk_onebit_decode(zk_pool *pool, size_t block, const void *in, size_t in_bytes, float *y,
                     size_t numel) {
  if (!size_ok(block, numel, in_bytes) || (numel > 0 && (in == NULL || y == NULL)))
    return -EINVAL;
  if (numel == 0)
    return 0;
  onebit_job job = {
      .block = block, .numel = numel, .n_blocks = onebit_blocks(block, numel), .y = y};
  job.scales = (uint8_t *)in; /* only read */
  job.signs = job.scales + job.n_blocks * sizeof(float);
  zk_pool_run(pool, onebit_tasks(pool, numel, job.n_blocks), decode_task, &job);
  return 0;
}
