/* The metrics registry and its text exposition (metrics.h). */
#include "metrics.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const double metrics_latency_buckets[] = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                          0.01,    0.025,  0.05,    0.1,    0.25,  0.5,    1,
                                          2.5,     5,      10,      30,     60};
const size_t metrics_nlatency_buckets =
    sizeof metrics_latency_buckets / sizeof metrics_latency_buckets[0];

/* A double kept in an atomic word: added to by compare-and-swap. */
typedef _Atomic uint64_t atomic_double;

static double ad_load(const atomic_double *a) {
  uint64_t bits = atomic_load_explicit(a, memory_order_relaxed);
  double v;
  memcpy(&v, &bits, sizeof v);
  return v;
}

static void ad_store(atomic_double *a, double v) {
  uint64_t bits;
  memcpy(&bits, &v, sizeof bits);
  atomic_store_explicit(a, bits, memory_order_relaxed);
}

static void ad_add(atomic_double *a, double v) {
  uint64_t old = atomic_load_explicit(a, memory_order_relaxed), next;
  do {
    double d;
    memcpy(&d, &old, sizeof d);
    d += v;
    memcpy(&next, &d, sizeof next);
  } while (!atomic_compare_exchange_weak_explicit(a, &old, next, memory_order_relaxed,
                                                  memory_order_relaxed));
}

struct metric_series {
  struct metric_series *next;
  metric_family *family;
  int refs; /* under the registry's mutex */
  int kept; /* the registry holds a reference of its own */
  char *values[METRICS_MAX_LABELS];
  atomic_double value; /* counter, gauge; a histogram's sum */
  _Atomic uint64_t count;
  _Atomic uint64_t buckets[METRICS_MAX_BUCKETS]; /* per bucket, not cumulative */
};

struct metric_family {
  struct metric_family *next;
  metrics *registry;
  metric_type type;
  char *name, *help;
  char *labels[METRICS_MAX_LABELS];
  size_t nlabels;
  double bounds[METRICS_MAX_BUCKETS];
  size_t nbounds;
  metric_series *series;
};

typedef struct collector {
  struct collector *next;
  void (*fn)(void *arg);
  void *arg;
} collector;

struct metrics {
  pthread_mutex_t mutex; /* families and series */
  metric_family *families, *last;
  pthread_mutex_t collect_mutex; /* collectors; held while they run */
  collector *collectors;
};

metrics *metrics_create(void) {
  metrics *m = calloc(1, sizeof *m);
  if (m == NULL)
    return NULL;
  pthread_mutex_init(&m->mutex, NULL);
  pthread_mutex_init(&m->collect_mutex, NULL);
  return m;
}

static void series_free(metric_series *s) {
  for (size_t i = 0; i < METRICS_MAX_LABELS; i++)
    free(s->values[i]);
  free(s);
}

static void family_free(metric_family *f) {
  while (f->series != NULL) {
    metric_series *s = f->series;
    f->series = s->next;
    series_free(s);
  }
  free(f->name);
  free(f->help);
  for (size_t i = 0; i < f->nlabels; i++)
    free(f->labels[i]);
  free(f);
}

void metrics_free(metrics *m) {
  if (m == NULL)
    return;
  while (m->families != NULL) {
    metric_family *f = m->families;
    m->families = f->next;
    family_free(f);
  }
  while (m->collectors != NULL) {
    collector *c = m->collectors;
    m->collectors = c->next;
    free(c);
  }
  pthread_mutex_destroy(&m->mutex);
  pthread_mutex_destroy(&m->collect_mutex);
  free(m);
}

static size_t count_labels(const char *const *labels) {
  size_t n = 0;
  while (labels != NULL && labels[n] != NULL)
    n++;
  return n;
}

/* Whether an existing family is the one asked for again. */
static int family_matches(const metric_family *f, metric_type type, const char *const *labels,
                          const double *bounds, size_t nbounds) {
  if (f->type != type || f->nlabels != count_labels(labels))
    return 0;
  for (size_t i = 0; i < f->nlabels; i++)
    if (strcmp(f->labels[i], labels[i]) != 0)
      return 0;
  if (type != METRIC_HISTOGRAM)
    return 1;
  if (f->nbounds != nbounds)
    return 0;
  for (size_t i = 0; i < nbounds; i++)
    if (f->bounds[i] != bounds[i])
      return 0;
  return 1;
}

static metric_family *family_new(metrics *m, metric_type type, const char *name, const char *help,
                                 const char *const *labels, const double *bounds, size_t nbounds) {
  size_t nlabels = count_labels(labels);
  if (nlabels > METRICS_MAX_LABELS || nbounds > METRICS_MAX_BUCKETS)
    return NULL;
  for (size_t i = 1; i < nbounds; i++)
    if (!(bounds[i] > bounds[i - 1]))
      return NULL;
  metric_family *f = calloc(1, sizeof *f);
  if (f == NULL)
    return NULL;
  f->registry = m;
  f->type = type;
  f->name = strdup(name);
  f->help = strdup(help != NULL ? help : "");
  int ok = f->name != NULL && f->help != NULL;
  for (size_t i = 0; i < nlabels; i++) {
    f->labels[i] = strdup(labels[i]);
    ok = ok && f->labels[i] != NULL;
  }
  f->nlabels = nlabels;
  if (type == METRIC_HISTOGRAM) {
    memcpy(f->bounds, bounds, nbounds * sizeof *bounds);
    f->nbounds = nbounds;
  }
  if (!ok) {
    family_free(f);
    return NULL;
  }
  return f;
}

metric_family *metrics_family(metrics *m, metric_type type, const char *name, const char *help,
                              const char *const *labels, const double *buckets, size_t nbuckets) {
  if (m == NULL || name == NULL)
    return NULL;
  if (type == METRIC_HISTOGRAM && buckets == NULL) {
    buckets = metrics_latency_buckets;
    nbuckets = metrics_nlatency_buckets;
  }
  pthread_mutex_lock(&m->mutex);
  metric_family *f = m->families;
  while (f != NULL && strcmp(f->name, name) != 0)
    f = f->next;
  if (f != NULL) {
    if (!family_matches(f, type, labels, buckets, nbuckets))
      f = NULL;
  } else if ((f = family_new(m, type, name, help, labels, buckets, nbuckets)) != NULL) {
    if (m->last != NULL)
      m->last->next = f;
    else
      m->families = f;
    m->last = f;
  }
  pthread_mutex_unlock(&m->mutex);
  return f;
}

static int series_is(const metric_series *s, const char *const *values, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(s->values[i], values[i]) != 0)
      return 0;
  return 1;
}

/* Under the registry's mutex: the series of f with these values, made if
 * new (with no reference), or NULL. */
static metric_series *series_find(metric_family *f, const char *const *values) {
  for (size_t i = 0; i < f->nlabels; i++)
    if (values == NULL || values[i] == NULL)
      return NULL;
  metric_series *s = f->series;
  while (s != NULL && !series_is(s, values, f->nlabels))
    s = s->next;
  if (s == NULL && (s = calloc(1, sizeof *s)) != NULL) {
    s->family = f;
    int ok = 1;
    for (size_t i = 0; i < f->nlabels; i++)
      ok = ok && (s->values[i] = strdup(values[i])) != NULL;
    if (!ok) {
      series_free(s);
      s = NULL;
    } else {
      /* Kept in the order made, so that a scrape lists ranks in order. */
      metric_series **tail = &f->series;
      while (*tail != NULL)
        tail = &(*tail)->next;
      *tail = s;
    }
  }
  return s;
}

metric_series *metric_series_get(metric_family *f, const char *const *values) {
  if (f == NULL)
    return NULL;
  pthread_mutex_lock(&f->registry->mutex);
  metric_series *s = series_find(f, values);
  if (s != NULL)
    s->refs++;
  pthread_mutex_unlock(&f->registry->mutex);
  return s;
}

metric_series *metric_family_kept(metric_family *f, const char *const *values) {
  if (f == NULL)
    return NULL;
  pthread_mutex_lock(&f->registry->mutex);
  metric_series *s = series_find(f, values);
  if (s != NULL && !s->kept) {
    s->kept = 1;
    s->refs++;
  }
  pthread_mutex_unlock(&f->registry->mutex);
  return s;
}

void metric_series_put(metric_series *s) {
  if (s == NULL)
    return;
  metric_family *f = s->family;
  pthread_mutex_lock(&f->registry->mutex);
  if (--s->refs == 0) {
    metric_series **at = &f->series;
    while (*at != s)
      at = &(*at)->next;
    *at = s->next;
    series_free(s);
  }
  pthread_mutex_unlock(&f->registry->mutex);
}

void metric_add(metric_series *s, double v) {
  if (s != NULL)
    ad_add(&s->value, v);
}

void metric_set(metric_series *s, double v) {
  if (s != NULL)
    ad_store(&s->value, v);
}

void metric_observe(metric_series *s, double v) {
  if (s == NULL)
    return;
  const metric_family *f = s->family;
  size_t i = 0;
  while (i < f->nbounds && v > f->bounds[i])
    i++;
  if (i < f->nbounds)
    atomic_fetch_add_explicit(&s->buckets[i], 1, memory_order_relaxed);
  ad_add(&s->value, v);
  atomic_fetch_add_explicit(&s->count, 1, memory_order_relaxed);
}

double metric_value(const metric_series *s) {
  if (s == NULL)
    return 0;
  if (s->family->type == METRIC_HISTOGRAM)
    return (double)atomic_load_explicit(&s->count, memory_order_relaxed);
  return ad_load(&s->value);
}

int metrics_add_collector(metrics *m, void (*fn)(void *arg), void *arg) {
  if (m == NULL)
    return 0;
  collector *c = calloc(1, sizeof *c);
  if (c == NULL)
    return -ENOMEM;
  c->fn = fn;
  c->arg = arg;
  pthread_mutex_lock(&m->collect_mutex);
  collector **tail = &m->collectors;
  while (*tail != NULL)
    tail = &(*tail)->next;
  *tail = c;
  pthread_mutex_unlock(&m->collect_mutex);
  return 0;
}

void metrics_remove_collector(metrics *m, void (*fn)(void *arg), void *arg) {
  if (m == NULL)
    return;
  pthread_mutex_lock(&m->collect_mutex);
  for (collector **at = &m->collectors; *at != NULL; at = &(*at)->next)
    if ((*at)->fn == fn && (*at)->arg == arg) {
      collector *c = *at;
      *at = c->next;
      free(c);
      break;
    }
  pthread_mutex_unlock(&m->collect_mutex);
}

void metrics_collect(metrics *m) {
  if (m == NULL)
    return;
  pthread_mutex_lock(&m->collect_mutex);
  for (collector *c = m->collectors; c != NULL; c = c->next)
    c->fn(c->arg);
  pthread_mutex_unlock(&m->collect_mutex);
}

/* ---- Exposition ------------------------------------------------------------ */

/* A sample value as Prometheus reads it: integers whole, others in the
 * shortest form that reads back the same, and NaN, +Inf, -Inf. */
static void put_value(FILE *out, double v) {
  if (isnan(v)) {
    fputs("NaN", out);
  } else if (isinf(v)) {
    fputs(v > 0 ? "+Inf" : "-Inf", out);
  } else if (v == floor(v) && fabs(v) < 1e15) {
    fprintf(out, "%.0f", v);
  } else {
    char buf[40];
    for (int precision = 6; precision <= 17; precision++) {
      snprintf(buf, sizeof buf, "%.*g", precision, v);
      if (strtod(buf, NULL) == v)
        break;
    }
    fputs(buf, out);
  }
}

/* A label value or a help text, escaped: backslash and newline always, the
 * double quote in label values only (the format's rules). */
static void put_escaped(FILE *out, const char *s, int quote) {
  for (; *s != '\0'; s++) {
    if (*s == '\\')
      fputs("\\\\", out);
    else if (*s == '\n')
      fputs("\\n", out);
    else if (*s == '"' && quote)
      fputs("\\\"", out);
    else
      fputc(*s, out);
  }
}

/* name{labels,extra} value: extra is one more label (a bucket's le), or
 * NULL. */
static void put_sample(FILE *out, const metric_family *f, const metric_series *s,
                       const char *suffix, const char *extra_name, double extra, double v) {
  fputs(f->name, out);
  fputs(suffix, out);
  if (f->nlabels > 0 || extra_name != NULL) {
    fputc('{', out);
    for (size_t i = 0; i < f->nlabels; i++) {
      fprintf(out, "%s%s=\"", i > 0 ? "," : "", f->labels[i]);
      put_escaped(out, s->values[i], 1);
      fputc('"', out);
    }
    if (extra_name != NULL) {
      fprintf(out, "%s%s=\"", f->nlabels > 0 ? "," : "", extra_name);
      put_value(out, extra);
      fputc('"', out);
    }
    fputc('}', out);
  }
  fputc(' ', out);
  put_value(out, v);
  fputc('\n', out);
}

static const char *type_name(metric_type t) {
  switch (t) {
  case METRIC_COUNTER:
    return "counter";
  case METRIC_GAUGE:
    return "gauge";
  case METRIC_HISTOGRAM:
    return "histogram";
  }
  return "untyped";
}

static void put_family(FILE *out, const metric_family *f) {
  fprintf(out, "# HELP %s ", f->name);
  put_escaped(out, f->help, 0);
  fprintf(out, "\n# TYPE %s %s\n", f->name, type_name(f->type));
  for (const metric_series *s = f->series; s != NULL; s = s->next) {
    if (f->type != METRIC_HISTOGRAM) {
      put_sample(out, f, s, "", NULL, 0, ad_load(&s->value));
      continue;
    }
    /* The count is read first: observations that land while this runs
     * make the buckets' total at least the count, and +Inf is the count,
     * so the buckets stay monotonic. */
    uint64_t count = atomic_load_explicit(&s->count, memory_order_relaxed);
    uint64_t cumulative = 0;
    for (size_t i = 0; i < f->nbounds; i++) {
      cumulative += atomic_load_explicit(&s->buckets[i], memory_order_relaxed);
      if (cumulative > count)
        cumulative = count;
      put_sample(out, f, s, "_bucket", "le", f->bounds[i], (double)cumulative);
    }
    put_sample(out, f, s, "_bucket", "le", INFINITY, (double)count);
    put_sample(out, f, s, "_sum", NULL, 0, ad_load(&s->value));
    put_sample(out, f, s, "_count", NULL, 0, (double)count);
  }
}

int metrics_render(metrics *m, char **text, size_t *len) {
  *text = NULL;
  *len = 0;
  char *buf = NULL;
  size_t bytes = 0;
  FILE *out = open_memstream(&buf, &bytes);
  if (out == NULL)
    return -ENOMEM;
  if (m != NULL) {
    pthread_mutex_lock(&m->mutex);
    for (const metric_family *f = m->families; f != NULL; f = f->next)
      put_family(out, f);
    pthread_mutex_unlock(&m->mutex);
  }
  if (fclose(out) != 0 || buf == NULL) {
    free(buf);
    return -ENOMEM;
  }
  *text = buf;
  *len = bytes;
  return 0;
}
