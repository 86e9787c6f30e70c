/* ipc: the local socket workers connect to (daemon.h's ipc_listen and
 * ipc_close_all; docs/architecture.md; the protocol is docs/protocol.md):
 * bound and renamed into place, connections accepted into sessions (or
 * refused with a notice when there are too many), everything closed at
 * shutdown.
 *
 * The IPC side of the node, in its files: ipc_session.c (a worker's
 * session: frames in and out, close, free), ipc_dispatch.c (its
 * requests), ipc_attach.c (ATTACH), ipc_completion.c (ops back from the
 * executors); ipc_impl.h is what they share.
 *
 * Everything here runs on the loop thread. A session is one worker
 * connection, driven by a uv_poll_t with recvmsg/sendmsg so descriptors
 * travel with SCM_RIGHTS. Requests become exec_ops for the attached rank's
 * executor; replies come back through the completion queue. A session that
 * sends a frame we cannot trust is answered once and closed; every other
 * error is answered and the session goes on. A session's memory is freed
 * only when it is closed and no op refers to it (refs == 0). */
#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon.h"
#include "frame.h"
#include "log.h"
#include "reader.h"

#include "ipc_impl.h"

/* ------------------------------------------------------------------------ */
/* Accepting connections                                                    */
/* ------------------------------------------------------------------------ */

static void on_accept(uv_poll_t *handle, int status, int events) {
  zdaemon *d = handle->data;
  for (;;) {
    int fd = accept4(d->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR)
        continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        LOG_WARNF("accept failed", "err=\"%s\"", strerror(errno));
      return;
    }
    if (d->stopping || d->nsessions >= d->options.max_sessions) {
      LOG_WARNF("connection refused", "sessions=%d max=%d", d->nsessions, d->options.max_sessions);
      /* Say why before closing: the worker reports this, not a bare
       * "connection closed". A short wait: a refused peer is not worth
       * blocking the loop for. */
      Zerod__V1__Notice notice = ZEROD__V1__NOTICE__INIT;
      char text[160];
      if (d->stopping) {
        notice.status = ZEROD__V1__STATUS__STATUS_UNAVAILABLE;
        snprintf(text, sizeof text, "zerod is shutting down");
      } else {
        notice.status = ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED;
        snprintf(text, sizeof text,
                 "zerod has %d worker sessions, the most --max-sessions allows; try again when "
                 "one ends",
                 d->nsessions);
      }
      notice.message = text;
      zd_frame_send(fd, ZEROD__V1__MSG_TYPE__MSG_NOTICE, 0, 0, &notice.base, NULL, 0, 100);
      close(fd);
      continue;
    }
    ipc__session_open(d, fd, ipc__dispatch);
  }
}

/* ------------------------------------------------------------------------ */
/* The listening socket                                                     */
/* ------------------------------------------------------------------------ */

int ipc_listen(zdaemon *d, char *err, size_t err_bytes) {
  int init_rc = reader_env_init(&d->readers, d->loop, ipc__deliver_reader_op, d,
                                d->options.collective_timeout_ms, d->options.max_pinned_versions);
  if (init_rc != 0) {
    snprintf(err, err_bytes, "cannot start: uv_timer_init: %s", uv_strerror(init_rc));
    return init_rc;
  }
  pthread_mutex_init(&d->completion_mutex, NULL);
  init_rc = uv_async_init(d->loop, &d->completion_async, ipc__on_completion);
  if (init_rc != 0) {
    snprintf(err, err_bytes, "cannot start: uv_async_init: %s", uv_strerror(init_rc));
    return init_rc;
  }
  d->completion_async.data = d;

  /* The socket is bound and listening under a temporary name and then
   * renamed into place, so a worker that sees the path can connect at once
   * (bound but not yet listening, connect() would be refused). */
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  const char *path = d->options.socket_path;
  size_t len = strlen(path);
  if (len + 4 >= sizeof addr.sun_path) {
    snprintf(err, err_bytes, "socket path '%s' is longer than %zu bytes", path,
             sizeof addr.sun_path - 5);
    return -ENAMETOOLONG;
  }
  memcpy(addr.sun_path, path, len);
  memcpy(addr.sun_path + len, ".new", 5);
  const char *tmp = addr.sun_path;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(err, err_bytes, "socket: %s", strerror(errno));
    return -errno;
  }
  /* Files left by a daemon that died are replaced; the lock file in the
   * state directory (main.c) guarantees no live daemon owns them. */
  unlink(tmp);
  /* Bind under a umask so the file never exists with looser permissions. */
  mode_t old_umask = umask(d->options.socket_group[0] ? 0117 : 0177);
  int rc = bind(fd, (struct sockaddr *)&addr, sizeof addr);
  umask(old_umask);
  if (rc != 0) {
    int e = errno;
    snprintf(err, err_bytes, "bind %s: %s", tmp, strerror(e));
    close(fd);
    return -e;
  }
  const char *failed = NULL;
  if (d->options.socket_group[0]) {
    struct group *g = getgrnam(d->options.socket_group);
    if (g == NULL || chown(tmp, (uid_t)-1, g->gr_gid) != 0 || chmod(tmp, 0660) != 0) {
      snprintf(err, err_bytes, "socket group '%s': %s", d->options.socket_group,
               g == NULL ? "no such group" : strerror(errno));
      close(fd);
      unlink(tmp);
      return -EINVAL;
    }
  }
  if (listen(fd, 128) != 0)
    failed = "listen";
  else if (rename(tmp, path) != 0)
    failed = "rename";
  if (failed != NULL) {
    int e = errno;
    snprintf(err, err_bytes, "%s %s: %s", failed, path, strerror(e));
    close(fd);
    unlink(tmp);
    return -e;
  }
  init_rc = uv_poll_init(d->loop, &d->listen_poll, fd);
  if (init_rc != 0) {
    snprintf(err, err_bytes, "poll %s: %s", path, uv_strerror(init_rc));
    close(fd);
    unlink(path);
    return init_rc;
  }
  d->listen_fd = fd;
  d->listen_poll.data = d;
  uv_poll_start(&d->listen_poll, UV_READABLE, on_accept);
  return 0;
}

void ipc_close_all(zdaemon *d, const char *reason) {
  if (d->listen_fd >= 0) {
    uv_poll_stop(&d->listen_poll);
    uv_close((uv_handle_t *)&d->listen_poll, NULL);
    close(d->listen_fd);
    d->listen_fd = -1;
    unlink(d->options.socket_path);
  }
  while (d->sessions != NULL) {
    session *s = d->sessions;
    Zerod__V1__Notice notice = ZEROD__V1__NOTICE__INIT;
    notice.status = ZEROD__V1__STATUS__STATUS_UNAVAILABLE;
    notice.message = (char *)reason;
    ipc__send_message(s, ZEROD__V1__MSG_TYPE__MSG_NOTICE, 0, &notice.base);
    s->detaching = 1; /* told: not a lost worker */
    ipc__session_close(s, NULL);
  }
}
