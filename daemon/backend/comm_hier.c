/* comm_hier - a hierarchical communicator (comm.h: comm_hier_create): the
 * ranks of one node (a local communicator, comm_local.c) composed with one
 * cross-node communicator per local rank index (the ranks with the same
 * local index on every node, Gloo), the way NCCL, Horovod and ZeRO++ build
 * hierarchical collectives. Global rank g = n * L + l for local rank l of
 * L on node n of N.
 *
 * all_gather: the cross-node all-gather of each rank's slice among its
 *   local index (N slices), then a local exchange that puts every node's
 *   slice of every local rank in place. Exact: the bytes are the flat
 *   collective's. Cross-node traffic per rank: N slices, not W.
 * reduce_scatter_f32: each local rank sums, over the node's ranks in local
 *   order, the slices its local index owns on every node (N slices), then
 *   the cross-node reduce-scatter (Gloo's, node order) gives each rank its
 *   own. The sum is (g(0,0) + g(0,1) + ...) + (g(1,0) + ...) + ...: fixed,
 *   so deterministic from run to run, but not the flat rank-order sum
 *   ((g0 + g1) + g2) + ... (docs/decisions.md, "Collectives"). Cross-node
 *   traffic per rank: N slices of the unit, not W.
 * reduce_scatter_wire (ZeRO++ qgZ, bf16 gradients): the same node half;
 *   then each rank encodes its N partial sums (bf16, or int8/int4 blocks
 *   with an fp32 scale each), one all-to-all per local index sends partial
 *   n to node n, and each rank decodes the N it got and sums them in fp32
 *   in node order. Cross-node bytes: N encoded slices.
 * all_gather_node (hpZ): the local all-gather alone.
 * all_reduce: the local all-reduce, then the cross-node one.
 * broadcast: the root's local index broadcasts across nodes, then every
 *   node broadcasts from that local rank.
 *
 * A failure of either half breaks the whole: both halves are aborted, so
 * the peers of each fail at once too. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm_impl.h"
#include "zk.h"

/* Sums are made in chunks of this many floats, kept in cache while every
 * local rank's values are added. */
#define SUM_CHUNK 8192

typedef struct hier_comm {
  comm base;
  comm *local, *cross;
  int l, L, n, N;
  void *scratch;
  size_t scratch_bytes;
} hier_comm;

static int grow_scratch(hier_comm *h, size_t bytes, const char *what) {
  if (bytes <= h->scratch_bytes)
    return 0;
  void *grown = realloc(h->scratch, bytes);
  if (grown == NULL)
    return comm_break(&h->base, -ENOMEM, "%s: %zu bytes of scratch: out of memory", what, bytes);
  h->scratch = grown;
  h->scratch_bytes = bytes;
  return 0;
}

/* A half failed: the whole breaks with its reason. */
static int half_failed(hier_comm *h, const char *half, int rc, const comm *sub) {
  return comm_break(&h->base, rc, "%s (%s): %s", half, sub == h->local ? "node" : "cross-node",
                    comm_last_error(sub));
}

static int hier_all_gather(comm *c, const void *send, void *recv, size_t b) {
  hier_comm *h = (hier_comm *)c;
  int rc = grow_scratch(h, (size_t)h->N * b, "all_gather");
  if (rc != 0)
    return rc;
  /* This rank's slice, and those of its local index on the other nodes. */
  if ((rc = comm_all_gather(h->cross, send, h->scratch, b)) != 0)
    return half_failed(h, "all_gather", rc, h->cross);
  const void *const *peers;
  if ((rc = comm_local_begin(h->local, "all_gather", h->scratch, b, &peers)) != 0)
    return half_failed(h, "all_gather", rc, h->local);
  for (int l = 0; l < h->L; l++)
    for (int n = 0; n < h->N; n++)
      memcpy((uint8_t *)recv + ((size_t)n * h->L + l) * b, (const uint8_t *)peers[l] + n * b, b);
  if ((rc = comm_local_end(h->local, "all_gather")) != 0)
    return half_failed(h, "all_gather", rc, h->local);
  comm_count(h->local, (uint64_t)c->world_size * b);
  return 0;
}

/* hpZ: the node half alone. */
static int hier_all_gather_node(comm *c, const void *send, void *recv, size_t b) {
  hier_comm *h = (hier_comm *)c;
  int rc = comm_all_gather(h->local, send, recv, b);
  return rc == 0 ? 0 : half_failed(h, "all_gather_node", rc, h->local);
}

/* The node half of a reduce-scatter: partial[n * s ..] = the node's ranks'
 * slices (n, l) summed in local order, for every node n. */
static int node_partials(hier_comm *h, float *send, float *partial, size_t s) {
  const void *const *peers;
  int rc;
  if ((rc = comm_local_begin(h->local, "reduce_scatter", send, s, &peers)) != 0)
    return half_failed(h, "reduce_scatter", rc, h->local);
  /* partial[n] = the node's ranks' slices (n, l), summed in local order. */
  for (int n = 0; n < h->N; n++) {
    size_t base = ((size_t)n * h->L + h->l) * s;
    float *out = partial + (size_t)n * s;
    for (size_t at = 0; at < s; at += SUM_CHUNK) {
      size_t k = s - at < SUM_CHUNK ? s - at : SUM_CHUNK;
      memcpy(out + at, (const float *)peers[0] + base + at, k * sizeof(float));
      for (int l = 1; l < h->L; l++) {
        const float *from = (const float *)peers[l] + base + at;
        for (size_t i = 0; i < k; i++)
          out[at + i] += from[i];
      }
    }
  }
  if ((rc = comm_local_end(h->local, "reduce_scatter")) != 0)
    return half_failed(h, "reduce_scatter", rc, h->local);
  comm_count(h->local, (uint64_t)h->base.world_size * s * sizeof(float));
  return 0;
}

static int hier_reduce_scatter_f32(comm *c, float *send, float *recv, size_t s) {
  hier_comm *h = (hier_comm *)c;
  int rc = grow_scratch(h, (size_t)h->N * s * sizeof(float), "reduce_scatter");
  if (rc != 0)
    return rc;
  float *partial = h->scratch;
  if ((rc = node_partials(h, send, partial, s)) != 0)
    return rc;
  if ((rc = comm_reduce_scatter_f32(h->cross, partial, recv, s)) != 0)
    return half_failed(h, "reduce_scatter", rc, h->cross);
  return 0;
}

/* Bytes of s elements encoded as wire says, 0 if the format is bad. */
static size_t wire_bytes(const comm_wire *wire, zk_qformat *fmt, size_t s) {
  if (wire->format == COMM_WIRE_BF16)
    return s * 2;
  if (wire->format == COMM_WIRE_ONEBIT)
    return zk_onebit_bytes(wire->block, s);
  *fmt = (zk_qformat){
      .bits = wire->format == COMM_WIRE_INT4 ? 4 : 8, .mode = ZK_QSYM, .block_numel = wire->block};
  return zk_quant_bytes(fmt, s);
}

/* The low-rank reduce (COMM_WIRE_LOWRANK; tests/python/lowrank_ref.py's
 * round() is its reference). For each other node n, on this rank alone:
 * M = this node's partial for n plus the error feedback, as rows x cols;
 * P = M Q with this rank's last Q for n, orthonormalized; Q = M^T P, kept
 * as the next warm start; the error M - P Q^T. P and Q go to node n in one
 * all-to-all, and each rank adds every other node's P Q^T, in node order,
 * to its own node's exact partial. Each node's basis is its own: nothing
 * but the factors crosses nodes, (rows + cols) r floats per node against
 * rows cols (docs/decisions.md, "Low-rank (PowerSGD) compression"). */
typedef struct lowrank_bufs {
  float *partial, *M, *out, *in;
} lowrank_bufs;

static int lowrank_scratch(hier_comm *h, size_t s, const comm_wire *w, lowrank_bufs *b) {
  const size_t N = (size_t)h->N, f = (w->rows + w->cols) * w->rank;
  const size_t counts[4] = {N * s, w->rows * w->cols, N * f, N * f};
  int rc = grow_scratch(h, (counts[0] + counts[1] + counts[2] + counts[3]) * sizeof(float),
                        "reduce_scatter");
  if (rc != 0)
    return rc;
  b->partial = h->scratch;
  b->M = b->partial + counts[0];
  b->out = b->M + counts[1];
  b->in = b->out + counts[2];
  return 0;
}

/* This rank's factors of its partial for node n, into out (P, then Q). */
static int lowrank_encode(const comm_wire *w, const float *x, float *error, float *q, size_t s,
                          float *M, float *out) {
  const size_t mn = w->rows * w->cols;
  for (size_t i = 0; i < s; i++)
    M[i] = x[i] + error[i];
  memset(M + s, 0, (mn - s) * sizeof(float));
  float *P = out, *Q = out + w->rows * w->rank;
  int rc = zk_lowrank_project(NULL, M, w->rows, w->cols, q, w->rank, P);
  if (rc == 0)
    rc = zk_lowrank_orthonormalize(NULL, P, w->rows, w->rank);
  if (rc == 0)
    rc = zk_lowrank_back(NULL, M, w->rows, w->cols, P, w->rank, Q);
  if (rc == 0)
    rc = zk_lowrank_expand(NULL, P, Q, w->rows, w->cols, w->rank, s, M, ZK_LOWRANK_SUBTRACT);
  if (rc != 0)
    return rc;
  memcpy(error, M, s * sizeof(float));
  memcpy(q, Q, w->cols * w->rank * sizeof(float));
  return 0;
}

static int hier_reduce_scatter_lowrank(hier_comm *h, float *send, float *recv, size_t s,
                                       const comm_wire *w) {
  const size_t N = (size_t)h->N, self = (size_t)h->n, f = (w->rows + w->cols) * w->rank;
  lowrank_bufs b;
  int rc = lowrank_scratch(h, s, w, &b);
  if (rc == 0)
    rc = node_partials(h, send, b.partial, s);
  if (rc != 0)
    return rc;
  for (size_t n = 0; n < N && rc == 0; n++)
    if (n == self)
      memset(b.out + n * f, 0, f * sizeof(float)); /* the own partial stays exact */
    else
      rc = lowrank_encode(w, b.partial + n * s, w->error + n * s, w->q + n * w->cols * w->rank, s,
                          b.M, b.out + n * f);
  if (rc != 0)
    return comm_break(&h->base, rc, "reduce_scatter: the low-rank factors failed");
  if ((rc = comm_all_to_all(h->cross, b.out, b.in, f * sizeof(float))) != 0)
    return half_failed(h, "reduce_scatter", rc, h->cross);
  /* recv may be this rank's slice of send, which the node half has read. */
  memcpy(recv, b.partial + self * s, s * sizeof(float));
  for (size_t m = 0; m < N && rc == 0; m++)
    if (m != self)
      rc = zk_lowrank_expand(NULL, b.in + m * f, b.in + m * f + w->rows * w->rank, w->rows, w->cols,
                             w->rank, s, recv, ZK_LOWRANK_ADD);
  return rc == 0 ? 0 : comm_break(&h->base, rc, "reduce_scatter: the low-rank sum failed");
}

static int hier_reduce_scatter_wire(comm *c, float *send, float *recv, size_t s,
                                    const comm_wire *wire) {
  hier_comm *h = (hier_comm *)c;
  if (wire->format == COMM_WIRE_LOWRANK)
    return wire->rank > 0 && wire->rows * wire->cols >= s
               ? hier_reduce_scatter_lowrank(h, send, recv, s, wire)
               : comm_break(c, -EINVAL, "reduce_scatter: bad low-rank shape");
  zk_qformat fmt = {0};
  size_t q = wire_bytes(wire, &fmt, s);
  if (q == 0)
    return comm_break(c, -EINVAL, "reduce_scatter: bad wire block %zu", wire->block);
  size_t N = (size_t)h->N, partial_bytes = N * s * sizeof(float);
  /* partials | encoded out | encoded in | one decoded slice */
  int rc = grow_scratch(h, partial_bytes + 2 * N * q + s * sizeof(float), "reduce_scatter");
  if (rc != 0)
    return rc;
  float *partial = h->scratch;
  uint8_t *out = (uint8_t *)h->scratch + partial_bytes, *in = out + N * q;
  float *decoded = (float *)(in + N * q);
  if ((rc = node_partials(h, send, partial, s)) != 0)
    return rc;
  const size_t self = (size_t)h->n;
  for (size_t n = 0; n < N && rc == 0; n++)
    if (wire->format == COMM_WIRE_ONEBIT)
      rc = n == self ? 0
                     : zk_onebit_encode(NULL, wire->block, partial + n * s, wire->error + n * s, s,
                                        out + n * q, q);
    else
      rc = wire->format == COMM_WIRE_BF16
               ? zk_cast(NULL, out + n * q, ZK_BF16, partial + n * s, ZK_F32, s)
               : zk_quantize(NULL, &fmt, partial + n * s, s, out + n * q, q, NULL);
  if (rc != 0)
    return comm_break(c, rc, "reduce_scatter: encoding the partial sums failed");
  if ((rc = comm_all_to_all(h->cross, out, in, q)) != 0)
    return half_failed(h, "reduce_scatter", rc, h->cross);
  /* recv may be this rank's slice of send, which the node half has read. */
  for (size_t n = 0; n < N && rc == 0; n++) {
    float *to = n == 0 ? recv : decoded;
    if (wire->format == COMM_WIRE_ONEBIT && n == self)
      memcpy(to, partial + n * s, s * sizeof(float)); /* never left the node */
    else if (wire->format == COMM_WIRE_ONEBIT)
      rc = zk_onebit_decode(NULL, wire->block, in + n * q, q, to, s);
    else
      rc = wire->format == COMM_WIRE_BF16 ? zk_cast(NULL, to, ZK_F32, in + n * q, ZK_BF16, s)
                                          : zk_dequantize(NULL, &fmt, in + n * q, q, to, s);
    if (rc == 0 && n > 0)
      for (size_t i = 0; i < s; i++)
        recv[i] += decoded[i];
  }
  if (rc != 0)
    return comm_break(c, rc, "reduce_scatter: decoding the partial sums failed");
  return 0;
}

static int hier_all_reduce(comm *c, void *buf, size_t count, comm_dtype dtype, comm_op op) {
  hier_comm *h = (hier_comm *)c;
  int rc = comm_all_reduce(h->local, buf, count, dtype, op);
  if (rc != 0)
    return half_failed(h, "all_reduce", rc, h->local);
  if ((rc = comm_all_reduce(h->cross, buf, count, dtype, op)) != 0)
    return half_failed(h, "all_reduce", rc, h->cross);
  return 0;
}

static int hier_broadcast(comm *c, void *buf, size_t bytes, int root) {
  hier_comm *h = (hier_comm *)c;
  int root_node = root / h->L, root_local = root % h->L, rc;
  if (h->l == root_local && (rc = comm_broadcast(h->cross, buf, bytes, root_node)) != 0)
    return half_failed(h, "broadcast", rc, h->cross);
  if ((rc = comm_broadcast(h->local, buf, bytes, root_local)) != 0)
    return half_failed(h, "broadcast", rc, h->local);
  return 0;
}

static int hier_barrier(comm *c) {
  hier_comm *h = (hier_comm *)c;
  int rc = comm_barrier(h->local);
  if (rc != 0)
    return half_failed(h, "barrier", rc, h->local);
  if ((rc = comm_barrier(h->cross)) != 0)
    return half_failed(h, "barrier", rc, h->cross);
  if ((rc = comm_barrier(h->local)) != 0)
    return half_failed(h, "barrier", rc, h->local);
  return 0;
}

/* Either half's failure, or an abort: both halves stop, so that the peers
 * of each (this node's ranks, this local index's ranks on other nodes)
 * fail at once too. */
static void hier_abort(comm *c) {
  hier_comm *h = (hier_comm *)c;
  comm_abort(h->local);
  comm_abort(h->cross);
}

static void hier_destroy(comm *c) {
  hier_comm *h = (hier_comm *)c;
  comm_destroy(h->local);
  comm_destroy(h->cross);
  free(h->scratch);
  free(h);
}

static void hier_take_bytes(comm *c, uint64_t bytes[COMM_LEVELS]) {
  hier_comm *h = (hier_comm *)c;
  uint64_t local[COMM_LEVELS], cross[COMM_LEVELS];
  comm_take_bytes(h->local, local);
  comm_take_bytes(h->cross, cross);
  for (int l = 0; l < COMM_LEVELS; l++)
    bytes[l] = local[l] + cross[l];
}

static const comm_ops hier_ops = {
    .name = "hierarchical",
    .all_gather = hier_all_gather,
    .all_gather_node = hier_all_gather_node,
    .reduce_scatter_f32 = hier_reduce_scatter_f32,
    .reduce_scatter_wire = hier_reduce_scatter_wire,
    .all_reduce = hier_all_reduce,
    .broadcast = hier_broadcast,
    .barrier = hier_barrier,
    .abort = hier_abort,
    .destroy = hier_destroy,
    .cancel = hier_abort,
    .take_bytes = hier_take_bytes,
};

int comm_hier_create(const comm_options *options, comm *local, comm *cross, comm **out, char *err,
                     size_t err_bytes) {
  if (out != NULL)
    *out = NULL;
  int rc = -EINVAL;
  if (options == NULL || local == NULL || cross == NULL || out == NULL) {
    comm_format_error(err, err_bytes, "create: options, local, cross and out must not be NULL");
    goto fail;
  }
  int L = comm_world_size(local), l = comm_rank(local);
  int N = comm_world_size(cross), n = comm_rank(cross);
  if (options->world_size != L * N || options->rank != n * L + l) {
    comm_format_error(err, err_bytes,
                      "create: rank %d of %d is not local rank %d of %d on node %d of %d",
                      options->rank, options->world_size, l, L, n, N);
    goto fail;
  }
  hier_comm *h = calloc(1, sizeof *h);
  if (h == NULL) {
    comm_format_error(err, err_bytes, "create: out of memory");
    rc = -ENOMEM;
    goto fail;
  }
  comm_init_base(&h->base, &hier_ops, options);
  h->base.node_ranks = L;
  h->local = local;
  h->cross = cross;
  h->l = l;
  h->L = L;
  h->n = n;
  h->N = N;
  *out = &h->base;
  return 0;
fail:
  comm_destroy(local);
  comm_destroy(cross);
  return rc;
}
