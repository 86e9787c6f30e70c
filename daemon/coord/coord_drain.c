/* coord_drain.c - saving a node's jobs before it stops (docs/daemon.md,
 * "Upgrades keep state").
 *
 * A node told to stop (SIGTERM, --drain-timeout; zerod standalone too,
 * whose node is a member of its in-process coordinator) sets draining in
 * its heartbeats. At the first, every job placed on the node that holds
 * state (ready, units reported, not a base: a base has its own checkpoint,
 * not deleting) gets a save, as a periodic checkpoint would (auto-<step>),
 * or keeps the one already running; each reply says how many are still in
 * flight, and the node stops at 0 (or at its timeout). The node that
 * comes back (or the standalone daemon that starts next on the same
 * directory, which loads the jobs from coordinator.pb) has its jobs
 * restored from their newest checkpoint: that save (ckpt_recover.c). */
#include <stdio.h>
#include <string.h>

#include "coord_ckpt.h"
#include "coord_impl.h"
#include "log.h"

/* Whether j is placed on node. */
static int placed_on(const cjob *j, const char *node) {
  for (size_t i = 0; i < j->msg->n_placement; i++)
    if (strcmp(j->msg->placement[i]->node, node) == 0)
      return 1;
  return 0;
}

/* Whether j holds state worth a save: some node reports units of it. */
static int has_units(const coord *c, const cjob *j) {
  for (size_t i = 0; i < j->msg->n_placement; i++) {
    const job_report *r = coord__placement_report(c, j, i);
    if (r != NULL && r->units > 0)
      return 1;
  }
  return 0;
}

static void start_saves(coord *c, const char *node) {
  int saving = 0;
  for (size_t i = 0; i < c->njobs; i++) {
    cjob *j = c->jobs[i];
    if (!placed_on(j, node) || j->deleting || j->msg->frozen ||
        j->state != ZEROD__V1__JOB_STATE__JOB_STATE_READY || !has_units(c, j))
      continue;
    char err[PATH_MAX + 256];
    if (j->ckpt.order == NULL &&
        coord__ckpt_save_start(c, j, "", NULL, 1, NULL, err, sizeof err) != 0) {
      LOG_WARNF("job not saved before its node stops", "job=%s node=%s err=\"%s\"", j->msg->name,
                node, err);
      continue;
    }
    j->draining = 1;
    saving++;
    LOG_INFOF("saving the job before stopping", "job=%s node=%s step=%llu", j->msg->name, node,
              (unsigned long long)j->step);
  }
  LOG_INFOF("node draining", "node=%s jobs_saving=%d", node, saving);
}

void coord__drain_node(coord *c, member *m, Zerod__V1__HeartbeatReply *reply) {
  const char *node = m->info->name;
  if (!m->draining) {
    m->draining = 1;
    start_saves(c, node);
  }
  uint32_t pending = 0;
  for (size_t i = 0; i < c->njobs; i++) {
    const cjob *j = c->jobs[i];
    pending += j->draining && j->ckpt.order != NULL && placed_on(j, node);
  }
  reply->drain_seen = 1;
  reply->drain_saves = pending;
}
