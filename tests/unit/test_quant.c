/* Block-wise int8/int4 quantization: the measured error stays within the
 * bound documented in zk.h on several distributions, values on the
 * quantization grid round-trip exactly (and are packed as documented),
 * non-finite blocks are flagged and poison only themselves, and malformed
 * formats or buffer sizes are refused. */
#include "testutil.h"

static zk_pool *pool2;

static int setup(void **state) {
  return zk_pool_create(2, &pool2);
}

static int teardown(void **state) {
  zk_pool_destroy(pool2);
  return 0;
}

static const zk_qformat formats[] = {
    {8, ZK_QSYM, 1},     {8, ZK_QSYM, 33},  {8, ZK_QSYM, 2048},  {8, ZK_QASYM, 33},
    {8, ZK_QASYM, 2048}, {4, ZK_QSYM, 2},   {4, ZK_QSYM, 64},    {4, ZK_QSYM, 2048},
    {4, ZK_QASYM, 2},    {4, ZK_QASYM, 64}, {4, ZK_QASYM, 4096},
};
#define N_FORMATS (sizeof formats / sizeof formats[0])

static float read_f32(const uint8_t *p) {
  float f;
  memcpy(&f, p, sizeof f);
  return f;
}

/* Quantizes x, dequantizes, and checks every element against the bound
 * computed from its block's range and the stored scale. Returns the largest
 * error / bound ratio seen. */
static double check_error_bound(const zk_qformat *fmt, const float *x, size_t n) {
  size_t bytes = zk_quant_bytes(fmt, n);
  uint8_t *q = xmalloc(bytes);
  float *y = xmalloc(n * sizeof(float));
  int nonfinite = -1;
  assert_int_equal(zk_quantize(pool2, fmt, x, n, q, bytes, &nonfinite), 0);
  assert_int_equal(nonfinite, 0);
  assert_int_equal(zk_dequantize(pool2, fmt, q, bytes, y, n), 0);
  int zero_point = fmt->mode == ZK_QASYM;
  double qmax = zero_point ? (1 << fmt->bits) - 1 : (1 << (fmt->bits - 1)) - 1;
  size_t n_blocks = (n + fmt->block_numel - 1) / fmt->block_numel;
  double worst = 0;
  for (size_t b = 0; b < n_blocks; b++) {
    size_t begin = b * fmt->block_numel;
    size_t end = begin + fmt->block_numel < n ? begin + fmt->block_numel : n;
    double lo = INFINITY, hi = -INFINITY;
    for (size_t i = begin; i < end; i++) {
      lo = fmin(lo, x[i]);
      hi = fmax(hi, x[i]);
    }
    double m = fmax(fabs(lo), fabs(hi));
    double want_scale = zero_point ? (hi - lo) / qmax : m / qmax;
    double scale = read_f32(q + b * 4);
    if (fabs(scale - want_scale) > want_scale * 0x1p-23)
      test_fail("block %zu: scale %.9g, expected %.9g", b, scale, want_scale);
    if (zero_point && read_f32(q + (n_blocks + b) * 4) != (float)lo)
      test_fail("block %zu: stored minimum %.9g, expected %.9g", b,
                (double)read_f32(q + (n_blocks + b) * 4), lo);
    double bound = 0.5001 * scale + (zero_point ? 0x1p-22 * m : 0.0);
    for (size_t i = begin; i < end; i++) {
      double err = fabs((double)y[i] - (double)x[i]);
      if (!(err <= bound))
        test_fail("int%d %s block %zu: |x - x'| = %.3g at %zu (x = %.9g) exceeds bound %.3g",
                  fmt->bits, zero_point ? "zero-point" : "symmetric", fmt->block_numel, err, i,
                  (double)x[i], bound);
      if (bound > 0 && err / bound > worst)
        worst = err / bound;
    }
  }
  free(q);
  free(y);
  return worst;
}

static void test_error_is_within_documented_bound(void **state) {
  test_rng rng = {21};
  for (size_t f = 0; f < N_FORMATS; f++) {
    double worst = 0;
    for (size_t si = 0; si < N_TEST_SIZES; si++) {
      size_t n = test_sizes[si];
      float *x = xmalloc(n * sizeof(float));
      /* Centred data, data far from zero (stresses the zero-point offset
       * term), and heavy-tailed data. */
      for (int dist = 0; dist < 3; dist++) {
        for (size_t i = 0; i < n; i++) {
          double z = rng_normal(&rng);
          x[i] = (float)(dist == 0 ? z : dist == 1 ? 1000.0 + z * 1e-2 : z * z * z * 1e-3);
        }
        double w = check_error_bound(&formats[f], x, n);
        worst = w > worst ? w : worst;
      }
      free(x);
    }
    print_message("int%d %-10s block %5zu: worst error / bound = %.4f\n", formats[f].bits,
                  formats[f].mode == ZK_QASYM ? "zero-point" : "symmetric", formats[f].block_numel,
                  worst);
  }
}

/* Values that lie on the grid of their block come back exactly, and the
 * codes are stored as documented (two's complement or unsigned; for 4 bits
 * element 2i in the low nibble). */
static void test_grid_values_round_trip_exactly_and_pack_as_documented(void **state) {
  test_rng rng = {22};
  const size_t n = 4097;
  for (size_t f = 0; f < N_FORMATS; f++) {
    const zk_qformat *fmt = &formats[f];
    int zero_point = fmt->mode == ZK_QASYM;
    int qmax = zero_point ? (1 << fmt->bits) - 1 : (1 << (fmt->bits - 1)) - 1;
    int qmin = zero_point ? 0 : -qmax;
    const float step = 0.25f, lo = zero_point ? -1.5f : 0.0f;
    int *codes = xmalloc(n * sizeof(int));
    float *x = xmalloc(n * sizeof(float)), *y = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
      /* Each block holds both ends of the range, so its scale is exactly `step`. */
      size_t in_block = i % fmt->block_numel;
      codes[i] = in_block == 0   ? qmax
                 : in_block == 1 ? qmin
                                 : qmin + (int)(rng_next(&rng) % (uint64_t)(qmax - qmin + 1));
      /* A block of one element (block size 1, or the last, partial block)
       * cannot hold both ends: its one value sets the scale alone. */
      int alone = fmt->block_numel == 1 || (in_block == 0 && i == n - 1);
      if (alone)
        codes[i] = zero_point ? 0 : qmax;
      x[i] = lo + (float)codes[i] * step;
    }
    size_t bytes = zk_quant_bytes(fmt, n);
    uint8_t *q = xmalloc(bytes);
    assert_int_equal(zk_quantize(pool2, fmt, x, n, q, bytes, NULL), 0);
    assert_int_equal(zk_dequantize(pool2, fmt, q, bytes, y, n), 0);
    for (size_t i = 0; i < n; i++)
      if (x[i] != y[i])
        test_fail("int%d block %zu: grid value %g came back as %g", fmt->bits, fmt->block_numel,
                  (double)x[i], (double)y[i]);
    size_t n_blocks = (n + fmt->block_numel - 1) / fmt->block_numel;
    const uint8_t *data = q + n_blocks * 4 * (zero_point ? 2 : 1);
    if (fmt->block_numel > 1) {
      for (size_t i = 0; i < n; i++) {
        int stored = fmt->bits == 8 ? (zero_point ? data[i] : (int8_t)data[i])
                                    : (i % 2 ? data[i / 2] >> 4 : data[i / 2] & 0xf);
        if (fmt->bits == 4 && !zero_point && stored >= 8)
          stored -= 16;
        if (stored != codes[i])
          test_fail("int%d element %zu stored as %d, expected code %d", fmt->bits, i, stored,
                    codes[i]);
      }
      if (fmt->bits == 4 && n % 2)
        assert_int_equal(data[n / 2] >> 4, 0); /* the unused last nibble is zero */
    }
    free(codes);
    free(x);
    free(y);
    free(q);
  }
}

static void test_nonfinite_block_is_flagged_and_only_it_is_poisoned(void **state) {
  const zk_qformat fmt = {8, ZK_QSYM, 64};
  const size_t n = 64 * 5;
  float x[64 * 5], y[64 * 5];
  for (size_t i = 0; i < n; i++)
    x[i] = (float)i / 100.0f;
  x[64 * 2 + 5] = INFINITY;
  uint8_t q[5 * 4 + 64 * 5];
  int nonfinite = 0;
  assert_int_equal(zk_quant_bytes(&fmt, n), sizeof q);
  assert_int_equal(zk_quantize(NULL, &fmt, x, n, q, sizeof q, &nonfinite), 0);
  assert_int_equal(nonfinite, 1);
  assert_int_equal(zk_dequantize(NULL, &fmt, q, sizeof q, y, n), 0);
  for (size_t i = 0; i < n; i++) {
    int in_bad_block = i / 64 == 2;
    if (in_bad_block != !!isnan(y[i]))
      test_fail("element %zu: %g (block 2 must be NaN, the others finite)", i, (double)y[i]);
  }
}

static void test_bad_formats_and_sizes_are_refused(void **state) {
  float x[8] = {0}, y[8];
  uint8_t q[64];
  const zk_qformat bad[] = {{5, ZK_QSYM, 8},
                            {4, ZK_QSYM, 3},
                            {8, ZK_QSYM, 0},
                            {8, (zk_qmode)9, 8},
                            {8, ZK_QSYM, ZK_QBLOCK_MAX + 1}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    assert_int_equal(zk_qformat_check(&bad[i]), -EINVAL);
    assert_int_equal(zk_quant_bytes(&bad[i], 8), 0);
    assert_int_equal(zk_quantize(NULL, &bad[i], x, 8, q, sizeof q, NULL), -EINVAL);
    assert_int_equal(zk_dequantize(NULL, &bad[i], q, sizeof q, y, 8), -EINVAL);
  }
  const zk_qformat ok = {4, ZK_QASYM, 4};
  size_t bytes = zk_quant_bytes(&ok, 8);
  assert_int_equal(bytes, 2 * 2 * 4 + 4);
  assert_int_equal(zk_quantize(NULL, &ok, x, 8, q, bytes - 1, NULL), -EINVAL);
  assert_int_equal(zk_dequantize(NULL, &ok, q, bytes + 1, y, 8), -EINVAL);
  assert_int_equal(zk_quant_bytes(&ok, SIZE_MAX), 0);
  /* An element count whose size cannot be computed matches no buffer size,
   * not even the 0 that zk_quant_bytes reports for it. */
  assert_int_equal(zk_quantize(NULL, &ok, x, SIZE_MAX, q, 0, NULL), -EINVAL);
  assert_int_equal(zk_dequantize(NULL, &ok, q, 0, y, SIZE_MAX / 8), -EINVAL);
  assert_int_equal(zk_quantize(NULL, &ok, x, 8, q, bytes, NULL), 0);
  assert_int_equal(zk_dequantize(NULL, &ok, q, bytes, y, 8), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_error_is_within_documented_bound),
      cmocka_unit_test(test_grid_values_round_trip_exactly_and_pack_as_documented),
      cmocka_unit_test(test_nonfinite_block_is_flagged_and_only_it_is_poisoned),
      cmocka_unit_test(test_bad_formats_and_sizes_are_refused),
  };
  return cmocka_run_group_tests_name("quant", tests, setup, teardown);
}
