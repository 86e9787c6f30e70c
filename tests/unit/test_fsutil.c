/* The durable-file steps (daemon/base/fsutil.c) against a scratch
 * directory: whole reads and writes, a directory's fsync, a file replaced
 * whole (and the step named when it fails), mkdir -p with the directory
 * mode. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "filemode.h"
#include "fsutil.h"

typedef struct scratch {
  char dir[PATH_MAX];
} scratch;

static int scratch_setup(void **state) {
  scratch *t = calloc(1, sizeof *t);
  const char *base = getenv("TMPDIR") != NULL ? getenv("TMPDIR") : "/tmp";
  snprintf(t->dir, sizeof t->dir, "%s/test_fsutil.XXXXXX", base);
  if (mkdtemp(t->dir) == NULL)
    return -1;
  *state = t;
  return 0;
}

static int scratch_teardown(void **state) {
  scratch *t = *state;
  char cmd[PATH_MAX + 16];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", t->dir);
  int rc = system(cmd);
  free(t);
  return rc == 0 ? 0 : -1;
}

static void path_in(const scratch *t, const char *name, char *out, size_t out_bytes) {
  if ((size_t)snprintf(out, out_bytes, "%s/%s", t->dir, name) >= out_bytes)
    fail_msg("%s/%s: longer than %zu bytes", t->dir, name, out_bytes);
}

/* The file's whole content, NUL-terminated (at most 255 bytes). */
static void expect_content(const char *path, const char *want) {
  char got[256] = "";
  int fd = open(path, O_RDONLY);
  if (fd < 0)
    fail_msg("%s: %s, expected a file holding '%s'", path, strerror(errno), want);
  ssize_t n = read(fd, got, sizeof got - 1);
  close(fd);
  assert_true(n >= 0);
  got[n] = '\0';
  if (strcmp(got, want) != 0)
    fail_msg("%s holds '%s', expected '%s'", path, got, want);
}

static void expect_missing(const char *path) {
  struct stat st;
  if (lstat(path, &st) == 0)
    fail_msg("%s exists, expected it gone", path);
}

/* ------------------------------------------------------------------------
 * Whole reads and writes
 * ------------------------------------------------------------------------ */

static void test_pwrite_all_then_pread_all_give_the_bytes_back(void **state) {
  scratch *t = *state;
  char path[PATH_MAX];
  path_in(t, "data", path, sizeof path);
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
  assert_true(fd >= 0);
  assert_int_equal(fsutil_pwrite_all(fd, "0123456789", 10, 0), 0);
  assert_int_equal(fsutil_pwrite_all(fd, "ab", 2, 4), 0);
  char buf[10];
  assert_int_equal(fsutil_pread_all(fd, buf, sizeof buf, 0), 0);
  assert_memory_equal(buf, "0123ab6789", sizeof buf);
  close(fd);
}

static void test_pread_all_says_1_when_the_file_ends_first(void **state) {
  scratch *t = *state;
  char path[PATH_MAX];
  path_in(t, "short", path, sizeof path);
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
  assert_true(fd >= 0);
  assert_int_equal(fsutil_pwrite_all(fd, "abc", 3, 0), 0);
  char buf[8];
  assert_int_equal(fsutil_pread_all(fd, buf, sizeof buf, 0), 1);
  assert_int_equal(fsutil_pread_all(fd, buf, 2, 1), 0);
  close(fd);
  assert_int_equal(fsutil_pread_all(-1, buf, 1, 0), -EBADF);
}

/* ------------------------------------------------------------------------
 * Directories and replaced files
 * ------------------------------------------------------------------------ */

static void test_fsync_dir_names_the_failed_step(void **state) {
  scratch *t = *state;
  const char *failed = NULL;
  assert_int_equal(fsutil_fsync_dir(t->dir, &failed), 0);
  char missing[PATH_MAX];
  path_in(t, "missing", missing, sizeof missing);
  assert_int_equal(fsutil_fsync_dir(missing, &failed), -ENOENT);
  assert_string_equal(failed, "open");
  assert_int_equal(fsutil_fsync_dir(missing, NULL), -ENOENT);
}

static void test_replace_writes_then_replaces_the_whole_file_with_the_file_mode(void **state) {
  scratch *t = *state;
  char path[PATH_MAX], tmp[PATH_MAX];
  path_in(t, "manifest.json", path, sizeof path);
  path_in(t, "manifest.json.tmp", tmp, sizeof tmp);
  assert_int_equal(fsutil_replace(path, "first version", 13, NULL), 0);
  expect_content(path, "first version");
  /* A .tmp left by a crash is overwritten, not in the way. */
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0644);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, "stale and longer than the new one", 33), 33);
  close(fd);
  const char *failed = "untouched";
  assert_int_equal(fsutil_replace(path, "second", 6, &failed), 0);
  expect_content(path, "second");
  expect_missing(tmp);
  struct stat st;
  assert_int_equal(stat(path, &st), 0);
  assert_int_equal(st.st_mode & 07777, filemode_file());
}

static void test_replace_names_the_failed_step_and_leaves_no_tmp(void **state) {
  scratch *t = *state;
  char path[PATH_MAX];
  const char *failed = NULL;
  path_in(t, "no/such/dir/file", path, sizeof path);
  assert_int_equal(fsutil_replace(path, "x", 1, &failed), -ENOENT);
  assert_string_equal(failed, "open");
  /* A directory where the file goes: the rename fails, the old entry stays. */
  path_in(t, "adir", path, sizeof path);
  assert_int_equal(mkdir(path, 0700), 0);
  int rc = fsutil_replace(path, "x", 1, &failed);
  if (rc != -EISDIR)
    fail_msg("replacing a directory: %d (%s), expected -EISDIR", rc, strerror(-rc));
  assert_string_equal(failed, "rename");
  char tmp[PATH_MAX];
  path_in(t, "adir.tmp", tmp, sizeof tmp);
  expect_missing(tmp);
  struct stat st;
  assert_int_equal(stat(path, &st), 0);
  assert_true(S_ISDIR(st.st_mode));
}

/* ------------------------------------------------------------------------
 * mkdir -p
 * ------------------------------------------------------------------------ */

static void test_mkdir_p_makes_every_missing_directory_with_the_directory_mode(void **state) {
  scratch *t = *state;
  char path[PATH_MAX];
  path_in(t, "a/b/c", path, sizeof path);
  assert_int_equal(fsutil_mkdir_p(path), 0);
  const char *made[] = {"a", "a/b", "a/b/c"};
  for (size_t i = 0; i < sizeof made / sizeof made[0]; i++) {
    char dir[PATH_MAX];
    path_in(t, made[i], dir, sizeof dir);
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
      fail_msg("%s: not made", dir);
    if ((st.st_mode & 07777) != filemode_dir())
      fail_msg("%s: mode %o, expected %o", dir, st.st_mode & 07777, filemode_dir());
  }
  /* Again, and with a trailing slash: what exists is left alone. */
  assert_int_equal(fsutil_mkdir_p(path), 0);
  path_in(t, "a/b/c/", path, sizeof path);
  assert_int_equal(fsutil_mkdir_p(path), 0);
}

static void test_mkdir_p_refuses_a_file_in_the_way_and_impossible_paths(void **state) {
  scratch *t = *state;
  char path[PATH_MAX];
  path_in(t, "file", path, sizeof path);
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
  assert_true(fd >= 0);
  close(fd);
  path_in(t, "file/below", path, sizeof path);
  assert_int_equal(fsutil_mkdir_p(path), -ENOTDIR);
  assert_int_equal(fsutil_mkdir_p(""), -ENOENT);
  char *long_path = malloc(PATH_MAX + 16);
  assert_non_null(long_path);
  memset(long_path, 'x', PATH_MAX + 15);
  long_path[0] = '/';
  long_path[PATH_MAX + 15] = '\0';
  assert_int_equal(fsutil_mkdir_p(long_path), -ENAMETOOLONG);
  free(long_path);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_pwrite_all_then_pread_all_give_the_bytes_back,
                                      scratch_setup, scratch_teardown),
      cmocka_unit_test_setup_teardown(test_pread_all_says_1_when_the_file_ends_first, scratch_setup,
                                      scratch_teardown),
      cmocka_unit_test_setup_teardown(test_fsync_dir_names_the_failed_step, scratch_setup,
                                      scratch_teardown),
      cmocka_unit_test_setup_teardown(
          test_replace_writes_then_replaces_the_whole_file_with_the_file_mode, scratch_setup,
          scratch_teardown),
      cmocka_unit_test_setup_teardown(test_replace_names_the_failed_step_and_leaves_no_tmp,
                                      scratch_setup, scratch_teardown),
      cmocka_unit_test_setup_teardown(
          test_mkdir_p_makes_every_missing_directory_with_the_directory_mode, scratch_setup,
          scratch_teardown),
      cmocka_unit_test_setup_teardown(test_mkdir_p_refuses_a_file_in_the_way_and_impossible_paths,
                                      scratch_setup, scratch_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
