/* Fuzz target: the IPC frame and message decoders (proto/frame.c), fed the
 * bytes a hostile worker or daemon could write on the socket.
 *
 * The input becomes a byte stream of frames, which goes two ways:
 *  - a walker decodes header after header from the buffer and unpacks each
 *    payload as the header's type, the way the daemon handles a frame;
 *  - the same stream is written through a socketpair, in chunks whose sizes
 *    come from the input, into a non-blocking zd_frame_reader.
 * The two must agree on every frame (same count, same headers, same
 * payload bytes), a message that unpacks must pack and unpack again, and
 * nothing may crash, leak or read outside its buffer.
 *
 * Random bytes almost never start with the frame magic, so the first input
 * byte picks how the stream is made. Odd: the rest of the input is the
 * stream, raw. Even: the rest is a list of records, each [selector,
 * length_lo, length_hi] followed by up to `length` payload bytes, and each
 * record becomes a frame with a valid header, so random inputs reach the
 * protobuf decoder and the message bounds. The selector picks a known type
 * (bit 7 clear) or uses its low bits as a raw, usually unknown, type (bit 7
 * set); bit 6 sets NO_REPLY, and bit 5 claims one fd that never comes. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "frame.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const uint16_t known_types[] = {
    ZEROD__V1__MSG_TYPE__MSG_ERROR,         ZEROD__V1__MSG_TYPE__MSG_NOTICE,
    ZEROD__V1__MSG_TYPE__MSG_ATTACH,        ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_GATHER,        ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_RELEASE,       ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER,   ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_REDUCE,        ZEROD__V1__MSG_TYPE__MSG_REDUCE_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_STEP,          ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_DETACH,        ZEROD__V1__MSG_TYPE__MSG_DETACH_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_UNITS,         ZEROD__V1__MSG_TYPE__MSG_UNITS_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_PIN,           ZEROD__V1__MSG_TYPE__MSG_PIN_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT,     ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_STATS,         ZEROD__V1__MSG_TYPE__MSG_STATS_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_READ_STATE,    ZEROD__V1__MSG_TYPE__MSG_READ_STATE_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS,    ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM,     ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT,    ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT_REPLY,
    ZEROD__V1__MSG_TYPE__MSG_WATCH,         ZEROD__V1__MSG_TYPE__MSG_WATCH_REPLY,
};
#define N_KNOWN_TYPES (sizeof known_types / sizeof known_types[0])

/* Frames are remembered by the walker and checked against the reader. */
#define MAX_FRAMES 4096

typedef struct walked_frame {
  zd_frame_header header;
  size_t payload_at; /* offset of the payload in the stream */
} walked_frame;

/* Builds the stream of synthesized frames (see the top of the file). */
static uint8_t *synthesize(const uint8_t *in, size_t in_bytes, size_t *out_bytes) {
  /* Each record of at least 3 input bytes becomes at most 24 + its payload,
   * so 9 times the input is always enough. */
  uint8_t *out = malloc(in_bytes * 9 + 1);
  if (out == NULL)
    return NULL;
  size_t at = 0, len = 0;
  uint64_t request_id = 1;
  while (in_bytes - at >= 3) {
    uint8_t selector = in[at];
    size_t payload_bytes = (size_t)(in[at + 1] | (in[at + 2] << 8));
    at += 3;
    if (payload_bytes > in_bytes - at)
      payload_bytes = in_bytes - at;
    zd_frame_header header = {
        .magic = ZD_FRAME_MAGIC,
        .version = ZD_FRAME_VERSION,
        .type =
            (selector & 0x80) ? (uint16_t)(selector & 0x1f) : known_types[selector % N_KNOWN_TYPES],
        .request_id = request_id++,
        .payload_bytes = (uint32_t)payload_bytes,
        .fd_count = (selector & 0x20) ? 1 : 0,
        .flags = (selector & 0x40) ? ZD_FRAME_F_NO_REPLY : 0,
    };
    zd_frame_header_encode(&header, out + len);
    memcpy(out + len + ZD_FRAME_HEADER_BYTES, in + at, payload_bytes);
    len += ZD_FRAME_HEADER_BYTES + payload_bytes;
    at += payload_bytes;
  }
  *out_bytes = len;
  return out;
}

/* Unpacks one payload the way the daemon would; a message that unpacks
 * must survive a pack/unpack round trip with its bounds intact. */
static void unpack_payload(uint16_t type, const uint8_t *payload, size_t payload_bytes) {
  /* An exact-size copy, so that AddressSanitizer sees any over-read. */
  uint8_t *exact = malloc(payload_bytes ? payload_bytes : 1);
  if (exact == NULL)
    return;
  memcpy(exact, payload, payload_bytes);
  unsigned min_fds, max_fds;
  bool known = zd_msg_fd_range(type, &min_fds, &max_fds) == 0;
  if (known != (zd_msg_descriptor(type) != NULL) || (known && min_fds > max_fds))
    abort();
  ProtobufCMessage *msg = NULL;
  const char *why = NULL;
  int rc = zd_msg_unpack(type, exact, payload_bytes, &msg, &why);
  if (rc == 0) {
    if (msg == NULL || msg->descriptor != zd_msg_descriptor(type))
      abort();
    size_t packed_bytes = protobuf_c_message_get_packed_size(msg);
    if (packed_bytes <= ZD_FRAME_MAX_PAYLOAD) {
      uint8_t *packed = malloc(packed_bytes ? packed_bytes : 1);
      if (packed != NULL) {
        protobuf_c_message_pack(msg, packed);
        ProtobufCMessage *again = NULL;
        if (zd_msg_unpack(type, packed, packed_bytes, &again, &why) != 0)
          abort(); /* a valid message must stay valid once re-encoded */
        protobuf_c_message_free_unpacked(again, NULL);
        free(packed);
      }
    }
    protobuf_c_message_free_unpacked(msg, NULL);
  } else {
    if (msg != NULL || why == NULL)
      abort();
    if (rc != -EBADMSG && !(rc == -EPROTO && !known))
      abort();
  }
  free(exact);
}

/* Walks the stream frame by frame. Returns the number of frames the reader
 * must deliver: those before the first bad header, truncated frame, or
 * header announcing fds (none are ever sent). */
static size_t walk(const uint8_t *stream, size_t stream_bytes, walked_frame *frames) {
  size_t at = 0, count = 0;
  while (stream_bytes - at >= ZD_FRAME_HEADER_BYTES && count < MAX_FRAMES) {
    zd_frame_header header;
    const char *why = NULL;
    int rc = zd_frame_header_decode(stream + at, stream_bytes - at, &header, &why);
    if (rc != 0) {
      if (why == NULL || (rc != -EPROTO && rc != -EMSGSIZE))
        abort();
      break;
    }
    if (header.payload_bytes > ZD_FRAME_MAX_PAYLOAD || header.fd_count > ZD_FRAME_MAX_FDS)
      abort();
    if (header.payload_bytes > stream_bytes - at - ZD_FRAME_HEADER_BYTES)
      break;
    const uint8_t *payload = stream + at + ZD_FRAME_HEADER_BYTES;
    unpack_payload(header.type, payload, header.payload_bytes);
    if (header.fd_count != 0)
      break;
    frames[count].header = header;
    frames[count].payload_at = at + ZD_FRAME_HEADER_BYTES;
    count++;
    at += ZD_FRAME_HEADER_BYTES + header.payload_bytes;
  }
  return count;
}

/* Takes every frame the reader has ready and checks it against the walk.
 * Returns false once the reader has failed. */
static bool drain(zd_frame_reader *reader, int sock, const uint8_t *stream,
                  const walked_frame *frames, size_t expected, size_t *delivered) {
  for (;;) {
    const char *why = NULL;
    int rc = zd_frame_read(reader, sock, &why);
    if (rc == 0)
      return true;
    if (rc < 0) {
      /* A failed reader holds nothing: no payload, no descriptors, nothing
       * read ahead. */
      if (why == NULL || reader->payload != NULL || reader->nfds != 0 || reader->chunk_nfds != 0 ||
          reader->buffer != NULL)
        abort();
      return false;
    }
    zd_frame_header header;
    uint8_t *payload;
    int fds[ZD_FRAME_MAX_FDS];
    unsigned nfds;
    zd_frame_reader_take(reader, &header, &payload, fds, &nfds);
    if (*delivered >= expected || nfds != 0)
      abort(); /* the reader found a frame the walker did not */
    const walked_frame *walked = &frames[*delivered];
    if (memcmp(&header, &walked->header, sizeof header) != 0)
      abort();
    if (header.payload_bytes != 0 &&
        (payload == NULL || memcmp(payload, stream + walked->payload_at, header.payload_bytes)))
      abort();
    free(payload);
    (*delivered)++;
  }
}

/* Pushes the stream through a socketpair into the incremental reader. */
static void read_through_socket(const uint8_t *stream, size_t stream_bytes, uint8_t chunk_seed,
                                const walked_frame *frames, size_t expected) {
  int sock[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sock) != 0)
    return;
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  size_t delivered = 0, written = 0;
  bool reading = true, send_failed = false;
  /* Chunk sizes vary with the position, so that frames arrive split at many
   * different points: 1 to 32 bytes when bit 6 of the seed is set and the
   * stream is short (tiny writes cost a few syscalls each), else 1 to 4096
   * bytes. */
  size_t chunk_range = (chunk_seed & 0x40) && stream_bytes <= 4096 ? 32 : 4096;
  size_t chunk_bytes = 1 + chunk_seed % chunk_range;
  while (reading && written < stream_bytes) {
    size_t want = stream_bytes - written < chunk_bytes ? stream_bytes - written : chunk_bytes;
    ssize_t n = send(sock[0], stream + written, want, MSG_NOSIGNAL);
    if (n > 0) {
      written += (size_t)n;
    } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      send_failed = true;
      break;
    }
    reading = drain(&reader, sock[1], stream, frames, expected, &delivered);
    chunk_bytes = 1 + (chunk_bytes * 131 + written) % chunk_range;
  }
  if (reading && !send_failed) {
    shutdown(sock[0], SHUT_WR);
    /* End of stream must fail the reader, as -ECONNRESET. */
    if (drain(&reader, sock[1], stream, frames, expected, &delivered))
      abort();
  }
  /* The reader stops exactly where the walker did: at the first bad header,
   * truncated frame, or frame whose fds never came. */
  if (!send_failed && delivered != expected)
    abort();
  zd_frame_reader_reset(&reader);
  close(sock[0]);
  close(sock[1]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2)
    return 0;
  bool synthesized = (data[0] & 1) == 0;
  uint8_t chunk_seed = data[0];
  size_t stream_bytes = size - 1;
  uint8_t *stream = synthesized ? synthesize(data + 1, size - 1, &stream_bytes) : NULL;
  if (synthesized && stream == NULL)
    return 0;
  const uint8_t *bytes = synthesized ? stream : data + 1;

  walked_frame *frames = malloc(sizeof *frames * MAX_FRAMES);
  if (frames != NULL) {
    size_t expected = walk(bytes, stream_bytes, frames);
    /* The reader is only compared when the walk saw the whole stream's
     * frames (it stops at MAX_FRAMES). */
    if (expected < MAX_FRAMES)
      read_through_socket(bytes, stream_bytes, chunk_seed, frames, expected);
    free(frames);
  }
  free(stream);
  return 0;
}
