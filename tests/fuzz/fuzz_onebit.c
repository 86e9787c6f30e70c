/* Fuzz target: 1-bit decoding of a buffer that came from another node
 * (1-bit Adam's cross-node sums, zk_onebit_decode).
 *
 * The first 5 bytes choose the block size and the element count; the rest
 * is the encoded buffer. The decoder is called with the exact size the
 * block and count need (decoding must never read outside the buffer,
 * whatever the bytes) and with the whole remainder (which it must refuse
 * unless the sizes happen to agree). */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "zk.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 5)
    return 0;
  size_t block = (size_t)(data[0] | (data[1] << 8));
  size_t numel = (size_t)(data[2] | (data[3] << 8) | ((data[4] & 0x3) << 16));
  const uint8_t *payload = data + 5;
  size_t payload_bytes = size - 5;
  float *out = malloc((numel ? numel : 1) * sizeof(float));
  if (out == NULL)
    return 0;
  size_t need = zk_onebit_bytes(block, numel);
  int block_ok = need > 0 || (numel == 0 && block >= 8 && block % 8 == 0);
  if (need > 0 && need <= payload_bytes) {
    /* A copy of exactly `need` bytes, so that ASan sees any over-read. */
    uint8_t *exact = malloc(need);
    if (exact != NULL) {
      memcpy(exact, payload, need);
      if (zk_onebit_decode(NULL, block, exact, need, out, numel) != 0)
        abort(); /* a valid block with the right size must decode */
      free(exact);
    }
  }
  int rc = zk_onebit_decode(NULL, block, payload, payload_bytes, out, numel);
  if (rc != 0 && rc != -EINVAL)
    abort();
  if (rc == 0 && !(block_ok && need == payload_bytes))
    abort(); /* accepted a buffer of the wrong size */
  free(out);
  return 0;
}
