/* client_fixtures.c - what the libzerod tests share (client_fixtures.h):
 * the fake daemon, serving one connection on its own thread, and the
 * worker side's helpers. */
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

#include "client_fixtures.h"

/* ------------------------------------------------------------------------
 * The fake daemon
 * ------------------------------------------------------------------------ */

volatile sig_atomic_t sigpipe_count;

void on_sigpipe(int signo) {
  (void)signo;
  sigpipe_count++;
}

/* A shared buffer of UNIT_PADDED_NUMEL floats: first_value + i, or zeros
 * when first_value is 0 (gradient buffers). The name shows in /proc. */
static int make_memfd(unsigned serial, const char *kind, int unit, float **map_out,
                      float first_value) {
  char name[64];
  snprintf(name, sizeof name, "fake-zerod-%u-%s-%d", serial, kind, unit);
  int fd = memfd_create(name, MFD_CLOEXEC);
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

/* Moves the pending drops into a reply. Like the daemon, the fake numbers
 * a dropped id afresh for the worker: its descriptor is sent again. The
 * pending count is cleared here, before the reply goes out: once the test
 * has the reply it may set the next drops, and a clear after the send
 * could wipe them (the test failed that way about one run in four). */
static void fake_take_drops(fake_daemon *fake, uint32_t **ids, size_t *count) {
  *ids = fake->drop_ids;
  *count = fake->ndrop_ids;
  for (unsigned d = 0; d < fake->ndrop_ids; d++) {
    uint32_t id = fake->drop_ids[d];
    if (id >= BUFFER_ID && id < BUFFER_ID + MAX_UNITS)
      fake->gathered_sent[id - BUFFER_ID] = fake->grad_sent[id - BUFFER_ID] = 0;
    if (id >= ALT_BUFFER_ID && id < ALT_BUFFER_ID + MAX_UNITS)
      fake->alt_sent[id - ALT_BUFFER_ID] = 0;
  }
  fake->ndrop_ids = 0;
}

static void fake_gather_reply(fake_daemon *fake, uint64_t request_id, uint32_t unit) {
  Zerod__V1__GatherReply reply = ZEROD__V1__GATHER_REPLY__INIT;
  reply.unit_id = unit;
  reply.buffer_id = BUFFER_ID + unit;
  reply.buffer_bytes = BUFFER_BYTES;
  reply.version = 7;
  if (fake->gather_unknown_buffer) {
    reply.buffer_id = 99;
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, request_id, &reply.base, NULL, 0);
    return;
  }
  if (fake->gather_cuda) {
    uint8_t handle[ZD_CUDA_IPC_HANDLE_BYTES] = {1, 2, 3};
    Zerod__V1__CudaBuffer cuda = ZEROD__V1__CUDA_BUFFER__INIT;
    cuda.mem_handle.data = handle;
    cuda.mem_handle.len = sizeof handle;
    cuda.event_handle.data = handle;
    cuda.event_handle.len = sizeof handle;
    cuda.device = 2;
    reply.cuda = &cuda;
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, request_id, &reply.base,
              &fake->gathered_fd[unit], fake->gather_cuda == 2 ? 1 : 0);
    return;
  }
  if (fake->alternate_gather_buffers)
    fake->gather_uses_alt[unit] = !fake->gather_uses_alt[unit];
  int *sent = &fake->gathered_sent[unit];
  int *fd = &fake->gathered_fd[unit];
  if (fake->gather_uses_alt[unit]) {
    reply.buffer_id = ALT_BUFFER_ID + unit;
    sent = &fake->alt_sent[unit];
    fd = &fake->alt_fd[unit];
  }
  fake_take_drops(fake, &reply.dropped_buffer_ids, &reply.n_dropped_buffer_ids);
  int first_time = !*sent;
  *sent = 1;
  fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, request_id, &reply.base, fd,
            first_time ? 1 : 0);
}

/* The worker's tests pass values 0.5, 1.5, 2.5, ... (registration) or
 * 100, 101, ... (load) for all 18 elements (15 + 3), back to back without
 * the alignment gap. */
static int fake_values_match(int fd, float first_value) {
  float values[18];
  if (pread(fd, values, sizeof values, 0) != sizeof values)
    return 0;
  for (int i = 0; i < 18; i++) {
    if (values[i] != first_value + (float)i)
      return 0;
  }
  return 1;
}

static uint64_t fake_w_shape[2] = {3, 5};
static uint64_t fake_b_shape[1] = {3};

/* A RegisterUnitReply in the fake's one layout; the storage is the
 * caller's. */
typedef struct fake_unit_reply {
  Zerod__V1__RegisterUnitReply reply;
  Zerod__V1__TensorPlacement w, b;
  Zerod__V1__TensorPlacement *placements[2];
} fake_unit_reply;

static void fake_unit_reply_init(fake_unit_reply *unit, uint32_t unit_id, char *name, char *w_name,
                                 char *b_name) {
  Zerod__V1__TensorPlacement w = ZEROD__V1__TENSOR_PLACEMENT__INIT;
  Zerod__V1__TensorPlacement b = ZEROD__V1__TENSOR_PLACEMENT__INIT;
  Zerod__V1__RegisterUnitReply reply = ZEROD__V1__REGISTER_UNIT_REPLY__INIT;
  w.name = w_name;
  w.n_shape = 2;
  w.shape = fake_w_shape;
  w.offset = 0;
  w.numel = 15;
  b.name = b_name;
  b.n_shape = 1;
  b.shape = fake_b_shape;
  b.offset = BIAS_OFFSET;
  b.numel = 3;
  unit->w = w;
  unit->b = b;
  unit->placements[0] = &unit->w;
  unit->placements[1] = &unit->b;
  reply.unit_id = unit_id;
  reply.name = name;
  reply.numel = UNIT_NUMEL;
  reply.padded_numel = UNIT_PADDED_NUMEL;
  reply.shard_numel = UNIT_PADDED_NUMEL;
  reply.n_tensors = 2;
  reply.tensors = unit->placements;
  reply.working_dtype = ZEROD__V1__DTYPE__DTYPE_F32;
  reply.grad_dtype = ZEROD__V1__DTYPE__DTYPE_F32;
  unit->reply = reply;
}

static void fake_register(fake_daemon *fake, uint64_t request_id,
                          const Zerod__V1__RegisterUnitRequest *request, const int *fds,
                          unsigned nfds) {
  fake->init_fd_count += (int)nfds;
  if (nfds == 1)
    fake->init_values_match = fake_values_match(fds[0], 0.5f);
  uint32_t unit_id = fake->units_registered++ % MAX_UNITS;
  snprintf(fake->unit_names[unit_id], sizeof fake->unit_names[unit_id], "%s", request->name);
  fake_unit_reply unit;
  fake_unit_reply_init(&unit, unit_id, fake->unit_names[unit_id],
                       request->n_tensors > 0 ? request->tensors[0]->name : "w",
                       request->n_tensors > 1 ? request->tensors[1]->name : "b");
  fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, request_id, &unit.reply.base, NULL,
            0);
}

static uint64_t fake_latest_version(const fake_daemon *fake) {
  return fake->latest_version != 0 ? fake->latest_version : 3;
}

static void fake_units(fake_daemon *fake, uint64_t request_id) {
  fake_unit_reply units[MAX_UNITS];
  Zerod__V1__RegisterUnitReply *replies[MAX_UNITS];
  unsigned count = fake->units_registered < MAX_UNITS ? fake->units_registered : MAX_UNITS;
  for (unsigned u = 0; u < count; u++) {
    fake_unit_reply_init(&units[u], u, fake->unit_names[u], "w", "b");
    if (fake->list_bad_placement)
      units[u].b.offset = UNIT_NUMEL - 1; /* 3 elements from there pass the end */
    if (fake->list_other_layout)
      units[u].b.offset = BIAS_OFFSET - 1;
    replies[u] = &units[u].reply;
  }
  Zerod__V1__UnitsReply reply = ZEROD__V1__UNITS_REPLY__INIT;
  reply.n_units = count;
  reply.units = replies;
  reply.version = fake_latest_version(fake);
  fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_UNITS_REPLY, request_id, &reply.base, NULL, 0);
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
  if (header->type < sizeof fake->frames_by_type / sizeof fake->frames_by_type[0])
    fake->frames_by_type[header->type]++;
  switch (header->type) {
  case ZEROD__V1__MSG_TYPE__MSG_ATTACH: {
    const Zerod__V1__AttachRequest *request = (const Zerod__V1__AttachRequest *)msg;
    fake->attach_mode = request->mode;
    fake->attach_pin = request->pin;
    snprintf(fake->attach_token, sizeof fake->attach_token, "%s", request->token);
    if (fake->attach_error != ZEROD__V1__STATUS__STATUS_OK) {
      fake_error(fake, id, fake->attach_error, "job nope does not exist");
      return 0;
    }
    Zerod__V1__AttachReply reply = ZEROD__V1__ATTACH_REPLY__INIT;
    reply.rank = fake->attach_rank;
    reply.world_size = fake->attach_world_size != 0 ? fake->attach_world_size : 1;
    reply.version = fake_latest_version(fake);
    reply.read_only = (request->mode == ZEROD__V1__ATTACH_MODE__ATTACH_READ_ONLY) !=
                      (fake->attach_read_only_lie != 0);
    reply.pinned_version = request->pin ? fake->pinned_version : 0;
    Zerod__V1__JobConfig config = ZEROD__V1__JOB_CONFIG__INIT;
    Zerod__V1__OptimizerConfig optimizer = ZEROD__V1__OPTIMIZER_CONFIG__INIT;
    if (fake->attach_config) {
      optimizer.kind = ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD;
      optimizer.lr = 0.25;
      optimizer.has_weight_decay = 1;
      optimizer.momentum = 0.9;
      optimizer.nesterov = 1;
      config.optimizer = &optimizer;
      config.working_dtype = ZEROD__V1__DTYPE__DTYPE_BF16;
      config.max_live_bytes = 1 << 20;
      config.max_grad_norm = 1.5;
      reply.config = &config;
    }
    if (fake->attach_warning != NULL)
      reply.warning = (char *)fake->attach_warning;
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, id, &reply.base, NULL, 0);
    return fake->close_after_attach;
  }
  case ZEROD__V1__MSG_TYPE__MSG_UNITS:
    fake_units(fake, id);
    return 0;
  case ZEROD__V1__MSG_TYPE__MSG_PIN: {
    Zerod__V1__PinReply reply = ZEROD__V1__PIN_REPLY__INIT;
    reply.version = fake_latest_version(fake);
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_PIN_REPLY, id, &reply.base, NULL, 0);
    return 0;
  }
  case ZEROD__V1__MSG_TYPE__MSG_WATCH: {
    const Zerod__V1__WatchVersionRequest *request = (const Zerod__V1__WatchVersionRequest *)msg;
    fake->watch_after = request->after_version;
    fake->watch_timeout_ms = request->timeout_ms;
    Zerod__V1__WatchVersionReply reply = ZEROD__V1__WATCH_VERSION_REPLY__INIT;
    reply.timed_out = fake->watch_timed_out;
    reply.version = fake->watch_timed_out ? request->after_version : fake->watch_version;
    reply.skipped = fake->watch_timed_out ? 0 : 2;
    reply.step = fake->watch_timed_out ? 0 : fake->watch_version;
    reply.changed_units = fake->watch_changed;
    reply.n_changed_units = fake->watch_timed_out ? 0 : fake->nwatch_changed;
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_WATCH_REPLY, id, &reply.base, NULL, 0);
    return 0;
  }
  case ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT: {
    fake->load_unit = ((const Zerod__V1__LoadUnitRequest *)msg)->unit_id;
    fake->load_fd_count += (int)nfds;
    if (nfds == 1)
      fake->load_values_match = fake_values_match(fds[0], 100.0f);
    Zerod__V1__LoadUnitReply reply = ZEROD__V1__LOAD_UNIT_REPLY__INIT;
    reply.unit_id = fake->load_unit;
    reply.version = ++fake->latest_version;
    fake_send(fake, ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT_REPLY, id, &reply.base, NULL, 0);
    return 0;
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
      fake_error(fake, id, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                 "more than 64 requests in flight");
    return 0;
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER: {
    uint32_t unit = ((const Zerod__V1__GradBufferRequest *)msg)->unit_id % MAX_UNITS;
    Zerod__V1__GradBufferReply reply = ZEROD__V1__GRAD_BUFFER_REPLY__INIT;
    reply.unit_id = unit;
    reply.buffer_id = BUFFER_ID + unit; /* the same numbers as gathered buffers, on purpose */
    reply.buffer_bytes = BUFFER_BYTES;
    fake_take_drops(fake, &reply.dropped_buffer_ids, &reply.n_dropped_buffer_ids);
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
    if (fake->reduce_error) {
      fake_error(fake, id, ZEROD__V1__STATUS__STATUS_ABORTED, "rank 1's worker disconnected");
      return 0;
    }
    if (header->flags & ZD_FRAME_F_NO_REPLY) {
      fake->reduce_no_reply_flags++;
      return 0;
    }
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

fake_daemon *fake_create(void) {
  static unsigned fakes_created;
  fake_daemon *fake = calloc(1, sizeof *fake);
  assert_non_null(fake);
  fake->serial = ++fakes_created;
  snprintf(fake->dir, sizeof fake->dir, "/tmp/zerod-test-client-XXXXXX");
  assert_non_null(mkdtemp(fake->dir));
  snprintf(fake->path, sizeof fake->path, "%s/zerod.sock", fake->dir);
  for (int u = 0; u < MAX_UNITS; u++) {
    fake->gathered_fd[u] =
        make_memfd(fake->serial, "gather", u, &fake->gathered[u], 1000.0f * (float)(u + 1));
    fake->alt_fd[u] = make_memfd(fake->serial, "alt", u, &fake->alt[u], 5000.0f * (float)(u + 1));
    fake->grad_fd[u] = make_memfd(fake->serial, "grad", u, &fake->grad[u], 0.0f);
    assert_true(fake->gathered_fd[u] >= 0 && fake->alt_fd[u] >= 0 && fake->grad_fd[u] >= 0);
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
void fake_start(fake_daemon *fake) {
  assert_int_equal(pthread_create(&fake->thread, NULL, fake_main, fake), 0);
}

/* Waits for the serving thread, which ends when the connection does. */
void fake_join(fake_daemon *fake) {
  if (!fake->joined)
    pthread_join(fake->thread, NULL);
  fake->joined = 1;
}

void fake_destroy(fake_daemon *fake) {
  fake_join(fake);
  close(fake->listen_fd);
  for (int u = 0; u < MAX_UNITS; u++) {
    munmap(fake->gathered[u], BUFFER_BYTES);
    munmap(fake->alt[u], BUFFER_BYTES);
    munmap(fake->grad[u], BUFFER_BYTES);
    close(fake->gathered_fd[u]);
    close(fake->alt_fd[u]);
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
const zd_tensor_desc unit_tensors[2] = {
    {.struct_size = sizeof(zd_tensor_desc), .name = "w", .shape = w_shape, .ndim = 2},
    {.struct_size = sizeof(zd_tensor_desc), .name = "b", .shape = b_shape, .ndim = 1},
};

zd_job *attach_job(zd_client *client) {
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

zd_unit register_unit(zd_job *job, const char *name) {
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

zd_client *connect_to(fake_daemon *fake) {
  zd_client *client = NULL;
  zd_status status = zd_connect(fake->path, &client);
  if (status != ZD_OK)
    fail_msg("connect: %s: %s", zd_strerror(status), zd_last_error());
  return client;
}

void assert_message_contains(const char *needle) {
  if (strstr(zd_last_error(), needle) == NULL)
    fail_msg("expected zd_last_error() to contain \"%s\", got \"%s\"", needle, zd_last_error());
}

/* Attaches to job "test" with the given flags (the job exists). */
zd_job *attach_with(zd_client *client, int read_only, int pin, int stable_addresses) {
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "test";
  options.read_only = read_only;
  options.pin = pin;
  options.stable_addresses = stable_addresses;
  zd_job *job = NULL;
  zd_status status = zd_attach(client, &options, &job);
  if (status != ZD_OK)
    fail_msg("attach: %s: %s", zd_strerror(status), zd_last_error());
  return job;
}

/* The /proc name of the fake's memfd `name` (for example "gather-0"). */
const char *memfd_name(const fake_daemon *fake, const char *name) {
  static char text[64];
  snprintf(text, sizeof text, "memfd:fake-zerod-%u-%s ", fake->serial, name);
  return text;
}

/* The permissions ("r--s", "---p", ...) of the mapping holding addr, from
 * /proc/self/maps, if it maps the fake's memfd `name` (NULL: whatever is
 * mapped there); "other" if it maps something else, "" if nothing is
 * mapped at addr. */
const char *perms_at(const void *addr, const fake_daemon *fake, const char *name) {
  static char perms[8];
  const char *file = name != NULL ? memfd_name(fake, name) : NULL;
  perms[0] = '\0';
  FILE *maps = fopen("/proc/self/maps", "r");
  assert_non_null(maps);
  char line[512];
  while (fgets(line, sizeof line, maps) != NULL) {
    unsigned long start, end;
    char line_perms[8];
    if (sscanf(line, "%lx-%lx %7s", &start, &end, line_perms) != 3)
      continue;
    if ((uintptr_t)addr >= start && (uintptr_t)addr < end) {
      if (file == NULL || strstr(line, file) != NULL)
        snprintf(perms, sizeof perms, "%s", line_perms);
      else
        snprintf(perms, sizeof perms, "other");
      break;
    }
  }
  fclose(maps);
  return perms;
}

void gather_ok(zd_job *job, zd_unit unit, zd_view *view) {
  zd_status status = zd_gather(job, unit, view);
  if (status != ZD_OK)
    fail_msg("gather unit %u: %s: %s", (unsigned)unit, zd_strerror(status), zd_last_error());
}

float first_weight(const zd_view *view) {
  return ((const float *)view->tensors[0].data)[0];
}
