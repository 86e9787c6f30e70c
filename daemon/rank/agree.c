/* agree: see agree.h. */
#include "agree.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define WORDS 4

void agree_init(agree_set *a, agree_field *storage, unsigned cap) {
  a->fields = storage;
  a->n = 0;
  a->cap = cap;
  a->refused = 0;
}

/* FNV-1a, 64 bits, over the length and the bytes. */
uint64_t agree_digest(uint64_t seed, const void *bytes, size_t len) {
  uint64_t h = seed ? seed : 0xcbf29ce484222325ull;
  uint64_t n = len;
  for (int k = 0; k < 8; k++) {
    h ^= (uint8_t)(n >> (8 * k));
    h *= 0x100000001b3ull;
  }
  const uint8_t *p = bytes;
  for (size_t i = 0; i < len; i++) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

static void add_digest(agree_set *a, uint64_t d, const char *fmt, va_list ap) {
  if (a->cap == 0)
    return;
  if (a->n == a->cap) {
    agree_field *last = &a->fields[a->cap - 1];
    last->digest = last->digest * 31 + d;
    return;
  }
  agree_field *f = &a->fields[a->n++];
  f->digest = d;
  vsnprintf(f->name, sizeof f->name, fmt, ap);
}

void agree_add(agree_set *a, const void *bytes, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  add_digest(a, agree_digest(0, bytes, len), fmt, ap);
  va_end(ap);
}

void agree_add_f64(agree_set *a, double value, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  add_digest(a, agree_digest(0, &value, sizeof value), fmt, ap);
  va_end(ap);
}

void agree_add_digest(agree_set *a, uint64_t d, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  add_digest(a, d, fmt, ap);
  va_end(ap);
}

size_t agree_values(const agree_set *a) {
  return 1 + (size_t)a->n * AGREE_VALUES_PER_FIELD;
}

void agree_put(const agree_set *a, double *out) {
  out[0] = a->refused ? 1.0 : 0.0;
  for (unsigned i = 0; i < a->n; i++) {
    double *v = out + 1 + (size_t)i * AGREE_VALUES_PER_FIELD;
    for (int w = 0; w < WORDS; w++) {
      double word = (double)((a->fields[i].digest >> (16 * w)) & 0xffff);
      v[w] = word;
      v[WORDS + w] = word * word;
    }
  }
}

/* Whether the ranks sent the same words of a field: the sums are exact
 * integers (each word < 2^16, each square < 2^32, at most 2^20 ranks). */
static int same_field(const double *v, unsigned nranks) {
  for (int w = 0; w < WORDS; w++) {
    unsigned __int128 sum = (unsigned __int128)(uint64_t)v[w];
    unsigned __int128 squares = (unsigned __int128)(uint64_t)v[WORDS + w];
    if ((unsigned __int128)nranks * squares != sum * sum)
      return 0;
  }
  return 1;
}

agree_verdict agree_check(const agree_set *a, const double *sums, unsigned nranks, char *why,
                          size_t why_bytes) {
  why[0] = '\0';
  if (sums[0] > 0) {
    snprintf(why, why_bytes, "%.0f of %u ranks", sums[0], nranks);
    return AGREE_REFUSED;
  }
  size_t at = 0;
  unsigned named = 0, differ = 0;
  for (unsigned i = 0; i < a->n; i++) {
    if (same_field(sums + 1 + (size_t)i * AGREE_VALUES_PER_FIELD, nranks))
      continue;
    differ++;
    if (named < 8 && at < why_bytes) {
      int n = snprintf(why + at, why_bytes - at, "%s%s", named ? ", " : "", a->fields[i].name);
      at += n > 0 ? (size_t)n : 0;
      named++;
    }
  }
  if (differ > named && at < why_bytes)
    snprintf(why + at, why_bytes - at, " and %u more", differ - named);
  return differ ? AGREE_DIFFERENT : AGREE_SAME;
}
