/* rpc_server_impl: the server side's internals, shared by the files of
 * the server (rpc_server.c, its lifecycle; rpc_call.c, call contexts;
 * rpc_queue.c, the queue thread and the events) and by nothing else: the server and call contexts,
 * the completion-queue tags, and the rpc__ steps each file offers the others. Private to
 * daemon/rpc/; the contract is rpc.h, the threading and call lifetime rules are in rpc_server.c's
 * opening comment. Everything here runs on the loop thread, but for the queue thread's
 * rpc__cq_thread_main. */
#ifndef ZEROD_RPC_SERVER_IMPL_H
#define ZEROD_RPC_SERVER_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>
#include <uv.h>

#include "admit.h"
#include "rpc.h"
#include "rpc_impl.h"

/* Bounds. Method paths are short ASCII names; a daemon serves a few dozen
 * methods; status messages are one line for a human. */
#define RPC_MAX_METHODS      64
#define RPC_MAX_STATUS_BYTES 1024
#define RPC_MAX_QUEUED_SENDS 64

typedef enum tag_kind {
  TAG_NEW_CALL, /* grpc_server_request_call matched (or failed at shutdown) */
  TAG_REQUEST,  /* RECV_MESSAGE of the request */
  TAG_CLOSE,    /* RECV_CLOSE_ON_SERVER: the call is over on the wire */
  TAG_WRITE,    /* one streamed SEND_MESSAGE */
  TAG_STATUS,   /* SEND_STATUS_FROM_SERVER (with the unary reply) */
  TAG_SHUTDOWN, /* grpc_server_shutdown_and_notify */
} tag_kind;

/* A completion-queue tag. Each batch kind has its own tag, and at most one
 * batch of a kind is outstanding per call, so a tag is never in the event
 * list twice and the list needs no allocation. */
typedef struct rpc_tag {
  tag_kind kind;
  int success;          /* set by the queue thread, under the server lock */
  struct rpc_tag *next; /* in the server's event list, under the lock */
  rpc_call *call;       /* NULL for TAG_SHUTDOWN */
} rpc_tag;

typedef struct rpc_method {
  char path[RPC_MAX_PATH_BYTES];
  size_t path_bytes;
  rpc_kind kind;
  rpc_handler handler;
  void *arg;
  int priority;  /* may use the reserved calls (rpc_server_set_priority) */
  int anonymous; /* may be called without credentials (rpc_server_set_anonymous) */
} rpc_method;

typedef enum server_state {
  SERVER_CREATED,    /* methods may be added; not listening */
  SERVER_RUNNING,    /* accepting calls */
  SERVER_RESTARTING, /* the listener died: draining the old gRPC server */
  SERVER_REBINDING,  /* no gRPC server: listening again, retried on the timer */
  SERVER_DRAINING,   /* shutdown asked: waiting for gRPC's tag and our calls */
  SERVER_CQ_CLOSING, /* server destroyed, queue shut down: waiting for thread */
  SERVER_CLOSING,    /* thread joined: waiting for the async handle to close */
  SERVER_DONE,       /* done() called; only rpc_server_destroy is left */
} server_state;

struct rpc_server {
  uv_loop_t *loop;
  char addr[RPC_MAX_ADDR_BYTES];
  rpc_method methods[RPC_MAX_METHODS];
  unsigned method_count;
  server_state state;
  grpc_server_credentials *creds;          /* rpc_server_set_tls; NULL: plain */
  tls_reload *tls_reload;                  /* what creds fetch their files through */
  char bound_addr[RPC_MAX_ADDR_BYTES + 8]; /* addr with the port it got (for listening again) */
  unsigned seen_accept_failures;           /* accept_failures when last checked */
  uv_timer_t *listener_timer;              /* on the heap, like wakeup; NULL before start */
  int closing_handles;                     /* handles whose close callback is due */
  rpc_observer observer;                   /* rpc_server_set_observer; NULL: none */
  void *observer_arg;
  rpc_identify_fn identify; /* rpc_server_set_identify; NULL: every caller is trusted */
  void *identify_arg;
  admit_state admit; /* what admitted calls hold, which wait for their request (admit.h) */

  grpc_server *server;
  grpc_completion_queue *cq;
  uv_thread_t cq_thread;
  /* On the heap, not in the struct: when start fails, the handle is closed
   * and its close callback frees it, whether or not the caller has freed
   * the server by then. */
  uv_async_t *wakeup;

  /* Shared with the queue thread. */
  uv_mutex_t lock;
  rpc_tag *events_head;
  rpc_tag *events_tail;
  int cq_thread_exited;

  /* Loop thread only. */
  rpc_tag shutdown_tag;
  int shutdown_notified;
  unsigned live_calls; /* call contexts allocated, armed requests included */
  int in_wakeup;       /* draining events: defer shutdown progress to the end */
  int cancel_deferred; /* a gentle shutdown: the next listener tick cancels what is left */
  /* Moves shutdown along (rpc_server.c's server_advance_shutdown, set by
   * rpc_server_create): a freed call reaches up to it through here. */
  void (*advance_shutdown)(rpc_server *s);
  void (*done)(void *arg);
  void *done_arg;
};

struct rpc_call {
  rpc_server *server;
  grpc_call *call;
  grpc_call_details details;
  grpc_metadata_array request_metadata;
  const rpc_method *method; /* NULL: unknown method */
  char *peer;               /* gpr_malloc'd by gRPC */
  gpr_timespec deadline;    /* monotonic; tv_sec INT64_MAX when none */
  uint64_t arrived_ns;      /* uv_hrtime when matched */
  rpc_transport transport;
  char cert_name[256]; /* the verified client certificate's CN, or "" */
  char *audit_who;     /* rpc_call_audit; NULL: not audited */
  char *audit_what;
  void (*on_free)(void *arg);
  void *on_free_arg;

  long principal;      /* from the identify function (RPC_PRINCIPAL_*) */
  admit_ticket ticket; /* what the call holds (admit.h); all zero if refused */
  admit_wait wait;     /* while its request message has not come */

  rpc_tag tag_new, tag_request, tag_close, tag_write, tag_status;
  unsigned outstanding; /* batches started whose tag is not yet handled */
  unsigned busy;        /* user callbacks running on the stack */

  grpc_byte_buffer *request; /* RECV_MESSAGE's out-parameter */
  int close_cancelled;       /* RECV_CLOSE_ON_SERVER's out-parameter */

  unsigned handed : 1;          /* the handler got the call */
  unsigned finished : 1;        /* rpc_call_finish was called */
  unsigned cancelled : 1;       /* the call is dead on the wire */
  unsigned cancel_notified : 1; /* cancel_cb ran (or never will) */
  unsigned metadata_sent : 1;   /* SEND_INITIAL_METADATA started */
  unsigned status_pending : 1;  /* finished: send the status after writes */
  unsigned status_started : 1;
  unsigned request_timed_out : 1; /* cancelled for a request that did not come */

  rpc_cancel_cb cancel_cb;
  void *cancel_arg;

  /* The status to send, and the unary reply with it. */
  grpc_status_code status;
  grpc_slice status_details;
  int has_status_details;
  grpc_byte_buffer *reply;

  /* Streamed messages: one in flight, up to RPC_MAX_QUEUED_SENDS waiting. */
  grpc_byte_buffer *write_in_flight;
  grpc_byte_buffer *write_queue[RPC_MAX_QUEUED_SENDS];
  unsigned write_head;
  unsigned write_count;
};

/* ---- call contexts ------------------------------------------------------- */

void rpc__tag_init(rpc_tag *tag, tag_kind kind, rpc_call *call);

/* Frees a call context (what it held from admission released, its
 * on_free run) and, outside an event drain, moves the server's shutdown
 * along (advance_shutdown). */
void rpc__call_free(rpc_call *call);

/* Frees the call once nothing can touch it any more (see rpc_server.c's opening
 * comment): no batch outstanding, no callback running, and finished if
 * the handler got it. */
void rpc__call_maybe_free(rpc_call *call);

/* Starts a batch; on success the tag will come back through the loop.
 * Returns 0 or -EIO (gRPC refused it; logged). */
int rpc__call_start_batch(rpc_call *call, const grpc_op *ops, size_t n_ops, rpc_tag *tag);

/* The call is dead on the wire: drop what was waiting to be sent and tell
 * the handler, once, if it still owns the call. */
void rpc__call_mark_cancelled(rpc_call *call);

/* Sends the status (with initial metadata if none went out, and the unary
 * reply); a refused batch cancels the call. */
void rpc__call_send_status(rpc_call *call);

/* Starts the next queued write, or the status once the queue has drained. */
void rpc__call_pump_writes(rpc_call *call);

/* Records the status to send when the writes have drained. */
void rpc__call_set_status(rpc_call *call, int status, const char *message);

/* Arms one more grpc_server_request_call with a new call context.
 * Returns 0, -ENOMEM or -EIO. */
int rpc__server_arm_request(rpc_server *s);

/* The method registered under path, or NULL. */
const rpc_method *rpc__server_find_method(const rpc_server *s, grpc_slice path);

/* Reads what the transport knows of the caller (Unix socket, TCP, TLS and
 * a verified certificate's common name). */
void rpc__call_read_auth(rpc_call *call);

/* ---- the queue and its events -------------------------------------------- */

/* One finished batch, on the loop: the call's state machine moves on. */
void rpc__server_handle_event(rpc_server *s, rpc_tag *tag);

/* The queue thread (uv_thread_create's entry): pops finished batches and
 * hands their tags to the loop (the server's event list, wakeup). */
void rpc__cq_thread_main(void *arg);

/* Cancels the calls whose request message is overdue (the listener
 * timer's tick). */
void rpc__sweep_awaiting(rpc_server *s);

#endif /* ZEROD_RPC_SERVER_IMPL_H */
