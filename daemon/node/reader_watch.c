/* reader_watch: WATCH, a read-only session waiting for the job's next
 * version (docs/subscribe.md).
 *
 * A WATCH answers at once when the job's latest version is already above
 * the one the subscriber holds; otherwise it parks on the reader env's list
 * (loop thread only) and the session's later requests wait behind it, as
 * they would behind a gather. The list is looked at whenever executors
 * hand back ops (a step's or a load's reply follows its write, so a new
 * version is seen with it) and by a timer every WATCH_POLL_MS, which
 * catches deadlines and versions moved by other paths (restores). An
 * answer pins the latest version as PIN does, so every unit the
 * subscriber then gathers comes from that one version; versions published
 * while nobody waited are not queued: the answer says how many were
 * skipped. A parked WATCH holds no pin, so a subscriber that keeps up
 * costs the trainer no copy-on-write snapshot: only one still reading
 * when the trainer moves on does (one copy per version, shared). */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "frame.h"
#include "log.h"
#include "pin.h"

#include "reader_impl.h"

#define WATCH_POLL_MS 20
#define WATCH_NONE    UINT64_MAX /* WatchVersionRequest.after_version: nothing held */

static void link_watcher(reader *r) {
  reader_env *env = r->env;
  r->watch_prev = NULL;
  r->watch_next = env->watchers;
  if (env->watchers != NULL)
    env->watchers->watch_prev = r;
  env->watchers = r;
  if (!uv_is_active((uv_handle_t *)&env->watch_timer))
    uv_timer_start(&env->watch_timer, env->on_watch_timer, WATCH_POLL_MS, WATCH_POLL_MS);
}

void reader__watch_unlink(reader *r) {
  reader_env *env = r->env;
  if (r->watch_prev != NULL)
    r->watch_prev->watch_next = r->watch_next;
  else
    env->watchers = r->watch_next;
  if (r->watch_next != NULL)
    r->watch_next->watch_prev = r->watch_prev;
  r->watch_prev = r->watch_next = NULL;
  if (env->watchers == NULL)
    uv_timer_stop(&env->watch_timer);
}

/* Grows the session's table of listed units to hold unit ids below n. */
static int listed_reserve(reader *r, uint32_t n) {
  if (n <= r->nlisted)
    return 0;
  uint8_t *grown = realloc(r->listed, n);
  if (grown == NULL)
    return -1;
  memset(grown + r->nlisted, 0, n - r->nlisted);
  r->listed = grown;
  r->nlisted = n;
  return 0;
}

/* The units the subscriber should read for an update from `after`: those
 * whose values changed after it, and those no answer has listed to this
 * session yet (new units, or a first watch). Every rank has registered
 * each one (listed by UNITS). Returns 0 with a malloc'd array (NULL when
 * there are none), or -1 when out of memory (an error: an empty list
 * would say that nothing changed). */
static int changed_units(reader *r, uint64_t after, uint32_t **out, size_t *n) {
  job *j = r->job;
  uint32_t total;
  unit_layout **units = job_units_copy(j, &total);
  *out = NULL;
  *n = 0;
  if (units == NULL && total > 0)
    return -1;
  uint32_t *ids = total > 0 ? malloc(total * sizeof *ids) : NULL;
  if (total > 0 && (ids == NULL || listed_reserve(r, total) != 0)) {
    free(ids);
    free(units);
    return -1;
  }
  for (uint32_t u = 0; u < total; u++) {
    const unit_layout *l = units[u];
    if (l == NULL || atomic_load(&l->ready_ranks) < j->nranks)
      continue;
    if (after == WATCH_NONE || atomic_load(&l->changed_version) > after || !r->listed[l->id]) {
      ids[(*n)++] = l->id;
      r->listed[l->id] = 1;
    }
  }
  free(units);
  *out = ids;
  return 0;
}

int reader__pin_latest(reader *r) {
  int over = 0;
  job_pin *pin = pin_acquire_latest(r->job, r->env->max_pins, &over);
  if (pin == NULL && over && r->pin != NULL) {
    /* Its own pin may be what fills the cap: let it go first. */
    pin_release(r->job, r->pin);
    r->pin = NULL;
    pin = pin_acquire_latest(r->job, r->env->max_pins, &over);
  }
  if (pin == NULL)
    return over ? -EBUSY : -ENOMEM;
  pin_release(r->job, r->pin);
  r->pin = pin;
  return 0;
}

void reader__pin_error(reader *r, exec_op *op, int rc) {
  if (rc == -EBUSY)
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
               "job '%s' has %d versions pinned by read-only sessions, as many as "
               "--max-pinned-versions allows: sessions reading older versions must move on "
               "(pin, watch) or detach; this session is left unpinned",
               r->job->name, r->env->max_pins);
  else
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
}

/* Pins the latest version and answers the op with it. */
static void answer(reader *r, exec_op *op, uint64_t after) {
  uint32_t *ids = NULL;
  size_t n = 0;
  int rc = reader__pin_latest(r);
  if (rc != 0) {
    reader__pin_error(r, op, rc);
    return;
  }
  if (changed_units(r, after, &ids, &n) != 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  job_pin *pin = r->pin;
  Zerod__V1__WatchVersionReply reply = ZEROD__V1__WATCH_VERSION_REPLY__INIT;
  reply.version = pin->version;
  reply.skipped = after != WATCH_NONE && pin->version > after + 1 ? pin->version - after - 1 : 0;
  reply.changed_units = ids;
  reply.n_changed_units = n;
  reply.step = r->job->nranks > 0 ? atomic_load(&r->job->ranks[0].step) : 0;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_WATCH_REPLY, &reply.base);
  free(ids);
  LOG_DEBUGF("reader watched", "job=%s session=%llu version=%llu skipped=%llu units=%zu",
             r->job->name, (unsigned long long)r->session_id, (unsigned long long)pin->version,
             (unsigned long long)reply.skipped, n);
}

/* Nothing newer came: the session pins the latest again, which is the
 * version it held (its pin was let go while it waited). */
static void answer_timed_out(reader *r, exec_op *op, uint64_t after) {
  int rc = r->pin == NULL ? reader__pin_latest(r) : 0;
  if (rc != 0) {
    reader__pin_error(r, op, rc);
    return;
  }
  Zerod__V1__WatchVersionReply reply = ZEROD__V1__WATCH_VERSION_REPLY__INIT;
  reply.version = after;
  reply.timed_out = 1;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_WATCH_REPLY, &reply.base);
}

/* Whether the op is answered now: a failed job, a newer version, a
 * deadline passed (or no wait asked). */
static int try_answer(reader *r, exec_op *op, uint64_t after, uint64_t deadline_ns) {
  char reason[512];
  if (job_failed(r->job, op->generation, reason, sizeof reason)) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_ABORTED,
               "job '%s' failed: %s; watch again when it has reset", r->job->name, reason);
    return 1;
  }
  if (after == WATCH_NONE || pin_latest_version(r->job) > after) {
    answer(r, op, after);
    return 1;
  }
  if (clock_now_ns() >= deadline_ns) {
    answer_timed_out(r, op, after);
    return 1;
  }
  return 0;
}

int reader__watch(reader *r, exec_op *op) {
  const Zerod__V1__WatchVersionRequest *req = (const Zerod__V1__WatchVersionRequest *)op->request;
  if (req->timeout_ms > ZD_MAX_WATCH_TIMEOUT_MS) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
               "watch timeout_ms %" PRIu32 " is over the limit of %u (24 h)", req->timeout_ms,
               ZD_MAX_WATCH_TIMEOUT_MS);
    return 1;
  }
  uint64_t deadline = clock_now_ns() + (uint64_t)req->timeout_ms * 1000000u;
  if (try_answer(r, op, req->after_version, deadline))
    return 1;
  /* While it waits the session reads nothing (its requests queue behind
   * the watch), so its pin goes: a trainer stepping past the held version
   * then has no copy to make for it (pin.h). The answer pins again. */
  pin_release(r->job, r->pin);
  r->pin = NULL;
  r->watching = op;
  r->watch_after = req->after_version;
  r->watch_deadline_ns = deadline;
  link_watcher(r);
  return 0;
}

int reader__watch_try(reader *r) {
  if (!try_answer(r, r->watching, r->watch_after, r->watch_deadline_ns))
    return 0;
  reader__watch_unlink(r);
  return 1;
}
