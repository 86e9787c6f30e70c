/* test_daemon_cuda.c - zerod --device cuda end to end: a real daemon whose
 * rank lives on GPU 0, a worker (this program) that reaches the daemon's
 * buffers through CUDA IPC, and the same training run on a --device cpu
 * daemon as the reference (docs/architecture.md).
 *
 * The worker registers two small units with rank 0's initial values, then
 * for a few AdamW steps: gathers them (on the GPU daemon: a device pointer opened
 * from the buffer's IPC handle, read after its stream waited for the
 * daemon's "gathered" event), derives a gradient from the gathered weights,
 * writes it into the gradient buffer (on the GPU daemon: with the module's
 * copy_to_device into the IPC buffer, then the "gradient written" event),
 * reduces and steps. The weights gathered after every step must agree with
 * the CPU daemon's to 1e-6 relative: the GPU optimizer kernels are within
 * an ulp of the CPU drivers (test_cuda_optim.c). With the optimizer state
 * offloaded (host memory or the tier file), the step is the CPU drivers'
 * own, so the weights must be the CPU daemon's to the bit; those runs also
 * save, restore and replay a checkpoint, and a test checks the host
 * quota. Last, a checkpoint saved on the GPU rank is restored by a CPU
 * daemon, and one saved on the CPU daemon by the GPU rank.
 *
 * The daemons are started with posix_spawn (CUDA does not survive fork),
 * one after the other, each in a temporary directory of its own. Without a
 * usable GPU, or without NCCL, the program prints one "SKIP: ..." line and
 * exits 77 (ctest's SKIP_RETURN_CODE), unless ZEROD_REQUIRE_GPU=1 makes
 * that a failure.
 */
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpu_testutil.h"
#include "standalone_daemon.h"
#include "zerod.h"

#if !defined(ZEROD_BINARY) || !defined(ZEROD_CTL)
#error "ZEROD_BINARY and ZEROD_CTL (the zerod and zerodctl programs) must be defined by the build"
#endif

#define STEPS        5
#define REL_TOL      1e-6
#define W_ROWS       613 /* 3 chunks of 1024 for the offloaded runs */
#define W_COLS       5
#define F_NUMEL      7 /* a frozen tensor between them */
#define B_NUMEL      5
#define PACKED_NUMEL (W_ROWS * W_COLS + F_NUMEL + B_NUMEL)
#define HEAD_NUMEL   1500 /* a second unit: an offloaded step's chunks cross units */
#define RUN_NUMEL    (PACKED_NUMEL + HEAD_NUMEL)
#define NUNITS       2

/* Where each unit's values lie in a run's history row. */
static const int unit_offset[NUNITS] = {0, PACKED_NUMEL};
static const int unit_numel[NUNITS] = {PACKED_NUMEL, HEAD_NUMEL};

/* ------------------------------------------------------------------------ */
/* A zerod process                                                          */
/* ------------------------------------------------------------------------ */

typedef standalone_daemon daemon_proc;

/* The daemon of the test that is running, killed by the teardown if the
 * test fails before it stops it. */
static daemon_proc *running;

static void print_log(const daemon_proc *d) {
  standalone_daemon_print_log(d);
}

/* Where the run keeps its optimizer state (offload_optimizer). */
typedef struct placement {
  zd_offload_device device;
  unsigned buffer_count;
  int pin_memory;
  zd_dtype working_dtype; /* 0: fp32 */
} placement;

static const placement ON_DEVICE = {ZD_OFFLOAD_DEFAULT, 0, 0, 0};

/* Starts `zerod standalone --device DEVICE` (tests/standalone_daemon.h),
 * its checkpoints in `checkpoint_dir` (NULL: the daemon's default, inside
 * its directory). */
static void daemon_start(daemon_proc *d, const char *device, const char *checkpoint_dir) {
  const char *extra[] = {"--device",
                         device,
                         "--log-level",
                         "debug",
                         checkpoint_dir != NULL ? "--checkpoint-dir" : NULL,
                         checkpoint_dir,
                         NULL};
  if (standalone_daemon_start_with(d, ZEROD_BINARY, 1, extra) != 0)
    fail_msg("zerod --device %s did not start (see above)", device);
  running = d;
}

/* Whether the daemon's log has a line with `text`. */
static int log_has(const daemon_proc *d, const char *text) {
  FILE *f = fopen(d->log, "r");
  if (f == NULL)
    return 0;
  char line[2048];
  int found = 0;
  while (!found && fgets(line, sizeof line, f) != NULL)
    found = strstr(line, text) != NULL;
  fclose(f);
  return found;
}

/* SIGTERM, and a clean exit within a minute; the directory is removed. */
static void daemon_stop(daemon_proc *d) {
  running = NULL;
  if (standalone_daemon_stop(d) != 0)
    fail_msg("zerod did not stop cleanly (its log is above)");
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

/* bf16 <-> fp32: the high half of the fp32 bits, rounded to nearest even
 * (the values here are finite). */
static float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);
  return (uint16_t)(bits >> 16);
}

/* Copies a gathered view's tensors (packed, in order) to the host, as
 * fp32 (a bf16 working copy widened). */
static void read_view(const zd_view *view, float *packed) {
  size_t at = 0;
  int bf16 = view->dtype == ZD_BF16;
  for (unsigned t = 0; t < view->ntensors; t++) {
    size_t numel = view->tensors[t].numel;
    size_t bytes = numel * (bf16 ? 2 : 4);
    void *host = bf16 ? malloc(bytes) : packed + at;
    assert_non_null(host);
    if (view->device >= 0) {
      /* The legacy default stream waited for the "gathered" event
       * (zd_view_stream_wait); cudaMemcpy runs after it. */
      CU_OK(cu->copy_to_host(host, view->tensors[t].data, bytes));
    } else {
      memcpy(host, view->tensors[t].data, bytes);
    }
    if (bf16) {
      for (size_t k = 0; k < numel; k++)
        packed[at + k] = bf16_to_f32(((const uint16_t *)host)[k]);
      free(host);
    }
    at += numel;
  }
}

/* Writes packed gradients into a gradient view's tensors (rounded to bf16
 * for a bf16 buffer). */
static void write_view(const zd_view *view, const float *packed) {
  size_t at = 0;
  int bf16 = view->dtype == ZD_BF16;
  for (unsigned t = 0; t < view->ntensors; t++) {
    size_t numel = view->tensors[t].numel;
    size_t bytes = numel * (bf16 ? 2 : 4);
    const void *host = packed + at;
    uint16_t *narrow = NULL;
    if (bf16) {
      narrow = malloc(bytes);
      assert_non_null(narrow);
      for (size_t k = 0; k < numel; k++)
        narrow[k] = f32_to_bf16(packed[at + k]);
      host = narrow;
    }
    if (view->device >= 0)
      CU_OK(cu->copy_to_device(view->tensors[t].data, host, bytes));
    else
      memcpy(view->tensors[t].data, host, bytes);
    free(narrow);
    at += numel;
  }
}

/* Steps from..to of the run: history[s] is the units as gathered before
 * step s (the last: after step `to`), back to back. On the cuda daemon the
 * views are device pointers. */
static void run_steps(const daemon_proc *d, zd_job *job, const zd_unit units[NUNITS],
                      int expect_gpu, int from, int to, float history[STEPS + 1][RUN_NUMEL]) {
  for (int s = from; s <= to; s++) {
    for (int u = 0; u < NUNITS; u++) {
      zd_view gathered = ZD_VIEW_INIT;
      ZD_OK_OR_FAIL(d, zd_gather(job, units[u], &gathered));
      if (expect_gpu) {
        assert_int_equal(gathered.device, 0);
        assert_non_null(gathered.event);
      } else {
        assert_int_equal(gathered.device, -1);
      }
      ZD_OK_OR_FAIL(d, zd_view_stream_wait(&gathered, NULL));
      read_view(&gathered, history[s] + unit_offset[u]);
      ZD_OK_OR_FAIL(d, zd_view_stream_done(&gathered, NULL));
      ZD_OK_OR_FAIL(d, zd_release(job, units[u]));
    }
    if (s == to)
      break;

    /* A gradient that depends on the weights, so a wrong update shows. */
    for (int u = 0; u < NUNITS; u++) {
      float grad[PACKED_NUMEL];
      for (int k = 0; k < unit_numel[u]; k++)
        grad[k] = 0.5f * history[s][unit_offset[u] + k] - 0.02f * (float)((k + s) % 5);
      zd_view grad_view = ZD_VIEW_INIT;
      ZD_OK_OR_FAIL(d, zd_grad_buffer(job, units[u], &grad_view));
      assert_int_equal(grad_view.device, expect_gpu ? 0 : -1);
      ZD_OK_OR_FAIL(d, zd_view_stream_wait(&grad_view, NULL));
      write_view(&grad_view, grad);
      ZD_OK_OR_FAIL(d, zd_view_stream_done(&grad_view, NULL));
      ZD_OK_OR_FAIL(d, zd_reduce(job, units[u]));
    }
    zd_step_result result = ZD_STEP_RESULT_INIT;
    ZD_OK_OR_FAIL(d, zd_step(job, NULL, &result));
    assert_int_equal(result.step, (uint64_t)s + 1);
    assert_false(result.skipped);
  }
}

#define SAVE_AT 2 /* the offloaded runs save a checkpoint after this step */

/* A daemon, the worker's connection to it and the job with its two units
 * registered. */
typedef struct session {
  daemon_proc d;
  int expect_gpu;
  zd_client *client;
  zd_job *job;
  zd_unit units[NUNITS];
} session;

static void session_open(session *s, const char *device, placement where,
                         const char *checkpoint_dir) {
  daemon_proc *d = &s->d;
  daemon_start(d, device, checkpoint_dir);
  s->expect_gpu = strcmp(device, "cuda") == 0;
  int offloaded = where.device != ZD_OFFLOAD_DEFAULT;

  ZD_OK_OR_FAIL(d, connect_when_listening(d, &s->client));
  zd_job_config config = ZD_JOB_CONFIG_INIT;
  config.optimizer = ZD_ADAMW;
  config.lr = 1e-2;
  config.weight_decay = 0.01;
  config.has_weight_decay = 1;
  config.offload_device = where.device;
  config.offload_buffer_count = where.buffer_count;
  config.offload_buffer_size = offloaded ? 1024 : 0;
  config.offload_pin_memory = where.pin_memory;
  if (where.working_dtype != 0)
    config.working_dtype = where.working_dtype;
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "gpu-parity";
  options.create = 1;
  options.config = &config;
  ZD_OK_OR_FAIL(d, zd_attach(s->client, &options, &s->job));

  static const uint64_t w_shape[] = {W_ROWS, W_COLS};
  static const uint64_t f_shape[] = {F_NUMEL};
  static const uint64_t b_shape[] = {B_NUMEL};
  zd_tensor_desc tensors[] = {
      {.struct_size = sizeof(zd_tensor_desc), .name = "w", .shape = w_shape, .ndim = 2},
      {.struct_size = sizeof(zd_tensor_desc),
       .name = "f",
       .shape = f_shape,
       .ndim = 1,
       .frozen = 1},
      {.struct_size = sizeof(zd_tensor_desc), .name = "b", .shape = b_shape, .ndim = 1}};
  float init[RUN_NUMEL];
  for (int k = 0; k < RUN_NUMEL; k++)
    init[k] = 0.25f * sinf(0.37f * (float)k) + 0.01f * (float)(k % 7);
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "layer";
  desc.tensors = tensors;
  desc.ntensors = 3;
  desc.init = ZD_INIT_FROM_RANK0;
  desc.init_values = init;
  ZD_OK_OR_FAIL(d, zd_register_unit(s->job, &desc, &s->units[0]));
  static const uint64_t head_shape[] = {HEAD_NUMEL};
  zd_tensor_desc head = {
      .struct_size = sizeof(zd_tensor_desc), .name = "h", .shape = head_shape, .ndim = 1};
  desc.name = "head";
  desc.tensors = &head;
  desc.ntensors = 1;
  desc.init_values = init + PACKED_NUMEL;
  ZD_OK_OR_FAIL(d, zd_register_unit(s->job, &desc, &s->units[1]));
}

static void session_close(session *s) {
  ZD_OK_OR_FAIL(&s->d, zd_detach(s->job));
  zd_close(s->client);
  daemon_stop(&s->d);
}

/* The whole run on one daemon: history[s] is the unit as gathered before
 * step s (history[STEPS]: after the last step). An offloaded run also
 * saves a checkpoint after step SAVE_AT, restores it once done and runs
 * the steps after it again, which must give the same bits. */
static void train(const char *device, placement where, float history[STEPS + 1][RUN_NUMEL]) {
  session run;
  session_open(&run, device, where, NULL);
  daemon_proc *d = &run.d;
  zd_job *job = run.job;
  const zd_unit *units = run.units;
  int expect_gpu = run.expect_gpu;
  int offloaded = where.device != ZD_OFFLOAD_DEFAULT;

  if (!offloaded) {
    run_steps(d, job, units, expect_gpu, 0, STEPS, history);
  } else {
    run_steps(d, job, units, expect_gpu, 0, SAVE_AT, history);
    zd_checkpoint_info info = ZD_CHECKPOINT_INFO_INIT;
    ZD_OK_OR_FAIL(d, zd_checkpoint_save(job, "mid", &info));
    assert_int_equal(info.step, SAVE_AT);
    run_steps(d, job, units, expect_gpu, SAVE_AT, STEPS, history);
    /* Where the state is, as the daemon counts it. */
    zd_rank_stats stats = ZD_RANK_STATS_INIT;
    unsigned nranks = 0;
    ZD_OK_OR_FAIL(d, zd_job_stats(job, &stats, 1, &nranks));
    assert_int_equal(nranks, 1);
    /* The fp32 accumulator and the working copy. */
    uint64_t padded = stats.state_bytes / (where.working_dtype == ZD_BF16 ? 6 : 8);
    assert_true(padded >= RUN_NUMEL && padded < RUN_NUMEL + 2048);
    if (expect_gpu && where.device == ZD_OFFLOAD_CPU)
      assert_int_equal(stats.host_state_bytes, 12 * padded); /* master, m, v */
    else
      assert_int_equal(stats.host_state_bytes, 0);
    if (where.device == ZD_OFFLOAD_NVME)
      assert_true(stats.tier_bytes >= 12 * padded);
    /* Back to step SAVE_AT, and the same steps again. */
    static float replay[STEPS + 1][RUN_NUMEL];
    ZD_OK_OR_FAIL(d, zd_checkpoint_restore(job, "mid", &info));
    assert_int_equal(info.step, SAVE_AT);
    run_steps(d, job, units, expect_gpu, SAVE_AT, STEPS, replay);
    for (int s = SAVE_AT; s <= STEPS; s++)
      if (memcmp(replay[s], history[s], sizeof replay[s]) != 0)
        fail_msg("after restoring step %d: step %d's weights differ from the first run's", SAVE_AT,
                 s);
  }
  if (expect_gpu && offloaded && !log_has(d, "optimizer state off the GPU")) {
    print_log(d);
    fail_msg("the GPU daemon did not take the offloaded step");
  }
  session_close(&run);
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                    */
/* ------------------------------------------------------------------------ */

static float cpu_run[STEPS + 1][RUN_NUMEL];
static zd_dtype cpu_run_dtype; /* of the run in cpu_run; 0: none yet */

/* The reference: the same run on a --device cpu daemon (once per working
 * precision). */
static void train_on_cpu(zd_dtype working_dtype) {
  if (cpu_run_dtype == working_dtype)
    return;
  placement on_device = ON_DEVICE;
  on_device.working_dtype = working_dtype;
  train("cpu", on_device, cpu_run);
  cpu_run_dtype = working_dtype;
  /* The run must have moved the weights, or the comparisons say nothing;
   * the frozen tensor must not have moved. */
  assert_true(fabs(cpu_run[STEPS][0] - cpu_run[0][0]) > 1e-3);
  assert_true(fabs(cpu_run[STEPS][PACKED_NUMEL] - cpu_run[0][PACKED_NUMEL]) > 1e-3);
  for (int k = W_ROWS * W_COLS; k < W_ROWS * W_COLS + F_NUMEL; k++)
    assert_true(cpu_run[STEPS][k] == cpu_run[0][k]);
}

/* Steps from..STEPS of two runs agree to rel_tol (0: to the bit). */
static void compare_runs(const char *name_a, float a_run[STEPS + 1][RUN_NUMEL], const char *name_b,
                         float b_run[STEPS + 1][RUN_NUMEL], int from, double rel_tol) {
  for (int s = from; s <= STEPS; s++) {
    for (int k = 0; k < RUN_NUMEL; k++) {
      double a = a_run[s][k], b = b_run[s][k];
      double scale = fabs(a) > fabs(b) ? fabs(a) : fabs(b);
      if (fabs(a - b) > rel_tol * scale + (rel_tol > 0 ? 1e-12 : 0))
        fail_msg("after step %d, element %d: %s %.9g, %s %.9g (relative tolerance %g)", s, k,
                 name_a, a, name_b, b, rel_tol);
    }
  }
}

static void compare(float gpu[STEPS + 1][RUN_NUMEL], double rel_tol) {
  compare_runs("cpu", cpu_run, "cuda", gpu, 0, rel_tol);
}

static void test_cuda_daemon_trains_like_the_cpu_daemon(void **state) {
  static float gpu[STEPS + 1][RUN_NUMEL];
  train_on_cpu(ZD_F32);
  train("cuda", ON_DEVICE, gpu);
  compare(gpu, REL_TOL);
}

/* offload_optimizer cpu on a GPU rank: the master weights and moments in
 * host memory, the step on the CPU with the CPU daemon's kernels over
 * chunks whose gradients came down from the GPU and whose working copy
 * goes back up, so the weights are the CPU daemon's to the bit. Two
 * page-locked buffers of 1024 elements: three chunks of the first unit,
 * the frozen tensor inside the last, then two of the second. */
static void test_cuda_daemon_with_host_optimizer_state_trains_like_the_cpu_daemon(void **state) {
  static float gpu[STEPS + 1][RUN_NUMEL];
  train_on_cpu(ZD_F32);
  train("cuda", (placement){ZD_OFFLOAD_CPU, 2, 1, ZD_F32}, gpu);
  compare(gpu, 0);
}

/* The same with a bf16 working copy: the CPU casts each chunk's new
 * weights to bf16 in the slot, and 2-byte elements go up. */
static void
test_cuda_daemon_with_host_optimizer_state_in_bf16_trains_like_the_cpu_daemon(void **state) {
  static float gpu[STEPS + 1][RUN_NUMEL];
  train_on_cpu(ZD_BF16);
  train("cuda", (placement){ZD_OFFLOAD_CPU, 3, 1, ZD_BF16}, gpu);
  compare(gpu, 0);
}

/* offload_optimizer nvme on a GPU rank: the state in the rank's tier
 * file, streamed through three pageable buffers; the same bits again. */
static void test_cuda_daemon_with_nvme_optimizer_state_trains_like_the_cpu_daemon(void **state) {
  static float gpu[STEPS + 1][RUN_NUMEL];
  train_on_cpu(ZD_F32);
  train("cuda", (placement){ZD_OFFLOAD_NVME, 3, 0, ZD_F32}, gpu);
  compare(gpu, 0);
}

/* A checkpoint saved by a `from` daemon after step SAVE_AT, restored by a
 * `to` daemon (a new process, the same checkpoint directory) into a job
 * registered afresh: the weights restored are the saved ones to the bit,
 * and the steps after it agree with the saving run's to REL_TOL (the bit
 * where both daemons are on the same device). */
static void move_checkpoint(const char *from, const char *to) {
  char checkpoints[64] = "/tmp/zerod-gpu-ckpt-XXXXXX";
  assert_non_null(mkdtemp(checkpoints));
  static float saved[STEPS + 1][RUN_NUMEL], resumed[STEPS + 1][RUN_NUMEL];
  session s;
  zd_checkpoint_info info = ZD_CHECKPOINT_INFO_INIT;
  session_open(&s, from, ON_DEVICE, checkpoints);
  run_steps(&s.d, s.job, s.units, s.expect_gpu, 0, SAVE_AT, saved);
  ZD_OK_OR_FAIL(&s.d, zd_checkpoint_save(s.job, "mid", &info));
  assert_int_equal(info.step, SAVE_AT);
  run_steps(&s.d, s.job, s.units, s.expect_gpu, SAVE_AT, STEPS, saved);
  session_close(&s);

  session_open(&s, to, ON_DEVICE, checkpoints);
  ZD_OK_OR_FAIL(&s.d, zd_checkpoint_restore(s.job, "mid", &info));
  assert_int_equal(info.step, SAVE_AT);
  run_steps(&s.d, s.job, s.units, s.expect_gpu, SAVE_AT, STEPS, resumed);
  session_close(&s);
  nftw(checkpoints, standalone_daemon_remove_entry, 16, FTW_DEPTH | FTW_PHYS);

  if (memcmp(resumed[SAVE_AT], saved[SAVE_AT], sizeof saved[SAVE_AT]) != 0)
    fail_msg("the weights restored on %s are not the ones saved on %s", to, from);
  compare_runs(from, saved, to, resumed, SAVE_AT, strcmp(from, to) == 0 ? 0 : REL_TOL);
}

static void test_checkpoint_saved_on_a_gpu_rank_restores_on_a_cpu_rank(void **state) {
  move_checkpoint("cuda", "cpu");
}

static void test_checkpoint_saved_on_a_cpu_rank_restores_on_a_gpu_rank(void **state) {
  move_checkpoint("cpu", "cuda");
}

/* Runs zerodctl against the daemon's control socket; its exit status. */
static int zerodctl(const daemon_proc *d, char *const args[]) {
  char control[160];
  snprintf(control, sizeof control, "unix:%s/control.sock", d->dir);
  char *argv[32] = {(char *)ZEROD_CTL, "-c", control};
  int n = 3;
  for (int k = 0; args[k] != NULL && n < 31; k++)
    argv[n++] = args[k];
  argv[n] = NULL;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  pid_t pid;
  int rc = posix_spawn(&pid, ZEROD_CTL, &actions, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0)
    fail_msg("posix_spawn %s: %s", ZEROD_CTL, strerror(rc));
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* A GPU rank's optimizer state in host memory counts against the job's
 * max_host_bytes (its accumulator and working copy against
 * max_device_bytes): a unit whose master and moments do not fit is
 * refused with the reason, one that fits trains, and the stats say where
 * its bytes are. */
static void test_cuda_daemon_counts_host_optimizer_state_against_the_host_quota(void **state) {
  daemon_proc d;
  daemon_start(&d, "cuda", NULL);
  char *create[] = {"jobs",  "create",
                    "quota", "--token",
                    "t",     "--offload-optimizer",
                    "cpu",   "--offload-buffer-size",
                    "1024",  "--max-host-bytes",
                    "96K",   "--max-device-bytes",
                    "1M",    NULL};
  if (zerodctl(&d, create) != 0) {
    print_log(&d);
    fail_msg("zerodctl jobs create failed");
  }
  zd_client *client;
  ZD_OK_OR_FAIL(&d, connect_when_listening(&d, &client));
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = "quota";
  options.token = "t";
  zd_job *job;
  ZD_OK_OR_FAIL(&d, zd_attach(client, &options, &job));
  /* The staging: 4 slots of 1024 fp32 gradients and fp32 working copy,
   * 32 KiB. 8192 elements: 96 KiB of master and moments beside it, over
   * 96 KiB; 64 KiB on the GPU, under 1 MiB. */
  static const uint64_t big_shape[] = {8192};
  zd_tensor_desc big_tensor = {
      .struct_size = sizeof(zd_tensor_desc), .name = "w", .shape = big_shape, .ndim = 1};
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "big";
  desc.tensors = &big_tensor;
  desc.ntensors = 1;
  desc.init = ZD_INIT_ZEROS;
  zd_unit unit;
  assert_int_equal(zd_register_unit(job, &desc, &unit), ZD_E_RESOURCE_EXHAUSTED);
  const char *why = zd_last_error();
  if (strstr(why, "optimizer state in host memory on rank 0") == NULL ||
      strstr(why, "max_host_bytes quota of 98304 bytes per rank (32768 in use, 32768 of them "
                  "offload_optimizer's staging buffers)") == NULL)
    fail_msg("unexpected refusal: %s", why);
  /* 4096 elements: 48 KiB on the host (80 with the staging), 32 KiB on
   * the GPU. */
  static const uint64_t small_shape[] = {4096};
  zd_tensor_desc small_tensor = {
      .struct_size = sizeof(zd_tensor_desc), .name = "w", .shape = small_shape, .ndim = 1};
  desc.name = "small";
  desc.tensors = &small_tensor;
  ZD_OK_OR_FAIL(&d, zd_register_unit(job, &desc, &unit));
  zd_rank_stats stats = ZD_RANK_STATS_INIT;
  unsigned nranks = 0;
  ZD_OK_OR_FAIL(&d, zd_job_stats(job, &stats, 1, &nranks));
  assert_int_equal(stats.host_state_bytes, 12 * 4096);
  assert_int_equal(stats.state_bytes, 8 * 4096);
  assert_int_equal(stats.tier_bytes, 0);
  assert_int_equal(stats.struct_size, sizeof stats);
  /* An entry without its size is refused, not overrun. */
  zd_rank_stats unsized = {0};
  assert_int_equal(zd_job_stats(job, &unsized, 1, &nranks), ZD_E_INVALID_ARGUMENT);
  assert_non_null(strstr(zd_last_error(), "ZD_RANK_STATS_INIT"));
  ZD_OK_OR_FAIL(&d, zd_detach(job));
  zd_close(client);
  daemon_stop(&d);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_cuda_daemon_trains_like_the_cpu_daemon, kill_running_daemon),
      cmocka_unit_test_teardown(
          test_cuda_daemon_with_host_optimizer_state_trains_like_the_cpu_daemon,
          kill_running_daemon),
      cmocka_unit_test_teardown(
          test_cuda_daemon_with_nvme_optimizer_state_trains_like_the_cpu_daemon,
          kill_running_daemon),
      cmocka_unit_test_teardown(
          test_cuda_daemon_with_host_optimizer_state_in_bf16_trains_like_the_cpu_daemon,
          kill_running_daemon),
      cmocka_unit_test_teardown(test_cuda_daemon_counts_host_optimizer_state_against_the_host_quota,
                                kill_running_daemon),
      cmocka_unit_test_teardown(test_checkpoint_saved_on_a_gpu_rank_restores_on_a_cpu_rank,
                                kill_running_daemon),
      cmocka_unit_test_teardown(test_checkpoint_saved_on_a_cpu_rank_restores_on_a_gpu_rank,
                                kill_running_daemon),
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
