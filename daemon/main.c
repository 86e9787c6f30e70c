/* zerod: command line, configuration and the process lifecycle.
 *
 *   zerod [standalone]   one node daemon with N CPU ranks and its rendezvous
 *                        in this process, socket and state in a local dir
 *   zerod node           a node daemon that joins a coordinator
 *   zerod coordinator    the cluster's coordinator (coord.h) over gRPC
 *
 * Every flag has a ZEROD_* environment variable; a flag wins over the
 * variable. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "coord.h"
#include "daemon.h"
#include "ckpt_call.h"
#include "tier.h"
#include "ckpt_node.h"
#include "health.h"
#include "log.h"
#include "metrics_http.h"
#include "pbcheck.h"
#include "size.h"
#include "cluster.h"
#include "filemode.h"
#include "jobs.h"
#include "cuda/zk_cuda.h"

#define ZEROD_VERSION "0.1.0"

static void usage(FILE *out) {
  fprintf(out,
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
          "options (each also read from the environment variable shown):\n"
          "  --ranks N               ranks hosted by this daemon; standalone: every job\n"
          "                          has N ranks; node: the most a job may place here\n"
          "                          [ZEROD_RANKS, default 1]\n"
          "  --device KIND           where the ranks' shards live and run: cpu (host memory,\n"
          "                          Gloo); cuda (rank i on GPU i, NCCL, CUDA IPC to\n"
          "                          workers; not yet validated on a GPU); auto (cuda\n"
          "                          if every rank has a GPU, else cpu) [ZEROD_DEVICE,\n"
          "                          default cpu]\n"
          "  --dir DIR               state directory: lock file and default socket\n"
          "                          [ZEROD_DIR, default ./.zerod]\n"
          "  --socket PATH           IPC socket path [ZEROD_SOCKET, default DIR/zerod.sock]\n"
          "  --socket-group GROUP    make the socket mode 0660 owned by GROUP (default: 0600,\n"
          "                          this user only) [ZEROD_SOCKET_GROUP]\n"
          "  --threads-per-rank N    kernel threads per rank [ZEROD_THREADS_PER_RANK,\n"
          "                          default: CPUs / ranks, at least 1]\n"
          "  --collective-timeout S  seconds a collective waits for a peer rank before the\n"
          "                          job fails [ZEROD_COLLECTIVE_TIMEOUT, default 60]\n"
          "  --max-live-bytes SIZE   default per-job, per-rank budget of gathered and gradient\n"
          "                          buffers, e.g. 512M, 4G [ZEROD_MAX_LIVE_BYTES, default 2G]\n"
          "  --max-sessions N        most worker connections [ZEROD_MAX_SESSIONS, default 1024]\n"
          "  --checkpoint-dir DIR    standalone: where checkpoints are saved\n"
          "                          [ZEROD_CHECKPOINT_DIR, default DIR/checkpoints]\n"
          "  --checkpoint-timeout S  standalone: longest a checkpoint save or restore may\n"
          "                          take [ZEROD_CHECKPOINT_TIMEOUT, default 600]\n"
          "  --export-root DIR       standalone: a directory Export may write in, and Restore\n"
          "                          and Export may read a checkpoint path from (besides the\n"
          "                          checkpoint directory); repeat for more; a relative\n"
          "                          export path is taken inside the first. Paths through\n"
          "                          '..' or a symbolic link are refused [ZEROD_EXPORT_ROOT,\n"
          "                          DIRs separated by ':'; default: the checkpoint dir]\n"
          "  --file-mode MODE        mode of the files written (checkpoints, exports, state),\n"
          "                          octal; directories get x where it has r (0640: 0750)\n"
          "                          [ZEROD_FILE_MODE, default 0600]\n"
          "  --nvme-dir DIR          where jobs with offload_optimizer nvme keep their optimizer\n"
          "                          state (a fast local disk; one daemon per directory: files\n"
          "                          left by a daemon that died are removed at start)\n"
          "                          [ZEROD_NVME_DIR, default DIR/nvme]\n"
          "  --coordinator HOST:PORT zerod node: the coordinator to join\n"
          "                          [ZEROD_COORDINATOR]\n"
          "  --name NAME             zerod node: this node's name, unique in the cluster\n"
          "                          [ZEROD_NODE_NAME, default: the host name]\n"
          "  --comm-host ADDR        address the ranks' Gloo connections use (and, for\n"
          "                          zerod node, that other nodes reach it on)\n"
          "                          [ZEROD_COMM_HOST, default 127.0.0.1]\n"
          "  --log-level LEVEL       debug, info, warn or error [ZEROD_LOG_LEVEL, default info]\n"
          "  --health-listen ADDR    serve grpc.health.v1 for probes on ADDR (HOST:PORT,\n"
          "                          unix:PATH): SERVING while a member of the cluster (node)\n"
          "                          or ready (standalone), NOT_SERVING while joining or\n"
          "                          draining [ZEROD_HEALTH_LISTEN, default: none]\n"
          "  --metrics-listen ADDR   serve Prometheus metrics at http://ADDR/metrics (HOST:PORT,\n"
          "                          :PORT for every address) [ZEROD_METRICS_LISTEN, default:\n"
          "                          none]\n"
          "  --log-format FORMAT     logfmt or json (one JSON object per line)\n"
          "                          [ZEROD_LOG_FORMAT, default logfmt]\n"
          "  --tls-ca FILE           zerod node: reach the coordinator over TLS, verifying it\n"
          "                          with this CA (PEM) [ZEROD_TLS_CA]\n"
          "  --tls-cert FILE         zerod node: client certificate for mutual TLS\n"
          "  --tls-key FILE          ... and its key [ZEROD_TLS_CERT, ZEROD_TLS_KEY]\n"
          "  --tls-server-name NAME  zerod node: the name to expect in the coordinator's\n"
          "                          certificate [ZEROD_TLS_SERVER_NAME, default: its host]\n"
          "  --auth-token-file FILE  zerod node: bearer token for the coordinator [ZEROD_AUTH_\n"
          "                          TOKEN_FILE, or the token itself in ZEROD_AUTH_TOKEN]\n"
          "  --insecure              zerod node: allow plain TCP to a coordinator on another\n"
          "                          host [ZEROD_INSECURE=1]\n"
          "  --version               print the version and exit\n"
          "  -h, --help              print this help and exit\n"
          "\n"
          "Logs go to stderr, one line per event. SIGINT or SIGTERM shut down cleanly:\n"
          "workers are told, executors stopped, shared memory freed, the socket removed.\n");
}

static int parse_int(const char *s, int lo, int hi, int *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi)
    return -1;
  *out = (int)v;
  return 0;
}

enum {
  OPT_RANKS = 1000,
  OPT_DIR,
  OPT_SOCKET,
  OPT_SOCKET_GROUP,
  OPT_THREADS,
  OPT_TIMEOUT,
  OPT_MAX_LIVE,
  OPT_MAX_SESSIONS,
  OPT_COMM_HOST,
  OPT_LOG_LEVEL,
  OPT_HEALTH_LISTEN,
  OPT_METRICS_LISTEN,
  OPT_LOG_FORMAT,
  OPT_VERSION,
  OPT_COORDINATOR,
  OPT_NAME,
  OPT_DEVICE,
  OPT_CHECKPOINT_DIR,
  OPT_CHECKPOINT_TIMEOUT,
  OPT_EXPORT_ROOT,
  OPT_FILE_MODE,
  OPT_NVME_DIR,
};

typedef struct raw_options {
  const char *ranks, *dir, *socket, *socket_group, *threads, *timeout, *max_live, *max_sessions,
      *comm_host, *log_level, *log_format, *coordinator, *name, *device, *checkpoint_dir,
      *checkpoint_timeout, *file_mode, *health_listen, *metrics_listen, *nvme_dir;
  const char *export_roots[COORD_MAX_EXPORT_ROOTS + 1]; /* one more: to say there are too many */
  unsigned n_export_roots;
} raw_options;

static const char *env_or(const char *flag, const char *name) {
  return flag != NULL ? flag : getenv(name);
}

static int bad_value(const char *flag, const char *value, const char *expected);

/* --log-level and --log-format (or their variables), before anything is
 * logged. 0, or bad_value's exit status. */
static int apply_log_flags(const char *level_flag, const char *format_flag) {
  const char *v;
  if ((v = env_or(level_flag, "ZEROD_LOG_LEVEL")) != NULL) {
    int level = log_parse_level(v);
    if (level < 0)
      return bad_value("--log-level", v, "debug, info, warn or error");
    log_set_level((log_level)level);
  }
  if ((v = env_or(format_flag, "ZEROD_LOG_FORMAT")) != NULL) {
    int format = log_parse_format(v);
    if (format < 0)
      return bad_value("--log-format", v, "logfmt or json");
    log_set_format((log_format)format);
  }
  return 0;
}

static int bad_value(const char *flag, const char *value, const char *expected) {
  fprintf(stderr, "zerod: invalid %s '%s' (%s)\n", flag, value, expected);
  return 2;
}

/* ------------------------------------------------------------------------ */
/* Control-plane security flags (docs/security.md)                          */
/* ------------------------------------------------------------------------ */

enum {
  SEC_TLS_CA = 3000,
  SEC_TLS_CERT,
  SEC_TLS_KEY,
  SEC_TLS_SERVER_NAME,
  SEC_TLS_CLIENT_CA,
  SEC_TLS_REQUIRE_CLIENT_CERT,
  SEC_TOKEN_FILE,
  SEC_AUTH_FILE,
  SEC_INSECURE,
};

/* The flags as given (NULL: not given); the environment fills the rest. */
typedef struct security_flags {
  const char *tls_ca, *tls_cert, *tls_key, *tls_server_name, *tls_client_ca, *token_file,
      *auth_file;
  int require_client_cert, insecure;
} security_flags;

#define SECURITY_CLIENT_OPTIONS                                                                    \
  {"tls-ca", required_argument, NULL, SEC_TLS_CA},                                                 \
      {"tls-cert", required_argument, NULL, SEC_TLS_CERT},                                         \
      {"tls-key", required_argument, NULL, SEC_TLS_KEY},                                           \
      {"tls-server-name", required_argument, NULL, SEC_TLS_SERVER_NAME},                           \
      {"auth-token-file", required_argument, NULL, SEC_TOKEN_FILE}, {                              \
    "insecure", no_argument, NULL, SEC_INSECURE                                                    \
  }
#define SECURITY_SERVER_OPTIONS                                                                    \
  {"tls-cert", required_argument, NULL, SEC_TLS_CERT},                                             \
      {"tls-key", required_argument, NULL, SEC_TLS_KEY},                                           \
      {"tls-client-ca", required_argument, NULL, SEC_TLS_CLIENT_CA},                               \
      {"tls-require-client-cert", no_argument, NULL, SEC_TLS_REQUIRE_CLIENT_CERT},                 \
      {"auth-file", required_argument, NULL, SEC_AUTH_FILE}, {                                     \
    "insecure", no_argument, NULL, SEC_INSECURE                                                    \
  }

/* Takes option c if it is a security flag: returns 1, else 0. */
static int security_option(int c, const char *arg, security_flags *f) {
  switch (c) {
  case SEC_TLS_CA:
    f->tls_ca = arg;
    return 1;
  case SEC_TLS_CERT:
    f->tls_cert = arg;
    return 1;
  case SEC_TLS_KEY:
    f->tls_key = arg;
    return 1;
  case SEC_TLS_SERVER_NAME:
    f->tls_server_name = arg;
    return 1;
  case SEC_TLS_CLIENT_CA:
    f->tls_client_ca = arg;
    return 1;
  case SEC_TLS_REQUIRE_CLIENT_CERT:
    f->require_client_cert = 1;
    return 1;
  case SEC_TOKEN_FILE:
    f->token_file = arg;
    return 1;
  case SEC_AUTH_FILE:
    f->auth_file = arg;
    return 1;
  case SEC_INSECURE:
    f->insecure = 1;
    return 1;
  default:
    return 0;
  }
}

static int env_flag(const char *name) {
  const char *v = getenv(name);
  return v != NULL && (strcmp(v, "1") == 0 || strcmp(v, "true") == 0 || strcmp(v, "yes") == 0);
}

/* The coordinator's listener flags not given, from the environment (a
 * node's client settings: rpc_client_credentials). */
static void server_security_from_env(security_flags *f) {
  f->tls_cert = env_or(f->tls_cert, "ZEROD_TLS_CERT");
  f->tls_key = env_or(f->tls_key, "ZEROD_TLS_KEY");
  f->tls_client_ca = env_or(f->tls_client_ca, "ZEROD_TLS_CLIENT_CA");
  f->auth_file = env_or(f->auth_file, "ZEROD_AUTH_FILE");
  f->require_client_cert |= env_flag("ZEROD_TLS_REQUIRE_CLIENT_CERT");
  f->insecure |= rpc_insecure_from_env();
}

/* --checkpoint-timeout: seconds, 1..86400, into milliseconds. */
static int parse_checkpoint_timeout(const char *flag, int *timeout_ms) {
  const char *v = env_or(flag, "ZEROD_CHECKPOINT_TIMEOUT");
  int seconds = 600;
  if (v != NULL && parse_int(v, 1, 86400, &seconds) != 0)
    return bad_value("--checkpoint-timeout", v, "seconds, 1..86400");
  *timeout_ms = seconds * 1000;
  return 0;
}

/* --retain-deleted-checkpoints: a duration, N with s, m, h or d (or no
 * unit: seconds), at most 10 years; 0 keeps them. */
static int parse_retention(const char *flag, int64_t *ms) {
  const char *v = env_or(flag, "ZEROD_RETAIN_DELETED_CHECKPOINTS");
  *ms = 0;
  if (v == NULL)
    return 0;
  char *end;
  errno = 0;
  unsigned long long n = strtoull(v, &end, 10);
  int64_t unit_s = *end == '\0' || strcmp(end, "s") == 0 ? 1
                   : strcmp(end, "m") == 0               ? 60
                   : strcmp(end, "h") == 0               ? 3600
                   : strcmp(end, "d") == 0               ? 86400
                                                         : 0;
  if (errno != 0 || end == v || v[0] == '-' || unit_s == 0 ||
      n > 3650ull * 86400 / (uint64_t)unit_s)
    return bad_value("--retain-deleted-checkpoints", v,
                     "a duration: N, Ns, Nm, Nh or Nd, at most 3650d; 0 keeps them");
  *ms = (int64_t)n * unit_s * 1000;
  return 0;
}

/* --file-mode (or ZEROD_FILE_MODE): set for the whole process, before
 * anything is written. */
static int file_mode_option(const char *flag) {
  const char *v = env_or(flag, "ZEROD_FILE_MODE");
  mode_t mode = FILEMODE_DEFAULT;
  if (v != NULL && filemode_parse(v, &mode) != 0)
    return bad_value("--file-mode", v,
                     "octal permissions with the owner's rw and no write for others, e.g. 0640");
  filemode_set(mode);
  return 0;
}

/* --export-root, repeated, else ZEROD_EXPORT_ROOT (directories separated
 * by ':'): directories that exist, made canonical (realpath), so that a
 * client's path is compared with what the filesystem holds. Prints the
 * error and returns nonzero on failure. */
static int export_roots_option(const char *const *flags, unsigned nflags, coord_options *co) {
  char env_copy[COORD_MAX_EXPORT_ROOTS * PATH_MAX];
  const char *given[COORD_MAX_EXPORT_ROOTS + 1];
  unsigned n = 0;
  const char *env = getenv("ZEROD_EXPORT_ROOT");
  if (nflags > 0) {
    for (; n < nflags && n <= COORD_MAX_EXPORT_ROOTS; n++)
      given[n] = flags[n];
  } else if (env != NULL && env[0] != '\0') {
    if (snprintf(env_copy, sizeof env_copy, "%s", env) >= (int)sizeof env_copy)
      return bad_value("ZEROD_EXPORT_ROOT", env, "too long");
    char *save = NULL;
    for (char *dir = strtok_r(env_copy, ":", &save); dir != NULL && n <= COORD_MAX_EXPORT_ROOTS;
         dir = strtok_r(NULL, ":", &save))
      given[n++] = dir;
  }
  if (n > COORD_MAX_EXPORT_ROOTS) {
    fprintf(stderr, "zerod: at most %d export roots\n", COORD_MAX_EXPORT_ROOTS);
    return 2;
  }
  for (unsigned i = 0; i < n; i++) {
    char resolved[PATH_MAX];
    struct stat st;
    const char *why = NULL;
    if (given[i][0] == '\0')
      why = "empty";
    else if (realpath(given[i], resolved) == NULL || stat(resolved, &st) != 0)
      why = strerror(errno); /* not created: an operator's directory */
    else if (!S_ISDIR(st.st_mode))
      why = "not a directory";
    if (why != NULL) {
      fprintf(stderr, "zerod: --export-root %s: %s\n", given[i], why);
      return 1;
    }
    if (strlen(resolved) > PATH_MAX - 512)
      return bad_value("--export-root", resolved, "path too long");
    snprintf(co->export_roots[i], sizeof co->export_roots[i], "%s", resolved);
  }
  co->n_export_roots = n;
  return 0;
}

static int mkdir_p(const char *path);

/* The checkpoint directory: the flag, else ZEROD_CHECKPOINT_DIR, else
 * fallback/checkpoints; created, then made absolute (it travels to the
 * nodes, which must find the same directory). Room is left for what is
 * appended (<job>/<name>.tmp-<id>/<file>). Prints the error and returns
 * nonzero on failure. */
static int checkpoint_dir_option(const char *flag, const char *fallback, char *out,
                                 size_t out_bytes) {
  const char *v = env_or(flag, "ZEROD_CHECKPOINT_DIR");
  char dir[PATH_MAX];
  if ((v != NULL && v[0] == '\0') || snprintf(dir, sizeof dir, v != NULL ? "%s" : "%s/checkpoints",
                                              v != NULL ? v : fallback) >= (int)sizeof dir - 512)
    return bad_value("--checkpoint-dir", v != NULL ? v : fallback, "a directory, path too long");
  int rc = mkdir_p(dir);
  char resolved[PATH_MAX];
  if (rc != 0 || realpath(dir, resolved) == NULL) {
    fprintf(stderr, "zerod: cannot create checkpoint directory %s: %s\n", dir,
            strerror(rc != 0 ? -rc : errno));
    return 1;
  }
  if (strlen(resolved) >= out_bytes - 512)
    return bad_value("--checkpoint-dir", resolved, "path too long");
  /* The path travels to the nodes in every save order, a string field:
   * they refuse one that is not UTF-8 (docs/control-plane.md). */
  if (!zd_utf8_valid(resolved, strlen(resolved)))
    return bad_value("--checkpoint-dir", resolved, "a path in UTF-8");
  snprintf(out, out_bytes, "%s", resolved);
  return 0;
}

/* mkdir -p, the directories made with the directory mode (filemode.h). */
static int mkdir_p(const char *path) {
  char tmp[PATH_MAX];
  snprintf(tmp, sizeof tmp, "%s", path);
  int rc;
  for (char *p = tmp + 1; *p != '\0'; p++) {
    if (*p != '/')
      continue;
    *p = '\0';
    if ((rc = filemode_mkdirat(AT_FDCWD, tmp)) != 0 && rc != -EEXIST)
      return rc;
    *p = '/';
  }
  if ((rc = filemode_mkdirat(AT_FDCWD, tmp)) != 0 && rc != -EEXIST)
    return rc;
  return 0;
}

/* Takes the state directory's lock file (one process per directory) and
 * writes our pid into it. Prints the error and returns -1 if another process
 * holds it. */
static int lock_state_dir(const char *lock_path, const char *dir, int *fd_out) {
  int fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char other[32] = "";
    if (fd >= 0) {
      ssize_t n = pread(fd, other, sizeof other - 1, 0);
      other[n > 0 ? n : 0] = '\0';
      other[strcspn(other, "\n")] = '\0';
      close(fd);
    }
    fprintf(stderr, "zerod: another zerod (pid %s) is using state directory %s\n",
            other[0] ? other : "?", dir);
    return -1;
  }
  if (ftruncate(fd, 0) == 0) {
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    ssize_t w = pwrite(fd, pid, (size_t)n, 0);
    (void)w;
  }
  *fd_out = fd;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* zerod coordinator                                                        */
/* ------------------------------------------------------------------------ */

static void coordinator_usage(FILE *out) {
  fprintf(out,
          "usage: zerod coordinator [options]\n"
          "\n"
          "Runs the cluster's coordinator: membership, jobs, rendezvous, checkpoints and\n"
          "health over gRPC. Node daemons (zerod node) and zerodctl dial it; it never\n"
          "dials them.\n"
          "\n"
          "options (each also read from the environment variable shown):\n"
          "  --listen ADDR           address to serve gRPC on, HOST:PORT (port 0: any free\n"
          "                          port) [ZEROD_LISTEN, default 0.0.0.0:7070]\n"
          "  --state-dir DIR         durable state (jobs), written atomically\n"
          "                          [ZEROD_STATE_DIR, default ./.zerod-coordinator]\n"
          "  --lease-ttl S           seconds a node may go without a heartbeat before it\n"
          "                          leaves the view [ZEROD_LEASE_TTL, default 10]\n"
          "  --checkpoint-dir DIR    where checkpoints are saved; every node must see it at\n"
          "                          the same path (a shared filesystem)\n"
          "                          [ZEROD_CHECKPOINT_DIR, default STATE-DIR/checkpoints]\n"
          "  --checkpoint-timeout S  longest a checkpoint save or restore may take\n"
          "                          [ZEROD_CHECKPOINT_TIMEOUT, default 600]\n"
          "  --retain-deleted-checkpoints DURATION\n"
          "                          remove a deleted job's checkpoints this long after the\n"
          "                          job's deletion (90s, 12h, 30d; 0: keep them until\n"
          "                          their tenant deletes them)\n"
          "                          [ZEROD_RETAIN_DELETED_CHECKPOINTS, default 0]\n"
          "  --export-root DIR       a directory Export may write in, and Restore and Export\n"
          "                          may read a checkpoint path from (besides the checkpoint\n"
          "                          directory); repeat for more (at most 8); a relative\n"
          "                          export path is taken inside the first. Paths through\n"
          "                          '..' or a symbolic link are refused [ZEROD_EXPORT_ROOT,\n"
          "                          DIRs separated by ':'; default: the checkpoint dir]\n"
          "  --file-mode MODE        mode of the files written (checkpoints, exports, the\n"
          "                          state file), octal; directories get x where it has r\n"
          "                          (0640: 0750) [ZEROD_FILE_MODE, default 0600]\n"
          "  --health-listen ADDR    also serve grpc.health.v1 alone, in plain text, on ADDR\n"
          "                          (for Kubernetes' gRPC probes, which speak no TLS)\n"
          "                          [ZEROD_HEALTH_LISTEN, default: none]\n"
          "  --metrics-listen ADDR   serve Prometheus metrics at http://ADDR/metrics (HOST:PORT,\n"
          "                          :PORT for every address) [ZEROD_METRICS_LISTEN, default:\n"
          "                          none]\n"
          "  --log-level LEVEL       debug, info, warn or error [ZEROD_LOG_LEVEL, default info]\n"
          "  --log-format FORMAT     logfmt or json (one JSON object per line)\n"
          "                          [ZEROD_LOG_FORMAT, default logfmt]\n"
          "  --tls-cert FILE         serve TLS with this certificate chain (PEM) [ZEROD_TLS_CERT]\n"
          "  --tls-key FILE          ... and its private key [ZEROD_TLS_KEY]\n"
          "  --tls-client-ca FILE    verify client certificates signed by this CA; a verified\n"
          "                          certificate's CN names a principal [ZEROD_TLS_CLIENT_CA]\n"
          "  --tls-require-client-cert  refuse clients without one (mutual TLS)\n"
          "                          [ZEROD_TLS_REQUIRE_CLIENT_CERT=1]\n"
          "  --auth-file FILE        principals: who may do what (docs/security.md)\n"
          "                          [ZEROD_AUTH_FILE; none: every caller may do everything]\n"
          "  --insecure              allow plain TCP and no --auth-file on an address other\n"
          "                          hosts can reach (logged as a warning) [ZEROD_INSECURE=1]\n"
          "  -h, --help              print this help and exit\n"
          "\n"
          "SIGINT or SIGTERM shut down cleanly: watches end, calls in flight are cancelled.\n");
}

typedef struct coordinator_process {
  uv_loop_t *loop;
  coord *coord;
  rpc_server *server;
  rpc_server *health_server; /* --health-listen, or NULL */
  health *health;
  metrics *metrics; /* --metrics-listen, or NULL */
  metrics_http *metrics_http;
  uv_signal_t sigint, sigterm;
  int stopping;
} coordinator_process;

/* --health-listen: a server of its own that serves grpc.health.v1 alone
 * (coord/health.c), on loop, not yet serving. Returns 0, or 1 with the
 * reason on stderr; on failure *server may still need its shutdown. */
static int start_health_listener(uv_loop_t *loop, const char *addr, const char *const *services,
                                 size_t nservices, rpc_server **server, health **h, int *port) {
  char err[512] = "";
  int rc = rpc_server_create(loop, addr, server, err, sizeof err);
  if (rc == 0)
    rc = health_register(*server, services, nservices, h);
  if (rc == 0)
    rc = rpc_server_set_identify(*server, health_identify_anonymous, NULL, 0);
  if (rc == 0)
    rc = rpc_server_start(*server, port, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "zerod: --health-listen %s: %s\n", addr, err[0] ? err : strerror(-rc));
    return 1;
  }
  return 0;
}

/* --metrics-listen: a registry (with zerod_build_info) served over HTTP
 * on loop for Prometheus. Nothing when addr is NULL or empty. Returns 0,
 * or 1 with the reason on stderr. */
static int start_metrics(uv_loop_t *loop, const char *addr, const char *mode, metrics **m,
                         metrics_http **http) {
  *m = NULL;
  *http = NULL;
  if (addr == NULL || addr[0] == '\0')
    return 0;
  *m = metrics_create();
  if (*m == NULL) {
    fprintf(stderr, "zerod: --metrics-listen: out of memory\n");
    return 1;
  }
  static const char *const labels[] = {"version", "mode", NULL};
  const char *const values[] = {ZEROD_VERSION, mode, NULL};
  metric_set(metric_family_kept(metrics_family(*m, METRIC_GAUGE, "zerod_build_info",
                                               "1, labelled with the version and mode that run.",
                                               labels, NULL, 0),
                                values),
             1);
  char err[512] = "";
  int port = 0;
  int rc = metrics_http_start(loop, *m, addr, http, &port, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "zerod: --metrics-listen %s: %s\n", addr, err[0] ? err : strerror(-rc));
    metrics_free(*m);
    *m = NULL;
    return 1;
  }
  LOG_INFOF("metrics listening", "address=%s port=%d path=/metrics", addr, port);
  return 0;
}

static void on_coordinator_server_done(void *arg) {
  (void)arg;
  LOG_INFOF("coordinator stopped serving", NULL);
}

static void on_coordinator_signal(uv_signal_t *handle, int signum) {
  coordinator_process *p = handle->data;
  if (p->stopping)
    return;
  p->stopping = 1;
  LOG_INFOF("shutting down", "reason=%s", signum == SIGINT ? "SIGINT" : "SIGTERM");
  if (p->health_server != NULL) {
    health_shutdown(p->health);
    rpc_server_shutdown_gently(p->health_server, on_coordinator_server_done, p);
  }
  metrics_http_stop(p->metrics_http);
  p->metrics_http = NULL;
  coord_shutdown(p->coord);
  /* Gently: the calls coord_shutdown just answered (a Save in flight:
   * "coordinator shutting down") reach their callers before the rest is
   * cancelled. */
  rpc_server_shutdown_gently(p->server, on_coordinator_server_done, p);
  uv_close((uv_handle_t *)&p->sigint, NULL);
  uv_close((uv_handle_t *)&p->sigterm, NULL);
}

/* Start failed after the server began serving: stop what was started
 * (nothing was accepted yet) and let the loop finish closing it. */
static void abandon_start(coordinator_process *p) {
  metrics_http_stop(p->metrics_http);
  p->metrics_http = NULL;
  coord_shutdown(p->coord);
  rpc_server_shutdown(p->server, on_coordinator_server_done, p);
  if (p->health_server != NULL)
    rpc_server_shutdown_gently(p->health_server, on_coordinator_server_done, p);
  uv_run(p->loop, UV_RUN_DEFAULT);
}

static int run_coordinator(int argc, char **argv) {
  enum {
    C_LISTEN = 2000,
    C_STATE_DIR,
    C_LEASE_TTL,
    C_LOG_LEVEL,
    C_LOG_FORMAT,
    C_CHECKPOINT_DIR,
    C_CHECKPOINT_TIMEOUT,
    C_RETAIN_DELETED,
    C_EXPORT_ROOT,
    C_FILE_MODE,
    C_HEALTH_LISTEN,
    C_METRICS_LISTEN
  };
  static const struct option long_options[] = {
      {"listen", required_argument, NULL, C_LISTEN},
      {"state-dir", required_argument, NULL, C_STATE_DIR},
      {"lease-ttl", required_argument, NULL, C_LEASE_TTL},
      {"checkpoint-dir", required_argument, NULL, C_CHECKPOINT_DIR},
      {"checkpoint-timeout", required_argument, NULL, C_CHECKPOINT_TIMEOUT},
      {"retain-deleted-checkpoints", required_argument, NULL, C_RETAIN_DELETED},
      {"export-root", required_argument, NULL, C_EXPORT_ROOT},
      {"file-mode", required_argument, NULL, C_FILE_MODE},
      {"health-listen", required_argument, NULL, C_HEALTH_LISTEN},
      {"metrics-listen", required_argument, NULL, C_METRICS_LISTEN},
      {"log-level", required_argument, NULL, C_LOG_LEVEL},
      {"log-format", required_argument, NULL, C_LOG_FORMAT},
      SECURITY_SERVER_OPTIONS,
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  security_flags sec = {0};
  const char *listen_flag = NULL, *dir_flag = NULL, *ttl_flag = NULL, *level_flag = NULL,
             *format_flag = NULL;
  const char *checkpoint_dir_flag = NULL, *checkpoint_timeout_flag = NULL, *file_mode_flag = NULL,
             *health_flag = NULL, *metrics_flag = NULL, *retain_flag = NULL;
  const char *export_root_flags[COORD_MAX_EXPORT_ROOTS + 1];
  unsigned n_export_root_flags = 0;
  int c;
  while ((c = getopt_long(argc, argv, "h", long_options, NULL)) != -1) {
    switch (c) {
    case C_LISTEN:
      listen_flag = optarg;
      break;
    case C_STATE_DIR:
      dir_flag = optarg;
      break;
    case C_LEASE_TTL:
      ttl_flag = optarg;
      break;
    case C_LOG_LEVEL:
      level_flag = optarg;
      break;
    case C_LOG_FORMAT:
      format_flag = optarg;
      break;
    case C_CHECKPOINT_DIR:
      checkpoint_dir_flag = optarg;
      break;
    case C_CHECKPOINT_TIMEOUT:
      checkpoint_timeout_flag = optarg;
      break;
    case C_RETAIN_DELETED:
      retain_flag = optarg;
      break;
    case C_EXPORT_ROOT:
      if (n_export_root_flags <= COORD_MAX_EXPORT_ROOTS)
        export_root_flags[n_export_root_flags++] = optarg;
      break;
    case C_FILE_MODE:
      file_mode_flag = optarg;
      break;
    case C_METRICS_LISTEN:
      metrics_flag = optarg;
      break;
    case C_HEALTH_LISTEN:
      health_flag = optarg;
      break;
    case 'h':
      coordinator_usage(stdout);
      return 0;
    default:
      if (security_option(c, optarg, &sec))
        break;
      coordinator_usage(stderr);
      return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "zerod coordinator: unexpected argument '%s'\n", argv[optind]);
    return 2;
  }
  int log_rc = apply_log_flags(level_flag, format_flag);
  if (log_rc != 0)
    return log_rc;
  const char *v;
  coord_options co = {.lease_ttl_ms = 10000};
  if ((v = env_or(ttl_flag, "ZEROD_LEASE_TTL")) != NULL) {
    char *end;
    double ttl = strtod(v, &end);
    if (end == v || *end != '\0' || !(ttl >= 0.1 && ttl <= 3600))
      return bad_value("--lease-ttl", v, "seconds, 0.1..3600");
    co.lease_ttl_ms = (int)(ttl * 1000 + 0.5);
  }
  v = env_or(dir_flag, "ZEROD_STATE_DIR");
  if (snprintf(co.state_dir, sizeof co.state_dir, "%s", v != NULL ? v : ".zerod-coordinator") >=
      (int)sizeof co.state_dir - 32)
    return bad_value("--state-dir", v, "path too long");
  const char *listen_addr = env_or(listen_flag, "ZEROD_LISTEN");
  if (listen_addr == NULL)
    listen_addr = "0.0.0.0:7070";
  const char *colon = strrchr(listen_addr, ':');
  if (colon == NULL || colon == listen_addr || colon[1] == '\0' || strlen(listen_addr) > 255)
    return bad_value("--listen", listen_addr, "HOST:PORT");

  if (parse_checkpoint_timeout(checkpoint_timeout_flag, &co.checkpoint_timeout_ms) != 0)
    return 2;
  if (parse_retention(retain_flag, &co.retain_deleted_checkpoints_ms) != 0)
    return 2;
  if (file_mode_option(file_mode_flag) != 0)
    return 2;

  /* Who can reach the listener, and what they may do (docs/security.md):
   * plain transport and no principals only where nobody else can reach
   * it, or when the operator says so. */
  server_security_from_env(&sec);
  rpc_tls tls = {.cert_file = sec.tls_cert,
                 .key_file = sec.tls_key,
                 .ca_file = sec.tls_client_ca,
                 .require_client_cert = sec.require_client_cert};
  int use_tls = sec.tls_cert != NULL || sec.tls_key != NULL;
  if (!use_tls && (sec.tls_client_ca != NULL || sec.require_client_cert)) {
    fprintf(stderr, "zerod: --tls-client-ca and --tls-require-client-cert need --tls-cert and "
                    "--tls-key\n");
    return 2;
  }
  int local = rpc_address_is_local(listen_addr);
  if (!use_tls && !local && !sec.insecure) {
    fprintf(stderr,
            "zerod: --listen %s is reachable from other hosts: serve TLS (--tls-cert, --tls-key) "
            "or pass --insecure\n",
            listen_addr);
    return 2;
  }
  if (sec.auth_file == NULL && !local && !sec.insecure) {
    fprintf(stderr,
            "zerod: --listen %s is reachable from other hosts and no principals are configured: "
            "anyone could delete any job. Pass --auth-file (docs/security.md) or --insecure\n",
            listen_addr);
    return 2;
  }
  if (sec.auth_file != NULL &&
      snprintf(co.auth_file, sizeof co.auth_file, "%s", sec.auth_file) >= (int)sizeof co.auth_file)
    return bad_value("--auth-file", sec.auth_file, "path too long");

  int rc = export_roots_option(export_root_flags, n_export_root_flags, &co);
  if (rc != 0)
    return rc;
  rc = mkdir_p(co.state_dir);
  if (rc != 0) {
    fprintf(stderr, "zerod: cannot create state directory %s: %s\n", co.state_dir, strerror(-rc));
    return 1;
  }
  if ((rc = checkpoint_dir_option(checkpoint_dir_flag, co.state_dir, co.checkpoint_dir,
                                  sizeof co.checkpoint_dir)) != 0)
    return rc;
  char lock_path[PATH_MAX + 32];
  snprintf(lock_path, sizeof lock_path, "%s/coordinator.lock", co.state_dir);
  int lock_fd = -1;
  if (lock_state_dir(lock_path, co.state_dir, &lock_fd) != 0)
    return 1;

  /* Every client connection holds a descriptor: take the whole allowance
   * (running out is survived, docs/security.md, but costs every call in
   * flight). */
  struct rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
  coordinator_process p = {.loop = uv_default_loop()};
  char err[512] = "";
  int status = 1;
  rc = coord_create(p.loop, &co, &p.coord, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "zerod: coordinator state in %s: %s\n", co.state_dir, err);
    goto out_lock;
  }
  rc = rpc_server_create(p.loop, listen_addr, &p.server, err, sizeof err);
  if (rc == 0 && use_tls)
    rc = rpc_server_set_tls(p.server, &tls, err, sizeof err);
  if (rc == 0)
    rc = coord_register(p.coord, p.server);

  int port = 0;
  if (rc == 0)
    rc = rpc_server_start(p.server, &port, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "zerod: cannot serve gRPC on %s: %s\n", listen_addr,
            err[0] ? err : strerror(-rc));
    /* Nothing was accepted: shutting down finishes on the next loop turn. */
    coord_shutdown(p.coord);
    if (p.server != NULL)
      rpc_server_shutdown(p.server, on_coordinator_server_done, &p);
    uv_run(p.loop, UV_RUN_DEFAULT);
    goto out_free;
  }
  /* A probe listener of its own (plain text, grpc.health.v1 only):
   * Kubernetes' gRPC probes speak no TLS, and the main port may. */
  const char *health_listen = env_or(health_flag, "ZEROD_HEALTH_LISTEN");
  if (health_listen != NULL && health_listen[0] != '\0') {
    static const char *const services[] = {"zerod.v1.Cluster", "zerod.v1.Jobs",
                                           "zerod.v1.Rendezvous", "zerod.v1.Checkpoints"};
    int health_port = 0;
    if (start_health_listener(p.loop, health_listen, services, sizeof services / sizeof services[0],
                              &p.health_server, &p.health, &health_port) != 0) {
      abandon_start(&p);
      goto out_free;
    }
    health_set(p.health, 1);
    LOG_INFOF("health listening", "address=%s port=%d", health_listen, health_port);
  }
  /* Calls are handled on this loop, so the server's observer may be set
   * now that it serves. */
  if (start_metrics(p.loop, env_or(metrics_flag, "ZEROD_METRICS_LISTEN"), "coordinator", &p.metrics,
                    &p.metrics_http) != 0 ||
      coord_metrics_start(p.coord, p.server, p.metrics) != 0) {
    abandon_start(&p);
    goto out_free;
  }
  uv_signal_init(p.loop, &p.sigint);
  uv_signal_init(p.loop, &p.sigterm);
  p.sigint.data = p.sigterm.data = &p;
  uv_signal_start(&p.sigint, on_coordinator_signal, SIGINT);
  uv_signal_start(&p.sigterm, on_coordinator_signal, SIGTERM);
  if (!use_tls && !local)
    LOG_WARNF("serving the control plane in plain text (--insecure): tokens and job data cross "
              "the network readable by anyone on the path",
              "address=%s", listen_addr);
  if (sec.auth_file == NULL && !local)
    LOG_WARNF("no principals configured (--insecure): every caller may do everything", "address=%s",
              listen_addr);
  LOG_INFOF("coordinator listening",
            "address=%.*s:%d state_dir=%s checkpoint_dir=%s lease_ttl_ms=%d version=%s pid=%d",
            (int)(colon - listen_addr), listen_addr, port, co.state_dir, co.checkpoint_dir,
            co.lease_ttl_ms, ZEROD_VERSION, (int)getpid());
  uv_run(p.loop, UV_RUN_DEFAULT);
  status = 0;
out_free:
  if (p.server != NULL)
    rpc_server_destroy(p.server);
  if (p.health_server != NULL)
    rpc_server_destroy(p.health_server);
  health_free(p.health);
  coord_metrics_stop(p.coord);
  coord_destroy(p.coord);
  metrics_free(p.metrics);
  rc = uv_loop_close(p.loop);
  if (rc != 0)
    LOG_WARNF("loop closed with open handles", "err=%s", uv_err_name(rc));
  if (status == 0)
    LOG_INFOF("stopped", NULL);
out_lock:
  unlink(lock_path);
  close(lock_fd);
  return status;
}

/* ------------------------------------------------------------------------ */
/* zerod [standalone] and zerod node                                        */
/* ------------------------------------------------------------------------ */

static zdaemon the_daemon;
static char comm_host[256] = "127.0.0.1";
static char nvme_dir[PATH_MAX];         /* --nvme-dir, made and resolved at start */
static char control_socket[PATH_MAX];   /* zerod standalone's control-plane socket */
static const char *checkpoint_dir_flag; /* zerod standalone: --checkpoint-dir, if given */
static int checkpoint_timeout_ms;       /* zerod standalone: --checkpoint-timeout */
static raw_options raw;                 /* the flags, as given */

/* zerod standalone: the same coordinator as `zerod coordinator`, in this
 * process and on this loop, in memory only (standalone jobs are created by
 * their workers and live as long as the daemon), serving gRPC on
 * DIR/control.sock so that zerodctl works against a standalone daemon too.
 * This node joins it like any node (node/cluster.c), with a local rendezvous. */
static int start_local_coordinator(zdaemon *d, char *err, size_t err_bytes) {
  daemon_options *o = &d->options;
  if (snprintf(control_socket, sizeof control_socket, "%s/control.sock", o->dir) >=
          (int)sizeof control_socket ||
      snprintf(o->coordinator, sizeof o->coordinator, "unix:%s", control_socket) >=
          (int)sizeof o->coordinator) {
    snprintf(err, err_bytes, "state directory path too long for a socket");
    control_socket[0] = '\0';
    return -ENAMETOOLONG;
  }
  /* A socket left by a daemon that died; the state directory's lock says
   * that no live one uses it. */
  unlink(control_socket);
  /* Static: a coord_options holds the export roots' paths, too big for
   * the stack of a function that the loop's callbacks nest under. */
  static coord_options co;
  co = (coord_options){.lease_ttl_ms = 10000, .checkpoint_timeout_ms = checkpoint_timeout_ms};
  if (checkpoint_dir_option(checkpoint_dir_flag, o->dir, co.checkpoint_dir,
                            sizeof co.checkpoint_dir) != 0) {
    snprintf(err, err_bytes, "no usable checkpoint directory");
    return -EINVAL;
  }
  if (export_roots_option(raw.export_roots, raw.n_export_roots, &co) != 0) {
    snprintf(err, err_bytes, "no usable export root");
    return -EINVAL;
  }
  int rc = coord_create(d->loop, &co, &d->coord, err, err_bytes);
  if (rc != 0)
    return rc;
  rc = rpc_server_create(d->loop, o->coordinator, &d->control_server, err, err_bytes);
  if (rc == -ENAMETOOLONG) /* DIR/control.sock does not fit a Unix socket's path */
    snprintf(err + strlen(err), err_bytes - strlen(err), " (choose a shorter --dir)");
  if (rc == 0)
    rc = coord_register(d->coord, d->control_server);
  if (rc == 0)
    rc = coord_metrics_start(d->coord, d->control_server, d->metrics);
  int port = 0;
  if (rc == 0)
    rc = rpc_server_start(d->control_server, &port, err, err_bytes);
  if (rc == 0)
    chmod(control_socket, 0600);
  return rc;
}

static void on_control_server_done(void *arg) {
  (void)arg;
  LOG_DEBUGF("control plane stopped serving", NULL);
}

static void shutdown_daemon(zdaemon *d, const char *why) {
  if (d->stopping)
    return;
  d->stopping = 1;
  LOG_INFOF("shutting down", "reason=%s", why);
  char reason[128];
  snprintf(reason, sizeof reason, "zerod is shutting down (%s)", why);
  ipc_close_all(d, reason);
  ckpt_call_shutdown(d); /* workers' checkpoint calls give up */
  metrics_http_stop(d->metrics_http);
  d->metrics_http = NULL;
  /* Draining: probes see NOT_SERVING, then the probe listener goes. */
  if (d->health_server != NULL) {
    health_shutdown(d->health);
    rpc_server_shutdown_gently(d->health_server, on_control_server_done, d);
  }
  cluster_stop(d);
  if (d->coord != NULL) {
    coord_shutdown(d->coord);
    rpc_server_shutdown_gently(d->control_server, on_control_server_done, d);
  }
  jobs_stop_all(d);
  ipc_drain_completions(d);
  ckpt_node_shutdown(d); /* shard writers stop at their next chunk */
  /* The jobs are freed once the loop has ended (main): read-only sessions'
   * gathers may still be running on the threadpool, and closed sessions
   * let go of their pins when their handles have closed. */
  uv_close((uv_handle_t *)&d->completion_async, NULL);
  uv_close((uv_handle_t *)&d->sigint, NULL);
  uv_close((uv_handle_t *)&d->sigterm, NULL);
}

static void on_signal(uv_signal_t *handle, int signum) {
  shutdown_daemon(handle->data, signum == SIGINT ? "SIGINT" : "SIGTERM");
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "coordinator") == 0)
    return run_coordinator(argc - 1, argv + 1);
  static const struct option long_options[] = {
      {"ranks", required_argument, NULL, OPT_RANKS},
      {"dir", required_argument, NULL, OPT_DIR},
      {"socket", required_argument, NULL, OPT_SOCKET},
      {"socket-group", required_argument, NULL, OPT_SOCKET_GROUP},
      {"threads-per-rank", required_argument, NULL, OPT_THREADS},
      {"collective-timeout", required_argument, NULL, OPT_TIMEOUT},
      {"max-live-bytes", required_argument, NULL, OPT_MAX_LIVE},
      {"max-sessions", required_argument, NULL, OPT_MAX_SESSIONS},
      {"comm-host", required_argument, NULL, OPT_COMM_HOST},
      {"log-level", required_argument, NULL, OPT_LOG_LEVEL},
      {"health-listen", required_argument, NULL, OPT_HEALTH_LISTEN},
      {"metrics-listen", required_argument, NULL, OPT_METRICS_LISTEN},
      {"log-format", required_argument, NULL, OPT_LOG_FORMAT},
      {"version", no_argument, NULL, OPT_VERSION},
      {"coordinator", required_argument, NULL, OPT_COORDINATOR},
      {"name", required_argument, NULL, OPT_NAME},
      {"device", required_argument, NULL, OPT_DEVICE},
      {"checkpoint-dir", required_argument, NULL, OPT_CHECKPOINT_DIR},
      {"checkpoint-timeout", required_argument, NULL, OPT_CHECKPOINT_TIMEOUT},
      SECURITY_CLIENT_OPTIONS,
      {"export-root", required_argument, NULL, OPT_EXPORT_ROOT},
      {"file-mode", required_argument, NULL, OPT_FILE_MODE},
      {"nvme-dir", required_argument, NULL, OPT_NVME_DIR},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  security_flags sec = {0};
  int c;
  while ((c = getopt_long(argc, argv, "h", long_options, NULL)) != -1) {
    switch (c) {
    case OPT_RANKS:
      raw.ranks = optarg;
      break;
    case OPT_DIR:
      raw.dir = optarg;
      break;
    case OPT_SOCKET:
      raw.socket = optarg;
      break;
    case OPT_SOCKET_GROUP:
      raw.socket_group = optarg;
      break;
    case OPT_THREADS:
      raw.threads = optarg;
      break;
    case OPT_TIMEOUT:
      raw.timeout = optarg;
      break;
    case OPT_MAX_LIVE:
      raw.max_live = optarg;
      break;
    case OPT_MAX_SESSIONS:
      raw.max_sessions = optarg;
      break;
    case OPT_COMM_HOST:
      raw.comm_host = optarg;
      break;
    case OPT_HEALTH_LISTEN:
      raw.health_listen = optarg;
      break;
    case OPT_METRICS_LISTEN:
      raw.metrics_listen = optarg;
      break;
    case OPT_LOG_LEVEL:
      raw.log_level = optarg;
      break;
    case OPT_LOG_FORMAT:
      raw.log_format = optarg;
      break;
    case OPT_COORDINATOR:
      raw.coordinator = optarg;
      break;
    case OPT_NAME:
      raw.name = optarg;
      break;
    case OPT_DEVICE:
      raw.device = optarg;
      break;
    case OPT_CHECKPOINT_DIR:
      raw.checkpoint_dir = optarg;
      break;
    case OPT_CHECKPOINT_TIMEOUT:
      raw.checkpoint_timeout = optarg;
      break;
    case OPT_EXPORT_ROOT:
      if (raw.n_export_roots <= COORD_MAX_EXPORT_ROOTS)
        raw.export_roots[raw.n_export_roots++] = optarg;
      break;
    case OPT_FILE_MODE:
      raw.file_mode = optarg;
      break;
    case OPT_NVME_DIR:
      raw.nvme_dir = optarg;
      break;
    case OPT_VERSION:
      printf("zerod %s\n", ZEROD_VERSION);
      return 0;
    case 'h':
      usage(stdout);
      return 0;
    default:
      if (security_option(c, optarg, &sec))
        break;
      usage(stderr);
      return 2;
    }
  }
  const char *mode = "standalone";
  if (optind < argc) {
    mode = argv[optind];
    if ((strcmp(mode, "standalone") != 0 && strcmp(mode, "node") != 0) || optind + 1 < argc) {
      fprintf(stderr, "zerod: unknown command '%s' (standalone, node or coordinator)\n",
              argv[optind]);
      usage(stderr);
      return 2;
    }
  }

  zdaemon *d = &the_daemon;
  daemon_options *o = &d->options;
  d->listen_fd = -1;
  d->lock_fd = -1;
  /* First: the device probe below may already log. */
  int log_rc = apply_log_flags(raw.log_level, raw.log_format);
  if (log_rc != 0)
    return log_rc;
  const char *v;
  o->ranks = 1;
  if ((v = env_or(raw.ranks, "ZEROD_RANKS")) != NULL &&
      parse_int(v, 1, JOB_MAX_WORLD, &o->ranks) != 0)
    return bad_value("--ranks", v, "1..64");
  v = env_or(raw.device, "ZEROD_DEVICE");
  if (v == NULL)
    v = "cpu";
  if (strcmp(v, "cpu") != 0 && strcmp(v, "cuda") != 0 && strcmp(v, "auto") != 0)
    return bad_value("--device", v, "cpu, cuda or auto");
  snprintf(o->device, sizeof o->device, "%s", v);
  /* GPU ranks need the CUDA module, a driver and one GPU per rank (local
   * rank i binds GPU i). cuda refuses to start without them; auto falls
   * back to the CPU and says why. */
  if (strcmp(o->device, "cpu") != 0) {
    const zk_cuda_api *cuda = NULL;
    char why[512] = "";
    int cuda_rc = zk_cuda_load(&cuda, why, sizeof why);
    int count = 0;
    if (cuda_rc == 0)
      cuda_rc = cuda->device_count(&count);
    if (cuda_rc == 0 && count < o->ranks) {
      snprintf(why, sizeof why, "%d rank(s) need as many GPUs, %d found", o->ranks, count);
      cuda_rc = -ENODEV;
    }
    if (cuda_rc != 0 && strcmp(o->device, "cuda") == 0) {
      fprintf(stderr, "zerod: --device cuda: %s\n", why);
      return 1;
    }
    snprintf(o->device, sizeof o->device, "%s", cuda_rc == 0 ? "cuda" : "cpu");
    if (cuda_rc != 0)
      LOG_INFOF("no usable GPU, ranks on the CPU", "why=\"%s\"", why);
  }
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  o->threads_per_rank = cpus > o->ranks ? (int)(cpus / o->ranks) : 1;
  if ((v = env_or(raw.threads, "ZEROD_THREADS_PER_RANK")) != NULL &&
      parse_int(v, 1, ZK_POOL_MAX_THREADS, &o->threads_per_rank) != 0)
    return bad_value("--threads-per-rank", v, "1..256");
  int timeout_s = 60;
  if ((v = env_or(raw.timeout, "ZEROD_COLLECTIVE_TIMEOUT")) != NULL &&
      parse_int(v, 1, 86400, &timeout_s) != 0)
    return bad_value("--collective-timeout", v, "seconds, 1..86400");
  o->collective_timeout_ms = timeout_s * 1000;
  o->max_live_bytes = (uint64_t)2 << 30;
  if ((v = env_or(raw.max_live, "ZEROD_MAX_LIVE_BYTES")) != NULL &&
      size_parse(v, &o->max_live_bytes) != 0)
    return bad_value("--max-live-bytes", v, "a size such as 512M or 4G");
  o->max_sessions = 1024;
  if ((v = env_or(raw.max_sessions, "ZEROD_MAX_SESSIONS")) != NULL &&
      parse_int(v, 1, 1 << 20, &o->max_sessions) != 0)
    return bad_value("--max-sessions", v, "1..1048576");
  if ((v = env_or(raw.comm_host, "ZEROD_COMM_HOST")) != NULL)
    snprintf(comm_host, sizeof comm_host, "%s", v);
  snprintf(o->comm_host, sizeof o->comm_host, "%s", comm_host);
  if (strcmp(mode, "node") == 0) {
    v = env_or(raw.coordinator, "ZEROD_COORDINATOR");
    if (v == NULL || v[0] == '\0' || strchr(v, ':') == NULL || strlen(v) >= sizeof o->coordinator)
      return bad_value("--coordinator", v != NULL ? v : "", "HOST:PORT, required by zerod node");
    snprintf(o->coordinator, sizeof o->coordinator, "%s", v);
  } else if (raw.coordinator != NULL) {
    fprintf(stderr, "zerod: --coordinator needs 'zerod node' (standalone runs its own)\n");
    return 2;
  }
  int tls_flags = sec.tls_ca != NULL || sec.tls_cert != NULL || sec.tls_key != NULL ||
                  sec.tls_server_name != NULL;
  if (strcmp(mode, "node") != 0 && (tls_flags || sec.token_file != NULL)) {
    fprintf(stderr,
            "zerod: --tls-* and --auth-token-file are how 'zerod node' reaches its coordinator "
            "(standalone's is in the same process)\n");
    return 2;
  }
  if (strcmp(mode, "node") == 0) {
    /* Flags, else the environment (rpc_client_credentials). The paths
     * point into argv or the environment, which live as long as we do. */
    o->tls = (rpc_tls){.ca_file = sec.tls_ca,
                       .cert_file = sec.tls_cert,
                       .key_file = sec.tls_key,
                       .server_name = sec.tls_server_name};
    char err[PATH_MAX + 128];
    if (rpc_client_credentials(&o->tls, sec.token_file, &o->use_tls, o->token, sizeof o->token, err,
                               sizeof err) != 0) {
      fprintf(stderr, "zerod: %s\n", err);
      return 2;
    }
    if (!o->use_tls && !sec.insecure && !rpc_insecure_from_env() &&
        !rpc_address_is_local(o->coordinator)) {
      fprintf(stderr,
              "zerod: the coordinator %s is on another host: reach it over TLS (--tls-ca, and "
              "--tls-cert/--tls-key for mutual TLS) or pass --insecure\n",
              o->coordinator);
      return 2;
    }
  }
  if (strcmp(mode, "node") == 0 &&
      (raw.checkpoint_dir != NULL || raw.checkpoint_timeout != NULL || raw.n_export_roots > 0)) {
    /* A node saves where its coordinator's orders say. */
    fprintf(stderr, "zerod: --checkpoint-dir, --checkpoint-timeout and --export-root are the "
                    "coordinator's (zerod coordinator or standalone), not a node's\n");
    return 2;
  }
  /* A node writes shard files and layouts with it too. */
  if (file_mode_option(raw.file_mode) != 0)
    return 2;
  if (strcmp(mode, "node") != 0) {
    checkpoint_dir_flag = raw.checkpoint_dir;
    if (parse_checkpoint_timeout(raw.checkpoint_timeout, &checkpoint_timeout_ms) != 0)
      return 2;
  }
  {
    v = env_or(raw.name, "ZEROD_NODE_NAME");
    char host[256] = "";
    if (v == NULL && gethostname(host, sizeof host - 1) == 0)
      v = host;
    if (v == NULL || strlen(v) < 1 || strlen(v) > 64 ||
        strspn(v, "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                  "abcdefghijklmnopqrstuvwxyz"
                  "0123456789._-") != strlen(v))
      return bad_value("--name", v != NULL ? v : "", "1..64 of [A-Za-z0-9._-]");
    memcpy(o->node_name, v, strlen(v) + 1); /* checked: at most 64 bytes */
  }
  v = env_or(raw.dir, "ZEROD_DIR");
  snprintf(o->dir, sizeof o->dir, "%s", v != NULL ? v : ".zerod");
  v = env_or(raw.socket, "ZEROD_SOCKET");
  if (v != NULL)
    snprintf(o->socket_path, sizeof o->socket_path, "%s", v);
  else {
    size_t dir_len = strlen(o->dir);
    if (dir_len + sizeof "/zerod.sock" > sizeof o->socket_path)
      return bad_value("--dir", o->dir, "path too long");
    memcpy(o->socket_path, o->dir, dir_len);
    memcpy(o->socket_path + dir_len, "/zerod.sock", sizeof "/zerod.sock");
  }
  if ((v = env_or(raw.socket_group, "ZEROD_SOCKET_GROUP")) != NULL)
    snprintf(o->socket_group, sizeof o->socket_group, "%s", v);

  /* The state directory and its lock: one daemon per directory. */
  int rc = mkdir_p(o->dir);
  if (rc != 0) {
    fprintf(stderr, "zerod: cannot create state directory %s: %s\n", o->dir, strerror(-rc));
    return 1;
  }
  char lock_path[PATH_MAX + 16];
  snprintf(lock_path, sizeof lock_path, "%s/zerod.lock", o->dir);
  if (lock_state_dir(lock_path, o->dir, &d->lock_fd) != 0)
    return 1;

  /* Gloo writes to sockets without MSG_NOSIGNAL: a peer that dies must be
   * an error, not a signal. */
  signal(SIGPIPE, SIG_IGN);
  /* Every worker session holds a socket and a descriptor per buffer it
   * was sent; take the whole file-descriptor allowance. */
  struct rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
  d->loop = uv_default_loop();
  if (start_metrics(d->loop, env_or(raw.metrics_listen, "ZEROD_METRICS_LISTEN"), mode, &d->metrics,
                    &d->metrics_http) != 0)
    return 1;
  char err[512] = "";
  if (o->coordinator[0] == '\0') {
    rc = start_local_coordinator(d, err, sizeof err);
    if (rc != 0) {
      fprintf(stderr, "zerod: in-process coordinator: %s\n", err);
      return 1;
    }
  }
  store *local_store = NULL;
  if (d->coord != NULL && (rc = store_mem_create(&local_store)) != 0) {
    fprintf(stderr, "zerod: rendezvous store: %s\n", strerror(-rc));
    return 1;
  }
  rc = cluster_create(d, local_store, &d->rendezvous, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "zerod: rendezvous store: %s\n", err[0] ? err : strerror(-rc));
    return 1;
  }
  const char *nvme_flag = env_or(raw.nvme_dir, "ZEROD_NVME_DIR");
  char nvme_want[PATH_MAX];
  if ((nvme_flag != NULL && nvme_flag[0] == '\0') ||
      snprintf(nvme_want, sizeof nvme_want, nvme_flag != NULL ? "%s" : "%s/nvme",
               nvme_flag != NULL ? nvme_flag : o->dir) >= (int)sizeof nvme_want - 256)
    return bad_value("--nvme-dir", nvme_flag != NULL ? nvme_flag : o->dir, "a directory");
  if ((rc = mkdir_p(nvme_want)) != 0 || realpath(nvme_want, nvme_dir) == NULL) {
    fprintf(stderr, "zerod: cannot create the nvme directory %s: %s\n", nvme_want,
            strerror(rc != 0 ? -rc : errno));
    return 1;
  }
  tier_sweep(nvme_dir);
  d->exec = (exec_settings){.complete = ipc_complete,
                            .stopped = ipc_stopped,
                            .ctx = d,
                            .ckpt = ckpt_node_hooks,
                            .threads_per_rank = o->threads_per_rank,
                            .collective_timeout_ms = o->collective_timeout_ms,
                            .comm_hostname = comm_host,
                            .rendezvous = d->rendezvous,
                            .nvme_dir = nvme_dir,
                            .device = o->device};
  if (jobs_metrics_start(d) != 0) {
    fprintf(stderr, "zerod: metrics: out of memory\n");
    return 1;
  }

  rc = ckpt_node_init(d, cluster_report);
  if (rc == 0)
    rc = ckpt_call_init(d);
  if (rc == 0)
    rc = ipc_listen(d, err, sizeof err);
  else
    snprintf(err, sizeof err, "cannot start: %s", uv_strerror(rc));
  if (rc != 0) {
    fprintf(stderr, "zerod: %s\n", err);
    return 1;
  }
  int health_port = 0;
  const char *health_listen = env_or(raw.health_listen, "ZEROD_HEALTH_LISTEN");
  if (health_listen != NULL && health_listen[0] != '\0') {
    /* The probe listener serves grpc.health.v1 only, and no secret: plain
     * text on any address is fine (Kubernetes' gRPC probes use no TLS). */
    static const char *const services[] = {"zerod.v1.Node"};
    if (start_health_listener(d->loop, health_listen, services, 1, &d->health_server, &d->health,
                              &health_port) != 0)
      return 1;
  }
  uv_signal_init(d->loop, &d->sigint);
  uv_signal_init(d->loop, &d->sigterm);
  d->sigint.data = d->sigterm.data = d;
  uv_signal_start(&d->sigint, on_signal, SIGINT);
  uv_signal_start(&d->sigterm, on_signal, SIGTERM);

  if (d->health_server != NULL)
    LOG_INFOF("health listening", "address=%s port=%d", health_listen, health_port);
  LOG_INFOF("zerod ready",
            "version=%s mode=%s socket=%s control=%s device=%s ranks=%d threads_per_rank=%d "
            "collective_timeout_s=%d max_live_bytes=%llu pid=%d",
            ZEROD_VERSION, mode, o->socket_path, o->coordinator, o->device, o->ranks,
            o->threads_per_rank, timeout_s, (unsigned long long)o->max_live_bytes, (int)getpid());
  cluster_start(d);
  uv_run(d->loop, UV_RUN_DEFAULT);
  /* The loop ends when every handle has closed and every threadpool read
   * has finished: nothing refers to the jobs any more. */
  jobs_metrics_stop(d);
  jobs_free_all(d);
  rc = uv_loop_close(d->loop);
  if (rc != 0)
    LOG_WARNF("loop closed with open handles", "err=%s", uv_err_name(rc));
  cluster_destroy(d); /* and its store */
  if (d->health_server != NULL)
    rpc_server_destroy(d->health_server);
  health_free(d->health);
  if (d->control_server != NULL)
    rpc_server_destroy(d->control_server);
  if (d->coord != NULL) {
    coord_metrics_stop(d->coord);
    coord_destroy(d->coord);
  }
  metrics_free(d->metrics);
  if (control_socket[0] != '\0')
    unlink(control_socket);
  pthread_mutex_destroy(&d->completion_mutex);
  unlink(lock_path);
  close(d->lock_fd);
  LOG_INFOF("stopped", NULL);
  return 0;
}
