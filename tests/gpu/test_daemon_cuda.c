/* test_daemon_cuda.c - zerod --device cuda end to end: a real daemon whose
 * rank lives on GPU 0, a worker (this program) that reaches the daemon's
 * buffers through CUDA IPC, and the same training run on a --device cpu
 * daemon as the reference (docs/architecture.md).
 *
 * The worker registers a small unit with rank 0's initial values, then for
 * a few AdamW steps: gathers it (on the GPU daemon: a device pointer opened
 * from the buffer's IPC handle, read after its stream waited for the
 * daemon's "gathered" event), derives a gradient from the gathered weights,
 * writes it into the gradient buffer (on the GPU daemon: with the module's
 * copy_to_device into the IPC buffer, then the "gradient written" event),
 * reduces and steps. The weights gathered after every step must agree with
 * the CPU daemon's to 1e-6 relative: the GPU optimizer kernels are within
 * an ulp of the CPU drivers (test_cuda_optim.c).
 *
 * The daemons are started with posix_spawn (CUDA does not survive fork),
 * one after the other, each in a temporary directory of its own. Without a
 * usable GPU, or without NCCL, the program prints one "SKIP: ..." line and
 * exits 77 (ctest's SKIP_RETURN_CODE), unless ZEROD_REQUIRE_GPU=1 makes
 * that a failure.
 */
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpu_testutil.h"
#include "zerod.h"

#ifndef ZEROD_BINARY
#error "ZEROD_BINARY (the zerod program) must be defined by the build"
#endif

extern char **environ;

#define STEPS        5
#define REL_TOL      1e-6
#define W_ROWS       37
#define W_COLS       5
#define B_NUMEL      5
#define PACKED_NUMEL (W_ROWS * W_COLS + B_NUMEL)

/* ------------------------------------------------------------------------ */
/* A zerod process                                                          */
/* ------------------------------------------------------------------------ */

typedef struct daemon_proc {
  pid_t pid;
  char dir[64];
  char socket[128];
  char log[128];
} daemon_proc;

/* The daemon of the test that is running, killed by the teardown if the
 * test fails before it stops it. */
static daemon_proc *running;

static void print_log(const daemon_proc *d) {
  FILE *f = fopen(d->log, "r");
  if (f == NULL)
    return;
  char line[1024];
  fprintf(stderr, "---- %s ----\n", d->log);
  while (fgets(line, sizeof line, f) != NULL)
    fputs(line, stderr);
  fclose(f);
}

static void daemon_start(daemon_proc *d, const char *device) {
  snprintf(d->dir, sizeof d->dir, "/tmp/zerod-gpu-XXXXXX");
  assert_non_null(mkdtemp(d->dir));
  snprintf(d->socket, sizeof d->socket, "%s/zerod.sock", d->dir);
  snprintf(d->log, sizeof d->log, "%s/zerod.log", d->dir);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, d->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  char *argv[] = {(char *)ZEROD_BINARY,
                  "standalone",
                  "--device",
                  (char *)device,
                  "--ranks",
                  "1",
                  "--dir",
                  d->dir,
                  "--threads-per-rank",
                  "1",
                  "--log-level",
                  "debug",
                  NULL};
  int rc = posix_spawn(&d->pid, ZEROD_BINARY, &actions, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0)
    fail_msg("posix_spawn %s: %s", ZEROD_BINARY, strerror(rc));
  running = d;
  /* Ready once its socket exists. */
  for (int waited_ms = 0;; waited_ms += 20) {
    struct stat st;
    if (stat(d->socket, &st) == 0)
      return;
    int status;
    if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
      print_log(d);
      fail_msg("zerod --device %s exited early (status %d)", device, status);
    }
    if (waited_ms > 60000) {
      print_log(d);
      fail_msg("zerod --device %s did not create its socket in 60 s", device);
    }
    usleep(20000);
  }
}

/* SIGTERM, and a clean exit within a minute. */
static void daemon_stop(daemon_proc *d) {
  kill(d->pid, SIGTERM);
  int status = 0;
  for (int waited_ms = 0;; waited_ms += 20) {
    if (waitpid(d->pid, &status, WNOHANG) == d->pid)
      break;
    if (waited_ms > 60000) {
      kill(d->pid, SIGKILL);
      waitpid(d->pid, &status, 0);
      print_log(d);
      fail_msg("zerod did not stop on SIGTERM");
    }
    usleep(20000);
  }
  running = NULL;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    print_log(d);
    fail_msg("zerod exited with status %d", status);
  }
  unlink(d->log);
  rmdir(d->dir);
}

static int kill_running_daemon(void **state) {
  if (running != NULL) {
    kill(running->pid, SIGKILL);
    waitpid(running->pid, NULL, 0);
    running = NULL;
  }
  return 0;
}

/* The socket file may show up a moment before the daemon listens on it:
 * a refused connection is tried again for a few seconds. */
static zd_status connect_when_listening(const daemon_proc *d, zd_client **out) {
  zd_status status = ZD_E_UNAVAILABLE;
  for (int waited_ms = 0; waited_ms < 10000; waited_ms += 20) {
    status = zd_connect(d->socket, out);
    if (status != ZD_E_UNAVAILABLE)
      break;
    usleep(20000);
  }
  return status;
}

/* ------------------------------------------------------------------------ */
/* The worker                                                               */
/* ------------------------------------------------------------------------ */

#define ZD_OK_OR_FAIL(d, call)                                                                     \
  do {                                                                                             \
    zd_status zd_rc_ = (call);                                                                     \
    if (zd_rc_ != ZD_OK) {                                                                         \
      print_log(d);                                                                                \
      fail_msg("%s: %s (%s)", #call, zd_strerror(zd_rc_), zd_last_error());                        \
    }                                                                                              \
  } while (0)

/* Copies a gathered view's tensors (packed, in order) to the host. */
static void read_view(const zd_view *view, float *packed) {
  size_t at = 0;
  for (unsigned t = 0; t < view->ntensors; t++) {
    size_t bytes = view->tensors[t].numel * sizeof(float);
    if (view->device >= 0) {
      /* The legacy default stream waited for the "gathered" event
       * (zd_view_stream_wait); cudaMemcpy runs after it. */
      CU_OK(cu->copy_to_host(packed + at, view->tensors[t].data, bytes));
    } else {
      memcpy(packed + at, view->tensors[t].data, bytes);
    }
    at += view->tensors[t].numel;
  }
}

/* Writes packed gradients into a gradient view's tensors. */
static void write_view(const zd_view *view, const float *packed) {
  size_t at = 0;
  for (unsigned t = 0; t < view->ntensors; t++) {
    size_t bytes = view->tensors[t].numel * sizeof(float);
    if (view->device >= 0)
      CU_OK(cu->copy_to_device(view->tensors[t].data, packed + at, bytes));
    else
      memcpy(view->tensors[t].data, packed + at, bytes);
    at += view->tensors[t].numel;
  }
}

/* The whole run on one daemon: history[s] is the unit as gathered before
 * step s (history[STEPS]: after the last step). */
static void train(const char *device, float history[STEPS + 1][PACKED_NUMEL]) {
  daemon_proc d;
  daemon_start(&d, device);
  int expect_gpu = strcmp(device, "cuda") == 0;

  zd_client *client;
  ZD_OK_OR_FAIL(&d, connect_when_listening(&d, &client));
  zd_job_config config = ZD_JOB_CONFIG_INIT;
  config.optimizer = ZD_ADAMW;
  config.lr = 1e-2;
  config.weight_decay = 0.01;
  config.has_weight_decay = 1;
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "gpu-parity";
  options.create = 1;
  options.config = &config;
  zd_job *job;
  ZD_OK_OR_FAIL(&d, zd_attach(client, &options, &job));

  static const uint64_t w_shape[] = {W_ROWS, W_COLS};
  static const uint64_t b_shape[] = {B_NUMEL};
  zd_tensor_desc tensors[] = {{.name = "w", .shape = w_shape, .ndim = 2},
                              {.name = "b", .shape = b_shape, .ndim = 1}};
  float init[PACKED_NUMEL];
  for (int k = 0; k < PACKED_NUMEL; k++)
    init[k] = 0.25f * sinf(0.37f * (float)k) + 0.01f * (float)(k % 7);
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "layer";
  desc.tensors = tensors;
  desc.ntensors = 2;
  desc.init = ZD_INIT_FROM_RANK0;
  desc.init_values = init;
  zd_unit unit;
  ZD_OK_OR_FAIL(&d, zd_register_unit(job, &desc, &unit));

  for (int s = 0; s <= STEPS; s++) {
    zd_view gathered;
    ZD_OK_OR_FAIL(&d, zd_gather(job, unit, &gathered));
    if (expect_gpu) {
      assert_int_equal(gathered.device, 0);
      assert_non_null(gathered.event);
    } else {
      assert_int_equal(gathered.device, -1);
    }
    ZD_OK_OR_FAIL(&d, zd_view_stream_wait(&gathered, NULL));
    read_view(&gathered, history[s]);
    ZD_OK_OR_FAIL(&d, zd_view_stream_done(&gathered, NULL));
    ZD_OK_OR_FAIL(&d, zd_release(job, unit));
    if (s == STEPS)
      break;

    /* A gradient that depends on the weights, so a wrong update shows. */
    float grad[PACKED_NUMEL];
    for (int k = 0; k < PACKED_NUMEL; k++)
      grad[k] = 0.5f * history[s][k] - 0.02f * (float)((k + s) % 5);
    zd_view grad_view;
    ZD_OK_OR_FAIL(&d, zd_grad_buffer(job, unit, &grad_view));
    assert_int_equal(grad_view.device, expect_gpu ? 0 : -1);
    ZD_OK_OR_FAIL(&d, zd_view_stream_wait(&grad_view, NULL));
    write_view(&grad_view, grad);
    ZD_OK_OR_FAIL(&d, zd_view_stream_done(&grad_view, NULL));
    ZD_OK_OR_FAIL(&d, zd_reduce(job, unit));
    zd_step_result result;
    ZD_OK_OR_FAIL(&d, zd_step(job, NULL, &result));
    assert_int_equal(result.step, (uint64_t)s + 1);
    assert_false(result.skipped);
  }
  ZD_OK_OR_FAIL(&d, zd_detach(job));
  zd_close(client);
  daemon_stop(&d);
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                    */
/* ------------------------------------------------------------------------ */

static void test_cuda_daemon_trains_like_the_cpu_daemon(void **state) {
  static float cpu[STEPS + 1][PACKED_NUMEL], gpu[STEPS + 1][PACKED_NUMEL];
  train("cpu", cpu);
  train("cuda", gpu);
  for (int s = 0; s <= STEPS; s++) {
    for (int k = 0; k < PACKED_NUMEL; k++) {
      double a = cpu[s][k], b = gpu[s][k];
      double scale = fabs(a) > fabs(b) ? fabs(a) : fabs(b);
      if (fabs(a - b) > REL_TOL * scale + 1e-12)
        fail_msg("after step %d, element %d: cpu %.9g, cuda %.9g (relative tolerance %g)", s, k, a,
                 b, REL_TOL);
    }
  }
  /* The run must have moved the weights, or the comparison says nothing. */
  assert_true(fabs(cpu[STEPS][0] - cpu[0][0]) > 1e-3);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_cuda_daemon_trains_like_the_cpu_daemon, kill_running_daemon),
  };
  /* A GPU daemon needs NCCL for its communicator, even with one rank. */
  char why[512] = "";
  const zk_cuda_api *api = NULL;
  if (zk_cuda_load(&api, why, sizeof why) == 0 && api->nccl_available(why, sizeof why) != 0) {
    const char *require = getenv("ZEROD_REQUIRE_GPU");
    if (require != NULL && strcmp(require, "1") == 0) {
      fprintf(stderr, "FAIL: ZEROD_REQUIRE_GPU=1 but NCCL is not usable: %s\n", why);
      return 1;
    }
    printf("SKIP: no usable NCCL: %s\n", why);
    return 77;
  }
  return gpu_test_main("daemon_cuda", tests, sizeof tests / sizeof tests[0]);
}
