/* libzerod: the client side of the local IPC protocol (client/include/zerod.h).
 *
 * This file owns one worker's connection to its node daemon: the blocking
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
#include "zerod.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "cuda/zk_cuda.h"
#include "frame.h"

/* ------------------------------------------------------------------------
 * Errors
 * ------------------------------------------------------------------------ */

#define LAST_ERROR_BYTES 1024

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

static zd_status set_error(zd_status status, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

static zd_status set_error(zd_status status, const char *format, ...) {
  va_list args;
  va_start(args, format);
  set_error_v(status, format, args);
  va_end(args);
  return status;
}

/* The C status for a protocol Status value: its negation, as zerod.h
 * promises. A status this library does not know (or OK inside an Error,
 * which is a daemon bug) becomes ZD_E_INTERNAL so callers only ever see
 * documented codes. */
static zd_status status_from_proto(int proto_status) {
  if (proto_status >= ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT &&
      proto_status <= ZEROD__V1__STATUS__STATUS_PROTOCOL)
    return (zd_status)-proto_status;
  return ZD_E_INTERNAL;
}

const char *zd_strerror(zd_status status) {
  switch (status) {
  case ZD_OK:
    return "OK";
  case ZD_E_INVALID_ARGUMENT:
    return "invalid argument";
  case ZD_E_NOT_FOUND:
    return "not found";
  case ZD_E_ALREADY_EXISTS:
    return "already exists";
  case ZD_E_FAILED_PRECONDITION:
    return "failed precondition";
  case ZD_E_RESOURCE_EXHAUSTED:
    return "resource exhausted";
  case ZD_E_PERMISSION_DENIED:
    return "permission denied";
  case ZD_E_UNAVAILABLE:
    return "unavailable";
  case ZD_E_INTERNAL:
    return "internal error";
  case ZD_E_ABORTED:
    return "aborted";
  case ZD_E_PROTOCOL:
    return "protocol error";
  case ZD_E_NOMEM:
    return "out of memory";
  case ZD_E_IO:
    return "I/O error";
  }
  return "unknown error";
}

const char *zd_last_error(void) {
  return last_error_text;
}

/* ------------------------------------------------------------------------
 * Types
 * ------------------------------------------------------------------------ */

/* A frame read while waiting for another request's reply, kept for the
 * caller that waits for it (an asynchronous gather). */
typedef struct stashed_frame {
  struct stashed_frame *next;
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
} stashed_frame;

/* Gathered buffers are mapped read-only and gradient buffers read-write, so
 * the two kinds are cached apart; a daemon that numbered both kinds from the
 * same counter, or from separate ones, is served correctly either way. */
typedef enum buffer_kind { BUFFER_GATHERED = 0, BUFFER_GRAD = 1 } buffer_kind;

/* One buffer the daemon sent. Usually it is mapped once (base) and its
 * descriptor closed. A stable-address job's gathered buffers are instead
 * mapped into each unit's own range at every gather, so their descriptor is
 * kept (fd) and base is NULL. A GPU buffer is opened once from its CUDA IPC
 * handles: base is then the device pointer in this process, device the
 * daemon's ordinal and event the buffer's interprocess event. Any entry
 * lives until the daemon lists the buffer as dropped, or until zd_close (a
 * GPU buffer's: until zd_detach). */
typedef struct buffer_mapping {
  buffer_kind kind;
  uint32_t buffer_id;
  void *base;
  size_t bytes;
  int fd;      /* -1 unless kept */
  int device;  /* GPU buffer: the CUDA ordinal; -1 for shared memory */
  void *event; /* GPU buffer: the opened cudaEvent_t */
  int held;    /* scratch of forget_dropped_buffers */
} buffer_mapping;

/* A reply's CudaBuffer, copied out before the reply is freed. */
typedef struct cuda_handles {
  int present;
  int device;
  uint8_t mem_handle[ZK_CUDA_IPC_HANDLE_BYTES];
  uint8_t event_handle[ZK_CUDA_IPC_HANDLE_BYTES];
} cuda_handles;

/* What this client knows of a unit (registered or listed): the placements,
 * and three tensor tables: gathered and gradient, whose data pointers are
 * filled in by each gather / grad_buffer call, and the layout handed out by
 * zd_job_unit_info, whose data pointers stay NULL. The names and shapes are
 * owned here and shared by all tables. */
typedef struct client_unit {
  zd_unit unit_id;
  char *name;
  unsigned ntensors;
  uint64_t numel;
  uint64_t padded_numel;
  zd_dtype working_dtype;
  zd_dtype grad_dtype;
  char **tensor_names;
  uint64_t *shapes; /* every tensor's dims, back to back */
  zd_tensor_view *gather_tensors;
  zd_tensor_view *grad_tensors;
  zd_tensor_view *info_tensors;
  /* The buffers behind the views handed out and still valid by contract:
   * the gathered one until zd_release, the gradient one until zd_reduce
   * (0: none). A buffer named here is never unmapped when dropped. */
  uint32_t held_gather_buffer;
  uint32_t held_grad_buffer;
  /* Stable-address jobs: the unit's reserved range, page-rounded to its
   * gathered layout (NULL until reserved). While the unit is gathered it
   * maps held_gather_buffer; otherwise it is PROT_NONE anonymous memory. */
  void *stable_base;
  size_t stable_bytes;
} client_unit;

struct zd_job {
  zd_client *client;
  struct zd_job *next; /* the client's list of jobs, freed by zd_close */
  char *name;
  int attached;
  int read_only;
  int pinned; /* read-only and serving one version: `version` is it */
  int stable_addresses;
  unsigned rank;
  unsigned world_size;
  uint64_t version;
  double loss_scale;    /* for the next step's loss; 0: none */
  zd_job_config config; /* the job's, as the attach reply had it */
  char *attach_warning; /* AttachReply.warning; NULL if none */
  client_unit *units;   /* sorted by unit id */
  size_t unit_count;
  size_t unit_capacity;
};

/* Requests sent without a reply (releases, asynchronous reduces) are
 * remembered for a while, only so that an error answering one can name the
 * request and unit it was about. */
#define NO_REPLY_RING 64

struct zd_client {
  int sock;
  int dead;
  char dead_reason[LAST_ERROR_BYTES];
  zd_status dead_status; /* what calls on a dead client return; 0: ZD_E_UNAVAILABLE */
  uint64_t next_request_id;
  zd_frame_reader reader;

  /* Ids of requests whose reply has not been consumed yet. */
  uint64_t *expected_ids;
  size_t expected_count;
  size_t expected_capacity;
  stashed_frame *stash_head;

  struct {
    uint64_t request_id;
    zd_unit unit;
    const char *kind; /* "release", "reduce" */
  } no_reply[NO_REPLY_RING];
  unsigned no_reply_next;

  zd_status deferred_status; /* ZD_OK when there is none */
  char deferred_message[LAST_ERROR_BYTES];

  buffer_mapping *mappings;
  size_t mapping_count;
  size_t mapping_capacity;

  zd_job *jobs;
};

/* ------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------ */

static size_t dtype_bytes(zd_dtype dtype) {
  return dtype == ZD_F32 ? 4 : 2;
}

static const char *dtype_name(zd_dtype dtype) {
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
static int dtype_from_proto(int proto_dtype, zd_dtype *out) {
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
static uint64_t page_round(uint64_t bytes) {
  long page_size = sysconf(_SC_PAGESIZE);
  uint64_t page = page_size > 0 ? (uint64_t)page_size : 4096;
  return bytes == 0 ? page : (bytes + page - 1) / page * page;
}

static void close_fds(int *fds, unsigned nfds) {
  for (unsigned i = 0; i < nfds; i++) {
    if (fds[i] >= 0)
      close(fds[i]);
    fds[i] = -1;
  }
}

/* The CUDA module, loaded when the first GPU buffer arrives (and cached
 * by the loader: later calls are cheap). NULL with a reason in why where it
 * cannot be loaded. */
static const zk_cuda_api *cuda_api(char *why, size_t why_bytes) {
  const zk_cuda_api *api = NULL;
  zk_cuda_load(&api, why, why_bytes);
  return api;
}

/* Unmaps a buffer and closes its kept descriptor, if any; a GPU buffer's
 * event and memory handle are closed (the module is loaded: it opened
 * them). */
static void mapping_free(buffer_mapping *mapping) {
  if (mapping->device >= 0) {
    const zk_cuda_api *api = cuda_api(NULL, 0);
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

/* Options structs carry their size so that fields can be added later. A
 * caller's struct is copied into a zeroed local one: fields the caller's
 * (older) header does not have read as zero, the documented default. A size
 * larger than this library knows means the caller asked for something this
 * library cannot do, so it is refused rather than silently ignored. */
static zd_status copy_sized_struct(void *dst, size_t dst_bytes, const void *src, size_t min_bytes,
                                   const char *what, const char *initialiser) {
  size_t src_bytes;
  memcpy(&src_bytes, src, sizeof src_bytes);
  if (src_bytes < min_bytes)
    return set_error(ZD_E_INVALID_ARGUMENT,
                     "%s: struct_size %zu is too small (at least %zu); initialise it with %s", what,
                     src_bytes, min_bytes, initialiser);
  if (src_bytes > dst_bytes)
    return set_error(ZD_E_INVALID_ARGUMENT,
                     "%s: struct_size %zu is larger than this libzerod knows (%zu); the program "
                     "was built against a newer zerod.h",
                     what, src_bytes, dst_bytes);
  memset(dst, 0, dst_bytes);
  memcpy(dst, src, src_bytes);
  return ZD_OK;
}

/* ------------------------------------------------------------------------
 * Connection state
 * ------------------------------------------------------------------------ */

static void stash_free_all(zd_client *client) {
  stashed_frame *frame = client->stash_head;
  while (frame != NULL) {
    stashed_frame *next = frame->next;
    close_fds(frame->fds, frame->nfds);
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
  return set_error(client->dead_status != ZD_OK ? client->dead_status : ZD_E_UNAVAILABLE, "%s: %s",
                   what, client->dead_reason);
}

/* A notice that ends the session: the daemon shutting down (UNAVAILABLE),
 * or refusing the connection (RESOURCE_EXHAUSTED: --max-sessions). */
static void client_mark_dead_by_notice(zd_client *client, int proto_status, const char *message) {
  if (proto_status == ZEROD__V1__STATUS__STATUS_UNAVAILABLE) {
    client_mark_dead(client, "daemon is shutting down: %s", message);
  } else {
    client_mark_dead(client, "zerod refused the session: %s", message);
    client->dead_status = status_from_proto(proto_status);
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

static int expected_find(const zd_client *client, uint64_t request_id) {
  for (size_t i = 0; i < client->expected_count; i++) {
    if (client->expected_ids[i] == request_id)
      return (int)i;
  }
  return -1;
}

static void expected_remove(zd_client *client, uint64_t request_id) {
  int index = expected_find(client, request_id);
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
    close_fds(fds, nfds);
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
static zd_status client_send(zd_client *client, uint16_t type, const ProtobufCMessage *msg,
                             const int *fds, unsigned nfds, int expect_reply, const char *what,
                             uint64_t *request_id_out) {
  if (client->dead)
    return client_dead_error(client, what);
  if (expect_reply && expected_reserve(client) != 0)
    return set_error(ZD_E_NOMEM, "%s: out of memory", what);
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
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: request larger than the %u-byte frame cap", what,
                     (unsigned)ZD_FRAME_MAX_PAYLOAD);
  if (rc == -ENOMEM)
    return set_error(ZD_E_NOMEM, "%s: out of memory", what);
  if (rc != 0) {
    /* A frame may be half written: the stream cannot be trusted. */
    client_mark_dead(client, "sending to zerod failed: %s", strerror(-rc));
    return set_error(ZD_E_IO, "%s: sending to zerod failed: %s", what, strerror(-rc));
  }
  if (expect_reply)
    client->expected_ids[client->expected_count++] = request_id;
  *request_id_out = request_id;
  return ZD_OK;
}

/* A protocol violation by the daemon: the stream cannot be trusted, so the
 * connection is closed and this call reports ZD_E_PROTOCOL. */
static zd_status client_protocol_error(zd_client *client, const char *what, const char *format, ...)
    __attribute__((format(printf, 3, 4)));

static zd_status client_protocol_error(zd_client *client, const char *what, const char *format,
                                       ...) {
  char detail[LAST_ERROR_BYTES];
  va_list args;
  va_start(args, format);
  vsnprintf(detail, sizeof detail, format, args);
  va_end(args);
  client_mark_dead(client, "connection closed after a protocol error: %s", detail);
  return set_error(ZD_E_PROTOCOL, "%s: protocol error from zerod: %s", what, detail);
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
      return client_protocol_error(client, what, "out of memory reading a frame");
    return client_protocol_error(client, what, "%s", why != NULL ? why : strerror(-rc));
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
  if (request_id != 0 && expected_find(client, request_id) >= 0) {
    stashed_frame *copy = malloc(sizeof *copy);
    if (copy == NULL) {
      close_fds(frame->fds, frame->nfds);
      free(frame->payload);
      return client_protocol_error(client, what, "out of memory stashing a reply");
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
  close_fds(frame->fds, frame->nfds);
  free(frame->payload);
  frame->payload = NULL;
  if (rc != 0) {
    if (why != NULL)
      return client_protocol_error(client, what, "frame of type %u for request %llu: %s", type,
                                   (unsigned long long)request_id, why);
    return client_protocol_error(client, what, "unexpected frame of type %u for request %llu", type,
                                 (unsigned long long)request_id);
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
      client->deferred_status = status_from_proto(error->status);
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
static zd_status client_wait(zd_client *client, uint64_t request_id, uint16_t reply_type,
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
    close_fds(frame.fds, frame.nfds);
    free(frame.payload);
    return client_protocol_error(client, what, "expected reply type %u, got type %u", reply_type,
                                 type);
  }
  zd_msg_fd_range(type, NULL, &max_fds);
  if (frame.nfds > max_fds) {
    close_fds(frame.fds, frame.nfds);
    free(frame.payload);
    return client_protocol_error(client, what, "%u file descriptors with a frame of type %u",
                                 frame.nfds, type);
  }
  int rc = zd_msg_unpack(type, frame.payload, frame.header.payload_bytes, &decoded, &why);
  free(frame.payload);
  if (rc != 0) {
    close_fds(frame.fds, frame.nfds);
    return client_protocol_error(client, what, "reply does not decode: %s",
                                 why != NULL ? why : strerror(-rc));
  }
  if (type == ZEROD__V1__MSG_TYPE__MSG_ERROR) {
    const Zerod__V1__Error *error = (const Zerod__V1__Error *)decoded;
    zd_status status = set_error(status_from_proto(error->status), "%s: %s", what, error->message);
    protobuf_c_message_free_unpacked(decoded, NULL);
    close_fds(frame.fds, frame.nfds);
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
 * earlier release) if one arrived: its effect has happened, but the worker
 * learns that the job is in trouble. */
static zd_status client_finish(zd_client *client) {
  if (client->deferred_status == ZD_OK)
    return ZD_OK;
  zd_status status = client->deferred_status;
  client->deferred_status = ZD_OK;
  return set_error(status, "%s", client->deferred_message);
}

/* Sends a request and waits for its reply: the common synchronous call. */
static zd_status client_call(zd_client *client, uint16_t type, const ProtobufCMessage *request,
                             const int *fds, unsigned nfds, uint16_t reply_type, const char *what,
                             ProtobufCMessage **reply, int *reply_fds, unsigned *reply_nfds) {
  uint64_t request_id;
  zd_status status = client_send(client, type, request, fds, nfds, 1, what, &request_id);
  if (status != ZD_OK)
    return status;
  return client_wait(client, request_id, reply_type, what, reply, reply_fds, reply_nfds);
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
    return set_error(ZD_E_INVALID_ARGUMENT, "connect: out is NULL");
  *out = NULL;
  if (socket_path == NULL)
    socket_path = zd_default_socket();
  struct sockaddr_un address = {.sun_family = AF_UNIX};
  size_t path_bytes = strlen(socket_path);
  if (path_bytes == 0 || path_bytes >= sizeof address.sun_path)
    return set_error(ZD_E_INVALID_ARGUMENT,
                     "connect: socket path must be 1..%zu bytes, got %zu (\"%.64s\")",
                     sizeof address.sun_path - 1, path_bytes, socket_path);
  memcpy(address.sun_path, socket_path, path_bytes + 1);

  zd_client *client = calloc(1, sizeof *client);
  if (client == NULL)
    return set_error(ZD_E_NOMEM, "connect: out of memory");
  client->sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (client->sock < 0) {
    int err = errno;
    free(client);
    return set_error(ZD_E_IO, "connect: socket(AF_UNIX): %s", strerror(err));
  }
  int rc;
  do {
    rc = connect(client->sock, (const struct sockaddr *)&address, sizeof address);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int err = errno;
    close(client->sock);
    free(client);
    return set_error(ZD_E_UNAVAILABLE,
                     "cannot connect to zerod at %s: %s (is the daemon running? start it with "
                     "`zerod standalone`)",
                     socket_path, strerror(err));
  }
  client->next_request_id = 1;
  zd_frame_reader_init(&client->reader);
  *out = client;
  return ZD_OK;
}

static void unit_free(client_unit *unit) {
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
    unit_free(&job->units[u]);
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
    mapping_free(&client->mappings[i]);
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
      copy_sized_struct(&local, sizeof local, caller_config, sizeof local.struct_size,
                        "attach: config", "ZD_JOB_CONFIG_INIT");
  if (status != ZD_OK)
    return status;
  if ((int)local.optimizer < 0 || local.optimizer > ZD_SGD)
    return set_error(ZD_E_INVALID_ARGUMENT,
                     "attach: config.optimizer %d is not ZD_ADAMW, ZD_ADAM or ZD_SGD",
                     (int)local.optimizer);
  if ((int)local.working_dtype < 0 || local.working_dtype > ZD_F16)
    return set_error(ZD_E_INVALID_ARGUMENT,
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
    return set_error(ZD_E_INVALID_ARGUMENT,
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
    return set_error(ZD_E_INVALID_ARGUMENT,
                     "attach: config.offload_device %d is not ZD_OFFLOAD_NONE, ZD_OFFLOAD_CPU or "
                     "ZD_OFFLOAD_NVME",
                     (int)local.offload_device);
  if (memchr(local.nvme_path, '\0', sizeof local.nvme_path) == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "attach: config.nvme_path is not NUL-terminated");
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
    return set_error(ZD_E_INVALID_ARGUMENT, "attach: client, options and out must not be NULL");
  *out = NULL;
  zd_attach_options options;
  zd_status status = copy_sized_struct(&options, sizeof options, caller_options,
                                       offsetof(zd_attach_options, job) + sizeof options.job,
                                       "attach: options", "ZD_ATTACH_OPTIONS_INIT");
  if (status != ZD_OK)
    return status;
  if (options.job == NULL || options.job[0] == '\0' || strlen(options.job) > ZD_MAX_JOB_NAME_BYTES)
    return set_error(ZD_E_INVALID_ARGUMENT, "attach: job name must be 1..%d bytes",
                     ZD_MAX_JOB_NAME_BYTES);
  if (options.token != NULL && strlen(options.token) > ZD_MAX_TOKEN_BYTES)
    return set_error(ZD_E_INVALID_ARGUMENT, "attach: token longer than %d bytes",
                     ZD_MAX_TOKEN_BYTES);
  char what[128];
  snprintf(what, sizeof what, "attach job %s", options.job);
  if (client->dead)
    return client_dead_error(client, what);
  for (zd_job *job = client->jobs; job != NULL; job = job->next) {
    if (job->attached)
      return set_error(ZD_E_FAILED_PRECONDITION,
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
    return set_error(ZD_E_NOMEM, "%s: out of memory", what);
  }
  job->name = name;

  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(client, ZEROD__V1__MSG_TYPE__MSG_ATTACH, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK) {
    job_free(job);
    return status;
  }
  const Zerod__V1__AttachReply *reply = (const Zerod__V1__AttachReply *)reply_msg;
  if ((reply->read_only != 0) != read_only) {
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    job_free(job);
    return client_protocol_error(client, what, "asked for a %s attachment, the reply says %s",
                                 read_only ? "read-only" : "read-write",
                                 read_only ? "read-write" : "read-only");
  }
  /* A read-only session takes no rank, so its rank says nothing. */
  if (!read_only && (reply->world_size == 0 || reply->rank >= reply->world_size)) {
    unsigned rank = reply->rank, world_size = reply->world_size;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    job_free(job);
    return client_protocol_error(client, what, "rank %u out of world size %u", rank, world_size);
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
    return set_error(ZD_E_NOMEM, "%s: out of memory", what);
  }
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  job->next = client->jobs;
  client->jobs = job;
  *out = job;
  return client_finish(client);
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
    return set_error(ZD_E_INVALID_ARGUMENT, "job config: job and out must not be NULL");
  /* The caller's struct_size says how much of the struct it has; like the
   * options structs, one larger than this library knows is refused. */
  size_t size = out->struct_size;
  if (size < sizeof out->struct_size || size > sizeof *out)
    return set_error(ZD_E_INVALID_ARGUMENT,
                     "job config: struct_size %zu is not in %zu..%zu; initialise it with "
                     "ZD_JOB_CONFIG_INIT",
                     size, sizeof out->struct_size, sizeof *out);
  memcpy((char *)out + sizeof out->struct_size, (const char *)&job->config + sizeof size,
         size - sizeof size);
  return ZD_OK;
}

const char *zd_job_attach_warning(const zd_job *job) {
  return job != NULL ? job->attach_warning : NULL;
}

/* Common entry checks of the calls on an attached job. */
static zd_status job_check(const zd_job *job, const char *what) {
  if (job == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: job is NULL", what);
  if (job->client->dead)
    return client_dead_error(job->client, what);
  if (!job->attached)
    return set_error(ZD_E_FAILED_PRECONDITION, "%s: job %s is detached", what, job->name);
  return ZD_OK;
}

/* The entry check of the calls that change the job (registration,
 * gradients, reduce, step, load): a read-only job is refused here, without
 * a round trip, with the reason. */
static zd_status job_check_writable(const zd_job *job, const char *what) {
  zd_status status = job_check(job, what);
  if (status != ZD_OK)
    return status;
  if (job->read_only)
    return set_error(ZD_E_PERMISSION_DENIED,
                     "%s: job %s is attached read-only; registering units, gradient buffers, "
                     "reduce, step and load need a read-write attachment",
                     what, job->name);
  return ZD_OK;
}

static client_unit *job_find_unit(zd_job *job, zd_unit unit_id) {
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
static zd_status unit_call_begin(zd_job *job, zd_unit unit_id, const char *verb, int writable,
                                 char *what, size_t what_bytes, client_unit **unit) {
  snprintf(what, what_bytes, "%s unit %u", verb, (unsigned)unit_id);
  zd_status status = writable ? job_check_writable(job, what) : job_check(job, what);
  if (status != ZD_OK)
    return status;
  *unit = job_find_unit(job, unit_id);
  if (*unit == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: no such unit known to this job", what);
  return ZD_OK;
}

/* Makes room for `more` units, before the request whose reply adds them. */
static zd_status job_reserve_units(zd_job *job, size_t more, const char *what) {
  if (job->unit_capacity - job->unit_count >= more)
    return ZD_OK;
  size_t capacity = job->unit_capacity ? job->unit_capacity : 16;
  while (capacity - job->unit_count < more)
    capacity *= 2;
  client_unit *units = realloc(job->units, capacity * sizeof *units);
  if (units == NULL)
    return set_error(ZD_E_NOMEM, "%s: out of memory", what);
  job->units = units;
  job->unit_capacity = capacity;
  return ZD_OK;
}

/* Adds a unit in id order (room was reserved). Views never point at a
 * client_unit itself, only at its separately allocated tables, so moving
 * entries is safe. */
static void job_insert_unit(zd_job *job, const client_unit *unit) {
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
    return set_error(ZD_E_INVALID_ARGUMENT, "unit info: job and out must not be NULL");
  if (index >= job->unit_count)
    return set_error(ZD_E_INVALID_ARGUMENT,
                     "unit info: index %u is past the %zu units job %s knows (see "
                     "zd_job_unit_count)",
                     index, job->unit_count, job->name);
  const client_unit *unit = &job->units[index];
  out->unit = unit->unit_id;
  out->name = unit->name;
  out->ntensors = unit->ntensors;
  out->tensors = unit->info_tensors;
  out->numel = unit->numel;
  out->padded_numel = unit->padded_numel;
  out->dtype = unit->working_dtype;
  return ZD_OK;
}

/* ------------------------------------------------------------------------
 * Stable addresses
 *
 * A job attached with stable_addresses gives each unit an address range of
 * its own, reserved once (PROT_NONE, no memory behind it). A gather maps the
 * daemon's buffer over the range with MAP_FIXED, whichever buffer id the
 * daemon picked this time, and a release maps inaccessible anonymous memory
 * back over it, so that between gathers the worker's views fault instead of
 * reading stale values, and no mapping keeps the daemon's buffer alive. The
 * buffers' descriptors are kept (buffer_mapping.fd) to map them again.
 * ------------------------------------------------------------------------ */

#define STABLE_RESERVE_FLAGS (MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)

/* Bytes of the unit's gathered layout: what its range must hold. */
static uint64_t unit_gathered_bytes(const client_unit *unit) {
  return unit->padded_numel * dtype_bytes(unit->working_dtype);
}

/* Reserves the unit's range if it has none yet. Registration and listing
 * try this and ignore a failure (the unit is known all the same); the
 * gather that needs the range tries again and reports it. */
static zd_status unit_reserve_range(client_unit *unit, const char *what) {
  if (unit->stable_base != NULL)
    return ZD_OK;
  /* padded_numel is at most 2^49 (frame.c, check_listed_unit), so this
   * cannot wrap; a range that large simply fails to map. */
  uint64_t range_bytes = page_round(unit_gathered_bytes(unit));
  if ((uint64_t)(size_t)range_bytes != range_bytes)
    return set_error(ZD_E_NOMEM, "%s: the unit's %llu-byte range does not fit the address space",
                     what, (unsigned long long)range_bytes);
  void *base = mmap(NULL, (size_t)range_bytes, PROT_NONE, STABLE_RESERVE_FLAGS, -1, 0);
  if (base == MAP_FAILED)
    return set_error(ZD_E_NOMEM, "%s: reserving the unit's %llu-byte address range: mmap: %s", what,
                     (unsigned long long)range_bytes, strerror(errno));
  unit->stable_base = base;
  unit->stable_bytes = (size_t)range_bytes;
  return ZD_OK;
}

/* Makes the unit's range inaccessible again. A failed MAP_FIXED may leave
 * the range unmapped, where a later mmap of anyone's could land; a later
 * MAP_FIXED of ours would then destroy that mapping, so on failure the range
 * is given up entirely, and the next gather reserves a new one. */
static zd_status unit_cover_range(client_unit *unit, const char *what) {
  if (unit->stable_base == NULL)
    return ZD_OK;
  void *covered = mmap(unit->stable_base, unit->stable_bytes, PROT_NONE,
                       STABLE_RESERVE_FLAGS | MAP_FIXED, -1, 0);
  if (covered != MAP_FAILED)
    return ZD_OK;
  int err = errno;
  munmap(unit->stable_base, unit->stable_bytes);
  unit->stable_base = NULL;
  unit->stable_bytes = 0;
  return set_error(ZD_E_IO,
                   "%s: making the unit's address range inaccessible: mmap: %s (the range was "
                   "unmapped; the unit's next gather maps it at a new address)",
                   what, strerror(err));
}

/* ------------------------------------------------------------------------
 * Register
 * ------------------------------------------------------------------------ */

/* Writes rank 0's values (initial ones, or ones to load) into a fresh memfd
 * for the daemon to read. A memfd rather than the socket because bulk data
 * never crosses the socket (the frame cap is 4 MiB, units are often
 * larger). */
static zd_status make_init_memfd(const float *values, uint64_t numel, const char *what,
                                 int *fd_out) {
  if (numel > SIZE_MAX / sizeof(float))
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: unit too large", what);
  size_t total_bytes = (size_t)numel * sizeof(float);
  int fd = memfd_create("zerod-values", MFD_CLOEXEC);
  if (fd < 0)
    return set_error(ZD_E_IO, "%s: memfd_create: %s", what, strerror(errno));
  if (ftruncate(fd, (off_t)total_bytes) != 0) {
    int err = errno;
    close(fd);
    return set_error(ZD_E_IO, "%s: ftruncate of the values memfd to %zu bytes: %s", what,
                     total_bytes, strerror(err));
  }
  const char *bytes = (const char *)values;
  size_t written_bytes = 0;
  while (written_bytes < total_bytes) {
    ssize_t n =
        pwrite(fd, bytes + written_bytes, total_bytes - written_bytes, (off_t)written_bytes);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      int err = n < 0 ? errno : EIO;
      close(fd);
      return set_error(ZD_E_IO, "%s: writing the values memfd: %s", what, strerror(err));
    }
    written_bytes += (size_t)n;
  }
  *fd_out = fd;
  return ZD_OK;
}

/* Keeps the reply's placements and builds the unit's tensor tables. */
static zd_status unit_from_reply(client_unit *unit, const char *unit_name,
                                 const Zerod__V1__RegisterUnitReply *reply, zd_client *client,
                                 const char *what) {
  memset(unit, 0, sizeof *unit);
  unit->unit_id = reply->unit_id;
  unit->numel = reply->numel;
  unit->padded_numel = reply->padded_numel;
  if (dtype_from_proto(reply->working_dtype, &unit->working_dtype) != 0 ||
      dtype_from_proto(reply->grad_dtype, &unit->grad_dtype) != 0)
    return client_protocol_error(client, what, "unknown dtype in the register reply");
  size_t ntensors = reply->n_tensors;
  size_t total_dims = 0;
  for (size_t t = 0; t < ntensors; t++)
    total_dims += reply->tensors[t]->n_shape;
  unit->name = strdup(unit_name);
  unit->tensor_names = calloc(ntensors, sizeof *unit->tensor_names);
  unit->shapes = calloc(total_dims ? total_dims : 1, sizeof *unit->shapes);
  unit->gather_tensors = calloc(ntensors, sizeof *unit->gather_tensors);
  unit->grad_tensors = calloc(ntensors, sizeof *unit->grad_tensors);
  unit->info_tensors = calloc(ntensors, sizeof *unit->info_tensors);
  if (unit->name == NULL || unit->tensor_names == NULL || unit->shapes == NULL ||
      unit->gather_tensors == NULL || unit->grad_tensors == NULL || unit->info_tensors == NULL)
    return set_error(ZD_E_NOMEM, "%s: out of memory", what);
  unit->ntensors = (unsigned)ntensors;
  uint64_t *dims = unit->shapes;
  for (size_t t = 0; t < ntensors; t++) {
    const Zerod__V1__TensorPlacement *placement = reply->tensors[t];
    if ((unit->tensor_names[t] = strdup(placement->name)) == NULL)
      return set_error(ZD_E_NOMEM, "%s: out of memory", what);
    if (placement->n_shape > 0)
      memcpy(dims, placement->shape, placement->n_shape * sizeof *dims);
    zd_tensor_view view = {.name = unit->tensor_names[t],
                           .data = NULL,
                           .shape = dims,
                           .ndim = (unsigned)placement->n_shape,
                           .numel = placement->numel,
                           .offset = placement->offset};
    unit->gather_tensors[t] = view;
    unit->grad_tensors[t] = view;
    unit->info_tensors[t] = view;
    dims += placement->n_shape;
  }
  return ZD_OK;
}

/* The most units a job has (the daemon's limit, docs/protocol.md). */
#define MAX_UNITS_PER_JOB 65536
#define MAX_WORLD_SIZE    64 /* ranks of a job (the daemon's JOB_MAX_WORLD) */

/* frame.c checks a RegisterUnitReply's placements when it decodes one, but
 * not the same message nested in a UnitsReply, so a listed unit gets the
 * same checks here, and a name: every tensor lies inside the unit, and the
 * unit's sizes keep every byte count far from wrapping. Returns what is
 * wrong, or NULL. */
static const char *check_listed_unit(const Zerod__V1__RegisterUnitReply *unit) {
  const uint64_t max_numel = (uint64_t)1 << 48;
  if (unit->name == NULL || unit->name[0] == '\0' ||
      strnlen(unit->name, ZD_MAX_NAME_BYTES + 1) > ZD_MAX_NAME_BYTES)
    return "unit name is empty or longer than 256 bytes";
  if (unit->n_tensors == 0 || unit->n_tensors > ZD_MAX_TENSORS_PER_UNIT)
    return "unit has no tensors, or more than 4096";
  if (unit->numel > unit->padded_numel || unit->padded_numel > 2 * max_numel)
    return "numel above padded_numel, or padded_numel above 2^49";
  for (size_t t = 0; t < unit->n_tensors; t++) {
    const Zerod__V1__TensorPlacement *placement = unit->tensors[t];
    if (placement->name == NULL || placement->name[0] == '\0' ||
        strnlen(placement->name, ZD_MAX_NAME_BYTES + 1) > ZD_MAX_NAME_BYTES)
      return "tensor name is empty or longer than 256 bytes";
    if (placement->n_shape > ZD_MAX_DIMS)
      return "tensor has more than 8 dimensions";
    uint64_t numel = 1;
    for (size_t d = 0; d < placement->n_shape; d++) {
      if (placement->shape[d] == 0 || placement->shape[d] > max_numel / numel)
        return "tensor has a zero-sized dimension or more than 2^48 elements";
      numel *= placement->shape[d];
    }
    if (placement->numel != numel)
      return "tensor placement numel does not match its shape";
    if (placement->offset > unit->numel || numel > unit->numel - placement->offset)
      return "tensor placement lies outside the unit";
  }
  return NULL;
}

/* Whether a listed unit is the one this job already knows by its id. */
static int unit_matches_reply(const client_unit *unit, const Zerod__V1__RegisterUnitReply *reply) {
  zd_dtype working_dtype, grad_dtype;
  if (dtype_from_proto(reply->working_dtype, &working_dtype) != 0 ||
      dtype_from_proto(reply->grad_dtype, &grad_dtype) != 0)
    return 0;
  if (strcmp(unit->name, reply->name) != 0 || unit->ntensors != reply->n_tensors ||
      unit->numel != reply->numel || unit->padded_numel != reply->padded_numel ||
      unit->working_dtype != working_dtype || unit->grad_dtype != grad_dtype)
    return 0;
  for (unsigned t = 0; t < unit->ntensors; t++) {
    const Zerod__V1__TensorPlacement *placement = reply->tensors[t];
    const zd_tensor_view *known = &unit->info_tensors[t];
    if (strcmp(known->name, placement->name) != 0 || known->offset != placement->offset ||
        known->numel != placement->numel || known->ndim != placement->n_shape ||
        (placement->n_shape > 0 &&
         memcmp(known->shape, placement->shape, placement->n_shape * sizeof *known->shape) != 0))
      return 0;
  }
  return 1;
}

static zd_status check_unit_desc(const zd_unit_desc *desc, uint64_t *numel_out) {
  if (desc->name == NULL || desc->name[0] == '\0' || strlen(desc->name) > ZD_MAX_NAME_BYTES)
    return set_error(ZD_E_INVALID_ARGUMENT, "register unit: name must be 1..%d bytes",
                     ZD_MAX_NAME_BYTES);
  if (desc->tensors == NULL || desc->ntensors == 0 || desc->ntensors > ZD_MAX_TENSORS_PER_UNIT)
    return set_error(ZD_E_INVALID_ARGUMENT,
                     "register unit %s: needs 1..%d tensors (tensors %s, ntensors %u)", desc->name,
                     ZD_MAX_TENSORS_PER_UNIT, desc->tensors ? "set" : "NULL", desc->ntensors);
  if ((int)desc->init < 0 || desc->init > ZD_INIT_ZEROS)
    return set_error(ZD_E_INVALID_ARGUMENT, "register unit %s: unknown init mode %d", desc->name,
                     (int)desc->init);
  /* The cap keeps every byte count (numel * 4) far from overflowing. */
  const uint64_t max_numel = (uint64_t)1 << 48;
  uint64_t unit_numel = 0;
  for (unsigned t = 0; t < desc->ntensors; t++) {
    const zd_tensor_desc *tensor = &desc->tensors[t];
    if (tensor->name == NULL || tensor->name[0] == '\0' || strlen(tensor->name) > ZD_MAX_NAME_BYTES)
      return set_error(ZD_E_INVALID_ARGUMENT,
                       "register unit %s: tensor %u name must be 1..%d bytes", desc->name, t,
                       ZD_MAX_NAME_BYTES);
    if (tensor->ndim > ZD_MAX_DIMS || (tensor->ndim > 0 && tensor->shape == NULL))
      return set_error(ZD_E_INVALID_ARGUMENT,
                       "register unit %s: tensor %s needs a shape of at most %d dims", desc->name,
                       tensor->name, ZD_MAX_DIMS);
    uint64_t numel = 1;
    for (unsigned d = 0; d < tensor->ndim; d++) {
      if (tensor->shape[d] == 0 || tensor->shape[d] > max_numel / numel)
        return set_error(ZD_E_INVALID_ARGUMENT,
                         "register unit %s: tensor %s dim %u is 0 or the tensor has more than "
                         "2^48 elements",
                         desc->name, tensor->name, d);
      numel *= tensor->shape[d];
    }
    unit_numel += numel;
    if (unit_numel > max_numel)
      return set_error(ZD_E_INVALID_ARGUMENT, "register unit %s: more than 2^48 elements",
                       desc->name);
  }
  *numel_out = unit_numel;
  return ZD_OK;
}

zd_status zd_register_unit(zd_job *job, const zd_unit_desc *caller_desc, zd_unit *out) {
  if (caller_desc == NULL || out == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "register unit: desc and out must not be NULL");
  zd_unit_desc desc;
  zd_status status = copy_sized_struct(&desc, sizeof desc, caller_desc,
                                       offsetof(zd_unit_desc, ntensors) + sizeof desc.ntensors,
                                       "register unit: desc", "ZD_UNIT_DESC_INIT");
  if (status != ZD_OK)
    return status;
  uint64_t unit_numel = 0;
  if ((status = check_unit_desc(&desc, &unit_numel)) != ZD_OK)
    return status;
  char what[ZD_MAX_NAME_BYTES + 32];
  snprintf(what, sizeof what, "register unit %s", desc.name);
  if ((status = job_check_writable(job, what)) != ZD_OK)
    return status;
  zd_client *client = job->client;
  zd_init init = desc.init == 0 ? ZD_INIT_FROM_RANK0 : desc.init;
  int sends_values = init == ZD_INIT_FROM_RANK0 && job->rank == 0;
  if (sends_values && desc.init_values == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: ZD_INIT_FROM_RANK0 on rank 0 needs init_values",
                     what);
  if ((status = job_reserve_units(job, 1, what)) != ZD_OK)
    return status;

  Zerod__V1__TensorSpec *specs = calloc(desc.ntensors, sizeof *specs);
  Zerod__V1__TensorSpec **spec_ptrs = calloc(desc.ntensors, sizeof *spec_ptrs);
  if (specs == NULL || spec_ptrs == NULL) {
    free(specs);
    free(spec_ptrs);
    return set_error(ZD_E_NOMEM, "%s: out of memory", what);
  }
  for (unsigned t = 0; t < desc.ntensors; t++) {
    Zerod__V1__TensorSpec spec = ZEROD__V1__TENSOR_SPEC__INIT;
    /* protobuf-c's structs are not const-correct; packing only reads. */
    spec.name = (char *)desc.tensors[t].name;
    spec.n_shape = desc.tensors[t].ndim;
    spec.shape = (uint64_t *)desc.tensors[t].shape;
    spec.frozen = desc.tensors[t].frozen != 0;
    specs[t] = spec;
    spec_ptrs[t] = &specs[t];
  }
  Zerod__V1__RegisterUnitRequest request = ZEROD__V1__REGISTER_UNIT_REQUEST__INIT;
  request.name = (char *)desc.name;
  request.n_tensors = desc.ntensors;
  request.tensors = spec_ptrs;
  request.init = (Zerod__V1__InitMode)init;
  request.seed = desc.seed;
  request.init_std = desc.init_std;

  int init_fd = -1;
  if (sends_values)
    status = make_init_memfd(desc.init_values, unit_numel, what, &init_fd);
  ProtobufCMessage *reply_msg = NULL;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds = 0;
  if (status == ZD_OK)
    status = client_call(client, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &request.base, &init_fd,
                         init_fd >= 0 ? 1 : 0, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, what,
                         &reply_msg, fds, &nfds);
  /* The daemon has its own reference to the memfd once sendmsg returns. */
  if (init_fd >= 0)
    close(init_fd);
  free(specs);
  free(spec_ptrs);
  if (status != ZD_OK)
    return status;

  const Zerod__V1__RegisterUnitReply *reply = (const Zerod__V1__RegisterUnitReply *)reply_msg;
  if (reply->n_tensors != desc.ntensors) {
    size_t got = reply->n_tensors;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    return client_protocol_error(client, what, "reply has %zu tensors, the request had %u", got,
                                 desc.ntensors);
  }
  if (job_find_unit(job, reply->unit_id) != NULL) {
    /* Registering the same unit twice on one session returns its state;
     * the earlier entry already describes it. */
    *out = reply->unit_id;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    return client_finish(client);
  }
  client_unit unit;
  status = unit_from_reply(&unit, desc.name, reply, client, what);
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (status != ZD_OK) {
    unit_free(&unit);
    return status;
  }
  if (job->stable_addresses)
    unit_reserve_range(&unit, what);
  job_insert_unit(job, &unit);
  *out = unit.unit_id;
  return client_finish(client);
}

/* ------------------------------------------------------------------------
 * List, pin, load
 * ------------------------------------------------------------------------ */

zd_status zd_list_units(zd_job *job, unsigned *count) {
  char what[ZD_MAX_JOB_NAME_BYTES + 32];
  snprintf(what, sizeof what, "list units of job %s", job != NULL ? job->name : "(null)");
  zd_status status = job_check(job, what);
  if (status != ZD_OK)
    return status;
  zd_client *client = job->client;
  Zerod__V1__UnitsRequest request = ZEROD__V1__UNITS_REQUEST__INIT;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(client, ZEROD__V1__MSG_TYPE__MSG_UNITS, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_UNITS_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__UnitsReply *reply = (const Zerod__V1__UnitsReply *)reply_msg;
  if (reply->n_units > MAX_UNITS_PER_JOB) {
    size_t listed = reply->n_units;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    return client_protocol_error(client, what,
                                 "the listing has %zu units, more than the %d a job has", listed,
                                 MAX_UNITS_PER_JOB);
  }
  if ((status = job_reserve_units(job, reply->n_units, what)) != ZD_OK) {
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    return status;
  }
  /* Units this job knows already (registered, or listed before) keep their
   * entries, whose tables views may point into; the listing must agree
   * with them. A failure half way leaves the units added so far, each
   * complete. */
  for (size_t u = 0; u < reply->n_units; u++) {
    const Zerod__V1__RegisterUnitReply *listed = reply->units[u];
    const char *why = check_listed_unit(listed);
    client_unit *known = why == NULL ? job_find_unit(job, listed->unit_id) : NULL;
    if (why == NULL && known != NULL && !unit_matches_reply(known, listed))
      why = "its layout differs from the unit this job knows by that id";
    if (why != NULL) {
      unsigned unit_id = listed->unit_id;
      protobuf_c_message_free_unpacked(reply_msg, NULL);
      return client_protocol_error(client, what, "unit %u in the listing: %s", unit_id, why);
    }
    if (known != NULL)
      continue;
    client_unit unit;
    status = unit_from_reply(&unit, listed->name, listed, client, what);
    if (status != ZD_OK) {
      unit_free(&unit);
      protobuf_c_message_free_unpacked(reply_msg, NULL);
      return status;
    }
    if (job->stable_addresses)
      unit_reserve_range(&unit, what);
    job_insert_unit(job, &unit);
  }
  /* A pinned job's version is the pinned one, which only zd_pin moves. */
  if (!job->pinned)
    job->version = reply->version;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (count != NULL)
    *count = (unsigned)job->unit_count;
  return client_finish(client);
}

zd_status zd_pin(zd_job *job, uint64_t *version) {
  char what[ZD_MAX_JOB_NAME_BYTES + 32];
  snprintf(what, sizeof what, "pin job %s", job != NULL ? job->name : "(null)");
  zd_status status = job_check(job, what);
  if (status != ZD_OK)
    return status;
  if (!job->read_only)
    return set_error(ZD_E_FAILED_PRECONDITION,
                     "%s: only read-only jobs pin a version; this one is attached read-write and "
                     "follows its own steps",
                     what);
  Zerod__V1__PinRequest request = ZEROD__V1__PIN_REQUEST__INIT;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_PIN, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_PIN_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  job->version = ((const Zerod__V1__PinReply *)reply_msg)->version;
  job->pinned = 1;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (version != NULL)
    *version = job->version;
  return client_finish(job->client);
}

/* A counter's name from the daemon, into a fixed field: refused when it
 * does not fit (a daemon that sends one is broken). */
static int copy_name(char *to, size_t to_bytes, const char *from) {
  size_t n = strlen(from);
  if (n == 0 || n >= to_bytes)
    return -1;
  memcpy(to, from, n + 1);
  return 0;
}

zd_status zd_job_stats(zd_job *job, zd_rank_stats *out, unsigned max, unsigned *nranks) {
  char what[ZD_MAX_JOB_NAME_BYTES + 32];
  snprintf(what, sizeof what, "stats of job %s", job != NULL ? job->name : "(null)");
  zd_status status = job_check(job, what);
  if (status != ZD_OK)
    return status;
  if ((out == NULL && max > 0) || nranks == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: out (for max > 0) and nranks must not be NULL",
                     what);
  Zerod__V1__StatsRequest request = ZEROD__V1__STATS_REQUEST__INIT;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_STATS, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_STATS_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__StatsReply *reply = (const Zerod__V1__StatsReply *)reply_msg;
  const char *why = reply->n_ranks > MAX_WORLD_SIZE ? "more ranks than a job has" : NULL;
  for (size_t r = 0; why == NULL && r < reply->n_ranks; r++) {
    const Zerod__V1__RankStats *rank = reply->ranks[r];
    if (rank->n_counters > ZD_MAX_COLLECTIVE_COUNTERS) {
      why = "more counters than there are levels and collectives";
      break;
    }
    if (r >= max)
      continue;
    zd_rank_stats *o = &out[r];
    memset(o, 0, sizeof *o);
    o->rank = rank->rank;
    o->step = rank->step;
    o->pool_bytes = rank->pool_bytes;
    o->secondary_bytes = rank->secondary_bytes;
    o->state_bytes = rank->state_bytes;
    o->tier_bytes = rank->tier_bytes;
    o->ncounters = (unsigned)rank->n_counters;
    for (size_t k = 0; k < rank->n_counters; k++) {
      const Zerod__V1__CollectiveCounter *c = rank->counters[k];
      if (copy_name(o->counters[k].level, sizeof o->counters[k].level, c->level) != 0 ||
          copy_name(o->counters[k].collective, sizeof o->counters[k].collective, c->collective) !=
              0) {
        why = "a counter's name is empty or too long";
        break;
      }
      o->counters[k].bytes = c->bytes;
      o->counters[k].calls = c->calls;
    }
  }
  size_t listed = reply->n_ranks;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (why != NULL)
    return client_protocol_error(job->client, what, "the stats reply has %s", why);
  *nranks = (unsigned)listed;
  return client_finish(job->client);
}

zd_status zd_load_unit(zd_job *job, zd_unit unit_id, const float *values, uint64_t *version) {
  return zd_load_state(job, unit_id, ZD_STATE_WEIGHTS, values, NULL, version);
}

static uint64_t unit_values_numel(const client_unit *unit) {
  uint64_t numel = 0;
  for (unsigned t = 0; t < unit->ntensors; t++)
    numel += unit->info_tensors[t].numel;
  return numel;
}

/* unit_call_begin of a writable call on one of the unit's states. */
static zd_status state_call_begin(zd_job *job, zd_unit unit_id, const char *verb,
                                  zd_unit_state state, char *what, size_t what_bytes,
                                  client_unit **unit) {
  zd_status status = unit_call_begin(job, unit_id, verb, 1, what, what_bytes, unit);
  if (status == ZD_OK && ((int)state < ZD_STATE_WEIGHTS || state > ZD_STATE_MOMENT2))
    status = set_error(ZD_E_INVALID_ARGUMENT, "%s: unknown state %d", what, (int)state);
  return status;
}

zd_status zd_load_state(zd_job *job, zd_unit unit_id, zd_unit_state state, const float *values,
                        const uint64_t *step, uint64_t *version) {
  char what[64];
  client_unit *unit;
  zd_status status = state_call_begin(job, unit_id, "load", state, what, sizeof what, &unit);
  if (status != ZD_OK)
    return status;
  /* Like ZD_INIT_FROM_RANK0: rank 0 sends every tensor's values back to
   * back, without the layout's alignment gaps; the others send nothing. */
  int sends_values = job->rank == 0;
  if (sends_values && values == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT,
                     "%s: rank 0 must pass the unit's values (values is NULL)", what);
  uint64_t values_numel = unit_values_numel(unit);
  int values_fd = -1;
  if (sends_values && (status = make_init_memfd(values, values_numel, what, &values_fd)) != ZD_OK)
    return status;
  Zerod__V1__LoadUnitRequest request = ZEROD__V1__LOAD_UNIT_REQUEST__INIT;
  request.unit_id = unit_id;
  request.state = (Zerod__V1__UnitState)state;
  request.set_step = step != NULL;
  request.step = step != NULL ? *step : 0;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT, &request.base, &values_fd,
                       values_fd >= 0 ? 1 : 0, ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT_REPLY, what,
                       &reply_msg, fds, &nfds);
  /* The daemon has its own reference to the memfd once sendmsg returns. */
  if (values_fd >= 0)
    close(values_fd);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__LoadUnitReply *reply = (const Zerod__V1__LoadUnitReply *)reply_msg;
  uint32_t reply_unit = reply->unit_id;
  uint64_t reply_version = reply->version;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (reply_unit != unit_id)
    return client_protocol_error(job->client, what, "load reply is for unit %u", reply_unit);
  job->version = reply_version;
  if (version != NULL)
    *version = reply_version;
  return client_finish(job->client);
}

zd_status zd_read_state(zd_job *job, zd_unit unit_id, zd_unit_state state, float *out, size_t numel,
                        uint64_t *step) {
  char what[64];
  client_unit *unit;
  zd_status status =
      state_call_begin(job, unit_id, "read state of", state, what, sizeof what, &unit);
  if (status != ZD_OK)
    return status;
  uint64_t want = unit_values_numel(unit);
  if (out == NULL || numel != want)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: out must hold the unit's %llu values (numel %zu)",
                     what, (unsigned long long)want, numel);
  Zerod__V1__ReadStateRequest request = ZEROD__V1__READ_STATE_REQUEST__INIT;
  request.unit_id = unit_id;
  request.state = (Zerod__V1__UnitState)state;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_READ_STATE, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_READ_STATE_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__ReadStateReply *reply = (const Zerod__V1__ReadStateReply *)reply_msg;
  uint32_t reply_unit = reply->unit_id;
  uint64_t reply_numel = reply->numel, reply_step = reply->step;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  const char *bad = reply_unit != unit_id ? "the reply is for another unit"
                    : nfds != 1           ? "the reply carries no values"
                    : reply_numel != want ? "the reply's value count is not the unit's"
                                          : NULL;
  if (bad != NULL) {
    for (unsigned i = 0; i < nfds; i++)
      close(fds[i]);
    return client_protocol_error(job->client, what, "%s", bad);
  }
  /* pread, never mmap: like the daemon with a worker's descriptors. */
  size_t bytes = (size_t)want * sizeof(float), done = 0;
  while (done < bytes) {
    ssize_t got = pread(fds[0], (char *)out + done, bytes - done, (off_t)done);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0) {
      int err = got < 0 ? errno : EIO;
      close(fds[0]);
      return set_error(ZD_E_IO, "%s: reading the values: %s", what, strerror(err));
    }
    done += (size_t)got;
  }
  close(fds[0]);
  if (step != NULL)
    *step = reply_step;
  return client_finish(job->client);
}

/* ------------------------------------------------------------------------
 * Buffers and views
 * ------------------------------------------------------------------------ */

static buffer_mapping *mapping_find(zd_client *client, buffer_kind kind, uint32_t buffer_id) {
  for (size_t i = 0; i < client->mapping_count; i++) {
    if (client->mappings[i].kind == kind && client->mappings[i].buffer_id == buffer_id)
      return &client->mappings[i];
  }
  return NULL;
}

/* Adds an entry to the cache, or replaces `found` (the old buffer behind
 * the same id). Takes the mapping's resources either way. */
static zd_status store_mapping(zd_client *client, buffer_mapping *found,
                               const buffer_mapping *mapping, const char *what,
                               buffer_mapping **out, int *replaced) {
  if (found != NULL) {
    /* The daemon replaced the buffer behind this id with one of another
     * size; views of the old one are only valid until their release. */
    mapping_free(found);
    *found = *mapping;
    *replaced = 1;
    *out = found;
    return ZD_OK;
  }
  if (client->mapping_count == client->mapping_capacity) {
    size_t capacity = client->mapping_capacity ? client->mapping_capacity * 2 : 16;
    buffer_mapping *mappings = realloc(client->mappings, capacity * sizeof *mappings);
    if (mappings == NULL) {
      buffer_mapping dropped = *mapping;
      mapping_free(&dropped);
      return set_error(ZD_E_NOMEM, "%s: out of memory", what);
    }
    client->mappings = mappings;
    client->mapping_capacity = capacity;
  }
  client->mappings[client->mapping_count] = *mapping;
  *out = &client->mappings[client->mapping_count++];
  return ZD_OK;
}

/* Opens a GPU buffer from its CUDA IPC handles, on the calling thread's
 * current device (cudaIpcOpenMemHandle maps it there, with peer access
 * where the daemon's device is another). */
static zd_status open_cuda_buffer(zd_client *client, buffer_kind kind, uint32_t buffer_id,
                                  uint64_t buffer_bytes, const cuda_handles *cuda,
                                  buffer_mapping *found, const char *what, buffer_mapping **out,
                                  int *replaced) {
  if (found != NULL && found->device >= 0 && found->bytes == buffer_bytes) {
    *out = found; /* the handles of a buffer already open: nothing new */
    return ZD_OK;
  }
  if (buffer_bytes == 0 || (uint64_t)(size_t)buffer_bytes != buffer_bytes)
    return client_protocol_error(client, what, "GPU buffer %u has an invalid size %llu",
                                 (unsigned)buffer_id, (unsigned long long)buffer_bytes);
  char why[512] = "";
  const zk_cuda_api *api = cuda_api(why, sizeof why);
  if (api == NULL)
    return set_error(ZD_E_FAILED_PRECONDITION,
                     "%s: zerod keeps this job on GPU %d (zerod --device cuda), but this process "
                     "cannot use CUDA: %s",
                     what, cuda->device, why);
  buffer_mapping mapping = {.kind = kind,
                            .buffer_id = buffer_id,
                            .bytes = (size_t)buffer_bytes,
                            .fd = -1,
                            .device = cuda->device};
  if (api->ipc_mem_open(cuda->mem_handle, &mapping.base) != 0)
    return set_error(ZD_E_IO, "%s: opening GPU buffer %u (device %d, %llu bytes): %s", what,
                     (unsigned)buffer_id, cuda->device, (unsigned long long)buffer_bytes,
                     api->last_error());
  if (api->ipc_event_open(cuda->event_handle, &mapping.event) != 0) {
    zd_status status = set_error(ZD_E_IO, "%s: opening the event of GPU buffer %u: %s", what,
                                 (unsigned)buffer_id, api->last_error());
    api->ipc_mem_close(mapping.base);
    return status;
  }
  return store_mapping(client, found, &mapping, what, out, replaced);
}

/* Finds or creates the entry of a buffer. A descriptor (or a GPU buffer's
 * handles) comes only the first time this session sees a buffer id; later
 * replies name it. With keep_fd the descriptor is kept for stable-address
 * mapping and nothing is mapped here; otherwise the buffer is mapped once
 * and the descriptor closed. *replaced is set when a descriptor replaced
 * the buffer behind a known id, so that whoever mapped the old one maps
 * again. */
static zd_status take_buffer(zd_client *client, buffer_kind kind, uint32_t buffer_id,
                             uint64_t buffer_bytes, int *fds, unsigned nfds,
                             const cuda_handles *cuda, int keep_fd, const char *what,
                             buffer_mapping **out, int *replaced) {
  *replaced = 0;
  buffer_mapping *found = mapping_find(client, kind, buffer_id);
  if (cuda->present && nfds > 0) {
    close_fds(fds, nfds);
    return client_protocol_error(client, what,
                                 "reply carries both a descriptor and GPU handles for buffer %u",
                                 (unsigned)buffer_id);
  }
  if (cuda->present)
    return open_cuda_buffer(client, kind, buffer_id, buffer_bytes, cuda, found, what, out,
                            replaced);
  if (found != NULL && found->device < 0 && (keep_fd ? found->fd < 0 : found->base == NULL))
    found = NULL; /* never happens in one session: stable_addresses is per job */
  if (nfds == 0) {
    if (found == NULL)
      return client_protocol_error(client, what,
                                   "reply names buffer %u without a descriptor, and this "
                                   "session has not seen that buffer",
                                   (unsigned)buffer_id);
    if (found->bytes != buffer_bytes)
      return client_protocol_error(client, what, "buffer %u is %llu bytes, but was mapped with %zu",
                                   (unsigned)buffer_id, (unsigned long long)buffer_bytes,
                                   found->bytes);
    *out = found;
    return ZD_OK;
  }

  int fd = fds[0];
  if (found != NULL && found->device < 0 && found->bytes == buffer_bytes) {
    close(fd);
    *out = found;
    return ZD_OK;
  }
  /* Mapping past the end of a memfd would turn every later access into
   * SIGBUS, so the size is checked before the worker can touch it. */
  struct stat st;
  if (buffer_bytes == 0 || (uint64_t)(size_t)buffer_bytes != buffer_bytes || fstat(fd, &st) != 0 ||
      (uint64_t)st.st_size < buffer_bytes) {
    close(fd);
    return client_protocol_error(client, what, "buffer %u descriptor is smaller than %llu bytes",
                                 (unsigned)buffer_id, (unsigned long long)buffer_bytes);
  }
  buffer_mapping mapping = {.kind = kind,
                            .buffer_id = buffer_id,
                            .base = NULL,
                            .bytes = (size_t)buffer_bytes,
                            .fd = keep_fd ? fd : -1,
                            .device = -1};
  if (!keep_fd) {
    int prot = kind == BUFFER_GRAD ? PROT_READ | PROT_WRITE : PROT_READ;
    void *base = mmap(NULL, (size_t)buffer_bytes, prot, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);
    if (base == MAP_FAILED)
      return set_error(ZD_E_IO, "%s: mmap of buffer %u (%llu bytes): %s", what, (unsigned)buffer_id,
                       (unsigned long long)buffer_bytes, strerror(err));
    mapping.base = base;
  }
  return store_mapping(client, found, &mapping, what, out, replaced);
}

/* The buffer mapped (or opened) once and cached by id: every buffer of a
 * job without stable addresses, every gradient buffer, every GPU buffer. */
static zd_status map_buffer(zd_client *client, buffer_kind kind, uint32_t buffer_id,
                            uint64_t buffer_bytes, int *fds, unsigned nfds,
                            const cuda_handles *cuda, const char *what,
                            buffer_mapping **mapping_out) {
  int replaced;
  return take_buffer(client, kind, buffer_id, buffer_bytes, fds, nfds, cuda, 0, what, mapping_out,
                     &replaced);
}

/* Whether a reply's buffer is a GPU buffer: its handles came with it, or
 * they came before. */
static int is_cuda_buffer(zd_client *client, buffer_kind kind, uint32_t buffer_id,
                          const cuda_handles *cuda) {
  const buffer_mapping *mapping = mapping_find(client, kind, buffer_id);
  return cuda->present || (mapping != NULL && mapping->device >= 0);
}

/* Copies a reply's CudaBuffer (checked by frame.c: 64-byte handles, a
 * device in range) before the reply is freed. */
static void copy_cuda_handles(const Zerod__V1__CudaBuffer *in, cuda_handles *out) {
  memset(out, 0, sizeof *out);
  if (in == NULL)
    return;
  out->present = 1;
  out->device = in->device;
  memcpy(out->mem_handle, in->mem_handle.data, sizeof out->mem_handle);
  memcpy(out->event_handle, in->event_handle.data, sizeof out->event_handle);
}

/* Maps a stable-address job's gathered buffer over the unit's own range
 * and returns the range's address, the same for every gather of the unit.
 * A unit gathered again into the buffer it still maps keeps the mapping. */
static zd_status map_stable(zd_client *client, client_unit *unit, uint32_t buffer_id,
                            uint64_t buffer_bytes, int *fds, unsigned nfds, const char *what,
                            void **base_out, size_t *bytes_out) {
  buffer_mapping *mapping;
  int replaced;
  static const cuda_handles no_cuda = {0};
  zd_status status = take_buffer(client, BUFFER_GATHERED, buffer_id, buffer_bytes, fds, nfds,
                                 &no_cuda, 1, what, &mapping, &replaced);
  if (status != ZD_OK)
    return status;
  /* The whole range is mapped, so the buffer must hold the whole layout:
   * a range page wholly past the end of the memfd would raise SIGBUS. */
  uint64_t layout_bytes = unit_gathered_bytes(unit);
  if (buffer_bytes < layout_bytes)
    return client_protocol_error(
        client, what, "buffer %u is %llu bytes, less than the unit's %llu-byte layout",
        (unsigned)buffer_id, (unsigned long long)buffer_bytes, (unsigned long long)layout_bytes);
  if ((status = unit_reserve_range(unit, what)) != ZD_OK)
    return status;
  if (unit->held_gather_buffer != buffer_id || replaced) {
    void *base = mmap(unit->stable_base, unit->stable_bytes, PROT_READ,
                      MAP_SHARED | MAP_FIXED | MAP_POPULATE, mapping->fd, 0);
    if (base == MAP_FAILED) {
      int err = errno;
      unit->held_gather_buffer = 0;
      unit_cover_range(unit, what);
      return set_error(ZD_E_IO, "%s: mmap of buffer %u at the unit's stable address %p: %s", what,
                       (unsigned)buffer_id, unit->stable_base, strerror(err));
    }
  }
  *base_out = unit->stable_base;
  *bytes_out = buffer_bytes < unit->stable_bytes ? (size_t)buffer_bytes : unit->stable_bytes;
  return ZD_OK;
}

/* The daemon freed these buffers: each is unmapped, its kept descriptor
 * closed (so that this process no longer keeps the memory alive), and its
 * id forgotten. The daemon drops only buffers this session does not hold,
 * and numbers both kinds from one counter, so every entry with the id goes,
 * except one that a view handed out still points into and may still use by
 * contract (a gathered view until its release, a gradient view until its
 * reduce): unmapping that would crash the worker for a daemon bug, so the
 * entry stays, until zd_close. */
static void forget_dropped_buffers(zd_client *client, const uint32_t *buffer_ids, size_t count) {
  if (count == 0)
    return;
  /* One pass over the units marks the held entries, so that the cost is
   * linear in units plus dropped ids times entries, however long the list
   * (the daemon drops many buffers at once when it trims its pool). */
  for (size_t i = 0; i < client->mapping_count; i++)
    client->mappings[i].held = 0;
  for (const zd_job *job = client->jobs; job != NULL; job = job->next) {
    for (size_t u = 0; u < job->unit_count; u++) {
      const client_unit *unit = &job->units[u];
      buffer_mapping *mapping;
      if (unit->held_gather_buffer != 0 &&
          (mapping = mapping_find(client, BUFFER_GATHERED, unit->held_gather_buffer)) != NULL)
        mapping->held = 1;
      if (unit->held_grad_buffer != 0 &&
          (mapping = mapping_find(client, BUFFER_GRAD, unit->held_grad_buffer)) != NULL)
        mapping->held = 1;
    }
  }
  for (size_t d = 0; d < count; d++) {
    size_t i = 0;
    while (i < client->mapping_count) {
      buffer_mapping *mapping = &client->mappings[i];
      if (mapping->buffer_id != buffer_ids[d] || mapping->held) {
        i++;
        continue;
      }
      mapping_free(mapping);
      client->mappings[i] = client->mappings[--client->mapping_count];
    }
  }
}

/* Closes every GPU buffer's handles (at detach: the daemon may free the
 * allocations once the session has ended, and an importer should not keep
 * handles to freed memory open). Shared-memory mappings stay until
 * zd_close, as views may still point into them. */
static void close_cuda_buffers(zd_client *client) {
  size_t i = 0;
  while (i < client->mapping_count) {
    if (client->mappings[i].device < 0) {
      i++;
      continue;
    }
    mapping_free(&client->mappings[i]);
    client->mappings[i] = client->mappings[--client->mapping_count];
  }
}

/* Points the unit's tensor table into a buffer and fills the view. Every
 * tensor must lie inside the buffer, or the worker would read past it.
 * gpu is the GPU buffer's entry, or NULL for shared memory. */
static zd_status fill_view(zd_client *client, client_unit *unit, zd_tensor_view *tensors,
                           void *base, uint64_t buffer_bytes, zd_dtype dtype, uint64_t version,
                           const buffer_mapping *gpu, const char *what, zd_view *out) {
  size_t elem_bytes = dtype_bytes(dtype);
  for (unsigned t = 0; t < unit->ntensors; t++) {
    uint64_t end = tensors[t].offset + tensors[t].numel;
    if (end > buffer_bytes / elem_bytes)
      return client_protocol_error(client, what,
                                   "tensor %s (elements %llu..%llu, %s) lies outside the "
                                   "%llu-byte buffer",
                                   tensors[t].name, (unsigned long long)tensors[t].offset,
                                   (unsigned long long)end, dtype_name(dtype),
                                   (unsigned long long)buffer_bytes);
    tensors[t].data = (char *)base + tensors[t].offset * elem_bytes;
  }
  out->base = base;
  out->bytes = (size_t)buffer_bytes;
  out->dtype = dtype;
  out->version = version;
  out->ntensors = unit->ntensors;
  out->tensors = tensors;
  out->device = gpu != NULL ? gpu->device : -1;
  out->event = gpu != NULL ? gpu->event : NULL;
  return ZD_OK;
}

/* ------------------------------------------------------------------------
 * Gather, release, gradients, reduce
 * ------------------------------------------------------------------------ */

zd_status zd_gather_async(zd_job *job, zd_unit unit_id, zd_pending *out) {
  char what[64];
  client_unit *unit;
  zd_status status = unit_call_begin(job, unit_id, "gather", 0, what, sizeof what, &unit);
  if (status != ZD_OK)
    return status;
  if (out == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: out is NULL", what);
  Zerod__V1__GatherRequest request = ZEROD__V1__GATHER_REQUEST__INIT;
  request.unit_id = unit_id;
  uint64_t request_id;
  status = client_send(job->client, ZEROD__V1__MSG_TYPE__MSG_GATHER, &request.base, NULL, 0, 1,
                       what, &request_id);
  if (status != ZD_OK)
    return status;
  out->request_id = request_id;
  out->unit = unit_id;
  return ZD_OK;
}

zd_status zd_gather_wait(zd_job *job, const zd_pending *pending, zd_view *out) {
  if (pending == NULL || out == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "gather: pending and out must not be NULL");
  char what[64];
  snprintf(what, sizeof what, "gather unit %u", (unsigned)pending->unit);
  zd_status status = job_check(job, what);
  if (status != ZD_OK)
    return status;
  zd_client *client = job->client;
  client_unit *unit = job_find_unit(job, pending->unit);
  if (unit == NULL || pending->request_id == 0 || expected_find(client, pending->request_id) < 0)
    return set_error(ZD_E_INVALID_ARGUMENT,
                     "%s: no gather in flight with request id %llu (waited twice?)", what,
                     (unsigned long long)pending->request_id);

  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_wait(client, pending->request_id, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, what,
                       &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__GatherReply *reply = (const Zerod__V1__GatherReply *)reply_msg;
  uint32_t buffer_id = reply->buffer_id;
  uint64_t buffer_bytes = reply->buffer_bytes;
  uint64_t version = reply->version;
  uint32_t reply_unit = reply->unit_id;
  cuda_handles cuda;
  copy_cuda_handles(reply->cuda, &cuda);
  /* The protocol has drops handled before the rest of the reply. */
  forget_dropped_buffers(client, reply->dropped_buffer_ids, reply->n_dropped_buffer_ids);
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (reply_unit != pending->unit) {
    close_fds(fds, nfds);
    return client_protocol_error(client, what, "gather reply is for unit %u", reply_unit);
  }
  void *base = NULL;
  size_t view_bytes = (size_t)buffer_bytes;
  buffer_mapping *gpu = NULL;
  /* GPU memory cannot be mapped at a reserved host address: a GPU buffer
   * is always used where CUDA opened it, stable_addresses or not. */
  if (job->stable_addresses && !is_cuda_buffer(client, BUFFER_GATHERED, buffer_id, &cuda)) {
    status = map_stable(client, unit, buffer_id, buffer_bytes, fds, nfds, what, &base, &view_bytes);
  } else {
    buffer_mapping *mapping;
    status = map_buffer(client, BUFFER_GATHERED, buffer_id, buffer_bytes, fds, nfds, &cuda, what,
                        &mapping);
    if (status == ZD_OK) {
      base = mapping->base;
      gpu = mapping->device >= 0 ? mapping : NULL;
    }
  }
  if (status != ZD_OK)
    return status;
  unit->held_gather_buffer = buffer_id;
  status = fill_view(client, unit, unit->gather_tensors, base, view_bytes, unit->working_dtype,
                     version, gpu, what, out);
  if (status != ZD_OK)
    return status;
  return client_finish(client);
}

zd_status zd_gather(zd_job *job, zd_unit unit_id, zd_view *out) {
  if (out == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "gather unit %u: out is NULL", (unsigned)unit_id);
  zd_pending pending;
  zd_status status = zd_gather_async(job, unit_id, &pending);
  if (status != ZD_OK)
    return status;
  return zd_gather_wait(job, &pending, out);
}

static void remember_no_reply(zd_client *client, uint64_t request_id, zd_unit unit,
                              const char *kind) {
  client->no_reply[client->no_reply_next].request_id = request_id;
  client->no_reply[client->no_reply_next].unit = unit;
  client->no_reply[client->no_reply_next].kind = kind;
  client->no_reply_next = (client->no_reply_next + 1) % NO_REPLY_RING;
}

/* Release is on every layer's critical path, so it costs one send and no
 * round trip: it goes out with NO_REPLY, and an error the daemon answers
 * anyway is kept as a deferred error for the next call that waits. */
zd_status zd_release(zd_job *job, zd_unit unit_id) {
  char what[64];
  client_unit *unit;
  zd_status status = unit_call_begin(job, unit_id, "release", 0, what, sizeof what, &unit);
  if (status != ZD_OK)
    return status;
  zd_client *client = job->client;
  /* The worker is done with the view: a stable range stops mapping the
   * daemon's buffer before the daemon may reuse or free it. */
  zd_status cover_status = ZD_OK;
  if (job->stable_addresses && unit->held_gather_buffer != 0)
    cover_status = unit_cover_range(unit, what);
  unit->held_gather_buffer = 0;
  Zerod__V1__ReleaseRequest request = ZEROD__V1__RELEASE_REQUEST__INIT;
  request.unit_id = unit_id;
  uint64_t request_id;
  status = client_send(client, ZEROD__V1__MSG_TYPE__MSG_RELEASE, &request.base, NULL, 0, 0, what,
                       &request_id);
  if (status != ZD_OK)
    return status;
  remember_no_reply(client, request_id, unit_id, "release");
  /* The release went out all the same; the error says what happened to the
   * range (set by unit_cover_range). */
  return cover_status;
}

zd_status zd_grad_buffer(zd_job *job, zd_unit unit_id, zd_view *out) {
  char what[64];
  client_unit *unit;
  zd_status status = unit_call_begin(job, unit_id, "grad buffer", 1, what, sizeof what, &unit);
  if (status != ZD_OK)
    return status;
  if (out == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: out is NULL", what);
  zd_client *client = job->client;
  Zerod__V1__GradBufferRequest request = ZEROD__V1__GRAD_BUFFER_REQUEST__INIT;
  request.unit_id = unit_id;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(client, ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__GradBufferReply *reply = (const Zerod__V1__GradBufferReply *)reply_msg;
  uint32_t buffer_id = reply->buffer_id;
  uint64_t buffer_bytes = reply->buffer_bytes;
  uint32_t reply_unit = reply->unit_id;
  cuda_handles cuda;
  copy_cuda_handles(reply->cuda, &cuda);
  forget_dropped_buffers(client, reply->dropped_buffer_ids, reply->n_dropped_buffer_ids);
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (reply_unit != unit_id) {
    close_fds(fds, nfds);
    return client_protocol_error(client, what, "grad buffer reply is for unit %u", reply_unit);
  }
  buffer_mapping *mapping;
  status =
      map_buffer(client, BUFFER_GRAD, buffer_id, buffer_bytes, fds, nfds, &cuda, what, &mapping);
  if (status != ZD_OK)
    return status;
  unit->held_grad_buffer = buffer_id;
  status =
      fill_view(client, unit, unit->grad_tensors, mapping->base, buffer_bytes, unit->grad_dtype,
                job->version, mapping->device >= 0 ? mapping : NULL, what, out);
  if (status != ZD_OK)
    return status;
  return client_finish(client);
}

/* Sends a REDUCE of the unit; with wait, waits for its reply. Without, the
 * request goes out with NO_REPLY, like a release: the daemon runs a rank's
 * requests in order, so the unit's next gradient buffer (or the step) is
 * answered only once this reduce has read the buffer, and an error is
 * reported by the next call that waits for the daemon. */
static zd_status reduce_unit(zd_job *job, zd_unit unit_id, int wait) {
  char what[64];
  client_unit *unit;
  zd_status status = unit_call_begin(job, unit_id, "reduce", 1, what, sizeof what, &unit);
  if (status != ZD_OK)
    return status;
  Zerod__V1__ReduceRequest request = ZEROD__V1__REDUCE_REQUEST__INIT;
  request.unit_id = unit_id;
  if (wait) {
    ProtobufCMessage *reply_msg;
    int fds[ZD_FRAME_MAX_FDS];
    unsigned nfds;
    status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_REDUCE, &request.base, NULL, 0,
                         ZEROD__V1__MSG_TYPE__MSG_REDUCE_REPLY, what, &reply_msg, fds, &nfds);
    if (status != ZD_OK)
      return status;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
  } else {
    uint64_t request_id;
    status = client_send(job->client, ZEROD__V1__MSG_TYPE__MSG_REDUCE, &request.base, NULL, 0, 0,
                         what, &request_id);
    if (status != ZD_OK)
      return status;
    remember_no_reply(job->client, request_id, unit_id, "reduce");
  }
  /* The gradient buffer is consumed: the next backward asks for one again. */
  unit->held_grad_buffer = 0;
  return wait ? client_finish(job->client) : ZD_OK;
}

zd_status zd_reduce(zd_job *job, zd_unit unit_id) {
  return reduce_unit(job, unit_id, 1);
}

zd_status zd_reduce_async(zd_job *job, zd_unit unit_id) {
  return reduce_unit(job, unit_id, 0);
}

/* ------------------------------------------------------------------------
 * Step and detach
 * ------------------------------------------------------------------------ */

zd_status zd_step(zd_job *job, const zd_step_options *caller_options, zd_step_result *out) {
  const char *what = "step";
  zd_status status = job_check_writable(job, what);
  if (status != ZD_OK)
    return status;
  zd_step_options options;
  memset(&options, 0, sizeof options);
  if (caller_options != NULL &&
      (status =
           copy_sized_struct(&options, sizeof options, caller_options, sizeof options.struct_size,
                             "step: options", "ZD_STEP_OPTIONS_INIT")) != ZD_OK)
    return status;
  Zerod__V1__StepRequest request = ZEROD__V1__STEP_REQUEST__INIT;
  request.set_lr = options.set_lr != 0;
  request.lr = options.lr;
  request.set_max_grad_norm = options.set_max_grad_norm != 0;
  request.max_grad_norm = options.max_grad_norm;
  request.grad_scale = options.grad_scale;
  if (options.ngroup_lr != 0 && options.group_lr == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "step: group_lr is NULL with ngroup_lr %u",
                     options.ngroup_lr);
  request.n_group_lr = options.ngroup_lr;
  request.group_lr = (double *)options.group_lr;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_STEP, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__StepReply *reply = (const Zerod__V1__StepReply *)reply_msg;
  job->version = reply->version;
  job->loss_scale = reply->loss_scale;
  if (out != NULL) {
    out->step = reply->step;
    out->version = reply->version;
    out->grad_norm = reply->grad_norm;
    out->skipped = reply->skipped;
    out->loss_scale = reply->loss_scale;
  }
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  return client_finish(job->client);
}

zd_status zd_set_groups(zd_job *job, const zd_param_group *groups, unsigned ngroups,
                        const zd_unit *units, const unsigned *const *tensor_groups,
                        unsigned nunits) {
  const char *what = "set groups";
  zd_status status = job_check_writable(job, what);
  if (status != ZD_OK)
    return status;
  if (groups == NULL || ngroups == 0 || (nunits != 0 && (units == NULL || tensor_groups == NULL)))
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: groups, units and tensor_groups must be given",
                     what);
  Zerod__V1__OptimizerConfig *configs = calloc(ngroups, sizeof *configs);
  Zerod__V1__OptimizerConfig **config_ptrs = calloc(ngroups, sizeof *config_ptrs);
  Zerod__V1__UnitGroups *unit_groups = calloc(nunits + 1, sizeof *unit_groups);
  Zerod__V1__UnitGroups **unit_ptrs = calloc(nunits + 1, sizeof *unit_ptrs);
  uint32_t **indices = calloc(nunits + 1, sizeof *indices);
  if (configs == NULL || config_ptrs == NULL || unit_groups == NULL || unit_ptrs == NULL ||
      indices == NULL) {
    status = set_error(ZD_E_NOMEM, "%s: out of memory", what);
    goto done;
  }
  for (unsigned g = 0; g < ngroups; g++) {
    Zerod__V1__OptimizerConfig *c = &configs[g];
    zerod__v1__optimizer_config__init(c);
    c->lr = groups[g].lr;
    c->beta1 = groups[g].beta1;
    c->beta2 = groups[g].beta2;
    c->eps = groups[g].eps;
    c->weight_decay = groups[g].weight_decay;
    c->has_weight_decay = groups[g].has_weight_decay != 0;
    c->momentum = groups[g].momentum;
    c->dampening = groups[g].dampening;
    c->nesterov = groups[g].nesterov != 0;
    config_ptrs[g] = c;
  }
  for (unsigned u = 0; u < nunits; u++) {
    client_unit *unit = job_find_unit(job, units[u]);
    if (unit == NULL) {
      status = set_error(ZD_E_INVALID_ARGUMENT, "%s: unit %u is not known to this job", what,
                         (unsigned)units[u]);
      goto done;
    }
    indices[u] = calloc(unit->ntensors + 1, sizeof *indices[u]);
    if (indices[u] == NULL) {
      status = set_error(ZD_E_NOMEM, "%s: out of memory", what);
      goto done;
    }
    for (unsigned t = 0; t < unit->ntensors; t++)
      indices[u][t] = tensor_groups[u][t];
    zerod__v1__unit_groups__init(&unit_groups[u]);
    unit_groups[u].unit_id = units[u];
    unit_groups[u].n_tensor_group = unit->ntensors;
    unit_groups[u].tensor_group = indices[u];
    unit_ptrs[u] = &unit_groups[u];
  }
  Zerod__V1__SetGroupsRequest request = ZEROD__V1__SET_GROUPS_REQUEST__INIT;
  request.n_groups = ngroups;
  request.groups = config_ptrs;
  request.n_units = nunits;
  request.units = unit_ptrs;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS_REPLY, what, &reply_msg, fds, &nfds);
  if (status == ZD_OK) {
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    status = client_finish(job->client);
  }
done:
  for (unsigned u = 0; indices != NULL && u < nunits; u++)
    free(indices[u]);
  free(indices);
  free(unit_ptrs);
  free(unit_groups);
  free(config_ptrs);
  free(configs);
  return status;
}

zd_status zd_grad_norm(zd_job *job, double grad_scale, double *norm) {
  const char *what = "grad_norm";
  zd_status status = job_check_writable(job, what);
  if (status != ZD_OK)
    return status;
  if (norm == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: norm must not be NULL", what);
  Zerod__V1__GradNormRequest request = ZEROD__V1__GRAD_NORM_REQUEST__INIT;
  request.grad_scale = grad_scale;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  *norm = ((const Zerod__V1__GradNormReply *)reply_msg)->grad_norm;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  return client_finish(job->client);
}

static zd_status checkpoint_call(zd_job *job, Zerod__V1__CheckpointAction action, const char *name,
                                 zd_checkpoint_info *info, const char *what) {
  zd_status status = job_check_writable(job, what);
  if (status != ZD_OK)
    return status;
  Zerod__V1__CheckpointRequest request = ZEROD__V1__CHECKPOINT_REQUEST__INIT;
  request.action = action;
  request.name = (char *)(name != NULL ? name : "");
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__CheckpointReply *reply = (const Zerod__V1__CheckpointReply *)reply_msg;
  if (info != NULL) {
    memset(info, 0, sizeof *info);
    snprintf(info->name, sizeof info->name, "%s", reply->name);
    info->step = reply->step;
    info->stall_ms = reply->stall_ms;
    info->total_ms = reply->total_ms;
  }
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  /* A restore let go of the units the worker held gathered: a stable
   * range stops mapping the daemon's buffers, as zd_release does. */
  for (size_t u = 0;
       action == ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_RESTORE && u < job->unit_count;
       u++) {
    client_unit *unit = &job->units[u];
    if (job->stable_addresses && unit->held_gather_buffer != 0)
      (void)unit_cover_range(unit, what);
    unit->held_gather_buffer = 0;
  }
  return client_finish(job->client);
}

zd_status zd_checkpoint_save(zd_job *job, const char *name, zd_checkpoint_info *info) {
  return checkpoint_call(job, ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_SAVE, name, info,
                         "checkpoint save");
}

zd_status zd_checkpoint_restore(zd_job *job, const char *name, zd_checkpoint_info *info) {
  if (name == NULL || name[0] == '\0')
    return set_error(ZD_E_INVALID_ARGUMENT, "checkpoint restore: name the checkpoint to restore");
  return checkpoint_call(job, ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_RESTORE, name, info,
                         "checkpoint restore");
}

zd_status zd_detach(zd_job *job) {
  char what[96];
  snprintf(what, sizeof what, "detach job %s", job != NULL ? job->name : "(null)");
  zd_status status = job_check(job, what);
  if (status != ZD_OK)
    return status;
  Zerod__V1__DetachRequest request = ZEROD__V1__DETACH_REQUEST__INIT;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_DETACH, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_DETACH_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  job->attached = 0;
  close_cuda_buffers(job->client);
  return client_finish(job->client);
}

/* ------------------------------------------------------------------------
 * GPU buffers: ordering with the daemon
 * ------------------------------------------------------------------------ */

/* A view of shared memory needs no ordering (the daemon's work on it is
 * complete when the reply arrives), so both calls accept it and do nothing:
 * a worker can call them whatever the daemon's device. */
static zd_status view_event_call(const zd_view *view, void *stream, int record, const char *what) {
  if (view == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: view is NULL", what);
  if (view->device < 0)
    return ZD_OK;
  const zk_cuda_api *api = cuda_api(NULL, 0);
  if (api == NULL || view->event == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: the view is not a GPU buffer of this process",
                     what);
  int rc =
      record ? api->event_record(view->event, stream) : api->stream_wait_event(stream, view->event);
  if (rc != 0)
    return set_error(ZD_E_IO, "%s: %s", what, api->last_error());
  return ZD_OK;
}

zd_status zd_view_stream_wait(const zd_view *view, void *stream) {
  return view_event_call(view, stream, 0, "view stream wait");
}

zd_status zd_view_stream_done(const zd_view *view, void *stream) {
  return view_event_call(view, stream, 1, "view stream done");
}
