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
 * most recent failure (CUDA's, NCCL's, or a refused argument) of the calling
 * thread.
 *
 * Version 2 adds what the CUDA device backend and the NCCL comm backend
 * need: streams, events, asynchronous copies, CUDA IPC handles, and NCCL
 * (opened with dlopen by the module, so nothing links libnccl).
 *
 * Version 3 adds page-locked host memory (the staging buffers of an
 * optimizer whose state is offloaded to host memory or NVMe).
 */
#ifndef ZK_CUDA_H
#define ZK_CUDA_H

#include <stddef.h>
#include "../zk.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ZK_CUDA_API_VERSION      3
#define ZK_CUDA_IPC_HANDLE_BYTES 64  /* cudaIpcMemHandle_t, cudaIpcEventHandle_t */
#define ZK_NCCL_UNIQUE_ID_BYTES  128 /* ncclUniqueId */

/* Element types and reductions of the NCCL entries. */
typedef enum zk_nccl_dtype { ZK_NCCL_F32, ZK_NCCL_F64, ZK_NCCL_U8, ZK_NCCL_I64 } zk_nccl_dtype;
typedef enum zk_nccl_op { ZK_NCCL_SUM, ZK_NCCL_MAX, ZK_NCCL_MIN } zk_nccl_op;
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

  /* ---- Version 2: the CUDA device backend and NCCL ---------------------
   * Streams and events are opaque (cudaStream_t, cudaEvent_t). Every entry
   * acts on the calling thread's current device (set_device). */
  int (*get_device)(int *device_out);
  int (*stream_create)(void **stream_out); /* non-blocking with respect to stream 0 */
  int (*stream_destroy)(void *stream);
  /* interprocess != 0: cudaEventInterprocess | cudaEventDisableTiming, so
   * the event can be exported with ipc_event_handle. */
  int (*event_create)(void **event_out, int interprocess);
  int (*event_destroy)(void *event);
  int (*event_record)(void *event, void *stream);
  int (*event_query)(void *event); /* 0: complete, -EAGAIN: pending, else an error */
  int (*event_synchronize)(void *event);
  int (*stream_wait_event)(void *stream, void *event);
  int (*copy_to_host_async)(void *dst_host, const void *src_dev, size_t bytes, void *stream);
  int (*copy_to_device_async)(void *dst_dev, const void *src_host, size_t bytes, void *stream);
  int (*memset_async)(void *dst_dev, int value, size_t bytes, void *stream);

  /* CUDA IPC. A handle is ZK_CUDA_IPC_HANDLE_BYTES opaque bytes that another
   * process on the same node opens. ipc_mem_handle takes the base pointer
   * of an alloc; ipc_mem_open maps it (cudaIpcMemLazyEnablePeerAccess) and
   * ipc_mem_close unmaps it. An opened event can be waited on
   * (stream_wait_event, event_synchronize) and recorded; destroy it with
   * event_destroy. */
  int (*ipc_mem_handle)(void *dev_ptr, void *handle_out);
  int (*ipc_mem_open)(const void *handle, void **dev_ptr_out);
  int (*ipc_mem_close)(void *dev_ptr);
  int (*ipc_event_handle)(void *event, void *handle_out);
  int (*ipc_event_open)(const void *handle, void **event_out);

  /* NCCL. The module opens libnccl.so.2 on first use (dlopen, so that the
   * kernels work where NCCL is not installed; $ZEROD_NCCL_LIBRARY names
   * another file) and needs NCCL 2.14 or newer; nccl_available says whether
   * it could, and writes why not (or, on success, which NCCL it loaded) to
   * why. A module built without nccl.h answers -ENOSYS to every NCCL entry.
   * Communicators are created non-blocking
   * (ncclConfig_t.blocking = 0): nccl_init returns at once and nccl_status
   * tells when the communicator is ready (0), still connecting (-EAGAIN) or
   * failed (another negative errno; last_error says why). Collectives only
   * enqueue on `stream`; completion is an event recorded after them, and a
   * peer that died shows as nccl_status failing (-ECONNRESET for NCCL's
   * remote errors, -EIO for the rest). nccl_abort frees a communicator in
   * any state without waiting for peers; nccl_destroy finalizes a healthy
   * one and frees it, aborting it instead if finalizing fails or takes more
   * than 10 s: either way the communicator is gone when it returns. */
  int (*nccl_available)(char *why, size_t why_len); /* 0 or -ENOSYS */
  int (*nccl_unique_id)(void *id_out);
  int (*nccl_init)(void **comm_out, int world_size, int rank, const void *unique_id);
  int (*nccl_status)(void *comm);
  int (*nccl_all_gather)(void *comm, const void *send, void *recv, size_t bytes_per_rank,
                         void *stream);
  int (*nccl_reduce_scatter_f32)(void *comm, const float *send, float *recv, size_t shard_numel,
                                 void *stream);
  int (*nccl_all_reduce)(void *comm, void *buf, size_t count, zk_nccl_dtype dtype, zk_nccl_op op,
                         void *stream);
  int (*nccl_broadcast)(void *comm, void *buf, size_t bytes, int root, void *stream);
  int (*nccl_abort)(void *comm);
  int (*nccl_destroy)(void *comm);

  /* ---- Version 3: page-locked host memory ---------------------------------
   * host_alloc returns zero-filled host memory that the GPU's copy engines
   * reach directly (cudaHostAlloc, portable), so the asynchronous copies
   * from and to it overlap the host's work; host_free gives it back
   * (NULL: nothing). */
  int (*host_alloc)(void **ptr_out, size_t bytes);
  int (*host_free)(void *ptr);
} zk_cuda_api;

/* Exported by the module. Returns NULL if it cannot serve `version`. */
typedef const zk_cuda_api *(*zk_cuda_get_api_fn)(int version);

/* Loader, part of the CPU kernel library (no CUDA needed to build or run it).
 * Opens the module ($ZEROD_CUDA_MODULE if set, else the copy next to the
 * library or program, else the installed one in libdir as seen from bindir,
 * else the build tree's, else the dynamic linker's search path), checks
 * its version and that at least one device is usable. On failure returns a
 * negative errno (-ENOENT: no module, -ENODEV: no usable GPU, -EPROTO: wrong
 * version) and writes the reason to why (if not NULL). The module stays
 * loaded for the life of the process; repeated calls return the same table. */
int zk_cuda_load(const zk_cuda_api **api_out, char *why, size_t why_len);

#ifdef __cplusplus
}
#endif

#endif /* ZK_CUDA_H */
