/* The registry (coord_impl.h): the coordinator's members and jobs at the
 * bottom of every other file here. It looks them up, builds the messages
 * that show them (views, jobs as replies show them, Watch events), keeps
 * the nodes' Watch streams, and derives each job's state.
 *
 * Every change that a node must know about marks that node's Watch stream
 * dirty, and a zero-delay timer sends each dirty stream one full
 * WatchEvent on the next turn of the loop, so a burst of changes (three
 * leases expiring in one sweep) costs one event per node, not one per
 * change.
 *
 * Job states are never stored: they are derived (coord__derive_job) from
 * the members and their last heartbeat's reports whenever either changes.
 *
 * The registry calls no file above it: what they add to its work (a job's
 * checkpoint order in an Assignment, the end of a job's keys) comes in
 * through c->hooks, set by coord_create. Loop thread only. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "coord_impl.h"
#include "ctl_decode.h"
#include "log.h"

/* ------------------------------------------------------------------------ */
/* Small helpers                                                            */
/* ------------------------------------------------------------------------ */

int64_t coord__unix_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int coord__random_bytes(void *buf, size_t len) {
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

void coord__append(char *buf, size_t buf_bytes, size_t *len, const char *fmt, ...) {
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
  coord__append(buf, buf_bytes, &len, count == 1 ? "node " : "nodes ");
  for (size_t i = 0; i < count && i < 8; i++)
    coord__append(buf, buf_bytes, &len, "%s%s", i ? ", " : "", names[i]);
  if (count > 8)
    coord__append(buf, buf_bytes, &len, " and %zu more", count - 8);
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

long coord__member_index(const coord *c, const char *name) {
  return search_by_name((void *const *)c->members, c->nmembers, member_name, name);
}

member *coord__find_member(const coord *c, const char *name) {
  long i = coord__member_index(c, name);
  return i >= 0 ? c->members[i] : NULL;
}

long coord__job_index(const coord *c, const char *name) {
  return search_by_name((void *const *)c->jobs, c->njobs, job_name, name);
}

cjob *coord__find_job(const coord *c, const char *name) {
  long i = coord__job_index(c, name);
  return i >= 0 ? c->jobs[i] : NULL;
}

long coord__placement_of(const cjob *j, const char *node) {
  for (size_t i = 0; i < j->msg->n_placement; i++)
    if (strcmp(j->msg->placement[i]->node, node) == 0)
      return (long)i;
  return -1;
}

int coord__compare_reports(const void *a, const void *b) {
  return strcmp(((const job_report *)a)->job, ((const job_report *)b)->job);
}

const job_report *coord__find_report(const member *m, const char *job) {
  if (m->nreports == 0)
    return NULL; /* bsearch must not be given a NULL array */
  job_report key = {.job = (char *)job};
  return bsearch(&key, m->reports, m->nreports, sizeof *m->reports, coord__compare_reports);
}

const job_report *coord__placement_report(const coord *c, const cjob *j, size_t i) {
  const member *m = coord__find_member(c, j->msg->placement[i]->node);
  return m != NULL ? coord__find_report(m, j->msg->name) : NULL;
}

void coord__free_reports(job_report *reports, size_t count) {
  for (size_t i = 0; i < count; i++) {
    free(reports[i].job);
    free(reports[i].error);
    free(reports[i].ranks);
  }
  free(reports);
}

/* ------------------------------------------------------------------------ */
/* Messages: views, jobs, watch events                                      */
/* ------------------------------------------------------------------------ */

/* The job as replies show it: the stored message with the live fields.
 * Points into j; valid until j changes. */
void coord__job_view(const cjob *j, Zerod__V1__Job *out) {
  *out = *j->msg;
  out->state = j->state;
  out->reason = (char *)j->reason;
  out->step = j->step;
  out->epoch = j->epoch;
  out->last_recovery = (char *)j->ckpt.last_recovery;
  out->stalled = (char *)j->stalled;
  out->replica_step = j->ckpt.mem.step;
}

int coord__view_build(const coord *c, view_msg *v) {
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

void coord__view_free(view_msg *v) {
  free(v->members);
  free(v->pointers);
}

/* Packs the WatchEvent for m (the view and m's assignments) into a malloc'd
 * buffer. Returns 0 or -ENOMEM. */
/* Whether j lost a node that is a member again, as are all its other
 * nodes: its nodes build its ranks afresh (Assignment.rebuild), and it is
 * then recovered from its newest checkpoint (ckpt_recover.c). */
static int rebuildable(const coord *c, const cjob *j) {
  int departed = 0;
  for (size_t i = 0; i < j->msg->n_placement; i++) {
    if (coord__find_member(c, j->msg->placement[i]->node) == NULL)
      return 0;
    departed |= j->marks[i].departed;
  }
  return departed && !j->deleting;
}

static int watch_event_pack(const coord *c, const member *m, uint8_t **out, size_t *out_bytes) {
  view_msg v;
  if (coord__view_build(c, &v) != 0)
    return -ENOMEM;
  int rc = -ENOMEM;
  size_t cap = c->njobs ? c->njobs : 1;
  Zerod__V1__Assignment *assignments = calloc(cap, sizeof *assignments);
  Zerod__V1__Assignment **pointers = calloc(cap, sizeof *pointers);
  Zerod__V1__Job *jobs = calloc(cap, sizeof *jobs);
  char(*buddies)[COORD_ADDR_BYTES] = calloc(cap, sizeof *buddies);
  if (assignments == NULL || pointers == NULL || jobs == NULL || buddies == NULL)
    goto out;
  size_t count = 0;
  for (size_t i = 0; i < c->njobs; i++) {
    cjob *j = c->jobs[i];
    long at = j->deleting ? -1 : coord__placement_of(j, m->info->name);
    if (at < 0)
      continue;
    coord__job_view(j, &jobs[count]);
    zerod__v1__assignment__init(&assignments[count]);
    assignments[count].job = &jobs[count];
    assignments[count].token_sha256 = j->token_sha256;
    assignments[count].n_read_token_sha256 = j->n_read_tokens;
    assignments[count].read_token_sha256 = (char **)j->read_token_ptrs;
    assignments[count].first_rank = j->msg->placement[at]->first_rank;
    assignments[count].ranks = j->msg->placement[at]->ranks;
    assignments[count].rebuild = rebuildable(c, j);
    assignments[count].abort_id = j->abort_id;
    assignments[count].abort_reason = (char *)j->abort_reason;
    c->hooks.assignment(c, j, (size_t)at, &assignments[count], buddies[count]);
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
  free(buddies);
  coord__view_free(&v);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Watch streams                                                            */
/* ------------------------------------------------------------------------ */

/* Ends m's Watch stream, if any, with status and message. */
void coord__watch_end(member *m, int status, const char *message) {
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
void coord__watch_send(coord *c, member *m) {
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
  coord__watch_end(m, RPC_RESOURCE_EXHAUSTED, message);
}

static void on_flush_timer(uv_timer_t *timer) {
  coord *c = timer->data;
  c->flush_scheduled = 0;
  for (size_t i = 0; i < c->nmembers; i++)
    if (c->members[i]->watch_dirty)
      coord__watch_send(c, c->members[i]);
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

void coord__mark_all_watches(coord *c) {
  for (size_t i = 0; i < c->nmembers; i++)
    mark_watch(c, c->members[i]);
}

void coord__mark_job_watches(coord *c, const cjob *j) {
  for (size_t i = 0; i < j->msg->n_placement; i++)
    mark_watch(c, coord__find_member(c, j->msg->placement[i]->node));
}

/* ------------------------------------------------------------------------ */
/* Job state                                                                */
/* ------------------------------------------------------------------------ */

/* Derives j's state, reason and step from the members and their reports
 * (see docs/control-plane.md, "Job states"), and tells the job's nodes if
 * the state or reason changed. */
void coord__derive_job(coord *c, cjob *j) {
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
    const job_report *r = m != NULL ? coord__find_report(m, j->msg->name) : NULL;
    if (r != NULL && (!have_step || r->step < step)) {
      step = r->step;
      have_step = 1;
    }
    /* A node that came back clears its departure once it has rebuilt the
     * job's ranks, at this epoch (a node re-sharded onto reports the old
     * ranks ready until it has rebuilt them: ckpt_memory.c; epoch 0: a
     * node of a version that does not say). */
    if (mark->departed && r != NULL && r->ready && r->error[0] == '\0' &&
        (r->epoch == 0 || r->epoch == j->epoch))
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
  c->hooks.job_changed(c, j);
}

/* Returns 1 if a live placement node of j still reports it. */
static int job_still_reported(const coord *c, const cjob *j) {
  for (size_t i = 0; i < j->msg->n_placement; i++) {
    const member *m = coord__find_member(c, j->msg->placement[i]->node);
    if (m != NULL && coord__find_report(m, j->msg->name) != NULL)
      return 1;
  }
  return 0;
}

void coord__member_free(member *m) {
  if (m == NULL)
    return;
  ctl_free(m->info ? &m->info->base : NULL);
  coord__free_reports(m->reports, m->nreports);
  free(m);
}

void coord__job_free(coord *c, cjob *j) {
  if (j == NULL)
    return;
  c->hooks.job_freed(c, j);
  ctl_free(&j->msg->base);
  free(j->token_sha256);
  free(j->read_tokens);
  free(j->marks);
  free(j);
}

/* Re-derives the jobs placed on node (every job when node is NULL), and
 * forgets the deleting ones that no live placement node reports any more. */
void coord__reconcile(coord *c, const char *node) {
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
      coord__job_free(c, j);
      forgot = 1;
      continue;
    }
    coord__derive_job(c, j);
    i++;
  }
  /* A forgotten job's checkpoints can move aside now (ckpt_retire.c). */
  if (forgot)
    c->hooks.jobs_forgotten(c);
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
  j->step = j->step_at_loss = msg->step;
  return j;
}
