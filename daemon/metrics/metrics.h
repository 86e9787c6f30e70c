/* metrics: a daemon's Prometheus metrics (docs/operations.md, "Metrics"),
 * rendered in the text exposition format (version 0.0.4).
 *
 * A registry holds families (a name, its help, its type, its label names)
 * and each family its series (one value per set of label values). Any
 * thread may update a series: its values are atomics, and an update takes
 * no lock. Families and series are made, looked up and dropped under the
 * registry's mutex, which rendering holds too, so a series dropped by its
 * owner (a job going away) vanishes from the next scrape and never from
 * the middle of one.
 *
 * Values that some thread owns and that are cheap to read there (a job's
 * sessions on the loop, the coordinator's members by state) are set by
 * collectors: functions the renderer's owner runs before each render on
 * the thread that owns them (metrics_http.c runs them on the loop).
 *
 * Every function takes NULL for a registry, family or series and does
 * nothing, so that code with metrics off (tests, tools) calls them as is. */
#ifndef ZEROD_METRICS_H
#define ZEROD_METRICS_H

#include <stddef.h>
#include <stdint.h>

#define METRICS_MAX_LABELS  4
#define METRICS_MAX_BUCKETS 24

typedef struct metrics metrics;
typedef struct metric_family metric_family;
typedef struct metric_series metric_series;

typedef enum metric_type { METRIC_COUNTER, METRIC_GAUGE, METRIC_HISTOGRAM } metric_type;

/* Latency buckets in seconds, from 50 µs to 60 s: the defaults for every
 * duration histogram of the daemon. */
extern const double metrics_latency_buckets[];
extern const size_t metrics_nlatency_buckets;

metrics *metrics_create(void);
/* Frees the registry, its families and any series still held. */
void metrics_free(metrics *m);

/* The family named name, made on first use (later calls with the same
 * name return it; type, labels and buckets must then agree, else NULL).
 * labels: NULL-terminated, at most METRICS_MAX_LABELS; buckets: the upper
 * bounds of a histogram, increasing (NULL for the latency defaults),
 * at most METRICS_MAX_BUCKETS. NULL if out of memory or misused. */
metric_family *metrics_family(metrics *m, metric_type type, const char *name, const char *help,
                              const char *const *labels, const double *buckets, size_t nbuckets);

/* A reference to the series of f with these label values (one per label
 * name, in order; NULL for a family without labels), made at zero if new.
 * Hold it while updating; metric_series_put drops the reference, and the
 * series leaves the registry with its last one. NULL if out of memory. */
metric_series *metric_series_get(metric_family *f, const char *const *values);
void metric_series_put(metric_series *s);

/* The series of f with these label values, made if new and then kept by
 * the registry, as long as it lives (for label values from a small fixed
 * set: a method and a status code, a state): no reference to put. Takes
 * the registry's mutex: for code that is not on a hot path, or caches it.
 * NULL if out of memory. */
metric_series *metric_family_kept(metric_family *f, const char *const *values);

/* A counter's or gauge's value grows by v (a counter's v >= 0). */
void metric_add(metric_series *s, double v);
/* A gauge's value becomes v. */
void metric_set(metric_series *s, double v);
/* A histogram counts one observation of v. */
void metric_observe(metric_series *s, double v);
/* The current value of a counter or gauge, or a histogram's count. */
double metric_value(const metric_series *s);

/* Collectors: fn(arg) runs on every metrics_collect, in the order added. */
int metrics_add_collector(metrics *m, void (*fn)(void *arg), void *arg);
void metrics_remove_collector(metrics *m, void (*fn)(void *arg), void *arg);
void metrics_collect(metrics *m);

/* The exposition of every family, in the order they were made: a
 * NUL-terminated malloc'd text in *text, its length in *len. 0 or -ENOMEM. */
int metrics_render(metrics *m, char **text, size_t *len);

#endif /* ZEROD_METRICS_H */
