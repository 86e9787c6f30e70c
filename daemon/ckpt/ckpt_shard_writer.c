/* ckpt_shard_writer: writing a shard file (ckpt.h, ckpt_writer_*; the
 * layout is in ckpt.h and ckpt_shard.c).
 *
 * Data comes in any chunk sizes; it is hashed twice as it arrives (the
 * current block's XXH64, finished at each block boundary into the table,
 * and the whole file's, which sees the bytes in file order), by pieces
 * small enough to stay in the core's cache between the two hashes, so the
 * bytes come from memory once for both; then copied into a write buffer so
 * that small chunks become large pwrites. A chunk at least as large as the
 * buffer, arriving when the buffer is empty, is written from the caller's
 * memory without the copy. After each pwrite the kernel is asked to start
 * writing the range back (sync_file_range), so that by the fsync at the
 * end most of the file is on its way to the disk instead of all of it
 * (docs/benchmarks.md). */
#include "ckpt.h"
#include "ckpt_impl.h"
#include "ckpt_io.h"
#include "fsutil.h"
#include "filemode.h"
#include "little_endian.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <xxhash.h>

#define WRITE_BUFFER_BYTES (4u << 20)
/* The piece hashed into the block's and the file's XXH64 in turn: within
 * any x86-64 or arm64 server core's L2. */
#define HASH_PIECE_BYTES (128u << 10)
/* Write-back is started for whole pages of this size (any page size up to it). */
#define WRITEBACK_ALIGN (64u << 10)

struct ckpt_writer {
  int fd;
  char *path;       /* for abort's unlink */
  const char *name; /* base name, within path */
  uint64_t data_bytes, data_written;
  uint64_t flushed_bytes;  /* file offset of buf[0] */
  uint64_t writeback_from; /* write-back started below this offset */
  XXH64_state_t *file_hash, *block_hash;
  uint64_t block_fill; /* bytes of the current block hashed so far */
  uint8_t *table;      /* nblocks little-endian XXH64s */
  uint64_t nblocks, blocks_done;
  uint8_t *buf;
  size_t buf_fill;
  int error; /* the first failure's code: every later call repeats it */
};

static void writer_free(ckpt_writer *w) {
  if (w->fd >= 0)
    close(w->fd);
  XXH64_freeState(w->file_hash);
  XXH64_freeState(w->block_hash);
  free(w->table);
  free(w->buf);
  free(w->path);
  free(w);
}

/* Writes bytes at the end of what is flushed, and starts the write-back
 * of the whole pages written so far (a page the next pwrite will write
 * into again is left for later). sync_file_range is only a hint here (the
 * fsync at the end is what makes the file durable): a filesystem that does
 * not support it is no error. */
static int writer_pwrite(ckpt_writer *w, const uint8_t *bytes, size_t len, char *err,
                         size_t err_bytes) {
  int rc = fsutil_pwrite_all(w->fd, bytes, len, w->flushed_bytes);
  if (rc != 0)
    return w->error = ckpt_fail(err, err_bytes, rc, "%s: %s", w->name, strerror(-rc));
  w->flushed_bytes += len;
  uint64_t whole = w->flushed_bytes & ~(uint64_t)(WRITEBACK_ALIGN - 1);
  if (whole > w->writeback_from) {
    (void)sync_file_range(w->fd, (off_t)w->writeback_from, (off_t)(whole - w->writeback_from),
                          SYNC_FILE_RANGE_WRITE);
    w->writeback_from = whole;
  }
  return 0;
}

static int writer_flush(ckpt_writer *w, char *err, size_t err_bytes) {
  int rc = writer_pwrite(w, w->buf, w->buf_fill, err, err_bytes);
  if (rc == 0)
    w->buf_fill = 0;
  return rc;
}

/* Appends bytes to the file (through the buffer); hashes them into the
 * whole file's checksum first unless the caller has. */
static int writer_append(ckpt_writer *w, const uint8_t *bytes, size_t len, int hashed, char *err,
                         size_t err_bytes) {
  if (len > 0 && !hashed)
    XXH64_update(w->file_hash, bytes, len);
  while (len > 0) {
    if (w->buf_fill == 0 && len >= WRITE_BUFFER_BYTES)
      return writer_pwrite(w, bytes, len, err, err_bytes);
    size_t take = WRITE_BUFFER_BYTES - w->buf_fill;
    if (take > len)
      take = len;
    memcpy(w->buf + w->buf_fill, bytes, take);
    w->buf_fill += take;
    bytes += take;
    len -= take;
    if (w->buf_fill == WRITE_BUFFER_BYTES) {
      int rc = writer_flush(w, err, err_bytes);
      if (rc != 0)
        return rc;
    }
  }
  return 0;
}

int ckpt_writer_open(const char *path, const ckpt_shard_header *h, ckpt_writer **out, char *err,
                     size_t err_bytes) {
  *out = NULL;
  const char *name = ckpt_base_name(path);
  uint64_t file_bytes;
  if (h->world_size == 0 || h->world_size > MAX_WORLD_SIZE || h->rank >= h->world_size)
    return ckpt_fail(err, err_bytes, -EINVAL, "%s: rank %" PRIu32 " of world size %" PRIu32, name,
                     h->rank, h->world_size);
  if (ckpt__shard_file_bytes(h->data_bytes, &file_bytes) != 0)
    return ckpt_fail(err, err_bytes, -ERANGE, "%s: %" PRIu64 " data bytes is too large", name,
                     h->data_bytes);
  ckpt_writer *w = calloc(1, sizeof *w);
  if (w == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  w->fd = -1;
  w->data_bytes = h->data_bytes;
  w->nblocks = ckpt__block_count(h->data_bytes);
  w->path = strdup(path);
  w->file_hash = XXH64_createState();
  w->block_hash = XXH64_createState();
  w->buf = malloc(WRITE_BUFFER_BYTES);
  /* The table is nblocks * 8 bytes: 8 bytes per MiB of data. */
  w->table = malloc(w->nblocks > 0 ? w->nblocks * 8 : 1);
  if (w->path == NULL || w->file_hash == NULL || w->block_hash == NULL || w->buf == NULL ||
      w->table == NULL) {
    writer_free(w);
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  }
  w->name = ckpt_base_name(w->path);
  XXH64_reset(w->file_hash, 0);
  XXH64_reset(w->block_hash, 0);
  w->fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, filemode_file());
  if (w->fd < 0) {
    int rc = ckpt_fail(err, err_bytes, -errno, "%s: %s", name, strerror(errno));
    writer_free(w);
    return rc;
  }
  int mode_rc = filemode_fix_file(w->fd);
  if (mode_rc != 0) {
    ckpt_fail(err, err_bytes, mode_rc, "%s: fchmod: %s", name, strerror(-mode_rc));
    ckpt_writer_abort(w);
    return mode_rc;
  }
  /* The header goes out at once, so that a full or read-only filesystem
   * shows up before any data is copied. */
  uint8_t header[CKPT_HEADER_BYTES];
  ckpt__header_encode(h, header);
  int rc = writer_append(w, header, sizeof header, 0, err, err_bytes);
  if (rc == 0)
    rc = writer_flush(w, err, err_bytes);
  if (rc != 0) {
    ckpt_writer_abort(w);
    return rc;
  }
  *out = w;
  return 0;
}

int ckpt_writer_write(ckpt_writer *w, const void *data, size_t bytes, char *err, size_t err_bytes) {
  if (w->error != 0)
    return ckpt_fail(err, err_bytes, w->error, "%s: an earlier write failed", w->name);
  if (bytes > w->data_bytes - w->data_written)
    return ckpt_fail(err, err_bytes, -ERANGE,
                     "%s: %zu more bytes would make %" PRIu64 " with %" PRIu64 " already written, "
                     "more than the header's %" PRIu64 " data bytes",
                     w->name, bytes, w->data_written + bytes, w->data_written, w->data_bytes);
  const uint8_t *at = data;
  size_t left = bytes;
  while (left > 0) {
    uint64_t take = CKPT_BLOCK_BYTES - w->block_fill;
    if (take > left)
      take = left;
    if (take > HASH_PIECE_BYTES)
      take = HASH_PIECE_BYTES;
    XXH64_update(w->block_hash, at, (size_t)take);
    XXH64_update(w->file_hash, at, (size_t)take);
    w->block_fill += take;
    if (w->block_fill == CKPT_BLOCK_BYTES) {
      le_put64(w->table + 8 * w->blocks_done++, XXH64_digest(w->block_hash));
      XXH64_reset(w->block_hash, 0);
      w->block_fill = 0;
    }
    at += take;
    left -= (size_t)take;
  }
  w->data_written += bytes;
  return writer_append(w, data, bytes, 1, err, err_bytes);
}

/* On failure the file is removed as well: it is not a shard file, and its
 * name must be free for a retry (the writer creates with O_EXCL). */
int ckpt_writer_finish(ckpt_writer *w, uint64_t *file_bytes, uint64_t *file_xxh64, char *err,
                       size_t err_bytes) {
  int rc = 0;
  if (w->error != 0) {
    rc = ckpt_fail(err, err_bytes, w->error, "%s: an earlier write failed", w->name);
  } else if (w->data_written != w->data_bytes) {
    rc = ckpt_fail(err, err_bytes, -ERANGE,
                   "%s: finished after %" PRIu64 " of the header's %" PRIu64 " data bytes", w->name,
                   w->data_written, w->data_bytes);
  }
  if (rc == 0 && w->block_fill > 0) {
    le_put64(w->table + 8 * w->blocks_done++, XXH64_digest(w->block_hash));
    w->block_fill = 0;
  }
  if (rc == 0) {
    uint8_t footer[FOOTER_BYTES];
    le_put64(footer, XXH64(w->table, (size_t)(8 * w->nblocks), 0));
    rc = writer_append(w, w->table, (size_t)(8 * w->nblocks), 0, err, err_bytes);
    if (rc == 0)
      rc = writer_append(w, footer, sizeof footer, 0, err, err_bytes);
    if (rc == 0)
      rc = writer_flush(w, err, err_bytes);
  }
  if (rc == 0 && fsync(w->fd) != 0)
    rc = ckpt_fail(err, err_bytes, -errno, "%s: fsync: %s", w->name, strerror(errno));
  if (rc == 0) {
    int fd = w->fd;
    w->fd = -1;
    if (close(fd) != 0)
      rc = ckpt_fail(err, err_bytes, -errno, "%s: close: %s", w->name, strerror(errno));
  }
  if (rc != 0) {
    ckpt_writer_abort(w);
    return rc;
  }
  *file_bytes = w->flushed_bytes;
  *file_xxh64 = XXH64_digest(w->file_hash);
  writer_free(w);
  return 0;
}

void ckpt_writer_abort(ckpt_writer *w) {
  if (w == NULL)
    return;
  if (w->fd >= 0) {
    close(w->fd);
    w->fd = -1;
  }
  unlink(w->path);
  writer_free(w);
}
