/* pbcheck: the strings of a protobuf message, checked in wire format (see
 * pbcheck.h), and the UTF-8 rules they are checked against.
 *
 * The walk reads the wire format the way protobuf-c's unpacker does
 * (protobuf-c.c: parse_tag_and_wiretype, scan_length_prefixed_data,
 * scan_varint), with the same limits on tag, length and varint encodings,
 * so that bytes the walker refuses as malformed are bytes protobuf-c would
 * refuse too, and bytes it accepts reach protobuf-c with every string it
 * will unpack already checked. */
#include "pbcheck.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * UTF-8
 * ------------------------------------------------------------------------ */

size_t zd_utf8_char(const unsigned char *p, size_t len) {
  unsigned char c = p[0];
  size_t extra;
  uint32_t cp;
  if (c < 0x80)
    return 1;
  if (c >= 0xc2 && c <= 0xdf) {
    extra = 1;
    cp = c & 0x1f;
  } else if (c >= 0xe0 && c <= 0xef) {
    extra = 2;
    cp = c & 0x0f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    extra = 3;
    cp = c & 0x07;
  } else {
    return 0; /* a continuation byte, 0xc0/0xc1 (always overlong), or 0xf5.. */
  }
  if (len <= extra)
    return 0;
  for (size_t k = 1; k <= extra; k++) {
    if ((p[k] & 0xc0) != 0x80)
      return 0;
    cp = (cp << 6) | (p[k] & 0x3f);
  }
  if ((extra == 2 && cp < 0x800) || (extra == 3 && cp < 0x10000) || cp > 0x10ffff ||
      (cp >= 0xd800 && cp <= 0xdfff))
    return 0;
  return extra + 1;
}

size_t zd_utf8_invalid_at(const char *s, size_t len) {
  const unsigned char *p = (const unsigned char *)s;
  size_t i = 0;
  for (size_t n; i < len; i += n)
    if ((n = zd_utf8_char(p + i, len - i)) == 0)
      return i;
  return len;
}

bool zd_utf8_valid(const char *s, size_t len) {
  return zd_utf8_invalid_at(s, len) == len;
}

void zd_utf8_sanitize(char *s) {
  unsigned char *p = (unsigned char *)s;
  size_t len = strlen(s);
  for (size_t i = 0, n; i < len; i += n) {
    if ((n = zd_utf8_char(p + i, len - i)) == 0) {
      p[i] = '?';
      n = 1;
    }
  }
}

/* ------------------------------------------------------------------------
 * Wire format
 * ------------------------------------------------------------------------ */

/* protobuf-c's limits: a tag and a length prefix take at most 5 bytes, a
 * varint value at most 10. */
#define TAG_MAX_BYTES    5
#define LENGTH_MAX_BYTES 5
#define VARINT_MAX_BYTES 10

#define WIRE_VARINT  0
#define WIRE_FIXED64 1
#define WIRE_LENGTH  2
#define WIRE_FIXED32 5

/* One field as it sits in the bytes. */
typedef struct wire_field {
  uint64_t number;
  unsigned wire_type;
  size_t value_at, value_bytes; /* the payload of a WIRE_LENGTH field */
} wire_field;

/* Reads a varint of at most max_bytes from bytes[*at, end). Returns false
 * when it runs past end or past max_bytes. */
static bool read_varint(const uint8_t *bytes, size_t end, size_t *at, unsigned max_bytes,
                        uint64_t *value) {
  uint64_t v = 0;
  for (unsigned i = 0; i < max_bytes && *at < end; i++) {
    uint8_t b = bytes[(*at)++];
    v |= (uint64_t)(b & 0x7f) << (7 * i); /* i < VARINT_MAX_BYTES: at most 63 */
    if ((b & 0x80) == 0) {
      *value = v;
      return true;
    }
  }
  return false;
}

/* Reads the field at bytes[*at, end) and moves *at past it. Returns false
 * for anything protobuf-c's unpacker refuses: a one-byte tag of field 0, a
 * truncated field, a length past end, groups and unknown wire types. */
static bool read_field(const uint8_t *bytes, size_t end, size_t *at, wire_field *field) {
  /* protobuf-c refuses a zero tag written in one byte but takes a longer
   * encoding of it as an unknown field (frame.c and ctl_decode.c refuse
   * those after unpacking); the walker skips it the same way. */
  if ((bytes[*at] & 0xf8) == 0)
    return false;
  uint64_t tag, value;
  if (!read_varint(bytes, end, at, TAG_MAX_BYTES, &tag))
    return false;
  field->number = tag >> 3;
  field->wire_type = (unsigned)(tag & 7);
  switch (field->wire_type) {
  case WIRE_VARINT:
    return read_varint(bytes, end, at, VARINT_MAX_BYTES, &value);
  case WIRE_FIXED64:
  case WIRE_FIXED32: {
    size_t width = field->wire_type == WIRE_FIXED64 ? 8 : 4;
    if (end - *at < width)
      return false;
    *at += width;
    return true;
  }
  case WIRE_LENGTH:
    if (!read_varint(bytes, end, at, LENGTH_MAX_BYTES, &value) || value > end - *at)
      return false;
    field->value_at = *at;
    field->value_bytes = (size_t)value;
    *at += (size_t)value;
    return true;
  default:
    return false; /* groups (3, 4) and the undefined types 6, 7 */
  }
}

/* ------------------------------------------------------------------------
 * The walk
 * ------------------------------------------------------------------------ */

/* A message being walked: its bytes [start, end), the next field's offset,
 * and (below the top) the field of the enclosing message that holds it,
 * whose tag is at field_at, for naming the path in an error. */
typedef struct level {
  const ProtobufCMessageDescriptor *desc;
  size_t start, end, at;
  const ProtobufCFieldDescriptor *field;
  size_t field_at;
} level;

/* How many times field `number` occurs as a length-delimited field in
 * bytes[start, stop): the index of the occurrence at stop in a repeated
 * field. Only called on bytes the walk has already read. */
static size_t occurrences_before(const uint8_t *bytes, size_t start, size_t stop, uint64_t number) {
  size_t count = 0;
  wire_field field;
  for (size_t at = start; at < stop && read_field(bytes, stop, &at, &field);)
    if (field.number == number && field.wire_type == WIRE_LENGTH)
      count++;
  return count;
}

/* Appends ".name" (no dot first) and "[index]" for a repeated field. */
static void append_segment(char *path, size_t path_bytes, size_t *used,
                           const ProtobufCFieldDescriptor *field, const uint8_t *bytes,
                           const level *holder, size_t field_at) {
  if (*used >= path_bytes)
    return;
  int n = snprintf(path + *used, path_bytes - *used, "%s%s", *used > 0 ? "." : "", field->name);
  *used = n < 0 ? path_bytes : *used + (size_t)n;
  if (field->label != PROTOBUF_C_LABEL_REPEATED || *used >= path_bytes)
    return;
  size_t index = occurrences_before(bytes, holder->start, field_at, field->id);
  n = snprintf(path + *used, path_bytes - *used, "[%zu]", index);
  *used = n < 0 ? path_bytes : *used + (size_t)n;
}

/* Writes the path of the string field `leaf` (its tag at leaf_at in the
 * innermost message of stack[0..depth]), e.g. "node.devices[1].name". */
static void field_path(const uint8_t *bytes, const level *stack, int depth,
                       const ProtobufCFieldDescriptor *leaf, size_t leaf_at, char *path,
                       size_t path_bytes) {
  size_t used = 0;
  path[0] = '\0';
  for (int k = 1; k <= depth; k++)
    append_segment(path, path_bytes, &used, stack[k].field, bytes, &stack[k - 1],
                   stack[k].field_at);
  append_segment(path, path_bytes, &used, leaf, bytes, &stack[depth], leaf_at);
}

static int report(char *err, size_t err_bytes, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int report(char *err, size_t err_bytes, int rc, const char *fmt, ...) {
  if (err_bytes > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_bytes, fmt, ap);
    va_end(ap);
  }
  return rc;
}

int zd_pb_check_strings(const ProtobufCMessageDescriptor *desc, const uint8_t *bytes, size_t nbytes,
                        char *err, size_t err_bytes) {
  if (err_bytes > 0)
    err[0] = '\0';
  if (nbytes == 0)
    return 0;
  if (bytes == NULL)
    return report(err, err_bytes, -EBADMSG, "%s does not decode (no bytes)", desc->name);

  level stack[ZD_PB_MAX_DEPTH];
  int depth = 0;
  stack[0] = (level){.desc = desc, .start = 0, .end = nbytes, .at = 0};
  /* Every pass reads at least one byte of a field or leaves a message, and
   * a message is entered only by reading its field, so the walk ends after
   * at most 2 * nbytes passes. */
  while (depth >= 0) {
    level *msg = &stack[depth];
    if (msg->at >= msg->end) {
      depth--;
      continue;
    }
    size_t field_at = msg->at;
    wire_field wire;
    if (!read_field(bytes, msg->end, &msg->at, &wire))
      return report(err, err_bytes, -EBADMSG, "%s does not decode", desc->name);
    if (wire.wire_type != WIRE_LENGTH || wire.number > UINT32_MAX)
      continue;
    /* A known field with another wire type than its own makes protobuf-c
     * refuse the message; such a field is not checked here. */
    const ProtobufCFieldDescriptor *field =
        protobuf_c_message_descriptor_get_field(msg->desc, (unsigned)wire.number);
    if (field == NULL)
      continue; /* unknown: kept as bytes, never read as a string */
    if (field->type == PROTOBUF_C_TYPE_STRING) {
      const unsigned char *text = bytes + wire.value_at;
      for (size_t i = 0, n; i < wire.value_bytes; i += n) {
        n = text[i] == 0 ? 0 : zd_utf8_char(text + i, wire.value_bytes - i);
        if (n != 0)
          continue;
        char path[256];
        field_path(bytes, stack, depth, field, field_at, path, sizeof path);
        if (text[i] == 0)
          return report(err, err_bytes, -EILSEQ, "field '%s' of %s contains a NUL byte at byte %zu",
                        path, desc->name, i);
        return report(err, err_bytes, -EILSEQ, "field '%s' of %s is not valid UTF-8 (at byte %zu)",
                      path, desc->name, i);
      }
    } else if (field->type == PROTOBUF_C_TYPE_MESSAGE) {
      if (depth + 1 >= ZD_PB_MAX_DEPTH)
        return report(err, err_bytes, -ELOOP, "%s nests messages deeper than %d", desc->name,
                      ZD_PB_MAX_DEPTH);
      stack[++depth] = (level){.desc = field->descriptor,
                               .start = wire.value_at,
                               .end = wire.value_at + wire.value_bytes,
                               .at = wire.value_at,
                               .field = field,
                               .field_at = field_at};
    }
  }
  return 0;
}
