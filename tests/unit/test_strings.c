/* Strings from outside (proto/pbcheck.c): a NUL byte inside a string field,
 * or bytes that are not well-formed UTF-8, are refused in the wire bytes by
 * both decoders, the IPC protocol's zd_msg_unpack and the control plane's
 * ctl_decode (and ctl_decode_message, for what the coordinator sends a
 * node), at the top level, in nested messages and in repeated fields, with
 * a message that names the field and the byte; valid multi-byte UTF-8 and
 * bytes fields pass.
 *
 * protobuf-c packs a char * up to its NUL, so the messages are packed with
 * a marker of the same length in place of the bad bytes, which are then
 * written over the marker in the packed bytes. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ctl_decode.h"
#include "frame.h"
#include "pbcheck.h"
#include "rpc.h"

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

typedef struct packed {
  uint8_t *bytes;
  size_t len;
} packed;

static packed pack(const ProtobufCMessage *msg) {
  packed p = {.len = protobuf_c_message_get_packed_size(msg)};
  p.bytes = malloc(p.len ? p.len : 1);
  assert_non_null(p.bytes);
  protobuf_c_message_pack(msg, p.bytes);
  return p;
}

/* Writes `with` (marker's length, NULs allowed) over the first occurrence
 * of the text marker in p. */
static void replace(packed *p, const char *marker, const char *with) {
  size_t n = strlen(marker);
  for (size_t i = 0; i + n <= p->len; i++) {
    if (memcmp(p->bytes + i, marker, n) == 0) {
      memcpy(p->bytes + i, with, n);
      return;
    }
  }
  fail_msg("marker '%s' is not in the packed message", marker);
}

/* The bad strings every decoder must refuse, each the same length as its
 * marker "MARK", and the byte the message must name. */
typedef struct bad_string {
  const char *what;
  const char bytes[5];
  const char *problem; /* "contains a NUL byte" or "is not valid UTF-8" */
  size_t at;
} bad_string;

static const bad_string bad_strings[] = {
    {"NUL inside", "a\0bc", "contains a NUL byte", 1},
    {"NUL first", "\0abc", "contains a NUL byte", 0},
    {"overlong '/'",
     "a\xc0\xaf"
     "b",
     "is not valid UTF-8", 1},
    {"overlong 3-byte",
     "\xe0\x80\xaf"
     "a",
     "is not valid UTF-8", 0},
    {"surrogate U+D800",
     "\xed\xa0\x80"
     "a",
     "is not valid UTF-8", 0},
    {"above U+10FFFF", "\xf4\x90\x80\x80", "is not valid UTF-8", 0},
    {"truncated sequence", "ab\xe2\x82", "is not valid UTF-8", 2},
    {"stray continuation",
     "ab\x80"
     "c",
     "is not valid UTF-8", 2},
    {"0xff", "abc\xff", "is not valid UTF-8", 3},
};
#define N_BAD (sizeof bad_strings / sizeof bad_strings[0])

/* mark_at: where the marker starts in its string. */
static void expect_message(const char *got, const char *path, const char *type,
                           const bad_string *bad, size_t mark_at) {
  char want[256];
  if (strcmp(bad->problem, "contains a NUL byte") == 0)
    snprintf(want, sizeof want, "field '%s' of %s contains a NUL byte at byte %zu", path, type,
             mark_at + bad->at);
  else
    snprintf(want, sizeof want, "field '%s' of %s is not valid UTF-8 (at byte %zu)", path, type,
             mark_at + bad->at);
  if (got == NULL || strcmp(got, want) != 0)
    fail_msg("%s: expected \"%s\", got \"%s\"", bad->what, want, got != NULL ? got : "(null)");
}

/* ctl_decode of p as the request of `method`: refused with the message
 * naming path, for every bad string written over "MARK" (which starts at
 * byte mark_at of its string). */
static void expect_ctl_refusals(const ProtobufCMessage *msg, const char *method, const char *path,
                                size_t mark_at) {
  for (size_t b = 0; b < N_BAD; b++) {
    packed p = pack(msg);
    replace(&p, "MARK", bad_strings[b].bytes);
    ProtobufCMessage *out = NULL;
    char err[512] = "";
    assert_int_equal(ctl_decode(method, p.bytes, p.len, &out, err, sizeof err),
                     RPC_INVALID_ARGUMENT);
    assert_null(out);
    expect_message(err, path, msg->descriptor->name, &bad_strings[b], mark_at);
    free(p.bytes);
  }
}

/* zd_msg_unpack of msg as `type`, likewise. */
static void expect_ipc_refusals(const ProtobufCMessage *msg, uint16_t type, const char *path,
                                size_t mark_at) {
  for (size_t b = 0; b < N_BAD; b++) {
    packed p = pack(msg);
    replace(&p, "MARK", bad_strings[b].bytes);
    ProtobufCMessage *out = NULL;
    const char *why = NULL;
    assert_int_equal(zd_msg_unpack(type, p.bytes, p.len, &out, &why), -EBADMSG);
    assert_null(out);
    expect_message(why, path, msg->descriptor->name, &bad_strings[b], mark_at);
    free(p.bytes);
  }
}

/* ------------------------------------------------------------------------
 * UTF-8
 * ------------------------------------------------------------------------ */

static void test_utf8_rules(void **state) {
  (void)state;
  static const struct {
    const char *s;
    size_t invalid_at;
  } cases[] = {
      {"", 0},
      {"plain ascii", 11},
      {"caf\xc3\xa9", 5},
      {"\xe2\x82\xac", 3},     /* U+20AC */
      {"\xf0\x9f\x98\x80", 4}, /* U+1F600 */
      {"\xf4\x8f\xbf\xbf", 4}, /* U+10FFFF, the last code point */
      {"\xed\x9f\xbf", 3},     /* U+D7FF, below the surrogates */
      {"\xee\x80\x80", 3},     /* U+E000, above them */
      {"a\xc0\x80", 1},        /* overlong NUL */
      {"\xc1\xbf", 0},         /* overlong */
      {"\xe0\x9f\xbf", 0},     /* overlong 3-byte */
      {"\xf0\x8f\xbf\xbf", 0}, /* overlong 4-byte */
      {"\xed\xa0\x80", 0},     /* U+D800 */
      {"\xed\xbf\xbf", 0},     /* U+DFFF */
      {"\xf4\x90\x80\x80", 0}, /* U+110000 */
      {"\xf5\x80\x80\x80", 0}, /* no such lead byte */
      {"ok\xe2\x82", 2},       /* truncated */
      {"ok\xe2\x82x", 2},      /* continuation missing */
      {"\x80", 0},             /* stray continuation */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    size_t len = strlen(cases[i].s);
    size_t at = zd_utf8_invalid_at(cases[i].s, len);
    if (at != cases[i].invalid_at)
      fail_msg("case %zu: first invalid byte at %zu, expected %zu", i, at, cases[i].invalid_at);
    assert_int_equal(zd_utf8_valid(cases[i].s, len), at == len);
  }
}

static void test_utf8_sanitize_replaces_only_bad_bytes(void **state) {
  (void)state;
  char s[] = "caf\xc3\xa9 \xff \xed\xa0\x80 cut \xe2\x82";
  zd_utf8_sanitize(s);
  assert_string_equal(s, "caf\xc3\xa9 ? ??? cut ??");
}

/* ------------------------------------------------------------------------
 * The walker
 * ------------------------------------------------------------------------ */

static void test_walker_accepts_valid_multibyte_strings_and_any_bytes(void **state) {
  (void)state;
  /* A Put's value is bytes: NULs and anything else are its business. */
  Zerod__V1__PutRequest put = ZEROD__V1__PUT_REQUEST__INIT;
  put.job = "j";
  put.key = "cl\xc3\xa9/\xe2\x82\xac/\xf0\x9f\x98\x80";
  uint8_t value[] = {0, 0xff, 0xc0, 0x80, 0xed, 0xa0, 0x80, 0};
  put.value.data = value;
  put.value.len = sizeof value;
  packed p = pack(&put.base);
  char err[256];
  assert_int_equal(zd_pb_check_strings(put.base.descriptor, p.bytes, p.len, err, sizeof err), 0);
  ProtobufCMessage *out = NULL;
  assert_int_equal(ctl_decode(CTL_PUT, p.bytes, p.len, &out, err, sizeof err), 0);
  const Zerod__V1__PutRequest *got = (const Zerod__V1__PutRequest *)out;
  assert_string_equal(got->key, put.key);
  assert_int_equal(got->value.len, sizeof value);
  ctl_free(out);
  free(p.bytes);
  /* Empty input is the message with every default. */
  assert_int_equal(zd_pb_check_strings(put.base.descriptor, NULL, 0, err, sizeof err), 0);
}

static void test_walker_refuses_malformed_wire_data(void **state) {
  (void)state;
  static const struct {
    const char *what;
    uint8_t bytes[8];
    size_t len;
  } cases[] = {
      {"length past the end", {0x0a, 0x05, 'a', 'b'}, 4},
      {"truncated tag", {0x80}, 1},
      {"truncated varint", {0x10, 0x80, 0x80}, 3},
      {"truncated fixed64", {0x11, 1, 2, 3}, 4},
      {"truncated fixed32", {0x15, 1, 2}, 3},
      {"start group", {0x0b}, 1},
      {"wire type 7", {0x0f}, 1},
      {"one-byte tag of field 0", {0x02, 0x00}, 2},
      {"six-byte length", {0x0a, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00}, 7},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char err[256] = "";
    int rc = zd_pb_check_strings(&zerod__v1__get_job_request__descriptor, cases[i].bytes,
                                 cases[i].len, err, sizeof err);
    if (rc != -EBADMSG)
      fail_msg("%s: rc %d, expected -EBADMSG", cases[i].what, rc);
    assert_string_equal(err, "zerod.v1.GetJobRequest does not decode");
    /* ctl_decode says what it said before there was a string check. */
    ProtobufCMessage *out = NULL;
    assert_int_equal(ctl_decode(CTL_GET_JOB, cases[i].bytes, cases[i].len, &out, err, sizeof err),
                     RPC_INVALID_ARGUMENT);
    assert_string_equal(err, "request is not a valid zerod.v1.GetJobRequest message");
  }
}

static void test_walker_skips_unknown_fields_and_packed_scalars(void **state) {
  (void)state;
  /* Field 9 (unknown to GetJobRequest) holds a NUL: kept as unknown bytes,
   * never read as a string, so not refused by the walker. */
  const uint8_t unknown[] = {0x0a, 0x01, 'a', 0x4a, 0x03, 'x', 0x00, 'y'};
  char err[256];
  assert_int_equal(zd_pb_check_strings(&zerod__v1__get_job_request__descriptor, unknown,
                                       sizeof unknown, err, sizeof err),
                   0);
  /* TensorSpec.shape packed (field 2, wire type 2) with a 0 byte in it. */
  Zerod__V1__TensorSpec spec = ZEROD__V1__TENSOR_SPEC__INIT;
  uint64_t shape[] = {0, 128, 1};
  spec.name = "w";
  spec.n_shape = 3;
  spec.shape = shape;
  packed p = pack(&spec.base);
  assert_int_equal(zd_pb_check_strings(spec.base.descriptor, p.bytes, p.len, err, sizeof err), 0);
  free(p.bytes);
}

/* A message type that holds itself, so that nesting has no end in the
 * schema: the walk stops at ZD_PB_MAX_DEPTH. */
static const ProtobufCMessageDescriptor nest_descriptor;
static const ProtobufCFieldDescriptor nest_fields[] = {
    {"child", 1, PROTOBUF_C_LABEL_NONE, PROTOBUF_C_TYPE_MESSAGE, 0, 0, &nest_descriptor, NULL, 0, 0,
     NULL, NULL},
};
static const unsigned nest_field_indices[] = {0};
static const ProtobufCIntRange nest_ranges[] = {{1, 0}, {0, 1}};
static const ProtobufCMessageDescriptor nest_descriptor = {PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC,
                                                           "test.Nest",
                                                           "Nest",
                                                           "Nest",
                                                           "test",
                                                           sizeof(ProtobufCMessage),
                                                           1,
                                                           nest_fields,
                                                           nest_field_indices,
                                                           1,
                                                           nest_ranges,
                                                           NULL,
                                                           NULL,
                                                           NULL,
                                                           NULL};

static void test_walker_limits_nesting(void **state) {
  (void)state;
  /* Messages nested `levels` deep: 0x0a <len> repeated, innermost empty. */
  for (int levels = ZD_PB_MAX_DEPTH - 2; levels <= ZD_PB_MAX_DEPTH + 2; levels++) {
    uint8_t bytes[2 * (ZD_PB_MAX_DEPTH + 2)];
    size_t len = 2 * (size_t)levels;
    for (int k = 0; k < levels; k++) {
      bytes[2 * k] = 0x0a;
      bytes[2 * k + 1] = (uint8_t)(len - 2 * (size_t)k - 2);
    }
    char err[256] = "";
    int rc = zd_pb_check_strings(&nest_descriptor, bytes, len, err, sizeof err);
    /* The top message is level 0: ZD_PB_MAX_DEPTH levels in all. */
    if (levels < ZD_PB_MAX_DEPTH) {
      assert_int_equal(rc, 0);
    } else {
      assert_int_equal(rc, -ELOOP);
      assert_string_equal(err, "test.Nest nests messages deeper than 32");
    }
  }
}

/* ------------------------------------------------------------------------
 * The control plane (ctl_decode)
 * ------------------------------------------------------------------------ */

static void test_ctl_refuses_bad_top_level_strings(void **state) {
  (void)state;
  Zerod__V1__GetJobRequest get = ZEROD__V1__GET_JOB_REQUEST__INIT;
  get.name = "MARK";
  expect_ctl_refusals(&get.base, CTL_GET_JOB, "name", 0);
  Zerod__V1__DeleteJobRequest del = ZEROD__V1__DELETE_JOB_REQUEST__INIT;
  del.name = "MARK";
  expect_ctl_refusals(&del.base, CTL_DELETE_JOB, "name", 0);
  Zerod__V1__ExportRequest exp = ZEROD__V1__EXPORT_REQUEST__INIT;
  exp.job = "j";
  exp.path = "/tmp/x.safetensorsMARK";
  expect_ctl_refusals(&exp.base, CTL_EXPORT, "path", 18);
  Zerod__V1__CreateJobRequest create = ZEROD__V1__CREATE_JOB_REQUEST__INIT;
  create.name = "ok";
  create.nodes = 1;
  create.ranks_per_node = 1;
  create.token = "MARK";
  expect_ctl_refusals(&create.base, CTL_CREATE_JOB, "token", 0);
}

/* The example, word for word. */
static void test_ctl_names_the_field_of_a_nul_in_a_job_name(void **state) {
  (void)state;
  Zerod__V1__GetJobRequest get = ZEROD__V1__GET_JOB_REQUEST__INIT;
  get.name = "aXb";
  packed p = pack(&get.base);
  replace(&p, "aXb", "a\0b");
  ProtobufCMessage *out = NULL;
  char err[512];
  assert_int_equal(ctl_decode(CTL_GET_JOB, p.bytes, p.len, &out, err, sizeof err),
                   RPC_INVALID_ARGUMENT);
  assert_string_equal(err, "field 'name' of zerod.v1.GetJobRequest contains a NUL byte at byte 1");
  free(p.bytes);
}

static void test_ctl_refuses_bad_strings_in_nested_and_repeated_fields(void **state) {
  (void)state;
  Zerod__V1__Device devices[3];
  Zerod__V1__Device *device_list[3];
  for (int i = 0; i < 3; i++) {
    zerod__v1__device__init(&devices[i]);
    devices[i].kind = "cpu";
    devices[i].name = i == 2 ? "MARK" : "h\xc3\xb6st"; /* valid 2-byte UTF-8 elsewhere */
    device_list[i] = &devices[i];
  }
  Zerod__V1__NodeInfo node = ZEROD__V1__NODE_INFO__INIT;
  node.name = "n0";
  node.address = "127.0.0.1";
  node.ranks = 1;
  node.n_devices = 3;
  node.devices = device_list;
  Zerod__V1__JoinRequest join = ZEROD__V1__JOIN_REQUEST__INIT;
  join.node = &node;
  expect_ctl_refusals(&join.base, CTL_JOIN, "node.devices[2].name", 0);

  /* A repeated string: the index is the one of the bad element. */
  char *names[] = {"n0", "n1", "MARK"};
  Zerod__V1__CreateJobRequest create = ZEROD__V1__CREATE_JOB_REQUEST__INIT;
  create.name = "j";
  create.nodes = 3;
  create.ranks_per_node = 1;
  create.n_node_names = 3;
  create.node_names = names;
  expect_ctl_refusals(&create.base, CTL_CREATE_JOB, "node_names[2]", 0);

  /* Two levels of repeated messages: jobs[1].saves[0].error. */
  Zerod__V1__ShardReport report = ZEROD__V1__SHARD_REPORT__INIT;
  report.error = "disk MARK";
  Zerod__V1__ShardReport *reports[] = {&report};
  Zerod__V1__JobStatus jobs[2];
  Zerod__V1__JobStatus *job_list[] = {&jobs[0], &jobs[1]};
  zerod__v1__job_status__init(&jobs[0]);
  zerod__v1__job_status__init(&jobs[1]);
  jobs[0].job = "a";
  jobs[1].job = "b";
  jobs[1].n_saves = 1;
  jobs[1].saves = reports;
  Zerod__V1__HeartbeatRequest beat = ZEROD__V1__HEARTBEAT_REQUEST__INIT;
  beat.node = "n0";
  beat.n_jobs = 2;
  beat.jobs = job_list;
  expect_ctl_refusals(&beat.base, CTL_HEARTBEAT, "jobs[1].saves[0].error", 5);
}

static void test_ctl_accepts_valid_multibyte_utf8(void **state) {
  (void)state;
  Zerod__V1__Device device = ZEROD__V1__DEVICE__INIT;
  Zerod__V1__Device *devices[] = {&device};
  device.kind = "cpu";
  device.name = "\xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf caf\xc3\xa9";
  Zerod__V1__NodeInfo node = ZEROD__V1__NODE_INFO__INIT;
  node.name = "n0";
  node.address = "h\xc3\xb6st.example";
  node.ranks = 1;
  node.version = "0.1.0 \xce\xb1";
  node.n_devices = 1;
  node.devices = devices;
  Zerod__V1__JoinRequest join = ZEROD__V1__JOIN_REQUEST__INIT;
  join.node = &node;
  packed p = pack(&join.base);
  ProtobufCMessage *out = NULL;
  char err[512] = "";
  if (ctl_decode(CTL_JOIN, p.bytes, p.len, &out, err, sizeof err) != 0)
    fail_msg("valid UTF-8 refused: %s", err);
  const Zerod__V1__JoinRequest *got = (const Zerod__V1__JoinRequest *)out;
  assert_string_equal(got->node->devices[0]->name, device.name);
  ctl_free(out);
  free(p.bytes);
}

/* What the coordinator sends a node is checked the same way. */
static void test_watch_event_with_a_bad_job_name_is_refused(void **state) {
  (void)state;
  Zerod__V1__Job job = ZEROD__V1__JOB__INIT;
  job.name = "aXzzz";
  Zerod__V1__Assignment assignments[2];
  Zerod__V1__Assignment *list[] = {&assignments[0], &assignments[1]};
  zerod__v1__assignment__init(&assignments[0]);
  zerod__v1__assignment__init(&assignments[1]);
  assignments[0].token = "t";
  assignments[1].job = &job;
  Zerod__V1__WatchEvent ev = ZEROD__V1__WATCH_EVENT__INIT;
  ev.n_assignments = 2;
  ev.assignments = list;
  packed p = pack(&ev.base);
  ProtobufCMessage *out = NULL;
  char err[512];
  assert_int_equal(ctl_decode_message(&zerod__v1__watch_event__descriptor, p.bytes, p.len, &out,
                                      err, sizeof err),
                   0);
  ctl_free(out);
  replace(&p, "aXzzz", "a\0zzz");
  assert_int_equal(ctl_decode_message(&zerod__v1__watch_event__descriptor, p.bytes, p.len, &out,
                                      err, sizeof err),
                   -EBADMSG);
  assert_null(out);
  assert_string_equal(err, "field 'assignments[1].job.name' of zerod.v1.WatchEvent contains a NUL "
                           "byte at byte 1");
  /* Not a message at all. */
  const uint8_t junk[] = {0x12, 0x7f};
  assert_int_equal(ctl_decode_message(&zerod__v1__watch_event__descriptor, junk, sizeof junk, &out,
                                      err, sizeof err),
                   -EBADMSG);
  assert_string_equal(err, "not a valid zerod.v1.WatchEvent message");
  /* An unknown field numbered 0 (a zero tag in two bytes, which protobuf-c
   * takes but would pack as the one-byte zero tag it refuses), as
   * ctl_decode refuses it in requests; found by fuzz_control. */
  const uint8_t field_zero[] = {0x80, 0x00, 0x00};
  assert_int_equal(ctl_decode_message(&zerod__v1__watch_event__descriptor, field_zero,
                                      sizeof field_zero, &out, err, sizeof err),
                   -EBADMSG);
  assert_null(out);
  assert_string_equal(err, "not a valid zerod.v1.WatchEvent message");
  free(p.bytes);
}

/* ------------------------------------------------------------------------
 * The IPC protocol (zd_msg_unpack)
 * ------------------------------------------------------------------------ */

static void test_ipc_refuses_bad_strings_in_attach(void **state) {
  (void)state;
  Zerod__V1__AttachRequest attach = ZEROD__V1__ATTACH_REQUEST__INIT;
  attach.protocol_version = 1;
  attach.job = "MARK";
  attach.token = "tok";
  expect_ipc_refusals(&attach.base, ZEROD__V1__MSG_TYPE__MSG_ATTACH, "job", 0);
  attach.job = "job";
  attach.token = "MARK";
  expect_ipc_refusals(&attach.base, ZEROD__V1__MSG_TYPE__MSG_ATTACH, "token", 0);
}

static void test_ipc_refuses_bad_strings_in_nested_and_repeated_fields(void **state) {
  (void)state;
  Zerod__V1__TensorSpec specs[3];
  Zerod__V1__TensorSpec *list[3];
  uint64_t shape[] = {4};
  for (int i = 0; i < 3; i++) {
    zerod__v1__tensor_spec__init(&specs[i]);
    specs[i].name = i == 1 ? "MARK" : "w\xc3\xa9ight";
    specs[i].n_shape = 1;
    specs[i].shape = shape;
    list[i] = &specs[i];
  }
  Zerod__V1__RegisterUnitRequest reg = ZEROD__V1__REGISTER_UNIT_REQUEST__INIT;
  reg.name = "unit";
  reg.n_tensors = 3;
  reg.tensors = list;
  expect_ipc_refusals(&reg.base, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, "tensors[1].name", 0);
  /* Replies are checked too: libzerod decodes them with zd_msg_unpack. */
  Zerod__V1__Error error = ZEROD__V1__ERROR__INIT;
  error.message = "no such MARK";
  expect_ipc_refusals(&error.base, ZEROD__V1__MSG_TYPE__MSG_ERROR, "message", 8);
}

static void test_ipc_accepts_valid_multibyte_utf8(void **state) {
  (void)state;
  Zerod__V1__TensorSpec spec = ZEROD__V1__TENSOR_SPEC__INIT;
  Zerod__V1__TensorSpec *list[] = {&spec};
  uint64_t shape[] = {2, 3};
  spec.name = "\xce\xb8.\xe2\x88\x87.\xf0\x9f\x98\x80";
  spec.n_shape = 2;
  spec.shape = shape;
  Zerod__V1__RegisterUnitRequest reg = ZEROD__V1__REGISTER_UNIT_REQUEST__INIT;
  reg.name = "unit \xc3\xa9";
  reg.n_tensors = 1;
  reg.tensors = list;
  packed p = pack(&reg.base);
  ProtobufCMessage *out = NULL;
  const char *why = NULL;
  if (zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, p.bytes, p.len, &out, &why) != 0)
    fail_msg("valid UTF-8 refused: %s", why);
  const Zerod__V1__RegisterUnitRequest *got = (const Zerod__V1__RegisterUnitRequest *)out;
  assert_string_equal(got->tensors[0]->name, spec.name);
  protobuf_c_message_free_unpacked(out, NULL);
  free(p.bytes);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_utf8_rules),
      cmocka_unit_test(test_utf8_sanitize_replaces_only_bad_bytes),
      cmocka_unit_test(test_walker_accepts_valid_multibyte_strings_and_any_bytes),
      cmocka_unit_test(test_walker_refuses_malformed_wire_data),
      cmocka_unit_test(test_walker_skips_unknown_fields_and_packed_scalars),
      cmocka_unit_test(test_walker_limits_nesting),
      cmocka_unit_test(test_ctl_refuses_bad_top_level_strings),
      cmocka_unit_test(test_ctl_names_the_field_of_a_nul_in_a_job_name),
      cmocka_unit_test(test_ctl_refuses_bad_strings_in_nested_and_repeated_fields),
      cmocka_unit_test(test_ctl_accepts_valid_multibyte_utf8),
      cmocka_unit_test(test_watch_event_with_a_bad_job_name_is_refused),
      cmocka_unit_test(test_ipc_refuses_bad_strings_in_attach),
      cmocka_unit_test(test_ipc_refuses_bad_strings_in_nested_and_repeated_fields),
      cmocka_unit_test(test_ipc_accepts_valid_multibyte_utf8),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
