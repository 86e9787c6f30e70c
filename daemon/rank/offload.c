/* offload: a GPU rank's optimizer state off the GPU (offload.h). */
#include "offload.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "log.h"
#include "tier.h"

/* One staging slot: a chunk's gradients on their way down, its new
 * working copy on its way up, and the fences that say when each copy is
 * done. */
typedef struct offload_slot {
  float *grad;
  void *working;
  void *down, *up;
  int up_pending; /* an upload from `working` was enqueued and not waited for */
} offload_slot;

typedef struct rank_offload {
  device *host; /* the CPU kernels, on the rank's thread pool */
  unsigned nslots;
  uint64_t chunk; /* elements */
  int pinned;
  offload_slot slots[JOB_MAX_OFFLOAD_BUFFERS]; /* buffer_count of them (config.c bounds it) */
} rank_offload;

int offload_enabled(const rank_state *rs) {
  job_offload o = rs->job->config.offload_device;
  return !device_is_host(rs->dev) && (o == JOB_OFFLOAD_CPU || o == JOB_OFFLOAD_NVME);
}

uint64_t offload_host_state_bytes(const rank_state *rs, const unit_layout *l) {
  int has[JOB_NSTATES];
  return l->shard_numel * 4 * (uint64_t)job_config_states(&rs->job->config, has);
}

uint64_t offload_staging_bytes(const job_config *c) {
  return (uint64_t)c->offload_buffer_count * c->offload_buffer_size *
         (4 + zk_dtype_size(c->working_dtype));
}

void offload_close(rank_state *rs) {
  rank_offload *o = rs->offload;
  if (o == NULL)
    return;
  if (rs->dev != NULL)
    device_sync(rs->dev);
  for (unsigned s = 0; s < o->nslots; s++) {
    offload_slot *slot = &o->slots[s];
    device_staging_free(rs->dev, slot->grad, o->pinned);
    device_staging_free(rs->dev, slot->working, o->pinned);
    device_fence_destroy(rs->dev, slot->down);
    device_fence_destroy(rs->dev, slot->up);
  }
  device_close(o->host);
  free(o);
  rs->offload = NULL;
}

/* The rank's staging, made on first use: buffer_count slots of
 * buffer_size elements. */
static int offload_get(rank_state *rs, rank_offload **out) {
  if (rs->offload != NULL) {
    *out = rs->offload;
    return 0;
  }
  const job_config *c = &rs->job->config;
  rank_offload *o = calloc(1, sizeof *o);
  if (o == NULL)
    return -ENOMEM;
  o->nslots = c->offload_buffer_count;
  o->chunk = c->offload_buffer_size;
  o->pinned = c->offload_pin_memory;
  rs->offload = o;
  int rc = device_host_open(rs->pool, &o->host);
  size_t wbytes = o->chunk * zk_dtype_size(c->working_dtype);
  for (unsigned s = 0; rc == 0 && s < o->nslots; s++) {
    offload_slot *slot = &o->slots[s];
    rc = device_staging_alloc(rs->dev, o->chunk * sizeof(float), o->pinned, (void **)&slot->grad);
    if (rc == 0)
      rc = device_staging_alloc(rs->dev, wbytes, o->pinned, &slot->working);
    if (rc == 0)
      rc = device_fence_create(rs->dev, &slot->down);
    if (rc == 0)
      rc = device_fence_create(rs->dev, &slot->up);
  }
  if (rc != 0) {
    LOG_ERRORF("no staging for an offloaded optimizer", "job=%s rank=%d bytes=%llu err=\"%s\"",
               rs->job->name, rs->rank, (unsigned long long)offload_staging_bytes(c),
               device_last_error(rs->dev));
    offload_close(rs);
    return rc;
  }
  LOG_INFOF("optimizer state off the GPU",
            "job=%s rank=%d device=%s buffers=%u buffer_size=%llu "
            "pinned=%d staging_bytes=%llu",
            rs->job->name, rs->rank, job_offload_name(c->offload_device), o->nslots,
            (unsigned long long)o->chunk, o->pinned, (unsigned long long)offload_staging_bytes(c));
  *out = o;
  return 0;
}

/* Waits for the upload a slot's working chunk was last sent with. */
static int slot_free_working(rank_state *rs, offload_slot *slot) {
  if (!slot->up_pending)
    return 0;
  slot->up_pending = 0;
  return device_fence_wait(rs->dev, slot->up);
}

/* Sends the slot's working chunk up to [begin, begin + n) of the
 * shard's working copy, with the fence that says when the slot is free. */
static int send_working(rank_state *rs, offload_slot *slot, shard *sh, uint64_t begin, uint64_t n) {
  size_t welem = zk_dtype_size(rs->job->config.working_dtype);
  int rc = device_upload_async(rs->dev, (uint8_t *)sh->working + begin * welem, slot->working,
                               n * welem);
  if (rc == 0)
    rc = device_fence_record(rs->dev, slot->up);
  slot->up_pending = rc == 0;
  return rc;
}

/* Whether the shard's trainable ranges cover [begin, end): then the
 * update writes every element of the working chunk. */
static int trainable_covers(const shard *sh, uint64_t begin, uint64_t end) {
  uint64_t at = begin;
  for (unsigned k = 0; k < sh->ntrainable && at < end; k++) {
    if (sh->trainable[k].end <= at)
      continue;
    if (sh->trainable[k].begin > at)
      return 0;
    at = sh->trainable[k].end;
  }
  return at >= end;
}

/* ---- the step ------------------------------------------------------------ */

/* A step in progress: the chunks (tier_chunks' list: the order tier_stream
 * visits a tier file in), how far the gradients were asked for, and which
 * chunk is updated next. */
typedef struct step_ctx {
  rank_state *rs;
  rank_offload *o;
  tier_chunk *tasks;
  size_t ntasks;
  size_t next_down; /* the first chunk whose gradients are not asked for yet */
  size_t cursor;    /* the next chunk to update */
  offload_update_fn fn;
  void *arg;
  uint64_t wait_ns; /* waiting for copies (the log's wait_ms) */
  uint64_t cpu_ns;  /* in the update (cpu_ms) */
} step_ctx;

/* Asks for the gradients of the chunks up to `upto`, each into its slot
 * (chunk i in slot i % nslots, whose last chunk the CPU is done with). */
static int ask_gradients(step_ctx *x, size_t upto) {
  rank_state *rs = x->rs;
  while (x->next_down < x->ntasks && x->next_down <= upto) {
    const tier_chunk *k = &x->tasks[x->next_down];
    offload_slot *slot = &x->o->slots[x->next_down % x->o->nslots];
    int rc = device_download_async(rs->dev, slot->grad, rs->shards[k->unit].grad_acc + k->begin,
                                   k->n * sizeof(float));
    if (rc == 0)
      rc = device_fence_record(rs->dev, slot->down);
    if (rc != 0)
      return rc;
    x->next_down++;
  }
  return 0;
}

/* Chunk x->cursor, its master and moments at hand in host memory. */
static int step_chunk(step_ctx *x, float *master, float *m1, float *m2) {
  rank_state *rs = x->rs;
  rank_offload *o = x->o;
  size_t i = x->cursor++;
  if (i >= x->ntasks)
    return -EIO; /* the tier's chunks and ours disagree: a bug */
  const tier_chunk *k = &x->tasks[i];
  shard *sh = &rs->shards[k->unit];
  offload_slot *slot = &o->slots[i % o->nslots];
  zk_dtype wdtype = rs->job->config.working_dtype;
  /* Up to nslots - 1 chunks of gradients are on their way while the CPU
   * works on this one. */
  int rc = ask_gradients(x, i + o->nslots - 1);
  uint64_t t0 = clock_now_ns();
  if (rc == 0)
    rc = device_fence_wait(rs->dev, slot->down);
  if (rc == 0)
    rc = slot_free_working(rs, slot);
  uint64_t t1 = clock_now_ns();
  /* Frozen tensors and padding keep their values: the working chunk
   * starts as the master's, and the update overwrites what it trains. */
  if (rc == 0 && !trainable_covers(sh, k->begin, k->begin + k->n))
    rc = device_cast(o->host, slot->working, wdtype, master, ZK_F32, k->n);
  if (rc == 0)
    rc = x->fn(x->arg, rs, o->host, sh, k->begin, k->n, master, m1, m2, slot->grad, slot->working);
  x->wait_ns += t1 - t0;
  x->cpu_ns += clock_now_ns() - t1;
  return rc == 0 ? send_working(rs, slot, sh, k->begin, k->n) : rc;
}

static int tier_step_chunk(void *arg, rank_state *rs, shard *sh, const unit_layout *l,
                           uint64_t begin, uint64_t n, float *master, float *m1, float *m2) {
  step_ctx *x = arg;
  (void)rs;
  (void)n;
  if (x->cursor >= x->ntasks || x->tasks[x->cursor].unit != l->id ||
      x->tasks[x->cursor].begin != begin || &x->rs->shards[l->id] != sh)
    return -EIO;
  return step_chunk(x, master, m1, m2);
}

int offload_step(rank_state *rs, offload_update_fn fn, void *arg) {
  if (!offload_enabled(rs))
    return 0;
  step_ctx x = {.rs = rs, .fn = fn, .arg = arg};
  uint64_t start = clock_now_ns();
  int rc = offload_get(rs, &x.o);
  if (rc == 0)
    rc = tier_chunks(rs, x.o->chunk, -1, &x.tasks, &x.ntasks);
  if (rc != 0 || x.ntasks == 0) {
    free(x.tasks);
    return rc;
  }
  if (tier_enabled(rs->job)) {
    rc = tier_stream(rs, -1, 1, tier_step_chunk, &x);
  } else {
    for (size_t i = 0; rc == 0 && i < x.ntasks; i++) {
      const tier_chunk *k = &x.tasks[i];
      shard *sh = &rs->shards[k->unit];
      rc = step_chunk(&x, sh->master + k->begin, sh->moment1 ? sh->moment1 + k->begin : NULL,
                      sh->moment2 ? sh->moment2 + k->begin : NULL);
    }
  }
  if (rc == 0 && x.cursor != x.ntasks)
    rc = -EIO;
  /* Every copy lands before the slots are used again (or freed). */
  for (unsigned s = 0; s < x.o->nslots; s++) {
    int wrc = slot_free_working(rs, &x.o->slots[s]);
    if (rc == 0)
      rc = wrc;
  }
  int src = device_sync(rs->dev);
  LOG_DEBUGF("offloaded step", "job=%s rank=%d chunks=%zu total_ms=%.3f cpu_ms=%.3f wait_ms=%.3f",
             rs->job->name, rs->rank, x.ntasks, (double)(clock_now_ns() - start) / 1e6,
             (double)x.cpu_ns / 1e6, (double)x.wait_ns / 1e6);
  free(x.tasks);
  return rc != 0 ? rc : src;
}

/* ---- the working copy and whole states ----------------------------------- */

/* The working copy of [begin, begin + n) from that stretch of master
 * (host memory), through slot 0: each call waits for the last upload from
 * it, the caller for the last one. */
static int upload_working(rank_state *rs, shard *sh, uint64_t begin, uint64_t n,
                          const float *master) {
  rank_offload *o = rs->offload;
  offload_slot *slot = &o->slots[0];
  int rc = slot_free_working(rs, slot);
  if (rc == 0)
    rc = device_cast(o->host, slot->working, rs->job->config.working_dtype, master, ZK_F32, n);
  return rc == 0 ? send_working(rs, slot, sh, begin, n) : rc;
}

static int tier_working_chunk(void *arg, rank_state *rs, shard *sh, const unit_layout *l,
                              uint64_t begin, uint64_t n, float *master, float *m1, float *m2) {
  (void)arg;
  (void)l;
  (void)m1;
  (void)m2;
  return upload_working(rs, sh, begin, n, master);
}

int offload_refresh_working(rank_state *rs, const unit_layout *l, shard *sh) {
  rank_offload *o;
  int rc = offload_get(rs, &o);
  if (rc != 0)
    return rc;
  if (sh->tiered) {
    rc = tier_stream(rs, (int64_t)l->id, 0, tier_working_chunk, NULL);
  } else {
    for (uint64_t b = 0; rc == 0 && b < l->shard_numel; b += o->chunk)
      rc = upload_working(rs, sh, b, l->shard_numel - b < o->chunk ? l->shard_numel - b : o->chunk,
                          sh->master + b);
  }
  int wrc = slot_free_working(rs, &o->slots[0]);
  return rc != 0 ? rc : wrc;
}

int offload_state_copy(rank_state *rs, shard *sh, const unit_layout *l, uint32_t state,
                       const float *src) {
  rank_offload *o;
  int rc = offload_get(rs, &o);
  offload_slot *slot = rc == 0 ? &o->slots[0] : NULL;
  for (uint64_t b = 0; rc == 0 && b < l->shard_numel; b += o->chunk) {
    uint64_t n = l->shard_numel - b < o->chunk ? l->shard_numel - b : o->chunk;
    rc = device_download(rs->dev, slot->grad, src + b, n * sizeof(float));
    if (rc == 0)
      rc = tier_write_state_range(rs, sh, l, (int)state, b, n, slot->grad);
  }
  return rc;
}
