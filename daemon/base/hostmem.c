/* hostmem: see hostmem.h. */
#include "hostmem.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* hostmem_populate_ahead's chunk: the writer behind it waits for none. */
#define AHEAD_CHUNK ((size_t)4 << 20)

void *hostmem_alloc(size_t bytes) {
  void *p =
      mmap(NULL, bytes ? bytes : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

int hostmem_populate(void *p, size_t bytes) {
  return bytes == 0 || madvise(p, bytes, MADV_POPULATE_WRITE) == 0 ? 0 : -errno;
}

struct hostmem_ahead {
  pthread_t thread;
  hostmem_range *ranges;
  unsigned nranges;
  atomic_int stop;
};

/* [p, p + bytes) shrunk to whole pages (madvise takes a page-aligned
 * start, and a range that is not a whole buffer of ours may share its
 * first and last pages with memory the kernel must not be asked about). */
static int whole_pages(hostmem_range *r) {
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  uintptr_t b = ((uintptr_t)r->p + page - 1) & ~(page - 1);
  uintptr_t e = ((uintptr_t)r->p + r->bytes) & ~(page - 1);
  r->p = (void *)b;
  r->bytes = e > b ? e - b : 0;
  return r->bytes > 0;
}

static void *ahead_main(void *arg) {
  hostmem_ahead *a = arg;
  for (unsigned i = 0; i < a->nranges; i++) {
    uint8_t *p = a->ranges[i].p;
    size_t bytes = a->ranges[i].bytes;
    for (size_t at = 0; at < bytes; at += AHEAD_CHUNK) {
      if (atomic_load(&a->stop) ||
          hostmem_populate(p + at, bytes - at < AHEAD_CHUNK ? bytes - at : AHEAD_CHUNK) != 0)
        return NULL;
    }
  }
  return NULL;
}

hostmem_ahead *hostmem_populate_ahead_ranges(const hostmem_range *ranges, unsigned n) {
  hostmem_ahead *a = calloc(1, sizeof *a);
  if (a == NULL || (a->ranges = calloc(n ? n : 1, sizeof *a->ranges)) == NULL)
    goto fail;
  for (unsigned i = 0; i < n; i++) {
    a->ranges[a->nranges] = ranges[i];
    a->nranges += whole_pages(&a->ranges[a->nranges]);
  }
  if (a->nranges > 0 && pthread_create(&a->thread, NULL, ahead_main, a) == 0)
    return a;
fail:
  if (a != NULL)
    free(a->ranges);
  free(a);
  return NULL;
}

hostmem_ahead *hostmem_populate_ahead(void *p, size_t bytes) {
  return hostmem_populate_ahead_ranges(&(hostmem_range){p, bytes}, 1);
}

void hostmem_populate_stop(hostmem_ahead *a) {
  if (a == NULL)
    return;
  atomic_store(&a->stop, 1);
  pthread_join(a->thread, NULL);
  free(a->ranges);
  free(a);
}

void hostmem_free(void *p, size_t bytes) {
  if (p != NULL)
    munmap(p, bytes ? bytes : 1);
}

/* A shared buffer is preceded by a page holding its count and size. */
#define SHARED_HEADER ((size_t)4096)

typedef struct shared_header {
  atomic_int refs;
  size_t bytes; /* the whole mapping */
} shared_header;

void *hostmem_shared_alloc(size_t bytes) {
  uint8_t *base = hostmem_alloc(bytes + SHARED_HEADER);
  if (base == NULL)
    return NULL;
  shared_header *h = (shared_header *)base;
  atomic_init(&h->refs, 1);
  h->bytes = bytes + SHARED_HEADER;
  return base + SHARED_HEADER;
}

_Static_assert(SHARED_HEADER == HOSTMEM_SHARED_FILE_OFFSET, "a mapped file's header is a page");

void *hostmem_shared_map_file(int fd, size_t bytes) {
  size_t total = bytes + SHARED_HEADER;
  uint8_t *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  if (base == MAP_FAILED)
    return NULL;
  shared_header *h = (shared_header *)base;
  atomic_init(&h->refs, 1);
  h->bytes = total; /* unmapped whole by the last unref, as an allocation is */
  return base + SHARED_HEADER;
}

void hostmem_shared_ref(void *p) {
  atomic_fetch_add(&((shared_header *)((uint8_t *)p - SHARED_HEADER))->refs, 1);
}

void hostmem_shared_unref(void *p) {
  if (p == NULL)
    return;
  shared_header *h = (shared_header *)((uint8_t *)p - SHARED_HEADER);
  if (atomic_fetch_sub(&h->refs, 1) == 1)
    hostmem_free(h, h->bytes);
}

/* An array's header, the 64 bytes before it: mapped arrays begin a page
 * after their mapping (the header ends that first page), heap arrays 64
 * bytes into their allocation. */
#define ARRAY_MAGIC       0x7a64617272617931ull /* "zdarray1" */
#define ARRAY_MAPPED_FROM ((size_t)1 << 20)

typedef struct array_header {
  uint64_t magic;
  size_t map_bytes; /* the whole mapping; 0: on the heap */
  uint8_t pad[48];
} array_header;

void *hostmem_array_alloc(size_t bytes) {
  size_t rounded = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
  if (rounded < bytes) {
    errno = ENOMEM;
    return NULL;
  }
  array_header *h;
  uint8_t *p;
  if (rounded >= ARRAY_MAPPED_FROM) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t map_bytes = page + (rounded + page - 1) / page * page;
    uint8_t *base = hostmem_alloc(map_bytes);
    if (base == NULL)
      return NULL;
    p = base + page;
    h = (array_header *)p - 1;
    h->map_bytes = map_bytes;
  } else {
    h = aligned_alloc(64, sizeof *h + rounded);
    if (h == NULL)
      return NULL;
    p = (uint8_t *)(h + 1);
    h->map_bytes = 0;
  }
  h->magic = ARRAY_MAGIC;
  return p;
}

void hostmem_array_free(void *p) {
  if (p == NULL)
    return;
  array_header *h = (array_header *)p - 1;
  if (h->magic != ARRAY_MAGIC)
    abort(); /* not an array of ours: freeing it would corrupt memory */
  h->magic = 0;
  if (h->map_bytes != 0)
    hostmem_free((uint8_t *)p - (size_t)sysconf(_SC_PAGESIZE), h->map_bytes);
  else
    free(h);
}

void *hostmem_array_zalloc(size_t bytes) {
  void *p = hostmem_array_alloc(bytes);
  if (p != NULL && !hostmem_array_mapped(p))
    memset(p, 0, bytes);
  return p;
}

int hostmem_array_mapped(const void *p) {
  return ((const array_header *)p - 1)->map_bytes != 0;
}
