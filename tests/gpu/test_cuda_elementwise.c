/* test_cuda_elementwise.c - the element-wise drivers of libzerod_cuda.so
 * (cast, accumulate, scale, sum of squares, quantize, dequantize) against the
 * CPU drivers of zk.h.
 *
 * Every kernel runs on the same random inputs on both sides, at sizes 0, 1,
 * 7 (tails shorter than a vector), 4097 and 1000003 (many blocks, odd tail),
 * and scale and sum of squares once more over 2^31 + 9 elements (64-bit
 * indexing). The program reaches the GPU only through the module's table,
 * allocations and copies included, as zerod does; it links no CUDA library.
 *
 * Tolerances, and why:
 * - casts, accumulate, scale, dequantize: bit-exact, except that two NaNs
 *   count as equal whatever their payloads (GPU arithmetic returns the
 *   canonical NaN where x86 propagates an operand's payload). Casts are
 *   integer code and are compared byte for byte, NaNs included.
 * - non-finite flags: equal.
 * - sum of squares: relative difference at most 1e-12 (the two drivers sum
 *   in different orders, each with error near 1e-15).
 * - quantize: identical bytes (scales, minimums, codes).
 *
 * Without a usable GPU the program prints one "SKIP: ..." line and exits 77
 * (ctest's SKIP_RETURN_CODE), unless ZEROD_REQUIRE_GPU=1 makes that a
 * failure.
 */
#include "gpu_testutil.h"

/* ------------------------------------------------------------------------ */
/* Casts                                                                    */
/* ------------------------------------------------------------------------ */

/* Random bit patterns cover every class of value: NaNs with payloads (quiet
 * and signalling), infinities, subnormals, values that overflow the 16-bit
 * formats, and rounding ties. The first elements are the awkward cases. */
static void fill_cast_source(rng *r, void *src, zk_dtype dtype, size_t n) {
  static const uint32_t f32_specials[] = {
      0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,
      0x7fc00000u, 0xffc00001u, 0x7f800001u, /* signalling NaN */
      0x00000001u,                           /* smallest fp32 subnormal */
      0x477ff000u,                           /* 65520: f16 overflow tie */
      0x477fefffu,                           /* just below it */
      0x33000000u,                           /* 2^-25: half the smallest f16 subnormal (tie to 0) */
      0x33000001u, 0x3f808000u,              /* bf16 tie to even */
      0x3f818000u, 0x7f7fffffu,              /* largest finite: bf16 overflow */
  };
  static const uint16_t h16_specials[] = {0x0000, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0x7c01,
                                          0x0001, 0x03ff, 0x0400, 0x7bff, 0x7f80, 0xff81};
  for (size_t i = 0; i < n; i++) {
    uint64_t bits = rng_next(r);
    if (dtype == ZK_F32) {
      size_t k = sizeof f32_specials / sizeof f32_specials[0];
      ((uint32_t *)src)[i] = i < k ? f32_specials[i] : (uint32_t)bits;
    } else {
      size_t k = sizeof h16_specials / sizeof h16_specials[0];
      ((uint16_t *)src)[i] = i < k ? h16_specials[i] : (uint16_t)bits;
    }
  }
}

static void test_cast_matches_cpu_bit_exact(void **state) {
  static const zk_dtype pairs[][2] = {
      {ZK_F32, ZK_BF16}, {ZK_F32, ZK_F16}, {ZK_BF16, ZK_F32}, {ZK_F16, ZK_F32}, {ZK_F32, ZK_F32}};
  char what[96];
  for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
    zk_dtype src_dtype = pairs[p][0], dst_dtype = pairs[p][1];
    for (size_t s = 0; s < N_SIZES; s++) {
      size_t n = test_sizes[s];
      rng r = {case_seed(3, (int)p, 0, 0, n)};
      size_t src_bytes = dtype_bytes(src_dtype, n), dst_bytes = dtype_bytes(dst_dtype, n);
      void *src = xmalloc(src_bytes), *want = xmalloc(dst_bytes), *got = xmalloc(dst_bytes);
      fill_cast_source(&r, src, src_dtype, n);
      assert_int_equal(zk_cast(NULL, want, dst_dtype, src, src_dtype, n), 0);
      void *d_src = dev_upload(src, src_bytes), *d_dst = dev_alloc(dst_bytes);
      CU_OK(cu->cast(NULL, d_dst, dst_dtype, d_src, src_dtype, n));
      dev_download(got, d_dst, dst_bytes);
      snprintf(what, sizeof what, "cast %s -> %s numel %zu", zk_dtype_name(src_dtype),
               zk_dtype_name(dst_dtype), n);
      check_bytes(what, want, got, dst_bytes);
      dev_free(d_src);
      dev_free(d_dst);
      free(src);
      free(want);
      free(got);
    }
  }
}

/* ------------------------------------------------------------------------ */
/* Accumulate, scale                                                        */
/* ------------------------------------------------------------------------ */

/* Puts an Inf or a NaN at a few random places, when `specials` is set. */
static void sprinkle_nonfinite(rng *r, float *x, size_t n, int specials) {
  if (!specials || n == 0)
    return;
  static const uint32_t bad[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc12345u};
  for (int k = 0; k < 3; k++)
    memcpy(&x[rng_next(r) % n], &bad[rng_next(r) % 4], sizeof(float));
}

static void test_accumulate_matches_cpu(void **state) {
  char what[96];
  for (size_t g = 0; g < 3; g++) {
    zk_dtype dtype = grad_dtypes[g];
    for (int specials = 0; specials <= 2; specials++)
      for (size_t s = 0; s < N_SIZES; s++) {
        size_t n = test_sizes[s];
        rng r = {case_seed(4, (int)g, specials, 0, n)};
        float *acc = xmalloc(n * 4), *src_f = xmalloc(n * 4), *got = xmalloc(n * 4);
        void *src = xmalloc(dtype_bytes(dtype, n));
        /* specials 1: non-finite gradients; 2: sums that overflow. */
        fill_values(&r, acc, n, -8, specials == 2 ? 127 : 4);
        fill_values(&r, src_f, n, -8, specials == 2 ? 127 : 4);
        if (dtype != ZK_F32 && specials == 2)
          fill_values(&r, src_f, n, -8, 15);
        sprinkle_nonfinite(&r, src_f, n, specials == 1);
        store_as(src, dtype, src_f, n);

        float *d_acc = dev_upload(acc, n * 4);
        void *d_src = dev_upload(src, dtype_bytes(dtype, n));
        int *d_flag = dev_alloc(sizeof(int));
        CU_OK(cu->memset(d_flag, 0, sizeof(int)));
        int want_flag = -1, got_flag = -1;
        assert_int_equal(zk_accumulate(NULL, acc, src, dtype, n, &want_flag), 0);
        CU_OK(cu->accumulate(NULL, d_acc, d_src, dtype, n, d_flag));
        dev_download(got, d_acc, n * 4);
        dev_download(&got_flag, d_flag, sizeof(int));
        snprintf(what, sizeof what, "accumulate %s numel %zu specials %d", zk_dtype_name(dtype), n,
                 specials);
        check_ulp(what, acc, got, ZK_F32, n, 0);
        if (got_flag != want_flag)
          fail_msg("%s: non-finite flag CPU %d, GPU %d", what, want_flag, got_flag);

        dev_free(d_acc);
        dev_free(d_src);
        dev_free(d_flag);
        free(acc);
        free(src_f);
        free(got);
        free(src);
      }
  }
}

static void test_scale_matches_cpu(void **state) {
  static const float factors[] = {0x1p-10f, 3.0f, 0x1p100f, 0.0f};
  char what[96];
  for (size_t f = 0; f < sizeof factors / sizeof factors[0]; f++)
    for (int specials = 0; specials <= 1; specials++)
      for (size_t s = 0; s < N_SIZES; s++) {
        size_t n = test_sizes[s];
        rng r = {case_seed(5, (int)f, specials, 0, n)};
        float *x = xmalloc(n * 4), *got = xmalloc(n * 4);
        fill_values(&r, x, n, -20, 40);
        sprinkle_nonfinite(&r, x, n, specials);
        float *d_x = dev_upload(x, n * 4);
        int *d_flag = dev_alloc(sizeof(int));
        CU_OK(cu->memset(d_flag, 0, sizeof(int)));
        int want_flag = -1, got_flag = -1;
        assert_int_equal(zk_scale(NULL, x, factors[f], n, &want_flag), 0);
        CU_OK(cu->scale(NULL, d_x, factors[f], n, d_flag));
        dev_download(got, d_x, n * 4);
        dev_download(&got_flag, d_flag, sizeof(int));
        snprintf(what, sizeof what, "scale by %g numel %zu specials %d", (double)factors[f], n,
                 specials);
        check_ulp(what, x, got, ZK_F32, n, 0);
        if (got_flag != want_flag)
          fail_msg("%s: non-finite flag CPU %d, GPU %d", what, want_flag, got_flag);
        dev_free(d_x);
        dev_free(d_flag);
        free(x);
        free(got);
      }
}

/* The device flag collects: a finite launch never clears it, and NULL
 * means "not asked". */
static void test_nonfinite_flag_is_never_cleared(void **state) {
  const size_t n = 1000;
  float x[1000];
  for (size_t i = 0; i < n; i++)
    x[i] = (float)i;
  float *d_x = dev_upload(x, sizeof x);
  int *d_flag = dev_alloc(sizeof(int));
  int flag = 1;
  CU_OK(cu->copy_to_device(d_flag, &flag, sizeof flag));
  CU_OK(cu->scale(NULL, d_x, 0.5f, n, d_flag));
  CU_OK(cu->accumulate(NULL, d_x, d_x, ZK_F32, n, d_flag));
  dev_download(&flag, d_flag, sizeof flag);
  assert_int_equal(flag, 1);

  flag = 0;
  CU_OK(cu->copy_to_device(d_flag, &flag, sizeof flag));
  CU_OK(cu->scale(NULL, d_x, 0.5f, n, d_flag));
  dev_download(&flag, d_flag, sizeof flag);
  assert_int_equal(flag, 0);
  CU_OK(cu->scale(NULL, d_x, INFINITY, n, NULL));
  CU_OK(cu->scale(NULL, d_x, 1.0f, n, d_flag));
  dev_download(&flag, d_flag, sizeof flag);
  assert_int_equal(flag, 1);
  dev_free(d_x);
  dev_free(d_flag);
}

/* ------------------------------------------------------------------------ */
/* Sum of squares                                                           */
/* ------------------------------------------------------------------------ */

static void test_sumsq_matches_cpu(void **state) {
  for (size_t g = 0; g < 3; g++) {
    zk_dtype dtype = grad_dtypes[g];
    for (size_t s = 0; s < N_SIZES; s++) {
      size_t n = test_sizes[s];
      rng r = {case_seed(6, (int)g, 0, 0, n)};
      float *x_f = xmalloc(n * 4);
      void *x = xmalloc(dtype_bytes(dtype, n));
      fill_values(&r, x_f, n, -20, 10);
      store_as(x, dtype, x_f, n);
      double want = -1.0;
      assert_int_equal(zk_sumsq(NULL, x, dtype, n, &want), 0);

      void *d_x = dev_upload(x, dtype_bytes(dtype, n));
      double *d_sum = dev_alloc(sizeof(double));
      double zero = 0.0, got = -1.0, again = -1.0, twice = -1.0;
      CU_OK(cu->copy_to_device(d_sum, &zero, sizeof zero));
      CU_OK(cu->sumsq(NULL, d_x, dtype, n, d_sum));
      dev_download(&got, d_sum, sizeof got);
      if (fabs(got - want) > SUMSQ_REL_TOL * fabs(want))
        fail_msg("sumsq %s numel %zu: CPU %.17g, GPU %.17g, relative difference %.3g (max %g)",
                 zk_dtype_name(dtype), n, want, got, fabs(got - want) / want, SUMSQ_REL_TOL);

      /* Added to the device sum, not stored: a second launch doubles it. */
      CU_OK(cu->sumsq(NULL, d_x, dtype, n, d_sum));
      dev_download(&twice, d_sum, sizeof twice);
      assert_true(twice == got + got);
      /* Deterministic: the same array gives the same bits. */
      CU_OK(cu->copy_to_device(d_sum, &zero, sizeof zero));
      CU_OK(cu->sumsq(NULL, d_x, dtype, n, d_sum));
      dev_download(&again, d_sum, sizeof again);
      assert_memory_equal(&again, &got, sizeof got);

      dev_free(d_x);
      dev_free(d_sum);
      free(x_f);
      free(x);
    }
  }
}

/* ------------------------------------------------------------------------ */
/* Quantization                                                             */
/* ------------------------------------------------------------------------ */

/* Values whose magnitude changes from block to block (so scales differ),
 * and, when `specials` is set, blocks that are all zero, that mix signed
 * zeros, that are constant, and that hold Inf or NaN. */
static void fill_quant_input(rng *r, float *x, size_t n, size_t block, int specials) {
  size_t n_blocks = (n + block - 1) / block;
  for (size_t b = 0; b < n_blocks; b++) {
    size_t begin = b * block, end = begin + block < n ? begin + block : n;
    int e = (int)(rng_next(r) % 40) - 30;
    for (size_t i = begin; i < end; i++)
      x[i] = ldexpf(rng_unit(r), e);
    if (!specials)
      continue;
    switch (b % 8) {
    case 1:
      for (size_t i = begin; i < end; i++)
        x[i] = 0.0f;
      break;
    case 2:
      for (size_t i = begin; i < end; i++)
        x[i] = (i % 3 == 0) ? -0.0f : 0.0f;
      break;
    case 3:
      for (size_t i = begin; i < end; i++)
        x[i] = -1.5f;
      break;
    case 4:
      x[begin + rng_next(r) % (end - begin)] = INFINITY;
      break;
    case 5:
      x[begin + rng_next(r) % (end - begin)] = -NAN;
      break;
    case 6: {
      uint32_t nan_bits = 0x7fa00001u; /* signalling NaN with a payload */
      memcpy(&x[begin + rng_next(r) % (end - begin)], &nan_bits, sizeof nan_bits);
      break;
    }
    case 7:
      /* A range near the top of fp32: (hi - lo) overflows in fp32. */
      for (size_t i = begin; i < end; i++)
        x[i] = (i % 2 ? 3e38f : -3e38f) * fabsf(rng_unit(r));
      break;
    default:
      break;
    }
  }
}

static void run_quant_case(const zk_qformat *fmt, size_t n, int specials, uint64_t seed) {
  char what[128];
  rng r = {seed};
  size_t bytes = zk_quant_bytes(fmt, n);
  assert_true(n == 0 || bytes > 0);
  float *x = xmalloc(n * 4), *want_y = xmalloc(n * 4), *got_y = xmalloc(n * 4);
  uint8_t *want = xmalloc(bytes), *got = xmalloc(bytes);
  fill_quant_input(&r, x, n, fmt->block_numel, specials);
  snprintf(what, sizeof what, "int%d %s block %zu numel %zu specials %d", fmt->bits,
           fmt->mode == ZK_QSYM ? "sym" : "asym", fmt->block_numel, n, specials);

  int want_flag = -1, got_flag = -1;
  assert_int_equal(zk_quantize(NULL, fmt, x, n, want, bytes, &want_flag), 0);
  float *d_x = dev_upload(x, n * 4);
  uint8_t *d_q = dev_alloc(bytes);
  float *d_y = dev_alloc(n * 4);
  int *d_flag = dev_alloc(sizeof(int));
  CU_OK(cu->memset(d_flag, 0, sizeof(int)));
  CU_OK(cu->quantize(NULL, fmt, d_x, n, d_q, bytes, d_flag));
  dev_download(got, d_q, bytes);
  dev_download(&got_flag, d_flag, sizeof(int));
  check_bytes(what, want, got, bytes);
  if (n > 0 && got_flag != want_flag)
    fail_msg("%s: non-finite flag CPU %d, GPU %d", what, want_flag, got_flag);

  assert_int_equal(zk_dequantize(NULL, fmt, want, bytes, want_y, n), 0);
  CU_OK(cu->dequantize(NULL, fmt, d_q, bytes, d_y, n));
  dev_download(got_y, d_y, n * 4);
  check_ulp(what, want_y, got_y, ZK_F32, n, 0);

  /* Any bytes decode, and decode the same: random scales, minimums, codes. */
  for (size_t i = 0; i < bytes; i++)
    want[i] = (uint8_t)rng_next(&r);
  CU_OK(cu->copy_to_device(d_q, want, bytes));
  assert_int_equal(zk_dequantize(NULL, fmt, want, bytes, want_y, n), 0);
  CU_OK(cu->dequantize(NULL, fmt, d_q, bytes, d_y, n));
  dev_download(got_y, d_y, n * 4);
  snprintf(what + strlen(what), sizeof what - strlen(what), " (random bytes)");
  check_ulp(what, want_y, got_y, ZK_F32, n, 0);

  dev_free(d_x);
  dev_free(d_q);
  dev_free(d_y);
  dev_free(d_flag);
  free(x);
  free(want_y);
  free(got_y);
  free(want);
  free(got);
}

static void test_quantize_matches_cpu(void **state) {
  static const size_t blocks[] = {1, 2, 7, 64, 4096, ZK_QBLOCK_MAX};
  for (int bits = 8; bits >= 4; bits -= 4)
    for (int mode = ZK_QSYM; mode <= ZK_QASYM; mode++)
      for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++) {
        zk_qformat fmt = {.bits = bits, .mode = (zk_qmode)mode, .block_numel = blocks[b]};
        if (zk_qformat_check(&fmt) != 0)
          continue; /* odd blocks for 4 bits */
        for (size_t s = 0; s < N_SIZES; s++)
          for (int specials = 0; specials <= 1; specials++)
            run_quant_case(&fmt, test_sizes[s], specials,
                           case_seed(7, bits, mode, (int)b * 2 + specials, test_sizes[s]));
      }
}

/* Unaligned buffers: the scales are then not 4-byte aligned. */
static void test_quantize_unaligned_buffer(void **state) {
  zk_qformat fmt = {.bits = 4, .mode = ZK_QASYM, .block_numel = 32};
  const size_t n = 1001;
  size_t bytes = zk_quant_bytes(&fmt, n);
  rng r = {99};
  float *x = xmalloc(n * 4);
  uint8_t *want = xmalloc(bytes), *got = xmalloc(bytes);
  fill_quant_input(&r, x, n, fmt.block_numel, 1);
  assert_int_equal(zk_quantize(NULL, &fmt, x, n, want, bytes, NULL), 0);
  float *d_x = dev_upload(x, n * 4);
  uint8_t *d_q = dev_alloc(bytes + 1);
  CU_OK(cu->quantize(NULL, &fmt, d_x, n, d_q + 1, bytes, NULL));
  dev_download(got, d_q + 1, bytes);
  check_bytes("unaligned int4 asym", want, got, bytes);
  dev_free(d_x);
  dev_free(d_q);
  free(x);
  free(want);
  free(got);
}

/* ------------------------------------------------------------------------ */
/* 64-bit indexing                                                          */
/* ------------------------------------------------------------------------ */

/* More than 2^31 elements: the kernels index with 64 bits. The array is set
 * on the device and only its ends come back, so the test needs 8 GiB of GPU
 * memory and little host memory; it is skipped where the GPU has less. */
static void test_more_than_2g_elements(void **state) {
  const size_t n = ((size_t)1 << 31) + 9;
  float *d_x = NULL;
  int rc = cu->alloc((void **)&d_x, n * sizeof(float));
  if (rc == -ENOMEM) {
    print_message("skipped: cannot allocate %zu bytes on the GPU\n", n * sizeof(float));
    skip();
  }
  CU_OK(rc);
  /* 0x3f800000 is 1.0f: fill with 1.0 byte-wise is impossible, so use
   * 0x3f3f3f3f (about 0.747), then double it. */
  CU_OK(cu->memset(d_x, 0x3f, n * sizeof(float)));
  double *d_sum = dev_alloc(sizeof(double));
  double zero = 0.0, sum = 0.0;
  CU_OK(cu->copy_to_device(d_sum, &zero, sizeof zero));
  CU_OK(cu->scale(NULL, d_x, 2.0f, n, NULL));
  CU_OK(cu->sumsq(NULL, d_x, ZK_F32, n, d_sum));
  float v;
  uint32_t bits = 0x3f3f3f3fu;
  memcpy(&v, &bits, sizeof v);
  v *= 2.0f;
  float ends[16];
  dev_download(ends, d_x + n - 16, sizeof ends);
  for (int i = 0; i < 16; i++)
    assert_true(ends[i] == v);
  dev_download(&sum, d_sum, sizeof sum);
  double want = (double)v * (double)v * (double)n;
  if (fabs(sum - want) > SUMSQ_REL_TOL * want)
    fail_msg("sumsq over %zu elements: %.17g, want %.17g", n, sum, want);
  dev_free(d_x);
  dev_free(d_sum);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cast_matches_cpu_bit_exact),
      cmocka_unit_test(test_accumulate_matches_cpu),
      cmocka_unit_test(test_scale_matches_cpu),
      cmocka_unit_test(test_nonfinite_flag_is_never_cleared),
      cmocka_unit_test(test_sumsq_matches_cpu),
      cmocka_unit_test(test_quantize_matches_cpu),
      cmocka_unit_test(test_quantize_unaligned_buffer),
      cmocka_unit_test(test_more_than_2g_elements),
  };
  return gpu_test_main("cuda_elementwise", tests, sizeof tests / sizeof tests[0]);
}
