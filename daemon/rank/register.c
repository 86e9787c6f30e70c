/* REGISTER_UNIT and LOAD_UNIT: the ranks agree on a unit's layout
 * (descriptors compared through a collective), create its shards and
 * initialise them from a seed or from rank 0's values. */
#include "exec_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "offload.h"
#include "pin.h"
#include "shm.h"
#include "tier.h"

/* A counter-based normal generator: value k of a unit depends only on the
 * seed, the unit's name and k, so every rank computes its own slice and the
 * result does not depend on the world size. */
static uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static float seeded_normal(uint64_t key, uint64_t index) {
  uint64_t a = splitmix64(key ^ (index * 2 + 0) * 0xd1342543de82ef95ull);
  uint64_t b = splitmix64(key ^ (index * 2 + 1) * 0xd1342543de82ef95ull);
  double u1 = ((double)(a >> 11) + 1.0) / 9007199254740993.0; /* (0, 1] */
  double u2 = (double)(b >> 11) / 9007199254740992.0;
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static uint64_t fnv1a(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s != '\0'; s++)
    h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return h;
}

/* Rank 0 lays its packed fp32 values of unit l (the tensors back to back,
 * as a worker sends them) out in the flat buffer, gaps and padding zero,
 * and broadcasts it into every rank's scratch (padded_numel floats, grown
 * by the caller); every rank then takes its slice from there. A host rank 0
 * lays the values out in its scratch directly, a GPU rank 0 in host memory
 * that it then copies to its device. */
static int broadcast_values(rank_state *rs, const unit_layout *l, const float *packed) {
  size_t bytes = l->padded_numel * sizeof(float);
  int rc = 0;
  if (rs->rank == 0) {
    float *layout = device_is_host(rs->dev) ? rs->scratch : malloc(bytes ? bytes : 1);
    if (layout == NULL)
      rc = -ENOMEM;
    if (rc == 0) {
      memset(layout, 0, bytes);
      uint64_t at = 0;
      for (unsigned t = 0; t < l->ntensors; t++) {
        memcpy(layout + l->tensors[t].offset, packed + at, l->tensors[t].numel * sizeof(float));
        at += l->tensors[t].numel;
      }
    }
    if (rc == 0 && layout != rs->scratch)
      rc = device_upload(rs->dev, rs->scratch, layout, bytes);
    if (layout != rs->scratch)
      free(layout);
    exec__dev_call(rs, rc);
  }
  /* A rank 0 that failed above still takes part, so that its peers do not
   * wait for it; the job fails all the same. */
  int comm_rc = comm_broadcast(rs->comm, rs->scratch, bytes, 0);
  rank_metrics_collective(rs, RANK_BROADCAST);
  return rc != 0 ? rc : comm_rc;
}

/* The initial values of INIT_SEEDED_NORMAL for this rank's slice of unit
 * l, into its (zero-filled) master shard: on a GPU rank they are computed
 * in host memory and copied over. */
static int seed_master(rank_state *rs, const unit_layout *l, shard *sh, uint64_t seed,
                       double init_std) {
  uint64_t lo = (uint64_t)rs->rank * l->shard_numel;
  float *values = device_is_host(rs->dev) && !sh->tiered
                      ? sh->master
                      : calloc(l->shard_numel + 1, sizeof(float));
  if (values == NULL)
    return -ENOMEM;
  uint64_t key = splitmix64(seed) ^ fnv1a(l->name);
  for (unsigned t = 0; t < l->ntensors; t++) {
    const tensor_layout *tl = &l->tensors[t];
    uint64_t b = tl->offset > lo ? tl->offset : lo;
    uint64_t e =
        tl->offset + tl->numel < lo + l->shard_numel ? tl->offset + tl->numel : lo + l->shard_numel;
    for (uint64_t k = b; k < e; k++)
      values[k - lo] = (float)init_std * seeded_normal(key, k);
  }
  int rc = 0;
  if (values != sh->master) {
    rc = exec__state_put(rs, sh, l, JOB_STATE_MASTER, values);
    free(values);
  }
  return rc;
}

/* Whether the unit `mine` would take the rank over one of its job's
 * quotas (answering op with which and why if so). The shard state in the
 * rank's memory counts against max_host_bytes on a host rank and
 * max_device_bytes on a GPU rank; what an offloaded optimizer keeps in
 * host memory (a GPU rank's master and moments, offload_optimizer cpu)
 * and its staging buffers count against max_host_bytes. */
/* One quota: whether need more bytes of `what` fit beside in_use (staging
 * of them the offload's buffers) under quota (0: none), answering op if
 * not. */
static int over_quota(rank_state *rs, exec_op *op, const char *unit, const char *what,
                      const char *quota_name, uint64_t quota, uint64_t in_use, uint64_t staging,
                      uint64_t need) {
  if (quota == 0 || in_use + need <= quota)
    return 0;
  char staged[96] = "";
  if (staging != 0)
    snprintf(staged, sizeof staged, ", %" PRIu64 " of them offload_optimizer's staging buffers",
             staging);
  exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
             "unit '%s' needs %" PRIu64 " bytes of %s on rank %d, over the job's %s quota of "
             "%" PRIu64 " bytes per rank (%" PRIu64 " in use%s)",
             unit, need, what, rs->rank, quota_name, quota, in_use, staged);
  return 1;
}

static int quota_refused(rank_state *rs, exec_op *op, const char *name, const unit_layout *mine) {
  job *j = rs->job;
  const unit_layout *have = job_unit_named(j, name);
  if (have != NULL && have->id < rs->nshards && rs->shards[have->id].present)
    return 0; /* registered here already: nothing new */
  uint64_t staging = (tier_enabled(j) ? tier_staging_bytes(&j->config) : 0) +
                     (offload_enabled(rs) ? offload_staging_bytes(&j->config) : 0);
  /* 1-bit Adam's and low-rank compression's state is made with the shard
   * (host ranks). */
  uint64_t need = exec__shard_bytes(rs, mine) + exec__feedback_bytes(rs, mine);
  /* In-memory copies (redundancy) are host memory too. */
  uint64_t copies = exec__replica_bytes(rs, mine);
  uint64_t copies_in_use = copies != 0 ? exec__replica_bytes_in_use(rs) : 0;
  if (device_is_host(rs->dev)) /* the rank's memory is host memory, staging included */
    return over_quota(rs, op, name,
                      copies != 0 ? "shard state and its in-memory copies" : "shard state",
                      "max_host_bytes", j->quota_host_bytes,
                      rs->state_bytes + staging + copies_in_use, staging, need + copies);
  if (over_quota(rs, op, name, "shard state", "max_device_bytes", j->quota_device_bytes,
                 rs->state_bytes, 0, need))
    return 1;
  /* A GPU rank's host side: its offloaded master and moments (none with
   * nvme: they are on disk), the staging, and its in-memory copies. */
  return (offload_enabled(rs) || copies != 0) &&
         over_quota(
             rs, op, name,
             copies != 0 ? "host memory (offloaded state, in-memory copies)"
                         : "optimizer state in host memory",
             "max_host_bytes", j->quota_host_bytes, rs->host_state_bytes + staging + copies_in_use,
             staging,
             (offload_enabled(rs) && !tier_enabled(j) ? offload_host_state_bytes(rs, mine) : 0) +
                 copies);
}

/* 1. This rank's layout of the unit (*mine), or a negative errno with the
 *    reason in err. A local failure still takes part in the collectives
 *    that follow, so that the other ranks fail with it instead of waiting
 *    for this one. */
static int local_layout(rank_state *rs, const Zerod__V1__RegisterUnitRequest *req,
                        uint64_t init_tag, unit_layout **mine, char *err, size_t err_bytes) {
  tensor_specs specs;
  int rc = tensor_specs_init(&specs, (unsigned)req->n_tensors);
  if (rc == 0) {
    for (unsigned t = 0; t < specs.n; t++) {
      specs.names[t] = req->tensors[t]->name;
      specs.shapes[t] = req->tensors[t]->shape;
      specs.ndims[t] = (unsigned)req->tensors[t]->n_shape;
      specs.frozen[t] = req->tensors[t]->frozen;
    }
    rc = unit_layout_build_specs(req->name, &specs, rs->job->world_size, init_tag, mine, err,
                                 err_bytes);
    tensor_specs_free(&specs);
  }
  if (rc != 0 && err[0] == '\0')
    snprintf(err, err_bytes, "%s", strerror(-rc));
  return rc;
}

/* 2. Rank 0 reads its initial values (into *packed) before anything is
 *    broadcast, so a bad descriptor fails the registration on every rank
 *    alike. 0, or a negative errno with the reason in err. */
static int32_t read_initial_values(const exec_op *op, const unit_layout *mine, float **packed,
                                   char *err, size_t err_bytes) {
  if (op->in_fd < 0) {
    snprintf(err, err_bytes,
             "INIT_FROM_RANK0 needs rank 0's initial values (one memfd with %llu floats)",
             (unsigned long long)mine->packed_numel);
    return -EINVAL;
  }
  *packed = malloc(mine->packed_numel * sizeof(float) + 1);
  int32_t status =
      *packed == NULL ? -ENOMEM : shm_read_fd(op->in_fd, *packed, mine->packed_numel * 4);
  if (status != 0)
    snprintf(err, err_bytes, "reading rank 0's initial values (%llu bytes expected): %s",
             (unsigned long long)mine->packed_numel * 4,
             status == -EINVAL ? "file too short" : strerror(-status));
  return status;
}

/* After the exchange: answers op with what is wrong with the layouts
 * (every rank alike) and returns 1, or returns 0 when every rank registered
 * rank 0's layout. codes[r]: rank r's unit_layout_diff against rank 0 (-1:
 * nothing to compare, -2: its own layout is invalid). */
static int layouts_refused(rank_state *rs, exec_op *op, const Zerod__V1__RegisterUnitRequest *req,
                           const unit_layout *mine, const int32_t *codes, const char *err) {
  for (int r = 0; r < rs->job->world_size; r++) {
    if (codes[r] == -1)
      continue;
    if (r == rs->rank && codes[r] == -2) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, "unit '%s': %s", req->name, err);
    } else if (codes[r] == -2) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "unit '%s': the layout registered on rank %d is invalid", req->name, r);
    } else if (codes[r] == 0) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "unit layouts differ between ranks: rank %d registered a different unit name, "
                 "tensor count or initialisation than rank 0 (this rank: unit '%s' with %u "
                 "tensors)",
                 r, req->name, (unsigned)req->n_tensors);
    } else {
      char here[320];
      unit_layout_describe_tensor(mine, codes[r] - 1, here, sizeof here);
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "unit '%s': layouts differ between ranks at tensor #%d: rank %d differs from "
                 "rank 0 (this rank %d has %s)",
                 req->name, codes[r] - 1, r, rs->rank, here);
    }
    return 1;
  }
  return 0;
}

/* 3. Rank 0's descriptor to everyone; every rank compares it with its own;
 *    the comparison results go to everyone. Returns 0 when every rank has
 *    rank 0's valid layout and values, else 1 with op answered alike on
 *    every rank. */
static int exchange_layouts(rank_state *rs, exec_op *op, const Zerod__V1__RegisterUnitRequest *req,
                            const unit_layout *mine, int local_rc, int32_t init_status,
                            const char *err) {
  job *j = rs->job;
  struct {
    uint64_t desc_bytes;
    int32_t layout_ok;
    int32_t init_status;
  } head = {0, 0, 0};
  if (rs->rank == 0) {
    head.layout_ok = local_rc == 0;
    head.desc_bytes = local_rc == 0 ? mine->descriptor_bytes : 0;
    head.init_status = init_status;
  }
  uint8_t *root_desc = NULL;
  int32_t *codes = NULL;
  int rc = exec__host_broadcast(rs, &head, sizeof head, 0);
  if (rc == 0 && head.desc_bytes > (64u << 20))
    rc = -EPROTO;
  if (rc == 0 && head.desc_bytes > 0) {
    root_desc = rs->rank == 0 ? mine->descriptor : malloc(head.desc_bytes);
    rc = root_desc == NULL ? -ENOMEM : exec__host_broadcast(rs, root_desc, head.desc_bytes, 0);
  }
  /* Only once rank 0's descriptor is here: after a failed broadcast
   * (a peer that never came, a timeout) there is none to compare with. */
  int32_t my_code = local_rc != 0
                        ? -2
                        : (rc == 0 && head.desc_bytes > 0
                               ? unit_layout_diff(mine->descriptor, mine->descriptor_bytes,
                                                  root_desc, head.desc_bytes)
                               : -1);
  if (rs->rank != 0)
    free(root_desc);
  codes = calloc((size_t)j->world_size, sizeof *codes);
  if (rc == 0 && codes == NULL)
    rc = -ENOMEM;
  if (rc == 0) {
    codes[rs->rank] = my_code;
    rc = exec__host_all_gather(rs, codes, sizeof *codes);
  }
  int refused = 1;
  if (rc != 0)
    exec__op_comm_failed(rs, op, "register (layout exchange)", rc);
  else if (!head.layout_ok)
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, "unit '%s': %s", req->name,
               rs->rank == 0 ? err : "rank 0's layout is invalid");
  else if (head.init_status != 0)
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, "unit '%s': %s", req->name,
               rs->rank == 0 ? err : "rank 0's initial values are unusable");
  else
    refused = layouts_refused(rs, op, req, mine, codes, err);
  free(codes);
  return refused;
}

/* 5. This rank's shard of a unit it registers for the first time, with
 *    its initial values (6. rank 0's broadcast to every rank). Returns 0,
 *    or 1 with op answered. */
static int install_shard(rank_state *rs, exec_op *op, const Zerod__V1__RegisterUnitRequest *req,
                         unit_layout *l, int init, const float *packed) {
  job *j = rs->job;
  /* Readers of this rank look at the shard table under its lock. */
  pin_lock_shards(rs);
  int rc = exec__shard_create(rs, l);
  pin_unlock_shards(rs);
  if (rc == 0)
    rc = exec__grow_scratch(rs, init == ZEROD__V1__INIT_MODE__INIT_FROM_RANK0 ? l->padded_numel : 0,
                            0);
  if (rc != 0 && rs->tier_error[0] != '\0') { /* offload nvme: the disk, not memory */
    job_fail(j, rs->generation, "rank %d: unit '%s': %s", rs->rank, l->name, rs->tier_error);
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
               "no room for the optimizer state of unit '%s' (%llu elements) on disk: %s", l->name,
               (unsigned long long)l->shard_numel, rs->tier_error);
    return 1;
  }
  if (rc != 0) {
    job_fail(j, rs->generation, "rank %d: out of memory for unit '%s'", rs->rank, l->name);
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
               "out of memory for the shard of unit '%s' (%llu elements)", l->name,
               (unsigned long long)l->shard_numel);
    return 1;
  }
  shard *sh = &rs->shards[l->id];
  uint64_t lo = (uint64_t)rs->rank * l->shard_numel;
  if (init == ZEROD__V1__INIT_MODE__INIT_FROM_RANK0) {
    rc = broadcast_values(rs, l, packed);
    if (rc != 0) {
      exec__op_comm_failed(rs, op, "register (initial values)", rc);
      return 1;
    }
    rc = exec__state_copy(rs, sh, l, JOB_STATE_MASTER, rs->scratch + lo);
  } else if (init == ZEROD__V1__INIT_MODE__INIT_SEEDED_NORMAL) {
    rc = seed_master(rs, l, sh, req->seed, req->init_std);
  }
  if (rc == 0)
    rc = exec__refresh_working(rs, l, sh);
  /* Readers copy the shard from other threads once the unit is ready. */
  if (rc == 0)
    rc = device_sync(rs->dev);
  if (rc != 0) {
    exec__op_device_failed(rs, op, "register (initial values)", rc);
    return 1;
  }
  /* No reader looks at the shard before this: the unit becomes readable
   * (and listed) once every rank has counted itself. */
  atomic_fetch_add(&l->ready_ranks, 1);
  return 0;
}

void exec__handle_register(rank_state *rs, exec_op *op) {
  Zerod__V1__RegisterUnitRequest *req = (Zerod__V1__RegisterUnitRequest *)op->request;
  job *j = rs->job;
  unit_layout *mine = NULL;
  float *packed = NULL;
  char err[512] = "";
  if (exec__op_job_failed(rs, op))
    return;
  int init = req->init == ZEROD__V1__INIT_MODE__INIT_UNSPECIFIED
                 ? ZEROD__V1__INIT_MODE__INIT_FROM_RANK0
                 : (int)req->init;
  /* A unit of the base is tagged apart, so that it never equals a unit of
   * the same name that the job registers as its own. */
  uint64_t init_tag = req->from_base
                          ? fnv1a("from_base")
                          : (uint64_t)init ^ (init == ZEROD__V1__INIT_MODE__INIT_SEEDED_NORMAL
                                                  ? (req->seed * 31) ^ fnv1a("std")
                                                  : 0);
  int local_rc = local_layout(rs, req, init_tag, &mine, err, sizeof err);
  int32_t init_status = 0;
  if (rs->rank == 0 && local_rc == 0 && !req->from_base &&
      init == ZEROD__V1__INIT_MODE__INIT_FROM_RANK0)
    init_status = read_initial_values(op, mine, &packed, err, sizeof err);
  if (exchange_layouts(rs, op, req, mine, local_rc, init_status, err))
    goto done;
  /* Every rank has the same layout and the same base: they decide alike. */
  uint32_t base_unit = 0;
  int reorder = 0;
  if (req->from_base && exec__base_unit_refused(rs, op, mine, &base_unit, &reorder))
    goto done;
  /* The unit is the base's: in the base's order (the reply says where each
   * tensor is). Every rank rebuilds it alike. */
  if (reorder && exec__base_order(rs, base_unit, init_tag, &mine, err, sizeof err) != 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "unit '%s': %s", req->name, err);
    goto done;
  }

  /* 4. The job's quotas, before anything is published or allocated: a
   * refused unit leaves no trace. Every rank decides alike (the same
   * layout, the same units, the same accounting). A base's unit costs the
   * job nothing. */
  if (!req->from_base && quota_refused(rs, op, req->name, mine))
    goto done;

  /* 5. Publish (or find) the unit; create this rank's shard. */
  int existed = 0, conflict = 0;
  unit_layout *l = job_publish_unit(j, mine, &existed, &conflict);
  if (l == NULL) {
    exec_error(op,
               conflict ? ZEROD__V1__STATUS__STATUS_ALREADY_EXISTS
                        : ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
               conflict ? "unit '%s' is already registered with a different layout"
                        : "unit '%s': too many units (at most %d)",
               req->name, JOB_MAX_UNITS);
    goto done;
  }
  mine = NULL; /* freed by job_publish_unit if it existed, else owned by the job */
  int fresh = l->id >= rs->nshards || !rs->shards[l->id].present;
  if (fresh && req->from_base && exec__install_base_shard(rs, op, l, base_unit))
    goto done;
  if (fresh && !req->from_base && install_shard(rs, op, req, l, init, packed))
    goto done;
  Zerod__V1__RegisterUnitReply reply = ZEROD__V1__REGISTER_UNIT_REPLY__INIT;
  if (exec_unit_reply(j, l, &reply) != 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
    goto done;
  }
  reply.existed = !fresh;
  reply.from_base = req->from_base;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, &reply.base);
  exec_unit_reply_free(&reply);
  LOG_DEBUGF("unit registered", "job=%s rank=%d unit=%u numel=%llu", j->name, rs->rank, l->id,
             (unsigned long long)l->numel);
done:
  unit_layout_free(mine);
  free(packed);
}

/* Outcomes of a LOAD_UNIT's local checks, exchanged between the ranks. */
enum {
  LOAD_OK = 0,
  LOAD_UNKNOWN_UNIT = 1,
  LOAD_NO_VALUES = 2,    /* rank 0 sent no descriptor */
  LOAD_SHORT_VALUES = 3, /* rank 0's descriptor is too short or unreadable */
  LOAD_NO_MEMORY = 4,
  LOAD_NO_STATE = 5, /* the job's optimizer keeps no such state */
};

/* LOAD_UNIT: rank 0's fp32 values become the unit's master weights and
 * working copy on every rank (frozen tensors included); the optimizer
 * state and the gradient accumulators stay. The version goes up, so no
 * cached gather of the old values is served again, and a pin of the old
 * version keeps them (copy on write, as in a step). With another state the
 * values become that optimizer moment instead, and the version stays; with
 * set_step the job's step count becomes req->step. */
void exec__handle_load(rank_state *rs, exec_op *op) {
  Zerod__V1__LoadUnitRequest *req = (Zerod__V1__LoadUnitRequest *)op->request;
  job *j = rs->job;
  if (exec__op_job_failed(rs, op))
    return;
  unit_layout *l = job_unit(j, req->unit_id);
  /* Every rank has the unit from the base alike: no exchange needed. */
  if (l != NULL && l->id < rs->nshards && rs->shards[l->id].present &&
      exec__refuse_base_unit(op, &rs->shards[l->id], l, "load"))
    return;
  int32_t code = LOAD_OK;
  char err[512] = "";
  float *packed = NULL;
  int32_t *codes = NULL;
  if (l == NULL || l->id >= rs->nshards || !rs->shards[l->id].present) {
    code = LOAD_UNKNOWN_UNIT;
  } else if (!exec__has_state(rs, req->state)) {
    code = LOAD_NO_STATE;
  } else if (rs->rank == 0 && op->in_fd < 0) {
    code = LOAD_NO_VALUES;
  } else if (rs->rank == 0) {
    packed = malloc(l->packed_numel * sizeof(float) + 1);
    int rc = packed == NULL ? -ENOMEM : shm_read_fd(op->in_fd, packed, l->packed_numel * 4);
    if (rc == -ENOMEM) {
      code = LOAD_NO_MEMORY;
    } else if (rc != 0) {
      code = LOAD_SHORT_VALUES;
      snprintf(err, sizeof err, "%s", rc == -EINVAL ? "file too short" : strerror(-rc));
    }
  }
  if (code == LOAD_OK && exec__grow_scratch(rs, l->padded_numel, 0) != 0)
    code = LOAD_NO_MEMORY;

  /* Every rank learns every rank's outcome before anything is broadcast,
   * so all of them fail or none does. The all-gather also means every rank
   * has finished its previous write before any rank starts this one. */
  codes = calloc((size_t)j->world_size, sizeof *codes);
  if (codes == NULL) {
    job_fail(j, rs->generation, "rank %d: out of memory", rs->rank);
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
    goto done;
  }
  codes[rs->rank] = code;
  int rc = exec__host_all_gather(rs, codes, sizeof *codes);
  if (rc != 0) {
    exec__op_comm_failed(rs, op, "load_unit (check)", rc);
    goto done;
  }
  for (int r = 0; r < j->world_size; r++) {
    const char *name = l != NULL ? l->name : "?";
    switch (codes[r]) {
    case LOAD_OK:
      continue;
    case LOAD_UNKNOWN_UNIT:
      exec_error(op, ZEROD__V1__STATUS__STATUS_NOT_FOUND, "unknown unit id %u (register it first)",
                 req->unit_id);
      break;
    case LOAD_NO_VALUES:
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "load_unit of unit '%s' needs rank 0's values (one descriptor with %llu fp32 "
                 "values, the tensors back to back)",
                 name, l != NULL ? (unsigned long long)l->packed_numel : 0ull);
      break;
    case LOAD_SHORT_VALUES:
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "load_unit of unit '%s': reading rank 0's values (%llu bytes expected): %s", name,
                 l != NULL ? (unsigned long long)l->packed_numel * 4 : 0ull,
                 r == rs->rank ? err : "file too short or unreadable");
      break;
    case LOAD_NO_STATE:
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "load_unit of unit '%s': the job's optimizer (%s) keeps no %s", name,
                 job_optimizer_name(j->config.optimizer), exec__state_name(rs, req->state));
      break;
    default:
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                 "load_unit of unit '%s': rank %d is out of memory", name, r);
      break;
    }
    goto done;
  }

  rc = broadcast_values(rs, l, packed);
  if (rc != 0) {
    exec__op_comm_failed(rs, op, "load_unit (values)", rc);
    goto done;
  }
  shard *sh = &rs->shards[l->id];
  uint64_t lo = (uint64_t)rs->rank * l->shard_numel;
  if ((uint32_t)req->state == JOB_STATE_MASTER) {
    pin_mark_changing(rs, l);
    pin_begin_write(rs);
    rc = exec__state_copy(rs, sh, l, JOB_STATE_MASTER, rs->scratch + lo);
    if (rc == 0)
      rc = exec__refresh_working(rs, l, sh);
    /* Readers copy the working copy once the write lock is released. */
    if (rc == 0)
      rc = device_sync(rs->dev);
    pin_end_write(rs);
  } else {
    /* A moment: no working copy changes, so readers see no new version. */
    rc = exec__state_copy(rs, sh, l, req->state, rs->scratch + lo);
    if (rc == 0)
      rc = device_sync(rs->dev);
  }
  if (rc == 0 && req->set_step)
    atomic_store(&rs->step, req->step);
  if (rc != 0) {
    exec__op_device_failed(rs, op, "load_unit", rc);
    goto done;
  }
  LOG_DEBUGF("unit loaded", "job=%s rank=%d unit=%u state=%s version=%llu", j->name, rs->rank,
             l->id, exec__state_name(rs, req->state), (unsigned long long)rs->version);
  Zerod__V1__LoadUnitReply reply = ZEROD__V1__LOAD_UNIT_REPLY__INIT;
  reply.unit_id = l->id;
  reply.version = rs->version;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT_REPLY, &reply.base);
done:
  free(packed);
  free(codes);
}
