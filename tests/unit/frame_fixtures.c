/* frame_fixtures.c - what the IPC framing tests share (frame_fixtures.h):
 * socket pairs and memfds, raw bytes and headers as a broken peer sends
 * them, reading a frame, packing a message, and one sample of every
 * message type with every field set. */
#include <dirent.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "frame_fixtures.h"

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

/* sock[0] writes, sock[1] reads; the reader may be non-blocking. */
void make_pair(int sock[2], bool nonblocking_reader) {
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sock), 0);
  if (nonblocking_reader)
    assert_int_equal(fcntl(sock[1], F_SETFL, fcntl(sock[1], F_GETFL) | O_NONBLOCK), 0);
}

void close_pair(int sock[2]) {
  close(sock[0]);
  close(sock[1]);
}

/* Descriptors open in this process, to show that refused frames leave no
 * received descriptor behind. */
int count_open_fds(void) {
  DIR *dir = opendir("/proc/self/fd");
  assert_non_null(dir);
  int count = 0;
  for (struct dirent *entry; (entry = readdir(dir)) != NULL;)
    if (entry->d_name[0] != '.')
      count++;
  closedir(dir);
  return count - 1; /* the directory's own descriptor */
}

int make_memfd(const char *content) {
  int fd = memfd_create("test_frame", MFD_CLOEXEC);
  assert_true(fd >= 0);
  size_t len = strlen(content);
  assert_int_equal(write(fd, content, len), (ssize_t)len);
  return fd;
}

/* A received descriptor must be the very file that was sent (same inode),
 * hold its content, and be close-on-exec (MSG_CMSG_CLOEXEC). */
void expect_same_memfd(int received, int sent, const char *content) {
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
void send_raw(int sock, const void *bytes, size_t len, const int *fds, unsigned nfds) {
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

zd_frame_header valid_header(uint16_t type, uint32_t payload_bytes, uint8_t fd_count) {
  zd_frame_header header = {.magic = ZD_FRAME_MAGIC,
                            .version = ZD_FRAME_VERSION,
                            .type = type,
                            .request_id = 77,
                            .payload_bytes = payload_bytes,
                            .fd_count = fd_count};
  return header;
}

void expect_why(const char *why, const char *part) {
  if (why == NULL || strstr(why, part) == NULL)
    fail_msg("expected an error message containing \"%s\", got \"%s\"", part, why ? why : "(null)");
}

/* Reads one frame from a blocking socket. */
int read_frame(zd_frame_reader *reader, int sock, const char **why) {
  int rc;
  while ((rc = zd_frame_read(reader, sock, why)) == 0)
    ;
  return rc;
}

uint8_t *pack(const ProtobufCMessage *msg, size_t *len) {
  *len = protobuf_c_message_get_packed_size(msg);
  uint8_t *bytes = malloc(*len ? *len : 1);
  assert_non_null(bytes);
  assert_int_equal(protobuf_c_message_pack(msg, bytes), *len);
  return bytes;
}

/* Writes a frame with a valid header and `payload_bytes` bytes of pattern
 * (seeded by the request id) into out; returns its size. */
size_t encode_raw_frame(uint8_t *out, uint64_t request_id, uint32_t payload_bytes,
                        uint8_t fd_count) {
  zd_frame_header header = valid_header(ZEROD__V1__MSG_TYPE__MSG_ERROR, payload_bytes, fd_count);
  header.request_id = request_id;
  zd_frame_header_encode(&header, out);
  for (uint32_t i = 0; i < payload_bytes; i++)
    out[ZD_FRAME_HEADER_BYTES + i] = (uint8_t)(request_id * 7 + i);
  return ZD_FRAME_HEADER_BYTES + payload_bytes;
}

/* ------------------------------------------------------------------------
 * One sample of every message, with every field set
 * ------------------------------------------------------------------------ */

void init_samples(samples *s) {
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
  zerod__v1__watch_version_request__init(&s->watch);
  s->watch.after_version = 41;
  s->watch.timeout_ms = 2500;
  zerod__v1__watch_version_reply__init(&s->watch_reply);
  s->watch_reply.version = 44;
  s->watch_reply.timed_out = 1;
  s->watch_reply.skipped = 2;
  s->changed_units[0] = 0;
  s->changed_units[1] = 3;
  s->watch_reply.changed_units = s->changed_units;
  s->watch_reply.n_changed_units = 2;
  s->watch_reply.step = 44;
}

size_t all_samples(const samples *s, typed_sample out[SAMPLE_TYPES]) {
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
      {ZEROD__V1__MSG_TYPE__MSG_WATCH, &s->watch.base},
      {ZEROD__V1__MSG_TYPE__MSG_WATCH_REPLY, &s->watch_reply.base},
  };
  memcpy(out, table, sizeof table);
  return sizeof table / sizeof table[0];
}
