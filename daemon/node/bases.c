/* Jobs on a base, on the node (bases.h). */
#include "bases.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "base_cache.h"
#include "log.h"

int bases_link(zdaemon *d, job *j, job *b, char *err, size_t err_bytes) {
  const char *name = j->config.base;
  if (name[0] == '\0')
    return 0;
  const char *why = NULL;
  if (b == NULL || b->deleted)
    why = "it is not on this node";
  else if (!atomic_load(&b->frozen))
    why = "it is not frozen (zerodctl jobs freeze)";
  else if (b->config.base[0] != '\0')
    why = "it is itself a job on a base";
  else if (b->world_size != j->world_size || b->first_rank != j->first_rank ||
           b->nranks != j->nranks)
    why = "its ranks differ from this job's (a job on a base has the base's nodes and world)";
  else if (b->config.working_dtype != j->config.working_dtype)
    why = "its working dtype differs from this job's";
  else if (strcmp(d->options.device, "cpu") != 0)
    why = "bases are kept on host ranks only (this node runs --device cuda)";
  if (why != NULL) {
    snprintf(err, err_bytes, "base_job '%s': %s", name, why);
    return -EINVAL;
  }
  j->base = b;
  b->base_users++;
  LOG_INFOF("job on a base", "job=%s base=%s users=%d", j->name, b->name, b->base_users);
  return 0;
}

void bases_unlink(zdaemon *d, job *j) {
  if (j->base != NULL) {
    j->base->base_users--;
    j->base = NULL;
  }
  if (atomic_load(&j->frozen) && d->exec.base_cache != NULL)
    base_cache_forget(d->exec.base_cache, j->id);
}

int bases_unused(const job *j) {
  return j->base_users == 0;
}
