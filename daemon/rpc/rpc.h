/* rpc: gRPC plumbing on the gRPC C core API (grpc/grpc.h), for the control
 * plane. Messages are opaque bytes here; callers pack and unpack them with
 * protobuf-c.
 *
 * Server. One completion queue, drained by one thread of ours that never
 * runs a handler: it pushes each completed event onto a locked queue and
 * wakes the libuv loop (uv_async_send); the loop drains the whole queue on
 * each wakeup and advances each call's state machine (the call context is
 * the tag). Handlers therefore run on the loop thread, with the daemon's
 * state, and answer then or later (a rendezvous Get that waits, a Watch
 * stream that sends for hours). Every rpc_call_* function must be called on
 * the loop thread.
 *
 * Client. Blocking calls, thread-safe, from any thread but the loop's: each
 * call has its own completion queue and a deadline. Server-streaming calls
 * are read one message at a time, blocking, by one thread; another thread
 * may cancel them. A loop follows a stream with rpc_follow (follow.c): a
 * thread of its own reads it and hands each message to the loop.
 *
 * Status codes are grpc_status_code values (0 OK, 3 INVALID_ARGUMENT,
 * 4 DEADLINE_EXCEEDED, 5 NOT_FOUND, 6 ALREADY_EXISTS, 9 FAILED_PRECONDITION,
 * 14 UNAVAILABLE, ...); RPC_* below name the ones zerod uses. */
#ifndef ZEROD_RPC_H
#define ZEROD_RPC_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "tls.h"

enum {
  RPC_OK = 0,
  RPC_CANCELLED = 1,
  RPC_UNKNOWN = 2,
  RPC_INVALID_ARGUMENT = 3,
  RPC_DEADLINE_EXCEEDED = 4,
  RPC_NOT_FOUND = 5,
  RPC_ALREADY_EXISTS = 6,
  RPC_PERMISSION_DENIED = 7,
  RPC_RESOURCE_EXHAUSTED = 8,
  RPC_FAILED_PRECONDITION = 9,
  RPC_ABORTED = 10,
  RPC_OUT_OF_RANGE = 11,
  RPC_UNIMPLEMENTED = 12,
  RPC_INTERNAL = 13,
  RPC_UNAVAILABLE = 14,
  RPC_DATA_LOSS = 15,
  RPC_UNAUTHENTICATED = 16,
};

/* Largest message either side sends or accepts (requests over it fail
 * with RESOURCE_EXHAUSTED before a handler sees them). */
#define RPC_MAX_MESSAGE_BYTES (4u << 20)

/* Admission (docs/security.md, "Exhaustion"). A call is weighed as it
 * arrives, with its credentials and before its request message, so that
 * a call that never sends one holds nothing it was not allowed.
 *
 * Calls with credentials (or trusted ones: rpc_server_set_identify) in
 * flight on one server: more are answered RESOURCE_EXHAUSTED at once,
 * except calls of priority methods (rpc_server_set_priority), which may
 * use RPC_RESERVED_CALLS more, so that health checks and node heartbeats
 * answer while others flood. */
#define RPC_MAX_CALLS      4096
#define RPC_RESERVED_CALLS 1024
/* Calls one principal may have in flight, counted from their arrival to
 * their end; its priority calls may use RPC_PRINCIPAL_RESERVED_CALLS more
 * (a node at its cap still heartbeats). */
#define RPC_MAX_CALLS_PER_PRINCIPAL  1024
#define RPC_PRINCIPAL_RESERVED_CALLS 64
/* Streams one client connection may have open at once. Said to clients
 * as HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS, which a gRPC client honours
 * by queueing the rest; counted and enforced here too, since a client
 * that never acknowledges the SETTINGS is not bound by them. Unix-socket
 * clients are not counted (every one has the same peer name). */
#define RPC_MAX_STREAMS_PER_CONNECTION 100
/* Calls without credentials (health checks) have a budget apart from the
 * slots above: per connection, per source address, in all. */
#define RPC_ANONYMOUS_CALLS_PER_CONNECTION 4
#define RPC_ANONYMOUS_CALLS_PER_ADDRESS    16
#define RPC_ANONYMOUS_CALLS                256
/* A call's request message must arrive within this long of its headers
 * (a client sends both at once), or the call ends DEADLINE_EXCEEDED. */
#define RPC_ANONYMOUS_REQUEST_MS 2000
#define RPC_REQUEST_MS           10000
/* The server pings a connection idle this long, and closes it when the
 * ping is not answered within RPC_KEEPALIVE_TIMEOUT_MS: a peer that
 * vanished (a node whose host died) does not hold its calls for ever. */
#define RPC_KEEPALIVE_MS         30000
#define RPC_KEEPALIVE_TIMEOUT_MS 10000
/* A connection with no call for this long is closed (a client that
 * connected and went quiet holds a descriptor for nothing); clients
 * reconnect on their next call. */
#define RPC_MAX_CONNECTION_IDLE_MS 300000

/* Returns the canonical name of a status code ("NOT_FOUND"), or "UNKNOWN". */
const char *rpc_status_name(int code);

/* ------------------------------------------------------------------------ */
/* Server                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct rpc_server rpc_server;
typedef struct rpc_call rpc_call;

typedef enum rpc_kind { RPC_UNARY, RPC_SERVER_STREAM } rpc_kind;

/* Called on the loop thread with the request message (valid only during the
 * call). A unary handler must eventually call rpc_call_finish exactly once.
 * A server-streaming handler sends with rpc_call_send and ends with
 * rpc_call_finish. A call the client cancels (or whose deadline passes, or
 * whose connection drops, or that the server's shutdown ends) gets its
 * cancel callback, if set, once, on the loop thread; the handler must then
 * still call rpc_call_finish (which is then a no-op that frees the call). */
typedef void (*rpc_handler)(rpc_call *call, const uint8_t *request, size_t request_bytes,
                            void *arg);
typedef void (*rpc_cancel_cb)(rpc_call *call, void *arg);

/* Creates a server that will listen on addr ("0.0.0.0:7070", "127.0.0.1:0"
 * for any free port, "unix:/path"). Plain (insecure) transport unless
 * rpc_server_set_tls is called before rpc_server_start. Returns 0 or a
 * negative errno with a message in err. */
int rpc_server_create(uv_loop_t *loop, const char *addr, rpc_server **out, char *err,
                      size_t err_bytes);

/* Registers a method by its full path ("/zerod.v1.Jobs/ListJobs"), before
 * rpc_server_start. Calls to unregistered methods get UNIMPLEMENTED. */
int rpc_server_add_method(rpc_server *s, const char *path, rpc_kind kind, rpc_handler handler,
                          void *arg);

/* Marks a registered method as one that must keep answering while other
 * clients flood the server (health checks, node heartbeats): its calls
 * may use RPC_RESERVED_CALLS calls beyond RPC_MAX_CALLS. */
int rpc_server_set_priority(rpc_server *s, const char *path);

/* Who a caller is, decided as its call arrives (before its request), by
 * the function given to rpc_server_set_identify: a principal's index
 * (0..nprincipals-1, counted against RPC_MAX_CALLS_PER_PRINCIPAL), or one
 * of these. A server without the function trusts every caller. */
#define RPC_PRINCIPAL_ANONYMOUS (-1) /* no credentials: the anonymous budget */
#define RPC_PRINCIPAL_TRUSTED   (-2) /* trusted (a Unix socket, no principals) */

/* Returns 0 with *principal (and its name in name, for messages), or a
 * status (UNAUTHENTICATED) and why in err, which refuses the call at
 * once. Runs on the loop thread; the call's metadata, transport and
 * method are readable (rpc_call_metadata, rpc_call_transport,
 * rpc_call_method_anonymous). */
typedef int (*rpc_identify_fn)(void *arg, const rpc_call *call, long *principal, char *name,
                               size_t name_bytes, char *err, size_t err_bytes);
/* Before rpc_server_start. Returns 0, -EBUSY after start, -ENOMEM. */
int rpc_server_set_identify(rpc_server *s, rpc_identify_fn fn, void *arg, size_t nprincipals);

/* Marks a registered method as one that a caller without credentials may
 * call (a health check): such a call is admitted within the anonymous
 * budget rather than refused. What counts is the identify function's
 * answer; this only lets it ask (rpc_call_method_anonymous). */
int rpc_server_set_anonymous(rpc_server *s, const char *path);

/* Called on the loop as each call ends: its method's full path, the status
 * it ended with (CANCELLED if the client went away; refusals when the
 * server is busy included) and the seconds since it arrived (metrics). */
typedef void (*rpc_observer)(void *arg, const char *method, int status, double seconds);
void rpc_server_set_observer(rpc_server *s, rpc_observer fn, void *arg);

/* Serves with TLS (mutual TLS with tls->ca_file and
 * tls->require_client_cert) instead of plain transport. Before
 * rpc_server_start. Returns 0 or a negative errno with a message in err
 * (an unreadable file, a missing key). */
int rpc_server_set_tls(rpc_server *s, const rpc_tls *tls, char *err, size_t err_bytes);

/* Binds, starts the completion-queue thread and begins accepting calls.
 * *port receives the bound port (useful with port 0). On failure the
 * server is as it was before (rpc_server_destroy, or shutdown then
 * destroy, both work); the one exception is -EIO, after binding, where
 * the caller must rpc_server_shutdown and wait for done as if it had
 * started. */
int rpc_server_start(rpc_server *s, int *port, char *err, size_t err_bytes);

/* Stops accepting calls and cancels every call in flight. Their cancel
 * callbacks run later, on the loop thread, after this returns; each
 * handler must still rpc_call_finish its calls. done(arg) runs on the loop
 * thread once every call has been finished and freed, gRPC's server is
 * destroyed and the completion-queue thread has exited. The loop must
 * keep running until then. After (or inside) done, rpc_server_destroy
 * frees the server. A server that never started calls done at once, from
 * inside this call. */
void rpc_server_shutdown(rpc_server *s, void (*done)(void *arg), void *arg);
/* The same, but calls in flight get up to a quarter of a second to end on
 * their own before they are cancelled: the last message of a call its
 * handler has just finished (a health Watch's NOT_SERVING) is sent rather
 * than dropped by the cancellation. */
void rpc_server_shutdown_gently(rpc_server *s, void (*done)(void *arg), void *arg);
void rpc_server_destroy(rpc_server *s);

/* Unary: send the reply (status RPC_OK) or an error status with a message.
 * Streaming: end the stream with a status (reply must be NULL). The reply
 * bytes are copied. Frees the call once gRPC is done with it: call is
 * invalid after this returns. */
void rpc_call_finish(rpc_call *call, int status, const char *message, const void *reply,
                     size_t reply_bytes);

/* Streaming: queues one message (copied). Messages go out in order, one
 * write in flight at a time. Returns 0, or -EPIPE once the call has been
 * cancelled, or -ENOBUFS when 64 messages already wait behind the one in
 * flight (a client that does not read), or -EMSGSIZE over
 * RPC_MAX_MESSAGE_BYTES, or -EINVAL on a unary call. A unary reply over
 * the limit becomes RESOURCE_EXHAUSTED for the client. */
int rpc_call_send(rpc_call *call, const void *message, size_t message_bytes);

/* The callback runs at most once, when the cancellation is seen; one set
 * after that never runs, so a handler that sets it late (not in the
 * handler itself) checks rpc_call_cancelled too. */
void rpc_call_set_cancel(rpc_call *call, rpc_cancel_cb cb, void *arg);
int rpc_call_cancelled(const rpc_call *call);

/* Milliseconds until the call's deadline (INT64_MAX if the client set
 * none; <= 0 if it has passed). */
int64_t rpc_call_remaining_ms(const rpc_call *call);

/* The peer's address as gRPC reports it ("ipv4:127.0.0.1:51234"). */
const char *rpc_call_peer(const rpc_call *call);

/* Whether the call's method may be called without credentials
 * (rpc_server_set_anonymous). */
int rpc_call_method_anonymous(const rpc_call *call);

/* The principal rpc_server_set_identify's function gave the call. */
long rpc_call_principal(const rpc_call *call);

/* How the call came in: over a Unix socket, over TCP in plain text, or
 * over TLS; and, over TLS, the subject common name of the client's
 * certificate, which gRPC has verified against the server's client CA
 * ("" when the client sent none). */
typedef enum rpc_transport {
  RPC_TRANSPORT_PLAIN = 0,
  RPC_TRANSPORT_UNIX = 1,
  RPC_TRANSPORT_TLS = 2,
} rpc_transport;
rpc_transport rpc_call_transport(const rpc_call *call);
const char *rpc_call_cert_name(const rpc_call *call);

/* Copies the value of the request metadata key (lower case, e.g.
 * "authorization") into out with a NUL. Returns its length, -ENOENT when
 * the call has no such key, -E2BIG when it does not fit, -EBADMSG when the
 * value holds a NUL byte. With several values, the first. */
int rpc_call_metadata(const rpc_call *call, const char *key, char *out, size_t out_bytes);

/* Marks the call for the audit log: when it is finished (or cancelled),
 * one line "audit" is logged with the method, who (a principal), what (the
 * object: "job=x"), the status and its message. who and what are copied. */
void rpc_call_audit(rpc_call *call, const char *who, const char *what);

/* fn(arg) runs once, on the loop thread, when the call is freed (after
 * rpc_call_finish, or after its cancellation). One per call; for
 * per-client accounting of calls in flight. */
void rpc_call_on_free(rpc_call *call, void (*fn)(void *arg), void *arg);

/* ------------------------------------------------------------------------ */
/* Client                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct rpc_channel rpc_channel;

/* target: "host:port" or "unix:PATH", plain transport, no credentials.
 * Returns 0 or a negative errno. The channel connects lazily; every call
 * may be made from any thread. Destroy it only after its calls have
 * returned and its streams are closed. */
int rpc_channel_create(const char *target, rpc_channel **out, char *err, size_t err_bytes);

typedef struct rpc_channel_options {
  const rpc_tls *tls; /* NULL: plain transport */
  /* Sent as "authorization: Bearer TOKEN" with every call; NULL or "":
   * none. At most RPC_MAX_TOKEN_BYTES of printable ASCII. */
  const char *token;
} rpc_channel_options;

/* As rpc_channel_create, with TLS and a bearer token (options may be
 * NULL). A TLS file that cannot be read fails here. */
int rpc_channel_create_with(const char *target, const rpc_channel_options *options,
                            rpc_channel **out, char *err, size_t err_bytes);
void rpc_channel_destroy(rpc_channel *ch);

/* The result of a call: status code, the server's message (or gRPC's own,
 * e.g. "Deadline Exceeded", "failed to connect to all addresses"). */
typedef struct rpc_result {
  int status;
  char message[512];
} rpc_result;

/* One unary call, blocking until the reply or timeout_ms (the call's
 * deadline, sent to the server; <= 0: none). On RPC_OK *reply is a malloc'd
 * buffer (caller frees; may be NULL when reply_bytes is 0). Returns the
 * status (also in result->status; result may be NULL). Bad arguments give
 * INVALID_ARGUMENT and a request over RPC_MAX_MESSAGE_BYTES
 * RESOURCE_EXHAUSTED, without a call. */
int rpc_unary(rpc_channel *ch, const char *method, const void *request, size_t request_bytes,
              int timeout_ms, uint8_t **reply, size_t *reply_bytes, rpc_result *result);

typedef struct rpc_stream rpc_stream;

/* Starts a server-streaming call. timeout_ms <= 0: no deadline. Returns 0
 * or a negative errno (the call's status, if it failed at once, comes from
 * rpc_stream_read). */
int rpc_stream_open(rpc_channel *ch, const char *method, const void *request, size_t request_bytes,
                    int timeout_ms, rpc_stream **out);

/* Blocks for the next message: returns 1 with a malloc'd *message, or 0 at
 * the end of the stream with the final status in *result (RPC_OK for a
 * clean end, RPC_CANCELLED after rpc_stream_cancel, RPC_UNAVAILABLE when
 * the server went away, ...). */
int rpc_stream_read(rpc_stream *st, uint8_t **message, size_t *message_bytes, rpc_result *result);

/* From any thread: makes a blocked or later rpc_stream_read return 0 with
 * RPC_CANCELLED. */
void rpc_stream_cancel(rpc_stream *st);

/* Frees the stream (cancelling it first if it has not ended). Not while
 * another thread is in rpc_stream_read. */
void rpc_stream_close(rpc_stream *st);

/* ------------------------------------------------------------------------ */
/* Streams followed on a loop                                               */
/* ------------------------------------------------------------------------ */

/* A server-streaming call read by a thread of its own (named thread_name,
 * for top -H), each message handed to the loop thread: on_message(ctx,
 * bytes, len) for every message in order (the bytes are the follower's,
 * valid during the call), then on_end(ctx, result) once when the stream
 * ends (result->status RPC_OK for a clean end, RPC_UNAVAILABLE when the
 * server went away, ...). The follower frees itself after on_end; the
 * caller forgets it then. Only the loop thread calls these functions. */
typedef struct rpc_follower rpc_follower;
typedef void (*rpc_follow_message_fn)(void *ctx, const uint8_t *bytes, size_t len);
typedef void (*rpc_follow_end_fn)(void *ctx, const rpc_result *result);

/* Opens the stream and starts its thread. Returns 0 or a negative errno
 * (nothing is called back then). */
int rpc_follow(uv_loop_t *loop, rpc_channel *ch, const char *method, const void *request,
               size_t request_bytes, const char *thread_name, rpc_follow_message_fn on_message,
               rpc_follow_end_fn on_end, void *ctx, rpc_follower **out);

/* Cancels a follower whose on_end has not been called: joins its thread
 * (which ends at once) and frees it once its handle has closed. Nothing is
 * called back after it returns, not even on_end. */
void rpc_follow_stop(rpc_follower *f);

/* gRPC's library init/shutdown are reference counted by rpc_server_create/
 * rpc_channel_create and their destroy functions; nothing to call. */

#endif /* ZEROD_RPC_H */
