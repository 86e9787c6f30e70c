/* tier: a rank's optimizer state on disk (offload_optimizer nvme,
 * ZeRO-Infinity's NVMe tier). On a GPU rank the step that streams it runs
 * on the CPU (offload.h).
 *
 * One file per rank, <nvme root>/<job>-<job id>/rank-<rank>.zdtier, opened
 * with O_DIRECT where the filesystem allows (backend/aio.h). Each unit's
 * shard has an extent in it: its fp32 master weights, then each moment the
 * optimizer keeps, each region padded to 4096 bytes. The file grows as
 * units register (zeros: moments start at zero for free) and is removed
 * with the rank. In memory stay the gradient accumulator and the working
 * copy (its own array, fp32 included), and the staging buffers:
 * buffer_count slots of buffer_size elements per state, through which a
 * step streams every extent chunk by chunk, reading ahead and writing
 * behind (tier_stream). Executor-owned, like the rest of the rank. */
#ifndef ZEROD_TIER_H
#define ZEROD_TIER_H

#include <stddef.h>
#include <stdint.h>

#include "job.h"

/* Whether the job keeps its optimizer state in a tier file. */
int tier_enabled(const job *j);

/* The host memory of a rank's staging buffers for a job of config c:
 * buffer_count × the states on disk × buffer_size fp32 elements. */
uint64_t tier_staging_bytes(const job_config *c);

/* Whether a job of config c can have its ranks on this daemon: its
 * nvme_path inside nvme_dir. Returns 0 or a negative errno with err set. */
int tier_check(const job_config *c, const char *nvme_dir, char *err, size_t err_bytes);

/* Gives a shard just created (arrays of memory-resident state already
 * allocated) its extent in the rank's tier file, opening the file first if
 * needed, under nvme_dir (the daemon's --nvme-dir, canonical; the job's
 * nvme_path must be inside it). Returns 0 or a negative errno with err
 * set. */
int tier_place(rank_state *rs, shard *sh, const unit_layout *l, const char *nvme_dir, char *err,
               size_t err_bytes);

/* Closes the rank's tier file and removes it (and the job's directory
 * once empty). */
void tier_close(rank_state *rs);

/* A whole state (JOB_STATE_*) of a tiered shard: read into dst, or written
 * from src (NULL: zeros). Host memory, shard_numel floats. Returns 0 or a
 * negative errno. */
int tier_read_state(rank_state *rs, const shard *sh, const unit_layout *l, int state, float *dst);
int tier_write_state(rank_state *rs, const shard *sh, const unit_layout *l, int state,
                     const float *src);
/* The same for elements [first, first + count) only (first a multiple of
 * buffer_size), from src holding that stretch. */
int tier_write_state_range(rank_state *rs, const shard *sh, const unit_layout *l, int state,
                           uint64_t first, uint64_t count, const float *src);

/* One chunk of a shard: elements [begin, begin + n) of unit's. */
typedef struct tier_chunk {
  uint32_t unit;
  uint64_t begin, n;
} tier_chunk;

/* The chunks of `chunk` elements (each shard's last one shorter) of the
 * rank's shards whose optimizer state is off the device's arrays (in the
 * tier file, or a GPU rank's host memory): only_unit's, or every one with
 * only_unit < 0, in unit order, which is the order tier_stream visits
 * them in. *out (NULL when there are none) is the caller's to free.
 * Returns 0 or -ENOMEM. */
int tier_chunks(rank_state *rs, uint64_t chunk, int64_t only_unit, tier_chunk **out, size_t *n);

/* Called by tier_stream with the chunk [begin, begin + n) of a shard's
 * states in memory (m1, m2 NULL when the optimizer keeps none); what it
 * changes is written back. Returns 0 or a negative errno (the stream
 * stops). */
typedef int (*tier_chunk_fn)(void *arg, rank_state *rs, shard *sh, const unit_layout *l,
                             uint64_t begin, uint64_t n, float *master, float *m1, float *m2);

/* Streams the tiered shards (only_unit's, or every one with only_unit < 0)
 * through the staging buffers, calling fn on each chunk, reading up to
 * buffer_count - 2 chunks ahead and writing each back behind; write back
 * says whether the chunks changed (a read-only pass writes nothing).
 * Returns 0 or a negative errno. */
int tier_stream(rank_state *rs, int64_t only_unit, int write_back, tier_chunk_fn fn, void *arg);

/* Removes what a daemon that died left in root: <job>-<id>/rank-*.zdtier
 * files and then their directories (no job outlives its daemon). Logs what
 * it removed. */
void tier_sweep(const char *root);

/* A save's copy of the tiered shards units[0..n) (master and moments,
 * unit by unit, as a rank's copy is laid out: bytes in all) without
 * taking their size in memory: the file's regions are copied on disk
 * (copy_file_range: in the kernel, a reflink where the filesystem has
 * them) into a file beside the tier file, which is mapped as a shared
 * buffer (hostmem_shared_map_file) and unlinked. Returns the buffer, or
 * NULL with *err a negative errno. */
void *tier_snapshot(rank_state *rs, unit_layout *const *units, unsigned n, uint64_t bytes,
                    int *err);

/* A file for a restore to stage the values it reads in (ckpt_restore_read's
 * staging_fd), beside the rank's tier file (opened if it was not yet),
 * already unlinked: closing the descriptor and unmapping give its space
 * back. Returns the descriptor or a negative errno. */
int tier_staging_file(rank_state *rs, const char *nvme_dir);

/* Casts a tiered shard's master weights into its working copy. */
int tier_refresh_working(rank_state *rs, const unit_layout *l, shard *sh);

#endif /* ZEROD_TIER_H */
