/* start: what both modes do as they start (start.h).
 *
 * Settings for the whole process (the log's level and format, the mode of
 * the files written), the directories the flags name (made, resolved,
 * checked: the state directory and its lock, the checkpoint directory,
 * the export roots), and the listeners both modes may open (probes,
 * metrics). Each prints its error on stderr, one line, and returns the
 * exit status. */
#include "start.h"

#include "fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "filemode.h"
#include "log.h"
#include "pbcheck.h"

/* --log-level and --log-format (or their variables), before anything is
 * logged. 0, or 2 with the error printed. */
int start_log(const flag_table *t, const flag_given *given) {
  const char *text;
  int64_t value;
  int rc = flag_value(t, given, FLAG_LOG_LEVEL, &text, &value);
  if (rc != 0)
    return rc;
  log_set_level((log_level)value);
  rc = flag_value(t, given, FLAG_LOG_FORMAT, &text, &value);
  if (rc != 0)
    return rc;
  log_set_format((log_format)value);
  return 0;
}

/* --file-mode (or ZEROD_FILE_MODE): set for the whole process, before
 * anything is written. 0, or 2 with the error printed. */
int start_file_mode(const flag_table *t, const flag_given *given) {
  const char *text;
  int64_t mode;
  int rc = flag_value(t, given, FLAG_FILE_MODE, &text, &mode);
  if (rc == 0)
    filemode_set((mode_t)mode);
  return rc;
}

/* --export-root, repeated, else ZEROD_EXPORT_ROOT (directories separated
 * by ':'): directories that exist, made canonical (realpath), so that a
 * client's path is compared with what the filesystem holds. Prints the
 * error and returns nonzero on failure. */
int start_export_roots(const flag_table *t, const flag_given *flags, coord_options *co) {
  char env_copy[COORD_MAX_EXPORT_ROOTS * PATH_MAX];
  const char *given[COORD_MAX_EXPORT_ROOTS + 1];
  unsigned n = 0;
  const char *env_name = flag_find(t, FLAG_EXPORT_ROOT)->env;
  const char *env = getenv(env_name);
  if (flags->n_export_roots > 0) {
    for (; n < flags->n_export_roots && n <= COORD_MAX_EXPORT_ROOTS; n++)
      given[n] = flags->export_roots[n];
  } else if (env != NULL && env[0] != '\0') {
    if (snprintf(env_copy, sizeof env_copy, "%s", env) >= (int)sizeof env_copy)
      return flag_invalid(env_name, env, "too long");
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
      return flag_invalid("--export-root", resolved, "path too long");
    snprintf(co->export_roots[i], sizeof co->export_roots[i], "%s", resolved);
  }
  co->n_export_roots = n;
  return 0;
}

/* The checkpoint directory: v (the flag, else ZEROD_CHECKPOINT_DIR), else
 * fallback/checkpoints; created, then made absolute (it travels to the
 * nodes, which must find the same directory). Room is left for what is
 * appended (<job>/<name>.tmp-<id>/<file>). Prints the error and returns
 * nonzero on failure. */
int start_checkpoint_dir(const char *v, const char *fallback, char *out, size_t out_bytes) {
  char dir[PATH_MAX];
  if ((v != NULL && v[0] == '\0') || snprintf(dir, sizeof dir, v != NULL ? "%s" : "%s/checkpoints",
                                              v != NULL ? v : fallback) >= (int)sizeof dir - 512)
    return flag_invalid("--checkpoint-dir", v != NULL ? v : fallback, "a directory, path too long");
  int rc = fsutil_mkdir_p(dir);
  char resolved[PATH_MAX];
  if (rc != 0 || realpath(dir, resolved) == NULL) {
    fprintf(stderr, "zerod: cannot create checkpoint directory %s: %s\n", dir,
            strerror(rc != 0 ? -rc : errno));
    return 1;
  }
  if (strlen(resolved) >= out_bytes - 512)
    return flag_invalid("--checkpoint-dir", resolved, "path too long");
  /* The path travels to the nodes in every save order, a string field:
   * they refuse one that is not UTF-8 (docs/control-plane.md). */
  if (!zd_utf8_valid(resolved, strlen(resolved)))
    return flag_invalid("--checkpoint-dir", resolved, "a path in UTF-8");
  snprintf(out, out_bytes, "%s", resolved);
  return 0;
}

/* Takes the state directory's lock file (one process per directory) and
 * writes our pid into it. Prints the error and returns -1 if another process
 * holds it. */
int start_lock_state_dir(const char *lock_path, const char *dir, int *fd_out) {
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

void start_raise_fd_limit(void) {
  struct rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
}

/* --health-listen: a server of its own that serves grpc.health.v1 alone
 * (coord/health.c), on loop, not yet serving. Returns 0, or 1 with the
 * reason on stderr; on failure *server may still need its shutdown. */
int start_health_listener(uv_loop_t *loop, const char *addr, const char *const *services,
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
int start_metrics(uv_loop_t *loop, const char *addr, const char *mode, metrics **m,
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

int start_stop_signals(uv_loop_t *loop, uv_signal_t *sigint, uv_signal_t *sigterm, uv_signal_cb cb,
                       void *data) {
  int rc = uv_signal_init(loop, sigint);
  if (rc != 0)
    return rc;
  rc = uv_signal_init(loop, sigterm);
  if (rc != 0) {
    uv_close((uv_handle_t *)sigint, NULL);
    return rc;
  }
  sigint->data = sigterm->data = data;
  rc = uv_signal_start(sigint, cb, SIGINT);
  if (rc == 0)
    rc = uv_signal_start(sigterm, cb, SIGTERM);
  if (rc != 0) {
    uv_close((uv_handle_t *)sigint, NULL);
    uv_close((uv_handle_t *)sigterm, NULL);
  }
  return rc;
}
