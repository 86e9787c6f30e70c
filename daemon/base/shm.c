/* memfd regions (see shm.h). */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int shm_region_create(shm_region *region, const char *name, size_t bytes) {
  long page = sysconf(_SC_PAGESIZE);
  size_t page_bytes = page > 0 ? (size_t)page : 4096;
  size_t mapped_bytes = (bytes + page_bytes - 1) / page_bytes * page_bytes;
  if (mapped_bytes == 0)
    mapped_bytes = page_bytes;
  region->fd = -1;
  region->base = NULL;
  region->bytes = 0;
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return -errno;
  if (ftruncate(fd, (off_t)mapped_bytes) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int err = -errno;
    close(fd);
    return err;
  }
  void *base = mmap(NULL, mapped_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    int err = -errno;
    close(fd);
    return err;
  }
  region->fd = fd;
  region->base = base;
  region->bytes = mapped_bytes;
  return 0;
}

void shm_region_destroy(shm_region *region) {
  if (region->base != NULL)
    munmap(region->base, region->bytes);
  if (region->fd >= 0)
    close(region->fd);
  region->base = NULL;
  region->fd = -1;
  region->bytes = 0;
}

int shm_read_fd(int fd, void *out, size_t bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0)
    return -errno;
  if (!S_ISREG(st.st_mode) || (size_t)st.st_size < bytes)
    return -EINVAL;
  size_t done = 0;
  while (done < bytes) {
    ssize_t n = pread(fd, (char *)out + done, bytes - done, (off_t)done);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return -errno;
    }
    if (n == 0)
      return -EINVAL; /* truncated while we read */
    done += (size_t)n;
  }
  return 0;
}
