/* reduce.cu - CUDA drivers of gradient accumulation, loss-scale removal and
 * the sum of squares behind the global gradient norm.
 *
 * The non-finite checks and the sum of squares write to device memory and
 * accumulate there (see zk_cuda.h), so a step can check and norm all its
 * shards without a host round trip per shard.
 */
#include "internal.h"

/* ---- accumulate and scale ---------------------------------------------- */

template <int G>
__global__ void __launch_bounds__(ZKC_THREADS)
    accumulate_kernel(float *__restrict__ acc, const void *__restrict__ src, size_t numel, int vec4,
                      int *nonfinite) {
  int bad = 0;
  auto add = [&](float &a, float g) {
    float sum = a + g;
    bad |= !zk_finite_f32(g) | !zk_finite_f32(sum);
    a = sum;
  };
  zkc_for_each(
      numel, vec4,
      [&](size_t group) {
        float a[4], g[4];
        zkc_load4<ZK_F32>(acc, group, a);
        zkc_load4<G>(src, group, g);
#pragma unroll
        for (int k = 0; k < 4; k++)
          add(a[k], g[k]);
        zkc_store4<ZK_F32>(acc, group, a);
      },
      [&](size_t i) { add(acc[i], zkc_load<G>(src, i)); });
  zkc_flag_nonfinite(nonfinite, bad);
}

typedef void (*accumulate_kernel_fn)(float *, const void *, size_t, int, int *);
static const accumulate_kernel_fn accumulate_kernels[3] = {
    accumulate_kernel<ZK_F32>, accumulate_kernel<ZK_BF16>, accumulate_kernel<ZK_F16>};

int zkc_accumulate(void *stream, float *acc, const void *src, zk_dtype src_dtype, size_t numel,
                   int *nonfinite_dev) {
  if (!zk_is_float_dtype(src_dtype))
    return -EINVAL;
  if (numel == 0)
    return 0;
  if (acc == NULL || src == NULL)
    return -EINVAL;
  int vec4 = zkc_vec4_ok(acc, ZK_F32) && zkc_vec4_ok(src, src_dtype);
  accumulate_kernel_fn kernel = accumulate_kernels[src_dtype];
  unsigned blocks;
  int rc = zkc_grid_blocks(kernel, vec4 ? (numel + 3) / 4 : numel, ZKC_THREADS, &blocks);
  if (rc != 0)
    return rc;
  kernel<<<blocks, ZKC_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(acc, src, numel, vec4,
                                                                        nonfinite_dev);
  return zkc_launch_check("accumulate_kernel");
}

__global__ void __launch_bounds__(ZKC_THREADS)
    scale_kernel(float *__restrict__ x, float factor, size_t numel, int vec4, int *nonfinite) {
  int bad = 0;
  auto scale = [&](float &v) {
    float y = v * factor;
    bad |= !zk_finite_f32(v) | !zk_finite_f32(y);
    v = y;
  };
  zkc_for_each(
      numel, vec4,
      [&](size_t group) {
        float v[4];
        zkc_load4<ZK_F32>(x, group, v);
#pragma unroll
        for (int k = 0; k < 4; k++)
          scale(v[k]);
        zkc_store4<ZK_F32>(x, group, v);
      },
      [&](size_t i) { scale(x[i]); });
  zkc_flag_nonfinite(nonfinite, bad);
}

int zkc_scale(void *stream, float *x, float factor, size_t numel, int *nonfinite_dev) {
  if (numel == 0)
    return 0;
  if (x == NULL)
    return -EINVAL;
  int vec4 = zkc_vec4_ok(x, ZK_F32);
  unsigned blocks;
  int rc = zkc_grid_blocks(scale_kernel, vec4 ? (numel + 3) / 4 : numel, ZKC_THREADS, &blocks);
  if (rc != 0)
    return rc;
  scale_kernel<<<blocks, ZKC_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(x, factor, numel,
                                                                              vec4, nonfinite_dev);
  return zkc_launch_check("scale_kernel");
}

/* ---- sum of squares ---------------------------------------------------- */

/* The sum must come out the same, bit for bit, every time it is computed
 * over the same array, on any GPU: the global norm decides gradient clipping
 * on every rank. So nothing in it depends on the device or on timing:
 * - the grid has a fixed size that depends only on numel (not on the SM
 *   count), and element i always goes to thread i mod (grid * block);
 * - each thread sums its elements in order, folding every SUMSQ_CHUNK
 *   squares into its total (a two-level sum that keeps the rounding error
 *   near (SUMSQ_CHUNK + n / SUMSQ_CHUNK) * 2^-53 instead of n * 2^-53);
 * - each block reduces its threads in a fixed tree into its own slot of a
 *   scratch array, and one block then reduces the slots in a fixed tree;
 * - the only atomic adds the final total to *sum_dev, one per launch, so
 *   launches ordered on one stream accumulate in a fixed order.
 * Squares of fp32 values are exact in double. */
#define SUMSQ_MAX_BLOCKS 1024u
#define SUMSQ_CHUNK      32

/* Reduces the blockDim.x (= ZKC_THREADS) values of shared in a fixed
 * pairwise tree; the result is in shared[0] for every thread afterwards. */
__device__ __forceinline__ void sumsq_block_tree(double *shared) {
  for (unsigned half = ZKC_THREADS / 2; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.x < half)
      shared[threadIdx.x] += shared[threadIdx.x + half];
  }
  __syncthreads();
}

/* Writes the block's partial sum to partials[blockIdx.x], or adds it to
 * *sum when the grid is a single block (no scratch needed). */
template <int D>
__global__ void __launch_bounds__(ZKC_THREADS)
    sumsq_partial_kernel(const void *__restrict__ x, size_t numel, double *partials, double *sum) {
  __shared__ double shared[ZKC_THREADS];
  size_t thread = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  size_t n_threads = (size_t)gridDim.x * blockDim.x;
  double total = 0.0, chunk = 0.0;
  int in_chunk = 0;
  for (size_t i = thread; i < numel; i += n_threads) {
    double v = zkc_load<D>(x, i);
    chunk += v * v;
    if (++in_chunk == SUMSQ_CHUNK) {
      total += chunk;
      chunk = 0.0;
      in_chunk = 0;
    }
  }
  shared[threadIdx.x] = total + chunk;
  sumsq_block_tree(shared);
  if (threadIdx.x == 0) {
    if (gridDim.x == 1)
      atomicAdd(sum, shared[0]);
    else
      partials[blockIdx.x] = shared[0];
  }
}

__global__ void __launch_bounds__(ZKC_THREADS)
    sumsq_final_kernel(const double *__restrict__ partials, unsigned n_partials, double *sum) {
  __shared__ double shared[ZKC_THREADS];
  double total = 0.0;
  for (unsigned i = threadIdx.x; i < n_partials; i += ZKC_THREADS)
    total += partials[i];
  shared[threadIdx.x] = total;
  sumsq_block_tree(shared);
  if (threadIdx.x == 0)
    atomicAdd(sum, shared[0]);
}

typedef void (*sumsq_partial_kernel_fn)(const void *, size_t, double *, double *);
static const sumsq_partial_kernel_fn sumsq_partial_kernels[3] = {
    sumsq_partial_kernel<ZK_F32>, sumsq_partial_kernel<ZK_BF16>, sumsq_partial_kernel<ZK_F16>};

int zkc_sumsq(void *stream, const void *x, zk_dtype dtype, size_t numel, double *sum_dev) {
  if (sum_dev == NULL || !zk_is_float_dtype(dtype))
    return -EINVAL;
  if (numel == 0)
    return 0;
  if (x == NULL)
    return -EINVAL;
  cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  size_t needed = (numel + ZKC_THREADS - 1) / ZKC_THREADS;
  unsigned blocks = needed < SUMSQ_MAX_BLOCKS ? (unsigned)needed : SUMSQ_MAX_BLOCKS;
  if (blocks == 1) {
    sumsq_partial_kernels[dtype]<<<1, ZKC_THREADS, 0, cuda_stream>>>(x, numel, NULL, sum_dev);
    return zkc_launch_check("sumsq_partial_kernel");
  }

  /* The scratch comes from the stream-ordered allocator: it is private to
   * this launch (launches on other streams cannot clobber it), costs no
   * device synchronisation, and is reused from the pool after the first
   * call. */
  double *partials = NULL;
  ZKC_CHECK(cudaMallocAsync((void **)&partials, blocks * sizeof(double), cuda_stream));
  sumsq_partial_kernels[dtype]<<<blocks, ZKC_THREADS, 0, cuda_stream>>>(x, numel, partials,
                                                                        sum_dev);
  int rc = zkc_launch_check("sumsq_partial_kernel");
  if (rc == 0) {
    sumsq_final_kernel<<<1, ZKC_THREADS, 0, cuda_stream>>>(partials, blocks, sum_dev);
    rc = zkc_launch_check("sumsq_final_kernel");
  }
  cudaError_t err = cudaFreeAsync(partials, cuda_stream);
  if (err != cudaSuccess && rc == 0)
    rc = zkc_fail(err, "cudaFreeAsync(partials)");
  return rc;
}
