/* Checkpoint directories (daemon/ckpt/ckpt_source.c, ckpt_export.c): a
 * checkpoint written as the ranks and the coordinator would reads by
 * element ranges across rank files, refuses absent states, foreign and
 * damaged shards, and exports every tensor to safetensors (F32 exactly,
 * BF16 as zk_cast rounds). Every test works in its own directory under
 * /tmp. */
#include <fcntl.h>
#include <unistd.h>

#include "testutil.h"

#include "ckpt.h"
#include "ckpt_fixtures.h"
#include "zk.h"

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

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_source_reads_ranges_across_rank_files),
      cmocka_unit_test(test_source_refuses_absent_states_and_foreign_shards),
      cmocka_unit_test(test_export_writes_every_tensor_from_the_rank_files),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
