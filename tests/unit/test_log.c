/* Log lines on stderr (daemon/base/log.c): logfmt as it always was, and
 * JSON lines, whose key-value fields are parsed back out of the logfmt tail
 * the callers format. stderr is captured through a temporary file put over
 * fd 2; every JSON line goes through a strict checker written for this test
 * (compact objects of string values, UTF-8 only, no raw control bytes). */
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

#include "log.h"

/* The output of one log_event call. */
#define CAPTURE(...) (capture_begin(), log_event(__VA_ARGS__), capture_end())

/* ------------------------------------------------------------------------
 * A strict checker for the JSON lines
 * ------------------------------------------------------------------------ */

#define MAX_FIELDS 512 /* a cut line of short fields holds ~180 */

typedef struct field {
  char key[256];
  char value[4096];
  size_t value_len;
  int bare; /* a number or a boolean, not a string */
} field;

typedef struct object {
  int n;
  field f[MAX_FIELDS];
} object;

/* Decodes one UTF-8 character at s into *cp; returns its length or 0 if it
 * is not the shortest form of a scalar value. */
static size_t utf8_decode(const unsigned char *s, const unsigned char *end, uint32_t *cp) {
  size_t len;
  uint32_t v, min;
  if (s[0] < 0x80)
    len = 1, v = s[0], min = 0;
  else if ((s[0] & 0xe0) == 0xc0)
    len = 2, v = s[0] & 0x1f, min = 0x80;
  else if ((s[0] & 0xf0) == 0xe0)
    len = 3, v = s[0] & 0x0f, min = 0x800;
  else if ((s[0] & 0xf8) == 0xf0)
    len = 4, v = s[0] & 0x07, min = 0x10000;
  else
    return 0;
  if ((size_t)(end - s) < len)
    return 0;
  for (size_t i = 1; i < len; i++) {
    if ((s[i] & 0xc0) != 0x80)
      return 0;
    v = v << 6 | (s[i] & 0x3f);
  }
  if (v < min || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff))
    return 0;
  *cp = v;
  return len;
}

static int hex(int c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

/* Parses a JSON string at *pp into out (decoded); 0 on success. */
static int parse_string(const unsigned char **pp, const unsigned char *end, char *out, size_t cap,
                        size_t *out_len) {
  const unsigned char *p = *pp;
  size_t n = 0;
  if (p >= end || *p++ != '"')
    return -1;
  for (;;) {
    if (p >= end)
      return -1;
    unsigned char c = *p;
    if (c == '"') {
      p++;
      break;
    }
    if (c < 0x20)
      return -1; /* raw control byte */
    char chunk[4];
    size_t chunk_len = 1;
    if (c == '\\') {
      if (p + 1 >= end)
        return -1;
      unsigned char e = p[1];
      p += 2;
      const char *simple = strchr("\"\\/bfnrt", e);
      if (e != 0 && simple != NULL) {
        static const char decoded[] = "\"\\/\b\f\n\r\t";
        chunk[0] = decoded[simple - "\"\\/bfnrt"];
      } else if (e == 'u') {
        if (end - p < 4)
          return -1;
        int v = 0;
        for (int i = 0; i < 4; i++) {
          int h = hex(p[i]);
          if (h < 0)
            return -1;
          v = v << 4 | h;
        }
        p += 4;
        if (v >= 0x80)
          return -1; /* the writer only escapes ASCII */
        chunk[0] = (char)v;
      } else {
        return -1;
      }
    } else if (c >= 0x80) {
      uint32_t cp;
      chunk_len = utf8_decode(p, end, &cp);
      if (chunk_len == 0)
        return -1;
      memcpy(chunk, p, chunk_len);
      p += chunk_len;
    } else {
      chunk[0] = (char)c;
      p++;
    }
    if (n + chunk_len >= cap)
      return -1;
    memcpy(out + n, chunk, chunk_len);
    n += chunk_len;
  }
  out[n] = '\0';
  *out_len = n;
  *pp = p;
  return 0;
}

/* Parses a bare value at *pp (a JSON number or true/false, up to ',' or
 * '}') into out, as its text; 0 on success. */
static int parse_bare(const unsigned char **pp, const unsigned char *end, char *out, size_t cap,
                      size_t *out_len) {
  const unsigned char *p = *pp;
  size_t n = 0;
  while (p < end && *p != ',' && *p != '}' && n + 1 < cap)
    out[n++] = (char)*p++;
  out[n] = '\0';
  char *stop = NULL;
  if (n == 0 || (strcmp(out, "true") != 0 && strcmp(out, "false") != 0 &&
                 (strtod(out, &stop), *stop != '\0' || strchr("-0123456789", out[0]) == NULL)))
    return -1;
  *out_len = n;
  *pp = p;
  return 0;
}

/* Parses one line: a compact object of string, number and boolean
 * values, then '\n', then nothing. 0 on success. */
static int parse_line(const char *line, size_t len, object *o) {
  const unsigned char *p = (const unsigned char *)line, *end = p + len;
  o->n = 0;
  if (len == 0 || line[len - 1] != '\n')
    return -1;
  end--; /* the newline */
  if (p >= end || *p++ != '{')
    return -1;
  if (p < end && *p == '}')
    return p + 1 == end ? 0 : -1;
  for (;;) {
    if (o->n == MAX_FIELDS)
      return -1;
    field *f = &o->f[o->n++];
    size_t key_len;
    if (parse_string(&p, end, f->key, sizeof f->key, &key_len) != 0)
      return -1;
    if (p >= end || *p++ != ':')
      return -1;
    f->bare = p < end && *p != '"';
    if ((f->bare ? parse_bare(&p, end, f->value, sizeof f->value, &f->value_len)
                 : parse_string(&p, end, f->value, sizeof f->value, &f->value_len)) != 0)
      return -1;
    if (p >= end)
      return -1;
    if (*p == '}')
      return p + 1 == end ? 0 : -1;
    if (*p++ != ',')
      return -1;
  }
}

/* Whether key's value is bare (a number or a boolean); -1: no such key. */
static int bare(const object *o, const char *key) {
  for (int i = 0; i < o->n; i++)
    if (strcmp(o->f[i].key, key) == 0)
      return o->f[i].bare;
  return -1;
}

static const char *get(const object *o, const char *key) {
  for (int i = 0; i < o->n; i++)
    if (strcmp(o->f[i].key, key) == 0)
      return o->f[i].value;
  return NULL;
}

/* Captures one JSON line and checks it; the fields land in o. */
static object parsed;

#define JSON(...)                                                                                  \
  do {                                                                                             \
    log_set_format(LOG_FORMAT_JSON);                                                               \
    CAPTURE(__VA_ARGS__);                                                                          \
    log_set_format(LOG_FORMAT_LOGFMT);                                                             \
    if (parse_line(captured, captured_len, &parsed) != 0)                                          \
      fail_msg("not a valid JSON line (%zu bytes): %s", captured_len, captured);                   \
  } while (0)

/* A timestamp like 2026-11-25T10:00:00.123Z. */
static void assert_timestamp(const char *ts) {
  static const char shape[] = "dddd-dd-ddTdd:dd:dd.dddZ";
  assert_int_equal(strlen(ts), strlen(shape));
  for (size_t i = 0; shape[i] != '\0'; i++) {
    if (shape[i] == 'd')
      assert_true(ts[i] >= '0' && ts[i] <= '9');
    else
      assert_int_equal(ts[i], shape[i]);
  }
}

/* The captured line without its timestamp: what follows `prefix` and the
 * 24 bytes of the timestamp. */
static const char *after_ts(const char *prefix) {
  size_t n = strlen(prefix);
  assert_memory_equal(captured, prefix, n);
  char ts[25];
  memcpy(ts, captured + n, 24);
  ts[24] = '\0';
  assert_timestamp(ts);
  return captured + n + 24;
}

/* ------------------------------------------------------------------------
 * logfmt
 * ------------------------------------------------------------------------ */

static void test_logfmt_unchanged(void **state) {
  (void)state;
  char q[64];
  CAPTURE(LOG_INFO, "worker attached", "job=%s rank=%d why=%s", "mlp", 0,
          log_quote("no such \"file\"", q, sizeof q));
  assert_string_equal(after_ts("ts="), " level=info msg=\"worker attached\" job=mlp rank=0 "
                                       "why=\"no such \\\"file\\\"\"\n");
  CAPTURE(LOG_WARN, "stopped", NULL);
  assert_string_equal(after_ts("ts="), " level=warn msg=stopped\n");
  /* Below the level: nothing. */
  CAPTURE(LOG_DEBUG, "quiet", "a=1");
  assert_int_equal(captured_len, 0);
}

static void test_logfmt_long_line_is_cut(void **state) {
  (void)state;
  static char big[3000];
  memset(big, 'a', sizeof big - 1);
  CAPTURE(LOG_INFO, "long", "v=%s", big);
  assert_int_equal(captured_len, 2047);
  assert_int_equal(captured[2046], '\n');
  assert_int_equal(captured[2045], 'a');
}

static void test_parse_format(void **state) {
  (void)state;
  assert_int_equal(log_parse_format("logfmt"), LOG_FORMAT_LOGFMT);
  assert_int_equal(log_parse_format("json"), LOG_FORMAT_JSON);
  assert_int_equal(log_parse_format("JSON"), -1);
  assert_int_equal(log_parse_format(""), -1);
}

/* ------------------------------------------------------------------------
 * JSON
 * ------------------------------------------------------------------------ */

static void test_json_plain_values(void **state) {
  (void)state;
  JSON(LOG_INFO, "worker attached", "job=%s rank=%d", "mlp", 0);
  assert_string_equal(after_ts("{\"ts\":\""),
                      "\",\"level\":\"info\",\"msg\":\"worker attached\",\"job\":\"mlp\","
                      "\"rank\":0}\n");
  assert_int_equal(parsed.n, 5);
  assert_timestamp(get(&parsed, "ts"));
  JSON(LOG_ERROR, "collective failed", "job=%s step=%llu bytes=%d empty= ok=%s", "j", 12ULL, -3,
       "1.5e-3");
  assert_string_equal(get(&parsed, "level"), "error");
  assert_string_equal(get(&parsed, "step"), "12");
  assert_string_equal(get(&parsed, "bytes"), "-3");
  assert_string_equal(get(&parsed, "empty"), "");
  assert_string_equal(get(&parsed, "ok"), "1.5e-3");
  assert_null(get(&parsed, "kv_raw"));
  /* Numbers and booleans are typed; text, quoted values, modes with a
   * leading zero, versions and 64-bit ids (over 15 digits) stay strings. */
  assert_int_equal(bare(&parsed, "step"), 1);
  assert_int_equal(bare(&parsed, "bytes"), 1);
  assert_int_equal(bare(&parsed, "ok"), 1);
  assert_int_equal(bare(&parsed, "empty"), 0);
  assert_int_equal(bare(&parsed, "job"), 0);
  JSON(LOG_INFO, "m",
       "lr=0.001 on=true off=false mode=0600 v=0.1.0 id=%llu small=%llu q=\"7\" x=1e",
       5651228676782159535ULL, 123456789012345ULL);
  assert_int_equal(bare(&parsed, "lr"), 1);
  assert_int_equal(bare(&parsed, "on"), 1);
  assert_int_equal(bare(&parsed, "off"), 1);
  assert_int_equal(bare(&parsed, "small"), 1);
  assert_int_equal(bare(&parsed, "mode"), 0);
  assert_int_equal(bare(&parsed, "v"), 0);
  assert_int_equal(bare(&parsed, "q"), 0);
  assert_int_equal(bare(&parsed, "x"), 0);
  assert_int_equal(bare(&parsed, "id"), 0);
  assert_string_equal(get(&parsed, "id"), "5651228676782159535");
}

/* The whole line, typed: counts and booleans bare, a fraction as a
 * number, a 19-digit id and a word as strings (a reader of doubles would
 * round the id to 5651228676782160000). */
static void test_json_typed_line(void **state) {
  (void)state;
  JSON(LOG_INFO, "job created", "ranks=%d ok=%s lr=%g id=%llu job=%s", 2, "true", 0.001,
       5651228676782159535ULL, "mlp");
  assert_string_equal(after_ts("{\"ts\":\""),
                      "\",\"level\":\"info\",\"msg\":\"job created\",\"ranks\":2,\"ok\":true,"
                      "\"lr\":0.001,\"id\":\"5651228676782159535\",\"job\":\"mlp\"}\n");
  /* 15 digits are still a number; 16 are not. */
  JSON(LOG_INFO, "m", "a=%llu b=%llu", 999999999999999ULL, 1000000000000000ULL);
  assert_string_equal(after_ts("{\"ts\":\""),
                      "\",\"level\":\"info\",\"msg\":\"m\","
                      "\"a\":999999999999999,\"b\":\"1000000000000000\"}\n");
}

static void test_json_quoted_values(void **state) {
  (void)state;
  char q1[64], q2[64], q3[64];
  JSON(LOG_WARN, "attach config differs", "why=%s path=%s eq=%s empty=%s",
       log_quote("no such file", q1, sizeof q1), log_quote("C:\\dir \"x\"", q2, sizeof q2),
       log_quote("a=b", q3, sizeof q3), "\"\"");
  assert_string_equal(get(&parsed, "why"), "no such file");
  assert_string_equal(get(&parsed, "path"), "C:\\dir \"x\"");
  assert_string_equal(get(&parsed, "eq"), "a=b");
  assert_string_equal(get(&parsed, "empty"), "");
  assert_null(get(&parsed, "kv_raw"));
  /* The escapes as written: JSON's own. */
  assert_non_null(strstr(captured, "\"path\":\"C:\\\\dir \\\"x\\\"\""));
  /* Callers that quote by hand ("why=\"%s\"") get the same. */
  JSON(LOG_INFO, "no usable GPU, ranks on the CPU", "why=\"%s\"", "libcuda.so: not found");
  assert_string_equal(get(&parsed, "why"), "libcuda.so: not found");
  assert_string_equal(get(&parsed, "msg"), "no usable GPU, ranks on the CPU");
}

static void test_json_escapes_in_values(void **state) {
  (void)state;
  /* Backslashes and quotes inside a bare value, a backslash log_quote
   * would not write, kept as is. */
  JSON(LOG_INFO, "m", "a=%s b=%s", "x\\y", "p\"q");
  assert_string_equal(get(&parsed, "a"), "x\\y");
  assert_string_equal(get(&parsed, "b"), "p\"q");
  JSON(LOG_INFO, "m", "c=\"%s\"", "back\\nslash");
  assert_string_equal(get(&parsed, "c"), "back\\nslash");
}

static void test_json_control_characters(void **state) {
  (void)state;
  JSON(LOG_INFO, "line\nbreak", "err=%s del=%s", "tab\there\r\x01", "\x7f");
  assert_string_equal(get(&parsed, "msg"), "line\nbreak");
  assert_string_equal(get(&parsed, "err"), "tab\there\r\x01");
  assert_string_equal(get(&parsed, "del"), "\x7f");
  assert_non_null(strstr(captured, "\"msg\":\"line\\u000abreak\""));
  assert_non_null(strstr(captured, "\"err\":\"tab\\u0009here\\u000d\\u0001\""));
  assert_ptr_equal(strchr(captured, '\n'), captured + captured_len - 1);
}

static void test_json_utf8(void **state) {
  (void)state;
  JSON(LOG_INFO, "caf\xc3\xa9", "ok=%s emoji=%s cjk=%s", "na\xc3\xafve", "\xf0\x9f\x98\x80",
       "\xe4\xb8\xad");
  assert_string_equal(get(&parsed, "msg"), "caf\xc3\xa9");
  assert_string_equal(get(&parsed, "ok"), "na\xc3\xafve");
  assert_string_equal(get(&parsed, "emoji"), "\xf0\x9f\x98\x80");
  assert_string_equal(get(&parsed, "cjk"), "\xe4\xb8\xad");
  /* Not UTF-8: a stray byte, an overlong '/', a surrogate, a sequence cut
   * short, one above U+10FFFF. Each bad byte becomes '?'. */
  JSON(LOG_INFO, "bad\xff", "a=%s b=%s c=%s d=%s e=%s", "x\xff\xc3(", "\xc0\xaf", "\xed\xa0\x80",
       "z\xe2\x82", "\xf4\x90\x80\x80");
  assert_string_equal(get(&parsed, "msg"), "bad?");
  assert_string_equal(get(&parsed, "a"), "x?"
                                         "?(" /* not a trigraph */);
  assert_string_equal(get(&parsed, "b"), "??");
  assert_string_equal(get(&parsed, "c"), "???");
  assert_string_equal(get(&parsed, "d"), "z??");
  assert_string_equal(get(&parsed, "e"), "????");
}

static void test_json_empty_tail(void **state) {
  (void)state;
  JSON(LOG_INFO, "stopped", NULL);
  assert_string_equal(after_ts("{\"ts\":\""), "\",\"level\":\"info\",\"msg\":\"stopped\"}\n");
  JSON(LOG_INFO, "stopped", "%s", "");
  assert_int_equal(parsed.n, 3);
  JSON(LOG_INFO, "stopped", "%s", "   ");
  assert_int_equal(parsed.n, 3);
  JSON(LOG_INFO, "", NULL);
  assert_string_equal(get(&parsed, "msg"), "");
}

static void test_json_unparsed_tail_is_kept(void **state) {
  (void)state;
  /* A stray token: the fields before it, then the rest as it was. */
  JSON(LOG_INFO, "m", "job=mlp oops rank=%d", 1);
  assert_string_equal(get(&parsed, "job"), "mlp");
  assert_string_equal(get(&parsed, "kv_raw"), "oops rank=1");
  assert_null(get(&parsed, "rank"));
  /* Not a pair from the first token on. */
  JSON(LOG_INFO, "m", "just words");
  assert_string_equal(get(&parsed, "kv_raw"), "just words");
  JSON(LOG_INFO, "m", "=x a=b");
  assert_string_equal(get(&parsed, "kv_raw"), "=x a=b");
  /* An unclosed quote; a quote closed inside a word (a value quoted by
   * hand that holds quotes itself). */
  JSON(LOG_INFO, "m", "a=1 why=\"no end");
  assert_string_equal(get(&parsed, "a"), "1");
  assert_string_equal(get(&parsed, "kv_raw"), "why=\"no end");
  JSON(LOG_INFO, "m", "why=\"%s\" after=1", "say \"hi\" now");
  assert_string_equal(get(&parsed, "kv_raw"), "why=\"say \"hi\" now\" after=1");
  /* Odd bytes in the raw part are escaped like any value. */
  JSON(LOG_INFO, "m", "x\t\xff\"\\");
  assert_string_equal(get(&parsed, "kv_raw"), "x\t?\"\\");
  assert_null(get(&parsed, "truncated"));
}

static void test_json_long_lines_stay_valid(void **state) {
  (void)state;
  static char big[3000];
  memset(big, 'a', sizeof big - 1);
  JSON(LOG_INFO, "long", "v=%s", big);
  assert_true(captured_len <= 2048);
  assert_string_equal(get(&parsed, "truncated"), "true");
  const char *v = get(&parsed, "v");
  assert_non_null(v);
  assert_true(strlen(v) > 1900);
  assert_int_equal(strspn(v, "a"), strlen(v));
  /* A long message. */
  JSON(LOG_INFO, big, "v=1");
  assert_true(captured_len <= 2048);
  assert_string_equal(get(&parsed, "truncated"), "true");
  assert_null(get(&parsed, "v"));

  /* Cuts at every offset through escapes, multibyte characters, keys and
   * field boundaries: the line is always valid, never over the limit. */
  static const char *const fillers[] = {"\x01", "\xc3\xa9", "\xf0\x9f\x98\x80", "\"", "\xff", "b"};
  for (size_t k = 0; k < sizeof fillers / sizeof fillers[0]; k++) {
    for (int pad = 0; pad < 48; pad++) {
      char value[3000] = "";
      size_t n = 0, fl = strlen(fillers[k]);
      while (n + fl < 700) {
        memcpy(value + n, fillers[k], fl);
        n += fl;
      }
      value[n] = '\0';
      char q[4096];
      JSON(LOG_INFO, "cut", "p=%.*s a=%s b=%s key%d=%s c=%s", pad, big,
           log_quote(value, q, sizeof q), value, pad, value, value);
      assert_true(captured_len <= 2048);
      assert_string_equal(get(&parsed, "truncated"), "true");
      assert_string_equal(get(&parsed, "msg"), "cut");
    }
  }
  /* Many short fields: cut between fields. */
  char tail[2400];
  size_t n = 0;
  for (int i = 0; n + 16 < sizeof tail; i++)
    n += (size_t)snprintf(tail + n, sizeof tail - n, "k%d=v%d ", i, i);
  JSON(LOG_INFO, "fields", "%s", tail);
  assert_true(captured_len <= 2048);
  assert_string_equal(get(&parsed, "truncated"), "true");
  assert_string_equal(get(&parsed, "k0"), "v0");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_logfmt_unchanged),
      cmocka_unit_test(test_logfmt_long_line_is_cut),
      cmocka_unit_test(test_parse_format),
      cmocka_unit_test(test_json_plain_values),
      cmocka_unit_test(test_json_typed_line),
      cmocka_unit_test(test_json_quoted_values),
      cmocka_unit_test(test_json_escapes_in_values),
      cmocka_unit_test(test_json_control_characters),
      cmocka_unit_test(test_json_utf8),
      cmocka_unit_test(test_json_empty_tail),
      cmocka_unit_test(test_json_unparsed_tail_is_kept),
      cmocka_unit_test(test_json_long_lines_stay_valid),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
