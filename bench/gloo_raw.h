/* gloo_raw.h - the baseline for the collective benchmarks: Gloo's own
 * all-gather, called directly, with no zerod code in the way. */
#ifndef ZEROD_BENCH_GLOO_RAW_H
#define ZEROD_BENCH_GLOO_RAW_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Starts `world` threads, each a rank with its own Gloo TCP context on
 * 127.0.0.1, and runs gloo::allgather of bytes_per_rank per rank (separate
 * input and output buffers) twice to warm up and then `iters` times, each
 * after a barrier. Writes the median wall time of one call on rank 0 to
 * *median_seconds. Returns 0, or -1 with a message on stderr. */
int gloo_raw_allgather(size_t bytes_per_rank, int world, int iters, double *median_seconds);

#ifdef __cplusplus
}
#endif

#endif /* ZEROD_BENCH_GLOO_RAW_H */
