/* jobs: the node's job registry and each job's life (docs/architecture.md).
 *
 * The loop owns the registry (d->jobs) and is the one owner of every job
 * in it: it creates a job with its executors and checkpoint state
 * (jobs_start), resets its communicators after a failure (jobs_reset),
 * takes it out of the registry when it is deleted (jobs_retire) and frees
 * it and everything hung on it (jobs_free). Everything here runs on the
 * loop thread. */
#ifndef ZEROD_JOBS_H
#define ZEROD_JOBS_H

#include <stddef.h>
#include <stdint.h>

#include "job.h"

struct daemon;

/* The job of that name in the registry, or NULL: the live one if there
 * is one (a job rebuilt after a node loss lives beside the deleted one its
 * workers have not all left yet), else a deleted one. */
job *jobs_find(struct daemon *d, const char *name);

/* Replaces j's read-token hashes with the n in hashes (the coordinator's
 * Assignment; those that are not 64 hex digits are skipped). Loop thread.
 * Returns 0 or -ENOMEM (j keeps its old ones). */
int jobs_set_read_tokens(job *j, char *const *hashes, size_t n);

/* Creates a job with nranks local ranks (global first_rank..), starts its
 * executors and their communicators of the given generation (the
 * rendezvous epoch: 0 standalone, the coordinator's job epoch in a
 * cluster), and adds it to d->jobs. Returns 0 or a negative errno with a
 * message in err. */
int jobs_start(struct daemon *d, const char *name, const char *token_sha256,
               const job_config *config, int world_size, int nranks, int first_rank, uint64_t id,
               unsigned generation, job **out, char *err, size_t err_bytes);

/* Nobody is attached to a failed job any more: its ranks build fresh
 * communicators (a new generation) so new workers resume from the kept
 * state. */
void jobs_reset(job *j);

/* Takes a deleted job out of d->jobs (nothing finds it by name any more)
 * into d->retired and stops its executors; call once no worker is
 * attached. The caller tells the coordinator (cluster_report). */
void jobs_retire(struct daemon *d, job *j);

/* Frees every retired job whose executors have all stopped and whose
 * read-only sessions and workers' checkpoint calls are all gone
 * (j->readers and j->worker_calls at 0: the caller sweeps finished calls
 * first, ckpt_call_sweep): joins the (exited) threads and calls
 * jobs_free. Called on the loop when an executor stops and when a reader's
 * state is freed; does nothing while the daemon stops (main frees what is
 * left once the loop has ended). */
void jobs_reap(struct daemon *d);

/* Shutdown (loop thread): read-only sessions waiting for a rank give up,
 * every rank of every job is stopped before any is joined (a rank blocked
 * in a collective wakes when its peers abort theirs, exec.h), and then
 * every executor, retired jobs' included, is joined. */
void jobs_stop_all(struct daemon *d);

/* Frees every job, live and retired, once the loop has ended: nothing
 * refers to them any more. */
void jobs_free_all(struct daemon *d);

/* Publishes the node's figures in d->metrics (jobs, sessions; each job's
 * and rank's own come with the job, rank_metrics.h): a collector that
 * reads the registry on the loop before each scrape. Stop before the
 * registry is freed. 0 or -ENOMEM. */
int jobs_metrics_start(struct daemon *d);
void jobs_metrics_stop(struct daemon *d);
/* Frees a job whose executors have stopped and been joined: its
 * checkpoint state (waiting for its shard writers), its ranks' state, its
 * pins and the job. */
void jobs_free(job *j);

#endif /* ZEROD_JOBS_H */
