/* Shard files (daemon/ckpt/ckpt_shard*.c): written in any chunk sizes they
 * read back exactly, by any range, and verify; the writer refuses too much
 * or too little data, an existing file and bad headers, and passes write
 * errors on with their errno; every kind of damage (a data, header, table
 * or footer byte, a short or long file, another rank's header) is caught
 * and named. Every test works in its own directory under /tmp. */
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

#include "ckpt.h"
#include "ckpt_fixtures.h"

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

int main(void) {
  const struct CMUnitTest tests[] = {
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
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
