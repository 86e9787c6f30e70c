/* comm_fixtures.h - what the communicator tests share (test_comm.c,
 * test_comm_failures.c, test_comm_local.c, test_comm_hier.c,
 * test_comm_store.c): running `world` ranks as threads of this process,
 * each with its own communicator of the backend a test's setup picks (Gloo
 * through one shared store_mem, the local backend, or the hierarchical
 * one), the rank checks that record a rank's first failure for the test
 * thread to report, and the data helpers more than one test uses.
 *
 * cmocka's assertions may only fail on the test's own thread, so rank
 * threads record their first failure in their rank_ctx and the test thread
 * reports it after joining them. */
#ifndef ZEROD_TESTS_COMM_FIXTURES_H
#define ZEROD_TESTS_COMM_FIXTURES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "comm.h"
#include "store.h"

#define MAX_WORLD          4
#define DEFAULT_TIMEOUT_MS 20000

/* ---- running a world of ranks on threads --------------------------------- */

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
extern backend use_backend;

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
void rank_fail(rank_ctx *rc, const char *fmt, ...);

/* Fails the rank with the message unless cond holds. */
#define RANK_CHECK(rc, cond, ...)                                                                  \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      rank_fail((rc), __VA_ARGS__);                                                                \
      return;                                                                                      \
    }                                                                                              \
  } while (0)

/* Fails the rank unless call returns 0, naming the call and the communicator's error. */
#define RANK_CALL(rc, call)                                                                        \
  do {                                                                                             \
    int call_rc_ = (call);                                                                         \
    RANK_CHECK((rc), call_rc_ == 0, "%s returned %d (%s): %s", #call, call_rc_,                    \
               strerror(-call_rc_), comm_last_error((rc)->c));                                     \
  } while (0)

/* Runs body on `world` ranks meeting through st; fails the test with a rank's failure. */
void run_world_in(store *st, int world, int timeout_ms, rank_body body, void *user);
/* The same with a store of its own. */
void run_world(int world, int timeout_ms, rank_body body, void *user);

/* A setup: the world runs use Gloo. */
int gloo_backend(void **state);
/* A setup: the world runs use the local backend. */
int local_backend(void **state);
/* A setup: the world runs use the hierarchical backend. */
int hier_backend(void **state);
/* A test run once on each backend. */
#define BOTH(test)                                                                                 \
  cmocka_unit_test_setup(test, gloo_backend), cmocka_unit_test_setup(test, local_backend),         \
      cmocka_unit_test_setup(test, hier_backend)

/* ---- helpers ------------------------------------------------------------- */

/* malloc that aborts when out of memory (and never returns NULL for 0 bytes). */
void *xmalloc(size_t bytes);
/* splitmix64: the next pseudo-random value of *state. */
uint64_t rng_next(uint64_t *state);
/* A body: ranks arrive at a barrier one by one, counted in the atomic_int user. */
void barrier_body(rank_ctx *rc);

/* ---- stopping a store ---------------------------------------------------- */

/* A store for stop_after_delay to stop after delay_ms. */
typedef struct stopping_store {
  store *st;
  int delay_ms;
} stopping_store;

/* A thread: sleeps the stopping_store arg's delay_ms, then stops its store. */
void *stop_after_delay(void *arg);

#endif /* ZEROD_TESTS_COMM_FIXTURES_H */
