/* hostmem: large host buffers: a host rank's state arrays, and the
 * checkpoint copies (a save's snapshot of a rank's state, a restore's
 * staging).
 *
 * Fresh anonymous memory costs a page fault per 4 KiB page the first time
 * it is written (allocation and zeroing in the kernel: about 0.35 ms per
 * MiB on the project's VM, several times a plain memcpy).
 * hostmem_populate faults a range in without touching what it holds, so
 * that a thread with time to spare pays for the faults and the thread that
 * copies into the buffer, e.g. a rank's executor while training waits,
 * does not; and hostmem_free gives the memory back to the kernel at once
 * (munmap), where malloc might keep it. No transparent huge pages: see
 * docs/decisions.md. Any thread. */
#ifndef ZEROD_HOSTMEM_H
#define ZEROD_HOSTMEM_H

#include <stddef.h>

/* bytes of zeroed memory (at least one page), not faulted in; NULL with
 * errno set on failure. */
void *hostmem_alloc(size_t bytes);
/* Faults in [p, p + bytes) of a buffer from hostmem_alloc, leaving what
 * it holds as it is, so other threads may be writing to it meanwhile
 * (MADV_POPULATE_WRITE). 0, or -EINVAL before Linux 5.14, -ENOMEM when
 * memory is short: the pages then fault when written, as they would have. */
int hostmem_populate(void *p, size_t bytes);
/* A thread that faults in [p, p + bytes) from the start, by chunks, while
 * the caller writes into it from the start too (a restore's reads): the
 * faults happen beside the writes instead of inside them. NULL if no
 * thread could be started (the pages fault when written). Stop (at the
 * next chunk, waiting for the thread) before freeing the buffer. */
typedef struct hostmem_ahead hostmem_ahead;
hostmem_ahead *hostmem_populate_ahead(void *p, size_t bytes);
/* The same over several ranges in turn, in the order given (the order of
 * the writes), each of any anonymous memory (from hostmem_alloc, or heap
 * arrays from hostmem_array_alloc): only the whole pages inside a range
 * are faulted in. NULL also when no range holds a whole page. */
typedef struct hostmem_range {
  void *p;
  size_t bytes;
} hostmem_range;
hostmem_ahead *hostmem_populate_ahead_ranges(const hostmem_range *ranges, unsigned n);
void hostmem_populate_stop(hostmem_ahead *a);

/* p from hostmem_alloc(bytes), or NULL. */
void hostmem_free(void *p, size_t bytes);

/* A buffer shared by threads that each hold a reference (a save's copy:
 * the rank copying into it, the writer faulting it in meanwhile): made
 * with one reference and unmapped when the last one is dropped. NULL as
 * for hostmem_alloc; unref of NULL does nothing. */
void *hostmem_shared_alloc(size_t bytes);
void hostmem_shared_ref(void *p);
void hostmem_shared_unref(void *p);

/* The same over a file: bytes of fd from file offset
 * HOSTMEM_SHARED_FILE_OFFSET (the first page is the header's, privately
 * copied when written), mapped private; the pages are the file's (the
 * page cache's, reclaimable), not anonymous memory. The file may be
 * unlinked and closed once this returns. NULL with errno on failure. */
#define HOSTMEM_SHARED_FILE_OFFSET ((size_t)4096)
void *hostmem_shared_map_file(int fd, size_t bytes);

/* The arrays a host rank keeps its state in (device_host.c), and a
 * restore's staged values, which a host rank takes as its own (rank/snapshot.c):
 * 64-byte aligned and padded to 64 bytes, NOT zeroed. From 1 MiB they are
 * mappings of their own (given back to the kernel when freed, and zero
 * when fresh; hostmem_array_mapped), smaller ones come from the heap.
 * NULL with errno set on failure; free of NULL does nothing, of anything
 * else than such an array aborts. */
void *hostmem_array_alloc(size_t bytes);
/* The same, zero-filled (a mapped array is zero already). */
void *hostmem_array_zalloc(size_t bytes);
void hostmem_array_free(void *p);
int hostmem_array_mapped(const void *p);

#endif /* ZEROD_HOSTMEM_H */
