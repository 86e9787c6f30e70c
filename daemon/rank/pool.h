/* pool: a rank's shared buffers (memfd regions, or GPU allocations exported
 * with CUDA IPC, device.h) — gathered units and gradient buffers —
 * bounded by the job's max_live_bytes (docs/architecture.md).
 *
 * The pool belongs to the rank's executor (or to the loop while the
 * executor is idle, see exec.h). Every decision here (reuse, eviction,
 * refusal) depends only on the pool's state, which is the same on every
 * rank of a job because every rank runs the same sequence of ops; the
 * collectives that follow from those decisions therefore agree. */
#ifndef ZEROD_POOL_H
#define ZEROD_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "job.h"

/* What an acquisition may reuse or evict, besides free buffers that hold
 * nothing current (stale gathers and slices, gradient buffers). */
typedef enum pool_mode {
  POOL_DEMAND,    /* a worker waits for it: any free buffer */
  POOL_PREFETCH,  /* ahead of need: no current gather or secondary slice */
  POOL_SECONDARY, /* an hpZ slice: current gathers, not other current slices */
} pool_mode;

/* Finds or makes a free buffer of at least `bytes` for `kind`: the least
 * recently used free buffer that fits without wasting more than half of it,
 * else a new one after evicting free buffers (least recently used first,
 * current hpZ secondary slices last) until the pool fits under the cap.
 * Returns the slot, or -1 with a message naming unit_name in err (-ENOSPC
 * semantics: the caller answers RESOURCE_EXHAUSTED, or stays quiet for a
 * prefetch or a slice). */
int64_t pool_acquire(rank_state *rs, buf_kind kind, uint64_t bytes, const char *unit_name,
                     pool_mode mode, char *err, size_t err_bytes);

/* A slot for a gathered base unit, the node's base cache's entry e, whose
 * hold the slot takes over (pool_buf.base_entry, of cache c): never counted in the
 * pool's bytes, never reused or evicted for other units; let go when the
 * pool is trimmed or freed. -1 if out of memory. */
struct base_cache;
struct base_cache_entry;
int64_t pool_adopt_base(rank_state *rs, struct base_cache *c, struct base_cache_entry *e,
                        uint32_t unit);

/* A holder takes or gives back a buffer; live_bytes counts held buffers. */
void pool_ref(rank_state *rs, pool_buf *b);
void pool_unref(rank_state *rs, pool_buf *b);

/* Frees every buffer nobody holds and forgets every cached gather. */
void pool_trim(rank_state *rs);

/* Frees every buffer (the rank is going away). */
void pool_free_all(rank_state *rs);

#endif /* ZEROD_POOL_H */
