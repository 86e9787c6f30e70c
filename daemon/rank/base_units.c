/* Units of a job's base (docs/bases.md): registered by reference
 * (RegisterUnitRequest.from_base), gathered through the node's base cache,
 * and refused everything that would write them.
 *
 * A job on a base runs on the base's nodes with the base's world, so its
 * rank r finds base rank r on this node: the unit's shard on rank r is
 * base rank r's working slice itself (frozen, so nobody writes it). A
 * gather that the rank's pool cannot serve asks the cache; the ranks agree
 * whether every one of them found the unit there (one small all-reduce),
 * and if not they all-gather their slices into a new region, which the
 * cache keeps. Once a rank holds a unit (its pool's BUF_BASE slot), every
 * later gather is served from it with no collective: a job on a base moves
 * only its own units' bytes after its first pass. */
#include "exec_impl.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base_cache.h"
#include "log.h"
#include "pin.h"
#include "pool.h"
#include "shm.h"

/* Whether two tensors of one name differ in what a reference must match:
 * the shape (frozen flags may differ: the unit is frozen either way). */
static int shape_differs(const tensor_layout *mine, const tensor_layout *base) {
  if (mine->ndim != base->ndim)
    return 1;
  for (unsigned d = 0; d < mine->ndim; d++)
    if (mine->shape[d] != base->shape[d])
      return 1;
  return 0;
}

/* The index of bl's tensor named name, or -1. */
static long base_tensor(const unit_layout *bl, const char *name) {
  for (unsigned t = 0; t < bl->ntensors; t++)
    if (strcmp(bl->tensors[t].name, name) == 0)
      return (long)t;
  return -1;
}

/* The base's unit of the registration's name, once every base rank here
 * has it, or NULL. */
static unit_layout *base_unit_named(job *base, const char *name) {
  unit_layout *bl = job_unit_named(base, name); /* takes the base's mutex */
  if (bl != NULL && atomic_load(&bl->ready_ranks) < base->nranks)
    return NULL;
  return bl;
}

int exec__base_unit_refused(rank_state *rs, exec_op *op, const unit_layout *mine,
                            uint32_t *base_unit, int *reorder) {
  job *j = rs->job;
  job *base = j->base;
  if (base == NULL) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
               "unit '%s' is registered from the base, but job '%s' has no base_job", mine->name,
               j->name);
    return 1;
  }
  unit_layout *bl = base_unit_named(base, mine->name);
  pthread_mutex_lock(&base->mutex);
  uint32_t base_units = base->nunits;
  pthread_mutex_unlock(&base->mutex);
  if (bl == NULL && base_units == 0) {
    /* A restarted daemon: the coordinator restores the base from its
     * checkpoint (docs/bases.md, "Restarts"). */
    exec_error(op, ZEROD__V1__STATUS__STATUS_UNAVAILABLE,
               "unit '%s': base '%s' holds no units on this node yet (after a restart it is "
               "restored from its checkpoint); retry",
               mine->name, base->name);
    return 1;
  }
  if (bl == NULL) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
               "unit '%s': base '%s' has no unit of that name", mine->name, base->name);
    return 1;
  }
  if (mine->ntensors != bl->ntensors) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
               "unit '%s': %u tensors, the base's unit has %u", mine->name, mine->ntensors,
               bl->ntensors);
    return 1;
  }
  /* Tensors are matched by name: a base made from a safetensors file has
   * its own order (ckpt/st_units.c). */
  *reorder = 0;
  for (unsigned t = 0; t < mine->ntensors; t++) {
    long at = base_tensor(bl, mine->tensors[t].name);
    if (at < 0 || shape_differs(&mine->tensors[t], &bl->tensors[at])) {
      char here[320], there[320];
      unit_layout_describe_tensor(mine, (int32_t)t, here, sizeof here);
      unit_layout_describe_tensor(bl, (int32_t)(at < 0 ? t : (unsigned)at), there, sizeof there);
      exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                 "unit '%s', tensor #%u: %s here, %s in base '%s'", mine->name, t, here,
                 at < 0 ? "no tensor of that name" : there, base->name);
      return 1;
    }
    *reorder |= at != (long)t;
  }
  *base_unit = bl->id;
  return 0;
}

int exec__base_order(rank_state *rs, uint32_t base_unit, uint64_t init_tag, unit_layout **mine,
                     char *err, size_t err_bytes) {
  unit_layout *bl = job_unit(rs->job->base, base_unit);
  const unit_layout *old = *mine;
  tensor_specs specs;
  int rc = tensor_specs_init(&specs, bl->ntensors);
  if (rc == 0) {
    for (unsigned t = 0; t < specs.n; t++) {
      const tensor_layout *bt = &bl->tensors[t];
      specs.names[t] = bt->name;
      specs.shapes[t] = bt->shape;
      specs.ndims[t] = bt->ndim;
      specs.frozen[t] = old->tensors[base_tensor(old, bt->name)].frozen;
    }
    unit_layout *fresh = NULL;
    rc = unit_layout_build_specs(old->name, &specs, rs->job->world_size, init_tag, &fresh, err,
                                 err_bytes);
    tensor_specs_free(&specs);
    if (rc == 0) {
      unit_layout_free(*mine);
      *mine = fresh;
    }
  }
  if (rc == -ENOMEM)
    snprintf(err, err_bytes, "out of memory");
  return rc;
}

int exec__install_base_shard(rank_state *rs, exec_op *op, unit_layout *l, uint32_t base_unit) {
  job *base = rs->job->base;
  rank_state *brs = &base->ranks[rs->rank - base->first_rank];
  /* The base is frozen: its shard table and arrays no longer change. */
  const shard *bsh = base_unit < brs->nshards ? &brs->shards[base_unit] : NULL;
  if (bsh == NULL || !bsh->present || bsh->working == NULL) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
               "unit '%s': base '%s' holds no shard of it on rank %d", l->name, base->name,
               rs->rank);
    return 1;
  }
  pin_lock_shards(rs);
  int rc = exec__shards_reserve(rs, l->id);
  if (rc == 0) {
    shard *sh = &rs->shards[l->id];
    memset(sh, 0, sizeof *sh);
    sh->working = bsh->working;
    sh->from_base = 1;
    sh->base_unit = base_unit;
    sh->gather_buf = sh->grad_buf = sh->secondary_buf = -1;
    sh->present = 1;
  }
  pin_unlock_shards(rs);
  if (rc != 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory for unit '%s'",
               l->name);
    return 1;
  }
  atomic_fetch_add(&l->ready_ranks, 1);
  return 0;
}

/* Every rank's working slice of the unit into a new region (the job's
 * collective), or a negative errno. The ranks first agree that each of
 * them has its region: one that cannot make it would otherwise leave the
 * others waiting in the all-gather until the collective timeout. */
static int gather_region(rank_state *rs, const unit_layout *l, const shard *sh, shm_region *r) {
  size_t shard_bytes = l->shard_numel * zk_dtype_size(rs->job->config.working_dtype);
  char name[96];
  snprintf(name, sizeof name, "zerod-base-%.64s-u%u", rs->job->base->name, sh->base_unit);
  int made = shm_region_create(r, name, shard_bytes * (size_t)rs->job->world_size);
  double all_made = made == 0 ? 1 : 0;
  int rc = exec__host_all_reduce_f64(rs, &all_made, 1, COMM_MIN);
  if (rc == 0 && all_made == 0)
    rc = made != 0 ? made : -ENOMEM; /* a peer's, if not this rank's */
  if (rc == 0) {
    uint8_t *mine = (uint8_t *)r->base + (size_t)rs->rank * shard_bytes;
    memcpy(mine, sh->working, shard_bytes);
    rc = comm_all_gather(rs->comm, mine, r->base, shard_bytes);
    rank_metrics_collective(rs, RANK_ALL_GATHER);
  }
  if (rc != 0 && made == 0)
    shm_region_destroy(r);
  return rc;
}

int exec__gather_from_base(rank_state *rs, const unit_layout *l, shard *sh) {
  base_cache *cache = rs->job->exec->base_cache;
  uint64_t base_id = rs->job->base->id;
  base_cache_entry *e = base_cache_get(cache, base_id, sh->base_unit);
  /* Whether every rank found it: then nobody gathers. */
  double have = e != NULL ? 1 : 0;
  int rc = exec__host_all_reduce_f64(rs, &have, 1, COMM_MIN);
  if (rc == 0 && have == 0) {
    shm_region r;
    rc = gather_region(rs, l, sh, &r);
    if (rc == 0 && e != NULL)
      shm_region_destroy(&r); /* this node had it: the others needed it */
    else if (rc == 0 && (e = base_cache_put(cache, base_id, sh->base_unit, &r)) == NULL)
      rc = -ENOMEM;
  }
  int64_t slot = rc == 0 ? pool_adopt_base(rs, cache, e, l->id) : -1;
  if (rc == 0 && slot < 0)
    rc = -ENOMEM;
  if (rc != 0) {
    base_cache_unref(cache, e);
    return rc;
  }
  sh->gather_buf = slot;
  LOG_DEBUGF("base unit gathered", "job=%s rank=%d unit=%s base=%s", rs->job->name, rs->rank,
             l->name, rs->job->base->name);
  return 0;
}

int exec__refuse_base_unit(exec_op *op, const shard *sh, const unit_layout *l, const char *what) {
  if (!sh->from_base)
    return 0;
  exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
             "%s of unit '%s': it is a unit of the job's base, frozen and read-only", what,
             l->name);
  return 1;
}
