/* bench_control: control-plane latency against a bare gRPC call.
 *
 * One gRPC server (daemon/rpc/) on a loop thread serves the coordinator's
 * services (coord.c) and a bare echo method side by side; one client thread
 * times, over the same channel, in the same run:
 *   - the echo (an empty handler: the cost of gRPC itself),
 *   - Cluster/Heartbeat of a joined node reporting one job,
 *   - Rendezvous/Get of a present key (64 bytes, as a Gloo address),
 *   - Rendezvous/Put then a waiting Get from a second thread (the hand-off).
 * Prints one JSON line per measurement with the median latency and its ratio
 * to the echo's median. Everything runs twice, each time with a fresh
 * coordinator: with no principals ("auth":"none"), and with a principals
 * file and the calls made with a node's bearer token ("auth":"token"),
 * which each call's identification (a SHA-256) and authorization cost. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_util.h"
#include "coord.h"
#include "digest.h"
#include "rpc.h"
#include "zerod/v1/control.pb-c.h"

#define ITERS 2000

static uv_loop_t loop;
static uv_async_t stop_async;
static rpc_server *server;
static coord *coordinator;

static void echo(rpc_call *call, const uint8_t *req, size_t len, void *arg) {
  (void)arg;
  rpc_call_finish(call, RPC_OK, NULL, req, len);
}

static void on_done(void *arg) {
  (void)arg;
}

static void on_stop(uv_async_t *h) {
  coord_shutdown(coordinator);
  rpc_server_shutdown(server, on_done, NULL);
  uv_close((uv_handle_t *)h, NULL);
}

static void *loop_main(void *arg) {
  (void)arg;
  uv_run(&loop, UV_RUN_DEFAULT);
  return NULL;
}

static uint8_t *pack(const ProtobufCMessage *m, size_t *len) {
  *len = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = malloc(*len ? *len : 1);
  if (buf != NULL)
    protobuf_c_message_pack(m, buf);
  return buf;
}

static int call(rpc_channel *ch, const char *method, const uint8_t *req, size_t len) {
  uint8_t *reply = NULL;
  size_t reply_len = 0;
  rpc_result r;
  int status = rpc_unary(ch, method, req, len, 10000, &reply, &reply_len, &r);
  if (status != RPC_OK)
    fprintf(stderr, "bench_control: %s: %s: %s\n", method, rpc_status_name(status), r.message);
  free(reply);
  return status;
}

/* Median latency in microseconds of ITERS calls. */
static double time_calls(rpc_channel *ch, const char *method, const uint8_t *req, size_t len) {
  static double t[ITERS];
  for (int i = 0; i < 50; i++)
    if (call(ch, method, req, len) != RPC_OK)
      exit(1);
  for (int i = 0; i < ITERS; i++) {
    double t0 = bench_now_s();
    if (call(ch, method, req, len) != RPC_OK)
      exit(1);
    t[i] = bench_now_s() - t0;
  }
  return bench_median(t, ITERS) * 1e6;
}

typedef struct waiter {
  rpc_channel *ch;
  uint8_t *req;
  size_t len;
  double done_at;
} waiter;

static void *wait_get(void *arg) {
  waiter *w = arg;
  call(w->ch, "/zerod.v1.Rendezvous/Get", w->req, w->len);
  w->done_at = bench_now_s();
  return NULL;
}

/* The authenticated run's principals: the node the timed calls act as,
 * and an admin that creates the job. */
#define BENCH_TOKEN       "bench-node-token-0123456789"
#define BENCH_ADMIN_TOKEN "bench-admin-token-0123456789"

static int measure(int with_auth) {
  char err[512] = "";
  char dir[] = "/tmp/zerod-bench-control-XXXXXX";
  if (mkdtemp(dir) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  const char *label = with_auth ? "token" : "none";
  uv_loop_init(&loop);
  coord_options co = {.lease_ttl_ms = 60000};
  snprintf(co.state_dir, sizeof co.state_dir, "%s", dir);
  char principals[PATH_MAX];
  snprintf(principals, sizeof principals, "%s/principals", dir);
  if (with_auth) {
    char node_hash[DIGEST_HEX_BYTES], admin_hash[DIGEST_HEX_BYTES];
    digest_sha256_hex(BENCH_TOKEN, node_hash);
    digest_sha256_hex(BENCH_ADMIN_TOKEN, admin_hash);
    FILE *f = fopen(principals, "w");
    if (f == NULL) {
      perror(principals);
      return 1;
    }
    fprintf(f, "bench-node node - token-sha256:%s\nops admin - token-sha256:%s\n", node_hash,
            admin_hash);
    fclose(f);
    snprintf(co.auth_file, sizeof co.auth_file, "%s", principals);
  }
  int port = 0;
  if (coord_create(&loop, &co, &coordinator, err, sizeof err) != 0 ||
      rpc_server_create(&loop, "127.0.0.1:0", &server, err, sizeof err) != 0 ||
      coord_register(coordinator, server) != 0 ||
      rpc_server_add_method(server, "/bench.Echo/Echo", RPC_UNARY, echo, NULL) != 0 ||
      rpc_server_start(server, &port, err, sizeof err) != 0) {
    fprintf(stderr, "bench_control: %s\n", err);
    return 1;
  }
  uv_async_init(&loop, &stop_async, on_stop);
  pthread_t loop_thread;
  pthread_create(&loop_thread, NULL, loop_main, NULL);

  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", port);
  rpc_channel *ch;
  rpc_channel_options options = {.token = with_auth ? BENCH_TOKEN : NULL};
  if (rpc_channel_create_with(target, &options, &ch, err, sizeof err) != 0) {
    fprintf(stderr, "bench_control: %s\n", err);
    return 1;
  }

  /* A node joins and a job is created on it. */
  Zerod__V1__NodeInfo info = ZEROD__V1__NODE_INFO__INIT;
  info.name = "bench-node";
  info.address = "127.0.0.1";
  info.ranks = 1;
  Zerod__V1__JoinRequest join = ZEROD__V1__JOIN_REQUEST__INIT;
  join.node = &info;
  size_t len;
  uint8_t *req = pack(&join.base, &len), *reply = NULL;
  size_t reply_len = 0;
  rpc_result r;
  if (rpc_unary(ch, "/zerod.v1.Cluster/Join", req, len, 10000, &reply, &reply_len, &r) != RPC_OK) {
    fprintf(stderr, "bench_control: join: %s\n", r.message);
    return 1;
  }
  free(req);
  Zerod__V1__JoinReply *jr = zerod__v1__join_reply__unpack(NULL, reply_len, reply);
  free(reply);
  uint64_t session = jr->session;
  zerod__v1__join_reply__free_unpacked(jr, NULL);
  /* The job is made by an admin (a node may not create jobs). */
  rpc_channel *admin_ch;
  rpc_channel_options admin_options = {.token = with_auth ? BENCH_ADMIN_TOKEN : NULL};
  if (rpc_channel_create_with(target, &admin_options, &admin_ch, err, sizeof err) != 0) {
    fprintf(stderr, "bench_control: %s\n", err);
    return 1;
  }
  Zerod__V1__CreateJobRequest create = ZEROD__V1__CREATE_JOB_REQUEST__INIT;
  create.name = "bench";
  create.nodes = 1;
  create.ranks_per_node = 1;
  req = pack(&create.base, &len);
  if (call(admin_ch, "/zerod.v1.Jobs/CreateJob", req, len) != RPC_OK)
    return 1;
  free(req);
  rpc_channel_destroy(admin_ch);

  uint8_t payload[64];
  memset(payload, 0xab, sizeof payload);
  double echo_us = time_calls(ch, "/bench.Echo/Echo", payload, sizeof payload);
  printf("{\"bench\":\"control\",\"auth\":\"%s\",\"call\":\"echo\",\"median_us\":%.1f,"
         "\"ratio\":1.00}\n",
         label, echo_us);

  Zerod__V1__JobStatus status = ZEROD__V1__JOB_STATUS__INIT;
  status.job = "bench";
  status.ready = 1;
  Zerod__V1__JobStatus *statuses[] = {&status};
  Zerod__V1__HeartbeatRequest hb = ZEROD__V1__HEARTBEAT_REQUEST__INIT;
  hb.node = "bench-node";
  hb.session = session;
  hb.n_jobs = 1;
  hb.jobs = statuses;
  req = pack(&hb.base, &len);
  double hb_us = time_calls(ch, "/zerod.v1.Cluster/Heartbeat", req, len);
  free(req);
  printf("{\"bench\":\"control\",\"auth\":\"%s\",\"call\":\"heartbeat\",\"median_us\":%.1f,"
         "\"ratio\":%.2f}\n",
         label, hb_us, hb_us / echo_us);

  Zerod__V1__PutRequest put = ZEROD__V1__PUT_REQUEST__INIT;
  put.job = "bench";
  put.key = "rank/0";
  put.value.data = payload;
  put.value.len = sizeof payload;
  req = pack(&put.base, &len);
  if (call(ch, "/zerod.v1.Rendezvous/Put", req, len) != RPC_OK)
    return 1;
  free(req);
  Zerod__V1__GetRequest get = ZEROD__V1__GET_REQUEST__INIT;
  get.job = "bench";
  get.key = "rank/0";
  req = pack(&get.base, &len);
  double get_us = time_calls(ch, "/zerod.v1.Rendezvous/Get", req, len);
  free(req);
  printf("{\"bench\":\"control\",\"auth\":\"%s\",\"call\":\"rendezvous_get\",\"median_us\":%.1f,"
         "\"ratio\":%.2f}\n",
         label, get_us, get_us / echo_us);

  /* Hand-off: a Get waits for a key; the Put that sets it releases it. The
   * time is from the Put's start to the Get's return. */
  static double t[200];
  for (int i = 0; i < 200; i++) {
    char key[32];
    snprintf(key, sizeof key, "wait/%d", i);
    get.key = key;
    get.wait = 1;
    waiter w = {.ch = ch};
    w.req = pack(&get.base, &w.len);
    pthread_t th;
    pthread_create(&th, NULL, wait_get, &w);
    usleep(2000); /* let the Get arrive and wait */
    put.key = key;
    req = pack(&put.base, &len);
    double t0 = bench_now_s();
    call(ch, "/zerod.v1.Rendezvous/Put", req, len);
    pthread_join(th, NULL);
    t[i] = w.done_at - t0;
    free(req);
    free(w.req);
  }
  double handoff_us = bench_median(t, 200) * 1e6;
  printf("{\"bench\":\"control\",\"auth\":\"%s\",\"call\":\"rendezvous_put_to_waiting_get\","
         "\"median_us\":%.1f,\"ratio\":%.2f}\n",
         label, handoff_us, handoff_us / echo_us);

  rpc_channel_destroy(ch);
  uv_async_send(&stop_async);
  pthread_join(loop_thread, NULL);
  rpc_server_destroy(server);
  coord_destroy(coordinator);
  uv_loop_close(&loop);
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/coordinator.pb", dir);
  unlink(path);
  snprintf(path, sizeof path, "%s/coordinator.pb.tmp", dir);
  unlink(path);
  unlink(principals);
  rmdir(dir);
  return 0;
}

int main(void) {
  int rc = measure(0);
  if (rc == 0)
    rc = measure(1);
  return rc;
}
