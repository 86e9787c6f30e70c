/* Adam, AdamW and SGD against a double-precision reference.
 *
 * Each step is checked quantity by quantity: the new optimizer state from the
 * inputs of the step, then the new weights from the inputs and the kernel's
 * new state, each against the same formula evaluated in double. The kernel
 * rounds every operation to fp32 (as torch does), so each quantity may differ
 * from the double result by a few roundings of the terms it is made of:
 * the tolerance is TOL_ROUNDINGS * 2^-24 * (sum of the magnitudes of the
 * terms). Coefficients such as (float)beta1 are rounded too, which the same
 * bound covers. The fused working copy must be the exact cast of the new
 * weights, and results must not depend on the number of threads.
 * (test_torch_parity.py checks the same kernels against torch.optim.) */
#include "testutil.h"

#define TOL_ROUNDINGS 6.0
#define EPS32         0x1p-24

typedef struct state_arrays {
  size_t n;
  float *param, *m, *v, *grad32;
  void *grad; /* in the gradient dtype */
  void *working;
} state_arrays;

static state_arrays make_state(test_rng *rng, size_t n) {
  state_arrays s = {.n = n};
  s.param = xmalloc(n * sizeof(float));
  s.m = xmalloc(n * sizeof(float));
  s.v = xmalloc(n * sizeof(float));
  s.grad32 = xmalloc(n * sizeof(float));
  s.grad = xmalloc(n * sizeof(float));
  s.working = xmalloc(n * sizeof(float));
  fill_normal(rng, s.param, n, 1.0);
  for (size_t i = 0; i < n; i++) {
    s.m[i] = 0.0f;
    s.v[i] = 0.0f;
  }
  return s;
}

/* A fresh gradient in its dtype, and its exact fp32 value for the reference. */
static void new_gradient(test_rng *rng, state_arrays *s, zk_dtype grad_dtype, double std) {
  fill_normal(rng, s->grad32, s->n, std);
  if (grad_dtype != ZK_F32) {
    assert_int_equal(zk_cast(NULL, s->grad, grad_dtype, s->grad32, ZK_F32, s->n), 0);
    assert_int_equal(zk_cast(NULL, s->grad32, ZK_F32, s->grad, grad_dtype, s->n), 0);
  } else {
    memcpy(s->grad, s->grad32, s->n * sizeof(float));
  }
}

static void free_state(state_arrays *s) {
  free(s->param);
  free(s->m);
  free(s->v);
  free(s->grad32);
  free(s->grad);
  free(s->working);
}

static void check_close(const char *what, size_t i, double got, double want, double magnitude) {
  double tol = TOL_ROUNDINGS * EPS32 * magnitude + 1e-38;
  if (!(fabs(got - want) <= tol))
    test_fail("%s[%zu] = %.9g, reference %.9g, |diff| %.3g > tolerance %.3g", what, i, got, want,
              fabs(got - want), tol);
}

static void check_working_copy(const state_arrays *s, zk_dtype working_dtype) {
  for (size_t i = 0; i < s->n; i++) {
    if (working_dtype == ZK_F32) {
      if (f32_bits(((float *)s->working)[i]) != f32_bits(s->param[i]))
        test_fail("working copy[%zu] is not the fp32 weight", i);
    } else if (working_dtype != ZK_DTYPE_NONE) {
      uint16_t want = ref_encode16(s->param[i], working_dtype == ZK_F16 ? 5 : 8,
                                   working_dtype == ZK_F16 ? 10 : 7);
      if (((uint16_t *)s->working)[i] != want)
        test_fail("%s working copy[%zu] = 0x%04x, want 0x%04x", zk_dtype_name(working_dtype), i,
                  ((uint16_t *)s->working)[i], want);
    }
  }
}

/* ---- Adam / AdamW ------------------------------------------------------ */

static void adam_check_step(const zk_adam_hparams *hp, const float *p0, const float *m0,
                            const float *v0, const state_arrays *s) {
  double bc1 = 1.0 - pow(hp->beta1, (double)hp->step);
  double bc2 = 1.0 - pow(hp->beta2, (double)hp->step);
  for (size_t i = 0; i < s->n; i++) {
    double g = (double)s->grad32[i] * hp->grad_scale;
    double p = p0[i];
    double decay = 1.0, l2 = 0.0;
    if (hp->decoupled_weight_decay)
      decay = 1.0 - hp->lr * hp->weight_decay;
    else
      l2 = hp->weight_decay * p;
    double gg = g + l2;
    double m_terms = fabs(hp->beta1 * m0[i]) + fabs((1 - hp->beta1) * gg) + fabs(l2);
    check_close("exp_avg", i, s->m[i], hp->beta1 * m0[i] + (1 - hp->beta1) * gg, m_terms);
    double v_terms = fabs(hp->beta2 * v0[i]) + fabs((1 - hp->beta2) * gg * gg) * 2 +
                     fabs(2 * (1 - hp->beta2) * gg * l2);
    check_close("exp_avg_sq", i, s->v[i], hp->beta2 * v0[i] + (1 - hp->beta2) * gg * gg, v_terms);
    double update = hp->lr / bc1 * s->m[i] / (sqrt(s->v[i]) / sqrt(bc2) + hp->eps);
    check_close("param", i, s->param[i], p * decay - update, fabs(p * decay) + 2 * fabs(update));
  }
}

static void run_adam_case(int decoupled, zk_dtype grad_dtype, zk_dtype working_dtype,
                          double grad_scale, zk_pool *pool) {
  test_rng rng = {1000 + (uint64_t)grad_dtype * 10 + (uint64_t)working_dtype};
  for (size_t si = 0; si < N_TEST_SIZES; si++) {
    size_t n = test_sizes[si];
    state_arrays s = make_state(&rng, n);
    float *p0 = xmalloc(n * sizeof(float)), *m0 = xmalloc(n * sizeof(float)),
          *v0 = xmalloc(n * sizeof(float));
    zk_adam_hparams hp = {.lr = 1e-3,
                          .beta1 = 0.9,
                          .beta2 = 0.999,
                          .eps = 1e-8,
                          .weight_decay = 1e-2,
                          .decoupled_weight_decay = decoupled,
                          .grad_scale = grad_scale};
    for (int64_t step = 1; step <= 3; step++) {
      hp.step = step;
      new_gradient(&rng, &s, grad_dtype, 1e-2 / grad_scale);
      memcpy(p0, s.param, n * sizeof(float));
      memcpy(m0, s.m, n * sizeof(float));
      memcpy(v0, s.v, n * sizeof(float));
      assert_int_equal(zk_adam_step(pool, &hp, s.param, s.m, s.v, s.grad, grad_dtype, s.working,
                                    working_dtype, n),
                       0);
      adam_check_step(&hp, p0, m0, v0, &s);
      check_working_copy(&s, working_dtype);
    }
    free(p0);
    free(m0);
    free(v0);
    free_state(&s);
  }
}

static void test_adamw_matches_double_reference(void **state) {
  zk_pool *pool;
  assert_int_equal(zk_pool_create(2, &pool), 0);
  for (int g = ZK_F32; g <= ZK_F16; g++)
    run_adam_case(1, (zk_dtype)g, ZK_BF16, 1.0, pool);
  run_adam_case(1, ZK_F32, ZK_F16, 1.0, NULL);
  run_adam_case(1, ZK_F32, ZK_F32, 1.0, NULL);
  run_adam_case(1, ZK_BF16, ZK_DTYPE_NONE, 1.0 / 1024, pool);
  zk_pool_destroy(pool);
}

static void test_adam_l2_matches_double_reference(void **state) {
  zk_pool *pool;
  assert_int_equal(zk_pool_create(2, &pool), 0);
  run_adam_case(0, ZK_F32, ZK_DTYPE_NONE, 1.0, pool);
  run_adam_case(0, ZK_F16, ZK_BF16, 1.0 / 65536, pool);
  zk_pool_destroy(pool);
}

/* ---- SGD --------------------------------------------------------------- */

static void run_sgd_case(double momentum, double dampening, int nesterov, double weight_decay,
                         zk_dtype grad_dtype, zk_dtype working_dtype, zk_pool *pool) {
  test_rng rng = {77 + (uint64_t)nesterov};
  for (size_t si = 0; si < N_TEST_SIZES; si++) {
    size_t n = test_sizes[si];
    state_arrays s = make_state(&rng, n);
    float *p0 = xmalloc(n * sizeof(float)), *b0 = xmalloc(n * sizeof(float));
    zk_sgd_hparams hp = {.lr = 0.05,
                         .momentum = momentum,
                         .dampening = dampening,
                         .weight_decay = weight_decay,
                         .nesterov = nesterov,
                         .grad_scale = 1.0};
    for (int64_t step = 1; step <= 3; step++) {
      hp.step = step;
      new_gradient(&rng, &s, grad_dtype, 1e-1);
      memcpy(p0, s.param, n * sizeof(float));
      memcpy(b0, s.m, n * sizeof(float));
      assert_int_equal(zk_sgd_step(pool, &hp, s.param, momentum != 0 ? s.m : NULL, s.grad,
                                   grad_dtype, s.working, working_dtype, n),
                       0);
      for (size_t i = 0; i < n; i++) {
        double d = (double)s.grad32[i] + weight_decay * p0[i];
        double d_terms = fabs(s.grad32[i]) + fabs(weight_decay * p0[i]);
        double dir = d, dir_terms = d_terms;
        if (momentum != 0) {
          double buf = step == 1 ? d : momentum * b0[i] + (1 - dampening) * d;
          check_close("momentum_buffer", i, s.m[i], buf,
                      d_terms + (step == 1 ? 0 : fabs(momentum * b0[i])));
          dir = nesterov ? d + momentum * s.m[i] : s.m[i];
          dir_terms = nesterov ? d_terms + fabs(momentum * s.m[i]) : fabs(s.m[i]);
        }
        check_close("param", i, s.param[i], p0[i] - hp.lr * dir,
                    fabs(p0[i]) + 2 * hp.lr * dir_terms);
      }
      check_working_copy(&s, working_dtype);
    }
    free(p0);
    free(b0);
    free_state(&s);
  }
}

static void test_sgd_variants_match_double_reference(void **state) {
  zk_pool *pool;
  assert_int_equal(zk_pool_create(2, &pool), 0);
  run_sgd_case(0.0, 0.0, 0, 0.0, ZK_F32, ZK_DTYPE_NONE, pool); /* plain */
  run_sgd_case(0.0, 0.0, 0, 1e-4, ZK_BF16, ZK_BF16, pool);     /* weight decay */
  run_sgd_case(0.9, 0.0, 0, 1e-4, ZK_F32, ZK_BF16, pool);      /* momentum */
  run_sgd_case(0.9, 0.1, 0, 0.0, ZK_F16, ZK_F16, NULL);        /* dampening */
  run_sgd_case(0.9, 0.0, 1, 5e-4, ZK_F32, ZK_F32, pool);       /* Nesterov */
  zk_pool_destroy(pool);
}

/* ---- determinism and argument checks ----------------------------------- */

static void test_results_do_not_depend_on_thread_count(void **state) {
  const size_t n = 1000003;
  test_rng rng = {5};
  state_arrays a = make_state(&rng, n), b = make_state(&rng, n);
  new_gradient(&rng, &a, ZK_BF16, 1e-2);
  memcpy(b.param, a.param, n * sizeof(float));
  memcpy(b.grad, a.grad, n * sizeof(uint16_t));
  zk_pool *pool;
  assert_int_equal(zk_pool_create(3, &pool), 0);
  zk_adam_hparams hp = {.lr = 1e-3,
                        .beta1 = 0.9,
                        .beta2 = 0.95,
                        .eps = 1e-8,
                        .weight_decay = 0.1,
                        .decoupled_weight_decay = 1,
                        .step = 1,
                        .grad_scale = 1.0};
  assert_int_equal(
      zk_adam_step(NULL, &hp, a.param, a.m, a.v, a.grad, ZK_BF16, a.working, ZK_BF16, n), 0);
  assert_int_equal(
      zk_adam_step(pool, &hp, b.param, b.m, b.v, b.grad, ZK_BF16, b.working, ZK_BF16, n), 0);
  assert_memory_equal(a.param, b.param, n * sizeof(float));
  assert_memory_equal(a.v, b.v, n * sizeof(float));
  assert_memory_equal(a.working, b.working, n * sizeof(uint16_t));
  zk_pool_destroy(pool);
  free_state(&a);
  free_state(&b);
}

static void test_bad_hyperparameters_are_rejected(void **state) {
  float p = 1, m = 0, v = 0, g = 1;
  zk_adam_hparams hp = {
      .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .step = 1, .grad_scale = 1.0};
  assert_int_equal(zk_adam_step(NULL, &hp, &p, &m, &v, &g, ZK_F32, NULL, ZK_DTYPE_NONE, 1), 0);
  zk_adam_hparams bad = hp;
  bad.step = 0;
  assert_int_equal(zk_adam_step(NULL, &bad, &p, &m, &v, &g, ZK_F32, NULL, ZK_DTYPE_NONE, 1),
                   -EINVAL);
  bad = hp;
  bad.beta2 = 1.0;
  assert_int_equal(zk_adam_step(NULL, &bad, &p, &m, &v, &g, ZK_F32, NULL, ZK_DTYPE_NONE, 1),
                   -EINVAL);
  bad = hp;
  bad.lr = NAN;
  assert_int_equal(zk_adam_step(NULL, &bad, &p, &m, &v, &g, ZK_F32, NULL, ZK_DTYPE_NONE, 1),
                   -EINVAL);
  bad = hp;
  bad.grad_scale = 0.0;
  assert_int_equal(zk_adam_step(NULL, &bad, &p, &m, &v, &g, ZK_F32, NULL, ZK_DTYPE_NONE, 1),
                   -EINVAL);
  assert_int_equal(zk_adam_step(NULL, &hp, &p, &m, &v, &g, ZK_DTYPE_NONE, NULL, ZK_DTYPE_NONE, 1),
                   -EINVAL);
  assert_int_equal(zk_adam_step(NULL, &hp, &p, &m, &v, &g, ZK_F32, NULL, ZK_BF16, 1), -EINVAL);
  assert_int_equal(zk_adam_step(NULL, NULL, &p, &m, &v, &g, ZK_F32, NULL, ZK_DTYPE_NONE, 1),
                   -EINVAL);
  assert_true(p != 1.0f); /* only the first, valid call changed anything */
  float p_after = p;

  zk_sgd_hparams sgd = {
      .lr = 0.1, .momentum = 0.9, .dampening = 0.1, .nesterov = 1, .step = 1, .grad_scale = 1.0};
  float buf = 0;
  assert_int_equal(zk_sgd_step(NULL, &sgd, &p, &buf, &g, ZK_F32, NULL, ZK_DTYPE_NONE, 1), -EINVAL);
  sgd.dampening = 0.0;
  assert_int_equal(zk_sgd_step(NULL, &sgd, &p, NULL, &g, ZK_F32, NULL, ZK_DTYPE_NONE, 1), -EINVAL);
  assert_true(p == p_after);
  assert_int_equal(zk_sgd_step(NULL, &sgd, &p, &buf, &g, ZK_F32, NULL, ZK_DTYPE_NONE, 1), 0);
  assert_true(p != p_after);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_adamw_matches_double_reference),
      cmocka_unit_test(test_adam_l2_matches_double_reference),
      cmocka_unit_test(test_sgd_variants_match_double_reference),
      cmocka_unit_test(test_results_do_not_depend_on_thread_count),
      cmocka_unit_test(test_bad_hyperparameters_are_rejected),
  };
  return cmocka_run_group_tests_name("optim", tests, NULL, NULL);
}
