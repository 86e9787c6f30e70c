/* size: byte sizes as operators write them, for flags and config files:
 * 4096, 512K, 512M, 4G, 1T (binary multiples; also 4GiB, 4GB), > 0. */
#ifndef ZEROD_SIZE_H
#define ZEROD_SIZE_H

#include <stdint.h>

/* Returns 0 with *out, or -1 for text that is not such a size (empty, a
 * sign, an unknown suffix, 0, over 10^18). */
int size_parse(const char *s, uint64_t *out);

#endif /* ZEROD_SIZE_H */
