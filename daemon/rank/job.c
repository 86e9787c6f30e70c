/* Jobs: creation, the unit table and the failure state (see job.h). */
#include "job.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The locks of pin.h: each rank's lock over its working copies and shard
 * table, and the versions' mutex and condition. */
static int init_rank_locks(job *j) {
  j->rank_locks = calloc((size_t)j->nranks, sizeof *j->rank_locks);
  if (j->rank_locks == NULL)
    return -ENOMEM;
  /* Writers first: a steady stream of readers must not hold a rank's step
   * back. Readers take several rank locks only in rank order and writers
   * hold one, so preferring writers cannot deadlock. */
  pthread_rwlockattr_t rwattr;
  pthread_rwlockattr_init(&rwattr);
  pthread_rwlockattr_setkind_np(&rwattr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
  for (int r = 0; r < j->nranks; r++)
    pthread_rwlock_init(&j->rank_locks[r], &rwattr);
  pthread_rwlockattr_destroy(&rwattr);
  pthread_mutex_init(&j->pin_mutex, NULL);
  /* Waits are bounded by a monotonic deadline, immune to clock changes. */
  pthread_condattr_t cattr;
  pthread_condattr_init(&cattr);
  pthread_condattr_setclock(&cattr, CLOCK_MONOTONIC);
  pthread_cond_init(&j->pin_cond, &cattr);
  pthread_condattr_destroy(&cattr);
  atomic_init(&j->latest_version, 0);
  return 0;
}

int job_create(const struct exec_settings *exec, void *owner, const char *name,
               const char *token_sha256, const job_config *config, int world_size, int nranks,
               int first_rank, uint64_t id, job **out) {
  if (nranks < 1 || first_rank < 0 || first_rank + nranks > world_size)
    return -EINVAL;
  job *j = calloc(1, sizeof *j);
  if (j == NULL)
    return -ENOMEM;
  j->exec = exec;
  j->owner = owner;
  j->name = strdup(name);
  j->token_sha256 = strdup(token_sha256);
  j->config = *config;
  j->world_size = world_size;
  j->nranks = nranks;
  j->first_rank = first_rank;
  j->id = id;
  j->failed_generation = -1;
  j->ranks = calloc((size_t)nranks, sizeof *j->ranks);
  if (j->name == NULL || j->token_sha256 == NULL || j->ranks == NULL) {
    job_destroy(j);
    return -ENOMEM;
  }
  pthread_mutex_init(&j->mutex, NULL);
  for (int r = 0; r < nranks; r++) {
    rank_state *rs = &j->ranks[r];
    rs->job = j;
    rs->rank = first_rank + r;
    rs->lr = config->lr;
    atomic_store(&rs->loss_scale, config->loss_scale);
    rs->loss_scale_hysteresis = config->loss_scale_hysteresis;
    rs->max_grad_norm = config->max_grad_norm;
    pthread_mutex_init(&rs->queue_mutex, NULL);
    pthread_cond_init(&rs->queue_cond, NULL);
    pthread_mutex_init(&rs->comm_lock, NULL);
    comm_cancel_init(&rs->build_cancel);
  }
  if (init_rank_locks(j) != 0) {
    job_destroy(j);
    return -ENOMEM;
  }
  *out = j;
  return 0;
}

void job_destroy(job *j) {
  if (j == NULL)
    return;
  free(j->read_token_sha256);
  if (j->ranks != NULL) {
    for (int r = 0; r < j->nranks; r++) {
      pthread_mutex_destroy(&j->ranks[r].queue_mutex);
      pthread_cond_destroy(&j->ranks[r].queue_cond);
      pthread_mutex_destroy(&j->ranks[r].comm_lock);
      comm_cancel_destroy(&j->ranks[r].build_cancel);
    }
    pthread_mutex_destroy(&j->mutex);
  }
  if (j->rank_locks != NULL) {
    for (int r = 0; r < j->nranks; r++)
      pthread_rwlock_destroy(&j->rank_locks[r]);
    free(j->rank_locks);
    pthread_mutex_destroy(&j->pin_mutex);
    pthread_cond_destroy(&j->pin_cond);
  }
  for (uint32_t u = 0; u < j->nunits; u++)
    unit_layout_free(j->units[u]);
  comm_local_group_unref(j->local_group);
  free(j->units);
  free(j->ranks);
  free(j->name);
  free(j->token_sha256);
  free(j);
}

comm_local_group *job_local_group(job *j, unsigned generation) {
  pthread_mutex_lock(&j->mutex);
  if (j->local_group == NULL || j->local_generation != generation) {
    comm_local_group *g = NULL;
    if (comm_local_group_create(j->nranks, &g) != 0) {
      pthread_mutex_unlock(&j->mutex);
      return NULL;
    }
    comm_local_group_unref(j->local_group);
    j->local_group = g;
    j->local_generation = generation;
  }
  comm_local_group *g = j->local_group;
  comm_local_group_ref(g);
  pthread_mutex_unlock(&j->mutex);
  return g;
}

/* ------------------------------------------------------------------------ */
/* Failure state and the unit table                                         */
/* ------------------------------------------------------------------------ */

void job_fail(job *j, unsigned generation, const char *fmt, ...) {
  pthread_mutex_lock(&j->mutex);
  if (j->failed_generation != (long)generation) {
    j->failed_generation = (long)generation;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->fail_reason, sizeof j->fail_reason, fmt, ap);
    va_end(ap);
  }
  pthread_mutex_unlock(&j->mutex);
  /* Readers waiting for a rank of a failed job would wait in vain (pin.h). */
  pthread_mutex_lock(&j->pin_mutex);
  pthread_cond_broadcast(&j->pin_cond);
  pthread_mutex_unlock(&j->pin_mutex);
}

int job_failed(job *j, unsigned generation, char *reason, size_t reason_bytes) {
  pthread_mutex_lock(&j->mutex);
  int failed = j->failed_generation == (long)generation;
  if (failed && reason != NULL)
    snprintf(reason, reason_bytes, "%s", j->fail_reason);
  pthread_mutex_unlock(&j->mutex);
  return failed;
}

unit_layout *job_unit_named(job *j, const char *name) {
  unit_layout *found = NULL;
  pthread_mutex_lock(&j->mutex);
  for (uint32_t u = 0; u < j->nunits && found == NULL; u++) {
    if (strcmp(j->units[u]->name, name) == 0)
      found = j->units[u];
  }
  pthread_mutex_unlock(&j->mutex);
  return found;
}

unit_layout *job_publish_unit(job *j, unit_layout *layout, int *existed, int *conflict) {
  *existed = 0;
  *conflict = 0;
  unit_layout *result = NULL;
  pthread_mutex_lock(&j->mutex);
  for (uint32_t u = 0; u < j->nunits; u++) {
    unit_layout *have = j->units[u];
    if (strcmp(have->name, layout->name) != 0)
      continue;
    /* The init tag (chunk 0) may differ on a re-registration: the state is
     * kept, so how it was first initialised no longer matters. Compare the
     * tensor chunks only. */
    int same = have->ntensors == layout->ntensors && have->numel == layout->numel;
    for (unsigned t = 0; same && t < have->ntensors; t++) {
      const tensor_layout *a = &have->tensors[t], *b = &layout->tensors[t];
      same = strcmp(a->name, b->name) == 0 && a->ndim == b->ndim && a->frozen == b->frozen &&
             memcmp(a->shape, b->shape, sizeof a->shape[0] * a->ndim) == 0;
    }
    if (same) {
      *existed = 1;
      result = have;
    } else {
      *conflict = 1;
    }
    pthread_mutex_unlock(&j->mutex);
    if (result != NULL)
      unit_layout_free(layout);
    return result;
  }
  if (j->nunits == j->units_cap) {
    uint32_t cap = j->units_cap ? j->units_cap * 2 : 16;
    unit_layout **grown = cap <= JOB_MAX_UNITS ? realloc(j->units, cap * sizeof *grown) : NULL;
    if (grown == NULL) {
      pthread_mutex_unlock(&j->mutex);
      return NULL;
    }
    j->units = grown;
    j->units_cap = cap;
  }
  layout->id = j->nunits;
  j->units[j->nunits++] = layout;
  pthread_mutex_unlock(&j->mutex);
  return layout;
}

unit_layout *job_unit(job *j, uint32_t unit_id) {
  pthread_mutex_lock(&j->mutex);
  unit_layout *l = unit_id < j->nunits ? j->units[unit_id] : NULL;
  pthread_mutex_unlock(&j->mutex);
  return l;
}

unit_layout **job_units_copy(job *j, uint32_t *n) {
  pthread_mutex_lock(&j->mutex);
  uint32_t nunits = j->nunits;
  unit_layout **units = malloc((nunits ? nunits : 1) * sizeof *units);
  if (units != NULL && nunits > 0)
    memcpy(units, j->units, nunits * sizeof *units);
  pthread_mutex_unlock(&j->mutex);
  *n = nunits;
  return units;
}
