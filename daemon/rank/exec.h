/* exec: one ordered executor per (job, rank) (docs/architecture.md).
 *
 * The loop thread turns requests into exec_ops and submits them; the rank's
 * executor thread runs them in submission order (kernels from kernels/ and
 * the blocking collectives from comm.h), encodes the reply frame itself and
 * hands the op back to the loop through the daemon's completion queue.
 *
 * Determinism: every rank of a job runs the same sequence of ops, so every
 * decision that changes the collectives (cache hits, evictions, prefetches)
 * is a function of that sequence and never of timing. Cheap ops that issue
 * no collective (a gather served from cache, a release, a gradient buffer)
 * may run on the loop thread instead — exec_try_inline — but only while the
 * executor is idle (busy == 0), which orders them exactly as if queued, and
 * only when they touch no device memory (a GPU rank's device is the
 * executor thread's alone, device.h). */
#ifndef ZEROD_EXEC_H
#define ZEROD_EXEC_H

#include <protobuf-c/protobuf-c.h>
#include <stdint.h>

#include "ckpt.h"
#include "job.h"
#include "zerod/v1/ipc.pb-c.h"

typedef enum op_kind {
  OP_COMM_INIT,     /* build the communicator (generation op->generation) */
  OP_SESSION_BEGIN, /* a session attached to the rank (op->session_id) */
  OP_SESSION_END,   /* it left: release everything it held */
  OP_REGISTER,
  OP_GATHER,
  OP_PREFETCH, /* internal: prefetch after an inline gather */
  OP_RELEASE,
  OP_GRAD_BUFFER,
  OP_REDUCE,
  OP_STEP,
  OP_LOAD,       /* LOAD_UNIT: collective, like a registration with INIT_FROM_RANK0 */
  OP_READ_STATE, /* READ_STATE: collective, a unit's gathered fp32 array */
  OP_SET_GROUPS, /* SET_GROUPS: parameter groups (no collective: every rank the same) */
  OP_GRAD_NORM,  /* GRAD_NORM: collective, the accumulated gradients' global norm */
  OP_PIN,        /* read-only sessions only (reader.c) */
  OP_WATCH,      /* read-only sessions only: wait for a newer version (reader_watch.c) */
  OP_TRIM,       /* free unheld buffers (the job has no sessions) */
  OP_FREEZE,     /* the job is a base now: free what only training needs */
  /* Checkpoints (ckpt_node.h), op->ckpt_id naming the order: */
  OP_SAVE,           /* take the copy now if no worker is attached */
  OP_RESTORE_READ,   /* read and verify the rank's part of op->ckpt_source */
  OP_RESTORE_COMMIT, /* install what was read */
  OP_RESTORE_ABORT,  /* drop what was read */
  OP_CKPT_PARK,      /* CHECKPOINT: collective; the worker waits for the call (node/ckpt_call.c) */
  OP_CKPT_UNPARK,    /* internal: the call ended */
  OP_STOP,           /* destroy the communicator and exit the thread */
} op_kind;

/* The op kind's name ("gather", "step", ...), for reports. */
const char *exec_op_name(int kind);

typedef struct exec_op {
  struct exec_op *next;
  op_kind kind;
  rank_state *rank;        /* NULL for a read-only session's op (reader.c) */
  struct session *session; /* reply target; NULL for internal ops */
  uint64_t session_id;
  uint64_t request_id;
  uint8_t flags;
  ProtobufCMessage *request; /* owned */
  int in_fd;                 /* owned; -1 if none */
  unsigned generation;       /* OP_COMM_INIT: the new one; reader ops: the job's at submission */
  uint32_t prefetch_unit;
  int job_created;       /* OP_SESSION_BEGIN: the attach created the job */
  char *warning;         /* OP_SESSION_BEGIN: AttachReply.warning, owned; NULL if none */
  uint64_t ckpt_id;      /* checkpoint ops: the order's id */
  char *ckpt_source;     /* OP_RESTORE_READ: owned */
  int ckpt_format;       /* OP_RESTORE_READ: Zerod__V1__RestoreFormat */
  double made_at;        /* clock_now_s() when made: the request's arrival */
  uint64_t comm_busy_at; /* OP_STEP: the rank's comm_activity_busy_ns then */
  uint64_t ckpt_call;    /* OP_CKPT_PARK's result: which call of the job this is */
  uint64_t ckpt_step;    /* OP_CKPT_PARK's result: the step every rank is at */
  int ckpt_answered;     /* OP_CKPT_PARK: the call's answer is in the op */

  /* Result, filled by the handler. */
  int status;           /* Zerod__V1__Status */
  uint8_t *reply_frame; /* encoded frame to send, or NULL */
  size_t reply_bytes;
  int reply_fd; /* dup'd descriptor to pass with the frame, or -1 */
} exec_op;

/* Called on the executor thread when an op is done (the daemon queues it
 * for the loop); ctx is exec_settings.ctx. */
typedef void (*exec_complete_fn)(void *ctx, exec_op *op);

/* What a rank tells the node of its part in checkpoints, on the executor
 * thread (node/ckpt_node.h implements them, and says what each means). The
 * rank knows the save and restore orders only by id. */
typedef struct exec_ckpt_hooks {
  /* A save order reached a rank with a worker attached: its copy of
   * `bytes` will be taken at the end of a step to come. */
  void (*stage)(job *j, int rank, uint64_t id, uint64_t bytes);
  /* Memory staged for that copy, or NULL (the rank allocates its own). */
  void *(*staging)(job *j, int rank, uint64_t id, uint64_t bytes);
  /* The copy was taken (ownership of data and layout passes), or failed. */
  void (*saved)(job *j, int rank, uint64_t id, uint64_t step, void *data, uint64_t data_bytes,
                ckpt_manifest *layout, int64_t stall_ms);
  void (*save_failed)(job *j, int rank, uint64_t id, int code, const char *error);
  /* A restore's part read (committed 0) or installed (1), or failed. */
  void (*restore_report)(job *j, int rank, uint64_t id, int committed, uint64_t step, int code,
                         const char *error);
  /* Before a restore's read: brings what the source lacks on this node
   * (an in-memory save's files held by other nodes). NULL, or 0 or a
   * negative errno with err. */
  int (*restore_fetch)(job *j, uint64_t id, char *err, size_t err_bytes);
  /* In-memory redundancy (rank/replicate.c; NULL: none): the directory of
   * the copy of `step` (made), the copy of its file name to the node's
   * buddy, and the news that every rank completed that copy (older ones
   * may go). 0 or a negative errno with err. */
  int (*replica_dir)(job *j, uint64_t step, char *out, size_t out_bytes, char *err,
                     size_t err_bytes);
  int (*replica_push)(job *j, uint64_t step, const char *dir, const char *name, char *err,
                      size_t err_bytes);
  void (*replica_done)(job *j, int rank, uint64_t step);
} exec_ckpt_hooks;

/* How the ranks of a job run, set by whoever owns the job (the node
 * daemon: node/jobs.c) and shared by all its ranks; it outlives them. */
typedef struct exec_settings {
  exec_complete_fn complete;
  /* Called on the executor thread as it exits after OP_STOP (its
   * rank_state.stopped is set): the owner may join it now. */
  void (*stopped)(void *ctx);
  void *ctx;
  exec_ckpt_hooks ckpt;
  /* Where the ranks' shards live: "cuda" puts local rank i on GPU i
   * (device_cuda.c, NCCL); anything else (NULL, "cpu") keeps them in host
   * memory (device_host.c, Gloo). */
  const char *device;
  int threads_per_rank;
  int collective_timeout_ms;
  const char *comm_hostname;
  store *rendezvous;
  /* Where jobs with offload_optimizer nvme keep their tier files (a
   * canonical path; NULL: none may). */
  const char *nvme_dir;
  /* The node's cache of gathered base units (base_cache.h), shared by
   * every job on a base. */
  struct base_cache *base_cache;
} exec_settings;

exec_op *exec_op_new(op_kind kind, rank_state *rank);
void exec_op_free(exec_op *op);

/* Starts the rank's executor thread. Returns 0 or a negative errno. */
int exec_rank_start(rank_state *rank);
/* Queues op at the tail (loop thread). */
void exec_submit(exec_op *op);
/* Runs op on the calling (loop) thread if it needs no collective and the
 * executor is idle; returns 1 if it ran (the reply is in op), 0 if the
 * caller must submit it. May submit an OP_PREFETCH itself. */
int exec_try_inline(exec_op *op);
/* Drops queued ops (answering them UNAVAILABLE) and queues OP_STOP. Stop
 * every rank of a job before joining any: a rank blocked in a collective
 * wakes up when its peers close their communicators. */
void exec_rank_stop(rank_state *rank);
void exec_rank_join(rank_state *rank);
/* Makes the collective the rank is in (if any) fail now (loop thread): its
 * job failed elsewhere, and its peers may never come. The communicator is
 * broken; the job's reset builds the next. */
void exec_rank_abort_comm(rank_state *rank);
/* Frees the executor-owned state (after stop). */
void exec_rank_free(rank_state *rank);

/* ---- Replies, shared with reader.c and ipc.c ----------------------------- */

/* Encodes the reply (or nothing for NO_REPLY or an op without a session)
 * into op->reply_frame, with op->reply_fd as its descriptor if set. */
void exec_reply(exec_op *op, uint16_t type, const ProtobufCMessage *msg);
/* Encodes an Error reply and sets op->status; drops any reply or fd. */
void exec_error(exec_op *op, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Fills a RegisterUnitReply (initialised by the caller) with unit l of job
 * j: its id, name, sizes and tensor placements. The strings and shapes
 * point into l, which lives as long as the job. Returns 0 or -ENOMEM;
 * exec_unit_reply_free frees what it allocated. */
int exec_unit_reply(const job *j, const unit_layout *l, Zerod__V1__RegisterUnitReply *reply);
void exec_unit_reply_free(Zerod__V1__RegisterUnitReply *reply);

/* Fills an AttachReply's config (both messages initialised here) from the
 * job's config with the given learning rate and clipping. */
void exec_job_config(const job *j, double lr, double max_grad_norm, job_config_msg *out);

#endif /* ZEROD_EXEC_H */
