/* bench_offload_gpu - offload_optimizer cpu on a GPU rank (rank/offload.c)
 * against the serial sum of its parts and against the same job with its
 * state on the GPU, in one run on one GPU:
 *
 *  1. offloaded step: a real `zerod --device cuda` (one rank, one kernel
 *     thread), one unit of N elements, AdamW, bf16 working copy, the
 *     master weights and moments in host memory (offload_optimizer cpu,
 *     pin_memory, 4 slots of 1 Mi elements): the time of zd_step. The step
 *     brings each chunk's fp32 gradients down, runs the CPU's AdamW on it,
 *     and sends its bf16 working copy up, the copies of the next and the
 *     previous chunks overlapping the CPU's work.
 *  2. serial baseline, in this process on the same GPU: the same chunks'
 *     copies down and up through page-locked memory and the same CPU
 *     kernel (zk_adam_step, one thread) over host arrays of the same size,
 *     one after another, nothing overlapped. Target: serial / offloaded >=
 *     1.0 (the overlap hides the copies; on a host with a slow CPU and a
 *     fast link the copies are small next to the update anyway).
 *  3. the device step: the same job with its state on the GPU (the GPU's
 *     AdamW): offloaded / device says what offloading costs (informative,
 *     no target: it trades GPU memory for host memory and time).
 *  4. the CPU alone: the serial baseline's updates without its copies
 *     (cpu_adamw_ms, informative): the floor of the offloaded step.
 *
 * No gradients are reduced: the step's work does not depend on their
 * values. Figures are medians over --rounds rounds (default 7) after a
 * warm-up step; each round times the three, in turn. Without a usable GPU
 * (or NCCL, which a GPU daemon needs) one {"bench":"offload_gpu",
 * "skipped":...} line, exit 0. With ZEROD_CUDA_MODULE naming the fake
 * module (tests/fake_cuda) it runs, and its figures mean nothing.
 *
 * Usage: bench_offload_gpu [--numel N] [--rounds N] */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_daemon.h"
#include "bench_util.h"
#include "cuda/zk_cuda.h"
#include "zerod.h"
#include "zk.h"

#define CHUNK (1u << 20) /* elements per slot */
#define SLOTS 4

static bench_daemon daemon_;
static const zk_cuda_api *cu;

static void die(const char *what, zd_status st) {
  fprintf(stderr, "bench_offload_gpu: %s: %s: %s\n", what, zd_strerror(st), zd_last_error());
  if (daemon_.pid > 0)
    kill(daemon_.pid, SIGKILL);
  exit(1);
}

static void cuda_check(int rc, const char *what) {
  if (rc != 0) {
    fprintf(stderr, "bench_offload_gpu: %s: %s\n", what, cu->last_error());
    if (daemon_.pid > 0)
      kill(daemon_.pid, SIGKILL);
    exit(1);
  }
}

/* A job with one unit of numel elements, bf16 working copy, the state
 * where `offload` says. */
static zd_job *make_job(const char *name, zd_offload_device offload, uint64_t numel,
                        zd_unit *unit) {
  zd_job_config config = ZD_JOB_CONFIG_INIT;
  config.working_dtype = ZD_BF16;
  config.offload_device = offload;
  config.offload_buffer_count = SLOTS;
  config.offload_buffer_size = CHUNK;
  config.offload_pin_memory = 1;
  zd_job *job = NULL;
  const char *what;
  zd_status st = bench_job_with_unit(daemon_.socket, name, &config, numel, &job, unit, &what);
  if (st != ZD_OK)
    die(what, st);
  return job;
}

static double step_seconds(zd_job *job) {
  double t0 = bench_now_s();
  zd_step_result result = ZD_STEP_RESULT_INIT;
  zd_status st = zd_step(job, NULL, &result);
  if (st != ZD_OK)
    die("step", st);
  return bench_now_s() - t0;
}

/* The serial baseline's buffers: the GPU's gradients and working copy,
 * host master and moments, one page-locked chunk of each kind. */
typedef struct serial_ctx {
  uint64_t numel;
  void *stream;
  float *grad_dev;
  void *working_dev;
  float *master, *m, *v;
  float *grad_host;
  void *working_host;
  zk_pool *pool;
  double cpu_s; /* the last serial run's time in the CPU's updates */
} serial_ctx;

static zk_adam_hparams adamw(int64_t step) {
  return (zk_adam_hparams){.lr = 1e-3,
                           .beta1 = 0.9,
                           .beta2 = 0.999,
                           .eps = 1e-8,
                           .weight_decay = 0.01,
                           .decoupled_weight_decay = 1,
                           .step = step,
                           .grad_scale = 1.0};
}

static void cpu_chunk(serial_ctx *c, const zk_adam_hparams *hp, uint64_t b, uint64_t n) {
  if (zk_adam_step(c->pool, hp, c->master + b, c->m + b, c->v + b, c->grad_host, ZK_F32,
                   c->working_host, ZK_BF16, n) != 0) {
    fprintf(stderr, "bench_offload_gpu: zk_adam_step failed\n");
    exit(1);
  }
}

/* The CPU's part alone: the same chunks' update, no copies (informative:
 * how far the offloaded step is from its floor). */
static double cpu_seconds(serial_ctx *c, int64_t step) {
  zk_adam_hparams hp = adamw(step);
  double t0 = bench_now_s();
  for (uint64_t b = 0; b < c->numel; b += CHUNK)
    cpu_chunk(c, &hp, b, c->numel - b < CHUNK ? c->numel - b : CHUNK);
  return bench_now_s() - t0;
}

static double serial_seconds(serial_ctx *c, int64_t step) {
  zk_adam_hparams hp = adamw(step);
  c->cpu_s = 0;
  double t0 = bench_now_s();
  for (uint64_t b = 0; b < c->numel; b += CHUNK) {
    uint64_t n = c->numel - b < CHUNK ? c->numel - b : CHUNK;
    cuda_check(cu->copy_to_host_async(c->grad_host, c->grad_dev + b, n * 4, c->stream), "down");
    cuda_check(cu->synchronize(c->stream), "synchronize");
    double t1 = bench_now_s();
    cpu_chunk(c, &hp, b, n);
    c->cpu_s += bench_now_s() - t1;
    cuda_check(cu->copy_to_device_async((uint8_t *)c->working_dev + b * 2, c->working_host, n * 2,
                                        c->stream),
               "up");
    cuda_check(cu->synchronize(c->stream), "synchronize");
  }
  return bench_now_s() - t0;
}

static void serial_open(serial_ctx *c, uint64_t numel) {
  c->numel = numel;
  cuda_check(cu->stream_create(&c->stream), "stream_create");
  cuda_check(cu->alloc((void **)&c->grad_dev, numel * 4), "alloc");
  cuda_check(cu->alloc(&c->working_dev, numel * 2), "alloc");
  cuda_check(cu->memset(c->grad_dev, 0, numel * 4), "memset");
  cuda_check(cu->host_alloc((void **)&c->grad_host, CHUNK * 4), "host_alloc");
  cuda_check(cu->host_alloc(&c->working_host, CHUNK * 2), "host_alloc");
  c->master = calloc(numel, 4);
  c->m = calloc(numel, 4);
  c->v = calloc(numel, 4);
  if (c->master == NULL || c->m == NULL || c->v == NULL || zk_pool_create(1, &c->pool) != 0) {
    fprintf(stderr, "bench_offload_gpu: out of memory\n");
    exit(1);
  }
  for (uint64_t i = 0; i < numel; i++)
    c->master[i] = 0.02f * (float)((i % 97) - 48) / 48.0f;
}

static void serial_close(serial_ctx *c) {
  cu->free(c->grad_dev);
  cu->free(c->working_dev);
  cu->host_free(c->grad_host);
  cu->host_free(c->working_host);
  cu->stream_destroy(c->stream);
  free(c->master);
  free(c->m);
  free(c->v);
  zk_pool_destroy(c->pool);
}

static void print_skip(const char *why) {
  printf("{\"bench\":\"offload_gpu\",\"skipped\":\"");
  for (; *why != '\0'; why++)
    if (*why == '"' || *why == '\\')
      printf("\\%c", *why);
    else if ((unsigned char)*why >= 0x20)
      putchar(*why);
  printf("\"}\n");
}

int main(int argc, char **argv) {
  uint64_t numel = (uint64_t)64 << 20;
  int rounds = 7;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--numel") == 0 && i + 1 < argc)
      numel = strtoull(argv[++i], NULL, 10);
    else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc)
      rounds = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [--numel N] [--rounds N]\n", argv[0]);
      return 2;
    }
  }
  if (numel == 0 || rounds < 1 || rounds > 99) {
    fprintf(stderr, "bench_offload_gpu: --numel must be positive, --rounds 1..99\n");
    return 2;
  }
  char why[512] = "";
  if (zk_cuda_load(&cu, why, sizeof why) != 0 || cu->nccl_available(why, sizeof why) != 0) {
    print_skip(why);
    return 0;
  }
  char device[256] = "";
  cuda_check(cu->device_name(0, device, sizeof device), "device_name");
  /* The daemon first: CUDA does not survive a fork, and this process has
   * not touched the GPU yet. */
  if (bench_daemon_start_on(&daemon_, "bench_offload_gpu", "cuda", 1, "4G") != 0)
    return 1;
  cuda_check(cu->set_device(0), "set_device");
  zd_unit unit;
  zd_job *offloaded = make_job("offloaded", ZD_OFFLOAD_CPU, numel, &unit);
  zd_job *on_device = make_job("on-device", ZD_OFFLOAD_DEFAULT, numel, &unit);
  serial_ctx serial = {0};
  serial_open(&serial, numel);

  double t_off[99], t_serial[99], t_serial_cpu[99], t_dev[99], t_cpu[99], ratio[99];
  step_seconds(offloaded); /* warm-up: the staging is made at the first step */
  step_seconds(on_device);
  serial_seconds(&serial, 1);
  for (int r = 0; r < rounds; r++) {
    t_off[r] = step_seconds(offloaded);
    t_serial[r] = serial_seconds(&serial, r + 2);
    t_serial_cpu[r] = serial.cpu_s;
    t_dev[r] = step_seconds(on_device);
    t_cpu[r] = cpu_seconds(&serial, r + 2);
    ratio[r] = t_serial[r] / t_off[r];
  }
  double off = bench_median(t_off, rounds), ser = bench_median(t_serial, rounds);
  double dev = bench_median(t_dev, rounds), overlap = bench_median(ratio, rounds);
  double cpu = bench_median(t_cpu, rounds), serial_cpu = bench_median(t_serial_cpu, rounds);
  printf("{\"bench\":\"offload_gpu_cpu_step\",\"device\":\"%s\",\"numel\":%llu,\"metric\":\"ms\","
         "\"value\":%.2f,\"baseline\":\"serial_copies_and_cpu_adamw\",\"baseline_value\":%.2f,"
         "\"ratio\":%.3f,\"target\":1.0,\"direction\":\"min\",\"met\":%s,"
         "\"cpu_adamw_ms\":%.2f,\"serial_cpu_ms\":%.2f,\"device_step_ms\":%.2f,\"offloaded_over_"
         "device\":%.2f}\n",
         device, (unsigned long long)numel, off * 1e3, ser * 1e3, overlap,
         overlap >= 1.0 ? "true" : "false", cpu * 1e3, serial_cpu * 1e3, dev * 1e3, off / dev);
  fflush(stdout);
  serial_close(&serial);
  bench_daemon_stop(&daemon_);
  return 0;
}
