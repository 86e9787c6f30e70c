/* ctl_decode: the decoders of the control plane's outside bytes.
 *
 * Every request the coordinator (coord_*.c, ckpt_*.c) serves arrives as
 * bytes from a gRPC client nobody here wrote. This module is the one place
 * that turns them into messages: it unpacks them with protobuf-c and then
 * checks everything the handlers rely on (names, ranges, string and list
 * sizes, UTF-8 in strings that are echoed back to other clients), so that
 * a handler only ever sees a well-formed request and only has to decide
 * what it means against the coordinator's state.
 *
 * The limits are part of the protocol and are documented, with the RPCs
 * that use them, in docs/control-plane.md. */
#ifndef ZEROD_CTL_DECODE_H
#define ZEROD_CTL_DECODE_H

#include <stddef.h>
#include <stdint.h>

#include "zerod/v1/control.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

/* Method paths. */
#define CTL_JOIN              "/zerod.v1.Cluster/Join"
#define CTL_HEARTBEAT         "/zerod.v1.Cluster/Heartbeat"
#define CTL_LEAVE             "/zerod.v1.Cluster/Leave"
#define CTL_GET_VIEW          "/zerod.v1.Cluster/GetView"
#define CTL_WATCH             "/zerod.v1.Cluster/Watch"
#define CTL_CREATE_JOB        "/zerod.v1.Jobs/CreateJob"
#define CTL_GET_JOB           "/zerod.v1.Jobs/GetJob"
#define CTL_LIST_JOBS         "/zerod.v1.Jobs/ListJobs"
#define CTL_DELETE_JOB        "/zerod.v1.Jobs/DeleteJob"
#define CTL_ISSUE_READ_TOKEN  "/zerod.v1.Jobs/IssueReadToken"
#define CTL_PUT               "/zerod.v1.Rendezvous/Put"
#define CTL_GET               "/zerod.v1.Rendezvous/Get"
#define CTL_DELETE            "/zerod.v1.Rendezvous/Delete"
#define CTL_HEALTH_CHECK      "/grpc.health.v1.Health/Check"
#define CTL_HEALTH_WATCH      "/grpc.health.v1.Health/Watch"
#define CTL_SAVE              "/zerod.v1.Checkpoints/Save"
#define CTL_LIST_CHECKPOINTS  "/zerod.v1.Checkpoints/List"
#define CTL_DELETE_CHECKPOINT "/zerod.v1.Checkpoints/Delete"
#define CTL_RESTORE           "/zerod.v1.Checkpoints/Restore"
#define CTL_EXPORT            "/zerod.v1.Checkpoints/Export"
#define CTL_FREEZE_JOB        "/zerod.v1.Jobs/FreezeJob"
#define CTL_SCALE_JOB         "/zerod.v1.Jobs/ScaleJob"
#define CTL_LOCATE_JOB        "/zerod.v1.Jobs/LocateJob"

/* Limits on requests (docs/control-plane.md, "Limits"). */
#define CTL_NAME_MAX_BYTES    64         /* node and job names */
#define CTL_ADDRESS_MAX_BYTES 255        /* NodeInfo.address */
#define CTL_MAX_RANKS         64         /* ranks of a node, world of a job */
#define CTL_MAX_REPLICA_SETS  8          /* steps of in-memory copies a node reports per job */
#define CTL_MAX_DEVICES       256        /* NodeInfo.devices */
#define CTL_TEXT_MAX_BYTES    256        /* device kind and name, version, service */
#define CTL_MAX_JOB_REPORTS   4096       /* HeartbeatRequest.jobs */
#define CTL_ERROR_MAX_BYTES   1024       /* JobStatus.error */
#define CTL_TOKEN_MAX_BYTES   256        /* CreateJobRequest.token */
#define CTL_KEY_MAX_BYTES     512        /* rendezvous keys */
#define CTL_VALUE_MAX_BYTES   (1u << 20) /* rendezvous values */
#define CTL_MAX_SHARD_REPORTS 256        /* JobStatus.saves, JobStatus.restores */
#define CTL_FILE_MAX_BYTES    255        /* ShardReport.file */
#define CTL_PATH_MAX_BYTES    4000 /* RestoreRequest.checkpoint as a path, ExportRequest.path */
#define CTL_MAX_SHARED_WITH   64   /* FreezeJobRequest.shared_with: tenants */

/* The number of methods ctl_decode knows (the paths above). */
#define CTL_NMETHODS 23

/* The path of method i (0 <= i < CTL_NMETHODS), and the descriptor of its
 * request message, for tests and fuzzing; NULL past the end. */
const char *ctl_method_path(unsigned i);
const ProtobufCMessageDescriptor *ctl_method_request(unsigned i);

/* Unpacks request bytes as the request of the method at path and validates
 * them. Returns 0 with *out set to the message (the caller frees it with
 * ctl_free), or a gRPC status (rpc.h) with *out NULL and a message in err
 * that says what is wrong: RPC_INVALID_ARGUMENT for bytes that are not a
 * valid request, RPC_UNIMPLEMENTED for a path that is not a method. Never
 * reads outside bytes[0, nbytes). */
int ctl_decode(const char *path, const uint8_t *bytes, size_t nbytes, ProtobufCMessage **out,
               char *err, size_t err_bytes);

/* Unpacks a control-plane message that is not a request but comes from
 * outside the process all the same: a reply or a Watch event the
 * coordinator sent a node, or the coordinator's state file. Like a
 * request, every string in it must be free of NUL bytes and well-formed
 * UTF-8 (zd_pb_check_strings, before protobuf-c unpacks it); what the
 * fields mean is the caller's to check. Returns 0 with *out set (free
 * with ctl_free), or -EBADMSG with *out NULL and a message in err that
 * names the bad field or says the bytes are not a valid message of desc's
 * type (which includes an unknown field numbered 0, as for requests: it
 * would not survive being packed again). Never reads outside
 * bytes[0, nbytes). */
int ctl_decode_message(const ProtobufCMessageDescriptor *desc, const uint8_t *bytes, size_t nbytes,
                       ProtobufCMessage **out, char *err, size_t err_bytes);

/* Frees a message from ctl_decode or ctl_decode_message (NULL is allowed). */
void ctl_free(ProtobufCMessage *msg);

/* Returns 1 if s is a valid node or job name: 1..64 bytes of
 * [A-Za-z0-9._-]. */
int ctl_valid_name(const char *s);

/* Returns 1 if s is a valid name for a checkpoint directory: a name (as
 * above) that does not start with '.' and does not contain ".tmp-" or
 * ".deleting-", which mark the coordinator's unfinished saves and deletes.
 * (Save also refuses the "auto-" prefix, which periodic checkpoints use.) */
int ctl_valid_checkpoint_name(const char *s);

/* Returns 1 if s is a job name that can name a directory: a valid name
 * other than "." and "..". */
int ctl_valid_job_dir_name(const char *s);

/* A job's checkpoint directory is named by the job, "<job>", while the job
 * lives; when it is deleted the directory becomes "<job>@<id>" (its job
 * id), so that a later job of the same name starts with none of them
 * (docs/checkpoints.md, "Ownership"). The longest such name: */
#define CTL_CKPT_DIR_MAX_BYTES (CTL_NAME_MAX_BYTES + 20)

/* Returns 1 if s names a job's checkpoint directory: a job directory name
 * (above), or one followed by '@' and a job id (1..19 digits, no leading
 * zero). With job_out (CTL_NAME_MAX_BYTES + 1 bytes) and id_out, gives the
 * parts (id 0 for a live job's "<job>"). */
int ctl_parse_checkpoint_dir(const char *s, char *job_out, uint64_t *id_out);

/* What RestoreRequest.checkpoint names. */
typedef enum ctl_checkpoint_ref {
  CTL_REF_INVALID = 0,
  CTL_REF_NAME = 1,     /* "<name>": a checkpoint of the restored job */
  CTL_REF_JOB_NAME = 2, /* "<dir>/<name>": a checkpoint of another job, or of a deleted one */
  CTL_REF_PATH = 3,     /* "/...": a checkpoint directory or a .safetensors file */
} ctl_checkpoint_ref;

/* Parses a checkpoint reference. For CTL_REF_NAME and CTL_REF_JOB_NAME,
 * dir_out (may be NULL for CTL_REF_NAME; CTL_CKPT_DIR_MAX_BYTES + 1
 * bytes: a checkpoint directory, "<job>" or "<job>@<id>") and name_out
 * (CTL_NAME_MAX_BYTES + 1 bytes) receive the parts. */
ctl_checkpoint_ref ctl_parse_checkpoint_ref(const char *ref, char *dir_out, char *name_out);

/* Makes s (NUL-terminated) text that check_text accepts, in place: every
 * control character and every byte that does not start or continue
 * well-formed UTF-8 becomes '?', and it is cut to at most max_bytes bytes
 * at a character boundary. For what a node puts in a Heartbeat (errors
 * carry paths and other bytes from outside): one bad byte must not get the
 * whole heartbeat refused. */
void ctl_text_sanitize(char *s, size_t max_bytes);

/* Checks a job config with the node's rules: job_config_from_proto and
 * job_config_finish (model/config.c), the one copy of the ranges, so that a
 * config that a node would refuse is refused at CreateJob and never
 * assigned, with the node's message. NULL (every default) is valid.
 * Returns 0 or -EINVAL with a message in err. */
int ctl_check_job_config(const Zerod__V1__JobConfig *config, char *err, size_t err_bytes);

/* Checks a CreateJob request as ctl_decode does. The coordinator checks
 * again the request it makes of one on a base (JobConfig.base_job), whose
 * nodes, ranks_per_node (0 there: the base's) and working dtype it takes
 * from the base. Returns 0 or -EINVAL with a message in err. */
int ctl_check_create_job(const Zerod__V1__CreateJobRequest *request, char *err, size_t err_bytes);

/* Checks a stored job (from the state file) like a CreateJob request, plus
 * its placement. Returns 0 or -EINVAL with a message in err. */
int ctl_check_stored_job(const Zerod__V1__StoredJob *stored, char *err, size_t err_bytes);

/* Checks a deleted job's record of the state file: a job name, an id
 * other than 0, a tenant name or "". Returns 0 or -EINVAL with err. */
int ctl_check_retired_job(const Zerod__V1__RetiredJob *retired, char *err, size_t err_bytes);

#endif /* ZEROD_CTL_DECODE_H */
