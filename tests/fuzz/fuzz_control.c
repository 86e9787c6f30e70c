/* Fuzz target: the control plane's request decoders (daemon/ctl_decode.c),
 * fed the bytes any gRPC client could send the coordinator, the state file
 * decoder the coordinator runs at start, and the node's decoding of what
 * the coordinator sends it (WatchEvent, JoinReply).
 *
 * The first input byte picks what the rest is: a request of one of the
 * CTL_NMETHODS methods, an unknown method path, a CoordinatorState (the
 * coordinator.pb file, checked job by job as coord.c loads it), or a
 * WatchEvent or JoinReply as a node decodes them (cluster.c, through
 * ctl_decode_message). Decoding must never crash, leak or read outside the
 * buffer; a request it accepts must be accepted again once re-encoded
 * (validation depends only on the message), every string of what it
 * accepts must be NUL-free, well-formed UTF-8 (proto/pbcheck.c), and a
 * refusal must come with a status and a message.
 *
 * Random bytes are seldom a well-formed message whose names and ranges
 * pass, so with bit 7 of the first byte set the rest of the input instead
 * steers an encoder that walks the message's descriptor and writes valid
 * wire format: which fields are present, how many repeats, and values drawn
 * mostly from the edges the validators check (name alphabets, lengths
 * around the limits, 0, 64, 65, NaN, infinities). That reaches every
 * validator on plain pseudo-random input, as the replay build runs it. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ctl_decode.h"
#include "pbcheck.h"
#include "rpc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* ------------------------------------------------------------------------ */
/* The descriptor-driven encoder                                            */
/* ------------------------------------------------------------------------ */

typedef struct source {
  const uint8_t *at;
  size_t left;
} source;

static uint8_t take(source *s) {
  if (s->left == 0)
    return 0;
  s->left--;
  return *s->at++;
}

#define SINK_CAP (1u << 16)

typedef struct sink {
  uint8_t bytes[SINK_CAP];
  size_t len;
} sink;

static void put_byte(sink *k, uint8_t b) {
  if (k->len < SINK_CAP)
    k->bytes[k->len++] = b;
}

static void put_varint(sink *k, uint64_t v) {
  do {
    put_byte(k, (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0)));
    v >>= 7;
  } while (v != 0);
}

static void put_fixed(sink *k, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++)
    put_byte(k, (uint8_t)(v >> (8 * i)));
}

/* Integers near the limits the validators check. */
static uint64_t pick_integer(source *s) {
  static const uint64_t edges[] = {0,  1,  2,   3,    4,    8,          9,         63,
                                   64, 65, 255, 4096, 4097, UINT32_MAX, UINT64_MAX};
  uint8_t b = take(s);
  if (b < 128)
    return edges[b % (sizeof edges / sizeof edges[0])];
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v = v << 8 | take(s);
  return v;
}

static double pick_double(source *s) {
  static const double edges[] = {0, 1e-3, 0.1, 0.5, 0.9, 0.999, 1, 1.5, -1, -0.0, 1e308};
  uint8_t b = take(s);
  switch (b % 16) {
  case 11:
    return NAN;
  case 12:
    return INFINITY;
  case 13:
    return -INFINITY;
  default:
    return b % 16 < 11 ? edges[b % 16] : (double)(int8_t)take(s);
  }
}

/* Text: mostly the name alphabet, sometimes bytes that are not (spaces,
 * control characters, NUL, UTF-8 and broken UTF-8: overlong forms,
 * surrogates, code points above U+10FFFF, cut sequences), at lengths
 * around the limits. */
static void put_text(sink *k, source *s) {
  static const uint16_t lengths[] = {0, 1, 2, 63, 64, 65, 255, 256, 257, 511, 512, 513, 1025};
  static const char alphabet[] = "abcxyzAZ09._-";
  static const uint8_t odd[] = {' ',  '/',  '\n', 0x7f, 0xc3, 0xa9, 0xe2, 0x82, 0xac,
                                0xff, 0x80, 0x00, 0xc0, 0xaf, 0xed, 0xa0, 0xf4, 0x90};
  uint8_t how = take(s);
  size_t len = how < 160 ? how % 12 : lengths[how % (sizeof lengths / sizeof lengths[0])];
  put_varint(k, len);
  for (size_t i = 0; i < len; i++) {
    uint8_t b = take(s);
    put_byte(k, b < 240 ? (uint8_t)alphabet[b % (sizeof alphabet - 1)] : odd[b % sizeof odd]);
  }
}

static void encode_message(const ProtobufCMessageDescriptor *d, source *s, sink *out, int depth);

static void encode_field(const ProtobufCFieldDescriptor *f, source *s, sink *out, int depth) {
  uint64_t v;
  switch (f->type) {
  case PROTOBUF_C_TYPE_INT32:
  case PROTOBUF_C_TYPE_INT64:
  case PROTOBUF_C_TYPE_UINT32:
  case PROTOBUF_C_TYPE_UINT64:
  case PROTOBUF_C_TYPE_SINT32:
  case PROTOBUF_C_TYPE_SINT64:
  case PROTOBUF_C_TYPE_BOOL:
  case PROTOBUF_C_TYPE_ENUM:
    put_varint(out, (uint64_t)f->id << 3 | 0);
    put_varint(out, f->type == PROTOBUF_C_TYPE_BOOL ? take(s) & 1 : pick_integer(s));
    break;
  case PROTOBUF_C_TYPE_DOUBLE: {
    double x = pick_double(s);
    memcpy(&v, &x, sizeof v);
    put_varint(out, (uint64_t)f->id << 3 | 1);
    put_fixed(out, v, 8);
    break;
  }
  case PROTOBUF_C_TYPE_FIXED64:
  case PROTOBUF_C_TYPE_SFIXED64:
    put_varint(out, (uint64_t)f->id << 3 | 1);
    put_fixed(out, pick_integer(s), 8);
    break;
  case PROTOBUF_C_TYPE_FLOAT:
  case PROTOBUF_C_TYPE_FIXED32:
  case PROTOBUF_C_TYPE_SFIXED32:
    put_varint(out, (uint64_t)f->id << 3 | 5);
    put_fixed(out, pick_integer(s), 4);
    break;
  case PROTOBUF_C_TYPE_STRING:
  case PROTOBUF_C_TYPE_BYTES:
    put_varint(out, (uint64_t)f->id << 3 | 2);
    put_text(out, s);
    break;
  case PROTOBUF_C_TYPE_MESSAGE: {
    if (depth >= 4)
      break;
    sink *inner = malloc(sizeof *inner);
    if (inner == NULL)
      break;
    inner->len = 0;
    encode_message(f->descriptor, s, inner, depth + 1);
    put_varint(out, (uint64_t)f->id << 3 | 2);
    put_varint(out, inner->len);
    for (size_t i = 0; i < inner->len; i++)
      put_byte(out, inner->bytes[i]);
    free(inner);
    break;
  }
  }
}

static void encode_message(const ProtobufCMessageDescriptor *d, source *s, sink *out, int depth) {
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    uint8_t control = take(s);
    if ((control & 3) == 0)
      continue; /* absent a quarter of the time */
    unsigned repeats = f->label == PROTOBUF_C_LABEL_REPEATED ? (control >> 2) % 5 : 1;
    for (unsigned r = 0; r < repeats; r++)
      encode_field(f, s, out, depth);
  }
}

/* ------------------------------------------------------------------------ */
/* The checks                                                               */
/* ------------------------------------------------------------------------ */

/* Every string of an accepted message is NUL-free, well-formed UTF-8: its
 * bytes, packed again, pass the string check. */
static void check_strings_again(const ProtobufCMessage *msg) {
  size_t packed_bytes = protobuf_c_message_get_packed_size(msg);
  uint8_t *packed = malloc(packed_bytes ? packed_bytes : 1);
  if (packed == NULL)
    return;
  protobuf_c_message_pack(msg, packed);
  char err[512];
  if (zd_pb_check_strings(msg->descriptor, packed, packed_bytes, err, sizeof err) != 0)
    abort();
  free(packed);
}

/* A message from outside that is not a request (ctl_decode_message): the
 * state file, or what the coordinator sends a node. A refusal says why. */
static ProtobufCMessage *fuzz_message(const ProtobufCMessageDescriptor *desc, const uint8_t *bytes,
                                      size_t nbytes) {
  ProtobufCMessage *msg = NULL;
  char err[512] = "";
  if (ctl_decode_message(desc, bytes, nbytes, &msg, err, sizeof err) != 0) {
    if (msg != NULL || err[0] == '\0')
      abort();
    return NULL;
  }
  if (msg == NULL)
    abort();
  check_strings_again(msg);
  return msg;
}

static void fuzz_state_file(const uint8_t *bytes, size_t nbytes) {
  Zerod__V1__CoordinatorState *state = (Zerod__V1__CoordinatorState *)fuzz_message(
      &zerod__v1__coordinator_state__descriptor, bytes, nbytes);
  if (state == NULL)
    return;
  char err[512];
  for (size_t i = 0; i < state->n_jobs; i++) {
    err[0] = '\0';
    if (state->jobs[i] != NULL && ctl_check_stored_job(state->jobs[i], err, sizeof err) != 0 &&
        err[0] == '\0')
      abort(); /* a refusal always says why */
  }
  for (size_t i = 0; i < state->n_retired; i++) {
    err[0] = '\0';
    const Zerod__V1__RetiredJob *r = state->retired[i];
    if (r == NULL)
      continue;
    if (ctl_check_retired_job(r, err, sizeof err) != 0) {
      if (err[0] == '\0')
        abort();
    } else if (!ctl_parse_checkpoint_dir(r->name, NULL, NULL) || r->id == 0) {
      abort(); /* an accepted record names a directory the coordinator can make */
    }
  }
  zerod__v1__coordinator_state__free_unpacked(state, NULL);
}

static void fuzz_request(const char *path, const uint8_t *bytes, size_t nbytes) {
  ProtobufCMessage *msg = NULL;
  char err[512] = "";
  int status = ctl_decode(path, bytes, nbytes, &msg, err, sizeof err);
  if (status != 0) {
    if (msg != NULL || err[0] == '\0')
      abort();
    if (status != RPC_INVALID_ARGUMENT &&
        !(status == RPC_UNIMPLEMENTED && path[0] == '/' && strstr(path, "NoSuchMethod") != NULL))
      abort();
    return;
  }
  if (msg == NULL)
    abort();
  check_strings_again(msg);
  size_t packed_bytes = protobuf_c_message_get_packed_size(msg);
  uint8_t *packed = malloc(packed_bytes ? packed_bytes : 1);
  if (packed != NULL) {
    protobuf_c_message_pack(msg, packed);
    ProtobufCMessage *again = NULL;
    if (ctl_decode(path, packed, packed_bytes, &again, err, sizeof err) != 0)
      abort(); /* a valid request must stay valid once re-encoded */
    ctl_free(again);
    free(packed);
  }
  ctl_free(msg);
}

/* The messages from outside that are not requests, after the methods and
 * the unknown path in the selector's range: the state file, and what a
 * node decodes from the coordinator (cluster.c). reconcile(), which acts
 * on a WatchEvent, needs a whole daemon and is left out; the decoding is
 * what sees the bytes. */
static const ProtobufCMessageDescriptor *const others[] = {
    &zerod__v1__coordinator_state__descriptor,
    &zerod__v1__watch_event__descriptor,
    &zerod__v1__join_reply__descriptor,
};
#define N_OTHERS (sizeof others / sizeof others[0])

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  unsigned selector = data[0] % (CTL_NMETHODS + 1 + N_OTHERS);
  const ProtobufCMessageDescriptor *other =
      selector > CTL_NMETHODS ? others[selector - CTL_NMETHODS - 1] : NULL;
  /* An exact-size copy, so that AddressSanitizer sees any over-read. */
  size_t nbytes = size - 1;
  uint8_t *bytes = malloc(nbytes ? nbytes : 1);
  if (bytes == NULL)
    return 0;
  memcpy(bytes, data + 1, nbytes);
  if ((data[0] & 0x80) != 0 && selector != CTL_NMETHODS) {
    /* Structured: the input steers an encoder of the method's request
     * (every method ctl_decode knows, the Checkpoints ones included) or of
     * the other message. */
    sink *encoded = malloc(sizeof *encoded);
    if (encoded != NULL) {
      source steer = {bytes, nbytes};
      encoded->len = 0;
      encode_message(other != NULL ? other : ctl_method_request(selector), &steer, encoded, 0);
      /* Again an exact-size copy for AddressSanitizer. */
      uint8_t *exact = malloc(encoded->len ? encoded->len : 1);
      if (exact != NULL) {
        memcpy(exact, encoded->bytes, encoded->len);
        if (other == &zerod__v1__coordinator_state__descriptor)
          fuzz_state_file(exact, encoded->len);
        else if (other != NULL)
          ctl_free(fuzz_message(other, exact, encoded->len));
        else
          fuzz_request(ctl_method_path(selector), exact, encoded->len);
        free(exact);
      }
      free(encoded);
    }
  } else if (selector < CTL_NMETHODS) {
    fuzz_request(ctl_method_path(selector), bytes, nbytes);
  } else if (selector == CTL_NMETHODS) {
    fuzz_request("/zerod.v1.Cluster/NoSuchMethod", bytes, nbytes);
  } else if (other == &zerod__v1__coordinator_state__descriptor) {
    fuzz_state_file(bytes, nbytes);
  } else {
    ctl_free(fuzz_message(other, bytes, nbytes));
  }
  free(bytes);
  return 0;
}
