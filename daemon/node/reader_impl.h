/* reader_impl: the state of a read-only session, shared by reader.c (its
 * buffers, gathers and the order of its requests) and reader_watch.c (WATCH:
 * waiting for a newer version). Internal to those two files. */
#ifndef ZEROD_READER_IMPL_H
#define ZEROD_READER_IMPL_H

#include <stdatomic.h>
#include <stdint.h>

#include "reader.h"
#include "shm.h"

/* One unit's buffer of a read-only session. */
typedef struct reader_buf {
  uint32_t id; /* 0: the unit has no buffer */
  shm_region region;
  uint64_t valid_version; /* version of its values; UINT64_MAX: none */
  int held;               /* between GATHER and RELEASE */
  int sent;               /* the session was given the descriptor */
  uint64_t last_use;      /* LRU tick */
  /* The last delta gather's answer: the version the buffer held before
   * (delta_from; delta 0: none, filled whole) and the blocks it wrote. */
  int delta;
  uint64_t delta_from;
  uint8_t *changed;
  size_t changed_bytes;
} reader_buf;

struct reader {
  reader_env *env;
  job *job;
  uint64_t session_id;
  job_pin *pin; /* NULL: every gather serves the latest version */

  /* The buffers, indexed by unit id; owned by whichever thread runs the
   * reader's current op. */
  reader_buf *bufs;
  uint32_t nbufs;
  uint64_t buffer_bytes; /* sum of the regions' sizes, <= max_live_bytes */
  uint64_t held_bytes;
  uint64_t tick;
  uint32_t next_buf_id;  /* never reused: the client caches mappings by id */
  uint32_t *dropped_ids; /* freed buffers the client still maps */
  size_t ndropped, dropped_cap;

  /* Loop-owned. */
  exec_op *queue_head, *queue_tail;
  exec_op *running; /* the op on the threadpool, or NULL */
  uv_work_t work;
  _Atomic int cancel; /* the session is closing: stop waiting */

  /* A WATCH waiting for a newer version (reader_watch.c; loop-owned): the
   * op, the version it waits to pass, its deadline (monotonic ns), and the
   * links of the env's list of waiting readers. */
  exec_op *watching;
  uint64_t watch_after;
  uint64_t watch_deadline_ns;
  struct reader *watch_prev, *watch_next;
  /* Units a WATCH answer has listed to this session (by unit id): a unit
   * not yet listed is listed whatever its changed_version. */
  uint8_t *listed;
  uint32_t nlisted;
};

/* reader_watch.c (which calls nothing of reader.c; reader.c hands parked
 * ops back and runs what queued behind them): a WATCH, answered now
 * (returns 1) or parked on the env's list until a newer version, its
 * deadline or the session's end (0); a parked one answered now if it can
 * (1, taken off the list; the caller hands it back), else 0. */
int reader__watch(reader *r, exec_op *op);
int reader__watch_try(reader *r);
/* Takes a parked WATCH off the env's list. */
void reader__watch_unlink(reader *r);
/* Pins the latest version for the session in place of its pin, within
 * the env's max_pins: the new pin is taken before the old one is let go
 * (moving to the same version keeps its snapshot), unless only letting go
 * first keeps the job within the cap. Returns 0, -ENOMEM, or -EBUSY (the
 * cap; the session is then unpinned when it had to let go). */
int reader__pin_latest(reader *r);
/* Answers op with the error of a failed reader__pin_latest. */
void reader__pin_error(reader *r, exec_op *op, int rc);

#endif /* ZEROD_READER_IMPL_H */
