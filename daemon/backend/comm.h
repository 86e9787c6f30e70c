/* comm: the collectives between the ranks of one job.
 *
 * One communicator per (job, rank). All calls are blocking and are made
 * from that rank's executor thread only; every rank of the job must issue
 * the same calls in the same order. A call that does not complete within the
 * communicator's timeout fails with -ETIMEDOUT (a dead or stuck peer is an
 * error, not a hang); after any failure the communicator is broken and
 * every later call fails fast with the same error until it is destroyed.
 *
 * Backends, behind one table of operations (comm_ops, comm_impl.h):
 * comm_gloo.cc (CPU ranks, Gloo over TCP; buffers in host memory) and
 * comm_nccl.c (GPU ranks, NCCL through the CUDA module; buffers in device
 * memory of the rank's device, collectives enqueued on the rank's stream and
 * waited for before the call returns, so the blocking contract above holds
 * for both). Errors are negative errno values; the last error's text is kept
 * per communicator (comm_last_error). Argument checks and the broken state
 * are common to both backends (comm.c). */
#ifndef ZEROD_COMM_H
#define ZEROD_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "store.h"

typedef struct comm comm;

/* What a communicator is doing, for a watcher on another thread (the
 * node's heartbeat: docs/daemon.md, "Stalls"): the collectives it has
 * begun, the one in progress (COMM_ACT_NONE: none) and since when
 * (CLOCK_MONOTONIC ns). Set with comm_set_activity; updated by every
 * collective of comm.h. */
typedef enum comm_act {
  COMM_ACT_NONE,
  COMM_ACT_ALL_GATHER,
  COMM_ACT_ALL_GATHER_NODE,
  COMM_ACT_REDUCE_SCATTER,
  COMM_ACT_ALL_REDUCE,
  COMM_ACT_ALL_TO_ALL,
  COMM_ACT_BROADCAST,
  COMM_ACT_BARRIER,
} comm_act;
/* Written by the rank's thread, read by others: only through
 * __atomic_load_n / __atomic_store_n (plain fields, so that C++ includers
 * see the same layout). */
typedef struct comm_activity {
  uint64_t calls;
  int op; /* comm_act */
  uint64_t since_ns;
  /* Nanoseconds spent in the collectives that have ended, and a sequence
   * count (odd while the writer changes since_ns, op or busy_ns) so that
   * comm_activity_busy_ns reads the three consistently. */
  uint64_t busy_ns;
  uint64_t seq;
} comm_activity;
/* The time a's communicator has spent in collectives up to now_ns
 * (CLOCK_MONOTONIC), the one in progress included; any thread. */
uint64_t comm_activity_busy_ns(const comm_activity *a, uint64_t now_ns);
/* "all_gather", ...; "" for COMM_ACT_NONE. */
const char *comm_act_name(int op);

typedef enum comm_dtype { COMM_F32, COMM_F64, COMM_U8, COMM_I64 } comm_dtype;

/* Where a communicator's traffic goes, for its byte counts: between ranks
 * on one node, between nodes (the cross-node half of a hierarchical
 * collective), or over a flat communicator whose ranks span nodes. */
typedef enum comm_level {
  COMM_LEVEL_NODE,
  COMM_LEVEL_CROSS,
  COMM_LEVEL_WORLD,
  COMM_LEVELS
} comm_level;
typedef enum comm_op { COMM_SUM, COMM_MAX, COMM_MIN } comm_op;

typedef struct comm_options {
  const char *prefix; /* namespace in the store, e.g. "job/7/epoch/1" */
  int rank, world_size;
  int timeout_ms;       /* per call, and for the rendezvous */
  const char *hostname; /* address to listen on; NULL: 127.0.0.1 */
  comm_level level;     /* what its bytes count as (comm_take_bytes) */
  /* Fired from another thread, ends the creation with -ECANCELED
   * (comm_cancel.h); NULL: only the store's stop or the timeout ends it. */
  struct comm_cancel *cancel;
} comm_options;

/* Creates a Gloo communicator; blocks until all world_size ranks have
 * called it with the same prefix (or the timeout). */
int comm_gloo_create(const comm_options *options, store *st, comm **out, char *err,
                     size_t err_bytes);

struct zk_cuda_api;

/* Creates an NCCL communicator for a GPU rank whose device is current on the
 * calling thread. Rank 0 puts a fresh ncclUniqueId under the prefix in the
 * store ("<prefix>/nccl-id"), the others wait for it; then it waits (up to
 * the timeout, for the whole rendezvous) for the communicator to connect.
 * stream (a cudaStream_t, the caller's, which must outlive the
 * communicator) carries every collective. -ENODEV when api is NULL (no CUDA
 * module), -EPROTO for a module older than API version 2, -ENOSYS where
 * NCCL is not available, -ETIMEDOUT when a rank does not come. */
int comm_nccl_create(const comm_options *options, store *st, const struct zk_cuda_api *api,
                     void *stream, comm **out, char *err, size_t err_bytes);

/* The ranks of a job that are threads of this process, all of its ranks
 * (a job on one node, host memory): a group that their communicators
 * share, made by whoever owns the job and handed to each rank. The
 * collectives are copies and rank-order sums in the process's memory
 * (comm_local.c), bit for bit the Gloo backend's results. */
typedef struct comm_local_group comm_local_group;
int comm_local_group_create(int world_size, comm_local_group **out);
void comm_local_group_ref(comm_local_group *g);
void comm_local_group_unref(comm_local_group *g);
/* Fails every call in the group, rendezvous included, at once and from now
 * on (-ECANCELED): the daemon's stop. Any thread. */
void comm_local_group_cancel(comm_local_group *g);
/* Creates options->rank's communicator in group (which it references);
 * blocks until every rank of the group has called it (or the timeout).
 * options->prefix and hostname are unused. */
int comm_local_create(const comm_options *options, comm_local_group *group, comm **out, char *err,
                      size_t err_bytes);

/* A hierarchical communicator (comm_hier.c) for a job of N nodes with L
 * ranks each: local, this node's L ranks (comm_local_create, level node),
 * and cross, the N ranks with this local index on every node (Gloo, level
 * cross); options->rank must be node * L + local rank. Gathers are exact;
 * reduce-scatter sums each node's ranks first, then the nodes (a fixed
 * order, not the flat rank order). Takes both, even on failure. */
int comm_hier_create(const comm_options *options, comm *local, comm *cross, comm **out, char *err,
                     size_t err_bytes);

/* recv holds world_size * bytes_per_rank; rank r's send lands at
 * recv + r * bytes_per_rank. send may point there already (in place). */
int comm_all_gather(comm *c, const void *send, void *recv, size_t bytes_per_rank);

/* The ranks of this rank's node in a hierarchical communicator (its L),
 * 0 for any other. */
int comm_node_ranks(const comm *c);

/* An all-gather among the ranks of this rank's node only, on a
 * hierarchical communicator (ZeRO++ hpZ's gathers from secondary
 * partitions): recv holds L * bytes_per_rank, local rank l's send lands at
 * recv + l * bytes_per_rank; send may be this rank's slot (in place). Its
 * bytes count at the node level. -ENOSYS on any other communicator. */
int comm_all_gather_node(comm *c, const void *send, void *recv, size_t bytes_per_rank);

/* Sums world_size shards of fp32 element-wise: send holds
 * world_size * shard_numel floats, recv receives this rank's shard (the sum
 * of every rank's [rank * shard_numel, (rank+1) * shard_numel) slice),
 * added in rank order, ((g0 + g1) + g2) + ..., so the result is the same
 * bits as a sequential sum in one process (Gloo backend; the NCCL backend
 * sums in NCCL's order, which depends on its algorithm and the topology, so
 * its fp32 results may differ from those in the last bits). send is not
 * modified. */
int comm_reduce_scatter_f32(comm *c, float *send, float *recv, size_t shard_numel);

/* How the cross-node half of a hierarchical reduce-scatter travels (ZeRO++
 * qgZ, and plain bf16 gradients): each node's partial sums are encoded,
 * exchanged with one all-to-all per local index, decoded and summed in fp32
 * in node order. The node half stays fp32 in shared memory. */
typedef enum comm_wire_format {
  COMM_WIRE_F32 = 0, /* exact: the rank-order reduce-scatter */
  COMM_WIRE_BF16,
  COMM_WIRE_INT8, /* blocks with an fp32 scale each (zk_quantize, symmetric) */
  COMM_WIRE_INT4,
  /* 1-bit Adam: signs and a scale per block, with error feedback
   * (zk_onebit_encode); this node's own partial sums stay exact. */
  COMM_WIRE_ONEBIT,
  /* Low-rank (PowerSGD): each partial sum for another node read as a rows
   * x cols matrix M (zero-padded) plus its error feedback, sent to its
   * owner as the factors P = orthonormalized M Q and M^T P; this node's
   * own partial sums stay exact (comm_hier.c). */
  COMM_WIRE_LOWRANK,
} comm_wire_format;

typedef struct comm_wire {
  comm_wire_format format;
  size_t block; /* elements per block, int8/int4 (even), one-bit (a multiple of 8) */
  /* COMM_WIRE_ONEBIT: the error feedback, one chunk of shard_numel per node
   * (the chunk this node sends to node n is error + n * shard_numel; its
   * own stays unused), kept by the caller from one call to the next. */
  float *error;
  /* COMM_WIRE_LOWRANK: the matrix (rows * cols >= shard_numel), the rank,
   * error as above, and the warm start: one cols x rank factor per node,
   * at q + n * cols * rank, replaced by each call's. */
  size_t rows, cols, rank;
  float *q;
} comm_wire;

/* comm_reduce_scatter_f32 whose cross-node half travels as wire says, on a
 * hierarchical communicator; any other communicator (and COMM_WIRE_F32, or
 * wire NULL) reduces exactly. */
int comm_reduce_scatter_f32_wire(comm *c, float *send, float *recv, size_t shard_numel,
                                 const comm_wire *wire);

/* send holds world_size chunks of bytes_per_rank, chunk j for rank j; recv
 * receives chunk r from each rank r (its own from itself). send and recv
 * do not overlap. Gloo and local backends; -ENOSYS on others. */
int comm_all_to_all(comm *c, const void *send, void *recv, size_t bytes_per_rank);

/* In place. */
int comm_all_reduce(comm *c, void *buf, size_t count, comm_dtype dtype, comm_op op);
int comm_broadcast(comm *c, void *buf, size_t bytes, int root);
int comm_barrier(comm *c);

/* The payload bytes its collectives moved, per level, since the last call
 * (which zeroes them): a gather's whole gathered buffer, a reduce-scatter's
 * whole input, an all-reduce's or broadcast's buffer; a hierarchical
 * communicator reports each of its halves at its own level. Executor
 * thread. */
void comm_take_bytes(comm *c, uint64_t bytes[COMM_LEVELS]);

int comm_rank(const comm *c);
int comm_world_size(const comm *c);
const char *comm_last_error(const comm *c);
void comm_destroy(comm *c);

/* Makes the collective in progress on c, if any, and every later one fail
 * at once (-ECANCELED) instead of waiting for peers that may never come:
 * the daemon's shutdown, whose executors must not wait out a collective
 * timeout. The one exception to "calls from the executor thread only": it
 * may be called from any thread, while the executor is inside a call, but
 * never at the same time as comm_destroy(c). It returns without waiting for
 * the call in progress; c stays to be destroyed by its owner. */
void comm_abort(comm *c);

/* Makes c record its collectives in a (which must outlive c; NULL: none).
 * Only the communicator a rank calls: those a hierarchical one is made of
 * record nothing. */
void comm_set_activity(comm *c, comm_activity *a);

#endif /* ZEROD_COMM_H */
