/* The checkpoint formats (daemon/ckpt.c, daemon/ckpt_safetensors.c):
 * manifests survive encode and decode exactly and byte for byte, and each
 * validation rule refuses what it should with a message that says where;
 * shard files written in any chunk sizes read back exactly, and every kind
 * of damage (a data, header or table byte, a short or long file) is caught
 * and named; a checkpoint directory reads by element ranges across rank
 * files and exports to safetensors; safetensors files written here read
 * back, and malformed headers are refused. Every test works in its own
 * directory under /tmp. */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "testutil.h"

#include "ckpt.h"
#include "hostmem.h"
#include "zk.h"

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

static char *make_dir(void) {
  char *dir = strdup("/tmp/test_ckpt.XXXXXX");
  assert_non_null(dir);
  assert_non_null(mkdtemp(dir));
  return dir;
}

/* Removes dir and the files in it (the tests make no subdirectories). */
static void remove_dir(char *dir) {
  DIR *d = opendir(dir);
  assert_non_null(d);
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    assert_int_equal(unlink(path), 0);
  }
  closedir(d);
  assert_int_equal(rmdir(dir), 0);
  free(dir);
}

static char *path_in(const char *dir, const char *file) {
  char *path = xmalloc(strlen(dir) + strlen(file) + 2);
  sprintf(path, "%s/%s", dir, file);
  return path;
}

static int file_exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

static uint64_t file_size(const char *path) {
  struct stat st;
  assert_int_equal(stat(path, &st), 0);
  return (uint64_t)st.st_size;
}

static uint8_t *read_whole(const char *path, size_t *len) {
  *len = (size_t)file_size(path);
  uint8_t *bytes = xmalloc(*len);
  int fd = open(path, O_RDONLY);
  assert_true(fd >= 0);
  assert_int_equal(pread(fd, bytes, *len, 0), (ssize_t)*len);
  close(fd);
  return bytes;
}

static void write_whole(const char *path, const void *bytes, size_t len) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, bytes, len), (ssize_t)len);
  close(fd);
}

static void flip_byte(const char *path, uint64_t offset) {
  int fd = open(path, O_RDWR);
  assert_true(fd >= 0);
  uint8_t b;
  assert_int_equal(pread(fd, &b, 1, (off_t)offset), 1);
  b ^= 0x10;
  assert_int_equal(pwrite(fd, &b, 1, (off_t)offset), 1);
  close(fd);
}

static void expect_error(int rc, int expect_rc, const char *err, const char *part) {
  if (rc != expect_rc)
    test_fail("expected %d (%s), got %d: \"%s\"", expect_rc, strerror(-expect_rc), rc, err);
  if (strstr(err, part) == NULL)
    test_fail("expected an error message containing \"%s\", got \"%s\"", part, err);
}

/* ------------------------------------------------------------------------
 * Sample manifests
 * ------------------------------------------------------------------------ */

typedef struct tensor_spec {
  const char *name;
  unsigned ndim;
  uint64_t shape[3];
  uint64_t gap_before; /* unused elements before it in the unit */
  int frozen;
} tensor_spec;

typedef struct unit_spec {
  const char *name;
  unsigned ntensors;
  tensor_spec tensors[3];
  uint64_t extra_shard_numel; /* beyond ceil(numel / world) */
} unit_spec;

/* Two units for three ranks: shapes of several ranks, a gap between
 * tensors, a frozen tensor, and padding beyond the minimum. */
static const unit_spec sample_units[] = {
    {"embed", 1, {{"embed.weight", 2, {4, 6}, 0, 0}}, 0},
    {"block.0",
     3,
     {{"attn.w", 2, {5, 5}, 0, 0}, {"attn.b", 1, {5}, 3, 1}, {"scale", 0, {0}, 0, 0}},
     2},
};

static char *xstrdup(const char *s) {
  char *copy = strdup(s);
  assert_non_null(copy);
  return copy;
}

/* A manifest as the coordinator would build one, every string malloc'd so
 * that ckpt_manifest_free frees it. */
static void build_manifest(ckpt_manifest *m, uint32_t world, const unit_spec *specs,
                           unsigned nunits, int with_files) {
  memset(m, 0, sizeof *m);
  m->format_version = CKPT_MANIFEST_VERSION;
  m->job = xstrdup("llama-7b.run_3");
  m->job_id = (1ull << 62) + 12345; /* beyond a double's 2^53 */
  snprintf(m->tenant, sizeof m->tenant, "team-a.research_2");
  m->name = xstrdup("step-9007199254740993");
  m->created_unix_ms = 1700000000123;
  m->step = 9007199254740993ull; /* 2^53 + 1 */
  m->version = 42;
  m->world_size = world;
  snprintf(m->config.optimizer, sizeof m->config.optimizer, "adamw");
  m->config.lr = 0.1; /* not exact in binary: must still come back bit for bit */
  m->config.beta1 = 0.9;
  m->config.beta2 = 0.999;
  m->config.eps = 1e-8;
  m->config.weight_decay = 0.01;
  m->config.momentum = 0;
  m->config.dampening = -0.0;
  m->config.nesterov = 1;
  snprintf(m->config.working_dtype, sizeof m->config.working_dtype, "bf16");
  m->config.max_grad_norm = 1.0 / 3.0;
  m->has_moment1 = 1;
  m->has_moment2 = 1;
  m->nunits = nunits;
  m->units = calloc(nunits, sizeof *m->units);
  assert_non_null(m->units);
  for (unsigned u = 0; u < nunits; u++) {
    const unit_spec *spec = &specs[u];
    ckpt_unit *unit = &m->units[u];
    unit->name = xstrdup(spec->name);
    unit->ntensors = spec->ntensors;
    unit->tensors = calloc(spec->ntensors, sizeof *unit->tensors);
    assert_non_null(unit->tensors);
    uint64_t at = 0;
    for (unsigned i = 0; i < spec->ntensors; i++) {
      const tensor_spec *ts = &spec->tensors[i];
      ckpt_tensor *t = &unit->tensors[i];
      t->name = xstrdup(ts->name);
      t->ndim = ts->ndim;
      t->numel = 1;
      for (unsigned d = 0; d < ts->ndim; d++) {
        t->shape[d] = ts->shape[d];
        t->numel *= ts->shape[d];
      }
      at += ts->gap_before;
      t->offset = at;
      t->frozen = ts->frozen;
      at += t->numel;
    }
    unit->numel = at;
    unit->shard_numel = (at + world - 1) / world + spec->extra_shard_numel;
    unit->padded_numel = unit->shard_numel * world;
  }
  if (with_files) {
    m->files = calloc(world, sizeof *m->files);
    assert_non_null(m->files);
    for (uint32_t k = 0; k < world; k++) {
      char name[40];
      ckpt_shard_name(k, world, name, sizeof name);
      m->files[k].name = xstrdup(name);
      m->files[k].bytes = ckpt_shard_file_bytes(m);
      m->files[k].xxh64 = 0xfedcba9876543210ull + k;
    }
  }
}

static void sample_manifest(ckpt_manifest *m, int with_files) {
  build_manifest(m, 3, sample_units, 2, with_files);
}

static void assert_doubles_identical(double a, double b) {
  uint64_t x, y;
  memcpy(&x, &a, sizeof x);
  memcpy(&y, &b, sizeof y);
  if (x != y)
    test_fail("expected %.17g (bits %016llx), got %.17g (bits %016llx)", a, (unsigned long long)x,
              b, (unsigned long long)y);
}

static void assert_manifests_equal(const ckpt_manifest *a, const ckpt_manifest *b) {
  assert_int_equal(a->format_version, b->format_version);
  assert_string_equal(a->job, b->job);
  assert_true(a->job_id == b->job_id);
  assert_string_equal(a->tenant, b->tenant);
  assert_string_equal(a->name, b->name);
  assert_true(a->created_unix_ms == b->created_unix_ms);
  assert_true(a->step == b->step);
  assert_true(a->version == b->version);
  assert_int_equal(a->world_size, b->world_size);
  assert_string_equal(a->config.optimizer, b->config.optimizer);
  assert_doubles_identical(a->config.lr, b->config.lr);
  assert_doubles_identical(a->config.beta1, b->config.beta1);
  assert_doubles_identical(a->config.beta2, b->config.beta2);
  assert_doubles_identical(a->config.eps, b->config.eps);
  assert_doubles_identical(a->config.weight_decay, b->config.weight_decay);
  assert_doubles_identical(a->config.momentum, b->config.momentum);
  assert_doubles_identical(a->config.dampening, b->config.dampening);
  assert_int_equal(a->config.nesterov, b->config.nesterov);
  assert_string_equal(a->config.working_dtype, b->config.working_dtype);
  assert_doubles_identical(a->config.max_grad_norm, b->config.max_grad_norm);
  assert_int_equal(a->has_moment1, b->has_moment1);
  assert_int_equal(a->has_moment2, b->has_moment2);
  assert_int_equal(a->nunits, b->nunits);
  for (unsigned u = 0; u < a->nunits; u++) {
    const ckpt_unit *x = &a->units[u], *y = &b->units[u];
    assert_string_equal(x->name, y->name);
    assert_true(x->numel == y->numel);
    assert_true(x->padded_numel == y->padded_numel);
    assert_true(x->shard_numel == y->shard_numel);
    assert_int_equal(x->ntensors, y->ntensors);
    for (unsigned i = 0; i < x->ntensors; i++) {
      const ckpt_tensor *s = &x->tensors[i], *t = &y->tensors[i];
      assert_string_equal(s->name, t->name);
      assert_int_equal(s->ndim, t->ndim);
      for (unsigned d = 0; d < s->ndim; d++)
        assert_true(s->shape[d] == t->shape[d]);
      assert_true(s->numel == t->numel);
      assert_true(s->offset == t->offset);
      assert_int_equal(s->frozen, t->frozen);
    }
  }
  assert_int_equal(a->files == NULL, b->files == NULL);
  for (uint32_t k = 0; a->files != NULL && k < a->world_size; k++) {
    assert_string_equal(a->files[k].name, b->files[k].name);
    assert_true(a->files[k].bytes == b->files[k].bytes);
    assert_true(a->files[k].xxh64 == b->files[k].xxh64);
  }
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
  assert_int_equal(json_integer_value(json_object_get(root, "format_version")), 2);
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

static void test_decode_refuses_what_is_not_a_manifest(void **state) {
  expect_text_rejected("", -EBADMSG, "not valid JSON");
  expect_text_rejected("{\"format\": ", -EBADMSG, "not valid JSON");
  expect_text_rejected("[1, 2]", -EBADMSG, "not a JSON object");
  expect_text_rejected("{\"a\": 1, \"a\": 2}", -EBADMSG, "duplicate");
  json_t *root = sample_json(1);
  json_object_set_new(root, "format", json_string("safetensors"));
  expect_rejected(root, "\"format\" is not");
  root = sample_json(1);
  json_object_set_new(root, "format_version", json_integer(3));
  expect_rejected(root, "unsupported format_version 3");
  root = sample_json(1);
  json_object_set_new(root, "format_version", json_integer(0));
  expect_rejected(root, "unsupported format_version 0");
  /* A newer version is reported as such even with keys this one lacks. */
  root = sample_json(1);
  json_object_set_new(root, "format_version", json_integer(3));
  json_object_set_new(root, "encryption", json_string("aes"));
  expect_rejected(root, "unsupported format_version 3");
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

/* ------------------------------------------------------------------------
 * Shard files
 * ------------------------------------------------------------------------ */

#define MIB (1u << 20)

static uint8_t *random_bytes(size_t len, uint64_t seed) {
  test_rng rng = {seed};
  uint8_t *bytes = xmalloc(len);
  for (size_t i = 0; i < len; i++)
    bytes[i] = (uint8_t)(rng_next(&rng) >> 24);
  return bytes;
}

static ckpt_shard_header shard_header(uint32_t rank, uint32_t world, uint64_t data_bytes) {
  ckpt_shard_header h = {
      .rank = rank, .world_size = world, .job_id = 77, .step = 1000, .data_bytes = data_bytes};
  return h;
}

/* Writes data in chunks of the given sizes, cycling through them. */
static void write_shard(const char *path, const ckpt_shard_header *h, const uint8_t *data,
                        const size_t *chunks, size_t nchunks, uint64_t *file_bytes,
                        uint64_t *file_xxh64) {
  ckpt_writer *w;
  char err[512] = "";
  int rc = ckpt_writer_open(path, h, &w, err, sizeof err);
  if (rc != 0)
    test_fail("writer_open: %s", err);
  for (uint64_t at = 0, i = 0; at < h->data_bytes; i++) {
    size_t n = chunks[i % nchunks];
    if (n > h->data_bytes - at)
      n = (size_t)(h->data_bytes - at);
    assert_int_equal(ckpt_writer_write(w, data + at, n, err, sizeof err), 0);
    at += n;
  }
  rc = ckpt_writer_finish(w, file_bytes, file_xxh64, err, sizeof err);
  if (rc != 0)
    test_fail("writer_finish: %s", err);
}

/* A 2.5 MiB shard file (two whole blocks and a half) in dir. */
typedef struct shard_fixture {
  char *dir, *path;
  uint8_t *data;
  uint64_t data_bytes, file_bytes, xxh64;
  ckpt_shard_header header;
} shard_fixture;

static void make_shard(shard_fixture *f) {
  static const size_t chunks[] = {1, 7, 4093, 65537, MIB + 3, 13};
  f->dir = make_dir();
  f->path = path_in(f->dir, "rank-00001-of-00004.zdshard");
  f->data_bytes = 2 * MIB + MIB / 2;
  f->data = random_bytes((size_t)f->data_bytes, 11);
  f->header = shard_header(1, 4, f->data_bytes);
  write_shard(f->path, &f->header, f->data, chunks, 6, &f->file_bytes, &f->xxh64);
}

static void free_shard(shard_fixture *f) {
  free(f->data);
  free(f->path);
  remove_dir(f->dir);
}

static int open_shard(const shard_fixture *f, ckpt_reader **r, char *err, size_t err_bytes) {
  return ckpt_reader_open(f->path, f->file_bytes, &f->header, r, err, err_bytes);
}

static void test_shard_written_in_odd_chunks_reads_back(void **state) {
  shard_fixture f;
  make_shard(&f);
  /* header + data + 3 table entries + footer */
  assert_true(f.file_bytes == CKPT_HEADER_BYTES + f.data_bytes + 3 * 8 + 8);
  assert_true(file_size(f.path) == f.file_bytes);
  struct stat st;
  assert_int_equal(stat(f.path, &st), 0);
  assert_int_equal(st.st_mode & 0777, 0600);
  size_t len;
  uint8_t *whole = read_whole(f.path, &len);
  assert_true(ckpt_hash_once(whole, len) == f.xxh64);
  assert_memory_equal(whole, "ZDSHARD\0", 8);
  assert_memory_equal(whole + CKPT_HEADER_BYTES, f.data, (size_t)f.data_bytes);
  free(whole);

  ckpt_reader *r;
  char err[512] = "";
  assert_int_equal(open_shard(&f, &r, err, sizeof err), 0);
  const ckpt_shard_header *h = ckpt_reader_header(r);
  assert_int_equal(h->rank, 1);
  assert_int_equal(h->world_size, 4);
  assert_true(h->job_id == 77 && h->step == 1000 && h->data_bytes == f.data_bytes);
  uint8_t *out = xmalloc((size_t)f.data_bytes);
  /* Ranges inside a block, across block boundaries, whole blocks, the
   * short tail, empty, and everything. */
  const uint64_t ranges[][2] = {{0, 1},
                                {5, 4096},
                                {MIB - 3, 7},
                                {MIB, MIB},
                                {MIB / 2, 2 * MIB},
                                {2 * MIB + 100, MIB / 2 - 100},
                                {f.data_bytes, 0},
                                {0, f.data_bytes}};
  for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
    memset(out, 0xa5, (size_t)ranges[i][1]);
    int rc = ckpt_reader_read(r, ranges[i][0], out, (size_t)ranges[i][1], err, sizeof err);
    if (rc != 0)
      test_fail("read of %llu bytes at %llu: %s", (unsigned long long)ranges[i][1],
                (unsigned long long)ranges[i][0], err);
    assert_memory_equal(out, f.data + ranges[i][0], (size_t)ranges[i][1]);
  }
  expect_error(ckpt_reader_read(r, f.data_bytes - 3, out, 4, err, sizeof err), -ERANGE, err,
               "past the end");
  expect_error(ckpt_reader_read(r, UINT64_MAX, out, 1, err, sizeof err), -ERANGE, err,
               "past the end");
  free(out);
  ckpt_reader_close(r);

  ckpt_file_entry entry = {
      .name = "rank-00001-of-00004.zdshard", .bytes = f.file_bytes, .xxh64 = f.xxh64};
  int rc = ckpt_file_verify(f.dir, &entry, err, sizeof err);
  if (rc != 0)
    test_fail("verify: %s", err);
  free_shard(&f);
}

static void test_shard_without_data_has_an_empty_table(void **state) {
  char *dir = make_dir();
  char *path = path_in(dir, "rank-00000-of-00001.zdshard");
  ckpt_shard_header h = shard_header(0, 1, 0);
  uint64_t bytes, xxh;
  write_shard(path, &h, NULL, (size_t[]){1}, 1, &bytes, &xxh);
  assert_true(bytes == CKPT_HEADER_BYTES + 8);
  ckpt_reader *r;
  char err[512] = "";
  assert_int_equal(ckpt_reader_open(path, bytes, &h, &r, err, sizeof err), 0);
  assert_int_equal(ckpt_reader_read(r, 0, NULL, 0, err, sizeof err), 0);
  ckpt_reader_close(r);
  ckpt_file_entry entry = {.name = "rank-00000-of-00001.zdshard", .bytes = bytes, .xxh64 = xxh};
  assert_int_equal(ckpt_file_verify(dir, &entry, err, sizeof err), 0);
  free(path);
  remove_dir(dir);
}

static void test_writer_refuses_more_data_than_the_header_says(void **state) {
  char *dir = make_dir();
  char *path = path_in(dir, "rank-00000-of-00002.zdshard");
  ckpt_shard_header h = shard_header(0, 2, 100);
  ckpt_writer *w;
  char err[512] = "";
  uint8_t data[101] = {0};
  assert_int_equal(ckpt_writer_open(path, &h, &w, err, sizeof err), 0);
  assert_int_equal(ckpt_writer_write(w, data, 60, err, sizeof err), 0);
  expect_error(ckpt_writer_write(w, data, 41, err, sizeof err), -ERANGE, err,
               "rank-00000-of-00002.zdshard: 41 more bytes");
  /* The refused write changed nothing: the rest still fits. */
  assert_int_equal(ckpt_writer_write(w, data, 40, err, sizeof err), 0);
  uint64_t bytes, xxh;
  assert_int_equal(ckpt_writer_finish(w, &bytes, &xxh, err, sizeof err), 0);
  free(path);
  remove_dir(dir);
}

static void test_finish_with_too_little_data_fails_and_removes_the_file(void **state) {
  char *dir = make_dir();
  char *path = path_in(dir, "rank-00000-of-00002.zdshard");
  ckpt_shard_header h = shard_header(0, 2, 3 * MIB);
  ckpt_writer *w;
  char err[512] = "";
  uint8_t *data = random_bytes(MIB, 3);
  assert_int_equal(ckpt_writer_open(path, &h, &w, err, sizeof err), 0);
  assert_int_equal(ckpt_writer_write(w, data, MIB, err, sizeof err), 0);
  uint64_t bytes, xxh;
  expect_error(ckpt_writer_finish(w, &bytes, &xxh, err, sizeof err), -ERANGE, err,
               "finished after 1048576 of the header's 3145728 data bytes");
  assert_false(file_exists(path));
  free(data);
  free(path);
  remove_dir(dir);
}

static void test_writer_open_refuses_an_existing_file_and_bad_headers(void **state) {
  char *dir = make_dir();
  char *path = path_in(dir, "rank-00000-of-00002.zdshard");
  write_whole(path, "precious", 8);
  ckpt_shard_header h = shard_header(0, 2, 10);
  ckpt_writer *w = (ckpt_writer *)1;
  char err[512] = "";
  expect_error(ckpt_writer_open(path, &h, &w, err, sizeof err), -EEXIST, err,
               "rank-00000-of-00002.zdshard: File exists");
  assert_null(w);
  size_t len;
  uint8_t *kept = read_whole(path, &len);
  assert_int_equal(len, 8);
  assert_memory_equal(kept, "precious", 8);
  free(kept);
  assert_int_equal(unlink(path), 0);
  h = shard_header(2, 2, 10);
  expect_error(ckpt_writer_open(path, &h, &w, err, sizeof err), -EINVAL, err, "rank 2 of");
  h = shard_header(0, 2, UINT64_MAX - 5);
  expect_error(ckpt_writer_open(path, &h, &w, err, sizeof err), -ERANGE, err, "too large");
  assert_false(file_exists(path));
  free(path);
  remove_dir(dir);
}

static void test_writer_abort_removes_the_file(void **state) {
  char *dir = make_dir();
  char *path = path_in(dir, "rank-00000-of-00001.zdshard");
  ckpt_shard_header h = shard_header(0, 1, 10);
  ckpt_writer *w;
  char err[512] = "";
  assert_int_equal(ckpt_writer_open(path, &h, &w, err, sizeof err), 0);
  assert_int_equal(ckpt_writer_write(w, "0123", 4, err, sizeof err), 0);
  assert_true(file_exists(path));
  ckpt_writer_abort(w);
  assert_false(file_exists(path));
  free(path);
  remove_dir(dir);
}

/* A write that fails (here EFBIG past RLIMIT_FSIZE, as ENOSPC would on a
 * full disk) comes back as its own errno with the file's name, and every
 * later call repeats it. */
static void test_write_errors_come_through_with_their_errno(void **state) {
  char *dir = make_dir();
  char *path = path_in(dir, "rank-00000-of-00001.zdshard");
  ckpt_shard_header h = shard_header(0, 1, 12 * MIB);
  uint8_t *data = random_bytes(MIB, 5);
  struct rlimit saved, limited;
  assert_int_equal(getrlimit(RLIMIT_FSIZE, &saved), 0);
  void (*saved_handler)(int) = signal(SIGXFSZ, SIG_IGN);
  limited = saved;
  limited.rlim_cur = 2 * MIB;
  assert_int_equal(setrlimit(RLIMIT_FSIZE, &limited), 0);
  ckpt_writer *w;
  char err[512] = "";
  assert_int_equal(ckpt_writer_open(path, &h, &w, err, sizeof err), 0);
  int rc = 0;
  for (int i = 0; i < 12 && rc == 0; i++)
    rc = ckpt_writer_write(w, data, MIB, err, sizeof err);
  assert_int_equal(setrlimit(RLIMIT_FSIZE, &saved), 0);
  signal(SIGXFSZ, saved_handler);
  expect_error(rc, -EFBIG, err, "rank-00000-of-00001.zdshard: File too large");
  expect_error(ckpt_writer_write(w, data, 1, err, sizeof err), -EFBIG, err, "earlier write");
  uint64_t bytes, xxh;
  expect_error(ckpt_writer_finish(w, &bytes, &xxh, err, sizeof err), -EFBIG, err, "earlier write");
  assert_false(file_exists(path));
  free(data);
  free(path);
  remove_dir(dir);
}

static void test_reader_names_the_block_with_a_flipped_byte(void **state) {
  shard_fixture f;
  make_shard(&f);
  flip_byte(f.path, CKPT_HEADER_BYTES + MIB + 12345); /* in block 1 */
  ckpt_reader *r;
  char err[512] = "";
  /* The table is intact, so the file opens; the damage shows on reading. */
  assert_int_equal(open_shard(&f, &r, err, sizeof err), 0);
  uint8_t *out = xmalloc(2 * MIB);
  assert_int_equal(ckpt_reader_read(r, 0, out, MIB, err, sizeof err), 0);
  assert_int_equal(ckpt_reader_read(r, 2 * MIB, out, 100, err, sizeof err), 0);
  expect_error(ckpt_reader_read(r, MIB + 12345, out, 1, err, sizeof err), -EBADMSG, err,
               "rank-00001-of-00004.zdshard: block 1 (bytes 1048576..2097152) checksum mismatch");
  /* A whole-block read straight into the caller's buffer is checked too. */
  expect_error(ckpt_reader_read(r, 0, out, 2 * MIB, err, sizeof err), -EBADMSG, err, "block 1");
  ckpt_reader_close(r);
  ckpt_file_entry entry = {
      .name = "rank-00001-of-00004.zdshard", .bytes = f.file_bytes, .xxh64 = f.xxh64};
  expect_error(ckpt_file_verify(f.dir, &entry, err, sizeof err), -EBADMSG, err,
               "block 1 (bytes 1048576..2097152) checksum mismatch");
  free(out);
  free_shard(&f);
}

/* Whole blocks are read several at a time (up to 8 MiB a pread): runs of
 * every length, the cap, the short last block, and damage in the middle of
 * a run named by its block. */
static void test_reader_reads_and_checks_runs_of_whole_blocks(void **state) {
  (void)state;
  static const size_t chunks[] = {8 * MIB, 3 * MIB + 17};
  shard_fixture f;
  f.dir = make_dir();
  f.path = path_in(f.dir, "rank-00001-of-00004.zdshard");
  f.data_bytes = 19 * MIB + MIB / 2;
  f.data = random_bytes((size_t)f.data_bytes, 12);
  f.header = shard_header(1, 4, f.data_bytes);
  write_shard(f.path, &f.header, f.data, chunks, 2, &f.file_bytes, &f.xxh64);
  ckpt_reader *r;
  char err[512] = "";
  assert_int_equal(open_shard(&f, &r, err, sizeof err), 0);
  uint8_t *out = xmalloc((size_t)f.data_bytes);
  const uint64_t ranges[][2] = {
      {0, f.data_bytes}, {MIB, 9 * MIB}, {3 * MIB, 16 * MIB + MIB / 2}, {2 * MIB - 5, 17 * MIB}};
  for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
    memset(out, 0xa5, (size_t)ranges[i][1]);
    if (ckpt_reader_read(r, ranges[i][0], out, (size_t)ranges[i][1], err, sizeof err) != 0)
      test_fail("read of %llu bytes at %llu: %s", (unsigned long long)ranges[i][1],
                (unsigned long long)ranges[i][0], err);
    assert_memory_equal(out, f.data + ranges[i][0], (size_t)ranges[i][1]);
  }
  ckpt_reader_close(r);
  flip_byte(f.path, CKPT_HEADER_BYTES + 13 * MIB + 999); /* block 13: 6th of the 2nd run */
  assert_int_equal(open_shard(&f, &r, err, sizeof err), 0);
  expect_error(ckpt_reader_read(r, 0, out, (size_t)f.data_bytes, err, sizeof err), -EBADMSG, err,
               "block 13 (bytes 13631488..14680064) checksum mismatch");
  expect_error(ckpt_reader_read(r, 9 * MIB, out, 8 * MIB, err, sizeof err), -EBADMSG, err,
               "block 13 ");
  assert_int_equal(ckpt_reader_read(r, 0, out, 13 * MIB, err, sizeof err), 0);
  ckpt_reader_close(r);
  free(out);
  free_shard(&f);
}

static void test_reader_refuses_a_flipped_header_byte(void **state) {
  static const uint64_t offsets[] = {0, 13, 44, 100, CKPT_HEADER_BYTES - 1};
  static const char *const expect[] = {"bad magic", "header checksum mismatch",
                                       "header checksum mismatch", "header checksum mismatch",
                                       "header checksum mismatch"};
  for (size_t i = 0; i < sizeof offsets / sizeof offsets[0]; i++) {
    shard_fixture f;
    make_shard(&f);
    flip_byte(f.path, offsets[i]);
    ckpt_reader *r = (ckpt_reader *)1;
    char err[512] = "";
    expect_error(open_shard(&f, &r, err, sizeof err), -EBADMSG, err, expect[i]);
    assert_null(r);
    ckpt_file_entry entry = {
        .name = "rank-00001-of-00004.zdshard", .bytes = f.file_bytes, .xxh64 = f.xxh64};
    expect_error(ckpt_file_verify(f.dir, &entry, err, sizeof err), -EBADMSG, err, expect[i]);
    free_shard(&f);
  }
}

static void test_reader_refuses_a_flipped_table_or_footer_byte(void **state) {
  shard_fixture f;
  make_shard(&f);
  uint64_t table_at = CKPT_HEADER_BYTES + f.data_bytes;
  const uint64_t offsets[] = {table_at, table_at + 17, f.file_bytes - 1};
  for (size_t i = 0; i < 3; i++) {
    flip_byte(f.path, offsets[i]);
    ckpt_reader *r;
    char err[512] = "";
    expect_error(open_shard(&f, &r, err, sizeof err), -EBADMSG, err,
                 "rank-00001-of-00004.zdshard: block table checksum mismatch");
    flip_byte(f.path, offsets[i]); /* repaired */
    assert_int_equal(open_shard(&f, &r, err, sizeof err), 0);
    ckpt_reader_close(r);
  }
  free_shard(&f);
}

static void test_reader_refuses_truncated_and_extended_files(void **state) {
  shard_fixture f;
  make_shard(&f);
  ckpt_reader *r;
  char err[512] = "", expect[128];
  assert_int_equal(truncate(f.path, 1000), 0);
  snprintf(expect, sizeof expect, "rank-00001-of-00004.zdshard: truncated: 1000 of %llu bytes",
           (unsigned long long)f.file_bytes);
  expect_error(open_shard(&f, &r, err, sizeof err), -ERANGE, err, expect);
  ckpt_file_entry entry = {
      .name = "rank-00001-of-00004.zdshard", .bytes = f.file_bytes, .xxh64 = f.xxh64};
  expect_error(ckpt_file_verify(f.dir, &entry, err, sizeof err), -ERANGE, err, "truncated");
  assert_int_equal(truncate(f.path, (off_t)f.file_bytes + 1), 0);
  expect_error(open_shard(&f, &r, err, sizeof err), -ERANGE, err, "too long");
  expect_error(ckpt_file_verify(f.dir, &entry, err, sizeof err), -ERANGE, err, "too long");
  free_shard(&f);
}

static void test_reader_checks_the_header_against_what_is_expected(void **state) {
  shard_fixture f;
  make_shard(&f);
  ckpt_reader *r;
  char err[512] = "";
  ckpt_shard_header other = f.header;
  other.rank = 2;
  expect_error(ckpt_reader_open(f.path, f.file_bytes, &other, &r, err, sizeof err), -EBADMSG, err,
               "header says rank 1 of 4");
  other = f.header;
  other.world_size = 8;
  expect_error(ckpt_reader_open(f.path, f.file_bytes, &other, &r, err, sizeof err), -EBADMSG, err,
               "expected rank 1 of 8");
  /* job id and step are the caller's to compare (ckpt_source does). */
  other = f.header;
  other.step = 5;
  assert_int_equal(ckpt_reader_open(f.path, f.file_bytes, &other, &r, err, sizeof err), 0);
  ckpt_reader_close(r);
  free_shard(&f);
}

static void test_file_verify_checks_the_whole_file_checksum(void **state) {
  shard_fixture f;
  make_shard(&f);
  char err[512] = "";
  ckpt_file_entry entry = {
      .name = "rank-00001-of-00004.zdshard", .bytes = f.file_bytes, .xxh64 = f.xxh64 ^ 1};
  expect_error(ckpt_file_verify(f.dir, &entry, err, sizeof err), -EBADMSG, err,
               "but the manifest says");
  /* A good file under another rank's name is refused. */
  entry.xxh64 = f.xxh64;
  char *renamed = path_in(f.dir, "rank-00002-of-00004.zdshard");
  assert_int_equal(rename(f.path, renamed), 0);
  entry.name = "rank-00002-of-00004.zdshard";
  expect_error(ckpt_file_verify(f.dir, &entry, err, sizeof err), -EBADMSG, err,
               "header says rank 1 of 4");
  assert_int_equal(rename(renamed, f.path), 0);
  free(renamed);
  entry.name = "rank-00003-of-00004.zdshard";
  expect_error(ckpt_file_verify(f.dir, &entry, err, sizeof err), -ENOENT, err, "No such file");
  free_shard(&f);
}

/* ------------------------------------------------------------------------
 * Checkpoint directories
 * ------------------------------------------------------------------------ */

/* Element i of a unit's flat state buffer (0 in the padding). */
static float state_value(const ckpt_unit *u, unsigned unit, int state, uint64_t i) {
  if (i >= u->numel)
    return 0.0f;
  return (float)(state * 1000000 + (int)unit * 10000) + (float)i * 0.5f;
}

/* Writes a checkpoint of m (world_size ranks) into dir as the ranks and
 * the coordinator would; shard headers carry header_step. */
static void write_checkpoint(const char *dir, ckpt_manifest *m, uint64_t header_step) {
  uint64_t data_bytes = ckpt_shard_data_bytes(m);
  for (uint32_t k = 0; k < m->world_size; k++) {
    char *path = path_in(dir, m->files[k].name);
    ckpt_shard_header h = {.rank = k,
                           .world_size = m->world_size,
                           .job_id = m->job_id,
                           .step = header_step,
                           .data_bytes = data_bytes};
    ckpt_writer *w;
    char err[512] = "";
    assert_int_equal(ckpt_writer_open(path, &h, &w, err, sizeof err), 0);
    for (unsigned u = 0; u < m->nunits; u++) {
      const ckpt_unit *unit = &m->units[u];
      float *shard = xmalloc((size_t)unit->shard_numel * 4);
      for (int s = 0; s < (int)ckpt_nstates(m); s++) {
        for (uint64_t i = 0; i < unit->shard_numel; i++)
          shard[i] = state_value(unit, u, s, k * unit->shard_numel + i);
        assert_int_equal(
            ckpt_writer_write(w, shard, (size_t)unit->shard_numel * 4, err, sizeof err), 0);
      }
      free(shard);
    }
    assert_int_equal(ckpt_writer_finish(w, &m->files[k].bytes, &m->files[k].xxh64, err, sizeof err),
                     0);
    free(path);
  }
  char err[512] = "";
  int rc = ckpt_manifest_store(dir, CKPT_MANIFEST_NAME, m, err, sizeof err);
  if (rc != 0)
    test_fail("store: %s", err);
}

/* Three ranks; the big unit's shards span several 1 MiB blocks, and shard
 * boundaries fall inside tensors. */
static const unit_spec source_units[] = {
    {"embed", 1, {{"embed.weight", 2, {1000, 700}, 0, 0}}, 5},
    {"norm", 2, {{"norm.w", 1, {7}, 0, 0}, {"norm.b", 1, {7}, 1, 0}}, 0},
};

static void test_source_reads_ranges_across_rank_files(void **state) {
  char *dir = make_dir();
  ckpt_manifest m;
  build_manifest(&m, 3, source_units, 2, 1);
  write_checkpoint(dir, &m, m.step);
  for (uint32_t k = 0; k < 3; k++) {
    char err[512] = "";
    int rc = ckpt_file_verify(dir, &m.files[k], err, sizeof err);
    if (rc != 0)
      test_fail("verify: %s", err);
  }
  ckpt_source *s;
  char err[512] = "";
  int rc = ckpt_source_open(dir, &s, err, sizeof err);
  if (rc != 0)
    test_fail("source_open: %s", err);
  const ckpt_manifest *sm = ckpt_source_manifest(s);
  assert_manifests_equal(&m, sm);
  float *out = xmalloc((size_t)m.units[0].padded_numel * 4);
  for (unsigned u = 0; u < 2; u++) {
    const ckpt_unit *unit = &sm->units[u];
    uint64_t sn = unit->shard_numel, padded = unit->padded_numel;
    const uint64_t ranges[][2] = {{0, padded},          {0, 1},          {sn - 1, sn + 1},
                                  {sn, 2 * sn},         {3, padded - 2}, {padded - 1, padded},
                                  {2 * sn - 5, 2 * sn}, {sn + 2, sn + 2}};
    for (int st = 0; st < 3; st++) {
      for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
        uint64_t from = ranges[i][0], to = ranges[i][1];
        rc = ckpt_source_read(s, u, (ckpt_state)st, from, to, out, err, sizeof err);
        if (rc != 0)
          test_fail("unit %u state %d [%llu, %llu): %s", u, st, (unsigned long long)from,
                    (unsigned long long)to, err);
        for (uint64_t e = from; e < to; e++)
          if (out[e - from] != state_value(unit, u, st, e))
            test_fail("unit %u state %d element %llu: expected %g, got %g", u, st,
                      (unsigned long long)e, state_value(unit, u, st, e), out[e - from]);
      }
    }
  }
  expect_error(ckpt_source_read(s, 2, CKPT_MASTER, 0, 1, out, err, sizeof err), -EINVAL, err,
               "no unit 2");
  expect_error(
      ckpt_source_read(s, 1, CKPT_MASTER, 0, m.units[1].padded_numel + 1, out, err, sizeof err),
      -ERANGE, err, "outside");
  expect_error(ckpt_source_read(s, 1, CKPT_MASTER, 5, 4, out, err, sizeof err), -ERANGE, err,
               "outside");
  free(out);
  ckpt_source_close(s);
  ckpt_manifest_free(&m);
  remove_dir(dir);
}

static void test_source_refuses_absent_states_and_foreign_shards(void **state) {
  char *dir = make_dir();
  ckpt_manifest m;
  build_manifest(&m, 3, source_units + 1, 1, 1);
  m.has_moment1 = 0;
  m.has_moment2 = 0;
  /* Shards from step 999 under a manifest of another step. */
  write_checkpoint(dir, &m, 999);
  ckpt_source *s;
  char err[512] = "";
  assert_int_equal(ckpt_source_open(dir, &s, err, sizeof err), 0);
  float out[32];
  expect_error(ckpt_source_read(s, 0, CKPT_MOMENT1, 0, 1, out, err, sizeof err), -EINVAL, err,
               "no state 1");
  expect_error(ckpt_source_read(s, 0, CKPT_MASTER, 0, 1, out, err, sizeof err), -EBADMSG, err,
               "rank-00000-of-00003.zdshard: header says job id");
  ckpt_source_close(s);
  /* A damaged shard: the error names it, and other ranks still read. */
  ckpt_manifest_free(&m);
  remove_dir(dir);
  dir = make_dir();
  build_manifest(&m, 3, source_units + 1, 1, 1);
  write_checkpoint(dir, &m, m.step);
  char *victim = path_in(dir, m.files[2].name);
  flip_byte(victim, CKPT_HEADER_BYTES + 3);
  free(victim);
  assert_int_equal(ckpt_source_open(dir, &s, err, sizeof err), 0);
  uint64_t sn = m.units[0].shard_numel;
  assert_int_equal(ckpt_source_read(s, 0, CKPT_MASTER, 0, 2 * sn, out, err, sizeof err), 0);
  expect_error(ckpt_source_read(s, 0, CKPT_MASTER, 2 * sn, 3 * sn, out, err, sizeof err), -EBADMSG,
               err, "rank-00002-of-00003.zdshard: block 0");
  ckpt_source_close(s);
  ckpt_manifest_free(&m);
  remove_dir(dir);
  /* No manifest at all. */
  dir = make_dir();
  expect_error(ckpt_source_open(dir, &s, err, sizeof err), -ENOENT, err, "manifest.json");
  remove_dir(dir);
}

/* Export: every tensor of every unit, its registered shape, the master
 * values at its offset (across rank files), in F32 exactly and in BF16 as
 * zk_cast rounds; metadata names the job, step and checkpoint. */
static void test_export_writes_every_tensor_from_the_rank_files(void **state) {
  char *dir = make_dir();
  ckpt_manifest m;
  build_manifest(&m, 3, source_units, 2, 1);
  write_checkpoint(dir, &m, m.step);
  char *out = path_in(dir, "out.safetensors");
  int dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  assert_true(dir_fd >= 0);
  for (int d = 0; d < 2; d++) {
    st_dtype dtype = d == 0 ? ST_F32 : ST_BF16;
    ckpt_export_info info;
    char err[512] = "";
    int rc = ckpt_export(dir, dir_fd, "out.safetensors", dtype, "cp", &info, err, sizeof err);
    if (rc != 0)
      test_fail("export: %s", err);
    assert_int_equal(info.tensors, 3);
    assert_int_equal(info.step, m.step);
    assert_int_equal(info.bytes, file_size(out));
    st_file f;
    int fd;
    if (st_open(out, &f, &fd, err, sizeof err) != 0)
      test_fail("st_open: %s", err);
    assert_int_equal(f.ntensors, 3);
    for (unsigned u = 0; u < m.nunits; u++) {
      const ckpt_unit *unit = &m.units[u];
      for (unsigned k = 0; k < unit->ntensors; k++) {
        const ckpt_tensor *t = &unit->tensors[k];
        const st_tensor *ft = st_find(&f, t->name);
        assert_non_null(ft);
        assert_int_equal(ft->dtype, dtype);
        assert_int_equal(ft->ndim, t->ndim);
        assert_memory_equal(ft->shape, t->shape, t->ndim * sizeof t->shape[0]);
        float *got = xmalloc((size_t)t->numel * 4), *want = xmalloc((size_t)t->numel * 4);
        for (uint64_t e = 0; e < t->numel; e++)
          want[e] = state_value(unit, u, CKPT_MASTER, t->offset + e);
        if (dtype == ST_BF16) {
          uint16_t *half = xmalloc((size_t)t->numel * 2);
          assert_int_equal(zk_cast(NULL, half, ZK_BF16, want, ZK_F32, (size_t)t->numel), 0);
          assert_int_equal(zk_cast(NULL, want, ZK_F32, half, ZK_BF16, (size_t)t->numel), 0);
          free(half);
        }
        if (st_read_f32(fd, &f, ft, 0, t->numel, got, err, sizeof err) != 0)
          test_fail("read %s: %s", t->name, err);
        assert_memory_equal(got, want, (size_t)t->numel * 4);
        free(got);
        free(want);
      }
    }
    st_file_free(&f);
    close(fd);
    size_t len;
    uint8_t *bytes = read_whole(out, &len);
    static const char md[] = "\"__metadata__\":{\"format\":\"pt\",\"zerod.job\":"
                             "\"llama-7b.run_3\",\"zerod.step\":\"9007199254740993\","
                             "\"zerod.checkpoint\":\"cp\"}";
    assert_non_null(memmem(bytes, len, md, sizeof md - 1));
    free(bytes);
  }
  /* A damaged block is named, and nothing is left at the path. */
  unlink(out);
  char *shard = path_in(dir, m.files[1].name);
  flip_byte(shard, CKPT_HEADER_BYTES + 10);
  ckpt_export_info info;
  char err[512] = "";
  expect_error(ckpt_export(dir, dir_fd, "out.safetensors", ST_F32, NULL, &info, err, sizeof err),
               -EBADMSG, err, m.files[1].name);
  assert_false(file_exists(out));
  close(dir_fd);
  free(shard);
  free(out);
  ckpt_manifest_free(&m);
  remove_dir(dir);
}

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

/* ---- hostmem: the buffers of a save's copy and a restore's staging ---- */

/* Pages of [p, p + bytes) in memory now (mincore). */
static size_t resident_pages(void *p, size_t bytes) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE), n = (bytes + page - 1) / page, in = 0;
  unsigned char *vec = malloc(n);
  assert_non_null(vec);
  assert_int_equal(mincore(p, bytes, vec), 0);
  for (size_t i = 0; i < n; i++)
    in += vec[i] & 1;
  free(vec);
  return in;
}

static void test_hostmem_gives_zeroed_memory_not_yet_faulted_in(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = 64 * page + 123;
  uint8_t *p = hostmem_alloc(bytes);
  assert_non_null(p);
  assert_int_equal(resident_pages(p, bytes), 0);
  for (size_t i = 0; i < bytes; i++)
    assert_int_equal(p[i], 0);
  memset(p, 0xa5, bytes); /* every byte asked for is there */
  assert_int_equal(resident_pages(p, bytes), 65);
  hostmem_free(p, bytes);
  hostmem_free(NULL, bytes);
  uint8_t *none = hostmem_alloc(0); /* a page, freed with the same size */
  assert_non_null(none);
  hostmem_free(none, 0);
}

static void test_hostmem_populate_keeps_what_the_memory_holds(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = 256 * page;
  uint8_t *p = hostmem_alloc(bytes);
  assert_non_null(p);
  for (size_t i = 0; i < bytes / 2; i++) /* half written, half never touched */
    p[i] = (uint8_t)(i * 31 + 7);
  int rc = hostmem_populate(p, bytes);
  if (rc == -EINVAL) {
    hostmem_free(p, bytes);
    skip(); /* before Linux 5.14: nothing is populated, pages fault as written */
  }
  assert_int_equal(rc, 0);
  assert_int_equal(resident_pages(p, bytes), 256);
  for (size_t i = 0; i < bytes; i++)
    assert_int_equal(p[i], i < bytes / 2 ? (uint8_t)(i * 31 + 7) : 0);
  hostmem_free(p, bytes);
}

static void test_hostmem_populate_ahead_faults_in_beside_a_writer(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = 24u << 20, npages = bytes / page;
  uint8_t *probe = hostmem_alloc(page);
  assert_non_null(probe);
  int supported = hostmem_populate(probe, page) == 0;
  hostmem_free(probe, page);
  if (!supported)
    skip();
  /* Alone, it faults in the whole buffer. */
  uint8_t *p = hostmem_alloc(bytes);
  assert_non_null(p);
  hostmem_ahead *a = hostmem_populate_ahead(p, bytes);
  assert_non_null(a);
  for (int i = 0; i < 1000 && resident_pages(p, bytes) < npages; i++)
    usleep(10000);
  assert_int_equal(resident_pages(p, bytes), npages);
  hostmem_populate_stop(a);
  hostmem_free(p, bytes);
  /* With a writer going through the same pages meanwhile, every byte
   * written stays written, and stop returns with the thread gone. */
  p = hostmem_alloc(bytes);
  assert_non_null(p);
  a = hostmem_populate_ahead(p, bytes);
  assert_non_null(a);
  for (size_t at = 0; at < bytes; at += 4096)
    for (size_t i = at; i < at + 4096; i++)
      p[i] = (uint8_t)(i * 13 + 1);
  hostmem_populate_stop(a);
  for (size_t i = 0; i < bytes; i++)
    if (p[i] != (uint8_t)(i * 13 + 1))
      fail_msg("byte %zu is %u", i, p[i]);
  hostmem_free(p, bytes);
  /* Stopped at once, before it is through. */
  p = hostmem_alloc(bytes);
  assert_non_null(p);
  hostmem_populate_stop(hostmem_populate_ahead(p, bytes));
  hostmem_populate_stop(NULL);
  hostmem_free(p, bytes);
}

static void test_hostmem_populate_ahead_ranges_faults_in_whole_pages_only(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  uint8_t *a = hostmem_alloc(6 * page), *b = hostmem_alloc(3 * page);
  assert_non_null(a);
  assert_non_null(b);
  if (hostmem_populate(a, page) != 0) {
    hostmem_free(a, 6 * page);
    hostmem_free(b, 3 * page);
    skip();
  }
  memset(b, 0x3c, 3 * page);
  /* In the order given: a's pages 2 and 3 by an unaligned range (pages 1
   * and 4 only partly in it), all of b (already resident: its
   * bytes stay), and a range inside one page, which is left alone. */
  const hostmem_range ranges[] = {
      {a + page + 100, 4 * page - 200}, {b, 3 * page}, {a + 5 * page + 8, page - 16}};
  hostmem_ahead *h = hostmem_populate_ahead_ranges(ranges, 3);
  assert_non_null(h);
  for (int i = 0; i < 1000 && resident_pages(a + 2 * page, 2 * page) < 2; i++)
    usleep(10000);
  hostmem_populate_stop(h);
  unsigned char vec[6];
  assert_int_equal(mincore(a, 6 * page, vec), 0);
  const unsigned char want[6] = {1, 0, 1, 1, 0, 0}; /* page 0: the probe above */
  for (int i = 0; i < 6; i++)
    if ((vec[i] & 1) != want[i])
      fail_msg("page %d of the first buffer: resident %d, expected %d", i, vec[i] & 1, want[i]);
  for (size_t i = 0; i < 3 * page; i++)
    assert_int_equal(b[i], 0x3c);
  /* Nothing with a whole page: no thread. */
  assert_null(hostmem_populate_ahead_ranges(&ranges[2], 1));
  assert_null(hostmem_populate_ahead_ranges(NULL, 0));
  hostmem_free(a, 6 * page);
  hostmem_free(b, 3 * page);
}

static void test_hostmem_arrays_are_aligned_and_big_ones_are_given_back(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t sizes[] = {0, 1, 63, 4096 + 8, (1u << 20) - 64, 1u << 20, (3u << 20) + 4};
  for (unsigned i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    size_t bytes = sizes[i];
    uint8_t *p = hostmem_array_alloc(bytes);
    assert_non_null(p);
    assert_int_equal((uintptr_t)p % 64, 0);
    int mapped = hostmem_array_mapped(p);
    assert_int_equal(mapped, bytes >= (1u << 20));
    size_t padded = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
    if (mapped) { /* fresh from the kernel: zero, and page-aligned */
      assert_int_equal((uintptr_t)p % page, 0);
      for (size_t b = 0; b < padded; b++)
        assert_int_equal(p[b], 0);
    }
    for (size_t b = 0; b < padded; b++) /* all of it, padding included, is ours */
      p[b] = (uint8_t)(b * 7 + i);
    for (size_t b = 0; b < padded; b++)
      assert_int_equal(p[b], (uint8_t)(b * 7 + i));
    hostmem_array_free(p);
    if (mapped) { /* unmapped at once, not kept by an allocator */
      unsigned char vec[1];
      errno = 0;
      assert_int_equal(mincore(p, page, vec), -1);
      assert_int_equal(errno, ENOMEM);
    }
  }
  hostmem_array_free(NULL);
}

static void test_hostmem_shared_buffer_lives_until_the_last_reference(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = 3 * page + 5;
  uint8_t *p = hostmem_shared_alloc(bytes);
  assert_non_null(p);
  for (size_t i = 0; i < bytes; i++)
    assert_int_equal(p[i], 0);
  memset(p, 0x5a, bytes);
  hostmem_shared_ref(p);   /* a second holder (the writer faulting it in) */
  hostmem_shared_unref(p); /* the first lets go: still there */
  unsigned char vec[4];
  assert_int_equal(mincore(p, bytes, vec), 0);
  for (size_t i = 0; i < bytes; i++)
    assert_int_equal(p[i], 0x5a);
  hostmem_shared_unref(p); /* the last: unmapped */
  errno = 0;
  assert_int_equal(mincore(p, bytes, vec), -1);
  assert_int_equal(errno, ENOMEM);
  hostmem_shared_unref(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_shard_names_are_zero_padded),
      cmocka_unit_test(test_incremental_hash_equals_one_shot_xxh64),
      cmocka_unit_test(test_data_offsets_follow_units_then_states),
      cmocka_unit_test(test_manifest_round_trips_exactly_and_byte_for_byte),
      cmocka_unit_test(test_manifest_encoding_is_deterministic),
      cmocka_unit_test(test_encode_refuses_values_json_cannot_hold),
      cmocka_unit_test(test_decode_refuses_what_is_not_a_manifest),
      cmocka_unit_test(test_manifest_tenant_by_version),
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
      cmocka_unit_test(test_shard_written_in_odd_chunks_reads_back),
      cmocka_unit_test(test_shard_without_data_has_an_empty_table),
      cmocka_unit_test(test_writer_refuses_more_data_than_the_header_says),
      cmocka_unit_test(test_finish_with_too_little_data_fails_and_removes_the_file),
      cmocka_unit_test(test_writer_open_refuses_an_existing_file_and_bad_headers),
      cmocka_unit_test(test_writer_abort_removes_the_file),
      cmocka_unit_test(test_write_errors_come_through_with_their_errno),
      cmocka_unit_test(test_reader_names_the_block_with_a_flipped_byte),
      cmocka_unit_test(test_reader_reads_and_checks_runs_of_whole_blocks),
      cmocka_unit_test(test_reader_refuses_a_flipped_header_byte),
      cmocka_unit_test(test_reader_refuses_a_flipped_table_or_footer_byte),
      cmocka_unit_test(test_reader_refuses_truncated_and_extended_files),
      cmocka_unit_test(test_reader_checks_the_header_against_what_is_expected),
      cmocka_unit_test(test_file_verify_checks_the_whole_file_checksum),
      cmocka_unit_test(test_source_reads_ranges_across_rank_files),
      cmocka_unit_test(test_source_refuses_absent_states_and_foreign_shards),
      cmocka_unit_test(test_export_writes_every_tensor_from_the_rank_files),
      cmocka_unit_test(test_safetensors_write_then_read_round_trips),
      cmocka_unit_test(test_safetensors_write_refuses_bad_arguments),
      cmocka_unit_test(test_safetensors_reads_f16_and_f64_and_refuses_integers),
      cmocka_unit_test(test_safetensors_header_rejections),
      cmocka_unit_test(test_safetensors_open_refuses_sizes_beyond_the_file),
      cmocka_unit_test(test_hostmem_gives_zeroed_memory_not_yet_faulted_in),
      cmocka_unit_test(test_hostmem_populate_keeps_what_the_memory_holds),
      cmocka_unit_test(test_hostmem_populate_ahead_faults_in_beside_a_writer),
      cmocka_unit_test(test_hostmem_populate_ahead_ranges_faults_in_whole_pages_only),
      cmocka_unit_test(test_hostmem_arrays_are_aligned_and_big_ones_are_given_back),
      cmocka_unit_test(test_hostmem_shared_buffer_lives_until_the_last_reference),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
