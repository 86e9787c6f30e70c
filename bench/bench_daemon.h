/* bench_daemon.h - a real standalone zerod for the benchmarks that need one
 * (bench_ipc, bench_offload): bin/zerod next to this build's bench/, or
 * $ZEROD_BIN, in a fresh directory under $TMPDIR (default /tmp), with one
 * rank thread each and the log at warn ($ZEROD_LOG_LEVEL says otherwise). */
#ifndef ZK_BENCH_DAEMON_H
#define ZK_BENCH_DAEMON_H

#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "zerod.h"

typedef struct bench_daemon {
  pid_t pid;
  char dir[PATH_MAX];
  char socket[PATH_MAX + 16];
} bench_daemon;

/* Starts `zerod standalone --device device --ranks ranks --max-live-bytes
 * max_live` and waits for its socket. Returns 0, or -1 after saying why on
 * stderr. */
static inline int bench_daemon_start_on(bench_daemon *d, const char *prog, const char *device,
                                        int ranks, const char *max_live) {
  char exe[PATH_MAX], zerod[PATH_MAX + 16];
  const char *env = getenv("ZEROD_BIN");
  if (env != NULL) {
    snprintf(zerod, sizeof zerod, "%s", env);
  } else {
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
      return -1;
    exe[n] = '\0';
    *strrchr(exe, '/') = '\0';
    snprintf(zerod, sizeof zerod, "%s/../bin/zerod", exe);
  }
  snprintf(d->dir, sizeof d->dir, "%s/zerod-%s-XXXXXX",
           getenv("TMPDIR") != NULL ? getenv("TMPDIR") : "/tmp", prog);
  if (mkdtemp(d->dir) == NULL) {
    fprintf(stderr, "%s: mkdtemp %s: %s\n", prog, d->dir, strerror(errno));
    return -1;
  }
  snprintf(d->socket, sizeof d->socket, "%s/zerod.sock", d->dir);
  char ranks_arg[16];
  snprintf(ranks_arg, sizeof ranks_arg, "%d", ranks);
  const char *level = getenv("ZEROD_LOG_LEVEL") != NULL ? getenv("ZEROD_LOG_LEVEL") : "warn";
  d->pid = fork();
  if (d->pid == 0) {
    execl(zerod, "zerod", "standalone", "--device", device, "--ranks", ranks_arg, "--dir", d->dir,
          "--socket", d->socket, "--threads-per-rank", "1", "--max-live-bytes", max_live,
          "--log-level", level, (char *)NULL);
    fprintf(stderr, "%s: exec %s: %s\n", prog, zerod, strerror(errno));
    _exit(127);
  }
  for (int i = 0; i < 250; i++) {
    struct stat st;
    if (stat(d->socket, &st) == 0)
      return 0;
    usleep(20000);
  }
  fprintf(stderr, "%s: zerod did not start\n", prog);
  kill(d->pid, SIGKILL);
  waitpid(d->pid, NULL, 0);
  d->pid = -1;
  return -1;
}

/* A job made by attaching to the daemon at socket (a connection of its
 * own) with config, and one unit of numel fp32 elements drawn from a
 * seeded normal (std 0.02). Returns ZD_OK, or the failing call's status
 * with *what naming it. */
static inline zd_status bench_job_with_unit(const char *socket, const char *name,
                                            const zd_job_config *config, uint64_t numel,
                                            zd_job **job, zd_unit *unit, const char **what) {
  zd_client *client;
  zd_status st = zd_connect(socket, &client);
  *what = "connect";
  if (st != ZD_OK)
    return st;
  zd_attach_options ao = ZD_ATTACH_OPTIONS_INIT;
  ao.job = name;
  ao.create = 1;
  ao.config = config;
  *what = "attach";
  if ((st = zd_attach(client, &ao, job)) != ZD_OK)
    return st;
  uint64_t shape[1] = {numel};
  zd_tensor_desc tensor = {
      .struct_size = sizeof(zd_tensor_desc), .name = "w", .shape = shape, .ndim = 1};
  zd_unit_desc ud = ZD_UNIT_DESC_INIT;
  ud.name = "big";
  ud.tensors = &tensor;
  ud.ntensors = 1;
  ud.init = ZD_INIT_SEEDED_NORMAL;
  ud.seed = 1;
  ud.init_std = 0.02;
  *what = "register";
  return zd_register_unit(*job, &ud, unit);
}

/* The same on CPU ranks. */
static inline int bench_daemon_start(bench_daemon *d, const char *prog, int ranks,
                                     const char *max_live) {
  return bench_daemon_start_on(d, prog, "cpu", ranks, max_live);
}

/* SIGTERM, wait, and remove its directory. */
static inline void bench_daemon_stop(bench_daemon *d) {
  if (d->pid > 0) {
    kill(d->pid, SIGTERM);
    waitpid(d->pid, NULL, 0);
  }
  d->pid = -1;
  char cmd[PATH_MAX + 16];
  snprintf(cmd, sizeof cmd, "rm -rf %s", d->dir);
  if (system(cmd) != 0)
    fprintf(stderr, "could not remove %s\n", d->dir);
}

#endif /* ZK_BENCH_DAEMON_H */
