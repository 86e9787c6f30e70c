/* admit: the server's admission of arriving calls (see admit.h). */
#include "admit.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* Counts by key                                                            */
/* ------------------------------------------------------------------------ */

struct admit_entry {
  admit_entry *next;
  unsigned count;
  char key[]; /* NUL-terminated */
};

/* FNV-1a: keys are short peer strings a client chooses only in part (its
 * port), and a table of a few thousand live entries at most. */
static uint64_t key_hash(const char *key, size_t len) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < len; i++) {
    h ^= (unsigned char)key[i];
    h *= 1099511628211ull;
  }
  return h;
}

static admit_entry **counts_slot(const admit_counts *t, const char *key, size_t len) {
  admit_entry **slot = &t->buckets[key_hash(key, len) & (t->nbuckets - 1)];
  while (*slot != NULL && (strncmp((*slot)->key, key, len) != 0 || (*slot)->key[len] != '\0'))
    slot = &(*slot)->next;
  return slot;
}

static unsigned counts_get(const admit_counts *t, const char *key, size_t len) {
  if (t->nbuckets == 0)
    return 0;
  admit_entry *e = *counts_slot(t, key, len);
  return e != NULL ? e->count : 0;
}

/* Doubles the buckets when the table is as full as it has buckets. A
 * failed growth leaves the table as it was (longer chains, still right). */
static void counts_grow(admit_counts *t) {
  size_t nbuckets = t->nbuckets ? t->nbuckets * 2 : 64;
  admit_entry **buckets = calloc(nbuckets, sizeof *buckets);
  if (buckets == NULL)
    return;
  for (size_t i = 0; i < t->nbuckets; i++) {
    admit_entry *e = t->buckets[i], *next;
    for (; e != NULL; e = next) {
      next = e->next;
      admit_entry **head = &buckets[key_hash(e->key, strlen(e->key)) & (nbuckets - 1)];
      e->next = *head;
      *head = e;
    }
  }
  free(t->buckets);
  t->buckets = buckets;
  t->nbuckets = nbuckets;
}

/* Adds one to key's count. Returns 0 or -ENOMEM (nothing changed). */
static int counts_add(admit_counts *t, const char *key, size_t len) {
  if (t->nentries >= t->nbuckets)
    counts_grow(t);
  if (t->nbuckets == 0)
    return -ENOMEM;
  admit_entry **slot = counts_slot(t, key, len);
  if (*slot == NULL) {
    admit_entry *e = malloc(sizeof *e + len + 1);
    if (e == NULL)
      return -ENOMEM;
    e->next = NULL;
    e->count = 0;
    memcpy(e->key, key, len);
    e->key[len] = '\0';
    *slot = e;
    t->nentries++;
  }
  (*slot)->count++;
  return 0;
}

/* Takes one from key's count, dropping the entry at zero. */
static void counts_remove(admit_counts *t, const char *key, size_t len) {
  if (t->nbuckets == 0)
    return;
  admit_entry **slot = counts_slot(t, key, len);
  admit_entry *e = *slot;
  if (e == NULL)
    return;
  if (--e->count == 0) {
    *slot = e->next;
    free(e);
    t->nentries--;
  }
}

static void counts_free(admit_counts *t) {
  for (size_t i = 0; i < t->nbuckets; i++) {
    admit_entry *e = t->buckets[i], *next;
    for (; e != NULL; e = next) {
      next = e->next;
      free(e);
    }
  }
  free(t->buckets);
  memset(t, 0, sizeof *t);
}

/* ------------------------------------------------------------------------ */
/* Peers                                                                    */
/* ------------------------------------------------------------------------ */

/* Connections are told apart by their peer, which names the client's
 * address and port over TCP. Every Unix-socket client is "unix:" alike,
 * so those are not counted per connection: the socket's file mode is
 * their access control (docs/security.md). */
static int peer_counted(const char *peer) {
  return peer != NULL && strncmp(peer, "unix:", 5) != 0;
}

/* The length of peer's address without its port ("ipv4:10.0.0.1:5123"
 * -> "ipv4:10.0.0.1", "ipv6:[::1]:5123" -> "ipv6:[::1]"). */
static size_t address_len(const char *peer) {
  const char *colon = strrchr(peer, ':');
  size_t len = strlen(peer);
  if (colon == NULL || colon == peer || strchr(peer, ':') == colon)
    return len; /* "scheme:address" without a port */
  return (size_t)(colon - peer);
}

/* ------------------------------------------------------------------------ */
/* Admission                                                                */
/* ------------------------------------------------------------------------ */

int admit_set_principals(admit_state *a, size_t n) {
  unsigned *calls = n > 0 ? calloc(n, sizeof *calls) : NULL;
  if (n > 0 && calls == NULL)
    return -ENOMEM;
  free(a->principal_calls);
  a->principal_calls = calls;
  a->nprincipals = n;
  return 0;
}

static int refuse(char *why, size_t why_bytes, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int refuse(char *why, size_t why_bytes, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, why_bytes, fmt, ap);
  va_end(ap);
  return -EBUSY;
}

/* The anonymous budget: per connection, per source address, in all. */
static int check_anonymous(const admit_state *a, const admit_request *req, char *why,
                           size_t why_bytes) {
  const admit_limits *l = &a->limits;
  if (a->anonymous >= l->anonymous)
    return refuse(why, why_bytes,
                  "server busy: %u calls without credentials in flight (at most %u); send "
                  "credentials",
                  a->anonymous, l->anonymous);
  if (!peer_counted(req->peer))
    return 0;
  size_t address_bytes = address_len(req->peer);
  unsigned from_address = counts_get(&a->addresses, req->peer, address_bytes);
  if (from_address >= l->anonymous_per_address)
    return refuse(why, why_bytes,
                  "%.*s has %u calls without credentials in flight (at most %u per address)",
                  (int)address_bytes, req->peer, from_address, l->anonymous_per_address);
  unsigned on_connection = counts_get(&a->anonymous_connections, req->peer, strlen(req->peer));
  if (on_connection >= l->anonymous_per_connection)
    return refuse(why, why_bytes,
                  "connection %s has %u calls without credentials in flight (at most %u)",
                  req->peer, on_connection, l->anonymous_per_connection);
  return 0;
}

static int check_principal(const admit_state *a, const admit_request *req, char *why,
                           size_t why_bytes) {
  const admit_limits *l = &a->limits;
  unsigned limit = l->calls;
  if (req->priority)
    limit += l->reserved_calls;
  if (a->admitted >= limit)
    return refuse(why, why_bytes, "server busy: %u calls in flight", a->admitted);
  if (req->principal < 0 || (size_t)req->principal >= a->nprincipals)
    return 0;
  unsigned calls = a->principal_calls[req->principal];
  unsigned cap = l->per_principal;
  if (req->priority)
    cap += l->principal_reserve;
  if (calls >= cap)
    return refuse(why, why_bytes, "principal %s has %u calls in flight (at most %u)",
                  req->principal_name != NULL ? req->principal_name : "?", calls, l->per_principal);
  return 0;
}

/* Counts a call on its connection (and, without credentials, its
 * address): all or nothing. Returns 0 or -ENOMEM. */
static int counted_add(admit_state *a, const char *peer, int anonymous) {
  size_t peer_bytes = strlen(peer);
  if (counts_add(&a->connections, peer, peer_bytes) != 0)
    return -ENOMEM;
  if (!anonymous)
    return 0;
  if (counts_add(&a->anonymous_connections, peer, peer_bytes) == 0) {
    if (counts_add(&a->addresses, peer, address_len(peer)) == 0)
      return 0;
    counts_remove(&a->anonymous_connections, peer, peer_bytes);
  }
  counts_remove(&a->connections, peer, peer_bytes);
  return -ENOMEM;
}

int admit_call(admit_state *a, const admit_request *req, admit_ticket *ticket, char *why,
               size_t why_bytes) {
  memset(ticket, 0, sizeof *ticket);
  ticket->principal = req->anonymous ? -1 : req->principal;
  int anonymous = req->anonymous != 0;
  int counted = peer_counted(req->peer);
  size_t peer_bytes = counted ? strlen(req->peer) : 0;
  if (counted) {
    unsigned on_connection = counts_get(&a->connections, req->peer, peer_bytes);
    if (on_connection >= a->limits.per_connection)
      return refuse(why, why_bytes, "connection %s has %u calls in flight (at most %u)", req->peer,
                    on_connection, a->limits.per_connection);
  }
  int status =
      anonymous ? check_anonymous(a, req, why, why_bytes) : check_principal(a, req, why, why_bytes);
  if (status != 0)
    return status;

  if (counted && counted_add(a, req->peer, anonymous) != 0) {
    snprintf(why, why_bytes, "server out of memory");
    return -ENOMEM;
  }
  ticket->connection = counted;
  if (anonymous) {
    ticket->anonymous = 1;
    a->anonymous++;
  } else {
    ticket->admitted = 1;
    a->admitted++;
    if (req->principal >= 0 && (size_t)req->principal < a->nprincipals)
      a->principal_calls[req->principal]++;
  }
  return 0;
}

void admit_release(admit_state *a, const char *peer, const admit_ticket *ticket) {
  if (ticket->connection) {
    counts_remove(&a->connections, peer, strlen(peer));
    if (ticket->anonymous) {
      counts_remove(&a->anonymous_connections, peer, strlen(peer));
      counts_remove(&a->addresses, peer, address_len(peer));
    }
  }
  if (ticket->anonymous)
    a->anonymous--;
  if (ticket->admitted) {
    a->admitted--;
    if (ticket->principal >= 0 && (size_t)ticket->principal < a->nprincipals)
      a->principal_calls[ticket->principal]--;
  }
}

/* ------------------------------------------------------------------------ */
/* Waiting for the request                                                  */
/* ------------------------------------------------------------------------ */

void admit_wait_start(admit_state *a, admit_wait *w, const admit_ticket *ticket,
                      uint64_t deadline_ns) {
  admit_wait_queue *q = &a->waiting[ticket->anonymous];
  w->deadline_ns = deadline_ns;
  w->queue = ticket->anonymous;
  w->next = NULL;
  w->prev = q->tail;
  if (q->tail != NULL)
    q->tail->next = w;
  else
    q->head = w;
  q->tail = w;
  w->linked = 1;
}

void admit_wait_stop(admit_state *a, admit_wait *w) {
  if (!w->linked)
    return;
  admit_wait_queue *q = &a->waiting[w->queue];
  if (w->prev != NULL)
    w->prev->next = w->next;
  else
    q->head = w->next;
  if (w->next != NULL)
    w->next->prev = w->prev;
  else
    q->tail = w->prev;
  w->prev = w->next = NULL;
  w->linked = 0;
}

admit_wait *admit_wait_overdue(admit_state *a, uint64_t now_ns) {
  for (int i = 0; i < 2; i++) {
    admit_wait *w = a->waiting[i].head;
    if (w != NULL && (int64_t)(now_ns - w->deadline_ns) >= 0) {
      admit_wait_stop(a, w);
      return w;
    }
  }
  return NULL;
}

int admit_log_due(admit_state *a, uint64_t now_ns, uint64_t period_ns, unsigned *unlogged) {
  admit_log_gate *g = &a->refusals;
  if (g->logged_ns != 0 && now_ns - g->logged_ns < period_ns) {
    g->unlogged++;
    return 0;
  }
  *unlogged = g->unlogged;
  g->logged_ns = now_ns;
  g->unlogged = 0;
  return 1;
}

/* ------------------------------------------------------------------------ */
/* Teardown and inspection                                                  */
/* ------------------------------------------------------------------------ */

unsigned admit_connection_calls(const admit_state *a, const char *peer) {
  return peer_counted(peer) ? counts_get(&a->connections, peer, strlen(peer)) : 0;
}

void admit_free(admit_state *a) {
  counts_free(&a->connections);
  counts_free(&a->anonymous_connections);
  counts_free(&a->addresses);
  free(a->principal_calls);
  memset(a, 0, sizeof *a);
}
