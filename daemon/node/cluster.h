/* cluster: a node daemon's membership in a cluster (`zerod node`).
 *
 * The node dials the coordinator (it is never dialled): it joins with retry
 * and backoff, renews its lease with heartbeats that report the state of
 * every job it hosts ranks of, and follows a Watch stream whose events carry
 * the view and this node's assignments. It reconciles its jobs to them:
 * builds the ranks of a new assignment (their communicators rendezvous
 * through the coordinator, store_grpc.c), and fails a job the coordinator
 * marks degraded or deletes, so its workers get the reason instead of
 * hanging. A heartbeat answered NOT_FOUND (lease lost, coordinator
 * restarted) makes it join again.
 *
 * Threads: everything runs on the loop thread, except the blocking gRPC
 * calls (Join, Heartbeat: on the libuv threadpool, one at a time) and the
 * Watch reader (its own thread, handing events to the loop through a locked
 * queue and a uv_async). */
#ifndef ZEROD_CLUSTER_H
#define ZEROD_CLUSTER_H

#include <stddef.h>

struct daemon;
struct store;

/* Creates the agent and the rendezvous store that talks to the coordinator
 * (*rendezvous; the agent owns it), or uses local_store instead (zerod
 * standalone: every rank is in this process; the agent owns it too).
 * Nothing is sent yet. */
int cluster_create(struct daemon *d, struct store *local_store, struct store **rendezvous,
                   char *err, size_t err_bytes);

/* Starts joining (loop thread, after the IPC socket is listening); with the
 * coordinator in this process (d->coord), joins it at once. */
void cluster_start(struct daemon *d);

/* A job's ranks are being built here: the coordinator hears as soon as they
 * are ready (or failed). */
void cluster_job_added(struct daemon *d);

/* Sends a heartbeat now (unless one is in flight): the coordinator learns
 * at once that a job has gone from this node. */
void cluster_report(struct daemon *d);

/* The drain before a stop (docs/daemon.md, "Upgrades keep state"): asks
 * the coordinator, in heartbeats, to save this node's jobs. 0 when the
 * node is no member (nothing to drain). cluster_drained says when the
 * coordinator has answered that no save is left, or could not be asked. */
int cluster_drain(struct daemon *d);
int cluster_drained(const struct daemon *d);

/* Shutdown, on the loop thread: leaves the cluster (one short blocking
 * call), stops the watch thread and closes the agent's handles. */
void cluster_stop(struct daemon *d);

/* Frees the agent and its store, after the loop has ended. */
void cluster_destroy(struct daemon *d);

#endif /* ZEROD_CLUSTER_H */
