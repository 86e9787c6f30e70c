/* module.cu - the face of libzerod_cuda.so: the per-thread error string, the
 * device and memory entries, and the zk_cuda_api table that
 * zk_cuda_get_api, the module's only exported symbol, hands out.
 *
 * The kernels themselves live in optim.cu, cast.cu, reduce.cu and quant.cu;
 * streams, events, asynchronous copies and CUDA IPC in device.cu; NCCL in
 * nccl.cu.
 */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* ---- errors ------------------------------------------------------------- */

/* One buffer per thread, like errno: entries called from different
 * threads (one executor per device) never see each other's failures. */
static thread_local char zkc_last_error[256];

int zkc_fail(cudaError_t err, const char *what) {
  snprintf(zkc_last_error, sizeof zkc_last_error, "%s: %s: %s", what, cudaGetErrorName(err),
           cudaGetErrorString(err));
  /* A failed call also leaves its code in the runtime's per-thread "last
   * error", which the launch check of the next kernel would report as its
   * own. Reading it clears it (sticky errors that poison the context stay,
   * and every later call reports them, as it should). */
  (void)cudaGetLastError();
  return err == cudaErrorMemoryAllocation ? -ENOMEM : -EIO;
}

int zkc_fail_text(int error, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(zkc_last_error, sizeof zkc_last_error, fmt, ap);
  va_end(ap);
  return error;
}

static const char *zkc_get_last_error(void) {
  return zkc_last_error;
}

int zkc_grid_blocks_for(const void *kernel, size_t work_items, unsigned threads,
                        unsigned *blocks_out) {
  int device, sm_count, blocks_per_sm;
  ZKC_CHECK(cudaGetDevice(&device));
  ZKC_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  ZKC_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, (int)threads, 0));
  size_t wave = (size_t)sm_count * (size_t)(blocks_per_sm > 0 ? blocks_per_sm : 1);
  size_t needed = (work_items + threads - 1) / threads;
  size_t blocks = needed < wave ? needed : wave;
  *blocks_out = blocks > 0 ? (unsigned)blocks : 1u;
  return 0;
}

/* ---- devices ------------------------------------------------------------ */

static int zkc_device_count(int *count_out) {
  if (count_out == NULL)
    return -EINVAL;
  *count_out = 0;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorInsufficientDriver) {
    /* The runtime says this both when the driver is too old and when there
     * is none at all, the common case on CPU machines; say which. */
    char what[128];
    void *driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (driver != NULL) {
      snprintf(what, sizeof what,
               "cudaGetDeviceCount (the NVIDIA driver is older than this CUDA %d.%d runtime)",
               CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
      dlclose(driver);
    } else {
      snprintf(what, sizeof what, "cudaGetDeviceCount (no NVIDIA driver: libcuda.so.1 not found)");
    }
    return zkc_fail(err, what);
  }
  if (err != cudaSuccess)
    return zkc_fail(err, "cudaGetDeviceCount");
  *count_out = count;
  return 0;
}

static int zkc_device_name(int device, char *name, size_t name_len) {
  if (name == NULL || name_len == 0)
    return -EINVAL;
  cudaDeviceProp prop;
  ZKC_CHECK(cudaGetDeviceProperties(&prop, device));
  snprintf(name, name_len, "%s", prop.name);
  return 0;
}

static int zkc_set_device(int device) {
  ZKC_CHECK(cudaSetDevice(device));
  return 0;
}

/* ---- memory ------------------------------------------------------------- */

static int zkc_alloc(void **ptr_out, size_t bytes) {
  if (ptr_out == NULL)
    return -EINVAL;
  *ptr_out = NULL;
  /* An empty allocation is NULL, which free accepts, rather than whatever
   * cudaMalloc(0) happens to return. */
  if (bytes == 0)
    return 0;
  ZKC_CHECK(cudaMalloc(ptr_out, bytes));
  return 0;
}

static int zkc_free(void *ptr) {
  if (ptr == NULL)
    return 0;
  ZKC_CHECK(cudaFree(ptr));
  return 0;
}

static int zkc_copy_to_device(void *dst_dev, const void *src_host, size_t bytes) {
  if (bytes == 0)
    return 0;
  if (dst_dev == NULL || src_host == NULL)
    return -EINVAL;
  ZKC_CHECK(cudaMemcpy(dst_dev, src_host, bytes, cudaMemcpyHostToDevice));
  return 0;
}

static int zkc_copy_to_host(void *dst_host, const void *src_dev, size_t bytes) {
  if (bytes == 0)
    return 0;
  if (dst_host == NULL || src_dev == NULL)
    return -EINVAL;
  ZKC_CHECK(cudaMemcpy(dst_host, src_dev, bytes, cudaMemcpyDeviceToHost));
  return 0;
}

static int zkc_copy_device(void *dst_dev, const void *src_dev, size_t bytes, void *stream) {
  if (bytes == 0)
    return 0;
  if (dst_dev == NULL || src_dev == NULL)
    return -EINVAL;
  ZKC_CHECK(cudaMemcpyAsync(dst_dev, src_dev, bytes, cudaMemcpyDeviceToDevice,
                            static_cast<cudaStream_t>(stream)));
  return 0;
}

static int zkc_memset(void *dst_dev, int value, size_t bytes) {
  if (bytes == 0)
    return 0;
  if (dst_dev == NULL)
    return -EINVAL;
  ZKC_CHECK(cudaMemset(dst_dev, value, bytes));
  return 0;
}

static int zkc_synchronize(void *stream) {
  ZKC_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return 0;
}

/* ---- the table ---------------------------------------------------------- */

/* Filled field by field (C++17 has no designated initialisers), and at
 * compile time, so the table exists before any constructor runs. */
static constexpr zk_cuda_api zkc_make_api() {
  zk_cuda_api api{};
  api.size = sizeof(zk_cuda_api);
  api.version = ZK_CUDA_API_VERSION;
  api.device_count = zkc_device_count;
  api.device_name = zkc_device_name;
  api.set_device = zkc_set_device;
  api.alloc = zkc_alloc;
  api.free = zkc_free;
  api.copy_to_device = zkc_copy_to_device;
  api.copy_to_host = zkc_copy_to_host;
  api.copy_device = zkc_copy_device;
  api.memset = zkc_memset;
  api.synchronize = zkc_synchronize;
  api.last_error = zkc_get_last_error;
  api.adam_step = zkc_adam_step;
  api.sgd_step = zkc_sgd_step;
  api.cast = zkc_cast;
  api.accumulate = zkc_accumulate;
  api.scale = zkc_scale;
  api.sumsq = zkc_sumsq;
  api.quantize = zkc_quantize;
  api.dequantize = zkc_dequantize;
  /* Version 2. */
  api.get_device = zkc_get_device;
  api.stream_create = zkc_stream_create;
  api.stream_destroy = zkc_stream_destroy;
  api.event_create = zkc_event_create;
  api.event_destroy = zkc_event_destroy;
  api.event_record = zkc_event_record;
  api.event_query = zkc_event_query;
  api.event_synchronize = zkc_event_synchronize;
  api.stream_wait_event = zkc_stream_wait_event;
  api.copy_to_host_async = zkc_copy_to_host_async;
  api.copy_to_device_async = zkc_copy_to_device_async;
  api.memset_async = zkc_memset_async;
  api.ipc_mem_handle = zkc_ipc_mem_handle;
  api.ipc_mem_open = zkc_ipc_mem_open;
  api.ipc_mem_close = zkc_ipc_mem_close;
  api.ipc_event_handle = zkc_ipc_event_handle;
  api.ipc_event_open = zkc_ipc_event_open;
  api.nccl_available = zkc_nccl_available;
  api.nccl_unique_id = zkc_nccl_unique_id;
  api.nccl_init = zkc_nccl_init;
  api.nccl_status = zkc_nccl_status;
  api.nccl_all_gather = zkc_nccl_all_gather;
  api.nccl_reduce_scatter_f32 = zkc_nccl_reduce_scatter_f32;
  api.nccl_all_reduce = zkc_nccl_all_reduce;
  api.nccl_broadcast = zkc_nccl_broadcast;
  api.nccl_abort = zkc_nccl_abort;
  api.nccl_destroy = zkc_nccl_destroy;
  /* Version 3. */
  api.host_alloc = zkc_host_alloc;
  api.host_free = zkc_host_free;
  return api;
}

static constexpr zk_cuda_api zkc_api = zkc_make_api();

/* The one exported symbol (everything else is hidden by
 * -fvisibility=hidden, and the static CUDA runtime by --exclude-libs). A
 * table only grows at its end, so any version up to ours can be served. */
extern "C" __attribute__((visibility("default"))) const zk_cuda_api *zk_cuda_get_api(int version) {
  if (version < 1 || version > ZK_CUDA_API_VERSION)
    return NULL;
  return &zkc_api;
}
