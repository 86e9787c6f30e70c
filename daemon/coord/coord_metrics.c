/* The coordinator's Prometheus figures (coord.h: coord_metrics_start):
 * members, jobs by state, checkpoint operations, and the calls of its
 * server by method and status. All of it runs on the loop. */
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "coord_impl.h"
#include "job_states.h"
#include "metrics.h"
#include "rpc.h"

/* The states a job is counted in (their words: job_states.h). */
static const Zerod__V1__JobState job_states[] = {
    ZEROD__V1__JOB_STATE__JOB_STATE_CREATING,
    ZEROD__V1__JOB_STATE__JOB_STATE_READY,
    ZEROD__V1__JOB_STATE__JOB_STATE_DEGRADED,
    ZEROD__V1__JOB_STATE__JOB_STATE_DELETING,
};
#define NJOB_STATES (sizeof job_states / sizeof job_states[0])

struct coord_metrics {
  metrics *registry;
  metric_series *members, *watches, *stalled;
  metric_series *jobs[NJOB_STATES];
  metric_family *rpcs, *rpc_seconds;
  metric_family *ckpt_ops, *ckpt_seconds, *ckpt_bytes;
};

/* The state a job is reported in: deleting wins over the stored state. */
static size_t state_index(const cjob *j) {
  Zerod__V1__JobState state = j->deleting ? ZEROD__V1__JOB_STATE__JOB_STATE_DELETING : j->state;
  for (size_t i = 0; i < NJOB_STATES; i++)
    if (job_states[i] == state)
      return i;
  return 0;
}

static void collect(void *arg) {
  coord *c = arg;
  struct coord_metrics *cm = c->metrics;
  size_t watches = 0;
  for (size_t i = 0; i < c->nmembers; i++)
    watches += c->members[i]->watch != NULL;
  metric_set(cm->members, (double)c->nmembers);
  metric_set(cm->watches, (double)watches);
  size_t counts[NJOB_STATES] = {0}, stalled = 0;
  for (size_t i = 0; i < c->njobs; i++) {
    counts[state_index(c->jobs[i])]++;
    stalled += c->jobs[i]->stalled[0] != '\0';
  }
  metric_set(cm->stalled, (double)stalled);
  for (size_t i = 0; i < NJOB_STATES; i++)
    metric_set(cm->jobs[i], (double)counts[i]);
}

/* "/zerod.v1.Jobs/CreateJob" -> service "zerod.v1.Jobs", method "CreateJob". */
static void observe(void *arg, const char *path, int status, double seconds) {
  struct coord_metrics *cm = arg;
  char service[128];
  const char *slash = strrchr(path, '/');
  const char *start = path[0] == '/' ? path + 1 : path;
  size_t len = slash != NULL && slash > start ? (size_t)(slash - start) : 0;
  if (len >= sizeof service)
    len = sizeof service - 1;
  memcpy(service, start, len);
  service[len] = '\0';
  const char *method = slash != NULL ? slash + 1 : path;
  const char *const handled[] = {service, method, rpc_status_name(status), NULL};
  metric_add(metric_family_kept(cm->rpcs, handled), 1);
  const char *const timed[] = {service, method, NULL};
  metric_observe(metric_family_kept(cm->rpc_seconds, timed), seconds);
}

int coord_metrics_start(coord *c, rpc_server *server, metrics *m) {
  if (m == NULL)
    return 0;
  struct coord_metrics *cm = calloc(1, sizeof *cm);
  if (cm == NULL)
    return -ENOMEM;
  cm->registry = m;
  cm->members = metric_series_get(
      metrics_family(m, METRIC_GAUGE, "zerod_coordinator_members",
                     "Nodes that are members of the cluster (their lease is live).", NULL, NULL, 0),
      NULL);
  cm->watches =
      metric_series_get(metrics_family(m, METRIC_GAUGE, "zerod_coordinator_watch_streams",
                                       "Members whose Watch stream is open.", NULL, NULL, 0),
                        NULL);
  cm->stalled = metric_series_get(
      metrics_family(m, METRIC_GAUGE, "zerod_coordinator_stalled_jobs",
                     "Jobs with a rank waiting in a collective for 5 s or more (Job.stalled).",
                     NULL, NULL, 0),
      NULL);
  static const char *const state_label[] = {"state", NULL};
  metric_family *jobs =
      metrics_family(m, METRIC_GAUGE, "zerod_coordinator_jobs",
                     "Jobs the coordinator knows, by state.", state_label, NULL, 0);
  for (size_t i = 0; i < NJOB_STATES; i++) {
    const char *const v[] = {zd_job_state_word(job_states[i]), NULL};
    cm->jobs[i] = metric_family_kept(jobs, v);
  }
  static const char *const rpc_labels[] = {"service", "method", "code", NULL};
  cm->rpcs = metrics_family(m, METRIC_COUNTER, "zerod_rpc_server_handled_total",
                            "gRPC calls the coordinator finished, by method and status code "
                            "(refusals while busy included).",
                            rpc_labels, NULL, 0);
  static const char *const timed_labels[] = {"service", "method", NULL};
  cm->rpc_seconds = metrics_family(m, METRIC_HISTOGRAM, "zerod_rpc_server_handling_seconds",
                                   "Time from a gRPC call's arrival to its end (a stream's "
                                   "whole life).",
                                   timed_labels, NULL, 0);
  static const char *const op_result[] = {"operation", "result", NULL};
  static const char *const op[] = {"operation", NULL};
  cm->ckpt_ops = metrics_family(m, METRIC_COUNTER, "zerod_checkpoint_operations_total",
                                "Checkpoint saves, restores and exports that ended, by result.",
                                op_result, NULL, 0);
  cm->ckpt_seconds =
      metrics_family(m, METRIC_HISTOGRAM, "zerod_checkpoint_duration_seconds",
                     "Time from a checkpoint operation's order to its success.", op, NULL, 0);
  cm->ckpt_bytes =
      metrics_family(m, METRIC_COUNTER, "zerod_checkpoint_bytes_total",
                     "Bytes of the checkpoints saved and the files exported.", op, NULL, 0);
  c->metrics = cm;
  int rc = metrics_add_collector(m, collect, c);
  if (rc != 0) {
    coord_metrics_stop(c);
    return rc;
  }
  if (server != NULL)
    rpc_server_set_observer(server, observe, cm);
  return 0;
}

void coord_metrics_stop(coord *c) {
  struct coord_metrics *cm = c->metrics;
  if (cm == NULL)
    return;
  metrics_remove_collector(cm->registry, collect, c);
  metric_series_put(cm->members);
  metric_series_put(cm->watches);
  metric_series_put(cm->stalled);
  free(cm);
  c->metrics = NULL;
}

void coord__metrics_checkpoint(coord *c, const char *operation, int ok, double seconds,
                               uint64_t bytes) {
  struct coord_metrics *cm = c->metrics;
  if (cm == NULL)
    return;
  const char *const result[] = {operation, ok ? "ok" : "failed", NULL};
  metric_add(metric_family_kept(cm->ckpt_ops, result), 1);
  if (!ok)
    return;
  const char *const v[] = {operation, NULL};
  metric_observe(metric_family_kept(cm->ckpt_seconds, v), seconds);
  metric_add(metric_family_kept(cm->ckpt_bytes, v), (double)bytes);
}
