/* base_cache: the node's read-only cache of gathered base units
 * (docs/bases.md), shared by every job on a base and every rank of those
 * jobs on this node.
 *
 * A base never changes, so a unit of it gathered once is good for every
 * job on the base for as long as the base lives. An entry is a memfd region
 * holding one unit's full gathered values (working precision), keyed by
 * (base job id, base unit id). Ranks hold entries through references: a
 * rank's pool keeps one per base unit it has gathered (pool.c, BUF_BASE)
 * until its session ends or its pool is trimmed, and workers map the
 * region read-only (base_cache_read_only_fd). Entries nobody holds stay
 * cached, least recently used first out, while the cache is over its
 * budget; entries held are never evicted (each job's hold is what its
 * workers gather every step anyway), so the budget bounds what is kept for
 * jobs to come.
 *
 * Threads: any (a mutex); the executors of every job on the node. */
#ifndef ZEROD_BASE_CACHE_H
#define ZEROD_BASE_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "shm.h"

typedef struct base_cache base_cache;
typedef struct base_cache_entry base_cache_entry;

typedef struct base_cache_stats {
  uint64_t entries, bytes, held_bytes, budget;
  uint64_t hits, misses, evictions;
} base_cache_stats;

/* A cache keeping at most budget bytes of entries that nobody holds. NULL
 * if out of memory. */
base_cache *base_cache_create(uint64_t budget);
/* Frees the cache; every entry must have been let go. */
void base_cache_destroy(base_cache *c);

/* The entry of (base, unit), held for the caller, or NULL (counted as a
 * hit or a miss). */
base_cache_entry *base_cache_get(base_cache *c, uint64_t base, uint32_t unit);
/* Makes region the entry of (base, unit) and holds it for the caller; if
 * another rank put one first, region is destroyed and that one is held.
 * Takes region either way. */
base_cache_entry *base_cache_put(base_cache *c, uint64_t base, uint32_t unit, shm_region *region);
/* Lets go of a hold; evicts what the budget no longer allows. */
void base_cache_unref(base_cache *c, base_cache_entry *e);
/* Frees every entry of a base nobody holds (the base is going away). */
void base_cache_forget(base_cache *c, uint64_t base);

/* The entry's region (its mapping and its size, fd included). */
const shm_region *base_cache_region(const base_cache_entry *e);
/* A new descriptor of the entry's region opened read-only, for a worker:
 * it cannot map it writable (mmap of PROT_WRITE, MAP_SHARED fails with
 * EACCES). -1 with errno set on failure, as dup(2). */
int base_cache_read_only_fd(const base_cache_entry *e);

void base_cache_stats_get(base_cache *c, base_cache_stats *out);
/* The same for one base: its entries, their bytes, those held, and its
 * lookups and evictions (budget: the cache's). Forgetting a base drops
 * its counts. */
void base_cache_base_stats(base_cache *c, uint64_t base, base_cache_stats *out);

#endif /* ZEROD_BASE_CACHE_H */
