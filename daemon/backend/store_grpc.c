/* store_grpc.c - the rendezvous store (store.h) of a node daemon in a
 * cluster: the coordinator's Rendezvous service over gRPC (rpc.h).
 *
 * Keys arrive as "<job>/<epoch>/<rest>" (the communicator prefix that
 * rank/session.c builds, then Gloo's own key) and are sent as the namespaced
 * (job, epoch, key) triple the service stores them under, so that deleting
 * a job on the coordinator deletes its keys too.
 *
 * Every call is a blocking gRPC call made from a rank's executor thread;
 * rpc_unary is thread-safe. A coordinator that is briefly unreachable
 * (restarting) is retried until the caller's deadline. */
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "log.h"
#include "rpc.h"
#include "store.h"
#include "zerod/v1/control.pb-c.h"

/* A Put or Delete that the coordinator does not answer within this fails
 * the rendezvous (and with it the communicator's creation). */
#define STORE_GRPC_CALL_MS  10000
#define STORE_GRPC_RETRY_MS 200
/* Waits are cut into calls of at most this, so that a stopping daemon is
 * noticed between them (store_grpc_stop) instead of at the deadline. */
#define STORE_GRPC_SLICE_MS 1000

typedef struct store_grpc {
  store base; /* first, so a store * is a store_grpc * */
  rpc_channel *channel;
  _Atomic int stopping;
} store_grpc;

/* A store key split into the Rendezvous namespace: "<job>/<epoch>/<rest>". */
typedef struct ns_key {
  char job[65]; /* job names are 1..64 bytes */
  uint64_t epoch;
  const char *rest; /* points into the caller's key */
} ns_key;

static int split_key(const char *full, ns_key *k) {
  const char *slash = strchr(full, '/');
  size_t job_len = slash != NULL ? (size_t)(slash - full) : 0;
  if (job_len == 0 || job_len >= sizeof k->job)
    return -EINVAL;
  memcpy(k->job, full, job_len);
  k->job[job_len] = '\0';
  char *end;
  errno = 0;
  unsigned long long e = strtoull(slash + 1, &end, 10);
  if (errno != 0 || end == slash + 1 || (*end != '/' && *end != '\0'))
    return -EINVAL;
  k->epoch = e;
  k->rest = *end == '/' ? end + 1 : end;
  return 0;
}

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
}

static int status_errno(int status) {
  switch (status) {
  case RPC_OK:
    return 0;
  case RPC_DEADLINE_EXCEEDED:
    return -ETIMEDOUT;
  case RPC_NOT_FOUND:
    return -ENOENT;
  case RPC_INVALID_ARGUMENT:
    return -EINVAL;
  case RPC_RESOURCE_EXHAUSTED:
    return -ENOSPC;
  case RPC_UNAVAILABLE:
    return -EAGAIN;
  default:
    return -EIO;
  }
}

/* Makes one call, retrying UNAVAILABLE (and a wait's slice running out)
 * until deadline_ms (monotonic) or store_grpc_stop. reply NULL: the reply
 * is dropped. */
static int call(store_grpc *s, const char *method, const ProtobufCMessage *req, int64_t deadline_ms,
                uint8_t **reply, size_t *reply_bytes) {
  size_t len = protobuf_c_message_get_packed_size(req);
  uint8_t *buf = malloc(len ? len : 1);
  if (buf == NULL)
    return -ENOMEM;
  protobuf_c_message_pack(req, buf);
  int rc;
  for (;;) {
    int64_t left = deadline_ms - clock_now_ms();
    if (left <= 0) {
      rc = -ETIMEDOUT;
      break;
    }
    if (atomic_load(&s->stopping)) {
      rc = -ECANCELED;
      break;
    }
    int slice = left > STORE_GRPC_SLICE_MS ? STORE_GRPC_SLICE_MS : (int)left;
    rpc_result result;
    uint8_t *got = NULL;
    size_t got_bytes = 0;
    rc = status_errno(rpc_unary(s->channel, method, buf, len, slice, &got, &got_bytes, &result));
    if (reply != NULL && rc == 0) {
      *reply = got;
      *reply_bytes = got_bytes;
    } else {
      free(got);
    }
    if (rc == -ETIMEDOUT && slice < left)
      continue; /* a wait's slice ran out: ask again */
    if (rc != -EAGAIN)
      break;
    LOG_DEBUGF("rendezvous retry", "method=%s status=%s", method, rpc_status_name(result.status));
    sleep_ms(STORE_GRPC_RETRY_MS);
  }
  free(buf);
  return rc;
}

static int grpc_set(store *st, const char *key, const void *value, size_t value_bytes) {
  ns_key k;
  int rc = split_key(key, &k);
  if (rc != 0)
    return rc;
  Zerod__V1__PutRequest req = ZEROD__V1__PUT_REQUEST__INIT;
  req.job = k.job;
  req.epoch = k.epoch;
  req.key = (char *)k.rest;
  req.value.data = (uint8_t *)value;
  req.value.len = value_bytes;
  return call((store_grpc *)st, "/zerod.v1.Rendezvous/Put", &req.base,
              clock_now_ms() + STORE_GRPC_CALL_MS, NULL, NULL);
}

static int grpc_get(store *st, const char *key, void **value, size_t *value_bytes, int timeout_ms) {
  ns_key k;
  int rc = split_key(key, &k);
  if (rc != 0)
    return rc;
  Zerod__V1__GetRequest req = ZEROD__V1__GET_REQUEST__INIT;
  req.job = k.job;
  req.epoch = k.epoch;
  req.key = (char *)k.rest;
  req.wait = timeout_ms != 0;
  uint8_t *reply = NULL;
  size_t reply_bytes = 0;
  int64_t deadline =
      timeout_ms < 0 ? INT64_MAX / 2 : clock_now_ms() + (timeout_ms > 0 ? timeout_ms : 1000);
  rc =
      call((store_grpc *)st, "/zerod.v1.Rendezvous/Get", &req.base, deadline, &reply, &reply_bytes);
  if (rc != 0)
    return rc;
  Zerod__V1__GetReply *r = zerod__v1__get_reply__unpack(NULL, reply_bytes, reply);
  free(reply);
  if (r == NULL)
    return -EPROTO;
  *value = malloc(r->value.len ? r->value.len : 1);
  if (*value != NULL) {
    memcpy(*value, r->value.data, r->value.len);
    *value_bytes = r->value.len;
  }
  zerod__v1__get_reply__free_unpacked(r, NULL);
  return *value != NULL ? 0 : -ENOMEM;
}

static int grpc_delete_prefix(store *st, const char *prefix) {
  ns_key k;
  int rc = split_key(prefix, &k);
  if (rc != 0)
    return rc;
  Zerod__V1__DeleteRequest req = ZEROD__V1__DELETE_REQUEST__INIT;
  req.job = k.job;
  req.epoch = k.epoch;
  req.key = (char *)k.rest;
  req.prefix = 1;
  return call((store_grpc *)st, "/zerod.v1.Rendezvous/Delete", &req.base,
              clock_now_ms() + STORE_GRPC_CALL_MS, NULL, NULL);
}

static void grpc_destroy(store *st) {
  free(st);
}

static const store_ops grpc_ops = {
    .set = grpc_set,
    .get = grpc_get,
    .delete_prefix = grpc_delete_prefix,
    .destroy = grpc_destroy,
};

void store_grpc_stop(store *st) {
  atomic_store(&((store_grpc *)st)->stopping, 1);
}

int store_grpc_create(rpc_channel *channel, store **out) {
  store_grpc *s = calloc(1, sizeof *s);
  if (s == NULL)
    return -ENOMEM;
  s->base.ops = &grpc_ops;
  s->channel = channel;
  *out = &s->base;
  return 0;
}
