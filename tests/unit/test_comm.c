/* The communicators (comm.h): Gloo, and the local backend of ranks that are
 * threads of one process (comm_local.c); and the in-process store
 * (store.h).
 *
 * Every collective test runs `world` ranks as threads of this process, each
 * creating its own communicator through one shared store_mem (Gloo) or one
 * local group, the way the daemon hosts several ranks of a job; the
 * collective and failure tests run once per backend, and the local
 * backend's sums are checked bit for bit against Gloo's. cmocka's assertions may only fail on
 * the test's own thread, so rank threads record their first failure in
 * their rank_ctx and the test thread reports it after joining them.
 *
 * Data are chosen so that every expected result is exact: small integers
 * in fp32 sum without rounding in any order. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "test_clock.h"

#include "comm.h"
#include "store.h"
#include "zk.h"

#define MAX_WORLD          4
#define DEFAULT_TIMEOUT_MS 20000

/* ---- helpers -------------------------------------------------------------- */

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes > 0 ? bytes : 1);
  if (p == NULL) {
    fprintf(stderr, "out of memory allocating %zu bytes\n", bytes);
    abort();
  }
  return p;
}

/* splitmix64, for the data of the determinism test. */
static uint64_t rng_next(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* The byte rank r contributes at offset i of its all-gather slice. */
static uint8_t gather_byte(int rank, size_t i) {
  return (uint8_t)(rank * 131 + i * 7 + 1);
}

/* An integer in [-1000, 1000] that rank r contributes at flat index j of
 * the reduce-scatter input; world * 1000 is far below 2^24, so sums are
 * exact. */
static float scatter_value(int rank, size_t j) {
  return (float)((int)((j * 2654435761u + (size_t)rank * 97u) % 2001u) - 1000);
}

/* ---- running a world of ranks on threads ----------------------------------- */

typedef struct world_run world_run;

typedef struct rank_ctx {
  world_run *run;
  int rank;
  comm *c;
  bool keep_comm; /* set by a body that must leave its communicator alive */
  char failure[512];
} rank_ctx;

typedef void (*rank_body)(rank_ctx *rc);

/* The backend the world runs use: set by each test's setup. The
 * hierarchical one runs `world` ranks as nodes of 2 ranks each (of 1 for
 * an odd world): a local group per node, a Gloo communicator per local
 * index. */
typedef enum backend { GLOO, LOCAL, HIER } backend;
static backend use_backend;
#define use_local (use_backend == LOCAL)

struct world_run {
  store *st;
  comm_local_group *group;                  /* the local backend's */
  comm_local_group *node_groups[MAX_WORLD]; /* the hierarchical one's, per node */
  int local_size;
  int world;
  int timeout_ms;
  rank_body body;
  void *user;
  rank_ctx ranks[MAX_WORLD];
};

/* Records a rank's first failure; the body then returns. */
static void rank_fail(rank_ctx *rc, const char *fmt, ...) {
  if (rc->failure[0] != '\0')
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rc->failure, sizeof rc->failure, fmt, ap);
  va_end(ap);
}

#define RANK_CHECK(rc, cond, ...)                                                                  \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      rank_fail((rc), __VA_ARGS__);                                                                \
      return;                                                                                      \
    }                                                                                              \
  } while (0)

#define RANK_CALL(rc, call)                                                                        \
  do {                                                                                             \
    int call_rc_ = (call);                                                                         \
    RANK_CHECK((rc), call_rc_ == 0, "%s returned %d (%s): %s", #call, call_rc_,                    \
               strerror(-call_rc_), comm_last_error((rc)->c));                                     \
  } while (0)

static void *rank_main(void *arg) {
  rank_ctx *rc = arg;
  world_run *run = rc->run;
  comm_options options = {.prefix = "test/job/1/epoch/0",
                          .rank = rc->rank,
                          .world_size = run->world,
                          .timeout_ms = run->timeout_ms};
  char err[256];
  int create_rc;
  if (use_backend == HIER) {
    int L = run->local_size, l = rc->rank % L, n = rc->rank / L;
    comm_options local_options = {
        .rank = l, .world_size = L, .timeout_ms = run->timeout_ms, .level = COMM_LEVEL_NODE};
    char prefix[64];
    snprintf(prefix, sizeof prefix, "test/hier/x%d", l);
    comm_options cross_options = {.prefix = prefix,
                                  .rank = n,
                                  .world_size = run->world / L,
                                  .timeout_ms = run->timeout_ms,
                                  .level = COMM_LEVEL_CROSS};
    comm *local = NULL, *cross = NULL;
    create_rc = comm_local_create(&local_options, run->node_groups[n], &local, err, sizeof err);
    if (create_rc == 0 &&
        (create_rc = comm_gloo_create(&cross_options, run->st, &cross, err, sizeof err)) != 0)
      comm_destroy(local);
    if (create_rc == 0)
      create_rc = comm_hier_create(&options, local, cross, &rc->c, err, sizeof err);
  } else if (use_backend == LOCAL) {
    create_rc = comm_local_create(&options, run->group, &rc->c, err, sizeof err);
  } else {
    create_rc = comm_gloo_create(&options, run->st, &rc->c, err, sizeof err);
  }
  if (create_rc != 0) {
    static const char *const names[] = {"gloo", "local", "hierarchical"};
    rank_fail(rc, "creating the %s communicator returned %d: %s", names[use_backend], create_rc,
              err);
    return NULL;
  }
  run->body(rc);
  if (!rc->keep_comm) {
    comm_destroy(rc->c);
    rc->c = NULL;
  }
  return NULL;
}

/* Runs body on `world` ranks rendezvousing through st and fails the test
 * with the first rank's failure. Communicators a body kept alive are
 * destroyed after the join. */
static void run_world_in(store *st, int world, int timeout_ms, rank_body body, void *user) {
  world_run run = {.st = st, .world = world, .timeout_ms = timeout_ms, .body = body, .user = user};
  if (use_local)
    assert_int_equal(comm_local_group_create(world, &run.group), 0);
  run.local_size = world % 2 == 0 ? 2 : 1;
  if (use_backend == HIER)
    for (int n = 0; n < world / run.local_size; n++)
      assert_int_equal(comm_local_group_create(run.local_size, &run.node_groups[n]), 0);
  pthread_t threads[MAX_WORLD];
  for (int r = 0; r < world; r++) {
    run.ranks[r].run = &run;
    run.ranks[r].rank = r;
    assert_int_equal(pthread_create(&threads[r], NULL, rank_main, &run.ranks[r]), 0);
  }
  for (int r = 0; r < world; r++)
    pthread_join(threads[r], NULL);
  for (int r = 0; r < world; r++)
    comm_destroy(run.ranks[r].c);
  comm_local_group_unref(run.group);
  for (int n = 0; n < MAX_WORLD; n++)
    comm_local_group_unref(run.node_groups[n]);
  for (int r = 0; r < world; r++)
    if (run.ranks[r].failure[0] != '\0')
      fail_msg("world %d, rank %d: %s", world, r, run.ranks[r].failure);
}

/* The same with a store of its own. */
static void run_world(int world, int timeout_ms, rank_body body, void *user) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  run_world_in(st, world, timeout_ms, body, user);
  st->ops->destroy(st);
}

/* ---- store_mem ------------------------------------------------------------- */

typedef struct delayed_set {
  store *st;
  int delay_ms;
} delayed_set;

static void *set_after_delay(void *arg) {
  delayed_set *ds = arg;
  sleep_ms(ds->delay_ms);
  ds->st->ops->set(ds->st, "late/key", "hello", 5);
  return NULL;
}

static void test_store_get_waits_for_a_key_set_by_another_thread(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  delayed_set ds = {st, 50};
  pthread_t writer;
  assert_int_equal(pthread_create(&writer, NULL, set_after_delay, &ds), 0);
  void *value = NULL;
  size_t value_bytes = 0;
  double started_ms = now_ms();
  assert_int_equal(st->ops->get(st, "late/key", &value, &value_bytes, 5000), 0);
  double waited_ms = now_ms() - started_ms;
  pthread_join(writer, NULL);
  assert_int_equal(value_bytes, 5);
  assert_memory_equal(value, "hello", 5);
  if (waited_ms < 30 || waited_ms > 4000)
    fail_msg("get should have returned when the key was set (~50 ms), took %.0f ms", waited_ms);
  free(value);
  st->ops->destroy(st);
}

static void test_store_get_times_out_on_a_missing_key(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  void *value = NULL;
  size_t value_bytes = 0;
  double started_ms = now_ms();
  assert_int_equal(st->ops->get(st, "missing", &value, &value_bytes, 100), -ETIMEDOUT);
  double waited_ms = now_ms() - started_ms;
  if (waited_ms < 95 || waited_ms > 2000)
    fail_msg("get should time out after 100 ms, took %.0f ms", waited_ms);
  /* A zero timeout only looks. */
  started_ms = now_ms();
  assert_int_equal(st->ops->get(st, "missing", &value, &value_bytes, 0), -ETIMEDOUT);
  assert_true(now_ms() - started_ms < 50);
  assert_null(value);
  st->ops->destroy(st);
}

static void test_store_set_replaces_and_keeps_many_keys(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  char key[64];
  /* Enough keys to grow the table several times. */
  for (int i = 0; i < 2000; i++) {
    snprintf(key, sizeof key, "k/%d", i);
    assert_int_equal(st->ops->set(st, key, &i, sizeof i), 0);
  }
  int replaced = -7;
  assert_int_equal(st->ops->set(st, "k/5", &replaced, sizeof replaced), 0);
  assert_int_equal(st->ops->set(st, "empty", NULL, 0), 0);
  for (int i = 0; i < 2000; i++) {
    snprintf(key, sizeof key, "k/%d", i);
    void *value = NULL;
    size_t value_bytes = 0;
    assert_int_equal(st->ops->get(st, key, &value, &value_bytes, 0), 0);
    assert_int_equal(value_bytes, sizeof(int));
    int got;
    memcpy(&got, value, sizeof got);
    assert_int_equal(got, i == 5 ? replaced : i);
    free(value);
  }
  void *value = NULL;
  size_t value_bytes = 99;
  assert_int_equal(st->ops->get(st, "empty", &value, &value_bytes, 0), 0);
  assert_int_equal(value_bytes, 0);
  assert_non_null(value);
  free(value);
  st->ops->destroy(st);
}

static void test_store_delete_prefix_removes_only_matching_keys(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  const char *keys[] = {"job/7/a", "job/7/b", "job/70/a", "job/8/a"};
  for (size_t i = 0; i < 4; i++)
    assert_int_equal(st->ops->set(st, keys[i], "x", 1), 0);
  assert_int_equal(st->ops->delete_prefix(st, "job/7/"), 0);
  const int present[] = {0, 0, 1, 1};
  for (size_t i = 0; i < 4; i++) {
    void *value = NULL;
    size_t value_bytes = 0;
    int rc = st->ops->get(st, keys[i], &value, &value_bytes, 0);
    if (present[i] ? rc != 0 : rc != -ETIMEDOUT)
      fail_msg("after delete_prefix(\"job/7/\"), get(\"%s\") returned %d", keys[i], rc);
    free(value);
  }
  st->ops->destroy(st);
}

static void test_store_rejects_oversized_keys(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  char *long_key = xmalloc(4096);
  memset(long_key, 'k', 4095);
  long_key[4095] = '\0';
  assert_int_equal(st->ops->set(st, long_key, "x", 1), -ENAMETOOLONG);
  free(long_key);
  st->ops->destroy(st);
}

typedef struct stopping_store {
  store *st;
  int delay_ms;
} stopping_store;

static void *stop_after_delay(void *arg) {
  stopping_store *ss = arg;
  sleep_ms(ss->delay_ms);
  store_mem_stop(ss->st);
  return NULL;
}

/* A stopping daemon's rendezvous must not wait for peers that stop too:
 * a wait for a missing key gives up when the store stops, and later ones
 * at once; keys that are there are still read. */
static void test_store_stop_ends_waits_for_missing_keys(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  assert_int_equal(st->ops->set(st, "there", "x", 1), 0);
  stopping_store ss = {st, 50};
  pthread_t stopper;
  assert_int_equal(pthread_create(&stopper, NULL, stop_after_delay, &ss), 0);
  void *value = NULL;
  size_t value_bytes = 0;
  double started_ms = now_ms();
  assert_int_equal(st->ops->get(st, "missing", &value, &value_bytes, 20000), -ECANCELED);
  double waited_ms = now_ms() - started_ms;
  pthread_join(stopper, NULL);
  if (waited_ms > 2000)
    fail_msg("get should give up when the store stops (~50 ms), took %.0f ms", waited_ms);
  started_ms = now_ms();
  assert_int_equal(st->ops->get(st, "missing", &value, &value_bytes, 20000), -ECANCELED);
  assert_true(now_ms() - started_ms < 50);
  assert_int_equal(st->ops->get(st, "there", &value, &value_bytes, 20000), 0);
  assert_int_equal(value_bytes, 1);
  free(value);
  st->ops->destroy(st);
}

/* ---- all-gather ------------------------------------------------------------ */

typedef struct gather_case {
  size_t bytes_per_rank;
  bool in_place;
} gather_case;

static void all_gather_body(rank_ctx *rc) {
  const gather_case *gc = rc->run->user;
  const int world = rc->run->world;
  const size_t n = gc->bytes_per_rank;
  uint8_t *gathered = xmalloc(n * (size_t)world);
  uint8_t *own = xmalloc(n);
  memset(gathered, 0xee, n * (size_t)world);
  uint8_t *send = gc->in_place ? gathered + (size_t)rc->rank * n : own;
  for (size_t i = 0; i < n; i++)
    send[i] = gather_byte(rc->rank, i);
  int call_rc = comm_all_gather(rc->c, send, gathered, n);
  if (call_rc != 0) {
    rank_fail(rc, "comm_all_gather returned %d: %s", call_rc, comm_last_error(rc->c));
  } else {
    for (int r = 0; r < world && rc->failure[0] == '\0'; r++)
      for (size_t i = 0; i < n; i++)
        if (gathered[(size_t)r * n + i] != gather_byte(r, i)) {
          rank_fail(rc, "%zu bytes per rank%s: byte %zu of rank %d's slice is %u, want %u", n,
                    gc->in_place ? " in place" : "", i, r, gathered[(size_t)r * n + i],
                    gather_byte(r, i));
          break;
        }
  }
  free(gathered);
  free(own);
}

static const size_t gather_sizes[] = {1, 7, 4097, 1000003};

static void check_all_gather(bool in_place) {
  for (int world = 1; world <= MAX_WORLD; world++)
    for (size_t s = 0; s < sizeof gather_sizes / sizeof gather_sizes[0]; s++) {
      gather_case gc = {gather_sizes[s], in_place};
      run_world(world, DEFAULT_TIMEOUT_MS, all_gather_body, &gc);
    }
}

static void test_all_gather_in_place_collects_every_rank_slice(void **state) {
  check_all_gather(true);
}

static void test_all_gather_out_of_place_collects_every_rank_slice(void **state) {
  check_all_gather(false);
}

/* ---- reduce-scatter --------------------------------------------------------- */

typedef struct scatter_case {
  size_t shard_numel;
  bool in_place;
} scatter_case;

static void reduce_scatter_body(rank_ctx *rc) {
  const scatter_case *sc = rc->run->user;
  const int world = rc->run->world;
  const size_t shard = sc->shard_numel, total = shard * (size_t)world;
  float *send = xmalloc(total * sizeof(float));
  float *separate_recv = xmalloc(shard * sizeof(float));
  float *recv = sc->in_place ? send + (size_t)rc->rank * shard : separate_recv;
  for (size_t j = 0; j < total; j++)
    send[j] = scatter_value(rc->rank, j);
  int call_rc = comm_reduce_scatter_f32(rc->c, send, recv, shard);
  if (call_rc != 0) {
    rank_fail(rc, "comm_reduce_scatter_f32 returned %d: %s", call_rc, comm_last_error(rc->c));
  } else {
    for (size_t i = 0; i < shard; i++) {
      size_t j = (size_t)rc->rank * shard + i;
      float want = 0.0f;
      for (int r = 0; r < world; r++)
        want += scatter_value(r, j);
      if (recv[i] != want) {
        rank_fail(rc, "shard_numel %zu%s: element %zu of the shard is %g, want %g", shard,
                  sc->in_place ? " in place" : "", i, (double)recv[i], (double)want);
        break;
      }
    }
  }
  free(send);
  free(separate_recv);
}

static void test_reduce_scatter_sums_every_rank_slice(void **state) {
  /* 1, a short odd shard, and shards just past 1 and 2 MiB. */
  const size_t shard_sizes[] = {1, 3, 262145, 524289};
  for (int world = 1; world <= MAX_WORLD; world++)
    for (size_t s = 0; s < sizeof shard_sizes / sizeof shard_sizes[0]; s++) {
      scatter_case sc = {shard_sizes[s], false};
      run_world(world, DEFAULT_TIMEOUT_MS, reduce_scatter_body, &sc);
    }
}

static void test_reduce_scatter_sums_a_large_shard(void **state) {
  scatter_case sc = {4u << 20, false}; /* 4 Mi floats: 16 MiB per shard */
  run_world(2, 60000, reduce_scatter_body, &sc);
  sc.shard_numel = (1u << 20) + 5;
  run_world(3, 60000, reduce_scatter_body, &sc);
}

static void test_reduce_scatter_in_place_into_own_shard(void **state) {
  for (int world = 1; world <= 3; world++) {
    scatter_case sc = {300001, true};
    run_world(world, DEFAULT_TIMEOUT_MS, reduce_scatter_body, &sc);
  }
}

/* Random normal data, so that the sums round: the result must still be the
 * same bits on every run. */
static void reduce_scatter_twice_body(rank_ctx *rc) {
  const size_t shard = 100003, total = shard * (size_t)rc->run->world;
  float *send = xmalloc(total * sizeof(float));
  float *first = xmalloc(shard * sizeof(float)), *second = xmalloc(shard * sizeof(float));
  float *results[2] = {first, second};
  for (int attempt = 0; attempt < 2; attempt++) {
    uint64_t seed = 1000u + (uint64_t)rc->rank;
    for (size_t j = 0; j < total; j++)
      send[j] = (float)((double)(rng_next(&seed) >> 11) * 0x1p-53 - 0.5) * 3.0f;
    int call_rc = comm_reduce_scatter_f32(rc->c, send, results[attempt], shard);
    if (call_rc != 0) {
      rank_fail(rc, "comm_reduce_scatter_f32 returned %d: %s", call_rc, comm_last_error(rc->c));
      break;
    }
  }
  if (rc->failure[0] == '\0' && memcmp(first, second, shard * sizeof(float)) != 0)
    rank_fail(rc, "two reduce-scatters of the same data gave different bits");
  /* The bits are those of a sequential sum in rank order, as one process
   * adding the ranks' gradients would compute them; the hierarchical
   * backend's, of each node's ranks in order, then of the nodes in order. */
  const int L = use_backend == HIER ? rc->run->local_size : rc->run->world;
  float *want = xmalloc(shard * sizeof(float)), *node = xmalloc(shard * sizeof(float));
  for (int r = 0; r < rc->run->world; r++) {
    uint64_t seed = 1000u + (uint64_t)r;
    size_t begin = (size_t)rc->rank * shard;
    for (size_t j = 0; j < total; j++) {
      float v = (float)((double)(rng_next(&seed) >> 11) * 0x1p-53 - 0.5) * 3.0f;
      if (j >= begin && j < begin + shard)
        node[j - begin] = r % L == 0 ? v : node[j - begin] + v;
    }
    if (r % L == L - 1)
      for (size_t i = 0; i < shard; i++)
        want[i] = r / L == 0 ? node[i] : want[i] + node[i];
  }
  if (rc->failure[0] == '\0' && memcmp(first, want, shard * sizeof(float)) != 0)
    rank_fail(rc, "the sum is not the %s sum",
              use_backend == HIER ? "nodes-then-ranks" : "rank-order sequential");
  free(node);
  free(want);
  free(send);
  free(first);
  free(second);
}

static void test_reduce_scatter_is_deterministic_run_to_run(void **state) {
  run_world(3, DEFAULT_TIMEOUT_MS, reduce_scatter_twice_body, NULL);
  run_world(4, DEFAULT_TIMEOUT_MS, reduce_scatter_twice_body, NULL);
}

/* ---- all-reduce, broadcast, barrier ---------------------------------------- */

#define REDUCE_NUMEL 1031

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

static void all_reduce_body(rank_ctx *rc) {
  static const comm_dtype dtypes[] = {COMM_F32, COMM_F64, COMM_I64, COMM_U8};
  static const comm_op ops[] = {COMM_SUM, COMM_MAX, COMM_MIN};
  const int world = rc->run->world;
  for (size_t d = 0; d < 4; d++)
    for (size_t o = 0; o < 3; o++) {
      comm_dtype dtype = dtypes[d];
      comm_op op = ops[o];
      union {
        float f32[REDUCE_NUMEL];
        double f64[REDUCE_NUMEL];
        int64_t i64[REDUCE_NUMEL];
        uint8_t u8[REDUCE_NUMEL];
      } buf;
      /* u8 holds 0..255, so its inputs are shifted to be non-negative and
       * kept small enough for the sum not to wrap. */
      for (size_t i = 0; i < REDUCE_NUMEL; i++) {
        double x = reduce_input(rc->rank, i);
        if (dtype == COMM_F32)
          buf.f32[i] = (float)x;
        else if (dtype == COMM_F64)
          buf.f64[i] = x * 1e-3;
        else if (dtype == COMM_I64)
          buf.i64[i] = (int64_t)x * ((int64_t)1 << 40);
        else
          buf.u8[i] = (uint8_t)(x + 44);
      }
      RANK_CALL(rc, comm_all_reduce(rc->c, &buf, REDUCE_NUMEL, dtype, op));
      for (size_t i = 0; i < REDUCE_NUMEL; i++) {
        double want = reduce_input(0, i), want_u8 = reduce_input(0, i) + 44;
        for (int r = 1; r < world; r++) {
          want = combine(op, want, reduce_input(r, i));
          want_u8 = combine(op, want_u8, reduce_input(r, i) + 44);
        }
        bool ok;
        if (dtype == COMM_F32)
          ok = buf.f32[i] == (float)want;
        else if (dtype == COMM_F64)
          ok = fabs(buf.f64[i] - want * 1e-3) <= 1e-12;
        else if (dtype == COMM_I64)
          ok = buf.i64[i] == (int64_t)want * ((int64_t)1 << 40);
        else
          ok = buf.u8[i] == (uint8_t)want_u8;
        RANK_CHECK(rc, ok, "dtype %d op %d: element %zu differs from the reduction of all ranks",
                   (int)dtype, (int)op, i);
      }
    }
}

static void test_all_reduce_combines_every_dtype_and_op(void **state) {
  for (int world = 1; world <= 3; world++)
    run_world(world, DEFAULT_TIMEOUT_MS, all_reduce_body, NULL);
}

typedef struct broadcast_case {
  int root;
  size_t bytes;
} broadcast_case;

static void broadcast_body(rank_ctx *rc) {
  const broadcast_case *bc = rc->run->user;
  uint8_t *buf = xmalloc(bc->bytes);
  for (size_t i = 0; i < bc->bytes; i++)
    buf[i] = rc->rank == bc->root ? gather_byte(bc->root, i) : 0;
  RANK_CALL(rc, comm_broadcast(rc->c, buf, bc->bytes, bc->root));
  for (size_t i = 0; i < bc->bytes; i++)
    if (buf[i] != gather_byte(bc->root, i)) {
      rank_fail(rc, "byte %zu is %u, want root %d's %u", i, buf[i], bc->root,
                gather_byte(bc->root, i));
      break;
    }
  free(buf);
}

static void test_broadcast_from_a_nonzero_root_reaches_every_rank(void **state) {
  broadcast_case cases[] = {{2, 4097}, {1, 1}, {3, 1000003}};
  run_world(3, DEFAULT_TIMEOUT_MS, broadcast_body, &cases[0]);
  run_world(2, DEFAULT_TIMEOUT_MS, broadcast_body, &cases[1]);
  run_world(4, DEFAULT_TIMEOUT_MS, broadcast_body, &cases[2]);
}

static void barrier_body(rank_ctx *rc) {
  atomic_int *arrived = rc->run->user;
  /* Later ranks arrive later, so a barrier that let anyone through early
   * would see fewer than world arrivals. */
  sleep_ms(30 * rc->rank);
  atomic_fetch_add(arrived, 1);
  RANK_CALL(rc, comm_barrier(rc->c));
  int seen = atomic_load(arrived);
  RANK_CHECK(rc, seen == rc->run->world, "left the barrier after %d of %d arrivals", seen,
             rc->run->world);
}

static void test_barrier_waits_for_every_rank(void **state) {
  for (int world = 1; world <= MAX_WORLD; world++) {
    atomic_int arrived = 0;
    run_world(world, DEFAULT_TIMEOUT_MS, barrier_body, &arrived);
  }
}

/* ---- failures --------------------------------------------------------------- */

static void test_create_times_out_when_a_rank_is_missing(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm_options options = {.prefix = "test/lonely", .rank = 0, .world_size = 2, .timeout_ms = 500};
  comm *c = NULL;
  char err[256] = "";
  double started_ms = now_ms();
  int rc = comm_gloo_create(&options, st, &c, err, sizeof err);
  double took_ms = now_ms() - started_ms;
  assert_int_equal(rc, -ETIMEDOUT);
  assert_null(c);
  if (took_ms < 450 || took_ms > 3000)
    fail_msg("create should give up after about 500 ms, took %.0f ms", took_ms);
  if (strstr(err, "rendezvous: timed out after 500 ms waiting for rank 1") == NULL)
    fail_msg("the error should name the missing rank, got \"%s\"", err);
  st->ops->destroy(st);
}

static void test_create_rejects_bad_options(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm *c = NULL;
  char err[256] = "";
  comm_options options = {.prefix = "test/bad", .rank = 2, .world_size = 2, .timeout_ms = 500};
  assert_int_equal(comm_gloo_create(&options, st, &c, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, "rank 2"));
  options.rank = 0;
  options.timeout_ms = 0;
  assert_int_equal(comm_gloo_create(&options, st, &c, err, sizeof err), -EINVAL);
  options.timeout_ms = 500;
  options.prefix = "";
  assert_int_equal(comm_gloo_create(&options, st, &c, err, sizeof err), -EINVAL);
  assert_null(c);
  st->ops->destroy(st);
}

static void test_create_removes_its_rendezvous_keys(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  atomic_int arrived = 0;
  run_world_in(st, 2, DEFAULT_TIMEOUT_MS, barrier_body, &arrived);
  /* Gloo's keys are "<r>" (pair addresses) and "rank_<r>" (host names). */
  const char *keys[] = {"test/job/1/epoch/0/0", "test/job/1/epoch/0/1", "test/job/1/epoch/0/rank_0",
                        "test/job/1/epoch/0/rank_1"};
  for (size_t i = 0; i < 4; i++) {
    void *value = NULL;
    size_t value_bytes = 0;
    int rc = st->ops->get(st, keys[i], &value, &value_bytes, 0);
    free(value);
    if (rc != -ETIMEDOUT)
      fail_msg("key \"%s\" should be gone once every rank has connected (get returned %d)", keys[i],
               rc);
  }
  st->ops->destroy(st);
}

/* Rank 1 creates its communicator and then stops calling (its thread
 * returns, its communicator stays open, like a stuck process). */
typedef struct stall_state {
  atomic_int rank0_failed;
  int first_rc, second_rc, late_rc;
  double first_ms, second_ms, late_ms, destroy_ms;
  char first_error[256];
  bool late_rank_calls; /* rank 1 calls once rank 0 has failed */
} stall_state;

static void stall_body(rank_ctx *rc) {
  stall_state *ss = rc->run->user;
  uint8_t gathered[2 * 64];
  if (rc->rank == 1) {
    if (!ss->late_rank_calls) {
      rc->keep_comm = true;
      return;
    }
    while (atomic_load(&ss->rank0_failed) == 0)
      sleep_ms(1);
    double started_ms = now_ms();
    ss->late_rc = comm_all_gather(rc->c, gathered + 64, gathered, 64);
    ss->late_ms = now_ms() - started_ms;
    return;
  }
  double started_ms = now_ms();
  ss->first_rc = comm_all_gather(rc->c, gathered, gathered, 64);
  ss->first_ms = now_ms() - started_ms;
  snprintf(ss->first_error, sizeof ss->first_error, "%s", comm_last_error(rc->c));
  started_ms = now_ms();
  ss->second_rc = comm_barrier(rc->c);
  ss->second_ms = now_ms() - started_ms;
  atomic_store(&ss->rank0_failed, 1);
  started_ms = now_ms();
  comm_destroy(rc->c);
  rc->c = NULL;
  ss->destroy_ms = now_ms() - started_ms;
}

static void test_all_gather_times_out_when_a_peer_stops_calling(void **state) {
  stall_state ss = {0};
  run_world(2, 500, stall_body, &ss);
  assert_int_equal(ss.first_rc, -ETIMEDOUT);
  if (ss.first_ms < 450 || ss.first_ms > 3000)
    fail_msg("all_gather should time out after about 500 ms, took %.0f ms", ss.first_ms);
  if (strstr(ss.first_error, "all_gather: timed out after 500 ms waiting for rank 1") == NULL)
    fail_msg("the error should name the silent rank, got \"%s\"", ss.first_error);
  /* The communicator is broken: the next call fails at once with the same
   * error, and destroying it does not wait for the peer. */
  assert_int_equal(ss.second_rc, -ETIMEDOUT);
  if (ss.second_ms > 50)
    fail_msg("a call on a broken communicator should fail fast, took %.0f ms", ss.second_ms);
  if (ss.destroy_ms > 1000)
    fail_msg("comm_destroy after a timeout took %.0f ms", ss.destroy_ms);
}

static void test_late_rank_fails_fast_after_its_peer_timed_out(void **state) {
  stall_state ss = {.late_rank_calls = true};
  run_world(2, 1000, stall_body, &ss);
  assert_int_equal(ss.first_rc, -ETIMEDOUT);
  /* Rank 0 closed its connections when it gave up, so rank 1 learns of it
   * at once instead of waiting out its own timeout. */
  if (ss.late_rc == 0)
    fail_msg("rank 1's all_gather should fail once rank 0 has given up");
  if (ss.late_ms > 500)
    fail_msg("rank 1 should fail fast, took %.0f ms (timeout 1000 ms)", ss.late_ms);
}

/* comm_abort, the daemon's stop: rank 1 builds its communicator and stops
 * calling (like a peer whose worker is gone); rank 0 enters a collective
 * with it and waits, and rank 1's thread aborts rank 0's communicator. The
 * call returns at once, not at the 20 s timeout, and later calls fail
 * fast. */
typedef enum abort_call {
  ABORT_ALL_GATHER,
  ABORT_REDUCE_SCATTER,
  ABORT_ALL_REDUCE,
  ABORT_BROADCAST,
  ABORT_BARRIER,
  ABORT_CALLS
} abort_call;

typedef struct abort_state {
  abort_call call;
  _Atomic(comm *) victim; /* rank 0's communicator, once rank 0 is about to call */
  atomic_int aborted;     /* rank 1 has returned from comm_abort */
  int first_rc, second_rc;
  double first_ms, second_ms;
  char first_error[256];
} abort_state;

static int call_collective(comm *c, abort_call call) {
  float floats[2 * 64] = {0};
  uint8_t bytes[2 * 64] = {0};
  switch (call) {
  case ABORT_ALL_GATHER:
    return comm_all_gather(c, bytes, bytes, 64);
  case ABORT_REDUCE_SCATTER:
    return comm_reduce_scatter_f32(c, floats, floats + 64, 32);
  case ABORT_ALL_REDUCE:
    return comm_all_reduce(c, floats, 64, COMM_F32, COMM_SUM);
  case ABORT_BROADCAST:
    return comm_broadcast(c, bytes, 64, 1);
  default:
    return comm_barrier(c);
  }
}

static void abort_body(rank_ctx *rc) {
  abort_state *as = rc->run->user;
  if (rc->rank == 1) {
    rc->keep_comm = true; /* silent, connected */
    comm *victim;
    while ((victim = atomic_load(&as->victim)) == NULL)
      sleep_ms(1);
    sleep_ms(100); /* rank 0 is waiting in its call by now */
    comm_abort(victim);
    atomic_store(&as->aborted, 1);
    return;
  }
  atomic_store(&as->victim, rc->c);
  double started_ms = now_ms();
  as->first_rc = call_collective(rc->c, as->call);
  as->first_ms = now_ms() - started_ms;
  snprintf(as->first_error, sizeof as->first_error, "%s", comm_last_error(rc->c));
  started_ms = now_ms();
  as->second_rc = comm_barrier(rc->c);
  as->second_ms = now_ms() - started_ms;
  /* comm_abort and comm_destroy never overlap (comm.h). */
  while (atomic_load(&as->aborted) == 0)
    sleep_ms(1);
}

static void test_abort_ends_a_collective_waiting_for_a_silent_peer(void **state) {
  for (int call = 0; call < ABORT_CALLS; call++) {
    abort_state as = {.call = (abort_call)call};
    run_world(2, DEFAULT_TIMEOUT_MS, abort_body, &as);
    if (as.first_rc != -ECANCELED)
      fail_msg("call %d returned %d (%s), want -ECANCELED", call, as.first_rc, as.first_error);
    if (as.first_ms > 2000)
      fail_msg("call %d should return at the abort (~100 ms), took %.0f ms", call, as.first_ms);
    assert_non_null(strstr(as.first_error, "communicator aborted"));
    assert_int_equal(as.second_rc, -ECANCELED);
    if (as.second_ms > 50)
      fail_msg("a call after the abort should fail fast, took %.0f ms", as.second_ms);
  }
}

/* A rank in the rendezvous whose peer never comes gives up when the store
 * stops (the daemon's stop), not at the timeout. */
static void test_create_gives_up_when_the_store_stops(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  stopping_store ss = {st, 100};
  pthread_t stopper;
  assert_int_equal(pthread_create(&stopper, NULL, stop_after_delay, &ss), 0);
  comm_options options = {
      .prefix = "test/stopped", .rank = 0, .world_size = 2, .timeout_ms = DEFAULT_TIMEOUT_MS};
  comm *c = NULL;
  char err[256] = "";
  double started_ms = now_ms();
  int rc = comm_gloo_create(&options, st, &c, err, sizeof err);
  double took_ms = now_ms() - started_ms;
  pthread_join(stopper, NULL);
  assert_int_equal(rc, -ECANCELED);
  assert_null(c);
  if (took_ms > 2000)
    fail_msg("create should give up when the store stops (~100 ms), took %.0f ms", took_ms);
  st->ops->destroy(st);
}

static void invalid_arguments_body(rank_ctx *rc) {
  int call_rc = comm_broadcast(rc->c, "x", 1, 5);
  RANK_CHECK(rc, call_rc == -EINVAL, "broadcast from root 5 of 1 returned %d", call_rc);
  RANK_CHECK(rc, strstr(comm_last_error(rc->c), "root 5") != NULL,
             "the error should name the bad root, got \"%s\"", comm_last_error(rc->c));
  /* Peers would now be out of step, so the communicator stays broken. */
  call_rc = comm_barrier(rc->c);
  RANK_CHECK(rc, call_rc == -EINVAL, "a call after a failure returned %d", call_rc);
}

static void test_bad_arguments_fail_and_break_the_communicator(void **state) {
  run_world(1, DEFAULT_TIMEOUT_MS, invalid_arguments_body, NULL);
}

/* ---- the local backend ------------------------------------------------------ */

static int gloo_backend(void **state) {
  (void)state;
  use_backend = GLOO;
  return 0;
}

static int local_backend(void **state) {
  (void)state;
  use_backend = LOCAL;
  return 0;
}

static int hier_backend(void **state) {
  (void)state;
  use_backend = HIER;
  return 0;
}

/* Sums of values that round: the local backend's reduce-scatter must add
 * them in the same order as Gloo's (rank order), to the bit. */
#define BITS_WORLD 3
#define BITS_SHARD 10007

typedef struct bits_state {
  float *inputs[BITS_WORLD]; /* each BITS_WORLD * BITS_SHARD */
  float results[BITS_WORLD][BITS_SHARD];
  double norms[BITS_WORLD][4];
} bits_state;

static void bits_body(rank_ctx *rc) {
  bits_state *bs = rc->run->user;
  RANK_CALL(
      rc, comm_reduce_scatter_f32(rc->c, bs->inputs[rc->rank], bs->results[rc->rank], BITS_SHARD));
  double *norms = bs->norms[rc->rank];
  for (int i = 0; i < 4; i++)
    norms[i] = 1.0 / (3.0 + rc->rank + i * 7.0);
  RANK_CALL(rc, comm_all_reduce(rc->c, norms, 4, COMM_F64, COMM_SUM));
}

static void test_local_sums_bit_for_bit_as_gloo(void **state) {
  (void)state;
  static bits_state gloo, local;
  uint64_t seed = 42;
  for (int r = 0; r < BITS_WORLD; r++) {
    gloo.inputs[r] = xmalloc(sizeof(float) * BITS_WORLD * BITS_SHARD);
    local.inputs[r] = xmalloc(sizeof(float) * BITS_WORLD * BITS_SHARD);
    for (size_t i = 0; i < (size_t)BITS_WORLD * BITS_SHARD; i++) {
      /* Magnitudes from 1e-4 to 1e4: sums that round differently in
       * another order. */
      double u = (double)(rng_next(&seed) >> 11) / 9007199254740992.0;
      gloo.inputs[r][i] = local.inputs[r][i] = (float)((u - 0.5) * pow(10.0, (double)(i % 9) - 4));
    }
  }
  use_backend = GLOO;
  run_world(BITS_WORLD, DEFAULT_TIMEOUT_MS, bits_body, &gloo);
  use_backend = LOCAL;
  run_world(BITS_WORLD, DEFAULT_TIMEOUT_MS, bits_body, &local);
  for (int r = 0; r < BITS_WORLD; r++)
    for (size_t i = 0; i < BITS_SHARD; i++) {
      size_t at = (size_t)r * BITS_SHARD + i;
      float want = (local.inputs[0][at] + local.inputs[1][at]) + local.inputs[2][at];
      if (memcmp(&want, &gloo.results[r][i], sizeof want) != 0 ||
          memcmp(&want, &local.results[r][i], sizeof want) != 0)
        fail_msg("rank %d element %zu: sequential %a, gloo %a, local %a", r, i, (double)want,
                 (double)gloo.results[r][i], (double)local.results[r][i]);
    }
  /* all_reduce: Gloo's is a ring (the order depends on the rank); the
   * local backend's is rank order on every rank, like its reduce-scatter. */
  for (int r = 0; r < BITS_WORLD; r++)
    for (int i = 0; i < 4; i++) {
      double want = (1.0 / (3.0 + i * 7.0) + 1.0 / (4.0 + i * 7.0)) + 1.0 / (5.0 + i * 7.0);
      assert_memory_equal(&local.norms[r][i], &want, sizeof want);
      assert_true(fabs(gloo.norms[r][i] - want) <= 1e-15);
    }
  /* And the order matters: a reversed sum differs somewhere. */
  size_t differs = 0;
  for (size_t i = 0; i < BITS_SHARD; i++) {
    float forward = (local.inputs[0][i] + local.inputs[1][i]) + local.inputs[2][i];
    float backward = (local.inputs[2][i] + local.inputs[1][i]) + local.inputs[0][i];
    differs += forward != backward;
  }
  assert_true(differs > 0);
  for (int r = 0; r < BITS_WORLD; r++) {
    free(gloo.inputs[r]);
    free(local.inputs[r]);
  }
}

static void test_local_create_waits_for_every_rank_then_times_out(void **state) {
  (void)state;
  comm_local_group *g = NULL;
  assert_int_equal(comm_local_group_create(2, &g), 0);
  comm_options options = {.rank = 0, .world_size = 2, .timeout_ms = 300};
  comm *c = NULL;
  char err[256] = "";
  double started_ms = now_ms();
  int rc = comm_local_create(&options, g, &c, err, sizeof err);
  double took_ms = now_ms() - started_ms;
  assert_int_equal(rc, -ETIMEDOUT);
  assert_null(c);
  if (took_ms < 250 || took_ms > 3000)
    fail_msg("create should give up after about 300 ms, took %.0f ms", took_ms);
  if (strstr(err, "rendezvous: timed out after 300 ms waiting for rank 1") == NULL)
    fail_msg("the error should name the missing rank, got \"%s\"", err);
  /* Bad options are refused before anything waits. */
  options.rank = 2;
  assert_int_equal(comm_local_create(&options, g, &c, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, "rank 2 of 2"));
  options = (comm_options){.rank = 0, .world_size = 3, .timeout_ms = 300};
  assert_int_equal(comm_local_create(&options, g, &c, err, sizeof err), -EINVAL);
  options = (comm_options){.rank = 0, .world_size = 2, .timeout_ms = 0};
  assert_int_equal(comm_local_create(&options, g, &c, err, sizeof err), -EINVAL);
  comm_local_group_unref(g);
}

/* A rank that leaves (its communicator destroyed: its job failed) wakes a
 * peer waiting for it at once. */
typedef struct leave_state {
  atomic_int waiting;
  int rc;
  double ms;
  char error[256];
} leave_state;

static void leave_body(rank_ctx *rc) {
  leave_state *ls = rc->run->user;
  if (rc->rank == 1) {
    while (atomic_load(&ls->waiting) == 0)
      sleep_ms(1);
    sleep_ms(100);
    comm_destroy(rc->c);
    rc->c = NULL;
    return;
  }
  uint8_t bytes[2 * 16];
  atomic_store(&ls->waiting, 1);
  double started_ms = now_ms();
  ls->rc = comm_all_gather(rc->c, bytes, bytes, 16);
  ls->ms = now_ms() - started_ms;
  snprintf(ls->error, sizeof ls->error, "%s", comm_last_error(rc->c));
}

static void test_local_peer_leaving_fails_a_waiting_rank_at_once(void **state) {
  (void)state;
  leave_state ls = {0};
  use_backend = LOCAL;
  run_world(2, DEFAULT_TIMEOUT_MS, leave_body, &ls);
  assert_int_equal(ls.rc, -ECONNRESET);
  if (ls.ms > 2000)
    fail_msg("the waiting rank should fail when its peer leaves (~100 ms), took %.0f ms", ls.ms);
  assert_non_null(strstr(ls.error, "all_gather: rank 1 left"));
}

/* Ranks whose workers sent different requests call different collectives:
 * every rank fails with -EPROTO, and none reads past a peer's buffer. */
typedef struct mismatch_state {
  int second; /* rank 1's call: 0 all_reduce, 1 barrier, 2 all_gather of another size */
  int rc[2];
  char error[2][256];
} mismatch_state;

static void mismatch_body(rank_ctx *rc) {
  mismatch_state *ms = rc->run->user;
  uint8_t gathered[2 * 64] = {0};
  double sums[4] = {0};
  int got;
  if (rc->rank == 0)
    got = comm_all_gather(rc->c, gathered, gathered, 64);
  else if (ms->second == 0)
    got = comm_all_reduce(rc->c, sums, 4, COMM_F64, COMM_SUM);
  else if (ms->second == 1)
    got = comm_barrier(rc->c);
  else
    got = comm_all_gather(rc->c, gathered + 32, gathered, 32);
  ms->rc[rc->rank] = got;
  snprintf(ms->error[rc->rank], sizeof ms->error[rc->rank], "%s", comm_last_error(rc->c));
}

static void test_local_ranks_out_of_step_fail_without_touching_buffers(void **state) {
  (void)state;
  use_backend = LOCAL;
  for (int second = 0; second < 3; second++) {
    mismatch_state ms = {.second = second};
    run_world(2, DEFAULT_TIMEOUT_MS, mismatch_body, &ms);
    for (int r = 0; r < 2; r++) {
      if (ms.rc[r] != -EPROTO)
        fail_msg("case %d, rank %d: returned %d (%s), want -EPROTO", second, r, ms.rc[r],
                 ms.error[r]);
      assert_non_null(strstr(ms.error[r], "out of step"));
    }
  }
}

/* Bytes by level: 2 nodes of 2 ranks. Cross-node, each rank moves N = 2
 * slices of a gather and 2 shards of a reduce, where a flat communicator
 * moves W = 4. */
typedef struct levels_state {
  uint64_t gather[MAX_WORLD][COMM_LEVELS], reduce[MAX_WORLD][COMM_LEVELS];
} levels_state;

static void levels_body(rank_ctx *rc) {
  levels_state *ls = rc->run->user;
  uint64_t ignored[COMM_LEVELS];
  comm_take_bytes(rc->c, ignored); /* the rendezvous */
  uint8_t gathered[4 * 100] = {0};
  float grads[4 * 25] = {0}, mine[25];
  RANK_CALL(rc, comm_all_gather(rc->c, gathered + rc->rank * 100, gathered, 100));
  comm_take_bytes(rc->c, ls->gather[rc->rank]);
  RANK_CALL(rc, comm_reduce_scatter_f32(rc->c, grads, mine, 25));
  comm_take_bytes(rc->c, ls->reduce[rc->rank]);
}

static void test_hier_moves_n_slices_across_nodes(void **state) {
  (void)state;
  levels_state ls = {0};
  use_backend = HIER;
  run_world(4, DEFAULT_TIMEOUT_MS, levels_body, &ls);
  for (int r = 0; r < 4; r++) {
    assert_int_equal(ls.gather[r][COMM_LEVEL_CROSS], 2 * 100);
    assert_int_equal(ls.gather[r][COMM_LEVEL_NODE], 4 * 100);
    assert_int_equal(ls.gather[r][COMM_LEVEL_WORLD], 0);
    assert_int_equal(ls.reduce[r][COMM_LEVEL_CROSS], 2 * 25 * sizeof(float));
    assert_int_equal(ls.reduce[r][COMM_LEVEL_NODE], 4 * 25 * sizeof(float));
  }
  /* A flat communicator counts everything at its own level. */
  memset(&ls, 0, sizeof ls);
  use_backend = GLOO;
  run_world(4, DEFAULT_TIMEOUT_MS, levels_body, &ls);
  assert_int_equal(ls.gather[0][COMM_LEVEL_NODE], 4 * 100);
  assert_int_equal(ls.reduce[0][COMM_LEVEL_NODE], 4 * 25 * sizeof(float));
}

/* all_to_all: chunk j of rank r's send lands as chunk r of rank j's recv. */
static void all_to_all_body(rank_ctx *rc) {
  const int W = rc->run->world;
  const size_t b = 1000;
  uint8_t *send = xmalloc(b * (size_t)W), *recv = xmalloc(b * (size_t)W);
  memset(send, 0, b * (size_t)W);
  for (int j = 0; j < W; j++)
    memset(send + (size_t)j * b, rc->rank * 16 + j, b);
  RANK_CALL(rc, comm_all_to_all(rc->c, send, recv, b));
  for (int r = 0; r < W; r++)
    for (size_t i = 0; i < b; i++)
      RANK_CHECK(rc, recv[(size_t)r * b + i] == (uint8_t)(r * 16 + rc->rank),
                 "chunk %d byte %zu is %u, want %u", r, i, recv[(size_t)r * b + i],
                 (unsigned)(r * 16 + rc->rank));
  free(send);
  free(recv);
}

static void test_all_to_all_swaps_every_chunk(void **state) {
  (void)state;
  for (int world = 1; world <= 4; world++)
    run_world(world, DEFAULT_TIMEOUT_MS, all_to_all_body, NULL);
}

/* qgZ on 2 nodes of 2 ranks: each node's partial sums cross as int8, int4
 * or bf16 blocks; the result is within the encoding's bound of the exact
 * sum (half a step of each node's partial, summed over the nodes), and the
 * cross-node bytes are the encoded ones. */
typedef struct wire_state {
  comm_wire wire;
  uint64_t cross[4];
  double worst_excess[4];
} wire_state;

#define WIRE_SHARD 3001

static float wire_value(int rank, size_t j) {
  uint64_t seed = 77 + (uint64_t)rank * 1000003 + j;
  return (float)(((double)(rng_next(&seed) >> 11) * 0x1p-53 - 0.5) * (1 + (double)(j % 7)));
}

static void wire_body(rank_ctx *rc) {
  wire_state *ws = rc->run->user;
  const int W = 4, L = 2;
  float *send = xmalloc(sizeof(float) * WIRE_SHARD * W), recv[WIRE_SHARD];
  for (size_t j = 0; j < (size_t)WIRE_SHARD * W; j++)
    send[j] = wire_value(rc->rank, j);
  uint64_t bytes[COMM_LEVELS];
  comm_take_bytes(rc->c, bytes);
  RANK_CALL(rc, comm_reduce_scatter_f32_wire(rc->c, send, recv, WIRE_SHARD, &ws->wire));
  comm_take_bytes(rc->c, bytes);
  ws->cross[rc->rank] = bytes[COMM_LEVEL_CROSS];
  /* The bound: per node, half a step of its partial's block (int), or
   * bf16's half ulp (2^-9 relative). */
  int qmax = ws->wire.format == COMM_WIRE_INT4 ? 7 : 127;
  double worst = -1e30;
  size_t block = ws->wire.block != 0 ? ws->wire.block : WIRE_SHARD; /* bf16: no blocks */
  for (size_t i0 = 0; i0 < WIRE_SHARD; i0 += block) {
    size_t end = i0 + block < WIRE_SHARD ? i0 + block : WIRE_SHARD;
    double bound[2] = {0, 0};
    for (int n = 0; n < 2; n++) {
      double m = 0;
      for (size_t i = i0; i < end; i++) {
        size_t at = (size_t)rc->rank * WIRE_SHARD + i;
        double p = (double)(float)(wire_value(n * L, at) + wire_value(n * L + 1, at));
        m = fabs(p) > m ? fabs(p) : m;
      }
      bound[n] = 0.5001 * m / qmax;
    }
    for (size_t i = i0; i < end; i++) {
      size_t at = (size_t)rc->rank * WIRE_SHARD + i;
      double exact = 0, b = 0;
      for (int n = 0; n < 2; n++) {
        float p = wire_value(n * L, at) + wire_value(n * L + 1, at);
        exact += p;
        b += ws->wire.format == COMM_WIRE_BF16 ? fabs(p) * 0x1p-8 : bound[n];
      }
      double excess = fabs(recv[i] - exact) - (b + 1e-6 * fabs(exact));
      worst = excess > worst ? excess : worst;
    }
  }
  ws->worst_excess[rc->rank] = worst;
  free(send);
}

static void test_hier_reduce_scatter_on_the_wire(void **state) {
  (void)state;
  use_backend = HIER;
  const comm_wire wires[] = {{COMM_WIRE_INT8, 64}, {COMM_WIRE_INT4, 64}, {COMM_WIRE_BF16, 0}};
  for (size_t k = 0; k < 3; k++) {
    wire_state ws = {.wire = wires[k]};
    run_world(4, DEFAULT_TIMEOUT_MS, wire_body, &ws);
    zk_qformat fmt = {.bits = wires[k].format == COMM_WIRE_INT4 ? 4 : 8,
                      .mode = ZK_QSYM,
                      .block_numel = wires[k].block};
    size_t q =
        wires[k].format == COMM_WIRE_BF16 ? WIRE_SHARD * 2 : zk_quant_bytes(&fmt, WIRE_SHARD);
    for (int r = 0; r < 4; r++) {
      if (ws.worst_excess[r] > 0)
        fail_msg("wire %zu, rank %d: an element is %g past the bound", k, r, ws.worst_excess[r]);
      assert_int_equal(ws.cross[r], 2 * q); /* N = 2 encoded slices */
    }
  }
}

#define BOTH(test)                                                                                 \
  cmocka_unit_test_setup(test, gloo_backend), cmocka_unit_test_setup(test, local_backend),         \
      cmocka_unit_test_setup(test, hier_backend)

int main(void) {
  /* Gloo writes to sockets without MSG_NOSIGNAL; the daemon ignores SIGPIPE
   * for the same reason. */
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_store_get_waits_for_a_key_set_by_another_thread),
      cmocka_unit_test(test_store_get_times_out_on_a_missing_key),
      cmocka_unit_test(test_store_set_replaces_and_keeps_many_keys),
      cmocka_unit_test(test_store_delete_prefix_removes_only_matching_keys),
      cmocka_unit_test(test_store_rejects_oversized_keys),
      cmocka_unit_test(test_store_stop_ends_waits_for_missing_keys),
      BOTH(test_all_gather_in_place_collects_every_rank_slice),
      BOTH(test_all_gather_out_of_place_collects_every_rank_slice),
      BOTH(test_reduce_scatter_sums_every_rank_slice),
      BOTH(test_reduce_scatter_sums_a_large_shard),
      BOTH(test_reduce_scatter_in_place_into_own_shard),
      BOTH(test_reduce_scatter_is_deterministic_run_to_run),
      BOTH(test_all_reduce_combines_every_dtype_and_op),
      BOTH(test_broadcast_from_a_nonzero_root_reaches_every_rank),
      BOTH(test_barrier_waits_for_every_rank),
      cmocka_unit_test_setup(test_create_times_out_when_a_rank_is_missing, gloo_backend),
      cmocka_unit_test_setup(test_create_rejects_bad_options, gloo_backend),
      cmocka_unit_test_setup(test_create_removes_its_rendezvous_keys, gloo_backend),
      BOTH(test_all_gather_times_out_when_a_peer_stops_calling),
      BOTH(test_late_rank_fails_fast_after_its_peer_timed_out),
      BOTH(test_abort_ends_a_collective_waiting_for_a_silent_peer),
      cmocka_unit_test_setup(test_create_gives_up_when_the_store_stops, gloo_backend),
      BOTH(test_bad_arguments_fail_and_break_the_communicator),
      cmocka_unit_test(test_local_sums_bit_for_bit_as_gloo),
      cmocka_unit_test(test_local_create_waits_for_every_rank_then_times_out),
      cmocka_unit_test(test_local_peer_leaving_fails_a_waiting_rank_at_once),
      cmocka_unit_test(test_local_ranks_out_of_step_fail_without_touching_buffers),
      cmocka_unit_test(test_hier_moves_n_slices_across_nodes),
      cmocka_unit_test_setup(test_all_to_all_swaps_every_chunk, gloo_backend),
      cmocka_unit_test_setup(test_all_to_all_swaps_every_chunk, local_backend),
      cmocka_unit_test(test_hier_reduce_scatter_on_the_wire),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
