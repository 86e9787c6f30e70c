/* device: where a rank's shards live and its kernels run (docs/architecture.md
 * "Device").
 *
 * Each rank has one device, a small table of operations with two backends:
 * device_host.c (host memory; the CPU drivers of kernels/ on the rank's
 * thread pool, the very calls the executor made before there was a device layer,
 * so host ranks compute the same bits as before) and device_cuda.c (GPU i
 * for local rank i; the CUDA module's entries, enqueued on the rank's own
 * stream). The rank (rank/) holds "device pointers" (host memory for the host backend,
 * GPU memory for CUDA) and never dereferences them: it passes them to these
 * operations and to comm.h, whose backend matches the device (Gloo for the
 * host, NCCL for CUDA).
 *
 * Threads: a device belongs to its rank's executor, which opens it (the
 * CUDA backend makes the rank's GPU current on that thread and creates the
 * stream there) and closes it. Two exceptions: device_read may be called
 * from any thread, and the loop thread may use a host device while the
 * executor is idle (exec.h), which a CUDA device never allows.
 *
 * Ordering: work is enqueued in call order on the rank's stream (the host
 * backend simply runs it). upload and download return when the host memory
 * may be reused or read; everything else may still be running when it
 * returns, until device_sync. Errors are negative errno values; the text
 * of the device's last failure is device_last_error. */
#ifndef ZEROD_DEVICE_H
#define ZEROD_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "cuda/zk_cuda.h"
#include "zk.h"

typedef enum device_kind { DEVICE_HOST = 0, DEVICE_CUDA = 1 } device_kind;

/* A buffer shared with the worker: a gathered unit or a gradient buffer.
 *
 * Host: a sealed memfd region (shm.h), sent to the worker as a descriptor.
 * CUDA: a device allocation exported with a CUDA IPC memory handle, and an
 * interprocess event that orders the buffer between the two processes:
 * whoever finishes using the buffer (the daemon after filling it, the
 * worker after writing a gradient or reading a gathered unit) records the
 * event on its stream, and whoever uses it next makes its stream wait for
 * the event first (device_buffer_wait, and zd_view_stream_wait in
 * libzerod). The requests on the socket order the records and the waits. */
typedef struct device_buffer {
  void *base;   /* host: the daemon's mapping; CUDA: the device pointer */
  size_t bytes; /* host: page-rounded mapping size; CUDA: the allocation */
  int fd;       /* host: the memfd; CUDA: -1 */
  void *event;  /* CUDA: the interprocess event; host: NULL */
  uint8_t mem_handle[ZK_CUDA_IPC_HANDLE_BYTES];
  uint8_t event_handle[ZK_CUDA_IPC_HANDLE_BYTES];
} device_buffer;

typedef struct device device;

typedef struct device_ops {
  void (*close)(device *dev);
  const char *(*last_error)(const device *dev);

  /* Memory. alloc fills with zeros; free accepts NULL. */
  int (*alloc)(device *dev, size_t bytes, void **out);
  void (*free)(device *dev, void *ptr);
  int (*upload)(device *dev, void *dst, const void *src_host, size_t bytes);
  int (*download)(device *dev, void *dst_host, const void *src, size_t bytes);
  /* Any thread, synchronous, ordered after nothing on the rank's stream:
   * the caller makes sure nobody writes src meanwhile (pin.h's rank lock,
   * taken only after the executor synchronised its writes). */
  int (*read)(device *dev, void *dst_host, const void *src, size_t bytes);
  int (*copy)(device *dev, void *dst, const void *src, size_t bytes);
  int (*zero)(device *dev, void *dst, size_t bytes);
  int (*sync)(device *dev);

  /* Shared buffers (see device_buffer). create returns a zero-filled buffer
   * that the worker may use at once; name shows in /proc/<pid>/fd for a
   * memfd. wait makes the rank's stream wait for the worker's last record
   * of the buffer's event; publish records it after the daemon's work. */
  int (*buffer_create)(device *dev, device_buffer *buf, const char *name, size_t bytes);
  void (*buffer_destroy)(device *dev, device_buffer *buf);
  int (*buffer_wait)(device *dev, device_buffer *buf);
  int (*buffer_publish)(device *dev, device_buffer *buf);

  /* Staging for a step that runs on the host while the state it reads and
   * writes is in the device's memory (offload_optimizer on a GPU rank).
   * staging_alloc returns zero-filled host memory the device copies from
   * and to (pinned: page-locked where the device has such memory, so that
   * the copies overlap the host's work); staging_free takes what it
   * returned with the same `pinned`. The _async copies only enqueue on the
   * rank's stream: host memory they read or write is in use until a fence
   * recorded after them has been waited for. A fence is an event: record
   * marks the stream's work so far, wait blocks the calling thread until
   * that work is done. The host device does everything at once. */
  int (*staging_alloc)(device *dev, size_t bytes, int pinned, void **out);
  void (*staging_free)(device *dev, void *ptr, int pinned);
  int (*download_async)(device *dev, void *dst_host, const void *src, size_t bytes);
  int (*upload_async)(device *dev, void *dst, const void *src_host, size_t bytes);
  int (*fence_create)(device *dev, void **out);
  void (*fence_destroy)(device *dev, void *fence);
  int (*fence_record)(device *dev, void *fence);
  int (*fence_wait)(device *dev, void *fence);

  /* Kernels, with zk.h's semantics. sumsq sums the squares of several
   * arrays into one total: begin, add each (in order), end. */
  int (*cast)(device *dev, void *dst, zk_dtype dst_dtype, const void *src, zk_dtype src_dtype,
              size_t numel);
  int (*accumulate)(device *dev, float *acc, const float *src, size_t numel);
  int (*sumsq_begin)(device *dev);
  int (*sumsq_add)(device *dev, const float *x, size_t numel);
  int (*sumsq_end)(device *dev, double *total);
  int (*adam_step)(device *dev, const zk_adam_hparams *hp, float *param, float *exp_avg,
                   float *exp_avg_sq, const float *grad, void *working, zk_dtype working_dtype,
                   size_t numel);
  int (*sgd_step)(device *dev, const zk_sgd_hparams *hp, float *param, float *momentum_buf,
                  const float *grad, void *working, zk_dtype working_dtype, size_t numel);
} device_ops;

struct device {
  const device_ops *ops;
  device_kind kind;
  int ordinal; /* the CUDA device; -1 for the host */
};

/* Opens the host device of a rank, running kernels on `pool` (not owned).
 * Its memory is hostmem's arrays (hostmem.h), so a host rank may take one
 * made elsewhere as its own (a restore's staged values, rank/snapshot.c). */
int device_host_open(zk_pool *pool, device **out);

/* Opens GPU `ordinal` for the calling thread (it becomes the thread's
 * current device) with a stream of its own. Loads the CUDA module. Returns
 * 0 or a negative errno with a message in err. */
int device_cuda_open(int ordinal, device **out, char *err, size_t err_bytes);
/* The module's table and the rank's stream (cudaStream_t), for NCCL. */
const zk_cuda_api *device_cuda_api(const device *dev);
void *device_cuda_stream(const device *dev);

/* ---- Calls through the table ------------------------------------------- */

static inline void device_close(device *dev) {
  if (dev != NULL)
    dev->ops->close(dev);
}
static inline const char *device_last_error(const device *dev) {
  return dev->ops->last_error(dev);
}
static inline int device_is_host(const device *dev) {
  return dev->kind == DEVICE_HOST;
}
static inline int device_alloc(device *dev, size_t bytes, void **out) {
  return dev->ops->alloc(dev, bytes, out);
}
static inline void device_free(device *dev, void *ptr) {
  dev->ops->free(dev, ptr);
}
static inline int device_upload(device *dev, void *dst, const void *src_host, size_t bytes) {
  return dev->ops->upload(dev, dst, src_host, bytes);
}
static inline int device_download(device *dev, void *dst_host, const void *src, size_t bytes) {
  return dev->ops->download(dev, dst_host, src, bytes);
}
static inline int device_read(device *dev, void *dst_host, const void *src, size_t bytes) {
  return dev->ops->read(dev, dst_host, src, bytes);
}
static inline int device_copy(device *dev, void *dst, const void *src, size_t bytes) {
  return dev->ops->copy(dev, dst, src, bytes);
}
static inline int device_zero(device *dev, void *dst, size_t bytes) {
  return dev->ops->zero(dev, dst, bytes);
}
static inline int device_sync(device *dev) {
  return dev->ops->sync(dev);
}
static inline int device_buffer_create(device *dev, device_buffer *buf, const char *name,
                                       size_t bytes) {
  return dev->ops->buffer_create(dev, buf, name, bytes);
}
static inline void device_buffer_destroy(device *dev, device_buffer *buf) {
  dev->ops->buffer_destroy(dev, buf);
}
static inline int device_buffer_wait(device *dev, device_buffer *buf) {
  return dev->ops->buffer_wait(dev, buf);
}
static inline int device_buffer_publish(device *dev, device_buffer *buf) {
  return dev->ops->buffer_publish(dev, buf);
}
static inline int device_staging_alloc(device *dev, size_t bytes, int pinned, void **out) {
  return dev->ops->staging_alloc(dev, bytes, pinned, out);
}
static inline void device_staging_free(device *dev, void *ptr, int pinned) {
  dev->ops->staging_free(dev, ptr, pinned);
}
static inline int device_download_async(device *dev, void *dst_host, const void *src,
                                        size_t bytes) {
  return dev->ops->download_async(dev, dst_host, src, bytes);
}
static inline int device_upload_async(device *dev, void *dst, const void *src_host, size_t bytes) {
  return dev->ops->upload_async(dev, dst, src_host, bytes);
}
static inline int device_fence_create(device *dev, void **out) {
  return dev->ops->fence_create(dev, out);
}
static inline void device_fence_destroy(device *dev, void *fence) {
  dev->ops->fence_destroy(dev, fence);
}
static inline int device_fence_record(device *dev, void *fence) {
  return dev->ops->fence_record(dev, fence);
}
static inline int device_fence_wait(device *dev, void *fence) {
  return dev->ops->fence_wait(dev, fence);
}
static inline int device_cast(device *dev, void *dst, zk_dtype dst_dtype, const void *src,
                              zk_dtype src_dtype, size_t numel) {
  return dev->ops->cast(dev, dst, dst_dtype, src, src_dtype, numel);
}
static inline int device_accumulate(device *dev, float *acc, const float *src, size_t numel) {
  return dev->ops->accumulate(dev, acc, src, numel);
}
static inline int device_sumsq_begin(device *dev) {
  return dev->ops->sumsq_begin(dev);
}
static inline int device_sumsq_add(device *dev, const float *x, size_t numel) {
  return dev->ops->sumsq_add(dev, x, numel);
}
static inline int device_sumsq_end(device *dev, double *total) {
  return dev->ops->sumsq_end(dev, total);
}
static inline int device_adam_step(device *dev, const zk_adam_hparams *hp, float *param,
                                   float *exp_avg, float *exp_avg_sq, const float *grad,
                                   void *working, zk_dtype working_dtype, size_t numel) {
  return dev->ops->adam_step(dev, hp, param, exp_avg, exp_avg_sq, grad, working, working_dtype,
                             numel);
}
static inline int device_sgd_step(device *dev, const zk_sgd_hparams *hp, float *param,
                                  float *momentum_buf, const float *grad, void *working,
                                  zk_dtype working_dtype, size_t numel) {
  return dev->ops->sgd_step(dev, hp, param, momentum_buf, grad, working, working_dtype, numel);
}

#endif /* ZEROD_DEVICE_H */
