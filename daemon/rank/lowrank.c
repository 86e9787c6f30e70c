/* Low-rank (PowerSGD) compression's side of a reduce (docs/compression.md):
 * a job with powersgd_rank sends each node's partial sums for another
 * node's slice as two rank-r factors (comm_hier.c, COMM_WIRE_LOWRANK), and
 * this rank keeps, per unit, what that needs from one reduce to the next:
 * the error feedback of its partial sums (one chunk of the shard per node)
 * and the warm start, its last right factor Q per node. Both are made with
 * the unit's shard and counted in state_bytes and the job's quota. */
#include "exec_impl.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Whether the job's reduces are compressed: powersgd_rank on host ranks
 * whose communicator is hierarchical across nodes. The same answer on
 * every rank of the job. */
static int compresses(const rank_state *rs) {
  return rs->job->config.powersgd_rank > 0 && job_spans_nodes(rs->job) &&
         comm_node_ranks(rs->comm) > 0;
}

static uint64_t nodes(const rank_state *rs) {
  return (uint64_t)rs->job->world_size / (uint64_t)comm_node_ranks(rs->comm);
}

/* The matrix a slice of the unit is read as: cols is the last dimension of
 * the unit's largest tensor of two or more dimensions (a weight's input
 * features: a slice then holds whole rows of it, shifted), else about the
 * square root of the slice; rows as many as the slice fills. Whether it
 * pays: the factors at most half the slice, else the unit stays exact. */
static int shape(const rank_state *rs, const unit_layout *l, uint64_t *rows, uint64_t *cols) {
  const uint64_t s = l->shard_numel, r = rs->job->config.powersgd_rank;
  uint64_t c = 0, largest = 0;
  for (unsigned t = 0; t < l->ntensors; t++) {
    const tensor_layout *tl = &l->tensors[t];
    if (tl->ndim >= 2 && tl->numel > largest) {
      largest = tl->numel;
      c = tl->shape[tl->ndim - 1];
    }
  }
  if (c == 0)
    c = (uint64_t)ceil(sqrt((double)s));
  c = c < s ? c : s;
  *cols = c;
  *rows = c > 0 ? (s + c - 1) / c : 0;
  return c > 0 && 2 * r * (*rows + c) <= s;
}

/* The unit's state: the error feedback (nodes x shard), then the warm
 * start (nodes x cols x rank). 0 for a unit that stays exact. */
static uint64_t state_numel(const rank_state *rs, const unit_layout *l) {
  uint64_t rows, cols;
  if (!compresses(rs) || !shape(rs, l, &rows, &cols))
    return 0;
  return nodes(rs) * (l->shard_numel + cols * rs->job->config.powersgd_rank);
}

uint64_t exec__lowrank_bytes(const rank_state *rs, const unit_layout *l) {
  return state_numel(rs, l) * sizeof(float);
}

/* The first right factors: values in [-1, 1) from a counter hash of (node,
 * element), the same on every rank and run, so the first reduce is as
 * deterministic as the ones that follow. */
static void warm_start_init(float *q, uint64_t n, uint64_t numel) {
  for (uint64_t i = 0; i < numel; i++) {
    uint64_t z = (n << 40) + i + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    q[i] = (float)((double)(z >> 40) / (double)(1ull << 23) - 1.0);
  }
}

/* The state as a unit starts: no error, the first factors. */
static void reset(const rank_state *rs, const unit_layout *l, float *state) {
  const uint64_t N = nodes(rs), s = l->shard_numel;
  const uint64_t per_node = (state_numel(rs, l) - N * s) / N;
  memset(state, 0, N * s * sizeof(float));
  for (uint64_t n = 0; n < N; n++)
    warm_start_init(state + N * s + n * per_node, n, per_node);
}

int exec__lowrank_make(rank_state *rs, shard *sh, const unit_layout *l) {
  const uint64_t numel = state_numel(rs, l);
  if (numel == 0 || sh->lowrank_state != NULL)
    return 0;
  sh->lowrank_state = malloc(numel * sizeof(float));
  if (sh->lowrank_state == NULL)
    return -ENOMEM;
  reset(rs, l, sh->lowrank_state);
  sh->lowrank_numel = numel;
  rs->state_bytes += numel * sizeof(float);
  return 0;
}

int exec__lowrank_wire(rank_state *rs, shard *sh, const unit_layout *l, comm_wire *wire) {
  uint64_t rows, cols;
  /* Exact until the steps completed reach the start: the same on every
   * rank. */
  if (!compresses(rs) || rs->step < rs->job->config.powersgd_start_step ||
      !shape(rs, l, &rows, &cols))
    return 0;
  int rc = exec__lowrank_make(rs, sh, l); /* made with the shard; again after a failure */
  if (rc != 0)
    return rc;
  wire->format = COMM_WIRE_LOWRANK;
  wire->rank = rs->job->config.powersgd_rank;
  wire->rows = rows;
  wire->cols = cols;
  wire->error = sh->lowrank_state;
  wire->q = sh->lowrank_state + nodes(rs) * l->shard_numel;
  return 0;
}

int exec__lowrank_on(const rank_state *rs) {
  return compresses(rs);
}

void exec__lowrank_save(const rank_state *rs, const shard *sh, const unit_layout *l, float *out) {
  const uint64_t numel = state_numel(rs, l);
  if (numel == 0)
    return;
  if (sh->lowrank_state != NULL && sh->lowrank_numel == numel)
    memcpy(out, sh->lowrank_state, numel * sizeof(float));
  else
    reset(rs, l, out); /* none made: what it would start from */
}

int exec__lowrank_restore(rank_state *rs, shard *sh, const unit_layout *l, const float *saved) {
  int rc = exec__lowrank_make(rs, sh, l);
  if (rc != 0 || sh->lowrank_state == NULL)
    return rc;
  if (saved != NULL)
    memcpy(sh->lowrank_state, saved, sh->lowrank_numel * sizeof(float));
  else
    reset(rs, l, sh->lowrank_state);
  return 0;
}

void exec__lowrank_free(rank_state *rs, shard *sh) {
  if (sh->lowrank_state == NULL)
    return;
  const uint64_t bytes = sh->lowrank_numel * sizeof(float);
  rs->state_bytes = rs->state_bytes >= bytes ? rs->state_bytes - bytes : 0;
  free(sh->lowrank_state);
  sh->lowrank_state = NULL;
  sh->lowrank_numel = 0;
}
