/* cast.cu - CUDA driver of the dtype conversions (math in math_cast.h).
 *
 * The conversions are integer bit manipulation plus exact scalings, so the
 * GPU produces the same bits as the CPU, NaN payloads included. fp32 to fp32
 * is a plain copy, as on the CPU.
 */
#include "internal.h"

template <int S, int D>
__global__ void __launch_bounds__(ZKC_THREADS)
    cast_kernel(void *__restrict__ dst, const void *__restrict__ src, size_t numel, int vec4) {
  zkc_for_each(
      numel, vec4,
      [&](size_t group) {
        float values[4];
        zkc_load4<S>(src, group, values);
        zkc_store4<D>(dst, group, values);
      },
      [&](size_t i) { zkc_store<D>(dst, i, zkc_load<S>(src, i)); });
}

typedef void (*cast_kernel_fn)(void *, const void *, size_t, int);

int zkc_cast(void *stream, void *dst, zk_dtype dst_dtype, const void *src, zk_dtype src_dtype,
             size_t numel) {
  cast_kernel_fn kernel = NULL;
  int copy = 0;
  if (src_dtype == ZK_F32 && dst_dtype == ZK_BF16)
    kernel = cast_kernel<ZK_F32, ZK_BF16>;
  else if (src_dtype == ZK_F32 && dst_dtype == ZK_F16)
    kernel = cast_kernel<ZK_F32, ZK_F16>;
  else if (src_dtype == ZK_BF16 && dst_dtype == ZK_F32)
    kernel = cast_kernel<ZK_BF16, ZK_F32>;
  else if (src_dtype == ZK_F16 && dst_dtype == ZK_F32)
    kernel = cast_kernel<ZK_F16, ZK_F32>;
  else if (src_dtype == ZK_F32 && dst_dtype == ZK_F32)
    copy = 1;
  else
    return -EINVAL;
  if (numel == 0)
    return 0;
  if (dst == NULL || src == NULL)
    return -EINVAL;
  cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  if (copy) {
    if (numel > SIZE_MAX / sizeof(float))
      return -EINVAL;
    ZKC_CHECK(
        cudaMemcpyAsync(dst, src, numel * sizeof(float), cudaMemcpyDeviceToDevice, cuda_stream));
    return 0;
  }

  int vec4 = zkc_vec4_ok(src, src_dtype) && zkc_vec4_ok(dst, dst_dtype);
  unsigned blocks;
  int rc = zkc_grid_blocks(kernel, vec4 ? (numel + 3) / 4 : numel, ZKC_THREADS, &blocks);
  if (rc != 0)
    return rc;
  kernel<<<blocks, ZKC_THREADS, 0, cuda_stream>>>(dst, src, numel, vec4);
  return zkc_launch_check("cast_kernel");
}
