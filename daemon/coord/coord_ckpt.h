/* coord_ckpt: the internals of the coordinator's Checkpoints service,
 * shared by its files (docs/architecture.md, daemon/coord):
 *
 *   ckpt_fs.c       file helpers (paths, mkdir -p, fsync, recursive removal)
 *   ckpt_pool.c     the thread pool, and removals on it
 *
 * and coord_ckpt.c, the service's hooks (coord_impl.h). Only those files
 * include this header; the rest of the coordinator reaches the service
 * through coord_impl.h's coord__ckpt_* hooks. */
#ifndef ZEROD_COORD_CKPT_H
#define ZEROD_COORD_CKPT_H

#include <dirent.h>
#include <stddef.h>

#include "coord_impl.h"

#define CKPT_DEFAULT_TIMEOUT_MS (600 * 1000)
#define CKPT_AUTO_RETRY_MS      (30 * 1000) /* after a failed periodic checkpoint */
#define CKPT_MAX_LISTED         65536       /* checkpoints in one List reply */
#define CKPT_MAX_TREE_DEPTH     16          /* directories inside a removed one */
#define CKPT_MESSAGE_BYTES      1536

/* ------------------------------------------------------------------------ */
/* ckpt_fs.c: file helpers (any thread)                                     */
/* ------------------------------------------------------------------------ */

/* What a job done on the threadpool tells the loop: 0, or a gRPC status
 * and why. Returns status, so that a check can end with it. */
typedef struct work_result {
  int status;
  char message[CKPT_MESSAGE_BYTES];
} work_result;

/* Sets r to status and the printf message; returns status. */
int coord__ckpt_work_fail(work_result *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Status for a failed file operation of the coordinator's own: a full disk
 * is RESOURCE_EXHAUSTED, the rest UNAVAILABLE (an operator fixes the
 * filesystem and retries). */
int coord__ckpt_io_status(int errnum);

/* Formats a path. coord__ckpt_init makes sure that the checkpoint
 * directory leaves 512 bytes of PATH_MAX, more than anything appended
 * needs (a job and a checkpoint name of at most 64 bytes each, a mark with
 * an id, a shard file's name), so nothing is cut off. */
void coord__ckpt_path_format(char *out, size_t out_bytes, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Copies a name that has been checked to fit (a valid name: 64 bytes). */
void coord__ckpt_copy_name(char *out, size_t out_bytes, const char *name);

/* fsync of the directory path. Returns 0 or a negative errno. */
int coord__ckpt_fsync_dir(const char *path);

/* mkdir -p with the directory mode (filemode.h). Returns 0 or a negative
 * errno. */
int coord__ckpt_make_dirs(const char *path);

/* Whether the entry e of the directory dir_fd is a directory (not
 * following a symbolic link). */
int coord__ckpt_is_dir_at(int dir_fd, const struct dirent *e);

/* Removes name (in the directory parent_fd; depth: how far below the first
 * call) and everything under it, never following symbolic links. Returns 0
 * or a negative errno. */
int coord__ckpt_remove_at(int parent_fd, const char *name, int depth);
/* Removes path and everything under it, in line. */
int coord__ckpt_rmtree(const char *path);

/* Whether path is dir or below it. */
int coord__ckpt_path_below(const char *path, const char *dir);

/* Whether s ends with suffix. */
int coord__ckpt_ends_with(const char *s, const char *suffix);

/* ------------------------------------------------------------------------ */
/* ckpt_pool.c: the thread pool                                             */
/* ------------------------------------------------------------------------ */

/* One piece of work: run() on a thread-pool thread, then done() on the
 * loop. Each kind embeds this first. */
typedef struct ckpt_work {
  uv_work_t req;
  coord *c;
  void (*run)(struct ckpt_work *w);
  void (*done)(struct ckpt_work *w);
} ckpt_work;

/* Runs w on the thread pool (counted in c->ckpt.work until done). */
void coord__ckpt_queue_work(coord *c, ckpt_work *w);

#endif /* ZEROD_COORD_CKPT_H */
