/* ckpt_fs: the file helpers of the coordinator's checkpoint files
 * (coord_ckpt.h): paths, directories made and synced, recursive removal
 * that never follows a symbolic link, and the status a failed file
 * operation answers with. None of them keeps state; every one is safe on
 * any thread (the thread pool runs most of them, ckpt_pool.c). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "coord_ckpt.h"
#include "filemode.h"

/* Status for a failed file operation of the coordinator's own: a full disk
 * is RESOURCE_EXHAUSTED, the rest UNAVAILABLE (an operator fixes the
 * filesystem and retries). */
int coord__ckpt_io_status(int errnum) {
  return errnum == ENOSPC || errnum == EDQUOT || errnum == ENOMEM ? RPC_RESOURCE_EXHAUSTED
                                                                  : RPC_UNAVAILABLE;
}

/* Formats a path. coord__ckpt_init makes sure that the checkpoint
 * directory leaves 512 bytes of PATH_MAX, more than anything appended here
 * needs (a job and a checkpoint name of at most 64 bytes each, a mark with
 * an id, a shard file's name), so nothing is cut off; vsnprintf rather
 * than snprintf because the compiler cannot know that. */
void coord__ckpt_path_format(char *out, size_t out_bytes, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(out, out_bytes, fmt, ap);
  va_end(ap);
}

/* Copies a name that has been checked to fit (a valid name: 64 bytes). */
void coord__ckpt_copy_name(char *out, size_t out_bytes, const char *name) {
  size_t len = strnlen(name, out_bytes - 1);
  memcpy(out, name, len);
  out[len] = '\0';
}

int coord__ckpt_is_dir_at(int dir_fd, const struct dirent *e) {
  if (e->d_type == DT_DIR)
    return 1;
  if (e->d_type != DT_UNKNOWN)
    return 0;
  struct stat st;
  return fstatat(dir_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
}

/* Removes name (in the directory parent_fd) and everything under it,
 * never following symbolic links. Safe on any thread. */
int coord__ckpt_remove_at(int parent_fd, const char *name, int depth) {
  if (unlinkat(parent_fd, name, 0) == 0 || errno == ENOENT)
    return 0;
  if (errno != EISDIR && errno != EPERM)
    return -errno;
  if (depth >= CKPT_MAX_TREE_DEPTH)
    return -ELOOP;
  int fd = openat(parent_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  DIR *d = fdopendir(fd);
  if (d == NULL) {
    int rc = -errno;
    close(fd);
    return rc;
  }
  int rc = 0;
  /* A file created while we read (a rank still writing into a failed
   * save) is caught by the next pass. */
  for (int pass = 0; pass < 3; pass++) {
    struct dirent *e;
    rewinddir(d);
    while ((e = readdir(d)) != NULL) {
      if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
        continue;
      int child = coord__ckpt_remove_at(dirfd(d), e->d_name, depth + 1);
      if (child != 0 && rc == 0)
        rc = child;
    }
    if (rc != 0)
      break;
    if (unlinkat(parent_fd, name, AT_REMOVEDIR) == 0 || errno == ENOENT) {
      closedir(d);
      return 0;
    }
    if (errno != ENOTEMPTY && errno != EEXIST) {
      rc = -errno;
      break;
    }
  }
  closedir(d);
  return rc != 0 ? rc : -ENOTEMPTY;
}

int coord__ckpt_rmtree(const char *path) {
  return coord__ckpt_remove_at(AT_FDCWD, path, 0);
}

/* Whether path is dir or below it. */
int coord__ckpt_path_below(const char *path, const char *dir) {
  size_t len = strlen(dir);
  return strncmp(path, dir, len) == 0 && (path[len] == '/' || path[len] == '\0');
}

int coord__ckpt_work_fail(work_result *r, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->message, sizeof r->message, fmt, ap);
  va_end(ap);
  r->status = status;
  return status;
}

int coord__ckpt_ends_with(const char *s, const char *suffix) {
  size_t len = strlen(s), suffix_len = strlen(suffix);
  return len >= suffix_len && strcmp(s + len - suffix_len, suffix) == 0;
}
