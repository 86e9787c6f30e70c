/* Fuzz target: the request header of the replica transport (daemon/node/
 * replica_net.c, replica_request_decode), fed what any host that reaches
 * a node's replica port could send.
 *
 * Every input is decoded twice. Raw: the input is the header, whatever
 * its length (the seeds are a valid PUT, GET and FOLLOW header). Laid
 * over a valid header: random bytes almost never start with the magic, so
 * the input also replaces a valid header's bytes from offset 12 on (after
 * magic, version and op; the first input byte, modulo 3, picks PUT, GET or
 * FOLLOW),
 * so random inputs reach the ids, the size limit, the name and its
 * padding. A header that decodes must hold a known op, a valid name, a
 * size under the limit (0 for a GET or a FOLLOW), and encode back to exactly the
 * bytes it came from; a refusal must say why; nothing may crash or read
 * outside its buffer. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "replica_net.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check(const uint8_t *buf, size_t len) {
  replica_request r;
  char err[256];
  err[0] = '\0';
  int rc = replica_request_decode(buf, len, &r, err, sizeof err);
  if (rc != 0) {
    if (err[0] == '\0' || strnlen(err, sizeof err) == sizeof err)
      abort(); /* a refusal always says why, NUL-terminated */
    return;
  }
  if (len != REPLICA_REQUEST_BYTES ||
      (r.op != REPLICA_OP_PUT && r.op != REPLICA_OP_GET && r.op != REPLICA_OP_FOLLOW) ||
      !replica_name_valid(r.name) || r.bytes > REPLICA_MAX_FILE_BYTES ||
      (r.op != REPLICA_OP_PUT && r.bytes != 0))
    abort();
  uint8_t again[REPLICA_REQUEST_BYTES];
  replica_request_encode(&r, again);
  if (memcmp(again, buf, REPLICA_REQUEST_BYTES) != 0)
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* A copy of exactly the input's size, so ASan sees any overread. */
  uint8_t *raw = malloc(size ? size : 1);
  if (raw == NULL)
    return 0;
  memcpy(raw, data, size);
  check(raw, size);
  free(raw);
  if (size == 0)
    return 0;
  static const int ops[3] = {REPLICA_OP_PUT, REPLICA_OP_GET, REPLICA_OP_FOLLOW};
  replica_request base = {.op = ops[data[0] % 3], .job_id = 1};
  strcpy(base.name, "rank0.zdshard");
  uint8_t buf[REPLICA_REQUEST_BYTES];
  replica_request_encode(&base, buf);
  size_t n = size - 1 < REPLICA_REQUEST_BYTES - 12 ? size - 1 : REPLICA_REQUEST_BYTES - 12;
  memcpy(buf + 12, data + 1, n);
  check(buf, sizeof buf);
  return 0;
}
