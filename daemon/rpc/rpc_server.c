/* rpc_server: a gRPC server on a loop, its lifecycle (see rpc.h for the
 * contract): created with its methods and settings, started (its queue,
 * thread and listener), the listener restarted when gRPC closes it, shut
 * down in gRPC's order, destroyed.
 *
 * The server side of the rpc library owns the server's grpc_* objects:
 * the server, its completion queue and the thread that drains it
 * (rpc_queue.c), the per-call contexts and their byte buffers, slices and
 * metadata arrays (rpc_call.c); their types are in rpc_server_impl.h. The
 * helpers both sides share are rpc_common.c and rpc_credentials.c
 * (rpc_impl.h); the client side (channels, per-call pluck queues,
 * streams) is client.c. Nothing outside daemon/rpc/ includes grpc/grpc.h.
 *
 * Server threading. gRPC posts each finished batch to one completion queue.
 * Our queue thread pops them and appends the tag (an rpc_tag embedded in a
 * call context or in the server) to a locked intrusive list, then wakes the
 * loop with uv_async_send. The loop takes the whole list on each wakeup and
 * advances each call's state machine. Every grpc_call_start_batch and
 * grpc_server_request_call is made on the loop thread, so a call's state
 * needs no lock; only the list and the thread's exit flag are shared.
 *
 * Call lifetime. A call context lives while any batch it started is
 * outstanding (its tag not yet handled on the loop), while a user callback
 * runs, or while the handler owns it (handed to the handler and not yet
 * finished). The last of these to end frees it, so a late completion never
 * touches freed memory and the handler's pointer stays valid until
 * rpc_call_finish. */
#include "rpc.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include "admit.h"
#include "log.h"
#include "rpc_impl.h"
#include "rpc_server_impl.h"
#include "tls.h"
#include "tls_reload.h"

/* Requests kept armed with grpc_server_request_call: gRPC holds calls that
 * arrive with none armed in its own queue, so this only saves a loop
 * wakeup per call under bursts. */
#define RPC_ARMED_REQUESTS 4
/* How often a server checks that its listener still accepts, and retries
 * listening again after it had to stop (docs/security.md, "Exhaustion"). */
#define RPC_LISTENER_CHECK_MS 250

static void server_advance_shutdown(rpc_server *s);

/* ------------------------------------------------------------------------ */
/* Server: lifecycle                                                        */
/* ------------------------------------------------------------------------ */

/* The loop side of the hand-off: takes every queued event at once. */
static void on_wakeup(uv_async_t *handle) {
  rpc_server *s = handle->data;

  uv_mutex_lock(&s->lock);
  rpc_tag *tag = s->events_head;
  s->events_head = NULL;
  s->events_tail = NULL;
  uv_mutex_unlock(&s->lock);

  s->in_wakeup = 1;
  while (tag != NULL) {
    /* Read next first: handling the tag may free the call that holds it
     * (never one that holds a later tag, which is still outstanding). */
    rpc_tag *next = tag->next;
    tag->next = NULL;
    rpc__server_handle_event(s, tag);
    tag = next;
  }
  s->in_wakeup = 0;
  server_advance_shutdown(s);
}

static void on_handle_closed(uv_handle_t *handle) {
  rpc_server *s = handle->data;

  free(handle);
  if (s == NULL)
    return; /* a failed start: the server may be gone already */
  if (--s->closing_handles > 0)
    return;
  s->wakeup = NULL;
  s->listener_timer = NULL;
  s->state = SERVER_DONE;
  LOG_INFOF("rpc server stopped", "addr=%s", s->addr);
  if (s->done != NULL)
    s->done(s->done_arg); /* may destroy s */
}

static int server_listen(rpc_server *s, const char *addr, int *port, char *err, size_t err_bytes);

/* The old gRPC server is gone: listen on the same address and port again.
 * While descriptors are short this fails; the timer retries. */
static void server_rebind(rpc_server *s) {
  char err[256];
  int port = 0;
  int rc = server_listen(s, s->bound_addr, &port, err, sizeof err);
  if (rc == -EADDRINUSE) {
    LOG_WARNF("rpc server cannot listen again yet; retrying", "addr=%s err=\"%s\"", s->bound_addr,
              err);
    return;
  }
  if (rc != 0)
    LOG_ERRORF("rpc server listening again without a call requested", "addr=%s err=\"%s\"",
               s->bound_addr, err);
  LOG_WARNF("rpc server listening again", "addr=%s port=%d", s->bound_addr, port);
}

/* The listener timer: a listener that gRPC closed is replaced by a whole
 * new gRPC server on the same address (gRPC offers no way to re-open one
 * listener); calls in flight are cancelled on the way, and clients
 * reconnect. A server without a listener tries again each tick. */
static void on_listener_timer(uv_timer_t *timer) {
  rpc_server *s = timer->data;
  if (s->state == SERVER_DRAINING && s->cancel_deferred) {
    s->cancel_deferred = 0;
    if (s->server != NULL && !(s->shutdown_notified && s->live_calls == 0))
      grpc_server_cancel_all_calls(s->server);
    return;
  }
  if (s->state == SERVER_REBINDING) {
    server_rebind(s);
    return;
  }
  if (s->state == SERVER_RUNNING)
    rpc__sweep_awaiting(s);
  unsigned failures = rpc__accept_failures();
  if (failures == s->seen_accept_failures || s->state != SERVER_RUNNING)
    return;
  s->seen_accept_failures = failures;
  LOG_WARNF("rpc server stopped accepting connections (gRPC closed its listener); restarting it",
            "addr=%s calls=%u", s->bound_addr, s->live_calls);
  s->state = SERVER_RESTARTING;
  s->shutdown_notified = 0;
  grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
  grpc_server_cancel_all_calls(s->server);
}

/* Moves shutdown along as far as it can go now. The order is gRPC's:
 * every call and request finished and the shutdown tag seen, then the
 * server destroyed, then the queue shut down and drained by the thread,
 * then the thread joined and the queue destroyed. */
static void server_advance_shutdown(rpc_server *s) {
  if (s->state == SERVER_RESTARTING && s->shutdown_notified && s->live_calls == 0) {
    grpc_server_destroy(s->server); /* closes the dead listener */
    s->server = NULL;
    s->state = SERVER_REBINDING;
    server_rebind(s);
    return;
  }
  if (s->state == SERVER_DRAINING && s->shutdown_notified && s->live_calls == 0) {
    if (s->server != NULL)
      grpc_server_destroy(s->server);
    s->server = NULL;
    grpc_completion_queue_shutdown(s->cq);
    s->state = SERVER_CQ_CLOSING;
  }
  if (s->state == SERVER_CQ_CLOSING) {
    uv_mutex_lock(&s->lock);
    int exited = s->cq_thread_exited;
    uv_mutex_unlock(&s->lock);
    if (!exited)
      return; /* its last uv_async_send will bring us back */
    /* The thread has set the flag and is returning: this join is short. */
    uv_thread_join(&s->cq_thread);
    grpc_completion_queue_destroy(s->cq);
    s->cq = NULL;
    s->state = SERVER_CLOSING;
    s->closing_handles = 1;
    if (s->listener_timer != NULL) {
      s->closing_handles++;
      uv_close((uv_handle_t *)s->listener_timer, on_handle_closed);
    }
    uv_close((uv_handle_t *)s->wakeup, on_handle_closed);
  }
}

int rpc_server_create(uv_loop_t *loop, const char *addr, rpc_server **out, char *err,
                      size_t err_bytes) {
  *out = NULL;
  if (loop == NULL || addr == NULL || addr[0] == '\0') {
    snprintf(err, err_bytes, "rpc server: no loop or address");
    return -EINVAL;
  }
  if (strlen(addr) >= RPC_MAX_ADDR_BYTES) {
    snprintf(err, err_bytes, "rpc server: address longer than %d bytes", RPC_MAX_ADDR_BYTES - 1);
    return -ENAMETOOLONG;
  }
  /* gRPC binds the path of a unix: address ("unix:PATH" or
   * "unix://ABSOLUTE_PATH") as it is, so it must fit a sockaddr_un with its
   * NUL. Said here, with the limit, because gRPC's own refusal only comes
   * back from grpc_server_add_http2_port as "cannot listen". */
  const char *unix_path = NULL;
  if (strncmp(addr, "unix://", 7) == 0)
    unix_path = addr + 7;
  else if (strncmp(addr, "unix:", 5) == 0)
    unix_path = addr + 5;
  struct sockaddr_un unix_addr;
  if (unix_path != NULL && strlen(unix_path) >= sizeof unix_addr.sun_path) {
    snprintf(err, err_bytes, "rpc server: socket path '%s' is longer than %zu bytes", unix_path,
             sizeof unix_addr.sun_path - 1);
    return -ENAMETOOLONG;
  }
  rpc_server *s = calloc(1, sizeof(*s));
  if (s == NULL) {
    snprintf(err, err_bytes, "rpc server: out of memory");
    return -ENOMEM;
  }
  if (uv_mutex_init(&s->lock) != 0) {
    free(s);
    snprintf(err, err_bytes, "rpc server: cannot create a mutex");
    return -ENOMEM;
  }
  s->loop = loop;
  memcpy(s->addr, addr, strlen(addr) + 1);
  s->state = SERVER_CREATED;
  s->advance_shutdown = server_advance_shutdown;
  s->admit.limits = rpc__admit_limits();
  rpc__tag_init(&s->shutdown_tag, TAG_SHUTDOWN, NULL);
  rpc__grpc_init(); /* balanced in rpc_server_destroy */
  *out = s;
  return 0;
}

int rpc_server_add_method(rpc_server *s, const char *path, rpc_kind kind, rpc_handler handler,
                          void *arg) {
  if (s == NULL || path == NULL || handler == NULL || path[0] != '/')
    return -EINVAL;
  if (kind != RPC_UNARY && kind != RPC_SERVER_STREAM)
    return -EINVAL;
  if (s->state != SERVER_CREATED)
    return -EBUSY;
  size_t path_bytes = strlen(path);
  if (path_bytes >= RPC_MAX_PATH_BYTES)
    return -ENAMETOOLONG;
  for (unsigned i = 0; i < s->method_count; i++) {
    if (s->methods[i].path_bytes == path_bytes && memcmp(s->methods[i].path, path, path_bytes) == 0)
      return -EEXIST;
  }
  if (s->method_count == RPC_MAX_METHODS)
    return -ENOSPC;
  rpc_method *m = &s->methods[s->method_count++];
  memcpy(m->path, path, path_bytes + 1);
  m->path_bytes = path_bytes;
  m->kind = kind;
  m->handler = handler;
  m->arg = arg;
  return 0;
}

/* Creates the gRPC server on the queue, listening on addr, starts it and
 * arms requests; state becomes SERVER_RUNNING. Returns 0 with *port, or
 * -EADDRINUSE (nothing left behind: no gRPC server), or -EIO when not
 * even one request could be armed (the server runs; the caller shuts it
 * down). */
static int server_listen(rpc_server *s, const char *addr, int *port, char *err, size_t err_bytes) {
  grpc_arg args[9];
  size_t n_args;
  rpc__message_limit_args(args, &n_args);
  /* Without this, a second daemon on the same port would bind too and
   * steal half the connections. */
  rpc__arg_int(args, &n_args, GRPC_ARG_ALLOW_REUSEPORT, 0);
  rpc__arg_int(args, &n_args, GRPC_ARG_MAX_CONCURRENT_STREAMS, RPC_MAX_STREAMS_PER_CONNECTION);
  rpc__arg_int(args, &n_args, GRPC_ARG_KEEPALIVE_TIME_MS, RPC_KEEPALIVE_MS);
  rpc__arg_int(args, &n_args, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, RPC_KEEPALIVE_TIMEOUT_MS);
  /* Watch streams and waiting Gets send nothing for long stretches: the
   * server's pings must be allowed then too. */
  rpc__arg_int(args, &n_args, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  rpc__arg_int(args, &n_args, GRPC_ARG_MAX_CONNECTION_IDLE_MS, RPC_MAX_CONNECTION_IDLE_MS);
  grpc_channel_args channel_args = {.num_args = n_args, .args = args};

  s->server = grpc_server_create(&channel_args, NULL);
  grpc_server_register_completion_queue(s->server, s->cq, NULL);
  grpc_server_credentials *creds =
      s->creds != NULL ? s->creds : grpc_insecure_server_credentials_create();
  int bound_port = grpc_server_add_http2_port(s->server, addr, creds);
  if (creds != s->creds)
    grpc_server_credentials_release(creds);
  if (bound_port == 0) {
    snprintf(err, err_bytes, "rpc server: cannot listen on %s (in use, or a bad address)", addr);
    grpc_server_destroy(s->server); /* no listener was added */
    s->server = NULL;
    return -EADDRINUSE;
  }

  grpc_server_start(s->server);
  s->state = SERVER_RUNNING;
  for (int i = 0; i < RPC_ARMED_REQUESTS; i++) {
    if (rpc__server_arm_request(s) < 0 && i == 0) {
      snprintf(err, err_bytes, "rpc server %s: cannot request calls", addr);
      return -EIO;
    }
  }
  *port = bound_port;
  return 0;
}

void rpc_server_set_observer(rpc_server *s, rpc_observer fn, void *arg) {
  s->observer = fn;
  s->observer_arg = arg;
}

static rpc_method *server_method(rpc_server *s, const char *path) {
  size_t path_bytes = strlen(path);
  for (unsigned i = 0; i < s->method_count; i++) {
    if (s->methods[i].path_bytes == path_bytes && memcmp(s->methods[i].path, path, path_bytes) == 0)
      return &s->methods[i];
  }
  return NULL;
}

int rpc_server_set_priority(rpc_server *s, const char *path) {
  if (s == NULL || path == NULL)
    return -EINVAL;
  rpc_method *m = server_method(s, path);
  if (m == NULL)
    return -ENOENT;
  m->priority = 1;
  return 0;
}

int rpc_server_set_anonymous(rpc_server *s, const char *path) {
  if (s == NULL || path == NULL)
    return -EINVAL;
  rpc_method *m = server_method(s, path);
  if (m == NULL)
    return -ENOENT;
  m->anonymous = 1;
  return 0;
}

int rpc_server_set_identify(rpc_server *s, rpc_identify_fn fn, void *arg, size_t nprincipals) {
  if (s == NULL)
    return -EINVAL;
  if (s->state != SERVER_CREATED)
    return -EBUSY;
  int rc = admit_set_principals(&s->admit, nprincipals);
  if (rc != 0)
    return rc;
  s->identify = fn;
  s->identify_arg = arg;
  return 0;
}

int rpc_server_set_tls(rpc_server *s, const rpc_tls *tls, char *err, size_t err_bytes) {
  if (s == NULL || tls == NULL) {
    snprintf(err, err_bytes, "rpc server: no TLS settings");
    return -EINVAL;
  }
  if (s->state != SERVER_CREATED) {
    snprintf(err, err_bytes, "rpc server %s: TLS must be set before it starts", s->addr);
    return -EBUSY;
  }
  grpc_server_credentials *creds;
  tls_reload *reload;
  int rc = rpc__server_credentials(tls, &creds, &reload, err, err_bytes);
  if (rc != 0)
    return rc;
  if (s->creds != NULL)
    grpc_server_credentials_release(s->creds);
  tls_reload_free(s->tls_reload); /* nothing fetched through it: not started */
  s->creds = creds;
  s->tls_reload = reload;
  return 0;
}

int rpc_server_start(rpc_server *s, int *port, char *err, size_t err_bytes) {
  int rc;

  if (s == NULL) {
    snprintf(err, err_bytes, "rpc server: NULL");
    return -EINVAL;
  }
  if (s->state != SERVER_CREATED) {
    snprintf(err, err_bytes, "rpc server %s: already started", s->addr);
    return -EBUSY;
  }

  /* The queue, the wakeup handle and the thread come first, so that the
   * only failure once the server is bound is none at all: gRPC refuses to
   * destroy a server with listeners that was never shut down. */
  s->wakeup = malloc(sizeof(*s->wakeup));
  if (s->wakeup == NULL) {
    snprintf(err, err_bytes, "rpc server %s: out of memory", s->addr);
    return -ENOMEM;
  }
  rc = uv_async_init(s->loop, s->wakeup, on_wakeup);
  if (rc < 0) {
    free(s->wakeup);
    s->wakeup = NULL;
    snprintf(err, err_bytes, "rpc server %s: uv_async_init: %s", s->addr, uv_strerror(rc));
    return rc;
  }
  s->wakeup->data = s;
  s->cq = grpc_completion_queue_create_for_next(NULL);
  s->cq_thread_exited = 0;
  rc = uv_thread_create(&s->cq_thread, rpc__cq_thread_main, s);
  if (rc < 0) {
    snprintf(err, err_bytes, "rpc server %s: cannot start its thread: %s", s->addr,
             uv_strerror(rc));
    grpc_completion_queue_shutdown(s->cq);
    grpc_event ev;
    do {
      ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    } while (ev.type != GRPC_QUEUE_SHUTDOWN);
    goto fail_thread_not_started;
  }

  int bound_port = 0;
  rc = server_listen(s, s->addr, &bound_port, err, err_bytes);
  if (rc == -EADDRINUSE)
    goto fail_thread_started;
  if (rc != 0) {
    /* No armed request would make a server that never answers. Shut it
     * down properly; the caller's shutdown and destroy then complete. */
    rpc_server_shutdown(s, NULL, NULL);
    return -EIO;
  }
  /* Listening again after gRPC closed the listener must get the same
   * port, not another free one. */
  snprintf(s->bound_addr, sizeof s->bound_addr, "%s", s->addr);
  size_t addr_len = strlen(s->addr);
  if (strncmp(s->addr, "unix:", 5) != 0 && addr_len >= 2 &&
      strcmp(s->addr + addr_len - 2, ":0") == 0)
    snprintf(s->bound_addr, sizeof s->bound_addr, "%.*s:%d", (int)(addr_len - 2), s->addr,
             bound_port);
  s->seen_accept_failures = rpc__accept_failures();
  s->listener_timer = malloc(sizeof *s->listener_timer);
  int timer_rc = s->listener_timer != NULL ? uv_timer_init(s->loop, s->listener_timer) : 0;
  if (s->listener_timer != NULL && timer_rc == 0) {
    s->listener_timer->data = s;
    uv_timer_start(s->listener_timer, on_listener_timer, RPC_LISTENER_CHECK_MS,
                   RPC_LISTENER_CHECK_MS);
    uv_unref((uv_handle_t *)s->listener_timer); /* the server's calls keep the loop alive */
  } else if (s->listener_timer == NULL) {
    LOG_WARNF("rpc server without its listener check (out of memory)", "addr=%s", s->addr);
  } else {
    free(s->listener_timer);
    s->listener_timer = NULL;
    LOG_WARNF("rpc server without its listener check", "addr=%s err=\"%s\"", s->addr,
              uv_strerror(timer_rc));
  }
  if (port != NULL)
    *port = bound_port;
  LOG_INFOF("rpc server listening", "addr=%s port=%d methods=%u transport=%s", s->addr, bound_port,
            s->method_count, s->creds != NULL ? "tls" : "plain");
  return 0;

fail_thread_started:
  grpc_completion_queue_shutdown(s->cq);
  uv_thread_join(&s->cq_thread);
fail_thread_not_started:
  grpc_completion_queue_destroy(s->cq);
  s->cq = NULL;
  s->cq_thread_exited = 0;
  s->wakeup->data = NULL;
  uv_close((uv_handle_t *)s->wakeup, on_handle_closed);
  s->wakeup = NULL;
  return rc;
}

static void shutdown_server(rpc_server *s, int gently, void (*done)(void *arg), void *arg);

void rpc_server_shutdown(rpc_server *s, void (*done)(void *arg), void *arg) {
  shutdown_server(s, 0, done, arg);
}

void rpc_server_shutdown_gently(rpc_server *s, void (*done)(void *arg), void *arg) {
  shutdown_server(s, 1, done, arg);
}

static void shutdown_server(rpc_server *s, int gently, void (*done)(void *arg), void *arg) {
  if (s == NULL)
    return;
  switch (s->state) {
  case SERVER_CREATED:
    /* Never started: nothing to wait for. */
    s->state = SERVER_DONE;
    if (done != NULL)
      done(arg);
    return;
  case SERVER_RUNNING:
    s->done = done;
    s->done_arg = arg;
    s->state = SERVER_DRAINING;
    LOG_INFOF("rpc server shutting down", "addr=%s calls=%u", s->addr, s->live_calls);
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
    if (gently && s->listener_timer != NULL)
      s->cancel_deferred = 1; /* what finished lands first (on_listener_timer) */
    else
      grpc_server_cancel_all_calls(s->server);
    return;
  case SERVER_RESTARTING:
    /* gRPC is already shutting the old server down: wait for it as for a
     * shutdown. */
    s->done = done;
    s->done_arg = arg;
    s->state = SERVER_DRAINING;
    return;
  case SERVER_REBINDING:
    /* No gRPC server to shut down. */
    s->done = done;
    s->done_arg = arg;
    s->state = SERVER_DRAINING;
    s->shutdown_notified = 1;
    server_advance_shutdown(s);
    return;
  case SERVER_DONE:
    if (done != NULL)
      done(arg);
    return;
  default:
    if (s->done == NULL) {
      /* Shut down by a start that failed after binding (see rpc.h). */
      s->done = done;
      s->done_arg = arg;
      return;
    }
    LOG_WARNF("rpc server shutdown called twice", "addr=%s", s->addr);
    return;
  }
}

void rpc_server_destroy(rpc_server *s) {
  if (s == NULL)
    return;
  if (s->state != SERVER_CREATED && s->state != SERVER_DONE) {
    /* Freeing it now would free memory the queue thread and gRPC still
     * use; leaking it is the lesser harm. */
    LOG_ERRORF("rpc server destroyed before its shutdown finished; leaking it", "addr=%s", s->addr);
    return;
  }
  if (s->creds != NULL)
    grpc_server_credentials_release(s->creds);
  tls_reload_free(s->tls_reload);
  admit_free(&s->admit);
  uv_mutex_destroy(&s->lock);
  free(s);
  grpc_shutdown(); /* balances rpc_server_create */
}
