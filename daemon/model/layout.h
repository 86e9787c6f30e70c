/* layout: how a unit's tensors lie in its flat buffer and in the ranks'
 * shards (docs/architecture.md).
 *
 * A unit is an ordered list of tensors laid out back to back in one flat
 * buffer (each tensor aligned), padded so that its length divides evenly
 * by the world size; rank r owns the contiguous slice
 * [r * shard_numel, (r + 1) * shard_numel). Every rank builds the layout
 * from what its worker registered; the canonical descriptor bytes are what
 * ranks compare to agree that they registered the same unit. */
#ifndef ZEROD_LAYOUT_H
#define ZEROD_LAYOUT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* Tensors start at a multiple of this many elements (64 bytes of fp32), and
 * shards are multiples of it, so every shard and tensor is vector aligned. */
#define JOB_ALIGN_NUMEL 16

typedef struct tensor_layout {
  char *name;
  uint64_t shape[8];
  unsigned ndim;
  uint64_t numel;
  uint64_t offset; /* elements from the start of the flat buffer */
  int frozen;
} tensor_layout;

typedef struct unit_layout {
  uint32_t id;
  char *name;
  unsigned ntensors;
  tensor_layout *tensors;
  uint64_t numel;        /* end of the last tensor */
  uint64_t packed_numel; /* sum of the tensors' numel (initial values) */
  uint64_t padded_numel; /* multiple of world * JOB_ALIGN_NUMEL */
  uint64_t shard_numel;
  int trainable;       /* a tensor is not frozen: a step changes the unit */
  uint8_t *descriptor; /* canonical bytes compared across ranks */
  size_t descriptor_bytes;
  /* Ranks whose shard of the unit holds its initial values. A unit is
   * listed (UNITS) and readable by read-only sessions once every rank has
   * it; a rank counts itself when its registration is complete. */
  _Atomic int ready_ranks;
  /* The job version at which the unit's values last changed (a step of a
   * unit with trainable tensors, a load, a restore; 0: not since it was
   * registered): what a subscriber's WATCH lists (node/reader_watch.c).
   * Raised by each rank before its version moves (pin_mark_changing). */
  _Atomic uint64_t changed_version;
} unit_layout;

/* Builds a unit layout from names, shapes and flags; err on failure. */
int unit_layout_build(const char *name, unsigned ntensors, const char *const *tensor_names,
                      const uint64_t *const *shapes, const unsigned *ndims, const int *frozen,
                      int world_size, uint64_t init_tag, unit_layout **out, char *err,
                      size_t err_bytes);
void unit_layout_free(unit_layout *layout);

/* The tensors unit_layout_build takes, as its four arrays, for n tensors:
 * filled by the caller (names and shapes point to its memory). */
typedef struct tensor_specs {
  unsigned n;
  const char **names;
  const uint64_t **shapes;
  unsigned *ndims;
  int *frozen;
} tensor_specs;

/* Zeroed arrays for n tensors: 0, or -ENOMEM with nothing held. */
int tensor_specs_init(tensor_specs *s, unsigned n);
void tensor_specs_free(tensor_specs *s);
/* unit_layout_build of s's tensors. */
int unit_layout_build_specs(const char *name, const tensor_specs *s, int world_size,
                            uint64_t init_tag, unit_layout **out, char *err, size_t err_bytes);

/* The first chunk of two descriptors that differs (0: the unit's own
 * chunk, t + 1: tensor t), or -1 if they are equal. */
int32_t unit_layout_diff(const uint8_t *a, size_t a_bytes, const uint8_t *b, size_t b_bytes);

/* Describes tensor `index` of a layout (name, shape, frozen) for an error
 * message; "(none)" when l is NULL or has no such tensor. */
void unit_layout_describe_tensor(const unit_layout *l, int32_t index, char *out, size_t out_bytes);

#endif /* ZEROD_LAYOUT_H */
