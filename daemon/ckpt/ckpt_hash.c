/* ckpt_hash: XXH64 with seed 0 (libxxhash), whole or incremental, as the
 * formats hash files (ckpt.h, ckpt_hash_*): for code that computes a
 * checkpoint file's hash without a shard writer (the tests do). */
#include "ckpt.h"

#include <stdlib.h>

#include <xxhash.h>

struct ckpt_hash {
  XXH64_state_t *state;
};

ckpt_hash *ckpt_hash_new(void) {
  ckpt_hash *h = malloc(sizeof *h);
  if (h == NULL)
    return NULL;
  h->state = XXH64_createState();
  if (h->state == NULL) {
    free(h);
    return NULL;
  }
  XXH64_reset(h->state, 0);
  return h;
}

void ckpt_hash_update(ckpt_hash *h, const void *data, size_t bytes) {
  if (bytes > 0)
    XXH64_update(h->state, data, bytes);
}

uint64_t ckpt_hash_digest(const ckpt_hash *h) {
  return XXH64_digest(h->state);
}

void ckpt_hash_free(ckpt_hash *h) {
  if (h == NULL)
    return;
  XXH64_freeState(h->state);
  free(h);
}

uint64_t ckpt_hash_once(const void *data, size_t bytes) {
  static const uint8_t nothing[1];
  return XXH64(bytes > 0 ? data : nothing, bytes, 0);
}
