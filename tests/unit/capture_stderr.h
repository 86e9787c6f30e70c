/* capture_stderr.h - what a test prints to stderr, captured through a
 * temporary file put over file descriptor 2 (test_log.c, test_flags.c):
 * capture_begin(), the calls, then capture_end() returns the text (also in
 * `captured`, `captured_len` bytes; at most 8 KiB). Include after cmocka.h. */
#ifndef ZEROD_TESTS_CAPTURE_STDERR_H
#define ZEROD_TESTS_CAPTURE_STDERR_H

#include <stdio.h>
#include <unistd.h>

static char captured[8192];
static size_t captured_len;
static FILE *capture_file;
static int saved_stderr = -1;

static void capture_begin(void) {
  fflush(stderr);
  capture_file = tmpfile();
  assert_non_null(capture_file);
  saved_stderr = dup(STDERR_FILENO);
  assert_true(saved_stderr >= 0);
  assert_true(dup2(fileno(capture_file), STDERR_FILENO) >= 0);
}

static const char *capture_end(void) {
  fflush(stderr);
  dup2(saved_stderr, STDERR_FILENO);
  close(saved_stderr);
  rewind(capture_file);
  captured_len = fread(captured, 1, sizeof captured - 1, capture_file);
  captured[captured_len] = '\0';
  fclose(capture_file);
  return captured;
}

#endif /* ZEROD_TESTS_CAPTURE_STDERR_H */
