/* 1-bit Adam's side of a reduce (docs/compression.md): after the job's
 * warm-up, a unit's partial sums cross nodes as signs and block scales
 * with error feedback (comm_hier.c, COMM_WIRE_ONEBIT), and this rank keeps
 * that feedback per unit. The frozen second moment is the optimizer's
 * (zk_adam_hparams.v_frozen_at, step.c). */
#include "exec_impl.h"

#include <errno.h>
#include <stdlib.h>

/* Whether this reduce is compressed: a job with onebit_freeze_step whose
 * warm-up is over (the steps completed reached it), on host ranks whose
 * communicator is hierarchical across nodes. The same answer on every rank
 * of the job: it depends on the step count and the job's shape only. */
static int compressed(const rank_state *rs) {
  const uint32_t freeze = rs->job->config.onebit_freeze_step;
  return freeze > 0 && rs->step >= freeze && job_spans_nodes(rs->job) &&
         comm_node_ranks(rs->comm) > 0;
}

int exec__onebit_wire(rank_state *rs, shard *sh, const unit_layout *l, comm_wire *wire) {
  if (!compressed(rs))
    return 0;
  if (sh->onebit_error == NULL) {
    /* One chunk per node: N = world / L, each the shard's length. */
    const uint64_t nodes = (uint64_t)rs->job->world_size / (uint64_t)comm_node_ranks(rs->comm);
    const uint64_t numel = nodes * l->shard_numel;
    sh->onebit_error = calloc(numel, sizeof(float));
    if (sh->onebit_error == NULL)
      return -ENOMEM;
    sh->onebit_numel = numel;
    rs->state_bytes += numel * sizeof(float);
  }
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
