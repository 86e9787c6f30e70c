/* gpu_testutil.h - shared helpers of the GPU test programs (test_cuda_*.c),
 * which check the CUDA drivers (libzerod_cuda.so) against the CPU drivers of
 * zk.h.
 *
 * Each test program is a single translation unit that includes this header,
 * so everything here is static: the module's table `cu` (set by
 * gpu_test_main), device allocation and copy helpers that fail the running
 * test on error, a seeded random generator, value fillers, ulp and byte
 * comparisons, the sizes every kernel runs at, the tolerances, and the dtype
 * lists. The programs reach the GPU only through the module's table,
 * allocations and copies included, as zerod does; they link no CUDA library.
 *
 * gpu_test_main() loads the module and runs a group of tests. Without a
 * usable GPU it prints one "SKIP: ..." line and returns 77 (ctest's
 * SKIP_RETURN_CODE), unless ZEROD_REQUIRE_GPU=1 makes that a failure.
 */
#ifndef ZEROD_TESTS_GPU_TESTUTIL_H
#define ZEROD_TESTS_GPU_TESTUTIL_H

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cuda/zk_cuda.h"
#include "math_cast.h"
#include "zk.h"

/* The module's function table, set by gpu_test_main(). */
static const zk_cuda_api *cu;

/* Sizes every kernel runs at: 0, 1, 7 (tails shorter than a vector), 4097
 * and 1000003 (many blocks, odd tail). */
static const size_t test_sizes[] = {0, 1, 7, 4097, 1000003};
#define N_SIZES (sizeof test_sizes / sizeof test_sizes[0])

/* Optimizer results may differ by this many ulps (see test_cuda_optim.c). */
#define OPTIM_MAX_ULP 1
/* Relative tolerance of the sum of squares (see test_cuda_elementwise.c). */
#define SUMSQ_REL_TOL 1e-12

/* ------------------------------------------------------------------------ */
/* Helpers                                                                  */
/* ------------------------------------------------------------------------ */

#define CU_OK(call)                                                                                \
  do {                                                                                             \
    int cu_rc_ = (call);                                                                           \
    if (cu_rc_ != 0)                                                                               \
      fail_msg("%s returned %d (%s)", #call, cu_rc_, cu->last_error());                            \
  } while (0)

static inline void *xmalloc(size_t bytes) {
  void *ptr = malloc(bytes > 0 ? bytes : 1);
  assert_non_null(ptr);
  return ptr;
}

static inline void *dev_alloc(size_t bytes) {
  void *ptr = NULL;
  CU_OK(cu->alloc(&ptr, bytes));
  return ptr;
}

static inline void *dev_upload(const void *host, size_t bytes) {
  void *ptr = dev_alloc(bytes);
  CU_OK(cu->copy_to_device(ptr, host, bytes));
  return ptr;
}

static inline void dev_download(void *host, const void *dev, size_t bytes) {
  CU_OK(cu->synchronize(NULL));
  CU_OK(cu->copy_to_host(host, dev, bytes));
}

static inline void dev_free(void *ptr) {
  CU_OK(cu->free(ptr));
}

/* splitmix64: a small, fast generator; every case seeds its own, so a
 * failure reproduces on its own. */
typedef struct rng {
  uint64_t state;
} rng;

static inline uint64_t rng_next(rng *r) {
  uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static inline float rng_unit(rng *r) {
  return (float)((double)(rng_next(r) >> 11) * 0x1p-52 - 1.0);
}

/* Signed values spread over magnitudes 2^-min_exp2 .. 2^max_exp2, as
 * gradients and weights are. */
static inline float rng_value(rng *r, int min_exp2, int max_exp2) {
  int e = min_exp2 + (int)(rng_next(r) % (uint64_t)(max_exp2 - min_exp2 + 1));
  return ldexpf(rng_unit(r), e);
}

static inline uint64_t case_seed(int a, int b, int c, int d, size_t numel) {
  return ((uint64_t)a << 48) ^ ((uint64_t)b << 40) ^ ((uint64_t)c << 32) ^ ((uint64_t)d << 24) ^
         (uint64_t)numel ^ 0x5eed;
}

static inline void fill_values(rng *r, float *x, size_t n, int min_exp2, int max_exp2) {
  for (size_t i = 0; i < n; i++)
    x[i] = rng_value(r, min_exp2, max_exp2);
}

/* Writes the values as dtype into dst (numel elements of that dtype). */
static inline void store_as(void *dst, zk_dtype dtype, const float *values, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (dtype == ZK_BF16)
      ((uint16_t *)dst)[i] = zk_f32_to_bf16(values[i]);
    else if (dtype == ZK_F16)
      ((uint16_t *)dst)[i] = zk_f32_to_f16(values[i]);
    else
      ((float *)dst)[i] = values[i];
  }
}

/* Bit pattern of element i of an array of dtype. */
static inline uint32_t element_bits(const void *array, zk_dtype dtype, size_t i) {
  if (dtype == ZK_F32)
    return ((const uint32_t *)array)[i];
  return ((const uint16_t *)array)[i];
}

/* Distance in ulps between two values of dtype: the difference of their
 * positions in the ordered sequence of representable values (+0 and -0 are
 * one position apart). Two NaNs are equal; a NaN and a number are as far
 * apart as can be. */
static inline int64_t ulp_distance(uint32_t a, uint32_t b, zk_dtype dtype) {
  uint32_t sign = dtype == ZK_F32 ? 0x80000000u : 0x8000u;
  uint32_t inf = dtype == ZK_F32 ? 0x7f800000u : dtype == ZK_BF16 ? 0x7f80u : 0x7c00u;
  int a_nan = (a & ~sign) > inf, b_nan = (b & ~sign) > inf;
  if (a_nan || b_nan)
    return a_nan && b_nan ? 0 : INT64_MAX;
  int64_t ka = (a & sign) ? -(int64_t)(a & ~sign) - 1 : (int64_t)a;
  int64_t kb = (b & sign) ? -(int64_t)(b & ~sign) - 1 : (int64_t)b;
  return ka > kb ? ka - kb : kb - ka;
}

/* Fails unless every element of got is within max_ulp of want. */
static inline int64_t check_ulp(const char *what, const void *want, const void *got, zk_dtype dtype,
                                size_t n, int64_t max_ulp) {
  int64_t worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < n; i++) {
    int64_t d = ulp_distance(element_bits(want, dtype, i), element_bits(got, dtype, i), dtype);
    if (d > worst) {
      worst = d;
      worst_i = i;
    }
  }
  if (worst > max_ulp)
    fail_msg("%s: element %zu of %zu differs by %" PRId64 " ulp (max %" PRId64 "): CPU 0x%08" PRIx32
             ", GPU 0x%08" PRIx32,
             what, worst_i, n, worst, max_ulp, element_bits(want, dtype, worst_i),
             element_bits(got, dtype, worst_i));
  return worst;
}

static inline void check_bytes(const char *what, const void *want, const void *got, size_t bytes) {
  const uint8_t *w = want, *g = got;
  for (size_t i = 0; i < bytes; i++)
    if (w[i] != g[i])
      fail_msg("%s: byte %zu of %zu differs: CPU 0x%02x, GPU 0x%02x", what, i, bytes, w[i], g[i]);
}

static inline size_t dtype_bytes(zk_dtype dtype, size_t n) {
  return zk_dtype_size(dtype) * n;
}

static const zk_dtype grad_dtypes[] = {ZK_F32, ZK_BF16, ZK_F16};
static const zk_dtype working_dtypes[] = {ZK_DTYPE_NONE, ZK_F32, ZK_BF16, ZK_F16};

/* ------------------------------------------------------------------------ */
/* Main                                                                     */
/* ------------------------------------------------------------------------ */

/* Loads the CUDA module into `cu` and runs the n tests as group `group`.
 * Without a usable GPU: prints "SKIP: ..." and returns 77, or, with
 * ZEROD_REQUIRE_GPU=1, reports a failure and returns 1. */
static inline int gpu_test_main(const char *group, const struct CMUnitTest *tests, size_t n) {
  char why[512] = "";
  int rc = zk_cuda_load(&cu, why, sizeof why);
  if (rc != 0) {
    const char *require = getenv("ZEROD_REQUIRE_GPU");
    if (require != NULL && strcmp(require, "1") == 0) {
      fprintf(stderr, "FAIL: ZEROD_REQUIRE_GPU=1 but no usable GPU (%d): %s\n", rc, why);
      return 1;
    }
    printf("SKIP: no usable GPU: %s\n", why);
    return 77;
  }
  printf("# CUDA module: %s\n", why);
  return _cmocka_run_group_tests(group, tests, n, NULL, NULL);
}

#endif /* ZEROD_TESTS_GPU_TESTUTIL_H */
