/* rank_metrics: a job's and its ranks' Prometheus series (metrics.h;
 * their names and meaning are listed in docs/operations.md, "Metrics").
 *
 * Labels: zerod_job (the job's name: Prometheus keeps `job` for the scrape
 * job) and rank (the global rank). The job's owner makes the series after
 * job_create and drops them before job_destroy (node/jobs.c), so a job's
 * figures leave the exposition when the job leaves the node. A job
 * without series (metrics off, or out of memory) is fine: every function
 * here then does nothing.
 *
 * Threads: rank_metrics_op and rank_metrics_collective update atomics and
 * run on any thread; rank_metrics_state reads the rank's executor-owned
 * fields and runs where the rank's state is (its executor, or the loop
 * while the executor is idle); rank_metrics_loop reads loop-owned fields. */
#ifndef ZEROD_RANK_METRICS_H
#define ZEROD_RANK_METRICS_H

#include <stdint.h>

#include "comm.h"
#include "metrics.h"

struct rank_state;
struct job;

/* Status codes counted by name (Zerod__V1__Status values below this). */
#define RANK_METRICS_CODES 16

typedef enum rank_collective {
  RANK_ALL_GATHER,
  RANK_REDUCE_SCATTER,
  RANK_BROADCAST,   /* initial values, loads */
  RANK_CONTROL,     /* small host collectives: layouts, step counts, norms */
  RANK_NCOLLECTIVES /* == JOB_COUNTER_KINDS */
} rank_collective;

/* The names of the kinds and levels, for STATS and the metrics' labels. */
extern const char *const rank_collective_names[RANK_NCOLLECTIVES];
extern const char *const rank_level_names[COMM_LEVELS];

/* The ops whose latency has a histogram. */
typedef enum rank_timer {
  RANK_UNTIMED,
  RANK_GATHER,
  RANK_REDUCE,
  RANK_STEP,
  RANK_REGISTER, /* registrations and loads */
} rank_timer;

typedef struct rank_series {
  metric_series *steps, *step;
  metric_series *step_seconds, *gather_seconds, *reduce_seconds, *register_seconds;
  metric_series *collective_bytes[COMM_LEVELS][RANK_NCOLLECTIVES];
  metric_series *collectives[COMM_LEVELS][RANK_NCOLLECTIVES];
  metric_series *shard_bytes, *tier_bytes, *host_state_bytes, *pool_bytes, *secondary_bytes,
      *live_bytes, *queue_depth, *attached;
  metric_series *ckpt_write_seconds, *ckpt_stall_seconds, *ckpt_bytes;
  metric_series *replica_seconds, *replica_bytes, *replica_step;
  metric_series *pin_snapshot_bytes;
  metric_series *comm_seconds, *wait_seconds, *exposed_comm_seconds;
  /* Errors by status code, made on first use by whichever thread answers
   * one. */
  metric_family *errors;
  _Atomic(metric_series *) error_series[RANK_METRICS_CODES];
} rank_series;

typedef struct job_series {
  metric_series *readers;
  /* A base's (made when it is first seen frozen): the jobs on it on this
   * node, the bytes of its units in the node's base cache, and that
   * cache's lookups and evictions of its units, with the counts at the
   * last scrape (the counters grow by what they grew since). */
  metric_series *base_jobs, *base_cached_bytes, *base_hits, *base_misses, *base_evictions;
  uint64_t base_seen_hits, base_seen_misses, base_seen_evictions;
} job_series;

/* Makes the series of a job and of all its ranks in m (none when m is
 * NULL); memory: where the ranks' shards are, "host" or "device". Before
 * the ranks start. rank_metrics_close drops them, after they stopped. */
void rank_metrics_open(struct job *j, metrics *m, const char *memory);
void rank_metrics_close(struct job *j);

/* An op is answered with status: its latency since made_at (clock_now_s)
 * if it succeeded and has a timer (a step counts one step), else its
 * error by code. */
void rank_metrics_op(struct rank_state *rs, rank_timer timer, int status, double made_at);
/* Exposed communication (docs/daemon.md): a worker attached (its waits
 * count from now), and a step request made at made_at (clock_now_s), when
 * the rank's collectives had taken comm_busy_at ns (comm_activity_busy_ns),
 * was answered; its worker reported waiting worker_wait_ns since its
 * previous step (at most the time since then is believed). Executor. */
void rank_metrics_waits_reset(struct rank_state *rs);
void rank_metrics_step_waits(struct rank_state *rs, uint64_t worker_wait_ns, double made_at,
                             uint64_t comm_busy_at);
/* After an op: the gauges that follow the rank's own state. */
void rank_metrics_state(struct rank_state *rs);
/* A collective of the rank of kind `which` has returned: the bytes its
 * communicator moved for it (comm_take_bytes, by level) go into the
 * rank's counters (STATS), and into its series when metrics are on. */
void rank_metrics_collective(struct rank_state *rs, rank_collective which);
/* A checkpoint's shard file was written (the node's shard writer). */
void rank_metrics_ckpt_written(struct rank_state *rs, double seconds, uint64_t bytes);
/* A save's copy stalled the rank's steps this long. */
void rank_metrics_ckpt_stall(struct rank_state *rs, double seconds);
/* An in-memory copy (rank/replicate.c): how long the step waited for it,
 * the bytes of the rank's file, and the step of its newest complete one. */
void rank_metrics_replica(struct rank_state *rs, double seconds, uint64_t bytes, uint64_t step);
/* The rank copied bytes of its working slices into a pinned version before
 * overwriting it (pin.c: copy on write for read-only sessions). */
void rank_metrics_pin_snapshot(struct rank_state *rs, uint64_t bytes);
/* Loop thread: queue depth, sessions. */
void rank_metrics_loop(struct job *j);
/* Loop thread, for a frozen job (a base): its figures (rank_series' base
 * series, made on the first call). */
struct base_cache_stats;
void rank_metrics_base(struct job *j, metrics *m, int jobs, const struct base_cache_stats *cache);

#endif /* ZEROD_RANK_METRICS_H */
