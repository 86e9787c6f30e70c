/* libzerod: the client side of the local IPC protocol (client/include/zerod.h),
 * in four files (client_impl.h says which owns what); this one has the
 * connection, connect, close and attach.
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

/* ------------------------------------------------------------------------
 * Connection state
 * ------------------------------------------------------------------------ */

static void stash_free_all(zd_client *client) {
  stashed_frame *frame = client->stash_head;
  while (frame != NULL) {
    stashed_frame *next = frame->next;
    client__close_fds(frame->fds, frame->nfds);
    free(frame->payload);
    free(frame);
    frame = next;
  }
  client->stash_head = NULL;
}

/* Marks the connection lost: the socket is closed at once (a half-read
 * stream cannot be resynchronised), replies read early are dropped, and
 * every later call fails with ZD_E_UNAVAILABLE and this reason. Mappings
 * stay until zd_close because the worker may still hold views. */
static void client_mark_dead(zd_client *client, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

static void client_mark_dead(zd_client *client, const char *format, ...) {
  if (client->dead)
    return;
  va_list args;
  va_start(args, format);
  vsnprintf(client->dead_reason, sizeof client->dead_reason, format, args);
  va_end(args);
  client->dead = 1;
  if (client->sock >= 0)
    close(client->sock);
  client->sock = -1;
  zd_frame_reader_reset(&client->reader);
  stash_free_all(client);
  client->expected_count = 0;
  for (zd_job *job = client->jobs; job != NULL; job = job->next)
    job->attached = 0;
}

static zd_status client_dead_error(const zd_client *client, const char *what) {
  return client__set_error(client->dead_status != ZD_OK ? client->dead_status : ZD_E_UNAVAILABLE,
                           "%s: %s", what, client->dead_reason);
}

/* A notice that ends the session: the daemon shutting down (UNAVAILABLE),
 * or refusing the connection (RESOURCE_EXHAUSTED: --max-sessions). */
static void client_mark_dead_by_notice(zd_client *client, int proto_status, const char *message) {
  if (proto_status == ZEROD__V1__STATUS__STATUS_UNAVAILABLE) {
    client_mark_dead(client, "daemon is shutting down: %s", message);
  } else {
    client_mark_dead(client, "zerod refused the session: %s", message);
    client->dead_status = client__status_from_wire(proto_status);
  }
}

/* Makes room for one more expected id before the request goes out, so that
 * a request on the wire always has its slot (no failure after sending). */
static int expected_reserve(zd_client *client) {
  if (client->expected_count < client->expected_capacity)
    return 0;
  size_t capacity = client->expected_capacity ? client->expected_capacity * 2 : 16;
  uint64_t *ids = realloc(client->expected_ids, capacity * sizeof *ids);
  if (ids == NULL)
    return -1;
  client->expected_ids = ids;
  client->expected_capacity = capacity;
  return 0;
}

int client__expected_find(const zd_client *client, uint64_t request_id) {
  for (size_t i = 0; i < client->expected_count; i++) {
    if (client->expected_ids[i] == request_id)
      return (int)i;
  }
  return -1;
}

static void expected_remove(zd_client *client, uint64_t request_id) {
  int index = client__expected_find(client, request_id);
  if (index >= 0)
    client->expected_ids[index] = client->expected_ids[--client->expected_count];
}

/* The daemon's shutdown notice (or its refusal of the connection) usually
 * sits in the receive queue when a send fails because the daemon closed
 * its end, and it says far more than "connection closed". This reads what
 * is left without blocking and returns the notice's status (0: none) and
 * message. */
static int drain_for_notice(zd_client *client, char *message, size_t message_bytes) {
  int found = 0;
  int flags = fcntl(client->sock, F_GETFL);
  if (flags < 0 || fcntl(client->sock, F_SETFL, flags | O_NONBLOCK) < 0)
    return 0;
  for (int frames = 0; frames < 64 && !found; frames++) {
    const char *why = NULL;
    if (zd_frame_read(&client->reader, client->sock, &why) != 1)
      break;
    zd_frame_header header;
    uint8_t *payload;
    int fds[ZD_FRAME_MAX_FDS];
    unsigned nfds;
    zd_frame_reader_take(&client->reader, &header, &payload, fds, &nfds);
    client__close_fds(fds, nfds);
    ProtobufCMessage *decoded = NULL;
    if (header.type == ZEROD__V1__MSG_TYPE__MSG_NOTICE &&
        zd_msg_unpack(header.type, payload, header.payload_bytes, &decoded, &why) == 0) {
      const Zerod__V1__Notice *notice = (const Zerod__V1__Notice *)decoded;
      if (notice->status != ZEROD__V1__STATUS__STATUS_OK) {
        snprintf(message, message_bytes, "%s", notice->message);
        found = (int)notice->status;
      }
      protobuf_c_message_free_unpacked(decoded, NULL);
    }
    free(payload);
  }
  return found;
}

/* Sends one request. With expect_reply the id is recorded so that its reply
 * is stashed if another call reads it first. */
zd_status client__send(zd_client *client, uint16_t type, const ProtobufCMessage *msg,
                       const int *fds, unsigned nfds, int expect_reply, const char *what,
                       uint64_t *request_id_out) {
  if (client->dead)
    return client_dead_error(client, what);
  if (expect_reply && expected_reserve(client) != 0)
    return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
  uint64_t request_id = client->next_request_id++;
  int rc = zd_frame_send(client->sock, type, request_id, expect_reply ? 0 : ZD_FRAME_F_NO_REPLY,
                         msg, fds, nfds, -1);
  if (rc == -EPIPE || rc == -ECONNRESET || rc == -ENOTCONN) {
    char notice[LAST_ERROR_BYTES];
    int notice_status = drain_for_notice(client, notice, sizeof notice);
    if (notice_status != 0)
      client_mark_dead_by_notice(client, notice_status, notice);
    else
      client_mark_dead(client, "zerod closed the connection");
    return client_dead_error(client, what);
  }
  if (rc == -EMSGSIZE)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "%s: request larger than the %u-byte frame cap",
                             what, (unsigned)ZD_FRAME_MAX_PAYLOAD);
  if (rc == -ENOMEM)
    return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
  if (rc != 0) {
    /* A frame may be half written: the stream cannot be trusted. */
    client_mark_dead(client, "sending to zerod failed: %s", strerror(-rc));
    return client__set_error(ZD_E_IO, "%s: sending to zerod failed: %s", what, strerror(-rc));
  }
  if (expect_reply)
    client->expected_ids[client->expected_count++] = request_id;
  *request_id_out = request_id;
  return ZD_OK;
}

/* A protocol violation by the daemon: the stream cannot be trusted, so the
 * connection is closed and this call reports ZD_E_PROTOCOL. */

zd_status client__protocol_error(zd_client *client, const char *what, const char *format, ...) {
  char detail[LAST_ERROR_BYTES];
  va_list args;
  va_start(args, format);
  vsnprintf(detail, sizeof detail, format, args);
  va_end(args);
  client_mark_dead(client, "connection closed after a protocol error: %s", detail);
  return client__set_error(ZD_E_PROTOCOL, "%s: protocol error from zerod: %s", what, detail);
}

/* Reads one whole frame, blocking without a time limit: collectives can
 * take long, and the daemon enforces their timeouts itself. */
static zd_status client_read_frame(zd_client *client, const char *what, stashed_frame *frame) {
  for (;;) {
    const char *why = NULL;
    int rc = zd_frame_read(&client->reader, client->sock, &why);
    if (rc == 1)
      break;
    if (rc == 0 || rc == -EINTR)
      continue;
    if (rc == -ECONNRESET || rc == -EPIPE) {
      /* A daemon that closes a session usually says why first, in an error
       * to a request sent without a reply; that is the reason to give. */
      if (client->deferred_status != ZD_OK)
        client_mark_dead(client, "zerod closed the connection after an error: %s",
                         client->deferred_message);
      else
        client_mark_dead(client, "zerod closed the connection");
      return client_dead_error(client, what);
    }
    if (rc == -ENOMEM)
      return client__protocol_error(client, what, "out of memory reading a frame");
    return client__protocol_error(client, what, "%s", why != NULL ? why : strerror(-rc));
  }
  frame->next = NULL;
  zd_frame_reader_take(&client->reader, &frame->header, &frame->payload, frame->fds, &frame->nfds);
  return ZD_OK;
}

static const char *no_reply_name(const zd_client *client, uint64_t request_id, char *name,
                                 size_t name_bytes) {
  for (unsigned i = 0; i < NO_REPLY_RING; i++) {
    if (client->no_reply[i].request_id == request_id && request_id != 0) {
      snprintf(name, name_bytes, "%s unit %u", client->no_reply[i].kind,
               (unsigned)client->no_reply[i].unit);
      return name;
    }
  }
  snprintf(name, name_bytes, "request %llu (sent without a reply)", (unsigned long long)request_id);
  return name;
}

/* Handles a frame that nobody is waiting for. Returns ZD_OK when the frame
 * was consumed (a notice, a deferred error, a stray release reply, or one
 * stashed for its own waiter), else the call's error. The frame's payload
 * and fds are owned by this function. */
static zd_status client_route_frame(zd_client *client, const char *what, stashed_frame *frame) {
  uint16_t type = frame->header.type;
  uint64_t request_id = frame->header.request_id;
  if (request_id != 0 && client__expected_find(client, request_id) >= 0) {
    stashed_frame *copy = malloc(sizeof *copy);
    if (copy == NULL) {
      client__close_fds(frame->fds, frame->nfds);
      free(frame->payload);
      return client__protocol_error(client, what, "out of memory stashing a reply");
    }
    *copy = *frame;
    stashed_frame **tail = &client->stash_head;
    while (*tail != NULL)
      tail = &(*tail)->next;
    *tail = copy;
    return ZD_OK;
  }

  ProtobufCMessage *decoded = NULL;
  const char *why = NULL;
  int rc = -EPROTO;
  if (frame->nfds == 0 &&
      (type == ZEROD__V1__MSG_TYPE__MSG_NOTICE || type == ZEROD__V1__MSG_TYPE__MSG_ERROR ||
       type == ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY))
    rc = zd_msg_unpack(type, frame->payload, frame->header.payload_bytes, &decoded, &why);
  client__close_fds(frame->fds, frame->nfds);
  free(frame->payload);
  frame->payload = NULL;
  if (rc != 0) {
    if (why != NULL)
      return client__protocol_error(client, what, "frame of type %u for request %llu: %s", type,
                                    (unsigned long long)request_id, why);
    return client__protocol_error(client, what, "unexpected frame of type %u for request %llu",
                                  type, (unsigned long long)request_id);
  }

  zd_status status = ZD_OK;
  if (type == ZEROD__V1__MSG_TYPE__MSG_NOTICE) {
    /* A notice with a status ends the session (a shutdown, a refused
     * connection); others are informational and, libzerod having no log
     * of its own, dropped. */
    const Zerod__V1__Notice *notice = (const Zerod__V1__Notice *)decoded;
    if (notice->status != ZEROD__V1__STATUS__STATUS_OK) {
      client_mark_dead_by_notice(client, notice->status, notice->message);
      status = client_dead_error(client, what);
    }
  } else if (type == ZEROD__V1__MSG_TYPE__MSG_ERROR) {
    /* The answer to a request sent without a reply: nobody waits for it, so
     * it is kept and reported by the next call that completes. Only the
     * first is kept; later ones are usually its consequences. */
    const Zerod__V1__Error *error = (const Zerod__V1__Error *)decoded;
    if (client->deferred_status == ZD_OK) {
      char name[96];
      client->deferred_status = client__status_from_wire(error->status);
      snprintf(client->deferred_message, sizeof client->deferred_message, "%s: %s",
               no_reply_name(client, request_id, name, sizeof name), error->message);
    }
  }
  /* A ReleaseReply is what a daemon that ignores the NO_REPLY flag sends;
   * it carries nothing, so it is dropped. */
  protobuf_c_message_free_unpacked(decoded, NULL);
  return status;
}

/* Waits for the reply to request_id and decodes it. An Error reply becomes
 * the call's status (its message prefixed with `what`); a reply of another
 * type than reply_type is a protocol error. On success the caller owns
 * *reply (protobuf_c_message_free_unpacked) and the descriptors in fds. */
zd_status client__wait(zd_client *client, uint64_t request_id, uint16_t reply_type,
                       const char *what, ProtobufCMessage **reply, int *fds, unsigned *nfds) {
  *reply = NULL;
  *nfds = 0;
  if (client->dead)
    return client_dead_error(client, what);

  stashed_frame frame = {0};
  int found = 0;
  for (stashed_frame **link = &client->stash_head; *link != NULL; link = &(*link)->next) {
    if ((*link)->header.request_id == request_id) {
      stashed_frame *stashed = *link;
      *link = stashed->next;
      frame = *stashed;
      free(stashed);
      found = 1;
      break;
    }
  }
  while (!found) {
    zd_status status = client_read_frame(client, what, &frame);
    if (status != ZD_OK)
      return status;
    if (frame.header.request_id == request_id && request_id != 0)
      break;
    status = client_route_frame(client, what, &frame);
    if (status != ZD_OK)
      return status;
  }
  expected_remove(client, request_id);

  uint16_t type = frame.header.type;
  unsigned max_fds = 0;
  ProtobufCMessage *decoded = NULL;
  const char *why = NULL;
  if (type != ZEROD__V1__MSG_TYPE__MSG_ERROR && type != reply_type) {
    client__close_fds(frame.fds, frame.nfds);
    free(frame.payload);
    return client__protocol_error(client, what, "expected reply type %u, got type %u", reply_type,
                                  type);
  }
  zd_msg_fd_range(type, NULL, &max_fds);
  if (frame.nfds > max_fds) {
    client__close_fds(frame.fds, frame.nfds);
    free(frame.payload);
    return client__protocol_error(client, what, "%u file descriptors with a frame of type %u",
                                  frame.nfds, type);
  }
  int rc = zd_msg_unpack(type, frame.payload, frame.header.payload_bytes, &decoded, &why);
  free(frame.payload);
  if (rc != 0) {
    client__close_fds(frame.fds, frame.nfds);
    return client__protocol_error(client, what, "reply does not decode: %s",
                                  why != NULL ? why : strerror(-rc));
  }
  if (type == ZEROD__V1__MSG_TYPE__MSG_ERROR) {
    const Zerod__V1__Error *error = (const Zerod__V1__Error *)decoded;
    zd_status status =
        client__set_error(client__status_from_wire(error->status), "%s: %s", what, error->message);
    protobuf_c_message_free_unpacked(decoded, NULL);
    client__close_fds(frame.fds, frame.nfds);
    /* STATUS_PROTOCOL means the daemon is closing this session. */
    if (status == ZD_E_PROTOCOL)
      client_mark_dead(client, "zerod closed the session after a protocol error: %s",
                       last_error_text);
    return status;
  }
  *reply = decoded;
  for (unsigned i = 0; i < frame.nfds; i++)
    fds[i] = frame.fds[i];
  *nfds = frame.nfds;
  return ZD_OK;
}

/* A call whose own request succeeded reports a deferred error (from an
 * earlier asynchronous reduce, or a release the daemon refused for its own
 * reasons) if one arrived: its effect has happened, but the worker learns
 * that the job is in trouble. The message starts with the earlier
 * request's name, which is how zerod.h tells callers to recognise it. */
zd_status client__finish(zd_client *client) {
  if (client->deferred_status == ZD_OK)
    return ZD_OK;
  zd_status status = client->deferred_status;
  client->deferred_status = ZD_OK;
  return client__set_error(status, "%s", client->deferred_message);
}

/* Sends a request and waits for its reply: the common synchronous call. */
zd_status client__call(zd_client *client, uint16_t type, const ProtobufCMessage *request,
                       const int *fds, unsigned nfds, uint16_t reply_type, const char *what,
                       ProtobufCMessage **reply, int *reply_fds, unsigned *reply_nfds) {
  uint64_t request_id;
  zd_status status = client__send(client, type, request, fds, nfds, 1, what, &request_id);
  if (status != ZD_OK)
    return status;
  return client__wait(client, request_id, reply_type, what, reply, reply_fds, reply_nfds);
}

/* ------------------------------------------------------------------------
 * Connect and close
 * ------------------------------------------------------------------------ */

const char *zd_default_socket(void) {
  const char *path = getenv("ZEROD_SOCKET");
  return path != NULL && path[0] != '\0' ? path : ".zerod/zerod.sock";
}

zd_status zd_connect(const char *socket_path, zd_client **out) {
  if (out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "connect: out is NULL");
  *out = NULL;
  if (socket_path == NULL)
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
    return client__set_error(
        ZD_E_UNAVAILABLE,
        "cannot connect to zerod at %s: %s (is the daemon running? start it with "
        "`zerod standalone`)",
        socket_path, strerror(err));
  }
  client->next_request_id = 1;
  zd_frame_reader_init(&client->reader);
  *out = client;
  return ZD_OK;
}

void client__unit_free(client_unit *unit) {
  if (unit->tensor_names != NULL) {
    for (unsigned t = 0; t < unit->ntensors; t++)
      free(unit->tensor_names[t]);
  }
  free(unit->tensor_names);
  free(unit->shapes);
  free(unit->gather_tensors);
  free(unit->grad_tensors);
  free(unit->info_tensors);
  free(unit->name);
  if (unit->stable_base != NULL)
    munmap(unit->stable_base, unit->stable_bytes);
}

static void job_free(zd_job *job) {
  for (size_t u = 0; u < job->unit_count; u++)
    client__unit_free(&job->units[u]);
  free(job->units);
  free(job->name);
  free(job->attach_warning);
  free(job);
}

void zd_close(zd_client *client) {
  if (client == NULL)
    return;
  /* Detaching is a courtesy to the daemon (it would notice the closed
   * socket anyway), so its errors are dropped, and the thread's last error
   * is left as the caller's last failed call set it. */
  char saved_error[LAST_ERROR_BYTES];
  memcpy(saved_error, last_error_text, sizeof saved_error);
  for (zd_job *job = client->jobs; job != NULL; job = job->next) {
    if (job->attached && !client->dead)
      zd_detach(job);
  }
  memcpy(last_error_text, saved_error, sizeof saved_error);

  if (client->sock >= 0)
    close(client->sock);
  zd_frame_reader_reset(&client->reader);
  stash_free_all(client);
  for (size_t i = 0; i < client->mapping_count; i++)
    client__mapping_free(&client->mappings[i]);
  free(client->mappings);
  free(client->expected_ids);
  zd_job *job = client->jobs;
  while (job != NULL) {
    zd_job *next = job->next;
    job_free(job);
    job = next;
  }
  free(client);
}

/* ------------------------------------------------------------------------
 * Attach
 * ------------------------------------------------------------------------ */

/* Translates the caller's job config into the protocol's. Every enum is
 * checked here so that a typo fails locally with a message, rather than as
 * an undecodable frame on the daemon's side. */
static zd_status fill_job_config(const zd_job_config *caller_config, Zerod__V1__JobConfig *config,
                                 Zerod__V1__OptimizerConfig *optimizer,
                                 Zerod__V1__OffloadConfig *offload, char *nvme_path,
                                 size_t nvme_path_bytes) {
  zd_job_config local;
  zd_status status =
      client__copy_sized_struct(&local, sizeof local, caller_config, sizeof local.struct_size,
                                "attach: config", "ZD_JOB_CONFIG_INIT");
  if (status != ZD_OK)
    return status;
  if ((int)local.optimizer < 0 || local.optimizer > ZD_SGD)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "attach: config.optimizer %d is not ZD_ADAMW, ZD_ADAM or ZD_SGD",
                             (int)local.optimizer);
  if ((int)local.working_dtype < 0 || local.working_dtype > ZD_F16)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "attach: config.working_dtype %d is not ZD_F32, ZD_BF16 or ZD_F16",
                             (int)local.working_dtype);
  optimizer->kind = (Zerod__V1__OptimizerKind)local.optimizer;
  optimizer->lr = local.lr;
  optimizer->beta1 = local.beta1;
  optimizer->beta2 = local.beta2;
  optimizer->eps = local.eps;
  optimizer->weight_decay = local.weight_decay;
  optimizer->has_weight_decay = local.has_weight_decay != 0;
  optimizer->momentum = local.momentum;
  optimizer->dampening = local.dampening;
  optimizer->nesterov = local.nesterov != 0;
  config->optimizer = optimizer;
  config->working_dtype = (Zerod__V1__Dtype)local.working_dtype;
  config->max_live_bytes = local.max_live_bytes;
  config->max_grad_norm = local.max_grad_norm;
  if ((int)local.collectives < 0 || local.collectives > ZD_COLLECTIVES_FLAT)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "attach: config.collectives %d is not ZD_COLLECTIVES_HIERARCHICAL or "
                             "ZD_COLLECTIVES_FLAT",
                             (int)local.collectives);
  config->collectives = (Zerod__V1__Collectives)local.collectives;
  config->quantized_weights = local.quantized_weights != 0;
  config->quantization_block = local.quantization_block;
  config->quantized_gradients = local.quantized_gradients;
  config->gradient_comm_dtype = (Zerod__V1__Dtype)local.gradient_comm_dtype;
  config->hpz_partition_size = local.hpz_partition_size;
  config->loss_scale = local.loss_scale;
  config->loss_scale_window = local.loss_scale_window;
  config->loss_scale_growth = local.loss_scale_growth;
  config->loss_scale_backoff = local.loss_scale_backoff;
  config->loss_scale_hysteresis = local.loss_scale_hysteresis;
  config->loss_scale_min = local.loss_scale_min;
  if ((int)local.offload_device < 0 || local.offload_device > ZD_OFFLOAD_NVME)
    return client__set_error(
        ZD_E_INVALID_ARGUMENT,
        "attach: config.offload_device %d is not ZD_OFFLOAD_NONE, ZD_OFFLOAD_CPU or "
        "ZD_OFFLOAD_NVME",
        (int)local.offload_device);
  if (memchr(local.nvme_path, '\0', sizeof local.nvme_path) == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "attach: config.nvme_path is not NUL-terminated");
  snprintf(nvme_path, nvme_path_bytes, "%s", local.nvme_path);
  offload->device = (Zerod__V1__OffloadDevice)local.offload_device;
  offload->nvme_path = nvme_path;
  offload->buffer_count = local.offload_buffer_count;
  offload->buffer_size = local.offload_buffer_size;
  offload->pin_memory = local.offload_pin_memory != 0;
  config->offload_optimizer = offload;
  return ZD_OK;
}

/* The reverse of fill_job_config: the job's effective config from an
 * AttachReply (a daemon sends it with every default filled in; one that
 * sent none leaves every field zero, which zd_job_config documents as the
 * defaults). */
static void job_config_from_reply(const Zerod__V1__JobConfig *config, zd_job_config *out) {
  memset(out, 0, sizeof *out);
  out->struct_size = sizeof *out;
  if (config == NULL)
    return;
  const Zerod__V1__OptimizerConfig *optimizer = config->optimizer;
  if (optimizer != NULL) {
    out->optimizer = optimizer->kind == ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_UNSPECIFIED
                         ? ZD_ADAMW
                         : (zd_optimizer)optimizer->kind;
    out->lr = optimizer->lr;
    out->beta1 = optimizer->beta1;
    out->beta2 = optimizer->beta2;
    out->eps = optimizer->eps;
    out->weight_decay = optimizer->weight_decay;
    out->has_weight_decay = optimizer->has_weight_decay;
    out->momentum = optimizer->momentum;
    out->dampening = optimizer->dampening;
    out->nesterov = optimizer->nesterov;
  }
  out->working_dtype = config->working_dtype == ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED
                           ? ZD_F32
                           : (zd_dtype)config->working_dtype;
  out->max_live_bytes = config->max_live_bytes;
  out->max_grad_norm = config->max_grad_norm;
  out->collectives = config->collectives == ZEROD__V1__COLLECTIVES__COLLECTIVES_UNSPECIFIED
                         ? ZD_COLLECTIVES_HIERARCHICAL
                         : (zd_collectives)config->collectives;
  out->quantized_weights = config->quantized_weights;
  out->quantization_block = config->quantization_block;
  out->quantized_gradients = config->quantized_gradients;
  out->gradient_comm_dtype = config->gradient_comm_dtype == ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED
                                 ? ZD_F32
                                 : (zd_dtype)config->gradient_comm_dtype;
  out->hpz_partition_size = config->hpz_partition_size;
  out->loss_scale = config->loss_scale;
  out->loss_scale_window = config->loss_scale_window;
  out->loss_scale_growth = config->loss_scale_growth;
  out->loss_scale_backoff = config->loss_scale_backoff;
  out->loss_scale_hysteresis = config->loss_scale_hysteresis;
  out->loss_scale_min = config->loss_scale_min;
  const Zerod__V1__OffloadConfig *offload = config->offload_optimizer;
  if (offload != NULL) {
    out->offload_device = offload->device == ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_UNSPECIFIED
                              ? ZD_OFFLOAD_NONE
                              : (zd_offload_device)offload->device;
    snprintf(out->nvme_path, sizeof out->nvme_path, "%s", offload->nvme_path);
    out->offload_buffer_count = offload->buffer_count;
    out->offload_buffer_size = offload->buffer_size;
    out->offload_pin_memory = offload->pin_memory;
  }
}

zd_status zd_attach(zd_client *client, const zd_attach_options *caller_options, zd_job **out) {
  if (client == NULL || caller_options == NULL || out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "attach: client, options and out must not be NULL");
  *out = NULL;
  zd_attach_options options;
  zd_status status =
      client__copy_sized_struct(&options, sizeof options, caller_options,
                                offsetof(zd_attach_options, job) + sizeof options.job,
                                "attach: options", "ZD_ATTACH_OPTIONS_INIT");
  if (status != ZD_OK)
    return status;
  if (options.job == NULL || options.job[0] == '\0' || strlen(options.job) > ZD_MAX_JOB_NAME_BYTES)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "attach: job name must be 1..%d bytes",
                             ZD_MAX_JOB_NAME_BYTES);
  if (options.token != NULL && strlen(options.token) > ZD_MAX_TOKEN_BYTES)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "attach: token longer than %d bytes",
                             ZD_MAX_TOKEN_BYTES);
  char what[128];
  snprintf(what, sizeof what, "attach job %s", options.job);
  if (client->dead)
    return client_dead_error(client, what);
  for (zd_job *job = client->jobs; job != NULL; job = job->next) {
    if (job->attached)
      return client__set_error(ZD_E_FAILED_PRECONDITION,
                               "%s: this connection is already attached to job %s (one job per "
                               "connection: use zd_connect again)",
                               what, job->name);
  }

  Zerod__V1__AttachRequest request = ZEROD__V1__ATTACH_REQUEST__INIT;
  Zerod__V1__JobConfig config = ZEROD__V1__JOB_CONFIG__INIT;
  Zerod__V1__OptimizerConfig optimizer = ZEROD__V1__OPTIMIZER_CONFIG__INIT;
  Zerod__V1__OffloadConfig offload = ZEROD__V1__OFFLOAD_CONFIG__INIT;
  char nvme_path[256];
  request.protocol_version = 1;
  request.job = (char *)options.job;
  request.local_rank = options.local_rank;
  request.token = (char *)(options.token != NULL ? options.token : "");
  int read_only = options.read_only != 0;
  request.mode = read_only ? ZEROD__V1__ATTACH_MODE__ATTACH_READ_ONLY
                           : ZEROD__V1__ATTACH_MODE__ATTACH_READ_WRITE;
  request.create = options.create != 0;
  request.pin = options.pin != 0;
  if (options.config != NULL) {
    if ((status = fill_job_config(options.config, &config, &optimizer, &offload, nvme_path,
                                  sizeof nvme_path)) != ZD_OK)
      return status;
    request.config = &config;
  }

  zd_job *job = calloc(1, sizeof *job);
  char *name = strdup(options.job);
  if (job == NULL || name == NULL) {
    free(job);
    free(name);
    return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
  }
  job->name = name;

  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(client, ZEROD__V1__MSG_TYPE__MSG_ATTACH, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK) {
    job_free(job);
    return status;
  }
  const Zerod__V1__AttachReply *reply = (const Zerod__V1__AttachReply *)reply_msg;
  if ((reply->read_only != 0) != read_only) {
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    job_free(job);
    return client__protocol_error(client, what, "asked for a %s attachment, the reply says %s",
                                  read_only ? "read-only" : "read-write",
                                  read_only ? "read-write" : "read-only");
  }
  /* A read-only session takes no rank, so its rank says nothing. */
  if (!read_only && (reply->world_size == 0 || reply->rank >= reply->world_size)) {
    unsigned rank = reply->rank, world_size = reply->world_size;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    job_free(job);
    return client__protocol_error(client, what, "rank %u out of world size %u", rank, world_size);
  }
  job->client = client;
  job->attached = 1;
  job->read_only = read_only;
  /* The protocol ignores `pin` for read-write sessions; so does the job. */
  job->pinned = read_only && options.pin;
  job->stable_addresses = options.stable_addresses != 0;
  job->rank = reply->rank;
  job->world_size = reply->world_size;
  job->version = job->pinned ? reply->pinned_version : reply->version;
  job->loss_scale = reply->loss_scale;
  job_config_from_reply(reply->config, &job->config);
  if (reply->warning != NULL && reply->warning[0] != '\0' &&
      (job->attach_warning = strdup(reply->warning)) == NULL) {
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    job_free(job);
    return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
  }
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  job->next = client->jobs;
  client->jobs = job;
  *out = job;
  return client__finish(client);
}

unsigned zd_job_rank(const zd_job *job) {
  return job != NULL ? job->rank : 0;
}

unsigned zd_job_world_size(const zd_job *job) {
  return job != NULL ? job->world_size : 0;
}

uint64_t zd_job_version(const zd_job *job) {
  return job != NULL ? job->version : 0;
}

double zd_job_loss_scale(const zd_job *job) {
  return job != NULL ? job->loss_scale : 0;
}

int zd_job_read_only(const zd_job *job) {
  return job != NULL ? job->read_only : 0;
}

zd_status zd_job_effective_config(const zd_job *job, zd_job_config *out) {
  if (job == NULL || out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "job config: job and out must not be NULL");
  /* The caller's struct_size says how much of the struct it has: the
   * fields that fit are written (client_sized.c). */
  zd_status status =
      SIZED_OUT_CHECK(out, zd_job_config, optimizer, "job config", "ZD_JOB_CONFIG_INIT");
  if (status != ZD_OK)
    return status;
  client__sized_out_write(out, &job->config, sizeof job->config);
  return ZD_OK;
}

const char *zd_job_attach_warning(const zd_job *job) {
  return job != NULL ? job->attach_warning : NULL;
}

/* Common entry checks of the calls on an attached job. */
zd_status client__job_check(const zd_job *job, const char *what) {
  if (job == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "%s: job is NULL", what);
  if (job->client->dead)
    return client_dead_error(job->client, what);
  if (!job->attached)
    return client__set_error(ZD_E_FAILED_PRECONDITION, "%s: job %s is detached", what, job->name);
  return ZD_OK;
}

/* The entry check of the calls that change the job (registration,
 * gradients, reduce, step, load): a read-only job is refused here, without
 * a round trip, with the reason. */
zd_status client__job_check_writable(const zd_job *job, const char *what) {
  zd_status status = client__job_check(job, what);
  if (status != ZD_OK)
    return status;
  if (job->read_only)
    return client__set_error(
        ZD_E_PERMISSION_DENIED,
        "%s: job %s is attached read-only; registering units, gradient buffers, "
        "reduce, step and load need a read-write attachment",
        what, job->name);
  return ZD_OK;
}

client_unit *client__job_find_unit(zd_job *job, zd_unit unit_id) {
  /* Daemons hand out small dense ids, so the id is tried as an index first;
   * the table is sorted by id, so a binary search covers any other
   * numbering (a read-only job may list only some units, say). */
  if (unit_id < job->unit_count && job->units[unit_id].unit_id == unit_id)
    return &job->units[unit_id];
  size_t low = 0, high = job->unit_count;
  while (low < high) {
    size_t middle = low + (high - low) / 2;
    if (job->units[middle].unit_id < unit_id)
      low = middle + 1;
    else
      high = middle;
  }
  return low < job->unit_count && job->units[low].unit_id == unit_id ? &job->units[low] : NULL;
}

/* The entry of every call on one unit: names the call in `what` ("<verb>
 * unit N"), checks the job (refusing a read-only one when `writable`) and
 * finds the unit. */
zd_status client__unit_call_begin(zd_job *job, zd_unit unit_id, const char *verb, int writable,
                                  char *what, size_t what_bytes, client_unit **unit) {
  snprintf(what, what_bytes, "%s unit %u", verb, (unsigned)unit_id);
  zd_status status =
      writable ? client__job_check_writable(job, what) : client__job_check(job, what);
  if (status != ZD_OK)
    return status;
  *unit = client__job_find_unit(job, unit_id);
  /* The daemon's answer for an id it does not know (client_status.c). */
  if (*unit == NULL)
    return client__set_error(ZD_E_NOT_FOUND, "%s: no such unit known to this job", what);
  return ZD_OK;
}

/* Makes room for `more` units, before the request whose reply adds them. */
zd_status client__job_reserve_units(zd_job *job, size_t more, const char *what) {
  if (job->unit_capacity - job->unit_count >= more)
    return ZD_OK;
  size_t capacity = job->unit_capacity ? job->unit_capacity : 16;
  while (capacity - job->unit_count < more)
    capacity *= 2;
  client_unit *units = realloc(job->units, capacity * sizeof *units);
  if (units == NULL)
    return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
  job->units = units;
  job->unit_capacity = capacity;
  return ZD_OK;
}

/* Adds a unit in id order (room was reserved). Views never point at a
 * client_unit itself, only at its separately allocated tables, so moving
 * entries is safe. */
void client__job_insert_unit(zd_job *job, const client_unit *unit) {
  size_t at = job->unit_count;
  while (at > 0 && job->units[at - 1].unit_id > unit->unit_id)
    at--;
  memmove(&job->units[at + 1], &job->units[at], (job->unit_count - at) * sizeof *job->units);
  job->units[at] = *unit;
  job->unit_count++;
}

unsigned zd_job_unit_count(const zd_job *job) {
  return job != NULL ? (unsigned)job->unit_count : 0;
}

zd_status zd_job_unit_info(const zd_job *job, unsigned index, zd_unit_info *out) {
  if (job == NULL || out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "unit info: job and out must not be NULL");
  zd_status status = SIZED_OUT_CHECK(out, zd_unit_info, unit, "unit info", "ZD_UNIT_INFO_INIT");
  if (status != ZD_OK)
    return status;
  if (index >= job->unit_count)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "unit info: index %u is past the %zu units job %s knows (see "
                             "zd_job_unit_count)",
                             index, job->unit_count, job->name);
  const client_unit *unit = &job->units[index];
  zd_unit_info info = ZD_UNIT_INFO_INIT;
  info.unit = unit->unit_id;
  info.name = unit->name;
  info.ntensors = unit->ntensors;
  info.tensors = unit->info_tensors;
  info.numel = unit->numel;
  info.padded_numel = unit->padded_numel;
  info.dtype = unit->working_dtype;
  client__sized_out_write(out, &info, sizeof info);
  return ZD_OK;
}
