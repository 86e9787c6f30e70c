/* clock: the monotonic clock, read one way everywhere in the daemon.
 *
 * Durations (how long a step, a copy or a call took), backoffs and the
 * deadlines of condition waits are all taken on CLOCK_MONOTONIC, which no
 * change of the wall clock moves. Header only (static inline), so it adds
 * no link dependency: any file of any folder above base/ may include it
 * (rank/, node/, backend/, metrics/, ckpt/ do). Safe on any thread. */
#ifndef ZEROD_CLOCK_H
#define ZEROD_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Nanoseconds on the monotonic clock. */
static inline uint64_t clock_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Microseconds on the monotonic clock. */
static inline int64_t clock_now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Milliseconds on the monotonic clock. */
static inline int64_t clock_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Seconds on the monotonic clock. */
static inline double clock_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The monotonic time timeout_ms (>= 0) from now, as the absolute deadline
 * of a pthread_cond_timedwait on a condition variable whose clock is
 * CLOCK_MONOTONIC (pthread_condattr_setclock). */
static inline struct timespec clock_deadline_ms(int timeout_ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  ts.tv_sec += timeout_ms / 1000;
  ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  return ts;
}

#endif
