/* rank_fixtures.h - what the rank executor tests share (test_rank.c,
 * test_rank_step.c, test_rank_errors.c): a job of one or two host ranks
 * with their executors started (the fixture), the completion queue the
 * executors hand finished ops to, queuing ops and waiting for them,
 * decoding replies, mapping the buffers behind them, and the test unit:
 * registering it, gathering it, and the values it starts from.
 *
 * Every op the test waits for carries TEST_SESSION: a non-NULL pointer
 * that nothing dereferences, since the executors only report ops that have
 * a session (test_rank.c says more). */
#ifndef ZEROD_TESTS_RANK_FIXTURES_H
#define ZEROD_TESTS_RANK_FIXTURES_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "exec.h"
#include "job.h"
#include "layout.h"
#include "store.h"

#define MAX_RANKS       2
#define COLLECTIVE_MS   20000 /* the ranks' collective timeout */
#define WAIT_MS         30000 /* how long the test waits for an op */
#define SESSION_ID      1
#define MAX_MAPPINGS    16
#define TEST_LR         0.1
#define TEST_LIVE_BYTES (64u << 20)

/* Never dereferenced: it only makes the executors report the op. */
extern char session_target;
#define TEST_SESSION ((struct session *)&session_target)

/* ---- The test's completion queue ----------------------------------------- */

typedef struct done_queue {
  pthread_mutex_t mutex;
  pthread_cond_t cond; /* CLOCK_MONOTONIC */
  exec_op *head, *tail;
} done_queue;

/* Takes the op of rs with request_id off the queue, waiting up to timeout_ms; NULL if it did not
 * come. */
exec_op *queue_take(done_queue *q, const rank_state *rs, uint64_t request_id, int timeout_ms);

/* ---- Checkpoint hooks: the node's side, replaced by counters ------------- */

/* How many times the executors called a checkpoint hook. */
extern atomic_int ckpt_hook_calls;

/* ---- A job and its executors --------------------------------------------- */

/* A buffer the test has mapped, by id, as libzerod caches them. */
typedef struct mapping {
  uint32_t id;
  void *base;
  size_t bytes;
} mapping;

typedef struct fixture {
  int world;
  store *st;
  done_queue q;
  exec_settings exec;
  job *j;
  int stopped[MAX_RANKS]; /* exec_rank_stop called */
  uint64_t next_request;
  mapping maps[MAX_RANKS][MAX_MAPPINGS];
} fixture;

/* A job of `world` host ranks (SGD, lr TEST_LR) with every executor started. */
fixture *fixture_open(int world);
/* Stops every rank before joining any (exec.h), then frees everything. */
void fixture_close(fixture *fx);
/* A setup: *state is a fixture of one rank. */
int setup_world1(void **state);
/* A setup: *state is a fixture of two ranks. */
int setup_world2(void **state);
/* A teardown: closes the fixture in *state. */
int teardown_fixture(void **state);
/* A test run on a fixture of `world` ranks, named with its world. */
#define RANK_TEST(fn, world)                                                                       \
  { #fn " [world " #world "]", fn, setup_world##world, teardown_fixture, NULL }

/* ---- Ops ----------------------------------------------------------------- */

/* The request as the loop hands it over: decoded from its wire form, owned by the op. */
ProtobufCMessage *owned_request(uint16_t type, const ProtobufCMessage *msg);
/* Queues an op on rank r; returns its request id. */
uint64_t submit_to(fixture *fx, int r, op_kind kind, uint16_t type, const ProtobufCMessage *req,
                   int in_fd, uint64_t request_id);
/* Queues the same request on every rank (a collective); rank0_fd goes to rank 0 only. */
uint64_t submit_all(fixture *fx, op_kind kind, uint16_t type, const ProtobufCMessage *req,
                    int rank0_fd);
/* Waits for rank r's op `id`; fails the test if it does not come within WAIT_MS. */
exec_op *wait_op(fixture *fx, int r, uint64_t id, const char *what);

/* ---- Replies ------------------------------------------------------------- */

/* Decodes an op's reply frame; fails unless it is of `type`. The caller frees the message. */
ProtobufCMessage *reply_of(const exec_op *op, uint16_t type, const char *what);
/* Waits for every rank's op `id` and checks each is answered with `type`; frees the ops. */
void expect_all_ok(fixture *fx, uint64_t id, uint16_t type, const char *what);

/* ---- Buffers: mapped once per id, as the client caches them -------------- */

/* Unmaps rank r's buffers of the n ids and forgets them. */
void mapping_drop(fixture *fx, int r, const uint32_t *ids, size_t n);
/* The mapping of buffer `id` on rank r: from the reply's descriptor the first time, then cached. */
void *buffer_map(fixture *fx, int r, const exec_op *op, uint32_t id, uint64_t bytes);

/* ---- The test unit ------------------------------------------------------- */

/* Three tensors: "weight" [3, 5] at offset 0, "bias" [5] at 16 (the
 * alignment gap 15..16), "scale" [2, 2], frozen, at 32; 36 elements, padded
 * to 48 (one rank) or 64 (two ranks). */
typedef struct tensor_def {
  const char *name;
  unsigned ndim;
  uint64_t shape[2];
  int frozen;
} tensor_def;

/* The test unit's tensors. */
extern const tensor_def unit_tensors[];
#define UNIT_NT     3
#define UNIT_PACKED 24 /* 15 + 5 + 4 */
#define UNIT_NAME   "layer0"

/* Queues REGISTER_UNIT of the test unit on every rank; returns the id. */
uint64_t submit_register(fixture *fx, Zerod__V1__InitMode init, uint64_t seed);
/* OP_COMM_INIT (generation 0), then OP_SESSION_BEGIN, on every rank. */
void start_ranks(fixture *fx);
/* Registers the test unit from rank 0's values; returns its id. */
uint32_t register_from_rank0(fixture *fx);
/* A unit-id request (Gather, Release, GradBuffer, Reduce share the shape) on every rank. */
uint64_t submit_unit_op(fixture *fx, op_kind kind, uint32_t unit_id);
/* Queues STEP on every rank; returns the id. */
uint64_t submit_step(fixture *fx);
/* GATHER on every rank: copies rank r's values into out[r], checks the version, releases. */
void gather_values(fixture *fx, uint32_t unit_id, uint64_t padded_numel, uint64_t want_version,
                   float *out[MAX_RANKS]);
/* The unit's flat buffer as rank 0 registered it: tensors at their offsets, zero elsewhere. */
void expected_initial(const unit_layout *l, float *flat);
/* Fails unless rank r's n values equal want bit for bit, naming the first that differs. */
void expect_flat_equal(const float *want, const float *got, uint64_t n, const char *what, int r);

#endif /* ZEROD_TESTS_RANK_FIXTURES_H */
