/* mode_node: `zerod [standalone]` and `zerod node`, a node daemon
 * (mode.h).
 *
 *   zerod [standalone]   one node daemon with N CPU ranks and its rendezvous
 *                        in this process, socket and state in a local dir,
 *                        with the coordinator in-process on DIR/control.sock
 *   zerod node           a node daemon that joins a coordinator
 *
 * Settles the command line (flags_node), takes the state directory,
 * starts the node's loop (node/: IPC sessions, jobs, the cluster agent,
 * checkpoint orders) and runs it until SIGINT or SIGTERM: workers are
 * told, executors stopped, shared memory freed, the socket removed. */
#include "mode.h"

#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_call.h"
#include "base_cache.h"
#include "bases.h"
#include "ckpt_node.h"
#include "cluster.h"
#include "coord.h"
#include "cuda/zk_cuda.h"
#include "daemon.h"
#include "flags.h"
#include "health.h"
#include "follow.h"
#include "jobs.h"
#include "log.h"
#include "paths.h"
#include "metrics_http.h"
#include "fsutil.h"
#include "replica.h"
#include "start.h"
#include "tier.h"

/* The process: one node daemon. Static: the executors and the loop's
 * callbacks refer to it until the end, and the daemon is large. */
typedef struct node_process {
  zdaemon daemon;
  flag_given given;              /* the flags, as given */
  const char *mode;              /* "standalone" or "node" */
  char comm_host[256];           /* --comm-host, which the executors point to */
  char nvme_dir[PATH_MAX];       /* --nvme-dir, made and resolved at start */
  char control_socket[PATH_MAX]; /* zerod standalone's control-plane socket */
  int checkpoint_timeout_ms;     /* zerod standalone: --checkpoint-timeout */
  int64_t job_idle_ttl_ms;       /* zerod standalone: --job-idle-ttl */
  int collective_timeout_s;      /* --collective-timeout, for the ready line */
  char lock_path[PATH_MAX + 16]; /* DIR/zerod.lock */
} node_process;

static node_process the_process;

/* zerod standalone: the same coordinator as `zerod coordinator`, in this
 * process and on this loop, in memory only (standalone jobs are created by
 * their workers and live as long as the daemon), serving gRPC on
 * DIR/control.sock so that zerodctl works against a standalone daemon too.
 * This node joins it like any node (node/cluster.c), with a local rendezvous. */
static int start_local_coordinator(node_process *p, char *err, size_t err_bytes) {
  zdaemon *d = &p->daemon;
  daemon_options *o = &d->options;
  char *control_socket = p->control_socket;
  if (snprintf(control_socket, sizeof p->control_socket, "%s/control.sock", o->dir) >=
          (int)sizeof p->control_socket ||
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
  co = (coord_options){.lease_ttl_ms = 10000,
                       .stall_timeout_ms = 30000,
                       .job_idle_ttl_ms = p->job_idle_ttl_ms,
                       .checkpoint_timeout_ms = p->checkpoint_timeout_ms,
                       .durable_bases_only = 0};
  snprintf(co.state_dir, sizeof co.state_dir, "%s", o->dir);
  if (start_checkpoint_dir(flag_text(&flags_node, &p->given, FLAG_CHECKPOINT_DIR), o->dir,
                           co.checkpoint_dir, sizeof co.checkpoint_dir) != 0) {
    snprintf(err, err_bytes, "no usable checkpoint directory");
    return -EINVAL;
  }
  if (start_export_roots(&flags_node, &p->given, &co) != 0) {
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
  if (d->draining)
    uv_close((uv_handle_t *)&d->drain_timer, NULL);
  char reason[128];
  snprintf(reason, sizeof reason, "zerod is shutting down (%s)", why);
  ipc_close_all(d, reason);
  follow_stop(d);        /* attaches waiting for a mirror answered */
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
  reader_env_close(&d->readers);
  if (d->signals_open) {
    uv_close((uv_handle_t *)&d->sigint, NULL);
    uv_close((uv_handle_t *)&d->sigterm, NULL);
  }
}

/* The drain (docs/daemon.md, "Upgrades keep state"): while everything
 * keeps serving, the coordinator saves this node's jobs that hold state
 * (cluster_drain, coord_drain.c); the daemon stops once none is in
 * flight, or at --drain-timeout. */
static void on_drain_tick(uv_timer_t *timer) {
  zdaemon *d = timer->data;
  int drained = cluster_drained(d);
  if (!drained && uv_now(d->loop) < d->drain_deadline_ms)
    return;
  if (drained)
    LOG_INFOF("drained: every job with state saved", NULL);
  else
    LOG_WARNF("drain timed out: stopping without some jobs' saves", "timeout_ms=%lld",
              (long long)d->drain_timeout_ms);
  shutdown_daemon(d, d->drain_signal);
}

/* Starts the drain; 0 when there is nothing to drain (stop now). */
static int start_drain(zdaemon *d, const char *signal_name) {
  if (d->drain_timeout_ms <= 0 || d->draining || !cluster_drain(d))
    return 0;
  if (uv_timer_init(d->loop, &d->drain_timer) != 0)
    return 0;
  d->draining = 1;
  d->drain_signal = signal_name;
  d->drain_timer.data = d;
  d->drain_deadline_ms = uv_now(d->loop) + (uint64_t)d->drain_timeout_ms;
  uv_timer_start(&d->drain_timer, on_drain_tick, 50, 50);
  LOG_INFOF("draining: the coordinator saves this node's jobs before it stops",
            "signal=%s timeout_ms=%lld", signal_name, (long long)d->drain_timeout_ms);
  return 1;
}

static void on_signal(uv_signal_t *handle, int signum) {
  zdaemon *d = handle->data;
  const char *name = signum == SIGINT ? "SIGINT" : "SIGTERM";
  if (d->draining) /* a second signal: stop now */
    LOG_WARNF("stopping without waiting for the drain", "signal=%s", name);
  else if (start_drain(d, name))
    return;
  shutdown_daemon(d, name);
}

/* ------------------------------------------------------------------------ */
/* The command line                                                         */
/* ------------------------------------------------------------------------ */

/* GPU ranks need the CUDA module, a driver and one GPU per rank (local
 * rank i binds GPU i). cuda refuses to start without them; auto falls
 * back to the CPU and says why. 0, or 1 with the reason on stderr. */
static int probe_gpus(daemon_options *o, int *gpus) {
  *gpus = 0;
  if (strcmp(o->device, "cpu") == 0)
    return 0;
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
  *gpus = cuda_rc == 0 ? count : 0;
  if (cuda_rc != 0)
    LOG_INFOF("no usable GPU, ranks on the CPU", "why=\"%s\"", why);
  return 0;
}

/* The most ranks one job may have (ranks are made per job): standalone's
 * --max-ranks, else its GPUs (one rank each) or CPUs, never under
 * --ranks; a node's --ranks (the coordinator places jobs). 0, or 2 with
 * the error printed. */
static int settle_max_ranks(node_process *p, int gpus) {
  daemon_options *o = &p->daemon.options;
  const char *v;
  int64_t value;
  int rc = flag_value(&flags_node, &p->given, FLAG_MAX_RANKS, &v, &value);
  if (rc != 0)
    return rc;
  if (strcmp(p->mode, "node") == 0) {
    if (v != NULL) {
      fprintf(stderr, "zerod: --max-ranks is standalone's; a node's --ranks is the most ranks "
                      "a job may place on it\n");
      return 2;
    }
    o->max_ranks = o->ranks;
    return 0;
  }
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  long fallback = strcmp(o->device, "cuda") == 0 ? gpus : cpus;
  o->max_ranks = v != NULL                  ? (int)value
                 : fallback > JOB_MAX_WORLD ? JOB_MAX_WORLD
                 : fallback < o->ranks      ? o->ranks
                                            : (int)fallback;
  if (o->max_ranks < o->ranks) {
    fprintf(stderr, "zerod: --max-ranks %d is below --ranks %d\n", o->max_ranks, o->ranks);
    return 2;
  }
  if (strcmp(o->device, "cuda") == 0 && o->max_ranks > gpus) {
    fprintf(stderr, "zerod: --max-ranks %d needs as many GPUs, %d found\n", o->max_ranks, gpus);
    return 2;
  }
  return 0;
}

/* The log (first: the device probe may already log), the ranks and where
 * they run. 0, or the exit status with the error printed. */
static int settle_ranks(node_process *p) {
  const flag_table *t = &flags_node;
  daemon_options *o = &p->daemon.options;
  int log_rc = start_log(t, &p->given);
  if (log_rc != 0)
    return log_rc;
  const char *v;
  int64_t value;
  int rc = flag_value(t, &p->given, FLAG_RANKS, &v, &value);
  if (rc != 0)
    return rc;
  o->ranks = (int)value;
  if ((rc = flag_value(t, &p->given, FLAG_DEVICE, &v, &value)) != 0)
    return rc;
  snprintf(o->device, sizeof o->device, "%s", v);
  int gpus;
  if ((rc = probe_gpus(o, &gpus)) != 0)
    return rc;
  return settle_max_ranks(p, gpus);
}

/* Threads per rank, the collectives' timeout, the live-bytes budget, the
 * sessions. 0, or 2 with the error printed. */
static int settle_limits(node_process *p) {
  const flag_table *t = &flags_node;
  daemon_options *o = &p->daemon.options;
  const char *v;
  int64_t value;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  o->threads_per_rank = cpus > o->ranks ? (int)(cpus / o->ranks) : 1;
  int rc = flag_value(t, &p->given, FLAG_THREADS_PER_RANK, &v, &value);
  if (rc != 0)
    return rc;
  if (v != NULL)
    o->threads_per_rank = (int)value;
  if ((rc = flag_value(t, &p->given, FLAG_COLLECTIVE_TIMEOUT, &v, &value)) != 0)
    return rc;
  p->collective_timeout_s = (int)value;
  o->collective_timeout_ms = p->collective_timeout_s * 1000;
  if ((rc = flag_value(t, &p->given, FLAG_MAX_LIVE_BYTES, &v, &value)) != 0)
    return rc;
  o->max_live_bytes = (uint64_t)value;
  if ((rc = flag_value(t, &p->given, FLAG_BASE_CACHE_BYTES, &v, &value)) != 0)
    return rc;
  o->base_cache_bytes = (uint64_t)value;
  if ((rc = flag_value(t, &p->given, FLAG_MAX_SESSIONS, &v, &value)) != 0)
    return rc;
  o->max_sessions = (int)value;
  if ((rc = flag_value(t, &p->given, FLAG_MAX_PINNED_VERSIONS, &v, &value)) != 0)
    return rc;
  o->max_pinned_versions = (int)value;
  return 0;
}

/* zerod node: how it reaches its coordinator: flags, else the environment
 * (rpc_client_credentials). The paths point into argv or the environment,
 * which live as long as we do. 0, or 2 with the error printed. */
static int settle_credentials(node_process *p) {
  const flag_given *given = &p->given;
  daemon_options *o = &p->daemon.options;
  o->tls = (rpc_tls){.ca_file = given->value[FLAG_TLS_CA],
                     .cert_file = given->value[FLAG_TLS_CERT],
                     .key_file = given->value[FLAG_TLS_KEY],
                     .server_name = given->value[FLAG_TLS_SERVER_NAME]};
  char err[PATH_MAX + 128];
  if (rpc_client_credentials(&o->tls, given->value[FLAG_AUTH_TOKEN_FILE], &o->use_tls, o->token,
                             sizeof o->token, err, sizeof err) != 0) {
    fprintf(stderr, "zerod: %s\n", err);
    return 2;
  }
  if (!o->use_tls && given->value[FLAG_INSECURE] == NULL && !rpc_insecure_from_env() &&
      !rpc_address_is_local(o->coordinator)) {
    fprintf(stderr,
            "zerod: the coordinator %s is on another host: reach it over TLS (--tls-ca, and "
            "--tls-cert/--tls-key for mutual TLS) or pass --insecure\n",
            o->coordinator);
    return 2;
  }
  return 0;
}

/* The cluster: the ranks' address, the coordinator (zerod node's; a
 * standalone daemon runs its own, and refuses the flags that reach
 * another). 0, or 2 with the error printed. */
static int settle_cluster(node_process *p) {
  const flag_table *t = &flags_node;
  const flag_given *given = &p->given;
  daemon_options *o = &p->daemon.options;
  int node = strcmp(p->mode, "node") == 0;
  snprintf(p->comm_host, sizeof p->comm_host, "%s", flag_text(t, given, FLAG_COMM_HOST));
  snprintf(o->comm_host, sizeof o->comm_host, "%s", p->comm_host);
  if (node) {
    const char *v = flag_text(t, given, FLAG_COORDINATOR);
    int64_t value;
    int rc = flag_check(t, FLAG_COORDINATOR, v != NULL ? v : "", &value);
    if (rc != 0)
      return rc;
    snprintf(o->coordinator, sizeof o->coordinator, "%s", v);
  } else if (given->value[FLAG_COORDINATOR] != NULL) {
    fprintf(stderr, "zerod: --coordinator needs 'zerod node' (standalone runs its own)\n");
    return 2;
  }
  int tls_flags = given->value[FLAG_TLS_CA] != NULL || given->value[FLAG_TLS_CERT] != NULL ||
                  given->value[FLAG_TLS_KEY] != NULL || given->value[FLAG_TLS_SERVER_NAME] != NULL;
  if (!node && (tls_flags || given->value[FLAG_AUTH_TOKEN_FILE] != NULL)) {
    fprintf(stderr,
            "zerod: --tls-* and --auth-token-file are how 'zerod node' reaches its coordinator "
            "(standalone's is in the same process)\n");
    return 2;
  }
  if (node) {
    int rc = settle_credentials(p);
    if (rc != 0)
      return rc;
  }
  if (node &&
      (given->value[FLAG_CHECKPOINT_DIR] != NULL || given->value[FLAG_CHECKPOINT_TIMEOUT] != NULL ||
       given->n_export_roots > 0 || given->value[FLAG_JOB_IDLE_TTL] != NULL)) {
    /* A node saves where its coordinator's orders say. */
    fprintf(stderr, "zerod: --checkpoint-dir, --checkpoint-timeout, --export-root and "
                    "--job-idle-ttl are the coordinator's (zerod coordinator or standalone), not "
                    "a node's\n");
    return 2;
  }
  return 0;
}

/* The files' mode, the checkpoints' timeout (standalone), the node's
 * name, the state directory, the socket. 0, or 2 with the error printed. */
static int settle_files(node_process *p) {
  const flag_table *t = &flags_node;
  daemon_options *o = &p->daemon.options;
  const char *v;
  int64_t value;
  /* A node writes shard files and layouts with it too. */
  if (start_file_mode(t, &p->given) != 0)
    return 2;
  int rc;
  if (strcmp(p->mode, "node") != 0) {
    if ((rc = flag_value(t, &p->given, FLAG_CHECKPOINT_TIMEOUT, &v, &value)) != 0)
      return rc;
    p->checkpoint_timeout_ms = (int)value * 1000;
    if ((rc = flag_value(t, &p->given, FLAG_JOB_IDLE_TTL, &v, &value)) != 0)
      return rc;
    p->job_idle_ttl_ms = value;
  }
  if ((rc = flag_value(t, &p->given, FLAG_DRAIN_TIMEOUT, &v, &value)) != 0)
    return rc;
  p->daemon.drain_timeout_ms = value;
  v = flag_text(t, &p->given, FLAG_NAME);
  char host[256] = "";
  if (v == NULL && gethostname(host, sizeof host - 1) == 0)
    v = host;
  if ((rc = flag_check(t, FLAG_NAME, v != NULL ? v : "", &value)) != 0)
    return rc;
  memcpy(o->node_name, v, strlen(v) + 1); /* checked: at most 64 bytes */
  if ((v = flag_text(t, &p->given, FLAG_DIR)) != NULL)
    snprintf(o->dir, sizeof o->dir, "%s", v);
  else if (zpath_default_dir(o->dir, sizeof o->dir) != 0)
    return flag_invalid("--dir", "(default)", "the user's state directory's path is too long");
  v = flag_text(t, &p->given, FLAG_SOCKET);
  if (v != NULL)
    snprintf(o->socket_path, sizeof o->socket_path, "%s", v);
  else {
    size_t dir_len = strlen(o->dir);
    if (dir_len + sizeof "/zerod.sock" > sizeof o->socket_path)
      return flag_invalid("--dir", o->dir, "path too long");
    memcpy(o->socket_path, o->dir, dir_len);
    memcpy(o->socket_path + dir_len, "/zerod.sock", sizeof "/zerod.sock");
  }
  if ((v = flag_text(t, &p->given, FLAG_SOCKET_GROUP)) != NULL)
    snprintf(o->socket_group, sizeof o->socket_group, "%s", v);
  return 0;
}

/* Reads the command line: the flags, then the mode (the word after them,
 * standalone when there is none), then each setting in the order of the
 * usage text's groups. -1 when the daemon goes on, else the exit status. */
static int read_command_line(node_process *p, int argc, char **argv) {
  const flag_table *t = &flags_node;
  int answered = flags_read_argv(t, argc, argv, &p->given);
  if (answered >= 0)
    return answered;
  p->mode = "standalone";
  if (optind < argc) {
    p->mode = argv[optind];
    if ((strcmp(p->mode, "standalone") != 0 && strcmp(p->mode, "node") != 0) || optind + 1 < argc) {
      fprintf(stderr, "zerod: unknown command '%s' (standalone, node or coordinator)\n",
              argv[optind]);
      flags_usage(t, stderr);
      return 2;
    }
  }
  int rc = settle_ranks(p);
  if (rc == 0)
    rc = settle_limits(p);
  if (rc == 0)
    rc = settle_cluster(p);
  if (rc == 0)
    rc = settle_files(p);
  return rc != 0 ? rc : -1;
}

/* ------------------------------------------------------------------------ */
/* The daemon                                                               */
/* ------------------------------------------------------------------------ */

/* The state directory and its lock: one daemon per directory. 0, or 1
 * with the error printed. */
static int take_state_dir(node_process *p) {
  zdaemon *d = &p->daemon;
  int rc = fsutil_mkdir_p(d->options.dir);
  if (rc != 0) {
    fprintf(stderr, "zerod: cannot create state directory %s: %s\n", d->options.dir, strerror(-rc));
    return 1;
  }
  snprintf(p->lock_path, sizeof p->lock_path, "%s/zerod.lock", d->options.dir);
  if (start_lock_state_dir(p->lock_path, d->options.dir, &d->lock_fd) != 0)
    return 1;
  return 0;
}

/* The rendezvous: the cluster agent, with an in-process coordinator and
 * store in standalone mode. 0, or 1 with the error printed. */
static int start_cluster(node_process *p) {
  zdaemon *d = &p->daemon;
  char err[512] = "";
  int rc;
  if (d->options.coordinator[0] == '\0') {
    rc = start_local_coordinator(p, err, sizeof err);
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
  return 0;
}

/* --nvme-dir (else DIR/nvme): made and resolved, and cleared of what a
 * daemon that died left there. 0, or the exit status with the error
 * printed. */
static int take_nvme_dir(node_process *p) {
  const char *dir = p->daemon.options.dir;
  const char *nvme_flag = flag_text(&flags_node, &p->given, FLAG_NVME_DIR);
  char nvme_want[PATH_MAX];
  if ((nvme_flag != NULL && nvme_flag[0] == '\0') ||
      snprintf(nvme_want, sizeof nvme_want, nvme_flag != NULL ? "%s" : "%s/nvme",
               nvme_flag != NULL ? nvme_flag : dir) >= (int)sizeof nvme_want - 256)
    return flag_invalid("--nvme-dir", nvme_flag != NULL ? nvme_flag : dir, "a directory");
  int rc;
  if ((rc = fsutil_mkdir_p(nvme_want)) != 0 || realpath(nvme_want, p->nvme_dir) == NULL) {
    fprintf(stderr, "zerod: cannot create the nvme directory %s: %s\n", nvme_want,
            strerror(rc != 0 ? -rc : errno));
    return 1;
  }
  tier_sweep(p->nvme_dir);
  return 0;
}

/* zerod node: the replica directory (--replica-dir, else
 * /dev/shm/zerod-replicas-NAME) and its server, on the address the ranks
 * listen on. 0, or the exit status with the error printed. */
static int start_replicas(node_process *p) {
  zdaemon *d = &p->daemon;
  if (d->coord != NULL)
    return 0; /* standalone: one node, no peer to copy to */
  const char *given = flag_text(&flags_node, &p->given, FLAG_REPLICA_DIR);
  char root[PATH_MAX];
  if ((given != NULL && given[0] == '\0') ||
      snprintf(root, sizeof root, given != NULL ? "%s" : "/dev/shm/zerod-replicas-%s",
               given != NULL ? given : d->options.node_name) >= (int)sizeof root - 256)
    return flag_invalid("--replica-dir", given != NULL ? given : "", "a directory");
  char err[PATH_MAX + 128];
  if (replica_start(d, root, p->comm_host, err, sizeof err) != 0) {
    fprintf(stderr, "zerod: replica server: %s\n", err);
    return 1;
  }
  if (follow_init(d) != 0) {
    fprintf(stderr, "zerod: out of memory\n");
    return 1;
  }
  return 0;
}

/* What the executors are given, the node's metrics, its checkpoint
 * halves and the workers' socket. 0, or 1 with the error printed. */
static int start_node(node_process *p) {
  zdaemon *d = &p->daemon;
  const daemon_options *o = &d->options;
  d->exec = (exec_settings){.complete = ipc_complete,
                            .stopped = ipc_stopped,
                            .ctx = d,
                            .ckpt = ckpt_node_hooks,
                            .threads_per_rank = o->threads_per_rank,
                            .collective_timeout_ms = o->collective_timeout_ms,
                            .comm_hostname = p->comm_host,
                            .rendezvous = d->rendezvous,
                            .nvme_dir = p->nvme_dir,
                            .device = o->device,
                            .base_cache = base_cache_create(o->base_cache_bytes)};
  if (d->exec.base_cache == NULL || jobs_metrics_start(d) != 0 || bases_metrics_start(d) != 0) {
    fprintf(stderr, "zerod: metrics: out of memory\n");
    return 1;
  }

  char err[512] = "";
  int rc = ckpt_node_init(d, cluster_report);
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
  return 0;
}

/* Runs the loop until SIGINT or SIGTERM has shut everything down. 0, or
 * 1 when the signals could not be caught: a daemon that cannot be
 * stopped gently stops at once instead of serving. */
static int run_loop(node_process *p, const char *health_listen, int health_port) {
  zdaemon *d = &p->daemon;
  const daemon_options *o = &d->options;
  int rc = start_stop_signals(d->loop, &d->sigint, &d->sigterm, on_signal, d);
  if (rc != 0) {
    LOG_ERRORF("cannot catch SIGINT and SIGTERM", "err=%s", uv_strerror(rc));
    shutdown_daemon(d, "no signal handlers");
    uv_run(d->loop, UV_RUN_DEFAULT);
    return 1;
  }
  d->signals_open = 1;

  if (d->health_server != NULL)
    LOG_INFOF("health listening", "address=%s port=%d", health_listen, health_port);
  LOG_INFOF("zerod ready",
            "version=%s mode=%s socket=%s control=%s device=%s ranks=%d max_ranks=%d "
            "threads_per_rank=%d collective_timeout_s=%d max_live_bytes=%llu pid=%d",
            ZEROD_VERSION, p->mode, o->socket_path, o->coordinator, o->device, o->ranks,
            o->max_ranks, o->threads_per_rank, p->collective_timeout_s,
            (unsigned long long)o->max_live_bytes, (int)getpid());
  cluster_start(d);
  uv_run(d->loop, UV_RUN_DEFAULT);
  return 0;
}

/* Frees what the daemon made, once its loop has ended: every handle has
 * closed and every threadpool read has finished, so nothing refers to the
 * jobs any more. */
static void free_daemon(node_process *p) {
  zdaemon *d = &p->daemon;
  bases_metrics_stop(d);
  jobs_metrics_stop(d);
  jobs_free_all(d);
  follow_free(d);
  base_cache_destroy(d->exec.base_cache); /* every job let go of its entries */
  d->exec.base_cache = NULL;
  int rc = uv_loop_close(d->loop);
  if (rc != 0)
    LOG_WARNF("loop closed with open handles", "err=%s", uv_err_name(rc));
  cluster_destroy(d); /* and its store */
  replica_stop(d);
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
  if (p->control_socket[0] != '\0')
    unlink(p->control_socket);
  pthread_mutex_destroy(&d->completion_mutex);
  unlink(p->lock_path);
  close(d->lock_fd);
  LOG_INFOF("stopped", NULL);
}

int mode_node_main(int argc, char **argv) {
  node_process *p = &the_process;
  zdaemon *d = &p->daemon;
  d->listen_fd = -1;
  d->lock_fd = -1;
  int rc = read_command_line(p, argc, argv);
  if (rc >= 0)
    return rc;
  if ((rc = take_state_dir(p)) != 0)
    return rc;

  /* Gloo writes to sockets without MSG_NOSIGNAL: a peer that dies must be
   * an error, not a signal. */
  signal(SIGPIPE, SIG_IGN);
  /* Every worker session holds a socket and a descriptor per buffer it
   * was sent; take the whole file-descriptor allowance. */
  start_raise_fd_limit();
  d->loop = uv_default_loop();
  if (start_metrics(d->loop, flag_text(&flags_node, &p->given, FLAG_METRICS_LISTEN), p->mode,
                    &d->metrics, &d->metrics_http) != 0)
    return 1;
  if ((rc = start_cluster(p)) != 0 || (rc = take_nvme_dir(p)) != 0 ||
      (rc = start_replicas(p)) != 0 || (rc = start_node(p)) != 0)
    return rc;
  int health_port = 0;
  const char *health_listen = flag_text(&flags_node, &p->given, FLAG_HEALTH_LISTEN);
  if (health_listen != NULL && health_listen[0] != '\0') {
    /* The probe listener serves grpc.health.v1 only, and no secret: plain
     * text on any address is fine (Kubernetes' gRPC probes use no TLS). */
    static const char *const services[] = {"zerod.v1.Node"};
    if (start_health_listener(d->loop, health_listen, services, 1, &d->health_server, &d->health,
                              &health_port) != 0)
      return 1;
  }
  rc = run_loop(p, health_listen, health_port);
  free_daemon(p);
  return rc;
}
