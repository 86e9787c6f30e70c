/* libzerod against a fake daemon: a thread that serves one connection on a
 * Unix socket in a temporary directory, speaks the real framing
 * (proto/frame.h), and misbehaves on request (closes the connection, answers
 * with errors, out of order, with undecodable frames, with shutdown
 * notices). Each test pins one behaviour of the client: how it surfaces the
 * daemon's errors, how it matches replies to requests, how it maps shared
 * buffers into views, and that a lost daemon never crashes the worker.
 *
 * cmocka is not thread-safe, so the fake daemon never asserts: it records
 * what it saw in its struct, and the test thread checks after the fact. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>

#include "frame.h"
#include "zerod.h"

/* ------------------------------------------------------------------------
 * The fake daemon
 * ------------------------------------------------------------------------ */

/* Every unit the fake registers has the same layout: "w" [3, 5] at element
 * 0, an alignment gap, "b" [3] at element 16, padded to 32 elements. */
#define UNIT_NUMEL        19
#define UNIT_PADDED_NUMEL 32
#define BIAS_OFFSET       16
#define MAX_UNITS         4
#define BUFFER_BYTES      (UNIT_PADDED_NUMEL * sizeof(float))

typedef struct fake_daemon {
  char dir[64];
  char path[96];
  int listen_fd;
  int conn_fd;
  pthread_t thread;
  int joined;

  /* What to do wrong, set by the test before connecting. */
  int close_after_attach;
  Zerod__V1__Status attach_error;
  int reorder_gathers;       /* hold the first gather, answer the second first */
  int gather_unknown_buffer; /* answer gathers naming an unseen buffer, no fd */
  int release_error;         /* answer releases with an Error */
  int step_notice;           /* answer a step with a shutdown notice */
  int step_garbage;          /* answer a step with a payload that does not decode */
  Zerod__V1__Status gather_error;

  /* Shared memory the fake hands out, one gathered and one gradient
   * buffer per unit; the fake keeps its own mappings to check writes. */
  int gathered_fd[MAX_UNITS];
  float *gathered[MAX_UNITS];
  int gathered_sent[MAX_UNITS];
  int grad_fd[MAX_UNITS];
  float *grad[MAX_UNITS];
  int grad_sent[MAX_UNITS];

  /* What the fake saw, checked by the test afterwards. */
  unsigned units_registered;
  int init_fd_count;
  int init_values_match;
  unsigned release_frames;
  unsigned release_no_reply_flags;
  float reduce_grad_sum;
  uint64_t held_gather_id;
  uint32_t held_gather_unit;
  uint64_t step_version;
  int garbage_written;
} fake_daemon;

static volatile sig_atomic_t sigpipe_count;

static void on_sigpipe(int signo) {
  (void)signo;
  sigpipe_count++;
}

/* A shared buffer of UNIT_PADDED_NUMEL floats: first_value + i, or zeros
 * when first_value is 0 (gradient buffers). */
static int make_memfd(float **map_out, float first_value) {
  int fd = memfd_create("fake-zerod", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, BUFFER_BYTES) != 0)
    return -1;
  float *map = mmap(NULL, BUFFER_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED)
    return -1;
  for (int i = 0; i < UNIT_PADDED_NUMEL; i++)
    map[i] = first_value != 0.0f ? first_value + (float)i : 0.0f;
  *map_out = map;
  return fd;
}

static void fake_send(fake_daemon *fake, uint16_t type, uint64_t request_id,
                      const ProtobufCMessage *msg, const int *fds, unsigned nfds) {
  zd_frame_send(fake->conn_fd, type, request_id, 0, msg, fds, nfds, 5000);
}

static void fake_error(fake_daemon *fake, uint64_t request_id, Zerod__V1__Status status,
                       const char *message) {
  Zerod__V1__Error error = ZEROD__V1__ERROR__INIT;
  error.status = status;
  error.message = (char *)message;
  fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_ERROR, request_id, &error.base, NULL, 0);
}

static void fake_gather_reply(fake_daemon *fake, uint64_t request_id, uint32_t unit) {
  Zerod__V1__GatherReply reply = ZEROD__V1__GATHER_REPLY__INIT;
  reply.unit_id = unit;
  reply.buffer_id = 10 + unit;
  reply.buffer_bytes = BUFFER_BYTES;
  reply.version = 7;
  if (fake->gather_unknown_buffer) {
    reply.buffer_id = 99;
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, request_id, &reply.base, NULL, 0);
    return;
  }
  int first_time = !fake->gathered_sent[unit];
  fake->gathered_sent[unit] = 1;
  fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, request_id, &reply.base,
            &fake->gathered_fd[unit], first_time ? 1 : 0);
}

static void fake_register(fake_daemon *fake, uint64_t request_id,
                          const Zerod__V1__RegisterUnitRequest *request, const int *fds,
                          unsigned nfds) {
  fake->init_fd_count += (int)nfds;
  if (nfds == 1) {
    /* The worker's test passes values 0.5, 1.5, 2.5, ... for all 18
     * elements (15 + 3), back to back without the alignment gap. */
    float values[18];
    fake->init_values_match = pread(fds[0], values, sizeof values, 0) == sizeof values;
    for (int i = 0; i < 18 && fake->init_values_match; i++)
      fake->init_values_match = values[i] == 0.5f + (float)i;
  }
  uint64_t w_shape[2] = {3, 5};
  uint64_t b_shape[1] = {3};
  Zerod__V1__TensorPlacement w = ZEROD__V1__TENSOR_PLACEMENT__INIT;
  Zerod__V1__TensorPlacement b = ZEROD__V1__TENSOR_PLACEMENT__INIT;
  w.name = request->n_tensors > 0 ? request->tensors[0]->name : "w";
  w.n_shape = 2;
  w.shape = w_shape;
  w.offset = 0;
  w.numel = 15;
  b.name = request->n_tensors > 1 ? request->tensors[1]->name : "b";
  b.n_shape = 1;
  b.shape = b_shape;
  b.offset = BIAS_OFFSET;
  b.numel = 3;
  Zerod__V1__TensorPlacement *placements[2] = {&w, &b};
  Zerod__V1__RegisterUnitReply reply = ZEROD__V1__REGISTER_UNIT_REPLY__INIT;
  reply.unit_id = fake->units_registered++;
  reply.numel = UNIT_NUMEL;
  reply.padded_numel = UNIT_PADDED_NUMEL;
  reply.shard_numel = UNIT_PADDED_NUMEL;
  reply.n_tensors = 2;
  reply.tensors = placements;
  reply.working_dtype = ZEROD__V1__DTYPE__DTYPE_F32;
  reply.grad_dtype = ZEROD__V1__DTYPE__DTYPE_F32;
  fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, request_id, &reply.base, NULL, 0);
}

/* Writes a frame whose header is valid but whose payload is not a
 * protobuf message (a truncated varint field). */
static void fake_send_garbage(fake_daemon *fake, uint16_t type, uint64_t request_id) {
  uint8_t frame[ZD_FRAME_HEADER_BYTES + 2];
  zd_frame_header header = {.magic = ZD_FRAME_MAGIC,
                            .version = ZD_FRAME_VERSION,
                            .type = type,
                            .request_id = request_id,
                            .payload_bytes = 2};
  zd_frame_header_encode(&header, frame);
  frame[ZD_FRAME_HEADER_BYTES] = 0x08;     /* field 1, varint */
  frame[ZD_FRAME_HEADER_BYTES + 1] = 0xff; /* ... that never ends */
  fake->garbage_written = write(fake->conn_fd, frame, sizeof frame) == (ssize_t)sizeof frame;
}

/* Answers one request; returns 0 to keep serving, 1 to close. */
static int fake_handle(fake_daemon *fake, const zd_frame_header *header, ProtobufCMessage *msg,
                       int *fds, unsigned nfds) {
  uint64_t id = header->request_id;
  switch (header->type) {
  case ZEROD__V1__MSG_TYPE__MSG_ATTACH: {
    if (fake->attach_error != ZEROD__V1__STATUS__STATUS_OK) {
      fake_error(fake, id, fake->attach_error, "job nope does not exist");
      return 0;
    }
    Zerod__V1__AttachReply reply = ZEROD__V1__ATTACH_REPLY__INIT;
    reply.rank = 0;
    reply.world_size = 1;
    reply.version = 3;
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, id, &reply.base, NULL, 0);
    return fake->close_after_attach;
  }
  case ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT:
    fake_register(fake, id, (const Zerod__V1__RegisterUnitRequest *)msg, fds, nfds);
    return 0;
  case ZEROD__V1__MSG_TYPE__MSG_GATHER: {
    uint32_t unit = ((const Zerod__V1__GatherRequest *)msg)->unit_id % MAX_UNITS;
    if (fake->gather_error != ZEROD__V1__STATUS__STATUS_OK) {
      fake_error(fake, id, fake->gather_error, "max_live_bytes exceeded");
      return 0;
    }
    if (fake->reorder_gathers && fake->held_gather_id == 0) {
      fake->held_gather_id = id;
      fake->held_gather_unit = unit;
      return 0;
    }
    fake_gather_reply(fake, id, unit);
    if (fake->held_gather_id != 0) {
      fake_gather_reply(fake, fake->held_gather_id, fake->held_gather_unit);
      fake->held_gather_id = 0;
      fake->reorder_gathers = 0;
    }
    return 0;
  }
  case ZEROD__V1__MSG_TYPE__MSG_RELEASE:
    fake->release_frames++;
    if (header->flags & ZD_FRAME_F_NO_REPLY)
      fake->release_no_reply_flags++;
    if (fake->release_error)
      fake_error(fake, id, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                 "unit is not gathered by this session");
    return 0;
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER: {
    uint32_t unit = ((const Zerod__V1__GradBufferRequest *)msg)->unit_id % MAX_UNITS;
    Zerod__V1__GradBufferReply reply = ZEROD__V1__GRAD_BUFFER_REPLY__INIT;
    reply.unit_id = unit;
    reply.buffer_id = 10 + unit; /* the same numbers as gathered buffers, on purpose */
    reply.buffer_bytes = BUFFER_BYTES;
    int first_time = !fake->grad_sent[unit];
    fake->grad_sent[unit] = 1;
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY, id, &reply.base,
              &fake->grad_fd[unit], first_time ? 1 : 0);
    return 0;
  }
  case ZEROD__V1__MSG_TYPE__MSG_REDUCE: {
    uint32_t unit = ((const Zerod__V1__ReduceRequest *)msg)->unit_id % MAX_UNITS;
    fake->reduce_grad_sum = 0;
    for (int i = 0; i < UNIT_PADDED_NUMEL; i++)
      fake->reduce_grad_sum += fake->grad[unit][i];
    Zerod__V1__ReduceReply reply = ZEROD__V1__REDUCE_REPLY__INIT;
    reply.unit_id = unit;
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_REDUCE_REPLY, id, &reply.base, NULL, 0);
    return 0;
  }
  case ZEROD__V1__MSG_TYPE__MSG_STEP: {
    if (fake->step_notice) {
      Zerod__V1__Notice notice = ZEROD__V1__NOTICE__INIT;
      notice.status = ZEROD__V1__STATUS__STATUS_UNAVAILABLE;
      notice.message = "SIGTERM received, draining";
      fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_NOTICE, 0, &notice.base, NULL, 0);
      return 0;
    }
    if (fake->step_garbage) {
      fake_send_garbage(fake, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, id);
      return 0;
    }
    Zerod__V1__StepReply reply = ZEROD__V1__STEP_REPLY__INIT;
    reply.step = 1;
    reply.version = ++fake->step_version;
    reply.grad_norm = 2.5;
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, id, &reply.base, NULL, 0);
    return 0;
  }
  case ZEROD__V1__MSG_TYPE__MSG_DETACH: {
    Zerod__V1__DetachReply reply = ZEROD__V1__DETACH_REPLY__INIT;
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_DETACH_REPLY, id, &reply.base, NULL, 0);
    return 0;
  }
  default:
    fake_error(fake, id, ZEROD__V1__STATUS__STATUS_PROTOCOL, "unexpected frame type");
    return 1;
  }
}

static void *fake_main(void *arg) {
  fake_daemon *fake = arg;
  fake->conn_fd = accept4(fake->listen_fd, NULL, NULL, SOCK_CLOEXEC);
  if (fake->conn_fd < 0)
    return NULL;
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  for (;;) {
    const char *why;
    int rc = zd_frame_read(&reader, fake->conn_fd, &why);
    if (rc == 0)
      continue;
    if (rc < 0)
      break;
    zd_frame_header header;
    uint8_t *payload;
    int fds[ZD_FRAME_MAX_FDS];
    unsigned nfds;
    zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
    ProtobufCMessage *msg = NULL;
    int done = 1;
    if (zd_msg_unpack(header.type, payload, header.payload_bytes, &msg, &why) == 0) {
      done = fake_handle(fake, &header, msg, fds, nfds);
      protobuf_c_message_free_unpacked(msg, NULL);
    }
    for (unsigned i = 0; i < nfds; i++)
      close(fds[i]);
    free(payload);
    if (done)
      break;
  }
  zd_frame_reader_reset(&reader);
  close(fake->conn_fd);
  return NULL;
}

static fake_daemon *fake_create(void) {
  fake_daemon *fake = calloc(1, sizeof *fake);
  assert_non_null(fake);
  snprintf(fake->dir, sizeof fake->dir, "/tmp/zerod-test-client-XXXXXX");
  assert_non_null(mkdtemp(fake->dir));
  snprintf(fake->path, sizeof fake->path, "%s/zerod.sock", fake->dir);
  for (int u = 0; u < MAX_UNITS; u++) {
    fake->gathered_fd[u] = make_memfd(&fake->gathered[u], 1000.0f * (float)(u + 1));
    fake->grad_fd[u] = make_memfd(&fake->grad[u], 0.0f);
    assert_true(fake->gathered_fd[u] >= 0 && fake->grad_fd[u] >= 0);
  }
  fake->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  assert_true(fake->listen_fd >= 0);
  struct sockaddr_un address = {.sun_family = AF_UNIX};
  snprintf(address.sun_path, sizeof address.sun_path, "%s", fake->path);
  assert_int_equal(bind(fake->listen_fd, (struct sockaddr *)&address, sizeof address), 0);
  assert_int_equal(listen(fake->listen_fd, 4), 0);
  return fake;
}

/* Starts serving; the configuration flags must be set before this. */
static void fake_start(fake_daemon *fake) {
  assert_int_equal(pthread_create(&fake->thread, NULL, fake_main, fake), 0);
}

/* Waits for the serving thread, which ends when the connection does. */
static void fake_join(fake_daemon *fake) {
  if (!fake->joined)
    pthread_join(fake->thread, NULL);
  fake->joined = 1;
}

static void fake_destroy(fake_daemon *fake) {
  fake_join(fake);
  close(fake->listen_fd);
  for (int u = 0; u < MAX_UNITS; u++) {
    munmap(fake->gathered[u], BUFFER_BYTES);
    munmap(fake->grad[u], BUFFER_BYTES);
    close(fake->gathered_fd[u]);
    close(fake->grad_fd[u]);
  }
  unlink(fake->path);
  rmdir(fake->dir);
  free(fake);
}

/* ------------------------------------------------------------------------
 * Helpers for the worker side
 * ------------------------------------------------------------------------ */

static const uint64_t w_shape[2] = {3, 5};
static const uint64_t b_shape[1] = {3};
static const zd_tensor_desc unit_tensors[2] = {
    {.name = "w", .shape = w_shape, .ndim = 2},
    {.name = "b", .shape = b_shape, .ndim = 1},
};

static zd_job *attach_job(zd_client *client) {
  zd_job_config config = ZD_JOB_CONFIG_INIT;
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "test";
  options.create = 1;
  options.config = &config;
  zd_job *job = NULL;
  zd_status status = zd_attach(client, &options, &job);
  if (status != ZD_OK)
    fail_msg("attach: %s: %s", zd_strerror(status), zd_last_error());
  return job;
}

static zd_unit register_unit(zd_job *job, const char *name) {
  float init_values[18];
  for (int i = 0; i < 18; i++)
    init_values[i] = 0.5f + (float)i;
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = name;
  desc.tensors = unit_tensors;
  desc.ntensors = 2;
  desc.init = ZD_INIT_FROM_RANK0;
  desc.init_values = init_values;
  zd_unit unit = 0;
  zd_status status = zd_register_unit(job, &desc, &unit);
  if (status != ZD_OK)
    fail_msg("register %s: %s: %s", name, zd_strerror(status), zd_last_error());
  return unit;
}

static zd_client *connect_to(fake_daemon *fake) {
  zd_client *client = NULL;
  zd_status status = zd_connect(fake->path, &client);
  if (status != ZD_OK)
    fail_msg("connect: %s: %s", zd_strerror(status), zd_last_error());
  return client;
}

static void assert_message_contains(const char *needle) {
  if (strstr(zd_last_error(), needle) == NULL)
    fail_msg("expected zd_last_error() to contain \"%s\", got \"%s\"", needle, zd_last_error());
}

/* ------------------------------------------------------------------------
 * Tests
 * ------------------------------------------------------------------------ */

static void test_connect_to_missing_socket_is_unavailable(void **state) {
  zd_client *client = (zd_client *)0x1;
  zd_status status = zd_connect("/tmp/zerod-test-client-no-such-dir/zerod.sock", &client);
  assert_int_equal(status, ZD_E_UNAVAILABLE);
  assert_null(client);
  assert_message_contains("cannot connect to zerod at /tmp/zerod-test-client-no-such-dir");
  assert_message_contains("No such file or directory");
  assert_message_contains("zerod standalone");
}

static void test_default_socket_follows_environment(void **state) {
  unsetenv("ZEROD_SOCKET");
  assert_string_equal(zd_default_socket(), ".zerod/zerod.sock");
  setenv("ZEROD_SOCKET", "/run/zerod/x.sock", 1);
  assert_string_equal(zd_default_socket(), "/run/zerod/x.sock");
  unsetenv("ZEROD_SOCKET");
}

static void test_daemon_closing_after_attach_makes_calls_unavailable(void **state) {
  fake_daemon *fake = fake_create();
  fake->close_after_attach = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  assert_int_equal(zd_job_version(job), 3);
  /* Wait until the fake has closed its end, so that the next call writes
   * to a closed socket: EPIPE, never SIGPIPE. */
  fake_join(fake);

  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "layer0";
  desc.tensors = unit_tensors;
  desc.ntensors = 2;
  desc.init = ZD_INIT_ZEROS;
  zd_unit unit;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_UNAVAILABLE);
  assert_message_contains("register unit layer0: zerod closed the connection");
  assert_int_equal(zd_release(job, 0), ZD_E_UNAVAILABLE);
  zd_view view;
  assert_int_equal(zd_gather(job, 0, &view), ZD_E_UNAVAILABLE);
  assert_int_equal(zd_grad_buffer(job, 0, &view), ZD_E_UNAVAILABLE);
  assert_int_equal(zd_reduce(job, 0), ZD_E_UNAVAILABLE);
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_UNAVAILABLE);
  assert_int_equal(zd_detach(job), ZD_E_UNAVAILABLE);
  assert_message_contains("zerod closed the connection");
  assert_int_equal(sigpipe_count, 0);
  zd_close(client);
  fake_destroy(fake);
}

static void test_daemon_closing_during_a_call_makes_it_unavailable(void **state) {
  fake_daemon *fake = fake_create();
  fake->close_after_attach = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  /* No join this time: the step may go out before the fake closes, and
   * then the client reads end-of-stream while waiting for the reply. */
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_UNAVAILABLE);
  assert_message_contains("zerod closed the connection");
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_UNAVAILABLE);
  assert_int_equal(sigpipe_count, 0);
  zd_close(client);
  fake_destroy(fake);
}

static void test_error_reply_surfaces_status_and_message(void **state) {
  fake_daemon *fake = fake_create();
  fake->attach_error = ZEROD__V1__STATUS__STATUS_NOT_FOUND;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "nope";
  zd_job *job = (zd_job *)0x1;
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_NOT_FOUND);
  assert_null(job);
  assert_string_equal(zd_last_error(), "attach job nope: job nope does not exist");
  zd_close(client);
  fake_destroy(fake);
}

static void test_gather_error_names_the_unit_and_keeps_the_connection(void **state) {
  fake_daemon *fake = fake_create();
  fake->gather_error = ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_RESOURCE_EXHAUSTED);
  assert_string_equal(zd_last_error(), "gather unit 0: max_live_bytes exceeded");
  zd_step_result result;
  assert_int_equal(zd_step(job, NULL, &result), ZD_OK);
  assert_int_equal(result.version, 1);
  zd_close(client);
  fake_destroy(fake);
}

static void test_rank0_sends_init_values_in_a_memfd(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  register_unit(job, "layer0");
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->init_fd_count, 1);
  assert_true(fake->init_values_match);
  fake_destroy(fake);
}

static void test_gather_view_points_at_placements(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view;
  if (zd_gather(job, unit, &view) != ZD_OK)
    fail_msg("gather: %s", zd_last_error());
  assert_int_equal(view.dtype, ZD_F32);
  assert_int_equal(view.bytes, BUFFER_BYTES);
  assert_int_equal(view.version, 7);
  assert_int_equal(view.ntensors, 2);
  assert_string_equal(view.tensors[0].name, "w");
  assert_string_equal(view.tensors[1].name, "b");
  assert_ptr_equal(view.tensors[0].data, view.base);
  assert_ptr_equal(view.tensors[1].data, (char *)view.base + BIAS_OFFSET * sizeof(float));
  assert_int_equal(view.tensors[0].ndim, 2);
  assert_int_equal(view.tensors[0].shape[0], 3);
  assert_int_equal(view.tensors[0].shape[1], 5);
  assert_int_equal(view.tensors[1].numel, 3);
  assert_int_equal(view.tensors[1].offset, BIAS_OFFSET);
  const float *weights = view.tensors[0].data;
  const float *bias = view.tensors[1].data;
  assert_true(weights[4] == 1004.0f);
  assert_true(bias[2] == 1000.0f + BIAS_OFFSET + 2);
  assert_int_equal(zd_release(job, unit), ZD_OK);

  /* The second reply carries no descriptor: the cached mapping serves, and
   * it is shared memory, so the daemon's writes show through. */
  fake->gathered[0][0] = -1.0f;
  zd_view again;
  assert_int_equal(zd_gather(job, unit, &again), ZD_OK);
  assert_ptr_equal(again.base, view.base);
  assert_true(((const float *)again.tensors[0].data)[0] == -1.0f);
  assert_int_equal(zd_release(job, unit), ZD_OK);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->release_frames, 2);
  assert_int_equal(fake->release_no_reply_flags, 2);
  fake_destroy(fake);
}

static void test_out_of_order_replies_are_matched_by_id(void **state) {
  fake_daemon *fake = fake_create();
  fake->reorder_gathers = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit first = register_unit(job, "layer0");
  zd_unit second = register_unit(job, "layer1");
  zd_pending first_pending, second_pending;
  assert_int_equal(zd_gather_async(job, first, &first_pending), ZD_OK);
  assert_int_equal(zd_gather_async(job, second, &second_pending), ZD_OK);
  assert_true(second_pending.request_id > first_pending.request_id);
  /* The fake answers the second gather first: waiting for the first must
   * stash that reply for the second wait. */
  zd_view first_view, second_view;
  assert_int_equal(zd_gather_wait(job, &first_pending, &first_view), ZD_OK);
  assert_true(((const float *)first_view.tensors[0].data)[1] == 1001.0f);
  assert_int_equal(zd_gather_wait(job, &second_pending, &second_view), ZD_OK);
  assert_true(((const float *)second_view.tensors[0].data)[1] == 2001.0f);
  assert_ptr_not_equal(first_view.base, second_view.base);
  /* Waiting twice for the same gather is a caller error, not a hang. */
  assert_int_equal(zd_gather_wait(job, &first_pending, &first_view), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("no gather in flight");
  zd_close(client);
  fake_destroy(fake);
}

static void test_grad_buffer_is_shared_and_writable(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view gathered;
  assert_int_equal(zd_gather(job, unit, &gathered), ZD_OK);
  zd_view grad;
  assert_int_equal(zd_grad_buffer(job, unit, &grad), ZD_OK);
  /* The fake reuses buffer id 10 for both kinds: they are cached apart. */
  assert_ptr_not_equal(grad.base, gathered.base);
  assert_int_equal(grad.dtype, ZD_F32);
  float *bias_grad = grad.tensors[1].data;
  assert_ptr_equal(bias_grad, (float *)grad.base + BIAS_OFFSET);
  bias_grad[0] = 1.5f;
  bias_grad[2] = 2.0f;
  assert_int_equal(zd_reduce(job, unit), ZD_OK);
  assert_true(fake->reduce_grad_sum == 3.5f);
  assert_int_equal(zd_release(job, unit), ZD_OK);

  zd_step_options options = ZD_STEP_OPTIONS_INIT;
  options.set_lr = 1;
  options.lr = 1e-4;
  zd_step_result result;
  assert_int_equal(zd_step(job, &options, &result), ZD_OK);
  assert_int_equal(result.step, 1);
  assert_true(result.grad_norm == 2.5);
  assert_int_equal(zd_job_version(job), result.version);
  assert_int_equal(zd_detach(job), ZD_OK);
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_FAILED_PRECONDITION);
  zd_close(client);
  fake_destroy(fake);
}

static void test_release_error_is_reported_by_the_next_call(void **state) {
  fake_daemon *fake = fake_create();
  fake->release_error = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  /* The release itself returns at once: it waits for nothing. */
  assert_int_equal(zd_release(job, unit), ZD_OK);
  /* The reduce succeeds on the daemon, but the worker learns of the
   * release's failure from it, with the release named. */
  assert_int_equal(zd_reduce(job, unit), ZD_E_FAILED_PRECONDITION);
  assert_string_equal(zd_last_error(), "release unit 0: unit is not gathered by this session");
  /* Reported once. */
  assert_int_equal(zd_reduce(job, unit), ZD_OK);
  zd_close(client);
  fake_destroy(fake);
}

static void test_shutdown_notice_makes_calls_unavailable(void **state) {
  fake_daemon *fake = fake_create();
  fake->step_notice = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_UNAVAILABLE);
  assert_string_equal(zd_last_error(), "step: daemon is shutting down: SIGTERM received, draining");
  zd_view view;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_UNAVAILABLE);
  assert_string_equal(zd_last_error(),
                      "gather unit 0: daemon is shutting down: SIGTERM received, draining");
  assert_int_equal(zd_release(job, unit), ZD_E_UNAVAILABLE);
  zd_close(client);
  fake_destroy(fake);
}

static void test_undecodable_reply_is_a_protocol_error(void **state) {
  fake_daemon *fake = fake_create();
  fake->step_garbage = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_PROTOCOL);
  assert_message_contains("step: protocol error from zerod");
  /* The connection is closed: later calls are unavailable, with the cause. */
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_UNAVAILABLE);
  assert_message_contains("protocol error");
  zd_close(client);
  fake_join(fake);
  assert_true(fake->garbage_written);
  fake_destroy(fake);
}

static void test_gather_of_unseen_buffer_without_fd_is_a_protocol_error(void **state) {
  fake_daemon *fake = fake_create();
  fake->gather_unknown_buffer = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_PROTOCOL);
  assert_message_contains("buffer 99 without a descriptor");
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_UNAVAILABLE);
  zd_close(client);
  fake_destroy(fake);
}

static void test_invalid_arguments_are_refused(void **state) {
  assert_int_equal(zd_connect(NULL, NULL), ZD_E_INVALID_ARGUMENT);
  char long_path[200];
  memset(long_path, 'x', sizeof long_path - 1);
  long_path[sizeof long_path - 1] = '\0';
  zd_client *client = NULL;
  assert_int_equal(zd_connect(long_path, &client), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("socket path");

  fake_daemon *fake = fake_create();
  fake_start(fake);
  client = connect_to(fake);
  zd_job *job = NULL;
  assert_int_equal(zd_attach(client, NULL, &job), ZD_E_INVALID_ARGUMENT);
  zd_attach_options options = {0}; /* struct_size 0: not initialised */
  options.job = "test";
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("ZD_ATTACH_OPTIONS_INIT");
  options.struct_size = sizeof options + 8;
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_INVALID_ARGUMENT);
  options = (zd_attach_options)ZD_ATTACH_OPTIONS_INIT;
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("job name");
  zd_job_config bad_config = ZD_JOB_CONFIG_INIT;
  bad_config.optimizer = (zd_optimizer)9;
  options.job = "test";
  options.config = &bad_config;
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("optimizer");
  /* A config from an older header (only struct_size and optimizer) is
   * accepted: the fields it lacks read as zero. */
  zd_job_config old_config = ZD_JOB_CONFIG_INIT;
  old_config.struct_size = offsetof(zd_job_config, lr);
  old_config.optimizer = ZD_SGD;
  options.config = &old_config;
  assert_int_equal(zd_attach(client, &options, &job), ZD_OK);
  assert_non_null(job);
  zd_job *second_job = NULL;
  assert_int_equal(zd_attach(client, &options, &second_job), ZD_E_FAILED_PRECONDITION);
  assert_null(second_job);
  assert_message_contains("one job per connection");

  zd_unit unit;
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "layer0";
  desc.tensors = unit_tensors;
  desc.ntensors = 0;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("1..4096 tensors");
  desc.ntensors = 2;
  desc.tensors = NULL;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_INVALID_ARGUMENT);
  desc.tensors = unit_tensors;
  desc.init = ZD_INIT_FROM_RANK0; /* rank 0 without init_values */
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("init_values");
  zd_tensor_desc zero_dim[1] = {{.name = "z", .shape = (const uint64_t[]){4, 0}, .ndim = 2}};
  desc.tensors = zero_dim;
  desc.ntensors = 1;
  desc.init = ZD_INIT_ZEROS;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_register_unit(job, NULL, &unit), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_register_unit(NULL, &desc, &unit), ZD_E_INVALID_ARGUMENT);

  zd_view view;
  zd_pending pending;
  assert_int_equal(zd_gather(job, 42, &view), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("gather unit 42");
  assert_int_equal(zd_gather(job, 0, NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_gather(NULL, 0, &view), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_gather_async(job, 0, NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_gather_wait(job, NULL, &view), ZD_E_INVALID_ARGUMENT);
  pending.request_id = 12345;
  pending.unit = 42;
  assert_int_equal(zd_gather_wait(job, &pending, &view), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_release(job, 42), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_release(NULL, 0), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_grad_buffer(job, 42, &view), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_reduce(job, 42), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_step(NULL, NULL, NULL), ZD_E_INVALID_ARGUMENT);
  zd_step_options step_options = {0};
  assert_int_equal(zd_step(job, &step_options, NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_detach(NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_job_rank(NULL), 0);
  assert_int_equal(zd_job_world_size(NULL), 0);
  /* After all of that the connection still works. */
  assert_int_equal(zd_step(job, NULL, NULL), ZD_OK);
  zd_close(client);
  zd_close(NULL);
  fake_destroy(fake);
}

static void test_every_status_has_a_name(void **state) {
  for (int code = ZD_OK; code >= ZD_E_IO; code--) {
    const char *name = zd_strerror((zd_status)code);
    assert_non_null(name);
    assert_string_not_equal(name, "unknown error");
    for (int other = code - 1; other >= ZD_E_IO; other--)
      assert_string_not_equal(name, zd_strerror((zd_status)other));
  }
  assert_string_equal(zd_strerror((zd_status)-99), "unknown error");
}

static void *read_last_error(void *unused) {
  (void)unused;
  return (void *)zd_last_error();
}

static void test_last_error_is_per_thread(void **state) {
  assert_int_equal(zd_connect(NULL, NULL), ZD_E_INVALID_ARGUMENT);
  assert_true(zd_last_error()[0] != '\0');
  pthread_t thread;
  void *seen = NULL;
  assert_int_equal(pthread_create(&thread, NULL, read_last_error, NULL), 0);
  assert_int_equal(pthread_join(thread, &seen), 0);
  assert_string_equal((const char *)seen, "");
}

int main(void) {
  signal(SIGPIPE, on_sigpipe);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_connect_to_missing_socket_is_unavailable),
      cmocka_unit_test(test_default_socket_follows_environment),
      cmocka_unit_test(test_daemon_closing_after_attach_makes_calls_unavailable),
      cmocka_unit_test(test_daemon_closing_during_a_call_makes_it_unavailable),
      cmocka_unit_test(test_error_reply_surfaces_status_and_message),
      cmocka_unit_test(test_gather_error_names_the_unit_and_keeps_the_connection),
      cmocka_unit_test(test_rank0_sends_init_values_in_a_memfd),
      cmocka_unit_test(test_gather_view_points_at_placements),
      cmocka_unit_test(test_out_of_order_replies_are_matched_by_id),
      cmocka_unit_test(test_grad_buffer_is_shared_and_writable),
      cmocka_unit_test(test_release_error_is_reported_by_the_next_call),
      cmocka_unit_test(test_shutdown_notice_makes_calls_unavailable),
      cmocka_unit_test(test_undecodable_reply_is_a_protocol_error),
      cmocka_unit_test(test_gather_of_unseen_buffer_without_fd_is_a_protocol_error),
      cmocka_unit_test(test_invalid_arguments_are_refused),
      cmocka_unit_test(test_every_status_has_a_name),
      cmocka_unit_test(test_last_error_is_per_thread),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
