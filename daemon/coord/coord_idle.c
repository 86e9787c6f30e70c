/* coord_idle.c - idle jobs expire (--job-idle-ttl).
 *
 * A job none of whose nodes reports a worker attached (JobStatus.sessions)
 * for the TTL is deleted, as DeleteJob would: its checkpoints stay, its
 * reason says it expired, and an audit line records it (principal
 * "coordinator", method "(expiry)"). A node that does not report the job
 * (gone, or not built yet) counts as having no worker: a job whose workers
 * never came back expires too. Bases (frozen jobs) never expire: jobs
 * build on them without attaching to them. */
#include <inttypes.h>
#include <stdio.h>

#include "coord_impl.h"
#include "log.h"

/* Whether any node of j reports a worker attached to it. */
static int attached_anywhere(const coord *c, const cjob *j) {
  for (size_t i = 0; i < j->msg->n_placement; i++) {
    const job_report *r = coord__placement_report(c, j, i);
    if (r != NULL && r->sessions > 0)
      return 1;
  }
  return 0;
}

void coord__job_idle_tick(coord *c, cjob *j, uint64_t now_ms) {
  int64_t ttl = c->options.job_idle_ttl_ms;
  if (ttl <= 0 || j->deleting || j->msg->frozen || attached_anywhere(c, j)) {
    j->idle_since_ms = 0;
    return;
  }
  if (j->idle_since_ms == 0) {
    j->idle_since_ms = now_ms;
    return;
  }
  if (now_ms - j->idle_since_ms < (uint64_t)ttl)
    return;
  char why[128], err[512];
  snprintf(why, sizeof why, "expired: no worker attached for %" PRId64 " s (--job-idle-ttl)",
           ttl / 1000);
  int status = coord__delete_job(c, j, why, err, sizeof err);
  if (status != 0) {
    /* Tried again at the next tick. */
    LOG_WARNF("idle job not expired", "job=%s error=\"%s\"", j->msg->name, err);
    return;
  }
  LOG_INFOF("job expired", "job=%s idle_s=%" PRId64, j->msg->name, ttl / 1000);
  LOG_INFOF("audit", "method=(expiry) principal=coordinator job=%s status=OK message=\"%s\"",
            j->msg->name, why);
}
