/* bench_ckpt.h: what bench_ckpt.c (the benchmark) and bench_ckpt_proto.c
 * (its prototypes: the writer's and reader's work rebuilt with other
 * strategies) share: the data, the files, and the I/O and hashing helpers. */
#ifndef ZEROD_BENCH_CKPT_H
#define ZEROD_BENCH_CKPT_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include <xxhash.h>

#define CHUNK (8u << 20) /* node/ckpt_node_impl.h's WRITE_CHUNK, and the raw I/O size */

extern uint8_t *src; /* the S data bytes, as a rank's snapshot would hold them */
extern uint8_t *dst; /* where reads go (pre-faulted) */
extern uint64_t S;   /* data bytes */
extern uint64_t unit_numel;
extern uint64_t *block_table; /* XXH64 of each CKPT_BLOCK_BYTES block of src */
extern uint64_t nblocks;
extern char shard_path[PATH_MAX + 80], proto_path[PATH_MAX + 48];
extern volatile uint64_t sink; /* keeps a hash from being optimised away */

__attribute__((format(printf, 1, 2), noreturn)) void die(const char *fmt, ...);
void pwrite_all(int fd, const uint8_t *p, size_t n, uint64_t off);
void pread_all(int fd, uint8_t *p, size_t n, uint64_t off);
/* Before a timed write: the previous file removed, the filesystem synced. */
void settle(const char *path);
/* Before a cold read: the file's pages dropped from the page cache. */
void drop_cache(const char *path);
/* The writer's two hashes (whole file, per block) over bytes of p. */
void writer_hashes(const uint8_t *p, uint64_t bytes, XXH64_state_t *file, XXH64_state_t *block,
                   uint64_t *block_fill, uint64_t *table, uint64_t *nb);

/* bench_ckpt_fs.c: the name of a statfs f_type, and the device a
 * directory is mounted from (/proc/self/mountinfo), into out. */
const char *fs_name(long type);
void mount_source(const char *dir, char *out, size_t out_bytes);

/* bench_ckpt_proto.c */
double proto_snapshot_hugepage(void);
double proto_write(int mode);
double proto_read(int mode);

#endif /* ZEROD_BENCH_CKPT_H */
