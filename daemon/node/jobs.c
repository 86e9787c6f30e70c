/* The node's jobs: the registry the loop keeps in the daemon (d->jobs),
 * and each job's life from its creation to its free (see jobs.h). */
#include "jobs.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_node.h"
#include "daemon.h"
#include "digest.h"
#include "bases.h"
#include "exec.h"
#include "log.h"
#include "pin.h"
#include "rank_metrics.h"
#include "tier.h"

job *jobs_find(zdaemon *d, const char *name) {
  job *deleted = NULL;
  for (job *j = d->jobs; j != NULL; j = j->next) {
    if (strcmp(j->name, name) != 0)
      continue;
    if (!j->deleted)
      return j;
    deleted = j;
  }
  return deleted;
}

/* Nobody is attached to a failed job any more: build fresh communicators
 * (a new generation) so new workers can resume from the kept state. */
void jobs_reset(job *j) {
  j->generation++;
  LOG_INFOF("job reset", "job=%s generation=%u", j->name, j->generation);
  for (int r = 0; r < j->nranks; r++) {
    exec_op *init = exec_op_new(OP_COMM_INIT, &j->ranks[r]);
    if (init != NULL) {
      init->generation = j->generation;
      exec_submit(init);
    }
  }
}

int jobs_set_read_tokens(job *j, char *const *hashes, size_t n) {
  char(*copy)[DIGEST_HEX_BYTES] = NULL;
  size_t kept = 0;
  if (n > 0) {
    copy = calloc(n, sizeof *copy);
    if (copy == NULL)
      return -ENOMEM;
    for (size_t i = 0; i < n; i++)
      if (digest_is_hex(hashes[i]))
        memcpy(copy[kept++], hashes[i], DIGEST_HEX_BYTES);
  }
  free(j->read_token_sha256);
  j->read_token_sha256 = copy;
  j->n_read_tokens = kept;
  return 0;
}

int jobs_start(zdaemon *d, const char *name, const char *token_sha256, const job_config *config,
               int world_size, int nranks, int first_rank, uint64_t id, unsigned generation,
               job **out, char *err, size_t err_bytes) {
  job *j;
  int rc = tier_check(config, d->exec.nvme_dir, err, err_bytes);
  if (rc != 0)
    return rc;
  rc = job_create(&d->exec, d, name, token_sha256, config, world_size, nranks, first_rank, id, &j);
  if (rc == 0 && (rc = bases_link(d, j, config->base[0] ? jobs_find(d, config->base) : NULL, err,
                                  err_bytes)) != 0) {
    jobs_free(j);
    return rc;
  }
  if (rc == 0 && (rc = ckpt_node_job_init(j)) != 0)
    jobs_free(j);
  if (rc == 0)
    rank_metrics_open(j, d->metrics, strcmp(d->options.device, "cuda") == 0 ? "device" : "host");
  if (rc != 0) {
    snprintf(err, err_bytes, "%s", rc == -ENOMEM ? "out of memory" : "ranks do not fit the world");
    return rc;
  }
  j->generation = generation;
  j->built_epoch = generation;
  for (int r = 0; r < j->nranks; r++) {
    rc = exec_rank_start(&j->ranks[r]);
    if (rc != 0) {
      for (int k = 0; k < r; k++)
        exec_rank_stop(&j->ranks[k]);
      for (int k = 0; k < r; k++)
        exec_rank_join(&j->ranks[k]);
      jobs_free(j);
      snprintf(err, err_bytes, "cannot start the executors: %s", strerror(-rc));
      return rc;
    }
  }
  for (int r = 0; r < j->nranks; r++) {
    exec_op *init = exec_op_new(OP_COMM_INIT, &j->ranks[r]);
    if (init == NULL) {
      job_fail(j, generation, "out of memory");
      continue;
    }
    init->generation = generation;
    exec_submit(init);
  }
  j->next = d->jobs;
  d->jobs = j;
  LOG_INFOF("job created",
            "job=%s id=%llu world_size=%d ranks=%d..%d optimizer=%s lr=%g working_dtype=%s "
            "max_live_bytes=%llu max_grad_norm=%g",
            j->name, (unsigned long long)j->id, j->world_size, j->first_rank,
            j->first_rank + j->nranks - 1, job_optimizer_name(config->optimizer), config->lr,
            zk_dtype_name(config->working_dtype), (unsigned long long)config->max_live_bytes,
            config->max_grad_norm);
  *out = j;
  return 0;
}

void jobs_retire(zdaemon *d, job *j) {
  for (job **p = &d->jobs; *p != NULL; p = &(*p)->next) {
    if (*p != j)
      continue;
    *p = j->next;
    j->next = d->retired;
    d->retired = j;
    pin_job_stop(j);
    for (int r = 0; r < j->nranks; r++)
      exec_rank_stop(&j->ranks[r]);
    LOG_INFOF("job removed", "job=%s id=%llu", j->name, (unsigned long long)j->id);
    return;
  }
}

/* Whether nothing runs for retired job j any more: every executor has
 * exited (its join returns at once), no reader holds it and no workers'
 * checkpoint call (ckpt_call.c, whose finished records the loop swept
 * before). */
static int reapable(job *j) {
  if (j->readers > 0 || j->worker_calls > 0 || !bases_unused(j))
    return 0;
  for (int r = 0; r < j->nranks; r++)
    if (j->ranks[r].thread_started && !atomic_load(&j->ranks[r].stopped))
      return 0;
  return 1;
}

void jobs_reap(zdaemon *d) {
  if (d->stopping)
    return;
  for (job **p = &d->retired; *p != NULL;) {
    job *j = *p;
    if (!reapable(j)) {
      p = &j->next;
      continue;
    }
    *p = j->next;
    for (int r = 0; r < j->nranks; r++)
      exec_rank_join(&j->ranks[r]);
    /* Logged once it is true: its kernel threads joined, its memory back. */
    char name[128];
    snprintf(name, sizeof name, "%s", j->name);
    unsigned long long id = (unsigned long long)j->id;
    jobs_free(j);
    LOG_INFOF("job freed", "job=%s id=%llu", name, id);
  }
}

void jobs_free(job *j) {
  if (j == NULL)
    return;
  ckpt_node_job_free(j); /* waits for its shard writers */
  rank_metrics_close(j);
  if (j->ranks != NULL)
    for (int r = 0; r < j->nranks; r++)
      exec_rank_free(&j->ranks[r]);
  pin_job_clear(j);
  bases_unlink(j->owner, j);
  job_destroy(j);
}

void jobs_stop_all(zdaemon *d) {
  for (job *j = d->jobs; j != NULL; j = j->next)
    pin_job_stop(j);
  for (job *j = d->jobs; j != NULL; j = j->next)
    for (int r = 0; r < j->nranks; r++)
      exec_rank_stop(&j->ranks[r]);
  for (job *j = d->jobs; j != NULL; j = j->next)
    for (int r = 0; r < j->nranks; r++)
      exec_rank_join(&j->ranks[r]);
  for (job *j = d->retired; j != NULL; j = j->next) /* stopped when retired */
    for (int r = 0; r < j->nranks; r++)
      exec_rank_join(&j->ranks[r]);
}

void jobs_free_all(zdaemon *d) {
  while (d->jobs != NULL) {
    job *j = d->jobs;
    d->jobs = j->next;
    jobs_free(j);
  }
  while (d->retired != NULL) {
    job *j = d->retired;
    d->retired = j->next;
    jobs_free(j);
  }
}

/* ---- Metrics ------------------------------------------------------------------ */

static void collect(void *arg) {
  zdaemon *d = arg;
  int active = 0, retired = 0;
  for (job *j = d->jobs; j != NULL; j = j->next, active++)
    rank_metrics_loop(j);
  for (job *j = d->retired; j != NULL; j = j->next, retired++)
    rank_metrics_loop(j);
  metric_set(d->m_jobs_active, active);
  metric_set(d->m_jobs_retired, retired);
  metric_set(d->m_sessions, d->nsessions);
}

int jobs_metrics_start(zdaemon *d) {
  if (d->metrics == NULL)
    return 0;
  static const char *const state[] = {"state", NULL};
  metric_family *jobs = metrics_family(
      d->metrics, METRIC_GAUGE, "zerod_node_jobs",
      "Jobs on this node: active, or retired (deleted, their executors stopping).", state, NULL, 0);
  const char *const active[] = {"active", NULL}, *const retired[] = {"retired", NULL};
  d->m_jobs_active = metric_family_kept(jobs, active);
  d->m_jobs_retired = metric_family_kept(jobs, retired);
  d->m_sessions = metric_series_get(
      metrics_family(d->metrics, METRIC_GAUGE, "zerod_node_sessions",
                     "Worker connections to this node's socket (read-write and read-only).", NULL,
                     NULL, 0),
      NULL);
  return metrics_add_collector(d->metrics, collect, d);
}

void jobs_metrics_stop(zdaemon *d) {
  metrics_remove_collector(d->metrics, collect, d);
  metric_series_put(d->m_sessions);
  d->m_sessions = NULL;
}
