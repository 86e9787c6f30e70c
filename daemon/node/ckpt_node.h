/* ckpt_node: a node's part of checkpoints (docs/architecture.md,
 * docs/checkpoints.md).
 *
 * The coordinator orders saves and restores through the job's assignment
 * (SaveOrder, RestoreOrder in the Watch stream); this node's ranks do the
 * work and report it in every heartbeat (JobStatus.saves / restores) until
 * the order leaves the assignment.
 *
 * Save. Every rank copies its shard state (fp32 master weights and the
 * optimizer's moments) to host memory at the same step, on its executor,
 * so no step runs meanwhile; the copy is then written to the order's
 * directory by a thread of its own while training goes on. The ranks agree
 * on the step through the step's own all-reduce (rank/step.c): a rank that knows
 * of an order adds its id there, and every rank takes its copy at the end
 * of that step. A rank with no worker attached takes it at once (OP_SAVE),
 * or when its worker detaches; one with a worker has its writer fault in
 * the memory for the copy as soon as the order reaches it (the copy holds
 * training up; faulting fresh memory in costs several times the copy).
 * Global rank 0 also writes the job's layout
 * (ckpt.h, CKPT_LAYOUT_NAME), from which the coordinator makes the
 * manifest.
 *
 * Restore. Refused while workers are attached to the job here (its ranks
 * would be between collectives). Otherwise attaches are refused until it
 * ends, every rank reads and verifies what it owns of the source into host
 * memory (OP_RESTORE_READ) and reports; once every rank of the job has,
 * the coordinator sets commit and every rank installs its part
 * (OP_RESTORE_COMMIT). An order withdrawn before the commit drops what was
 * read: the job is unchanged.
 *
 * Threads: ckpt_node_orders, ckpt_node_reports and the job functions run
 * on the loop; the rank functions on the rank's executor; each save's
 * writers on threads of their own. A job's checkpoint state has a mutex of
 * its own, and the loop learns of progress through an async handle that
 * sends a heartbeat at once. */
#ifndef ZEROD_CKPT_NODE_H
#define ZEROD_CKPT_NODE_H

#include <stdint.h>

#include "ckpt.h"
#include "exec.h"
#include "job.h"
#include "zerod/v1/control.pb-c.h"

struct daemon;

/* ---- Loop thread ------------------------------------------------------------ */

/* The async handle through which threads report progress: the loop then
 * calls progress (cluster_report: a heartbeat at once). Shutdown stops
 * every job's shard writers (at their next chunk; their saves fail) and
 * closes it. */
int ckpt_node_init(struct daemon *d, void (*progress)(struct daemon *d));
void ckpt_node_shutdown(struct daemon *d);

/* Whether j is being restored and not yet installed on all of this node's
 * ranks: workers may not attach. Once every local rank has installed the
 * restored state they may, though the order stays in the Assignment until
 * the coordinator has heard from every rank (loop thread). */
int ckpt_node_restoring(job *j);

/* The replica server in-memory copies of j go to ("host:port"; "" or
 * NULL: none), from its Assignment (loop thread). */
void ckpt_node_set_buddy(job *j, const char *buddy);

/* Follows the checkpoint orders of job j's assignment. */
void ckpt_node_orders(job *j, const Zerod__V1__Assignment *as);

/* Adds the job's reports to st. What they point to is in *owned until
 * ckpt_node_reports_free (after the heartbeat is encoded). */
void ckpt_node_reports(job *j, Zerod__V1__JobStatus *st, void **owned);
void ckpt_node_reports_free(void *owned);

/* The job's checkpoint state, made with the job (job_create) and freed
 * with it once its executors have stopped: waits for its writers, which
 * give up at their next chunk. */
int ckpt_node_job_init(job *j);
void ckpt_node_job_free(job *j);

/* ---- Executor threads ---------------------------------------------------------- */

/* The functions below, as the ranks reach them (exec_settings.ckpt). */
extern const exec_ckpt_hooks ckpt_node_hooks;

/* Save id reached rank `rank` (global), whose copy will take `bytes`,
 * while a worker is attached: the copy is taken at the end of a step to
 * come. Its shard writer starts now and faults that much host memory in
 * while training goes on, so that the copy, which holds training up, takes
 * no page faults. */
void ckpt_node_stage(job *j, int rank, uint64_t id, uint64_t bytes);

/* The memory staged for rank's copy for save id if there is some of
 * exactly `bytes`, faulted in or not yet all of it (the writer goes on
 * beside the copy): the caller holds a reference (hostmem_shared_unref).
 * NULL: the caller allocates with hostmem_shared_alloc. */
void *ckpt_node_staging(job *j, int rank, uint64_t id, uint64_t bytes);

/* Rank `rank` (global) took its copy for save id: data_bytes of shard data
 * in the shard file's order (memory from ckpt_node_staging or
 * hostmem_shared_alloc), and for rank 0 the job's layout. Ownership of data and
 * layout passes here. */
void ckpt_node_saved(job *j, int rank, uint64_t id, uint64_t step, void *data, uint64_t data_bytes,
                     ckpt_manifest *layout, int64_t stall_ms);
void ckpt_node_save_failed(job *j, int rank, uint64_t id, int code, const char *error);

/* A rank's restore result: read and verified (committed 0), installed
 * (committed 1), or failed (code: a gRPC status; error names the cause). */
void ckpt_node_restore_report(job *j, int rank, uint64_t id, int committed, uint64_t step, int code,
                              const char *error);

#endif /* ZEROD_CKPT_NODE_H */
