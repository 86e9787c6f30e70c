/* ckpt_node_memory: a node's part of a restore from in-memory copies
 * (ckpt_node_impl.h; docs/redundancy.md).
 *
 * The order carries the save's manifest and, per rank of the world that
 * saved it, the replica servers that hold its file. The loop writes the
 * manifest into this node's replica directory of the save, which becomes
 * the restore's source, and keeps the holders. The first of the job's
 * ranks to read fetches every file the directory lacks (under
 * fetch_mutex; the others wait for it and share its outcome); then each
 * reads what it owns through the ordinary re-sharding reader (ckpt.h,
 * ckpt_source), from memory: no disk is read. */
#include "ckpt_node_impl.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt.h"
#include "daemon.h"
#include "fsutil.h"
#include "log.h"
#include "replica.h"
#include "rpc.h"

void ckpt_node__mem_holders_free(job_ckpt *c) {
  for (uint32_t r = 0; c->mem_holders != NULL && r < c->mem_world; r++) {
    for (size_t k = 0; c->mem_holders[r] != NULL && k < c->mem_nholders[r]; k++)
      free(c->mem_holders[r][k]);
    free(c->mem_holders[r]);
  }
  free(c->mem_holders);
  free(c->mem_nholders);
  c->mem_holders = NULL;
  c->mem_nholders = NULL;
  c->mem_world = 0;
}

/* Copies the order's holders into c. 0 or -ENOMEM. */
static int keep_holders(job_ckpt *c, const Zerod__V1__RestoreOrder *o) {
  ckpt_node__mem_holders_free(c);
  uint32_t n = (uint32_t)o->n_holders;
  c->mem_holders = calloc(n ? n : 1, sizeof *c->mem_holders);
  c->mem_nholders = calloc(n ? n : 1, sizeof *c->mem_nholders);
  if (c->mem_holders == NULL || c->mem_nholders == NULL)
    return -ENOMEM;
  c->mem_world = n;
  for (uint32_t r = 0; r < n; r++) {
    const Zerod__V1__ReplicaHolders *h = o->holders[r];
    size_t count = h != NULL ? h->n_addresses : 0;
    c->mem_holders[r] = calloc(count ? count : 1, sizeof *c->mem_holders[r]);
    if (c->mem_holders[r] == NULL)
      return -ENOMEM;
    for (size_t k = 0; k < count; k++) {
      if ((c->mem_holders[r][k] = strdup(h->addresses[k])) == NULL)
        return -ENOMEM;
      c->mem_nholders[r]++;
    }
  }
  return 0;
}

int ckpt_node__mem_restore_prepare(job *j, const Zerod__V1__RestoreOrder *o, char *source,
                                   size_t source_bytes, char *err, size_t err_bytes) {
  job_ckpt *c = j->ckpt;
  int rc = replica_save_dir(j->owner, j->id, o->memory_step, source, source_bytes, err, err_bytes);
  pthread_mutex_lock(&c->fetch_mutex);
  if (rc == 0 && (rc = keep_holders(c, o)) != 0)
    snprintf(err, err_bytes, "out of memory");
  c->mem_save = o->memory_step;
  c->fetched = 0;
  pthread_mutex_unlock(&c->fetch_mutex);
  return rc;
}

/* The copies' manifest in dir, made from the layout there (fetched from a
 * holder if this node has none): every rank's file, of the size the layout
 * makes it (their XXH64s are not known here; a restore checks the blocks
 * it reads). 0 or a negative errno with err. */
static int make_manifest(job *j, job_ckpt *c, const char *dir, char *err, size_t err_bytes) {
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/%s", dir, CKPT_LAYOUT_NAME);
  int rc = 0;
  if (access(path, R_OK) != 0) {
    rc = -ENOENT;
    snprintf(err, err_bytes, "no node holds the job's layout");
    for (uint32_t r = 0; r < c->mem_world && rc != 0; r++)
      for (size_t k = 0; k < c->mem_nholders[r] && rc != 0; k++)
        rc = replica_fetch_file(j->owner, j->id, c->mem_save, dir, CKPT_LAYOUT_NAME,
                                c->mem_holders[r][k], err, err_bytes);
    if (rc != 0)
      return rc;
  }
  ckpt_manifest m;
  rc = ckpt_manifest_load(dir, CKPT_LAYOUT_NAME, CKPT_DECODE_NO_FILES, &m, err, err_bytes);
  if (rc != 0)
    return rc;
  ckpt_file_entry *files = calloc(m.world_size ? m.world_size : 1, sizeof *files);
  char(*names)[64] = calloc(m.world_size ? m.world_size : 1, sizeof *names);
  if (files == NULL || names == NULL || m.world_size != c->mem_world || m.step != c->mem_save) {
    rc = files == NULL || names == NULL ? -ENOMEM : -EPROTO;
    snprintf(err, err_bytes, "%s",
             rc == -ENOMEM ? "out of memory" : "the layout is not of the copies ordered");
  } else {
    uint64_t bytes = ckpt_shard_file_bytes(&m);
    for (uint32_t r = 0; r < m.world_size; r++) {
      ckpt_shard_name(r, m.world_size, names[r], sizeof names[r]);
      files[r] = (ckpt_file_entry){.name = names[r], .bytes = bytes};
    }
    ckpt_file_entry *none = m.files;
    m.files = files;
    rc = ckpt_manifest_store(dir, CKPT_MANIFEST_NAME, &m, err, err_bytes);
    m.files = none;
  }
  free(files);
  free(names);
  ckpt_manifest_free(&m);
  return rc;
}

int ckpt_node__mem_fetch(job *j, uint64_t id, char *err, size_t err_bytes) {
  job_ckpt *c = j->ckpt;
  (void)id;
  pthread_mutex_lock(&c->fetch_mutex);
  if (c->mem_holders == NULL) {
    pthread_mutex_unlock(&c->fetch_mutex);
    return 0; /* not from memory */
  }
  if (c->fetched != c->mem_save) {
    char dir[PATH_MAX];
    c->fetch_rc = replica_save_dir(j->owner, j->id, c->mem_save, dir, sizeof dir, c->fetch_error,
                                   sizeof c->fetch_error);
    if (c->fetch_rc == 0)
      c->fetch_rc = make_manifest(j, c, dir, c->fetch_error, sizeof c->fetch_error);
    if (c->fetch_rc == 0)
      c->fetch_rc =
          replica_fetch(j->owner, j->id, c->mem_save, dir, c->mem_holders, c->mem_nholders,
                        c->mem_world, c->fetch_error, sizeof c->fetch_error);
    c->fetched = c->mem_save;
    if (c->fetch_rc == 0)
      LOG_INFOF("in-memory copies fetched", "job=%s step=%llu", j->name,
                (unsigned long long)c->mem_save);
  }
  int rc = c->fetch_rc;
  if (rc != 0)
    snprintf(err, err_bytes, "%s", c->fetch_error);
  pthread_mutex_unlock(&c->fetch_mutex);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* In-memory copies (rank/replicate.c, on the ranks' executors)             */
/* ------------------------------------------------------------------------ */

void ckpt_node_set_buddy(job *j, const char *buddy) {
  job_ckpt *c = j->ckpt;
  if (c == NULL)
    return;
  pthread_mutex_lock(&c->mutex);
  snprintf(c->buddy, sizeof c->buddy, "%s", buddy != NULL ? buddy : "");
  pthread_mutex_unlock(&c->mutex);
}

int ckpt_node__replica_dir(job *j, uint64_t step, char *out, size_t out_bytes, char *err,
                           size_t err_bytes) {
  return replica_save_dir(j->owner, j->id, step, out, out_bytes, err, err_bytes);
}

int ckpt_node__replica_push(job *j, uint64_t step, const char *dir, const char *name, char *err,
                            size_t err_bytes) {
  job_ckpt *c = j->ckpt;
  char buddy[sizeof c->buddy];
  pthread_mutex_lock(&c->mutex);
  snprintf(buddy, sizeof buddy, "%s", c->buddy);
  pthread_mutex_unlock(&c->mutex);
  return replica_push(j->owner, j->id, step, dir, name, buddy, err, err_bytes);
}

void ckpt_node__replica_done(job *j, int rank, uint64_t step) {
  /* Once per node: every rank of the job completed the copy of step, so
   * the older ones (this node's and its peer's) are of no more use. */
  if (rank == j->first_rank)
    replica_keep(j->owner, j->id, step);
}
