/* rpc against itself (daemon/rpc/): a real gRPC server on 127.0.0.1:0
 * whose libuv loop runs on its own thread, and blocking clients
 * (rpc_fixtures.c). This file: status names, the server's and the
 * client's argument checks, a port in use, and unary calls: replies now
 * and later, error statuses, unknown methods, the peer's address,
 * deadlines and the server's cancel callback.
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
 * Tests
 * ------------------------------------------------------------------------ */

static void test_status_names(void **state) {
  assert_string_equal(rpc_status_name(RPC_OK), "OK");
  assert_string_equal(rpc_status_name(RPC_NOT_FOUND), "NOT_FOUND");
  assert_string_equal(rpc_status_name(RPC_UNAVAILABLE), "UNAVAILABLE");
  assert_string_equal(rpc_status_name(RPC_UNAUTHENTICATED), "UNAUTHENTICATED");
  assert_string_equal(rpc_status_name(-1), "UNKNOWN");
  assert_string_equal(rpc_status_name(99), "UNKNOWN");
}

static void dummy_handler(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  rpc_call_finish(call, RPC_OK, NULL, NULL, 0);
}

static void test_add_method_rejects_bad_input(void **state) {
  uv_loop_t loop;
  rpc_server *s = NULL;
  char err[256];
  char long_path[400];

  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(rpc_server_create(&loop, "127.0.0.1:0", &s, err, sizeof err), 0);
  assert_int_equal(rpc_server_add_method(s, "no/slash", RPC_UNARY, dummy_handler, NULL), -EINVAL);
  assert_int_equal(rpc_server_add_method(s, "/a/B", RPC_UNARY, NULL, NULL), -EINVAL);
  memset(long_path, 'x', sizeof long_path - 1);
  long_path[0] = '/';
  long_path[sizeof long_path - 1] = '\0';
  assert_int_equal(rpc_server_add_method(s, long_path, RPC_UNARY, dummy_handler, NULL),
                   -ENAMETOOLONG);
  assert_int_equal(rpc_server_add_method(s, "/a/B", RPC_UNARY, dummy_handler, NULL), 0);
  assert_int_equal(rpc_server_add_method(s, "/a/B", RPC_SERVER_STREAM, dummy_handler, NULL),
                   -EEXIST);
  /* Never started: destroy alone is enough. */
  rpc_server_destroy(s);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* A unix: path that does not fit a sockaddr_un is refused when the server
 * is created, with the limit, rather than as "cannot listen" at start. */
static void test_create_refuses_a_unix_path_too_long_for_a_socket(void **state) {
  uv_loop_t loop;
  rpc_server *s = NULL;
  char err[512] = "";
  char addr[200], path[150];

  assert_int_equal(uv_loop_init(&loop), 0);
  memset(path, 'x', sizeof path - 1);
  path[0] = '/';
  path[108] = '\0'; /* 108 bytes: one more than sun_path holds with its NUL */
  snprintf(addr, sizeof addr, "unix:%s", path);
  assert_int_equal(rpc_server_create(&loop, addr, &s, err, sizeof err), -ENAMETOOLONG);
  assert_null(s);
  assert_non_null(strstr(err, "is longer than 107 bytes"));
  assert_non_null(strstr(err, path));
  snprintf(addr, sizeof addr, "unix://%s", path);
  assert_int_equal(rpc_server_create(&loop, addr, &s, err, sizeof err), -ENAMETOOLONG);
  /* 107 bytes fit. */
  path[107] = '\0';
  snprintf(addr, sizeof addr, "unix:%s", path);
  assert_int_equal(rpc_server_create(&loop, addr, &s, err, sizeof err), 0);
  rpc_server_destroy(s);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_start_fails_on_a_port_in_use(void **state) {
  fixture *fx = *state;
  uv_loop_t loop;
  rpc_server *s = NULL;
  char err[256] = "";
  char addr[64];
  int port = 0;

  assert_int_equal(uv_loop_init(&loop), 0);
  snprintf(addr, sizeof addr, "127.0.0.1:%d", fx->port);
  assert_int_equal(rpc_server_create(&loop, addr, &s, err, sizeof err), 0);
  assert_int_equal(rpc_server_add_method(s, "/a/B", RPC_UNARY, dummy_handler, NULL), 0);
  assert_int_equal(rpc_server_start(s, &port, err, sizeof err), -EADDRINUSE);
  assert_non_null(strstr(err, addr));
  rpc_server_destroy(s);
  /* The failed start closed its async handle; the loop frees it. */
  assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
  assert_int_equal(uv_loop_close(&loop), 0);

  /* The first server still answers. */
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;
  assert_int_equal(
      rpc_unary(fx->channel, "/test.Echo/Echo", "hi", 2, 10000, &reply, &reply_bytes, &result),
      RPC_OK);
  free(reply);
}

static void test_unary_echo_round_trip(void **state) {
  fixture *fx = *state;
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;

  int status =
      rpc_unary(fx->channel, "/test.Echo/Echo", "hello", 5, 10000, &reply, &reply_bytes, &result);
  assert_int_equal(status, RPC_OK);
  assert_int_equal(result.status, RPC_OK);
  assert_int_equal(reply_bytes, 5);
  assert_memory_equal(reply, "hello", 5);
  free(reply);

  /* An empty request gets an empty reply. */
  status = rpc_unary(fx->channel, "/test.Echo/Echo", NULL, 0, 10000, &reply, &reply_bytes, &result);
  assert_int_equal(status, RPC_OK);
  assert_int_equal(reply_bytes, 0);
  free(reply);

  /* A large request (1 MiB), under the limit, comes back byte for byte. */
  size_t big_bytes = 1u << 20;
  uint8_t *big = malloc(big_bytes);
  assert_non_null(big);
  for (size_t i = 0; i < big_bytes; i++)
    big[i] = (uint8_t)(i * 131 + 7);
  status = rpc_unary(fx->channel, "/test.Echo/Echo", big, big_bytes, 10000, &reply, &reply_bytes,
                     &result);
  assert_int_equal(status, RPC_OK);
  assert_int_equal(reply_bytes, big_bytes);
  assert_memory_equal(reply, big, big_bytes);
  free(reply);
  free(big);
  assert_int_equal(atomic_load(&fx->echo_calls), 3);
  assert_int_equal(atomic_load(&fx->unary_send_rc), -EINVAL);
}

static void test_reply_later_from_a_timer(void **state) {
  fixture *fx = *state;
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;

  int status = rpc_unary(fx->channel, "/test.Echo/Later", "patience", 8, 10000, &reply,
                         &reply_bytes, &result);
  assert_int_equal(status, RPC_OK);
  assert_int_equal(reply_bytes, 8);
  assert_memory_equal(reply, "patience", 8);
  free(reply);
  assert_int_equal(atomic_load(&fx->later_calls), 1);
}

static void test_error_status_and_message_reach_the_client(void **state) {
  fixture *fx = *state;
  uint8_t *reply = (uint8_t *)"sentinel";
  size_t reply_bytes = 99;
  rpc_result result;

  int status =
      rpc_unary(fx->channel, "/test.Echo/Fail", "k1", 2, 10000, &reply, &reply_bytes, &result);
  assert_int_equal(status, RPC_NOT_FOUND);
  assert_int_equal(result.status, RPC_NOT_FOUND);
  assert_string_equal(result.message, "no such key: k1");
  assert_null(reply);
  assert_int_equal(reply_bytes, 0);
}

static void test_unknown_method_is_unimplemented(void **state) {
  fixture *fx = *state;
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;

  int status = rpc_unary(fx->channel, "/test.Echo/NoSuchMethod", "x", 1, 10000, &reply,
                         &reply_bytes, &result);
  assert_int_equal(status, RPC_UNIMPLEMENTED);
  assert_non_null(strstr(result.message, "/test.Echo/NoSuchMethod"));
  assert_null(reply);

  /* So does an unknown method opened as a stream. */
  rpc_stream *st = NULL;
  assert_int_equal(rpc_stream_open(fx->channel, "/test.Echo/Nope", NULL, 0, 10000, &st), 0);
  uint8_t *message = NULL;
  size_t message_bytes = 0;
  assert_int_equal(rpc_stream_read(st, &message, &message_bytes, &result), 0);
  assert_int_equal(result.status, RPC_UNIMPLEMENTED);
  rpc_stream_close(st);
}

static void test_peer_is_the_client_address(void **state) {
  fixture *fx = *state;
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;

  assert_int_equal(
      rpc_unary(fx->channel, "/test.Echo/Peer", NULL, 0, 10000, &reply, &reply_bytes, &result),
      RPC_OK);
  char peer[128];
  snprintf(peer, sizeof peer, "%.*s", (int)reply_bytes, (const char *)reply);
  free(reply);
  if (strncmp(peer, "ipv4:127.0.0.1:", 15) != 0)
    fail_msg("expected peer ipv4:127.0.0.1:<port>, got \"%s\"", peer);
}

static void test_deadline_exceeded_and_server_cancel_callback(void **state) {
  fixture *fx = *state;
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;

  long long start = now_ms();
  int status =
      rpc_unary(fx->channel, "/test.Echo/Hang", "wait", 4, 1000, &reply, &reply_bytes, &result);
  long long elapsed = now_ms() - start;
  assert_int_equal(status, RPC_DEADLINE_EXCEEDED);
  assert_null(reply);
  if (elapsed < 900 || elapsed > 20000)
    fail_msg("deadline of 1000 ms took %lld ms", elapsed);
  assert_int_equal(atomic_load(&fx->hang_started), 1);
  /* The handler saw the deadline, and the server cancelled the call. */
  long long remaining = atomic_load(&fx->hang_remaining_ms);
  /* gRPC sends the deadline as a timeout, rounded up and restarted when the
   * headers arrive, so the server may see a little more than was set. */
  if (remaining <= 0 || remaining > 1200)
    fail_msg("handler saw %lld ms remaining of 1000", remaining);
  if (!wait_for(&fx->hang_cancelled, 1, WAIT_MS))
    fail_msg("the server's cancel callback did not run");
  usleep(50 * 1000);
  assert_int_equal(atomic_load(&fx->hang_cancelled), 1); /* once */
}

static void test_client_rejects_bad_arguments(void **state) {
  fixture *fx = *state;
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;
  rpc_stream *st = NULL;

  assert_int_equal(rpc_unary(fx->channel, "no-slash", "x", 1, 1000, &reply, &reply_bytes, &result),
                   RPC_INVALID_ARGUMENT);
  assert_int_equal(rpc_unary(fx->channel, "/a/B", NULL, 3, 1000, &reply, &reply_bytes, &result),
                   RPC_INVALID_ARGUMENT);
  assert_int_equal(rpc_stream_open(fx->channel, NULL, NULL, 0, 1000, &st), -EINVAL);
  assert_null(st);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status_names),
      cmocka_unit_test(test_add_method_rejects_bad_input),
      cmocka_unit_test(test_create_refuses_a_unix_path_too_long_for_a_socket),
      cmocka_unit_test_setup_teardown(test_start_fails_on_a_port_in_use, setup_server,
                                      teardown_server),
      cmocka_unit_test_setup_teardown(test_unary_echo_round_trip, setup_server, teardown_server),
      cmocka_unit_test_setup_teardown(test_reply_later_from_a_timer, setup_server, teardown_server),
      cmocka_unit_test_setup_teardown(test_error_status_and_message_reach_the_client, setup_server,
                                      teardown_server),
      cmocka_unit_test_setup_teardown(test_unknown_method_is_unimplemented, setup_server,
                                      teardown_server),
      cmocka_unit_test_setup_teardown(test_peer_is_the_client_address, setup_server,
                                      teardown_server),
      cmocka_unit_test_setup_teardown(test_deadline_exceeded_and_server_cancel_callback,
                                      setup_server, teardown_server),
      cmocka_unit_test_setup_teardown(test_client_rejects_bad_arguments, setup_server,
                                      teardown_server),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
