/* The message bounds zd_msg_unpack enforces (proto/frame.c): payloads that
 * are not protobuf, enums out of range, job names outside their alphabet
 * or length, shapes with too many or zero dimensions or too many elements,
 * tensor counts, names and messages over their caps, placements outside
 * their unit, CUDA handles of the wrong size, payloads that need too much
 * memory to unpack and field numbers protobuf does not allow are each a
 * bad message, refused with a reason. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "frame.h"
#include "frame_fixtures.h"

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

/* zd_msg_unpack of msg packed as `type`, expecting rc; the message is freed
 * either way. */
static int unpack_packed(uint16_t type, const ProtobufCMessage *msg, const char **why) {
  size_t len;
  uint8_t *bytes = pack(msg, &len);
  ProtobufCMessage *out = (ProtobufCMessage *)1;
  int rc = zd_msg_unpack(type, bytes, len, &out, why);
  if (rc == 0)
    protobuf_c_message_free_unpacked(out, NULL);
  else
    assert_null(out);
  free(bytes);
  return rc;
}

/* ------------------------------------------------------------------------
 * Payloads that break the message bounds
 * ------------------------------------------------------------------------ */

static void test_garbage_payload_is_a_bad_message(void **state) {
  /* A truncated varint, a length running past the end, and an invalid wire
   * type. */
  const uint8_t garbage[][4] = {
      {0x08, 0xff, 0xff, 0xff}, {0x12, 0x7f, 'a', 'b'}, {0x0f, 0x00, 0x00, 0x00}};
  for (size_t i = 0; i < 3; i++) {
    ProtobufCMessage *out = (ProtobufCMessage *)1;
    const char *why;
    assert_int_equal(
        zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_ATTACH, garbage[i], sizeof garbage[i], &out, &why),
        -EBADMSG);
    assert_null(out);
    expect_why(why, "not a valid protobuf");
  }
}

static void test_out_of_range_enum_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  init_samples(&s);
  s.attach.mode = 7;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), -EBADMSG);
  expect_why(why, "attach mode");

  init_samples(&s);
  s.config.working_dtype = 9; /* nested one level down */
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), -EBADMSG);
  expect_why(why, "dtype");

  init_samples(&s);
  s.optimizer.kind = -1; /* two levels down, negative */
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, &s.attach_reply.base, &why),
                   -EBADMSG);
  expect_why(why, "optimizer kind");

  init_samples(&s);
  s.register_unit.init = 4;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "init mode");

  init_samples(&s);
  s.error.status = 11;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ERROR, &s.error.base, &why), -EBADMSG);
  expect_why(why, "status");

  init_samples(&s);
  s.register_unit_reply.grad_dtype = 100;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY,
                                 &s.register_unit_reply.base, &why),
                   -EBADMSG);
  expect_why(why, "dtype");
}

static void test_job_name_outside_its_alphabet_is_a_bad_message(void **state) {
  const char *bad[] = {"a/b", "../x", "job name", "job\n", "caf\xc3\xa9", ".", ".."};
  samples s;
  const char *why;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    init_samples(&s);
    s.attach.job = (char *)bad[i];
    if (unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why) != -EBADMSG)
      fail_msg("job name \"%s\" was accepted", bad[i]);
    expect_why(why, "job name");
  }
  init_samples(&s);
  s.attach.job = "Az09._-";
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), 0);
}

static void test_job_name_empty_or_over_64_bytes_is_a_bad_message(void **state) {
  char name[ZD_MAX_JOB_NAME_BYTES + 2];
  samples s;
  const char *why;
  init_samples(&s);
  s.attach.job = "";
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), -EBADMSG);
  expect_why(why, "empty");
  memset(name, 'j', sizeof name - 1);
  name[ZD_MAX_JOB_NAME_BYTES] = '\0';
  s.attach.job = name;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), 0);
  name[ZD_MAX_JOB_NAME_BYTES] = 'j';
  name[ZD_MAX_JOB_NAME_BYTES + 1] = '\0';
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), -EBADMSG);
  expect_why(why, "longer than 64");
}

static void test_too_many_dims_is_a_bad_message(void **state) {
  uint64_t shape[ZD_MAX_DIMS + 1] = {1, 2, 1, 2, 1, 2, 1, 2, 1};
  samples s;
  const char *why;
  init_samples(&s);
  s.weight.shape = shape;
  s.weight.n_shape = ZD_MAX_DIMS;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), 0);
  s.weight.n_shape = ZD_MAX_DIMS + 1;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "more than 8 dimensions");
  /* A scalar (no dims) is one element and fine. */
  s.weight.n_shape = 0;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), 0);
}

static void test_zero_dim_is_a_bad_message(void **state) {
  uint64_t shape[3] = {4, 0, 4};
  samples s;
  const char *why;
  init_samples(&s);
  s.bias.shape = shape;
  s.bias.n_shape = 3;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "zero-sized dimension");
}

static void test_more_than_2_to_48_elements_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  init_samples(&s);
  uint64_t at_cap[2] = {1ull << 24, 1ull << 24};
  uint64_t over[3] = {1ull << 24, 1ull << 24, 2};
  uint64_t wraps[2] = {1ull << 32, 1ull << 32}; /* 2^64: zero if it wrapped */
  s.weight.shape = at_cap;
  s.weight.n_shape = 2;
  s.register_unit.n_tensors = 1;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), 0);
  s.weight.shape = over;
  s.weight.n_shape = 3;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "more than 2^48");
  s.weight.shape = wraps;
  s.weight.n_shape = 2;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  /* Two tensors at the cap each: the unit is over it. */
  s.weight.shape = at_cap;
  s.bias.shape = at_cap;
  s.bias.n_shape = 2;
  s.register_unit.n_tensors = 2;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "unit has more than 2^48");
}

static void test_tensor_count_outside_1_to_4096_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  init_samples(&s);
  s.register_unit.n_tensors = 0;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "no tensors");

  Zerod__V1__TensorSpec **many = malloc(sizeof *many * (ZD_MAX_TENSORS_PER_UNIT + 1));
  for (size_t i = 0; i <= ZD_MAX_TENSORS_PER_UNIT; i++)
    many[i] = &s.bias;
  s.register_unit.tensors = many;
  s.register_unit.n_tensors = ZD_MAX_TENSORS_PER_UNIT;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), 0);
  s.register_unit.n_tensors = ZD_MAX_TENSORS_PER_UNIT + 1;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "more than 4096 tensors");
  free(many);
}

static void test_name_over_256_bytes_is_a_bad_message(void **state) {
  char name[ZD_MAX_NAME_BYTES + 2];
  memset(name, 'n', sizeof name - 1);
  name[ZD_MAX_NAME_BYTES] = '\0'; /* exactly at the cap */
  samples s;
  const char *why;
  init_samples(&s);
  s.register_unit.name = name;
  s.weight.name = name;
  s.attach.token = name;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), 0);
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), 0);
  name[ZD_MAX_NAME_BYTES] = 'n'; /* one over */
  name[ZD_MAX_NAME_BYTES + 1] = '\0';
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "unit name longer than 256");
  s.register_unit.name = "unit";
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "tensor name longer than 256");
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), -EBADMSG);
  expect_why(why, "token longer than 256");
}

static void test_empty_unit_or_tensor_name_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  init_samples(&s);
  s.register_unit.name = "";
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "unit name is empty");
  init_samples(&s);
  s.bias.name = "";
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "tensor name is empty");
}

static void test_error_message_over_1024_bytes_is_a_bad_message(void **state) {
  char text[ZD_MAX_MESSAGE_BYTES + 2];
  memset(text, 'e', sizeof text - 1);
  text[ZD_MAX_MESSAGE_BYTES + 1] = '\0';
  samples s;
  const char *why;
  init_samples(&s);
  s.error.message = text;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ERROR, &s.error.base, &why), -EBADMSG);
  expect_why(why, "1024");
  s.notice.message = text;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_NOTICE, &s.notice.base, &why), -EBADMSG);
  s.attach_reply.warning = text;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, &s.attach_reply.base, &why),
                   -EBADMSG);
  expect_why(why, "attach warning longer than 1024");
  text[ZD_MAX_MESSAGE_BYTES] = '\0';
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ERROR, &s.error.base, &why), 0);
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, &s.attach_reply.base, &why),
                   0);
}

static void test_tensor_placement_outside_its_unit_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  init_samples(&s);
  s.bias_at.offset = s.register_unit_reply.numel - 1023;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY,
                                 &s.register_unit_reply.base, &why),
                   -EBADMSG);
  expect_why(why, "outside the unit");
  init_samples(&s);
  s.bias_at.offset = UINT64_MAX;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY,
                                 &s.register_unit_reply.base, &why),
                   -EBADMSG);
  init_samples(&s);
  s.bias_at.numel = 1023;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY,
                                 &s.register_unit_reply.base, &why),
                   -EBADMSG);
  expect_why(why, "does not match its shape");
}

/* A GPU buffer's handles are read by CUDA at a fixed 64 bytes, so a reply
 * with another length (or an impossible device) never reaches a client. */
static void test_cuda_buffer_with_wrong_handle_sizes_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  uint8_t long_handle[ZD_CUDA_IPC_HANDLE_BYTES + 1] = {0};
  static const uint16_t types[] = {ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY,
                                   ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY};
  for (int t = 0; t < 2; t++) {
    init_samples(&s);
    const ProtobufCMessage *reply = t == 0 ? &s.gather_reply.base : &s.grad_buffer_reply.base;
    assert_int_equal(unpack_packed(types[t], reply, &why), 0);
    s.cuda.mem_handle.len = ZD_CUDA_IPC_HANDLE_BYTES - 1;
    assert_int_equal(unpack_packed(types[t], reply, &why), -EBADMSG);
    expect_why(why, "CUDA memory handle is not 64 bytes");
    init_samples(&s);
    s.cuda.event_handle.len = 0;
    assert_int_equal(unpack_packed(types[t], reply, &why), -EBADMSG);
    expect_why(why, "CUDA event handle is not 64 bytes");
    init_samples(&s);
    s.cuda.mem_handle.len = sizeof long_handle;
    s.cuda.mem_handle.data = long_handle;
    assert_int_equal(unpack_packed(types[t], reply, &why), -EBADMSG);
    init_samples(&s);
    s.cuda.device = -1;
    assert_int_equal(unpack_packed(types[t], reply, &why), -EBADMSG);
    expect_why(why, "CUDA device ordinal outside 0..1023");
    init_samples(&s);
    s.cuda.device = ZD_MAX_CUDA_DEVICE + 1;
    assert_int_equal(unpack_packed(types[t], reply, &why), -EBADMSG);
  }
}

/* A 2 MiB payload of a million empty tensors would cost protobuf-c about
 * 60 MiB of structs; the unpack budget stops it at 16 MiB. */
static void test_payload_needing_too_much_memory_is_a_bad_message(void **state) {
  size_t count = 1u << 20;
  uint8_t *payload = malloc(2 * count);
  for (size_t i = 0; i < count; i++) {
    payload[2 * i] = 0x12; /* field 2 (tensors), length-delimited */
    payload[2 * i + 1] = 0x00;
  }
  ProtobufCMessage *out;
  const char *why;
  assert_int_equal(
      zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, payload, 2 * count, &out, &why),
      -EBADMSG);
  expect_why(why, "16 MiB");
  free(payload);
}

/* Unknown fields are kept (a newer peer may send them), but only with
 * field numbers protobuf allows: an over-long encoding of field 0, or a
 * number past 2^29 - 1, would be packed again as some other field. */
static void test_field_number_zero_or_past_2_to_29_is_a_bad_message(void **state) {
  const uint8_t field_0[] = {0x80, 0x00, 0x01};
  const uint8_t field_2_to_29[] = {0x80, 0x80, 0x80, 0x80, 0x10, 0x01};
  const uint8_t field_100[] = {0xa0, 0x06, 0x01};
  ProtobufCMessage *out;
  const char *why;
  assert_int_equal(
      zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_GATHER, field_0, sizeof field_0, &out, &why),
      -EBADMSG);
  expect_why(why, "field number");
  assert_int_equal(zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_GATHER, field_2_to_29,
                                 sizeof field_2_to_29, &out, &why),
                   -EBADMSG);
  expect_why(why, "field number");
  assert_int_equal(
      zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_GATHER, field_100, sizeof field_100, &out, &why), 0);
  assert_int_equal(out->n_unknown_fields, 1);
  protobuf_c_message_free_unpacked(out, NULL);
}

static void test_empty_attach_payload_is_a_bad_message(void **state) {
  ProtobufCMessage *out;
  const char *why;
  assert_int_equal(zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_ATTACH, NULL, 0, &out, &why), -EBADMSG);
  expect_why(why, "job name is empty");
  assert_int_equal(zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_GATHER, NULL, 0, &out, &why), 0);
  protobuf_c_message_free_unpacked(out, NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_garbage_payload_is_a_bad_message),
      cmocka_unit_test(test_out_of_range_enum_is_a_bad_message),
      cmocka_unit_test(test_job_name_outside_its_alphabet_is_a_bad_message),
      cmocka_unit_test(test_job_name_empty_or_over_64_bytes_is_a_bad_message),
      cmocka_unit_test(test_too_many_dims_is_a_bad_message),
      cmocka_unit_test(test_zero_dim_is_a_bad_message),
      cmocka_unit_test(test_more_than_2_to_48_elements_is_a_bad_message),
      cmocka_unit_test(test_tensor_count_outside_1_to_4096_is_a_bad_message),
      cmocka_unit_test(test_name_over_256_bytes_is_a_bad_message),
      cmocka_unit_test(test_empty_unit_or_tensor_name_is_a_bad_message),
      cmocka_unit_test(test_error_message_over_1024_bytes_is_a_bad_message),
      cmocka_unit_test(test_tensor_placement_outside_its_unit_is_a_bad_message),
      cmocka_unit_test(test_cuda_buffer_with_wrong_handle_sizes_is_a_bad_message),
      cmocka_unit_test(test_payload_needing_too_much_memory_is_a_bad_message),
      cmocka_unit_test(test_field_number_zero_or_past_2_to_29_is_a_bad_message),
      cmocka_unit_test(test_empty_attach_payload_is_a_bad_message),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
