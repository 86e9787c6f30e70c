/* Framing of the local IPC protocol, shared by the daemon and libzerod.
 *
 * A frame is a fixed 24-byte little-endian header followed by a protobuf-c
 * payload (proto/zerod/v1/ipc.proto) and, as SCM_RIGHTS ancillary data on
 * the same sendmsg, up to ZD_FRAME_MAX_FDS file descriptors:
 *
 *   offset size field
 *        0    4 magic          ZD_FRAME_MAGIC ("ZDIP" in memory order)
 *        4    2 version        ZD_FRAME_VERSION
 *        6    2 type           a Zerod__V1__MsgType value
 *        8    8 request_id     0 for notices
 *       16    4 payload_bytes  at most ZD_FRAME_MAX_PAYLOAD
 *       20    1 fd_count       at most ZD_FRAME_MAX_FDS
 *       21    1 flags          ZD_FRAME_F_*; unknown bits are an error
 *       22    2 reserved       must be zero
 *
 * Decoding is strict: every check happens before anything is allocated, and
 * each failure has its own message. Errors are negative errno values
 * (-EPROTO for a malformed frame, -EMSGSIZE for a size over a cap, -EBADMSG
 * for a payload that does not decode), as in libuv. */
#ifndef ZD_FRAME_H
#define ZD_FRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "zerod/v1/ipc.pb-c.h"

#define ZD_FRAME_MAGIC        0x5049445aU /* bytes 'Z' 'D' 'I' 'P' */
#define ZD_FRAME_VERSION      1
#define ZD_FRAME_HEADER_BYTES 24
#define ZD_FRAME_MAX_PAYLOAD  (4u << 20)
#define ZD_FRAME_MAX_FDS      4

/* The sender wants no reply on success (errors are always answered). */
#define ZD_FRAME_F_NO_REPLY 0x01u
#define ZD_FRAME_F_KNOWN    ZD_FRAME_F_NO_REPLY

/* Bounds on decoded messages, checked by zd_msg_unpack. */
#define ZD_MAX_NAME_BYTES       256
#define ZD_MAX_JOB_NAME_BYTES   64
#define ZD_MAX_TOKEN_BYTES      256
#define ZD_MAX_TENSORS_PER_UNIT 4096
#define ZD_MAX_DIMS             8
/* Elements in one tensor, and in one unit (sum of its tensors). */
#define ZD_MAX_NUMEL (1ull << 48)
/* WatchVersionRequest.timeout_ms at most (24 h). */
#define ZD_MAX_WATCH_TIMEOUT_MS (24u * 3600u * 1000u)
/* The human-readable message of an Error or a Notice. */
#define ZD_MAX_MESSAGE_BYTES 1024
/* A GPU buffer (CudaBuffer): the sizes of cudaIpcMemHandle_t and
 * cudaIpcEventHandle_t, and the highest device ordinal accepted. */
#define ZD_CUDA_IPC_HANDLE_BYTES 64
#define ZD_MAX_CUDA_DEVICE       1023

typedef struct zd_frame_header {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint64_t request_id;
  uint32_t payload_bytes;
  uint8_t fd_count;
  uint8_t flags;
  uint16_t reserved;
} zd_frame_header;

/* Writes the header in wire order into out (ZD_FRAME_HEADER_BYTES). */
void zd_frame_header_encode(const zd_frame_header *header, uint8_t *out);

/* Reads and validates a header: magic, version, payload size cap, fd count
 * cap, flags and reserved bits. The type is not checked here (see
 * zd_msg_descriptor). On error *why (if not NULL) points to a static
 * message. */
int zd_frame_header_decode(const uint8_t *in, size_t in_bytes, zd_frame_header *header,
                           const char **why);

/* The protobuf-c descriptor of the message a frame type carries, or NULL
 * for an unknown type. */
const ProtobufCMessageDescriptor *zd_msg_descriptor(uint16_t type);

/* Expected SCM_RIGHTS descriptors for a frame type: the range
 * [*min_fds, *max_fds]. Returns -EPROTO for an unknown type. */
int zd_msg_fd_range(uint16_t type, unsigned *min_fds, unsigned *max_fds);

/* Unpacks a payload as the message of `type` and checks the bounds above
 * (string lengths, counts, dims): every string field, at any depth, free
 * of NUL bytes and well-formed UTF-8 (pbcheck.h; checked in the bytes,
 * before unpacking, since protobuf-c would cut a string at a NUL), names
 * and tokens within their caps, job names non-empty in [A-Za-z0-9._-] and
 * not "." or "..", units and tensors with non-empty names, 1..4096 tensors of
 * at most 8 dims, each dim >= 1, at most ZD_MAX_NUMEL elements per tensor
 * and per unit, tensor placements inside their unit, every enum field (at
 * any depth) a value ipc.proto defines, and unknown fields (kept, for newer
 * peers) only with field numbers 1..2^29-1. Decoding allocates at most
 * 16 MiB whatever the payload. Returns 0 and the message in *out (free with
 * protobuf_c_message_free_unpacked(*out, NULL)), or a negative errno with
 * *why set and *out NULL (*why points to a static message, or for a bad
 * string to one in a buffer of the calling thread that names the field and
 * lives until that thread's next call): -EPROTO for an unknown type,
 * -EBADMSG for a payload that does not decode or breaks a bound (a bad
 * string included), -EMSGSIZE for a payload over ZD_FRAME_MAX_PAYLOAD. */
int zd_msg_unpack(uint16_t type, const uint8_t *payload, size_t payload_bytes,
                  ProtobufCMessage **out, const char **why);

/* Bytes one recvmsg may read ahead of the frame being assembled. */
#define ZD_FRAME_READ_BUFFER_BYTES (64u << 10)

/* Incremental reader of frames from a non-blocking (or blocking) socket.
 * One recvmsg reads as much as the socket holds (up to
 * ZD_FRAME_READ_BUFFER_BYTES beyond the payload being completed), and the
 * frames it brought are then handed out one by one without another system
 * call. The descriptors of a recvmsg go to the last frame whose first byte
 * it returned. That is exact for a sender that passes a frame's fds with a
 * sendmsg that starts with the frame's first byte and sends no byte of
 * another frame (zd_frame_send, the daemon's send_some); frame.c explains
 * why Linux makes it so.
 *
 * The reader owns a read-ahead buffer, allocated on the first read, and
 * the descriptors that came with bytes not yet handed out: a reader that
 * has read must be given back with zd_frame_reader_reset. The fields are
 * the reader's own; callers use the functions. */
typedef struct zd_frame_reader {
  /* The frame being assembled. */
  zd_frame_header header; /* all zero until decoded */
  bool header_decoded;
  uint64_t frame_start; /* stream offset of its first byte, once decoded */
  size_t have;          /* bytes of the current frame received so far */
  uint8_t *payload;     /* malloc'd, header.payload_bytes long */
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;

  /* Bytes read ahead: buffer[buffer_start, buffer_end) are the last bytes
   * received, not yet part of a decoded frame. */
  uint8_t *buffer; /* ZD_FRAME_READ_BUFFER_BYTES, malloc'd on first use */
  size_t buffer_start, buffer_end;
  uint64_t stream_bytes; /* bytes received on this socket so far */

  /* The descriptors of the last recvmsg while no frame has claimed them,
   * and the stream offsets [chunk_begin, chunk_end) of the bytes it
   * returned. */
  int chunk_fds[ZD_FRAME_MAX_FDS];
  unsigned chunk_nfds;
  uint64_t chunk_begin, chunk_end;
} zd_frame_reader;

void zd_frame_reader_init(zd_frame_reader *reader);

/* Returns 1 when a whole frame is ready (header, payload, fds), reading
 * from sock only when no whole frame is buffered already; 0 when more
 * bytes are needed (EAGAIN), -ECONNRESET on end of stream, or another
 * negative errno for a broken frame (with *why set). After 1 the caller
 * takes the frame with zd_frame_reader_take.
 *
 * On an error the reader has already closed the frame's descriptors and
 * freed its payload, and dropped what it had read ahead.
 * reader->header still holds the frame's header when it had been decoded
 * (all zero otherwise), so the caller can answer with its request id.
 * Every error means the stream can no longer be trusted (a bad header,
 * more fds than the cap or than the header announces, fds that came with
 * no frame's first byte, a read error, end of stream): the caller answers
 * if it can and closes the socket. *why says whether the stream ended
 * between frames or inside one.
 *
 * Frames read ahead are invisible to poll/epoll: a caller that stops
 * calling zd_frame_read before it returns 0 (a cap on frames per wakeup)
 * must check zd_frame_reader_pending before it waits for the socket. */
int zd_frame_read(zd_frame_reader *reader, int sock, const char **why);

/* Whether the next zd_frame_read answers (with a frame or an error)
 * without reading the socket, because what it needs is already buffered.
 * After zd_frame_read returned 0 this is always false. */
bool zd_frame_reader_pending(const zd_frame_reader *reader);

/* Hands the complete frame to the caller: the payload (caller frees; NULL
 * for an empty payload) and the descriptors (caller closes; fds must have
 * room for ZD_FRAME_MAX_FDS), then makes the reader ready for the next
 * frame, keeping what it has read ahead. */
void zd_frame_reader_take(zd_frame_reader *reader, zd_frame_header *header, uint8_t **payload,
                          int *fds, unsigned *nfds);

/* zd_frame_read and zd_frame_reader_take for a stream that carries no
 * descriptors (TCP, a follower's connection): descriptors that come anyway
 * are closed. Returns as zd_frame_read does; on 1, *header and *payload
 * (the caller frees it) are the frame. */
int zd_frame_read_plain(zd_frame_reader *reader, int sock, zd_frame_header *header,
                        uint8_t **payload, const char **why);

/* For a stream that carries raw bytes between frames (a follower's TCP
 * connection, node/follow_fetch.c): copies into dst up to n of the bytes
 * already read ahead after the last frame taken, and returns how many; the
 * caller reads the rest from the socket itself. Only between frames, and
 * only on a stream without descriptors (the stream offsets that place
 * descriptors do not count bytes read outside the reader). */
size_t zd_frame_reader_take_bytes(zd_frame_reader *reader, void *dst, size_t n);

/* Closes any descriptors, frees the partial frame and the read-ahead
 * buffer, and forgets the bytes read ahead. */
void zd_frame_reader_reset(zd_frame_reader *reader);

/* Packs msg (may be NULL for an empty payload) into one frame and sends it
 * with its fds in one sendmsg (looping on short writes; the fds go with the
 * first byte). Blocks (polls) on EAGAIN until sent or timeout_ms passes
 * (-1: no limit). Returns 0 or a negative errno (-EPIPE when the peer is
 * gone; SIGPIPE is never raised; -EINVAL for an unknown type, unknown flag
 * bits, more than ZD_FRAME_MAX_FDS fds, or a msg whose descriptor is not
 * the type's; -EMSGSIZE for a payload over the cap; -ETIMEDOUT, after which
 * part of the frame may have been sent and the socket must be closed). */
int zd_frame_send(int sock, uint16_t type, uint64_t request_id, uint8_t flags,
                  const ProtobufCMessage *msg, const int *fds, unsigned nfds, int timeout_ms);

/* Encodes a whole frame (header + payload) into a malloc'd buffer (the
 * caller frees *out), for callers that queue frames themselves; nfds only
 * fills the header's fd_count. Such a caller must pass the fds with a
 * sendmsg that starts with the frame's first byte and sends no byte of
 * another frame, as zd_frame_send does: that is how the reader knows whose
 * they are. Same argument errors as zd_frame_send. */
int zd_frame_encode(uint16_t type, uint64_t request_id, uint8_t flags, unsigned nfds,
                    const ProtobufCMessage *msg, uint8_t **out, size_t *out_bytes);

#endif /* ZD_FRAME_H */
