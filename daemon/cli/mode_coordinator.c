/* mode_coordinator: `zerod coordinator`, the cluster's coordinator
 * (mode.h; coord.h is the coordinator itself).
 *
 * Settles the coordinator's command line (flags_coordinator), takes its
 * state directory, serves coord.h's services over gRPC on the loop, with
 * a plain-text probe listener and metrics if asked for, and shuts down
 * gently on SIGINT or SIGTERM: watches end, calls in flight are
 * cancelled. */
#include "mode.h"

#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coord.h"
#include "flags.h"
#include "health.h"
#include "log.h"
#include "fsutil.h"
#include "start.h"

/* A switch's environment variable: set to 1, true or yes. */
static int env_switch(const flag_table *t, flag_id id) {
  const char *v = getenv(flag_find(t, id)->env);
  return v != NULL && (strcmp(v, "1") == 0 || strcmp(v, "true") == 0 || strcmp(v, "yes") == 0);
}

/* The coordinator's listener: the flags, else their variables (a node's
 * client settings are rpc_client_credentials'). */
typedef struct server_security {
  const char *tls_cert, *tls_key, *tls_client_ca, *auth_file;
  int require_client_cert, insecure;
} server_security;

static void server_security_settle(const flag_table *t, const flag_given *given,
                                   server_security *sec) {
  sec->tls_cert = flag_text(t, given, FLAG_TLS_CERT);
  sec->tls_key = flag_text(t, given, FLAG_TLS_KEY);
  sec->tls_client_ca = flag_text(t, given, FLAG_TLS_CLIENT_CA);
  sec->auth_file = flag_text(t, given, FLAG_AUTH_FILE);
  sec->require_client_cert = given->value[FLAG_TLS_REQUIRE_CLIENT_CERT] != NULL ||
                             env_switch(t, FLAG_TLS_REQUIRE_CLIENT_CERT);
  sec->insecure = given->value[FLAG_INSECURE] != NULL || rpc_insecure_from_env();
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
  int signals_open; /* the two handles above are open */
  int stopping;
} coordinator_process;

static void on_coordinator_server_done(void *arg) {
  (void)arg;
  LOG_INFOF("coordinator stopped serving", NULL);
}

static void shutdown_coordinator(coordinator_process *p, const char *why) {
  if (p->stopping)
    return;
  p->stopping = 1;
  LOG_INFOF("shutting down", "reason=%s", why);
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
  if (p->signals_open) {
    uv_close((uv_handle_t *)&p->sigint, NULL);
    uv_close((uv_handle_t *)&p->sigterm, NULL);
  }
}

static void on_coordinator_signal(uv_signal_t *handle, int signum) {
  shutdown_coordinator(handle->data, signum == SIGINT ? "SIGINT" : "SIGTERM");
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

/* What the command line settles before anything starts. */
typedef struct coordinator_settings {
  coord_options co;
  const char *listen_addr; /* HOST:PORT */
  int local;               /* no other host can reach listen_addr */
  int use_tls;
  rpc_tls tls;
  server_security sec;
} coordinator_settings;

/* The log, the lease, the state directory's path, the listener's address,
 * the checkpoints' timeout and retention, the files' mode. 0, or 2 with
 * the error printed. */
static int settle_flags(const flag_table *t, const flag_given *given, coordinator_settings *s) {
  int log_rc = start_log(t, given);
  if (log_rc != 0)
    return log_rc;
  const char *v;
  int64_t value;
  coord_options *co = &s->co;
  int rc = flag_value(t, given, FLAG_LEASE_TTL, &v, &value);
  if (rc != 0)
    return rc;
  co->lease_ttl_ms = (int)value;
  if ((rc = flag_value(t, given, FLAG_STALL_TIMEOUT, &v, &value)) != 0)
    return rc;
  co->stall_timeout_ms = value;
  if ((rc = flag_value(t, given, FLAG_JOB_IDLE_TTL, &v, &value)) != 0)
    return rc;
  co->job_idle_ttl_ms = value;
  if ((rc = flag_value(t, given, FLAG_STATE_DIR, &v, &value)) != 0)
    return rc;
  snprintf(co->state_dir, sizeof co->state_dir, "%s", v);
  if ((rc = flag_value(t, given, FLAG_LISTEN, &s->listen_addr, &value)) != 0)
    return rc;

  if ((rc = flag_value(t, given, FLAG_CHECKPOINT_TIMEOUT, &v, &value)) != 0)
    return rc;
  co->checkpoint_timeout_ms = (int)value * 1000;
  if ((rc = flag_value(t, given, FLAG_RETAIN_DELETED_CHECKPOINTS, &v, &value)) != 0)
    return rc;
  co->retain_deleted_checkpoints_ms = value;
  if (start_file_mode(t, given) != 0)
    return 2;
  return 0;
}

/* Who can reach the listener, and what they may do (docs/security.md):
 * plain transport and no principals only where nobody else can reach it,
 * or when the operator says so. 0, or 2 with the error printed. */
static int settle_security(const flag_table *t, const flag_given *given, coordinator_settings *s) {
  server_security_settle(t, given, &s->sec);
  const server_security *sec = &s->sec;
  s->tls = (rpc_tls){.cert_file = sec->tls_cert,
                     .key_file = sec->tls_key,
                     .ca_file = sec->tls_client_ca,
                     .require_client_cert = sec->require_client_cert};
  s->use_tls = sec->tls_cert != NULL || sec->tls_key != NULL;
  if (!s->use_tls && (sec->tls_client_ca != NULL || sec->require_client_cert)) {
    fprintf(stderr, "zerod: --tls-client-ca and --tls-require-client-cert need --tls-cert and "
                    "--tls-key\n");
    return 2;
  }
  s->local = rpc_address_is_local(s->listen_addr);
  if (!s->use_tls && !s->local && !sec->insecure) {
    fprintf(stderr,
            "zerod: --listen %s is reachable from other hosts: serve TLS (--tls-cert, --tls-key) "
            "or pass --insecure\n",
            s->listen_addr);
    return 2;
  }
  if (sec->auth_file == NULL && !s->local && !sec->insecure) {
    fprintf(stderr,
            "zerod: --listen %s is reachable from other hosts and no principals are configured: "
            "anyone could delete any job. Pass --auth-file (docs/security.md) or --insecure\n",
            s->listen_addr);
    return 2;
  }
  if (sec->auth_file != NULL && snprintf(s->co.auth_file, sizeof s->co.auth_file, "%s",
                                         sec->auth_file) >= (int)sizeof s->co.auth_file)
    return flag_invalid("--auth-file", sec->auth_file, "path too long");
  return 0;
}

/* The export roots, the state directory (made) and its lock, the
 * checkpoint directory (made). 0, or the exit status with the error
 * printed. */
static int take_directories(const flag_table *t, const flag_given *given, coordinator_settings *s,
                            char *lock_path, size_t lock_path_bytes, int *lock_fd) {
  coord_options *co = &s->co;
  int rc = start_export_roots(t, given, co);
  if (rc != 0)
    return rc;
  rc = fsutil_mkdir_p(co->state_dir);
  if (rc != 0) {
    fprintf(stderr, "zerod: cannot create state directory %s: %s\n", co->state_dir, strerror(-rc));
    return 1;
  }
  if ((rc = start_checkpoint_dir(flag_text(t, given, FLAG_CHECKPOINT_DIR), co->state_dir,
                                 co->checkpoint_dir, sizeof co->checkpoint_dir)) != 0)
    return rc;
  snprintf(lock_path, lock_path_bytes, "%s/coordinator.lock", co->state_dir);
  if (start_lock_state_dir(lock_path, co->state_dir, lock_fd) != 0)
    return 1;
  return 0;
}

/* The gRPC server on the listener, serving the coordinator's services.
 * 0, or 1 with the reason on stderr and what was made shut down. */
static int serve_grpc(coordinator_process *p, const coordinator_settings *s, int *port) {
  char err[512] = "";
  int rc = rpc_server_create(p->loop, s->listen_addr, &p->server, err, sizeof err);
  if (rc == 0 && s->use_tls)
    rc = rpc_server_set_tls(p->server, &s->tls, err, sizeof err);
  if (rc == 0)
    rc = coord_register(p->coord, p->server);

  if (rc == 0)
    rc = rpc_server_start(p->server, port, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "zerod: cannot serve gRPC on %s: %s\n", s->listen_addr,
            err[0] ? err : strerror(-rc));
    /* Nothing was accepted: shutting down finishes on the next loop turn. */
    coord_shutdown(p->coord);
    if (p->server != NULL)
      rpc_server_shutdown(p->server, on_coordinator_server_done, p);
    uv_run(p->loop, UV_RUN_DEFAULT);
    return 1;
  }
  return 0;
}

/* --health-listen and --metrics-listen, once the server serves. 0, or 1
 * with the reason on stderr and the start abandoned. */
static int start_listeners(coordinator_process *p, const flag_table *t, const flag_given *given) {
  /* A probe listener of its own (plain text, grpc.health.v1 only):
   * Kubernetes' gRPC probes speak no TLS, and the main port may. */
  const char *health_listen = flag_text(t, given, FLAG_HEALTH_LISTEN);
  if (health_listen != NULL && health_listen[0] != '\0') {
    static const char *const services[] = {"zerod.v1.Cluster", "zerod.v1.Jobs",
                                           "zerod.v1.Rendezvous", "zerod.v1.Checkpoints"};
    int health_port = 0;
    if (start_health_listener(p->loop, health_listen, services,
                              sizeof services / sizeof services[0], &p->health_server, &p->health,
                              &health_port) != 0) {
      abandon_start(p);
      return 1;
    }
    health_set(p->health, 1);
    LOG_INFOF("health listening", "address=%s port=%d", health_listen, health_port);
  }
  /* Calls are handled on this loop, so the server's observer may be set
   * now that it serves. */
  if (start_metrics(p->loop, flag_text(t, given, FLAG_METRICS_LISTEN), "coordinator", &p->metrics,
                    &p->metrics_http) != 0 ||
      coord_metrics_start(p->coord, p->server, p->metrics) != 0) {
    abandon_start(p);
    return 1;
  }
  return 0;
}

/* Serves until SIGINT or SIGTERM has shut everything down. 0, or 1 when
 * the signals could not be caught: a coordinator that cannot be stopped
 * gently stops at once instead of serving. */
static int run_loop(coordinator_process *p, const coordinator_settings *s, int port) {
  int rc = start_stop_signals(p->loop, &p->sigint, &p->sigterm, on_coordinator_signal, p);
  if (rc != 0) {
    LOG_ERRORF("cannot catch SIGINT and SIGTERM", "err=%s", uv_strerror(rc));
    shutdown_coordinator(p, "no signal handlers");
    uv_run(p->loop, UV_RUN_DEFAULT);
    return 1;
  }
  p->signals_open = 1;
  if (!s->use_tls && !s->local)
    LOG_WARNF("serving the control plane in plain text (--insecure): tokens and job data cross "
              "the network readable by anyone on the path",
              "address=%s", s->listen_addr);
  if (s->sec.auth_file == NULL && !s->local)
    LOG_WARNF("no principals configured (--insecure): every caller may do everything", "address=%s",
              s->listen_addr);
  const char *colon = strrchr(s->listen_addr, ':');
  LOG_INFOF("coordinator listening",
            "address=%.*s:%d state_dir=%s checkpoint_dir=%s lease_ttl_ms=%d version=%s pid=%d",
            (int)(colon - s->listen_addr), s->listen_addr, port, s->co.state_dir,
            s->co.checkpoint_dir, s->co.lease_ttl_ms, ZEROD_VERSION, (int)getpid());
  uv_run(p->loop, UV_RUN_DEFAULT);
  return 0;
}

/* Frees what the process made, once its loop has ended. */
static void free_process(coordinator_process *p, int status) {
  if (p->server != NULL)
    rpc_server_destroy(p->server);
  if (p->health_server != NULL)
    rpc_server_destroy(p->health_server);
  health_free(p->health);
  coord_metrics_stop(p->coord);
  coord_destroy(p->coord);
  metrics_free(p->metrics);
  int rc = uv_loop_close(p->loop);
  if (rc != 0)
    LOG_WARNF("loop closed with open handles", "err=%s", uv_err_name(rc));
  if (status == 0)
    LOG_INFOF("stopped", NULL);
}

/* The coordinator, from its state to its shutdown. The exit status. */
static int run_coordinator(const coordinator_settings *s, const flag_table *t,
                           const flag_given *given) {
  coordinator_process p = {.loop = uv_default_loop()};
  char err[512] = "";
  int rc = coord_create(p.loop, &s->co, &p.coord, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "zerod: coordinator state in %s: %s\n", s->co.state_dir, err);
    return 1;
  }
  int status = 1;
  int port = 0;
  if (serve_grpc(&p, s, &port) == 0 && start_listeners(&p, t, given) == 0)
    status = run_loop(&p, s, port);
  free_process(&p, status);
  return status;
}

int mode_coordinator_main(int argc, char **argv) {
  const flag_table *t = &flags_coordinator;
  flag_given given;
  int answered = flags_read_argv(t, argc, argv, &given);
  if (answered >= 0)
    return answered;
  if (optind < argc) {
    fprintf(stderr, "zerod coordinator: unexpected argument '%s'\n", argv[optind]);
    return 2;
  }
  coordinator_settings s = {0};
  int rc = settle_flags(t, &given, &s);
  if (rc == 0)
    rc = settle_security(t, &given, &s);
  if (rc != 0)
    return rc;
  char lock_path[PATH_MAX + 32];
  int lock_fd = -1;
  if ((rc = take_directories(t, &given, &s, lock_path, sizeof lock_path, &lock_fd)) != 0)
    return rc;

  /* Every client connection holds a descriptor: take the whole allowance
   * (running out is survived, docs/security.md, but costs every call in
   * flight). */
  start_raise_fd_limit();
  int status = run_coordinator(&s, t, &given);
  unlink(lock_path);
  close(lock_fd);
  return status;
}
