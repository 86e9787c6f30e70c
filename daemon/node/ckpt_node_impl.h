/* ckpt_node_impl: what the loop's side of a node's checkpoints
 * (ckpt_node.c) and the side that runs on the ranks' executors and the
 * shard writers (ckpt_writer.c) share: a job's checkpoint state, under its
 * own mutex, and the functions both sides call on it. */
#ifndef ZEROD_CKPT_NODE_IMPL_H
#define ZEROD_CKPT_NODE_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "ckpt_node.h"

/* Data is handed to the shard writer in chunks of this size, and a save
 * withdrawn by the coordinator is noticed between two of them. */
#define WRITE_CHUNK (8u << 20)
/* A rank that learnt of a save from its peers (the step's all-reduce)
 * waits this long for the order itself to reach its node. */
#define ORDER_WAIT_S 120
/* Saves that ended here, remembered so that a copy taken after its order
 * left (ranks agreed on the save in a step that was running when it was
 * withdrawn) is dropped. One order per job at a time: a few are plenty. */
#define ENDED_KEPT 8

enum { SAVE_COPYING = 0, SAVE_WRITING = 1, SAVE_DONE = 2, SAVE_FAILED = 3 };
/* The memory a rank's copy goes into, when its writer faults it in ahead
 * of the copy (ckpt_node_stage). The rank may take it before the writer
 * is done, without waiting: the writer goes on faulting pages in beside
 * the copy (MADV_POPULATE_WRITE leaves written pages alone) until the copy
 * is over, and holds a reference of its own meanwhile (hostmem_shared_*). */
enum { STAGE_NONE, STAGE_FAULTING, STAGE_READY, STAGE_TAKEN };
/* The writer faults the memory in by chunks of this size, looking between
 * two at whether the copy is over. */
#define STAGE_CHUNK (4u << 20)

typedef struct rank_save {
  int state;
  uint64_t step;
  int64_t stall_ms;
  char file[64];
  uint64_t bytes, xxh64;
  int code;
  char error[512];
  void *data; /* the copy (hostmem_shared_alloc), until written */
  uint64_t data_bytes;
  ckpt_manifest *layout;              /* rank 0 */
  double layout_ms, data_ms, sync_ms; /* the write's phases, for the log */
  int has_writer;
  int stage;     /* STAGE_* */
  void *staging; /* faulted in for the copy until the rank takes it */
  uint64_t staging_bytes;
} rank_save;

typedef struct save_rec {
  struct save_rec *next;
  uint64_t id;
  /* NULL until the order reaches this node: until then the record only
   * holds copies taken early (ranks told by their peers) and is not
   * reported. */
  char *dir;
  _Atomic int abort;
  int refs;         /* the job's list, and each running writer */
  rank_save *ranks; /* [nranks], by local index */
} save_rec;

typedef struct rank_restore {
  int done, committed, code;
  uint64_t step;
  char error[512];
} rank_restore;

typedef struct job_ckpt {
  pthread_mutex_t mutex;
  /* A save got its directory, a rank's copy or its staged memory came or
   * it failed, or a writer ended. */
  pthread_cond_t cond;
  save_rec *saves;
  uint64_t ended[ENDED_KEPT]; /* ids of saves that left the assignment */
  unsigned ended_next;
  int writers;         /* running */
  uint64_t restore_id; /* 0: none */
  int restore_commit_sent;
  rank_restore *restores; /* [nranks] */
  /* A restore from in-memory copies (RestoreOrder.memory): their step
   * and, per saved rank, where its file is (replica.h), for the ranks'
   * fetch of what this node lacks (once: fetch_mutex, fetched). */
  uint64_t mem_save;
  char ***mem_holders;
  size_t *mem_nholders;
  uint32_t mem_world;
  pthread_mutex_t fetch_mutex;
  uint64_t fetched;
  int fetch_rc;
  char fetch_error[512];
  char buddy[300]; /* Assignment.replica_buddy: where in-memory copies go */
} job_ckpt;

/* Under c->mutex. */
void ckpt_node__save_unref(job *j, save_rec *s);

/* Under c->mutex: the save's record, made if absent (a rank may learn of a
 * save from its peers before its node gets the order). */
save_rec *ckpt_node__save_get(job *j, uint64_t id);

/* ckpt_node_memory.c: a restore from in-memory copies. On the loop: the
 * path of this node's replica directory of the copies' step into source,
 * and the holders kept for the ranks' fetch. 0, or a negative errno with
 * err (the caller reports every local rank's failure). */
int ckpt_node__mem_restore_prepare(job *j, const Zerod__V1__RestoreOrder *o, char *source,
                                   size_t source_bytes, char *err, size_t err_bytes);
void ckpt_node__mem_holders_free(job_ckpt *c);
/* The exec_ckpt_hooks.restore_fetch of the node (a rank's executor). */
int ckpt_node__mem_fetch(job *j, uint64_t id, char *err, size_t err_bytes);
/* The exec_ckpt_hooks.replica_* of the node (rank/replicate.c). */
int ckpt_node__replica_dir(job *j, uint64_t step, char *out, size_t out_bytes, char *err,
                           size_t err_bytes);
int ckpt_node__replica_push(job *j, uint64_t step, const char *dir, const char *name, char *err,
                            size_t err_bytes);
void ckpt_node__replica_done(job *j, int rank, uint64_t step);

/* Under c->mutex: starts rank local's writer for save s. */
void ckpt_node__start_writer(job *j, save_rec *s, int local);

#endif /* ZEROD_CKPT_NODE_IMPL_H */
