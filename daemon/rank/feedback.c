/* The compression state a rank keeps for its job's cross-node gradient
 * sums (1-bit Adam's error feedback, onebit.c; low-rank compression's
 * error feedback and warm start, lowrank.c) as checkpoints see it: saved
 * after the unit's states in the rank's shard file and restored into the
 * same layout (ckpt.h, ckpt_feedback), so that a restore in the compressed
 * phase repeats the steps after the save bit for bit. */
#include "exec_impl.h"

#include "ckpt_job.h"

static uint64_t numel_of(const void *arg, const unit_layout *l) {
  return exec__feedback_bytes(arg, l) / sizeof(float);
}

void exec__feedback_view(const rank_state *rs, ckpt_job_view *view) {
  /* Either compresses on a hierarchical communicator only: node_ranks > 0. */
  view->feedback_kind = exec__onebit_nodes(rs) > 0 ? "onebit"
                        : exec__lowrank_on(rs)     ? "powersgd"
                                                   : NULL;
  view->feedback_nodes =
      view->feedback_kind != NULL ? (uint32_t)(rs->job->world_size / comm_node_ranks(rs->comm)) : 0;
  view->feedback_numel = numel_of;
  view->feedback_arg = rs;
}

uint64_t exec__feedback_bytes(const rank_state *rs, const unit_layout *l) {
  return exec__onebit_bytes(rs, l) + exec__lowrank_bytes(rs, l);
}

void exec__feedback_save(const rank_state *rs, const shard *sh, const unit_layout *l, float *out) {
  exec__onebit_save(rs, sh, l, out);
  exec__lowrank_save(rs, sh, l, out);
}

int exec__feedback_restore(rank_state *rs, shard *sh, const unit_layout *l, const float *saved) {
  int rc = exec__onebit_restore(rs, sh, l, saved);
  return rc != 0 ? rc : exec__lowrank_restore(rs, sh, l, saved);
}
