/* The local backend's closing barrier (comm_local.c: release): a rank whose
 * group breaks while a peer is still reading its buffers does not return,
 * and so does not free them, until that peer has finished.
 *
 * The CI's ASan run found this as a use after free: a job torn down while
 * its ranks built their communicator; one rank freed the step counts it
 * had published while another still copied them. Here the two ranks use
 * comm_local_begin/comm_local_end (the hierarchical backend's node half),
 * which let the test hold rank 1 between its reads. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "test_clock.h"

#include "comm.h"
#include "comm_impl.h"

#define TIMEOUT_MS 20000

typedef struct world {
  comm_local_group *group;
  atomic_int published;       /* ranks past comm_local_begin */
  atomic_int rank0_returned;  /* rank 0's comm_local_end returned */
  int returned_while_reading; /* rank 0 returned before rank 1 finished */
  int begin_rc[2], end_rc[2];
  uint64_t read_back[2];
  char error[2][320];
} world;

typedef struct rank_arg {
  world *w;
  int rank;
} rank_arg;

static void *rank_main(void *arg) {
  rank_arg *ra = arg;
  world *w = ra->w;
  comm_options options = {
      .prefix = "release", .rank = ra->rank, .world_size = 2, .timeout_ms = TIMEOUT_MS};
  comm *c = NULL;
  char err[256];
  if (comm_local_create(&options, w->group, &c, err, sizeof err) != 0) {
    snprintf(w->error[ra->rank], sizeof w->error[ra->rank], "create: %s", err);
    w->begin_rc[ra->rank] = -1;
    return NULL;
  }
  uint64_t mine = 1000 + (uint64_t)ra->rank;
  const void *const *peers = NULL;
  w->begin_rc[ra->rank] = comm_local_begin(c, "release_test", &mine, sizeof mine, &peers);
  if (w->begin_rc[ra->rank] == 0) {
    atomic_fetch_add(&w->published, 1);
    while (atomic_load(&w->published) < 2)
      sleep_ms(1);
    if (ra->rank == 0) {
      /* A failure elsewhere aborts the group while rank 1 reads. */
      comm_abort(c);
    } else {
      sleep_ms(200); /* a slow copy */
      w->returned_while_reading = atomic_load(&w->rank0_returned);
      memcpy(&w->read_back[1], peers[0], sizeof w->read_back[1]);
    }
    w->end_rc[ra->rank] = comm_local_end(c, "release_test");
    if (ra->rank == 0)
      atomic_store(&w->rank0_returned, 1);
  }
  snprintf(w->error[ra->rank], sizeof w->error[ra->rank], "%s", comm_last_error(c));
  comm_destroy(c);
  return NULL;
}

static void test_a_broken_group_waits_for_readers_before_returning(void **state) {
  (void)state;
  world w = {0};
  assert_int_equal(comm_local_group_create(2, &w.group), 0);
  pthread_t threads[2];
  rank_arg args[2] = {{&w, 0}, {&w, 1}};
  for (int r = 0; r < 2; r++)
    assert_int_equal(pthread_create(&threads[r], NULL, rank_main, &args[r]), 0);
  for (int r = 0; r < 2; r++)
    pthread_join(threads[r], NULL);
  comm_local_group_unref(w.group);
  for (int r = 0; r < 2; r++)
    if (w.begin_rc[r] != 0)
      fail_msg("rank %d: begin returned %d (%s)", r, w.begin_rc[r], w.error[r]);
  if (w.returned_while_reading)
    fail_msg("rank 0 returned from its closing barrier while rank 1 still read its buffer");
  assert_int_equal(w.read_back[1], 1000);
  /* The collective itself still fails on both ranks: the group broke. */
  for (int r = 0; r < 2; r++)
    if (w.end_rc[r] != -ECANCELED)
      fail_msg("rank %d: end returned %d (%s), want -ECANCELED", r, w.end_rc[r], w.error[r]);
  assert_non_null(strstr(w.error[1], "aborted"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_a_broken_group_waits_for_readers_before_returning),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
