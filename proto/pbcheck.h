/* pbcheck: the strings of a protobuf message, checked in wire format.
 *
 * protobuf-c unpacks a `string` field into a NUL-terminated char *, so a
 * NUL byte inside one cuts it short and every C reader sees only the part
 * before it: a job named "a\0zzz" would be job "a". protobuf-c does not
 * check UTF-8 either, which proto3 requires of strings (and which other
 * proto3 readers, Python's among them, enforce). Both can only be seen in
 * the bytes, before unpacking, so the decoders of outside bytes (the IPC
 * protocol's zd_msg_unpack in frame.c, the control plane's ctl_decode, the
 * node's reading of what the coordinator sends, the coordinator's state
 * file) run zd_pb_check_strings on a message's bytes first.
 *
 * The walker follows the message's descriptor: every field the descriptor
 * knows as a string (singular, optional, oneof or repeated, at any depth)
 * must be free of NUL bytes and well-formed UTF-8; fields of message type
 * are entered with their own descriptor (map fields are repeated entry
 * messages, so map keys and values are covered); bytes fields, packed
 * scalars and unknown fields are skipped. It never reads outside
 * bytes[0, nbytes), never allocates, and keeps its own stack of at most
 * ZD_PB_MAX_DEPTH nested messages. Thread-safe. */
#ifndef ZD_PBCHECK_H
#define ZD_PBCHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

/* Messages nested deeper than this are refused. No zerod schema comes
 * close (none is recursive); the limit keeps the walk's stack fixed. */
#define ZD_PB_MAX_DEPTH 32

/* Checks every string field of the message desc that bytes[0, nbytes)
 * encodes (bytes may be NULL when nbytes is 0). Returns 0 when they are all
 * NUL-free, well-formed UTF-8, or a negative errno with a message in err
 * (err_bytes may be 0):
 *   -EILSEQ  a string field contains a NUL byte or is not valid UTF-8; the
 *            message names the field by its path from the top message and
 *            the byte, e.g. "field 'node.devices[1].name' of
 *            zerod.v1.JoinRequest contains a NUL byte at byte 3";
 *   -ELOOP   messages nested deeper than ZD_PB_MAX_DEPTH;
 *   -EBADMSG the bytes are not protobuf wire format that protobuf-c could
 *            unpack (a truncated field, a length past the end, a group or
 *            an unknown wire type). Callers report this as the unpack
 *            failure it would be. */
int zd_pb_check_strings(const ProtobufCMessageDescriptor *desc, const uint8_t *bytes, size_t nbytes,
                        char *err, size_t err_bytes);

/* The length of the well-formed UTF-8 character that starts p[0, len)
 * (len >= 1): 1..4, or 0 when there is none there (a stray continuation
 * byte, a truncated sequence, an overlong form, a surrogate, or a code
 * point above U+10FFFF). */
size_t zd_utf8_char(const unsigned char *p, size_t len);

/* The offset of the first byte of s[0, len) that does not start a
 * well-formed UTF-8 character, or len when the whole of it is valid. */
size_t zd_utf8_invalid_at(const char *s, size_t len);

/* Whether s[0, len) is well-formed UTF-8 (NUL bytes are valid UTF-8). */
bool zd_utf8_valid(const char *s, size_t len);

/* Makes the NUL-terminated s valid UTF-8 in place: every byte that does
 * not start or continue a well-formed character becomes '?'. For text
 * built with snprintf from parts that may be cut inside a character (a
 * truncated message), before it is sent to a peer whose decoder checks. */
void zd_utf8_sanitize(char *s);

#endif /* ZD_PBCHECK_H */
