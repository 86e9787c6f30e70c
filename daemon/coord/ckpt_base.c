/* ckpt_base: a base's own checkpoint (coord_ckpt.h; docs/bases.md,
 * "Restarts"). A frozen job's state never changes again, so one checkpoint
 * holds it for good. Once a job is frozen the coordinator saves it (a save
 * with no caller, named as a Save with no name is) and stores the
 * checkpoint's name in the job (Job.base_checkpoint), from which the
 * base is restored when its nodes come back without its state
 * (ckpt_recover.c). A failed save is retried as periodic checkpoints are.
 * Loop thread only. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "coord_ckpt.h"
#include "job_states.h"
#include "log.h"

size_t coord__ckpt_nodes_holding(const coord *c, const cjob *j, size_t *empty) {
  size_t holding = 0;
  *empty = 0;
  for (size_t i = 0; i < j->msg->n_placement; i++) {
    const member *m = coord__find_member(c, j->msg->placement[i]->node);
    const job_report *r = m != NULL ? coord__find_report(m, j->msg->name) : NULL;
    if (r == NULL || !r->ready)
      continue;
    if (r->units > 0)
      holding++;
    else
      (*empty)++;
  }
  return holding;
}

/* Stores the name of j's completed save as its base checkpoint. A failed
 * write is tried again at the next tick. */
static void store_saved(coord *c, cjob *j) {
  Zerod__V1__Job changed = *j->msg;
  changed.base_checkpoint = j->ckpt.base_saved;
  char err[512];
  if (coord__job_store(c, j, &changed, err, sizeof err) != 0) {
    LOG_WARNF("base checkpoint not stored yet", "job=%s checkpoint=%s err=\"%s\"", j->msg->name,
              j->ckpt.base_saved, err);
    return;
  }
  LOG_INFOF("base checkpoint stored", "job=%s checkpoint=%s", j->msg->name, j->ckpt.base_saved);
  j->ckpt.base_saved[0] = '\0';
  coord__mark_job_watches(c, j);
}

static void start_save(coord *c, cjob *j, uint64_t now) {
  char err[PATH_MAX + 256];
  int status = coord__ckpt_save_start(c, j, "", NULL, 0, NULL, err, sizeof err);
  if (status != 0) {
    LOG_WARNF("base checkpoint not started", "job=%s status=%s err=\"%s\"", j->msg->name,
              rpc_status_name(status), err);
    j->ckpt.autockpt.retry_ms = now + CKPT_AUTO_RETRY_MS;
    return;
  }
  j->ckpt.order->for_base = 1;
}

void coord__ckpt_base_tick(coord *c, cjob *j, uint64_t now) {
  if (!j->msg->frozen || j->deleting || c->options.checkpoint_dir[0] == '\0')
    return;
  if (j->ckpt.base_saved[0] != '\0')
    store_saved(c, j);
  if (j->state != ZEROD__V1__JOB_STATE__JOB_STATE_READY || j->ckpt.order != NULL ||
      now < j->ckpt.autockpt.retry_ms || j->ckpt.base_saved[0] != '\0')
    return;
  if (j->msg->base_checkpoint[0] != '\0')
    return; /* saved: a node that loses it gets it back (ckpt_recover.c) */
  size_t empty = 0;
  size_t holding = coord__ckpt_nodes_holding(c, j, &empty);
  if (holding == j->msg->n_placement) {
    start_save(c, j, now);
  } else if (empty > 0 && !j->ckpt.base_unsaved_logged) {
    /* Frozen with no units yet (their registration is not reported yet,
     * or there are none), or restarted before its save completed. */
    LOG_INFOF("base not saved yet: some of its nodes report no units of it",
              "job=%s nodes_without=%zu", j->msg->name, empty);
    j->ckpt.base_unsaved_logged = 1;
  }
}
