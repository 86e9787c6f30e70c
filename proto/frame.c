/* Framing of the local IPC protocol: the 24-byte header, the map from frame
 * types to protobuf-c messages, and the bounds every decoded message must
 * meet. The reading and writing of whole frames (with their SCM_RIGHTS file
 * descriptors) on a Unix stream socket is frame_io.c.
 *
 * Everything here treats its input as hostile: the header is checked field
 * by field before anything is allocated, the payload buffer is exactly the
 * size the (checked) header announces, a payload is unpacked through an
 * allocator with a fixed budget, and a decoded message is checked against
 * the protocol's bounds before it is handed out. The daemon and libzerod
 * both use this file, so a worker and the daemon agree on what is valid. */
#include "frame.h"

#include "names.h"
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
  case ZEROD__V1__MSG_TYPE__MSG_WATCH:
    return &zerod__v1__watch_version_request__descriptor;
  case ZEROD__V1__MSG_TYPE__MSG_WATCH_REPLY:
    return &zerod__v1__watch_version_reply__descriptor;
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
  for (const char *c = job; *c != '\0'; c++)
    if (!zd_name_char(*c))
      return fail(why, "job name has a character outside [A-Za-z0-9._-]", -EBADMSG);
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
