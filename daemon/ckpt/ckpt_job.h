/* ckpt_job: a job's state against checkpoints, from a rank's side: the
 * layout rank 0 writes during a save, and the reading side of a restore
 * (docs/checkpoints.md). The node's orders and reports are in
 * node/ckpt_node.h; the ranks' copies and installs in rank/.
 *
 * Both see the job through a ckpt_job_view: what they need of it, filled in
 * by the rank, so that this module depends on the data model and not on
 * the executor's job object. */
#ifndef ZEROD_CKPT_JOB_H
#define ZEROD_CKPT_JOB_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"
#include "config.h"
#include "layout.h"

/* A job as checkpoints see it. The units are the job's, in id order (a
 * table that only grows: a copy of it taken under the job's mutex). */
typedef struct ckpt_job_view {
  const char *name;
  uint64_t id;
  int world_size;
  const job_config *config;
  /* A base's rank: it keeps its master weights alone (no moments), so its
   * saves hold those and its restores read those. */
  int weights_only;
  /* A job that compresses its cross-node gradient sums keeps state for
   * them on each rank (rank/feedback.c), saved and restored with the
   * shards: its kind ("onebit", "powersgd"; NULL: none), the job's node
   * count, and each unit's floats of it on this rank. */
  const char *feedback_kind;
  uint32_t feedback_nodes;
  uint64_t (*feedback_numel)(const void *arg, const unit_layout *l);
  const void *feedback_arg;
  unit_layout *const *units;
  unsigned nunits;
} ckpt_job_view;

/* What a rank read for a restore, in host memory, waiting for the commit. */
typedef struct ckpt_staged_unit {
  unit_layout *layout; /* the job's, or built from the manifest (owned) */
  int owned;
  float *state[3]; /* shard_numel each, by ckpt_state; NULL: zeros */
  /* The rank's compression state for the unit (malloc'd, the job's
   * feedback_numel of it), or NULL: none read (it starts afresh). */
  float *feedback;
} ckpt_staged_unit;

typedef struct ckpt_staged {
  uint64_t id;
  uint64_t step; /* the job's step after the restore */
  /* The checkpoint held compression state of another world, node count,
   * kind or size (a re-sharding restore): it was left, and the state
   * starts afresh. */
  int feedback_dropped;
  unsigned nunits;
  ckpt_staged_unit *units;
  /* arrays: each state is its own hostmem_array_alloc, which a host
   * rank takes as it is (and frees what it held in its place); otherwise
   * they all lie in mem, one hostmem_alloc. mem_bytes: all of them
   * (mem's size). */
  int arrays;
  int staging_fd; /* not arrays: mem maps this file (not owned), or -1: memory */
  void *mem;
  size_t mem_bytes;
} ckpt_staged;

/* Reads and verifies rank's part (global rank) of source (a checkpoint
 * directory or a safetensors file, by format) for job j, matching it to
 * the job's units (or, for a checkpoint and a job with none, to units built
 * from its manifest); host_arrays: into arrays a host rank can take (see
 * ckpt_staged); otherwise into one buffer, a mapping of staging_fd (a file
 * it sizes, for a job whose state is on disk: the staged values are then
 * page cache, not memory) or, with -1, memory. Returns 0, or a negative
 * errno with a gRPC status in *code and the reason in err. */
int ckpt_restore_read(const ckpt_job_view *j, int rank, const char *source, int format,
                      int host_arrays, int staging_fd, ckpt_staged **out, int *code, char *err,
                      size_t err_bytes);
void ckpt_staged_free(ckpt_staged *s);

/* The layout of job j (a manifest without files), as rank 0 writes it
 * during a save; NULL if out of memory. */
ckpt_manifest *ckpt_layout_of(const ckpt_job_view *j, uint64_t step, uint64_t version);

/* st_units.c: the units of a job with none, made from f's tensors for
 * world_size ranks: one unit per module (a name up to its last '.', or
 * "<root>"), in the order of the modules' names, tensors by name. *out
 * (freed with free, each with unit_layout_free) and *n, or a negative
 * errno with err. */
int st_units_build(const st_file *f, int world_size, unit_layout ***out, unsigned *n, char *err,
                   size_t err_bytes);

#endif /* ZEROD_CKPT_JOB_H */
