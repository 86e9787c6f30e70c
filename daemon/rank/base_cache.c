/* The node's cache of gathered base units (base_cache.h). */
#include "base_cache.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

struct base_cache_entry {
  base_cache_entry *next;
  uint64_t base;
  uint32_t unit;
  shm_region region;
  int refs;
  uint64_t last_use; /* LRU tick of its last let-go */
};

/* One base's lookups and evictions, for its metrics. */
typedef struct base_counts {
  struct base_counts *next;
  uint64_t base;
  uint64_t hits, misses, evictions;
} base_counts;

struct base_cache {
  pthread_mutex_t mutex;
  base_cache_entry *entries;
  uint64_t budget, bytes, tick;
  uint64_t hits, misses, evictions;
  base_counts *counts; /* per base, made on its first lookup */
};

base_cache *base_cache_create(uint64_t budget) {
  base_cache *c = calloc(1, sizeof *c);
  if (c == NULL)
    return NULL;
  pthread_mutex_init(&c->mutex, NULL);
  c->budget = budget;
  return c;
}

static void entry_free(base_cache *c, base_cache_entry *e) {
  c->bytes -= e->region.bytes;
  shm_region_destroy(&e->region);
  free(e);
}

/* base's counts, made if needed; NULL if out of memory (with the mutex). */
static base_counts *counts_of(base_cache *c, uint64_t base) {
  for (base_counts *k = c->counts; k != NULL; k = k->next)
    if (k->base == base)
      return k;
  base_counts *k = calloc(1, sizeof *k);
  if (k != NULL) {
    k->base = base;
    k->next = c->counts;
    c->counts = k;
  }
  return k;
}

void base_cache_destroy(base_cache *c) {
  if (c == NULL)
    return;
  while (c->counts != NULL) {
    base_counts *k = c->counts;
    c->counts = k->next;
    free(k);
  }
  while (c->entries != NULL) {
    base_cache_entry *e = c->entries;
    c->entries = e->next;
    entry_free(c, e);
  }
  pthread_mutex_destroy(&c->mutex);
  free(c);
}

static base_cache_entry *find(base_cache *c, uint64_t base, uint32_t unit) {
  for (base_cache_entry *e = c->entries; e != NULL; e = e->next)
    if (e->base == base && e->unit == unit)
      return e;
  return NULL;
}

/* Bytes of entries somebody holds (with the mutex). */
static uint64_t held_bytes(const base_cache *c) {
  uint64_t held = 0;
  for (const base_cache_entry *e = c->entries; e != NULL; e = e->next)
    if (e->refs > 0)
      held += e->region.bytes;
  return held;
}

/* Evicts entries nobody holds, least recently used first, until those
 * left fit the budget (with the mutex). */
static void evict(base_cache *c) {
  for (;;) {
    uint64_t idle = c->bytes - held_bytes(c);
    if (idle <= c->budget)
      return;
    base_cache_entry **victim = NULL;
    for (base_cache_entry **at = &c->entries; *at != NULL; at = &(*at)->next)
      if ((*at)->refs == 0 && (victim == NULL || (*at)->last_use < (*victim)->last_use))
        victim = at;
    if (victim == NULL)
      return;
    base_cache_entry *e = *victim;
    *victim = e->next;
    base_counts *k = counts_of(c, e->base);
    if (k != NULL)
      k->evictions++;
    entry_free(c, e);
    c->evictions++;
  }
}

base_cache_entry *base_cache_get(base_cache *c, uint64_t base, uint32_t unit) {
  pthread_mutex_lock(&c->mutex);
  base_cache_entry *e = find(c, base, unit);
  base_counts *k = counts_of(c, base);
  if (e != NULL) {
    e->refs++;
    c->hits++;
  } else {
    c->misses++;
  }
  if (k != NULL)
    *(e != NULL ? &k->hits : &k->misses) += 1;
  pthread_mutex_unlock(&c->mutex);
  return e;
}

base_cache_entry *base_cache_put(base_cache *c, uint64_t base, uint32_t unit, shm_region *region) {
  pthread_mutex_lock(&c->mutex);
  base_cache_entry *e = find(c, base, unit);
  if (e == NULL && (e = calloc(1, sizeof *e)) != NULL) {
    e->base = base;
    e->unit = unit;
    e->region = *region;
    c->bytes += region->bytes;
    e->next = c->entries;
    c->entries = e;
  } else {
    shm_region_destroy(region);
  }
  if (e != NULL)
    e->refs++;
  evict(c);
  pthread_mutex_unlock(&c->mutex);
  region->fd = -1;
  region->base = NULL;
  return e;
}

void base_cache_unref(base_cache *c, base_cache_entry *e) {
  if (e == NULL)
    return;
  pthread_mutex_lock(&c->mutex);
  if (e->refs > 0 && --e->refs == 0) {
    e->last_use = ++c->tick;
    evict(c);
  }
  pthread_mutex_unlock(&c->mutex);
}

void base_cache_forget(base_cache *c, uint64_t base) {
  pthread_mutex_lock(&c->mutex);
  for (base_cache_entry **at = &c->entries; *at != NULL;) {
    base_cache_entry *e = *at;
    if (e->base == base && e->refs == 0) {
      *at = e->next;
      entry_free(c, e);
    } else {
      at = &e->next;
    }
  }
  for (base_counts **at = &c->counts; *at != NULL; at = &(*at)->next) {
    if ((*at)->base == base) {
      base_counts *k = *at;
      *at = k->next;
      free(k);
      break;
    }
  }
  pthread_mutex_unlock(&c->mutex);
}

const shm_region *base_cache_region(const base_cache_entry *e) {
  return &e->region;
}

int base_cache_read_only_fd(const base_cache_entry *e) {
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", e->region.fd);
  return open(path, O_RDONLY | O_CLOEXEC);
}

void base_cache_stats_get(base_cache *c, base_cache_stats *out) {
  pthread_mutex_lock(&c->mutex);
  uint64_t n = 0;
  for (const base_cache_entry *e = c->entries; e != NULL; e = e->next)
    n++;
  *out = (base_cache_stats){.entries = n,
                            .bytes = c->bytes,
                            .held_bytes = held_bytes(c),
                            .budget = c->budget,
                            .hits = c->hits,
                            .misses = c->misses,
                            .evictions = c->evictions};
  pthread_mutex_unlock(&c->mutex);
}

void base_cache_base_stats(base_cache *c, uint64_t base, base_cache_stats *out) {
  pthread_mutex_lock(&c->mutex);
  *out = (base_cache_stats){.budget = c->budget};
  for (const base_cache_entry *e = c->entries; e != NULL; e = e->next) {
    if (e->base != base)
      continue;
    out->entries++;
    out->bytes += e->region.bytes;
    out->held_bytes += e->refs > 0 ? e->region.bytes : 0;
  }
  for (const base_counts *k = c->counts; k != NULL; k = k->next) {
    if (k->base == base) {
      out->hits = k->hits;
      out->misses = k->misses;
      out->evictions = k->evictions;
    }
  }
  pthread_mutex_unlock(&c->mutex);
}
