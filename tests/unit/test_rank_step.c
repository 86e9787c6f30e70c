/* The rank executors' REDUCE and STEP (daemon/rank/exec.c) on one and two
 * host ranks (rank_fixtures.c): gradients summed over the ranks, gaps,
 * padding and frozen tensors ignored, and SGD's update checked bit for
 * bit.
 *
 * Values are chosen so that every expected result is exact: initial values
 * and gradients are small multiples of 1/4, whose sums are exact in fp32;
 * the SGD update is computed in the test as the kernel defines it
 * (kernels/math_optim.h: fmaf(-lr, g, w), lr rounded to fp32), so it is
 * compared bit for bit. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "test_clock.h"

#include "config.h"
#include "exec.h"
#include "frame.h"
#include "hostmem.h"
#include "job.h"
#include "layout.h"
#include "pin.h"
#include "rank_fixtures.h"
#include "store.h"

/* ---- Gradients and the step ---------------------------------------------- */

/* Rank r's gradient for packed element k of a trainable tensor. */
static float grad_value(int r, uint64_t k) {
  return (float)((int)((k * 7 + (uint64_t)r * 5) % 13) - 6) * 0.25f;
}

/* GRAD_BUFFER on every rank; fills rank r's buffer with grad(r, k) at each
 * trainable tensor's packed element k and `junk` everywhere else (gaps,
 * padding, frozen tensors), then REDUCE. */
static void reduce_gradients(fixture *fx, const unit_layout *l, float junk) {
  uint64_t id = submit_unit_op(fx, OP_GRAD_BUFFER, l->id);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "GRAD_BUFFER");
    Zerod__V1__GradBufferReply *reply = (Zerod__V1__GradBufferReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY, "GRAD_BUFFER");
    assert_int_equal(reply->unit_id, l->id);
    assert_true(reply->buffer_bytes >= l->padded_numel * sizeof(float));
    mapping_drop(fx, r, reply->dropped_buffer_ids, reply->n_dropped_buffer_ids);
    float *g = buffer_map(fx, r, op, reply->buffer_id, reply->buffer_bytes);
    for (uint64_t i = 0; i < l->padded_numel; i++)
      g[i] = junk;
    uint64_t k = 0;
    for (unsigned t = 0; t < l->ntensors; t++)
      for (uint64_t i = 0; i < l->tensors[t].numel; i++, k++)
        if (!l->tensors[t].frozen)
          g[l->tensors[t].offset + i] = grad_value(r, k);
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
  }
  id = submit_unit_op(fx, OP_REDUCE, l->id);
  expect_all_ok(fx, id, ZEROD__V1__MSG_TYPE__MSG_REDUCE_REPLY, "REDUCE");
}

/* STEP on every rank; checks the reply (step 1, version 1, the norm of
 * the summed gradients) and the gathered values afterwards: each trainable
 * element is w - lr * (g_0 + ... + g_{W-1}) as the kernel computes it, and
 * frozen tensors, gaps and padding keep their values. */
static void step_and_check(fixture *fx, const unit_layout *l) {
  uint64_t n = l->padded_numel;
  float *want = calloc(n, sizeof(float));
  assert_non_null(want);
  expected_initial(l, want);
  double sumsq = 0;
  uint64_t k = 0;
  const float neg_lr = (float)(-TEST_LR);
  for (unsigned t = 0; t < l->ntensors; t++)
    for (uint64_t i = 0; i < l->tensors[t].numel; i++, k++) {
      if (l->tensors[t].frozen)
        continue;
      float g = 0;
      for (int r = 0; r < fx->world; r++)
        g += grad_value(r, k); /* exact: multiples of 1/4 */
      sumsq += (double)g * g;
      float *w = &want[l->tensors[t].offset + i];
      *w = fmaf(neg_lr, g, *w);
    }

  uint64_t id = submit_step(fx);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "STEP");
    Zerod__V1__StepReply *reply =
        (Zerod__V1__StepReply *)reply_of(op, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, "STEP");
    assert_int_equal(reply->step, 1);
    assert_int_equal(reply->version, 1);
    assert_false(reply->skipped);
    if (fabs(reply->grad_norm - sqrt(sumsq)) > 1e-9 * sqrt(sumsq))
      fail_msg("STEP on rank %d: grad_norm %.17g, expected %.17g (the norm of the summed "
               "trainable gradients)",
               r, reply->grad_norm, sqrt(sumsq));
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
  }

  float *got[MAX_RANKS] = {0};
  for (int r = 0; r < fx->world; r++)
    assert_non_null(got[r] = calloc(n, sizeof(float)));
  gather_values(fx, l->id, n, 1, got);
  for (int r = 0; r < fx->world; r++) {
    expect_flat_equal(want, got[r], n, "the weights after an SGD step (w - lr * sum of g)", r);
    free(got[r]);
  }
  free(want);
}

/* ---- Tests --------------------------------------------------------------- */

static void test_step_sgd_updates_master(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  assert_non_null(l);
  reduce_gradients(fx, l, 0.0f);
  step_and_check(fx, l);
  /* No checkpoint order was given: the step never reached the hooks. */
  assert_int_equal(atomic_load(&ckpt_hook_calls), 0);
}

/* REDUCE sums the ranks' gradient buffers (docs/protocol.md: "sum the
 * unit's gradient buffers over the ranks", in rank order): two ranks with
 * different gradients step by lr * (g0 + g1), not by their mean. */
static void test_two_ranks_reduce_sums_their_gradients(void **state) {
  fixture *fx = *state;
  assert_int_equal(fx->world, 2);
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  assert_non_null(l);
  assert_true(grad_value(0, 1) != grad_value(1, 1)); /* the ranks' gradients differ */
  reduce_gradients(fx, l, 0.0f);
  step_and_check(fx, l);
}

/* Gradients written into gaps, padding and frozen tensors are ignored:
 * they count neither in the update nor in the norm. */
static void test_reduce_ignores_gaps_padding_and_frozen_gradients(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  assert_non_null(l);
  reduce_gradients(fx, l, 1000.0f);
  step_and_check(fx, l);
}
int main(void) {
  const struct CMUnitTest tests[] = {
      RANK_TEST(test_step_sgd_updates_master, 1),
      RANK_TEST(test_two_ranks_reduce_sums_their_gradients, 2),
      RANK_TEST(test_reduce_ignores_gaps_padding_and_frozen_gradients, 1),
      RANK_TEST(test_reduce_ignores_gaps_padding_and_frozen_gradients, 2),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
