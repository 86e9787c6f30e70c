/* Server streams of the rpc layer (daemon/rpc/) against a real gRPC
 * server on a loop thread (rpc_fixtures.c): a stream ending OK after its
 * messages, the bounded send queue, rpc_follow handing every message and
 * the end to a loop (and stopping without callbacks, and an unknown
 * method), a client cancelling a stream, and closing before or without
 * reading.
 *
 * cmocka is not thread-safe, so handlers (on the loop thread) and helper
 * client threads never assert: they record what they saw in atomics and
 * structs, and the test thread checks afterwards. Waits on the server's
 * side are polls with generous bounds: the machines are shared and noisy.
 *
 * Every test tears down completely (server shut down, loop closed with no
 * handle left, channel destroyed), so the ASan build's leak check covers
 * gRPC's objects too. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <uv.h>

#include "rpc.h"
#include "rpc_fixtures.h"

/* ------------------------------------------------------------------------
 * Streams
 * ------------------------------------------------------------------------ */

static void test_stream_sends_n_messages_then_ok(void **state) {
  fixture *fx = *state;
  rpc_stream *st = NULL;
  rpc_result result;
  uint8_t *message = NULL;
  size_t message_bytes = 0;
  uint32_t expected = 0;

  assert_int_equal(rpc_stream_open(fx->channel, "/test.Echo/Count", NULL, 0, 10000, &st), 0);
  while (rpc_stream_read(st, &message, &message_bytes, &result) == 1) {
    uint32_t index;
    assert_int_equal(message_bytes, sizeof index);
    memcpy(&index, message, sizeof index);
    free(message);
    assert_int_equal(index, expected);
    expected++;
  }
  assert_int_equal(expected, STREAM_COUNT);
  assert_int_equal(result.status, RPC_OK);
  /* Reading past the end keeps returning the end. */
  assert_int_equal(rpc_stream_read(st, &message, &message_bytes, &result), 0);
  assert_int_equal(result.status, RPC_OK);
  rpc_stream_close(st);
  assert_int_equal(atomic_load(&fx->count_send_errors), 0);
  assert_int_equal(atomic_load(&fx->oversize_send_rc), -EMSGSIZE);
}

/* rpc_follow: a stream read by a thread of its own, handed to a loop. */
typedef struct follow_state {
  rpc_follower *follower;
  uint32_t messages;
  int out_of_order;
  int ends;
  int end_status;
  uint32_t stop_after; /* 0: never */
} follow_state;

static void follow_message(void *ctx, const uint8_t *bytes, size_t len) {
  follow_state *fs = ctx;
  uint32_t index = UINT32_MAX;
  if (len == sizeof index)
    memcpy(&index, bytes, sizeof index);
  if (index != fs->messages && fs->stop_after == 0)
    fs->out_of_order = 1;
  fs->messages++;
  if (fs->stop_after != 0 && fs->messages == fs->stop_after)
    rpc_follow_stop(fs->follower);
}

static void follow_end(void *ctx, const rpc_result *result) {
  follow_state *fs = ctx;
  fs->ends++;
  fs->end_status = result->status;
}

static void test_follow_hands_every_message_then_the_end_to_the_loop(void **state) {
  fixture *fx = *state;
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  follow_state fs = {0};
  assert_int_equal(rpc_follow(&loop, fx->channel, "/test.Echo/Count", NULL, 0, "zd-test-follow",
                              follow_message, follow_end, &fs, &fs.follower),
                   0);
  /* The follower's handle is the loop's only one: the loop ends once the
   * stream has ended and the follower has freed itself. */
  assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
  assert_int_equal(fs.messages, STREAM_COUNT);
  assert_false(fs.out_of_order);
  assert_int_equal(fs.ends, 1);
  assert_int_equal(fs.end_status, RPC_OK);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_follow_stop_ends_the_stream_without_callbacks(void **state) {
  fixture *fx = *state;
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  /* The ticker sends until cancelled: stopping the follower is what ends it. */
  follow_state fs = {.stop_after = 3};
  assert_int_equal(rpc_follow(&loop, fx->channel, "/test.Echo/Ticker", NULL, 0, "zd-test-follow",
                              follow_message, follow_end, &fs, &fs.follower),
                   0);
  assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
  assert_int_equal(fs.messages, 3); /* none after the stop, though more were queued */
  assert_int_equal(fs.ends, 0);     /* and no end */
  assert_int_equal(uv_loop_close(&loop), 0);
  if (!wait_for(&fx->ticker_cancelled, 1, WAIT_MS))
    fail_msg("the server did not see the stream cancelled");
}

static void test_follow_of_an_unknown_method_ends_unimplemented(void **state) {
  fixture *fx = *state;
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  follow_state fs = {0};
  assert_int_equal(rpc_follow(&loop, fx->channel, "/test.Echo/Nope", NULL, 0, "zd-test-follow",
                              follow_message, follow_end, &fs, &fs.follower),
                   0);
  assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
  assert_int_equal(fs.messages, 0);
  assert_int_equal(fs.ends, 1);
  assert_int_equal(fs.end_status, RPC_UNIMPLEMENTED);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_stream_queue_is_bounded(void **state) {
  fixture *fx = *state;
  rpc_stream *st = NULL;
  rpc_result result;
  uint8_t *message = NULL;
  size_t message_bytes = 0;
  int received = 0;

  assert_int_equal(rpc_stream_open(fx->channel, "/test.Echo/Burst", NULL, 0, 10000, &st), 0);
  while (rpc_stream_read(st, &message, &message_bytes, &result) == 1) {
    assert_int_equal(message_bytes, 1024);
    free(message);
    received++;
  }
  assert_int_equal(result.status, RPC_OK);
  rpc_stream_close(st);

  /* 64 wait behind the one in flight; the rest are refused, and every
   * accepted message arrives. */
  int ok = atomic_load(&fx->burst_ok);
  if (ok < 64 || ok > 65)
    fail_msg("expected 64 or 65 sends accepted, got %d", ok);
  assert_int_equal(atomic_load(&fx->burst_nobufs), BURST_MESSAGES - ok);
  assert_int_equal(received, ok);
}

typedef struct cancel_args {
  rpc_stream *st;
  fixture *fx;
} cancel_args;

static void *cancel_later(void *arg) {
  cancel_args *args = arg;
  usleep(100 * 1000);
  rpc_stream_cancel(args->st);
  return NULL;
}

static void test_client_cancels_a_stream(void **state) {
  fixture *fx = *state;
  rpc_stream *st = NULL;
  rpc_result result;
  uint8_t *message = NULL;
  size_t message_bytes = 0;
  int received = 0;

  /* No deadline: only the cancel from the other thread ends the read. */
  assert_int_equal(rpc_stream_open(fx->channel, "/test.Echo/Ticker", NULL, 0, 0, &st), 0);
  assert_int_equal(rpc_stream_read(st, &message, &message_bytes, &result), 1);
  free(message);
  received++;

  cancel_args args = {st, fx};
  pthread_t canceller;
  assert_int_equal(pthread_create(&canceller, NULL, cancel_later, &args), 0);
  while (rpc_stream_read(st, &message, &message_bytes, &result) == 1) {
    free(message);
    received++;
    if (received > 100000)
      break;
  }
  pthread_join(canceller, NULL);
  assert_int_equal(result.status, RPC_CANCELLED);
  assert_true(received >= 1);
  /* A later read still says cancelled. */
  assert_int_equal(rpc_stream_read(st, &message, &message_bytes, &result), 0);
  assert_int_equal(result.status, RPC_CANCELLED);
  rpc_stream_close(st);

  if (!wait_for(&fx->ticker_cancelled, 1, WAIT_MS))
    fail_msg("the server did not see the stream's cancellation");
  if (!wait_for(&fx->ticker_finished, 1, WAIT_MS))
    fail_msg("the ticker did not finish after its cancellation");
  assert_int_equal(atomic_load(&fx->ticker_send_after_cancel), -EPIPE);
}

static void test_cancel_before_read_and_close_without_reading(void **state) {
  fixture *fx = *state;
  rpc_stream *st = NULL;
  rpc_result result;
  uint8_t *message = NULL;
  size_t message_bytes = 0;

  assert_int_equal(rpc_stream_open(fx->channel, "/test.Echo/Ticker", NULL, 0, 0, &st), 0);
  rpc_stream_cancel(st);
  assert_int_equal(rpc_stream_read(st, &message, &message_bytes, &result), 0);
  assert_null(message);
  assert_int_equal(result.status, RPC_CANCELLED);
  rpc_stream_close(st);

  /* The cancelled call may or may not have reached the server; if it did,
   * its ticker ends. Let it settle before counting. */
  usleep(200 * 1000);
  int started = atomic_load(&fx->ticker_started);
  if (!wait_for(&fx->ticker_finished, started, WAIT_MS))
    fail_msg("the server did not end the cancelled ticker");

  /* Closing a live stream unread cancels it; the server's call ends. */
  assert_int_equal(rpc_stream_open(fx->channel, "/test.Echo/Ticker", NULL, 0, 0, &st), 0);
  if (!wait_for(&fx->ticker_started, started + 1, WAIT_MS))
    fail_msg("the ticker never started");
  rpc_stream_close(st);
  if (!wait_for(&fx->ticker_finished, started + 1, WAIT_MS))
    fail_msg("the server did not end the ticker after close");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_stream_sends_n_messages_then_ok, setup_server,
                                      teardown_server),
      cmocka_unit_test_setup_teardown(test_stream_queue_is_bounded, setup_server, teardown_server),
      cmocka_unit_test_setup_teardown(test_follow_hands_every_message_then_the_end_to_the_loop,
                                      setup_server, teardown_server),
      cmocka_unit_test_setup_teardown(test_follow_stop_ends_the_stream_without_callbacks,
                                      setup_server, teardown_server),
      cmocka_unit_test_setup_teardown(test_follow_of_an_unknown_method_ends_unimplemented,
                                      setup_server, teardown_server),
      cmocka_unit_test_setup_teardown(test_client_cancels_a_stream, setup_server, teardown_server),
      cmocka_unit_test_setup_teardown(test_cancel_before_read_and_close_without_reading,
                                      setup_server, teardown_server),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
