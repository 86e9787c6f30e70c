/* replicate: a rank's in-memory copy at the end of a step (exec_impl.h;
 * docs/redundancy.md).
 *
 * A job with redundancy copies its state every redundancy_every steps,
 * inside the step, before the step is answered: each rank writes its shard
 * file (the checkpoint format, ckpt.h) into its node's replica directory of
 * that step (tmpfs: memory), each node's first rank also the job's layout,
 * and the node copies them to its buddy node (exec_ckpt_hooks.replica_*);
 * then the ranks all-reduce whether they all did. Only then is the step
 * answered: a step that any worker saw complete has every rank's file on
 * two nodes, so the loss of one node loses no completed step. A copy that
 * failed somewhere (the all-reduce says so) is logged and the step is
 * answered all the same: the job goes on with its previous copy. */
#include "exec_impl.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "clock.h"
#include "log.h"
#include "rank_metrics.h"

/* Writes the rank's shard file into dir (as name.part, renamed once
 * complete, so that a file under its name is whole). 0 or a negative errno
 * with err. */
static int write_shard(rank_state *rs, unit_layout **units, unsigned n, uint64_t bytes,
                       const char *dir, const char *name, char *err, size_t err_bytes) {
  job *j = rs->job;
  int want[JOB_NSTATES];
  exec__rank_states(rs, want);
  char part[PATH_MAX + 80], path[PATH_MAX + 80];
  snprintf(part, sizeof part, "%s/%s.part", dir, name);
  snprintf(path, sizeof path, "%s/%s", dir, name);
  ckpt_shard_header h = {.rank = (uint32_t)rs->rank,
                         .world_size = (uint32_t)j->world_size,
                         .job_id = j->id,
                         .step = rs->step,
                         .data_bytes = bytes};
  uint64_t largest = 0;
  for (unsigned k = 0; k < n; k++)
    largest = units[k]->shard_numel > largest ? units[k]->shard_numel : largest;
  float *bounce = NULL; /* made for the first state not in host memory */
  ckpt_writer *w = NULL;
  int rc = ckpt_writer_open(part, &h, &w, err, err_bytes);
  for (unsigned k = 0; rc == 0 && k < n; k++) {
    shard *sh = &rs->shards[units[k]->id];
    for (uint32_t s = 0; rc == 0 && s < 3; s++) {
      if (!want[s])
        continue;
      /* A host rank's state is written from where it lives; any other's
       * (a GPU's, a tier file's) is copied into host memory first. */
      const float *from = device_is_host(rs->dev) ? exec__shard_state(rs, sh, s) : NULL;
      if (from == NULL && bounce == NULL && (bounce = malloc(largest * sizeof(float))) == NULL) {
        snprintf(err, err_bytes, "out of host memory");
        rc = -ENOMEM;
      } else if (from == NULL && (rc = exec__state_get(rs, sh, units[k], s, bounce)) != 0)
        snprintf(err, err_bytes, "copying the shard state: %s", device_last_error(rs->dev));
      else
        rc = ckpt_writer_write(w, from != NULL ? from : bounce,
                               units[k]->shard_numel * sizeof(float), err, err_bytes);
    }
  }
  free(bounce);
  uint64_t file_bytes = 0, xxh64;
  if (rc == 0)
    rc = ckpt_writer_finish(w, &file_bytes, &xxh64, err, err_bytes);
  else if (w != NULL)
    ckpt_writer_abort(w);
  rs->replica_file_bytes = file_bytes;
  if (rc == 0 && rename(part, path) != 0) {
    rc = -errno;
    snprintf(err, err_bytes, "cannot rename %s.part: %s", name, strerror(errno));
  }
  return rc;
}

/* The node's first rank: the job's layout beside the shard files, from
 * which a restore makes its manifest. */
static int write_layout(rank_state *rs, unit_layout **units, unsigned n, const char *dir, char *err,
                        size_t err_bytes) {
  ckpt_manifest *layout = exec__layout(rs, units, n);
  if (layout == NULL) {
    snprintf(err, err_bytes, "out of host memory");
    return -ENOMEM;
  }
  int rc = ckpt_manifest_store(dir, CKPT_LAYOUT_NAME, layout, err, err_bytes);
  ckpt_manifest_free(layout);
  free(layout);
  return rc;
}

/* This rank's part of the copy: its file (and the layout) written and
 * copied to the buddy. 0 or a negative errno with err. */
static int copy_here(rank_state *rs, char *err, size_t err_bytes) {
  job *j = rs->job;
  const exec_ckpt_hooks *hooks = exec__ckpt(rs);
  char dir[PATH_MAX];
  double t0 = clock_now_s();
  int rc = hooks->replica_dir(j, rs->step, dir, sizeof dir, err, err_bytes);
  if (rc != 0)
    return rc;
  unsigned n = 0;
  uint64_t bytes = 0;
  unit_layout **units = exec__snapshot_units(rs, &n, &bytes);
  if (units == NULL) {
    snprintf(err, err_bytes, "out of host memory");
    return -ENOMEM;
  }
  char name[64];
  ckpt_shard_name((uint32_t)rs->rank, (uint32_t)j->world_size, name, sizeof name);
  int first = rs->rank == j->first_rank;
  rc = write_shard(rs, units, n, bytes, dir, name, err, err_bytes);
  if (rc == 0 && first)
    rc = write_layout(rs, units, n, dir, err, err_bytes);
  free(units);
  double t1 = clock_now_s();
  if (rc == 0)
    rc = hooks->replica_push(j, rs->step, dir, name, err, err_bytes);
  LOG_DEBUGF("in-memory copy written and sent", "job=%s rank=%d write_ms=%.1f send_ms=%.1f",
             j->name, rs->rank, (t1 - t0) * 1e3, (clock_now_s() - t1) * 1e3);
  if (rc == 0 && first)
    rc = hooks->replica_push(j, rs->step, dir, CKPT_LAYOUT_NAME, err, err_bytes);
  return rc;
}

int exec__replicate(rank_state *rs, exec_op *op) {
  job *j = rs->job;
  unsigned every = atomic_load(&j->redundancy_every);
  if (every == 0 || rs->step == 0 || rs->step % every != 0 || exec__ckpt(rs)->replica_dir == NULL)
    return 0;
  double t0 = clock_now_s();
  char err[512] = "";
  int rc = copy_here(rs, err, sizeof err);
  double t1 = clock_now_s();
  if (rc != 0) {
    char quoted[600];
    LOG_WARNF("in-memory copy not made", "job=%s rank=%d step=%llu err=%s", j->name, rs->rank,
              (unsigned long long)rs->step, log_quote(err, quoted, sizeof quoted));
  }
  /* Every rank's copy is on two nodes before any rank answers the step. */
  double ok = rc == 0 ? 1.0 : 0.0;
  int crc = comm_all_reduce(rs->comm, &ok, 1, COMM_F64, COMM_MIN);
  if (crc != 0) {
    exec__op_comm_failed(rs, op, "all_reduce (in-memory copy)", crc);
    return -1;
  }
  if (ok == 1.0) {
    exec__ckpt(rs)->replica_done(j, rs->rank, rs->step);
    atomic_store(&rs->replica_step, rs->step);
  } else if (rc == 0) {
    LOG_WARNF("in-memory copy incomplete: another rank's failed", "job=%s rank=%d step=%llu",
              j->name, rs->rank, (unsigned long long)rs->step);
  }
  double t2 = clock_now_s();
  rank_metrics_replica(rs, t2 - t0, rs->replica_file_bytes, ok == 1.0 ? rs->step : 0);
  LOG_DEBUGF("in-memory copy", "job=%s rank=%d step=%llu bytes=%llu copy_ms=%.1f agree_ms=%.1f",
             j->name, rs->rank, (unsigned long long)rs->step,
             (unsigned long long)rs->replica_file_bytes, (t1 - t0) * 1e3, (t2 - t1) * 1e3);
  return 0;
}
