/* flags: reading zerod's command lines through their tables (flags.h).
 *
 * The getopt_long loop that fills a flag_given, the lookup of a flag's
 * text (given, else its variable, else its default), the parsers the
 * tables name, and the one form of a bad value's error: "zerod: invalid
 * --FLAG 'VALUE' (EXPECTED)" on stderr, exit status 2. The rows themselves are in
 * flags_table.c. */
#include "flags.h"

#include "names.h"

#include <errno.h>
#include <getopt.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "filemode.h"
#include "log.h"
#include "size.h"

/* getopt_long's value for a flag: its id past the byte range; -h is 'h'. */
#define FLAG_OPT_BASE 1000

/* ------------------------------------------------------------------------ */
/* Parsers                                                                  */
/* ------------------------------------------------------------------------ */

/* A decimal integer in [f->lo, f->hi]. */
int flag_parse_int(const flag *f, const char *text, int64_t *number) {
  char *end;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < f->lo || v > f->hi)
    return -1;
  *number = v;
  return 0;
}

/* A size in bytes: 512M, 4G (size.h). */
int flag_parse_size(const flag *f, const char *text, int64_t *number) {
  (void)f;
  uint64_t bytes;
  if (size_parse(text, &bytes) != 0)
    return -1;
  *number = (int64_t)bytes;
  return 0;
}

/* One of f->choices; *number is its index. */
int flag_parse_choice(const flag *f, const char *text, int64_t *number) {
  for (int64_t i = 0; f->choices[i] != NULL; i++)
    if (strcmp(text, f->choices[i]) == 0) {
      *number = i;
      return 0;
    }
  return -1;
}

/* Any text of at most f->hi bytes. */
int flag_parse_text(const flag *f, const char *text, int64_t *number) {
  (void)number;
  return strlen(text) > (size_t)f->hi ? -1 : 0;
}

/* debug, info, warn or error: a log_level. */
int flag_parse_log_level(const flag *f, const char *text, int64_t *number) {
  (void)f;
  int level = log_parse_level(text);
  if (level < 0)
    return -1;
  *number = level;
  return 0;
}

/* logfmt or json: a log_format. */
int flag_parse_log_format(const flag *f, const char *text, int64_t *number) {
  (void)f;
  int format = log_parse_format(text);
  if (format < 0)
    return -1;
  *number = format;
  return 0;
}

/* Octal permissions (filemode.h). */
int flag_parse_file_mode(const flag *f, const char *text, int64_t *number) {
  (void)f;
  mode_t mode;
  if (filemode_parse(text, &mode) != 0)
    return -1;
  *number = mode;
  return 0;
}

/* The coordinator's listener: HOST:PORT, a host and a port around the
 * last colon, at most f->hi bytes. */
int flag_parse_listen(const flag *f, const char *text, int64_t *number) {
  (void)number;
  const char *colon = strrchr(text, ':');
  if (colon == NULL || colon == text || colon[1] == '\0' || strlen(text) > (size_t)f->hi)
    return -1;
  return 0;
}

/* The coordinator a node joins: some text with a colon, at most f->hi
 * bytes (the address is checked when it is dialled). */
int flag_parse_coordinator(const flag *f, const char *text, int64_t *number) {
  (void)number;
  if (text[0] == '\0' || strchr(text, ':') == NULL || strlen(text) > (size_t)f->hi)
    return -1;
  return 0;
}

/* A node's name: 1..64 of [A-Za-z0-9._-]. */
int flag_parse_node_name(const flag *f, const char *text, int64_t *number) {
  (void)f;
  (void)number;
  return zd_valid_name(text) ? 0 : -1;
}

/* Seconds, 0.1..3600, fractions allowed: milliseconds, rounded. */
int flag_parse_seconds_ms(const flag *f, const char *text, int64_t *number) {
  (void)f;
  char *end;
  double seconds = strtod(text, &end);
  if (end == text || *end != '\0' || !(seconds >= 0.1 && seconds <= 3600))
    return -1;
  *number = (int)(seconds * 1000 + 0.5);
  return 0;
}

/* A duration: N with s, m, h or d (or no unit: seconds), at most 10
 * years: milliseconds. */
int flag_parse_duration_ms(const flag *f, const char *text, int64_t *number) {
  (void)f;
  char *end;
  errno = 0;
  unsigned long long n = strtoull(text, &end, 10);
  int64_t unit_s = *end == '\0' || strcmp(end, "s") == 0 ? 1
                   : strcmp(end, "m") == 0               ? 60
                   : strcmp(end, "h") == 0               ? 3600
                   : strcmp(end, "d") == 0               ? 86400
                                                         : 0;
  if (errno != 0 || end == text || text[0] == '-' || unit_s == 0 ||
      n > 3650ull * 86400 / (uint64_t)unit_s)
    return -1;
  *number = (int64_t)n * unit_s * 1000;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Values                                                                   */
/* ------------------------------------------------------------------------ */

const flag *flag_find(const flag_table *t, flag_id id) {
  for (size_t i = 0; i < t->n_flags; i++)
    if (t->flags[i].id == id)
      return &t->flags[i];
  return NULL;
}

const char *flag_text(const flag_table *t, const flag_given *given, flag_id id) {
  const flag *f = flag_find(t, id);
  if (given->value[id] != NULL || f == NULL)
    return given->value[id];
  const char *env = f->env != NULL ? getenv(f->env) : NULL;
  return env != NULL ? env : f->fallback;
}

int flag_invalid(const char *name, const char *value, const char *expected) {
  fprintf(stderr, "zerod: invalid %s '%s' (%s)\n", name, value, expected);
  return 2;
}

int flag_check(const flag_table *t, flag_id id, const char *text, int64_t *number) {
  const flag *f = flag_find(t, id);
  if (f == NULL || f->parse == NULL || f->parse(f, text, number) == 0)
    return 0;
  char name[64];
  snprintf(name, sizeof name, "--%s", f->name);
  return flag_invalid(name, text, f->expected);
}

int flag_value(const flag_table *t, const flag_given *given, flag_id id, const char **text,
               int64_t *number) {
  *text = flag_text(t, given, id);
  return *text != NULL ? flag_check(t, id, *text, number) : 0;
}

/* ------------------------------------------------------------------------ */
/* The command line                                                         */
/* ------------------------------------------------------------------------ */

/* t's flags as getopt_long's table, in t->getopt_order if it has one. */
static void getopt_table(const flag_table *t, struct option *out) {
  size_t n = 0;
  for (size_t i = 0; i < t->n_flags; i++) {
    const flag *f = &t->flags[i];
    if (t->getopt_order != NULL) {
      if (t->getopt_order[i] == NULL)
        break; /* not a permutation of the table: tests/unit/test_flags.c */
      f = NULL;
      for (size_t k = 0; k < t->n_flags && f == NULL; k++)
        if (strcmp(t->flags[k].name, t->getopt_order[i]) == 0)
          f = &t->flags[k];
      if (f == NULL)
        continue;
    }
    out[n++] = (struct option){f->name, f->takes_value ? required_argument : no_argument, NULL,
                               f->id == FLAG_HELP ? 'h' : FLAG_OPT_BASE + (int)f->id};
  }
  out[n] = (struct option){NULL, 0, NULL, 0};
}

int flags_parse_argv(const flag_table *t, int argc, char **argv, flag_given *given) {
  struct option options[FLAG_COUNT + 1];
  getopt_table(t, options);
  memset(given, 0, sizeof *given);
  int c;
  while ((c = getopt_long(argc, argv, "h", options, NULL)) != -1) {
    if (c == 'h')
      return FLAGS_HELP;
    if (c < FLAG_OPT_BASE || c >= FLAG_OPT_BASE + FLAG_COUNT)
      return FLAGS_UNKNOWN; /* getopt said why */
    flag_id id = (flag_id)(c - FLAG_OPT_BASE);
    if (id == FLAG_VERSION)
      return FLAGS_VERSION;
    if (id == FLAG_EXPORT_ROOT) {
      if (given->n_export_roots <= COORD_MAX_EXPORT_ROOTS)
        given->export_roots[given->n_export_roots++] = optarg;
    } else {
      given->value[id] = optarg != NULL ? optarg : "";
    }
  }
  return FLAGS_OK;
}

int flags_read_argv(const flag_table *t, int argc, char **argv, flag_given *given) {
  switch (flags_parse_argv(t, argc, argv, given)) {
  case FLAGS_OK:
    return -1;
  case FLAGS_VERSION:
    printf("zerod %s\n", ZEROD_VERSION);
    return 0;
  case FLAGS_HELP:
    flags_usage(t, stdout);
    return 0;
  default:
    flags_usage(t, stderr);
    return 2;
  }
}

void flags_usage(const flag_table *t, FILE *out) {
  fputs(t->usage_head, out);
  for (size_t i = 0; i < t->n_flags; i++)
    fputs(t->flags[i].help, out);
  fputs(t->usage_tail, out);
}
