/* The coordinator's side of checkpoints (docs/architecture.md,
 * docs/checkpoints.md): the Checkpoints service (Save, List, Delete,
 * Restore), the orders it gives the nodes through their Watch streams,
 * and the periodic checkpoints of a job's CheckpointPolicy.
 *
 * The filesystem is the catalog. A checkpoint J/N exists iff
 * <checkpoint-dir>/J/N/ holds a manifest.json that decodes; there is no
 * other record to keep in step with the directories, so nothing can
 * disagree with them after a crash. A save writes into J/<N>.tmp-<id>/,
 * which becomes N only by the rename that follows the manifest; a delete
 * first renames N to N.deleting-<id>. Anything that carries one of those
 * marks is an unfinished operation, removed when the coordinator starts.
 *
 * An order (a save or a restore) travels to the job's nodes in their
 * Assignments; every rank reports on it in each heartbeat (ShardReport),
 * and the coordinator keeps the latest report of each rank. A save: every
 * rank writes its shard file into the temporary directory, rank 0 also the
 * job's layout; once all report success the coordinator writes the
 * manifest, renames the directory into place and answers. A restore:
 * every rank reads and checks what it will own (phase 1); once all
 * succeeded the order says commit, and every rank installs it (phase 2).
 * A job has at most one order at a time, and only while it is ready: a
 * job that stops being ready fails its order.
 *
 * Everything runs on the loop thread except file work that may take long
 * on a big or remote filesystem: the commit of a save, the checks before a
 * restore, List's scan and every recursive removal run on libuv's thread
 * pool, each with its own copy of what it needs, and report back to the
 * loop. Left in line, as with the state file, are a mkdir, a rename and a
 * directory fsync per operation, and reading one job's directory to find
 * the periodic checkpoints to drop.
 *
 * The service is in the files of coord_ckpt.h, one job each: the orders
 * (ckpt_order.c), saves (ckpt_save.c), restores (ckpt_restore.c), exports
 * (ckpt_exports.c), the catalog (ckpt_catalog.c), the paths clients give
 * (ckpt_paths.c), the thread pool (ckpt_pool.c) and file helpers
 * (ckpt_fs.c). This file is their top: the hooks the rest of the
 * coordinator calls (coord_impl.h), the nodes' reports, the periodic
 * schedule, and what a start finds in the checkpoint directory. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "coord_ckpt.h"
#include "job_states.h"
#include "fsutil.h"
#include "ctl_decode.h"
#include "log.h"

/* ------------------------------------------------------------------------ */
/* Reports from the nodes                                                   */
/* ------------------------------------------------------------------------ */

void coord__ckpt_heartbeat(coord *c, const member *m, const Zerod__V1__HeartbeatRequest *req) {
  for (size_t i = 0; i < req->n_jobs; i++) {
    const Zerod__V1__JobStatus *s = req->jobs[i];
    if (s->n_saves == 0 && s->n_restores == 0)
      continue;
    cjob *j = coord__find_job(c, s->job);
    ckpt_order *o = j != NULL ? j->ckpt.order : NULL;
    if (o == NULL || o->phase != PHASE_RUNNING)
      continue; /* reports of an order that ended: the node will drop it */
    long at = coord__placement_of(j, m->info->name);
    if (at < 0)
      continue;
    uint32_t first = j->msg->placement[at]->first_rank;
    uint32_t count = j->msg->placement[at]->ranks;
    Zerod__V1__ShardReport *const *reports = o->kind == ORDER_SAVE ? s->saves : s->restores;
    size_t nreports = o->kind == ORDER_SAVE ? s->n_saves : s->n_restores;
    int touched = 0;
    for (size_t k = 0; k < nreports; k++) {
      const Zerod__V1__ShardReport *r = reports[k];
      if (r->id != o->id)
        continue;
      if (r->rank < first || r->rank >= first + count || r->rank >= o->world_size) {
        LOG_WARNF("ignored a shard report for a rank the node does not host",
                  "node=%s job=%s order=%" PRIu64 " rank=%u", m->info->name, o->job, o->id,
                  r->rank);
        continue;
      }
      coord__ckpt_record_report(&o->ranks[r->rank], r);
      touched = 1;
    }
    if (!touched)
      continue;
    if (o->kind == ORDER_SAVE)
      coord__ckpt_save_progress(c, o);
    else
      coord__ckpt_restore_progress(c, o);
  }
}

/* ------------------------------------------------------------------------ */
/* Periodic checkpoints                                                     */
/* ------------------------------------------------------------------------ */

/* Starts j's periodic checkpoint if the policy says it is due. */
static void auto_check(coord *c, cjob *j, uint64_t now) {
  const Zerod__V1__CheckpointPolicy *policy = j->msg->checkpoint_policy;
  auto_ckpt *a = &j->ckpt.autockpt;
  /* A base's state does not change: its own checkpoint is ckpt_base.c's. */
  if (policy == NULL || j->deleting || j->msg->frozen ||
      j->state != ZEROD__V1__JOB_STATE__JOB_STATE_READY)
    return;
  if (!a->armed) {
    /* Counted from the step and the time at which the job is first ready
     * under this coordinator. */
    a->armed = 1;
    a->last_step = j->step;
    a->last_ms = now;
    return;
  }
  if (j->ckpt.order != NULL || now < a->retry_ms)
    return; /* never beside another order; after a failure, later */
  int by_steps = policy->every_steps != 0 && j->step >= a->last_step + policy->every_steps;
  /* By time, but not again for a job that has not moved since. */
  int by_time = policy->every_seconds != 0 &&
                now - a->last_ms >= (uint64_t)policy->every_seconds * 1000 &&
                !(a->saved && j->step == a->last_step);
  if (!by_steps && !by_time)
    return;
  char err[PATH_MAX + 256];
  int status = coord__ckpt_save_start(c, j, "", NULL, 1, NULL, err, sizeof err);
  if (status != 0) {
    LOG_WARNF("periodic checkpoint not started", "job=%s status=%s err=\"%s\"", j->msg->name,
              rpc_status_name(status), err);
    a->retry_ms = now + CKPT_AUTO_RETRY_MS;
  }
}

/* ------------------------------------------------------------------------ */
/* Hooks (coord_impl.h)                                                     */
/* ------------------------------------------------------------------------ */

void coord__ckpt_assignment(const coord *c, cjob *j, size_t at, Zerod__V1__Assignment *a,
                            char *buddy) {
  a->recovery_pending = coord__ckpt_recovery_pending(j);
  coord__mem_assignment(c, j, at, a, buddy, COORD_ADDR_BYTES);
  ckpt_order *o = j->ckpt.order;
  if (o == NULL || o->phase != PHASE_RUNNING)
    return;
  if (o->kind == ORDER_SAVE) {
    a->n_saves = 1;
    a->saves = o->save_list;
  } else {
    a->restore = &o->restore_msg;
  }
}

void coord__ckpt_job_changed(coord *c, cjob *j) {
  ckpt_order *o = j->ckpt.order;
  /* A job rebuilt for its in-memory copies is recovered as soon as it is
   * ready, not at the next tick: it is down meanwhile (ckpt_memory.c). */
  if (o == NULL && j->state == ZEROD__V1__JOB_STATE__JOB_STATE_READY && coord__mem_enabled(j) &&
      coord__ckpt_recovery_pending(j) && !c->shutting_down)
    coord__ckpt_recover_tick(c, j, uv_now(c->loop));
  if (o == NULL || j->state == ZEROD__V1__JOB_STATE__JOB_STATE_READY)
    return;
  /* A save being committed has every shard written: it completes. */
  if (o->phase == PHASE_COMMITTING)
    return;
  int installing = o->kind == ORDER_RESTORE && o->phase == PHASE_RUNNING && o->restore_msg.commit;
  coord__ckpt_order_fail(c, o, RPC_UNAVAILABLE, "job '%s' is no longer ready (%s: %s)%s", o->job,
                         zd_job_state_word(j->state), j->reason,
                         installing ? "; some ranks may have installed the restored state" : "");
}

void coord__ckpt_job_deleted(coord *c, cjob *j) {
  ckpt_order *o = j->ckpt.order;
  if (o == NULL)
    return;
  if (o->phase == PHASE_COMMITTING) {
    coord__ckpt_order_detach(c, o); /* checkpoints outlive their jobs */
    return;
  }
  coord__ckpt_order_fail(c, o, RPC_NOT_FOUND, "job '%s' was deleted", o->job);
}

void coord__ckpt_tick(coord *c) {
  if (c->shutting_down)
    return;
  if (c->options.checkpoint_dir[0] == '\0') {
    /* No checkpoints to recover from: a lost state is settled as lost at
     * once, so that no node waits for a recovery (ckpt_recover.c). */
    for (size_t i = 0; i < c->njobs; i++) {
      cjob *j = c->jobs[i];
      if (j->ckpt.recovered_epoch != j->epoch) {
        j->ckpt.recovered_epoch = j->epoch;
        coord__mark_job_watches(c, j);
      }
    }
    return;
  }
  uint64_t now = uv_now(c->loop);
  ckpt_order *next;
  for (ckpt_order *o = c->ckpt.orders; o != NULL; o = next) {
    next = o->next;
    if (o->phase != PHASE_RUNNING || o->abandoned || now < o->deadline_ms)
      continue;
    char pending[128];
    coord__ckpt_format_pending(o, pending, sizeof pending);
    int installing = o->kind == ORDER_RESTORE && o->restore_msg.commit;
    coord__ckpt_order_fail(c, o, RPC_DEADLINE_EXCEEDED,
                           "the %s did not finish within %.1f s (waiting for ranks %s)%s",
                           coord__ckpt_order_noun(o), (double)o->timeout_ms / 1000.0, pending,
                           installing ? "; some ranks may have installed the restored state" : "");
  }
  for (size_t i = 0; i < c->njobs; i++) {
    auto_check(c, c->jobs[i], now);
    coord__ckpt_base_tick(c, c->jobs[i], now);
    coord__ckpt_recover_tick(c, c->jobs[i], now);
    coord__mem_tick(c, c->jobs[i]);
  }
  coord__ckpt_retire_pending(c);
  coord__ckpt_retention(c, coord__unix_ms());
}

void coord__ckpt_shutdown(coord *c) {
  ckpt_order *next;
  for (ckpt_order *o = c->ckpt.orders; o != NULL; o = next) {
    next = o->next;
    if (o->phase != PHASE_COMMITTING && !o->abandoned)
      coord__ckpt_order_fail(c, o, RPC_UNAVAILABLE, "coordinator shutting down");
  }
}

void coord__ckpt_destroy(coord *c) {
  if (c->ckpt.work != 0)
    LOG_ERRORF("coordinator freed with checkpoint work in flight", "work=%u", c->ckpt.work);
  while (c->ckpt.orders != NULL) {
    ckpt_order *o = c->ckpt.orders;
    o->call = NULL; /* the server is gone, and its calls with it */
    coord__ckpt_order_free(c, o);
  }
}

/* Removes what a crash left in one job's directory. */
static void remove_leftovers(const char *job_dir) {
  DIR *d = opendir(job_dir);
  if (d == NULL)
    return;
  struct dirent *e;
  char path[2 * PATH_MAX + 2];
  while ((e = readdir(d)) != NULL) {
    int unfinished = strstr(e->d_name, ".tmp-") != NULL;
    if (!unfinished && strstr(e->d_name, ".deleting-") == NULL)
      continue;
    snprintf(path, sizeof path, "%s/%s", job_dir, e->d_name);
    int rc = coord__ckpt_remove_at(dirfd(d), e->d_name, 0);
    if (rc == 0)
      LOG_INFOF(unfinished ? "removed an unfinished checkpoint save"
                           : "removed an unfinished checkpoint delete",
                "path=%s", path);
    else
      LOG_WARNF("cannot remove a leftover checkpoint directory", "path=%s err=\"%s\"", path,
                strerror(-rc));
  }
  closedir(d);
}

int coord__ckpt_init(coord *c, char *err, size_t err_bytes) {
  /* Ids differ from those of an earlier run of the coordinator (orders
   * and deleted directories are named by them): milliseconds since 1970,
   * times 1024, only grow, unless this run orders 1024 per millisecond. */
  c->ckpt.next_id = (uint64_t)coord__unix_ms() * 1024;
  const char *dir = c->options.checkpoint_dir;
  if (dir[0] == '\0')
    return 0; /* no checkpoints: the service answers FAILED_PRECONDITION */
  if (dir[0] != '/') {
    snprintf(err, err_bytes, "the checkpoint directory must be an absolute path (got %s)", dir);
    return -EINVAL;
  }
  if (strlen(dir) > PATH_MAX - 512) {
    snprintf(err, err_bytes, "the checkpoint directory's path is longer than %d bytes",
             PATH_MAX - 512);
    return -ENAMETOOLONG;
  }
  for (unsigned i = 0; i < c->options.n_export_roots; i++) {
    const char *root = c->options.export_roots[i];
    if (root[0] != '/' || strlen(root) > PATH_MAX - 512) {
      snprintf(err, err_bytes, "export root %s: not an absolute path of at most %d bytes", root,
               PATH_MAX - 512);
      return -EINVAL;
    }
  }
  if (c->options.n_export_roots > COORD_MAX_EXPORT_ROOTS) {
    snprintf(err, err_bytes, "more than %d export roots", COORD_MAX_EXPORT_ROOTS);
    return -EINVAL;
  }
  int rc = fsutil_mkdir_p(dir);
  if (rc != 0) {
    snprintf(err, err_bytes, "cannot create the checkpoint directory %s: %s", dir, strerror(-rc));
    return rc;
  }
  DIR *d = opendir(dir);
  if (d == NULL) {
    rc = -errno;
    snprintf(err, err_bytes, "cannot read the checkpoint directory %s: %s", dir, strerror(errno));
    return rc;
  }
  /* Layout: <dir>/<job>/<checkpoint> and <dir>/<job>@<id>/<checkpoint>;
   * the marks are one level down, but for a deleted job's directory whose
   * retention ran out (<job>@<id>.deleting-<n>). */
  struct dirent *e;
  char job_dir[PATH_MAX + 256];
  uint64_t last_id = 0;
  while ((e = readdir(d)) != NULL) {
    uint64_t id;
    if (strstr(e->d_name, ".deleting-") != NULL && strchr(e->d_name, '@') != NULL) {
      snprintf(job_dir, sizeof job_dir, "%s/%s", dir, e->d_name);
      int removed = coord__ckpt_remove_at(dirfd(d), e->d_name, 0);
      LOG_INFOF(removed == 0 ? "removed a deleted job's expired checkpoints"
                             : "cannot remove a deleted job's expired checkpoints",
                "path=%s err=\"%s\"", job_dir, removed == 0 ? "" : strerror(-removed));
      continue;
    }
    if (!ctl_parse_checkpoint_dir(e->d_name, NULL, &id) || !coord__ckpt_is_dir_at(dirfd(d), e))
      continue;
    if (id > last_id)
      last_id = id;
    snprintf(job_dir, sizeof job_dir, "%s/%s", dir, e->d_name);
    remove_leftovers(job_dir);
  }
  closedir(d);
  /* Job ids never repeat a deleted job's directory, even where the ids
   * are not kept (zerod standalone keeps no state). */
  if (c->next_job_id <= last_id)
    c->next_job_id = last_id + 1;
  return 0;
}

int coord__ckpt_register(coord *c, rpc_server *server) {
  int rc = coord__ckpt_save_register(c, server);
  if (rc == 0)
    rc = coord__ckpt_catalog_register(c, server);
  if (rc == 0)
    rc = coord__ckpt_restore_register(c, server);
  if (rc == 0)
    rc = coord__ckpt_exports_register(c, server);
  if (rc == 0)
    rc = coord__ckpt_scale_register(c, server);
  return rc;
}
