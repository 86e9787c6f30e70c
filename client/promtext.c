/* Prometheus' text format, read (promtext.h). */
#include "promtext.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct reader {
  const char *p, *end; /* the current line: [p, end) */
  size_t line;
  char *err;
  size_t err_bytes;
} reader;

static int fail(reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(reader *r, const char *fmt, ...) {
  char why[160];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  snprintf(r->err, r->err_bytes, "line %zu: %s", r->line, why);
  return -EINVAL;
}

static void skip_blanks(reader *r) {
  while (r->p < r->end && (*r->p == ' ' || *r->p == '\t'))
    r->p++;
}

static int is_alpha(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static int is_digit(char c) {
  return c >= '0' && c <= '9';
}

/* A metric name ([a-zA-Z_:][a-zA-Z0-9_:]*) or, with colons 0, a label
 * name, copied into a new string. */
static int read_name(reader *r, int colons, const char *what, char **out) {
  const char *start = r->p;
  while (r->p < r->end &&
         (is_alpha(*r->p) || (colons && *r->p == ':') || (r->p > start && is_digit(*r->p))))
    r->p++;
  size_t n = (size_t)(r->p - start);
  if (n == 0)
    return fail(r, "expected a %s", what);
  if (n > PROM_MAX_NAME)
    return fail(r, "%s longer than %d bytes", what, PROM_MAX_NAME);
  if ((*out = strndup(start, n)) == NULL)
    return -ENOMEM;
  return 0;
}

/* A quoted label value with the escapes \\, \" and \n. */
static int read_quoted(reader *r, char **out) {
  if (r->p >= r->end || *r->p != '"')
    return fail(r, "expected '\"' to open a label value");
  r->p++;
  char *buf = malloc(PROM_MAX_VALUE + 1);
  if (buf == NULL)
    return -ENOMEM;
  size_t n = 0;
  for (;;) {
    if (r->p >= r->end) {
      free(buf);
      return fail(r, "label value not closed");
    }
    char c = *r->p++;
    if (c == '"')
      break;
    if (c == '\\') {
      if (r->p >= r->end) {
        free(buf);
        return fail(r, "label value not closed");
      }
      char e = *r->p++;
      if (e == 'n')
        c = '\n';
      else if (e == '\\' || e == '"')
        c = e;
      else {
        free(buf);
        return fail(r, "unknown escape '\\%c' in a label value", e);
      }
    }
    if (n == PROM_MAX_VALUE) {
      free(buf);
      return fail(r, "label value longer than %d bytes", PROM_MAX_VALUE);
    }
    buf[n++] = c;
  }
  buf[n] = '\0';
  *out = buf;
  return 0;
}

static int read_labels(reader *r, prom_sample *s) {
  r->p++; /* '{' */
  for (;;) {
    skip_blanks(r);
    if (r->p < r->end && *r->p == '}') {
      r->p++;
      return 0;
    }
    if (s->nlabels == PROM_MAX_LABELS)
      return fail(r, "more than %d labels", PROM_MAX_LABELS);
    prom_label *l = &s->labels[s->nlabels];
    int rc = read_name(r, 0, "label name", &l->name);
    if (rc != 0)
      return rc;
    s->nlabels++; /* owns the name now, freed with the sample */
    for (size_t i = 0; i + 1 < s->nlabels; i++)
      if (strcmp(s->labels[i].name, l->name) == 0)
        return fail(r, "label '%s' given twice", l->name);
    skip_blanks(r);
    if (r->p >= r->end || *r->p != '=')
      return fail(r, "expected '=' after label '%s'", l->name);
    r->p++;
    skip_blanks(r);
    if ((rc = read_quoted(r, &l->value)) != 0)
      return rc;
    skip_blanks(r);
    if (r->p < r->end && *r->p == ',') {
      r->p++;
      continue;
    }
    if (r->p < r->end && *r->p == '}') {
      r->p++;
      return 0;
    }
    return fail(r, "expected ',' or '}' after a label");
  }
}

/* A number token: a float as Go's ParseFloat takes it, NaN and [+-]Inf. */
static int read_number(reader *r, const char *what, double *out) {
  const char *start = r->p;
  while (r->p < r->end && *r->p != ' ' && *r->p != '\t')
    r->p++;
  size_t n = (size_t)(r->p - start);
  char tok[64];
  if (n == 0)
    return fail(r, "expected a %s", what);
  if (n >= sizeof tok)
    return fail(r, "%s too long", what);
  memcpy(tok, start, n);
  tok[n] = '\0';
  /* strtod takes hexadecimal and "infinity" forms the format has not. */
  for (size_t i = 0; i < n; i++)
    if (tok[i] == 'x' || tok[i] == 'X')
      return fail(r, "'%s' is not a %s", tok, what);
  char *end;
  errno = 0;
  double v = strtod(tok, &end);
  if (end != tok + n || end == tok)
    return fail(r, "'%s' is not a %s", tok, what);
  *out = v;
  return 0;
}

static void sample_free(prom_sample *s) {
  free(s->name);
  for (size_t i = 0; i < s->nlabels; i++) {
    free(s->labels[i].name);
    free(s->labels[i].value);
  }
  free(s->labels);
}

static int read_sample(reader *r, prom_sample *s) {
  memset(s, 0, sizeof *s);
  int rc = read_name(r, 1, "metric name", &s->name);
  if (rc != 0)
    return rc;
  skip_blanks(r);
  if (r->p < r->end && *r->p == '{') {
    if ((s->labels = calloc(PROM_MAX_LABELS, sizeof *s->labels)) == NULL)
      return -ENOMEM;
    if ((rc = read_labels(r, s)) != 0)
      return rc;
  }
  skip_blanks(r);
  if ((rc = read_number(r, "sample value", &s->value)) != 0)
    return rc;
  skip_blanks(r);
  if (r->p < r->end) {
    double ts;
    if ((rc = read_number(r, "timestamp", &ts)) != 0)
      return rc;
    skip_blanks(r);
    if (r->p < r->end)
      return fail(r, "unexpected text after the timestamp");
  }
  return 0;
}

int prom_parse(const char *text, size_t len, prom_set *out, char *err, size_t err_bytes) {
  memset(out, 0, sizeof *out);
  err[0] = '\0';
  reader r = {.err = err, .err_bytes = err_bytes};
  size_t cap = 0;
  const char *p = text, *end = text + len;
  int rc = 0;
  while (p < end && rc == 0) {
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    const char *line_end = nl != NULL ? nl : end;
    r.line++;
    r.p = p;
    r.end = line_end;
    if (memchr(p, '\0', (size_t)(line_end - p)) != NULL) {
      rc = fail(&r, "NUL byte");
      break;
    }
    if (line_end > p && line_end[-1] == '\r')
      r.end--;
    p = nl != NULL ? nl + 1 : end;
    skip_blanks(&r);
    if (r.p == r.end || *r.p == '#')
      continue;
    if (out->n == PROM_MAX_SAMPLES) {
      rc = fail(&r, "more than %d samples", PROM_MAX_SAMPLES);
      break;
    }
    if (out->n == cap) {
      size_t next = cap ? cap * 2 : 64;
      prom_sample *grown = realloc(out->samples, next * sizeof *grown);
      if (grown == NULL) {
        rc = -ENOMEM;
        break;
      }
      out->samples = grown;
      cap = next;
    }
    prom_sample *s = &out->samples[out->n];
    rc = read_sample(&r, s);
    if (rc != 0) {
      sample_free(s);
      break;
    }
    /* The label array, made for the most, trimmed to what is used. */
    if (s->labels != NULL && s->nlabels == 0) {
      free(s->labels);
      s->labels = NULL;
    } else if (s->labels != NULL) {
      prom_label *fit = realloc(s->labels, s->nlabels * sizeof *fit);
      if (fit != NULL)
        s->labels = fit;
    }
    out->n++;
  }
  if (rc != 0) {
    if (rc == -ENOMEM)
      snprintf(err, err_bytes, "out of memory");
    prom_set_free(out);
  }
  return rc;
}

void prom_set_free(prom_set *set) {
  for (size_t i = 0; i < set->n; i++)
    sample_free(&set->samples[i]);
  free(set->samples);
  set->samples = NULL;
  set->n = 0;
}

const char *prom_label_value(const prom_sample *s, const char *name) {
  for (size_t i = 0; i < s->nlabels; i++)
    if (strcmp(s->labels[i].name, name) == 0)
      return s->labels[i].value;
  return NULL;
}
