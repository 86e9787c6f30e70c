/* args.h - argument checks shared by the CPU and the CUDA drivers.
 *
 * Both driver families must accept and refuse exactly the same calls, so the
 * checks live here once (plain C, also compiled as CUDA host code). Order
 * of checks, as documented in zk.h: dtypes and hyper-parameters first, then
 * an empty array (accepted, nothing touched), then the pointers.
 */
#ifndef ZK_ARGS_H
#define ZK_ARGS_H

#include <errno.h>
#include <stddef.h>

#include "math_optim.h"
#include "zk.h"

#define ZK_NOTHING_TO_DO 1

static inline int zk_is_float_dtype(zk_dtype dtype) {
  return dtype == ZK_F32 || dtype == ZK_BF16 || dtype == ZK_F16;
}

static inline int zk_step_dtypes_ok(zk_dtype grad_dtype, zk_dtype working_dtype) {
  return zk_is_float_dtype(grad_dtype) &&
         (zk_is_float_dtype(working_dtype) || working_dtype == ZK_DTYPE_NONE);
}

/* Checks an Adam step's arguments and computes its coefficients. Returns
 * -EINVAL, ZK_NOTHING_TO_DO for numel == 0, or 0 to go on. */
static inline int zk_adam_prepare(const zk_adam_hparams *hp, zk_adam_coef *coef, const float *param,
                                  const float *exp_avg, const float *exp_avg_sq, const void *grad,
                                  zk_dtype grad_dtype, const void *working, zk_dtype working_dtype,
                                  size_t numel) {
  if (hp == NULL || !zk_step_dtypes_ok(grad_dtype, working_dtype) ||
      zk_adam_coef_init(coef, hp->lr, hp->beta1, hp->beta2, hp->eps, hp->weight_decay,
                        hp->decoupled_weight_decay, hp->step, hp->grad_scale, hp->v_frozen_at) != 0)
    return -EINVAL;
  if (numel == 0)
    return ZK_NOTHING_TO_DO;
  if (param == NULL || exp_avg == NULL || exp_avg_sq == NULL || grad == NULL ||
      (working == NULL && working_dtype != ZK_DTYPE_NONE))
    return -EINVAL;
  return 0;
}

/* The same for SGD; momentum_buf is needed only with momentum. */
static inline int zk_sgd_prepare(const zk_sgd_hparams *hp, zk_sgd_coef *coef, const float *param,
                                 const float *momentum_buf, const void *grad, zk_dtype grad_dtype,
                                 const void *working, zk_dtype working_dtype, size_t numel) {
  if (hp == NULL || !zk_step_dtypes_ok(grad_dtype, working_dtype) ||
      zk_sgd_coef_init(coef, hp->lr, hp->momentum, hp->dampening, hp->weight_decay, hp->nesterov,
                       hp->step, hp->grad_scale) != 0)
    return -EINVAL;
  if (numel == 0)
    return ZK_NOTHING_TO_DO;
  if (param == NULL || grad == NULL || (coef->has_momentum && momentum_buf == NULL) ||
      (working == NULL && working_dtype != ZK_DTYPE_NONE))
    return -EINVAL;
  return 0;
}

#endif /* ZK_ARGS_H */
