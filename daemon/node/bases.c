/* Jobs on a base, on the node (bases.h). */
#include "bases.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "base_cache.h"
#include "metrics.h"
#include "rank_metrics.h"
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

/* ---- Metrics ------------------------------------------------------------------ */

/* The cache's counts are cumulative: the counters grow by what they grew
 * since the last scrape. */
static void collect(void *arg) {
  zdaemon *d = arg;
  base_cache_stats st;
  base_cache_stats_get(d->exec.base_cache, &st);
  struct base_cache_series *m = &d->m_base_cache;
  metric_set(m->held, (double)st.held_bytes);
  metric_set(m->idle, (double)(st.bytes - st.held_bytes));
  metric_set(m->budget, (double)st.budget);
  metric_set(m->entries, (double)st.entries);
  metric_add(m->hits, (double)(st.hits - m->seen_hits));
  metric_add(m->misses, (double)(st.misses - m->seen_misses));
  metric_add(m->evictions, (double)(st.evictions - m->seen_evictions));
  m->seen_hits = st.hits;
  m->seen_misses = st.misses;
  m->seen_evictions = st.evictions;
  for (job *j = d->jobs; j != NULL; j = j->next) {
    if (!atomic_load(&j->frozen))
      continue;
    base_cache_stats of_base;
    base_cache_base_stats(d->exec.base_cache, j->id, &of_base);
    rank_metrics_base(j, d->metrics, j->base_users, &of_base);
  }
}

int bases_metrics_start(zdaemon *d) {
  if (d->metrics == NULL)
    return 0;
  static const char *const kind[] = {"kind", NULL}, *const result[] = {"result", NULL};
  metric_family *bytes = metrics_family(
      d->metrics, METRIC_GAUGE, "zerod_base_cache_bytes",
      "The node's base cache: bytes of entries jobs hold, of entries kept for none (idle), and "
      "the budget of idle ones (--base-cache-bytes).",
      kind, NULL, 0);
  metric_family *lookups = metrics_family(
      d->metrics, METRIC_COUNTER, "zerod_base_cache_lookups_total",
      "Gathers of a base's unit that asked the node's base cache: found (hit) or not (miss).",
      result, NULL, 0);
  const char *const held[] = {"held", NULL}, *const idle[] = {"idle", NULL},
                    *const budget[] = {"budget", NULL}, *const hit[] = {"hit", NULL},
                    *const miss[] = {"miss", NULL};
  d->m_base_cache.held = metric_family_kept(bytes, held);
  d->m_base_cache.idle = metric_family_kept(bytes, idle);
  d->m_base_cache.budget = metric_family_kept(bytes, budget);
  d->m_base_cache.hits = metric_family_kept(lookups, hit);
  d->m_base_cache.misses = metric_family_kept(lookups, miss);
  d->m_base_cache.entries = metric_family_kept(
      metrics_family(d->metrics, METRIC_GAUGE, "zerod_base_cache_entries",
                     "Gathered base units in the node's base cache.", NULL, NULL, 0),
      NULL);
  d->m_base_cache.evictions = metric_family_kept(
      metrics_family(d->metrics, METRIC_COUNTER, "zerod_base_cache_evictions_total",
                     "Idle entries the node's base cache let go to stay within its budget.", NULL,
                     NULL, 0),
      NULL);
  return metrics_add_collector(d->metrics, collect, d);
}

void bases_metrics_stop(zdaemon *d) {
  if (d->metrics != NULL)
    metrics_remove_collector(d->metrics, collect, d);
}
