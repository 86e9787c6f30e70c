/* fsutil: the durable-file steps (fsutil.h): whole reads and writes, a
 * directory's fsync, a file replaced whole. */
#include "fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "filemode.h"

/* Both loops below go on after EINTR and short transfers. A read that
 * meets the end of the file returns 1: the file is shorter than its size
 * said (it shrank under us), which callers report as truncated. */
int fsutil_pread_all(int fd, void *buf, size_t bytes, uint64_t offset) {
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

int fsutil_pwrite_all(int fd, const void *buf, size_t bytes, uint64_t offset) {
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

int fsutil_fsync_dir(const char *dir, const char **failed) {
  const char *unused;
  failed = failed != NULL ? failed : &unused;
  *failed = "open";
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  *failed = "fsync";
  int rc = fsync(fd) == 0 ? 0 : -errno;
  close(fd);
  return rc;
}

int fsutil_replace(const char *path, const void *bytes, size_t len, const char **failed) {
  const char *unused;
  failed = failed != NULL ? failed : &unused;
  size_t path_len = strlen(path);
  char *tmp = malloc(path_len + 5);
  if (tmp == NULL) {
    *failed = "alloc";
    return -ENOMEM;
  }
  memcpy(tmp, path, path_len);
  memcpy(tmp + path_len, ".tmp", 5);
  /* O_TRUNC, not O_EXCL: a .tmp left by a crash is ours to replace. */
  *failed = "open";
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, filemode_file());
  if (fd < 0) {
    int rc = -errno;
    free(tmp);
    return rc;
  }
  int rc;
  if ((rc = filemode_fix_file(fd)) != 0)
    *failed = "fchmod";
  else if ((rc = fsutil_pwrite_all(fd, bytes, len, 0)) != 0)
    *failed = "write";
  else if (fsync(fd) != 0) {
    rc = -errno;
    *failed = "fsync";
  }
  if (close(fd) != 0 && rc == 0) {
    rc = -errno;
    *failed = "close";
  }
  if (rc == 0 && rename(tmp, path) != 0) {
    rc = -errno;
    *failed = "rename";
  }
  if (rc != 0)
    unlink(tmp);
  free(tmp);
  return rc;
}

int fsutil_mkdir_p(const char *path) {
  char buf[PATH_MAX];
  if (path[0] == '\0')
    return -ENOENT;
  if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
    return -ENAMETOOLONG;
  for (char *p = buf + 1;; p++) {
    if (*p != '/' && *p != '\0')
      continue;
    char saved = *p;
    *p = '\0';
    int rc = filemode_mkdirat(AT_FDCWD, buf);
    if (rc != 0 && rc != -EEXIST)
      return rc;
    *p = saved;
    if (saved == '\0')
      return 0;
  }
}
