/* Checkpoints from a rank's side: the copy of its shard state for a save
 * (taken between steps, handed to the node's writer through the job's
 * checkpoint hooks), and a restore's reading and installing. */
#include "exec_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt_job.h"
#include "clock.h"
#include "hostmem.h"
#include "log.h"
#include "pin.h"
#include "pool.h"
#include "rpc.h"
#include "tier.h"

ckpt_manifest *exec__layout(rank_state *rs, unit_layout **units, unsigned n) {
  job *j = rs->job;
  ckpt_job_view view = {.name = j->name,
                        .id = j->id,
                        .world_size = j->world_size,
                        .config = &j->config,
                        .weights_only = rs->weights_only,
                        .units = units,
                        .nunits = n};
  exec__feedback_view(rs, &view);
  return ckpt_layout_of(&view, rs->step, rs->version);
}

/* The bytes of the units' compression state (feedback.c), saved after
 * their states. */
static uint64_t feedback_total(const rank_state *rs, unit_layout *const *units, unsigned n) {
  uint64_t bytes = 0;
  for (unsigned k = 0; !rs->weights_only && k < n; k++)
    bytes += exec__feedback_bytes(rs, units[k]);
  return bytes;
}

unit_layout **exec__snapshot_units(rank_state *rs, unsigned *n, uint64_t *bytes) {
  job *j = rs->job;
  int want[3];
  int nstates = exec__rank_states(rs, want);
  uint32_t nunits;
  unit_layout **units = job_units_copy(j, &nunits);
  *n = 0;
  *bytes = 0;
  for (uint32_t u = 0; units != NULL && u < nunits; u++)
    if (u < rs->nshards && shard_has_state(&rs->shards[u])) {
      units[(*n)++] = units[u];
      *bytes += units[u]->shard_numel * 4 * (uint64_t)nstates;
    }
  *bytes += feedback_total(rs, units, *n);
  return units;
}

void exec__take_snapshot(rank_state *rs, uint64_t id) {
  job *j = rs->job;
  rs->ckpt_taken = id;
  char reason[512] = "";
  if (job_failed(j, rs->generation, reason, sizeof reason)) {
    char why[600];
    snprintf(why, sizeof why, "job '%s' failed: %s", j->name, reason);
    exec__ckpt(rs)->save_failed(j, rs->rank, id, RPC_FAILED_PRECONDITION, why);
    return;
  }
  double t0 = clock_now_s();
  int want[3];
  exec__rank_states(rs, want);
  unsigned n = 0;
  uint64_t bytes = 0;
  unit_layout **units = exec__snapshot_units(rs, &n, &bytes);
  /* Memory the rank's writer faulted in while the step ran, if the order
   * came early enough (ckpt_node_stage), else fresh. A job whose state is
   * on disk copies it there (tier_snapshot): its size may be more than
   * the memory there is. */
  int tiered = tier_enabled(j), rc = 0;
  uint8_t *data = units != NULL && !tiered ? exec__ckpt(rs)->staging(j, rs->rank, id, bytes) : NULL;
  int staged = data != NULL;
  if (units != NULL && tiered)
    data = tier_snapshot(rs, units, n, bytes, &rc);
  else if (units != NULL && data == NULL)
    data = hostmem_shared_alloc(bytes);
  if (rc == 0 && data == NULL)
    rc = -ENOMEM;
  uint8_t *at = data;
  for (unsigned k = 0; rc == 0 && !tiered && k < n; k++) {
    shard *sh = &rs->shards[units[k]->id];
    size_t b = units[k]->shard_numel * sizeof(float);
    for (int s = 0; rc == 0 && s < 3; s++) {
      if (!want[s])
        continue;
      rc = exec__state_get(rs, sh, units[k], (uint32_t)s, (float *)at);
      at += b;
    }
  }
  /* The compression state after every unit's states (ckpt.h); a tier's
   * copy leaves room for it. */
  if (rc == 0)
    at = data + (bytes - feedback_total(rs, units, n));
  for (unsigned k = 0; rc == 0 && !rs->weights_only && k < n; k++) {
    exec__feedback_save(rs, &rs->shards[units[k]->id], units[k], (float *)at);
    at += exec__feedback_bytes(rs, units[k]);
  }
  ckpt_manifest *layout = NULL;
  if (rc == 0 && rs->rank == 0 && (layout = exec__layout(rs, units, n)) == NULL)
    rc = -ENOMEM;
  free(units);
  if (rc != 0) {
    hostmem_shared_unref(data);
    char why[600];
    if (tiered && rc != -ENOMEM)
      snprintf(why, sizeof why, "copying the shard state on disk: %s", strerror(-rc));
    else
      snprintf(why, sizeof why, "copying the shard state: %s",
               rc == -ENOMEM ? "out of host memory" : device_last_error(rs->dev));
    exec__ckpt(rs)->save_failed(j, rs->rank, id, RPC_RESOURCE_EXHAUSTED, why);
    return;
  }
  int64_t stall_ms = (int64_t)((clock_now_s() - t0) * 1000);
  LOG_DEBUGF("shard copied for a save",
             "job=%s rank=%d save=%llu step=%llu bytes=%llu staged=%d ms=%lld", j->name, rs->rank,
             (unsigned long long)id, (unsigned long long)rs->step, (unsigned long long)bytes,
             staged, (long long)stall_ms);
  exec__ckpt(rs)->saved(j, rs->rank, id, rs->step, data, bytes, layout, stall_ms);
}

/* A save order reached the rank: with no worker attached no step will
 * come, so the copy is taken now (in queue order, before any op of a
 * worker that attaches later), and likewise with a worker waiting in its
 * own save (every rank is at the same step: OP_CKPT_PARK checked). With
 * one training, it is taken at the end of a step to come, and the rank's
 * writer faults its memory in meanwhile. */
void exec__handle_save(rank_state *rs, exec_op *op) {
  if (op->ckpt_id <= rs->ckpt_taken || atomic_load(&rs->ckpt_pending) < op->ckpt_id)
    return;
  if (rs->session_id == 0 ||
      rs->ckpt_parked == ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_SAVE) {
    exec__take_snapshot(rs, op->ckpt_id);
    return;
  }
  unsigned n;
  uint64_t bytes;
  unit_layout **units = exec__snapshot_units(rs, &n, &bytes);
  if (units != NULL && !tier_enabled(rs->job)) /* a tier's copy takes no memory to stage */
    exec__ckpt(rs)->stage(rs->job, rs->rank, op->ckpt_id, bytes);
  free(units);
}

/* The job as checkpoints see it (ckpt_job.h), with a copy of its unit
 * table taken under its mutex (the caller frees view->units), less the
 * units of its base (never saved, never restored). Returns 0 or -ENOMEM
 * (view->units NULL). */
static int job_view(rank_state *rs, ckpt_job_view *view) {
  job *j = rs->job;
  uint32_t total, nunits = 0;
  unit_layout **units = job_units_copy(j, &total);
  for (uint32_t u = 0; units != NULL && u < total; u++)
    if (!(u < rs->nshards && rs->shards[u].from_base))
      units[nunits++] = units[u];
  *view = (ckpt_job_view){.name = j->name,
                          .id = j->id,
                          .world_size = j->world_size,
                          .config = &j->config,
                          .weights_only = rs->weights_only,
                          .units = units,
                          .nunits = nunits};
  exec__feedback_view(rs, view);
  return units != NULL ? 0 : -ENOMEM;
}

/* Whether the units a restore makes (a job that had none takes the
 * checkpoint's or the file's) would take the rank over the job's quota of
 * shard state, said in err: refused before anything is published, as a
 * registration over it is. */
static int restore_over_quota(rank_state *rs, const ckpt_staged *st, char *err, size_t err_bytes) {
  job *j = rs->job;
  int host = device_is_host(rs->dev);
  uint64_t quota = host ? j->quota_host_bytes : j->quota_device_bytes, need = 0;
  unsigned made = 0;
  /* A host rank's in-memory copies (redundancy) are its host memory too. */
  uint64_t in_use = rs->state_bytes + (host ? exec__replica_bytes_in_use(rs) : 0);
  for (unsigned u = 0; u < st->nunits; u++) {
    if (st->units[u].owned) {
      need += exec__shard_bytes(rs, st->units[u].layout) +
              exec__feedback_bytes(rs, st->units[u].layout) +
              (host ? exec__replica_bytes(rs, st->units[u].layout) : 0);
      made++;
    }
  }
  if (quota == 0 || made == 0 || in_use + need <= quota)
    return 0;
  snprintf(err, err_bytes,
           "the restore makes %u units needing %" PRIu64 " bytes of shard state%s on rank %d, "
           "over the job's %s quota of %" PRIu64 " bytes per rank (%" PRIu64 " in use)",
           made, need, host && atomic_load(&j->redundancy_every) ? " and in-memory copies" : "",
           rs->rank, host ? "max_host_bytes" : "max_device_bytes", quota, in_use);
  return 1;
}

void exec__handle_restore_read(rank_state *rs, exec_op *op) {
  ckpt_staged_free(rs->ckpt_staged);
  rs->ckpt_staged = NULL;
  int code = 0;
  char err[512] = "";
  ckpt_staged *st = NULL;
  double t0 = clock_now_s();
  ckpt_job_view view = {0};
  /* A job whose state is on disk stages what it reads in a file, mapped:
   * page cache, not memory (its state may be larger than memory). */
  int tiered = tier_enabled(rs->job);
  int staging_fd = tiered ? tier_staging_file(rs, rs->job->exec->nvme_dir) : -1;
  if (tiered && staging_fd < 0)
    LOG_WARNF("a restore stages in memory: no staging file beside the tier file",
              "job=%s rank=%d err=\"%s\"", rs->job->name, rs->rank, strerror(-staging_fd));
  /* A source in other nodes' memory comes here first (NULL: none). */
  int fetched = exec__ckpt(rs)->restore_fetch != NULL
                    ? exec__ckpt(rs)->restore_fetch(rs->job, op->ckpt_id, err, sizeof err)
                    : 0;
  if (fetched != 0)
    code = RPC_UNAVAILABLE;
  int rc = fetched != 0 ? fetched
           : job_view(rs, &view) == 0
               ? ckpt_restore_read(&view, rs->rank, op->ckpt_source, op->ckpt_format,
                                   device_is_host(rs->dev) && !tiered, staging_fd, &st, &code, err,
                                   sizeof err)
               : -ENOMEM;
  if (staging_fd >= 0)
    close(staging_fd); /* the mapping, if any, keeps the file */
  if (fetched == 0 && view.units == NULL) {
    code = RPC_RESOURCE_EXHAUSTED;
    snprintf(err, sizeof err, "out of host memory");
  }
  free((void *)view.units);
  if (rc == 0 && restore_over_quota(rs, st, err, sizeof err)) {
    ckpt_staged_free(st);
    st = NULL;
    code = RPC_RESOURCE_EXHAUSTED;
    rc = -ENOSPC;
  }
  if (rc == 0) {
    st->id = op->ckpt_id;
    rs->ckpt_staged = st;
    LOG_DEBUGF("read for a restore", "job=%s rank=%d restore=%llu bytes=%zu ms=%.1f", rs->job->name,
               rs->rank, (unsigned long long)op->ckpt_id, st->mem_bytes,
               (clock_now_s() - t0) * 1e3);
  }
  exec__ckpt(rs)->restore_report(rs->job, rs->rank, op->ckpt_id, 0, rc == 0 ? st->step : 0,
                                 rc == 0 ? 0 : (code != 0 ? code : RPC_INTERNAL), err);
}

/* Installs what exec__handle_restore_read staged: every rank of the job does
 * this once all have read and verified their part. A failure here leaves
 * ranks that installed and ranks that did not, so the job fails. */
void exec__handle_restore_commit(rank_state *rs, exec_op *op) {
  job *j = rs->job;
  ckpt_staged *st = rs->ckpt_staged;
  char err[512] = "";
  int rc = 0;
  if (st == NULL || st->id != op->ckpt_id) {
    exec__ckpt(rs)->restore_report(j, rs->rank, op->ckpt_id, 0, 0, RPC_INTERNAL,
                                   "no values read for this restore on the rank");
    return;
  }
  rs->ckpt_staged = NULL;
  unsigned char *fresh = calloc(st->nunits + 1, 1);
  if (fresh == NULL)
    rc = -ENOMEM;
  for (unsigned u = 0; rc == 0 && u < st->nunits; u++) {
    ckpt_staged_unit *su = &st->units[u];
    if (su->owned) {
      int existed = 0, conflict = 0;
      unit_layout *l = job_publish_unit(j, su->layout, &existed, &conflict);
      if (l == NULL) {
        snprintf(err, sizeof err, "unit '%s': %s", su->layout->name,
                 conflict ? "registered meanwhile with a different layout" : "too many units");
        rc = -EINVAL;
        break;
      }
      su->owned = 0; /* the job's now (or freed, if it existed) */
      su->layout = l;
    }
    const unit_layout *l = su->layout;
    if (l->id >= rs->nshards || !rs->shards[l->id].present) {
      pin_lock_shards(rs);
      rc = exec__shard_create(rs, l);
      pin_unlock_shards(rs);
      fresh[u] = rc == 0;
      if (rc != 0)
        snprintf(err, sizeof err, "out of memory for the shard of unit '%s'", l->name);
    }
  }
  if (rc == 0) {
    for (unsigned u = 0; u < st->nunits; u++)
      pin_mark_changing(rs, st->units[u].layout);
    pin_begin_write(rs);
    for (unsigned u = 0; rc == 0 && u < st->nunits; u++) {
      ckpt_staged_unit *su = &st->units[u];
      const unit_layout *l = su->layout;
      shard *sh = &rs->shards[l->id];
      size_t bytes = l->shard_numel * sizeof(float);
      if (!rs->weights_only && (rc = exec__feedback_restore(rs, sh, l, su->feedback)) != 0) {
        snprintf(err, sizeof err, "out of memory for the compression state of unit '%s'", l->name);
        break;
      }
      if (sh->tiered || sh->host_state) {
        /* Into the tier file, or a GPU rank's host arrays; the staged
         * arrays go with the staging. */
        for (int k = 0; rc == 0 && k < JOB_NSTATES; k++)
          if (exec__has_state(rs, (uint32_t)k))
            rc = exec__state_put(rs, sh, l, (uint32_t)k, su->state[k]);
        if (rc == 0)
          rc = device_zero(rs->dev, sh->grad_acc, bytes);
        if (rc == 0)
          rc = exec__refresh_working(rs, l, sh);
        continue;
      }
      float **dst[3] = {&sh->master, &sh->moment1, &sh->moment2};
      float *master = sh->master;
      for (int k = 0; rc == 0 && k < 3; k++) {
        if (*dst[k] == NULL)
          continue;
        if (su->state[k] == NULL) {
          rc = device_zero(rs->dev, *dst[k], bytes);
        } else if (st->arrays) {
          /* A host rank takes the staged array as it is; the one it held
           * goes with the staging, freed once the rank has reported. */
          float *held = *dst[k];
          *dst[k] = su->state[k];
          su->state[k] = held;
        } else {
          rc = device_upload(rs->dev, *dst[k], su->state[k], bytes);
        }
      }
      if (sh->working == (void *)master)
        sh->working = sh->master;
      if (rc == 0 && sh->grad_acc != NULL) /* a base's rank keeps none */
        rc = device_zero(rs->dev, sh->grad_acc, bytes);
      if (rc == 0)
        rc = exec__refresh_working(rs, l, sh);
    }
    if (rc == 0)
      rc = device_sync(rs->dev);
    if (rc != 0)
      snprintf(err, sizeof err, "installing the restored values: %s", device_last_error(rs->dev));
    rs->step = st->step;
    pin_end_write(rs);
  }
  for (unsigned u = 0; rc == 0 && u < st->nunits; u++)
    if (fresh[u])
      atomic_fetch_add(&st->units[u].layout->ready_ranks, 1);
  free(fresh);
  if (rc == 0 && st->feedback_dropped && rs->rank == 0)
    LOG_WARNF("the compression state (error feedback) not restored: the checkpoint's is of "
              "another world, node count or kind; it starts afresh",
              "job=%s restore=%llu", j->name, (unsigned long long)op->ckpt_id);
  if (rc != 0) {
    job_fail(j, rs->generation, "rank %d: restore: %s", rs->rank, err);
    exec__ckpt(rs)->restore_report(j, rs->rank, op->ckpt_id, 0, 0, RPC_INTERNAL, err);
  } else {
    LOG_INFOF("restored", "job=%s rank=%d restore=%llu step=%llu units=%u", j->name, rs->rank,
              (unsigned long long)op->ckpt_id, (unsigned long long)st->step, st->nunits);
    exec__ckpt(rs)->restore_report(j, rs->rank, op->ckpt_id, 1, st->step, 0, NULL);
  }
  ckpt_staged_free(st);
}

/* What every rank brings to a worker's checkpoint call, compared. */
typedef struct ckpt_call_key {
  uint64_t step;
  uint64_t call;
  uint64_t name_hash; /* FNV-1a of the name */
  uint32_t action;
  uint32_t pad;
} ckpt_call_key;

static uint64_t name_hash(const char *name) {
  uint64_t h = 14695981039346656037ull;
  for (const unsigned char *p = (const unsigned char *)name; *p != '\0'; p++)
    h = (h ^ *p) * 1099511628211ull;
  return h;
}

static const char *action_verb(uint32_t action) {
  return action == ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_RESTORE ? "restore" : "save";
}

void exec__ckpt_unpark(rank_state *rs) {
  if (rs->ckpt_parked == ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_RESTORE)
    atomic_fetch_sub(&rs->job->ckpt_restore_parked, 1);
  rs->ckpt_parked = 0;
}

void exec__handle_ckpt_park(rank_state *rs, exec_op *op) {
  const Zerod__V1__CheckpointRequest *req = (const Zerod__V1__CheckpointRequest *)op->request;
  op->generation = rs->generation;
  if (exec__op_job_failed(rs, op))
    return;
  job *j = rs->job;
  ckpt_call_key *all = calloc((size_t)j->world_size, sizeof *all);
  if (all == NULL) {
    job_fail(j, rs->generation, "rank %d: out of memory", rs->rank);
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  int restore = req->action == ZEROD__V1__CHECKPOINT_ACTION__CHECKPOINT_ACTION_RESTORE;
  /* The restore replaces the values the worker gathered: it lets go of
   * them (its gradient buffers stay; the restore zeroes what was reduced
   * into the shard). */
  if (restore)
    exec__drop_gather_holds(rs);
  /* Waiting from before the collective: once any rank is past it (the
   * leader asks the coordinator then), the orders that follow find every
   * rank waiting. */
  rs->ckpt_parked = (int)req->action;
  if (restore)
    atomic_fetch_add(&j->ckpt_restore_parked, 1);
  all[rs->rank] = (ckpt_call_key){.step = rs->step,
                                  .call = rs->ckpt_calls,
                                  .name_hash = name_hash(req->name),
                                  .action = (uint32_t)req->action};
  int err = exec__host_all_gather(rs, all, sizeof *all);
  if (err != 0) {
    free(all);
    exec__ckpt_unpark(rs);
    exec__op_comm_failed(rs, op, "all_gather (checkpoint)", err);
    return;
  }
  /* Every rank took part, alike or not: the next call has the next number
   * on all of them. */
  rs->ckpt_calls++;
  for (int r = 1; r < j->world_size; r++) {
    const ckpt_call_key *a = &all[0], *b = &all[r];
    if (b->action != a->action) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                 "rank 0 asked to %s a checkpoint and rank %d to %s one: a checkpoint is a "
                 "collective, every rank makes the same call",
                 action_verb(a->action), r, action_verb(b->action));
    } else if (b->name_hash != a->name_hash) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                 "rank 0 and rank %d named different checkpoints (this rank: '%s'): every rank "
                 "names the same",
                 r, req->name);
    } else if (b->step != a->step || b->call != a->call) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                 "rank 0 called at step %llu and rank %d at step %llu: a checkpoint is a "
                 "collective, every rank calls it between the same two steps",
                 (unsigned long long)a->step, r, (unsigned long long)b->step);
    } else {
      continue;
    }
    free(all);
    exec__ckpt_unpark(rs);
    return;
  }
  free(all);
  /* An order that came before the worker did. */
  uint64_t pending = atomic_load(&rs->ckpt_pending);
  if (!restore && pending > rs->ckpt_taken)
    exec__take_snapshot(rs, pending);
  op->ckpt_call = rs->ckpt_calls - 1;
  op->ckpt_step = rs->step;
  op->status = ZEROD__V1__STATUS__STATUS_OK;
}
