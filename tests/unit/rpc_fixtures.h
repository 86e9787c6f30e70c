/* rpc_fixtures.h - what the gRPC plumbing tests share (test_rpc.c,
 * test_rpc_stream.c, test_rpc_limits.c, test_rpc_load.c): a real gRPC
 * server on 127.0.0.1:0 whose libuv loop runs on its own thread, with the
 * test methods of /test.Echo (Echo, Later, Fail, Hang, Peer, Big; the
 * streams Count, Burst, Ticker) recording what they saw in the fixture,
 * and a channel to it; a monotonic clock and a poll for the test thread. */
#ifndef ZEROD_TESTS_RPC_FIXTURES_H
#define ZEROD_TESTS_RPC_FIXTURES_H

#include <pthread.h>
#include <stdatomic.h>

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

/* A setup: starts the server with the test methods on its loop thread and opens a channel. */
int setup_server(void **state);
/* Asks the loop to shut the server down; returns whether done() ran in time. */
int shutdown_server(fixture *fx);
/* A teardown: shuts the server down, joins the loop, checks no handle is left, frees all. */
int teardown_server(void **state);

/* The monotonic clock in milliseconds. */
long long now_ms(void);
/* Polls until *value >= at_least; returns whether it got there in time. */
int wait_for(atomic_int *value, int at_least, int timeout_ms);

#endif /* ZEROD_TESTS_RPC_FIXTURES_H */
