/* math_optim.h - the per-element optimizer updates, shared by CPU and CUDA.
 *
 * Each update follows torch.optim's single-tensor implementation operation by
 * operation, in fp32, rounding where torch rounds, so that results agree with
 * PyTorch to the bit on CPU: torch's CPU kernels compute add(x, alpha=a) and
 * addcmul as fused multiply-adds, so those are fmaf here, and every other
 * product and sum is rounded on its own (the build keeps the compiler from
 * contracting them: C11 mode on CPU, --fmad=false for CUDA). fmaf is
 * correctly rounded on both, so CPU and CUDA produce the same bits.
 *
 * The per-step scalars (bias corrections, step size) are computed once per
 * step on the host in double, as torch computes them from Python floats, and
 * rounded to fp32 where torch hands them to a tensor operation.
 */
#ifndef ZK_MATH_OPTIM_H
#define ZK_MATH_OPTIM_H

#include <math.h>
#include "zk_hd.h"

/* ---- Adam / AdamW ------------------------------------------------------ */

typedef struct zk_adam_coef {
  float grad_scale;   /* multiplies the gradient first (1 = none; exact then) */
  float weight_decay; /* Adam: grad += weight_decay * param */
  float param_decay;  /* AdamW: param *= 1 - lr * weight_decay (1 = none) */
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size; /* -lr / (1 - beta1^step) */
  int l2;              /* 1 when Adam (not AdamW) has a non-zero weight decay */
} zk_adam_coef;

/* torch (1.13 and 2.x), per parameter:
 *   AdamW: param.mul_(1 - lr * wd)          Adam: grad = grad.add(param, alpha=wd)
 *   exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
 *   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
 *   denom = (exp_avg_sq.sqrt() / sqrt(1 - beta2^step)).add_(eps)
 *   param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1^step))
 * (torch 2.x writes the first moment as a lerp, which rounds differently by
 * at most an ulp; the parity tests bound the effect.) */
ZK_HD float zk_adam_update(const zk_adam_coef *c, float param, float *exp_avg, float *exp_avg_sq,
                           float grad) {
  float g = grad * c->grad_scale;
  param = param * c->param_decay;
  if (c->l2)
    g = fmaf(c->weight_decay, param, g);
  float m = fmaf(c->one_minus_beta1, g, *exp_avg * c->beta1);
  float v = fmaf(c->one_minus_beta2 * g, g, *exp_avg_sq * c->beta2);
  float denom = sqrtf(v) / c->bias_correction2_sqrt + c->eps;
  *exp_avg = m;
  *exp_avg_sq = v;
  return param + c->neg_step_size * m / denom;
}

/* The host computes the coefficients of one step; returns 0, or -1 for
 * hyper-parameters torch would reject too. */
static inline int zk_adam_coef_init(zk_adam_coef *c, double lr, double beta1, double beta2,
                                    double eps, double weight_decay, int decoupled, long long step,
                                    double grad_scale, long long v_frozen_at) {
  if (!(lr >= 0) || !(eps >= 0) || !(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1) ||
      !(weight_decay >= 0) || step < 1 || !(grad_scale > 0) || isinf(grad_scale) || v_frozen_at < 0)
    return -1;
  double bias_correction1 = 1.0 - pow(beta1, (double)step);
  /* 1-bit Adam past its warm-up: v kept (v * 1 + 0 * g * g) and corrected
   * as at the step it froze. */
  const int frozen = v_frozen_at > 0 && step > v_frozen_at;
  double bias_correction2 = 1.0 - pow(beta2, (double)(frozen ? v_frozen_at : step));
  if (frozen)
    beta2 = 1.0;
  c->grad_scale = (float)grad_scale;
  c->weight_decay = (float)weight_decay;
  c->param_decay = decoupled ? (float)(1.0 - lr * weight_decay) : 1.0f;
  c->l2 = !decoupled && weight_decay != 0.0;
  c->beta1 = (float)beta1;
  c->one_minus_beta1 = (float)(1.0 - beta1);
  c->beta2 = (float)beta2;
  c->one_minus_beta2 = (float)(1.0 - beta2);
  c->bias_correction2_sqrt = (float)sqrt(bias_correction2);
  c->eps = (float)eps;
  c->neg_step_size = (float)(-(lr / bias_correction1));
  return 0;
}

/* ---- SGD --------------------------------------------------------------- */

typedef struct zk_sgd_coef {
  float grad_scale;
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  float neg_lr;
  int has_weight_decay;
  int has_momentum;
  int nesterov;
  int first_step; /* the momentum buffer starts as a copy of the gradient */
} zk_sgd_coef;

/* torch, per parameter:
 *   if wd != 0: d_p = d_p.add(param, alpha=wd)
 *   if momentum != 0:
 *     buf = clone(d_p) on the first step, else buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
 *     d_p = d_p.add(buf, alpha=momentum) if nesterov else buf
 *   param.add_(d_p, alpha=-lr) */
ZK_HD float zk_sgd_update(const zk_sgd_coef *c, float param, float *momentum_buf, float grad) {
  float d = grad * c->grad_scale;
  if (c->has_weight_decay)
    d = fmaf(c->weight_decay, param, d);
  if (c->has_momentum) {
    float buf = c->first_step ? d : fmaf(c->one_minus_dampening, d, *momentum_buf * c->momentum);
    *momentum_buf = buf;
    d = c->nesterov ? fmaf(c->momentum, buf, d) : buf;
  }
  return fmaf(c->neg_lr, d, param);
}

static inline int zk_sgd_coef_init(zk_sgd_coef *c, double lr, double momentum, double dampening,
                                   double weight_decay, int nesterov, long long step,
                                   double grad_scale) {
  if (!(lr >= 0) || !(momentum >= 0) || !(weight_decay >= 0) || isnan(dampening) || step < 1 ||
      !(grad_scale > 0) || isinf(grad_scale))
    return -1;
  /* torch: "Nesterov momentum requires a momentum and zero dampening". */
  if (nesterov && (momentum <= 0 || dampening != 0))
    return -1;
  c->grad_scale = (float)grad_scale;
  c->weight_decay = (float)weight_decay;
  c->momentum = (float)momentum;
  c->one_minus_dampening = (float)(1.0 - dampening);
  c->neg_lr = (float)(-lr);
  c->has_weight_decay = weight_decay != 0.0;
  c->has_momentum = momentum != 0.0;
  c->nesterov = nesterov != 0;
  c->first_step = step == 1;
  return 0;
}

#endif /* ZK_MATH_OPTIM_H */
