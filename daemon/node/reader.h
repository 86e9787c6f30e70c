/* reader: read-only sessions (evaluation, inference, weight sync) — their
 * buffers, their pin and the order of their requests (docs/architecture.md).
 *
 * A read-only session takes no rank and no part in the job's collectives.
 * Its GATHER assembles a unit from every rank's working-copy slice (pin.h)
 * into a memfd buffer of its own, one per unit, created on the first
 * gather, sent once, and refilled only when the version it serves changes.
 * The session's buffers are bounded by the job's max_live_bytes: released
 * units' buffers are evicted least recently used first, and a gather that
 * cannot fit even then fails with RESOURCE_EXHAUSTED and changes nothing.
 *
 * Threads: the reader's requests run one at a time in arrival order. Those
 * that only look at the reader's own state (a gather served from its
 * buffer, RELEASE, PIN, DETACH) run on the loop thread when nothing else of
 * the session is running; a gather that copies runs on the libuv
 * threadpool (it may wait for a rank, up to the collective timeout, and
 * copies a whole unit), and the loop finishes it. While a gather runs
 * there, the reader's state is that thread's; the loop touches only the
 * queue. */
#ifndef ZEROD_READER_H
#define ZEROD_READER_H

#include <stdint.h>
#include <uv.h>

#include "exec.h"
#include "job.h"

typedef struct reader reader;

/* Where readers run and report, set once by the daemon (it outlives every
 * reader): the loop whose threadpool runs their copies, the function
 * called on the loop thread with each finished op (its reply encoded in
 * the op, or none for a session that is closing; it takes the op) and its
 * ctx, and how long a gather waits for a lagging rank. The readers whose
 * WATCH waits for a newer version are on its list, looked at when ops
 * complete (reader_poll_watches) and by its timer. */
typedef struct reader_env {
  uv_loop_t *loop;
  void (*done)(void *ctx, exec_op *op);
  void *ctx;
  int timeout_ms;
  struct reader *watchers;
  uv_timer_t watch_timer;
  uv_timer_cb on_watch_timer; /* reader.c's, started by reader_watch.c */
  int max_pins;               /* pinned versions per job (--max-pinned-versions) */
} reader_env;

/* Fills env and starts its timer handle (not running until a WATCH
 * waits); reader_env_close closes it. Returns 0 or a libuv error. */
int reader_env_init(reader_env *env, uv_loop_t *loop, void (*done)(void *ctx, exec_op *op),
                    void *ctx, int timeout_ms, int max_pins);
void reader_env_close(reader_env *env);

/* Answers the waiting WATCHes that can be answered: a newer version, the
 * deadline, a failed job (loop thread; cheap with none waiting). The
 * daemon calls it whenever executors hand back ops, which is when
 * versions move. */
void reader_poll_watches(reader_env *env);

/* Creates the state of a read-only session of job j (loop thread). With
 * `pin`, the latest version is pinned for every later gather. Returns 0 or
 * -ENOMEM. */
int reader_create(reader_env *env, job *j, uint64_t session_id, int pin, reader **out);
/* The job the reader reads. */
job *reader_job(const reader *r);
/* The pinned version, or the latest version when nothing is pinned. */
uint64_t reader_version(const reader *r, int *pinned);

/* Queues a GATHER, RELEASE, PIN or OP_SESSION_END (DETACH) of the session
 * (loop thread); each comes back through the done function, in order. */
void reader_submit(reader *r, exec_op *op);

/* The session is closing (loop thread): a running gather stops waiting,
 * queued ops are handed back unanswered. */
void reader_close(reader *r);

/* Frees the reader: its buffers and its pin. Only when none of its ops is
 * left (the session holds a reference per op, so its free path is safe). */
void reader_destroy(reader *r);

#endif /* ZEROD_READER_H */
