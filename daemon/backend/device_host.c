/* The host device (see device.h): shards in host memory, the CPU drivers of
 * kernels/ on the rank's thread pool, gathered and gradient buffers in
 * memfd regions. Every operation is the call the executor made before there was
 * a device layer, so host ranks compute exactly the same bits; nothing is
 * asynchronous, so sync and the buffer events do nothing. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "hostmem.h"
#include "shm.h"

typedef struct host_device {
  device base; /* first: a device * is a host_device * */
  zk_pool *pool;
  double sumsq_total;
  int last_rc; /* the last failure, for device_last_error */
} host_device;

static zk_pool *pool_of(device *dev) {
  return ((host_device *)dev)->pool;
}

static void host_close(device *dev) {
  free(dev);
}

static const char *host_last_error(const device *dev) {
  return strerror(-((const host_device *)dev)->last_rc);
}

/* Keeps a failure (rc < 0) for device_last_error; passes rc through. */
static int host_failed(device *dev, int rc) {
  if (rc != 0)
    ((host_device *)dev)->last_rc = rc;
  return rc;
}

/* hostmem's arrays: cache-line aligned and padded, as the vectorised
 * drivers like them; a restore's staged arrays are the same kind. A mapped
 * array is zero when fresh; the others are zeroed here. */
static int host_alloc(device *dev, size_t bytes, void **out) {
  void *p = hostmem_array_zalloc(bytes);
  if (p == NULL)
    return host_failed(dev, -ENOMEM);
  *out = p;
  return 0;
}

static void host_free(device *dev, void *ptr) {
  hostmem_array_free(ptr);
}

static int host_copy(device *dev, void *dst, const void *src, size_t bytes) {
  memcpy(dst, src, bytes);
  return 0;
}

static int host_zero(device *dev, void *dst, size_t bytes) {
  memset(dst, 0, bytes);
  return 0;
}

static int host_sync(device *dev) {
  return 0;
}

static int host_buffer_create(device *dev, device_buffer *buf, const char *name, size_t bytes) {
  shm_region region;
  int rc = shm_region_create(&region, name, bytes);
  if (rc != 0)
    return host_failed(dev, rc);
  memset(buf, 0, sizeof *buf);
  buf->base = region.base;
  buf->bytes = region.bytes;
  buf->fd = region.fd;
  return 0;
}

static void host_buffer_destroy(device *dev, device_buffer *buf) {
  shm_region region = {.fd = buf->fd, .base = buf->base, .bytes = buf->bytes};
  shm_region_destroy(&region);
  buf->base = NULL;
  buf->fd = -1;
  buf->bytes = 0;
}

static int host_buffer_event(device *dev, device_buffer *buf) {
  return 0;
}

static int host_cast(device *dev, void *dst, zk_dtype dst_dtype, const void *src,
                     zk_dtype src_dtype, size_t numel) {
  return host_failed(dev, zk_cast(pool_of(dev), dst, dst_dtype, src, src_dtype, numel));
}

static int host_accumulate(device *dev, float *acc, const float *src, size_t numel) {
  return host_failed(dev, zk_accumulate(pool_of(dev), acc, src, ZK_F32, numel, NULL));
}

/* Each array's sum is taken on its own and the sums are added in call
 * order, as the executor added them before: the norm keeps its bits. */
static int host_sumsq_begin(device *dev) {
  ((host_device *)dev)->sumsq_total = 0;
  return 0;
}

static int host_sumsq_add(device *dev, const float *x, size_t numel) {
  double s = 0;
  int rc = zk_sumsq(pool_of(dev), x, ZK_F32, numel, &s);
  ((host_device *)dev)->sumsq_total += s;
  return host_failed(dev, rc);
}

static int host_sumsq_end(device *dev, double *total) {
  *total = ((host_device *)dev)->sumsq_total;
  return 0;
}

static int host_adam_step(device *dev, const zk_adam_hparams *hp, float *param, float *exp_avg,
                          float *exp_avg_sq, const float *grad, void *working,
                          zk_dtype working_dtype, size_t numel) {
  return host_failed(dev, zk_adam_step(pool_of(dev), hp, param, exp_avg, exp_avg_sq, grad, ZK_F32,
                                       working, working_dtype, numel));
}

static int host_sgd_step(device *dev, const zk_sgd_hparams *hp, float *param, float *momentum_buf,
                         const float *grad, void *working, zk_dtype working_dtype, size_t numel) {
  return host_failed(dev, zk_sgd_step(pool_of(dev), hp, param, momentum_buf, grad, ZK_F32, working,
                                      working_dtype, numel));
}

/* The host device's memory is its own staging: nothing to pin, copies
 * done at once, fences that are always reached. */
static int host_staging_alloc(device *dev, size_t bytes, int pinned, void **out) {
  (void)pinned;
  return host_alloc(dev, bytes, out);
}

static void host_staging_free(device *dev, void *ptr, int pinned) {
  (void)pinned;
  host_free(dev, ptr);
}

static int host_fence_create(device *dev, void **out) {
  static char fence; /* any non-NULL pointer */
  (void)dev;
  *out = &fence;
  return 0;
}

static void host_fence_destroy(device *dev, void *fence) {
  (void)dev;
  (void)fence;
}

static int host_fence(device *dev, void *fence) {
  (void)dev;
  (void)fence;
  return 0;
}

static const device_ops host_ops = {
    .close = host_close,
    .last_error = host_last_error,
    .alloc = host_alloc,
    .free = host_free,
    .upload = host_copy,
    .download = host_copy,
    .read = host_copy,
    .copy = host_copy,
    .zero = host_zero,
    .sync = host_sync,
    .buffer_create = host_buffer_create,
    .buffer_destroy = host_buffer_destroy,
    .buffer_wait = host_buffer_event,
    .buffer_publish = host_buffer_event,
    .staging_alloc = host_staging_alloc,
    .staging_free = host_staging_free,
    .download_async = host_copy,
    .upload_async = host_copy,
    .fence_create = host_fence_create,
    .fence_destroy = host_fence_destroy,
    .fence_record = host_fence,
    .fence_wait = host_fence,
    .cast = host_cast,
    .accumulate = host_accumulate,
    .sumsq_begin = host_sumsq_begin,
    .sumsq_add = host_sumsq_add,
    .sumsq_end = host_sumsq_end,
    .adam_step = host_adam_step,
    .sgd_step = host_sgd_step,
};

int device_host_open(zk_pool *pool, device **out) {
  host_device *hd = calloc(1, sizeof *hd);
  if (hd == NULL)
    return -ENOMEM;
  hd->base.ops = &host_ops;
  hd->base.kind = DEVICE_HOST;
  hd->base.ordinal = -1;
  hd->pool = pool;
  *out = &hd->base;
  return 0;
}
