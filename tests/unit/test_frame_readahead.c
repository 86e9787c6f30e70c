/* The IPC frame reader's reading ahead (proto/frame.c): a burst of frames
 * is taken off the socket with one recvmsg and handed out one by one, each
 * with exactly its own descriptors; a large frame between small ones is
 * read whole; descriptors read ahead are closed by a reset; and a broken
 * frame behind good ones fails in its turn. Over a real socketpair. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "frame.h"
#include "frame_fixtures.h"

/* ------------------------------------------------------------------------
 * Reading ahead
 * ------------------------------------------------------------------------ */

/* Reads one frame, expecting it at once (rc 1), with this request id and
 * exactly these descriptors, in order. names[i] is sent_fds[i]'s content. */
static void expect_frame(zd_frame_reader *reader, int sock, uint64_t request_id,
                         const int *sent_fds, const char *const *names, unsigned nfds) {
  const char *why = NULL;
  int rc = zd_frame_read(reader, sock, &why);
  if (rc != 1)
    fail_msg("frame %llu: read returned %d (%s), expected a frame", (unsigned long long)request_id,
             rc, why ? why : "no reason");
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned got_nfds;
  zd_frame_reader_take(reader, &header, &payload, fds, &got_nfds);
  if (header.request_id != request_id)
    fail_msg("expected frame %llu, got frame %llu", (unsigned long long)request_id,
             (unsigned long long)header.request_id);
  if (got_nfds != nfds)
    fail_msg("frame %llu: %u descriptors, expected %u", (unsigned long long)request_id, got_nfds,
             nfds);
  for (unsigned i = 0; i < nfds; i++) {
    expect_same_memfd(fds[i], sent_fds[i], names[i]);
    close(fds[i]);
  }
  free(payload);
}

static void test_burst_of_frames_is_read_with_one_recvmsg(void **state) {
  enum { FRAMES = 8, PAYLOAD = 16 };
  uint8_t burst[FRAMES * (ZD_FRAME_HEADER_BYTES + PAYLOAD)];
  size_t burst_bytes = 0;
  for (unsigned i = 0; i < FRAMES; i++)
    burst_bytes += encode_raw_frame(burst + burst_bytes, i + 1, PAYLOAD, 0);
  int sock[2];
  make_pair(sock, true);
  assert_int_equal(write(sock[0], burst, burst_bytes), (ssize_t)burst_bytes);

  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  assert_false(zd_frame_reader_pending(&reader));
  expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
  /* That one call took the whole burst off the socket. */
  int queued_bytes = -1;
  assert_int_equal(ioctl(sock[1], FIONREAD, &queued_bytes), 0);
  assert_int_equal(queued_bytes, 0);
  /* The other frames come from the buffer: with no socket at all (-1) any
   * recvmsg would fail with EBADF. */
  for (unsigned i = 1; i < FRAMES; i++) {
    assert_true(zd_frame_reader_pending(&reader));
    const char *why = NULL;
    assert_int_equal(zd_frame_read(&reader, -1, &why), 1);
    zd_frame_header header;
    uint8_t *payload;
    int fds[ZD_FRAME_MAX_FDS];
    unsigned nfds;
    zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
    assert_int_equal(header.request_id, i + 1);
    assert_int_equal(nfds, 0);
    assert_int_equal(header.payload_bytes, PAYLOAD);
    assert_memory_equal(
        payload, burst + i * (ZD_FRAME_HEADER_BYTES + PAYLOAD) + ZD_FRAME_HEADER_BYTES, PAYLOAD);
    free(payload);
  }
  assert_false(zd_frame_reader_pending(&reader));
  /* Only now does the reader go back to the socket, and find it closed. */
  shutdown(sock[0], SHUT_WR);
  const char *why = NULL;
  assert_int_equal(zd_frame_read(&reader, sock[1], &why), -ECONNRESET);
  expect_why(why, "connection closed");
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

static void test_fds_stay_with_their_frames_in_a_burst(void **state) {
  samples s;
  init_samples(&s);
  int open_before = count_open_fds();
  const char *second_names[1] = {"second"};
  const char *fifth_names[2] = {"fifth a", "fifth b"};
  const char *sixth_names[1] = {"sixth"};
  int second[1] = {make_memfd(second_names[0])};
  int fifth[2] = {make_memfd(fifth_names[0]), make_memfd(fifth_names[1])};
  int sixth[1] = {make_memfd(sixth_names[0])};
  int sock[2];
  make_pair(sock, true);
  /* Seven frames queued before the reader looks: descriptors on the second
   * frame, on the third after that one (behind two frames without), and
   * on two frames back to back. */
  const struct {
    uint16_t type;
    const ProtobufCMessage *msg;
    const int *fds;
    unsigned nfds;
  } frames[] = {
      {ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, &s.step_reply.base, NULL, 0},
      {ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, &s.gather_reply.base, second, 1},
      {ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, &s.step_reply.base, NULL, 0},
      {ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY, &s.release_reply.base, NULL, 0},
      {ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY, &s.grad_buffer_reply.base, fifth, 2},
      {ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, &s.gather_reply.base, sixth, 1},
      {ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, &s.step_reply.base, NULL, 0},
  };
  for (unsigned i = 0; i < 7; i++)
    assert_int_equal(zd_frame_send(sock[0], frames[i].type, i + 1, 0, frames[i].msg, frames[i].fds,
                                   frames[i].nfds, -1),
                     0);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
  expect_frame(&reader, sock[1], 2, second, second_names, 1);
  expect_frame(&reader, sock[1], 3, NULL, NULL, 0);
  expect_frame(&reader, sock[1], 4, NULL, NULL, 0);
  expect_frame(&reader, sock[1], 5, fifth, fifth_names, 2);
  expect_frame(&reader, sock[1], 6, sixth, sixth_names, 1);
  expect_frame(&reader, sock[1], 7, NULL, NULL, 0);
  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
  zd_frame_reader_reset(&reader);
  close(second[0]);
  close(fifth[0]);
  close(fifth[1]);
  close(sixth[0]);
  close_pair(sock);
  assert_int_equal(count_open_fds(), open_before);
}

/* Frames a writer thread sends on a blocking socket, in order. */
typedef struct frame_writer {
  int sock;
  samples *s;
  const int *fds; /* 4: one for the first frame, two for the large one, one for the fourth */
  int rc;
} frame_writer;

static void *write_small_large_small(void *arg) {
  frame_writer *w = arg;
  w->rc = zd_frame_send(w->sock, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 1, 0,
                        &w->s->gather_reply.base, &w->fds[0], 1, 10000);
  if (w->rc == 0)
    w->rc = zd_frame_send(w->sock, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, 2, 0,
                          &w->s->step_reply.base, NULL, 0, 10000);
  if (w->rc == 0)
    w->rc = zd_frame_send(w->sock, ZEROD__V1__MSG_TYPE__MSG_ERROR, 3, 0, &w->s->error.base,
                          &w->fds[1], 2, 10000);
  if (w->rc == 0)
    w->rc = zd_frame_send(w->sock, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 4, 0,
                          &w->s->gather_reply.base, &w->fds[3], 1, 10000);
  if (w->rc == 0)
    w->rc = zd_frame_send(w->sock, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, 5, 0,
                          &w->s->step_reply.base, NULL, 0, 10000);
  return NULL;
}

/* A 3 MiB frame between small ones: its payload is larger than the read
 * buffer and the socket buffer, so it is completed by reads straight into
 * its allocation, and the frames around it keep their descriptors. */
static void test_large_frame_between_small_ones_is_read_whole(void **state) {
  samples s;
  init_samples(&s);
  size_t text_bytes = 3u << 20;
  char *text = malloc(text_bytes + 1);
  for (size_t i = 0; i < text_bytes; i++)
    text[i] = (char)('a' + i % 26);
  text[text_bytes] = '\0';
  s.error.message = text;
  size_t expected_bytes;
  uint8_t *expected = pack(&s.error.base, &expected_bytes);
  const char *names[4] = {"first", "large 0", "large 1", "fourth"};
  int sent_fds[4];
  for (int i = 0; i < 4; i++)
    sent_fds[i] = make_memfd(names[i]);
  int sock[2];
  make_pair(sock, false);
  frame_writer w = {.sock = sock[0], .s = &s, .fds = sent_fds};
  pthread_t thread;
  assert_int_equal(pthread_create(&thread, NULL, write_small_large_small, &w), 0);

  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  const uint64_t small_ids[] = {1, 2};
  for (int f = 0; f < 2; f++) {
    assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
    zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
    assert_int_equal(header.request_id, small_ids[f]);
    assert_int_equal(nfds, f == 0 ? 1 : 0);
    if (f == 0) {
      expect_same_memfd(fds[0], sent_fds[0], names[0]);
      close(fds[0]);
    }
    free(payload);
  }
  assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 3);
  assert_int_equal(header.payload_bytes, expected_bytes);
  assert_memory_equal(payload, expected, expected_bytes);
  assert_int_equal(nfds, 2);
  expect_same_memfd(fds[0], sent_fds[1], names[1]);
  expect_same_memfd(fds[1], sent_fds[2], names[2]);
  close(fds[0]);
  close(fds[1]);
  free(payload);
  assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 4);
  assert_int_equal(nfds, 1);
  expect_same_memfd(fds[0], sent_fds[3], names[3]);
  close(fds[0]);
  free(payload);
  assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 5);
  assert_int_equal(nfds, 0);
  free(payload);

  assert_int_equal(pthread_join(thread, NULL), 0);
  assert_int_equal(w.rc, 0);
  zd_frame_reader_reset(&reader);
  for (int i = 0; i < 4; i++)
    close(sent_fds[i]);
  free(expected);
  free(text);
  close_pair(sock);
}

/* A sender may write a frame in several sendmsg calls, the descriptors
 * with the first: they stay with the frame whether the reader sees the two
 * parts of its header in one recvmsg or two, and whether a frame without
 * descriptors comes before it in the same recvmsg. */
static void test_fds_on_a_header_split_across_two_writes_stay_with_it(void **state) {
  int open_before = count_open_fds();
  const char *names[1] = {"split"};
  int sent_fds[1] = {make_memfd(names[0])};
  uint8_t first[ZD_FRAME_HEADER_BYTES + 8], split[ZD_FRAME_HEADER_BYTES + 40];
  size_t first_bytes = encode_raw_frame(first, 1, 8, 0);
  size_t split_bytes = encode_raw_frame(split, 2, 40, 1);
  for (int read_between = 0; read_between < 2; read_between++) {
    int sock[2];
    make_pair(sock, true);
    zd_frame_reader reader;
    zd_frame_reader_init(&reader);
    send_raw(sock[0], first, first_bytes, NULL, 0);
    send_raw(sock[0], split, 10, sent_fds, 1);
    if (read_between) {
      expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
      assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
      assert_int_equal(reader.have, 10);
    }
    send_raw(sock[0], split + 10, split_bytes - 10, NULL, 0);
    if (!read_between)
      expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
    expect_frame(&reader, sock[1], 2, sent_fds, names, 1);
    assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
    zd_frame_reader_reset(&reader);
    close_pair(sock);
  }
  close(sent_fds[0]);
  assert_int_equal(count_open_fds(), open_before);
}

/* Descriptors read ahead with a frame not yet handed out belong to the
 * reader until then: a reset closes them. */
static void test_reset_closes_descriptors_read_ahead(void **state) {
  int open_before = count_open_fds();
  int memfd = make_memfd("ahead");
  uint8_t frame[ZD_FRAME_HEADER_BYTES + 4];
  int sock[2];
  make_pair(sock, true);
  send_raw(sock[0], frame, encode_raw_frame(frame, 1, 4, 0), NULL, 0);
  send_raw(sock[0], frame, encode_raw_frame(frame, 2, 4, 1), &memfd, 1);
  close(memfd);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
  assert_true(zd_frame_reader_pending(&reader));
  zd_frame_reader_reset(&reader);
  close_pair(sock);
  assert_int_equal(count_open_fds(), open_before);
}

/* Frames before a broken one in the same recvmsg are still handed out; the
 * broken one fails when its turn comes, without reading the socket. */
static void test_bad_header_behind_good_frames_fails_in_its_turn(void **state) {
  uint8_t burst[3 * (ZD_FRAME_HEADER_BYTES + 4)];
  size_t burst_bytes = encode_raw_frame(burst, 1, 4, 0);
  burst_bytes += encode_raw_frame(burst + burst_bytes, 2, 4, 0);
  size_t bad_at = burst_bytes;
  burst_bytes += encode_raw_frame(burst + burst_bytes, 3, 4, 0);
  burst[bad_at] ^= 0xff; /* magic */
  int sock[2];
  make_pair(sock, true);
  assert_int_equal(write(sock[0], burst, burst_bytes), (ssize_t)burst_bytes);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
  expect_frame(&reader, -1, 2, NULL, NULL, 0);
  assert_true(zd_frame_reader_pending(&reader));
  const char *why = NULL;
  assert_int_equal(zd_frame_read(&reader, -1, &why), -EPROTO);
  expect_why(why, "magic");
  assert_null(reader.buffer);
  close_pair(sock);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_burst_of_frames_is_read_with_one_recvmsg),
      cmocka_unit_test(test_fds_stay_with_their_frames_in_a_burst),
      cmocka_unit_test(test_large_frame_between_small_ones_is_read_whole),
      cmocka_unit_test(test_fds_on_a_header_split_across_two_writes_stay_with_it),
      cmocka_unit_test(test_reset_closes_descriptors_read_ahead),
      cmocka_unit_test(test_bad_header_behind_good_frames_fails_in_its_turn),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
