/* ckpt_impl: what the parts of the checkpoint format (ckpt.h) share and
 * nothing outside daemon/ckpt/ sees: limits both the manifest and the
 * shard files check, the shard file's layout arithmetic, its header's
 * codec, and the tenant rule. Included only by daemon/ckpt/'s own .c
 * files that implement ckpt.h (the formats are described there and in
 * the file that owns each). */
#ifndef ZEROD_CKPT_IMPL_H
#define ZEROD_CKPT_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"

/* Shard data is copied between files and float arrays as it is. */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shard files are little-endian and read in place: a little-endian host is needed"
#endif

/* manifest.json's "format". */
#define MANIFEST_FORMAT "zerod-checkpoint"
/* The most ranks a checkpoint may have (manifest and shard header). */
#define MAX_WORLD_SIZE 4096u
/* A shard file ends with the XXH64 of its block table. */
#define FOOTER_BYTES 8u

/* Blocks of data_bytes (the last one may be short). */
uint64_t ckpt__block_count(uint64_t data_bytes);

/* The size of a shard file holding data_bytes, or -ERANGE when it would
 * not fit in an off_t (the limit of every file offset we compute). */
int ckpt__shard_file_bytes(uint64_t data_bytes, uint64_t *out);

/* Which of a unit's state slots holds state, or -1 if m has no such state. */
int ckpt__state_slot(const ckpt_manifest *m, ckpt_state state);

/* A shard header's CKPT_HEADER_BYTES (with its checksum). */
void ckpt__header_encode(const ckpt_shard_header *h, uint8_t *out);

/* Decodes and checks a shard header (magic, checksum, version, block
 * size, reserved bytes, rank and world size, a data size whose file fits
 * an off_t: *file_bytes). Returns 0, or -EBADMSG / -ERANGE with a message
 * naming the file (name). */
int ckpt__header_decode(const uint8_t *in, const char *name, ckpt_shard_header *h,
                        uint64_t *file_bytes, char *err, size_t err_bytes);

/* Why tenant (len bytes) is not a tenant's name, or NULL: "" (none), or
 * 1..CKPT_TENANT_MAX_BYTES of [A-Za-z0-9._-]. */
const char *ckpt__tenant_problem(const char *tenant, size_t len);

#endif /* ZEROD_CKPT_IMPL_H */
