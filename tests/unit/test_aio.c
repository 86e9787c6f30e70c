/* The offload tier's file I/O (daemon/backend/aio.c): what is written in
 * slots reads back, in any order of waits, on io_uring and on the pread
 * fallback alike; O_DIRECT's alignment is enforced; a read past the end is
 * an error, not garbage; growing the file reads back zeros. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "aio.h"

#define CHUNK (16 * AIO_ALIGN)

/* mkdtemp's template, under $TMPDIR (default /tmp), made in main. */
static char dir[200];

static aio_file *open_file(const char *name, unsigned slots) {
  char path[256], err[256];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  aio_file *f = NULL;
  int rc = aio_file_open(path, 0600, slots, 3, &f, err, sizeof err);
  if (rc != 0)
    fail_msg("aio_file_open: %s", err);
  return f;
}

static uint8_t *buffer(uint8_t fill) {
  uint8_t *b = aligned_alloc(AIO_ALIGN, CHUNK);
  assert_non_null(b);
  for (size_t i = 0; i < CHUNK; i++)
    b[i] = (uint8_t)(fill + i * 7);
  return b;
}

static void test_slots_write_and_read_back(void **state) {
  (void)state;
  aio_file *f = open_file("a", 4);
  printf("engine %s, O_DIRECT %d\n", aio_file_engine(f), aio_file_direct(f));
  assert_int_equal(aio_file_resize(f, 8 * CHUNK), 0);
  uint8_t *out[8], *in[8];
  for (int i = 0; i < 8; i++) {
    out[i] = buffer((uint8_t)(i * 31));
    in[i] = aligned_alloc(AIO_ALIGN, CHUNK);
  }
  /* Eight chunks through four slots, each slot reused once its write landed. */
  for (int i = 0; i < 8; i++) {
    assert_int_equal(aio_file_wait(f, (unsigned)(i % 4)), 0);
    assert_int_equal(aio_file_write(f, (unsigned)(i % 4), out[i], CHUNK, (uint64_t)i * CHUNK), 0);
    assert_int_equal(aio_file_submit(f), 0);
  }
  for (unsigned s = 0; s < 4; s++)
    assert_int_equal(aio_file_wait(f, s), 0);
  /* Read back in reverse, waiting for each slot in another order. */
  for (int i = 7; i >= 0; i--)
    assert_int_equal(aio_file_read(f, (unsigned)(i % 4), in[i], CHUNK, (uint64_t)i * CHUNK), 0);
  for (int s = 3; s >= 0; s--)
    assert_int_equal(aio_file_wait(f, (unsigned)s), 0);
  for (int i = 0; i < 8; i++) {
    assert_memory_equal(in[i], out[i], CHUNK);
    free(in[i]);
    free(out[i]);
  }
  aio_file_close(f);
}

static void test_growing_reads_zeros_and_past_the_end_fails(void **state) {
  (void)state;
  aio_file *f = open_file("b", 2);
  assert_int_equal(aio_file_resize(f, 2 * CHUNK), 0);
  uint8_t *b = buffer(9);
  assert_int_equal(aio_file_read(f, 0, b, CHUNK, CHUNK), 0);
  assert_int_equal(aio_file_wait(f, 0), 0);
  for (size_t i = 0; i < CHUNK; i++)
    assert_int_equal(b[i], 0);
  /* The slot's error is reported once, then cleared. */
  assert_int_equal(aio_file_read(f, 1, b, CHUNK, 2 * CHUNK), 0);
  assert_int_equal(aio_file_wait(f, 1), -EIO);
  assert_int_equal(aio_file_wait(f, 1), 0);
  if (aio_file_direct(f)) {
    assert_int_equal(aio_file_read(f, 0, b + 1, CHUNK - AIO_ALIGN, 0), -EINVAL);
    assert_int_equal(aio_file_read(f, 0, b, 100, 0), -EINVAL);
    assert_int_equal(aio_file_read(f, 0, b, CHUNK, 100), -EINVAL);
  }
  assert_int_equal(aio_file_read(f, 9, b, CHUNK, 0), -EINVAL); /* no such slot */
  free(b);
  aio_file_close(f);
}

static void test_open_error_says_why(void **state) {
  (void)state;
  aio_file *f = NULL;
  char err[256] = "";
  assert_int_equal(aio_file_open("/nonexistent-dir/x", 0600, 2, 3, &f, err, sizeof err), -ENOENT);
  assert_null(f);
  assert_non_null(strstr(err, "/nonexistent-dir/x"));
}

int main(void) {
  const char *tmp = getenv("TMPDIR") != NULL ? getenv("TMPDIR") : "/tmp";
  if (snprintf(dir, sizeof dir, "%s/zerod-test-aio-XXXXXX", tmp) >= (int)sizeof dir ||
      mkdtemp(dir) == NULL)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_slots_write_and_read_back),
      cmocka_unit_test(test_growing_reads_zeros_and_past_the_end_fails),
      cmocka_unit_test(test_open_error_says_why),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (system(cmd) != 0)
    fprintf(stderr, "could not remove %s\n", dir);
  return failed;
}
