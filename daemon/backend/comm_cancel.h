/* comm_cancel.h - cutting short a communicator's creation from another
 * thread.
 *
 * A communicator's creation waits for peers: in the rendezvous store, while
 * its connections are made, in the barrier that ends it. A collective has
 * comm_abort; a creation has no communicator yet, so its creator hands the
 * backend one of these (comm_options.cancel):
 *
 *   creator thread                      any other thread
 *   comm_cancel_arm(c, generation)
 *   comm_*_create(... cancel = c ...)   comm_cancel_fire(c, generation)
 *   comm_cancel_disarm(c)
 *
 * While it creates, the backend hooks what a fire must wake (the Gloo
 * pairs being connected, then the barrier's context) and polls
 * comm_cancel_fired between its waits. A fire runs the hook at most once;
 * a hook set after the fire is refused (the backend gives up). The tag (the creator's
 * generation) keeps a fire meant for one creation from hitting the next. */
#ifndef ZEROD_BACKEND_COMM_CANCEL_H
#define ZEROD_BACKEND_COMM_CANCEL_H

#include <pthread.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct comm_cancel {
  pthread_mutex_t mutex;
  int armed, fired;
  unsigned tag;
  void (*hook)(void *arg); /* run under mutex: it must not block */
  void *arg;
} comm_cancel;

void comm_cancel_init(comm_cancel *c);
void comm_cancel_destroy(comm_cancel *c);

/* The creator, before and after a creation. */
void comm_cancel_arm(comm_cancel *c, unsigned tag);
void comm_cancel_disarm(comm_cancel *c);

/* Fires the creation armed with tag, if one is; returns whether it did. */
int comm_cancel_fire(comm_cancel *c, unsigned tag);
/* Whether a creation is armed; its tag in *tag. */
int comm_cancel_armed(comm_cancel *c, unsigned *tag);

/* The backend. c may be NULL (nothing cancels). hook returns 1 without
 * keeping the hook when the creation was fired already (the caller gives
 * up); unhook must come before what the hook touches goes away. */
int comm_cancel_hook(comm_cancel *c, void (*hook)(void *arg), void *arg);
void comm_cancel_unhook(comm_cancel *c);
int comm_cancel_fired(comm_cancel *c);

#ifdef __cplusplus
}
#endif

#endif /* ZEROD_BACKEND_COMM_CANCEL_H */
