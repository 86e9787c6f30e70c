/* Logging to stderr, logfmt or JSON lines (see log.h). */
#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static _Atomic int min_level = LOG_INFO;

static _Atomic int out_format = LOG_FORMAT_LOGFMT;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

/* Both formats build a line in a buffer of this size and write it with one
 * write(2); longer lines are cut (a JSON line still closes its object). */
#define LINE_BYTES 2048

void log_set_level(log_level level) {
  atomic_store(&min_level, (int)level);
}

void log_set_format(log_format format) {
  atomic_store(&out_format, (int)format);
}

int log_parse_format(const char *name) {
  if (strcmp(name, "logfmt") == 0)
    return LOG_FORMAT_LOGFMT;
  if (strcmp(name, "json") == 0)
    return LOG_FORMAT_JSON;
  return -1;
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

/* ---- JSON lines ---------------------------------------------------------- */

/* A JSON line under construction. Every piece is appended whole or not at
 * all; the first piece that does not fit (within cap, which leaves room for
 * the closing bytes) marks the line full and every later piece is dropped,
 * so a cut line is a prefix of the full one, closed. */
typedef struct jline {
  char *buf;
  size_t n, cap;
  int full;
  int in_string; /* a value's opening quote is out, its closing one is not */
} jline;

/* What closing a cut line may need: the open value's quote, the marker and
 * the end of the object. */
#define JSON_CUT_MARK ",\"truncated\":\"true\""
#define JSON_RESERVE  (1 + sizeof JSON_CUT_MARK - 1 + 2)

static void jput(jline *j, const char *s, size_t len) {
  if (j->full || j->n + len > j->cap) {
    j->full = 1;
    return;
  }
  memcpy(j->buf + j->n, s, len);
  j->n += len;
}

static void jputs(jline *j, const char *s) {
  jput(j, s, strlen(s));
}

/* Length of the well-formed UTF-8 sequence at s (2 to 4 bytes), or 0: no
 * overlong forms, no surrogates, nothing above U+10FFFF. A local copy of
 * the rule in proto/pbcheck.h, which base/ may not include. */
static size_t utf8_len(const unsigned char *s, size_t avail) {
  unsigned char c = s[0];
  size_t len;
  unsigned char lo = 0x80, hi = 0xbf; /* range of the second byte */
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    if (c == 0xe0)
      lo = 0xa0; /* overlong */
    else if (c == 0xed)
      hi = 0x9f; /* surrogates */
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    if (c == 0xf0)
      lo = 0x90; /* overlong */
    else if (c == 0xf4)
      hi = 0x8f; /* above U+10FFFF */
  } else {
    return 0;
  }
  if (avail < len || s[1] < lo || s[1] > hi)
    return 0;
  for (size_t i = 2; i < len; i++)
    if (s[i] < 0x80 || s[i] > 0xbf)
      return 0;
  return len;
}

/* Appends s[0..len) as the inside of a JSON string: '"' and '\' escaped,
 * control characters (and DEL) as \u00XX, valid UTF-8 as is, any other
 * byte >= 0x80 as '?' (a JSON text must be UTF-8). */
static void jescape(jline *j, const char *s, size_t len) {
  const unsigned char *u = (const unsigned char *)s;
  for (size_t i = 0; i < len && !j->full;) {
    unsigned char c = u[i];
    if (c == '"' || c == '\\') {
      char esc[2] = {'\\', (char)c};
      jput(j, esc, 2);
      i++;
    } else if (c < 0x20 || c == 0x7f) {
      char esc[7];
      snprintf(esc, sizeof esc, "\\u%04x", c);
      jput(j, esc, 6);
      i++;
    } else if (c < 0x80) {
      jput(j, s + i, 1);
      i++;
    } else {
      size_t l = utf8_len(u + i, len - i);
      if (l == 0) {
        jput(j, "?", 1);
        i++;
      } else {
        jput(j, s + i, l);
        i += l;
      }
    }
  }
}

/* Starts the field "key":" and leaves the value's string open. A key that
 * does not fit whole is taken back: a cut line never ends in a bare key. */
static void jfield_open(jline *j, const char *key, size_t key_len) {
  size_t mark = j->n;
  jput(j, ",\"", 2);
  jescape(j, key, key_len);
  jput(j, "\":\"", 3);
  if (j->full)
    j->n = mark;
  else
    j->in_string = 1;
}

static void jfield_close(jline *j) {
  jput(j, "\"", 1);
  if (!j->full)
    j->in_string = 0;
}

static void jfield(jline *j, const char *key, const char *value, size_t value_len) {
  jfield_open(j, key, strlen(key));
  jescape(j, value, value_len);
  jfield_close(j);
}

/* Whether the bare value v[0..n) goes into JSON as it is: true, false, or
 * a number in JSON's grammar (no leading zeros: 0600 is a mode, a string),
 * an integer of at most 15 digits (a 64-bit id has more, and readers that
 * keep numbers as doubles would round it: it stays a string). */
static int json_bare(const char *v, size_t n) {
  if ((n == 4 && memcmp(v, "true", 4) == 0) || (n == 5 && memcmp(v, "false", 5) == 0))
    return 1;
  size_t i = v[0] == '-' ? 1 : 0, digits = 0, frac = 0;
  if (i < n && v[i] == '0' && i + 1 < n && v[i + 1] >= '0' && v[i + 1] <= '9')
    return 0;
  for (; i < n && v[i] >= '0' && v[i] <= '9'; i++)
    digits++;
  if (digits == 0)
    return 0;
  if (i < n && v[i] == '.') {
    size_t f = 0;
    for (i++; i < n && v[i] >= '0' && v[i] <= '9'; i++)
      f++;
    if (f == 0)
      return 0;
    frac = 1;
  }
  if (i < n && (v[i] == 'e' || v[i] == 'E')) {
    size_t e = 0;
    if (++i < n && (v[i] == '+' || v[i] == '-'))
      i++;
    for (; i < n && v[i] >= '0' && v[i] <= '9'; i++)
      e++;
    if (e == 0)
      return 0;
    frac = 1;
  }
  return i == n && (frac || digits <= 15);
}

/* The field "key":value with a bare value; taken back whole if it does
 * not fit (a cut line never ends in half a number). */
static void jfield_bare(jline *j, const char *key, size_t key_len, const char *v, size_t n) {
  size_t mark = j->n;
  jput(j, ",\"", 2);
  jescape(j, key, key_len);
  jput(j, "\":", 2);
  jput(j, v, n);
  if (j->full)
    j->n = mark;
}

/* Turns the formatted logfmt tail into fields: key=value pairs separated
 * by spaces, a value bare (up to the next space) or double-quoted with the
 * escapes log_quote writes (\" and \\; any other backslash stays as is).
 * A bare value that is a number or a boolean in JSON's grammar (json_bare)
 * is written as one; every other value, and every quoted one, as a string.
 * At the first token that is
 * not a pair (no '=', an empty key, an unclosed quote, a closing quote not
 * followed by a space) the rest of the tail, from that token on, becomes
 * the field kv_raw. */
static void json_tail(jline *j, const char *tail) {
  char value[LINE_BYTES];
  const char *p = tail;
  while (!j->full) {
    while (*p == ' ')
      p++;
    if (*p == '\0')
      return;
    const char *token = p;
    const char *key = p;
    while (*p != '\0' && *p != ' ' && *p != '=' && *p != '"')
      p++;
    size_t key_len = (size_t)(p - key);
    if (*p != '=' || key_len == 0) {
      jfield(j, "kv_raw", token, strlen(token));
      return;
    }
    p++; /* '=' */
    size_t n = 0;
    if (*p == '"') {
      p++;
      while (*p != '\0' && *p != '"' && n < sizeof value) {
        if (*p == '\\' && (p[1] == '"' || p[1] == '\\'))
          p++;
        value[n++] = *p++;
      }
      if (*p != '"' || (p[1] != ' ' && p[1] != '\0')) {
        jfield(j, "kv_raw", token, strlen(token));
        return;
      }
      p++;
    } else {
      const char *v = p;
      while (*p != '\0' && *p != ' ')
        p++;
      n = (size_t)(p - v);
      memcpy(value, v, n);
      if (n > 0 && json_bare(value, n)) {
        jfield_bare(j, key, key_len, value, n);
        continue;
      }
    }
    jfield_open(j, key, key_len);
    jescape(j, value, n);
    jfield_close(j);
  }
}

static size_t json_line(char *line, const char *ts, log_level level, const char *msg,
                        const char *tail, int tail_cut) {
  jline j = {.buf = line, .cap = LINE_BYTES - JSON_RESERVE};
  jputs(&j, "{\"ts\":\"");
  jputs(&j, ts);
  jputs(&j, "\",\"level\":\"");
  jputs(&j, level_names[level]);
  jputs(&j, "\"");
  jfield(&j, "msg", msg, strlen(msg));
  if (tail != NULL)
    json_tail(&j, tail);
  /* The reserve is outside cap: these always fit. */
  j.cap = LINE_BYTES;
  if (j.full) {
    j.full = 0;
    if (j.in_string)
      jputs(&j, "\"");
    tail_cut = 1;
  }
  if (tail_cut)
    jputs(&j, JSON_CUT_MARK);
  jputs(&j, "}\n");
  return j.n;
}

/* ---- the event ------------------------------------------------------------ */

void log_event(log_level level, const char *msg, const char *kv_fmt, ...) {
  if ((int)level < atomic_load(&min_level))
    return;
  char line[LINE_BYTES];
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  struct tm tm;
  gmtime_r(&now.tv_sec, &tm);
  char ts[64];
  snprintf(ts, sizeof ts, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900, tm.tm_mon + 1,
           tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, now.tv_nsec / 1000000);
  size_t len;
  if (atomic_load(&out_format) == LOG_FORMAT_JSON) {
    /* The tail is formatted as logfmt first (callers write printf formats
     * for logfmt), then parsed into fields. */
    char tail[LINE_BYTES];
    int cut = 0;
    if (kv_fmt != NULL) {
      va_list ap;
      va_start(ap, kv_fmt);
      int m = vsnprintf(tail, sizeof tail, kv_fmt, ap);
      va_end(ap);
      if (m < 0)
        tail[0] = '\0';
      cut = m >= (int)sizeof tail;
    }
    len = json_line(line, ts, level, msg, kv_fmt != NULL ? tail : NULL, cut);
  } else {
    char quoted[512];
    int n = snprintf(line, sizeof line, "ts=%s level=%s msg=%s", ts, level_names[level],
                     log_quote(msg, quoted, sizeof quoted));
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
    len = (size_t)n;
  }
  /* One write per line: lines from different threads stay whole. */
  ssize_t w = write(STDERR_FILENO, line, len);
  (void)w;
}
