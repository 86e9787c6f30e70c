/* coord_drain.c - saving jobs before a daemon stops (docs/daemon.md,
 * "Upgrades keep state").
 *
 * zerod standalone drains on SIGTERM: every job of the node that holds
 * state (ready, units reported, not a base: a base has its own checkpoint,
 * not deleting) gets a save, as a periodic checkpoint would (auto-<step>),
 * or keeps the one already running; the daemon stops once none of them is
 * in flight, or at its drain timeout. The daemon that starts next on the
 * same state directory loads the jobs (coordinator.pb) and restores each
 * from its newest checkpoint: that save (ckpt_recover.c). */
#include <stdio.h>
#include <string.h>

#include "coord_ckpt.h"
#include "coord_impl.h"
#include "log.h"

/* Whether j holds state worth a save: some node reports units of it. */
static int has_units(const coord *c, const cjob *j) {
  for (size_t i = 0; i < j->msg->n_placement; i++) {
    const job_report *r = coord__placement_report(c, j, i);
    if (r != NULL && r->units > 0)
      return 1;
  }
  return 0;
}

int coord_drain_start(coord *c) {
  int draining = 0;
  for (size_t i = 0; i < c->njobs; i++) {
    cjob *j = c->jobs[i];
    if (j->deleting || j->msg->frozen || j->state != ZEROD__V1__JOB_STATE__JOB_STATE_READY ||
        !has_units(c, j))
      continue;
    char err[PATH_MAX + 256];
    if (j->ckpt.order == NULL &&
        coord__ckpt_save_start(c, j, "", NULL, 1, NULL, err, sizeof err) != 0) {
      LOG_WARNF("job not saved before stopping", "job=%s err=\"%s\"", j->msg->name, err);
      continue;
    }
    j->draining = 1;
    draining++;
    LOG_INFOF("saving the job before stopping", "job=%s step=%llu", j->msg->name,
              (unsigned long long)j->step);
  }
  return draining;
}

int coord_drain_pending(const coord *c, char *names, size_t names_bytes) {
  int pending = 0;
  size_t used = 0;
  if (names_bytes > 0)
    names[0] = '\0';
  for (size_t i = 0; i < c->njobs; i++) {
    const cjob *j = c->jobs[i];
    if (!j->draining || j->ckpt.order == NULL)
      continue;
    pending++;
    if (used < names_bytes) {
      int n = snprintf(names + used, names_bytes - used, "%s%s", used > 0 ? "," : "", j->msg->name);
      used += n > 0 ? (size_t)n : 0;
    }
  }
  return pending;
}
