/* coord_stalls: which ranks of a job wait in a collective, and for whom
 * (coord_impl.h; docs/daemon.md, "Stalls").
 *
 * Every heartbeat says what each of the node's ranks is doing: how many
 * collectives it has begun, the one it is in and for how long, and the op
 * its executor last began. The ranks of a job make the same collectives in
 * the same order, so a rank that has been in its n-th collective for
 * COORD_STALL_MS waits for the ranks that have begun fewer than n: those
 * are named, with what they last did ("attach 9.1 s ago": their worker sent
 * nothing since). The answer is Job.stalled, and a line in the log when it
 * changes. Once a rank has waited for the coordinator's stall timeout, the
 * job's nodes are told to fail the operation on every rank with that
 * report (Assignment.abort_id), once per stall. Loop thread only. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "coord_impl.h"
#include "log.h"

#define STALL_NAMED 4 /* laggards named, then "and N more" */

/* The ranks j's nodes last reported, into ranks[] (at most max). */
static size_t reported(const coord *c, const cjob *j, const rank_activity **ranks, size_t max) {
  size_t n = 0;
  for (size_t i = 0; i < j->msg->n_placement; i++) {
    const job_report *r = coord__placement_report(c, j, i);
    for (size_t k = 0; r != NULL && k < r->nranks && n < max; k++)
      ranks[n++] = &r->ranks[k];
  }
  return n;
}

/* Describes the stall of ranks[0..n), or "" if none is stalled; the
 * longest wait into *longest_ms. */
static void describe(const rank_activity *const *ranks, size_t n, char *out, size_t out_bytes,
                     uint64_t *longest_ms) {
  out[0] = '\0';
  *longest_ms = 0;
  const rank_activity *longest = NULL;
  for (size_t i = 0; i < n; i++)
    if (ranks[i]->collective[0] != '\0' && ranks[i]->waiting_ms >= COORD_STALL_MS &&
        (longest == NULL || ranks[i]->waiting_ms > longest->waiting_ms))
      longest = ranks[i];
  if (longest == NULL)
    return;
  *longest_ms = longest->waiting_ms;
  uint64_t seq = longest->collectives;
  char who[256] = "";
  size_t wlen = 0, waiting = 0, len = 0, behind = 0;
  for (size_t i = 0; i < n; i++)
    if (ranks[i]->collective[0] != '\0' && ranks[i]->collectives == seq)
      coord__append(who, sizeof who, &wlen, "%s%u", waiting++ ? "," : "", ranks[i]->rank);
  coord__append(out, out_bytes, &len, "rank%s %s wait%s %.1f s in %s #%" PRIu64,
                waiting == 1 ? "" : "s", who, waiting == 1 ? "s" : "",
                (double)longest->waiting_ms / 1e3, longest->collective, seq);
  for (size_t i = 0; i < n; i++) {
    const rank_activity *a = ranks[i];
    if (a->collectives >= seq)
      continue;
    if (behind < STALL_NAMED)
      coord__append(out, out_bytes, &len, "%s rank %u (%s, last op %s %.1f s ago)",
                    behind ? ";" : " for", a->rank,
                    a->collective[0] != '\0' ? "in an earlier collective" : "in no collective",
                    a->last_op[0] != '\0' ? a->last_op : "none", (double)a->last_op_ms / 1e3);
    behind++;
  }
  if (behind > STALL_NAMED)
    coord__append(out, out_bytes, &len, "; and %zu more", behind - STALL_NAMED);
  if (behind == 0)
    coord__append(out, out_bytes, &len, "; every reported rank has begun it");
}

void coord__job_stalls(coord *c, cjob *j) {
  const rank_activity *ranks[CTL_MAX_RANKS];
  size_t n = reported(c, j, ranks, CTL_MAX_RANKS);
  char now[COORD_REASON_BYTES];
  uint64_t longest_ms;
  describe(ranks, n, now, sizeof now, &longest_ms);
  /* Logged when it starts and ends; the figures in between only grow. */
  char quoted[COORD_REASON_BYTES + 64];
  if (now[0] != '\0' && j->stalled[0] == '\0')
    LOG_WARNF("job stalled in a collective", "job=%s stalled=%s", j->msg->name,
              log_quote(now, quoted, sizeof quoted));
  else if (now[0] == '\0' && j->stalled[0] != '\0')
    LOG_INFOF("job no longer stalled", "job=%s", j->msg->name);
  snprintf(j->stalled, sizeof j->stalled, "%s", now);
  if (now[0] == '\0') {
    j->stall_aborted = 0;
    return;
  }
  /* Past the stall timeout the wait ends on every rank at once, with who
   * waits for whom, rather than at each node's collective timeout. */
  int64_t limit = c->options.stall_timeout_ms;
  if (limit > 0 && !j->stall_aborted && longest_ms >= (uint64_t)limit) {
    j->stall_aborted = 1;
    j->abort_id++;
    snprintf(j->abort_reason, sizeof j->abort_reason, "%s", now);
    LOG_WARNF("stalled job's operation failed on every rank",
              "job=%s stall_timeout_ms=%" PRId64 " stalled=%s", j->msg->name, limit,
              log_quote(now, quoted, sizeof quoted));
    coord__mark_job_watches(c, j);
  }
}
