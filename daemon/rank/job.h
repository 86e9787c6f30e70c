/* job: the data model of the node daemon (docs/architecture.md).
 *
 * A job is a named training state: an optimizer and precision config, a
 * world of ranks, and its units. A unit is an ordered list of tensors laid
 * out back to back in one flat buffer (each tensor aligned), padded so that
 * its length divides evenly by the world size; rank r owns the contiguous
 * slice [r * shard_numel, (r + 1) * shard_numel).
 *
 * Ownership and threads: the job and its unit layouts are created on the
 * loop thread or by executors under job->mutex and are immutable once
 * published. Each rank_state (the per-rank shards, the buffer pool, the
 * communicator) belongs to that rank's executor thread; the loop touches it
 * only while the executor is idle (rank_state.busy == 0, see exec.h).
 * The exceptions are what read-only sessions read from worker threads: the
 * shard table and working copies (under job.rank_locks) and the versions
 * (under job.pin_mutex); pin.h has the rules. */
#ifndef ZEROD_JOB_H
#define ZEROD_JOB_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "comm.h"
#include "comm_cancel.h"
#include "config.h"
#include "device.h"
#include "digest.h"
#include "layout.h"
#include "zerod/v1/ipc.pb-c.h"
#include "zk.h"

#define JOB_MAX_UNITS      65536
#define JOB_MAX_WORLD      64
#define JOB_COUNTER_LEVELS 3 /* comm_level: node, cross, world */
#define JOB_COUNTER_KINDS  4 /* rank_collective */

struct session;
struct exec_op;
struct exec_settings;
struct rank_series;
struct job_series;

/* A [begin, end) range of a shard, in shard elements. */
typedef struct shard_range {
  uint64_t begin, end;
  uint32_t group; /* trainable ranges: the parameter group of its tensor */
} shard_range;

/* Gathered units, gradient buffers, and hpZ secondary partitions (a
 * rank's slice of a gathered unit, kept for gathers inside the node). */
typedef enum buf_kind { BUF_GATHER, BUF_GRAD, BUF_SECONDARY, BUF_BASE } buf_kind;

/* One buffer of a rank's pool: a memfd region on a host rank, an
 * IPC-exported allocation on a GPU rank (device.h). */
typedef struct pool_buf {
  uint32_t id; /* stable for the rank's life; the client caches by it */
  device_buffer buf;
  buf_kind kind;
  int64_t unit;           /* unit it holds or -1 */
  uint64_t valid_version; /* gather, secondary: version of its values; UINT64_MAX: none */
  int refs;               /* > 0: live (held by the worker) */
  uint64_t last_use;      /* LRU tick */
  uint64_t sent_session;  /* session that already received the fd or handles */
  int in_use;             /* slot holds a buffer */
  /* BUF_BASE: a gathered base unit, the node's base cache's entry, which
   * buf describes but does not own (never counted in the pool's bytes). */
  struct base_cache *base_cache;
  struct base_cache_entry *base_entry;
} pool_buf;

/* A rank's state for one unit. The arrays are in the rank's device memory
 * (device.h): host memory on a host rank, GPU memory on a GPU rank. */
typedef struct shard {
  int present;
  float *master;            /* fp32 master weights, shard_numel */
  float *moment1, *moment2; /* Adam m, v; SGD momentum in moment1 */
  float *grad_acc;          /* fp32 gradient accumulator */
  void *working;            /* working copy; == master for fp32 */
  shard_range *trainable;   /* ranges updated by the optimizer */
  unsigned ntrainable;
  shard_range *zero_ranges; /* full-buffer ranges zeroed before a reduce
                               (alignment gaps, padding, frozen tensors) */
  unsigned nzero_ranges;
  int64_t gather_buf;    /* pool index of the gathered buffer, or -1 */
  int gather_held;       /* the worker holds it (between gather and release) */
  int64_t grad_buf;      /* pool index of the gradient buffer held, or -1 */
  int64_t secondary_buf; /* pool index of its hpZ secondary partition, or -1 */
  uint64_t bytes;        /* exec__shard_bytes, counted in the rank's state_bytes */
  /* offload_optimizer nvme (tier.h): master and moments are in the rank's
   * tier file at tier_offset, one tier_stride-byte region each (master,
   * moment1, moment2 as kept), not in the arrays above (NULL). */
  int tiered;
  uint64_t tier_offset, tier_stride;
  /* offload_optimizer cpu on a GPU rank (offload.h): master and moments
   * are host memory (hostmem arrays), the accumulator and the working copy
   * (its own array, fp32 included) the GPU's; host_bytes of them counted
   * in the rank's host_state_bytes. */
  int host_state;
  uint64_t host_bytes;
  /* A unit of the job's base (RegisterUnitRequest.from_base): working is
   * the base's rank's working slice (read only; the base is frozen), no
   * other array exists, and the unit is gathered through the node's base
   * cache (rank/base_units.c). base_unit: its id in the base. */
  int from_base;
  uint32_t base_unit;
  /* 1-bit Adam (rank/onebit.c): the error feedback of this rank's partial
   * sums sent to each node, host memory, counted in state_bytes; NULL
   * until the first compressed reduce. */
  float *onebit_error;
  uint64_t onebit_numel;
  /* Low-rank compression (rank/lowrank.c): the error feedback of this
   * rank's partial sums (nodes x shard), then its warm start (nodes x cols
   * x rank), host memory counted in state_bytes; NULL for a unit that
   * stays exact. */
  float *lowrank_state;
  uint64_t lowrank_numel;
} shard;

/* Whether the shard holds state of the rank's own (master weights,
 * moments, accumulator): present and not a unit of the job's base. */
static inline int shard_has_state(const shard *sh) {
  return sh->present && !sh->from_base;
}

typedef struct rank_state {
  struct job *job;
  int rank;

  /* Executor (exec.c, the queue). */
  pthread_t thread;
  int thread_started;
  pthread_mutex_t queue_mutex;
  pthread_cond_t queue_cond;
  struct exec_op *queue_head, *queue_tail;
  _Atomic int busy;    /* ops submitted and not finished */
  _Atomic int stopped; /* the thread has run OP_STOP and is exiting */
  /* Set once the rank is told to stop (exec_rank_stop), which aborts its
   * communicator from the loop thread; comm_lock keeps the executor from
   * replacing or freeing `comm` meanwhile. */
  _Atomic int stopping;
  pthread_mutex_t comm_lock;
  /* Armed while the executor builds a communicator (tagged with its
   * generation): exec_rank_abort_comm fires it when the rank stops or that
   * generation has failed, so a build waiting for a peer that is gone ends
   * now, not at its timeout. */
  comm_cancel build_cancel;

  /* Executor-owned state. The device is opened by the executor thread
   * when it starts and closed when it stops; every array below that holds
   * values (shards, scratch, the pool's buffers) is its memory. */
  device *dev;
  char device_error[512]; /* why the device could not be opened */
  /* The op's failure came from the device (a copy around a collective),
   * not from the communicator; reset before each op. */
  int failed_on_device;
  comm *comm;
  unsigned generation; /* communicator generation (job resets) */
  zk_pool *pool;
  shard *shards;
  uint32_t nshards; /* capacity, indexed by unit id */
  pool_buf *bufs;
  uint32_t nbufs;
  uint32_t next_buf_id; /* ids are never reused: clients cache mappings by id */
  uint64_t pool_bytes, live_bytes, tick;
  uint32_t *dropped_ids; /* freed buffers the session still maps */
  size_t ndropped, dropped_cap;
  uint64_t session_id;
  /* Completed optimizer steps (after a restore: the checkpoint's). Written
   * by the executor; atomic because the loop reads it for the node's
   * heartbeat reports (JobStatus.step). Not the version, which loads and
   * restores move too. */
  _Atomic uint64_t step;
  /* generation + 1 once this rank's communicator of that generation is
   * built; read by the loop for the node's heartbeat reports. */
  _Atomic unsigned comm_ready;
  /* Bumped when the working copies change (step, load), only inside
   * pin_begin_write under the job's pin_mutex, where readers look at it;
   * the executor reads it freely. */
  uint64_t version;
  /* What the rank is doing, for the node's heartbeat (docs/daemon.md,
   * "Stalls"): its communicator's collectives (comm_set_activity), and the
   * op its executor last began (op_kind) and when (clock_now_ns). */
  comm_activity activity;
  _Atomic int last_op;
  _Atomic uint64_t last_op_ns;
  uint64_t state_bytes; /* executor-owned: bytes of its shards (exec__shard_bytes) */
  /* Executor-owned: the job is a base and this rank keeps its master
   * weights alone (exec__handle_freeze); its saves hold those only. */
  int weights_only;
  /* In-memory redundancy (replicate.c): the step of this rank's newest
   * copy that every rank completed (atomic: the loop may read it), and the
   * bytes of its file. */
  _Atomic uint64_t replica_step;
  uint64_t replica_file_bytes;
  /* offload_optimizer nvme: the rank's tier file (tier.h; NULL until a
   * shard needs it) and the bytes of state in it. Executor-owned. */
  struct rank_tier *tier;
  uint64_t tier_bytes;
  char tier_error[512]; /* why the last shard found no room in the tier file, or "" */
  /* A GPU rank's optimizer state off the GPU (offload.h): its staging
   * slots and host kernels (NULL until first used), and the bytes of
   * state in host memory. Executor-owned. */
  struct rank_offload *offload;
  uint64_t host_state_bytes;
  double lr, max_grad_norm; /* lr: group 0's */
  /* Dynamic loss scaling (config.loss_scale > 0): the scale the next
   * step's gradients carry, good steps since the last change, overflows
   * still tolerated before a backoff. Executor-owned; loss_scale is atomic
   * because the loop reads it for ATTACH replies. */
  _Atomic double loss_scale;
  uint32_t loss_scale_good, loss_scale_hysteresis;
  /* SET_GROUPS' parameter groups (groups[0].lr unused: lr is group 0's);
   * none (0): one group, the job's config. Executor-owned. */
  job_group *groups;
  unsigned ngroups;
  double progress_since_s; /* monotonic time of the last progress line */
  uint64_t progress_since_step;
  float *scratch; /* fp32, scratch_numel: initial values, reduce input */
  uint64_t scratch_numel;
  float *shard_scratch; /* fp32, reduced shard */
  uint64_t shard_scratch_numel;
  void *staging; /* GPU ranks: small collectives on host values pass here */
  size_t staging_bytes;
  /* qwZ (gather.c): every rank's quantized shard, and a dequantized one
   * for a working copy that is not fp32. Host memory. */
  uint8_t *qgather;
  size_t qgather_bytes;
  float *qdequant;
  size_t qdequant_numel;
  /* hpZ (gather.c): the node's ranks that hold a unit's secondary
   * partition (L, set when the communicator is built), 0 when off; the
   * pool bytes its slices take (executor-owned). */
  int hpz_ranks;
  uint64_t secondary_bytes;
  uint32_t *order; /* gather order recorded before the first step */
  size_t order_len, order_cap;
  int order_complete;
  size_t order_cursor;

  /* Checkpoints (ckpt_node.h). The save order the loop has told this rank
   * of (the highest id; 0: none), and the last one it took its copy for
   * (executor-owned); a restore's values read and verified, waiting for
   * the commit (executor-owned). */
  _Atomic uint64_t ckpt_pending;
  uint64_t ckpt_taken;
  struct ckpt_staged *ckpt_staged;
  /* A worker's own CHECKPOINT call (node/ckpt_call.c): the action it waits
   * in (Zerod__V1__CheckpointAction; 0: none), from OP_CKPT_PARK to
   * OP_CKPT_UNPARK, and the calls made since the communicator was built,
   * which name a call alike on every rank. Executor-owned. */
  int ckpt_parked;
  uint64_t ckpt_calls;

  /* Collectives run, by level (comm_level) and kind (rank_collective):
   * bytes and calls. Counted by the executor, read by the loop (STATS). */
  _Atomic uint64_t coll_bytes[JOB_COUNTER_LEVELS][JOB_COUNTER_KINDS];
  _Atomic uint64_t coll_calls[JOB_COUNTER_LEVELS][JOB_COUNTER_KINDS];
  /* The pool's bytes and the secondary partitions' after the last op,
   * for STATS (the executor writes them, the loop reads). */
  _Atomic uint64_t stat_pool_bytes, stat_secondary_bytes;
  /* Its shards' bytes in memory and in its tier file (offload nvme). */
  _Atomic uint64_t stat_state_bytes, stat_tier_bytes, stat_host_state_bytes;
  /* The worker's waits and the communication among them, in ns
   * (rank_metrics_waits; RankStats.wait_seconds, exposed_comm_seconds),
   * and since when the next step's reported waits can have run
   * (executor-owned: the attach or the last step's answer). */
  _Atomic uint64_t stat_wait_ns, stat_exposed_comm_ns;
  uint64_t waits_since_ns;

  /* Loop-owned. */
  struct session *session; /* the attached read-write session */

  struct rank_series *metrics; /* its Prometheus series (rank_metrics.h); NULL: none */
} rank_state;

typedef struct job {
  struct job *next;
  /* How its ranks run and whom they report to (exec.h), and the owner's
   * own pointer (the node daemon's): both set by the owner, which outlives
   * the job. */
  const struct exec_settings *exec;
  void *owner;
  char *name;
  uint64_t id;
  char *token_sha256; /* the owner token's SHA-256, 64 hex digits (digest.h) */
  /* Loop-owned: SHA-256s of the read tokens, which attach read-only
   * sessions only (the coordinator's IssueReadToken; jobs_set_read_tokens). */
  char (*read_token_sha256)[DIGEST_HEX_BYTES];
  size_t n_read_tokens;
  job_config config;
  /* Quotas (control.proto Quotas), set by the owner before any session
   * attaches; 0: no limit. Shard state per rank in host or device memory,
   * whichever holds the rank's shards; sessions on this node. */
  uint64_t quota_host_bytes, quota_device_bytes;
  uint32_t quota_sessions;
  int world_size;    /* ranks of the job, on every node */
  int nranks;        /* ranks hosted here: global ranks first_rank.. */
  int first_rank;    /* first_rank + nranks - 1; standalone: 0 and world_size */
  rank_state *ranks; /* [nranks], ranks[i].rank == first_rank + i */

  pthread_mutex_t mutex; /* units, failure state, the local group */
  unit_layout **units;
  uint32_t nunits, units_cap;
  unsigned generation;  /* current communicator generation (loop writes) */
  unsigned built_epoch; /* the coordinator's job epoch it was built at (JobStatus.epoch) */
  /* In-memory redundancy: a copy every this many steps (replicate.c); 0:
   * none. Set when the job is built. */
  _Atomic unsigned redundancy_every;
  long failed_generation; /* -1, or the generation that failed */
  /* Host ranks: the group the communicators of local_generation of the
   * job's ranks here share (comm_local.c: all of the job's ranks, or this
   * node's half of a hierarchical communicator), or NULL. */
  comm_local_group *local_group;
  unsigned local_generation;
  char fail_reason[512];

  int sessions;        /* loop-owned: attached read-write sessions */
  int deleted;         /* loop-owned: deleted on the coordinator; retired once nobody is attached */
  uint64_t abort_seen; /* loop-owned: the coordinator's last stall abort followed (cluster.c) */
  int readers;         /* loop-owned: read-only sessions whose state is not yet freed */
  /* Loop-owned: the id of the restore in progress (attaches are refused
   * until it ends), 0 if none. */
  uint64_t restoring;
  /* Loop-owned: the node rebuilt the job's ranks (their state was lost)
   * and the coordinator has not yet settled whether it comes back from a
   * checkpoint (Assignment.recovery_pending): attaches are refused. */
  int awaiting_recovery;
  /* Workers waiting in a restore they asked for (CHECKPOINT): counted by
   * the executors, read by the loop, which restores with them attached. */
  _Atomic int ckpt_restore_parked;
  /* Loop-owned: workers' checkpoint calls (node/ckpt_call.c) running on
   * this node; the job is not freed before they end. */
  int worker_calls;
  struct job_ckpt *ckpt; /* the node's checkpoint work for the job (node/ckpt_node.c) */

  /* Versions and pins (pin.c; pin.h has the locking rules). */
  pthread_rwlock_t *rank_locks; /* [nranks], by local index */
  pthread_mutex_t pin_mutex;
  pthread_cond_t pin_cond;
  struct job_pin *pins;
  int pins_stopping;               /* the daemon is stopping: readers give up */
  _Atomic uint64_t latest_version; /* the highest version any rank reached */

  struct job_series *metrics; /* its Prometheus series (rank_metrics.h); NULL: none */

  /* Bases (docs/bases.md). frozen: the job is a base (FreezeJob; the loop
   * sets it from the assignment, executors read it): nothing writes its
   * state any more. base: the frozen job this one's from_base units come
   * from, set by the loop before the executors start; base_users (loop-
   * owned) counts the jobs on this one, which is not freed before they are. */
  _Atomic int frozen;
  struct job *base;
  int base_users;
} job;

/* A reference to the local group of the job's communicators of
 * generation (made by the first rank to ask for it; the previous
 * generation's is let go), or NULL if out of memory. */
comm_local_group *job_local_group(job *j, unsigned generation);

/* Whether some of the job's ranks live on other nodes. Such a job never
 * resets on one node alone (its communicators span the nodes, decisions.md),
 * a lost worker fails it at once (peers would wait in collectives), and
 * read-only sessions, which assemble units from every rank's memory, are
 * refused. */
static inline int job_spans_nodes(const job *j) {
  return j->nranks < j->world_size;
}

/* Creates a job of world_size ranks of which this daemon hosts nranks,
 * global ranks first_rank.. (executors not started). -EINVAL if they do not
 * fit, -ENOMEM. */
int job_create(const struct exec_settings *exec, void *owner, const char *name,
               const char *token_sha256, const job_config *config, int world_size, int nranks,
               int first_rank, uint64_t id, job **out);
/* Frees the job itself: call once its executors have stopped and freed
 * their state (exec_rank_free), its pins are gone (pin_job_clear) and its
 * owner has freed what it hung on the job (node/jobs.c does all of it). */
void job_destroy(job *j);

/* Marks the job failed in its current generation (first reason wins) and
 * wakes the readers waiting on its ranks. */
void job_fail(job *j, unsigned generation, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Returns 1 and copies the reason if the job failed in `generation`. */
int job_failed(job *j, unsigned generation, char *reason, size_t reason_bytes);

/* Finds or publishes a unit under the job's mutex. Returns the published
 * layout (the caller's is freed if an equal one exists), or NULL with
 * *conflict = 1 if the name exists with a different layout. */
unit_layout *job_publish_unit(job *j, unit_layout *layout, int *existed, int *conflict);
unit_layout *job_unit(job *j, uint32_t unit_id);
/* The published unit named name, or NULL (takes the job's mutex). */
unit_layout *job_unit_named(job *j, const char *name);
/* A copy of the unit table, in id order, taken under the job's mutex (the
 * layouts are immutable once published, so only the table is copied); the
 * caller frees it. NULL if out of memory; *n is set either way. */
unit_layout **job_units_copy(job *j, uint32_t *n);

#endif /* ZEROD_JOB_H */
