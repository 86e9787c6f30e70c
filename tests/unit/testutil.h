/* testutil.h - what the kernel tests share: a seeded generator, the awkward
 * sizes every kernel is run on, and float comparisons in ulps. */
#ifndef ZK_TESTUTIL_H
#define ZK_TESTUTIL_H

#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "zk.h"

/* 0, 1, a short tail, just over a page of fp32, and a large odd size that
 * crosses the pool's parallel threshold. */
static const size_t test_sizes[] = {0, 1, 7, 4097, 1000003};
#define N_TEST_SIZES (sizeof test_sizes / sizeof test_sizes[0])

/* splitmix64: small, seedable, good enough for test data. */
typedef struct test_rng {
  uint64_t state;
} test_rng;

static inline uint64_t rng_next(test_rng *rng) {
  uint64_t z = (rng->state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static inline double rng_uniform(test_rng *rng) {
  return (double)(rng_next(rng) >> 11) * 0x1p-53;
}

/* Standard normal (Box-Muller). */
static inline double rng_normal(test_rng *rng) {
  double u1 = rng_uniform(rng), u2 = rng_uniform(rng);
  return sqrt(-2.0 * log(u1 + 0x1p-60)) * cos(6.283185307179586 * u2);
}

static inline void fill_normal(test_rng *rng, float *x, size_t n, double scale) {
  for (size_t i = 0; i < n; i++)
    x[i] = (float)(rng_normal(rng) * scale);
}

static inline void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (p == NULL) {
    fprintf(stderr, "out of memory allocating %zu bytes\n", bytes);
    abort();
  }
  return p;
}

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Distance in units in the last place between two finite floats (the
 * number of representable floats between them). */
static inline int64_t ulp_distance(float a, float b) {
  int64_t ia = (int32_t)f32_bits(a), ib = (int32_t)f32_bits(b);
  if (ia < 0)
    ia = (int64_t)INT32_MIN - ia;
  if (ib < 0)
    ib = (int64_t)INT32_MIN - ib;
  return ia > ib ? ia - ib : ib - ia;
}

/* Fails the current test with a formatted message. */
static inline void test_fail(const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fail_msg("%s", msg);
}

/* Bit-level reference encoder of a finite or special double holding an fp32
 * value into a binary float format with `ebits` exponent and `mbits`
 * mantissa bits (binary16: 5, 10; bfloat16: 8, 7), rounding to nearest,
 * ties to even. Written from the definition of the format, independently of
 * the kernels' bit tricks. NaN is encoded as the quiet NaN that keeps the top
 * payload bits of the fp32 NaN. */
static inline uint16_t ref_encode16(float value, int ebits, int mbits) {
  uint32_t in = f32_bits(value);
  uint16_t sign = (uint16_t)((in >> 31) << (ebits + mbits));
  uint32_t exp_all = (1u << ebits) - 1;
  if (isnan(value)) {
    uint32_t payload = (in & 0x7fffffu) >> (23 - mbits);
    return (uint16_t)(sign | (exp_all << mbits) | (1u << (mbits - 1)) | payload);
  }
  if (isinf(value))
    return (uint16_t)(sign | (exp_all << mbits));
  double a = fabs((double)value);
  if (a == 0.0)
    return sign;
  int bias = (1 << (ebits - 1)) - 1;
  int emin = 1 - bias;
  int e;
  frexp(a, &e);
  int exponent = e - 1 < emin ? emin : e - 1;
  double scaled = ldexp(a, mbits - exponent); /* exact: a power-of-two scaling */
  double r = floor(scaled);
  double frac = scaled - r;
  if (frac > 0.5 || (frac == 0.5 && fmod(r, 2.0) == 1.0))
    r += 1.0;
  if (r >= ldexp(1.0, mbits + 1)) {
    r /= 2.0;
    exponent++;
  }
  if (exponent > bias)
    return (uint16_t)(sign | (exp_all << mbits));
  uint32_t biased = r >= ldexp(1.0, mbits) ? (uint32_t)(exponent + bias) : 0;
  uint32_t mantissa = (uint32_t)r & ((1u << mbits) - 1);
  return (uint16_t)(sign | (biased << mbits) | mantissa);
}

/* Reference decoder of a 16-bit pattern to its exact value (as a float,
 * which holds every binary16 and bfloat16 value exactly). */
static inline float ref_decode16(uint16_t h, int ebits, int mbits) {
  int sign = h >> (ebits + mbits);
  uint32_t biased = (h >> mbits) & ((1u << ebits) - 1);
  uint32_t mantissa = h & ((1u << mbits) - 1);
  int bias = (1 << (ebits - 1)) - 1;
  double v;
  if (biased == (1u << ebits) - 1) {
    if (mantissa == 0)
      return sign ? -INFINITY : INFINITY;
    /* NaN: the fp32 with the same payload, widened. */
    uint32_t bits = ((uint32_t)sign << 31) | 0x7f800000u | (mantissa << (23 - mbits));
    return bits_f32(bits);
  }
  if (biased == 0)
    v = ldexp((double)mantissa, 1 - bias - mbits);
  else
    v = ldexp((double)(mantissa | (1u << mbits)), (int)biased - bias - mbits);
  return (float)(sign ? -v : v);
}

#endif /* ZK_TESTUTIL_H */
