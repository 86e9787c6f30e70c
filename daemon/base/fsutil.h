/* fsutil: the file steps the daemon's durable files are written and read
 * with, one copy each: whole preads and pwrites. Included by the
 * checkpoint formats (daemon/ckpt/). Thread-safe (no state). */
#ifndef ZEROD_FSUTIL_H
#define ZEROD_FSUTIL_H

#include <stddef.h>
#include <stdint.h>

/* Whole transfers at offset, going on after EINTR and short ones. pread
 * returns 1 if the file ends first (it is shorter than expected:
 * truncated); pwrite returns -EIO if no progress is made. Otherwise 0 or
 * a negative errno. */
int fsutil_pread_all(int fd, void *buf, size_t bytes, uint64_t offset);
int fsutil_pwrite_all(int fd, const void *buf, size_t bytes, uint64_t offset);

#endif /* ZEROD_FSUTIL_H */
