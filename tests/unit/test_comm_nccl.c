/* The NCCL backend of comm.h (daemon/backend/comm_nccl.c) without a GPU.
 *
 * comm_nccl.c reaches CUDA and NCCL only through the module's table
 * (zk_cuda.h), so a fake table stands in for the module here: its "device
 * memory" is host memory, its communicator is a one-rank world that copies
 * where NCCL would, and switches make its connection, events and
 * asynchronous errors misbehave on demand. That pins what the backend adds
 * on top of NCCL, on every machine: the errors when there is no module or
 * no NCCL, the rendezvous key, the timeouts of create and of collectives,
 * abort on failure and fail-fast afterwards, and that every resource it
 * takes is given back. The real module is exercised by
 * tests/gpu/test_nccl_comm.c where a GPU is lent. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "comm.h"
#include "cuda/zk_cuda.h"
#include "store.h"

/* ---- the fake module ------------------------------------------------------ */

typedef struct fake_state {
  /* Switches. */
  bool no_nccl;       /* nccl_available answers -ENOSYS */
  bool never_connect; /* nccl_status stays -EAGAIN */
  bool never_done;    /* event_query stays -EAGAIN */
  int async_error;    /* nccl_status answers this once connected (0: none) */
  /* Counters. */
  int inits, aborts, destroys;
  int events_created, events_destroyed;
  int allocs, frees;
  int collectives;
} fake_state;

static fake_state fake;
static int fake_comm_token, fake_event_token;
static const char *fake_error = "";

static const char *fake_last_error(void) {
  return fake_error;
}

static int fake_nccl_available(char *why, size_t why_len) {
  snprintf(why, why_len, "%s", fake.no_nccl ? "fake: cannot open libnccl.so.2" : "fake NCCL");
  return fake.no_nccl ? -ENOSYS : 0;
}

static int fake_get_device(int *device_out) {
  *device_out = 0;
  return 0;
}

static int fake_alloc(void **ptr_out, size_t bytes) {
  *ptr_out = malloc(bytes);
  fake.allocs++;
  return *ptr_out != NULL ? 0 : -ENOMEM;
}

static int fake_free(void *ptr) {
  if (ptr != NULL)
    fake.frees++;
  free(ptr);
  return 0;
}

static int fake_memset_async(void *dst_dev, int value, size_t bytes, void *stream) {
  memset(dst_dev, value, bytes);
  return 0;
}

static int fake_event_create(void **event_out, int interprocess) {
  *event_out = &fake_event_token;
  fake.events_created++;
  return 0;
}

static int fake_event_destroy(void *event) {
  fake.events_destroyed++;
  return 0;
}

static int fake_event_record(void *event, void *stream) {
  return 0;
}

static int fake_event_query(void *event) {
  return fake.never_done ? -EAGAIN : 0;
}

static int fake_nccl_unique_id(void *id_out) {
  memset(id_out, 0x42, ZK_NCCL_UNIQUE_ID_BYTES);
  return 0;
}

static int fake_nccl_init(void **comm_out, int world_size, int rank, const void *unique_id) {
  const uint8_t *id = unique_id;
  if (id[0] != 0x42 || id[ZK_NCCL_UNIQUE_ID_BYTES - 1] != 0x42)
    return -EINVAL;
  *comm_out = &fake_comm_token;
  fake.inits++;
  return 0;
}

static int fake_nccl_status(void *nccl_comm) {
  if (fake.never_connect)
    return -EAGAIN;
  if (fake.async_error != 0) {
    fake_error = "NCCL communicator failed: remote process exited or there was a network error";
    return fake.async_error;
  }
  return 0;
}

/* A one-rank world: gathers and scatters copy, reductions and broadcasts
 * leave the data as it is. */
static int fake_nccl_all_gather(void *nccl_comm, const void *send, void *recv,
                                size_t bytes_per_rank, void *stream) {
  fake.collectives++;
  memmove(recv, send, bytes_per_rank);
  return 0;
}

static int fake_nccl_reduce_scatter_f32(void *nccl_comm, const float *send, float *recv,
                                        size_t shard_numel, void *stream) {
  fake.collectives++;
  memmove(recv, send, shard_numel * sizeof(float));
  return 0;
}

static int fake_nccl_all_reduce(void *nccl_comm, void *buf, size_t count, zk_nccl_dtype dtype,
                                zk_nccl_op op, void *stream) {
  fake.collectives++;
  return dtype <= ZK_NCCL_I64 && op <= ZK_NCCL_MIN ? 0 : -EINVAL;
}

static int fake_nccl_broadcast(void *nccl_comm, void *buf, size_t bytes, int root, void *stream) {
  fake.collectives++;
  return 0;
}

static int fake_nccl_abort(void *nccl_comm) {
  fake.aborts++;
  return 0;
}

static int fake_nccl_destroy(void *nccl_comm) {
  fake.destroys++;
  return 0;
}

static const zk_cuda_api fake_api = {
    .size = sizeof(zk_cuda_api),
    .version = ZK_CUDA_API_VERSION,
    .alloc = fake_alloc,
    .free = fake_free,
    .last_error = fake_last_error,
    .get_device = fake_get_device,
    .event_create = fake_event_create,
    .event_destroy = fake_event_destroy,
    .event_record = fake_event_record,
    .event_query = fake_event_query,
    .memset_async = fake_memset_async,
    .nccl_available = fake_nccl_available,
    .nccl_unique_id = fake_nccl_unique_id,
    .nccl_init = fake_nccl_init,
    .nccl_status = fake_nccl_status,
    .nccl_all_gather = fake_nccl_all_gather,
    .nccl_reduce_scatter_f32 = fake_nccl_reduce_scatter_f32,
    .nccl_all_reduce = fake_nccl_all_reduce,
    .nccl_broadcast = fake_nccl_broadcast,
    .nccl_abort = fake_nccl_abort,
    .nccl_destroy = fake_nccl_destroy,
};

/* ---- helpers --------------------------------------------------------------- */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int reset_fake(void **state) {
  memset(&fake, 0, sizeof fake);
  fake_error = "";
  return 0;
}

/* Everything the backend took from the module is given back. */
static void assert_resources_returned(void) {
  if (fake.events_created != fake.events_destroyed)
    fail_msg("%d events created, %d destroyed", fake.events_created, fake.events_destroyed);
  if (fake.allocs != fake.frees)
    fail_msg("%d device allocations, %d freed", fake.allocs, fake.frees);
  if (fake.inits != fake.aborts + fake.destroys)
    fail_msg("%d NCCL communicators, %d aborted, %d destroyed", fake.inits, fake.aborts,
             fake.destroys);
}

static int create(store *st, const zk_cuda_api *api, int rank, int world, int timeout_ms, comm **c,
                  char *err, size_t err_bytes) {
  comm_options options = {
      .prefix = "test/nccl", .rank = rank, .world_size = world, .timeout_ms = timeout_ms};
  return comm_nccl_create(&options, st, api, NULL, c, err, err_bytes);
}

/* ---- tests ----------------------------------------------------------------- */

static void test_create_without_a_cuda_module_fails_with_enodev(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm *c = (comm *)0x1;
  char err[256] = "";
  assert_int_equal(create(st, NULL, 0, 1, 1000, &c, err, sizeof err), -ENODEV);
  assert_null(c);
  if (strstr(err, "no CUDA module") == NULL)
    fail_msg("the error should say that the CUDA module is missing, got \"%s\"", err);
  st->ops->destroy(st);
}

static void test_create_without_nccl_fails_with_enosys(void **state) {
  fake.no_nccl = true;
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm *c = NULL;
  char err[256] = "";
  assert_int_equal(create(st, &fake_api, 0, 1, 1000, &c, err, sizeof err), -ENOSYS);
  assert_null(c);
  if (strstr(err, "NCCL is not available: fake: cannot open libnccl.so.2") == NULL)
    fail_msg("the error should carry the module's reason, got \"%s\"", err);
  assert_int_equal(fake.inits, 0);
  st->ops->destroy(st);
}

static void test_create_rejects_an_old_module_table(void **state) {
  zk_cuda_api old_api = fake_api;
  old_api.version = 1;
  old_api.size = offsetof(zk_cuda_api, get_device);
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm *c = NULL;
  char err[256] = "";
  assert_int_equal(create(st, &old_api, 0, 1, 1000, &c, err, sizeof err), -EPROTO);
  assert_non_null(strstr(err, "need version 2"));
  st->ops->destroy(st);
}

static void test_collectives_dispatch_to_nccl_and_destroy_returns_everything(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm *c = NULL;
  char err[256] = "";
  int rc = create(st, &fake_api, 0, 1, 5000, &c, err, sizeof err);
  if (rc != 0)
    fail_msg("comm_nccl_create returned %d: %s", rc, err);
  assert_int_equal(comm_rank(c), 0);
  assert_int_equal(comm_world_size(c), 1);

  /* Rank 0 deleted the unique id once connected. */
  void *value = NULL;
  size_t value_bytes = 0;
  assert_int_equal(st->ops->get(st, "test/nccl/nccl-id", &value, &value_bytes, 0), -ETIMEDOUT);

  uint8_t send[16], gathered[16];
  for (size_t i = 0; i < sizeof send; i++)
    send[i] = (uint8_t)(i + 1);
  assert_int_equal(comm_all_gather(c, send, gathered, sizeof send), 0);
  assert_memory_equal(send, gathered, sizeof send);
  float grads[4] = {1, 2, 3, 4}, shard[4] = {0};
  assert_int_equal(comm_reduce_scatter_f32(c, grads, shard, 4), 0);
  assert_memory_equal(grads, shard, sizeof grads);
  double norm = 2.5;
  assert_int_equal(comm_all_reduce(c, &norm, 1, COMM_F64, COMM_SUM), 0);
  assert_int_equal(comm_broadcast(c, send, sizeof send, 0), 0);
  assert_int_equal(comm_barrier(c), 0);
  /* Zero-sized calls never reach NCCL. */
  assert_int_equal(comm_all_gather(c, NULL, NULL, 0), 0);
  assert_int_equal(fake.collectives, 5);
  assert_string_equal(comm_last_error(c), "");

  comm_destroy(c);
  assert_int_equal(fake.destroys, 1);
  assert_int_equal(fake.aborts, 0);
  assert_resources_returned();
  st->ops->destroy(st);
}

static void test_create_times_out_and_aborts_when_a_rank_never_connects(void **state) {
  fake.never_connect = true;
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm *c = NULL;
  char err[256] = "";
  double started_ms = now_ms();
  int rc = create(st, &fake_api, 0, 2, 300, &c, err, sizeof err);
  double took_ms = now_ms() - started_ms;
  assert_int_equal(rc, -ETIMEDOUT);
  assert_null(c);
  if (took_ms < 290 || took_ms > 2000)
    fail_msg("create should give up after about 300 ms, took %.0f ms", took_ms);
  if (strstr(err, "timed out after 300 ms waiting for the NCCL communicator to connect") == NULL)
    fail_msg("unexpected error \"%s\"", err);
  assert_int_equal(fake.aborts, 1);
  assert_int_equal(fake.destroys, 0);
  assert_resources_returned();
  st->ops->destroy(st);
}

static void test_create_times_out_waiting_for_rank_0s_unique_id(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm *c = NULL;
  char err[256] = "";
  assert_int_equal(create(st, &fake_api, 1, 2, 200, &c, err, sizeof err), -ETIMEDOUT);
  assert_null(c);
  if (strstr(err, "timed out after 200 ms waiting for rank 0's NCCL unique id") == NULL)
    fail_msg("unexpected error \"%s\"", err);
  assert_int_equal(fake.inits, 0);
  assert_resources_returned();
  st->ops->destroy(st);
}

static void test_collective_times_out_then_fails_fast(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm *c = NULL;
  char err[256] = "";
  assert_int_equal(create(st, &fake_api, 0, 1, 300, &c, err, sizeof err), 0);
  fake.never_done = true;
  uint8_t buf[8] = {0};
  double started_ms = now_ms();
  assert_int_equal(comm_all_gather(c, buf, buf, sizeof buf), -ETIMEDOUT);
  double took_ms = now_ms() - started_ms;
  if (took_ms < 290 || took_ms > 2000)
    fail_msg("all_gather should give up after about 300 ms, took %.0f ms", took_ms);
  if (strstr(comm_last_error(c), "all_gather: timed out after 300 ms") == NULL)
    fail_msg("unexpected error \"%s\"", comm_last_error(c));
  /* Aborted once; every later call fails at once with the same error. */
  assert_int_equal(fake.aborts, 1);
  started_ms = now_ms();
  assert_int_equal(comm_barrier(c), -ETIMEDOUT);
  assert_int_equal(comm_broadcast(c, buf, sizeof buf, 0), -ETIMEDOUT);
  if (now_ms() - started_ms > 50)
    fail_msg("calls on a broken communicator should fail fast");
  assert_int_equal(fake.collectives, 1);
  comm_destroy(c);
  assert_int_equal(fake.aborts, 1);
  assert_int_equal(fake.destroys, 0);
  assert_resources_returned();
  st->ops->destroy(st);
}

static void test_peer_failure_breaks_with_nccl_error(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  comm *c = NULL;
  char err[256] = "";
  assert_int_equal(create(st, &fake_api, 0, 1, 5000, &c, err, sizeof err), 0);
  fake.never_done = true;
  fake.async_error = -ECONNRESET;
  double started_ms = now_ms();
  assert_int_equal(comm_barrier(c), -ECONNRESET);
  if (now_ms() - started_ms > 1000)
    fail_msg("a peer's failure should be noticed at once, not at the timeout");
  if (strstr(comm_last_error(c), "barrier: NCCL failed") == NULL ||
      strstr(comm_last_error(c), "remote process exited") == NULL)
    fail_msg("the error should carry NCCL's text, got \"%s\"", comm_last_error(c));
  assert_int_equal(comm_all_reduce(c, NULL, 0, COMM_F32, COMM_SUM), -ECONNRESET);
  comm_destroy(c);
  assert_int_equal(fake.aborts, 1);
  assert_resources_returned();
  st->ops->destroy(st);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_create_without_a_cuda_module_fails_with_enodev, reset_fake),
      cmocka_unit_test_setup(test_create_without_nccl_fails_with_enosys, reset_fake),
      cmocka_unit_test_setup(test_create_rejects_an_old_module_table, reset_fake),
      cmocka_unit_test_setup(test_collectives_dispatch_to_nccl_and_destroy_returns_everything,
                             reset_fake),
      cmocka_unit_test_setup(test_create_times_out_and_aborts_when_a_rank_never_connects,
                             reset_fake),
      cmocka_unit_test_setup(test_create_times_out_waiting_for_rank_0s_unique_id, reset_fake),
      cmocka_unit_test_setup(test_collective_times_out_then_fails_fast, reset_fake),
      cmocka_unit_test_setup(test_peer_failure_breaks_with_nccl_error, reset_fake),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
