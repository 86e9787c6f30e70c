/* ckpt_source: a checkpoint directory read by element ranges (ckpt.h,
 * ckpt_source_*): its manifest loaded once, each rank's shard file opened
 * and checked on first use, a unit's state read across the ranks that
 * hold it. A restore that re-shards reads through it. */
#include "ckpt.h"
#include "ckpt_impl.h"
#include "ckpt_io.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

struct ckpt_source {
  char *dir;
  ckpt_manifest manifest;
  uint64_t data_bytes;    /* of each shard file */
  uint64_t *unit_offsets; /* [nunits]: where each unit's states start in the data */
  ckpt_reader **readers;  /* [world_size], opened on first use */
};

int ckpt_source_open(const char *dir, ckpt_source **out, char *err, size_t err_bytes) {
  *out = NULL;
  ckpt_source *s = calloc(1, sizeof *s);
  if (s == NULL || (s->dir = strdup(dir)) == NULL) {
    free(s);
    return ckpt_fail(err, err_bytes, -ENOMEM, "out of memory opening %s", dir);
  }
  int rc = ckpt_manifest_load(dir, CKPT_MANIFEST_NAME, 0, &s->manifest, err, err_bytes);
  if (rc != 0) {
    ckpt_source_close(s);
    return rc;
  }
  const ckpt_manifest *m = &s->manifest;
  s->unit_offsets = calloc(m->nunits > 0 ? m->nunits : 1, sizeof *s->unit_offsets);
  s->readers = calloc(m->world_size, sizeof *s->readers);
  if (s->unit_offsets == NULL || s->readers == NULL) {
    ckpt_source_close(s);
    return ckpt_fail(err, err_bytes, -ENOMEM, "out of memory opening %s", dir);
  }
  /* ckpt_data_offset walks the units; a restore reads every unit, so the
   * offsets are summed once here. */
  uint64_t at = 0;
  for (unsigned u = 0; u < m->nunits; u++) {
    s->unit_offsets[u] = at;
    at += m->units[u].shard_numel * 4 * ckpt_nstates(m);
  }
  s->data_bytes = ckpt_shard_data_bytes(m); /* the states, then any feedback */
  *out = s;
  return 0;
}

const ckpt_manifest *ckpt_source_manifest(const ckpt_source *s) {
  return &s->manifest;
}

/* Rank k's reader, opened and checked on first use. Besides what the
 * reader checks against the manifest (size, rank, world size, data
 * bytes), the header's job id and step must be the manifest's: a shard
 * file of the same size left from another save would otherwise pass, as
 * a restore checks only the blocks it reads, not the whole-file XXH64. */
static int source_reader(ckpt_source *s, uint32_t k, ckpt_reader **out, char *err,
                         size_t err_bytes) {
  const ckpt_manifest *m = &s->manifest;
  if (s->readers[k] == NULL) {
    char *path = ckpt_join_path(s->dir, m->files[k].name);
    if (path == NULL)
      return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", m->files[k].name);
    ckpt_shard_header expect = {.rank = k,
                                .world_size = m->world_size,
                                .job_id = m->job_id,
                                .step = m->step,
                                .data_bytes = s->data_bytes};
    ckpt_reader *r;
    int rc = ckpt_reader_open(path, m->files[k].bytes, &expect, &r, err, err_bytes);
    free(path);
    if (rc != 0)
      return rc;
    const ckpt_shard_header *h = ckpt_reader_header(r);
    if (h->job_id != m->job_id || h->step != m->step) {
      rc = ckpt_fail(err, err_bytes, -EBADMSG,
                     "%s: header says job id %" PRIu64 " at step %" PRIu64
                     ", the manifest job id %" PRIu64 " at step %" PRIu64,
                     m->files[k].name, h->job_id, h->step, m->job_id, m->step);
      ckpt_reader_close(r);
      return rc;
    }
    s->readers[k] = r;
  }
  *out = s->readers[k];
  return 0;
}

int ckpt_source_read(ckpt_source *s, unsigned unit, ckpt_state state, uint64_t from, uint64_t to,
                     float *dst, char *err, size_t err_bytes) {
  const ckpt_manifest *m = &s->manifest;
  int slot = ckpt__state_slot(m, state);
  if (unit >= m->nunits)
    return ckpt_fail(err, err_bytes, -EINVAL, "checkpoint has no unit %u (it has %u)", unit,
                     m->nunits);
  if (slot < 0)
    return ckpt_fail(err, err_bytes, -EINVAL, "checkpoint has no state %d", (int)state);
  const ckpt_unit *u = &m->units[unit];
  if (from > to || to > u->padded_numel)
    return ckpt_fail(err, err_bytes, -ERANGE,
                     "unit '%s': elements %" PRIu64 "..%" PRIu64 " are outside 0..%" PRIu64,
                     u->name, from, to, u->padded_numel);
  uint64_t state_offset = s->unit_offsets[unit] + (uint64_t)slot * u->shard_numel * 4;
  /* Rank k holds elements [k * shard_numel, (k + 1) * shard_numel). */
  while (from < to) {
    uint32_t k = (uint32_t)(from / u->shard_numel);
    uint64_t rank_end = ((uint64_t)k + 1) * u->shard_numel;
    uint64_t chunk_end = to < rank_end ? to : rank_end;
    ckpt_reader *r = NULL;
    int rc = source_reader(s, k, &r, err, err_bytes);
    if (rc == 0)
      rc = ckpt_reader_read(r, state_offset + (from - (uint64_t)k * u->shard_numel) * 4, dst,
                            (size_t)((chunk_end - from) * 4), err, err_bytes);
    if (rc != 0)
      return rc;
    dst += chunk_end - from;
    from = chunk_end;
  }
  return 0;
}

int ckpt_source_read_feedback(ckpt_source *s, unsigned unit, uint32_t rank, float *dst, char *err,
                              size_t err_bytes) {
  const ckpt_manifest *m = &s->manifest;
  int64_t offset = ckpt_feedback_offset(m, unit);
  if (offset < 0 || rank >= m->world_size)
    return ckpt_fail(err, err_bytes, -EINVAL,
                     "checkpoint has no error feedback of unit %u on rank %" PRIu32, unit, rank);
  ckpt_reader *r = NULL;
  int rc = source_reader(s, rank, &r, err, err_bytes);
  return rc != 0 ? rc
                 : ckpt_reader_read(r, (uint64_t)offset, dst, (size_t)(m->feedback.numel[unit] * 4),
                                    err, err_bytes);
}

void ckpt_source_close(ckpt_source *s) {
  if (s == NULL)
    return;
  for (uint32_t k = 0; s->readers != NULL && k < s->manifest.world_size; k++)
    ckpt_reader_close(s->readers[k]);
  free(s->readers);
  free(s->unit_offsets);
  ckpt_manifest_free(&s->manifest);
  free(s->dir);
  free(s);
}
