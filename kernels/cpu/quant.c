/* quant.c - CPU driver of block-wise int8/int4 quantization (math in
 * math_quant.h, layout in zk.h).
 *
 * Blocks are independent, so the array is split over the pool by whole
 * blocks; 4-bit blocks hold an even number of elements and therefore start
 * on a byte boundary, so no two threads share a byte.
 */
#include <errno.h>
#include <string.h>

#include "../math_quant.h"
#include "internal.h"

int zk_qformat_check(const zk_qformat *fmt) {
  if (fmt == NULL || (fmt->bits != 8 && fmt->bits != 4) ||
      (fmt->mode != ZK_QSYM && fmt->mode != ZK_QASYM) || fmt->block_numel < 1 ||
      fmt->block_numel > ZK_QBLOCK_MAX || (fmt->bits == 4 && fmt->block_numel % 2 != 0))
    return -EINVAL;
  return 0;
}

static size_t quant_blocks(const zk_qformat *fmt, size_t numel) {
  return numel / fmt->block_numel + (numel % fmt->block_numel != 0);
}

static size_t quant_meta_bytes(const zk_qformat *fmt, size_t n_blocks) {
  return n_blocks * sizeof(float) * (fmt->mode == ZK_QASYM ? 2 : 1);
}

size_t zk_quant_bytes(const zk_qformat *fmt, size_t numel) {
  if (zk_qformat_check(fmt) != 0 || numel > SIZE_MAX / 16)
    return 0;
  return quant_meta_bytes(fmt, quant_blocks(fmt, numel)) + (numel * (size_t)fmt->bits + 7) / 8;
}

/* ---- block statistics -------------------------------------------------- */

typedef struct block_stats {
  float lo, hi;
  int nonfinite;
} block_stats;

ZK_VECTOR_LOOP static block_stats block_scan(const float *restrict x, size_t n) {
  int32_t lo = INT32_MAX, hi = INT32_MIN;
  int bad = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t bits = zk_f32_bits(x[i]);
    int32_t key = zk_quant_order_key(bits);
    lo = key < lo ? key : lo;
    hi = key > hi ? key : hi;
    bad |= (bits & 0x7f800000u) == 0x7f800000u;
  }
  block_stats stats = {zk_quant_key_to_f32(lo), zk_quant_key_to_f32(hi), bad};
  return stats;
}

/* ---- quantize ---------------------------------------------------------- */

ZK_VECTOR_LOOP static void quantize8(const float *restrict x, size_t n, uint8_t *restrict q,
                                     float lo, float inv_scale, int qmax, int zero_point) {
  if (zero_point)
    for (size_t i = 0; i < n; i++)
      q[i] = (uint8_t)zk_quantize_asym(x[i], lo, inv_scale, qmax);
  else
    for (size_t i = 0; i < n; i++)
      q[i] = (uint8_t)(int8_t)zk_quantize_sym(x[i], inv_scale, qmax);
}

static inline int quantize_one(float x, float lo, float inv_scale, int qmax, int zero_point) {
  return zero_point ? zk_quantize_asym(x, lo, inv_scale, qmax)
                    : zk_quantize_sym(x, inv_scale, qmax);
}

ZK_VECTOR_LOOP static void quantize4(const float *restrict x, size_t n, uint8_t *restrict q,
                                     float lo, float inv_scale, int qmax, int zero_point) {
  size_t pairs = n / 2;
  for (size_t i = 0; i < pairs; i++)
    q[i] = zk_pack_nibbles(quantize_one(x[2 * i], lo, inv_scale, qmax, zero_point),
                           quantize_one(x[2 * i + 1], lo, inv_scale, qmax, zero_point));
  if (n % 2)
    q[pairs] = zk_pack_nibbles(quantize_one(x[n - 1], lo, inv_scale, qmax, zero_point), 0);
}

typedef struct quant_job {
  zk_qformat fmt;
  const float *x;
  float *y;
  size_t numel, n_blocks;
  uint8_t *meta; /* scales, then mins (zero-point); unaligned access through memcpy */
  uint8_t *data;
  int nonfinite[ZK_POOL_MAX_THREADS]; /* one flag per task */
} quant_job;

static void quantize_task(void *ctx, int task, int n_tasks) {
  quant_job *job = ctx;
  const size_t block = job->fmt.block_numel;
  const int zero_point = job->fmt.mode == ZK_QASYM;
  const int qmax = zk_quant_qmax(job->fmt.bits, zero_point);
  size_t first = job->n_blocks * (size_t)task / (size_t)n_tasks;
  size_t last = job->n_blocks * (size_t)(task + 1) / (size_t)n_tasks;
  int bad = 0;
  for (size_t b = first; b < last; b++) {
    size_t begin = b * block;
    size_t n = job->numel - begin < block ? job->numel - begin : block;
    block_stats st = block_scan(job->x + begin, n);
    float scale = zk_quant_scale(st.lo, st.hi, qmax, zero_point, st.nonfinite);
    float inv_scale = zk_quant_inv_scale(scale);
    memcpy(job->meta + b * sizeof(float), &scale, sizeof scale);
    if (zero_point)
      memcpy(job->meta + (job->n_blocks + b) * sizeof(float), &st.lo, sizeof st.lo);
    if (job->fmt.bits == 8)
      quantize8(job->x + begin, n, job->data + begin, st.lo, inv_scale, qmax, zero_point);
    else
      quantize4(job->x + begin, n, job->data + begin / 2, st.lo, inv_scale, qmax, zero_point);
    bad |= st.nonfinite;
  }
  job->nonfinite[task] = bad;
}

static int quant_tasks(const zk_pool *pool, size_t numel, size_t n_blocks) {
  int n_tasks = zk_task_count(pool, numel);
  return (size_t)n_tasks > n_blocks ? (int)n_blocks : n_tasks;
}

/* The buffer size a call must pass: valid format, and numel small enough
 * for the size to be computed (zk_quant_bytes returns 0 beyond that). */
static int quant_size_ok(const zk_qformat *fmt, size_t numel, size_t bytes) {
  size_t need = zk_quant_bytes(fmt, numel);
  return zk_qformat_check(fmt) == 0 && bytes == need && (need > 0 || numel == 0);
}

int zk_quantize(zk_pool *pool, const zk_qformat *fmt, const float *x, size_t numel, void *out,
                size_t out_bytes, int *nonfinite_out) {
  if (!quant_size_ok(fmt, numel, out_bytes) || (numel > 0 && (x == NULL || out == NULL)))
    return -EINVAL;
  if (nonfinite_out != NULL)
    *nonfinite_out = 0;
  if (numel == 0)
    return 0;
  quant_job job = {.fmt = *fmt, .x = x, .numel = numel, .n_blocks = quant_blocks(fmt, numel)};
  job.meta = out;
  job.data = job.meta + quant_meta_bytes(fmt, job.n_blocks);
  int n_tasks = quant_tasks(pool, numel, job.n_blocks);
  zk_pool_run(pool, n_tasks, quantize_task, &job);
  int bad = 0;
  for (int t = 0; t < n_tasks; t++)
    bad |= job.nonfinite[t];
  if (nonfinite_out != NULL)
    *nonfinite_out = bad;
  return 0;
}

/* ---- dequantize -------------------------------------------------------- */

ZK_VECTOR_LOOP static void dequantize8(const uint8_t *restrict q, size_t n, float *restrict y,
                                       float lo, float scale, int zero_point) {
  if (zero_point)
    for (size_t i = 0; i < n; i++)
      y[i] = zk_dequantize_asym(q[i], lo, scale);
  else
    for (size_t i = 0; i < n; i++)
      y[i] = zk_dequantize_sym((int8_t)q[i], scale);
}

ZK_VECTOR_LOOP static void dequantize4(const uint8_t *restrict q, size_t n, float *restrict y,
                                       float lo, float scale, int zero_point) {
  for (size_t i = 0; i < n; i++) {
    int code = zk_unpack_nibble(q[i / 2], (int)(i % 2), !zero_point);
    y[i] = zero_point ? zk_dequantize_asym(code, lo, scale) : zk_dequantize_sym(code, scale);
  }
}

static void dequantize_task(void *ctx, int task, int n_tasks) {
  quant_job *job = ctx;
  const size_t block = job->fmt.block_numel;
  const int zero_point = job->fmt.mode == ZK_QASYM;
  size_t first = job->n_blocks * (size_t)task / (size_t)n_tasks;
  size_t last = job->n_blocks * (size_t)(task + 1) / (size_t)n_tasks;
  for (size_t b = first; b < last; b++) {
    size_t begin = b * block;
    size_t n = job->numel - begin < block ? job->numel - begin : block;
    float scale, lo = 0.0f;
    memcpy(&scale, job->meta + b * sizeof(float), sizeof scale);
    if (zero_point)
      memcpy(&lo, job->meta + (job->n_blocks + b) * sizeof(float), sizeof lo);
    if (job->fmt.bits == 8)
      dequantize8(job->data + begin, n, job->y + begin, lo, scale, zero_point);
    else
      dequantize4(job->data + begin / 2, n, job->y + begin, lo, scale, zero_point);
  }
}

int zk_dequantize(zk_pool *pool, const zk_qformat *fmt, const void *in, size_t in_bytes, float *y,
                  size_t numel) {
  if (!quant_size_ok(fmt, numel, in_bytes) || (numel > 0 && (in == NULL || y == NULL)))
    return -EINVAL;
  if (numel == 0)
    return 0;
  quant_job job = {.fmt = *fmt, .y = y, .numel = numel, .n_blocks = quant_blocks(fmt, numel)};
  job.meta = (uint8_t *)in; /* only read */
  job.data = job.meta + quant_meta_bytes(fmt, job.n_blocks);
  zk_pool_run(pool, quant_tasks(pool, numel, job.n_blocks), dequantize_task, &job);
  return 0;
}
