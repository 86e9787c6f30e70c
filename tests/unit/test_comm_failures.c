/* How the communicators fail (comm.h), on every backend: a rendezvous
 * that times out or whose store stops, bad options and arguments, a peer
 * that stops calling, a late rank after its peer timed out, and abort
 * ending a collective that waits for a silent peer; Gloo's rendezvous
 * keys removed once every rank has connected. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "test_clock.h"

#include "comm.h"
#include "comm_fixtures.h"
#include "store.h"

/* ---- failures --------------------------------------------------------------- */

static void test_create_times_out_when_a_rank_is_missing(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm_options options = {.prefix = "test/lonely", .rank = 0, .world_size = 2, .timeout_ms = 500};
  comm *c = NULL;
  char err[256] = "";
  double started_ms = now_ms();
  int rc = comm_gloo_create(&options, st, &c, err, sizeof err);
  double took_ms = now_ms() - started_ms;
  assert_int_equal(rc, -ETIMEDOUT);
  assert_null(c);
  if (took_ms < 450 || took_ms > 3000)
    fail_msg("create should give up after about 500 ms, took %.0f ms", took_ms);
  if (strstr(err, "rendezvous: timed out after 500 ms waiting for rank 1") == NULL)
    fail_msg("the error should name the missing rank, got \"%s\"", err);
  st->ops->destroy(st);
}

static void test_create_rejects_bad_options(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm *c = NULL;
  char err[256] = "";
  comm_options options = {.prefix = "test/bad", .rank = 2, .world_size = 2, .timeout_ms = 500};
  assert_int_equal(comm_gloo_create(&options, st, &c, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, "rank 2"));
  options.rank = 0;
  options.timeout_ms = 0;
  assert_int_equal(comm_gloo_create(&options, st, &c, err, sizeof err), -EINVAL);
  options.timeout_ms = 500;
  options.prefix = "";
  assert_int_equal(comm_gloo_create(&options, st, &c, err, sizeof err), -EINVAL);
  assert_null(c);
  st->ops->destroy(st);
}

static void test_create_removes_its_rendezvous_keys(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  atomic_int arrived = 0;
  run_world_in(st, 2, DEFAULT_TIMEOUT_MS, barrier_body, &arrived);
  /* Gloo's keys are "<r>" (pair addresses) and "rank_<r>" (host names). */
  const char *keys[] = {"test/job/1/epoch/0/0", "test/job/1/epoch/0/1", "test/job/1/epoch/0/rank_0",
                        "test/job/1/epoch/0/rank_1"};
  for (size_t i = 0; i < 4; i++) {
    void *value = NULL;
    size_t value_bytes = 0;
    int rc = st->ops->get(st, keys[i], &value, &value_bytes, 0);
    free(value);
    if (rc != -ETIMEDOUT)
      fail_msg("key \"%s\" should be gone once every rank has connected (get returned %d)", keys[i],
               rc);
  }
  st->ops->destroy(st);
}

/* Rank 1 creates its communicator and then stops calling (its thread
 * returns, its communicator stays open, like a stuck process). */
typedef struct stall_state {
  atomic_int rank0_failed;
  int first_rc, second_rc, late_rc;
  double first_ms, second_ms, late_ms, destroy_ms;
  char first_error[256];
  bool late_rank_calls; /* rank 1 calls once rank 0 has failed */
} stall_state;

static void stall_body(rank_ctx *rc) {
  stall_state *ss = rc->run->user;
  uint8_t gathered[2 * 64];
  if (rc->rank == 1) {
    if (!ss->late_rank_calls) {
      rc->keep_comm = true;
      return;
    }
    while (atomic_load(&ss->rank0_failed) == 0)
      sleep_ms(1);
    double started_ms = now_ms();
    ss->late_rc = comm_all_gather(rc->c, gathered + 64, gathered, 64);
    ss->late_ms = now_ms() - started_ms;
    return;
  }
  double started_ms = now_ms();
  ss->first_rc = comm_all_gather(rc->c, gathered, gathered, 64);
  ss->first_ms = now_ms() - started_ms;
  snprintf(ss->first_error, sizeof ss->first_error, "%s", comm_last_error(rc->c));
  started_ms = now_ms();
  ss->second_rc = comm_barrier(rc->c);
  ss->second_ms = now_ms() - started_ms;
  atomic_store(&ss->rank0_failed, 1);
  started_ms = now_ms();
  comm_destroy(rc->c);
  rc->c = NULL;
  ss->destroy_ms = now_ms() - started_ms;
}

static void test_all_gather_times_out_when_a_peer_stops_calling(void **state) {
  stall_state ss = {0};
  run_world(2, 500, stall_body, &ss);
  assert_int_equal(ss.first_rc, -ETIMEDOUT);
  if (ss.first_ms < 450 || ss.first_ms > 3000)
    fail_msg("all_gather should time out after about 500 ms, took %.0f ms", ss.first_ms);
  if (strstr(ss.first_error, "all_gather: timed out after 500 ms waiting for rank 1") == NULL)
    fail_msg("the error should name the silent rank, got \"%s\"", ss.first_error);
  /* The communicator is broken: the next call fails at once with the same
   * error, and destroying it does not wait for the peer. */
  assert_int_equal(ss.second_rc, -ETIMEDOUT);
  if (ss.second_ms > 50)
    fail_msg("a call on a broken communicator should fail fast, took %.0f ms", ss.second_ms);
  if (ss.destroy_ms > 1000)
    fail_msg("comm_destroy after a timeout took %.0f ms", ss.destroy_ms);
}

static void test_late_rank_fails_fast_after_its_peer_timed_out(void **state) {
  stall_state ss = {.late_rank_calls = true};
  run_world(2, 1000, stall_body, &ss);
  assert_int_equal(ss.first_rc, -ETIMEDOUT);
  /* Rank 0 closed its connections when it gave up, so rank 1 learns of it
   * at once instead of waiting out its own timeout. */
  if (ss.late_rc == 0)
    fail_msg("rank 1's all_gather should fail once rank 0 has given up");
  if (ss.late_ms > 500)
    fail_msg("rank 1 should fail fast, took %.0f ms (timeout 1000 ms)", ss.late_ms);
}

/* comm_abort, the daemon's stop: rank 1 builds its communicator and stops
 * calling (like a peer whose worker is gone); rank 0 enters a collective
 * with it and waits, and rank 1's thread aborts rank 0's communicator. The
 * call returns at once, not at the 20 s timeout, and later calls fail
 * fast. */
typedef enum abort_call {
  ABORT_ALL_GATHER,
  ABORT_REDUCE_SCATTER,
  ABORT_ALL_REDUCE,
  ABORT_BROADCAST,
  ABORT_BARRIER,
  ABORT_CALLS
} abort_call;

typedef struct abort_state {
  abort_call call;
  _Atomic(comm *) victim; /* rank 0's communicator, once rank 0 is about to call */
  atomic_int aborted;     /* rank 1 has returned from comm_abort */
  int first_rc, second_rc;
  double first_ms, second_ms;
  char first_error[256];
} abort_state;

static int call_collective(comm *c, abort_call call) {
  float floats[2 * 64] = {0};
  uint8_t bytes[2 * 64] = {0};
  switch (call) {
  case ABORT_ALL_GATHER:
    return comm_all_gather(c, bytes, bytes, 64);
  case ABORT_REDUCE_SCATTER:
    return comm_reduce_scatter_f32(c, floats, floats + 64, 32);
  case ABORT_ALL_REDUCE:
    return comm_all_reduce(c, floats, 64, COMM_F32, COMM_SUM);
  case ABORT_BROADCAST:
    return comm_broadcast(c, bytes, 64, 1);
  default:
    return comm_barrier(c);
  }
}

static void abort_body(rank_ctx *rc) {
  abort_state *as = rc->run->user;
  if (rc->rank == 1) {
    rc->keep_comm = true; /* silent, connected */
    comm *victim;
    while ((victim = atomic_load(&as->victim)) == NULL)
      sleep_ms(1);
    sleep_ms(100); /* rank 0 is waiting in its call by now */
    comm_abort(victim);
    atomic_store(&as->aborted, 1);
    return;
  }
  atomic_store(&as->victim, rc->c);
  double started_ms = now_ms();
  as->first_rc = call_collective(rc->c, as->call);
  as->first_ms = now_ms() - started_ms;
  snprintf(as->first_error, sizeof as->first_error, "%s", comm_last_error(rc->c));
  started_ms = now_ms();
  as->second_rc = comm_barrier(rc->c);
  as->second_ms = now_ms() - started_ms;
  /* comm_abort and comm_destroy never overlap (comm.h). */
  while (atomic_load(&as->aborted) == 0)
    sleep_ms(1);
}

static void test_abort_ends_a_collective_waiting_for_a_silent_peer(void **state) {
  for (int call = 0; call < ABORT_CALLS; call++) {
    abort_state as = {.call = (abort_call)call};
    run_world(2, DEFAULT_TIMEOUT_MS, abort_body, &as);
    if (as.first_rc != -ECANCELED)
      fail_msg("call %d returned %d (%s), want -ECANCELED", call, as.first_rc, as.first_error);
    if (as.first_ms > 2000)
      fail_msg("call %d should return at the abort (~100 ms), took %.0f ms", call, as.first_ms);
    assert_non_null(strstr(as.first_error, "communicator aborted"));
    assert_int_equal(as.second_rc, -ECANCELED);
    if (as.second_ms > 50)
      fail_msg("a call after the abort should fail fast, took %.0f ms", as.second_ms);
  }
}

/* A rank in the rendezvous whose peer never comes gives up when the store
 * stops (the daemon's stop), not at the timeout. */
static void test_create_gives_up_when_the_store_stops(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  stopping_store ss = {st, 100};
  pthread_t stopper;
  assert_int_equal(pthread_create(&stopper, NULL, stop_after_delay, &ss), 0);
  comm_options options = {
      .prefix = "test/stopped", .rank = 0, .world_size = 2, .timeout_ms = DEFAULT_TIMEOUT_MS};
  comm *c = NULL;
  char err[256] = "";
  double started_ms = now_ms();
  int rc = comm_gloo_create(&options, st, &c, err, sizeof err);
  double took_ms = now_ms() - started_ms;
  pthread_join(stopper, NULL);
  assert_int_equal(rc, -ECANCELED);
  assert_null(c);
  if (took_ms > 2000)
    fail_msg("create should give up when the store stops (~100 ms), took %.0f ms", took_ms);
  st->ops->destroy(st);
}

static void invalid_arguments_body(rank_ctx *rc) {
  int call_rc = comm_broadcast(rc->c, "x", 1, 5);
  RANK_CHECK(rc, call_rc == -EINVAL, "broadcast from root 5 of 1 returned %d", call_rc);
  RANK_CHECK(rc, strstr(comm_last_error(rc->c), "root 5") != NULL,
             "the error should name the bad root, got \"%s\"", comm_last_error(rc->c));
  /* Peers would now be out of step, so the communicator stays broken. */
  call_rc = comm_barrier(rc->c);
  RANK_CHECK(rc, call_rc == -EINVAL, "a call after a failure returned %d", call_rc);
}

static void test_bad_arguments_fail_and_break_the_communicator(void **state) {
  run_world(1, DEFAULT_TIMEOUT_MS, invalid_arguments_body, NULL);
}

int main(void) {
  /* Gloo writes to sockets without MSG_NOSIGNAL; the daemon ignores SIGPIPE
   * for the same reason. */
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_create_times_out_when_a_rank_is_missing, gloo_backend),
      cmocka_unit_test_setup(test_create_rejects_bad_options, gloo_backend),
      cmocka_unit_test_setup(test_create_removes_its_rendezvous_keys, gloo_backend),
      BOTH(test_all_gather_times_out_when_a_peer_stops_calling),
      BOTH(test_late_rank_fails_fast_after_its_peer_timed_out),
      BOTH(test_abort_ends_a_collective_waiting_for_a_silent_peer),
      cmocka_unit_test_setup(test_create_gives_up_when_the_store_stops, gloo_backend),
      BOTH(test_bad_arguments_fail_and_break_the_communicator),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
