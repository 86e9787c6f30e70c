/* Paths kept inside root directories (confine.h). */
#include "confine.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Copies path's components into out joined by single '/' (with a leading
 * '/' if path is absolute), dropping empty and "." components. Returns
 * the length written, or -EPERM for "..", -ENAMETOOLONG. */
static long normalize(const char *path, char *out, size_t out_bytes) {
  size_t len = 0;
  if (out_bytes == 0)
    return -ENAMETOOLONG;
  if (path[0] == '/')
    out[len++] = '/';
  const char *p = path;
  while (*p != '\0') {
    while (*p == '/')
      p++;
    size_t comp_len = strcspn(p, "/");
    if (comp_len == 0)
      break;
    if (comp_len == 2 && p[0] == '.' && p[1] == '.')
      return -EPERM;
    if (!(comp_len == 1 && p[0] == '.')) {
      if (comp_len > NAME_MAX)
        return -ENAMETOOLONG;
      int sep = len > 0 && out[len - 1] != '/';
      if (len + (size_t)sep + comp_len >= out_bytes)
        return -ENAMETOOLONG;
      if (sep)
        out[len++] = '/';
      memcpy(out + len, p, comp_len);
      len += comp_len;
    }
    p += comp_len;
  }
  if (len >= out_bytes)
    return -ENAMETOOLONG;
  out[len] = '\0';
  return (long)len;
}

int confine_locate(const char *path, const char *const *roots, unsigned nroots, char *rel_out,
                   size_t rel_bytes) {
  if (path == NULL || path[0] == '\0')
    return -EINVAL;
  if (path[0] != '/') {
    if (nroots == 0)
      return -EINVAL;
    long rc = normalize(path, rel_out, rel_bytes);
    return rc < 0 ? (int)rc : 0;
  }
  char norm[PATH_MAX];
  long norm_len = normalize(path, norm, sizeof norm);
  if (norm_len < 0)
    return (int)norm_len;
  for (unsigned i = 0; i < nroots; i++) {
    const char *root = roots[i];
    size_t root_len = strlen(root);
    const char *rest;
    if (root_len == 1 && root[0] == '/')
      rest = norm + 1;
    else if (strncmp(norm, root, root_len) == 0 && norm[root_len] == '/')
      rest = norm + root_len + 1;
    else if (strncmp(norm, root, root_len) == 0 && norm[root_len] == '\0')
      rest = norm + root_len;
    else
      continue;
    size_t rest_len = strlen(rest);
    if (rest_len >= rel_bytes)
      return -ENAMETOOLONG;
    memcpy(rel_out, rest, rest_len + 1);
    return (int)i;
  }
  return -EACCES;
}

/* Why openat(dir_fd, name, O_DIRECTORY | O_NOFOLLOW) failed with rc: the
 * kernel answers ELOOP or ENOTDIR for a symbolic link depending on the
 * flags, so a failure is looked at once more without following. */
static int classify_failure(int dir_fd, const char *name, int rc) {
  struct stat st;
  if ((rc == -ELOOP || rc == -ENOTDIR) && fstatat(dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0)
    return S_ISLNK(st.st_mode) ? -ELOOP : S_ISDIR(st.st_mode) ? rc : -ENOTDIR;
  return rc;
}

int confine_open_parent(int root_fd, const char *rel, int *dir_fd_out, const char **name_out,
                        size_t *bad_len_out) {
  size_t bad_len = 0;
  /* A descriptor of our own, so that the caller closes what it gets
   * whether or not rel had a directory component. */
  int fd = openat(root_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  if (rel[0] == '\0') {
    *dir_fd_out = fd;
    *name_out = ".";
    return 0;
  }
  const char *comp = rel;
  int rc = 0;
  for (;;) {
    const char *slash = strchr(comp, '/');
    size_t comp_len = slash != NULL ? (size_t)(slash - comp) : strlen(comp);
    bad_len = (size_t)(comp - rel) + comp_len;
    if (comp_len == 0) {
      rc = -EINVAL; /* an empty component: not what confine_locate makes */
      break;
    }
    if (comp_len > NAME_MAX) {
      rc = -ENAMETOOLONG;
      break;
    }
    if (comp_len == 2 && comp[0] == '.' && comp[1] == '.') {
      rc = -EPERM;
      break;
    }
    if (slash == NULL) {
      *dir_fd_out = fd;
      *name_out = comp;
      return 0;
    }
    char name[NAME_MAX + 1];
    memcpy(name, comp, comp_len);
    name[comp_len] = '\0';
    int next = openat(fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) {
      rc = classify_failure(fd, name, -errno);
      break;
    }
    close(fd);
    fd = next;
    comp = slash + 1;
  }
  close(fd);
  if (bad_len_out != NULL)
    *bad_len_out = bad_len;
  return rc;
}
