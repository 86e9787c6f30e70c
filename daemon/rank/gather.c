/* GATHER, RELEASE and GRAD_BUFFER: a unit's full working values in a
 * buffer the worker maps (served from the pool's cache when its version is
 * current, else all-gathered: from the node's hpZ secondary partitions
 * when they hold that version), the gradient buffer the worker writes, and
 * prefetching along the gather order recorded before the first step. */
#include "exec_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base_cache.h"
#include "log.h"
#include "pool.h"

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
  if (!device_is_host(rs->dev)) { /* (bases are on host ranks only: node/bases.c) */
    cuda->mem_handle.data = b->buf.mem_handle;
    cuda->mem_handle.len = sizeof b->buf.mem_handle;
    cuda->device = rs->dev->ordinal;
    cuda->event_handle.data = b->buf.event_handle;
    cuda->event_handle.len = sizeof b->buf.event_handle;
    b->sent_session = op->session_id;
    return 1;
  }
  /* A base's unit is shared by every job on the base: the worker gets a
   * descriptor opened read-only, which it cannot map writable. */
  op->reply_fd = b->kind == BUF_BASE ? base_cache_read_only_fd(b->base_entry) : dup(b->buf.fd);
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
/* qwZ: every rank quantizes its master shard to int8 blocks, the quantized
 * shards are all-gathered (a job spanning nodes: hierarchically, so what
 * crosses nodes is int8 plus a scale per block), and each is dequantized
 * into its place in the gathered buffer, on every rank alike. Host ranks. */
static int fill_gathered_quantized(rank_state *rs, const unit_layout *l, shard *sh, pool_buf *b) {
  const job_config *config = &rs->job->config;
  zk_qformat fmt = {.bits = 8, .mode = ZK_QSYM, .block_numel = config->quantization_block};
  size_t q = zk_quant_bytes(&fmt, l->shard_numel);
  size_t world = (size_t)rs->job->world_size;
  if (q == 0)
    return -EINVAL;
  if (q * world > rs->qgather_bytes) {
    uint8_t *grown = realloc(rs->qgather, q * world);
    if (grown == NULL)
      return -ENOMEM;
    rs->qgather = grown;
    rs->qgather_bytes = q * world;
  }
  int cast = config->working_dtype != ZK_F32; /* dequantized in fp32, then cast */
  if (cast && l->shard_numel > rs->qdequant_numel) {
    float *grown = realloc(rs->qdequant, l->shard_numel * sizeof *grown);
    if (grown == NULL)
      return -ENOMEM;
    rs->qdequant = grown;
    rs->qdequant_numel = l->shard_numel;
  }
  uint8_t *mine = rs->qgather + (size_t)rs->rank * q;
  int rc = zk_quantize(rs->pool, &fmt, sh->master, l->shard_numel, mine, q, NULL);
  if (rc == 0)
    rc = exec__dev_call(rs, device_buffer_wait(rs->dev, &b->buf));
  if (rc == 0) {
    rc = comm_all_gather(rs->comm, mine, rs->qgather, q);
    rank_metrics_collective(rs, RANK_ALL_GATHER);
  }
  size_t elem = zk_dtype_size(config->working_dtype);
  for (size_t r = 0; rc == 0 && r < world; r++) {
    void *slot = (uint8_t *)b->buf.base + r * l->shard_numel * elem;
    float *to = cast ? rs->qdequant : slot;
    rc = zk_dequantize(rs->pool, &fmt, rs->qgather + r * q, q, to, l->shard_numel);
    if (rc == 0 && cast)
      rc = zk_cast(rs->pool, slot, config->working_dtype, rs->qdequant, ZK_F32, l->shard_numel);
  }
  if (rc == 0)
    rc = exec__dev_call(rs, device_buffer_publish(rs->dev, &b->buf));
  return rc;
}

static int fill_gathered(rank_state *rs, const unit_layout *l, shard *sh, pool_buf *b) {
  if (rs->job->config.quantized_weights && job_spans_nodes(rs->job) && device_is_host(rs->dev))
    return fill_gathered_quantized(rs, l, sh, b);
  size_t elem = zk_dtype_size(rs->job->config.working_dtype);
  size_t shard_bytes = l->shard_numel * elem;
  uint8_t *base = b->buf.base;
  uint8_t *mine = base + (size_t)rs->rank * shard_bytes;
  int rc = exec__dev_call(rs, device_buffer_wait(rs->dev, &b->buf));
  if (rc == 0)
    rc = exec__dev_call(rs, device_copy(rs->dev, mine, sh->working, shard_bytes));
  if (rc == 0) {
    rc = comm_all_gather(rs->comm, mine, base, shard_bytes);
    rank_metrics_collective(rs, RANK_ALL_GATHER);
  }
  if (rc == 0)
    rc = exec__dev_call(rs, device_buffer_publish(rs->dev, &b->buf));
  if (rc == 0)
    rc = exec__dev_call(rs, device_sync(rs->dev));
  return rc;
}

/* ZeRO++ hpZ: a unit's secondary partition is the 1/L slice of its
 * gathered values that this rank keeps for its node (local rank l keeps
 * [l * P / L, (l + 1) * P / L) of the padded unit), in the pool. */
static uint64_t secondary_bytes(const rank_state *rs, const unit_layout *l) {
  return unit_buffer_bytes(rs, l) / (uint64_t)rs->hpz_ranks;
}

static pool_buf *valid_secondary(rank_state *rs, const shard *sh) {
  if (rs->hpz_ranks <= 1 || sh->secondary_buf < 0)
    return NULL;
  pool_buf *s = &rs->bufs[sh->secondary_buf];
  return s->valid_version == rs->version ? s : NULL;
}

/* The gather inside the node: every local rank's slice, no bytes between
 * nodes; the values are those the gather across nodes put there. */
static int fill_from_secondary(rank_state *rs, const unit_layout *l, pool_buf *s, pool_buf *b) {
  int rc = exec__dev_call(rs, device_buffer_wait(rs->dev, &b->buf));
  if (rc == 0) {
    rc = comm_all_gather_node(rs->comm, s->buf.base, b->buf.base, secondary_bytes(rs, l));
    rank_metrics_collective(rs, RANK_ALL_GATHER);
  }
  if (rc == 0)
    rc = exec__dev_call(rs, device_buffer_publish(rs->dev, &b->buf));
  s->last_use = ++rs->tick;
  return rc;
}

/* After a gather across nodes: keeps this rank's slice if the pool has
 * room for it, evicting cached gathers but no other current slice
 * (POOL_SECONDARY). Without room the next gather crosses nodes again.
 * Every rank of the job decides alike (pool.h), so their next gathers of
 * the unit agree on where they go. The gathered buffer is bufs[gathered]
 * (an index: acquiring may move the pool's table). */
static void keep_secondary(rank_state *rs, const unit_layout *l, shard *sh, int64_t gathered) {
  uint64_t bytes = secondary_bytes(rs, l);
  int64_t slot = sh->secondary_buf;
  if (slot < 0) {
    char why[256];
    /* The gathered buffer is not held yet (the caller hands it out
     * next): it must not be the slice's victim. */
    rs->bufs[gathered].refs++;
    slot = pool_acquire(rs, BUF_SECONDARY, bytes, l->name, POOL_SECONDARY, why, sizeof why);
    rs->bufs[gathered].refs--;
    if (slot < 0)
      return;
  }
  pool_buf *s = &rs->bufs[slot];
  size_t local = (size_t)(rs->rank % rs->hpz_ranks);
  memcpy(s->buf.base, (const uint8_t *)rs->bufs[gathered].buf.base + local * bytes, bytes);
  s->unit = l->id;
  s->valid_version = rs->version;
  s->last_use = ++rs->tick;
  sh->secondary_buf = slot;
}

/* Fills the buffer in slot with the unit's values at the rank's version
 * (from its secondary partition when hpZ kept a current one) and makes it
 * the unit's cached gather. */
static int gather_unit(rank_state *rs, const unit_layout *l, shard *sh, int64_t slot) {
  pool_buf *b = &rs->bufs[slot];
  pool_buf *s = valid_secondary(rs, sh);
  int rc = s != NULL ? fill_from_secondary(rs, l, s, b) : fill_gathered(rs, l, sh, b);
  if (rc != 0)
    return rc;
  b->unit = l->id;
  b->valid_version = rs->version;
  b->last_use = ++rs->tick;
  sh->gather_buf = slot;
  if (s == NULL && rs->hpz_ranks > 1)
    keep_secondary(rs, l, sh, slot);
  return 0;
}

/* Whether the unit's gathered buffer holds its values at the rank's
 * version; a base's unit never changes, so once gathered it stays so. */
static int gathered_current(const rank_state *rs, const shard *sh) {
  return sh->gather_buf >= 0 &&
         (sh->from_base || rs->bufs[sh->gather_buf].valid_version == rs->version);
}

/* A gather the pool cannot serve: the unit into sh->gather_buf, from the
 * base through the node's cache, or all-gathered into a pool buffer. 0, or
 * 1 with op answered. */
static int gather_missing(rank_state *rs, exec_op *op, const unit_layout *l, shard *sh) {
  if (sh->from_base) {
    int err = exec__gather_from_base(rs, l, sh);
    if (err != 0)
      exec__op_comm_failed(rs, op, "all_gather (base unit)", err);
    return err != 0;
  }
  char why[256];
  int64_t slot =
      pool_acquire(rs, BUF_GATHER, unit_buffer_bytes(rs, l), l->name, POOL_DEMAND, why, sizeof why);
  if (slot < 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "%s", why);
    return 1;
  }
  int err = gather_unit(rs, l, sh, slot);
  if (err != 0)
    exec__op_comm_failed(rs, op, "all_gather", err);
  return err != 0;
}

void exec__prefetch_unit(rank_state *rs, uint32_t unit_id) {
  unit_layout *l = job_unit(rs->job, unit_id);
  if (l == NULL || unit_id >= rs->nshards || !rs->shards[unit_id].present)
    return;
  shard *sh = &rs->shards[unit_id];
  /* A unit of the base is gathered on demand only: its first gather asks
   * the node's cache, the later ones are served from the pool. */
  if (sh->from_base || gathered_current(rs, sh))
    return;
  if (job_failed(rs->job, rs->generation, NULL, 0) || rs->comm == NULL)
    return;
  char why[256];
  int64_t slot = pool_acquire(rs, BUF_GATHER, unit_buffer_bytes(rs, l), l->name, POOL_PREFETCH, why,
                              sizeof why);
  if (slot < 0)
    return;
  int err = gather_unit(rs, l, sh, slot);
  if (err != 0) {
    job_fail(rs->job, rs->generation, "rank %d: prefetch of unit '%s': %s", rs->rank, l->name,
             rs->failed_on_device ? device_last_error(rs->dev) : comm_last_error(rs->comm));
    return;
  }
  LOG_DEBUGF("prefetched", "job=%s rank=%d unit=%u version=%llu", rs->job->name, rs->rank, unit_id,
             (unsigned long long)rs->version);
}

static void attach_dropped(rank_state *rs, uint32_t **ids, size_t *n) {
  *ids = rs->dropped_ids;
  *n = rs->ndropped;
}

/* Returns 1 if handled, 0 if it needs the executor (a cache miss inline). */
int exec__handle_gather(rank_state *rs, exec_op *op, int inline_only, int64_t *prefetch_next) {
  Zerod__V1__GatherRequest *req = (Zerod__V1__GatherRequest *)op->request;
  *prefetch_next = -1;
  if (exec__op_job_failed(rs, op))
    return 1;
  unit_layout *l;
  shard *sh = exec__lookup_shard(rs, op, req->unit_id, &l);
  if (sh == NULL)
    return 1;
  if (sh->gather_held) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
               "unit '%s' is already gathered by this session; release it first", l->name);
    return 1;
  }
  if (!gathered_current(rs, sh)) {
    if (inline_only)
      return 0;
    if (gather_missing(rs, op, l, sh) != 0)
      return 1;
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

void exec__handle_release(rank_state *rs, exec_op *op) {
  Zerod__V1__ReleaseRequest *req = (Zerod__V1__ReleaseRequest *)op->request;
  unit_layout *l;
  shard *sh = exec__lookup_shard(rs, op, req->unit_id, &l);
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
int exec__handle_grad_buffer(rank_state *rs, exec_op *op, int inline_only) {
  Zerod__V1__GradBufferRequest *req = (Zerod__V1__GradBufferRequest *)op->request;
  if (exec__op_job_failed(rs, op))
    return 1;
  unit_layout *l;
  shard *sh = exec__lookup_shard(rs, op, req->unit_id, &l);
  if (sh == NULL || exec__refuse_base_unit(op, sh, l, "a gradient buffer"))
    return 1;
  if (sh->grad_buf < 0) {
    if (inline_only && !device_is_host(rs->dev))
      return 0;
    char why[256];
    int64_t slot =
        pool_acquire(rs, BUF_GRAD, unit_buffer_bytes(rs, l), l->name, POOL_DEMAND, why, sizeof why);
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

void exec__drop_gather_holds(rank_state *rs) {
  for (uint32_t u = 0; u < rs->nshards; u++) {
    shard *sh = &rs->shards[u];
    if (sh->present && sh->gather_held && sh->gather_buf >= 0)
      pool_unref(rs, &rs->bufs[sh->gather_buf]);
    sh->gather_held = 0;
  }
}
