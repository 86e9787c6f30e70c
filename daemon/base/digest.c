/* digest: SHA-256 of secrets (see digest.h). */
#include "digest.h"

#include <stdio.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

void digest_sha256(const void *bytes, size_t n, uint8_t out[32]) {
  unsigned int len = 32;
  /* EVP_Digest with SHA-256 cannot fail on valid arguments. */
  EVP_Digest(bytes, n, out, &len, EVP_sha256(), NULL);
}

void digest_sha256_hex(const char *s, char out[DIGEST_HEX_BYTES]) {
  static const char hex[] = "0123456789abcdef";
  uint8_t digest[32];
  digest_sha256(s, strlen(s), digest);
  for (int i = 0; i < 32; i++) {
    out[2 * i] = hex[digest[i] >> 4];
    out[2 * i + 1] = hex[digest[i] & 15];
  }
  out[64] = '\0';
  OPENSSL_cleanse(digest, sizeof digest);
}

int digest_is_hex(const char *s) {
  if (strlen(s) != 64)
    return 0;
  for (int i = 0; i < 64; i++) {
    if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
      return 0;
  }
  return 1;
}

int digest_hex_equal(const char *a, const char *b) {
  return digest_is_hex(a) && digest_is_hex(b) && CRYPTO_memcmp(a, b, 64) == 0;
}
