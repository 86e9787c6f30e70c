/* The server's admission of arriving calls (daemon/rpc/admit.c), on its
 * own: each test fills one limit exactly, checks that the next call is
 * refused with a message naming the limit, and that giving one call back
 * lets the next one in. The same limits, reached over gRPC by real
 * clients, are tests/integration/test_admission.py. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "admit.h"
#include "rpc.h"
#include "rpc_impl.h"

/* The server's limits, as every rpc server has them. */
static void init_state(admit_state *a) {
  memset(a, 0, sizeof *a);
  a->limits = rpc__admit_limits();
}

typedef struct held {
  char peer[64];
  admit_ticket ticket;
} held;

/* Admits a call or fails the test, saying why it was refused. */
static void must_admit(admit_state *a, const admit_request *req, held *out) {
  char why[256] = "";
  int status = admit_call(a, req, &out->ticket, why, sizeof why);
  if (status != 0)
    fail_msg("expected %s (principal %ld) to be admitted, got %d: %s", req->peer, req->principal,
             status, why);
  snprintf(out->peer, sizeof out->peer, "%s", req->peer);
}

static void must_refuse(admit_state *a, const admit_request *req, const char *part) {
  char why[256] = "";
  admit_ticket ticket;
  int status = admit_call(a, req, &ticket, why, sizeof why);
  if (status != -EBUSY)
    fail_msg("expected %s to be refused (%s), got status %d", req->peer, part, status);
  if (strstr(why, part) == NULL)
    fail_msg("expected the refusal to say '%s', got '%s'", part, why);
}

static void release_all(admit_state *a, held *calls, size_t n) {
  for (size_t i = 0; i < n; i++)
    admit_release(a, calls[i].peer, &calls[i].ticket);
}

static void test_connection_holds_at_most_its_streams(void **state) {
  (void)state;
  admit_state a;
  init_state(&a);
  assert_int_equal(admit_set_principals(&a, 2), 0);
  held calls[RPC_MAX_STREAMS_PER_CONNECTION];
  admit_request req = {.peer = "ipv4:10.0.0.1:5000", .principal = 0, .principal_name = "alice"};
  for (int i = 0; i < RPC_MAX_STREAMS_PER_CONNECTION; i++)
    must_admit(&a, &req, &calls[i]);
  must_refuse(&a, &req, "connection ipv4:10.0.0.1:5000 has 100 calls in flight (at most 100)");
  /* Another connection of the same client, another principal: in. */
  held other;
  admit_request other_req = {.peer = "ipv4:10.0.0.1:5001", .principal = 1, .principal_name = "b"};
  must_admit(&a, &other_req, &other);
  admit_release(&a, calls[0].peer, &calls[0].ticket);
  must_admit(&a, &req, &calls[0]);
  assert_int_equal(admit_connection_calls(&a, req.peer), RPC_MAX_STREAMS_PER_CONNECTION);
  release_all(&a, calls, RPC_MAX_STREAMS_PER_CONNECTION);
  admit_release(&a, other.peer, &other.ticket);
  assert_int_equal(admit_connection_calls(&a, req.peer), 0);
  assert_int_equal(a.admitted, 0);
  assert_int_equal(a.principal_calls[0], 0);
  admit_free(&a);
}

/* Every Unix-socket client has the peer "unix:": not counted per
 * connection, so the socket's clients are bounded by the server's slots. */
static void test_unix_peers_are_not_counted_per_connection(void **state) {
  (void)state;
  admit_state a;
  init_state(&a);
  enum { N = 3 * RPC_MAX_STREAMS_PER_CONNECTION };
  held *calls = calloc(N, sizeof *calls);
  admit_request req = {.peer = "unix:", .principal = -1};
  for (int i = 0; i < N; i++)
    must_admit(&a, &req, &calls[i]);
  release_all(&a, calls, N);
  assert_int_equal(a.admitted, 0);
  free(calls);
  admit_free(&a);
}

static void test_principal_cap_counts_every_call_with_a_reserve(void **state) {
  (void)state;
  admit_state a;
  init_state(&a);
  assert_int_equal(admit_set_principals(&a, 2), 0);
  enum { CAP = RPC_MAX_CALLS_PER_PRINCIPAL, RESERVE = RPC_PRINCIPAL_RESERVED_CALLS };
  held *calls = calloc(CAP + RESERVE, sizeof *calls);
  admit_request req = {.principal = 0, .principal_name = "node-a"};
  char peers[CAP / RPC_MAX_STREAMS_PER_CONNECTION + 2][32];
  for (int i = 0; i < CAP; i++) {
    snprintf(peers[i / RPC_MAX_STREAMS_PER_CONNECTION], sizeof peers[0], "ipv4:10.0.0.2:%d",
             6000 + i / RPC_MAX_STREAMS_PER_CONNECTION);
    req.peer = peers[i / RPC_MAX_STREAMS_PER_CONNECTION];
    must_admit(&a, &req, &calls[i]);
  }
  req.peer = "ipv4:10.0.0.2:7000";
  must_refuse(&a, &req, "principal node-a has 1024 calls in flight (at most 1024)");
  /* Its heartbeats and health checks still go through, up to the reserve. */
  req.priority = 1;
  for (int i = 0; i < RESERVE; i++)
    must_admit(&a, &req, &calls[CAP + i]);
  must_refuse(&a, &req, "principal node-a has 1088 calls in flight");
  /* Another principal is not held back by this one's calls. */
  held other;
  admit_request other_req = {.peer = "ipv4:10.0.0.3:1", .principal = 1, .principal_name = "bob"};
  must_admit(&a, &other_req, &other);
  admit_release(&a, other.peer, &other.ticket);
  release_all(&a, calls, CAP + RESERVE);
  assert_int_equal(a.principal_calls[0], 0);
  assert_int_equal(a.admitted, 0);
  free(calls);
  admit_free(&a);
}

static void test_anonymous_budget_per_connection_address_and_in_all(void **state) {
  (void)state;
  admit_state a;
  init_state(&a);
  enum {
    PER_CONN = RPC_ANONYMOUS_CALLS_PER_CONNECTION,
    PER_ADDR = RPC_ANONYMOUS_CALLS_PER_ADDRESS
  };
  held calls[RPC_ANONYMOUS_CALLS];
  admit_request req = {.peer = "ipv4:10.0.0.9:100", .anonymous = 1};
  for (int i = 0; i < PER_CONN; i++)
    must_admit(&a, &req, &calls[i]);
  must_refuse(&a, &req, "has 4 calls without credentials in flight (at most 4)");
  /* Calls with credentials on the same connection are not anonymous ones. */
  held named;
  admit_request named_req = {.peer = req.peer, .principal = -1};
  must_admit(&a, &named_req, &named);
  /* More connections from the same address: up to the address's budget. */
  char peers[PER_ADDR][32];
  int n = PER_CONN;
  for (int conn = 1; n < PER_ADDR; conn++) {
    snprintf(peers[conn], sizeof peers[0], "ipv4:10.0.0.9:%d", 100 + conn);
    req.peer = peers[conn];
    for (int i = 0; i < PER_CONN && n < PER_ADDR; i++)
      must_admit(&a, &req, &calls[n++]);
  }
  req.peer = "ipv4:10.0.0.9:999";
  must_refuse(&a, &req,
              "ipv4:10.0.0.9 has 16 calls without credentials in flight (at most 16 "
              "per address)");
  /* The server's own slots are untouched: every admitted count is the one
   * call with credentials. */
  assert_int_equal(a.admitted, 1);
  assert_int_equal(a.anonymous, PER_ADDR);
  /* Other addresses fill the budget in all. */
  char more[RPC_ANONYMOUS_CALLS][40];
  for (int i = 0; n < RPC_ANONYMOUS_CALLS; i++) {
    snprintf(more[i], sizeof more[0], "ipv6:[fd00::%x]:443", i);
    req.peer = more[i];
    must_admit(&a, &req, &calls[n++]);
  }
  req.peer = "ipv4:10.9.9.9:1";
  must_refuse(&a, &req, "256 calls without credentials in flight (at most 256)");
  admit_release(&a, calls[0].peer, &calls[0].ticket);
  must_admit(&a, &req, &calls[0]);
  release_all(&a, calls, RPC_ANONYMOUS_CALLS);
  admit_release(&a, named.peer, &named.ticket);
  assert_int_equal(a.anonymous, 0);
  assert_int_equal(a.admitted, 0);
  assert_int_equal(a.addresses.nentries, 0);
  assert_int_equal(a.connections.nentries, 0);
  admit_free(&a);
}

static void test_server_slots_keep_a_reserve_for_priority_calls(void **state) {
  (void)state;
  admit_state a;
  init_state(&a);
  enum { ALL = RPC_MAX_CALLS + RPC_RESERVED_CALLS };
  held *calls = calloc(ALL, sizeof *calls);
  admit_request req = {.principal = -1};
  char(*peers)[32] = calloc(ALL / RPC_MAX_STREAMS_PER_CONNECTION + 1, sizeof *peers);
  for (int i = 0; i < ALL; i++) {
    int conn = i / RPC_MAX_STREAMS_PER_CONNECTION;
    snprintf(peers[conn], sizeof peers[0], "ipv4:10.1.%d.%d:9", conn / 200, conn % 200);
    req.peer = peers[conn];
    req.priority = i >= RPC_MAX_CALLS;
    if (i == RPC_MAX_CALLS)
      must_refuse(&a, &(admit_request){.peer = "ipv4:10.2.0.1:1", .principal = -1},
                  "server busy: 4096 calls in flight");
    must_admit(&a, &req, &calls[i]);
  }
  req.peer = "ipv4:10.2.0.2:1";
  must_refuse(&a, &req, "server busy: 5120 calls in flight");
  release_all(&a, calls, ALL);
  assert_int_equal(a.admitted, 0);
  free(peers);
  free(calls);
  admit_free(&a);
}

/* The two queues of calls waiting for their request: each gives up its
 * overdue calls oldest first, a call taken out early never comes back,
 * and calls of the other queue are not held up by this one's. */
static void test_waiting_calls_end_when_overdue_in_order(void **state) {
  (void)state;
  admit_state a;
  init_state(&a);
  admit_ticket with = {.admitted = 1}, without = {.anonymous = 1};
  admit_wait w[4] = {{0}};
  admit_wait_start(&a, &w[0], &with, 1000);
  admit_wait_start(&a, &w[1], &without, 300);
  admit_wait_start(&a, &w[2], &with, 1100);
  admit_wait_start(&a, &w[3], &with, 1200);
  admit_wait_stop(&a, &w[2]); /* its request came */
  assert_null(admit_wait_overdue(&a, 299));
  assert_ptr_equal(admit_wait_overdue(&a, 300), &w[1]);
  assert_null(admit_wait_overdue(&a, 999));
  assert_ptr_equal(admit_wait_overdue(&a, 5000), &w[0]);
  assert_ptr_equal(admit_wait_overdue(&a, 5000), &w[3]);
  assert_null(admit_wait_overdue(&a, 5000));
  for (int i = 0; i < 4; i++)
    assert_int_equal(w[i].linked, 0);
  admit_wait_stop(&a, &w[0]); /* a second stop is nothing */
  admit_free(&a);
}

/* Refusals: the first of each period is logged, with the count of those
 * that were not since the last one logged. */
static void test_refusals_are_logged_once_a_period(void **state) {
  (void)state;
  admit_state a;
  init_state(&a);
  unsigned unlogged = 99;
  assert_true(admit_log_due(&a, 5000, 1000, &unlogged));
  assert_int_equal(unlogged, 0);
  assert_false(admit_log_due(&a, 5001, 1000, &unlogged));
  assert_false(admit_log_due(&a, 5999, 1000, &unlogged));
  assert_true(admit_log_due(&a, 6000, 1000, &unlogged));
  assert_int_equal(unlogged, 2);
  assert_true(admit_log_due(&a, 9000, 1000, &unlogged));
  assert_int_equal(unlogged, 0);
  admit_free(&a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_connection_holds_at_most_its_streams),
      cmocka_unit_test(test_unix_peers_are_not_counted_per_connection),
      cmocka_unit_test(test_principal_cap_counts_every_call_with_a_reserve),
      cmocka_unit_test(test_anonymous_budget_per_connection_address_and_in_all),
      cmocka_unit_test(test_server_slots_keep_a_reserve_for_priority_calls),
      cmocka_unit_test(test_waiting_calls_end_when_overdue_in_order),
      cmocka_unit_test(test_refusals_are_logged_once_a_period),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
