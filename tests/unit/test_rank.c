/* The rank executors (daemon/rank/exec.c) driven through their public API
 * alone: a job from job_create, each rank's executor started with
 * exec_rank_start, ops made with exec_op_new and queued with exec_submit,
 * the way the node's loop does it, against the host device ("cpu") and Gloo
 * over the in-memory rendezvous store, with one and two ranks in this
 * process.
 *
 * The executors hand finished ops to exec_settings.complete, which here
 * pushes them onto a queue the test owns (the daemon's is ipc_completion.c's
 * completion queue). That callback is only made for an op with a session
 * (finish() in exec.c frees the others), so every op the test waits for
 * carries TEST_SESSION: a non-NULL pointer that nothing dereferences (rank/
 * code only compares op->session with NULL). Replies are decoded from
 * op->reply_frame as a worker would decode them (proto/frame.h), and the
 * buffers behind them are mapped from op->reply_fd and cached by buffer id,
 * as libzerod does.
 *
 * cmocka may only fail on the test's thread: the executors' threads do
 * nothing here but queue their ops.
 *
 * Values are chosen so that every expected result is exact: initial values
 * and gradients are small multiples of 1/4, whose sums are exact in fp32;
 * the SGD update is computed in the test as the kernel defines it
 * (kernels/math_optim.h: fmaf(-lr, g, w), lr rounded to fp32), so it is
 * compared bit for bit. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "test_clock.h"

#include "config.h"
#include "exec.h"
#include "frame.h"
#include "hostmem.h"
#include "job.h"
#include "layout.h"
#include "pin.h"
#include "store.h"

#define MAX_RANKS       2
#define COLLECTIVE_MS   20000 /* the ranks' collective timeout */
#define WAIT_MS         30000 /* how long the test waits for an op */
#define SESSION_ID      1
#define MAX_MAPPINGS    16
#define TEST_LR         0.1
#define TEST_LIVE_BYTES (64u << 20)

/* Never dereferenced: it only makes the executors report the op. */
static char session_target;
#define TEST_SESSION ((struct session *)&session_target)

/* ---- The test's completion queue ------------------------------------------ */

typedef struct done_queue {
  pthread_mutex_t mutex;
  pthread_cond_t cond; /* CLOCK_MONOTONIC */
  exec_op *head, *tail;
} done_queue;

/* exec_settings.complete: on an executor thread (or on the thread that
 * stops a rank, for the ops it drops). */
static void on_complete(void *ctx, exec_op *op) {
  done_queue *q = ctx;
  pthread_mutex_lock(&q->mutex);
  op->next = NULL;
  if (q->tail != NULL)
    q->tail->next = op;
  else
    q->head = op;
  q->tail = op;
  pthread_cond_broadcast(&q->cond);
  pthread_mutex_unlock(&q->mutex);
}

static void queue_init(done_queue *q) {
  memset(q, 0, sizeof *q);
  pthread_mutex_init(&q->mutex, NULL);
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&q->cond, &attr);
  pthread_condattr_destroy(&attr);
}

static void queue_drain(done_queue *q) {
  pthread_mutex_lock(&q->mutex);
  exec_op *op = q->head;
  q->head = q->tail = NULL;
  pthread_mutex_unlock(&q->mutex);
  while (op != NULL) {
    exec_op *next = op->next;
    exec_op_free(op);
    op = next;
  }
}

static void queue_destroy(done_queue *q) {
  queue_drain(q);
  pthread_mutex_destroy(&q->mutex);
  pthread_cond_destroy(&q->cond);
}

/* Takes the op of `rs` with `request_id` off the queue, waiting up to
 * timeout_ms for it; NULL if it did not come. */
static exec_op *queue_take(done_queue *q, const rank_state *rs, uint64_t request_id,
                           int timeout_ms) {
  struct timespec deadline;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec++;
    deadline.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&q->mutex);
  for (;;) {
    exec_op *prev = NULL;
    for (exec_op *op = q->head; op != NULL; prev = op, op = op->next) {
      if (op->rank != rs || op->request_id != request_id)
        continue;
      if (prev != NULL)
        prev->next = op->next;
      else
        q->head = op->next;
      if (q->tail == op)
        q->tail = prev;
      op->next = NULL;
      pthread_mutex_unlock(&q->mutex);
      return op;
    }
    if (pthread_cond_timedwait(&q->cond, &q->mutex, &deadline) == ETIMEDOUT) {
      pthread_mutex_unlock(&q->mutex);
      return NULL;
    }
  }
}

/* ---- Checkpoint hooks: the node's side, replaced by counters -------------------------- */

static atomic_int ckpt_hook_calls;

static void counting_stage(job *j, int rank, uint64_t id, uint64_t bytes) {
  atomic_fetch_add(&ckpt_hook_calls, 1);
}

static void *counting_staging(job *j, int rank, uint64_t id, uint64_t bytes) {
  atomic_fetch_add(&ckpt_hook_calls, 1);
  return NULL;
}

static void counting_saved(job *j, int rank, uint64_t id, uint64_t step, void *data,
                           uint64_t data_bytes, ckpt_manifest *layout, int64_t stall_ms) {
  atomic_fetch_add(&ckpt_hook_calls, 1);
  /* Ownership of the copy and the layout passes to the hook. */
  hostmem_shared_unref(data);
  if (layout != NULL) {
    ckpt_manifest_free(layout);
    free(layout);
  }
}

static void counting_save_failed(job *j, int rank, uint64_t id, int code, const char *error) {
  atomic_fetch_add(&ckpt_hook_calls, 1);
}

static void counting_restore_report(job *j, int rank, uint64_t id, int committed, uint64_t step,
                                    int code, const char *error) {
  atomic_fetch_add(&ckpt_hook_calls, 1);
}

static const exec_ckpt_hooks counting_hooks = {.stage = counting_stage,
                                               .staging = counting_staging,
                                               .saved = counting_saved,
                                               .save_failed = counting_save_failed,
                                               .restore_report = counting_restore_report};

/* ---- A job and its executors ------------------------------------------------------ */

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

static job_config sgd_config(void) {
  job_config c;
  memset(&c, 0, sizeof c);
  c.optimizer = JOB_SGD;
  c.lr = TEST_LR;
  c.working_dtype = ZK_F32;
  char err[256] = "";
  if (job_config_finish(&c, TEST_LIVE_BYTES, err, sizeof err) != 0)
    fail_msg("job_config_finish refused plain SGD: %s", err);
  return c;
}

static fixture *fixture_open(int world) {
  fixture *fx = calloc(1, sizeof *fx);
  assert_non_null(fx);
  fx->world = world;
  fx->next_request = 1;
  queue_init(&fx->q);
  assert_int_equal(store_mem_create(&fx->st), 0);
  fx->exec = (exec_settings){.complete = on_complete,
                             .ctx = &fx->q,
                             .ckpt = counting_hooks,
                             .device = "cpu",
                             .threads_per_rank = 1,
                             .collective_timeout_ms = COLLECTIVE_MS,
                             .comm_hostname = NULL,
                             .rendezvous = fx->st};
  job_config config = sgd_config();
  int rc = job_create(&fx->exec, NULL, "ranktest", "token", &config, world, world, 0, 7, &fx->j);
  if (rc != 0)
    fail_msg("job_create(world %d) returned %d, expected 0", world, rc);
  for (int r = 0; r < world; r++) {
    rc = exec_rank_start(&fx->j->ranks[r]);
    if (rc != 0)
      fail_msg("exec_rank_start(rank %d) returned %d, expected 0", r, rc);
  }
  return fx;
}

/* Stops every rank before joining any (exec.h), then frees everything. */
static void fixture_close(fixture *fx) {
  if (fx == NULL)
    return;
  for (int r = 0; r < fx->world; r++)
    if (!fx->stopped[r]) {
      exec_rank_stop(&fx->j->ranks[r]);
      fx->stopped[r] = 1;
    }
  for (int r = 0; r < fx->world; r++)
    exec_rank_join(&fx->j->ranks[r]);
  queue_drain(&fx->q);
  for (int r = 0; r < fx->world; r++) {
    exec_rank_free(&fx->j->ranks[r]);
    for (int m = 0; m < MAX_MAPPINGS; m++)
      if (fx->maps[r][m].base != NULL)
        munmap(fx->maps[r][m].base, fx->maps[r][m].bytes);
  }
  pin_job_clear(fx->j);
  job_destroy(fx->j);
  fx->st->ops->destroy(fx->st);
  queue_destroy(&fx->q);
  free(fx);
}

static int setup_world1(void **state) {
  *state = fixture_open(1);
  return 0;
}

static int setup_world2(void **state) {
  *state = fixture_open(2);
  return 0;
}

static int teardown_fixture(void **state) {
  fixture_close(*state);
  *state = NULL;
  return 0;
}

/* ---- Ops ------------------------------------------------------------------------ */

/* The request as the loop hands it over: decoded from its wire form
 * (zd_msg_unpack), so that the op owns it as exec_op_free expects. */
static ProtobufCMessage *owned_request(uint16_t type, const ProtobufCMessage *msg) {
  size_t bytes = protobuf_c_message_get_packed_size(msg);
  uint8_t *buf = malloc(bytes ? bytes : 1);
  assert_non_null(buf);
  protobuf_c_message_pack(msg, buf);
  ProtobufCMessage *out = NULL;
  const char *why = NULL;
  int rc = zd_msg_unpack(type, buf, bytes, &out, &why);
  free(buf);
  if (rc != 0)
    fail_msg("a request of type %u does not pass zd_msg_unpack: %s", type, why ? why : "?");
  return out;
}

/* Queues an op on rank r; returns its request id. */
static uint64_t submit_to(fixture *fx, int r, op_kind kind, uint16_t type,
                          const ProtobufCMessage *req, int in_fd, uint64_t request_id) {
  exec_op *op = exec_op_new(kind, &fx->j->ranks[r]);
  assert_non_null(op);
  op->session = TEST_SESSION;
  op->session_id = SESSION_ID;
  op->request_id = request_id;
  op->in_fd = in_fd;
  if (req != NULL)
    op->request = owned_request(type, req);
  exec_submit(op);
  return request_id;
}

/* Queues the same request on every rank (a collective); in_fd goes to
 * rank 0 only. */
static uint64_t submit_all(fixture *fx, op_kind kind, uint16_t type, const ProtobufCMessage *req,
                           int rank0_fd) {
  uint64_t id = fx->next_request++;
  for (int r = 0; r < fx->world; r++)
    submit_to(fx, r, kind, type, req, r == 0 ? rank0_fd : -1, id);
  return id;
}

static exec_op *wait_op(fixture *fx, int r, uint64_t id, const char *what) {
  exec_op *op = queue_take(&fx->q, &fx->j->ranks[r], id, WAIT_MS);
  if (op == NULL)
    fail_msg("%s: rank %d did not complete request %llu within %d ms", what, r,
             (unsigned long long)id, WAIT_MS);
  return op;
}

/* ---- Replies ------------------------------------------------------------------------ */

/* Decodes an op's reply frame; fails unless it is of `type` (an Error
 * reply is reported with its status and message). The caller frees the
 * message with protobuf_c_message_free_unpacked. */
static ProtobufCMessage *reply_of(const exec_op *op, uint16_t type, const char *what) {
  if (op->reply_frame == NULL)
    fail_msg("%s (rank %d): expected a reply of type %u, got no reply frame (status %d)", what,
             op->rank->rank, type, op->status);
  zd_frame_header h;
  const char *why = NULL;
  if (zd_frame_header_decode(op->reply_frame, op->reply_bytes, &h, &why) != 0)
    fail_msg("%s: the reply's header does not decode: %s", what, why);
  assert_int_equal(h.request_id, op->request_id);
  assert_int_equal(ZD_FRAME_HEADER_BYTES + (size_t)h.payload_bytes, op->reply_bytes);
  ProtobufCMessage *msg = NULL;
  if (zd_msg_unpack(h.type, op->reply_frame + ZD_FRAME_HEADER_BYTES, h.payload_bytes, &msg, &why) !=
      0)
    fail_msg("%s: the reply's payload (type %u) does not decode: %s", what, h.type, why);
  if (h.type == ZEROD__V1__MSG_TYPE__MSG_ERROR && type != ZEROD__V1__MSG_TYPE__MSG_ERROR) {
    const Zerod__V1__Error *e = (const Zerod__V1__Error *)msg;
    fail_msg("%s (rank %d): expected a reply of type %u, got Error status %d: %s", what,
             op->rank->rank, type, e->status, e->message);
  }
  if (h.type != type)
    fail_msg("%s: expected a reply of type %u, got type %u", what, type, h.type);
  /* A descriptor goes with the frame exactly when the header says so. */
  assert_int_equal(h.fd_count, op->reply_fd >= 0 ? 1 : 0);
  if (type != ZEROD__V1__MSG_TYPE__MSG_ERROR && op->status != ZEROD__V1__STATUS__STATUS_OK)
    fail_msg("%s: a %u reply with status %d, expected STATUS_OK", what, type, op->status);
  return msg;
}

/* Checks that an op was answered with an Error of `status` whose message
 * contains `contains` (if not NULL). */
static void expect_error(const exec_op *op, int status, const char *contains, const char *what) {
  if (op->status != status)
    fail_msg("%s (rank %d): expected status %d, got %d", what, op->rank->rank, status, op->status);
  Zerod__V1__Error *e = (Zerod__V1__Error *)reply_of(op, ZEROD__V1__MSG_TYPE__MSG_ERROR, what);
  if ((int)e->status != status)
    fail_msg("%s: the Error reply says status %d, expected %d (%s)", what, e->status, status,
             e->message);
  if (contains != NULL && strstr(e->message, contains) == NULL)
    fail_msg("%s: the error message \"%s\" should mention \"%s\"", what, e->message, contains);
  assert_int_equal(op->reply_fd, -1);
  protobuf_c_message_free_unpacked(&e->base, NULL);
}

/* Waits for every rank's op `id` and checks each is answered with
 * `type`; frees the ops. */
static void expect_all_ok(fixture *fx, uint64_t id, uint16_t type, const char *what) {
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, what);
    protobuf_c_message_free_unpacked(reply_of(op, type, what), NULL);
    exec_op_free(op);
  }
}

/* ---- Buffers: mapped once per id, as the client caches them --------------------- */

static mapping *mapping_find(fixture *fx, int r, uint32_t id) {
  for (int m = 0; m < MAX_MAPPINGS; m++)
    if (fx->maps[r][m].base != NULL && fx->maps[r][m].id == id)
      return &fx->maps[r][m];
  return NULL;
}

static void mapping_drop(fixture *fx, int r, const uint32_t *ids, size_t n) {
  for (size_t k = 0; k < n; k++) {
    mapping *m = mapping_find(fx, r, ids[k]);
    if (m != NULL) {
      munmap(m->base, m->bytes);
      memset(m, 0, sizeof *m);
    }
  }
}

/* The mapping of buffer `id` on rank r: the first time from the reply's
 * descriptor (which the op still owns), later from the cache. */
static void *buffer_map(fixture *fx, int r, const exec_op *op, uint32_t id, uint64_t bytes) {
  mapping *m = mapping_find(fx, r, id);
  if (op->reply_fd < 0) {
    if (m == NULL)
      fail_msg("rank %d: buffer %u came without a descriptor, but was never sent before", r, id);
    return m->base;
  }
  if (m != NULL)
    fail_msg("rank %d: buffer %u was sent a second time to the same session", r, id);
  for (int k = 0; k < MAX_MAPPINGS && m == NULL; k++)
    if (fx->maps[r][k].base == NULL)
      m = &fx->maps[r][k];
  assert_non_null(m);
  void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, op->reply_fd, 0);
  if (base == MAP_FAILED)
    fail_msg("rank %d: mapping buffer %u (%llu bytes) failed: %s", r, id, (unsigned long long)bytes,
             strerror(errno));
  *m = (mapping){.id = id, .base = base, .bytes = bytes};
  return base;
}

/* ---- The test unit ------------------------------------------------------------------ */

/* Three tensors: "weight" [3, 5] at offset 0, "bias" [5] at 16 (the
 * alignment gap 15..16), "scale" [2, 2], frozen, at 32; 36 elements, padded
 * to 48 (one rank) or 64 (two ranks). */
typedef struct tensor_def {
  const char *name;
  unsigned ndim;
  uint64_t shape[2];
  int frozen;
} tensor_def;

static const tensor_def unit_tensors[] = {
    {"weight", 2, {3, 5}, 0},
    {"bias", 1, {5, 0}, 0},
    {"scale", 2, {2, 2}, 1},
};
#define UNIT_NT     3
#define UNIT_PACKED 24 /* 15 + 5 + 4 */
#define UNIT_NAME   "layer0"

/* Rank 0's initial values, packed (the tensors back to back). */
static float init_value(uint64_t k) {
  return (float)((int)(k % 11) - 5) * 0.25f + 1.0f;
}

/* Rank r's gradient for packed element k of a trainable tensor. */
static float grad_value(int r, uint64_t k) {
  return (float)((int)((k * 7 + (uint64_t)r * 5) % 13) - 6) * 0.25f;
}

/* The layout the daemon must have built, from model/layout.c itself. */
static unit_layout *expected_layout(int world) {
  const char *names[UNIT_NT];
  const uint64_t *shapes[UNIT_NT];
  unsigned ndims[UNIT_NT];
  int frozen[UNIT_NT];
  for (int t = 0; t < UNIT_NT; t++) {
    names[t] = unit_tensors[t].name;
    shapes[t] = unit_tensors[t].shape;
    ndims[t] = unit_tensors[t].ndim;
    frozen[t] = unit_tensors[t].frozen;
  }
  unit_layout *l = NULL;
  char err[256] = "";
  if (unit_layout_build(UNIT_NAME, UNIT_NT, names, shapes, ndims, frozen, world, 0, &l, err,
                        sizeof err) != 0)
    fail_msg("unit_layout_build: %s", err);
  return l;
}

/* A memfd holding rank 0's initial values (the op owns it). */
static int init_values_fd(void) {
  float packed[UNIT_PACKED];
  for (int k = 0; k < UNIT_PACKED; k++)
    packed[k] = init_value((uint64_t)k);
  int fd = memfd_create("test-rank-init", MFD_CLOEXEC);
  if (fd < 0)
    fail_msg("memfd_create: %s", strerror(errno));
  assert_int_equal(write(fd, packed, sizeof packed), (ssize_t)sizeof packed);
  return fd;
}

/* Queues REGISTER_UNIT of the test unit on every rank; returns the id. */
static uint64_t submit_register(fixture *fx, Zerod__V1__InitMode init, uint64_t seed) {
  Zerod__V1__TensorSpec specs[UNIT_NT];
  Zerod__V1__TensorSpec *ptrs[UNIT_NT];
  for (int t = 0; t < UNIT_NT; t++) {
    zerod__v1__tensor_spec__init(&specs[t]);
    specs[t].name = (char *)unit_tensors[t].name;
    specs[t].n_shape = unit_tensors[t].ndim;
    specs[t].shape = (uint64_t *)unit_tensors[t].shape;
    specs[t].frozen = unit_tensors[t].frozen;
    ptrs[t] = &specs[t];
  }
  Zerod__V1__RegisterUnitRequest req = ZEROD__V1__REGISTER_UNIT_REQUEST__INIT;
  req.name = UNIT_NAME;
  req.n_tensors = UNIT_NT;
  req.tensors = ptrs;
  req.init = init;
  req.seed = seed;
  req.init_std = 0.02;
  int fd = init == ZEROD__V1__INIT_MODE__INIT_FROM_RANK0 ? init_values_fd() : -1;
  return submit_all(fx, OP_REGISTER, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &req.base, fd);
}

/* OP_COMM_INIT (generation 0), then OP_SESSION_BEGIN, on every rank. */
static void start_ranks(fixture *fx) {
  uint64_t id = submit_all(fx, OP_COMM_INIT, 0, NULL, -1);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "OP_COMM_INIT");
    if (op->status != ZEROD__V1__STATUS__STATUS_OK)
      fail_msg("OP_COMM_INIT on rank %d: status %d, expected OK", r, op->status);
    assert_null(op->reply_frame); /* the loop sends nothing for it */
    exec_op_free(op);
  }
  char reason[512] = "";
  if (job_failed(fx->j, 0, reason, sizeof reason))
    fail_msg("the job failed while building its communicators: %s", reason);
  for (int r = 0; r < fx->world; r++)
    if (atomic_load(&fx->j->ranks[r].comm_ready) != 1)
      fail_msg("rank %d: comm_ready is %u after OP_COMM_INIT of generation 0, expected 1", r,
               atomic_load(&fx->j->ranks[r].comm_ready));
  id = submit_all(fx, OP_SESSION_BEGIN, 0, NULL, -1);
  expect_all_ok(fx, id, ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, "OP_SESSION_BEGIN");
}

/* Registers the test unit from rank 0's values; returns its id. */
static uint32_t register_from_rank0(fixture *fx) {
  uint64_t id = submit_register(fx, ZEROD__V1__INIT_MODE__INIT_FROM_RANK0, 0);
  uint32_t unit_id = UINT32_MAX;
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "REGISTER_UNIT");
    Zerod__V1__RegisterUnitReply *reply = (Zerod__V1__RegisterUnitReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, "REGISTER_UNIT");
    if (r > 0)
      assert_int_equal(reply->unit_id, unit_id);
    unit_id = reply->unit_id;
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
  }
  return unit_id;
}

/* A unit-id request (Gather, Release, GradBuffer, Reduce share the shape). */
static uint64_t submit_unit_op(fixture *fx, op_kind kind, uint32_t unit_id) {
  switch (kind) {
  case OP_GATHER: {
    Zerod__V1__GatherRequest req = ZEROD__V1__GATHER_REQUEST__INIT;
    req.unit_id = unit_id;
    return submit_all(fx, kind, ZEROD__V1__MSG_TYPE__MSG_GATHER, &req.base, -1);
  }
  case OP_RELEASE: {
    Zerod__V1__ReleaseRequest req = ZEROD__V1__RELEASE_REQUEST__INIT;
    req.unit_id = unit_id;
    return submit_all(fx, kind, ZEROD__V1__MSG_TYPE__MSG_RELEASE, &req.base, -1);
  }
  case OP_GRAD_BUFFER: {
    Zerod__V1__GradBufferRequest req = ZEROD__V1__GRAD_BUFFER_REQUEST__INIT;
    req.unit_id = unit_id;
    return submit_all(fx, kind, ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER, &req.base, -1);
  }
  case OP_REDUCE: {
    Zerod__V1__ReduceRequest req = ZEROD__V1__REDUCE_REQUEST__INIT;
    req.unit_id = unit_id;
    return submit_all(fx, kind, ZEROD__V1__MSG_TYPE__MSG_REDUCE, &req.base, -1);
  }
  default:
    fail_msg("submit_unit_op: op kind %d takes no unit", kind);
  }
  return 0;
}

static uint64_t submit_step(fixture *fx) {
  Zerod__V1__StepRequest req = ZEROD__V1__STEP_REQUEST__INIT;
  return submit_all(fx, OP_STEP, ZEROD__V1__MSG_TYPE__MSG_STEP, &req.base, -1);
}

/* GATHER of the unit on every rank: copies each rank's gathered values
 * (padded_numel floats) into out[r], checks the version, and releases. */
static void gather_values(fixture *fx, uint32_t unit_id, uint64_t padded_numel,
                          uint64_t want_version, float *out[MAX_RANKS]) {
  uint64_t id = submit_unit_op(fx, OP_GATHER, unit_id);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "GATHER");
    Zerod__V1__GatherReply *reply =
        (Zerod__V1__GatherReply *)reply_of(op, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, "GATHER");
    assert_int_equal(reply->unit_id, unit_id);
    if (reply->version != want_version)
      fail_msg("GATHER on rank %d: version %llu, expected %llu", r,
               (unsigned long long)reply->version, (unsigned long long)want_version);
    if (reply->buffer_bytes < padded_numel * sizeof(float))
      fail_msg("GATHER on rank %d: buffer of %llu bytes, expected at least %llu", r,
               (unsigned long long)reply->buffer_bytes,
               (unsigned long long)(padded_numel * sizeof(float)));
    assert_null(reply->cuda);
    mapping_drop(fx, r, reply->dropped_buffer_ids, reply->n_dropped_buffer_ids);
    const float *base = buffer_map(fx, r, op, reply->buffer_id, reply->buffer_bytes);
    memcpy(out[r], base, padded_numel * sizeof(float));
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
  }
  id = submit_unit_op(fx, OP_RELEASE, unit_id);
  expect_all_ok(fx, id, ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY, "RELEASE");
}

/* The unit's flat buffer as rank 0 registered it: tensors at their
 * offsets, zero elsewhere. */
static void expected_initial(const unit_layout *l, float *flat) {
  memset(flat, 0, l->padded_numel * sizeof(float));
  uint64_t k = 0;
  for (unsigned t = 0; t < l->ntensors; t++)
    for (uint64_t i = 0; i < l->tensors[t].numel; i++)
      flat[l->tensors[t].offset + i] = init_value(k++);
}

static void expect_flat_equal(const float *want, const float *got, uint64_t n, const char *what,
                              int r) {
  for (uint64_t i = 0; i < n; i++)
    if (memcmp(&want[i], &got[i], sizeof(float)) != 0)
      fail_msg("%s, rank %d: element %llu is %.9g, expected %.9g", what, r, (unsigned long long)i,
               (double)got[i], (double)want[i]);
}

/* GRAD_BUFFER on every rank; fills rank r's buffer with grad(r, k) at each
 * trainable tensor's packed element k and `junk` everywhere else (gaps,
 * padding, frozen tensors), then REDUCE. */
static void reduce_gradients(fixture *fx, const unit_layout *l, float junk) {
  uint64_t id = submit_unit_op(fx, OP_GRAD_BUFFER, l->id);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "GRAD_BUFFER");
    Zerod__V1__GradBufferReply *reply = (Zerod__V1__GradBufferReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY, "GRAD_BUFFER");
    assert_int_equal(reply->unit_id, l->id);
    assert_true(reply->buffer_bytes >= l->padded_numel * sizeof(float));
    mapping_drop(fx, r, reply->dropped_buffer_ids, reply->n_dropped_buffer_ids);
    float *g = buffer_map(fx, r, op, reply->buffer_id, reply->buffer_bytes);
    for (uint64_t i = 0; i < l->padded_numel; i++)
      g[i] = junk;
    uint64_t k = 0;
    for (unsigned t = 0; t < l->ntensors; t++)
      for (uint64_t i = 0; i < l->tensors[t].numel; i++, k++)
        if (!l->tensors[t].frozen)
          g[l->tensors[t].offset + i] = grad_value(r, k);
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
  }
  id = submit_unit_op(fx, OP_REDUCE, l->id);
  expect_all_ok(fx, id, ZEROD__V1__MSG_TYPE__MSG_REDUCE_REPLY, "REDUCE");
}

/* STEP on every rank; checks the reply (step 1, version 1, the norm of
 * the summed gradients) and the gathered values afterwards: each trainable
 * element is w - lr * (g_0 + ... + g_{W-1}) as the kernel computes it, and
 * frozen tensors, gaps and padding keep their values. */
static void step_and_check(fixture *fx, const unit_layout *l) {
  uint64_t n = l->padded_numel;
  float *want = calloc(n, sizeof(float));
  assert_non_null(want);
  expected_initial(l, want);
  double sumsq = 0;
  uint64_t k = 0;
  const float neg_lr = (float)(-TEST_LR);
  for (unsigned t = 0; t < l->ntensors; t++)
    for (uint64_t i = 0; i < l->tensors[t].numel; i++, k++) {
      if (l->tensors[t].frozen)
        continue;
      float g = 0;
      for (int r = 0; r < fx->world; r++)
        g += grad_value(r, k); /* exact: multiples of 1/4 */
      sumsq += (double)g * g;
      float *w = &want[l->tensors[t].offset + i];
      *w = fmaf(neg_lr, g, *w);
    }

  uint64_t id = submit_step(fx);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "STEP");
    Zerod__V1__StepReply *reply =
        (Zerod__V1__StepReply *)reply_of(op, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, "STEP");
    assert_int_equal(reply->step, 1);
    assert_int_equal(reply->version, 1);
    assert_false(reply->skipped);
    if (fabs(reply->grad_norm - sqrt(sumsq)) > 1e-9 * sqrt(sumsq))
      fail_msg("STEP on rank %d: grad_norm %.17g, expected %.17g (the norm of the summed "
               "trainable gradients)",
               r, reply->grad_norm, sqrt(sumsq));
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
  }

  float *got[MAX_RANKS] = {0};
  for (int r = 0; r < fx->world; r++)
    assert_non_null(got[r] = calloc(n, sizeof(float)));
  gather_values(fx, l->id, n, 1, got);
  for (int r = 0; r < fx->world; r++) {
    expect_flat_equal(want, got[r], n, "the weights after an SGD step (w - lr * sum of g)", r);
    free(got[r]);
  }
  free(want);
}

/* ---- Tests ------------------------------------------------------------------------ */

static void test_comm_init_then_session_begin_succeed(void **state) {
  fixture *fx = *state;
  uint64_t id = submit_all(fx, OP_COMM_INIT, 0, NULL, -1);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "OP_COMM_INIT");
    if (op->status != ZEROD__V1__STATUS__STATUS_OK)
      fail_msg("OP_COMM_INIT on rank %d: status %d, expected OK", r, op->status);
    assert_null(op->reply_frame);
    assert_int_equal(atomic_load(&fx->j->ranks[r].comm_ready), 1);
    exec_op_free(op);
  }
  assert_false(job_failed(fx->j, 0, NULL, 0));

  id = submit_all(fx, OP_SESSION_BEGIN, 0, NULL, -1);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "OP_SESSION_BEGIN");
    Zerod__V1__AttachReply *reply = (Zerod__V1__AttachReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, "OP_SESSION_BEGIN");
    assert_int_equal(reply->rank, r);
    assert_int_equal(reply->world_size, fx->world);
    assert_int_equal(reply->job_id, 7);
    assert_int_equal(reply->version, 0);
    assert_non_null(reply->config);
    assert_non_null(reply->config->optimizer);
    assert_int_equal(reply->config->optimizer->kind, ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD);
    assert_true(reply->config->optimizer->lr == TEST_LR);
    assert_int_equal(reply->config->working_dtype, ZEROD__V1__DTYPE__DTYPE_F32);
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    assert_int_equal(fx->j->ranks[r].session_id, SESSION_ID);
    exec_op_free(op);
  }
}

static void test_register_seeded_reply_matches_unit_layout_build(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  unit_layout *want = expected_layout(fx->world);
  uint64_t id = submit_register(fx, ZEROD__V1__INIT_MODE__INIT_SEEDED_NORMAL, 1234);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "REGISTER_UNIT (seeded)");
    Zerod__V1__RegisterUnitReply *reply = (Zerod__V1__RegisterUnitReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, "REGISTER_UNIT (seeded)");
    assert_int_equal(reply->unit_id, 0);
    assert_string_equal(reply->name, UNIT_NAME);
    assert_false(reply->existed);
    if (reply->numel != want->numel || reply->padded_numel != want->padded_numel ||
        reply->shard_numel != want->shard_numel)
      fail_msg("rank %d: numel/padded/shard %llu/%llu/%llu, expected %llu/%llu/%llu (world %d)", r,
               (unsigned long long)reply->numel, (unsigned long long)reply->padded_numel,
               (unsigned long long)reply->shard_numel, (unsigned long long)want->numel,
               (unsigned long long)want->padded_numel, (unsigned long long)want->shard_numel,
               fx->world);
    assert_int_equal(reply->padded_numel, reply->shard_numel * (uint64_t)fx->world);
    assert_int_equal(reply->working_dtype, ZEROD__V1__DTYPE__DTYPE_F32);
    assert_int_equal(reply->grad_dtype, ZEROD__V1__DTYPE__DTYPE_F32);
    assert_int_equal(reply->n_tensors, want->ntensors);
    for (unsigned t = 0; t < want->ntensors; t++) {
      const Zerod__V1__TensorPlacement *p = reply->tensors[t];
      const tensor_layout *tl = &want->tensors[t];
      assert_string_equal(p->name, tl->name);
      if (p->offset != tl->offset || p->numel != tl->numel)
        fail_msg("rank %d, tensor '%s': offset %llu numel %llu, expected offset %llu numel %llu", r,
                 tl->name, (unsigned long long)p->offset, (unsigned long long)p->numel,
                 (unsigned long long)tl->offset, (unsigned long long)tl->numel);
      assert_int_equal(p->n_shape, tl->ndim);
      for (unsigned d = 0; d < tl->ndim; d++)
        assert_int_equal(p->shape[d], tl->shape[d]);
    }
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
  }
  /* The published layout is the job's: unit 0, counted ready on every rank. */
  unit_layout *l = job_unit(fx->j, 0);
  assert_non_null(l);
  assert_int_equal(atomic_load(&l->ready_ranks), fx->world);
  assert_int_equal(l->padded_numel, want->padded_numel);
  unit_layout_free(want);
}

static void test_register_again_returns_the_existing_unit(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  /* The same layout again (a restarted worker): the unit and its values
   * are kept, whatever the init mode says now. */
  uint64_t id = submit_register(fx, ZEROD__V1__INIT_MODE__INIT_ZEROS, 0);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "REGISTER_UNIT again");
    Zerod__V1__RegisterUnitReply *reply = (Zerod__V1__RegisterUnitReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, "REGISTER_UNIT again");
    assert_int_equal(reply->unit_id, unit_id);
    if (!reply->existed)
      fail_msg("rank %d: a second registration of the same layout should reply existed = true", r);
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
  }
  unit_layout *l = job_unit(fx->j, unit_id);
  assert_non_null(l);
  float *want = calloc(l->padded_numel, sizeof(float));
  float *got[MAX_RANKS] = {0};
  for (int r = 0; r < fx->world; r++)
    got[r] = calloc(l->padded_numel, sizeof(float));
  expected_initial(l, want);
  gather_values(fx, unit_id, l->padded_numel, 0, got);
  for (int r = 0; r < fx->world; r++) {
    expect_flat_equal(want, got[r], l->padded_numel, "values kept by a re-registration", r);
    free(got[r]);
  }
  free(want);
}

static void test_gather_returns_rank0_initial_values(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  assert_non_null(l);
  float *want = calloc(l->padded_numel, sizeof(float));
  float *got[MAX_RANKS] = {0};
  for (int r = 0; r < fx->world; r++)
    got[r] = calloc(l->padded_numel, sizeof(float));
  expected_initial(l, want);
  gather_values(fx, unit_id, l->padded_numel, 0, got);
  for (int r = 0; r < fx->world; r++) {
    expect_flat_equal(want, got[r], l->padded_numel,
                      "the gathered unit (rank 0's values at their offsets, zero elsewhere)", r);
    free(got[r]);
  }
  free(want);
}

/* INIT_SEEDED_NORMAL: value k of a unit depends on the seed, the unit's
 * name and k only (exec.c), so one rank and two ranks gather the same
 * values; gaps and padding are zero. */
static void test_seeded_init_does_not_depend_on_world_size(void **state) {
  fixture *fx1 = *state;
  fixture *fx2 = fixture_open(2);
  fixture *fxs[2] = {fx1, fx2};
  float *got[2][MAX_RANKS] = {{0}};
  uint64_t padded[2] = {0};
  unit_layout *l1 = NULL;
  for (int f = 0; f < 2; f++) {
    fixture *fx = fxs[f];
    start_ranks(fx);
    uint64_t id = submit_register(fx, ZEROD__V1__INIT_MODE__INIT_SEEDED_NORMAL, 99);
    expect_all_ok(fx, id, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, "REGISTER_UNIT (seeded)");
    unit_layout *l = job_unit(fx->j, 0);
    assert_non_null(l);
    if (f == 0)
      l1 = l;
    padded[f] = l->padded_numel;
    for (int r = 0; r < fx->world; r++)
      got[f][r] = calloc(l->padded_numel, sizeof(float));
    gather_values(fx, 0, l->padded_numel, 0, got[f]);
  }
  /* Same offsets on both (world only changes the padding). */
  for (unsigned t = 0; t < l1->ntensors; t++) {
    const tensor_layout *tl = &l1->tensors[t];
    for (uint64_t i = 0; i < tl->numel; i++) {
      uint64_t at = tl->offset + i;
      float v = got[0][0][at];
      if (v == 0.0f || !isfinite(v) || fabsf(v) > 0.02f * 8)
        fail_msg("seeded value %llu of tensor '%s' is %g: not a draw of N(0, 0.02^2)",
                 (unsigned long long)i, tl->name, (double)v);
      for (int r = 0; r < 2; r++)
        if (memcmp(&got[1][r][at], &v, sizeof v) != 0)
          fail_msg("seeded element %llu: %.9g with one rank, %.9g on rank %d of two",
                   (unsigned long long)at, (double)v, (double)got[1][r][at], r);
    }
  }
  for (int f = 0; f < 2; f++)
    for (uint64_t at = l1->numel; at < padded[f]; at++)
      for (int r = 0; r < fxs[f]->world; r++)
        if (got[f][r][at] != 0.0f)
          fail_msg("padding element %llu is %g, expected 0", (unsigned long long)at,
                   (double)got[f][r][at]);
  assert_true(got[0][0][15] == 0.0f); /* the gap between "weight" and "bias" */
  for (int f = 0; f < 2; f++)
    for (int r = 0; r < fxs[f]->world; r++)
      free(got[f][r]);
  fixture_close(fx2);
}

static void test_step_sgd_updates_master(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  assert_non_null(l);
  reduce_gradients(fx, l, 0.0f);
  step_and_check(fx, l);
  /* No checkpoint order was given: the step never reached the hooks. */
  assert_int_equal(atomic_load(&ckpt_hook_calls), 0);
}

/* REDUCE sums the ranks' gradient buffers (docs/protocol.md: "sum the
 * unit's gradient buffers over the ranks", in rank order): two ranks with
 * different gradients step by lr * (g0 + g1), not by their mean. */
static void test_two_ranks_reduce_sums_their_gradients(void **state) {
  fixture *fx = *state;
  assert_int_equal(fx->world, 2);
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  assert_non_null(l);
  assert_true(grad_value(0, 1) != grad_value(1, 1)); /* the ranks' gradients differ */
  reduce_gradients(fx, l, 0.0f);
  step_and_check(fx, l);
}

/* Gradients written into gaps, padding and frozen tensors are ignored:
 * they count neither in the update nor in the norm. */
static void test_reduce_ignores_gaps_padding_and_frozen_gradients(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  assert_non_null(l);
  reduce_gradients(fx, l, 1000.0f);
  step_and_check(fx, l);
}

/* Waits until rank r's executor has finished everything queued (busy is
 * decremented just after the completion callback). */
static void wait_idle(fixture *fx, int r) {
  double t0 = now_ms();
  while (atomic_load(&fx->j->ranks[r].busy) != 0) {
    if (now_ms() - t0 > WAIT_MS)
      fail_msg("rank %d did not become idle within %d ms", r, WAIT_MS);
    sleep_ms(1);
  }
}

/* exec_try_inline: a gather served from the rank's cache runs on the
 * calling thread while the executor is idle (no collective); a miss is
 * left to the executor, untouched. */
static void test_try_inline_serves_a_cached_gather_while_idle(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  float *want = calloc(l->padded_numel, sizeof(float));
  float *got[MAX_RANKS] = {0};
  for (int r = 0; r < fx->world; r++)
    got[r] = calloc(l->padded_numel, sizeof(float));
  expected_initial(l, want);
  gather_values(fx, unit_id, l->padded_numel, 0, got); /* fills the cache */

  Zerod__V1__GatherRequest greq = ZEROD__V1__GATHER_REQUEST__INIT;
  greq.unit_id = unit_id;
  Zerod__V1__ReleaseRequest rreq = ZEROD__V1__RELEASE_REQUEST__INIT;
  rreq.unit_id = unit_id;
  for (int r = 0; r < fx->world; r++) {
    wait_idle(fx, r);
    exec_op *op = exec_op_new(OP_GATHER, &fx->j->ranks[r]);
    op->session = TEST_SESSION;
    op->session_id = SESSION_ID;
    op->request_id = fx->next_request++;
    op->request = owned_request(ZEROD__V1__MSG_TYPE__MSG_GATHER, &greq.base);
    if (exec_try_inline(op) != 1)
      fail_msg("rank %d: a cached gather with the executor idle should run inline", r);
    Zerod__V1__GatherReply *reply = (Zerod__V1__GatherReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, "inline GATHER");
    assert_int_equal(reply->version, 0);
    assert_int_equal(op->reply_fd, -1); /* the session has the buffer already */
    const float *base = buffer_map(fx, r, op, reply->buffer_id, reply->buffer_bytes);
    expect_flat_equal(want, base, l->padded_numel, "a gather served inline", r);
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);

    op = exec_op_new(OP_RELEASE, &fx->j->ranks[r]);
    op->session = TEST_SESSION;
    op->session_id = SESSION_ID;
    op->request_id = fx->next_request++;
    op->request = owned_request(ZEROD__V1__MSG_TYPE__MSG_RELEASE, &rreq.base);
    assert_int_equal(exec_try_inline(op), 1);
    protobuf_c_message_free_unpacked(
        reply_of(op, ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY, "inline RELEASE"), NULL);
    exec_op_free(op);
  }

  /* A step moves the version: the cached values are stale, and the gather
   * needs the executor (an all-gather). */
  uint64_t id = submit_step(fx);
  expect_all_ok(fx, id, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, "STEP without gradients");
  id = fx->next_request++;
  for (int r = 0; r < fx->world; r++) {
    wait_idle(fx, r);
    exec_op *op = exec_op_new(OP_GATHER, &fx->j->ranks[r]);
    op->session = TEST_SESSION;
    op->session_id = SESSION_ID;
    op->request_id = id;
    op->request = owned_request(ZEROD__V1__MSG_TYPE__MSG_GATHER, &greq.base);
    if (exec_try_inline(op) != 0)
      fail_msg("rank %d: a gather of a stale cache entry must not run inline", r);
    assert_null(op->reply_frame);
    exec_submit(op);
  }
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "GATHER after the step");
    Zerod__V1__GatherReply *reply = (Zerod__V1__GatherReply *)reply_of(
        op, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, "GATHER after the step");
    assert_int_equal(reply->version, 1);
    /* No gradient: the weights did not move. */
    const float *base = buffer_map(fx, r, op, reply->buffer_id, reply->buffer_bytes);
    expect_flat_equal(want, base, l->padded_numel, "the weights after a step without gradients", r);
    protobuf_c_message_free_unpacked(&reply->base, NULL);
    exec_op_free(op);
    free(got[r]);
  }
  free(want);
}

static void test_gather_unknown_unit_is_not_found(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint64_t id = submit_unit_op(fx, OP_GATHER, 42);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "GATHER of unit 42");
    expect_error(op, ZEROD__V1__STATUS__STATUS_NOT_FOUND, "unknown unit id 42",
                 "GATHER of an unknown unit");
    exec_op_free(op);
  }
  /* The rank goes on: a unit registered now gathers normally. */
  assert_false(job_failed(fx->j, 0, NULL, 0));
  uint32_t unit_id = register_from_rank0(fx);
  unit_layout *l = job_unit(fx->j, unit_id);
  float *got[MAX_RANKS] = {0};
  for (int r = 0; r < fx->world; r++)
    got[r] = calloc(l->padded_numel, sizeof(float));
  gather_values(fx, unit_id, l->padded_numel, 0, got);
  for (int r = 0; r < fx->world; r++)
    free(got[r]);
}

static void test_failed_job_answers_aborted(void **state) {
  fixture *fx = *state;
  start_ranks(fx);
  uint32_t unit_id = register_from_rank0(fx);
  job_fail(fx->j, 0, "a peer lost its worker");
  const op_kind kinds[] = {OP_GATHER, OP_GRAD_BUFFER, OP_REDUCE};
  const char *names[] = {"GATHER", "GRAD_BUFFER", "REDUCE"};
  for (int k = 0; k < 3; k++) {
    uint64_t id = submit_unit_op(fx, kinds[k], unit_id);
    for (int r = 0; r < fx->world; r++) {
      exec_op *op = wait_op(fx, r, id, names[k]);
      expect_error(op, ZEROD__V1__STATUS__STATUS_ABORTED, "a peer lost its worker", names[k]);
      exec_op_free(op);
    }
  }
  uint64_t id = submit_step(fx);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "STEP");
    expect_error(op, ZEROD__V1__STATUS__STATUS_ABORTED, "a peer lost its worker",
                 "STEP of a failed job");
    exec_op_free(op);
  }
  id = submit_register(fx, ZEROD__V1__INIT_MODE__INIT_FROM_RANK0, 0);
  for (int r = 0; r < fx->world; r++) {
    exec_op *op = wait_op(fx, r, id, "REGISTER_UNIT");
    expect_error(op, ZEROD__V1__STATUS__STATUS_ABORTED, "failed", "REGISTER_UNIT of a failed job");
    exec_op_free(op);
  }
}

/* A rank blocked in a collective (rank 0 registers alone, waiting for rank
 * 1) has ops queued behind it: exec_rank_stop answers those UNAVAILABLE at
 * once, on the caller's thread; stopping the peer wakes the blocked
 * collective (ABORTED), and both threads join. */
static void test_stop_answers_queued_ops_unavailable(void **state) {
  fixture *fx = *state;
  assert_int_equal(fx->world, 2);
  start_ranks(fx);
  rank_state *rs0 = &fx->j->ranks[0];

  uint64_t reg_id = fx->next_request++;
  {
    Zerod__V1__TensorSpec spec = ZEROD__V1__TENSOR_SPEC__INIT;
    Zerod__V1__TensorSpec *specs[1] = {&spec};
    uint64_t shape[1] = {8};
    spec.name = "w";
    spec.n_shape = 1;
    spec.shape = shape;
    Zerod__V1__RegisterUnitRequest req = ZEROD__V1__REGISTER_UNIT_REQUEST__INIT;
    req.name = "alone";
    req.n_tensors = 1;
    req.tensors = specs;
    req.init = ZEROD__V1__INIT_MODE__INIT_ZEROS;
    submit_to(fx, 0, OP_REGISTER, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &req.base, -1, reg_id);
  }
  /* Wait until the executor has taken the registration off its queue. */
  double t0 = now_ms();
  for (;;) {
    pthread_mutex_lock(&rs0->queue_mutex);
    int queued = rs0->queue_head != NULL;
    pthread_mutex_unlock(&rs0->queue_mutex);
    if (!queued)
      break;
    if (now_ms() - t0 > WAIT_MS)
      fail_msg("rank 0 did not start the registration within %d ms", WAIT_MS);
    sleep_ms(1);
  }

  uint64_t queued_ids[2];
  {
    Zerod__V1__GatherRequest g = ZEROD__V1__GATHER_REQUEST__INIT;
    queued_ids[0] = submit_to(fx, 0, OP_GATHER, ZEROD__V1__MSG_TYPE__MSG_GATHER, &g.base, -1,
                              fx->next_request++);
    Zerod__V1__StepRequest s = ZEROD__V1__STEP_REQUEST__INIT;
    queued_ids[1] =
        submit_to(fx, 0, OP_STEP, ZEROD__V1__MSG_TYPE__MSG_STEP, &s.base, -1, fx->next_request++);
  }
  assert_int_equal(atomic_load(&rs0->busy), 3);

  exec_rank_stop(rs0);
  fx->stopped[0] = 1;
  /* Answered by exec_rank_stop itself: already on the queue. */
  for (int k = 0; k < 2; k++) {
    exec_op *op = queue_take(&fx->q, rs0, queued_ids[k], 0);
    if (op == NULL)
      fail_msg("queued op %d was not answered by exec_rank_stop", k);
    expect_error(op, ZEROD__V1__STATUS__STATUS_UNAVAILABLE, "shutting down",
                 "an op queued when the rank stopped");
    exec_op_free(op);
  }
  /* The registration in progress is not one of them: it ends in its own
   * handler, ABORTED, once its collective is aborted (at once between
   * ranks that share memory: the stop cancels the job's local group). */
  exec_op *blocked = queue_take(&fx->q, rs0, reg_id, 0);
  if (blocked != NULL && blocked->status != ZEROD__V1__STATUS__STATUS_ABORTED)
    fail_msg("the registration in progress was answered %d, not ABORTED", blocked->status);

  exec_rank_stop(&fx->j->ranks[1]);
  fx->stopped[1] = 1;
  t0 = now_ms();
  exec_rank_join(rs0);
  exec_rank_join(&fx->j->ranks[1]);
  double join_ms = now_ms() - t0;
  assert_false(rs0->thread_started);
  assert_false(fx->j->ranks[1].thread_started);
  assert_int_equal(atomic_load(&rs0->busy), 0);
  if (join_ms > COLLECTIVE_MS / 2)
    fail_msg("joining took %.0f ms: the peer's stop should wake the collective at once", join_ms);

  if (blocked == NULL)
    blocked = queue_take(&fx->q, rs0, reg_id, 0);
  if (blocked == NULL)
    fail_msg("the blocked registration was never answered");
  expect_error(blocked, ZEROD__V1__STATUS__STATUS_ABORTED, NULL,
               "the registration whose peer stopped");
  exec_op_free(blocked);
  assert_true(job_failed(fx->j, 0, NULL, 0));
}

#define RANK_TEST(fn, world)                                                                       \
  { #fn " [world " #world "]", fn, setup_world##world, teardown_fixture, NULL }

int main(void) {
  const struct CMUnitTest tests[] = {
      RANK_TEST(test_comm_init_then_session_begin_succeed, 1),
      RANK_TEST(test_comm_init_then_session_begin_succeed, 2),
      RANK_TEST(test_register_seeded_reply_matches_unit_layout_build, 1),
      RANK_TEST(test_register_seeded_reply_matches_unit_layout_build, 2),
      RANK_TEST(test_register_again_returns_the_existing_unit, 2),
      RANK_TEST(test_gather_returns_rank0_initial_values, 1),
      RANK_TEST(test_gather_returns_rank0_initial_values, 2),
      RANK_TEST(test_seeded_init_does_not_depend_on_world_size, 1),
      RANK_TEST(test_step_sgd_updates_master, 1),
      RANK_TEST(test_two_ranks_reduce_sums_their_gradients, 2),
      RANK_TEST(test_reduce_ignores_gaps_padding_and_frozen_gradients, 1),
      RANK_TEST(test_reduce_ignores_gaps_padding_and_frozen_gradients, 2),
      RANK_TEST(test_try_inline_serves_a_cached_gather_while_idle, 1),
      RANK_TEST(test_try_inline_serves_a_cached_gather_while_idle, 2),
      RANK_TEST(test_gather_unknown_unit_is_not_found, 1),
      RANK_TEST(test_gather_unknown_unit_is_not_found, 2),
      RANK_TEST(test_failed_job_answers_aborted, 1),
      RANK_TEST(test_failed_job_answers_aborted, 2),
      RANK_TEST(test_stop_answers_queued_ops_unavailable, 2),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
