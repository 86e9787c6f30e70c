/* A worker's session on the rank (begin; end: what it held is released,
 * a save waiting for the step is taken), and the rank's communicator,
 * built anew for each generation of the job. */
#include "exec_impl.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "log.h"
#include "pool.h"

void exec__set_comm(rank_state *rs, comm *c) {
  pthread_mutex_lock(&rs->comm_lock);
  comm *old = rs->comm;
  comm_set_activity(c, &rs->activity);
  rs->comm = c;
  if (c != NULL && atomic_load(&rs->stopping))
    comm_abort(c);
  pthread_mutex_unlock(&rs->comm_lock);
  comm_destroy(old);
}

void exec__handle_session_begin(rank_state *rs, exec_op *op) {
  rs->session_id = op->session_id;
  rs->ndropped = 0;
  job_config_msg config;
  exec_job_config(rs->job, rs->lr, rs->max_grad_norm, &config);
  Zerod__V1__AttachReply reply = ZEROD__V1__ATTACH_REPLY__INIT;
  reply.job_id = rs->job->id;
  reply.rank = (uint32_t)rs->rank;
  reply.world_size = (uint32_t)rs->job->world_size;
  reply.version = rs->version;
  reply.loss_scale = atomic_load(&rs->loss_scale);
  reply.config = &config.config;
  reply.created = op->job_created;
  if (op->warning != NULL)
    reply.warning = op->warning;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, &reply.base);
}

void exec__handle_session_end(rank_state *rs, exec_op *op) {
  exec__drop_gather_holds(rs);
  for (uint32_t u = 0; u < rs->nshards; u++) {
    shard *sh = &rs->shards[u];
    if (!sh->present)
      continue;
    if (sh->grad_buf >= 0) {
      pool_unref(rs, &rs->bufs[sh->grad_buf]);
      rs->bufs[sh->grad_buf].unit = -1;
      sh->grad_buf = -1;
    }
  }
  rs->ndropped = 0;
  rs->session_id = 0;
  /* A save waiting for this rank's next step takes its copy now: without a
   * worker there is no next step. */
  uint64_t pending = atomic_load(&rs->ckpt_pending);
  if (pending > rs->ckpt_taken)
    exec__take_snapshot(rs, pending);
  /* A job that failed (e.g. its worker died) closes this rank's
   * communicator, so peers blocked in a collective with this rank fail now
   * rather than at their timeout. */
  if (rs->comm != NULL && job_failed(rs->job, rs->generation, NULL, 0))
    exec__set_comm(rs, NULL);
  if (op->session != NULL) {
    Zerod__V1__DetachReply reply = ZEROD__V1__DETACH_REPLY__INIT;
    exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_DETACH_REPLY, &reply.base);
  }
}

/* This node's ranks of the job, sharing memory: local rank
 * rs->rank - first_rank of nranks. */
static int local_comm(rank_state *rs, const comm_options *global, comm **out, char *err,
                      size_t err_bytes) {
  comm_local_group *g = job_local_group(rs->job, rs->generation);
  if (g == NULL) {
    snprintf(err, err_bytes, "out of memory");
    return -ENOMEM;
  }
  comm_options options = *global;
  options.rank = rs->rank - rs->job->first_rank;
  options.world_size = rs->job->nranks;
  options.level = COMM_LEVEL_NODE;
  int rc = comm_local_create(&options, g, out, err, err_bytes);
  comm_local_group_unref(g);
  return rc;
}

/* A job on N nodes of L ranks each (CreateJob places nodes * ranks_per_node
 * ranks, node by node): the node's ranks share memory, and the ranks with
 * this local index on every node form a Gloo communicator of their own
 * ("<job>/<generation>/x<index>" in the rendezvous). */
static int hierarchical_comm(rank_state *rs, const comm_options *global, comm **out, char *err,
                             size_t err_bytes) {
  const job *j = rs->job;
  int L = j->nranks, l = rs->rank - j->first_rank;
  if (j->world_size % L != 0 || j->first_rank % L != 0) {
    snprintf(err, err_bytes, "ranks %d..%d of %d are not one node of equal ones", j->first_rank,
             j->first_rank + L - 1, j->world_size);
    return -EINVAL;
  }
  comm *local = NULL, *cross = NULL;
  int rc = local_comm(rs, global, &local, err, err_bytes);
  if (rc != 0)
    return rc;
  char prefix[160];
  snprintf(prefix, sizeof prefix, "%s/x%d", global->prefix, l);
  comm_options options = *global;
  options.prefix = prefix;
  options.rank = j->first_rank / L;
  options.world_size = j->world_size / L;
  options.level = COMM_LEVEL_CROSS;
  rc = comm_gloo_create(&options, j->exec->rendezvous, &cross, err, err_bytes);
  if (rc != 0) {
    comm_destroy(local);
    return rc;
  }
  return comm_hier_create(global, local, cross, out, err, err_bytes);
}

void exec__cancel_build_if_over(rank_state *rs) {
  unsigned building;
  if (comm_cancel_armed(&rs->build_cancel, &building) &&
      (atomic_load(&rs->stopping) || job_failed(rs->job, building, NULL, 0)))
    comm_cancel_fire(&rs->build_cancel, building);
}

void exec__handle_comm_init(rank_state *rs, exec_op *op) {
  if (rs->comm != NULL)
    exec__set_comm(rs, NULL);
  rs->generation = op->generation;
  rs->ckpt_calls = 0;
  /* "<job>/<generation>/": the rendezvous namespace (job, epoch) that the
   * coordinator's store splits it into (store_grpc.c). Job names hold no
   * '/'. */
  char prefix[128], err[512] = "";
  snprintf(prefix, sizeof prefix, "%s/%u", rs->job->name, rs->generation);
  comm_options options = {.prefix = prefix,
                          .rank = rs->rank,
                          .world_size = rs->job->world_size,
                          .timeout_ms = rs->job->exec->collective_timeout_ms,
                          .hostname = rs->job->exec->comm_hostname,
                          .level = job_spans_nodes(rs->job) ? COMM_LEVEL_WORLD : COMM_LEVEL_NODE,
                          .cancel = &rs->build_cancel};
  int rc;
  comm *built = NULL;
  comm_cancel_arm(&rs->build_cancel, rs->generation);
  exec__cancel_build_if_over(rs); /* a stop or failure before the arm fired nothing */
  if (rs->dev == NULL) {
    snprintf(err, sizeof err, "%s", rs->device_error);
    rc = -ENODEV;
  } else if (device_is_host(rs->dev) && !job_spans_nodes(rs->job)) {
    /* Every rank is a thread of this process: shared memory, no sockets. */
    rc = local_comm(rs, &options, &built, err, sizeof err);
  } else if (device_is_host(rs->dev) && rs->job->config.collectives == JOB_HIERARCHICAL) {
    rc = hierarchical_comm(rs, &options, &built, err, sizeof err);
  } else if (device_is_host(rs->dev)) {
    rc = comm_gloo_create(&options, rs->job->exec->rendezvous, &built, err, sizeof err);
  } else {
    rc = comm_nccl_create(&options, rs->job->exec->rendezvous, device_cuda_api(rs->dev),
                          device_cuda_stream(rs->dev), &built, err, sizeof err);
  }
  comm_cancel_disarm(&rs->build_cancel);
  if (rc != 0) {
    job_fail(rs->job, rs->generation, "rank %d: communicator: %s", rs->rank, err);
    if (atomic_load(&rs->stopping)) /* the rendezvous gave up: the daemon is stopping */
      LOG_INFOF("communicator not built; zerod is stopping", "job=%s rank=%d generation=%u",
                rs->job->name, rs->rank, rs->generation);
    else if (rc == -ECANCELED) /* its generation failed meanwhile, reason given already */
      LOG_INFOF("communicator not built; its generation failed", "job=%s rank=%d generation=%u",
                rs->job->name, rs->rank, rs->generation);
    else
      LOG_ERRORF("communicator failed", "job=%s rank=%d generation=%u", rs->job->name, rs->rank,
                 rs->generation);
    return;
  }
  exec__set_comm(rs, built);
  /* hpZ's secondary partitions are gathered by the node half of a
   * hierarchical communicator (host ranks); CreateJob refuses a size other
   * than the ranks per node. */
  rs->hpz_ranks = 0;
  uint32_t hpz = rs->job->config.hpz_partition_size;
  if (hpz > 1 && job_spans_nodes(rs->job)) {
    int L = comm_node_ranks(built);
    if (L > 1 && (uint32_t)L == hpz)
      rs->hpz_ranks = L;
    else if (rs->rank == rs->job->first_rank)
      LOG_WARNF("hpZ is off for this job", "job=%s hpz_partition_size=%u ranks_per_node=%d why=%s",
                rs->job->name, hpz, rs->job->nranks,
                L == 0 ? "its communicator has no node half (GPU ranks: NCCL)"
                       : "the size is not the job's ranks per node");
  }
  /* After a reset the ranks' pools may differ (their last ops failed at
   * different points); trimming them makes their next decisions agree
   * again. The step counts must agree too. */
  pool_trim(rs);
  int64_t *steps = calloc((size_t)rs->job->world_size, sizeof *steps);
  if (steps == NULL) {
    job_fail(rs->job, rs->generation, "rank %d: out of memory", rs->rank);
    return;
  }
  steps[rs->rank] = (int64_t)rs->step;
  rc = exec__host_all_gather(rs, steps, sizeof *steps);
  for (int r = 0; rc == 0 && r < rs->job->world_size; r++)
    if (steps[r] != steps[0]) {
      job_fail(rs->job, rs->generation,
               "ranks disagree on the step count (rank 0: %lld, rank %d: %lld)",
               (long long)steps[0], r, (long long)steps[r]);
      break;
    }
  if (rc != 0)
    job_fail(rs->job, rs->generation, "rank %d: communicator check: %s", rs->rank,
             rs->failed_on_device ? device_last_error(rs->dev) : comm_last_error(rs->comm));
  free(steps);
  if (rc == 0 && !job_failed(rs->job, rs->generation, NULL, 0))
    atomic_store(&rs->comm_ready, rs->generation + 1);
  LOG_DEBUGF("communicator ready", "job=%s rank=%d generation=%u", rs->job->name, rs->rank,
             rs->generation);
}
