/* zerodctl: the command line of the control plane (docs/architecture.md).
 *
 * Each invocation makes one or two blocking unary calls to the coordinator
 * (rpc.h's client half, protobuf-c messages from control.proto and
 * health.proto), every call with the --timeout deadline (checkpoint save
 * and restore, and export, wait for the whole operation: 600 s unless
 * --timeout is given), and prints the
 * result either for people (aligned tables, "key: value" lines) or, with
 * --json, as exactly one JSON object on stdout for scripts.
 *
 * The contract with scripts: exit status 0 on success, 1 when a call fails
 * (or the health check is not SERVING), 2 for a usage error; on failure
 * exactly one line on stderr, "zerodctl: <what>: <STATUS>: <message>", and
 * nothing else there. gRPC's own logging is therefore silenced (unless the
 * user asked for it with GRPC_VERBOSITY), and every string that came from
 * the command line or the coordinator is stripped of control characters
 * before it reaches the terminal. docs/zerodctl.md is the user's guide. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grpc/health/v1/health.pb-c.h"
#include "log.h"
#include "rpc.h"
#include "size.h"
#include "top.h"
#include "zerod/v1/control.pb-c.h"
#include "zerodctl_impl.h"

#ifndef ZEROD_VERSION
#define ZEROD_VERSION "0.1.0"
#endif

/* ------------------------------------------------------------------------ */
/* Command line                                                             */
/* ------------------------------------------------------------------------ */

static const char general_usage[] =
    "usage: zerodctl [options] COMMAND [ARGS...]\n"
    "\n"
    "The command line of zerod's control plane: talks to the coordinator over gRPC.\n"
    "\n"
    "commands:\n"
    "  members                  the coordinator's view: epoch and live nodes\n"
    "  jobs list                every job, one per line\n"
    "  jobs get NAME            one job in full: placement, config, state\n"
    "  jobs create NAME [opts]  create a job (see zerodctl jobs create --help)\n"
    "  jobs delete NAME         delete a job\n"
    "  jobs read-token NAME     a new token that attaches read-only sessions only\n"
    "  checkpoint save JOB [NAME]\n"
    "                           checkpoint a ready job (NAME default: step-<step>);\n"
    "                           waits for it (600 s unless --timeout)\n"
    "  checkpoint list [JOB]    the checkpoints you may read, of every job or of JOB\n"
    "                           (a deleted job's are under JOB@ID, its id)\n"
    "  checkpoint delete JOB NAME\n"
    "                           delete a checkpoint (JOB@ID: of a deleted job)\n"
    "  checkpoint restore JOB CHECKPOINT\n"
    "                           restore a ready job from NAME, OTHERJOB/NAME,\n"
    "                           OLDJOB@ID/NAME (a deleted job's), or an\n"
    "                           absolute path (a checkpoint directory or a\n"
    "                           .safetensors file inside the coordinator's checkpoint\n"
    "                           directory or export roots); waits (600 s unless\n"
    "                           --timeout)\n"
    "  export JOB FILE [--checkpoint CHECKPOINT] [--dtype fp32|bf16] [--overwrite]\n"
    "                           write the full weights of JOB's state now (or of\n"
    "                           CHECKPOINT: NAME, OTHERJOB/NAME, OLDJOB@ID/NAME or a\n"
    "                           directory) to one safetensors FILE, written by the\n"
    "                           coordinator inside its export roots (relative:\n"
    "                           inside the first; default root: its checkpoint\n"
    "                           directory);\n"
    "                           waits (600 s unless --timeout)\n"
    "  health [SERVICE]         grpc.health.v1 check; exit 0 only when SERVING\n"
    "  top [--metrics HOST:PORT]...\n"
    "                           a live table of jobs and ranks from the daemons'\n"
    "                           metrics (its options follow it: zerodctl top --help)\n"
    "\n"
    "options (before or after the command):\n"
    "  -c, --coordinator HOST:PORT  the coordinator, or unix:DIR/control.sock for a\n"
    "                               standalone zerod [ZEROD_COORDINATOR, default\n"
    "                               " CTL_DEFAULT_COORDINATOR "]\n"
    "  -j, --json                   print one JSON object (for scripts)\n"
    "  -t, --timeout SECONDS        deadline of each call [default 10; checkpoint save\n"
    "                               and restore, and export 600]\n"
    "      --tls-ca FILE            reach the coordinator over TLS, verifying it with\n"
    "                               this CA (PEM) [ZEROD_TLS_CA]\n"
    "      --tls-cert FILE          client certificate for mutual TLS [ZEROD_TLS_CERT]\n"
    "      --tls-key FILE           its private key [ZEROD_TLS_KEY]\n"
    "      --tls-server-name NAME   name to expect in the coordinator's certificate\n"
    "                               [ZEROD_TLS_SERVER_NAME, default: its host]\n"
    "      --auth-token-file FILE   bearer token of your principal [ZEROD_AUTH_TOKEN_FILE,\n"
    "                               or the token itself in ZEROD_AUTH_TOKEN]\n"
    "      --insecure               allow plain TCP to a coordinator on another host\n"
    "  -h, --help                   print help (of a command, after it) and exit\n"
    "      --version                print the version and exit\n"
    "\n"
    "exit status: 0 success, 1 the call failed (or not SERVING), 2 usage error;\n"
    "on failure one line on stderr.\n";

static const char create_usage[] =
    "usage: zerodctl jobs create NAME [options]\n"
    "\n"
    "Creates job NAME and prints it with its owner token (workers attach with it).\n"
    "\n"
    "options:\n"
    "  --nodes N                nodes to place the job on, 1..64 [default 1, or the\n"
    "                           number of --node names]\n"
    "  --ranks-per-node R       ranks on each node, 1..64 [default 1]; at most 64 in all\n"
    "  --node A[,B...]          the nodes, in rank order (repeatable) [default: the first\n"
    "                           N live members by name with room]\n"
    "  --optimizer KIND         adamw, adam or sgd [default adamw]\n"
    "  --lr X                   learning rate [default 0.001]\n"
    "  --weight-decay X         [default 0.01 for adamw, 0 else]\n"
    "  --betas B1,B2            adamw and adam [default 0.9,0.999]\n"
    "  --eps X                  adamw and adam [default 1e-08]\n"
    "  --momentum X             sgd [default 0]\n"
    "  --precision P            working copy precision: fp32, bf16 or fp16 (with dynamic\n"
    "                           loss scaling from 65536) [default fp32]\n"
    "  --collectives C          hierarchical (node first, then across nodes: fewer\n"
    "                           bytes between nodes) or flat (sums in rank order,\n"
    "                           bit-identical to one process) [default hierarchical]\n"
    "  --quantized-weights      ZeRO++ qwZ: all-gather weights as int8 blocks (jobs on\n"
    "                           several nodes)\n"
    "  --quantization-block N   elements per quantization block [default 256]\n"
    "  --quantized-gradients B  ZeRO++ qgZ: gradients cross nodes as B-bit blocks (8 or\n"
    "                           4; jobs on several nodes, hierarchical)\n"
    "  --gradient-comm-dtype D  without qgZ: fp32 (exact) or bf16 [default fp32]\n"
    "  --hpz-partition-size L   ZeRO++ hpZ: keep a secondary partition over the L ranks\n"
    "                           of each node, so backward gathers stay in the node\n"
    "                           (L: --ranks-per-node; 1: off) [default 1]\n"
    "  --offload-optimizer D    where the optimizer state lives: none, cpu (host memory;\n"
    "                           GPU ranks step on the CPU) or nvme (a file per rank under\n"
    "                           the nodes' --nvme-dir, streamed through the CPU's step)\n"
    "  --nvme-path DIR          nvme: a directory inside the nodes' --nvme-dir\n"
    "  --offload-buffer-count N staging buffers per rank, 2..64 [default 4]\n"
    "  --offload-buffer-size N  elements per buffer and state, a multiple of 1024\n"
    "                           [default 1048576]\n"
    "  --offload-pin-memory     GPU ranks: page-locked staging buffers\n"
    "  --max-grad-norm X        clip the global gradient norm to X [default: off]\n"
    "  --max-live-bytes SIZE    gathered + gradient buffers per rank, e.g. 512M, 4G\n"
    "  --max-host-bytes SIZE    shard state per rank in host memory (quota)\n"
    "  --max-device-bytes SIZE  shard state per rank in GPU memory (quota)\n"
    "  --max-sessions N         workers attached to the job on one node (quota)\n"
    "                           [default: the node's]\n"
    "  --token T                the owner token [default: the coordinator makes one]\n"
    "  --tenant T               the tenant that owns the job [default: yours; an admin\n"
    "                           may name any]\n"
    "  --checkpoint-every-steps N\n"
    "                           checkpoint the job (auto-<step>) every N steps\n"
    "  --checkpoint-every-seconds S\n"
    "                           ... and/or every S seconds [default: neither]\n"
    "  --checkpoint-keep K      keep the newest K periodic checkpoints [default: all]\n";

typedef struct command {
  const char *name; /* "members", "jobs get", ... */
  int min_args, max_args;
  const char *args_usage; /* after the name, for usage errors */
  int (*run)(ctl *c, int argc, char **argv);
} command;

static const command commands[] = {
    {"members", 0, 0, "", ctl__cmd_members},
    {"jobs list", 0, 0, "", ctl__cmd_jobs_list},
    {"jobs get", 1, 1, " NAME", ctl__cmd_jobs_get},
    {"jobs create", 1, 1, " NAME [options]", NULL}, /* takes its options: ctl__cmd_jobs_create */
    {"jobs delete", 1, 1, " NAME", ctl__cmd_jobs_delete},
    {"jobs read-token", 1, 1, " NAME", ctl__cmd_jobs_read_token},
    {"checkpoint save", 1, 2, " JOB [NAME]", ctl__cmd_checkpoint_save},
    {"checkpoint list", 0, 1, " [JOB]", ctl__cmd_checkpoint_list},
    {"checkpoint delete", 2, 2, " JOB NAME", ctl__cmd_checkpoint_delete},
    {"checkpoint restore", 2, 2, " JOB CHECKPOINT", ctl__cmd_checkpoint_restore},
    {"export", 2, 2, " JOB FILE [--checkpoint CHECKPOINT] [--dtype fp32|bf16] [--overwrite]",
     ctl__cmd_export},
    {"health", 0, 1, " [SERVICE]", ctl__cmd_health},
};

enum {
  OPT_VERSION = 1000,
  OPT_NODES,
  OPT_RANKS_PER_NODE,
  OPT_NODE,
  OPT_OPTIMIZER,
  OPT_LR,
  OPT_WEIGHT_DECAY,
  OPT_BETAS,
  OPT_EPS,
  OPT_MOMENTUM,
  OPT_PRECISION,
  OPT_COLLECTIVES,
  OPT_QUANTIZED_WEIGHTS,
  OPT_QUANTIZATION_BLOCK,
  OPT_QUANTIZED_GRADIENTS,
  OPT_GRADIENT_COMM_DTYPE,
  OPT_HPZ_PARTITION_SIZE,
  OPT_OFFLOAD,
  OPT_NVME_PATH,
  OPT_OFFLOAD_BUFFER_COUNT,
  OPT_OFFLOAD_BUFFER_SIZE,
  OPT_OFFLOAD_PIN_MEMORY,
  OPT_MAX_GRAD_NORM,
  OPT_MAX_LIVE_BYTES,
  OPT_MAX_HOST_BYTES,
  OPT_MAX_DEVICE_BYTES,
  OPT_MAX_SESSIONS,
  OPT_TOKEN,
  OPT_TENANT,
  OPT_EVERY_STEPS,
  OPT_EVERY_SECONDS,
  OPT_KEEP,
  OPT_CHECKPOINT,
  OPT_DTYPE,
  OPT_OVERWRITE,
  /* how to reach the coordinator (any command) */
  OPT_TLS_CA,
  OPT_TLS_CERT,
  OPT_TLS_KEY,
  OPT_TLS_SERVER_NAME,
  OPT_AUTH_TOKEN_FILE,
  OPT_INSECURE,
};

static const struct option long_options[] = {
    {"coordinator", required_argument, NULL, 'c'},
    {"json", no_argument, NULL, 'j'},
    {"timeout", required_argument, NULL, 't'},
    {"help", no_argument, NULL, 'h'},
    {"version", no_argument, NULL, OPT_VERSION},
    /* jobs create */
    {"nodes", required_argument, NULL, OPT_NODES},
    {"ranks-per-node", required_argument, NULL, OPT_RANKS_PER_NODE},
    {"node", required_argument, NULL, OPT_NODE},
    {"optimizer", required_argument, NULL, OPT_OPTIMIZER},
    {"lr", required_argument, NULL, OPT_LR},
    {"weight-decay", required_argument, NULL, OPT_WEIGHT_DECAY},
    {"betas", required_argument, NULL, OPT_BETAS},
    {"eps", required_argument, NULL, OPT_EPS},
    {"momentum", required_argument, NULL, OPT_MOMENTUM},
    {"precision", required_argument, NULL, OPT_PRECISION},
    {"collectives", required_argument, NULL, OPT_COLLECTIVES},
    {"quantized-weights", no_argument, NULL, OPT_QUANTIZED_WEIGHTS},
    {"quantization-block", required_argument, NULL, OPT_QUANTIZATION_BLOCK},
    {"quantized-gradients", required_argument, NULL, OPT_QUANTIZED_GRADIENTS},
    {"gradient-comm-dtype", required_argument, NULL, OPT_GRADIENT_COMM_DTYPE},
    {"hpz-partition-size", required_argument, NULL, OPT_HPZ_PARTITION_SIZE},
    {"offload-optimizer", required_argument, NULL, OPT_OFFLOAD},
    {"nvme-path", required_argument, NULL, OPT_NVME_PATH},
    {"offload-buffer-count", required_argument, NULL, OPT_OFFLOAD_BUFFER_COUNT},
    {"offload-buffer-size", required_argument, NULL, OPT_OFFLOAD_BUFFER_SIZE},
    {"offload-pin-memory", no_argument, NULL, OPT_OFFLOAD_PIN_MEMORY},
    {"max-grad-norm", required_argument, NULL, OPT_MAX_GRAD_NORM},
    {"max-live-bytes", required_argument, NULL, OPT_MAX_LIVE_BYTES},
    {"max-host-bytes", required_argument, NULL, OPT_MAX_HOST_BYTES},
    {"max-device-bytes", required_argument, NULL, OPT_MAX_DEVICE_BYTES},
    {"max-sessions", required_argument, NULL, OPT_MAX_SESSIONS},
    {"token", required_argument, NULL, OPT_TOKEN},
    {"tenant", required_argument, NULL, OPT_TENANT},
    {"checkpoint-every-steps", required_argument, NULL, OPT_EVERY_STEPS},
    {"checkpoint-every-seconds", required_argument, NULL, OPT_EVERY_SECONDS},
    {"checkpoint-keep", required_argument, NULL, OPT_KEEP},
    /* export */
    {"checkpoint", required_argument, NULL, OPT_CHECKPOINT},
    {"dtype", required_argument, NULL, OPT_DTYPE},
    {"overwrite", no_argument, NULL, OPT_OVERWRITE},
    {"tls-ca", required_argument, NULL, OPT_TLS_CA},
    {"tls-cert", required_argument, NULL, OPT_TLS_CERT},
    {"tls-key", required_argument, NULL, OPT_TLS_KEY},
    {"tls-server-name", required_argument, NULL, OPT_TLS_SERVER_NAME},
    {"auth-token-file", required_argument, NULL, OPT_AUTH_TOKEN_FILE},
    {"insecure", no_argument, NULL, OPT_INSECURE},
    {NULL, 0, NULL, 0},
};

/* Records one `jobs create` option; returns 0 or the usage exit status. */
static int set_create_option(create_options *o, int opt, const char *value, const char *spelled) {
  const char **slot = NULL;
  switch (opt) {
  case OPT_NODES:
    slot = &o->nodes;
    break;
  case OPT_RANKS_PER_NODE:
    slot = &o->ranks_per_node;
    break;
  case OPT_OPTIMIZER:
    slot = &o->optimizer;
    break;
  case OPT_LR:
    slot = &o->lr;
    break;
  case OPT_WEIGHT_DECAY:
    slot = &o->weight_decay;
    break;
  case OPT_BETAS:
    slot = &o->betas;
    break;
  case OPT_EPS:
    slot = &o->eps;
    break;
  case OPT_MOMENTUM:
    slot = &o->momentum;
    break;
  case OPT_PRECISION:
    slot = &o->precision;
    break;
  case OPT_COLLECTIVES:
    slot = &o->collectives;
    break;
  case OPT_QUANTIZED_WEIGHTS:
    slot = &o->quantized_weights;
    value = "on";
    break;
  case OPT_QUANTIZATION_BLOCK:
    slot = &o->quantization_block;
    break;
  case OPT_QUANTIZED_GRADIENTS:
    slot = &o->quantized_gradients;
    break;
  case OPT_GRADIENT_COMM_DTYPE:
    slot = &o->gradient_comm_dtype;
    break;
  case OPT_HPZ_PARTITION_SIZE:
    slot = &o->hpz_partition_size;
    break;
  case OPT_OFFLOAD:
    slot = &o->offload;
    break;
  case OPT_NVME_PATH:
    slot = &o->nvme_path;
    break;
  case OPT_OFFLOAD_BUFFER_COUNT:
    slot = &o->offload_buffer_count;
    break;
  case OPT_OFFLOAD_BUFFER_SIZE:
    slot = &o->offload_buffer_size;
    break;
  case OPT_OFFLOAD_PIN_MEMORY:
    slot = &o->offload_pin_memory;
    value = "on";
    break;
  case OPT_MAX_GRAD_NORM:
    slot = &o->max_grad_norm;
    break;
  case OPT_MAX_LIVE_BYTES:
    slot = &o->max_live_bytes;
    break;
  case OPT_MAX_HOST_BYTES:
    slot = &o->max_host_bytes;
    break;
  case OPT_MAX_DEVICE_BYTES:
    slot = &o->max_device_bytes;
    break;
  case OPT_MAX_SESSIONS:
    slot = &o->max_sessions;
    break;
  case OPT_TOKEN:
    slot = &o->token;
    break;
  case OPT_TENANT:
    slot = &o->tenant;
    break;
  case OPT_EVERY_STEPS:
    slot = &o->every_steps;
    break;
  case OPT_EVERY_SECONDS:
    slot = &o->every_seconds;
    break;
  case OPT_KEEP:
    slot = &o->keep;
    break;
  case OPT_NODE:
    if (o->n_node_lists == CTL_MAX_NODES)
      return ctl__usage_error("jobs create: --node given more than %d times", CTL_MAX_NODES);
    o->node_lists[o->n_node_lists++] = value;
    break;
  default:
    return ctl__usage_error("unknown option '%s'", spelled);
  }
  if (slot != NULL)
    *slot = value;
  return 0;
}

/* Options that belong to one command, refused with any other: the first
 * one given of each, as spelled. */
typedef struct owned_option {
  const char *command;
  int first_opt, last_opt; /* its OPT_ range */
  char given[64];          /* "" if none */
} owned_option;

/* The option as the user spelled it, for messages: "--nodes" (also from
 * "--nodes=3"), "-c". */
static void option_spelling(int opt, int long_index, const char *arg, char *out, size_t out_bytes) {
  if (long_index >= 0)
    snprintf(out, out_bytes, "--%s", long_options[long_index].name);
  else if (arg != NULL && strncmp(arg, "--", 2) == 0)
    snprintf(out, out_bytes, "%.*s", (int)strcspn(arg, "="), arg);
  else if (opt > 0 && opt < 128)
    snprintf(out, out_bytes, "-%c", opt);
  else
    snprintf(out, out_bytes, "%s", arg != NULL ? arg : "?");
}

/* Finds the command named by the first positional words; *words receives
 * how many words its name took. NULL if none matches. */
static const command *find_command(int argc, char **argv, int *words) {
  char name[64];
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
    const char *space = strchr(commands[i].name, ' ');
    if (space == NULL) {
      if (argc >= 1 && strcmp(argv[0], commands[i].name) == 0) {
        *words = 1;
        return &commands[i];
      }
      continue;
    }
    if (argc < 2)
      continue;
    snprintf(name, sizeof name, "%s %s", argv[0], argv[1]);
    if (strcmp(name, commands[i].name) == 0) {
      *words = 2;
      return &commands[i];
    }
  }
  return NULL;
}

int main(int argc, char **argv) {
  /* top reads the daemons' metrics, not the coordinator: options of its
   * own, after it. */
  if (argc > 1 && strcmp(argv[1], "top") == 0)
    return ctl_top(argc - 1, argv + 1);
  ctl c = {.coordinator = NULL, .timeout_s = CTL_DEFAULT_TIMEOUT_S};
  create_options create = {0};
  const char *coordinator_from = "--coordinator";
  bool help = false, version = false, timeout_given = false, insecure = false;
  const char *token_file = NULL;
  char spelled[64];
  owned_option owned[] = {{"jobs create", OPT_NODES, OPT_KEEP, ""},
                          {"export", OPT_CHECKPOINT, OPT_OVERWRITE, ""}};

  opterr = 0; /* our own one-line messages */
  int opt, long_index = -1;
  while ((opt = getopt_long(argc, argv, ":c:jt:h", long_options, &long_index)) != -1) {
    /* After an error getopt names the option in optopt (0: an unknown long
     * option) and argv[optind - 1] is the word it was reading. */
    const char *word = optind > 0 && optind <= argc ? argv[optind - 1] : NULL;
    if (opt == '?' || opt == ':')
      option_spelling(optopt, -1, word, spelled, sizeof spelled);
    else
      option_spelling(opt, long_index, word, spelled, sizeof spelled);
    long_index = -1;
    switch (opt) {
    case 'c':
      c.coordinator = optarg;
      break;
    case 'j':
      c.json = true;
      break;
    case 't':
      if (ctl__parse_timeout(optarg, &c.timeout_s) != 0)
        return ctl__usage_error("invalid --timeout '%s': expected seconds, > 0 and <= %g", optarg,
                                CTL_MAX_TIMEOUT_S);
      timeout_given = true;
      break;
    case 'h':
      help = true;
      break;
    case OPT_VERSION:
      version = true;
      break;
    case OPT_TLS_CA:
      c.tls.ca_file = optarg;
      break;
    case OPT_TLS_CERT:
      c.tls.cert_file = optarg;
      break;
    case OPT_TLS_KEY:
      c.tls.key_file = optarg;
      break;
    case OPT_TLS_SERVER_NAME:
      c.tls.server_name = optarg;
      break;
    case OPT_AUTH_TOKEN_FILE:
      token_file = optarg;
      break;
    case OPT_INSECURE:
      insecure = true;
      break;
    case OPT_CHECKPOINT:
    case OPT_DTYPE:
    case OPT_OVERWRITE:
      if (opt == OPT_CHECKPOINT)
        c.export_checkpoint = optarg;
      else if (opt == OPT_DTYPE)
        c.export_dtype = optarg;
      else
        c.export_overwrite = true;
      break;
    case ':':
      return ctl__usage_error("option '%s' needs a value (see zerodctl --help)", spelled);
    case '?':
      if (optopt != 0 && word != NULL && strncmp(word, "--", 2) == 0)
        return ctl__usage_error("option '%s' takes no value (see zerodctl --help)", spelled);
      return ctl__usage_error("unknown option '%s' (see zerodctl --help)", spelled);
    default: {
      int rc = set_create_option(&create, opt, optarg, spelled);
      if (rc != 0)
        return rc;
      break;
    }
    }
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++)
      if (opt >= owned[i].first_opt && opt <= owned[i].last_opt && owned[i].given[0] == '\0')
        snprintf(owned[i].given, sizeof owned[i].given, "%s", spelled);
  }
  int n_args = argc - optind;
  char **args = argv + optind;

  if (version) {
    printf("zerodctl %s\n", ZEROD_VERSION);
    return 0;
  }
  int words = 0;
  const command *cmd = find_command(n_args, args, &words);
  if (help) {
    fputs(cmd != NULL && strcmp(cmd->name, "jobs create") == 0 ? create_usage : general_usage,
          stdout);
    return 0;
  }
  if (n_args == 0)
    return ctl__usage_error("no command given (see zerodctl --help)");
  if (cmd == NULL) {
    if (strcmp(args[0], "jobs") == 0)
      return ctl__usage_error(n_args == 1
                                  ? "jobs: which one? list, get, create or delete"
                                  : "jobs: unknown command '%s' (list, get, create or delete)",
                              n_args > 1 ? args[1] : "");
    if (strcmp(args[0], "checkpoint") == 0)
      return ctl__usage_error(
          n_args == 1 ? "checkpoint: which one? save, list, delete or restore"
                      : "checkpoint: unknown command '%s' (save, list, delete or restore)",
          n_args > 1 ? args[1] : "");
    if (strcmp(args[0], "top") == 0)
      return ctl__usage_error("top: its options go after it: zerodctl top [--json] ...");
    return ctl__usage_error("unknown command '%s' (see zerodctl --help)", args[0]);
  }
  c.command = cmd->name;
  args += words;
  n_args -= words;
  if (n_args < cmd->min_args || n_args > cmd->max_args)
    return ctl__usage_error("%s: usage: zerodctl %s%s", cmd->name, cmd->name, cmd->args_usage);
  for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++)
    if (owned[i].given[0] != '\0' && strcmp(cmd->name, owned[i].command) != 0)
      return ctl__usage_error("%s: option '%s' belongs to %s", cmd->name, owned[i].given,
                              owned[i].command);
  if (strcmp(cmd->name, "export") == 0) {
    int rc = ctl__check_export_args(&c, args);
    if (rc != 0)
      return rc;
    if (!timeout_given)
      c.timeout_s = CTL_CHECKPOINT_TIMEOUT_S;
  }
  if (strncmp(cmd->name, "jobs ", 5) == 0 && n_args == 1 && !ctl__valid_name(args[0]))
    return ctl__usage_error("%s: invalid job name '%s': expected 1..64 characters [A-Za-z0-9._-]",
                            cmd->name, args[0]);
  if (strncmp(cmd->name, "checkpoint ", 11) == 0) {
    int rc = ctl__check_checkpoint_args(cmd->name, n_args, args);
    if (rc != 0)
      return rc;
    /* A save or restore answers when the whole job has done it. */
    if (!timeout_given &&
        (strcmp(cmd->name, "checkpoint save") == 0 || strcmp(cmd->name, "checkpoint restore") == 0))
      c.timeout_s = CTL_CHECKPOINT_TIMEOUT_S;
  }

  if (c.coordinator == NULL) {
    c.coordinator = getenv("ZEROD_COORDINATOR");
    coordinator_from = "ZEROD_COORDINATOR";
    if (c.coordinator == NULL || c.coordinator[0] == '\0')
      c.coordinator = CTL_DEFAULT_COORDINATOR;
  }
  if (!ctl__valid_target(c.coordinator))
    return ctl__usage_error("invalid %s '%s': expected HOST:PORT or unix:PATH", coordinator_from,
                            c.coordinator);
  int rc = ctl__security_setup(&c, token_file, insecure);
  if (rc != 0)
    return rc;
  c.timeout_ms = (int)(c.timeout_s * 1000.0 + 0.999);
  if (c.timeout_ms < 1)
    c.timeout_ms = 1;

  /* gRPC logs to stderr on its own (connection failures, at ERROR); the
   * failure line is ours to print. A user who sets GRPC_VERBOSITY keeps it.
   * It is read once, when gRPC initialises in rpc_channel_create. Our
   * rpc module logs through log.h: only its errors could matter here, and
   * those reach the user as the call's status. */
  if (setenv("GRPC_VERBOSITY", "NONE", 0) != 0)
    return ctl__fail_line(CTL_EXIT_FAILED, "setenv: %s", strerror(errno));
  log_set_level(LOG_ERROR);

  if (cmd->run != NULL)
    rc = cmd->run(&c, n_args, args);
  else
    rc = ctl__cmd_jobs_create(&c, args[0], &create);
  if (c.channel != NULL)
    rpc_channel_destroy(c.channel);

  /* Output that did not reach stdout (a full disk, a closed pipe) is a
   * failure a script must see. */
  if (fflush(stdout) != 0 || ferror(stdout)) {
    if (rc == 0)
      rc =
          ctl__fail_line(CTL_EXIT_FAILED, "%s: writing the output: %s", c.command, strerror(errno));
  }
  return rc;
}
