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
 * before it reaches the terminal. docs/zerodctl.md is the user's guide.
 *
 * This file is the entry: the help texts, the table of commands, and main,
 * which parses the options, picks the command, checks its arguments,
 * settles how to reach the coordinator and runs it. The commands, the
 * checks and the output live in the other zerodctl_*.c files
 * (zerodctl_impl.h lists them); `zerodctl top` is top.c. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "rpc.h"
#include "top.h"
#include "zerodctl_watch.h"
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
    "  jobs watch NAME [opts]   follow the job's versions through the local node\n"
    "                           daemon, one line each (zerodctl jobs watch --help)\n"
    "  jobs freeze NAME [--share T1,T2] [--public]\n"
    "                           make a ready job a base (docs/bases.md): its state\n"
    "                           never changes again, and jobs created with --base\n"
    "                           NAME share it; --share: the other tenants that may,\n"
    "                           --public: every tenant (again: replaces the sharing)\n"
    "  jobs scale NAME NODE,NODE...\n"
    "                           move a job with --redundancy onto these nodes (grow,\n"
    "                           drain one, or swap), re-sharded from its in-memory\n"
    "                           copy (docs/redundancy.md)\n"
    "  bases list               the bases you may read, with the jobs on each\n"
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
    "                               standalone zerod [ZEROD_COORDINATOR, default: a\n"
    "                               local zerod's control.sock in its default --dir\n"
    "                               (yours, /var/lib/zerod, /run/zerod), else\n"
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
    "  --deepspeed-config FILE  the optimizer, precision, loss scaling, offload, ZeRO++\n"
    "                           and clipping of a DeepSpeed JSON config; the options\n"
    "                           below override it; other keys are listed on stderr\n"
    "                           as ignored (docs/zerodctl.md, \"DeepSpeed configs\")\n"
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
    "  --onebit-adam K          1-bit Adam: K exact steps, then gradient sums cross nodes\n"
    "                           as signs with error feedback (Adam/AdamW, hierarchical)\n"
    "  --powersgd-rank R        low-rank compression: gradient sums cross nodes as two\n"
    "                           rank-R factors with error feedback (PowerSGD; 1..64)\n"
    "  --powersgd-start K       with --powersgd-rank: K exact steps first [default 0]\n"
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
    "  --base NAME              build the job on base NAME (a frozen job: zerodctl\n"
    "                           jobs freeze): it runs on the base's nodes, with its\n"
    "                           ranks per node and precision [default for each]\n"
    "  --checkpoint-every-steps N\n"
    "                           checkpoint the job (auto-<step>) every N steps\n"
    "  --checkpoint-every-seconds S\n"
    "                           ... and/or every S seconds [default: neither]\n"
    "  --checkpoint-keep K      keep the newest K periodic checkpoints [default: all]\n"
    "  --redundancy 1           keep a copy of every node's state in another node's\n"
    "                           memory: a lost node's job is re-sharded onto the others\n"
    "                           with no disk read (docs/redundancy.md) [default: 0]\n"
    "  --redundancy-every-steps N\n"
    "                           ... copied every N steps [default: 1]\n";

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
    {"jobs freeze", 1, 1, " NAME [--share T1,T2] [--public]", ctl__cmd_jobs_freeze},
    {"jobs scale", 2, 2, " NAME NODE,NODE...", ctl__cmd_jobs_scale},
    {"bases list", 0, 0, "", ctl__cmd_bases_list},
    {"checkpoint save", 1, 2, " JOB [NAME]", ctl__cmd_checkpoint_save},
    {"checkpoint list", 0, 1, " [JOB]", ctl__cmd_checkpoint_list},
    {"checkpoint delete", 2, 2, " JOB NAME", ctl__cmd_checkpoint_delete},
    {"checkpoint restore", 2, 2, " JOB CHECKPOINT", ctl__cmd_checkpoint_restore},
    {"export", 2, 2, " JOB FILE [--checkpoint CHECKPOINT] [--dtype fp32|bf16] [--overwrite]",
     ctl__cmd_export},
    {"health", 0, 1, " [SERVICE]", ctl__cmd_health},
};

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

/* No command is named by args: the usage error that says which word is
 * wrong. */
static int unknown_command(int n_args, char **args) {
  if (n_args == 0)
    return ctl__usage_error("no command given (see zerodctl --help)");
  if (strcmp(args[0], "jobs") == 0)
    return ctl__usage_error(
        n_args == 1
            ? "jobs: which one? list, get, create, delete, read-token, freeze or watch"
            : "jobs: unknown command '%s' (list, get, create, delete, read-token, freeze or watch)",
        n_args > 1 ? args[1] : "");
  if (strcmp(args[0], "bases") == 0)
    return ctl__usage_error(n_args == 1 ? "bases: which one? list"
                                        : "bases: unknown command '%s' (list)",
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

/* Checks cmd's arguments (args, n_args of them) and the options given
 * with it before anything is sent; the commands that wait for a whole
 * job get the longer timeout unless --timeout was given. Returns 0 or the
 * usage exit status. */
static int check_command(ctl *c, const command *cmd, const ctl_options *options, int n_args,
                         char **args) {
  if (n_args < cmd->min_args || n_args > cmd->max_args)
    return ctl__usage_error("%s: usage: zerodctl %s%s", cmd->name, cmd->name, cmd->args_usage);
  int rc = ctl__check_owned_options(options, cmd->name);
  if (rc != 0)
    return rc;
  if (strcmp(cmd->name, "export") == 0) {
    rc = ctl__check_export_args(c, args);
    if (rc != 0)
      return rc;
    if (!options->timeout_given)
      c->timeout_s = CTL_CHECKPOINT_TIMEOUT_S;
  }
  if (strncmp(cmd->name, "jobs ", 5) == 0 && n_args == 1 && !ctl__valid_name(args[0]))
    return ctl__usage_error("%s: invalid job name '%s': expected 1..64 characters [A-Za-z0-9._-]",
                            cmd->name, args[0]);
  if (strcmp(cmd->name, "jobs freeze") == 0 && (rc = ctl__check_freeze_args(c)) != 0)
    return rc;
  if (strncmp(cmd->name, "checkpoint ", 11) == 0) {
    rc = ctl__check_checkpoint_args(cmd->name, n_args, args);
    if (rc != 0)
      return rc;
    /* A save or restore answers when the whole job has done it. */
    if (!options->timeout_given &&
        (strcmp(cmd->name, "checkpoint save") == 0 || strcmp(cmd->name, "checkpoint restore") == 0))
      c->timeout_s = CTL_CHECKPOINT_TIMEOUT_S;
  }
  return 0;
}

/* Nothing named a coordinator: a local zerod's control socket where a
 * daemon started without --dir keeps it (paths.h), as container CLIs find
 * their local daemon; else the default address. */
static void default_coordinator(ctl *c) {
  char path[ZPATH_MAX];
  c->coordinator_defaulted = true;
  c->coordinator = CTL_DEFAULT_COORDINATOR;
  if (zpath_find("control.sock", path, sizeof path, c->looked, sizeof c->looked)) {
    snprintf(c->local_target, sizeof c->local_target, "unix:%s", path);
    c->coordinator = c->local_target;
  }
}

/* The coordinator (--coordinator, else ZEROD_COORDINATOR, else a local
 * daemon's or the default), how to reach it, and the calls' deadline.
 * Returns 0 or the usage exit status. */
static int settle_coordinator(ctl *c, const ctl_options *options) {
  const char *coordinator_from = "--coordinator";
  if (c->coordinator == NULL) {
    c->coordinator = getenv("ZEROD_COORDINATOR");
    coordinator_from = "ZEROD_COORDINATOR";
    if (c->coordinator == NULL || c->coordinator[0] == '\0')
      default_coordinator(c);
  }
  if (!ctl__valid_target(c->coordinator))
    return ctl__usage_error("invalid %s '%s': expected HOST:PORT or unix:PATH", coordinator_from,
                            c->coordinator);
  int rc = ctl__security_setup(c, options->token_file, options->insecure);
  if (rc != 0)
    return rc;
  c->timeout_ms = (int)(c->timeout_s * 1000.0 + 0.999);
  if (c->timeout_ms < 1)
    c->timeout_ms = 1;
  return 0;
}

/* Runs cmd with gRPC's own logging silenced, and fails it when its output
 * did not reach stdout. Returns the exit status. */
static int run_command(ctl *c, const command *cmd, const ctl_options *options, int n_args,
                       char **args) {
  /* gRPC logs to stderr on its own (connection failures, at ERROR); the
   * failure line is ours to print. A user who sets GRPC_VERBOSITY keeps it.
   * It is read once, when gRPC initialises in rpc_channel_create. Our
   * rpc module logs through log.h: only its errors could matter here, and
   * those reach the user as the call's status. */
  if (setenv("GRPC_VERBOSITY", "NONE", 0) != 0)
    return ctl__fail_line(CTL_EXIT_FAILED, "setenv: %s", strerror(errno));
  log_set_level(LOG_ERROR);

  int rc;
  if (cmd->run != NULL)
    rc = cmd->run(c, n_args, args);
  else
    rc = ctl__cmd_jobs_create(c, args[0], &options->create);
  if (c->channel != NULL)
    rpc_channel_destroy(c->channel);

  /* Output that did not reach stdout (a full disk, a closed pipe) is a
   * failure a script must see. */
  if (fflush(stdout) != 0 || ferror(stdout)) {
    if (rc == 0)
      rc = ctl__fail_line(CTL_EXIT_FAILED, "%s: writing the output: %s", c->command,
                          strerror(errno));
  }
  return rc;
}

int main(int argc, char **argv) {
  /* top reads the daemons' metrics, not the coordinator: options of its
   * own, after it. */
  if (argc > 1 && strcmp(argv[1], "top") == 0)
    return ctl_top(argc - 1, argv + 1);
  /* jobs watch subscribes through the local node daemon's socket. */
  if (argc > 2 && strcmp(argv[1], "jobs") == 0 && strcmp(argv[2], "watch") == 0)
    return ctl_watch(argc - 2, argv + 2);
  ctl c = {.coordinator = NULL, .timeout_s = CTL_DEFAULT_TIMEOUT_S};
  ctl_options options;
  int rc = ctl__parse_options(argc, argv, &c, &options);
  if (rc != 0)
    return rc;
  int n_args = argc - optind;
  char **args = argv + optind;

  if (options.version) {
    printf("zerodctl %s\n", ZEROD_VERSION);
    return 0;
  }
  int words = 0;
  const command *cmd = find_command(n_args, args, &words);
  if (options.help) {
    fputs(cmd != NULL && strcmp(cmd->name, "jobs create") == 0 ? create_usage : general_usage,
          stdout);
    return 0;
  }
  if (cmd == NULL)
    return unknown_command(n_args, args);
  c.command = cmd->name;
  args += words;
  n_args -= words;
  rc = check_command(&c, cmd, &options, n_args, args);
  if (rc == 0)
    rc = settle_coordinator(&c, &options);
  if (rc != 0)
    return rc;
  return run_command(&c, cmd, &options, n_args, args);
}
