/* bench_comm - zerod's Gloo collectives against raw Gloo, and its local
 * collectives (ranks that are threads of one process, comm_local.c)
 * against memcpy, measured in the same run on the same machine.
 *
 * The local all-gather of a 64 MiB unit between 2 ranks is compared with
 * one memcpy of the same 64 MiB on one thread (the target: at least 0.7x
 * of it), as the daemon runs it: in place, each rank's slice already in its
 * gathered buffer.
 *
 * The all-gather of one unit (64 MiB gathered, over 2 ranks by default) is
 * compared with gloo_raw_allgather, Gloo's own all-gather called directly
 * (gloo_raw.cc): our wrapper should cost nothing measurable. The ring
 * reduce-scatter moves the same bytes over the wire as an all-gather whose
 * per-rank slice is one shard, so that all-gather is its baseline; the
 * difference is the fp32 sum and the segment pipelining. Ranks are threads of
 * this process talking over TCP loopback, as the daemon hosts them. A round
 * measures each of them once: the median over the timed calls on rank 0,
 * each call after a barrier, following two warm-up calls. The rounds
 * interleave the baseline with our calls so that a noisy neighbour slows
 * both alike, and each figure is the median over the rounds. Output: one
 * JSON object per line (docs/benchmarks.md).
 *
 * Usage: bench_comm [--unit-mib N] [--world N] [--iters N] [--rounds N]
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "comm.h"
#include "gloo_raw.h"
#include "store.h"

#define MAX_WORLD     8
#define WARMUP_CALLS  2
#define MAX_ITERS     1000
#define MAX_ROUNDS    99
#define BENCH_TIMEOUT 120000

typedef enum bench_op { OP_ALL_GATHER, OP_ALL_GATHER_IN_PLACE, OP_REDUCE_SCATTER } bench_op;

typedef struct bench_run {
  store *st;
  comm_local_group *group; /* the local backend's; NULL: Gloo */
  const char *prefix;
  int world;
  int iters;
  bench_op op;
  size_t bytes_per_rank; /* all-gather slice, or reduce-scatter shard bytes */
} bench_run;

typedef struct bench_rank {
  bench_run *run;
  int rank;
  double seconds[MAX_ITERS];
  int error;
} bench_rank;

static void *alloc_pages(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 4096, bytes) != 0) {
    fprintf(stderr, "bench_comm: cannot allocate %zu bytes\n", bytes);
    exit(1);
  }
  memset(p, 1, bytes); /* fault the pages in before timing */
  return p;
}

static int run_op(comm *c, const bench_run *run, void *send, void *gathered) {
  const size_t n = run->bytes_per_rank;
  switch (run->op) {
  case OP_ALL_GATHER:
    return comm_all_gather(c, send, gathered, n);
  case OP_ALL_GATHER_IN_PLACE:
    return comm_all_gather(c, (char *)gathered + (size_t)comm_rank(c) * n, gathered, n);
  case OP_REDUCE_SCATTER:
    /* The input is clobbered call after call; its values only double, so
     * they never become subnormal and the timing stays honest. */
    return comm_reduce_scatter_f32(c, gathered, send, n / sizeof(float));
  }
  return -EINVAL;
}

static void *rank_main(void *arg) {
  bench_rank *br = arg;
  const bench_run *run = br->run;
  comm_options options = {.prefix = run->prefix,
                          .rank = br->rank,
                          .world_size = run->world,
                          .timeout_ms = BENCH_TIMEOUT};
  char err[256];
  comm *c = NULL;
  br->error = run->group != NULL ? comm_local_create(&options, run->group, &c, err, sizeof err)
                                 : comm_gloo_create(&options, run->st, &c, err, sizeof err);
  if (br->error != 0) {
    fprintf(stderr, "bench_comm: rank %d: %s\n", br->rank, err);
    return NULL;
  }
  /* gathered holds every rank's slice (or the reduce-scatter input); send
   * holds one slice (or the reduce-scatter output shard). */
  const size_t gathered_bytes = run->bytes_per_rank * (size_t)run->world;
  float *gathered = alloc_pages(gathered_bytes);
  float *send = alloc_pages(run->bytes_per_rank);
  for (size_t i = 0; i < gathered_bytes / sizeof(float); i++)
    gathered[i] = 1.0f;
  for (int call = 0; call < WARMUP_CALLS + run->iters && br->error == 0; call++) {
    br->error = comm_barrier(c);
    if (br->error != 0)
      break;
    double t0 = bench_now_s();
    br->error = run_op(c, run, send, gathered);
    double took = bench_now_s() - t0;
    if (call >= WARMUP_CALLS)
      br->seconds[call - WARMUP_CALLS] = took;
  }
  if (br->error != 0)
    fprintf(stderr, "bench_comm: rank %d: %s\n", br->rank, comm_last_error(c));
  else
    br->error = comm_barrier(c);
  comm_destroy(c);
  free(gathered);
  free(send);
  return NULL;
}

/* Runs one benchmark on `world` rank threads; returns the median seconds
 * per call on rank 0, or a negative value on failure. */
static double measure(bench_op op, bool local, size_t bytes_per_rank, int world, int iters) {
  static int run_id;
  char prefix[64];
  snprintf(prefix, sizeof prefix, "bench/%d", run_id++);
  bench_run run = {
      .prefix = prefix, .world = world, .iters = iters, .op = op, .bytes_per_rank = bytes_per_rank};
  if (store_mem_create(&run.st) != 0)
    return -1.0;
  if (local && comm_local_group_create(world, &run.group) != 0)
    return -1.0;
  bench_rank ranks[MAX_WORLD];
  pthread_t threads[MAX_WORLD];
  for (int r = 0; r < world; r++) {
    ranks[r] = (bench_rank){.run = &run, .rank = r};
    if (pthread_create(&threads[r], NULL, rank_main, &ranks[r]) != 0) {
      fprintf(stderr, "bench_comm: cannot start rank %d\n", r);
      exit(1);
    }
  }
  bool failed = false;
  for (int r = 0; r < world; r++) {
    pthread_join(threads[r], NULL);
    failed |= ranks[r].error != 0;
  }
  run.st->ops->destroy(run.st);
  comm_local_group_unref(run.group);
  return failed ? -1.0 : bench_median(ranks[0].seconds, iters);
}

/* The baseline of the local collectives: one memcpy of `bytes` on this
 * thread, both buffers faulted in; the median over iters calls. */
static double measure_memcpy(size_t bytes, int iters) {
  void *from = alloc_pages(bytes), *to = alloc_pages(bytes);
  double seconds[MAX_ITERS];
  for (int call = 0; call < WARMUP_CALLS + iters; call++) {
    double t0 = bench_now_s();
    memcpy(to, from, bytes);
    double took = bench_now_s() - t0;
    if (call >= WARMUP_CALLS)
      seconds[call - WARMUP_CALLS] = took;
  }
  /* Keep the copy from being optimised away. */
  volatile unsigned char sink = ((unsigned char *)to)[bytes / 2];
  (void)sink;
  free(from);
  free(to);
  return bench_median(seconds, iters);
}

static void print_ratio(const char *bench, int world, size_t bytes_per_rank, double value,
                        const char *baseline, double baseline_value, double target) {
  printf("{\"bench\":\"%s\",\"world\":%d,\"bytes_per_rank\":%zu,\"metric\":\"GB/s\","
         "\"value\":%.2f,\"baseline\":\"%s\",\"baseline_value\":%.2f,\"ratio\":%.3f",
         bench, world, bytes_per_rank, value, baseline, baseline_value, value / baseline_value);
  if (target > 0)
    printf(",\"target\":%.2f", target);
  printf("}\n");
  fflush(stdout);
}

int main(int argc, char **argv) {
  size_t unit_mib = 64;
  int world = 2, iters = 11, rounds = 5;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--unit-mib") == 0 && i + 1 < argc)
      unit_mib = strtoull(argv[++i], NULL, 10);
    else if (strcmp(argv[i], "--world") == 0 && i + 1 < argc)
      world = atoi(argv[++i]);
    else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
      iters = atoi(argv[++i]);
    else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc)
      rounds = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [--unit-mib N] [--world N] [--iters N] [--rounds N]\n", argv[0]);
      return 2;
    }
  }
  if (unit_mib == 0 || world < 2 || world > MAX_WORLD || iters < 1 || iters > MAX_ITERS ||
      rounds < 1 || rounds > MAX_ROUNDS) {
    fprintf(stderr,
            "bench_comm: need --unit-mib > 0, --world in [2, %d], --iters in [1, %d], "
            "--rounds in [1, %d]\n",
            MAX_WORLD, MAX_ITERS, MAX_ROUNDS);
    return 2;
  }
  /* A peer's death must be an error code, not SIGPIPE (see comm_gloo.cc). */
  signal(SIGPIPE, SIG_IGN);

  /* The unit is what one all-gather assembles: each rank holds 1/world of
   * it, rounded down to whole floats so the reduce-scatter can use it. */
  const size_t unit_bytes = unit_mib << 20;
  const size_t bytes_per_rank = unit_bytes / (size_t)world / sizeof(float) * sizeof(float);
  const double gathered_bytes = (double)bytes_per_rank * world;

  double raw_s[MAX_ROUNDS], ours_s[MAX_ROUNDS], in_place_s[MAX_ROUNDS], scatter_s[MAX_ROUNDS];
  double memcpy_s[MAX_ROUNDS], local_s[MAX_ROUNDS], local_scatter_s[MAX_ROUNDS];
  for (int round = 0; round < rounds; round++) {
    /* Odd rounds run the baseline second, so that neither side always runs
     * on a machine just woken (or just heated) by the other. */
    if (round % 2 == 1)
      ours_s[round] = measure(OP_ALL_GATHER, false, bytes_per_rank, world, iters);
    if (gloo_raw_allgather(bytes_per_rank, world, iters, &raw_s[round]) != 0)
      return 1;
    if (round % 2 == 0)
      ours_s[round] = measure(OP_ALL_GATHER, false, bytes_per_rank, world, iters);
    in_place_s[round] = measure(OP_ALL_GATHER_IN_PLACE, false, bytes_per_rank, world, iters);
    scatter_s[round] = measure(OP_REDUCE_SCATTER, false, bytes_per_rank, world, iters);
    if (round % 2 == 1)
      local_s[round] = measure(OP_ALL_GATHER_IN_PLACE, true, bytes_per_rank, world, iters);
    memcpy_s[round] = measure_memcpy(bytes_per_rank * (size_t)world, iters);
    if (round % 2 == 0)
      local_s[round] = measure(OP_ALL_GATHER_IN_PLACE, true, bytes_per_rank, world, iters);
    local_scatter_s[round] = measure(OP_REDUCE_SCATTER, true, bytes_per_rank, world, iters);
    if (ours_s[round] < 0 || in_place_s[round] < 0 || scatter_s[round] < 0 || local_s[round] < 0 ||
        local_scatter_s[round] < 0)
      return 1;
  }
  const double t_raw = bench_median(raw_s, rounds);
  const double t_ours = bench_median(ours_s, rounds);
  const double t_in_place = bench_median(in_place_s, rounds);
  const double t_scatter = bench_median(scatter_s, rounds);

  const double raw_gbs = gathered_bytes / t_raw / 1e9;
  print_ratio("comm_all_gather", world, bytes_per_rank, gathered_bytes / t_ours / 1e9,
              "gloo_raw_allgather", raw_gbs, 0.9);
  print_ratio("comm_all_gather_in_place", world, bytes_per_rank, gathered_bytes / t_in_place / 1e9,
              "gloo_raw_allgather", raw_gbs, 0.9);
  /* Reduce-scatter of the unit: the bytes per rank are the whole fp32
   * input, the same count the baseline all-gather assembles. */
  print_ratio("comm_reduce_scatter_f32", world, bytes_per_rank, gathered_bytes / t_scatter / 1e9,
              "gloo_raw_allgather", raw_gbs, 0.0);
  const double memcpy_gbs = gathered_bytes / bench_median(memcpy_s, rounds) / 1e9;
  print_ratio("comm_local_all_gather_in_place", world, bytes_per_rank,
              gathered_bytes / bench_median(local_s, rounds) / 1e9, "memcpy", memcpy_gbs, 0.7);
  print_ratio("comm_local_reduce_scatter_f32", world, bytes_per_rank,
              gathered_bytes / bench_median(local_scatter_s, rounds) / 1e9, "memcpy", memcpy_gbs,
              0.0);
  print_ratio("comm_local_all_gather_in_place", world, bytes_per_rank,
              gathered_bytes / bench_median(local_s, rounds) / 1e9, "comm_all_gather_in_place",
              gathered_bytes / t_in_place / 1e9, 0.0);
  return 0;
}
