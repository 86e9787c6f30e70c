/* ckpt_io: the small helpers every part of the checkpoint formats uses
 * (ckpt_io.h): error messages, base names and joined paths. */
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
