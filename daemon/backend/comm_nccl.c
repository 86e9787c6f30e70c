/* comm_nccl.c - the NCCL backend of comm.h: collectives between the GPU
 * ranks of a job, on device memory.
 *
 * Plain C that reaches CUDA and NCCL only through the CUDA module's table
 * (zk_cuda.h), so zerod links nothing from CUDA and runs where there is
 * none; without the module comm_nccl_create fails with -ENODEV, without
 * libnccl.so.2 with -ENOSYS.
 *
 * Rendezvous: rank 0 asks NCCL for a unique id and puts its 128 bytes under
 * "<prefix>/nccl-id" in the store; the other ranks wait for it. The
 * communicator is created non-blocking, so that a rank that never comes
 * cannot hang us inside NCCL: we poll its state until it is connected or
 * the timeout, and abort it then. Once rank 0 sees it connected, every rank
 * has read the id and rank 0 deletes the key.
 *
 * Collectives: comm.h promises blocking calls with a timeout. Each call
 * enqueues the NCCL collective on the rank's stream, records one event
 * (created with the communicator) after it and polls that event and the
 * communicator's asynchronous error until the event completes, NCCL reports
 * an error (a peer died: -ECONNRESET or -EIO) or the timeout passes
 * (-ETIMEDOUT). Any failure aborts the NCCL communicator, which stops its
 * kernels, so nothing still queued can touch the caller's buffers, and
 * breaks ours: every later call fails fast with the same error (comm.c).
 *
 * Results: the sums are NCCL's, whose order depends on NCCL's algorithm
 * (ring, tree) and the topology, not on rank order. comm.h's reduce-scatter
 * promise of a rank-order sum, which the Gloo backend keeps, does not hold
 * here: fp32 results may differ from Gloo's or a sequential sum in the last
 * bits. They are the same run to run on one topology and NCCL version
 * (NCCL's reductions are deterministic for a fixed configuration).
 *
 * Threads: like every comm call, these run on the rank's executor thread,
 * whose current device is the rank's device (the module's entries act on
 * the calling thread's current device). */
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "comm_impl.h"
#include "cuda/zk_cuda.h"

/* Create polls the connection every 1 ms at first, backing off to 10 ms:
 * connecting takes tens of milliseconds at least, and the poll is cheap. */
#define CONNECT_POLL_FIRST_US 1000
#define CONNECT_POLL_MAX_US   10000
/* A collective may take a few microseconds; sleeping a whole millisecond
 * before the first look would dominate small ones. Start at 10 us and back
 * off to 1 ms, so a long collective costs at most ~1000 polls a second. */
#define COLLECTIVE_POLL_FIRST_US 10
#define COLLECTIVE_POLL_MAX_US   1000

#define NCCL_ID_KEY_SUFFIX "/nccl-id"

typedef struct nccl_comm {
  comm base; /* first, so a comm * is an nccl_comm * */
  const zk_cuda_api *api;
  void *nccl;          /* ncclComm_t; NULL once aborted */
  void *stream;        /* cudaStream_t of the rank, the caller's */
  void *done_event;    /* recorded after each collective */
  void *barrier_value; /* 8 device bytes that the barrier all-reduces */
  int device;          /* for messages; -1 if unknown */
  /* Set by comm_abort, from another thread: the owner's waits give up. */
  _Atomic int cancelled;
} nccl_comm;

static nccl_comm *nccl_of(comm *c) {
  return (nccl_comm *)c;
}

/* ---- time ------------------------------------------------------------------ */

/* Sleeps *delay_us and doubles it, up to max_us. */
static void sleep_backoff(long *delay_us, long max_us) {
  struct timespec ts = {*delay_us / 1000000, (*delay_us % 1000000) * 1000};
  nanosleep(&ts, NULL);
  *delay_us = *delay_us * 2 < max_us ? *delay_us * 2 : max_us;
}

/* ---- the operations ---------------------------------------------------------- */

/* Waits for the collective just enqueued on the rank's stream. */
static int wait_collective(nccl_comm *nc, const char *op_name) {
  const zk_cuda_api *api = nc->api;
  comm *c = &nc->base;
  int rc = api->event_record(nc->done_event, nc->stream);
  if (rc != 0)
    return comm_break(c, rc, "%s: recording the completion event failed: %s", op_name,
                      api->last_error());
  const int64_t deadline_us = clock_now_us() + (int64_t)c->timeout_ms * 1000;
  long delay_us = COLLECTIVE_POLL_FIRST_US;
  for (;;) {
    rc = api->event_query(nc->done_event);
    if (rc == 0)
      return 0;
    if (rc != -EAGAIN)
      return comm_break(c, rc, "%s: CUDA error while waiting for the collective: %s", op_name,
                        api->last_error());
    /* comm_abort: the abort that comm_break makes here, on the owner's
     * thread, stops the collective's kernels. */
    if (atomic_load(&nc->cancelled))
      return comm_break(c, -ECANCELED, "%s: communicator aborted", op_name);
    /* A dead peer shows as the communicator's asynchronous error, while
     * our event would simply never complete. */
    rc = api->nccl_status(nc->nccl);
    if (rc != 0 && rc != -EAGAIN)
      return comm_break(c, rc, "%s: NCCL failed (rank %d of %d): %s", op_name, c->rank,
                        c->world_size, api->last_error());
    if (clock_now_us() >= deadline_us)
      return comm_break(c, -ETIMEDOUT,
                        "%s: timed out after %d ms waiting for the NCCL collective (rank %d of "
                        "%d; a peer is dead, stuck or not calling)",
                        op_name, c->timeout_ms, c->rank, c->world_size);
    sleep_backoff(&delay_us, COLLECTIVE_POLL_MAX_US);
  }
}

/* The end of every collective: an enqueue that failed breaks the
 * communicator, one that succeeded is waited for. */
static int finish_collective(nccl_comm *nc, const char *op_name, int enqueue_rc) {
  if (enqueue_rc != 0)
    return comm_break(&nc->base, enqueue_rc, "%s: NCCL did not accept the collective: %s", op_name,
                      nc->api->last_error());
  return wait_collective(nc, op_name);
}

static int nccl_all_gather_op(comm *c, const void *send, void *recv, size_t bytes_per_rank) {
  nccl_comm *nc = nccl_of(c);
  /* NCCL's in-place all-gather is ours: send is recv's slice of this rank. */
  int rc = nc->api->nccl_all_gather(nc->nccl, send, recv, bytes_per_rank, nc->stream);
  return finish_collective(nc, "all_gather", rc);
}

static int nccl_reduce_scatter_op(comm *c, float *send, float *recv, size_t shard_numel) {
  nccl_comm *nc = nccl_of(c);
  /* In place, too, means the same to NCCL: recv is send's shard of this
   * rank. */
  int rc = nc->api->nccl_reduce_scatter_f32(nc->nccl, send, recv, shard_numel, nc->stream);
  return finish_collective(nc, "reduce_scatter", rc);
}

static zk_nccl_dtype nccl_dtype_of(comm_dtype dtype) {
  switch (dtype) {
  case COMM_F32:
    return ZK_NCCL_F32;
  case COMM_F64:
    return ZK_NCCL_F64;
  case COMM_U8:
    return ZK_NCCL_U8;
  case COMM_I64:
    return ZK_NCCL_I64;
  }
  return ZK_NCCL_F32; /* unreachable: comm.c checked the dtype */
}

static zk_nccl_op nccl_op_of(comm_op op) {
  switch (op) {
  case COMM_SUM:
    return ZK_NCCL_SUM;
  case COMM_MAX:
    return ZK_NCCL_MAX;
  case COMM_MIN:
    return ZK_NCCL_MIN;
  }
  return ZK_NCCL_SUM; /* unreachable: comm.c checked the op */
}

static int nccl_all_reduce_op(comm *c, void *buf, size_t count, comm_dtype dtype, comm_op op) {
  nccl_comm *nc = nccl_of(c);
  int rc = nc->api->nccl_all_reduce(nc->nccl, buf, count, nccl_dtype_of(dtype), nccl_op_of(op),
                                    nc->stream);
  return finish_collective(nc, "all_reduce", rc);
}

static int nccl_broadcast_op(comm *c, void *buf, size_t bytes, int root) {
  nccl_comm *nc = nccl_of(c);
  int rc = nc->api->nccl_broadcast(nc->nccl, buf, bytes, root, nc->stream);
  return finish_collective(nc, "broadcast", rc);
}

/* NCCL has no barrier: an all-reduce of one value completes on no rank
 * before every rank has contributed, which is one. */
static int nccl_barrier_op(comm *c) {
  nccl_comm *nc = nccl_of(c);
  int rc = nc->api->nccl_all_reduce(nc->nccl, nc->barrier_value, 1, ZK_NCCL_I64, ZK_NCCL_SUM,
                                    nc->stream);
  return finish_collective(nc, "barrier", rc);
}

/* NCCL's abort stops the communicator's kernels and frees it without
 * waiting for the peers, whose own calls then fail (their transport sees
 * the connections go). */
static void nccl_abort_op(comm *c) {
  nccl_comm *nc = nccl_of(c);
  if (nc->nccl != NULL) {
    (void)nc->api->nccl_abort(nc->nccl);
    nc->nccl = NULL;
  }
}

/* comm_abort: only a flag, which the owner's wait polls; NCCL's own abort
 * is left to the owner's thread (comm_break), whose device is current. */
static void nccl_cancel_op(comm *c) {
  atomic_store(&nccl_of(c)->cancelled, 1);
}

/* Also the cleanup of a half-built communicator: every field may be NULL.
 * A broken (or never connected) communicator is aborted, a healthy one
 * finalized and destroyed. cudaFree waits for the device, so the barrier
 * value is not freed under a kernel still using it. */
static void nccl_destroy_op(comm *c) {
  nccl_comm *nc = nccl_of(c);
  const zk_cuda_api *api = nc->api;
  if (nc->nccl != NULL) {
    if (c->broken_error != 0)
      (void)api->nccl_abort(nc->nccl);
    else
      (void)api->nccl_destroy(nc->nccl);
    nc->nccl = NULL;
  }
  if (nc->done_event != NULL)
    (void)api->event_destroy(nc->done_event);
  if (nc->barrier_value != NULL)
    (void)api->free(nc->barrier_value);
  free(nc);
}

static const comm_ops nccl_ops = {
    .name = "nccl",
    .all_gather = nccl_all_gather_op,
    .reduce_scatter_f32 = nccl_reduce_scatter_op,
    .all_reduce = nccl_all_reduce_op,
    .broadcast = nccl_broadcast_op,
    .barrier = nccl_barrier_op,
    .abort = nccl_abort_op,
    .destroy = nccl_destroy_op,
    .cancel = nccl_cancel_op,
};

/* ---- creation ------------------------------------------------------------------ */

/* Rank 0 publishes a fresh unique id; the others wait for it until the
 * deadline. */
static int exchange_unique_id(nccl_comm *nc, const comm_options *options, store *st,
                              const char *key, int64_t deadline_us, uint8_t *id, char *err,
                              size_t err_bytes) {
  const zk_cuda_api *api = nc->api;
  if (options->rank == 0) {
    int rc = api->nccl_unique_id(id);
    if (rc != 0) {
      comm_format_error(err, err_bytes, "create: ncclGetUniqueId failed: %s", api->last_error());
      return rc;
    }
    rc = st->ops->set(st, key, id, ZK_NCCL_UNIQUE_ID_BYTES);
    if (rc != 0)
      comm_format_error(err, err_bytes, "rendezvous: store set of '%s' failed: %s", key,
                        strerror(-rc));
    return rc;
  }

  int64_t left_us = deadline_us - clock_now_us();
  int left_ms = left_us > 0 ? (int)((left_us + 999) / 1000) : 0;
  void *value = NULL;
  size_t value_bytes = 0;
  int rc = st->ops->get(st, key, &value, &value_bytes, left_ms);
  if (rc == -ETIMEDOUT) {
    comm_format_error(err, err_bytes,
                      "rendezvous: timed out after %d ms waiting for rank 0's NCCL unique id "
                      "(key '%s')",
                      options->timeout_ms, key);
    return rc;
  }
  if (rc != 0) {
    comm_format_error(err, err_bytes, "rendezvous: store get of '%s' failed: %s", key,
                      strerror(-rc));
    return rc;
  }
  if (value_bytes != ZK_NCCL_UNIQUE_ID_BYTES) {
    comm_format_error(err, err_bytes,
                      "rendezvous: '%s' holds %zu bytes, not an NCCL unique id (%d bytes)", key,
                      value_bytes, ZK_NCCL_UNIQUE_ID_BYTES);
    free(value);
    return -EPROTO;
  }
  memcpy(id, value, ZK_NCCL_UNIQUE_ID_BYTES);
  free(value);
  return 0;
}

/* Polls the non-blocking communicator until it is connected, fails, or the
 * deadline passes. */
static int wait_connected(nccl_comm *nc, int64_t deadline_us, char *err, size_t err_bytes) {
  const zk_cuda_api *api = nc->api;
  const comm *c = &nc->base;
  long delay_us = CONNECT_POLL_FIRST_US;
  for (;;) {
    int rc = api->nccl_status(nc->nccl);
    if (rc == 0)
      return 0;
    if (rc != -EAGAIN) {
      comm_format_error(err, err_bytes, "create: the NCCL communicator failed (rank %d of %d): %s",
                        c->rank, c->world_size, api->last_error());
      return rc;
    }
    if (clock_now_us() >= deadline_us) {
      comm_format_error(err, err_bytes,
                        "rendezvous: timed out after %d ms waiting for the NCCL communicator to "
                        "connect (rank %d of %d; a rank is missing or unreachable)",
                        c->timeout_ms, c->rank, c->world_size);
      return -ETIMEDOUT;
    }
    sleep_backoff(&delay_us, CONNECT_POLL_MAX_US);
  }
}

/* Everything a communicator needs from the module: the table must have the
 * version 2 entries and NCCL must be there. */
static int check_api(const zk_cuda_api *api, char *err, size_t err_bytes) {
  if (api == NULL) {
    comm_format_error(err, err_bytes,
                      "create: no CUDA module (api is NULL): NCCL communicators need "
                      "libzerod_cuda.so and a usable GPU");
    return -ENODEV;
  }
  if (api->size < sizeof(zk_cuda_api) || api->version < 2) {
    comm_format_error(err, err_bytes,
                      "create: the CUDA module's API (version %d, %zu bytes) has no NCCL entries "
                      "(need version 2, %zu bytes)",
                      api->version, api->size, sizeof(zk_cuda_api));
    return -EPROTO;
  }
  char why[256] = "";
  int rc = api->nccl_available(why, sizeof why);
  if (rc != 0) {
    comm_format_error(err, err_bytes, "create: NCCL is not available: %s", why);
    return rc;
  }
  return 0;
}

int comm_nccl_create(const comm_options *options, store *st, const struct zk_cuda_api *api,
                     void *stream, comm **out, char *err, size_t err_bytes) {
  if (err != NULL && err_bytes > 0)
    err[0] = '\0';
  int rc = comm_check_options(options, st, out, err, err_bytes);
  if (rc != 0)
    return rc;
  *out = NULL;
  rc = check_api(api, err, err_bytes);
  if (rc != 0)
    return rc;

  char key[COMM_MAX_PREFIX_BYTES + sizeof NCCL_ID_KEY_SUFFIX];
  snprintf(key, sizeof key, "%s%s", options->prefix, NCCL_ID_KEY_SUFFIX);
  const int64_t deadline_us = clock_now_us() + (int64_t)options->timeout_ms * 1000;

  nccl_comm *nc = calloc(1, sizeof *nc);
  if (nc == NULL) {
    comm_format_error(err, err_bytes, "create: out of memory");
    return -ENOMEM;
  }
  comm_init_base(&nc->base, &nccl_ops, options);
  nc->api = api;
  nc->stream = stream;
  if (api->get_device(&nc->device) != 0)
    nc->device = -1;

  rc = api->event_create(&nc->done_event, 0);
  if (rc != 0) {
    comm_format_error(err, err_bytes, "create: event_create on device %d failed: %s", nc->device,
                      api->last_error());
    goto fail;
  }
  rc = api->alloc(&nc->barrier_value, sizeof(int64_t));
  if (rc == 0)
    rc = api->memset_async(nc->barrier_value, 0, sizeof(int64_t), stream);
  if (rc != 0) {
    comm_format_error(err, err_bytes, "create: the barrier's device value on device %d: %s",
                      nc->device, api->last_error());
    goto fail;
  }

  uint8_t id[ZK_NCCL_UNIQUE_ID_BYTES];
  rc = exchange_unique_id(nc, options, st, key, deadline_us, id, err, err_bytes);
  if (rc != 0)
    goto fail;
  rc = api->nccl_init(&nc->nccl, options->world_size, options->rank, id);
  if (rc != 0) {
    nc->nccl = NULL;
    comm_format_error(err, err_bytes, "create: ncclCommInitRankConfig (rank %d of %d) failed: %s",
                      options->rank, options->world_size, api->last_error());
    goto fail;
  }
  rc = wait_connected(nc, deadline_us, err, err_bytes);
  if (rc != 0)
    goto fail;

  /* Connected on rank 0 means every rank has joined, so every rank has
   * read the id. Best effort: a failure only leaves one stale key. */
  if (options->rank == 0)
    (void)st->ops->delete_prefix(st, key);
  *out = &nc->base;
  return 0;

fail:
  /* The destroy path aborts a communicator it finds broken, which is what a
   * half-connected one needs: finalizing would wait for the missing ranks. */
  nc->base.broken_error = rc;
  nccl_destroy_op(&nc->base);
  return rc;
}
