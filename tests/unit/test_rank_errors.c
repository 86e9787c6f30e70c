/* How the rank executors (daemon/rank/exec.c) answer ops that cannot be
 * served, on one and two host ranks (rank_fixtures.c): a gather of an
 * unknown unit (NOT_FOUND, and the rank goes on), every op of a failed job
 * (ABORTED), and ops queued behind a rank that stops (UNAVAILABLE, at
 * once) while the op blocked in a collective ends ABORTED. */
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

/* ---- Replies ------------------------------------------------------------- */

/* Checks that an op was answered with an Error of `status` whose message
 * contains `contains` (if not NULL). */
static void expect_error(const exec_op *op, int status, const char *contains, const char *what) {
  if (op->status != status)
    fail_msg("%s (rank %d): expected status %d, got %d", what, op->rank->rank, status, op->status);
  Zerod__V1__Error *e = (Zerod__V1__Error *)reply_of(op, ZEROD__V1__MSG_TYPE__MSG_ERROR, what);
  if ((int)e->status != status)
    fail_msg("%s: the Error reply says status %d, expected %d (%s)", what, e->status, status,
             e->message);
  if (contains != NULL && strstr(e->message, contains) == NULL)
    fail_msg("%s: the error message \"%s\" should mention \"%s\"", what, e->message, contains);
  assert_int_equal(op->reply_fd, -1);
  protobuf_c_message_free_unpacked(&e->base, NULL);
}

/* ---- Tests --------------------------------------------------------------- */

static void test_gather_unknown_unit_is_not_found(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint64_t id = submit_unit_op(fx, OP_GATHER, 42);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "GATHER of unit 42");
    expect_error(op, ZEROD__V1__STATUS__STATUS_NOT_FOUND, "unknown unit id 42",
                 "GATHER of an unknown unit");
    exec_op_free(op);
  }
  /* The rank goes on: a unit registered now gathers normally. */
  assert_false(job_failed(fx->j, 0, NULL, 0));
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  float *got[MAX_RANKS] = {0};
  for (int r = 0; r < fx->world; r++)
    got[r] = calloc(l->padded_numel, sizeof(float));
  gather_values(fx, unit_id, l->padded_numel, 0, got);
  for (int r = 0; r < fx->world; r++)
    free(got[r]);
}

static void test_failed_job_answers_aborted(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  job_fail(fx->j, 0, "a peer lost its worker");
  const op_kind kinds[] = {OP_GATHER, OP_GRAD_BUFFER, OP_REDUCE};
  const char *names[] = {"GATHER", "GRAD_BUFFER", "REDUCE"};
  for (int k = 0; k < 3; k++) {
    uint64_t id = submit_unit_op(fx, kinds[k], unit_id);
    for (int r = 0; r < fx->world; r++) {
      exec_op *op = wait_op(fx, r, id, names[k]);
      expect_error(op, ZEROD__V1__STATUS__STATUS_ABORTED, "a peer lost its worker", names[k]);
      exec_op_free(op);
    }
  }
  uint64_t id = submit_step(fx);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "STEP");
    expect_error(op, ZEROD__V1__STATUS__STATUS_ABORTED, "a peer lost its worker",
                 "STEP of a failed job");
    exec_op_free(op);
  }
  id = submit_register(fx, ZEROD__V1__INIT_MODE__INIT_FROM_RANK0, 0);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "REGISTER_UNIT");
    expect_error(op, ZEROD__V1__STATUS__STATUS_ABORTED, "failed", "REGISTER_UNIT of a failed job");
    exec_op_free(op);
  }
}

/* A rank blocked in a collective (rank 0 registers alone, waiting for rank
 * 1) has ops queued behind it: exec_rank_stop answers those UNAVAILABLE at
 * once, on the caller's thread; stopping the peer wakes the blocked
 * collective (ABORTED), and both threads join. */
static void test_stop_answers_queued_ops_unavailable(void **state) {
  fixture *fx = *state;
  assert_int_equal(fx->world, 2);
  start_ranks(fx);
  rank_state *rs0 = &fx->j->ranks[0];

  uint64_t reg_id = fx->next_request++;
  {
    Zerod__V1__TensorSpec spec = ZEROD__V1__TENSOR_SPEC__INIT;
    Zerod__V1__TensorSpec *specs[1] = {&spec};
    uint64_t shape[1] = {8};
    spec.name = "w";
    spec.n_shape = 1;
    spec.shape = shape;
    Zerod__V1__RegisterUnitRequest req = ZEROD__V1__REGISTER_UNIT_REQUEST__INIT;
    req.name = "alone";
    req.n_tensors = 1;
    req.tensors = specs;
    req.init = ZEROD__V1__INIT_MODE__INIT_ZEROS;
    submit_to(fx, 0, OP_REGISTER, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &req.base, -1, reg_id);
  }
  /* Wait until the executor has taken the registration off its queue. */
  double t0 = now_ms();
  for (;;) {
    pthread_mutex_lock(&rs0->queue_mutex);
    int queued = rs0->queue_head != NULL;
    pthread_mutex_unlock(&rs0->queue_mutex);
    if (!queued)
      break;
    if (now_ms() - t0 > WAIT_MS)
      fail_msg("rank 0 did not start the registration within %d ms", WAIT_MS);
    sleep_ms(1);
  }

  uint64_t queued_ids[2];
  {
    Zerod__V1__GatherRequest g = ZEROD__V1__GATHER_REQUEST__INIT;
    queued_ids[0] = submit_to(fx, 0, OP_GATHER, ZEROD__V1__MSG_TYPE__MSG_GATHER, &g.base, -1,
                              fx->next_request++);
    Zerod__V1__StepRequest s = ZEROD__V1__STEP_REQUEST__INIT;
    queued_ids[1] =
        submit_to(fx, 0, OP_STEP, ZEROD__V1__MSG_TYPE__MSG_STEP, &s.base, -1, fx->next_request++);
  }
  assert_int_equal(atomic_load(&rs0->busy), 3);

  exec_rank_stop(rs0);
  fx->stopped[0] = 1;
  /* Answered by exec_rank_stop itself: already on the queue. */
  for (int k = 0; k < 2; k++) {
    exec_op *op = queue_take(&fx->q, rs0, queued_ids[k], 0);
    if (op == NULL)
      fail_msg("queued op %d was not answered by exec_rank_stop", k);
    expect_error(op, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "shutting down",
                 "an op queued when the rank stopped");
    exec_op_free(op);
  }
  /* The registration in progress is not one of them: it ends in its own
   * handler, ABORTED, once its collective is aborted (at once between
   * ranks that share memory: the stop cancels the job's local group). */
  exec_op *blocked = queue_take(&fx->q, rs0, reg_id, 0);
  if (blocked != NULL && blocked->status != ZEROD__V1__STATUS__STATUS_ABORTED)
    fail_msg("the registration in progress was answered %d, not ABORTED", blocked->status);

  exec_rank_stop(&fx->j->ranks[1]);
  fx->stopped[1] = 1;
  t0 = now_ms();
  exec_rank_join(rs0);
  exec_rank_join(&fx->j->ranks[1]);
  double join_ms = now_ms() - t0;
  assert_false(rs0->thread_started);
  assert_false(fx->j->ranks[1].thread_started);
  assert_int_equal(atomic_load(&rs0->busy), 0);
  if (join_ms > COLLECTIVE_MS / 2)
    fail_msg("joining took %.0f ms: the peer's stop should wake the collective at once", join_ms);

  if (blocked == NULL)
    blocked = queue_take(&fx->q, rs0, reg_id, 0);
  if (blocked == NULL)
    fail_msg("the blocked registration was never answered");
  expect_error(blocked, ZEROD__V1__STATUS__STATUS_ABORTED, NULL,
               "the registration whose peer stopped");
  exec_op_free(blocked);
  assert_true(job_failed(fx->j, 0, NULL, 0));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      RANK_TEST(test_gather_unknown_unit_is_not_found, 1),
      RANK_TEST(test_gather_unknown_unit_is_not_found, 2),
      RANK_TEST(test_failed_job_answers_aborted, 1),
      RANK_TEST(test_failed_job_answers_aborted, 2),
      RANK_TEST(test_stop_answers_queued_ops_unavailable, 2),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
