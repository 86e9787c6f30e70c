/* math_quant.h - block-wise integer quantization for compressed collectives.
 *
 * A block of values shares one fp32 scale (and, in zero-point mode, one fp32
 * minimum). The drivers first reduce a block to its statistics, then call
 * these per-element functions. Rounding is rintf: to nearest, ties to even,
 * in CPU and CUDA alike, so both produce the same bytes.
 */
#ifndef ZK_MATH_QUANT_H
#define ZK_MATH_QUANT_H

#include <math.h>
#include "zk_hd.h"

/* The largest code of a format: symmetric codes are in [-qmax, qmax] (the
 * most negative two's-complement code is left unused so that the grid is
 * symmetric and 0 is exact); zero-point codes are in [0, qmax]. */
ZK_HD int zk_quant_qmax(int bits, int zero_point) {
  return zero_point ? (1 << bits) - 1 : (1 << (bits - 1)) - 1;
}

/* Scale of a block from its statistics. Computed in double so that a
 * zero-point range (hi - lo) near the top of the fp32 range does not
 * overflow before the division. A block that held Inf or NaN gets NaN. */
ZK_HD float zk_quant_scale(float lo, float hi, int qmax, int zero_point, int nonfinite) {
  double range = zero_point ? (double)hi - (double)lo : fmax(fabs((double)lo), fabs((double)hi));
  return nonfinite ? zk_bits_f32(0x7fc00000u) : (float)(range / qmax);
}

/* Block statistics are reduced in the total order of the float bit
 * patterns: the int32 key below has the same signed order as the floats
 * (-0 below +0, NaNs beyond the infinities by sign). Integer min/max
 * reductions vectorise on CPU and are order-independent on GPU, and both
 * drivers pick the same minimum for every block, signed zeros included,
 * which matters because the zero-point minimum is stored in the buffer. */
ZK_HD int32_t zk_quant_order_key(uint32_t bits) {
  int32_t s = (int32_t)bits;
  return s ^ (int32_t)((uint32_t)(s >> 31) & 0x7fffffffu);
}

ZK_HD float zk_quant_key_to_f32(int32_t key) {
  return zk_bits_f32((uint32_t)(key ^ (int32_t)((uint32_t)(key >> 31) & 0x7fffffffu)));
}

/* Reciprocal of the scale, or 0 for an all-zero (or constant) block and for
 * NaN scales, so that every code of such a block is 0 and no division by
 * zero happens in the element loop. */
ZK_HD float zk_quant_inv_scale(float scale) {
  return scale > 0.0f ? 1.0f / scale : 0.0f;
}

ZK_HD int zk_quantize_sym(float x, float inv_scale, int qmax) {
  float q = rintf(x * inv_scale);
  q = q > (float)qmax ? (float)qmax : q;
  q = q < (float)-qmax ? (float)-qmax : q;
  return zk_finite_f32(q) ? (int)q : 0;
}

ZK_HD int zk_quantize_asym(float x, float lo, float inv_scale, int qmax) {
  float q = rintf((x - lo) * inv_scale);
  q = q > (float)qmax ? (float)qmax : q;
  q = q < 0.0f ? 0.0f : q;
  return zk_finite_f32(q) ? (int)q : 0;
}

ZK_HD float zk_dequantize_sym(int q, float scale) {
  return (float)q * scale;
}

ZK_HD float zk_dequantize_asym(int q, float lo, float scale) {
  return (float)q * scale + lo;
}

/* 4-bit codes travel as nibbles: element 2i in the low nibble of byte i,
 * element 2i + 1 in the high one. Symmetric codes are two's complement. */
ZK_HD uint8_t zk_pack_nibbles(int low, int high) {
  return (uint8_t)((low & 0xf) | ((high & 0xf) << 4));
}

ZK_HD int zk_unpack_nibble(uint8_t byte, int high, int is_signed) {
  int v = high ? (byte >> 4) : (byte & 0xf);
  return is_signed ? v - ((v & 0x8) << 1) : v;
}

#endif /* ZK_MATH_QUANT_H */
