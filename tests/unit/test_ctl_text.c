/* ctl_text_sanitize (daemon/ctl_decode.c): what a node puts in a Heartbeat
 * must pass the coordinator's text check, or the whole heartbeat (and the
 * node's lease) is refused. Fixed cases pin what is replaced and where a
 * long string is cut; random bytes, sanitized into a Heartbeat's error
 * fields, must always decode. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ctl_decode.h"

static void expect_sanitized(const char *in, size_t max_bytes, const char *want) {
  char buf[64];
  snprintf(buf, sizeof buf, "%s", in);
  ctl_text_sanitize(buf, max_bytes);
  assert_string_equal(buf, want);
}

static void test_fixed_cases(void **state) {
  (void)state;
  expect_sanitized("", 10, "");
  expect_sanitized("No space left on device", 100, "No space left on device");
  expect_sanitized("a\nb\tc\x7f", 100, "a?b?c?");
  expect_sanitized("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", 100,
                   "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  expect_sanitized("\xff\xfe", 100, "??");
  expect_sanitized("end \xc3", 100, "end ?");        /* cut sequence */
  expect_sanitized("\xc0\xaf", 100, "??");           /* overlong '/' */
  expect_sanitized("\xed\xa0\x80", 100, "???");      /* surrogate */
  expect_sanitized("\xf4\x90\x80\x80", 100, "????"); /* above U+10FFFF */
  expect_sanitized("\xe2\x82"
                   "x",
                   100, "??x"); /* continuation missing */
  /* Cut at max_bytes, never inside a character. */
  expect_sanitized("abcdef", 3, "abc");
  expect_sanitized("a\xc3\xa9", 2, "a");
  expect_sanitized("a\xc3\xa9", 3, "a\xc3\xa9");
  expect_sanitized("\xf0\x9f\x98\x80", 3, "");
}

/* The coordinator's own decoder accepts what was sanitized. */
static void test_random_bytes_always_decode_in_a_heartbeat(void **state) {
  (void)state;
  uint64_t x = 0x9e3779b97f4a7c15ull;
  char text[CTL_ERROR_MAX_BYTES + 200];
  for (int round = 0; round < 20000; round++) {
    size_t len = (size_t)(x % sizeof text);
    for (size_t i = 0; i < len; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      /* Mostly bytes >= 0x80 and ASCII, so that valid sequences occur too. */
      unsigned char c = (unsigned char)(x >> 24);
      text[i] = (char)(c == 0 ? 'z' : c);
    }
    text[len] = '\0';
    ctl_text_sanitize(text, CTL_ERROR_MAX_BYTES);
    assert_true(strlen(text) <= CTL_ERROR_MAX_BYTES);

    Zerod__V1__ShardReport report = ZEROD__V1__SHARD_REPORT__INIT;
    report.id = 1;
    report.done = 1;
    report.error = text;
    Zerod__V1__ShardReport *reports[] = {&report};
    Zerod__V1__JobStatus job = ZEROD__V1__JOB_STATUS__INIT;
    job.job = "j";
    job.error = text;
    job.n_saves = 1;
    job.saves = reports;
    Zerod__V1__JobStatus *jobs[] = {&job};
    Zerod__V1__HeartbeatRequest req = ZEROD__V1__HEARTBEAT_REQUEST__INIT;
    req.node = "n0";
    req.session = 1;
    req.n_jobs = 1;
    req.jobs = jobs;
    size_t n = protobuf_c_message_get_packed_size(&req.base);
    uint8_t *bytes = malloc(n);
    assert_non_null(bytes);
    protobuf_c_message_pack(&req.base, bytes);
    ProtobufCMessage *out = NULL;
    char err[512] = "";
    int rc = ctl_decode(CTL_HEARTBEAT, bytes, n, &out, err, sizeof err);
    if (rc != 0)
      fail_msg("round %d: a sanitized error was refused: %s", round, err);
    ctl_free(out);
    free(bytes);
    x += 0x9e3779b97f4a7c15ull;
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fixed_cases),
      cmocka_unit_test(test_random_bytes_always_decode_in_a_heartbeat),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
