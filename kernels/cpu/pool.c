/* pool.c - the thread pool that spreads one parallel loop over the cores.
 *
 * The pool runs one job at a time: zk_pool_run publishes (fn, ctx, n_tasks)
 * under the mutex, bumps a generation counter and wakes the workers. Tasks
 * are claimed from an atomic counter, so the caller and every worker take
 * whatever is left and a slow thread never holds the others back. The caller
 * returns only after every worker has left the job, so ctx may live on the
 * caller's stack.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "../zk.h"

struct zk_pool {
  int n_threads; /* including the caller */
  pthread_t *workers;
  pthread_mutex_t mutex;
  pthread_cond_t job_ready;
  pthread_cond_t job_done;
  uint64_t generation; /* bumped for each job; guarded by mutex */
  int busy_workers;    /* workers still inside the current job; guarded by mutex */
  int stopping;
  zk_task_fn fn;
  void *ctx;
  int n_tasks;
  atomic_int next_task;
};

static void pool_work(zk_pool *pool, zk_task_fn fn, void *ctx, int n_tasks) {
  for (;;) {
    int task = atomic_fetch_add_explicit(&pool->next_task, 1, memory_order_relaxed);
    if (task >= n_tasks)
      return;
    fn(ctx, task, n_tasks);
  }
}

static void *pool_worker_main(void *arg) {
  zk_pool *pool = arg;
  uint64_t seen = 0;
  pthread_setname_np(pthread_self(), "zd-kernel"); /* for top -H, gdb, tests */
  pthread_mutex_lock(&pool->mutex);
  for (;;) {
    while (pool->generation == seen && !pool->stopping)
      pthread_cond_wait(&pool->job_ready, &pool->mutex);
    if (pool->stopping)
      break;
    seen = pool->generation;
    zk_task_fn fn = pool->fn;
    void *ctx = pool->ctx;
    int n_tasks = pool->n_tasks;
    pthread_mutex_unlock(&pool->mutex);

    pool_work(pool, fn, ctx, n_tasks);

    pthread_mutex_lock(&pool->mutex);
    if (--pool->busy_workers == 0)
      pthread_cond_signal(&pool->job_done);
  }
  pthread_mutex_unlock(&pool->mutex);
  return NULL;
}

int zk_pool_create(int n_threads, zk_pool **pool_out) {
  if (pool_out == NULL || n_threads < 1 || n_threads > ZK_POOL_MAX_THREADS)
    return -EINVAL;
  zk_pool *pool = calloc(1, sizeof *pool);
  if (pool == NULL)
    return -ENOMEM;
  pool->n_threads = 1;
  pthread_mutex_init(&pool->mutex, NULL);
  pthread_cond_init(&pool->job_ready, NULL);
  pthread_cond_init(&pool->job_done, NULL);
  atomic_init(&pool->next_task, 0);
  pool->workers = calloc((size_t)n_threads, sizeof *pool->workers);
  if (pool->workers == NULL) {
    zk_pool_destroy(pool);
    return -ENOMEM;
  }
  for (int i = 1; i < n_threads; i++) {
    int err = pthread_create(&pool->workers[i - 1], NULL, pool_worker_main, pool);
    if (err != 0) {
      zk_pool_destroy(pool);
      return -err;
    }
    pool->n_threads++;
  }
  *pool_out = pool;
  return 0;
}

void zk_pool_destroy(zk_pool *pool) {
  if (pool == NULL)
    return;
  pthread_mutex_lock(&pool->mutex);
  pool->stopping = 1;
  pthread_cond_broadcast(&pool->job_ready);
  pthread_mutex_unlock(&pool->mutex);
  for (int i = 0; i < pool->n_threads - 1; i++)
    pthread_join(pool->workers[i], NULL);
  pthread_cond_destroy(&pool->job_done);
  pthread_cond_destroy(&pool->job_ready);
  pthread_mutex_destroy(&pool->mutex);
  free(pool->workers);
  free(pool);
}

int zk_pool_size(const zk_pool *pool) {
  return pool == NULL ? 1 : pool->n_threads;
}

void zk_pool_run(zk_pool *pool, int n_tasks, zk_task_fn fn, void *ctx) {
  if (n_tasks <= 0)
    return;
  if (pool == NULL || pool->n_threads == 1 || n_tasks == 1) {
    for (int task = 0; task < n_tasks; task++)
      fn(ctx, task, n_tasks);
    return;
  }
  pthread_mutex_lock(&pool->mutex);
  pool->fn = fn;
  pool->ctx = ctx;
  pool->n_tasks = n_tasks;
  atomic_store_explicit(&pool->next_task, 0, memory_order_relaxed);
  pool->busy_workers = pool->n_threads - 1;
  pool->generation++;
  pthread_cond_broadcast(&pool->job_ready);
  pthread_mutex_unlock(&pool->mutex);

  pool_work(pool, fn, ctx, n_tasks);

  pthread_mutex_lock(&pool->mutex);
  while (pool->busy_workers > 0)
    pthread_cond_wait(&pool->job_done, &pool->mutex);
  pthread_mutex_unlock(&pool->mutex);
}
