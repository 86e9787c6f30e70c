/* The checkpoint manifest and its model (daemon/ckpt/): shard file names,
 * the incremental hash, data offsets by unit and state; manifests survive
 * encode and decode exactly and byte for byte, and each validation rule
 * refuses what it should with a message that says where; store and load
 * through a directory. Shard files are test_ckpt_shard.c's, checkpoint
 * directories and export test_ckpt_source.c's, safetensors
 * test_ckpt_safetensors.c's, host buffers test_hostmem.c's. */
#include <jansson.h>

#include "testutil.h"

#include "ckpt.h"
#include "ckpt_fixtures.h"

/* ------------------------------------------------------------------------
 * Sample manifests
 * ------------------------------------------------------------------------ */

/* Two units for three ranks: shapes of several ranks, a gap between
 * tensors, a frozen tensor, and padding beyond the minimum. */
static const unit_spec sample_units[] = {
    {"embed", 1, {{"embed.weight", 2, {4, 6}, 0, 0}}, 0},
    {"block.0",
     3,
     {{"attn.w", 2, {5, 5}, 0, 0}, {"attn.b", 1, {5}, 3, 1}, {"scale", 0, {0}, 0, 0}},
     2},
};

static void sample_manifest(ckpt_manifest *m, int with_files) {
  build_manifest(m, 3, sample_units, 2, with_files);
}

/* The sample manifest's JSON, for tests that break one thing in it. */
static json_t *sample_json(int with_files) {
  ckpt_manifest m;
  sample_manifest(&m, with_files);
  size_t len;
  char *text = ckpt_manifest_encode(&m, &len);
  assert_non_null(text);
  json_error_t jerr;
  json_t *root = json_loadb(text, len, 0, &jerr);
  assert_non_null(root);
  free(text);
  ckpt_manifest_free(&m);
  return root;
}

static json_t *unit_of(json_t *root, size_t u) {
  return json_array_get(json_object_get(root, "units"), u);
}

static json_t *tensor_of(json_t *root, size_t u, size_t i) {
  return json_array_get(json_object_get(unit_of(root, u), "tensors"), i);
}

static json_t *file_of(json_t *root, size_t k) {
  return json_array_get(json_object_get(root, "files"), k);
}

/* Decodes root (which it frees) expecting rc and a message containing
 * part, and that nothing is left in the output. */
static void expect_rejected_with(json_t *root, int flags, int rc, const char *part) {
  char *text = json_dumps(root, JSON_COMPACT);
  assert_non_null(text);
  json_decref(root);
  ckpt_manifest m;
  char err[512] = "";
  int got = ckpt_manifest_decode(text, strlen(text), flags, &m, err, sizeof err);
  if (got != rc)
    test_fail("decoding %.300s: expected %d, got %d (\"%s\")", text, rc, got, err);
  free(text);
  expect_error(got, rc, err, part);
  assert_null(m.job);
  assert_null(m.units);
  assert_null(m.files);
  assert_int_equal(m.nunits, 0);
}

static void expect_rejected(json_t *root, const char *part) {
  expect_rejected_with(root, 0, -EBADMSG, part);
}

static void expect_accepted(json_t *root, int flags) {
  char *text = json_dumps(root, JSON_COMPACT);
  assert_non_null(text);
  json_decref(root);
  ckpt_manifest m;
  char err[512] = "";
  int rc = ckpt_manifest_decode(text, strlen(text), flags, &m, err, sizeof err);
  if (rc != 0)
    test_fail("expected %.300s to decode, got %d: %s", text, rc, err);
  free(text);
  ckpt_manifest_free(&m);
}

static void expect_text_rejected(const char *text, int rc, const char *part) {
  ckpt_manifest m;
  char err[512] = "";
  expect_error(ckpt_manifest_decode(text, strlen(text), 0, &m, err, sizeof err), rc, err, part);
  assert_null(m.units);
}

/* ------------------------------------------------------------------------
 * Hashing, names, the manifest's model
 * ------------------------------------------------------------------------ */

static void test_shard_names_are_zero_padded(void **state) {
  char name[40];
  ckpt_shard_name(3, 4, name, sizeof name);
  assert_string_equal(name, "rank-00003-of-00004.zdshard");
  ckpt_shard_name(4095, 4096, name, 32);
  assert_string_equal(name, "rank-04095-of-04096.zdshard");
}

static void test_incremental_hash_equals_one_shot_xxh64(void **state) {
  /* XXH64("", seed 0) is a published constant. */
  assert_true(ckpt_hash_once(NULL, 0) == 0xef46db3751d8e999ull);
  test_rng rng = {7};
  size_t len = 100003;
  uint8_t *bytes = xmalloc(len);
  for (size_t i = 0; i < len; i++)
    bytes[i] = (uint8_t)rng_next(&rng);
  ckpt_hash *h = ckpt_hash_new();
  assert_non_null(h);
  for (size_t at = 0, chunk = 1; at < len; at += chunk, chunk = chunk * 3 + 1) {
    size_t n = chunk < len - at ? chunk : len - at;
    ckpt_hash_update(h, bytes + at, n);
  }
  assert_true(ckpt_hash_digest(h) == ckpt_hash_once(bytes, len));
  ckpt_hash_free(h);
  free(bytes);
}

static void test_data_offsets_follow_units_then_states(void **state) {
  ckpt_manifest m;
  sample_manifest(&m, 1);
  /* embed: shard 8; block.0: 25 + gap 3 + 5 + a scalar = 34, shard 12 + 2 = 14. */
  assert_int_equal(ckpt_nstates(&m), 3);
  assert_true(m.units[0].shard_numel == 8);
  assert_true(m.units[1].shard_numel == 14);
  assert_true(m.units[1].numel == 34);
  assert_true(ckpt_shard_data_bytes(&m) == (8 + 14) * 4 * 3);
  assert_int_equal(ckpt_data_offset(&m, 0, CKPT_MASTER), 0);
  assert_int_equal(ckpt_data_offset(&m, 0, CKPT_MOMENT1), 32);
  assert_int_equal(ckpt_data_offset(&m, 0, CKPT_MOMENT2), 64);
  assert_int_equal(ckpt_data_offset(&m, 1, CKPT_MASTER), 96);
  assert_int_equal(ckpt_data_offset(&m, 1, CKPT_MOMENT2), 96 + 2 * 56);
  assert_int_equal(ckpt_data_offset(&m, 2, CKPT_MASTER), -1);
  /* 264 data bytes: one short block, so one table entry. */
  assert_true(ckpt_shard_file_bytes(&m) == CKPT_HEADER_BYTES + 264 + 8 + 8);
  m.has_moment1 = 0; /* moment2 moves up into moment1's place */
  assert_int_equal(ckpt_nstates(&m), 2);
  assert_int_equal(ckpt_data_offset(&m, 0, CKPT_MOMENT1), -1);
  assert_int_equal(ckpt_data_offset(&m, 0, CKPT_MOMENT2), 32);
  assert_int_equal(ckpt_data_offset(&m, 1, CKPT_MASTER), 64);
  ckpt_manifest_free(&m);
}

/* A compressing job's state (ckpt_feedback) follows every unit's states:
 * for each unit, its count of floats. */
static void test_feedback_follows_the_states(void **state) {
  ckpt_manifest m;
  sample_manifest(&m, 1);
  assert_int_equal(ckpt_feedback_offset(&m, 0), -1);
  uint64_t numel[2] = {16, 0};
  snprintf(m.feedback.kind, sizeof m.feedback.kind, "onebit");
  m.feedback.nodes = 3;
  m.feedback.numel = numel;
  assert_true(ckpt_shard_data_bytes(&m) == (8 + 14) * 4 * 3 + 16 * 4);
  assert_int_equal(ckpt_data_offset(&m, 1, CKPT_MOMENT2), 96 + 2 * 56); /* unmoved */
  assert_int_equal(ckpt_feedback_offset(&m, 0), (8 + 14) * 4 * 3);
  assert_int_equal(ckpt_feedback_offset(&m, 1), (8 + 14) * 4 * 3 + 16 * 4);
  assert_int_equal(ckpt_feedback_offset(&m, 2), -1);
  m.feedback.numel = NULL;
  ckpt_manifest_free(&m);
}

/* ------------------------------------------------------------------------
 * Manifest encoding and decoding
 * ------------------------------------------------------------------------ */

static void test_manifest_round_trips_exactly_and_byte_for_byte(void **state) {
  ckpt_manifest m, back;
  sample_manifest(&m, 1);
  size_t len, again_len;
  char *text = ckpt_manifest_encode(&m, &len);
  assert_non_null(text);
  assert_int_equal(strlen(text), len);
  char err[512] = "";
  int rc = ckpt_manifest_decode(text, len, 0, &back, err, sizeof err);
  if (rc != 0)
    test_fail("decode failed: %s", err);
  assert_manifests_equal(&m, &back);
  char *again = ckpt_manifest_encode(&back, &again_len);
  assert_non_null(again);
  assert_int_equal(len, again_len);
  assert_memory_equal(text, again, len);
  /* The integers beyond 2^53 are written as integers, digit for digit. */
  assert_non_null(strstr(text, "\"job_id\": 4611686018427400249"));
  assert_non_null(strstr(text, "\"step\": 9007199254740993"));
  assert_non_null(strstr(text, "\"xxh64\": \"fedcba9876543212\""));
  free(again);
  free(text);
  ckpt_manifest_free(&back);
  ckpt_manifest_free(&m);
}

static void test_manifest_encoding_is_deterministic(void **state) {
  ckpt_manifest a, b;
  sample_manifest(&a, 1);
  sample_manifest(&b, 1);
  size_t len_a, len_b;
  char *text_a = ckpt_manifest_encode(&a, &len_a), *text_b = ckpt_manifest_encode(&b, &len_b);
  assert_int_equal(len_a, len_b);
  assert_memory_equal(text_a, text_b, len_a);
  /* Keys in a fixed order: format first, files last. */
  assert_ptr_equal(strstr(text_a, "\"format\""), text_a + 4);
  assert_true(strstr(text_a, "\"units\"") < strstr(text_a, "\"files\""));
  free(text_a);
  free(text_b);
  ckpt_manifest_free(&a);
  ckpt_manifest_free(&b);
}

static void test_encode_refuses_values_json_cannot_hold(void **state) {
  ckpt_manifest m;
  size_t len;
  sample_manifest(&m, 1);
  m.step = (uint64_t)INT64_MAX + 1;
  assert_null(ckpt_manifest_encode(&m, &len));
  m.step = 1;
  m.config.lr = NAN;
  assert_null(ckpt_manifest_encode(&m, &len));
  ckpt_manifest_free(&m);
}

/* Version 2 added "tenant", the checkpoint's owner; version 1 manifests
 * (written before) still read, with no tenant, and a version 1 manifest
 * with a "tenant" is a malformed one, as a version 2 without it. */
static void test_manifest_tenant_by_version(void **state) {
  json_t *root = sample_json(1);
  assert_int_equal(json_integer_value(json_object_get(root, "format_version")), 3);
  assert_string_equal(json_string_value(json_object_get(root, "tenant")), "team-a.research_2");
  json_object_set_new(root, "format_version", json_integer(1));
  json_object_del(root, "tenant");
  char *text = json_dumps(root, JSON_COMPACT);
  json_decref(root);
  ckpt_manifest m;
  char err[512] = "";
  assert_int_equal(ckpt_manifest_decode(text, strlen(text), 0, &m, err, sizeof err), 0);
  assert_int_equal(m.format_version, 1);
  assert_string_equal(m.tenant, "");
  ckpt_manifest_free(&m);
  free(text);

  root = sample_json(1);
  json_object_set_new(root, "format_version", json_integer(1));
  expect_rejected(root, "unknown key \"tenant\"");
  root = sample_json(1);
  json_object_del(root, "tenant");
  expect_rejected(root, "\"tenant\"");
  root = sample_json(1);
  json_object_set_new(root, "tenant", json_string("team/../b"));
  expect_rejected(root, "\"tenant\" holds a character other than");
  root = sample_json(1);
  json_object_set_new(
      root, "tenant",
      json_string("t234567890123456789012345678901234567890123456789012345678901234x"));
  expect_rejected(root, "\"tenant\" is longer than 64 bytes");
  root = sample_json(1);
  json_object_set_new(root, "tenant", json_stringn("a\0b", 3));
  expect_rejected(root, "is not allowed"); /* jansson refuses \u0000 before we see it */
  root = sample_json(1);
  json_object_set_new(root, "tenant", json_string(""));
  expect_accepted(root, 0);

  /* The encoder refuses a tenant the decoder would. */
  sample_manifest(&m, 1);
  snprintf(m.tenant, sizeof m.tenant, "a b");
  size_t len;
  assert_null(ckpt_manifest_encode(&m, &len));
  ckpt_manifest_free(&m);
}

/* Version 3 added "feedback" (optional): a kind, a node count dividing the
 * world and a count per unit, unknown to a version 2 manifest. */
static json_t *feedback_json(const char *kind, json_int_t nodes, size_t ncounts) {
  json_t *fb = json_object(), *numel = json_array();
  for (size_t i = 0; i < ncounts; i++)
    json_array_append_new(numel, json_integer(40));
  json_object_set_new(fb, "kind", json_string(kind));
  json_object_set_new(fb, "nodes", json_integer(nodes));
  json_object_set_new(fb, "numel", numel);
  return fb;
}

static void test_manifest_feedback(void **state) {
  ckpt_manifest m, back;
  sample_manifest(&m, 0); /* the files' sizes are of no feedback */
  uint64_t *numel = calloc(2, sizeof *numel);
  numel[0] = 24;
  snprintf(m.feedback.kind, sizeof m.feedback.kind, "powersgd");
  m.feedback.nodes = 3;
  m.feedback.numel = numel;
  size_t len;
  char *text = ckpt_manifest_encode(&m, &len);
  assert_non_null(text);
  char err[512] = "";
  assert_int_equal(ckpt_manifest_decode(text, len, CKPT_DECODE_NO_FILES, &back, err, sizeof err),
                   0);
  assert_string_equal(back.feedback.kind, "powersgd");
  assert_int_equal(back.feedback.nodes, 3);
  assert_true(back.feedback.numel[0] == 24 && back.feedback.numel[1] == 0);
  ckpt_manifest_free(&back);
  free(text);
  ckpt_manifest_free(&m); /* frees numel */
  json_t *root = sample_json(1);
  assert_null(json_object_get(root, "feedback")); /* absent when none */
  json_object_set_new(root, "feedback", feedback_json("onebit", 2, 2));
  expect_rejected(root, "\"nodes\" 2 does not divide world_size 3");
  root = sample_json(1);
  json_object_set_new(root, "feedback", feedback_json("onebit", 0, 2));
  expect_rejected(root, "does not divide");
  root = sample_json(1);
  json_object_set_new(root, "feedback", feedback_json("onebit", 6, 2));
  expect_rejected(root, "\"nodes\" is 6, more than 3");
  root = sample_json(1);
  json_object_set_new(root, "feedback", feedback_json("topk", 3, 2));
  expect_rejected(root, "\"kind\" is not");
  root = sample_json(1);
  json_object_set_new(root, "feedback", feedback_json("onebit", 3, 1));
  expect_rejected(root, "one count per unit");
  /* The files' sizes then differ from what the feedback adds. */
  root = sample_json(1);
  json_object_set_new(root, "feedback", feedback_json("onebit", 3, 2));
  expect_rejected(root, "bytes");
  root = sample_json(1);
  json_object_set_new(root, "format_version", json_integer(2));
  json_object_set_new(root, "feedback", feedback_json("onebit", 1, 2));
  expect_rejected(root, "unknown key \"feedback\"");
}

static void test_decode_refuses_what_is_not_a_manifest(void **state) {
  expect_text_rejected("", -EBADMSG, "not valid JSON");
  expect_text_rejected("{\"format\": ", -EBADMSG, "not valid JSON");
  expect_text_rejected("[1, 2]", -EBADMSG, "not a JSON object");
  expect_text_rejected("{\"a\": 1, \"a\": 2}", -EBADMSG, "duplicate");
  json_t *root = sample_json(1);
  json_object_set_new(root, "format", json_string("safetensors"));
  expect_rejected(root, "\"format\" is not");
  root = sample_json(1);
  json_object_set_new(root, "format_version", json_integer(4));
  expect_rejected(root, "unsupported format_version 4");
  root = sample_json(1);
  json_object_set_new(root, "format_version", json_integer(0));
  expect_rejected(root, "unsupported format_version 0");
  /* A newer version is reported as such even with keys this one lacks. */
  root = sample_json(1);
  json_object_set_new(root, "format_version", json_integer(4));
  json_object_set_new(root, "encryption", json_string("aes"));
  expect_rejected(root, "unsupported format_version 4");
  /* Over the size cap: refused before parsing. */
  size_t huge = (size_t)CKPT_MAX_MANIFEST_BYTES + 1;
  char *big = xmalloc(huge);
  memset(big, ' ', huge);
  ckpt_manifest m;
  char err[256] = "";
  expect_error(ckpt_manifest_decode(big, huge, 0, &m, err, sizeof err), -ERANGE, err, "more than");
  free(big);
}

static void test_decode_refuses_missing_keys(void **state) {
  static const char *const top[] = {"format",     "format_version",  "job",    "job_id",
                                    "name",       "created_unix_ms", "step",   "version",
                                    "world_size", "config",          "states", "units",
                                    "files"};
  for (size_t i = 0; i < sizeof top / sizeof top[0]; i++) {
    json_t *root = sample_json(1);
    json_object_del(root, top[i]);
    char part[64];
    snprintf(part, sizeof part, "missing \"%s\"", top[i]);
    expect_rejected(root, part);
  }
  static const char *const config[] = {
      "optimizer", "lr",        "beta1",    "beta2",         "eps",          "weight_decay",
      "momentum",  "dampening", "nesterov", "working_dtype", "max_grad_norm"};
  for (size_t i = 0; i < sizeof config / sizeof config[0]; i++) {
    json_t *root = sample_json(1);
    json_object_del(json_object_get(root, "config"), config[i]);
    expect_rejected(root, "config: missing");
  }
  static const char *const unit[] = {"name", "numel", "padded_numel", "shard_numel", "tensors"};
  for (size_t i = 0; i < sizeof unit / sizeof unit[0]; i++) {
    json_t *root = sample_json(1);
    json_object_del(unit_of(root, 1), unit[i]);
    expect_rejected(root, "units[1]: missing");
  }
  static const char *const tensor[] = {"name", "shape", "offset", "frozen"};
  for (size_t i = 0; i < sizeof tensor / sizeof tensor[0]; i++) {
    json_t *root = sample_json(1);
    json_object_del(tensor_of(root, 1, 2), tensor[i]);
    expect_rejected(root, "units[1].tensors[2]: missing");
  }
  static const char *const file[] = {"name", "bytes", "xxh64"};
  for (size_t i = 0; i < sizeof file / sizeof file[0]; i++) {
    json_t *root = sample_json(1);
    json_object_del(file_of(root, 2), file[i]);
    expect_rejected(root, "files[2]: missing");
  }
}

static void test_decode_refuses_unknown_keys(void **state) {
  json_t *root = sample_json(1);
  json_object_set_new(root, "comment", json_string("hi"));
  expect_rejected(root, "manifest: unknown key \"comment\"");
  root = sample_json(1);
  json_object_set_new(json_object_get(root, "config"), "amsgrad", json_true());
  expect_rejected(root, "config: unknown key \"amsgrad\"");
  root = sample_json(1);
  json_object_set_new(unit_of(root, 0), "dtype", json_string("fp32"));
  expect_rejected(root, "units[0]: unknown key");
  root = sample_json(1);
  json_object_set_new(tensor_of(root, 0, 0), "stride", json_integer(1));
  expect_rejected(root, "units[0].tensors[0]: unknown key");
  root = sample_json(1);
  json_object_set_new(file_of(root, 0), "md5", json_string("x"));
  expect_rejected(root, "files[0]: unknown key");
}

static void test_decode_refuses_wrong_types(void **state) {
  json_t *root = sample_json(1);
  json_object_set_new(root, "job_id", json_string("7"));
  expect_rejected(root, "\"job_id\" is not an integer");
  root = sample_json(1);
  json_object_set_new(root, "step", json_real(3.0));
  expect_rejected(root, "\"step\" is not an integer");
  root = sample_json(1);
  json_object_set_new(root, "job", json_integer(5));
  expect_rejected(root, "\"job\" is not a string");
  root = sample_json(1);
  json_object_set_new(root, "created_unix_ms", json_true());
  expect_rejected(root, "\"created_unix_ms\" is not an integer");
  root = sample_json(1);
  json_object_set_new(root, "config", json_array());
  expect_rejected(root, "config: is not an object");
  root = sample_json(1);
  json_object_set_new(json_object_get(root, "config"), "lr", json_string("0.1"));
  expect_rejected(root, "\"lr\" is not a number");
  root = sample_json(1);
  json_object_set_new(json_object_get(root, "config"), "nesterov", json_integer(1));
  expect_rejected(root, "\"nesterov\" is not true or false");
  root = sample_json(1);
  json_object_set_new(root, "units", json_object());
  expect_rejected(root, "\"units\" is not a list");
  root = sample_json(1);
  json_array_set_new(json_object_get(root, "units"), 0, json_string("embed"));
  expect_rejected(root, "units[0]: is not an object");
  root = sample_json(1);
  json_object_set_new(tensor_of(root, 0, 0), "shape", json_integer(24));
  expect_rejected(root, "\"shape\" is not a list");
  root = sample_json(1);
  json_array_set_new(json_object_get(tensor_of(root, 0, 0), "shape"), 1, json_real(6.0));
  expect_rejected(root, "\"shape\"[1] is not a non-negative integer");
  root = sample_json(1);
  json_object_set_new(tensor_of(root, 0, 0), "frozen", json_null());
  expect_rejected(root, "\"frozen\" is not true or false");
  root = sample_json(1);
  json_object_set_new(file_of(root, 1), "xxh64", json_integer(17));
  expect_rejected(root, "\"xxh64\" is not a string");
  /* Config strings outside their sets. */
  root = sample_json(1);
  json_object_set_new(json_object_get(root, "config"), "optimizer", json_string("lion"));
  expect_rejected(root, "\"optimizer\" is not");
  root = sample_json(1);
  json_object_set_new(json_object_get(root, "config"), "working_dtype", json_string("fp8"));
  expect_rejected(root, "\"working_dtype\" is not");
}

static void test_decode_refuses_negative_numbers(void **state) {
  static const char *const top[] = {"job_id", "step", "version", "world_size", "format_version"};
  for (size_t i = 0; i < sizeof top / sizeof top[0]; i++) {
    json_t *root = sample_json(1);
    json_object_set_new(root, top[i], json_integer(-1));
    expect_rejected(root, "is negative");
  }
  static const char *const unit[] = {"numel", "padded_numel", "shard_numel"};
  for (size_t i = 0; i < sizeof unit / sizeof unit[0]; i++) {
    json_t *root = sample_json(1);
    json_object_set_new(unit_of(root, 0), unit[i], json_integer(-24));
    expect_rejected(root, "is negative");
  }
  json_t *root = sample_json(1);
  json_object_set_new(tensor_of(root, 1, 1), "offset", json_integer(-1));
  expect_rejected(root, "\"offset\" is negative");
  root = sample_json(1);
  json_array_set_new(json_object_get(tensor_of(root, 0, 0), "shape"), 0, json_integer(-4));
  expect_rejected(root, "not a non-negative integer");
  root = sample_json(1);
  json_object_set_new(file_of(root, 0), "bytes", json_integer(-4200));
  expect_rejected(root, "\"bytes\" is negative");
  /* created_unix_ms is signed: a date before 1970 is odd but valid. */
  root = sample_json(1);
  json_object_set_new(root, "created_unix_ms", json_integer(-5));
  expect_accepted(root, 0);
}

static void test_decode_refuses_world_size_outside_1_to_4096(void **state) {
  json_t *root = sample_json(0);
  json_object_set_new(root, "world_size", json_integer(0));
  expect_rejected_with(root, CKPT_DECODE_NO_FILES, -EBADMSG, "\"world_size\" is 0");
  root = sample_json(0);
  json_object_set_new(root, "world_size", json_integer(4097));
  expect_rejected_with(root, CKPT_DECODE_NO_FILES, -EBADMSG, "more than 4096");
}

static void test_decode_refuses_bad_names(void **state) {
  static const char *const bad_path_names[] = {"", ".", "..", "a/b", "../up", "/abs"};
  for (size_t i = 0; i < sizeof bad_path_names / sizeof bad_path_names[0]; i++) {
    json_t *root = sample_json(1);
    json_object_set_new(root, "job", json_string(bad_path_names[i]));
    expect_rejected(root, "\"job\"");
    root = sample_json(1);
    json_object_set_new(root, "name", json_string(bad_path_names[i]));
    expect_rejected(root, "\"name\"");
  }
  char long_name[300];
  memset(long_name, 'x', sizeof long_name);
  long_name[256] = '\0';
  json_t *root = sample_json(1);
  json_object_set_new(root, "job", json_string(long_name));
  expect_rejected(root, "longer than 255 bytes");
  long_name[256] = 'x';
  long_name[257] = '\0';
  root = sample_json(1);
  json_object_set_new(unit_of(root, 0), "name", json_string(long_name));
  expect_rejected(root, "longer than 256 bytes");
  root = sample_json(1);
  json_object_set_new(tensor_of(root, 1, 0), "name", json_string(""));
  expect_rejected(root, "units[1].tensors[0]: \"name\" is empty");
  /* A NUL inside a JSON string is refused by the parser already. */
  expect_text_rejected("{\"format\": \"zerod\\u0000-checkpoint\"}", -EBADMSG, "not valid JSON");
  /* Names unique in their scope. */
  root = sample_json(1);
  json_object_set_new(unit_of(root, 1), "name", json_string("embed"));
  expect_rejected(root, "two units are named \"embed\"");
  root = sample_json(1);
  json_object_set_new(tensor_of(root, 1, 2), "name", json_string("attn.w"));
  expect_rejected(root, "units[1]: two tensors are named \"attn.w\"");
  /* The same tensor name in two units is fine. */
  root = sample_json(1);
  json_object_set_new(tensor_of(root, 1, 0), "name", json_string("embed.weight"));
  expect_accepted(root, 0);
}

/* Unit and tensor names only label data (file names come from ranks), so
 * they take what the IPC protocol lets a worker register: any 1..256
 * bytes, '/' and ".." included. */
static void test_decode_accepts_every_name_the_protocol_registers(void **state) {
  char name256[257];
  memset(name256, 'y', 256);
  name256[256] = '\0';
  json_t *root = sample_json(1);
  json_object_set_new(tensor_of(root, 1, 0), "name", json_string("encoder/layer.0/w"));
  json_object_set_new(tensor_of(root, 1, 1), "name", json_string(".."));
  json_object_set_new(unit_of(root, 0), "name", json_string(name256));
  expect_accepted(root, 0);
}

static void test_decode_refuses_tensors_outside_or_across_each_other(void **state) {
  /* numel is the end of the last tensor. */
  json_t *root = sample_json(1);
  json_object_set_new(unit_of(root, 1), "numel", json_integer(35));
  expect_rejected(root, "but its last tensor ends at element 34");
  root = sample_json(1);
  json_object_set_new(tensor_of(root, 1, 2), "offset", json_integer(34));
  expect_rejected(root, "\"numel\" is 34");
  /* Overlap with the previous tensor, and out of offset order. */
  root = sample_json(1);
  json_object_set_new(tensor_of(root, 1, 1), "offset", json_integer(24));
  expect_rejected(root, "units[1].tensors[1]: starts at element 24, before the end");
  root = sample_json(1);
  json_object_set_new(tensor_of(root, 1, 0), "offset", json_integer(29));
  expect_rejected(root, "units[1].tensors[1]: starts at element 28");
  /* A zero-element tensor may sit right at the previous one's end. */
  root = sample_json(1);
  json_array_append_new(json_object_get(tensor_of(root, 1, 2), "shape"), json_integer(0));
  json_object_set_new(unit_of(root, 1), "numel", json_integer(33));
  expect_accepted(root, 0);
  /* More than 8 dimensions. */
  root = sample_json(1);
  json_t *shape = json_object_get(tensor_of(root, 0, 0), "shape");
  json_array_clear(shape);
  for (int d = 0; d < 9; d++)
    json_array_append_new(shape, json_integer(1));
  expect_rejected(root, "more than 8 dimensions");
}

static void test_decode_refuses_padding_that_is_not_shard_times_world(void **state) {
  json_t *root = sample_json(1);
  json_object_set_new(unit_of(root, 0), "padded_numel", json_integer(25));
  expect_rejected(root, "\"padded_numel\" 25 is not \"shard_numel\" 8 times world_size 3");
  root = sample_json(1);
  json_object_set_new(unit_of(root, 0), "shard_numel", json_integer(9));
  expect_rejected(root, "is not \"shard_numel\" 9");
  /* Consistent, but too small for the tensors. */
  root = sample_json(0);
  json_object_set_new(unit_of(root, 0), "shard_numel", json_integer(7));
  json_object_set_new(unit_of(root, 0), "padded_numel", json_integer(21));
  expect_rejected_with(root, CKPT_DECODE_NO_FILES, -EBADMSG, "is less than \"numel\" 24");
}

static void test_decode_refuses_wrong_files(void **state) {
  json_t *root = sample_json(1);
  json_array_remove(json_object_get(root, "files"), 2);
  expect_rejected(root, "files: has 2 entries for world_size 3");
  root = sample_json(1);
  json_object_set_new(file_of(root, 1), "name", json_string("rank-00002-of-00003.zdshard"));
  expect_rejected(root, "expected \"rank-00001-of-00003.zdshard\"");
  root = sample_json(1);
  json_object_set_new(file_of(root, 0), "name", json_string("../rank-00000-of-00003.zdshard"));
  expect_rejected(root, "files[0]: \"name\"");
  root = sample_json(1);
  json_object_set_new(file_of(root, 0), "bytes", json_integer(4096));
  expect_rejected(root, "but the units make a shard file of");
  static const char *const bad_hex[] = {"fedcba987654321", "FEDCBA9876543210", "fedcba98765432100",
                                        "fedcba987654321g", ""};
  for (size_t i = 0; i < sizeof bad_hex / sizeof bad_hex[0]; i++) {
    root = sample_json(1);
    json_object_set_new(file_of(root, 0), "xxh64", json_string(bad_hex[i]));
    expect_rejected(root, "16 lower-case hexadecimal digits");
  }
}

static void test_decode_refuses_states_out_of_order(void **state) {
  static const char *const bad[] = {"[]",
                                    "[\"moment1\"]",
                                    "[\"master\", \"moment2\", \"moment1\"]",
                                    "[\"master\", \"master\"]",
                                    "[\"master\", \"moment1\", \"moment1\"]",
                                    "[\"master\", \"moment3\"]",
                                    "\"master\"",
                                    "[\"master\", 1]"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    json_t *root = sample_json(0);
    json_object_set_new(root, "states", json_loads(bad[i], JSON_DECODE_ANY, NULL));
    expect_rejected_with(root, CKPT_DECODE_NO_FILES, -EBADMSG, "states");
  }
  /* Moments may be absent: SGD without momentum saves the master only. */
  static const char *const good[] = {"[\"master\"]", "[\"master\", \"moment2\"]"};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    json_t *root = sample_json(0);
    json_object_set_new(root, "states", json_loads(good[i], JSON_DECODE_ANY, NULL));
    expect_accepted(root, CKPT_DECODE_NO_FILES);
  }
}

static void test_decode_refuses_sizes_that_overflow(void **state) {
  /* Beyond int64: the parser refuses the integer. */
  json_t *root = sample_json(1);
  char *text = json_dumps(root, JSON_COMPACT);
  json_decref(root);
  char *at = strstr(text, "\"version\":42");
  assert_non_null(at);
  char *patched = xmalloc(strlen(text) + 32);
  sprintf(patched, "%.*s\"version\":18446744073709551616%s", (int)(at - text), text,
          at + strlen("\"version\":42"));
  expect_text_rejected(patched, -EBADMSG, "not valid JSON");
  free(patched);
  free(text);
  /* A shape whose product passes 2^64. */
  root = sample_json(1);
  json_t *shape = json_object_get(tensor_of(root, 0, 0), "shape");
  json_array_set_new(shape, 0, json_integer(INT64_MAX));
  json_array_set_new(shape, 1, json_integer(4));
  expect_rejected(root, "more than 2^64 elements");
  /* offset + numel past 2^64. */
  root = sample_json(1);
  json_object_set_new(tensor_of(root, 1, 2), "offset", json_integer(INT64_MAX));
  json_t *big_shape = json_object_get(tensor_of(root, 1, 2), "shape");
  json_array_append_new(big_shape, json_integer(INT64_MAX));
  json_array_append_new(big_shape, json_integer(2));
  expect_rejected(root, "offset + numel overflows");
  /* shard_numel * world_size past 2^64. */
  root = sample_json(1);
  json_object_set_new(unit_of(root, 0), "shard_numel", json_integer(INT64_MAX));
  json_object_set_new(unit_of(root, 0), "padded_numel", json_integer(INT64_MAX));
  expect_rejected(root, "is not \"shard_numel\"");
  /* Consistent units whose shard files would pass 2^63 bytes. */
  root = sample_json(0);
  json_object_set_new(root, "world_size", json_integer(1));
  uint64_t shard = (1ull << 61);
  json_object_set_new(unit_of(root, 0), "shard_numel", json_integer((json_int_t)shard));
  json_object_set_new(unit_of(root, 0), "padded_numel", json_integer((json_int_t)shard));
  expect_rejected_with(root, CKPT_DECODE_NO_FILES, -EBADMSG, "larger than 2^6");
}

static void test_layout_has_no_files_and_decodes_with_the_flag(void **state) {
  ckpt_manifest m, back;
  sample_manifest(&m, 0);
  size_t len;
  char *text = ckpt_manifest_encode(&m, &len);
  assert_non_null(text);
  assert_null(strstr(text, "\"files\""));
  char err[512] = "";
  expect_error(ckpt_manifest_decode(text, len, 0, &back, err, sizeof err), -EBADMSG, err,
               "missing \"files\"");
  assert_int_equal(ckpt_manifest_decode(text, len, CKPT_DECODE_NO_FILES, &back, err, sizeof err),
                   0);
  assert_manifests_equal(&m, &back);
  ckpt_manifest_free(&back);
  free(text);
  /* A complete manifest reads as a layout too, without its files. */
  ckpt_manifest full;
  sample_manifest(&full, 1);
  text = ckpt_manifest_encode(&full, &len);
  assert_int_equal(ckpt_manifest_decode(text, len, CKPT_DECODE_NO_FILES, &back, err, sizeof err),
                   0);
  assert_null(back.files);
  assert_manifests_equal(&m, &back);
  ckpt_manifest_free(&back);
  free(text);
  expect_error(ckpt_manifest_decode("{}", 2, 4, &back, err, sizeof err), -EINVAL, err, "flags");
  ckpt_manifest_free(&full);
  ckpt_manifest_free(&m);
}

static void test_manifest_store_then_load(void **state) {
  char *dir = make_dir();
  ckpt_manifest m, back, layout;
  sample_manifest(&m, 1);
  char err[512] = "";
  int rc = ckpt_manifest_store(dir, CKPT_MANIFEST_NAME, &m, err, sizeof err);
  if (rc != 0)
    test_fail("store: %s", err);
  assert_int_equal(ckpt_manifest_load(dir, CKPT_MANIFEST_NAME, 0, &back, err, sizeof err), 0);
  assert_manifests_equal(&m, &back);
  ckpt_manifest_free(&back);
  char *tmp = path_in(dir, CKPT_MANIFEST_NAME ".tmp");
  assert_false(file_exists(tmp));
  free(tmp);
  /* A layout: the same without files, under its own name. */
  free(m.files[0].name);
  free(m.files[1].name);
  free(m.files[2].name);
  free(m.files);
  m.files = NULL;
  assert_int_equal(ckpt_manifest_store(dir, CKPT_LAYOUT_NAME, &m, err, sizeof err), 0);
  assert_int_equal(
      ckpt_manifest_load(dir, CKPT_LAYOUT_NAME, CKPT_DECODE_NO_FILES, &layout, err, sizeof err), 0);
  assert_manifests_equal(&m, &layout);
  ckpt_manifest_free(&layout);
  /* A manifest that would not load is never written. */
  m.units[0].padded_numel++;
  expect_error(ckpt_manifest_store(dir, "bad.json", &m, err, sizeof err), -EBADMSG, err,
               "bad.json: units[0]");
  char *bad = path_in(dir, "bad.json");
  assert_false(file_exists(bad));
  free(bad);
  /* Missing and malformed files name themselves. */
  expect_error(ckpt_manifest_load(dir, "absent.json", 0, &back, err, sizeof err), -ENOENT, err,
               "absent.json: No such file");
  char *junk = path_in(dir, "junk.json");
  write_whole(junk, "{\"format\": 1}", 13);
  expect_error(ckpt_manifest_load(dir, "junk.json", 0, &back, err, sizeof err), -EBADMSG, err,
               "junk.json: manifest: \"format\" is not a string");
  free(junk);
  ckpt_manifest_free(&m);
  remove_dir(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_shard_names_are_zero_padded),
      cmocka_unit_test(test_incremental_hash_equals_one_shot_xxh64),
      cmocka_unit_test(test_data_offsets_follow_units_then_states),
      cmocka_unit_test(test_feedback_follows_the_states),
      cmocka_unit_test(test_manifest_round_trips_exactly_and_byte_for_byte),
      cmocka_unit_test(test_manifest_encoding_is_deterministic),
      cmocka_unit_test(test_encode_refuses_values_json_cannot_hold),
      cmocka_unit_test(test_decode_refuses_what_is_not_a_manifest),
      cmocka_unit_test(test_manifest_tenant_by_version),
      cmocka_unit_test(test_manifest_feedback),
      cmocka_unit_test(test_decode_refuses_missing_keys),
      cmocka_unit_test(test_decode_refuses_unknown_keys),
      cmocka_unit_test(test_decode_refuses_wrong_types),
      cmocka_unit_test(test_decode_refuses_negative_numbers),
      cmocka_unit_test(test_decode_refuses_world_size_outside_1_to_4096),
      cmocka_unit_test(test_decode_refuses_bad_names),
      cmocka_unit_test(test_decode_accepts_every_name_the_protocol_registers),
      cmocka_unit_test(test_decode_refuses_tensors_outside_or_across_each_other),
      cmocka_unit_test(test_decode_refuses_padding_that_is_not_shard_times_world),
      cmocka_unit_test(test_decode_refuses_wrong_files),
      cmocka_unit_test(test_decode_refuses_states_out_of_order),
      cmocka_unit_test(test_decode_refuses_sizes_that_overflow),
      cmocka_unit_test(test_layout_has_no_files_and_decodes_with_the_flag),
      cmocka_unit_test(test_manifest_store_then_load),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
