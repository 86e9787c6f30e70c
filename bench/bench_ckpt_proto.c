/* bench_ckpt_proto: bench_ckpt's prototypes (its header comment, part 4):
 * the writer's and the reader's work rebuilt here with other strategies
 * (sync_file_range, hashing on a second thread, huge pages), to show where
 * the time goes; they write and read the same bytes but not a valid shard
 * file. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench_ckpt.h"
#include "bench_util.h"
#include "ckpt.h"

/* The snapshot into memory that asks for transparent huge pages (one
 * fault per 2 MiB instead of per 4 KiB). */
double proto_snapshot_hugepage(void) {
  double t0 = bench_now_s();
  uint8_t *p = mmap(NULL, S, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    die("mmap: %s", strerror(errno));
  madvise(p, S, MADV_HUGEPAGE);
  uint64_t state_bytes = unit_numel * 4;
  for (uint64_t at = 0; at < S; at += state_bytes)
    memcpy(p + at, src + at, (size_t)state_bytes);
  double t = bench_now_s() - t0;
  if (p[S - 1] != src[S - 1])
    die("snapshot");
  munmap(p, S);
  return t;
}

/* Hashing on a second thread: the writer's two hashes over all of p (a
 * save's snapshot does not change while it is written), or, for reads
 * (following), only the block hashes of what the reader has made ready,
 * checked against the table. */
typedef struct hash_job {
  const uint8_t *p;
  uint64_t bytes;
  int following;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint64_t ready; /* bytes read so far, under mutex */
} hash_job;

static void hash_ready(hash_job *j, uint64_t ready) {
  pthread_mutex_lock(&j->mutex);
  j->ready = ready;
  pthread_cond_signal(&j->cond);
  pthread_mutex_unlock(&j->mutex);
}

static void *hash_main(void *arg) {
  hash_job *j = arg;
  XXH64_state_t *file = j->following ? NULL : XXH64_createState(), *block = XXH64_createState();
  uint64_t *table = malloc(nblocks * sizeof *table), fill = 0, nb = 0, done = 0;
  if ((file == NULL && !j->following) || block == NULL || table == NULL)
    die("out of memory");
  if (file != NULL)
    XXH64_reset(file, 0);
  XXH64_reset(block, 0);
  while (done < j->bytes) {
    uint64_t upto = j->bytes;
    if (j->following) {
      pthread_mutex_lock(&j->mutex);
      while (j->ready == done)
        pthread_cond_wait(&j->cond, &j->mutex);
      upto = j->ready;
      pthread_mutex_unlock(&j->mutex);
    }
    writer_hashes(j->p + done, upto - done, file, block, &fill, table, &nb);
    done = upto;
  }
  if (fill > 0)
    table[nb++] = XXH64_digest(block);
  if (file != NULL)
    sink = XXH64_digest(file);
  if (j->following && memcmp(table, block_table, nblocks * sizeof *table) != 0)
    die("block check failed");
  free(table);
  XXH64_freeState(file);
  XXH64_freeState(block);
  return NULL;
}

/* The writer's work, rebuilt: the same hashing of each 8 MiB chunk, then
 * its pwrite, and an fsync at the end. mode 0: as ckpt.c; 1: and
 * sync_file_range(WRITE) after each chunk, so that the disk starts on it
 * at once instead of at the fsync; 2: the hashing on a second thread, all
 * of the (immutable) snapshot at once, beside the pwrites. */
double proto_write(int mode) {
  settle(proto_path);
  double t0 = bench_now_s();
  int fd = open(proto_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    die("open %s: %s", proto_path, strerror(errno));
  pthread_t t;
  hash_job hj = {
      .p = src, .bytes = S, .mutex = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};
  if (mode == 2 && pthread_create(&t, NULL, hash_main, &hj) != 0)
    die("pthread_create");
  XXH64_state_t *file = XXH64_createState(), *block = XXH64_createState();
  uint64_t *table = malloc(nblocks * sizeof *table), fill = 0, nb = 0;
  if (file == NULL || block == NULL || table == NULL)
    die("out of memory");
  XXH64_reset(file, 0);
  XXH64_reset(block, 0);
  for (uint64_t at = 0; at < S; at += CHUNK) {
    size_t n = S - at < CHUNK ? (size_t)(S - at) : CHUNK;
    if (mode != 2)
      writer_hashes(src + at, n, file, block, &fill, table, &nb);
    pwrite_all(fd, src + at, n, at);
    if (mode == 1)
      sync_file_range(fd, (off_t)at, (off_t)n, SYNC_FILE_RANGE_WRITE);
  }
  if (fsync(fd) != 0)
    die("fsync: %s", strerror(errno));
  close(fd);
  if (mode == 2)
    pthread_join(t, NULL);
  double t_end = bench_now_s() - t0;
  free(table);
  XXH64_freeState(file);
  XXH64_freeState(block);
  return t_end;
}

/* Reads of the shard's data with the same per-block checks as
 * ckpt_reader_read. mode 0: 8 MiB preads, each followed by its blocks'
 * checks; 1: 8 MiB preads on this thread, the checks on a second one
 * following behind. The table is taken from memory (a reader reads it
 * once at open: 8 bytes per MiB). */
double proto_read(int mode) {
  drop_cache(shard_path);
  double t0 = bench_now_s();
  int fd = open(shard_path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    die("open %s: %s", shard_path, strerror(errno));
  hash_job hj = {.p = dst,
                 .bytes = S,
                 .following = 1,
                 .mutex = PTHREAD_MUTEX_INITIALIZER,
                 .cond = PTHREAD_COND_INITIALIZER};
  pthread_t t;
  if (mode == 1 && pthread_create(&t, NULL, hash_main, &hj) != 0)
    die("pthread_create");
  for (uint64_t at = 0; at < S; at += CHUNK) {
    size_t n = S - at < CHUNK ? (size_t)(S - at) : CHUNK;
    pread_all(fd, dst + at, n, CKPT_HEADER_BYTES + at);
    if (mode == 1) {
      hash_ready(&hj, at + n);
      continue;
    }
    for (uint64_t b = at / CKPT_BLOCK_BYTES; b * CKPT_BLOCK_BYTES < at + n; b++) {
      uint64_t start = b * CKPT_BLOCK_BYTES;
      uint64_t len = S - start < CKPT_BLOCK_BYTES ? S - start : CKPT_BLOCK_BYTES;
      if (XXH64(dst + start, (size_t)len, 0) != block_table[b])
        die("block %" PRIu64 " checksum mismatch", b);
    }
  }
  if (mode == 1)
    pthread_join(t, NULL);
  close(fd);
  return bench_now_s() - t0;
}
