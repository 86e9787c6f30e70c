/* rank_fixtures.c - what the rank executor tests share (rank_fixtures.h):
 * a job and its executors, the completion queue, ops and replies, mapped
 * buffers, and the test unit. */
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
#include "rank_fixtures.h"
#include "store.h"

/* Never dereferenced: it only makes the executors report the op. */
char session_target;

/* ---- The test's completion queue ------------------------------------------ */

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
exec_op *queue_take(done_queue *q, const rank_state *rs, uint64_t request_id, int timeout_ms) {
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

atomic_int ckpt_hook_calls;

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

fixture *fixture_open(int world) {
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
void fixture_close(fixture *fx) {
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

int setup_world1(void **state) {
  *state = fixture_open(1);
  return 0;
}

int setup_world2(void **state) {
  *state = fixture_open(2);
  return 0;
}

int teardown_fixture(void **state) {
  fixture_close(*state);
  *state = NULL;
  return 0;
}

/* ---- Ops ------------------------------------------------------------------------ */

/* The request as the loop hands it over: decoded from its wire form
 * (zd_msg_unpack), so that the op owns it as exec_op_free expects. */
ProtobufCMessage *owned_request(uint16_t type, const ProtobufCMessage *msg) {
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
uint64_t submit_to(fixture *fx, int r, op_kind kind, uint16_t type, const ProtobufCMessage *req,
                   int in_fd, uint64_t request_id) {
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
uint64_t submit_all(fixture *fx, op_kind kind, uint16_t type, const ProtobufCMessage *req,
                    int rank0_fd) {
  uint64_t id = fx->next_request++;
  for (int r = 0; r < fx->world; r++)
    submit_to(fx, r, kind, type, req, r == 0 ? rank0_fd : -1, id);
  return id;
}

exec_op *wait_op(fixture *fx, int r, uint64_t id, const char *what) {
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
ProtobufCMessage *reply_of(const exec_op *op, uint16_t type, const char *what) {
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

/* Waits for every rank's op `id` and checks each is answered with
 * `type`; frees the ops. */
void expect_all_ok(fixture *fx, uint64_t id, uint16_t type, const char *what) {
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

void mapping_drop(fixture *fx, int r, const uint32_t *ids, size_t n) {
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
void *buffer_map(fixture *fx, int r, const exec_op *op, uint32_t id, uint64_t bytes) {
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

const tensor_def unit_tensors[] = {
    {"weight", 2, {3, 5}, 0},
    {"bias", 1, {5, 0}, 0},
    {"scale", 2, {2, 2}, 1},
};

/* Rank 0's initial values, packed (the tensors back to back). */
static float init_value(uint64_t k) {
  return (float)((int)(k % 11) - 5) * 0.25f + 1.0f;
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
uint64_t submit_register(fixture *fx, Zerod__V1__InitMode init, uint64_t seed) {
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
void start_ranks(fixture *fx) {
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
uint32_t register_from_rank0(fixture *fx) {
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
uint64_t submit_unit_op(fixture *fx, op_kind kind, uint32_t unit_id) {
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

uint64_t submit_step(fixture *fx) {
  Zerod__V1__StepRequest req = ZEROD__V1__STEP_REQUEST__INIT;
  return submit_all(fx, OP_STEP, ZEROD__V1__MSG_TYPE__MSG_STEP, &req.base, -1);
}

/* GATHER of the unit on every rank: copies each rank's gathered values
 * (padded_numel floats) into out[r], checks the version, and releases. */
void gather_values(fixture *fx, uint32_t unit_id, uint64_t padded_numel, uint64_t want_version,
                   float *out[MAX_RANKS]) {
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
void expected_initial(const unit_layout *l, float *flat) {
  memset(flat, 0, l->padded_numel * sizeof(float));
  uint64_t k = 0;
  for (unsigned t = 0; t < l->ntensors; t++)
    for (uint64_t i = 0; i < l->tensors[t].numel; i++)
      flat[l->tensors[t].offset + i] = init_value(k++);
}

void expect_flat_equal(const float *want, const float *got, uint64_t n, const char *what, int r) {
  for (uint64_t i = 0; i < n; i++)
    if (memcmp(&want[i], &got[i], sizeof(float)) != 0)
      fail_msg("%s, rank %d: element %llu is %.9g, expected %.9g", what, r, (unsigned long long)i,
               (double)got[i], (double)want[i]);
}
