/* bench_ckpt - the checkpoint format layer (daemon/ckpt.c) against raw
 * sequential I/O of the same bytes on the same filesystem, in one run:
 *
 *  1. save: ckpt_writer_open/write/finish of S data bytes, handed over in
 *     8 MiB chunks as the node's shard writer does (header, per-block XXH64
 *     table, footer, whole-file XXH64, fsync), against a raw sequential
 *     pwrite of the same S bytes in 8 MiB chunks into a new file and an
 *     fsync. Target: ckpt / raw >= 0.8 (throughput).
 *  2. restore: ckpt_reader_read of the whole data (every block read and
 *     checked) and ckpt_source_read of every unit's states in manifest
 *     order (what a restore does, world size 1), against a raw sequential
 *     read of the same S bytes in 8 MiB preads. Cold (the files' pages
 *     dropped with posix_fadvise(POSIX_FADV_DONTNEED) before each read, and
 *     checked with mincore) and warm (read again at once). Target >= 0.8.
 *  3. the parts: memcpy, XXH64 once, the writer's two hashes (block table
 *     and whole file), and the copy a save takes while training waits:
 *     into memory faulted in beforehand (hostmem_alloc, hostmem_populate,
 *     untimed: the rank's writer does it while the step runs), as rank/snapshot.c's
 *     take_snapshot does when the order came early enough, and into fresh
 *     memory (malloc + memcpy of S, when it did not), each with its share
 *     of the whole save (copy + write); and a restore's staging: ckpt_source
 *     into one hostmem buffer faulted in by a thread ahead of the reads
 *     (hostmem_populate_ahead), as ckpt/restore.c's read_checkpoint does, and
 *     into a fresh calloc'd buffer per unit and state (what it did before).
 *  4. prototypes (--no-prototypes skips them): the writer's work rebuilt
 *     here (hashing, then pwrites), then with sync_file_range to start
 *     write-back early (which ckpt_writer now does), then with the hashing
 *     on a second thread beside the writes; reads of 8 MiB with the same
 *     block checks (which ckpt_reader now does), and with the checks on a
 *     second thread; the snapshot, and a restore's staging, into
 *     MADV_HUGEPAGE memory; XXH3-64. They write and read the same bytes but
 *     not a valid shard file; they show where the time goes, not what
 *     ckpt.c does.
 *
 * Every figure is the median over --rounds rounds (default 7), after one
 * untimed warm-up round (the first touches of fresh memory and page cache
 * are several times slower on this VM); in each round the subjects and
 * their baselines run one after another, in an order that rotates from
 * round to round. Each line also has the fastest round of each (best,
 * ratio_best). Before each timed write the previous file is removed and
 * the filesystem synced (syncfs), outside the timing. --verbose prints
 * every round's times on stderr, and each write split into its data calls
 * and its fsync.
 *
 *   bench_ckpt [--mib N] [--dir DIR] [--rounds N] [--no-prototypes] [--keep] [--verbose]
 *
 * --mib (or $ZEROD_BENCH_CKPT_MIB, default 512): the data size, rounded
 * down to whole units; shrunk (and said so) when the filesystem or memory
 * cannot hold 4x of it. --dir (or $ZEROD_BENCH_CKPT_DIR): where the
 * files go (a new directory is made inside it and removed at the end);
 * default the directory of this executable (the build tree), which is on a
 * disk, where $TMPDIR or /tmp may be a tmpfs. The filesystem's type is
 * printed; on a tmpfs the "cold" reads are not cold and a warning is
 * printed. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <xxhash.h>

#include "bench_ckpt.h"
#include "bench_util.h"
#include "ckpt.h"
#include "hostmem.h"

#define NUNITS     16u
#define NSTATES    3u /* master, moment1, moment2 (AdamW) */
#define MAX_ROUNDS 64

void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "bench_ckpt: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  exit(1);
}

/* ------------------------------------------------------------------------ */
/* The state and the files                                                  */
/* ------------------------------------------------------------------------ */

uint8_t *src; /* the S data bytes, as a rank's snapshot would hold them */
uint8_t *dst; /* where reads go (pre-faulted) */
uint64_t S;   /* data bytes */
uint64_t unit_numel;
static char work_dir[PATH_MAX + 32], ckpt_dir[PATH_MAX + 40];
static char raw_path[PATH_MAX + 48];
char shard_path[PATH_MAX + 80], proto_path[PATH_MAX + 48];
static int work_fd = -1;
static uint64_t shard_file_bytes, shard_xxh64;
uint64_t *block_table; /* XXH64 of each CKPT_BLOCK_BYTES block of src */
uint64_t nblocks;

static void fill_state(void) {
  /* Incompressible bytes (xorshift), so that no layer can shortcut them. */
  uint64_t x = 0x9e3779b97f4a7c15ull;
  uint64_t *p = (uint64_t *)src;
  for (uint64_t i = 0; i < S / 8; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = x;
  }
  memset(dst, 0, S);
  nblocks = (S + CKPT_BLOCK_BYTES - 1) / CKPT_BLOCK_BYTES;
  block_table = malloc(nblocks * sizeof *block_table);
  if (block_table == NULL)
    die("out of memory");
  for (uint64_t b = 0; b < nblocks; b++) {
    uint64_t start = b * CKPT_BLOCK_BYTES;
    uint64_t len = S - start < CKPT_BLOCK_BYTES ? S - start : CKPT_BLOCK_BYTES;
    block_table[b] = XXH64(src + start, (size_t)len, 0);
  }
}

void pwrite_all(int fd, const uint8_t *p, size_t n, uint64_t off) {
  while (n > 0) {
    ssize_t w = pwrite(fd, p, n, (off_t)off);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      die("pwrite: %s", w < 0 ? strerror(errno) : "no progress");
    p += w;
    n -= (size_t)w;
    off += (uint64_t)w;
  }
}

void pread_all(int fd, uint8_t *p, size_t n, uint64_t off) {
  while (n > 0) {
    ssize_t r = pread(fd, p, n, (off_t)off);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      die("pread: %s", r < 0 ? strerror(errno) : "end of file");
    p += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
}

/* Removes path (if there) and syncs the filesystem, so that the removal's
 * and others' pending writes are not charged to the next timed run. */
void settle(const char *path) {
  if (path != NULL && unlink(path) != 0 && errno != ENOENT)
    die("unlink %s: %s", path, strerror(errno));
  if (syncfs(work_fd) != 0)
    die("syncfs: %s", strerror(errno));
}

/* Drops the file's pages from the page cache (it is already durable). */
void drop_cache(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    die("open %s: %s", path, strerror(errno));
  if (fdatasync(fd) != 0)
    die("fdatasync %s: %s", path, strerror(errno));
  int rc = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  if (rc != 0)
    die("posix_fadvise %s: %s", path, strerror(rc));
  close(fd);
}

/* The fraction of the file's pages in the page cache (mincore). */
static double resident(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0)
    die("open %s: %s", path, strerror(errno));
  size_t len = (size_t)st.st_size, page = (size_t)sysconf(_SC_PAGESIZE);
  void *map = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED)
    die("mmap %s: %s", path, strerror(errno));
  size_t npages = (len + page - 1) / page, in = 0;
  unsigned char *vec = malloc(npages);
  if (vec == NULL || mincore(map, len, vec) != 0)
    die("mincore %s: %s", path, strerror(errno));
  for (size_t i = 0; i < npages; i++)
    in += vec[i] & 1;
  free(vec);
  munmap(map, len);
  return (double)in / (double)npages;
}

/* ------------------------------------------------------------------------ */
/* The manifest (world size 1, NUNITS units of master + two moments)        */
/* ------------------------------------------------------------------------ */

static char unit_names[NUNITS][16], tensor_names[NUNITS][24];
static ckpt_tensor tensors[NUNITS];
static ckpt_unit units[NUNITS];
static ckpt_file_entry file_entry;
static char shard_name[40], job_name[] = "bench", ckpt_name[] = "bench";

static void make_manifest(ckpt_manifest *m) {
  memset(m, 0, sizeof *m);
  for (unsigned u = 0; u < NUNITS; u++) {
    snprintf(unit_names[u], sizeof unit_names[u], "unit%u", u);
    snprintf(tensor_names[u], sizeof tensor_names[u], "unit%u.weight", u);
    tensors[u] = (ckpt_tensor){
        .name = tensor_names[u], .shape = {unit_numel}, .ndim = 1, .numel = unit_numel};
    units[u] = (ckpt_unit){.name = unit_names[u],
                           .ntensors = 1,
                           .tensors = &tensors[u],
                           .numel = unit_numel,
                           .padded_numel = unit_numel,
                           .shard_numel = unit_numel};
  }
  file_entry =
      (ckpt_file_entry){.name = shard_name, .bytes = shard_file_bytes, .xxh64 = shard_xxh64};
  m->format_version = CKPT_FORMAT_VERSION;
  m->job = job_name;
  m->job_id = 1;
  m->name = ckpt_name;
  m->step = 100;
  m->version = 100;
  m->world_size = 1;
  snprintf(m->config.optimizer, sizeof m->config.optimizer, "adamw");
  m->config.lr = 1e-3;
  m->config.beta1 = 0.9;
  m->config.beta2 = 0.999;
  m->config.eps = 1e-8;
  m->config.weight_decay = 0.01;
  snprintf(m->config.working_dtype, sizeof m->config.working_dtype, "fp32");
  m->has_moment1 = m->has_moment2 = 1;
  m->nunits = NUNITS;
  m->units = units;
  m->files = &file_entry;
}

/* ------------------------------------------------------------------------ */
/* The timed operations: each returns seconds                               */
/* ------------------------------------------------------------------------ */

/* Of the last raw_write or ckpt_write: the seconds spent in the data
 * calls (pwrite into the page cache, or ckpt_writer_write), the rest
 * being the fsync (or ckpt_writer_finish). Printed with --verbose. */
static double last_data_s;

static double raw_write(const char *path, int srf) {
  settle(path);
  double t0 = bench_now_s();
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    die("open %s: %s", path, strerror(errno));
  for (uint64_t at = 0; at < S; at += CHUNK) {
    size_t n = S - at < CHUNK ? (size_t)(S - at) : CHUNK;
    pwrite_all(fd, src + at, n, at);
    if (srf)
      sync_file_range(fd, (off_t)at, (off_t)n, SYNC_FILE_RANGE_WRITE);
  }
  last_data_s = bench_now_s() - t0;
  if (fsync(fd) != 0)
    die("fsync %s: %s", path, strerror(errno));
  close(fd);
  return bench_now_s() - t0;
}

static double ckpt_write(void) {
  settle(shard_path);
  char err[512];
  ckpt_shard_header h = {.rank = 0, .world_size = 1, .job_id = 1, .step = 100, .data_bytes = S};
  double t0 = bench_now_s();
  ckpt_writer *w;
  if (ckpt_writer_open(shard_path, &h, &w, err, sizeof err) != 0)
    die("ckpt_writer_open: %s", err);
  for (uint64_t at = 0; at < S; at += CHUNK) {
    size_t n = S - at < CHUNK ? (size_t)(S - at) : CHUNK;
    if (ckpt_writer_write(w, src + at, n, err, sizeof err) != 0)
      die("ckpt_writer_write: %s", err);
  }
  last_data_s = bench_now_s() - t0;
  if (ckpt_writer_finish(w, &shard_file_bytes, &shard_xxh64, err, sizeof err) != 0)
    die("ckpt_writer_finish: %s", err);
  return bench_now_s() - t0;
}

static double raw_read(const char *path, int cold) {
  if (cold)
    drop_cache(path);
  double t0 = bench_now_s();
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    die("open %s: %s", path, strerror(errno));
  for (uint64_t at = 0; at < S; at += CHUNK)
    pread_all(fd, dst + at, S - at < CHUNK ? (size_t)(S - at) : CHUNK, at);
  close(fd);
  return bench_now_s() - t0;
}

static double ckpt_reader_all(int cold) {
  if (cold)
    drop_cache(shard_path);
  char err[512];
  ckpt_shard_header expect = {.rank = 0, .world_size = 1, .data_bytes = S};
  double t0 = bench_now_s();
  ckpt_reader *r;
  if (ckpt_reader_open(shard_path, shard_file_bytes, &expect, &r, err, sizeof err) != 0)
    die("ckpt_reader_open: %s", err);
  if (ckpt_reader_read(r, 0, dst, (size_t)S, err, sizeof err) != 0)
    die("ckpt_reader_read: %s", err);
  ckpt_reader_close(r);
  return bench_now_s() - t0;
}

/* What a restore's read does: every unit's states, in manifest order. */
static double ckpt_source_all(int cold) {
  if (cold)
    drop_cache(shard_path);
  char err[512];
  double t0 = bench_now_s();
  ckpt_source *s;
  if (ckpt_source_open(ckpt_dir, &s, err, sizeof err) != 0)
    die("ckpt_source_open: %s", err);
  const ckpt_state states[NSTATES] = {CKPT_MASTER, CKPT_MOMENT1, CKPT_MOMENT2};
  float *at = (float *)dst;
  for (unsigned u = 0; u < NUNITS; u++)
    for (unsigned k = 0; k < NSTATES; k++) {
      if (ckpt_source_read(s, u, states[k], 0, unit_numel, at, err, sizeof err) != 0)
        die("ckpt_source_read: %s", err);
      at += unit_numel;
    }
  ckpt_source_close(s);
  return bench_now_s() - t0;
}

/* The same into one buffer for every unit and state, faulted in by a
 * thread ahead of the reads, as a restore stages what it reads
 * (ckpt/restore.c read_checkpoint); freed untimed. */
static double ckpt_source_staged(void) {
  drop_cache(shard_path);
  char err[512];
  double t0 = bench_now_s();
  uint8_t *b = hostmem_alloc(S);
  if (b == NULL)
    die("out of memory");
  hostmem_ahead *ahead = hostmem_populate_ahead(b, S);
  ckpt_source *s;
  if (ckpt_source_open(ckpt_dir, &s, err, sizeof err) != 0)
    die("ckpt_source_open: %s", err);
  const ckpt_state states[NSTATES] = {CKPT_MASTER, CKPT_MOMENT1, CKPT_MOMENT2};
  for (unsigned u = 0; u < NUNITS; u++)
    for (unsigned k = 0; k < NSTATES; k++)
      if (ckpt_source_read(s, u, states[k], 0, unit_numel,
                           (float *)(b + ((uint64_t)u * NSTATES + k) * unit_numel * 4), err,
                           sizeof err) != 0)
        die("ckpt_source_read: %s", err);
  hostmem_populate_stop(ahead);
  ckpt_source_close(s);
  double t = bench_now_s() - t0;
  if (memcmp(b, src, S) != 0)
    die("ckpt_source read back different bytes");
  hostmem_free(b, S);
  return t;
}

/* The same into a new calloc'd buffer per unit and state, as a restore
 * staged what it read before the staging above; freed untimed. huge (a
 * prototype): the buffers mmap'd with MADV_HUGEPAGE instead. */
static double ckpt_source_fresh(int huge) {
  drop_cache(shard_path);
  char err[512];
  float *bufs[NUNITS * NSTATES];
  size_t buf_bytes = (unit_numel + 1) * sizeof(float);
  double t0 = bench_now_s();
  ckpt_source *s;
  if (ckpt_source_open(ckpt_dir, &s, err, sizeof err) != 0)
    die("ckpt_source_open: %s", err);
  const ckpt_state states[NSTATES] = {CKPT_MASTER, CKPT_MOMENT1, CKPT_MOMENT2};
  for (unsigned u = 0; u < NUNITS; u++)
    for (unsigned k = 0; k < NSTATES; k++) {
      float *b;
      if (huge) {
        b = mmap(NULL, buf_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (b == MAP_FAILED)
          die("mmap: %s", strerror(errno));
        madvise(b, buf_bytes, MADV_HUGEPAGE);
      } else if ((b = calloc(unit_numel + 1, sizeof(float))) == NULL) {
        die("out of memory");
      }
      bufs[u * NSTATES + k] = b;
      if (ckpt_source_read(s, u, states[k], 0, unit_numel, b, err, sizeof err) != 0)
        die("ckpt_source_read: %s", err);
    }
  ckpt_source_close(s);
  double t = bench_now_s() - t0;
  for (unsigned i = 0; i < NUNITS * NSTATES; i++) {
    if (memcmp(bufs[i], src + (uint64_t)i * unit_numel * 4, unit_numel * 4) != 0)
      die("ckpt_source read back different bytes");
    if (huge)
      munmap(bufs[i], buf_bytes);
    else
      free(bufs[i]);
  }
  return t;
}

static void check_dst(const char *what) {
  if (memcmp(dst, src, S) != 0)
    die("%s read back different bytes", what);
  memset(dst, 0, S);
}

/* ---- In memory ----------------------------------------------------------- */

static double t_memcpy(void) {
  double t0 = bench_now_s();
  memcpy(dst, src, S);
  double t = bench_now_s() - t0;
  if (dst[S - 1] != src[S - 1])
    die("memcpy");
  return t;
}

volatile uint64_t sink;

static double t_xxh64_once(void) {
  double t0 = bench_now_s();
  sink = XXH64(src, (size_t)S, 0);
  return bench_now_s() - t0;
}

/* XXH3-64 (a format change, for comparison only): the same data once. */
static double t_xxh3_once(void) {
  double t0 = bench_now_s();
  sink = XXH3_64bits(src, (size_t)S);
  return bench_now_s() - t0;
}

/* The writer's hashing, as ckpt_writer_write does it per 8 MiB chunk:
 * the block hashes over the chunk, then the whole file's over it. */
void writer_hashes(const uint8_t *p, uint64_t bytes, XXH64_state_t *file, XXH64_state_t *block,
                   uint64_t *block_fill, uint64_t *table, uint64_t *nb) {
  for (uint64_t at = 0; at < bytes; at += CHUNK) {
    size_t n = bytes - at < CHUNK ? (size_t)(bytes - at) : CHUNK;
    const uint8_t *c = p + at;
    size_t left = n;
    while (left > 0) {
      size_t take = CKPT_BLOCK_BYTES - *block_fill;
      if (take > left)
        take = left;
      XXH64_update(block, c, take);
      *block_fill += take;
      if (*block_fill == CKPT_BLOCK_BYTES) {
        table[(*nb)++] = XXH64_digest(block);
        XXH64_reset(block, 0);
        *block_fill = 0;
      }
      c += take;
      left -= take;
    }
    if (file != NULL)
      XXH64_update(file, p + at, n);
  }
}

static double t_writer_hashes(void) {
  XXH64_state_t *file = XXH64_createState(), *block = XXH64_createState();
  uint64_t *table = malloc(nblocks * sizeof *table), fill = 0, nb = 0;
  if (file == NULL || block == NULL || table == NULL)
    die("out of memory");
  double t0 = bench_now_s();
  XXH64_reset(file, 0);
  XXH64_reset(block, 0);
  writer_hashes(src, S, file, block, &fill, table, &nb);
  if (fill > 0)
    table[nb++] = XXH64_digest(block);
  sink = XXH64_digest(file);
  double t = bench_now_s() - t0;
  if (nb != nblocks || memcmp(table, block_table, nblocks * sizeof *table) != 0)
    die("writer hashes differ from the block table");
  free(table);
  XXH64_freeState(file);
  XXH64_freeState(block);
  return t;
}

/* The copy a save takes while the rank's steps wait (rank/snapshot.c
 * take_snapshot on a host rank: malloc of the shard bytes, then a copy of
 * each state into it). Freed outside the timing. */
/* The snapshot into fresh memory (staged 0), or into memory faulted in
 * beforehand, untimed (staged 1). */
static double t_snapshot(int staged) {
  uint8_t *p = staged ? hostmem_alloc(S) : malloc(S);
  if (p == NULL)
    die("out of memory");
  if (staged && hostmem_populate(p, S) != 0)
    memset(p, 0, S); /* before Linux 5.14 */
  double t0 = bench_now_s();
  uint64_t state_bytes = unit_numel * 4;
  for (uint64_t at = 0; at < S; at += state_bytes)
    memcpy(p + at, src + at, (size_t)state_bytes);
  double t = bench_now_s() - t0;
  if (p[S - 1] != src[S - 1])
    die("snapshot");
  if (staged)
    hostmem_free(p, S);
  else
    free(p);
  return t;
}

/* ------------------------------------------------------------------------ */
/* Reporting                                                                */
/* ------------------------------------------------------------------------ */

static int verbose;

static double med(double *t, int n) {
  double c[MAX_ROUNDS];
  memcpy(c, t, sizeof t[0] * (size_t)n);
  return bench_median(c, n);
}

static double best(const double *t, int n) {
  double b = t[0];
  for (int i = 1; i < n; i++)
    b = t[i] < b ? t[i] : b;
  return b;
}

static double mbps(double seconds) {
  return (double)S / seconds / 1e6;
}

/* One line: subject against baseline, as throughput (MB/s of data): the
 * medians and their ratio, and the best rounds' (the machine is shared:
 * the fastest round is the one least disturbed). */
static void report(const char *bench, const char *subject, double *t, const char *baseline,
                   double *tb, int rounds, const char *extra) {
  double v = mbps(med(t, rounds)), b = mbps(med(tb, rounds));
  if (verbose) {
    fprintf(stderr, "%s %s ms:", bench, subject);
    for (int r = 0; r < rounds; r++)
      fprintf(stderr, " %.1f", t[r] * 1e3);
    fprintf(stderr, " | %s ms:", baseline);
    for (int r = 0; r < rounds; r++)
      fprintf(stderr, " %.1f", tb[r] * 1e3);
    fprintf(stderr, "\n");
  }
  printf("{\"bench\":\"%s\",\"subject\":\"%s\",\"bytes\":%" PRIu64 ",\"metric\":\"MB/s\","
         "\"value\":%.1f,\"baseline\":\"%s\",\"baseline_value\":%.1f,\"ratio\":%.3f,"
         "\"best\":%.1f,\"baseline_best\":%.1f,\"ratio_best\":%.3f,\"rounds\":%d%s}\n",
         bench, subject, S, v, baseline, b, v / b, mbps(best(t, rounds)), mbps(best(tb, rounds)),
         best(tb, rounds) / best(t, rounds), rounds, extra != NULL ? extra : "");
  fflush(stdout);
}

/* ------------------------------------------------------------------------ */

static void usage(FILE *out) {
  fprintf(out, "usage: bench_ckpt [--mib N] [--dir DIR] [--rounds N] [--no-prototypes] [--keep]\n"
               "       [--verbose]\n");
}

int main(int argc, char **argv) {
  uint64_t mib = 512;
  int rounds = 7, prototypes = 1, keep = 0;
  const char *base = getenv("ZEROD_BENCH_CKPT_DIR");
  if (getenv("ZEROD_BENCH_CKPT_MIB") != NULL)
    mib = strtoull(getenv("ZEROD_BENCH_CKPT_MIB"), NULL, 10);
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--mib") == 0 && i + 1 < argc) {
      mib = strtoull(argv[++i], NULL, 10);
    } else if (strcmp(argv[i], "--dir") == 0 && i + 1 < argc) {
      base = argv[++i];
    } else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) {
      rounds = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--no-prototypes") == 0) {
      prototypes = 0;
    } else if (strcmp(argv[i], "--verbose") == 0) {
      verbose = 1;
    } else if (strcmp(argv[i], "--keep") == 0) {
      keep = 1;
    } else if (strcmp(argv[i], "--help") == 0) {
      usage(stdout);
      return 0;
    } else {
      usage(stderr);
      return 2;
    }
  }
  if (rounds < 1 || rounds > MAX_ROUNDS || mib < 16)
    die("--rounds must be 1..%d and --mib at least 16", MAX_ROUNDS);

  char exe_dir[PATH_MAX];
  if (base == NULL) {
    ssize_t n = readlink("/proc/self/exe", exe_dir, sizeof exe_dir - 1);
    if (n <= 0)
      die("readlink /proc/self/exe: %s", strerror(errno));
    exe_dir[n] = '\0';
    *strrchr(exe_dir, '/') = '\0';
    base = exe_dir;
  }
  snprintf(work_dir, sizeof work_dir, "%s/bench-ckpt-XXXXXX", base);
  if (mkdtemp(work_dir) == NULL)
    die("mkdtemp %s: %s", work_dir, strerror(errno));
  snprintf(ckpt_dir, sizeof ckpt_dir, "%s/ckpt", work_dir);
  if (mkdir(ckpt_dir, 0700) != 0)
    die("mkdir %s: %s", ckpt_dir, strerror(errno));
  ckpt_shard_name(0, 1, shard_name, sizeof shard_name);
  snprintf(shard_path, sizeof shard_path, "%s/%s", ckpt_dir, shard_name);
  snprintf(raw_path, sizeof raw_path, "%s/raw.bin", work_dir);
  snprintf(proto_path, sizeof proto_path, "%s/proto.bin", work_dir);
  if ((work_fd = open(work_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
    die("open %s: %s", work_dir, strerror(errno));

  /* Sizes: three files of S at once (raw, shard, prototype) and a margin
   * on the disk; two buffers of S and a snapshot in memory. */
  struct statfs sf;
  struct statvfs sv;
  if (fstatfs(work_fd, &sf) != 0 || fstatvfs(work_fd, &sv) != 0)
    die("statfs %s: %s", work_dir, strerror(errno));
  const char *fs = fs_name((long)sf.f_type);
  char device[256];
  mount_source(work_dir, device, sizeof device);
  uint64_t free_bytes = (uint64_t)sv.f_bavail * sv.f_frsize;
  uint64_t avail_mem = (uint64_t)sysconf(_SC_AVPHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
  uint64_t want = mib << 20, limit = want;
  if (free_bytes / 4 < limit)
    limit = free_bytes / 4;
  if (avail_mem / 4 < limit)
    limit = avail_mem / 4;
  if (limit < want)
    fprintf(stderr,
            "bench_ckpt: shrinking the state from %" PRIu64 " MiB to %" PRIu64
            " MiB (disk free %" PRIu64 " MiB, memory available %" PRIu64 " MiB)\n",
            want >> 20, limit >> 20, free_bytes >> 20, avail_mem >> 20);
  unit_numel = limit / (4ull * NSTATES * NUNITS) / 1024 * 1024;
  if (unit_numel == 0)
    die("not enough room for a state of %" PRIu64 " bytes", limit);
  S = unit_numel * 4 * NSTATES * NUNITS;
  if (strcmp(fs, "tmpfs") == 0)
    fprintf(stderr,
            "bench_ckpt: WARNING: %s is a tmpfs: nothing reaches a disk and 'cold' "
            "reads are memory reads; pass --dir on a disk filesystem\n",
            work_dir);

  src = malloc(S);
  dst = malloc(S);
  if (src == NULL || dst == NULL)
    die("out of memory for 2 x %" PRIu64 " bytes", S);
  fill_state();
  printf("{\"bench\":\"ckpt_env\",\"dir\":\"%s\",\"fs\":\"%s\",\"device\":\"%s\","
         "\"disk_free_mib\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"units\":%u,\"states\":%u,"
         "\"chunk_bytes\":%u,\"block_bytes\":%u,\"cpus\":%ld,\"rounds\":%d%s}\n",
         work_dir, fs, device, free_bytes >> 20, S, NUNITS, NSTATES, CHUNK, CKPT_BLOCK_BYTES,
         sysconf(_SC_NPROCESSORS_ONLN), rounds, limit < want ? ",\"shrunk\":true" : "");
  fflush(stdout);

  /* ---- Writes ---- */
  double w_raw_data[MAX_ROUNDS], w_ckpt_data[MAX_ROUNDS];
  double w_raw[MAX_ROUNDS], w_ckpt[MAX_ROUNDS], w_model[MAX_ROUNDS], w_srf[MAX_ROUNDS],
      w_thr[MAX_ROUNDS], w_raw_srf[MAX_ROUNDS];
  for (int r = -1; r < rounds; r++) { /* -1: a warm-up round, not kept */
    int k = r < 0 ? 0 : r;
    if (r % 2 == 0) {
      w_raw[k] = raw_write(raw_path, 0);
      w_raw_data[k] = last_data_s;
      w_ckpt[k] = ckpt_write();
      w_ckpt_data[k] = last_data_s;
    } else {
      w_ckpt[k] = ckpt_write();
      w_ckpt_data[k] = last_data_s;
      w_raw[k] = raw_write(raw_path, 0);
      w_raw_data[k] = last_data_s;
    }
    if (prototypes) {
      w_model[k] = proto_write(0);
      w_srf[k] = proto_write(1);
      w_thr[k] = proto_write(2);
      w_raw_srf[k] = raw_write(proto_path, 1);
    }
  }
  settle(proto_path);
  char extra[256];
  snprintf(extra, sizeof extra, ",\"fs\":\"%s\",\"target\":0.8", fs);
  report("ckpt_save_write", "ckpt_writer", w_ckpt, "raw_pwrite_8m_fsync", w_raw, rounds, extra);
  if (verbose) {
    fprintf(stderr, "ckpt_save_write data calls / fsync ms:");
    for (int r = 0; r < rounds; r++)
      fprintf(stderr, " %.0f/%.0f", w_ckpt_data[r] * 1e3, (w_ckpt[r] - w_ckpt_data[r]) * 1e3);
    fprintf(stderr, " | raw:");
    for (int r = 0; r < rounds; r++)
      fprintf(stderr, " %.0f/%.0f", w_raw_data[r] * 1e3, (w_raw[r] - w_raw_data[r]) * 1e3);
    fprintf(stderr, "\n");
  }
  if (shard_file_bytes != CKPT_HEADER_BYTES + S + 8 * nblocks + 8)
    die("unexpected shard file size %" PRIu64, shard_file_bytes);

  /* The manifest, for ckpt_source (not timed). */
  ckpt_manifest m;
  char err[512];
  make_manifest(&m);
  if (ckpt_manifest_store(ckpt_dir, CKPT_MANIFEST_NAME, &m, err, sizeof err) != 0)
    die("ckpt_manifest_store: %s", err);

  /* ---- Reads ---- */
  double rc_raw[MAX_ROUNDS], rc_rd[MAX_ROUNDS], rc_src[MAX_ROUNDS];
  double rw_raw[MAX_ROUNDS], rw_rd[MAX_ROUNDS], rw_src[MAX_ROUNDS];
  double rp_8m[MAX_ROUNDS], rp_thr[MAX_ROUNDS], rc_calloc[MAX_ROUNDS], rp_huge[MAX_ROUNDS],
      rc_staged[MAX_ROUNDS];
  double max_resident = 0;
  for (int r = -1; r < rounds; r++) { /* -1: a warm-up round, not kept */
    int k = r < 0 ? 0 : r;
    for (int i = 0; i < 3; i++) {
      int which = (i + k) % 3;
      if (which == 0) {
        drop_cache(raw_path);
        double res = resident(raw_path);
        max_resident = res > max_resident ? res : max_resident;
        rc_raw[k] = raw_read(raw_path, 1);
        rw_raw[k] = raw_read(raw_path, 0);
        check_dst("raw read");
      } else if (which == 1) {
        drop_cache(shard_path);
        double res = resident(shard_path);
        max_resident = res > max_resident ? res : max_resident;
        rc_rd[k] = ckpt_reader_all(1);
        rw_rd[k] = ckpt_reader_all(0);
        check_dst("ckpt_reader");
      } else {
        rc_src[k] = ckpt_source_all(1);
        rw_src[k] = ckpt_source_all(0);
        check_dst("ckpt_source");
      }
    }
    rc_staged[k] = ckpt_source_staged();
    rc_calloc[k] = ckpt_source_fresh(0);
    if (prototypes) {
      rp_8m[k] = proto_read(0);
      check_dst("prototype read");
      rp_thr[k] = proto_read(1);
      check_dst("prototype read");
      rp_huge[k] = ckpt_source_fresh(1);
    }
  }
  snprintf(extra, sizeof extra,
           ",\"cache\":\"cold\",\"resident_before\":%.3f,\"fs\":\"%s\","
           "\"target\":0.8",
           max_resident, fs);
  report("ckpt_restore_read", "ckpt_reader", rc_rd, "raw_pread_8m", rc_raw, rounds, extra);
  report("ckpt_restore_read", "ckpt_source", rc_src, "raw_pread_8m", rc_raw, rounds, extra);
  report("ckpt_restore_read", "ckpt_source_into_staging", rc_staged, "raw_pread_8m", rc_raw, rounds,
         extra);
  report("ckpt_restore_read", "ckpt_source_into_calloc", rc_calloc, "raw_pread_8m", rc_raw, rounds,
         extra);
  snprintf(extra, sizeof extra, ",\"cache\":\"warm\",\"fs\":\"%s\"", fs);
  report("ckpt_restore_read", "ckpt_reader", rw_rd, "raw_pread_8m", rw_raw, rounds, extra);
  report("ckpt_restore_read", "ckpt_source", rw_src, "raw_pread_8m", rw_raw, rounds, extra);

  /* ---- In memory ---- */
  double c_mem[MAX_ROUNDS], c_xxh[MAX_ROUNDS], c_wh[MAX_ROUNDS], c_snap[MAX_ROUNDS],
      c_staged[MAX_ROUNDS], c_huge[MAX_ROUNDS], c_xxh3[MAX_ROUNDS];
  for (int r = -1; r < rounds; r++) { /* -1: a warm-up round, not kept */
    int k = r < 0 ? 0 : r;
    c_mem[k] = t_memcpy();
    c_xxh[k] = t_xxh64_once();
    c_wh[k] = t_writer_hashes();
    c_snap[k] = t_snapshot(0);
    c_staged[k] = t_snapshot(1);
    if (prototypes) {
      c_huge[k] = proto_snapshot_hugepage();
      c_xxh3[k] = t_xxh3_once();
    }
  }
  report("ckpt_parts", "xxh64_once", c_xxh, "memcpy_prefaulted", c_mem, rounds, NULL);
  report("ckpt_parts", "writer_hashes_block_and_file", c_wh, "memcpy_prefaulted", c_mem, rounds,
         NULL);
  report("ckpt_parts", "snapshot_staged_memcpy", c_staged, "memcpy_prefaulted", c_mem, rounds,
         NULL);
  report("ckpt_parts", "snapshot_malloc_memcpy", c_snap, "memcpy_prefaulted", c_mem, rounds, NULL);
  double write = med(w_ckpt, rounds);
  for (int staged = 1; staged >= 0; staged--) {
    double stall = med(staged ? c_staged : c_snap, rounds);
    printf("{\"bench\":\"ckpt_save_stall\",\"level\":\"format\",\"staged\":%s,\"bytes\":%" PRIu64
           ",\"stall_ms\":%.1f,\"total_ms\":%.1f,\"ratio\":%.3f,\"note\":\"stall: the copy of "
           "the state (take_snapshot) into %s; total: that plus ckpt_writer of it\"}\n",
           staged ? "true" : "false", S, stall * 1e3, (stall + write) * 1e3,
           stall / (stall + write),
           staged ? "memory the writer faulted in beforehand" : "fresh memory (malloc)");
  }
  /* Where a save's time goes: the writer's hashing against the time of
   * the raw write of the same bytes. */
  printf("{\"bench\":\"ckpt_save_breakdown\",\"bytes\":%" PRIu64 ",\"raw_write_ms\":%.1f,"
         "\"ckpt_write_ms\":%.1f,\"writer_hashes_ms\":%.1f,\"raw_plus_hashes_ms\":%.1f}\n",
         S, med(w_raw, rounds) * 1e3, write * 1e3, med(c_wh, rounds) * 1e3,
         (med(w_raw, rounds) + med(c_wh, rounds)) * 1e3);

  if (prototypes) {
    report("ckpt_parts", "proto_xxh3_64_once", c_xxh3, "memcpy_prefaulted", c_mem, rounds,
           ",\"prototype\":true");
    report("ckpt_parts", "proto_snapshot_mmap_hugepage", c_huge, "memcpy_prefaulted", c_mem, rounds,
           ",\"prototype\":true");
    snprintf(extra, sizeof extra, ",\"prototype\":true,\"fs\":\"%s\"", fs);
    report("ckpt_save_write", "proto_hash_then_pwrite", w_model, "raw_pwrite_8m_fsync", w_raw,
           rounds, extra);
    report("ckpt_save_write", "proto_hash_then_pwrite_sync_file_range", w_srf,
           "raw_pwrite_8m_fsync", w_raw, rounds, extra);
    report("ckpt_save_write", "proto_hash_on_second_thread", w_thr, "raw_pwrite_8m_fsync", w_raw,
           rounds, extra);
    report("ckpt_save_write", "raw_pwrite_8m_sync_file_range", w_raw_srf, "raw_pwrite_8m_fsync",
           w_raw, rounds, extra);
    snprintf(extra, sizeof extra, ",\"prototype\":true,\"cache\":\"cold\",\"fs\":\"%s\"", fs);
    report("ckpt_restore_read", "proto_pread_8m_check_blocks", rp_8m, "raw_pread_8m", rc_raw,
           rounds, extra);
    report("ckpt_restore_read", "proto_pread_8m_check_on_second_thread", rp_thr, "raw_pread_8m",
           rc_raw, rounds, extra);
    report("ckpt_restore_read", "proto_ckpt_source_into_mmap_hugepage", rp_huge, "raw_pread_8m",
           rc_raw, rounds, extra);
  }

  if (!keep) {
    unlink(raw_path);
    unlink(shard_path);
    char manifest_path[PATH_MAX + 64 + 40];
    snprintf(manifest_path, sizeof manifest_path, "%s/%s", ckpt_dir, CKPT_MANIFEST_NAME);
    unlink(manifest_path);
    rmdir(ckpt_dir);
    rmdir(work_dir);
  } else {
    fprintf(stderr, "bench_ckpt: kept %s\n", work_dir);
  }
  close(work_fd);
  free(block_table);
  free(src);
  free(dst);
  return 0;
}
