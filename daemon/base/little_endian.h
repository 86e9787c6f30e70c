/* little_endian: fixed-width integers stored little-endian, byte by byte,
 * whatever the host's byte order (no packed structs, no alignment needs).
 *
 * The checkpoint formats include it (daemon/ckpt/: shard file headers,
 * block tables and footers; the safetensors length prefix). Header only
 * (static inline); safe on any thread. (proto/frame.c keeps its own for
 * the IPC frames: proto/ is below daemon/ and links no daemon library.) */
#ifndef ZEROD_LITTLE_ENDIAN_H
#define ZEROD_LITTLE_ENDIAN_H

#include <stdint.h>

static inline void le_put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static inline void le_put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint32_t le_get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--)
    v = v << 8 | p[i];
  return v;
}

static inline uint64_t le_get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--)
    v = v << 8 | p[i];
  return v;
}

#endif
