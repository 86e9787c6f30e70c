/* zerodctl_output: what zerodctl prints (zerodctl_impl.h).
 *
 * The one error line on stderr; JSON for scripts (--json): exactly one
 * object per invocation, always valid, whatever bytes the coordinator
 * sent; aligned tables and "key: value" lines for people; the names of
 * the control plane's enum values. Every string from the command line or
 * the coordinator is stripped of control characters before it reaches a
 * terminal. Calls nothing of zerodctl's own. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "zerodctl_impl.h"

/* ------------------------------------------------------------------------ */
/* Errors: one line on stderr                                               */
/* ------------------------------------------------------------------------ */

/* Replaces control characters (newlines included) with '?' so that text
 * from the user or the coordinator cannot break a line or drive the
 * terminal. Bytes of UTF-8 sequences pass unchanged. */
void ctl__sanitize_line(char *s) {
  for (; *s != '\0'; s++)
    if ((unsigned char)*s < 0x20 || (unsigned char)*s == 0x7f)
      *s = '?';
}

/* Prints "zerodctl: <message>\n" on stderr, as one line, and returns status. */
int ctl__fail_line(int status, const char *fmt, ...) {
  char line[CTL_ERROR_LINE_BYTES];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (n < 0)
    snprintf(line, sizeof line, "error (message could not be formatted)");
  ctl__sanitize_line(line);
  fprintf(stderr, "zerodctl: %s\n", line);
  return status;
}

/* ------------------------------------------------------------------------ */
/* JSON output, through jansson                                             */
/* ------------------------------------------------------------------------ */

/* Length of the valid UTF-8 sequence at s (1..4), or 0 if s does not start
 * one (stray continuation byte, overlong form, surrogate, past U+10FFFF,
 * truncated). */
static size_t utf8_sequence_bytes(const unsigned char *s) {
  unsigned char lead = s[0];
  size_t len;
  unsigned char lo = 0x80, hi = 0xbf; /* allowed range of the second byte */
  if (lead >= 0xc2 && lead <= 0xdf) {
    len = 2;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    len = 3;
    if (lead == 0xe0)
      lo = 0xa0;
    else if (lead == 0xed)
      hi = 0x9f;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    len = 4;
    if (lead == 0xf0)
      lo = 0x90;
    else if (lead == 0xf4)
      hi = 0x8f;
  } else {
    return 0;
  }
  if (s[1] < lo || s[1] > hi)
    return 0;
  for (size_t i = 2; i < len; i++)
    if (s[i] < 0x80 || s[i] > 0xbf)
      return 0;
  return len;
}

/* A copy of s with every byte that does not start or continue a valid
 * UTF-8 sequence replaced by U+FFFD, or NULL without memory. */
static char *utf8_repaired(const char *s) {
  size_t n = strlen(s);
  char *copy = malloc(3 * n + 1); /* each bad byte grows to 3 */
  if (copy == NULL)
    return NULL;
  const unsigned char *p = (const unsigned char *)s;
  char *q = copy;
  while (*p != '\0') {
    size_t len = *p < 0x80 ? 1 : utf8_sequence_bytes(p);
    if (len == 0) {
      memcpy(q, "\xef\xbf\xbd", 3);
      q += 3;
      p++;
    } else {
      memcpy(q, p, len);
      q += len;
      p += len;
    }
  }
  *q = '\0';
  return copy;
}

json_t *ctl__json_str(const char *s) {
  if (s == NULL)
    s = "";
  json_t *v = json_string(s);
  if (v != NULL)
    return v;
  char *copy = utf8_repaired(s);
  if (copy == NULL)
    return NULL;
  v = json_string(copy);
  free(copy);
  return v;
}

json_t *ctl__json_id(uint64_t id) {
  char text[24];
  snprintf(text, sizeof text, "%" PRIu64, id);
  return json_string(text);
}

json_t *ctl__json_count(uint64_t n) {
  if (n > (uint64_t)INT64_MAX)
    return ctl__json_id(n);
  return json_integer((json_int_t)n);
}

json_t *ctl__json_real(double v) {
  return isnan(v) || isinf(v) ? json_null() : json_real(v);
}

/* The fewest significant digits, 15 to 17, at which every real under v
 * reads back as itself: jansson writes reals with one precision per
 * document, and 17 everywhere would print 0.9 as 0.90000000000000002. */
static int real_digits(json_t *v) {
  int digits = 15;
  if (json_is_real(v)) {
    double x = json_real_value(v);
    char text[40];
    for (; digits < 17; digits++) {
      snprintf(text, sizeof text, "%.*g", digits, x);
      if (strtod(text, NULL) == x)
        break;
    }
  } else if (json_is_object(v)) {
    const char *key;
    json_t *item;
    json_object_foreach(v, key, item) {
      int d = real_digits(item);
      digits = d > digits ? d : digits;
    }
  } else if (json_is_array(v)) {
    size_t i;
    json_t *item;
    json_array_foreach(v, i, item) {
      int d = real_digits(item);
      digits = d > digits ? d : digits;
    }
  }
  return digits;
}

int ctl__json_print(json_t *root) {
  int rc = root != NULL
               ? json_dumpf(root, stdout, JSON_COMPACT | JSON_REAL_PRECISION(real_digits(root)))
               : -1;
  json_decref(root);
  if (rc != 0)
    return ctl__fail_line(CTL_EXIT_FAILED, "cannot print JSON (out of memory or stdout closed)");
  putchar('\n');
  return CTL_EXIT_OK;
}

/* ------------------------------------------------------------------------ */
/* Tables and values for people                                             */
/* ------------------------------------------------------------------------ */

void ctl__table_init(table *t, size_t columns, const char *const *headers) {
  memset(t, 0, sizeof *t);
  t->columns = columns;
  for (size_t c = 0; c < columns; c++)
    t->headers[c] = headers[c];
}

void ctl__table_free(table *t) {
  for (size_t i = 0; i < t->rows * t->columns; i++)
    free(t->cells[i]);
  free(t->cells);
  t->cells = NULL;
  t->rows = t->capacity = 0;
}

/* Appends a row of t->columns cells (copied; empty cells print as "-").
 * Returns 0 or -ENOMEM. */
int ctl__table_add_row(table *t, char cell_text[][TABLE_CELL_BYTES]) {
  if (t->rows == t->capacity) {
    size_t capacity = t->capacity ? t->capacity * 2 : 16;
    char **cells = realloc(t->cells, capacity * t->columns * sizeof *cells);
    if (cells == NULL)
      return -ENOMEM;
    t->cells = cells;
    t->capacity = capacity;
  }
  char **row = t->cells + t->rows * t->columns;
  for (size_t c = 0; c < t->columns; c++) {
    row[c] = strdup(cell_text[c][0] != '\0' ? cell_text[c] : "-");
    if (row[c] == NULL) {
      for (size_t k = 0; k < c; k++)
        free(row[k]);
      return -ENOMEM;
    }
    ctl__sanitize_line(row[c]);
  }
  t->rows++;
  return 0;
}

/* Columns of a terminal that s takes: one per character, so UTF-8
 * continuation bytes do not count (wide CJK characters are not handled). */
static size_t display_width(const char *s) {
  size_t width = 0;
  for (; *s != '\0'; s++)
    if (((unsigned char)*s & 0xc0) != 0x80)
      width++;
  return width;
}

/* Prints the header and rows, each column as wide as its widest cell, two
 * spaces apart, no trailing blanks. */
void ctl__table_print(const table *t, FILE *out) {
  size_t width[TABLE_MAX_COLUMNS];
  for (size_t c = 0; c < t->columns; c++) {
    width[c] = display_width(t->headers[c]);
    for (size_t r = 0; r < t->rows; r++) {
      size_t w = display_width(t->cells[r * t->columns + c]);
      if (w > width[c])
        width[c] = w;
    }
  }
  for (size_t r = 0; r <= t->rows; r++) {
    for (size_t c = 0; c < t->columns; c++) {
      const char *cell = r == 0 ? t->headers[c] : t->cells[(r - 1) * t->columns + c];
      fputs(cell, out);
      if (c + 1 < t->columns)
        fprintf(out, "%*s", (int)(width[c] - display_width(cell) + 2), "");
    }
    fputc('\n', out);
  }
}

/* "512 B", "4.0 KiB", "15.6 GiB". */
const char *ctl__format_bytes(uint64_t bytes, char *out, size_t out_bytes) {
  static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) {
    snprintf(out, out_bytes, "%" PRIu64 " B", bytes);
    return out;
  }
  double value = (double)bytes / 1024.0;
  size_t unit = 0;
  while (value >= 1023.95 && unit + 1 < sizeof units / sizeof units[0]) {
    value /= 1024.0;
    unit++;
  }
  snprintf(out, out_bytes, "%.1f %s", value, units[unit]);
  return out;
}

/* "2026-11-21T10:00:00Z" (UTC), or "-" for 0. */
const char *ctl__format_unix_ms(int64_t unix_ms, char *out, size_t out_bytes) {
  struct tm tm;
  time_t seconds = (time_t)(unix_ms / 1000);
  if (unix_ms <= 0 || gmtime_r(&seconds, &tm) == NULL) {
    snprintf(out, out_bytes, "-");
    return out;
  }
  strftime(out, out_bytes, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return out;
}

/* "850 ms", "3.4 s". */
const char *ctl__format_ms(int64_t ms, char *out, size_t out_bytes) {
  if (ms < 1000)
    snprintf(out, out_bytes, "%" PRId64 " ms", ms > 0 ? ms : 0);
  else
    snprintf(out, out_bytes, "%.1f s", (double)ms / 1000.0);
  return out;
}

/* Prints "key: value" (the value stripped of control characters). */
void ctl__print_field(const char *key, const char *fmt, ...) {
  char value[CTL_ERROR_LINE_BYTES];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(value, sizeof value, fmt, ap);
  va_end(ap);
  if (n < 0)
    value[0] = '\0';
  ctl__sanitize_line(value);
  printf("%s: %s\n", key, value[0] != '\0' ? value : "-");
}

/* ------------------------------------------------------------------------ */
/* Enum names                                                               */
/* ------------------------------------------------------------------------ */

/* OPTIMIZER_UNSPECIFIED means AdamW (ipc.proto). */
const char *ctl__optimizer_name(Zerod__V1__OptimizerKind kind) {
  switch (kind) {
  case ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_UNSPECIFIED:
  case ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAMW:
    return "adamw";
  case ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAM:
    return "adam";
  case ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD:
    return "sgd";
  default:
    return "unknown";
  }
}

/* DTYPE_UNSPECIFIED means fp32 for the working copy (ipc.proto). */
/* The offload_optimizer device's name ("none" when unset). */
const char *ctl__offload_name(const Zerod__V1__OffloadConfig *off) {
  if (off == NULL)
    return "none";
  switch (off->device) {
  case ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_CPU:
    return "cpu";
  case ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME:
    return "nvme";
  default:
    return "none";
  }
}

const char *ctl__precision_name(Zerod__V1__Dtype dtype) {
  switch (dtype) {
  case ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED:
  case ZEROD__V1__DTYPE__DTYPE_F32:
    return "fp32";
  case ZEROD__V1__DTYPE__DTYPE_BF16:
    return "bf16";
  case ZEROD__V1__DTYPE__DTYPE_F16:
    return "fp16";
  default:
    return "unknown";
  }
}

const char *ctl__serving_status_name(Grpc__Health__V1__HealthCheckResponse__ServingStatus s,
                                     bool lower) {
  switch (s) {
  case GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING:
    return lower ? "serving" : "SERVING";
  case GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING:
    return lower ? "not_serving" : "NOT_SERVING";
  case GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN:
    return lower ? "service_unknown" : "SERVICE_UNKNOWN";
  default:
    return lower ? "unknown" : "UNKNOWN";
  }
}
