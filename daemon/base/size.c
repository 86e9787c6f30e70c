/* size: byte sizes as operators write them (see size.h). */
#include "size.h"

#include <errno.h>
#include <stdlib.h>

int size_parse(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  if (s[0] == '-' || s[0] == '+')
    return -1;
  double v = strtod(s, &end);
  if (errno != 0 || end == s || !(v > 0))
    return -1;
  double multiplier = 1;
  switch (*end) {
  case 'k':
  case 'K':
    multiplier = 1024.0, end++;
    break;
  case 'm':
  case 'M':
    multiplier = 1024.0 * 1024, end++;
    break;
  case 'g':
  case 'G':
    multiplier = 1024.0 * 1024 * 1024, end++;
    break;
  case 't':
  case 'T':
    multiplier = 1024.0 * 1024 * 1024 * 1024, end++;
    break;
  default:
    break;
  }
  if (multiplier > 1 && *end == 'i')
    end++;
  if (*end == 'B')
    end++;
  if (*end != '\0' || v * multiplier > 1e18 || v * multiplier < 1)
    return -1;
  *out = (uint64_t)(v * multiplier);
  return 0;
}
