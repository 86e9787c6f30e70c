/* A rank's buffer pool (see pool.h). */
#include "pool.h"

#include "base_cache.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint64_t page_round(uint64_t bytes) {
  long page = sysconf(_SC_PAGESIZE);
  uint64_t p = page > 0 ? (uint64_t)page : 4096;
  return bytes == 0 ? p : (bytes + p - 1) / p * p;
}

/* A buffer no longer holds its unit's gathered values (or its secondary
 * partition). */
static void forget_unit(rank_state *rs, uint32_t slot) {
  pool_buf *b = &rs->bufs[slot];
  if (b->unit >= 0 && (uint64_t)b->unit < rs->nshards) {
    shard *sh = &rs->shards[b->unit];
    if ((b->kind == BUF_GATHER || b->kind == BUF_BASE) && sh->gather_buf == (int64_t)slot)
      sh->gather_buf = -1;
    if (b->kind == BUF_SECONDARY && sh->secondary_buf == (int64_t)slot)
      sh->secondary_buf = -1;
  }
  b->unit = -1;
  b->valid_version = UINT64_MAX;
}

/* Free buffers may be reused or evicted (pool_mode): a prefetch spares
 * current cache entries, which a worker is about to gather; an hpZ slice
 * spares the other slices (it would only push one out for another). */
static int available(const rank_state *rs, const pool_buf *b, pool_mode mode) {
  if (!b->in_use || b->refs > 0 || b->kind == BUF_BASE)
    return 0;
  if (b->kind == BUF_GRAD || b->valid_version != rs->version)
    return 1;
  return mode == POOL_DEMAND || (mode == POOL_SECONDARY && b->kind == BUF_GATHER);
}

/* Eviction order: current hpZ secondary partitions last (they are small
 * and outlive the gathers they came from: the backward pass needs them
 * after the forward's buffers are gone), least recently used first within
 * each. */
static int evict_before(const rank_state *rs, const pool_buf *a, const pool_buf *b) {
  int keep_a = a->kind == BUF_SECONDARY && a->valid_version == rs->version;
  int keep_b = b->kind == BUF_SECONDARY && b->valid_version == rs->version;
  if (keep_a != keep_b)
    return keep_b;
  return a->last_use < b->last_use;
}

/* Frees a free buffer. If the attached session was sent its descriptor (or
 * its CUDA IPC handles), the id goes on the list the next reply carries, so
 * the worker unmaps it (or closes them) too. */
static void drop(rank_state *rs, uint32_t slot) {
  pool_buf *b = &rs->bufs[slot];
  forget_unit(rs, slot);
  if (b->sent_session == rs->session_id && rs->session_id != 0) {
    if (rs->ndropped == rs->dropped_cap) {
      size_t cap = rs->dropped_cap ? rs->dropped_cap * 2 : 16;
      uint32_t *grown = realloc(rs->dropped_ids, cap * sizeof *grown);
      if (grown != NULL) {
        rs->dropped_ids = grown;
        rs->dropped_cap = cap;
      }
    }
    if (rs->ndropped < rs->dropped_cap)
      rs->dropped_ids[rs->ndropped++] = b->id;
  }
  if (b->kind == BUF_BASE) {
    base_cache_unref(b->base_cache, b->base_entry);
  } else {
    rs->pool_bytes -= b->buf.bytes;
    if (b->kind == BUF_SECONDARY)
      rs->secondary_bytes -= b->buf.bytes;
    device_buffer_destroy(rs->dev, &b->buf);
  }
  memset(b, 0, sizeof *b);
  b->unit = -1;
}

static const char *const kind_what[] = {"gathering", "a gradient buffer for",
                                        "the secondary partition of", "gathering base unit"};
static const char *const kind_name[] = {"gather", "grad", "hpz", "base"};

/* An unused slot of the table (grown by one if none), or -1. */
static int64_t free_slot(rank_state *rs) {
  for (uint32_t i = 0; i < rs->nbufs; i++)
    if (!rs->bufs[i].in_use)
      return i;
  pool_buf *grown = realloc(rs->bufs, (rs->nbufs + 1) * sizeof *grown);
  if (grown == NULL)
    return -1;
  rs->bufs = grown;
  memset(&rs->bufs[rs->nbufs], 0, sizeof rs->bufs[rs->nbufs]);
  return rs->nbufs++;
}

int64_t pool_adopt_base(rank_state *rs, base_cache *c, base_cache_entry *e, uint32_t unit) {
  int64_t slot = free_slot(rs);
  if (slot < 0)
    return -1;
  pool_buf *b = &rs->bufs[slot];
  const shm_region *r = base_cache_region(e);
  memset(b, 0, sizeof *b);
  b->buf.base = r->base;
  b->buf.bytes = r->bytes;
  b->buf.fd = r->fd;
  b->base_cache = c;
  b->base_entry = e;
  b->in_use = 1;
  b->id = ++rs->next_buf_id;
  b->kind = BUF_BASE;
  b->unit = unit;
  b->valid_version = UINT64_MAX;
  b->last_use = ++rs->tick;
  return slot;
}

int64_t pool_acquire(rank_state *rs, buf_kind kind, uint64_t bytes, const char *unit_name,
                     pool_mode mode, char *err, size_t err_bytes) {
  const uint64_t cap = rs->job->config.max_live_bytes;
  uint64_t need = page_round(bytes);
  if (rs->live_bytes + need > cap) {
    snprintf(err, err_bytes,
             "%s unit '%s' needs %" PRIu64 " bytes but %" PRIu64 " of the job's max_live_bytes "
             "%" PRIu64 " are held; release units first",
             kind_what[kind], unit_name, need, rs->live_bytes, cap);
    return -1;
  }
  int64_t best = -1;
  for (uint32_t i = 0; i < rs->nbufs; i++) {
    pool_buf *b = &rs->bufs[i];
    if (!available(rs, b, mode) || b->kind != kind || b->buf.bytes < need ||
        b->buf.bytes > 2 * need)
      continue;
    if (best < 0 || b->last_use < rs->bufs[best].last_use)
      best = i;
  }
  if (best >= 0) {
    forget_unit(rs, (uint32_t)best);
    return best;
  }
  while (rs->pool_bytes + need > cap) {
    int64_t victim = -1;
    for (uint32_t i = 0; i < rs->nbufs; i++)
      if (available(rs, &rs->bufs[i], mode) &&
          (victim < 0 || evict_before(rs, &rs->bufs[i], &rs->bufs[victim])))
        victim = i;
    if (victim < 0) {
      snprintf(err, err_bytes,
               "unit '%s' needs %" PRIu64 " bytes; the pool is full (max_live_bytes %" PRIu64 ")",
               unit_name, need, cap);
      return -1;
    }
    drop(rs, (uint32_t)victim);
  }
  int64_t slot = free_slot(rs);
  if (slot < 0) {
    snprintf(err, err_bytes, "out of memory for the buffer of unit '%s'", unit_name);
    return -1;
  }
  pool_buf *b = &rs->bufs[slot];
  /* A memfd's name shows in /proc/<pid>/fd, which makes leaks easy to see. */
  char name[96];
  snprintf(name, sizeof name, "zerod-%.64s-r%d-%s", rs->job->name, rs->rank, kind_name[kind]);
  int rc = device_buffer_create(rs->dev, &b->buf, name, need);
  if (rc != 0) {
    snprintf(err, err_bytes, "cannot create a %" PRIu64 "-byte %s buffer for unit '%s': %s", need,
             device_is_host(rs->dev) ? "shared-memory" : "GPU", unit_name,
             device_last_error(rs->dev));
    return -1;
  }
  b->in_use = 1;
  b->id = ++rs->next_buf_id;
  b->kind = kind;
  b->unit = -1;
  b->valid_version = UINT64_MAX;
  b->refs = 0;
  b->sent_session = 0;
  rs->pool_bytes += b->buf.bytes;
  if (kind == BUF_SECONDARY)
    rs->secondary_bytes += b->buf.bytes;
  return slot;
}

void pool_ref(rank_state *rs, pool_buf *b) {
  if (b->refs++ == 0 && b->kind != BUF_BASE)
    rs->live_bytes += b->buf.bytes;
  b->last_use = ++rs->tick;
}

void pool_unref(rank_state *rs, pool_buf *b) {
  if (b->refs > 0 && --b->refs == 0 && b->kind != BUF_BASE)
    rs->live_bytes -= b->buf.bytes;
}

/* All ranks trim at the same point of their op sequences (the loop queues
 * it for every rank at once), so their later decisions still agree. */
void pool_trim(rank_state *rs) {
  for (uint32_t i = 0; i < rs->nbufs; i++) {
    if (!rs->bufs[i].in_use)
      continue;
    if (rs->bufs[i].refs == 0)
      drop(rs, i);
    else
      rs->bufs[i].valid_version = UINT64_MAX; /* held: stale at its next gather */
  }
}

void pool_free_all(rank_state *rs) {
  for (uint32_t i = 0; i < rs->nbufs; i++)
    if (rs->bufs[i].in_use && rs->bufs[i].kind == BUF_BASE)
      base_cache_unref(rs->bufs[i].base_cache, rs->bufs[i].base_entry);
    else if (rs->bufs[i].in_use)
      device_buffer_destroy(rs->dev, &rs->bufs[i].buf);
  free(rs->bufs);
  free(rs->dropped_ids);
  rs->bufs = NULL;
  rs->dropped_ids = NULL;
  rs->nbufs = 0;
  rs->pool_bytes = rs->live_bytes = rs->secondary_bytes = 0;
}
