/* The IPC frame header and the message types (proto/frame.c): the header's
 * 24 bytes in wire order, its checks in their documented order, each
 * type's descriptor range and message, and an unknown type refused by
 * unpack and send yet read whole by the framing, to be answered by its
 * request id. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "frame.h"
#include "frame_fixtures.h"

/* ------------------------------------------------------------------------
 * Header
 * ------------------------------------------------------------------------ */

static void test_header_is_little_endian_in_wire_order(void **state) {
  zd_frame_header header = {.magic = ZD_FRAME_MAGIC,
                            .version = ZD_FRAME_VERSION,
                            .type = 0x0214,
                            .request_id = 0x0807060504030201ull,
                            .payload_bytes = 0x00030201,
                            .fd_count = 3,
                            .flags = ZD_FRAME_F_NO_REPLY};
  uint8_t bytes[ZD_FRAME_HEADER_BYTES];
  zd_frame_header_encode(&header, bytes);
  const uint8_t expected[ZD_FRAME_HEADER_BYTES] = {
      'Z', 'D', 'I', 'P', 1, 0, 0x14, 0x02, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 0, 3, 1, 0, 0};
  assert_memory_equal(bytes, expected, sizeof expected);
  zd_frame_header decoded;
  const char *why = "unset";
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), 0);
  assert_null(why);
  assert_memory_equal(&decoded, &header, sizeof header);
}

static void test_header_shorter_than_24_bytes_is_rejected(void **state) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0), decoded;
  uint8_t bytes[ZD_FRAME_HEADER_BYTES];
  zd_frame_header_encode(&header, bytes);
  const char *why;
  assert_int_equal(zd_frame_header_decode(bytes, 23, &decoded, &why), -EPROTO);
  expect_why(why, "shorter than 24");
}

static void test_header_checks_run_in_documented_order(void **state) {
  /* Bad in every field at once: the magic is what is reported. */
  zd_frame_header header = {.magic = 1,
                            .version = 9,
                            .payload_bytes = UINT32_MAX,
                            .fd_count = 200,
                            .flags = 0xff,
                            .reserved = 1},
                  decoded;
  uint8_t bytes[ZD_FRAME_HEADER_BYTES];
  const char *why;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EPROTO);
  expect_why(why, "magic");
  header.magic = ZD_FRAME_MAGIC;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EPROTO);
  expect_why(why, "version");
  header.version = ZD_FRAME_VERSION;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EMSGSIZE);
  header.payload_bytes = 0;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EPROTO);
  expect_why(why, "descriptors");
  header.fd_count = 0;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EPROTO);
  expect_why(why, "flag");
  header.flags = 0;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EPROTO);
  expect_why(why, "reserved");
  header.reserved = 0;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, NULL), 0);
}

/* ------------------------------------------------------------------------
 * Types
 * ------------------------------------------------------------------------ */

static void test_fd_ranges_follow_the_protocol(void **state) {
  samples s;
  typed_sample table[SAMPLE_TYPES];
  init_samples(&s);
  size_t n = all_samples(&s, table);
  for (size_t i = 0; i < n; i++) {
    unsigned min_fds = 99, max_fds = 99;
    assert_int_equal(zd_msg_fd_range(table[i].type, &min_fds, &max_fds), 0);
    bool carries_fd = table[i].type == ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT ||
                      table[i].type == ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY ||
                      table[i].type == ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY ||
                      table[i].type == ZEROD__V1__MSG_TYPE__MSG_READ_STATE_REPLY;
    assert_int_equal(min_fds, 0);
    if (max_fds != (carries_fd ? 1u : 0u))
      fail_msg("type %u: expected at most %u fds, got %u", table[i].type, carries_fd ? 1 : 0,
               max_fds);
    assert_ptr_equal(zd_msg_descriptor(table[i].type), table[i].msg->descriptor);
  }
}

static void test_unknown_message_type_has_no_descriptor_and_does_not_unpack(void **state) {
  const uint16_t unknown[] = {ZEROD__V1__MSG_TYPE__MSG_NONE, 3, 15, 50, 0x7fff, 0xffff};
  for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
    assert_null(zd_msg_descriptor(unknown[i]));
    unsigned min_fds, max_fds;
    assert_int_equal(zd_msg_fd_range(unknown[i], &min_fds, &max_fds), -EPROTO);
    ProtobufCMessage *out = (ProtobufCMessage *)1;
    const char *why;
    assert_int_equal(zd_msg_unpack(unknown[i], NULL, 0, &out, &why), -EPROTO);
    assert_null(out);
    expect_why(why, "unknown message type");
    assert_int_equal(zd_frame_send(-1, unknown[i], 1, 0, NULL, NULL, 0, 0), -EINVAL);
  }

  /* The framing itself does not judge the type: the frame is read whole, so
   * the receiver can answer it by request id and go on. */
  int sock[2];
  make_pair(sock, false);
  zd_frame_header header = valid_header(99, 3, 0);
  uint8_t bytes[ZD_FRAME_HEADER_BYTES + 3] = {0};
  zd_frame_header_encode(&header, bytes);
  send_raw(sock[0], bytes, sizeof bytes, NULL, 0);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
  zd_frame_header got;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  zd_frame_reader_take(&reader, &got, &payload, fds, &nfds);
  assert_int_equal(got.type, 99);
  assert_int_equal(got.request_id, 77);
  free(payload);
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_header_is_little_endian_in_wire_order),
      cmocka_unit_test(test_header_shorter_than_24_bytes_is_rejected),
      cmocka_unit_test(test_header_checks_run_in_documented_order),
      cmocka_unit_test(test_fd_ranges_follow_the_protocol),
      cmocka_unit_test(test_unknown_message_type_has_no_descriptor_and_does_not_unpack),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
