/* ipc_attach: ATTACH, the admission of a session to a job (a rank of it,
 * or a read-only reader): the job created on a creating attach (on the
 * in-process coordinator first, standalone), a failed job reset by the
 * first attach that finds it idle, the token checked (owner or read),
 * the job's max_sessions quota, and a differing config warned about. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_node.h"
#include "cluster.h"
#include "coord.h"
#include "daemon.h"
#include "digest.h"
#include "follow.h"
#include "jobs.h"
#include "log.h"
#include "pin.h"
#include "reader.h"
#include "tier.h"

#include "ipc_impl.h"

/* The ranks of a job an attach creates: what it asks for (a launcher's
 * world size), else the daemon's --ranks. */
static int created_world_size(const zdaemon *d, const Zerod__V1__AttachRequest *req) {
  return req->world_size != 0 ? (int)req->world_size : d->options.ranks;
}

/* zerod standalone: a job created by an attach is created on the
 * in-process coordinator first (so zerodctl lists it), with the attach's
 * config and token, placed on this node. */
static int create_on_coordinator(zdaemon *d, const Zerod__V1__AttachRequest *req, uint64_t *id,
                                 unsigned *generation, int *status, char *err, size_t err_bytes) {
  uint64_t epoch = 0;
  int rc = coord_create_job_local(d->coord, req->job, req->token, req->config, d->options.node_name,
                                  (uint32_t)created_world_size(d, req), id, &epoch, err, err_bytes);
  if (rc == 0) {
    *generation = (unsigned)epoch;
    return 0;
  }
  /* ALREADY_EXISTS: created (zerodctl) or deleted on the coordinator and
   * not yet built or retired here; the watch event is on its way. */
  *status = rc == RPC_ALREADY_EXISTS || rc == RPC_UNAVAILABLE
                ? ZEROD__V1__STATUS__STATUS_UNAVAILABLE
                : ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED;
  return -1;
}

static job *create_job(zdaemon *d, session *s, uint64_t request_id,
                       const Zerod__V1__AttachRequest *req) {
  job_config config;
  char err[512] = "";
  if (job_config_from_proto(req->config, &config, err, sizeof err) != 0 ||
      job_config_finish(&config, d->options.max_live_bytes, err, sizeof err) != 0) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, "job '%s': %s",
                    req->job, err);
    return NULL;
  }
  if (tier_check(&config, d->exec.nvme_dir, err, sizeof err) != 0) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, "job '%s': %s",
                    req->job, err);
    return NULL;
  }
  if (config.onebit_freeze_step > 0 || config.powersgd_rank > 0) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                    "job '%s': %s compresses the gradient sums between nodes, and a job an "
                    "attach creates lives on this node alone; create it on 2 or more nodes "
                    "(zerodctl jobs create --nodes N)",
                    req->job,
                    config.onebit_freeze_step > 0 ? "onebit_freeze_step (1-bit Adam)"
                                                  : "powersgd_rank (low-rank compression)");
    return NULL;
  }
  uint64_t id = ++d->next_job_id;
  unsigned generation = 0;
  int status;
  if (d->coord != NULL &&
      create_on_coordinator(d, req, &id, &generation, &status, err, sizeof err) != 0) {
    ipc__send_error(s, request_id, status, "job '%s': %s; try again", req->job, err);
    return NULL;
  }
  job *j;
  char token_sha256[DIGEST_HEX_BYTES];
  digest_sha256_hex(req->token, token_sha256);
  int world_size = created_world_size(d, req);
  int rc = jobs_start(d, req->job, token_sha256, &config, world_size, world_size, 0, id, generation,
                      &j, err, sizeof err);
  if (rc != 0) {
    /* The coordinator's record stays: the watch builds the job from it
     * later, as it would one created with zerodctl. */
    ipc__send_error(s, request_id,
                    rc == -EINVAL ? ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION
                                  : ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                    "job '%s': %s", req->job, err);
    return NULL;
  }
  cluster_job_added(d);
  return j;
}

/* A failed job is reset by the first attach that finds nobody attached (it
 * can also fail with nobody attached, e.g. a prefetch after the last
 * detach); the attacher's requests then queue behind the new
 * communicators. Readers take no part in collectives, so they count as
 * nobody. Returns 1 if the job can be attached, else answers ABORTED. */
static int job_usable_for_attach(session *s, uint64_t request_id, job *j) {
  char reason[512];
  int local_reset = !job_spans_nodes(j);
  if (local_reset && j->sessions == 0 && job_failed(j, j->generation, NULL, 0))
    jobs_reset(j);
  if (!job_failed(j, j->generation, reason, sizeof reason))
    return 1;
  if (local_reset)
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_ABORTED,
                    "job '%s' failed: %s; it resets when all its workers have detached", j->name,
                    reason);
  else
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_ABORTED,
                    "job '%s' failed: %s; a job with ranks on several nodes does not reset: delete "
                    "and re-create it",
                    j->name, reason);
  return 0;
}

/* A fresh creating attach (ZD_CREATE_FRESH) joins a job that exists only
 * while none of its steps is done (its other ranks attaching); else it is
 * answered FAILED_PRECONDITION and returns 0. */
static int job_fresh_enough(session *s, uint64_t request_id, const Zerod__V1__AttachRequest *req,
                            job *j) {
  uint64_t step = atomic_load(&j->ranks[0].step);
  if (!req->create || !req->fresh || step == 0)
    return 1;
  ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                  "job '%s' exists and has done %llu step(s); a fresh start refuses it: delete it "
                  "(zerodctl jobs delete %s), pick another name, or attach to resume it",
                  j->name, (unsigned long long)step, j->name);
  return 0;
}

/* What a worker's token admits to j: its owner token attaches anything, a
 * read token (IssueReadToken) read-only sessions. The job keeps hashes
 * only; the token is hashed once and compared in constant time. */
typedef enum token_kind { TOKEN_NONE, TOKEN_OWNER, TOKEN_READ } token_kind;

static token_kind token_of(const job *j, const char *token) {
  char hash[DIGEST_HEX_BYTES];
  digest_sha256_hex(token, hash);
  int read = 0;
  for (size_t i = 0; i < j->n_read_tokens; i++)
    read |= digest_hex_equal(j->read_token_sha256[i], hash);
  return digest_hex_equal(j->token_sha256, hash) ? TOKEN_OWNER : read ? TOKEN_READ : TOKEN_NONE;
}

/* Refuses an attach whose token admits it to nothing (kind TOKEN_NONE) or
 * only to read-only sessions (TOKEN_READ on a read-write attach), saying
 * which: no token sent for a job that has one, a token sent for a job
 * without one (a $ZEROD_TOKEN left set), or one that does not match. */
static void send_token_refused(session *s, uint64_t request_id, const job *j, const char *token,
                               token_kind kind) {
  int sent = token != NULL && token[0] != '\0';
  if (kind == TOKEN_READ)
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_PERMISSION_DENIED,
                    "job '%s': a read token attaches read-only sessions only", j->name);
  else if (!sent)
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_PERMISSION_DENIED,
                    "job '%s' requires a token and this attach sent none: pass its owner token "
                    "(token= in Python, zd_attach_options.token in C, a worker's --token) or set "
                    "ZEROD_TOKEN",
                    j->name);
  else if (token_of(j, "") == TOKEN_OWNER)
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_PERMISSION_DENIED,
                    "job '%s' has no token but this attach sent one (is ZEROD_TOKEN set?)",
                    j->name);
  else
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_PERMISSION_DENIED,
                    "the token does not match job '%s' (neither its owner token nor a read token)",
                    j->name);
}

/* The job's max_sessions quota (control.proto Quotas) counts read-write
 * and read-only sessions on this node. Returns 1 if one more fits, else
 * answers RESOURCE_EXHAUSTED naming the quota and returns 0. */
static int job_has_session_room(session *s, uint64_t request_id, const job *j) {
  if (j->quota_sessions == 0 || (uint32_t)(j->sessions + j->readers) < j->quota_sessions)
    return 1;
  ipc__send_error(
      s, request_id, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
      "job '%s' has %d sessions on this node, as many as its max_sessions quota (%u) allows",
      j->name, j->sessions + j->readers, j->quota_sessions);
  return 0;
}

/* A mirror of a job another node hosts (follow.h) never resets here: it
 * failed when its far side did, and the next attach follows anew. */
static int mirror_usable(session *s, uint64_t request_id, job *j) {
  char reason[512];
  if (!job_failed(j, j->generation, reason, sizeof reason))
    return 1;
  ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_ABORTED, "job '%s' failed: %s", j->name,
                  reason);
  return 0;
}

/* A read-only session of j (a job of this node's, or a mirror of one
 * another node hosts): the checks, the reader, the reply. */
static void attach_reader(session *s, uint64_t request_id, uint8_t flags,
                          const Zerod__V1__AttachRequest *req, job *j, int mirrored) {
  zdaemon *d = s->daemon;
  /* The owner token, or a read token (which admits nothing else). */
  if (token_of(j, req->token) == TOKEN_NONE) {
    send_token_refused(s, request_id, j, req->token, TOKEN_NONE);
    return;
  }
  if (job_spans_nodes(j)) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
                    "job '%s' has ranks on other nodes; read-only sessions need every rank on this "
                    "daemon (standalone jobs)",
                    req->job);
    return;
  }
  if (mirrored ? !mirror_usable(s, request_id, j) : !job_usable_for_attach(s, request_id, j))
    return;
  if (!job_has_session_room(s, request_id, j))
    return;
  reader *r;
  int rc = reader_create(&d->readers, j, s->id, req->pin, &r);
  if (rc == -EBUSY) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                    "job '%s' has %d versions pinned by read-only sessions, as many as "
                    "--max-pinned-versions allows: sessions reading older versions must move on "
                    "(pin, watch) or detach; or attach without pin",
                    j->name, d->options.max_pinned_versions);
    return;
  }
  if (rc != 0) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  s->job = j;
  s->read_only = r;
  j->readers++;
  int pinned = 0;
  uint64_t version = reader_version(r, &pinned);
  job_config_msg config;
  exec_job_config(j, j->config.lr, j->config.max_grad_norm, &config);
  Zerod__V1__AttachReply reply = ZEROD__V1__ATTACH_REPLY__INIT;
  reply.job_id = j->id;
  reply.world_size = (uint32_t)j->world_size;
  reply.version = pin_latest_version(j);
  reply.config = &config.config;
  reply.read_only = 1;
  reply.pinned_version = pinned ? version : 0;
  if (!(flags & ZD_FRAME_F_NO_REPLY))
    ipc__send_message(s, ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY, request_id, &reply.base);
  if (pinned)
    LOG_INFOF("reader attached", "job=%s pid=%d uid=%d session=%llu pinned_version=%llu", j->name,
              (int)s->pid, (int)s->uid, (unsigned long long)s->id, (unsigned long long)version);
  else
    LOG_INFOF("reader attached", "job=%s pid=%d uid=%d session=%llu pinned=false", j->name,
              (int)s->pid, (int)s->uid, (unsigned long long)s->id);
}

/* A read-only attach that waited for its mirror (follow_attach). */
static void resume_followed(session *s, uint64_t request_id, uint8_t flags,
                            const Zerod__V1__AttachRequest *req, job *j, int status,
                            const char *message) {
  if (j != NULL)
    attach_reader(s, request_id, flags, req, j, 1);
  else
    ipc__send_error(s, request_id, status, "%s", message);
}

/* A read-only session: no rank, no collectives. It joins an existing job
 * only: one of this node's, answered at once from the loop (pinning takes
 * the job's pin mutex, which is never held for long; see pin.h), or, on a
 * node of a cluster, one another node hosts, through a mirror of it
 * (follow.h), answered once the mirror has the job's latest version. */
static void attach_read_only(session *s, uint64_t request_id, uint8_t flags,
                             const Zerod__V1__AttachRequest *req) {
  zdaemon *d = s->daemon;
  if (req->create) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                    "a read-only attach cannot create job '%s' (a read-write attach creates jobs)",
                    req->job);
    return;
  }
  job *j = jobs_find(d, req->job);
  if (j != NULL) {
    attach_reader(s, request_id, flags, req, j, 0);
    return;
  }
  if (follow_attach(d, s, request_id, flags, req, resume_followed) != 0)
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_NOT_FOUND,
                    "no job named '%s' (a read-only session attaches to an existing job)",
                    req->job);
}

/* A read-write attach to a job that exists uses the job's config, not the
 * one it sent (only a creating attach's counts), so a worker that asked for
 * other hyper-parameters would train with the job's without knowing. The
 * attach's config, defaults filled in, is compared with the job's: fields
 * gets the names of those that differ (comma-separated, for the log),
 * warning a sentence for the worker (AttachReply.warning, within an error
 * message's 1024 bytes). Returns 0 if they are the same. */
static int config_differences(zdaemon *d, const job *j, const Zerod__V1__JobConfig *proto,
                              char *fields, size_t fields_bytes, char *warning,
                              size_t warning_bytes) {
  job_config want;
  char err[256] = "";
  fields[0] = '\0';
  if (job_config_from_proto(proto, &want, err, sizeof err) != 0 ||
      job_config_finish(&want, d->options.max_live_bytes, err, sizeof err) != 0) {
    snprintf(fields, fields_bytes, "invalid");
    snprintf(warning, warning_bytes,
             "job '%s' exists: this attach's config was not used (it is invalid: %s); the "
             "job's config is in the reply",
             j->name, err);
    return 1;
  }
  char list[768];
  if (job_config_diff(&want, &j->config, fields, fields_bytes, list, sizeof list) == 0)
    return 0;
  snprintf(warning, warning_bytes,
           "job '%s' exists with another config; this attach's was not used: %s (the reply's "
           "config is the job's)",
           j->name, list);
  return 1;
}

void ipc__handle_attach(session *s, uint64_t request_id, uint8_t flags,
                        Zerod__V1__AttachRequest *req) {
  zdaemon *d = s->daemon;
  if (req->protocol_version != 1) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
                    "protocol version %u is not supported (this daemon speaks 1)",
                    req->protocol_version);
    return;
  }
  if (req->mode == ZEROD__V1__ATTACH_MODE__ATTACH_READ_ONLY) {
    attach_read_only(s, request_id, flags, req);
    return;
  }
  int created = 0;
  job *j = jobs_find(d, req->job);
  if (j == NULL && req->create && d->coord != NULL &&
      created_world_size(d, req) > d->options.max_ranks) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                    "job '%s' would have %d ranks, but this daemon hosts at most %d per job "
                    "(start it with --max-ranks %d)",
                    req->job, created_world_size(d, req), d->options.max_ranks,
                    created_world_size(d, req));
    return;
  }
  int nranks = j != NULL ? j->nranks : created_world_size(d, req);
  if ((int)req->local_rank >= nranks) {
    ipc__send_error(
        s, request_id, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
        "local rank %u does not exist: this daemon hosts %d rank(s) (0..%d) of job '%s'",
        req->local_rank, nranks, nranks - 1, req->job);
    return;
  }
  if (j == NULL && d->cluster != NULL && d->coord == NULL) {
    ipc__send_error(
        s, request_id, ZEROD__V1__STATUS__STATUS_NOT_FOUND,
        "job '%s' has no ranks on this node; in a cluster, jobs are created through the "
        "coordinator (zerodctl jobs create)",
        req->job);
    return;
  }
  if (j == NULL) {
    if (!req->create) {
      ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_NOT_FOUND,
                      "no job named '%s' on this daemon (attach with create to make it; "
                      "zerodctl jobs list shows the jobs there are)",
                      req->job);
      return;
    }
    j = create_job(d, s, request_id, req);
    if (j == NULL)
      return;
    created = 1;
  } else {
    token_kind kind = token_of(j, req->token);
    if (kind != TOKEN_OWNER) {
      send_token_refused(s, request_id, j, req->token, kind);
      return;
    }
  }
  if (!created && !job_fresh_enough(s, request_id, req, j))
    return;
  if (!job_usable_for_attach(s, request_id, j))
    return;
  if (ckpt_node_restoring(j) || j->awaiting_recovery) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_UNAVAILABLE,
                    j->awaiting_recovery
                        ? "job '%s' lost its state on this node (a restart, a lost node, a move) "
                          "and is being recovered from its in-memory copies or newest checkpoint; "
                          "attach again when it is done"
                        : "job '%s' is being restored from a checkpoint; attach again when it is "
                          "done",
                    j->name);
    return;
  }
  rank_state *rs = &j->ranks[req->local_rank];
  if (rs->session != NULL) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_ALREADY_EXISTS,
                    "rank %u of job '%s' is already attached (worker pid %d)", req->local_rank,
                    j->name, (int)rs->session->pid);
    return;
  }
  if (!job_has_session_room(s, request_id, j))
    return;
  s->job = j;
  s->rank = rs;
  rs->session = s;
  j->sessions++;
  exec_op *op = exec_op_new(OP_SESSION_BEGIN, rs);
  if (op == NULL) {
    ipc__send_error(s, request_id, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  op->session = s;
  op->session_id = s->id;
  op->request_id = request_id;
  op->flags = flags;
  op->job_created = created;
  char fields[256], warning[ZD_MAX_MESSAGE_BYTES + 1];
  int differs =
      !created && req->config != NULL &&
      config_differences(d, j, req->config, fields, sizeof fields, warning, sizeof warning);
  if (differs)
    op->warning = strdup(warning); /* without it (no memory) the reply only lacks the warning */
  ipc__submit(s, op);
  LOG_INFOF("worker attached", "job=%s rank=%d pid=%d uid=%d session=%llu", j->name, rs->rank,
            (int)s->pid, (int)s->uid, (unsigned long long)s->id);
  if (differs)
    LOG_WARNF("attach config differs from the job's; the job's is used",
              "job=%s rank=%d pid=%d fields=%s", j->name, rs->rank, (int)s->pid, fields);
}
