/* follow_impl: a mirror of a job another node hosts (follow.h), shared by
 * follow.c (the loop's side: the list, waiting attaches, stopping) and
 * follow_fetch.c (the mirror's thread: the connection and the versions). */
#ifndef ZEROD_FOLLOW_IMPL_H
#define ZEROD_FOLLOW_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

#include "digest.h"
#include "follow.h"
#include "frame.h"
#include "job.h"

typedef enum mirror_state { MIRROR_STARTING, MIRROR_READY, MIRROR_FAILED } mirror_state;

/* A read-only attach waiting for its mirror's first version. */
typedef struct follow_waiter {
  struct follow_waiter *next;
  struct session *s; /* holds a reference */
  uint64_t request_id;
  uint8_t flags;
  uint8_t *packed; /* the AttachRequest, packed */
  size_t packed_bytes;
  follow_resume_fn resume;
} follow_waiter;

typedef struct mirror {
  struct mirror *next;
  struct daemon *d;
  char name[ZD_MAX_JOB_NAME_BYTES + 1];
  char token[ZD_MAX_TOKEN_BYTES + 1];
  char token_sha256[DIGEST_HEX_BYTES];
  uv_async_t *wake; /* the loop's: a state changed */

  /* Set by the thread (job before READY); read by the loop after it sees
   * the state. */
  job *j;
  _Atomic int state; /* mirror_state */
  int status;        /* FAILED: a Zerod__V1__Status, and why */
  char message[768];
  char upstream[300]; /* "node (host:port)", for messages */

  /* Loop-owned. */
  _Atomic int stop;
  _Atomic int fd; /* the connection, -1 before and after: shut down to stop */
  pthread_t thread;
  int thread_started, joined;
  mirror_state seen; /* the state the loop last acted on */
  follow_waiter *waiters;
  uint64_t idle_since_ms;

  /* Thread-owned: by upstream unit id, the local layout and the version
   * last fetched. */
  struct mirror_unit {
    unit_layout *layout; /* NULL: not seen yet */
    uint64_t version;    /* UINT64_MAX: never fetched */
  } * units;
  uint32_t nunits;
  uint64_t next_request;
  uint64_t fetched; /* bytes of gathered values the version being installed took */
  zd_frame_reader reader;
} mirror;

/* follow_fetch.c: the thread (arg: the mirror), and what it leaves behind
 * to free once it has been joined and no session reads the job. */
void *follow__main(void *arg);
void follow__mirror_free(mirror *m);

#endif /* ZEROD_FOLLOW_IMPL_H */
