/* ckpt_fixtures.c - what the checkpoint tests share (ckpt_fixtures.h):
 * scratch directories and whole-file helpers, manifests built from unit
 * specs, and a field-by-field comparison of two manifests. */
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

#include "ckpt_fixtures.h"

char *make_dir(void) {
  char *dir = strdup("/tmp/test_ckpt.XXXXXX");
  assert_non_null(dir);
  assert_non_null(mkdtemp(dir));
  return dir;
}

/* Removes dir and the files in it (the tests make no subdirectories). */
void remove_dir(char *dir) {
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

char *path_in(const char *dir, const char *file) {
  char *path = xmalloc(strlen(dir) + strlen(file) + 2);
  sprintf(path, "%s/%s", dir, file);
  return path;
}

int file_exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

uint64_t file_size(const char *path) {
  struct stat st;
  assert_int_equal(stat(path, &st), 0);
  return (uint64_t)st.st_size;
}

uint8_t *read_whole(const char *path, size_t *len) {
  *len = (size_t)file_size(path);
  uint8_t *bytes = xmalloc(*len);
  int fd = open(path, O_RDONLY);
  assert_true(fd >= 0);
  assert_int_equal(pread(fd, bytes, *len, 0), (ssize_t)*len);
  close(fd);
  return bytes;
}

void write_whole(const char *path, const void *bytes, size_t len) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, bytes, len), (ssize_t)len);
  close(fd);
}

void flip_byte(const char *path, uint64_t offset) {
  int fd = open(path, O_RDWR);
  assert_true(fd >= 0);
  uint8_t b;
  assert_int_equal(pread(fd, &b, 1, (off_t)offset), 1);
  b ^= 0x10;
  assert_int_equal(pwrite(fd, &b, 1, (off_t)offset), 1);
  close(fd);
}

void expect_error(int rc, int expect_rc, const char *err, const char *part) {
  if (rc != expect_rc)
    test_fail("expected %d (%s), got %d: \"%s\"", expect_rc, strerror(-expect_rc), rc, err);
  if (strstr(err, part) == NULL)
    test_fail("expected an error message containing \"%s\", got \"%s\"", part, err);
}

static char *xstrdup(const char *s) {
  char *copy = strdup(s);
  assert_non_null(copy);
  return copy;
}

/* A manifest as the coordinator would build one, every string malloc'd so
 * that ckpt_manifest_free frees it. */
void build_manifest(ckpt_manifest *m, uint32_t world, const unit_spec *specs, unsigned nunits,
                    int with_files) {
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

static void assert_doubles_identical(double a, double b) {
  uint64_t x, y;
  memcpy(&x, &a, sizeof x);
  memcpy(&y, &b, sizeof y);
  if (x != y)
    test_fail("expected %.17g (bits %016llx), got %.17g (bits %016llx)", a, (unsigned long long)x,
              b, (unsigned long long)y);
}

void assert_manifests_equal(const ckpt_manifest *a, const ckpt_manifest *b) {
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
  assert_string_equal(a->feedback.kind, b->feedback.kind);
  assert_int_equal(a->feedback.nodes, b->feedback.nodes);
  assert_int_equal(a->feedback.numel != NULL, b->feedback.numel != NULL);
  for (unsigned u = 0; a->feedback.numel != NULL && u < a->nunits; u++)
    assert_true(a->feedback.numel[u] == b->feedback.numel[u]);
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
