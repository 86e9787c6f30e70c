/* The control plane's request decoders (see ctl_decode.h).
 *
 * Each method has a descriptor (what protobuf-c unpacks) and a validator
 * (what the handler relies on). A validator writes one message that names
 * the field and the limit, so that the client's error says what to fix. */
#include "ctl_decode.h"

#include "names.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "digest.h"
#include "pbcheck.h"
#include "rpc.h"

/* ------------------------------------------------------------------------ */
/* Helpers                                                                  */
/* ------------------------------------------------------------------------ */

static int fail(char *err, size_t err_bytes, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Writes the message and returns -EINVAL, so validators can say
 * `return fail(err, err_bytes, "...")`. */
static int fail(char *err, size_t err_bytes, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, err_bytes, fmt, ap);
  va_end(ap);
  return -EINVAL;
}

int ctl_valid_name(const char *s) {
  return zd_valid_name(s);
}

int ctl_valid_checkpoint_name(const char *s) {
  return zd_valid_checkpoint_name(s);
}

int ctl_valid_job_dir_name(const char *s) {
  return zd_valid_job_dir_name(s);
}

int ctl_parse_checkpoint_dir(const char *s, char *job_out, uint64_t *id_out) {
  if (s == NULL)
    return 0;
  const char *at = strchr(s, '@');
  size_t job_bytes = at != NULL ? (size_t)(at - s) : strlen(s);
  if (job_bytes == 0 || job_bytes > CTL_NAME_MAX_BYTES)
    return 0;
  char job[CTL_NAME_MAX_BYTES + 1];
  memcpy(job, s, job_bytes);
  job[job_bytes] = '\0';
  if (!ctl_valid_job_dir_name(job))
    return 0;
  uint64_t id = 0;
  if (at != NULL) {
    const char *digits = at + 1;
    size_t n = strlen(digits);
    /* 19 digits stay below 2^63, as every job id does. */
    if (n == 0 || n > 19 || digits[0] == '0' || strspn(digits, "0123456789") != n)
      return 0;
    for (size_t i = 0; i < n; i++)
      id = id * 10 + (uint64_t)(digits[i] - '0');
  }
  if (job_out != NULL)
    memcpy(job_out, job, job_bytes + 1);
  if (id_out != NULL)
    *id_out = id;
  return 1;
}

ctl_checkpoint_ref ctl_parse_checkpoint_ref(const char *ref, char *dir_out, char *name_out) {
  if (ref == NULL || ref[0] == '\0')
    return CTL_REF_INVALID;
  if (ref[0] == '/')
    return CTL_REF_PATH; /* checked as text by the decoder; the handler resolves it */
  const char *slash = strchr(ref, '/');
  if (slash == NULL) {
    if (!ctl_valid_checkpoint_name(ref))
      return CTL_REF_INVALID;
    snprintf(name_out, CTL_NAME_MAX_BYTES + 1, "%s", ref);
    return CTL_REF_NAME;
  }
  size_t dir_bytes = (size_t)(slash - ref);
  if (dir_bytes == 0 || dir_bytes > CTL_CKPT_DIR_MAX_BYTES)
    return CTL_REF_INVALID;
  char dir[CTL_CKPT_DIR_MAX_BYTES + 1];
  memcpy(dir, ref, dir_bytes);
  dir[dir_bytes] = '\0';
  if (!ctl_parse_checkpoint_dir(dir, NULL, NULL) || !ctl_valid_checkpoint_name(slash + 1))
    return CTL_REF_INVALID;
  if (dir_out != NULL)
    memcpy(dir_out, dir, dir_bytes + 1);
  snprintf(name_out, CTL_NAME_MAX_BYTES + 1, "%s", slash + 1);
  return CTL_REF_JOB_NAME;
}

void ctl_text_sanitize(char *s, size_t max_bytes) {
  unsigned char *p = (unsigned char *)s;
  size_t len = strlen(s);
  for (size_t i = 0, n; i < len; i += n) {
    n = zd_utf8_char(p + i, len - i);
    if (n == 0 || (n == 1 && (p[i] < 0x20 || p[i] == 0x7f))) {
      p[i] = '?';
      n = 1;
    }
    if (i + n > max_bytes) {
      p[i] = '\0';
      return;
    }
  }
}

/* Checks a free-text field: min_bytes..max_bytes of UTF-8 without control
 * characters (they would garble logs and error messages). */
static int check_text(const char *field, const char *s, size_t min_bytes, size_t max_bytes,
                      char *err, size_t err_bytes) {
  if (s == NULL)
    s = "";
  size_t len = strlen(s);
  if (len < min_bytes)
    return fail(err, err_bytes, "%s must not be empty", field);
  if (len > max_bytes)
    return fail(err, err_bytes, "%s is %zu bytes long (at most %zu)", field, len, max_bytes);
  for (size_t i = 0; i < len; i++)
    if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
      return fail(err, err_bytes, "%s contains a control character", field);
  if (!zd_utf8_valid(s, len))
    return fail(err, err_bytes, "%s is not valid UTF-8", field);
  return 0;
}

static int check_name(const char *field, const char *s, char *err, size_t err_bytes) {
  if (ctl_valid_name(s))
    return 0;
  if (s == NULL || s[0] == '\0')
    return fail(err, err_bytes, "%s is missing (1..%d bytes of [A-Za-z0-9._-])", field,
                CTL_NAME_MAX_BYTES);
  /* The bad name is not echoed: it may hold anything. */
  return fail(err, err_bytes, "%s must be 1..%d bytes of [A-Za-z0-9._-] (got %zu bytes)", field,
              CTL_NAME_MAX_BYTES, strlen(s));
}

/* Rendezvous keys are opaque to the coordinator but must be text (proto3
 * strings), 1..CTL_KEY_MAX_BYTES bytes; prefix deletes may use "". */
static int check_key(const char *s, int allow_empty, char *err, size_t err_bytes) {
  if (s == NULL)
    s = "";
  size_t len = strlen(s);
  if (len == 0 && !allow_empty)
    return fail(err, err_bytes, "key must not be empty (1..%d bytes)", CTL_KEY_MAX_BYTES);
  if (len > CTL_KEY_MAX_BYTES)
    return fail(err, err_bytes, "key is %zu bytes long (at most %d)", len, CTL_KEY_MAX_BYTES);
  if (!zd_utf8_valid(s, len))
    return fail(err, err_bytes, "key is not valid UTF-8");
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Job configs                                                              */
/* ------------------------------------------------------------------------ */

int ctl_check_job_config(const Zerod__V1__JobConfig *pc, char *err, size_t err_bytes) {
  /* The node's own rules (model/config.c), run as a node runs them when it
   * builds the job's ranks, so that a config a node would refuse is refused
   * here and never assigned. They are the only copy: nothing about a
   * config's values is checked here besides them. The default
   * max_live_bytes is the node's (0 here: no rule depends on it). */
  job_config config;
  int rc = job_config_from_proto(pc, &config, err, err_bytes);
  if (rc == 0)
    rc = job_config_finish(&config, 0, err, err_bytes);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Validators, one per method                                               */
/* ------------------------------------------------------------------------ */

typedef int (*validator)(const ProtobufCMessage *msg, char *err, size_t err_bytes);

static int check_node_info(const Zerod__V1__NodeInfo *n, char *err, size_t err_bytes) {
  if (n == NULL)
    return fail(err, err_bytes, "node is missing");
  int rc = check_name("node.name", n->name, err, err_bytes);
  if (rc == 0)
    rc = check_text("node.address", n->address, 1, CTL_ADDRESS_MAX_BYTES, err, err_bytes);
  if (rc == 0 && (n->ranks < 1 || n->ranks > CTL_MAX_RANKS))
    rc = fail(err, err_bytes, "node.ranks is %u (1..%d)", n->ranks, CTL_MAX_RANKS);
  if (rc == 0)
    rc = check_text("node.version", n->version, 0, CTL_TEXT_MAX_BYTES, err, err_bytes);
  if (rc == 0 && n->n_devices > CTL_MAX_DEVICES)
    rc = fail(err, err_bytes, "node lists %zu devices (at most %d)", n->n_devices, CTL_MAX_DEVICES);
  for (size_t i = 0; rc == 0 && i < n->n_devices; i++) {
    const Zerod__V1__Device *d = n->devices[i];
    if (d == NULL)
      return fail(err, err_bytes, "node.devices[%zu] is missing", i);
    rc = check_text("node.devices[].kind", d->kind, 0, CTL_TEXT_MAX_BYTES, err, err_bytes);
    if (rc == 0)
      rc = check_text("node.devices[].name", d->name, 0, CTL_TEXT_MAX_BYTES, err, err_bytes);
  }
  return rc;
}

static int check_join(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__JoinRequest *r = (const Zerod__V1__JoinRequest *)msg;
  return check_node_info(r->node, err, err_bytes);
}

/* A node's reports on its ranks' checkpoint work. Two reports of one rank
 * and order in one list are not refused: the later one counts. Whether the
 * ranks are the node's, and the orders the job's, the coordinator decides
 * (reports that are not are ignored). */
static int check_shard_reports(const char *field, Zerod__V1__ShardReport *const *reports,
                               size_t count, char *err, size_t err_bytes) {
  if (count > CTL_MAX_SHARD_REPORTS)
    return fail(err, err_bytes, "%s lists %zu reports (at most %d)", field, count,
                CTL_MAX_SHARD_REPORTS);
  for (size_t i = 0; i < count; i++) {
    const Zerod__V1__ShardReport *r = reports[i];
    if (r == NULL)
      return fail(err, err_bytes, "%s[%zu] is missing", field, i);
    if (r->rank >= CTL_MAX_RANKS)
      return fail(err, err_bytes, "%s[].rank is %u (0..%d)", field, r->rank, CTL_MAX_RANKS - 1);
    int rc = check_text("reports[].error", r->error, 0, CTL_ERROR_MAX_BYTES, err, err_bytes);
    if (rc == 0)
      rc = check_text("reports[].file", r->file, 0, CTL_FILE_MAX_BYTES, err, err_bytes);
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* A node's reports of what its ranks are doing: a rank each at most. */
static int check_activity(Zerod__V1__RankActivity *const *ranks, size_t count, char *err,
                          size_t err_bytes) {
  if (count > CTL_MAX_RANKS)
    return fail(err, err_bytes, "jobs[].ranks lists %zu ranks (at most %d)", count, CTL_MAX_RANKS);
  for (size_t i = 0; i < count; i++) {
    const Zerod__V1__RankActivity *a = ranks[i];
    if (a == NULL)
      return fail(err, err_bytes, "jobs[].ranks[%zu] is missing", i);
    if (a->rank >= CTL_MAX_RANKS)
      return fail(err, err_bytes, "jobs[].ranks[].rank is %u (0..%d)", a->rank, CTL_MAX_RANKS - 1);
    int rc = check_text("jobs[].ranks[].collective", a->collective, 0, 32, err, err_bytes);
    if (rc == 0)
      rc = check_text("jobs[].ranks[].last_op", a->last_op, 0, 32, err, err_bytes);
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* A node's in-memory copies of a job (JobStatus.replicas). */
static int check_replicas(Zerod__V1__ReplicaSet *const *sets, size_t count, char *err,
                          size_t err_bytes) {
  if (count > CTL_MAX_REPLICA_SETS)
    return fail(err, err_bytes, "jobs[].replicas lists %zu steps (at most %d)", count,
                CTL_MAX_REPLICA_SETS);
  for (size_t i = 0; i < count; i++) {
    const Zerod__V1__ReplicaSet *s = sets[i];
    if (s == NULL)
      return fail(err, err_bytes, "jobs[].replicas[%zu] is missing", i);
    if (s->world_size > CTL_MAX_RANKS || s->n_ranks > s->world_size)
      return fail(err, err_bytes, "jobs[].replicas[%zu]: %zu files of a world of %u (1..%d)", i,
                  s->n_ranks, s->world_size, CTL_MAX_RANKS);
    for (size_t k = 0; k < s->n_ranks; k++)
      if (s->ranks[k] >= s->world_size)
        return fail(err, err_bytes, "jobs[].replicas[%zu]: rank %u of a world of %u", i,
                    s->ranks[k], s->world_size);
  }
  return 0;
}

static int check_heartbeat(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__HeartbeatRequest *r = (const Zerod__V1__HeartbeatRequest *)msg;
  int rc = check_name("node", r->node, err, err_bytes);
  if (rc != 0)
    return rc;
  if (r->n_jobs > CTL_MAX_JOB_REPORTS)
    return fail(err, err_bytes, "heartbeat reports %zu jobs (at most %d)", r->n_jobs,
                CTL_MAX_JOB_REPORTS);
  for (size_t i = 0; i < r->n_jobs; i++) {
    const Zerod__V1__JobStatus *s = r->jobs[i];
    if (s == NULL)
      return fail(err, err_bytes, "jobs[%zu] is missing", i);
    if ((rc = check_name("jobs[].job", s->job, err, err_bytes)) != 0)
      return rc;
    if ((rc = check_text("jobs[].error", s->error, 0, CTL_ERROR_MAX_BYTES, err, err_bytes)) != 0)
      return rc;
    if ((rc = check_shard_reports("jobs[].saves", s->saves, s->n_saves, err, err_bytes)) != 0 ||
        (rc = check_shard_reports("jobs[].restores", s->restores, s->n_restores, err, err_bytes)) !=
            0 ||
        (rc = check_activity(s->ranks, s->n_ranks, err, err_bytes)) != 0 ||
        (rc = check_replicas(s->replicas, s->n_replicas, err, err_bytes)) != 0)
      return rc;
  }
  /* One report per job: the coordinator keeps the last heartbeat's reports
   * by job name, and two for one job would be ambiguous. Quadratic, but
   * bounded by CTL_MAX_JOB_REPORTS (and a node reports a handful). */
  for (size_t i = 0; i < r->n_jobs; i++)
    for (size_t k = i + 1; k < r->n_jobs; k++)
      if (strcmp(r->jobs[i]->job, r->jobs[k]->job) == 0)
        return fail(err, err_bytes, "job '%s' is reported twice", r->jobs[i]->job);
  return 0;
}

static int check_leave(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  return check_name("node", ((const Zerod__V1__LeaveRequest *)msg)->node, err, err_bytes);
}

static int check_watch(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  return check_name("node", ((const Zerod__V1__WatchRequest *)msg)->node, err, err_bytes);
}

static int check_nothing(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  return 0;
}

static int check_world(uint32_t nodes, uint32_t ranks_per_node, char *err, size_t err_bytes) {
  if (nodes < 1 || nodes > CTL_MAX_RANKS)
    return fail(err, err_bytes, "nodes is %u (1..%d)", nodes, CTL_MAX_RANKS);
  if (ranks_per_node < 1 || ranks_per_node > CTL_MAX_RANKS)
    return fail(err, err_bytes, "ranks_per_node is %u (1..%d)", ranks_per_node, CTL_MAX_RANKS);
  if ((uint64_t)nodes * ranks_per_node > CTL_MAX_RANKS)
    return fail(err, err_bytes, "a world of %u nodes x %u ranks is %llu ranks (at most %d)", nodes,
                ranks_per_node, (unsigned long long)nodes * ranks_per_node, CTL_MAX_RANKS);
  return 0;
}

static int check_token(const char *token, int allow_empty, char *err, size_t err_bytes) {
  size_t len = token != NULL ? strlen(token) : 0;
  if (len == 0)
    return allow_empty ? 0 : fail(err, err_bytes, "token is missing");
  if (len > CTL_TOKEN_MAX_BYTES)
    return fail(err, err_bytes, "token is %zu bytes long (at most %d)", len, CTL_TOKEN_MAX_BYTES);
  for (size_t i = 0; i < len; i++)
    if ((unsigned char)token[i] <= 0x20 || (unsigned char)token[i] >= 0x7f)
      return fail(err, err_bytes, "token must be printable ASCII without spaces");
  return 0;
}

int ctl_check_create_job(const Zerod__V1__CreateJobRequest *r, char *err, size_t err_bytes) {
  int rc = check_name("name", r->name, err, err_bytes);
  /* A job on a base may leave nodes and ranks_per_node 0: the base's
   * (the coordinator fills them in and checks the request again). */
  const char *base = r->config != NULL && r->config->base_job != NULL ? r->config->base_job : "";
  int on_base = base[0] != '\0';
  uint32_t nodes = r->nodes, ranks_per_node = r->ranks_per_node;
  if (on_base && nodes == 0)
    nodes = r->n_node_names != 0 ? (uint32_t)r->n_node_names : 1;
  if (on_base && ranks_per_node == 0)
    ranks_per_node = 1;
  if (rc == 0)
    rc = check_world(nodes, ranks_per_node, err, err_bytes);
  if (rc == 0)
    rc = ctl_check_job_config(r->config, err, err_bytes);
  if (rc == 0)
    rc = check_token(r->token, 1, err, err_bytes);
  if (rc != 0)
    return rc;
  if (on_base && strcmp(base, r->name) == 0)
    return fail(err, err_bytes, "job '%s' cannot be its own base (config.base_job)", r->name);
  if (r->config != NULL && r->config->onebit_freeze_step > 0 && nodes < 2)
    return fail(err, err_bytes,
                "onebit_freeze_step (1-bit Adam) compresses the gradient sums between nodes; a "
                "job on %u node has none: give it 2 or more nodes, or leave 1-bit Adam off",
                nodes);
  if (r->config != NULL && r->config->powersgd_rank > 0 && nodes < 2)
    return fail(err, err_bytes,
                "powersgd_rank (low-rank compression) compresses the gradient sums between "
                "nodes; a job on %u node has none: give it 2 or more nodes, or leave it off",
                nodes);
  /* hpZ's secondary group is the ranks of one node, as in ZeRO++. */
  uint32_t hpz = r->config != NULL ? r->config->hpz_partition_size : 0;
  if (hpz > 1 && r->ranks_per_node != 0 && hpz != r->ranks_per_node)
    return fail(err, err_bytes,
                "hpz_partition_size is %u; it must be 1 (off) or the job's ranks_per_node (%u): "
                "the secondary partition is spread over the ranks of one node",
                hpz, r->ranks_per_node);
  if (r->tenant[0] != '\0' && !ctl_valid_job_dir_name(r->tenant))
    return fail(err, err_bytes, "tenant must be 1..64 of [A-Za-z0-9._-], not '.' or '..'");
  if (r->n_node_names != 0 && r->n_node_names != nodes)
    return fail(err, err_bytes, "node_names lists %zu nodes but nodes is %u", r->n_node_names,
                r->nodes);
  for (size_t i = 0; i < r->n_node_names; i++) {
    if ((rc = check_name("node_names[]", r->node_names[i], err, err_bytes)) != 0)
      return rc;
    for (size_t k = 0; k < i; k++)
      if (strcmp(r->node_names[i], r->node_names[k]) == 0)
        return fail(err, err_bytes, "node '%s' is listed twice in node_names", r->node_names[i]);
  }
  return 0;
}

static int check_create_job(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  return ctl_check_create_job((const Zerod__V1__CreateJobRequest *)msg, err, err_bytes);
}

/* The tenants a base is shared with: at most CTL_MAX_SHARED_WITH tenant
 * names (as CreateJob's tenant), none twice. */
static int check_shared_with(char *const *tenants, size_t n, char *err, size_t err_bytes) {
  if (n > CTL_MAX_SHARED_WITH)
    return fail(err, err_bytes, "shared_with lists %zu tenants (at most %d)", n,
                CTL_MAX_SHARED_WITH);
  for (size_t i = 0; i < n; i++) {
    int rc = check_name("shared_with[]", tenants[i], err, err_bytes);
    if (rc != 0)
      return rc;
    if (!ctl_valid_job_dir_name(tenants[i]))
      return fail(err, err_bytes, "shared_with[] must be tenant names, not '.' or '..'");
    for (size_t k = 0; k < i; k++)
      if (strcmp(tenants[i], tenants[k]) == 0)
        return fail(err, err_bytes, "tenant '%s' is listed twice in shared_with", tenants[i]);
  }
  return 0;
}

static int check_freeze_job(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__FreezeJobRequest *r = (const Zerod__V1__FreezeJobRequest *)msg;
  int rc = check_name("name", r->name, err, err_bytes);
  return rc == 0 ? check_shared_with(r->shared_with, r->n_shared_with, err, err_bytes) : rc;
}

static int check_scale_job(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__ScaleJobRequest *r = (const Zerod__V1__ScaleJobRequest *)msg;
  int rc = check_name("name", r->name, err, err_bytes);
  if (rc != 0)
    return rc;
  if (r->n_node_names < 1 || r->n_node_names > CTL_MAX_RANKS)
    return fail(err, err_bytes, "node_names lists %zu nodes (1..%d)", r->n_node_names,
                CTL_MAX_RANKS);
  for (size_t i = 0; i < r->n_node_names; i++) {
    if ((rc = check_name("node_names[]", r->node_names[i], err, err_bytes)) != 0)
      return rc;
    for (size_t k = 0; k < i; k++)
      if (strcmp(r->node_names[i], r->node_names[k]) == 0)
        return fail(err, err_bytes, "node '%s' is named twice", r->node_names[i]);
  }
  return 0;
}

static int check_get_job(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  return check_name("name", ((const Zerod__V1__GetJobRequest *)msg)->name, err, err_bytes);
}

static int check_delete_job(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  return check_name("name", ((const Zerod__V1__DeleteJobRequest *)msg)->name, err, err_bytes);
}

static int check_locate_job(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__LocateJobRequest *r = (const void *)msg;
  int rc = check_name("name", r->name, err, err_bytes);
  return rc != 0 ? rc : check_token(r->token, 1, err, err_bytes);
}

static int check_issue_read_token(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  return check_name("job", ((const Zerod__V1__IssueReadTokenRequest *)msg)->job, err, err_bytes);
}

static int check_put(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__PutRequest *r = (const Zerod__V1__PutRequest *)msg;
  int rc = check_name("job", r->job, err, err_bytes);
  if (rc == 0)
    rc = check_key(r->key, 0, err, err_bytes);
  if (rc == 0 && r->value.len > CTL_VALUE_MAX_BYTES)
    rc = fail(err, err_bytes, "value is %zu bytes (at most %u)", r->value.len, CTL_VALUE_MAX_BYTES);
  return rc;
}

static int check_get(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__GetRequest *r = (const Zerod__V1__GetRequest *)msg;
  int rc = check_name("job", r->job, err, err_bytes);
  return rc == 0 ? check_key(r->key, 0, err, err_bytes) : rc;
}

static int check_delete(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__DeleteRequest *r = (const Zerod__V1__DeleteRequest *)msg;
  int rc = check_name("job", r->job, err, err_bytes);
  return rc == 0 ? check_key(r->key, r->prefix, err, err_bytes) : rc;
}

/* Job names of checkpoint requests name directories. */
static int check_job_dir(const char *field, const char *s, char *err, size_t err_bytes) {
  int rc = check_name(field, s, err, err_bytes);
  if (rc == 0 && !ctl_valid_job_dir_name(s))
    rc = fail(err, err_bytes, "%s '%s' cannot name a checkpoint directory", field, s);
  return rc;
}

/* List and Delete also take a deleted job's directory, "<job>@<id>". */
static int check_checkpoint_dir(const char *field, const char *s, char *err, size_t err_bytes) {
  if (s != NULL && strchr(s, '@') != NULL) {
    if (ctl_parse_checkpoint_dir(s, NULL, NULL))
      return 0;
    return fail(err, err_bytes,
                "%s must be a job name or a deleted job's <job>@<id> (got %zu bytes)", field,
                strlen(s));
  }
  return check_job_dir(field, s, err, err_bytes);
}

static int check_checkpoint_name(const char *s, char *err, size_t err_bytes) {
  int rc = check_name("name", s, err, err_bytes);
  if (rc == 0 && !ctl_valid_checkpoint_name(s))
    rc = fail(err, err_bytes,
              "name '%s' is reserved: checkpoint names must not start with '.' or contain "
              "'.tmp-' or '.deleting-'",
              s);
  return rc;
}

static int check_save(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__SaveRequest *r = (const Zerod__V1__SaveRequest *)msg;
  int rc = check_job_dir("job", r->job, err, err_bytes);
  if (rc != 0 || r->name == NULL || r->name[0] == '\0')
    return rc; /* an empty name: step-<step> */
  if ((rc = check_checkpoint_name(r->name, err, err_bytes)) != 0)
    return rc;
  if (strncmp(r->name, "auto-", 5) == 0)
    return fail(err, err_bytes,
                "name '%s' is reserved: 'auto-' names are the periodic checkpoints'", r->name);
  return 0;
}

static int check_list_checkpoints(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__ListCheckpointsRequest *r = (const Zerod__V1__ListCheckpointsRequest *)msg;
  if (r->job == NULL || r->job[0] == '\0')
    return 0; /* every job */
  return check_checkpoint_dir("job", r->job, err, err_bytes);
}

static int check_delete_checkpoint(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__DeleteCheckpointRequest *r = (const Zerod__V1__DeleteCheckpointRequest *)msg;
  int rc = check_checkpoint_dir("job", r->job, err, err_bytes);
  return rc == 0 ? check_checkpoint_name(r->name, err, err_bytes) : rc;
}

/* A checkpoint reference (RestoreRequest, ExportRequest): a name, a
 * <job>/<name>, or an absolute path. */
static int check_checkpoint_ref(const char *ref, char *err, size_t err_bytes) {
  char name[CTL_NAME_MAX_BYTES + 1];
  switch (ctl_parse_checkpoint_ref(ref, NULL, name)) {
  case CTL_REF_NAME:
  case CTL_REF_JOB_NAME:
    return 0;
  case CTL_REF_PATH:
    /* Shown back in errors and sent to the nodes: text, and short enough
     * to leave room in PATH_MAX for what the nodes append. */
    return check_text("checkpoint", ref, 1, CTL_PATH_MAX_BYTES, err, err_bytes);
  default:
    break;
  }
  /* Not echoed: it may hold anything. */
  return fail(err, err_bytes,
              "checkpoint must be a checkpoint name, <job>/<name> (<job>@<id>/<name> for a "
              "deleted job's), or an absolute path to a "
              "checkpoint directory or a .safetensors file (got %zu bytes)",
              strlen(ref));
}

static int check_restore(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__RestoreRequest *r = (const Zerod__V1__RestoreRequest *)msg;
  int rc = check_job_dir("job", r->job, err, err_bytes);
  if (rc != 0)
    return rc;
  const char *ref = r->checkpoint != NULL ? r->checkpoint : "";
  if (ref[0] == '\0')
    return fail(err, err_bytes,
                "checkpoint is missing (a name, <job>/<name>, or an absolute path)");
  return check_checkpoint_ref(ref, err, err_bytes);
}

static int check_export(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Zerod__V1__ExportRequest *r = (const Zerod__V1__ExportRequest *)msg;
  int rc = check_job_dir("job", r->job, err, err_bytes);
  if (rc != 0)
    return rc;
  if (r->checkpoint != NULL && r->checkpoint[0] != '\0' &&
      (rc = check_checkpoint_ref(r->checkpoint, err, err_bytes)) != 0)
    return rc;
  /* Absolute, or relative to the coordinator's first export root; where
   * it may lead is the handler's to check (confine.h). */
  const char *path = r->path != NULL ? r->path : "";
  if (path[0] == '\0')
    return fail(err, err_bytes, "path is missing (the .safetensors file to write)");
  if ((rc = check_text("path", path, 1, CTL_PATH_MAX_BYTES, err, err_bytes)) != 0)
    return rc;
  if (r->dtype != ZEROD__V1__EXPORT_DTYPE__EXPORT_DTYPE_UNSPECIFIED &&
      r->dtype != ZEROD__V1__EXPORT_DTYPE__EXPORT_DTYPE_F32 &&
      r->dtype != ZEROD__V1__EXPORT_DTYPE__EXPORT_DTYPE_BF16)
    return fail(err, err_bytes, "dtype %d is not F32 or BF16", (int)r->dtype);
  return 0;
}

static int check_health(const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  const Grpc__Health__V1__HealthCheckRequest *r = (const Grpc__Health__V1__HealthCheckRequest *)msg;
  return check_text("service", r->service, 0, CTL_TEXT_MAX_BYTES, err, err_bytes);
}

/* ------------------------------------------------------------------------ */
/* The method table                                                         */
/* ------------------------------------------------------------------------ */

typedef struct ctl_method {
  const char *path;
  const ProtobufCMessageDescriptor *request;
  validator check;
} ctl_method;

static const ctl_method methods[CTL_NMETHODS] = {
    {CTL_JOIN, &zerod__v1__join_request__descriptor, check_join},
    {CTL_HEARTBEAT, &zerod__v1__heartbeat_request__descriptor, check_heartbeat},
    {CTL_LEAVE, &zerod__v1__leave_request__descriptor, check_leave},
    {CTL_GET_VIEW, &zerod__v1__get_view_request__descriptor, check_nothing},
    {CTL_WATCH, &zerod__v1__watch_request__descriptor, check_watch},
    {CTL_CREATE_JOB, &zerod__v1__create_job_request__descriptor, check_create_job},
    {CTL_GET_JOB, &zerod__v1__get_job_request__descriptor, check_get_job},
    {CTL_LIST_JOBS, &zerod__v1__list_jobs_request__descriptor, check_nothing},
    {CTL_DELETE_JOB, &zerod__v1__delete_job_request__descriptor, check_delete_job},
    {CTL_ISSUE_READ_TOKEN, &zerod__v1__issue_read_token_request__descriptor,
     check_issue_read_token},
    {CTL_PUT, &zerod__v1__put_request__descriptor, check_put},
    {CTL_GET, &zerod__v1__get_request__descriptor, check_get},
    {CTL_DELETE, &zerod__v1__delete_request__descriptor, check_delete},
    {CTL_HEALTH_CHECK, &grpc__health__v1__health_check_request__descriptor, check_health},
    {CTL_HEALTH_WATCH, &grpc__health__v1__health_check_request__descriptor, check_health},
    {CTL_SAVE, &zerod__v1__save_request__descriptor, check_save},
    {CTL_LIST_CHECKPOINTS, &zerod__v1__list_checkpoints_request__descriptor,
     check_list_checkpoints},
    {CTL_DELETE_CHECKPOINT, &zerod__v1__delete_checkpoint_request__descriptor,
     check_delete_checkpoint},
    {CTL_RESTORE, &zerod__v1__restore_request__descriptor, check_restore},
    {CTL_EXPORT, &zerod__v1__export_request__descriptor, check_export},
    {CTL_FREEZE_JOB, &zerod__v1__freeze_job_request__descriptor, check_freeze_job},
    {CTL_SCALE_JOB, &zerod__v1__scale_job_request__descriptor, check_scale_job},
    {CTL_LOCATE_JOB, &zerod__v1__locate_job_request__descriptor, check_locate_job},
};

const char *ctl_method_path(unsigned i) {
  return i < CTL_NMETHODS ? methods[i].path : NULL;
}

const ProtobufCMessageDescriptor *ctl_method_request(unsigned i) {
  return i < CTL_NMETHODS ? methods[i].request : NULL;
}

/* Whether msg or a message inside it kept an unknown field numbered 0.
 * protobuf-c reads a zero tag written in two or more bytes (0x80 0x00) as
 * an unknown field but refuses the one-byte zero tag it writes for it, so
 * such a message would not survive being stored and read again (the
 * coordinator stores jobs); field number 0 is invalid in protobuf anyway. */
static int has_field_zero(const ProtobufCMessage *msg) {
  for (unsigned i = 0; i < msg->n_unknown_fields; i++)
    if (msg->unknown_fields[i].tag == 0)
      return 1;
  const ProtobufCMessageDescriptor *d = msg->descriptor;
  for (unsigned f = 0; f < d->n_fields; f++) {
    const ProtobufCFieldDescriptor *fd = &d->fields[f];
    if (fd->type != PROTOBUF_C_TYPE_MESSAGE)
      continue;
    const char *member = (const char *)msg + fd->offset;
    if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
      size_t n = *(const size_t *)((const char *)msg + fd->quantifier_offset);
      ProtobufCMessage *const *items = *(ProtobufCMessage *const *const *)member;
      for (size_t k = 0; k < n; k++)
        if (items[k] != NULL && has_field_zero(items[k]))
          return 1;
    } else {
      const ProtobufCMessage *sub = *(const ProtobufCMessage *const *)member;
      if (sub != NULL && has_field_zero(sub))
        return 1;
    }
  }
  return 0;
}

int ctl_decode(const char *path, const uint8_t *bytes, size_t nbytes, ProtobufCMessage **out,
               char *err, size_t err_bytes) {
  *out = NULL;
  const ctl_method *m = NULL;
  for (unsigned i = 0; path != NULL && i < CTL_NMETHODS; i++)
    if (strcmp(methods[i].path, path) == 0)
      m = &methods[i];
  if (m == NULL) {
    snprintf(err, err_bytes, "unknown method %s", path != NULL ? path : "(none)");
    return RPC_UNIMPLEMENTED;
  }
  if (nbytes > RPC_MAX_MESSAGE_BYTES) {
    snprintf(err, err_bytes, "request is %zu bytes (at most %u)", nbytes, RPC_MAX_MESSAGE_BYTES);
    return RPC_INVALID_ARGUMENT;
  }
  /* protobuf-c would cut a string at a NUL byte (GetJob of "a\0zzz"
   * would find job "a") and takes any bytes as UTF-8, so every string is
   * checked in the bytes first; the message names the field. */
  int rc = zd_pb_check_strings(m->request, bytes, nbytes, err, err_bytes);
  if (rc != 0) {
    if (rc == -EBADMSG)
      snprintf(err, err_bytes, "request is not a valid %s message", m->request->name);
    return RPC_INVALID_ARGUMENT;
  }
  /* protobuf-c reads nothing past nbytes; an empty request is the message
   * with every field at its default (and bytes may then be NULL). */
  static const uint8_t empty[1];
  ProtobufCMessage *msg =
      protobuf_c_message_unpack(m->request, NULL, nbytes, bytes != NULL ? bytes : empty);
  if (msg == NULL || has_field_zero(msg)) {
    if (msg != NULL)
      protobuf_c_message_free_unpacked(msg, NULL);
    snprintf(err, err_bytes, "request is not a valid %s message", m->request->name);
    return RPC_INVALID_ARGUMENT;
  }
  if (m->check(msg, err, err_bytes) != 0) {
    protobuf_c_message_free_unpacked(msg, NULL);
    return RPC_INVALID_ARGUMENT;
  }
  *out = msg;
  return 0;
}

int ctl_decode_message(const ProtobufCMessageDescriptor *desc, const uint8_t *bytes, size_t nbytes,
                       ProtobufCMessage **out, char *err, size_t err_bytes) {
  *out = NULL;
  int rc = zd_pb_check_strings(desc, bytes, nbytes, err, err_bytes);
  static const uint8_t empty[1];
  ProtobufCMessage *msg =
      rc == 0 ? protobuf_c_message_unpack(desc, NULL, nbytes, bytes != NULL ? bytes : empty) : NULL;
  if (msg == NULL || has_field_zero(msg)) {
    ctl_free(msg);
    /* A bad string keeps the walker's message, which names the field. */
    if (rc == 0 || rc == -EBADMSG)
      snprintf(err, err_bytes, "not a valid %s message", desc->name);
    return -EBADMSG;
  }
  *out = msg;
  return 0;
}

void ctl_free(ProtobufCMessage *msg) {
  if (msg != NULL)
    protobuf_c_message_free_unpacked(msg, NULL);
}

int ctl_check_retired_job(const Zerod__V1__RetiredJob *retired, char *err, size_t err_bytes) {
  int rc = check_name("deleted job name", retired->name, err, err_bytes);
  if (rc != 0)
    return rc;
  if (!ctl_valid_job_dir_name(retired->name))
    return fail(err, err_bytes, "deleted job '%s' cannot name a directory", retired->name);
  if (retired->id == 0 || retired->id > INT64_MAX)
    return fail(err, err_bytes, "deleted job '%s' has id %" PRIu64, retired->name, retired->id);
  if (retired->tenant[0] != '\0' && !ctl_valid_job_dir_name(retired->tenant))
    return fail(err, err_bytes, "deleted job '%s' has an invalid tenant", retired->name);
  return 0;
}

int ctl_check_stored_job(const Zerod__V1__StoredJob *stored, char *err, size_t err_bytes) {
  const Zerod__V1__Job *j = stored->job;
  if (j == NULL)
    return fail(err, err_bytes, "a stored job has no job");
  int rc = check_name("job name", j->name, err, err_bytes);
  if (rc != 0)
    return rc;
  char inner[256];
  if (check_world(j->nodes, j->ranks_per_node, inner, sizeof inner) != 0 ||
      ctl_check_job_config(j->config, inner, sizeof inner) != 0)
    return fail(err, err_bytes, "job '%s': %s", j->name, inner);
  /* The token's hash; files from before tokens were hashed hold the
   * token itself. */
  if (stored->token_sha256[0] != '\0' ? !digest_is_hex(stored->token_sha256)
                                      : check_token(stored->token, 0, inner, sizeof inner) != 0)
    return fail(err, err_bytes, "job '%s': its owner token's hash is not 64 hex digits", j->name);
  for (size_t i = 0; i < stored->n_read_token_sha256; i++)
    if (!digest_is_hex(stored->read_token_sha256[i]))
      return fail(err, err_bytes, "job '%s': a read token's hash is not 64 hex digits", j->name);
  if (j->id == 0)
    return fail(err, err_bytes, "job '%s' has id 0", j->name);
  if (j->tenant[0] != '\0' && !ctl_valid_job_dir_name(j->tenant))
    return fail(err, err_bytes, "job '%s' has an invalid tenant", j->name);
  if (check_shared_with(j->shared_with, j->n_shared_with, inner, sizeof inner) != 0)
    return fail(err, err_bytes, "job '%s': %s", j->name, inner);
  if (j->frozen && j->config != NULL && j->config->base_job[0] != '\0')
    return fail(err, err_bytes, "job '%s' is a base on a base", j->name);
  if (j->world_size != j->nodes * j->ranks_per_node || j->n_placement != j->nodes)
    return fail(err, err_bytes, "job '%s': world and placement disagree", j->name);
  for (size_t i = 0; i < j->n_placement; i++) {
    const Zerod__V1__RankPlacement *p = j->placement[i];
    if (p == NULL || !ctl_valid_name(p->node) || p->first_rank != i * j->ranks_per_node ||
        p->ranks != j->ranks_per_node)
      return fail(err, err_bytes, "job '%s': placement %zu is invalid", j->name, i);
    for (size_t k = 0; k < i; k++)
      if (strcmp(j->placement[k]->node, p->node) == 0)
        return fail(err, err_bytes, "job '%s': node '%s' is placed twice", j->name, p->node);
  }
  return 0;
}
