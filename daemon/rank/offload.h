/* offload: the optimizer state of a GPU rank kept off the GPU
 * (offload_optimizer cpu or nvme), as DeepSpeed's offload_optimizer keeps
 * it: the gradient accumulator and the working copy stay in the GPU's
 * memory, where the reduces and the gathers need them; the fp32 master
 * weights and the moments are in host memory (the shard's arrays, cpu) or
 * in the rank's tier file (nvme, tier.h), and the step runs the CPU
 * kernels on them.
 *
 * The step goes chunk by chunk (buffer_size elements) through
 * buffer_count staging slots, each a gradient chunk and a working-copy
 * chunk of host memory (page-locked with pin_memory): the gradients of
 * the next chunks come down from the GPU while the CPU updates this one,
 * and this chunk's new working copy goes up while the CPU updates the
 * next. Everything here runs on the rank's executor. On a CPU rank none of
 * this is used: its device memory is host memory already. */
#ifndef ZEROD_OFFLOAD_H
#define ZEROD_OFFLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "job.h"

/* Whether rank rs keeps its optimizer state off its device: a GPU rank
 * of a job with offload_optimizer cpu or nvme. */
int offload_enabled(const rank_state *rs);

/* The CPU update of one chunk [begin, begin + n) of a shard: master, m1,
 * m2 (NULL where the optimizer keeps none), grad and working hold that
 * chunk, in host memory; the kernels run on host. Returns 0 or a negative
 * errno. */
typedef int (*offload_update_fn)(void *arg, rank_state *rs, device *host, shard *sh, uint64_t begin,
                                 uint64_t n, float *master, float *m1, float *m2, const float *grad,
                                 void *working);

/* The step of every offloaded shard: fn on each chunk, the gradients
 * brought down and the working copies sent up around it. Returns when the
 * last upload has landed. 0 or a negative errno (the device's text in
 * device_last_error, or the host's). */
int offload_step(rank_state *rs, offload_update_fn fn, void *arg);

/* Casts an offloaded shard's master weights into its working copy on the
 * GPU (registration, a load, a restore). */
int offload_refresh_working(rank_state *rs, const unit_layout *l, shard *sh);

/* A whole state of a shard in the tier file from src in the GPU's memory
 * (the rank's scratch), through the staging slots. */
int offload_state_copy(rank_state *rs, shard *sh, const unit_layout *l, uint32_t state,
                       const float *src);

/* Bytes of host memory the master and the moments of l's shard take on a
 * rank with the state in host memory (offload cpu), and the staging slots
 * of the job (per rank, any placement off the device). */
uint64_t offload_host_state_bytes(const rank_state *rs, const unit_layout *l);
uint64_t offload_staging_bytes(const job_config *c);

/* Frees the staging slots and the host device (the rank stops). */
void offload_close(rank_state *rs);

#endif /* ZEROD_OFFLOAD_H */
