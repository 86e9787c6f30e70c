/* Cancelling a communicator's creation (comm_cancel.h): a fire reaches
 * only the creation armed with its tag and runs its hook once; a Gloo
 * creation whose peer never comes ends with -ECANCELED when fired, whether
 * it waits for the peer's key in the store or for the peer's connection
 * and barrier after the peer published its address (the rank dies there:
 * here its store never answers it again). Without the cancel those waits
 * last until the timeout, which the daemon's stop used to wait out. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "comm.h"
#include "comm_cancel.h"
#include "store.h"

#define TIMEOUT_MS 20000

/* ---- the cancel object ----------------------------------------------------- */

static void count_hook(void *arg) {
  (*(int *)arg)++;
}

static void test_fire_reaches_only_its_tag_and_runs_the_hook_once(void **state) {
  (void)state;
  comm_cancel c;
  comm_cancel_init(&c);
  int runs = 0;
  assert_int_equal(comm_cancel_fire(&c, 5), 0); /* nothing armed */
  comm_cancel_arm(&c, 5);
  unsigned tag = 0;
  assert_int_equal(comm_cancel_armed(&c, &tag), 1);
  assert_int_equal(tag, 5);
  assert_int_equal(comm_cancel_hook(&c, count_hook, &runs), 0);
  assert_int_equal(comm_cancel_fire(&c, 4), 0); /* an older generation's */
  assert_int_equal(runs, 0);
  assert_int_equal(comm_cancel_fired(&c), 0);
  assert_int_equal(comm_cancel_fire(&c, 5), 1);
  assert_int_equal(runs, 1);
  assert_int_equal(comm_cancel_fire(&c, 5), 0);
  assert_int_equal(runs, 1);
  assert_int_equal(comm_cancel_fired(&c), 1);
  /* A hook set after the fire is refused: the backend gives up. */
  assert_int_equal(comm_cancel_hook(&c, count_hook, &runs), 1);
  assert_int_equal(runs, 1);
  comm_cancel_disarm(&c);
  assert_int_equal(comm_cancel_armed(&c, &tag), 0);
  /* The next creation starts unfired, and an unhooked one runs nothing. */
  comm_cancel_arm(&c, 6);
  assert_int_equal(comm_cancel_fired(&c), 0);
  assert_int_equal(comm_cancel_hook(&c, count_hook, &runs), 0);
  comm_cancel_unhook(&c);
  assert_int_equal(comm_cancel_fire(&c, 6), 1);
  assert_int_equal(runs, 1);
  /* No cancel at all: nothing ever fires. */
  assert_int_equal(comm_cancel_hook(NULL, count_hook, &runs), 0);
  assert_int_equal(comm_cancel_fired(NULL), 0);
  comm_cancel_destroy(&c);
}

/* ---- a store that stops answering one rank --------------------------------- */

/* Passes writes on; every read blocks until released, then fails. */
typedef struct stuck_store {
  store base;
  store *inner;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  int released;
} stuck_store;

static int stuck_set(store *st, const char *key, const void *value, size_t value_bytes) {
  store *inner = ((stuck_store *)st)->inner;
  return inner->ops->set(inner, key, value, value_bytes);
}

static int stuck_get(store *st, const char *key, void **value, size_t *value_bytes,
                     int timeout_ms) {
  (void)key, (void)value, (void)value_bytes, (void)timeout_ms;
  stuck_store *s = (stuck_store *)st;
  pthread_mutex_lock(&s->mutex);
  while (!s->released)
    pthread_cond_wait(&s->cond, &s->mutex);
  pthread_mutex_unlock(&s->mutex);
  return -ECANCELED;
}

static int stuck_delete_prefix(store *st, const char *prefix) {
  store *inner = ((stuck_store *)st)->inner;
  return inner->ops->delete_prefix(inner, prefix);
}

static void stuck_destroy(store *st) {
  (void)st;
}

static const store_ops stuck_ops = {.set = stuck_set,
                                    .get = stuck_get,
                                    .delete_prefix = stuck_delete_prefix,
                                    .destroy = stuck_destroy};

static void stuck_release(stuck_store *s) {
  pthread_mutex_lock(&s->mutex);
  s->released = 1;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->mutex);
}

/* ---- creations on threads -------------------------------------------------- */

typedef struct creation {
  comm_options options;
  store *st;
  comm_cancel cancel;
  int rc;
  char err[256];
  pthread_t thread;
} creation;

static void *create_main(void *arg) {
  creation *cr = arg;
  comm *c = NULL;
  cr->rc = comm_gloo_create(&cr->options, cr->st, &c, cr->err, sizeof cr->err);
  comm_destroy(c);
  return NULL;
}

static void start_creation(creation *cr, const char *prefix, int rank, int world, store *st) {
  memset(cr, 0, sizeof *cr);
  comm_cancel_init(&cr->cancel);
  comm_cancel_arm(&cr->cancel, 1);
  cr->options = (comm_options){.prefix = prefix,
                               .rank = rank,
                               .world_size = world,
                               .timeout_ms = TIMEOUT_MS,
                               .cancel = &cr->cancel};
  cr->st = st;
  assert_int_equal(pthread_create(&cr->thread, NULL, create_main, cr), 0);
}

/* Joins a fired creation: it ended cancelled, or (peer_may_reset) with the
 * error a peer cancelled first causes (a reset); never at its timeout. */
static void join_cancelled(creation *cr, int peer_may_reset) {
  pthread_join(cr->thread, NULL);
  int cancelled = cr->rc == -ECANCELED && strstr(cr->err, "cancelled") != NULL;
  if (!cancelled && !(peer_may_reset && cr->rc < 0 && cr->rc != -ETIMEDOUT))
    fail_msg("rank %d: a fired creation should end cancelled, got %d (%s)", cr->options.rank,
             cr->rc, cr->err);
  comm_cancel_destroy(&cr->cancel);
}

static void finish_cancelled(creation *cr) {
  assert_int_equal(comm_cancel_fire(&cr->cancel, 1), 1);
  join_cancelled(cr, 0);
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Rank 1 never comes: rank 0 waits for its key in the store. */
static void test_cancel_ends_a_creation_waiting_in_the_store(void **state) {
  (void)state;
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  creation cr;
  start_creation(&cr, "test/cancel-store", 0, 2, st);
  sleep_ms(100);
  finish_cancelled(&cr);
  st->ops->destroy(st);
}

/* Rank 2 publishes its addresses, then hears nothing more: ranks 0 and 1
 * wait to connect to it or in the barrier for it (which of the two depends
 * on how the ports compare), until fired. */
static void test_cancel_ends_a_creation_whose_peer_published_and_died(void **state) {
  (void)state;
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  stuck_store stuck = {.base = {.ops = &stuck_ops}, .inner = st};
  pthread_mutex_init(&stuck.mutex, NULL);
  pthread_cond_init(&stuck.cond, NULL);
  creation ranks[3];
  start_creation(&ranks[2], "test/cancel-mesh", 2, 3, &stuck.base);
  void *value = NULL;
  size_t value_bytes = 0;
  assert_int_equal(st->ops->get(st, "test/cancel-mesh/2", &value, &value_bytes, TIMEOUT_MS), 0);
  free(value);
  start_creation(&ranks[0], "test/cancel-mesh", 0, 3, st);
  start_creation(&ranks[1], "test/cancel-mesh", 1, 3, st);
  /* Both have rank 2's addresses at once; this lets them reach their waits
   * for it (a fire any earlier ends them all the same). */
  sleep_ms(500);
  /* Rank 0's fire closes its connections, which may end rank 1 with a
   * reset before its own fire. */
  assert_int_equal(comm_cancel_fire(&ranks[0].cancel, 1), 1);
  comm_cancel_fire(&ranks[1].cancel, 1);
  join_cancelled(&ranks[0], 0);
  join_cancelled(&ranks[1], 1);
  stuck_release(&stuck);
  pthread_join(ranks[2].thread, NULL);
  assert_int_not_equal(ranks[2].rc, 0);
  comm_cancel_destroy(&ranks[2].cancel);
  pthread_mutex_destroy(&stuck.mutex);
  pthread_cond_destroy(&stuck.cond);
  st->ops->destroy(st);
}

int main(void) {
  /* Gloo writes to sockets without MSG_NOSIGNAL; the daemon ignores SIGPIPE
   * for the same reason. */
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fire_reaches_only_its_tag_and_runs_the_hook_once),
      cmocka_unit_test(test_cancel_ends_a_creation_waiting_in_the_store),
      cmocka_unit_test(test_cancel_ends_a_creation_whose_peer_published_and_died),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
