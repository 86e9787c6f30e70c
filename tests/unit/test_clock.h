/* test_clock.h - time in the tests that wait for threads: a monotonic
 * clock in milliseconds and a sleep. */
#ifndef ZEROD_TEST_CLOCK_H
#define ZEROD_TEST_CLOCK_H

#include <time.h>

static inline double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static inline void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

#endif /* ZEROD_TEST_CLOCK_H */
