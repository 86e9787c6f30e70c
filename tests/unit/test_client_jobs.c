/* libzerod's jobs against a fake daemon (client/client.c; the fake is
 * client_fixtures.c's): an attach's mode and pin, the job's effective
 * config and the daemon's warning; the owner token from $ZEROD_TOKEN when
 * none is given; a read-only job refusing writes
 * without asking the daemon; the unit table from registrations and
 * listings, a listing checked like a registration; zd_pin moving a
 * read-only job to the latest version; zd_load_unit sending rank 0's
 * values in a memfd, and no values from other ranks. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "frame.h"
#include "zerod.h"

#include "client_fixtures.h"

/* ------------------------------------------------------------------------
 * Tests
 * ------------------------------------------------------------------------ */

/* The attach reply's config is the job's effective one, and its warning
 * (the attach's config was not used) reaches the worker; both stay after
 * detach. */
static void test_attach_keeps_the_jobs_config_and_the_daemons_warning(void **state) {
  static const char warning[] = "job 'test' exists with another config; this attach's was not "
                                "used: lr 0.001 (the job's 0.25)";
  fake_daemon *fake = fake_create();
  fake->attach_config = 1;
  fake->attach_warning = warning;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  assert_string_equal(zd_job_attach_warning(job), warning);
  zd_job_config config = ZD_JOB_CONFIG_INIT;
  assert_int_equal(zd_job_effective_config(job, &config), ZD_OK);
  assert_int_equal(config.struct_size, sizeof config);
  assert_int_equal(config.optimizer, ZD_SGD);
  assert_true(config.lr == 0.25 && config.momentum == 0.9 && config.nesterov == 1);
  assert_true(config.weight_decay == 0 && config.has_weight_decay == 1);
  assert_int_equal(config.working_dtype, ZD_BF16);
  assert_int_equal(config.max_live_bytes, 1 << 20);
  assert_true(config.max_grad_norm == 1.5);
  assert_int_equal(zd_detach(job), ZD_OK);
  assert_string_equal(zd_job_attach_warning(job), warning);

  /* An older caller's smaller struct gets the fields it has, no more; a
   * size outside what this library knows is refused. */
  zd_job_config older = ZD_JOB_CONFIG_INIT;
  older.struct_size = offsetof(zd_job_config, beta1);
  older.beta1 = 7;
  assert_int_equal(zd_job_effective_config(job, &older), ZD_OK);
  assert_true(older.lr == 0.25 && older.beta1 == 7);
  older.struct_size = 0;
  assert_int_equal(zd_job_effective_config(job, &older), ZD_E_INVALID_ARGUMENT);
  older.struct_size = sizeof older + 8;
  assert_int_equal(zd_job_effective_config(job, &older), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("ZD_JOB_CONFIG_INIT");
  assert_int_equal(zd_job_effective_config(NULL, &config), ZD_E_INVALID_ARGUMENT);
  assert_null(zd_job_attach_warning(NULL));
  zd_close(client);
  fake_join(fake);
  fake_destroy(fake);

  /* No warning: NULL. */
  fake = fake_create();
  fake_start(fake);
  client = connect_to(fake);
  job = attach_job(client);
  assert_null(zd_job_attach_warning(job));
  zd_close(client);
  fake_join(fake);
  fake_destroy(fake);
}

static void test_read_only_attach_sends_mode_and_pin(void **state) {
  fake_daemon *fake = fake_create();
  fake->latest_version = 9;
  fake->pinned_version = 5;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 1, 0);
  assert_int_equal(zd_job_read_only(job), 1);
  /* A pinned job reports the version it reads, not the latest. */
  assert_int_equal(zd_job_version(job), 5);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->attach_mode, ZEROD__V1__ATTACH_MODE__ATTACH_READ_ONLY);
  assert_true(fake->attach_pin);
  fake_destroy(fake);

  fake = fake_create();
  fake->latest_version = 9;
  fake_start(fake);
  client = connect_to(fake);
  job = attach_with(client, 1, 0, 0);
  assert_int_equal(zd_job_read_only(job), 1);
  assert_int_equal(zd_job_version(job), 9);
  zd_close(client);
  fake_join(fake);
  assert_false(fake->attach_pin);
  fake_destroy(fake);

  fake = fake_create();
  fake_start(fake);
  client = connect_to(fake);
  job = attach_job(client);
  assert_int_equal(zd_job_read_only(job), 0);
  assert_int_equal(zd_job_read_only(NULL), 0);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->attach_mode, ZEROD__V1__ATTACH_MODE__ATTACH_READ_WRITE);
  fake_destroy(fake);
}

static void test_watch_pins_the_answer_and_learns_new_units(void **state) {
  fake_daemon *fake = fake_create();
  fake->pinned_version = 5;
  fake->watch_version = 12;
  snprintf(fake->unit_names[0], sizeof fake->unit_names[0], "%s", "dense");
  snprintf(fake->unit_names[1], sizeof fake->unit_names[1], "%s", "late");
  fake->units_registered = 2; /* listed by UNITS; the attach lists none */
  fake->watch_changed[0] = 0;
  fake->watch_changed[1] = 1;
  fake->nwatch_changed = 2;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 1, 0);
  zd_update update = ZD_UPDATE_INIT;
  assert_int_equal(zd_watch(job, ZD_NO_VERSION, 250, &update), ZD_OK);
  assert_int_equal(update.version, 12);
  assert_false(update.timed_out);
  assert_int_equal(update.skipped, 2);
  assert_int_equal(update.step, 12);
  assert_int_equal(update.nchanged, 2);
  assert_int_equal(update.changed[0], 0);
  assert_int_equal(update.changed[1], 1);
  assert_int_equal(zd_job_version(job), 12); /* pinned at the answer */
  /* Units the library had not listed were listed (UNITS) and are known. */
  assert_int_equal(zd_job_unit_count(job), 2);
  zd_unit_info info = ZD_UNIT_INFO_INIT;
  assert_int_equal(zd_job_unit_info(job, 1, &info), ZD_OK);
  assert_string_equal(info.name, "late");

  /* A timeout changes nothing but the out struct. */
  fake->watch_timed_out = 1;
  update = (zd_update)ZD_UPDATE_INIT;
  assert_int_equal(zd_watch(job, 12, 0, &update), ZD_OK);
  assert_true(update.timed_out);
  assert_int_equal(update.version, 12);
  assert_int_equal(update.nchanged, 0);
  assert_int_equal(zd_job_version(job), 12);

  /* Refused before a request. */
  assert_int_equal(zd_watch(job, 12, -1, &update), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("timeout_ms");
  assert_int_equal(zd_watch(job, 12, 24 * 3600 * 1000 + 1, &update), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_watch(job, 12, 0, NULL), ZD_E_INVALID_ARGUMENT);
  zd_update unsized = {0};
  assert_int_equal(zd_watch(job, 12, 0, &unsized), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("ZD_UPDATE_INIT");
  assert_int_equal(zd_watch(NULL, 12, 0, &update), ZD_E_INVALID_ARGUMENT);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_WATCH], 2);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_UNITS], 1);
  assert_int_equal(fake->watch_after, 12);
  assert_int_equal(fake->watch_timeout_ms, 0);
  fake_destroy(fake);

  /* A read-write job does not watch: refused locally. */
  fake = fake_create();
  fake_start(fake);
  client = connect_to(fake);
  job = attach_job(client);
  assert_int_equal(zd_watch(job, 0, 0, &update), ZD_E_FAILED_PRECONDITION);
  assert_message_contains("read-only");
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_WATCH], 0);
  fake_destroy(fake);
}

/* Attaches to job "test" with token (NULL: none given) through a fresh
 * fake; returns the token the fake received in *sent. */
static void attach_sending(const char *token, char *sent, size_t sent_bytes) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "test";
  options.token = token;
  zd_job *job = NULL;
  assert_int_equal(zd_attach(client, &options, &job), ZD_OK);
  zd_close(client);
  fake_join(fake);
  snprintf(sent, sent_bytes, "%s", fake->attach_token);
  fake_destroy(fake);
}

/* No token given (NULL): $ZEROD_TOKEN is sent, as Kubernetes hands a
 * worker its job's token; a given token wins, "" included (none). */
static void test_attach_takes_the_token_from_zerod_token(void **state) {
  (void)state;
  char sent[64];
  setenv("ZEROD_TOKEN", "from-env", 1);
  attach_sending(NULL, sent, sizeof sent);
  assert_string_equal(sent, "from-env");
  attach_sending("given", sent, sizeof sent);
  assert_string_equal(sent, "given");
  attach_sending("", sent, sizeof sent);
  assert_string_equal(sent, "");
  unsetenv("ZEROD_TOKEN");
  attach_sending(NULL, sent, sizeof sent);
  assert_string_equal(sent, "");
  /* One too long in the environment is refused, saying where it came from. */
  char long_token[ZD_MAX_TOKEN_BYTES + 2];
  memset(long_token, 't', sizeof long_token - 1);
  long_token[sizeof long_token - 1] = '\0';
  setenv("ZEROD_TOKEN", long_token, 1);
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "test";
  zd_job *job = NULL;
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("ZEROD_TOKEN");
  unsetenv("ZEROD_TOKEN");
  zd_close(client);
  fake_destroy(fake);
}

static void test_attach_reply_with_the_other_mode_is_a_protocol_error(void **state) {
  fake_daemon *fake = fake_create();
  fake->attach_read_only_lie = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "test";
  options.read_only = 1;
  zd_job *job = NULL;
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_PROTOCOL);
  assert_null(job);
  assert_message_contains("asked for a read-only attachment, the reply says read-write");
  zd_close(client);
  fake_destroy(fake);
}

static void test_read_only_job_refuses_writes_without_asking(void **state) {
  fake_daemon *fake = fake_create();
  fake->units_registered = 1;
  snprintf(fake->unit_names[0], sizeof fake->unit_names[0], "embed");
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 0, 0);
  assert_int_equal(zd_list_units(job, NULL), ZD_OK);

  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "layer9";
  desc.tensors = unit_tensors;
  desc.ntensors = 2;
  desc.init = ZD_INIT_ZEROS;
  zd_unit unit;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_PERMISSION_DENIED);
  assert_message_contains("register unit layer9: job test is attached read-only");
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_grad_buffer(job, 0, &view), ZD_E_PERMISSION_DENIED);
  assert_message_contains("grad buffer unit 0: job test is attached read-only");
  assert_int_equal(zd_reduce(job, 0), ZD_E_PERMISSION_DENIED);
  assert_message_contains("reduce unit 0");
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_PERMISSION_DENIED);
  assert_message_contains("step: job test is attached read-only");
  float values[18] = {0};
  assert_int_equal(zd_load_unit(job, 0, values, NULL), ZD_E_PERMISSION_DENIED);
  assert_message_contains("load unit 0");

  /* Reading still works, through a read-only mapping. */
  gather_ok(job, 0, &view);
  assert_true(first_weight(&view) == 1000.0f);
  assert_string_equal(perms_at(view.base, fake, "gather-0"), "r--s");
  assert_int_equal(zd_release(job, 0), ZD_OK);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT], 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER], 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_REDUCE], 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_STEP], 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT], 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_GATHER], 1);
  fake_destroy(fake);
}

static void test_list_units_builds_the_unit_table(void **state) {
  fake_daemon *fake = fake_create();
  fake->units_registered = 2;
  fake->latest_version = 11;
  snprintf(fake->unit_names[0], sizeof fake->unit_names[0], "embed");
  snprintf(fake->unit_names[1], sizeof fake->unit_names[1], "block0");
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 0, 0);
  assert_int_equal(zd_job_unit_count(job), 0);
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, 1, &view), ZD_E_NOT_FOUND);
  assert_message_contains("no such unit known to this job");

  unsigned count = 0;
  assert_int_equal(zd_list_units(job, &count), ZD_OK);
  assert_int_equal(count, 2);
  assert_int_equal(zd_job_unit_count(job), 2);
  assert_int_equal(zd_job_version(job), 11);
  zd_unit_info info = ZD_UNIT_INFO_INIT;
  assert_int_equal(zd_job_unit_info(job, 0, &info), ZD_OK);
  assert_int_equal(info.unit, 0);
  assert_string_equal(info.name, "embed");
  assert_int_equal(zd_job_unit_info(job, 1, &info), ZD_OK);
  assert_int_equal(info.unit, 1);
  assert_string_equal(info.name, "block0");
  assert_int_equal(info.ntensors, 2);
  assert_int_equal(info.numel, UNIT_NUMEL);
  assert_int_equal(info.padded_numel, UNIT_PADDED_NUMEL);
  assert_int_equal(info.dtype, ZD_F32);
  assert_string_equal(info.tensors[0].name, "w");
  assert_int_equal(info.tensors[0].ndim, 2);
  assert_int_equal(info.tensors[0].shape[1], 5);
  assert_int_equal(info.tensors[0].offset, 0);
  assert_string_equal(info.tensors[1].name, "b");
  assert_int_equal(info.tensors[1].offset, BIAS_OFFSET);
  assert_int_equal(info.tensors[1].numel, 3);
  assert_null(info.tensors[0].data);
  assert_null(info.tensors[1].data);
  assert_int_equal(zd_job_unit_info(job, 2, &info), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("index 2 is past the 2 units");
  assert_int_equal(zd_job_unit_info(job, 0, NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_job_unit_info(NULL, 0, &info), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_job_unit_count(NULL), 0);

  /* A listed unit gathers like a registered one, and the layout's data
   * pointers stay NULL while the view's point into the buffer. */
  gather_ok(job, 1, &view);
  assert_true(first_weight(&view) == 2000.0f);
  assert_true(((const float *)view.tensors[1].data)[0] == 2000.0f + BIAS_OFFSET);
  assert_int_equal(zd_job_unit_info(job, 1, &info), ZD_OK);
  assert_null(info.tensors[1].data);
  assert_int_equal(zd_release(job, 1), ZD_OK);

  /* Listing again keeps the entries (views point into their tables). */
  const zd_tensor_view *tensors_before = view.tensors;
  assert_int_equal(zd_list_units(job, &count), ZD_OK);
  assert_int_equal(count, 2);
  gather_ok(job, 1, &view);
  assert_ptr_equal(view.tensors, tensors_before);
  zd_close(client);
  fake_destroy(fake);
}

static void test_registered_units_are_in_the_unit_table(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  register_unit(job, "layer0");
  register_unit(job, "layer1");
  assert_int_equal(zd_job_unit_count(job), 2);
  zd_unit_info info = ZD_UNIT_INFO_INIT;
  assert_int_equal(zd_job_unit_info(job, 1, &info), ZD_OK);
  assert_int_equal(info.unit, 1);
  assert_string_equal(info.name, "layer1");
  assert_int_equal(info.tensors[1].offset, BIAS_OFFSET);
  assert_int_equal(info.padded_numel, UNIT_PADDED_NUMEL);
  /* A read-write job may list too: the listing agrees, nothing is added. */
  unsigned count = 0;
  assert_int_equal(zd_list_units(job, &count), ZD_OK);
  assert_int_equal(count, 2);
  assert_int_equal(zd_job_unit_info(job, 0, &info), ZD_OK);
  assert_string_equal(info.name, "layer0");
  zd_close(client);
  fake_destroy(fake);
}

static void test_listing_is_checked_like_a_registration(void **state) {
  /* frame.c checks placements of a RegisterUnitReply, not of the units
   * nested in a UnitsReply: the client must. */
  fake_daemon *fake = fake_create();
  fake->units_registered = 1;
  fake->list_bad_placement = 1;
  snprintf(fake->unit_names[0], sizeof fake->unit_names[0], "embed");
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 0, 0);
  assert_int_equal(zd_list_units(job, NULL), ZD_E_PROTOCOL);
  assert_message_contains("unit 0 in the listing: tensor placement lies outside the unit");
  assert_int_equal(zd_job_unit_count(job), 0);
  zd_close(client);
  fake_destroy(fake);

  /* A listing that contradicts a unit the job registered. */
  fake = fake_create();
  fake_start(fake);
  client = connect_to(fake);
  job = attach_job(client);
  register_unit(job, "layer0");
  fake->list_other_layout = 1;
  assert_int_equal(zd_list_units(job, NULL), ZD_E_PROTOCOL);
  assert_message_contains("its layout differs from the unit this job knows");
  zd_close(client);
  fake_destroy(fake);
}

static void test_pin_moves_a_read_only_job_to_the_latest_version(void **state) {
  fake_daemon *fake = fake_create();
  fake->latest_version = 8;
  fake->pinned_version = 5;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 1, 0);
  assert_int_equal(zd_job_version(job), 5);
  uint64_t version = 0;
  assert_int_equal(zd_pin(job, &version), ZD_OK);
  assert_int_equal(version, 8);
  assert_int_equal(zd_job_version(job), 8);
  /* The listing reports the latest version; a pinned job keeps its own. */
  fake->latest_version = 12;
  assert_int_equal(zd_list_units(job, NULL), ZD_OK);
  assert_int_equal(zd_job_version(job), 8);
  assert_int_equal(zd_pin(job, NULL), ZD_OK);
  assert_int_equal(zd_job_version(job), 12);
  assert_int_equal(zd_pin(NULL, NULL), ZD_E_INVALID_ARGUMENT);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_PIN], 2);
  fake_destroy(fake);

  /* An unpinned read-only job is pinned from its first zd_pin on. */
  fake = fake_create();
  fake->latest_version = 4;
  fake_start(fake);
  client = connect_to(fake);
  job = attach_with(client, 1, 0, 0);
  assert_int_equal(zd_pin(job, &version), ZD_OK);
  assert_int_equal(version, 4);
  fake->latest_version = 6;
  assert_int_equal(zd_list_units(job, NULL), ZD_OK);
  assert_int_equal(zd_job_version(job), 4);
  zd_close(client);
  fake_destroy(fake);

  /* A read-write job follows its own steps: refused locally. */
  fake = fake_create();
  fake_start(fake);
  client = connect_to(fake);
  job = attach_job(client);
  assert_int_equal(zd_pin(job, &version), ZD_E_FAILED_PRECONDITION);
  assert_message_contains("pin job test: only read-only jobs pin a version");
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_PIN], 0);
  fake_destroy(fake);
}

static void test_load_unit_sends_rank0_values_in_a_memfd(void **state) {
  fake_daemon *fake = fake_create();
  fake->latest_version = 3;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  register_unit(job, "layer0");
  zd_unit unit = register_unit(job, "layer1");
  /* Rank 0 must give the values. */
  assert_int_equal(zd_load_unit(job, unit, NULL, NULL), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("load unit 1: rank 0 must pass the unit's values");
  assert_int_equal(zd_load_unit(job, 42, NULL, NULL), ZD_E_NOT_FOUND);
  assert_int_equal(zd_load_unit(NULL, unit, NULL, NULL), ZD_E_INVALID_ARGUMENT);
  float values[18];
  for (int i = 0; i < 18; i++)
    values[i] = 100.0f + (float)i;
  uint64_t version = 0;
  assert_int_equal(zd_load_unit(job, unit, values, &version), ZD_OK);
  assert_int_equal(version, 4);
  assert_int_equal(zd_job_version(job), 4);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT], 1);
  assert_int_equal(fake->load_fd_count, 1);
  assert_true(fake->load_values_match);
  assert_int_equal(fake->load_unit, 1);
  fake_destroy(fake);
}

static void test_load_unit_on_other_ranks_sends_no_values(void **state) {
  fake_daemon *fake = fake_create();
  fake->latest_version = 3;
  fake->attach_rank = 1;
  fake->attach_world_size = 2;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  assert_int_equal(zd_job_rank(job), 1);
  zd_unit unit = register_unit(job, "layer0");
  uint64_t version = 0;
  assert_int_equal(zd_load_unit(job, unit, NULL, &version), ZD_OK);
  assert_int_equal(version, 4);
  /* Values given on another rank are ignored, not sent. */
  float values[18] = {0};
  assert_int_equal(zd_load_unit(job, unit, values, NULL), ZD_OK);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->init_fd_count, 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT], 2);
  assert_int_equal(fake->load_fd_count, 0);
  fake_destroy(fake);
}

int main(void) {
  signal(SIGPIPE, on_sigpipe);
  /* No test here may depend on whether this machine has a GPU. */
  setenv("ZEROD_CUDA_MODULE", "/nonexistent/libzerod_cuda.so", 1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_read_only_attach_sends_mode_and_pin),
      cmocka_unit_test(test_watch_pins_the_answer_and_learns_new_units),
      cmocka_unit_test(test_attach_keeps_the_jobs_config_and_the_daemons_warning),
      cmocka_unit_test(test_attach_reply_with_the_other_mode_is_a_protocol_error),
      cmocka_unit_test(test_attach_takes_the_token_from_zerod_token),
      cmocka_unit_test(test_read_only_job_refuses_writes_without_asking),
      cmocka_unit_test(test_list_units_builds_the_unit_table),
      cmocka_unit_test(test_registered_units_are_in_the_unit_table),
      cmocka_unit_test(test_listing_is_checked_like_a_registration),
      cmocka_unit_test(test_pin_moves_a_read_only_job_to_the_latest_version),
      cmocka_unit_test(test_load_unit_sends_rank0_values_in_a_memfd),
      cmocka_unit_test(test_load_unit_on_other_ranks_sends_no_values),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
