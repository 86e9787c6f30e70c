/* comm_cancel.c - cutting short a communicator's creation (comm_cancel.h). */
#include "comm_cancel.h"

void comm_cancel_init(comm_cancel *c) {
  pthread_mutex_init(&c->mutex, NULL);
  c->armed = c->fired = 0;
  c->tag = 0;
  c->hook = NULL;
  c->arg = NULL;
}

void comm_cancel_destroy(comm_cancel *c) {
  pthread_mutex_destroy(&c->mutex);
}

void comm_cancel_arm(comm_cancel *c, unsigned tag) {
  pthread_mutex_lock(&c->mutex);
  c->armed = 1;
  c->fired = 0;
  c->tag = tag;
  c->hook = NULL;
  pthread_mutex_unlock(&c->mutex);
}

void comm_cancel_disarm(comm_cancel *c) {
  pthread_mutex_lock(&c->mutex);
  c->armed = 0;
  c->hook = NULL;
  pthread_mutex_unlock(&c->mutex);
}

int comm_cancel_fire(comm_cancel *c, unsigned tag) {
  pthread_mutex_lock(&c->mutex);
  int fire = c->armed && !c->fired && c->tag == tag;
  if (fire) {
    c->fired = 1;
    if (c->hook != NULL)
      c->hook(c->arg);
    c->hook = NULL;
  }
  pthread_mutex_unlock(&c->mutex);
  return fire;
}

int comm_cancel_armed(comm_cancel *c, unsigned *tag) {
  pthread_mutex_lock(&c->mutex);
  int armed = c->armed;
  *tag = c->tag;
  pthread_mutex_unlock(&c->mutex);
  return armed;
}

int comm_cancel_hook(comm_cancel *c, void (*hook)(void *arg), void *arg) {
  if (c == NULL)
    return 0;
  pthread_mutex_lock(&c->mutex);
  int fired = c->fired;
  if (!fired) {
    c->hook = hook;
    c->arg = arg;
  }
  pthread_mutex_unlock(&c->mutex);
  return fired;
}

void comm_cancel_unhook(comm_cancel *c) {
  if (c == NULL)
    return;
  pthread_mutex_lock(&c->mutex);
  c->hook = NULL;
  c->arg = NULL;
  pthread_mutex_unlock(&c->mutex);
}

int comm_cancel_fired(comm_cancel *c) {
  if (c == NULL)
    return 0;
  pthread_mutex_lock(&c->mutex);
  int fired = c->fired;
  pthread_mutex_unlock(&c->mutex);
  return fired;
}
