/* shm: memfd shared-memory regions that the daemon maps and hands to
 * workers with SCM_RIGHTS.
 *
 * Each region is sealed against shrinking and growing once sized, so a
 * worker holding the descriptor cannot truncate it under the daemon (which
 * would turn the daemon's next access into SIGBUS). */
#ifndef ZEROD_SHM_H
#define ZEROD_SHM_H

#include <stddef.h>

typedef struct shm_region {
  int fd;
  void *base;
  size_t bytes; /* mapped size, a multiple of the page size */
} shm_region;

/* Creates a zero-filled region of at least `bytes` (rounded up to pages),
 * named for /proc/<pid>/fd listings. Returns 0 or a negative errno. */
int shm_region_create(shm_region *region, const char *name, size_t bytes);
void shm_region_destroy(shm_region *region);

/* Reads exactly `bytes` from offset 0 of a descriptor a worker sent, with
 * pread (never mmap: the worker may truncate its own memfd at any time).
 * Returns 0, -EINVAL if the file is shorter, or a negative errno. */
int shm_read_fd(int fd, void *out, size_t bytes);

#endif /* ZEROD_SHM_H */
