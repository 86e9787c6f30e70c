/* libzerod's contract with its caller, against a real `zerod standalone`
 * (tests/standalone_daemon.h): each call returns its own errors, with the
 * status the daemon gives the same fault (client/client_status.c); the
 * caller's arguments are checked before they are used; and the structs
 * that carry their size are read and written only as far as the caller's
 * struct_size reaches (client/client_sized.c, docs/client.md "ABI
 * policy").
 *
 * One daemon serves every test; each test attaches to a job of its own
 * (one rank, SGD with lr 0.5) with two units "a" (w [2, 3], b [3]) and "b"
 * (w [4]) from known values. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "client_impl.h" /* client__status_from_wire and its inverse */
#include "standalone_daemon.h"
#include "zerod.h"

#ifndef ZEROD_BINARY
#error "ZEROD_BINARY (the zerod program) must be defined by the build"
#endif

static standalone_daemon daemon_proc;

static int start_daemon(void **state) {
  return standalone_daemon_start(&daemon_proc, ZEROD_BINARY, 1);
}

static int stop_daemon(void **state) {
  return standalone_daemon_stop(&daemon_proc);
}

#define OK(call)                                                                                   \
  do {                                                                                             \
    zd_status status_ = (call);                                                                    \
    if (status_ != ZD_OK)                                                                          \
      fail_msg("%s: %s (%s)", #call, zd_strerror(status_), zd_last_error());                       \
  } while (0)

#define assert_message_contains(text)                                                              \
  do {                                                                                             \
    if (strstr(zd_last_error(), (text)) == NULL)                                                   \
      fail_msg("zd_last_error() is \"%s\", expected it to contain \"%s\"", zd_last_error(),        \
               (text));                                                                            \
  } while (0)

/* A test's connection, job and units. */
typedef struct session {
  zd_client *client;
  zd_job *job;
  zd_unit a, b;
} session;

static const uint64_t a_w_shape[2] = {2, 3};
static const uint64_t a_b_shape[1] = {3};
static const uint64_t b_w_shape[1] = {4};

static void open_session(session *s, const char *job_name) {
  OK(zd_connect(daemon_proc.socket, &s->client));
  zd_job_config config = ZD_JOB_CONFIG_INIT;
  config.optimizer = ZD_SGD;
  config.lr = 0.5;
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = job_name;
  options.create = 1;
  options.config = &config;
  OK(zd_attach(s->client, &options, &s->job));

  zd_tensor_desc a_tensors[2] = {ZD_TENSOR_DESC_INIT, ZD_TENSOR_DESC_INIT};
  a_tensors[0].name = "w";
  a_tensors[0].shape = a_w_shape;
  a_tensors[0].ndim = 2;
  a_tensors[1].name = "b";
  a_tensors[1].shape = a_b_shape;
  a_tensors[1].ndim = 1;
  float a_values[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "a";
  desc.tensors = a_tensors;
  desc.ntensors = 2;
  desc.init = ZD_INIT_FROM_RANK0;
  desc.init_values = a_values;
  OK(zd_register_unit(s->job, &desc, &s->a));

  zd_tensor_desc b_tensor = ZD_TENSOR_DESC_INIT;
  b_tensor.name = "w";
  b_tensor.shape = b_w_shape;
  b_tensor.ndim = 1;
  float b_values[4] = {10, 20, 30, 40};
  desc.name = "b";
  desc.tensors = &b_tensor;
  desc.ntensors = 1;
  desc.init_values = b_values;
  OK(zd_register_unit(s->job, &desc, &s->b));
}

static void close_session(session *s) {
  OK(zd_detach(s->job));
  zd_close(s->client);
}

/* ------------------------------------------------------------------------
 * Releases return their own errors
 * ------------------------------------------------------------------------ */

static void test_release_of_a_unit_never_gathered_fails_in_the_release(void **state) {
  session s;
  open_session(&s, "release-never-gathered");
  assert_int_equal(zd_release(s.job, s.a), ZD_E_FAILED_PRECONDITION);
  assert_message_contains("release unit 0: unit a is not gathered");
  /* The next, unrelated calls report nothing of it. */
  zd_view grad = ZD_VIEW_INIT;
  OK(zd_grad_buffer(s.job, s.a, &grad));
  memset(grad.base, 0, grad.bytes);
  OK(zd_reduce(s.job, s.a));
  OK(zd_step(s.job, NULL, NULL));
  close_session(&s);
}

static void test_second_release_fails_in_the_release(void **state) {
  session s;
  open_session(&s, "release-twice");
  zd_view view = ZD_VIEW_INIT;
  OK(zd_gather(s.job, s.b, &view));
  assert_true(((const float *)view.base)[3] == 40.0f);
  OK(zd_release(s.job, s.b));
  assert_int_equal(zd_release(s.job, s.b), ZD_E_FAILED_PRECONDITION);
  assert_message_contains("release unit 1");
  /* The unit can be gathered again, and the step after says nothing. */
  OK(zd_gather(s.job, s.b, &view));
  OK(zd_release(s.job, s.b));
  zd_step_result result = ZD_STEP_RESULT_INIT;
  OK(zd_step(s.job, NULL, &result));
  assert_int_equal(result.step, 1);
  close_session(&s);
}

static void test_release_after_a_restore_fails_in_the_release(void **state) {
  session s;
  open_session(&s, "release-after-restore");
  OK(zd_checkpoint_save(s.job, "before", NULL));
  zd_view view = ZD_VIEW_INIT;
  OK(zd_gather(s.job, s.a, &view));
  /* The restore lets go of the gathered unit, on both sides. */
  OK(zd_checkpoint_restore(s.job, "before", NULL));
  assert_int_equal(zd_release(s.job, s.a), ZD_E_FAILED_PRECONDITION);
  OK(zd_step(s.job, NULL, NULL));
  close_session(&s);
}

/* ------------------------------------------------------------------------
 * One status per fault
 * ------------------------------------------------------------------------ */

/* The daemon answers NOT_FOUND for a unit id it does not know
 * (protocol.md); the library, which knows the job's units, answers the
 * same without asking, whichever call it is. */
static void test_unknown_unit_is_not_found_from_every_call(void **state) {
  session s;
  open_session(&s, "unknown-unit");
  const zd_unit unknown = 99;
  zd_view view = ZD_VIEW_INIT;
  zd_pending pending = ZD_PENDING_INIT;
  float values[9] = {0};
  uint64_t step;
  assert_int_equal(zd_gather(s.job, unknown, &view), ZD_E_NOT_FOUND);
  assert_message_contains("gather unit 99: no such unit known to this job");
  assert_int_equal(zd_gather_async(s.job, unknown, &pending), ZD_E_NOT_FOUND);
  assert_int_equal(zd_release(s.job, unknown), ZD_E_NOT_FOUND);
  assert_int_equal(zd_grad_buffer(s.job, unknown, &view), ZD_E_NOT_FOUND);
  assert_int_equal(zd_reduce(s.job, unknown), ZD_E_NOT_FOUND);
  assert_int_equal(zd_reduce_async(s.job, unknown), ZD_E_NOT_FOUND);
  assert_int_equal(zd_load_unit(s.job, unknown, values, NULL), ZD_E_NOT_FOUND);
  assert_int_equal(zd_load_state(s.job, unknown, ZD_STATE_WEIGHTS, values, NULL, NULL),
                   ZD_E_NOT_FOUND);
  assert_int_equal(zd_read_state(s.job, unknown, ZD_STATE_WEIGHTS, values, 9, &step),
                   ZD_E_NOT_FOUND);
  zd_param_group group = ZD_PARAM_GROUP_INIT;
  const unsigned groups_of_unknown[1] = {0};
  const unsigned *tensor_groups[1] = {groups_of_unknown};
  assert_int_equal(zd_set_groups(s.job, &group, 1, &unknown, tensor_groups, 1), ZD_E_NOT_FOUND);
  assert_message_contains("units[0]: unit 99 is not known");
  /* None of it is reported again by the next call. */
  OK(zd_step(s.job, NULL, NULL));
  close_session(&s);
}

/* Every wire Status the protocol defines has its zd_status, and back:
 * the one table (client_status.c) covers the whole enum, so a code added
 * to ipc.proto without an API status fails here. */
static void test_every_wire_status_maps_to_its_api_status(void **state) {
  const ProtobufCEnumDescriptor *wire = &zerod__v1__status__descriptor;
  for (unsigned i = 0; i < wire->n_values; i++) {
    int code = wire->values[i].value;
    if (code == ZEROD__V1__STATUS__STATUS_OK)
      continue;
    zd_status status = client__status_from_wire(code);
    assert_true(status < 0);
    assert_int_equal(client__status_to_wire(status), code);
    assert_string_not_equal(zd_strerror(status), "unknown error");
    /* The names agree: STATUS_NOT_FOUND is ZD_E_NOT_FOUND's "not found". */
    char wire_name[64];
    snprintf(wire_name, sizeof wire_name, "%s", wire->values[i].name + strlen("STATUS_"));
    for (char *c = wire_name; *c != '\0'; c++)
      *c = *c == '_' ? ' ' : (char)(*c - 'A' + 'a');
    if (status != ZD_E_INTERNAL && status != ZD_E_PROTOCOL)
      assert_string_equal(zd_strerror(status), wire_name);
  }
  /* OK inside an error, and codes of a newer daemon, are not passed on. */
  assert_int_equal(client__status_from_wire(ZEROD__V1__STATUS__STATUS_OK), ZD_E_INTERNAL);
  assert_int_equal(client__status_from_wire(99), ZD_E_INTERNAL);
  /* The library's own codes have no wire code. */
  assert_int_equal(client__status_to_wire(ZD_E_NOMEM), -1);
  assert_int_equal(client__status_to_wire(ZD_E_IO), -1);
}

/* ------------------------------------------------------------------------
 * Arguments
 * ------------------------------------------------------------------------ */

static void test_set_groups_refuses_a_null_tensor_groups_entry(void **state) {
  session s;
  open_session(&s, "groups-null-entry");
  zd_param_group groups[2] = {ZD_PARAM_GROUP_INIT, ZD_PARAM_GROUP_INIT};
  groups[1].lr = 0.25;
  const zd_unit units[2] = {s.a, s.b};
  const unsigned a_groups[2] = {0, 1};
  const unsigned *tensor_groups[2] = {a_groups, NULL};
  assert_int_equal(zd_set_groups(s.job, groups, 2, units, tensor_groups, 2), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("tensor_groups[1] (unit 1) is NULL");
  /* With every entry given, the same call works. */
  const unsigned b_groups[1] = {1};
  tensor_groups[1] = b_groups;
  OK(zd_set_groups(s.job, groups, 2, units, tensor_groups, 2));
  OK(zd_step(s.job, NULL, NULL));
  close_session(&s);
}

static void test_sized_arrays_need_one_struct_size_in_every_element(void **state) {
  session s;
  open_session(&s, "sized-arrays");
  zd_param_group groups[2] = {ZD_PARAM_GROUP_INIT, {0}};
  const zd_unit units[1] = {s.b};
  const unsigned b_groups[1] = {1};
  const unsigned *tensor_groups[1] = {b_groups};
  assert_int_equal(zd_set_groups(s.job, groups, 2, units, tensor_groups, 1), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("groups[1].struct_size is 0");
  groups[0].struct_size = sizeof groups[0] + 8;
  assert_int_equal(zd_set_groups(s.job, groups, 2, units, tensor_groups, 1), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("newer zerod.h");

  zd_tensor_desc tensors[2] = {ZD_TENSOR_DESC_INIT, {0}};
  tensors[0].name = "x";
  tensors[0].shape = b_w_shape;
  tensors[0].ndim = 1;
  tensors[1] = tensors[0];
  tensors[1].name = "y";
  tensors[1].struct_size = 0;
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "c";
  desc.tensors = tensors;
  desc.ntensors = 2;
  desc.init = ZD_INIT_ZEROS;
  zd_unit unit;
  assert_int_equal(zd_register_unit(s.job, &desc, &unit), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("tensors[1].struct_size is 0");
  tensors[1].struct_size = sizeof tensors[1];
  OK(zd_register_unit(s.job, &desc, &unit));
  close_session(&s);
}

/* ------------------------------------------------------------------------
 * Outputs end at the caller's struct_size
 * ------------------------------------------------------------------------ */

#define CANARY 0xa5

/* A struct of `type` in a buffer whose bytes from `end` on are the canary. */
#define CANARIED(type, name, end)                                                                  \
  unsigned char name##_bytes[sizeof(type) + 32] __attribute__((aligned(16)));                      \
  memset(name##_bytes, CANARY, sizeof name##_bytes);                                               \
  type *name = (type *)name##_bytes;                                                               \
  name->struct_size = (end)

static void assert_canary_from(const unsigned char *bytes, size_t from, size_t total,
                               const char *what) {
  for (size_t i = from; i < total; i++) {
    if (bytes[i] != CANARY)
      fail_msg("%s: byte %zu, past the caller's struct_size %zu, was written", what, i, from);
  }
}

static void test_outputs_end_at_the_callers_struct_size(void **state) {
  session s;
  open_session(&s, "outputs-end");
  /* A view without the GPU fields (as a header before them had it). */
  size_t view_end = offsetof(zd_view, device);
  CANARIED(zd_view, view, view_end);
  OK(zd_gather(s.job, s.b, view));
  assert_int_equal(view->ntensors, 1);
  assert_true(((const float *)view->tensors[0].data)[0] == 10.0f);
  assert_canary_from(view_bytes, view_end, sizeof view_bytes, "zd_gather's view");
  OK(zd_release(s.job, s.b));

  /* A pending gather of the whole (first) size, then the view again. */
  CANARIED(zd_pending, pending, sizeof(zd_pending));
  OK(zd_gather_async(s.job, s.a, pending));
  assert_canary_from(pending_bytes, sizeof(zd_pending), sizeof pending_bytes, "zd_pending");
  memset(view_bytes, CANARY, sizeof view_bytes);
  view->struct_size = view_end;
  OK(zd_gather_wait(s.job, pending, view));
  assert_int_equal(view->ntensors, 2);
  assert_canary_from(view_bytes, view_end, sizeof view_bytes, "zd_gather_wait's view");
  OK(zd_release(s.job, s.a));

  /* A unit's info without its dtype. */
  size_t info_end = offsetof(zd_unit_info, dtype);
  CANARIED(zd_unit_info, info, info_end);
  OK(zd_job_unit_info(s.job, 0, info));
  assert_string_equal(info->name, "a");
  assert_int_equal(info->ntensors, 2);
  assert_canary_from(info_bytes, info_end, sizeof info_bytes, "zd_unit_info");

  /* A step result without loss_scale: the very bytes a worker built before
   * loss_scale was added would have lost (issue 33). */
  zd_view grad = ZD_VIEW_INIT;
  OK(zd_grad_buffer(s.job, s.b, &grad));
  float *g = grad.tensors[0].data;
  g[0] = 3;
  g[1] = 4;
  g[2] = g[3] = 0;
  OK(zd_reduce(s.job, s.b));
  size_t result_end = offsetof(zd_step_result, loss_scale);
  CANARIED(zd_step_result, result, result_end);
  OK(zd_step(s.job, NULL, result));
  assert_int_equal(result->step, 1);
  assert_true(result->grad_norm == 5.0);
  assert_int_equal(result->skipped, 0);
  assert_canary_from(result_bytes, result_end, sizeof result_bytes, "zd_step_result");

  size_t checkpoint_end = offsetof(zd_checkpoint_info, stall_ms);
  CANARIED(zd_checkpoint_info, checkpoint, checkpoint_end);
  OK(zd_checkpoint_save(s.job, "canaried", checkpoint));
  assert_string_equal(checkpoint->name, "canaried");
  assert_int_equal(checkpoint->step, 1);
  assert_canary_from(checkpoint_bytes, checkpoint_end, sizeof checkpoint_bytes,
                     "zd_checkpoint_info");
  close_session(&s);
}

/* A struct_size the call cannot use is refused before anything is sent:
 * the gather below never reaches the daemon (the unit is not held after
 * it), and the step is not taken. */
static void test_unusable_struct_size_is_refused_before_the_request(void **state) {
  session s;
  open_session(&s, "outputs-refused");
  zd_view view = {0};
  assert_int_equal(zd_gather(s.job, s.a, &view), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("ZD_VIEW_INIT");
  assert_int_equal(zd_release(s.job, s.a), ZD_E_FAILED_PRECONDITION);
  view.struct_size = sizeof view + 8;
  assert_int_equal(zd_gather(s.job, s.a, &view), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("newer zerod.h");

  zd_step_result result = {0};
  assert_int_equal(zd_step(s.job, NULL, &result), ZD_E_INVALID_ARGUMENT);
  result.struct_size = sizeof result;
  OK(zd_step(s.job, NULL, &result));
  assert_int_equal(result.step, 1);
  close_session(&s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_release_of_a_unit_never_gathered_fails_in_the_release),
      cmocka_unit_test(test_second_release_fails_in_the_release),
      cmocka_unit_test(test_release_after_a_restore_fails_in_the_release),
      cmocka_unit_test(test_unknown_unit_is_not_found_from_every_call),
      cmocka_unit_test(test_every_wire_status_maps_to_its_api_status),
      cmocka_unit_test(test_set_groups_refuses_a_null_tensor_groups_entry),
      cmocka_unit_test(test_sized_arrays_need_one_struct_size_in_every_element),
      cmocka_unit_test(test_outputs_end_at_the_callers_struct_size),
      cmocka_unit_test(test_unusable_struct_size_is_refused_before_the_request),
  };
  return cmocka_run_group_tests(tests, start_daemon, stop_daemon);
}
