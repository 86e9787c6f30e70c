/* flags_table: zerod's two command lines, row by row (flags.h).
 *
 * Each row is one flag: its name, the environment variable read when the
 * flag is not given, the default, the parser, and its lines of the usage
 * text. The rows are in the order of the usage text, which they make up
 * with each table's head and tail; `zerod --help` and `zerod coordinator
 * --help` print exactly that (tests/unit/test_flags.c checks that every
 * row's help names its flag, its variable and its default). Defaults that
 * depend on other flags (the socket in DIR, the threads per rank, the
 * host name) are computed by the modes, and their rows have none. */
#include <limits.h>
#include <stddef.h>

#include "flags.h"
#include "job.h"
#include "zk.h"

/* --state-dir: room for what is appended (/coordinator.lock, the state
 * file and its temporary name). */
#define STATE_DIR_MAX_BYTES (PATH_MAX - 33)

static const char *const device_choices[] = {"cpu", "cuda", "auto", NULL};

/* Rows both command lines share, word for word. */
#define ROW_METRICS_LISTEN                                                                         \
  {                                                                                                \
    .id = FLAG_METRICS_LISTEN, .name = "metrics-listen", .takes_value = 1,                         \
    .env = "ZEROD_METRICS_LISTEN",                                                                 \
    .help =                                                                                        \
        "  --metrics-listen ADDR   serve Prometheus metrics at http://ADDR/metrics (HOST:PORT,\n"  \
        "                          :PORT for every address) [ZEROD_METRICS_LISTEN, default:\n"     \
        "                          none]\n"                                                        \
  }

#define ROW_JOB_IDLE_TTL                                                                           \
  {                                                                                                \
    .id = FLAG_JOB_IDLE_TTL, .name = "job-idle-ttl", .takes_value = 1,                             \
    .env = "ZEROD_JOB_IDLE_TTL", .fallback = "0", .parse = flag_parse_duration_ms,                 \
    .expected = "a duration: N, Ns, Nm, Nh or Nd, at most 3650d; 0: never",                        \
    .help = "  --job-idle-ttl DURATION\n"                                                          \
            "                          delete a job once no worker has been attached to it on\n"   \
            "                          any of its nodes this long (90s, 12h, 7d; its\n"            \
            "                          checkpoints stay; bases never expire)\n"                    \
            "                          [ZEROD_JOB_IDLE_TTL, default 0: never]\n"                   \
  }

#define ROW_LOG_LEVEL                                                                              \
  {                                                                                                \
    .id = FLAG_LOG_LEVEL, .name = "log-level", .takes_value = 1, .env = "ZEROD_LOG_LEVEL",         \
    .fallback = "info", .parse = flag_parse_log_level, .expected = "debug, info, warn or error",   \
    .help =                                                                                        \
        "  --log-level LEVEL       debug, info, warn or error [ZEROD_LOG_LEVEL, default info]\n"   \
  }

#define ROW_LOG_FORMAT                                                                             \
  {                                                                                                \
    .id = FLAG_LOG_FORMAT, .name = "log-format", .takes_value = 1, .env = "ZEROD_LOG_FORMAT",      \
    .fallback = "logfmt", .parse = flag_parse_log_format, .expected = "logfmt or json",            \
    .help = "  --log-format FORMAT     logfmt or json (one JSON object per line)\n"                \
            "                          [ZEROD_LOG_FORMAT, default logfmt]\n"                       \
  }

#define ROW_HELP                                                                                   \
  {                                                                                                \
    .id = FLAG_HELP, .name = "help",                                                               \
    .help = "  -h, --help              print this help and exit\n"                                 \
  }

/* ------------------------------------------------------------------------ */
/* zerod [standalone] and zerod node                                        */
/* ------------------------------------------------------------------------ */

static const char node_usage_head[] =
    "usage: zerod [standalone] [options]\n"
    "       zerod node --coordinator HOST:PORT [options]\n"
    "       zerod coordinator [--listen ADDR] [--state-dir DIR] [--lease-ttl S]\n"
    "                         [--checkpoint-dir DIR] [--checkpoint-timeout S]\n"
    "                         [--export-root DIR]... [--file-mode MODE]\n"
    "                         (zerod coordinator --help)\n"
    "\n"
    "Runs a zerod node daemon with its rendezvous in one process (standalone mode):\n"
    "workers on this machine attach through a Unix socket and train through it.\n"
    "\n"
    "options (each also read from the environment variable shown):\n";

static const char node_usage_tail[] =
    "\n"
    "Logs go to stderr, one line per event. SIGINT or SIGTERM shut down cleanly:\n"
    "workers are told, executors stopped, shared memory freed, the socket removed.\n";

static const flag node_flags[] = {
    {.id = FLAG_RANKS,
     .name = "ranks",
     .takes_value = 1,
     .env = "ZEROD_RANKS",
     .fallback = "1",
     .parse = flag_parse_int,
     .lo = 1,
     .hi = JOB_MAX_WORLD,
     .expected = "1..64",
     .help = "  --ranks N               standalone: the ranks of a job whose creator asks for\n"
             "                          no number (a launcher's WORLD_SIZE is asked for);\n"
             "                          node: the most a job may place here\n"
             "                          [ZEROD_RANKS, default 1]\n"},
    {.id = FLAG_MAX_RANKS,
     .name = "max-ranks",
     .takes_value = 1,
     .env = "ZEROD_MAX_RANKS",
     .parse = flag_parse_int,
     .lo = 1,
     .hi = JOB_MAX_WORLD,
     .expected = "1..64",
     .help = "  --max-ranks N           standalone: the most ranks one job may have here\n"
             "                          (ranks are made per job) [ZEROD_MAX_RANKS, default:\n"
             "                          the CPUs (cpu) or GPUs (cuda), at least --ranks]\n"},
    {.id = FLAG_DEVICE,
     .name = "device",
     .takes_value = 1,
     .env = "ZEROD_DEVICE",
     .fallback = "cpu",
     .parse = flag_parse_choice,
     .choices = device_choices,
     .expected = "cpu, cuda or auto",
     .help = "  --device KIND           where the ranks' shards live and run: cpu (host memory,\n"
             "                          Gloo); cuda (rank i on GPU i, NCCL, CUDA IPC to\n"
             "                          workers; not yet validated on a GPU); auto (cuda\n"
             "                          if every rank has a GPU, else cpu) [ZEROD_DEVICE,\n"
             "                          default cpu]\n"},
    {.id = FLAG_DIR,
     .name = "dir",
     .takes_value = 1,
     .env = "ZEROD_DIR",
     .help = "  --dir DIR               state directory: lock file and default socket, the\n"
             "                          same wherever zerod starts ($XDG_STATE_HOME/zerod,\n"
             "                          else root: /var/lib/zerod, others ~/.local/state/zerod)\n"
             "                          [ZEROD_DIR, default: the user's state directory]\n"},
    {.id = FLAG_SOCKET,
     .name = "socket",
     .takes_value = 1,
     .env = "ZEROD_SOCKET",
     .help = "  --socket PATH           IPC socket path [ZEROD_SOCKET, default DIR/zerod.sock]\n"},
    {.id = FLAG_SOCKET_GROUP,
     .name = "socket-group",
     .takes_value = 1,
     .env = "ZEROD_SOCKET_GROUP",
     .help = "  --socket-group GROUP    make the socket mode 0660 owned by GROUP (default: 0600,\n"
             "                          this user only) [ZEROD_SOCKET_GROUP]\n"},
    {.id = FLAG_THREADS_PER_RANK,
     .name = "threads-per-rank",
     .takes_value = 1,
     .env = "ZEROD_THREADS_PER_RANK",
     .parse = flag_parse_int,
     .lo = 1,
     .hi = ZK_POOL_MAX_THREADS,
     .expected = "1..256",
     .help = "  --threads-per-rank N    kernel threads per rank [ZEROD_THREADS_PER_RANK,\n"
             "                          default: CPUs / ranks, at least 1]\n"},
    {.id = FLAG_COLLECTIVE_TIMEOUT,
     .name = "collective-timeout",
     .takes_value = 1,
     .env = "ZEROD_COLLECTIVE_TIMEOUT",
     .fallback = "60",
     .parse = flag_parse_int,
     .lo = 1,
     .hi = 86400,
     .expected = "seconds, 1..86400",
     .help = "  --collective-timeout S  seconds a collective waits for a peer rank before the\n"
             "                          job fails [ZEROD_COLLECTIVE_TIMEOUT, default 60]\n"},
    {.id = FLAG_MAX_LIVE_BYTES,
     .name = "max-live-bytes",
     .takes_value = 1,
     .env = "ZEROD_MAX_LIVE_BYTES",
     .fallback = "2G",
     .parse = flag_parse_size,
     .expected = "a size such as 512M or 4G",
     .help =
         "  --max-live-bytes SIZE   default per-job, per-rank budget of gathered and gradient\n"
         "                          buffers, e.g. 512M, 4G [ZEROD_MAX_LIVE_BYTES, default 2G]\n"},
    {.id = FLAG_MAX_SESSIONS,
     .name = "max-sessions",
     .takes_value = 1,
     .env = "ZEROD_MAX_SESSIONS",
     .fallback = "1024",
     .parse = flag_parse_int,
     .lo = 1,
     .hi = 1 << 20,
     .expected = "1..1048576",
     .help =
         "  --max-sessions N        most worker connections [ZEROD_MAX_SESSIONS, default 1024]\n"},
    {.id = FLAG_MAX_PINNED_VERSIONS,
     .name = "max-pinned-versions",
     .takes_value = 1,
     .env = "ZEROD_MAX_PINNED_VERSIONS",
     .fallback = "4",
     .parse = flag_parse_int,
     .lo = 1,
     .hi = 1024,
     .expected = "1..1024",
     .help = "  --max-pinned-versions N most versions of one job that read-only sessions keep\n"
             "                          pinned at once (each may cost a copy of the weights)\n"
             "                          [ZEROD_MAX_PINNED_VERSIONS, default 4]\n"},
    {.id = FLAG_BASE_CACHE_BYTES,
     .name = "base-cache-bytes",
     .takes_value = 1,
     .env = "ZEROD_BASE_CACHE_BYTES",
     .fallback = "1G",
     .parse = flag_parse_size,
     .expected = "a size such as 512M or 4G",
     .help = "  --base-cache-bytes SIZE gathered units of bases kept for no job, shared by every\n"
             "                          job on the node [ZEROD_BASE_CACHE_BYTES, default 1G]\n"},
    {.id = FLAG_CHECKPOINT_DIR,
     .name = "checkpoint-dir",
     .takes_value = 1,
     .env = "ZEROD_CHECKPOINT_DIR",
     .help = "  --checkpoint-dir DIR    standalone: where checkpoints are saved\n"
             "                          [ZEROD_CHECKPOINT_DIR, default DIR/checkpoints]\n"},
    {.id = FLAG_CHECKPOINT_TIMEOUT,
     .name = "checkpoint-timeout",
     .takes_value = 1,
     .env = "ZEROD_CHECKPOINT_TIMEOUT",
     .fallback = "600",
     .parse = flag_parse_int,
     .lo = 1,
     .hi = 86400,
     .expected = "seconds, 1..86400",
     .help = "  --checkpoint-timeout S  standalone: longest a checkpoint save or restore may\n"
             "                          take [ZEROD_CHECKPOINT_TIMEOUT, default 600]\n"},
    ROW_JOB_IDLE_TTL,
    {.id = FLAG_DRAIN_TIMEOUT,
     .name = "drain-timeout",
     .takes_value = 1,
     .env = "ZEROD_DRAIN_TIMEOUT",
     .fallback = "20s",
     .parse = flag_parse_duration_ms,
     .expected = "a duration: N, Ns, Nm, Nh or Nd, at most 3650d; 0: no drain",
     .help = "  --drain-timeout DURATION\n"
             "                          on SIGTERM or SIGINT, have the coordinator save every\n"
             "                          job of this node that holds state before stopping,\n"
             "                          waiting at most this long (a second signal stops at\n"
             "                          once); restored when the node (standalone: the next\n"
             "                          daemon on this --dir) is back [ZEROD_DRAIN_TIMEOUT,\n"
             "                          default 20s; 0: stop at once]\n"},
    {.id = FLAG_EXPORT_ROOT,
     .name = "export-root",
     .takes_value = 1,
     .env = "ZEROD_EXPORT_ROOT",
     .help = "  --export-root DIR       standalone: a directory Export may write in, and Restore\n"
             "                          and Export may read a checkpoint path from (besides the\n"
             "                          checkpoint directory); repeat for more; a relative\n"
             "                          export path is taken inside the first. Paths through\n"
             "                          '..' or a symbolic link are refused [ZEROD_EXPORT_ROOT,\n"
             "                          DIRs separated by ':'; default: the checkpoint dir]\n"},
    {.id = FLAG_FILE_MODE,
     .name = "file-mode",
     .takes_value = 1,
     .env = "ZEROD_FILE_MODE",
     .fallback = "0600",
     .parse = flag_parse_file_mode,
     .expected = "octal permissions with the owner's rw and no write for others, e.g. 0640",
     .help = "  --file-mode MODE        mode of the files written (checkpoints, exports, state),\n"
             "                          octal; directories get x where it has r (0640: 0750)\n"
             "                          [ZEROD_FILE_MODE, default 0600]\n"},
    {.id = FLAG_NVME_DIR,
     .name = "nvme-dir",
     .takes_value = 1,
     .env = "ZEROD_NVME_DIR",
     .help =
         "  --nvme-dir DIR          where jobs with offload_optimizer nvme keep their optimizer\n"
         "                          state (a fast local disk; one daemon per directory: files\n"
         "                          left by a daemon that died are removed at start)\n"
         "                          [ZEROD_NVME_DIR, default DIR/nvme]\n"},
    {.id = FLAG_REPLICA_DIR,
     .name = "replica-dir",
     .takes_value = 1,
     .env = "ZEROD_REPLICA_DIR",
     .help = "  --replica-dir DIR       zerod node: where the in-memory copies of jobs with\n"
             "                          redundancy live (tmpfs: memory, not disk; emptied at\n"
             "                          start) [ZEROD_REPLICA_DIR,\n"
             "                          default /dev/shm/zerod-replicas-NAME]\n"},
    {.id = FLAG_COORDINATOR,
     .name = "coordinator",
     .takes_value = 1,
     .env = "ZEROD_COORDINATOR",
     .parse = flag_parse_coordinator,
     .hi = 255,
     .expected = "HOST:PORT, required by zerod node",
     .help = "  --coordinator HOST:PORT zerod node: the coordinator to join\n"
             "                          [ZEROD_COORDINATOR]\n"},
    {.id = FLAG_NAME,
     .name = "name",
     .takes_value = 1,
     .env = "ZEROD_NODE_NAME",
     .parse = flag_parse_node_name,
     .expected = "1..64 of [A-Za-z0-9._-]",
     .help = "  --name NAME             zerod node: this node's name, unique in the cluster\n"
             "                          [ZEROD_NODE_NAME, default: the host name]\n"},
    {.id = FLAG_COMM_HOST,
     .name = "comm-host",
     .takes_value = 1,
     .env = "ZEROD_COMM_HOST",
     .fallback = "127.0.0.1",
     .help = "  --comm-host ADDR        address the ranks' Gloo connections use (and, for\n"
             "                          zerod node, that other nodes reach it on)\n"
             "                          [ZEROD_COMM_HOST, default 127.0.0.1]\n"},
    ROW_LOG_LEVEL,
    {.id = FLAG_HEALTH_LISTEN,
     .name = "health-listen",
     .takes_value = 1,
     .env = "ZEROD_HEALTH_LISTEN",
     .help = "  --health-listen ADDR    serve grpc.health.v1 for probes on ADDR (HOST:PORT,\n"
             "                          unix:PATH): SERVING while a member of the cluster (node)\n"
             "                          or ready (standalone), NOT_SERVING while joining or\n"
             "                          draining [ZEROD_HEALTH_LISTEN, default: none]\n"},
    ROW_METRICS_LISTEN,
    ROW_LOG_FORMAT,
    {.id = FLAG_TLS_CA,
     .name = "tls-ca",
     .takes_value = 1,
     .env = "ZEROD_TLS_CA",
     .help = "  --tls-ca FILE           zerod node: reach the coordinator over TLS, verifying it\n"
             "                          with this CA (PEM) [ZEROD_TLS_CA]\n"},
    {.id = FLAG_TLS_CERT,
     .name = "tls-cert",
     .takes_value = 1,
     .env = "ZEROD_TLS_CERT",
     .help = "  --tls-cert FILE         zerod node: client certificate for mutual TLS\n"},
    {.id = FLAG_TLS_KEY,
     .name = "tls-key",
     .takes_value = 1,
     .env = "ZEROD_TLS_KEY",
     .help = "  --tls-key FILE          ... and its key [ZEROD_TLS_CERT, ZEROD_TLS_KEY]\n"},
    {.id = FLAG_TLS_SERVER_NAME,
     .name = "tls-server-name",
     .takes_value = 1,
     .env = "ZEROD_TLS_SERVER_NAME",
     .help = "  --tls-server-name NAME  zerod node: the name to expect in the coordinator's\n"
             "                          certificate [ZEROD_TLS_SERVER_NAME, default: its host]\n"},
    {.id = FLAG_AUTH_TOKEN_FILE,
     .name = "auth-token-file",
     .takes_value = 1,
     .env = "ZEROD_AUTH_TOKEN_FILE",
     .help = "  --auth-token-file FILE  zerod node: bearer token for the coordinator [ZEROD_AUTH_\n"
             "                          TOKEN_FILE, or the token itself in ZEROD_AUTH_TOKEN]\n"},
    {.id = FLAG_INSECURE,
     .name = "insecure",
     .env = "ZEROD_INSECURE",
     .help = "  --insecure              zerod node: allow plain TCP to a coordinator on another\n"
             "                          host [ZEROD_INSECURE=1]\n"},
    {.id = FLAG_VERSION,
     .name = "version",
     .help = "  --version               print the version and exit\n"},
    ROW_HELP,
};

/* The order the flags were given to getopt_long before they were a table:
 * an ambiguous abbreviation's candidates are listed in it. */
static const char *const node_getopt_order[] = {"ranks",
                                                "dir",
                                                "socket",
                                                "socket-group",
                                                "threads-per-rank",
                                                "collective-timeout",
                                                "max-live-bytes",
                                                "max-sessions",
                                                "comm-host",
                                                "log-level",
                                                "health-listen",
                                                "metrics-listen",
                                                "log-format",
                                                "version",
                                                "coordinator",
                                                "name",
                                                "device",
                                                "checkpoint-dir",
                                                "checkpoint-timeout",
                                                "tls-ca",
                                                "tls-cert",
                                                "tls-key",
                                                "tls-server-name",
                                                "auth-token-file",
                                                "insecure",
                                                "export-root",
                                                "file-mode",
                                                "nvme-dir",
                                                "base-cache-bytes",
                                                "replica-dir",
                                                "max-ranks",
                                                "job-idle-ttl",
                                                "drain-timeout",
                                                "max-pinned-versions",
                                                "help",
                                                NULL};

const flag_table flags_node = {.usage_head = node_usage_head,
                               .usage_tail = node_usage_tail,
                               .flags = node_flags,
                               .n_flags = sizeof node_flags / sizeof node_flags[0],
                               .getopt_order = node_getopt_order};

/* ------------------------------------------------------------------------ */
/* zerod coordinator                                                        */
/* ------------------------------------------------------------------------ */

static const char coordinator_usage_head[] =
    "usage: zerod coordinator [options]\n"
    "\n"
    "Runs the cluster's coordinator: membership, jobs, rendezvous, checkpoints and\n"
    "health over gRPC. Node daemons (zerod node) and zerodctl dial it; it never\n"
    "dials them.\n"
    "\n"
    "options (each also read from the environment variable shown):\n";

static const char coordinator_usage_tail[] =
    "\n"
    "SIGINT or SIGTERM shut down cleanly: watches end, calls in flight are cancelled.\n";

static const flag coordinator_flags[] = {
    {.id = FLAG_LISTEN,
     .name = "listen",
     .takes_value = 1,
     .env = "ZEROD_LISTEN",
     .fallback = "0.0.0.0:7070",
     .parse = flag_parse_listen,
     .hi = 255,
     .expected = "HOST:PORT",
     .help = "  --listen ADDR           address to serve gRPC on, HOST:PORT (port 0: any free\n"
             "                          port) [ZEROD_LISTEN, default 0.0.0.0:7070]\n"},
    {.id = FLAG_STATE_DIR,
     .name = "state-dir",
     .takes_value = 1,
     .env = "ZEROD_STATE_DIR",
     .fallback = ".zerod-coordinator",
     .parse = flag_parse_text,
     .hi = STATE_DIR_MAX_BYTES,
     .expected = "path too long",
     .help = "  --state-dir DIR         durable state (jobs), written atomically\n"
             "                          [ZEROD_STATE_DIR, default ./.zerod-coordinator]\n"},
    {.id = FLAG_LEASE_TTL,
     .name = "lease-ttl",
     .takes_value = 1,
     .env = "ZEROD_LEASE_TTL",
     .fallback = "10",
     .parse = flag_parse_seconds_ms,
     .expected = "seconds, 0.1..3600",
     .help = "  --lease-ttl S           seconds a node may go without a heartbeat before it\n"
             "                          leaves the view [ZEROD_LEASE_TTL, default 10]\n"},
    {.id = FLAG_CHECKPOINT_DIR,
     .name = "checkpoint-dir",
     .takes_value = 1,
     .env = "ZEROD_CHECKPOINT_DIR",
     .help = "  --checkpoint-dir DIR    where checkpoints are saved; every node must see it at\n"
             "                          the same path (a shared filesystem)\n"
             "                          [ZEROD_CHECKPOINT_DIR, default STATE-DIR/checkpoints]\n"},
    {.id = FLAG_CHECKPOINT_TIMEOUT,
     .name = "checkpoint-timeout",
     .takes_value = 1,
     .env = "ZEROD_CHECKPOINT_TIMEOUT",
     .fallback = "600",
     .parse = flag_parse_int,
     .lo = 1,
     .hi = 86400,
     .expected = "seconds, 1..86400",
     .help = "  --checkpoint-timeout S  longest a checkpoint save or restore may take\n"
             "                          [ZEROD_CHECKPOINT_TIMEOUT, default 600]\n"},
    {.id = FLAG_RETAIN_DELETED_CHECKPOINTS,
     .name = "retain-deleted-checkpoints",
     .takes_value = 1,
     .env = "ZEROD_RETAIN_DELETED_CHECKPOINTS",
     .fallback = "0",
     .parse = flag_parse_duration_ms,
     .expected = "a duration: N, Ns, Nm, Nh or Nd, at most 3650d; 0 keeps them",
     .help = "  --retain-deleted-checkpoints DURATION\n"
             "                          remove a deleted job's checkpoints this long after the\n"
             "                          job's deletion (90s, 12h, 30d; 0: keep them until\n"
             "                          their tenant deletes them)\n"
             "                          [ZEROD_RETAIN_DELETED_CHECKPOINTS, default 0]\n"},
    {.id = FLAG_STALL_TIMEOUT,
     .name = "stall-timeout",
     .takes_value = 1,
     .env = "ZEROD_STALL_TIMEOUT",
     .fallback = "30s",
     .parse = flag_parse_duration_ms,
     .expected = "a duration: N, Ns, Nm, Nh or Nd, at most 3650d; 0: never",
     .help = "  --stall-timeout DURATION\n"
             "                          fail a job's operation on every rank once a rank has\n"
             "                          waited this long in a collective for a peer, naming\n"
             "                          it (docs/daemon.md, \"Stalls\"; 0: only the nodes'\n"
             "                          collective timeout ends the wait)\n"
             "                          [ZEROD_STALL_TIMEOUT, default 30s]\n"},
    ROW_JOB_IDLE_TTL,
    {.id = FLAG_EXPORT_ROOT,
     .name = "export-root",
     .takes_value = 1,
     .env = "ZEROD_EXPORT_ROOT",
     .help = "  --export-root DIR       a directory Export may write in, and Restore and Export\n"
             "                          may read a checkpoint path from (besides the checkpoint\n"
             "                          directory); repeat for more (at most 8); a relative\n"
             "                          export path is taken inside the first. Paths through\n"
             "                          '..' or a symbolic link are refused [ZEROD_EXPORT_ROOT,\n"
             "                          DIRs separated by ':'; default: the checkpoint dir]\n"},
    {.id = FLAG_FILE_MODE,
     .name = "file-mode",
     .takes_value = 1,
     .env = "ZEROD_FILE_MODE",
     .fallback = "0600",
     .parse = flag_parse_file_mode,
     .expected = "octal permissions with the owner's rw and no write for others, e.g. 0640",
     .help = "  --file-mode MODE        mode of the files written (checkpoints, exports, the\n"
             "                          state file), octal; directories get x where it has r\n"
             "                          (0640: 0750) [ZEROD_FILE_MODE, default 0600]\n"},
    {.id = FLAG_HEALTH_LISTEN,
     .name = "health-listen",
     .takes_value = 1,
     .env = "ZEROD_HEALTH_LISTEN",
     .help = "  --health-listen ADDR    also serve grpc.health.v1 alone, in plain text, on ADDR\n"
             "                          (for Kubernetes' gRPC probes, which speak no TLS)\n"
             "                          [ZEROD_HEALTH_LISTEN, default: none]\n"},
    ROW_METRICS_LISTEN,
    ROW_LOG_LEVEL,
    ROW_LOG_FORMAT,
    {.id = FLAG_TLS_CERT,
     .name = "tls-cert",
     .takes_value = 1,
     .env = "ZEROD_TLS_CERT",
     .help = "  --tls-cert FILE         serve TLS with this certificate chain (PEM) "
             "[ZEROD_TLS_CERT]\n"},
    {.id = FLAG_TLS_KEY,
     .name = "tls-key",
     .takes_value = 1,
     .env = "ZEROD_TLS_KEY",
     .help = "  --tls-key FILE          ... and its private key [ZEROD_TLS_KEY]\n"},
    {.id = FLAG_TLS_CLIENT_CA,
     .name = "tls-client-ca",
     .takes_value = 1,
     .env = "ZEROD_TLS_CLIENT_CA",
     .help =
         "  --tls-client-ca FILE    verify client certificates signed by this CA; a verified\n"
         "                          certificate's CN names a principal [ZEROD_TLS_CLIENT_CA]\n"},
    {.id = FLAG_TLS_REQUIRE_CLIENT_CERT,
     .name = "tls-require-client-cert",
     .env = "ZEROD_TLS_REQUIRE_CLIENT_CERT",
     .help = "  --tls-require-client-cert  refuse clients without one (mutual TLS)\n"
             "                          [ZEROD_TLS_REQUIRE_CLIENT_CERT=1]\n"},
    {.id = FLAG_AUTH_FILE,
     .name = "auth-file",
     .takes_value = 1,
     .env = "ZEROD_AUTH_FILE",
     .help = "  --auth-file FILE        principals: who may do what (docs/security.md)\n"
             "                          [ZEROD_AUTH_FILE; none: every caller may do everything]\n"},
    {.id = FLAG_INSECURE,
     .name = "insecure",
     .env = "ZEROD_INSECURE",
     .help =
         "  --insecure              allow plain TCP and no --auth-file on an address other\n"
         "                          hosts can reach (logged as a warning) [ZEROD_INSECURE=1]\n"},
    ROW_HELP,
};

const flag_table flags_coordinator = {.usage_head = coordinator_usage_head,
                                      .usage_tail = coordinator_usage_tail,
                                      .flags = coordinator_flags,
                                      .n_flags =
                                          sizeof coordinator_flags / sizeof coordinator_flags[0],
                                      .getopt_order = NULL};
