/* STEP: the all-reduce of the gradient norm (with the save orders the
 * ranks know of), clipping, the optimizer update of every shard and the
 * new working copies; the progress log. */
#include "exec_impl.h"
#include "offload.h"
#include "tier.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>

#include "clock.h"
#include "log.h"
#include "pin.h"

/* Every PROGRESS_EVERY_STEPS steps rank 0 logs where the job is and how
 * fast it goes, so an operator sees training progress in the daemon's log
 * without asking the workers. */
#define PROGRESS_EVERY_STEPS 100

static void log_progress(rank_state *rs, double grad_norm) {
  if (rs->rank != 0)
    return;
  double now = clock_now_s();
  if (rs->progress_since_s == 0) {
    rs->progress_since_s = now;
    rs->progress_since_step = rs->step;
    return;
  }
  if (rs->step % PROGRESS_EVERY_STEPS != 0)
    return;
  double elapsed = now - rs->progress_since_s;
  double rate = elapsed > 0 ? (double)(rs->step - rs->progress_since_step) / elapsed : 0;
  LOG_INFOF("job progress",
            "job=%s step=%llu grad_norm=%.4g lr=%g steps_per_s=%.2f live_bytes=%llu", rs->job->name,
            (unsigned long long)rs->step, grad_norm, rs->lr, rate,
            (unsigned long long)rs->live_bytes);
  rs->progress_since_s = now;
  rs->progress_since_step = rs->step;
}

/* After a step with loss scaling (every rank alike: `skipped` comes from
 * the all-reduce): DeepSpeed's DynamicLossScaler.update_scale. An overflow
 * uses up one of the hysteresis's tolerated overflows while more than one
 * is left, else backs the scale off (down to the minimum) and leaves the
 * hysteresis used up, so every further overflow backs off at once; only a
 * growth, after `window` good steps since the last overflow, restores it
 * (DeepSpeed's default, consecutive_hysteresis off). */
static void update_loss_scale(rank_state *rs, int skipped) {
  const job_config *c = &rs->job->config;
  double scale = atomic_load(&rs->loss_scale);
  if (skipped) {
    rs->loss_scale_good = 0;
    if (rs->loss_scale_hysteresis > 1) {
      rs->loss_scale_hysteresis--;
      return;
    }
    scale *= c->loss_scale_backoff;
    if (scale < c->loss_scale_min)
      scale = c->loss_scale_min;
    LOG_INFOF("loss scale reduced", "job=%s rank=%d step=%llu loss_scale=%g", rs->job->name,
              rs->rank, (unsigned long long)rs->step, scale);
  } else if (++rs->loss_scale_good >= c->loss_scale_window) {
    rs->loss_scale_good = 0;
    rs->loss_scale_hysteresis = c->loss_scale_hysteresis;
    scale *= c->loss_scale_growth;
  }
  atomic_store(&rs->loss_scale, scale);
}

/* What the accumulated gradients are divided by: the worker's grad_scale
 * (averaging over the ranks; 0: 1) and the loss scale its loss carried. */
static double gradient_divisor(rank_state *rs, double grad_scale) {
  double loss_scale = atomic_load(&rs->loss_scale);
  return (grad_scale == 0 ? 1.0 : grad_scale) * (loss_scale > 0 ? loss_scale : 1.0);
}

/* This rank's sum of squares of its accumulated gradients (unit by unit,
 * each sum deterministic). 0 or the device's error. */
static int local_grad_sumsq(rank_state *rs, double *out) {
  device *dev = rs->dev;
  int err = device_sumsq_begin(dev);
  for (uint32_t u = 0; u < rs->nshards && err == 0; u++) {
    shard *sh = &rs->shards[u];
    if (shard_has_state(sh))
      err = device_sumsq_add(dev, sh->grad_acc, job_unit(rs->job, u)->shard_numel);
  }
  if (err == 0)
    err = device_sumsq_end(dev, out);
  return err;
}

void exec__handle_grad_norm(rank_state *rs, exec_op *op) {
  Zerod__V1__GradNormRequest *req = (Zerod__V1__GradNormRequest *)op->request;
  if (exec__op_job_failed(rs, op))
    return;
  /* Every rank divides by the same grad_scale, or none answers. */
  agree_field field;
  agree_set agreed;
  agree_init(&agreed, &field, 1);
  agreed.refused = !(req->grad_scale >= 0 && isfinite(req->grad_scale));
  agree_add_f64(&agreed, req->grad_scale == 0 ? 1.0 : req->grad_scale, "grad_scale");
  double grad_scale = gradient_divisor(rs, agreed.refused ? 0 : req->grad_scale);
  double sumsq = 0;
  int err = local_grad_sumsq(rs, &sumsq);
  if (err != 0) {
    exec__op_device_failed(rs, op, "grad_norm", err);
    return;
  }
  err = exec__all_reduce_agreed(rs, op, &sumsq, 1, &agreed,
                                ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                                "grad_scale must be >= 0 and finite", "grad_norm request");
  if (err < 0) {
    exec__op_comm_failed(rs, op, "all_reduce (gradient norm)", err);
    return;
  }
  if (err > 0)
    return;
  Zerod__V1__GradNormReply reply = ZEROD__V1__GRAD_NORM_REPLY__INIT;
  reply.grad_norm = sqrt(sumsq) / grad_scale;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM_REPLY, &reply.base);
}

/* The optimizer over one stretch [begin, begin + n) of a shard on dev:
 * its trainable ranges there, each with its group's hyper-parameters.
 * master, m1, m2, grad and working hold that stretch (the shard's own
 * arrays at begin, a tier chunk, a GPU rank's staging slot); working NULL:
 * the master is the working copy. An offload_update_fn. */
typedef struct update_args {
  int64_t step_number;
  double grad_scale; /* what multiplies the accumulated gradients: clip / divisor */
} update_args;

static int update_chunk(void *arg, rank_state *rs, device *dev, shard *sh, uint64_t begin,
                        uint64_t n, float *master, float *m1, float *m2, const float *grad,
                        void *working) {
  const update_args *a = arg;
  const job_config *c = &rs->job->config;
  size_t welem = zk_dtype_size(c->working_dtype);
  uint64_t end = begin + n;
  for (unsigned k = 0; k < sh->ntrainable; k++) {
    uint64_t b = sh->trainable[k].begin > begin ? sh->trainable[k].begin : begin;
    uint64_t e = sh->trainable[k].end < end ? sh->trainable[k].end : end;
    if (b >= e)
      continue;
    job_group grp;
    exec__group(rs, sh->trainable[k].group, &grp);
    uint64_t at = b - begin;
    void *w = working != NULL ? (uint8_t *)working + at * welem : NULL;
    zk_dtype wdtype = w != NULL ? c->working_dtype : ZK_DTYPE_NONE;
    int rc;
    if (c->optimizer == JOB_SGD) {
      zk_sgd_hparams hp = {.lr = grp.lr,
                           .momentum = grp.momentum,
                           .dampening = grp.dampening,
                           .weight_decay = grp.weight_decay,
                           .nesterov = grp.nesterov,
                           .step = a->step_number,
                           .grad_scale = a->grad_scale};
      rc = device_sgd_step(dev, &hp, master + at, m1 ? m1 + at : NULL, grad + at, w, wdtype, e - b);
    } else {
      zk_adam_hparams hp = {.lr = grp.lr,
                            .beta1 = grp.beta1,
                            .beta2 = grp.beta2,
                            .eps = grp.eps,
                            .weight_decay = grp.weight_decay,
                            .decoupled_weight_decay = c->optimizer == JOB_ADAMW,
                            .step = a->step_number,
                            .grad_scale = a->grad_scale,
                            .v_frozen_at = c->onebit_freeze_step};
      rc = device_adam_step(dev, &hp, master + at, m1 + at, m2 + at, grad + at, w, wdtype, e - b);
    }
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* A tier chunk of a host rank: the gradients and the working copy are
 * the shard's arrays (the working copy its own array, fp32 included). A
 * tier_chunk_fn. */
static int update_tier_chunk(void *arg, rank_state *rs, shard *sh, const unit_layout *l,
                             uint64_t begin, uint64_t n, float *master, float *m1, float *m2) {
  (void)l;
  size_t welem = zk_dtype_size(rs->job->config.working_dtype);
  return update_chunk(arg, rs, rs->dev, sh, begin, n, master, m1, m2, sh->grad_acc + begin,
                      (uint8_t *)sh->working + begin * welem);
}

/* The step's options, which every rank must send alike, into `a`; this
 * rank's own verdict on them in a->refused, with the reason in why. */
static void step_options(const rank_state *rs, const Zerod__V1__StepRequest *req, agree_set *a,
                         char *why, size_t why_bytes) {
  int bad_group_lr = 0;
  for (size_t g = 0; g < req->n_group_lr; g++)
    bad_group_lr |= !(req->group_lr[g] > 0 && isfinite(req->group_lr[g]));
  unsigned ngroups = rs->ngroups ? rs->ngroups : 1;
  a->refused = 1;
  if (req->n_group_lr != 0 && req->n_group_lr != ngroups)
    snprintf(why, why_bytes, "%zu group learning rates for %u parameter groups", req->n_group_lr,
             ngroups);
  else if ((req->set_lr && !(req->lr > 0 && isfinite(req->lr))) || bad_group_lr ||
           (req->set_max_grad_norm && !(req->max_grad_norm >= 0)) ||
           !(req->grad_scale >= 0 && isfinite(req->grad_scale)))
    /* No "step: " here: the client names the request it failed (libzerod
     * prefixes "step: "), as for every other request's errors. */
    snprintf(why, why_bytes, "lr must be > 0, max_grad_norm >= 0 and grad_scale >= 0 and finite");
  else
    a->refused = 0;
  double lr[2] = {req->set_lr ? 1.0 : 0.0, req->set_lr ? req->lr : 0.0};
  double clip[2] = {req->set_max_grad_norm ? 1.0 : 0.0,
                    req->set_max_grad_norm ? req->max_grad_norm : 0.0};
  agree_add(a, lr, sizeof lr, "lr");
  agree_add(a, req->group_lr, req->n_group_lr * sizeof *req->group_lr, "group_lr");
  agree_add(a, clip, sizeof clip, "max_grad_norm");
  agree_add_f64(a, req->grad_scale == 0 ? 1.0 : req->grad_scale, "grad_scale");
}

/* The options the ranks agreed on take effect. */
static void apply_step_options(rank_state *rs, const Zerod__V1__StepRequest *req) {
  if (req->set_lr)
    rs->lr = req->lr;
  for (size_t g = 0; g < req->n_group_lr; g++) {
    if (g == 0)
      rs->lr = req->group_lr[0];
    else
      rs->groups[g].lr = req->group_lr[g];
  }
  if (req->set_max_grad_norm)
    rs->max_grad_norm = req->max_grad_norm;
}

void exec__handle_step(rank_state *rs, exec_op *op) {
  Zerod__V1__StepRequest *req = (Zerod__V1__StepRequest *)op->request;
  if (exec__op_job_failed(rs, op))
    return;
  /* The options are checked here and compared across the ranks in the
   * norm's all-reduce; a rank whose options are invalid still joins it,
   * so that every rank fails alike instead of waiting for it. */
  agree_field fields[4];
  agree_set agreed;
  agree_init(&agreed, fields, 4);
  char refusal[256] = "";
  step_options(rs, req, &agreed, refusal, sizeof refusal);
  /* Read before the step moves the loss scale (update_loss_scale below). */
  double loss_scale = atomic_load(&rs->loss_scale);
  double grad_scale = gradient_divisor(rs, agreed.refused ? 0 : req->grad_scale);

  /* The global norm: every rank's partial sum of squares over its shards
   * (in unit order, each sum deterministic), all-reduced. */
  device *dev = rs->dev;
  double local_sumsq = 0;
  int err = local_grad_sumsq(rs, &local_sumsq);
  if (err != 0) {
    exec__op_device_failed(rs, op, "step (gradient norm)", err);
    return;
  }
  /* The same all-reduce agrees on a checkpoint: a rank that knows of a
   * save order adds its id and a count, and every rank takes its copy at
   * the end of this step (ckpt_node.h). The coordinator has one save of a
   * job in flight at a time, so the ids summed are all the same. */
  uint64_t pending = atomic_load(&rs->ckpt_pending);
  if (pending <= rs->ckpt_taken)
    pending = 0;
  double reduced[3] = {local_sumsq, (double)pending, pending != 0 ? 1.0 : 0.0};
  err =
      exec__all_reduce_agreed(rs, op, reduced, 3, &agreed,
                              ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, refusal, "step options");
  if (err < 0) {
    exec__op_comm_failed(rs, op, "all_reduce (gradient norm)", err);
    return;
  }
  if (err > 0)
    return; /* answered: refused or different options; the gradients stay */
  apply_step_options(rs, req);
  local_sumsq = reduced[0];
  uint64_t save_id = reduced[2] > 0 ? (uint64_t)llround(reduced[1] / reduced[2]) : 0;
  double grad_norm = sqrt(local_sumsq) / grad_scale;
  int skipped = !isfinite(local_sumsq);
  if (!skipped) {
    double coef = 1.0;
    if (rs->max_grad_norm > 0) {
      coef = rs->max_grad_norm / (grad_norm + 1e-6);
      if (coef > 1.0)
        coef = 1.0;
    }
    int64_t step_number = (int64_t)rs->step + 1;
    /* The version goes up here, after the all-reduce: every rank has
     * finished its previous write, so ranks stay within one version. A
     * pin of the current version gets this rank's slices first. */
    pin_mark_step(rs);
    pin_begin_write(rs);
    update_args args = {.step_number = step_number, .grad_scale = coef / grad_scale};
    int rc = 0;
    for (uint32_t u = 0; u < rs->nshards && rc == 0; u++) {
      shard *sh = &rs->shards[u];
      if (shard_has_state(sh) && !sh->tiered && !sh->host_state)
        rc = update_chunk(&args, rs, dev, sh, 0, job_unit(rs->job, u)->shard_numel, sh->master,
                          sh->moment1, sh->moment2, sh->grad_acc,
                          sh->working == (void *)sh->master ? NULL : sh->working);
    }
    /* A GPU rank's state off the GPU: the CPU's step, chunk by chunk,
     * the gradients coming down and the working copies going up around it
     * (offload.h); a host rank's state on disk, streamed through the
     * staging buffers (tier.h). */
    if (rc == 0 && offload_enabled(rs))
      rc = offload_step(rs, update_chunk, &args);
    else if (rc == 0)
      rc = tier_stream(rs, -1, 1, update_tier_chunk, &args);
    if (rc != 0) {
      /* The hyper-parameters were checked at creation; a failure here
       * would leave ranks inconsistent, so the job stops. */
      device_sync(dev);
      pin_end_write(rs);
      exec__op_device_failed(rs, op, "optimizer step", rc);
      return;
    }
    /* Readers copy the working copies once the write lock is released. */
    rc = device_sync(dev);
    pin_end_write(rs);
    if (rc != 0) {
      exec__op_device_failed(rs, op, "optimizer step", rc);
      return;
    }
    rs->step++;
    log_progress(rs, grad_norm);
  }
  for (uint32_t u = 0; u < rs->nshards && err == 0; u++) {
    shard *sh = &rs->shards[u];
    if (shard_has_state(sh))
      err = device_zero(dev, sh->grad_acc, job_unit(rs->job, u)->shard_numel * sizeof(float));
  }
  if (err == 0)
    err = device_sync(dev);
  if (err != 0) {
    exec__op_device_failed(rs, op, "step (clearing the gradients)", err);
    return;
  }
  if (loss_scale > 0)
    update_loss_scale(rs, skipped);
  rs->order_complete = 1;
  if (save_id > rs->ckpt_taken)
    exec__take_snapshot(rs, save_id);
  if (!skipped && exec__replicate(rs, op) != 0)
    return; /* answered: the all-reduce failed */
  Zerod__V1__StepReply reply = ZEROD__V1__STEP_REPLY__INIT;
  reply.step = rs->step;
  reply.version = rs->version;
  reply.grad_norm = grad_norm;
  reply.skipped = skipped;
  reply.loss_scale = atomic_load(&rs->loss_scale);
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, &reply.base);
}
