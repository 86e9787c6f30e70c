/* bench_util.h - the timing helpers every benchmark shares. */
#ifndef ZK_BENCH_UTIL_H
#define ZK_BENCH_UTIL_H

#include <stdlib.h>
#include <time.h>

static inline double bench_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int bench_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median of n timings (sorts them in place). */
static inline double bench_median(double *t, int n) {
  qsort(t, (size_t)n, sizeof t[0], bench_cmp_double);
  return t[n / 2];
}

#endif /* ZK_BENCH_UTIL_H */
