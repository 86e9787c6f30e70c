/* Versions and pins (daemon/rank/pin.c) without executors.
 *
 * A job from job_create with one or two ranks whose host devices and shards
 * the test sets up by hand: one unit, published with job_publish_unit, each
 * rank holding its slice of the working copy (fp32, so the working copy is
 * the master). The test thread plays the executors' part, rewriting a
 * rank's slice between pin_begin_write and pin_end_write as a step does, and
 * reads with pin_read_unit as a read-only session's worker does; a second
 * thread plays the other side where a read must wait (a rank catching up,
 * the job failing, the daemon stopping).
 *
 * Element k of the unit holds version * 1000 + k at a given version, so
 * every read says which version each rank's slice came from. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "test_clock.h"

#include "config.h"
#include "device.h"
#include "exec.h"
#include "job.h"
#include "layout.h"
#include "pin.h"

#define MAX_RANKS  2
#define UNIT_NUMEL 40 /* padded to 48 (one rank) or 64 (two ranks) */
#define LONG_MS    10000

typedef struct fixture {
  int world;
  exec_settings exec; /* never used: no executor runs */
  job *j;
  unit_layout *l; /* the job's */
} fixture;

static float value_at(uint64_t version, uint64_t k) {
  return (float)(version * 1000 + k);
}

/* Writes the values of `version` into rank rs's working slice. */
static void fill_slice(rank_state *rs, const unit_layout *l, uint64_t version) {
  float *w = rs->shards[l->id].working;
  uint64_t lo = (uint64_t)rs->rank * l->shard_numel;
  for (uint64_t i = 0; i < l->shard_numel; i++)
    w[i] = value_at(version, lo + i);
}

/* What an executor's step does to the working copies: the version goes up
 * and the slice is rewritten under the rank's write lock. */
static void rank_write(fixture *fx, int r) {
  rank_state *rs = &fx->j->ranks[r];
  uint64_t before = rs->version;
  pin_begin_write(rs);
  assert_int_equal(rs->version, before + 1);
  fill_slice(rs, fx->l, rs->version);
  pin_end_write(rs);
}

static fixture *fixture_open(int world) {
  fixture *fx = calloc(1, sizeof *fx);
  assert_non_null(fx);
  fx->world = world;
  job_config config;
  memset(&config, 0, sizeof config);
  config.optimizer = JOB_SGD;
  config.lr = 0.1;
  config.working_dtype = ZK_F32;
  assert_int_equal(job_create(&fx->exec, NULL, "pintest", "", &config, world, world, 0, 1, &fx->j),
                   0);
  const char *names[1] = {"w"};
  const uint64_t shape[1] = {UNIT_NUMEL};
  const uint64_t *shapes[1] = {shape};
  unsigned ndims[1] = {1};
  int frozen[1] = {0};
  unit_layout *mine = NULL;
  char err[256] = "";
  if (unit_layout_build("u", 1, names, shapes, ndims, frozen, world, 0, &mine, err, sizeof err) !=
      0)
    fail_msg("unit_layout_build: %s", err);
  int existed = 0, conflict = 0;
  fx->l = job_publish_unit(fx->j, mine, &existed, &conflict);
  assert_non_null(fx->l);
  assert_int_equal(fx->l->id, 0);
  /* Each rank: a host device and its shard of the unit, at version 0. */
  for (int r = 0; r < world; r++) {
    rank_state *rs = &fx->j->ranks[r];
    assert_int_equal(zk_pool_create(1, &rs->pool), 0);
    assert_int_equal(device_host_open(rs->pool, &rs->dev), 0);
    rs->shards = calloc(1, sizeof *rs->shards);
    assert_non_null(rs->shards);
    rs->nshards = 1;
    shard *sh = &rs->shards[0];
    void *master = NULL;
    assert_int_equal(device_alloc(rs->dev, fx->l->shard_numel * sizeof(float), &master), 0);
    sh->master = master;
    sh->working = master;
    sh->gather_buf = sh->grad_buf = -1;
    sh->present = 1;
    fill_slice(rs, fx->l, 0);
    atomic_fetch_add(&fx->l->ready_ranks, 1);
  }
  return fx;
}

static void fixture_close(fixture *fx) {
  if (fx == NULL)
    return;
  for (int r = 0; r < fx->world; r++) {
    rank_state *rs = &fx->j->ranks[r];
    if (rs->shards != NULL)
      device_free(rs->dev, rs->shards[0].master);
    free(rs->shards);
    rs->shards = NULL;
    device_close(rs->dev);
    rs->dev = NULL;
    zk_pool_destroy(rs->pool);
    rs->pool = NULL;
  }
  pin_job_clear(fx->j);
  job_destroy(fx->j);
  free(fx);
}

static int setup_world1(void **state) {
  *state = fixture_open(1);
  return 0;
}

static int setup_world2(void **state) {
  *state = fixture_open(2);
  return 0;
}

static int teardown_fixture(void **state) {
  fixture_close(*state);
  *state = NULL;
  return 0;
}

/* Reads the unit (at pin's version, or the latest with pin NULL) and
 * returns the status; on success checks that every rank's slice holds
 * want_version's values and that the served version is it. */
static int read_unit(fixture *fx, job_pin *pin, int timeout_ms, uint64_t want_version, char *err,
                     size_t err_bytes) {
  float got[64];
  assert_true(fx->l->padded_numel <= 64);
  memset(got, 0xff, sizeof got);
  pin_read_control control = {.generation = 0, .cancel = NULL, .timeout_ms = timeout_ms};
  uint64_t served = UINT64_MAX;
  int status = pin_read_unit(fx->j, pin, fx->l, got, UINT64_MAX, &control, &served, err, err_bytes);
  if (status != 0)
    return status;
  if (served != want_version)
    fail_msg("pin_read_unit served version %llu, expected %llu", (unsigned long long)served,
             (unsigned long long)want_version);
  for (uint64_t k = 0; k < fx->l->padded_numel; k++)
    if (got[k] != value_at(want_version, k))
      fail_msg("%s read, element %llu: %g, expected %g (version %llu's value)",
               pin != NULL ? "pinned" : "latest", (unsigned long long)k, (double)got[k],
               (double)value_at(want_version, k), (unsigned long long)want_version);
  return 0;
}

static void expect_read_ok(fixture *fx, job_pin *pin, uint64_t want_version, const char *what) {
  char err[512] = "";
  int status = read_unit(fx, pin, LONG_MS, want_version, err, sizeof err);
  if (status != 0)
    fail_msg("%s: pin_read_unit returned status %d (%s), expected 0", what, status, err);
}

/* ---- Versions ------------------------------------------------------------------ */

static void test_begin_end_write_moves_the_version_up(void **state) {
  fixture *fx = *state;
  assert_int_equal(pin_latest_version(fx->j), 0);
  rank_write(fx, 0);
  assert_int_equal(fx->j->ranks[0].version, 1);
  assert_int_equal(pin_latest_version(fx->j), 1);
  if (fx->world == 2) {
    /* The latest version is the highest any rank reached. */
    assert_int_equal(fx->j->ranks[1].version, 0);
    rank_write(fx, 1);
    assert_int_equal(fx->j->ranks[1].version, 1);
    assert_int_equal(pin_latest_version(fx->j), 1);
  }
  for (int r = 0; r < fx->world; r++)
    rank_write(fx, r);
  assert_int_equal(pin_latest_version(fx->j), 2);
  /* No pin existed: nothing was copied. */
  assert_null(fx->j->pins);
  expect_read_ok(fx, NULL, 2, "latest read after two writes");
}

/* ---- Pins ------------------------------------------------------------------------ */

static void test_acquire_latest_shares_one_pin_per_version(void **state) {
  fixture *fx = *state;
  job_pin *a = pin_acquire_latest(fx->j, 0, NULL);
  job_pin *b = pin_acquire_latest(fx->j, 0, NULL);
  assert_non_null(a);
  if (a != b)
    fail_msg("two pins of version 0 should be one shared pin");
  assert_int_equal(a->version, 0);
  assert_int_equal(a->refs, 2);
  for (int r = 0; r < fx->world; r++)
    rank_write(fx, r);
  job_pin *c = pin_acquire_latest(fx->j, 0, NULL);
  assert_non_null(c);
  if (c == a)
    fail_msg("a pin after the ranks moved to version 1 must be a new pin, not version 0's");
  assert_int_equal(c->version, 1);
  assert_int_equal(c->refs, 1);
  assert_int_equal(a->refs, 2);
  pin_release(fx->j, a);
  pin_release(fx->j, b);
  pin_release(fx->j, c);
  assert_null(fx->j->pins);
}

static void test_acquire_latest_keeps_within_the_cap(void **state) {
  fixture *fx = *state;
  int over = -1;
  job_pin *a = pin_acquire_latest(fx->j, 1, &over);
  assert_non_null(a);
  assert_int_equal(over, 0);
  for (int r = 0; r < fx->world; r++)
    rank_write(fx, r);
  /* Version 1 would be a second pinned version: refused, nothing made. */
  assert_null(pin_acquire_latest(fx->j, 1, &over));
  assert_int_equal(over, 1);
  assert_ptr_equal(fx->j->pins, a);
  assert_null(a->next);
  /* A cap with room: taken; sharing an existing pin never counts. */
  job_pin *b = pin_acquire_latest(fx->j, 2, &over);
  assert_non_null(b);
  assert_int_equal(over, 0);
  job_pin *c = pin_acquire_latest(fx->j, 2, &over);
  assert_ptr_equal(b, c);
  pin_release(fx->j, a);
  pin_release(fx->j, b);
  pin_release(fx->j, c);
  assert_null(fx->j->pins);
}

static void test_release_frees_the_pin(void **state) {
  fixture *fx = *state;
  job_pin *a = pin_acquire_latest(fx->j, 0, NULL);
  job_pin *b = pin_acquire_latest(fx->j, 0, NULL);
  assert_ptr_equal(fx->j->pins, a);
  pin_release(fx->j, a);
  /* One holder left: the pin stays listed. */
  assert_ptr_equal(fx->j->pins, b);
  assert_int_equal(b->refs, 1);
  /* A snapshot taken for it is freed with it (ASan's leak check). */
  rank_write(fx, 0);
  assert_true(b->saved[0]);
  pin_release(fx->j, b);
  assert_null(fx->j->pins);
  pin_release(fx->j, NULL); /* accepted */
}

/* Copy on write: rank r's values at the pinned version are copied into the
 * pin when r first writes past it; the pin reads them, an unpinned read
 * the new ones. */
static void test_pin_keeps_old_values_after_a_write(void **state) {
  fixture *fx = *state;
  job_pin *pin = pin_acquire_latest(fx->j, 0, NULL);
  assert_non_null(pin);
  for (int r = 0; r < fx->world; r++)
    assert_false(pin->saved[r]);
  /* Nothing written yet: the pin reads the live slices. */
  expect_read_ok(fx, pin, 0, "pinned read before any write");

  for (int r = 0; r < fx->world; r++)
    rank_write(fx, r);
  for (int r = 0; r < fx->world; r++) {
    if (!pin->saved[r])
      fail_msg("rank %d wrote past the pinned version without saving its slice", r);
    assert_non_null(pin->snapshots[r].working[0]);
  }
  expect_read_ok(fx, pin, 0, "pinned read after the ranks wrote version 1");
  expect_read_ok(fx, NULL, 1, "latest read after the ranks wrote version 1");

  /* A second write does not touch the pin again. */
  void *snap0 = pin->snapshots[0].working[0];
  for (int r = 0; r < fx->world; r++)
    rank_write(fx, r);
  assert_ptr_equal(pin->snapshots[0].working[0], snap0);
  expect_read_ok(fx, pin, 0, "pinned read after version 2");
  expect_read_ok(fx, NULL, 2, "latest read after version 2");
  pin_release(fx->j, pin);
}

/* have_version: the reader already holds the pinned version, no copy. */
static void test_read_at_have_version_copies_nothing(void **state) {
  fixture *fx = *state;
  job_pin *pin = pin_acquire_latest(fx->j, 0, NULL);
  float dst[64];
  memset(dst, 0x5a, sizeof dst);
  pin_read_control control = {.timeout_ms = 100};
  uint64_t served = 77;
  char err[256] = "";
  assert_int_equal(pin_read_unit(fx->j, pin, fx->l, dst, 0, &control, &served, err, sizeof err), 0);
  assert_int_equal(served, 0);
  for (size_t i = 0; i < sizeof dst; i++)
    if (((unsigned char *)dst)[i] != 0x5a)
      fail_msg("byte %zu of dst was written although the reader had the version", i);
  pin_release(fx->j, pin);
}

/* A delta read of the unit into dst; returns its bitmap (the unit fits
 * in block 0: bit 0). */
static uint8_t delta_read(fixture *fx, job_pin *pin, float *dst) {
  uint8_t changed[1] = {0};
  assert_int_equal(pin_delta_bitmap_bytes(fx->l->padded_numel * sizeof(float)), 1);
  pin_read_control control = {.timeout_ms = 100, .changed = changed};
  uint64_t served;
  char err[256] = "";
  int status =
      pin_read_unit(fx->j, pin, fx->l, dst, UINT64_MAX, &control, &served, err, sizeof err);
  if (status != 0)
    fail_msg("delta read: status %d (%s)", status, err);
  return changed[0];
}

static void expect_values(fixture *fx, const float *dst, uint64_t version) {
  for (uint64_t k = 0; k < fx->l->padded_numel; k++)
    if (dst[k] != value_at(version, k))
      fail_msg("element %llu: %g, expected version %llu's %g", (unsigned long long)k,
               (double)dst[k], (unsigned long long)version, (double)value_at(version, k));
}

/* A delta read marks a block whose values differ from dst's and writes it;
 * one that matches is neither marked nor written, from live slices and
 * from a pin's snapshots alike. */
static void test_delta_read_marks_changed_blocks_only(void **state) {
  fixture *fx = *state;
  float dst[64];
  memset(dst, 0, sizeof dst);
  assert_int_equal(delta_read(fx, NULL, dst), 1); /* zeros -> version 0 */
  expect_values(fx, dst, 0);
  assert_int_equal(delta_read(fx, NULL, dst), 0); /* the same values: nothing */
  expect_values(fx, dst, 0);

  job_pin *pin = pin_acquire_latest(fx->j, 0, NULL);
  for (int r = 0; r < fx->world; r++)
    rank_write(fx, r);
  assert_true(pin->saved[0]);
  assert_int_equal(delta_read(fx, pin, dst), 0); /* the snapshot holds version 0 */
  expect_values(fx, dst, 0);
  assert_int_equal(delta_read(fx, NULL, dst), 1); /* live: version 1 */
  expect_values(fx, dst, 1);
  /* Only the last element differs: the block is written again. */
  dst[fx->l->padded_numel - 1] = -1.0f;
  assert_int_equal(delta_read(fx, NULL, dst), 1);
  expect_values(fx, dst, 1);
  pin_release(fx->j, pin);
}

/* ---- Waiting for a lagging rank ------------------------------------------------ */

static void test_read_times_out_unavailable_for_a_lagging_rank(void **state) {
  fixture *fx = *state;
  assert_int_equal(fx->world, 2);
  /* Rank 0 has written version 1; rank 1, between the collective and its
   * write, is still at version 0. */
  rank_write(fx, 0);
  char err[512] = "";
  double t0 = now_ms();
  int status = read_unit(fx, NULL, 150, 1, err, sizeof err);
  double waited = now_ms() - t0;
  if (status != ZEROD__V1__STATUS__STATUS_UNAVAILABLE)
    fail_msg("latest read with rank 1 lagging: status %d (%s), expected UNAVAILABLE", status, err);
  if (strstr(err, "rank 1") == NULL)
    fail_msg("the timeout message \"%s\" should name the lagging rank 1", err);
  if (waited < 140 || waited > 5000)
    fail_msg("the read should give up after its 150 ms timeout, took %.0f ms", waited);

  /* A pin of the latest version (1) waits for rank 1 the same way. */
  job_pin *pin = pin_acquire_latest(fx->j, 0, NULL);
  assert_int_equal(pin->version, 1);
  t0 = now_ms();
  status = read_unit(fx, pin, 150, 1, err, sizeof err);
  waited = now_ms() - t0;
  if (status != ZEROD__V1__STATUS__STATUS_UNAVAILABLE)
    fail_msg("pinned read with rank 1 lagging: status %d (%s), expected UNAVAILABLE", status, err);
  if (waited < 140 || waited > 5000)
    fail_msg("the pinned read should give up after 150 ms, took %.0f ms", waited);

  /* Once rank 1 catches up both reads succeed. */
  rank_write(fx, 1);
  expect_read_ok(fx, pin, 1, "pinned read once rank 1 caught up");
  expect_read_ok(fx, NULL, 1, "latest read once rank 1 caught up");
  pin_release(fx->j, pin);
}

typedef enum late_event { LATE_WRITE, LATE_FAIL, LATE_STOP } late_event;

typedef struct late_ctx {
  fixture *fx;
  late_event event;
  int delay_ms;
} late_ctx;

static void *late_main(void *arg) {
  late_ctx *c = arg;
  sleep_ms(c->delay_ms);
  switch (c->event) {
  case LATE_WRITE: {
    rank_state *rs = &c->fx->j->ranks[1];
    pin_begin_write(rs);
    fill_slice(rs, c->fx->l, rs->version);
    pin_end_write(rs);
    break;
  }
  case LATE_FAIL:
    job_fail(c->fx->j, 0, "rank 1: all_reduce timed out");
    break;
  case LATE_STOP:
    pin_job_stop(c->fx->j);
    break;
  }
  return NULL;
}

/* Rank 0 is at version 1, rank 1 at 0; a latest read (timeout LONG_MS)
 * runs while another thread does `event` after 100 ms. Returns the status
 * and the time the read took. */
static int read_during(fixture *fx, late_event event, char *err, size_t err_bytes,
                       double *took_ms) {
  rank_write(fx, 0);
  late_ctx c = {.fx = fx, .event = event, .delay_ms = 100};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, late_main, &c), 0);
  double t0 = now_ms();
  int status = read_unit(fx, NULL, LONG_MS, 1, err, err_bytes);
  *took_ms = now_ms() - t0;
  pthread_join(t, NULL);
  return status;
}

static void test_reader_waits_for_a_lagging_rank_to_catch_up(void **state) {
  fixture *fx = *state;
  char err[512] = "";
  double took;
  int status = read_during(fx, LATE_WRITE, err, sizeof err, &took);
  if (status != 0)
    fail_msg("the read should succeed once rank 1 wrote version 1: status %d (%s)", status, err);
  if (took < 90 || took > LONG_MS / 2)
    fail_msg("the read should have waited for rank 1's write (~100 ms), took %.0f ms", took);
}

static void test_read_aborted_when_the_job_fails_while_waiting(void **state) {
  fixture *fx = *state;
  char err[512] = "";
  double took;
  int status = read_during(fx, LATE_FAIL, err, sizeof err, &took);
  if (status != ZEROD__V1__STATUS__STATUS_ABORTED)
    fail_msg("a read waiting on a job that fails: status %d (%s), expected ABORTED", status, err);
  if (strstr(err, "all_reduce timed out") == NULL)
    fail_msg("the message \"%s\" should carry the job's failure reason", err);
  if (took > LONG_MS / 2)
    fail_msg("job_fail should wake the reader at once, the read took %.0f ms", took);
}

static void test_read_unavailable_when_the_daemon_stops_while_waiting(void **state) {
  fixture *fx = *state;
  char err[512] = "";
  double took;
  int status = read_during(fx, LATE_STOP, err, sizeof err, &took);
  if (status != ZEROD__V1__STATUS__STATUS_UNAVAILABLE)
    fail_msg("a read waiting when the daemon stops: status %d (%s), expected UNAVAILABLE", status,
             err);
  if (strstr(err, "shutting down") == NULL)
    fail_msg("the message \"%s\" should say zerod is shutting down", err);
  if (took > LONG_MS / 2)
    fail_msg("pin_job_stop should wake the reader at once, the read took %.0f ms", took);
}

#define PIN_TEST(fn, world)                                                                        \
  { #fn " [world " #world "]", fn, setup_world##world, teardown_fixture, NULL }

int main(void) {
  const struct CMUnitTest tests[] = {
      PIN_TEST(test_begin_end_write_moves_the_version_up, 1),
      PIN_TEST(test_begin_end_write_moves_the_version_up, 2),
      PIN_TEST(test_acquire_latest_shares_one_pin_per_version, 2),
      PIN_TEST(test_acquire_latest_keeps_within_the_cap, 2),
      PIN_TEST(test_release_frees_the_pin, 1),
      PIN_TEST(test_pin_keeps_old_values_after_a_write, 1),
      PIN_TEST(test_pin_keeps_old_values_after_a_write, 2),
      PIN_TEST(test_read_at_have_version_copies_nothing, 2),
      PIN_TEST(test_delta_read_marks_changed_blocks_only, 1),
      PIN_TEST(test_delta_read_marks_changed_blocks_only, 2),
      PIN_TEST(test_read_times_out_unavailable_for_a_lagging_rank, 2),
      PIN_TEST(test_reader_waits_for_a_lagging_rank_to_catch_up, 2),
      PIN_TEST(test_read_aborted_when_the_job_fails_while_waiting, 2),
      PIN_TEST(test_read_unavailable_when_the_daemon_stops_while_waiting, 2),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
