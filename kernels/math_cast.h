/* math_cast.h - conversions between fp32 and the 16-bit float formats.
 *
 * All conversions to a narrower format round to nearest, ties to even, like
 * IEEE 754 arithmetic. Overflow becomes an infinity of the same sign; NaN
 * stays NaN with its sign and top payload bits, and is made quiet so that a
 * signalling NaN never turns into an infinity by losing its low payload bits.
 * Widening conversions are exact. The code is branch-free (selects only) so
 * the CPU drivers vectorise it.
 */
#ifndef ZK_MATH_CAST_H
#define ZK_MATH_CAST_H

#include <math.h>
#include "zk_hd.h"

/* bfloat16 is the top half of an fp32: rounding adds just under half an ulp
 * of the result, plus one when the kept part is odd (ties to even). A carry
 * out of the mantissa moves into the exponent, which is also how the largest
 * finite values round up to infinity. */
ZK_HD uint16_t zk_f32_to_bf16(float f) {
  uint32_t u = zk_f32_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

ZK_HD float zk_bf16_to_f32(uint16_t h) {
  return zk_bits_f32((uint32_t)h << 16);
}

/* IEEE binary16: 5 exponent bits (bias 15), 10 mantissa bits.
 * Three ranges of |f|:
 * - [2^-14, 65520): normal half. Re-bias the exponent (127 - 15 = 112) and
 *   round the 23-bit mantissa to 10 bits with the same add-and-shift as
 *   bfloat16; a carry into the exponent is correct rounding.
 * - below 2^-14: subnormal half, a multiple of 2^-24. |f| * 2^24 is exact (a
 *   power-of-two scaling that cannot overflow here), and rintf rounds it to
 *   the nearest integer, ties to even, which is the half's bit pattern;
 *   1024 comes out as the smallest normal, also correct.
 * - 65520 and up (the midpoint between 65504 and 65536, which ties to the
 *   even pattern 0x7c00): infinity. */
ZK_HD uint16_t zk_f32_to_f16(float f) {
  uint32_t u = zk_f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs_bits = u & 0x7fffffffu;
  uint32_t normal = (abs_bits + 0xfffu + ((abs_bits >> 13) & 1u) - 0x38000000u) >> 13;
  uint32_t subnormal = (uint32_t)rintf(zk_bits_f32(abs_bits) * 0x1p24f);
  uint32_t h = abs_bits >= 0x38800000u ? normal : subnormal;
  h = abs_bits >= 0x477ff000u ? 0x7c00u : h;
  h = abs_bits > 0x7f800000u ? (0x7e00u | ((abs_bits >> 13) & 0x3ffu)) : h;
  return (uint16_t)(sign | h);
}

/* Normal halves re-bias the exponent; subnormal halves are m * 2^-24, which
 * an int-to-float conversion and a power-of-two scaling give exactly (without
 * producing an fp32 denormal, so flush-to-zero modes cannot change it). */
ZK_HD float zk_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);
  uint32_t subnormal = zk_f32_bits((float)mantissa * 0x1p-24f);
  uint32_t special = 0x7f800000u | (mantissa << 13);
  uint32_t bits = exponent == 0 ? subnormal : (exponent == 0x1fu ? special : normal);
  return zk_bits_f32(sign | bits);
}

#endif /* ZK_MATH_CAST_H */
