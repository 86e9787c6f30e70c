/* The rendezvous KV (coord_impl.h): (job, epoch, key) -> bytes, soft state,
 * with Gets that wait until their key is set or their deadline passes. The
 * ranks of a job build their communicators through it (Put, Get, Delete of
 * the Rendezvous service); a job's keys and waiting Gets go with the job.
 *
 * Limits (coord_impl.h): COORD_MAX_KV_BYTES and COORD_MAX_KV_KEYS over
 * every job, COORD_MAX_WAITERS Gets waiting at once. Loop thread only. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "coord_impl.h"
#include "ctl_decode.h"

static size_t kv_cost(size_t key_bytes, size_t value_bytes) {
  return key_bytes + value_bytes + COORD_KV_KEY_OVERHEAD;
}

static void kv_free_entry(coord *c, kv_entry *e) {
  c->kv_bytes -= kv_cost(strlen(e->key), e->value_bytes);
  c->kv_keys--;
  free(e->key);
  free(e->value);
  free(e);
}

void coord__kv_clear(coord *c, cjob *j) {
  while (j->kv != NULL) {
    kv_entry *e = j->kv;
    j->kv = e->next;
    kv_free_entry(c, e);
  }
}

void coord__kv_job_freed(coord *c, cjob *j) {
  coord__kv_clear(c, j);
  coord__kv_waiters_end(j, RPC_NOT_FOUND, "the job is gone");
}

static kv_entry **kv_find(cjob *j, uint64_t epoch, const char *key) {
  for (kv_entry **p = &j->kv; *p != NULL; p = &(*p)->next)
    if ((*p)->epoch == epoch && strcmp((*p)->key, key) == 0)
      return p;
  return NULL;
}

/* Finds a job that rendezvous may use, or answers NOT_FOUND. */
static cjob *rendezvous_job(coord *c, rpc_call *call, const char *name) {
  cjob *j = coord__find_job(c, name);
  if (j == NULL || j->deleting) {
    if (j != NULL)
      coord__finish_error(call, RPC_NOT_FOUND, "job '%s' is being deleted", name);
    else
      coord__finish_error(call, RPC_NOT_FOUND, "no job named '%s'", name);
    return NULL;
  }
  return j;
}

static void finish_value(rpc_call *call, const kv_entry *e) {
  Zerod__V1__GetReply reply = ZEROD__V1__GET_REPLY__INIT;
  reply.value.data = e->value;
  reply.value.len = e->value_bytes;
  coord__finish_message(call, &reply.base);
}

static void waiter_unlink(kv_waiter *w) {
  for (kv_waiter **p = &w->job->waiters; *p != NULL; p = &(*p)->next) {
    if (*p == w) {
      *p = w->next;
      break;
    }
  }
  w->coord->nwaiters--;
}

static void waiter_free(kv_waiter *w) {
  free(w->key);
  free(w);
}

/* Ends every waiting Get of j with status. */
void coord__kv_waiters_end(cjob *j, int status, const char *message) {
  while (j->waiters != NULL) {
    kv_waiter *w = j->waiters;
    waiter_unlink(w);
    rpc_call_set_cancel(w->call, NULL, NULL);
    rpc_call_finish(w->call, status, message, NULL, 0);
    waiter_free(w);
  }
}

static void on_waiter_cancelled(rpc_call *call, void *arg) {
  kv_waiter *w = arg;
  waiter_unlink(w);
  waiter_free(w);
  /* gRPC has already ended the call (its deadline passed, or the client
   * went away): this only frees it. */
  rpc_call_finish(call, rpc_call_remaining_ms(call) <= 0 ? RPC_DEADLINE_EXCEEDED : RPC_CANCELLED,
                  "rendezvous wait ended", NULL, 0);
}

static void on_put(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__PutRequest *req = coord__begin(c, call, CTL_PUT, request, request_bytes);
  if (req == NULL)
    return;
  cjob *j = rendezvous_job(c, call, req->job);
  if (j == NULL)
    goto out;
  size_t key_bytes = strlen(req->key);
  kv_entry **found = kv_find(j, req->epoch, req->key);
  kv_entry *e = found != NULL ? *found : NULL;
  size_t old_cost = e != NULL ? kv_cost(key_bytes, e->value_bytes) : 0;
  size_t new_total = c->kv_bytes - old_cost + kv_cost(key_bytes, req->value.len);
  if (new_total > COORD_MAX_KV_BYTES) {
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED,
                        "rendezvous store is full (%zu of %u bytes used; this key needs %zu)",
                        c->kv_bytes, COORD_MAX_KV_BYTES, kv_cost(key_bytes, req->value.len));
    goto out;
  }
  if (e == NULL && c->kv_keys >= COORD_MAX_KV_KEYS) {
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "rendezvous store holds %d keys (at most %d)",
                        COORD_MAX_KV_KEYS, COORD_MAX_KV_KEYS);
    goto out;
  }
  uint8_t *value = NULL;
  if (req->value.len != 0 && (value = malloc(req->value.len)) == NULL) {
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
    goto out;
  }
  if (req->value.len != 0)
    memcpy(value, req->value.data, req->value.len);
  if (e == NULL) {
    e = calloc(1, sizeof *e);
    char *key = strdup(req->key);
    if (e == NULL || key == NULL) {
      free(e);
      free(key);
      free(value);
      coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
      goto out;
    }
    e->key = key;
    e->epoch = req->epoch;
    e->next = j->kv;
    j->kv = e;
    c->kv_keys++;
  } else {
    free(e->value);
  }
  e->value = value;
  e->value_bytes = req->value.len;
  c->kv_bytes = new_total;

  /* Release the Gets waiting for this key. */
  kv_waiter **p = &j->waiters;
  while (*p != NULL) {
    kv_waiter *w = *p;
    if (w->epoch != e->epoch || strcmp(w->key, e->key) != 0) {
      p = &w->next;
      continue;
    }
    waiter_unlink(w);
    rpc_call_set_cancel(w->call, NULL, NULL);
    finish_value(w->call, e);
    waiter_free(w);
  }
  Zerod__V1__PutReply reply = ZEROD__V1__PUT_REPLY__INIT;
  coord__finish_message(call, &reply.base);
out:
  ctl_free(&req->base);
}

static void on_get(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__GetRequest *req = coord__begin(c, call, CTL_GET, request, request_bytes);
  if (req == NULL)
    return;
  cjob *j = rendezvous_job(c, call, req->job);
  if (j == NULL)
    goto out;
  kv_entry **found = kv_find(j, req->epoch, req->key);
  if (found != NULL) {
    finish_value(call, *found);
    goto out;
  }
  if (!req->wait) {
    coord__finish_error(call, RPC_NOT_FOUND, "key '%s' is not set (job '%s', epoch %" PRIu64 ")",
                        req->key, req->job, req->epoch);
    goto out;
  }
  if (rpc_call_remaining_ms(call) <= 0) {
    coord__finish_error(call, RPC_DEADLINE_EXCEEDED, "deadline passed before key '%s' was set",
                        req->key);
    goto out;
  }
  if (c->nwaiters >= COORD_MAX_WAITERS) {
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "%d Gets are already waiting (at most %d)",
                        COORD_MAX_WAITERS, COORD_MAX_WAITERS);
    goto out;
  }
  kv_waiter *w = calloc(1, sizeof *w);
  char *key = strdup(req->key);
  if (w == NULL || key == NULL) {
    free(w);
    free(key);
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
    goto out;
  }
  w->coord = c;
  w->job = j;
  w->call = call;
  w->epoch = req->epoch;
  w->key = key;
  w->next = j->waiters;
  j->waiters = w;
  c->nwaiters++;
  rpc_call_set_cancel(call, on_waiter_cancelled, w);
out:
  ctl_free(&req->base);
}

static void on_delete(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__DeleteRequest *req = coord__begin(c, call, CTL_DELETE, request, request_bytes);
  if (req == NULL)
    return;
  cjob *j = rendezvous_job(c, call, req->job);
  if (j != NULL) {
    uint32_t deleted = 0;
    size_t key_bytes = strlen(req->key);
    kv_entry **p = &j->kv;
    while (*p != NULL) {
      kv_entry *e = *p;
      int match = e->epoch == req->epoch && (req->prefix ? strncmp(e->key, req->key, key_bytes) == 0
                                                         : strcmp(e->key, req->key) == 0);
      if (!match) {
        p = &e->next;
        continue;
      }
      *p = e->next;
      kv_free_entry(c, e);
      deleted++;
    }
    Zerod__V1__DeleteReply reply = ZEROD__V1__DELETE_REPLY__INIT;
    reply.deleted = deleted;
    coord__finish_message(call, &reply.base);
  }
  ctl_free(&req->base);
}

int coord__kv_register(coord *c, rpc_server *server) {
  static const coord_method methods[] = {
      {CTL_PUT, RPC_UNARY, on_put},
      {CTL_GET, RPC_UNARY, on_get},
      {CTL_DELETE, RPC_UNARY, on_delete},
  };
  return coord__add_methods(c, server, methods, sizeof methods / sizeof methods[0]);
}
