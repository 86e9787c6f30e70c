/* coord_ckpt: the internals of the coordinator's Checkpoints service,
 * shared by its files (docs/architecture.md, daemon/coord), each of which
 * calls only those listed before it:
 *
 *   ckpt_fs.c       file helpers (paths, mkdir -p, fsync, recursive removal)
 *   ckpt_pool.c     the thread pool, and removals on it
 *   ckpt_order.c    the orders: made, failed, freed; what they read
 *   ckpt_paths.c    paths from clients; checks of what is read and written
 *   ckpt_catalog.c  the checkpoints that exist: List, Delete, retention
 *   ckpt_save.c     saves: Save, periodic ones, an Export's
 *   ckpt_restore.c  Restore
 *   ckpt_exports.c  Export
 *   ckpt_base.c     a base's own checkpoint, saved once it is frozen
 *   ckpt_recover.c  a job whose state a node lost, restored from a
 *                   checkpoint
 *
 * and coord_ckpt.c on top of them, the service's hooks (coord_impl.h).
 * Only those files include this header; the rest of the coordinator
 * reaches the service through coord_impl.h's coord__ckpt_* hooks. Their
 * state is coord.ckpt and cjob.ckpt (coord_impl.h). */
#ifndef ZEROD_COORD_CKPT_H
#define ZEROD_COORD_CKPT_H

#include <dirent.h>
#include <stddef.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "coord_impl.h"

#define CKPT_DEFAULT_TIMEOUT_MS (600 * 1000)
#define CKPT_AUTO_RETRY_MS      (30 * 1000) /* after a failed periodic checkpoint */
#define CKPT_MEM_RETRY_MS       1000        /* after a failed restore from memory */
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

/* ------------------------------------------------------------------------ */
/* ckpt_order.c: the orders                                                 */
/* ------------------------------------------------------------------------ */

typedef enum order_kind { ORDER_SAVE, ORDER_RESTORE } order_kind;

typedef enum order_phase {
  PHASE_PREPARING,  /* restore: the source is being checked on the thread pool */
  PHASE_RUNNING,    /* in the nodes' Assignments, collecting their reports */
  PHASE_COMMITTING, /* save: manifest and rename on the thread pool */
} order_phase;

/* The latest report of one rank on the order. */
typedef struct rank_report {
  int done;
  int failed;
  int committed;
  int code;    /* with failed */
  char *error; /* owned; NULL if none (or it could not be copied) */
  uint64_t step, bytes, xxh64;
  int64_t stall_ms;
  char file[CTL_FILE_MAX_BYTES + 1];
} rank_report;

/* Where and how an Export writes its file: path is canonical (an export
 * root, then the rest without "." or ".." or empty components), and its
 * first root_len bytes are the root, which the file is opened from
 * (confine.h). */
typedef struct export_spec {
  char path[PATH_MAX];
  size_t root_len;
  st_dtype dtype;
  int overwrite;
} export_spec;

typedef struct ckpt_order {
  struct ckpt_order *next;
  coord *c;
  order_kind kind;
  order_phase phase;
  uint64_t id;
  char job[CTL_NAME_MAX_BYTES + 1];
  uint64_t job_id;
  char tenant[AUTH_NAME_MAX_BYTES + 1]; /* the job's: the owner of what it saves */
  uint32_t world_size;
  /* The job's order (its cjob.order points here). An order that fails
   * while thread-pool work for it is in flight is detached and answered at
   * once, and freed when the work reports back. */
  int attached;
  int work_in_flight;
  int abandoned;
  rpc_call *call; /* the Save, Restore or Export waiting for it; NULL: periodic, or answered */
  int periodic;
  int for_base; /* the coordinator's save of a base (ckpt_base.c) */
  int recovery; /* the coordinator's restore of a job whose state a node lost (ckpt_recover.c) */
  /* A restore from in-memory copies (ckpt_memory.c): per rank of the
   * world that made them, the replica servers holding its file, and the
   * messages pointing there (all owned). */
  int memory;
  char (*mem_holders)[2][COORD_ADDR_BYTES];
  Zerod__V1__ReplicaHolders *mem_holder_msgs;
  Zerod__V1__ReplicaHolders **mem_holder_ptrs;
  char **mem_addrs;
  /* A save for an Export of the job's state now: the temporary checkpoint
   * is exported to export_path and removed, never renamed into place. */
  int is_export;
  export_spec export;
  uint64_t started_ns;               /* uv_hrtime */
  uint64_t deadline_ms;              /* on the loop's clock */
  int64_t timeout_ms;                /* what the deadline allowed */
  char name[CTL_NAME_MAX_BYTES + 1]; /* save: as asked; "" for step-<step> or auto-<step> */
  char dir[PATH_MAX];                /* save: the temporary directory; restore: the source */
  /* What the Assignments carry; the strings point into the order. */
  Zerod__V1__SaveOrder save_msg;
  Zerod__V1__SaveOrder *save_list[1];
  Zerod__V1__RestoreOrder restore_msg;
  rank_report *ranks; /* [world_size] */
} ckpt_order;

/* An Export of a checkpoint (of the files alone: the job need not exist). */
typedef struct export_work {
  ckpt_work base;
  struct export_work *next; /* in coord.exports */
  rpc_call *call;           /* NULL once the client went away */
  char source[PATH_MAX];
  export_spec export;
  ckpt_access access; /* who may read what (ckpt_owner.c) */
  uint64_t started_ns;
  /* Out */
  work_result result;
  ckpt_export_info info;
  int64_t total_ms;
} export_work;

/* "save", "export", "periodic checkpoint" or "restore", for messages. */
const char *coord__ckpt_order_noun(const ckpt_order *o);
/* A job state as a word ("ready"), for messages. */
/* Milliseconds since since_ns (uv_hrtime). */
int64_t coord__ckpt_elapsed_ms(uint64_t since_ns);

/* The job whose order o is, or NULL once it no longer is. */
cjob *coord__ckpt_order_job(const coord *c, const ckpt_order *o);
/* A new order of j (j's order from now on), or NULL. */
ckpt_order *coord__ckpt_order_new(coord *c, cjob *j, order_kind kind);
/* Makes o no longer its job's order; a running order leaves the
 * Assignments, which the job's nodes hear at once. */
void coord__ckpt_order_detach(coord *c, ckpt_order *o);
/* Detaches and frees o; a call it still has is answered INTERNAL. */
void coord__ckpt_order_free(coord *c, ckpt_order *o);

/* Ends o with an error: answers its call, takes it out of the Assignments
 * (the nodes drop what they did for it), removes a save's temporary
 * directory and, for a periodic save, holds the next attempt back. The
 * checkpoints that exist are never touched. */
void coord__ckpt_order_fail(coord *c, ckpt_order *o, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The lowest rank that reported a failure, or NULL. A report with an
 * error is a failure whether or not it also says done. */
const rank_report *coord__ckpt_first_failure(const ckpt_order *o, uint32_t *rank);
/* Fails o with rank's report. */
void coord__ckpt_fail_with_rank(coord *c, ckpt_order *o, uint32_t rank, const rank_report *rr);
/* "ranks 1, 3" (at most 8, then "and N more") of the ranks still owed. */
void coord__ckpt_format_pending(const ckpt_order *o, char *out, size_t out_bytes);
/* The cancel callback of an order's call (rpc_call_set_cancel; arg: the
 * order). */
void coord__ckpt_on_order_cancelled(rpc_call *call, void *arg);
/* Records a rank's report on the order. */
void coord__ckpt_record_report(rank_report *rr, const Zerod__V1__ShardReport *r);

/* What Save and Restore require of the job: that the coordinator has a
 * checkpoint directory, that the job exists, is ready and has no order in
 * flight. Returns 0 with the job, or a status with the reason in err. */
int coord__ckpt_order_precheck(coord *c, const char *name, cjob **out, char *err, size_t err_bytes);
/* The deadline of an order: the call's, at most --checkpoint-timeout. */
void coord__ckpt_order_set_deadline(const coord *c, ckpt_order *o, rpc_call *call);

/* The restore or the export in flight that reads path, or NULL. */
const ckpt_order *coord__ckpt_restore_reading(const coord *c, const char *path);
const export_work *coord__ckpt_export_reading(const coord *c, const char *path);

/* ------------------------------------------------------------------------ */
/* ckpt_paths.c: paths from clients; checks of what is read and written     */
/* ------------------------------------------------------------------------ */

/* The roots Export may write in: the export roots, or the checkpoint
 * directory if none is configured. Returns how many. */
unsigned coord__ckpt_write_roots(const coord *c, const char **roots);

/* Places a client's path in roots (what names them, "export roots", is
 * for messages): out gets the canonical path (root, then the rest of
 * path, normalized) and *root_len the root's length in it. what ("export
 * path") names the path in messages. Text only: nothing is opened.
 * Returns 0, or a gRPC status with the reason in err. */
int coord__ckpt_place_path(const char *what, const char *path, const char *const *roots,
                           unsigned nroots, const char *roots_name, char *out, size_t out_bytes,
                           size_t *root_len, char *err, size_t err_bytes);

/* Resolves a RestoreRequest.checkpoint (or ExportRequest.checkpoint) of
 * job into the canonical path of the checkpoint (in out). Returns 0 or a
 * status with the reason in err. */
int coord__ckpt_resolve_source(const coord *c, const char *job, const char *ref, char *out,
                               size_t out_bytes, char *err, size_t err_bytes);

/* The source of a Restore or an Export, stat'ed. Returns 0 or the status
 * in result. Thread pool. */
int coord__ckpt_stat_source(const char *source, struct stat *st, work_result *result);

/* A checkpoint directory about to be read (Restore, Export): its manifest
 * decodes, its owner is one access may read, and every shard file has the
 * size the manifest says. Returns 0 with the saved step and world size,
 * or the status in result. Thread pool. */
int coord__ckpt_check_dir(const char *source, const ckpt_access *access, uint64_t *step,
                          uint32_t *world_size, work_result *result);

/* Opens the directory an export writes in and checks the name it will
 * write (export_spec). Returns 0 with *dir_fd (to close) and *name, or the
 * status in result. */
int coord__ckpt_export_target_open(const export_spec *ex, int *dir_fd, const char **name,
                                   work_result *result);

/* Writes the checkpoint in dir to the safetensors file of ex (label: the
 * name its metadata gives, or NULL). Thread pool. Returns 0 or the status
 * in result. */
int coord__ckpt_export_to_file(const char *dir, const export_spec *ex, const char *label,
                               ckpt_export_info *info, work_result *result);

/* ------------------------------------------------------------------------ */
/* ckpt_catalog.c: List, Delete, retention                                  */
/* ------------------------------------------------------------------------ */

/* After a periodic checkpoint of j: deletes its oldest auto-* checkpoints
 * beyond the policy's keep. */
void coord__ckpt_apply_retention(coord *c, cjob *j);

/* Registers ListCheckpoints and DeleteCheckpoint. */
int coord__ckpt_catalog_register(coord *c, rpc_server *server);

/* ------------------------------------------------------------------------ */
/* ckpt_save.c: saves                                                       */
/* ------------------------------------------------------------------------ */

/* Starts a save of j: makes the temporary directory and puts the order in
 * the Assignments of the job's nodes. name: as asked ("" for
 * step-<step>); call: the waiting Save or Export, or NULL for a periodic
 * one; ex: for an Export, where the save goes, else NULL. Returns 0, or a
 * status with the reason in err and nothing started. */
int coord__ckpt_save_start(coord *c, cjob *j, const char *name, rpc_call *call, int periodic,
                           const export_spec *ex, char *err, size_t err_bytes);

/* Answers an Export with what was written (checkpoint: the source, or ""
 * for the job's state). */
void coord__ckpt_export_reply(rpc_call *call, const char *path, const ckpt_export_info *info,
                              int64_t total_ms, const char *checkpoint);

/* A rank reported on save o: fails it, or once every rank is done,
 * commits it. */
void coord__ckpt_save_progress(coord *c, ckpt_order *o);

/* Registers Save. */
int coord__ckpt_save_register(coord *c, rpc_server *server);

/* ------------------------------------------------------------------------ */
/* ckpt_restore.c: Restore                                                  */
/* ------------------------------------------------------------------------ */

/* A rank reported on restore o: fails it, moves it to its commit, or
 * completes it. */
void coord__ckpt_restore_progress(coord *c, ckpt_order *o);

/* Starts a restore of j from source (a path already resolved) with the
 * access rights of who: the source is checked on the thread pool, then
 * the order goes to the job's nodes. call: the waiting Restore, or NULL
 * for the coordinator's own. Returns 0, or a status with the reason in
 * err and nothing started. */
int coord__ckpt_restore_start(coord *c, cjob *j, const char *source, rpc_call *call,
                              const coord_caller *who, char *err, size_t err_bytes);

/* Registers Restore. */
int coord__ckpt_restore_register(coord *c, rpc_server *server);

/* ------------------------------------------------------------------------ */
/* ckpt_exports.c: Export                                                   */
/* ------------------------------------------------------------------------ */

/* Registers Export. */
int coord__ckpt_exports_register(coord *c, rpc_server *server);
int coord__ckpt_scale_register(coord *c, rpc_server *server);

/* ------------------------------------------------------------------------ */
/* ckpt_base.c: a base's own checkpoint                                     */
/* ------------------------------------------------------------------------ */

/* From the periodic tick, for every job: a frozen job with no checkpoint
 * of its own gets one saved, and a completed save is stored in the job. */
void coord__ckpt_base_tick(coord *c, cjob *j, uint64_t now);
/* How many of j's placement nodes report it ready with its state, and
 * (empty) how many report it ready without any unit. */
size_t coord__ckpt_nodes_holding(const coord *c, const cjob *j, size_t *empty);

/* ------------------------------------------------------------------------ */
/* ckpt_recover.c: a job whose state a node lost                            */
/* ------------------------------------------------------------------------ */

/* From the periodic tick, for every job: one that a node reports ready
 * with no units after it lost them is restored from its checkpoint (a
 * base's own, else its newest), or settled as started empty. */
void coord__ckpt_recover_tick(coord *c, cjob *j, uint64_t now);
/* Whether j's loss of state at its epoch is not settled yet (the nodes
 * that rebuilt it admit no worker meanwhile). */
int coord__ckpt_recovery_pending(const cjob *j);

/* ------------------------------------------------------------------------ */
/* ckpt_memory.c: in-memory redundancy                                      */
/* ------------------------------------------------------------------------ */

/* Whether j's policy asks for in-memory redundancy. */
int coord__mem_enabled(const cjob *j);
/* The replica key and buddy address (into buddy, of buddy_bytes) for
 * placement node at's Assignment. */
void coord__mem_assignment(const coord *c, cjob *j, size_t at, Zerod__V1__Assignment *a,
                           char *buddy, size_t buddy_bytes);
/* From the periodic tick: j's newest complete in-memory copy, from its
 * nodes' reports, into j->ckpt.mem.step; a job whose ranks failed on a
 * node (not a node lost) is rebuilt on its nodes and restored from it. */
void coord__mem_tick(coord *c, cjob *j);
/* Starts the recovery of j from the newest in-memory copy the live nodes
 * hold (re-sharded onto its world as it is now). 0, or -1 when there is
 * none (or out of memory). */
int coord__mem_restore_start(coord *c, cjob *j);
/* Stores j placed on nodes (n names, each with the job's ranks per node,
 * in rank order), every one of them marked to build the job afresh (why
 * says why), after which it is recovered from its newest in-memory copy.
 * 0, or an RPC status with err and nothing changed. */
int coord__mem_replace(coord *c, cjob *j, const char *const *nodes, size_t n, const char *why,
                       char *err, size_t err_bytes);
/* Placement node at of j left the cluster (reason): a job with in-memory
 * copies is re-placed, its ranks there on a spare node (a member outside
 * the job with room for its ranks) if there is one, else re-sharded onto
 * the other nodes
 * (stored; every node is to rebuild). 1 if so, 0 if the job waits for the
 * node as before. */
int coord__mem_node_lost(coord *c, cjob *j, size_t at, const char *reason);

#endif /* ZEROD_COORD_CKPT_H */
