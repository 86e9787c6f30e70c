/* follow: read-only sessions of a job this node does not host
 * (docs/subscribe.md, "Across nodes").
 *
 * A read-only ATTACH of a job that has no ranks here, on a node in a
 * cluster, makes (or joins) a mirror of the job: a thread that asks the
 * coordinator where the job is (LocateJob, with the attach's token),
 * follows it from that node's replica server (a FOLLOW connection, whose
 * far end, follow_relay, relays a read-only session to that node's
 * daemon), and installs each version it fetches into a one-rank job in
 * this daemon's memory, at the upstream version's number. Every local
 * read-only session of the job (same name, same token) attaches to that
 * job: one fetch per version serves them all, from shared memory, with
 * the pins, watches and deltas of any read-only session.
 *
 * A mirror fetches only the blocks a version changed (delta gathers on
 * the far side). It is stopped once no session has used it for
 * FOLLOW_IDLE_MS; when the far side fails or goes away, the mirror job
 * fails (its sessions get ABORTED) and the next attach starts a new one.
 *
 * The loop thread owns the mirror list and the attaches that wait for a
 * mirror's first version; each mirror's thread owns its connection and
 * writes its job as a rank's executor would (pin.h). */
#ifndef ZEROD_FOLLOW_H
#define ZEROD_FOLLOW_H

#include <stddef.h>
#include <stdint.h>

#include "zerod/v1/ipc.pb-c.h"

struct daemon;
struct session;
struct job;

/* The longest WATCH a follower sends (the relay refuses longer ones). */
#define FOLLOW_MAX_WATCH_MS 60000
/* How long a mirror no session uses is kept. */
#define FOLLOW_IDLE_MS 30000

/* The hosting side: relays one FOLLOW connection (replica_follow_fn; ctx
 * the daemon), on the replica server's connection thread. */
void follow_relay(void *ctx, int fd);

/* The bytes that follow a GatherReply on a follower's stream
 * (docs/protocol.md, "FOLLOW"): block b of the buffer, at *at, is sent
 * when the reply is whole or lists it. follow_block_span gives its length
 * (0: not sent); follow_gathered_bytes, the sum over follow_nblocks. */
size_t follow_nblocks(const Zerod__V1__GatherReply *g);
size_t follow_block_span(const Zerod__V1__GatherReply *g, size_t b, size_t *at);
uint64_t follow_gathered_bytes(const Zerod__V1__GatherReply *g);

/* What an attach waiting for a mirror is finished with, on the loop:
 * the mirror's job (j != NULL), or an error (j NULL, status and message). */
typedef void (*follow_resume_fn)(struct session *s, uint64_t request_id, uint8_t flags,
                                 const Zerod__V1__AttachRequest *req, struct job *j, int status,
                                 const char *message);

/* The following side, on the loop. follow_init before serving (0 or
 * -ENOMEM); follow_attach takes a read-only attach of a job this node
 * does not have: resume is called with the mirror (at once when it is
 * ready, else once its first version is in) or with why it failed.
 * Returns 0, or -ENOTSUP when this daemon follows nothing (zerod
 * standalone: no coordinator to ask). follow_stop stops every mirror's
 * thread, answers waiting attaches UNAVAILABLE and closes its handles (the
 * daemon stops); follow_free frees the mirrors and their jobs once the
 * loop has ended (no session reads them any more). */
int follow_init(struct daemon *d);
int follow_attach(struct daemon *d, struct session *s, uint64_t request_id, uint8_t flags,
                  const Zerod__V1__AttachRequest *req, follow_resume_fn resume);
void follow_stop(struct daemon *d);
void follow_free(struct daemon *d);

#endif /* ZEROD_FOLLOW_H */
