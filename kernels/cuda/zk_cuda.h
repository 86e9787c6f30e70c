/* zk_cuda.h - the CUDA kernel module (libzerod_cuda.so) and its loader.
 *
 * The CUDA drivers of the kernels in zk.h live in a shared module that is
 * opened with dlopen only where a GPU is present, so that the CPU build of
 * zerod needs nothing from CUDA at run time. The module exports one symbol,
 * zk_cuda_get_api, which returns a table of functions; the table carries its
 * size and version so that fields can be added at the end without breaking an
 * older caller (as NCCL's config structs do).
 *
 * The kernel entries take the same arguments as their CPU counterparts in
 * zk.h, with a CUDA stream (cudaStream_t passed as void *, NULL for the
 * default stream) in place of the thread pool, and with device pointers for
 * every array. They only enqueue work: results are ready once the stream is
 * synchronised. Outputs that the CPU drivers return through host pointers
 * are device pointers here and are accumulated rather than overwritten, so
 * one flag or sum can collect many launches without a host round trip:
 * - nonfinite_dev (int *, may be NULL): set to 1 when Inf/NaN is found, never
 *   cleared by the kernel;
 * - sum_dev (double *): the sum of squares is added to *sum_dev.
 * Every entry returns 0 or a negative errno value; last_error() describes the
 * most recent CUDA failure of the calling thread.
 */
#ifndef ZK_CUDA_H
#define ZK_CUDA_H

#include <stddef.h>
#include "../zk.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ZK_CUDA_API_VERSION 1
#define ZK_CUDA_MODULE_NAME "libzerod_cuda.so"

typedef struct zk_cuda_api {
  size_t size; /* sizeof(zk_cuda_api) of the module */
  int version; /* ZK_CUDA_API_VERSION of the module */

  /* Devices and memory (the seed of the CUDA device backend). */
  int (*device_count)(int *count_out);
  int (*device_name)(int device, char *name, size_t name_len);
  int (*set_device)(int device);
  int (*alloc)(void **ptr_out, size_t bytes);
  int (*free)(void *ptr);
  int (*copy_to_device)(void *dst_dev, const void *src_host, size_t bytes);
  int (*copy_to_host)(void *dst_host, const void *src_dev, size_t bytes);
  int (*copy_device)(void *dst_dev, const void *src_dev, size_t bytes, void *stream);
  int (*memset)(void *dst_dev, int value, size_t bytes);
  int (*synchronize)(void *stream);
  const char *(*last_error)(void);

  /* Kernels; see zk.h for the semantics of each. */
  int (*adam_step)(void *stream, const zk_adam_hparams *hp, float *param, float *exp_avg,
                   float *exp_avg_sq, const void *grad, zk_dtype grad_dtype, void *working,
                   zk_dtype working_dtype, size_t numel);
  int (*sgd_step)(void *stream, const zk_sgd_hparams *hp, float *param, float *momentum_buf,
                  const void *grad, zk_dtype grad_dtype, void *working, zk_dtype working_dtype,
                  size_t numel);
  int (*cast)(void *stream, void *dst, zk_dtype dst_dtype, const void *src, zk_dtype src_dtype,
              size_t numel);
  int (*accumulate)(void *stream, float *acc, const void *src, zk_dtype src_dtype, size_t numel,
                    int *nonfinite_dev);
  int (*scale)(void *stream, float *x, float factor, size_t numel, int *nonfinite_dev);
  int (*sumsq)(void *stream, const void *x, zk_dtype dtype, size_t numel, double *sum_dev);
  int (*quantize)(void *stream, const zk_qformat *fmt, const float *x, size_t numel, void *out,
                  size_t out_bytes, int *nonfinite_dev);
  int (*dequantize)(void *stream, const zk_qformat *fmt, const void *in, size_t in_bytes, float *y,
                    size_t numel);
} zk_cuda_api;

/* Exported by the module. Returns NULL if it cannot serve `version`. */
typedef const zk_cuda_api *(*zk_cuda_get_api_fn)(int version);

/* Loader, part of the CPU kernel library (no CUDA needed to build or run it).
 * Opens the module ($ZEROD_CUDA_MODULE if set, else the copy installed or
 * built next to the library, else the dynamic linker's search path), checks
 * its version and that at least one device is usable. On failure returns a
 * negative errno (-ENOENT: no module, -ENODEV: no usable GPU, -EPROTO: wrong
 * version) and writes the reason to why (if not NULL). The module stays
 * loaded for the life of the process; repeated calls return the same table. */
int zk_cuda_load(const zk_cuda_api **api_out, char *why, size_t why_len);

#ifdef __cplusplus
}
#endif

#endif /* ZK_CUDA_H */
