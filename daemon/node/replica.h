/* replica: a node's in-memory copies of its jobs' state (docs/redundancy.md).
 *
 * A job with redundancy is saved in memory every few steps: each rank's
 * shard file goes into this node's replica directory (on tmpfs: memory,
 * not disk), under <root>/<job id>/<save id>/, and is copied to the job's
 * buddy node, whose replica server (replica_net.h) keeps it in the same
 * place of its own directory. After a node loss, a node restoring the job
 * reads the files it holds there and fetches the others from the servers
 * that hold them. The files of a save older than the job's newest
 * complete one go (replica_keep); a deleted job's all go.
 *
 * The server's connection threads ask for a job's key (given by the
 * coordinator in the job's Assignment): the key table has a mutex of its
 * own. The other functions: replica_set_key, replica_keep, replica_forget
 * and replica_save_dir on the loop thread; replica_push and
 * replica_fetch on any thread (a writer, a rank's executor). */
#ifndef ZEROD_REPLICA_H
#define ZEROD_REPLICA_H

#include <stddef.h>
#include <stdint.h>

#include "replica_net.h"
#include "zerod/v1/control.pb-c.h"

struct daemon;

/* How long a copy to or from a peer may stall. */
#define REPLICA_TIMEOUT_MS 60000

/* Makes root (emptied of what an earlier daemon left: its copies died
 * with it) and serves it on host, any port. 0, or a negative errno with
 * err. */
int replica_start(struct daemon *d, const char *root, const char *host, char *err,
                  size_t err_bytes);
/* The server's port, 0 when none runs (zerod standalone). */
int replica_port(const struct daemon *d);
void replica_stop(struct daemon *d);

/* The key of job_id, from its Assignment (key_len 0: none). */
void replica_set_key(struct daemon *d, uint64_t job_id, const uint8_t *key, size_t key_len);
/* Removes job_id's saves older than keep (the newest complete one). */
void replica_keep(struct daemon *d, uint64_t job_id, uint64_t keep);
/* The job was deleted: its key and every copy of it go. */
void replica_forget(struct daemon *d, uint64_t job_id);
/* The directory of save_id of job_id, made if absent, into out. 0 or a
 * negative errno with err. */
int replica_save_dir(struct daemon *d, uint64_t job_id, uint64_t save_id, char *out,
                     size_t out_bytes, char *err, size_t err_bytes);

/* Copies the file name of dir (save_id of job_id) to the replica server
 * at buddy. 0 or a negative errno with err. */
int replica_push(struct daemon *d, uint64_t job_id, uint64_t save_id, const char *dir,
                 const char *name, const char *buddy, char *err, size_t err_bytes);
/* Fetches name into dir from holder. 0 or a negative errno with err. */
int replica_fetch_file(struct daemon *d, uint64_t job_id, uint64_t save_id, const char *dir,
                       const char *name, const char *holder, char *err, size_t err_bytes);
/* Fetches into dir every file of the manifest there that dir lacks, each
 * from the first of its holders (per saved rank, "host:port" strings,
 * nholders[rank] of them) that has it. 0 or a negative errno with err. */
int replica_fetch(struct daemon *d, uint64_t job_id, uint64_t save_id, const char *dir,
                  char ***holders, const size_t *nholders, uint32_t world_size, char *err,
                  size_t err_bytes);

/* What a heartbeat says of job_id's copies here: at most
 * REPLICA_REPORT_STEPS steps (a job keeps two: the newest complete one and
 * the one being made) of at most REPLICA_REPORT_RANKS files each. Fills
 * st->replicas; returns what it points to, for replica_report_free after
 * the heartbeat is encoded (NULL: nothing, or out of memory). Loop thread. */
#define REPLICA_REPORT_STEPS 8
#define REPLICA_REPORT_RANKS 128
void *replica_report(struct daemon *d, uint64_t job_id, Zerod__V1__JobStatus *st);
void replica_report_free(void *blob);

#endif /* ZEROD_REPLICA_H */
