/* A node's checkpoints, off the loop: what the ranks' executors report
 * through the job's checkpoint hooks (a save's copy staged, taken or
 * failed; a restore read or installed), and the shard writers, one thread
 * per rank and save, that fault in the memory for a copy and write it to
 * the save's directory (see ckpt_node.h). The loop's side is ckpt_node.c;
 * the two meet in the job's checkpoint state (ckpt_node_impl.h) and the
 * async handle that wakes the loop. */
#include "ckpt_node_impl.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "crashpoint.h"
#include "ctl_decode.h"
#include "daemon.h"
#include "exec.h"
#include "hostmem.h"
#include "log.h"
#include "rank_metrics.h"
#include "rpc.h"

/* Asks the loop for a heartbeat: progress is reported at once. */
static void wake_loop(job *j) {
  zdaemon *d = j->owner;
  if (d != NULL && atomic_load(&d->ckpt_async_ready))
    uv_async_send(&d->ckpt_async);
}

static void save_free(save_rec *s, int nranks) {
  for (int i = 0; i < nranks; i++) {
    hostmem_shared_unref(s->ranks[i].data);
    hostmem_shared_unref(s->ranks[i].staging);
    ckpt_manifest_free(s->ranks[i].layout);
    free(s->ranks[i].layout);
  }
  free(s->ranks);
  free(s->dir);
  free(s);
}

/* Under c->mutex. */
void ckpt_node__save_unref(job *j, save_rec *s) {
  if (--s->refs == 0)
    save_free(s, j->nranks);
}

/* Under c->mutex: whether save id has ended on this node. */
static int save_ended(const job_ckpt *c, uint64_t id) {
  for (unsigned i = 0; i < ENDED_KEPT; i++)
    if (c->ended[i] == id)
      return 1;
  return 0;
}

/* Under c->mutex: the save's record, made if absent (a rank may learn of a
 * save from its peers before its node gets the order). */
save_rec *ckpt_node__save_get(job *j, uint64_t id) {
  job_ckpt *c = j->ckpt;
  for (save_rec *s = c->saves; s != NULL; s = s->next)
    if (s->id == id)
      return s;
  save_rec *s = calloc(1, sizeof *s);
  if (s == NULL)
    return NULL;
  s->ranks = calloc((size_t)j->nranks, sizeof *s->ranks);
  if (s->ranks == NULL) {
    free(s);
    return NULL;
  }
  s->id = id;
  s->refs = 1;
  s->next = c->saves;
  c->saves = s;
  return s;
}

typedef struct writer_arg {
  job *j;
  save_rec *s;
  int local;
} writer_arg;

static int write_shard(job *j, save_rec *s, rank_save *rs, int rank, const char *dir, char *err,
                       size_t err_bytes) {
  double t0 = clock_now_s() * 1e3;
  if (rs->layout != NULL) {
    int rc = ckpt_manifest_store(dir, CKPT_LAYOUT_NAME, rs->layout, err, err_bytes);
    if (rc != 0)
      return rc;
  }
  double t1 = clock_now_s() * 1e3;
  rs->layout_ms = t1 - t0;
  char path[PATH_MAX];
  ckpt_shard_name((uint32_t)rank, (uint32_t)j->world_size, rs->file, sizeof rs->file);
  if (snprintf(path, sizeof path, "%s/%s", dir, rs->file) >= (int)sizeof path) {
    snprintf(err, err_bytes, "%s: path too long", dir);
    return -ENAMETOOLONG;
  }
  ckpt_shard_header h = {.rank = (uint32_t)rank,
                         .world_size = (uint32_t)j->world_size,
                         .job_id = j->id,
                         .step = rs->step,
                         .data_bytes = rs->data_bytes};
  ckpt_writer *w = NULL;
  int rc = ckpt_writer_open(path, &h, &w, err, err_bytes);
  if (rc != 0)
    return rc;
  const uint8_t *p = rs->data;
  for (uint64_t at = 0; at < rs->data_bytes; at += WRITE_CHUNK) {
    if (atomic_load(&s->abort)) {
      ckpt_writer_abort(w);
      snprintf(err, err_bytes, "the save was withdrawn");
      return -ECANCELED;
    }
    size_t n = rs->data_bytes - at < WRITE_CHUNK ? (size_t)(rs->data_bytes - at) : WRITE_CHUNK;
    rc = ckpt_writer_write(w, p + at, n, err, err_bytes);
    if (rc != 0) {
      ckpt_writer_abort(w);
      return rc;
    }
    crash_point("node-shard-write");
  }
  double t2 = clock_now_s() * 1e3;
  rs->data_ms = t2 - t1;
  rc = ckpt_writer_finish(w, &rs->bytes, &rs->xxh64, err, err_bytes);
  rs->sync_ms = clock_now_s() * 1e3 - t2;
  return rc;
}

/* Under c->mutex, for a writer started before its rank's copy
 * (ckpt_node_stage): faults in the memory the copy will go into while
 * training goes on, and beside the copy if the rank takes it first; then
 * waits for the copy. Whether it came (the rank may fail its save, or the
 * save end, first). */
static int stage_and_wait(job *j, save_rec *s, rank_save *rs, int rank) {
  job_ckpt *c = j->ckpt;
  uint64_t bytes = rs->staging_bytes;
  pthread_mutex_unlock(&c->mutex);
  double t0 = clock_now_s() * 1e3;
  uint8_t *p = hostmem_shared_alloc(bytes);
  if (p != NULL)
    hostmem_shared_ref(p); /* this thread's, while it faults pages in */
  pthread_mutex_lock(&c->mutex);
  rs->staging = p;
  if (p == NULL)
    rs->stage = STAGE_NONE; /* the rank allocates */
  uint64_t done = 0, before_taken = 0;
  int populated = 1; /* 0: the kernel cannot (before 5.14); the copy faults them in */
  while ((rs->stage == STAGE_FAULTING || rs->stage == STAGE_TAKEN) && rs->state == SAVE_COPYING &&
         done < bytes && populated && !atomic_load(&s->abort)) {
    if (rs->stage == STAGE_FAULTING)
      before_taken = done;
    pthread_mutex_unlock(&c->mutex);
    size_t n = bytes - done < STAGE_CHUNK ? (size_t)(bytes - done) : STAGE_CHUNK;
    if ((populated = hostmem_populate(p + done, n) == 0))
      done += n;
    pthread_mutex_lock(&c->mutex);
  }
  if (rs->stage == STAGE_FAULTING) {
    rs->stage = STAGE_READY;
    before_taken = done;
  }
  /* faulted: before the rank took it (all of it if it did not, yet) */
  LOG_DEBUGF("memory for a save's copy faulted in",
             "job=%s rank=%d save=%llu bytes=%llu faulted=%llu ms=%.1f", j->name, rank,
             (unsigned long long)s->id, (unsigned long long)bytes, (unsigned long long)before_taken,
             clock_now_s() * 1e3 - t0);
  pthread_mutex_unlock(&c->mutex);
  hostmem_shared_unref(p);
  pthread_mutex_lock(&c->mutex);
  while (rs->state == SAVE_COPYING && !atomic_load(&s->abort))
    pthread_cond_wait(&c->cond, &c->mutex);
  if (rs->stage == STAGE_READY) { /* not taken: the copy came without it */
    p = rs->staging;
    rs->staging = NULL;
    rs->stage = STAGE_NONE;
    pthread_mutex_unlock(&c->mutex);
    hostmem_shared_unref(p);
    pthread_mutex_lock(&c->mutex);
  }
  return rs->state == SAVE_WRITING;
}

static void *writer_main(void *arg) {
  writer_arg *a = arg;
  job *j = a->j;
  pthread_setname_np(pthread_self(), "zd-ckpt-write");
  save_rec *s = a->s;
  int local = a->local;
  free(a);
  job_ckpt *c = j->ckpt;
  rank_save *rs = &s->ranks[local];
  int rank = j->first_rank + local;

  pthread_mutex_lock(&c->mutex);
  if (rs->stage == STAGE_FAULTING && !stage_and_wait(j, s, rs, rank)) {
    /* The rank reported its own failure, or the save ended: nothing to
     * write or report here. */
    ckpt_node__save_unref(j, s);
    wake_loop(j);
    c->writers--;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->mutex);
    return NULL;
  }
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += ORDER_WAIT_S;
  int timed_out = 0;
  while (s->dir == NULL && !atomic_load(&s->abort) && !timed_out)
    timed_out = pthread_cond_timedwait(&c->cond, &c->mutex, &deadline) == ETIMEDOUT;
  char dir[PATH_MAX] = "";
  if (s->dir != NULL)
    snprintf(dir, sizeof dir, "%s", s->dir);
  pthread_mutex_unlock(&c->mutex);

  char err[512] = "";
  int rc;
  if (dir[0] == '\0' && !timed_out) {
    rc = -ECANCELED;
    snprintf(err, sizeof err, "the save was withdrawn");
  } else if (dir[0] == '\0') {
    rc = -ETIMEDOUT;
    snprintf(err, sizeof err, "the save order did not reach this node in %d s", ORDER_WAIT_S);
  } else {
    rc = write_shard(j, s, rs, rank, dir, err, sizeof err);
  }
  if (rc != 0) {
    char msg[600];
    LOG_WARNF("shard not saved", "job=%s rank=%d save=%llu error=%s", j->name, rank,
              (unsigned long long)s->id, log_quote(err, msg, sizeof msg));
  } else {
    crash_point("node-shard-written");
    rank_metrics_ckpt_written(&j->ranks[local], (rs->layout_ms + rs->data_ms + rs->sync_ms) / 1e3,
                              rs->bytes);
    LOG_INFOF("shard saved",
              "job=%s rank=%d save=%llu step=%llu bytes=%llu layout_ms=%.1f data_ms=%.1f "
              "sync_ms=%.1f",
              j->name, rank, (unsigned long long)s->id, (unsigned long long)rs->step,
              (unsigned long long)rs->bytes, rs->layout_ms, rs->data_ms, rs->sync_ms);
  }

  pthread_mutex_lock(&c->mutex);
  if (rc != 0) {
    rs->state = SAVE_FAILED;
    rs->code = rc == -ENOSPC || rc == -EDQUOT ? RPC_RESOURCE_EXHAUSTED
               : rc == -ECANCELED             ? RPC_CANCELLED
               : rc == -ETIMEDOUT             ? RPC_DEADLINE_EXCEEDED
                                              : RPC_INTERNAL;
    snprintf(rs->error, sizeof rs->error, "%s", err);
  } else {
    rs->state = SAVE_DONE;
  }
  hostmem_shared_unref(rs->data);
  rs->data = NULL;
  ckpt_manifest_free(rs->layout);
  free(rs->layout);
  rs->layout = NULL;
  ckpt_node__save_unref(j, s);
  /* Before this writer stops counting: once none does, the job and the
   * loop's handle may go (stop_writers, then shutdown or jobs_free). */
  wake_loop(j);
  c->writers--;
  pthread_cond_broadcast(&c->cond);
  pthread_mutex_unlock(&c->mutex);
  return NULL;
}

/* Under c->mutex: starts rank local's writer for save s. */
void ckpt_node__start_writer(job *j, save_rec *s, int local) {
  job_ckpt *c = j->ckpt;
  rank_save *rs = &s->ranks[local];
  writer_arg *a = malloc(sizeof *a);
  int rc = ENOMEM;
  if (a != NULL) {
    *a = (writer_arg){.j = j, .s = s, .local = local};
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    s->refs++;
    c->writers++;
    rc = pthread_create(&t, &attr, writer_main, a);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
      s->refs--;
      c->writers--;
      free(a);
    }
  }
  if (rc == 0) {
    rs->has_writer = 1;
    return;
  }
  rs->stage = STAGE_NONE;
  if (rs->state == SAVE_WRITING) {
    rs->state = SAVE_FAILED;
    rs->code = RPC_RESOURCE_EXHAUSTED;
    snprintf(rs->error, sizeof rs->error, "cannot start the shard writer: %s", strerror(rc));
  }
}

void ckpt_node_stage(job *j, int rank, uint64_t id, uint64_t bytes) {
  job_ckpt *c = j->ckpt;
  pthread_mutex_lock(&c->mutex);
  save_rec *s = save_ended(c, id) ? NULL : ckpt_node__save_get(j, id);
  rank_save *rs = s != NULL ? &s->ranks[rank - j->first_rank] : NULL;
  if (rs != NULL && !rs->has_writer && rs->state == SAVE_COPYING && bytes > 0) {
    rs->stage = STAGE_FAULTING;
    rs->staging_bytes = bytes;
    ckpt_node__start_writer(j, s, rank - j->first_rank);
  }
  pthread_mutex_unlock(&c->mutex);
}

void *ckpt_node_staging(job *j, int rank, uint64_t id, uint64_t bytes) {
  job_ckpt *c = j->ckpt;
  void *p = NULL;
  pthread_mutex_lock(&c->mutex);
  save_rec *s = c->saves;
  while (s != NULL && s->id != id)
    s = s->next;
  rank_save *rs = s != NULL ? &s->ranks[rank - j->first_rank] : NULL;
  /* Taken as it is, faulted in or not: waiting for the writer would make
   * the copy wait for a thread that may not be running. */
  if (rs != NULL && rs->staging != NULL && rs->staging_bytes == bytes &&
      (rs->stage == STAGE_FAULTING || rs->stage == STAGE_READY)) {
    p = rs->staging;
    rs->staging = NULL;
    rs->stage = STAGE_TAKEN;
  }
  pthread_mutex_unlock(&c->mutex);
  return p;
}

void ckpt_node_saved(job *j, int rank, uint64_t id, uint64_t step, void *data, uint64_t data_bytes,
                     ckpt_manifest *layout, int64_t stall_ms) {
  job_ckpt *c = j->ckpt;
  int local = rank - j->first_rank;
  pthread_mutex_lock(&c->mutex);
  int ended = save_ended(c, id);
  save_rec *s = ended ? NULL : ckpt_node__save_get(j, id);
  if (s == NULL) {
    pthread_mutex_unlock(&c->mutex);
    hostmem_shared_unref(data);
    ckpt_manifest_free(layout);
    free(layout);
    if (ended)
      LOG_DEBUGF("copy for a save that has ended dropped", "job=%s rank=%d save=%llu", j->name,
                 rank, (unsigned long long)id);
    else
      ckpt_node_save_failed(j, rank, id, RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  rank_save *rs = &s->ranks[local];
  rs->state = SAVE_WRITING;
  rs->step = step;
  rs->stall_ms = stall_ms;
  rank_metrics_ckpt_stall(&j->ranks[local], (double)stall_ms / 1e3);
  rs->data = data;
  rs->data_bytes = data_bytes;
  rs->layout = layout;
  if (rs->has_writer) /* waiting for the copy (stage_and_wait) */
    pthread_cond_broadcast(&c->cond);
  else
    ckpt_node__start_writer(j, s, local);
  pthread_mutex_unlock(&c->mutex);
  wake_loop(j);
}

void ckpt_node_save_failed(job *j, int rank, uint64_t id, int code, const char *error) {
  job_ckpt *c = j->ckpt;
  pthread_mutex_lock(&c->mutex);
  save_rec *s = save_ended(c, id) ? NULL : ckpt_node__save_get(j, id);
  if (s != NULL) {
    rank_save *rs = &s->ranks[rank - j->first_rank];
    rs->state = SAVE_FAILED;
    rs->code = code;
    snprintf(rs->error, sizeof rs->error, "%s", error);
    pthread_cond_broadcast(&c->cond); /* a writer staging for the copy stops */
  }
  pthread_mutex_unlock(&c->mutex);
  char msg[600];
  LOG_WARNF("shard not saved", "job=%s rank=%d save=%llu error=%s", j->name, rank,
            (unsigned long long)id, log_quote(error, msg, sizeof msg));
  wake_loop(j);
}

void ckpt_node_restore_report(job *j, int rank, uint64_t id, int committed, uint64_t step, int code,
                              const char *error) {
  job_ckpt *c = j->ckpt;
  pthread_mutex_lock(&c->mutex);
  if (c->restore_id == id) {
    rank_restore *r = &c->restores[rank - j->first_rank];
    r->done = 1;
    r->committed = committed;
    r->step = step;
    r->code = code;
    snprintf(r->error, sizeof r->error, "%s", error != NULL ? error : "");
  }
  pthread_mutex_unlock(&c->mutex);
  wake_loop(j);
}

const exec_ckpt_hooks ckpt_node_hooks = {
    .stage = ckpt_node_stage,
    .staging = ckpt_node_staging,
    .saved = ckpt_node_saved,
    .save_failed = ckpt_node_save_failed,
    .restore_report = ckpt_node_restore_report,
    .restore_fetch = ckpt_node__mem_fetch,
    .replica_dir = ckpt_node__replica_dir,
    .replica_push = ckpt_node__replica_push,
    .replica_done = ckpt_node__replica_done,
};
