/* replica: a node's in-memory copies of its jobs' state (replica.h). */
#include "replica.h"

#include "follow.h"

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "daemon.h"
#include "fsutil.h"
#include "log.h"

typedef struct job_key {
  uint64_t job_id;
  uint8_t key[REPLICA_KEY_BYTES];
} job_key;

struct replica_node {
  char root[PATH_MAX];
  replica_server *server;
  pthread_mutex_t mutex; /* keys */
  job_key *keys;
  size_t nkeys, cap;
};

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  remove(path);
  return 0;
}

/* Removes path and everything below it, as far as it can. */
static void remove_tree(const char *path) {
  nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* The server's question: job_id's key, if this node has it. */
static int key_of(void *ctx, uint64_t job_id, uint8_t key[REPLICA_KEY_BYTES]) {
  struct replica_node *r = ctx;
  int rc = -ENOENT;
  pthread_mutex_lock(&r->mutex);
  for (size_t i = 0; i < r->nkeys; i++) {
    if (r->keys[i].job_id == job_id) {
      memcpy(key, r->keys[i].key, REPLICA_KEY_BYTES);
      rc = 0;
      break;
    }
  }
  pthread_mutex_unlock(&r->mutex);
  return rc;
}

int replica_start(zdaemon *d, const char *root, const char *host, char *err, size_t err_bytes) {
  struct replica_node *r = calloc(1, sizeof *r);
  if (r == NULL) {
    snprintf(err, err_bytes, "out of memory");
    return -ENOMEM;
  }
  pthread_mutex_init(&r->mutex, NULL);
  snprintf(r->root, sizeof r->root, "%s", root);
  /* What a daemon before this one kept died with it: its saves are stale,
   * and the coordinator hands out new keys. */
  remove_tree(root);
  int rc = fsutil_mkdir_p(root);
  if (rc != 0) {
    snprintf(err, err_bytes, "cannot create the replica directory %s: %s", root, strerror(-rc));
  } else {
    rc = replica_server_start(host, 0, root, key_of, r, &r->server, err, err_bytes);
    if (rc == 0)
      replica_server_set_follow(r->server, follow_relay, d);
  }
  if (rc != 0) {
    pthread_mutex_destroy(&r->mutex);
    free(r);
    return rc;
  }
  d->replicas = r;
  LOG_INFOF("replica server listening", "address=%s port=%d dir=%s", host,
            replica_server_port(r->server), root);
  return 0;
}

int replica_port(const zdaemon *d) {
  return d->replicas != NULL ? replica_server_port(d->replicas->server) : 0;
}

void replica_stop(zdaemon *d) {
  struct replica_node *r = d->replicas;
  if (r == NULL)
    return;
  replica_server_stop(r->server);
  remove_tree(r->root); /* in memory: nobody will read it again */
  pthread_mutex_destroy(&r->mutex);
  free(r->keys);
  free(r);
  d->replicas = NULL;
}

void replica_set_key(zdaemon *d, uint64_t job_id, const uint8_t *key, size_t key_len) {
  struct replica_node *r = d->replicas;
  if (r == NULL || key_len != REPLICA_KEY_BYTES)
    return;
  pthread_mutex_lock(&r->mutex);
  size_t i = 0;
  while (i < r->nkeys && r->keys[i].job_id != job_id)
    i++;
  if (i == r->nkeys && r->nkeys == r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 8;
    job_key *grown = realloc(r->keys, cap * sizeof *grown);
    if (grown != NULL) {
      r->keys = grown;
      r->cap = cap;
    }
  }
  if (i < r->cap) {
    r->keys[i].job_id = job_id;
    memcpy(r->keys[i].key, key, REPLICA_KEY_BYTES);
    if (i == r->nkeys)
      r->nkeys++;
  }
  pthread_mutex_unlock(&r->mutex);
}

void replica_keep(zdaemon *d, uint64_t job_id, uint64_t keep) {
  struct replica_node *r = d->replicas;
  char dir[PATH_MAX];
  if (r == NULL || keep == 0 ||
      snprintf(dir, sizeof dir, "%s/%" PRIu64, r->root, job_id) >= (int)sizeof dir - 32)
    return;
  DIR *dp = opendir(dir);
  if (dp == NULL)
    return;
  struct dirent *e;
  while ((e = readdir(dp)) != NULL) {
    char *end;
    errno = 0;
    unsigned long long id = strtoull(e->d_name, &end, 10);
    if (e->d_name[0] == '.' || *end != '\0' || errno != 0 || id >= keep)
      continue;
    char path[PATH_MAX + 300];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    remove_tree(path);
  }
  closedir(dp);
}

void replica_forget(zdaemon *d, uint64_t job_id) {
  struct replica_node *r = d->replicas;
  if (r == NULL)
    return;
  pthread_mutex_lock(&r->mutex);
  for (size_t i = 0; i < r->nkeys; i++) {
    if (r->keys[i].job_id == job_id) {
      r->keys[i] = r->keys[--r->nkeys];
      break;
    }
  }
  pthread_mutex_unlock(&r->mutex);
  char dir[PATH_MAX];
  if (snprintf(dir, sizeof dir, "%s/%" PRIu64, r->root, job_id) < (int)sizeof dir)
    remove_tree(dir);
}

int replica_save_dir(zdaemon *d, uint64_t job_id, uint64_t save_id, char *out, size_t out_bytes,
                     char *err, size_t err_bytes) {
  struct replica_node *r = d->replicas;
  if (r == NULL) {
    snprintf(err, err_bytes, "this node keeps no in-memory copies (no replica server)");
    return -ENOTSUP;
  }
  if (snprintf(out, out_bytes, "%s/%" PRIu64 "/%" PRIu64, r->root, job_id, save_id) >=
      (int)out_bytes) {
    snprintf(err, err_bytes, "%s: path too long", r->root);
    return -ENAMETOOLONG;
  }
  int rc = fsutil_mkdir_p(out);
  if (rc != 0)
    snprintf(err, err_bytes, "cannot create %s: %s", out, strerror(-rc));
  return rc;
}

static int job_key_copy(zdaemon *d, uint64_t job_id, uint8_t key[REPLICA_KEY_BYTES], char *err,
                        size_t err_bytes) {
  if (d->replicas == NULL || key_of(d->replicas, job_id, key) != 0) {
    snprintf(err, err_bytes, "no replica key for the job (id %" PRIu64 ")", job_id);
    return -ENOKEY;
  }
  return 0;
}

int replica_push(zdaemon *d, uint64_t job_id, uint64_t save_id, const char *dir, const char *name,
                 const char *buddy, char *err, size_t err_bytes) {
  uint8_t key[REPLICA_KEY_BYTES];
  int rc = job_key_copy(d, job_id, key, err, err_bytes);
  if (rc != 0)
    return rc;
  if (buddy == NULL || buddy[0] == '\0') {
    snprintf(err, err_bytes, "no other node of the job serves copies");
    return -EHOSTUNREACH;
  }
  char path[PATH_MAX + 80];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  char why[400] = "";
  rc = replica_put(buddy, key, job_id, save_id, name, path, REPLICA_TIMEOUT_MS, why, sizeof why);
  if (rc != 0)
    snprintf(err, err_bytes, "copy of %s to %s: %s", name, buddy, why);
  return rc;
}

/* Fetches one file of the save from the first holder that has it. */
static int fetch_one(const uint8_t key[REPLICA_KEY_BYTES], uint64_t job_id, uint64_t save_id,
                     const char *dir, const char *name, char **holders, size_t nholders, char *err,
                     size_t err_bytes) {
  char path[PATH_MAX + 80];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  int rc = -ENOENT;
  snprintf(err, err_bytes, "%s: no node that held it is left", name);
  for (size_t k = 0; k < nholders && rc != 0; k++) {
    char why[400] = "";
    rc = replica_get(holders[k], key, job_id, save_id, name, path, REPLICA_TIMEOUT_MS, why,
                     sizeof why);
    if (rc != 0) {
      LOG_WARNF("in-memory copy not fetched from a holder", "file=%s holder=%s err=\"%s\"", name,
                holders[k], why);
      snprintf(err, err_bytes, "%s from %s: %s", name, holders[k], why);
    }
  }
  return rc;
}

int replica_fetch_file(zdaemon *d, uint64_t job_id, uint64_t save_id, const char *dir,
                       const char *name, const char *holder, char *err, size_t err_bytes) {
  uint8_t key[REPLICA_KEY_BYTES];
  int rc = job_key_copy(d, job_id, key, err, err_bytes);
  char *holders[1] = {(char *)holder};
  if (rc == 0)
    rc = fetch_one(key, job_id, save_id, dir, name, holders, 1, err, err_bytes);
  return rc;
}

int replica_fetch(zdaemon *d, uint64_t job_id, uint64_t save_id, const char *dir, char ***holders,
                  const size_t *nholders, uint32_t world_size, char *err, size_t err_bytes) {
  uint8_t key[REPLICA_KEY_BYTES];
  int rc = job_key_copy(d, job_id, key, err, err_bytes);
  if (rc != 0)
    return rc;
  ckpt_manifest m;
  rc = ckpt_manifest_load(dir, CKPT_MANIFEST_NAME, 0, &m, err, err_bytes);
  if (rc != 0)
    return rc;
  if (m.world_size != world_size) {
    snprintf(err, err_bytes, "the manifest has %u ranks, the order %u holders", m.world_size,
             world_size);
    ckpt_manifest_free(&m);
    return -EPROTO;
  }
  for (uint32_t k = 0; k < m.world_size && rc == 0; k++) {
    char path[PATH_MAX + 80];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, m.files[k].name);
    if (stat(path, &st) == 0 && (uint64_t)st.st_size == m.files[k].bytes)
      continue; /* this node's own, or its buddy's copy */
    rc = fetch_one(key, job_id, save_id, dir, m.files[k].name, holders[k], nholders[k], err,
                   err_bytes);
  }
  ckpt_manifest_free(&m);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* What this node holds, for its heartbeat                                  */
/* ------------------------------------------------------------------------ */

typedef struct report_blob {
  Zerod__V1__ReplicaSet *sets;
  Zerod__V1__ReplicaSet **ptrs;
  uint32_t *ranks; /* every set's, one after the other */
} report_blob;

/* Whether name is a whole shard file: its rank and world into *rank,
 * *world. */
static int shard_file(const char *name, uint32_t *rank, uint32_t *world) {
  unsigned r, w;
  int end = 0;
  if (sscanf(name, "rank-%5u-of-%5u.zdshard%n", &r, &w, &end) != 2 || name[end] != '\0' || r >= w)
    return 0;
  char expect[64];
  ckpt_shard_name(r, w, expect, sizeof expect);
  if (strcmp(expect, name) != 0)
    return 0;
  *rank = r;
  *world = w;
  return 1;
}

/* Fills set from the directory of one step: its shard files and layout. */
static void scan_step(const char *dir, Zerod__V1__ReplicaSet *set, uint32_t *ranks, size_t cap) {
  DIR *dp = opendir(dir);
  if (dp == NULL)
    return;
  struct dirent *e;
  while ((e = readdir(dp)) != NULL) {
    uint32_t rank, world;
    if (strcmp(e->d_name, CKPT_LAYOUT_NAME) == 0) {
      set->layout = 1;
    } else if (shard_file(e->d_name, &rank, &world) && set->n_ranks < cap &&
               (set->world_size == 0 || set->world_size == world)) {
      set->world_size = world;
      ranks[set->n_ranks++] = rank;
    }
  }
  closedir(dp);
}

void *replica_report(zdaemon *d, uint64_t job_id, Zerod__V1__JobStatus *st) {
  struct replica_node *r = d->replicas;
  char dir[PATH_MAX];
  if (r == NULL ||
      snprintf(dir, sizeof dir, "%s/%" PRIu64, r->root, job_id) >= (int)sizeof dir - 32)
    return NULL;
  uint64_t steps[REPLICA_REPORT_STEPS];
  size_t nsteps = 0;
  DIR *dp = opendir(dir);
  if (dp == NULL)
    return NULL;
  struct dirent *e;
  while ((e = readdir(dp)) != NULL && nsteps < REPLICA_REPORT_STEPS) {
    char *end;
    errno = 0;
    unsigned long long step = strtoull(e->d_name, &end, 10);
    if (e->d_name[0] != '.' && *end == '\0' && errno == 0)
      steps[nsteps++] = step;
  }
  closedir(dp);
  report_blob *b = calloc(1, sizeof *b);
  if (b == NULL || nsteps == 0 || (b->sets = calloc(nsteps, sizeof *b->sets)) == NULL ||
      (b->ptrs = calloc(nsteps, sizeof *b->ptrs)) == NULL ||
      (b->ranks = calloc(nsteps * REPLICA_REPORT_RANKS, sizeof *b->ranks)) == NULL) {
    replica_report_free(b);
    return NULL;
  }
  for (size_t i = 0; i < nsteps; i++) {
    Zerod__V1__ReplicaSet *set = &b->sets[i];
    zerod__v1__replica_set__init(set);
    set->step = steps[i];
    set->ranks = &b->ranks[i * REPLICA_REPORT_RANKS];
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/%" PRIu64, dir, steps[i]);
    scan_step(path, set, set->ranks, REPLICA_REPORT_RANKS);
    b->ptrs[i] = set;
  }
  st->n_replicas = nsteps;
  st->replicas = b->ptrs;
  return b;
}

void replica_report_free(void *blob) {
  report_blob *b = blob;
  if (b == NULL)
    return;
  free(b->sets);
  free(b->ptrs);
  free(b->ranks);
  free(b);
}
