/* The layout a save writes, from the job's view (ckpt_job.h). */
#include "ckpt_job.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

ckpt_manifest *ckpt_layout_of(const ckpt_job_view *j, uint64_t step, uint64_t version) {
  unit_layout *const *units = j->units;
  unsigned nunits = j->nunits;
  ckpt_manifest *m = calloc(1, sizeof *m);
  if (m == NULL)
    return NULL;
  const job_config *cfg = j->config;
  m->format_version = CKPT_MANIFEST_VERSION;
  m->job = strdup(j->name);
  m->name = strdup("layout"); /* the coordinator names the checkpoint */
  m->job_id = j->id;
  m->step = step;
  m->version = version;
  m->world_size = (uint32_t)j->world_size;
  snprintf(m->config.optimizer, sizeof m->config.optimizer, "%s",
           job_optimizer_name(cfg->optimizer));
  m->config.lr = cfg->lr;
  m->config.beta1 = cfg->beta1;
  m->config.beta2 = cfg->beta2;
  m->config.eps = cfg->eps;
  m->config.weight_decay = cfg->weight_decay;
  m->config.momentum = cfg->momentum;
  m->config.dampening = cfg->dampening;
  m->config.nesterov = cfg->nesterov;
  snprintf(m->config.working_dtype, sizeof m->config.working_dtype, "%s",
           cfg->working_dtype == ZK_BF16  ? "bf16"
           : cfg->working_dtype == ZK_F16 ? "fp16"
                                          : "fp32");
  m->config.max_grad_norm = cfg->max_grad_norm;
  int has[JOB_NSTATES];
  job_config_states(cfg, has);
  m->has_moment1 = has[JOB_STATE_MOMENT1] && !j->weights_only;
  m->has_moment2 = has[JOB_STATE_MOMENT2] && !j->weights_only;
  m->nunits = nunits;
  m->units = calloc(nunits ? nunits : 1, sizeof *m->units);
  int ok = m->job != NULL && m->name != NULL && m->units != NULL;
  for (unsigned u = 0; ok && u < nunits; u++) {
    const unit_layout *l = units[u];
    ckpt_unit *cu = &m->units[u];
    cu->name = strdup(l->name);
    cu->ntensors = l->ntensors;
    cu->numel = l->numel;
    cu->padded_numel = l->padded_numel;
    cu->shard_numel = l->shard_numel;
    cu->tensors = calloc(l->ntensors ? l->ntensors : 1, sizeof *cu->tensors);
    ok = cu->name != NULL && cu->tensors != NULL;
    for (unsigned t = 0; ok && t < l->ntensors; t++) {
      const tensor_layout *tl = &l->tensors[t];
      ckpt_tensor *ct = &cu->tensors[t];
      ct->name = strdup(tl->name);
      ct->ndim = tl->ndim;
      memcpy(ct->shape, tl->shape, sizeof ct->shape[0] * tl->ndim);
      ct->numel = tl->numel;
      ct->offset = tl->offset;
      ct->frozen = tl->frozen;
      ok = ct->name != NULL;
    }
  }
  if (ok && !j->weights_only && j->feedback_kind != NULL) {
    snprintf(m->feedback.kind, sizeof m->feedback.kind, "%s", j->feedback_kind);
    m->feedback.nodes = j->feedback_nodes;
    m->feedback.numel = calloc(nunits ? nunits : 1, sizeof *m->feedback.numel);
    ok = m->feedback.numel != NULL;
    for (unsigned u = 0; ok && u < nunits; u++)
      m->feedback.numel[u] = j->feedback_numel(j->feedback_arg, units[u]);
  }
  if (!ok) {
    ckpt_manifest_free(m);
    free(m);
    return NULL;
  }
  return m;
}
