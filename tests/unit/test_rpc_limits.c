/* Message limits of the rpc layer (daemon/rpc/) both ways, against a real
 * gRPC server on a loop thread (rpc_fixtures.c): a request over the limit
 * refused by the client and by the server, a reply over it
 * RESOURCE_EXHAUSTED; and UNAVAILABLE when nobody listens.
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
 * Limits and a dead server
 * ------------------------------------------------------------------------ */

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

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_request_over_the_limit_refused, setup_server,
                                      teardown_server),
      cmocka_unit_test_setup_teardown(test_server_refuses_a_request_over_the_limit, setup_server,
                                      teardown_server),
      cmocka_unit_test_setup_teardown(test_reply_over_the_limit_is_resource_exhausted, setup_server,
                                      teardown_server),
      cmocka_unit_test(test_unavailable_when_nobody_listens),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
