/* test_cuda_optim.c - the CUDA module's table, memory and argument checks,
 * and the optimizer drivers (Adam, SGD) of libzerod_cuda.so against the CPU
 * drivers of zk.h.
 *
 * Every optimizer runs on the same random inputs on both sides, at sizes 0,
 * 1, 7 (tails shorter than a vector), 4097 and 1000003 (many blocks, odd
 * tail), and once on misaligned arrays. The program reaches the GPU only
 * through the module's table, allocations and copies included, as zerod
 * does; it links no CUDA library.
 *
 * Tolerances, and why:
 * - optimizer steps: at most 1 ulp on every fp32 state value and every
 *   working-copy element. Both drivers run the same math_optim.h code with
 *   the same host-computed coefficients, and the module is compiled with
 *   --fmad=false, so the results are expected to be bit-identical; the 1 ulp
 *   allowance is the contract (zk.h promises agreement "within stated
 *   tolerances"), and the test prints the largest distance it saw.
 * - memory copies: identical bytes.
 * - bad arguments: refused with -EINVAL before anything is dereferenced.
 *
 * Without a usable GPU the program prints one "SKIP: ..." line and exits 77
 * (ctest's SKIP_RETURN_CODE), unless ZEROD_REQUIRE_GPU=1 makes that a
 * failure.
 */
#include "gpu_testutil.h"

/* The largest ulp distance seen in the optimizer tests, printed at the end. */
static int64_t optim_worst_ulp;

/* ------------------------------------------------------------------------ */
/* Module and memory                                                        */
/* ------------------------------------------------------------------------ */

static void test_load_returns_one_table(void **state) {
  const zk_cuda_api *again = NULL;
  char why[256];
  assert_int_equal(zk_cuda_load(&again, why, sizeof why), 0);
  assert_ptr_equal(again, cu);
  assert_true(cu->size >= sizeof(zk_cuda_api));
  assert_int_equal(cu->version, ZK_CUDA_API_VERSION);
  int count = 0;
  CU_OK(cu->device_count(&count));
  assert_true(count > 0);
  char name[128] = "";
  CU_OK(cu->device_name(0, name, sizeof name));
  assert_true(name[0] != '\0');
}

static void test_memory_round_trip(void **state) {
  void *empty = (void *)1;
  CU_OK(cu->alloc(&empty, 0));
  assert_null(empty);
  CU_OK(cu->free(NULL));
  assert_int_equal(cu->alloc(NULL, 16), -EINVAL);

  uint8_t host[1000], back[1000];
  for (size_t i = 0; i < sizeof host; i++)
    host[i] = (uint8_t)(i * 7);
  void *a = dev_upload(host, sizeof host);
  void *b = dev_alloc(sizeof host);
  CU_OK(cu->memset(b, 0xab, sizeof host));
  CU_OK(cu->copy_device(b, a, 500, NULL));
  dev_download(back, b, sizeof host);
  check_bytes("copy_device", host, back, 500);
  for (size_t i = 500; i < sizeof host; i++)
    assert_int_equal(back[i], 0xab);
  dev_free(a);
  dev_free(b);
}

static void test_failure_sets_last_error(void **state) {
  void *huge = NULL;
  /* No GPU has 2^60 bytes. */
  int rc = cu->alloc(&huge, (size_t)1 << 60);
  assert_true(rc == -ENOMEM || rc == -EIO);
  assert_null(huge);
  assert_true(strlen(cu->last_error()) > 0);
  /* The failure is not reported again by the next, valid launch. */
  float *x = dev_alloc(16 * sizeof(float));
  CU_OK(cu->memset(x, 0, 16 * sizeof(float)));
  CU_OK(cu->scale(NULL, x, 2.0f, 16, NULL));
  CU_OK(cu->synchronize(NULL));
  dev_free(x);
}

/* ------------------------------------------------------------------------ */
/* Argument checks                                                          */
/* ------------------------------------------------------------------------ */

static void test_bad_arguments_are_rejected(void **state) {
  zk_adam_hparams adam = {.lr = 1e-3,
                          .beta1 = 0.9,
                          .beta2 = 0.999,
                          .eps = 1e-8,
                          .decoupled_weight_decay = 1,
                          .step = 1,
                          .grad_scale = 1.0};
  float dummy_f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float *p = dummy_f; /* never dereferenced: every call below fails its checks first */

  assert_int_equal(cu->adam_step(NULL, NULL, p, p, p, p, ZK_F32, NULL, ZK_DTYPE_NONE, 4), -EINVAL);
  zk_adam_hparams bad = adam;
  bad.step = 0;
  assert_int_equal(cu->adam_step(NULL, &bad, p, p, p, p, ZK_F32, NULL, ZK_DTYPE_NONE, 4), -EINVAL);
  bad = adam;
  bad.beta1 = 1.0;
  assert_int_equal(cu->adam_step(NULL, &bad, p, p, p, p, ZK_F32, NULL, ZK_DTYPE_NONE, 4), -EINVAL);
  assert_int_equal(cu->adam_step(NULL, &adam, p, p, p, p, ZK_DTYPE_NONE, NULL, ZK_DTYPE_NONE, 4),
                   -EINVAL);
  assert_int_equal(cu->adam_step(NULL, &adam, p, p, p, p, ZK_F32, NULL, ZK_F16, 4), -EINVAL);
  assert_int_equal(cu->adam_step(NULL, &adam, NULL, p, p, p, ZK_F32, NULL, ZK_DTYPE_NONE, 4),
                   -EINVAL);
  /* numel 0 reads nothing, so NULL arrays are fine. */
  assert_int_equal(cu->adam_step(NULL, &adam, NULL, NULL, NULL, NULL, ZK_F32, NULL, ZK_BF16, 0), 0);

  zk_sgd_hparams sgd = {
      .lr = 0.1, .momentum = 0.9, .dampening = 0.1, .nesterov = 1, .step = 1, .grad_scale = 1.0};
  assert_int_equal(cu->sgd_step(NULL, &sgd, p, p, p, ZK_F32, NULL, ZK_DTYPE_NONE, 4), -EINVAL);
  sgd.nesterov = 0;
  assert_int_equal(cu->sgd_step(NULL, &sgd, p, NULL, p, ZK_F32, NULL, ZK_DTYPE_NONE, 4), -EINVAL);

  assert_int_equal(cu->cast(NULL, p, ZK_F16, p, ZK_BF16, 4), -EINVAL);
  assert_int_equal(cu->cast(NULL, p, ZK_BF16, p, ZK_BF16, 4), -EINVAL);
  assert_int_equal(cu->cast(NULL, p, ZK_DTYPE_NONE, p, ZK_F32, 4), -EINVAL);
  assert_int_equal(cu->cast(NULL, p, (zk_dtype)7, p, ZK_F32, 4), -EINVAL);
  assert_int_equal(cu->cast(NULL, NULL, ZK_BF16, NULL, ZK_F32, 0), 0);

  assert_int_equal(cu->accumulate(NULL, p, p, ZK_DTYPE_NONE, 4, NULL), -EINVAL);
  assert_int_equal(cu->accumulate(NULL, NULL, p, ZK_F32, 4, NULL), -EINVAL);
  assert_int_equal(cu->scale(NULL, NULL, 2.0f, 4, NULL), -EINVAL);
  assert_int_equal(cu->scale(NULL, NULL, 2.0f, 0, NULL), 0);
  assert_int_equal(cu->sumsq(NULL, p, ZK_F32, 4, NULL), -EINVAL);
  assert_int_equal(cu->sumsq(NULL, p, (zk_dtype)9, 4, (double *)p), -EINVAL);

  const zk_qformat bad_formats[] = {
      {.bits = 5, .mode = ZK_QSYM, .block_numel = 64},
      {.bits = 8, .mode = (zk_qmode)2, .block_numel = 64},
      {.bits = 8, .mode = ZK_QSYM, .block_numel = 0},
      {.bits = 8, .mode = ZK_QSYM, .block_numel = ZK_QBLOCK_MAX + 1},
      {.bits = 4, .mode = ZK_QASYM, .block_numel = 63},
  };
  for (size_t f = 0; f < sizeof bad_formats / sizeof bad_formats[0]; f++) {
    assert_int_equal(cu->quantize(NULL, &bad_formats[f], p, 4, p, 16, NULL), -EINVAL);
    assert_int_equal(cu->dequantize(NULL, &bad_formats[f], p, 16, p, 4), -EINVAL);
    assert_int_equal(cu->quantize(NULL, &bad_formats[f], NULL, 0, NULL, 0, NULL), -EINVAL);
  }
  zk_qformat fmt = {.bits = 8, .mode = ZK_QSYM, .block_numel = 2};
  /* 4 elements: 2 scales (8 bytes) + 4 codes. */
  assert_int_equal(zk_quant_bytes(&fmt, 4), 12);
  assert_int_equal(cu->quantize(NULL, &fmt, p, 4, p, 11, NULL), -EINVAL);
  assert_int_equal(cu->dequantize(NULL, &fmt, p, 13, p, 4), -EINVAL);
  assert_int_equal(cu->quantize(NULL, &fmt, NULL, 4, p, 12, NULL), -EINVAL);
  assert_int_equal(cu->quantize(NULL, &fmt, NULL, 0, NULL, 0, NULL), 0);
  assert_int_equal(cu->dequantize(NULL, &fmt, NULL, 0, NULL, 0), 0);
  /* Sizes whose byte count would overflow are refused, not wrapped. */
  assert_int_equal(cu->quantize(NULL, &fmt, p, SIZE_MAX / 4, p, 0, NULL), -EINVAL);
}

/* ------------------------------------------------------------------------ */
/* Optimizers                                                               */
/* ------------------------------------------------------------------------ */

#define OPTIM_STEPS 3

/* Gradients of step `step`, as float values (the device gets them in dtype). */
static void make_grads(rng *r, float *grad_f, void *grad_host, zk_dtype dtype, size_t n) {
  fill_values(r, grad_f, n, -12, 1);
  store_as(grad_host, dtype, grad_f, n);
}

typedef struct adam_variant {
  const char *name;
  int decoupled;
  double weight_decay;
  double grad_scale;
} adam_variant;

static const adam_variant adam_variants[] = {
    {"AdamW", 1, 0.1, 1.0},
    {"Adam", 0, 0.01, 1.0 / 1024},
};

static void run_adam_case(const adam_variant *variant, zk_dtype grad_dtype, zk_dtype working_dtype,
                          size_t n, uint64_t seed) {
  char what[160];
  rng r = {seed};
  size_t f32_bytes = n * sizeof(float);
  size_t grad_bytes = dtype_bytes(grad_dtype, n);
  size_t working_bytes = dtype_bytes(working_dtype, n);

  float *param = xmalloc(f32_bytes), *m = xmalloc(f32_bytes), *v = xmalloc(f32_bytes);
  float *grad_f = xmalloc(f32_bytes);
  void *grad = xmalloc(grad_bytes), *working = xmalloc(working_bytes);
  float *got_f32 = xmalloc(f32_bytes);
  void *got_working = xmalloc(working_bytes);
  fill_values(&r, param, n, -4, 0);
  memset(m, 0, f32_bytes);
  memset(v, 0, f32_bytes);

  float *d_param = dev_upload(param, f32_bytes), *d_m = dev_upload(m, f32_bytes);
  float *d_v = dev_upload(v, f32_bytes);
  void *d_grad = dev_alloc(grad_bytes), *d_working = dev_alloc(working_bytes);

  for (int step = 1; step <= OPTIM_STEPS; step++) {
    zk_adam_hparams hp = {.lr = 1e-3,
                          .beta1 = 0.9,
                          .beta2 = 0.999,
                          .eps = 1e-8,
                          .weight_decay = variant->weight_decay,
                          .decoupled_weight_decay = variant->decoupled,
                          .step = step,
                          .grad_scale = variant->grad_scale};
    make_grads(&r, grad_f, grad, grad_dtype, n);
    CU_OK(cu->copy_to_device(d_grad, grad, grad_bytes));
    assert_int_equal(
        zk_adam_step(NULL, &hp, param, m, v, grad, grad_dtype, working, working_dtype, n), 0);
    CU_OK(cu->adam_step(NULL, &hp, d_param, d_m, d_v, d_grad, grad_dtype, d_working, working_dtype,
                        n));

    snprintf(what, sizeof what, "%s grad %s working %s numel %zu step %d", variant->name,
             zk_dtype_name(grad_dtype), zk_dtype_name(working_dtype), n, step);
    size_t len = strlen(what);
    struct {
      const char *name;
      const float *want;
      const float *dev;
    } arrays[] = {{"param", param, d_param}, {"exp_avg", m, d_m}, {"exp_avg_sq", v, d_v}};
    for (size_t a = 0; a < 3; a++) {
      dev_download(got_f32, arrays[a].dev, f32_bytes);
      snprintf(what + len, sizeof what - len, ": %s", arrays[a].name);
      int64_t d = check_ulp(what, arrays[a].want, got_f32, ZK_F32, n, OPTIM_MAX_ULP);
      optim_worst_ulp = d > optim_worst_ulp ? d : optim_worst_ulp;
    }
    if (working_dtype != ZK_DTYPE_NONE) {
      dev_download(got_working, d_working, working_bytes);
      snprintf(what + len, sizeof what - len, ": working");
      int64_t d = check_ulp(what, working, got_working, working_dtype, n, OPTIM_MAX_ULP);
      optim_worst_ulp = d > optim_worst_ulp ? d : optim_worst_ulp;
    }
  }

  dev_free(d_param);
  dev_free(d_m);
  dev_free(d_v);
  dev_free(d_grad);
  dev_free(d_working);
  free(param);
  free(m);
  free(v);
  free(grad_f);
  free(grad);
  free(working);
  free(got_f32);
  free(got_working);
}

static void test_adam_matches_cpu(void **state) {
  for (size_t a = 0; a < sizeof adam_variants / sizeof adam_variants[0]; a++)
    for (size_t g = 0; g < 3; g++)
      for (size_t w = 0; w < 4; w++)
        for (size_t s = 0; s < N_SIZES; s++)
          run_adam_case(&adam_variants[a], grad_dtypes[g], working_dtypes[w], test_sizes[s],
                        case_seed(1, (int)a, (int)g, (int)w, test_sizes[s]));
  print_message("adam: largest difference from the CPU: %" PRId64 " ulp (allowed %d)\n",
                optim_worst_ulp, OPTIM_MAX_ULP);
}

typedef struct sgd_variant {
  const char *name;
  double momentum, dampening, weight_decay, grad_scale;
  int nesterov;
} sgd_variant;

static const sgd_variant sgd_variants[] = {
    {"plain", 0.0, 0.0, 0.0, 1.0, 0},
    {"momentum+dampening+wd", 0.9, 0.1, 1e-4, 1.0, 0},
    {"nesterov+wd", 0.9, 0.0, 1e-4, 1.0, 1},
    {"momentum+grad_scale", 0.8, 0.0, 0.0, 1.0 / 256, 0},
};

static void run_sgd_case(const sgd_variant *variant, zk_dtype grad_dtype, zk_dtype working_dtype,
                         size_t n, uint64_t seed) {
  char what[160];
  rng r = {seed};
  int has_momentum = variant->momentum != 0.0;
  size_t f32_bytes = n * sizeof(float);
  size_t grad_bytes = dtype_bytes(grad_dtype, n);
  size_t working_bytes = dtype_bytes(working_dtype, n);

  float *param = xmalloc(f32_bytes), *buf = xmalloc(f32_bytes), *grad_f = xmalloc(f32_bytes);
  void *grad = xmalloc(grad_bytes), *working = xmalloc(working_bytes);
  float *got_f32 = xmalloc(f32_bytes);
  void *got_working = xmalloc(working_bytes);
  fill_values(&r, param, n, -4, 0);
  /* The first step overwrites the buffer: garbage here proves it. */
  fill_values(&r, buf, n, 0, 4);

  float *d_param = dev_upload(param, f32_bytes);
  /* Without momentum the buffer is absent (NULL), as zerod passes it. */
  float *d_buf = has_momentum ? dev_upload(buf, f32_bytes) : NULL;
  void *d_grad = dev_alloc(grad_bytes), *d_working = dev_alloc(working_bytes);

  for (int step = 1; step <= OPTIM_STEPS; step++) {
    zk_sgd_hparams hp = {.lr = 0.05,
                         .momentum = variant->momentum,
                         .dampening = variant->dampening,
                         .weight_decay = variant->weight_decay,
                         .nesterov = variant->nesterov,
                         .step = step,
                         .grad_scale = variant->grad_scale};
    make_grads(&r, grad_f, grad, grad_dtype, n);
    CU_OK(cu->copy_to_device(d_grad, grad, grad_bytes));
    assert_int_equal(zk_sgd_step(NULL, &hp, param, has_momentum ? buf : NULL, grad, grad_dtype,
                                 working, working_dtype, n),
                     0);
    CU_OK(cu->sgd_step(NULL, &hp, d_param, d_buf, d_grad, grad_dtype, d_working, working_dtype, n));

    snprintf(what, sizeof what, "SGD %s grad %s working %s numel %zu step %d", variant->name,
             zk_dtype_name(grad_dtype), zk_dtype_name(working_dtype), n, step);
    size_t len = strlen(what);
    dev_download(got_f32, d_param, f32_bytes);
    snprintf(what + len, sizeof what - len, ": param");
    int64_t d = check_ulp(what, param, got_f32, ZK_F32, n, OPTIM_MAX_ULP);
    optim_worst_ulp = d > optim_worst_ulp ? d : optim_worst_ulp;
    if (has_momentum) {
      dev_download(got_f32, d_buf, f32_bytes);
      snprintf(what + len, sizeof what - len, ": momentum_buf");
      d = check_ulp(what, buf, got_f32, ZK_F32, n, OPTIM_MAX_ULP);
      optim_worst_ulp = d > optim_worst_ulp ? d : optim_worst_ulp;
    }
    if (working_dtype != ZK_DTYPE_NONE) {
      dev_download(got_working, d_working, working_bytes);
      snprintf(what + len, sizeof what - len, ": working");
      d = check_ulp(what, working, got_working, working_dtype, n, OPTIM_MAX_ULP);
      optim_worst_ulp = d > optim_worst_ulp ? d : optim_worst_ulp;
    }
  }

  dev_free(d_param);
  dev_free(d_buf);
  dev_free(d_grad);
  dev_free(d_working);
  free(param);
  free(buf);
  free(grad_f);
  free(grad);
  free(working);
  free(got_f32);
  free(got_working);
}

static void test_sgd_matches_cpu(void **state) {
  for (size_t v = 0; v < sizeof sgd_variants / sizeof sgd_variants[0]; v++)
    for (size_t g = 0; g < 3; g++)
      for (size_t w = 0; w < 4; w++)
        for (size_t s = 0; s < N_SIZES; s++)
          run_sgd_case(&sgd_variants[v], grad_dtypes[g], working_dtypes[w], test_sizes[s],
                       case_seed(2, (int)v, (int)g, (int)w, test_sizes[s]));
  print_message("adam+sgd: largest difference from the CPU: %" PRId64 " ulp (allowed %d)\n",
                optim_worst_ulp, OPTIM_MAX_ULP);
}

/* An odd offset makes every array misaligned for 4-wide access, which takes
 * the kernels' one-element path over the whole array. */
static void test_optim_misaligned_arrays(void **state) {
  const size_t n = 4097;
  rng r = {77};
  size_t bytes = (n + 1) * sizeof(float);
  float *param = xmalloc(bytes), *m = xmalloc(bytes), *v = xmalloc(bytes), *g = xmalloc(bytes);
  uint16_t *working = xmalloc((n + 1) * 2), *got_working = xmalloc((n + 1) * 2);
  float *got = xmalloc(bytes);
  fill_values(&r, param, n + 1, -4, 0);
  fill_values(&r, m, n + 1, -8, -2);
  for (size_t i = 0; i < n + 1; i++)
    v[i] = fabsf(rng_value(&r, -16, -8));
  fill_values(&r, g, n + 1, -10, 0);
  float *d_param = dev_upload(param, bytes), *d_m = dev_upload(m, bytes);
  float *d_v = dev_upload(v, bytes), *d_g = dev_upload(g, bytes);
  uint16_t *d_working = dev_alloc((n + 1) * 2);

  zk_adam_hparams hp = {.lr = 1e-3,
                        .beta1 = 0.9,
                        .beta2 = 0.95,
                        .eps = 1e-8,
                        .weight_decay = 0.1,
                        .decoupled_weight_decay = 1,
                        .step = 10,
                        .grad_scale = 1.0};
  assert_int_equal(
      zk_adam_step(NULL, &hp, param + 1, m + 1, v + 1, g + 1, ZK_F32, working + 1, ZK_BF16, n), 0);
  CU_OK(cu->adam_step(NULL, &hp, d_param + 1, d_m + 1, d_v + 1, d_g + 1, ZK_F32, d_working + 1,
                      ZK_BF16, n));
  dev_download(got, d_param, bytes);
  check_ulp("misaligned adam: param", param + 1, got + 1, ZK_F32, n, OPTIM_MAX_ULP);
  dev_download(got, d_v, bytes);
  check_ulp("misaligned adam: exp_avg_sq", v + 1, got + 1, ZK_F32, n, OPTIM_MAX_ULP);
  dev_download(got_working, d_working, (n + 1) * 2);
  check_ulp("misaligned adam: working", working + 1, got_working + 1, ZK_BF16, n, OPTIM_MAX_ULP);

  dev_free(d_param);
  dev_free(d_m);
  dev_free(d_v);
  dev_free(d_g);
  dev_free(d_working);
  free(param);
  free(m);
  free(v);
  free(g);
  free(working);
  free(got_working);
  free(got);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_load_returns_one_table),
      cmocka_unit_test(test_memory_round_trip),
      cmocka_unit_test(test_failure_sets_last_error),
      cmocka_unit_test(test_bad_arguments_are_rejected),
      cmocka_unit_test(test_adam_matches_cpu),
      cmocka_unit_test(test_sgd_matches_cpu),
      cmocka_unit_test(test_optim_misaligned_arrays),
  };
  return gpu_test_main("cuda_optim", tests, sizeof tests / sizeof tests[0]);
}
