/* fsutil: the file steps the daemon's durable files are written and read
 * with, one copy each: whole preads and pwrites, a directory's fsync, a
 * file replaced whole (write, fsync, rename), mkdir -p. Included by the
 * checkpoint formats (daemon/ckpt/), the coordinator's checkpoints
 * (daemon/coord/ckpt_*.c) and the binary's directories (daemon/cli/).
 * Thread-safe (no state). */
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

/* fsyncs a directory, so that the entries made or renamed in it survive
 * a crash. Returns 0 or a negative errno, with *failed (if not NULL) the
 * step that failed: "open" or "fsync". */
int fsutil_fsync_dir(const char *dir, const char **failed);

/* Replaces path whole: writes path.tmp (made with the file mode,
 * filemode.h; a .tmp left by a crash is overwritten), fsyncs it and
 * renames it over path, so that path is either the old file or the
 * complete new one. The directory is the caller's to fsync
 * (fsutil_fsync_dir). Returns 0, or a negative errno with *failed (if not
 * NULL) the step that failed: "alloc", "open", "fchmod", "write",
 * "fsync", "close" (of path.tmp) or "rename"; path.tmp is then removed. */
int fsutil_replace(const char *path, const void *bytes, size_t len, const char **failed);

/* mkdir -p: makes path and every missing directory above it, each with
 * the directory mode (filemode.h); those that exist are left as they are.
 * Returns 0, -ENOENT for "", -ENAMETOOLONG past PATH_MAX, or the first
 * mkdir's negative errno (-ENOTDIR: a file is in the way). */
int fsutil_mkdir_p(const char *path);

#endif /* ZEROD_FSUTIL_H */
