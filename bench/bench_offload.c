/* bench_offload - the offload tier (offload_optimizer nvme, rank/tier.c)
 * against raw I/O of the same bytes, and the host step with and without
 * offload "cpu", in one run on one filesystem:
 *
 *  1. nvme step: a real standalone daemon (one CPU rank), one unit of N
 *     fp32 elements whose master weights and AdamW moments live in the
 *     rank's tier file (O_DIRECT, io_uring), buffer_count 4 of 1 Mi
 *     elements; the time of zd_step (a gradient of ones reduced before
 *     each, untimed: the step reads, updates and writes all 3 x 4N bytes). Baseline:
 *     raw sequential reads and writes of the same bytes in the same 1 Mi x 3
 *     chunks through the same interface (backend/aio.c, the same slots:
 *     two chunks read ahead, one written behind), with no computation, in a
 *     file beside the tier file. Target: raw / step >= 0.8 (the step runs at
 *     80% of the I/O's bandwidth or better).
 *  2. host step: the same unit with its state in memory, offload "cpu"
 *     against offload "none" (today's host step: the same code). Target:
 *     ratio 1.0 within noise.
 *
 * Figures are medians over --rounds rounds (default 9) after one warm-up
 * step; each round times the zerod side and its baseline one after
 * another (alternating which goes first), and the nvme ratio is the median
 * of the rounds' own ratios: this VM's disk drifts by 2x within seconds.
 * --numel N (default 32 Mi elements: a 384 MiB tier file) and
 * TMPDIR (default /tmp) choose the size and the filesystem; the JSON lines
 * name both. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "aio.h"
#include "bench_daemon.h"
#include "bench_util.h"
#include "zerod.h"

#define CHUNK   (1u << 20) /* elements per buffer and state */
#define SLOTS   4
#define NSTATES 3

static bench_daemon daemon_;
static const char *socket_path = daemon_.socket;

static void die(const char *what, zd_status st) {
  fprintf(stderr, "bench_offload: %s: %s: %s\n", what, zd_strerror(st), zd_last_error());
  if (daemon_.pid > 0)
    kill(daemon_.pid, SIGKILL);
  exit(1);
}

/* A job with one unit of numel elements, offload_device as given. */
static zd_job *make_job(const char *name, zd_offload_device offload, uint64_t numel,
                        zd_unit *unit) {
  zd_job_config config = ZD_JOB_CONFIG_INIT;
  config.offload_device = offload;
  config.offload_buffer_count = SLOTS;
  config.offload_buffer_size = CHUNK;
  zd_job *job = NULL;
  const char *what;
  zd_status st = bench_job_with_unit(socket_path, name, &config, numel, &job, unit, &what);
  if (st != ZD_OK)
    die(what, st);
  return job;
}

static double step_seconds(zd_job *job, zd_unit unit) {
  zd_view grad = ZD_VIEW_INIT;
  zd_status st = zd_grad_buffer(job, unit, &grad);
  if (st != ZD_OK)
    die("grad_buffer", st);
  float *g = grad.base;
  for (uint64_t i = 0; i < grad.bytes / sizeof(float); i++)
    g[i] = 1.0f;
  st = zd_reduce(job, unit);
  if (st != ZD_OK)
    die("reduce", st);
  double t0 = bench_now_s();
  zd_step_result result = ZD_STEP_RESULT_INIT;
  if ((st = zd_step(job, NULL, &result)) != ZD_OK)
    die("step", st);
  return bench_now_s() - t0;
}

/* The 3 states of raw chunk `chunk` into or out of slot's buffers. */
static void raw_chunk_io(aio_file *f, float *buffers, uint64_t stride, unsigned slot, size_t chunk,
                         int write) {
  for (unsigned s = 0; s < NSTATES; s++) {
    float *buf = buffers + ((size_t)slot * NSTATES + s) * CHUNK;
    uint64_t offset = s * stride + (uint64_t)chunk * CHUNK * 4;
    if (write)
      aio_file_write(f, slot, buf, CHUNK * 4, offset);
    else
      aio_file_read(f, slot, buf, CHUNK * 4, offset);
  }
}

/* Raw: every chunk of 3 states read, then written back, through the same
 * slots and look-ahead as tier_stream, nothing computed. */
static double raw_seconds(aio_file *f, float *buffers, uint64_t numel) {
  uint64_t stride = (numel * 4 + AIO_ALIGN - 1) / AIO_ALIGN * AIO_ALIGN;
  size_t ntasks = (size_t)((numel + CHUNK - 1) / CHUNK);
  size_t ahead = SLOTS - 2, issued = 0;
  double t0 = bench_now_s();
  for (size_t i = 0; i < ntasks; i++) {
    while (issued < ntasks && issued <= i + ahead) {
      unsigned slot = (unsigned)(issued % SLOTS);
      if (aio_file_wait(f, slot) != 0)
        return -1;
      raw_chunk_io(f, buffers, stride, slot, issued, 0);
      issued++;
    }
    aio_file_submit(f);
    unsigned slot = (unsigned)(i % SLOTS);
    if (aio_file_wait(f, slot) != 0)
      return -1;
    raw_chunk_io(f, buffers, stride, slot, i, 1);
    aio_file_submit(f);
  }
  for (unsigned s = 0; s < SLOTS; s++)
    if (aio_file_wait(f, s) != 0)
      return -1;
  return bench_now_s() - t0;
}

int main(int argc, char **argv) {
  uint64_t numel = 32u << 20;
  int rounds = 9;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--numel") == 0)
      numel = strtoull(argv[i + 1], NULL, 10) / CHUNK * CHUNK;
    else if (strcmp(argv[i], "--rounds") == 0)
      rounds = atoi(argv[i + 1]);
  }
  if (numel == 0 || rounds < 1) {
    fprintf(stderr, "usage: bench_offload [--numel N (a multiple of %u)] [--rounds R]\n", CHUNK);
    return 2;
  }
  if (bench_daemon_start(&daemon_, "bench_offload", 1, "4G") != 0)
    return 1;
  /* 1. The nvme step against raw I/O of its bytes. */
  zd_unit unit;
  zd_job *job = make_job("nvme", ZD_OFFLOAD_NVME, numel, &unit);
  char raw_path[PATH_MAX + 32], err[256];
  snprintf(raw_path, sizeof raw_path, "%s/nvme/raw.bin", daemon_.dir);
  aio_file *f;
  if (aio_file_open(raw_path, 0600, SLOTS, NSTATES, &f, err, sizeof err) != 0) {
    fprintf(stderr, "bench_offload: %s\n", err);
    return 1;
  }
  uint64_t stride = (numel * 4 + AIO_ALIGN - 1) / AIO_ALIGN * AIO_ALIGN;
  aio_file_resize(f, NSTATES * stride);
  float *buffers = aligned_alloc(AIO_ALIGN, (size_t)SLOTS * NSTATES * CHUNK * 4);
  memset(buffers, 0, (size_t)SLOTS * NSTATES * CHUNK * 4);
  /* The raw file is written once whole, so that reads find extents. */
  for (uint64_t off = 0; off < NSTATES * stride; off += CHUNK * 4) {
    aio_file_write(f, 0, buffers, CHUNK * 4, off);
    aio_file_wait(f, 0);
  }
  step_seconds(job, unit); /* warm-up */
  raw_seconds(f, buffers, numel);
  double *zt = calloc((size_t)rounds, sizeof *zt), *rt = calloc((size_t)rounds, sizeof *rt);
  double *ratios = calloc((size_t)rounds, sizeof *ratios);
  for (int r = 0; r < rounds; r++) {
    /* The disk of a shared machine drifts by 2x over seconds: each round
     * times both back to back, in alternating order, and the ratio is the
     * median of the rounds' own ratios. */
    if (r % 2 == 0) {
      zt[r] = step_seconds(job, unit);
      rt[r] = raw_seconds(f, buffers, numel);
    } else {
      rt[r] = raw_seconds(f, buffers, numel);
      zt[r] = step_seconds(job, unit);
    }
    ratios[r] = rt[r] / zt[r];
  }
  double ratio = bench_median(ratios, rounds);
  free(ratios);
  double z = bench_median(zt, rounds), raw = bench_median(rt, rounds);
  double gib = (double)NSTATES * 4 * (double)numel * 2 / (1u << 30); /* read + write */
  printf("{\"bench\":\"offload_nvme_adamw_step\",\"numel\":%llu,\"dir\":\"%s\",\"engine\":\"%s\","
         "\"direct\":%d,\"metric\":\"GiB/s\",\"value\":%.3f,\"step_ms\":%.1f,"
         "\"baseline\":\"raw_aio_read_write_same_bytes\",\"baseline_value\":%.3f,\"raw_ms\":%.1f,"
         "\"ratio\":%.3f,\"target\":0.8}\n",
         (unsigned long long)numel, daemon_.dir, aio_file_engine(f), aio_file_direct(f), gib / z,
         z * 1e3, gib / raw, raw * 1e3, ratio);
  fflush(stdout);
  aio_file_close(f);
  unlink(raw_path);
  free(buffers);
  zd_detach(job);

  /* 2. The host step: offload "cpu" against "none". */
  zd_unit u_none, u_cpu;
  zd_job *none = make_job("none", ZD_OFFLOAD_NONE, numel, &u_none);
  zd_job *cpu = make_job("cpu", ZD_OFFLOAD_CPU, numel, &u_cpu);
  step_seconds(none, u_none);
  step_seconds(cpu, u_cpu);
  for (int r = 0; r < rounds; r++) {
    rt[r] = step_seconds(none, u_none);
    zt[r] = step_seconds(cpu, u_cpu);
  }
  double c = bench_median(zt, rounds), n = bench_median(rt, rounds);
  printf("{\"bench\":\"offload_cpu_host_step\",\"numel\":%llu,\"metric\":\"ms\",\"value\":%.2f,"
         "\"baseline\":\"offload_none_host_step\",\"baseline_value\":%.2f,\"ratio\":%.3f,"
         "\"target\":1.0,\"lower_is_better\":true,\"nvme_step_over_memory_step\":%.2f}\n",
         (unsigned long long)numel, c * 1e3, n * 1e3, c / n, z / n);
  fflush(stdout);
  zd_detach(none);
  zd_detach(cpu);
  free(zt);
  free(rt);
  bench_daemon_stop(&daemon_);
  return 0;
}
