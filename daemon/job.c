/* Jobs, their configs and unit layouts (see job.h). */
#include "job.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_node.h"
#include "exec.h"
#include "pin.h"

int job_config_from_proto(const Zerod__V1__JobConfig *pc, job_config *c, char *err,
                          size_t err_bytes) {
  memset(c, 0, sizeof *c);
  c->working_dtype = ZK_F32;
  if (pc == NULL)
    return 0;
  if (pc->optimizer != NULL) {
    const Zerod__V1__OptimizerConfig *o = pc->optimizer;
    c->optimizer = o->kind == ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_UNSPECIFIED
                       ? JOB_ADAMW
                       : (job_optimizer)o->kind;
    c->lr = o->lr;
    c->beta1 = o->beta1;
    c->beta2 = o->beta2;
    c->eps = o->eps;
    c->weight_decay =
        o->has_weight_decay ? o->weight_decay : (c->optimizer == JOB_ADAMW ? 0.01 : 0.0);
    c->momentum = o->momentum;
    c->dampening = o->dampening;
    c->nesterov = o->nesterov;
  } else {
    c->optimizer = JOB_ADAMW;
    c->weight_decay = 0.01;
  }
  switch (pc->working_dtype) {
  case ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED:
  case ZEROD__V1__DTYPE__DTYPE_F32:
    c->working_dtype = ZK_F32;
    break;
  case ZEROD__V1__DTYPE__DTYPE_BF16:
    c->working_dtype = ZK_BF16;
    break;
  default:
    snprintf(err, err_bytes, "working precision must be fp32 or bf16");
    return -EINVAL;
  }
  c->max_live_bytes = pc->max_live_bytes;
  c->max_grad_norm = pc->max_grad_norm;
  return 0;
}

const char *job_optimizer_name(job_optimizer o) {
  return o == JOB_ADAMW ? "adamw" : o == JOB_ADAM ? "adam" : "sgd";
}

int job_config_finish(job_config *c, uint64_t default_max_live_bytes, char *err, size_t err_bytes) {
  if (c->optimizer == 0)
    c->optimizer = JOB_ADAMW;
  if (c->optimizer != JOB_ADAMW && c->optimizer != JOB_ADAM && c->optimizer != JOB_SGD) {
    snprintf(err, err_bytes, "unknown optimizer %d", (int)c->optimizer);
    return -EINVAL;
  }
  if (c->lr == 0)
    c->lr = 1e-3;
  if (c->beta1 == 0)
    c->beta1 = 0.9;
  if (c->beta2 == 0)
    c->beta2 = 0.999;
  if (c->eps == 0)
    c->eps = 1e-8;
  if (c->max_live_bytes == 0)
    c->max_live_bytes = default_max_live_bytes;
  if (c->working_dtype != ZK_F32 && c->working_dtype != ZK_BF16) {
    snprintf(err, err_bytes, "working precision must be fp32 or bf16");
    return -EINVAL;
  }
  /* The checks torch.optim makes, so a bad config fails at creation and not
   * at the first step. */
  if (!(c->lr > 0) || !isfinite(c->lr)) {
    snprintf(err, err_bytes, "invalid learning rate %g (must be > 0)", c->lr);
    return -EINVAL;
  }
  if (!(c->beta1 >= 0 && c->beta1 < 1) || !(c->beta2 >= 0 && c->beta2 < 1)) {
    snprintf(err, err_bytes, "invalid betas (%g, %g) (each in [0, 1))", c->beta1, c->beta2);
    return -EINVAL;
  }
  if (!(c->eps >= 0) || !(c->weight_decay >= 0) || !(c->momentum >= 0) ||
      !(c->max_grad_norm >= 0) || !isfinite(c->weight_decay)) {
    snprintf(err, err_bytes, "eps, weight decay, momentum and max_grad_norm must be >= 0");
    return -EINVAL;
  }
  if (c->optimizer == JOB_SGD && c->nesterov && (c->momentum <= 0 || c->dampening != 0)) {
    snprintf(err, err_bytes, "nesterov momentum requires a momentum and zero dampening");
    return -EINVAL;
  }
  return 0;
}

int job_create(struct daemon *daemon, const char *name, const char *token, const job_config *config,
               int world_size, int nranks, int first_rank, uint64_t id, job **out) {
  if (nranks < 1 || first_rank < 0 || first_rank + nranks > world_size)
    return -EINVAL;
  job *j = calloc(1, sizeof *j);
  if (j == NULL)
    return -ENOMEM;
  j->daemon = daemon;
  j->name = strdup(name);
  j->token = strdup(token != NULL ? token : "");
  j->config = *config;
  j->world_size = world_size;
  j->nranks = nranks;
  j->first_rank = first_rank;
  j->id = id;
  j->failed_generation = -1;
  j->ranks = calloc((size_t)nranks, sizeof *j->ranks);
  if (j->name == NULL || j->token == NULL || j->ranks == NULL) {
    job_destroy(j);
    return -ENOMEM;
  }
  pthread_mutex_init(&j->mutex, NULL);
  for (int r = 0; r < nranks; r++) {
    rank_state *rs = &j->ranks[r];
    rs->job = j;
    rs->rank = first_rank + r;
    rs->lr = config->lr;
    rs->max_grad_norm = config->max_grad_norm;
    pthread_mutex_init(&rs->queue_mutex, NULL);
    pthread_cond_init(&rs->queue_cond, NULL);
    pthread_mutex_init(&rs->comm_lock, NULL);
  }
  if (pin_job_init(j) != 0 || ckpt_node_job_init(j) != 0) {
    job_destroy(j);
    return -ENOMEM;
  }
  *out = j;
  return 0;
}

void job_destroy(job *j) {
  if (j == NULL)
    return;
  ckpt_node_job_free(j); /* waits for its shard writers */
  if (j->ranks != NULL) {
    for (int r = 0; r < j->nranks; r++) {
      exec_rank_free(&j->ranks[r]);
      pthread_mutex_destroy(&j->ranks[r].queue_mutex);
      pthread_cond_destroy(&j->ranks[r].queue_cond);
      pthread_mutex_destroy(&j->ranks[r].comm_lock);
    }
    pthread_mutex_destroy(&j->mutex);
  }
  pin_job_destroy(j);
  for (uint32_t u = 0; u < j->nunits; u++)
    unit_layout_free(j->units[u]);
  free(j->units);
  free(j->ranks);
  free(j->name);
  free(j->token);
  free(j);
}

/* ------------------------------------------------------------------------ */
/* Unit layouts                                                             */
/* ------------------------------------------------------------------------ */

/* The descriptor is a sequence of chunks, [u32 length][bytes]: first the
 * unit (name, tensor count, initialisation tag), then one per tensor (name,
 * dims, frozen). Comparing chunk by chunk finds the first differing tensor,
 * which the layout-mismatch error names. */
typedef struct desc_writer {
  uint8_t *buf;
  size_t len, cap;
  int failed;
} desc_writer;

static void desc_put(desc_writer *w, const void *data, size_t bytes) {
  if (w->failed)
    return;
  if (w->len + bytes > w->cap) {
    size_t cap = w->cap ? w->cap * 2 : 256;
    while (cap < w->len + bytes)
      cap *= 2;
    uint8_t *grown = realloc(w->buf, cap);
    if (grown == NULL) {
      w->failed = 1;
      return;
    }
    w->buf = grown;
    w->cap = cap;
  }
  memcpy(w->buf + w->len, data, bytes);
  w->len += bytes;
}

static void desc_u64(desc_writer *w, uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; i++)
    b[i] = (uint8_t)(v >> (8 * i));
  desc_put(w, b, 8);
}

static void desc_str(desc_writer *w, const char *s) {
  desc_u64(w, strlen(s));
  desc_put(w, s, strlen(s));
}

static size_t desc_chunk_begin(desc_writer *w) {
  uint8_t zero[4] = {0};
  desc_put(w, zero, 4);
  return w->len;
}

static void desc_chunk_end(desc_writer *w, size_t start) {
  if (w->failed)
    return;
  uint32_t n = (uint32_t)(w->len - start);
  for (int i = 0; i < 4; i++)
    w->buf[start - 4 + (size_t)i] = (uint8_t)(n >> (8 * i));
}

static uint64_t round_up(uint64_t x, uint64_t m) {
  return (x + m - 1) / m * m;
}

int unit_layout_build(const char *name, unsigned ntensors, const char *const *tensor_names,
                      const uint64_t *const *shapes, const unsigned *ndims, const int *frozen,
                      int world_size, uint64_t init_tag, unit_layout **out, char *err,
                      size_t err_bytes) {
  unit_layout *l = calloc(1, sizeof *l);
  if (l == NULL)
    return -ENOMEM;
  l->name = strdup(name);
  l->ntensors = ntensors;
  l->tensors = calloc(ntensors, sizeof *l->tensors);
  if (l->name == NULL || l->tensors == NULL) {
    unit_layout_free(l);
    return -ENOMEM;
  }
  desc_writer w = {0};
  size_t chunk = desc_chunk_begin(&w);
  desc_str(&w, name);
  desc_u64(&w, ntensors);
  desc_u64(&w, init_tag);
  desc_chunk_end(&w, chunk);

  /* 2^48 elements is far beyond any host's memory; the bound keeps every
   * later byte count (x 4 bytes x world) from overflowing 64 bits. */
  const uint64_t max_numel = (uint64_t)1 << 48;
  uint64_t offset = 0;
  for (unsigned t = 0; t < ntensors; t++) {
    tensor_layout *tl = &l->tensors[t];
    tl->name = strdup(tensor_names[t]);
    if (tl->name == NULL) {
      free(w.buf);
      unit_layout_free(l);
      return -ENOMEM;
    }
    for (unsigned k = 0; k < t; k++) {
      if (strcmp(l->tensors[k].name, tl->name) == 0) {
        snprintf(err, err_bytes, "unit '%s': tensor name '%s' appears twice", name, tl->name);
        free(w.buf);
        unit_layout_free(l);
        return -EINVAL;
      }
    }
    tl->ndim = ndims[t];
    tl->frozen = frozen[t] != 0;
    uint64_t numel = 1;
    for (unsigned d = 0; d < tl->ndim; d++) {
      tl->shape[d] = shapes[t][d];
      if (tl->shape[d] == 0 || numel > max_numel / tl->shape[d]) {
        snprintf(err, err_bytes, "unit '%s' tensor '%s': dimension %u is %llu (must be 1..2^48)",
                 name, tl->name, d, (unsigned long long)tl->shape[d]);
        free(w.buf);
        unit_layout_free(l);
        return -EINVAL;
      }
      numel *= tl->shape[d];
    }
    tl->numel = numel;
    offset = round_up(offset, JOB_ALIGN_NUMEL);
    tl->offset = offset;
    offset += numel;
    l->packed_numel += numel;
    if (offset > max_numel) {
      snprintf(err, err_bytes, "unit '%s' has more than 2^48 elements", name);
      free(w.buf);
      unit_layout_free(l);
      return -EINVAL;
    }
    chunk = desc_chunk_begin(&w);
    desc_str(&w, tl->name);
    desc_u64(&w, tl->ndim);
    for (unsigned d = 0; d < tl->ndim; d++)
      desc_u64(&w, tl->shape[d]);
    desc_u64(&w, (uint64_t)tl->frozen);
    desc_chunk_end(&w, chunk);
  }
  if (w.failed) {
    free(w.buf);
    unit_layout_free(l);
    return -ENOMEM;
  }
  l->numel = offset;
  l->padded_numel = round_up(offset, (uint64_t)world_size * JOB_ALIGN_NUMEL);
  l->shard_numel = l->padded_numel / (uint64_t)world_size;
  l->descriptor = w.buf;
  l->descriptor_bytes = w.len;
  *out = l;
  return 0;
}

void unit_layout_free(unit_layout *l) {
  if (l == NULL)
    return;
  if (l->tensors != NULL)
    for (unsigned t = 0; t < l->ntensors; t++)
      free(l->tensors[t].name);
  free(l->tensors);
  free(l->name);
  free(l->descriptor);
  free(l);
}

/* ------------------------------------------------------------------------ */
/* Failure state and the unit table                                         */
/* ------------------------------------------------------------------------ */

void job_fail(job *j, unsigned generation, const char *fmt, ...) {
  pthread_mutex_lock(&j->mutex);
  if (j->failed_generation != (long)generation) {
    j->failed_generation = (long)generation;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->fail_reason, sizeof j->fail_reason, fmt, ap);
    va_end(ap);
  }
  pthread_mutex_unlock(&j->mutex);
  /* Readers waiting for a rank of a failed job would wait in vain. */
  pin_wake(j);
}

int job_failed(job *j, unsigned generation, char *reason, size_t reason_bytes) {
  pthread_mutex_lock(&j->mutex);
  int failed = j->failed_generation == (long)generation;
  if (failed && reason != NULL)
    snprintf(reason, reason_bytes, "%s", j->fail_reason);
  pthread_mutex_unlock(&j->mutex);
  return failed;
}

unit_layout *job_publish_unit(job *j, unit_layout *layout, int *existed, int *conflict) {
  *existed = 0;
  *conflict = 0;
  unit_layout *result = NULL;
  pthread_mutex_lock(&j->mutex);
  for (uint32_t u = 0; u < j->nunits; u++) {
    unit_layout *have = j->units[u];
    if (strcmp(have->name, layout->name) != 0)
      continue;
    /* The init tag (chunk 0) may differ on a re-registration: the state is
     * kept, so how it was first initialised no longer matters. Compare the
     * tensor chunks only. */
    int same = have->ntensors == layout->ntensors && have->numel == layout->numel;
    for (unsigned t = 0; same && t < have->ntensors; t++) {
      const tensor_layout *a = &have->tensors[t], *b = &layout->tensors[t];
      same = strcmp(a->name, b->name) == 0 && a->ndim == b->ndim && a->frozen == b->frozen &&
             memcmp(a->shape, b->shape, sizeof a->shape[0] * a->ndim) == 0;
    }
    if (same) {
      *existed = 1;
      result = have;
    } else {
      *conflict = 1;
    }
    pthread_mutex_unlock(&j->mutex);
    if (result != NULL)
      unit_layout_free(layout);
    return result;
  }
  if (j->nunits == j->units_cap) {
    uint32_t cap = j->units_cap ? j->units_cap * 2 : 16;
    unit_layout **grown = cap <= JOB_MAX_UNITS ? realloc(j->units, cap * sizeof *grown) : NULL;
    if (grown == NULL) {
      pthread_mutex_unlock(&j->mutex);
      return NULL;
    }
    j->units = grown;
    j->units_cap = cap;
  }
  layout->id = j->nunits;
  j->units[j->nunits++] = layout;
  pthread_mutex_unlock(&j->mutex);
  return layout;
}

unit_layout *job_unit(job *j, uint32_t unit_id) {
  pthread_mutex_lock(&j->mutex);
  unit_layout *l = unit_id < j->nunits ? j->units[unit_id] : NULL;
  pthread_mutex_unlock(&j->mutex);
  return l;
}
