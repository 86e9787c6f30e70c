/* Jobs on a base (docs/bases.md), through libzerod against a real
 * `zerod standalone` of two ranks (tests/standalone_daemon.h), each rank a
 * thread with its own connection:
 *
 * - a job "base" registers a unit of known values and is frozen with
 *   `zerodctl jobs freeze`; from then on it refuses writes;
 * - a job on it registers that unit from the base, plus an adapter of its
 *   own, and trains the adapter with gradients that depend on the base's
 *   values; a job with a private copy (the same values as its own frozen
 *   unit) trains the same adapter: the adapters must be bit-identical;
 * - a second job on the base gathers the base unit from the node's cache:
 *   no all-gather bytes, and none of the base's bytes in its state;
 * - what would write the base unit is refused (gradient buffer, load,
 *   writable mapping), and so is a registration that does not match it. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "standalone_daemon.h"
#include "zerod.h"

#define RANKS 2
#define ROWS  8
#define COLS  16
#define STEPS 4

static standalone_daemon daemon_proc;

static float base_value(unsigned k) {
  return (float)sin(0.37 * k + 0.1) * 0.5f;
}

/* One rank's connection to a job. */
typedef struct rank_session {
  zd_client *client;
  zd_job *job;
  zd_status status;
  char error[512];
} rank_session;

typedef enum job_kind { MAKE_BASE, ON_BASE, PRIVATE_COPY } job_kind;

typedef struct rank_task {
  job_kind kind;
  const char *job_name;
  unsigned rank;
  float adapter[COLS];        /* the trained adapter, gathered after the last step */
  zd_rank_stats stats[RANKS]; /* after training */
  zd_status grad_on_base, load_on_base, register_mismatch, register_unknown;
  int writable_mapping_refused;
  int holds_base_unit; /* the doomed job's ranks got the base's unit */
  rank_session s;
} rank_task;

#define TRY(call)                                                                                  \
  do {                                                                                             \
    zd_status st_ = (call);                                                                        \
    if (st_ != ZD_OK) {                                                                            \
      t->s.status = st_;                                                                           \
      snprintf(t->s.error, sizeof t->s.error, "%s: %s", #call, zd_last_error());                   \
      return;                                                                                      \
    }                                                                                              \
  } while (0)

static void attach(rank_task *t, const char *base_job) {
  zd_job_config config = ZD_JOB_CONFIG_INIT;
  config.lr = 0.05;
  if (base_job != NULL)
    snprintf(config.base_job, sizeof config.base_job, "%s", base_job);
  zd_attach_options options = ZD_ATTACH_OPTIONS_INIT;
  options.job = t->job_name;
  options.local_rank = t->rank;
  options.create = 1;
  options.config = &config;
  t->s.status = zd_connect(daemon_proc.socket, &t->s.client);
  if (t->s.status == ZD_OK)
    t->s.status = zd_attach(t->s.client, &options, &t->s.job);
  if (t->s.status != ZD_OK)
    snprintf(t->s.error, sizeof t->s.error, "attach %s: %s", t->job_name, zd_last_error());
}

static zd_status register_weight(rank_task *t, int from_base, int frozen, uint64_t cols,
                                 const char *name, zd_unit *out) {
  static float values[ROWS * COLS];
  for (unsigned k = 0; k < ROWS * COLS; k++)
    values[k] = base_value(k);
  uint64_t shape[2] = {ROWS, cols};
  zd_tensor_desc tensor = ZD_TENSOR_DESC_INIT;
  tensor.name = "w";
  tensor.shape = shape;
  tensor.ndim = 2;
  tensor.frozen = frozen;
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = name;
  desc.tensors = &tensor;
  desc.ntensors = 1;
  desc.init_values = values;
  desc.from_base = from_base;
  return zd_register_unit(t->s.job, &desc, out);
}

static void make_base(rank_task *t) {
  zd_unit w;
  TRY(register_weight(t, 0, 0, COLS, "layer.w", &w));
  TRY(zd_detach(t->s.job));
}

/* The adapter's gradient: a function of the base's values and the
 * adapter's own, computed alike by every run. */
static void adapter_grad(const float *w, const float *a, float *g) {
  for (unsigned c = 0; c < COLS; c++) {
    float s = 0;
    for (unsigned r = 0; r < ROWS; r++)
      s += w[r * COLS + c] * (a[c] + 0.25f);
    g[c] = s;
  }
}

static void probe_refusals(rank_task *t, zd_unit w) {
  zd_view view = ZD_VIEW_INIT;
  t->grad_on_base = zd_grad_buffer(t->s.job, w, &view);
  float values[ROWS * COLS] = {0};
  t->load_on_base = zd_load_unit(t->s.job, w, values, NULL);
  zd_unit other;
  t->register_mismatch = register_weight(t, 1, 0, COLS - 1, "layer.w", &other);
  t->register_unknown = register_weight(t, 1, 0, COLS, "layer.nothing", &other);
}

static void train(rank_task *t) {
  zd_unit w, a;
  TRY(register_weight(t, t->kind == ON_BASE, 1, COLS, "layer.w", &w));
  float init[COLS];
  for (unsigned c = 0; c < COLS; c++)
    init[c] = 0.01f * (float)c;
  uint64_t shape[1] = {COLS};
  zd_tensor_desc tensor = ZD_TENSOR_DESC_INIT;
  tensor.name = "a";
  tensor.shape = shape;
  tensor.ndim = 1;
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "adapter";
  desc.tensors = &tensor;
  desc.ntensors = 1;
  desc.init_values = init;
  TRY(zd_register_unit(t->s.job, &desc, &a));
  for (int step = 0; step < STEPS; step++) {
    zd_view wv = ZD_VIEW_INIT, av = ZD_VIEW_INIT, gv = ZD_VIEW_INIT;
    TRY(zd_gather(t->s.job, w, &wv));
    TRY(zd_gather(t->s.job, a, &av));
    if (t->kind == ON_BASE && step == 0)
      t->writable_mapping_refused =
          mprotect(wv.base, wv.bytes, PROT_READ | PROT_WRITE) != 0 && errno == EACCES;
    TRY(zd_grad_buffer(t->s.job, a, &gv));
    adapter_grad(wv.tensors[0].data, av.tensors[0].data, gv.tensors[0].data);
    TRY(zd_release(t->s.job, w));
    TRY(zd_release(t->s.job, a));
    TRY(zd_reduce(t->s.job, a));
    zd_step_result result = ZD_STEP_RESULT_INIT;
    TRY(zd_step(t->s.job, NULL, &result));
  }
  zd_view av = ZD_VIEW_INIT;
  TRY(zd_gather(t->s.job, a, &av));
  memcpy(t->adapter, av.tensors[0].data, sizeof t->adapter);
  TRY(zd_release(t->s.job, a));
  if (t->kind == ON_BASE)
    probe_refusals(t, w);
  unsigned n = 0;
  t->stats[0].struct_size = sizeof t->stats[0];
  TRY(zd_job_stats(t->s.job, t->stats, RANKS, &n));
  TRY(zd_detach(t->s.job));
}

static void *rank_main(void *arg) {
  rank_task *t = arg;
  attach(t, t->kind == ON_BASE ? "base" : NULL);
  if (t->s.status == ZD_OK)
    t->kind == MAKE_BASE ? make_base(t) : train(t);
  if (t->s.client != NULL)
    zd_close(t->s.client);
  return NULL;
}

/* Runs one job's ranks as threads and fails the test on any rank's error. */
static void run_job(job_kind kind, const char *name, rank_task *tasks) {
  pthread_t threads[RANKS];
  for (unsigned r = 0; r < RANKS; r++) {
    memset(&tasks[r], 0, sizeof tasks[r]);
    tasks[r].kind = kind;
    tasks[r].job_name = name;
    tasks[r].rank = r;
    assert_int_equal(pthread_create(&threads[r], NULL, rank_main, &tasks[r]), 0);
  }
  for (unsigned r = 0; r < RANKS; r++)
    pthread_join(threads[r], NULL);
  for (unsigned r = 0; r < RANKS; r++)
    if (tasks[r].s.status != ZD_OK) {
      standalone_daemon_print_log(&daemon_proc);
      fail_msg("job %s, rank %u: %s", name, r, tasks[r].s.error);
    }
}

/* Runs zerodctl with args; its output into out. */
static void zerodctl_out(const char *args, char *out, size_t out_bytes) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%s --coordinator unix:%s/control.sock %s 2>&1", ZERODCTL_BINARY,
           daemon_proc.dir, args);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t n = fread(out, 1, out_bytes - 1, p);
  out[n] = '\0';
  if (pclose(p) != 0)
    fail_msg("%s failed: %s", cmd, out);
}

static void zerodctl(const char *args) {
  char out[2048];
  zerodctl_out(args, out, sizeof out);
}

/* Waits until the coordinator has saved base and stored its checkpoint
 * (the save's copy of the base comes and goes in the daemon's memory). */
static void wait_for_base_checkpoint(const char *base) {
  char args[128], out[8192] = "";
  snprintf(args, sizeof args, "jobs get %s --json", base);
  for (int tries = 0; tries < 1500; tries++) { /* 30 s */
    zerodctl_out(args, out, sizeof out);
    if (strstr(out, "\"base_checkpoint\":\"step-") != NULL)
      return;
    usleep(20000);
  }
  fail_msg("base %s was not saved: %s", base, out);
}

/* The node learns of the freeze through its watch: a write to the base is
 * refused once it has. */
static void wait_until_frozen(void) {
  char last[600] = "";
  for (int tries = 0; tries < 1500; tries++) { /* 30 s */
    rank_task t = {.kind = MAKE_BASE, .job_name = "base", .rank = 0};
    attach(&t, NULL);
    /* A gradient buffer: no collective (a registration would wait for
     * rank 1), and refused once the node knows. */
    zd_view view = ZD_VIEW_INIT;
    zd_status st = t.s.status == ZD_OK ? zd_list_units(t.s.job, NULL) : t.s.status;
    if (st == ZD_OK)
      st = zd_grad_buffer(t.s.job, 0, &view);
    snprintf(last, sizeof last, "%s: %s", zd_strerror(st), zd_last_error());
    if (t.s.client != NULL)
      zd_close(t.s.client);
    if (st == ZD_E_FAILED_PRECONDITION && strstr(last, "frozen base") != NULL)
      return;
    usleep(20000);
  }
  fail_msg("the node never refused a write to the frozen base (last: %s)", last);
}

static uint64_t all_gather_bytes(const zd_rank_stats *s) {
  uint64_t bytes = 0;
  for (unsigned k = 0; k < s->ncounters; k++)
    if (strcmp(s->counters[k].collective, "all_gather") == 0)
      bytes += s->counters[k].bytes;
  return bytes;
}

static void test_jobs_on_a_base_train_like_a_private_copy_and_share_it(void **state) {
  (void)state;
  static rank_task base[RANKS], first[RANKS], second[RANKS], private_copy[RANKS];
  run_job(MAKE_BASE, "base", base);
  zerodctl("jobs freeze base");
  wait_until_frozen();
  run_job(ON_BASE, "lora-1", first);
  run_job(ON_BASE, "lora-2", second);
  run_job(PRIVATE_COPY, "private", private_copy);
  for (unsigned r = 0; r < RANKS; r++) {
    if (memcmp(first[r].adapter, private_copy[r].adapter, sizeof first[r].adapter) != 0)
      fail_msg("rank %u: the adapter trained on the base differs from the private copy's "
               "(%.9g vs %.9g)",
               r, first[r].adapter[1], private_copy[r].adapter[1]);
    assert_memory_equal(second[r].adapter, first[r].adapter, sizeof first[r].adapter);
    /* Something trained: the adapter moved from its initial values. */
    assert_true(first[r].adapter[1] != 0.01f);
  }
  for (unsigned r = 0; r < RANKS; r++) {
    /* The base's bytes are not the jobs': their state is the adapter's. */
    if (first[r].stats[r].state_bytes >= private_copy[r].stats[r].state_bytes)
      fail_msg("rank %u: state of the job on the base %llu bytes, of the private copy %llu", r,
               (unsigned long long)first[r].stats[r].state_bytes,
               (unsigned long long)private_copy[r].stats[r].state_bytes);
    /* The second job found the base unit in the node's cache: its
     * all-gathers moved the adapter only, less than the first job's. */
    if (all_gather_bytes(&second[r].stats[r]) >= all_gather_bytes(&first[r].stats[r]))
      fail_msg("rank %u: all-gather bytes of the second job %llu, of the first %llu", r,
               (unsigned long long)all_gather_bytes(&second[r].stats[r]),
               (unsigned long long)all_gather_bytes(&first[r].stats[r]));
    assert_int_equal(first[r].grad_on_base, ZD_E_FAILED_PRECONDITION);
    assert_int_equal(first[r].load_on_base, ZD_E_FAILED_PRECONDITION);
    assert_int_equal(first[r].register_mismatch, ZD_E_INVALID_ARGUMENT);
    assert_int_equal(first[r].register_unknown, ZD_E_INVALID_ARGUMENT);
    assert_true(first[r].writable_mapping_refused);
  }
}

/* ---- A job on the base dies ---------------------------------------------- */

/* In a child process: a job on the base whose two ranks gather the base's
 * unit and hold it, then the process is killed. */
static void *crash_rank(void *arg) {
  rank_task *t = arg;
  attach(t, "base");
  zd_unit w;
  zd_view view = ZD_VIEW_INIT;
  if (t->s.status == ZD_OK && register_weight(t, 1, 0, COLS, "layer.w", &w) == ZD_OK &&
      zd_gather(t->s.job, w, &view) == ZD_OK)
    t->holds_base_unit = 1;
  return NULL;
}

static void crash_a_job_on_the_base(void) {
  pid_t child = fork();
  assert_true(child >= 0);
  if (child == 0) {
    static rank_task tasks[RANKS];
    pthread_t threads[RANKS];
    for (unsigned r = 0; r < RANKS; r++) {
      tasks[r] = (rank_task){.kind = ON_BASE, .job_name = "doomed", .rank = r};
      pthread_create(&threads[r], NULL, crash_rank, &tasks[r]);
    }
    for (unsigned r = 0; r < RANKS; r++)
      pthread_join(threads[r], NULL);
    raise(tasks[0].holds_base_unit && tasks[1].holds_base_unit ? SIGKILL : SIGABRT);
  }
  int status;
  assert_int_equal(waitpid(child, &status, 0), child);
  if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL)
    fail_msg("the doomed job's workers did not get to hold the base's unit (status %d)", status);
}

/* A job on the base whose workers are killed while they hold its unit:
 * the base and the node's cache stay, and a new job on it trains exactly
 * as the first did. */
static void test_the_base_outlives_a_job_on_it_that_dies(void **state) {
  (void)state;
  static rank_task before[RANKS], after[RANKS];
  run_job(ON_BASE, "lora-before", before);
  crash_a_job_on_the_base();
  run_job(ON_BASE, "lora-after", after);
  for (unsigned r = 0; r < RANKS; r++)
    assert_memory_equal(after[r].adapter, before[r].adapter, sizeof before[r].adapter);
}

/* ---- Memory: the base is held once ------------------------------------- */

#define BIG_ROWS 4096
#define BIG_COLS 4096 /* 16M floats: 64 MiB, so that a few MiB of noise stay small */

static uint64_t daemon_rss(void) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)daemon_proc.pid);
  FILE *f = fopen(path, "r");
  uint64_t kib = 0;
  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "VmRSS: %llu kB", (unsigned long long *)&kib) == 1)
      break;
  if (f != NULL)
    fclose(f);
  return kib * 1024;
}

typedef struct big_task {
  const char *job_name;
  const char *base_job; /* NULL: the unit is the job's own */
  unsigned rank;
  rank_session s;
} big_task;

static void *big_main(void *arg) {
  big_task *t = arg;
  rank_task a = {.job_name = t->job_name, .rank = t->rank};
  attach(&a, t->base_job);
  t->s = a.s;
  if (a.s.status != ZD_OK)
    return NULL;
  static const uint64_t shape[2] = {BIG_ROWS, BIG_COLS};
  float *values =
      t->base_job == NULL && t->rank == 0 ? malloc(sizeof(float) * BIG_ROWS * BIG_COLS) : NULL;
  for (uint64_t k = 0; values != NULL && k < (uint64_t)BIG_ROWS * BIG_COLS; k++)
    values[k] = base_value((unsigned)k);
  zd_tensor_desc tensor = ZD_TENSOR_DESC_INIT;
  tensor.name = "w";
  tensor.shape = shape;
  tensor.ndim = 2;
  tensor.frozen = 1;
  zd_unit_desc desc = ZD_UNIT_DESC_INIT;
  desc.name = "big.w";
  desc.tensors = &tensor;
  desc.ntensors = 1;
  desc.init_values = values;
  desc.from_base = t->base_job != NULL && strcmp(t->job_name, "big") != 0;
  zd_unit u;
  zd_view view = ZD_VIEW_INIT;
  zd_status st = zd_register_unit(a.s.job, &desc, &u);
  if (st == ZD_OK && strcmp(t->job_name, "big") != 0)
    st = zd_gather(a.s.job, u, &view);
  if (st == ZD_OK && strcmp(t->job_name, "big") != 0)
    st = zd_release(a.s.job, u);
  if (st == ZD_OK)
    st = zd_detach(a.s.job);
  if (st != ZD_OK) {
    t->s.status = st;
    snprintf(t->s.error, sizeof t->s.error, "%s: %s", t->job_name, zd_last_error());
  }
  free(values);
  zd_close(a.s.client);
  return NULL;
}

static void run_big(const char *name, const char *base_job) {
  pthread_t threads[RANKS];
  big_task tasks[RANKS];
  for (unsigned r = 0; r < RANKS; r++) {
    tasks[r] = (big_task){.job_name = name, .base_job = base_job, .rank = r};
    assert_int_equal(pthread_create(&threads[r], NULL, big_main, &tasks[r]), 0);
  }
  for (unsigned r = 0; r < RANKS; r++)
    pthread_join(threads[r], NULL);
  for (unsigned r = 0; r < RANKS; r++)
    if (tasks[r].s.status != ZD_OK)
      fail_msg("job %s, rank %u: %s", name, r, tasks[r].s.error);
}

/* The state bytes of every rank of job (zd_job_stats, through an attach
 * of its rank 0). */
static uint64_t state_bytes_of(const char *job) {
  rank_task t = {.job_name = job, .rank = 0};
  attach(&t, NULL);
  zd_rank_stats stats[RANKS];
  for (unsigned r = 0; r < RANKS; r++)
    stats[r] = (zd_rank_stats)ZD_RANK_STATS_INIT;
  unsigned n = 0;
  uint64_t sum = 0;
  if (t.s.status == ZD_OK && zd_job_stats(t.s.job, stats, RANKS, &n) == ZD_OK)
    for (unsigned r = 0; r < n && r < RANKS; r++)
      sum += stats[r].state_bytes;
  if (t.s.job != NULL)
    zd_detach(t.s.job);
  zd_close(t.s.client);
  return sum;
}

/* The daemon's resident memory as jobs come: the base's shards once, its
 * gathered copy once (the node's cache), and nothing more of it for a
 * second and a third job on it; a job with a private copy adds its own. */
static void test_the_base_is_held_once_however_many_jobs_use_it(void **state) {
  (void)state;
  const double base_bytes = 4.0 * BIG_ROWS * BIG_COLS;
  run_big("big", NULL);
  /* Master weights, moments and accumulator: 16 bytes a value. */
  assert_true(fabs((double)state_bytes_of("big") - 4 * base_bytes) < 0.01 * base_bytes);
  zerodctl("jobs freeze big");
  /* A base keeps its weights alone (fp32: the working copy is the master). */
  uint64_t held = 0;
  for (int tries = 0; tries < 500 && (held = state_bytes_of("big")) != (uint64_t)base_bytes;
       tries++)
    usleep(20000);
  if (held != (uint64_t)base_bytes)
    fail_msg("the base holds %" PRIu64 " bytes of state, not its weights' %.0f", held, base_bytes);
  wait_for_base_checkpoint("big");
  uint64_t before = daemon_rss();
  run_big("big-1", "big");
  uint64_t one = daemon_rss();
  run_big("big-2", "big");
  run_big("big-3", "big");
  uint64_t three = daemon_rss();
  run_big("big-private", NULL);
  uint64_t private_copy = daemon_rss();
  fprintf(stderr,
          "bases memory: base %.1f MiB; RSS %.1f MiB with the base, +%.1f MiB for the first job "
          "on it, +%.1f MiB for two more, +%.1f MiB for a private copy\n",
          base_bytes / 1048576, before / 1048576.0, ((double)one - before) / 1048576,
          ((double)three - one) / 1048576, ((double)private_copy - three) / 1048576);
  /* The first job brings the gathered copy: about the base's size. */
  if ((double)one - before > 1.25 * base_bytes)
    fail_msg("the first job on the base added %.1f MiB (base %.1f MiB)",
             ((double)one - before) / 1048576, base_bytes / 1048576);
  /* Two more add a small part of it, not the base again. */
  if ((double)three - one > 0.25 * base_bytes)
    fail_msg("two more jobs on the base added %.1f MiB (base %.1f MiB)",
             ((double)three - one) / 1048576, base_bytes / 1048576);
  /* A private copy holds the values itself (its master weights). */
  if ((double)private_copy - three < 0.9 * base_bytes)
    fail_msg("a private copy added only %.1f MiB (base %.1f MiB): the measure is blind",
             ((double)private_copy - three) / 1048576, base_bytes / 1048576);
}

/* ---- zerodctl top shows the bases ----------------------------------------- */

static char metrics_address[64];

static void test_top_shows_each_base_and_the_cache(void **state) {
  (void)state;
  char cmd[512], out[16384] = "";
  snprintf(cmd, sizeof cmd, "%s top --metrics %s --once --json --interval 0.2", ZERODCTL_BINARY,
           metrics_address);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t n = fread(out, 1, sizeof out - 1, p);
  out[n] = '\0';
  assert_int_equal(pclose(p), 0);
  /* The earlier tests left bases "base" and "big" with jobs on them, and
   * their units in the cache. */
  for (int k = 0; k < 2; k++) {
    char want[64];
    snprintf(want, sizeof want, "{\"base\":\"%s\"", k == 0 ? "base" : "big");
    const char *at = strstr(out, want);
    if (at == NULL)
      fail_msg("zerodctl top does not show base %s: %s", want, out);
    double jobs = 0, cached = 0, hits = -1, misses = -1;
    const char *j = strstr(at, "\"jobs\":"), *c = strstr(at, "\"cached_bytes\":");
    const char *h = strstr(at, "\"cache_hits\":"), *m = strstr(at, "\"cache_misses\":");
    assert_true(j != NULL && c != NULL && h != NULL && m != NULL);
    sscanf(j, "\"jobs\":%lf", &jobs);
    sscanf(c, "\"cached_bytes\":%lf", &cached);
    sscanf(h, "\"cache_hits\":%lf", &hits);
    sscanf(m, "\"cache_misses\":%lf", &misses);
    if (!(jobs >= 2 && cached > 0))
      fail_msg("base %s: jobs %g, cached bytes %g: %s", want, jobs, cached, out);
    /* Each base's own lookups: big's unit was gathered by 3 jobs of 2 ranks
     * each, the first missing on every rank, the two others hitting. */
    if (k == 1 && !(misses == RANKS && hits == 2 * RANKS))
      fail_msg("base big: %g hits, %g misses (want %d and %d): %s", hits, misses, 2 * RANKS, RANKS,
               out);
    if (k == 0 && !(misses >= 1 && hits >= 1))
      fail_msg("base base: %g hits, %g misses: %s", hits, misses, out);
  }
}

/* A port nobody listens on now, for the daemon's metrics. */
static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  int port = -1;
  if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(fd, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0)
    close(fd);
  return port;
}

static int setup(void **state) {
  (void)state;
  snprintf(metrics_address, sizeof metrics_address, "127.0.0.1:%d", free_port());
  const char *const extra[] = {"--metrics-listen", metrics_address, NULL};
  return standalone_daemon_start_with(&daemon_proc, ZEROD_BINARY, RANKS, extra);
}

static int teardown(void **state) {
  (void)state;
  return standalone_daemon_stop(&daemon_proc);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_jobs_on_a_base_train_like_a_private_copy_and_share_it),
      cmocka_unit_test(test_the_base_outlives_a_job_on_it_that_dies),
      cmocka_unit_test(test_the_base_is_held_once_however_many_jobs_use_it),
      cmocka_unit_test(test_top_shows_each_base_and_the_cache),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
