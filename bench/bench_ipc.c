/* bench_ipc - the request path and the gathered data path of a real zerod,
 * each against its raw baseline measured in the same run:
 *
 *  1. gather + release of a 4 KiB unit on 1 rank, against a raw Unix-socket
 *     exchange of the same message count and sizes (request, reply, and a
 *     one-way message) with a process that answers with blocking
 *     read/write. Target: zerod / raw <= 1.5.
 *  2. all-gather of a 64 MiB unit over 2 ranks (two client threads, each
 *     attached as one rank), against Gloo's own all-gather of the same
 *     bytes. Two units alternate and max_live_bytes holds only one, so every
 *     gather is a real all-gather, never a cache hit. Target: raw / zerod
 *     >= 0.9 (throughput ratio).
 *
 * It starts its own daemon (bin/zerod next to this build's bench/, or
 * $ZEROD_BIN) in a temporary directory and stops it at the end.
 *
 *   bench_ipc [--iters N] [--rounds N] [--skip-allgather]
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_daemon.h"
#include "bench_util.h"
#include "gloo_raw.h"
#include "zerod.h"

static void die(const char *what, zd_status st) {
  fprintf(stderr, "bench_ipc: %s: %s: %s\n", what, zd_strerror(st), zd_last_error());
  exit(1);
}

/* ------------------------------------------------------------------------ */
/* The daemon                                                               */
/* ------------------------------------------------------------------------ */

static bench_daemon daemon_;
static const char *socket_path = daemon_.socket;

static pid_t start_daemon(int ranks, const char *max_live) {
  return bench_daemon_start(&daemon_, "bench_ipc", ranks, max_live) == 0 ? daemon_.pid : -1;
}

static void stop_daemon(pid_t pid) {
  (void)pid;
  bench_daemon_stop(&daemon_);
}

/* ------------------------------------------------------------------------ */
/* 1. gather + release against a raw socket exchange                        */
/* ------------------------------------------------------------------------ */

/* Message sizes of the zerod exchange: a 24-byte header plus the payloads
 * of GatherRequest (2 bytes), GatherReply (~12 bytes), ReleaseRequest. */
enum { REQ_BYTES = 26, REPLY_BYTES = 38, ONEWAY_BYTES = 26 };

static int read_full(int fd, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, (char *)buf + got, n - got);
    if (r <= 0)
      return -1;
    got += (size_t)r;
  }
  return 0;
}

static double raw_exchange_seconds(int iters) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
    return -1;
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    char buf[64] = {0};
    for (;;) {
      if (read_full(sv[1], buf, REQ_BYTES) != 0)
        _exit(0);
      if (write(sv[1], buf, REPLY_BYTES) != REPLY_BYTES)
        _exit(1);
      if (read_full(sv[1], buf, ONEWAY_BYTES) != 0)
        _exit(0);
    }
  }
  close(sv[1]);
  char buf[64] = {0};
  double t0 = bench_now_s();
  for (int i = 0; i < iters; i++) {
    if (write(sv[0], buf, REQ_BYTES) != REQ_BYTES || read_full(sv[0], buf, REPLY_BYTES) != 0 ||
        write(sv[0], buf, ONEWAY_BYTES) != ONEWAY_BYTES)
      return -1;
  }
  double t = (bench_now_s() - t0) / iters;
  close(sv[0]);
  waitpid(pid, NULL, 0);
  return t;
}

static void bench_gather_release(int iters, int rounds) {
  pid_t daemon_pid = start_daemon(1, "256M");
  if (daemon_pid < 0)
    exit(1);
  zd_client *client;
  zd_status st = zd_connect(socket_path, &client);
  if (st != ZD_OK)
    die("connect", st);
  zd_job_config config = ZD_JOB_CONFIG_INIT;
  zd_attach_options ao = ZD_ATTACH_OPTIONS_INIT;
  ao.job = "bench";
  ao.create = 1;
  ao.config = &config;
  zd_job *job;
  if ((st = zd_attach(client, &ao, &job)) != ZD_OK)
    die("attach", st);
  uint64_t shape[1] = {1024}; /* 4 KiB of fp32 */
  zd_tensor_desc tensor = {
      .struct_size = sizeof(zd_tensor_desc), .name = "w", .shape = shape, .ndim = 1};
  zd_unit_desc ud = ZD_UNIT_DESC_INIT;
  ud.name = "small";
  ud.tensors = &tensor;
  ud.ntensors = 1;
  ud.init = ZD_INIT_ZEROS;
  zd_unit unit;
  if ((st = zd_register_unit(job, &ud, &unit)) != ZD_OK)
    die("register", st);

  double *zerod_t = calloc((size_t)rounds, sizeof *zerod_t);
  double *raw_t = calloc((size_t)rounds, sizeof *raw_t);
  for (int r = 0; r < rounds; r++) {
    zd_view view = ZD_VIEW_INIT;
    double t0 = bench_now_s();
    for (int i = 0; i < iters; i++) {
      if ((st = zd_gather(job, unit, &view)) != ZD_OK)
        die("gather", st);
      if ((st = zd_release(job, unit)) != ZD_OK)
        die("release", st);
    }
    zerod_t[r] = (bench_now_s() - t0) / iters;
    raw_t[r] = raw_exchange_seconds(iters);
  }
  double z = bench_median(zerod_t, rounds), raw = bench_median(raw_t, rounds);
  printf("{\"bench\":\"ipc_gather_release_4k\",\"ranks\":1,\"metric\":\"us\",\"value\":%.2f,"
         "\"baseline\":\"raw_unix_socket_exchange\",\"baseline_value\":%.2f,\"ratio\":%.3f,"
         "\"target\":1.5,\"lower_is_better\":true}\n",
         z * 1e6, raw * 1e6, z / raw);
  fflush(stdout);
  zd_detach(job);
  zd_close(client);
  free(zerod_t);
  free(raw_t);
  stop_daemon(daemon_pid);
}

/* ------------------------------------------------------------------------ */
/* 2. all-gather of 64 MiB over 2 ranks against raw Gloo                    */
/* ------------------------------------------------------------------------ */

#define AG_NUMEL (16u << 20) /* 64 MiB of fp32 */

typedef struct ag_worker {
  int rank, iters;
  double seconds; /* per gather, median */
  pthread_barrier_t *barrier;
} ag_worker;

static void *ag_main(void *arg) {
  ag_worker *w = arg;
  zd_client *client;
  zd_status st = zd_connect(socket_path, &client);
  if (st != ZD_OK)
    die("connect", st);
  zd_job_config config = ZD_JOB_CONFIG_INIT;
  zd_attach_options ao = ZD_ATTACH_OPTIONS_INIT;
  ao.job = "allgather";
  ao.local_rank = (unsigned)w->rank;
  ao.create = 1;
  ao.config = &config;
  zd_job *job;
  if ((st = zd_attach(client, &ao, &job)) != ZD_OK)
    die("attach", st);
  uint64_t shape[1] = {AG_NUMEL};
  zd_tensor_desc tensor = {
      .struct_size = sizeof(zd_tensor_desc), .name = "w", .shape = shape, .ndim = 1};
  zd_unit units[2];
  for (int u = 0; u < 2; u++) {
    zd_unit_desc ud = ZD_UNIT_DESC_INIT;
    ud.name = u == 0 ? "a" : "b";
    ud.tensors = &tensor;
    ud.ntensors = 1;
    ud.init = ZD_INIT_ZEROS;
    if ((st = zd_register_unit(job, &ud, &units[u])) != ZD_OK)
      die("register", st);
  }
  double *t = calloc((size_t)w->iters, sizeof *t);
  for (int i = -2; i < w->iters; i++) {
    pthread_barrier_wait(w->barrier);
    zd_view view = ZD_VIEW_INIT;
    double t0 = bench_now_s();
    if ((st = zd_gather(job, units[(i + 2) & 1], &view)) != ZD_OK)
      die("gather", st);
    double dt = bench_now_s() - t0;
    if ((st = zd_release(job, units[(i + 2) & 1])) != ZD_OK)
      die("release", st);
    if (i >= 0)
      t[i] = dt;
  }
  w->seconds = bench_median(t, w->iters);
  free(t);
  zd_detach(job);
  zd_close(client);
  return NULL;
}

static void bench_all_gather(int iters, int rounds) {
  /* Room for one 64 MiB gathered buffer only (see the top comment). */
  pid_t daemon_pid = start_daemon(2, "80M");
  if (daemon_pid < 0)
    exit(1);
  double *zerod_t = calloc((size_t)rounds, sizeof *zerod_t);
  double *raw_t = calloc((size_t)rounds, sizeof *raw_t);
  for (int r = 0; r < rounds; r++) {
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, 2);
    ag_worker w[2] = {{0, iters, 0, &barrier}, {1, iters, 0, &barrier}};
    pthread_t th[2];
    for (int k = 0; k < 2; k++)
      pthread_create(&th[k], NULL, ag_main, &w[k]);
    for (int k = 0; k < 2; k++)
      pthread_join(th[k], NULL);
    pthread_barrier_destroy(&barrier);
    zerod_t[r] = w[0].seconds > w[1].seconds ? w[0].seconds : w[1].seconds;
    if (gloo_raw_allgather((size_t)AG_NUMEL * 4 / 2, 2, iters, &raw_t[r]) != 0)
      exit(1);
  }
  double z = bench_median(zerod_t, rounds), raw = bench_median(raw_t, rounds);
  double bytes = (double)AG_NUMEL * 4;
  printf("{\"bench\":\"ipc_all_gather_64m\",\"ranks\":2,\"metric\":\"GB/s\",\"value\":%.3f,"
         "\"baseline\":\"gloo_raw_allgather\",\"baseline_value\":%.3f,\"ratio\":%.3f,"
         "\"target\":0.9}\n",
         bytes / z / 1e9, bytes / raw / 1e9, raw / z);
  fflush(stdout);
  free(zerod_t);
  free(raw_t);
  stop_daemon(daemon_pid);
}

int main(int argc, char **argv) {
  int iters = 20000, rounds = 7, skip_allgather = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
      iters = atoi(argv[++i]);
    else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc)
      rounds = atoi(argv[++i]);
    else if (strcmp(argv[i], "--skip-allgather") == 0)
      skip_allgather = 1;
    else {
      fprintf(stderr, "usage: bench_ipc [--iters N] [--rounds N] [--skip-allgather]\n");
      return 2;
    }
  }
  signal(SIGPIPE, SIG_IGN);
  bench_gather_release(iters, rounds);
  if (!skip_allgather)
    bench_all_gather(10, rounds < 5 ? rounds : 5);
  return 0;
}
