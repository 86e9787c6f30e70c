/* fsutil: files written to last (fsutil.h): whole reads and writes. */
#include "fsutil.h"

#include <errno.h>
#include <unistd.h>

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
