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
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_call.h"
#include "ckpt_node.h"
#include "cluster.h"
#include "coord.h"
#include "cuda/zk_cuda.h"
#include "daemon.h"
#include "flags.h"
#include "health.h"
#include "jobs.h"
#include "log.h"
#include "metrics_http.h"
#include "start.h"
#include "tier.h"

static zdaemon the_daemon;
static char comm_host[256] = "127.0.0.1";
static char nvme_dir[PATH_MAX];       /* --nvme-dir, made and resolved at start */
static char control_socket[PATH_MAX]; /* zerod standalone's control-plane socket */
static int checkpoint_timeout_ms;     /* zerod standalone: --checkpoint-timeout */
static flag_given given;              /* the flags, as given */

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
  if (start_checkpoint_dir(flag_text(&flags_node, &given, FLAG_CHECKPOINT_DIR), o->dir,
                           co.checkpoint_dir, sizeof co.checkpoint_dir) != 0) {
    snprintf(err, err_bytes, "no usable checkpoint directory");
    return -EINVAL;
  }
  if (start_export_roots(&flags_node, &given, &co) != 0) {
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

int mode_node_main(int argc, char **argv) {
  const flag_table *t = &flags_node;
  int answered = flags_read_argv(t, argc, argv, &given);
  if (answered >= 0)
    return answered;
  const char *mode = "standalone";
  if (optind < argc) {
    mode = argv[optind];
    if ((strcmp(mode, "standalone") != 0 && strcmp(mode, "node") != 0) || optind + 1 < argc) {
      fprintf(stderr, "zerod: unknown command '%s' (standalone, node or coordinator)\n",
              argv[optind]);
      flags_usage(t, stderr);
      return 2;
    }
  }

  zdaemon *d = &the_daemon;
  daemon_options *o = &d->options;
  d->listen_fd = -1;
  d->lock_fd = -1;
  /* First: the device probe below may already log. */
  int log_rc = start_log(t, &given);
  if (log_rc != 0)
    return log_rc;
  const char *v;
  int64_t value;
  int rc = flag_value(t, &given, FLAG_RANKS, &v, &value);
  if (rc != 0)
    return rc;
  o->ranks = (int)value;
  if ((rc = flag_value(t, &given, FLAG_DEVICE, &v, &value)) != 0)
    return rc;
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
  if ((rc = flag_value(t, &given, FLAG_THREADS_PER_RANK, &v, &value)) != 0)
    return rc;
  if (v != NULL)
    o->threads_per_rank = (int)value;
  if ((rc = flag_value(t, &given, FLAG_COLLECTIVE_TIMEOUT, &v, &value)) != 0)
    return rc;
  int timeout_s = (int)value;
  o->collective_timeout_ms = timeout_s * 1000;
  if ((rc = flag_value(t, &given, FLAG_MAX_LIVE_BYTES, &v, &value)) != 0)
    return rc;
  o->max_live_bytes = (uint64_t)value;
  if ((rc = flag_value(t, &given, FLAG_MAX_SESSIONS, &v, &value)) != 0)
    return rc;
  o->max_sessions = (int)value;
  snprintf(comm_host, sizeof comm_host, "%s", flag_text(t, &given, FLAG_COMM_HOST));
  snprintf(o->comm_host, sizeof o->comm_host, "%s", comm_host);
  if (strcmp(mode, "node") == 0) {
    v = flag_text(t, &given, FLAG_COORDINATOR);
    if ((rc = flag_check(t, FLAG_COORDINATOR, v != NULL ? v : "", &value)) != 0)
      return rc;
    snprintf(o->coordinator, sizeof o->coordinator, "%s", v);
  } else if (given.value[FLAG_COORDINATOR] != NULL) {
    fprintf(stderr, "zerod: --coordinator needs 'zerod node' (standalone runs its own)\n");
    return 2;
  }
  int tls_flags = given.value[FLAG_TLS_CA] != NULL || given.value[FLAG_TLS_CERT] != NULL ||
                  given.value[FLAG_TLS_KEY] != NULL || given.value[FLAG_TLS_SERVER_NAME] != NULL;
  if (strcmp(mode, "node") != 0 && (tls_flags || given.value[FLAG_AUTH_TOKEN_FILE] != NULL)) {
    fprintf(stderr,
            "zerod: --tls-* and --auth-token-file are how 'zerod node' reaches its coordinator "
            "(standalone's is in the same process)\n");
    return 2;
  }
  if (strcmp(mode, "node") == 0) {
    /* Flags, else the environment (rpc_client_credentials). The paths
     * point into argv or the environment, which live as long as we do. */
    o->tls = (rpc_tls){.ca_file = given.value[FLAG_TLS_CA],
                       .cert_file = given.value[FLAG_TLS_CERT],
                       .key_file = given.value[FLAG_TLS_KEY],
                       .server_name = given.value[FLAG_TLS_SERVER_NAME]};
    char err[PATH_MAX + 128];
    if (rpc_client_credentials(&o->tls, given.value[FLAG_AUTH_TOKEN_FILE], &o->use_tls, o->token,
                               sizeof o->token, err, sizeof err) != 0) {
      fprintf(stderr, "zerod: %s\n", err);
      return 2;
    }
    if (!o->use_tls && given.value[FLAG_INSECURE] == NULL && !rpc_insecure_from_env() &&
        !rpc_address_is_local(o->coordinator)) {
      fprintf(stderr,
              "zerod: the coordinator %s is on another host: reach it over TLS (--tls-ca, and "
              "--tls-cert/--tls-key for mutual TLS) or pass --insecure\n",
              o->coordinator);
      return 2;
    }
  }
  if (strcmp(mode, "node") == 0 &&
      (given.value[FLAG_CHECKPOINT_DIR] != NULL || given.value[FLAG_CHECKPOINT_TIMEOUT] != NULL ||
       given.n_export_roots > 0)) {
    /* A node saves where its coordinator's orders say. */
    fprintf(stderr, "zerod: --checkpoint-dir, --checkpoint-timeout and --export-root are the "
                    "coordinator's (zerod coordinator or standalone), not a node's\n");
    return 2;
  }
  /* A node writes shard files and layouts with it too. */
  if (start_file_mode(t, &given) != 0)
    return 2;
  if (strcmp(mode, "node") != 0) {
    if ((rc = flag_value(t, &given, FLAG_CHECKPOINT_TIMEOUT, &v, &value)) != 0)
      return rc;
    checkpoint_timeout_ms = (int)value * 1000;
  }
  {
    v = flag_text(t, &given, FLAG_NAME);
    char host[256] = "";
    if (v == NULL && gethostname(host, sizeof host - 1) == 0)
      v = host;
    if ((rc = flag_check(t, FLAG_NAME, v != NULL ? v : "", &value)) != 0)
      return rc;
    memcpy(o->node_name, v, strlen(v) + 1); /* checked: at most 64 bytes */
  }
  snprintf(o->dir, sizeof o->dir, "%s", flag_text(t, &given, FLAG_DIR));
  v = flag_text(t, &given, FLAG_SOCKET);
  if (v != NULL)
    snprintf(o->socket_path, sizeof o->socket_path, "%s", v);
  else {
    size_t dir_len = strlen(o->dir);
    if (dir_len + sizeof "/zerod.sock" > sizeof o->socket_path)
      return flag_invalid("--dir", o->dir, "path too long");
    memcpy(o->socket_path, o->dir, dir_len);
    memcpy(o->socket_path + dir_len, "/zerod.sock", sizeof "/zerod.sock");
  }
  if ((v = flag_text(t, &given, FLAG_SOCKET_GROUP)) != NULL)
    snprintf(o->socket_group, sizeof o->socket_group, "%s", v);

  /* The state directory and its lock: one daemon per directory. */
  rc = start_mkdir_p(o->dir);
  if (rc != 0) {
    fprintf(stderr, "zerod: cannot create state directory %s: %s\n", o->dir, strerror(-rc));
    return 1;
  }
  char lock_path[PATH_MAX + 16];
  snprintf(lock_path, sizeof lock_path, "%s/zerod.lock", o->dir);
  if (start_lock_state_dir(lock_path, o->dir, &d->lock_fd) != 0)
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
  if (start_metrics(d->loop, flag_text(t, &given, FLAG_METRICS_LISTEN), mode, &d->metrics,
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
  const char *nvme_flag = flag_text(t, &given, FLAG_NVME_DIR);
  char nvme_want[PATH_MAX];
  if ((nvme_flag != NULL && nvme_flag[0] == '\0') ||
      snprintf(nvme_want, sizeof nvme_want, nvme_flag != NULL ? "%s" : "%s/nvme",
               nvme_flag != NULL ? nvme_flag : o->dir) >= (int)sizeof nvme_want - 256)
    return flag_invalid("--nvme-dir", nvme_flag != NULL ? nvme_flag : o->dir, "a directory");
  if ((rc = start_mkdir_p(nvme_want)) != 0 || realpath(nvme_want, nvme_dir) == NULL) {
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
  const char *health_listen = flag_text(t, &given, FLAG_HEALTH_LISTEN);
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
