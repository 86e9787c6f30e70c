/* The thread pool: every task runs exactly once per job, on any number of
 * threads, job after job, and bad arguments are refused. */
#include <stdatomic.h>

#include "testutil.h"

typedef struct count_ctx {
  atomic_int runs[1000];
  atomic_int wrong_total;
} count_ctx;

static void count_task(void *ctx, int task, int n_tasks) {
  count_ctx *c = ctx;
  atomic_fetch_add(&c->runs[task], 1);
  if (task < 0 || task >= n_tasks)
    atomic_fetch_add(&c->wrong_total, 1);
}

static void check_each_task_runs_once(zk_pool *pool, int n_tasks) {
  count_ctx *c = calloc(1, sizeof *c);
  zk_pool_run(pool, n_tasks, count_task, c);
  for (int t = 0; t < n_tasks; t++)
    if (atomic_load(&c->runs[t]) != 1)
      test_fail("%d tasks on %d threads: task %d ran %d times", n_tasks, zk_pool_size(pool), t,
                atomic_load(&c->runs[t]));
  for (int t = n_tasks; t < 1000; t++)
    assert_int_equal(atomic_load(&c->runs[t]), 0);
  assert_int_equal(atomic_load(&c->wrong_total), 0);
  free(c);
}

static void test_every_task_runs_exactly_once(void **state) {
  int threads[] = {1, 2, 3, 8};
  int tasks[] = {0, 1, 2, 3, 7, 64, 1000};
  for (size_t i = 0; i < sizeof threads / sizeof threads[0]; i++) {
    zk_pool *pool;
    assert_int_equal(zk_pool_create(threads[i], &pool), 0);
    assert_int_equal(zk_pool_size(pool), threads[i]);
    for (size_t j = 0; j < sizeof tasks / sizeof tasks[0]; j++)
      check_each_task_runs_once(pool, tasks[j]);
    zk_pool_destroy(pool);
  }
  check_each_task_runs_once(NULL, 5);
  assert_int_equal(zk_pool_size(NULL), 1);
}

static void test_many_back_to_back_jobs_complete(void **state) {
  zk_pool *pool;
  assert_int_equal(zk_pool_create(4, &pool), 0);
  for (int round = 0; round < 2000; round++)
    check_each_task_runs_once(pool, 1 + round % 9);
  zk_pool_destroy(pool);
}

static void test_create_rejects_bad_thread_counts(void **state) {
  zk_pool *pool = NULL;
  assert_int_equal(zk_pool_create(0, &pool), -EINVAL);
  assert_int_equal(zk_pool_create(-3, &pool), -EINVAL);
  assert_int_equal(zk_pool_create(100000, &pool), -EINVAL);
  assert_int_equal(zk_pool_create(2, NULL), -EINVAL);
  assert_null(pool);
  zk_pool_destroy(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_task_runs_exactly_once),
      cmocka_unit_test(test_many_back_to_back_jobs_complete),
      cmocka_unit_test(test_create_rejects_bad_thread_counts),
  };
  return cmocka_run_group_tests_name("pool", tests, NULL, NULL);
}
