/* agree: the settings every rank of a job must send alike (the step's
 * options, parameter groups), compared across the ranks before any takes
 * effect.
 *
 * Each rank reduces each setting to a 64-bit digest, named for the
 * messages ("lr", "groups[1].beta2"). The digests travel in a sum
 * all-reduce, the one the request makes anyway where it has one: each
 * digest as four 16-bit words and their squares, so every sum is an exact
 * integer in a double. The ranks sent the same word w_i exactly when
 * n * sum(w_i^2) == (sum w_i)^2 (Cauchy-Schwarz), which every rank
 * computes from the same sums, so every rank reaches the same verdict and
 * names the same fields. A rank whose own request is invalid joins the
 * collective anyway, marked refused, so that the others do not wait for it
 * and fail together. */
#ifndef ZD_RANK_AGREE_H
#define ZD_RANK_AGREE_H

#include <stddef.h>
#include <stdint.h>

/* Doubles a field takes in the all-reduce: four words, four squares. */
#define AGREE_VALUES_PER_FIELD 8

typedef struct agree_field {
  char name[48];
  uint64_t digest;
} agree_field;

typedef struct agree_set {
  agree_field *fields; /* the caller's storage, cap of them */
  unsigned n, cap;
  int refused; /* this rank's own request is invalid */
} agree_set;

/* The verdict after the all-reduce. */
typedef enum agree_verdict {
  AGREE_SAME = 0, /* every rank sent the same, and none refused */
  AGREE_REFUSED,  /* some rank's own request was invalid */
  AGREE_DIFFERENT /* valid everywhere, but not the same */
} agree_verdict;

void agree_init(agree_set *a, agree_field *storage, unsigned cap);

/* A field: its bytes' digest, named by the format. Fields past cap are
 * folded into the last one (its name then covers them: a bug to rely on). */
void agree_add(agree_set *a, const void *bytes, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void agree_add_f64(agree_set *a, double value, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A field whose digest the caller made (agree_digest, folded). */
void agree_add_digest(agree_set *a, uint64_t digest, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The digest agree_add takes of bytes; seed 0 for a first, or a previous
 * digest to fold more bytes in. */
uint64_t agree_digest(uint64_t seed, const void *bytes, size_t len);

/* The doubles this rank contributes (agree_values of them), to be summed
 * over the ranks. */
size_t agree_values(const agree_set *a);
void agree_put(const agree_set *a, double *out);

/* From the sums over nranks ranks: the verdict; for AGREE_DIFFERENT the
 * names of the fields that differ ("lr, max_grad_norm"), for
 * AGREE_REFUSED how many ranks refused ("1 of 2 ranks"). */
agree_verdict agree_check(const agree_set *a, const double *sums, unsigned nranks, char *why,
                          size_t why_bytes);

#endif
