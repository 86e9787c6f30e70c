/* The IPC framing (proto/frame.c): every message type survives encode,
 * send, read and unpack with 0, 1 and 4 memfds; frames arrive whole however
 * the bytes are split, with their own descriptors; and each class of
 * malformed input is refused with its own error, closing what it received
 * and allocating nothing beyond the caps. Everything runs over a real
 * socketpair(AF_UNIX, SOCK_STREAM). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "frame.h"

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

/* sock[0] writes, sock[1] reads; the reader may be non-blocking. */
static void make_pair(int sock[2], bool nonblocking_reader) {
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sock), 0);
  if (nonblocking_reader)
    assert_int_equal(fcntl(sock[1], F_SETFL, fcntl(sock[1], F_GETFL) | O_NONBLOCK), 0);
}

static void close_pair(int sock[2]) {
  close(sock[0]);
  close(sock[1]);
}

/* Descriptors open in this process, to show that refused frames leave no
 * received descriptor behind. */
static int count_open_fds(void) {
  DIR *dir = opendir("/proc/self/fd");
  assert_non_null(dir);
  int count = 0;
  for (struct dirent *entry; (entry = readdir(dir)) != NULL;)
    if (entry->d_name[0] != '.')
      count++;
  closedir(dir);
  return count - 1; /* the directory's own descriptor */
}

static int make_memfd(const char *content) {
  int fd = memfd_create("test_frame", MFD_CLOEXEC);
  assert_true(fd >= 0);
  size_t len = strlen(content);
  assert_int_equal(write(fd, content, len), (ssize_t)len);
  return fd;
}

/* A received descriptor must be the very file that was sent (same inode),
 * hold its content, and be close-on-exec (MSG_CMSG_CLOEXEC). */
static void expect_same_memfd(int received, int sent, const char *content) {
  struct stat received_stat, sent_stat;
  assert_int_equal(fstat(received, &received_stat), 0);
  assert_int_equal(fstat(sent, &sent_stat), 0);
  assert_true(received_stat.st_ino == sent_stat.st_ino);
  assert_true(received_stat.st_dev == sent_stat.st_dev);
  char buf[64] = {0};
  size_t len = strlen(content);
  assert_int_equal(pread(received, buf, sizeof buf - 1, 0), (ssize_t)len);
  assert_string_equal(buf, content);
  assert_true(fcntl(received, F_GETFD) & FD_CLOEXEC);
}

/* Sends raw bytes, with fds on the first sendmsg, as a hostile or broken
 * peer would. */
static void send_raw(int sock, const void *bytes, size_t len, const int *fds, unsigned nfds) {
  union {
    struct cmsghdr align;
    char bytes[CMSG_SPACE(sizeof(int) * 8)];
  } control;
  memset(&control, 0, sizeof control);
  struct iovec iov = {.iov_base = (void *)bytes, .iov_len = len};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  if (nfds > 0) {
    msg.msg_control = control.bytes;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * nfds);
  }
  assert_int_equal(sendmsg(sock, &msg, MSG_NOSIGNAL), (ssize_t)len);
}

static zd_frame_header valid_header(uint16_t type, uint32_t payload_bytes, uint8_t fd_count) {
  zd_frame_header header = {.magic = ZD_FRAME_MAGIC,
                            .version = ZD_FRAME_VERSION,
                            .type = type,
                            .request_id = 77,
                            .payload_bytes = payload_bytes,
                            .fd_count = fd_count};
  return header;
}

static void send_header(int sock, const zd_frame_header *header, const int *fds, unsigned nfds) {
  uint8_t bytes[ZD_FRAME_HEADER_BYTES];
  zd_frame_header_encode(header, bytes);
  send_raw(sock, bytes, sizeof bytes, fds, nfds);
}

static void expect_why(const char *why, const char *part) {
  if (why == NULL || strstr(why, part) == NULL)
    fail_msg("expected an error message containing \"%s\", got \"%s\"", part, why ? why : "(null)");
}

/* Reads one frame from a blocking socket. */
static int read_frame(zd_frame_reader *reader, int sock, const char **why) {
  int rc;
  while ((rc = zd_frame_read(reader, sock, why)) == 0)
    ;
  return rc;
}

/* The reader's answer to one header sent by a broken peer, with the
 * descriptors it received already closed. */
static int read_after_header(const zd_frame_header *header, const int *fds, unsigned nfds,
                             zd_frame_reader *reader, const char **why) {
  int sock[2];
  make_pair(sock, false);
  send_header(sock[0], header, fds, nfds);
  zd_frame_reader_init(reader);
  int rc = read_frame(reader, sock[1], why);
  close_pair(sock);
  return rc;
}

static uint8_t *pack(const ProtobufCMessage *msg, size_t *len) {
  *len = protobuf_c_message_get_packed_size(msg);
  uint8_t *bytes = malloc(*len ? *len : 1);
  assert_non_null(bytes);
  assert_int_equal(protobuf_c_message_pack(msg, bytes), *len);
  return bytes;
}

/* zd_msg_unpack of msg packed as `type`, expecting rc; the message is freed
 * either way. */
static int unpack_packed(uint16_t type, const ProtobufCMessage *msg, const char **why) {
  size_t len;
  uint8_t *bytes = pack(msg, &len);
  ProtobufCMessage *out = (ProtobufCMessage *)1;
  int rc = zd_msg_unpack(type, bytes, len, &out, why);
  if (rc == 0)
    protobuf_c_message_free_unpacked(out, NULL);
  else
    assert_null(out);
  free(bytes);
  return rc;
}

/* ------------------------------------------------------------------------
 * One sample of every message, with every field set
 * ------------------------------------------------------------------------ */

typedef struct samples {
  Zerod__V1__Error error;
  Zerod__V1__Notice notice;
  Zerod__V1__OptimizerConfig optimizer;
  Zerod__V1__JobConfig config;
  Zerod__V1__AttachRequest attach;
  Zerod__V1__AttachReply attach_reply;
  uint64_t weight_shape[2];
  uint64_t bias_shape[1];
  uint32_t dropped_ids[3];
  Zerod__V1__TensorSpec weight, bias;
  Zerod__V1__TensorSpec *tensors[2];
  Zerod__V1__RegisterUnitRequest register_unit;
  Zerod__V1__TensorPlacement weight_at, bias_at;
  Zerod__V1__TensorPlacement *placements[2];
  Zerod__V1__RegisterUnitReply register_unit_reply;
  Zerod__V1__GatherRequest gather;
  uint8_t mem_handle[ZD_CUDA_IPC_HANDLE_BYTES], event_handle[ZD_CUDA_IPC_HANDLE_BYTES];
  Zerod__V1__CudaBuffer cuda;
  Zerod__V1__GatherReply gather_reply;
  Zerod__V1__ReleaseRequest release;
  Zerod__V1__ReleaseReply release_reply;
  Zerod__V1__GradBufferRequest grad_buffer;
  Zerod__V1__GradBufferReply grad_buffer_reply;
  Zerod__V1__ReduceRequest reduce;
  Zerod__V1__ReduceReply reduce_reply;
  Zerod__V1__StepRequest step;
  Zerod__V1__StepReply step_reply;
  Zerod__V1__DetachRequest detach;
  Zerod__V1__DetachReply detach_reply;
  Zerod__V1__StatsRequest stats;
  Zerod__V1__StatsReply stats_reply;
  Zerod__V1__RankStats rank_stats, *rank_stats_list[1];
  Zerod__V1__ReadStateRequest read_state;
  Zerod__V1__ReadStateReply read_state_reply;
  Zerod__V1__SetGroupsRequest set_groups;
  Zerod__V1__OptimizerConfig group, *group_list[1];
  Zerod__V1__UnitGroups unit_groups, *unit_groups_list[1];
  uint32_t tensor_group[3];
  Zerod__V1__SetGroupsReply set_groups_reply;
  Zerod__V1__GradNormRequest grad_norm;
  Zerod__V1__GradNormReply grad_norm_reply;
  Zerod__V1__CheckpointRequest checkpoint;
  Zerod__V1__CheckpointReply checkpoint_reply;
  Zerod__V1__CollectiveCounter counter, *counter_list[1];
} samples;

static void init_samples(samples *s) {
  zerod__v1__error__init(&s->error);
  s->error.status = ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED;
  s->error.message = "gather needs 4194304 bytes, 1048576 of max_live_bytes 4194304 left";
  zerod__v1__notice__init(&s->notice);
  s->notice.status = ZEROD__V1__STATUS__STATUS_UNAVAILABLE;
  s->notice.message = "daemon shutting down";

  zerod__v1__optimizer_config__init(&s->optimizer);
  s->optimizer.kind = ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD;
  s->optimizer.lr = 0.1;
  s->optimizer.beta1 = 0.8;
  s->optimizer.beta2 = 0.99;
  s->optimizer.eps = 1e-6;
  s->optimizer.weight_decay = 0;
  s->optimizer.has_weight_decay = 1;
  s->optimizer.momentum = 0.9;
  s->optimizer.dampening = 0.1;
  s->optimizer.nesterov = 1;
  zerod__v1__job_config__init(&s->config);
  s->config.optimizer = &s->optimizer;
  s->config.working_dtype = ZEROD__V1__DTYPE__DTYPE_BF16;
  s->config.max_live_bytes = 1ull << 33;
  s->config.max_grad_norm = 1.0;

  zerod__v1__attach_request__init(&s->attach);
  s->attach.protocol_version = 1;
  s->attach.job = "llama-7b.run_3";
  s->attach.local_rank = 2;
  s->attach.token = "owner-token";
  s->attach.mode = ZEROD__V1__ATTACH_MODE__ATTACH_READ_ONLY;
  s->attach.create = 1;
  s->attach.config = &s->config;
  zerod__v1__attach_reply__init(&s->attach_reply);
  s->attach_reply.job_id = 42;
  s->attach_reply.rank = 5;
  s->attach_reply.world_size = 8;
  s->attach_reply.version = 1000;
  s->attach_reply.config = &s->config;
  s->attach_reply.created = 1;

  s->weight_shape[0] = 4096;
  s->weight_shape[1] = 1024;
  s->bias_shape[0] = 1024;
  zerod__v1__tensor_spec__init(&s->weight);
  s->weight.name = "layers.0.mlp.weight";
  s->weight.n_shape = 2;
  s->weight.shape = s->weight_shape;
  zerod__v1__tensor_spec__init(&s->bias);
  s->bias.name = "layers.0.mlp.bias";
  s->bias.n_shape = 1;
  s->bias.shape = s->bias_shape;
  s->bias.frozen = 1;
  s->tensors[0] = &s->weight;
  s->tensors[1] = &s->bias;
  zerod__v1__register_unit_request__init(&s->register_unit);
  s->register_unit.name = "layers.0";
  s->register_unit.n_tensors = 2;
  s->register_unit.tensors = s->tensors;
  s->register_unit.init = ZEROD__V1__INIT_MODE__INIT_SEEDED_NORMAL;
  s->register_unit.seed = 1234;
  s->register_unit.init_std = 0.02;

  zerod__v1__tensor_placement__init(&s->weight_at);
  s->weight_at.name = "layers.0.mlp.weight";
  s->weight_at.n_shape = 2;
  s->weight_at.shape = s->weight_shape;
  s->weight_at.offset = 0;
  s->weight_at.numel = 4096 * 1024;
  zerod__v1__tensor_placement__init(&s->bias_at);
  s->bias_at.name = "layers.0.mlp.bias";
  s->bias_at.n_shape = 1;
  s->bias_at.shape = s->bias_shape;
  s->bias_at.offset = 4096 * 1024;
  s->bias_at.numel = 1024;
  s->placements[0] = &s->weight_at;
  s->placements[1] = &s->bias_at;
  zerod__v1__register_unit_reply__init(&s->register_unit_reply);
  s->register_unit_reply.unit_id = 3;
  s->register_unit_reply.numel = 4096 * 1024 + 1024;
  s->register_unit_reply.padded_numel = 4096 * 1024 + 2048;
  s->register_unit_reply.shard_numel = (4096 * 1024 + 2048) / 8;
  s->register_unit_reply.n_tensors = 2;
  s->register_unit_reply.tensors = s->placements;
  s->register_unit_reply.working_dtype = ZEROD__V1__DTYPE__DTYPE_BF16;
  s->register_unit_reply.grad_dtype = ZEROD__V1__DTYPE__DTYPE_F32;
  s->register_unit_reply.existed = 1;

  zerod__v1__gather_request__init(&s->gather);
  s->gather.unit_id = 3;
  zerod__v1__gather_reply__init(&s->gather_reply);
  s->gather_reply.unit_id = 3;
  s->gather_reply.buffer_id = 9;
  s->gather_reply.buffer_bytes = 8392704;
  s->gather_reply.version = 1000;
  s->dropped_ids[0] = 4;
  s->dropped_ids[1] = 5;
  s->dropped_ids[2] = 70000;
  s->gather_reply.n_dropped_buffer_ids = 3;
  s->gather_reply.dropped_buffer_ids = s->dropped_ids;
  zerod__v1__cuda_buffer__init(&s->cuda);
  for (int i = 0; i < ZD_CUDA_IPC_HANDLE_BYTES; i++) {
    s->mem_handle[i] = (uint8_t)(i * 7 + 1);
    s->event_handle[i] = (uint8_t)(255 - i);
  }
  s->cuda.mem_handle.data = s->mem_handle;
  s->cuda.mem_handle.len = sizeof s->mem_handle;
  s->cuda.device = 3;
  s->cuda.event_handle.data = s->event_handle;
  s->cuda.event_handle.len = sizeof s->event_handle;
  s->gather_reply.cuda = &s->cuda;
  zerod__v1__release_request__init(&s->release);
  s->release.unit_id = 3;
  zerod__v1__release_reply__init(&s->release_reply);
  zerod__v1__grad_buffer_request__init(&s->grad_buffer);
  s->grad_buffer.unit_id = 3;
  zerod__v1__grad_buffer_reply__init(&s->grad_buffer_reply);
  s->grad_buffer_reply.unit_id = 3;
  s->grad_buffer_reply.buffer_id = 10;
  s->grad_buffer_reply.buffer_bytes = 16785408;
  s->grad_buffer_reply.n_dropped_buffer_ids = 1;
  s->grad_buffer_reply.dropped_buffer_ids = s->dropped_ids;
  s->grad_buffer_reply.cuda = &s->cuda;
  zerod__v1__reduce_request__init(&s->reduce);
  s->reduce.unit_id = 3;
  zerod__v1__reduce_reply__init(&s->reduce_reply);
  s->reduce_reply.unit_id = 3;
  zerod__v1__step_request__init(&s->step);
  s->step.set_lr = 1;
  s->step.lr = 3e-4;
  s->step.set_max_grad_norm = 1;
  s->step.max_grad_norm = 0.5;
  s->step.grad_scale = 65536;
  zerod__v1__step_reply__init(&s->step_reply);
  s->step_reply.step = 1001;
  s->step_reply.version = 1001;
  s->step_reply.grad_norm = 2.5;
  s->step_reply.skipped = 1;
  zerod__v1__detach_request__init(&s->detach);
  zerod__v1__detach_reply__init(&s->detach_reply);
  zerod__v1__stats_request__init(&s->stats);
  zerod__v1__collective_counter__init(&s->counter);
  s->counter.level = "node";
  s->counter.collective = "all_gather";
  s->counter.bytes = 3ull << 33;
  s->counter.calls = 12;
  s->counter_list[0] = &s->counter;
  zerod__v1__rank_stats__init(&s->rank_stats);
  s->rank_stats.rank = 5;
  s->rank_stats.step = 77;
  s->rank_stats.n_counters = 1;
  s->rank_stats.counters = s->counter_list;
  s->rank_stats_list[0] = &s->rank_stats;
  zerod__v1__stats_reply__init(&s->stats_reply);
  s->stats_reply.n_ranks = 1;
  s->stats_reply.ranks = s->rank_stats_list;
  zerod__v1__read_state_request__init(&s->read_state);
  s->read_state.unit_id = 3;
  s->read_state.state = ZEROD__V1__UNIT_STATE__UNIT_STATE_MOMENT2;
  zerod__v1__read_state_reply__init(&s->read_state_reply);
  s->read_state_reply.unit_id = 3;
  s->read_state_reply.state = ZEROD__V1__UNIT_STATE__UNIT_STATE_MOMENT2;
  s->read_state_reply.step = 1001;
  s->read_state_reply.numel = 5ull << 30;
  zerod__v1__optimizer_config__init(&s->group);
  s->group.lr = 3e-4;
  s->group.has_weight_decay = 1;
  s->group_list[0] = &s->group;
  zerod__v1__unit_groups__init(&s->unit_groups);
  s->unit_groups.unit_id = 2;
  s->tensor_group[0] = 0;
  s->tensor_group[1] = 1;
  s->tensor_group[2] = 0;
  s->unit_groups.n_tensor_group = 3;
  s->unit_groups.tensor_group = s->tensor_group;
  s->unit_groups_list[0] = &s->unit_groups;
  zerod__v1__set_groups_request__init(&s->set_groups);
  s->set_groups.n_groups = 1;
  s->set_groups.groups = s->group_list;
  s->set_groups.n_units = 1;
  s->set_groups.units = s->unit_groups_list;
  zerod__v1__set_groups_reply__init(&s->set_groups_reply);
  s->set_groups_reply.groups = 2;
  zerod__v1__grad_norm_request__init(&s->grad_norm);
  s->grad_norm.grad_scale = 4;
  zerod__v1__grad_norm_reply__init(&s->grad_norm_reply);
  s->grad_norm_reply.grad_norm = 0.125;
  zerod__v1__checkpoint_request__init(&s->checkpoint);
  s->checkpoint.action = ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_RESTORE;
  s->checkpoint.name = "step-00000012";
  zerod__v1__checkpoint_reply__init(&s->checkpoint_reply);
  s->checkpoint_reply.name = "step-00000012";
  s->checkpoint_reply.step = 12;
  s->checkpoint_reply.stall_ms = 3;
  s->checkpoint_reply.total_ms = 41;
}

#define SAMPLE_TYPES 28

typedef struct typed_sample {
  uint16_t type;
  const ProtobufCMessage *msg;
} typed_sample;

static size_t all_samples(const samples *s, typed_sample out[SAMPLE_TYPES]) {
  const typed_sample table[] = {
      {ZEROD__V1__MSG_TYPE__MSG_ERROR, &s->error.base},
      {ZEROD__V1__MSG_TYPE__MSG_NOTICE, &s->notice.base},
      {ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s->attach.base},
      {ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, &s->attach_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s->register_unit.base},
      {ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, &s->register_unit_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_GATHER, &s->gather.base},
      {ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, &s->gather_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_RELEASE, &s->release.base},
      {ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY, &s->release_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER, &s->grad_buffer.base},
      {ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY, &s->grad_buffer_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_REDUCE, &s->reduce.base},
      {ZEROD__V1__MSG_TYPE__MSG_REDUCE_REPLY, &s->reduce_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_STEP, &s->step.base},
      {ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, &s->step_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_DETACH, &s->detach.base},
      {ZEROD__V1__MSG_TYPE__MSG_DETACH_REPLY, &s->detach_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_STATS, &s->stats.base},
      {ZEROD__V1__MSG_TYPE__MSG_STATS_REPLY, &s->stats_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_READ_STATE, &s->read_state.base},
      {ZEROD__V1__MSG_TYPE__MSG_READ_STATE_REPLY, &s->read_state_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS, &s->set_groups.base},
      {ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS_REPLY, &s->set_groups_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM, &s->grad_norm.base},
      {ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM_REPLY, &s->grad_norm_reply.base},
      {ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT, &s->checkpoint.base},
      {ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT_REPLY, &s->checkpoint_reply.base},
  };
  memcpy(out, table, sizeof table);
  return sizeof table / sizeof table[0];
}

/* ------------------------------------------------------------------------
 * Header
 * ------------------------------------------------------------------------ */

static void test_header_is_little_endian_in_wire_order(void **state) {
  zd_frame_header header = {.magic = ZD_FRAME_MAGIC,
                            .version = ZD_FRAME_VERSION,
                            .type = 0x0214,
                            .request_id = 0x0807060504030201ull,
                            .payload_bytes = 0x00030201,
                            .fd_count = 3,
                            .flags = ZD_FRAME_F_NO_REPLY};
  uint8_t bytes[ZD_FRAME_HEADER_BYTES];
  zd_frame_header_encode(&header, bytes);
  const uint8_t expected[ZD_FRAME_HEADER_BYTES] = {
      'Z', 'D', 'I', 'P', 1, 0, 0x14, 0x02, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 0, 3, 1, 0, 0};
  assert_memory_equal(bytes, expected, sizeof expected);
  zd_frame_header decoded;
  const char *why = "unset";
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), 0);
  assert_null(why);
  assert_memory_equal(&decoded, &header, sizeof header);
}

static void test_header_shorter_than_24_bytes_is_rejected(void **state) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0), decoded;
  uint8_t bytes[ZD_FRAME_HEADER_BYTES];
  zd_frame_header_encode(&header, bytes);
  const char *why;
  assert_int_equal(zd_frame_header_decode(bytes, 23, &decoded, &why), -EPROTO);
  expect_why(why, "shorter than 24");
}

static void test_header_checks_run_in_documented_order(void **state) {
  /* Bad in every field at once: the magic is what is reported. */
  zd_frame_header header = {.magic = 1,
                            .version = 9,
                            .payload_bytes = UINT32_MAX,
                            .fd_count = 200,
                            .flags = 0xff,
                            .reserved = 1},
                  decoded;
  uint8_t bytes[ZD_FRAME_HEADER_BYTES];
  const char *why;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EPROTO);
  expect_why(why, "magic");
  header.magic = ZD_FRAME_MAGIC;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EPROTO);
  expect_why(why, "version");
  header.version = ZD_FRAME_VERSION;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EMSGSIZE);
  header.payload_bytes = 0;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EPROTO);
  expect_why(why, "descriptors");
  header.fd_count = 0;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EPROTO);
  expect_why(why, "flag");
  header.flags = 0;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, &why), -EPROTO);
  expect_why(why, "reserved");
  header.reserved = 0;
  zd_frame_header_encode(&header, bytes);
  assert_int_equal(zd_frame_header_decode(bytes, sizeof bytes, &decoded, NULL), 0);
}

/* ------------------------------------------------------------------------
 * Types
 * ------------------------------------------------------------------------ */

static void test_fd_ranges_follow_the_protocol(void **state) {
  samples s;
  typed_sample table[SAMPLE_TYPES];
  init_samples(&s);
  size_t n = all_samples(&s, table);
  for (size_t i = 0; i < n; i++) {
    unsigned min_fds = 99, max_fds = 99;
    assert_int_equal(zd_msg_fd_range(table[i].type, &min_fds, &max_fds), 0);
    bool carries_fd = table[i].type == ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT ||
                      table[i].type == ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY ||
                      table[i].type == ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY ||
                      table[i].type == ZEROD__V1__MSG_TYPE__MSG_READ_STATE_REPLY;
    assert_int_equal(min_fds, 0);
    if (max_fds != (carries_fd ? 1u : 0u))
      fail_msg("type %u: expected at most %u fds, got %u", table[i].type, carries_fd ? 1 : 0,
               max_fds);
    assert_ptr_equal(zd_msg_descriptor(table[i].type), table[i].msg->descriptor);
  }
}

static void test_unknown_message_type_has_no_descriptor_and_does_not_unpack(void **state) {
  const uint16_t unknown[] = {ZEROD__V1__MSG_TYPE__MSG_NONE, 3, 15, 48, 0x7fff, 0xffff};
  for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
    assert_null(zd_msg_descriptor(unknown[i]));
    unsigned min_fds, max_fds;
    assert_int_equal(zd_msg_fd_range(unknown[i], &min_fds, &max_fds), -EPROTO);
    ProtobufCMessage *out = (ProtobufCMessage *)1;
    const char *why;
    assert_int_equal(zd_msg_unpack(unknown[i], NULL, 0, &out, &why), -EPROTO);
    assert_null(out);
    expect_why(why, "unknown message type");
    assert_int_equal(zd_frame_send(-1, unknown[i], 1, 0, NULL, NULL, 0, 0), -EINVAL);
  }

  /* The framing itself does not judge the type: the frame is read whole, so
   * the receiver can answer it by request id and go on. */
  int sock[2];
  make_pair(sock, false);
  zd_frame_header header = valid_header(99, 3, 0);
  uint8_t bytes[ZD_FRAME_HEADER_BYTES + 3] = {0};
  zd_frame_header_encode(&header, bytes);
  send_raw(sock[0], bytes, sizeof bytes, NULL, 0);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
  zd_frame_header got;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  zd_frame_reader_take(&reader, &got, &payload, fds, &nfds);
  assert_int_equal(got.type, 99);
  assert_int_equal(got.request_id, 77);
  free(payload);
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

/* ------------------------------------------------------------------------
 * Round trips
 * ------------------------------------------------------------------------ */

/* Sends msg with nfds fresh memfds, reads it back and checks header,
 * payload, message and descriptors. */
static void round_trip(int sock[2], uint16_t type, const ProtobufCMessage *msg, unsigned nfds) {
  int sent_fds[ZD_FRAME_MAX_FDS];
  char contents[ZD_FRAME_MAX_FDS][32];
  for (unsigned i = 0; i < nfds; i++) {
    snprintf(contents[i], sizeof contents[i], "type %u fd %u", type, i);
    sent_fds[i] = make_memfd(contents[i]);
  }
  uint64_t request_id = 1000 + type * 10 + nfds;
  assert_int_equal(
      zd_frame_send(sock[0], type, request_id, ZD_FRAME_F_NO_REPLY, msg, sent_fds, nfds, 1000), 0);

  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  const char *why = NULL;
  int rc = read_frame(&reader, sock[1], &why);
  if (rc != 1)
    fail_msg("type %u with %u fds: read returned %d (%s)", type, nfds, rc, why ? why : "");
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned got_nfds;
  zd_frame_reader_take(&reader, &header, &payload, fds, &got_nfds);
  assert_int_equal(header.type, type);
  assert_int_equal(header.request_id, request_id);
  assert_int_equal(header.flags, ZD_FRAME_F_NO_REPLY);
  assert_int_equal(header.fd_count, nfds);
  assert_int_equal(got_nfds, nfds);

  size_t expected_bytes;
  uint8_t *expected = pack(msg, &expected_bytes);
  assert_int_equal(header.payload_bytes, expected_bytes);
  if (expected_bytes > 0)
    assert_memory_equal(payload, expected, expected_bytes);

  ProtobufCMessage *out;
  rc = zd_msg_unpack(type, payload, header.payload_bytes, &out, &why);
  if (rc != 0)
    fail_msg("type %u: unpack returned %d (%s)", type, rc, why);
  assert_ptr_equal(out->descriptor, msg->descriptor);
  size_t repacked_bytes;
  uint8_t *repacked = pack(out, &repacked_bytes);
  assert_int_equal(repacked_bytes, expected_bytes);
  if (expected_bytes > 0)
    assert_memory_equal(repacked, expected, expected_bytes);

  for (unsigned i = 0; i < nfds; i++) {
    expect_same_memfd(fds[i], sent_fds[i], contents[i]);
    close(fds[i]);
    close(sent_fds[i]);
  }
  protobuf_c_message_free_unpacked(out, NULL);
  free(repacked);
  free(expected);
  free(payload);
  zd_frame_reader_reset(&reader);
}

static void test_every_message_type_round_trips_with_0_1_and_4_fds(void **state) {
  samples s;
  typed_sample table[SAMPLE_TYPES];
  init_samples(&s);
  size_t n = all_samples(&s, table);
  int open_before = count_open_fds();
  int sock[2];
  make_pair(sock, false);
  const unsigned fd_counts[] = {0, 1, 4};
  for (size_t i = 0; i < n; i++)
    for (size_t f = 0; f < 3; f++)
      round_trip(sock, table[i].type, table[i].msg, fd_counts[f]);
  close_pair(sock);
  assert_int_equal(count_open_fds(), open_before);
}

static void test_encoded_frame_equals_what_send_puts_on_the_wire(void **state) {
  samples s;
  typed_sample table[SAMPLE_TYPES];
  init_samples(&s);
  size_t n = all_samples(&s, table);
  int sock[2];
  make_pair(sock, false);
  for (size_t i = 0; i < n; i++) {
    uint8_t *frame;
    size_t frame_bytes;
    assert_int_equal(zd_frame_encode(table[i].type, 5, 0, 0, table[i].msg, &frame, &frame_bytes),
                     0);
    assert_int_equal(zd_frame_send(sock[0], table[i].type, 5, 0, table[i].msg, NULL, 0, -1), 0);
    uint8_t *wire = malloc(frame_bytes);
    assert_int_equal(recv(sock[1], wire, frame_bytes, MSG_WAITALL), (ssize_t)frame_bytes);
    assert_memory_equal(wire, frame, frame_bytes);
    zd_frame_header header;
    assert_int_equal(zd_frame_header_decode(frame, frame_bytes, &header, NULL), 0);
    assert_int_equal(header.payload_bytes, frame_bytes - ZD_FRAME_HEADER_BYTES);
    free(wire);
    free(frame);
  }
  close_pair(sock);
}

static void test_empty_message_sends_an_empty_payload(void **state) {
  int sock[2];
  make_pair(sock, false);
  assert_int_equal(zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_DETACH, 8, 0, NULL, NULL, 0, -1),
                   0);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.payload_bytes, 0);
  assert_null(payload);
  ProtobufCMessage *out;
  assert_int_equal(zd_msg_unpack(header.type, payload, 0, &out, NULL), 0);
  protobuf_c_message_free_unpacked(out, NULL);
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

/* Writes what it can of data, then lets the reader read, until all is
 * written; returns the reader's last answer. */
static int pump(int writer, const uint8_t *data, size_t len, zd_frame_reader *reader, int sock) {
  size_t written = 0;
  int rc = 0;
  while (written < len) {
    ssize_t n = send(writer, data + written, len - written, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0)
      written += (size_t)n;
    else
      assert_true(errno == EAGAIN);
    rc = zd_frame_read(reader, sock, NULL);
    if (rc != 0)
      return rc;
  }
  /* Everything is in the socket now; the reader may still be behind. */
  while (rc == 0)
    rc = zd_frame_read(reader, sock, NULL);
  return rc;
}

static void test_payload_at_the_cap_is_read_whole(void **state) {
  size_t frame_bytes = ZD_FRAME_HEADER_BYTES + ZD_FRAME_MAX_PAYLOAD;
  uint8_t *frame = malloc(frame_bytes);
  for (size_t i = 0; i < frame_bytes; i++)
    frame[i] = (uint8_t)(i * 31);
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_ERROR, ZD_FRAME_MAX_PAYLOAD, 0);
  zd_frame_header_encode(&header, frame);
  int sock[2];
  make_pair(sock, true);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  assert_int_equal(pump(sock[0], frame, frame_bytes, &reader, sock[1]), 1);
  zd_frame_header got;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  zd_frame_reader_take(&reader, &got, &payload, fds, &nfds);
  assert_int_equal(got.payload_bytes, ZD_FRAME_MAX_PAYLOAD);
  assert_memory_equal(payload, frame + ZD_FRAME_HEADER_BYTES, ZD_FRAME_MAX_PAYLOAD);
  free(payload);
  free(frame);
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

static void test_frame_split_into_1_byte_writes_is_ready_only_when_complete(void **state) {
  samples s;
  init_samples(&s);
  uint8_t *frame;
  size_t frame_bytes;
  assert_int_equal(zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, 11, 0, 2,
                                   &s.register_unit.base, &frame, &frame_bytes),
                   0);
  int sent_fds[2] = {make_memfd("first"), make_memfd("second")};
  int sock[2];
  make_pair(sock, true);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
  for (size_t i = 0; i < frame_bytes; i++) {
    /* The descriptors go with the first byte, as zd_frame_send sends them. */
    send_raw(sock[0], frame + i, 1, sent_fds, i == 0 ? 2 : 0);
    int rc = zd_frame_read(&reader, sock[1], NULL);
    if (rc != (i + 1 == frame_bytes ? 1 : 0))
      fail_msg("after byte %zu of %zu: read returned %d", i + 1, frame_bytes, rc);
  }
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(nfds, 2);
  expect_same_memfd(fds[0], sent_fds[0], "first");
  expect_same_memfd(fds[1], sent_fds[1], "second");
  assert_memory_equal(payload, frame + ZD_FRAME_HEADER_BYTES, header.payload_bytes);
  ProtobufCMessage *out;
  assert_int_equal(zd_msg_unpack(header.type, payload, header.payload_bytes, &out, NULL), 0);
  protobuf_c_message_free_unpacked(out, NULL);
  /* Nothing more is there: the next frame is not ready. */
  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
  assert_int_equal(reader.have, 0);
  for (int i = 0; i < 2; i++) {
    close(fds[i]);
    close(sent_fds[i]);
  }
  free(payload);
  free(frame);
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

static void test_back_to_back_frames_keep_their_own_fds(void **state) {
  samples s;
  init_samples(&s);
  int first[1] = {make_memfd("gathered")};
  int second[4] = {make_memfd("g0"), make_memfd("g1"), make_memfd("g2"), make_memfd("g3")};
  int sock[2];
  make_pair(sock, true);
  /* All three frames are queued before the reader looks at any. */
  assert_int_equal(zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 1, 0,
                                 &s.gather_reply.base, first, 1, -1),
                   0);
  assert_int_equal(zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY, 2, 0,
                                 &s.grad_buffer_reply.base, second, 4, -1),
                   0);
  assert_int_equal(zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, 3, 0,
                                 &s.step_reply.base, NULL, 0, -1),
                   0);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;

  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 1);
  assert_int_equal(nfds, 1);
  expect_same_memfd(fds[0], first[0], "gathered");
  close(fds[0]);
  free(payload);

  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 2);
  assert_int_equal(nfds, 4);
  const char *names[4] = {"g0", "g1", "g2", "g3"};
  for (int i = 0; i < 4; i++) {
    expect_same_memfd(fds[i], second[i], names[i]);
    close(fds[i]);
  }
  free(payload);

  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 3);
  assert_int_equal(nfds, 0);
  free(payload);
  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);

  close(first[0]);
  for (int i = 0; i < 4; i++)
    close(second[i]);
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

/* What a reader thread saw of two frames sent while it was reading. */
typedef struct threaded_read {
  int sock;
  int rc[2];
  zd_frame_header header[2];
  uint8_t *payload[2];
  int fds[2][ZD_FRAME_MAX_FDS];
  unsigned nfds[2];
} threaded_read;

static void *read_two_frames(void *arg) {
  threaded_read *r = arg;
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  for (int f = 0; f < 2; f++) {
    r->rc[f] = read_frame(&reader, r->sock, NULL);
    if (r->rc[f] != 1)
      break;
    zd_frame_reader_take(&reader, &r->header[f], &r->payload[f], r->fds[f], &r->nfds[f]);
  }
  zd_frame_reader_reset(&reader);
  return NULL;
}

/* A frame larger than the socket buffer goes out in many sendmsg calls; its
 * descriptors must go with the first only, so that they arrive with this
 * frame and none arrive with the next. */
static void test_frame_sent_in_pieces_carries_its_fds_once(void **state) {
  samples s;
  init_samples(&s);
  size_t text_bytes = 3u << 20;
  char *text = malloc(text_bytes + 1);
  memset(text, 'p', text_bytes);
  text[text_bytes] = '\0';
  s.error.message = text;
  int sent_fds[3] = {make_memfd("big 0"), make_memfd("big 1"), make_memfd("small")};
  int sock[2];
  make_pair(sock, false);
  assert_int_equal(fcntl(sock[0], F_SETFL, fcntl(sock[0], F_GETFL) | O_NONBLOCK), 0);
  threaded_read r = {.sock = sock[1]};
  pthread_t thread;
  assert_int_equal(pthread_create(&thread, NULL, read_two_frames, &r), 0);
  int send_big = zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_ERROR, 1, 0, &s.error.base,
                               sent_fds, 2, 10000);
  int send_small = zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 2, 0,
                                 &s.gather_reply.base, &sent_fds[2], 1, 10000);
  assert_int_equal(pthread_join(thread, NULL), 0);
  assert_int_equal(send_big, 0);
  assert_int_equal(send_small, 0);
  assert_int_equal(r.rc[0], 1);
  assert_int_equal(r.rc[1], 1);
  assert_int_equal(r.header[0].payload_bytes, protobuf_c_message_get_packed_size(&s.error.base));
  assert_int_equal(r.nfds[0], 2);
  assert_int_equal(r.nfds[1], 1);
  expect_same_memfd(r.fds[0][0], sent_fds[0], "big 0");
  expect_same_memfd(r.fds[0][1], sent_fds[1], "big 1");
  expect_same_memfd(r.fds[1][0], sent_fds[2], "small");
  for (int i = 0; i < 3; i++)
    close(sent_fds[i]);
  close(r.fds[0][0]);
  close(r.fds[0][1]);
  close(r.fds[1][0]);
  free(r.payload[0]);
  free(r.payload[1]);
  free(text);
  close_pair(sock);
}

/* ------------------------------------------------------------------------
 * Reading ahead
 * ------------------------------------------------------------------------ */

/* Writes a frame with a valid header and `payload_bytes` bytes of pattern
 * (seeded by the request id) into out; returns its size. */
static size_t encode_raw_frame(uint8_t *out, uint64_t request_id, uint32_t payload_bytes,
                               uint8_t fd_count) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_ERROR, payload_bytes, fd_count);
  header.request_id = request_id;
  zd_frame_header_encode(&header, out);
  for (uint32_t i = 0; i < payload_bytes; i++)
    out[ZD_FRAME_HEADER_BYTES + i] = (uint8_t)(request_id * 7 + i);
  return ZD_FRAME_HEADER_BYTES + payload_bytes;
}

/* Reads one frame, expecting it at once (rc 1), with this request id and
 * exactly these descriptors, in order. names[i] is sent_fds[i]'s content. */
static void expect_frame(zd_frame_reader *reader, int sock, uint64_t request_id,
                         const int *sent_fds, const char *const *names, unsigned nfds) {
  const char *why = NULL;
  int rc = zd_frame_read(reader, sock, &why);
  if (rc != 1)
    fail_msg("frame %llu: read returned %d (%s), expected a frame", (unsigned long long)request_id,
             rc, why ? why : "no reason");
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned got_nfds;
  zd_frame_reader_take(reader, &header, &payload, fds, &got_nfds);
  if (header.request_id != request_id)
    fail_msg("expected frame %llu, got frame %llu", (unsigned long long)request_id,
             (unsigned long long)header.request_id);
  if (got_nfds != nfds)
    fail_msg("frame %llu: %u descriptors, expected %u", (unsigned long long)request_id, got_nfds,
             nfds);
  for (unsigned i = 0; i < nfds; i++) {
    expect_same_memfd(fds[i], sent_fds[i], names[i]);
    close(fds[i]);
  }
  free(payload);
}

static void test_burst_of_frames_is_read_with_one_recvmsg(void **state) {
  enum { FRAMES = 8, PAYLOAD = 16 };
  uint8_t burst[FRAMES * (ZD_FRAME_HEADER_BYTES + PAYLOAD)];
  size_t burst_bytes = 0;
  for (unsigned i = 0; i < FRAMES; i++)
    burst_bytes += encode_raw_frame(burst + burst_bytes, i + 1, PAYLOAD, 0);
  int sock[2];
  make_pair(sock, true);
  assert_int_equal(write(sock[0], burst, burst_bytes), (ssize_t)burst_bytes);

  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  assert_false(zd_frame_reader_pending(&reader));
  expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
  /* That one call took the whole burst off the socket. */
  int queued_bytes = -1;
  assert_int_equal(ioctl(sock[1], FIONREAD, &queued_bytes), 0);
  assert_int_equal(queued_bytes, 0);
  /* The other frames come from the buffer: with no socket at all (-1) any
   * recvmsg would fail with EBADF. */
  for (unsigned i = 1; i < FRAMES; i++) {
    assert_true(zd_frame_reader_pending(&reader));
    const char *why = NULL;
    assert_int_equal(zd_frame_read(&reader, -1, &why), 1);
    zd_frame_header header;
    uint8_t *payload;
    int fds[ZD_FRAME_MAX_FDS];
    unsigned nfds;
    zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
    assert_int_equal(header.request_id, i + 1);
    assert_int_equal(nfds, 0);
    assert_int_equal(header.payload_bytes, PAYLOAD);
    assert_memory_equal(
        payload, burst + i * (ZD_FRAME_HEADER_BYTES + PAYLOAD) + ZD_FRAME_HEADER_BYTES, PAYLOAD);
    free(payload);
  }
  assert_false(zd_frame_reader_pending(&reader));
  /* Only now does the reader go back to the socket, and find it closed. */
  shutdown(sock[0], SHUT_WR);
  const char *why = NULL;
  assert_int_equal(zd_frame_read(&reader, sock[1], &why), -ECONNRESET);
  expect_why(why, "connection closed");
  zd_frame_reader_reset(&reader);
  close_pair(sock);
}

static void test_fds_stay_with_their_frames_in_a_burst(void **state) {
  samples s;
  init_samples(&s);
  int open_before = count_open_fds();
  const char *second_names[1] = {"second"};
  const char *fifth_names[2] = {"fifth a", "fifth b"};
  const char *sixth_names[1] = {"sixth"};
  int second[1] = {make_memfd(second_names[0])};
  int fifth[2] = {make_memfd(fifth_names[0]), make_memfd(fifth_names[1])};
  int sixth[1] = {make_memfd(sixth_names[0])};
  int sock[2];
  make_pair(sock, true);
  /* Seven frames queued before the reader looks: descriptors on the second
   * frame, on the third after that one (behind two frames without), and
   * on two frames back to back. */
  const struct {
    uint16_t type;
    const ProtobufCMessage *msg;
    const int *fds;
    unsigned nfds;
  } frames[] = {
      {ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, &s.step_reply.base, NULL, 0},
      {ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, &s.gather_reply.base, second, 1},
      {ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, &s.step_reply.base, NULL, 0},
      {ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY, &s.release_reply.base, NULL, 0},
      {ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY, &s.grad_buffer_reply.base, fifth, 2},
      {ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, &s.gather_reply.base, sixth, 1},
      {ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, &s.step_reply.base, NULL, 0},
  };
  for (unsigned i = 0; i < 7; i++)
    assert_int_equal(zd_frame_send(sock[0], frames[i].type, i + 1, 0, frames[i].msg, frames[i].fds,
                                   frames[i].nfds, -1),
                     0);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
  expect_frame(&reader, sock[1], 2, second, second_names, 1);
  expect_frame(&reader, sock[1], 3, NULL, NULL, 0);
  expect_frame(&reader, sock[1], 4, NULL, NULL, 0);
  expect_frame(&reader, sock[1], 5, fifth, fifth_names, 2);
  expect_frame(&reader, sock[1], 6, sixth, sixth_names, 1);
  expect_frame(&reader, sock[1], 7, NULL, NULL, 0);
  assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
  zd_frame_reader_reset(&reader);
  close(second[0]);
  close(fifth[0]);
  close(fifth[1]);
  close(sixth[0]);
  close_pair(sock);
  assert_int_equal(count_open_fds(), open_before);
}

/* Frames a writer thread sends on a blocking socket, in order. */
typedef struct frame_writer {
  int sock;
  samples *s;
  const int *fds; /* 4: one for the first frame, two for the large one, one for the fourth */
  int rc;
} frame_writer;

static void *write_small_large_small(void *arg) {
  frame_writer *w = arg;
  w->rc = zd_frame_send(w->sock, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 1, 0,
                        &w->s->gather_reply.base, &w->fds[0], 1, 10000);
  if (w->rc == 0)
    w->rc = zd_frame_send(w->sock, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, 2, 0,
                          &w->s->step_reply.base, NULL, 0, 10000);
  if (w->rc == 0)
    w->rc = zd_frame_send(w->sock, ZEROD__V1__MSG_TYPE__MSG_ERROR, 3, 0, &w->s->error.base,
                          &w->fds[1], 2, 10000);
  if (w->rc == 0)
    w->rc = zd_frame_send(w->sock, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 4, 0,
                          &w->s->gather_reply.base, &w->fds[3], 1, 10000);
  if (w->rc == 0)
    w->rc = zd_frame_send(w->sock, ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY, 5, 0,
                          &w->s->step_reply.base, NULL, 0, 10000);
  return NULL;
}

/* A 3 MiB frame between small ones: its payload is larger than the read
 * buffer and the socket buffer, so it is completed by reads straight into
 * its allocation, and the frames around it keep their descriptors. */
static void test_large_frame_between_small_ones_is_read_whole(void **state) {
  samples s;
  init_samples(&s);
  size_t text_bytes = 3u << 20;
  char *text = malloc(text_bytes + 1);
  for (size_t i = 0; i < text_bytes; i++)
    text[i] = (char)('a' + i % 26);
  text[text_bytes] = '\0';
  s.error.message = text;
  size_t expected_bytes;
  uint8_t *expected = pack(&s.error.base, &expected_bytes);
  const char *names[4] = {"first", "large 0", "large 1", "fourth"};
  int sent_fds[4];
  for (int i = 0; i < 4; i++)
    sent_fds[i] = make_memfd(names[i]);
  int sock[2];
  make_pair(sock, false);
  frame_writer w = {.sock = sock[0], .s = &s, .fds = sent_fds};
  pthread_t thread;
  assert_int_equal(pthread_create(&thread, NULL, write_small_large_small, &w), 0);

  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  const uint64_t small_ids[] = {1, 2};
  for (int f = 0; f < 2; f++) {
    assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
    zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
    assert_int_equal(header.request_id, small_ids[f]);
    assert_int_equal(nfds, f == 0 ? 1 : 0);
    if (f == 0) {
      expect_same_memfd(fds[0], sent_fds[0], names[0]);
      close(fds[0]);
    }
    free(payload);
  }
  assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 3);
  assert_int_equal(header.payload_bytes, expected_bytes);
  assert_memory_equal(payload, expected, expected_bytes);
  assert_int_equal(nfds, 2);
  expect_same_memfd(fds[0], sent_fds[1], names[1]);
  expect_same_memfd(fds[1], sent_fds[2], names[2]);
  close(fds[0]);
  close(fds[1]);
  free(payload);
  assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 4);
  assert_int_equal(nfds, 1);
  expect_same_memfd(fds[0], sent_fds[3], names[3]);
  close(fds[0]);
  free(payload);
  assert_int_equal(read_frame(&reader, sock[1], NULL), 1);
  zd_frame_reader_take(&reader, &header, &payload, fds, &nfds);
  assert_int_equal(header.request_id, 5);
  assert_int_equal(nfds, 0);
  free(payload);

  assert_int_equal(pthread_join(thread, NULL), 0);
  assert_int_equal(w.rc, 0);
  zd_frame_reader_reset(&reader);
  for (int i = 0; i < 4; i++)
    close(sent_fds[i]);
  free(expected);
  free(text);
  close_pair(sock);
}

/* A sender may write a frame in several sendmsg calls, the descriptors
 * with the first: they stay with the frame whether the reader sees the two
 * parts of its header in one recvmsg or two, and whether a frame without
 * descriptors comes before it in the same recvmsg. */
static void test_fds_on_a_header_split_across_two_writes_stay_with_it(void **state) {
  int open_before = count_open_fds();
  const char *names[1] = {"split"};
  int sent_fds[1] = {make_memfd(names[0])};
  uint8_t first[ZD_FRAME_HEADER_BYTES + 8], split[ZD_FRAME_HEADER_BYTES + 40];
  size_t first_bytes = encode_raw_frame(first, 1, 8, 0);
  size_t split_bytes = encode_raw_frame(split, 2, 40, 1);
  for (int read_between = 0; read_between < 2; read_between++) {
    int sock[2];
    make_pair(sock, true);
    zd_frame_reader reader;
    zd_frame_reader_init(&reader);
    send_raw(sock[0], first, first_bytes, NULL, 0);
    send_raw(sock[0], split, 10, sent_fds, 1);
    if (read_between) {
      expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
      assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
      assert_int_equal(reader.have, 10);
    }
    send_raw(sock[0], split + 10, split_bytes - 10, NULL, 0);
    if (!read_between)
      expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
    expect_frame(&reader, sock[1], 2, sent_fds, names, 1);
    assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
    zd_frame_reader_reset(&reader);
    close_pair(sock);
  }
  close(sent_fds[0]);
  assert_int_equal(count_open_fds(), open_before);
}

/* Descriptors read ahead with a frame not yet handed out belong to the
 * reader until then: a reset closes them. */
static void test_reset_closes_descriptors_read_ahead(void **state) {
  int open_before = count_open_fds();
  int memfd = make_memfd("ahead");
  uint8_t frame[ZD_FRAME_HEADER_BYTES + 4];
  int sock[2];
  make_pair(sock, true);
  send_raw(sock[0], frame, encode_raw_frame(frame, 1, 4, 0), NULL, 0);
  send_raw(sock[0], frame, encode_raw_frame(frame, 2, 4, 1), &memfd, 1);
  close(memfd);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
  assert_true(zd_frame_reader_pending(&reader));
  zd_frame_reader_reset(&reader);
  close_pair(sock);
  assert_int_equal(count_open_fds(), open_before);
}

/* Frames before a broken one in the same recvmsg are still handed out; the
 * broken one fails when its turn comes, without reading the socket. */
static void test_bad_header_behind_good_frames_fails_in_its_turn(void **state) {
  uint8_t burst[3 * (ZD_FRAME_HEADER_BYTES + 4)];
  size_t burst_bytes = encode_raw_frame(burst, 1, 4, 0);
  burst_bytes += encode_raw_frame(burst + burst_bytes, 2, 4, 0);
  size_t bad_at = burst_bytes;
  burst_bytes += encode_raw_frame(burst + burst_bytes, 3, 4, 0);
  burst[bad_at] ^= 0xff; /* magic */
  int sock[2];
  make_pair(sock, true);
  assert_int_equal(write(sock[0], burst, burst_bytes), (ssize_t)burst_bytes);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  expect_frame(&reader, sock[1], 1, NULL, NULL, 0);
  expect_frame(&reader, -1, 2, NULL, NULL, 0);
  assert_true(zd_frame_reader_pending(&reader));
  const char *why = NULL;
  assert_int_equal(zd_frame_read(&reader, -1, &why), -EPROTO);
  expect_why(why, "magic");
  assert_null(reader.buffer);
  close_pair(sock);
}

/* ------------------------------------------------------------------------
 * Malformed frames
 * ------------------------------------------------------------------------ */

static void test_short_header_then_eof_is_connection_reset(void **state) {
  int sock[2];
  make_pair(sock, false);
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0);
  uint8_t bytes[ZD_FRAME_HEADER_BYTES];
  zd_frame_header_encode(&header, bytes);
  send_raw(sock[0], bytes, 10, NULL, 0);
  shutdown(sock[0], SHUT_WR);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  const char *why;
  assert_int_equal(read_frame(&reader, sock[1], &why), -ECONNRESET);
  expect_why(why, "middle of a frame");
  close_pair(sock);
}

static void test_eof_between_frames_is_connection_reset(void **state) {
  int sock[2];
  make_pair(sock, false);
  close(sock[0]);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  const char *why;
  assert_int_equal(read_frame(&reader, sock[1], &why), -ECONNRESET);
  expect_why(why, "connection closed");
  close(sock[1]);
}

static void test_eof_inside_payload_frees_it_and_closes_fds(void **state) {
  int open_before = count_open_fds();
  int sock[2];
  make_pair(sock, false);
  int memfd = make_memfd("x");
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, 100, 1);
  send_header(sock[0], &header, &memfd, 1);
  send_raw(sock[0], "abc", 3, NULL, 0);
  close(memfd);
  shutdown(sock[0], SHUT_WR);
  zd_frame_reader reader;
  zd_frame_reader_init(&reader);
  const char *why;
  assert_int_equal(read_frame(&reader, sock[1], &why), -ECONNRESET);
  assert_null(reader.payload);
  assert_int_equal(reader.nfds, 0);
  assert_int_equal(reader.header.request_id, 77); /* still there to answer with */
  close_pair(sock);
  assert_int_equal(count_open_fds(), open_before);
}

static void test_bad_magic_is_a_protocol_error(void **state) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0);
  header.magic = 0x12345678;
  zd_frame_reader reader;
  const char *why;
  assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EPROTO);
  expect_why(why, "magic");
  assert_null(reader.payload);
}

static void test_bad_version_is_a_protocol_error(void **state) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0);
  header.version = 2;
  zd_frame_reader reader;
  const char *why;
  assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EPROTO);
  expect_why(why, "version");
}

static void test_oversize_payload_is_refused_before_allocating(void **state) {
  const uint32_t sizes[] = {ZD_FRAME_MAX_PAYLOAD + 1, UINT32_MAX};
  for (size_t i = 0; i < 2; i++) {
    zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_ATTACH, sizes[i], 0);
    zd_frame_reader reader;
    const char *why;
    assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EMSGSIZE);
    expect_why(why, "4 MiB");
    /* The header never became current, and no payload buffer exists. */
    assert_null(reader.payload);
    assert_int_equal(reader.header.payload_bytes, 0);
    assert_int_equal(reader.have, 0);
  }
  ProtobufCMessage *out;
  static const uint8_t byte;
  assert_int_equal(
      zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_ERROR, &byte, ZD_FRAME_MAX_PAYLOAD + 1, &out, NULL),
      -EMSGSIZE);
}

static void test_unknown_flag_bits_are_a_protocol_error(void **state) {
  for (unsigned bit = 1; bit < 8; bit++) {
    zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0);
    header.flags = (uint8_t)(ZD_FRAME_F_NO_REPLY | (1u << bit));
    zd_frame_reader reader;
    const char *why;
    assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EPROTO);
    expect_why(why, "flag");
  }
}

static void test_nonzero_reserved_is_a_protocol_error(void **state) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER, 0, 0);
  header.reserved = 0x0100;
  zd_frame_reader reader;
  const char *why;
  assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EPROTO);
  expect_why(why, "reserved");
}

static void test_fd_count_over_the_cap_is_a_protocol_error(void **state) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 0, 5);
  zd_frame_reader reader;
  const char *why;
  assert_int_equal(read_after_header(&header, NULL, 0, &reader, &why), -EPROTO);
  expect_why(why, "more than 4");
}

static void test_more_fds_sent_than_the_cap_are_all_closed(void **state) {
  int open_before = count_open_fds();
  int memfds[5];
  for (int i = 0; i < 5; i++)
    memfds[i] = make_memfd("extra");
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 0, 4);
  zd_frame_reader reader;
  const char *why;
  assert_int_equal(read_after_header(&header, memfds, 5, &reader, &why), -EPROTO);
  expect_why(why, "file descriptors");
  assert_int_equal(reader.nfds, 0);
  for (int i = 0; i < 5; i++)
    close(memfds[i]);
  assert_int_equal(count_open_fds(), open_before);
}

static void test_fd_count_differing_from_fds_sent_is_a_protocol_error(void **state) {
  int open_before = count_open_fds();
  int memfds[2] = {make_memfd("a"), make_memfd("b")};
  /* Fewer than announced, more than announced, and some when none are. */
  const struct {
    uint8_t announced;
    unsigned sent;
  } cases[] = {{2, 1}, {1, 2}, {0, 1}, {3, 0}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    zd_frame_header header =
        valid_header(ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, 0, cases[i].announced);
    zd_frame_reader reader;
    const char *why;
    assert_int_equal(read_after_header(&header, memfds, cases[i].sent, &reader, &why), -EPROTO);
    expect_why(why, "fd count does not match header");
    assert_int_equal(reader.nfds, 0);
    /* The whole frame was read, so the error can name the request. */
    assert_int_equal(reader.header.request_id, 77);
  }
  close(memfds[0]);
  close(memfds[1]);
  assert_int_equal(count_open_fds(), open_before);
}

/* A sender that puts descriptors on a byte in the middle of a frame (here
 * one that announces a descriptor, so that only where they came decides)
 * is refused, and the descriptors are closed. */
static void test_fds_sent_inside_a_frame_are_a_protocol_error(void **state) {
  int open_before = count_open_fds();
  uint8_t frame[ZD_FRAME_HEADER_BYTES + 100];
  size_t frame_bytes = encode_raw_frame(frame, 5, 100, 1);
  /* Inside the payload, and inside the header. */
  const size_t split_at[] = {ZD_FRAME_HEADER_BYTES + 50, 10};
  for (size_t i = 0; i < 2; i++) {
    int memfd = make_memfd("inside");
    int sock[2];
    make_pair(sock, true);
    zd_frame_reader reader;
    zd_frame_reader_init(&reader);
    send_raw(sock[0], frame, split_at[i], NULL, 0);
    assert_int_equal(zd_frame_read(&reader, sock[1], NULL), 0);
    send_raw(sock[0], frame + split_at[i], frame_bytes - split_at[i], &memfd, 1);
    close(memfd);
    const char *why = NULL;
    assert_int_equal(zd_frame_read(&reader, sock[1], &why), -EPROTO);
    expect_why(why, "without the first byte of a frame");
    assert_int_equal(reader.nfds, 0);
    assert_int_equal(reader.chunk_nfds, 0);
    assert_null(reader.payload);
    zd_frame_reader_reset(&reader);
    close_pair(sock);
    assert_int_equal(count_open_fds(), open_before);
  }
}

/* ------------------------------------------------------------------------
 * Payloads that break the message bounds
 * ------------------------------------------------------------------------ */

static void test_garbage_payload_is_a_bad_message(void **state) {
  /* A truncated varint, a length running past the end, and an invalid wire
   * type. */
  const uint8_t garbage[][4] = {
      {0x08, 0xff, 0xff, 0xff}, {0x12, 0x7f, 'a', 'b'}, {0x0f, 0x00, 0x00, 0x00}};
  for (size_t i = 0; i < 3; i++) {
    ProtobufCMessage *out = (ProtobufCMessage *)1;
    const char *why;
    assert_int_equal(
        zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_ATTACH, garbage[i], sizeof garbage[i], &out, &why),
        -EBADMSG);
    assert_null(out);
    expect_why(why, "not a valid protobuf");
  }
}

static void test_out_of_range_enum_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  init_samples(&s);
  s.attach.mode = 7;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), -EBADMSG);
  expect_why(why, "attach mode");

  init_samples(&s);
  s.config.working_dtype = 9; /* nested one level down */
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), -EBADMSG);
  expect_why(why, "dtype");

  init_samples(&s);
  s.optimizer.kind = -1; /* two levels down, negative */
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, &s.attach_reply.base, &why),
                   -EBADMSG);
  expect_why(why, "optimizer kind");

  init_samples(&s);
  s.register_unit.init = 4;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "init mode");

  init_samples(&s);
  s.error.status = 11;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ERROR, &s.error.base, &why), -EBADMSG);
  expect_why(why, "status");

  init_samples(&s);
  s.register_unit_reply.grad_dtype = 100;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY,
                                 &s.register_unit_reply.base, &why),
                   -EBADMSG);
  expect_why(why, "dtype");
}

static void test_job_name_outside_its_alphabet_is_a_bad_message(void **state) {
  const char *bad[] = {"a/b", "../x", "job name", "job\n", "caf\xc3\xa9", ".", ".."};
  samples s;
  const char *why;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    init_samples(&s);
    s.attach.job = (char *)bad[i];
    if (unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why) != -EBADMSG)
      fail_msg("job name \"%s\" was accepted", bad[i]);
    expect_why(why, "job name");
  }
  init_samples(&s);
  s.attach.job = "Az09._-";
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), 0);
}

static void test_job_name_empty_or_over_64_bytes_is_a_bad_message(void **state) {
  char name[ZD_MAX_JOB_NAME_BYTES + 2];
  samples s;
  const char *why;
  init_samples(&s);
  s.attach.job = "";
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), -EBADMSG);
  expect_why(why, "empty");
  memset(name, 'j', sizeof name - 1);
  name[ZD_MAX_JOB_NAME_BYTES] = '\0';
  s.attach.job = name;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), 0);
  name[ZD_MAX_JOB_NAME_BYTES] = 'j';
  name[ZD_MAX_JOB_NAME_BYTES + 1] = '\0';
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), -EBADMSG);
  expect_why(why, "longer than 64");
}

static void test_too_many_dims_is_a_bad_message(void **state) {
  uint64_t shape[ZD_MAX_DIMS + 1] = {1, 2, 1, 2, 1, 2, 1, 2, 1};
  samples s;
  const char *why;
  init_samples(&s);
  s.weight.shape = shape;
  s.weight.n_shape = ZD_MAX_DIMS;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), 0);
  s.weight.n_shape = ZD_MAX_DIMS + 1;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "more than 8 dimensions");
  /* A scalar (no dims) is one element and fine. */
  s.weight.n_shape = 0;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), 0);
}

static void test_zero_dim_is_a_bad_message(void **state) {
  uint64_t shape[3] = {4, 0, 4};
  samples s;
  const char *why;
  init_samples(&s);
  s.bias.shape = shape;
  s.bias.n_shape = 3;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "zero-sized dimension");
}

static void test_more_than_2_to_48_elements_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  init_samples(&s);
  uint64_t at_cap[2] = {1ull << 24, 1ull << 24};
  uint64_t over[3] = {1ull << 24, 1ull << 24, 2};
  uint64_t wraps[2] = {1ull << 32, 1ull << 32}; /* 2^64: zero if it wrapped */
  s.weight.shape = at_cap;
  s.weight.n_shape = 2;
  s.register_unit.n_tensors = 1;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), 0);
  s.weight.shape = over;
  s.weight.n_shape = 3;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "more than 2^48");
  s.weight.shape = wraps;
  s.weight.n_shape = 2;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  /* Two tensors at the cap each: the unit is over it. */
  s.weight.shape = at_cap;
  s.bias.shape = at_cap;
  s.bias.n_shape = 2;
  s.register_unit.n_tensors = 2;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "unit has more than 2^48");
}

static void test_tensor_count_outside_1_to_4096_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  init_samples(&s);
  s.register_unit.n_tensors = 0;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "no tensors");

  Zerod__V1__TensorSpec **many = malloc(sizeof *many * (ZD_MAX_TENSORS_PER_UNIT + 1));
  for (size_t i = 0; i <= ZD_MAX_TENSORS_PER_UNIT; i++)
    many[i] = &s.bias;
  s.register_unit.tensors = many;
  s.register_unit.n_tensors = ZD_MAX_TENSORS_PER_UNIT;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), 0);
  s.register_unit.n_tensors = ZD_MAX_TENSORS_PER_UNIT + 1;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "more than 4096 tensors");
  free(many);
}

static void test_name_over_256_bytes_is_a_bad_message(void **state) {
  char name[ZD_MAX_NAME_BYTES + 2];
  memset(name, 'n', sizeof name - 1);
  name[ZD_MAX_NAME_BYTES] = '\0'; /* exactly at the cap */
  samples s;
  const char *why;
  init_samples(&s);
  s.register_unit.name = name;
  s.weight.name = name;
  s.attach.token = name;
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), 0);
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), 0);
  name[ZD_MAX_NAME_BYTES] = 'n'; /* one over */
  name[ZD_MAX_NAME_BYTES + 1] = '\0';
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "unit name longer than 256");
  s.register_unit.name = "unit";
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "tensor name longer than 256");
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH, &s.attach.base, &why), -EBADMSG);
  expect_why(why, "token longer than 256");
}

static void test_empty_unit_or_tensor_name_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  init_samples(&s);
  s.register_unit.name = "";
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "unit name is empty");
  init_samples(&s);
  s.bias.name = "";
  assert_int_equal(
      unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &s.register_unit.base, &why), -EBADMSG);
  expect_why(why, "tensor name is empty");
}

static void test_error_message_over_1024_bytes_is_a_bad_message(void **state) {
  char text[ZD_MAX_MESSAGE_BYTES + 2];
  memset(text, 'e', sizeof text - 1);
  text[ZD_MAX_MESSAGE_BYTES + 1] = '\0';
  samples s;
  const char *why;
  init_samples(&s);
  s.error.message = text;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ERROR, &s.error.base, &why), -EBADMSG);
  expect_why(why, "1024");
  s.notice.message = text;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_NOTICE, &s.notice.base, &why), -EBADMSG);
  s.attach_reply.warning = text;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, &s.attach_reply.base, &why),
                   -EBADMSG);
  expect_why(why, "attach warning longer than 1024");
  text[ZD_MAX_MESSAGE_BYTES] = '\0';
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ERROR, &s.error.base, &why), 0);
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, &s.attach_reply.base, &why),
                   0);
}

static void test_tensor_placement_outside_its_unit_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  init_samples(&s);
  s.bias_at.offset = s.register_unit_reply.numel - 1023;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY,
                                 &s.register_unit_reply.base, &why),
                   -EBADMSG);
  expect_why(why, "outside the unit");
  init_samples(&s);
  s.bias_at.offset = UINT64_MAX;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY,
                                 &s.register_unit_reply.base, &why),
                   -EBADMSG);
  init_samples(&s);
  s.bias_at.numel = 1023;
  assert_int_equal(unpack_packed(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY,
                                 &s.register_unit_reply.base, &why),
                   -EBADMSG);
  expect_why(why, "does not match its shape");
}

/* A GPU buffer's handles are read by CUDA at a fixed 64 bytes, so a reply
 * with another length (or an impossible device) never reaches a client. */
static void test_cuda_buffer_with_wrong_handle_sizes_is_a_bad_message(void **state) {
  samples s;
  const char *why;
  uint8_t long_handle[ZD_CUDA_IPC_HANDLE_BYTES + 1] = {0};
  static const uint16_t types[] = {ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY,
                                   ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY};
  for (int t = 0; t < 2; t++) {
    init_samples(&s);
    const ProtobufCMessage *reply = t == 0 ? &s.gather_reply.base : &s.grad_buffer_reply.base;
    assert_int_equal(unpack_packed(types[t], reply, &why), 0);
    s.cuda.mem_handle.len = ZD_CUDA_IPC_HANDLE_BYTES - 1;
    assert_int_equal(unpack_packed(types[t], reply, &why), -EBADMSG);
    expect_why(why, "CUDA memory handle is not 64 bytes");
    init_samples(&s);
    s.cuda.event_handle.len = 0;
    assert_int_equal(unpack_packed(types[t], reply, &why), -EBADMSG);
    expect_why(why, "CUDA event handle is not 64 bytes");
    init_samples(&s);
    s.cuda.mem_handle.len = sizeof long_handle;
    s.cuda.mem_handle.data = long_handle;
    assert_int_equal(unpack_packed(types[t], reply, &why), -EBADMSG);
    init_samples(&s);
    s.cuda.device = -1;
    assert_int_equal(unpack_packed(types[t], reply, &why), -EBADMSG);
    expect_why(why, "CUDA device ordinal outside 0..1023");
    init_samples(&s);
    s.cuda.device = ZD_MAX_CUDA_DEVICE + 1;
    assert_int_equal(unpack_packed(types[t], reply, &why), -EBADMSG);
  }
}

/* A 2 MiB payload of a million empty tensors would cost protobuf-c about
 * 60 MiB of structs; the unpack budget stops it at 16 MiB. */
static void test_payload_needing_too_much_memory_is_a_bad_message(void **state) {
  size_t count = 1u << 20;
  uint8_t *payload = malloc(2 * count);
  for (size_t i = 0; i < count; i++) {
    payload[2 * i] = 0x12; /* field 2 (tensors), length-delimited */
    payload[2 * i + 1] = 0x00;
  }
  ProtobufCMessage *out;
  const char *why;
  assert_int_equal(
      zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, payload, 2 * count, &out, &why),
      -EBADMSG);
  expect_why(why, "16 MiB");
  free(payload);
}

/* Unknown fields are kept (a newer peer may send them), but only with
 * field numbers protobuf allows: an over-long encoding of field 0, or a
 * number past 2^29 - 1, would be packed again as some other field. */
static void test_field_number_zero_or_past_2_to_29_is_a_bad_message(void **state) {
  const uint8_t field_0[] = {0x80, 0x00, 0x01};
  const uint8_t field_2_to_29[] = {0x80, 0x80, 0x80, 0x80, 0x10, 0x01};
  const uint8_t field_100[] = {0xa0, 0x06, 0x01};
  ProtobufCMessage *out;
  const char *why;
  assert_int_equal(
      zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_GATHER, field_0, sizeof field_0, &out, &why),
      -EBADMSG);
  expect_why(why, "field number");
  assert_int_equal(zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_GATHER, field_2_to_29,
                                 sizeof field_2_to_29, &out, &why),
                   -EBADMSG);
  expect_why(why, "field number");
  assert_int_equal(
      zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_GATHER, field_100, sizeof field_100, &out, &why), 0);
  assert_int_equal(out->n_unknown_fields, 1);
  protobuf_c_message_free_unpacked(out, NULL);
}

static void test_empty_attach_payload_is_a_bad_message(void **state) {
  ProtobufCMessage *out;
  const char *why;
  assert_int_equal(zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_ATTACH, NULL, 0, &out, &why), -EBADMSG);
  expect_why(why, "job name is empty");
  assert_int_equal(zd_msg_unpack(ZEROD__V1__MSG_TYPE__MSG_GATHER, NULL, 0, &out, &why), 0);
  protobuf_c_message_free_unpacked(out, NULL);
}

/* ------------------------------------------------------------------------
 * Sending
 * ------------------------------------------------------------------------ */

static void test_encode_refuses_bad_arguments(void **state) {
  samples s;
  init_samples(&s);
  uint8_t *frame = NULL;
  size_t frame_bytes;
  /* The message must be the one the type carries. */
  assert_int_equal(zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_ATTACH, 1, 0, 0, &s.gather.base, &frame,
                                   &frame_bytes),
                   -EINVAL);
  assert_int_equal(zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_GATHER, 1, 0x02, 0, &s.gather.base,
                                   &frame, &frame_bytes),
                   -EINVAL);
  assert_int_equal(zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_GATHER, 1, 0, ZD_FRAME_MAX_FDS + 1,
                                   &s.gather.base, &frame, &frame_bytes),
                   -EINVAL);
  char *huge = malloc(ZD_FRAME_MAX_PAYLOAD + 1);
  memset(huge, 'h', ZD_FRAME_MAX_PAYLOAD);
  huge[ZD_FRAME_MAX_PAYLOAD] = '\0';
  s.error.message = huge;
  assert_int_equal(
      zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_ERROR, 1, 0, 0, &s.error.base, &frame, &frame_bytes),
      -EMSGSIZE);
  assert_int_equal(
      zd_frame_send(-1, ZEROD__V1__MSG_TYPE__MSG_ERROR, 1, 0, &s.error.base, NULL, 0, 0),
      -EMSGSIZE);
  assert_null(frame);
  free(huge);
}

static void test_send_to_a_closed_peer_is_epipe_without_sigpipe(void **state) {
  samples s;
  init_samples(&s);
  int sock[2];
  make_pair(sock, false);
  close(sock[1]);
  /* SIGPIPE would kill this test process. */
  assert_int_equal(
      zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_GATHER, 1, 0, &s.gather.base, NULL, 0, 100),
      -EPIPE);
  close(sock[0]);
}

static void test_send_to_a_full_socket_times_out(void **state) {
  samples s;
  init_samples(&s);
  int sock[2];
  make_pair(sock, false);
  assert_int_equal(fcntl(sock[0], F_SETFL, fcntl(sock[0], F_GETFL) | O_NONBLOCK), 0);
  /* A frame larger than the socket's buffers, and nobody reading. */
  char *text = malloc(ZD_FRAME_MAX_PAYLOAD - 64);
  memset(text, 't', ZD_FRAME_MAX_PAYLOAD - 65);
  text[ZD_FRAME_MAX_PAYLOAD - 65] = '\0';
  s.error.message = text;
  assert_int_equal(
      zd_frame_send(sock[0], ZEROD__V1__MSG_TYPE__MSG_ERROR, 1, 0, &s.error.base, NULL, 0, 50),
      -ETIMEDOUT);
  free(text);
  close_pair(sock);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_header_is_little_endian_in_wire_order),
      cmocka_unit_test(test_header_shorter_than_24_bytes_is_rejected),
      cmocka_unit_test(test_header_checks_run_in_documented_order),
      cmocka_unit_test(test_fd_ranges_follow_the_protocol),
      cmocka_unit_test(test_unknown_message_type_has_no_descriptor_and_does_not_unpack),
      cmocka_unit_test(test_every_message_type_round_trips_with_0_1_and_4_fds),
      cmocka_unit_test(test_encoded_frame_equals_what_send_puts_on_the_wire),
      cmocka_unit_test(test_empty_message_sends_an_empty_payload),
      cmocka_unit_test(test_payload_at_the_cap_is_read_whole),
      cmocka_unit_test(test_frame_split_into_1_byte_writes_is_ready_only_when_complete),
      cmocka_unit_test(test_back_to_back_frames_keep_their_own_fds),
      cmocka_unit_test(test_frame_sent_in_pieces_carries_its_fds_once),
      cmocka_unit_test(test_burst_of_frames_is_read_with_one_recvmsg),
      cmocka_unit_test(test_fds_stay_with_their_frames_in_a_burst),
      cmocka_unit_test(test_large_frame_between_small_ones_is_read_whole),
      cmocka_unit_test(test_fds_on_a_header_split_across_two_writes_stay_with_it),
      cmocka_unit_test(test_reset_closes_descriptors_read_ahead),
      cmocka_unit_test(test_bad_header_behind_good_frames_fails_in_its_turn),
      cmocka_unit_test(test_short_header_then_eof_is_connection_reset),
      cmocka_unit_test(test_eof_between_frames_is_connection_reset),
      cmocka_unit_test(test_eof_inside_payload_frees_it_and_closes_fds),
      cmocka_unit_test(test_bad_magic_is_a_protocol_error),
      cmocka_unit_test(test_bad_version_is_a_protocol_error),
      cmocka_unit_test(test_oversize_payload_is_refused_before_allocating),
      cmocka_unit_test(test_unknown_flag_bits_are_a_protocol_error),
      cmocka_unit_test(test_nonzero_reserved_is_a_protocol_error),
      cmocka_unit_test(test_fd_count_over_the_cap_is_a_protocol_error),
      cmocka_unit_test(test_more_fds_sent_than_the_cap_are_all_closed),
      cmocka_unit_test(test_fd_count_differing_from_fds_sent_is_a_protocol_error),
      cmocka_unit_test(test_fds_sent_inside_a_frame_are_a_protocol_error),
      cmocka_unit_test(test_garbage_payload_is_a_bad_message),
      cmocka_unit_test(test_out_of_range_enum_is_a_bad_message),
      cmocka_unit_test(test_job_name_outside_its_alphabet_is_a_bad_message),
      cmocka_unit_test(test_job_name_empty_or_over_64_bytes_is_a_bad_message),
      cmocka_unit_test(test_too_many_dims_is_a_bad_message),
      cmocka_unit_test(test_zero_dim_is_a_bad_message),
      cmocka_unit_test(test_more_than_2_to_48_elements_is_a_bad_message),
      cmocka_unit_test(test_tensor_count_outside_1_to_4096_is_a_bad_message),
      cmocka_unit_test(test_name_over_256_bytes_is_a_bad_message),
      cmocka_unit_test(test_empty_unit_or_tensor_name_is_a_bad_message),
      cmocka_unit_test(test_error_message_over_1024_bytes_is_a_bad_message),
      cmocka_unit_test(test_tensor_placement_outside_its_unit_is_a_bad_message),
      cmocka_unit_test(test_cuda_buffer_with_wrong_handle_sizes_is_a_bad_message),
      cmocka_unit_test(test_payload_needing_too_much_memory_is_a_bad_message),
      cmocka_unit_test(test_field_number_zero_or_past_2_to_29_is_a_bad_message),
      cmocka_unit_test(test_empty_attach_payload_is_a_bad_message),
      cmocka_unit_test(test_encode_refuses_bad_arguments),
      cmocka_unit_test(test_send_to_a_closed_peer_is_epipe_without_sigpipe),
      cmocka_unit_test(test_send_to_a_full_socket_times_out),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
