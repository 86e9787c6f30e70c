/* log: one line per event on stderr, in logfmt (the default):
 *
 *   ts=2026-11-21T10:00:00.123Z level=info msg="worker attached" job=mlp rank=0
 *
 * or, after log_set_format(LOG_FORMAT_JSON), one JSON object:
 *
 *   {"ts":"2026-11-21T10:00:00.123Z","level":"info","msg":"worker attached",
 *    "job":"mlp","rank":"0"}
 *
 * The message is quoted; the key-value tail is formatted by the caller as
 * logfmt (values with spaces must be quoted by the caller, log_quote helps).
 * In JSON the tail is parsed back into fields, every value a string
 * (numbers as printed); a part of the tail that is not key=value pairs is
 * kept whole in the field "kv_raw". Lines are at most 2048 bytes; a longer
 * one is cut (a JSON line stays one valid object, with "truncated":"true").
 * Lines are written with one write(2), so lines from different threads
 * never interleave. */
#ifndef ZEROD_LOG_H
#define ZEROD_LOG_H

typedef enum log_level { LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR } log_level;

typedef enum log_format { LOG_FORMAT_LOGFMT, LOG_FORMAT_JSON } log_format;

void log_set_level(log_level level);
void log_set_format(log_format format);
/* Parses "logfmt" or "json"; returns -1 if unknown. */
int log_parse_format(const char *name);
/* Parses "debug", "info", "warn" or "error"; returns -1 if unknown. */
int log_parse_level(const char *name);

/* Logs msg with the key-value tail kv_fmt (printf format, may be NULL). */
void log_event(log_level level, const char *msg, const char *kv_fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Copies s into out as a logfmt value: quoted and escaped when it holds
 * spaces, quotes, '=' or control characters. Returns out. */
const char *log_quote(const char *s, char *out, unsigned out_bytes);

#define LOG_DEBUGF(msg, ...) log_event(LOG_DEBUG, msg, __VA_ARGS__)
#define LOG_INFOF(msg, ...)  log_event(LOG_INFO, msg, __VA_ARGS__)
#define LOG_WARNF(msg, ...)  log_event(LOG_WARN, msg, __VA_ARGS__)
#define LOG_ERRORF(msg, ...) log_event(LOG_ERROR, msg, __VA_ARGS__)

#endif /* ZEROD_LOG_H */
