/* ckpt_save: saves (coord_ckpt.h; docs/checkpoints.md): Save, the
 * periodic checkpoints' saves, and the save behind an Export of a job's
 * state.
 *
 * A save writes into <checkpoint-dir>/J/<N>.tmp-<id>/, which becomes N
 * only by the rename that follows the manifest: every rank writes its
 * shard file into the temporary directory, rank 0 also the job's layout;
 * once all report success the commit (on the thread pool) checks what
 * they wrote, writes the manifest, reads it back and renames the
 * directory into place, and the call is answered. An Export's save is
 * exported from the temporary directory and removed instead. Anything
 * left with the .tmp- mark is an unfinished save, removed at the next
 * start. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "coord_ckpt.h"
#include "fsutil.h"
#include "crashpoint.h"
#include "ctl_decode.h"
#include "filemode.h"
#include "log.h"

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
  int rc = fsutil_mkdir_p(job_dir);
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
  if ((rc = fsutil_fsync_dir(w->tmp_dir, NULL)) != 0)
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
  if ((rc = fsutil_fsync_dir(w->job_dir, NULL)) != 0) {
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
    if (o->for_base && j != NULL)
      snprintf(j->ckpt.base_saved, sizeof j->ckpt.base_saved, "%s", w->final_name);
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

void coord__ckpt_save_progress(coord *c, ckpt_order *o) {
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

int coord__ckpt_save_register(coord *c, rpc_server *server) {
  static const coord_method methods[] = {{CTL_SAVE, RPC_UNARY, on_save}};
  return coord__add_methods(c, server, methods, sizeof methods / sizeof methods[0]);
}
