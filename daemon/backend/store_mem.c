/* store_mem.c - the in-process rendezvous store (store.h).
 *
 * This file owns store_mem: a chained hash table of NUL-terminated keys to
 * byte-string values, guarded by one mutex. Readers that ask for a key that
 * is not there yet sleep on one condition variable until a writer sets it or
 * their deadline passes. The deadline is taken on CLOCK_MONOTONIC so that a
 * wall-clock jump (NTP, an operator's `date`) can neither cut a rendezvous
 * short nor stretch it.
 *
 * Timeouts: get() with timeout_ms == 0 only looks; timeout_ms < 0 waits
 * without limit (useful in tests, never in the daemon).
 *
 * Ownership: the store copies every key and value it is given; get() hands
 * the caller a malloc'd copy that the caller frees. destroy() frees the
 * table and everything in it; no thread may be inside a call at that time. */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "store.h"

/* Rendezvous keys are short ("job/7/epoch/1/rank_3") and values are pair
 * addresses, a few hundred bytes per peer; these limits are far above that
 * and keep a confused caller from filling the daemon's memory. */
#define STORE_MEM_MAX_KEY_BYTES   1024
#define STORE_MEM_MAX_VALUE_BYTES (64u * 1024 * 1024)
#define STORE_MEM_MIN_BUCKETS     64

typedef struct store_mem_entry {
  struct store_mem_entry *next;
  char *key;
  void *value;
  size_t value_bytes;
} store_mem_entry;

typedef struct store_mem {
  store base; /* first, so a store * is a store_mem * */
  pthread_mutex_t mutex;
  pthread_cond_t key_set; /* broadcast on every set */
  store_mem_entry **buckets;
  size_t bucket_count; /* a power of two */
  size_t entry_count;
  int stopping; /* store_mem_stop: waits give up */
} store_mem;

/* ---- the table ---------------------------------------------------------- */

/* FNV-1a: short keys, no adversary (the keys come from this daemon). */
static uint64_t key_hash(const char *key) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char *p = (const unsigned char *)key; *p != '\0'; p++) {
    h ^= *p;
    h *= 0x100000001b3ull;
  }
  return h;
}

static store_mem_entry **bucket_of(store_mem *sm, const char *key) {
  return &sm->buckets[key_hash(key) & (sm->bucket_count - 1)];
}

static store_mem_entry *find_entry(store_mem *sm, const char *key) {
  for (store_mem_entry *e = *bucket_of(sm, key); e != NULL; e = e->next)
    if (strcmp(e->key, key) == 0)
      return e;
  return NULL;
}

static void free_entry(store_mem_entry *e) {
  free(e->key);
  free(e->value);
  free(e);
}

/* Doubles the bucket array once the table is fuller than one entry per
 * bucket. A failed allocation only leaves the chains longer, so it is not an
 * error. */
static void maybe_grow(store_mem *sm) {
  if (sm->entry_count < sm->bucket_count)
    return;
  size_t new_count = sm->bucket_count * 2;
  store_mem_entry **new_buckets = calloc(new_count, sizeof *new_buckets);
  if (new_buckets == NULL)
    return;
  for (size_t b = 0; b < sm->bucket_count; b++) {
    store_mem_entry *e = sm->buckets[b];
    while (e != NULL) {
      store_mem_entry *next = e->next;
      store_mem_entry **slot = &new_buckets[key_hash(e->key) & (new_count - 1)];
      e->next = *slot;
      *slot = e;
      e = next;
    }
  }
  free(sm->buckets);
  sm->buckets = new_buckets;
  sm->bucket_count = new_count;
}

static int check_key(const char *key) {
  if (key == NULL)
    return -EINVAL;
  if (strnlen(key, STORE_MEM_MAX_KEY_BYTES + 1) > STORE_MEM_MAX_KEY_BYTES)
    return -ENAMETOOLONG;
  return 0;
}

/* malloc(0) may return NULL, which would read as an allocation failure, so
 * empty values get one byte. */
static void *copy_bytes(const void *src, size_t bytes) {
  void *dst = malloc(bytes > 0 ? bytes : 1);
  if (dst != NULL && bytes > 0)
    memcpy(dst, src, bytes);
  return dst;
}

/* ---- the operations ------------------------------------------------------ */

static int store_mem_set(store *st, const char *key, const void *value, size_t value_bytes) {
  store_mem *sm = (store_mem *)st;
  int rc = check_key(key);
  if (rc != 0)
    return rc;
  if (value == NULL && value_bytes > 0)
    return -EINVAL;
  if (value_bytes > STORE_MEM_MAX_VALUE_BYTES)
    return -EMSGSIZE;

  /* Copy outside the lock: the copies may be large and other ranks' threads
   * are waiting on the same mutex. */
  void *value_copy = copy_bytes(value, value_bytes);
  if (value_copy == NULL)
    return -ENOMEM;

  pthread_mutex_lock(&sm->mutex);
  store_mem_entry *e = find_entry(sm, key);
  if (e != NULL) {
    free(e->value);
    e->value = value_copy;
    e->value_bytes = value_bytes;
  } else {
    e = malloc(sizeof *e);
    char *key_copy = strdup(key);
    if (e == NULL || key_copy == NULL) {
      pthread_mutex_unlock(&sm->mutex);
      free(e);
      free(key_copy);
      free(value_copy);
      return -ENOMEM;
    }
    e->key = key_copy;
    e->value = value_copy;
    e->value_bytes = value_bytes;
    store_mem_entry **bucket = bucket_of(sm, key);
    e->next = *bucket;
    *bucket = e;
    sm->entry_count++;
    maybe_grow(sm);
  }
  pthread_cond_broadcast(&sm->key_set);
  pthread_mutex_unlock(&sm->mutex);
  return 0;
}

static int store_mem_get(store *st, const char *key, void **value, size_t *value_bytes,
                         int timeout_ms) {
  store_mem *sm = (store_mem *)st;
  int rc = check_key(key);
  if (rc != 0)
    return rc;
  if (value == NULL || value_bytes == NULL)
    return -EINVAL;

  struct timespec deadline;
  if (timeout_ms > 0)
    deadline = clock_deadline_ms(timeout_ms);

  pthread_mutex_lock(&sm->mutex);
  store_mem_entry *e;
  while ((e = find_entry(sm, key)) == NULL) {
    if (timeout_ms == 0) {
      rc = -ETIMEDOUT;
      break;
    }
    if (sm->stopping) {
      rc = -ECANCELED;
      break;
    }
    /* Spurious wakeups and sets of other keys land here too; the loop
     * re-checks, and the absolute deadline keeps the total wait bounded. */
    int wait_rc = timeout_ms < 0 ? pthread_cond_wait(&sm->key_set, &sm->mutex)
                                 : pthread_cond_timedwait(&sm->key_set, &sm->mutex, &deadline);
    if (wait_rc == ETIMEDOUT && (e = find_entry(sm, key)) == NULL) {
      rc = -ETIMEDOUT;
      break;
    }
  }
  if (e != NULL) {
    /* The value may be replaced by a later set once the lock is dropped, so
     * the copy is taken under the lock. */
    void *copy = copy_bytes(e->value, e->value_bytes);
    if (copy == NULL) {
      rc = -ENOMEM;
    } else {
      *value = copy;
      *value_bytes = e->value_bytes;
      rc = 0;
    }
  }
  pthread_mutex_unlock(&sm->mutex);
  return rc;
}

void store_mem_stop(store *st) {
  store_mem *sm = (store_mem *)st;
  pthread_mutex_lock(&sm->mutex);
  sm->stopping = 1;
  pthread_cond_broadcast(&sm->key_set);
  pthread_mutex_unlock(&sm->mutex);
}

static int store_mem_delete_prefix(store *st, const char *prefix) {
  store_mem *sm = (store_mem *)st;
  int rc = check_key(prefix);
  if (rc != 0)
    return rc;
  size_t prefix_bytes = strlen(prefix);

  pthread_mutex_lock(&sm->mutex);
  for (size_t b = 0; b < sm->bucket_count; b++) {
    store_mem_entry **link = &sm->buckets[b];
    while (*link != NULL) {
      store_mem_entry *e = *link;
      if (strncmp(e->key, prefix, prefix_bytes) == 0) {
        *link = e->next;
        free_entry(e);
        sm->entry_count--;
      } else {
        link = &e->next;
      }
    }
  }
  pthread_mutex_unlock(&sm->mutex);
  return 0;
}

static void store_mem_destroy(store *st) {
  store_mem *sm = (store_mem *)st;
  if (sm == NULL)
    return;
  for (size_t b = 0; b < sm->bucket_count; b++) {
    store_mem_entry *e = sm->buckets[b];
    while (e != NULL) {
      store_mem_entry *next = e->next;
      free_entry(e);
      e = next;
    }
  }
  free(sm->buckets);
  pthread_cond_destroy(&sm->key_set);
  pthread_mutex_destroy(&sm->mutex);
  free(sm);
}

static const store_ops store_mem_ops = {
    .set = store_mem_set,
    .get = store_mem_get,
    .delete_prefix = store_mem_delete_prefix,
    .destroy = store_mem_destroy,
};

int store_mem_create(store **out) {
  if (out == NULL)
    return -EINVAL;
  *out = NULL;

  store_mem *sm = calloc(1, sizeof *sm);
  if (sm == NULL)
    return -ENOMEM;
  sm->base.ops = &store_mem_ops;
  sm->bucket_count = STORE_MEM_MIN_BUCKETS;
  sm->buckets = calloc(sm->bucket_count, sizeof *sm->buckets);
  if (sm->buckets == NULL) {
    free(sm);
    return -ENOMEM;
  }

  int rc = pthread_mutex_init(&sm->mutex, NULL);
  if (rc != 0)
    goto fail_buckets;
  pthread_condattr_t cond_attr;
  rc = pthread_condattr_init(&cond_attr);
  if (rc != 0)
    goto fail_mutex;
  rc = pthread_condattr_setclock(&cond_attr, CLOCK_MONOTONIC);
  if (rc == 0)
    rc = pthread_cond_init(&sm->key_set, &cond_attr);
  pthread_condattr_destroy(&cond_attr);
  if (rc != 0)
    goto fail_mutex;

  *out = &sm->base;
  return 0;

fail_mutex:
  pthread_mutex_destroy(&sm->mutex);
fail_buckets:
  free(sm->buckets);
  free(sm);
  return -rc;
}
