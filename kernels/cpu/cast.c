/* cast.c - CPU driver of the dtype conversions (math in math_cast.h). */
#include <errno.h>
#include <string.h>

#include "internal.h"

typedef void (*cast_loop_fn)(void *restrict dst, const void *restrict src, size_t begin,
                             size_t end);

#define CAST_LOOP(NAME, DST, SRC)                                                                  \
  ZK_VECTOR_LOOP static void NAME(void *restrict dst, const void *restrict src, size_t begin,      \
                                  size_t end) {                                                    \
    for (size_t i = begin; i < end; i++)                                                           \
      zk_store_f32(dst, DST, i, zk_load_f32(src, SRC, i));                                         \
  }
CAST_LOOP(cast_f32_to_bf16, ZK_BF16, ZK_F32)
CAST_LOOP(cast_f32_to_f16, ZK_F16, ZK_F32)
CAST_LOOP(cast_bf16_to_f32, ZK_F32, ZK_BF16)
CAST_LOOP(cast_f16_to_f32, ZK_F32, ZK_F16)

static void copy_f32(void *restrict dst, const void *restrict src, size_t begin, size_t end) {
  memcpy((float *)dst + begin, (const float *)src + begin, (end - begin) * sizeof(float));
}

typedef struct cast_job {
  cast_loop_fn loop;
  void *dst;
  const void *src;
  size_t numel;
} cast_job;

static void cast_task(void *ctx, int task, int n_tasks) {
  cast_job *job = ctx;
  size_t begin, end;
  zk_split(job->numel, task, n_tasks, &begin, &end);
  if (begin < end)
    job->loop(job->dst, job->src, begin, end);
}

int zk_cast(zk_pool *pool, void *dst, zk_dtype dst_dtype, const void *src, zk_dtype src_dtype,
            size_t numel) {
  cast_loop_fn loop = NULL;
  if (src_dtype == ZK_F32 && dst_dtype == ZK_BF16)
    loop = cast_f32_to_bf16;
  else if (src_dtype == ZK_F32 && dst_dtype == ZK_F16)
    loop = cast_f32_to_f16;
  else if (src_dtype == ZK_BF16 && dst_dtype == ZK_F32)
    loop = cast_bf16_to_f32;
  else if (src_dtype == ZK_F16 && dst_dtype == ZK_F32)
    loop = cast_f16_to_f32;
  else if (src_dtype == ZK_F32 && dst_dtype == ZK_F32)
    loop = copy_f32;
  else
    return -EINVAL;
  if (numel == 0)
    return 0;
  if (dst == NULL || src == NULL)
    return -EINVAL;
  cast_job job = {.loop = loop, .dst = dst, .src = src, .numel = numel};
  zk_pool_run(pool, zk_task_count(pool, numel), cast_task, &job);
  return 0;
}
