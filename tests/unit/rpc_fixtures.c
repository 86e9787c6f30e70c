/* rpc_fixtures.c - what the gRPC plumbing tests share (rpc_fixtures.h):
 * the server with the test methods on a loop thread, its setup and
 * teardown, and the test thread's clock and poll. */
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
 * Time
 * ------------------------------------------------------------------------ */

long long now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Polls until *value >= at_least; returns whether it got there in time. */
int wait_for(atomic_int *value, int at_least, int timeout_ms) {
  long long end = now_ms() + timeout_ms;
  while (atomic_load(value) < at_least) {
    if (now_ms() > end)
      return 0;
    usleep(1000);
  }
  return 1;
}

/* ------------------------------------------------------------------------
 * The test methods
 * ------------------------------------------------------------------------ */

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

/* ------------------------------------------------------------------------
 * Setup and teardown
 * ------------------------------------------------------------------------ */

int setup_server(void **state) {
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
int shutdown_server(fixture *fx) {
  atomic_store(&fx->shutdown_requested, 1);
  uv_async_send(&fx->control);
  return wait_for(&fx->done_called, 1, WAIT_MS);
}

int teardown_server(void **state) {
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
