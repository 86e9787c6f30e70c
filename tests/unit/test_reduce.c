/* Gradient accumulation, loss-scale removal and the sum of squares.
 *
 * Accumulate and scale are one fp32 operation per element, so they must be
 * bit-exact against the operation done in double and rounded once to fp32
 * (double has more than 2 * 24 + 2 bits, so that rounding is exact too).
 * The non-finite flag must see an Inf or NaN anywhere, including the tail
 * that the vector loop leaves to scalar code, and overflow of the result. */
#include "testutil.h"

static zk_pool *pool2;

static int setup(void **state) {
  return zk_pool_create(2, &pool2);
}

static int teardown(void **state) {
  zk_pool_destroy(pool2);
  return 0;
}

static void test_accumulate_is_exact_for_every_gradient_dtype(void **state) {
  test_rng rng = {11};
  for (size_t si = 0; si < N_TEST_SIZES; si++) {
    size_t n = test_sizes[si];
    float *acc = xmalloc(n * sizeof(float)), *want = xmalloc(n * sizeof(float));
    float *g32 = xmalloc(n * sizeof(float));
    void *g = xmalloc(n * sizeof(float));
    for (int d = ZK_F32; d <= ZK_F16; d++) {
      fill_normal(&rng, acc, n, 1.0);
      fill_normal(&rng, g32, n, 1e-3);
      if (d != ZK_F32) {
        assert_int_equal(zk_cast(NULL, g, (zk_dtype)d, g32, ZK_F32, n), 0);
        assert_int_equal(zk_cast(NULL, g32, ZK_F32, g, (zk_dtype)d, n), 0);
      } else {
        memcpy(g, g32, n * sizeof(float));
      }
      for (size_t i = 0; i < n; i++)
        want[i] = (float)((double)acc[i] + (double)g32[i]);
      int nonfinite = -1;
      assert_int_equal(zk_accumulate(pool2, acc, g, (zk_dtype)d, n, &nonfinite), 0);
      assert_int_equal(nonfinite, 0);
      assert_memory_equal(acc, want, n * sizeof(float));
    }
    free(acc);
    free(want);
    free(g32);
    free(g);
  }
}

static void test_nonfinite_flag_sees_every_position_and_overflow(void **state) {
  const size_t n = 4097 * 40;
  float *acc = xmalloc(n * sizeof(float)), *g = xmalloc(n * sizeof(float));
  const size_t positions[] = {0, 1, 15, 16, 4096, n / 2, n - 2, n - 1};
  const float bad_values[] = {INFINITY, -INFINITY, NAN};
  for (size_t p = 0; p < sizeof positions / sizeof positions[0]; p++)
    for (size_t b = 0; b < 3; b++) {
      for (size_t i = 0; i < n; i++)
        acc[i] = g[i] = 1.0f;
      g[positions[p]] = bad_values[b];
      int nonfinite = 0;
      assert_int_equal(zk_accumulate(pool2, acc, g, ZK_F32, n, &nonfinite), 0);
      if (nonfinite != 1)
        test_fail("accumulate missed %g at %zu", (double)bad_values[b], positions[p]);
      g[positions[p]] = 1.0f;
      acc[positions[p]] = bad_values[b];
      assert_int_equal(zk_scale(pool2, acc, 0.5f, n, &nonfinite), 0);
      if (nonfinite != 1)
        test_fail("scale missed %g at %zu", (double)bad_values[b], positions[p]);
    }
  /* Overflow of finite inputs is caught too. */
  for (size_t i = 0; i < n; i++)
    acc[i] = g[i] = 1.0f;
  acc[n - 1] = g[n - 1] = 3e38f;
  int nonfinite = 0;
  assert_int_equal(zk_accumulate(pool2, acc, g, ZK_F32, n, &nonfinite), 0);
  assert_int_equal(nonfinite, 1);
  acc[n - 1] = 3e38f;
  assert_int_equal(zk_scale(NULL, acc, 65536.0f, n, &nonfinite), 0);
  assert_int_equal(nonfinite, 1);
  free(acc);
  free(g);
}

static void test_scale_is_exact(void **state) {
  test_rng rng = {12};
  const float factors[] = {1.0f / 65536.0f, 0.3f, 1.0f};
  for (size_t si = 0; si < N_TEST_SIZES; si++) {
    size_t n = test_sizes[si];
    float *x = xmalloc(n * sizeof(float)), *want = xmalloc(n * sizeof(float));
    for (size_t f = 0; f < 3; f++) {
      fill_normal(&rng, x, n, 1e4);
      for (size_t i = 0; i < n; i++)
        want[i] = (float)((double)x[i] * factors[f]);
      int nonfinite = -1;
      assert_int_equal(zk_scale(pool2, x, factors[f], n, &nonfinite), 0);
      assert_int_equal(nonfinite, 0);
      assert_memory_equal(x, want, n * sizeof(float));
    }
    free(x);
    free(want);
  }
}

/* Sum of squares against a long-double (x87, 64-bit mantissa) sequential
 * sum. Tolerance: relative 1e-13, far above the kernel's bound of about
 * (log2 n + 64) 2^-53 < 1e-14 and far below fp32 summation error. */
static void test_sumsq_matches_long_double_reference(void **state) {
  test_rng rng = {13};
  for (size_t si = 0; si < N_TEST_SIZES; si++) {
    size_t n = test_sizes[si];
    float *x = xmalloc(n * sizeof(float));
    uint16_t *h = xmalloc(n * sizeof(uint16_t));
    fill_normal(&rng, x, n, 3.0);
    for (int d = ZK_F32; d <= ZK_F16; d++) {
      const void *src = x;
      float *exact = x;
      float *decoded = NULL;
      if (d != ZK_F32) {
        assert_int_equal(zk_cast(NULL, h, (zk_dtype)d, x, ZK_F32, n), 0);
        decoded = xmalloc(n * sizeof(float));
        assert_int_equal(zk_cast(NULL, decoded, ZK_F32, h, (zk_dtype)d, n), 0);
        src = h;
        exact = decoded;
      }
      long double ref = 0;
      for (size_t i = 0; i < n; i++)
        ref += (long double)exact[i] * exact[i];
      double got = -1, got_serial = -1;
      assert_int_equal(zk_sumsq(pool2, src, (zk_dtype)d, n, &got), 0);
      assert_int_equal(zk_sumsq(NULL, src, (zk_dtype)d, n, &got_serial), 0);
      double rel = n == 0 ? fabs(got) : fabs(got - (double)ref) / (double)ref;
      if (!(rel <= 1e-13))
        test_fail("sumsq %s n=%zu: %.17g vs %.17Lg (rel %.3g)", zk_dtype_name((zk_dtype)d), n, got,
                  ref, rel);
      /* Same bits on one thread and on two. */
      assert_memory_equal(&got, &got_serial, sizeof got);
      free(decoded);
    }
    free(x);
    free(h);
  }
}

/* 10^9 bf16 elements (2 GB) of one value whose square is exact: the exact
 * sum is known, and a plain running sum in fp32 would be off by a factor of
 * several, one in double by about 1e-8. */
static void test_sumsq_is_stable_for_a_billion_elements(void **state) {
  const size_t n = 1000000000;
  uint16_t *x = malloc(n * sizeof(uint16_t));
  if (x == NULL) {
    print_message("cannot allocate 2 GB; skipping\n");
    skip();
  }
  float value = 0.1f;
  uint16_t bits;
  assert_int_equal(zk_cast(NULL, &bits, ZK_BF16, &value, ZK_F32, 1), 0);
  float decoded;
  assert_int_equal(zk_cast(NULL, &decoded, ZK_F32, &bits, ZK_BF16, 1), 0);
  for (size_t i = 0; i < n; i++)
    x[i] = bits;
  double got = 0;
  assert_int_equal(zk_sumsq(pool2, x, ZK_BF16, n, &got), 0);
  long double exact = (long double)n * ((long double)decoded * decoded);
  double rel = fabs(got - (double)exact) / (double)exact;
  print_message("sumsq of 1e9 elements: relative error %.3g\n", rel);
  assert_true(rel <= 1e-14);
  free(x);
}

static void test_reduce_rejects_bad_arguments(void **state) {
  float a = 0;
  double s;
  assert_int_equal(zk_accumulate(NULL, &a, &a, ZK_DTYPE_NONE, 1, NULL), -EINVAL);
  assert_int_equal(zk_accumulate(NULL, NULL, &a, ZK_F32, 1, NULL), -EINVAL);
  assert_int_equal(zk_scale(NULL, NULL, 2.0f, 1, NULL), -EINVAL);
  assert_int_equal(zk_sumsq(NULL, &a, ZK_F32, 1, NULL), -EINVAL);
  assert_int_equal(zk_sumsq(NULL, &a, (zk_dtype)7, 1, &s), -EINVAL);
  assert_int_equal(zk_sumsq(NULL, NULL, ZK_F32, 0, &s), 0);
  assert_true(s == 0.0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_accumulate_is_exact_for_every_gradient_dtype),
      cmocka_unit_test(test_nonfinite_flag_sees_every_position_and_overflow),
      cmocka_unit_test(test_scale_is_exact),
      cmocka_unit_test(test_sumsq_matches_long_double_reference),
      cmocka_unit_test(test_sumsq_is_stable_for_a_billion_elements),
      cmocka_unit_test(test_reduce_rejects_bad_arguments),
  };
  return cmocka_run_group_tests_name("reduce", tests, setup, teardown);
}
