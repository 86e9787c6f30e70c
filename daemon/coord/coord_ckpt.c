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
 * the periodic checkpoints to drop. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "confine.h"
#include "coord_ckpt.h"
#include "coord_impl.h"
#include "crashpoint.h"
#include "ctl_decode.h"
#include "filemode.h"
#include "log.h"

/* ------------------------------------------------------------------------ */
/* Save                                                                     */
/* ------------------------------------------------------------------------ */

/* Starts a save of j: makes the temporary directory and puts the order in
 * the Assignments of the job's nodes. name: as asked ("" for
 * step-<step>); call: the waiting Save or Export, or NULL for a periodic
 * one; ex: for an Export, where the save goes, else NULL.
 * Returns 0, or a status with the reason in err and nothing started. */
int coord__ckpt_save_start(coord *c, cjob *j, const char *name, rpc_call *call, int periodic,
                           const export_spec *ex, char *err, size_t err_bytes) {
  if (call != NULL && rpc_call_remaining_ms(call) <= 0) {
    snprintf(err, err_bytes, "the call's deadline passed before the save began");
    return RPC_DEADLINE_EXCEEDED;
  }
  ckpt_order *o = coord__ckpt_order_new(c, j, ORDER_SAVE);
  if (o == NULL) {
    snprintf(err, err_bytes, "coordinator out of memory");
    return RPC_RESOURCE_EXHAUSTED;
  }
  o->periodic = periodic;
  if (ex != NULL) {
    o->is_export = 1;
    o->export = *ex;
  }
  snprintf(o->name, sizeof o->name, "%s", name);
  char job_dir[PATH_MAX];
  coord__ckpt_path_format(job_dir, sizeof job_dir, "%s/%s", c->options.checkpoint_dir,
                          j->msg->name);
  const char *stem = periodic ? "auto" : ex != NULL ? "export" : name[0] != '\0' ? name : "step";
  coord__ckpt_path_format(o->dir, sizeof o->dir, "%s/%s.tmp-%" PRIu64, job_dir, stem, o->id);
  const char *failed_path = job_dir;
  int rc = coord__ckpt_make_dirs(job_dir);
  if (rc == 0 && (rc = filemode_mkdirat(AT_FDCWD, o->dir)) != 0)
    failed_path = o->dir;
  if (rc != 0) {
    snprintf(err, err_bytes, "cannot create %s: %s", failed_path, strerror(-rc));
    o->dir[0] = '\0'; /* nothing of ours to remove */
    coord__ckpt_order_free(c, o);
    return coord__ckpt_io_status(-rc);
  }
  zerod__v1__save_order__init(&o->save_msg);
  o->save_msg.id = o->id;
  o->save_msg.dir = o->dir;
  o->save_list[0] = &o->save_msg;
  o->phase = PHASE_RUNNING;
  coord__ckpt_order_set_deadline(c, o, call);
  if (call != NULL) {
    o->call = call;
    rpc_call_set_cancel(call, coord__ckpt_on_order_cancelled, o);
  }
  LOG_INFOF(periodic     ? "periodic checkpoint started"
            : ex != NULL ? "export of the job's state started"
                         : "checkpoint save started",
            "job=%s order=%" PRIu64 " name=%s step=%" PRIu64 " dir=%s", o->job, o->id,
            name[0] != '\0' ? name : "-", j->step, o->dir);
  coord__mark_job_watches(c, j);
  return 0;
}

/* A save being committed: what the thread needs, and what it found. */
typedef struct commit_work {
  ckpt_work base;
  ckpt_order *order;
  /* In */
  char job_dir[PATH_MAX];
  char tmp_dir[PATH_MAX];
  char job[CTL_NAME_MAX_BYTES + 1];
  char name[CTL_NAME_MAX_BYTES + 1];
  const char *stem; /* "step" or "auto" for a name made from the step */
  uint64_t id, job_id, step;
  char tenant[AUTH_NAME_MAX_BYTES + 1];
  uint32_t world_size;
  int64_t created_unix_ms;
  uint64_t started_ns;
  ckpt_file_entry *files;                     /* [world_size], names in file_names */
  char (*file_names)[CTL_FILE_MAX_BYTES + 1]; /* [world_size] */
  int is_export;                              /* export as asked and remove, rather than rename */
  export_spec export;
  /* Out */
  work_result result;
  ckpt_export_info exported;
  char final_name[CTL_NAME_MAX_BYTES + 24];
  char final_dir[PATH_MAX];
  uint64_t bytes;
  int64_t total_ms;
} commit_work;

/* Checks what the ranks wrote and completes the temporary directory:
 * manifest (from rank 0's layout and the ranks' reports), read back,
 * layout removed, directory synced. */
static int commit_manifest(commit_work *w) {
  char path[PATH_MAX + CTL_FILE_MAX_BYTES + 2];
  struct stat st;
  crash_point("coord-shards-done");
  /* Every shard file is where the coordinator sees the directory: if it is
   * not, the nodes wrote to another filesystem than this one. */
  for (uint32_t r = 0; r < w->world_size; r++) {
    snprintf(path, sizeof path, "%s/%s", w->tmp_dir, w->files[r].name);
    if (stat(path, &st) != 0) {
      if (errno == ENOENT)
        return coord__ckpt_work_fail(
            &w->result, RPC_FAILED_PRECONDITION,
            "rank %u's shard file %s is not in %s as the coordinator sees it: the "
            "checkpoint directory must be on a filesystem that every node shares "
            "(docs/checkpoints.md)",
            r, w->files[r].name, w->tmp_dir);
      return coord__ckpt_work_fail(&w->result, coord__ckpt_io_status(errno), "cannot stat %s: %s",
                                   path, strerror(errno));
    }
    if ((uint64_t)st.st_size != w->files[r].bytes)
      return coord__ckpt_work_fail(&w->result, RPC_DATA_LOSS,
                                   "%s: %" PRIu64 " bytes on disk, rank %u reported %" PRIu64,
                                   w->files[r].name, (uint64_t)st.st_size, r, w->files[r].bytes);
    w->bytes += w->files[r].bytes;
  }

  ckpt_manifest m;
  char err[CKPT_MESSAGE_BYTES - 64];
  int rc =
      ckpt_manifest_load(w->tmp_dir, CKPT_LAYOUT_NAME, CKPT_DECODE_NO_FILES, &m, err, sizeof err);
  if (rc != 0)
    return coord__ckpt_work_fail(&w->result, rc == -ENOENT ? RPC_FAILED_PRECONDITION : RPC_INTERNAL,
                                 "rank 0's layout: %s", err);
  if (m.step != w->step || m.world_size != w->world_size) {
    coord__ckpt_work_fail(&w->result, RPC_INTERNAL,
                          "rank 0's layout is of step %" PRIu64
                          " and %u ranks; the ranks reported step %" PRIu64 " and %u ranks",
                          m.step, m.world_size, w->step, w->world_size);
    ckpt_manifest_free(&m);
    return w->result.status;
  }
  uint64_t expect_bytes = ckpt_shard_file_bytes(&m);
  for (uint32_t r = 0; r < w->world_size; r++) {
    if (w->files[r].bytes != expect_bytes) {
      coord__ckpt_work_fail(&w->result, RPC_INTERNAL,
                            "rank %u's shard file is %" PRIu64
                            " bytes; the job's layout makes it %" PRIu64,
                            r, w->files[r].bytes, expect_bytes);
      ckpt_manifest_free(&m);
      return w->result.status;
    }
  }

  /* The name: as asked, or made from the step (with the order id when
   * that name is taken: two saves at one step). */
  if (w->name[0] != '\0') {
    snprintf(w->final_name, sizeof w->final_name, "%s", w->name);
  } else {
    snprintf(w->final_name, sizeof w->final_name, "%s-%08" PRIu64, w->stem, w->step);
    coord__ckpt_path_format(w->final_dir, sizeof w->final_dir, "%s/%s", w->job_dir, w->final_name);
    if (lstat(w->final_dir, &st) == 0)
      snprintf(w->final_name, sizeof w->final_name, "%s-%08" PRIu64 "-%" PRIu64, w->stem, w->step,
               w->id);
  }
  coord__ckpt_path_format(w->final_dir, sizeof w->final_dir, "%s/%s", w->job_dir, w->final_name);

  /* The coordinator is the authority on the job, its owner and the
   * checkpoint's name: they are set here whatever the layout said. The
   * fields are swapped in and back out so that ckpt_manifest_free frees
   * only its own. */
  char *layout_job = m.job, *layout_name = m.name;
  ckpt_file_entry *layout_files = m.files;
  m.job = w->job;
  m.name = w->final_name;
  m.files = w->files;
  m.job_id = w->job_id;
  snprintf(m.tenant, sizeof m.tenant, "%s", w->tenant); /* the owner (ckpt_owner.c) */
  m.created_unix_ms = w->created_unix_ms;
  rc = ckpt_manifest_store(w->tmp_dir, CKPT_MANIFEST_NAME, &m, err, sizeof err);
  m.job = layout_job;
  m.name = layout_name;
  m.files = layout_files;
  ckpt_manifest_free(&m);
  if (rc != 0)
    return coord__ckpt_work_fail(&w->result, coord__ckpt_io_status(-rc),
                                 "cannot write the manifest: %s", err);
  /* Read back, so that the coordinator names only checkpoints that List
   * and Restore will accept. */
  rc = ckpt_manifest_load(w->tmp_dir, CKPT_MANIFEST_NAME, 0, &m, err, sizeof err);
  if (rc != 0)
    return coord__ckpt_work_fail(&w->result, RPC_INTERNAL, "the manifest does not read back: %s",
                                 err);
  ckpt_manifest_free(&m);

  snprintf(path, sizeof path, "%s/%s", w->tmp_dir, CKPT_LAYOUT_NAME);
  if (unlink(path) != 0 && errno != ENOENT)
    return coord__ckpt_work_fail(&w->result, coord__ckpt_io_status(errno), "cannot remove %s: %s",
                                 path, strerror(errno));
  if ((rc = coord__ckpt_fsync_dir(w->tmp_dir)) != 0)
    return coord__ckpt_work_fail(&w->result, coord__ckpt_io_status(-rc), "cannot sync %s: %s",
                                 w->tmp_dir, strerror(-rc));
  return 0;
}

/* Turns the completed temporary directory into the checkpoint: renamed,
 * parent synced. */
static int commit_rename(commit_work *w) {
  struct stat st;
  int rc;
  crash_point("coord-manifest-written");
  /* Never over an existing checkpoint: rename(2) would replace an empty
   * directory silently. Filesystems without RENAME_NOREPLACE (some network
   * ones) get a check first; there is one order per job, so only an
   * operator's mkdir could race it. */
  rc = renameat2(AT_FDCWD, w->tmp_dir, AT_FDCWD, w->final_dir, RENAME_NOREPLACE);
  if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) {
    if (lstat(w->final_dir, &st) == 0)
      errno = EEXIST;
    else
      rc = rename(w->tmp_dir, w->final_dir);
  }
  if (rc != 0) {
    if (errno == EEXIST || errno == ENOTEMPTY)
      return coord__ckpt_work_fail(&w->result, RPC_ALREADY_EXISTS,
                                   "job '%s' already has a checkpoint named '%s'", w->job,
                                   w->final_name);
    return coord__ckpt_work_fail(&w->result, coord__ckpt_io_status(errno),
                                 "cannot rename %s to %s: %s", w->tmp_dir, w->final_name,
                                 strerror(errno));
  }
  /* Renamed: the checkpoint exists from here on, whatever follows. A
   * failed sync of the parent means it might not survive a crash of the
   * machine; that is reported, and the directory stays. */
  if ((rc = coord__ckpt_fsync_dir(w->job_dir)) != 0) {
    LOG_WARNF("checkpoint renamed but its directory not synced", "path=%s err=\"%s\"", w->final_dir,
              strerror(-rc));
  }
  crash_point("coord-renamed");
  w->total_ms = coord__ckpt_elapsed_ms(w->started_ns);
  return 0;
}

static void commit_run(ckpt_work *base) {
  commit_work *w = (commit_work *)base;
  w->result.status = 0;
  int rc = commit_manifest(w);
  if (rc == 0 && w->is_export) {
    rc = coord__ckpt_export_to_file(w->tmp_dir, &w->export, NULL, &w->exported, &w->result);
    w->total_ms = coord__ckpt_elapsed_ms(w->started_ns);
  } else if (rc == 0) {
    rc = commit_rename(w);
  }
  if (rc != 0 || w->is_export) {
    /* A failed save, or the export's temporary checkpoint. */
    rc = coord__ckpt_rmtree(w->tmp_dir);
    if (rc != 0)
      LOG_WARNF("cannot remove a temporary checkpoint; the next start removes it",
                "path=%s err=\"%s\"", w->tmp_dir, strerror(-rc));
  }
}

void coord__ckpt_export_reply(rpc_call *call, const char *path, const ckpt_export_info *info,
                              int64_t total_ms, const char *checkpoint) {
  Zerod__V1__ExportReply reply = ZEROD__V1__EXPORT_REPLY__INIT;
  reply.path = (char *)path;
  reply.step = info->step;
  reply.tensors = info->tensors;
  reply.bytes = info->bytes;
  reply.total_ms = total_ms;
  reply.checkpoint = (char *)checkpoint;
  rpc_call_set_cancel(call, NULL, NULL);
  coord__finish_message(call, &reply.base);
}

static void commit_done(ckpt_work *base) {
  commit_work *w = (commit_work *)base;
  ckpt_order *o = w->order;
  o->work_in_flight = 0;
  o->dir[0] = '\0'; /* renamed, or removed by the thread */
  int64_t stall_ms = 0;
  for (uint32_t r = 0; r < o->world_size; r++)
    if (o->ranks[r].stall_ms > stall_ms)
      stall_ms = o->ranks[r].stall_ms;
  cjob *j = coord__ckpt_order_job(o->c, o);
  if (o->abandoned) {
    coord__ckpt_order_free(o->c, o); /* already answered */
  } else if (w->result.status != 0) {
    coord__ckpt_order_fail(o->c, o, w->result.status, "%s", w->result.message);
  } else if (w->is_export) {
    LOG_INFOF("job's state exported",
              "job=%s order=%" PRIu64 " step=%" PRIu64 " tensors=%u bytes=%" PRIu64
              " stall_ms=%" PRId64 " total_ms=%" PRId64 " path=%s",
              o->job, o->id, w->exported.step, w->exported.tensors, w->exported.bytes, stall_ms,
              w->total_ms, w->export.path);
    coord__metrics_checkpoint(o->c, "export", 1, (double)w->total_ms / 1e3, w->exported.bytes);
    if (o->call != NULL) {
      coord__ckpt_export_reply(o->call, w->export.path, &w->exported, w->total_ms, "");
      o->call = NULL;
    }
    coord__ckpt_order_free(o->c, o);
  } else {
    LOG_INFOF(o->periodic ? "periodic checkpoint saved" : "checkpoint saved",
              "job=%s order=%" PRIu64 " name=%s step=%" PRIu64 " bytes=%" PRIu64
              " stall_ms=%" PRId64 " total_ms=%" PRId64 " path=%s",
              o->job, o->id, w->final_name, w->step, w->bytes, stall_ms, w->total_ms, w->final_dir);
    coord__metrics_checkpoint(o->c, "save", 1, (double)w->total_ms / 1e3, w->bytes);
    if (o->call != NULL) {
      Zerod__V1__Checkpoint checkpoint = ZEROD__V1__CHECKPOINT__INIT;
      checkpoint.job = w->job;
      checkpoint.name = w->final_name;
      checkpoint.path = w->final_dir;
      checkpoint.step = w->step;
      checkpoint.world_size = w->world_size;
      checkpoint.bytes = w->bytes;
      checkpoint.created_unix_ms = w->created_unix_ms;
      checkpoint.job_id = w->job_id;
      checkpoint.tenant = w->tenant;
      Zerod__V1__SaveReply reply = ZEROD__V1__SAVE_REPLY__INIT;
      reply.checkpoint = &checkpoint;
      reply.stall_ms = stall_ms;
      reply.total_ms = w->total_ms;
      rpc_call_set_cancel(o->call, NULL, NULL);
      coord__finish_message(o->call, &reply.base);
      o->call = NULL;
    }
    if (o->periodic && j != NULL) {
      j->ckpt.autockpt.saved = 1;
      j->ckpt.autockpt.last_step = w->step;
      j->ckpt.autockpt.last_ms = uv_now(o->c->loop);
    }
    coord *c = o->c;
    coord__ckpt_order_free(c, o);
    /* Only now that the new one is complete may old ones go. */
    if (j != NULL && !j->deleting)
      coord__ckpt_apply_retention(c, j);
  }
  free(w->files);
  free(w->file_names);
  free(w);
}

/* Every rank saved: the order leaves the Assignments (the nodes have
 * nothing left to do) and the commit goes to the thread pool. The job
 * stays busy until it reports back. */
static void save_commit(coord *c, ckpt_order *o, uint64_t step) {
  commit_work *w = calloc(1, sizeof *w);
  if (w != NULL) {
    w->files = calloc(o->world_size, sizeof *w->files);
    w->file_names = calloc(o->world_size, sizeof *w->file_names);
  }
  if (w == NULL || w->files == NULL || w->file_names == NULL) {
    if (w != NULL) {
      free(w->files);
      free(w->file_names);
    }
    free(w);
    coord__ckpt_order_fail(c, o, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
    return;
  }
  w->base.run = commit_run;
  w->base.done = commit_done;
  w->order = o;
  coord__ckpt_path_format(w->job_dir, sizeof w->job_dir, "%s/%s", c->options.checkpoint_dir,
                          o->job);
  snprintf(w->tmp_dir, sizeof w->tmp_dir, "%s", o->dir);
  snprintf(w->job, sizeof w->job, "%s", o->job);
  snprintf(w->name, sizeof w->name, "%s", o->name);
  w->stem = o->periodic ? "auto" : "step";
  w->is_export = o->is_export;
  w->export = o->export;
  w->id = o->id;
  w->job_id = o->job_id;
  snprintf(w->tenant, sizeof w->tenant, "%s", o->tenant);
  w->step = step;
  w->world_size = o->world_size;
  w->created_unix_ms = coord__unix_ms();
  w->started_ns = o->started_ns;
  for (uint32_t r = 0; r < o->world_size; r++) {
    snprintf(w->file_names[r], sizeof w->file_names[r], "%s", o->ranks[r].file);
    w->files[r].name = w->file_names[r];
    w->files[r].bytes = o->ranks[r].bytes;
    w->files[r].xxh64 = o->ranks[r].xxh64;
  }
  cjob *j = coord__ckpt_order_job(c, o);
  o->phase = PHASE_COMMITTING;
  o->work_in_flight = 1;
  if (j != NULL)
    coord__mark_job_watches(c, j);
  LOG_DEBUGF("checkpoint shards written; committing", "job=%s order=%" PRIu64 " step=%" PRIu64,
             o->job, o->id, step);
  coord__ckpt_queue_work(c, &w->base);
}

static void save_progress(coord *c, ckpt_order *o) {
  uint32_t rank;
  const rank_report *failed = coord__ckpt_first_failure(o, &rank);
  if (failed != NULL) {
    coord__ckpt_fail_with_rank(c, o, rank, failed);
    return;
  }
  for (uint32_t r = 0; r < o->world_size; r++)
    if (!o->ranks[r].done)
      return;
  /* Ranks take their copy at the end of the same step; if they did not,
   * the shards do not make one state and the checkpoint would be wrong. */
  for (uint32_t r = 1; r < o->world_size; r++) {
    if (o->ranks[r].step != o->ranks[0].step) {
      coord__ckpt_order_fail(c, o, RPC_FAILED_PRECONDITION,
                             "ranks saved different steps: rank 0 at %" PRIu64
                             ", rank %u at %" PRIu64 "; retry",
                             o->ranks[0].step, r, o->ranks[r].step);
      return;
    }
  }
  for (uint32_t r = 0; r < o->world_size; r++) {
    char expect[64];
    ckpt_shard_name(r, o->world_size, expect, sizeof expect);
    if (strcmp(o->ranks[r].file, expect) != 0) {
      coord__ckpt_order_fail(c, o, RPC_INTERNAL, "rank %u reported shard file '%s'; expected '%s'",
                             r, o->ranks[r].file, expect);
      return;
    }
  }
  save_commit(c, o, o->ranks[0].step);
}

static void on_save(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__SaveRequest *req = coord__begin(c, call, CTL_SAVE, request, request_bytes);
  if (req == NULL)
    return;
  char err[PATH_MAX + 256];
  cjob *j = NULL;
  int status = coord__ckpt_order_precheck(c, req->job, &j, err, sizeof err);
  if (status == 0 && req->name[0] != '\0') {
    char path[PATH_MAX + 2 * CTL_NAME_MAX_BYTES];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s/%s", c->options.checkpoint_dir, req->job, req->name);
    if (lstat(path, &st) == 0) {
      snprintf(err, sizeof err, "job '%s' already has a checkpoint named '%s'", req->job,
               req->name);
      status = RPC_ALREADY_EXISTS;
    }
  }
  if (status == 0)
    status = coord__ckpt_save_start(c, j, req->name, call, 0, NULL, err, sizeof err);
  if (status != 0)
    coord__finish_error(call, status, "%s", err);
  ctl_free(&req->base);
}

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
      save_progress(c, o);
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
  if (policy == NULL || j->deleting || j->state != ZEROD__V1__JOB_STATE__JOB_STATE_READY)
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

void coord__ckpt_assignment(const cjob *j, Zerod__V1__Assignment *a) {
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
  if (o == NULL || j->state == ZEROD__V1__JOB_STATE__JOB_STATE_READY)
    return;
  /* A save being committed has every shard written: it completes. */
  if (o->phase == PHASE_COMMITTING)
    return;
  int installing = o->kind == ORDER_RESTORE && o->phase == PHASE_RUNNING && o->restore_msg.commit;
  coord__ckpt_order_fail(c, o, RPC_UNAVAILABLE, "job '%s' is no longer ready (%s: %s)%s", o->job,
                         coord__ckpt_state_word(j->state), j->reason,
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
  if (c->options.checkpoint_dir[0] == '\0' || c->shutting_down)
    return;
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
  for (size_t i = 0; i < c->njobs; i++)
    auto_check(c, c->jobs[i], now);
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
  int rc = coord__ckpt_make_dirs(dir);
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
  static const coord_method save[] = {{CTL_SAVE, RPC_UNARY, on_save}};
  int rc = coord__add_methods(c, server, save, sizeof save / sizeof save[0]);
  if (rc == 0)
    rc = coord__ckpt_catalog_register(c, server);
  if (rc == 0)
    rc = coord__ckpt_restore_register(c, server);
  if (rc == 0)
    rc = coord__ckpt_exports_register(c, server);
  return rc;
}
