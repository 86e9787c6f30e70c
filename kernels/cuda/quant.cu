/* quant.cu - CUDA drivers of block-wise int8/int4 quantization (math in
 * math_quant.h, byte layout in zk.h).
 *
 * One CUDA block handles one quantization block at a time (and strides over
 * the rest): its threads scan the block for its statistics, reduce them
 * through shared memory, and then quantize the block with the scale that
 * thread 0 derived. The bytes are those of the CPU driver (cpu/quant.c):
 * the same statistics, the same scale function, the same per-element
 * rounding, the same nibble packing.
 *
 * The module does not link the CPU library, so the format check and the
 * buffer size are computed here again, by the same rules as
 * zk_qformat_check and zk_quant_bytes.
 */
#include "../math_quant.h"
#include "internal.h"

/* ---- format and layout ------------------------------------------------- */

typedef struct quant_layout {
  size_t n_blocks;
  size_t meta_bytes; /* scales, then mins (zero-point) */
  size_t total_bytes;
} quant_layout;

static int quant_layout_init(const zk_qformat *fmt, size_t numel, quant_layout *layout) {
  if (fmt == NULL || (fmt->bits != 8 && fmt->bits != 4) ||
      (fmt->mode != ZK_QSYM && fmt->mode != ZK_QASYM) || fmt->block_numel < 1 ||
      fmt->block_numel > ZK_QBLOCK_MAX || (fmt->bits == 4 && fmt->block_numel % 2 != 0))
    return -EINVAL;
  /* zk_quant_bytes's limit: with it neither the metadata (at most 8 bytes
   * per element) nor numel * bits can overflow. */
  if (numel > SIZE_MAX / 16)
    return -EINVAL;
  layout->n_blocks = numel / fmt->block_numel + (numel % fmt->block_numel != 0);
  layout->meta_bytes = layout->n_blocks * sizeof(float) * (fmt->mode == ZK_QASYM ? 2 : 1);
  layout->total_bytes = layout->meta_bytes + (numel * (size_t)fmt->bits + 7) / 8;
  return 0;
}

/* Threads per CUDA block: a warp at least, one per element (or per byte of
 * 4-bit codes) for small blocks, ZKC_THREADS for large ones. */
static unsigned quant_threads(const zk_qformat *fmt) {
  size_t items = fmt->bits == 4 ? fmt->block_numel / 2 : fmt->block_numel;
  size_t threads = (items + 31) / 32 * 32;
  return threads < ZKC_THREADS ? (unsigned)threads : ZKC_THREADS;
}

/* The metadata is not necessarily 4-byte aligned (the caller may place the
 * buffer anywhere, as on the CPU, which uses memcpy), so it moves bytewise;
 * one value per block, so the cost does not show. */
__device__ __forceinline__ void store_f32_bytes(uint8_t *dst, float value) {
  uint32_t bits = zk_f32_bits(value);
#pragma unroll
  for (int k = 0; k < 4; k++)
    dst[k] = (uint8_t)(bits >> (8 * k));
}

__device__ __forceinline__ float load_f32_bytes(const uint8_t *src) {
  uint32_t bits = 0;
#pragma unroll
  for (int k = 0; k < 4; k++)
    bits |= (uint32_t)src[k] << (8 * k);
  return zk_bits_f32(bits);
}

/* ---- block statistics -------------------------------------------------- */

/* Minimum and maximum are reduced as zk_quant_order_key values (math_quant.h),
 * like the CPU driver, so both store the same minimum for every block. */
#define QUANT_MAX_WARPS (ZKC_THREADS / 32)

/* What thread 0 publishes to the block after reducing the statistics. */
typedef struct quant_shared {
  int32_t warp_lo[QUANT_MAX_WARPS];
  int32_t warp_hi[QUANT_MAX_WARPS];
  int warp_bad[QUANT_MAX_WARPS];
  float lo;
  float inv_scale;
} quant_shared;

/* ---- quantize ---------------------------------------------------------- */

template <int BITS, int ZERO_POINT>
__device__ __forceinline__ int quantize_one(float x, float lo, float inv_scale, int qmax) {
  return ZERO_POINT ? zk_quantize_asym(x, lo, inv_scale, qmax)
                    : zk_quantize_sym(x, inv_scale, qmax);
}

template <int BITS, int ZERO_POINT>
__global__ void __launch_bounds__(ZKC_THREADS)
    quantize_kernel(const float *__restrict__ x, size_t numel, size_t block_numel, size_t n_blocks,
                    uint8_t *__restrict__ meta, uint8_t *__restrict__ data, int *nonfinite) {
  __shared__ quant_shared shared;
  const int qmax = zk_quant_qmax(BITS, ZERO_POINT);
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x / 32u;
  const unsigned n_warps = blockDim.x / 32u;

  for (size_t b = blockIdx.x; b < n_blocks; b += gridDim.x) {
    size_t begin = b * block_numel;
    size_t n = numel - begin < block_numel ? numel - begin : block_numel;
    const float *block_x = x + begin;

    int32_t lo = INT32_MAX, hi = INT32_MIN;
    int bad = 0;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
      uint32_t bits = zk_f32_bits(block_x[i]);
      int32_t key = zk_quant_order_key(bits);
      lo = key < lo ? key : lo;
      hi = key > hi ? key : hi;
      bad |= (bits & 0x7f800000u) == 0x7f800000u;
    }
    /* Integer min/max/or are exact and commutative: any reduction order
     * gives the CPU's result. */
    lo = __reduce_min_sync(0xffffffffu, lo);
    hi = __reduce_max_sync(0xffffffffu, hi);
    bad = (int)__reduce_or_sync(0xffffffffu, (unsigned)bad);
    if (lane == 0) {
      shared.warp_lo[warp] = lo;
      shared.warp_hi[warp] = hi;
      shared.warp_bad[warp] = bad;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (unsigned w = 1; w < n_warps; w++) {
        lo = shared.warp_lo[w] < lo ? shared.warp_lo[w] : lo;
        hi = shared.warp_hi[w] > hi ? shared.warp_hi[w] : hi;
        bad |= shared.warp_bad[w];
      }
      float lo_f = zk_quant_key_to_f32(lo), hi_f = zk_quant_key_to_f32(hi);
      float scale = zk_quant_scale(lo_f, hi_f, qmax, ZERO_POINT, bad);
      store_f32_bytes(meta + b * sizeof(float), scale);
      if (ZERO_POINT)
        store_f32_bytes(meta + (n_blocks + b) * sizeof(float), lo_f);
      if (bad && nonfinite != NULL)
        atomicOr(nonfinite, 1);
      shared.lo = lo_f;
      shared.inv_scale = zk_quant_inv_scale(scale);
    }
    __syncthreads();

    const float block_lo = shared.lo, inv_scale = shared.inv_scale;
    if (BITS == 8) {
      uint8_t *block_data = data + begin;
      for (size_t i = threadIdx.x; i < n; i += blockDim.x)
        block_data[i] =
            (uint8_t)quantize_one<BITS, ZERO_POINT>(block_x[i], block_lo, inv_scale, qmax);
    } else {
      /* Blocks hold an even number of elements, so a block starts on a byte
       * boundary; only the last block of an odd numel ends in a half byte,
       * whose high nibble is 0. */
      uint8_t *block_data = data + begin / 2;
      size_t n_bytes = (n + 1) / 2;
      for (size_t i = threadIdx.x; i < n_bytes; i += blockDim.x) {
        int low = quantize_one<BITS, ZERO_POINT>(block_x[2 * i], block_lo, inv_scale, qmax);
        int high = 2 * i + 1 < n ? quantize_one<BITS, ZERO_POINT>(block_x[2 * i + 1], block_lo,
                                                                  inv_scale, qmax)
                                 : 0;
        block_data[i] = zk_pack_nibbles(low, high);
      }
    }
    /* The next block's reduction reuses shared. */
    __syncthreads();
  }
}

typedef void (*quantize_kernel_fn)(const float *, size_t, size_t, size_t, uint8_t *, uint8_t *,
                                   int *);

/* Indexed [bits == 4][mode]. */
static const quantize_kernel_fn quantize_kernels[2][2] = {
    {quantize_kernel<8, 0>, quantize_kernel<8, 1>}, {quantize_kernel<4, 0>, quantize_kernel<4, 1>}};

/* Blocks of the grid for n_blocks quantization blocks: one wave at most. */
template <typename K>
static int quant_grid(K kernel, size_t n_blocks, unsigned threads, unsigned *blocks_out) {
  size_t capped = n_blocks < ((size_t)1 << 31) ? n_blocks : ((size_t)1 << 31);
  return zkc_grid_blocks(kernel, capped * threads, threads, blocks_out);
}

int zkc_quantize(void *stream, const zk_qformat *fmt, const float *x, size_t numel, void *out,
                 size_t out_bytes, int *nonfinite_dev) {
  quant_layout layout;
  if (quant_layout_init(fmt, numel, &layout) != 0 || out_bytes != layout.total_bytes)
    return -EINVAL;
  if (numel == 0)
    return 0;
  if (x == NULL || out == NULL)
    return -EINVAL;
  quantize_kernel_fn kernel = quantize_kernels[fmt->bits == 4][fmt->mode == ZK_QASYM];
  unsigned threads = quant_threads(fmt), blocks;
  int rc = quant_grid(kernel, layout.n_blocks, threads, &blocks);
  if (rc != 0)
    return rc;
  uint8_t *meta = static_cast<uint8_t *>(out);
  kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, numel, fmt->block_numel, layout.n_blocks, meta, meta + layout.meta_bytes, nonfinite_dev);
  return zkc_launch_check("quantize_kernel");
}

/* ---- dequantize -------------------------------------------------------- */

/* Any byte pattern decodes: codes are read within the buffer whose size
 * the host checked, and NaN or infinite scales simply propagate. */
template <int BITS, int ZERO_POINT>
__global__ void __launch_bounds__(ZKC_THREADS)
    dequantize_kernel(const uint8_t *__restrict__ meta, const uint8_t *__restrict__ data,
                      size_t numel, size_t block_numel, size_t n_blocks, float *__restrict__ y) {
  for (size_t b = blockIdx.x; b < n_blocks; b += gridDim.x) {
    size_t begin = b * block_numel;
    size_t n = numel - begin < block_numel ? numel - begin : block_numel;
    /* Every thread reads the same four bytes: one broadcast from L1. */
    float scale = load_f32_bytes(meta + b * sizeof(float));
    float lo = ZERO_POINT ? load_f32_bytes(meta + (n_blocks + b) * sizeof(float)) : 0.0f;
    float *block_y = y + begin;
    if (BITS == 8) {
      const uint8_t *block_data = data + begin;
      for (size_t i = threadIdx.x; i < n; i += blockDim.x)
        block_y[i] = ZERO_POINT ? zk_dequantize_asym(block_data[i], lo, scale)
                                : zk_dequantize_sym((int8_t)block_data[i], scale);
    } else {
      const uint8_t *block_data = data + begin / 2;
      for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
        int code = zk_unpack_nibble(block_data[i / 2], (int)(i % 2), !ZERO_POINT);
        block_y[i] =
            ZERO_POINT ? zk_dequantize_asym(code, lo, scale) : zk_dequantize_sym(code, scale);
      }
    }
  }
}

typedef void (*dequantize_kernel_fn)(const uint8_t *, const uint8_t *, size_t, size_t, size_t,
                                     float *);

static const dequantize_kernel_fn dequantize_kernels[2][2] = {
    {dequantize_kernel<8, 0>, dequantize_kernel<8, 1>},
    {dequantize_kernel<4, 0>, dequantize_kernel<4, 1>}};

int zkc_dequantize(void *stream, const zk_qformat *fmt, const void *in, size_t in_bytes, float *y,
                   size_t numel) {
  quant_layout layout;
  if (quant_layout_init(fmt, numel, &layout) != 0 || in_bytes != layout.total_bytes)
    return -EINVAL;
  if (numel == 0)
    return 0;
  if (in == NULL || y == NULL)
    return -EINVAL;
  dequantize_kernel_fn kernel = dequantize_kernels[fmt->bits == 4][fmt->mode == ZK_QASYM];
  unsigned threads = quant_threads(fmt), blocks;
  int rc = quant_grid(kernel, layout.n_blocks, threads, &blocks);
  if (rc != 0)
    return rc;
  const uint8_t *meta = static_cast<const uint8_t *>(in);
  kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      meta, meta + layout.meta_bytes, numel, fmt->block_numel, layout.n_blocks, y);
  return zkc_launch_check("dequantize_kernel");
}
