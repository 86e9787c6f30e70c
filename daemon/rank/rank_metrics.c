/* A job's and its ranks' series (rank_metrics.h). */
#include "rank_metrics.h"

#include <ctype.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base_cache.h"
#include "clock.h"
#include "job.h"

static const char *const rank_labels[] = {"zerod_job", "rank", NULL};

const char *const rank_level_names[COMM_LEVELS] = {"node", "cross", "world"};
_Static_assert(JOB_COUNTER_LEVELS == COMM_LEVELS, "a counter per comm_level");
_Static_assert(JOB_COUNTER_KINDS == RANK_NCOLLECTIVES, "a counter per rank_collective");

const char *const rank_collective_names[RANK_NCOLLECTIVES] = {
    [RANK_ALL_GATHER] = "all_gather",
    [RANK_REDUCE_SCATTER] = "reduce_scatter",
    [RANK_BROADCAST] = "broadcast",
    [RANK_CONTROL] = "control",
};

static metric_series *series(metrics *m, metric_type type, const char *name, const char *help,
                             const char *const *labels, const char *const *values) {
  return metric_series_get(metrics_family(m, type, name, help, labels, NULL, 0), values);
}

static void open_rank(metrics *m, rank_state *rs, rank_series *s, const char *memory) {
  char rank[16];
  snprintf(rank, sizeof rank, "%d", rs->rank);
  const char *const v[] = {rs->job->name, rank, NULL};
  s->steps = series(m, METRIC_COUNTER, "zerod_steps_total", "Optimizer steps the rank completed.",
                    rank_labels, v);
  s->step = series(m, METRIC_GAUGE, "zerod_step",
                   "The rank's completed optimizer steps (a restore sets it to the checkpoint's).",
                   rank_labels, v);
  s->step_seconds = series(m, METRIC_HISTOGRAM, "zerod_step_duration_seconds",
                           "Time from a step request's arrival to its answer (the gradient "
                           "norm's all-reduce, clipping and the optimizer).",
                           rank_labels, v);
  s->gather_seconds = series(m, METRIC_HISTOGRAM, "zerod_gather_duration_seconds",
                             "Time from a gather request's arrival to its answer (queueing, and "
                             "the all-gather unless the unit was cached or prefetched).",
                             rank_labels, v);
  s->reduce_seconds = series(m, METRIC_HISTOGRAM, "zerod_reduce_duration_seconds",
                             "Time from a reduce request's arrival to its answer (queueing and "
                             "the reduce-scatter).",
                             rank_labels, v);
  s->register_seconds =
      series(m, METRIC_HISTOGRAM, "zerod_register_duration_seconds",
             "Time from a unit registration's arrival to its answer.", rank_labels, v);
  s->comm_seconds = series(m, METRIC_COUNTER, "zerod_comm_seconds_total",
                           "Time the rank spent in collectives, at every level.", rank_labels, v);
  s->wait_seconds = series(m, METRIC_COUNTER, "zerod_worker_wait_seconds_total",
                           "Time the rank's worker waited for the daemon's answers: the waits "
                           "it reports with each step, and each step request's own time.",
                           rank_labels, v);
  s->exposed_comm_seconds =
      series(m, METRIC_COUNTER, "zerod_exposed_comm_seconds_total",
             "The communication the worker waited for: its reported waits (gathers, gradient "
             "buffers) and the collectives run while its step requests waited.",
             rank_labels, v);
  static const char *const coll_labels[] = {"zerod_job", "rank", "collective", "level", NULL};
  /* A job on this node alone moves nothing between nodes: its series
   * are the node level's only. */
  for (int level = 0; level < COMM_LEVELS; level++)
    for (int c = 0; c < RANK_NCOLLECTIVES && (level == COMM_LEVEL_NODE || job_spans_nodes(rs->job));
         c++) {
      const char *const cv[] = {rs->job->name, rank, rank_collective_names[c],
                                rank_level_names[level], NULL};
      s->collective_bytes[level][c] =
          series(m, METRIC_COUNTER, "zerod_collective_bytes_total",
                 "Payload bytes of the rank's collectives: the gathered buffer of a unit's "
                 "all-gather, the gradients' input of a reduce-scatter, the values of a "
                 "broadcast; control: the small host collectives (layouts, step counts, norms).",
                 coll_labels, cv);
      s->collectives[level][c] = series(m, METRIC_COUNTER, "zerod_collectives_total",
                                        "Collectives the rank ran.", coll_labels, cv);
    }
  static const char *const mem_labels[] = {"zerod_job", "rank", "memory", NULL};
  const char *const mv[] = {rs->job->name, rank, memory, NULL};
  s->shard_bytes = series(m, METRIC_GAUGE, "zerod_shard_bytes",
                          "Bytes of the rank's shards (master weights, optimizer moments, "
                          "gradient accumulators, working copies), by the memory that holds them.",
                          mem_labels, mv);
  /* offload_optimizer nvme: what lives in the rank's tier file. */
  const char *const nv[] = {rs->job->name, rank, "nvme", NULL};
  s->tier_bytes = series(m, METRIC_GAUGE, "zerod_shard_bytes",
                         "Bytes of the rank's shards (master weights, optimizer moments, "
                         "gradient accumulators, working copies), by the memory that holds them.",
                         mem_labels, nv);
  /* offload_optimizer cpu on a GPU rank: what lives in host memory. */
  const char *const hv[] = {rs->job->name, rank, "host", NULL};
  s->host_state_bytes = strcmp(memory, "host") != 0
                            ? series(m, METRIC_GAUGE, "zerod_shard_bytes",
                                     "Bytes of the rank's shards (master weights, optimizer "
                                     "moments, gradient accumulators, working copies), by the "
                                     "memory that holds them.",
                                     mem_labels, hv)
                            : NULL;
  s->pool_bytes =
      series(m, METRIC_GAUGE, "zerod_buffer_bytes",
             "Bytes of the rank's gathered and gradient buffers and hpZ secondary partitions, "
             "live or cached.",
             mem_labels, mv);
  s->secondary_bytes = series(m, METRIC_GAUGE, "zerod_hpz_secondary_bytes",
                              "Bytes of the rank's ZeRO++ hpZ secondary partitions (part of "
                              "zerod_buffer_bytes).",
                              mem_labels, mv);
  s->live_bytes = series(m, METRIC_GAUGE, "zerod_live_gathered_bytes",
                         "Bytes of the rank's buffers a worker holds now (the job's "
                         "max_live_bytes bounds them).",
                         rank_labels, v);
  s->queue_depth = series(m, METRIC_GAUGE, "zerod_queue_depth",
                          "Requests queued or running on the rank's executor.", rank_labels, v);
  s->attached =
      series(m, METRIC_GAUGE, "zerod_worker_attached",
             "1 while a read-write worker session is attached to the rank.", rank_labels, v);
  s->ckpt_write_seconds =
      series(m, METRIC_HISTOGRAM, "zerod_checkpoint_write_duration_seconds",
             "Time to write and sync the rank's shard file of a checkpoint.", rank_labels, v);
  s->ckpt_stall_seconds = series(m, METRIC_HISTOGRAM, "zerod_checkpoint_stall_seconds",
                                 "Time a save's copy held up the rank's step.", rank_labels, v);
  s->ckpt_bytes = series(m, METRIC_COUNTER, "zerod_checkpoint_written_bytes_total",
                         "Bytes of shard files the rank wrote for checkpoints.", rank_labels, v);
  s->replica_seconds =
      series(m, METRIC_HISTOGRAM, "zerod_replica_copy_seconds",
             "Time a step waited for the rank's in-memory copy: written, sent to the buddy node "
             "and agreed by every rank (redundancy).",
             rank_labels, v);
  s->replica_bytes = series(m, METRIC_GAUGE, "zerod_replica_bytes",
                            "Bytes of the rank's newest in-memory copy (held twice: on its node "
                            "and on the buddy node).",
                            rank_labels, v);
  s->replica_step = series(m, METRIC_GAUGE, "zerod_replica_step",
                           "Step of the job's newest complete in-memory copy.", rank_labels, v);
  s->pin_snapshot_bytes =
      series(m, METRIC_COUNTER, "zerod_pin_snapshot_bytes_total",
             "Bytes the rank copied out of its working copies into versions that read-only "
             "sessions (subscribers) had pinned, before overwriting them (copy on write).",
             rank_labels, v);
  static const char *const err_labels[] = {"zerod_job", "rank", "code", NULL};
  s->errors = metrics_family(m, METRIC_COUNTER, "zerod_request_errors_total",
                             "Worker requests to the rank answered with an error, by status code.",
                             err_labels, NULL, 0);
}

static void close_rank(rank_series *s) {
  metric_series *all[] = {s->steps,
                          s->step,
                          s->step_seconds,
                          s->gather_seconds,
                          s->reduce_seconds,
                          s->register_seconds,
                          s->shard_bytes,
                          s->tier_bytes,
                          s->host_state_bytes,
                          s->pool_bytes,
                          s->secondary_bytes,
                          s->live_bytes,
                          s->queue_depth,
                          s->attached,
                          s->ckpt_write_seconds,
                          s->ckpt_stall_seconds,
                          s->ckpt_bytes,
                          s->replica_seconds,
                          s->replica_bytes,
                          s->replica_step,
                          s->pin_snapshot_bytes};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    metric_series_put(all[i]);
  for (int level = 0; level < COMM_LEVELS; level++)
    for (int c = 0; c < RANK_NCOLLECTIVES; c++) {
      metric_series_put(s->collective_bytes[level][c]);
      metric_series_put(s->collectives[level][c]);
    }
  for (int c = 0; c < RANK_METRICS_CODES; c++)
    metric_series_put(atomic_load(&s->error_series[c]));
  free(s);
}

void rank_metrics_open(job *j, metrics *m, const char *memory) {
  if (m == NULL)
    return;
  static const char *const job_labels[] = {"zerod_job", NULL};
  const char *const v[] = {j->name, NULL};
  if ((j->metrics = calloc(1, sizeof *j->metrics)) == NULL)
    return;
  j->metrics->readers =
      series(m, METRIC_GAUGE, "zerod_read_only_sessions",
             "Read-only sessions attached to the job on this node.", job_labels, v);
  for (int r = 0; r < j->nranks; r++) {
    rank_state *rs = &j->ranks[r];
    if ((rs->metrics = calloc(1, sizeof *rs->metrics)) != NULL)
      open_rank(m, rs, rs->metrics, memory);
  }
}

/* Makes a base's series on its first scrape. */
static void open_base(job_series *s, metrics *m, const char *name) {
  static const char *const base_labels[] = {"zerod_base", NULL};
  static const char *const lookup_labels[] = {"zerod_base", "result", NULL};
  const char *const v[] = {name, NULL};
  const char *const hit[] = {name, "hit", NULL}, *const miss[] = {name, "miss", NULL};
  static const char lookups_help[] =
      "First gathers of this base's units by a rank that found the unit in the node's base "
      "cache (hit) or not (miss).";
  s->base_jobs = series(m, METRIC_GAUGE, "zerod_base_jobs",
                        "Jobs on this base (a frozen job) on this node.", base_labels, v);
  s->base_cached_bytes =
      series(m, METRIC_GAUGE, "zerod_base_cached_bytes",
             "Bytes of this base's gathered units in the node's base cache.", base_labels, v);
  s->base_hits =
      series(m, METRIC_COUNTER, "zerod_base_lookups_total", lookups_help, lookup_labels, hit);
  s->base_misses =
      series(m, METRIC_COUNTER, "zerod_base_lookups_total", lookups_help, lookup_labels, miss);
  s->base_evictions = series(
      m, METRIC_COUNTER, "zerod_base_evictions_total",
      "This base's gathered units the node's base cache let go for its budget.", base_labels, v);
}

void rank_metrics_base(job *j, metrics *m, int jobs, const base_cache_stats *cache) {
  job_series *s = j->metrics;
  if (s == NULL || m == NULL)
    return;
  if (s->base_jobs == NULL)
    open_base(s, m, j->name);
  metric_set(s->base_jobs, jobs);
  metric_set(s->base_cached_bytes, (double)cache->bytes);
  metric_add(s->base_hits, (double)(cache->hits - s->base_seen_hits));
  metric_add(s->base_misses, (double)(cache->misses - s->base_seen_misses));
  metric_add(s->base_evictions, (double)(cache->evictions - s->base_seen_evictions));
  s->base_seen_hits = cache->hits;
  s->base_seen_misses = cache->misses;
  s->base_seen_evictions = cache->evictions;
}

void rank_metrics_close(job *j) {
  if (j->metrics != NULL) {
    metric_series_put(j->metrics->readers);
    metric_series_put(j->metrics->base_jobs);
    metric_series_put(j->metrics->base_cached_bytes);
    metric_series_put(j->metrics->base_hits);
    metric_series_put(j->metrics->base_misses);
    metric_series_put(j->metrics->base_evictions);
  }
  free(j->metrics);
  j->metrics = NULL;
  for (int r = 0; r < j->nranks; r++) {
    if (j->ranks[r].metrics != NULL)
      close_rank(j->ranks[r].metrics);
    j->ranks[r].metrics = NULL;
  }
}

/* "STATUS_INVALID_ARGUMENT" -> "invalid_argument". */
static void code_name(int status, char *out, size_t out_bytes) {
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value(&zerod__v1__status__descriptor, status);
  const char *name = v != NULL ? v->name : "unknown";
  if (strncmp(name, "STATUS_", 7) == 0)
    name += 7;
  size_t i = 0;
  for (; name[i] != '\0' && i + 1 < out_bytes; i++)
    out[i] = (char)tolower((unsigned char)name[i]);
  out[i] = '\0';
}

static void count_error(rank_state *rs, int status) {
  rank_series *s = rs->metrics;
  if (s->errors == NULL || status < 0 || status >= RANK_METRICS_CODES)
    return;
  metric_series *e = atomic_load(&s->error_series[status]);
  if (e == NULL) {
    char rank[16], code[48];
    snprintf(rank, sizeof rank, "%d", rs->rank);
    code_name(status, code, sizeof code);
    const char *const v[] = {rs->job->name, rank, code, NULL};
    metric_series *made = metric_series_get(s->errors, v);
    if (made == NULL)
      return;
    /* Another thread may have made it first: theirs is kept. */
    if (atomic_compare_exchange_strong(&s->error_series[status], &e, made))
      e = made;
    else
      metric_series_put(made);
  }
  metric_add(e, 1);
}

void rank_metrics_op(rank_state *rs, rank_timer timer, int status, double made_at) {
  if (rs == NULL || rs->metrics == NULL)
    return;
  rank_series *s = rs->metrics;
  if (status != ZEROD__V1__STATUS__STATUS_OK) {
    count_error(rs, status);
    return;
  }
  metric_series *h = NULL;
  switch (timer) {
  case RANK_GATHER:
    h = s->gather_seconds;
    break;
  case RANK_REDUCE:
    h = s->reduce_seconds;
    break;
  case RANK_STEP:
    h = s->step_seconds;
    metric_add(s->steps, 1);
    break;
  case RANK_REGISTER:
    h = s->register_seconds;
    break;
  case RANK_UNTIMED:
    return;
  }
  metric_observe(h, clock_now_s() - made_at);
}

void rank_metrics_waits_reset(rank_state *rs) {
  rs->waits_since_ns = clock_now_ns();
}

void rank_metrics_step_waits(rank_state *rs, uint64_t worker_wait_ns, double made_at,
                             uint64_t comm_busy_at) {
  const uint64_t now = clock_now_ns();
  const uint64_t arrived = (uint64_t)(made_at * 1e9);
  /* The worker's figure is its own word: no more than the time since its
   * attach or its last step's answer up to this request. */
  const uint64_t could = arrived > rs->waits_since_ns ? arrived - rs->waits_since_ns : 0;
  if (worker_wait_ns > could)
    worker_wait_ns = could;
  const uint64_t busy = comm_activity_busy_ns(&rs->activity, now);
  const uint64_t in_step = busy > comm_busy_at ? busy - comm_busy_at : 0;
  const uint64_t step_ns = now > arrived ? now - arrived : 0;
  atomic_fetch_add_explicit(&rs->stat_wait_ns, worker_wait_ns + step_ns, memory_order_relaxed);
  atomic_fetch_add_explicit(&rs->stat_exposed_comm_ns, worker_wait_ns + in_step,
                            memory_order_relaxed);
  rs->waits_since_ns = now;
  rank_series *s = rs->metrics;
  if (s == NULL)
    return;
  metric_set(s->wait_seconds, (double)atomic_load(&rs->stat_wait_ns) / 1e9);
  metric_set(s->exposed_comm_seconds, (double)atomic_load(&rs->stat_exposed_comm_ns) / 1e9);
}

void rank_metrics_state(rank_state *rs) {
  atomic_store_explicit(&rs->stat_pool_bytes, rs->pool_bytes, memory_order_relaxed);
  atomic_store_explicit(&rs->stat_secondary_bytes, rs->secondary_bytes, memory_order_relaxed);
  atomic_store_explicit(&rs->stat_state_bytes, rs->state_bytes, memory_order_relaxed);
  atomic_store_explicit(&rs->stat_tier_bytes, rs->tier_bytes, memory_order_relaxed);
  atomic_store_explicit(&rs->stat_host_state_bytes, rs->host_state_bytes, memory_order_relaxed);
  rank_series *s = rs->metrics;
  if (s == NULL)
    return;
  metric_set(s->step, (double)atomic_load(&rs->step));
  metric_set(s->shard_bytes, (double)rs->state_bytes);
  metric_set(s->tier_bytes, (double)rs->tier_bytes);
  if (s->host_state_bytes != NULL)
    metric_set(s->host_state_bytes, (double)rs->host_state_bytes);
  metric_set(s->pool_bytes, (double)rs->pool_bytes);
  metric_set(s->secondary_bytes, (double)rs->secondary_bytes);
  metric_set(s->live_bytes, (double)rs->live_bytes);
  metric_set(s->comm_seconds, (double)comm_activity_busy_ns(&rs->activity, clock_now_ns()) / 1e9);
}

void rank_metrics_collective(rank_state *rs, rank_collective which) {
  uint64_t bytes[COMM_LEVELS];
  comm_take_bytes(rs->comm, bytes);
  for (int level = 0; level < COMM_LEVELS; level++) {
    if (bytes[level] == 0)
      continue;
    atomic_fetch_add_explicit(&rs->coll_bytes[level][which], bytes[level], memory_order_relaxed);
    atomic_fetch_add_explicit(&rs->coll_calls[level][which], 1, memory_order_relaxed);
    if (rs->metrics != NULL) {
      metric_add(rs->metrics->collective_bytes[level][which], (double)bytes[level]);
      metric_add(rs->metrics->collectives[level][which], 1);
    }
  }
}

void rank_metrics_ckpt_written(rank_state *rs, double seconds, uint64_t bytes) {
  if (rs->metrics == NULL)
    return;
  metric_observe(rs->metrics->ckpt_write_seconds, seconds);
  metric_add(rs->metrics->ckpt_bytes, (double)bytes);
}

void rank_metrics_pin_snapshot(rank_state *rs, uint64_t bytes) {
  if (rs->metrics != NULL)
    metric_add(rs->metrics->pin_snapshot_bytes, (double)bytes);
}

void rank_metrics_ckpt_stall(rank_state *rs, double seconds) {
  if (rs->metrics != NULL)
    metric_observe(rs->metrics->ckpt_stall_seconds, seconds);
}

void rank_metrics_replica(rank_state *rs, double seconds, uint64_t bytes, uint64_t step) {
  if (rs->metrics == NULL)
    return;
  metric_observe(rs->metrics->replica_seconds, seconds);
  metric_set(rs->metrics->replica_bytes, (double)bytes);
  if (step != 0)
    metric_set(rs->metrics->replica_step, (double)step);
}

void rank_metrics_loop(job *j) {
  if (j->metrics != NULL)
    metric_set(j->metrics->readers, j->readers);
  for (int r = 0; r < j->nranks; r++) {
    rank_state *rs = &j->ranks[r];
    if (rs->metrics == NULL)
      continue;
    metric_set(rs->metrics->queue_depth, atomic_load(&rs->busy));
    metric_set(rs->metrics->attached, rs->session != NULL);
  }
}
