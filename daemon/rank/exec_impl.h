/* exec_impl: what the files of the executor share (the files of rank/), and nothing
 * else includes. Every function here runs on the rank's executor thread
 * (or on the loop while the executor is idle: exec_try_inline), takes the
 * rank it works for, and is named exec__ (internal, like libuv's uv__).
 * exec.c runs the queue and calls the handlers; each handler answers its
 * op through exec_reply or exec_error (reply.c). */
#ifndef ZEROD_EXEC_IMPL_H
#define ZEROD_EXEC_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "agree.h"
#include "comm.h"
#include "exec.h"
#include "job.h"
#include "rank_metrics.h"

/* The node's side of checkpoints, through the job's settings (exec.h). */
static inline const exec_ckpt_hooks *exec__ckpt(const rank_state *rs) {
  return &rs->job->exec->ckpt;
}

/* ---- reply.c: replies and failures ------------------------------------------- */

/* Checks the job's failure state; answers ABORTED and returns 1 if failed. */
int exec__op_job_failed(rank_state *rs, exec_op *op);

/* Passes a device call's result through, noting a failure so that the
 * collective it belongs to reports the device's error (op_comm_failed). */
int exec__dev_call(rank_state *rs, int rc);

/* The rank's device failed (a GPU error is usually sticky, and the ranks'
 * states would drift apart): the job fails, and the op is answered. */
void exec__op_device_failed(rank_state *rs, exec_op *op, const char *what, int err);

/* A collective failed: the job is failed for every rank (the communicator is
 * broken), and this op is answered with the reason. */
void exec__op_comm_failed(rank_state *rs, exec_op *op, const char *what, int err);

/* ---- shard.c: shards and scratch --------------------------------------------- */

/* Frees a shard's arrays (its working copy too, unless it is the master). */
void exec__shard_free(rank_state *rs, shard *sh);
/* The state a rank keeps for its job's compressed cross-node gradient
 * sums, per unit: 1-bit Adam's error feedback (onebit.c) and low-rank
 * compression's error feedback and warm start (lowrank.c). Each module has
 * the same life cycle: its bytes for a unit on this rank (0 for a job that
 * does not compress, or a low-rank unit too small to pay); made with the
 * shard (counted in state_bytes); set into *wire for a reduce once past
 * the job's exact steps; copied for a save (what it starts from where none
 * was made); restored (saved, or its start for NULL: the values it
 * belonged to are gone); freed. 0, or -ENOMEM. */
uint32_t exec__onebit_nodes(const rank_state *rs); /* 0: the job does not use 1-bit Adam */
uint64_t exec__onebit_bytes(const rank_state *rs, const unit_layout *l);
int exec__onebit_make(rank_state *rs, shard *sh, const unit_layout *l);
int exec__onebit_wire(rank_state *rs, shard *sh, const unit_layout *l, comm_wire *wire);
void exec__onebit_save(const rank_state *rs, const shard *sh, const unit_layout *l, float *out);
int exec__onebit_restore(rank_state *rs, shard *sh, const unit_layout *l, const float *saved);
void exec__onebit_free(rank_state *rs, shard *sh);
int exec__lowrank_on(const rank_state *rs); /* whether the job uses low-rank compression */
uint64_t exec__lowrank_bytes(const rank_state *rs, const unit_layout *l);
int exec__lowrank_make(rank_state *rs, shard *sh, const unit_layout *l);
int exec__lowrank_wire(rank_state *rs, shard *sh, const unit_layout *l, comm_wire *wire);
void exec__lowrank_save(const rank_state *rs, const shard *sh, const unit_layout *l, float *out);
int exec__lowrank_restore(rank_state *rs, shard *sh, const unit_layout *l, const float *saved);
void exec__lowrank_free(rank_state *rs, shard *sh);
/* Either, as quotas and checkpoints see it (feedback.c): the job's kind of
 * state into a view (ckpt_job.h), and a unit's bytes, save and restore. */
struct ckpt_job_view;
void exec__feedback_view(const rank_state *rs, struct ckpt_job_view *view);
uint64_t exec__feedback_bytes(const rank_state *rs, const unit_layout *l);
void exec__feedback_save(const rank_state *rs, const shard *sh, const unit_layout *l, float *out);
int exec__feedback_restore(rank_state *rs, shard *sh, const unit_layout *l, const float *saved);

/* Creates the rank's shard of unit l (zeroed; the table grows as needed),
 * with its trainable and zeroed ranges. 0 or -ENOMEM. */
int exec__shard_create(rank_state *rs, const unit_layout *l);
/* Grows the rank's shard table to hold unit_id. 0 or -ENOMEM. */
int exec__shards_reserve(rank_state *rs, uint32_t unit_id);

/* Units of the job's base (base_units.c). The registration's checks
 * against the base's unit of its name, tensors matched by name (1:
 * refused, op answered; else *base_unit is its id in the base, and
 * *reorder says the base has them in another order); the registration's
 * layout rebuilt in the base's order (0, or a negative errno with err);
 * this rank's shard of it (the base rank's working slice; 1: refused); a
 * gather through the node's base cache into sh->gather_buf (collective; 0
 * or a negative errno); and the refusal of what would write one (1: op
 * answered). */
int exec__base_unit_refused(rank_state *rs, exec_op *op, const unit_layout *mine,
                            uint32_t *base_unit, int *reorder);
int exec__base_order(rank_state *rs, uint32_t base_unit, uint64_t init_tag, unit_layout **mine,
                     char *err, size_t err_bytes);
int exec__install_base_shard(rank_state *rs, exec_op *op, unit_layout *l, uint32_t base_unit);
int exec__gather_from_base(rank_state *rs, const unit_layout *l, shard *sh);
int exec__refuse_base_unit(exec_op *op, const shard *sh, const unit_layout *l, const char *what);
/* Bytes of device (or host) memory the shard of l takes on rs: master,
 * gradient accumulator, the optimizer's moments, a bf16 working copy. */
uint64_t exec__shard_bytes(const rank_state *rs, const unit_layout *l);

/* Recomputes the shard's trainable ranges with each tensor's parameter
 * group (tensor_group[t], one per tensor of l; NULL: all in group 0), so
 * that no range spans two groups. 0 or -ENOMEM (the ranges unchanged). */
int exec__shard_set_groups(rank_state *rs, const unit_layout *l, shard *sh,
                           const uint32_t *tensor_group);

/* The shard's fp32 array of a state (JOB_STATE_MASTER, _MOMENT1,
 * _MOMENT2: UnitState's numbers), or NULL where the job's optimizer keeps
 * no such state, or keeps it in a tier file (sh->tiered). Device memory,
 * except on a GPU rank with the state in host memory (sh->host_state):
 * exec__state_get/put/copy know where each lives. */
float *exec__shard_state(rank_state *rs, shard *sh, uint32_t state);

/* Whether the job's optimizer keeps the state. */
int exec__has_state(const rank_state *rs, uint32_t state);
/* The states rank rs keeps (JOB_STATE_*): its config's, or the master
 * weights alone once it is a base's (exec__handle_freeze). Their count. */
int exec__rank_states(const rank_state *rs, int has[JOB_NSTATES]);
/* The units of which rank rs holds a shard, in the job's order, and the
 * bytes of its copy for a save (snapshot.c). NULL if out of memory. */
unit_layout **exec__snapshot_units(rank_state *rs, unsigned *n, uint64_t *bytes);
/* In-memory redundancy: the host memory (tmpfs) the copies of unit l's
 * shard take on the rank's node, its own and its peer's (0 without
 * redundancy); and that of every unit the rank holds. Both count against
 * max_host_bytes. */
uint64_t exec__replica_bytes(const rank_state *rs, const unit_layout *l);
uint64_t exec__replica_bytes_in_use(rank_state *rs);
/* The job's layout (ckpt.h) of those units at the rank's step: a save's
 * manifest without files. NULL if out of memory. */
ckpt_manifest *exec__layout(rank_state *rs, unit_layout **units, unsigned n);
/* replicate.c: at the end of a step, the job's in-memory copy when one is
 * due (docs/redundancy.md). 0, or -1 with op answered (the collective
 * failed). */
int exec__replicate(rank_state *rs, exec_op *op);
/* OP_FREEZE: the job is a base now, whose state never changes: its
 * shards keep their master weights (and working copies) and free their
 * moments and gradient accumulators. Offloaded state stays as it is. */
void exec__handle_freeze(rank_state *rs);

/* A whole state of a shard, wherever it lives: copied into dst, or
 * replaced by src (NULL: zeros), host memory, shard_numel floats. Returns 0
 * or a negative errno (-EINVAL: no such state). */
int exec__state_get(rank_state *rs, shard *sh, const unit_layout *l, uint32_t state, float *dst);
int exec__state_put(rank_state *rs, shard *sh, const unit_layout *l, uint32_t state,
                    const float *src);
/* The same from src in the rank's device memory (its scratch). */
int exec__state_copy(rank_state *rs, shard *sh, const unit_layout *l, uint32_t state,
                     const float *src);

/* The words LOAD_UNIT and READ_STATE name a state with in messages. */
const char *exec__state_name(const rank_state *rs, uint32_t state);

/* Makes the rank's fp32 scratch hold numel elements and its shard scratch
 * shard_numel. 0 or -ENOMEM. */
int exec__grow_scratch(rank_state *rs, uint64_t numel, uint64_t shard_numel);

/* Casts the master shard into the working copy (bf16 working precision). */
int exec__refresh_working(rank_state *rs, const unit_layout *l, shard *sh);

/* The rank's shard of a registered unit (and its layout in *out), or NULL
 * with op answered NOT_FOUND (unknown unit, or not registered here);
 * exec__find_shard says why in `why` instead of answering. */
shard *exec__lookup_shard(rank_state *rs, exec_op *op, uint32_t unit_id, unit_layout **out);
shard *exec__find_shard(rank_state *rs, uint32_t unit_id, unit_layout **out, char *why,
                        size_t why_bytes);

/* ---- collective.c: collectives on host values -------------------------------- */

/* recv holds world_size * bytes_per_rank; this rank's part is taken from
 * recv + rank * bytes_per_rank (the in-place form of comm_all_gather). */
int exec__host_all_gather(rank_state *rs, void *recv, size_t bytes_per_rank);

/* root's bytes into buf on every rank. 0 or a negative errno. */
int exec__host_broadcast(rank_state *rs, void *buf, size_t bytes, int root);

/* An all-reduce of count doubles with op. 0 or a negative errno. */
int exec__host_all_reduce_f64(rank_state *rs, double *buf, size_t count, comm_op op);

/* A sum all-reduce of the caller's count values together with the
 * agreement `a` (agree.h) of a request that every rank must send alike
 * (`what` names it in messages: "step options"). Returns 0 when every rank
 * sent a valid request and the same fields (values then hold the sums), 1
 * with op answered otherwise (on a refusing rank with refusal_status and
 * `refusal`, on the others INVALID_ARGUMENT naming what was refused or the
 * fields that differ: every rank fails alike), or a negative errno when
 * the collective failed (op not answered). */
int exec__all_reduce_agreed(rank_state *rs, exec_op *op, double *values, size_t count,
                            const agree_set *a, int refusal_status, const char *refusal,
                            const char *what);

/* ---- gather.c: gathered and gradient buffers --------------------------------- */

/* Gathers ahead the unit after unit_id in the recorded order, if the
 * pool has room; failures are dropped (the gather itself will report). */
void exec__prefetch_unit(rank_state *rs, uint32_t unit_id);

/* Returns 1 if handled, 0 if it needs the executor (a cache miss inline). */
int exec__handle_gather(rank_state *rs, exec_op *op, int inline_only, int64_t *prefetch_next);

/* RELEASE: the worker let go of a gathered buffer (it stays cached). */
void exec__handle_release(rank_state *rs, exec_op *op);

/* Lets go of every gathered unit the worker holds (session end, a restore
 * it asked for). */
void exec__drop_gather_holds(rank_state *rs);

/* Returns 1 if handled, 0 if it needs the executor (inline, a GPU rank
 * that must allocate the buffer on its device). */
int exec__handle_grad_buffer(rank_state *rs, exec_op *op, int inline_only);

/* ---- reduce.c ---------------------------------------------------------------- */

/* REDUCE: the unit's gradient buffer is reduce-scattered and added to the
 * rank's fp32 accumulator. */
void exec__handle_reduce(rank_state *rs, exec_op *op);

/* ---- state.c ----------------------------------------------------------------- */

/* READ_STATE: the unit's fp32 weights or one of its optimizer moments,
 * gathered from every rank's shard, the tensors back to back in a memfd
 * that goes with the reply. */
void exec__handle_read_state(rank_state *rs, exec_op *op);

/* ---- groups.c ---------------------------------------------------------------- */

/* SET_GROUPS: the job's parameter groups and each tensor's group. */
void exec__handle_set_groups(rank_state *rs, exec_op *op);

/* Group g's hyper-parameters for the next step (g < max(1, ngroups)). */
void exec__group(const rank_state *rs, uint32_t g, job_group *out);

/* ---- step.c ------------------------------------------------------------------ */

/* STEP: the optimizer step of every shard the rank holds, the save order
 * the ranks agree on taken at its end. */
void exec__handle_step(rank_state *rs, exec_op *op);

/* GRAD_NORM: the global norm of the gradients accumulated since the last
 * step, as the next step will see it (collective). */
void exec__handle_grad_norm(rank_state *rs, exec_op *op);

/* ---- register.c: registration and loads -------------------------------------- */

/* REGISTER_UNIT: the ranks agree on the unit's layout and create and
 * initialise its shards (or find it registered already). */
void exec__handle_register(rank_state *rs, exec_op *op);

/* LOAD_UNIT: rank 0's fp32 values become the unit's master weights and
 * working copy on every rank (frozen tensors included); the optimizer
 * state and the gradient accumulators stay. The version goes up, so no
 * cached gather of the old values is served again, and a pin of the old
 * version keeps them (copy on write, as in a step). */
void exec__handle_load(rank_state *rs, exec_op *op);

/* ---- session.c: sessions and the communicator -------------------------------- */

/* Replaces the rank's communicator (NULL: none) and destroys the old one.
 * The swap is under comm_lock because exec_rank_stop, on the loop thread,
 * may be aborting the old one; once the lock is ours it is done, and it
 * will find only the new one. A communicator built while the rank is
 * stopping is aborted at once: what the executor runs with it before
 * OP_STOP (the step-count check of a build) must not wait for peers that
 * stop too. */
void exec__set_comm(rank_state *rs, comm *c);

/* Cancels the communicator build in progress (rs->build_cancel) if it is
 * the rank's last (the rank stops) or its generation has failed; a build
 * of a newer generation goes on. Any thread. */
void exec__cancel_build_if_over(rank_state *rs);

/* A worker session attached to the rank. */
void exec__handle_session_begin(rank_state *rs, exec_op *op);

/* It left: what it held is released, and a save waiting for a step that
 * will not come is taken now. */
void exec__handle_session_end(rank_state *rs, exec_op *op);

/* Builds the rank's communicator of op->generation (a reset builds a new
 * one) and has the ranks agree on their step counts. */
void exec__handle_comm_init(rank_state *rs, exec_op *op);

/* ---- snapshot.c: checkpoints ------------------------------------------------- */

/* Copies the rank's shard state (master weights, then the moments the
 * optimizer keeps, unit by unit: the shard file's data order, ckpt.h) to
 * host memory and hands it to its writer (the ckpt hooks). The executor
 * runs nothing else meanwhile, so no step changes the state being copied;
 * this is all the time a save holds training up. */
void exec__take_snapshot(rank_state *rs, uint64_t id);

/* A save order reached the rank: with no worker attached no step will
 * come, so the copy is taken now (in queue order, before any op of a
 * worker that attaches later). With one, it is taken at the end of a step
 * to come, and the rank's writer faults its memory in meanwhile. */
void exec__handle_save(rank_state *rs, exec_op *op);

/* Reads and verifies the rank's part of a restore's source into host
 * memory, and reports. */
void exec__handle_restore_read(rank_state *rs, exec_op *op);

/* Installs what exec__handle_restore_read staged: every rank of the job does
 * this once all have read and verified their part. A failure here leaves
 * ranks that installed and ranks that did not, so the job fails. */
void exec__handle_restore_commit(rank_state *rs, exec_op *op);

/* CHECKPOINT from the worker (node/ckpt_call.c): a collective in which
 * every rank checks that all were called alike (action, name, step), then
 * waits for the call with its worker (rs->ckpt_parked). A save order that
 * reaches a waiting rank has its copy taken at once; a restore releases
 * the worker's gathered units first. The op's reply is the node's, when
 * the call ends: the op carries the call and the step. */
void exec__handle_ckpt_park(rank_state *rs, exec_op *op);
/* The rank's worker no longer waits in a checkpoint call. */
void exec__ckpt_unpark(rank_state *rs);

#endif /* ZEROD_EXEC_IMPL_H */
