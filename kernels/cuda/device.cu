/* device.cu - the version 2 device entries of libzerod_cuda.so: the current
 * device, streams, events, asynchronous copies and CUDA IPC, the pieces of
 * the daemon's CUDA device backend and of the ordering between the daemon
 * and its workers (docs/architecture.md).
 *
 * Thin wrappers: each checks what the runtime would not report clearly (a
 * NULL out-parameter, an empty copy), makes one runtime call and turns a
 * failure into a negative errno and the thread's last error (zkc_fail).
 * Streams, events and IPC handles cross the table as opaque pointers and
 * byte arrays, so that callers in C need no CUDA header.
 */
#include <string.h>

#include "internal.h"

/* The table promises a fixed handle size; the runtime's types must match
 * it, or an exported handle would be cut or overrun. */
static_assert(sizeof(cudaIpcMemHandle_t) == ZK_CUDA_IPC_HANDLE_BYTES,
              "cudaIpcMemHandle_t is not ZK_CUDA_IPC_HANDLE_BYTES");
static_assert(sizeof(cudaIpcEventHandle_t) == ZK_CUDA_IPC_HANDLE_BYTES,
              "cudaIpcEventHandle_t is not ZK_CUDA_IPC_HANDLE_BYTES");

static cudaStream_t as_stream(void *stream) {
  return static_cast<cudaStream_t>(stream);
}

static cudaEvent_t as_event(void *event) {
  return static_cast<cudaEvent_t>(event);
}

/* ---- devices and streams ------------------------------------------------ */

int zkc_get_device(int *device_out) {
  if (device_out == NULL)
    return zkc_fail_text(-EINVAL, "get_device: device_out is NULL");
  ZKC_CHECK(cudaGetDevice(device_out));
  return 0;
}

/* Non-blocking: the legacy default stream would otherwise serialise with
 * every stream of the process, the workers' copies included. */
int zkc_stream_create(void **stream_out) {
  if (stream_out == NULL)
    return zkc_fail_text(-EINVAL, "stream_create: stream_out is NULL");
  *stream_out = NULL;
  cudaStream_t stream;
  ZKC_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  *stream_out = stream;
  return 0;
}

int zkc_stream_destroy(void *stream) {
  /* The default stream is not ours to destroy. */
  if (stream == NULL)
    return zkc_fail_text(-EINVAL, "stream_destroy: the default stream cannot be destroyed");
  ZKC_CHECK(cudaStreamDestroy(as_stream(stream)));
  return 0;
}

/* ---- events ------------------------------------------------------------- */

/* No event times anything: cudaEventDisableTiming makes record and wait
 * cheaper, and CUDA requires it of interprocess events. */
int zkc_event_create(void **event_out, int interprocess) {
  if (event_out == NULL)
    return zkc_fail_text(-EINVAL, "event_create: event_out is NULL");
  *event_out = NULL;
  unsigned flags = cudaEventDisableTiming;
  if (interprocess)
    flags |= cudaEventInterprocess;
  cudaEvent_t event;
  ZKC_CHECK(cudaEventCreateWithFlags(&event, flags));
  *event_out = event;
  return 0;
}

int zkc_event_destroy(void *event) {
  if (event == NULL)
    return 0;
  ZKC_CHECK(cudaEventDestroy(as_event(event)));
  return 0;
}

int zkc_event_record(void *event, void *stream) {
  if (event == NULL)
    return zkc_fail_text(-EINVAL, "event_record: event is NULL");
  ZKC_CHECK(cudaEventRecord(as_event(event), as_stream(stream)));
  return 0;
}

int zkc_event_query(void *event) {
  if (event == NULL)
    return zkc_fail_text(-EINVAL, "event_query: event is NULL");
  cudaError_t err = cudaEventQuery(as_event(event));
  if (err == cudaErrorNotReady) {
    /* "Not yet" is an answer, not a failure: if the runtime kept it as the
     * thread's last error, the next launch check would report it. */
    if (cudaPeekAtLastError() == cudaErrorNotReady)
      (void)cudaGetLastError();
    return -EAGAIN;
  }
  if (err != cudaSuccess)
    return zkc_fail(err, "cudaEventQuery");
  return 0;
}

int zkc_event_synchronize(void *event) {
  if (event == NULL)
    return zkc_fail_text(-EINVAL, "event_synchronize: event is NULL");
  ZKC_CHECK(cudaEventSynchronize(as_event(event)));
  return 0;
}

int zkc_stream_wait_event(void *stream, void *event) {
  if (event == NULL)
    return zkc_fail_text(-EINVAL, "stream_wait_event: event is NULL");
  ZKC_CHECK(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0));
  return 0;
}

/* ---- asynchronous copies ------------------------------------------------ */

/* From or to pageable host memory these are only asynchronous with respect
 * to the host up to a staging buffer; from pinned memory (the daemon's
 * shared buffers, once registered) they are fully so. */
int zkc_copy_to_host_async(void *dst_host, const void *src_dev, size_t bytes, void *stream) {
  if (bytes == 0)
    return 0;
  if (dst_host == NULL || src_dev == NULL)
    return zkc_fail_text(-EINVAL, "copy_to_host_async: NULL buffer");
  ZKC_CHECK(cudaMemcpyAsync(dst_host, src_dev, bytes, cudaMemcpyDeviceToHost, as_stream(stream)));
  return 0;
}

int zkc_copy_to_device_async(void *dst_dev, const void *src_host, size_t bytes, void *stream) {
  if (bytes == 0)
    return 0;
  if (dst_dev == NULL || src_host == NULL)
    return zkc_fail_text(-EINVAL, "copy_to_device_async: NULL buffer");
  ZKC_CHECK(cudaMemcpyAsync(dst_dev, src_host, bytes, cudaMemcpyHostToDevice, as_stream(stream)));
  return 0;
}

/* ---- page-locked host memory -------------------------------------------- */

int zkc_host_alloc(void **ptr_out, size_t bytes) {
  if (ptr_out == NULL)
    return zkc_fail_text(-EINVAL, "host_alloc: NULL output");
  *ptr_out = NULL;
  void *p = NULL;
  ZKC_CHECK(cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable));
  memset(p, 0, bytes);
  *ptr_out = p;
  return 0;
}

int zkc_host_free(void *ptr) {
  if (ptr != NULL)
    ZKC_CHECK(cudaFreeHost(ptr));
  return 0;
}

int zkc_memset_async(void *dst_dev, int value, size_t bytes, void *stream) {
  if (bytes == 0)
    return 0;
  if (dst_dev == NULL)
    return zkc_fail_text(-EINVAL, "memset_async: NULL buffer");
  ZKC_CHECK(cudaMemsetAsync(dst_dev, value, bytes, as_stream(stream)));
  return 0;
}

/* ---- CUDA IPC ------------------------------------------------------------ */

int zkc_ipc_mem_handle(void *dev_ptr, void *handle_out) {
  if (dev_ptr == NULL || handle_out == NULL)
    return zkc_fail_text(-EINVAL, "ipc_mem_handle: NULL pointer");
  cudaIpcMemHandle_t handle;
  ZKC_CHECK(cudaIpcGetMemHandle(&handle, dev_ptr));
  memcpy(handle_out, &handle, sizeof handle);
  return 0;
}

/* Lazy peer access: a handle exported from another device of the node is
 * mapped with peer access enabled, one from this device costs nothing. */
int zkc_ipc_mem_open(const void *handle, void **dev_ptr_out) {
  if (handle == NULL || dev_ptr_out == NULL)
    return zkc_fail_text(-EINVAL, "ipc_mem_open: NULL pointer");
  *dev_ptr_out = NULL;
  cudaIpcMemHandle_t mem_handle;
  memcpy(&mem_handle, handle, sizeof mem_handle);
  ZKC_CHECK(cudaIpcOpenMemHandle(dev_ptr_out, mem_handle, cudaIpcMemLazyEnablePeerAccess));
  return 0;
}

int zkc_ipc_mem_close(void *dev_ptr) {
  if (dev_ptr == NULL)
    return zkc_fail_text(-EINVAL, "ipc_mem_close: NULL pointer");
  ZKC_CHECK(cudaIpcCloseMemHandle(dev_ptr));
  return 0;
}

int zkc_ipc_event_handle(void *event, void *handle_out) {
  if (event == NULL || handle_out == NULL)
    return zkc_fail_text(-EINVAL, "ipc_event_handle: NULL pointer");
  cudaIpcEventHandle_t handle;
  ZKC_CHECK(cudaIpcGetEventHandle(&handle, as_event(event)));
  memcpy(handle_out, &handle, sizeof handle);
  return 0;
}

int zkc_ipc_event_open(const void *handle, void **event_out) {
  if (handle == NULL || event_out == NULL)
    return zkc_fail_text(-EINVAL, "ipc_event_open: NULL pointer");
  *event_out = NULL;
  cudaIpcEventHandle_t event_handle;
  memcpy(&event_handle, handle, sizeof event_handle);
  cudaEvent_t event;
  ZKC_CHECK(cudaIpcOpenEventHandle(&event, event_handle));
  *event_out = event;
  return 0;
}
