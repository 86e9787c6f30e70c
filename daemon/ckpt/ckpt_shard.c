/* ckpt_shard: the shard file's layout (ckpt.h): its name, its size and
 * where each unit's state lies in its data, and its header's codec
 * (ckpt_impl.h), shared by the writer (ckpt_shard_writer.c) and the
 * readers (ckpt_shard_reader.c, ckpt_source.c).
 *
 * Shard file header (CKPT_HEADER_BYTES, little-endian):
 *   0 magic "ZDSHARD\0"   8 u32 format version   12 u32 rank   16 u32 world size
 *   20 u32 block bytes   24 u64 job id   32 u64 step   40 u64 data bytes
 *   48..4087 zero   4088 u64 XXH64 of bytes 0..4087
 * The reserved bytes must be zero so that a later version can give them a
 * meaning that an old reader refuses instead of ignoring. */
#include "ckpt.h"
#include "ckpt_impl.h"
#include "ckpt_io.h"
#include "little_endian.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include <xxhash.h>

#define HEADER_MAGIC       "ZDSHARD"
#define HEADER_CHECKSUM_AT (CKPT_HEADER_BYTES - 8)
#define HEADER_FIXED_BYTES 48u

/* ------------------------------------------------------------------------
 * Sizes and offsets
 * ------------------------------------------------------------------------ */

uint64_t ckpt__block_count(uint64_t data_bytes) {
  return data_bytes / CKPT_BLOCK_BYTES + (data_bytes % CKPT_BLOCK_BYTES != 0);
}

int ckpt__shard_file_bytes(uint64_t data_bytes, uint64_t *out) {
  const uint64_t max = (uint64_t)INT64_MAX;
  if (data_bytes > max)
    return -ERANGE;
  /* The table is at most data_bytes / 2^17 + 8 bytes, so the sum below
   * stays far from wrapping even for data_bytes near 2^63. */
  uint64_t total =
      CKPT_HEADER_BYTES + data_bytes + 8 * ckpt__block_count(data_bytes) + FOOTER_BYTES;
  if (total > max)
    return -ERANGE;
  *out = total;
  return 0;
}

void ckpt_shard_name(uint32_t rank, uint32_t world_size, char *out, size_t out_bytes) {
  snprintf(out, out_bytes, "rank-%05" PRIu32 "-of-%05" PRIu32 ".zdshard", rank, world_size);
}

unsigned ckpt_nstates(const ckpt_manifest *m) {
  return 1u + (m->has_moment1 != 0) + (m->has_moment2 != 0);
}

uint64_t ckpt_shard_data_bytes(const ckpt_manifest *m) {
  uint64_t bytes = 0;
  for (unsigned u = 0; u < m->nunits; u++)
    bytes += m->units[u].shard_numel * 4 * ckpt_nstates(m) +
             (m->feedback.numel != NULL ? m->feedback.numel[u] * 4 : 0);
  return bytes;
}

int64_t ckpt_feedback_offset(const ckpt_manifest *m, unsigned unit) {
  if (unit >= m->nunits || m->feedback.numel == NULL)
    return -1;
  uint64_t offset = 0;
  for (unsigned u = 0; u < m->nunits; u++)
    offset += m->units[u].shard_numel * 4 * ckpt_nstates(m);
  for (unsigned u = 0; u < unit; u++)
    offset += m->feedback.numel[u] * 4;
  return (int64_t)offset;
}

int ckpt__state_slot(const ckpt_manifest *m, ckpt_state state) {
  switch (state) {
  case CKPT_MASTER:
    return 0;
  case CKPT_MOMENT1:
    return m->has_moment1 ? 1 : -1;
  case CKPT_MOMENT2:
    return m->has_moment2 ? 1 + (m->has_moment1 != 0) : -1;
  }
  return -1;
}

int64_t ckpt_data_offset(const ckpt_manifest *m, unsigned unit, ckpt_state state) {
  int slot = ckpt__state_slot(m, state);
  if (unit >= m->nunits || slot < 0)
    return -1;
  uint64_t offset = 0;
  for (unsigned u = 0; u < unit; u++)
    offset += m->units[u].shard_numel * 4 * ckpt_nstates(m);
  return (int64_t)(offset + (uint64_t)slot * m->units[unit].shard_numel * 4);
}

uint64_t ckpt_shard_file_bytes(const ckpt_manifest *m) {
  uint64_t data_bytes = ckpt_shard_data_bytes(m);
  return CKPT_HEADER_BYTES + data_bytes + 8 * ckpt__block_count(data_bytes) + FOOTER_BYTES;
}

/* ------------------------------------------------------------------------
 * The header
 * ------------------------------------------------------------------------ */

void ckpt__header_encode(const ckpt_shard_header *h, uint8_t *out) {
  memset(out, 0, CKPT_HEADER_BYTES);
  memcpy(out, HEADER_MAGIC, sizeof HEADER_MAGIC); /* with its NUL: 8 bytes */
  le_put32(out + 8, CKPT_FORMAT_VERSION);
  le_put32(out + 12, h->rank);
  le_put32(out + 16, h->world_size);
  le_put32(out + 20, CKPT_BLOCK_BYTES);
  le_put64(out + 24, h->job_id);
  le_put64(out + 32, h->step);
  le_put64(out + 40, h->data_bytes);
  le_put64(out + HEADER_CHECKSUM_AT, XXH64(out, HEADER_CHECKSUM_AT, 0));
}

/* The magic first (is this a shard file at all?), then the checksum, so
 * that a damaged field reads as damage rather than as a strange value. */
int ckpt__header_decode(const uint8_t *in, const char *name, ckpt_shard_header *h,
                        uint64_t *file_bytes, char *err, size_t err_bytes) {
  if (memcmp(in, HEADER_MAGIC, sizeof HEADER_MAGIC) != 0)
    return ckpt_fail(err, err_bytes, -EBADMSG, "%s: not a zerod shard file (bad magic)", name);
  uint64_t stored = le_get64(in + HEADER_CHECKSUM_AT);
  uint64_t actual = XXH64(in, HEADER_CHECKSUM_AT, 0);
  if (stored != actual)
    return ckpt_fail(err, err_bytes, -EBADMSG,
                     "%s: header checksum mismatch (stored %016" PRIx64 ", computed %016" PRIx64
                     ")",
                     name, stored, actual);
  uint32_t version = le_get32(in + 8), block_bytes = le_get32(in + 20);
  if (version != CKPT_FORMAT_VERSION)
    return ckpt_fail(err, err_bytes, -EBADMSG, "%s: format version %" PRIu32 ", this reads %d",
                     name, version, CKPT_FORMAT_VERSION);
  if (block_bytes != CKPT_BLOCK_BYTES)
    return ckpt_fail(err, err_bytes, -EBADMSG, "%s: block size %" PRIu32 ", this reads %u", name,
                     block_bytes, CKPT_BLOCK_BYTES);
  for (size_t i = HEADER_FIXED_BYTES; i < HEADER_CHECKSUM_AT; i++)
    if (in[i] != 0)
      return ckpt_fail(err, err_bytes, -EBADMSG, "%s: reserved header byte %zu is not zero", name,
                       i);
  h->rank = le_get32(in + 12);
  h->world_size = le_get32(in + 16);
  h->job_id = le_get64(in + 24);
  h->step = le_get64(in + 32);
  h->data_bytes = le_get64(in + 40);
  if (h->world_size == 0 || h->world_size > MAX_WORLD_SIZE || h->rank >= h->world_size)
    return ckpt_fail(err, err_bytes, -EBADMSG, "%s: rank %" PRIu32 " of world size %" PRIu32, name,
                     h->rank, h->world_size);
  if (ckpt__shard_file_bytes(h->data_bytes, file_bytes) != 0)
    return ckpt_fail(err, err_bytes, -ERANGE, "%s: %" PRIu64 " data bytes is too large", name,
                     h->data_bytes);
  return 0;
}
