/* follow: the loop's side of mirrors (follow.h): the list, the attaches
 * that wait for a mirror's first version, and stopping mirrors no session
 * uses. The threads are follow_fetch.c's. */
#include "follow.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "daemon.h"
#include "log.h"
#include "reader.h"

#include "follow_impl.h"
#include "ipc_impl.h"

/* How often the loop looks for mirrors to stop or free. */
#define FOLLOW_SWEEP_MS 1000

typedef struct follow_env {
  zdaemon *d;
  mirror *mirrors;
  uv_async_t wake;
  uv_timer_t sweep;
  int stopping;
} follow_env;

/* Answers a waiting attach: with the mirror's job, or with its failure. */
static void resume(follow_waiter *w, mirror *m) {
  Zerod__V1__AttachRequest *req =
      zerod__v1__attach_request__unpack(NULL, w->packed_bytes, w->packed);
  session *s = w->s;
  s->attach_pending = 0;
  if (!s->closing && req != NULL) {
    if (m != NULL && atomic_load(&m->state) == MIRROR_READY)
      w->resume(s, w->request_id, w->flags, req, m->j, 0, NULL);
    else
      w->resume(s, w->request_id, w->flags, req, NULL,
                m != NULL ? m->status : ZEROD__V1__STATUS__STATUS_UNAVAILABLE,
                m != NULL ? m->message : "zerod is shutting down");
  }
  if (req != NULL)
    zerod__v1__attach_request__free_unpacked(req, NULL);
  free(w->packed);
  free(w);
  ipc__session_unref(s);
}

static void resume_all(mirror *m) {
  while (m->waiters != NULL) {
    follow_waiter *w = m->waiters;
    m->waiters = w->next;
    resume(w, m);
  }
}

/* Stops a mirror's thread and waits for it (it ends within one WATCH of
 * its connection being shut down). */
static void join(mirror *m) {
  atomic_store(&m->stop, 1);
  int fd = atomic_load(&m->fd);
  if (fd >= 0)
    shutdown(fd, SHUT_RDWR);
  if (m->thread_started && !m->joined) {
    pthread_join(m->thread, NULL);
    m->joined = 1;
  }
}

/* A state the thread reached (the waiting attaches are answered), or a
 * version it installed (the node's waiting watches are looked at now, not
 * at their next tick: nothing of the mirror hands ops back to the loop). */
static void on_wake(uv_async_t *handle) {
  follow_env *env = handle->data;
  reader_poll_watches(&env->d->readers);
  for (mirror *m = env->mirrors; m != NULL; m = m->next) {
    mirror_state state = atomic_load(&m->state);
    if (state == m->seen)
      continue;
    m->seen = state;
    resume_all(m);
  }
}

/* Mirrors no session uses for FOLLOW_IDLE_MS are stopped, failed ones
 * freed once their sessions are gone. */
static void on_sweep(uv_timer_t *timer) {
  follow_env *env = timer->data;
  uint64_t now = uv_now(timer->loop);
  for (mirror **link = &env->mirrors; *link != NULL;) {
    mirror *m = *link;
    int state = atomic_load(&m->state);
    int readers = m->j != NULL && state != MIRROR_STARTING ? m->j->readers : 0;
    if (state == MIRROR_STARTING || readers > 0 || m->waiters != NULL) {
      m->idle_since_ms = 0;
      link = &m->next;
      continue;
    }
    if (m->idle_since_ms == 0)
      m->idle_since_ms = now;
    if (state == MIRROR_READY && now - m->idle_since_ms < FOLLOW_IDLE_MS) {
      link = &m->next;
      continue;
    }
    LOG_INFOF("stopped following a job", "job=%s reason=\"%s\"", m->name,
              state == MIRROR_READY ? "no session used it" : m->message);
    join(m);
    *link = m->next;
    follow__mirror_free(m);
  }
}

int follow_init(zdaemon *d) {
  follow_env *env = calloc(1, sizeof *env);
  if (env == NULL)
    return -ENOMEM;
  env->d = d;
  uv_async_init(d->loop, &env->wake, on_wake);
  env->wake.data = env;
  uv_timer_init(d->loop, &env->sweep);
  env->sweep.data = env;
  uv_timer_start(&env->sweep, on_sweep, FOLLOW_SWEEP_MS, FOLLOW_SWEEP_MS);
  uv_unref((uv_handle_t *)&env->sweep);
  d->follow = env;
  return 0;
}

/* A live mirror of name for this token, or NULL. */
static mirror *find(follow_env *env, const char *name, const char *token_sha256) {
  for (mirror *m = env->mirrors; m != NULL; m = m->next)
    if (atomic_load(&m->state) != MIRROR_FAILED && !atomic_load(&m->stop) &&
        strcmp(m->name, name) == 0 && digest_hex_equal(m->token_sha256, token_sha256))
      return m;
  return NULL;
}

static mirror *start(zdaemon *d, follow_env *env, const Zerod__V1__AttachRequest *req,
                     const char *token_sha256) {
  mirror *m = calloc(1, sizeof *m);
  if (m == NULL)
    return NULL;
  m->d = d;
  snprintf(m->name, sizeof m->name, "%s", req->job);
  snprintf(m->token, sizeof m->token, "%s", req->token);
  memcpy(m->token_sha256, token_sha256, sizeof m->token_sha256);
  m->wake = &env->wake;
  atomic_init(&m->state, MIRROR_STARTING);
  atomic_init(&m->stop, 0);
  atomic_init(&m->fd, -1);
  m->seen = MIRROR_STARTING;
  if (pthread_create(&m->thread, NULL, follow__main, m) != 0) {
    free(m);
    return NULL;
  }
  m->thread_started = 1;
  m->next = env->mirrors;
  env->mirrors = m;
  LOG_INFOF("following a job from another node", "job=%s", m->name);
  return m;
}

/* Parks an attach on m until its first version. */
static int park(mirror *m, session *s, uint64_t request_id, uint8_t flags,
                const Zerod__V1__AttachRequest *req, follow_resume_fn fn) {
  follow_waiter *w = calloc(1, sizeof *w);
  size_t bytes = zerod__v1__attach_request__get_packed_size(req);
  uint8_t *packed = w != NULL ? malloc(bytes ? bytes : 1) : NULL;
  if (packed == NULL) {
    free(w);
    return -ENOMEM;
  }
  zerod__v1__attach_request__pack(req, packed);
  *w = (follow_waiter){.next = m->waiters,
                       .s = s,
                       .request_id = request_id,
                       .flags = flags,
                       .packed = packed,
                       .packed_bytes = bytes,
                       .resume = fn};
  m->waiters = w;
  s->refs++;
  s->attach_pending = 1;
  return 0;
}

int follow_attach(zdaemon *d, session *s, uint64_t request_id, uint8_t flags,
                  const Zerod__V1__AttachRequest *req, follow_resume_fn fn) {
  follow_env *env = d->follow;
  if (env == NULL || d->control_channel == NULL || d->coord != NULL)
    return -ENOTSUP;
  char token_sha256[DIGEST_HEX_BYTES];
  digest_sha256_hex(req->token, token_sha256);
  mirror *m = find(env, req->job, token_sha256);
  if (m == NULL && !env->stopping)
    m = start(d, env, req, token_sha256);
  if (m == NULL) {
    fn(s, request_id, flags, req, NULL, ZEROD__V1__STATUS__STATUS_UNAVAILABLE,
       env->stopping ? "zerod is shutting down" : "cannot start following the job");
    return 0;
  }
  m->idle_since_ms = 0;
  if (atomic_load(&m->state) == MIRROR_READY && m->seen == MIRROR_READY) {
    fn(s, request_id, flags, req, m->j, 0, NULL);
    return 0;
  }
  if (park(m, s, request_id, flags, req, fn) != 0)
    fn(s, request_id, flags, req, NULL, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
       "out of memory");
  return 0;
}

void follow_stop(zdaemon *d) {
  follow_env *env = d->follow;
  if (env == NULL || env->stopping)
    return;
  env->stopping = 1;
  for (mirror *m = env->mirrors; m != NULL; m = m->next)
    join(m);
  for (mirror *m = env->mirrors; m != NULL; m = m->next) {
    m->seen = atomic_load(&m->state);
    resume_all(m);
  }
  uv_timer_stop(&env->sweep);
  uv_close((uv_handle_t *)&env->wake, NULL);
  uv_close((uv_handle_t *)&env->sweep, NULL);
}

void follow_free(zdaemon *d) {
  follow_env *env = d->follow;
  if (env == NULL)
    return;
  while (env->mirrors != NULL) {
    mirror *m = env->mirrors;
    env->mirrors = m->next;
    follow__mirror_free(m);
  }
  free(env);
  d->follow = NULL;
}
