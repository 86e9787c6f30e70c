/* Paths kept inside root directories (daemon/base/confine.c) and the mode
 * of what the daemon writes (daemon/base/filemode.c): the text checks of
 * confine_locate, and the component walk of confine_open_parent against a
 * real tree with symbolic links planted in it. */
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

#include "confine.h"
#include "filemode.h"

/* ------------------------------------------------------------------------
 * confine_locate: the text
 * ------------------------------------------------------------------------ */

static const char *const two_roots[] = {"/data/exports", "/ckpt"};

/* path is placed in root want_root with the rest want_rel. */
static void expect_located(const char *path, int want_root, const char *want_rel) {
  char rel[PATH_MAX];
  int root = confine_locate(path, two_roots, 2, rel, sizeof rel);
  if (root != want_root)
    fail_msg("%s: root %d, expected %d", path, root, want_root);
  if (strcmp(rel, want_rel) != 0)
    fail_msg("%s: rest '%s', expected '%s'", path, rel, want_rel);
}

static void expect_refused(const char *path, int want_rc) {
  char rel[PATH_MAX];
  int rc = confine_locate(path, two_roots, 2, rel, sizeof rel);
  if (rc != want_rc)
    fail_msg("%s: %d, expected %d (%s)", path, rc, want_rc, strerror(-want_rc));
}

static void test_locate_places_absolute_paths_in_their_root(void **state) {
  (void)state;
  expect_located("/data/exports/out.safetensors", 0, "out.safetensors");
  expect_located("/data/exports/a/b/c", 0, "a/b/c");
  expect_located("/ckpt/job/name", 1, "job/name");
  expect_located("/data/exports", 0, "");
  expect_located("/ckpt", 1, "");
}

static void test_locate_drops_empty_and_dot_components_and_trailing_slashes(void **state) {
  (void)state;
  expect_located("//data///exports//a//b", 0, "a/b");
  expect_located("/data/./exports/./a/.", 0, "a");
  expect_located("/data/exports/a/", 0, "a");
  expect_located("/data/exports/a///", 0, "a");
  expect_located("/data/exports/", 0, "");
  expect_located("/ckpt/./", 1, "");
}

static void test_locate_takes_relative_paths_inside_the_first_root(void **state) {
  (void)state;
  expect_located("out.safetensors", 0, "out.safetensors");
  expect_located("./sub//out.safetensors", 0, "sub/out.safetensors");
  expect_located("sub/dir/", 0, "sub/dir");
  expect_located(".", 0, "");
  char rel[PATH_MAX];
  assert_int_equal(confine_locate("x", two_roots, 0, rel, sizeof rel), -EINVAL);
}

static void test_locate_refuses_paths_outside_every_root(void **state) {
  (void)state;
  expect_refused("/etc/passwd", -EACCES);
  expect_refused("/", -EACCES);
  expect_refused("/data", -EACCES);
  /* A root's name as a prefix of another name is not inside it. */
  expect_refused("/data/exportsX/out", -EACCES);
  expect_refused("/data/export", -EACCES);
  expect_refused("/ckpt2/job", -EACCES);
}

static void test_locate_refuses_dot_dot_anywhere(void **state) {
  (void)state;
  /* Even where it would resolve inside a root: never needed, never
   * trusted (the directory it names may be a symbolic link). */
  expect_refused("/data/exports/../exports/out", -EPERM);
  expect_refused("/data/exports/a/../b", -EPERM);
  expect_refused("/data/exports/..", -EPERM);
  expect_refused("/etc/../data/exports/x", -EPERM);
  expect_refused("../out", -EPERM);
  expect_refused("a/../../out", -EPERM);
  expect_refused("..", -EPERM);
  /* Names that merely contain dots are names. */
  expect_located("/data/exports/..a/b..", 0, "..a/b..");
  expect_located("/data/exports/.../x", 0, ".../x");
}

static void test_locate_refuses_empty_and_over_long_paths(void **state) {
  (void)state;
  expect_refused("", -EINVAL);
  char rel[PATH_MAX];
  assert_int_equal(confine_locate(NULL, two_roots, 2, rel, sizeof rel), -EINVAL);

  char long_name[NAME_MAX + 2];
  memset(long_name, 'n', sizeof long_name - 1);
  long_name[sizeof long_name - 1] = '\0';
  char path[NAME_MAX + 64];
  snprintf(path, sizeof path, "/data/exports/%s", long_name);
  expect_refused(path, -ENAMETOOLONG);
  long_name[NAME_MAX] = '\0'; /* NAME_MAX itself is fine */
  snprintf(path, sizeof path, "/data/exports/%s", long_name);
  expect_located(path, 0, long_name);

  /* A whole path longer than PATH_MAX. */
  size_t bytes = PATH_MAX + 100;
  char *huge = malloc(bytes + 1);
  assert_non_null(huge);
  strcpy(huge, "/data/exports");
  for (size_t len = strlen(huge); len + 3 <= bytes; len += 2)
    memcpy(huge + len, "/a", 3);
  expect_refused(huge, -ENAMETOOLONG);
  free(huge);

  /* The rest does not fit the caller's buffer. */
  char small[4];
  assert_int_equal(confine_locate("/data/exports/abcd", two_roots, 2, small, sizeof small),
                   -ENAMETOOLONG);
  assert_int_equal(confine_locate("abcd", two_roots, 2, small, sizeof small), -ENAMETOOLONG);
  assert_int_equal(confine_locate("/data/exports/abc", two_roots, 2, small, sizeof small), 0);
  assert_string_equal(small, "abc");
}

static void test_locate_root_slash_holds_everything(void **state) {
  (void)state;
  const char *const slash[] = {"/"};
  char rel[PATH_MAX];
  assert_int_equal(confine_locate("/etc/passwd", slash, 1, rel, sizeof rel), 0);
  assert_string_equal(rel, "etc/passwd");
  assert_int_equal(confine_locate("/", slash, 1, rel, sizeof rel), 0);
  assert_string_equal(rel, "");
  assert_int_equal(confine_locate("/etc/../x", slash, 1, rel, sizeof rel), -EPERM);
}

/* ------------------------------------------------------------------------
 * confine_open_parent: the walk
 * ------------------------------------------------------------------------ */

/* A tree in a temporary directory:
 *   outside/              a directory next to the root, with secret
 *   root/a/b/             directories
 *   root/a/file           a regular file
 *   root/evil -> ../outside            a symbolic link to a directory outside
 *   root/a/inner -> b                  a symbolic link that stays inside
 *   root/link.safetensors -> ../outside/secret   a symbolic link to a file */
typedef struct tree {
  char top[64];
  char root[128];
  int root_fd;
} tree;

static void at(const tree *t, char *out, size_t out_bytes, const char *rel) {
  snprintf(out, out_bytes, "%s/%s", t->top, rel);
}

static int tree_setup(void **state) {
  tree *t = calloc(1, sizeof *t);
  assert_non_null(t);
  snprintf(t->top, sizeof t->top, "/tmp/test_confine.XXXXXX");
  assert_non_null(mkdtemp(t->top));
  char p[256], q[256];
  const char *dirs[] = {"outside", "root", "root/a", "root/a/b"};
  for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
    at(t, p, sizeof p, dirs[i]);
    assert_int_equal(mkdir(p, 0700), 0);
  }
  const char *files[] = {"outside/secret", "root/a/file"};
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
    at(t, p, sizeof p, files[i]);
    int fd = open(p, O_WRONLY | O_CREAT | O_EXCL, 0644);
    assert_true(fd >= 0);
    close(fd);
  }
  at(t, p, sizeof p, "outside");
  at(t, q, sizeof q, "root/evil");
  assert_int_equal(symlink(p, q), 0);
  at(t, q, sizeof q, "root/a/inner");
  assert_int_equal(symlink("b", q), 0);
  at(t, p, sizeof p, "outside/secret");
  at(t, q, sizeof q, "root/link.safetensors");
  assert_int_equal(symlink(p, q), 0);
  at(t, t->root, sizeof t->root, "root");
  t->root_fd = open(t->root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  assert_true(t->root_fd >= 0);
  *state = t;
  return 0;
}

static int tree_teardown(void **state) {
  tree *t = *state;
  close(t->root_fd);
  const char *unlinks[] = {"root/link.safetensors", "root/a/inner", "root/evil", "root/a/file",
                           "outside/secret"};
  const char *rmdirs[] = {"root/a/b", "root/a", "root", "outside", ""};
  char p[256];
  for (size_t i = 0; i < sizeof unlinks / sizeof unlinks[0]; i++) {
    at(t, p, sizeof p, unlinks[i]);
    unlink(p);
  }
  for (size_t i = 0; i < sizeof rmdirs / sizeof rmdirs[0]; i++) {
    at(t, p, sizeof p, rmdirs[i]);
    rmdir(p);
  }
  free(t);
  return 0;
}

/* The directory fd refers to is the one at path. */
static void expect_same_dir(int fd, const char *path) {
  struct stat got, want;
  assert_int_equal(fstat(fd, &got), 0);
  assert_int_equal(stat(path, &want), 0);
  if (got.st_ino != want.st_ino || got.st_dev != want.st_dev)
    fail_msg("the directory opened is not %s", path);
}

static void expect_walk_fails(const tree *t, const char *rel, int want_rc, size_t want_bad_len) {
  int dir_fd = -1;
  const char *name = NULL;
  size_t bad_len = 0;
  int rc = confine_open_parent(t->root_fd, rel, &dir_fd, &name, &bad_len);
  if (rc != want_rc)
    fail_msg("%s: %d (%s), expected %d (%s)", rel, rc, strerror(-rc), want_rc, strerror(-want_rc));
  if (bad_len != want_bad_len)
    fail_msg("%s: failed at '%.*s', expected '%.*s'", rel, (int)bad_len, rel, (int)want_bad_len,
             rel);
}

static void test_walk_opens_the_parent_of_the_last_component(void **state) {
  tree *t = *state;
  char want[256];
  int dir_fd;
  const char *name;
  assert_int_equal(confine_open_parent(t->root_fd, "a/b/out.safetensors", &dir_fd, &name, NULL), 0);
  assert_string_equal(name, "out.safetensors");
  at(t, want, sizeof want, "root/a/b");
  expect_same_dir(dir_fd, want);
  close(dir_fd);

  assert_int_equal(confine_open_parent(t->root_fd, "x", &dir_fd, &name, NULL), 0);
  assert_string_equal(name, "x");
  expect_same_dir(dir_fd, t->root);
  assert_true(dir_fd != t->root_fd); /* the caller's own, to close */
  close(dir_fd);

  /* The root itself: its own directory, named ".". */
  assert_int_equal(confine_open_parent(t->root_fd, "", &dir_fd, &name, NULL), 0);
  assert_string_equal(name, ".");
  expect_same_dir(dir_fd, t->root);
  close(dir_fd);
}

static void test_walk_never_follows_a_symbolic_link_on_the_way(void **state) {
  tree *t = *state;
  /* A link to a directory outside the root, and one that stays inside:
   * both refused, naming the link. */
  expect_walk_fails(t, "evil/out.safetensors", -ELOOP, strlen("evil"));
  expect_walk_fails(t, "evil/secret", -ELOOP, strlen("evil"));
  expect_walk_fails(t, "a/inner/x", -ELOOP, strlen("a/inner"));
}

static void test_walk_leaves_the_last_component_to_the_caller(void **state) {
  tree *t = *state;
  /* A symbolic link as the last component is not opened: the caller
   * looks at it with fstatat(AT_SYMLINK_NOFOLLOW) and refuses it. */
  int dir_fd;
  const char *name;
  assert_int_equal(confine_open_parent(t->root_fd, "link.safetensors", &dir_fd, &name, NULL), 0);
  struct stat st;
  assert_int_equal(fstatat(dir_fd, name, &st, AT_SYMLINK_NOFOLLOW), 0);
  assert_true(S_ISLNK(st.st_mode));
  /* Opened without following, it cannot be written through. */
  assert_true(openat(dir_fd, name, O_WRONLY | O_NOFOLLOW) < 0 && errno == ELOOP);
  close(dir_fd);
}

static void test_walk_names_what_is_missing_or_not_a_directory(void **state) {
  tree *t = *state;
  expect_walk_fails(t, "missing/x", -ENOENT, strlen("missing"));
  expect_walk_fails(t, "a/missing/deeper/x", -ENOENT, strlen("a/missing"));
  expect_walk_fails(t, "a/file/x", -ENOTDIR, strlen("a/file"));
}

static void test_walk_refuses_what_locate_never_makes(void **state) {
  tree *t = *state;
  expect_walk_fails(t, "../outside/secret", -EPERM, 2);
  expect_walk_fails(t, "a/../../outside", -EPERM, strlen("a/.."));
  expect_walk_fails(t, "a/..", -EPERM, strlen("a/.."));
  expect_walk_fails(t, "a//b/x", -EINVAL, strlen("a/"));
  expect_walk_fails(t, "/a/x", -EINVAL, 0);
  char rel[NAME_MAX + 16];
  memset(rel, 'n', NAME_MAX + 1);
  snprintf(rel + NAME_MAX + 1, sizeof rel - NAME_MAX - 1, "/x");
  expect_walk_fails(t, rel, -ENAMETOOLONG, NAME_MAX + 1);
}

/* ------------------------------------------------------------------------
 * filemode
 * ------------------------------------------------------------------------ */

static void test_file_mode_parse(void **state) {
  (void)state;
  mode_t mode;
  const struct {
    const char *text;
    int ok;
    mode_t mode;
  } cases[] = {
      {"0600", 1, 0600}, {"0640", 1, 0640}, {"0644", 1, 0644},  {"600", 1, 0600}, {"0660", 1, 0660},
      {"0700", 1, 0700}, {"0666", 0, 0},    {"0602", 0, 0},     {"0400", 0, 0},   {"0200", 0, 0},
      {"04600", 0, 0},   {"01600", 0, 0},   {"0o640", 0, 0},    {"640x", 0, 0},   {"", 0, 0},
      {"-0600", 0, 0},   {"0800", 0, 0},    {"00000600", 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    mode = 0;
    int rc = filemode_parse(cases[i].text, &mode);
    if (cases[i].ok && (rc != 0 || mode != cases[i].mode))
      fail_msg("'%s': %d, mode %o; expected %o", cases[i].text, rc, (unsigned)mode,
               (unsigned)cases[i].mode);
    if (!cases[i].ok && rc != -EINVAL)
      fail_msg("'%s' was accepted (mode %o)", cases[i].text, (unsigned)mode);
  }
  assert_int_equal(filemode_parse(NULL, &mode), -EINVAL);
}

static void test_dir_mode_adds_x_where_the_file_mode_reads(void **state) {
  (void)state;
  filemode_set(0600);
  assert_int_equal(filemode_file(), 0600);
  assert_int_equal(filemode_dir(), 0700);
  filemode_set(0640);
  assert_int_equal(filemode_dir(), 0750);
  filemode_set(0644);
  assert_int_equal(filemode_dir(), 0755);
  filemode_set(0660);
  assert_int_equal(filemode_dir(), 0770);
  filemode_set(FILEMODE_DEFAULT);
}

/* The mode is exact whatever the umask: a umask only takes bits away. */
static void test_modes_are_exact_under_a_umask(void **state) {
  tree *t = *state;
  mode_t old_umask = umask(077);
  filemode_set(0640);
  assert_int_equal(filemode_mkdirat(t->root_fd, "made"), 0);
  assert_int_equal(filemode_mkdirat(t->root_fd, "made"), -EEXIST);
  struct stat st;
  assert_int_equal(fstatat(t->root_fd, "made", &st, 0), 0);
  assert_int_equal(st.st_mode & 07777, 0750);
  int fd = openat(t->root_fd, "made/file", O_WRONLY | O_CREAT | O_EXCL, filemode_file());
  assert_true(fd >= 0);
  assert_int_equal(filemode_fix_file(fd), 0);
  assert_int_equal(fstat(fd, &st), 0);
  assert_int_equal(st.st_mode & 07777, 0640);
  close(fd);
  umask(old_umask);
  filemode_set(FILEMODE_DEFAULT);
  assert_int_equal(unlinkat(t->root_fd, "made/file", 0), 0);
  assert_int_equal(unlinkat(t->root_fd, "made", AT_REMOVEDIR), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_locate_places_absolute_paths_in_their_root),
      cmocka_unit_test(test_locate_drops_empty_and_dot_components_and_trailing_slashes),
      cmocka_unit_test(test_locate_takes_relative_paths_inside_the_first_root),
      cmocka_unit_test(test_locate_refuses_paths_outside_every_root),
      cmocka_unit_test(test_locate_refuses_dot_dot_anywhere),
      cmocka_unit_test(test_locate_refuses_empty_and_over_long_paths),
      cmocka_unit_test(test_locate_root_slash_holds_everything),
      cmocka_unit_test_setup_teardown(test_walk_opens_the_parent_of_the_last_component, tree_setup,
                                      tree_teardown),
      cmocka_unit_test_setup_teardown(test_walk_never_follows_a_symbolic_link_on_the_way,
                                      tree_setup, tree_teardown),
      cmocka_unit_test_setup_teardown(test_walk_leaves_the_last_component_to_the_caller, tree_setup,
                                      tree_teardown),
      cmocka_unit_test_setup_teardown(test_walk_names_what_is_missing_or_not_a_directory,
                                      tree_setup, tree_teardown),
      cmocka_unit_test_setup_teardown(test_walk_refuses_what_locate_never_makes, tree_setup,
                                      tree_teardown),
      cmocka_unit_test(test_file_mode_parse),
      cmocka_unit_test(test_dir_mode_adds_x_where_the_file_mode_reads),
      cmocka_unit_test_setup_teardown(test_modes_are_exact_under_a_umask, tree_setup,
                                      tree_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
