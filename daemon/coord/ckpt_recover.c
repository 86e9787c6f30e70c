/* ckpt_recover: a job's state lost on a node comes back from a checkpoint
 * (coord_ckpt.h; docs/checkpoints.md, "Recovery").
 *
 * A node that restarts loses every shard it held. When it comes back, the
 * jobs whose ranks are all on it are rebuilt there, empty (node/cluster.c),
 * and the node reports them ready with no units (JobStatus.units). Then,
 * with no caller, the coordinator restores such a job: a base from its own
 * checkpoint (Job.base_checkpoint, ckpt_base.c), any other job from its
 * newest checkpoint, looked for on the thread pool (the highest step among
 * the job's own checkpoints that hold units). The steps since that
 * checkpoint are lost, and said so (logged, and Job.last_recovery). A job
 * with no checkpoint starts empty, also said so.
 *
 * Meanwhile the node that rebuilt the job admits no worker
 * (Assignment.recovery_pending), so that no worker registers fresh units
 * into a job about to be restored. A loss is settled once per job epoch
 * (every node that leaves bumps it); a job loaded from the state file at
 * start is unsettled until its nodes report, one created since has lost
 * nothing. A failed restore is retried as periodic checkpoints are. Loop
 * thread only. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_ckpt.h"
#include "ctl_decode.h"
#include "job_states.h"
#include "log.h"

/* The newest checkpoint of a job, looked for on the thread pool. */
typedef struct scan_work {
  ckpt_work base;
  char dir[PATH_MAX]; /* the job's checkpoint directory */
  char job[CTL_NAME_MAX_BYTES + 1];
  uint64_t job_id, epoch;
  /* Out */
  int found;
  char name[CTL_NAME_MAX_BYTES + 1];
  uint64_t step;
  int64_t created_unix_ms;
} scan_work;

static void scan_run(ckpt_work *base) {
  scan_work *w = (scan_work *)base;
  DIR *d = opendir(w->dir);
  if (d == NULL)
    return; /* no checkpoint ever */
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!ctl_valid_checkpoint_name(e->d_name) || !coord__ckpt_is_dir_at(dirfd(d), e))
      continue;
    char path[PATH_MAX + CTL_NAME_MAX_BYTES + 2], err[512];
    coord__ckpt_path_format(path, sizeof path, "%s/%s", w->dir, e->d_name);
    ckpt_manifest m;
    if (ckpt_manifest_load(path, CKPT_MANIFEST_NAME, 0, &m, err, sizeof err) != 0)
      continue; /* not a checkpoint (List skips it too) */
    /* The job's own (not one of a deleted job of its name), with units. */
    int better = m.job_id == w->job_id && m.nunits > 0 &&
                 (!w->found || m.step > w->step ||
                  (m.step == w->step && m.created_unix_ms > w->created_unix_ms));
    if (better) {
      w->found = 1;
      coord__ckpt_copy_name(w->name, sizeof w->name, e->d_name);
      w->step = m.step;
      w->created_unix_ms = m.created_unix_ms;
    }
    ckpt_manifest_free(&m);
  }
  closedir(d);
}

/* Settles j's loss of state at this epoch, with what happened (NULL:
 * nothing to tell); its nodes admit workers again. */
static void settle(coord *c, cjob *j, const char *what) {
  j->ckpt.recovered_epoch = j->epoch;
  if (what != NULL)
    snprintf(j->ckpt.last_recovery, sizeof j->ckpt.last_recovery, "%s", what);
  coord__mark_job_watches(c, j);
}

/* Restores j from its checkpoint name (in its checkpoint directory). */
static void start_restore(coord *c, cjob *j, const char *name, uint64_t now) {
  char source[PATH_MAX];
  coord__ckpt_path_format(source, sizeof source, "%s/%s/%s", c->options.checkpoint_dir,
                          j->msg->name, name);
  /* The coordinator's own order: its checks of who may read pass, its
   * checks of the files do not change. */
  coord_caller self = {.trusted = 1, .index = -1};
  char err[PATH_MAX + 256];
  int status = coord__ckpt_restore_start(c, j, source, NULL, &self, err, sizeof err);
  if (status != 0) {
    LOG_WARNF("recovery restore not started", "job=%s status=%s err=\"%s\"", j->msg->name,
              rpc_status_name(status), err);
    j->ckpt.autockpt.retry_ms = now + CKPT_AUTO_RETRY_MS;
    return;
  }
  j->ckpt.order->recovery = 1;
  LOG_INFOF("recovery started: the job's state was lost on a node that came back",
            "job=%s checkpoint=%s step_at_loss=%" PRIu64, j->msg->name, name, j->step_at_loss);
}

static void scan_done(ckpt_work *base) {
  scan_work *w = (scan_work *)base;
  coord *c = w->base.c;
  cjob *j = c->shutting_down ? NULL : coord__find_job(c, w->job);
  if (j != NULL && j->msg->id == w->job_id) {
    j->ckpt.recovery_scanning = 0;
    /* A node left again meanwhile: the next tick looks again. */
    int current = j->epoch == w->epoch && !j->deleting && j->ckpt.order == NULL &&
                  j->state == ZEROD__V1__JOB_STATE__JOB_STATE_READY;
    if (current && w->found) {
      start_restore(c, j, w->name, uv_now(c->loop));
    } else if (current) {
      LOG_WARNF("the job's state was lost on a node that came back, and it has no checkpoint: "
                "it starts empty",
                "job=%s step_at_loss=%" PRIu64, j->msg->name, j->step_at_loss);
      char what[256];
      snprintf(what, sizeof what,
               "state lost on a node at step %" PRIu64 "; no checkpoint: started empty",
               j->step_at_loss);
      settle(c, j, what);
    }
  }
  free(w);
}

static void start_scan(coord *c, cjob *j) {
  scan_work *w = calloc(1, sizeof *w);
  if (w == NULL)
    return; /* the next tick tries again */
  coord__ckpt_path_format(w->dir, sizeof w->dir, "%s/%s", c->options.checkpoint_dir, j->msg->name);
  coord__ckpt_copy_name(w->job, sizeof w->job, j->msg->name);
  w->job_id = j->msg->id;
  w->epoch = j->epoch;
  w->base.run = scan_run;
  w->base.done = scan_done;
  j->ckpt.recovery_scanning = 1;
  coord__ckpt_queue_work(c, &w->base);
}

/* The restore of a recovery completed, bringing j to its checkpoint's step
 * (ckpt_restore.c set j->step): the steps since are lost, and said so. */
static void restored(coord *c, cjob *j) {
  j->ckpt.recovery_restored = 0;
  uint64_t lost = j->step_at_loss > j->step ? j->step_at_loss - j->step : 0;
  char what[256];
  if (j->ckpt.recovery_from_memory) {
    /* Copied within every k-th step, before it was answered: what may be
     * lost is what completed since, fewer than k steps. */
    const Zerod__V1__CheckpointPolicy *p = j->msg->checkpoint_policy;
    uint32_t every = p != NULL && p->redundancy_every_steps > 1 ? p->redundancy_every_steps : 1;
    LOG_INFOF("recovered from the in-memory copies", "job=%s step=%" PRIu64 " world_size=%u",
              j->msg->name, j->step, j->msg->world_size);
    if (every == 1)
      snprintf(what, sizeof what,
               "state lost on a node; restored from the in-memory copy of step %" PRIu64
               " on %u rank%s: no completed step lost",
               j->step, j->msg->world_size, j->msg->world_size == 1 ? "" : "s");
    else
      snprintf(what, sizeof what,
               "state lost on a node; restored from the in-memory copy of step %" PRIu64
               " on %u rank%s: the steps completed since (fewer than %" PRIu32 ") are lost",
               j->step, j->msg->world_size, j->msg->world_size == 1 ? "" : "s", every);
    settle(c, j, what);
    return;
  }
  LOG_INFOF("recovered from a checkpoint", "job=%s step=%" PRIu64 " lost_steps=%" PRIu64,
            j->msg->name, j->step, lost);
  snprintf(what, sizeof what,
           "state lost on a node at step %" PRIu64 "; restored from the checkpoint of step "
           "%" PRIu64 ": %" PRIu64 " step%s lost",
           j->step_at_loss, j->step, lost, lost == 1 ? "" : "s");
  settle(c, j, what);
}

void coord__ckpt_recover_tick(coord *c, cjob *j, uint64_t now) {
  if (j->deleting)
    return;
  if (j->ckpt.recovery_restored)
    restored(c, j);
  if (j->ckpt.recovered_epoch == j->epoch || j->ckpt.recovery_scanning || j->ckpt.order != NULL ||
      j->state != ZEROD__V1__JOB_STATE__JOB_STATE_READY || now < j->ckpt.autockpt.retry_ms)
    return;
  size_t empty = 0;
  size_t holding = coord__ckpt_nodes_holding(c, j, &empty);
  if (empty == 0) {
    if (holding == j->msg->n_placement)
      settle(c, j, NULL); /* every node kept it: nothing was lost */
    return;
  }
  j->ckpt.recovery_from_memory = 0;
  if (coord__mem_enabled(j) && j->ckpt.mem_failed_epoch != j->epoch &&
      coord__mem_restore_start(c, j) == 0)
    j->ckpt.recovery_from_memory = 1; /* no disk read (ckpt_memory.c) */
  else if (j->msg->frozen && j->msg->base_checkpoint[0] != '\0')
    start_restore(c, j, j->msg->base_checkpoint, now);
  else
    start_scan(c, j);
}

int coord__ckpt_recovery_pending(const cjob *j) {
  return j->ckpt.recovered_epoch != j->epoch;
}
