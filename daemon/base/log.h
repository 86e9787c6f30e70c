/* log: one line per event on stderr, in logfmt:
 *
 *   ts=2026-11-21T10:00:00.123Z level=info msg="worker attached" job=mlp rank=0
 *
 * The message is quoted; the key-value tail is formatted by the caller
 * (values with spaces must be quoted by the caller, log_quote helps). Lines
 * are written with one write(2), so lines from different threads never
 * interleave. */
#ifndef ZEROD_LOG_H
#define ZEROD_LOG_H

typedef enum log_level { LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR } log_level;

void log_set_level(log_level level);
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
