/* comm.c - the public face of comm.h: argument checks, the broken state and
 * the dispatch to a backend (comm_gloo.cc, comm_nccl.c) through its table.
 *
 * Checks that do not depend on the transport live here once, so that both
 * backends reject the same calls with the same messages. A bad argument
 * breaks the communicator like any other failure: the peers have made (or
 * will make) the call this rank refused, so the ranks are out of step and no
 * later collective could be trusted. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "clock.h"
#include "comm_impl.h"

/* ---- shared by the backends ---------------------------------------------- */

void comm_init_base(comm *c, const comm_ops *ops, const comm_options *options) {
  c->ops = ops;
  c->rank = options->rank;
  c->world_size = options->world_size;
  c->timeout_ms = options->timeout_ms;
  c->broken_error = 0;
  c->last_error[0] = '\0';
  c->level = options->level;
  c->moved = 0;
  c->node_ranks = 0;
  c->activity = NULL;
}

const char *comm_act_name(int op) {
  static const char *const names[] = {
      "",           "all_gather", "all_gather_node", "reduce_scatter",
      "all_reduce", "all_to_all", "broadcast",       "barrier"};
  return op >= 0 && op < (int)(sizeof names / sizeof names[0]) ? names[op] : "?";
}

void comm_set_activity(comm *c, comm_activity *a) {
  if (c != NULL)
    c->activity = a;
}

/* A seqlock's write side: one writer (the rank's thread), readers retry. */
static void activity_write_begin(comm_activity *a) {
  __atomic_store_n(&a->seq, __atomic_load_n(&a->seq, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void activity_write_end(comm_activity *a) {
  __atomic_store_n(&a->seq, __atomic_load_n(&a->seq, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
}

static void activity_begin(comm *c, comm_act op) {
  comm_activity *a = c->activity;
  if (a == NULL)
    return;
  activity_write_begin(a);
  __atomic_store_n(&a->since_ns, clock_now_ns(), __ATOMIC_RELAXED);
  __atomic_store_n(&a->calls, __atomic_load_n(&a->calls, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
  __atomic_store_n(&a->op, (int)op, __ATOMIC_RELEASE);
  activity_write_end(a);
}

static int activity_end(comm *c, int rc) {
  comm_activity *a = c->activity;
  if (a == NULL)
    return rc;
  const uint64_t now = clock_now_ns();
  activity_write_begin(a);
  const uint64_t since = __atomic_load_n(&a->since_ns, __ATOMIC_RELAXED);
  __atomic_store_n(&a->busy_ns,
                   __atomic_load_n(&a->busy_ns, __ATOMIC_RELAXED) + (now > since ? now - since : 0),
                   __ATOMIC_RELAXED);
  __atomic_store_n(&a->op, (int)COMM_ACT_NONE, __ATOMIC_RELEASE);
  activity_write_end(a);
  return rc;
}

uint64_t comm_activity_busy_ns(const comm_activity *a, uint64_t now_ns) {
  for (;;) {
    const uint64_t seq = __atomic_load_n(&a->seq, __ATOMIC_ACQUIRE);
    const uint64_t busy = __atomic_load_n(&a->busy_ns, __ATOMIC_RELAXED);
    const uint64_t since = __atomic_load_n(&a->since_ns, __ATOMIC_RELAXED);
    const int op = __atomic_load_n(&a->op, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if ((seq & 1) != 0 || __atomic_load_n(&a->seq, __ATOMIC_RELAXED) != seq)
      continue;
    return busy + (op != COMM_ACT_NONE && now_ns > since ? now_ns - since : 0);
  }
}

/* The backend's call expr, recorded in c's activity as op. */
#define TRACKED(c, op, expr) (activity_begin((c), (op)), activity_end((c), (expr)))

/* A collective that succeeded moved its payload. */
static int counted(comm *c, int rc, uint64_t bytes) {
  if (rc == 0)
    comm_count(c, bytes);
  return rc;
}

int comm_break(comm *c, int error, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->last_error, sizeof c->last_error, fmt, ap);
  va_end(ap);
  const int was_broken = c->broken_error != 0;
  c->broken_error = error;
  if (!was_broken && c->ops->abort != NULL)
    c->ops->abort(c);
  return error;
}

void comm_format_error(char *err, size_t err_bytes, const char *fmt, ...) {
  if (err == NULL || err_bytes == 0)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, err_bytes, fmt, ap);
  va_end(ap);
}

int comm_check_options(const comm_options *options, const store *st, comm **out, char *err,
                       size_t err_bytes) {
  if (options == NULL || st == NULL || st->ops == NULL || out == NULL) {
    comm_format_error(err, err_bytes, "create: options, store and out must not be NULL");
    return -EINVAL;
  }
  if (options->prefix == NULL || options->prefix[0] == '\0' ||
      strnlen(options->prefix, COMM_MAX_PREFIX_BYTES + 1) > COMM_MAX_PREFIX_BYTES) {
    comm_format_error(err, err_bytes,
                      "create: prefix must be a non-empty string of at most %d bytes",
                      COMM_MAX_PREFIX_BYTES);
    return -EINVAL;
  }
  if (options->world_size < 1 || options->world_size > COMM_MAX_WORLD_SIZE) {
    comm_format_error(err, err_bytes, "create: world_size %d is outside [1, %d]",
                      options->world_size, COMM_MAX_WORLD_SIZE);
    return -EINVAL;
  }
  if (options->rank < 0 || options->rank >= options->world_size) {
    comm_format_error(err, err_bytes, "create: rank %d is outside [0, %d)", options->rank,
                      options->world_size);
    return -EINVAL;
  }
  if (options->timeout_ms < 1 || options->timeout_ms > COMM_MAX_TIMEOUT_MS) {
    comm_format_error(err, err_bytes, "create: timeout_ms %d is outside [1, %d]",
                      options->timeout_ms, COMM_MAX_TIMEOUT_MS);
    return -EINVAL;
  }
  return 0;
}

size_t comm_dtype_bytes(comm_dtype dtype) {
  switch (dtype) {
  case COMM_F32:
    return sizeof(float);
  case COMM_F64:
    return sizeof(double);
  case COMM_U8:
    return sizeof(uint8_t);
  case COMM_I64:
    return sizeof(int64_t);
  }
  return 0;
}

/* Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte. Device
 * pointers live in one unified address space with host pointers, so the
 * test means the same for both backends. */
static int ranges_overlap(const void *a, size_t a_bytes, const void *b, size_t b_bytes) {
  uintptr_t a_begin = (uintptr_t)a, b_begin = (uintptr_t)b;
  return a_begin < b_begin + b_bytes && b_begin < a_begin + a_bytes;
}

/* ---- the collectives ------------------------------------------------------ */

int comm_all_gather(comm *c, const void *send, void *recv, size_t bytes_per_rank) {
  if (c == NULL)
    return -EINVAL;
  if (c->broken_error != 0)
    return c->broken_error;
  if (bytes_per_rank == 0)
    return 0;
  if (send == NULL || recv == NULL)
    return comm_break(c, -EINVAL, "all_gather: send and recv must not be NULL");
  if (bytes_per_rank > SIZE_MAX / (size_t)c->world_size)
    return comm_break(c, -EOVERFLOW, "all_gather: %zu bytes per rank times %d ranks overflows",
                      bytes_per_rank, c->world_size);
  const size_t gathered_bytes = bytes_per_rank * (size_t)c->world_size;
  const uint8_t *own_slice = (const uint8_t *)recv + (size_t)c->rank * bytes_per_rank;
  /* In place means send is our own slice of recv; a send that overlaps recv
   * anywhere else would be overwritten by the peers' data while in use. */
  if (send != own_slice && ranges_overlap(send, bytes_per_rank, recv, gathered_bytes))
    return comm_break(c, -EINVAL,
                      "all_gather: send overlaps recv but is not this rank's slice (rank %d)",
                      c->rank);
  return counted(c,
                 TRACKED(c, COMM_ACT_ALL_GATHER, c->ops->all_gather(c, send, recv, bytes_per_rank)),
                 gathered_bytes);
}

int comm_node_ranks(const comm *c) {
  return c != NULL ? c->node_ranks : 0;
}

int comm_all_gather_node(comm *c, const void *send, void *recv, size_t bytes_per_rank) {
  if (c == NULL)
    return -EINVAL;
  if (c->broken_error != 0)
    return c->broken_error;
  if (c->ops->all_gather_node == NULL)
    return comm_break(c, -ENOSYS, "all_gather_node: the %s backend has no node half", c->ops->name);
  if (bytes_per_rank == 0)
    return 0;
  if (send == NULL || recv == NULL)
    return comm_break(c, -EINVAL, "all_gather_node: send and recv must not be NULL");
  /* The node half checks the rest, as for any all-gather of its own. */
  return TRACKED(c, COMM_ACT_ALL_GATHER_NODE,
                 c->ops->all_gather_node(c, send, recv, bytes_per_rank));
}

/* The checks of a reduce-scatter, exact or on the wire: 1 to go on, 0 for
 * nothing to do, or a negative errno (the communicator broken). */
static int reduce_scatter_checked(comm *c, float *send, float *recv, size_t shard_numel) {
  if (c == NULL)
    return -EINVAL;
  if (c->broken_error != 0)
    return c->broken_error;
  if (shard_numel == 0)
    return 0;
  if (send == NULL || recv == NULL)
    return comm_break(c, -EINVAL, "reduce_scatter: send and recv must not be NULL");
  const size_t world = (size_t)c->world_size;
  if (shard_numel > SIZE_MAX / sizeof(float) / world)
    return comm_break(c, -EOVERFLOW,
                      "reduce_scatter: %zu floats per shard times %zu ranks overflows", shard_numel,
                      world);
  const size_t shard_bytes = shard_numel * sizeof(float);
  /* In place means recv is this rank's own shard of send; any other
   * overlap would corrupt chunks still in flight. */
  const float *own_shard = send + (size_t)c->rank * shard_numel;
  if (recv != own_shard && ranges_overlap(send, shard_bytes * world, recv, shard_bytes))
    return comm_break(c, -EINVAL,
                      "reduce_scatter: recv overlaps send but is not this rank's shard (rank %d)",
                      c->rank);
  return 1;
}

int comm_reduce_scatter_f32(comm *c, float *send, float *recv, size_t shard_numel) {
  int rc = reduce_scatter_checked(c, send, recv, shard_numel);
  if (rc <= 0)
    return rc;
  return counted(
      c,
      TRACKED(c, COMM_ACT_REDUCE_SCATTER, c->ops->reduce_scatter_f32(c, send, recv, shard_numel)),
      shard_numel * sizeof(float) * (size_t)c->world_size);
}

int comm_reduce_scatter_f32_wire(comm *c, float *send, float *recv, size_t shard_numel,
                                 const comm_wire *wire) {
  if (c == NULL || wire == NULL || wire->format == COMM_WIRE_F32 ||
      c->ops->reduce_scatter_wire == NULL)
    return comm_reduce_scatter_f32(c, send, recv, shard_numel);
  int rc = reduce_scatter_checked(c, send, recv, shard_numel);
  if (rc <= 0)
    return rc;
  if ((wire->format == COMM_WIRE_ONEBIT || wire->format == COMM_WIRE_LOWRANK) &&
      (wire->error == NULL || (wire->format == COMM_WIRE_LOWRANK && wire->q == NULL)))
    return comm_break(c, -EINVAL, "reduce_scatter: compressed wire without its error feedback");
  if (wire->format != COMM_WIRE_BF16 && wire->format != COMM_WIRE_INT8 &&
      wire->format != COMM_WIRE_INT4 && wire->format != COMM_WIRE_ONEBIT &&
      wire->format != COMM_WIRE_LOWRANK)
    return comm_break(c, -EINVAL, "reduce_scatter: unknown wire format %d", (int)wire->format);
  /* Its halves count their own bytes (comm_take_bytes). */
  return TRACKED(c, COMM_ACT_REDUCE_SCATTER,
                 c->ops->reduce_scatter_wire(c, send, recv, shard_numel, wire));
}

int comm_all_reduce(comm *c, void *buf, size_t count, comm_dtype dtype, comm_op op) {
  if (c == NULL)
    return -EINVAL;
  if (c->broken_error != 0)
    return c->broken_error;
  const size_t element_bytes = comm_dtype_bytes(dtype);
  if (element_bytes == 0)
    return comm_break(c, -EINVAL, "all_reduce: unknown dtype %d", (int)dtype);
  if (op != COMM_SUM && op != COMM_MAX && op != COMM_MIN)
    return comm_break(c, -EINVAL, "all_reduce: unknown op %d", (int)op);
  if (count == 0)
    return 0;
  if (buf == NULL)
    return comm_break(c, -EINVAL, "all_reduce: buf must not be NULL");
  if (count > SIZE_MAX / element_bytes)
    return comm_break(c, -EOVERFLOW, "all_reduce: %zu elements overflow", count);
  return counted(c, TRACKED(c, COMM_ACT_ALL_REDUCE, c->ops->all_reduce(c, buf, count, dtype, op)),
                 count * element_bytes);
}

int comm_all_to_all(comm *c, const void *send, void *recv, size_t bytes_per_rank) {
  if (c == NULL)
    return -EINVAL;
  if (c->broken_error != 0)
    return c->broken_error;
  if (c->ops->all_to_all == NULL)
    return comm_break(c, -ENOSYS, "all_to_all: the %s backend has none", c->ops->name);
  if (bytes_per_rank == 0)
    return 0;
  if (send == NULL || recv == NULL)
    return comm_break(c, -EINVAL, "all_to_all: send and recv must not be NULL");
  if (bytes_per_rank > SIZE_MAX / (size_t)c->world_size)
    return comm_break(c, -EOVERFLOW, "all_to_all: %zu bytes per rank times %d ranks overflows",
                      bytes_per_rank, c->world_size);
  const size_t total = bytes_per_rank * (size_t)c->world_size;
  if (ranges_overlap(send, total, recv, total))
    return comm_break(c, -EINVAL, "all_to_all: send and recv overlap");
  return counted(
      c, TRACKED(c, COMM_ACT_ALL_TO_ALL, c->ops->all_to_all(c, send, recv, bytes_per_rank)), total);
}

int comm_broadcast(comm *c, void *buf, size_t bytes, int root) {
  if (c == NULL)
    return -EINVAL;
  if (c->broken_error != 0)
    return c->broken_error;
  if (root < 0 || root >= c->world_size)
    return comm_break(c, -EINVAL, "broadcast: root %d is outside [0, %d)", root, c->world_size);
  if (bytes == 0)
    return 0;
  if (buf == NULL)
    return comm_break(c, -EINVAL, "broadcast: buf must not be NULL");
  return counted(c, TRACKED(c, COMM_ACT_BROADCAST, c->ops->broadcast(c, buf, bytes, root)), bytes);
}

int comm_barrier(comm *c) {
  if (c == NULL)
    return -EINVAL;
  if (c->broken_error != 0)
    return c->broken_error;
  return TRACKED(c, COMM_ACT_BARRIER, c->ops->barrier(c));
}

/* ---- the rest ------------------------------------------------------------- */

int comm_rank(const comm *c) {
  return c != NULL ? c->rank : -EINVAL;
}

int comm_world_size(const comm *c) {
  return c != NULL ? c->world_size : -EINVAL;
}

const char *comm_last_error(const comm *c) {
  return c != NULL ? c->last_error : "comm: NULL communicator";
}

void comm_take_bytes(comm *c, uint64_t bytes[COMM_LEVELS]) {
  for (int l = 0; l < COMM_LEVELS; l++)
    bytes[l] = 0;
  if (c == NULL)
    return;
  if (c->ops->take_bytes != NULL) {
    c->ops->take_bytes(c, bytes);
    return;
  }
  bytes[c->level] = c->moved;
  c->moved = 0;
}

void comm_destroy(comm *c) {
  if (c != NULL)
    c->ops->destroy(c);
}

void comm_abort(comm *c) {
  if (c != NULL && c->ops->cancel != NULL)
    c->ops->cancel(c);
}
