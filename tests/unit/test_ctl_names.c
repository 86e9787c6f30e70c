/* The names the Checkpoints service takes from outside (ctl_decode.c):
 * checkpoint directories ("<job>" of a live job, "<job>@<id>" of a
 * deleted one) and checkpoint references ("<name>", "<dir>/<name>", a
 * path). Each case says what a caller could otherwise reach: a directory
 * name that is not one of these must never become a path. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "ctl_decode.h"

static void expect_dir(const char *s, const char *job, uint64_t id) {
  char got_job[CTL_NAME_MAX_BYTES + 1] = "";
  uint64_t got_id = 99;
  if (!ctl_parse_checkpoint_dir(s, got_job, &got_id))
    fail_msg("expected '%s' to name a checkpoint directory", s);
  assert_string_equal(got_job, job);
  assert_true(got_id == id);
}

static void expect_not_dir(const char *s) {
  if (ctl_parse_checkpoint_dir(s, NULL, NULL))
    fail_msg("expected '%s' to be refused as a checkpoint directory", s);
}

static void test_checkpoint_dir_names(void **state) {
  (void)state;
  expect_dir("mlp", "mlp", 0);
  expect_dir("mlp@7", "mlp", 7);
  expect_dir("a.b_c-d@1234567890123456789", "a.b_c-d", 1234567890123456789ull);
  expect_not_dir("");
  expect_not_dir("@7");
  expect_not_dir("mlp@");
  expect_not_dir("mlp@0");  /* no job has id 0 */
  expect_not_dir("mlp@07"); /* one spelling per directory */
  expect_not_dir("mlp@7@8");
  expect_not_dir("mlp@-7");
  expect_not_dir("mlp@7x");
  expect_not_dir("mlp@12345678901234567890"); /* 20 digits: past 2^63 */
  expect_not_dir("..@7");
  expect_not_dir(".@7");
  expect_not_dir("..");
  expect_not_dir("a/b@7");
  expect_not_dir("a b");
  char long_job[CTL_NAME_MAX_BYTES + 8];
  memset(long_job, 'j', CTL_NAME_MAX_BYTES + 1);
  long_job[CTL_NAME_MAX_BYTES + 1] = '\0';
  expect_not_dir(long_job);
  long_job[CTL_NAME_MAX_BYTES] = '\0';
  expect_dir(long_job, long_job, 0);
}

static void test_checkpoint_refs(void **state) {
  (void)state;
  char dir[CTL_CKPT_DIR_MAX_BYTES + 1], name[CTL_NAME_MAX_BYTES + 1];
  assert_int_equal(ctl_parse_checkpoint_ref("step-1", dir, name), CTL_REF_NAME);
  assert_string_equal(name, "step-1");
  assert_int_equal(ctl_parse_checkpoint_ref("mlp/step-1", dir, name), CTL_REF_JOB_NAME);
  assert_string_equal(dir, "mlp");
  assert_string_equal(name, "step-1");
  assert_int_equal(ctl_parse_checkpoint_ref("mlp@12/secret", dir, name), CTL_REF_JOB_NAME);
  assert_string_equal(dir, "mlp@12");
  assert_string_equal(name, "secret");
  /* The longest directory fits the buffer the header asks for. */
  char ref[CTL_CKPT_DIR_MAX_BYTES + 16];
  memset(ref, 'j', CTL_NAME_MAX_BYTES);
  strcpy(ref + CTL_NAME_MAX_BYTES, "@1234567890123456789/n");
  assert_int_equal(ctl_parse_checkpoint_ref(ref, dir, name), CTL_REF_JOB_NAME);
  assert_int_equal(strlen(dir), CTL_CKPT_DIR_MAX_BYTES);
  assert_int_equal(ctl_parse_checkpoint_ref("mlp@0/secret", dir, name), CTL_REF_INVALID);
  assert_int_equal(ctl_parse_checkpoint_ref("../x/secret", dir, name), CTL_REF_INVALID);
  assert_int_equal(ctl_parse_checkpoint_ref("mlp/x.tmp-3", dir, name), CTL_REF_INVALID);
  assert_int_equal(ctl_parse_checkpoint_ref("mlp/a/b", dir, name), CTL_REF_INVALID);
  assert_int_equal(ctl_parse_checkpoint_ref("/data/ckpt/mlp/a", dir, name), CTL_REF_PATH);
}

/* List and Delete take a deleted job's directory; Save and CreateJob do
 * not take the form at all (a job is never named with '@'). */
static void test_requests_take_deleted_job_directories(void **state) {
  (void)state;
  Zerod__V1__DeleteCheckpointRequest del = ZEROD__V1__DELETE_CHECKPOINT_REQUEST__INIT;
  del.job = "mlp@7";
  del.name = "secret";
  uint8_t buf[256];
  size_t len = zerod__v1__delete_checkpoint_request__pack(&del, buf);
  ProtobufCMessage *msg = NULL;
  char err[512];
  assert_int_equal(ctl_decode(CTL_DELETE_CHECKPOINT, buf, len, &msg, err, sizeof err), 0);
  ctl_free(msg);
  del.job = "mlp@x";
  len = zerod__v1__delete_checkpoint_request__pack(&del, buf);
  assert_int_not_equal(ctl_decode(CTL_DELETE_CHECKPOINT, buf, len, &msg, err, sizeof err), 0);
  assert_non_null(strstr(err, "<job>@<id>"));

  Zerod__V1__CreateJobRequest create = ZEROD__V1__CREATE_JOB_REQUEST__INIT;
  create.name = "mlp@7";
  create.nodes = 1;
  create.ranks_per_node = 1;
  len = zerod__v1__create_job_request__pack(&create, buf);
  assert_int_not_equal(ctl_decode(CTL_CREATE_JOB, buf, len, &msg, err, sizeof err), 0);
  assert_null(msg);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_checkpoint_dir_names),
      cmocka_unit_test(test_checkpoint_refs),
      cmocka_unit_test(test_requests_take_deleted_job_directories),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
