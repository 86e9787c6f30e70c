/* The reading side of a restore (see ckpt_node.h): a rank's part of a
 * checkpoint or a safetensors file, read and verified into host memory on
 * the rank's executor, matched to the job's units, and staged until the
 * coordinator commits. */
#include "ckpt_job.h"

#include <errno.h>
#include <sys/mman.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hostmem.h"
#include "rpc.h"
#include "zerod/v1/control.pb-c.h"

/* ------------------------------------------------------------------------ */
/* Restore: reading (executor thread)                                       */
/* ------------------------------------------------------------------------ */

void ckpt_staged_free(ckpt_staged *s) {
  if (s == NULL)
    return;
  for (unsigned u = 0; u < s->nunits; u++) {
    if (s->units[u].owned)
      unit_layout_free(s->units[u].layout);
    for (int k = 0; k < 3 && s->arrays; k++)
      hostmem_array_free(s->units[u].state[k]);
    free(s->units[u].feedback);
  }
  if (!s->arrays)
    hostmem_free(s->mem, s->mem_bytes);
  free(s->units);
  free(s);
}

static void shape_text(const uint64_t *shape, unsigned ndim, char *out, size_t out_bytes) {
  size_t len = (size_t)snprintf(out, out_bytes, "[");
  for (unsigned d = 0; d < ndim && len < out_bytes; d++)
    len += (size_t)snprintf(out + len, out_bytes - len, "%s%llu", d ? ", " : "",
                            (unsigned long long)shape[d]);
  if (len < out_bytes)
    snprintf(out + len, out_bytes - len, "]");
}

/* Whether the job's unit l and the checkpoint's unit cu hold the same
 * tensors at the same places; err names the first difference. */
static int same_unit(const unit_layout *l, const ckpt_unit *cu, char *err, size_t err_bytes) {
  if (l->ntensors != cu->ntensors) {
    snprintf(err, err_bytes, "unit '%s' has %u tensors in the job, %u in the checkpoint", l->name,
             l->ntensors, cu->ntensors);
    return 0;
  }
  for (unsigned t = 0; t < l->ntensors; t++) {
    const tensor_layout *a = &l->tensors[t];
    const ckpt_tensor *b = &cu->tensors[t];
    char sa[160], sb[160];
    shape_text(a->shape, a->ndim, sa, sizeof sa);
    shape_text(b->shape, b->ndim, sb, sizeof sb);
    if (strcmp(a->name, b->name) != 0) {
      snprintf(err, err_bytes, "unit '%s': tensor #%u is '%s' in the job, '%s' in the checkpoint",
               l->name, t, a->name, b->name);
      return 0;
    }
    if (strcmp(sa, sb) != 0 || a->offset != b->offset || a->frozen != b->frozen) {
      snprintf(err, err_bytes,
               "unit '%s', tensor '%s': shape %s%s in the job, %s%s in the checkpoint", l->name,
               a->name, sa, a->frozen ? " (frozen)" : "", sb, b->frozen ? " (frozen)" : "");
      return 0;
    }
  }
  if (l->numel != cu->numel) {
    snprintf(err, err_bytes, "unit '%s': %llu elements in the job, %llu in the checkpoint", l->name,
             (unsigned long long)l->numel, (unsigned long long)cu->numel);
    return 0;
  }
  return 1;
}

static int fail(int *code, int c, int rc) {
  *code = c;
  return rc;
}

/* A format library error as a gRPC status: damaged or truncated files are
 * DATA_LOSS, a missing one NOT_FOUND. */
static int io_code(int rc) {
  return rc == -EBADMSG || rc == -ERANGE ? RPC_DATA_LOSS
         : rc == -ENOENT                 ? RPC_NOT_FOUND
         : rc == -ENOMEM                 ? RPC_RESOURCE_EXHAUSTED
                                         : RPC_INTERNAL;
}

static int optimizers_compatible(const char *saved, job_optimizer now) {
  int saved_sgd = strcmp(saved, "sgd") == 0;
  return saved_sgd == (now == JOB_SGD);
}

/* Points the states wanted of every staged unit (layouts set) at memory
 * for their values. On a host rank (st->arrays) each is an array of the
 * host device's own kind, which the rank takes as it is at the commit
 * instead of copying from it (rank/snapshot.c); otherwise they share one buffer,
 * a cache line apart. Not zeroed: the reader zeroes what it does not read
 * (zero_between). */
static size_t staged_state_bytes(const unit_layout *l) {
  return (l->shard_numel * sizeof(float) + 63) & ~(size_t)63;
}

static int stage_memory(ckpt_staged *st, const int want[3]) {
  size_t total = 0;
  for (unsigned u = 0; u < st->nunits; u++)
    for (int k = 0; k < 3; k++)
      if (want[k])
        total += staged_state_bytes(st->units[u].layout);
  st->mem_bytes = total;
  if (total == 0)
    return 0;
  if (!st->arrays && st->staging_fd >= 0) {
    /* Shared, so that the kernel may write the pages back to the file and
     * drop them: the staged state takes no more memory than the cache
     * lends it. hostmem_free unmaps it as it would memory. */
    void *p = ftruncate(st->staging_fd, (off_t)total) == 0
                  ? mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, st->staging_fd, 0)
                  : MAP_FAILED;
    if (p == MAP_FAILED)
      return -errno;
    st->mem = p;
  } else if (!st->arrays && (st->mem = hostmem_alloc(total)) == NULL) {
    return -ENOMEM;
  }
  size_t at = 0;
  for (unsigned u = 0; u < st->nunits; u++)
    for (int k = 0; k < 3; k++) {
      if (!want[k])
        continue;
      size_t bytes = staged_state_bytes(st->units[u].layout);
      float *p = st->arrays ? hostmem_array_alloc(bytes) : (float *)((uint8_t *)st->mem + at);
      if (p == NULL)
        return -ENOMEM;
      st->units[u].state[k] = p;
      at += bytes;
    }
  return 0;
}

/* A thread that faults the staged states in ahead of the reads, in the
 * order they fill them: fresh memory takes a page fault per 4 KiB, which
 * inside the reads cost more than the reads themselves
 * (docs/benchmarks.md). NULL if none could be started. */
static hostmem_ahead *stage_ahead(const ckpt_staged *st) {
  hostmem_range *ranges = calloc(3 * (size_t)st->nunits + 1, sizeof *ranges);
  if (ranges == NULL)
    return NULL;
  unsigned n = 0;
  for (unsigned u = 0; u < st->nunits; u++)
    for (int k = 0; k < 3; k++)
      if (st->units[u].state[k] != NULL)
        ranges[n++] =
            (hostmem_range){st->units[u].state[k], staged_state_bytes(st->units[u].layout)};
  hostmem_ahead *ahead = hostmem_populate_ahead_ranges(ranges, n);
  free(ranges);
  return ahead;
}

/* Zeroes elements [from, to) of a staged state: what no read fills. */
static void zero_between(float *state, uint64_t from, uint64_t to) {
  if (from < to)
    memset(state + from, 0, (to - from) * sizeof(float));
}

/* The rank's compression state (ckpt_feedback), where the checkpoint has
 * it for this job's world, nodes and kind, at the sizes the job keeps: the
 * same rank of the same layout made it. Otherwise it is dropped, and said
 * (st->feedback_dropped). */
static int read_feedback(const ckpt_job_view *j, int rank, ckpt_source *src, ckpt_staged *st,
                         char *err, size_t err_bytes) {
  const ckpt_manifest *m = ckpt_source_manifest(src);
  if (m->feedback.kind[0] == '\0' || j->feedback_kind == NULL)
    return 0;
  int same = strcmp(m->feedback.kind, j->feedback_kind) == 0 &&
             m->feedback.nodes == j->feedback_nodes && m->world_size == (uint32_t)j->world_size;
  for (unsigned u = 0; same && u < st->nunits; u++)
    same = m->feedback.numel[u] == j->feedback_numel(j->feedback_arg, st->units[u].layout);
  if (!same) {
    st->feedback_dropped = 1;
    return 0;
  }
  for (unsigned u = 0; u < st->nunits; u++) {
    ckpt_staged_unit *su = &st->units[u];
    if (m->feedback.numel[u] == 0)
      continue;
    if ((su->feedback = malloc((size_t)m->feedback.numel[u] * sizeof(float))) == NULL)
      return -ENOMEM;
    int rc = ckpt_source_read_feedback(src, u, (uint32_t)rank, su->feedback, err, err_bytes);
    if (rc != 0)
      return rc;
  }
  return 0;
}

static int read_checkpoint(const ckpt_job_view *j, int rank, const char *source, ckpt_staged *st,
                           int *code, char *err, size_t err_bytes) {
  ckpt_source *src = NULL;
  hostmem_ahead *ahead = NULL;
  int rc = ckpt_source_open(source, &src, err, err_bytes);
  if (rc != 0)
    return fail(code, io_code(rc), rc);
  const ckpt_manifest *m = ckpt_source_manifest(src);
  const job_config *cfg = j->config;
  unit_layout *const *units = j->units;
  unsigned njob = j->nunits;
  if (!optimizers_compatible(m->config.optimizer, cfg->optimizer)) {
    snprintf(err, err_bytes, "the checkpoint was saved by a job using %s; job '%s' uses %s",
             m->config.optimizer, j->name, job_optimizer_name(cfg->optimizer));
    rc = fail(code, RPC_FAILED_PRECONDITION, -EINVAL);
    goto done;
  }
  if (njob != 0 && njob != m->nunits) {
    snprintf(err, err_bytes, "job '%s' has %u units, the checkpoint %u", j->name, njob, m->nunits);
    rc = fail(code, RPC_FAILED_PRECONDITION, -EINVAL);
    goto done;
  }
  st->nunits = m->nunits;
  st->units = calloc(m->nunits ? m->nunits : 1, sizeof *st->units);
  if (st->units == NULL) {
    rc = fail(code, RPC_RESOURCE_EXHAUSTED, -ENOMEM);
    goto done;
  }
  st->step = m->step;
  int has[JOB_NSTATES];
  job_config_states(cfg, has);
  int need1 = has[JOB_STATE_MOMENT1] && !j->weights_only;
  int need2 = has[JOB_STATE_MOMENT2] && !j->weights_only;
  for (unsigned u = 0; u < m->nunits; u++) {
    const ckpt_unit *cu = &m->units[u];
    ckpt_staged_unit *su = &st->units[u];
    if (njob == 0) {
      /* A job with no units yet takes the checkpoint's: built as a worker's
       * registration would build them, for this job's world size. */
      tensor_specs specs;
      rc = tensor_specs_init(&specs, cu->ntensors);
      if (rc == 0) {
        for (unsigned t = 0; t < cu->ntensors; t++) {
          specs.names[t] = cu->tensors[t].name;
          specs.shapes[t] = cu->tensors[t].shape;
          specs.ndims[t] = cu->tensors[t].ndim;
          specs.frozen[t] = cu->tensors[t].frozen;
        }
        rc = unit_layout_build_specs(cu->name, &specs, j->world_size, 0, &su->layout, err,
                                     err_bytes);
        tensor_specs_free(&specs);
      }
      if (rc != 0) {
        rc = fail(code, rc == -ENOMEM ? RPC_RESOURCE_EXHAUSTED : RPC_FAILED_PRECONDITION, rc);
        goto done;
      }
      su->owned = 1;
      if (!same_unit(su->layout, cu, err, err_bytes)) {
        rc = fail(code, RPC_FAILED_PRECONDITION, -EINVAL);
        goto done;
      }
    } else {
      unit_layout *l = NULL;
      for (unsigned k = 0; k < njob && l == NULL; k++)
        if (strcmp(units[k]->name, cu->name) == 0)
          l = units[k];
      if (l == NULL) {
        snprintf(err, err_bytes, "the checkpoint's unit '%s' is not registered in job '%s'",
                 cu->name, j->name);
        rc = fail(code, RPC_FAILED_PRECONDITION, -EINVAL);
        goto done;
      }
      if (!same_unit(l, cu, err, err_bytes)) {
        rc = fail(code, RPC_FAILED_PRECONDITION, -EINVAL);
        goto done;
      }
      su->layout = l;
    }
  }
  /* This rank's slice of every unit in the job's world, by state; beyond
   * the tensors (padding) it is zero. */
  const int want[3] = {1, need1 && m->has_moment1, need2 && m->has_moment2};
  if ((rc = stage_memory(st, want)) != 0) {
    rc = fail(code, RPC_RESOURCE_EXHAUSTED, rc);
    goto done;
  }
  ahead = stage_ahead(st);
  for (unsigned u = 0; u < m->nunits; u++) {
    const unit_layout *l = st->units[u].layout;
    uint64_t lo = (uint64_t)rank * l->shard_numel;
    uint64_t hi = lo + l->shard_numel < l->numel ? lo + l->shard_numel : l->numel;
    hi = hi > lo ? hi : lo;
    ckpt_state states[3] = {CKPT_MASTER, CKPT_MOMENT1, CKPT_MOMENT2};
    for (int k = 0; k < 3; k++) {
      ckpt_staged_unit *su = &st->units[u];
      if (su->state[k] == NULL)
        continue;
      if (lo < hi) {
        rc = ckpt_source_read(src, u, states[k], lo, hi, su->state[k], err, err_bytes);
        if (rc != 0) {
          rc = fail(code, io_code(rc), rc);
          goto done;
        }
      }
      zero_between(su->state[k], hi - lo, l->shard_numel);
    }
  }
  if ((rc = read_feedback(j, rank, src, st, err, err_bytes)) != 0) {
    rc = fail(code, rc == -ENOMEM ? RPC_RESOURCE_EXHAUSTED : io_code(rc), rc);
    goto done;
  }
  rc = 0;
done:
  hostmem_populate_stop(ahead);
  ckpt_source_close(src);
  return rc;
}

static int read_safetensors(const ckpt_job_view *j, int rank, const char *source, ckpt_staged *st,
                            int *code, char *err, size_t err_bytes) {
  st_file f = {0};
  int fd = -1;
  hostmem_ahead *ahead = NULL;
  int rc = st_open(source, &f, &fd, err, err_bytes);
  if (rc != 0)
    return fail(code, rc == -ENOENT ? RPC_NOT_FOUND : RPC_INVALID_ARGUMENT, rc);
  unsigned njob = j->nunits;
  unit_layout *const *units = j->units;
  unit_layout **made = NULL; /* a job with no units takes the file's */
  int handed = 0;            /* made's layouts are the staging's */
  if (njob == 0) {
    rc = st_units_build(&f, j->world_size, &made, &njob, err, err_bytes);
    if (rc != 0) {
      rc = fail(code, rc == -ENOMEM ? RPC_RESOURCE_EXHAUSTED : RPC_INVALID_ARGUMENT, rc);
      goto done;
    }
    units = made;
  }
  /* Every tensor is checked on every rank, so all ranks fail alike. */
  for (unsigned u = 0; u < njob; u++) {
    const unit_layout *l = units[u];
    for (unsigned t = 0; t < l->ntensors; t++) {
      const tensor_layout *tl = &l->tensors[t];
      const st_tensor *ft = st_find(&f, tl->name);
      char sa[160], sb[160];
      shape_text(tl->shape, tl->ndim, sa, sizeof sa);
      if (ft == NULL) {
        snprintf(err, err_bytes, "tensor '%s' (unit '%s', shape %s) is not in %s", tl->name,
                 l->name, sa, source);
        rc = fail(code, RPC_INVALID_ARGUMENT, -EINVAL);
        goto done;
      }
      shape_text(ft->shape, ft->ndim, sb, sizeof sb);
      if (strcmp(sa, sb) != 0 && !(ft->numel == tl->numel && tl->ndim == 0)) {
        snprintf(err, err_bytes, "tensor '%s' (unit '%s'): shape %s in the job, %s in %s", tl->name,
                 l->name, sa, sb, source);
        rc = fail(code, RPC_INVALID_ARGUMENT, -EINVAL);
        goto done;
      }
      if (ft->dtype == ST_OTHER) {
        snprintf(err, err_bytes, "tensor '%s': dtype %s is not a floating-point type", tl->name,
                 ft->dtype_name);
        rc = fail(code, RPC_INVALID_ARGUMENT, -EINVAL);
        goto done;
      }
    }
  }
  st->nunits = njob;
  st->units = calloc(njob, sizeof *st->units);
  if (st->units == NULL) {
    rc = fail(code, RPC_RESOURCE_EXHAUSTED, -ENOMEM);
    goto done;
  }
  st->step = 0; /* weights only: the optimizer starts over */
  for (unsigned u = 0; u < njob; u++) {
    st->units[u].layout = units[u];
    st->units[u].owned = made != NULL; /* the staging frees them from here on */
  }
  handed = made != NULL;
  if ((rc = stage_memory(st, (const int[3]){1, 0, 0})) != 0) {
    rc = fail(code, RPC_RESOURCE_EXHAUSTED, rc);
    goto done;
  }
  ahead = stage_ahead(st);
  for (unsigned u = 0; u < njob; u++) {
    const unit_layout *l = units[u];
    float *master = st->units[u].state[CKPT_MASTER];
    uint64_t lo = (uint64_t)rank * l->shard_numel, hi = lo + l->shard_numel, at = lo;
    for (unsigned t = 0; t < l->ntensors; t++) { /* by offset: alignment gaps between */
      const tensor_layout *tl = &l->tensors[t];
      uint64_t b = tl->offset > lo ? tl->offset : lo;
      uint64_t e = tl->offset + tl->numel < hi ? tl->offset + tl->numel : hi;
      if (b >= e)
        continue;
      zero_between(master, at - lo, b - lo);
      rc = st_read_f32(fd, &f, st_find(&f, tl->name), b - tl->offset, e - tl->offset,
                       master + (b - lo), err, err_bytes);
      if (rc != 0) {
        rc = fail(code, io_code(rc), rc);
        goto done;
      }
      at = e;
    }
    zero_between(master, at - lo, hi - lo);
  }
  rc = 0;
done:
  for (unsigned u = 0; made != NULL && !handed && u < njob; u++)
    unit_layout_free(made[u]);
  free(made);
  hostmem_populate_stop(ahead);
  if (fd >= 0)
    close(fd);
  st_file_free(&f);
  return rc;
}

int ckpt_restore_read(const ckpt_job_view *j, int rank, const char *source, int format,
                      int host_arrays, int staging_fd, ckpt_staged **out, int *code, char *err,
                      size_t err_bytes) {
  *out = NULL;
  *code = 0;
  ckpt_staged *st = calloc(1, sizeof *st);
  if (st == NULL)
    return fail(code, RPC_RESOURCE_EXHAUSTED, -ENOMEM);
  st->arrays = host_arrays;
  st->staging_fd = host_arrays ? -1 : staging_fd;
  int rc;
  if (format == ZEROD__V1__RESTORE_FORMAT__RESTORE_FORMAT_SAFETENSORS) {
    rc = read_safetensors(j, rank, source, st, code, err, err_bytes);
  } else if (format == ZEROD__V1__RESTORE_FORMAT__RESTORE_FORMAT_CHECKPOINT) {
    rc = read_checkpoint(j, rank, source, st, code, err, err_bytes);
  } else {
    snprintf(err, err_bytes, "unknown restore format %d", format);
    rc = fail(code, RPC_INVALID_ARGUMENT, -EINVAL);
  }
  if (rc != 0) {
    ckpt_staged_free(st);
    return rc;
  }
  *out = st;
  return 0;
}
