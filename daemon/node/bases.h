/* bases: the node's side of jobs on a base (docs/bases.md) — linking a
 * job to the frozen job it names as its base, and letting go of it.
 *
 * Threads: the loop (the registry's). */
#ifndef ZEROD_BASES_H
#define ZEROD_BASES_H

#include <stddef.h>

#include "daemon.h"

/* Links job j (its executors not started yet) to the base its config
 * names, if any, which the registry found as b (NULL: none): the base must
 * be a frozen job of this node's registry
 * with the same world, the same ranks here, the same working dtype, and
 * host ranks. 0, or -EINVAL with the reason in err. */
int bases_link(zdaemon *d, job *j, job *b, char *err, size_t err_bytes);

/* j is being freed: its base loses a user, and a base being freed drops
 * its entries from the node's base cache. */
void bases_unlink(zdaemon *d, job *j);

/* Whether job j may be freed as far as bases go: no job on it is left. */
int bases_unused(const job *j);

/* The node's base cache and each base in /metrics: zerod_base_cache_bytes
 * {kind=held|idle|budget}, zerod_base_cache_entries,
 * zerod_base_cache_lookups_total{result=hit|miss},
 * zerod_base_cache_evictions_total, and per base zerod_base_jobs and
 * zerod_base_cached_bytes. 0 or -ENOMEM. */
int bases_metrics_start(zdaemon *d);
void bases_metrics_stop(zdaemon *d);

#endif /* ZEROD_BASES_H */
