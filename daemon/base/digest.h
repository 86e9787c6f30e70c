/* digest: SHA-256 (OpenSSL) for secrets kept as hashes (docs/security.md):
 * the coordinator's principals and job owner tokens, which neither the
 * coordinator's state file nor a node holds in the clear. */
#ifndef ZEROD_DIGEST_H
#define ZEROD_DIGEST_H

#include <stddef.h>
#include <stdint.h>

#define DIGEST_HEX_BYTES 65 /* 64 hex digits and a NUL */

void digest_sha256(const void *bytes, size_t n, uint8_t out[32]);

/* The SHA-256 of s (a NUL-terminated string) as 64 lower-case hex digits. */
void digest_sha256_hex(const char *s, char out[DIGEST_HEX_BYTES]);

/* Whether s is 64 lower-case hex digits. */
int digest_is_hex(const char *s);

/* Whether two digests of digest_sha256_hex are the same (both 64 hex
 * digits), compared in constant time. */
int digest_hex_equal(const char *a, const char *b);

#endif /* ZEROD_DIGEST_H */
