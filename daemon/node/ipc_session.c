/* ipc_session: a worker's session (ipc_impl.h): opened on an accepted
 * connection, driven by a uv_poll_t with recvmsg/sendmsg so descriptors
 * travel with SCM_RIGHTS; frames read and handed to its handler, replies
 * queued and written as the socket takes them, its ops sent to its rank;
 * closed at once when it misbehaves or goes (what that means for its job
 * is decided here), and freed when closed and no op refers to it. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ckpt_call.h"
#include "cluster.h"
#include "daemon.h"
#include "frame.h"
#include "jobs.h"
#include "log.h"
#include "pbcheck.h"
#include "reader.h"

#include "ipc_impl.h"

/* Reply bytes a session may leave unread before it is dropped. */
#define SESSION_MAX_OUT_BYTES (64u << 20)
/* Frames read per wakeup, so that one busy session cannot starve others. */
#define SESSION_FRAMES_PER_WAKEUP 64

static void session_update_poll(session *s);

/* Frees the deleted jobs nothing runs for any more: the workers'
 * checkpoint calls that are over are dropped first, so that only running
 * ones keep a job (jobs_reap). */
void ipc__reap_jobs(zdaemon *d) {
  ckpt_call_sweep(d);
  jobs_reap(d);
}

/* ------------------------------------------------------------------------ */
/* Lifetime                                                                 */
/* ------------------------------------------------------------------------ */

static void session_free(session *s) {
  /* No op of the session is left (each holds a reference), so neither is
   * a read of its reader: the job no longer has it. */
  if (s->read_only != NULL) {
    job *j = reader_job(s->read_only);
    reader_destroy(s->read_only);
    j->readers--;
    ipc__reap_jobs(s->daemon); /* it may have been the last of a deleted job */
  }
  zd_frame_reader_reset(&s->reader);
  while (s->out_head != NULL) {
    out_frame *f = s->out_head;
    s->out_head = f->next;
    if (f->fd >= 0)
      close(f->fd);
    free(f->data);
    free(f);
  }
  free(s);
}

void ipc__session_unref(session *s) {
  if (--s->refs == 0 && s->poll_closed)
    session_free(s);
}

static void on_poll_closed(uv_handle_t *handle) {
  session *s = handle->data;
  close(s->fd);
  s->fd = -1;
  s->poll_closed = 1;
  ipc__session_unref(s); /* the open connection's reference */
}

/* ------------------------------------------------------------------------ */
/* Output                                                                   */
/* ------------------------------------------------------------------------ */

static int send_some(session *s, out_frame *f) {
  while (f->sent < f->bytes) {
    struct iovec iov = {.iov_base = f->data + f->sent, .iov_len = f->bytes - f->sent};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    union {
      struct cmsghdr align;
      char buf[CMSG_SPACE(sizeof(int))];
    } control;
    if (f->sent == 0 && f->fd >= 0) {
      memset(&control, 0, sizeof control);
      msg.msg_control = control.buf;
      msg.msg_controllen = sizeof control.buf;
      struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int));
      memcpy(CMSG_DATA(cmsg), &f->fd, sizeof(int));
    }
    ssize_t n = sendmsg(s->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return 0;
      return -errno;
    }
    if (f->sent == 0 && f->fd >= 0) {
      close(f->fd);
      f->fd = -1;
    }
    f->sent += (size_t)n;
  }
  return 1;
}

static void session_flush(session *s) {
  while (s->out_head != NULL) {
    out_frame *f = s->out_head;
    int rc = send_some(s, f);
    if (rc < 0) {
      ipc__session_close(s, "send failed (worker gone)");
      return;
    }
    if (rc == 0)
      break;
    s->out_head = f->next;
    if (s->out_head == NULL)
      s->out_tail = NULL;
    s->out_bytes -= f->bytes;
    free(f->data);
    free(f);
  }
  session_update_poll(s);
}

/* Takes ownership of data and fd. */
void ipc__session_send(session *s, uint8_t *data, size_t bytes, int fd) {
  if (s->closing) {
    free(data);
    if (fd >= 0)
      close(fd);
    return;
  }
  out_frame *f = calloc(1, sizeof *f);
  if (f == NULL) {
    free(data);
    if (fd >= 0)
      close(fd);
    ipc__session_close(s, "out of memory");
    return;
  }
  f->data = data;
  f->bytes = bytes;
  f->fd = fd;
  if (s->out_tail != NULL)
    s->out_tail->next = f;
  else
    s->out_head = f;
  s->out_tail = f;
  s->out_bytes += bytes;
  if (s->out_bytes > SESSION_MAX_OUT_BYTES) {
    ipc__session_close(s, "worker does not read its replies");
    return;
  }
  session_flush(s);
}

void ipc__send_message(session *s, uint16_t type, uint64_t request_id,
                       const ProtobufCMessage *msg) {
  uint8_t *frame;
  size_t bytes;
  if (zd_frame_encode(type, request_id, 0, 0, msg, &frame, &bytes) == 0)
    ipc__session_send(s, frame, bytes, -1);
}

void ipc__send_error(session *s, uint64_t request_id, int status, const char *fmt, ...) {
  char message[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof message, fmt, ap);
  va_end(ap);
  /* The worker's decoder refuses an Error whose message is not UTF-8, and
   * vsnprintf may have cut one inside a character (a long unit name). */
  zd_utf8_sanitize(message);
  Zerod__V1__Error err = ZEROD__V1__ERROR__INIT;
  err.status = (Zerod__V1__Status)status;
  err.message = message;
  ipc__send_message(s, ZEROD__V1__MSG_TYPE__MSG_ERROR, request_id, &err.base);
}

/* ------------------------------------------------------------------------ */
/* Requests to the ranks                                                    */
/* ------------------------------------------------------------------------ */

void ipc__submit(session *s, exec_op *op) {
  s->refs++;
  s->inflight++;
  if (exec_try_inline(op)) {
    if (op->reply_frame != NULL) {
      ipc__session_send(s, op->reply_frame, op->reply_bytes, op->reply_fd);
      op->reply_frame = NULL;
      op->reply_fd = -1;
    }
    s->inflight--;
    op->session = NULL;
    exec_op_free(op);
    ipc__session_unref(s);
    return;
  }
  exec_submit(op);
}

/* ------------------------------------------------------------------------ */
/* Sessions                                                                 */
/* ------------------------------------------------------------------------ */

static void on_session_io(uv_poll_t *handle, int status, int events);

static void session_update_poll(session *s) {
  if (s->closing)
    return;
  int events = UV_READABLE;
  if (s->out_head != NULL)
    events |= UV_WRITABLE;
  /* uv_poll_start re-registers the descriptor even when nothing changed,
   * which costs an epoll_ctl per request: only call it on a change. */
  if (events != s->poll_events) {
    s->poll_events = events;
    uv_poll_start(&s->poll, events, on_session_io);
  }
}

static void on_session_io(uv_poll_t *handle, int status, int events) {
  session *s = handle->data;
  if (status < 0) {
    ipc__session_close(s, uv_strerror(status));
    return;
  }
  if (events & UV_WRITABLE)
    session_flush(s);
  if (s->closing || !(events & UV_READABLE))
    return;
  /* The cap bounds reads of the socket; frames the reader already holds
   * are handed out too, since epoll cannot see them. */
  for (int n = 0;
       !s->closing && (n < SESSION_FRAMES_PER_WAKEUP || zd_frame_reader_pending(&s->reader)); n++) {
    const char *why = NULL;
    int rc = zd_frame_read(&s->reader, s->fd, &why);
    if (rc == 0)
      return;
    if (rc == -ECONNRESET) {
      ipc__session_close(s, s->job != NULL ? "disconnected without detaching" : NULL);
      return;
    }
    if (rc < 0) {
      /* The byte stream can no longer be trusted: answer once, close. */
      LOG_WARNF("protocol error", "session=%llu pid=%d err=\"%s\"", (unsigned long long)s->id,
                (int)s->pid, why != NULL ? why : strerror(-rc));
      ipc__send_error(s, 0, ZEROD__V1__STATUS__STATUS_PROTOCOL, "protocol error: %s; closing",
                      why != NULL ? why : strerror(-rc));
      ipc__session_close(s, "protocol error");
      return;
    }
    zd_frame_header header;
    uint8_t *payload;
    int fds[ZD_FRAME_MAX_FDS];
    unsigned nfds;
    zd_frame_reader_take(&s->reader, &header, &payload, fds, &nfds);
    s->on_frame(s, &header, payload, fds, nfds);
  }
}

/* Closes a session at once (reason NULL: a clean close). Its ops still in
 * the executors finish; their replies are dropped. */
void ipc__session_close(session *s, const char *reason) {
  if (s->closing)
    return;
  s->closing = 1;
  zdaemon *d = s->daemon;
  /* Push out what is already queued (an error explaining the close). */
  if (s->out_head != NULL)
    for (out_frame *f = s->out_head; f != NULL; f = f->next)
      if (send_some(s, f) <= 0)
        break;
  if (s->job != NULL && s->read_only != NULL) {
    /* A reader leaves nothing to fail: it took no part in collectives. Its
     * running gather stops waiting; its buffers and pin go with the
     * session (session_free). */
    job *j = s->job;
    if (s->detaching)
      LOG_INFOF("reader detached", "job=%s pid=%d session=%llu", j->name, (int)s->pid,
                (unsigned long long)s->id);
    else
      LOG_INFOF("reader disconnected", "job=%s pid=%d session=%llu reason=\"%s\"", j->name,
                (int)s->pid, (unsigned long long)s->id, reason != NULL ? reason : "closed");
    reader_close(s->read_only);
    s->job = NULL;
  } else if (s->job != NULL) {
    job *j = s->job;
    rank_state *rs = s->rank;
    if (!s->detaching) {
      LOG_WARNF("worker lost", "job=%s rank=%d pid=%d reason=\"%s\"", j->name, rs->rank,
                (int)s->pid, reason != NULL ? reason : "closed");
      /* Other ranks may be waiting for this one in a collective: fail the
       * job, which closes the rank's communicator so they fail now. A lone
       * standalone worker leaves an idle job behind instead. */
      if (j->sessions > 1 || job_spans_nodes(j))
        job_fail(j, j->generation, "rank %d's worker (pid %d) disconnected without detaching",
                 rs->rank, (int)s->pid);
      exec_op *end = exec_op_new(OP_SESSION_END, rs);
      if (end != NULL)
        exec_submit(end);
    } else if (d->stopping) {
      LOG_INFOF("worker disconnected", "job=%s rank=%d pid=%d reason=shutdown", j->name, rs->rank,
                (int)s->pid);
    } else {
      LOG_INFOF("worker detached", "job=%s rank=%d pid=%d", j->name, rs->rank, (int)s->pid);
    }
    rs->session = NULL;
    s->job = NULL;
    if (--j->sessions == 0 && !d->stopping && j->deleted) {
      jobs_retire(d, j);
      cluster_report(d); /* the coordinator hears at once that it has gone */
    } else if (j->sessions == 0 && !d->stopping && !job_failed(j, j->generation, NULL, 0)) {
      /* The job is idle: give its buffers back to the system. */
      for (int r = 0; r < j->nranks; r++) {
        exec_op *trim = exec_op_new(OP_TRIM, &j->ranks[r]);
        if (trim != NULL)
          exec_submit(trim);
      }
    } else if (j->sessions == 0 && !d->stopping && !job_spans_nodes(j)) {
      jobs_reset(j); /* a multi-node job does not reset alone (decisions.md) */
    }
  } else if (reason != NULL) {
    LOG_DEBUGF("connection closed", "session=%llu reason=\"%s\"", (unsigned long long)s->id,
               reason);
  }
  if (s->prev != NULL)
    s->prev->next = s->next;
  else
    d->sessions = s->next;
  if (s->next != NULL)
    s->next->prev = s->prev;
  d->nsessions--;
  uv_poll_stop(&s->poll);
  uv_close((uv_handle_t *)&s->poll, on_poll_closed);
}

session *ipc__session_open(zdaemon *d, int fd, ipc_frame_fn on_frame) {
  session *s = calloc(1, sizeof *s);
  if (s == NULL) {
    close(fd);
    return NULL;
  }
  s->daemon = d;
  s->on_frame = on_frame;
  s->fd = fd;
  s->id = ++d->next_session_id;
  s->refs = 1;
  zd_frame_reader_init(&s->reader);
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
    s->pid = cred.pid;
    s->uid = cred.uid;
  }
  if (uv_poll_init(d->loop, &s->poll, fd) != 0) {
    close(fd);
    free(s);
    return NULL;
  }
  s->poll.data = s;
  s->next = d->sessions;
  if (d->sessions != NULL)
    d->sessions->prev = s;
  d->sessions = s;
  d->nsessions++;
  s->poll_events = UV_READABLE;
  uv_poll_start(&s->poll, UV_READABLE, on_session_io);
  LOG_DEBUGF("connection", "session=%llu pid=%d uid=%d", (unsigned long long)s->id, (int)s->pid,
             (int)s->uid);
  return s;
}
