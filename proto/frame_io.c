/* Reading and writing whole frames of the local IPC protocol (frame.h) on a
 * Unix stream socket, with their SCM_RIGHTS file descriptors: a buffered
 * reader that matches descriptors to the frame they came with, and a writer
 * that sends a frame whole or fails by a deadline. The header, the message
 * types and the bounds are frame.c's. */
#include "frame.h"

#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* *why = message (when asked for), and err. */
static int fail(const char **why, const char *message, int err) {
  if (why != NULL)
    *why = message;
  return err;
}

/* ------------------------------------------------------------------------
 * Reading frames
 * ------------------------------------------------------------------------ */

/* The reader reads ahead: one recvmsg takes up to ZD_FRAME_READ_BUFFER_BYTES
 * of whatever the socket holds, which may be several frames, and the frames
 * are then handed out one by one without another system call. The rest of
 * a payload that did not come with its header is read straight into the
 * payload's allocation, with the buffer behind it for what follows.
 *
 * Reading ahead means a recvmsg's SCM_RIGHTS descriptors have to be matched
 * with one of the frames it returned. Linux's AF_UNIX stream sockets decide
 * which (net/unix/af_unix.c):
 *
 *  - unix_stream_sendmsg attaches the descriptors of a sendmsg to the first
 *    skb it queues ("Only send the fds in the first buffer"), that is to
 *    the first byte the call writes. zd_frame_send (send_all below) and the
 *    daemon's send_some write each frame with its own sendmsg calls and
 *    pass the descriptors only with the call that writes its first byte.
 *    So a frame's descriptors ride on its first byte, on an skb that holds
 *    no other frame's first byte.
 *  - unix_stream_read_generic copies skb after skb into one recvmsg. When
 *    it reads from an skb that carries descriptors it detaches them and
 *    stops: at once if the skb has bytes left, else after unlinking it
 *    ("if (scm.fp) break;"). The first read from an skb starts at its first
 *    byte (we never use MSG_PEEK or SO_PEEK_OFF), and a sendmsg of no bytes
 *    queues no skb, so no descriptors come without bytes.
 *
 * Hence one recvmsg returns at most one set of descriptors; they belong to
 * the last skb it read from, and it returned that skb's first byte. The
 * rule the reader applies follows: the descriptors of a recvmsg (a
 * "chunk" of the stream) belong to the last frame whose first byte lies in
 * the chunk. The reader keeps the chunk's range of stream offsets with its
 * descriptors, and settles them when that frame is known: a frame whose
 * header is decoded ends where the next one starts, and a frame whose
 * header runs past the chunk is the last to start in it. Descriptors in a
 * chunk where no frame starts cannot come from a sender that follows the
 * protocol, and are a protocol error. A hostile sender can still put
 * descriptors on a later byte of a frame that one recvmsg returns with its
 * first byte; they then count as that frame's, and its fd count decides. */

static void close_fds(int *fds, unsigned nfds) {
  for (unsigned i = 0; i < nfds; i++) {
    if (fds[i] >= 0)
      close(fds[i]);
    fds[i] = -1;
  }
}

void zd_frame_reader_init(zd_frame_reader *reader) {
  memset(reader, 0, sizeof *reader);
  for (unsigned i = 0; i < ZD_FRAME_MAX_FDS; i++) {
    reader->fds[i] = -1;
    reader->chunk_fds[i] = -1;
  }
}

void zd_frame_reader_reset(zd_frame_reader *reader) {
  close_fds(reader->fds, reader->nfds);
  close_fds(reader->chunk_fds, reader->chunk_nfds);
  free(reader->payload);
  free(reader->buffer);
  zd_frame_reader_init(reader);
}

/* Drops everything the reader holds after a failure (the frame, the bytes
 * read ahead and their descriptors) but keeps the header when it was
 * decoded, so the caller can still name the request in its error. The
 * stream cannot be trusted after an error, so nothing read ahead is kept;
 * a reader used again starts afresh and never writes through a freed
 * payload. */
static int reader_fail(zd_frame_reader *reader, const char **why, const char *message, int err) {
  zd_frame_header header = reader->header;
  zd_frame_reader_reset(reader);
  reader->header = header;
  return fail(why, message, err);
}

/* Bytes read ahead and not yet part of a decoded frame. */
static size_t buffered_bytes(const zd_frame_reader *reader) {
  return reader->buffer_end - reader->buffer_start;
}

/* The buffered bytes are always the last ones received, so the first of
 * them sits at this offset of the stream. */
static uint64_t buffered_stream_offset(const zd_frame_reader *reader) {
  return reader->stream_bytes - buffered_bytes(reader);
}

/* Whether the last chunk's descriptors can belong to no frame: the frame
 * [frame_start, frame_end) reaches past the chunk, so no later frame
 * starts in it, and this one does not start in it either. frame_end is
 * UINT64_MAX while the frame's header is incomplete. */
static bool chunk_fds_orphaned(const zd_frame_reader *reader, uint64_t frame_start,
                               uint64_t frame_end) {
  if (reader->chunk_nfds == 0 || frame_end < reader->chunk_end)
    return false;
  return frame_start < reader->chunk_begin || frame_start >= reader->chunk_end;
}

/* Settles the last chunk's descriptors against the current frame
 * [frame_start, frame_end) (frame_end UINT64_MAX while its header is
 * incomplete, which also means the frame runs past the chunk). They stay
 * with the chunk while a later frame starts inside it; otherwise this
 * frame is the last that can start in the chunk, and they are its own, or
 * nobody's. */
static int settle_chunk_fds(zd_frame_reader *reader, uint64_t frame_start, uint64_t frame_end,
                            const char **why) {
  if (reader->chunk_nfds == 0 || frame_end < reader->chunk_end)
    return 0;
  if (chunk_fds_orphaned(reader, frame_start, frame_end))
    return reader_fail(reader, why, "file descriptors arrived without the first byte of a frame",
                       -EPROTO);
  /* A frame starts in one chunk only, so it has none yet. */
  for (unsigned i = 0; i < reader->chunk_nfds; i++) {
    reader->fds[i] = reader->chunk_fds[i];
    reader->chunk_fds[i] = -1;
  }
  reader->nfds = reader->chunk_nfds;
  reader->chunk_nfds = 0;
  return 0;
}

/* Advances the current frame with the bytes already read. Returns 1 when
 * it is complete, 0 when it needs bytes from the socket, or an error. */
static int reader_parse(zd_frame_reader *reader, const char **why) {
  if (!reader->header_decoded) {
    size_t buffered = buffered_bytes(reader);
    uint64_t frame_start = buffered_stream_offset(reader);
    if (buffered < ZD_FRAME_HEADER_BYTES) {
      /* A recvmsg comes next, and its chunk must find the last one's
       * descriptors settled: this frame runs past that chunk, so it is
       * the last frame that can start in it. */
      reader->have = buffered;
      return settle_chunk_fds(reader, frame_start, UINT64_MAX, why);
    }

    /* The header is decoded as soon as it is complete, so that a bad one
     * fails before any payload is read or allocated; the allocation is
     * then exactly the (capped) size it announces. */
    zd_frame_header header;
    const char *reason;
    int rc = zd_frame_header_decode(reader->buffer + reader->buffer_start, ZD_FRAME_HEADER_BYTES,
                                    &header, &reason);
    if (rc != 0)
      return reader_fail(reader, why, reason, rc);
    reader->header = header;
    reader->header_decoded = true;
    reader->frame_start = frame_start;
    rc = settle_chunk_fds(reader, frame_start,
                          frame_start + ZD_FRAME_HEADER_BYTES + header.payload_bytes, why);
    if (rc != 0)
      return rc;
    if (header.payload_bytes > 0) {
      reader->payload = malloc(header.payload_bytes);
      if (reader->payload == NULL)
        return reader_fail(reader, why, "out of memory for a frame payload", -ENOMEM);
    }
    reader->buffer_start += ZD_FRAME_HEADER_BYTES;
    size_t from_buffer = buffered_bytes(reader);
    if (from_buffer > header.payload_bytes)
      from_buffer = header.payload_bytes;
    if (from_buffer > 0)
      memcpy(reader->payload, reader->buffer + reader->buffer_start, from_buffer);
    reader->buffer_start += from_buffer;
    reader->have = ZD_FRAME_HEADER_BYTES + from_buffer;
  }
  if (reader->have < ZD_FRAME_HEADER_BYTES + (size_t)reader->header.payload_bytes)
    return 0;

  /* Whatever chunk the descriptors came in, they were settled when the
   * frame's header was: only now that the frame is whole is the count
   * final. */
  if (reader->nfds != reader->header.fd_count)
    return reader_fail(reader, why, "fd count does not match header", -EPROTO);
  return 1;
}

/* Keeps the SCM_RIGHTS descriptors of one recvmsg with its chunk. Returns
 * 0, or -EPROTO when they do not fit (the kernel truncated them, or more
 * than the cap came); those received are then closed. */
static int take_chunk_fds(zd_frame_reader *reader, struct msghdr *msg, const char **why) {
  int rc = 0;
  for (struct cmsghdr *cmsg = CMSG_FIRSTHDR(msg); cmsg != NULL; cmsg = CMSG_NXTHDR(msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS)
      continue;
    size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char *data = CMSG_DATA(cmsg);
    for (size_t i = 0; i < count; i++) {
      int fd;
      memcpy(&fd, data + i * sizeof fd, sizeof fd);
      if (reader->chunk_nfds < ZD_FRAME_MAX_FDS)
        reader->chunk_fds[reader->chunk_nfds++] = fd;
      else {
        close(fd);
        rc = -EPROTO;
      }
    }
  }
  if (rc != 0)
    return reader_fail(reader, why, "more than 4 file descriptors sent with one frame", rc);
  if (msg->msg_flags & MSG_CTRUNC)
    return reader_fail(reader, why, "file descriptors truncated (more than 4 sent)", -EPROTO);
  return 0;
}

/* One recvmsg: the rest of the current payload (when its header is
 * decoded) and then as much as the buffer holds. Returns 1 when bytes
 * came, 0 on EAGAIN, or an error. It is only called when no complete frame
 * is buffered, so what the buffer holds is the start of one header (under
 * 24 bytes), or nothing when a payload is being completed. */
static int reader_receive(zd_frame_reader *reader, int sock, const char **why) {
  if (reader->buffer == NULL) {
    reader->buffer = malloc(ZD_FRAME_READ_BUFFER_BYTES);
    if (reader->buffer == NULL)
      return reader_fail(reader, why, "out of memory for the frame read buffer", -ENOMEM);
  }
  if (reader->buffer_start > 0) {
    size_t buffered = buffered_bytes(reader);
    memmove(reader->buffer, reader->buffer + reader->buffer_start, buffered);
    reader->buffer_start = 0;
    reader->buffer_end = buffered;
  }

  struct iovec iov[2];
  int iov_count = 0;
  size_t payload_missing = 0;
  if (reader->header_decoded) {
    size_t payload_have = reader->have - ZD_FRAME_HEADER_BYTES;
    payload_missing = reader->header.payload_bytes - payload_have;
    iov[iov_count++] =
        (struct iovec){.iov_base = reader->payload + payload_have, .iov_len = payload_missing};
  }
  iov[iov_count++] = (struct iovec){.iov_base = reader->buffer + reader->buffer_end,
                                    .iov_len = ZD_FRAME_READ_BUFFER_BYTES - reader->buffer_end};
  union {
    struct cmsghdr align;
    char bytes[CMSG_SPACE(sizeof(int) * ZD_FRAME_MAX_FDS)];
  } control;
  struct msghdr msg = {.msg_iov = iov,
                       .msg_iovlen = (size_t)iov_count,
                       .msg_control = control.bytes,
                       .msg_controllen = sizeof control.bytes};
  ssize_t got;
  do {
    got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  if (got < 0) {
    int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK)
      return 0;
    return reader_fail(reader, why, "recvmsg on the IPC socket failed", -err);
  }
  int rc = take_chunk_fds(reader, &msg, why);
  if (rc != 0)
    return rc;
  if (got == 0)
    return reader_fail(reader, why,
                       reader->have == 0 ? "connection closed"
                                         : "connection closed in the middle of a frame",
                       -ECONNRESET);

  reader->chunk_begin = reader->stream_bytes;
  reader->stream_bytes += (uint64_t)got;
  reader->chunk_end = reader->stream_bytes;
  size_t into_payload = (size_t)got < payload_missing ? (size_t)got : payload_missing;
  reader->have += into_payload;
  reader->buffer_end += (size_t)got - into_payload;
  if (reader->header_decoded) {
    /* The chunk began inside this frame's payload, so its descriptors can
     * only be those of a frame that starts after this one ends. */
    rc = settle_chunk_fds(
        reader, reader->frame_start,
        reader->frame_start + ZD_FRAME_HEADER_BYTES + reader->header.payload_bytes, why);
    if (rc != 0)
      return rc;
  }
  return 1;
}

int zd_frame_read(zd_frame_reader *reader, int sock, const char **why) {
  if (why != NULL)
    *why = NULL;
  for (;;) {
    int rc = reader_parse(reader, why);
    if (rc != 0)
      return rc;
    rc = reader_receive(reader, sock, why);
    if (rc <= 0)
      return rc;
  }
}

bool zd_frame_reader_pending(const zd_frame_reader *reader) {
  if (reader->header_decoded)
    return reader->have == ZD_FRAME_HEADER_BYTES + (size_t)reader->header.payload_bytes;
  size_t buffered = buffered_bytes(reader);
  uint64_t frame_start = buffered_stream_offset(reader);
  if (buffered < ZD_FRAME_HEADER_BYTES)
    return chunk_fds_orphaned(reader, frame_start, UINT64_MAX);
  zd_frame_header header;
  if (zd_frame_header_decode(reader->buffer + reader->buffer_start, ZD_FRAME_HEADER_BYTES, &header,
                             NULL) != 0)
    return true;
  uint64_t frame_bytes = ZD_FRAME_HEADER_BYTES + (uint64_t)header.payload_bytes;
  return frame_bytes <= buffered ||
         chunk_fds_orphaned(reader, frame_start, frame_start + frame_bytes);
}

void zd_frame_reader_take(zd_frame_reader *reader, zd_frame_header *header, uint8_t **payload,
                          int *fds, unsigned *nfds) {
  *header = reader->header;
  *payload = reader->payload;
  for (unsigned i = 0; i < reader->nfds; i++) {
    fds[i] = reader->fds[i];
    reader->fds[i] = -1;
  }
  *nfds = reader->nfds;
  /* Ownership has moved to the caller: forget the frame without closing or
   * freeing. The bytes read ahead, and the descriptors of their chunk,
   * stay for the frames that follow. */
  memset(&reader->header, 0, sizeof reader->header);
  reader->header_decoded = false;
  reader->frame_start = 0;
  reader->have = 0;
  reader->payload = NULL;
  reader->nfds = 0;
}

/* ------------------------------------------------------------------------
 * Writing frames
 * ------------------------------------------------------------------------ */

/* Checks the arguments of a frame and returns its payload size. */
static int frame_check(uint16_t type, uint8_t flags, unsigned nfds, const ProtobufCMessage *msg,
                       size_t *payload_bytes) {
  const ProtobufCMessageDescriptor *desc = zd_msg_descriptor(type);
  if (desc == NULL || (flags & ~ZD_FRAME_F_KNOWN) != 0 || nfds > ZD_FRAME_MAX_FDS)
    return -EINVAL;
  if (msg != NULL && msg->descriptor != desc)
    return -EINVAL;
  size_t packed = msg != NULL ? protobuf_c_message_get_packed_size(msg) : 0;
  if (packed > ZD_FRAME_MAX_PAYLOAD)
    return -EMSGSIZE;
  *payload_bytes = packed;
  return 0;
}

static void frame_write(uint16_t type, uint64_t request_id, uint8_t flags, unsigned nfds,
                        const ProtobufCMessage *msg, size_t payload_bytes, uint8_t *out) {
  zd_frame_header header = {.magic = ZD_FRAME_MAGIC,
                            .version = ZD_FRAME_VERSION,
                            .type = type,
                            .request_id = request_id,
                            .payload_bytes = (uint32_t)payload_bytes,
                            .fd_count = (uint8_t)nfds,
                            .flags = flags};
  zd_frame_header_encode(&header, out);
  if (msg != NULL)
    protobuf_c_message_pack(msg, out + ZD_FRAME_HEADER_BYTES);
}

int zd_frame_encode(uint16_t type, uint64_t request_id, uint8_t flags, unsigned nfds,
                    const ProtobufCMessage *msg, uint8_t **out, size_t *out_bytes) {
  size_t payload_bytes;
  int rc = frame_check(type, flags, nfds, msg, &payload_bytes);
  if (rc != 0)
    return rc;
  uint8_t *frame = malloc(ZD_FRAME_HEADER_BYTES + payload_bytes);
  if (frame == NULL)
    return -ENOMEM;
  frame_write(type, request_id, flags, nfds, msg, payload_bytes, frame);
  *out = frame;
  *out_bytes = ZD_FRAME_HEADER_BYTES + payload_bytes;
  return 0;
}

static int64_t now_ms(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

/* Waits until sock is writable or the deadline (-1: none) passes. */
static int wait_writable(int sock, int64_t deadline_ms) {
  for (;;) {
    int wait_ms = -1;
    if (deadline_ms >= 0) {
      int64_t left_ms = deadline_ms - now_ms();
      if (left_ms <= 0)
        return -ETIMEDOUT;
      wait_ms = left_ms > 1000000 ? 1000000 : (int)left_ms;
    }
    struct pollfd pfd = {.fd = sock, .events = POLLOUT};
    int ready = poll(&pfd, 1, wait_ms);
    if (ready > 0)
      return 0; /* POLLERR and POLLHUP surface as the next sendmsg's error. */
    if (ready < 0 && errno != EINTR)
      return -errno;
  }
}

static int send_all(int sock, const uint8_t *frame, size_t frame_bytes, const int *fds,
                    unsigned nfds, int timeout_ms) {
  int64_t deadline_ms = timeout_ms >= 0 ? now_ms() + timeout_ms : -1;
  union {
    struct cmsghdr align;
    char bytes[CMSG_SPACE(sizeof(int) * ZD_FRAME_MAX_FDS)];
  } control;
  size_t sent = 0;
  while (sent < frame_bytes) {
    struct iovec iov = {.iov_base = (void *)(frame + sent), .iov_len = frame_bytes - sent};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    /* The descriptors ride on the first byte of the frame, which is how
     * the reader tells whose they are (see "Reading frames"). */
    if (sent == 0 && nfds > 0) {
      memset(&control, 0, sizeof control);
      msg.msg_control = control.bytes;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
      struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
      memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * nfds);
    }
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) {
      sent += (size_t)n;
      continue;
    }
    if (errno == EINTR)
      continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return -errno;
    int rc = wait_writable(sock, deadline_ms);
    if (rc != 0)
      return rc;
  }
  return 0;
}

int zd_frame_send(int sock, uint16_t type, uint64_t request_id, uint8_t flags,
                  const ProtobufCMessage *msg, const int *fds, unsigned nfds, int timeout_ms) {
  size_t payload_bytes;
  int rc = frame_check(type, flags, nfds, msg, &payload_bytes);
  if (rc != 0)
    return rc;
  if (nfds > 0 && fds == NULL)
    return -EINVAL;
  /* Most frames are small requests and replies: those are built on the
   * stack so that a round trip costs no allocation. */
  uint8_t small[512];
  size_t frame_bytes = ZD_FRAME_HEADER_BYTES + payload_bytes;
  uint8_t *frame = frame_bytes <= sizeof small ? small : malloc(frame_bytes);
  if (frame == NULL)
    return -ENOMEM;
  frame_write(type, request_id, flags, nfds, msg, payload_bytes, frame);
  rc = send_all(sock, frame, frame_bytes, fds, nfds, timeout_ms);
  if (frame != small)
    free(frame);
  return rc;
}

size_t zd_frame_reader_take_bytes(zd_frame_reader *reader, void *dst, size_t n) {
  if (reader->header_decoded || reader->buffer == NULL)
    return 0;
  size_t k = buffered_bytes(reader);
  if (k > n)
    k = n;
  memcpy(dst, reader->buffer + reader->buffer_start, k);
  reader->buffer_start += k;
  return k;
}

int zd_frame_read_plain(zd_frame_reader *reader, int sock, zd_frame_header *header,
                        uint8_t **payload, const char **why) {
  int rc = zd_frame_read(reader, sock, why);
  if (rc != 1)
    return rc;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  zd_frame_reader_take(reader, header, payload, fds, &nfds);
  for (unsigned i = 0; i < nfds; i++)
    close(fds[i]);
  return 1;
}
