/* comm_impl.h - what the backends of comm.h share; private to comm.c,
 * comm_gloo.cc and comm_nccl.c.
 *
 * A communicator is a backend's own struct whose first member (C) or base
 * class (C++) is `struct comm`: the table of operations, the rank's place in
 * the world, and the error state that makes a broken communicator fail
 * fast. comm.c owns the public entry points: it checks the arguments every
 * backend would check the same way, fails fast once the communicator is
 * broken, and only then calls the backend through the table, so a backend
 * sees valid arguments and a healthy communicator. A backend that fails
 * breaks the communicator with comm_break(), which records the message and
 * calls the backend's abort so that no transfer can still touch the
 * caller's buffers. */
#ifndef ZEROD_COMM_IMPL_H
#define ZEROD_COMM_IMPL_H

#include <stdarg.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* comm.h is C without linkage guards of its own. */
#include "comm.h"

/* Limits on the options, checked before anything is allocated. */
#define COMM_MAX_WORLD_SIZE   65536
#define COMM_MAX_PREFIX_BYTES 512
#define COMM_MAX_TIMEOUT_MS   (24 * 3600 * 1000)

typedef struct comm_ops {
  const char *name; /* "gloo", "nccl": for messages */
  /* The collectives, called by comm.c with checked arguments (non-zero
   * sizes, non-NULL buffers, no overflow, in-place or disjoint buffers, a
   * valid root, dtype and op) on a communicator that is not broken. Each
   * returns 0, or the result of comm_break(). */
  int (*all_gather)(comm *c, const void *send, void *recv, size_t bytes_per_rank);
  int (*reduce_scatter_f32)(comm *c, float *send, float *recv, size_t shard_numel);
  int (*all_reduce)(comm *c, void *buf, size_t count, comm_dtype dtype, comm_op op);
  /* A reduce-scatter whose cross-node half travels encoded (hierarchical
   * communicators; NULL elsewhere: the exact one is used). */
  int (*reduce_scatter_wire)(comm *c, float *send, float *recv, size_t shard_numel,
                             const comm_wire *wire);
  /* The node half's all-gather (hierarchical communicators; NULL
   * elsewhere: comm_all_gather_node fails with -ENOSYS). Counts its own
   * bytes, at the node level. */
  int (*all_gather_node)(comm *c, const void *send, void *recv, size_t bytes_per_rank);
  /* NULL where the backend has none: comm_all_to_all fails with -ENOSYS. */
  int (*all_to_all)(comm *c, const void *send, void *recv, size_t bytes_per_rank);
  int (*broadcast)(comm *c, void *buf, size_t bytes, int root);
  int (*barrier)(comm *c);
  /* Called once, by comm_break, when the communicator breaks: stops every
   * transfer in flight and tells the peers where the transport can, without
   * waiting for them. */
  void (*abort)(comm *c);
  /* Frees the communicator, healthy or broken, without waiting for peers. */
  void (*destroy)(comm *c);
  /* comm_abort: called from another thread, possibly while the owner is
   * inside a collective, which must then return at once; later calls fail
   * fast. Touches only what is safe to touch concurrently with a call. */
  void (*cancel)(comm *c);
  /* comm_take_bytes of a communicator made of others (NULL: its own
   * counts, which comm.c keeps after each successful call). */
  void (*take_bytes)(comm *c, uint64_t bytes[COMM_LEVELS]);
} comm_ops;

struct comm {
  const comm_ops *ops;
  int rank;
  int world_size;
  int timeout_ms;
  /* 0, or the negative errno of the failure that broke the communicator. */
  int broken_error;
  comm_level level;        /* options->level */
  int node_ranks;          /* a hierarchical communicator's L; 0 for others */
  uint64_t moved;          /* payload bytes since the last comm_take_bytes */
  comm_activity *activity; /* comm_set_activity, or NULL */
  char last_error[512];
};

/* Sets the common fields of a freshly allocated communicator. */
void comm_init_base(comm *c, const comm_ops *ops, const comm_options *options);

/* Breaks c: records the message as its last error, remembers error for
 * every later call, calls ops->abort (once) and returns error. */
__attribute__((format(printf, 3, 4))) int comm_break(comm *c, int error, const char *fmt, ...);

/* Checks the options common to every backend (NULL pointers, prefix, rank,
 * world size, timeout), writing the reason into err. 0 or -EINVAL. */
int comm_check_options(const comm_options *options, const store *st, comm **out, char *err,
                       size_t err_bytes);

/* snprintf into a caller's error buffer that may be NULL or empty. */
__attribute__((format(printf, 3, 4))) void comm_format_error(char *err, size_t err_bytes,
                                                             const char *fmt, ...);

/* comm_local.c, for comm_hier.c: a collective of the caller's own making
 * between the local group's ranks. comm_local_begin publishes `mine` (and
 * `size`, which every rank must pass alike with the same `what`), meets the
 * ranks and sets *peers to every rank's `mine` ([world_size]; valid until
 * comm_local_end), which meets them again: after it nobody reads another's
 * buffer. Bytes are not counted (the caller does: comm_count). */
int comm_local_begin(comm *local, const char *what, const void *mine, size_t size,
                     const void *const **peers);
int comm_local_end(comm *local, const char *what);

/* Adds bytes to c's count (comm.c does it for the collectives it passes
 * on; a backend that moves bytes outside them counts them itself). */
static inline void comm_count(comm *c, uint64_t bytes) {
  c->moved += bytes;
}

/* Bytes of one element of dtype, 0 for an unknown dtype. */
size_t comm_dtype_bytes(comm_dtype dtype);

#ifdef __cplusplus
}
#endif

#endif /* ZEROD_COMM_IMPL_H */
