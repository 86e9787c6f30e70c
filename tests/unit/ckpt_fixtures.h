/* ckpt_fixtures.h - what the checkpoint tests share (test_ckpt.c,
 * test_ckpt_shard.c, test_ckpt_source.c, test_ckpt_safetensors.c): scratch
 * directories under /tmp and whole-file helpers, manifests built from unit
 * specs, and a field-by-field comparison of two manifests. Include after
 * testutil.h (cmocka). */
#ifndef ZEROD_TESTS_CKPT_FIXTURES_H
#define ZEROD_TESTS_CKPT_FIXTURES_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"

/* A new empty directory under /tmp; its name, malloc'd. */
char *make_dir(void);
/* Removes dir and the files in it (no subdirectories), and frees dir. */
void remove_dir(char *dir);
/* "dir/file", malloc'd. */
char *path_in(const char *dir, const char *file);
/* Whether path exists. */
int file_exists(const char *path);
/* The size of path, which must exist. */
uint64_t file_size(const char *path);
/* The whole of path (malloc'd), its size in *len. */
uint8_t *read_whole(const char *path, size_t *len);
/* Writes bytes as the whole of path (created or truncated, mode 0600). */
void write_whole(const char *path, const void *bytes, size_t len);
/* Flips one bit of the byte at offset in path. */
void flip_byte(const char *path, uint64_t offset);
/* Fails unless rc is expect_rc and err contains part. */
void expect_error(int rc, int expect_rc, const char *err, const char *part);

typedef struct tensor_spec {
  const char *name;
  unsigned ndim;
  uint64_t shape[3];
  uint64_t gap_before; /* unused elements before it in the unit */
  int frozen;
} tensor_spec;

typedef struct unit_spec {
  const char *name;
  unsigned ntensors;
  tensor_spec tensors[3];
  uint64_t extra_shard_numel; /* beyond ceil(numel / world) */
} unit_spec;

/* Fills m for world ranks with specs' units, and its files if with_files. */
void build_manifest(ckpt_manifest *m, uint32_t world, const unit_spec *specs, unsigned nunits,
                    int with_files);
/* Fails unless a and b are equal in every field, doubles bit for bit. */
void assert_manifests_equal(const ckpt_manifest *a, const ckpt_manifest *b);

#endif /* ZEROD_TESTS_CKPT_FIXTURES_H */
