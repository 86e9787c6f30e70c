/* zerod's command lines as tables (daemon/cli/flags.h), read without a
 * daemon: every flag has the environment variable the daemon reads for
 * it, the defaults are the ones the usage text documents, a bad value's
 * error names the flag (given or from its variable), a flag wins over its
 * variable and the variable over the default, and the usage text is the
 * rows' help in order. The expected names, variables and defaults below
 * are written out here, from the daemon as it was before the tables, so
 * that a row changed by mistake fails here. stderr is captured through a
 * temporary file put over fd 2. */
#include <getopt.h>
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "capture_stderr.h"

#include "flags.h"
#include "log.h"

/* ------------------------------------------------------------------------
 * The expected command lines
 * ------------------------------------------------------------------------ */

typedef struct expected_flag {
  const char *name;
  const char *env;        /* NULL: none */
  const char *documented; /* what the help says after "default ", or NULL */
  const char *text;       /* the default's text, when the row has one */
  int64_t number;         /* ... and what it parses to */
} expected_flag;

static const expected_flag node_expected[] = {
    {"ranks", "ZEROD_RANKS", "1", "1", 1},
    {"max-ranks", "ZEROD_MAX_RANKS", ": the CPUs (cpu) or GPUs (cuda)", NULL, 0},
    {"device", "ZEROD_DEVICE", "cpu", "cpu", 0},
    {"dir", "ZEROD_DIR", ": the user's state directory", NULL, 0},
    {"socket", "ZEROD_SOCKET", "DIR/zerod.sock", NULL, 0},
    {"socket-group", "ZEROD_SOCKET_GROUP", NULL, NULL, 0},
    {"threads-per-rank", "ZEROD_THREADS_PER_RANK", ": CPUs / ranks", NULL, 0},
    {"collective-timeout", "ZEROD_COLLECTIVE_TIMEOUT", "60", "60", 60},
    {"max-live-bytes", "ZEROD_MAX_LIVE_BYTES", "2G", "2G", (int64_t)2 << 30},
    {"base-cache-bytes", "ZEROD_BASE_CACHE_BYTES", "1G", "1G", (int64_t)1 << 30},
    {"max-sessions", "ZEROD_MAX_SESSIONS", "1024", "1024", 1024},
    {"max-pinned-versions", "ZEROD_MAX_PINNED_VERSIONS", "4", "4", 4},
    {"checkpoint-dir", "ZEROD_CHECKPOINT_DIR", "DIR/checkpoints", NULL, 0},
    {"checkpoint-timeout", "ZEROD_CHECKPOINT_TIMEOUT", "600", "600", 600},
    {"job-idle-ttl", "ZEROD_JOB_IDLE_TTL", "0: never", "0", 0},
    {"drain-timeout", "ZEROD_DRAIN_TIMEOUT", "20s", "20s", 20000},
    {"export-root", "ZEROD_EXPORT_ROOT", ": the checkpoint dir", NULL, 0},
    {"file-mode", "ZEROD_FILE_MODE", "0600", "0600", 0600},
    {"nvme-dir", "ZEROD_NVME_DIR", "DIR/nvme", NULL, 0},
    {"replica-dir", "ZEROD_REPLICA_DIR", "/dev/shm/zerod-replicas-NAME", NULL, 0},
    {"coordinator", "ZEROD_COORDINATOR", NULL, NULL, 0},
    {"name", "ZEROD_NODE_NAME", ": the host name", NULL, 0},
    {"comm-host", "ZEROD_COMM_HOST", "127.0.0.1", "127.0.0.1", 0},
    {"log-level", "ZEROD_LOG_LEVEL", "info", "info", LOG_INFO},
    {"health-listen", "ZEROD_HEALTH_LISTEN", ": none", NULL, 0},
    {"metrics-listen", "ZEROD_METRICS_LISTEN", ": none", NULL, 0},
    {"log-format", "ZEROD_LOG_FORMAT", "logfmt", "logfmt", LOG_FORMAT_LOGFMT},
    {"tls-ca", "ZEROD_TLS_CA", NULL, NULL, 0},
    {"tls-cert", "ZEROD_TLS_CERT", NULL, NULL, 0},
    {"tls-key", "ZEROD_TLS_KEY", NULL, NULL, 0},
    {"tls-server-name", "ZEROD_TLS_SERVER_NAME", ": its host", NULL, 0},
    {"auth-token-file", "ZEROD_AUTH_TOKEN_FILE", NULL, NULL, 0},
    {"insecure", "ZEROD_INSECURE", NULL, NULL, 0},
    {"version", NULL, NULL, NULL, 0},
    {"help", NULL, NULL, NULL, 0},
};

static const expected_flag coordinator_expected[] = {
    {"listen", "ZEROD_LISTEN", "0.0.0.0:7070", "0.0.0.0:7070", 0},
    {"state-dir", "ZEROD_STATE_DIR", "./.zerod-coordinator", ".zerod-coordinator", 0},
    {"lease-ttl", "ZEROD_LEASE_TTL", "10", "10", 10000},
    {"checkpoint-dir", "ZEROD_CHECKPOINT_DIR", "STATE-DIR/checkpoints", NULL, 0},
    {"checkpoint-timeout", "ZEROD_CHECKPOINT_TIMEOUT", "600", "600", 600},
    {"retain-deleted-checkpoints", "ZEROD_RETAIN_DELETED_CHECKPOINTS", "0", "0", 0},
    {"stall-timeout", "ZEROD_STALL_TIMEOUT", "30s", "30s", 30000},
    {"job-idle-ttl", "ZEROD_JOB_IDLE_TTL", "0: never", "0", 0},
    {"export-root", "ZEROD_EXPORT_ROOT", ": the checkpoint dir", NULL, 0},
    {"file-mode", "ZEROD_FILE_MODE", "0600", "0600", 0600},
    {"health-listen", "ZEROD_HEALTH_LISTEN", ": none", NULL, 0},
    {"metrics-listen", "ZEROD_METRICS_LISTEN", ": none", NULL, 0},
    {"log-level", "ZEROD_LOG_LEVEL", "info", "info", LOG_INFO},
    {"log-format", "ZEROD_LOG_FORMAT", "logfmt", "logfmt", LOG_FORMAT_LOGFMT},
    {"tls-cert", "ZEROD_TLS_CERT", NULL, NULL, 0},
    {"tls-key", "ZEROD_TLS_KEY", NULL, NULL, 0},
    {"tls-client-ca", "ZEROD_TLS_CLIENT_CA", NULL, NULL, 0},
    {"tls-require-client-cert", "ZEROD_TLS_REQUIRE_CLIENT_CERT", NULL, NULL, 0},
    {"auth-file", "ZEROD_AUTH_FILE", NULL, NULL, 0},
    {"insecure", "ZEROD_INSECURE", NULL, NULL, 0},
    {"help", NULL, NULL, NULL, 0},
};

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* A value each parser refuses, for every flag that has one, and what the
 * error says is expected (as the daemon always said it). */
typedef struct bad_value {
  const char *name, *value, *expected;
} bad_value;

static const bad_value bad_values[] = {
    {"ranks", "0", "1..64"},
    {"ranks", "65", "1..64"},
    {"max-ranks", "0", "1..64"},
    {"device", "tpu", "cpu, cuda or auto"},
    {"threads-per-rank", "257", "1..256"},
    {"collective-timeout", "0", "seconds, 1..86400"},
    {"max-live-bytes", "lots", "a size such as 512M or 4G"},
    {"base-cache-bytes", "lots", "a size such as 512M or 4G"},
    {"max-sessions", "0", "1..1048576"},
    {"max-pinned-versions", "0", "1..1024"},
    {"checkpoint-timeout", "86401", "seconds, 1..86400"},
    {"file-mode", "0777",
     "octal permissions with the owner's rw and no write for others, e.g. 0640"},
    {"coordinator", "no-port", "HOST:PORT, required by zerod node"},
    {"coordinator", "", "HOST:PORT, required by zerod node"},
    {"name", "two words", "1..64 of [A-Za-z0-9._-]"},
    {"log-level", "loud", "debug, info, warn or error"},
    {"log-format", "xml", "logfmt or json"},
    {"listen", ":7070", "HOST:PORT"},
    {"lease-ttl", "0.01", "seconds, 0.1..3600"},
    {"retain-deleted-checkpoints", "5y",
     "a duration: N, Ns, Nm, Nh or Nd, at most 3650d; 0 keeps them"},
    {"stall-timeout", "-3s", "a duration: N, Ns, Nm, Nh or Nd, at most 3650d; 0: never"},
    {"drain-timeout", "-1s", "a duration: N, Ns, Nm, Nh or Nd, at most 3650d; 0: no drain"},
    {"job-idle-ttl", "soon", "a duration: N, Ns, Nm, Nh or Nd, at most 3650d; 0: never"},
    {"state-dir", NULL, "path too long"}, /* a path of PATH_MAX bytes, made in the test */
};

static const flag *row_named(const flag_table *t, const char *name) {
  for (size_t i = 0; i < t->n_flags; i++)
    if (strcmp(t->flags[i].name, name) == 0)
      return &t->flags[i];
  return NULL;
}

/* The help that describes row i: its own, and the next row's when that
 * one goes on with it ("--tls-key FILE  ... and its key [ZEROD_TLS_CERT,
 * ZEROD_TLS_KEY]"); lines joined, names cut at a line's end made whole. */
static void help_block(const flag_table *t, size_t i, char *out, size_t out_bytes) {
  char raw[2048];
  snprintf(raw, sizeof raw, "%s%s", t->flags[i].help,
           i + 1 < t->n_flags && strstr(t->flags[i + 1].help, " ... ") != NULL
               ? t->flags[i + 1].help
               : "");
  size_t n = 0;
  for (const char *p = raw; *p != '\0' && n + 1 < out_bytes; p++) {
    if (*p == '\n') {
      while (p[1] == ' ')
        p++;
      if (n > 0 && out[n - 1] != '_') /* "[ZEROD_AUTH_\n    TOKEN_FILE" */
        out[n++] = ' ';
      continue;
    }
    out[n++] = *p;
  }
  out[n] = '\0';
}

static void unset_variables(void) {
  const flag_table *tables[] = {&flags_node, &flags_coordinator};
  for (size_t k = 0; k < 2; k++)
    for (size_t i = 0; i < tables[k]->n_flags; i++)
      if (tables[k]->flags[i].env != NULL)
        unsetenv(tables[k]->flags[i].env);
}

/* ------------------------------------------------------------------------
 * Tests
 * ------------------------------------------------------------------------ */

static void check_table_names_its_flags(const flag_table *t, const expected_flag *want,
                                        size_t n_want) {
  assert_int_equal(t->n_flags, n_want);
  for (size_t i = 0; i < n_want; i++) {
    const flag *f = row_named(t, want[i].name);
    if (f == NULL)
      fail_msg("no row for --%s", want[i].name);
    if (want[i].env == NULL && f->env != NULL)
      fail_msg("--%s reads %s, expected no variable", f->name, f->env);
    if (want[i].env != NULL && (f->env == NULL || strcmp(f->env, want[i].env) != 0))
      fail_msg("--%s reads %s, expected %s", f->name, f->env ? f->env : "nothing", want[i].env);
    assert_ptr_equal(flag_find(t, f->id), f);
    for (size_t k = 0; k < t->n_flags; k++)
      if (&t->flags[k] != f && t->flags[k].id == f->id)
        fail_msg("--%s and --%s share an id", f->name, t->flags[k].name);
  }
}

static void test_every_flag_has_its_variable(void **state) {
  (void)state;
  check_table_names_its_flags(&flags_node, node_expected, COUNT(node_expected));
  check_table_names_its_flags(&flags_coordinator, coordinator_expected,
                              COUNT(coordinator_expected));
}

static void check_help_names_flag_and_variable(const flag_table *t) {
  for (size_t i = 0; i < t->n_flags; i++) {
    const flag *f = &t->flags[i];
    char start[64], block[2048];
    snprintf(start, sizeof start, f->id == FLAG_HELP ? "  -h, --%s " : "  --%s ", f->name);
    if (strncmp(f->help, start, strlen(start)) != 0)
      fail_msg("the help of --%s starts '%.30s'", f->name, f->help);
    assert_true(f->help[strlen(f->help) - 1] == '\n');
    help_block(t, i, block, sizeof block);
    if (f->env != NULL && strstr(block, f->env) == NULL)
      fail_msg("the help of --%s does not name %s: %s", f->name, f->env, block);
  }
}

static void test_each_help_names_its_flag_and_variable(void **state) {
  (void)state;
  check_help_names_flag_and_variable(&flags_node);
  check_help_names_flag_and_variable(&flags_coordinator);
}

static void check_defaults(const flag_table *t, const expected_flag *want, size_t n_want) {
  flag_given none;
  memset(&none, 0, sizeof none);
  for (size_t i = 0; i < n_want; i++) {
    const flag *f = row_named(t, want[i].name);
    assert_non_null(f);
    char block[2048], phrase[128];
    help_block(t, (size_t)(f - t->flags), block, sizeof block);
    if (want[i].documented != NULL) {
      snprintf(phrase, sizeof phrase, "default%s%s", want[i].documented[0] == ':' ? "" : " ",
               want[i].documented);
      if (strstr(block, phrase) == NULL)
        fail_msg("the help of --%s does not say '%s': %s", f->name, phrase, block);
    }
    const char *text = NULL;
    int64_t number = -1;
    assert_int_equal(flag_value(t, &none, f->id, &text, &number), 0);
    if (want[i].text == NULL) {
      if (text != NULL)
        fail_msg("--%s defaults to '%s', expected none (or the mode's)", f->name, text);
      continue;
    }
    if (text == NULL || strcmp(text, want[i].text) != 0)
      fail_msg("--%s defaults to '%s', expected '%s'", f->name, text ? text : "(none)",
               want[i].text);
    if (f->parse != NULL && f->parse != flag_parse_text && f->parse != flag_parse_listen &&
        number != want[i].number)
      fail_msg("--%s's default parses to %lld, expected %lld", f->name, (long long)number,
               (long long)want[i].number);
  }
}

static void test_defaults_are_as_documented(void **state) {
  (void)state;
  unset_variables();
  check_defaults(&flags_node, node_expected, COUNT(node_expected));
  check_defaults(&flags_coordinator, coordinator_expected, COUNT(coordinator_expected));
}

/* The one line a bad value prints, given as a flag or through its
 * variable: both name the flag. */
static void check_bad_value(const flag_table *t, const flag *f, const char *value,
                            const char *expected) {
  char want[PATH_MAX + 256];
  snprintf(want, sizeof want, "zerod: invalid --%s '%s' (%s)\n", f->name, value, expected);
  int64_t number = 0;
  capture_begin();
  int rc = flag_check(t, f->id, value, &number);
  const char *got = capture_end();
  if (rc != 2 || strcmp(got, want) != 0)
    fail_msg("--%s '%.40s': status %d, printed '%s', expected '%s'", f->name, value, rc, got, want);
  if (f->env == NULL)
    return;
  flag_given none;
  memset(&none, 0, sizeof none);
  const char *text;
  setenv(f->env, value, 1);
  capture_begin();
  rc = flag_value(t, &none, f->id, &text, &number);
  got = capture_end();
  unsetenv(f->env);
  if (rc != 2 || strcmp(got, want) != 0)
    fail_msg("%s='%.40s': status %d, printed '%s', expected '%s'", f->env, value, rc, got, want);
}

static void test_a_bad_value_names_the_flag(void **state) {
  (void)state;
  unset_variables();
  static char long_path[PATH_MAX + 1];
  memset(long_path, 'd', PATH_MAX);
  long_path[0] = '/';
  const flag_table *tables[] = {&flags_node, &flags_coordinator};
  for (size_t k = 0; k < 2; k++) {
    const flag_table *t = tables[k];
    for (size_t i = 0; i < t->n_flags; i++) {
      const flag *f = &t->flags[i];
      if (f->parse == NULL)
        continue;
      int covered = 0;
      for (size_t b = 0; b < COUNT(bad_values); b++) {
        if (strcmp(bad_values[b].name, f->name) != 0)
          continue;
        check_bad_value(t, f, bad_values[b].value != NULL ? bad_values[b].value : long_path,
                        bad_values[b].expected);
        covered = 1;
      }
      if (!covered)
        fail_msg("--%s has a parser and no bad value in this test", f->name);
    }
  }
}

static void test_a_flag_beats_its_variable_beats_the_default(void **state) {
  (void)state;
  unset_variables();
  flag_given given;
  memset(&given, 0, sizeof given);
  const char *text;
  int64_t ranks = 0;
  assert_int_equal(flag_value(&flags_node, &given, FLAG_RANKS, &text, &ranks), 0);
  assert_int_equal(ranks, 1);
  setenv("ZEROD_RANKS", "3", 1);
  assert_int_equal(flag_value(&flags_node, &given, FLAG_RANKS, &text, &ranks), 0);
  assert_int_equal(ranks, 3);
  given.value[FLAG_RANKS] = "5";
  assert_int_equal(flag_value(&flags_node, &given, FLAG_RANKS, &text, &ranks), 0);
  assert_int_equal(ranks, 5);
  unsetenv("ZEROD_RANKS");
  /* A flag the table does not have is never read from the environment. */
  setenv("ZEROD_LISTEN", "10.0.0.1:1", 1);
  assert_null(flag_text(&flags_node, &given, FLAG_LISTEN));
  unsetenv("ZEROD_LISTEN");
}

static int parse_words(const flag_table *t, flag_given *given, int argc, char **argv) {
  optind = 0; /* glibc: start over */
  return flags_parse_argv(t, argc, argv, given);
}

static void test_the_command_line_fills_the_given_flags(void **state) {
  (void)state;
  flag_given given;
  char *argv[] = {"zerod",      "--ranks", "2",        "--export-root", "/a", "--export-root=/b",
                  "--insecure", "--comm",  "10.0.0.2", "node",          NULL};
  assert_int_equal(parse_words(&flags_node, &given, 10, argv), FLAGS_OK);
  assert_string_equal(given.value[FLAG_RANKS], "2");
  assert_string_equal(given.value[FLAG_INSECURE], "");
  assert_string_equal(given.value[FLAG_COMM_HOST], "10.0.0.2"); /* an abbreviation */
  assert_int_equal(given.n_export_roots, 2);
  assert_string_equal(given.export_roots[1], "/b");
  assert_int_equal(optind, 9);
  assert_string_equal(argv[optind], "node");

  char *help[] = {"zerod", "--help", "--bogus", NULL};
  assert_int_equal(parse_words(&flags_node, &given, 3, help), FLAGS_HELP);
  char *version[] = {"zerod", "--version", NULL};
  assert_int_equal(parse_words(&flags_node, &given, 2, version), FLAGS_VERSION);
  char *coordinator_version[] = {"coordinator", "--version", NULL};
  capture_begin();
  int rc = parse_words(&flags_coordinator, &given, 2, coordinator_version);
  const char *got = capture_end();
  assert_int_equal(rc, FLAGS_UNKNOWN);
  assert_non_null(strstr(got, "--version"));
}

static void check_usage(const flag_table *t, const char *first_line) {
  FILE *out = tmpfile();
  assert_non_null(out);
  flags_usage(t, out);
  static char text[16384], want[16384];
  rewind(out);
  size_t n = fread(text, 1, sizeof text - 1, out);
  text[n] = '\0';
  fclose(out);
  size_t used = (size_t)snprintf(want, sizeof want, "%s", t->usage_head);
  for (size_t i = 0; i < t->n_flags; i++)
    used += (size_t)snprintf(want + used, sizeof want - used, "%s", t->flags[i].help);
  snprintf(want + used, sizeof want - used, "%s", t->usage_tail);
  assert_string_equal(text, want);
  assert_memory_equal(text, first_line, strlen(first_line));
  /* getopt's order, where the table has one, names every flag once. */
  if (t->getopt_order == NULL)
    return;
  size_t k = 0;
  for (; t->getopt_order[k] != NULL; k++) {
    assert_non_null(row_named(t, t->getopt_order[k]));
    for (size_t j = 0; j < k; j++)
      assert_string_not_equal(t->getopt_order[j], t->getopt_order[k]);
  }
  assert_int_equal(k, t->n_flags);
}

static void test_the_usage_is_the_rows_help_in_order(void **state) {
  (void)state;
  check_usage(&flags_node, "usage: zerod [standalone] [options]\n");
  check_usage(&flags_coordinator, "usage: zerod coordinator [options]\n");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_flag_has_its_variable),
      cmocka_unit_test(test_each_help_names_its_flag_and_variable),
      cmocka_unit_test(test_defaults_are_as_documented),
      cmocka_unit_test(test_a_bad_value_names_the_flag),
      cmocka_unit_test(test_a_flag_beats_its_variable_beats_the_default),
      cmocka_unit_test(test_the_command_line_fills_the_given_flags),
      cmocka_unit_test(test_the_usage_is_the_rows_help_in_order),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
