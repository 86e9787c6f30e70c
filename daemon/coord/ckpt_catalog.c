/* ckpt_catalog: the checkpoints that exist (coord_ckpt.h): List, Delete,
 * and the retention of a job's periodic checkpoints.
 *
 * The filesystem is the catalog. A checkpoint J/N exists iff
 * <checkpoint-dir>/J/N/ holds a manifest.json that decodes; there is no
 * other record to keep in step with the directories, so nothing can
 * disagree with them after a crash. A delete first renames N to
 * N.deleting-<id> (out of every listing at once) and removes the files on
 * the thread pool; a crash in between leaves the mark, removed at the next
 * start (coord__ckpt_init). Each caller sees and deletes only the
 * checkpoints its principal may reach (ckpt_owner.c).
 *
 * List scans on the thread pool; a delete's rename and directory fsync,
 * and reading one job's directory for retention, are in line. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "coord_ckpt.h"
#include "fsutil.h"
#include "ctl_decode.h"
#include "log.h"

/* ------------------------------------------------------------------------ */
/* List                                                                     */
/* ------------------------------------------------------------------------ */

typedef struct listed {
  char job[CTL_CKPT_DIR_MAX_BYTES + 1]; /* its directory: "<job>", or "<job>@<id>" if deleted */
  char name[CTL_NAME_MAX_BYTES + 1];
  char tenant[AUTH_NAME_MAX_BYTES + 1]; /* its owner */
  uint64_t step, bytes, job_id;
  uint32_t world_size;
  int64_t created_unix_ms;
} listed;

typedef struct list_work {
  ckpt_work base;
  rpc_call *call; /* NULL once the client went away */
  char dir[PATH_MAX];
  char job[CTL_CKPT_DIR_MAX_BYTES + 1]; /* "": every job */
  ckpt_access access;                   /* sees the checkpoints it may read (ckpt_owner.c) */
  /* Out */
  int status;
  char message[256];
  listed *items;
  size_t count, capacity;
} list_work;

static int compare_listed(const void *a, const void *b) {
  const listed *x = a, *y = b;
  int cmp = strcmp(x->job, y->job);
  if (cmp != 0)
    return cmp;
  if (x->step != y->step)
    return x->step < y->step ? -1 : 1;
  return strcmp(x->name, y->name);
}

/* Adds the checkpoints of one job's directory that the caller may read.
 * A directory with a final name whose manifest does not decode is
 * skipped, with a warning: it is not a checkpoint (an admin's Delete can
 * still remove it). */
static void list_job(list_work *w, const char *job) {
  char job_dir[PATH_MAX], path[PATH_MAX + CTL_NAME_MAX_BYTES + 2];
  coord__ckpt_path_format(job_dir, sizeof job_dir, "%s/%s", w->dir, job);
  DIR *d = opendir(job_dir);
  if (d == NULL) {
    if (errno != ENOENT && errno != ENOTDIR)
      LOG_WARNF("cannot list a job's checkpoints", "path=%s err=\"%s\"", job_dir, strerror(errno));
    return;
  }
  struct dirent *e;
  while (w->status == 0 && (e = readdir(d)) != NULL) {
    if (!ctl_valid_checkpoint_name(e->d_name) || !coord__ckpt_is_dir_at(dirfd(d), e))
      continue;
    coord__ckpt_path_format(path, sizeof path, "%s/%s", job_dir, e->d_name);
    ckpt_manifest m;
    char err[512];
    if (ckpt_manifest_load(path, CKPT_MANIFEST_NAME, 0, &m, err, sizeof err) != 0) {
      char quoted[600];
      LOG_WARNF("skipped a checkpoint directory whose manifest does not decode", "path=%s err=%s",
                path, log_quote(err, quoted, sizeof quoted));
      continue;
    }
    if (coord__ckpt_allowed(&w->access, m.job_id, m.tenant, CKPT_READ) != 0) {
      ckpt_manifest_free(&m);
      continue; /* another tenant's: not even its name is shown */
    }
    if (w->count == w->capacity) {
      size_t capacity = w->capacity ? w->capacity * 2 : 64;
      listed *grown = realloc(w->items, capacity * sizeof *grown);
      if (grown == NULL) {
        w->status = RPC_RESOURCE_EXHAUSTED;
        snprintf(w->message, sizeof w->message, "coordinator out of memory");
        ckpt_manifest_free(&m);
        break;
      }
      w->items = grown;
      w->capacity = capacity;
    }
    listed *item = &w->items[w->count++];
    snprintf(item->job, sizeof item->job, "%s", job);
    coord__ckpt_copy_name(item->name, sizeof item->name, e->d_name);
    item->step = m.step;
    item->world_size = m.world_size;
    item->job_id = m.job_id;
    snprintf(item->tenant, sizeof item->tenant, "%s",
             coord__ckpt_owner(&w->access, m.job_id, m.tenant));
    item->created_unix_ms = m.created_unix_ms;
    item->bytes = 0;
    for (uint32_t r = 0; r < m.world_size; r++)
      item->bytes += m.files[r].bytes;
    ckpt_manifest_free(&m);
    if (w->count > CKPT_MAX_LISTED) {
      w->status = RPC_RESOURCE_EXHAUSTED;
      snprintf(w->message, sizeof w->message, "more than %d checkpoints; list one job at a time",
               CKPT_MAX_LISTED);
    }
  }
  closedir(d);
}

/* Whether a directory entry of the checkpoint directory is one to list:
 * with job "", every job's directory; with "<job>", that job's and those of
 * the deleted jobs of its name ("<job>@<id>"); with "<job>@<id>", that one. */
static int list_wants(const list_work *w, const char *entry) {
  char job[CTL_NAME_MAX_BYTES + 1];
  uint64_t id;
  if (!ctl_parse_checkpoint_dir(entry, job, &id))
    return 0;
  if (w->job[0] == '\0')
    return 1;
  if (strchr(w->job, '@') != NULL)
    return strcmp(entry, w->job) == 0;
  return strcmp(job, w->job) == 0;
}

static void list_run(ckpt_work *base) {
  list_work *w = (list_work *)base;
  DIR *d = opendir(w->dir);
  if (d == NULL) {
    w->status = coord__ckpt_io_status(errno);
    snprintf(w->message, sizeof w->message, "cannot read the checkpoint directory: %s",
             strerror(errno));
    return;
  }
  struct dirent *e;
  while (w->status == 0 && (e = readdir(d)) != NULL)
    if (list_wants(w, e->d_name) && coord__ckpt_is_dir_at(dirfd(d), e))
      list_job(w, e->d_name);
  closedir(d);
  if (w->status == 0 && w->count > 1)
    qsort(w->items, w->count, sizeof *w->items, compare_listed);
}

static void list_done(ckpt_work *base) {
  list_work *w = (list_work *)base;
  coord *c = w->base.c;
  if (w->call == NULL) {
    /* The client went away (its cancel callback freed the call). */
  } else if (w->status != 0) {
    rpc_call_set_cancel(w->call, NULL, NULL);
    rpc_call_finish(w->call, w->status, w->message, NULL, 0);
  } else {
    Zerod__V1__Checkpoint *checkpoints = calloc(w->count ? w->count : 1, sizeof *checkpoints);
    Zerod__V1__Checkpoint **pointers = calloc(w->count ? w->count : 1, sizeof *pointers);
    char(*paths)[PATH_MAX + CTL_CKPT_DIR_MAX_BYTES + CTL_NAME_MAX_BYTES + 2] =
        calloc(w->count ? w->count : 1, sizeof *paths);
    rpc_call_set_cancel(w->call, NULL, NULL);
    if (checkpoints == NULL || pointers == NULL || paths == NULL) {
      rpc_call_finish(w->call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory", NULL, 0);
    } else {
      size_t n = 0;
      for (size_t i = 0; i < w->count; i++) {
        const listed *item = &w->items[i];
        Zerod__V1__Checkpoint *out = &checkpoints[n];
        zerod__v1__checkpoint__init(out);
        snprintf(paths[n], sizeof paths[n], "%s/%s/%s", c->options.checkpoint_dir, item->job,
                 item->name);
        out->job = (char *)item->job;
        out->name = (char *)item->name;
        out->path = paths[n];
        out->step = item->step;
        out->world_size = item->world_size;
        out->bytes = item->bytes;
        out->created_unix_ms = item->created_unix_ms;
        out->job_id = item->job_id;
        out->tenant = (char *)item->tenant;
        pointers[n++] = out;
      }
      Zerod__V1__ListCheckpointsReply reply = ZEROD__V1__LIST_CHECKPOINTS_REPLY__INIT;
      reply.n_checkpoints = n;
      reply.checkpoints = pointers;
      coord__finish_message(w->call, &reply.base);
    }
    free(checkpoints);
    free(pointers);
    free(paths);
  }
  free(w->items);
  coord__ckpt_access_free(&w->access);
  free(w);
}

static void on_list_cancelled(rpc_call *call, void *arg) {
  list_work *w = arg;
  w->call = NULL;
  rpc_call_finish(call, rpc_call_remaining_ms(call) <= 0 ? RPC_DEADLINE_EXCEEDED : RPC_CANCELLED,
                  "list ended", NULL, 0);
}

static void on_list(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  coord_caller who;
  Zerod__V1__ListCheckpointsRequest *req =
      coord__begin_as(c, call, CTL_LIST_CHECKPOINTS, request, request_bytes, &who);
  if (req == NULL)
    return;
  list_work *w = NULL;
  if (c->options.checkpoint_dir[0] == '\0') {
    coord__finish_error(call, RPC_FAILED_PRECONDITION,
                        "this coordinator has no checkpoint directory");
  } else if ((w = calloc(1, sizeof *w)) == NULL ||
             coord__ckpt_access(c, &who, NULL, &w->access) != 0) {
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
    free(w);
  } else {
    /* Checkpoints outlive their jobs: the job named need not exist. */
    w->base.run = list_run;
    w->base.done = list_done;
    w->call = call;
    snprintf(w->dir, sizeof w->dir, "%s", c->options.checkpoint_dir);
    snprintf(w->job, sizeof w->job, "%s", req->job);
    rpc_call_set_cancel(call, on_list_cancelled, w);
    coord__ckpt_queue_work(c, &w->base);
  }
  ctl_free(&req->base);
}

/* ------------------------------------------------------------------------ */
/* Delete                                                                   */
/* ------------------------------------------------------------------------ */

/* Takes job/name out of the catalog at once (a rename to
 * name.deleting-<id>, synced) and removes its files on the thread pool,
 * if access (NULL: the coordinator itself) may delete it. Returns 0 or a
 * status with the reason in err. */
static int delete_checkpoint(coord *c, const char *job, const char *name, const ckpt_access *access,
                             char *err, size_t err_bytes) {
  char job_dir[PATH_MAX], path[PATH_MAX + CTL_NAME_MAX_BYTES + 2];
  char gone[PATH_MAX + CTL_NAME_MAX_BYTES + 48];
  coord__ckpt_path_format(job_dir, sizeof job_dir, "%s/%s", c->options.checkpoint_dir, job);
  snprintf(path, sizeof path, "%s/%s", job_dir, name);
  struct stat st;
  /* Another tenant's is as missing as a missing one (ckpt_owner.c). */
  int status = lstat(path, &st) != 0 || !S_ISDIR(st.st_mode) ? RPC_NOT_FOUND
               : access != NULL                              ? coord__ckpt_may_delete(access, path)
                                                             : 0;
  if (status == RPC_PERMISSION_DENIED)
    snprintf(err, err_bytes, "%s %s of tenant %s may not delete checkpoints",
             auth_role_name(access->who.role), access->who.name, access->who.tenant);
  else if (status != 0)
    snprintf(err, err_bytes, "job '%s' has no checkpoint named '%s'", job, name);
  if (status != 0)
    return status;
  const ckpt_order *reader = coord__ckpt_restore_reading(c, path);
  if (reader != NULL) {
    snprintf(err, err_bytes,
             "job '%s' is being restored from checkpoint '%s/%s' (order %" PRIu64
             "); retry when it is done",
             reader->job, job, name, reader->id);
    return RPC_FAILED_PRECONDITION;
  }
  const cjob *base = coord__find_job(c, job);
  if (base != NULL && base->msg->frozen &&
      (strcmp(base->msg->base_checkpoint, name) == 0 || strcmp(base->ckpt.base_saved, name) == 0)) {
    snprintf(err, err_bytes,
             "checkpoint '%s/%s' holds base '%s': its nodes are restored from it after a "
             "restart (delete the base first)",
             job, name, job);
    return RPC_FAILED_PRECONDITION;
  }
  if (coord__ckpt_export_reading(c, path) != NULL) {
    snprintf(err, err_bytes, "checkpoint '%s/%s' is being exported; retry when it is done", job,
             name);
    return RPC_FAILED_PRECONDITION;
  }
  snprintf(gone, sizeof gone, "%s.deleting-%" PRIu64, path, c->ckpt.next_id++);
  if (rename(path, gone) != 0) {
    int errnum = errno;
    snprintf(err, err_bytes, "cannot delete %s: %s", path, strerror(errnum));
    return errnum == ENOENT ? RPC_NOT_FOUND : coord__ckpt_io_status(errnum);
  }
  /* Gone from List from here on. Unsynced, the rename might be undone by
   * a crash of the machine: then the checkpoint would simply be back. */
  int rc = fsutil_fsync_dir(job_dir, NULL);
  if (rc != 0)
    LOG_WARNF("checkpoint renamed for deletion but its directory not synced", "path=%s err=\"%s\"",
              job_dir, strerror(-rc));
  LOG_INFOF("checkpoint deleted", "job=%s name=%s", job, name);
  coord__ckpt_remove_tree(c, gone, "deleted checkpoint");
  return 0;
}

static void on_delete_checkpoint(rpc_call *call, const uint8_t *request, size_t request_bytes,
                                 void *arg) {
  coord *c = arg;
  coord_caller who;
  Zerod__V1__DeleteCheckpointRequest *req =
      coord__begin_as(c, call, CTL_DELETE_CHECKPOINT, request, request_bytes, &who);
  if (req == NULL)
    return;
  char err[PATH_MAX + 256];
  int status;
  ckpt_access access = {0};
  if (c->options.checkpoint_dir[0] == '\0') {
    snprintf(err, sizeof err, "this coordinator has no checkpoint directory");
    status = RPC_FAILED_PRECONDITION;
  } else if (coord__ckpt_access(c, &who, NULL, &access) != 0) {
    snprintf(err, sizeof err, "coordinator out of memory");
    status = RPC_RESOURCE_EXHAUSTED;
  } else {
    status = delete_checkpoint(c, req->job, req->name, &access, err, sizeof err);
  }
  coord__ckpt_access_free(&access);
  if (status != 0) {
    coord__finish_error(call, status, "%s", err);
  } else {
    Zerod__V1__DeleteCheckpointReply reply = ZEROD__V1__DELETE_CHECKPOINT_REPLY__INIT;
    coord__finish_message(call, &reply.base);
  }
  ctl_free(&req->base);
}

/* ------------------------------------------------------------------------ */
/* Retention of a job's periodic checkpoints                                */
/* ------------------------------------------------------------------------ */

typedef struct auto_entry {
  uint64_t step;
  char name[CTL_NAME_MAX_BYTES + 1];
} auto_entry;

static int compare_auto_newest_first(const void *a, const void *b) {
  const auto_entry *x = a, *y = b;
  if (x->step != y->step)
    return x->step > y->step ? -1 : 1;
  return -strcmp(x->name, y->name);
}

/* After a periodic checkpoint of j: deletes its oldest auto-* checkpoints
 * beyond the policy's keep. Their names carry the step (auto-<step> or
 * auto-<step>-<id>), so one read of the job's directory is enough. */
void coord__ckpt_apply_retention(coord *c, cjob *j) {
  const Zerod__V1__CheckpointPolicy *policy = j->msg->checkpoint_policy;
  if (policy == NULL || policy->keep == 0)
    return;
  char job_dir[PATH_MAX];
  coord__ckpt_path_format(job_dir, sizeof job_dir, "%s/%s", c->options.checkpoint_dir,
                          j->msg->name);
  DIR *d = opendir(job_dir);
  if (d == NULL) {
    LOG_WARNF("cannot read a job's checkpoints to drop old ones", "path=%s err=\"%s\"", job_dir,
              strerror(errno));
    return;
  }
  auto_entry *entries = NULL;
  size_t count = 0, capacity = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    const char *p = e->d_name;
    if (strncmp(p, "auto-", 5) != 0 || !ctl_valid_checkpoint_name(p) ||
        !coord__ckpt_is_dir_at(dirfd(d), e))
      continue;
    char *end;
    errno = 0;
    unsigned long long step = strtoull(p + 5, &end, 10);
    if (errno != 0 || end == p + 5 || (*end != '\0' && *end != '-'))
      continue; /* not a name the schedule made */
    if (count == capacity) {
      size_t grown_capacity = capacity ? capacity * 2 : 16;
      auto_entry *grown = realloc(entries, grown_capacity * sizeof *grown);
      if (grown == NULL)
        break; /* keep more rather than fail: the next one retries */
      entries = grown;
      capacity = grown_capacity;
    }
    entries[count].step = step;
    coord__ckpt_copy_name(entries[count].name, sizeof entries[count].name, p);
    count++;
  }
  closedir(d);
  if (count > policy->keep) {
    qsort(entries, count, sizeof *entries, compare_auto_newest_first);
    size_t kept = 0;
    for (size_t i = 0; i < count; i++) {
      if (!coord__ckpt_saved_by(c, j, entries[i].name))
        continue; /* an earlier job's of this name: not this policy's to drop */
      if (kept < policy->keep) {
        kept++;
        continue;
      }
      char err[PATH_MAX + 256];
      if (delete_checkpoint(c, j->msg->name, entries[i].name, NULL, err, sizeof err) != 0)
        LOG_WARNF("cannot drop an old periodic checkpoint", "job=%s name=%s err=\"%s\"",
                  j->msg->name, entries[i].name, err);
    }
  }
  free(entries);
}

int coord__ckpt_catalog_register(coord *c, rpc_server *server) {
  static const coord_method methods[] = {
      {CTL_LIST_CHECKPOINTS, RPC_UNARY, on_list},
      {CTL_DELETE_CHECKPOINT, RPC_UNARY, on_delete_checkpoint},
  };
  return coord__add_methods(c, server, methods, sizeof methods / sizeof methods[0]);
}
