/* zerodctl top (top.h): scrapes each target's /metrics every interval
 * with libcurl, reads it with promtext.c, and prints one row per (job,
 * rank) with figures over the interval (steps/s, mean latencies, bytes
 * moved per second) and as of its end (step, memory, queue), plus one row
 * per target (mode, version, jobs, sessions, memory and CPU of the
 * process). A table for people (redrawn in place on a terminal), or with
 * --json one JSON object per refresh, one per line. */
#include "top.h"

#include <curl/curl.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "promtext.h"

#ifndef ZEROD_VERSION
#define ZEROD_VERSION "0.1.0"
#endif

#define TOP_MAX_TARGETS    64
#define TOP_MAX_BODY_BYTES (64u << 20)
#define TOP_URL_BYTES      1024

enum { TOP_EXIT_OK = 0, TOP_EXIT_FAILED = 1, TOP_EXIT_USAGE = 2 };

typedef struct target {
  char given[TOP_URL_BYTES]; /* as the user wrote it: the row's name */
  char url[TOP_URL_BYTES];
  prom_set prev, cur;
  bool have_prev, have_cur;
  double prev_t, cur_t; /* monotonic seconds of each scrape */
  char error[320];      /* the last scrape's failure, or "" */
} target;

typedef struct top_options {
  target *targets;
  size_t ntargets;
  double interval_s, timeout_s;
  long count; /* refreshes; 0: until interrupted */
  bool json;
  const char *job; /* only this job; NULL: all */
} top_options;

static volatile sig_atomic_t interrupted;

static void on_interrupt(int sig) {
  (void)sig;
  interrupted = 1;
}

/* Text from a target, safe for a terminal: control bytes become '?'. */
static void safe(const char *s, char *out, size_t out_bytes) {
  size_t i = 0;
  for (; s[i] != '\0' && i + 1 < out_bytes; i++)
    out[i] = (unsigned char)s[i] < 0x20 || (unsigned char)s[i] == 0x7f ? '?' : s[i];
  out[i] = '\0';
}

static int top_fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int top_fail(int status, const char *fmt, ...) {
  char line[1024], shown[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  safe(line, shown, sizeof shown);
  fprintf(stderr, "zerodctl: top: %s\n", shown);
  return status;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- Targets ------------------------------------------------------------------ */

/* HOST:PORT means http://HOST:PORT/metrics; a URL must be http(s). */
static int add_target(top_options *o, const char *given) {
  if (o->ntargets == TOP_MAX_TARGETS)
    return top_fail(TOP_EXIT_USAGE, "at most %d --metrics targets", TOP_MAX_TARGETS);
  if (given[0] == '\0' || strlen(given) >= TOP_URL_BYTES - 32)
    return top_fail(TOP_EXIT_USAGE, "invalid --metrics '%s': expected HOST:PORT or a URL", given);
  target *t = &o->targets[o->ntargets];
  memset(t, 0, sizeof *t);
  snprintf(t->given, sizeof t->given, "%s", given);
  if (strstr(given, "://") != NULL) {
    if (strncmp(given, "http://", 7) != 0 && strncmp(given, "https://", 8) != 0)
      return top_fail(TOP_EXIT_USAGE, "invalid --metrics '%s': only http:// and https://", given);
    snprintf(t->url, sizeof t->url, "%s", given);
  } else {
    if (strchr(given, ':') == NULL || strchr(given, '/') != NULL)
      return top_fail(TOP_EXIT_USAGE, "invalid --metrics '%s': expected HOST:PORT or a URL", given);
    snprintf(t->url, sizeof t->url, "http://%s/metrics", given);
  }
  o->ntargets++;
  return 0;
}

typedef struct body {
  char *data;
  size_t len, cap;
  bool too_big;
} body;

static size_t on_body(char *data, size_t size, size_t n, void *arg) {
  body *b = arg;
  size_t bytes = size * n;
  if (b->len + bytes > TOP_MAX_BODY_BYTES) {
    b->too_big = true;
    return 0;
  }
  if (b->len + bytes + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 65536;
    while (cap < b->len + bytes + 1)
      cap *= 2;
    char *grown = realloc(b->data, cap);
    if (grown == NULL)
      return 0;
    b->data = grown;
    b->cap = cap;
  }
  memcpy(b->data + b->len, data, bytes);
  b->len += bytes;
  return bytes;
}

/* One scrape of t into t->cur (the last good one moves to t->prev). */
static void scrape(target *t, double timeout_s) {
  body b = {0};
  char curl_err[CURL_ERROR_SIZE] = "";
  CURL *curl = curl_easy_init();
  if (curl == NULL) {
    snprintf(t->error, sizeof t->error, "cannot start libcurl");
    return;
  }
  curl_easy_setopt(curl, CURLOPT_URL, t->url);
  curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_FAILONERROR, 1L);
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
  curl_easy_setopt(curl, CURLOPT_USERAGENT, "zerodctl/" ZEROD_VERSION);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, curl_err);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &b);
  CURLcode rc = curl_easy_perform(curl);
  double when = now_s();
  curl_easy_cleanup(curl);
  if (rc != CURLE_OK) {
    snprintf(t->error, sizeof t->error, "%s",
             b.too_big          ? "the metrics are over 64 MiB"
             : curl_err[0] != 0 ? curl_err
                                : curl_easy_strerror(rc));
    free(b.data);
    return;
  }
  prom_set set;
  char err[200];
  int prc = prom_parse(b.data != NULL ? b.data : "", b.len, &set, err, sizeof err);
  free(b.data);
  if (prc != 0) {
    snprintf(t->error, sizeof t->error, "not Prometheus' text format: %s", err);
    return;
  }
  t->error[0] = '\0';
  if (t->have_prev)
    prom_set_free(&t->prev);
  t->prev = t->cur;
  t->prev_t = t->cur_t;
  t->have_prev = t->have_cur;
  t->cur = set;
  t->cur_t = when;
  t->have_cur = true;
}

/* ---- Figures ------------------------------------------------------------------- */

/* The sum of name's samples of job and rank (NULL: any), and of label ==
 * value if label is given; *found says whether any matched. */
static double sum_of(const prom_set *set, const char *name, const char *job, const char *rank,
                     bool *found) {
  double sum = 0;
  bool any = false;
  for (size_t i = 0; i < set->n; i++) {
    const prom_sample *s = &set->samples[i];
    if (strcmp(s->name, name) != 0)
      continue;
    const char *j = prom_label_value(s, "zerod_job"), *r = prom_label_value(s, "rank");
    if (job != NULL && (j == NULL || strcmp(j, job) != 0))
      continue;
    if (rank != NULL && (r == NULL || strcmp(r, rank) != 0))
      continue;
    sum += s->value;
    any = true;
  }
  if (found != NULL)
    *found = any;
  return sum;
}

/* zerod_shard_bytes of a job's rank in memory (every `memory` but nvme),
 * or on disk (nvme: offload_optimizer's tier file). */
static double shard_bytes(const prom_set *set, const char *job, const char *rank, bool on_disk) {
  double sum = 0;
  for (size_t i = 0; i < set->n; i++) {
    const prom_sample *s = &set->samples[i];
    if (strcmp(s->name, "zerod_shard_bytes") != 0)
      continue;
    const char *j = prom_label_value(s, "zerod_job"), *r = prom_label_value(s, "rank");
    const char *memory = prom_label_value(s, "memory");
    if (j == NULL || strcmp(j, job) != 0 || r == NULL || strcmp(r, rank) != 0)
      continue;
    if ((memory != NULL && strcmp(memory, "nvme") == 0) == on_disk)
      sum += s->value;
  }
  return sum;
}

/* A counter's growth per second over the interval, or NAN (no previous
 * scrape, or the counter went back: the job was made again). */
static double per_second(const target *t, const char *name, const char *job, const char *rank) {
  if (!t->have_prev || t->cur_t <= t->prev_t)
    return NAN;
  bool a, b;
  double now = sum_of(&t->cur, name, job, rank, &a), before = sum_of(&t->prev, name, job, rank, &b);
  if (!a || !b || now < before)
    return NAN;
  return (now - before) / (t->cur_t - t->prev_t);
}

/* A histogram's mean over the interval in milliseconds, or NAN when it
 * counted nothing new. */
static double mean_ms(const target *t, const char *histogram, const char *job, const char *rank) {
  if (!t->have_prev)
    return NAN;
  char sum_name[128], count_name[128];
  snprintf(sum_name, sizeof sum_name, "%s_sum", histogram);
  snprintf(count_name, sizeof count_name, "%s_count", histogram);
  double count =
      sum_of(&t->cur, count_name, job, rank, NULL) - sum_of(&t->prev, count_name, job, rank, NULL);
  double sum =
      sum_of(&t->cur, sum_name, job, rank, NULL) - sum_of(&t->prev, sum_name, job, rank, NULL);
  if (!(count > 0) || sum < 0)
    return NAN;
  return sum / count * 1e3;
}

typedef struct row {
  const target *t;
  const char *job, *rank;
  double step, steps_per_s, step_ms, gather_ms, reduce_ms, bytes_per_s;
  double shard_bytes, disk_bytes, buffer_bytes, live_bytes, queue, attached, errors;
} row;

static int row_order(const void *a, const void *b) {
  const row *x = a, *y = b;
  int c = strcmp(x->job, y->job);
  if (c != 0)
    return c;
  long rx = strtol(x->rank, NULL, 10), ry = strtol(y->rank, NULL, 10);
  return rx < ry ? -1 : rx > ry ? 1 : strcmp(x->t->given, y->t->given);
}

/* One row per zerod_step sample of every target that answered. */
static row *collect_rows(const top_options *o, size_t *n) {
  size_t cap = 0;
  *n = 0;
  for (size_t i = 0; i < o->ntargets; i++)
    if (o->targets[i].have_cur && o->targets[i].error[0] == '\0')
      cap += o->targets[i].cur.n;
  row *rows = calloc(cap ? cap : 1, sizeof *rows);
  if (rows == NULL)
    return NULL;
  for (size_t i = 0; i < o->ntargets; i++) {
    const target *t = &o->targets[i];
    if (!t->have_cur || t->error[0] != '\0')
      continue;
    for (size_t k = 0; k < t->cur.n; k++) {
      const prom_sample *s = &t->cur.samples[k];
      const char *job = prom_label_value(s, "zerod_job"), *rank = prom_label_value(s, "rank");
      if (strcmp(s->name, "zerod_step") != 0 || job == NULL || rank == NULL)
        continue;
      if (o->job != NULL && strcmp(job, o->job) != 0)
        continue;
      row *r = &rows[(*n)++];
      r->t = t;
      r->job = job;
      r->rank = rank;
      r->step = s->value;
      r->steps_per_s = per_second(t, "zerod_steps_total", job, rank);
      r->step_ms = mean_ms(t, "zerod_step_duration_seconds", job, rank);
      r->gather_ms = mean_ms(t, "zerod_gather_duration_seconds", job, rank);
      r->reduce_ms = mean_ms(t, "zerod_reduce_duration_seconds", job, rank);
      r->bytes_per_s = per_second(t, "zerod_collective_bytes_total", job, rank);
      r->shard_bytes = shard_bytes(&t->cur, job, rank, false);
      r->disk_bytes = shard_bytes(&t->cur, job, rank, true);
      r->buffer_bytes = sum_of(&t->cur, "zerod_buffer_bytes", job, rank, NULL);
      r->live_bytes = sum_of(&t->cur, "zerod_live_gathered_bytes", job, rank, NULL);
      r->queue = sum_of(&t->cur, "zerod_queue_depth", job, rank, NULL);
      r->attached = sum_of(&t->cur, "zerod_worker_attached", job, rank, NULL);
      r->errors = sum_of(&t->cur, "zerod_request_errors_total", job, rank, NULL);
    }
  }
  qsort(rows, *n, sizeof *rows, row_order);
  return rows;
}

/* A label of the target's zerod_build_info, or "?". */
static const char *build_label(const target *t, const char *label) {
  for (size_t i = 0; i < t->cur.n; i++)
    if (strcmp(t->cur.samples[i].name, "zerod_build_info") == 0) {
      const char *v = prom_label_value(&t->cur.samples[i], label);
      return v != NULL ? v : "?";
    }
  return "?";
}

static double node_jobs(const target *t) {
  double jobs = 0;
  for (size_t i = 0; i < t->cur.n; i++) {
    const prom_sample *s = &t->cur.samples[i];
    const char *state = prom_label_value(s, "state");
    if (strcmp(s->name, "zerod_node_jobs") == 0 && state != NULL && strcmp(state, "active") == 0)
      jobs += s->value;
  }
  return jobs;
}

/* ---- Output --------------------------------------------------------------------- */

static void fmt_bytes(double v, char *out, size_t n) {
  static const char *const units[] = {"", "K", "M", "G", "T", "P"};
  if (isnan(v)) {
    snprintf(out, n, "-");
    return;
  }
  int u = 0;
  while (fabs(v) >= 1024 && u < 5) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(out, n, "%.0f", v);
  else
    snprintf(out, n, "%.1f%s", v, units[u]);
}

static void fmt_num(double v, const char *fmt, char *out, size_t n) {
  if (isnan(v))
    snprintf(out, n, "-");
  else
    snprintf(out, n, fmt, v);
}

/* The value of name's sample with label == value (0 if none). */
static double labelled(const prom_set *set, const char *name, const char *label,
                       const char *value) {
  double sum = 0;
  for (size_t i = 0; i < set->n; i++) {
    const char *v = prom_label_value(&set->samples[i], label);
    if (strcmp(set->samples[i].name, name) == 0 && v != NULL && strcmp(v, value) == 0)
      sum += set->samples[i].value;
  }
  return sum;
}

/* Sum of the samples of name for base whose "result" label is result. */
static double base_lookups(const prom_set *set, const char *base, const char *result) {
  double sum = 0;
  for (size_t i = 0; i < set->n; i++) {
    const prom_sample *s = &set->samples[i];
    const char *b = prom_label_value(s, "zerod_base"), *r = prom_label_value(s, "result");
    if (strcmp(s->name, "zerod_base_lookups_total") == 0 && b != NULL && r != NULL &&
        strcmp(b, base) == 0 && strcmp(r, result) == 0)
      sum += s->value;
  }
  return sum;
}

/* From sample *k of a target that answered on: the next zerod_base_jobs
 * sample (one per base), its index in *k and its base's name, or NULL. */
static const prom_sample *next_base(const target *t, size_t *k, const char **base) {
  if (!t->have_cur || t->error[0] != '\0')
    return NULL;
  for (; *k < t->cur.n; (*k)++) {
    const prom_sample *s = &t->cur.samples[*k];
    *base = prom_label_value(s, "zerod_base");
    if (strcmp(s->name, "zerod_base_jobs") == 0 && *base != NULL)
      return s;
  }
  return NULL;
}

/* Bases (docs/bases.md): per target its base cache, then each base with
 * the jobs on it and its cached bytes; nothing when no target has one. */
static void print_bases(const top_options *o) {
  bool header = false;
  for (size_t i = 0; i < o->ntargets; i++) {
    const target *t = &o->targets[i];
    const prom_sample *s;
    const char *base;
    for (size_t k = 0; (s = next_base(t, &k, &base)) != NULL; k++) {
      if (!header) {
        printf("\n%-28s %-24s %5s %9s %9s %9s %8s %8s\n", "TARGET", "BASE", "JOBS", "CACHED",
               "HELD", "IDLE", "HITS", "MISSES");
        header = true;
      }
      char name[64], bname[72], cached[16], held[16], idle[16];
      safe(t->given, name, sizeof name);
      safe(base, bname, sizeof bname);
      fmt_bytes(labelled(&t->cur, "zerod_base_cached_bytes", "zerod_base", base), cached,
                sizeof cached);
      fmt_bytes(labelled(&t->cur, "zerod_base_cache_bytes", "kind", "held"), held, sizeof held);
      fmt_bytes(labelled(&t->cur, "zerod_base_cache_bytes", "kind", "idle"), idle, sizeof idle);
      printf("%-28s %-24s %5.0f %9s %9s %9s %8.0f %8.0f\n", name, bname, s->value, cached, held,
             idle, base_lookups(&t->cur, base, "hit"), base_lookups(&t->cur, base, "miss"));
    }
  }
}

static void print_table(const top_options *o, const row *rows, size_t nrows, bool tty) {
  char when[32];
  time_t now = time(NULL);
  struct tm tm;
  gmtime_r(&now, &tm);
  strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
  if (tty)
    fputs("\033[H\033[2J", stdout);
  printf("zerodctl top: %zu target%s, every %gs, %s\n\n", o->ntargets, o->ntargets == 1 ? "" : "s",
         o->interval_s, when);
  printf("%-28s %-11s %-8s %5s %9s %9s %6s\n", "TARGET", "MODE", "VERSION", "JOBS", "SESSIONS",
         "RSS", "CPU");
  for (size_t i = 0; i < o->ntargets; i++) {
    const target *t = &o->targets[i];
    char name[64], mode[16], version[16];
    safe(t->given, name, sizeof name);
    if (!t->have_cur || t->error[0] != '\0') {
      char why[320];
      safe(t->error[0] ? t->error : "no answer yet", why, sizeof why);
      printf("%-28s unreachable: %s\n", name, why);
      continue;
    }
    safe(build_label(t, "mode"), mode, sizeof mode);
    safe(build_label(t, "version"), version, sizeof version);
    char rss[16], cpu[16];
    fmt_bytes(sum_of(&t->cur, "process_resident_memory_bytes", NULL, NULL, NULL), rss, sizeof rss);
    fmt_num(per_second(t, "process_cpu_seconds_total", NULL, NULL) * 100, "%.0f%%", cpu,
            sizeof cpu);
    printf("%-28s %-11s %-8s %5.0f %9.0f %9s %6s\n", name, mode, version, node_jobs(t),
           sum_of(&t->cur, "zerod_node_sessions", NULL, NULL, NULL), rss, cpu);
  }
  print_bases(o);
  int job_width = 8;
  for (size_t i = 0; i < nrows; i++) {
    int w = (int)strlen(rows[i].job);
    if (w > job_width)
      job_width = w < 64 ? w : 64;
  }
  printf("\n%-*s %4s %8s %8s %8s %9s %9s %9s %9s %9s %9s %9s %5s %6s %6s\n", job_width, "JOB",
         "RANK", "STEP", "STEPS/S", "STEP_MS", "GATHER_MS", "REDUCE_MS", "MOVED/S", "SHARDS",
         "ON_DISK", "BUFFERS", "LIVE", "QUEUE", "WORKER", "ERRORS");
  if (nrows == 0)
    printf("(no jobs)\n");
  for (size_t i = 0; i < nrows; i++) {
    const row *r = &rows[i];
    char job[72], rank[16], rate[16], step_ms[16], gather[16], reduce[16], moved[16], shards[16],
        disk[16], buffers[16], live[16];
    safe(r->job, job, sizeof job);
    safe(r->rank, rank, sizeof rank);
    fmt_num(r->steps_per_s, "%.1f", rate, sizeof rate);
    fmt_num(r->step_ms, "%.2f", step_ms, sizeof step_ms);
    fmt_num(r->gather_ms, "%.2f", gather, sizeof gather);
    fmt_num(r->reduce_ms, "%.2f", reduce, sizeof reduce);
    fmt_bytes(r->bytes_per_s, moved, sizeof moved);
    fmt_bytes(r->shard_bytes, shards, sizeof shards);
    fmt_bytes(r->disk_bytes, disk, sizeof disk);
    fmt_bytes(r->buffer_bytes, buffers, sizeof buffers);
    fmt_bytes(r->live_bytes, live, sizeof live);
    printf("%-*s %4s %8.0f %8s %8s %9s %9s %9s %9s %9s %9s %9s %5.0f %6s %6.0f\n", job_width, job,
           rank, r->step, rate, step_ms, gather, reduce, moved, shards, disk, buffers, live,
           r->queue, r->attached > 0 ? "yes" : "no", r->errors);
  }
  if (!tty)
    putchar('\n');
}

/* A JSON string from a target's text: as is when it is UTF-8, else with
 * every byte outside ASCII replaced. */
static json_t *jstr(const char *s) {
  json_t *v = json_string(s);
  if (v != NULL)
    return v;
  char copy[1024];
  size_t i = 0;
  for (; s[i] != '\0' && i + 1 < sizeof copy; i++)
    copy[i] = (unsigned char)s[i] < 0x80 ? s[i] : '?';
  copy[i] = '\0';
  return json_string(copy);
}

static json_t *jnum(double v) {
  return isnan(v) || isinf(v) ? json_null() : json_real(v);
}

/* A count (a step, bytes, sessions): a JSON integer, as the metric's value
 * is one; null when the daemon has not reported it. */
static json_t *jcount(double v) {
  if (isnan(v) || isinf(v) || v < -9007199254740992.0 || v > 9007199254740992.0)
    return json_null();
  return json_integer((json_int_t)llround(v));
}

/* The bases of every target, for --json: one object per (target, base). */
static json_t *json_bases(const top_options *o) {
  json_t *bases = json_array();
  for (size_t i = 0; i < o->ntargets; i++) {
    const target *t = &o->targets[i];
    const prom_sample *s;
    const char *base;
    for (size_t k = 0; (s = next_base(t, &k, &base)) != NULL; k++) {
      json_t *jb = json_object();
      json_object_set_new(jb, "base", jstr(base));
      json_object_set_new(jb, "target", jstr(t->given));
      json_object_set_new(jb, "jobs", jcount(s->value));
      json_object_set_new(jb, "cached_bytes",
                          jcount(labelled(&t->cur, "zerod_base_cached_bytes", "zerod_base", base)));
      json_object_set_new(jb, "cache_hits", jcount(base_lookups(&t->cur, base, "hit")));
      json_object_set_new(jb, "cache_misses", jcount(base_lookups(&t->cur, base, "miss")));
      json_array_append_new(bases, jb);
    }
  }
  return bases;
}

static int print_json(const top_options *o, const row *rows, size_t nrows) {
  json_t *root = json_object(), *targets = json_array(), *ranks = json_array();
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  json_object_set_new(root, "time_unix_ms",
                      json_integer((json_int_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000));
  json_object_set_new(root, "interval_s", json_real(o->interval_s));
  for (size_t i = 0; i < o->ntargets; i++) {
    const target *t = &o->targets[i];
    json_t *jt = json_object();
    bool ok = t->have_cur && t->error[0] == '\0';
    json_object_set_new(jt, "target", jstr(t->given));
    json_object_set_new(jt, "url", jstr(t->url));
    json_object_set_new(jt, "ok", json_boolean(ok));
    if (!ok) {
      json_object_set_new(jt, "error", jstr(t->error[0] ? t->error : "no answer yet"));
    } else {
      json_object_set_new(jt, "mode", jstr(build_label(t, "mode")));
      json_object_set_new(jt, "version", jstr(build_label(t, "version")));
      json_object_set_new(jt, "jobs", jcount(node_jobs(t)));
      json_object_set_new(jt, "sessions",
                          jcount(sum_of(&t->cur, "zerod_node_sessions", NULL, NULL, NULL)));
      json_object_set_new(
          jt, "resident_bytes",
          jcount(sum_of(&t->cur, "process_resident_memory_bytes", NULL, NULL, NULL)));
      json_object_set_new(jt, "cpu_percent",
                          jnum(per_second(t, "process_cpu_seconds_total", NULL, NULL) * 100));
    }
    json_array_append_new(targets, jt);
  }
  for (size_t i = 0; i < nrows; i++) {
    const row *r = &rows[i];
    json_t *jr = json_object();
    json_object_set_new(jr, "job", jstr(r->job));
    json_object_set_new(jr, "rank", json_integer(strtol(r->rank, NULL, 10)));
    json_object_set_new(jr, "target", jstr(r->t->given));
    json_object_set_new(jr, "step", jcount(r->step));
    json_object_set_new(jr, "steps_per_s", jnum(r->steps_per_s));
    json_object_set_new(jr, "step_ms", jnum(r->step_ms));
    json_object_set_new(jr, "gather_ms", jnum(r->gather_ms));
    json_object_set_new(jr, "reduce_ms", jnum(r->reduce_ms));
    json_object_set_new(jr, "moved_bytes_per_s", jnum(r->bytes_per_s));
    json_object_set_new(jr, "shard_bytes", jcount(r->shard_bytes));
    json_object_set_new(jr, "shard_disk_bytes", jcount(r->disk_bytes));
    json_object_set_new(jr, "buffer_bytes", jcount(r->buffer_bytes));
    json_object_set_new(jr, "live_bytes", jcount(r->live_bytes));
    json_object_set_new(jr, "queue_depth", jcount(r->queue));
    json_object_set_new(jr, "worker_attached", json_boolean(r->attached > 0));
    json_object_set_new(jr, "errors", jcount(r->errors));
    json_array_append_new(ranks, jr);
  }
  json_object_set_new(root, "targets", targets);
  json_object_set_new(root, "ranks", ranks);
  json_object_set_new(root, "bases", json_bases(o));
  char *text = json_dumps(root, JSON_COMPACT);
  json_decref(root);
  if (text == NULL)
    return -ENOMEM;
  puts(text);
  free(text);
  return 0;
}

/* ---- The command --------------------------------------------------------------- */

static const char usage[] =
    "usage: zerodctl top [options]\n"
    "\n"
    "A live table of the jobs and ranks that zerod daemons report on their\n"
    "Prometheus endpoint (zerod --metrics-listen): per rank the step, steps/s,\n"
    "mean step, gather and reduce latency and bytes moved per second over the\n"
    "interval, shard memory and disk (offload_optimizer nvme), buffer memory,\n"
    "queue depth, whether a worker is attached and errors; per daemon its mode,\n"
    "jobs, sessions, memory and CPU; per base (a frozen job) the jobs on it, its\n"
    "bytes in the node's base cache, and the cache's hits and misses.\n"
    "\n"
    "options:\n"
    "  --metrics TARGET  a daemon's endpoint: HOST:PORT (http://HOST:PORT/metrics)\n"
    "                    or an http(s) URL; repeat for more daemons\n"
    "                    [ZEROD_METRICS, targets separated by ',']\n"
    "  --interval S      seconds between refreshes, over which rates are taken\n"
    "                    (0.2..3600, default 2); the first table comes after one\n"
    "  --count N         stop after N tables (default: until interrupted)\n"
    "  --once            the same as --count 1\n"
    "  --job NAME        only this job's ranks\n"
    "  --timeout S       seconds a scrape may take (default 5)\n"
    "  -j, --json        one JSON object per refresh, one per line\n"
    "  -h, --help        this text\n"
    "\n"
    "Exit status: 0, or 1 when no target answered the last scrape of a --count run.\n";

static int parse_seconds(const char *s, double lo, double hi, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno != 0 || end == s || *end != '\0' || !(v >= lo && v <= hi))
    return -1;
  *out = v;
  return 0;
}

static int parse_options(int argc, char **argv, top_options *o) {
  enum { T_METRICS = 3000, T_INTERVAL, T_COUNT, T_ONCE, T_JOB, T_TIMEOUT };
  static const struct option long_options[] = {
      {"metrics", required_argument, NULL, T_METRICS},
      {"interval", required_argument, NULL, T_INTERVAL},
      {"count", required_argument, NULL, T_COUNT},
      {"once", no_argument, NULL, T_ONCE},
      {"job", required_argument, NULL, T_JOB},
      {"timeout", required_argument, NULL, T_TIMEOUT},
      {"json", no_argument, NULL, 'j'},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  opterr = 0;
  optind = 1;
  int opt;
  while ((opt = getopt_long(argc, argv, ":jh", long_options, NULL)) != -1) {
    switch (opt) {
    case T_METRICS: {
      int rc = add_target(o, optarg);
      if (rc != 0)
        return rc;
      break;
    }
    case T_INTERVAL:
      if (parse_seconds(optarg, 0.2, 3600, &o->interval_s) != 0)
        return top_fail(TOP_EXIT_USAGE, "invalid --interval '%s': expected seconds, 0.2..3600",
                        optarg);
      break;
    case T_TIMEOUT:
      if (parse_seconds(optarg, 0.1, 3600, &o->timeout_s) != 0)
        return top_fail(TOP_EXIT_USAGE, "invalid --timeout '%s': expected seconds, 0.1..3600",
                        optarg);
      break;
    case T_COUNT: {
      char *end;
      errno = 0;
      long n = strtol(optarg, &end, 10);
      if (errno != 0 || end == optarg || *end != '\0' || n < 1 || n > 1000000)
        return top_fail(TOP_EXIT_USAGE, "invalid --count '%s': expected 1..1000000", optarg);
      o->count = n;
      break;
    }
    case T_ONCE:
      o->count = 1;
      break;
    case T_JOB:
      o->job = optarg;
      break;
    case 'j':
      o->json = true;
      break;
    case 'h':
      fputs(usage, stdout);
      return -1;
    case ':':
      return top_fail(TOP_EXIT_USAGE, "option '%s' needs a value (see zerodctl top --help)",
                      argv[optind - 1]);
    default:
      return top_fail(TOP_EXIT_USAGE, "unknown option '%s' (see zerodctl top --help)",
                      argv[optind - 1]);
    }
  }
  if (optind < argc)
    return top_fail(TOP_EXIT_USAGE, "unexpected argument '%s' (see zerodctl top --help)",
                    argv[optind]);
  if (o->ntargets == 0) {
    const char *env = getenv("ZEROD_METRICS");
    if (env != NULL && env[0] != '\0') {
      char list[8192];
      snprintf(list, sizeof list, "%s", env);
      char *save = NULL;
      for (char *t = strtok_r(list, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        int rc = add_target(o, t);
        if (rc != 0)
          return rc;
      }
    }
  }
  if (o->ntargets == 0)
    return top_fail(TOP_EXIT_USAGE, "no target: give --metrics HOST:PORT (a daemon's "
                                    "--metrics-listen) or set ZEROD_METRICS");
  return 0;
}

/* Sleeps s seconds unless interrupted. */
static void nap(double s) {
  struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - floor(s)) * 1e9)};
  while (!interrupted && nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

int ctl_top(int argc, char **argv) {
  top_options o = {.interval_s = 2, .timeout_s = 5};
  o.targets = calloc(TOP_MAX_TARGETS, sizeof *o.targets);
  if (o.targets == NULL)
    return top_fail(TOP_EXIT_FAILED, "out of memory");
  int rc = parse_options(argc, argv, &o);
  if (rc != 0) {
    free(o.targets);
    return rc < 0 ? TOP_EXIT_OK : rc;
  }
  if (curl_global_init(CURL_GLOBAL_DEFAULT) != 0) {
    free(o.targets);
    return top_fail(TOP_EXIT_FAILED, "cannot start libcurl");
  }
  struct sigaction sa = {.sa_handler = on_interrupt};
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  bool tty = !o.json && isatty(STDOUT_FILENO);

  /* A first scrape, so that the first table has rates. */
  for (size_t i = 0; i < o.ntargets; i++)
    scrape(&o.targets[i], o.timeout_s);
  int status = TOP_EXIT_OK;
  for (long n = 0; !interrupted && (o.count == 0 || n < o.count); n++) {
    nap(o.interval_s);
    if (interrupted)
      break;
    size_t answered = 0;
    for (size_t i = 0; i < o.ntargets; i++) {
      scrape(&o.targets[i], o.timeout_s);
      answered += o.targets[i].error[0] == '\0';
    }
    size_t nrows;
    row *rows = collect_rows(&o, &nrows);
    if (rows == NULL) {
      status = top_fail(TOP_EXIT_FAILED, "out of memory");
      break;
    }
    if (o.json) {
      if (print_json(&o, rows, nrows) != 0)
        status = top_fail(TOP_EXIT_FAILED, "out of memory");
    } else {
      print_table(&o, rows, nrows, tty);
    }
    free(rows);
    if (fflush(stdout) != 0) {
      status = top_fail(TOP_EXIT_FAILED, "writing the output: %s", strerror(errno));
      break;
    }
    status = answered > 0 ? TOP_EXIT_OK : TOP_EXIT_FAILED;
    if (answered == 0 && o.count != 0 && n + 1 == o.count) {
      for (size_t i = 0; i < o.ntargets; i++)
        top_fail(TOP_EXIT_FAILED, "%s: %s", o.targets[i].given, o.targets[i].error);
    }
  }
  if (o.count == 0)
    status = TOP_EXIT_OK; /* ran until interrupted */
  for (size_t i = 0; i < o.ntargets; i++) {
    if (o.targets[i].have_prev)
      prom_set_free(&o.targets[i].prev);
    if (o.targets[i].have_cur)
      prom_set_free(&o.targets[i].cur);
  }
  free(o.targets);
  curl_global_cleanup();
  return status;
}
