/* internal.h - what the CUDA drivers of libzerod_cuda.so share: error
 * reporting, launch geometry, dtype access on the device and the prototypes
 * of the entries that module.cu puts into the zk_cuda_api table.
 *
 * Only the .cu files of the module include this header; it is C++ (CUDA)
 * and never seen by the CPU library, which reaches the module only through
 * the table.
 */
#ifndef ZK_CUDA_INTERNAL_H
#define ZK_CUDA_INTERNAL_H

#include <cuda_runtime.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "../args.h"
#include "../math_cast.h"
#include "../zk.h"
#include "zk_cuda.h"

/* ---- errors ------------------------------------------------------------- */

/* Records "what: cudaErrorName: description" as the calling thread's last
 * error, clears the runtime's own sticky-until-read error state (so the
 * next launch check does not report this failure again) and returns the
 * errno value the entries return: -ENOMEM for allocation failures, -EIO for
 * everything else. */
int zkc_fail(cudaError_t err, const char *what);

/* Records a message of the caller's (a failure that is not a cudaError_t:
 * NCCL's, a bad argument) as the calling thread's last error and returns
 * error, a negative errno value. */
__attribute__((format(printf, 2, 3))) int zkc_fail_text(int error, const char *fmt, ...);

/* Returns zkc_fail(...) from the enclosing function when a CUDA call fails. */
#define ZKC_CHECK(call)                                                                            \
  do {                                                                                             \
    cudaError_t zkc_err_ = (call);                                                                 \
    if (zkc_err_ != cudaSuccess)                                                                   \
      return zkc_fail(zkc_err_, #call);                                                            \
  } while (0)

/* Launches are asynchronous: a bad configuration is only reported by the
 * next cudaGetLastError, which this checks right after the launch. */
static inline int zkc_launch_check(const char *kernel_name) {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : zkc_fail(err, kernel_name);
}

/* ---- launch geometry ---------------------------------------------------- */

/* Threads per block of the element-wise kernels: 256 keeps enough blocks per
 * SM resident to hide memory latency without starving registers. */
#define ZKC_THREADS 256u

/* Blocks for a grid-stride loop of `kernel` over work_items items with
 * `threads` threads per block: as many as the current device holds resident
 * at once (one full wave, per the occupancy calculator, so that no block
 * waits for a second wave while the others idle at the end), or fewer when
 * there is little work. */
int zkc_grid_blocks_for(const void *kernel, size_t work_items, unsigned threads,
                        unsigned *blocks_out);

template <typename K>
static inline int zkc_grid_blocks(K kernel, size_t work_items, unsigned threads,
                                  unsigned *blocks_out) {
  return zkc_grid_blocks_for(reinterpret_cast<const void *>(kernel), work_items, threads,
                             blocks_out);
}

static inline int zkc_aligned(const void *ptr, size_t alignment) {
  return ((uintptr_t)ptr & (alignment - 1)) == 0;
}

/* ---- dtype access on the device ----------------------------------------- */

/* D is a zk_dtype value; each kernel is instantiated per dtype, so these
 * compile to one load or store and the conversion from math_cast.h. */
template <int D> __device__ __forceinline__ float zkc_load(const void *src, size_t i) {
  if constexpr (D == ZK_BF16)
    return zk_bf16_to_f32(static_cast<const uint16_t *>(src)[i]);
  else if constexpr (D == ZK_F16)
    return zk_f16_to_f32(static_cast<const uint16_t *>(src)[i]);
  else
    return static_cast<const float *>(src)[i];
}

template <int D> __device__ __forceinline__ void zkc_store(void *dst, size_t i, float value) {
  if constexpr (D == ZK_BF16)
    static_cast<uint16_t *>(dst)[i] = zk_f32_to_bf16(value);
  else if constexpr (D == ZK_F16)
    static_cast<uint16_t *>(dst)[i] = zk_f32_to_f16(value);
  else if constexpr (D == ZK_F32)
    static_cast<float *>(dst)[i] = value;
}

/* Four consecutive elements 4 * group .. 4 * group + 3 in one 16-byte (fp32)
 * or 8-byte (16-bit) access. The caller has checked the alignment (see
 * zkc_vec4_ok). Element 4 * group sits in the low half of the first word:
 * the GPU is little-endian. */
template <int D>
__device__ __forceinline__ void zkc_load4(const void *src, size_t group, float out[4]) {
  if constexpr (D == ZK_F32) {
    float4 v = static_cast<const float4 *>(src)[group];
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  } else {
    uint2 v = static_cast<const uint2 *>(src)[group];
    uint16_t h[4] = {(uint16_t)(v.x & 0xffffu), (uint16_t)(v.x >> 16), (uint16_t)(v.y & 0xffffu),
                     (uint16_t)(v.y >> 16)};
#pragma unroll
    for (int k = 0; k < 4; k++)
      out[k] = D == ZK_BF16 ? zk_bf16_to_f32(h[k]) : zk_f16_to_f32(h[k]);
  }
}

template <int D>
__device__ __forceinline__ void zkc_store4(void *dst, size_t group, const float in[4]) {
  if constexpr (D == ZK_F32) {
    static_cast<float4 *>(dst)[group] = make_float4(in[0], in[1], in[2], in[3]);
  } else if constexpr (D == ZK_BF16 || D == ZK_F16) {
    uint32_t h[4];
#pragma unroll
    for (int k = 0; k < 4; k++)
      h[k] = D == ZK_BF16 ? zk_f32_to_bf16(in[k]) : zk_f32_to_f16(in[k]);
    static_cast<uint2 *>(dst)[group] = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
  }
}

/* Whether an array of dtype can be read four elements at a time. NULL (an
 * absent array) does not stand in the way. */
/* The traversal every element-wise kernel shares: a grid-stride loop over
 * groups of four elements through group_fn (when vec4, i.e. every array is
 * aligned for 16-byte fp32 and 8-byte 16-bit accesses), then over the
 * elements the groups left over (all of them without vec4) through
 * element_fn. Both see each element exactly once, in one thread. */
template <typename GroupFn, typename ElementFn>
__device__ __forceinline__ void zkc_for_each(size_t numel, int vec4, GroupFn group_fn,
                                             ElementFn element_fn) {
  size_t thread = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  size_t n_threads = (size_t)gridDim.x * blockDim.x;
  size_t scalar_begin = 0;
  if (vec4) {
    size_t n_groups = numel / 4;
    for (size_t group = thread; group < n_groups; group += n_threads)
      group_fn(group);
    scalar_begin = n_groups * 4;
  }
  for (size_t i = scalar_begin + thread; i < numel; i += n_threads)
    element_fn(i);
}

static inline int zkc_vec4_ok(const void *ptr, zk_dtype dtype) {
  return ptr == NULL || zkc_aligned(ptr, dtype == ZK_F32 ? 16 : 8);
}

/* Sets *flag (a device int, may be NULL) when any thread of the warp saw a
 * non-finite value. Called by every thread of the block after its loops;
 * one atomic per offending warp, and the flag is only ever set, never
 * cleared, so launches can share it. */
__device__ __forceinline__ void zkc_flag_nonfinite(int *flag, int bad) {
  if (flag == NULL)
    return;
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31u) == 0)
    atomicOr(flag, 1);
}

/* ---- entries of the table (one file each group) ------------------------- */

/* optim.cu */
int zkc_adam_step(void *stream, const zk_adam_hparams *hp, float *param, float *exp_avg,
                  float *exp_avg_sq, const void *grad, zk_dtype grad_dtype, void *working,
                  zk_dtype working_dtype, size_t numel);
int zkc_sgd_step(void *stream, const zk_sgd_hparams *hp, float *param, float *momentum_buf,
                 const void *grad, zk_dtype grad_dtype, void *working, zk_dtype working_dtype,
                 size_t numel);

/* cast.cu */
int zkc_cast(void *stream, void *dst, zk_dtype dst_dtype, const void *src, zk_dtype src_dtype,
             size_t numel);

/* reduce.cu */
int zkc_accumulate(void *stream, float *acc, const void *src, zk_dtype src_dtype, size_t numel,
                   int *nonfinite_dev);
int zkc_scale(void *stream, float *x, float factor, size_t numel, int *nonfinite_dev);
int zkc_sumsq(void *stream, const void *x, zk_dtype dtype, size_t numel, double *sum_dev);

/* quant.cu */
int zkc_quantize(void *stream, const zk_qformat *fmt, const float *x, size_t numel, void *out,
                 size_t out_bytes, int *nonfinite_dev);
int zkc_dequantize(void *stream, const zk_qformat *fmt, const void *in, size_t in_bytes, float *y,
                   size_t numel);

/* device.cu: the version 2 device entries */
int zkc_get_device(int *device_out);
int zkc_stream_create(void **stream_out);
int zkc_stream_destroy(void *stream);
int zkc_event_create(void **event_out, int interprocess);
int zkc_event_destroy(void *event);
int zkc_event_record(void *event, void *stream);
int zkc_event_query(void *event);
int zkc_event_synchronize(void *event);
int zkc_stream_wait_event(void *stream, void *event);
int zkc_copy_to_host_async(void *dst_host, const void *src_dev, size_t bytes, void *stream);
int zkc_copy_to_device_async(void *dst_dev, const void *src_host, size_t bytes, void *stream);
int zkc_memset_async(void *dst_dev, int value, size_t bytes, void *stream);
int zkc_host_alloc(void **ptr_out, size_t bytes);
int zkc_host_free(void *ptr);
int zkc_ipc_mem_handle(void *dev_ptr, void *handle_out);
int zkc_ipc_mem_open(const void *handle, void **dev_ptr_out);
int zkc_ipc_mem_close(void *dev_ptr);
int zkc_ipc_event_handle(void *event, void *handle_out);
int zkc_ipc_event_open(const void *handle, void **event_out);

/* nccl.cu */
int zkc_nccl_available(char *why, size_t why_len);
int zkc_nccl_unique_id(void *id_out);
int zkc_nccl_init(void **comm_out, int world_size, int rank, const void *unique_id);
int zkc_nccl_status(void *comm);
int zkc_nccl_all_gather(void *comm, const void *send, void *recv, size_t bytes_per_rank,
                        void *stream);
int zkc_nccl_reduce_scatter_f32(void *comm, const float *send, float *recv, size_t shard_numel,
                                void *stream);
int zkc_nccl_all_reduce(void *comm, void *buf, size_t count, zk_nccl_dtype dtype, zk_nccl_op op,
                        void *stream);
int zkc_nccl_broadcast(void *comm, void *buf, size_t bytes, int root, void *stream);
int zkc_nccl_abort(void *comm);
int zkc_nccl_destroy(void *comm);

#endif /* ZK_CUDA_INTERNAL_H */
