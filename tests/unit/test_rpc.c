/* rpc against itself: a real gRPC server on 127.0.0.1:0 whose libuv loop
 * runs on its own thread, and blocking clients on the test thread and on
 * helper threads. Each test pins one behaviour of daemon/rpc/: replies now
 * and later, error statuses, unknown methods, deadlines and the server's
 * cancel callback, streams (ending, cancelled, over-full), message limits
 * both ways, a dead server, shutdown with calls in flight, and many
 * concurrent clients.
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

#define WAIT_MS        20000 /* bound on waiting for the server to react */
#define STREAM_COUNT   50    /* messages the Count method sends */
#define BURST_MESSAGES 100   /* sends the Burst method tries at once */

/* ------------------------------------------------------------------------
 * The fixture: a server with test methods on a loop thread, and a channel
 * ------------------------------------------------------------------------ */

typedef struct fixture {
  uv_loop_t loop;
  uv_async_t control; /* the test thread asks the loop to shut down */
  pthread_t loop_thread;
  int loop_running;
  rpc_server *server;
  int port;
  char target[64];
  rpc_channel *channel;

  atomic_int shutdown_requested;
  int shutdown_started; /* loop thread only */
  atomic_int done_called;

  /* What the handlers saw. */
  atomic_int echo_calls;
  atomic_int later_calls;
  atomic_int hang_started;
  atomic_int hang_cancelled;
  atomic_llong hang_remaining_ms;
  atomic_int ticker_started;
  atomic_int ticker_cancelled;
  atomic_int ticker_send_after_cancel; /* rpc_call_send's return then */
  atomic_int ticker_finished;
  atomic_int count_send_errors;
  atomic_int unary_send_rc;    /* rpc_call_send on a unary call */
  atomic_int oversize_send_rc; /* rpc_call_send over the limit */
  atomic_int burst_ok;
  atomic_int burst_nobufs;
  atomic_int big_calls;
} fixture;

static long long now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Polls until *value >= at_least; returns whether it got there in time. */
static int wait_for(atomic_int *value, int at_least, int timeout_ms) {
  long long end = now_ms() + timeout_ms;
  while (atomic_load(value) < at_least) {
    if (now_ms() > end)
      return 0;
    usleep(1000);
  }
  return 1;
}

static void close_and_free(uv_handle_t *handle) {
  free(handle->data);
}

/* Echo: replies with the request. */
static void echo_handler(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  fixture *fx = arg;
  atomic_fetch_add(&fx->echo_calls, 1);
  atomic_store(&fx->unary_send_rc, rpc_call_send(call, "x", 1));
  rpc_call_finish(call, RPC_OK, NULL, request, request_bytes);
}

/* Later: replies with the request from a timer, after the handler returned. */
typedef struct later_reply {
  uv_timer_t timer;
  rpc_call *call;
  size_t request_bytes;
  uint8_t request[64];
} later_reply;

static void later_fire(uv_timer_t *timer) {
  later_reply *later = timer->data;
  rpc_call_finish(later->call, RPC_OK, NULL, later->request, later->request_bytes);
  uv_close((uv_handle_t *)timer, close_and_free);
}

static void later_handler(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  fixture *fx = arg;
  later_reply *later = calloc(1, sizeof(*later));
  if (later == NULL || request_bytes > sizeof(later->request)) {
    free(later);
    rpc_call_finish(call, RPC_INVALID_ARGUMENT, "request too long for Later", NULL, 0);
    return;
  }
  atomic_fetch_add(&fx->later_calls, 1);
  later->call = call;
  later->request_bytes = request_bytes;
  if (request_bytes > 0)
    memcpy(later->request, request, request_bytes);
  uv_timer_init(&fx->loop, &later->timer);
  later->timer.data = later;
  uv_timer_start(&later->timer, later_fire, 30, 0);
}

/* Fail: NOT_FOUND with a message naming the request. */
static void fail_handler(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  char message[128];
  snprintf(message, sizeof message, "no such key: %.*s",
           (int)(request_bytes < 64 ? request_bytes : 64), (const char *)request);
  rpc_call_finish(call, RPC_NOT_FOUND, message, NULL, 0);
}

/* Hang: never answers; finishes only when cancelled. */
static void hang_cancel(rpc_call *call, void *arg) {
  fixture *fx = arg;
  atomic_fetch_add(&fx->hang_cancelled, 1);
  rpc_call_finish(call, RPC_CANCELLED, "cancelled", NULL, 0);
}

static void hang_handler(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  fixture *fx = arg;
  atomic_store(&fx->hang_remaining_ms, (long long)rpc_call_remaining_ms(call));
  rpc_call_set_cancel(call, hang_cancel, fx);
  atomic_fetch_add(&fx->hang_started, 1);
}

/* Peer: replies with the peer's address. */
static void peer_handler(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  const char *peer = rpc_call_peer(call);
  rpc_call_finish(call, RPC_OK, NULL, peer, strlen(peer));
}

/* Big: a reply one byte over the limit. */
static void big_handler(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  fixture *fx = arg;
  size_t n_bytes = RPC_MAX_MESSAGE_BYTES + 1;
  uint8_t *reply = calloc(1, n_bytes);
  atomic_fetch_add(&fx->big_calls, 1);
  rpc_call_finish(call, RPC_OK, NULL, reply, reply == NULL ? 0 : n_bytes);
  free(reply);
}

/* Count (stream): STREAM_COUNT messages holding their index, then OK. */
static void count_handler(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  fixture *fx = arg;
  /* The size is checked before the bytes are read. */
  static const uint8_t one_byte = 0;
  atomic_store(&fx->oversize_send_rc, rpc_call_send(call, &one_byte, RPC_MAX_MESSAGE_BYTES + 1));
  for (uint32_t i = 0; i < STREAM_COUNT; i++) {
    if (rpc_call_send(call, &i, sizeof i) != 0)
      atomic_fetch_add(&fx->count_send_errors, 1);
  }
  rpc_call_finish(call, RPC_OK, NULL, NULL, 0);
}

/* Burst (stream): BURST_MESSAGES sends at once, more than the queue holds. */
static void burst_handler(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  fixture *fx = arg;
  uint8_t message[1024];
  memset(message, 'b', sizeof message);
  for (int i = 0; i < BURST_MESSAGES; i++) {
    int rc = rpc_call_send(call, message, sizeof message);
    if (rc == 0)
      atomic_fetch_add(&fx->burst_ok, 1);
    else if (rc == -ENOBUFS)
      atomic_fetch_add(&fx->burst_nobufs, 1);
  }
  rpc_call_finish(call, RPC_OK, NULL, NULL, 0);
}

/* Ticker (stream): one message every 5 ms until cancelled. On the tick after
 * the cancel it records what rpc_call_send says, then finishes. */
typedef struct ticker {
  uv_timer_t timer;
  rpc_call *call;
  fixture *fx;
  uint32_t sent;
  int cancelled;
} ticker;

static void ticker_cancel(rpc_call *call, void *arg) {
  ticker *t = arg;
  t->cancelled = 1;
  atomic_fetch_add(&t->fx->ticker_cancelled, 1);
}

static void ticker_tick(uv_timer_t *timer) {
  ticker *t = timer->data;
  if (t->cancelled) {
    atomic_store(&t->fx->ticker_send_after_cancel, rpc_call_send(t->call, "x", 1));
    rpc_call_finish(t->call, RPC_CANCELLED, NULL, NULL, 0);
    atomic_fetch_add(&t->fx->ticker_finished, 1);
    uv_timer_stop(timer);
    uv_close((uv_handle_t *)timer, close_and_free);
    return;
  }
  int rc = rpc_call_send(t->call, &t->sent, sizeof t->sent);
  if (rc == 0)
    t->sent++;
}

static void ticker_handler(rpc_call *call, const uint8_t *request, size_t request_bytes,
                           void *arg) {
  fixture *fx = arg;
  ticker *t = calloc(1, sizeof(*t));
  if (t == NULL) {
    rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "no memory", NULL, 0);
    return;
  }
  t->call = call;
  t->fx = fx;
  rpc_call_set_cancel(call, ticker_cancel, t);
  uv_timer_init(&fx->loop, &t->timer);
  t->timer.data = t;
  uv_timer_start(&t->timer, ticker_tick, 0, 5);
  atomic_fetch_add(&fx->ticker_started, 1);
}

static void on_server_done(void *arg) {
  fixture *fx = arg;
  rpc_server_destroy(fx->server);
  fx->server = NULL;
  uv_close((uv_handle_t *)&fx->control, NULL);
  atomic_store(&fx->done_called, 1);
}

static void on_control(uv_async_t *handle) {
  fixture *fx = handle->data;
  if (atomic_load(&fx->shutdown_requested) && !fx->shutdown_started) {
    fx->shutdown_started = 1;
    rpc_server_shutdown(fx->server, on_server_done, fx);
  }
}

static void *loop_main(void *arg) {
  fixture *fx = arg;
  uv_run(&fx->loop, UV_RUN_DEFAULT);
  return NULL;
}

static int setup_server(void **state) {
  fixture *fx = calloc(1, sizeof(*fx));
  char err[256] = "";
  assert_non_null(fx);
  assert_int_equal(uv_loop_init(&fx->loop), 0);
  assert_int_equal(uv_async_init(&fx->loop, &fx->control, on_control), 0);
  fx->control.data = fx;

  assert_int_equal(rpc_server_create(&fx->loop, "127.0.0.1:0", &fx->server, err, sizeof err), 0);
  static const struct {
    const char *path;
    rpc_kind kind;
    rpc_handler handler;
  } methods[] = {
      {"/test.Echo/Echo", RPC_UNARY, echo_handler},
      {"/test.Echo/Later", RPC_UNARY, later_handler},
      {"/test.Echo/Fail", RPC_UNARY, fail_handler},
      {"/test.Echo/Hang", RPC_UNARY, hang_handler},
      {"/test.Echo/Peer", RPC_UNARY, peer_handler},
      {"/test.Echo/Big", RPC_UNARY, big_handler},
      {"/test.Echo/Count", RPC_SERVER_STREAM, count_handler},
      {"/test.Echo/Burst", RPC_SERVER_STREAM, burst_handler},
      {"/test.Echo/Ticker", RPC_SERVER_STREAM, ticker_handler},
  };
  for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
    assert_int_equal(
        rpc_server_add_method(fx->server, methods[i].path, methods[i].kind, methods[i].handler, fx),
        0);
  }
  int rc = rpc_server_start(fx->server, &fx->port, err, sizeof err);
  if (rc != 0)
    fail_msg("rpc_server_start: %d %s", rc, err);
  assert_true(fx->port > 0);
  snprintf(fx->target, sizeof fx->target, "127.0.0.1:%d", fx->port);
  assert_int_equal(rpc_channel_create(fx->target, &fx->channel, err, sizeof err), 0);

  /* From here on the loop thread owns the server. */
  assert_int_equal(pthread_create(&fx->loop_thread, NULL, loop_main, fx), 0);
  fx->loop_running = 1;
  *state = fx;
  return 0;
}

/* Asks the loop to shut the server down; returns whether done() ran in
 * time. */
static int shutdown_server(fixture *fx) {
  atomic_store(&fx->shutdown_requested, 1);
  uv_async_send(&fx->control);
  return wait_for(&fx->done_called, 1, WAIT_MS);
}

static int teardown_server(void **state) {
  fixture *fx = *state;
  if (!atomic_load(&fx->done_called) && !shutdown_server(fx))
    fail_msg("server shutdown did not call done within %d ms", WAIT_MS);
  pthread_join(fx->loop_thread, NULL);
  assert_null(fx->server);
  /* Every handle (timers, the server's async) was closed. */
  assert_int_equal(uv_loop_close(&fx->loop), 0);
  rpc_channel_destroy(fx->channel);
  free(fx);
  return 0;
}

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

static void test_request_over_the_limit_refused(void **state) {
  fixture *fx = *state;
  size_t n_bytes = RPC_MAX_MESSAGE_BYTES + 1;
  uint8_t *request = calloc(1, n_bytes);
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;

  assert_non_null(request);
  int status = rpc_unary(fx->channel, "/test.Echo/Echo", request, n_bytes, 10000, &reply,
                         &reply_bytes, &result);
  assert_int_equal(status, RPC_RESOURCE_EXHAUSTED);
  assert_null(reply);

  rpc_stream *st = NULL;
  assert_int_equal(rpc_stream_open(fx->channel, "/test.Echo/Count", request, n_bytes, 10000, &st),
                   0);
  uint8_t *message = NULL;
  size_t message_bytes = 0;
  assert_int_equal(rpc_stream_read(st, &message, &message_bytes, &result), 0);
  assert_int_equal(result.status, RPC_RESOURCE_EXHAUSTED);
  rpc_stream_close(st);
  free(request);
  assert_int_equal(atomic_load(&fx->echo_calls), 0);
}

/* A client that is not ours, with no send limit: the server itself must
 * refuse the message before any handler sees it. */
static void test_server_refuses_a_request_over_the_limit(void **state) {
  fixture *fx = *state;
  size_t n_bytes = RPC_MAX_MESSAGE_BYTES + 1;

  grpc_init();
  grpc_arg arg;
  arg.type = GRPC_ARG_INTEGER;
  arg.key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
  arg.value.integer = -1;
  grpc_channel_args args = {.num_args = 1, .args = &arg};
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  grpc_channel *channel = grpc_channel_create(fx->target, creds, &args);
  grpc_channel_credentials_release(creds);
  grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
  grpc_slice method = grpc_slice_from_static_string("/test.Echo/Echo");
  gpr_timespec deadline =
      gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(20000, GPR_TIMESPAN));
  grpc_call *call = grpc_channel_create_call(channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq, method,
                                             NULL, deadline, NULL);

  uint8_t *request = calloc(1, n_bytes);
  assert_non_null(request);
  grpc_slice request_slice = grpc_slice_from_copied_buffer((const char *)request, n_bytes);
  free(request);
  grpc_byte_buffer *request_buffer = grpc_raw_byte_buffer_create(&request_slice, 1);
  grpc_slice_unref(request_slice);
  grpc_byte_buffer *reply_buffer = NULL;
  grpc_metadata_array initial, trailing;
  grpc_metadata_array_init(&initial);
  grpc_metadata_array_init(&trailing);
  grpc_status_code status = GRPC_STATUS_OK;
  grpc_slice details = grpc_empty_slice();
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = request_buffer;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &initial;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &reply_buffer;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &trailing;
  ops[5].data.recv_status_on_client.status = &status;
  ops[5].data.recv_status_on_client.status_details = &details;
  int tag;
  assert_int_equal(grpc_call_start_batch(call, ops, 6, &tag, NULL), GRPC_CALL_OK);
  grpc_event ev = grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  assert_int_equal(ev.type, GRPC_OP_COMPLETE);

  int got_status = (int)status;
  if (reply_buffer != NULL)
    grpc_byte_buffer_destroy(reply_buffer);
  grpc_byte_buffer_destroy(request_buffer);
  grpc_slice_unref(details);
  grpc_metadata_array_destroy(&initial);
  grpc_metadata_array_destroy(&trailing);
  grpc_call_unref(call);
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  grpc_channel_destroy(channel);
  grpc_shutdown();

  assert_int_equal(got_status, RPC_RESOURCE_EXHAUSTED);
  assert_int_equal(atomic_load(&fx->echo_calls), 0);
}

static void test_reply_over_the_limit_is_resource_exhausted(void **state) {
  fixture *fx = *state;
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;

  int status =
      rpc_unary(fx->channel, "/test.Echo/Big", NULL, 0, 10000, &reply, &reply_bytes, &result);
  assert_int_equal(status, RPC_RESOURCE_EXHAUSTED);
  assert_null(reply);
  assert_int_equal(atomic_load(&fx->big_calls), 1);
}

static void test_unavailable_when_nobody_listens(void **state) {
  /* A port that is bound but not listening refuses connections, and stays
   * ours (so nobody else starts listening on it) until the test ends. */
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  socklen_t sa_bytes = sizeof sa;
  assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &sa_bytes), 0);

  char target[64], err[256];
  snprintf(target, sizeof target, "127.0.0.1:%d", ntohs(sa.sin_port));
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_create(target, &ch, err, sizeof err), 0);

  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  rpc_result result;
  long long start = now_ms();
  int status = rpc_unary(ch, "/test.Echo/Echo", "x", 1, 10000, &reply, &reply_bytes, &result);
  long long elapsed = now_ms() - start;
  assert_int_equal(status, RPC_UNAVAILABLE);
  assert_true(result.message[0] != '\0');
  if (elapsed >= 10000)
    fail_msg("UNAVAILABLE took %lld ms, the whole deadline", elapsed);

  /* A stream to it ends with UNAVAILABLE too. */
  rpc_stream *st = NULL;
  assert_int_equal(rpc_stream_open(ch, "/test.Echo/Count", NULL, 0, 10000, &st), 0);
  uint8_t *message = NULL;
  size_t message_bytes = 0;
  assert_int_equal(rpc_stream_read(st, &message, &message_bytes, &result), 0);
  assert_int_equal(result.status, RPC_UNAVAILABLE);
  rpc_stream_close(st);

  rpc_channel_destroy(ch);
  close(fd);
}

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
      cmocka_unit_test_setup_teardown(test_request_over_the_limit_refused, setup_server,
                                      teardown_server),
      cmocka_unit_test_setup_teardown(test_server_refuses_a_request_over_the_limit, setup_server,
                                      teardown_server),
      cmocka_unit_test_setup_teardown(test_reply_over_the_limit_is_resource_exhausted, setup_server,
                                      teardown_server),
      cmocka_unit_test(test_unavailable_when_nobody_listens),
      cmocka_unit_test_setup_teardown(test_shutdown_with_calls_in_flight, setup_server,
                                      teardown_server),
      cmocka_unit_test_setup_teardown(test_many_concurrent_clients, setup_server, teardown_server),
      cmocka_unit_test_setup_teardown(test_client_rejects_bad_arguments, setup_server,
                                      teardown_server),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
