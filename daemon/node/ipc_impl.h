/* ipc_impl: what the files of the node's IPC share (ipc.c, ipc_session.c,
 * ipc_dispatch.c, ipc_attach.c, ipc_completion.c) and nothing else
 * includes: a session's state, and the ipc__ steps each file offers the
 * others.
 * Everything here runs on the loop thread; the rules (who frees a session,
 * when a session is closed) are in ipc.c's opening comment. */
#ifndef ZEROD_IPC_IMPL_H
#define ZEROD_IPC_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "daemon.h"
#include "exec.h"
#include "frame.h"
#include "job.h"
#include "reader.h"

/* Requests a session may have queued before it is told to wait. */
#define SESSION_MAX_INFLIGHT 4096

typedef struct out_frame {
  struct out_frame *next;
  uint8_t *data;
  size_t bytes, sent;
  int fd; /* passed with the first byte; -1 if none */
} out_frame;

typedef struct session session;

/* What a session does with each complete frame it reads: ipc__dispatch
 * (ipc.c gives it at ipc__session_open). Owns payload and fds. */
typedef void (*ipc_frame_fn)(session *s, const zd_frame_header *h, uint8_t *payload, int *fds,
                             unsigned nfds);

struct session {
  uv_poll_t poll;
  zdaemon *daemon;
  ipc_frame_fn on_frame;
  struct session *next, *prev;
  uint64_t id;
  int fd;
  pid_t pid;
  uid_t uid;
  zd_frame_reader reader;

  job *job;          /* attached job, or NULL */
  rank_state *rank;  /* read-write: the rank it holds; NULL for read-only */
  reader *read_only; /* read-only session: its buffers, pin, request order */
  int detaching;

  int refs; /* 1 while open + 1 per op in flight */
  int inflight;
  int closing;
  int attach_pending; /* a read-only ATTACH waits for a mirror (follow.h) */
  int poll_closed;
  out_frame *out_head, *out_tail;
  size_t out_bytes;
  int poll_events; /* events the poll handle watches now */
};

/* ---- sessions ------------------------------------------------------------ */

/* A new session on an accepted connection (fd, which it owns from now:
 * closed on failure), reading frames for on_frame. NULL: out of memory or
 * no poll handle. */
session *ipc__session_open(zdaemon *d, int fd, ipc_frame_fn on_frame);

/* Closes a session at once (reason NULL: a clean close). Its ops still in
 * the executors finish; their replies are dropped. */
void ipc__session_close(session *s, const char *reason);

/* Drops a reference (an op's, or the open connection's); the last one
 * frees the session once its poll handle is closed. */
void ipc__session_unref(session *s);

/* Queues a frame to the worker; takes ownership of data and fd. */
void ipc__session_send(session *s, uint8_t *data, size_t bytes, int fd);

/* A message, or an Error (status and a printf message, made valid
 * UTF-8), to the worker. */
void ipc__send_message(session *s, uint16_t type, uint64_t request_id, const ProtobufCMessage *msg);
__attribute__((format(printf, 4, 5))) void ipc__send_error(session *s, uint64_t request_id,
                                                           int status, const char *fmt, ...);

/* Sends a request's op to its rank's executor, or runs it at once on the
 * loop when the rank is idle (exec_try_inline) and answers it. */
void ipc__submit(session *s, exec_op *op);

/* Frees the deleted jobs nothing runs for any more: the workers'
 * checkpoint calls that are over are dropped first, so that only running
 * ones keep a job (jobs_reap). */
void ipc__reap_jobs(zdaemon *d);

/* ---- requests ------------------------------------------------------------ */

/* Handles one complete frame (an ipc_frame_fn); owns payload and fds. */
void ipc__dispatch(session *s, const zd_frame_header *h, uint8_t *payload, int *fds, unsigned nfds);

/* ATTACH: a read-write session takes a rank of a job (created first if
 * asked and allowed), a read-only one a reader; each refusal answered. */
void ipc__handle_attach(session *s, uint64_t request_id, uint8_t flags,
                        Zerod__V1__AttachRequest *req);

/* ---- completions --------------------------------------------------------- */

/* The completion queue's wakeup: every op finished since, delivered. */
void ipc__on_completion(uv_async_t *handle);

/* A read-only session's op, finished (reader_env.done). */
void ipc__deliver_reader_op(void *daemon, exec_op *op);

#endif /* ZEROD_IPC_IMPL_H */
