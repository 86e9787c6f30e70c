/* The rpc layer (daemon/rpc/) under load, against a real gRPC server on a
 * loop thread (rpc_fixtures.c): shutdown with unary calls and streams in
 * flight on client threads, and many concurrent clients.
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
 * Shutdown and load
 * ------------------------------------------------------------------------ */

typedef struct hang_client {
  rpc_channel *channel;
  int status;
  long long elapsed_ms;
} hang_client;

static void *hang_client_main(void *arg) {
  hang_client *c = arg;
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;
  long long start = now_ms();
  c->status =
      rpc_unary(c->channel, "/test.Echo/Hang", "x", 1, 60000, &reply, &reply_bytes, &result);
  c->elapsed_ms = now_ms() - start;
  free(reply);
  return NULL;
}

typedef struct stream_client {
  rpc_channel *channel;
  atomic_int received;
  int status;
} stream_client;

static void *stream_client_main(void *arg) {
  stream_client *c = arg;
  rpc_stream *st = NULL;
  rpc_result result;
  uint8_t *message = NULL;
  size_t message_bytes = 0;
  c->status = -1;
  if (rpc_stream_open(c->channel, "/test.Echo/Ticker", NULL, 0, 60000, &st) != 0)
    return NULL;
  while (rpc_stream_read(st, &message, &message_bytes, &result) == 1) {
    free(message);
    atomic_fetch_add(&c->received, 1);
  }
  c->status = result.status;
  rpc_stream_close(st);
  return NULL;
}

static void test_shutdown_with_calls_in_flight(void **state) {
  fixture *fx = *state;
  hang_client hanging = {.channel = fx->channel, .status = -1};
  stream_client streaming = {.channel = fx->channel, .status = -1};
  pthread_t hang_thread, stream_thread;

  atomic_init(&streaming.received, 0);
  assert_int_equal(pthread_create(&hang_thread, NULL, hang_client_main, &hanging), 0);
  assert_int_equal(pthread_create(&stream_thread, NULL, stream_client_main, &streaming), 0);
  if (!wait_for(&fx->hang_started, 1, WAIT_MS) || !wait_for(&streaming.received, 1, WAIT_MS))
    fail_msg("the calls did not start");

  long long start = now_ms();
  if (!shutdown_server(fx))
    fail_msg("shutdown with calls in flight did not call done within %d ms", WAIT_MS);
  pthread_join(hang_thread, NULL);
  pthread_join(stream_thread, NULL);
  long long elapsed = now_ms() - start;

  /* Both calls were cancelled by the shutdown (not by their deadlines),
   * and both clients saw an error. */
  assert_int_equal(atomic_load(&fx->hang_cancelled), 1);
  assert_int_equal(atomic_load(&fx->ticker_cancelled), 1);
  assert_int_equal(atomic_load(&fx->ticker_finished), 1);
  assert_int_not_equal(hanging.status, RPC_OK);
  assert_int_not_equal(hanging.status, -1);
  assert_int_not_equal(streaming.status, RPC_OK);
  assert_int_not_equal(streaming.status, -1);
  if (hanging.elapsed_ms >= 60000 || elapsed >= 60000)
    fail_msg("clients waited for their deadlines (%lld ms)", hanging.elapsed_ms);
  print_message("at shutdown the unary client saw %s, the stream client %s\n",
                rpc_status_name(hanging.status), rpc_status_name(streaming.status));

  /* A call after the shutdown fails at once rather than hanging. */
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;
  int status =
      rpc_unary(fx->channel, "/test.Echo/Echo", "x", 1, 10000, &reply, &reply_bytes, &result);
  assert_int_equal(status, RPC_UNAVAILABLE);
}

#define CLIENT_THREADS   8
#define CALLS_PER_THREAD 200

typedef struct load_client {
  rpc_channel *channel;
  int index;
  int failures;
  int first_status;
} load_client;

static void *load_client_main(void *arg) {
  load_client *c = arg;
  for (int i = 0; i < CALLS_PER_THREAD; i++) {
    char request[64];
    int n = snprintf(request, sizeof request, "client %d call %d", c->index, i);
    uint8_t *reply = NULL;
    size_t reply_bytes = 0;
    rpc_result result;
    int status = rpc_unary(c->channel, "/test.Echo/Echo", request, (size_t)n, 20000, &reply,
                           &reply_bytes, &result);
    if (status != RPC_OK || reply_bytes != (size_t)n || memcmp(reply, request, (size_t)n) != 0) {
      if (c->failures == 0)
        c->first_status = status;
      c->failures++;
    }
    free(reply);
  }
  return NULL;
}

static void test_many_concurrent_clients(void **state) {
  fixture *fx = *state;
  load_client clients[CLIENT_THREADS];
  pthread_t threads[CLIENT_THREADS];
  char err[256];

  /* Half share the fixture's channel, half have their own. */
  for (int i = 0; i < CLIENT_THREADS; i++) {
    clients[i] = (load_client){.channel = fx->channel, .index = i};
    if (i % 2 == 1)
      assert_int_equal(rpc_channel_create(fx->target, &clients[i].channel, err, sizeof err), 0);
    assert_int_equal(pthread_create(&threads[i], NULL, load_client_main, &clients[i]), 0);
  }
  for (int i = 0; i < CLIENT_THREADS; i++)
    pthread_join(threads[i], NULL);
  for (int i = 0; i < CLIENT_THREADS; i++) {
    if (clients[i].failures != 0)
      fail_msg("client %d: %d of %d calls failed (first status %s)", i, clients[i].failures,
               CALLS_PER_THREAD, rpc_status_name(clients[i].first_status));
    if (i % 2 == 1)
      rpc_channel_destroy(clients[i].channel);
  }
  assert_int_equal(atomic_load(&fx->echo_calls), CLIENT_THREADS * CALLS_PER_THREAD);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_shutdown_with_calls_in_flight, setup_server,
                                      teardown_server),
      cmocka_unit_test_setup_teardown(test_many_concurrent_clients, setup_server, teardown_server),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
