/* The rendezvous store: a small key-value interface through which the ranks
 * of a job find each other (Gloo's pair addresses, later NCCL's unique id).
 *
 * In standalone mode it is store_mem (in this process); the coordinator's
 * Rendezvous KV backs it in cluster mode (store_grpc). Implementations
 * must be thread-safe: every rank's executor thread uses the store at once.
 * Keys are NUL-terminated strings; values are byte strings. */
#ifndef ZEROD_STORE_H
#define ZEROD_STORE_H

#include <stddef.h>

typedef struct store store;

typedef struct store_ops {
  /* Sets key to a copy of value. Returns 0 or a negative errno. */
  int (*set)(store *st, const char *key, const void *value, size_t value_bytes);
  /* Waits up to timeout_ms for key, then returns a malloc'd copy of its
   * value (caller frees). Returns 0, -ETIMEDOUT, or a negative errno. */
  int (*get)(store *st, const char *key, void **value, size_t *value_bytes, int timeout_ms);
  /* Deletes every key starting with prefix. Returns 0 or a negative errno. */
  int (*delete_prefix)(store *st, const char *prefix);
  void (*destroy)(store *st);
} store_ops;

struct store {
  const store_ops *ops;
};

/* An in-process store: a hash table under a mutex, waiters on a condition
 * variable. */
int store_mem_create(store **out);
/* Makes waits for a key that is not there give up at once (-ECANCELED),
 * those in progress and later ones; keys that are there are still read, so
 * ranks that have all published finish their rendezvous. The daemon is
 * stopping: a rank must not wait for peers whose executors stop first. */
void store_mem_stop(store *st);

/* The coordinator's Rendezvous service (store_grpc.c): keys must be
 * "<job>/<epoch>/<key>". The channel stays the caller's and must outlive
 * the store. */
struct rpc_channel;
int store_grpc_create(struct rpc_channel *channel, store **out);
/* Makes calls in progress give up within about a second (-ECANCELED), and
 * later ones at once: the daemon is stopping. */
void store_grpc_stop(store *st);

#endif /* ZEROD_STORE_H */
