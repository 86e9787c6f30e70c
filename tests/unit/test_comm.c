/* The collectives of the communicators (comm.h) on every backend: Gloo,
 * the local backend of ranks that are threads of one process
 * (comm_local.c), and the hierarchical one: all-gather, reduce-scatter,
 * all-reduce, broadcast, barrier and all-to-all, each on worlds of up to
 * MAX_WORLD ranks run as threads (comm_fixtures.c).
 *
 * Data are chosen so that every expected result is exact: small integers
 * in fp32 sum without rounding in any order. */
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
#include "zk.h"

/* ---- helpers ------------------------------------------------------------- */

/* The byte rank r contributes at offset i of its all-gather slice. */
static uint8_t gather_byte(int rank, size_t i) {
  return (uint8_t)(rank * 131 + i * 7 + 1);
}

/* An integer in [-1000, 1000] that rank r contributes at flat index j of
 * the reduce-scatter input; world * 1000 is far below 2^24, so sums are
 * exact. */
static float scatter_value(int rank, size_t j) {
  return (float)((int)((j * 2654435761u + (size_t)rank * 97u) % 2001u) - 1000);
}

/* ---- all-gather ------------------------------------------------------------ */

typedef struct gather_case {
  size_t bytes_per_rank;
  bool in_place;
} gather_case;

static void all_gather_body(rank_ctx *rc) {
  const gather_case *gc = rc->run->user;
  const int world = rc->run->world;
  const size_t n = gc->bytes_per_rank;
  uint8_t *gathered = xmalloc(n * (size_t)world);
  uint8_t *own = xmalloc(n);
  memset(gathered, 0xee, n * (size_t)world);
  uint8_t *send = gc->in_place ? gathered + (size_t)rc->rank * n : own;
  for (size_t i = 0; i < n; i++)
    send[i] = gather_byte(rc->rank, i);
  int call_rc = comm_all_gather(rc->c, send, gathered, n);
  if (call_rc != 0) {
    rank_fail(rc, "comm_all_gather returned %d: %s", call_rc, comm_last_error(rc->c));
  } else {
    for (int r = 0; r < world && rc->failure[0] == '\0'; r++)
      for (size_t i = 0; i < n; i++)
        if (gathered[(size_t)r * n + i] != gather_byte(r, i)) {
          rank_fail(rc, "%zu bytes per rank%s: byte %zu of rank %d's slice is %u, want %u", n,
                    gc->in_place ? " in place" : "", i, r, gathered[(size_t)r * n + i],
                    gather_byte(r, i));
          break;
        }
  }
  free(gathered);
  free(own);
}

static const size_t gather_sizes[] = {1, 7, 4097, 1000003};

static void check_all_gather(bool in_place) {
  for (int world = 1; world <= MAX_WORLD; world++)
    for (size_t s = 0; s < sizeof gather_sizes / sizeof gather_sizes[0]; s++) {
      gather_case gc = {gather_sizes[s], in_place};
      run_world(world, DEFAULT_TIMEOUT_MS, all_gather_body, &gc);
    }
}

static void test_all_gather_in_place_collects_every_rank_slice(void **state) {
  check_all_gather(true);
}

static void test_all_gather_out_of_place_collects_every_rank_slice(void **state) {
  check_all_gather(false);
}

/* ---- reduce-scatter --------------------------------------------------------- */

typedef struct scatter_case {
  size_t shard_numel;
  bool in_place;
} scatter_case;

static void reduce_scatter_body(rank_ctx *rc) {
  const scatter_case *sc = rc->run->user;
  const int world = rc->run->world;
  const size_t shard = sc->shard_numel, total = shard * (size_t)world;
  float *send = xmalloc(total * sizeof(float));
  float *separate_recv = xmalloc(shard * sizeof(float));
  float *recv = sc->in_place ? send + (size_t)rc->rank * shard : separate_recv;
  for (size_t j = 0; j < total; j++)
    send[j] = scatter_value(rc->rank, j);
  int call_rc = comm_reduce_scatter_f32(rc->c, send, recv, shard);
  if (call_rc != 0) {
    rank_fail(rc, "comm_reduce_scatter_f32 returned %d: %s", call_rc, comm_last_error(rc->c));
  } else {
    for (size_t i = 0; i < shard; i++) {
      size_t j = (size_t)rc->rank * shard + i;
      float want = 0.0f;
      for (int r = 0; r < world; r++)
        want += scatter_value(r, j);
      if (recv[i] != want) {
        rank_fail(rc, "shard_numel %zu%s: element %zu of the shard is %g, want %g", shard,
                  sc->in_place ? " in place" : "", i, (double)recv[i], (double)want);
        break;
      }
    }
  }
  free(send);
  free(separate_recv);
}

static void test_reduce_scatter_sums_every_rank_slice(void **state) {
  /* 1, a short odd shard, and shards just past 1 and 2 MiB. */
  const size_t shard_sizes[] = {1, 3, 262145, 524289};
  for (int world = 1; world <= MAX_WORLD; world++)
    for (size_t s = 0; s < sizeof shard_sizes / sizeof shard_sizes[0]; s++) {
      scatter_case sc = {shard_sizes[s], false};
      run_world(world, DEFAULT_TIMEOUT_MS, reduce_scatter_body, &sc);
    }
}

static void test_reduce_scatter_sums_a_large_shard(void **state) {
  scatter_case sc = {4u << 20, false}; /* 4 Mi floats: 16 MiB per shard */
  run_world(2, 60000, reduce_scatter_body, &sc);
  sc.shard_numel = (1u << 20) + 5;
  run_world(3, 60000, reduce_scatter_body, &sc);
}

static void test_reduce_scatter_in_place_into_own_shard(void **state) {
  for (int world = 1; world <= 3; world++) {
    scatter_case sc = {300001, true};
    run_world(world, DEFAULT_TIMEOUT_MS, reduce_scatter_body, &sc);
  }
}

/* Random normal data, so that the sums round: the result must still be the
 * same bits on every run. */
static void reduce_scatter_twice_body(rank_ctx *rc) {
  const size_t shard = 100003, total = shard * (size_t)rc->run->world;
  float *send = xmalloc(total * sizeof(float));
  float *first = xmalloc(shard * sizeof(float)), *second = xmalloc(shard * sizeof(float));
  float *results[2] = {first, second};
  for (int attempt = 0; attempt < 2; attempt++) {
    uint64_t seed = 1000u + (uint64_t)rc->rank;
    for (size_t j = 0; j < total; j++)
      send[j] = (float)((double)(rng_next(&seed) >> 11) * 0x1p-53 - 0.5) * 3.0f;
    int call_rc = comm_reduce_scatter_f32(rc->c, send, results[attempt], shard);
    if (call_rc != 0) {
      rank_fail(rc, "comm_reduce_scatter_f32 returned %d: %s", call_rc, comm_last_error(rc->c));
      break;
    }
  }
  if (rc->failure[0] == '\0' && memcmp(first, second, shard * sizeof(float)) != 0)
    rank_fail(rc, "two reduce-scatters of the same data gave different bits");
  /* The bits are those of a sequential sum in rank order, as one process
   * adding the ranks' gradients would compute them; the hierarchical
   * backend's, of each node's ranks in order, then of the nodes in order. */
  const int L = use_backend == HIER ? rc->run->local_size : rc->run->world;
  float *want = xmalloc(shard * sizeof(float)), *node = xmalloc(shard * sizeof(float));
  for (int r = 0; r < rc->run->world; r++) {
    uint64_t seed = 1000u + (uint64_t)r;
    size_t begin = (size_t)rc->rank * shard;
    for (size_t j = 0; j < total; j++) {
      float v = (float)((double)(rng_next(&seed) >> 11) * 0x1p-53 - 0.5) * 3.0f;
      if (j >= begin && j < begin + shard)
        node[j - begin] = r % L == 0 ? v : node[j - begin] + v;
    }
    if (r % L == L - 1)
      for (size_t i = 0; i < shard; i++)
        want[i] = r / L == 0 ? node[i] : want[i] + node[i];
  }
  if (rc->failure[0] == '\0' && memcmp(first, want, shard * sizeof(float)) != 0)
    rank_fail(rc, "the sum is not the %s sum",
              use_backend == HIER ? "nodes-then-ranks" : "rank-order sequential");
  free(node);
  free(want);
  free(send);
  free(first);
  free(second);
}

static void test_reduce_scatter_is_deterministic_run_to_run(void **state) {
  run_world(3, DEFAULT_TIMEOUT_MS, reduce_scatter_twice_body, NULL);
  run_world(4, DEFAULT_TIMEOUT_MS, reduce_scatter_twice_body, NULL);
}

/* ---- all-reduce, broadcast, barrier ---------------------------------------- */

#define REDUCE_NUMEL 1031

static double reduce_input(int rank, size_t i) {
  return (double)((int)((i * 37u + (size_t)rank * 11u) % 23u) - 11) * (rank + 1);
}

static double combine(comm_op op, double a, double b) {
  switch (op) {
  case COMM_SUM:
    return a + b;
  case COMM_MAX:
    return a > b ? a : b;
  case COMM_MIN:
    return a < b ? a : b;
  }
  return NAN;
}

static void all_reduce_body(rank_ctx *rc) {
  static const comm_dtype dtypes[] = {COMM_F32, COMM_F64, COMM_I64, COMM_U8};
  static const comm_op ops[] = {COMM_SUM, COMM_MAX, COMM_MIN};
  const int world = rc->run->world;
  for (size_t d = 0; d < 4; d++)
    for (size_t o = 0; o < 3; o++) {
      comm_dtype dtype = dtypes[d];
      comm_op op = ops[o];
      union {
        float f32[REDUCE_NUMEL];
        double f64[REDUCE_NUMEL];
        int64_t i64[REDUCE_NUMEL];
        uint8_t u8[REDUCE_NUMEL];
      } buf;
      /* u8 holds 0..255, so its inputs are shifted to be non-negative and
       * kept small enough for the sum not to wrap. */
      for (size_t i = 0; i < REDUCE_NUMEL; i++) {
        double x = reduce_input(rc->rank, i);
        if (dtype == COMM_F32)
          buf.f32[i] = (float)x;
        else if (dtype == COMM_F64)
          buf.f64[i] = x * 1e-3;
        else if (dtype == COMM_I64)
          buf.i64[i] = (int64_t)x * ((int64_t)1 << 40);
        else
          buf.u8[i] = (uint8_t)(x + 44);
      }
      RANK_CALL(rc, comm_all_reduce(rc->c, &buf, REDUCE_NUMEL, dtype, op));
      for (size_t i = 0; i < REDUCE_NUMEL; i++) {
        double want = reduce_input(0, i), want_u8 = reduce_input(0, i) + 44;
        for (int r = 1; r < world; r++) {
          want = combine(op, want, reduce_input(r, i));
          want_u8 = combine(op, want_u8, reduce_input(r, i) + 44);
        }
        bool ok;
        if (dtype == COMM_F32)
          ok = buf.f32[i] == (float)want;
        else if (dtype == COMM_F64)
          ok = fabs(buf.f64[i] - want * 1e-3) <= 1e-12;
        else if (dtype == COMM_I64)
          ok = buf.i64[i] == (int64_t)want * ((int64_t)1 << 40);
        else
          ok = buf.u8[i] == (uint8_t)want_u8;
        RANK_CHECK(rc, ok, "dtype %d op %d: element %zu differs from the reduction of all ranks",
                   (int)dtype, (int)op, i);
      }
    }
}

static void test_all_reduce_combines_every_dtype_and_op(void **state) {
  for (int world = 1; world <= 3; world++)
    run_world(world, DEFAULT_TIMEOUT_MS, all_reduce_body, NULL);
}

typedef struct broadcast_case {
  int root;
  size_t bytes;
} broadcast_case;

static void broadcast_body(rank_ctx *rc) {
  const broadcast_case *bc = rc->run->user;
  uint8_t *buf = xmalloc(bc->bytes);
  for (size_t i = 0; i < bc->bytes; i++)
    buf[i] = rc->rank == bc->root ? gather_byte(bc->root, i) : 0;
  RANK_CALL(rc, comm_broadcast(rc->c, buf, bc->bytes, bc->root));
  for (size_t i = 0; i < bc->bytes; i++)
    if (buf[i] != gather_byte(bc->root, i)) {
      rank_fail(rc, "byte %zu is %u, want root %d's %u", i, buf[i], bc->root,
                gather_byte(bc->root, i));
      break;
    }
  free(buf);
}

static void test_broadcast_from_a_nonzero_root_reaches_every_rank(void **state) {
  broadcast_case cases[] = {{2, 4097}, {1, 1}, {3, 1000003}};
  run_world(3, DEFAULT_TIMEOUT_MS, broadcast_body, &cases[0]);
  run_world(2, DEFAULT_TIMEOUT_MS, broadcast_body, &cases[1]);
  run_world(4, DEFAULT_TIMEOUT_MS, broadcast_body, &cases[2]);
}

static void test_barrier_waits_for_every_rank(void **state) {
  for (int world = 1; world <= MAX_WORLD; world++) {
    atomic_int arrived = 0;
    run_world(world, DEFAULT_TIMEOUT_MS, barrier_body, &arrived);
  }
}

/* ---- all-to-all ---------------------------------------------------------- */

/* all_to_all: chunk j of rank r's send lands as chunk r of rank j's recv. */
static void all_to_all_body(rank_ctx *rc) {
  const int W = rc->run->world;
  const size_t b = 1000;
  uint8_t *send = xmalloc(b * (size_t)W), *recv = xmalloc(b * (size_t)W);
  memset(send, 0, b * (size_t)W);
  for (int j = 0; j < W; j++)
    memset(send + (size_t)j * b, rc->rank * 16 + j, b);
  RANK_CALL(rc, comm_all_to_all(rc->c, send, recv, b));
  for (int r = 0; r < W; r++)
    for (size_t i = 0; i < b; i++)
      RANK_CHECK(rc, recv[(size_t)r * b + i] == (uint8_t)(r * 16 + rc->rank),
                 "chunk %d byte %zu is %u, want %u", r, i, recv[(size_t)r * b + i],
                 (unsigned)(r * 16 + rc->rank));
  free(send);
  free(recv);
}

static void test_all_to_all_swaps_every_chunk(void **state) {
  (void)state;
  for (int world = 1; world <= 4; world++)
    run_world(world, DEFAULT_TIMEOUT_MS, all_to_all_body, NULL);
}

int main(void) {
  /* Gloo writes to sockets without MSG_NOSIGNAL; the daemon ignores SIGPIPE
   * for the same reason. */
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      BOTH(test_all_gather_in_place_collects_every_rank_slice),
      BOTH(test_all_gather_out_of_place_collects_every_rank_slice),
      BOTH(test_reduce_scatter_sums_every_rank_slice),
      BOTH(test_reduce_scatter_sums_a_large_shard),
      BOTH(test_reduce_scatter_in_place_into_own_shard),
      BOTH(test_reduce_scatter_is_deterministic_run_to_run),
      BOTH(test_all_reduce_combines_every_dtype_and_op),
      BOTH(test_broadcast_from_a_nonzero_root_reaches_every_rank),
      BOTH(test_barrier_waits_for_every_rank),
      cmocka_unit_test_setup(test_all_to_all_swaps_every_chunk, gloo_backend),
      cmocka_unit_test_setup(test_all_to_all_swaps_every_chunk, local_backend),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
