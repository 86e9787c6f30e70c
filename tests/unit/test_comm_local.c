/* The local backend (comm_local.c) against Gloo: its sums bit for bit
 * the same as Gloo's, its rendezvous waiting for every rank then timing
 * out, a peer leaving failing a waiting rank at once, and ranks out of
 * step failing without touching buffers. */
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

/* ---- the local backend ------------------------------------------------------ */

/* Sums of values that round: the local backend's reduce-scatter must add
 * them in the same order as Gloo's (rank order), to the bit. */
#define BITS_WORLD 3
#define BITS_SHARD 10007

typedef struct bits_state {
  float *inputs[BITS_WORLD]; /* each BITS_WORLD * BITS_SHARD */
  float results[BITS_WORLD][BITS_SHARD];
  double norms[BITS_WORLD][4];
} bits_state;

static void bits_body(rank_ctx *rc) {
  bits_state *bs = rc->run->user;
  RANK_CALL(
      rc, comm_reduce_scatter_f32(rc->c, bs->inputs[rc->rank], bs->results[rc->rank], BITS_SHARD));
  double *norms = bs->norms[rc->rank];
  for (int i = 0; i < 4; i++)
    norms[i] = 1.0 / (3.0 + rc->rank + i * 7.0);
  RANK_CALL(rc, comm_all_reduce(rc->c, norms, 4, COMM_F64, COMM_SUM));
}

static void test_local_sums_bit_for_bit_as_gloo(void **state) {
  (void)state;
  static bits_state gloo, local;
  uint64_t seed = 42;
  for (int r = 0; r < BITS_WORLD; r++) {
    gloo.inputs[r] = xmalloc(sizeof(float) * BITS_WORLD * BITS_SHARD);
    local.inputs[r] = xmalloc(sizeof(float) * BITS_WORLD * BITS_SHARD);
    for (size_t i = 0; i < (size_t)BITS_WORLD * BITS_SHARD; i++) {
      /* Magnitudes from 1e-4 to 1e4: sums that round differently in
       * another order. */
      double u = (double)(rng_next(&seed) >> 11) / 9007199254740992.0;
      gloo.inputs[r][i] = local.inputs[r][i] = (float)((u - 0.5) * pow(10.0, (double)(i % 9) - 4));
    }
  }
  use_backend = GLOO;
  run_world(BITS_WORLD, DEFAULT_TIMEOUT_MS, bits_body, &gloo);
  use_backend = LOCAL;
  run_world(BITS_WORLD, DEFAULT_TIMEOUT_MS, bits_body, &local);
  for (int r = 0; r < BITS_WORLD; r++)
    for (size_t i = 0; i < BITS_SHARD; i++) {
      size_t at = (size_t)r * BITS_SHARD + i;
      float want = (local.inputs[0][at] + local.inputs[1][at]) + local.inputs[2][at];
      if (memcmp(&want, &gloo.results[r][i], sizeof want) != 0 ||
          memcmp(&want, &local.results[r][i], sizeof want) != 0)
        fail_msg("rank %d element %zu: sequential %a, gloo %a, local %a", r, i, (double)want,
                 (double)gloo.results[r][i], (double)local.results[r][i]);
    }
  /* all_reduce: Gloo's is a ring (the order depends on the rank); the
   * local backend's is rank order on every rank, like its reduce-scatter. */
  for (int r = 0; r < BITS_WORLD; r++)
    for (int i = 0; i < 4; i++) {
      double want = (1.0 / (3.0 + i * 7.0) + 1.0 / (4.0 + i * 7.0)) + 1.0 / (5.0 + i * 7.0);
      assert_memory_equal(&local.norms[r][i], &want, sizeof want);
      assert_true(fabs(gloo.norms[r][i] - want) <= 1e-15);
    }
  /* And the order matters: a reversed sum differs somewhere. */
  size_t differs = 0;
  for (size_t i = 0; i < BITS_SHARD; i++) {
    float forward = (local.inputs[0][i] + local.inputs[1][i]) + local.inputs[2][i];
    float backward = (local.inputs[2][i] + local.inputs[1][i]) + local.inputs[0][i];
    differs += forward != backward;
  }
  assert_true(differs > 0);
  for (int r = 0; r < BITS_WORLD; r++) {
    free(gloo.inputs[r]);
    free(local.inputs[r]);
  }
}

static void test_local_create_waits_for_every_rank_then_times_out(void **state) {
  (void)state;
  comm_local_group *g = NULL;
  assert_int_equal(comm_local_group_create(2, &g), 0);
  comm_options options = {.rank = 0, .world_size = 2, .timeout_ms = 300};
  comm *c = NULL;
  char err[256] = "";
  double started_ms = now_ms();
  int rc = comm_local_create(&options, g, &c, err, sizeof err);
  double took_ms = now_ms() - started_ms;
  assert_int_equal(rc, -ETIMEDOUT);
  assert_null(c);
  if (took_ms < 250 || took_ms > 3000)
    fail_msg("create should give up after about 300 ms, took %.0f ms", took_ms);
  if (strstr(err, "rendezvous: timed out after 300 ms waiting for rank 1") == NULL)
    fail_msg("the error should name the missing rank, got \"%s\"", err);
  /* Bad options are refused before anything waits. */
  options.rank = 2;
  assert_int_equal(comm_local_create(&options, g, &c, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, "rank 2 of 2"));
  options = (comm_options){.rank = 0, .world_size = 3, .timeout_ms = 300};
  assert_int_equal(comm_local_create(&options, g, &c, err, sizeof err), -EINVAL);
  options = (comm_options){.rank = 0, .world_size = 2, .timeout_ms = 0};
  assert_int_equal(comm_local_create(&options, g, &c, err, sizeof err), -EINVAL);
  comm_local_group_unref(g);
}

/* A rank that leaves (its communicator destroyed: its job failed) wakes a
 * peer waiting for it at once. */
typedef struct leave_state {
  atomic_int waiting;
  int rc;
  double ms;
  char error[256];
} leave_state;

static void leave_body(rank_ctx *rc) {
  leave_state *ls = rc->run->user;
  if (rc->rank == 1) {
    while (atomic_load(&ls->waiting) == 0)
      sleep_ms(1);
    sleep_ms(100);
    comm_destroy(rc->c);
    rc->c = NULL;
    return;
  }
  uint8_t bytes[2 * 16];
  atomic_store(&ls->waiting, 1);
  double started_ms = now_ms();
  ls->rc = comm_all_gather(rc->c, bytes, bytes, 16);
  ls->ms = now_ms() - started_ms;
  snprintf(ls->error, sizeof ls->error, "%s", comm_last_error(rc->c));
}

static void test_local_peer_leaving_fails_a_waiting_rank_at_once(void **state) {
  (void)state;
  leave_state ls = {0};
  use_backend = LOCAL;
  run_world(2, DEFAULT_TIMEOUT_MS, leave_body, &ls);
  assert_int_equal(ls.rc, -ECONNRESET);
  if (ls.ms > 2000)
    fail_msg("the waiting rank should fail when its peer leaves (~100 ms), took %.0f ms", ls.ms);
  assert_non_null(strstr(ls.error, "all_gather: rank 1 left"));
}

/* Ranks whose workers sent different requests call different collectives:
 * every rank fails with -EPROTO, and none reads past a peer's buffer. */
typedef struct mismatch_state {
  int second; /* rank 1's call: 0 all_reduce, 1 barrier, 2 all_gather of another size */
  int rc[2];
  char error[2][256];
} mismatch_state;

static void mismatch_body(rank_ctx *rc) {
  mismatch_state *ms = rc->run->user;
  uint8_t gathered[2 * 64] = {0};
  double sums[4] = {0};
  int got;
  if (rc->rank == 0)
    got = comm_all_gather(rc->c, gathered, gathered, 64);
  else if (ms->second == 0)
    got = comm_all_reduce(rc->c, sums, 4, COMM_F64, COMM_SUM);
  else if (ms->second == 1)
    got = comm_barrier(rc->c);
  else
    got = comm_all_gather(rc->c, gathered + 32, gathered, 32);
  ms->rc[rc->rank] = got;
  snprintf(ms->error[rc->rank], sizeof ms->error[rc->rank], "%s", comm_last_error(rc->c));
}

static void test_local_ranks_out_of_step_fail_without_touching_buffers(void **state) {
  (void)state;
  use_backend = LOCAL;
  for (int second = 0; second < 3; second++) {
    mismatch_state ms = {.second = second};
    run_world(2, DEFAULT_TIMEOUT_MS, mismatch_body, &ms);
    for (int r = 0; r < 2; r++) {
      if (ms.rc[r] != -EPROTO)
        fail_msg("case %d, rank %d: returned %d (%s), want -EPROTO", second, r, ms.rc[r],
                 ms.error[r]);
      assert_non_null(strstr(ms.error[r], "out of step"));
    }
  }
}

int main(void) {
  /* Gloo writes to sockets without MSG_NOSIGNAL; the daemon ignores SIGPIPE
   * for the same reason. */
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_local_sums_bit_for_bit_as_gloo),
      cmocka_unit_test(test_local_create_waits_for_every_rank_then_times_out),
      cmocka_unit_test(test_local_peer_leaving_fails_a_waiting_rank_at_once),
      cmocka_unit_test(test_local_ranks_out_of_step_fail_without_touching_buffers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
