/* Malformed frames (proto/frame.c): each class of bad header, early end of
 * stream and misplaced or miscounted descriptors is refused by the reader
 * with its own error, closing every descriptor it received and allocating
 * nothing beyond the caps. The frames are sent over a real socketpair, as
 * a broken or hostile peer would send them. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "frame.h"
#include "frame_fixtures.h"

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

static void send_header(int sock, const zd_frame_header *header, const int *fds, unsigned nfds) {
  uint8_t bytes[ZD_FRAME_HEADER_BYTES];
  zd_frame_header_encode(header, bytes);
  send_raw(sock, bytes, sizeof bytes, fds, nfds);
}

/* The reader's answer to one header sent by a broken peer, with the
 * descriptors it received already closed. */
static int read_after_header(const zd_frame_header *header, const int *fds, unsigned nfds,
                             zd_frame_reader *reader, const char **why) {
  int sock[2];
  make_pair(sock, false);
  send_header(sock[0], header, fds, nfds);
  zd_frame_reader_init(reader);
  int rc = read_frame(reader, sock[1], why);
  close_pair(sock);
  return rc;
}

/* ------------------------------------------------------------------------
 * Malformed frames
 * ------------------------------------------------------------------------ */

static void test_short_header_then_eof_is_connection_reset(void **state) {
  int sock[2];
  make_pair(sock, false);
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0);
  uint8_t bytes[ZD_FRAME_HEADER_BYTES];
  zd_frame_header_encode(&header, bytes);
  send_raw(sock[0], bytes, 10, NULL, 0);
  shutdown(sock[0], SHUT_WR);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  const char *why;
  assert_int_equal(read_frame(&reader, sock[1], &why), -ECONNRESET);
  expect_why(why, "middle of a frame");
  close_pair(sock);
}

static void test_eof_between_frames_is_connection_reset(void **state) {
  int sock[2];
  make_pair(sock, false);
  close(sock[0]);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  const char *why;
  assert_int_equal(read_frame(&reader, sock[1], &why), -ECONNRESET);
  expect_why(why, "connection closed");
  close(sock[1]);
}

static void test_eof_inside_payload_frees_it_and_closes_fds(void **state) {
  int open_before = count_open_fds();
  int sock[2];
  make_pair(sock, false);
  int memfd = make_memfd("x");
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, 100, 1);
  send_header(sock[0], &header, &memfd, 1);
  send_raw(sock[0], "abc", 3, NULL, 0);
  close(memfd);
  shutdown(sock[0], SHUT_WR);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  const char *why;
  assert_int_equal(read_frame(&reader, sock[1], &why), -ECONNRESET);
  assert_null(reader.payload);
  assert_int_equal(reader.nfds, 0);
  assert_int_equal(reader.header.request_id, 77); /* still there to answer with */
  close_pair(sock);
  assert_int_equal(count_open_fds(), open_before);
}

static void test_bad_magic_is_a_protocol_error(void **state) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0);
  header.magic = 0x12345678;
  zd_frame_reader reader;
  const char *why;
  assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EPROTO);
  expect_why(why, "magic");
  assert_null(reader.payload);
}

static void test_bad_version_is_a_protocol_error(void **state) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0);
  header.version = 2;
  zd_frame_reader reader;
  const char *why;
  assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EPROTO);
  expect_why(why, "version");
}

static void test_oversize_payload_is_refused_before_allocating(void **state) {
  const uint32_t sizes[] = {ZD_FRAME_MAX_PAYLOAD + 1, UINT32_MAX};
  for (size_t i = 0; i < 2; i++) {
    zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_ATTACH, sizes[i], 0);
    zd_frame_reader reader;
    const char *why;
    assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EMSGSIZE);
    expect_why(why, "4 MiB");
    /* The header never became current, and no payload buffer exists. */
    assert_null(reader.payload);
    assert_int_equal(reader.header.payload_bytes, 0);
    assert_int_equal(reader.have, 0);
  }
  ProtobufCMessage *out;
  static const uint8_t byte;
  assert_int_equal(
      zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_ERROR, &byte, ZD_FRAME_MAX_PAYLOAD + 1, &out, NULL),
      -EMSGSIZE);
}

static void test_unknown_flag_bits_are_a_protocol_error(void **state) {
  for (unsigned bit = 1; bit < 8; bit++) {
    zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0);
    header.flags = (uint8_t)(ZD_FRAME_F_NO_REPLY | (1u << bit));
    zd_frame_reader reader;
    const char *why;
    assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EPROTO);
    expect_why(why, "flag");
  }
}

static void test_nonzero_reserved_is_a_protocol_error(void **state) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0);
  header.reserved = 0x0100;
  zd_frame_reader reader;
  const char *why;
  assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EPROTO);
  expect_why(why, "reserved");
}

static void test_fd_count_over_the_cap_is_a_protocol_error(void **state) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 0, 5);
  zd_frame_reader reader;
  const char *why;
  assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EPROTO);
  expect_why(why, "more than 4");
}

static void test_more_fds_sent_than_the_cap_are_all_closed(void **state) {
  int open_before = count_open_fds();
  int memfds[5];
  for (int i = 0; i < 5; i++)
    memfds[i] = make_memfd("extra");
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 0, 4);
  zd_frame_reader reader;
  const char *why;
  assert_int_equal(read_after_header(&header, memfds, 5, &reader, &why), -EPROTO);
  expect_why(why, "file descriptors");
  assert_int_equal(reader.nfds, 0);
  for (int i = 0; i < 5; i++)
    close(memfds[i]);
  assert_int_equal(count_open_fds(), open_before);
}

static void test_fd_count_differing_from_fds_sent_is_a_protocol_error(void **state) {
  int open_before = count_open_fds();
  int memfds[2] = {make_memfd("a"), make_memfd("b")};
  /* Fewer than announced, more than announced, and some when none are. */
  const struct {
    uint8_t announced;
    unsigned sent;
  } cases[] = {{2, 1}, {1, 2}, {0, 1}, {3, 0}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    zd_frame_header header =
        valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 0, cases[i].announced);
    zd_frame_reader reader;
    const char *why;
    assert_int_equal(read_after_header(&header, memfds, cases[i].sent, &reader, &why), -EPROTO);
    expect_why(why, "fd count does not match header");
    assert_int_equal(reader.nfds, 0);
    /* The whole frame was read, so the error can name the request. */
    assert_int_equal(reader.header.request_id, 77);
  }
  close(memfds[0]);
  close(memfds[1]);
  assert_int_equal(count_open_fds(), open_before);
}

/* A sender that puts descriptors on a byte in the middle of a frame (here
 * one that announces a descriptor, so that only where they came decides)
 * is refused, and the descriptors are closed. */
static void test_fds_sent_inside_a_frame_are_a_protocol_error(void **state) {
  int open_before = count_open_fds();
  uint8_t frame[ZD_FRAME_HEADER_BYTES + 100];
  size_t frame_bytes = encode_raw_frame(frame, 5, 100, 1);
  /* Inside the payload, and inside the header. */
  const size_t split_at[] = {ZD_FRAME_HEADER_BYTES + 50, 10};
  for (size_t i = 0; i < 2; i++) {
    int memfd = make_memfd("inside");
    int sock[2];
    make_pair(sock, true);
    zd_frame_reader reader;
    zd_frame_reader_init(&reader);
    send_raw(sock[0], frame, split_at[i], NULL, 0);
    assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
    send_raw(sock[0], frame + split_at[i], frame_bytes - split_at[i], &memfd, 1);
    close(memfd);
    const char *why = NULL;
    assert_int_equal(zd_frame_read(&reader, sock[1], &why), -EPROTO);
    expect_why(why, "without the first byte of a frame");
    assert_int_equal(reader.nfds, 0);
    assert_int_equal(reader.chunk_nfds, 0);
    assert_null(reader.payload);
    zd_frame_reader_reset(&reader);
    close_pair(sock);
    assert_int_equal(count_open_fds(), open_before);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_short_header_then_eof_is_connection_reset),
      cmocka_unit_test(test_eof_between_frames_is_connection_reset),
      cmocka_unit_test(test_eof_inside_payload_frees_it_and_closes_fds),
      cmocka_unit_test(test_bad_magic_is_a_protocol_error),
      cmocka_unit_test(test_bad_version_is_a_protocol_error),
      cmocka_unit_test(test_oversize_payload_is_refused_before_allocating),
      cmocka_unit_test(test_unknown_flag_bits_are_a_protocol_error),
      cmocka_unit_test(test_nonzero_reserved_is_a_protocol_error),
      cmocka_unit_test(test_fd_count_over_the_cap_is_a_protocol_error),
      cmocka_unit_test(test_more_fds_sent_than_the_cap_are_all_closed),
      cmocka_unit_test(test_fd_count_differing_from_fds_sent_is_a_protocol_error),
      cmocka_unit_test(test_fds_sent_inside_a_frame_are_a_protocol_error),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
