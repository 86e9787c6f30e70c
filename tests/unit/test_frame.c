/* The IPC framing (proto/frame.c) end to end: every message type survives
 * encode, send, read and unpack with 0, 1 and 4 memfds; frames arrive whole
 * however the bytes are split, with their own descriptors; and the sender
 * refuses bad arguments, fails with EPIPE (never SIGPIPE) on a closed peer
 * and times out on a full socket. Everything runs over a real
 * socketpair(AF_UNIX, SOCK_STREAM). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "frame.h"
#include "frame_fixtures.h"

/* ------------------------------------------------------------------------
 * Round trips
 * ------------------------------------------------------------------------ */

/* Sends msg with nfds fresh memfds, reads it back and checks header,
 * payload, message and descriptors. */
static void round_trip(int sock[2], uint16_t type, const ProtobufCMessage *msg, unsigned nfds) {
  int sent_fds[ZD_FRAME_MAX_FDS];
  char contents[ZD_FRAME_MAX_FDS][32];
  for (unsigned i = 0; i < nfds; i++) {
    snprintf(contents[i], sizeof contents[i], "type %u fd %u", type, i);
    sent_fds[i] = make_memfd(contents[i]);
  }
  uint64_t request_id = 1000 + type * 10 + nfds;
  assert_int_equal(
      zd_frame_send(sock[0], type, request_id, ZD_FRAME_F_NO_REPLY, msg, sent_fds, nfds, 1000), 0);

  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  const char *why = NULL;
  int rc = read_frame(&reader, sock[1], &why);
  if (rc != 1)
    fail_msg("type %u with %u fds: read returned %d (%s)", type, nfds, rc, why ? why : "");
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned got_nfds;
  zd_frame_reader_take(&reader, &header, &payload, fds, &got_nfds);
  assert_int_equal(header.type, type);
  assert_int_equal(header.request_id, request_id);
  assert_int_equal(header.flags, ZD_FRAME_F_NO_REPLY);
  assert_int_equal(header.fd_count, nfds);
  assert_int_equal(got_nfds, nfds);

  size_t expected_bytes;
  uint8_t *expected = pack(msg, &expected_bytes);
  assert_int_equal(header.payload_bytes, expected_bytes);
  if (expected_bytes > 0)
    assert_memory_equal(payload, expected, expected_bytes);

  ProtobufCMessage *out;
  rc = zd_msg_unpack(type, payload, header.payload_bytes, &out, &why);
  if (rc != 0)
    fail_msg("type %u: unpack returned %d (%s)", type, rc, why);
  assert_ptr_equal(out->descriptor, msg->descriptor);
  size_t repacked_bytes;
  uint8_t *repacked = pack(out, &repacked_bytes);
  assert_int_equal(repacked_bytes, expected_bytes);
  if (expected_bytes > 0)
    assert_memory_equal(repacked, expected, expected_bytes);

  for (unsigned i = 0; i < nfds; i++) {
    expect_same_memfd(fds[i], sent_fds[i], contents[i]);
    close(fds[i]);
    close(sent_fds[i]);
  }
  protobuf_c_message_free_unpacked(out, NULL);
  free(repacked);
  free(expected);
  free(payload);
  zd_frame_reader_reset(&reader);
}

static void test_every_message_type_round_trips_with_0_1_and_4_fds(void **state) {
  samples s;
  typed_sample table[SAMPLE_TYPES];
  init_samples(&s);
  size_t n = all_samples(&s, table);
  int open_before = count_open_fds();
  int sock[2];
  make_pair(sock, false);
  const unsigned fd_counts[] = {0, 1, 4};
  for (size_t i = 0; i < n; i++)
    for (size_t f = 0; f < 3; f++)
      round_trip(sock, table[i].type, table[i].msg, fd_counts[f]);
  close_pair(sock);
  assert_int_equal(count_open_fds(), open_before);
}

static void test_encoded_frame_equals_what_send_puts_on_the_wire(void **state) {
  samples s;
  typed_sample table[SAMPLE_TYPES];
  init_samples(&s);
  size_t n = all_samples(&s, table);
  int sock[2];
  make_pair(sock, false);
  for (size_t i = 0; i < n; i++) {
    uint8_t *frame;
    size_t frame_bytes;
    assert_int_equal(zd_frame_encode(table[i].type, 5, 0, 0, table[i].msg, &frame, &frame_bytes),
                     0);
    assert_int_equal(zd_frame_send(sock[0], table[i].type, 5, 0, table[i].msg, NULL, 0, -1), 0);
    uint8_t *wire = malloc(frame_bytes);
    assert_int_equal(recv(sock[1], wire, frame_bytes, MSG_WAITALL), (ssize_t)frame_bytes);
    assert_memory_equal(wire, frame, frame_bytes);
    zd_frame_header header;
    assert_int_equal(zd_frame_header_decode(frame, frame_bytes, &header, NULL), 0);
    assert_int_equal(header.payload_bytes, frame_bytes - ZD_FRAME_HEADER_BYTES);
    free(wire);
    free(frame);
  }
  close_pair(sock);
}

static void test_empty_message_sends_an_empty_payload(void **state) {
  int sock[2];
  make_pair(sock, false);
  assert_int_equal(zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_DETACH, 8, 0, NULL, NULL, 0, -1),
                   0);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.payload_bytes, 0);
  assert_null(payload);
  ProtobufCMessage *out;
  assert_int_equal(zd_msg_unpack(header.type, payload, 0, &out, NULL), 0);
  protobuf_c_message_free_unpacked(out, NULL);
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

/* Writes what it can of data, then lets the reader read, until all is
 * written; returns the reader's last answer. */
static int pump(int writer, const uint8_t *data, size_t len, zd_frame_reader *reader, int sock) {
  size_t written = 0;
  int rc = 0;
  while (written < len) {
    ssize_t n = send(writer, data + written, len - written, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0)
      written += (size_t)n;
    else
      assert_true(errno == EAGAIN);
    rc = zd_frame_read(reader, sock, NULL);
    if (rc != 0)
      return rc;
  }
  /* Everything is in the socket now; the reader may still be behind. */
  while (rc == 0)
    rc = zd_frame_read(reader, sock, NULL);
  return rc;
}

static void test_payload_at_the_cap_is_read_whole(void **state) {
  size_t frame_bytes = ZD_FRAME_HEADER_BYTES + ZD_FRAME_MAX_PAYLOAD;
  uint8_t *frame = malloc(frame_bytes);
  for (size_t i = 0; i < frame_bytes; i++)
    frame[i] = (uint8_t)(i * 31);
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_ERROR, ZD_FRAME_MAX_PAYLOAD, 0);
  zd_frame_header_encode(&header, frame);
  int sock[2];
  make_pair(sock, true);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  assert_int_equal(pump(sock[0], frame, frame_bytes, &reader, sock[1]), 1);
  zd_frame_header got;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  zd_frame_reader_take(&reader, &got, &payload, fds, &nfds);
  assert_int_equal(got.payload_bytes, ZD_FRAME_MAX_PAYLOAD);
  assert_memory_equal(payload, frame + ZD_FRAME_HEADER_BYTES, ZD_FRAME_MAX_PAYLOAD);
  free(payload);
  free(frame);
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

static void test_frame_split_into_1_byte_writes_is_ready_only_when_complete(void **state) {
  samples s;
  init_samples(&s);
  uint8_t *frame;
  size_t frame_bytes;
  assert_int_equal(zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, 11, 0, 2,
                                   &s.register_unit.base, &frame, &frame_bytes),
                   0);
  int sent_fds[2] = {make_memfd("first"), make_memfd("second")};
  int sock[2];
  make_pair(sock, true);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
  for (size_t i = 0; i < frame_bytes; i++) {
    /* The descriptors go with the first byte, as zd_frame_send sends them. */
    send_raw(sock[0], frame + i, 1, sent_fds, i == 0 ? 2 : 0);
    int rc = zd_frame_read(&reader, sock[1], NULL);
    if (rc != (i + 1 == frame_bytes ? 1 : 0))
      fail_msg("after byte %zu of %zu: read returned %d", i + 1, frame_bytes, rc);
  }
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(nfds, 2);
  expect_same_memfd(fds[0], sent_fds[0], "first");
  expect_same_memfd(fds[1], sent_fds[1], "second");
  assert_memory_equal(payload, frame + ZD_FRAME_HEADER_BYTES, header.payload_bytes);
  ProtobufCMessage *out;
  assert_int_equal(zd_msg_unpack(header.type, payload, header.payload_bytes, &out, NULL), 0);
  protobuf_c_message_free_unpacked(out, NULL);
  /* Nothing more is there: the next frame is not ready. */
  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
  assert_int_equal(reader.have, 0);
  for (int i = 0; i < 2; i++) {
    close(fds[i]);
    close(sent_fds[i]);
  }
  free(payload);
  free(frame);
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

static void test_back_to_back_frames_keep_their_own_fds(void **state) {
  samples s;
  init_samples(&s);
  int first[1] = {make_memfd("gathered")};
  int second[4] = {make_memfd("g0"), make_memfd("g1"), make_memfd("g2"), make_memfd("g3")};
  int sock[2];
  make_pair(sock, true);
  /* All three frames are queued before the reader looks at any. */
  assert_int_equal(zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 1, 0,
                                 &s.gather_reply.base, first, 1, -1),
                   0);
  assert_int_equal(zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY, 2, 0,
                                 &s.grad_buffer_reply.base, second, 4, -1),
                   0);
  assert_int_equal(zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, 3, 0,
                                 &s.step_reply.base, NULL, 0, -1),
                   0);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;

  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 1);
  assert_int_equal(nfds, 1);
  expect_same_memfd(fds[0], first[0], "gathered");
  close(fds[0]);
  free(payload);

  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 2);
  assert_int_equal(nfds, 4);
  const char *names[4] = {"g0", "g1", "g2", "g3"};
  for (int i = 0; i < 4; i++) {
    expect_same_memfd(fds[i], second[i], names[i]);
    close(fds[i]);
  }
  free(payload);

  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 3);
  assert_int_equal(nfds, 0);
  free(payload);
  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);

  close(first[0]);
  for (int i = 0; i < 4; i++)
    close(second[i]);
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

/* What a reader thread saw of two frames sent while it was reading. */
typedef struct threaded_read {
  int sock;
  int rc[2];
  zd_frame_header header[2];
  uint8_t *payload[2];
  int fds[2][ZD_FRAME_MAX_FDS];
  unsigned nfds[2];
} threaded_read;

static void *read_two_frames(void *arg) {
  threaded_read *r = arg;
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  for (int f = 0; f < 2; f++) {
    r->rc[f] = read_frame(&reader, r->sock, NULL);
    if (r->rc[f] != 1)
      break;
    zd_frame_reader_take(&reader, &r->header[f], &r->payload[f], r->fds[f], &r->nfds[f]);
  }
  zd_frame_reader_reset(&reader);
  return NULL;
}

/* A frame larger than the socket buffer goes out in many sendmsg calls; its
 * descriptors must go with the first only, so that they arrive with this
 * frame and none arrive with the next. */
static void test_frame_sent_in_pieces_carries_its_fds_once(void **state) {
  samples s;
  init_samples(&s);
  size_t text_bytes = 3u << 20;
  char *text = malloc(text_bytes + 1);
  memset(text, 'p', text_bytes);
  text[text_bytes] = '\0';
  s.error.message = text;
  int sent_fds[3] = {make_memfd("big 0"), make_memfd("big 1"), make_memfd("small")};
  int sock[2];
  make_pair(sock, false);
  assert_int_equal(fcntl(sock[0], F_SETFL, fcntl(sock[0], F_GETFL) | O_NONBLOCK), 0);
  threaded_read r = {.sock = sock[1]};
  pthread_t thread;
  assert_int_equal(pthread_create(&thread, NULL, read_two_frames, &r), 0);
  int send_big = zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_ERROR, 1, 0, &s.error.base,
                               sent_fds, 2, 10000);
  int send_small = zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 2, 0,
                                 &s.gather_reply.base, &sent_fds[2], 1, 10000);
  assert_int_equal(pthread_join(thread, NULL), 0);
  assert_int_equal(send_big, 0);
  assert_int_equal(send_small, 0);
  assert_int_equal(r.rc[0], 1);
  assert_int_equal(r.rc[1], 1);
  assert_int_equal(r.header[0].payload_bytes, protobuf_c_message_get_packed_size(&s.error.base));
  assert_int_equal(r.nfds[0], 2);
  assert_int_equal(r.nfds[1], 1);
  expect_same_memfd(r.fds[0][0], sent_fds[0], "big 0");
  expect_same_memfd(r.fds[0][1], sent_fds[1], "big 1");
  expect_same_memfd(r.fds[1][0], sent_fds[2], "small");
  for (int i = 0; i < 3; i++)
    close(sent_fds[i]);
  close(r.fds[0][0]);
  close(r.fds[0][1]);
  close(r.fds[1][0]);
  free(r.payload[0]);
  free(r.payload[1]);
  free(text);
  close_pair(sock);
}

/* ------------------------------------------------------------------------
 * Sending
 * ------------------------------------------------------------------------ */

static void test_encode_refuses_bad_arguments(void **state) {
  samples s;
  init_samples(&s);
  uint8_t *frame = NULL;
  size_t frame_bytes;
  /* The message must be the one the type carries. */
  assert_int_equal(zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_ATTACH, 1, 0, 0, &s.gather.base, &frame,
                                   &frame_bytes),
                   -EINVAL);
  assert_int_equal(zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_GATHER, 1, 0x02, 0, &s.gather.base,
                                   &frame, &frame_bytes),
                   -EINVAL);
  assert_int_equal(zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_GATHER, 1, 0, ZD_FRAME_MAX_FDS + 1,
                                   &s.gather.base, &frame, &frame_bytes),
                   -EINVAL);
  char *huge = malloc(ZD_FRAME_MAX_PAYLOAD + 1);
  memset(huge, 'h', ZD_FRAME_MAX_PAYLOAD);
  huge[ZD_FRAME_MAX_PAYLOAD] = '\0';
  s.error.message = huge;
  assert_int_equal(
      zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_ERROR, 1, 0, 0, &s.error.base, &frame, &frame_bytes),
      -EMSGSIZE);
  assert_int_equal(
      zd_frame_send(-1, ZEROD__V1__MSG_TYPE__MSG_ERROR, 1, 0, &s.error.base, NULL, 0, 0),
      -EMSGSIZE);
  assert_null(frame);
  free(huge);
}

static void test_send_to_a_closed_peer_is_epipe_without_sigpipe(void **state) {
  samples s;
  init_samples(&s);
  int sock[2];
  make_pair(sock, false);
  close(sock[1]);
  /* SIGPIPE would kill this test process. */
  assert_int_equal(
      zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_GATHER, 1, 0, &s.gather.base, NULL, 0, 100),
      -EPIPE);
  close(sock[0]);
}

static void test_send_to_a_full_socket_times_out(void **state) {
  samples s;
  init_samples(&s);
  int sock[2];
  make_pair(sock, false);
  assert_int_equal(fcntl(sock[0], F_SETFL, fcntl(sock[0], F_GETFL) | O_NONBLOCK), 0);
  /* A frame larger than the socket's buffers, and nobody reading. */
  char *text = malloc(ZD_FRAME_MAX_PAYLOAD - 64);
  memset(text, 't', ZD_FRAME_MAX_PAYLOAD - 65);
  text[ZD_FRAME_MAX_PAYLOAD - 65] = '\0';
  s.error.message = text;
  assert_int_equal(
      zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_ERROR, 1, 0, &s.error.base, NULL, 0, 50),
      -ETIMEDOUT);
  free(text);
  close_pair(sock);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_message_type_round_trips_with_0_1_and_4_fds),
      cmocka_unit_test(test_encoded_frame_equals_what_send_puts_on_the_wire),
      cmocka_unit_test(test_empty_message_sends_an_empty_payload),
      cmocka_unit_test(test_payload_at_the_cap_is_read_whole),
      cmocka_unit_test(test_frame_split_into_1_byte_writes_is_ready_only_when_complete),
      cmocka_unit_test(test_back_to_back_frames_keep_their_own_fds),
      cmocka_unit_test(test_frame_sent_in_pieces_carries_its_fds_once),
      cmocka_unit_test(test_encode_refuses_bad_arguments),
      cmocka_unit_test(test_send_to_a_closed_peer_is_epipe_without_sigpipe),
      cmocka_unit_test(test_send_to_a_full_socket_times_out),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
