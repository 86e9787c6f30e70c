/* The metrics registry and its text exposition (daemon/metrics/metrics.c):
 * the exact text of counters, gauges and histograms (cumulative buckets,
 * +Inf, _sum and _count), label and help escaping, families asked for
 * twice, series that leave with their last reference and kept ones that
 * stay, collectors, and updates from many threads at once. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "metrics.h"

static char *render(metrics *m) {
  char *text;
  size_t len;
  assert_int_equal(metrics_render(m, &text, &len), 0);
  assert_int_equal(strlen(text), len);
  return text;
}

static const char *const job_rank[] = {"zerod_job", "rank", NULL};

static void counter_and_gauge_text(void **state) {
  (void)state;
  metrics *m = metrics_create();
  metric_family *steps =
      metrics_family(m, METRIC_COUNTER, "zerod_steps_total", "Steps done.", job_rank, NULL, 0);
  const char *const r0[] = {"lm", "0", NULL}, *const r1[] = {"lm", "1", NULL};
  metric_series *a = metric_series_get(steps, r0), *b = metric_series_get(steps, r1);
  metric_add(a, 3);
  metric_add(a, 2);
  metric_add(b, 0.5);
  metric_series *g = metric_series_get(
      metrics_family(m, METRIC_GAUGE, "zerod_node_sessions", "Sessions.", NULL, NULL, 0), NULL);
  metric_set(g, 7);
  metric_set(g, -2);
  char *text = render(m);
  assert_string_equal(text, "# HELP zerod_steps_total Steps done.\n"
                            "# TYPE zerod_steps_total counter\n"
                            "zerod_steps_total{zerod_job=\"lm\",rank=\"0\"} 5\n"
                            "zerod_steps_total{zerod_job=\"lm\",rank=\"1\"} 0.5\n"
                            "# HELP zerod_node_sessions Sessions.\n"
                            "# TYPE zerod_node_sessions gauge\n"
                            "zerod_node_sessions -2\n");
  free(text);
  assert_true(metric_value(a) == 5);
  metric_series_put(a);
  metric_series_put(b);
  metric_series_put(g);
  metrics_free(m);
}

static void histogram_text(void **state) {
  (void)state;
  metrics *m = metrics_create();
  static const double bounds[] = {0.1, 1, 10};
  metric_series *h = metric_series_get(
      metrics_family(m, METRIC_HISTOGRAM, "x_seconds", "X.", NULL, bounds, 3), NULL);
  metric_observe(h, 0.05);
  metric_observe(h, 0.1); /* on a bound: in that bucket (le) */
  metric_observe(h, 5);
  metric_observe(h, 100);
  char *text = render(m);
  assert_string_equal(text, "# HELP x_seconds X.\n"
                            "# TYPE x_seconds histogram\n"
                            "x_seconds_bucket{le=\"0.1\"} 2\n"
                            "x_seconds_bucket{le=\"1\"} 2\n"
                            "x_seconds_bucket{le=\"10\"} 3\n"
                            "x_seconds_bucket{le=\"+Inf\"} 4\n"
                            "x_seconds_sum 105.15\n"
                            "x_seconds_count 4\n");
  free(text);
  assert_true(metric_value(h) == 4);
  metric_series_put(h);
  /* Bounds that do not increase are refused. */
  static const double bad[] = {1, 1};
  assert_null(metrics_family(m, METRIC_HISTOGRAM, "y_seconds", "Y.", NULL, bad, 2));
  metrics_free(m);
}

static void escaping(void **state) {
  (void)state;
  metrics *m = metrics_create();
  static const char *const labels[] = {"zerod_job", NULL};
  metric_family *f =
      metrics_family(m, METRIC_GAUGE, "g", "a \\ back\nslash \"quoted\"", labels, NULL, 0);
  const char *const v[] = {"a\"b\\c\nd", NULL};
  metric_series *s = metric_series_get(f, v);
  metric_set(s, 1);
  char *text = render(m);
  /* Help: backslash and newline escaped, quotes kept; label values: all three. */
  assert_string_equal(text, "# HELP g a \\\\ back\\nslash \"quoted\"\n"
                            "# TYPE g gauge\n"
                            "g{zerod_job=\"a\\\"b\\\\c\\nd\"} 1\n");
  free(text);
  metric_series_put(s);
  metrics_free(m);
}

static void families_and_series_lifetimes(void **state) {
  (void)state;
  metrics *m = metrics_create();
  metric_family *f = metrics_family(m, METRIC_COUNTER, "c_total", "C.", job_rank, NULL, 0);
  /* The same family again, and refusals of a different shape. */
  assert_ptr_equal(metrics_family(m, METRIC_COUNTER, "c_total", "C.", job_rank, NULL, 0), f);
  assert_null(metrics_family(m, METRIC_GAUGE, "c_total", "C.", job_rank, NULL, 0));
  assert_null(metrics_family(m, METRIC_COUNTER, "c_total", "C.", NULL, NULL, 0));
  /* A missing label value is refused. */
  const char *const short_values[] = {"lm", NULL};
  assert_null(metric_series_get(f, short_values));

  const char *const v[] = {"lm", "0", NULL};
  metric_series *a = metric_series_get(f, v), *b = metric_series_get(f, v);
  assert_ptr_equal(a, b);
  metric_add(a, 1);
  metric_series_put(a);
  char *text = render(m);
  assert_non_null(strstr(text, "c_total{zerod_job=\"lm\",rank=\"0\"} 1\n"));
  free(text);
  metric_series_put(b); /* the last reference: the series leaves */
  text = render(m);
  assert_string_equal(text, "# HELP c_total C.\n# TYPE c_total counter\n");
  free(text);
  /* Made again, it starts over. */
  a = metric_series_get(f, v);
  assert_true(metric_value(a) == 0);
  metric_series_put(a);

  /* A kept series stays with no reference, and one held and put stays
   * kept. */
  const char *const k[] = {"lm", "9", NULL};
  metric_add(metric_family_kept(f, k), 2);
  metric_series *held = metric_series_get(f, k);
  metric_series_put(held);
  assert_ptr_equal(metric_family_kept(f, k), held);
  text = render(m);
  assert_non_null(strstr(text, "c_total{zerod_job=\"lm\",rank=\"9\"} 2\n"));
  free(text);
  metrics_free(m); /* frees the kept series */
}

static void null_is_off(void **state) {
  (void)state;
  metric_family *f = metrics_family(NULL, METRIC_COUNTER, "c_total", "C.", NULL, NULL, 0);
  assert_null(f);
  assert_null(metric_series_get(f, NULL));
  assert_null(metric_family_kept(f, NULL));
  metric_add(NULL, 1);
  metric_set(NULL, 1);
  metric_observe(NULL, 1);
  metric_series_put(NULL);
  metrics_collect(NULL);
  char *text;
  size_t len;
  assert_int_equal(metrics_render(NULL, &text, &len), 0);
  assert_string_equal(text, "");
  free(text);
}

static void bump(void *arg) {
  metric_add(arg, 1);
}

static void collectors_run_in_order_until_removed(void **state) {
  (void)state;
  metrics *m = metrics_create();
  metric_series *s =
      metric_series_get(metrics_family(m, METRIC_GAUGE, "collected", "Runs.", NULL, NULL, 0), NULL);
  assert_int_equal(metrics_add_collector(m, bump, s), 0);
  metrics_collect(m);
  metrics_collect(m);
  assert_true(metric_value(s) == 2);
  metrics_remove_collector(m, bump, s);
  metrics_collect(m);
  assert_true(metric_value(s) == 2);
  metric_series_put(s);
  metrics_free(m);
}

#define THREADS 8
#define ROUNDS  20000

typedef struct worker_arg {
  metric_series *counter, *histogram;
  metric_family *family;
  metrics *registry;
} worker_arg;

static void *hammer(void *p) {
  worker_arg *a = p;
  const char *const v[] = {"race", "0", NULL};
  for (int i = 0; i < ROUNDS; i++) {
    metric_add(a->counter, 1);
    metric_observe(a->histogram, 0.001);
    /* Series made and dropped while others render. */
    metric_series *s = metric_series_get(a->family, v);
    metric_add(s, 1);
    metric_series_put(s);
    if (i % 1000 == 0) {
      char *text;
      size_t len;
      assert_int_equal(metrics_render(a->registry, &text, &len), 0);
      free(text);
    }
  }
  return NULL;
}

static void concurrent_updates_are_not_lost(void **state) {
  (void)state;
  metrics *m = metrics_create();
  worker_arg a = {
      .counter = metric_series_get(
          metrics_family(m, METRIC_COUNTER, "n_total", "N.", NULL, NULL, 0), NULL),
      .histogram = metric_series_get(
          metrics_family(m, METRIC_HISTOGRAM, "t_seconds", "T.", NULL, NULL, 0), NULL),
      .family = metrics_family(m, METRIC_COUNTER, "churn_total", "Churn.", job_rank, NULL, 0),
      .registry = m,
  };
  pthread_t threads[THREADS];
  for (int t = 0; t < THREADS; t++)
    assert_int_equal(pthread_create(&threads[t], NULL, hammer, &a), 0);
  for (int t = 0; t < THREADS; t++)
    pthread_join(threads[t], NULL);
  assert_true(metric_value(a.counter) == THREADS * ROUNDS);
  assert_true(metric_value(a.histogram) == THREADS * ROUNDS);
  char *text = render(m);
  char want[64];
  snprintf(want, sizeof want, "t_seconds_bucket{le=\"0.001\"} %d\n", THREADS * ROUNDS);
  assert_non_null(strstr(text, want));
  free(text);
  metric_series_put(a.counter);
  metric_series_put(a.histogram);
  metrics_free(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(counter_and_gauge_text),
      cmocka_unit_test(histogram_text),
      cmocka_unit_test(escaping),
      cmocka_unit_test(families_and_series_lifetimes),
      cmocka_unit_test(null_is_off),
      cmocka_unit_test(collectors_run_in_order_until_removed),
      cmocka_unit_test(concurrent_updates_are_not_lost),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
