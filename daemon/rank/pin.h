/* pin: the versions of a job's working copies, the versions that read-only
 * sessions pin, and the assembly of a unit at a version from every rank's
 * working-copy slice (docs/architecture.md).
 *
 * A rank's version goes up by one each time its executor rewrites its
 * working copies (a step, a LOAD_UNIT). Ranks meet in a collective before
 * every such write, so two ranks of a job are never more than one version
 * apart, and the job's latest version is the highest any rank has reached.
 *
 * A pin keeps one version readable while training goes on, by copy on
 * write: the first time rank r is about to move past a pinned version, its
 * executor copies rank r's working slices (every unit) into the pin; until
 * then the live slices are that version. A pin therefore costs nothing
 * until training steps past it, and then one copy of the model in working
 * precision, spread over the ranks. Sessions pinning the same version share
 * one pin (refcounted); the last to let go frees it.
 *
 * Locks, always taken in this order:
 *
 *   job->rank_locks[r]  (rwlock)  written by rank r's executor while it
 *                                 changes its working copies or grows its
 *                                 shard table; read by a reader copying
 *                                 rank r's slice. A reader that needs
 *                                 several ranks takes them in rank order.
 *   job->pin_mutex                the ranks' versions, the pin list, pin
 *                                 refcounts and snapshots. Never held across
 *                                 a copy, a collective or a wait (the loop
 *                                 thread takes it to pin and unpin).
 *   job->mutex                    the unit table and the failure state.
 *
 * job->pin_cond is broadcast when a rank finishes a write, when the job
 * fails, when the daemon stops and when a reader is cancelled; readers wait
 * on it for a lagging rank, bounded by the collective timeout. Writers
 * never wait on a reader for longer than one unit's copy. */
#ifndef ZEROD_PIN_H
#define ZEROD_PIN_H

#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>

#include "job.h"

/* Rank r's working slices at a pin's version, copied when r moved past it. */
typedef struct pin_snapshot {
  uint32_t nunits;
  void **working; /* [nunits], indexed by unit id; NULL where rank r had no shard */
} pin_snapshot;

typedef struct job_pin {
  struct job_pin *next;
  uint64_t version;
  int refs;                /* sessions pinning it, plus a writer saving into it */
  uint8_t *saved;          /* [world]: rank r moved past the version; see snapshots[r] */
  pin_snapshot *snapshots; /* [world] */
  int lost;                /* a snapshot could not be made (out of memory) */
} job_pin;

/* Frees the pins left in the job's list (before job_destroy, once every
 * session is gone). The locks above are the job's (job_create makes them). */
void pin_job_clear(job *j);

/* ---- Writers: rank r's executor ---------------------------------------- */

/* Before rank rs rewrites its working copies: takes its write lock, saves
 * its slices into a pin of its current version that lacks them, and moves
 * its version up by one. pin_end_write releases the lock and wakes readers
 * that wait for the rank. Nothing between the two may block on another
 * rank (no collective). */
void pin_begin_write(rank_state *rs);
void pin_end_write(rank_state *rs);
/* pin_begin_write moving the version to to_version when that is higher
 * than the next: a job that mirrors another's versions (node/follow.c). */
void pin_begin_write_to(rank_state *rs, uint64_t to_version);
/* Before pin_begin_write: unit l's values change in the write to come, so
 * its changed_version becomes at least the version the rank moves to.
 * Marked before the version is published, so a subscriber that sees the
 * version sees the mark. pin_mark_step marks every unit a step changes:
 * those with a trainable tensor, not of the job's base (the same on
 * every rank). */
void pin_mark_changing(rank_state *rs, unit_layout *l);
/* A job whose first values were written before any reader could see it
 * (a mirror's first version, node/follow.c) starts at version. */
void pin_start_at(rank_state *rs, uint64_t version);
/* The same, to a version given (pin_begin_write_to's). */
void pin_mark_changed_at(unit_layout *l, uint64_t version);
void pin_mark_step(rank_state *rs);

/* Around a change of the rank's shard table (a new unit's shard) that does
 * not change any version. */
void pin_lock_shards(rank_state *rs);
void pin_unlock_shards(rank_state *rs);

/* ---- Job events -------------------------------------------------------- */

/* Wakes every waiting reader so it looks at the job again (it failed, a
 * reader was cancelled). */
void pin_wake(job *j);
/* The daemon is stopping: waiting readers give up (UNAVAILABLE). */
void pin_job_stop(job *j);

/* ---- Pins: any thread ---------------------------------------------------- */

/* The highest version any rank of the job has reached. Lock-free. */
uint64_t pin_latest_version(job *j);

/* Pins the latest version (sharing an existing pin of it). Returns NULL
 * when out of memory, or (*over set) when a new pin would make the job's
 * distinct pinned versions more than max_pins (0: no limit). */
job_pin *pin_acquire_latest(job *j, int max_pins, int *over);
/* Drops a reference; the last one frees the pin and its snapshots. */
void pin_release(job *j, job_pin *pin);

/* ---- Reading ------------------------------------------------------------- */

typedef struct pin_read_control {
  unsigned generation; /* the job generation the read belongs to */
  _Atomic int *cancel; /* set by the session when it goes away */
  int timeout_ms;      /* how long to wait for a lagging rank */
  /* A delta read (docs/subscribe.md, "Deltas"): dst holds have_version's
   * values, and each block of PIN_DELTA_BLOCK_BYTES of the unit is
   * compared before it is copied; bit b of changed (byte b / 8, bit
   * b % 8; zeroed by the caller, pin_delta_bitmap_bytes long) is set when
   * block b differed. NULL: a plain copy. */
  uint8_t *changed;
} pin_read_control;

#define PIN_DELTA_BLOCK_BYTES 65536u
/* The bitmap of a delta read of a unit of unit_bytes. */
static inline size_t pin_delta_bitmap_bytes(uint64_t unit_bytes) {
  uint64_t blocks = (unit_bytes + PIN_DELTA_BLOCK_BYTES - 1) / PIN_DELTA_BLOCK_BYTES;
  return (size_t)((blocks + 7) / 8);
}

/* Copies unit l's working values, every rank's slice at its place, into
 * dst (l->padded_numel elements of the working dtype): at pin's version, or
 * with pin NULL at the latest version. When that version is have_version
 * the copy is skipped (dst already holds it); with control->changed, only
 * the blocks that differ from dst are written, and marked. Waits for a rank that has not
 * reached the version yet. The unit must be registered on every rank
 * (unit_layout.ready_ranks). Returns 0 with *served_version set, or a
 * Zerod__V1__Status with a message in err: FAILED_PRECONDITION (the unit did
 * not exist at the pinned version), RESOURCE_EXHAUSTED (the pin's snapshot
 * was lost), ABORTED (the job failed while waiting), UNAVAILABLE (timed
 * out, cancelled, or the daemon is stopping). Runs on a worker thread,
 * never on the loop. */
int pin_read_unit(job *j, job_pin *pin, const unit_layout *l, void *dst, uint64_t have_version,
                  const pin_read_control *control, uint64_t *served_version, char *err,
                  size_t err_bytes);

#endif /* ZEROD_PIN_H */
