/* The node daemon's process-wide state, owned by the loop thread. */
#ifndef ZEROD_DAEMON_H
#define ZEROD_DAEMON_H

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "exec.h"
#include "rpc.h"
#include "job.h"
#include "metrics.h"
#include "reader.h"
#include "store.h"

typedef struct daemon_options {
  char dir[PATH_MAX];         /* state directory (lock file, default socket) */
  char socket_path[PATH_MAX]; /* IPC socket */
  char socket_group[64];      /* "" : mode 0600; else mode 0660, this group */
  int ranks;                  /* standalone: a created job's default; node: the most */
  int max_ranks;              /* standalone: the most ranks of one job (node: ranks) */
  char device[8];             /* "cpu" or "cuda": where the ranks' shards live (resolved
                                 from --device auto at start) */
  int threads_per_rank;
  int collective_timeout_ms;
  uint64_t max_live_bytes;   /* default per-job gathered + gradient bytes per rank */
  uint64_t base_cache_bytes; /* --base-cache-bytes (base_cache.h) */
  int max_sessions;
  int max_pinned_versions; /* per job, read-only sessions' pins (pin.h) */
  /* zerod node: the coordinator to join ("" in standalone mode), this
   * node's name and the address its ranks listen on for collectives. */
  char coordinator[256];
  char node_name[65];
  char comm_host[256];
  /* zerod node: how it reaches the coordinator (docs/security.md): tls
   * when use_tls (rpc_client_credentials); token "": none. */
  int use_tls;
  rpc_tls tls;
  char token[RPC_MAX_TOKEN_BYTES + 1];
} daemon_options;

struct session;
struct cluster_agent;

typedef struct daemon {
  uv_loop_t *loop;
  daemon_options options;
  store *rendezvous;
  job *jobs;
  job *retired; /* deleted jobs, executors stopping: freed by jobs_reap, or at exit */
  uint64_t next_job_id;

  int listen_fd;
  uv_poll_t listen_poll;
  int lock_fd;
  struct session *sessions;
  int nsessions;
  uint64_t next_session_id;

  /* Ops finished by executors, drained by the loop (completion_async). */
  pthread_mutex_t completion_mutex;
  exec_op *completion_head, *completion_tail;
  _Atomic int executors_stopped; /* an executor exited since the last drain */
  /* How every job's ranks run and report (exec.h); the jobs point to it. */
  exec_settings exec;
  /* How read-only sessions' readers run and report (reader.h). */
  reader_env readers;
  uv_async_t completion_async;
  /* Checkpoint progress from executors and shard writers: a heartbeat at
   * once (ckpt_node.c). */
  uv_async_t ckpt_async;
  _Atomic int ckpt_async_ready;
  void (*ckpt_progress)(struct daemon *d); /* on the loop, after ckpt_async */
  /* Workers' own checkpoint calls (ckpt_call.c): the running ones, and
   * their threads' wakeup. */
  struct ckpt_call *worker_calls;
  uv_async_t worker_calls_async;
  int worker_calls_ready, worker_calls_stopping;

  /* The coordinator client (zerod node, and zerod standalone, whose
   * coordinator runs in this process: coord, serving control_server). */
  struct cluster_agent *cluster;
  /* zerod node: its in-memory copies and their server (replica.h); NULL
   * in zerod standalone. */
  struct replica_node *replicas;
  /* zerod node: the mirrors of jobs other nodes host that its read-only
   * sessions follow (follow.h); NULL in zerod standalone. */
  struct follow_env *follow;
  /* Its channel to the coordinator (thread-safe blocking calls, rpc.h),
   * with this node's credentials: set by cluster_create. */
  struct rpc_channel *control_channel;
  struct coord *coord;
  struct rpc_server *control_server;
  /* --health-listen: the probe listener and its status (health.h); NULL
   * without the flag. cluster.c sets the status. */
  struct rpc_server *health_server;
  struct health *health;

  /* Prometheus (rank_metrics.h, jobs_metrics_start); NULL without
   * --metrics-listen. The registry outlives the jobs (main frees it). */
  metrics *metrics;
  struct metrics_http *metrics_http;
  metric_series *m_jobs_active, *m_jobs_retired, *m_sessions;
  /* The base cache's series (node/bases.c), and its cumulative counts at
   * the last scrape, which the counters grow from. */
  struct base_cache_series {
    metric_series *held, *idle, *budget, *entries, *hits, *misses, *evictions;
    uint64_t seen_hits, seen_misses, seen_evictions;
  } m_base_cache;

  uv_signal_t sigint, sigterm;
  int signals_open; /* the two handles above are open */
  int stopping;
  /* zerod standalone's drain before it stops (mode_node.c): saving its
   * jobs until none is in flight or drain_deadline_ms (loop time). */
  int64_t drain_timeout_ms; /* --drain-timeout; 0: no drain */
  int draining;
  const char *drain_signal; /* "SIGTERM" or "SIGINT": the shutdown's reason */
  uv_timer_t drain_timer;
  uint64_t drain_deadline_ms;
} zdaemon; /* not "daemon": unistd.h declares daemon(3) */

/* ipc.c */
int ipc_listen(zdaemon *d, char *err, size_t err_bytes);
void ipc_close_all(zdaemon *d, const char *reason);
void ipc_complete(void *daemon, exec_op *op); /* executor thread */
/* Drains the completion queue, and frees the deleted jobs whose executors
 * have stopped (jobs_reap). */
void ipc_drain_completions(zdaemon *d);
/* An executor is exiting (exec_settings.stopped; its thread): wakes the
 * loop so that it can reap the job. */
void ipc_stopped(void *daemon);

#endif /* ZEROD_DAEMON_H */
