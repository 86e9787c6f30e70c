/* libzerod against a fake daemon: a thread that serves one connection on a
 * Unix socket in a temporary directory, speaks the real framing
 * (proto/frame.h), and misbehaves on request (closes the connection, answers
 * with errors, out of order, with undecodable frames, with shutdown
 * notices). Each test pins one behaviour of the client: how it surfaces the
 * daemon's errors, how it matches replies to requests, how it maps shared
 * buffers into views, and that a lost daemon never crashes the worker.
 *
 * cmocka is not thread-safe, so the fake daemon never asserts: it records
 * what it saw in its struct, and the test thread checks after the fact.
 * The test thread changes the fake's behaviour only between calls, while
 * the fake waits for the next request.
 *
 * Mappings are checked in /proc/self (maps and fd): every memfd the fake
 * makes has its own name, and the fake keeps one mapping and one
 * descriptor of each, so whatever else shows up belongs to libzerod. */
#include <dirent.h>
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
  unsigned serial; /* in the memfds' names, apart from earlier fakes' */
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
  int reduce_error;          /* answer reduces with an Error */
  int reduce_no_reply_flags; /* reduces that came with NO_REPLY */
  int step_notice;           /* answer a step with a shutdown notice */
  int step_garbage;          /* answer a step with a payload that does not decode */
  Zerod__V1__Status gather_error;
  /* The attached rank and world size (0: rank 0 of 1). */
  unsigned attach_rank;
  unsigned attach_world_size;
  int attach_read_only_lie;     /* answer read_only the other way round */
  int attach_config;            /* send a config (SGD, see fake_attach_config) */
  const char *attach_warning;   /* AttachReply.warning; NULL: none */
  uint64_t latest_version;      /* the job's version (attach, units, pin); 0: 3 */
  uint64_t pinned_version;      /* AttachReply.pinned_version */
  int alternate_gather_buffers; /* switch each unit's buffer at every gather */
  int list_bad_placement;       /* list tensor "b" outside its unit */
  int list_other_layout;        /* list tensor "b" at another offset */
  uint32_t drop_ids[4];         /* dropped_buffer_ids of the next buffer reply */
  unsigned ndrop_ids;
  /* Answer gathers as a GPU daemon would: CUDA IPC handles in the reply
   * (1), or handles and a descriptor both (2). */
  int gather_cuda;

  /* Shared memory the fake hands out, one gathered and one gradient
   * buffer per unit; the fake keeps its own mappings to check writes. */
  int gathered_fd[MAX_UNITS];
  float *gathered[MAX_UNITS];
  int gathered_sent[MAX_UNITS];
  int grad_fd[MAX_UNITS];
  float *grad[MAX_UNITS];
  int grad_sent[MAX_UNITS];
  /* With alternate_gather_buffers: a second gathered buffer per unit, id
   * ALT_BUFFER_ID + unit, values 5000 * (unit + 1) + i. */
  int alt_fd[MAX_UNITS];
  float *alt[MAX_UNITS];
  int alt_sent[MAX_UNITS];
  int gather_uses_alt[MAX_UNITS];

  /* The job's units, by id: registered, or set by the test before start. */
  char unit_names[MAX_UNITS][32];

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
  unsigned frames_by_type[64];
  int attach_mode;
  int attach_pin;
  int load_fd_count;
  int load_values_match;
  uint32_t load_unit;
} fake_daemon;

#define BUFFER_ID     10 /* + unit, for gathered and gradient buffers alike */
#define ALT_BUFFER_ID 20 /* + unit */

static volatile sig_atomic_t sigpipe_count;

static void on_sigpipe(int signo) {
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

static fake_daemon *fake_create(void) {
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
static const zd_tensor_desc unit_tensors[2] = {
    {.struct_size = sizeof(zd_tensor_desc), .name = "w", .shape = w_shape, .ndim = 2},
    {.struct_size = sizeof(zd_tensor_desc), .name = "b", .shape = b_shape, .ndim = 1},
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

/* Attaches to job "test" with the given flags (the job exists). */
static zd_job *attach_with(zd_client *client, int read_only, int pin, int stable_addresses) {
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
static const char *memfd_name(const fake_daemon *fake, const char *name) {
  static char text[64];
  snprintf(text, sizeof text, "memfd:fake-zerod-%u-%s ", fake->serial, name);
  return text;
}

/* The permissions ("r--s", "---p", ...) of the mapping holding addr, from
 * /proc/self/maps, if it maps the fake's memfd `name` (NULL: whatever is
 * mapped there); "other" if it maps something else, "" if nothing is
 * mapped at addr. */
static const char *perms_at(const void *addr, const fake_daemon *fake, const char *name) {
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

/* How many mappings of this process map the fake's memfd `name`: the
 * fake's own, plus libzerod's. */
static int count_mappings(const char *needle) {
  FILE *maps = fopen("/proc/self/maps", "r");
  assert_non_null(maps);
  char line[512];
  int count = 0;
  while (fgets(line, sizeof line, maps) != NULL)
    count += strstr(line, needle) != NULL;
  fclose(maps);
  return count;
}

/* /proc/self/maps is read a page at a time, and a mapping that the fake
 * daemon's thread adds or removes meanwhile can make a line appear twice or
 * not at all: count until two reads agree. */
static int mappings_of(const fake_daemon *fake, const char *name) {
  const char *needle = memfd_name(fake, name);
  int count = count_mappings(needle);
  for (int tries = 0; tries < 10; tries++) {
    int again = count_mappings(needle);
    if (again == count)
      break;
    count = again;
  }
  return count;
}

/* How many open descriptors of this process name the fake's memfd `name`:
 * the fake's own, plus those libzerod keeps. */
static int descriptors_of(const fake_daemon *fake, const char *name) {
  const char *needle = memfd_name(fake, name);
  DIR *dir = opendir("/proc/self/fd");
  assert_non_null(dir);
  int count = 0;
  struct dirent *entry;
  while ((entry = readdir(dir)) != NULL) {
    char path[300], target[256];
    snprintf(path, sizeof path, "/proc/self/fd/%s", entry->d_name);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n <= 0)
      continue;
    target[n] = '\0';
    count += strstr(target, needle) != NULL;
  }
  closedir(dir);
  return count;
}

static void gather_ok(zd_job *job, zd_unit unit, zd_view *view) {
  zd_status status = zd_gather(job, unit, view);
  if (status != ZD_OK)
    fail_msg("gather unit %u: %s: %s", (unsigned)unit, zd_strerror(status), zd_last_error());
}

static float first_weight(const zd_view *view) {
  return ((const float *)view->tensors[0].data)[0];
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
  zd_view view = ZD_VIEW_INIT;
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
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_RESOURCE_EXHAUSTED);
  assert_string_equal(zd_last_error(), "gather unit 0: max_live_bytes exceeded");
  zd_step_result result = ZD_STEP_RESULT_INIT;
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
  zd_view view = ZD_VIEW_INIT;
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
  /* Shared memory: no device, no event, and nothing to order. */
  assert_int_equal(view.device, -1);
  assert_null(view.event);
  assert_int_equal(zd_view_stream_wait(&view, NULL), ZD_OK);
  assert_int_equal(zd_view_stream_done(&view, NULL), ZD_OK);
  const float *weights = view.tensors[0].data;
  const float *bias = view.tensors[1].data;
  assert_true(weights[4] == 1004.0f);
  assert_true(bias[2] == 1000.0f + BIAS_OFFSET + 2);
  assert_int_equal(zd_release(job, unit), ZD_OK);

  /* The second reply carries no descriptor: the cached mapping serves, and
   * it is shared memory, so the daemon's writes show through. */
  fake->gathered[0][0] = -1.0f;
  zd_view again = ZD_VIEW_INIT;
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
  zd_pending first_pending = ZD_PENDING_INIT, second_pending = ZD_PENDING_INIT;
  assert_int_equal(zd_gather_async(job, first, &first_pending), ZD_OK);
  assert_int_equal(zd_gather_async(job, second, &second_pending), ZD_OK);
  assert_true(second_pending.request_id > first_pending.request_id);
  /* The fake answers the second gather first: waiting for the first must
   * stash that reply for the second wait. */
  zd_view first_view = ZD_VIEW_INIT, second_view = ZD_VIEW_INIT;
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
  zd_view gathered = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &gathered), ZD_OK);
  zd_view grad = ZD_VIEW_INIT;
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
  zd_step_result result = ZD_STEP_RESULT_INIT;
  assert_int_equal(zd_step(job, &options, &result), ZD_OK);
  assert_int_equal(result.step, 1);
  assert_true(result.grad_norm == 2.5);
  assert_int_equal(zd_job_version(job), result.version);
  assert_int_equal(zd_detach(job), ZD_OK);
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_FAILED_PRECONDITION);
  zd_close(client);
  fake_destroy(fake);
}

static void test_release_error_the_library_cannot_foresee_is_deferred(void **state) {
  fake_daemon *fake = fake_create();
  fake->release_error = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view = ZD_VIEW_INIT;
  gather_ok(job, unit, &view);
  /* The release itself returns at once: it waits for nothing, and the
   * library had every reason to send it. */
  assert_int_equal(zd_release(job, unit), ZD_OK);
  /* The daemon refused it for a reason of its own: the reduce succeeds on
   * the daemon, and the worker learns of the release's failure from it,
   * with the release named first. */
  assert_int_equal(zd_reduce(job, unit), ZD_E_RESOURCE_EXHAUSTED);
  assert_string_equal(zd_last_error(), "release unit 0: more than 64 requests in flight");
  /* Reported once. */
  assert_int_equal(zd_reduce(job, unit), ZD_OK);
  zd_close(client);
  fake_destroy(fake);
}

static void test_async_reduce_waits_for_nothing_and_defers_its_error(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view grad = ZD_VIEW_INIT;
  assert_int_equal(zd_grad_buffer(job, unit, &grad), ZD_OK);
  ((float *)grad.base)[0] = 3.0f;
  assert_int_equal(zd_reduce_async(job, unit), ZD_OK);
  /* The next call that waits sees the reduce done by the daemon in order. */
  assert_int_equal(zd_step(job, NULL, NULL), ZD_OK);
  assert_int_equal(fake->reduce_no_reply_flags, 1);
  assert_true(fake->reduce_grad_sum == 3.0f);
  /* An error answering an asynchronous reduce is reported by the next call
   * that waits, with the reduce named; the call's own effect happened. */
  fake->reduce_error = 1;
  assert_int_equal(zd_grad_buffer(job, unit, &grad), ZD_OK);
  assert_int_equal(zd_reduce_async(job, unit), ZD_OK);
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_ABORTED);
  assert_string_equal(zd_last_error(), "reduce unit 0: rank 1's worker disconnected");
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
  zd_view view = ZD_VIEW_INIT;
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
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_PROTOCOL);
  assert_message_contains("buffer 99 without a descriptor");
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_UNAVAILABLE);
  zd_close(client);
  fake_destroy(fake);
}

/* main() points ZEROD_CUDA_MODULE nowhere, so this process never has CUDA,
 * GPU or not: a GPU buffer must fail the gather with a clear reason. */
static void test_gpu_buffer_without_cuda_fails_with_the_reason(void **state) {
  fake_daemon *fake = fake_create();
  fake->gather_cuda = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_FAILED_PRECONDITION);
  assert_message_contains("zerod keeps this job on GPU 2 (zerod --device cuda)");
  assert_message_contains("cannot use CUDA");
  /* The connection is fine: only this process lacks CUDA. */
  assert_int_equal(zd_release(job, unit), ZD_OK);
  assert_int_equal(zd_detach(job), ZD_OK);
  zd_close(client);
  fake_destroy(fake);
}

static void test_gpu_buffer_with_a_descriptor_too_is_a_protocol_error(void **state) {
  fake_daemon *fake = fake_create();
  fake->gather_cuda = 2;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &view), ZD_E_PROTOCOL);
  assert_message_contains("both a descriptor and GPU handles for buffer 10");
  zd_close(client);
  fake_destroy(fake);
}

/* The attach reply's config is the job's effective one, and its warning
 * (the attach's config was not used) reaches the worker; both stay after
 * detach. */
static void test_attach_keeps_the_jobs_config_and_the_daemons_warning(void **state) {
  static const char warning[] = "job 'test' exists with another config; this attach's was not "
                                "used: lr 0.001 (the job's 0.25)";
  fake_daemon *fake = fake_create();
  fake->attach_config = 1;
  fake->attach_warning = warning;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  assert_string_equal(zd_job_attach_warning(job), warning);
  zd_job_config config = ZD_JOB_CONFIG_INIT;
  assert_int_equal(zd_job_effective_config(job, &config), ZD_OK);
  assert_int_equal(config.struct_size, sizeof config);
  assert_int_equal(config.optimizer, ZD_SGD);
  assert_true(config.lr == 0.25 && config.momentum == 0.9 && config.nesterov == 1);
  assert_true(config.weight_decay == 0 && config.has_weight_decay == 1);
  assert_int_equal(config.working_dtype, ZD_BF16);
  assert_int_equal(config.max_live_bytes, 1 << 20);
  assert_true(config.max_grad_norm == 1.5);
  assert_int_equal(zd_detach(job), ZD_OK);
  assert_string_equal(zd_job_attach_warning(job), warning);

  /* An older caller's smaller struct gets the fields it has, no more; a
   * size outside what this library knows is refused. */
  zd_job_config older = ZD_JOB_CONFIG_INIT;
  older.struct_size = offsetof(zd_job_config, beta1);
  older.beta1 = 7;
  assert_int_equal(zd_job_effective_config(job, &older), ZD_OK);
  assert_true(older.lr == 0.25 && older.beta1 == 7);
  older.struct_size = 0;
  assert_int_equal(zd_job_effective_config(job, &older), ZD_E_INVALID_ARGUMENT);
  older.struct_size = sizeof older + 8;
  assert_int_equal(zd_job_effective_config(job, &older), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("ZD_JOB_CONFIG_INIT");
  assert_int_equal(zd_job_effective_config(NULL, &config), ZD_E_INVALID_ARGUMENT);
  assert_null(zd_job_attach_warning(NULL));
  zd_close(client);
  fake_join(fake);
  fake_destroy(fake);

  /* No warning: NULL. */
  fake = fake_create();
  fake_start(fake);
  client = connect_to(fake);
  job = attach_job(client);
  assert_null(zd_job_attach_warning(job));
  zd_close(client);
  fake_join(fake);
  fake_destroy(fake);
}

static void test_read_only_attach_sends_mode_and_pin(void **state) {
  fake_daemon *fake = fake_create();
  fake->latest_version = 9;
  fake->pinned_version = 5;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 1, 0);
  assert_int_equal(zd_job_read_only(job), 1);
  /* A pinned job reports the version it reads, not the latest. */
  assert_int_equal(zd_job_version(job), 5);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->attach_mode, ZEROD__V1__ATTACH_MODE__ATTACH_READ_ONLY);
  assert_true(fake->attach_pin);
  fake_destroy(fake);

  fake = fake_create();
  fake->latest_version = 9;
  fake_start(fake);
  client = connect_to(fake);
  job = attach_with(client, 1, 0, 0);
  assert_int_equal(zd_job_read_only(job), 1);
  assert_int_equal(zd_job_version(job), 9);
  zd_close(client);
  fake_join(fake);
  assert_false(fake->attach_pin);
  fake_destroy(fake);

  fake = fake_create();
  fake_start(fake);
  client = connect_to(fake);
  job = attach_job(client);
  assert_int_equal(zd_job_read_only(job), 0);
  assert_int_equal(zd_job_read_only(NULL), 0);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->attach_mode, ZEROD__V1__ATTACH_MODE__ATTACH_READ_WRITE);
  fake_destroy(fake);
}

static void test_attach_reply_with_the_other_mode_is_a_protocol_error(void **state) {
  fake_daemon *fake = fake_create();
  fake->attach_read_only_lie = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "test";
  options.read_only = 1;
  zd_job *job = NULL;
  assert_int_equal(zd_attach(client, &options, &job), ZD_E_PROTOCOL);
  assert_null(job);
  assert_message_contains("asked for a read-only attachment, the reply says read-write");
  zd_close(client);
  fake_destroy(fake);
}

static void test_read_only_job_refuses_writes_without_asking(void **state) {
  fake_daemon *fake = fake_create();
  fake->units_registered = 1;
  snprintf(fake->unit_names[0], sizeof fake->unit_names[0], "embed");
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 0, 0);
  assert_int_equal(zd_list_units(job, NULL), ZD_OK);

  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "layer9";
  desc.tensors = unit_tensors;
  desc.ntensors = 2;
  desc.init = ZD_INIT_ZEROS;
  zd_unit unit;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_PERMISSION_DENIED);
  assert_message_contains("register unit layer9: job test is attached read-only");
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_grad_buffer(job, 0, &view), ZD_E_PERMISSION_DENIED);
  assert_message_contains("grad buffer unit 0: job test is attached read-only");
  assert_int_equal(zd_reduce(job, 0), ZD_E_PERMISSION_DENIED);
  assert_message_contains("reduce unit 0");
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_PERMISSION_DENIED);
  assert_message_contains("step: job test is attached read-only");
  float values[18] = {0};
  assert_int_equal(zd_load_unit(job, 0, values, NULL), ZD_E_PERMISSION_DENIED);
  assert_message_contains("load unit 0");

  /* Reading still works, through a read-only mapping. */
  gather_ok(job, 0, &view);
  assert_true(first_weight(&view) == 1000.0f);
  assert_string_equal(perms_at(view.base, fake, "gather-0"), "r--s");
  assert_int_equal(zd_release(job, 0), ZD_OK);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT], 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER], 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_REDUCE], 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_STEP], 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT], 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_GATHER], 1);
  fake_destroy(fake);
}

static void test_list_units_builds_the_unit_table(void **state) {
  fake_daemon *fake = fake_create();
  fake->units_registered = 2;
  fake->latest_version = 11;
  snprintf(fake->unit_names[0], sizeof fake->unit_names[0], "embed");
  snprintf(fake->unit_names[1], sizeof fake->unit_names[1], "block0");
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 0, 0);
  assert_int_equal(zd_job_unit_count(job), 0);
  zd_view view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, 1, &view), ZD_E_NOT_FOUND);
  assert_message_contains("no such unit known to this job");

  unsigned count = 0;
  assert_int_equal(zd_list_units(job, &count), ZD_OK);
  assert_int_equal(count, 2);
  assert_int_equal(zd_job_unit_count(job), 2);
  assert_int_equal(zd_job_version(job), 11);
  zd_unit_info info = ZD_UNIT_INFO_INIT;
  assert_int_equal(zd_job_unit_info(job, 0, &info), ZD_OK);
  assert_int_equal(info.unit, 0);
  assert_string_equal(info.name, "embed");
  assert_int_equal(zd_job_unit_info(job, 1, &info), ZD_OK);
  assert_int_equal(info.unit, 1);
  assert_string_equal(info.name, "block0");
  assert_int_equal(info.ntensors, 2);
  assert_int_equal(info.numel, UNIT_NUMEL);
  assert_int_equal(info.padded_numel, UNIT_PADDED_NUMEL);
  assert_int_equal(info.dtype, ZD_F32);
  assert_string_equal(info.tensors[0].name, "w");
  assert_int_equal(info.tensors[0].ndim, 2);
  assert_int_equal(info.tensors[0].shape[1], 5);
  assert_int_equal(info.tensors[0].offset, 0);
  assert_string_equal(info.tensors[1].name, "b");
  assert_int_equal(info.tensors[1].offset, BIAS_OFFSET);
  assert_int_equal(info.tensors[1].numel, 3);
  assert_null(info.tensors[0].data);
  assert_null(info.tensors[1].data);
  assert_int_equal(zd_job_unit_info(job, 2, &info), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("index 2 is past the 2 units");
  assert_int_equal(zd_job_unit_info(job, 0, NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_job_unit_info(NULL, 0, &info), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_job_unit_count(NULL), 0);

  /* A listed unit gathers like a registered one, and the layout's data
   * pointers stay NULL while the view's point into the buffer. */
  gather_ok(job, 1, &view);
  assert_true(first_weight(&view) == 2000.0f);
  assert_true(((const float *)view.tensors[1].data)[0] == 2000.0f + BIAS_OFFSET);
  assert_int_equal(zd_job_unit_info(job, 1, &info), ZD_OK);
  assert_null(info.tensors[1].data);
  assert_int_equal(zd_release(job, 1), ZD_OK);

  /* Listing again keeps the entries (views point into their tables). */
  const zd_tensor_view *tensors_before = view.tensors;
  assert_int_equal(zd_list_units(job, &count), ZD_OK);
  assert_int_equal(count, 2);
  gather_ok(job, 1, &view);
  assert_ptr_equal(view.tensors, tensors_before);
  zd_close(client);
  fake_destroy(fake);
}

static void test_registered_units_are_in_the_unit_table(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  register_unit(job, "layer0");
  register_unit(job, "layer1");
  assert_int_equal(zd_job_unit_count(job), 2);
  zd_unit_info info = ZD_UNIT_INFO_INIT;
  assert_int_equal(zd_job_unit_info(job, 1, &info), ZD_OK);
  assert_int_equal(info.unit, 1);
  assert_string_equal(info.name, "layer1");
  assert_int_equal(info.tensors[1].offset, BIAS_OFFSET);
  assert_int_equal(info.padded_numel, UNIT_PADDED_NUMEL);
  /* A read-write job may list too: the listing agrees, nothing is added. */
  unsigned count = 0;
  assert_int_equal(zd_list_units(job, &count), ZD_OK);
  assert_int_equal(count, 2);
  assert_int_equal(zd_job_unit_info(job, 0, &info), ZD_OK);
  assert_string_equal(info.name, "layer0");
  zd_close(client);
  fake_destroy(fake);
}

static void test_listing_is_checked_like_a_registration(void **state) {
  /* frame.c checks placements of a RegisterUnitReply, not of the units
   * nested in a UnitsReply: the client must. */
  fake_daemon *fake = fake_create();
  fake->units_registered = 1;
  fake->list_bad_placement = 1;
  snprintf(fake->unit_names[0], sizeof fake->unit_names[0], "embed");
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 0, 0);
  assert_int_equal(zd_list_units(job, NULL), ZD_E_PROTOCOL);
  assert_message_contains("unit 0 in the listing: tensor placement lies outside the unit");
  assert_int_equal(zd_job_unit_count(job), 0);
  zd_close(client);
  fake_destroy(fake);

  /* A listing that contradicts a unit the job registered. */
  fake = fake_create();
  fake_start(fake);
  client = connect_to(fake);
  job = attach_job(client);
  register_unit(job, "layer0");
  fake->list_other_layout = 1;
  assert_int_equal(zd_list_units(job, NULL), ZD_E_PROTOCOL);
  assert_message_contains("its layout differs from the unit this job knows");
  zd_close(client);
  fake_destroy(fake);
}

static void test_pin_moves_a_read_only_job_to_the_latest_version(void **state) {
  fake_daemon *fake = fake_create();
  fake->latest_version = 8;
  fake->pinned_version = 5;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 1, 0);
  assert_int_equal(zd_job_version(job), 5);
  uint64_t version = 0;
  assert_int_equal(zd_pin(job, &version), ZD_OK);
  assert_int_equal(version, 8);
  assert_int_equal(zd_job_version(job), 8);
  /* The listing reports the latest version; a pinned job keeps its own. */
  fake->latest_version = 12;
  assert_int_equal(zd_list_units(job, NULL), ZD_OK);
  assert_int_equal(zd_job_version(job), 8);
  assert_int_equal(zd_pin(job, NULL), ZD_OK);
  assert_int_equal(zd_job_version(job), 12);
  assert_int_equal(zd_pin(NULL, NULL), ZD_E_INVALID_ARGUMENT);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_PIN], 2);
  fake_destroy(fake);

  /* An unpinned read-only job is pinned from its first zd_pin on. */
  fake = fake_create();
  fake->latest_version = 4;
  fake_start(fake);
  client = connect_to(fake);
  job = attach_with(client, 1, 0, 0);
  assert_int_equal(zd_pin(job, &version), ZD_OK);
  assert_int_equal(version, 4);
  fake->latest_version = 6;
  assert_int_equal(zd_list_units(job, NULL), ZD_OK);
  assert_int_equal(zd_job_version(job), 4);
  zd_close(client);
  fake_destroy(fake);

  /* A read-write job follows its own steps: refused locally. */
  fake = fake_create();
  fake_start(fake);
  client = connect_to(fake);
  job = attach_job(client);
  assert_int_equal(zd_pin(job, &version), ZD_E_FAILED_PRECONDITION);
  assert_message_contains("pin job test: only read-only jobs pin a version");
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_PIN], 0);
  fake_destroy(fake);
}

static void test_load_unit_sends_rank0_values_in_a_memfd(void **state) {
  fake_daemon *fake = fake_create();
  fake->latest_version = 3;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  register_unit(job, "layer0");
  zd_unit unit = register_unit(job, "layer1");
  /* Rank 0 must give the values. */
  assert_int_equal(zd_load_unit(job, unit, NULL, NULL), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("load unit 1: rank 0 must pass the unit's values");
  assert_int_equal(zd_load_unit(job, 42, NULL, NULL), ZD_E_NOT_FOUND);
  assert_int_equal(zd_load_unit(NULL, unit, NULL, NULL), ZD_E_INVALID_ARGUMENT);
  float values[18];
  for (int i = 0; i < 18; i++)
    values[i] = 100.0f + (float)i;
  uint64_t version = 0;
  assert_int_equal(zd_load_unit(job, unit, values, &version), ZD_OK);
  assert_int_equal(version, 4);
  assert_int_equal(zd_job_version(job), 4);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT], 1);
  assert_int_equal(fake->load_fd_count, 1);
  assert_true(fake->load_values_match);
  assert_int_equal(fake->load_unit, 1);
  fake_destroy(fake);
}

static void test_load_unit_on_other_ranks_sends_no_values(void **state) {
  fake_daemon *fake = fake_create();
  fake->latest_version = 3;
  fake->attach_rank = 1;
  fake->attach_world_size = 2;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  assert_int_equal(zd_job_rank(job), 1);
  zd_unit unit = register_unit(job, "layer0");
  uint64_t version = 0;
  assert_int_equal(zd_load_unit(job, unit, NULL, &version), ZD_OK);
  assert_int_equal(version, 4);
  /* Values given on another rank are ignored, not sent. */
  float values[18] = {0};
  assert_int_equal(zd_load_unit(job, unit, values, NULL), ZD_OK);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->init_fd_count, 0);
  assert_int_equal(fake->frames_by_type[ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT], 2);
  assert_int_equal(fake->load_fd_count, 0);
  fake_destroy(fake);
}

static void test_dropped_buffers_are_unmapped(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit first = register_unit(job, "layer0");
  zd_unit second = register_unit(job, "layer1");
  zd_view view = ZD_VIEW_INIT;
  gather_ok(job, first, &view);
  assert_int_equal(zd_release(job, first), ZD_OK);
  zd_view grad = ZD_VIEW_INIT;
  assert_int_equal(zd_grad_buffer(job, second, &grad), ZD_OK);
  assert_int_equal(zd_reduce(job, second), ZD_OK);
  assert_int_equal(mappings_of(fake, "gather-0"), 2);
  assert_int_equal(mappings_of(fake, "grad-1"), 2);

  /* A gather reply drops the released gathered buffer, a gradient reply
   * the reduced gradient buffer. */
  fake->drop_ids[0] = BUFFER_ID + first;
  fake->ndrop_ids = 1;
  gather_ok(job, second, &view);
  assert_int_equal(mappings_of(fake, "gather-0"), 1);
  assert_int_equal(zd_release(job, second), ZD_OK);
  fake->drop_ids[0] = BUFFER_ID + second;
  fake->ndrop_ids = 1;
  assert_int_equal(zd_grad_buffer(job, first, &grad), ZD_OK);
  assert_int_equal(mappings_of(fake, "grad-1"), 1);
  assert_int_equal(mappings_of(fake, "gather-1"), 1);
  assert_int_equal(zd_reduce(job, first), ZD_OK);

  /* The id was forgotten: the daemon sends the buffer again, and it is
   * mapped afresh. */
  gather_ok(job, first, &view);
  assert_true(first_weight(&view) == 1000.0f);
  assert_int_equal(mappings_of(fake, "gather-0"), 2);
  zd_close(client);
  assert_int_equal(mappings_of(fake, "gather-0"), 1);
  fake_destroy(fake);
}

static void test_dropped_buffer_a_view_still_uses_is_kept(void **state) {
  /* A daemon must not drop a buffer the session holds; if one does, the
   * worker's views keep working rather than crash. */
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit first = register_unit(job, "layer0");
  zd_unit second = register_unit(job, "layer1");
  zd_view gathered = ZD_VIEW_INIT;
  gather_ok(job, first, &gathered);
  zd_view grad = ZD_VIEW_INIT;
  fake->drop_ids[0] = BUFFER_ID + first;
  fake->ndrop_ids = 1;
  assert_int_equal(zd_grad_buffer(job, second, &grad), ZD_OK);
  assert_int_equal(mappings_of(fake, "gather-0"), 2);
  assert_true(first_weight(&gathered) == 1000.0f);
  fake->drop_ids[0] = BUFFER_ID + second;
  fake->ndrop_ids = 1;
  zd_view other = ZD_VIEW_INIT;
  gather_ok(job, second, &other);
  assert_int_equal(mappings_of(fake, "grad-1"), 2);
  ((float *)grad.tensors[1].data)[0] = 4.0f;
  assert_int_equal(zd_reduce(job, second), ZD_OK);
  assert_true(fake->reduce_grad_sum == 4.0f);
  zd_close(client);
  fake_destroy(fake);
}

static void test_stable_addresses_keep_a_unit_at_one_address(void **state) {
  fake_daemon *fake = fake_create();
  fake->alternate_gather_buffers = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 0, 0, 1);
  zd_unit unit = register_unit(job, "layer0");
  register_unit(job, "layer1");

  zd_view first = ZD_VIEW_INIT;
  gather_ok(job, unit, &first); /* buffer ALT_BUFFER_ID */
  assert_true(first_weight(&first) == 5000.0f);
  assert_string_equal(perms_at(first.base, fake, "alt-0"), "r--s");
  assert_ptr_equal(first.tensors[1].data, (float *)first.base + BIAS_OFFSET);
  assert_int_equal(first.bytes, BUFFER_BYTES);
  void *base = first.base;
  assert_int_equal(zd_release(job, unit), ZD_OK);
  /* Released: the range is inaccessible and maps no daemon memory, but the
   * descriptor is kept to map the buffer again. */
  assert_string_equal(perms_at(base, fake, NULL), "---p");
  assert_int_equal(mappings_of(fake, "alt-0"), 1);
  assert_int_equal(descriptors_of(fake, "alt-0"), 2);

  zd_view second = ZD_VIEW_INIT;
  gather_ok(job, unit, &second); /* buffer BUFFER_ID: another id, same address */
  assert_ptr_equal(second.base, base);
  assert_ptr_equal(second.tensors[0].data, base);
  assert_true(first_weight(&second) == 1000.0f);
  assert_true(((const float *)second.tensors[1].data)[2] == 1000.0f + BIAS_OFFSET + 2);
  assert_string_equal(perms_at(base, fake, "gather-0"), "r--s");
  /* Shared memory: the daemon's writes show through. */
  fake->gathered[0][1] = -2.0f;
  assert_true(((const float *)second.tensors[0].data)[1] == -2.0f);

  /* Gathering again without a release (this fake allows it) into the same
   * buffer keeps the mapping. */
  fake->alternate_gather_buffers = 0;
  zd_view again = ZD_VIEW_INIT;
  gather_ok(job, unit, &again);
  assert_ptr_equal(again.base, base);
  assert_true(first_weight(&again) == 1000.0f);
  assert_string_equal(perms_at(base, fake, "gather-0"), "r--s");
  assert_int_equal(zd_release(job, unit), ZD_OK);
  assert_string_equal(perms_at(base, fake, NULL), "---p");

  /* Another unit has a range of its own. */
  zd_view other = ZD_VIEW_INIT;
  gather_ok(job, 1, &other);
  assert_ptr_not_equal(other.base, base);
  assert_true(first_weight(&other) == 2000.0f);
  assert_int_equal(zd_release(job, 1), ZD_OK);

  /* Gradient views are unaffected (mapped once, read-write). */
  zd_view grad = ZD_VIEW_INIT;
  assert_int_equal(zd_grad_buffer(job, unit, &grad), ZD_OK);
  assert_string_equal(perms_at(grad.base, fake, "grad-0"), "rw-s");
  assert_int_equal(zd_reduce(job, unit), ZD_OK);

  /* Re-gathering restores access. */
  fake->alternate_gather_buffers = 1;
  gather_ok(job, unit, &again);
  assert_ptr_equal(again.base, base);
  assert_true(first_weight(&again) == 5000.0f);
  assert_string_equal(perms_at(base, fake, "alt-0"), "r--s");

  /* zd_close unmaps the ranges and closes the kept descriptors. */
  zd_close(client);
  assert_int_equal(mappings_of(fake, "alt-0"), 1);
  assert_int_equal(descriptors_of(fake, "alt-0"), 1);
  assert_int_equal(descriptors_of(fake, "gather-0"), 1);
  assert_int_equal(descriptors_of(fake, "gather-1"), 1);
  fake_destroy(fake);
}

static void test_stable_addresses_close_dropped_descriptors(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 0, 0, 1);
  zd_unit first = register_unit(job, "layer0");
  zd_unit second = register_unit(job, "layer1");
  zd_view view = ZD_VIEW_INIT;
  gather_ok(job, first, &view);
  void *base = view.base;
  assert_int_equal(zd_release(job, first), ZD_OK);
  assert_int_equal(descriptors_of(fake, "gather-0"), 2);
  fake->drop_ids[0] = BUFFER_ID + first;
  fake->ndrop_ids = 1;
  gather_ok(job, second, &view);
  assert_int_equal(descriptors_of(fake, "gather-0"), 1);
  assert_int_equal(zd_release(job, second), ZD_OK);
  /* The daemon sends the buffer again; the unit's address is the same. */
  gather_ok(job, first, &view);
  assert_ptr_equal(view.base, base);
  assert_true(first_weight(&view) == 1000.0f);
  assert_int_equal(descriptors_of(fake, "gather-0"), 2);
  zd_close(client);
  assert_int_equal(descriptors_of(fake, "gather-0"), 1);
  fake_destroy(fake);
}

static void test_stable_addresses_on_a_read_only_job(void **state) {
  fake_daemon *fake = fake_create();
  fake->alternate_gather_buffers = 1;
  fake->units_registered = 1;
  snprintf(fake->unit_names[0], sizeof fake->unit_names[0], "embed");
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 1, 1);
  assert_int_equal(zd_list_units(job, NULL), ZD_OK);
  zd_view first = ZD_VIEW_INIT, second = ZD_VIEW_INIT;
  gather_ok(job, 0, &first);
  assert_int_equal(zd_release(job, 0), ZD_OK);
  assert_string_equal(perms_at(first.base, fake, NULL), "---p");
  gather_ok(job, 0, &second);
  assert_ptr_equal(second.base, first.base);
  assert_true(first_weight(&second) == 1000.0f);
  assert_string_equal(perms_at(second.base, fake, "gather-0"), "r--s");
  zd_close(client);
  fake_destroy(fake);
}

static void test_without_stable_addresses_each_buffer_keeps_its_mapping(void **state) {
  fake_daemon *fake = fake_create();
  fake->alternate_gather_buffers = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view first = ZD_VIEW_INIT, second = ZD_VIEW_INIT, third = ZD_VIEW_INIT;
  gather_ok(job, unit, &first);
  assert_int_equal(zd_release(job, unit), ZD_OK);
  gather_ok(job, unit, &second);
  assert_int_equal(zd_release(job, unit), ZD_OK);
  /* Two buffers, two cached mappings; released ones stay mapped, and the
   * descriptors are closed once mapped. */
  assert_ptr_not_equal(first.base, second.base);
  assert_string_equal(perms_at(first.base, fake, "alt-0"), "r--s");
  assert_string_equal(perms_at(second.base, fake, "gather-0"), "r--s");
  assert_int_equal(descriptors_of(fake, "alt-0"), 1);
  assert_int_equal(descriptors_of(fake, "gather-0"), 1);
  gather_ok(job, unit, &third);
  assert_ptr_equal(third.base, first.base);
  assert_true(first_weight(&third) == 5000.0f);
  assert_int_equal(mappings_of(fake, "alt-0"), 2);
  zd_close(client);
  assert_int_equal(mappings_of(fake, "alt-0"), 1);
  assert_int_equal(mappings_of(fake, "gather-0"), 1);
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
  zd_tensor_desc zero_dim[1] = {{.struct_size = sizeof(zd_tensor_desc),
                                 .name = "z",
                                 .shape = (const uint64_t[]){4, 0},
                                 .ndim = 2}};
  desc.tensors = zero_dim;
  desc.ntensors = 1;
  desc.init = ZD_INIT_ZEROS;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_register_unit(job, NULL, &unit), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_register_unit(NULL, &desc, &unit), ZD_E_INVALID_ARGUMENT);

  zd_view view = ZD_VIEW_INIT;
  zd_pending pending = ZD_PENDING_INIT;
  assert_int_equal(zd_gather(job, 42, &view), ZD_E_NOT_FOUND);
  assert_message_contains("gather unit 42");
  assert_int_equal(zd_gather(job, 0, NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_gather(NULL, 0, &view), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_gather_async(job, 0, NULL), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_gather_wait(job, NULL, &view), ZD_E_INVALID_ARGUMENT);
  pending.request_id = 12345;
  pending.unit = 42;
  assert_int_equal(zd_gather_wait(job, &pending, &view), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_release(job, 42), ZD_E_NOT_FOUND);
  assert_int_equal(zd_release(NULL, 0), ZD_E_INVALID_ARGUMENT);
  assert_int_equal(zd_grad_buffer(job, 42, &view), ZD_E_NOT_FOUND);
  assert_int_equal(zd_reduce(job, 42), ZD_E_NOT_FOUND);
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
  /* No test here may depend on whether this machine has a GPU. */
  setenv("ZEROD_CUDA_MODULE", "/nonexistent/libzerod_cuda.so", 1);
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
      cmocka_unit_test(test_release_error_the_library_cannot_foresee_is_deferred),
      cmocka_unit_test(test_async_reduce_waits_for_nothing_and_defers_its_error),
      cmocka_unit_test(test_shutdown_notice_makes_calls_unavailable),
      cmocka_unit_test(test_undecodable_reply_is_a_protocol_error),
      cmocka_unit_test(test_gather_of_unseen_buffer_without_fd_is_a_protocol_error),
      cmocka_unit_test(test_gpu_buffer_without_cuda_fails_with_the_reason),
      cmocka_unit_test(test_gpu_buffer_with_a_descriptor_too_is_a_protocol_error),
      cmocka_unit_test(test_read_only_attach_sends_mode_and_pin),
      cmocka_unit_test(test_attach_keeps_the_jobs_config_and_the_daemons_warning),
      cmocka_unit_test(test_attach_reply_with_the_other_mode_is_a_protocol_error),
      cmocka_unit_test(test_read_only_job_refuses_writes_without_asking),
      cmocka_unit_test(test_list_units_builds_the_unit_table),
      cmocka_unit_test(test_registered_units_are_in_the_unit_table),
      cmocka_unit_test(test_listing_is_checked_like_a_registration),
      cmocka_unit_test(test_pin_moves_a_read_only_job_to_the_latest_version),
      cmocka_unit_test(test_load_unit_sends_rank0_values_in_a_memfd),
      cmocka_unit_test(test_load_unit_on_other_ranks_sends_no_values),
      cmocka_unit_test(test_dropped_buffers_are_unmapped),
      cmocka_unit_test(test_dropped_buffer_a_view_still_uses_is_kept),
      cmocka_unit_test(test_stable_addresses_keep_a_unit_at_one_address),
      cmocka_unit_test(test_stable_addresses_close_dropped_descriptors),
      cmocka_unit_test(test_stable_addresses_on_a_read_only_job),
      cmocka_unit_test(test_without_stable_addresses_each_buffer_keeps_its_mapping),
      cmocka_unit_test(test_invalid_arguments_are_refused),
      cmocka_unit_test(test_every_status_has_a_name),
      cmocka_unit_test(test_last_error_is_per_thread),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
