/* comm_fixtures.c - what the communicator tests share (comm_fixtures.h):
 * running a world of ranks on threads with the backend a setup picks, the
 * rank checks, and the data helpers more than one test uses. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test_clock.h"

#include "comm_fixtures.h"

/* ---- helpers -------------------------------------------------------------- */

void *xmalloc(size_t bytes) {
  void *p = malloc(bytes > 0 ? bytes : 1);
  if (p == NULL) {
    fprintf(stderr, "out of memory allocating %zu bytes\n", bytes);
    abort();
  }
  return p;
}

/* splitmix64, for the data of the determinism test. */
uint64_t rng_next(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* ---- running a world of ranks on threads --------------------------------- */

backend use_backend;
#define use_local (use_backend == LOCAL)

/* Records a rank's first failure; the body then returns. */
void rank_fail(rank_ctx *rc, const char *fmt, ...) {
  if (rc->failure[0] != '\0')
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rc->failure, sizeof rc->failure, fmt, ap);
  va_end(ap);
}

static void *rank_main(void *arg) {
  rank_ctx *rc = arg;
  world_run *run = rc->run;
  comm_options options = {.prefix = "test/job/1/epoch/0",
                          .rank = rc->rank,
                          .world_size = run->world,
                          .timeout_ms = run->timeout_ms};
  char err[256];
  int create_rc;
  if (use_backend == HIER) {
    int L = run->local_size, l = rc->rank % L, n = rc->rank / L;
    comm_options local_options = {
        .rank = l, .world_size = L, .timeout_ms = run->timeout_ms, .level = COMM_LEVEL_NODE};
    char prefix[64];
    snprintf(prefix, sizeof prefix, "test/hier/x%d", l);
    comm_options cross_options = {.prefix = prefix,
                                  .rank = n,
                                  .world_size = run->world / L,
                                  .timeout_ms = run->timeout_ms,
                                  .level = COMM_LEVEL_CROSS};
    comm *local = NULL, *cross = NULL;
    create_rc = comm_local_create(&local_options, run->node_groups[n], &local, err, sizeof err);
    if (create_rc == 0 &&
        (create_rc = comm_gloo_create(&cross_options, run->st, &cross, err, sizeof err)) != 0)
      comm_destroy(local);
    if (create_rc == 0)
      create_rc = comm_hier_create(&options, local, cross, &rc->c, err, sizeof err);
  } else if (use_backend == LOCAL) {
    create_rc = comm_local_create(&options, run->group, &rc->c, err, sizeof err);
  } else {
    create_rc = comm_gloo_create(&options, run->st, &rc->c, err, sizeof err);
  }
  if (create_rc != 0) {
    static const char *const names[] = {"gloo", "local", "hierarchical"};
    rank_fail(rc, "creating the %s communicator returned %d: %s", names[use_backend], create_rc,
              err);
    return NULL;
  }
  run->body(rc);
  if (!rc->keep_comm) {
    comm_destroy(rc->c);
    rc->c = NULL;
  }
  return NULL;
}

/* Runs body on `world` ranks rendezvousing through st and fails the test
 * with the first rank's failure. Communicators a body kept alive are
 * destroyed after the join. */
void run_world_in(store *st, int world, int timeout_ms, rank_body body, void *user) {
  world_run run = {.st = st, .world = world, .timeout_ms = timeout_ms, .body = body, .user = user};
  if (use_local)
    assert_int_equal(comm_local_group_create(world, &run.group), 0);
  run.local_size = world % 2 == 0 ? 2 : 1;
  if (use_backend == HIER)
    for (int n = 0; n < world / run.local_size; n++)
      assert_int_equal(comm_local_group_create(run.local_size, &run.node_groups[n]), 0);
  pthread_t threads[MAX_WORLD];
  for (int r = 0; r < world; r++) {
    run.ranks[r].run = &run;
    run.ranks[r].rank = r;
    assert_int_equal(pthread_create(&threads[r], NULL, rank_main, &run.ranks[r]), 0);
  }
  for (int r = 0; r < world; r++)
    pthread_join(threads[r], NULL);
  for (int r = 0; r < world; r++)
    comm_destroy(run.ranks[r].c);
  comm_local_group_unref(run.group);
  for (int n = 0; n < MAX_WORLD; n++)
    comm_local_group_unref(run.node_groups[n]);
  for (int r = 0; r < world; r++)
    if (run.ranks[r].failure[0] != '\0')
      fail_msg("world %d, rank %d: %s", world, r, run.ranks[r].failure);
}

/* The same with a store of its own. */
void run_world(int world, int timeout_ms, rank_body body, void *user) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  run_world_in(st, world, timeout_ms, body, user);
  st->ops->destroy(st);
}

/* ---- the backend a world runs on ----------------------------------------- */

int gloo_backend(void **state) {
  (void)state;
  use_backend = GLOO;
  return 0;
}

int local_backend(void **state) {
  (void)state;
  use_backend = LOCAL;
  return 0;
}

int hier_backend(void **state) {
  (void)state;
  use_backend = HIER;
  return 0;
}

/* ---- a body more than one test runs -------------------------------------- */

void barrier_body(rank_ctx *rc) {
  atomic_int *arrived = rc->run->user;
  /* Later ranks arrive later, so a barrier that let anyone through early
   * would see fewer than world arrivals. */
  sleep_ms(30 * rc->rank);
  atomic_fetch_add(arrived, 1);
  RANK_CALL(rc, comm_barrier(rc->c));
  int seen = atomic_load(arrived);
  RANK_CHECK(rc, seen == rc->run->world, "left the barrier after %d of %d arrivals", seen,
             rc->run->world);
}

/* ---- stopping a store ---------------------------------------------------- */

void *stop_after_delay(void *arg) {
  stopping_store *ss = arg;
  sleep_ms(ss->delay_ms);
  store_mem_stop(ss->st);
  return NULL;
}
