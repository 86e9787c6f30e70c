/* optim.cu - CUDA drivers of the optimizer steps (Adam, AdamW, SGD).
 *
 * The same single pass as the CPU drivers in cpu/optim.c: read the gradient
 * in its dtype, update the fp32 weights and state in place and write the
 * working copy. The per-step coefficients are computed on the host by the
 * same zk_*_coef_init as on the CPU and passed to the kernel by value; the
 * element math is zk_adam_update / zk_sgd_update from math_optim.h. With
 * --fmad=false (see CMakeLists.txt) the GPU then rounds exactly as the CPU.
 *
 * Each kernel is instantiated per (gradient dtype, working dtype) pair. It
 * reads and writes four elements per access when every array is aligned for
 * it (cudaMalloc'd buffers are), and falls back to one element otherwise.
 */
#include "internal.h"

/* ---- Adam / AdamW ------------------------------------------------------ */

template <int G, int W>
__global__ void __launch_bounds__(ZKC_THREADS)
    adam_kernel(const __grid_constant__ zk_adam_coef coef, float *__restrict__ param,
                float *__restrict__ exp_avg, float *__restrict__ exp_avg_sq,
                const void *__restrict__ grad, void *__restrict__ working, size_t numel, int vec4) {
  zkc_for_each(
      numel, vec4,
      [&](size_t group) {
        float p[4], m[4], v[4], g[4];
        zkc_load4<ZK_F32>(param, group, p);
        zkc_load4<ZK_F32>(exp_avg, group, m);
        zkc_load4<ZK_F32>(exp_avg_sq, group, v);
        zkc_load4<G>(grad, group, g);
#pragma unroll
        for (int k = 0; k < 4; k++)
          p[k] = zk_adam_update(&coef, p[k], &m[k], &v[k], g[k]);
        zkc_store4<ZK_F32>(param, group, p);
        zkc_store4<ZK_F32>(exp_avg, group, m);
        zkc_store4<ZK_F32>(exp_avg_sq, group, v);
        zkc_store4<W>(working, group, p);
      },
      [&](size_t i) {
        float p =
            zk_adam_update(&coef, param[i], &exp_avg[i], &exp_avg_sq[i], zkc_load<G>(grad, i));
        param[i] = p;
        zkc_store<W>(working, i, p);
      });
}

typedef void (*adam_kernel_fn)(zk_adam_coef, float *, float *, float *, const void *, void *,
                               size_t, int);

/* Indexed [grad dtype][working dtype], in zk_dtype order. */
#define ADAM_ROW(G)                                                                                \
  {                                                                                                \
    adam_kernel<G, ZK_F32>, adam_kernel<G, ZK_BF16>, adam_kernel<G, ZK_F16>,                       \
        adam_kernel<G, ZK_DTYPE_NONE>                                                              \
  }
static const adam_kernel_fn adam_kernels[3][4] = {ADAM_ROW(ZK_F32), ADAM_ROW(ZK_BF16),
                                                  ADAM_ROW(ZK_F16)};

int zkc_adam_step(void *stream, const zk_adam_hparams *hp, float *param, float *exp_avg,
                  float *exp_avg_sq, const void *grad, zk_dtype grad_dtype, void *working,
                  zk_dtype working_dtype, size_t numel) {
  zk_adam_coef coef;
  int rc = zk_adam_prepare(hp, &coef, param, exp_avg, exp_avg_sq, grad, grad_dtype, working,
                           working_dtype, numel);
  if (rc != 0)
    return rc == ZK_NOTHING_TO_DO ? 0 : rc;
  if (working_dtype == ZK_DTYPE_NONE)
    working = NULL;

  int vec4 = zkc_vec4_ok(param, ZK_F32) && zkc_vec4_ok(exp_avg, ZK_F32) &&
             zkc_vec4_ok(exp_avg_sq, ZK_F32) && zkc_vec4_ok(grad, grad_dtype) &&
             zkc_vec4_ok(working, working_dtype);
  adam_kernel_fn kernel = adam_kernels[grad_dtype][working_dtype];
  unsigned blocks;
  rc = zkc_grid_blocks(kernel, vec4 ? (numel + 3) / 4 : numel, ZKC_THREADS, &blocks);
  if (rc != 0)
    return rc;
  kernel<<<blocks, ZKC_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
      coef, param, exp_avg, exp_avg_sq, grad, working, numel, vec4);
  return zkc_launch_check("adam_kernel");
}

/* ---- SGD --------------------------------------------------------------- */

/* Without momentum there is no buffer (it may be NULL): the update gets a
 * register stand-in that it never touches, as on the CPU. */
template <int G, int W>
__global__ void __launch_bounds__(ZKC_THREADS)
    sgd_kernel(const __grid_constant__ zk_sgd_coef coef, float *__restrict__ param,
               float *__restrict__ momentum_buf, const void *__restrict__ grad,
               void *__restrict__ working, size_t numel, int vec4) {
  zkc_for_each(
      numel, vec4,
      [&](size_t group) {
        float p[4], g[4], buf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        zkc_load4<ZK_F32>(param, group, p);
        if (coef.has_momentum)
          zkc_load4<ZK_F32>(momentum_buf, group, buf);
        zkc_load4<G>(grad, group, g);
#pragma unroll
        for (int k = 0; k < 4; k++)
          p[k] = zk_sgd_update(&coef, p[k], &buf[k], g[k]);
        zkc_store4<ZK_F32>(param, group, p);
        if (coef.has_momentum)
          zkc_store4<ZK_F32>(momentum_buf, group, buf);
        zkc_store4<W>(working, group, p);
      },
      [&](size_t i) {
        float buf = coef.has_momentum ? momentum_buf[i] : 0.0f;
        float p = zk_sgd_update(&coef, param[i], &buf, zkc_load<G>(grad, i));
        param[i] = p;
        if (coef.has_momentum)
          momentum_buf[i] = buf;
        zkc_store<W>(working, i, p);
      });
}

typedef void (*sgd_kernel_fn)(zk_sgd_coef, float *, float *, const void *, void *, size_t, int);

#define SGD_ROW(G)                                                                                 \
  {                                                                                                \
    sgd_kernel<G, ZK_F32>, sgd_kernel<G, ZK_BF16>, sgd_kernel<G, ZK_F16>,                          \
        sgd_kernel<G, ZK_DTYPE_NONE>                                                               \
  }
static const sgd_kernel_fn sgd_kernels[3][4] = {SGD_ROW(ZK_F32), SGD_ROW(ZK_BF16), SGD_ROW(ZK_F16)};

int zkc_sgd_step(void *stream, const zk_sgd_hparams *hp, float *param, float *momentum_buf,
                 const void *grad, zk_dtype grad_dtype, void *working, zk_dtype working_dtype,
                 size_t numel) {
  zk_sgd_coef coef;
  int rc = zk_sgd_prepare(hp, &coef, param, momentum_buf, grad, grad_dtype, working, working_dtype,
                          numel);
  if (rc != 0)
    return rc == ZK_NOTHING_TO_DO ? 0 : rc;
  if (!coef.has_momentum)
    momentum_buf = NULL;
  if (working_dtype == ZK_DTYPE_NONE)
    working = NULL;

  int vec4 = zkc_vec4_ok(param, ZK_F32) && zkc_vec4_ok(momentum_buf, ZK_F32) &&
             zkc_vec4_ok(grad, grad_dtype) && zkc_vec4_ok(working, working_dtype);
  sgd_kernel_fn kernel = sgd_kernels[grad_dtype][working_dtype];
  unsigned blocks;
  rc = zkc_grid_blocks(kernel, vec4 ? (numel + 3) / 4 : numel, ZKC_THREADS, &blocks);
  if (rc != 0)
    return rc;
  kernel<<<blocks, ZKC_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(coef, param, momentum_buf,
                                                                        grad, working, numel, vec4);
  return zkc_launch_check("sgd_kernel");
}
