/* Executors: the ordered per-(job, rank) queue, the shard state and the
 * handlers of every request that reaches a rank (see exec.h); the rank's
 * buffers are pool.c's, and its memory and kernels are its device's
 * (device.h): host memory and the CPU drivers on a host rank, GPU memory
 * and the CUDA module on a GPU rank. The handlers are the same for both;
 * values that must be looked at on the host (initial values, outcome
 * codes, the gradient norm) are copied there explicitly. */
#include "exec.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "frame.h"
#include "ckpt_node.h"
#include "hostmem.h"
#include "log.h"
#include "pin.h"
#include "pool.h"
#include "rpc.h"
#include "shm.h"

static exec_settings settings = {.threads_per_rank = 1, .collective_timeout_ms = 60000};

void exec_configure(const exec_settings *s) {
  settings = *s;
}

exec_op *exec_op_new(op_kind kind, rank_state *rank) {
  exec_op *op = calloc(1, sizeof *op);
  if (op == NULL)
    return NULL;
  op->kind = kind;
  op->rank = rank;
  op->in_fd = -1;
  op->reply_fd = -1;
  return op;
}

void exec_op_free(exec_op *op) {
  if (op == NULL)
    return;
  if (op->request != NULL)
    protobuf_c_message_free_unpacked(op->request, NULL);
  if (op->in_fd >= 0)
    close(op->in_fd);
  if (op->reply_fd >= 0)
    close(op->reply_fd);
  free(op->reply_frame);
  free(op->ckpt_source);
  free(op->warning);
  free(op);
}

/* ------------------------------------------------------------------------ */
/* Replies                                                                  */
/* ------------------------------------------------------------------------ */

void exec_reply(exec_op *op, uint16_t type, const ProtobufCMessage *msg) {
  op->status = ZEROD__V1__STATUS__STATUS_OK;
  if (op->session == NULL || (op->flags & ZD_FRAME_F_NO_REPLY)) {
    if (op->reply_fd >= 0) {
      close(op->reply_fd);
      op->reply_fd = -1;
    }
    return;
  }
  unsigned nfds = op->reply_fd >= 0 ? 1 : 0;
  if (zd_frame_encode(type, op->request_id, 0, nfds, msg, &op->reply_frame, &op->reply_bytes) !=
      0) {
    op->reply_frame = NULL;
    op->status = ZEROD__V1__STATUS__STATUS_INTERNAL;
  }
}

void exec_error(exec_op *op, int status, const char *fmt, ...) {
  char message[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof message, fmt, ap);
  va_end(ap);
  op->status = status;
  if (op->reply_fd >= 0) {
    close(op->reply_fd);
    op->reply_fd = -1;
  }
  free(op->reply_frame);
  op->reply_frame = NULL;
  if (op->session == NULL)
    return;
  Zerod__V1__Error err = ZEROD__V1__ERROR__INIT;
  err.status = (Zerod__V1__Status)status;
  err.message = message;
  if (zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_ERROR, op->request_id, 0, 0, &err.base,
                      &op->reply_frame, &op->reply_bytes) != 0)
    op->reply_frame = NULL;
}

static Zerod__V1__Dtype proto_dtype(zk_dtype d) {
  switch (d) {
  case ZK_F32:
    return ZEROD__V1__DTYPE__DTYPE_F32;
  case ZK_BF16:
    return ZEROD__V1__DTYPE__DTYPE_BF16;
  case ZK_F16:
    return ZEROD__V1__DTYPE__DTYPE_F16;
  default:
    return ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED;
  }
}

int exec_unit_reply(const job *j, const unit_layout *l, Zerod__V1__RegisterUnitReply *reply) {
  Zerod__V1__TensorPlacement *placements = calloc(l->ntensors, sizeof *placements);
  Zerod__V1__TensorPlacement **ptrs = calloc(l->ntensors, sizeof *ptrs);
  if (placements == NULL || ptrs == NULL) {
    free(placements);
    free(ptrs);
    return -ENOMEM;
  }
  for (unsigned t = 0; t < l->ntensors; t++) {
    zerod__v1__tensor_placement__init(&placements[t]);
    placements[t].name = l->tensors[t].name;
    placements[t].n_shape = l->tensors[t].ndim;
    placements[t].shape = (uint64_t *)l->tensors[t].shape;
    placements[t].offset = l->tensors[t].offset;
    placements[t].numel = l->tensors[t].numel;
    ptrs[t] = &placements[t];
  }
  reply->unit_id = l->id;
  reply->name = l->name;
  reply->numel = l->numel;
  reply->padded_numel = l->padded_numel;
  reply->shard_numel = l->shard_numel;
  reply->n_tensors = l->ntensors;
  reply->tensors = ptrs;
  reply->working_dtype = proto_dtype(j->config.working_dtype);
  reply->grad_dtype = proto_dtype(j->config.working_dtype);
  return 0;
}

void exec_unit_reply_free(Zerod__V1__RegisterUnitReply *reply) {
  if (reply->tensors != NULL && reply->n_tensors > 0)
    free(reply->tensors[0]); /* the placements, one block */
  free(reply->tensors);
  reply->tensors = NULL;
  reply->n_tensors = 0;
}

void exec_job_config(const job *j, double lr, double max_grad_norm, Zerod__V1__JobConfig *config,
                     Zerod__V1__OptimizerConfig *opt) {
  const job_config *c = &j->config;
  zerod__v1__optimizer_config__init(opt);
  opt->kind = (Zerod__V1__OptimizerKind)c->optimizer;
  opt->lr = lr;
  opt->beta1 = c->beta1;
  opt->beta2 = c->beta2;
  opt->eps = c->eps;
  opt->weight_decay = c->weight_decay;
  opt->has_weight_decay = 1;
  opt->momentum = c->momentum;
  opt->dampening = c->dampening;
  opt->nesterov = c->nesterov;
  zerod__v1__job_config__init(config);
  config->optimizer = opt;
  config->working_dtype = proto_dtype(c->working_dtype);
  config->max_live_bytes = c->max_live_bytes;
  config->max_grad_norm = max_grad_norm;
}

/* Replaces the rank's communicator (NULL: none) and destroys the old one.
 * The swap is under comm_lock because exec_rank_stop, on the loop thread,
 * may be aborting the old one; once the lock is ours it is done, and it
 * will find only the new one. A communicator built while the rank is
 * stopping is aborted at once: what the executor runs with it before
 * OP_STOP (the step-count check of a build) must not wait for peers that
 * stop too. */
static void set_comm(rank_state *rs, comm *c) {
  pthread_mutex_lock(&rs->comm_lock);
  comm *old = rs->comm;
  rs->comm = c;
  if (c != NULL && atomic_load(&rs->stopping))
    comm_abort(c);
  pthread_mutex_unlock(&rs->comm_lock);
  comm_destroy(old);
}

/* Checks the job's failure state; answers ABORTED and returns 1 if failed. */
static int op_job_failed(rank_state *rs, exec_op *op) {
  char reason[512];
  if (!job_failed(rs->job, rs->generation, reason, sizeof reason) && rs->comm != NULL)
    return 0;
  if (rs->comm == NULL && !job_failed(rs->job, rs->generation, reason, sizeof reason))
    snprintf(reason, sizeof reason, "rank %d has no communicator", rs->rank);
  exec_error(op, ZEROD__V1__STATUS__STATUS_ABORTED, "job '%s' failed: %s", rs->job->name, reason);
  return 1;
}

/* Passes a device call's result through, noting a failure so that the
 * collective it belongs to reports the device's error (op_comm_failed). */
static int dev_call(rank_state *rs, int rc) {
  if (rc != 0)
    rs->failed_on_device = 1;
  return rc;
}

/* The rank's device failed (a GPU error is usually sticky, and the ranks'
 * states would drift apart): the job fails, and the op is answered. */
static void op_device_failed(rank_state *rs, exec_op *op, const char *what, int err) {
  job_fail(rs->job, rs->generation, "rank %d: %s: %s", rs->rank, what, device_last_error(rs->dev));
  char reason[512] = "";
  job_failed(rs->job, rs->generation, reason, sizeof reason);
  LOG_ERRORF("device failed", "job=%s rank=%d op=%s err=%d", rs->job->name, rs->rank, what, err);
  exec_error(op, ZEROD__V1__STATUS__STATUS_INTERNAL, "job '%s' failed: %s", rs->job->name, reason);
}

/* A collective failed: the job is failed for every rank (the communicator is
 * broken), and this op is answered with the reason. */
static void op_comm_failed(rank_state *rs, exec_op *op, const char *what, int err) {
  job_fail(rs->job, rs->generation, "rank %d: %s: %s", rs->rank, what,
           rs->failed_on_device ? device_last_error(rs->dev)
           : rs->comm != NULL   ? comm_last_error(rs->comm)
                                : strerror(-err));
  char reason[512] = "";
  job_failed(rs->job, rs->generation, reason, sizeof reason);
  if (atomic_load(&rs->stopping)) /* aborted by the daemon's stop, not a failure */
    LOG_INFOF("collective aborted; zerod is stopping", "job=%s rank=%d op=%s", rs->job->name,
              rs->rank, what);
  else
    LOG_ERRORF("collective failed", "job=%s rank=%d op=%s err=%d", rs->job->name, rs->rank, what,
               err);
  exec_error(op, ZEROD__V1__STATUS__STATUS_ABORTED, "job '%s' failed: %s", rs->job->name, reason);
}

/* ------------------------------------------------------------------------ */
/* Buffers                                                                  */
/* ------------------------------------------------------------------------ */

/* Bytes of a unit's gathered or gradient buffer (working precision). */
static uint64_t unit_buffer_bytes(const rank_state *rs, const unit_layout *l) {
  return l->padded_numel * zk_dtype_size(rs->job->config.working_dtype);
}

/* Describes the buffer to the session the first time it gets it: a host
 * buffer's descriptor goes with the reply frame (op->reply_fd); a GPU
 * buffer's CUDA IPC handles go in *cuda, which the caller attaches to the
 * reply when this returns 1 for a GPU rank. Returns 1 if the session is
 * told now, 0 if it was before, or -1 with the op answered. */
static int reply_buffer(rank_state *rs, exec_op *op, pool_buf *b, Zerod__V1__CudaBuffer *cuda) {
  if (b->sent_session == op->session_id)
    return 0;
  if (!device_is_host(rs->dev)) {
    cuda->mem_handle.data = b->buf.mem_handle;
    cuda->mem_handle.len = sizeof b->buf.mem_handle;
    cuda->device = rs->dev->ordinal;
    cuda->event_handle.data = b->buf.event_handle;
    cuda->event_handle.len = sizeof b->buf.event_handle;
    b->sent_session = op->session_id;
    return 1;
  }
  op->reply_fd = dup(b->buf.fd);
  if (op->reply_fd < 0) {
    /* The buffer is already counted as held on this rank and on its peers;
     * rather than let their accounting drift apart, the job stops here (and
     * resets when its workers have left). */
    int err = errno;
    job_fail(rs->job, rs->generation, "rank %d: cannot pass a buffer to the worker: %s", rs->rank,
             strerror(err));
    exec_error(op, ZEROD__V1__STATUS__STATUS_ABORTED, "cannot pass the buffer to the worker: %s",
               strerror(err));
    return -1;
  }
  b->sent_session = op->session_id;
  return 1;
}

/* ------------------------------------------------------------------------ */
/* Shards                                                                   */
/* ------------------------------------------------------------------------ */

/* Zero-filled memory of the rank's device, or NULL. */
static void *zalloc(rank_state *rs, uint64_t bytes) {
  void *p = NULL;
  return device_alloc(rs->dev, bytes, &p) == 0 ? p : NULL;
}

static void shard_free(rank_state *rs, shard *sh) {
  if (sh->working != (void *)sh->master)
    device_free(rs->dev, sh->working);
  device_free(rs->dev, sh->master);
  device_free(rs->dev, sh->moment1);
  device_free(rs->dev, sh->moment2);
  device_free(rs->dev, sh->grad_acc);
  free(sh->trainable);
  free(sh->zero_ranges);
  memset(sh, 0, sizeof *sh);
  sh->gather_buf = -1;
  sh->grad_buf = -1;
}

static int ranges_push(shard_range **ranges, unsigned *n, uint64_t begin, uint64_t end) {
  if (begin >= end)
    return 0;
  if (*n > 0 && (*ranges)[*n - 1].end == begin) {
    (*ranges)[*n - 1].end = end;
    return 0;
  }
  shard_range *grown = realloc(*ranges, (*n + 1) * sizeof *grown);
  if (grown == NULL)
    return -ENOMEM;
  grown[*n].begin = begin;
  grown[*n].end = end;
  *ranges = grown;
  (*n)++;
  return 0;
}

static int shard_create(rank_state *rs, const unit_layout *l) {
  if (l->id >= rs->nshards) {
    uint32_t cap = rs->nshards ? rs->nshards : 16;
    while (cap <= l->id)
      cap *= 2;
    shard *grown = realloc(rs->shards, cap * sizeof *grown);
    if (grown == NULL)
      return -ENOMEM;
    for (uint32_t i = rs->nshards; i < cap; i++) {
      memset(&grown[i], 0, sizeof grown[i]);
      grown[i].gather_buf = -1;
      grown[i].grad_buf = -1;
    }
    rs->shards = grown;
    rs->nshards = cap;
  }
  shard *sh = &rs->shards[l->id];
  const job_config *c = &rs->job->config;
  uint64_t n = l->shard_numel;
  sh->master = zalloc(rs, n * 4);
  sh->grad_acc = zalloc(rs, n * 4);
  int need_m1 = c->optimizer != JOB_SGD || c->momentum != 0;
  sh->moment1 = need_m1 ? zalloc(rs, n * 4) : NULL;
  sh->moment2 = c->optimizer != JOB_SGD ? zalloc(rs, n * 4) : NULL;
  sh->working = c->working_dtype == ZK_F32 ? (void *)sh->master
                                           : zalloc(rs, n * zk_dtype_size(c->working_dtype));
  int err = 0;
  if (sh->master == NULL || sh->grad_acc == NULL || (need_m1 && sh->moment1 == NULL) ||
      (c->optimizer != JOB_SGD && sh->moment2 == NULL) || sh->working == NULL)
    err = -ENOMEM;
  /* Trainable ranges of this rank's shard, and the ranges of the whole flat
   * buffer that hold no trainable tensor (gaps, padding, frozen tensors):
   * gradients there are zeroed before a reduce. */
  uint64_t lo = (uint64_t)rs->rank * n, hi = lo + n, cursor = 0;
  for (unsigned t = 0; t < l->ntensors && err == 0; t++) {
    const tensor_layout *tl = &l->tensors[t];
    err = ranges_push(&sh->zero_ranges, &sh->nzero_ranges, cursor, tl->offset);
    if (tl->frozen) {
      if (err == 0)
        err = ranges_push(&sh->zero_ranges, &sh->nzero_ranges, tl->offset, tl->offset + tl->numel);
    } else {
      uint64_t b = tl->offset > lo ? tl->offset : lo;
      uint64_t e = tl->offset + tl->numel < hi ? tl->offset + tl->numel : hi;
      if (b < e && err == 0)
        err = ranges_push(&sh->trainable, &sh->ntrainable, b - lo, e - lo);
    }
    cursor = tl->offset + tl->numel;
  }
  if (err == 0)
    err = ranges_push(&sh->zero_ranges, &sh->nzero_ranges, cursor, l->padded_numel);
  if (err != 0) {
    shard_free(rs, sh);
    return err;
  }
  sh->present = 1;
  sh->gather_buf = -1;
  sh->grad_buf = -1;
  return 0;
}

static int grow_scratch(rank_state *rs, uint64_t numel, uint64_t shard_numel) {
  if (numel > rs->scratch_numel) {
    device_free(rs->dev, rs->scratch);
    rs->scratch = zalloc(rs, numel * 4);
    rs->scratch_numel = rs->scratch != NULL ? numel : 0;
    if (rs->scratch == NULL)
      return -ENOMEM;
  }
  if (shard_numel > rs->shard_scratch_numel) {
    device_free(rs->dev, rs->shard_scratch);
    rs->shard_scratch = zalloc(rs, shard_numel * 4);
    rs->shard_scratch_numel = rs->shard_scratch != NULL ? shard_numel : 0;
    if (rs->shard_scratch == NULL)
      return -ENOMEM;
  }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Collectives on host values                                               */
/* ------------------------------------------------------------------------ */

/* Outcome codes, step counts, layout descriptors and the gradient norm live
 * in host memory. A host rank's communicator (Gloo) takes them in place; a
 * GPU rank's (NCCL) takes device memory only, so they pass through a
 * staging area on the rank's device, copied there and back. A failed copy
 * is a failed collective: the job fails either way. */
static int staging_reserve(rank_state *rs, size_t bytes) {
  if (bytes <= rs->staging_bytes)
    return 0;
  device_free(rs->dev, rs->staging);
  rs->staging = NULL;
  rs->staging_bytes = 0;
  int rc = device_alloc(rs->dev, bytes, &rs->staging);
  if (rc == 0)
    rs->staging_bytes = bytes;
  return rc;
}

/* recv holds world_size * bytes_per_rank; this rank's part is taken from
 * recv + rank * bytes_per_rank (the in-place form of comm_all_gather). */
static int host_all_gather(rank_state *rs, void *recv, size_t bytes_per_rank) {
  uint8_t *mine = (uint8_t *)recv + (size_t)rs->rank * bytes_per_rank;
  size_t total = (size_t)rs->job->world_size * bytes_per_rank;
  if (device_is_host(rs->dev))
    return comm_all_gather(rs->comm, mine, recv, bytes_per_rank);
  int rc = dev_call(rs, staging_reserve(rs, total));
  uint8_t *staged_mine = (uint8_t *)rs->staging + (size_t)rs->rank * bytes_per_rank;
  if (rc == 0)
    rc = dev_call(rs, device_upload(rs->dev, staged_mine, mine, bytes_per_rank));
  if (rc == 0)
    rc = comm_all_gather(rs->comm, staged_mine, rs->staging, bytes_per_rank);
  if (rc == 0)
    rc = dev_call(rs, device_download(rs->dev, recv, rs->staging, total));
  return rc;
}

static int host_broadcast(rank_state *rs, void *buf, size_t bytes, int root) {
  if (device_is_host(rs->dev))
    return comm_broadcast(rs->comm, buf, bytes, root);
  int rc = dev_call(rs, staging_reserve(rs, bytes));
  if (rc == 0 && rs->rank == root)
    rc = dev_call(rs, device_upload(rs->dev, rs->staging, buf, bytes));
  if (rc == 0)
    rc = comm_broadcast(rs->comm, rs->staging, bytes, root);
  if (rc == 0 && rs->rank != root)
    rc = dev_call(rs, device_download(rs->dev, buf, rs->staging, bytes));
  return rc;
}

static int host_all_reduce_f64(rank_state *rs, double *buf, size_t count, comm_op op) {
  if (device_is_host(rs->dev))
    return comm_all_reduce(rs->comm, buf, count, COMM_F64, op);
  size_t bytes = count * sizeof *buf;
  int rc = dev_call(rs, staging_reserve(rs, bytes));
  if (rc == 0)
    rc = dev_call(rs, device_upload(rs->dev, rs->staging, buf, bytes));
  if (rc == 0)
    rc = comm_all_reduce(rs->comm, rs->staging, count, COMM_F64, op);
  if (rc == 0)
    rc = dev_call(rs, device_download(rs->dev, buf, rs->staging, bytes));
  return rc;
}

/* A counter-based normal generator: value k of a unit depends only on the
 * seed, the unit's name and k, so every rank computes its own slice and the
 * result does not depend on the world size. */
static uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static float seeded_normal(uint64_t key, uint64_t index) {
  uint64_t a = splitmix64(key ^ (index * 2 + 0) * 0xd1342543de82ef95ull);
  uint64_t b = splitmix64(key ^ (index * 2 + 1) * 0xd1342543de82ef95ull);
  double u1 = ((double)(a >> 11) + 1.0) / 9007199254740993.0; /* (0, 1] */
  double u2 = (double)(b >> 11) / 9007199254740992.0;
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static uint64_t fnv1a(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s != '\0'; s++)
    h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return h;
}

/* Casts the master shard into the working copy (bf16 working precision). */
static int refresh_working(rank_state *rs, const unit_layout *l, shard *sh) {
  if (sh->working == (void *)sh->master)
    return 0;
  return device_cast(rs->dev, sh->working, rs->job->config.working_dtype, sh->master, ZK_F32,
                     l->shard_numel);
}

/* ------------------------------------------------------------------------ */
/* Gather order and prefetch                                                */
/* ------------------------------------------------------------------------ */

static void order_record(rank_state *rs, uint32_t unit_id) {
  if (rs->order_complete || rs->order_len >= (1u << 20))
    return;
  if (rs->order_len == rs->order_cap) {
    size_t cap = rs->order_cap ? rs->order_cap * 2 : 64;
    uint32_t *grown = realloc(rs->order, cap * sizeof *grown);
    if (grown == NULL)
      return;
    rs->order = grown;
    rs->order_cap = cap;
  }
  rs->order[rs->order_len++] = unit_id;
}

/* The unit that followed unit_id in the recorded order, from the cursor on;
 * -1 if there is none. */
static int64_t order_next(rank_state *rs, uint32_t unit_id) {
  if (!rs->order_complete || rs->order_len == 0)
    return -1;
  for (size_t k = 0; k < rs->order_len; k++) {
    size_t pos = (rs->order_cursor + k) % rs->order_len;
    if (rs->order[pos] == unit_id) {
      rs->order_cursor = (pos + 1) % rs->order_len;
      return rs->order[rs->order_cursor];
    }
  }
  return -1;
}

/* Fills a gathered buffer with the unit's working copy of every rank. On a
 * GPU rank the stream first waits for the worker's last use of the buffer
 * (its reads of the values gathered there before) and records the buffer's
 * event once the values are in; the values are complete when this returns
 * (the collective waits for itself, the rest is synchronised). */
static int fill_gathered(rank_state *rs, const unit_layout *l, shard *sh, pool_buf *b) {
  size_t elem = zk_dtype_size(rs->job->config.working_dtype);
  size_t shard_bytes = l->shard_numel * elem;
  uint8_t *base = b->buf.base;
  uint8_t *mine = base + (size_t)rs->rank * shard_bytes;
  int rc = dev_call(rs, device_buffer_wait(rs->dev, &b->buf));
  if (rc == 0)
    rc = dev_call(rs, device_copy(rs->dev, mine, sh->working, shard_bytes));
  if (rc == 0)
    rc = comm_all_gather(rs->comm, mine, base, shard_bytes);
  if (rc == 0)
    rc = dev_call(rs, device_buffer_publish(rs->dev, &b->buf));
  if (rc == 0)
    rc = dev_call(rs, device_sync(rs->dev));
  return rc;
}

static void prefetch_unit(rank_state *rs, uint32_t unit_id) {
  unit_layout *l = job_unit(rs->job, unit_id);
  if (l == NULL || unit_id >= rs->nshards || !rs->shards[unit_id].present)
    return;
  shard *sh = &rs->shards[unit_id];
  if (sh->gather_buf >= 0 && rs->bufs[sh->gather_buf].valid_version == rs->version)
    return;
  if (job_failed(rs->job, rs->generation, NULL, 0) || rs->comm == NULL)
    return;
  char why[256];
  int64_t slot =
      pool_acquire(rs, BUF_GATHER, unit_buffer_bytes(rs, l), l->name, 1, why, sizeof why);
  if (slot < 0)
    return;
  pool_buf *b = &rs->bufs[slot];
  int err = fill_gathered(rs, l, sh, b);
  if (err != 0) {
    job_fail(rs->job, rs->generation, "rank %d: prefetch of unit '%s': %s", rs->rank, l->name,
             rs->failed_on_device ? device_last_error(rs->dev) : comm_last_error(rs->comm));
    return;
  }
  b->unit = unit_id;
  b->valid_version = rs->version;
  b->last_use = ++rs->tick;
  sh->gather_buf = slot;
  LOG_DEBUGF("prefetched", "job=%s rank=%d unit=%u version=%llu", rs->job->name, rs->rank, unit_id,
             (unsigned long long)rs->version);
}

/* ------------------------------------------------------------------------ */
/* Handlers                                                                 */
/* ------------------------------------------------------------------------ */

static shard *lookup_shard(rank_state *rs, exec_op *op, uint32_t unit_id, unit_layout **out) {
  unit_layout *l = job_unit(rs->job, unit_id);
  if (l == NULL || unit_id >= rs->nshards || !rs->shards[unit_id].present) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_NOT_FOUND, "unknown unit id %u (register it first)",
               unit_id);
    return NULL;
  }
  *out = l;
  return &rs->shards[unit_id];
}

static void attach_dropped(rank_state *rs, uint32_t **ids, size_t *n) {
  *ids = rs->dropped_ids;
  *n = rs->ndropped;
}

/* Returns 1 if handled, 0 if it needs the executor (a cache miss inline). */
static int handle_gather(rank_state *rs, exec_op *op, int inline_only, int64_t *prefetch_next) {
  Zerod__V1__GatherRequest *req = (Zerod__V1__GatherRequest *)op->request;
  *prefetch_next = -1;
  if (op_job_failed(rs, op))
    return 1;
  unit_layout *l;
  shard *sh = lookup_shard(rs, op, req->unit_id, &l);
  if (sh == NULL)
    return 1;
  if (sh->gather_held) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
               "unit '%s' is already gathered by this session; release it first", l->name);
    return 1;
  }
  int hit = sh->gather_buf >= 0 && rs->bufs[sh->gather_buf].valid_version == rs->version;
  if (!hit) {
    if (inline_only)
      return 0;
    char why[256];
    int64_t slot =
        pool_acquire(rs, BUF_GATHER, unit_buffer_bytes(rs, l), l->name, 0, why, sizeof why);
    if (slot < 0) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "%s", why);
      return 1;
    }
    int err = fill_gathered(rs, l, sh, &rs->bufs[slot]);
    if (err != 0) {
      op_comm_failed(rs, op, "all_gather", err);
      return 1;
    }
    rs->bufs[slot].unit = req->unit_id;
    rs->bufs[slot].valid_version = rs->version;
    sh->gather_buf = slot;
  }
  pool_buf *b = &rs->bufs[sh->gather_buf];
  pool_ref(rs, b);
  sh->gather_held = 1;
  order_record(rs, req->unit_id);
  Zerod__V1__CudaBuffer cuda = ZEROD__V1__CUDA_BUFFER__INIT;
  int first = reply_buffer(rs, op, b, &cuda);
  if (first < 0)
    return 1;
  Zerod__V1__GatherReply reply = ZEROD__V1__GATHER_REPLY__INIT;
  reply.unit_id = req->unit_id;
  reply.buffer_id = b->id;
  reply.buffer_bytes = b->buf.bytes;
  reply.version = rs->version;
  if (first && !device_is_host(rs->dev))
    reply.cuda = &cuda;
  attach_dropped(rs, &reply.dropped_buffer_ids, &reply.n_dropped_buffer_ids);
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, &reply.base);
  if (op->reply_frame != NULL)
    rs->ndropped = 0;
  *prefetch_next = order_next(rs, req->unit_id);
  return 1;
}

static void handle_release(rank_state *rs, exec_op *op) {
  Zerod__V1__ReleaseRequest *req = (Zerod__V1__ReleaseRequest *)op->request;
  unit_layout *l;
  shard *sh = lookup_shard(rs, op, req->unit_id, &l);
  if (sh == NULL)
    return;
  if (!sh->gather_held || sh->gather_buf < 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
               "release of unit '%s', which this session does not hold", l->name);
    return;
  }
  pool_unref(rs, &rs->bufs[sh->gather_buf]);
  sh->gather_held = 0;
  Zerod__V1__ReleaseReply reply = ZEROD__V1__RELEASE_REPLY__INIT;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY, &reply.base);
}

/* Returns 1 if handled, 0 if it needs the executor (inline, a GPU rank
 * that must allocate the buffer on its device). */
static int handle_grad_buffer(rank_state *rs, exec_op *op, int inline_only) {
  Zerod__V1__GradBufferRequest *req = (Zerod__V1__GradBufferRequest *)op->request;
  if (op_job_failed(rs, op))
    return 1;
  unit_layout *l;
  shard *sh = lookup_shard(rs, op, req->unit_id, &l);
  if (sh == NULL)
    return 1;
  if (sh->grad_buf < 0) {
    if (inline_only && !device_is_host(rs->dev))
      return 0;
    char why[256];
    int64_t slot =
        pool_acquire(rs, BUF_GRAD, unit_buffer_bytes(rs, l), l->name, 0, why, sizeof why);
    if (slot < 0) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "%s", why);
      return 1;
    }
    rs->bufs[slot].unit = req->unit_id;
    pool_ref(rs, &rs->bufs[slot]);
    sh->grad_buf = slot;
  }
  pool_buf *b = &rs->bufs[sh->grad_buf];
  Zerod__V1__CudaBuffer cuda = ZEROD__V1__CUDA_BUFFER__INIT;
  int first = reply_buffer(rs, op, b, &cuda);
  if (first < 0)
    return 1;
  Zerod__V1__GradBufferReply reply = ZEROD__V1__GRAD_BUFFER_REPLY__INIT;
  reply.unit_id = req->unit_id;
  reply.buffer_id = b->id;
  reply.buffer_bytes = b->buf.bytes;
  if (first && !device_is_host(rs->dev))
    reply.cuda = &cuda;
  attach_dropped(rs, &reply.dropped_buffer_ids, &reply.n_dropped_buffer_ids);
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY, &reply.base);
  if (op->reply_frame != NULL)
    rs->ndropped = 0;
  return 1;
}

static void handle_reduce(rank_state *rs, exec_op *op) {
  Zerod__V1__ReduceRequest *req = (Zerod__V1__ReduceRequest *)op->request;
  if (op_job_failed(rs, op))
    return;
  unit_layout *l;
  shard *sh = lookup_shard(rs, op, req->unit_id, &l);
  if (sh == NULL)
    return;
  if (sh->grad_buf < 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
               "reduce of unit '%s' without a gradient buffer (ask for it with grad_buffer first)",
               l->name);
    return;
  }
  pool_buf *b = &rs->bufs[sh->grad_buf];
  if (grow_scratch(rs, rs->job->config.working_dtype == ZK_F32 ? 0 : l->padded_numel,
                   l->shard_numel) != 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory for reduce");
    return;
  }
  /* fp32 gradients are reduced in the worker's buffer itself (its contents
   * are undefined after the reduce, as documented); lower precisions are
   * widened first so the sum is taken in fp32. On a GPU rank the stream
   * first waits for the worker's "gradient written" record of the buffer's
   * event, and records it again once the daemon has read the buffer. */
  device *dev = rs->dev;
  float *send = b->buf.base;
  int err = device_buffer_wait(dev, &b->buf);
  if (err == 0 && rs->job->config.working_dtype != ZK_F32) {
    err = device_cast(dev, rs->scratch, ZK_F32, b->buf.base, rs->job->config.working_dtype,
                      l->padded_numel);
    send = rs->scratch;
  }
  for (unsigned k = 0; k < sh->nzero_ranges && err == 0; k++)
    err = device_zero(dev, send + sh->zero_ranges[k].begin,
                      (sh->zero_ranges[k].end - sh->zero_ranges[k].begin) * sizeof(float));
  if (err != 0) {
    op_device_failed(rs, op, "reduce", err);
    return;
  }
  err = comm_reduce_scatter_f32(rs->comm, send, rs->shard_scratch, l->shard_numel);
  if (err != 0) {
    op_comm_failed(rs, op, "reduce_scatter", err);
    return;
  }
  err = device_accumulate(dev, sh->grad_acc, rs->shard_scratch, l->shard_numel);
  if (err == 0)
    err = device_buffer_publish(dev, &b->buf);
  if (err == 0)
    err = device_sync(dev);
  if (err != 0) {
    op_device_failed(rs, op, "reduce", err);
    return;
  }
  pool_unref(rs, b);
  b->unit = -1;
  sh->grad_buf = -1;
  Zerod__V1__ReduceReply reply = ZEROD__V1__REDUCE_REPLY__INIT;
  reply.unit_id = req->unit_id;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_REDUCE_REPLY, &reply.base);
}

/* Every PROGRESS_EVERY_STEPS steps rank 0 logs where the job is and how
 * fast it goes, so an operator sees training progress in the daemon's log
 * without asking the workers. */
#define PROGRESS_EVERY_STEPS 100

static double monotonic_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void log_progress(rank_state *rs, double grad_norm) {
  if (rs->rank != 0)
    return;
  double now = monotonic_s();
  if (rs->progress_since_s == 0) {
    rs->progress_since_s = now;
    rs->progress_since_step = rs->step;
    return;
  }
  if (rs->step % PROGRESS_EVERY_STEPS != 0)
    return;
  double elapsed = now - rs->progress_since_s;
  double rate = elapsed > 0 ? (double)(rs->step - rs->progress_since_step) / elapsed : 0;
  LOG_INFOF("job progress",
            "job=%s step=%llu grad_norm=%.4g lr=%g steps_per_s=%.2f live_bytes=%llu", rs->job->name,
            (unsigned long long)rs->step, grad_norm, rs->lr, rate,
            (unsigned long long)rs->live_bytes);
  rs->progress_since_s = now;
  rs->progress_since_step = rs->step;
}

/* ------------------------------------------------------------------------ */
/* Checkpoints: the rank's copy for a save                                  */
/* ------------------------------------------------------------------------ */

/* Copies the rank's shard state (master weights, then the moments the
 * optimizer keeps, unit by unit: the shard file's data order, ckpt.h) to
 * host memory and hands it to its writer (ckpt_node.c). The executor runs
 * nothing else meanwhile, so no step changes the state being copied; this
 * is all the time a save holds training up. */
/* The states a save copies, by ckpt_state: the master weights and the
 * moments the optimizer keeps. Returns how many. */
static int snapshot_states(const job_config *c, int want[3]) {
  want[0] = 1;
  want[1] = c->optimizer != JOB_SGD || c->momentum != 0;
  want[2] = c->optimizer != JOB_SGD;
  return want[0] + want[1] + want[2];
}

/* The units of which rank rs holds a shard, in the job's order, and the
 * bytes of its copy for a save. NULL if out of memory. */
static unit_layout **snapshot_units(rank_state *rs, unsigned *n, uint64_t *bytes) {
  job *j = rs->job;
  int want[3];
  int nstates = snapshot_states(&j->config, want);
  pthread_mutex_lock(&j->mutex);
  uint32_t nunits = j->nunits;
  unit_layout **units = malloc((nunits ? nunits : 1) * sizeof *units);
  if (units != NULL && nunits > 0)
    memcpy(units, j->units, nunits * sizeof *units);
  pthread_mutex_unlock(&j->mutex);
  *n = 0;
  *bytes = 0;
  for (uint32_t u = 0; units != NULL && u < nunits; u++)
    if (u < rs->nshards && rs->shards[u].present) {
      units[(*n)++] = units[u];
      *bytes += units[u]->shard_numel * 4 * (uint64_t)nstates;
    }
  return units;
}

static void take_snapshot(rank_state *rs, uint64_t id) {
  job *j = rs->job;
  rs->ckpt_taken = id;
  char reason[512] = "";
  if (job_failed(j, rs->generation, reason, sizeof reason)) {
    char why[600];
    snprintf(why, sizeof why, "job '%s' failed: %s", j->name, reason);
    ckpt_node_save_failed(j, rs->rank, id, RPC_FAILED_PRECONDITION, why);
    return;
  }
  double t0 = monotonic_s();
  int want[3];
  snapshot_states(&j->config, want);
  unsigned n = 0;
  uint64_t bytes = 0;
  unit_layout **units = snapshot_units(rs, &n, &bytes);
  /* Memory the rank's writer faulted in while the step ran, if the order
   * came early enough (ckpt_node_stage), else fresh. */
  uint8_t *data = units != NULL ? ckpt_node_staging(j, rs->rank, id, bytes) : NULL;
  int staged = data != NULL;
  if (units != NULL && data == NULL)
    data = hostmem_shared_alloc(bytes);
  int rc = data != NULL ? 0 : -ENOMEM;
  uint8_t *at = data;
  for (unsigned k = 0; rc == 0 && k < n; k++) {
    shard *sh = &rs->shards[units[k]->id];
    size_t b = units[k]->shard_numel * sizeof(float);
    const float *states[3] = {sh->master, sh->moment1, sh->moment2};
    for (int s = 0; rc == 0 && s < 3; s++) {
      if (!want[s])
        continue;
      rc = device_download(rs->dev, at, states[s], b);
      at += b;
    }
  }
  ckpt_manifest *layout = NULL;
  if (rc == 0 && rs->rank == 0 &&
      (layout = ckpt_layout_of(j, units, n, rs->step, rs->version)) == NULL)
    rc = -ENOMEM;
  free(units);
  if (rc != 0) {
    hostmem_shared_unref(data);
    char why[600];
    snprintf(why, sizeof why, "copying the shard state: %s",
             rc == -ENOMEM ? "out of host memory" : device_last_error(rs->dev));
    ckpt_node_save_failed(j, rs->rank, id, RPC_RESOURCE_EXHAUSTED, why);
    return;
  }
  int64_t stall_ms = (int64_t)((monotonic_s() - t0) * 1000);
  LOG_DEBUGF("shard copied for a save",
             "job=%s rank=%d save=%llu step=%llu bytes=%llu staged=%d ms=%lld", j->name, rs->rank,
             (unsigned long long)id, (unsigned long long)rs->step, (unsigned long long)bytes,
             staged, (long long)stall_ms);
  ckpt_node_saved(j, rs->rank, id, rs->step, data, bytes, layout, stall_ms);
}

static void handle_step(rank_state *rs, exec_op *op) {
  Zerod__V1__StepRequest *req = (Zerod__V1__StepRequest *)op->request;
  if (op_job_failed(rs, op))
    return;
  if ((req->set_lr && !(req->lr > 0 && isfinite(req->lr))) ||
      (req->set_max_grad_norm && !(req->max_grad_norm >= 0)) ||
      !(req->grad_scale >= 0 && isfinite(req->grad_scale))) {
    /* No "step: " here: the client names the request it failed (libzerod
     * prefixes "step: "), as for every other request's errors. */
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
               "lr must be > 0, max_grad_norm >= 0 and grad_scale >= 0 and finite");
    return;
  }
  if (req->set_lr)
    rs->lr = req->lr;
  if (req->set_max_grad_norm)
    rs->max_grad_norm = req->max_grad_norm;
  double grad_scale = req->grad_scale == 0 ? 1.0 : req->grad_scale;

  /* The global norm: every rank's partial sum of squares over its shards
   * (in unit order, each sum deterministic), all-reduced. */
  device *dev = rs->dev;
  double local_sumsq = 0;
  int err = device_sumsq_begin(dev);
  for (uint32_t u = 0; u < rs->nshards && err == 0; u++) {
    shard *sh = &rs->shards[u];
    if (sh->present)
      err = device_sumsq_add(dev, sh->grad_acc, job_unit(rs->job, u)->shard_numel);
  }
  if (err == 0)
    err = device_sumsq_end(dev, &local_sumsq);
  if (err != 0) {
    op_device_failed(rs, op, "step (gradient norm)", err);
    return;
  }
  /* The same all-reduce agrees on a checkpoint: a rank that knows of a
   * save order adds its id and a count, and every rank takes its copy at
   * the end of this step (ckpt_node.h). The coordinator has one save of a
   * job in flight at a time, so the ids summed are all the same. */
  uint64_t pending = atomic_load(&rs->ckpt_pending);
  if (pending <= rs->ckpt_taken)
    pending = 0;
  double reduced[3] = {local_sumsq, (double)pending, pending != 0 ? 1.0 : 0.0};
  err = host_all_reduce_f64(rs, reduced, 3, COMM_SUM);
  if (err != 0) {
    op_comm_failed(rs, op, "all_reduce (gradient norm)", err);
    return;
  }
  local_sumsq = reduced[0];
  uint64_t save_id = reduced[2] > 0 ? (uint64_t)llround(reduced[1] / reduced[2]) : 0;
  double grad_norm = sqrt(local_sumsq) / grad_scale;
  int skipped = !isfinite(local_sumsq);
  if (!skipped) {
    double coef = 1.0;
    if (rs->max_grad_norm > 0) {
      coef = rs->max_grad_norm / (grad_norm + 1e-6);
      if (coef > 1.0)
        coef = 1.0;
    }
    const job_config *c = &rs->job->config;
    int64_t step_number = (int64_t)rs->step + 1;
    /* The version goes up here, after the all-reduce: every rank has
     * finished its previous write, so ranks stay within one version. A
     * pin of the current version gets this rank's slices first. */
    pin_begin_write(rs);
    for (uint32_t u = 0; u < rs->nshards; u++) {
      shard *sh = &rs->shards[u];
      if (!sh->present)
        continue;
      for (unsigned k = 0; k < sh->ntrainable; k++) {
        uint64_t b = sh->trainable[k].begin, n = sh->trainable[k].end - b;
        size_t welem = zk_dtype_size(c->working_dtype);
        void *working =
            sh->working == (void *)sh->master ? NULL : (uint8_t *)sh->working + b * welem;
        zk_dtype wdtype = working != NULL ? c->working_dtype : ZK_DTYPE_NONE;
        int rc;
        if (c->optimizer == JOB_SGD) {
          zk_sgd_hparams hp = {.lr = rs->lr,
                               .momentum = c->momentum,
                               .dampening = c->dampening,
                               .weight_decay = c->weight_decay,
                               .nesterov = c->nesterov,
                               .step = step_number,
                               .grad_scale = coef / grad_scale};
          rc = device_sgd_step(dev, &hp, sh->master + b, sh->moment1 ? sh->moment1 + b : NULL,
                               sh->grad_acc + b, working, wdtype, n);
        } else {
          zk_adam_hparams hp = {.lr = rs->lr,
                                .beta1 = c->beta1,
                                .beta2 = c->beta2,
                                .eps = c->eps,
                                .weight_decay = c->weight_decay,
                                .decoupled_weight_decay = c->optimizer == JOB_ADAMW,
                                .step = step_number,
                                .grad_scale = coef / grad_scale};
          rc = device_adam_step(dev, &hp, sh->master + b, sh->moment1 + b, sh->moment2 + b,
                                sh->grad_acc + b, working, wdtype, n);
        }
        if (rc != 0) {
          /* The hyper-parameters were checked at creation; a failure here
           * would leave ranks inconsistent, so the job stops. */
          device_sync(dev);
          pin_end_write(rs);
          op_device_failed(rs, op, "optimizer step", rc);
          return;
        }
      }
    }
    /* Readers copy the working copies once the write lock is released. */
    int rc = device_sync(dev);
    pin_end_write(rs);
    if (rc != 0) {
      op_device_failed(rs, op, "optimizer step", rc);
      return;
    }
    rs->step++;
    log_progress(rs, grad_norm);
  }
  for (uint32_t u = 0; u < rs->nshards && err == 0; u++) {
    shard *sh = &rs->shards[u];
    if (sh->present)
      err = device_zero(dev, sh->grad_acc, job_unit(rs->job, u)->shard_numel * sizeof(float));
  }
  if (err == 0)
    err = device_sync(dev);
  if (err != 0) {
    op_device_failed(rs, op, "step (clearing the gradients)", err);
    return;
  }
  rs->order_complete = 1;
  if (save_id > rs->ckpt_taken)
    take_snapshot(rs, save_id);
  Zerod__V1__StepReply reply = ZEROD__V1__STEP_REPLY__INIT;
  reply.step = rs->step;
  reply.version = rs->version;
  reply.grad_norm = grad_norm;
  reply.skipped = skipped;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, &reply.base);
}

/* Rank 0 lays its packed fp32 values of unit l (the tensors back to back,
 * as a worker sends them) out in the flat buffer, gaps and padding zero,
 * and broadcasts it into every rank's scratch (padded_numel floats, grown
 * by the caller); every rank then takes its slice from there. A host rank 0
 * lays the values out in its scratch directly, a GPU rank 0 in host memory
 * that it then copies to its device. */
static int broadcast_values(rank_state *rs, const unit_layout *l, const float *packed) {
  size_t bytes = l->padded_numel * sizeof(float);
  int rc = 0;
  if (rs->rank == 0) {
    float *layout = device_is_host(rs->dev) ? rs->scratch : malloc(bytes ? bytes : 1);
    if (layout == NULL)
      rc = -ENOMEM;
    if (rc == 0) {
      memset(layout, 0, bytes);
      uint64_t at = 0;
      for (unsigned t = 0; t < l->ntensors; t++) {
        memcpy(layout + l->tensors[t].offset, packed + at, l->tensors[t].numel * sizeof(float));
        at += l->tensors[t].numel;
      }
    }
    if (rc == 0 && layout != rs->scratch)
      rc = device_upload(rs->dev, rs->scratch, layout, bytes);
    if (layout != rs->scratch)
      free(layout);
    dev_call(rs, rc);
  }
  /* A rank 0 that failed above still takes part, so that its peers do not
   * wait for it; the job fails all the same. */
  int comm_rc = comm_broadcast(rs->comm, rs->scratch, bytes, 0);
  return rc != 0 ? rc : comm_rc;
}

/* The initial values of INIT_SEEDED_NORMAL for this rank's slice of unit
 * l, into its (zero-filled) master shard: on a GPU rank they are computed
 * in host memory and copied over. */
static int seed_master(rank_state *rs, const unit_layout *l, shard *sh, uint64_t seed,
                       double init_std) {
  uint64_t lo = (uint64_t)rs->rank * l->shard_numel;
  float *values = device_is_host(rs->dev) ? sh->master : calloc(l->shard_numel + 1, sizeof(float));
  if (values == NULL)
    return -ENOMEM;
  uint64_t key = splitmix64(seed) ^ fnv1a(l->name);
  for (unsigned t = 0; t < l->ntensors; t++) {
    const tensor_layout *tl = &l->tensors[t];
    uint64_t b = tl->offset > lo ? tl->offset : lo;
    uint64_t e =
        tl->offset + tl->numel < lo + l->shard_numel ? tl->offset + tl->numel : lo + l->shard_numel;
    for (uint64_t k = b; k < e; k++)
      values[k - lo] = (float)init_std * seeded_normal(key, k);
  }
  int rc = 0;
  if (values != sh->master) {
    rc = device_upload(rs->dev, sh->master, values, l->shard_numel * sizeof(float));
    free(values);
  }
  return rc;
}

/* The first chunk index where two descriptors differ, or -1 if equal. */
static int32_t descriptor_diff(const uint8_t *a, size_t a_bytes, const uint8_t *b, size_t b_bytes) {
  size_t pa = 0, pb = 0;
  for (int32_t chunk = 0;; chunk++) {
    if (pa >= a_bytes && pb >= b_bytes)
      return -1;
    if (pa + 4 > a_bytes || pb + 4 > b_bytes)
      return chunk;
    uint32_t la = 0, lb = 0;
    for (int i = 0; i < 4; i++) {
      la |= (uint32_t)a[pa + (size_t)i] << (8 * i);
      lb |= (uint32_t)b[pb + (size_t)i] << (8 * i);
    }
    if (la != lb || pa + 4 + la > a_bytes || pb + 4 + lb > b_bytes ||
        memcmp(a + pa + 4, b + pb + 4, la) != 0)
      return chunk;
    pa += 4 + la;
    pb += 4 + lb;
  }
}

/* Describes tensor `index` of a layout for an error message. */
static void describe_tensor(const unit_layout *l, int32_t index, char *out, size_t out_bytes) {
  if (l == NULL || index < 0 || (unsigned)index >= l->ntensors) {
    snprintf(out, out_bytes, "(none)");
    return;
  }
  const tensor_layout *t = &l->tensors[index];
  int n = snprintf(out, out_bytes, "'%s' shape [", t->name);
  for (unsigned d = 0; d < t->ndim && n > 0 && (size_t)n < out_bytes; d++)
    n += snprintf(out + n, out_bytes - (size_t)n, "%s%llu", d ? "," : "",
                  (unsigned long long)t->shape[d]);
  if (n > 0 && (size_t)n < out_bytes)
    snprintf(out + n, out_bytes - (size_t)n, "]%s", t->frozen ? " frozen" : "");
}

static void handle_register(rank_state *rs, exec_op *op) {
  Zerod__V1__RegisterUnitRequest *req = (Zerod__V1__RegisterUnitRequest *)op->request;
  job *j = rs->job;
  unit_layout *mine = NULL;
  float *packed = NULL;
  uint8_t *root_desc = NULL;
  int root_desc_owned = 0;
  int32_t *codes = NULL;
  char err[512] = "";
  if (op_job_failed(rs, op))
    return;

  /* 1. The local layout. A local failure still takes part in the
   *    collectives below, so that the other ranks fail with it instead of
   *    waiting for this one. */
  unsigned nt = (unsigned)req->n_tensors;
  const char **names = calloc(nt ? nt : 1, sizeof *names);
  const uint64_t **shapes = calloc(nt ? nt : 1, sizeof *shapes);
  unsigned *ndims = calloc(nt ? nt : 1, sizeof *ndims);
  int *frozen = calloc(nt ? nt : 1, sizeof *frozen);
  int local_rc = -ENOMEM;
  int init = req->init == ZEROD__V1__INIT_MODE__INIT_UNSPECIFIED
                 ? ZEROD__V1__INIT_MODE__INIT_FROM_RANK0
                 : (int)req->init;
  uint64_t init_tag =
      (uint64_t)init ^
      (init == ZEROD__V1__INIT_MODE__INIT_SEEDED_NORMAL ? (req->seed * 31) ^ fnv1a("std") : 0);
  if (names != NULL && shapes != NULL && ndims != NULL && frozen != NULL) {
    for (unsigned t = 0; t < nt; t++) {
      names[t] = req->tensors[t]->name;
      shapes[t] = req->tensors[t]->shape;
      ndims[t] = (unsigned)req->tensors[t]->n_shape;
      frozen[t] = req->tensors[t]->frozen;
    }
    local_rc = unit_layout_build(req->name, nt, names, shapes, ndims, frozen, j->world_size,
                                 init_tag, &mine, err, sizeof err);
  }
  free(names);
  free(shapes);
  free(ndims);
  free(frozen);
  if (local_rc != 0 && err[0] == '\0')
    snprintf(err, sizeof err, "%s", strerror(-local_rc));

  /* 2. Rank 0 reads its initial values before anything is broadcast, so a
   *    bad descriptor fails the registration on every rank alike. */
  int32_t init_status = 0;
  if (rs->rank == 0 && local_rc == 0 && init == ZEROD__V1__INIT_MODE__INIT_FROM_RANK0) {
    if (op->in_fd < 0) {
      init_status = -EINVAL;
      snprintf(err, sizeof err,
               "INIT_FROM_RANK0 needs rank 0's initial values (one memfd with %llu floats)",
               (unsigned long long)mine->packed_numel);
    } else {
      packed = malloc(mine->packed_numel * sizeof(float) + 1);
      init_status =
          packed == NULL ? -ENOMEM : shm_read_fd(op->in_fd, packed, mine->packed_numel * 4);
      if (init_status != 0)
        snprintf(err, sizeof err, "reading rank 0's initial values (%llu bytes expected): %s",
                 (unsigned long long)mine->packed_numel * 4,
                 init_status == -EINVAL ? "file too short" : strerror(-init_status));
    }
  }

  /* 3. Rank 0's descriptor to everyone; every rank compares it with its
   *    own; the comparison results go to everyone. */
  struct {
    uint64_t desc_bytes;
    int32_t layout_ok;
    int32_t init_status;
  } head = {0, 0, 0};
  if (rs->rank == 0) {
    head.layout_ok = local_rc == 0;
    head.desc_bytes = local_rc == 0 ? mine->descriptor_bytes : 0;
    head.init_status = init_status;
  }
  int rc = host_broadcast(rs, &head, sizeof head, 0);
  if (rc == 0 && head.desc_bytes > (64u << 20))
    rc = -EPROTO;
  if (rc == 0 && head.desc_bytes > 0) {
    root_desc_owned = rs->rank != 0;
    root_desc = rs->rank == 0 ? mine->descriptor : malloc(head.desc_bytes);
    rc = root_desc == NULL ? -ENOMEM : host_broadcast(rs, root_desc, head.desc_bytes, 0);
  }
  /* Only once rank 0's descriptor is here: after a failed broadcast
   * (a peer that never came, a timeout) there is none to compare with. */
  int32_t my_code = local_rc != 0 ? -2
                                  : (rc == 0 && head.desc_bytes > 0
                                         ? descriptor_diff(mine->descriptor, mine->descriptor_bytes,
                                                           root_desc, head.desc_bytes)
                                         : -1);
  codes = calloc((size_t)j->world_size, sizeof *codes);
  if (rc == 0 && codes == NULL)
    rc = -ENOMEM;
  if (rc == 0) {
    codes[rs->rank] = my_code;
    rc = host_all_gather(rs, codes, sizeof *codes);
  }
  if (rc != 0) {
    op_comm_failed(rs, op, "register (layout exchange)", rc);
    goto done;
  }
  if (!head.layout_ok) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, "unit '%s': %s", req->name,
               rs->rank == 0 ? err : "rank 0's layout is invalid");
    goto done;
  }
  if (head.init_status != 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, "unit '%s': %s", req->name,
               rs->rank == 0 ? err : "rank 0's initial values are unusable");
    goto done;
  }
  for (int r = 0; r < j->world_size; r++) {
    if (codes[r] == -1)
      continue;
    if (r == rs->rank && codes[r] == -2) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, "unit '%s': %s", req->name, err);
    } else if (codes[r] == -2) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "unit '%s': the layout registered on rank %d is invalid", req->name, r);
    } else if (codes[r] == 0) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "unit layouts differ between ranks: rank %d registered a different unit name, "
                 "tensor count or initialisation than rank 0 (this rank: unit '%s' with %u "
                 "tensors)",
                 r, req->name, nt);
    } else {
      char here[320];
      describe_tensor(mine, codes[r] - 1, here, sizeof here);
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "unit '%s': layouts differ between ranks at tensor #%d: rank %d differs from "
                 "rank 0 (this rank %d has %s)",
                 req->name, codes[r] - 1, r, rs->rank, here);
    }
    goto done;
  }

  /* 4. Publish (or find) the unit; create this rank's shard. */
  int existed = 0, conflict = 0;
  unit_layout *l = job_publish_unit(j, mine, &existed, &conflict);
  if (l == NULL) {
    exec_error(op,
               conflict ? ZEROD__V1__STATUS__STATUS_ALREADY_EXISTS
                        : ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
               conflict ? "unit '%s' is already registered with a different layout"
                        : "unit '%s': too many units (at most %d)",
               req->name, JOB_MAX_UNITS);
    goto done;
  }
  mine = NULL; /* freed by job_publish_unit if it existed, else owned by the job */
  int fresh = l->id >= rs->nshards || !rs->shards[l->id].present;
  if (fresh) {
    /* Readers of this rank look at the shard table under its lock. */
    pin_lock_shards(rs);
    rc = shard_create(rs, l);
    pin_unlock_shards(rs);
    if (rc == 0)
      rc = grow_scratch(rs, init == ZEROD__V1__INIT_MODE__INIT_FROM_RANK0 ? l->padded_numel : 0, 0);
    if (rc != 0) {
      job_fail(j, rs->generation, "rank %d: out of memory for unit '%s'", rs->rank, l->name);
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                 "out of memory for the shard of unit '%s' (%llu elements)", l->name,
                 (unsigned long long)l->shard_numel);
      goto done;
    }
    shard *sh = &rs->shards[l->id];
    uint64_t lo = (uint64_t)rs->rank * l->shard_numel;
    if (init == ZEROD__V1__INIT_MODE__INIT_FROM_RANK0) {
      /* 5. Rank 0's values to every rank. */
      rc = broadcast_values(rs, l, packed);
      if (rc != 0) {
        op_comm_failed(rs, op, "register (initial values)", rc);
        goto done;
      }
      rc = device_copy(rs->dev, sh->master, rs->scratch + lo, l->shard_numel * sizeof(float));
    } else if (init == ZEROD__V1__INIT_MODE__INIT_SEEDED_NORMAL) {
      rc = seed_master(rs, l, sh, req->seed, req->init_std);
    }
    if (rc == 0)
      rc = refresh_working(rs, l, sh);
    /* Readers copy the shard from other threads once the unit is ready. */
    if (rc == 0)
      rc = device_sync(rs->dev);
    if (rc != 0) {
      op_device_failed(rs, op, "register (initial values)", rc);
      goto done;
    }
    /* No reader looks at the shard before this: the unit becomes readable
     * (and listed) once every rank has counted itself. */
    atomic_fetch_add(&l->ready_ranks, 1);
  }
  {
    Zerod__V1__RegisterUnitReply reply = ZEROD__V1__REGISTER_UNIT_REPLY__INIT;
    if (exec_unit_reply(j, l, &reply) != 0) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
      goto done;
    }
    reply.existed = !fresh;
    exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, &reply.base);
    exec_unit_reply_free(&reply);
    LOG_DEBUGF("unit registered", "job=%s rank=%d unit=%u numel=%llu", j->name, rs->rank, l->id,
               (unsigned long long)l->numel);
  }
done:
  if (root_desc_owned)
    free(root_desc);
  unit_layout_free(mine);
  free(packed);
  free(codes);
}

/* Outcomes of a LOAD_UNIT's local checks, exchanged between the ranks. */
enum {
  LOAD_OK = 0,
  LOAD_UNKNOWN_UNIT = 1,
  LOAD_NO_VALUES = 2,    /* rank 0 sent no descriptor */
  LOAD_SHORT_VALUES = 3, /* rank 0's descriptor is too short or unreadable */
  LOAD_NO_MEMORY = 4,
};

/* LOAD_UNIT: rank 0's fp32 values become the unit's master weights and
 * working copy on every rank (frozen tensors included); the optimizer
 * state and the gradient accumulators stay. The version goes up, so no
 * cached gather of the old values is served again, and a pin of the old
 * version keeps them (copy on write, as in a step). */
static void handle_load(rank_state *rs, exec_op *op) {
  Zerod__V1__LoadUnitRequest *req = (Zerod__V1__LoadUnitRequest *)op->request;
  job *j = rs->job;
  if (op_job_failed(rs, op))
    return;
  unit_layout *l = job_unit(j, req->unit_id);
  int32_t code = LOAD_OK;
  char err[512] = "";
  float *packed = NULL;
  int32_t *codes = NULL;
  if (l == NULL || l->id >= rs->nshards || !rs->shards[l->id].present) {
    code = LOAD_UNKNOWN_UNIT;
  } else if (rs->rank == 0 && op->in_fd < 0) {
    code = LOAD_NO_VALUES;
  } else if (rs->rank == 0) {
    packed = malloc(l->packed_numel * sizeof(float) + 1);
    int rc = packed == NULL ? -ENOMEM : shm_read_fd(op->in_fd, packed, l->packed_numel * 4);
    if (rc == -ENOMEM) {
      code = LOAD_NO_MEMORY;
    } else if (rc != 0) {
      code = LOAD_SHORT_VALUES;
      snprintf(err, sizeof err, "%s", rc == -EINVAL ? "file too short" : strerror(-rc));
    }
  }
  if (code == LOAD_OK && grow_scratch(rs, l->padded_numel, 0) != 0)
    code = LOAD_NO_MEMORY;

  /* Every rank learns every rank's outcome before anything is broadcast,
   * so all of them fail or none does. The all-gather also means every rank
   * has finished its previous write before any rank starts this one. */
  codes = calloc((size_t)j->world_size, sizeof *codes);
  if (codes == NULL) {
    job_fail(j, rs->generation, "rank %d: out of memory", rs->rank);
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
    goto done;
  }
  codes[rs->rank] = code;
  int rc = host_all_gather(rs, codes, sizeof *codes);
  if (rc != 0) {
    op_comm_failed(rs, op, "load_unit (check)", rc);
    goto done;
  }
  for (int r = 0; r < j->world_size; r++) {
    const char *name = l != NULL ? l->name : "?";
    switch (codes[r]) {
    case LOAD_OK:
      continue;
    case LOAD_UNKNOWN_UNIT:
      exec_error(op, ZEROD__V1__STATUS__STATUS_NOT_FOUND,
                 "load_unit: unknown unit id %u (register it first)", req->unit_id);
      break;
    case LOAD_NO_VALUES:
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "load_unit of unit '%s' needs rank 0's values (one descriptor with %llu fp32 "
                 "values, the tensors back to back)",
                 name, l != NULL ? (unsigned long long)l->packed_numel : 0ull);
      break;
    case LOAD_SHORT_VALUES:
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "load_unit of unit '%s': reading rank 0's values (%llu bytes expected): %s", name,
                 l != NULL ? (unsigned long long)l->packed_numel * 4 : 0ull,
                 r == rs->rank ? err : "file too short or unreadable");
      break;
    default:
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                 "load_unit of unit '%s': rank %d is out of memory", name, r);
      break;
    }
    goto done;
  }

  rc = broadcast_values(rs, l, packed);
  if (rc != 0) {
    op_comm_failed(rs, op, "load_unit (values)", rc);
    goto done;
  }
  shard *sh = &rs->shards[l->id];
  uint64_t lo = (uint64_t)rs->rank * l->shard_numel;
  pin_begin_write(rs);
  rc = device_copy(rs->dev, sh->master, rs->scratch + lo, l->shard_numel * sizeof(float));
  if (rc == 0)
    rc = refresh_working(rs, l, sh);
  /* Readers copy the working copy once the write lock is released. */
  if (rc == 0)
    rc = device_sync(rs->dev);
  pin_end_write(rs);
  if (rc != 0) {
    op_device_failed(rs, op, "load_unit", rc);
    goto done;
  }
  LOG_DEBUGF("unit loaded", "job=%s rank=%d unit=%u version=%llu", j->name, rs->rank, l->id,
             (unsigned long long)rs->version);
  Zerod__V1__LoadUnitReply reply = ZEROD__V1__LOAD_UNIT_REPLY__INIT;
  reply.unit_id = l->id;
  reply.version = rs->version;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT_REPLY, &reply.base);
done:
  free(packed);
  free(codes);
}

static void handle_session_begin(rank_state *rs, exec_op *op) {
  rs->session_id = op->session_id;
  rs->ndropped = 0;
  Zerod__V1__OptimizerConfig opt;
  Zerod__V1__JobConfig config;
  exec_job_config(rs->job, rs->lr, rs->max_grad_norm, &config, &opt);
  Zerod__V1__AttachReply reply = ZEROD__V1__ATTACH_REPLY__INIT;
  reply.job_id = rs->job->id;
  reply.rank = (uint32_t)rs->rank;
  reply.world_size = (uint32_t)rs->job->world_size;
  reply.version = rs->version;
  reply.config = &config;
  reply.created = op->job_created;
  if (op->warning != NULL)
    reply.warning = op->warning;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, &reply.base);
}

static void handle_session_end(rank_state *rs, exec_op *op) {
  for (uint32_t u = 0; u < rs->nshards; u++) {
    shard *sh = &rs->shards[u];
    if (!sh->present)
      continue;
    if (sh->gather_held && sh->gather_buf >= 0)
      pool_unref(rs, &rs->bufs[sh->gather_buf]);
    sh->gather_held = 0;
    if (sh->grad_buf >= 0) {
      pool_unref(rs, &rs->bufs[sh->grad_buf]);
      rs->bufs[sh->grad_buf].unit = -1;
      sh->grad_buf = -1;
    }
  }
  rs->ndropped = 0;
  rs->session_id = 0;
  /* A save waiting for this rank's next step takes its copy now: without a
   * worker there is no next step. */
  uint64_t pending = atomic_load(&rs->ckpt_pending);
  if (pending > rs->ckpt_taken)
    take_snapshot(rs, pending);
  /* A job that failed (e.g. its worker died) closes this rank's
   * communicator, so peers blocked in a collective with this rank fail now
   * rather than at their timeout. */
  if (rs->comm != NULL && job_failed(rs->job, rs->generation, NULL, 0))
    set_comm(rs, NULL);
  if (op->session != NULL) {
    Zerod__V1__DetachReply reply = ZEROD__V1__DETACH_REPLY__INIT;
    exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_DETACH_REPLY, &reply.base);
  }
}

/* ------------------------------------------------------------------------ */
/* Checkpoints: saves without a worker, restores                            */
/* ------------------------------------------------------------------------ */

/* A save order reached the rank: with no worker attached no step will
 * come, so the copy is taken now (in queue order, before any op of a
 * worker that attaches later). With one, it is taken at the end of a step
 * to come, and the rank's writer faults its memory in meanwhile. */
static void handle_save(rank_state *rs, exec_op *op) {
  if (op->ckpt_id <= rs->ckpt_taken || atomic_load(&rs->ckpt_pending) < op->ckpt_id)
    return;
  if (rs->session_id == 0) {
    take_snapshot(rs, op->ckpt_id);
    return;
  }
  unsigned n;
  uint64_t bytes;
  unit_layout **units = snapshot_units(rs, &n, &bytes);
  if (units != NULL)
    ckpt_node_stage(rs->job, rs->rank, op->ckpt_id, bytes);
  free(units);
}

static void handle_restore_read(rank_state *rs, exec_op *op) {
  ckpt_staged_free(rs->ckpt_staged);
  rs->ckpt_staged = NULL;
  int code = 0;
  char err[512] = "";
  ckpt_staged *st = NULL;
  double t0 = monotonic_s();
  int rc = ckpt_restore_read(rs->job, rs->rank, op->ckpt_source, op->ckpt_format,
                             device_is_host(rs->dev), &st, &code, err, sizeof err);
  if (rc == 0) {
    st->id = op->ckpt_id;
    rs->ckpt_staged = st;
    LOG_DEBUGF("read for a restore", "job=%s rank=%d restore=%llu bytes=%zu ms=%.1f", rs->job->name,
               rs->rank, (unsigned long long)op->ckpt_id, st->mem_bytes,
               (monotonic_s() - t0) * 1e3);
  }
  ckpt_node_restore_report(rs->job, rs->rank, op->ckpt_id, 0, rc == 0 ? st->step : 0,
                           rc == 0 ? 0 : (code != 0 ? code : RPC_INTERNAL), err);
}

/* Installs what handle_restore_read staged: every rank of the job does
 * this once all have read and verified their part. A failure here leaves
 * ranks that installed and ranks that did not, so the job fails. */
static void handle_restore_commit(rank_state *rs, exec_op *op) {
  job *j = rs->job;
  ckpt_staged *st = rs->ckpt_staged;
  char err[512] = "";
  int rc = 0;
  if (st == NULL || st->id != op->ckpt_id) {
    ckpt_node_restore_report(j, rs->rank, op->ckpt_id, 0, 0, RPC_INTERNAL,
                             "no values read for this restore on the rank");
    return;
  }
  rs->ckpt_staged = NULL;
  unsigned char *fresh = calloc(st->nunits + 1, 1);
  if (fresh == NULL)
    rc = -ENOMEM;
  for (unsigned u = 0; rc == 0 && u < st->nunits; u++) {
    ckpt_staged_unit *su = &st->units[u];
    if (su->owned) {
      int existed = 0, conflict = 0;
      unit_layout *l = job_publish_unit(j, su->layout, &existed, &conflict);
      if (l == NULL) {
        snprintf(err, sizeof err, "unit '%s': %s", su->layout->name,
                 conflict ? "registered meanwhile with a different layout" : "too many units");
        rc = -EINVAL;
        break;
      }
      su->owned = 0; /* the job's now (or freed, if it existed) */
      su->layout = l;
    }
    const unit_layout *l = su->layout;
    if (l->id >= rs->nshards || !rs->shards[l->id].present) {
      pin_lock_shards(rs);
      rc = shard_create(rs, l);
      pin_unlock_shards(rs);
      fresh[u] = rc == 0;
      if (rc != 0)
        snprintf(err, sizeof err, "out of memory for the shard of unit '%s'", l->name);
    }
  }
  if (rc == 0) {
    pin_begin_write(rs);
    for (unsigned u = 0; rc == 0 && u < st->nunits; u++) {
      ckpt_staged_unit *su = &st->units[u];
      const unit_layout *l = su->layout;
      shard *sh = &rs->shards[l->id];
      size_t bytes = l->shard_numel * sizeof(float);
      float **dst[3] = {&sh->master, &sh->moment1, &sh->moment2};
      float *master = sh->master;
      for (int k = 0; rc == 0 && k < 3; k++) {
        if (*dst[k] == NULL)
          continue;
        if (su->state[k] == NULL) {
          rc = device_zero(rs->dev, *dst[k], bytes);
        } else if (st->arrays) {
          /* A host rank takes the staged array as it is; the one it held
           * goes with the staging, freed once the rank has reported. */
          float *held = *dst[k];
          *dst[k] = su->state[k];
          su->state[k] = held;
        } else {
          rc = device_upload(rs->dev, *dst[k], su->state[k], bytes);
        }
      }
      if (sh->working == (void *)master)
        sh->working = sh->master;
      if (rc == 0)
        rc = device_zero(rs->dev, sh->grad_acc, bytes);
      if (rc == 0)
        rc = refresh_working(rs, l, sh);
    }
    if (rc == 0)
      rc = device_sync(rs->dev);
    if (rc != 0)
      snprintf(err, sizeof err, "installing the restored values: %s", device_last_error(rs->dev));
    rs->step = st->step;
    pin_end_write(rs);
  }
  for (unsigned u = 0; rc == 0 && u < st->nunits; u++)
    if (fresh[u])
      atomic_fetch_add(&st->units[u].layout->ready_ranks, 1);
  free(fresh);
  if (rc != 0) {
    job_fail(j, rs->generation, "rank %d: restore: %s", rs->rank, err);
    ckpt_node_restore_report(j, rs->rank, op->ckpt_id, 0, 0, RPC_INTERNAL, err);
  } else {
    LOG_INFOF("restored", "job=%s rank=%d restore=%llu step=%llu units=%u", j->name, rs->rank,
              (unsigned long long)op->ckpt_id, (unsigned long long)st->step, st->nunits);
    ckpt_node_restore_report(j, rs->rank, op->ckpt_id, 1, st->step, 0, NULL);
  }
  ckpt_staged_free(st);
}

static void handle_comm_init(rank_state *rs, exec_op *op) {
  if (rs->comm != NULL)
    set_comm(rs, NULL);
  rs->generation = op->generation;
  /* "<job>/<generation>/": the rendezvous namespace (job, epoch) that the
   * coordinator's store splits it into (store_grpc.c). Job names hold no
   * '/'. */
  char prefix[128], err[512] = "";
  snprintf(prefix, sizeof prefix, "%s/%u", rs->job->name, rs->generation);
  comm_options options = {.prefix = prefix,
                          .rank = rs->rank,
                          .world_size = rs->job->world_size,
                          .timeout_ms = settings.collective_timeout_ms,
                          .hostname = settings.comm_hostname};
  int rc;
  comm *built = NULL;
  if (rs->dev == NULL) {
    snprintf(err, sizeof err, "%s", rs->device_error);
    rc = -ENODEV;
  } else if (device_is_host(rs->dev)) {
    rc = comm_gloo_create(&options, settings.rendezvous, &built, err, sizeof err);
  } else {
    rc = comm_nccl_create(&options, settings.rendezvous, device_cuda_api(rs->dev),
                          device_cuda_stream(rs->dev), &built, err, sizeof err);
  }
  if (rc != 0) {
    job_fail(rs->job, rs->generation, "rank %d: communicator: %s", rs->rank, err);
    if (atomic_load(&rs->stopping)) /* the rendezvous gave up: the daemon is stopping */
      LOG_INFOF("communicator not built; zerod is stopping", "job=%s rank=%d generation=%u",
                rs->job->name, rs->rank, rs->generation);
    else
      LOG_ERRORF("communicator failed", "job=%s rank=%d generation=%u", rs->job->name, rs->rank,
                 rs->generation);
    return;
  }
  set_comm(rs, built);
  /* After a reset the ranks' pools may differ (their last ops failed at
   * different points); trimming them makes their next decisions agree
   * again. The step counts must agree too. */
  pool_trim(rs);
  int64_t *steps = calloc((size_t)rs->job->world_size, sizeof *steps);
  if (steps == NULL) {
    job_fail(rs->job, rs->generation, "rank %d: out of memory", rs->rank);
    return;
  }
  steps[rs->rank] = (int64_t)rs->step;
  rc = host_all_gather(rs, steps, sizeof *steps);
  for (int r = 0; rc == 0 && r < rs->job->world_size; r++)
    if (steps[r] != steps[0]) {
      job_fail(rs->job, rs->generation,
               "ranks disagree on the step count (rank 0: %lld, rank %d: %lld)",
               (long long)steps[0], r, (long long)steps[r]);
      break;
    }
  if (rc != 0)
    job_fail(rs->job, rs->generation, "rank %d: communicator check: %s", rs->rank,
             rs->failed_on_device ? device_last_error(rs->dev) : comm_last_error(rs->comm));
  free(steps);
  if (rc == 0 && !job_failed(rs->job, rs->generation, NULL, 0))
    atomic_store(&rs->comm_ready, rs->generation + 1);
  LOG_DEBUGF("communicator ready", "job=%s rank=%d generation=%u", rs->job->name, rs->rank,
             rs->generation);
}

/* ------------------------------------------------------------------------ */
/* The executor thread                                                      */
/* ------------------------------------------------------------------------ */

static void finish(exec_op *op) {
  if (op->session != NULL)
    settings.complete(op);
  else
    exec_op_free(op);
}

static void run_op(rank_state *rs, exec_op *op) {
  int64_t next = -1;
  rs->failed_on_device = 0;
  switch (op->kind) {
  case OP_COMM_INIT:
    handle_comm_init(rs, op);
    break;
  case OP_SESSION_BEGIN:
    handle_session_begin(rs, op);
    break;
  case OP_SESSION_END:
    handle_session_end(rs, op);
    break;
  case OP_REGISTER:
    handle_register(rs, op);
    break;
  case OP_GATHER:
    handle_gather(rs, op, 0, &next);
    break;
  case OP_PREFETCH:
    next = op->prefetch_unit;
    break;
  case OP_RELEASE:
    handle_release(rs, op);
    break;
  case OP_GRAD_BUFFER:
    handle_grad_buffer(rs, op, 0);
    break;
  case OP_REDUCE:
    handle_reduce(rs, op);
    break;
  case OP_STEP:
    handle_step(rs, op);
    break;
  case OP_LOAD:
    handle_load(rs, op);
    break;
  case OP_PIN: /* read-only sessions' ops never reach an executor */
    break;
  case OP_TRIM:
    pool_trim(rs);
    break;
  case OP_SAVE:
    handle_save(rs, op);
    break;
  case OP_RESTORE_READ:
    handle_restore_read(rs, op);
    break;
  case OP_RESTORE_COMMIT:
    handle_restore_commit(rs, op);
    break;
  case OP_RESTORE_ABORT:
    ckpt_staged_free(rs->ckpt_staged);
    rs->ckpt_staged = NULL;
    break;
  case OP_STOP:
    break;
  }
  /* The reply goes out before the prefetch starts: the worker computes on
   * this unit while the next one is gathered. */
  finish(op);
  rs->failed_on_device = 0;
  if (next >= 0)
    prefetch_unit(rs, (uint32_t)next);
}

/* Opens the rank's device on its executor thread: a GPU rank's device is
 * current on this thread from here on. A failure is kept for the
 * communicator's creation, which fails the job with it. */
static void open_device(rank_state *rs) {
  int rc;
  if (settings.device != NULL && strcmp(settings.device, "cuda") == 0) {
    /* Local rank i binds GPU i (ARCHITECTURE §3). */
    int ordinal = rs->rank - rs->job->first_rank;
    rc = device_cuda_open(ordinal, &rs->dev, rs->device_error, sizeof rs->device_error);
    if (rc == 0)
      LOG_INFOF("rank on GPU", "job=%s rank=%d device=%d", rs->job->name, rs->rank, ordinal);
  } else {
    rc = device_host_open(rs->pool, &rs->dev);
    if (rc != 0)
      snprintf(rs->device_error, sizeof rs->device_error, "host device: %s", strerror(-rc));
  }
  if (rc != 0) {
    rs->dev = NULL;
    LOG_ERRORF("device failed", "job=%s rank=%d err=\"%s\"", rs->job->name, rs->rank,
               rs->device_error);
  }
}

/* Frees everything that lives in the device's memory, then the device, on
 * the executor thread that owns it. Readers of the rank's shards are kept
 * out by its lock (the daemon is stopping: they give up). */
static void close_device(rank_state *rs) {
  if (rs->dev == NULL)
    return;
  device_sync(rs->dev);
  pin_lock_shards(rs);
  for (uint32_t u = 0; u < rs->nshards; u++)
    if (rs->shards[u].present)
      shard_free(rs, &rs->shards[u]);
  pin_unlock_shards(rs);
  pool_free_all(rs);
  device_free(rs->dev, rs->scratch);
  device_free(rs->dev, rs->shard_scratch);
  device_free(rs->dev, rs->staging);
  rs->scratch = rs->shard_scratch = NULL;
  rs->staging = NULL;
  rs->scratch_numel = rs->shard_scratch_numel = 0;
  rs->staging_bytes = 0;
  device_close(rs->dev);
  rs->dev = NULL;
}

static void *exec_main(void *arg) {
  rank_state *rs = arg;
  open_device(rs);
  for (;;) {
    pthread_mutex_lock(&rs->queue_mutex);
    while (rs->queue_head == NULL)
      pthread_cond_wait(&rs->queue_cond, &rs->queue_mutex);
    exec_op *op = rs->queue_head;
    rs->queue_head = op->next;
    if (rs->queue_head == NULL)
      rs->queue_tail = NULL;
    pthread_mutex_unlock(&rs->queue_mutex);
    op->next = NULL;
    if (op->kind == OP_STOP) {
      /* Closing the communicator's connections wakes any peer rank blocked
       * on this one at once, instead of at its timeout. */
      set_comm(rs, NULL);
      close_device(rs);
      exec_op_free(op);
      atomic_fetch_sub(&rs->busy, 1);
      return NULL;
    }
    run_op(rs, op);
    atomic_fetch_sub(&rs->busy, 1);
  }
}

int exec_rank_start(rank_state *rs) {
  int rc = zk_pool_create(settings.threads_per_rank, &rs->pool);
  if (rc != 0)
    return rc;
  rc = pthread_create(&rs->thread, NULL, exec_main, rs);
  if (rc != 0)
    return -rc;
  rs->thread_started = 1;
  return 0;
}

void exec_submit(exec_op *op) {
  rank_state *rs = op->rank;
  atomic_fetch_add(&rs->busy, 1);
  pthread_mutex_lock(&rs->queue_mutex);
  if (rs->queue_tail != NULL)
    rs->queue_tail->next = op;
  else
    rs->queue_head = op;
  rs->queue_tail = op;
  pthread_cond_signal(&rs->queue_cond);
  pthread_mutex_unlock(&rs->queue_mutex);
}

int exec_try_inline(exec_op *op) {
  rank_state *rs = op->rank;
  if (atomic_load(&rs->busy) != 0)
    return 0;
  int64_t next = -1;
  switch (op->kind) {
  case OP_GATHER:
    if (!handle_gather(rs, op, 1, &next))
      return 0;
    break;
  case OP_RELEASE:
    handle_release(rs, op);
    break;
  case OP_GRAD_BUFFER:
    if (!handle_grad_buffer(rs, op, 1))
      return 0;
    break;
  default:
    return 0;
  }
  if (next >= 0) {
    /* The executor is idle, so this prefetch runs right after the gather,
     * exactly where the executor would have run it. */
    exec_op *prefetch = exec_op_new(OP_PREFETCH, rs);
    if (prefetch != NULL) {
      prefetch->prefetch_unit = (uint32_t)next;
      exec_submit(prefetch);
    }
  }
  return 1;
}

void exec_rank_stop(rank_state *rs) {
  if (!rs->thread_started)
    return;
  atomic_store(&rs->stopping, 1);
  pthread_mutex_lock(&rs->queue_mutex);
  exec_op *dropped = rs->queue_head;
  rs->queue_head = rs->queue_tail = NULL;
  pthread_mutex_unlock(&rs->queue_mutex);
  while (dropped != NULL) {
    exec_op *next = dropped->next;
    dropped->next = NULL;
    exec_error(dropped, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "zerod is shutting down");
    atomic_fetch_sub(&rs->busy, 1);
    finish(dropped);
    dropped = next;
  }
  /* An op still running may be a collective whose peers will not come
   * (their executors are stopping too, or they are on nodes whose workers
   * are gone): aborting the communicator makes it return now, not at the
   * collective timeout; comm_abort only raises flags and wakes waiters, so
   * the loop can call it. A communicator still being built gives up in its
   * rendezvous once the store is stopped (node_stop), or is aborted by
   * set_comm when it is done. */
  pthread_mutex_lock(&rs->comm_lock);
  comm_abort(rs->comm);
  pthread_mutex_unlock(&rs->comm_lock);
  exec_op *stop = exec_op_new(OP_STOP, rs);
  if (stop != NULL)
    exec_submit(stop);
}

void exec_rank_join(rank_state *rs) {
  if (!rs->thread_started)
    return;
  pthread_join(rs->thread, NULL);
  rs->thread_started = 0;
}

void exec_rank_free(rank_state *rs) {
  if (rs->comm != NULL)
    comm_destroy(rs->comm);
  rs->comm = NULL;
  /* The executor closed its device when it stopped (close_device); what
   * is left is host memory. */
  free(rs->shards);
  rs->shards = NULL;
  free(rs->bufs);
  free(rs->dropped_ids);
  rs->bufs = NULL;
  rs->dropped_ids = NULL;
  free(rs->order);
  rs->order = NULL;
  ckpt_staged_free(rs->ckpt_staged);
  rs->ckpt_staged = NULL;
  zk_pool_destroy(rs->pool);
  rs->pool = NULL;
}
