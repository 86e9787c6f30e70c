/* Shards: a rank's state for each unit (master weights, moments, gradient
 * accumulator, working copy) in its device's memory, the ranges of it the
 * optimizer updates and those a reduce zeroes, and the rank's scratch. */
#include "exec_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hostmem.h"
#include "log.h"
#include "offload.h"
#include "tier.h"

/* Zero-filled memory of the rank's device, or NULL. */
static void *zalloc(rank_state *rs, uint64_t bytes) {
  void *p = NULL;
  return device_alloc(rs->dev, bytes, &p) == 0 ? p : NULL;
}

int exec__rank_states(const rank_state *rs, int has[JOB_NSTATES]) {
  int n = job_config_states(&rs->job->config, has);
  if (rs->weights_only) {
    n -= has[JOB_STATE_MOMENT1] + has[JOB_STATE_MOMENT2];
    has[JOB_STATE_MOMENT1] = has[JOB_STATE_MOMENT2] = 0;
  }
  return n;
}

uint64_t exec__shard_bytes(const rank_state *rs, const unit_layout *l) {
  const job_config *c = &rs->job->config;
  int has[JOB_NSTATES];
  exec__rank_states(rs, has);
  /* In the device's memory: the accumulator and the working copy (its own
   * array) where the rest is on disk, or off a GPU. */
  if (tier_enabled(rs->job) || offload_enabled(rs))
    return l->shard_numel * (4 + zk_dtype_size(c->working_dtype));
  uint64_t per_element = rs->weights_only ? 4 : 4 + 4; /* master, gradient accumulator */
  per_element += has[JOB_STATE_MOMENT1] ? 4 : 0;
  per_element += has[JOB_STATE_MOMENT2] ? 4 : 0;
  per_element += c->working_dtype == ZK_F32 ? 0 : zk_dtype_size(c->working_dtype);
  return l->shard_numel * per_element;
}

uint64_t exec__replica_bytes(const rank_state *rs, const unit_layout *l) {
  if (atomic_load(&rs->job->redundancy_every) == 0)
    return 0;
  int has[JOB_NSTATES];
  unsigned nstates = (unsigned)exec__rank_states(rs, has);
  /* Its own copy, and as much of its peer's held on its node. */
  return 2 * l->shard_numel * 4 * (uint64_t)nstates;
}

uint64_t exec__replica_bytes_in_use(rank_state *rs) {
  uint32_t n = 0;
  unit_layout **units = job_units_copy(rs->job, &n);
  uint64_t bytes = 0;
  for (uint32_t u = 0; units != NULL && u < n && u < rs->nshards; u++)
    if (shard_has_state(&rs->shards[u]))
      bytes += exec__replica_bytes(rs, units[u]);
  free(units);
  return bytes;
}

void exec__shard_free(rank_state *rs, shard *sh) {
  if (sh->from_base) { /* the base's memory: nothing of its own */
    memset(sh, 0, sizeof *sh);
    sh->gather_buf = sh->grad_buf = sh->secondary_buf = -1;
    return;
  }
  if (sh->present && rs->state_bytes >= sh->bytes)
    rs->state_bytes -= sh->bytes;
  if (sh->present && rs->host_state_bytes >= sh->host_bytes)
    rs->host_state_bytes -= sh->host_bytes;
  if (sh->working != (void *)sh->master)
    device_free(rs->dev, sh->working);
  if (sh->host_state) {
    hostmem_array_free(sh->master);
    hostmem_array_free(sh->moment1);
    hostmem_array_free(sh->moment2);
  } else {
    device_free(rs->dev, sh->master);
    device_free(rs->dev, sh->moment1);
    device_free(rs->dev, sh->moment2);
  }
  device_free(rs->dev, sh->grad_acc);
  exec__onebit_free(rs, sh);
  exec__lowrank_free(rs, sh);
  free(sh->trainable);
  free(sh->zero_ranges);
  memset(sh, 0, sizeof *sh);
  sh->gather_buf = -1;
  sh->grad_buf = -1;
  sh->secondary_buf = -1;
}

static int ranges_push(shard_range **ranges, unsigned *n, uint64_t begin, uint64_t end,
                       uint32_t group) {
  if (begin >= end)
    return 0;
  if (*n > 0 && (*ranges)[*n - 1].end == begin && (*ranges)[*n - 1].group == group) {
    (*ranges)[*n - 1].end = end;
    return 0;
  }
  shard_range *grown = realloc(*ranges, (*n + 1) * sizeof *grown);
  if (grown == NULL)
    return -ENOMEM;
  grown[*n].begin = begin;
  grown[*n].end = end;
  grown[*n].group = group;
  *ranges = grown;
  (*n)++;
  return 0;
}

int exec__shards_reserve(rank_state *rs, uint32_t unit_id) {
  if (unit_id < rs->nshards)
    return 0;
  uint32_t cap = rs->nshards ? rs->nshards : 16;
  while (cap <= unit_id)
    cap *= 2;
  shard *grown = realloc(rs->shards, cap * sizeof *grown);
  if (grown == NULL)
    return -ENOMEM;
  for (uint32_t i = rs->nshards; i < cap; i++) {
    memset(&grown[i], 0, sizeof grown[i]);
    grown[i].gather_buf = -1;
    grown[i].grad_buf = -1;
    grown[i].secondary_buf = -1;
  }
  rs->shards = grown;
  rs->nshards = cap;
  return 0;
}

int exec__shard_create(rank_state *rs, const unit_layout *l) {
  if (exec__shards_reserve(rs, l->id) != 0)
    return -ENOMEM;
  shard *sh = &rs->shards[l->id];
  const job_config *c = &rs->job->config;
  uint64_t n = l->shard_numel;
  int has[JOB_NSTATES];
  exec__rank_states(rs, has);
  int err = 0;
  if (tier_enabled(rs->job)) {
    /* Master and moments go to the tier file; the working copy is an
     * array of its own, fp32 included. */
    sh->grad_acc = zalloc(rs, n * 4);
    sh->working = zalloc(rs, n * zk_dtype_size(c->working_dtype));
    rs->tier_error[0] = '\0';
    if (sh->grad_acc == NULL || sh->working == NULL)
      err = -ENOMEM;
    else if ((err = tier_place(rs, sh, l, rs->job->exec->nvme_dir, rs->tier_error,
                               sizeof rs->tier_error)) != 0)
      LOG_ERRORF("no room for a shard's optimizer state on disk",
                 "job=%s rank=%d unit=%s err=\"%s\"", rs->job->name, rs->rank, l->name,
                 rs->tier_error);
  } else if (offload_enabled(rs)) {
    /* offload_optimizer cpu on a GPU rank: master and moments in host
     * memory; the accumulator and the working copy on the GPU. */
    sh->host_state = 1;
    sh->master = hostmem_array_zalloc(n * 4);
    sh->moment1 = has[JOB_STATE_MOMENT1] ? hostmem_array_zalloc(n * 4) : NULL;
    sh->moment2 = has[JOB_STATE_MOMENT2] ? hostmem_array_zalloc(n * 4) : NULL;
    sh->grad_acc = zalloc(rs, n * 4);
    sh->working = zalloc(rs, n * zk_dtype_size(c->working_dtype));
    if (sh->master == NULL || sh->grad_acc == NULL ||
        (has[JOB_STATE_MOMENT1] && sh->moment1 == NULL) ||
        (has[JOB_STATE_MOMENT2] && sh->moment2 == NULL) || sh->working == NULL)
      err = -ENOMEM;
  } else {
    sh->master = zalloc(rs, n * 4);
    sh->grad_acc = rs->weights_only ? NULL : zalloc(rs, n * 4);
    sh->moment1 = has[JOB_STATE_MOMENT1] ? zalloc(rs, n * 4) : NULL;
    sh->moment2 = has[JOB_STATE_MOMENT2] ? zalloc(rs, n * 4) : NULL;
    sh->working = c->working_dtype == ZK_F32 ? (void *)sh->master
                                             : zalloc(rs, n * zk_dtype_size(c->working_dtype));
    if (sh->master == NULL || (sh->grad_acc == NULL && !rs->weights_only) ||
        (has[JOB_STATE_MOMENT1] && sh->moment1 == NULL) ||
        (has[JOB_STATE_MOMENT2] && sh->moment2 == NULL) || sh->working == NULL)
      err = -ENOMEM;
  }
  /* The ranges of the whole flat buffer that hold no trainable tensor
   * (gaps, padding, frozen tensors): gradients there are zeroed before a
   * reduce. */
  uint64_t cursor = 0;
  for (unsigned t = 0; t < l->ntensors && err == 0; t++) {
    const tensor_layout *tl = &l->tensors[t];
    err = ranges_push(&sh->zero_ranges, &sh->nzero_ranges, cursor, tl->offset, 0);
    if (tl->frozen && err == 0)
      err = ranges_push(&sh->zero_ranges, &sh->nzero_ranges, tl->offset, tl->offset + tl->numel, 0);
    cursor = tl->offset + tl->numel;
  }
  if (err == 0)
    err = ranges_push(&sh->zero_ranges, &sh->nzero_ranges, cursor, l->padded_numel, 0);
  if (err == 0)
    err = exec__shard_set_groups(rs, l, sh, NULL);
  if (err == 0)
    err = exec__onebit_make(rs, sh, l);
  if (err == 0)
    err = exec__lowrank_make(rs, sh, l);
  if (err != 0) {
    exec__shard_free(rs, sh);
    return err;
  }
  sh->present = 1;
  sh->gather_buf = -1;
  sh->grad_buf = -1;
  sh->secondary_buf = -1;
  sh->bytes = exec__shard_bytes(rs, l);
  rs->state_bytes += sh->bytes;
  sh->host_bytes = sh->host_state ? offload_host_state_bytes(rs, l) : 0;
  rs->host_state_bytes += sh->host_bytes;
  return 0;
}

int exec__grow_scratch(rank_state *rs, uint64_t numel, uint64_t shard_numel) {
  if (numel > rs->scratch_numel) {
    device_free(rs->dev, rs->scratch);
    rs->scratch = zalloc(rs, numel * 4);
    rs->scratch_numel = rs->scratch != NULL ? numel : 0;
    if (rs->scratch == NULL)
      return -ENOMEM;
  }
  if (shard_numel > rs->shard_scratch_numel) {
    device_free(rs->dev, rs->shard_scratch);
    rs->shard_scratch = zalloc(rs, shard_numel * 4);
    rs->shard_scratch_numel = rs->shard_scratch != NULL ? shard_numel : 0;
    if (rs->shard_scratch == NULL)
      return -ENOMEM;
  }
  return 0;
}

/* Casts the master shard into the working copy (bf16 working precision). */
int exec__refresh_working(rank_state *rs, const unit_layout *l, shard *sh) {
  if (offload_enabled(rs))
    return offload_refresh_working(rs, l, sh);
  if (sh->tiered)
    return tier_refresh_working(rs, l, sh);
  if (sh->working == (void *)sh->master)
    return 0;
  return device_cast(rs->dev, sh->working, rs->job->config.working_dtype, sh->master, ZK_F32,
                     l->shard_numel);
}

shard *exec__find_shard(rank_state *rs, uint32_t unit_id, unit_layout **out, char *why,
                        size_t why_bytes) {
  unit_layout *l = job_unit(rs->job, unit_id);
  if (l == NULL || unit_id >= rs->nshards || !rs->shards[unit_id].present) {
    snprintf(why, why_bytes, "unknown unit id %u (register it first)", unit_id);
    return NULL;
  }
  *out = l;
  return &rs->shards[unit_id];
}

shard *exec__lookup_shard(rank_state *rs, exec_op *op, uint32_t unit_id, unit_layout **out) {
  char why[96];
  shard *sh = exec__find_shard(rs, unit_id, out, why, sizeof why);
  if (sh == NULL)
    exec_error(op, ZEROD__V1__STATUS__STATUS_NOT_FOUND, "%s", why);
  return sh;
}

int exec__shard_set_groups(rank_state *rs, const unit_layout *l, shard *sh,
                           const uint32_t *tensor_group) {
  shard_range *ranges = NULL;
  unsigned n = 0;
  uint64_t lo = (uint64_t)rs->rank * l->shard_numel, hi = lo + l->shard_numel;
  for (unsigned t = 0; t < l->ntensors; t++) {
    const tensor_layout *tl = &l->tensors[t];
    if (tl->frozen)
      continue;
    uint64_t b = tl->offset > lo ? tl->offset : lo;
    uint64_t e = tl->offset + tl->numel < hi ? tl->offset + tl->numel : hi;
    if (b < e && ranges_push(&ranges, &n, b - lo, e - lo, tensor_group ? tensor_group[t] : 0)) {
      free(ranges);
      return -ENOMEM;
    }
  }
  free(sh->trainable);
  sh->trainable = ranges;
  sh->ntrainable = n;
  return 0;
}

int exec__has_state(const rank_state *rs, uint32_t state) {
  int has[JOB_NSTATES];
  exec__rank_states(rs, has);
  return state < JOB_NSTATES && has[state];
}

int exec__state_get(rank_state *rs, shard *sh, const unit_layout *l, uint32_t state, float *dst) {
  if (!exec__has_state(rs, state))
    return -EINVAL;
  if (sh->tiered)
    return tier_read_state(rs, sh, l, (int)state, dst);
  if (sh->host_state) {
    memcpy(dst, exec__shard_state(rs, sh, state), l->shard_numel * sizeof(float));
    return 0;
  }
  return device_download(rs->dev, dst, exec__shard_state(rs, sh, state),
                         l->shard_numel * sizeof(float));
}

int exec__state_put(rank_state *rs, shard *sh, const unit_layout *l, uint32_t state,
                    const float *src) {
  if (!exec__has_state(rs, state))
    return -EINVAL;
  if (sh->tiered)
    return tier_write_state(rs, sh, l, (int)state, src);
  float *dst = exec__shard_state(rs, sh, state);
  size_t bytes = l->shard_numel * sizeof(float);
  if (sh->host_state) {
    if (src == NULL)
      memset(dst, 0, bytes);
    else
      memcpy(dst, src, bytes);
    return 0;
  }
  return src == NULL ? device_zero(rs->dev, dst, bytes) : device_upload(rs->dev, dst, src, bytes);
}

int exec__state_copy(rank_state *rs, shard *sh, const unit_layout *l, uint32_t state,
                     const float *src) {
  if (!exec__has_state(rs, state))
    return -EINVAL;
  float *dst = exec__shard_state(rs, sh, state);
  size_t bytes = l->shard_numel * sizeof(float);
  if (sh->host_state) /* a GPU rank's state in host memory */
    return device_download(rs->dev, dst, src, bytes);
  if (sh->tiered && !device_is_host(rs->dev)) /* down through the staging slots */
    return offload_state_copy(rs, sh, l, state, src);
  if (sh->tiered) /* a host rank: its device's memory is host memory */
    return tier_write_state(rs, sh, l, (int)state, src);
  return device_copy(rs->dev, dst, src, bytes);
}

float *exec__shard_state(rank_state *rs, shard *sh, uint32_t state) {
  int has[JOB_NSTATES];
  exec__rank_states(rs, has);
  if (state >= JOB_NSTATES || !has[state])
    return NULL;
  return state == JOB_STATE_MASTER    ? sh->master
         : state == JOB_STATE_MOMENT1 ? sh->moment1
                                      : sh->moment2;
}

const char *exec__state_name(const rank_state *rs, uint32_t state) {
  int sgd = rs->job->config.optimizer == JOB_SGD;
  switch (state) {
  case JOB_STATE_MASTER:
    return "weights";
  case JOB_STATE_MOMENT1:
    return sgd ? "momentum_buffer" : "exp_avg";
  case JOB_STATE_MOMENT2:
    return "exp_avg_sq";
  default:
    return "unknown state";
  }
}

void exec__handle_freeze(rank_state *rs) {
  if (rs->weights_only)
    return;
  if (tier_enabled(rs->job) || offload_enabled(rs)) {
    /* Its state is on disk or a GPU rank's host arrays: kept as it is. */
    LOG_DEBUGF("a base's optimizer state stays where it is offloaded", "job=%s rank=%d",
               rs->job->name, rs->rank);
    return;
  }
  uint64_t before = rs->state_bytes;
  rs->weights_only = 1;
  for (uint32_t u = 0; u < rs->nshards; u++) {
    shard *sh = &rs->shards[u];
    if (!shard_has_state(sh))
      continue;
    device_free(rs->dev, sh->moment1);
    device_free(rs->dev, sh->moment2);
    device_free(rs->dev, sh->grad_acc);
    sh->moment1 = sh->moment2 = sh->grad_acc = NULL;
    uint64_t bytes = exec__shard_bytes(rs, job_unit(rs->job, u));
    rs->state_bytes -= sh->bytes - bytes;
    sh->bytes = bytes;
  }
  rank_metrics_state(rs);
  LOG_INFOF("a base keeps its weights only: moments and gradient accumulators freed",
            "job=%s rank=%d freed_bytes=%" PRIu64, rs->job->name, rs->rank,
            before - rs->state_bytes);
}
