/* admit: which arriving calls a server takes in, before they hold anything
 * (docs/security.md, "Exhaustion"). Private to daemon/rpc/.
 *
 * A call is weighed when gRPC hands it to the server, with its headers
 * (credentials) but before its request message: a call whose request
 * never comes must not hold a slot it has not earned. The caller is
 * identified first (rpc_server_set_identify); then the call must fit
 *
 *   - its connection: RPC_MAX_STREAMS_PER_CONNECTION calls, counted here
 *     whatever the client did with the HTTP/2 SETTINGS that say so (a
 *     client that never acknowledges them is held to them all the same);
 *   - without credentials (a health check, the only call that needs none):
 *     a small budget of its own, per connection, per source address and in
 *     all, apart from the server's slots;
 *   - with them: its principal's cap, counted over every call of the
 *     principal from its arrival to its end, and the server's slots, of
 *     which priority methods (health, a node's heartbeat) have a reserve.
 *
 * What a call took is in its ticket, given back by admit_release when the
 * call is freed. An admitted call then waits for its request message in a
 * queue (admit_wait_*), from which the server ends the overdue ones; and
 * refusals are logged through a gate (admit_log_due), so that a flood of
 * them writes a line a second, not a line each. Everything runs on the
 * server's loop thread. */
#ifndef ZEROD_RPC_ADMIT_H
#define ZEROD_RPC_ADMIT_H

#include <stddef.h>
#include <stdint.h>

/* A table of counts by string key (a peer, an address); an entry exists
 * while its count is not zero. */
typedef struct admit_entry admit_entry;
typedef struct admit_counts {
  admit_entry **buckets;
  size_t nbuckets;
  size_t nentries;
} admit_counts;

/* The limits (rpc.h gives the server's: RPC_MAX_CALLS and the others). */
typedef struct admit_limits {
  unsigned calls;             /* calls with credentials in flight, in all */
  unsigned reserved_calls;    /* more for priority methods */
  unsigned per_principal;     /* calls of one principal */
  unsigned principal_reserve; /* more for its priority calls */
  unsigned per_connection;    /* calls on one connection */
  unsigned anonymous_per_connection, anonymous_per_address, anonymous;
} admit_limits;

/* A call waiting for its request message: a node of one of the two
 * queues below, kept in the call (intrusive). */
typedef struct admit_wait {
  struct admit_wait *prev, *next;
  uint64_t deadline_ns; /* by the caller's clock (uv_hrtime) */
  unsigned queue : 1;   /* which queue: 1 for calls without credentials */
  unsigned linked : 1;
} admit_wait;

/* Calls waiting for their request, oldest first. Every call of a queue
 * has the same time to wait, so the oldest is also the first overdue. */
typedef struct admit_wait_queue {
  admit_wait *head, *tail;
} admit_wait_queue;

/* When a refusal was last logged, and how many were not since. */
typedef struct admit_log_gate {
  uint64_t logged_ns;
  unsigned unlogged;
} admit_log_gate;

typedef struct admit_state {
  admit_limits limits;
  admit_counts connections;           /* calls in flight per peer ("ipv4:10.0.0.1:51234") */
  admit_counts anonymous_connections; /* of them, calls without credentials */
  admit_counts addresses;             /* calls without credentials per source address */
  unsigned *principal_calls;
  size_t nprincipals;
  unsigned admitted;           /* calls with credentials (or trusted) in flight */
  unsigned anonymous;          /* calls without credentials in flight */
  admit_wait_queue waiting[2]; /* [0]: with credentials; [1]: without */
  admit_log_gate refusals;
} admit_state;

/* What is known of a call when it arrives. */
typedef struct admit_request {
  const char *peer; /* as gRPC names it; "unix:..." is not counted per connection */
  int anonymous;    /* no credentials: the anonymous budget */
  long principal;   /* with credentials: the principal's index, or -1 (trusted, no cap) */
  const char *principal_name;
  int priority; /* the method may use the reserves */
} admit_request;

/* What an admitted call holds. */
typedef struct admit_ticket {
  long principal;
  unsigned connection : 1; /* counted in connections under its peer */
  unsigned anonymous : 1;  /* counted in addresses and anonymous */
  unsigned admitted : 1;   /* counted in admitted (and its principal's) */
} admit_ticket;

/* Sizes the per-principal counts (principals 0..n-1). Returns 0 or
 * -ENOMEM. Only while no call is admitted. */
int admit_set_principals(admit_state *a, size_t n);

/* Takes the call in: returns 0 with *ticket, or -EBUSY (over a limit,
 * which why names) or -ENOMEM (a count cannot be kept), with nothing
 * taken. */
int admit_call(admit_state *a, const admit_request *req, admit_ticket *ticket, char *why,
               size_t why_bytes);

/* Gives back what ticket holds; peer is the call's, as given to admit_call. */
void admit_release(admit_state *a, const char *peer, const admit_ticket *ticket);

/* Queues w (a call admitted with ticket, not yet queued) to wait for its
 * request until deadline_ns; without credentials it waits in the queue of
 * its kind, whose calls must all have the same time to wait. */
void admit_wait_start(admit_state *a, admit_wait *w, const admit_ticket *ticket,
                      uint64_t deadline_ns);
/* Takes w out of its queue (its request came, or the call ended); nothing
 * if it is in none. */
void admit_wait_stop(admit_state *a, admit_wait *w);
/* Takes the next call whose wait ended before now_ns out of its queue and
 * returns it, or NULL when there is none. */
admit_wait *admit_wait_overdue(admit_state *a, uint64_t now_ns);

/* Whether a refusal at now_ns may be logged: once per period_ns, with the
 * count of those not logged since in *unlogged. Counts it otherwise. */
int admit_log_due(admit_state *a, uint64_t now_ns, uint64_t period_ns, unsigned *unlogged);

/* The calls one peer has in flight (tests and logs). */
unsigned admit_connection_calls(const admit_state *a, const char *peer);

void admit_free(admit_state *a);

#endif /* ZEROD_RPC_ADMIT_H */
