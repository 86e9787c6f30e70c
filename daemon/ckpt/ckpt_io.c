/* ckpt_io: the small helpers every part of the checkpoint formats uses
 * (ckpt_io.h): error messages, base names and joined paths, whole
 * preads and pwrites. */
#include "ckpt_io.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int ckpt_fail(char *err, size_t err_bytes, int rc, const char *fmt, ...) {
  if (err != NULL && err_bytes > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_bytes, fmt, ap);
    va_end(ap);
  }
  return rc;
}

void ckpt_prefix_error(char *err, size_t err_bytes, const char *prefix) {
  if (err == NULL || err_bytes == 0)
    return;
  char inner[512];
  snprintf(inner, sizeof inner, "%s", err);
  snprintf(err, err_bytes, "%s: %s", prefix, inner);
}

const char *ckpt_base_name(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash != NULL ? slash + 1 : path;
}

char *ckpt_join_path(const char *dir, const char *file) {
  size_t dir_len = strlen(dir), file_len = strlen(file);
  char *path = malloc(dir_len + 1 + file_len + 1);
  if (path == NULL)
    return NULL;
  memcpy(path, dir, dir_len);
  path[dir_len] = '/';
  memcpy(path + dir_len + 1, file, file_len + 1);
  return path;
}

/* Both loops below go on after EINTR and short transfers. A read that
 * meets the end of the file returns 1: the file is shorter than its size
 * said (it shrank under us), which callers report as truncated. */
int ckpt_pread_all(int fd, void *buf, size_t bytes, uint64_t offset) {
  uint8_t *at = buf;
  while (bytes > 0) {
    ssize_t n = pread(fd, at, bytes, (off_t)offset);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return -errno;
    }
    if (n == 0)
      return 1;
    at += n;
    bytes -= (size_t)n;
    offset += (uint64_t)n;
  }
  return 0;
}

int ckpt_pwrite_all(int fd, const void *buf, size_t bytes, uint64_t offset) {
  const uint8_t *at = buf;
  while (bytes > 0) {
    ssize_t n = pwrite(fd, at, bytes, (off_t)offset);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return -errno;
    }
    if (n == 0)
      return -EIO; /* no progress and no error: do not spin */
    at += n;
    bytes -= (size_t)n;
    offset += (uint64_t)n;
  }
  return 0;
}
