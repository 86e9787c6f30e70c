/* The coordinator (see coord.h): membership and leases, the job registry,
 * the rendezvous KV and health, as gRPC handlers on the loop thread. The
 * Checkpoints service is coord_ckpt.c's, on the same state (coord_impl.h);
 * this file calls its hooks where jobs, reports and Watch events change.
 *
 * Requests are decoded and validated by ctl_decode.c; the handlers here
 * decide what a well-formed request means against the state. Every change
 * that a node must know about marks that node's Watch stream dirty, and a
 * zero-delay timer sends each dirty stream one full WatchEvent on the next
 * turn of the loop, so a burst of changes (three leases expiring in one
 * sweep) costs one event per node, not one per change.
 *
 * Job states are never stored: they are derived (derive_job) from the
 * members and their last heartbeat's reports whenever either changes.
 *
 * Nothing here blocks the loop except the state file write (coord_state.c):
 * a few kilobytes written and fsync'd when a job is created or deleted.
 * Those are rare operator actions, and answering them only once the state
 * is durable is the point, so the write is done in line rather than on
 * the thread pool. */
#include "config.h"
#include "coord_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ctl_decode.h"
#include "digest.h"
#include "filemode.h"
#include "health.h"
#include "log.h"

static void reconcile(coord *c, const char *node);
static void mark_all_watches(coord *c);

/* ------------------------------------------------------------------------ */
/* Small helpers                                                            */
/* ------------------------------------------------------------------------ */

int64_t coord__unix_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int random_bytes(void *buf, size_t len) {
  size_t got = 0;
  while (got < len) {
    ssize_t n = getrandom((char *)buf + got, len - got, 0);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return -errno;
    }
    got += (size_t)n;
  }
  return 0;
}

/* A new token: COORD_TOKEN_HEX_DIGITS random hex digits into out
 * (COORD_TOKEN_HEX_DIGITS + 1 bytes). Returns 0 or a negative errno
 * (errno set). */
static int random_token(char *out) {
  uint8_t raw[COORD_TOKEN_HEX_DIGITS / 2];
  int rc = random_bytes(raw, sizeof raw);
  if (rc != 0)
    return rc;
  for (size_t i = 0; i < sizeof raw; i++)
    snprintf(out + 2 * i, 3, "%02x", raw[i]);
  return 0;
}

/* Returns a copy of msg made by packing and unpacking it, so that the copy
 * is one protobuf-c allocation tree (freed with ctl_free), or NULL. */
void *coord__message_copy(const ProtobufCMessage *msg) {
  size_t len = protobuf_c_message_get_packed_size(msg);
  uint8_t *buf = malloc(len ? len : 1);
  if (buf == NULL)
    return NULL;
  protobuf_c_message_pack(msg, buf);
  ProtobufCMessage *copy = protobuf_c_message_unpack(msg->descriptor, NULL, len, buf);
  free(buf);
  return copy;
}

void coord__finish_message(rpc_call *call, const ProtobufCMessage *msg) {
  size_t len = protobuf_c_message_get_packed_size(msg);
  if (len > RPC_MAX_MESSAGE_BYTES) {
    char err[128];
    snprintf(err, sizeof err, "reply would be %zu bytes (at most %u)", len, RPC_MAX_MESSAGE_BYTES);
    rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, err, NULL, 0);
    return;
  }
  uint8_t *buf = malloc(len ? len : 1);
  if (buf == NULL) {
    rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory", NULL, 0);
    return;
  }
  protobuf_c_message_pack(msg, buf);
  rpc_call_finish(call, RPC_OK, NULL, buf, len);
  free(buf);
}

void coord__finish_error(rpc_call *call, int status, const char *fmt, ...) {
  char message[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof message, fmt, ap);
  va_end(ap);
  rpc_call_finish(call, status, message, NULL, 0);
}

/* Appends printf output to buf (of buf_bytes) at *len, truncating. */
static void append(char *buf, size_t buf_bytes, size_t *len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void append(char *buf, size_t buf_bytes, size_t *len, const char *fmt, ...) {
  if (*len >= buf_bytes)
    return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf + *len, buf_bytes - *len, fmt, ap);
  va_end(ap);
  if (n > 0)
    *len = *len + (size_t)n < buf_bytes ? *len + (size_t)n : buf_bytes;
}

/* Formats "node a" or "nodes a, b, c" (at most 8 names, then "and N
 * more") into buf, from the names[count]. */
static void format_nodes(char *buf, size_t buf_bytes, const char *const *names, size_t count) {
  size_t len = 0;
  buf[0] = '\0';
  append(buf, buf_bytes, &len, count == 1 ? "node " : "nodes ");
  for (size_t i = 0; i < count && i < 8; i++)
    append(buf, buf_bytes, &len, "%s%s", i ? ", " : "", names[i]);
  if (count > 8)
    append(buf, buf_bytes, &len, " and %zu more", count - 8);
}

/* ------------------------------------------------------------------------ */
/* Members and jobs: lookup                                                 */
/* ------------------------------------------------------------------------ */

static const char *member_name(const void *m) {
  return ((const member *)m)->info->name;
}
static const char *job_name(const void *j) {
  return ((const cjob *)j)->msg->name;
}

/* Binary search by name in an array sorted by name; returns the index of
 * the match, or -(insertion point) - 1. */
static long search_by_name(void *const *items, size_t n, const char *(*name_of)(const void *),
                           const char *name) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int cmp = strcmp(name_of(items[mid]), name);
    if (cmp == 0)
      return (long)mid;
    if (cmp < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return -(long)lo - 1;
}

static long find_member_index(const coord *c, const char *name) {
  return search_by_name((void *const *)c->members, c->nmembers, member_name, name);
}

member *coord__find_member(const coord *c, const char *name) {
  long i = find_member_index(c, name);
  return i >= 0 ? c->members[i] : NULL;
}

static long find_job_index(const coord *c, const char *name) {
  return search_by_name((void *const *)c->jobs, c->njobs, job_name, name);
}

cjob *coord__find_job(const coord *c, const char *name) {
  long i = find_job_index(c, name);
  return i >= 0 ? c->jobs[i] : NULL;
}

long coord__placement_of(const cjob *j, const char *node) {
  for (size_t i = 0; i < j->msg->n_placement; i++)
    if (strcmp(j->msg->placement[i]->node, node) == 0)
      return (long)i;
  return -1;
}

static int compare_reports(const void *a, const void *b) {
  return strcmp(((const job_report *)a)->job, ((const job_report *)b)->job);
}

static const job_report *find_report(const member *m, const char *job) {
  if (m->nreports == 0)
    return NULL; /* bsearch must not be given a NULL array */
  job_report key = {.job = (char *)job};
  return bsearch(&key, m->reports, m->nreports, sizeof *m->reports, compare_reports);
}

static void free_reports(job_report *reports, size_t count) {
  for (size_t i = 0; i < count; i++) {
    free(reports[i].job);
    free(reports[i].error);
  }
  free(reports);
}

/* ------------------------------------------------------------------------ */
/* Messages: views, jobs, watch events                                      */
/* ------------------------------------------------------------------------ */

/* The job as replies show it: the stored message with the live fields.
 * Points into j; valid until j changes. */
static void job_view(const cjob *j, Zerod__V1__Job *out) {
  *out = *j->msg;
  out->state = j->state;
  out->reason = (char *)j->reason;
  out->step = j->step;
  out->epoch = j->epoch;
}

/* A View message built from the members; free with view_free. */
typedef struct view_msg {
  Zerod__V1__View view;
  Zerod__V1__Member *members;
  Zerod__V1__Member **pointers;
} view_msg;

static int view_build(const coord *c, view_msg *v) {
  zerod__v1__view__init(&v->view);
  v->members = calloc(c->nmembers ? c->nmembers : 1, sizeof *v->members);
  v->pointers = calloc(c->nmembers ? c->nmembers : 1, sizeof *v->pointers);
  if (v->members == NULL || v->pointers == NULL) {
    free(v->members);
    free(v->pointers);
    return -ENOMEM;
  }
  uint64_t now = uv_now(c->loop);
  for (size_t i = 0; i < c->nmembers; i++) {
    const member *m = c->members[i];
    Zerod__V1__Member *out = &v->members[i];
    zerod__v1__member__init(out);
    out->node = m->info;
    out->session = m->session;
    out->joined_unix_ms = m->joined_unix_ms;
    out->lease_remaining_ms =
        m->lease_deadline_ms > now ? (int64_t)(m->lease_deadline_ms - now) : 0;
    v->pointers[i] = out;
  }
  v->view.epoch = c->epoch;
  v->view.n_members = c->nmembers;
  v->view.members = v->pointers;
  return 0;
}

static void view_free(view_msg *v) {
  free(v->members);
  free(v->pointers);
}

/* Packs the WatchEvent for m (the view and m's assignments) into a malloc'd
 * buffer. Returns 0 or -ENOMEM. */
static int watch_event_pack(const coord *c, const member *m, uint8_t **out, size_t *out_bytes) {
  view_msg v;
  if (view_build(c, &v) != 0)
    return -ENOMEM;
  int rc = -ENOMEM;
  size_t cap = c->njobs ? c->njobs : 1;
  Zerod__V1__Assignment *assignments = calloc(cap, sizeof *assignments);
  Zerod__V1__Assignment **pointers = calloc(cap, sizeof *pointers);
  Zerod__V1__Job *jobs = calloc(cap, sizeof *jobs);
  if (assignments == NULL || pointers == NULL || jobs == NULL)
    goto out;
  size_t count = 0;
  for (size_t i = 0; i < c->njobs; i++) {
    const cjob *j = c->jobs[i];
    long at = j->deleting ? -1 : coord__placement_of(j, m->info->name);
    if (at < 0)
      continue;
    job_view(j, &jobs[count]);
    zerod__v1__assignment__init(&assignments[count]);
    assignments[count].job = &jobs[count];
    assignments[count].token_sha256 = j->token_sha256;
    assignments[count].n_read_token_sha256 = j->n_read_tokens;
    assignments[count].read_token_sha256 = (char **)j->read_token_ptrs;
    assignments[count].first_rank = j->msg->placement[at]->first_rank;
    assignments[count].ranks = j->msg->placement[at]->ranks;
    coord__ckpt_assignment(j, &assignments[count]);
    pointers[count] = &assignments[count];
    count++;
  }
  Zerod__V1__WatchEvent event = ZEROD__V1__WATCH_EVENT__INIT;
  event.view = &v.view;
  event.n_assignments = count;
  event.assignments = pointers;
  event.next_job_id = c->next_job_id;
  size_t len = zerod__v1__watch_event__get_packed_size(&event);
  uint8_t *buf = malloc(len ? len : 1);
  if (buf == NULL)
    goto out;
  zerod__v1__watch_event__pack(&event, buf);
  *out = buf;
  *out_bytes = len;
  rc = 0;
out:
  free(assignments);
  free(pointers);
  free(jobs);
  view_free(&v);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Watch streams                                                            */
/* ------------------------------------------------------------------------ */

/* Ends m's Watch stream, if any, with status and message. */
static void watch_end(member *m, int status, const char *message) {
  rpc_call *call = m->watch;
  if (call == NULL)
    return;
  m->watch = NULL;
  m->watch_dirty = 0;
  /* The call is finished here; its cancel callback must not run later
   * with a member that may be gone by then. */
  rpc_call_set_cancel(call, NULL, NULL);
  rpc_call_finish(call, status, message, NULL, 0);
}

/* Sends m's stream the current event. */
static void watch_send(coord *c, member *m) {
  m->watch_dirty = 0;
  if (m->watch == NULL)
    return;
  uint8_t *event = NULL;
  size_t event_bytes = 0;
  int rc = watch_event_pack(c, m, &event, &event_bytes);
  if (rc == 0 && event_bytes > RPC_MAX_MESSAGE_BYTES)
    rc = -EMSGSIZE;
  if (rc == 0)
    rc = rpc_call_send(m->watch, event, event_bytes);
  free(event);
  /* -EPIPE: the client cancelled; its cancel callback (already run or on
   * its way) ends the stream. Anything else ends it here: the node
   * re-opens the watch and gets the full state again, which is all it
   * needs since every event is the whole state. */
  if (rc == 0 || rc == -EPIPE)
    return;
  LOG_WARNF("watch stream ended", "node=%s err=%s", m->info->name, strerror(-rc));
  char message[256];
  snprintf(message, sizeof message, "watch stream ended: %s",
           rc == -ENOBUFS ? "the client is not reading its events" : strerror(-rc));
  watch_end(m, RPC_RESOURCE_EXHAUSTED, message);
}

static void on_flush_timer(uv_timer_t *timer) {
  coord *c = timer->data;
  c->flush_scheduled = 0;
  for (size_t i = 0; i < c->nmembers; i++)
    if (c->members[i]->watch_dirty)
      watch_send(c, c->members[i]);
}

static void mark_watch(coord *c, member *m) {
  if (m == NULL || m->watch == NULL || c->shutting_down)
    return;
  m->watch_dirty = 1;
  if (!c->flush_scheduled) {
    c->flush_scheduled = 1;
    uv_timer_start(&c->flush_timer, on_flush_timer, 0, 0);
  }
}

static void mark_all_watches(coord *c) {
  for (size_t i = 0; i < c->nmembers; i++)
    mark_watch(c, c->members[i]);
}

void coord__mark_job_watches(coord *c, const cjob *j) {
  for (size_t i = 0; i < j->msg->n_placement; i++)
    mark_watch(c, coord__find_member(c, j->msg->placement[i]->node));
}

static void on_watch_cancelled(rpc_call *call, void *arg) {
  member *m = arg;
  if (m->watch == call) {
    m->watch = NULL;
    m->watch_dirty = 0;
  }
  rpc_call_finish(call, RPC_CANCELLED, "watch cancelled", NULL, 0);
}

/* ------------------------------------------------------------------------ */
/* Job state                                                                */
/* ------------------------------------------------------------------------ */

/* Derives j's state, reason and step from the members and their reports
 * (see docs/control-plane.md, "Job states"), and tells the job's nodes if
 * the state or reason changed. */
static void derive_job(coord *c, cjob *j) {
  if (j->deleting)
    return;
  size_t n = j->msg->n_placement;
  const char *absent[CTL_MAX_RANKS], *building[CTL_MAX_RANKS];
  size_t nabsent = 0, nbuilding = 0;
  const char *departed_reason = NULL, *error_node = NULL;
  const char *error = NULL;
  int rejoined = 0, have_step = 0;
  uint64_t step = 0;
  for (size_t i = 0; i < n && i < CTL_MAX_RANKS; i++) {
    const char *node = j->msg->placement[i]->node;
    node_mark *mark = &j->marks[i];
    const member *m = coord__find_member(c, node);
    const job_report *r = m != NULL ? find_report(m, j->msg->name) : NULL;
    if (r != NULL && (!have_step || r->step < step)) {
      step = r->step;
      have_step = 1;
    }
    /* A node that came back clears its departure once it has rebuilt the
     * job's ranks. */
    if (mark->departed && r != NULL && r->ready && r->error[0] == '\0')
      mark->departed = 0;
    if (mark->departed) {
      if (departed_reason == NULL) {
        departed_reason = mark->reason;
        rejoined = m != NULL;
      }
      continue;
    }
    if (m == NULL) {
      absent[nabsent++] = node;
    } else if (r != NULL && r->error[0] != '\0') {
      if (error == NULL) {
        error = r->error;
        error_node = node;
      }
    } else if (r == NULL || !r->ready) {
      building[nbuilding++] = node;
    }
  }

  Zerod__V1__JobState state;
  char reason[COORD_REASON_BYTES], nodes[768];
  if (departed_reason != NULL) {
    state = ZEROD__V1__JOB_STATE__JOB_STATE_DEGRADED;
    if (rejoined)
      snprintf(reason, sizeof reason, "%s and re-joined; waiting for it to rebuild the job's ranks",
               departed_reason);
    else
      snprintf(reason, sizeof reason, "%s", departed_reason);
  } else if (error != NULL) {
    state = ZEROD__V1__JOB_STATE__JOB_STATE_DEGRADED;
    snprintf(reason, sizeof reason, "node '%s': %s", error_node, error);
  } else if (nabsent != 0) {
    state = ZEROD__V1__JOB_STATE__JOB_STATE_CREATING;
    format_nodes(nodes, sizeof nodes, absent, nabsent);
    snprintf(reason, sizeof reason, "waiting for %s to join and build the job's ranks", nodes);
  } else if (nbuilding != 0) {
    state = ZEROD__V1__JOB_STATE__JOB_STATE_CREATING;
    format_nodes(nodes, sizeof nodes, building, nbuilding);
    snprintf(reason, sizeof reason, "waiting for %s to build the job's ranks", nodes);
  } else {
    state = ZEROD__V1__JOB_STATE__JOB_STATE_READY;
    reason[0] = '\0';
  }
  /* A node's error may have been cut inside a UTF-8 character above, and
   * the reason goes to nodes and clients whose decoders refuse that. */
  ctl_text_sanitize(reason, sizeof reason - 1);
  if (have_step)
    j->step = step;
  if (state != j->state || strcmp(reason, j->reason) != 0) {
    char quoted[COORD_REASON_BYTES + 64];
    LOG_INFOF("job state changed", "job=%s state=%s reason=%s", j->msg->name,
              protobuf_c_enum_descriptor_get_value(&zerod__v1__job_state__descriptor, state)->name,
              log_quote(reason, quoted, sizeof quoted));
    j->state = state;
    snprintf(j->reason, sizeof j->reason, "%s", reason);
    coord__mark_job_watches(c, j);
  }
  coord__ckpt_job_changed(c, j);
}

/* Returns 1 if a live placement node of j still reports it. */
static int job_still_reported(const coord *c, const cjob *j) {
  for (size_t i = 0; i < j->msg->n_placement; i++) {
    const member *m = coord__find_member(c, j->msg->placement[i]->node);
    if (m != NULL && find_report(m, j->msg->name) != NULL)
      return 1;
  }
  return 0;
}

static void job_free(coord *c, cjob *j) {
  if (j == NULL)
    return;
  coord__kv_clear(c, j);
  coord__kv_waiters_end(j, RPC_NOT_FOUND, "the job is gone");
  ctl_free(&j->msg->base);
  free(j->token_sha256);
  free(j->read_tokens);
  free(j->marks);
  free(j);
}

/* Re-derives the jobs placed on node (every job when node is NULL), and
 * forgets the deleting ones that no live placement node reports any more. */
static void reconcile(coord *c, const char *node) {
  size_t i = 0;
  int forgot = 0;
  while (i < c->njobs) {
    cjob *j = c->jobs[i];
    if (node != NULL && coord__placement_of(j, node) < 0) {
      i++;
      continue;
    }
    if (j->deleting && !job_still_reported(c, j)) {
      LOG_INFOF("job deleted", "job=%s id=%" PRIu64, j->msg->name, j->msg->id);
      memmove(&c->jobs[i], &c->jobs[i + 1], (c->njobs - i - 1) * sizeof *c->jobs);
      c->njobs--;
      job_free(c, j);
      forgot = 1;
      continue;
    }
    derive_job(c, j);
    i++;
  }
  /* A forgotten job's checkpoints can move aside now (ckpt_retire.c). */
  if (forgot)
    coord__ckpt_retire_pending(c);
}

/* Adds a read token's hash (64 hex digits) to j, dropping the oldest when
 * it has COORD_MAX_READ_TOKENS. Returns 0 or -ENOMEM. */
int coord__job_add_read_token(cjob *j, const char *hash) {
  if (j->read_tokens == NULL) {
    j->read_tokens = calloc(COORD_MAX_READ_TOKENS, sizeof *j->read_tokens);
    if (j->read_tokens == NULL)
      return -ENOMEM;
    for (size_t i = 0; i < COORD_MAX_READ_TOKENS; i++)
      j->read_token_ptrs[i] = j->read_tokens[i];
  }
  if (j->n_read_tokens == COORD_MAX_READ_TOKENS) {
    memmove(j->read_tokens[0], j->read_tokens[1],
            (COORD_MAX_READ_TOKENS - 1) * sizeof j->read_tokens[0]);
    j->n_read_tokens--;
  }
  snprintf(j->read_tokens[j->n_read_tokens++], DIGEST_HEX_BYTES, "%s", hash);
  return 0;
}

/* token_sha256: the owner token's hash, 64 hex digits (the token itself
 * is never kept). */
cjob *coord__job_new(Zerod__V1__Job *msg, const char *token_sha256) {
  cjob *j = calloc(1, sizeof *j);
  if (j == NULL)
    return NULL;
  j->msg = msg;
  j->token_sha256 = strdup(token_sha256);
  j->marks = calloc(msg->n_placement ? msg->n_placement : 1, sizeof *j->marks);
  if (j->token_sha256 == NULL || j->marks == NULL) {
    free(j->token_sha256);
    free(j->marks);
    free(j);
    return NULL;
  }
  j->state = ZEROD__V1__JOB_STATE__JOB_STATE_UNSPECIFIED;
  j->epoch = msg->epoch ? msg->epoch : 1;
  j->step = msg->step;
  return j;
}

/* ------------------------------------------------------------------------ */
/* Request plumbing                                                         */
/* ------------------------------------------------------------------------ */

void *coord__begin(coord *c, rpc_call *call, const char *path, const uint8_t *request,
                   size_t request_bytes) {
  coord_caller who;
  return coord__begin_as(c, call, path, request, request_bytes, &who);
}

void *coord__begin_as(coord *c, rpc_call *call, const char *path, const uint8_t *request,
                      size_t request_bytes, coord_caller *caller) {
  if (c->shutting_down) {
    rpc_call_finish(call, RPC_UNAVAILABLE, "coordinator shutting down", NULL, 0);
    return NULL;
  }
  char err[512];
  coord_caller who;
  int status = coord__caller(c, call, &who);
  if (status != 0) {
    rpc_call_finish(call, status, "no credentials", NULL, 0);
    return NULL;
  }
  ProtobufCMessage *msg = NULL;
  status = ctl_decode(path, request, request_bytes, &msg, err, sizeof err);
  if (status != 0) {
    rpc_call_finish(call, status, err, NULL, 0);
    return NULL;
  }
  char audit[512];
  status = coord__authorize(c, &who, path, msg, audit, sizeof audit, err, sizeof err);
  if (status != 0) {
    LOG_WARNF("call refused", "method=%s principal=%s status=%s reason=\"%s\"", path, who.name,
              rpc_status_name(status), err);
    if (audit[0] != '\0')
      rpc_call_audit(call, who.name, audit);
    rpc_call_finish(call, status, err, NULL, 0);
    ctl_free(msg);
    return NULL;
  }
  if (audit[0] != '\0')
    rpc_call_audit(call, who.name, audit);
  *caller = who;
  return msg;
}

int coord__add_methods(coord *c, rpc_server *server, const coord_method *methods, size_t count) {
  for (size_t i = 0; i < count; i++) {
    int rc = rpc_server_add_method(server, methods[i].path, methods[i].kind, methods[i].handler, c);
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* Finds the member that node and session name, or answers NOT_FOUND. */
static member *member_or_not_found(coord *c, rpc_call *call, const char *node, uint64_t session) {
  member *m = coord__find_member(c, node);
  if (m == NULL || m->session != session) {
    coord__finish_error(
        call, RPC_NOT_FOUND,
        "node '%s' is not a member (lease expired or coordinator restarted); join again", node);
    return NULL;
  }
  return m;
}

/* ------------------------------------------------------------------------ */
/* Cluster                                                                  */
/* ------------------------------------------------------------------------ */

static void member_free(member *m) {
  if (m == NULL)
    return;
  ctl_free(m->info ? &m->info->base : NULL);
  free_reports(m->reports, m->nreports);
  free(m);
}

/* Removes the member at index i: the view changes, its watch ends, and the
 * jobs placed on it degrade. why: "lease expired" or "left". */
static void member_remove(coord *c, size_t i, const char *why) {
  member *m = c->members[i];
  memmove(&c->members[i], &c->members[i + 1], (c->nmembers - i - 1) * sizeof *c->members);
  c->nmembers--;
  c->epoch++;
  char reason[160];
  snprintf(reason, sizeof reason, "node '%s' left the cluster (%s)", m->info->name, why);
  LOG_INFOF("node left", "node=%s session=%" PRIu64 " why=\"%s\" epoch=%" PRIu64, m->info->name,
            m->session, why, c->epoch);
  char message[200];
  snprintf(message, sizeof message, "%s", reason);
  watch_end(m, RPC_NOT_FOUND, message);
  /* The node's ranks are gone with it: every job placed there must rebuild
   * its communicator, under a new rendezvous epoch so that stale keys of
   * the old world are never read by the new one. */
  for (size_t k = 0; k < c->njobs; k++) {
    cjob *j = c->jobs[k];
    long at = j->deleting ? -1 : coord__placement_of(j, m->info->name);
    if (at < 0)
      continue;
    j->marks[at].departed = 1;
    snprintf(j->marks[at].reason, sizeof j->marks[at].reason, "%s", reason);
    j->epoch++;
  }
  char name[CTL_NAME_MAX_BYTES + 1];
  snprintf(name, sizeof name, "%s", m->info->name);
  member_free(m);
  reconcile(c, name);
  mark_all_watches(c);
}

/* Adds node as a member with a fresh session and lease. Returns 0 with the
 * member in *out, or an RPC status with the reason in err. */
static int join_member(coord *c, const Zerod__V1__NodeInfo *node, const member **out, char *err,
                       size_t err_bytes) {
  long at = find_member_index(c, node->name);
  uint64_t now = uv_now(c->loop);
  if (at >= 0) {
    const member *old = c->members[at];
    snprintf(err, err_bytes,
             "node '%s' is already a member (session %" PRIu64 ", lease expires in %" PRIu64 " ms)",
             node->name, old->session,
             old->lease_deadline_ms > now ? old->lease_deadline_ms - now : 0);
    return RPC_ALREADY_EXISTS;
  }
  if (c->nmembers >= COORD_MAX_MEMBERS) {
    snprintf(err, err_bytes, "the cluster has %d members (at most %d)", (int)c->nmembers,
             COORD_MAX_MEMBERS);
    return RPC_RESOURCE_EXHAUSTED;
  }
  size_t info_bytes = zerod__v1__node_info__get_packed_size(node);
  if (info_bytes > COORD_MAX_NODE_INFO) {
    snprintf(err, err_bytes, "node info is %zu bytes (at most %u)", info_bytes,
             COORD_MAX_NODE_INFO);
    return RPC_INVALID_ARGUMENT;
  }
  member **grown = realloc(c->members, (c->nmembers + 1) * sizeof *c->members);
  if (grown != NULL)
    c->members = grown;
  member *m = calloc(1, sizeof *m);
  if (grown == NULL || m == NULL || (m->info = coord__message_copy(&node->base)) == NULL ||
      random_bytes(&m->session, sizeof m->session) != 0) {
    member_free(m);
    snprintf(err, err_bytes, "coordinator out of memory or randomness");
    return RPC_RESOURCE_EXHAUSTED;
  }
  if (m->session == 0)
    m->session = 1; /* 0 is what a request without a session carries */
  m->joined_unix_ms = coord__unix_ms();
  m->lease_deadline_ms = now + (uint64_t)c->options.lease_ttl_ms;
  at = -at - 1;
  memmove(&c->members[at + 1], &c->members[at], (c->nmembers - (size_t)at) * sizeof *c->members);
  c->members[at] = m;
  c->nmembers++;
  c->epoch++;
  char address[600];
  LOG_INFOF("node joined", "node=%s session=%" PRIu64 " address=%s ranks=%u epoch=%" PRIu64,
            node->name, m->session, log_quote(node->address, address, sizeof address), node->ranks,
            c->epoch);
  reconcile(c, node->name);
  mark_all_watches(c);
  *out = m;
  return 0;
}

static void on_join(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__JoinRequest *req = coord__begin(c, call, CTL_JOIN, request, request_bytes);
  if (req == NULL)
    return;
  const member *m;
  char err[512];
  int status = join_member(c, req->node, &m, err, sizeof err);
  view_msg v;
  if (status != 0) {
    coord__finish_error(call, status, "%s", err);
  } else if (view_build(c, &v) != 0) {
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
  } else {
    Zerod__V1__JoinReply reply = ZEROD__V1__JOIN_REPLY__INIT;
    reply.session = m->session;
    reply.lease_ttl_ms = (uint32_t)c->options.lease_ttl_ms;
    reply.view = &v.view;
    coord__finish_message(call, &reply.base);
    view_free(&v);
  }
  ctl_free(&req->base);
}

int coord_join_local(coord *c, const Zerod__V1__NodeInfo *node, uint64_t *session_out,
                     int *lease_ttl_ms_out, char *err, size_t err_bytes) {
  const member *m;
  int status = join_member(c, node, &m, err, err_bytes);
  if (status == 0) {
    *session_out = m->session;
    *lease_ttl_ms_out = c->options.lease_ttl_ms;
  }
  return status;
}

static void on_heartbeat(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__HeartbeatRequest *req = coord__begin(c, call, CTL_HEARTBEAT, request, request_bytes);
  if (req == NULL)
    return;
  member *m = member_or_not_found(c, call, req->node, req->session);
  if (m == NULL)
    goto out;
  job_report *reports = calloc(req->n_jobs ? req->n_jobs : 1, sizeof *reports);
  int ok = reports != NULL;
  for (size_t i = 0; ok && i < req->n_jobs; i++) {
    reports[i].job = strdup(req->jobs[i]->job);
    reports[i].error = strdup(req->jobs[i]->error);
    reports[i].ready = req->jobs[i]->ready;
    reports[i].step = req->jobs[i]->step;
    ok = reports[i].job != NULL && reports[i].error != NULL;
  }
  if (!ok) {
    free_reports(reports, req->n_jobs);
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
    goto out;
  }
  qsort(reports, req->n_jobs, sizeof *reports, compare_reports);
  free_reports(m->reports, m->nreports);
  m->reports = reports;
  m->nreports = req->n_jobs;
  m->lease_deadline_ms = uv_now(c->loop) + (uint64_t)c->options.lease_ttl_ms;
  reconcile(c, m->info->name);
  coord__ckpt_heartbeat(c, m, req);

  Zerod__V1__HeartbeatReply reply = ZEROD__V1__HEARTBEAT_REPLY__INIT;
  reply.lease_ttl_ms = (uint32_t)c->options.lease_ttl_ms;
  reply.epoch = c->epoch;
  coord__finish_message(call, &reply.base);
out:
  ctl_free(&req->base);
}

static void on_leave(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__LeaveRequest *req = coord__begin(c, call, CTL_LEAVE, request, request_bytes);
  if (req == NULL)
    return;
  if (member_or_not_found(c, call, req->node, req->session) != NULL) {
    member_remove(c, (size_t)find_member_index(c, req->node), "left");
    Zerod__V1__LeaveReply reply = ZEROD__V1__LEAVE_REPLY__INIT;
    coord__finish_message(call, &reply.base);
  }
  ctl_free(&req->base);
}

static void on_get_view(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  coord_caller who;
  ProtobufCMessage *req = coord__begin_as(c, call, CTL_GET_VIEW, request, request_bytes, &who);
  if (req == NULL)
    return;
  view_msg v;
  if (view_build(c, &v) == 0) {
    /* A session is what Heartbeat, Leave and Watch take: only nodes and
     * admins see them. */
    if (who.role != AUTH_ADMIN && who.role != AUTH_NODE) {
      for (size_t i = 0; i < v.view.n_members; i++)
        v.members[i].session = 0;
    }
    coord__finish_message(call, &v.view.base);
    view_free(&v);
  } else {
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
  }
  ctl_free(req);
}

static void on_watch(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__WatchRequest *req = coord__begin(c, call, CTL_WATCH, request, request_bytes);
  if (req == NULL)
    return;
  member *m = member_or_not_found(c, call, req->node, req->session);
  if (m != NULL) {
    /* One stream per member: a node that re-opens its watch (after a
     * network blip it may not have noticed) replaces the old one. */
    watch_end(m, RPC_ABORTED, "replaced by a newer Watch of the same node");
    m->watch = call;
    rpc_call_set_cancel(call, on_watch_cancelled, m);
    LOG_DEBUGF("watch opened", "node=%s session=%" PRIu64, m->info->name, m->session);
    watch_send(c, m);
  }
  ctl_free(&req->base);
}

/* The lease sweep: members whose lease passed leave the view. */
static void on_lease_timer(uv_timer_t *timer) {
  coord *c = timer->data;
  uint64_t now = uv_now(c->loop);
  size_t i = 0;
  while (i < c->nmembers) {
    if (c->members[i]->lease_deadline_ms <= now)
      member_remove(c, i, "lease expired");
    else
      i++;
  }
  coord__ckpt_tick(c);
}

/* ------------------------------------------------------------------------ */
/* Jobs                                                                     */
/* ------------------------------------------------------------------------ */

/* Fills an effective config (torch.optim's defaults for zero fields: the
 * node's job_config_finish itself, model/config.c) so that GetJob shows
 * what will run. in has been validated by ctl_check_job_config. */
static void effective_config(const Zerod__V1__JobConfig *in, job_config_msg *out) {
  /* max_live_bytes stays 0 when it is: each node then uses its own
   * default. */
  job_config c;
  char err[256];
  if (job_config_from_proto(in, &c, err, sizeof err) != 0 ||
      job_config_finish(&c, 0, err, sizeof err) != 0) {
    /* Not reached: ctl_check_job_config made the same two calls. */
    job_config_from_proto(NULL, &c, err, sizeof err);
    job_config_finish(&c, 0, err, sizeof err);
  }
  job_config_to_proto(&c, out);
}

/* Picks the job's nodes into chosen[nodes] (names owned by the members),
 * or writes why not to err and returns RPC_FAILED_PRECONDITION. */
static int place_job(coord *c, const Zerod__V1__CreateJobRequest *req, const char **chosen,
                     char *err, size_t err_bytes) {
  if (req->n_node_names != 0) {
    for (size_t i = 0; i < req->n_node_names; i++) {
      const member *m = coord__find_member(c, req->node_names[i]);
      if (m == NULL) {
        snprintf(err, err_bytes, "node '%s' is not a member", req->node_names[i]);
        return RPC_FAILED_PRECONDITION;
      }
      if (m->info->ranks < req->ranks_per_node) {
        snprintf(err, err_bytes, "node '%s' can host %u ranks; the job needs %u per node",
                 m->info->name, m->info->ranks, req->ranks_per_node);
        return RPC_FAILED_PRECONDITION;
      }
      chosen[i] = m->info->name;
    }
    return 0;
  }
  size_t found = 0;
  for (size_t i = 0; i < c->nmembers && found < req->nodes; i++)
    if (c->members[i]->info->ranks >= req->ranks_per_node)
      chosen[found++] = c->members[i]->info->name;
  if (found == req->nodes)
    return 0;
  size_t able = 0;
  for (size_t i = 0; i < c->nmembers; i++)
    able += c->members[i]->info->ranks >= req->ranks_per_node;
  if (able == c->nmembers)
    snprintf(err, err_bytes, "job needs %u nodes that can host %u ranks each; %zu are members",
             req->nodes, req->ranks_per_node, c->nmembers);
  else
    snprintf(err, err_bytes,
             "job needs %u nodes that can host %u ranks each; %zu of the %zu members can",
             req->nodes, req->ranks_per_node, able, c->nmembers);
  return RPC_FAILED_PRECONDITION;
}

/* Creates the job req describes (decoded and validated), placed by
 * place_job. An empty token is replaced by a random one unless
 * token_as_given (an in-process create, whose workers attached without
 * one). Returns 0 with the job in *out, or an RPC status with the reason in
 * err and nothing changed. */
/* What a job asks of its tenant's quotas: its per-rank (per-node for
 * sessions) quota times its ranks (nodes). live-bytes falls back to the
 * config's max_live_bytes. */
static uint64_t job_quota_use(auth_quota_kind kind, const Zerod__V1__Quotas *q,
                              const Zerod__V1__JobConfig *config, uint32_t nodes,
                              uint32_t ranks_per_node) {
  uint64_t world = (uint64_t)nodes * ranks_per_node;
  switch (kind) {
  case AUTH_QUOTA_JOBS:
    return 1;
  case AUTH_QUOTA_SESSIONS:
    return q != NULL ? (uint64_t)q->max_sessions * nodes : 0;
  case AUTH_QUOTA_HOST_BYTES:
    return q != NULL ? q->max_host_bytes * world : 0;
  case AUTH_QUOTA_DEVICE_BYTES:
    return q != NULL ? q->max_device_bytes * world : 0;
  case AUTH_QUOTA_LIVE_BYTES: {
    uint64_t live = q != NULL ? q->max_live_bytes : 0;
    if (live == 0 && config != NULL)
      live = config->max_live_bytes;
    return live * world;
  }
  default:
    return 0;
  }
}

/* The per-job quota a tenant's quota of kind needs set, as zerodctl
 * spells it. */
static const char *const quota_flags[AUTH_NQUOTAS] = {
    NULL, "max_sessions (--max-sessions)", "max_host_bytes (--max-host-bytes)",
    "max_device_bytes (--max-device-bytes)", "max_live_bytes (--max-live-bytes)"};

/* Admits a job of tenant against the tenant's quotas (auth.h): each
 * limit must hold with the job's share added. Returns 0, or
 * RESOURCE_EXHAUSTED naming the quota, or INVALID_ARGUMENT when the
 * tenant's limit needs a per-job quota the request leaves unset (a job
 * without it could use any amount). */
static int tenant_admit(const coord *c, const char *tenant, const Zerod__V1__CreateJobRequest *req,
                        char *err, size_t err_bytes) {
  if (c->auth == NULL || tenant[0] == '\0')
    return 0;
  const auth_quota *q = auth_quota_of(c->auth, tenant);
  if (q == NULL)
    return 0;
  for (int k = 0; k < AUTH_NQUOTAS; k++) {
    if (!(q->limited & (1u << k)))
      continue;
    uint64_t want = job_quota_use((auth_quota_kind)k, req->quotas, req->config, req->nodes,
                                  req->ranks_per_node);
    if (want == 0 && k != AUTH_QUOTA_JOBS) {
      snprintf(err, err_bytes, "tenant %s has a %s quota: the job must set quotas.%s", tenant,
               auth_quota_name((auth_quota_kind)k), quota_flags[k]);
      return RPC_INVALID_ARGUMENT;
    }
    uint64_t used = 0;
    for (size_t i = 0; i < c->njobs; i++) {
      const cjob *j = c->jobs[i];
      if (j->deleting || strcmp(j->msg->tenant, tenant) != 0)
        continue;
      used += job_quota_use((auth_quota_kind)k, j->msg->quotas, j->msg->config, j->msg->nodes,
                            j->msg->ranks_per_node);
    }
    if (used + want > q->limit[k]) {
      snprintf(err, err_bytes,
               "tenant %s's %s quota is %" PRIu64 "; its jobs use %" PRIu64
               " and this one asks %" PRIu64,
               tenant, auth_quota_name((auth_quota_kind)k), q->limit[k], used, want);
      return RPC_RESOURCE_EXHAUSTED;
    }
  }
  return 0;
}

static int create_job(coord *c, const Zerod__V1__CreateJobRequest *req, const char *tenant,
                      int token_as_given, const cjob **out, char *token_out, char *err,
                      size_t err_bytes) {
  long at = find_job_index(c, req->name);
  if (at >= 0) {
    snprintf(err, err_bytes, "job '%s' %s", req->name,
             c->jobs[at]->deleting ? "is still being deleted" : "already exists");
    return RPC_ALREADY_EXISTS;
  }
  if (c->njobs >= COORD_MAX_JOBS) {
    snprintf(err, err_bytes, "the coordinator has %zu jobs (at most %d)", c->njobs, COORD_MAX_JOBS);
    return RPC_RESOURCE_EXHAUSTED;
  }
  int status = coord__ckpt_name_free(c, req->name, err, err_bytes);
  if (status != 0)
    return status;
  status = tenant_admit(c, tenant, req, err, err_bytes);
  if (status != 0)
    return status;
  const char *chosen[CTL_MAX_RANKS];
  status = place_job(c, req, chosen, err, err_bytes);
  if (status != 0)
    return status;

  char token[CTL_TOKEN_MAX_BYTES + 1];
  if (req->token[0] != '\0' || token_as_given) {
    snprintf(token, sizeof token, "%s", req->token);
  } else {
    if (random_token(token) != 0) {
      snprintf(err, err_bytes, "cannot make a token: %s", strerror(errno));
      return RPC_UNAVAILABLE;
    }
  }

  /* The job as stored, built on the stack and copied into one allocation
   * tree. */
  job_config_msg effective;
  effective_config(req->config, &effective);
  Zerod__V1__JobConfig config = effective.config; /* its pointers stay in effective */
  Zerod__V1__Quotas quotas = ZEROD__V1__QUOTAS__INIT;
  if (req->quotas != NULL) {
    quotas.max_live_bytes = req->quotas->max_live_bytes;
    quotas.max_host_bytes = req->quotas->max_host_bytes;
    quotas.max_device_bytes = req->quotas->max_device_bytes;
    quotas.max_sessions = req->quotas->max_sessions;
  }
  Zerod__V1__RankPlacement placement[CTL_MAX_RANKS];
  Zerod__V1__RankPlacement *placement_pointers[CTL_MAX_RANKS];
  for (uint32_t i = 0; i < req->nodes; i++) {
    zerod__v1__rank_placement__init(&placement[i]);
    placement[i].node = (char *)chosen[i];
    placement[i].first_rank = i * req->ranks_per_node;
    placement[i].ranks = req->ranks_per_node;
    placement_pointers[i] = &placement[i];
  }
  Zerod__V1__Job job = ZEROD__V1__JOB__INIT;
  job.name = req->name;
  job.id = c->next_job_id;
  job.config = &config;
  job.nodes = req->nodes;
  job.ranks_per_node = req->ranks_per_node;
  job.world_size = req->nodes * req->ranks_per_node;
  job.quotas = &quotas;
  job.n_placement = req->nodes;
  job.placement = placement_pointers;
  job.created_unix_ms = coord__unix_ms();
  job.epoch = 1;
  job.tenant = (char *)tenant;
  /* Kept with the job (and so in the state file) only when it asks for
   * something: an all-zero policy is no policy. */
  const Zerod__V1__CheckpointPolicy *policy = req->checkpoint_policy;
  if (policy != NULL && (policy->every_steps != 0 || policy->every_seconds != 0))
    job.checkpoint_policy = (Zerod__V1__CheckpointPolicy *)policy;
  Zerod__V1__Job *copy = coord__message_copy(&job.base);
  char token_sha256[DIGEST_HEX_BYTES];
  digest_sha256_hex(token, token_sha256);
  cjob *j = copy != NULL ? coord__job_new(copy, token_sha256) : NULL;
  if (j == NULL) {
    ctl_free(copy ? &copy->base : NULL);
    snprintf(err, err_bytes, "coordinator out of memory");
    return RPC_RESOURCE_EXHAUSTED;
  }
  cjob **grown = realloc(c->jobs, (c->njobs + 1) * sizeof *c->jobs);
  if (grown == NULL) {
    job_free(c, j);
    snprintf(err, err_bytes, "coordinator out of memory");
    return RPC_RESOURCE_EXHAUSTED;
  }
  c->jobs = grown;

  if (coord__state_write(c, j, NULL, c->next_job_id + 1, err, err_bytes) != 0) {
    LOG_ERRORF("job not created", "job=%s err=\"%s\"", req->name, err);
    job_free(c, j);
    return RPC_UNAVAILABLE;
  }
  c->next_job_id++;
  at = -at - 1;
  memmove(&c->jobs[at + 1], &c->jobs[at], (c->njobs - (size_t)at) * sizeof *c->jobs);
  c->jobs[at] = j;
  c->njobs++;
  LOG_INFOF("job created", "job=%s id=%" PRIu64 " nodes=%u ranks_per_node=%u tenant=%s", req->name,
            j->msg->id, req->nodes, req->ranks_per_node, tenant);
  derive_job(c, j);
  coord__mark_job_watches(c, j);
  memcpy(token_out, token, strlen(token) + 1);
  *out = j;
  return 0;
}

static void on_create_job(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  coord_caller who;
  Zerod__V1__CreateJobRequest *req =
      coord__begin_as(c, call, CTL_CREATE_JOB, request, request_bytes, &who);
  if (req == NULL)
    return;
  /* coord__begin_as let the caller make it: an admin names any tenant or
   * none, a tenant its own (or none, meaning its own). */
  char err[PATH_MAX + 256];
  const char *tenant = req->tenant[0] != '\0' ? req->tenant : who.tenant;
  const cjob *j;
  char token[CTL_TOKEN_MAX_BYTES + 1];
  int status = create_job(c, req, tenant, 0, &j, token, err, sizeof err);
  if (status != 0) {
    coord__finish_error(call, status, "%s", err);
  } else {
    Zerod__V1__Job view;
    job_view(j, &view);
    Zerod__V1__CreateJobReply reply = ZEROD__V1__CREATE_JOB_REPLY__INIT;
    reply.job = &view;
    reply.token = token; /* the only time it leaves the coordinator */
    coord__finish_message(call, &reply.base);
  }
  ctl_free(&req->base);
}

int coord_create_job_local(coord *c, const char *name, const char *token,
                           const Zerod__V1__JobConfig *config, const char *node, uint32_t ranks,
                           uint64_t *id_out, uint64_t *epoch_out, char *err, size_t err_bytes) {
  if (c->shutting_down) {
    snprintf(err, err_bytes, "coordinator shutting down");
    return RPC_UNAVAILABLE;
  }
  Zerod__V1__CreateJobRequest req = ZEROD__V1__CREATE_JOB_REQUEST__INIT;
  req.name = (char *)name;
  req.token = (char *)(token != NULL ? token : "");
  req.config = (Zerod__V1__JobConfig *)config;
  req.nodes = 1;
  req.ranks_per_node = ranks;
  char *nodes[1] = {(char *)node};
  req.n_node_names = 1;
  req.node_names = nodes;
  const cjob *j;
  char given[CTL_TOKEN_MAX_BYTES + 1];
  int status = create_job(c, &req, "", 1, &j, given, err, err_bytes);
  if (status == 0) {
    *id_out = j->msg->id;
    *epoch_out = j->epoch;
  }
  return status;
}

static void on_get_job(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__GetJobRequest *req = coord__begin(c, call, CTL_GET_JOB, request, request_bytes);
  if (req == NULL)
    return;
  const cjob *j = coord__find_job(c, req->name);
  if (j == NULL) {
    coord__finish_error(call, RPC_NOT_FOUND, "no job named '%s'", req->name);
  } else {
    Zerod__V1__Job view;
    job_view(j, &view);
    coord__finish_message(call, &view.base);
  }
  ctl_free(&req->base);
}

/* ListJobs shows each caller the jobs it may read; a node, those placed
 * on it. */
static int job_listed_for(const coord_caller *who, const cjob *j) {
  return who->role == AUTH_NODE ? coord__placed_on(who, j) : coord__may_read_job(who, j);
}

/* A new read token for a job: made here, its hash kept (durably, before
 * the reply) and sent to the job's nodes, the token itself given to the
 * caller alone. */
static void on_issue_read_token(rpc_call *call, const uint8_t *request, size_t request_bytes,
                                void *arg) {
  coord *c = arg;
  Zerod__V1__IssueReadTokenRequest *req =
      coord__begin(c, call, CTL_ISSUE_READ_TOKEN, request, request_bytes);
  if (req == NULL)
    return;
  cjob *j = coord__find_job(c, req->job);
  char token[COORD_TOKEN_HEX_DIGITS + 1], hash[DIGEST_HEX_BYTES], err[512];
  if (j == NULL || j->deleting) {
    coord__finish_error(call, RPC_NOT_FOUND, "no job named '%s'", req->job);
  } else if (random_token(token) != 0) {
    coord__finish_error(call, RPC_UNAVAILABLE, "cannot make a token: %s", strerror(errno));
  } else {
    digest_sha256_hex(token, hash);
    /* Kept only once stored: a token that a restart would forget is no
     * token to give out. */
    char dropped[DIGEST_HEX_BYTES] = "";
    if (j->n_read_tokens == COORD_MAX_READ_TOKENS)
      memcpy(dropped, j->read_tokens[0], sizeof dropped);
    if (coord__job_add_read_token(j, hash) != 0) {
      coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
    } else if (coord__state_write(c, NULL, NULL, c->next_job_id, err, sizeof err) != 0) {
      j->n_read_tokens--;
      if (dropped[0] != '\0') {
        memmove(j->read_tokens[1], j->read_tokens[0], j->n_read_tokens * sizeof j->read_tokens[0]);
        memcpy(j->read_tokens[0], dropped, sizeof dropped);
        j->n_read_tokens++;
      }
      coord__finish_error(call, RPC_UNAVAILABLE, "%s", err);
    } else {
      coord__mark_job_watches(c, j);
      Zerod__V1__IssueReadTokenReply reply = ZEROD__V1__ISSUE_READ_TOKEN_REPLY__INIT;
      reply.token = token;
      coord__finish_message(call, &reply.base);
    }
  }
  memset(token, 0, sizeof token);
  ctl_free(&req->base);
}

static void on_list_jobs(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  coord_caller who;
  ProtobufCMessage *req = coord__begin_as(c, call, CTL_LIST_JOBS, request, request_bytes, &who);
  if (req == NULL)
    return;
  Zerod__V1__Job *views = calloc(c->njobs ? c->njobs : 1, sizeof *views);
  Zerod__V1__Job **pointers = calloc(c->njobs ? c->njobs : 1, sizeof *pointers);
  if (views == NULL || pointers == NULL) {
    coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
  } else {
    size_t n = 0;
    for (size_t i = 0; i < c->njobs; i++) {
      if (!job_listed_for(&who, c->jobs[i]))
        continue;
      job_view(c->jobs[i], &views[n]);
      pointers[n] = &views[n];
      n++;
    }
    Zerod__V1__ListJobsReply reply = ZEROD__V1__LIST_JOBS_REPLY__INIT;
    reply.n_jobs = n;
    reply.jobs = pointers;
    coord__finish_message(call, &reply.base);
  }
  free(views);
  free(pointers);
  ctl_free(req);
}

static void on_delete_job(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__DeleteJobRequest *req = coord__begin(c, call, CTL_DELETE_JOB, request, request_bytes);
  if (req == NULL)
    return;
  cjob *j = coord__find_job(c, req->name);
  if (j == NULL) {
    coord__finish_error(call, RPC_NOT_FOUND, "no job named '%s'", req->name);
    goto out;
  }
  if (!j->deleting) {
    char err[PATH_MAX + 256];
    /* Its checkpoints outlive it, and their owner is recorded with it
     * (ckpt_owner.c). */
    if (coord__ckpt_retire(c, j, coord__unix_ms()) != 0) {
      coord__finish_error(call, RPC_RESOURCE_EXHAUSTED, "coordinator out of memory");
      goto out;
    }
    if (coord__state_write(c, NULL, j, c->next_job_id, err, sizeof err) != 0) {
      coord__ckpt_unretire(c, j->msg->id);
      LOG_ERRORF("job not deleted", "job=%s err=\"%s\"", req->name, err);
      coord__finish_error(call, RPC_UNAVAILABLE, "%s", err);
      goto out;
    }
    /* The job leaves every assignment now (its nodes tear it down when
     * their watch says so) and stays listed until none reports it. */
    j->deleting = 1;
    j->state = ZEROD__V1__JOB_STATE__JOB_STATE_DELETING;
    snprintf(j->reason, sizeof j->reason, "deleted; waiting for its nodes to drop it");
    char message[128];
    snprintf(message, sizeof message, "job '%s' was deleted", req->name);
    coord__kv_waiters_end(j, RPC_NOT_FOUND, message);
    coord__kv_clear(c, j);
    coord__ckpt_job_deleted(c, j);
    LOG_INFOF("job deleting", "job=%s id=%" PRIu64, req->name, j->msg->id);
    coord__mark_job_watches(c, j);
    /* The job may be forgotten at once (no node reports it), so the node
     * name that selects it must not point into it. */
    char node[CTL_NAME_MAX_BYTES + 1];
    snprintf(node, sizeof node, "%s", j->msg->placement[0]->node);
    reconcile(c, node);
  }
  Zerod__V1__DeleteJobReply reply = ZEROD__V1__DELETE_JOB_REPLY__INIT;
  coord__finish_message(call, &reply.base);
out:
  ctl_free(&req->base);
}

/* ------------------------------------------------------------------------ */
/* Health                                                                   */
/* ------------------------------------------------------------------------ */

static const char *const health_services[] = {
    "",
    "zerod.v1.Cluster",
    "zerod.v1.Jobs",
    "zerod.v1.Rendezvous",
    "zerod.v1.Checkpoints",
    "grpc.health.v1.Health",
};

/* ------------------------------------------------------------------------ */
/* Lifecycle                                                                */
/* ------------------------------------------------------------------------ */

/* Each tenant's directory in the first export root, where its exports go
 * (authz.c), made if missing with the daemon's directory mode. */
static int make_tenant_dirs(coord *c, char *err, size_t err_bytes) {
  if (c->auth == NULL || c->options.n_export_roots == 0)
    return 0;
  const char *root = c->options.export_roots[0];
  int fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    snprintf(err, err_bytes, "cannot open the export root %s: %s", root, strerror(e));
    return -e;
  }
  int rc = 0;
  for (size_t i = 0; i < auth_count(c->auth) && rc == 0; i++) {
    const char *tenant = auth_at(c->auth, i)->tenant;
    if (tenant[0] == '\0')
      continue;
    rc = filemode_mkdirat(fd, tenant);
    if (rc == -EEXIST)
      rc = 0;
    if (rc != 0)
      snprintf(err, err_bytes, "cannot make the tenant directory %s/%s: %s", root, tenant,
               strerror(-rc));
  }
  close(fd);
  return rc;
}

int coord_create(uv_loop_t *loop, const coord_options *options, coord **out, char *err,
                 size_t err_bytes) {
  *out = NULL;
  if (options->lease_ttl_ms <= 0) {
    snprintf(err, err_bytes, "the lease TTL must be > 0");
    return -EINVAL;
  }
  coord *c = calloc(1, sizeof *c);
  if (c == NULL) {
    snprintf(err, err_bytes, "out of memory");
    return -ENOMEM;
  }
  int rc;
  c->loop = loop;
  c->options = *options;
  c->next_job_id = 1;
  snprintf(c->state_path, sizeof c->state_path, "%s/coordinator.pb", options->state_dir);
  snprintf(c->tmp_path, sizeof c->tmp_path, "%s/coordinator.pb.tmp", options->state_dir);
  if (options->auth_file[0] != '\0') {
    if ((rc = auth_load(options->auth_file, &c->auth, err, err_bytes)) != 0)
      goto fail;
    LOG_INFOF("principals loaded", "path=%s principals=%zu", options->auth_file,
              auth_count(c->auth));
  }
  if ((rc = make_tenant_dirs(c, err, err_bytes)) != 0)
    goto fail;

  if (options->state_dir[0] == '\0')
    goto loaded; /* in memory only */
  /* Create the directory and its parents. */
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s", options->state_dir);
  for (char *p = path + 1;; p++) {
    if (*p != '/' && *p != '\0')
      continue;
    char saved = *p;
    *p = '\0';
    if ((rc = filemode_mkdirat(AT_FDCWD, path)) != 0 && rc != -EEXIST) {
      snprintf(err, err_bytes, "cannot create %s: %s", path, strerror(-rc));
      goto fail;
    }
    *p = saved;
    if (saved == '\0')
      break;
  }
  /* A crash during a write leaves the temporary file; the state is the
   * renamed file, so the leftover is dropped. */
  if (unlink(c->tmp_path) == 0)
    LOG_INFOF("removed an unfinished state write", "path=%s", c->tmp_path);
  if ((rc = coord__state_load(c, err, err_bytes)) != 0)
    goto fail;
  /* Recovered jobs wait for their nodes to re-join and report. */
  for (size_t i = 0; i < c->njobs; i++)
    derive_job(c, c->jobs[i]);
loaded:
  if ((rc = coord__ckpt_init(c, err, err_bytes)) != 0)
    goto fail;
  /* Deleted jobs whose checkpoints a crash kept from moving aside. */
  coord__ckpt_retire_pending(c);
  if (c->njobs != 0)
    LOG_INFOF("recovered jobs", "jobs=%zu next_job_id=%" PRIu64 " path=%s", c->njobs,
              c->next_job_id, c->state_path);

  /* uv_timer_init only fills in the handle; it cannot fail. */
  uv_timer_init(loop, &c->lease_timer);
  uv_timer_init(loop, &c->flush_timer);
  c->open_handles = 2;
  c->lease_timer.data = c;
  c->flush_timer.data = c;
  uint64_t period = (uint64_t)options->lease_ttl_ms / 4;
  if (period > COORD_SWEEP_MAX_MS)
    period = COORD_SWEEP_MAX_MS;
  if (period == 0)
    period = 1;
  uv_timer_start(&c->lease_timer, on_lease_timer, period, period);
  *out = c;
  return 0;
fail:
  for (size_t i = 0; i < c->njobs; i++)
    job_free(c, c->jobs[i]);
  free(c->jobs);
  auth_free(c->auth);
  coord__ckpt_retired_free(c);
  free(c);
  return rc;
}

int coord_register(coord *c, rpc_server *server) {
  static const coord_method methods[] = {
      {CTL_JOIN, RPC_UNARY, on_join},
      {CTL_HEARTBEAT, RPC_UNARY, on_heartbeat},
      {CTL_LEAVE, RPC_UNARY, on_leave},
      {CTL_GET_VIEW, RPC_UNARY, on_get_view},
      {CTL_WATCH, RPC_SERVER_STREAM, on_watch},
      {CTL_CREATE_JOB, RPC_UNARY, on_create_job},
      {CTL_GET_JOB, RPC_UNARY, on_get_job},
      {CTL_LIST_JOBS, RPC_UNARY, on_list_jobs},
      {CTL_DELETE_JOB, RPC_UNARY, on_delete_job},
      {CTL_ISSUE_READ_TOKEN, RPC_UNARY, on_issue_read_token},
  };
  int rc = coord__add_methods(c, server, methods, sizeof methods / sizeof methods[0]);
  if (rc == 0)
    rc = coord__kv_register(c, server);
  if (rc != 0)
    return rc;
  /* Health (Check and Watch): SERVING until coord_shutdown. */
  rc = health_register(server, health_services, sizeof health_services / sizeof health_services[0],
                       &c->health);
  if (rc != 0)
    return rc;
  health_set(c->health, 1);
  /* These answer while other clients flood the server (rpc.h). */
  rpc_server_set_priority(server, CTL_HEARTBEAT);
  rpc_server_set_priority(server, CTL_JOIN);
  rpc_server_set_priority(server, CTL_WATCH);
  /* Callers are named as their calls arrive, and counted by that name. */
  rc = rpc_server_set_identify(server, coord__identify, c, c->auth ? auth_count(c->auth) : 0);
  if (rc != 0)
    return rc;
  return coord__ckpt_register(c, server);
}

static void on_timer_closed(uv_handle_t *handle) {
  coord *c = handle->data;
  c->open_handles--;
}

void coord_shutdown(coord *c) {
  if (c == NULL || c->shutting_down)
    return;
  c->shutting_down = 1;
  health_shutdown(c->health);
  for (size_t i = 0; i < c->nmembers; i++)
    watch_end(c->members[i], RPC_UNAVAILABLE, "coordinator shutting down");
  for (size_t i = 0; i < c->njobs; i++)
    coord__kv_waiters_end(c->jobs[i], RPC_UNAVAILABLE, "coordinator shutting down");
  coord__ckpt_shutdown(c);
  uv_close((uv_handle_t *)&c->lease_timer, on_timer_closed);
  uv_close((uv_handle_t *)&c->flush_timer, on_timer_closed);
}

void coord_destroy(coord *c) {
  if (c == NULL)
    return;
  if (c->open_handles != 0)
    LOG_ERRORF("coordinator freed with open timers", "handles=%d", c->open_handles);
  health_free(c->health);
  coord__ckpt_destroy(c);
  for (size_t i = 0; i < c->nmembers; i++)
    member_free(c->members[i]);
  free(c->members);
  for (size_t i = 0; i < c->njobs; i++)
    job_free(c, c->jobs[i]);
  free(c->jobs);
  auth_free(c->auth);
  coord__ckpt_retired_free(c);
  free(c);
}
