/* The hierarchical communicator (comm_hier_create): a local group per
 * node and a Gloo communicator across nodes. Bytes counted by level, and
 * reduce-scatter with the cross-node partial sums on the wire as int8,
 * int4 or bf16 blocks (qgZ), within the encoding's bound, or as 1-bit
 * signs with error feedback (1-bit Adam), bit for bit. */
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

/* ---- the hierarchical backend -------------------------------------------- */

/* Bytes by level: 2 nodes of 2 ranks. Cross-node, each rank moves N = 2
 * slices of a gather and 2 shards of a reduce, where a flat communicator
 * moves W = 4. */
typedef struct levels_state {
  uint64_t gather[MAX_WORLD][COMM_LEVELS], reduce[MAX_WORLD][COMM_LEVELS];
} levels_state;

static void levels_body(rank_ctx *rc) {
  levels_state *ls = rc->run->user;
  uint64_t ignored[COMM_LEVELS];
  comm_take_bytes(rc->c, ignored); /* the rendezvous */
  uint8_t gathered[4 * 100] = {0};
  float grads[4 * 25] = {0}, mine[25];
  RANK_CALL(rc, comm_all_gather(rc->c, gathered + rc->rank * 100, gathered, 100));
  comm_take_bytes(rc->c, ls->gather[rc->rank]);
  RANK_CALL(rc, comm_reduce_scatter_f32(rc->c, grads, mine, 25));
  comm_take_bytes(rc->c, ls->reduce[rc->rank]);
}

static void test_hier_moves_n_slices_across_nodes(void **state) {
  (void)state;
  levels_state ls = {0};
  use_backend = HIER;
  run_world(4, DEFAULT_TIMEOUT_MS, levels_body, &ls);
  for (int r = 0; r < 4; r++) {
    assert_int_equal(ls.gather[r][COMM_LEVEL_CROSS], 2 * 100);
    assert_int_equal(ls.gather[r][COMM_LEVEL_NODE], 4 * 100);
    assert_int_equal(ls.gather[r][COMM_LEVEL_WORLD], 0);
    assert_int_equal(ls.reduce[r][COMM_LEVEL_CROSS], 2 * 25 * sizeof(float));
    assert_int_equal(ls.reduce[r][COMM_LEVEL_NODE], 4 * 25 * sizeof(float));
  }
  /* A flat communicator counts everything at its own level. */
  memset(&ls, 0, sizeof ls);
  use_backend = GLOO;
  run_world(4, DEFAULT_TIMEOUT_MS, levels_body, &ls);
  assert_int_equal(ls.gather[0][COMM_LEVEL_NODE], 4 * 100);
  assert_int_equal(ls.reduce[0][COMM_LEVEL_NODE], 4 * 25 * sizeof(float));
}

/* qgZ on 2 nodes of 2 ranks: each node's partial sums cross as int8, int4
 * or bf16 blocks; the result is within the encoding's bound of the exact
 * sum (half a step of each node's partial, summed over the nodes), and the
 * cross-node bytes are the encoded ones. */
typedef struct wire_state {
  comm_wire wire;
  uint64_t cross[4];
  double worst_excess[4];
} wire_state;

#define WIRE_SHARD 3001

static float wire_value(int rank, size_t j) {
  uint64_t seed = 77 + (uint64_t)rank * 1000003 + j;
  return (float)(((double)(rng_next(&seed) >> 11) * 0x1p-53 - 0.5) * (1 + (double)(j % 7)));
}

static void wire_body(rank_ctx *rc) {
  wire_state *ws = rc->run->user;
  const int W = 4, L = 2;
  float *send = xmalloc(sizeof(float) * WIRE_SHARD * W), recv[WIRE_SHARD];
  for (size_t j = 0; j < (size_t)WIRE_SHARD * W; j++)
    send[j] = wire_value(rc->rank, j);
  uint64_t bytes[COMM_LEVELS];
  comm_take_bytes(rc->c, bytes);
  RANK_CALL(rc, comm_reduce_scatter_f32_wire(rc->c, send, recv, WIRE_SHARD, &ws->wire));
  comm_take_bytes(rc->c, bytes);
  ws->cross[rc->rank] = bytes[COMM_LEVEL_CROSS];
  /* The bound: per node, half a step of its partial's block (int), or
   * bf16's half ulp (2^-9 relative). */
  int qmax = ws->wire.format == COMM_WIRE_INT4 ? 7 : 127;
  double worst = -1e30;
  size_t block = ws->wire.block != 0 ? ws->wire.block : WIRE_SHARD; /* bf16: no blocks */
  for (size_t i0 = 0; i0 < WIRE_SHARD; i0 += block) {
    size_t end = i0 + block < WIRE_SHARD ? i0 + block : WIRE_SHARD;
    double bound[2] = {0, 0};
    for (int n = 0; n < 2; n++) {
      double m = 0;
      for (size_t i = i0; i < end; i++) {
        size_t at = (size_t)rc->rank * WIRE_SHARD + i;
        double p = (double)(float)(wire_value(n * L, at) + wire_value(n * L + 1, at));
        m = fabs(p) > m ? fabs(p) : m;
      }
      bound[n] = 0.5001 * m / qmax;
    }
    for (size_t i = i0; i < end; i++) {
      size_t at = (size_t)rc->rank * WIRE_SHARD + i;
      double exact = 0, b = 0;
      for (int n = 0; n < 2; n++) {
        float p = wire_value(n * L, at) + wire_value(n * L + 1, at);
        exact += p;
        b += ws->wire.format == COMM_WIRE_BF16 ? fabs(p) * 0x1p-8 : bound[n];
      }
      double excess = fabs(recv[i] - exact) - (b + 1e-6 * fabs(exact));
      worst = excess > worst ? excess : worst;
    }
  }
  ws->worst_excess[rc->rank] = worst;
  free(send);
}

static void test_hier_reduce_scatter_on_the_wire(void **state) {
  (void)state;
  use_backend = HIER;
  const comm_wire wires[] = {{.format = COMM_WIRE_INT8, .block = 64},
                             {.format = COMM_WIRE_INT4, .block = 64},
                             {.format = COMM_WIRE_BF16}};
  for (size_t k = 0; k < 3; k++) {
    wire_state ws = {.wire = wires[k]};
    run_world(4, DEFAULT_TIMEOUT_MS, wire_body, &ws);
    zk_qformat fmt = {.bits = wires[k].format == COMM_WIRE_INT4 ? 4 : 8,
                      .mode = ZK_QSYM,
                      .block_numel = wires[k].block};
    size_t q =
        wires[k].format == COMM_WIRE_BF16 ? WIRE_SHARD * 2 : zk_quant_bytes(&fmt, WIRE_SHARD);
    for (int r = 0; r < 4; r++) {
      if (ws.worst_excess[r] > 0)
        fail_msg("wire %zu, rank %d: an element is %g past the bound", k, r, ws.worst_excess[r]);
      assert_int_equal(ws.cross[r], 2 * q); /* N = 2 encoded slices */
    }
  }
}

/* 1-bit Adam's wire on 2 nodes of 2 ranks, three rounds whose error
 * feedback carries over: every rank's result, and the error every rank
 * keeps, are bit for bit what a single thread computes from the same
 * values with the encoding's own functions (checked against numpy in
 * python.onebit): a rank's own node's partial sum exact, the other node's
 * decoded from the signs and block scales of (its partial + the error its
 * rank kept), summed in node order. What crosses nodes is the encoding. */
#define ONEBIT_BLOCK  256
#define ONEBIT_ROUNDS 3

typedef struct onebit_state {
  float *error[4];              /* each rank's: 2 chunks of WIRE_SHARD */
  float *got[ONEBIT_ROUNDS][4]; /* each rank's result, per round */
  uint64_t cross[4];
} onebit_state;

static void onebit_body(rank_ctx *rc) {
  onebit_state *os = rc->run->user;
  float *send = xmalloc(sizeof(float) * WIRE_SHARD * 4);
  comm_wire wire = {
      .format = COMM_WIRE_ONEBIT, .block = ONEBIT_BLOCK, .error = os->error[rc->rank]};
  for (int round = 0; round < ONEBIT_ROUNDS; round++) {
    for (size_t j = 0; j < (size_t)WIRE_SHARD * 4; j++)
      send[j] = wire_value(rc->rank + 10 * round, j);
    uint64_t bytes[COMM_LEVELS];
    comm_take_bytes(rc->c, bytes);
    RANK_CALL(
        rc, comm_reduce_scatter_f32_wire(rc->c, send, os->got[round][rc->rank], WIRE_SHARD, &wire));
    comm_take_bytes(rc->c, bytes);
    os->cross[rc->rank] = bytes[COMM_LEVEL_CROSS];
  }
  free(send);
}

/* Node `node`'s partial sum (its 2 ranks' values in local order) of the
 * chunk for rank (n, local), in round `round`. */
static void onebit_partial(int node, int n, int local, int round, float *out) {
  for (size_t i = 0; i < WIRE_SHARD; i++) {
    size_t j = ((size_t)n * 2 + (size_t)local) * WIRE_SHARD + i;
    out[i] = wire_value(node * 2 + 10 * round, j);
    out[i] += wire_value(node * 2 + 1 + 10 * round, j);
  }
}

static void test_hier_reduce_scatter_one_bit_with_error_feedback(void **state) {
  (void)state;
  use_backend = HIER;
  onebit_state os = {0};
  float *want_error[4], *want[4];
  const size_t q = zk_onebit_bytes(ONEBIT_BLOCK, WIRE_SHARD);
  uint8_t *encoded = xmalloc(q);
  float *partial = xmalloc(sizeof(float) * WIRE_SHARD),
        *decoded = xmalloc(sizeof(float) * WIRE_SHARD);
  for (int r = 0; r < 4; r++) {
    os.error[r] = calloc(2 * WIRE_SHARD, sizeof(float));
    want_error[r] = calloc(2 * WIRE_SHARD, sizeof(float));
    want[r] = xmalloc(sizeof(float) * WIRE_SHARD);
    for (int k = 0; k < ONEBIT_ROUNDS; k++)
      os.got[k][r] = xmalloc(sizeof(float) * WIRE_SHARD);
  }
  run_world(4, DEFAULT_TIMEOUT_MS, onebit_body, &os);
  for (int round = 0; round < ONEBIT_ROUNDS; round++) {
    /* Rank d = (dn, local) sums, over source nodes m in order, node m's
     * partial for it: exact from its own node, else as rank (m, local)
     * encoded it with the error it kept for node dn. */
    for (int d = 0; d < 4; d++) {
      const int dn = d / 2, local = d % 2;
      for (int m = 0; m < 2; m++) {
        onebit_partial(m, dn, local, round, partial);
        if (m == dn) {
          memcpy(decoded, partial, sizeof(float) * WIRE_SHARD);
        } else {
          float *err = want_error[m * 2 + local] + (size_t)dn * WIRE_SHARD;
          assert_int_equal(
              zk_onebit_encode(NULL, ONEBIT_BLOCK, partial, err, WIRE_SHARD, encoded, q), 0);
          assert_int_equal(zk_onebit_decode(NULL, ONEBIT_BLOCK, encoded, q, decoded, WIRE_SHARD),
                           0);
        }
        for (size_t i = 0; i < WIRE_SHARD; i++)
          want[d][i] = m == 0 ? decoded[i] : want[d][i] + decoded[i];
      }
      if (memcmp(want[d], os.got[round][d], sizeof(float) * WIRE_SHARD) != 0)
        fail_msg("round %d, rank %d: the sum differs from the single-thread one", round, d);
    }
  }
  for (int r = 0; r < 4; r++) {
    if (memcmp(want_error[r], os.error[r], sizeof(float) * 2 * WIRE_SHARD) != 0)
      fail_msg("rank %d: its error feedback differs from the single-thread one", r);
    assert_int_equal(os.cross[r], 2 * q); /* N = 2 encoded chunks, the own one never sent */
    free(os.error[r]);
    free(want_error[r]);
    free(want[r]);
    for (int k = 0; k < ONEBIT_ROUNDS; k++)
      free(os.got[k][r]);
  }
  free(encoded);
  free(partial);
  free(decoded);
}

int main(void) {
  /* Gloo writes to sockets without MSG_NOSIGNAL; the daemon ignores SIGPIPE
   * for the same reason. */
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hier_moves_n_slices_across_nodes),
      cmocka_unit_test(test_hier_reduce_scatter_on_the_wire),
      cmocka_unit_test(test_hier_reduce_scatter_one_bit_with_error_feedback),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
