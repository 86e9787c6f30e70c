/* test_nccl_comm.c - the NCCL backend of comm.h (daemon/comm_nccl.c) on
 * device buffers, through the CUDA module's NCCL entries.
 *
 * NCCL refuses two ranks of one communicator on one GPU, so the collectives
 * run as a one-rank world on every machine, and across min(devices, 4)
 * ranks (one thread per device, rendezvousing through one store_mem, the
 * way the daemon hosts the GPU ranks of a job) where there are two GPUs or
 * more. Values are small integers (or quarters in fp64), so every expected
 * result is exact whatever order NCCL sums in. Failures: a rank that never
 * comes makes comm_nccl_create time out with a message; a bad argument
 * breaks the communicator, and later calls fail fast.
 *
 * Rank threads may not fail a cmocka test themselves (its assertions
 * longjmp on the test's own thread): they record their first failure and
 * the test thread reports it after joining them.
 *
 * Without a usable GPU, or without libnccl.so.2, the program prints one
 * "SKIP: ..." line and exits 77 (ctest's SKIP_RETURN_CODE); with
 * ZEROD_REQUIRE_GPU=1 a missing GPU is a failure instead.
 */
#include <pthread.h>
#include <stdbool.h>
#include <time.h>

#include "comm.h"
#include "gpu_testutil.h"
#include "store.h"

#define MAX_WORLD      4
#define TIMEOUT_MS     30000
#define REDUCE_NUMEL   1031
#define NCCL_ID_SUFFIX "/nccl-id"

/* ------------------------------------------------------------------------ */
/* Ranks on threads                                                          */
/* ------------------------------------------------------------------------ */

typedef struct rank_ctx {
  int rank, world;
  store *st;
  const char *prefix;
  void *stream;
  comm *c;
  char failure[512];
} rank_ctx;

__attribute__((format(printf, 2, 3))) static void rank_fail(rank_ctx *rc, const char *fmt, ...) {
  if (rc->failure[0] != '\0')
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rc->failure, sizeof rc->failure, fmt, ap);
  va_end(ap);
}

/* Records a failed module call (with the module's reason) and returns -1. */
#define RANK_CU(rc, call)                                                                          \
  do {                                                                                             \
    int cu_rc_ = (call);                                                                           \
    if (cu_rc_ != 0) {                                                                             \
      rank_fail((rc), "%s returned %d (%s)", #call, cu_rc_, cu->last_error());                     \
      return -1;                                                                                   \
    }                                                                                              \
  } while (0)

#define RANK_COMM(rc, call)                                                                        \
  do {                                                                                             \
    int comm_rc_ = (call);                                                                         \
    if (comm_rc_ != 0) {                                                                           \
      rank_fail((rc), "%s returned %d (%s): %s", #call, comm_rc_, strerror(-comm_rc_),             \
                comm_last_error((rc)->c));                                                         \
      return -1;                                                                                   \
    }                                                                                              \
  } while (0)

/* Host <-> device through the rank's stream: the collectives run there,
 * and a non-blocking stream does not wait for the legacy default stream
 * that the synchronous copies use. */
static int upload(rank_ctx *rc, void *dev, const void *host, size_t bytes) {
  RANK_CU(rc, cu->copy_to_device_async(dev, host, bytes, rc->stream));
  RANK_CU(rc, cu->synchronize(rc->stream));
  return 0;
}

static int download(rank_ctx *rc, void *host, const void *dev, size_t bytes) {
  RANK_CU(rc, cu->copy_to_host_async(host, dev, bytes, rc->stream));
  RANK_CU(rc, cu->synchronize(rc->stream));
  return 0;
}

static uint8_t gather_byte(int rank, size_t i) {
  return (uint8_t)(rank * 131 + i * 7 + 1);
}

static float scatter_value(int rank, size_t j) {
  return (float)((int)((j * 2654435761u + (size_t)rank * 97u) % 2001u) - 1000);
}

static double reduce_input(int rank, size_t i) {
  return (double)((int)((i * 37u + (size_t)rank * 11u) % 23u) - 11) * (rank + 1);
}

static double combine(comm_op op, double a, double b) {
  switch (op) {
  case COMM_SUM:
    return a + b;
  case COMM_MAX:
    return a > b ? a : b;
  case COMM_MIN:
    return a < b ? a : b;
  }
  return NAN;
}

/* ---- the collectives, checked on one rank ---------------------------------- */

static int check_all_gather(rank_ctx *rc, size_t n, bool in_place) {
  const size_t total = n * (size_t)rc->world;
  uint8_t *host = xmalloc(total);
  uint8_t *gathered = NULL, *own = NULL;
  int result = -1;
  if (cu->alloc((void **)&gathered, total) != 0 || cu->alloc((void **)&own, n) != 0) {
    rank_fail(rc, "alloc: %s", cu->last_error());
    goto out;
  }
  if (cu->memset(gathered, 0xee, total) != 0 || cu->synchronize(NULL) != 0) {
    rank_fail(rc, "memset: %s", cu->last_error());
    goto out;
  }
  uint8_t *send = in_place ? gathered + (size_t)rc->rank * n : own;
  for (size_t i = 0; i < n; i++)
    host[i] = gather_byte(rc->rank, i);
  if (upload(rc, send, host, n) != 0)
    goto out;
  int call_rc = comm_all_gather(rc->c, send, gathered, n);
  if (call_rc != 0) {
    rank_fail(rc, "comm_all_gather(%zu bytes%s) returned %d: %s", n, in_place ? ", in place" : "",
              call_rc, comm_last_error(rc->c));
    goto out;
  }
  if (download(rc, host, gathered, total) != 0)
    goto out;
  for (int r = 0; r < rc->world; r++)
    for (size_t i = 0; i < n; i++)
      if (host[(size_t)r * n + i] != gather_byte(r, i)) {
        rank_fail(rc, "all_gather %zu bytes%s: byte %zu of rank %d's slice is %u, want %u", n,
                  in_place ? " in place" : "", i, r, host[(size_t)r * n + i], gather_byte(r, i));
        goto out;
      }
  result = 0;
out:
  cu->free(gathered);
  cu->free(own);
  free(host);
  return result;
}

static int check_reduce_scatter(rank_ctx *rc, size_t shard, bool in_place) {
  const size_t total = shard * (size_t)rc->world;
  float *host = xmalloc(total * sizeof(float));
  float *send = NULL, *separate = NULL;
  int result = -1;
  if (cu->alloc((void **)&send, total * sizeof(float)) != 0 ||
      cu->alloc((void **)&separate, shard * sizeof(float)) != 0) {
    rank_fail(rc, "alloc: %s", cu->last_error());
    goto out;
  }
  float *recv = in_place ? send + (size_t)rc->rank * shard : separate;
  for (size_t j = 0; j < total; j++)
    host[j] = scatter_value(rc->rank, j);
  if (upload(rc, send, host, total * sizeof(float)) != 0)
    goto out;
  int call_rc = comm_reduce_scatter_f32(rc->c, send, recv, shard);
  if (call_rc != 0) {
    rank_fail(rc, "comm_reduce_scatter_f32(%zu%s) returned %d: %s", shard,
              in_place ? ", in place" : "", call_rc, comm_last_error(rc->c));
    goto out;
  }
  if (download(rc, host, recv, shard * sizeof(float)) != 0)
    goto out;
  for (size_t i = 0; i < shard; i++) {
    size_t j = (size_t)rc->rank * shard + i;
    float want = 0.0f;
    for (int r = 0; r < rc->world; r++)
      want += scatter_value(r, j);
    if (host[i] != want) {
      rank_fail(rc, "reduce_scatter shard %zu%s: element %zu is %g, want %g", shard,
                in_place ? " in place" : "", i, (double)host[i], (double)want);
      goto out;
    }
  }
  result = 0;
out:
  cu->free(send);
  cu->free(separate);
  free(host);
  return result;
}

typedef union reduce_buf {
  float f32[REDUCE_NUMEL];
  double f64[REDUCE_NUMEL];
  int64_t i64[REDUCE_NUMEL];
  uint8_t u8[REDUCE_NUMEL];
} reduce_buf;

/* u8 inputs are shifted to be non-negative and stay small enough for the
 * sum of four ranks not to wrap; f64 inputs are quarters, exact in any
 * order. */
static void fill_reduce_input(reduce_buf *buf, comm_dtype dtype, int rank) {
  for (size_t i = 0; i < REDUCE_NUMEL; i++) {
    double x = reduce_input(rank, i);
    if (dtype == COMM_F32)
      buf->f32[i] = (float)x;
    else if (dtype == COMM_F64)
      buf->f64[i] = x * 0.25;
    else if (dtype == COMM_I64)
      buf->i64[i] = (int64_t)x * ((int64_t)1 << 40);
    else
      buf->u8[i] = (uint8_t)(x + 44);
  }
}

static int check_all_reduce(rank_ctx *rc, comm_dtype dtype, comm_op op) {
  static reduce_buf host_bufs[MAX_WORLD];
  reduce_buf *host = &host_bufs[rc->rank];
  void *dev = NULL;
  RANK_CU(rc, cu->alloc(&dev, sizeof *host));
  int result = -1;
  fill_reduce_input(host, dtype, rc->rank);
  if (upload(rc, dev, host, sizeof *host) != 0)
    goto out;
  int call_rc = comm_all_reduce(rc->c, dev, REDUCE_NUMEL, dtype, op);
  if (call_rc != 0) {
    rank_fail(rc, "comm_all_reduce(dtype %d, op %d) returned %d: %s", (int)dtype, (int)op, call_rc,
              comm_last_error(rc->c));
    goto out;
  }
  if (download(rc, host, dev, sizeof *host) != 0)
    goto out;
  for (size_t i = 0; i < REDUCE_NUMEL; i++) {
    double want = reduce_input(0, i), want_u8 = reduce_input(0, i) + 44;
    for (int r = 1; r < rc->world; r++) {
      want = combine(op, want, reduce_input(r, i));
      want_u8 = combine(op, want_u8, reduce_input(r, i) + 44);
    }
    bool ok;
    if (dtype == COMM_F32)
      ok = host->f32[i] == (float)want;
    else if (dtype == COMM_F64)
      ok = host->f64[i] == want * 0.25;
    else if (dtype == COMM_I64)
      ok = host->i64[i] == (int64_t)want * ((int64_t)1 << 40);
    else
      ok = host->u8[i] == (uint8_t)want_u8;
    if (!ok) {
      rank_fail(rc,
                "all_reduce dtype %d op %d: element %zu differs from the reduction of all "
                "ranks",
                (int)dtype, (int)op, i);
      goto out;
    }
  }
  result = 0;
out:
  cu->free(dev);
  return result;
}

static int check_broadcast(rank_ctx *rc, int root, size_t bytes) {
  uint8_t *host = xmalloc(bytes);
  void *dev = NULL;
  int result = -1;
  if (cu->alloc(&dev, bytes) != 0) {
    rank_fail(rc, "alloc: %s", cu->last_error());
    goto out;
  }
  for (size_t i = 0; i < bytes; i++)
    host[i] = rc->rank == root ? gather_byte(root, i) : 0;
  if (upload(rc, dev, host, bytes) != 0)
    goto out;
  int call_rc = comm_broadcast(rc->c, dev, bytes, root);
  if (call_rc != 0) {
    rank_fail(rc, "comm_broadcast(root %d) returned %d: %s", root, call_rc, comm_last_error(rc->c));
    goto out;
  }
  if (download(rc, host, dev, bytes) != 0)
    goto out;
  for (size_t i = 0; i < bytes; i++)
    if (host[i] != gather_byte(root, i)) {
      rank_fail(rc, "broadcast: byte %zu is %u, want root %d's %u", i, host[i], root,
                gather_byte(root, i));
      goto out;
    }
  result = 0;
out:
  cu->free(dev);
  free(host);
  return result;
}

static int run_collectives(rank_ctx *rc) {
  static const size_t gather_sizes[] = {1, 4097, 1000003};
  for (size_t s = 0; s < sizeof gather_sizes / sizeof gather_sizes[0]; s++)
    for (int in_place = 0; in_place <= 1; in_place++)
      if (check_all_gather(rc, gather_sizes[s], in_place) != 0)
        return -1;
  static const size_t shard_sizes[] = {1, 3, 262145};
  for (size_t s = 0; s < sizeof shard_sizes / sizeof shard_sizes[0]; s++)
    for (int in_place = 0; in_place <= 1; in_place++)
      if (check_reduce_scatter(rc, shard_sizes[s], in_place) != 0)
        return -1;
  static const comm_dtype dtypes[] = {COMM_F32, COMM_F64, COMM_I64, COMM_U8};
  static const comm_op ops[] = {COMM_SUM, COMM_MAX, COMM_MIN};
  for (size_t d = 0; d < 4; d++)
    for (size_t o = 0; o < 3; o++)
      if (check_all_reduce(rc, dtypes[d], ops[o]) != 0)
        return -1;
  if (check_broadcast(rc, rc->world - 1, 4097) != 0 || check_broadcast(rc, 0, 1) != 0)
    return -1;
  for (int i = 0; i < 3; i++)
    RANK_COMM(rc, comm_barrier(rc->c));
  /* Zero-sized calls are no-ops, not NCCL calls. */
  RANK_COMM(rc, comm_all_gather(rc->c, NULL, NULL, 0));
  return 0;
}

static void *collectives_rank_main(void *arg) {
  rank_ctx *rc = arg;
  if (cu->set_device(rc->rank) != 0 || cu->stream_create(&rc->stream) != 0) {
    rank_fail(rc, "device %d: %s", rc->rank, cu->last_error());
    return NULL;
  }
  comm_options options = {
      .prefix = rc->prefix, .rank = rc->rank, .world_size = rc->world, .timeout_ms = TIMEOUT_MS};
  char err[256] = "";
  int create_rc = comm_nccl_create(&options, rc->st, cu, rc->stream, &rc->c, err, sizeof err);
  if (create_rc != 0)
    rank_fail(rc, "comm_nccl_create returned %d: %s", create_rc, err);
  else
    (void)run_collectives(rc);
  comm_destroy(rc->c);
  rc->c = NULL;
  if (cu->stream_destroy(rc->stream) != 0)
    rank_fail(rc, "stream_destroy: %s", cu->last_error());
  return NULL;
}

static void run_world(int world, const char *prefix) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  rank_ctx ranks[MAX_WORLD];
  pthread_t threads[MAX_WORLD];
  memset(ranks, 0, sizeof ranks);
  for (int r = 0; r < world; r++) {
    ranks[r] = (rank_ctx){.rank = r, .world = world, .st = st, .prefix = prefix};
    assert_int_equal(pthread_create(&threads[r], NULL, collectives_rank_main, &ranks[r]), 0);
  }
  for (int r = 0; r < world; r++)
    pthread_join(threads[r], NULL);
  st->ops->destroy(st);
  for (int r = 0; r < world; r++)
    if (ranks[r].failure[0] != '\0')
      fail_msg("world %d, rank %d: %s", world, r, ranks[r].failure);
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                     */
/* ------------------------------------------------------------------------ */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static void test_collectives_on_a_one_rank_world(void **state) {
  run_world(1, "test/nccl/one");
}

static void test_collectives_across_devices(void **state) {
  int count = 0;
  CU_OK(cu->device_count(&count));
  if (count < 2) {
    printf("# one device: the multi-rank collectives need two or more\n");
    skip();
  }
  run_world(count < MAX_WORLD ? count : MAX_WORLD, "test/nccl/many");
}

/* A communicator of this thread on device 0; the caller frees the stream. */
static int create_on_device0(const char *prefix, int rank, int world, int timeout_ms, store *st,
                             void **stream, comm **c, char *err, size_t err_bytes) {
  CU_OK(cu->set_device(0));
  CU_OK(cu->stream_create(stream));
  comm_options options = {
      .prefix = prefix, .rank = rank, .world_size = world, .timeout_ms = timeout_ms};
  return comm_nccl_create(&options, st, cu, *stream, c, err, err_bytes);
}

static void test_create_times_out_when_a_rank_never_comes(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  void *stream = NULL;
  comm *c = NULL;
  char err[256] = "";
  double started_ms = now_ms();
  int rc = create_on_device0("test/nccl/lonely", 0, 2, 2000, st, &stream, &c, err, sizeof err);
  double took_ms = now_ms() - started_ms;
  assert_int_equal(rc, -ETIMEDOUT);
  assert_null(c);
  if (took_ms < 1900 || took_ms > 10000)
    fail_msg("create should give up after about 2000 ms, took %.0f ms", took_ms);
  if (strstr(err, "timed out after 2000 ms") == NULL || strstr(err, "NCCL") == NULL)
    fail_msg("the error should say that NCCL timed out, got \"%s\"", err);
  printf("# %s (%.0f ms)\n", err, took_ms);
  CU_OK(cu->stream_destroy(stream));
  st->ops->destroy(st);
}

static void test_create_times_out_waiting_for_the_unique_id(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  void *stream = NULL;
  comm *c = NULL;
  char err[256] = "";
  int rc = create_on_device0("test/nccl/no-root", 1, 2, 500, st, &stream, &c, err, sizeof err);
  assert_int_equal(rc, -ETIMEDOUT);
  assert_null(c);
  if (strstr(err, "waiting for rank 0's NCCL unique id") == NULL)
    fail_msg("the error should name the missing unique id, got \"%s\"", err);
  CU_OK(cu->stream_destroy(stream));
  st->ops->destroy(st);
}

static void test_create_rejects_a_malformed_unique_id(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  assert_int_equal(st->ops->set(st, "test/nccl/bad-id" NCCL_ID_SUFFIX, "short", 5), 0);
  void *stream = NULL;
  comm *c = NULL;
  char err[256] = "";
  int rc = create_on_device0("test/nccl/bad-id", 1, 2, 500, st, &stream, &c, err, sizeof err);
  assert_int_equal(rc, -EPROTO);
  assert_null(c);
  if (strstr(err, "not an NCCL unique id") == NULL)
    fail_msg("the error should say the id is malformed, got \"%s\"", err);
  CU_OK(cu->stream_destroy(stream));
  st->ops->destroy(st);
}

static void test_create_removes_the_unique_id_key(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  void *stream = NULL;
  comm *c = NULL;
  char err[256] = "";
  int rc = create_on_device0("test/nccl/keys", 0, 1, TIMEOUT_MS, st, &stream, &c, err, sizeof err);
  if (rc != 0)
    fail_msg("comm_nccl_create returned %d: %s", rc, err);
  void *value = NULL;
  size_t value_bytes = 0;
  rc = st->ops->get(st, "test/nccl/keys" NCCL_ID_SUFFIX, &value, &value_bytes, 0);
  free(value);
  if (rc != -ETIMEDOUT)
    fail_msg("the unique id should be gone once the communicator is up (get returned %d)", rc);
  comm_destroy(c);
  CU_OK(cu->stream_destroy(stream));
  st->ops->destroy(st);
}

static void test_bad_arguments_break_the_communicator(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  void *stream = NULL;
  comm *c = NULL;
  char err[256] = "";
  int rc = create_on_device0("test/nccl/bad", 0, 1, TIMEOUT_MS, st, &stream, &c, err, sizeof err);
  if (rc != 0)
    fail_msg("comm_nccl_create returned %d: %s", rc, err);
  void *dev = dev_alloc(8);
  assert_int_equal(comm_broadcast(c, dev, 8, 5), -EINVAL);
  if (strstr(comm_last_error(c), "root 5") == NULL)
    fail_msg("the error should name the bad root, got \"%s\"", comm_last_error(c));
  /* The communicator is broken (and its NCCL communicator aborted): later
   * calls fail at once with the same error, and destroy does not wait. */
  double started_ms = now_ms();
  assert_int_equal(comm_barrier(c), -EINVAL);
  assert_int_equal(comm_all_reduce(c, dev, 1, COMM_F64, COMM_SUM), -EINVAL);
  if (now_ms() - started_ms > 50)
    fail_msg("calls on a broken communicator should fail fast");
  comm_destroy(c);
  dev_free(dev);
  CU_OK(cu->stream_destroy(stream));
  st->ops->destroy(st);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_collectives_on_a_one_rank_world),
      cmocka_unit_test(test_collectives_across_devices),
      cmocka_unit_test(test_create_removes_the_unique_id_key),
      cmocka_unit_test(test_bad_arguments_break_the_communicator),
      cmocka_unit_test(test_create_times_out_waiting_for_the_unique_id),
      cmocka_unit_test(test_create_rejects_a_malformed_unique_id),
      cmocka_unit_test(test_create_times_out_when_a_rank_never_comes),
  };
  /* A GPU without NCCL is not a failure of this program: say so and skip. */
  const zk_cuda_api *api = NULL;
  char why[512] = "";
  if (zk_cuda_load(&api, why, sizeof why) == 0 && api->nccl_available(why, sizeof why) != 0) {
    printf("SKIP: NCCL not available: %s\n", why);
    return 77;
  }
  if (api != NULL)
    printf("# %s\n", why);
  return gpu_test_main("nccl_comm", tests, sizeof tests / sizeof tests[0]);
}
