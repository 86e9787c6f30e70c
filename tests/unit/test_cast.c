/* Casts between fp32 and bf16/fp16, checked bit for bit against a reference
 * written from the formats' definitions (testutil.h), on every special
 * class (NaN, +-Inf, +-0, subnormals, ties, overflow), on a sweep through the
 * whole fp32 range, and exhaustively for the widening direction. */
#include "testutil.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

enum { F16_E = 5, F16_M = 10, BF16_E = 8, BF16_M = 7 };

/* Runs the narrowing cast on n values through the driver (with the given
 * pool) and compares with the reference; returns the number of mismatches
 * and reports the first. */
static size_t check_narrowing(zk_pool *pool, const float *src, size_t n, zk_dtype dtype) {
  uint16_t *out = xmalloc(n * sizeof *out);
  assert_int_equal(zk_cast(pool, out, dtype, src, ZK_F32, n), 0);
  int ebits = dtype == ZK_F16 ? F16_E : BF16_E, mbits = dtype == ZK_F16 ? F16_M : BF16_M;
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    uint16_t want = ref_encode16(src[i], ebits, mbits);
    if (out[i] != want && bad++ == 0)
      print_error("%s(0x%08x = %a): got 0x%04x, want 0x%04x\n", zk_dtype_name(dtype),
                  f32_bits(src[i]), (double)src[i], out[i], want);
  }
  free(out);
  return bad;
}

/* Values on and around every rounding decision: for each exponent, mantissas
 * whose discarded bits are 0, 1, just under half, exactly half (a tie, with
 * the kept part even and odd), just over half, and all ones. */
static size_t boundary_values(float *out, int discarded_bits) {
  size_t n = 0;
  uint32_t half = 1u << (discarded_bits - 1), all = (1u << discarded_bits) - 1;
  uint32_t lows[] = {0, 1, half - 1, half, half + 1, all};
  uint32_t keeps[] = {0, 1, 2, 3, 0x7fffffu >> discarded_bits, (0x7fffffu >> discarded_bits) - 1};
  for (uint32_t sign = 0; sign < 2; sign++)
    for (uint32_t e = 0; e < 256; e++)
      for (size_t k = 0; k < sizeof keeps / sizeof keeps[0]; k++)
        for (size_t l = 0; l < sizeof lows / sizeof lows[0]; l++) {
          uint32_t mant = ((keeps[k] << discarded_bits) | lows[l]) & 0x7fffffu;
          out[n++] = bits_f32((sign << 31) | (e << 23) | mant);
        }
  return n;
}

static const uint32_t special_bits[] = {
    0x00000000, 0x80000000,             /* +-0 */
    0x7f800000, 0xff800000,             /* +-Inf */
    0x7fc00000, 0xffc00000, 0x7fc00001, /* quiet NaNs */
    0x7f800001, 0xff800001, 0x7fa00000, /* signalling NaNs: must stay NaN */
    0x00000001, 0x80000001, 0x007fffff, /* fp32 subnormals */
    0x00800000, 0x7f7fffff, 0xff7fffff, /* smallest normal, largest finite */
    0x477fe000, 0x477fefff, 0x477ff000, /* 65504, just under and at the fp16 overflow tie */
    0x477ff001, 0x47800000,             /* above it: Inf */
    0x38800000, 0x387fe000, 0x387ff000, /* fp16 normal/subnormal boundary */
    0x33000000, 0x33000001, 0x33800000, /* half and above half of the smallest fp16 subnormal */
    0x32ffffff, 0x337fffff, 0x33c00000, /* just below, ... 1.5 x (tie to even 2) */
    0x7f7f8000, 0x7f7f7fff, 0x7f7fffff, /* bf16 overflow tie and neighbours */
    0x3f808000, 0x3f818000,             /* bf16 ties: to even down and up */
};

static void test_narrowing_special_values_are_bit_exact(void **state) {
  size_t n = sizeof special_bits / sizeof special_bits[0];
  float src[sizeof special_bits / sizeof special_bits[0]];
  for (size_t i = 0; i < n; i++)
    src[i] = bits_f32(special_bits[i]);
  assert_int_equal(check_narrowing(NULL, src, n, ZK_F16), 0);
  assert_int_equal(check_narrowing(NULL, src, n, ZK_BF16), 0);
}

static void test_narrowing_rounding_boundaries_are_bit_exact(void **state) {
  float *src = xmalloc(2 * 256 * 36 * sizeof *src);
  size_t n = boundary_values(src, 13);
  assert_int_equal(check_narrowing(NULL, src, n, ZK_F16), 0);
  n = boundary_values(src, 16);
  assert_int_equal(check_narrowing(NULL, src, n, ZK_BF16), 0);
  free(src);
}

/* A sweep through all 2^32 patterns with a stride co-prime to every field
 * boundary: 16.7 million values covering every exponent, sign and NaN class. */
static void test_narrowing_sweep_of_fp32_range_is_bit_exact(void **state) {
  const size_t n = ((size_t)1 << 32) / 257 + 1;
  float *src = xmalloc(n * sizeof *src);
  for (size_t i = 0; i < n; i++)
    src[i] = bits_f32((uint32_t)(i * 257u));
  zk_pool *pool;
  assert_int_equal(zk_pool_create(2, &pool), 0);
  assert_int_equal(check_narrowing(pool, src, n, ZK_F16), 0);
  assert_int_equal(check_narrowing(pool, src, n, ZK_BF16), 0);
  zk_pool_destroy(pool);
  free(src);
}

/* Every fp32 below 2^-13 and above 2^-26 in magnitude: the whole fp16
 * subnormal range and the normal range's bottom, where the rounding position
 * moves with the exponent. */
static void test_fp16_subnormal_range_is_exhaustively_bit_exact(void **state) {
  uint32_t lo = 0x32800000u, hi = 0x39000000u;
  size_t n = hi - lo;
  float *src = xmalloc(n * sizeof *src);
  for (size_t i = 0; i < n; i++)
    src[i] = bits_f32(lo + (uint32_t)i);
  assert_int_equal(check_narrowing(NULL, src, n, ZK_F16), 0);
  for (size_t i = 0; i < n; i++)
    src[i] = -src[i];
  assert_int_equal(check_narrowing(NULL, src, n, ZK_F16), 0);
  free(src);
}

#if defined(__x86_64__) && defined(__GNUC__)
/* The CPU's own conversion instruction (F16C, round to nearest even) is a
 * second reference that nobody here wrote; it is compared on all 2^32
 * inputs where the instruction exists. F16C keeps NaN payloads the way zk
 * does. */
__attribute__((target("f16c"))) static size_t f16c_compare_all(zk_pool *pool) {
  const size_t chunk = (size_t)1 << 24;
  float *src = xmalloc(chunk * sizeof *src);
  uint16_t *out = xmalloc(chunk * sizeof *out);
  size_t bad = 0;
  for (uint64_t base = 0; base < ((uint64_t)1 << 32); base += chunk) {
    for (size_t i = 0; i < chunk; i++)
      src[i] = bits_f32((uint32_t)(base + i));
    assert_int_equal(zk_cast(pool, out, ZK_F16, src, ZK_F32, chunk), 0);
    for (size_t i = 0; i < chunk; i += 8) {
      __m128i hw = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
      uint16_t want[8];
      _mm_storeu_si128((__m128i *)want, hw);
      for (int j = 0; j < 8; j++)
        if (out[i + j] != want[j] && bad++ == 0)
          print_error("f16(0x%08x): got 0x%04x, F16C says 0x%04x\n", f32_bits(src[i + j]),
                      out[i + j], want[j]);
    }
  }
  free(out);
  free(src);
  return bad;
}

static void test_f16_matches_hardware_f16c_on_all_inputs(void **state) {
  unsigned eax, ebx, ecx, edx;
  /* CPUID leaf 1: ECX bit 29 is F16C, bit 28 AVX (which the 256-bit form needs). */
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 29)) || !(ecx & (1u << 28))) {
    print_message("this CPU has no F16C; the hardware comparison is skipped\n");
    skip();
  }
  zk_pool *pool;
  assert_int_equal(zk_pool_create(2, &pool), 0);
  assert_int_equal(f16c_compare_all(pool), 0);
  zk_pool_destroy(pool);
}
#endif

static void test_widening_is_exact_for_all_16bit_patterns(void **state) {
  uint16_t src[65536];
  float out[65536];
  for (uint32_t i = 0; i < 65536; i++)
    src[i] = (uint16_t)i;
  for (int k = 0; k < 2; k++) {
    zk_dtype dtype = k == 0 ? ZK_F16 : ZK_BF16;
    int ebits = k == 0 ? F16_E : BF16_E, mbits = k == 0 ? F16_M : BF16_M;
    assert_int_equal(zk_cast(NULL, out, ZK_F32, src, dtype, 65536), 0);
    for (uint32_t i = 0; i < 65536; i++) {
      float want = ref_decode16((uint16_t)i, ebits, mbits);
      if (f32_bits(out[i]) != f32_bits(want))
        test_fail("%s 0x%04x: got 0x%08x, want 0x%08x", zk_dtype_name(dtype), i, f32_bits(out[i]),
                  f32_bits(want));
      /* And back through the kernel: every value survives the round trip,
       * except that a signalling NaN comes back quiet. */
      uint16_t back;
      assert_int_equal(zk_cast(NULL, &back, dtype, &out[i], ZK_F32, 1), 0);
      uint16_t want_back = (uint16_t)i;
      if (isnan(out[i]))
        want_back |= (uint16_t)(1u << (mbits - 1));
      if (back != want_back)
        test_fail("%s 0x%04x does not round-trip (0x%04x)", zk_dtype_name(dtype), i, back);
    }
  }
}

static void test_cast_handles_awkward_sizes_and_threads(void **state) {
  test_rng rng = {42};
  zk_pool *pool;
  assert_int_equal(zk_pool_create(2, &pool), 0);
  for (size_t s = 0; s < N_TEST_SIZES; s++) {
    size_t n = test_sizes[s];
    float *src = xmalloc(n * sizeof *src), *back = xmalloc((n + 1) * sizeof *back);
    uint16_t *half = xmalloc((n + 1) * sizeof *half);
    fill_normal(&rng, src, n, 100.0);
    half[n] = 0xbeef; /* a guard: nothing past numel may be written */
    assert_int_equal(check_narrowing(pool, src, n, ZK_BF16), 0);
    assert_int_equal(zk_cast(pool, half, ZK_BF16, src, ZK_F32, n), 0);
    assert_int_equal(half[n], 0xbeef);
    back[n] = 7.0f;
    assert_int_equal(zk_cast(pool, back, ZK_F32, half, ZK_BF16, n), 0);
    assert_true(back[n] == 7.0f);
    for (size_t i = 0; i < n; i++)
      assert_true(f32_bits(back[i]) == f32_bits(ref_decode16(half[i], BF16_E, BF16_M)));
    assert_int_equal(zk_cast(pool, back, ZK_F32, src, ZK_F32, n), 0);
    assert_memory_equal(back, src, n * sizeof *src);
    free(src);
    free(back);
    free(half);
  }
  zk_pool_destroy(pool);
}

static void test_cast_rejects_unsupported_pairs(void **state) {
  float f = 1.0f;
  uint16_t h = 0;
  assert_int_equal(zk_cast(NULL, &h, ZK_F16, &h, ZK_BF16, 1), -EINVAL);
  assert_int_equal(zk_cast(NULL, &h, ZK_DTYPE_NONE, &f, ZK_F32, 1), -EINVAL);
  assert_int_equal(zk_cast(NULL, &h, (zk_dtype)99, &f, ZK_F32, 1), -EINVAL);
  assert_int_equal(zk_cast(NULL, NULL, ZK_F16, &f, ZK_F32, 1), -EINVAL);
  assert_int_equal(zk_cast(NULL, NULL, ZK_F16, NULL, ZK_F32, 0), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_narrowing_special_values_are_bit_exact),
    cmocka_unit_test(test_narrowing_rounding_boundaries_are_bit_exact),
    cmocka_unit_test(test_narrowing_sweep_of_fp32_range_is_bit_exact),
    cmocka_unit_test(test_fp16_subnormal_range_is_exhaustively_bit_exact),
#if defined(__x86_64__) && defined(__GNUC__)
    cmocka_unit_test(test_f16_matches_hardware_f16c_on_all_inputs),
#endif
    cmocka_unit_test(test_widening_is_exact_for_all_16bit_patterns),
    cmocka_unit_test(test_cast_handles_awkward_sizes_and_threads),
    cmocka_unit_test(test_cast_rejects_unsupported_pairs),
  };
  return cmocka_run_group_tests_name("cast", tests, NULL, NULL);
}
