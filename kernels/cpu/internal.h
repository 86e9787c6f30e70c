/* internal.h - what the CPU drivers share: work splitting, dtype access and
 * the attribute that compiles a loop for several instruction sets. */
#ifndef ZK_CPU_INTERNAL_H
#define ZK_CPU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include "../args.h"
#include "../math_cast.h"
#include "../zk.h"

/* Arrays smaller than this run on the calling thread: waking the pool costs
 * more than the loop itself. */
#define ZK_PARALLEL_MIN_NUMEL ((size_t)1 << 16)

/* Task boundaries are multiples of this many elements (256 bytes of fp32),
 * so that two threads never write the same cache line. */
#define ZK_SPLIT_ALIGN ((size_t)64)

/* The element loops are compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2
 * and FMA) and baseline x86-64, and the dynamic loader picks the best one
 * the CPU has (function multi-versioning). One binary then runs fast on
 * every machine, which -march=native would not allow. The explicit fmaf of
 * the optimizer math is one instruction from v3 up (a libm call before). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(ZK_NO_CLONES)
#define ZK_VECTOR_LOOP __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZK_VECTOR_LOOP
#endif

#define ZK_ALWAYS_INLINE static inline __attribute__((always_inline))

/* The range [*begin, *end) of task `task` out of n_tasks over numel elements. */
static inline void zk_split(size_t numel, int task, int n_tasks, size_t *begin, size_t *end) {
  size_t blocks = (numel + ZK_SPLIT_ALIGN - 1) / ZK_SPLIT_ALIGN;
  size_t b = blocks * (size_t)task / (size_t)n_tasks * ZK_SPLIT_ALIGN;
  size_t e = blocks * (size_t)(task + 1) / (size_t)n_tasks * ZK_SPLIT_ALIGN;
  *begin = b < numel ? b : numel;
  *end = e < numel ? e : numel;
}

/* How many tasks to split numel elements into: at most the pool's size,
 * hence at most ZK_POOL_MAX_THREADS. */
static inline int zk_task_count(const zk_pool *pool, size_t numel) {
  return numel < ZK_PARALLEL_MIN_NUMEL ? 1 : zk_pool_size(pool);
}

/* Element i of an array of dtype, as fp32. dtype is a constant wherever this
 * is inlined, so the switch disappears before vectorisation. */
ZK_ALWAYS_INLINE float zk_load_f32(const void *restrict src, zk_dtype dtype, size_t i) {
  switch (dtype) {
  case ZK_BF16:
    return zk_bf16_to_f32(((const uint16_t *)src)[i]);
  case ZK_F16:
    return zk_f16_to_f32(((const uint16_t *)src)[i]);
  default:
    return ((const float *)src)[i];
  }
}

ZK_ALWAYS_INLINE void zk_store_f32(void *restrict dst, zk_dtype dtype, size_t i, float value) {
  switch (dtype) {
  case ZK_BF16:
    ((uint16_t *)dst)[i] = zk_f32_to_bf16(value);
    break;
  case ZK_F16:
    ((uint16_t *)dst)[i] = zk_f32_to_f16(value);
    break;
  case ZK_F32:
    ((float *)dst)[i] = value;
    break;
  default:
    break;
  }
}

#endif /* ZK_CPU_INTERNAL_H */
