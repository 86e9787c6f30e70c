/* libzerod's shared bottom (client_impl.h): the calling thread's last
 * error, dtype names and sizes, releasing fds and mappings, and the CUDA
 * module, loaded the first time a GPU buffer arrives. */
#include "client_impl.h"

/* ------------------------------------------------------------------------
 * Errors
 * ------------------------------------------------------------------------ */

/* The detail of the calling thread's last failed call. Thread-local so that
 * workers with one client per thread never see each other's messages. */
static _Thread_local char last_error_text[LAST_ERROR_BYTES];

static zd_status set_error_v(zd_status status, const char *format, va_list args) {
  /* Format into a scratch buffer first: the arguments may point into
   * last_error_text itself (a message being prefixed). */
  char text[LAST_ERROR_BYTES];
  vsnprintf(text, sizeof text, format, args);
  memcpy(last_error_text, text, sizeof text);
  return status;
}

zd_status client__set_error(zd_status status, const char *format, ...) {
  va_list args;
  va_start(args, format);
  set_error_v(status, format, args);
  va_end(args);
  return status;
}

void client__restore_error(const char *saved) {
  snprintf(last_error_text, sizeof last_error_text, "%s", saved);
}

const char *zd_last_error(void) {
  return last_error_text;
}

/* ------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------ */

size_t client__dtype_bytes(zd_dtype dtype) {
  return dtype == ZD_F32 ? 4 : 2;
}

const char *client__dtype_name(zd_dtype dtype) {
  switch (dtype) {
  case ZD_F32:
    return "f32";
  case ZD_BF16:
    return "bf16";
  case ZD_F16:
    return "f16";
  }
  return "?";
}

/* A protocol dtype as a zd_dtype; unspecified means fp32, the default. */
int client__dtype_from_proto(int proto_dtype, zd_dtype *out) {
  switch (proto_dtype) {
  case ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED:
  case ZEROD__V1__DTYPE__DTYPE_F32:
    *out = ZD_F32;
    return 0;
  case ZEROD__V1__DTYPE__DTYPE_BF16:
    *out = ZD_BF16;
    return 0;
  case ZEROD__V1__DTYPE__DTYPE_F16:
    *out = ZD_F16;
    return 0;
  default:
    return -1;
  }
}

/* bytes rounded up to whole pages (at least one). */
uint64_t client__page_round(uint64_t bytes) {
  long page_size = sysconf(_SC_PAGESIZE);
  uint64_t page = page_size > 0 ? (uint64_t)page_size : 4096;
  return bytes == 0 ? page : (bytes + page - 1) / page * page;
}

void client__close_fds(int *fds, unsigned nfds) {
  for (unsigned i = 0; i < nfds; i++) {
    if (fds[i] >= 0)
      close(fds[i]);
    fds[i] = -1;
  }
}

/* The CUDA module, loaded when the first GPU buffer arrives (and cached
 * by the loader: later calls are cheap). NULL with a reason in why where it
 * cannot be loaded. */
const zk_cuda_api *client__cuda_api(char *why, size_t why_bytes) {
  const zk_cuda_api *api = NULL;
  zk_cuda_load(&api, why, why_bytes);
  return api;
}

/* Unmaps a buffer and closes its kept descriptor, if any; a GPU buffer's
 * event and memory handle are closed (the module is loaded: it opened
 * them). */
void client__mapping_free(buffer_mapping *mapping) {
  if (mapping->device >= 0) {
    const zk_cuda_api *api = client__cuda_api(NULL, 0);
    if (api != NULL && mapping->event != NULL)
      api->event_destroy(mapping->event);
    if (api != NULL && mapping->base != NULL)
      api->ipc_mem_close(mapping->base);
  } else if (mapping->base != NULL) {
    munmap(mapping->base, mapping->bytes);
  }
  if (mapping->fd >= 0)
    close(mapping->fd);
  mapping->base = NULL;
  mapping->event = NULL;
  mapping->fd = -1;
}
