/* ckpt_call: the checkpoints workers ask for themselves (CHECKPOINT,
 * ipc.proto; zerod.torch.save and load).
 *
 * Every rank's worker sends the same request between the same two steps.
 * Its rank checks that in a collective and waits with its worker
 * (OP_CKPT_PARK, rank/snapshot.c); then the op comes here. The node that
 * hosts global rank 0 (the leader) asks the coordinator, Save or Restore,
 * as any control-plane client would, on a thread of the call's, and puts
 * the answer in the job's rendezvous store; other nodes read it from
 * there. Every waiting worker of the node is answered with it, on the
 * loop. A save's order reaches ranks whose workers wait, so each takes its
 * copy at once; a restore's may install while they wait
 * (ckpt_node.c follow_restore counts them as gone). */
#ifndef ZEROD_CKPT_CALL_H
#define ZEROD_CKPT_CALL_H

#include "exec.h"
#include "frame.h"

struct daemon;
struct session;

/* Sets up the loop's side (daemon start). Returns 0 or a negative errno. */
int ckpt_call_init(struct daemon *d);

/* Checks a CHECKPOINT request before its rank sees it: the action, and the
 * name (a checkpoint of this job: 1..64 of [A-Za-z0-9._-], not starting
 * with '.'; required to restore). Returns 0, or writes why into err and
 * returns -EINVAL. */
int ckpt_call_check(const Zerod__V1__CheckpointRequest *req, char *err, size_t err_bytes);

/* A worker's OP_CKPT_PARK came back done: it waits for the call of its
 * job numbered op->ckpt_call, which starts with the first of this node's
 * ranks. Takes the op: when the call ends, the op is answered (its reply
 * or error set, its rank let go on) and handed back through finish_op,
 * which sends the reply and frees it (the caller's, ipc.c: the same
 * function for every op). Returns 0, or a negative errno (the op stays
 * the caller's). */
int ckpt_call_wait(struct daemon *d, exec_op *op, void (*finish_op)(exec_op *op));

/* Shutdown (loop): calls still waiting give up (a leader's call to the
 * coordinator ends when the coordinator answers: it fails saves and
 * restores of a node that leaves); the loop runs until they have. */
void ckpt_call_shutdown(struct daemon *d);

/* Drops the records of finished calls that nobody will come for any more
 * (every rank answered, or the job failed or has no worker), so that each
 * job's worker_calls counts only the calls it must outlive (jobs_reap
 * frees a retired job only at 0). The loop calls it before jobs_reap. */
void ckpt_call_sweep(struct daemon *d);

/* The worker protocol's status (Zerod__V1__Status) for a control-plane
 * status (rpc.h): what a worker is told when a call made for it fails. */
int ckpt_call_ipc_status(int rpc_status);

#endif /* ZEROD_CKPT_CALL_H */
