/* Versions, pins and copy-on-write snapshots (see pin.h). */
#include "pin.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "log.h"
#include "rank_metrics.h"
#include "zerod/v1/ipc.pb-c.h"

/* ------------------------------------------------------------------------ */
/* Setup                                                                    */
/* ------------------------------------------------------------------------ */

static void snapshot_free(pin_snapshot *s) {
  for (uint32_t u = 0; u < s->nunits; u++)
    free(s->working[u]);
  free(s->working);
  s->working = NULL;
  s->nunits = 0;
}

static void pin_free(job *j, job_pin *p) {
  if (p == NULL)
    return;
  if (p->snapshots != NULL)
    for (int r = 0; r < j->nranks; r++)
      snapshot_free(&p->snapshots[r]);
  free(p->snapshots);
  free(p->saved);
  free(p);
}

void pin_job_clear(job *j) {
  /* Every session has let go of its pin by now; free what is left anyway. */
  while (j->pins != NULL) {
    job_pin *p = j->pins;
    j->pins = p->next;
    pin_free(j, p);
  }
}

/* ------------------------------------------------------------------------ */
/* Pins                                                                     */
/* ------------------------------------------------------------------------ */

/* pin_mutex held. */
static job_pin *find_pin(job *j, uint64_t version) {
  for (job_pin *p = j->pins; p != NULL; p = p->next)
    if (p->version == version)
      return p;
  return NULL;
}

/* pin_mutex held. Drops a reference; returns the pin if it must be freed
 * (after the mutex is released), else NULL. */
static job_pin *unref_locked(job *j, job_pin *p) {
  if (--p->refs > 0)
    return NULL;
  for (job_pin **at = &j->pins; *at != NULL; at = &(*at)->next)
    if (*at == p) {
      *at = p->next;
      break;
    }
  return p;
}

/* pin_mutex held. */
/* A rank's index in the job's arrays (ranks, rank_locks, a pin's saved and
 * snapshots): its local index, which equals its global rank only where this
 * daemon hosts the whole job (read-only assembly needs that, see ipc.c). */
static ptrdiff_t local_index(const rank_state *rs) {
  return rs - rs->job->ranks;
}

static uint64_t max_rank_version(job *j) {
  uint64_t v = 0;
  for (int r = 0; r < j->nranks; r++)
    if (j->ranks[r].version > v)
      v = j->ranks[r].version;
  return v;
}

uint64_t pin_latest_version(job *j) {
  return atomic_load(&j->latest_version);
}

static int pin_count(const job *j) {
  int n = 0;
  for (const job_pin *p = j->pins; p != NULL; p = p->next)
    n++;
  return n;
}

job_pin *pin_acquire_latest(job *j, int max_pins, int *over) {
  if (over != NULL)
    *over = 0;
  pthread_mutex_lock(&j->pin_mutex);
  /* A rank that is writing has already counted its new version (see
   * pin_begin_write), so the pinned version is never one that a rank is
   * overwriting right now without saving it. */
  uint64_t version = max_rank_version(j);
  job_pin *p = find_pin(j, version);
  if (p != NULL) {
    p->refs++;
    pthread_mutex_unlock(&j->pin_mutex);
    return p;
  }
  if (max_pins > 0 && pin_count(j) >= max_pins) {
    pthread_mutex_unlock(&j->pin_mutex);
    if (over != NULL)
      *over = 1;
    return NULL;
  }
  p = calloc(1, sizeof *p);
  if (p != NULL) {
    p->saved = calloc((size_t)j->nranks, sizeof *p->saved);
    p->snapshots = calloc((size_t)j->nranks, sizeof *p->snapshots);
    if (p->saved == NULL || p->snapshots == NULL) {
      pin_free(j, p);
      p = NULL;
    }
  }
  if (p != NULL) {
    p->version = version;
    p->refs = 1;
    p->next = j->pins;
    j->pins = p;
  }
  pthread_mutex_unlock(&j->pin_mutex);
  return p;
}

void pin_release(job *j, job_pin *p) {
  if (p == NULL)
    return;
  pthread_mutex_lock(&j->pin_mutex);
  job_pin *dead = unref_locked(j, p);
  pthread_mutex_unlock(&j->pin_mutex);
  pin_free(j, dead);
}

/* ------------------------------------------------------------------------ */
/* Writers                                                                  */
/* ------------------------------------------------------------------------ */

/* Copies the rank's working slices of every unit it holds (from its device,
 * into host memory). Runs on the rank's executor with its write lock held,
 * so the slices are stable and the shard table cannot grow. */
static int snapshot_take(rank_state *rs, pin_snapshot *out, uint64_t *copied) {
  job *j = rs->job;
  size_t elem_bytes = zk_dtype_size(j->config.working_dtype);
  out->nunits = 0;
  out->working = calloc(rs->nshards ? rs->nshards : 1, sizeof *out->working);
  if (out->working == NULL)
    return -ENOMEM;
  out->nunits = rs->nshards;
  for (uint32_t u = 0; u < rs->nshards; u++) {
    const shard *sh = &rs->shards[u];
    const unit_layout *l = sh->present ? job_unit(j, u) : NULL;
    if (l == NULL)
      continue;
    size_t bytes = l->shard_numel * elem_bytes;
    out->working[u] = malloc(bytes ? bytes : 1);
    if (out->working[u] == NULL) {
      snapshot_free(out);
      return -ENOMEM;
    }
    int rc = device_download(rs->dev, out->working[u], sh->working, bytes);
    *copied += bytes;
    if (rc != 0) {
      snapshot_free(out);
      return rc;
    }
  }
  return 0;
}

void pin_begin_write(rank_state *rs) {
  pin_begin_write_to(rs, 0);
}

void pin_begin_write_to(rank_state *rs, uint64_t to_version) {
  job *j = rs->job;
  pthread_rwlock_wrlock(&j->rank_locks[local_index(rs)]);
  pthread_mutex_lock(&j->pin_mutex);
  uint64_t version = rs->version;
  job_pin *p = find_pin(j, version);
  if (p != NULL && !p->saved[local_index(rs)])
    p->refs++; /* kept alive while its snapshot is made */
  else
    p = NULL;
  /* The new version counts at once: a pin made from now on is of this
   * version or later, whose values this rank is writing now and readers
   * will find live once the write lock is released. Only the pin found
   * above can need this rank's current values. */
  rs->version = to_version > version ? to_version : version + 1;
  if (atomic_load(&j->latest_version) < rs->version)
    atomic_store(&j->latest_version, rs->version);
  pthread_mutex_unlock(&j->pin_mutex);
  if (p == NULL)
    return;

  /* The copy is made outside pin_mutex, so readers of other ranks and
   * other ranks' writers go on meanwhile; readers of this rank wait on
   * the write lock and find the snapshot when they get in. */
  pin_snapshot snap = {0};
  uint64_t copied = 0;
  int rc = snapshot_take(rs, &snap, &copied);
  if (rc != 0)
    LOG_ERRORF("pin snapshot failed", "job=%s rank=%d version=%llu err=\"%s\"", j->name, rs->rank,
               (unsigned long long)version, strerror(-rc));
  else
    rank_metrics_pin_snapshot(rs, copied);
  pthread_mutex_lock(&j->pin_mutex);
  p->snapshots[local_index(rs)] = snap;
  p->saved[local_index(rs)] = 1;
  if (rc != 0)
    p->lost = 1;
  job_pin *dead = unref_locked(j, p);
  pthread_mutex_unlock(&j->pin_mutex);
  pin_free(j, dead);
}

void pin_start_at(rank_state *rs, uint64_t version) {
  job *j = rs->job;
  pthread_mutex_lock(&j->pin_mutex);
  rs->version = version;
  if (atomic_load(&j->latest_version) < version)
    atomic_store(&j->latest_version, version);
  pthread_mutex_unlock(&j->pin_mutex);
}

void pin_mark_changing(rank_state *rs, unit_layout *l) {
  pin_mark_changed_at(l, rs->version + 1);
}

void pin_mark_changed_at(unit_layout *l, uint64_t next) {
  uint64_t seen = atomic_load(&l->changed_version);
  while (seen < next && !atomic_compare_exchange_weak(&l->changed_version, &seen, next)) {
  }
}

void pin_mark_step(rank_state *rs) {
  for (uint32_t u = 0; u < rs->nshards; u++) {
    if (!rs->shards[u].present || rs->shards[u].from_base)
      continue;
    unit_layout *l = job_unit(rs->job, u);
    if (l != NULL && l->trainable)
      pin_mark_changing(rs, l);
  }
}

void pin_end_write(rank_state *rs) {
  job *j = rs->job;
  pthread_rwlock_unlock(&j->rank_locks[local_index(rs)]);
  pin_wake(j);
}

void pin_lock_shards(rank_state *rs) {
  pthread_rwlock_wrlock(&rs->job->rank_locks[local_index(rs)]);
}

void pin_unlock_shards(rank_state *rs) {
  pthread_rwlock_unlock(&rs->job->rank_locks[local_index(rs)]);
}

void pin_wake(job *j) {
  pthread_mutex_lock(&j->pin_mutex);
  pthread_cond_broadcast(&j->pin_cond);
  pthread_mutex_unlock(&j->pin_mutex);
}

void pin_job_stop(job *j) {
  pthread_mutex_lock(&j->pin_mutex);
  j->pins_stopping = 1;
  pthread_cond_broadcast(&j->pin_cond);
  pthread_mutex_unlock(&j->pin_mutex);
}

/* ------------------------------------------------------------------------ */
/* Readers                                                                  */
/* ------------------------------------------------------------------------ */

/* pin_mutex held: reasons to stop reading, whatever the ranks do. */
static int read_stopped(job *j, const pin_read_control *c, char *err, size_t err_bytes) {
  if (j->pins_stopping) {
    snprintf(err, err_bytes, "zerod is shutting down");
    return ZEROD__V1__STATUS__STATUS_UNAVAILABLE;
  }
  if (c->cancel != NULL && atomic_load(c->cancel)) {
    snprintf(err, err_bytes, "the session is closing");
    return ZEROD__V1__STATUS__STATUS_UNAVAILABLE;
  }
  return 0;
}

/* pin_mutex held, no rank lock held: waits until a rank moves on. Returns
 * 0 to retry, or a status when the job failed or the wait timed out. */
static int wait_for_rank(job *j, const pin_read_control *c, const struct timespec *deadline,
                         int rank, uint64_t version, char *err, size_t err_bytes) {
  char reason[512];
  if (job_failed(j, c->generation, reason, sizeof reason)) {
    snprintf(err, err_bytes, "job '%s' failed while reading version %llu: %s", j->name,
             (unsigned long long)version, reason);
    return ZEROD__V1__STATUS__STATUS_ABORTED;
  }
  LOG_DEBUGF("reader waits", "job=%s rank=%d version=%llu", j->name, rank,
             (unsigned long long)version);
  if (pthread_cond_timedwait(&j->pin_cond, &j->pin_mutex, deadline) == ETIMEDOUT) {
    snprintf(err, err_bytes,
             "rank %d of job '%s' did not reach version %llu within the collective timeout "
             "(%d s)",
             rank, j->name, (unsigned long long)version, c->timeout_ms / 1000);
    return ZEROD__V1__STATUS__STATUS_UNAVAILABLE;
  }
  return 0;
}

/* Copies a rank's live slice out of its device memory; rank lock held.
 * Returns 0, or a status with a message in err. */
static int copy_live_slice(job *j, int rank, const unit_layout *l, const void *src, void *dst,
                           size_t bytes, char *err, size_t err_bytes) {
  int rc = device_read(j->ranks[rank].dev, dst, src, bytes);
  if (rc == 0)
    return 0;
  snprintf(err, err_bytes, "copying unit '%s' from rank %d's device failed: %s", l->name, rank,
           strerror(-rc));
  return ZEROD__V1__STATUS__STATUS_INTERNAL;
}

/* Copies a slice of bytes at offset `at` of the unit from src to dst,
 * block by block (PIN_DELTA_BLOCK_BYTES of the unit): a block whose bytes
 * already match is left alone, one that differs is written and its bit
 * set in changed. */
static void delta_copy(uint8_t *dst, const uint8_t *src, size_t bytes, size_t at,
                       uint8_t *changed) {
  size_t done = 0;
  while (done < bytes) {
    size_t block = (at + done) / PIN_DELTA_BLOCK_BYTES;
    size_t end = (block + 1) * PIN_DELTA_BLOCK_BYTES - at;
    size_t n = (end < bytes ? end : bytes) - done;
    if (memcmp(dst + done, src + done, n) != 0) {
      memcpy(dst + done, src + done, n);
      changed[block / 8] |= (uint8_t)(1u << (block % 8));
    }
    done += n;
  }
}

/* Marks the blocks of a slice written whole (a delta read from a device). */
static void delta_mark(size_t bytes, size_t at, uint8_t *changed) {
  if (bytes == 0)
    return;
  for (size_t b = at / PIN_DELTA_BLOCK_BYTES; b <= (at + bytes - 1) / PIN_DELTA_BLOCK_BYTES; b++)
    changed[b / 8] |= (uint8_t)(1u << (b % 8));
}

/* Rank r's slice into its place in dst: a plain copy, or a delta read's
 * (c->changed). A live slice in device memory is read whole and marked
 * (comparing would need a host copy of it first). Rank lock held. */
static int copy_slice(job *j, int r, const unit_layout *l, const void *src, int live, uint8_t *dst,
                      size_t slice_bytes, const pin_read_control *c, char *err, size_t err_bytes) {
  size_t at = (size_t)r * slice_bytes;
  int host = !live || device_is_host(j->ranks[r].dev);
  if (c->changed != NULL && host) {
    delta_copy(dst + at, src, slice_bytes, at, c->changed);
    return 0;
  }
  if (c->changed != NULL)
    delta_mark(slice_bytes, at, c->changed);
  if (!live) {
    memcpy(dst + at, src, slice_bytes);
    return 0;
  }
  return copy_live_slice(j, r, l, src, dst + at, slice_bytes, err, err_bytes);
}

/* A rank's live slice of the unit; rank lock held. */
static const void *live_slice(job *j, int rank, const unit_layout *l) {
  const rank_state *rs = &j->ranks[rank];
  if (l->id >= rs->nshards || !rs->shards[l->id].present)
    return NULL;
  return rs->shards[l->id].working;
}

/* Pinned: each rank on its own, under its read lock only. A rank's slice
 * comes from the pin's snapshot once the rank has moved past the version,
 * from the live working copy while it is at the version, and a rank still
 * below it is waited for. */
static int read_pinned(job *j, job_pin *pin, const unit_layout *l, uint8_t *dst, size_t slice_bytes,
                       const pin_read_control *c, const struct timespec *deadline, char *err,
                       size_t err_bytes) {
  const uint64_t version = pin->version;
  for (int r = 0; r < j->nranks; r++) {
    for (;;) {
      pthread_rwlock_rdlock(&j->rank_locks[r]);
      pthread_mutex_lock(&j->pin_mutex);
      int status = read_stopped(j, c, err, err_bytes);
      const void *src = NULL;
      uint64_t rank_version = j->ranks[r].version;
      if (status == 0 && pin->saved[r]) {
        const pin_snapshot *s = &pin->snapshots[r];
        if (pin->lost) {
          snprintf(err, err_bytes,
                   "pinned version %llu of job '%s' was lost: out of memory for its copy when "
                   "training moved past it; pin again",
                   (unsigned long long)version, j->name);
          status = ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED;
        } else if (l->id >= s->nunits || s->working[l->id] == NULL) {
          snprintf(err, err_bytes,
                   "unit '%s' did not exist at the pinned version %llu (it was registered "
                   "later); pin again to read it",
                   l->name, (unsigned long long)version);
          status = ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION;
        } else {
          src = s->working[l->id];
        }
      } else if (status == 0 && rank_version == version) {
        src = live_slice(j, r, l);
        if (src == NULL) {
          snprintf(err, err_bytes, "unit '%s' has no shard on rank %d", l->name, r);
          status = ZEROD__V1__STATUS__STATUS_INTERNAL;
        }
      } else if (status == 0 && rank_version > version) {
        /* Cannot happen: the rank saved its slices before moving on. */
        snprintf(err, err_bytes, "rank %d moved past pinned version %llu without keeping it", r,
                 (unsigned long long)version);
        status = ZEROD__V1__STATUS__STATUS_INTERNAL;
      } else if (status == 0) {
        pthread_rwlock_unlock(&j->rank_locks[r]);
        status = wait_for_rank(j, c, deadline, r, version, err, err_bytes);
        pthread_mutex_unlock(&j->pin_mutex);
        if (status != 0)
          return status;
        continue;
      }
      int live = status == 0 && !pin->saved[r];
      pthread_mutex_unlock(&j->pin_mutex);
      /* A snapshot is immutable and lives as long as the pin, which the
       * caller holds; a live slice is stable under the read lock. */
      if (status == 0)
        status = copy_slice(j, r, l, src, live, dst, slice_bytes, c, err, err_bytes);
      pthread_rwlock_unlock(&j->rank_locks[r]);
      if (status != 0)
        return status;
      break;
    }
  }
  return 0;
}

/* Latest: every rank's read lock at once (in rank order), so the slices
 * are one version; if the ranks are not all at the latest version (one
 * is between its collective and its write), wait for the laggard. */
static int read_latest(job *j, const unit_layout *l, uint8_t *dst, size_t slice_bytes,
                       uint64_t have_version, const pin_read_control *c,
                       const struct timespec *deadline, uint64_t *served, char *err,
                       size_t err_bytes) {
  for (;;) {
    for (int r = 0; r < j->nranks; r++)
      pthread_rwlock_rdlock(&j->rank_locks[r]);
    pthread_mutex_lock(&j->pin_mutex);
    int status = read_stopped(j, c, err, err_bytes);
    uint64_t version = max_rank_version(j);
    int lagging = -1;
    for (int r = 0; status == 0 && r < j->nranks && lagging < 0; r++)
      if (j->ranks[r].version != version)
        lagging = r;
    if (status == 0 && lagging >= 0) {
      for (int r = j->nranks - 1; r >= 0; r--)
        pthread_rwlock_unlock(&j->rank_locks[r]);
      status = wait_for_rank(j, c, deadline, lagging, version, err, err_bytes);
      pthread_mutex_unlock(&j->pin_mutex);
      if (status != 0)
        return status;
      continue;
    }
    pthread_mutex_unlock(&j->pin_mutex);
    for (int r = 0; status == 0 && r < j->nranks && version != have_version; r++) {
      const void *src = live_slice(j, r, l);
      if (src == NULL) {
        snprintf(err, err_bytes, "unit '%s' has no shard on rank %d", l->name, r);
        status = ZEROD__V1__STATUS__STATUS_INTERNAL;
        break;
      }
      status = copy_slice(j, r, l, src, 1, dst, slice_bytes, c, err, err_bytes);
    }
    for (int r = j->nranks - 1; r >= 0; r--)
      pthread_rwlock_unlock(&j->rank_locks[r]);
    *served = version;
    return status;
  }
}

int pin_read_unit(job *j, job_pin *pin, const unit_layout *l, void *dst, uint64_t have_version,
                  const pin_read_control *control, uint64_t *served_version, char *err,
                  size_t err_bytes) {
  size_t slice_bytes = l->shard_numel * zk_dtype_size(j->config.working_dtype);
  struct timespec deadline = clock_deadline_ms(control->timeout_ms);
  if (pin == NULL)
    return read_latest(j, l, dst, slice_bytes, have_version, control, &deadline, served_version,
                       err, err_bytes);
  *served_version = pin->version;
  if (pin->version == have_version)
    return 0;
  return read_pinned(j, pin, l, dst, slice_bytes, control, &deadline, err, err_bytes);
}
