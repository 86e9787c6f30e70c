/* zk.h - the zerod kernel library: the math the node daemon runs on its shards.
 *
 * Everything here works on flat, contiguous arrays of one dtype. The CPU
 * drivers declared in this header vectorise the element-wise math from the
 * math_*.h headers and split large arrays across the threads of a zk_pool.
 * The CUDA drivers for the same math live in a separate shared module
 * (kernels/cuda/zk_cuda.h) that is loaded only where a GPU is present.
 *
 * Conventions (as in the rest of zerod):
 * - every call returns 0 or a negative errno value (-EINVAL for bad
 *   arguments); results go through out-parameters;
 * - the caller owns every buffer; no call keeps a pointer after it returns;
 * - a NULL pool runs the work on the calling thread;
 * - numel may be 0, in which case nothing is read or written.
 */
#ifndef ZK_H
#define ZK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of shards, gradients and working copies. */
typedef enum zk_dtype {
  ZK_F32 = 0,
  ZK_BF16 = 1,
  ZK_F16 = 2,
  ZK_DTYPE_NONE = 3 /* "no array", e.g. no working copy to write */
} zk_dtype;

/* Size of one element in bytes, or 0 for ZK_DTYPE_NONE / unknown values. */
size_t zk_dtype_size(zk_dtype dtype);
const char *zk_dtype_name(zk_dtype dtype);

/* ------------------------------------------------------------------------ */
/* Thread pool                                                              */
/* ------------------------------------------------------------------------ */

/* A fixed set of worker threads that run one parallel loop at a time. The
 * calling thread takes part in the loop, so a pool of n threads starts n - 1
 * workers. One pool must not be used from two threads at once; the daemon
 * gives each executor its own pool. */
typedef struct zk_pool zk_pool;

/* Most threads a pool may have; per-task result arrays are sized by it. */
#define ZK_POOL_MAX_THREADS 256

int zk_pool_create(int n_threads, zk_pool **pool_out);
/* Joins the workers and frees the pool. Accepts NULL. */
void zk_pool_destroy(zk_pool *pool);
/* Number of threads including the caller; 1 for a NULL pool. */
int zk_pool_size(const zk_pool *pool);

/* Runs fn(ctx, task, n_tasks) for task = 0 .. n_tasks - 1, spread over the
 * pool's threads, and returns when all have finished. */
typedef void (*zk_task_fn)(void *ctx, int task, int n_tasks);
void zk_pool_run(zk_pool *pool, int n_tasks, zk_task_fn fn, void *ctx);

/* ------------------------------------------------------------------------ */
/* Optimizers                                                               */
/* ------------------------------------------------------------------------ */

/* Hyper-parameters are doubles, as in torch.optim, where they are Python
 * floats: the derived per-step coefficients are computed in double and
 * rounded to float once, exactly as torch does. */

/* Adam and AdamW (torch.optim.Adam / torch.optim.AdamW, amsgrad=False,
 * maximize=False). */
typedef struct zk_adam_hparams {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int decoupled_weight_decay; /* 1: AdamW (decay the weights), 0: Adam (L2 in the gradient) */
  int64_t step;               /* this step's number, counted from 1 */
  double grad_scale; /* gradients are multiplied by this first (1 / loss scale); 1 = none */
  /* 1-bit Adam: the step after which the second moment stays as it was
   * (beta2 1, its bias correction that step's) for steps past it; 0: never. */
  int64_t v_frozen_at;
} zk_adam_hparams;

/* SGD (torch.optim.SGD, maximize=False). */
typedef struct zk_sgd_hparams {
  double lr;
  double momentum;
  double dampening;
  double weight_decay;
  int nesterov;
  int64_t step;      /* this step's number, counted from 1; step 1 seeds the momentum buffer */
  double grad_scale; /* gradients are multiplied by this first; 1 = none */
} zk_sgd_hparams;

/* One optimizer step on a shard.
 * param, exp_avg, exp_avg_sq: fp32 master weights and moments, updated in place.
 * grad: numel elements of grad_dtype (F32, BF16 or F16), read only.
 * working: if working_dtype is not ZK_DTYPE_NONE, numel elements that receive
 *   the updated weights cast to working_dtype (F32, BF16 or F16).
 * Returns -EINVAL for bad hyper-parameters (step < 1, negative lr, ...). */
int zk_adam_step(zk_pool *pool, const zk_adam_hparams *hp, float *param, float *exp_avg,
                 float *exp_avg_sq, const void *grad, zk_dtype grad_dtype, void *working,
                 zk_dtype working_dtype, size_t numel);

/* momentum_buf is only touched when hp->momentum != 0. */
int zk_sgd_step(zk_pool *pool, const zk_sgd_hparams *hp, float *param, float *momentum_buf,
                const void *grad, zk_dtype grad_dtype, void *working, zk_dtype working_dtype,
                size_t numel);

/* ------------------------------------------------------------------------ */
/* Casts, accumulation, loss scaling, norms                                 */
/* ------------------------------------------------------------------------ */

/* dst[i] = (dst_dtype) src[i]. Supported: F32 -> BF16/F16/F32 and
 * BF16/F16 -> F32. Rounding is to nearest, ties to even; values too large for
 * the target become infinities of the same sign; NaN stays NaN (sign and the
 * top payload bits kept, made quiet). */
int zk_cast(zk_pool *pool, void *dst, zk_dtype dst_dtype, const void *src, zk_dtype src_dtype,
            size_t numel);

/* acc[i] += (float) src[i] (gradient accumulation). *nonfinite_out, when not
 * NULL, is set to 1 if any element of src or of the result is Inf or NaN,
 * else 0. */
int zk_accumulate(zk_pool *pool, float *acc, const void *src, zk_dtype src_dtype, size_t numel,
                  int *nonfinite_out);

/* x[i] *= factor (loss-scale removal). *nonfinite_out as for zk_accumulate,
 * over the input and the result. */
int zk_scale(zk_pool *pool, float *x, float factor, size_t numel, int *nonfinite_out);

/* *sum_out = sum of x[i]^2 in double precision, with pairwise summation over
 * fixed blocks so that the result does not depend on the number of threads
 * and its relative error stays near 1e-15 even for 10^9 elements. */
int zk_sumsq(zk_pool *pool, const void *x, zk_dtype dtype, size_t numel, double *sum_out);

/* ------------------------------------------------------------------------ */
/* Block-wise quantization (ZeRO++ compressed collectives)                   */
/* ------------------------------------------------------------------------ */

typedef enum zk_qmode {
  ZK_QSYM = 0, /* q = round(x / scale), scale = max|x| / qmax */
  ZK_QASYM = 1 /* q = round((x - min) / scale), scale = (max - min) / (2^bits - 1) */
} zk_qmode;

typedef struct zk_qformat {
  int bits;           /* 8, or 4 (two values per byte, element 2i in the low nibble) */
  zk_qmode mode;      /* symmetric or zero-point */
  size_t block_numel; /* elements per block, each with its own fp32 scale; even for 4 bits */
} zk_qformat;

/* Largest block accepted (and the smallest is 1, or 2 for 4 bits). */
#define ZK_QBLOCK_MAX ((size_t)1 << 20)

/* A quantized array is one contiguous buffer:
 *   float scales[n_blocks];
 *   float mins[n_blocks];              (ZK_QASYM only)
 *   uint8_t data[(numel * bits + 7) / 8];
 * with n_blocks = ceil(numel / block_numel). Symmetric data is two's
 * complement (int8 in [-127, 127], int4 in [-7, 7]); zero-point data is
 * unsigned ([0, 255] or [0, 15]). The stored minimum is the block's least
 * value in the order of fp32 bit patterns (-0 before +0). A block that holds Inf or NaN gets a NaN
 * scale, and dequantizes to NaN, so overflow survives compression.
 *
 * Error bound, per element of a block whose values lie in [lo, hi]
 * (M = max(|lo|, |hi|)):
 *   symmetric:   |x - x'| <= 0.5001 * scale,                 scale = M / qmax
 *   zero-point:  |x - x'| <= 0.5001 * scale + 2^-22 * M,      scale = (hi - lo) / (2^bits - 1)
 * where qmax = 127 for 8 bits and 7 for 4 bits. The 0.0001 and 2^-22 terms
 * cover float rounding of the scale, the product and the offset;
 * docs/kernels.md derives them. */

/* Bytes of the quantized buffer for numel elements, or 0 if fmt is invalid. */
size_t zk_quant_bytes(const zk_qformat *fmt, size_t numel);
int zk_qformat_check(const zk_qformat *fmt);

/* Quantizes x into out (out_bytes must equal zk_quant_bytes). *nonfinite_out,
 * when not NULL, is set to 1 if any block held Inf or NaN. */
int zk_quantize(zk_pool *pool, const zk_qformat *fmt, const float *x, size_t numel, void *out,
                size_t out_bytes, int *nonfinite_out);

/* Dequantizes a buffer that may come from another process: the format and
 * the buffer size are checked (-EINVAL, nothing written, on a mismatch), and
 * any byte pattern decodes without reading outside the buffer. */
int zk_dequantize(zk_pool *pool, const zk_qformat *fmt, const void *in, size_t in_bytes, float *y,
                  size_t numel);

/* ------------------------------------------------------------------------ */
/* One-bit compression with error feedback (1-bit Adam's cross-node sums)    */
/* ------------------------------------------------------------------------ */

/* A one-bit array is one contiguous buffer:
 *   float scales[n_blocks];
 *   uint8_t signs[(numel + 7) / 8];   bit i % 8 of byte i / 8: element i < 0
 * with n_blocks = ceil(numel / block). block is a multiple of 8 (blocks start
 * on a byte boundary), 8 to ZK_QBLOCK_MAX. Element i decodes to -scale or
 * +scale of its block.
 *
 * Encoding adds the error left by the previous encoding first (error
 * feedback: what one round loses is sent in the next): y = x + error in
 * fp32; the block's scale is the mean of |y| (summed in double in element
 * order, divided by the block's length, rounded to fp32), the sign bit is
 * y < 0, and error becomes y - decoded(y). A block holding Inf or NaN gets a
 * NaN scale (it decodes to NaN, so overflow survives compression) and
 * leaves its error as it was. tests/python/onebit_ref.py is the reference. */

/* Bytes of the one-bit buffer for numel elements, or 0 for a bad block. */
size_t zk_onebit_bytes(size_t block, size_t numel);

/* Encodes x + error into out (out_bytes must equal zk_onebit_bytes) and
 * updates error (numel elements). x and error may not overlap out. */
int zk_onebit_encode(zk_pool *pool, size_t block, const float *x, float *error, size_t numel,
                     void *out, size_t out_bytes);

/* Decodes a buffer that may come from another process: sizes are checked
 * (-EINVAL, nothing written, on a mismatch). */
int zk_onebit_decode(zk_pool *pool, size_t block, const void *in, size_t in_bytes, float *y,
                     size_t numel);

/* ------------------------------------------------------------------------ */
/* Low-rank compression (PowerSGD's cross-node sums)                        */
/* ------------------------------------------------------------------------ */

/* Matrices are row-major fp32: M is rows x cols, P is rows x rank, Q is
 * cols x rank. Every sum below is accumulated in double in the order
 * stated, each term the product (double)a * (double)b of two floats (exact
 * in double), and rounded to fp32 once at the end. Each output element is
 * computed by one thread in that order, so the bits do not depend on the
 * number of threads. Every call returns -EINVAL for rank == 0, for sizes
 * whose products (rows * cols, rows * rank, cols * rank) overflow size_t
 * when counted in doubles, or for a NULL pointer to an array that has
 * elements (a pointer to no elements may be NULL); -ENOMEM when its
 * scratch (double accumulators) cannot be allocated.
 * tests/python/lowrank_ref.py is the reference, bit for bit, and holds the
 * cross-node round built on these. */

/* P = M Q: P[i][j] = (float) sum over k = 0..cols-1 ascending of
 * M[i][k] * Q[k][j]. */
int zk_lowrank_project(zk_pool *pool, const float *M, size_t rows, size_t cols, const float *Q,
                       size_t rank, float *P);

/* Q = M^T P: Q[k][j] = (float) sum over i = 0..rows-1 ascending of
 * M[i][k] * P[i][j]. */
int zk_lowrank_back(zk_pool *pool, const float *M, size_t rows, size_t cols, const float *P,
                    size_t rank, float *Q);

/* Gram-Schmidt on the columns of P (rows x rank), in place, column
 * j = 0..rank-1 in order:
 *   for k = 0..j-1 ascending:
 *     d = sum over i ascending of (double)P[i][k] * (double)P[i][j]    (double)
 *     P[i][j] = (float)((double)P[i][j] - d * (double)P[i][k])  for every i
 *   n = sqrt(sum over i ascending of (double)P[i][j] * (double)P[i][j]) (double)
 *   P[i][j] = n == 0 ? 0 : (float)((double)P[i][j] / n)        for every i
 * (d * P[i][k] is rounded to double before the subtraction: no FMA). NaN
 * and Inf propagate: a column holding them comes out NaN where they reach.
 * Columns past the span of the earlier ones (rank > rows) are normalized
 * rounding noise, or 0. Runs on the calling thread: P is small. */
int zk_lowrank_orthonormalize(zk_pool *pool, float *P, size_t rows, size_t rank);

/* How zk_lowrank_expand puts its product into out. */
typedef enum zk_lowrank_mode {
  ZK_LOWRANK_SET = 0,     /* out = a */
  ZK_LOWRANK_ADD = 1,     /* out = out + a */
  ZK_LOWRANK_SUBTRACT = 2 /* out = out - a */
} zk_lowrank_mode;

/* The first numel elements (row-major, numel <= rows * cols, else -EINVAL)
 * of P Q^T, each
 *   a[i][k] = (float) sum over j = 0..rank-1 ascending of P[i][j] * Q[k][j]
 * put into out by mode (fp32 add or subtract of the rounded a). out may not
 * overlap P or Q. */
int zk_lowrank_expand(zk_pool *pool, const float *P, const float *Q, size_t rows, size_t cols,
                      size_t rank, size_t numel, float *out, zk_lowrank_mode mode);

#ifdef __cplusplus
}
#endif

#endif /* ZK_H */
