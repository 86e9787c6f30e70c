/* Server streams followed on a loop (see rpc.h, "Streams followed on a
 * loop"): a thread of the follower's own blocks in rpc_stream_read and
 * hands each message to the loop through a locked queue and a uv_async;
 * the loop drains the whole queue on each wakeup and calls the caller's
 * functions. This file is the whole hand-over: the reading thread's side
 * (read_main, push) and the loop's (on_async, rpc_follow_stop). */
#include "rpc.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* One message from the reading thread, or the end of the stream. */
typedef struct follow_msg {
  struct follow_msg *next;
  uint8_t *bytes;
  size_t len;
  int end;
  rpc_result result;
} follow_msg;

struct rpc_follower {
  rpc_stream *stream;
  pthread_t thread;
  rpc_follow_message_fn on_message;
  rpc_follow_end_fn on_end;
  void *ctx;
  char thread_name[16];

  pthread_mutex_t mutex; /* the queue */
  follow_msg *head, *tail;
  uv_async_t async;
  int stopped; /* loop-owned: no callback any more */
};

static void free_msgs(follow_msg *m) {
  while (m != NULL) {
    follow_msg *next = m->next;
    free(m->bytes);
    free(m);
    m = next;
  }
}

/* ---- The reading thread ---------------------------------------------------- */

static void push(rpc_follower *f, follow_msg *m) {
  pthread_mutex_lock(&f->mutex);
  if (f->tail != NULL)
    f->tail->next = m;
  else
    f->head = m;
  f->tail = m;
  pthread_mutex_unlock(&f->mutex);
  uv_async_send(&f->async);
}

static void *read_main(void *arg) {
  rpc_follower *f = arg;
  pthread_setname_np(pthread_self(), f->thread_name);
  for (;;) {
    follow_msg *m = calloc(1, sizeof *m);
    if (m == NULL) {
      usleep(10000); /* out of memory: the message waits in gRPC meanwhile */
      continue;
    }
    if (rpc_stream_read(f->stream, &m->bytes, &m->len, &m->result) == 1) {
      push(f, m);
      continue;
    }
    m->end = 1;
    push(f, m);
    return NULL;
  }
}

/* ---- The loop ---------------------------------------------------------------- */

static void on_closed(uv_handle_t *h) {
  rpc_follower *f = h->data;
  free_msgs(f->head);
  pthread_mutex_destroy(&f->mutex);
  free(f);
}

/* The thread has ended or been told to: joins it and lets go of the stream
 * and the handle (the follower is freed once the handle has closed). */
static void finish(rpc_follower *f) {
  f->stopped = 1;
  pthread_join(f->thread, NULL);
  rpc_stream_close(f->stream);
  f->stream = NULL;
  uv_close((uv_handle_t *)&f->async, on_closed);
}

static void on_async(uv_async_t *h) {
  rpc_follower *f = h->data;
  if (f->stopped)
    return;
  pthread_mutex_lock(&f->mutex);
  follow_msg *m = f->head;
  f->head = f->tail = NULL;
  pthread_mutex_unlock(&f->mutex);
  while (m != NULL) {
    follow_msg *next = m->next;
    m->next = NULL;
    if (!m->end) {
      f->on_message(f->ctx, m->bytes, m->len);
      if (f->stopped) { /* on_message stopped it: nothing more is called */
        free_msgs(next);
        free_msgs(m);
        return;
      }
    } else {
      /* The last message: after on_end the follower is gone. */
      rpc_result result = m->result;
      free_msgs(next);
      free_msgs(m);
      rpc_follow_end_fn on_end = f->on_end;
      void *ctx = f->ctx;
      finish(f);
      on_end(ctx, &result);
      return;
    }
    free_msgs(m);
    m = next;
  }
}

int rpc_follow(uv_loop_t *loop, rpc_channel *ch, const char *method, const void *request,
               size_t request_bytes, const char *thread_name, rpc_follow_message_fn on_message,
               rpc_follow_end_fn on_end, void *ctx, rpc_follower **out) {
  rpc_follower *f = calloc(1, sizeof *f);
  if (f == NULL)
    return -ENOMEM;
  f->on_message = on_message;
  f->on_end = on_end;
  f->ctx = ctx;
  snprintf(f->thread_name, sizeof f->thread_name, "%s", thread_name);
  int rc = rpc_stream_open(ch, method, request, request_bytes, 0, &f->stream);
  if (rc != 0) {
    free(f);
    return rc;
  }
  pthread_mutex_init(&f->mutex, NULL);
  rc = uv_async_init(loop, &f->async, on_async);
  if (rc != 0) {
    rpc_stream_close(f->stream);
    pthread_mutex_destroy(&f->mutex);
    free(f);
    return rc;
  }
  f->async.data = f;
  rc = pthread_create(&f->thread, NULL, read_main, f);
  if (rc != 0) {
    /* The handle's memory must live until it has closed: on_closed frees. */
    f->stopped = 1;
    rpc_stream_close(f->stream);
    f->stream = NULL;
    uv_close((uv_handle_t *)&f->async, on_closed);
    return -rc;
  }
  *out = f;
  return 0;
}

void rpc_follow_stop(rpc_follower *f) {
  if (f == NULL)
    return;
  rpc_stream_cancel(f->stream);
  finish(f);
}
