/* lowrank.c - CPU driver of low-rank (PowerSGD) compression: the products
 * P = M Q, Q = M^T P and P Q^T, and Gram-Schmidt (arithmetic in zk.h).
 *
 * Bits must not depend on the number of threads, so no sum is ever split:
 * every output element belongs to one thread, which adds its terms in the
 * order zk.h states. Threads take ranges of rows (project, expand) or of
 * columns of M (back). The products of two floats are exact in double, so
 * the sums round the same whether or not the compiler fused them.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Doubles that back's accumulator keeps per task: a block of columns of M
 * whose sums stay in L1/L2 while every row of M passes over them. */
#define LOWRANK_BACK_ACC ((size_t)4096)

/* *out = a * b, if the product counted in doubles fits size_t. */
static int count_ok(size_t a, size_t b, size_t *out) {
  if (a != 0 && b > SIZE_MAX / sizeof(double) / a)
    return 0;
  *out = a * b;
  return 1;
}

/* a * b, saturated: only used to decide whether threads pay. */
static size_t work_of(size_t a, size_t b) {
  return a != 0 && b > SIZE_MAX / a ? SIZE_MAX : a * b;
}

/* Task `task`'s share [*begin, *end) of units, without forming units * task. */
static void task_range(size_t units, int task, int n_tasks, size_t *begin, size_t *end) {
  const size_t n = (size_t)n_tasks, t = (size_t)task, q = units / n, r = units % n;
  *begin = q * t + (t < r ? t : r);
  *end = *begin + q + (t < r);
}

static int lowrank_tasks(const zk_pool *pool, size_t work, size_t units) {
  int n_tasks = zk_task_count(pool, work);
  return (size_t)n_tasks > units ? (int)units : n_tasks;
}

/* n_tasks buffers of per_task doubles, or NULL. */
static double *task_buffers(int n_tasks, size_t per_task) {
  if (per_task > SIZE_MAX / sizeof(double) / (size_t)n_tasks)
    return NULL;
  return malloc((size_t)n_tasks * per_task * sizeof(double));
}

typedef struct lowrank_job {
  const float *M;   /* project, back */
  const float *P;   /* back, expand */
  const double *Qd; /* project: Q widened, its rows padded to ld */
  const float *Qt;  /* expand: Q transposed */
  float *out;       /* P (project), Q (back), out (expand) */
  double *acc;      /* per_task doubles for each task */
  size_t rows, cols, rank, ld, per_task, numel;
  zk_lowrank_mode mode;
} lowrank_job;

/* ------------------------------------------------------------------------ */
/* P = M Q                                                                  */
/* ------------------------------------------------------------------------ */

/* P = M Q is computed for tiles of LOWRANK_ROWS rows and LOWRANK_COLS
 * columns of P at once: the tile's sums are independent of each other, so
 * the CPU overlaps their additions (a vector across rows, several vectors
 * across columns) where one sum alone would wait on each add. Each sum
 * still runs over k in order. */
#define LOWRANK_ROWS ((size_t)8)
#define LOWRANK_COLS ((size_t)4)
/* Columns of M transposed (and widened) at a time, for the rows of a tile. */
#define LOWRANK_KBLOCK ((size_t)256)

/* mt[k][r] = row r of m (stride cols), element k, for k < n; rows from nr
 * on are zero (computed, never stored). */
static void gather_rows(const float *m, size_t cols, size_t nr, size_t n, double *restrict mt) {
  for (size_t r = 0; r < LOWRANK_ROWS; r++)
    for (size_t k = 0; k < n; k++)
      mt[k * LOWRANK_ROWS + r] = r < nr ? (double)m[r * cols + k] : 0.0;
}

/* acc[r][j] += mt[k][r] * q[k][j] for k = 0..n-1 in order, for the
 * LOWRANK_ROWS rows r and the LOWRANK_COLS columns j of q and acc (both of
 * stride ld). The tile lives in a local array the compiler keeps in
 * registers. */
ZK_VECTOR_LOOP static void project_tile(const double *restrict mt, size_t n,
                                        const double *restrict q, size_t ld, double *restrict acc) {
  double a[LOWRANK_ROWS][LOWRANK_COLS];
  for (size_t r = 0; r < LOWRANK_ROWS; r++)
    for (size_t j = 0; j < LOWRANK_COLS; j++)
      a[r][j] = acc[r * ld + j];
  for (size_t k = 0; k < n; k++)
    for (size_t r = 0; r < LOWRANK_ROWS; r++)
      for (size_t j = 0; j < LOWRANK_COLS; j++)
        a[r][j] += mt[k * LOWRANK_ROWS + r] * q[k * ld + j];
  for (size_t r = 0; r < LOWRANK_ROWS; r++)
    for (size_t j = 0; j < LOWRANK_COLS; j++)
      acc[r * ld + j] = a[r][j];
}

/* nr <= LOWRANK_ROWS rows of P = M Q from the rows of M at m; buf holds
 * LOWRANK_ROWS * (LOWRANK_KBLOCK + job->ld) doubles. */
static void project_rows(const lowrank_job *job, const float *m, size_t nr, double *buf, float *p) {
  const size_t cols = job->cols, ld = job->ld;
  double *acc = buf, *mt = buf + LOWRANK_ROWS * ld;
  memset(acc, 0, LOWRANK_ROWS * ld * sizeof(double));
  for (size_t k0 = 0; k0 < cols; k0 += LOWRANK_KBLOCK) {
    const size_t n = cols - k0 < LOWRANK_KBLOCK ? cols - k0 : LOWRANK_KBLOCK;
    gather_rows(m + k0, cols, nr, n, mt);
    for (size_t j0 = 0; j0 < ld; j0 += LOWRANK_COLS)
      project_tile(mt, n, job->Qd + k0 * ld + j0, ld, acc + j0);
  }
  for (size_t r = 0; r < nr; r++)
    for (size_t j = 0; j < job->rank; j++)
      p[r * job->rank + j] = (float)acc[r * ld + j];
}

static void project_task(void *ctx, int task, int n_tasks) {
  const lowrank_job *job = ctx;
  size_t first, last;
  task_range(job->rows, task, n_tasks, &first, &last);
  double *buf = job->acc + (size_t)task * job->per_task;
  for (size_t i = first; i < last; i += LOWRANK_ROWS) {
    const size_t nr = last - i < LOWRANK_ROWS ? last - i : LOWRANK_ROWS;
    project_rows(job, job->M + i * job->cols, nr, buf, job->out + i * job->rank);
  }
}

/* Q in double, its rows padded with zeros to ld columns (a multiple of
 * LOWRANK_COLS); NULL when out of memory. */
static double *widen_q(const float *Q, size_t cols, size_t rank, size_t ld) {
  if (cols > SIZE_MAX / sizeof(double) / ld)
    return NULL;
  double *qd = malloc(cols * ld * sizeof(double));
  if (qd == NULL)
    return NULL;
  for (size_t k = 0; k < cols; k++)
    for (size_t j = 0; j < ld; j++)
      qd[k * ld + j] = j < rank ? (double)Q[k * rank + j] : 0.0;
  return qd;
}

int zk_lowrank_project(zk_pool *pool, const float *M, size_t rows, size_t cols, const float *Q,
                       size_t rank, float *P) {
  size_t mn, pr, qr;
  if (rank == 0 || !count_ok(rows, cols, &mn) || !count_ok(rows, rank, &pr) ||
      !count_ok(cols, rank, &qr) || (mn > 0 && M == NULL) || (qr > 0 && Q == NULL) ||
      (pr > 0 && P == NULL))
    return -EINVAL;
  if (pr == 0)
    return 0;
  if (cols == 0) { /* empty sums */
    memset(P, 0, pr * sizeof(float));
    return 0;
  }
  lowrank_job job = {.M = M, .out = P, .rows = rows, .cols = cols, .rank = rank};
  const int n_tasks = lowrank_tasks(pool, work_of(mn, rank), rows);
  if (rank > SIZE_MAX / sizeof(double) / LOWRANK_ROWS - 2 * LOWRANK_KBLOCK)
    return -ENOMEM; /* ld and per_task would not fit size_t */
  job.ld = (rank + LOWRANK_COLS - 1) / LOWRANK_COLS * LOWRANK_COLS;
  job.per_task = LOWRANK_ROWS * (LOWRANK_KBLOCK + job.ld);
  double *qd = widen_q(Q, cols, rank, job.ld);
  job.Qd = qd;
  job.acc = qd == NULL ? NULL : task_buffers(n_tasks, job.per_task);
  if (job.acc != NULL)
    zk_pool_run(pool, n_tasks, project_task, &job);
  free(job.acc);
  free(qd);
  return job.acc == NULL ? -ENOMEM : 0;
}

/* ------------------------------------------------------------------------ */
/* Q = M^T P                                                                */
/* ------------------------------------------------------------------------ */

/* Adds row i of M (its columns [k0, k0 + width)) times row i of P into the
 * sums of those columns, acc[j][k] (stride width): called for i ascending,
 * so each sum keeps its order. Along k the sums are independent and
 * contiguous, which is what the loop vectorises over. */
ZK_VECTOR_LOOP static void back_row(const float *restrict m, const float *restrict p, size_t width,
                                    size_t rank, double *restrict acc) {
  for (size_t j = 0; j < rank; j++) {
    const double pj = p[j];
    double *a = acc + j * width;
    for (size_t k = 0; k < width; k++)
      a[k] += (double)m[k] * pj;
  }
}

static void back_block(const lowrank_job *job, double *acc, size_t k0, size_t width) {
  const size_t rank = job->rank;
  memset(acc, 0, width * rank * sizeof(double));
  for (size_t i = 0; i < job->rows; i++)
    back_row(job->M + i * job->cols + k0, job->P + i * rank, width, rank, acc);
  float *q = job->out + k0 * rank;
  for (size_t k = 0; k < width; k++)
    for (size_t j = 0; j < rank; j++)
      q[k * rank + j] = (float)acc[j * width + k];
}

static void back_task(void *ctx, int task, int n_tasks) {
  const lowrank_job *job = ctx;
  size_t first, last;
  task_range(job->cols, task, n_tasks, &first, &last);
  double *acc = job->acc + (size_t)task * job->per_task;
  const size_t block = job->per_task / job->rank;
  for (size_t k0 = first; k0 < last; k0 += block)
    back_block(job, acc, k0, last - k0 < block ? last - k0 : block);
}

int zk_lowrank_back(zk_pool *pool, const float *M, size_t rows, size_t cols, const float *P,
                    size_t rank, float *Q) {
  size_t mn, pr, qr;
  if (rank == 0 || !count_ok(rows, cols, &mn) || !count_ok(rows, rank, &pr) ||
      !count_ok(cols, rank, &qr) || (mn > 0 && M == NULL) || (pr > 0 && P == NULL) ||
      (qr > 0 && Q == NULL))
    return -EINVAL;
  if (qr == 0)
    return 0;
  lowrank_job job = {.M = M, .P = P, .out = Q, .rows = rows, .cols = cols, .rank = rank};
  const int n_tasks = lowrank_tasks(pool, work_of(mn, rank), cols);
  /* Whole columns (rank sums each), as many as fit LOWRANK_BACK_ACC, at least one. */
  job.per_task = rank < LOWRANK_BACK_ACC ? LOWRANK_BACK_ACC / rank * rank : rank;
  if ((job.acc = task_buffers(n_tasks, job.per_task)) == NULL)
    return -ENOMEM;
  zk_pool_run(pool, n_tasks, back_task, &job);
  free(job.acc);
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Gram-Schmidt                                                             */
/* ------------------------------------------------------------------------ */

/* sum over i ascending of (double)P[i][a] * (double)P[i][b] */
static double column_dot(const float *P, size_t rows, size_t rank, size_t a, size_t b) {
  double sum = 0.0;
  for (size_t i = 0; i < rows; i++)
    sum += (double)P[i * rank + a] * (double)P[i * rank + b];
  return sum;
}

static void orthonormalize_column(float *P, size_t rows, size_t rank, size_t j) {
  for (size_t k = 0; k < j; k++) {
    const double d = column_dot(P, rows, rank, k, j);
    for (size_t i = 0; i < rows; i++) {
      /* Two roundings in double, as zk.h states: a statement of its own,
       * so that not even a compiler that contracts within an expression
       * (clang's default) makes it an FMA. */
      const double dp = d * (double)P[i * rank + k];
      P[i * rank + j] = (float)((double)P[i * rank + j] - dp);
    }
  }
  const double n = sqrt(column_dot(P, rows, rank, j, j));
  for (size_t i = 0; i < rows; i++)
    P[i * rank + j] = n == 0.0 ? 0.0f : (float)((double)P[i * rank + j] / n);
}

/* Serial: P is rows x rank, small next to M, and one thread keeps the bits
 * trivially the same for any pool. */
int zk_lowrank_orthonormalize(zk_pool *pool, float *P, size_t rows, size_t rank) {
  size_t pr;
  if (rank == 0 || !count_ok(rows, rank, &pr) || (pr > 0 && P == NULL))
    return -EINVAL;
  for (size_t j = 0; j < rank && rows > 0; j++)
    orthonormalize_column(P, rows, rank, j);
  return 0;
}

/* ------------------------------------------------------------------------ */
/* out (mode) P Q^T                                                         */
/* ------------------------------------------------------------------------ */

/* Elements of a row of P Q^T summed at once, across which the loop over
 * j vectorises (each element's sum still runs j = 0, 1, ...). */
#define LOWRANK_EXPAND_CHUNK ((size_t)256)

/* n <= LOWRANK_EXPAND_CHUNK elements of a row of P Q^T into out by mode: p
 * is the row of P, qt points at the first element's column of Q^T (rank x
 * cols, stride cols). */
ZK_VECTOR_LOOP static void expand_chunk(const float *restrict p, const float *restrict qt,
                                        size_t cols, size_t n, size_t rank, float *restrict out,
                                        zk_lowrank_mode mode) {
  double acc[LOWRANK_EXPAND_CHUNK];
  for (size_t k = 0; k < n; k++)
    acc[k] = 0.0;
  for (size_t j = 0; j < rank; j++) {
    const double pj = p[j];
    const float *q = qt + j * cols;
    for (size_t k = 0; k < n; k++)
      acc[k] += pj * (double)q[k];
  }
  if (mode == ZK_LOWRANK_SET)
    for (size_t k = 0; k < n; k++)
      out[k] = (float)acc[k];
  else if (mode == ZK_LOWRANK_ADD)
    for (size_t k = 0; k < n; k++)
      out[k] += (float)acc[k];
  else
    for (size_t k = 0; k < n; k++)
      out[k] -= (float)acc[k];
}

static void expand_task(void *ctx, int task, int n_tasks) {
  const lowrank_job *job = ctx;
  const size_t cols = job->cols, numel = job->numel;
  size_t first, last;
  task_range((numel + cols - 1) / cols, task, n_tasks, &first, &last);
  for (size_t i = first; i < last; i++) {
    const size_t end = numel - i * cols < cols ? numel - i * cols : cols;
    for (size_t k0 = 0; k0 < end; k0 += LOWRANK_EXPAND_CHUNK)
      expand_chunk(job->P + i * job->rank, job->Qt + k0, cols,
                   end - k0 < LOWRANK_EXPAND_CHUNK ? end - k0 : LOWRANK_EXPAND_CHUNK, job->rank,
                   job->out + i * cols + k0, job->mode);
  }
}

/* Q^T (rank x cols): the elements of a row of P Q^T then read a row of it
 * each, contiguously. */
static float *transpose(const float *Q, size_t cols, size_t rank) {
  float *qt = malloc(cols * rank * sizeof(float));
  if (qt == NULL)
    return NULL;
  for (size_t k = 0; k < cols; k++)
    for (size_t j = 0; j < rank; j++)
      qt[j * cols + k] = Q[k * rank + j];
  return qt;
}

int zk_lowrank_expand(zk_pool *pool, const float *P, const float *Q, size_t rows, size_t cols,
                      size_t rank, size_t numel, float *out, zk_lowrank_mode mode) {
  size_t mn, pr, qr;
  if (rank == 0 || !count_ok(rows, cols, &mn) || !count_ok(rows, rank, &pr) ||
      !count_ok(cols, rank, &qr) || numel > mn || (pr > 0 && P == NULL) || (qr > 0 && Q == NULL) ||
      (numel > 0 && out == NULL) ||
      (mode != ZK_LOWRANK_SET && mode != ZK_LOWRANK_ADD && mode != ZK_LOWRANK_SUBTRACT))
    return -EINVAL;
  if (numel == 0)
    return 0;
  lowrank_job job = {.P = P, .rows = rows, .cols = cols, .rank = rank, .numel = numel};
  job.out = out;
  job.mode = mode;
  float *qt = transpose(Q, cols, rank);
  if ((job.Qt = qt) == NULL)
    return -ENOMEM;
  const size_t rows_used = (numel + cols - 1) / cols;
  zk_pool_run(pool, lowrank_tasks(pool, work_of(numel, rank), rows_used), expand_task, &job);
  free(qt);
  return 0;
}
