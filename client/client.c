/* libzerod: the client side of the local IPC protocol (client/include/zerod.h),
 * in several files (client_impl.h says which owns what); this one has
 * connect and close, at the top: zd_close detaches the jobs left attached.
 *
 * The library owns one worker's connection to its node daemon: the blocking
 * Unix socket, the request ids and the matching of replies to them (replies
 * may come back out of order), the replies read early for someone else (the
 * stash), the errors of requests sent without a reply (deferred errors), the
 * shared-memory mappings of gathered and gradient buffers (cached by buffer
 * id until the daemon lists the buffer as dropped), the per-unit tensor
 * tables that views point into, and, for jobs attached with
 * stable_addresses, one reserved address range per unit that each gather
 * maps the unit's buffer into. A daemon whose ranks live on GPUs
 * (zerod --device cuda) sends CUDA IPC handles instead of descriptors: the
 * library then loads the CUDA module (kernels/cuda/zk_cuda.h, the first
 * time such a buffer arrives, so a CPU-only worker never touches CUDA),
 * opens the handles once and caches them by buffer id like a mapping.
 * Nothing here blocks except to wait for the
 * daemon, and nothing here trusts the daemon: a frame that does not decode,
 * a reply of the wrong type, or a buffer without a descriptor closes the
 * connection with ZD_E_PROTOCOL instead of crashing the worker.
 *
 * Once the connection is lost (end of stream, a protocol error, or the
 * daemon's shutdown notice) the client is "dead": every later call fails at
 * once with ZD_E_UNAVAILABLE and the reason, and the mappings stay valid
 * until zd_close so that views held by the worker never dangle. */
#include "client_impl.h"
#include "paths.h"

/* ------------------------------------------------------------------------
 * Connect and close
 * ------------------------------------------------------------------------ */

/* Where zd_default_socket looked, for the connect error (per thread). */
static _Thread_local char default_tried[ZPATH_CANDIDATES * (ZPATH_MAX + 2)];

const char *zd_default_socket(void) {
  static _Thread_local char found[ZPATH_MAX];
  const char *path = getenv("ZEROD_SOCKET");
  if (path != NULL && path[0] != '\0') {
    snprintf(default_tried, sizeof default_tried, "%s ($ZEROD_SOCKET)", path);
    return path;
  }
  zpath_find("zerod.sock", found, sizeof found, default_tried, sizeof default_tried);
  return found;
}

/* The connect error: where the socket was and, for the default, where
 * else a daemon was looked for and how to start or name one. */
static zd_status connect_failed(const char *socket_path, int defaulted, int err) {
  if (!defaulted)
    return client__set_error(ZD_E_UNAVAILABLE,
                             "cannot connect to zerod at %s: %s (is the daemon running? start it "
                             "with `zerod standalone --dir DIR` and connect to DIR/zerod.sock)",
                             socket_path, strerror(err));
  return client__set_error(ZD_E_UNAVAILABLE,
                           "cannot connect to zerod: no daemon answers at %s (looked at: %s); "
                           "start one with `zerod standalone`, or name its socket with "
                           "ZEROD_SOCKET",
                           socket_path, default_tried);
}

zd_status zd_connect(const char *socket_path, zd_client **out) {
  if (out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "connect: out is NULL");
  *out = NULL;
  int defaulted = socket_path == NULL;
  if (defaulted)
    socket_path = zd_default_socket();
  struct sockaddr_un address = {.sun_family = AF_UNIX};
  size_t path_bytes = strlen(socket_path);
  if (path_bytes == 0 || path_bytes >= sizeof address.sun_path)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "connect: socket path must be 1..%zu bytes, got %zu (\"%.64s\")",
                             sizeof address.sun_path - 1, path_bytes, socket_path);
  memcpy(address.sun_path, socket_path, path_bytes + 1);

  zd_client *client = calloc(1, sizeof *client);
  if (client == NULL)
    return client__set_error(ZD_E_NOMEM, "connect: out of memory");
  client->sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (client->sock < 0) {
    int err = errno;
    free(client);
    return client__set_error(ZD_E_IO, "connect: socket(AF_UNIX): %s", strerror(err));
  }
  int rc;
  do {
    rc = connect(client->sock, (const struct sockaddr *)&address, sizeof address);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int err = errno;
    close(client->sock);
    free(client);
    return connect_failed(socket_path, defaulted, err);
  }
  client->next_request_id = 1;
  zd_frame_reader_init(&client->reader);
  *out = client;
  return ZD_OK;
}

void zd_close(zd_client *client) {
  if (client == NULL)
    return;
  /* Detaching is a courtesy to the daemon (it would notice the closed
   * socket anyway), so its errors are dropped, and the thread's last error
   * is left as the caller's last failed call set it. */
  char saved_error[LAST_ERROR_BYTES];
  snprintf(saved_error, sizeof saved_error, "%s", zd_last_error());
  for (zd_job *job = client->jobs; job != NULL; job = job->next) {
    if (job->attached && !client->dead)
      zd_detach(job);
  }
  client__restore_error(saved_error);

  client__conn_close(client);
  for (size_t i = 0; i < client->mapping_count; i++)
    client__mapping_free(&client->mappings[i]);
  free(client->mappings);
  zd_job *job = client->jobs;
  while (job != NULL) {
    zd_job *next = job->next;
    client__job_free(job);
    job = next;
  }
  free(client);
}
