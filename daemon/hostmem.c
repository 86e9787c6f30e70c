/* hostmem: see hostmem.h. */
#include "hostmem.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

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
  uint8_t *p;
  size_t bytes;
  atomic_int stop;
};

static void *ahead_main(void *arg) {
  hostmem_ahead *a = arg;
  for (size_t at = 0; at < a->bytes && !atomic_load(&a->stop); at += AHEAD_CHUNK)
    if (hostmem_populate(a->p + at, a->bytes - at < AHEAD_CHUNK ? a->bytes - at : AHEAD_CHUNK) != 0)
      break;
  return NULL;
}

hostmem_ahead *hostmem_populate_ahead(void *p, size_t bytes) {
  hostmem_ahead *a = calloc(1, sizeof *a);
  if (a == NULL || bytes == 0)
    goto fail;
  a->p = p;
  a->bytes = bytes;
  if (pthread_create(&a->thread, NULL, ahead_main, a) == 0)
    return a;
fail:
  free(a);
  return NULL;
}

void hostmem_populate_stop(hostmem_ahead *a) {
  if (a == NULL)
    return;
  atomic_store(&a->stop, 1);
  pthread_join(a->thread, NULL);
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
