/* demo_kernels - the kernels doing a training run's work, end to end.
 *
 * Until the daemon exists this is what `make demo` trains: a linear model
 * y = W x + b fitted to a synthetic teacher, the way a zerod rank will do
 * it. The fp32 master weights, AdamW moments and a bf16 working copy live in
 * flat arrays; each step the forward pass reads the bf16 working copy, the
 * backward pass writes bf16 gradients, and the kernels do the rest:
 * gradient norm (zk_sumsq), clipping folded into the step (grad_scale),
 * the AdamW update with the fused bf16 write, and an int8 round trip of the
 * gradient as a compressed collective would send it. It prints the loss as
 * it falls and exits non-zero if it does not fall at least 100-fold.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "zk.h"

enum { IN = 256, OUT = 64, BATCH = 512, STEPS = 150 };
#define NUMEL (OUT * IN + OUT)

static uint64_t rng_state = 2024;

static double rand_normal(void) {
  double u[2];
  for (int k = 0; k < 2; k++) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    u[k] = ((double)(rng_state >> 11) + 0.5) * 0x1p-53;
  }
  return sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]);
}

#define CHECK(call)                                                                                \
  do {                                                                                             \
    int rc_ = (call);                                                                              \
    if (rc_ != 0) {                                                                                \
      fprintf(stderr, "demo: %s failed: %s\n", #call, strerror(-rc_));                             \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

int main(void) {
  static float teacher[NUMEL], master[NUMEL], exp_avg[NUMEL], exp_avg_sq[NUMEL];
  static float weights[NUMEL], grad32[NUMEL], grad_back[NUMEL];
  static uint16_t working[NUMEL], grad16[NUMEL];
  static float x[BATCH][IN], y[BATCH][OUT];

  zk_pool *pool;
  CHECK(zk_pool_create(2, &pool));
  for (int i = 0; i < NUMEL; i++) {
    teacher[i] = (float)(rand_normal() / sqrt((double)IN));
    master[i] = (float)(rand_normal() * 0.02);
  }
  CHECK(zk_cast(pool, working, ZK_BF16, master, ZK_F32, NUMEL));
  const float *tw = teacher, *tb = teacher + OUT * IN;

  const zk_qformat qfmt = {8, ZK_QSYM, 256};
  size_t qbytes = zk_quant_bytes(&qfmt, NUMEL);
  void *qbuf = malloc(qbytes);
  if (qbuf == NULL)
    return 1;

  printf("demo: linear model %dx%d (%d parameters), batch %d, AdamW lr 1e-2, bf16 working copy "
         "and gradients, clip 1.0\n",
         OUT, IN, NUMEL, BATCH);
  double first_loss = 0, loss = 0;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int step = 1; step <= STEPS; step++) {
    /* A fresh batch from the teacher. */
    for (int s = 0; s < BATCH; s++) {
      for (int i = 0; i < IN; i++)
        x[s][i] = (float)rand_normal();
      for (int o = 0; o < OUT; o++) {
        double acc = tb[o];
        for (int i = 0; i < IN; i++)
          acc += (double)tw[o * IN + i] * x[s][i];
        y[s][o] = (float)acc;
      }
    }
    /* Forward with the bf16 working copy, mean squared error, backward. */
    CHECK(zk_cast(pool, weights, ZK_F32, working, ZK_BF16, NUMEL));
    const float *w = weights, *b = weights + OUT * IN;
    memset(grad32, 0, sizeof grad32);
    loss = 0;
    for (int s = 0; s < BATCH; s++)
      for (int o = 0; o < OUT; o++) {
        float pred = b[o];
        for (int i = 0; i < IN; i++)
          pred += w[o * IN + i] * x[s][i];
        float err = pred - y[s][o];
        loss += (double)err * err / (BATCH * OUT);
        float d = 2.0f * err / (BATCH * OUT);
        for (int i = 0; i < IN; i++)
          grad32[o * IN + i] += d * x[s][i];
        grad32[OUT * IN + o] += d;
      }
    if (step == 1)
      first_loss = loss;
    CHECK(zk_cast(pool, grad16, ZK_BF16, grad32, ZK_F32, NUMEL));

    /* What a compressed collective would do to the gradient: int8 blocks. */
    int nonfinite = 0;
    CHECK(zk_quantize(pool, &qfmt, grad32, NUMEL, qbuf, qbytes, &nonfinite));
    CHECK(zk_dequantize(pool, &qfmt, qbuf, qbytes, grad_back, NUMEL));
    double qerr = 0, qnorm = 0;
    for (int i = 0; i < NUMEL; i++) {
      qerr += (double)(grad_back[i] - grad32[i]) * (grad_back[i] - grad32[i]);
      qnorm += (double)grad32[i] * grad32[i];
    }

    /* Global norm, clipping folded into the step, AdamW with fused bf16 write. */
    double sumsq;
    CHECK(zk_sumsq(pool, grad16, ZK_BF16, NUMEL, &sumsq));
    double norm = sqrt(sumsq), clip = norm > 1.0 ? 1.0 / (norm + 1e-6) : 1.0;
    zk_adam_hparams hp = {.lr = 1e-2,
                          .beta1 = 0.9,
                          .beta2 = 0.999,
                          .eps = 1e-8,
                          .weight_decay = 1e-4,
                          .decoupled_weight_decay = 1,
                          .step = step,
                          .grad_scale = clip};
    CHECK(zk_adam_step(pool, &hp, master, exp_avg, exp_avg_sq, grad16, ZK_BF16, working, ZK_BF16,
                       NUMEL));
    if (step == 1 || step % 25 == 0)
      printf("step %4d  loss %10.6f  grad_norm %8.4f  int8 grad error %.2e%s\n", step, loss, norm,
             sqrt(qerr / (qnorm + 1e-30)), nonfinite ? "  (non-finite!)" : "");
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  printf("demo: %d steps in %.2f s (%.0f steps/s); loss %.6f -> %.6f (%.0fx lower)\n", STEPS, secs,
         STEPS / secs, first_loss, loss, first_loss / loss);
  free(qbuf);
  zk_pool_destroy(pool);
  if (!(loss * 100 < first_loss)) {
    fprintf(stderr, "demo: FAILED: the loss did not fall 100-fold\n");
    return 1;
  }
  printf("demo: self-check passed\n");
  return 0;
}
