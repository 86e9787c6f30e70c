/* logfmt logging to stderr (see log.h). */
#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static _Atomic int min_level = LOG_INFO;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

void log_set_level(log_level level) {
  atomic_store(&min_level, (int)level);
}

int log_parse_level(const char *name) {
  for (int i = 0; i < 4; i++)
    if (strcmp(name, level_names[i]) == 0)
      return i;
  return -1;
}

const char *log_quote(const char *s, char *out, unsigned out_bytes) {
  int needs_quotes = s[0] == '\0';
  for (const char *p = s; *p != '\0'; p++)
    if (*p == ' ' || *p == '"' || *p == '=' || (unsigned char)*p < 0x20)
      needs_quotes = 1;
  unsigned n = 0;
  if (out_bytes < 3) {
    if (out_bytes > 0)
      out[0] = '\0';
    return out;
  }
  if (needs_quotes)
    out[n++] = '"';
  for (const char *p = s; *p != '\0' && n + 3 < out_bytes; p++) {
    unsigned char c = (unsigned char)*p;
    if (c == '"' || c == '\\') {
      out[n++] = '\\';
      out[n++] = (char)c;
    } else if (c < 0x20) {
      out[n++] = ' ';
    } else {
      out[n++] = (char)c;
    }
  }
  if (needs_quotes)
    out[n++] = '"';
  out[n] = '\0';
  return out;
}

void log_event(log_level level, const char *msg, const char *kv_fmt, ...) {
  if ((int)level < atomic_load(&min_level))
    return;
  char line[2048];
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  struct tm tm;
  gmtime_r(&now.tv_sec, &tm);
  char quoted[512];
  int n =
      snprintf(line, sizeof line, "ts=%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s msg=%s",
               tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
               now.tv_nsec / 1000000, level_names[level], log_quote(msg, quoted, sizeof quoted));
  if (n < 0)
    return;
  if (kv_fmt != NULL && (size_t)n + 2 < sizeof line) {
    line[n++] = ' ';
    va_list ap;
    va_start(ap, kv_fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n, kv_fmt, ap);
    va_end(ap);
    if (m > 0)
      n += m;
  }
  if ((size_t)n >= sizeof line - 1)
    n = (int)sizeof line - 2;
  line[n++] = '\n';
  /* One write per line: lines from different threads stay whole. */
  ssize_t w = write(STDERR_FILENO, line, (size_t)n);
  (void)w;
}
