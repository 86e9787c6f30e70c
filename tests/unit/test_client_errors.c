/* How libzerod fails, against a fake daemon (client/client.c; the fake is
 * client_fixtures.c's): a missing socket; a daemon that closes the
 * connection or shuts down, which never crashes the worker (no SIGPIPE);
 * error replies surfaced with their status and message, at once or by the
 * next call that waits; undecodable or impossible replies as protocol
 * errors; GPU buffers this process cannot use; arguments refused before
 * anything is sent; a name for every status; the last error per thread. */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "frame.h"
#include "zerod.h"

#include "client_fixtures.h"

/* ------------------------------------------------------------------------
 * Tests
 * ------------------------------------------------------------------------ */

static void test_connect_to_missing_socket_is_unavailable(void **state) {
  zd_client *client = (zd_client *)0x1;
  zd_status status = zd_connect("/tmp/zerod-test-client-no-such-dir/zerod.sock", &client);
  assert_int_equal(status, ZD_E_UNAVAILABLE);
  assert_null(client);
  assert_message_contains("cannot connect to zerod at /tmp/zerod-test-client-no-such-dir");
  assert_message_contains("No such file or directory");
  assert_message_contains("zerod standalone");
}

/* $ZEROD_SOCKET, else the user's state directory's socket (here under
 * $XDG_STATE_HOME), never the working directory; connecting to the
 * default when nothing listens says where it looked and what to do. */
static void test_default_socket_follows_environment(void **state) {
  char home[] = "/tmp/zerod-test-xdg-XXXXXX";
  assert_non_null(mkdtemp(home));
  setenv("XDG_STATE_HOME", home, 1);
  unsetenv("ZEROD_SOCKET");
  char want[128];
  snprintf(want, sizeof want, "%s/zerod/zerod.sock", home);
  assert_string_equal(zd_default_socket(), want);
  zd_client *client = NULL;
  assert_int_equal(zd_connect(NULL, &client), ZD_E_UNAVAILABLE);
  assert_message_contains("no daemon answers at");
  assert_message_contains(want);
  assert_message_contains("/var/lib/zerod/zerod.sock");
  assert_message_contains("zerod standalone");
  assert_message_contains("ZEROD_SOCKET");
  setenv("ZEROD_SOCKET", "/run/zerod/x.sock", 1);
  assert_string_equal(zd_default_socket(), "/run/zerod/x.sock");
  unsetenv("ZEROD_SOCKET");
  unsetenv("XDG_STATE_HOME");
  rmdir(home);
}

static void test_daemon_closing_after_attach_makes_calls_unavailable(void **state) {
  fake_daemon *fake = fake_create();
  fake->close_after_attach = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  assert_int_equal(zd_job_version(job), 3);
  /* Wait until the fake has closed its end, so that the next call writes
   * to a closed socket: EPIPE, never SIGPIPE. */
  fake_join(fake);

  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "layer0";
  desc.tensors = unit_tensors;
  desc.ntensors = 2;
  desc.init = ZD_INIT_ZEROS;
  zd_unit unit;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_UNAVAILABLE);
  assert_message_contains("register unit layer0: zerod closed the connection");
  assert_int_equal(zd_release(job, 0), ZD_E_UNAVAILABLE);
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, 0, &view), ZD_E_UNAVAILABLE);
  assert_int_equal(zd_grad_buffer(job, 0, &view), ZD_E_UNAVAILABLE);
  assert_int_equal(zd_reduce(job, 0), ZD_E_UNAVAILABLE);
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_UNAVAILABLE);
  assert_int_equal(zd_detach(job), ZD_E_UNAVAILABLE);
  assert_message_contains("zerod closed the connection");
  assert_int_equal(sigpipe_count, 0);
  zd_close(client);
  fake_destroy(fake);
}

static void test_daemon_closing_during_a_call_makes_it_unavailable(void **state) {
  fake_daemon *fake = fake_create();
  fake->close_after_attach = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  /* No join this time: the step may go out before the fake closes, and
   * then the client reads end-of-stream while waiting for the reply. */
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_UNAVAILABLE);
  assert_message_contains("zerod closed the connection");
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_UNAVAILABLE);
  assert_int_equal(sigpipe_count, 0);
  zd_close(client);
  fake_destroy(fake);
}

static void test_error_reply_surfaces_status_and_message(void **state) {
  fake_daemon *fake = fake_create();
  fake->attach_error = ZEROD__V1__STATUS__STATUS_NOT_FOUND;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "nope";
  zd_job *job = (zd_job *)0x1;
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_NOT_FOUND);
  assert_null(job);
  assert_string_equal(zd_last_error(), "attach job nope: job nope does not exist");
  zd_close(client);
  fake_destroy(fake);
}

static void test_gather_error_names_the_unit_and_keeps_the_connection(void **state) {
  fake_daemon *fake = fake_create();
  fake->gather_error = ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_RESOURCE_EXHAUSTED);
  assert_string_equal(zd_last_error(), "gather unit 0: max_live_bytes exceeded");
  zd_step_result result = ZD_STEP_RESULT_INIT;
  assert_int_equal(zd_step(job, NULL, &result), ZD_OK);
  assert_int_equal(result.version, 1);
  zd_close(client);
  fake_destroy(fake);
}

static void test_release_error_the_library_cannot_foresee_is_deferred(void **state) {
  fake_daemon *fake = fake_create();
  fake->release_error = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view = ZD_VIEW_INIT;
  gather_ok(job, unit, &view);
  /* The release itself returns at once: it waits for nothing, and the
   * library had every reason to send it. */
  assert_int_equal(zd_release(job, unit), ZD_OK);
  /* The daemon refused it for a reason of its own: the reduce succeeds on
   * the daemon, and the worker learns of the release's failure from it,
   * with the release named first. */
  assert_int_equal(zd_reduce(job, unit), ZD_E_RESOURCE_EXHAUSTED);
  assert_string_equal(zd_last_error(), "release unit 0: more than 64 requests in flight");
  /* Reported once. */
  assert_int_equal(zd_reduce(job, unit), ZD_OK);
  zd_close(client);
  fake_destroy(fake);
}

static void test_async_reduce_waits_for_nothing_and_defers_its_error(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view grad = ZD_VIEW_INIT;
  assert_int_equal(zd_grad_buffer(job, unit, &grad), ZD_OK);
  ((float *)grad.base)[0] = 3.0f;
  assert_int_equal(zd_reduce_async(job, unit), ZD_OK);
  /* The next call that waits sees the reduce done by the daemon in order. */
  assert_int_equal(zd_step(job, NULL, NULL), ZD_OK);
  assert_int_equal(fake->reduce_no_reply_flags, 1);
  assert_true(fake->reduce_grad_sum == 3.0f);
  /* An error answering an asynchronous reduce is reported by the next call
   * that waits, with the reduce named; the call's own effect happened. */
  fake->reduce_error = 1;
  assert_int_equal(zd_grad_buffer(job, unit, &grad), ZD_OK);
  assert_int_equal(zd_reduce_async(job, unit), ZD_OK);
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_ABORTED);
  assert_string_equal(zd_last_error(), "reduce unit 0: rank 1's worker disconnected");
  zd_close(client);
  fake_destroy(fake);
}

static void test_shutdown_notice_makes_calls_unavailable(void **state) {
  fake_daemon *fake = fake_create();
  fake->step_notice = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_UNAVAILABLE);
  assert_string_equal(zd_last_error(), "step: daemon is shutting down: SIGTERM received, draining");
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_UNAVAILABLE);
  assert_string_equal(zd_last_error(),
                      "gather unit 0: daemon is shutting down: SIGTERM received, draining");
  assert_int_equal(zd_release(job, unit), ZD_E_UNAVAILABLE);
  zd_close(client);
  fake_destroy(fake);
}

static void test_undecodable_reply_is_a_protocol_error(void **state) {
  fake_daemon *fake = fake_create();
  fake->step_garbage = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_PROTOCOL);
  assert_message_contains("step: protocol error from zerod");
  /* The connection is closed: later calls are unavailable, with the cause. */
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_UNAVAILABLE);
  assert_message_contains("protocol error");
  zd_close(client);
  fake_join(fake);
  assert_true(fake->garbage_written);
  fake_destroy(fake);
}

static void test_gather_of_unseen_buffer_without_fd_is_a_protocol_error(void **state) {
  fake_daemon *fake = fake_create();
  fake->gather_unknown_buffer = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_PROTOCOL);
  assert_message_contains("buffer 99 without a descriptor");
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_UNAVAILABLE);
  zd_close(client);
  fake_destroy(fake);
}

/* main() points ZEROD_CUDA_MODULE nowhere, so this process never has CUDA,
 * GPU or not: a GPU buffer must fail the gather with a clear reason. */
static void test_gpu_buffer_without_cuda_fails_with_the_reason(void **state) {
  fake_daemon *fake = fake_create();
  fake->gather_cuda = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_FAILED_PRECONDITION);
  assert_message_contains("zerod keeps this job on GPU 2 (zerod --device cuda)");
  assert_message_contains("cannot use CUDA");
  /* The connection is fine: only this process lacks CUDA. */
  assert_int_equal(zd_release(job, unit), ZD_OK);
  assert_int_equal(zd_detach(job), ZD_OK);
  zd_close(client);
  fake_destroy(fake);
}

static void test_gpu_buffer_with_a_descriptor_too_is_a_protocol_error(void **state) {
  fake_daemon *fake = fake_create();
  fake->gather_cuda = 2;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_PROTOCOL);
  assert_message_contains("both a descriptor and GPU handles for buffer 10");
  zd_close(client);
  fake_destroy(fake);
}

static void test_invalid_arguments_are_refused(void **state) {
  assert_int_equal(zd_connect(NULL, NULL), ZD_E_INVALID_ARGUMENT);
  char long_path[200];
  memset(long_path, 'x', sizeof long_path - 1);
  long_path[sizeof long_path - 1] = '\0';
  zd_client *client = NULL;
  assert_int_equal(zd_connect(long_path, &client), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("socket path");

  fake_daemon *fake = fake_create();
  fake_start(fake);
  client = connect_to(fake);
  zd_job *job = NULL;
  assert_int_equal(zd_attach(client, NULL, &job), ZD_E_INVALID_ARGUMENT);
  zd_attach_options options = {0}; /* struct_size 0: not initialised */
  options.job = "test";
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("ZD_ATTACH_OPTIONS_INIT");
  options.struct_size = sizeof options + 8;
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_INVALID_ARGUMENT);
  options = (zd_attach_options)ZD_ATTACH_OPTIONS_INIT;
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("job name");
  zd_job_config bad_config = ZD_JOB_CONFIG_INIT;
  bad_config.optimizer = (zd_optimizer)9;
  options.job = "test";
  options.config = &bad_config;
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("optimizer");
  /* A config from an older header (only struct_size and optimizer) is
   * accepted: the fields it lacks read as zero. */
  zd_job_config old_config = ZD_JOB_CONFIG_INIT;
  old_config.struct_size = offsetof(zd_job_config, lr);
  old_config.optimizer = ZD_SGD;
  options.config = &old_config;
  assert_int_equal(zd_attach(client, &options, &job), ZD_OK);
  assert_non_null(job);
  zd_job *second_job = NULL;
  assert_int_equal(zd_attach(client, &options, &second_job), ZD_E_FAILED_PRECONDITION);
  assert_null(second_job);
  assert_message_contains("one job per connection");

  zd_unit unit;
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "layer0";
  desc.tensors = unit_tensors;
  desc.ntensors = 0;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("1..4096 tensors");
  desc.ntensors = 2;
  desc.tensors = NULL;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_INVALID_ARGUMENT);
  desc.tensors = unit_tensors;
  desc.init = ZD_INIT_FROM_RANK0; /* rank 0 without init_values */
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("init_values");
  zd_tensor_desc zero_dim[1] = {{.struct_size = sizeof(zd_tensor_desc),
                                 .name = "z",
                                 .shape = (const uint64_t[]){4, 0},
                                 .ndim = 2}};
  desc.tensors = zero_dim;
  desc.ntensors = 1;
  desc.init = ZD_INIT_ZEROS;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_register_unit(job, NULL, &unit), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_register_unit(NULL, &desc, &unit), ZD_E_INVALID_ARGUMENT);

  zd_view view = ZD_VIEW_INIT;
  zd_pending pending = ZD_PENDING_INIT;
  assert_int_equal(zd_gather(job, 42, &view), ZD_E_NOT_FOUND);
  assert_message_contains("gather unit 42");
  assert_int_equal(zd_gather(job, 0, NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_gather(NULL, 0, &view), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_gather_async(job, 0, NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_gather_wait(job, NULL, &view), ZD_E_INVALID_ARGUMENT);
  pending.request_id = 12345;
  pending.unit = 42;
  assert_int_equal(zd_gather_wait(job, &pending, &view), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_release(job, 42), ZD_E_NOT_FOUND);
  assert_int_equal(zd_release(NULL, 0), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_grad_buffer(job, 42, &view), ZD_E_NOT_FOUND);
  assert_int_equal(zd_reduce(job, 42), ZD_E_NOT_FOUND);
  assert_int_equal(zd_step(NULL, NULL, NULL), ZD_E_INVALID_ARGUMENT);
  zd_step_options step_options = {0};
  assert_int_equal(zd_step(job, &step_options, NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_detach(NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_job_rank(NULL), 0);
  assert_int_equal(zd_job_world_size(NULL), 0);
  /* After all of that the connection still works. */
  assert_int_equal(zd_step(job, NULL, NULL), ZD_OK);
  zd_close(client);
  zd_close(NULL);
  fake_destroy(fake);
}

static void test_every_status_has_a_name(void **state) {
  for (int code = ZD_OK; code >= ZD_E_IO; code--) {
    const char *name = zd_strerror((zd_status)code);
    assert_non_null(name);
    assert_string_not_equal(name, "unknown error");
    for (int other = code - 1; other >= ZD_E_IO; other--)
      assert_string_not_equal(name, zd_strerror((zd_status)other));
  }
  assert_string_equal(zd_strerror((zd_status)-99), "unknown error");
}

static void *read_last_error(void *unused) {
  (void)unused;
  return (void *)zd_last_error();
}

static void test_last_error_is_per_thread(void **state) {
  assert_int_equal(zd_connect(NULL, NULL), ZD_E_INVALID_ARGUMENT);
  assert_true(zd_last_error()[0] != '\0');
  pthread_t thread;
  void *seen = NULL;
  assert_int_equal(pthread_create(&thread, NULL, read_last_error, NULL), 0);
  assert_int_equal(pthread_join(thread, &seen), 0);
  assert_string_equal((const char *)seen, "");
}

int main(void) {
  signal(SIGPIPE, on_sigpipe);
  /* No test here may depend on whether this machine has a GPU. */
  setenv("ZEROD_CUDA_MODULE", "/nonexistent/libzerod_cuda.so", 1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_connect_to_missing_socket_is_unavailable),
      cmocka_unit_test(test_default_socket_follows_environment),
      cmocka_unit_test(test_daemon_closing_after_attach_makes_calls_unavailable),
      cmocka_unit_test(test_daemon_closing_during_a_call_makes_it_unavailable),
      cmocka_unit_test(test_error_reply_surfaces_status_and_message),
      cmocka_unit_test(test_gather_error_names_the_unit_and_keeps_the_connection),
      cmocka_unit_test(test_release_error_the_library_cannot_foresee_is_deferred),
      cmocka_unit_test(test_async_reduce_waits_for_nothing_and_defers_its_error),
      cmocka_unit_test(test_shutdown_notice_makes_calls_unavailable),
      cmocka_unit_test(test_undecodable_reply_is_a_protocol_error),
      cmocka_unit_test(test_gather_of_unseen_buffer_without_fd_is_a_protocol_error),
      cmocka_unit_test(test_gpu_buffer_without_cuda_fails_with_the_reason),
      cmocka_unit_test(test_gpu_buffer_with_a_descriptor_too_is_a_protocol_error),
      cmocka_unit_test(test_invalid_arguments_are_refused),
      cmocka_unit_test(test_every_status_has_a_name),
      cmocka_unit_test(test_last_error_is_per_thread),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
