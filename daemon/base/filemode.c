/* The permissions of what the daemon writes (filemode.h). */
#include "filemode.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static mode_t file_mode = FILEMODE_DEFAULT;

int filemode_parse(const char *text, mode_t *out) {
  char *end;
  if (text == NULL || text[0] < '0' || text[0] > '7')
    return -EINVAL;
  errno = 0;
  unsigned long v = strtoul(text, &end, 8);
  if (errno != 0 || *end != '\0' || end - text > 4 || v > 0777)
    return -EINVAL;
  mode_t mode = (mode_t)v;
  if ((mode & 0600) != 0600 || (mode & 0002) != 0)
    return -EINVAL;
  *out = mode;
  return 0;
}

void filemode_set(mode_t mode) {
  file_mode = mode & 0777;
}

mode_t filemode_file(void) {
  return file_mode;
}

mode_t filemode_dir(void) {
  return file_mode | 0700 | ((file_mode & 0044) >> 2);
}

int filemode_fix_file(int fd) {
  return fchmod(fd, file_mode) == 0 ? 0 : -errno;
}

int filemode_mkdirat(int dir_fd, const char *name) {
  mode_t mode = filemode_dir();
  if (mkdirat(dir_fd, name, mode) != 0)
    return -errno;
  /* The umask may have taken bits away. Opened without following, so
   * that what is changed is the directory just made. */
  int fd = openat(dir_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  int rc = fchmod(fd, mode) == 0 ? 0 : -errno;
  close(fd);
  return rc;
}
