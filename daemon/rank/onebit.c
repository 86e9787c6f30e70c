/* 1-bit Adam's side of a reduce (docs/compression.md): after the job's
 * warm-up, a unit's partial sums cross nodes as signs and block scales
 * with error feedback (comm_hier.c, COMM_WIRE_ONEBIT), and this rank keeps
 * that feedback per unit, made with the unit's shard (so that the job's
 * memory quota counts it from the registration on). The frozen second
 * moment is the optimizer's (zk_adam_hparams.v_frozen_at, step.c). */
#include "exec_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* Whether the job's reduces are compressed once its warm-up is over: a job
 * with onebit_freeze_step on host ranks whose communicator is hierarchical
 * across nodes. The same answer on every rank of the job. */
static int compresses(const rank_state *rs) {
  return rs->job->config.onebit_freeze_step > 0 && job_spans_nodes(rs->job) &&
         comm_node_ranks(rs->comm) > 0;
}

uint32_t exec__onebit_nodes(const rank_state *rs) {
  return compresses(rs) ? (uint32_t)(rs->job->world_size / comm_node_ranks(rs->comm)) : 0;
}

/* The unit's error feedback: one chunk per node, N = world / L, each the
 * shard's length. */
static uint64_t error_numel(const rank_state *rs, const unit_layout *l) {
  return (uint64_t)exec__onebit_nodes(rs) * l->shard_numel;
}

/* The feedback of a save: the unit's, or zeros where none was made. */
void exec__onebit_save(const rank_state *rs, const shard *sh, const unit_layout *l, float *out) {
  if (!compresses(rs))
    return;
  uint64_t numel = error_numel(rs, l);
  if (sh->onebit_error != NULL && sh->onebit_numel == numel)
    memcpy(out, sh->onebit_error, numel * sizeof(float));
  else
    memset(out, 0, numel * sizeof(float));
}

int exec__onebit_restore(rank_state *rs, shard *sh, const unit_layout *l, const float *saved) {
  if (!compresses(rs))
    return 0;
  int rc = exec__onebit_make(rs, sh, l);
  if (rc != 0)
    return rc;
  if (saved != NULL)
    memcpy(sh->onebit_error, saved, sh->onebit_numel * sizeof(float));
  else
    memset(sh->onebit_error, 0, sh->onebit_numel * sizeof(float));
  return 0;
}

uint64_t exec__onebit_bytes(const rank_state *rs, const unit_layout *l) {
  return compresses(rs) ? error_numel(rs, l) * sizeof(float) : 0;
}

int exec__onebit_make(rank_state *rs, shard *sh, const unit_layout *l) {
  if (!compresses(rs) || sh->onebit_error != NULL)
    return 0;
  const uint64_t numel = error_numel(rs, l);
  sh->onebit_error = calloc(numel, sizeof(float));
  if (sh->onebit_error == NULL)
    return -ENOMEM;
  sh->onebit_numel = numel;
  rs->state_bytes += numel * sizeof(float);
  return 0;
}

int exec__onebit_wire(rank_state *rs, shard *sh, const unit_layout *l, comm_wire *wire) {
  /* The warm-up is over once the steps completed reach the freeze step: a
   * function of the step count, the same on every rank. */
  if (!compresses(rs) || rs->step < rs->job->config.onebit_freeze_step)
    return 0;
  int rc = exec__onebit_make(rs, sh, l); /* made with the shard; again after a failure */
  if (rc != 0)
    return rc;
  wire->format = COMM_WIRE_ONEBIT;
  wire->error = sh->onebit_error;
  return 0;
}

void exec__onebit_free(rank_state *rs, shard *sh) {
  if (sh->onebit_error == NULL)
    return;
  const uint64_t bytes = sh->onebit_numel * sizeof(float);
  rs->state_bytes = rs->state_bytes >= bytes ? rs->state_bytes - bytes : 0;
  free(sh->onebit_error);
  sh->onebit_error = NULL;
  sh->onebit_numel = 0;
}
