/* zk_hd.h - what lets the element-wise math headers compile as C and as CUDA.
 *
 * The math_*.h headers define each operation once, as a static inline
 * function marked ZK_HD. A C compiler sees plain static inline functions that
 * the CPU drivers call inside vectorisable loops; nvcc sees __host__
 * __device__ functions that the CUDA kernels call per element. Nothing in
 * these headers may use a library call that differs between the two (the
 * rounding functions used, rintf and sqrtf, are correctly rounded in both).
 */
#ifndef ZK_HD_H
#define ZK_HD_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define ZK_HD static inline __host__ __device__
#else
#define ZK_HD static inline
#endif

/* Bit casts. memcpy is the portable spelling and compiles to a register move. */
ZK_HD uint32_t zk_f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

ZK_HD float zk_bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/* 1 if x is neither Inf nor NaN. A bit test, so it also works where the
 * compiler was told that no Inf or NaN can occur. */
ZK_HD int zk_finite_f32(float x) {
  return (zk_f32_bits(x) & 0x7f800000u) != 0x7f800000u;
}

#endif /* ZK_HD_H */
