/* libzerod's connection (client_impl.h): requests sent and replies
 * matched to them (replies may come back out of order), the replies read
 * early for someone else (the stash), the errors of requests sent without a
 * reply (deferred errors), and the connection's death: once it is lost
 * (end of stream, a protocol error, or the daemon's shutdown notice) every
 * later call fails at once with ZD_E_UNAVAILABLE and the reason. Nothing
 * here trusts the daemon: a frame that does not decode or a reply of the
 * wrong type closes the connection with ZD_E_PROTOCOL. */
#include "client_impl.h"
#include "clock.h"

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

void client__conn_close(zd_client *client) {
  if (client->sock >= 0)
    close(client->sock);
  client->sock = -1;
  zd_frame_reader_reset(&client->reader);
  stash_free_all(client);
  free(client->expected_ids);
  client->expected_ids = NULL;
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

zd_status client__dead_error(const zd_client *client, const char *what) {
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
    return client__dead_error(client, what);
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
    return client__dead_error(client, what);
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
      return client__dead_error(client, what);
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
      status = client__dead_error(client, what);
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
static zd_status wait_reply(zd_client *client, uint64_t request_id, uint16_t reply_type,
                            const char *what, ProtobufCMessage **reply, int *fds, unsigned *nfds);

zd_status client__wait(zd_client *client, uint64_t request_id, uint16_t reply_type,
                       const char *what, ProtobufCMessage **reply, int *fds, unsigned *nfds) {
  const uint64_t began = clock_now_ns();
  zd_status status = wait_reply(client, request_id, reply_type, what, reply, fds, nfds);
  client->wait_ns += clock_now_ns() - began;
  return status;
}

static zd_status wait_reply(zd_client *client, uint64_t request_id, uint16_t reply_type,
                            const char *what, ProtobufCMessage **reply, int *fds, unsigned *nfds) {
  *reply = NULL;
  *nfds = 0;
  if (client->dead)
    return client__dead_error(client, what);

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
                       zd_last_error());
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
