/* safetensors files (daemon/ckpt/ckpt_safetensors.c, st_units.c): files
 * written here read back (F32 exactly, BF16 rounded to nearest even),
 * files of other writers read as F16 and F64 and refuse integers,
 * malformed headers and sizes beyond the file are refused with a message
 * that says why; the units a job with none takes from a file are one per
 * module, in order. Every test works in its own directory under /tmp. */
#include <unistd.h>

#include "testutil.h"

#include "ckpt.h"
#include "ckpt_fixtures.h"
#include "ckpt_job.h"

/* ------------------------------------------------------------------------
 * safetensors
 * ------------------------------------------------------------------------ */

typedef struct fill_ctx {
  float *values[4];
  int fail_on; /* tensor index whose fill fails, or -1 */
} fill_ctx;

static int fill_values(void *arg, unsigned i, float *dst, uint64_t numel, char *err,
                       size_t err_bytes) {
  fill_ctx *ctx = arg;
  if ((int)i == ctx->fail_on) {
    snprintf(err, err_bytes, "no values for tensor %u", i);
    return -EIO;
  }
  memcpy(dst, ctx->values[i], (size_t)numel * 4);
  return 0;
}

static st_tensor st_spec(const char *name, st_dtype dtype, unsigned ndim, uint64_t d0,
                         uint64_t d1) {
  st_tensor t;
  memset(&t, 0, sizeof t);
  t.name = (char *)name;
  t.dtype = dtype;
  t.ndim = ndim;
  t.shape[0] = d0;
  t.shape[1] = d1;
  return t;
}

static void test_safetensors_write_then_read_round_trips(void **state) {
  char *dir = make_dir();
  char *path = path_in(dir, "model.safetensors");
  test_rng rng = {99};
  st_tensor specs[3] = {st_spec("w", ST_F32, 2, 300, 7), st_spec("b", ST_BF16, 1, 1001, 0),
                        st_spec("empty", ST_F32, 1, 0, 0)};
  fill_ctx ctx = {{xmalloc(2100 * 4), xmalloc(1001 * 4), xmalloc(4)}, -1};
  fill_normal(&rng, ctx.values[0], 2100, 3.0);
  fill_normal(&rng, ctx.values[1], 1001, 3.0);
  ctx.values[1][0] = 1.0f + 0x1p-8f; /* a tie: rounds to even (1.0) */
  ctx.values[1][1] = 1.0f + 0x3p-8f; /* a tie: rounds to even (1 + 2^-6) */
  ctx.values[1][2] = 3.4e38f;        /* rounds up to infinity */
  char err[512] = "";
  int rc = st_write(path, specs, 3, "{\"format\": \"pt\", \"source\": \"zerod\"}", fill_values,
                    &ctx, err, sizeof err);
  if (rc != 0)
    test_fail("st_write: %s", err);
  char *tmp = path_in(dir, "model.safetensors.tmp");
  assert_false(file_exists(tmp));
  free(tmp);

  /* The header is padded with spaces to a multiple of 8. */
  size_t len;
  uint8_t *raw = read_whole(path, &len);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; i--)
    header_len = header_len << 8 | raw[i];
  assert_int_equal(header_len % 8, 0);
  assert_true(8 + header_len + 2100 * 4 + 1001 * 2 == len);
  assert_int_equal(raw[0 + 8], '{');
  const char *metadata = "{\"__metadata__\":{\"format\":\"pt\",\"source\":\"zerod\"},";
  assert_memory_equal(raw + 8, metadata, strlen(metadata));
  free(raw);

  st_file f;
  int fd;
  rc = st_open(path, &f, &fd, err, sizeof err);
  if (rc != 0)
    test_fail("st_open: %s", err);
  assert_int_equal(f.ntensors, 3);
  assert_string_equal(f.tensors[0].name, "b"); /* sorted by name */
  assert_string_equal(f.tensors[1].name, "empty");
  assert_string_equal(f.tensors[2].name, "w");
  assert_true(f.data_start == 8 + header_len);
  assert_int_equal(f.data_start % 8, 0);
  const st_tensor *w = st_find(&f, "w"), *b = st_find(&f, "b");
  assert_non_null(w);
  assert_non_null(b);
  assert_null(st_find(&f, "c"));
  assert_string_equal(w->dtype_name, "F32");
  assert_int_equal(w->ndim, 2);
  assert_true(w->shape[0] == 300 && w->shape[1] == 7 && w->numel == 2100);
  assert_true(w->begin == 0 && w->end == 8400);
  assert_string_equal(b->dtype_name, "BF16");
  assert_true(b->begin == 8400 && b->end == 8400 + 2002);

  float *out = xmalloc(2100 * 4);
  assert_int_equal(st_read_f32(fd, &f, w, 0, 2100, out, err, sizeof err), 0);
  assert_memory_equal(out, ctx.values[0], 2100 * 4);
  assert_int_equal(st_read_f32(fd, &f, w, 1000, 1003, out, err, sizeof err), 0);
  assert_memory_equal(out, ctx.values[0] + 1000, 3 * 4);
  assert_int_equal(st_read_f32(fd, &f, b, 0, 1001, out, err, sizeof err), 0);
  for (size_t i = 0; i < 1001; i++) {
    float expect = ref_decode16(ref_encode16(ctx.values[1][i], 8, 7), 8, 7);
    if (f32_bits(out[i]) != f32_bits(expect))
      test_fail("bf16 element %zu of %.9g: expected %.9g, got %.9g", i, ctx.values[1][i], expect,
                out[i]);
  }
  assert_true(out[0] == 1.0f);
  assert_true(out[1] == 1.0f + 0x1p-6f);
  assert_true(isinf(out[2]));
  expect_error(st_read_f32(fd, &f, w, 2000, 2101, out, err, sizeof err), -ERANGE, err, "outside");
  close(fd);
  st_file_free(&f);
  free(out);
  for (int i = 0; i < 3; i++)
    free(ctx.values[i]);
  free(path);
  remove_dir(dir);
}

static void test_safetensors_write_refuses_bad_arguments(void **state) {
  char *dir = make_dir();
  char *path = path_in(dir, "x.safetensors");
  float v[4] = {1, 2, 3, 4};
  fill_ctx ctx = {{v, v, v, v}, -1};
  char err[512] = "";
  st_tensor dup[2] = {st_spec("a", ST_F32, 1, 4, 0), st_spec("a", ST_F32, 1, 4, 0)};
  expect_error(st_write(path, dup, 2, NULL, fill_values, &ctx, err, sizeof err), -EINVAL, err,
               "two tensors are named 'a'");
  st_tensor f16 = st_spec("h", ST_F16, 1, 4, 0);
  expect_error(st_write(path, &f16, 1, NULL, fill_values, &ctx, err, sizeof err), -EINVAL, err,
               "only F32 and BF16");
  st_tensor meta = st_spec("__metadata__", ST_F32, 1, 4, 0);
  expect_error(st_write(path, &meta, 1, NULL, fill_values, &ctx, err, sizeof err), -EINVAL, err,
               "__metadata__");
  st_tensor ok = st_spec("ok", ST_F32, 1, 4, 0);
  expect_error(st_write(path, &ok, 1, "{\"n\": 1}", fill_values, &ctx, err, sizeof err), -EINVAL,
               err, "is not a string");
  expect_error(st_write(path, &ok, 1, "[", fill_values, &ctx, err, sizeof err), -EINVAL, err,
               "metadata is not valid JSON");
  /* A failing fill keeps its message and leaves no file behind. */
  ctx.fail_on = 0;
  expect_error(st_write(path, &ok, 1, NULL, fill_values, &ctx, err, sizeof err), -EIO, err,
               "no values for tensor 0");
  assert_false(file_exists(path));
  char *tmp = path_in(dir, "x.safetensors.tmp");
  assert_false(file_exists(tmp));
  free(tmp);
  free(path);
  remove_dir(dir);
}

/* A file image from a header and data, as another writer made it. */
static void write_st_file(const char *path, const char *header, const void *data,
                          size_t data_bytes) {
  size_t header_len = strlen(header);
  uint8_t *image = xmalloc(8 + header_len + data_bytes);
  for (int i = 0; i < 8; i++)
    image[i] = (uint8_t)((uint64_t)header_len >> (8 * i));
  memcpy(image + 8, header, header_len);
  if (data_bytes > 0)
    memcpy(image + 8 + header_len, data, data_bytes);
  write_whole(path, image, 8 + header_len + data_bytes);
  free(image);
}

static void test_safetensors_reads_f16_and_f64_and_refuses_integers(void **state) {
  char *dir = make_dir();
  char *path = path_in(dir, "mixed.safetensors");
  uint8_t data[64];
  uint16_t halves[4] = {0x3c00, 0xc000, 0x0001, 0x7c00}; /* 1, -2, 2^-24, inf */
  double doubles[2] = {0.1, -1e300};
  int64_t ints[2] = {7, -7};
  memcpy(data, halves, 8);
  memcpy(data + 8, doubles, 16);
  memcpy(data + 24, ints, 16);
  write_st_file(path,
                "{\"h\":{\"dtype\":\"F16\",\"shape\":[2,2],\"data_offsets\":[0,8]},"
                "\"d\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[8,24]},"
                "\"i\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[24,40]},"
                "\"__metadata__\":{\"format\":\"pt\"}}",
                data, 40);
  st_file f;
  int fd;
  char err[512] = "";
  int rc = st_open(path, &f, &fd, err, sizeof err);
  if (rc != 0)
    test_fail("st_open: %s", err);
  float out[4];
  assert_int_equal(st_read_f32(fd, &f, st_find(&f, "h"), 0, 4, out, err, sizeof err), 0);
  assert_true(out[0] == 1.0f && out[1] == -2.0f && out[2] == 0x1p-24f && isinf(out[3]));
  assert_int_equal(st_read_f32(fd, &f, st_find(&f, "d"), 0, 2, out, err, sizeof err), 0);
  assert_true(out[0] == 0.1f && isinf(out[1]) && out[1] < 0);
  const st_tensor *i64 = st_find(&f, "i");
  assert_int_equal(i64->dtype, ST_OTHER);
  assert_string_equal(i64->dtype_name, "I64");
  expect_error(st_read_f32(fd, &f, i64, 0, 2, out, err, sizeof err), -EINVAL, err,
               "I64, which does not convert");
  /* A file cut short after its header was read: the read says so. */
  assert_int_equal(truncate(path, (off_t)f.data_start + 12), 0);
  expect_error(st_read_f32(fd, &f, st_find(&f, "d"), 0, 2, out, err, sizeof err), -ERANGE, err,
               "tensor 'd': file truncated");
  close(fd);
  st_file_free(&f);
  free(path);
  remove_dir(dir);
}

static void expect_header_rejected(const char *json, uint64_t data_bytes, int rc,
                                   const char *part) {
  st_file f;
  char err[512] = "";
  int got = st_header_decode(json, strlen(json), data_bytes, &f, err, sizeof err);
  if (got != rc)
    test_fail("header %s: expected %d, got %d (%s)", json, rc, got, err);
  expect_error(got, rc, err, part);
  assert_null(f.tensors);
  assert_int_equal(f.ntensors, 0);
}

#define T(name, dtype, shape, b, e)                                                                \
  "\"" name "\":{\"dtype\":\"" dtype "\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

static void test_safetensors_header_rejections(void **state) {
  expect_header_rejected("", 0, -EBADMSG, "not valid JSON");
  expect_header_rejected("[]", 0, -EBADMSG, "not a JSON object");
  expect_header_rejected("{\"a\": 5}", 0, -EBADMSG, "tensor 'a' is not an object");
  expect_header_rejected("{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 4, 12) "}", 12,
                         -EBADMSG, "overlaps tensor 'a'");
  expect_header_rejected("{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 12, 20) "}", 20,
                         -EBADMSG, "data bytes 8..12 before tensor 'b' belong to no tensor");
  expect_header_rejected("{" T("a", "F32", "[2]", 4, 12) "}", 12, -EBADMSG,
                         "data bytes 0..4 before tensor 'a'");
  expect_header_rejected("{" T("a", "F32", "[2]", 0, 8) "}", 9, -EBADMSG,
                         "data bytes 8..9 at the end belong to no tensor");
  expect_header_rejected("{}", 1, -EBADMSG, "at the end belong to no tensor");
  expect_header_rejected("{" T("a", "F32", "[2]", 0, 8) "}", 7, -ERANGE, "out of bounds");
  expect_header_rejected("{" T("a", "F32", "[2]", 8, 0) "}", 8, -EBADMSG, "begin <= end");
  expect_header_rejected("{" T("a", "Q4", "[2]", 0, 1) "}", 1, -EBADMSG, "unknown dtype \"Q4\"");
  expect_header_rejected("{" T("a", "F32", "[3]", 0, 8) "}", 8, -EBADMSG,
                         "hold 8 bytes, but 3 elements of F32 need 12");
  expect_header_rejected("{" T("a", "BF16", "[-1]", 0, 2) "}", 2, -EBADMSG,
                         "not a non-negative integer");
  expect_header_rejected("{" T("a", "U8", "[1,1,1,1,1,1,1,1,1]", 0, 1) "}", 1, -EBADMSG,
                         "at most 8 dimensions");
  expect_header_rejected("{" T("a", "F64", "[4294967296,4294967296,4294967296]", 0, 8) "}", 8,
                         -EBADMSG, "too many elements");
  expect_header_rejected("{" T("a", "F32", "[2]", 0, 8) "," T("a", "F32", "[2]", 8, 16) "}", 16,
                         -EBADMSG, "duplicate");
  expect_header_rejected("{" T("", "F32", "[2]", 0, 8) "}", 8, -EBADMSG, "empty name");
  expect_header_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],"
                         "\"extra\":1}}",
                         4, -EBADMSG, "unknown key \"extra\"");
  expect_header_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, -EBADMSG, "data_offsets");
  expect_header_rejected("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, -EBADMSG,
                         "no \"dtype\"");
  expect_header_rejected("{\"__metadata__\":{\"k\":1}}", 0, -EBADMSG, "is not a string");
  expect_header_rejected("{\"__metadata__\":[]}", 0, -EBADMSG, "is not an object");
  /* Accepted: metadata (or null), zero-size tensors, every dtype. */
  const char *good = "{\"__metadata__\":{\"a\":\"b\"}," T("z", "F32", "[0,5]", 0, 0) "," T(
      "u", "BOOL", "[3]", 0, 3) "," T("e4", "F8_E4M3", "[1]", 3, 4) "," T("q", "U16", "[]", 4,
                                                                          6) "}";
  st_file f;
  char err[512] = "";
  int rc = st_header_decode(good, strlen(good), 6, &f, err, sizeof err);
  if (rc != 0)
    test_fail("expected the header to decode: %s", err);
  assert_int_equal(f.ntensors, 4);
  assert_true(st_find(&f, "q")->numel == 1);
  assert_true(st_find(&f, "z")->numel == 0);
  assert_true(f.data_start == 8 + strlen(good));
  st_file_free(&f);
  const char *null_meta = "{\"__metadata__\":null}";
  assert_int_equal(st_header_decode(null_meta, strlen(null_meta), 0, &f, err, sizeof err), 0);
  assert_int_equal(f.ntensors, 0);
  st_file_free(&f);
}

static void test_safetensors_open_refuses_sizes_beyond_the_file(void **state) {
  char *dir = make_dir();
  char *path = path_in(dir, "bad.safetensors");
  st_file f;
  int fd = 0;
  char err[512] = "";
  write_whole(path, "\x10\0\0", 3);
  expect_error(st_open(path, &f, &fd, err, sizeof err), -ERANGE, err,
               "bad.safetensors: truncated: 3 bytes");
  assert_int_equal(fd, -1);
  /* A header size prefix larger than the rest of the file. */
  uint8_t image[24] = {100, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
  write_whole(path, image, sizeof image);
  expect_error(st_open(path, &f, &fd, err, sizeof err), -ERANGE, err,
               "header size 100 is larger than the file (24 bytes)");
  /* Larger than the cap, whatever the file's size. */
  uint8_t huge[8] = {0, 0, 0, 0x40, 0, 0, 0, 0};
  write_whole(path, huge, sizeof huge);
  expect_error(st_open(path, &f, &fd, err, sizeof err), -ERANGE, err, "more than the");
  /* A header whose offsets run past the data. */
  write_st_file(path, "{" T("a", "F32", "[4]", 0, 16) "}", "12345678", 8);
  expect_error(st_open(path, &f, &fd, err, sizeof err), -ERANGE, err,
               "bad.safetensors: tensor 'a'");
  expect_error(st_open("/nonexistent/x.safetensors", &f, &fd, err, sizeof err), -ENOENT, err,
               "x.safetensors");
  free(path);
  remove_dir(dir);
}

/* ------------------------------------------------------------------------
 * The units of a job with none (st_units_build)
 * ------------------------------------------------------------------------ */

/* What one unit made from a file should hold: its name, and its tensors'
 * names and shapes in order. */
typedef struct unit_want {
  const char *name;
  unsigned ntensors;
  const char *tensors[2];
  unsigned ndims[2];
  uint64_t shapes[2][2];
} unit_want;

/* Decodes a header (F32 tensors back to back in data_bytes) into f. */
static void decode_header(const char *json, uint64_t data_bytes, st_file *f) {
  char err[512] = "";
  int rc = st_header_decode(json, strlen(json), data_bytes, f, err, sizeof err);
  if (rc != 0)
    test_fail("header %s: %s", json, err);
}

/* Builds f's units for world ranks, checks them against want (names,
 * tensors, shapes; shards of world_size-consistent padding, tensors inside
 * the unit), and frees them. */
static void expect_units(const st_file *f, int world, const unit_want *want, unsigned nwant) {
  unit_layout **units = NULL;
  unsigned n = 0;
  char err[512] = "";
  int rc = st_units_build(f, world, &units, &n, err, sizeof err);
  if (rc != 0)
    test_fail("st_units_build: %d (%s)", rc, err);
  assert_non_null(units);
  assert_int_equal(n, nwant);
  for (unsigned u = 0; u < n; u++) {
    const unit_layout *l = units[u];
    assert_string_equal(l->name, want[u].name);
    assert_int_equal(l->ntensors, want[u].ntensors);
    for (unsigned t = 0; t < l->ntensors; t++) {
      const tensor_layout *tl = &l->tensors[t];
      assert_string_equal(tl->name, want[u].tensors[t]);
      assert_int_equal(tl->ndim, want[u].ndims[t]);
      uint64_t numel = 1;
      for (unsigned d = 0; d < tl->ndim; d++) {
        assert_true(tl->shape[d] == want[u].shapes[t][d]);
        numel *= tl->shape[d];
      }
      assert_true(tl->numel == numel);
      assert_true(tl->offset + tl->numel <= l->numel);
    }
    assert_true(l->padded_numel == l->shard_numel * (uint64_t)world);
    assert_true(l->padded_numel >= l->numel);
  }
  for (unsigned u = 0; u < n; u++)
    unit_layout_free(units[u]);
  free(units);
}

/* One unit per module (the name up to its last '.'), "<root>" for names
 * without a dot; units in the order of their modules' names, each unit's
 * tensors by name. */
static void test_st_units_are_one_per_module_in_name_order(void **state) {
  const char *json = "{" T("blocks.0.up.weight", "F32", "[4,3]", 0, 48) "," T(
      "blocks.0.up.bias", "F32", "[4]", 48, 64) "," T("embed.weight", "F32", "[10,4]", 64,
                                                      224) "," T("gain", "F32", "[]", 224, 228) "}";
  st_file f;
  decode_header(json, 228, &f);
  const unit_want want[] = {
      {"<root>", 1, {"gain"}, {0}, {{0}}},
      {"blocks.0.up", 2, {"blocks.0.up.bias", "blocks.0.up.weight"}, {1, 2}, {{4}, {4, 3}}},
      {"embed", 1, {"embed.weight"}, {2}, {{10, 4}}},
  };
  expect_units(&f, 3, want, 3);
  expect_units(&f, 1, want, 3);
  st_file_free(&f);
}

/* A submodule's tensors sort between its parent's ("a.bias" < "a.sub.w" <
 * "a.weight"): the parent's unit still holds both of its own. */
static void test_st_units_keep_a_module_whole_around_its_submodule(void **state) {
  const char *json = "{" T("a.bias", "F32", "[2]", 0, 8) "," T(
      "a.sub.w", "F32", "[3]", 8, 20) "," T("a.weight", "F32", "[2,2]", 20, 36) "}";
  st_file f;
  decode_header(json, 36, &f);
  const unit_want want[] = {
      {"a", 2, {"a.bias", "a.weight"}, {1, 2}, {{2}, {2, 2}}},
      {"a.sub", 1, {"a.sub.w"}, {1}, {{3}}},
  };
  expect_units(&f, 2, want, 2);
  st_file_free(&f);
}

/* A file with no tensors makes no units: refused, saying why, with
 * nothing in the outputs. */
static void test_st_units_refuse_a_file_without_tensors(void **state) {
  static const char *const empty[] = {"{}", "{\"__metadata__\":{\"format\":\"pt\"}}"};
  for (size_t i = 0; i < sizeof empty / sizeof empty[0]; i++) {
    st_file f;
    decode_header(empty[i], 0, &f);
    assert_int_equal(f.ntensors, 0);
    unit_layout **units = (unit_layout **)1;
    unsigned n = 7;
    char err[512] = "";
    int rc = st_units_build(&f, 2, &units, &n, err, sizeof err);
    assert_true(rc < 0);
    assert_true(err[0] != '\0');
    assert_null(units);
    assert_int_equal(n, 0);
    st_file_free(&f);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_safetensors_write_then_read_round_trips),
      cmocka_unit_test(test_safetensors_write_refuses_bad_arguments),
      cmocka_unit_test(test_safetensors_reads_f16_and_f64_and_refuses_integers),
      cmocka_unit_test(test_safetensors_header_rejections),
      cmocka_unit_test(test_safetensors_open_refuses_sizes_beyond_the_file),
      cmocka_unit_test(test_st_units_are_one_per_module_in_name_order),
      cmocka_unit_test(test_st_units_keep_a_module_whole_around_its_submodule),
      cmocka_unit_test(test_st_units_refuse_a_file_without_tensors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
