/* The CUDA device (see device.h): a rank's shards in the memory of GPU i,
 * its kernels on a stream of its own, and gathered and gradient buffers
 * exported to workers with CUDA IPC.
 *
 * Everything goes through the CUDA module's table (kernels/cuda/zk_cuda.h),
 * so this file is plain C and zerod links nothing from CUDA: the module is
 * loaded when the first CUDA device is opened, which only a daemon started
 * with --device cuda does.
 *
 * Values the step needs on the host (the sum of squares of the gradients)
 * are accumulated in a small device scratch and copied back once, after
 * every launch that adds to them. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "hostmem.h"

typedef struct cuda_device {
  device base; /* first: a device * is a cuda_device * */
  const zk_cuda_api *api;
  void *stream;      /* cudaStream_t, non-blocking: no implicit sync with stream 0 */
  double *sumsq_dev; /* one double on the device */
  char last_error[512];
} cuda_device;

static cuda_device *cuda_of(device *dev) {
  return (cuda_device *)dev;
}

/* Keeps the module's description of a failure with what was being done;
 * the module's own text is per thread and overwritten by its next failure. */
static int failed(cuda_device *cd, const char *what, int rc) {
  snprintf(cd->last_error, sizeof cd->last_error, "GPU %d: %s: %s", cd->base.ordinal, what,
           cd->api->last_error());
  return rc;
}

#define CUDA_GOTO(cd, what, call, label)                                                           \
  do {                                                                                             \
    rc = (call);                                                                                   \
    if (rc != 0) {                                                                                 \
      failed((cd), (what), rc);                                                                    \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

#define CUDA_TRY(cd, what, call)                                                                   \
  do {                                                                                             \
    int cuda_rc_ = (call);                                                                         \
    if (cuda_rc_ != 0)                                                                             \
      return failed((cd), (what), cuda_rc_);                                                       \
  } while (0)

static void cuda_close(device *dev) {
  cuda_device *cd = cuda_of(dev);
  if (cd->stream != NULL)
    cd->api->synchronize(cd->stream);
  cd->api->free(cd->sumsq_dev);
  if (cd->stream != NULL)
    cd->api->stream_destroy(cd->stream);
  free(cd);
}

static const char *cuda_last_error(const device *dev) {
  return ((const cuda_device *)dev)->last_error;
}

static int cuda_alloc(device *dev, size_t bytes, void **out) {
  cuda_device *cd = cuda_of(dev);
  void *p = NULL;
  /* cudaMalloc of 0 bytes returns NULL, which reads as "no array". */
  CUDA_TRY(cd, "alloc", cd->api->alloc(&p, bytes == 0 ? 16 : bytes));
  int rc = cd->api->memset_async(p, 0, bytes == 0 ? 16 : bytes, cd->stream);
  if (rc != 0) {
    failed(cd, "memset", rc);
    cd->api->free(p);
    return rc;
  }
  *out = p;
  return 0;
}

static void cuda_free(device *dev, void *ptr) {
  if (ptr != NULL)
    cuda_of(dev)->api->free(ptr);
}

/* The host side may be pageable memory, which an asynchronous copy reads
 * or writes later: wait, so the caller may reuse or read it at once. */
static int cuda_upload(device *dev, void *dst, const void *src_host, size_t bytes) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "copy to device", cd->api->copy_to_device_async(dst, src_host, bytes, cd->stream));
  CUDA_TRY(cd, "copy to device", cd->api->synchronize(cd->stream));
  return 0;
}

static int cuda_download(device *dev, void *dst_host, const void *src, size_t bytes) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "copy to host", cd->api->copy_to_host_async(dst_host, src, bytes, cd->stream));
  CUDA_TRY(cd, "copy to host", cd->api->synchronize(cd->stream));
  return 0;
}

/* From a reader's thread: the rank's GPU becomes that thread's current
 * device (harmless for a threadpool thread), and the copy runs on the
 * legacy default stream, which does not wait for the rank's non-blocking
 * stream. The caller holds the rank lock, and the executor synchronises
 * before it lets go of it, so the values are complete. The module keeps
 * this thread's error text; the device's is the executor's alone. */
static int cuda_read(device *dev, void *dst_host, const void *src, size_t bytes) {
  cuda_device *cd = cuda_of(dev);
  int rc = cd->api->set_device(cd->base.ordinal);
  return rc != 0 ? rc : cd->api->copy_to_host(dst_host, src, bytes);
}

static int cuda_copy(device *dev, void *dst, const void *src, size_t bytes) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "copy on device", cd->api->copy_device(dst, src, bytes, cd->stream));
  return 0;
}

static int cuda_zero(device *dev, void *dst, size_t bytes) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "memset", cd->api->memset_async(dst, 0, bytes, cd->stream));
  return 0;
}

static int cuda_sync(device *dev) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "synchronize", cd->api->synchronize(cd->stream));
  return 0;
}

static void cuda_buffer_destroy(device *dev, device_buffer *buf) {
  cuda_device *cd = cuda_of(dev);
  if (buf->event != NULL)
    cd->api->event_destroy(buf->event);
  if (buf->base != NULL)
    cd->api->free(buf->base);
  memset(buf, 0, sizeof *buf);
  buf->fd = -1;
}

/* The zeros are written and the event recorded before the handles go out:
 * a worker that waits for the event (or one that does not) finds a
 * zero-filled buffer, like a fresh memfd. */
static int cuda_buffer_create(device *dev, device_buffer *buf, const char *name, size_t bytes) {
  cuda_device *cd = cuda_of(dev);
  const zk_cuda_api *api = cd->api;
  int rc;
  memset(buf, 0, sizeof *buf);
  buf->fd = -1;
  CUDA_GOTO(cd, "alloc", api->alloc(&buf->base, bytes), fail);
  buf->bytes = bytes;
  CUDA_GOTO(cd, "memset", api->memset_async(buf->base, 0, bytes, cd->stream), fail);
  CUDA_GOTO(cd, "event", api->event_create(&buf->event, 1), fail);
  CUDA_GOTO(cd, "event record", api->event_record(buf->event, cd->stream), fail);
  CUDA_GOTO(cd, "IPC memory handle", api->ipc_mem_handle(buf->base, buf->mem_handle), fail);
  CUDA_GOTO(cd, "IPC event handle", api->ipc_event_handle(buf->event, buf->event_handle), fail);
  CUDA_GOTO(cd, "synchronize", api->synchronize(cd->stream), fail);
  return 0;
fail:
  cuda_buffer_destroy(dev, buf);
  return rc;
}

static int cuda_buffer_wait(device *dev, device_buffer *buf) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "wait for the worker's event", cd->api->stream_wait_event(cd->stream, buf->event));
  return 0;
}

static int cuda_buffer_publish(device *dev, device_buffer *buf) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "record the buffer's event", cd->api->event_record(buf->event, cd->stream));
  return 0;
}

static int cuda_cast(device *dev, void *dst, zk_dtype dst_dtype, const void *src,
                     zk_dtype src_dtype, size_t numel) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "cast", cd->api->cast(cd->stream, dst, dst_dtype, src, src_dtype, numel));
  return 0;
}

static int cuda_accumulate(device *dev, float *acc, const float *src, size_t numel) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "accumulate", cd->api->accumulate(cd->stream, acc, src, ZK_F32, numel, NULL));
  return 0;
}

static int cuda_sumsq_begin(device *dev) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "sum of squares",
           cd->api->memset_async(cd->sumsq_dev, 0, sizeof *cd->sumsq_dev, cd->stream));
  return 0;
}

static int cuda_sumsq_add(device *dev, const float *x, size_t numel) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "sum of squares", cd->api->sumsq(cd->stream, x, ZK_F32, numel, cd->sumsq_dev));
  return 0;
}

static int cuda_sumsq_end(device *dev, double *total) {
  return cuda_download(dev, total, cuda_of(dev)->sumsq_dev, sizeof *total);
}

static int cuda_adam_step(device *dev, const zk_adam_hparams *hp, float *param, float *exp_avg,
                          float *exp_avg_sq, const float *grad, void *working,
                          zk_dtype working_dtype, size_t numel) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "adam step",
           cd->api->adam_step(cd->stream, hp, param, exp_avg, exp_avg_sq, grad, ZK_F32, working,
                              working_dtype, numel));
  return 0;
}

static int cuda_sgd_step(device *dev, const zk_sgd_hparams *hp, float *param, float *momentum_buf,
                         const float *grad, void *working, zk_dtype working_dtype, size_t numel) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "sgd step",
           cd->api->sgd_step(cd->stream, hp, param, momentum_buf, grad, ZK_F32, working,
                             working_dtype, numel));
  return 0;
}

/* Page-locked when asked (the module's host_alloc), so the copies from and
 * to it run on the copy engines while the host works; hostmem's arrays
 * otherwise, which an asynchronous copy reads and writes through CUDA's
 * own staging (correct; the host waits for it). */
static int cuda_staging_alloc(device *dev, size_t bytes, int pinned, void **out) {
  cuda_device *cd = cuda_of(dev);
  if (pinned) {
    CUDA_TRY(cd, "page-locked host memory", cd->api->host_alloc(out, bytes));
    return 0;
  }
  *out = hostmem_array_zalloc(bytes);
  if (*out == NULL) {
    snprintf(cd->last_error, sizeof cd->last_error, "out of host memory (%zu bytes)", bytes);
    return -ENOMEM;
  }
  return 0;
}

static void cuda_staging_free(device *dev, void *ptr, int pinned) {
  if (ptr == NULL)
    return;
  if (pinned)
    cuda_of(dev)->api->host_free(ptr);
  else
    hostmem_array_free(ptr);
}

static int cuda_download_async(device *dev, void *dst_host, const void *src, size_t bytes) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "copy to host", cd->api->copy_to_host_async(dst_host, src, bytes, cd->stream));
  return 0;
}

static int cuda_upload_async(device *dev, void *dst, const void *src_host, size_t bytes) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "copy to device", cd->api->copy_to_device_async(dst, src_host, bytes, cd->stream));
  return 0;
}

static int cuda_fence_create(device *dev, void **out) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "event create", cd->api->event_create(out, 0));
  return 0;
}

static void cuda_fence_destroy(device *dev, void *fence) {
  if (fence != NULL)
    cuda_of(dev)->api->event_destroy(fence);
}

static int cuda_fence_record(device *dev, void *fence) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "event record", cd->api->event_record(fence, cd->stream));
  return 0;
}

static int cuda_fence_wait(device *dev, void *fence) {
  cuda_device *cd = cuda_of(dev);
  CUDA_TRY(cd, "event synchronize", cd->api->event_synchronize(fence));
  return 0;
}

static const device_ops cuda_ops = {
    .close = cuda_close,
    .last_error = cuda_last_error,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .read = cuda_read,
    .copy = cuda_copy,
    .zero = cuda_zero,
    .sync = cuda_sync,
    .buffer_create = cuda_buffer_create,
    .buffer_destroy = cuda_buffer_destroy,
    .buffer_wait = cuda_buffer_wait,
    .buffer_publish = cuda_buffer_publish,
    .staging_alloc = cuda_staging_alloc,
    .staging_free = cuda_staging_free,
    .download_async = cuda_download_async,
    .upload_async = cuda_upload_async,
    .fence_create = cuda_fence_create,
    .fence_destroy = cuda_fence_destroy,
    .fence_record = cuda_fence_record,
    .fence_wait = cuda_fence_wait,
    .cast = cuda_cast,
    .accumulate = cuda_accumulate,
    .sumsq_begin = cuda_sumsq_begin,
    .sumsq_add = cuda_sumsq_add,
    .sumsq_end = cuda_sumsq_end,
    .adam_step = cuda_adam_step,
    .sgd_step = cuda_sgd_step,
};

int device_cuda_open(int ordinal, device **out, char *err, size_t err_bytes) {
  const zk_cuda_api *api = NULL;
  char why[512] = "";
  int rc = zk_cuda_load(&api, why, sizeof why);
  if (rc != 0) {
    snprintf(err, err_bytes, "GPU %d: %s", ordinal, why);
    return rc;
  }
  cuda_device *cd = calloc(1, sizeof *cd);
  if (cd == NULL) {
    snprintf(err, err_bytes, "out of memory");
    return -ENOMEM;
  }
  cd->base.ops = &cuda_ops;
  cd->base.kind = DEVICE_CUDA;
  cd->base.ordinal = ordinal;
  cd->api = api;
  CUDA_GOTO(cd, "set device", api->set_device(ordinal), fail);
  CUDA_GOTO(cd, "stream", api->stream_create(&cd->stream), fail);
  CUDA_GOTO(cd, "alloc", api->alloc((void **)&cd->sumsq_dev, sizeof *cd->sumsq_dev), fail);
  *out = &cd->base;
  return 0;
fail:
  snprintf(err, err_bytes, "%s", cd->last_error);
  cuda_close(&cd->base);
  return rc;
}

const zk_cuda_api *device_cuda_api(const device *dev) {
  return dev->kind == DEVICE_CUDA ? ((const cuda_device *)dev)->api : NULL;
}

void *device_cuda_stream(const device *dev) {
  return dev->kind == DEVICE_CUDA ? ((const cuda_device *)dev)->stream : NULL;
}
