/* zerodctl_impl: what the files of zerodctl share (docs/zerodctl.md is the
 * user's guide; docs/architecture.md lists the files).
 *
 * zerodctl is one program cut along its jobs, each file calling only the
 * files listed after it, never back:
 *
 *   zerodctl.c            the entry: help texts, the command table, dispatch
 *   zerodctl_options.c    the options, before or after the command
 *   zerodctl_checkpoint.c checkpoint save, list, delete, restore; export
 *   zerodctl_cluster.c    members, health
 *   zerodctl_create.c     jobs create: its options checked into a request
 *   zerodctl_deepspeed.c  jobs create --deepspeed-config: the file read (its
 *                         own header, zerodctl_deepspeed.h: jansson only)
 *   zerodctl_bases.c      jobs freeze, bases list (docs/bases.md)
 *   zerodctl_jobs.c       jobs list, get, delete, read-token; how a job prints
 *   zerodctl_args.c       checks of names, numbers and addresses typed
 *   zerodctl_call.c       calls to the coordinator, its credentials
 *   zerodctl_output.c     one error line on stderr; JSON, tables and values
 *                         for people on stdout; the names of enum values
 *
 * Included by the zerodctl*.c files only; top.c (zerodctl top) has its own
 * header, top.h. Names shared between the files are ctl__*; the types and
 * limits below are the program's own. */
#ifndef ZEROD_ZERODCTL_IMPL_H
#define ZEROD_ZERODCTL_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <jansson.h>

#include "grpc/health/v1/health.pb-c.h"
#include "paths.h"
#include "rpc.h"
#include "zerod/v1/control.pb-c.h"

#define CTL_DEFAULT_COORDINATOR  "127.0.0.1:7070"
#define CTL_DEFAULT_TIMEOUT_S    10.0
#define CTL_CHECKPOINT_TIMEOUT_S 600.0 /* checkpoint save and restore, without --timeout */
#define CTL_MAX_TIMEOUT_S        86400.0
#define CTL_NAME_MAX_BYTES       64 /* node and job names (control.proto) */
#define CTL_MAX_NODES            64 /* nodes of one job (CreateJobRequest) */
#define CTL_MAX_RANKS            64 /* ranks per node, and world size */
#define CTL_TOKEN_MAX_BYTES      256
#define CTL_TARGET_MAX_BYTES     255
#define CTL_PATH_MAX_BYTES       4000 /* a checkpoint path (RestoreRequest) */
#define CTL_ERROR_LINE_BYTES     1024

/* Exit statuses (docs/zerodctl.md). */
enum { CTL_EXIT_OK = 0, CTL_EXIT_FAILED = 1, CTL_EXIT_USAGE = 2 };

/* A table for people: a header and rows of cells, printed aligned. */
#define TABLE_MAX_COLUMNS 9
#define TABLE_CELL_BYTES  256

typedef struct table {
  size_t columns;
  const char *headers[TABLE_MAX_COLUMNS];
  size_t rows, capacity; /* in rows */
  char **cells;          /* rows * columns strings, owned */
} table;

/* ------------------------------------------------------------------------ */
/* zerodctl_output.c                                                        */
/* ------------------------------------------------------------------------ */

/* Errors: one line on stderr, "zerodctl: <message>", stripped of control
 * characters; each returns status, the exit status to return. */
void ctl__sanitize_line(char *s);
int ctl__fail_line(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define ctl__usage_error(...) ctl__fail_line(CTL_EXIT_USAGE, __VA_ARGS__)

/* JSON values, each a new reference (NULL without memory, which
 * json_object_set_new and json_array_append_new then refuse): a string,
 * any bytes made valid UTF-8 (U+FFFD for the others); a 64-bit id as a
 * decimal string, as protobuf's JSON mapping writes one, since readers
 * that keep numbers as doubles (jq, JavaScript) round past 2^53; a count
 * (steps, ranks, bytes) as an integer (a string past INT64_MAX); a real,
 * null for NaN and infinities. Counts that are signed (milliseconds) are
 * json_integer's, booleans json_boolean's. */
json_t *ctl__json_str(const char *s);
json_t *ctl__json_id(uint64_t id);
json_t *ctl__json_count(uint64_t n);
json_t *ctl__json_real(double v);
/* Prints root on stdout, compact, on one line, and drops the reference.
 * Returns the exit status (an error line printed when it fails). */
int ctl__json_print(json_t *root);

/* Tables for people: rows of TABLE_CELL_BYTES cells, printed aligned. */
void ctl__table_init(table *t, size_t columns, const char *const *headers);
void ctl__table_free(table *t);
int ctl__table_add_row(table *t, char cell_text[][TABLE_CELL_BYTES]);
void ctl__table_print(const table *t, FILE *out);

/* Values for people; each writes out and returns it. */
const char *ctl__format_bytes(uint64_t bytes, char *out, size_t out_bytes);
const char *ctl__format_unix_ms(int64_t unix_ms, char *out, size_t out_bytes);
const char *ctl__format_ms(int64_t ms, char *out, size_t out_bytes);
void ctl__print_field(const char *key, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The names of enum values, as --json and the tables print them. */
const char *ctl__optimizer_name(Zerod__V1__OptimizerKind kind);
const char *ctl__offload_name(const Zerod__V1__OffloadConfig *off);
const char *ctl__precision_name(Zerod__V1__Dtype dtype);
const char *ctl__serving_status_name(Grpc__Health__V1__HealthCheckResponse__ServingStatus s,
                                     bool lower);

/* One invocation: the command line's settings and the channel. */
typedef struct ctl {
  const char *coordinator; /* HOST:PORT or unix:PATH */
  /* No --coordinator nor ZEROD_COORDINATOR: a local daemon's control
   * socket found in its default place (paths.h), else the default address;
   * where it looked, for the error when nothing answers. */
  bool coordinator_defaulted;
  char local_target[ZPATH_MAX + 8];
  char looked[ZPATH_CANDIDATES * (ZPATH_MAX + 2)];
  double timeout_s;
  int timeout_ms;
  bool json;
  const char *command; /* "jobs get", for error lines */
  rpc_channel *channel;
  /* export's options */
  const char *export_checkpoint; /* NULL: the job's state now */
  const char *export_dtype;      /* NULL: fp32 */
  bool export_overwrite;
  /* jobs freeze's options */
  const char *freeze_share; /* --share T1,T2; NULL: shared with none */
  bool freeze_public;       /* --public */
  /* How to reach the coordinator (docs/security.md). */
  bool use_tls;
  rpc_tls tls;
  char token[RPC_MAX_TOKEN_BYTES + 1]; /* "": none */
} ctl;

/* ------------------------------------------------------------------------ */
/* zerodctl_args.c                                                          */
/* ------------------------------------------------------------------------ */

/* Names of nodes, jobs and tenants: 1..64 bytes of [A-Za-z0-9._-]. */
bool ctl__valid_name(const char *s);
/* Checkpoint names: valid names, not hidden, without the coordinator's
 * marks of unfinished saves and deletes. */
bool ctl__valid_checkpoint_name(const char *s);
/* Job names that name a directory of checkpoints (not "." or ".."). */
bool ctl__valid_job_dir_name(const char *s);
/* A job's checkpoint directory: JOB, or a deleted job's JOB@ID. */
bool ctl__valid_checkpoint_dir(const char *s);
/* NAME, JOB/NAME, JOB@ID/NAME, or an absolute path. */
bool ctl__valid_checkpoint_ref(const char *s);
/* HOST:PORT or unix:PATH. */
bool ctl__valid_target(const char *s);
/* A token: 1..256 printable characters, no spaces. */
bool ctl__valid_token(const char *s);

/* Numbers: 0, or -1 when s is not one in range. */
int ctl__parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out);
int ctl__parse_double(const char *s, double lo, double hi, bool hi_open, double *out);
int ctl__parse_timeout(const char *s, double *out);

/* The arguments of `export` and of the `checkpoint` commands, checked
 * before anything is sent: 0, or the usage exit status (the line
 * printed). */
int ctl__check_export_args(const ctl *c, char **argv);
int ctl__check_checkpoint_args(const char *command, int argc, char **argv);

/* ------------------------------------------------------------------------ */
/* zerodctl_call.c                                                          */
/* ------------------------------------------------------------------------ */

/* Makes one unary call: packs request, waits up to the timeout, unpacks
 * the reply as reply_type into *reply (caller frees with
 * protobuf_c_message_free_unpacked). On failure prints the error line and
 * returns the exit status; returns 0 on success. */
int ctl__call(ctl *c, const char *method, const ProtobufCMessage *request,
              const ProtobufCMessageDescriptor *reply_type, ProtobufCMessage **reply);

/* Settles how c reaches the coordinator: TLS and the token from the flags,
 * else the environment; plain transport to another host only with
 * --insecure. Returns 0 or the usage exit status. */
int ctl__security_setup(ctl *c, const char *token_file, bool insecure);

/* ------------------------------------------------------------------------ */
/* The commands                                                             */
/* ------------------------------------------------------------------------ */

/* A command: argv holds its arguments (argc of them, counted against the
 * command table); returns the exit status, the error line printed. */
typedef int ctl_command_fn(ctl *c, int argc, char **argv);

/* zerodctl_checkpoint.c */
ctl_command_fn ctl__cmd_checkpoint_save, ctl__cmd_checkpoint_list, ctl__cmd_checkpoint_delete,
    ctl__cmd_checkpoint_restore, ctl__cmd_export;

/* zerodctl_cluster.c */
ctl_command_fn ctl__cmd_members, ctl__cmd_health;

/* zerodctl_create.c */
/* The options of `jobs create`, as given (checked in ctl__cmd_jobs_create). */
typedef struct create_options {
  const char *nodes, *ranks_per_node, *optimizer, *lr, *weight_decay, *betas, *eps, *momentum,
      *precision, *collectives, *quantized_weights, *quantization_block, *quantized_gradients,
      *gradient_comm_dtype, *hpz_partition_size, *onebit_freeze_step, *powersgd_rank, *powersgd_start_step, *offload, *nvme_path,
      *offload_buffer_count, *offload_buffer_size, *offload_pin_memory, *max_grad_norm,
      *max_live_bytes, *max_host_bytes, *max_device_bytes, *max_sessions, *token, *tenant, *base,
      *every_steps, *every_seconds, *keep, *redundancy, *redundancy_every, *deepspeed_config;
  const char *node_lists[CTL_MAX_NODES]; /* each --node A[,B...] */
  size_t n_node_lists;
} create_options;

int ctl__cmd_jobs_create(ctl *c, const char *name, const create_options *o);

/* zerodctl_bases.c */
ctl_command_fn ctl__cmd_jobs_freeze, ctl__cmd_bases_list, ctl__cmd_jobs_scale;
/* --share's tenants, checked: 0, or the usage exit status. */
int ctl__check_freeze_args(const ctl *c);

/* zerodctl_jobs.c */
ctl_command_fn ctl__cmd_jobs_list, ctl__cmd_jobs_get, ctl__cmd_jobs_delete,
    ctl__cmd_jobs_read_token;
/* A job as a JSON object, and for people, one field per line. */
json_t *ctl__json_job(const Zerod__V1__Job *job);
void ctl__print_job(const Zerod__V1__Job *job);
/* Lists the jobs: as JSON, {json_key: [every job row takes]}; for
 * people, a table of columns (at most TABLE_MAX_COLUMNS) with a row of
 * the jobs row takes. row(job, NULL) says whether it takes job;
 * row(job, cells) fills its cells too. Returns the exit status. */
typedef bool ctl_job_row(const Zerod__V1__Job *job, char cells[][TABLE_CELL_BYTES]);
int ctl__list_jobs(ctl *c, const char *json_key, const char *const *headers, size_t columns,
                   ctl_job_row *row);
/* Calls method, whose reply is a Job, and prints the job as `jobs get`
 * does. Returns the exit status. */
int ctl__call_job(ctl *c, const char *method, const ProtobufCMessage *request);
/* "a,b,c" of a job's nodes, for tables; past three names, "a,b,c,+5". */
void ctl__format_job_nodes(const Zerod__V1__Job *job, char *out, size_t out_bytes);
/* Whom a base is shared with, for people: "team-b,team-c", "every
 * tenant (public)" or "no other tenant". */
void ctl__format_sharing(const Zerod__V1__Job *job, char *out, size_t out_bytes);

/* ------------------------------------------------------------------------ */
/* zerodctl_options.c                                                       */
/* ------------------------------------------------------------------------ */

/* Options that belong to one command, refused with any other: the first
 * one given of each, as spelled. */
typedef struct owned_option {
  const char *command;
  int first_opt, last_opt; /* its OPT_ range */
  char given[64];          /* "" if none */
} owned_option;

/* What the options said, besides what they set in the ctl. */
typedef struct ctl_options {
  create_options create;  /* jobs create's, as given */
  owned_option owned[3];  /* jobs create's, export's, jobs freeze's */
  bool help, version;     /* --help, --version */
  bool timeout_given;     /* --timeout */
  bool insecure;          /* --insecure */
  const char *token_file; /* --auth-token-file, or NULL */
} ctl_options;

/* Parses argv's options into c and o (getopt_long: optind is then the
 * first word that is not an option). Returns 0, or the usage exit status
 * with the error line printed. */
int ctl__parse_options(int argc, char **argv, ctl *c, ctl_options *o);
/* Refuses an option given that belongs to a command other than command:
 * 0, or the usage exit status. */
int ctl__check_owned_options(const ctl_options *o, const char *command);

#endif /* ZEROD_ZERODCTL_IMPL_H */
