/* Fuzz target: dequantization of a buffer that came from another process.
 *
 * The first 6 bytes choose the format (bits, mode, block size) and the
 * element count; the rest is the quantized buffer. The decoder is called
 * with the exact size the format needs (decoding must never read outside
 * the buffer, whatever the bytes) and with the whole remainder (which it
 * must refuse unless the sizes happen to agree). */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "zk.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 6)
    return 0;
  zk_qformat fmt = {.bits = (data[0] & 1) ? 4 : 8,
                    .mode = (data[0] & 2) ? ZK_QASYM : ZK_QSYM,
                    .block_numel = (size_t)(data[1] | (data[2] << 8))};
  if (data[0] & 4)
    fmt.block_numel |= 1; /* also try odd blocks, which 4 bits must refuse */
  size_t numel = (size_t)(data[3] | (data[4] << 8) | ((data[5] & 0x3) << 16));
  const uint8_t *payload = data + 6;
  size_t payload_bytes = size - 6;

  float *out = malloc((numel ? numel : 1) * sizeof(float));
  if (out == NULL)
    return 0;
  size_t need = zk_quant_bytes(&fmt, numel);
  int format_ok = zk_qformat_check(&fmt) == 0;
  if (format_ok && need <= payload_bytes) {
    /* A copy of exactly `need` bytes, so that ASan sees any over-read. */
    uint8_t *exact = malloc(need ? need : 1);
    if (exact != NULL) {
      memcpy(exact, payload, need);
      if (zk_dequantize(NULL, &fmt, exact, need, out, numel) != 0)
        abort(); /* a valid format with the right size must decode */
      free(exact);
    }
  }
  int rc = zk_dequantize(NULL, &fmt, payload, payload_bytes, out, numel);
  if (rc != 0 && rc != -EINVAL)
    abort();
  if (rc == 0 && !(format_ok && need == payload_bytes))
    abort(); /* accepted a buffer of the wrong size */
  free(out);
  return 0;
}
