/* coord: the coordinator (docs/architecture.md) - membership, jobs, the
 * rendezvous KV, checkpoints and health, served over gRPC (rpc.h).
 *
 * Everything here runs on the loop thread: the gRPC handlers are called
 * there (rpc.h), and the lease sweep is a uv_timer on the same loop.
 *
 * State:
 *  - Members (soft state): node info, session id, lease deadline. A node
 *    joins, renews its lease with Heartbeat, and leaves with Leave or by
 *    missing its lease; each change bumps the view epoch and is pushed to
 *    every Watch stream. A duplicate live name is refused (ALREADY_EXISTS).
 *  - Jobs (durable, in --state-dir/coordinator.pb, written atomically):
 *    name, id, token, config, placement (nodes and their ranks), quotas.
 *    Their state (creating, ready, degraded, deleting) and reason are
 *    derived from the members and the nodes' heartbeat reports.
 *  - Rendezvous KV (soft state): (job, epoch, key) -> bytes, with Gets that
 *    wait until the key is set or their deadline passes.
 *  - Checkpoints (coord_ckpt.c): directories under --checkpoint-dir, which
 *    are their own catalog, and the save and restore orders in flight
 *    (soft state: an order does not survive a restart; its temporary
 *    directory is removed at the next start).
 * After a restart the jobs come back from the state file; the members come
 * back as their nodes re-join (a Heartbeat from an unknown session answers
 * NOT_FOUND, which tells the node to join again).
 *
 * Requests are decoded and validated by ctl_decode.h. Every RPC, its errors,
 * the job state machine and the limits: docs/control-plane.md. */
#ifndef ZEROD_COORD_H
#define ZEROD_COORD_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "metrics.h"
#include "rpc.h"
#include "zerod/v1/control.pb-c.h"

typedef struct coord coord;

#define COORD_MAX_EXPORT_ROOTS 8 /* --export-root, repeated */

typedef struct coord_options {
  char state_dir[PATH_MAX]; /* created if missing; holds coordinator.pb; "": in memory only */
  /* coordinator.pb keeps the bases (frozen jobs) and no other job: zerod
   * standalone, whose jobs are made by their workers and live in its
   * memory alone, while a base is restored from its checkpoint after a
   * restart (docs/decisions.md, "Bases"). */
  int durable_bases_only;
  int lease_ttl_ms; /* a node that does not renew within this leaves */
  /* A job whose rank has waited this long in a collective for peers has
   * the operation failed on every rank (coord_stalls.c); 0: never. */
  int64_t stall_timeout_ms;
  /* A job none of whose nodes has had a worker attached for this long is
   * deleted (coord_idle.c); 0: never. Bases (frozen jobs) never expire. */
  int64_t job_idle_ttl_ms;
  /* Where checkpoints live: <checkpoint_dir>/<job>/<name>/. An absolute
   * path (it travels to the nodes, which must see the same directory),
   * created if missing. "": no checkpoints (the Checkpoints methods answer
   * FAILED_PRECONDITION). */
  char checkpoint_dir[PATH_MAX];
  int checkpoint_timeout_ms; /* longest a save or restore may take; 0: 600 s */
  /* A deleted job's checkpoints are removed this long after the job's
   * deletion; 0: kept until their owner deletes them. */
  int64_t retain_deleted_checkpoints_ms;
  /* The principals file (coord/auth.h, docs/security.md); "": none, and
   * every caller may do everything (a loopback or --insecure setup). */
  char auth_file[PATH_MAX];
  /* Where Export may write its file, and, with checkpoint_dir, where
   * Restore and Export may read a checkpoint named by an absolute path
   * (docs/checkpoints.md, "Where files may be read and written"). Absolute
   * paths of existing directories without symbolic links (realpath), the
   * first of which holds an export given as a relative path. None:
   * checkpoint_dir is the only root, for exports too. */
  char export_roots[COORD_MAX_EXPORT_ROOTS][PATH_MAX];
  unsigned n_export_roots;
} coord_options;

/* Loads the state directory (creating it if needed), removes what a crash
 * left in the checkpoint directory, and starts the lease timer on loop.
 * Returns 0 or a negative errno with a message in err (an unreadable or
 * corrupt state file is an error, never silently dropped). */
int coord_create(uv_loop_t *loop, const coord_options *options, coord **out, char *err,
                 size_t err_bytes);

/* Registers the Cluster, Jobs, Rendezvous, Checkpoints and
 * grpc.health.v1.Health methods on a server that has not been started. */
int coord_register(coord *c, rpc_server *server);

/* zerod standalone: makes node a member at once, as Join would (its agent
 * then renews the lease over gRPC like any node's). Returns 0 with the
 * session and lease TTL, or an RPC status with the reason in err. */
int coord_join_local(coord *c, const Zerod__V1__NodeInfo *node, uint64_t *session_out,
                     int *lease_ttl_ms_out, char *err, size_t err_bytes);

/* zerod standalone: creates a job placed on node alone (ranks ranks), as
 * CreateJob would, from the loop thread of the process that runs the
 * coordinator. The token is kept as given, even empty. config must be valid
 * (the caller has checked it). Returns 0 with the job's id and epoch, or an
 * RPC status (ALREADY_EXISTS, FAILED_PRECONDITION: node is not a member
 * yet, ...) with the reason in err. */
int coord_create_job_local(coord *c, const char *name, const char *token,
                           const Zerod__V1__JobConfig *config, const char *node, uint32_t ranks,
                           uint64_t *id_out, uint64_t *epoch_out, char *err, size_t err_bytes);

/* Publishes the coordinator's figures in m (docs/operations.md,
 * "Metrics"): members, jobs by state and checkpoint operations through a
 * collector, and the calls of server (its control server; NULL: none) by
 * method and status. Loop thread. 0 or -ENOMEM; m NULL: nothing. */
int coord_metrics_start(coord *c, rpc_server *server, metrics *m);
/* Stops publishing (before coord_destroy, and before m is freed). */
void coord_metrics_stop(coord *c);

/* Starts shutting down: health turns NOT_SERVING, every Watch stream ends
 * with UNAVAILABLE ("coordinator shutting down"), waiting Gets and
 * checkpoint orders in flight with UNAVAILABLE, and the lease timer is
 * closed. Call before rpc_server_shutdown. Checkpoint file work already on
 * libuv's thread pool finishes while the loop keeps running. */
void coord_shutdown(coord *c);

/* Frees the coordinator, after coord_shutdown, once the server is done and
 * the loop has ended (its timers closed, its thread-pool work done). */
void coord_destroy(coord *c);

#endif /* ZEROD_COORD_H */
