/* A node's part of checkpoints: orders, reports, the ranks' copies and
 * shard writers, layouts (see ckpt_node.h). The reading side of restores
 * is ckpt_restore.c. */
#include "ckpt_node.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "crashpoint.h"
#include "ctl_decode.h"
#include "daemon.h"
#include "exec.h"
#include "hostmem.h"
#include "log.h"
#include "rpc.h"

/* Data is handed to the shard writer in chunks of this size, and a save
 * withdrawn by the coordinator is noticed between two of them. */
#define WRITE_CHUNK (8u << 20)
/* A rank that learnt of a save from its peers (the step's all-reduce)
 * waits this long for the order itself to reach its node. */
#define ORDER_WAIT_S 120
/* Saves that ended here, remembered so that a copy taken after its order
 * left (ranks agreed on the save in a step that was running when it was
 * withdrawn) is dropped. One order per job at a time: a few are plenty. */
#define ENDED_KEPT 8

enum { SAVE_COPYING = 0, SAVE_WRITING = 1, SAVE_DONE = 2, SAVE_FAILED = 3 };
/* The memory a rank's copy goes into, when its writer faults it in ahead
 * of the copy (ckpt_node_stage). The rank may take it before the writer
 * is done, without waiting: the writer goes on faulting pages in beside
 * the copy (MADV_POPULATE_WRITE leaves written pages alone) until the copy
 * is over, and holds a reference of its own meanwhile (hostmem_shared_*). */
enum { STAGE_NONE, STAGE_FAULTING, STAGE_READY, STAGE_TAKEN };
/* The writer faults the memory in by chunks of this size, looking between
 * two at whether the copy is over. */
#define STAGE_CHUNK (4u << 20)

typedef struct rank_save {
  int state;
  uint64_t step;
  int64_t stall_ms;
  char file[64];
  uint64_t bytes, xxh64;
  int code;
  char error[512];
  void *data; /* the copy (hostmem_shared_alloc), until written */
  uint64_t data_bytes;
  ckpt_manifest *layout;              /* rank 0 */
  double layout_ms, data_ms, sync_ms; /* the write's phases, for the log */
  int has_writer;
  int stage;     /* STAGE_* */
  void *staging; /* faulted in for the copy until the rank takes it */
  uint64_t staging_bytes;
} rank_save;

typedef struct save_rec {
  struct save_rec *next;
  uint64_t id;
  /* NULL until the order reaches this node: until then the record only
   * holds copies taken early (ranks told by their peers) and is not
   * reported. */
  char *dir;
  _Atomic int abort;
  int refs;         /* the job's list, and each running writer */
  rank_save *ranks; /* [nranks], by local index */
} save_rec;

typedef struct rank_restore {
  int done, committed, code;
  uint64_t step;
  char error[512];
} rank_restore;

typedef struct job_ckpt {
  pthread_mutex_t mutex;
  /* A save got its directory, a rank's copy or its staged memory came or
   * it failed, or a writer ended. */
  pthread_cond_t cond;
  save_rec *saves;
  uint64_t ended[ENDED_KEPT]; /* ids of saves that left the assignment */
  unsigned ended_next;
  int writers;         /* running */
  uint64_t restore_id; /* 0: none */
  int restore_commit_sent;
  rank_restore *restores; /* [nranks] */
} job_ckpt;

/* Asks the loop for a heartbeat: progress is reported at once. */
static void wake_loop(job *j) {
  zdaemon *d = j->owner;
  if (d != NULL && atomic_load(&d->ckpt_async_ready))
    uv_async_send(&d->ckpt_async);
}

static void on_ckpt_async(uv_async_t *h) {
  zdaemon *d = h->data;
  d->ckpt_progress(d);
}

int ckpt_node_init(zdaemon *d, void (*progress)(zdaemon *d)) {
  d->ckpt_progress = progress;
  int rc = uv_async_init(d->loop, &d->ckpt_async, on_ckpt_async);
  if (rc != 0)
    return rc;
  d->ckpt_async.data = d;
  atomic_store(&d->ckpt_async_ready, 1);
  return 0;
}

/* Asks the job's writers to stop and waits until they have. */
static void stop_writers(job *j) {
  job_ckpt *c = j->ckpt;
  if (c == NULL)
    return;
  pthread_mutex_lock(&c->mutex);
  for (save_rec *s = c->saves; s != NULL; s = s->next)
    atomic_store(&s->abort, 1);
  pthread_cond_broadcast(&c->cond);
  while (c->writers > 0)
    pthread_cond_wait(&c->cond, &c->mutex);
  pthread_mutex_unlock(&c->mutex);
}

void ckpt_node_shutdown(zdaemon *d) {
  for (job *j = d->jobs; j != NULL; j = j->next)
    stop_writers(j);
  for (job *j = d->retired; j != NULL; j = j->next)
    stop_writers(j);
  if (!atomic_exchange(&d->ckpt_async_ready, 0))
    return;
  uv_close((uv_handle_t *)&d->ckpt_async, NULL);
}

int ckpt_node_job_init(job *j) {
  job_ckpt *c = calloc(1, sizeof *c);
  if (c == NULL)
    return -ENOMEM;
  c->restores = calloc((size_t)(j->nranks > 0 ? j->nranks : 1), sizeof *c->restores);
  if (c->restores == NULL) {
    free(c);
    return -ENOMEM;
  }
  pthread_mutex_init(&c->mutex, NULL);
  pthread_cond_init(&c->cond, NULL);
  j->ckpt = c;
  return 0;
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
static void save_unref(job *j, save_rec *s) {
  if (--s->refs == 0)
    save_free(s, j->nranks);
}

void ckpt_node_job_free(job *j) {
  job_ckpt *c = j->ckpt;
  if (c == NULL)
    return;
  stop_writers(j);
  pthread_mutex_lock(&c->mutex);
  save_rec *next;
  for (save_rec *s = c->saves; s != NULL; s = next) {
    next = s->next;
    save_unref(j, s);
  }
  pthread_mutex_unlock(&c->mutex);
  pthread_mutex_destroy(&c->mutex);
  pthread_cond_destroy(&c->cond);
  free(c->restores);
  free(c);
  j->ckpt = NULL;
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
static save_rec *save_get(job *j, uint64_t id) {
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

/* ------------------------------------------------------------------------ */
/* Shard writers                                                            */
/* ------------------------------------------------------------------------ */

static double monotonic_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

typedef struct writer_arg {
  job *j;
  save_rec *s;
  int local;
} writer_arg;

static int write_shard(job *j, save_rec *s, rank_save *rs, int rank, const char *dir, char *err,
                       size_t err_bytes) {
  double t0 = monotonic_ms();
  if (rs->layout != NULL) {
    int rc = ckpt_manifest_store(dir, CKPT_LAYOUT_NAME, rs->layout, err, err_bytes);
    if (rc != 0)
      return rc;
  }
  double t1 = monotonic_ms();
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
  double t2 = monotonic_ms();
  rs->data_ms = t2 - t1;
  rc = ckpt_writer_finish(w, &rs->bytes, &rs->xxh64, err, err_bytes);
  rs->sync_ms = monotonic_ms() - t2;
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
  double t0 = monotonic_ms();
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
             monotonic_ms() - t0);
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
    save_unref(j, s);
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
  save_unref(j, s);
  /* Before this writer stops counting: once none does, the job and the
   * loop's handle may go (stop_writers, then shutdown or jobs_free). */
  wake_loop(j);
  c->writers--;
  pthread_cond_broadcast(&c->cond);
  pthread_mutex_unlock(&c->mutex);
  return NULL;
}

/* Under c->mutex: starts rank local's writer for save s. */
static void start_writer(job *j, save_rec *s, int local) {
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
  save_rec *s = save_ended(c, id) ? NULL : save_get(j, id);
  rank_save *rs = s != NULL ? &s->ranks[rank - j->first_rank] : NULL;
  if (rs != NULL && !rs->has_writer && rs->state == SAVE_COPYING && bytes > 0) {
    rs->stage = STAGE_FAULTING;
    rs->staging_bytes = bytes;
    start_writer(j, s, rank - j->first_rank);
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
  save_rec *s = ended ? NULL : save_get(j, id);
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
  rs->data = data;
  rs->data_bytes = data_bytes;
  rs->layout = layout;
  if (rs->has_writer) /* waiting for the copy (stage_and_wait) */
    pthread_cond_broadcast(&c->cond);
  else
    start_writer(j, s, local);
  pthread_mutex_unlock(&c->mutex);
  wake_loop(j);
}

void ckpt_node_save_failed(job *j, int rank, uint64_t id, int code, const char *error) {
  job_ckpt *c = j->ckpt;
  pthread_mutex_lock(&c->mutex);
  save_rec *s = save_ended(c, id) ? NULL : save_get(j, id);
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

/* ------------------------------------------------------------------------ */
/* Orders (loop thread)                                                     */
/* ------------------------------------------------------------------------ */

static void submit(job *j, op_kind kind, uint64_t id, const char *source, int format) {
  for (int r = 0; r < j->nranks; r++) {
    exec_op *op = exec_op_new(kind, &j->ranks[r]);
    if (op == NULL) {
      if (kind == OP_RESTORE_READ || kind == OP_RESTORE_COMMIT)
        ckpt_node_restore_report(j, j->first_rank + r, id, 0, 0, RPC_RESOURCE_EXHAUSTED,
                                 "out of memory");
      continue;
    }
    op->ckpt_id = id;
    op->ckpt_format = format;
    if (source != NULL && (op->ckpt_source = strdup(source)) == NULL) {
      exec_op_free(op);
      ckpt_node_restore_report(j, j->first_rank + r, id, 0, 0, RPC_RESOURCE_EXHAUSTED,
                               "out of memory");
      continue;
    }
    exec_submit(op);
  }
}

static void follow_saves(job *j, const Zerod__V1__Assignment *as) {
  job_ckpt *c = j->ckpt;
  pthread_mutex_lock(&c->mutex);
  for (size_t i = 0; as != NULL && i < as->n_saves; i++) {
    const Zerod__V1__SaveOrder *o = as->saves[i];
    if (o->id == 0 || o->dir == NULL || o->dir[0] != '/')
      continue;
    save_rec *s = save_get(j, o->id);
    if (s == NULL || s->dir != NULL || (s->dir = strdup(o->dir)) == NULL)
      continue;
    pthread_cond_broadcast(&c->cond);
    LOG_INFOF("save ordered", "job=%s save=%llu dir=%s", j->name, (unsigned long long)o->id,
              o->dir);
    /* Every local rank learns of it; one with no worker attached takes its
     * copy at once (OP_SAVE), the others at the end of the next step. */
    for (int r = 0; r < j->nranks; r++) {
      uint64_t prev = atomic_load(&j->ranks[r].ckpt_pending);
      if (prev < o->id)
        atomic_store(&j->ranks[r].ckpt_pending, o->id);
    }
    pthread_mutex_unlock(&c->mutex);
    submit(j, OP_SAVE, o->id, NULL, 0);
    pthread_mutex_lock(&c->mutex);
  }
  /* Orders that left the assignment are over (done, failed or withdrawn):
   * their writers stop at the next chunk and the records go. */
  for (save_rec **p = &c->saves; *p != NULL;) {
    save_rec *s = *p;
    int still = 0;
    for (size_t i = 0; as != NULL && i < as->n_saves && !still; i++)
      still = as->saves[i]->id == s->id;
    if (still || s->dir == NULL) {
      p = &s->next;
      continue;
    }
    *p = s->next;
    /* A rank that has not taken its copy yet must not bring the withdrawn
     * id into its next step's all-reduce (the ids summed there must be
     * those of one order). */
    for (int r = 0; r < j->nranks; r++) {
      uint64_t id = s->id;
      atomic_compare_exchange_strong(&j->ranks[r].ckpt_pending, &id, 0);
    }
    atomic_store(&s->abort, 1);
    pthread_cond_broadcast(&c->cond);
    c->ended[c->ended_next++ % ENDED_KEPT] = s->id;
    save_unref(j, s);
  }
  pthread_mutex_unlock(&c->mutex);
}

static void follow_restore(job *j, const Zerod__V1__Assignment *as) {
  job_ckpt *c = j->ckpt;
  const Zerod__V1__RestoreOrder *o = as != NULL ? as->restore : NULL;
  if (o != NULL && (o->id == 0 || o->source == NULL || o->source[0] != '/'))
    o = NULL;
  pthread_mutex_lock(&c->mutex);
  uint64_t current = c->restore_id;
  int commit_sent = c->restore_commit_sent;
  pthread_mutex_unlock(&c->mutex);

  if (current != 0 && (o == NULL || o->id != current)) {
    /* Withdrawn (failed elsewhere, or done): what was read but not
     * installed is dropped, and workers may attach again. */
    if (!commit_sent)
      submit(j, OP_RESTORE_ABORT, current, NULL, 0);
    pthread_mutex_lock(&c->mutex);
    c->restore_id = 0;
    c->restore_commit_sent = 0;
    pthread_mutex_unlock(&c->mutex);
    j->restoring = 0;
    LOG_INFOF("restore ended", "job=%s restore=%llu", j->name, (unsigned long long)current);
    current = 0;
  }
  if (o == NULL)
    return;
  if (current == 0) {
    pthread_mutex_lock(&c->mutex);
    c->restore_id = o->id;
    c->restore_commit_sent = 0;
    memset(c->restores, 0, (size_t)j->nranks * sizeof *c->restores);
    pthread_mutex_unlock(&c->mutex);
    if (j->sessions > 0) {
      char why[256];
      snprintf(why, sizeof why,
               "%d worker(s) attached to job '%s' on node '%s': a job is restored with no "
               "worker attached",
               j->sessions, j->name, ((zdaemon *)j->owner)->options.node_name);
      for (int r = 0; r < j->nranks; r++)
        ckpt_node_restore_report(j, j->first_rank + r, o->id, 0, 0, RPC_FAILED_PRECONDITION, why);
      return;
    }
    j->restoring = o->id;
    LOG_INFOF("restore ordered", "job=%s restore=%llu source=%s", j->name,
              (unsigned long long)o->id, o->source);
    submit(j, OP_RESTORE_READ, o->id, o->source, (int)o->format);
    return;
  }
  if (o->commit && !commit_sent && j->restoring == o->id) {
    pthread_mutex_lock(&c->mutex);
    c->restore_commit_sent = 1;
    pthread_mutex_unlock(&c->mutex);
    submit(j, OP_RESTORE_COMMIT, o->id, NULL, 0);
  }
}

int ckpt_node_restoring(job *j) {
  if (j->restoring == 0 || j->ckpt == NULL)
    return 0;
  job_ckpt *c = j->ckpt;
  pthread_mutex_lock(&c->mutex);
  int installed = c->restore_id == j->restoring && c->restore_commit_sent;
  for (int r = 0; installed && r < j->nranks; r++)
    installed = c->restores[r].committed;
  pthread_mutex_unlock(&c->mutex);
  return !installed;
}

void ckpt_node_orders(job *j, const Zerod__V1__Assignment *as) {
  if (j->ckpt == NULL)
    return;
  follow_saves(j, as);
  follow_restore(j, as);
}

/* ------------------------------------------------------------------------ */
/* Reports (loop thread)                                                    */
/* ------------------------------------------------------------------------ */

typedef struct reports {
  Zerod__V1__ShardReport *items;
  Zerod__V1__ShardReport **saves, **restores;
  char (*errors)[512];
  char (*files)[64];
} reports;

void ckpt_node_reports(job *j, Zerod__V1__JobStatus *st, void **owned) {
  *owned = NULL;
  job_ckpt *c = j->ckpt;
  if (c == NULL)
    return;
  pthread_mutex_lock(&c->mutex);
  size_t nsaves = 0;
  for (save_rec *s = c->saves; s != NULL; s = s->next)
    nsaves += s->dir != NULL ? (size_t)j->nranks : 0;
  size_t nrestores = c->restore_id != 0 ? (size_t)j->nranks : 0;
  size_t n = nsaves + nrestores;
  if (n == 0) {
    pthread_mutex_unlock(&c->mutex);
    return;
  }
  reports *r = calloc(1, sizeof *r);
  if (r != NULL) {
    r->items = calloc(n, sizeof *r->items);
    r->saves = calloc(nsaves + 1, sizeof *r->saves);
    r->restores = calloc(nrestores + 1, sizeof *r->restores);
    r->errors = calloc(n, sizeof *r->errors);
    r->files = calloc(n, sizeof *r->files);
  }
  if (r == NULL || r->items == NULL || r->saves == NULL || r->restores == NULL ||
      r->errors == NULL || r->files == NULL) {
    pthread_mutex_unlock(&c->mutex);
    ckpt_node_reports_free(r);
    return; /* reported with the next heartbeat */
  }
  size_t k = 0, ks = 0, kr = 0;
  for (save_rec *s = c->saves; s != NULL; s = s->next) {
    if (s->dir == NULL)
      continue;
    for (int i = 0; i < j->nranks; i++, k++) {
      const rank_save *rs = &s->ranks[i];
      Zerod__V1__ShardReport *it = &r->items[k];
      zerod__v1__shard_report__init(it);
      it->id = s->id;
      it->rank = (uint32_t)(j->first_rank + i);
      it->done = rs->state == SAVE_DONE || rs->state == SAVE_FAILED;
      if (rs->state == SAVE_FAILED) {
        snprintf(r->errors[k], sizeof r->errors[k], "%s", rs->error);
        ctl_text_sanitize(r->errors[k], CTL_ERROR_MAX_BYTES);
        it->error = r->errors[k];
        it->code = rs->code;
      }
      if (rs->state == SAVE_DONE) {
        snprintf(r->files[k], sizeof r->files[k], "%s", rs->file);
        it->file = r->files[k];
        it->bytes = rs->bytes;
        it->xxh64 = rs->xxh64;
      }
      it->step = rs->step;
      it->stall_ms = rs->stall_ms;
      r->saves[ks++] = it;
    }
  }
  for (int i = 0; nrestores > 0 && i < j->nranks; i++, k++) {
    const rank_restore *rr = &c->restores[i];
    Zerod__V1__ShardReport *it = &r->items[k];
    zerod__v1__shard_report__init(it);
    it->id = c->restore_id;
    it->rank = (uint32_t)(j->first_rank + i);
    it->done = rr->done;
    it->committed = rr->committed;
    it->step = rr->step;
    if (rr->code != 0) {
      snprintf(r->errors[k], sizeof r->errors[k], "%s", rr->error);
      ctl_text_sanitize(r->errors[k], CTL_ERROR_MAX_BYTES);
      it->error = r->errors[k];
      it->code = rr->code;
    }
    r->restores[kr++] = it;
  }
  pthread_mutex_unlock(&c->mutex);
  st->n_saves = ks;
  st->saves = r->saves;
  st->n_restores = kr;
  st->restores = r->restores;
  *owned = r;
}

void ckpt_node_reports_free(void *owned) {
  reports *r = owned;
  if (r == NULL)
    return;
  free(r->items);
  free(r->saves);
  free(r->restores);
  free(r->errors);
  free(r->files);
  free(r);
}

const exec_ckpt_hooks ckpt_node_hooks = {
    .stage = ckpt_node_stage,
    .staging = ckpt_node_staging,
    .saved = ckpt_node_saved,
    .save_failed = ckpt_node_save_failed,
    .restore_report = ckpt_node_restore_report,
};
