/* The Prometheus text reader of zerodctl top (client/promtext.c): the
 * format's samples (labels, escapes, NaN and infinities, timestamps,
 * comments, CRLF), refusals with their line number, and the daemon's own
 * exposition (daemon/metrics/metrics.c) read back value for value. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "metrics.h"
#include "promtext.h"

static prom_set parse_ok(const char *text) {
  prom_set set;
  char err[256];
  int rc = prom_parse(text, strlen(text), &set, err, sizeof err);
  if (rc != 0)
    fail_msg("'%s': %s", text, err);
  return set;
}

static void parse_fails(const char *text, size_t len, const char *want) {
  prom_set set;
  char err[256];
  assert_int_equal(prom_parse(text, len, &set, err, sizeof err), -EINVAL);
  assert_int_equal(set.n, 0);
  assert_null(set.samples);
  if (strstr(err, want) == NULL)
    fail_msg("error '%s' does not say '%s'", err, want);
}

static void samples_of_the_format(void **state) {
  (void)state;
  prom_set set = parse_ok("# HELP zerod_step The step.\n"
                          "# TYPE zerod_step gauge\n"
                          "zerod_step{zerod_job=\"lm\",rank=\"0\"} 42\n"
                          "\n"
                          "  spaced_out  {  a = \"1\" , b=\"2\" , }  3.5  1700000000000\r\n"
                          "esc{v=\"a\\\\b\\\"c\\nd\"} -1e-3\n"
                          "nan_one NaN\n"
                          "up +Inf\n"
                          "down -Inf\n"
                          "colon:name_total 7");
  assert_int_equal(set.n, 7);
  assert_string_equal(set.samples[0].name, "zerod_step");
  assert_int_equal(set.samples[0].nlabels, 2);
  assert_string_equal(prom_label_value(&set.samples[0], "zerod_job"), "lm");
  assert_string_equal(prom_label_value(&set.samples[0], "rank"), "0");
  assert_null(prom_label_value(&set.samples[0], "job"));
  assert_true(set.samples[0].value == 42);
  assert_string_equal(set.samples[1].name, "spaced_out");
  assert_string_equal(prom_label_value(&set.samples[1], "b"), "2");
  assert_true(set.samples[1].value == 3.5);
  assert_string_equal(prom_label_value(&set.samples[2], "v"), "a\\b\"c\nd");
  assert_true(set.samples[2].value == -1e-3);
  assert_true(isnan(set.samples[3].value));
  assert_true(isinf(set.samples[4].value) && set.samples[4].value > 0);
  assert_true(isinf(set.samples[5].value) && set.samples[5].value < 0);
  assert_string_equal(set.samples[6].name, "colon:name_total");
  prom_set_free(&set);

  set = parse_ok("");
  assert_int_equal(set.n, 0);
  prom_set_free(&set);
}

static void refusals_name_their_line(void **state) {
  (void)state;
  parse_fails("ok 1\n9bad 1\n", strlen("ok 1\n9bad 1\n"), "line 2: expected a metric name");
  parse_fails("a{b=\"1\n", strlen("a{b=\"1\n"), "line 1: label value not closed");
  parse_fails("a{b=\"1\"\n", strlen("a{b=\"1\"\n"), "line 1: expected ',' or '}'");
  parse_fails("a{b=\"1\"} \n", strlen("a{b=\"1\"} \n"), "line 1: expected a sample value");
  parse_fails("a{b=\"1\",b=\"2\"} 1", strlen("a{b=\"1\",b=\"2\"} 1"), "label 'b' given twice");
  parse_fails("a{b=1} 1", strlen("a{b=1} 1"), "expected '\"'");
  parse_fails("a{b=\"\\t\"} 1", strlen("a{b=\"\\t\"} 1"), "unknown escape");
  parse_fails("a one", strlen("a one"), "'one' is not a sample value");
  parse_fails("a 0x10", strlen("a 0x10"), "is not a sample value");
  parse_fails("a 1 2 3", strlen("a 1 2 3"), "after the timestamp");
  parse_fails("a 1 soon", strlen("a 1 soon"), "is not a timestamp");
  parse_fails("a{b=\"1\" c=\"2\"} 1", strlen("a{b=\"1\" c=\"2\"} 1"), "expected ',' or '}'");
  parse_fails("a 1\nb\0 1\n", 9, "line 2: NUL byte");
  /* Bounds: a name, a value, the labels of one sample. */
  char line[PROM_MAX_VALUE + 64];
  memset(line, 'n', PROM_MAX_NAME + 1);
  snprintf(line + PROM_MAX_NAME + 1, 8, " 1");
  parse_fails(line, strlen(line), "longer than 256");
  int n = snprintf(line, sizeof line, "a{v=\"");
  memset(line + n, 'x', PROM_MAX_VALUE + 1);
  snprintf(line + n + PROM_MAX_VALUE + 1, 8, "\"} 1");
  parse_fails(line, strlen(line), "longer than 4096");
  n = snprintf(line, sizeof line, "a{");
  for (int i = 0; i <= PROM_MAX_LABELS; i++)
    n += snprintf(line + n, sizeof line - (size_t)n, "l%d=\"\",", i);
  snprintf(line + n, sizeof line - (size_t)n, "} 1");
  parse_fails(line, strlen(line), "more than 32 labels");
}

/* What the daemon renders, read back: every value, label and name. */
static void the_daemons_exposition_reads_back(void **state) {
  (void)state;
  metrics *m = metrics_create();
  static const char *const labels[] = {"zerod_job", "rank", NULL};
  const char *const v[] = {"we\"ird\\job\nname", "3", NULL};
  metric_series *c = metric_series_get(
      metrics_family(m, METRIC_COUNTER, "zerod_steps_total", "Steps.", labels, NULL, 0), v);
  metric_add(c, 12345);
  metric_series *h = metric_series_get(
      metrics_family(m, METRIC_HISTOGRAM, "zerod_gather_duration_seconds", "G.", labels, NULL, 0),
      v);
  metric_observe(h, 0.0003);
  metric_observe(h, 0.002);
  char *text;
  size_t len;
  assert_int_equal(metrics_render(m, &text, &len), 0);
  prom_set set;
  char err[256];
  assert_int_equal(prom_parse(text, len, &set, err, sizeof err), 0);
  /* 1 counter + buckets + +Inf + sum + count. */
  assert_int_equal(set.n, 1 + metrics_nlatency_buckets + 3);
  assert_string_equal(prom_label_value(&set.samples[0], "zerod_job"), v[0]);
  assert_true(set.samples[0].value == 12345);
  double sum = NAN, count = NAN, inf = NAN;
  for (size_t i = 0; i < set.n; i++) {
    const prom_sample *s = &set.samples[i];
    if (strcmp(s->name, "zerod_gather_duration_seconds_sum") == 0)
      sum = s->value;
    if (strcmp(s->name, "zerod_gather_duration_seconds_count") == 0)
      count = s->value;
    const char *le = prom_label_value(s, "le");
    if (le != NULL && strcmp(le, "+Inf") == 0)
      inf = s->value;
    if (le != NULL && strcmp(le, "0.0005") == 0)
      assert_true(s->value == 1);
  }
  assert_true(sum == 0.0003 + 0.002);
  assert_true(count == 2 && inf == 2);
  prom_set_free(&set);
  free(text);
  metric_series_put(c);
  metric_series_put(h);
  metrics_free(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(samples_of_the_format),
      cmocka_unit_test(refusals_name_their_line),
      cmocka_unit_test(the_daemons_exposition_reads_back),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
