/* ckpt_shard_reader: reading shard files back (ckpt.h): a reader that
 * checks a file's size, header and block table when it opens and each
 * block it reads, and ckpt_file_verify, which checks a whole file against
 * its manifest entry. The layout is in ckpt.h and ckpt_shard.c. */
#include "ckpt.h"
#include "ckpt_impl.h"
#include "ckpt_io.h"
#include "fsutil.h"
#include "little_endian.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

/* Whole blocks a reader reads with one pread: 8 MiB. */
#define READ_RUN_BLOCKS 8

struct ckpt_reader {
  int fd;
  char *name; /* base name, for messages */
  ckpt_shard_header header;
  uint64_t nblocks;
  uint8_t *table;        /* checked against the footer at open */
  uint8_t *block;        /* CKPT_BLOCK_BYTES, allocated on first use */
  uint64_t cached_block; /* the block in `block`, verified; UINT64_MAX for none */
};

/* Reports a read's outcome: 0, -errno, or 1 (end of file: truncated). */
static int read_failed(int rc, const char *name, const char *what, char *err, size_t err_bytes) {
  if (rc > 0)
    return ckpt_fail(err, err_bytes, -ERANGE, "%s: truncated while reading %s", name, what);
  return ckpt_fail(err, err_bytes, rc, "%s: reading %s: %s", name, what, strerror(-rc));
}

/* Checks a file's size against what the caller expects, before anything
 * is read, so that a short file is reported as truncated, not as a bad
 * checksum. */
static int check_size(uint64_t actual, uint64_t expect, const char *name, char *err,
                      size_t err_bytes) {
  if (actual < expect)
    return ckpt_fail(err, err_bytes, -ERANGE, "%s: truncated: %" PRIu64 " of %" PRIu64 " bytes",
                     name, actual, expect);
  if (actual > expect)
    return ckpt_fail(err, err_bytes, -ERANGE, "%s: too long: %" PRIu64 " bytes, expected %" PRIu64,
                     name, actual, expect);
  return 0;
}

/* Reads and checks the table and footer of a file whose header said
 * data_bytes; *table is malloc'd. */
static int read_table(int fd, const char *name, uint64_t data_bytes, uint8_t **table, char *err,
                      size_t err_bytes) {
  uint64_t nblocks = ckpt__block_count(data_bytes);
  size_t table_bytes = (size_t)(8 * nblocks);
  uint8_t *bytes = malloc(table_bytes + FOOTER_BYTES);
  if (bytes == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory for the block table", name);
  int rc = fsutil_pread_all(fd, bytes, table_bytes + FOOTER_BYTES, CKPT_HEADER_BYTES + data_bytes);
  if (rc != 0) {
    free(bytes);
    return read_failed(rc, name, "the block table", err, err_bytes);
  }
  uint64_t stored = le_get64(bytes + table_bytes), actual = XXH64(bytes, table_bytes, 0);
  if (stored != actual) {
    free(bytes);
    return ckpt_fail(err, err_bytes, -EBADMSG,
                     "%s: block table checksum mismatch (footer %016" PRIx64
                     ", computed %016" PRIx64 ")",
                     name, stored, actual);
  }
  *table = bytes;
  return 0;
}

static int check_block(const uint8_t *table, uint64_t block, const uint8_t *bytes, size_t len,
                       const char *name, char *err, size_t err_bytes) {
  if (XXH64(bytes, len, 0) == le_get64(table + 8 * block))
    return 0;
  uint64_t start = block * CKPT_BLOCK_BYTES;
  return ckpt_fail(err, err_bytes, -EBADMSG,
                   "%s: block %" PRIu64 " (bytes %" PRIu64 "..%" PRIu64 ") checksum mismatch", name,
                   block, start, start + len);
}

/* Opens and checks everything but the data blocks: size, header, table. */
static int reader_check(ckpt_reader *r, const char *path, uint64_t expect_bytes,
                        const ckpt_shard_header *expect, char *err, size_t err_bytes) {
  const char *name = r->name;
  r->fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (r->fd < 0 || fstat(r->fd, &st) != 0)
    return ckpt_fail(err, err_bytes, -errno, "%s: %s", name, strerror(errno));
  if (!S_ISREG(st.st_mode))
    return ckpt_fail(err, err_bytes, -EINVAL, "%s: not a regular file", name);
  int rc = check_size((uint64_t)st.st_size, expect_bytes, name, err, err_bytes);
  if (rc != 0)
    return rc;
  if (expect_bytes < CKPT_HEADER_BYTES)
    return ckpt_fail(err, err_bytes, -ERANGE, "%s: %" PRIu64 " bytes cannot hold a shard header",
                     name, expect_bytes);
  uint8_t header[CKPT_HEADER_BYTES];
  uint64_t file_bytes;
  if ((rc = fsutil_pread_all(r->fd, header, sizeof header, 0)) != 0)
    return read_failed(rc, name, "the header", err, err_bytes);
  if ((rc = ckpt__header_decode(header, name, &r->header, &file_bytes, err, err_bytes)) != 0)
    return rc;
  if (r->header.rank != expect->rank || r->header.world_size != expect->world_size ||
      r->header.data_bytes != expect->data_bytes)
    return ckpt_fail(err, err_bytes, -EBADMSG,
                     "%s: header says rank %" PRIu32 " of %" PRIu32 " with %" PRIu64
                     " data bytes, expected rank %" PRIu32 " of %" PRIu32 " with %" PRIu64,
                     name, r->header.rank, r->header.world_size, r->header.data_bytes, expect->rank,
                     expect->world_size, expect->data_bytes);
  if (file_bytes != expect_bytes)
    return ckpt_fail(err, err_bytes, -ERANGE,
                     "%s: %" PRIu64 " data bytes make a file of %" PRIu64 " bytes, not %" PRIu64,
                     name, r->header.data_bytes, file_bytes, expect_bytes);
  r->nblocks = ckpt__block_count(r->header.data_bytes);
  return read_table(r->fd, name, r->header.data_bytes, &r->table, err, err_bytes);
}

int ckpt_reader_open(const char *path, uint64_t expect_bytes, const ckpt_shard_header *expect,
                     ckpt_reader **out, char *err, size_t err_bytes) {
  *out = NULL;
  ckpt_reader *r = calloc(1, sizeof *r);
  if (r == NULL || (r->name = strdup(ckpt_base_name(path))) == NULL) {
    free(r);
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", ckpt_base_name(path));
  }
  r->cached_block = UINT64_MAX;
  int rc = reader_check(r, path, expect_bytes, expect, err, err_bytes);
  if (rc != 0) {
    ckpt_reader_close(r);
    return rc;
  }
  *out = r;
  return 0;
}

int ckpt_reader_read(ckpt_reader *r, uint64_t offset, void *dst, size_t bytes, char *err,
                     size_t err_bytes) {
  const uint64_t data_bytes = r->header.data_bytes;
  if (offset > data_bytes || bytes > data_bytes - offset)
    return ckpt_fail(err, err_bytes, -ERANGE,
                     "%s: bytes %" PRIu64 "..%" PRIu64 " are past the end of the data (%" PRIu64
                     ")",
                     r->name, offset, offset + (uint64_t)bytes, data_bytes);
  uint8_t *out = dst;
  while (bytes > 0) {
    uint64_t block = offset / CKPT_BLOCK_BYTES, start = block * CKPT_BLOCK_BYTES;
    size_t block_len =
        (size_t)(data_bytes - start < CKPT_BLOCK_BYTES ? data_bytes - start : CKPT_BLOCK_BYTES);
    size_t in_block = (size_t)(offset - start);
    size_t take = block_len - in_block < bytes ? block_len - in_block : bytes;
    int rc;
    if (in_block == 0 && take == block_len && block != r->cached_block) {
      /* Whole blocks the caller wants: read (up to READ_RUN_BLOCKS in one
       * pread) and check them in place. A run of more than one is of full
       * blocks (data follows each of them). */
      uint64_t run = 1;
      while (run < READ_RUN_BLOCKS && (run + 1) * CKPT_BLOCK_BYTES <= bytes)
        run++;
      size_t run_len = (size_t)((run - 1) * CKPT_BLOCK_BYTES) + block_len;
      if ((rc = fsutil_pread_all(r->fd, out, run_len, CKPT_HEADER_BYTES + start)) != 0)
        return read_failed(rc, r->name, "data", err, err_bytes);
      for (uint64_t k = 0; k < run; k++)
        if ((rc = check_block(r->table, block + k, out + k * CKPT_BLOCK_BYTES, block_len, r->name,
                              err, err_bytes)) != 0)
          return rc;
      take = run_len;
    } else {
      if (block != r->cached_block) {
        if (r->block == NULL && (r->block = malloc(CKPT_BLOCK_BYTES)) == NULL)
          return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", r->name);
        r->cached_block = UINT64_MAX;
        if ((rc = fsutil_pread_all(r->fd, r->block, block_len, CKPT_HEADER_BYTES + start)) != 0)
          return read_failed(rc, r->name, "data", err, err_bytes);
        if ((rc = check_block(r->table, block, r->block, block_len, r->name, err, err_bytes)) != 0)
          return rc;
        r->cached_block = block;
      }
      memcpy(out, r->block + in_block, take);
    }
    out += take;
    offset += take;
    bytes -= take;
  }
  return 0;
}

const ckpt_shard_header *ckpt_reader_header(const ckpt_reader *r) {
  return &r->header;
}

void ckpt_reader_close(ckpt_reader *r) {
  if (r == NULL)
    return;
  if (r->fd >= 0)
    close(r->fd);
  free(r->name);
  free(r->table);
  free(r->block);
  free(r);
}

/* ------------------------------------------------------------------------
 * Whole-file verification
 * ------------------------------------------------------------------------ */

/* Everything ckpt_file_verify checks before the data: size, header (and
 * that it belongs to the file's name), table. */
static int verify_structure(int fd, const ckpt_file_entry *entry, const char *name,
                            uint8_t *header_bytes, ckpt_shard_header *header, uint8_t **table,
                            char *err, size_t err_bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0)
    return ckpt_fail(err, err_bytes, -errno, "%s: %s", name, strerror(errno));
  if (!S_ISREG(st.st_mode))
    return ckpt_fail(err, err_bytes, -EINVAL, "%s: not a regular file", name);
  int rc = check_size((uint64_t)st.st_size, entry->bytes, name, err, err_bytes);
  if (rc != 0)
    return rc;
  if (entry->bytes < CKPT_HEADER_BYTES)
    return ckpt_fail(err, err_bytes, -ERANGE, "%s: %" PRIu64 " bytes cannot hold a shard header",
                     name, entry->bytes);
  uint64_t file_bytes;
  if ((rc = fsutil_pread_all(fd, header_bytes, CKPT_HEADER_BYTES, 0)) != 0)
    return read_failed(rc, name, "the header", err, err_bytes);
  if ((rc = ckpt__header_decode(header_bytes, name, header, &file_bytes, err, err_bytes)) != 0)
    return rc;
  char expect_name[40];
  ckpt_shard_name(header->rank, header->world_size, expect_name, sizeof expect_name);
  if (strcmp(expect_name, entry->name) != 0)
    return ckpt_fail(err, err_bytes, -EBADMSG, "%s: header says rank %" PRIu32 " of %" PRIu32, name,
                     header->rank, header->world_size);
  if (file_bytes != entry->bytes)
    return ckpt_fail(err, err_bytes, -ERANGE,
                     "%s: %" PRIu64 " data bytes make a file of %" PRIu64 " bytes, not %" PRIu64,
                     name, header->data_bytes, file_bytes, entry->bytes);
  return read_table(fd, name, header->data_bytes, table, err, err_bytes);
}

int ckpt_file_verify(const char *dir, const ckpt_file_entry *entry, char *err, size_t err_bytes) {
  const char *name = ckpt_base_name(entry->name);
  char *path = ckpt_join_path(dir, entry->name);
  if (path == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  free(path);
  if (fd < 0)
    return ckpt_fail(err, err_bytes, -errno, "%s: %s", name, strerror(errno));
  /* One pass from start to end: let the kernel read ahead. */
  posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  uint8_t header_bytes[CKPT_HEADER_BYTES];
  ckpt_shard_header header;
  uint8_t *table = NULL, *block = malloc(CKPT_BLOCK_BYTES);
  XXH64_state_t *file_hash = XXH64_createState();
  int rc = 0;
  if (file_hash == NULL || block == NULL)
    rc = ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  else
    rc = verify_structure(fd, entry, name, header_bytes, &header, &table, err, err_bytes);
  if (rc == 0) {
    /* The whole file's hash sees the bytes in file order: header, every
     * block as it is checked, then the table and footer. */
    XXH64_reset(file_hash, 0);
    XXH64_update(file_hash, header_bytes, sizeof header_bytes);
    uint64_t nblocks = ckpt__block_count(header.data_bytes);
    for (uint64_t b = 0; rc == 0 && b < nblocks; b++) {
      uint64_t start = b * CKPT_BLOCK_BYTES;
      size_t len = (size_t)(header.data_bytes - start < CKPT_BLOCK_BYTES ? header.data_bytes - start
                                                                         : CKPT_BLOCK_BYTES);
      if ((rc = fsutil_pread_all(fd, block, len, CKPT_HEADER_BYTES + start)) != 0)
        rc = read_failed(rc, name, "data", err, err_bytes);
      else
        rc = check_block(table, b, block, len, name, err, err_bytes);
      if (rc == 0)
        XXH64_update(file_hash, block, len);
    }
    if (rc == 0) {
      XXH64_update(file_hash, table, (size_t)(8 * nblocks + FOOTER_BYTES));
      uint64_t actual = XXH64_digest(file_hash);
      if (actual != entry->xxh64)
        rc = ckpt_fail(err, err_bytes, -EBADMSG,
                       "%s: file checksum %016" PRIx64 ", but the manifest says %016" PRIx64, name,
                       actual, entry->xxh64);
    }
  }
  close(fd);
  XXH64_freeState(file_hash);
  free(table);
  free(block);
  return rc;
}
