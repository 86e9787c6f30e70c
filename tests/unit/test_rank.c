/* The rank executors (daemon/rank/exec.c) driven through their public API
 * alone: a job from job_create, each rank's executor started with
 * exec_rank_start, ops made with exec_op_new and queued with exec_submit,
 * the way the node's loop does it, against the host device ("cpu") and Gloo
 * over the in-memory rendezvous store, with one and two ranks in this
 * process (rank_fixtures.c). This file: the communicator and the session,
 * registering a unit, gathering it, and gathers served inline.
 *
 * The executors hand finished ops to exec_settings.complete, which here
 * pushes them onto a queue the test owns (the daemon's is ipc_completion.c's
 * completion queue). That callback is only made for an op with a session
 * (finish() in exec.c frees the others), so every op the test waits for
 * carries TEST_SESSION: a non-NULL pointer that nothing dereferences (rank/
 * code only compares op->session with NULL). Replies are decoded from
 * op->reply_frame as a worker would decode them (proto/frame.h), and the
 * buffers behind them are mapped from op->reply_fd and cached by buffer id,
 * as libzerod does.
 *
 * cmocka may only fail on the test's thread: the executors' threads do
 * nothing here but queue their ops.
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

/* The layout the daemon must have built, from model/layout.c itself. */
static unit_layout *expected_layout(int world) {
  const char *names[UNIT_NT];
  const uint64_t *shapes[UNIT_NT];
  unsigned ndims[UNIT_NT];
  int frozen[UNIT_NT];
  for (int t = 0; t < UNIT_NT; t++) {
    names[t] = unit_tensors[t].name;
    shapes[t] = unit_tensors[t].shape;
    ndims[t] = unit_tensors[t].ndim;
    frozen[t] = unit_tensors[t].frozen;
  }
  unit_layout *l = NULL;
  char err[256] = "";
  if (unit_layout_build(UNIT_NAME, UNIT_NT, names, shapes, ndims, frozen, world, 0, &l, err,
                        sizeof err) != 0)
    fail_msg("unit_layout_build: %s", err);
  return l;
}

/* ---- Tests ------------------------------------------------------------------------ */

static void test_comm_init_then_session_begin_succeed(void **state) {
  fixture *fx = *state;
  uint64_t id = submit_all(fx, OP_COMM_INIT, 0, NULL, -1);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "OP_COMM_INIT");
    if (op->status != ZEROD__V1__STATUS__STATUS_OK)
      fail_msg("OP_COMM_INIT on rank %d: status %d, expected OK", r, op->status);
    assert_null(op->reply_frame);
    assert_int_equal(atomic_load(&fx->j->ranks[r].comm_ready), 1);
    exec_op_free(op);
  }
  assert_false(job_failed(fx->j, 0, NULL, 0));

  id = submit_all(fx, OP_SESSION_BEGIN, 0, NULL, -1);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "OP_SESSION_BEGIN");
    Zerod__V1__AttachReply *reply = (Zerod__V1__AttachReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, "OP_SESSION_BEGIN");
    assert_int_equal(reply->rank, r);
    assert_int_equal(reply->world_size, fx->world);
    assert_int_equal(reply->job_id, 7);
    assert_int_equal(reply->version, 0);
    assert_non_null(reply->config);
    assert_non_null(reply->config->optimizer);
    assert_int_equal(reply->config->optimizer->kind, ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD);
    assert_true(reply->config->optimizer->lr == TEST_LR);
    assert_int_equal(reply->config->working_dtype, ZEROD__V1__DTYPE__DTYPE_F32);
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    assert_int_equal(fx->j->ranks[r].session_id, SESSION_ID);
    exec_op_free(op);
  }
}

static void test_register_seeded_reply_matches_unit_layout_build(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  unit_layout *want = expected_layout(fx->world);
  uint64_t id = submit_register(fx, ZEROD__V1__INIT_MODE__INIT_SEEDED_NORMAL, 1234);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "REGISTER_UNIT (seeded)");
    Zerod__V1__RegisterUnitReply *reply = (Zerod__V1__RegisterUnitReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, "REGISTER_UNIT (seeded)");
    assert_int_equal(reply->unit_id, 0);
    assert_string_equal(reply->name, UNIT_NAME);
    assert_false(reply->existed);
    if (reply->numel != want->numel || reply->padded_numel != want->padded_numel ||
        reply->shard_numel != want->shard_numel)
      fail_msg("rank %d: numel/padded/shard %llu/%llu/%llu, expected %llu/%llu/%llu (world %d)", r,
               (unsigned long long)reply->numel, (unsigned long long)reply->padded_numel,
               (unsigned long long)reply->shard_numel, (unsigned long long)want->numel,
               (unsigned long long)want->padded_numel, (unsigned long long)want->shard_numel,
               fx->world);
    assert_int_equal(reply->padded_numel, reply->shard_numel * (uint64_t)fx->world);
    assert_int_equal(reply->working_dtype, ZEROD__V1__DTYPE__DTYPE_F32);
    assert_int_equal(reply->grad_dtype, ZEROD__V1__DTYPE__DTYPE_F32);
    assert_int_equal(reply->n_tensors, want->ntensors);
    for (unsigned t = 0; t < want->ntensors; t++) {
      const Zerod__V1__TensorPlacement *p = reply->tensors[t];
      const tensor_layout *tl = &want->tensors[t];
      assert_string_equal(p->name, tl->name);
      if (p->offset != tl->offset || p->numel != tl->numel)
        fail_msg("rank %d, tensor '%s': offset %llu numel %llu, expected offset %llu numel %llu", r,
                 tl->name, (unsigned long long)p->offset, (unsigned long long)p->numel,
                 (unsigned long long)tl->offset, (unsigned long long)tl->numel);
      assert_int_equal(p->n_shape, tl->ndim);
      for (unsigned d = 0; d < tl->ndim; d++)
        assert_int_equal(p->shape[d], tl->shape[d]);
    }
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
  }
  /* The published layout is the job's: unit 0, counted ready on every rank. */
  unit_layout *l = job_unit(fx->j, 0);
  assert_non_null(l);
  assert_int_equal(atomic_load(&l->ready_ranks), fx->world);
  assert_int_equal(l->padded_numel, want->padded_numel);
  unit_layout_free(want);
}

static void test_register_again_returns_the_existing_unit(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  /* The same layout again (a restarted worker): the unit and its values
   * are kept, whatever the init mode says now. */
  uint64_t id = submit_register(fx, ZEROD__V1__INIT_MODE__INIT_ZEROS, 0);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "REGISTER_UNIT again");
    Zerod__V1__RegisterUnitReply *reply = (Zerod__V1__RegisterUnitReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, "REGISTER_UNIT again");
    assert_int_equal(reply->unit_id, unit_id);
    if (!reply->existed)
      fail_msg("rank %d: a second registration of the same layout should reply existed = true", r);
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
  }
  unit_layout *l = job_unit(fx->j, unit_id);
  assert_non_null(l);
  float *want = calloc(l->padded_numel, sizeof(float));
  float *got[MAX_RANKS] = {0};
  for (int r = 0; r < fx->world; r++)
    got[r] = calloc(l->padded_numel, sizeof(float));
  expected_initial(l, want);
  gather_values(fx, unit_id, l->padded_numel, 0, got);
  for (int r = 0; r < fx->world; r++) {
    expect_flat_equal(want, got[r], l->padded_numel, "values kept by a re-registration", r);
    free(got[r]);
  }
  free(want);
}

static void test_gather_returns_rank0_initial_values(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  assert_non_null(l);
  float *want = calloc(l->padded_numel, sizeof(float));
  float *got[MAX_RANKS] = {0};
  for (int r = 0; r < fx->world; r++)
    got[r] = calloc(l->padded_numel, sizeof(float));
  expected_initial(l, want);
  gather_values(fx, unit_id, l->padded_numel, 0, got);
  for (int r = 0; r < fx->world; r++) {
    expect_flat_equal(want, got[r], l->padded_numel,
                      "the gathered unit (rank 0's values at their offsets, zero elsewhere)", r);
    free(got[r]);
  }
  free(want);
}

/* INIT_SEEDED_NORMAL: value k of a unit depends on the seed, the unit's
 * name and k only (exec.c), so one rank and two ranks gather the same
 * values; gaps and padding are zero. */
static void test_seeded_init_does_not_depend_on_world_size(void **state) {
  fixture *fx1 = *state;
  fixture *fx2 = fixture_open(2);
  fixture *fxs[2] = {fx1, fx2};
  float *got[2][MAX_RANKS] = {{0}};
  uint64_t padded[2] = {0};
  unit_layout *l1 = NULL;
  for (int f = 0; f < 2; f++) {
    fixture *fx = fxs[f];
    start_ranks(fx);
    uint64_t id = submit_register(fx, ZEROD__V1__INIT_MODE__INIT_SEEDED_NORMAL, 99);
    expect_all_ok(fx, id, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, "REGISTER_UNIT (seeded)");
    unit_layout *l = job_unit(fx->j, 0);
    assert_non_null(l);
    if (f == 0)
      l1 = l;
    padded[f] = l->padded_numel;
    for (int r = 0; r < fx->world; r++)
      got[f][r] = calloc(l->padded_numel, sizeof(float));
    gather_values(fx, 0, l->padded_numel, 0, got[f]);
  }
  /* Same offsets on both (world only changes the padding). */
  for (unsigned t = 0; t < l1->ntensors; t++) {
    const tensor_layout *tl = &l1->tensors[t];
    for (uint64_t i = 0; i < tl->numel; i++) {
      uint64_t at = tl->offset + i;
      float v = got[0][0][at];
      if (v == 0.0f || !isfinite(v) || fabsf(v) > 0.02f * 8)
        fail_msg("seeded value %llu of tensor '%s' is %g: not a draw of N(0, 0.02^2)",
                 (unsigned long long)i, tl->name, (double)v);
      for (int r = 0; r < 2; r++)
        if (memcmp(&got[1][r][at], &v, sizeof v) != 0)
          fail_msg("seeded element %llu: %.9g with one rank, %.9g on rank %d of two",
                   (unsigned long long)at, (double)v, (double)got[1][r][at], r);
    }
  }
  for (int f = 0; f < 2; f++)
    for (uint64_t at = l1->numel; at < padded[f]; at++)
      for (int r = 0; r < fxs[f]->world; r++)
        if (got[f][r][at] != 0.0f)
          fail_msg("padding element %llu is %g, expected 0", (unsigned long long)at,
                   (double)got[f][r][at]);
  assert_true(got[0][0][15] == 0.0f); /* the gap between "weight" and "bias" */
  for (int f = 0; f < 2; f++)
    for (int r = 0; r < fxs[f]->world; r++)
      free(got[f][r]);
  fixture_close(fx2);
}

/* Waits until rank r's executor has finished everything queued (busy is
 * decremented just after the completion callback). */
static void wait_idle(fixture *fx, int r) {
  double t0 = now_ms();
  while (atomic_load(&fx->j->ranks[r].busy) != 0) {
    if (now_ms() - t0 > WAIT_MS)
      fail_msg("rank %d did not become idle within %d ms", r, WAIT_MS);
    sleep_ms(1);
  }
}

/* exec_try_inline: a gather served from the rank's cache runs on the
 * calling thread while the executor is idle (no collective); a miss is
 * left to the executor, untouched. */
static void test_try_inline_serves_a_cached_gather_while_idle(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  float *want = calloc(l->padded_numel, sizeof(float));
  float *got[MAX_RANKS] = {0};
  for (int r = 0; r < fx->world; r++)
    got[r] = calloc(l->padded_numel, sizeof(float));
  expected_initial(l, want);
  gather_values(fx, unit_id, l->padded_numel, 0, got); /* fills the cache */

  Zerod__V1__GatherRequest greq = ZEROD__V1__GATHER_REQUEST__INIT;
  greq.unit_id = unit_id;
  Zerod__V1__ReleaseRequest rreq = ZEROD__V1__RELEASE_REQUEST__INIT;
  rreq.unit_id = unit_id;
  for (int r = 0; r < fx->world; r++) {
    wait_idle(fx, r);
    exec_op *op = exec_op_new(OP_GATHER, &fx->j->ranks[r]);
    op->session = TEST_SESSION;
    op->session_id = SESSION_ID;
    op->request_id = fx->next_request++;
    op->request = owned_request(ZEROD__V1__MSG_TYPE__MSG_GATHER, &greq.base);
    if (exec_try_inline(op) != 1)
      fail_msg("rank %d: a cached gather with the executor idle should run inline", r);
    Zerod__V1__GatherReply *reply = (Zerod__V1__GatherReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, "inline GATHER");
    assert_int_equal(reply->version, 0);
    assert_int_equal(op->reply_fd, -1); /* the session has the buffer already */
    const float *base = buffer_map(fx, r, op, reply->buffer_id, reply->buffer_bytes);
    expect_flat_equal(want, base, l->padded_numel, "a gather served inline", r);
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);

    op = exec_op_new(OP_RELEASE, &fx->j->ranks[r]);
    op->session = TEST_SESSION;
    op->session_id = SESSION_ID;
    op->request_id = fx->next_request++;
    op->request = owned_request(ZEROD__V1__MSG_TYPE__MSG_RELEASE, &rreq.base);
    assert_int_equal(exec_try_inline(op), 1);
    protobuf_c_message_free_unpacked(
        reply_of(op, ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY, "inline RELEASE"), NULL);
    exec_op_free(op);
  }

  /* A step moves the version: the cached values are stale, and the gather
   * needs the executor (an all-gather). */
  uint64_t id = submit_step(fx);
  expect_all_ok(fx, id, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, "STEP without gradients");
  id = fx->next_request++;
  for (int r = 0; r < fx->world; r++) {
    wait_idle(fx, r);
    exec_op *op = exec_op_new(OP_GATHER, &fx->j->ranks[r]);
    op->session = TEST_SESSION;
    op->session_id = SESSION_ID;
    op->request_id = id;
    op->request = owned_request(ZEROD__V1__MSG_TYPE__MSG_GATHER, &greq.base);
    if (exec_try_inline(op) != 0)
      fail_msg("rank %d: a gather of a stale cache entry must not run inline", r);
    assert_null(op->reply_frame);
    exec_submit(op);
  }
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "GATHER after the step");
    Zerod__V1__GatherReply *reply = (Zerod__V1__GatherReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, "GATHER after the step");
    assert_int_equal(reply->version, 1);
    /* No gradient: the weights did not move. */
    const float *base = buffer_map(fx, r, op, reply->buffer_id, reply->buffer_bytes);
    expect_flat_equal(want, base, l->padded_numel, "the weights after a step without gradients", r);
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
    free(got[r]);
  }
  free(want);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      RANK_TEST(test_comm_init_then_session_begin_succeed, 1),
      RANK_TEST(test_comm_init_then_session_begin_succeed, 2),
      RANK_TEST(test_register_seeded_reply_matches_unit_layout_build, 1),
      RANK_TEST(test_register_seeded_reply_matches_unit_layout_build, 2),
      RANK_TEST(test_register_again_returns_the_existing_unit, 2),
      RANK_TEST(test_gather_returns_rank0_initial_values, 1),
      RANK_TEST(test_gather_returns_rank0_initial_values, 2),
      RANK_TEST(test_seeded_init_does_not_depend_on_world_size, 1),
      RANK_TEST(test_try_inline_serves_a_cached_gather_while_idle, 1),
      RANK_TEST(test_try_inline_serves_a_cached_gather_while_idle, 2),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
