/* A node's checkpoints, on the loop thread: the orders of the job's
 * assignment followed (saves get their directory and the ranks are told,
 * restores are read and committed), the progress reported in heartbeats,
 * and each job's checkpoint state made and freed (see ckpt_node.h). What
 * runs on the ranks' executors and the shard writers is ckpt_writer.c. */
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

#include "crashpoint.h"
#include "ctl_decode.h"
#include "daemon.h"
#include "exec.h"
#include "hostmem.h"
#include "log.h"
#include "replica.h"
#include "rpc.h"

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
  pthread_mutex_init(&c->fetch_mutex, NULL);
  j->ckpt = c;
  return 0;
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
    ckpt_node__save_unref(j, s);
  }
  pthread_mutex_unlock(&c->mutex);
  pthread_mutex_destroy(&c->mutex);
  pthread_cond_destroy(&c->cond);
  ckpt_node__mem_holders_free(c);
  pthread_mutex_destroy(&c->fetch_mutex);
  free(c->restores);
  free(c);
  j->ckpt = NULL;
}

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
    save_rec *s = ckpt_node__save_get(j, o->id);
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
    ckpt_node__save_unref(j, s);
  }
  pthread_mutex_unlock(&c->mutex);
}

static void follow_restore(job *j, const Zerod__V1__Assignment *as) {
  job_ckpt *c = j->ckpt;
  const Zerod__V1__RestoreOrder *o = as != NULL ? as->restore : NULL;
  if (o != NULL && (o->id == 0 || o->source == NULL || (o->source[0] != '/' && !o->memory)))
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
    /* Workers waiting in a restore they asked for are as good as gone:
     * they hold nothing (OP_CKPT_PARK let go of it) and send nothing. */
    if (j->sessions > atomic_load(&j->ckpt_restore_parked)) {
      char why[256];
      snprintf(why, sizeof why,
               "%d worker(s) attached to job '%s' on node '%s': a job is restored with no "
               "worker attached (or with every worker waiting in a restore it asked for)",
               j->sessions, j->name, ((zdaemon *)j->owner)->options.node_name);
      for (int r = 0; r < j->nranks; r++)
        ckpt_node_restore_report(j, j->first_rank + r, o->id, 0, 0, RPC_FAILED_PRECONDITION, why);
      return;
    }
    char source[PATH_MAX], why[PATH_MAX + 64];
    snprintf(source, sizeof source, "%s", o->source);
    if (o->memory &&
        ckpt_node__mem_restore_prepare(j, o, source, sizeof source, why, sizeof why) != 0) {
      LOG_WARNF("restore from the in-memory copies not started", "job=%s restore=%llu err=\"%s\"",
                j->name, (unsigned long long)o->id, why);
      for (int r = 0; r < j->nranks; r++)
        ckpt_node_restore_report(j, j->first_rank + r, o->id, 0, 0, RPC_INTERNAL, why);
      return;
    }
    j->restoring = o->id;
    LOG_INFOF("restore ordered", "job=%s restore=%llu source=%s", j->name,
              (unsigned long long)o->id, source);
    submit(j, OP_RESTORE_READ, o->id, source, (int)o->format);
    return;
  }
  if (o->commit && !commit_sent && j->restoring == o->id) {
    pthread_mutex_lock(&c->mutex);
    c->restore_commit_sent = 1;
    pthread_mutex_unlock(&c->mutex);
    submit(j, OP_RESTORE_COMMIT, o->id, NULL, 0);
    /* Restored, by whoever asked: what this node lost comes back now, and
     * workers attach once it is installed (ckpt_node_restoring). */
    j->awaiting_recovery = 0;
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
