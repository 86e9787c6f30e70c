/* libzerod: the client side of the local IPC protocol (client/include/zerod.h).
 *
 * This file owns one worker's connection to its node daemon: the blocking
 * Unix socket, the request ids and the matching of replies to them (replies
 * may come back out of order), the replies read early for someone else (the
 * stash), the errors of requests sent without a reply (deferred errors), the
 * shared-memory mappings of gathered and gradient buffers (cached by buffer
 * id for the life of the connection), and the per-unit tensor tables that
 * views point into. Nothing here blocks except to wait for the daemon, and
 * nothing here trusts the daemon: a frame that does not decode, a reply of
 * the wrong type, or a buffer without a descriptor closes the connection
 * with ZD_E_PROTOCOL instead of crashing the worker.
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

typedef struct buffer_mapping {
  buffer_kind kind;
  uint32_t buffer_id;
  void *base;
  size_t bytes;
} buffer_mapping;

/* What this client knows of a registered unit: the reply's placements, and
 * two tensor tables (gathered and gradient) whose data pointers are filled
 * in by each gather / grad_buffer call. The names and shapes are owned here
 * and shared by both tables. */
typedef struct client_unit {
  zd_unit unit_id;
  char *name;
  unsigned ntensors;
  uint64_t numel;
  zd_dtype working_dtype;
  zd_dtype grad_dtype;
  char **tensor_names;
  uint64_t *shapes; /* every tensor's dims, back to back */
  zd_tensor_view *gather_tensors;
  zd_tensor_view *grad_tensors;
} client_unit;

struct zd_job {
  zd_client *client;
  struct zd_job *next; /* the client's list of jobs, freed by zd_close */
  char *name;
  int attached;
  unsigned rank;
  unsigned world_size;
  uint64_t version;
  client_unit *units;
  size_t unit_count;
  size_t unit_capacity;
};

/* Requests sent without a reply (releases) are remembered for a while, only
 * so that an error answering one can name the unit it was about. */
#define NO_REPLY_RING 64

struct zd_client {
  int sock;
  int dead;
  char dead_reason[LAST_ERROR_BYTES];
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

static void close_fds(int *fds, unsigned nfds) {
  for (unsigned i = 0; i < nfds; i++) {
    if (fds[i] >= 0)
      close(fds[i]);
    fds[i] = -1;
  }
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
  return set_error(ZD_E_UNAVAILABLE, "%s: %s", what, client->dead_reason);
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

/* The daemon's shutdown notice usually sits in the receive queue when a
 * send fails because the daemon closed its end, and it says far more than
 * "connection closed". This reads what is left without blocking and returns
 * the notice's message if one is there. */
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
      if (notice->status == ZEROD__V1__STATUS__STATUS_UNAVAILABLE) {
        snprintf(message, message_bytes, "%s", notice->message);
        found = 1;
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
    if (drain_for_notice(client, notice, sizeof notice))
      client_mark_dead(client, "daemon is shutting down: %s", notice);
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
      snprintf(name, name_bytes, "release unit %u", (unsigned)client->no_reply[i].unit);
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
    /* Notices other than a shutdown are informational; libzerod has no log
     * of its own, so they are dropped. */
    const Zerod__V1__Notice *notice = (const Zerod__V1__Notice *)decoded;
    if (notice->status == ZEROD__V1__STATUS__STATUS_UNAVAILABLE) {
      client_mark_dead(client, "daemon is shutting down: %s", notice->message);
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
  free(unit->name);
}

static void job_free(zd_job *job) {
  for (size_t u = 0; u < job->unit_count; u++)
    unit_free(&job->units[u]);
  free(job->units);
  free(job->name);
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
    munmap(client->mappings[i].base, client->mappings[i].bytes);
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
                                 Zerod__V1__OptimizerConfig *optimizer) {
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
  return ZD_OK;
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
  request.protocol_version = 1;
  request.job = (char *)options.job;
  request.local_rank = options.local_rank;
  request.token = (char *)(options.token != NULL ? options.token : "");
  request.mode = options.read_only ? ZEROD__V1__ATTACH_MODE__ATTACH_READ_ONLY
                                   : ZEROD__V1__ATTACH_MODE__ATTACH_READ_WRITE;
  request.create = options.create != 0;
  if (options.config != NULL) {
    if ((status = fill_job_config(options.config, &config, &optimizer)) != ZD_OK)
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
  if (reply->world_size == 0 || reply->rank >= reply->world_size) {
    unsigned rank = reply->rank, world_size = reply->world_size;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    job_free(job);
    return client_protocol_error(client, what, "rank %u out of world size %u", rank, world_size);
  }
  job->client = client;
  job->attached = 1;
  job->rank = reply->rank;
  job->world_size = reply->world_size;
  job->version = reply->version;
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

static client_unit *job_find_unit(zd_job *job, zd_unit unit_id) {
  /* Daemons hand out small dense ids, so the id is tried as an index first;
   * the scan covers any other numbering. */
  if (unit_id < job->unit_count && job->units[unit_id].unit_id == unit_id)
    return &job->units[unit_id];
  for (size_t u = 0; u < job->unit_count; u++) {
    if (job->units[u].unit_id == unit_id)
      return &job->units[u];
  }
  return NULL;
}

/* ------------------------------------------------------------------------
 * Register
 * ------------------------------------------------------------------------ */

/* Writes rank 0's initial values into a fresh memfd for the daemon to
 * read. A memfd rather than the socket because bulk data never crosses the
 * socket (the frame cap is 4 MiB, units are often larger). */
static zd_status make_init_memfd(const float *values, uint64_t numel, const char *what,
                                 int *fd_out) {
  if (numel > SIZE_MAX / sizeof(float))
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: unit too large", what);
  size_t total_bytes = (size_t)numel * sizeof(float);
  int fd = memfd_create("zerod-init", MFD_CLOEXEC);
  if (fd < 0)
    return set_error(ZD_E_IO, "%s: memfd_create: %s", what, strerror(errno));
  if (ftruncate(fd, (off_t)total_bytes) != 0) {
    int err = errno;
    close(fd);
    return set_error(ZD_E_IO, "%s: ftruncate of the init memfd to %zu bytes: %s", what, total_bytes,
                     strerror(err));
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
      return set_error(ZD_E_IO, "%s: writing the init memfd: %s", what, strerror(err));
    }
    written_bytes += (size_t)n;
  }
  *fd_out = fd;
  return ZD_OK;
}

/* Keeps the reply's placements and builds the unit's two tensor tables. */
static zd_status unit_from_reply(client_unit *unit, const char *unit_name,
                                 const Zerod__V1__RegisterUnitReply *reply, zd_client *client,
                                 const char *what) {
  memset(unit, 0, sizeof *unit);
  unit->unit_id = reply->unit_id;
  unit->numel = reply->numel;
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
  if (unit->name == NULL || unit->tensor_names == NULL || unit->shapes == NULL ||
      unit->gather_tensors == NULL || unit->grad_tensors == NULL)
    return set_error(ZD_E_NOMEM, "%s: out of memory", what);
  unit->ntensors = (unsigned)ntensors;
  uint64_t *dims = unit->shapes;
  for (size_t t = 0; t < ntensors; t++) {
    const Zerod__V1__TensorPlacement *placement = reply->tensors[t];
    if ((unit->tensor_names[t] = strdup(placement->name)) == NULL)
      return set_error(ZD_E_NOMEM, "%s: out of memory", what);
    memcpy(dims, placement->shape, placement->n_shape * sizeof *dims);
    zd_tensor_view view = {.name = unit->tensor_names[t],
                           .data = NULL,
                           .shape = dims,
                           .ndim = (unsigned)placement->n_shape,
                           .numel = placement->numel,
                           .offset = placement->offset};
    unit->gather_tensors[t] = view;
    unit->grad_tensors[t] = view;
    dims += placement->n_shape;
  }
  return ZD_OK;
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
  if ((status = job_check(job, what)) != ZD_OK)
    return status;
  zd_client *client = job->client;
  zd_init init = desc.init == 0 ? ZD_INIT_FROM_RANK0 : desc.init;
  int sends_values = init == ZD_INIT_FROM_RANK0 && job->rank == 0;
  if (sends_values && desc.init_values == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: ZD_INIT_FROM_RANK0 on rank 0 needs init_values",
                     what);
  if (job->unit_count == job->unit_capacity) {
    size_t capacity = job->unit_capacity ? job->unit_capacity * 2 : 16;
    client_unit *units = realloc(job->units, capacity * sizeof *units);
    if (units == NULL)
      return set_error(ZD_E_NOMEM, "%s: out of memory", what);
    job->units = units;
    job->unit_capacity = capacity;
  }

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
  client_unit *unit = &job->units[job->unit_count];
  status = unit_from_reply(unit, desc.name, reply, client, what);
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (status != ZD_OK) {
    unit_free(unit);
    return status;
  }
  job->unit_count++;
  *out = unit->unit_id;
  return client_finish(client);
}

/* ------------------------------------------------------------------------
 * Buffers and views
 * ------------------------------------------------------------------------ */

/* Finds or creates the mapping of a buffer. A descriptor comes only the
 * first time this session sees a buffer id; later replies name it. */
static zd_status map_buffer(zd_client *client, buffer_kind kind, uint32_t buffer_id,
                            uint64_t buffer_bytes, int *fds, unsigned nfds, const char *what,
                            void **base_out) {
  buffer_mapping *found = NULL;
  for (size_t i = 0; i < client->mapping_count; i++) {
    if (client->mappings[i].kind == kind && client->mappings[i].buffer_id == buffer_id) {
      found = &client->mappings[i];
      break;
    }
  }
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
    *base_out = found->base;
    return ZD_OK;
  }

  int fd = fds[0];
  if (found != NULL && found->bytes == buffer_bytes) {
    close(fd);
    *base_out = found->base;
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
  int prot = kind == BUFFER_GRAD ? PROT_READ | PROT_WRITE : PROT_READ;
  void *base = mmap(NULL, (size_t)buffer_bytes, prot, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (base == MAP_FAILED)
    return set_error(ZD_E_IO, "%s: mmap of buffer %u (%llu bytes): %s", what, (unsigned)buffer_id,
                     (unsigned long long)buffer_bytes, strerror(err));
  if (found != NULL) {
    /* The daemon replaced the buffer behind this id with one of another
     * size; views of the old one are only valid until their release. */
    munmap(found->base, found->bytes);
    found->base = base;
    found->bytes = (size_t)buffer_bytes;
    *base_out = base;
    return ZD_OK;
  }
  if (client->mapping_count == client->mapping_capacity) {
    size_t capacity = client->mapping_capacity ? client->mapping_capacity * 2 : 16;
    buffer_mapping *mappings = realloc(client->mappings, capacity * sizeof *mappings);
    if (mappings == NULL) {
      munmap(base, (size_t)buffer_bytes);
      return set_error(ZD_E_NOMEM, "%s: out of memory", what);
    }
    client->mappings = mappings;
    client->mapping_capacity = capacity;
  }
  buffer_mapping mapping = {
      .kind = kind, .buffer_id = buffer_id, .base = base, .bytes = (size_t)buffer_bytes};
  client->mappings[client->mapping_count++] = mapping;
  *base_out = base;
  return ZD_OK;
}

/* Points the unit's tensor table into a buffer and fills the view. Every
 * tensor must lie inside the buffer, or the worker would read past it. */
static zd_status fill_view(zd_client *client, client_unit *unit, zd_tensor_view *tensors,
                           void *base, uint64_t buffer_bytes, zd_dtype dtype, uint64_t version,
                           const char *what, zd_view *out) {
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
  return ZD_OK;
}

/* ------------------------------------------------------------------------
 * Gather, release, gradients, reduce
 * ------------------------------------------------------------------------ */

zd_status zd_gather_async(zd_job *job, zd_unit unit_id, zd_pending *out) {
  char what[64];
  snprintf(what, sizeof what, "gather unit %u", (unsigned)unit_id);
  zd_status status = job_check(job, what);
  if (status != ZD_OK)
    return status;
  if (out == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: out is NULL", what);
  if (job_find_unit(job, unit_id) == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: no such unit registered on this job", what);
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
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (reply_unit != pending->unit) {
    close_fds(fds, nfds);
    return client_protocol_error(client, what, "gather reply is for unit %u", reply_unit);
  }
  void *base;
  status = map_buffer(client, BUFFER_GATHERED, buffer_id, buffer_bytes, fds, nfds, what, &base);
  if (status != ZD_OK)
    return status;
  status = fill_view(client, unit, unit->gather_tensors, base, buffer_bytes, unit->working_dtype,
                     version, what, out);
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

/* Release is on every layer's critical path, so it costs one send and no
 * round trip: it goes out with NO_REPLY, and an error the daemon answers
 * anyway is kept as a deferred error for the next call that waits. */
zd_status zd_release(zd_job *job, zd_unit unit_id) {
  char what[64];
  snprintf(what, sizeof what, "release unit %u", (unsigned)unit_id);
  zd_status status = job_check(job, what);
  if (status != ZD_OK)
    return status;
  if (job_find_unit(job, unit_id) == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: no such unit registered on this job", what);
  zd_client *client = job->client;
  Zerod__V1__ReleaseRequest request = ZEROD__V1__RELEASE_REQUEST__INIT;
  request.unit_id = unit_id;
  uint64_t request_id;
  status = client_send(client, ZEROD__V1__MSG_TYPE__MSG_RELEASE, &request.base, NULL, 0, 0, what,
                       &request_id);
  if (status != ZD_OK)
    return status;
  client->no_reply[client->no_reply_next].request_id = request_id;
  client->no_reply[client->no_reply_next].unit = unit_id;
  client->no_reply_next = (client->no_reply_next + 1) % NO_REPLY_RING;
  return ZD_OK;
}

zd_status zd_grad_buffer(zd_job *job, zd_unit unit_id, zd_view *out) {
  char what[64];
  snprintf(what, sizeof what, "grad buffer unit %u", (unsigned)unit_id);
  zd_status status = job_check(job, what);
  if (status != ZD_OK)
    return status;
  if (out == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: out is NULL", what);
  client_unit *unit = job_find_unit(job, unit_id);
  if (unit == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: no such unit registered on this job", what);
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
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (reply_unit != unit_id) {
    close_fds(fds, nfds);
    return client_protocol_error(client, what, "grad buffer reply is for unit %u", reply_unit);
  }
  void *base;
  status = map_buffer(client, BUFFER_GRAD, buffer_id, buffer_bytes, fds, nfds, what, &base);
  if (status != ZD_OK)
    return status;
  status = fill_view(client, unit, unit->grad_tensors, base, buffer_bytes, unit->grad_dtype,
                     job->version, what, out);
  if (status != ZD_OK)
    return status;
  return client_finish(client);
}

zd_status zd_reduce(zd_job *job, zd_unit unit_id) {
  char what[64];
  snprintf(what, sizeof what, "reduce unit %u", (unsigned)unit_id);
  zd_status status = job_check(job, what);
  if (status != ZD_OK)
    return status;
  if (job_find_unit(job, unit_id) == NULL)
    return set_error(ZD_E_INVALID_ARGUMENT, "%s: no such unit registered on this job", what);
  Zerod__V1__ReduceRequest request = ZEROD__V1__REDUCE_REQUEST__INIT;
  request.unit_id = unit_id;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_REDUCE, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_REDUCE_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  return client_finish(job->client);
}

/* ------------------------------------------------------------------------
 * Step and detach
 * ------------------------------------------------------------------------ */

zd_status zd_step(zd_job *job, const zd_step_options *caller_options, zd_step_result *out) {
  const char *what = "step";
  zd_status status = job_check(job, what);
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
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client_call(job->client, ZEROD__V1__MSG_TYPE__MSG_STEP, &request.base, NULL, 0,
                       ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__StepReply *reply = (const Zerod__V1__StepReply *)reply_msg;
  job->version = reply->version;
  if (out != NULL) {
    out->step = reply->step;
    out->version = reply->version;
    out->grad_norm = reply->grad_norm;
    out->skipped = reply->skipped;
  }
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  return client_finish(job->client);
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
  return client_finish(job->client);
}
