/* fake_cuda_module.c - a stand-in for libzerod_cuda.so on machines without
 * a GPU, so that zerod's GPU code paths (daemon/backend/device_cuda.c, the CUDA
 * branches of rank/, CUDA IPC in libzerod) run in CPU-only CI.
 *
 * It exports zk_cuda_get_api like the real module (kernels/cuda/zk_cuda.h)
 * and is loaded the same way, with ZEROD_CUDA_MODULE pointing at it. Its
 * "device memory" is host memory, each allocation a memfd of its own so
 * that another process can open it: an IPC memory handle names the
 * exporter's pid and descriptor, and the importer maps
 * /proc/<pid>/fd/<fd>. Streams and events exist but order nothing, since
 * every operation completes before it returns. The kernels are the CPU
 * drivers of zk.h on the calling thread. NCCL is a one-rank world: the
 * collectives copy where a real one would and a larger world is refused.
 *
 * What this cannot check: real asynchrony (a missing wait or record goes
 * unnoticed), device placement, and NCCL with several ranks. Those are
 * what tests/gpu checks on a GPU. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda/zk_cuda.h"

#define EXPORT __attribute__((visibility("default")))

static _Thread_local char last_error[256];
static _Thread_local int current_device;

static int fail(int rc, const char *what) {
  snprintf(last_error, sizeof last_error, "fake CUDA: %s: %s", what, strerror(-rc));
  return rc;
}

static const char *fake_last_error(void) {
  return last_error;
}

/* The number of fake devices: $ZEROD_FAKE_CUDA_DEVICES, default 1. */
static int fake_device_count(int *count_out) {
  const char *env = getenv("ZEROD_FAKE_CUDA_DEVICES");
  *count_out = env != NULL ? atoi(env) : 1;
  return 0;
}

static int fake_device_name(int device, char *name, size_t name_len) {
  snprintf(name, name_len, "fake CUDA device %d (host memory)", device);
  return 0;
}

static int fake_set_device(int device) {
  int count;
  fake_device_count(&count);
  if (device < 0 || device >= count)
    return fail(-EINVAL, "set_device");
  current_device = device;
  return 0;
}

static int fake_get_device(int *device_out) {
  *device_out = current_device;
  return 0;
}

/* ---- memory: one memfd per allocation ------------------------------------ */

typedef struct allocation {
  struct allocation *next;
  void *base;
  size_t bytes;
  int fd;       /* exported allocations: the memfd; imported: -1 */
  int imported; /* opened with ipc_mem_open */
} allocation;

static pthread_mutex_t allocations_mutex = PTHREAD_MUTEX_INITIALIZER;
static allocation *allocations;

static allocation *find_locked(const void *base) {
  for (allocation *a = allocations; a != NULL; a = a->next)
    if (a->base == base)
      return a;
  return NULL;
}

static int fake_alloc(void **ptr_out, size_t bytes) {
  allocation *a = calloc(1, sizeof *a);
  if (a == NULL)
    return fail(-ENOMEM, "alloc");
  a->bytes = bytes == 0 ? 1 : bytes;
  a->fd = memfd_create("fake-cuda", MFD_CLOEXEC);
  if (a->fd < 0 || ftruncate(a->fd, (off_t)a->bytes) != 0) {
    int rc = -errno;
    if (a->fd >= 0)
      close(a->fd);
    free(a);
    return fail(rc, "alloc");
  }
  a->base = mmap(NULL, a->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
  if (a->base == MAP_FAILED) {
    int rc = -errno;
    close(a->fd);
    free(a);
    return fail(rc, "alloc");
  }
  pthread_mutex_lock(&allocations_mutex);
  a->next = allocations;
  allocations = a;
  pthread_mutex_unlock(&allocations_mutex);
  *ptr_out = a->base;
  return 0;
}

/* Frees an allocation (imported: only if it was imported). */
static int release(void *ptr, int imported) {
  if (ptr == NULL)
    return 0;
  pthread_mutex_lock(&allocations_mutex);
  allocation **link = &allocations;
  while (*link != NULL && ((*link)->base != ptr || (*link)->imported != imported))
    link = &(*link)->next;
  allocation *a = *link;
  if (a != NULL)
    *link = a->next;
  pthread_mutex_unlock(&allocations_mutex);
  if (a == NULL)
    return fail(-EINVAL,
                imported ? "ipc_mem_close of an unknown pointer" : "free of an unknown pointer");
  munmap(a->base, a->bytes);
  if (a->fd >= 0)
    close(a->fd);
  free(a);
  return 0;
}

static int fake_free(void *ptr) {
  return release(ptr, 0);
}

/* Page-locked host memory is plain host memory here (ASan sees a wrong
 * free). */
static int fake_host_alloc(void **ptr_out, size_t bytes) {
  *ptr_out = calloc(1, bytes ? bytes : 1);
  return *ptr_out != NULL ? 0 : fail(-ENOMEM, "host_alloc");
}

static int fake_host_free(void *ptr) {
  free(ptr);
  return 0;
}

static int fake_copy(void *dst, const void *src, size_t bytes) {
  if (bytes == 0)
    return 0;
  if (dst == NULL || src == NULL)
    return fail(-EINVAL, "copy");
  memmove(dst, src, bytes);
  return 0;
}

static int fake_copy_device(void *dst, const void *src, size_t bytes, void *stream) {
  return fake_copy(dst, src, bytes);
}

static int fake_copy_async(void *dst, const void *src, size_t bytes, void *stream) {
  return fake_copy(dst, src, bytes);
}

static int fake_memset(void *dst, int value, size_t bytes) {
  if (bytes != 0 && dst == NULL)
    return fail(-EINVAL, "memset");
  memset(dst, value, bytes);
  return 0;
}

static int fake_memset_async(void *dst, int value, size_t bytes, void *stream) {
  return fake_memset(dst, value, bytes);
}

static int fake_nothing(void *object) {
  return 0;
}

/* ---- kernels: the CPU drivers -------------------------------------------- */

static int fake_adam_step(void *stream, const zk_adam_hparams *hp, float *param, float *exp_avg,
                          float *exp_avg_sq, const void *grad, zk_dtype grad_dtype, void *working,
                          zk_dtype working_dtype, size_t numel) {
  return zk_adam_step(NULL, hp, param, exp_avg, exp_avg_sq, grad, grad_dtype, working,
                      working_dtype, numel);
}

static int fake_sgd_step(void *stream, const zk_sgd_hparams *hp, float *param, float *momentum_buf,
                         const void *grad, zk_dtype grad_dtype, void *working,
                         zk_dtype working_dtype, size_t numel) {
  return zk_sgd_step(NULL, hp, param, momentum_buf, grad, grad_dtype, working, working_dtype,
                     numel);
}

static int fake_cast(void *stream, void *dst, zk_dtype dst_dtype, const void *src,
                     zk_dtype src_dtype, size_t numel) {
  return zk_cast(NULL, dst, dst_dtype, src, src_dtype, numel);
}

/* Device flags and sums accumulate, as the module's contract says. */
static int fake_accumulate(void *stream, float *acc, const void *src, zk_dtype src_dtype,
                           size_t numel, int *nonfinite_dev) {
  int nonfinite = 0;
  int rc = zk_accumulate(NULL, acc, src, src_dtype, numel, &nonfinite);
  if (nonfinite_dev != NULL && nonfinite)
    *nonfinite_dev = 1;
  return rc;
}

static int fake_scale(void *stream, float *x, float factor, size_t numel, int *nonfinite_dev) {
  int nonfinite = 0;
  int rc = zk_scale(NULL, x, factor, numel, &nonfinite);
  if (nonfinite_dev != NULL && nonfinite)
    *nonfinite_dev = 1;
  return rc;
}

static int fake_sumsq(void *stream, const void *x, zk_dtype dtype, size_t numel, double *sum_dev) {
  double sum = 0;
  int rc = zk_sumsq(NULL, x, dtype, numel, &sum);
  *sum_dev += sum;
  return rc;
}

static int fake_quantize(void *stream, const zk_qformat *fmt, const float *x, size_t numel,
                         void *out, size_t out_bytes, int *nonfinite_dev) {
  int nonfinite = 0;
  int rc = zk_quantize(NULL, fmt, x, numel, out, out_bytes, &nonfinite);
  if (nonfinite_dev != NULL && nonfinite)
    *nonfinite_dev = 1;
  return rc;
}

static int fake_dequantize(void *stream, const zk_qformat *fmt, const void *in, size_t in_bytes,
                           float *y, size_t numel) {
  return zk_dequantize(NULL, fmt, in, in_bytes, y, numel);
}

/* ---- streams and events: tokens that order nothing ----------------------- */

static int fake_stream_create(void **stream_out) {
  *stream_out = malloc(1);
  return *stream_out != NULL ? 0 : fail(-ENOMEM, "stream_create");
}

static int fake_free_object(void *object) {
  free(object);
  return 0;
}

static int fake_event_create(void **event_out, int interprocess) {
  *event_out = malloc(1);
  return *event_out != NULL ? 0 : fail(-ENOMEM, "event_create");
}

static int fake_event_record(void *event, void *stream) {
  return event != NULL ? 0 : fail(-EINVAL, "event_record of NULL");
}

static int fake_stream_wait_event(void *stream, void *event) {
  return event != NULL ? 0 : fail(-EINVAL, "stream_wait_event on NULL");
}

/* ---- CUDA IPC across processes ------------------------------------------- */

typedef struct fake_mem_handle {
  int32_t pid;
  int32_t fd;
  uint64_t bytes;
} fake_mem_handle;

static int fake_ipc_mem_handle(void *dev_ptr, void *handle_out) {
  pthread_mutex_lock(&allocations_mutex);
  allocation *a = find_locked(dev_ptr);
  fake_mem_handle h = {
      .pid = (int32_t)getpid(), .fd = a != NULL ? a->fd : -1, .bytes = a != NULL ? a->bytes : 0};
  pthread_mutex_unlock(&allocations_mutex);
  if (a == NULL || a->imported)
    return fail(-EINVAL, "ipc_mem_handle of a pointer that is no allocation's base");
  memset(handle_out, 0, ZK_CUDA_IPC_HANDLE_BYTES);
  memcpy(handle_out, &h, sizeof h);
  return 0;
}

static int fake_ipc_mem_open(const void *handle, void **dev_ptr_out) {
  fake_mem_handle h;
  memcpy(&h, handle, sizeof h);
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)h.pid, (int)h.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0)
    return fail(-errno, "ipc_mem_open");
  struct stat st;
  if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < h.bytes) {
    close(fd);
    return fail(-EINVAL, "ipc_mem_open: the allocation is smaller than the handle says");
  }
  allocation *a = calloc(1, sizeof *a);
  void *base = mmap(NULL, h.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (a == NULL || base == MAP_FAILED) {
    if (base != MAP_FAILED)
      munmap(base, h.bytes);
    free(a);
    return fail(-ENOMEM, "ipc_mem_open");
  }
  a->base = base;
  a->bytes = h.bytes;
  a->fd = -1;
  a->imported = 1;
  pthread_mutex_lock(&allocations_mutex);
  a->next = allocations;
  allocations = a;
  pthread_mutex_unlock(&allocations_mutex);
  *dev_ptr_out = base;
  return 0;
}

static int fake_ipc_mem_close(void *dev_ptr) {
  return release(dev_ptr, 1);
}

static int fake_ipc_event_handle(void *event, void *handle_out) {
  memset(handle_out, 0xe7, ZK_CUDA_IPC_HANDLE_BYTES);
  return 0;
}

static int fake_ipc_event_open(const void *handle, void **event_out) {
  return fake_event_create(event_out, 1);
}

/* ---- NCCL: a one-rank world ---------------------------------------------- */

static int fake_nccl_available(char *why, size_t why_len) {
  snprintf(why, why_len, "fake NCCL (one rank)");
  return 0;
}

static int fake_nccl_unique_id(void *id_out) {
  memset(id_out, 0x11, ZK_NCCL_UNIQUE_ID_BYTES);
  return 0;
}

static int fake_nccl_init(void **comm_out, int world_size, int rank, const void *unique_id) {
  if (world_size != 1)
    return fail(-ENOSYS, "nccl_init: the fake NCCL has one rank only");
  *comm_out = malloc(1);
  return *comm_out != NULL ? 0 : fail(-ENOMEM, "nccl_init");
}

static int fake_nccl_all_gather(void *comm, const void *send, void *recv, size_t bytes_per_rank,
                                void *stream) {
  return fake_copy(recv, send, bytes_per_rank);
}

static int fake_nccl_reduce_scatter_f32(void *comm, const float *send, float *recv,
                                        size_t shard_numel, void *stream) {
  return fake_copy(recv, send, shard_numel * sizeof(float));
}

static int fake_nccl_all_reduce(void *comm, void *buf, size_t count, zk_nccl_dtype dtype,
                                zk_nccl_op op, void *stream) {
  return 0;
}

static int fake_nccl_broadcast(void *comm, void *buf, size_t bytes, int root, void *stream) {
  return 0;
}

static zk_cuda_api fake_api;

static void fill_api(void) {
  fake_api.size = sizeof fake_api;
  fake_api.version = ZK_CUDA_API_VERSION;
  fake_api.device_count = fake_device_count;
  fake_api.device_name = fake_device_name;
  fake_api.set_device = fake_set_device;
  fake_api.alloc = fake_alloc;
  fake_api.free = fake_free;
  fake_api.copy_to_device = fake_copy;
  fake_api.copy_to_host = fake_copy;
  fake_api.copy_device = fake_copy_device;
  fake_api.memset = fake_memset;
  fake_api.synchronize = fake_nothing;
  fake_api.last_error = fake_last_error;
  fake_api.adam_step = fake_adam_step;
  fake_api.sgd_step = fake_sgd_step;
  fake_api.cast = fake_cast;
  fake_api.accumulate = fake_accumulate;
  fake_api.scale = fake_scale;
  fake_api.sumsq = fake_sumsq;
  fake_api.quantize = fake_quantize;
  fake_api.dequantize = fake_dequantize;
  fake_api.get_device = fake_get_device;
  fake_api.stream_create = fake_stream_create;
  fake_api.stream_destroy = fake_free_object;
  fake_api.event_create = fake_event_create;
  fake_api.event_destroy = fake_free_object;
  fake_api.event_record = fake_event_record;
  fake_api.event_query = fake_nothing;
  fake_api.event_synchronize = fake_nothing;
  fake_api.stream_wait_event = fake_stream_wait_event;
  fake_api.copy_to_host_async = fake_copy_async;
  fake_api.copy_to_device_async = fake_copy_async;
  fake_api.memset_async = fake_memset_async;
  fake_api.ipc_mem_handle = fake_ipc_mem_handle;
  fake_api.ipc_mem_open = fake_ipc_mem_open;
  fake_api.ipc_mem_close = fake_ipc_mem_close;
  fake_api.ipc_event_handle = fake_ipc_event_handle;
  fake_api.ipc_event_open = fake_ipc_event_open;
  fake_api.nccl_available = fake_nccl_available;
  fake_api.nccl_unique_id = fake_nccl_unique_id;
  fake_api.nccl_init = fake_nccl_init;
  fake_api.nccl_status = fake_nothing;
  fake_api.nccl_all_gather = fake_nccl_all_gather;
  fake_api.nccl_reduce_scatter_f32 = fake_nccl_reduce_scatter_f32;
  fake_api.nccl_all_reduce = fake_nccl_all_reduce;
  fake_api.nccl_broadcast = fake_nccl_broadcast;
  fake_api.nccl_abort = fake_free_object;
  fake_api.nccl_destroy = fake_free_object;
  fake_api.host_alloc = fake_host_alloc;
  fake_api.host_free = fake_host_free;
}

static pthread_once_t fill_once = PTHREAD_ONCE_INIT;

/* The module's one export, as in kernels/cuda/module.cu. */
EXPORT const zk_cuda_api *zk_cuda_get_api(int version);

EXPORT const zk_cuda_api *zk_cuda_get_api(int version) {
  if (version < 1 || version > ZK_CUDA_API_VERSION)
    return NULL;
  pthread_once(&fill_once, fill_api);
  return &fake_api;
}
