/* Framing of the local IPC protocol: the 24-byte header, the map from frame
 * types to protobuf-c messages, the bounds every decoded message must meet,
 * and the reading and writing of whole frames (with their SCM_RIGHTS file
 * descriptors) on a Unix stream socket.
 *
 * Everything here treats its input as hostile: the header is checked field
 * by field before anything is allocated, the payload buffer is exactly the
 * size the (checked) header announces, a payload is unpacked through an
 * allocator with a fixed budget, and a decoded message is checked against
 * the protocol's bounds before it is handed out. The daemon and libzerod
 * both use this file, so a worker and the daemon agree on what is valid. */
#include "frame.h"

#include "pbcheck.h"

#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------
 * Header
 * ------------------------------------------------------------------------ */

/* The wire format is little-endian whatever the host is, so fields are
 * assembled byte by byte rather than through a packed struct. */
static void put_le16(uint8_t *out, uint16_t value) {
  out[0] = (uint8_t)value;
  out[1] = (uint8_t)(value >> 8);
}

static void put_le32(uint8_t *out, uint32_t value) {
  for (int i = 0; i < 4; i++)
    out[i] = (uint8_t)(value >> (8 * i));
}

static void put_le64(uint8_t *out, uint64_t value) {
  for (int i = 0; i < 8; i++)
    out[i] = (uint8_t)(value >> (8 * i));
}

static uint16_t get_le16(const uint8_t *in) {
  return (uint16_t)(in[0] | (in[1] << 8));
}

static uint32_t get_le32(const uint8_t *in) {
  uint32_t value = 0;
  for (int i = 3; i >= 0; i--)
    value = (value << 8) | in[i];
  return value;
}

static uint64_t get_le64(const uint8_t *in) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; i--)
    value = (value << 8) | in[i];
  return value;
}

static int fail(const char **why, const char *message, int err) {
  if (why != NULL)
    *why = message;
  return err;
}

void zd_frame_header_encode(const zd_frame_header *header, uint8_t *out) {
  put_le32(out + 0, header->magic);
  put_le16(out + 4, header->version);
  put_le16(out + 6, header->type);
  put_le64(out + 8, header->request_id);
  put_le32(out + 16, header->payload_bytes);
  out[20] = header->fd_count;
  out[21] = header->flags;
  put_le16(out + 22, header->reserved);
}

int zd_frame_header_decode(const uint8_t *in, size_t in_bytes, zd_frame_header *header,
                           const char **why) {
  if (in == NULL || in_bytes < ZD_FRAME_HEADER_BYTES)
    return fail(why, "frame header shorter than 24 bytes", -EPROTO);
  zd_frame_header decoded = {
      .magic = get_le32(in + 0),
      .version = get_le16(in + 4),
      .type = get_le16(in + 6),
      .request_id = get_le64(in + 8),
      .payload_bytes = get_le32(in + 16),
      .fd_count = in[20],
      .flags = in[21],
      .reserved = get_le16(in + 22),
  };
  if (decoded.magic != ZD_FRAME_MAGIC)
    return fail(why, "bad frame magic (not a zerod IPC frame)", -EPROTO);
  if (decoded.version != ZD_FRAME_VERSION)
    return fail(why, "unsupported frame version (this side speaks version 1)", -EPROTO);
  if (decoded.payload_bytes > ZD_FRAME_MAX_PAYLOAD)
    return fail(why, "frame payload larger than the 4 MiB cap", -EMSGSIZE);
  if (decoded.fd_count > ZD_FRAME_MAX_FDS)
    return fail(why, "frame announces more than 4 file descriptors", -EPROTO);
  if ((decoded.flags & ~ZD_FRAME_F_KNOWN) != 0)
    return fail(why, "unknown frame flag bits set", -EPROTO);
  if (decoded.reserved != 0)
    return fail(why, "reserved frame header bits are not zero", -EPROTO);
  *header = decoded;
  if (why != NULL)
    *why = NULL;
  return 0;
}

/* ------------------------------------------------------------------------
 * Frame types
 * ------------------------------------------------------------------------ */

const ProtobufCMessageDescriptor *zd_msg_descriptor(uint16_t type) {
  switch (type) {
  case ZEROD__V1__MSG_TYPE__MSG_ERROR:
    return &zerod__v1__error__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_NOTICE:
    return &zerod__v1__notice__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_ATTACH:
    return &zerod__v1__attach_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY:
    return &zerod__v1__attach_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT:
    return &zerod__v1__register_unit_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY:
    return &zerod__v1__register_unit_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_GATHER:
    return &zerod__v1__gather_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY:
    return &zerod__v1__gather_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_RELEASE:
    return &zerod__v1__release_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_RELEASE_REPLY:
    return &zerod__v1__release_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER:
    return &zerod__v1__grad_buffer_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY:
    return &zerod__v1__grad_buffer_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_REDUCE:
    return &zerod__v1__reduce_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_REDUCE_REPLY:
    return &zerod__v1__reduce_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_STEP:
    return &zerod__v1__step_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_STEP_REPLY:
    return &zerod__v1__step_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_DETACH:
    return &zerod__v1__detach_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_DETACH_REPLY:
    return &zerod__v1__detach_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_UNITS:
    return &zerod__v1__units_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_UNITS_REPLY:
    return &zerod__v1__units_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_PIN:
    return &zerod__v1__pin_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_PIN_REPLY:
    return &zerod__v1__pin_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT:
    return &zerod__v1__load_unit_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT_REPLY:
    return &zerod__v1__load_unit_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_STATS:
    return &zerod__v1__stats_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_STATS_REPLY:
    return &zerod__v1__stats_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_READ_STATE:
    return &zerod__v1__read_state_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_READ_STATE_REPLY:
    return &zerod__v1__read_state_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS:
    return &zerod__v1__set_groups_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_SET_GROUPS_REPLY:
    return &zerod__v1__set_groups_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM:
    return &zerod__v1__grad_norm_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_NORM_REPLY:
    return &zerod__v1__grad_norm_reply__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT:
    return &zerod__v1__checkpoint_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_CHECKPOINT_REPLY:
    return &zerod__v1__checkpoint_reply__descriptor;
  default:
    return NULL;
  }
}

int zd_msg_fd_range(uint16_t type, unsigned *min_fds, unsigned *max_fds) {
  if (zd_msg_descriptor(type) == NULL)
    return -EPROTO;
  unsigned max = 0;
  switch (type) {
  /* Rank 0's initial values travel with REGISTER_UNIT (INIT_FROM_RANK0
   * only) and LOAD_UNIT, and a buffer's memfd travels with its reply the first time the
   * session sees that buffer (a GPU buffer's CUDA IPC handles travel in the
   * reply instead); later replies name it by buffer_id only. A
   * READ_STATE reply carries its values in a memfd of its own. */
  case ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT:
  case ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT:
  case ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY:
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY:
  case ZEROD__V1__MSG_TYPE__MSG_READ_STATE_REPLY:
    max = 1;
    break;
  default:
    break;
  }
  if (min_fds != NULL)
    *min_fds = 0;
  if (max_fds != NULL)
    *max_fds = max;
  return 0;
}

/* ------------------------------------------------------------------------
 * Unpacking and bounds
 * ------------------------------------------------------------------------ */

/* Bytes a single unpack may allocate in total. protobuf-c bounds every
 * repeated field by the payload, but a 4 MiB payload of two-byte empty
 * sub-messages or unknown fields would still cost it well over 100 MiB of
 * structs. The largest valid message (4096 tensors with 256-byte names and
 * 8 dims) needs about 2 MiB, so 16 MiB refuses only payloads that are
 * invalid anyway, and refuses them before the memory is spent. The budget
 * only counts: memory comes from malloc, so the message is freed with the
 * default allocator as frame.h promises. */
#define UNPACK_BUDGET_BYTES (16u << 20)

typedef struct unpack_budget {
  size_t left_bytes;
  bool exceeded;
} unpack_budget;

static void *budget_alloc(void *allocator_data, size_t size) {
  unpack_budget *budget = allocator_data;
  if (size > budget->left_bytes) {
    budget->exceeded = true;
    return NULL;
  }
  budget->left_bytes -= size;
  return malloc(size != 0 ? size : 1);
}

static void budget_free(void *allocator_data, void *pointer) {
  free(pointer);
}

/* The C string fields come from protobuf-c with a terminating NUL, and
 * zd_pb_check_strings has refused any with a NUL inside before unpacking,
 * so strlen is every string's whole length; it is bounded all the same. */
static bool string_within(const char *text, size_t max_bytes) {
  return text != NULL && strnlen(text, max_bytes + 1) <= max_bytes;
}

static bool string_nonempty(const char *text) {
  return text != NULL && text[0] != '\0';
}

/* Job names end up in file names (checkpoints) and metric labels, so they
 * are restricted to a portable file-name alphabet, and "." and ".." are
 * refused as they name directories. */
static int check_job_name(const char *job, const char **why) {
  if (!string_nonempty(job))
    return fail(why, "job name is empty", -EBADMSG);
  if (!string_within(job, ZD_MAX_JOB_NAME_BYTES))
    return fail(why, "job name longer than 64 bytes", -EBADMSG);
  for (const char *c = job; *c != '\0'; c++) {
    bool ok = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
              *c == '.' || *c == '_' || *c == '-';
    if (!ok)
      return fail(why, "job name has a character outside [A-Za-z0-9._-]", -EBADMSG);
  }
  if (strcmp(job, ".") == 0 || strcmp(job, "..") == 0)
    return fail(why, "job name may not be \".\" or \"..\"", -EBADMSG);
  return 0;
}

/* The element count of a shape, or -EBADMSG when a dimension is zero, there
 * are too many dimensions, or the product exceeds ZD_MAX_NUMEL (which keeps
 * every later byte count of the daemon far from overflowing). A shape with
 * no dimensions is a scalar: one element. */
static int shape_numel(const uint64_t *shape, size_t n_shape, uint64_t *numel, const char **why) {
  if (n_shape > ZD_MAX_DIMS)
    return fail(why, "tensor has more than 8 dimensions", -EBADMSG);
  uint64_t product = 1;
  for (size_t d = 0; d < n_shape; d++) {
    if (shape[d] == 0)
      return fail(why, "tensor has a zero-sized dimension", -EBADMSG);
    if (shape[d] > ZD_MAX_NUMEL / product)
      return fail(why, "tensor has more than 2^48 elements", -EBADMSG);
    product *= shape[d];
  }
  *numel = product;
  return 0;
}

static int check_tensor_name(const char *name, const char **why) {
  if (!string_nonempty(name))
    return fail(why, "tensor name is empty", -EBADMSG);
  if (!string_within(name, ZD_MAX_NAME_BYTES))
    return fail(why, "tensor name longer than 256 bytes", -EBADMSG);
  return 0;
}

static int check_unit_name(const char *name, const char **why) {
  if (!string_nonempty(name))
    return fail(why, "unit name is empty", -EBADMSG);
  if (!string_within(name, ZD_MAX_NAME_BYTES))
    return fail(why, "unit name longer than 256 bytes", -EBADMSG);
  return 0;
}

static int check_register_unit(const Zerod__V1__RegisterUnitRequest *request, const char **why) {
  int rc = check_unit_name(request->name, why);
  if (rc != 0)
    return rc;
  if (request->n_tensors == 0)
    return fail(why, "unit has no tensors", -EBADMSG);
  if (request->n_tensors > ZD_MAX_TENSORS_PER_UNIT)
    return fail(why, "unit has more than 4096 tensors", -EBADMSG);
  uint64_t unit_numel = 0;
  for (size_t t = 0; t < request->n_tensors; t++) {
    const Zerod__V1__TensorSpec *tensor = request->tensors[t];
    uint64_t numel;
    if ((rc = check_tensor_name(tensor->name, why)) != 0 ||
        (rc = shape_numel(tensor->shape, tensor->n_shape, &numel, why)) != 0)
      return rc;
    /* Each term is at most 2^48, so the sum cannot wrap before the check. */
    unit_numel += numel;
    if (unit_numel > ZD_MAX_NUMEL)
      return fail(why, "unit has more than 2^48 elements", -EBADMSG);
  }
  return 0;
}

/* A worker maps the gathered buffer by these placements, so libzerod must
 * not trust them blindly either: every tensor lies inside the unit. */
static int check_register_unit_reply(const Zerod__V1__RegisterUnitReply *reply, const char **why) {
  if (reply->n_tensors == 0)
    return fail(why, "unit reply has no tensors", -EBADMSG);
  if (reply->n_tensors > ZD_MAX_TENSORS_PER_UNIT)
    return fail(why, "unit reply has more than 4096 tensors", -EBADMSG);
  /* Padding may take a unit a little past ZD_MAX_NUMEL; twice the cap still
   * keeps every byte count a client computes from these far from wrapping. */
  if (reply->numel > reply->padded_numel || reply->padded_numel > 2 * ZD_MAX_NUMEL)
    return fail(why, "unit reply numel above padded_numel, or padded_numel above 2^49", -EBADMSG);
  for (size_t t = 0; t < reply->n_tensors; t++) {
    const Zerod__V1__TensorPlacement *placement = reply->tensors[t];
    uint64_t numel;
    int rc;
    if ((rc = check_tensor_name(placement->name, why)) != 0 ||
        (rc = shape_numel(placement->shape, placement->n_shape, &numel, why)) != 0)
      return rc;
    if (placement->numel != numel)
      return fail(why, "tensor placement numel does not match its shape", -EBADMSG);
    if (placement->offset > reply->numel || numel > reply->numel - placement->offset)
      return fail(why, "tensor placement lies outside the unit", -EBADMSG);
  }
  return 0;
}

/* A message naming an enum value from the message's descriptor, by the
 * enum it belongs to, so that the error says which field was wrong. */
static const char *unknown_enum_message(const ProtobufCEnumDescriptor *enum_desc) {
  if (enum_desc == &zerod__v1__status__descriptor)
    return "unknown status value";
  if (enum_desc == &zerod__v1__dtype__descriptor)
    return "unknown dtype value";
  if (enum_desc == &zerod__v1__optimizer_kind__descriptor)
    return "unknown optimizer kind";
  if (enum_desc == &zerod__v1__attach_mode__descriptor)
    return "unknown attach mode";
  if (enum_desc == &zerod__v1__init_mode__descriptor)
    return "unknown init mode";
  return "unknown enum value";
}

static bool enum_known(const ProtobufCFieldDescriptor *field, int value) {
  return protobuf_c_enum_descriptor_get_value(field->descriptor, value) != NULL;
}

/* Field numbers run from 1 to 2^29 - 1. protobuf-c refuses a plain 0 but
 * takes an over-long encoding of 0, and numbers past 2^29 - 1, as unknown
 * fields; packed again, those would come out as a different (possibly
 * known) field, so a message carrying one is refused. */
#define MAX_FIELD_NUMBER 0x1fffffffu

/* proto3 keeps enum values it does not know as plain ints, so every enum
 * field, at any depth, is checked against its descriptor, as is the number
 * of every unknown field. This walks the descriptors rather than naming
 * fields, so a field added to ipc.proto is covered without touching this
 * file. The depth is that of the schema (ipc.proto has no recursive
 * messages), not of the input. */
static int check_fields(const ProtobufCMessage *message, const char **why) {
  for (unsigned u = 0; u < message->n_unknown_fields; u++) {
    uint32_t tag = message->unknown_fields[u].tag;
    if (tag == 0 || tag > MAX_FIELD_NUMBER)
      return fail(why, "field number outside 1..2^29-1", -EBADMSG);
  }
  const ProtobufCMessageDescriptor *desc = message->descriptor;
  for (unsigned f = 0; f < desc->n_fields; f++) {
    const ProtobufCFieldDescriptor *field = &desc->fields[f];
    const char *member = (const char *)message + field->offset;
    if (field->type != PROTOBUF_C_TYPE_ENUM && field->type != PROTOBUF_C_TYPE_MESSAGE)
      continue;
    size_t count = 1;
    const void *values = member;
    if (field->label == PROTOBUF_C_LABEL_REPEATED) {
      memcpy(&count, (const char *)message + field->quantifier_offset, sizeof count);
      memcpy(&values, member, sizeof values);
    }
    for (size_t i = 0; i < count; i++) {
      if (field->type == PROTOBUF_C_TYPE_ENUM) {
        int value;
        memcpy(&value, (const char *)values + i * sizeof(int), sizeof value);
        if (!enum_known(field, value))
          return fail(why, unknown_enum_message(field->descriptor), -EBADMSG);
      } else {
        const ProtobufCMessage *sub;
        memcpy(&sub, (const char *)values + i * sizeof sub, sizeof sub);
        int rc = sub != NULL ? check_fields(sub, why) : 0;
        if (rc != 0)
          return rc;
      }
    }
  }
  return 0;
}

/* A GPU buffer's handles are opaque bytes that the CUDA runtime reads at a
 * fixed size, so any other length is refused before a client copies them. */
static int check_cuda_buffer(const Zerod__V1__CudaBuffer *cuda, const char **why) {
  if (cuda == NULL)
    return 0;
  if (cuda->mem_handle.len != ZD_CUDA_IPC_HANDLE_BYTES)
    return fail(why, "CUDA memory handle is not 64 bytes", -EBADMSG);
  if (cuda->event_handle.len != ZD_CUDA_IPC_HANDLE_BYTES)
    return fail(why, "CUDA event handle is not 64 bytes", -EBADMSG);
  if (cuda->device < 0 || cuda->device > ZD_MAX_CUDA_DEVICE)
    return fail(why, "CUDA device ordinal outside 0..1023", -EBADMSG);
  return 0;
}

static int check_bounds(uint16_t type, const ProtobufCMessage *message, const char **why) {
  int rc = check_fields(message, why);
  if (rc != 0)
    return rc;
  switch (type) {
  case ZEROD__V1__MSG_TYPE__MSG_ERROR: {
    const Zerod__V1__Error *error = (const Zerod__V1__Error *)message;
    if (!string_within(error->message, ZD_MAX_MESSAGE_BYTES))
      return fail(why, "error message longer than 1024 bytes", -EBADMSG);
    return 0;
  }
  case ZEROD__V1__MSG_TYPE__MSG_NOTICE: {
    const Zerod__V1__Notice *notice = (const Zerod__V1__Notice *)message;
    if (!string_within(notice->message, ZD_MAX_MESSAGE_BYTES))
      return fail(why, "notice message longer than 1024 bytes", -EBADMSG);
    return 0;
  }
  case ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY: {
    const Zerod__V1__AttachReply *reply = (const Zerod__V1__AttachReply *)message;
    if (!string_within(reply->warning, ZD_MAX_MESSAGE_BYTES))
      return fail(why, "attach warning longer than 1024 bytes", -EBADMSG);
    return 0;
  }
  case ZEROD__V1__MSG_TYPE__MSG_ATTACH: {
    const Zerod__V1__AttachRequest *attach = (const Zerod__V1__AttachRequest *)message;
    if ((rc = check_job_name(attach->job, why)) != 0)
      return rc;
    if (!string_within(attach->token, ZD_MAX_TOKEN_BYTES))
      return fail(why, "token longer than 256 bytes", -EBADMSG);
    return 0;
  }
  case ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT:
    return check_register_unit((const Zerod__V1__RegisterUnitRequest *)message, why);
  case ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY:
    return check_register_unit_reply((const Zerod__V1__RegisterUnitReply *)message, why);
  case ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY:
    return check_cuda_buffer(((const Zerod__V1__GatherReply *)message)->cuda, why);
  case ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY:
    return check_cuda_buffer(((const Zerod__V1__GradBufferReply *)message)->cuda, why);
  default:
    return 0;
  }
}

int zd_msg_unpack(uint16_t type, const uint8_t *payload, size_t payload_bytes,
                  ProtobufCMessage **out, const char **why) {
  static const uint8_t empty_payload[1];
  if (out == NULL)
    return fail(why, "no output message pointer", -EINVAL);
  *out = NULL;
  const ProtobufCMessageDescriptor *desc = zd_msg_descriptor(type);
  if (desc == NULL)
    return fail(why, "unknown message type", -EPROTO);
  if (payload_bytes > ZD_FRAME_MAX_PAYLOAD)
    return fail(why, "payload larger than the 4 MiB cap", -EMSGSIZE);
  if (payload == NULL && payload_bytes != 0)
    return fail(why, "no payload bytes", -EINVAL);

  /* protobuf-c would cut a string at a NUL byte (a job "a\0zzz" would be
   * job "a") and takes any bytes as UTF-8, so the strings are checked in
   * the bytes first. The message names the field, so it is built per call,
   * in a buffer of the calling thread that *why points to. */
  static _Thread_local char string_why[320];
  int rc = zd_pb_check_strings(desc, payload, payload_bytes, string_why, sizeof string_why);
  if (rc == -EBADMSG)
    return fail(why, "payload is not a valid protobuf message of its type", -EBADMSG);
  if (rc != 0)
    return fail(why, string_why, -EBADMSG);

  unpack_budget budget = {.left_bytes = UNPACK_BUDGET_BYTES};
  ProtobufCAllocator allocator = {
      .alloc = budget_alloc, .free = budget_free, .allocator_data = &budget};
  ProtobufCMessage *message = protobuf_c_message_unpack(desc, &allocator, payload_bytes,
                                                        payload != NULL ? payload : empty_payload);
  if (message == NULL) {
    if (budget.exceeded)
      return fail(why, "payload needs more than 16 MiB to decode", -EBADMSG);
    return fail(why, "payload is not a valid protobuf message of its type", -EBADMSG);
  }
  rc = check_bounds(type, message, why);
  if (rc != 0) {
    protobuf_c_message_free_unpacked(message, NULL);
    return rc;
  }
  *out = message;
  if (why != NULL)
    *why = NULL;
  return 0;
}

/* ------------------------------------------------------------------------
 * Reading frames
 * ------------------------------------------------------------------------ */

/* The reader reads ahead: one recvmsg takes up to ZD_FRAME_READ_BUFFER_BYTES
 * of whatever the socket holds, which may be several frames, and the frames
 * are then handed out one by one without another system call. The rest of
 * a payload that did not come with its header is read straight into the
 * payload's allocation, with the buffer behind it for what follows.
 *
 * Reading ahead means a recvmsg's SCM_RIGHTS descriptors have to be matched
 * with one of the frames it returned. Linux's AF_UNIX stream sockets decide
 * which (net/unix/af_unix.c):
 *
 *  - unix_stream_sendmsg attaches the descriptors of a sendmsg to the first
 *    skb it queues ("Only send the fds in the first buffer"), that is to
 *    the first byte the call writes. zd_frame_send (send_all below) and the
 *    daemon's send_some write each frame with its own sendmsg calls and
 *    pass the descriptors only with the call that writes its first byte.
 *    So a frame's descriptors ride on its first byte, on an skb that holds
 *    no other frame's first byte.
 *  - unix_stream_read_generic copies skb after skb into one recvmsg. When
 *    it reads from an skb that carries descriptors it detaches them and
 *    stops: at once if the skb has bytes left, else after unlinking it
 *    ("if (scm.fp) break;"). The first read from an skb starts at its first
 *    byte (we never use MSG_PEEK or SO_PEEK_OFF), and a sendmsg of no bytes
 *    queues no skb, so no descriptors come without bytes.
 *
 * Hence one recvmsg returns at most one set of descriptors; they belong to
 * the last skb it read from, and it returned that skb's first byte. The
 * rule the reader applies follows: the descriptors of a recvmsg (a
 * "chunk" of the stream) belong to the last frame whose first byte lies in
 * the chunk. The reader keeps the chunk's range of stream offsets with its
 * descriptors, and settles them when that frame is known: a frame whose
 * header is decoded ends where the next one starts, and a frame whose
 * header runs past the chunk is the last to start in it. Descriptors in a
 * chunk where no frame starts cannot come from a sender that follows the
 * protocol, and are a protocol error. A hostile sender can still put
 * descriptors on a later byte of a frame that one recvmsg returns with its
 * first byte; they then count as that frame's, and its fd count decides. */

static void close_fds(int *fds, unsigned nfds) {
  for (unsigned i = 0; i < nfds; i++) {
    if (fds[i] >= 0)
      close(fds[i]);
    fds[i] = -1;
  }
}

void zd_frame_reader_init(zd_frame_reader *reader) {
  memset(reader, 0, sizeof *reader);
  for (unsigned i = 0; i < ZD_FRAME_MAX_FDS; i++) {
    reader->fds[i] = -1;
    reader->chunk_fds[i] = -1;
  }
}

void zd_frame_reader_reset(zd_frame_reader *reader) {
  close_fds(reader->fds, reader->nfds);
  close_fds(reader->chunk_fds, reader->chunk_nfds);
  free(reader->payload);
  free(reader->buffer);
  zd_frame_reader_init(reader);
}

/* Drops everything the reader holds after a failure (the frame, the bytes
 * read ahead and their descriptors) but keeps the header when it was
 * decoded, so the caller can still name the request in its error. The
 * stream cannot be trusted after an error, so nothing read ahead is kept;
 * a reader used again starts afresh and never writes through a freed
 * payload. */
static int reader_fail(zd_frame_reader *reader, const char **why, const char *message, int err) {
  zd_frame_header header = reader->header;
  zd_frame_reader_reset(reader);
  reader->header = header;
  return fail(why, message, err);
}

/* Bytes read ahead and not yet part of a decoded frame. */
static size_t buffered_bytes(const zd_frame_reader *reader) {
  return reader->buffer_end - reader->buffer_start;
}

/* The buffered bytes are always the last ones received, so the first of
 * them sits at this offset of the stream. */
static uint64_t buffered_stream_offset(const zd_frame_reader *reader) {
  return reader->stream_bytes - buffered_bytes(reader);
}

/* Whether the last chunk's descriptors can belong to no frame: the frame
 * [frame_start, frame_end) reaches past the chunk, so no later frame
 * starts in it, and this one does not start in it either. frame_end is
 * UINT64_MAX while the frame's header is incomplete. */
static bool chunk_fds_orphaned(const zd_frame_reader *reader, uint64_t frame_start,
                               uint64_t frame_end) {
  if (reader->chunk_nfds == 0 || frame_end < reader->chunk_end)
    return false;
  return frame_start < reader->chunk_begin || frame_start >= reader->chunk_end;
}

/* Settles the last chunk's descriptors against the current frame
 * [frame_start, frame_end) (frame_end UINT64_MAX while its header is
 * incomplete, which also means the frame runs past the chunk). They stay
 * with the chunk while a later frame starts inside it; otherwise this
 * frame is the last that can start in the chunk, and they are its own, or
 * nobody's. */
static int settle_chunk_fds(zd_frame_reader *reader, uint64_t frame_start, uint64_t frame_end,
                            const char **why) {
  if (reader->chunk_nfds == 0 || frame_end < reader->chunk_end)
    return 0;
  if (chunk_fds_orphaned(reader, frame_start, frame_end))
    return reader_fail(reader, why, "file descriptors arrived without the first byte of a frame",
                       -EPROTO);
  /* A frame starts in one chunk only, so it has none yet. */
  for (unsigned i = 0; i < reader->chunk_nfds; i++) {
    reader->fds[i] = reader->chunk_fds[i];
    reader->chunk_fds[i] = -1;
  }
  reader->nfds = reader->chunk_nfds;
  reader->chunk_nfds = 0;
  return 0;
}

/* Advances the current frame with the bytes already read. Returns 1 when
 * it is complete, 0 when it needs bytes from the socket, or an error. */
static int reader_parse(zd_frame_reader *reader, const char **why) {
  if (!reader->header_decoded) {
    size_t buffered = buffered_bytes(reader);
    uint64_t frame_start = buffered_stream_offset(reader);
    if (buffered < ZD_FRAME_HEADER_BYTES) {
      /* A recvmsg comes next, and its chunk must find the last one's
       * descriptors settled: this frame runs past that chunk, so it is
       * the last frame that can start in it. */
      reader->have = buffered;
      return settle_chunk_fds(reader, frame_start, UINT64_MAX, why);
    }

    /* The header is decoded as soon as it is complete, so that a bad one
     * fails before any payload is read or allocated; the allocation is
     * then exactly the (capped) size it announces. */
    zd_frame_header header;
    const char *reason;
    int rc = zd_frame_header_decode(reader->buffer + reader->buffer_start, ZD_FRAME_HEADER_BYTES,
                                    &header, &reason);
    if (rc != 0)
      return reader_fail(reader, why, reason, rc);
    reader->header = header;
    reader->header_decoded = true;
    reader->frame_start = frame_start;
    rc = settle_chunk_fds(reader, frame_start,
                          frame_start + ZD_FRAME_HEADER_BYTES + header.payload_bytes, why);
    if (rc != 0)
      return rc;
    if (header.payload_bytes > 0) {
      reader->payload = malloc(header.payload_bytes);
      if (reader->payload == NULL)
        return reader_fail(reader, why, "out of memory for a frame payload", -ENOMEM);
    }
    reader->buffer_start += ZD_FRAME_HEADER_BYTES;
    size_t from_buffer = buffered_bytes(reader);
    if (from_buffer > header.payload_bytes)
      from_buffer = header.payload_bytes;
    if (from_buffer > 0)
      memcpy(reader->payload, reader->buffer + reader->buffer_start, from_buffer);
    reader->buffer_start += from_buffer;
    reader->have = ZD_FRAME_HEADER_BYTES + from_buffer;
  }
  if (reader->have < ZD_FRAME_HEADER_BYTES + (size_t)reader->header.payload_bytes)
    return 0;

  /* Whatever chunk the descriptors came in, they were settled when the
   * frame's header was: only now that the frame is whole is the count
   * final. */
  if (reader->nfds != reader->header.fd_count)
    return reader_fail(reader, why, "fd count does not match header", -EPROTO);
  return 1;
}

/* Keeps the SCM_RIGHTS descriptors of one recvmsg with its chunk. Returns
 * 0, or -EPROTO when they do not fit (the kernel truncated them, or more
 * than the cap came); those received are then closed. */
static int take_chunk_fds(zd_frame_reader *reader, struct msghdr *msg, const char **why) {
  int rc = 0;
  for (struct cmsghdr *cmsg = CMSG_FIRSTHDR(msg); cmsg != NULL; cmsg = CMSG_NXTHDR(msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS)
      continue;
    size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char *data = CMSG_DATA(cmsg);
    for (size_t i = 0; i < count; i++) {
      int fd;
      memcpy(&fd, data + i * sizeof fd, sizeof fd);
      if (reader->chunk_nfds < ZD_FRAME_MAX_FDS)
        reader->chunk_fds[reader->chunk_nfds++] = fd;
      else {
        close(fd);
        rc = -EPROTO;
      }
    }
  }
  if (rc != 0)
    return reader_fail(reader, why, "more than 4 file descriptors sent with one frame", rc);
  if (msg->msg_flags & MSG_CTRUNC)
    return reader_fail(reader, why, "file descriptors truncated (more than 4 sent)", -EPROTO);
  return 0;
}

/* One recvmsg: the rest of the current payload (when its header is
 * decoded) and then as much as the buffer holds. Returns 1 when bytes
 * came, 0 on EAGAIN, or an error. It is only called when no complete frame
 * is buffered, so what the buffer holds is the start of one header (under
 * 24 bytes), or nothing when a payload is being completed. */
static int reader_receive(zd_frame_reader *reader, int sock, const char **why) {
  if (reader->buffer == NULL) {
    reader->buffer = malloc(ZD_FRAME_READ_BUFFER_BYTES);
    if (reader->buffer == NULL)
      return reader_fail(reader, why, "out of memory for the frame read buffer", -ENOMEM);
  }
  if (reader->buffer_start > 0) {
    size_t buffered = buffered_bytes(reader);
    memmove(reader->buffer, reader->buffer + reader->buffer_start, buffered);
    reader->buffer_start = 0;
    reader->buffer_end = buffered;
  }

  struct iovec iov[2];
  int iov_count = 0;
  size_t payload_missing = 0;
  if (reader->header_decoded) {
    size_t payload_have = reader->have - ZD_FRAME_HEADER_BYTES;
    payload_missing = reader->header.payload_bytes - payload_have;
    iov[iov_count++] =
        (struct iovec){.iov_base = reader->payload + payload_have, .iov_len = payload_missing};
  }
  iov[iov_count++] = (struct iovec){.iov_base = reader->buffer + reader->buffer_end,
                                    .iov_len = ZD_FRAME_READ_BUFFER_BYTES - reader->buffer_end};
  union {
    struct cmsghdr align;
    char bytes[CMSG_SPACE(sizeof(int) * ZD_FRAME_MAX_FDS)];
  } control;
  struct msghdr msg = {.msg_iov = iov,
                       .msg_iovlen = (size_t)iov_count,
                       .msg_control = control.bytes,
                       .msg_controllen = sizeof control.bytes};
  ssize_t got;
  do {
    got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  if (got < 0) {
    int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK)
      return 0;
    return reader_fail(reader, why, "recvmsg on the IPC socket failed", -err);
  }
  int rc = take_chunk_fds(reader, &msg, why);
  if (rc != 0)
    return rc;
  if (got == 0)
    return reader_fail(reader, why,
                       reader->have == 0 ? "connection closed"
                                         : "connection closed in the middle of a frame",
                       -ECONNRESET);

  reader->chunk_begin = reader->stream_bytes;
  reader->stream_bytes += (uint64_t)got;
  reader->chunk_end = reader->stream_bytes;
  size_t into_payload = (size_t)got < payload_missing ? (size_t)got : payload_missing;
  reader->have += into_payload;
  reader->buffer_end += (size_t)got - into_payload;
  if (reader->header_decoded) {
    /* The chunk began inside this frame's payload, so its descriptors can
     * only be those of a frame that starts after this one ends. */
    rc = settle_chunk_fds(
        reader, reader->frame_start,
        reader->frame_start + ZD_FRAME_HEADER_BYTES + reader->header.payload_bytes, why);
    if (rc != 0)
      return rc;
  }
  return 1;
}

int zd_frame_read(zd_frame_reader *reader, int sock, const char **why) {
  if (why != NULL)
    *why = NULL;
  for (;;) {
    int rc = reader_parse(reader, why);
    if (rc != 0)
      return rc;
    rc = reader_receive(reader, sock, why);
    if (rc <= 0)
      return rc;
  }
}

bool zd_frame_reader_pending(const zd_frame_reader *reader) {
  if (reader->header_decoded)
    return reader->have == ZD_FRAME_HEADER_BYTES + (size_t)reader->header.payload_bytes;
  size_t buffered = buffered_bytes(reader);
  uint64_t frame_start = buffered_stream_offset(reader);
  if (buffered < ZD_FRAME_HEADER_BYTES)
    return chunk_fds_orphaned(reader, frame_start, UINT64_MAX);
  zd_frame_header header;
  if (zd_frame_header_decode(reader->buffer + reader->buffer_start, ZD_FRAME_HEADER_BYTES, &header,
                             NULL) != 0)
    return true;
  uint64_t frame_bytes = ZD_FRAME_HEADER_BYTES + (uint64_t)header.payload_bytes;
  return frame_bytes <= buffered ||
         chunk_fds_orphaned(reader, frame_start, frame_start + frame_bytes);
}

void zd_frame_reader_take(zd_frame_reader *reader, zd_frame_header *header, uint8_t **payload,
                          int *fds, unsigned *nfds) {
  *header = reader->header;
  *payload = reader->payload;
  for (unsigned i = 0; i < reader->nfds; i++) {
    fds[i] = reader->fds[i];
    reader->fds[i] = -1;
  }
  *nfds = reader->nfds;
  /* Ownership has moved to the caller: forget the frame without closing or
   * freeing. The bytes read ahead, and the descriptors of their chunk,
   * stay for the frames that follow. */
  memset(&reader->header, 0, sizeof reader->header);
  reader->header_decoded = false;
  reader->frame_start = 0;
  reader->have = 0;
  reader->payload = NULL;
  reader->nfds = 0;
}

/* ------------------------------------------------------------------------
 * Writing frames
 * ------------------------------------------------------------------------ */

/* Checks the arguments of a frame and returns its payload size. */
static int frame_check(uint16_t type, uint8_t flags, unsigned nfds, const ProtobufCMessage *msg,
                       size_t *payload_bytes) {
  const ProtobufCMessageDescriptor *desc = zd_msg_descriptor(type);
  if (desc == NULL || (flags & ~ZD_FRAME_F_KNOWN) != 0 || nfds > ZD_FRAME_MAX_FDS)
    return -EINVAL;
  if (msg != NULL && msg->descriptor != desc)
    return -EINVAL;
  size_t packed = msg != NULL ? protobuf_c_message_get_packed_size(msg) : 0;
  if (packed > ZD_FRAME_MAX_PAYLOAD)
    return -EMSGSIZE;
  *payload_bytes = packed;
  return 0;
}

static void frame_write(uint16_t type, uint64_t request_id, uint8_t flags, unsigned nfds,
                        const ProtobufCMessage *msg, size_t payload_bytes, uint8_t *out) {
  zd_frame_header header = {.magic = ZD_FRAME_MAGIC,
                            .version = ZD_FRAME_VERSION,
                            .type = type,
                            .request_id = request_id,
                            .payload_bytes = (uint32_t)payload_bytes,
                            .fd_count = (uint8_t)nfds,
                            .flags = flags};
  zd_frame_header_encode(&header, out);
  if (msg != NULL)
    protobuf_c_message_pack(msg, out + ZD_FRAME_HEADER_BYTES);
}

int zd_frame_encode(uint16_t type, uint64_t request_id, uint8_t flags, unsigned nfds,
                    const ProtobufCMessage *msg, uint8_t **out, size_t *out_bytes) {
  size_t payload_bytes;
  int rc = frame_check(type, flags, nfds, msg, &payload_bytes);
  if (rc != 0)
    return rc;
  uint8_t *frame = malloc(ZD_FRAME_HEADER_BYTES + payload_bytes);
  if (frame == NULL)
    return -ENOMEM;
  frame_write(type, request_id, flags, nfds, msg, payload_bytes, frame);
  *out = frame;
  *out_bytes = ZD_FRAME_HEADER_BYTES + payload_bytes;
  return 0;
}

static int64_t now_ms(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

/* Waits until sock is writable or the deadline (-1: none) passes. */
static int wait_writable(int sock, int64_t deadline_ms) {
  for (;;) {
    int wait_ms = -1;
    if (deadline_ms >= 0) {
      int64_t left_ms = deadline_ms - now_ms();
      if (left_ms <= 0)
        return -ETIMEDOUT;
      wait_ms = left_ms > 1000000 ? 1000000 : (int)left_ms;
    }
    struct pollfd pfd = {.fd = sock, .events = POLLOUT};
    int ready = poll(&pfd, 1, wait_ms);
    if (ready > 0)
      return 0; /* POLLERR and POLLHUP surface as the next sendmsg's error. */
    if (ready < 0 && errno != EINTR)
      return -errno;
  }
}

static int send_all(int sock, const uint8_t *frame, size_t frame_bytes, const int *fds,
                    unsigned nfds, int timeout_ms) {
  int64_t deadline_ms = timeout_ms >= 0 ? now_ms() + timeout_ms : -1;
  union {
    struct cmsghdr align;
    char bytes[CMSG_SPACE(sizeof(int) * ZD_FRAME_MAX_FDS)];
  } control;
  size_t sent = 0;
  while (sent < frame_bytes) {
    struct iovec iov = {.iov_base = (void *)(frame + sent), .iov_len = frame_bytes - sent};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    /* The descriptors ride on the first byte of the frame, which is how
     * the reader tells whose they are (see "Reading frames"). */
    if (sent == 0 && nfds > 0) {
      memset(&control, 0, sizeof control);
      msg.msg_control = control.bytes;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
      struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
      memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * nfds);
    }
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) {
      sent += (size_t)n;
      continue;
    }
    if (errno == EINTR)
      continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return -errno;
    int rc = wait_writable(sock, deadline_ms);
    if (rc != 0)
      return rc;
  }
  return 0;
}

int zd_frame_send(int sock, uint16_t type, uint64_t request_id, uint8_t flags,
                  const ProtobufCMessage *msg, const int *fds, unsigned nfds, int timeout_ms) {
  size_t payload_bytes;
  int rc = frame_check(type, flags, nfds, msg, &payload_bytes);
  if (rc != 0)
    return rc;
  if (nfds > 0 && fds == NULL)
    return -EINVAL;
  /* Most frames are small requests and replies: those are built on the
   * stack so that a round trip costs no allocation. */
  uint8_t small[512];
  size_t frame_bytes = ZD_FRAME_HEADER_BYTES + payload_bytes;
  uint8_t *frame = frame_bytes <= sizeof small ? small : malloc(frame_bytes);
  if (frame == NULL)
    return -ENOMEM;
  frame_write(type, request_id, flags, nfds, msg, payload_bytes, frame);
  rc = send_all(sock, frame, frame_bytes, fds, nfds, timeout_ms);
  if (frame != small)
    free(frame);
  return rc;
}
