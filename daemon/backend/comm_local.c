/* comm_local - the collectives between ranks that are threads of one
 * process (comm.h: comm_local_create): a node daemon's host ranks of a job
 * whose ranks all live on this node.
 *
 * No transport: each collective publishes the rank's buffers in the
 * group's slots, meets its peers at a barrier, reads what it needs from
 * their buffers (copies for a gather or a broadcast, sums in rank order
 * for a reduction) and meets them at a second barrier, after which nobody
 * reads its buffers any more and it may return. The second barrier waits
 * for every rank even when the group breaks in between (release). A reduction adds the ranks'
 * values in rank order, ((g0 + g1) + g2) + ..., element by element: the
 * same bits as the Gloo backend and a sequential sum.
 *
 * A barrier that waits longer than the communicator's timeout breaks the
 * group for every rank (-ETIMEDOUT), as a stuck peer does over Gloo; so do
 * an abort (comm_abort, a failure on any rank) and a rank leaving
 * (comm_destroy): its peers' calls fail at once instead of waiting. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "comm_impl.h"

/* A reduction works through its slice in chunks of this many elements, so
 * that the running sum stays in cache while each rank's values are added. */
#define SUM_CHUNK 8192

/* What a rank published for the collective under way: its buffers, and
 * the call, which every rank must have made alike before any reads a
 * peer's buffer (ranks whose workers sent different requests would
 * otherwise read past each other's buffers). */
typedef struct slot {
  const void *send;
  void *recv;
  const char *what; /* the collective's name (a literal) */
  size_t size;      /* bytes per rank, elements, or bytes */
  int dtype, op, root;
} slot;

struct comm_local_group {
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  int world_size;
  int refs;
  uint64_t arrived, phase; /* the barrier: arrivals in this phase, phases done */
  int error;               /* 0, or why the group broke (every rank fails with it) */
  char why[256];
  slot *slots;       /* [world_size], each written by its rank between barriers */
  uint64_t *arrival; /* [world_size]: the phase + 1 of each rank's last arrival */
};

typedef struct local_comm {
  comm base;
  comm_local_group *group;
  const void **peers; /* [world_size]: comm_local_begin's answer */
} local_comm;

int comm_local_group_create(int world_size, comm_local_group **out) {
  *out = NULL;
  if (world_size < 1 || world_size > COMM_MAX_WORLD_SIZE)
    return -EINVAL;
  comm_local_group *g = calloc(1, sizeof *g);
  if (g == NULL || (g->slots = calloc((size_t)world_size, sizeof *g->slots)) == NULL ||
      (g->arrival = calloc((size_t)world_size, sizeof *g->arrival)) == NULL) {
    if (g != NULL)
      free(g->slots);
    free(g);
    return -ENOMEM;
  }
  pthread_mutex_init(&g->mutex, NULL);
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&g->cond, &attr);
  pthread_condattr_destroy(&attr);
  g->world_size = world_size;
  g->refs = 1;
  *out = g;
  return 0;
}

void comm_local_group_ref(comm_local_group *g) {
  pthread_mutex_lock(&g->mutex);
  g->refs++;
  pthread_mutex_unlock(&g->mutex);
}

void comm_local_group_unref(comm_local_group *g) {
  if (g == NULL)
    return;
  pthread_mutex_lock(&g->mutex);
  int last = --g->refs == 0;
  pthread_mutex_unlock(&g->mutex);
  if (!last)
    return;
  pthread_mutex_destroy(&g->mutex);
  pthread_cond_destroy(&g->cond);
  free(g->slots);
  free(g->arrival);
  free(g);
}

/* Breaks the group for every rank (the first reason wins) and wakes them. */
static void group_break(comm_local_group *g, int error, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void group_break(comm_local_group *g, int error, const char *fmt, ...) {
  pthread_mutex_lock(&g->mutex);
  if (g->error == 0) {
    g->error = error;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->why, sizeof g->why, fmt, ap);
    va_end(ap);
  }
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->mutex);
}

void comm_local_group_cancel(comm_local_group *g) {
  group_break(g, -ECANCELED, "the group was cancelled");
}

/* Sets the group's timeout error, naming the first rank missing from the
 * phase, and wakes the others. Called with the mutex held. */
static void group_timed_out(comm_local_group *g, uint64_t phase, int timeout_ms) {
  int missing = 0;
  while (missing < g->world_size && g->arrival[missing] == phase + 1)
    missing++;
  g->error = -ETIMEDOUT;
  snprintf(g->why, sizeof g->why,
           "timed out after %d ms waiting for rank %d (peer dead or not calling)", timeout_ms,
           missing);
  pthread_cond_broadcast(&g->cond);
}

/* Waits for every rank of the group to arrive for the collective what. 0,
 * or the group's error, after which the caller's communicator is broken
 * with its reason (worded as the Gloo backend words it).
 *
 * A closing barrier (release: after publish, when the ranks read each
 * other's buffers) waits for every rank even if the group has broken
 * meanwhile: a peer past publish may still be copying from this rank's
 * buffers, which the caller frees when it returns. Such a peer is not
 * blocked on anything (it is copying or adding) and arrives; once the
 * timeout has passed, the wait goes on without one. */
static int barrier_wait(local_comm *lc, const char *what, int release) {
  comm_local_group *g = lc->group;
  struct timespec deadline = clock_deadline_ms(lc->base.timeout_ms);
  pthread_mutex_lock(&g->mutex);
  const int entry_error = g->error;
  int rc = entry_error;
  if (rc == 0 || release) {
    uint64_t phase = g->phase;
    g->arrival[lc->base.rank] = phase + 1;
    if (++g->arrived == (uint64_t)g->world_size) {
      g->arrived = 0;
      g->phase++;
      pthread_cond_broadcast(&g->cond);
    } else {
      int timed_out = 0;
      while (g->phase == phase && (release || g->error == 0)) {
        if (timed_out) {
          pthread_cond_wait(&g->cond, &g->mutex);
        } else if (pthread_cond_timedwait(&g->cond, &g->mutex, &deadline) == ETIMEDOUT) {
          timed_out = 1;
          if (g->phase == phase && g->error == 0)
            group_timed_out(g, phase, lc->base.timeout_ms);
        }
      }
    }
    rc = entry_error != 0 ? entry_error : g->phase != phase ? 0 : g->error;
  }
  char why[sizeof g->why];
  memcpy(why, g->why, sizeof why);
  pthread_mutex_unlock(&g->mutex);
  if (rc == -ECANCELED)
    return comm_break(&lc->base, rc, "%s: communicator aborted", what);
  if (rc != 0)
    return comm_break(&lc->base, rc, "%s: %s", what, why);
  return 0;
}

static int barrier(local_comm *lc, const char *what) {
  return barrier_wait(lc, what, 0);
}

/* The closing barrier of a collective: after it, no peer reads this
 * rank's buffers (barrier_wait). */
static int release(local_comm *lc, const char *what) {
  return barrier_wait(lc, what, 1);
}

/* Publishes the rank's buffers and its call and meets the others: after
 * it, every rank's slot is readable until the closing barrier. If the
 * ranks made different calls, every one of them sees it in the same slots
 * and fails (-EPROTO), and none reads a peer's buffer. */
static int publish(local_comm *lc, slot mine) {
  comm_local_group *g = lc->group;
  g->slots[lc->base.rank] = mine;
  int rc = barrier(lc, mine.what);
  if (rc != 0)
    return rc;
  for (int r = 0; r < g->world_size; r++) {
    const slot *s = &g->slots[r];
    if (strcmp(s->what, mine.what) != 0 || s->size != mine.size || s->dtype != mine.dtype ||
        s->op != mine.op || s->root != mine.root) {
      group_break(g, -EPROTO, "ranks are out of step");
      return comm_break(&lc->base, -EPROTO,
                        "%s: ranks are out of step: rank %d called %s (size %zu), rank %d %s "
                        "(size %zu)",
                        mine.what, lc->base.rank, mine.what, mine.size, r, s->what, s->size);
    }
  }
  return 0;
}

static int local_all_gather(comm *c, const void *send, void *recv, size_t bytes_per_rank) {
  local_comm *lc = (local_comm *)c;
  int rc =
      publish(lc, (slot){.send = send, .recv = recv, .what = "all_gather", .size = bytes_per_rank});
  if (rc != 0)
    return rc;
  const slot *slots = lc->group->slots;
  for (int r = 0; r < c->world_size; r++) {
    uint8_t *to = (uint8_t *)recv + (size_t)r * bytes_per_rank;
    if (slots[r].send != to)
      memcpy(to, slots[r].send, bytes_per_rank);
  }
  return release(lc, "all_gather");
}

static int local_reduce_scatter_f32(comm *c, float *send, float *recv, size_t shard_numel) {
  local_comm *lc = (local_comm *)c;
  int rc = publish(
      lc, (slot){.send = send, .recv = recv, .what = "reduce_scatter", .size = shard_numel});
  if (rc != 0)
    return rc;
  const slot *slots = lc->group->slots;
  size_t base = (size_t)c->rank * shard_numel;
  /* The sum of a chunk is made aside: recv may be this rank's own slice of
   * its send (in place), whose values are still to be added. */
  float acc[SUM_CHUNK];
  for (size_t at = 0; at < shard_numel; at += SUM_CHUNK) {
    size_t n = shard_numel - at < SUM_CHUNK ? shard_numel - at : SUM_CHUNK;
    memcpy(acc, (const float *)slots[0].send + base + at, n * sizeof(float));
    for (int r = 1; r < c->world_size; r++) {
      const float *from = (const float *)slots[r].send + base + at;
      for (size_t i = 0; i < n; i++)
        acc[i] += from[i];
    }
    memcpy(recv + at, acc, n * sizeof(float));
  }
  return release(lc, "reduce_scatter");
}

/* out = op over the ranks' bufs, in rank order. */
#define REDUCE_INTO(type, out, count, op)                                                          \
  do {                                                                                             \
    type *o = (type *)(out);                                                                       \
    memcpy(o, slots[0].recv, (count) * sizeof(type));                                              \
    for (int r = 1; r < c->world_size; r++) {                                                      \
      const type *v = (const type *)slots[r].recv;                                                 \
      for (size_t i = 0; i < (count); i++)                                                         \
        o[i] = (op) == COMM_SUM   ? (type)(o[i] + v[i])                                            \
               : (op) == COMM_MAX ? (o[i] > v[i] ? o[i] : v[i])                                    \
                                  : (o[i] < v[i] ? o[i] : v[i]);                                   \
    }                                                                                              \
  } while (0)

static size_t dtype_bytes(comm_dtype dtype) {
  switch (dtype) {
  case COMM_F32:
    return 4;
  case COMM_F64:
  case COMM_I64:
    return 8;
  case COMM_U8:
    return 1;
  }
  return 1;
}

static int local_all_reduce(comm *c, void *buf, size_t count, comm_dtype dtype, comm_op op) {
  local_comm *lc = (local_comm *)c;
  size_t bytes = count * dtype_bytes(dtype);
  /* Everyone reads every buf: the result waits in a buffer of this rank's
   * own until the closing barrier. */
  void *out = malloc(bytes);
  if (out == NULL)
    return comm_break(c, -ENOMEM, "local: all_reduce of %zu bytes: out of memory", bytes);
  int rc = publish(
      lc,
      (slot){.recv = buf, .what = "all_reduce", .size = count, .dtype = (int)dtype, .op = (int)op});
  if (rc != 0) {
    free(out);
    return rc;
  }
  const slot *slots = lc->group->slots;
  switch (dtype) {
  case COMM_F32:
    REDUCE_INTO(float, out, count, op);
    break;
  case COMM_F64:
    REDUCE_INTO(double, out, count, op);
    break;
  case COMM_I64:
    REDUCE_INTO(int64_t, out, count, op);
    break;
  case COMM_U8:
    REDUCE_INTO(uint8_t, out, count, op);
    break;
  }
  rc = release(lc, "all_reduce");
  if (rc == 0)
    memcpy(buf, out, bytes);
  free(out);
  return rc;
}

static int local_all_to_all(comm *c, const void *send, void *recv, size_t bytes) {
  local_comm *lc = (local_comm *)c;
  int rc = publish(lc, (slot){.send = send, .recv = recv, .what = "all_to_all", .size = bytes});
  if (rc != 0)
    return rc;
  const slot *slots = lc->group->slots;
  for (int r = 0; r < c->world_size; r++)
    memcpy((uint8_t *)recv + (size_t)r * bytes,
           (const uint8_t *)slots[r].send + (size_t)c->rank * bytes, bytes);
  return release(lc, "all_to_all");
}

static int local_broadcast(comm *c, void *buf, size_t bytes, int root) {
  local_comm *lc = (local_comm *)c;
  int rc = publish(lc, (slot){.recv = buf, .what = "broadcast", .size = bytes, .root = root});
  if (rc != 0)
    return rc;
  if (c->rank != root)
    memcpy(buf, lc->group->slots[root].recv, bytes);
  return release(lc, "broadcast");
}

static int local_barrier(comm *c) {
  /* Published too, so that a rank in a barrier and a peer in another
   * collective find out instead of reading stale slots. */
  local_comm *lc = (local_comm *)c;
  int rc = publish(lc, (slot){.what = "barrier"});
  return rc != 0 ? rc : release(lc, "barrier");
}

static void local_abort(comm *c) {
  local_comm *lc = (local_comm *)c;
  group_break(lc->group, -ECONNABORTED, "rank %d failed: %s", c->rank, c->last_error);
}

static void local_cancel(comm *c) {
  local_comm *lc = (local_comm *)c;
  group_break(lc->group, -ECANCELED, "rank %d's communicator was aborted", c->rank);
}

static void local_destroy(comm *c) {
  local_comm *lc = (local_comm *)c;
  /* A peer still waiting for this rank would wait in vain. */
  group_break(lc->group, -ECONNRESET, "rank %d left", c->rank);
  comm_local_group_unref(lc->group);
  free(lc->peers);
  free(lc);
}

int comm_local_begin(comm *c, const char *what, const void *mine, size_t size,
                     const void *const **peers) {
  local_comm *lc = (local_comm *)c;
  if (c->broken_error != 0)
    return c->broken_error;
  int rc = publish(lc, (slot){.send = mine, .what = what, .size = size});
  if (rc != 0)
    return rc;
  for (int r = 0; r < c->world_size; r++)
    lc->peers[r] = lc->group->slots[r].send;
  *peers = lc->peers;
  return 0;
}

int comm_local_end(comm *c, const char *what) {
  /* Met even by a broken communicator: its peers may still be reading the
   * buffer it published at comm_local_begin. */
  return release((local_comm *)c, what);
}

static const comm_ops local_ops = {
    .name = "local",
    .all_gather = local_all_gather,
    .reduce_scatter_f32 = local_reduce_scatter_f32,
    .all_reduce = local_all_reduce,
    .all_to_all = local_all_to_all,
    .broadcast = local_broadcast,
    .barrier = local_barrier,
    .abort = local_abort,
    .destroy = local_destroy,
    .cancel = local_cancel,
};

int comm_local_create(const comm_options *options, comm_local_group *group, comm **out, char *err,
                      size_t err_bytes) {
  if (out != NULL)
    *out = NULL;
  if (options == NULL || group == NULL || out == NULL) {
    comm_format_error(err, err_bytes, "create: options, group and out must not be NULL");
    return -EINVAL;
  }
  if (options->world_size != group->world_size || options->rank < 0 ||
      options->rank >= options->world_size) {
    comm_format_error(err, err_bytes, "create: rank %d of %d does not fit a group of %d",
                      options->rank, options->world_size, group->world_size);
    return -EINVAL;
  }
  if (options->timeout_ms <= 0 || options->timeout_ms > COMM_MAX_TIMEOUT_MS) {
    comm_format_error(err, err_bytes, "create: timeout must be 1..%d ms", COMM_MAX_TIMEOUT_MS);
    return -EINVAL;
  }
  local_comm *lc = calloc(1, sizeof *lc);
  if (lc != NULL && (lc->peers = calloc((size_t)options->world_size, sizeof *lc->peers)) == NULL) {
    free(lc);
    lc = NULL;
  }
  if (lc == NULL) {
    comm_format_error(err, err_bytes, "create: out of memory");
    return -ENOMEM;
  }
  comm_init_base(&lc->base, &local_ops, options);
  comm_local_group_ref(group);
  lc->group = group;
  /* The rendezvous: every rank has its communicator before any uses it. */
  int rc = barrier(lc, "rendezvous");
  if (rc != 0) {
    comm_format_error(err, err_bytes, "%s", lc->base.last_error);
    comm_local_group_unref(group);
    free(lc->peers);
    free(lc);
    return rc;
  }
  *out = &lc->base;
  return 0;
}
