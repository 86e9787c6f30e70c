/* The node's job registry (daemon/node/jobs.c) with a daemon set up by
 * hand: a uv loop, the in-memory rendezvous store and exec settings whose
 * completion callback queues finished ops for the test (as in test_rank.c;
 * the daemon's is ipc_complete).
 *
 * What jobs_start needs of the daemon: d->exec (the job points to it) and
 * nothing else. It makes the job's checkpoint state itself
 * (ckpt_node_job_init); ckpt_node_init (the async handle on the loop that
 * turns checkpoint progress into heartbeats) is not needed: wake_loop only
 * uses the handle once d->ckpt_async_ready is set, and no checkpoint order
 * is given here. The checkpoint hooks are the node's own (ckpt_node_hooks);
 * no rank reaches them without an order. No IPC listener, no cluster.
 *
 * The executors run for real (host device, Gloo over the store): jobs_start
 * queues each rank's OP_COMM_INIT without a session, so the test sees them
 * through rank_state.comm_ready, and checks that the executors answer by
 * queueing an OP_SESSION_BEGIN with a session (a pointer never
 * dereferenced). Shutdown is the daemon's: stop every rank of every job,
 * join them all, then jobs_free. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "test_clock.h"
#include <uv.h>

#include "ckpt_node.h"
#include "daemon.h"
#include "exec.h"
#include "frame.h"
#include "job.h"
#include "jobs.h"
#include "pin.h"
#include "store.h"

#define COLLECTIVE_MS 20000
#define WAIT_MS       30000

static char session_target;
#define TEST_SESSION ((struct session *)&session_target)

/* ---- Completions ------------------------------------------------------------------ */

typedef struct done_queue {
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  exec_op *head;
} done_queue;

static void on_complete(void *ctx, exec_op *op) {
  done_queue *q = ctx;
  pthread_mutex_lock(&q->mutex);
  op->next = q->head;
  q->head = op;
  pthread_cond_broadcast(&q->cond);
  pthread_mutex_unlock(&q->mutex);
}

/* exec_settings.stopped: executors tell the loop they exited. */
static _Atomic int executors_stopped;
static void on_stopped(void *ctx) {
  atomic_fetch_add(&executors_stopped, 1);
}

/* The op of `rs` with `request_id`, waiting up to WAIT_MS; NULL if none. */
static exec_op *queue_take(done_queue *q, const rank_state *rs, uint64_t request_id) {
  double deadline = now_ms() + WAIT_MS;
  pthread_mutex_lock(&q->mutex);
  for (;;) {
    for (exec_op **at = &q->head; *at != NULL; at = &(*at)->next) {
      exec_op *op = *at;
      if (op->rank == rs && op->request_id == request_id) {
        *at = op->next;
        op->next = NULL;
        pthread_mutex_unlock(&q->mutex);
        return op;
      }
    }
    if (now_ms() > deadline) {
      pthread_mutex_unlock(&q->mutex);
      return NULL;
    }
    /* The cond uses the realtime clock; a short wait and a recheck are
     * enough here. */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 50 * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&q->cond, &q->mutex, &ts);
  }
}

/* ---- The daemon ------------------------------------------------------------------ */

typedef struct fixture {
  uv_loop_t loop;
  zdaemon d;
  store *st;
  done_queue q;
  uint64_t next_request;
} fixture;

static int setup_daemon(void **state) {
  fixture *fx = calloc(1, sizeof *fx);
  assert_non_null(fx);
  assert_int_equal(uv_loop_init(&fx->loop), 0);
  assert_int_equal(store_mem_create(&fx->st), 0);
  pthread_mutex_init(&fx->q.mutex, NULL);
  pthread_cond_init(&fx->q.cond, NULL);
  fx->next_request = 1;
  zdaemon *d = &fx->d;
  d->loop = &fx->loop;
  d->listen_fd = -1;
  d->lock_fd = -1;
  d->rendezvous = fx->st;
  d->next_job_id = 1;
  atomic_store(&executors_stopped, 0);
  d->exec = (exec_settings){.complete = on_complete,
                            .stopped = on_stopped,
                            .ctx = &fx->q,
                            .ckpt = ckpt_node_hooks,
                            .device = "cpu",
                            .threads_per_rank = 1,
                            .collective_timeout_ms = COLLECTIVE_MS,
                            .comm_hostname = NULL,
                            .rendezvous = fx->st};
  *state = fx;
  return 0;
}

/* The daemon's shutdown (main.c): jobs_stop_all, the completions drained,
 * then jobs_free_all. */
static int teardown_daemon(void **state) {
  fixture *fx = *state;
  zdaemon *d = &fx->d;
  jobs_stop_all(d);
  while (fx->q.head != NULL) {
    exec_op *op = fx->q.head;
    fx->q.head = op->next;
    exec_op_free(op);
  }
  jobs_free_all(d);
  assert_int_equal(uv_loop_close(&fx->loop), 0);
  fx->st->ops->destroy(fx->st);
  pthread_mutex_destroy(&fx->q.mutex);
  pthread_cond_destroy(&fx->q.cond);
  free(fx);
  *state = NULL;
  return 0;
}

static job_config default_config(void) {
  job_config c;
  char err[256] = "";
  assert_int_equal(job_config_from_proto(NULL, &c, err, sizeof err), 0);
  if (job_config_finish(&c, 64u << 20, err, sizeof err) != 0)
    fail_msg("job_config_finish refused the defaults: %s", err);
  return c;
}

/* jobs_start of a job hosting every rank of a world. */
static job *start_job(fixture *fx, const char *name, int world, unsigned generation) {
  job_config config = default_config();
  job *j = NULL;
  char err[256] = "";
  uint64_t id = fx->d.next_job_id++;
  int rc = jobs_start(&fx->d, name, "token", &config, world, world, 0, id, generation, &j, err,
                      sizeof err);
  if (rc != 0)
    fail_msg("jobs_start(%s, world %d) returned %d (%s), expected 0", name, world, rc, err);
  assert_non_null(j);
  assert_int_equal(j->id, id);
  return j;
}

/* Waits until every rank of j has built its communicator of `generation`
 * (the OP_COMM_INIT jobs_start or jobs_reset queued). */
static void wait_comm_ready(job *j, unsigned generation) {
  double deadline = now_ms() + WAIT_MS;
  for (int r = 0; r < j->nranks; r++)
    while (atomic_load(&j->ranks[r].comm_ready) != generation + 1) {
      char reason[512] = "";
      if (job_failed(j, generation, reason, sizeof reason))
        fail_msg("job '%s' failed building generation %u: %s", j->name, generation, reason);
      if (now_ms() > deadline)
        fail_msg("job '%s' rank %d: communicator of generation %u not ready within %d ms "
                 "(comm_ready %u)",
                 j->name, r, generation, WAIT_MS, atomic_load(&j->ranks[r].comm_ready));
      sleep_ms(2);
    }
}

/* Every rank of j answers an OP_SESSION_BEGIN through the daemon's
 * completion callback: its executor is running. */
static void expect_ranks_answer(fixture *fx, job *j) {
  uint64_t id = fx->next_request++;
  for (int r = 0; r < j->nranks; r++) {
    exec_op *op = exec_op_new(OP_SESSION_BEGIN, &j->ranks[r]);
    assert_non_null(op);
    op->session = TEST_SESSION;
    op->session_id = 1;
    op->request_id = id;
    exec_submit(op);
  }
  for (int r = 0; r < j->nranks; r++) {
    exec_op *op = queue_take(&fx->q, &j->ranks[r], id);
    if (op == NULL)
      fail_msg("job '%s' rank %d did not answer OP_SESSION_BEGIN within %d ms", j->name, r,
               WAIT_MS);
    zd_frame_header h;
    assert_non_null(op->reply_frame);
    assert_int_equal(zd_frame_header_decode(op->reply_frame, op->reply_bytes, &h, NULL), 0);
    if (h.type != ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY)
      fail_msg("job '%s' rank %d answered OP_SESSION_BEGIN with type %u (status %d), expected an "
               "AttachReply",
               j->name, r, h.type, op->status);
    exec_op_free(op);
  }
}

static int registry_contains(const zdaemon *d, const job *j) {
  for (const job *k = d->jobs; k != NULL; k = k->next)
    if (k == j)
      return 1;
  return 0;
}

/* ---- Tests ------------------------------------------------------------------------ */

static void test_start_adds_a_job_that_find_finds_by_name(void **state) {
  fixture *fx = *state;
  zdaemon *d = &fx->d;
  assert_null(jobs_find(d, "alpha"));
  job *j = start_job(fx, "alpha", 1, 0);
  assert_ptr_equal(jobs_find(d, "alpha"), j);
  assert_ptr_equal(d->jobs, j);
  assert_string_equal(j->name, "alpha");
  assert_string_equal(j->token_sha256, "token");
  assert_ptr_equal(j->owner, d);
  assert_ptr_equal(j->exec, &d->exec);
  assert_non_null(j->ckpt); /* the job's checkpoint state, made by jobs_start */
  assert_int_equal(j->generation, 0);
  for (int r = 0; r < j->nranks; r++)
    assert_true(j->ranks[r].thread_started);
  wait_comm_ready(j, 0);
  expect_ranks_answer(fx, j);
  /* Names are matched whole. */
  assert_null(jobs_find(d, "alph"));
  assert_null(jobs_find(d, "alpha2"));
}

static void test_second_job_with_another_name_coexists(void **state) {
  fixture *fx = *state;
  zdaemon *d = &fx->d;
  job *a = start_job(fx, "alpha", 1, 0);
  job *b = start_job(fx, "beta", 2, 0);
  assert_true(a != b);
  assert_ptr_equal(jobs_find(d, "alpha"), a);
  assert_ptr_equal(jobs_find(d, "beta"), b);
  assert_null(jobs_find(d, "gamma"));
  assert_true(a->id != b->id);
  /* Their communicators rendezvous under their own names in one store. */
  wait_comm_ready(a, 0);
  wait_comm_ready(b, 0);
  expect_ranks_answer(fx, a);
  expect_ranks_answer(fx, b);
}

static void test_retire_removes_the_job_and_stops_its_executors(void **state) {
  fixture *fx = *state;
  zdaemon *d = &fx->d;
  job *a = start_job(fx, "alpha", 2, 0);
  job *b = start_job(fx, "beta", 1, 0);
  wait_comm_ready(a, 0);
  wait_comm_ready(b, 0);

  jobs_retire(d, a);
  assert_null(jobs_find(d, "alpha"));
  if (registry_contains(d, a))
    fail_msg("a retired job is still in d->jobs");
  assert_ptr_equal(d->retired, a);
  assert_null(a->next);
  assert_true(a->pins_stopping); /* its readers give up */
  assert_ptr_equal(jobs_find(d, "beta"), b);

  /* Its executors were told to stop: they end without any other help. */
  double t0 = now_ms();
  for (int r = 0; r < a->nranks; r++) {
    exec_rank_join(&a->ranks[r]);
    assert_false(a->ranks[r].thread_started);
    assert_int_equal(atomic_load(&a->ranks[r].busy), 0);
  }
  if (now_ms() - t0 > COLLECTIVE_MS / 2)
    fail_msg("the retired job's executors took %.0f ms to stop", now_ms() - t0);
  /* The other job goes on. */
  expect_ranks_answer(fx, b);

  /* Freed after the join (ASan's leak check covers the rest). */
  d->retired = a->next;
  jobs_free(a);
  assert_null(d->retired);
  assert_ptr_equal(jobs_find(d, "beta"), b);

  /* A job of the retired one's name may be created again, and its ranks
   * rendezvous under the same prefix ("alpha/0") as the retired job's did. */
  job *again = start_job(fx, "alpha", 2, 0);
  assert_ptr_equal(jobs_find(d, "alpha"), again);
  wait_comm_ready(again, 0);
}

/* Waits until `n` executors have called exec_settings.stopped. */
static void wait_executors_stopped(int n) {
  double t0 = now_ms();
  while (atomic_load(&executors_stopped) < n) {
    if (now_ms() - t0 > COLLECTIVE_MS)
      fail_msg("%d of %d executors stopped after %.0f ms", atomic_load(&executors_stopped), n,
               now_ms() - t0);
    usleep(1000);
  }
}

static void test_reap_frees_a_retired_job_once_its_executors_stopped(void **state) {
  fixture *fx = *state;
  zdaemon *d = &fx->d;
  job *a = start_job(fx, "alpha", 2, 0);
  job *b = start_job(fx, "beta", 1, 0);
  wait_comm_ready(a, 0);
  jobs_retire(d, a);
  wait_executors_stopped(2);
  for (int r = 0; r < a->nranks; r++)
    assert_true(atomic_load(&a->ranks[r].stopped));
  jobs_reap(d); /* joins and frees it: ASan's leak check holds it to that */
  assert_null(d->retired);
  assert_ptr_equal(jobs_find(d, "beta"), b);
  expect_ranks_answer(fx, b);
}

static void test_reap_keeps_a_retired_job_a_reader_holds(void **state) {
  fixture *fx = *state;
  zdaemon *d = &fx->d;
  job *a = start_job(fx, "alpha", 1, 0);
  wait_comm_ready(a, 0);
  a->readers = 1; /* a read-only session whose state is not yet freed */
  jobs_retire(d, a);
  wait_executors_stopped(1);
  jobs_reap(d);
  assert_ptr_equal(d->retired, a); /* the reader may still read its memory */
  a->readers = 0;
  jobs_reap(d);
  assert_null(d->retired);
}

static void test_reap_does_nothing_while_the_daemon_stops(void **state) {
  fixture *fx = *state;
  zdaemon *d = &fx->d;
  job *a = start_job(fx, "alpha", 1, 0);
  jobs_retire(d, a);
  wait_executors_stopped(1);
  d->stopping = 1; /* shutdown joins and frees every job itself */
  jobs_reap(d);
  assert_ptr_equal(d->retired, a);
  d->stopping = 0;
}

static void test_retire_twice_changes_nothing(void **state) {
  fixture *fx = *state;
  zdaemon *d = &fx->d;
  job *a = start_job(fx, "alpha", 1, 0);
  job *b = start_job(fx, "beta", 1, 0);
  jobs_retire(d, a);
  jobs_retire(d, a); /* already out of d->jobs: nothing happens */
  assert_ptr_equal(d->retired, a);
  assert_null(a->next);
  assert_ptr_equal(d->jobs, b);
  assert_null(b->next);
}

static void test_reset_builds_the_next_generation(void **state) {
  fixture *fx = *state;
  job *j = start_job(fx, "alpha", 2, 3);
  assert_int_equal(j->generation, 3);
  wait_comm_ready(j, 3);
  job_fail(j, 3, "a worker died");
  jobs_reset(j);
  assert_int_equal(j->generation, 4);
  wait_comm_ready(j, 4);
  assert_false(job_failed(j, 4, NULL, 0));
  expect_ranks_answer(fx, j);
}

static void test_start_refuses_ranks_that_do_not_fit(void **state) {
  fixture *fx = *state;
  zdaemon *d = &fx->d;
  job_config config = default_config();
  job *j = NULL;
  char err[256] = "";
  int rc = jobs_start(d, "alpha", "token", &config, 1, 2, 0, 1, 0, &j, err, sizeof err);
  if (rc != -EINVAL)
    fail_msg("jobs_start of 2 ranks in a world of 1 returned %d, expected -EINVAL", rc);
  assert_null(j);
  if (strstr(err, "do not fit") == NULL)
    fail_msg("the message \"%s\" should say the ranks do not fit the world", err);
  assert_null(d->jobs);
  assert_null(jobs_find(d, "alpha"));
}

#define JOBS_TEST(fn) cmocka_unit_test_setup_teardown(fn, setup_daemon, teardown_daemon)

int main(void) {
  const struct CMUnitTest tests[] = {
      JOBS_TEST(test_start_adds_a_job_that_find_finds_by_name),
      JOBS_TEST(test_second_job_with_another_name_coexists),
      JOBS_TEST(test_retire_removes_the_job_and_stops_its_executors),
      JOBS_TEST(test_reap_frees_a_retired_job_once_its_executors_stopped),
      JOBS_TEST(test_reap_keeps_a_retired_job_a_reader_holds),
      JOBS_TEST(test_reap_does_nothing_while_the_daemon_stops),
      JOBS_TEST(test_retire_twice_changes_nothing),
      JOBS_TEST(test_reset_builds_the_next_generation),
      JOBS_TEST(test_start_refuses_ranks_that_do_not_fit),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
