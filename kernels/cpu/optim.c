/* optim.c - CPU drivers of the optimizer steps (Adam, AdamW, SGD).
 *
 * Each step is one pass over the shard: read the gradient (in its dtype),
 * update the fp32 master weights and optimizer state in place, and write the
 * working copy in the same pass, so the state is streamed through memory
 * once. The element math is zk_adam_update / zk_sgd_update from
 * math_optim.h; this file only chooses a specialised loop for the dtypes and
 * splits the array over the pool.
 */
#include <errno.h>

#include "../args.h"
#include "internal.h"

/* ---- Adam / AdamW ------------------------------------------------------ */

typedef void (*adam_loop_fn)(const zk_adam_coef *coef, float *restrict param,
                             float *restrict exp_avg, float *restrict exp_avg_sq,
                             const void *restrict grad, void *restrict working, size_t begin,
                             size_t end);

ZK_ALWAYS_INLINE void adam_loop(const zk_adam_coef *coef_in, float *restrict param,
                                float *restrict exp_avg, float *restrict exp_avg_sq,
                                const void *restrict grad, zk_dtype grad_dtype,
                                void *restrict working, zk_dtype working_dtype, size_t begin,
                                size_t end) {
  /* A local copy tells the compiler the coefficients cannot change under
   * the stores of the loop. */
  const zk_adam_coef coef = *coef_in;
  for (size_t i = begin; i < end; i++) {
    float p = zk_adam_update(&coef, param[i], &exp_avg[i], &exp_avg_sq[i],
                             zk_load_f32(grad, grad_dtype, i));
    param[i] = p;
    zk_store_f32(working, working_dtype, i, p);
  }
}

/* One loop per (gradient dtype, working dtype) pair, each compiled for
 * several instruction sets. */
#define ADAM_LOOP(G, W)                                                                            \
  ZK_VECTOR_LOOP static void adam_loop_##G##_##W(                                                  \
      const zk_adam_coef *coef, float *restrict param, float *restrict exp_avg,                    \
      float *restrict exp_avg_sq, const void *restrict grad, void *restrict working, size_t begin, \
      size_t end) {                                                                                \
    adam_loop(coef, param, exp_avg, exp_avg_sq, grad, ZK_##G, working, ZK_##W, begin, end);        \
  }
#define ADAM_LOOPS(G)                                                                              \
  ADAM_LOOP(G, F32) ADAM_LOOP(G, BF16) ADAM_LOOP(G, F16) ADAM_LOOP(G, DTYPE_NONE)
ADAM_LOOPS(F32)
ADAM_LOOPS(BF16)
ADAM_LOOPS(F16)

/* Indexed [grad dtype][working dtype], in zk_dtype order. */
#define ADAM_ROW(G)                                                                                \
  { adam_loop_##G##_F32, adam_loop_##G##_BF16, adam_loop_##G##_F16, adam_loop_##G##_DTYPE_NONE }
static const adam_loop_fn adam_loops[3][4] = {ADAM_ROW(F32), ADAM_ROW(BF16), ADAM_ROW(F16)};

typedef struct adam_job {
  adam_loop_fn loop;
  zk_adam_coef coef;
  float *param, *exp_avg, *exp_avg_sq;
  const void *grad;
  void *working;
  size_t numel;
} adam_job;

static void adam_task(void *ctx, int task, int n_tasks) {
  adam_job *job = ctx;
  size_t begin, end;
  zk_split(job->numel, task, n_tasks, &begin, &end);
  if (begin < end)
    job->loop(&job->coef, job->param, job->exp_avg, job->exp_avg_sq, job->grad, job->working, begin,
              end);
}

int zk_adam_step(zk_pool *pool, const zk_adam_hparams *hp, float *param, float *exp_avg,
                 float *exp_avg_sq, const void *grad, zk_dtype grad_dtype, void *working,
                 zk_dtype working_dtype, size_t numel) {
  adam_job job = {.param = param,
                  .exp_avg = exp_avg,
                  .exp_avg_sq = exp_avg_sq,
                  .grad = grad,
                  .working = working,
                  .numel = numel};
  int rc = zk_adam_prepare(hp, &job.coef, param, exp_avg, exp_avg_sq, grad, grad_dtype, working,
                           working_dtype, numel);
  if (rc != 0)
    return rc == ZK_NOTHING_TO_DO ? 0 : rc;
  job.loop = adam_loops[grad_dtype][working_dtype];
  zk_pool_run(pool, zk_task_count(pool, numel), adam_task, &job);
  return 0;
}

/* ---- SGD --------------------------------------------------------------- */

typedef void (*sgd_loop_fn)(const zk_sgd_coef *coef, float *restrict param,
                            float *restrict momentum_buf, const void *restrict grad,
                            void *restrict working, size_t begin, size_t end);

ZK_ALWAYS_INLINE void sgd_loop(const zk_sgd_coef *coef_in, float *restrict param,
                               float *restrict momentum_buf, const void *restrict grad,
                               zk_dtype grad_dtype, void *restrict working, zk_dtype working_dtype,
                               size_t begin, size_t end) {
  const zk_sgd_coef coef = *coef_in;
  if (coef.has_momentum) {
    for (size_t i = begin; i < end; i++) {
      float p = zk_sgd_update(&coef, param[i], &momentum_buf[i], zk_load_f32(grad, grad_dtype, i));
      param[i] = p;
      zk_store_f32(working, working_dtype, i, p);
    }
  } else {
    /* Without momentum there is no buffer (it may be NULL); the update never
     * touches this stand-in. */
    float unused = 0.0f;
    for (size_t i = begin; i < end; i++) {
      float p = zk_sgd_update(&coef, param[i], &unused, zk_load_f32(grad, grad_dtype, i));
      param[i] = p;
      zk_store_f32(working, working_dtype, i, p);
    }
  }
}

#define SGD_LOOP(G, W)                                                                             \
  ZK_VECTOR_LOOP static void sgd_loop_##G##_##W(                                                   \
      const zk_sgd_coef *coef, float *restrict param, float *restrict momentum_buf,                \
      const void *restrict grad, void *restrict working, size_t begin, size_t end) {               \
    sgd_loop(coef, param, momentum_buf, grad, ZK_##G, working, ZK_##W, begin, end);                \
  }
#define SGD_LOOPS(G) SGD_LOOP(G, F32) SGD_LOOP(G, BF16) SGD_LOOP(G, F16) SGD_LOOP(G, DTYPE_NONE)
SGD_LOOPS(F32)
SGD_LOOPS(BF16)
SGD_LOOPS(F16)

#define SGD_ROW(G)                                                                                 \
  { sgd_loop_##G##_F32, sgd_loop_##G##_BF16, sgd_loop_##G##_F16, sgd_loop_##G##_DTYPE_NONE }
static const sgd_loop_fn sgd_loops[3][4] = {SGD_ROW(F32), SGD_ROW(BF16), SGD_ROW(F16)};

typedef struct sgd_job {
  sgd_loop_fn loop;
  zk_sgd_coef coef;
  float *param, *momentum_buf;
  const void *grad;
  void *working;
  size_t numel;
} sgd_job;

static void sgd_task(void *ctx, int task, int n_tasks) {
  sgd_job *job = ctx;
  size_t begin, end;
  zk_split(job->numel, task, n_tasks, &begin, &end);
  if (begin < end)
    job->loop(&job->coef, job->param, job->momentum_buf, job->grad, job->working, begin, end);
}

int zk_sgd_step(zk_pool *pool, const zk_sgd_hparams *hp, float *param, float *momentum_buf,
                const void *grad, zk_dtype grad_dtype, void *working, zk_dtype working_dtype,
                size_t numel) {
  sgd_job job = {.param = param,
                 .momentum_buf = momentum_buf,
                 .grad = grad,
                 .working = working,
                 .numel = numel};
  int rc = zk_sgd_prepare(hp, &job.coef, param, momentum_buf, grad, grad_dtype, working,
                          working_dtype, numel);
  if (rc != 0)
    return rc == ZK_NOTHING_TO_DO ? 0 : rc;
  job.loop = sgd_loops[grad_dtype][working_dtype];
  zk_pool_run(pool, zk_task_count(pool, numel), sgd_task, &job);
  return 0;
}
