/* frame_fixtures.h - what the IPC framing tests share (test_frame.c,
 * test_frame_header.c, test_frame_readahead.c, test_frame_malformed.c,
 * test_frame_bounds.c): socket pairs and memfds, raw bytes and headers as
 * a broken peer sends them, reading a frame, packing a message, and one
 * sample of every message type with every field set. */
#ifndef ZEROD_TESTS_FRAME_FIXTURES_H
#define ZEROD_TESTS_FRAME_FIXTURES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "frame.h"

/* Makes a connected socketpair: sock[0] writes, sock[1] reads, maybe non-blocking. */
void make_pair(int sock[2], bool nonblocking_reader);
/* Closes both ends of a pair. */
void close_pair(int sock[2]);
/* The number of descriptors open in this process. */
int count_open_fds(void);
/* A new memfd holding content. */
int make_memfd(const char *content);
/* Fails unless received is the memfd sent (same inode), holds content, and is close-on-exec. */
void expect_same_memfd(int received, int sent, const char *content);
/* Sends raw bytes with fds on one sendmsg, as a hostile or broken peer would. */
void send_raw(int sock, const void *bytes, size_t len, const int *fds, unsigned nfds);
/* A header that passes every check, request id 77. */
zd_frame_header valid_header(uint16_t type, uint32_t payload_bytes, uint8_t fd_count);
/* Fails unless why contains part. */
void expect_why(const char *why, const char *part);
/* Reads one frame from a blocking socket; zd_frame_read's answer. */
int read_frame(zd_frame_reader *reader, int sock, const char **why);
/* msg packed (malloc'd), its size in *len. */
uint8_t *pack(const ProtobufCMessage *msg, size_t *len);
/* Writes a valid frame with a patterned payload into out; returns its size. */
size_t encode_raw_frame(uint8_t *out, uint64_t request_id, uint32_t payload_bytes,
                        uint8_t fd_count);

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
  Zerod__V1__WatchVersionRequest watch;
  uint32_t changed_units[2];
  Zerod__V1__WatchVersionReply watch_reply;
} samples;

#define SAMPLE_TYPES 30

typedef struct typed_sample {
  uint16_t type;
  const ProtobufCMessage *msg;
} typed_sample;

/* Fills s with one sample of every message, every field set. */
void init_samples(samples *s);
/* Puts each sample with its type in out; returns how many (SAMPLE_TYPES). */
size_t all_samples(const samples *s, typed_sample out[SAMPLE_TYPES]);

#endif /* ZEROD_TESTS_FRAME_FIXTURES_H */
