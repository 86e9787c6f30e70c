/* ckpt_owner: who owns a checkpoint and who may reach it, and the records
 * of deleted jobs (docs/checkpoints.md, "Ownership"; docs/security.md).
 *
 * A checkpoint belongs to the job that saved it, by the job's id, not its
 * name: a job created later under the same name is another job. Its
 * manifest says which (job_id, and since format 2 the tenant), and the
 * coordinator knows the tenant of every job id it has: the live jobs, and
 * the deleted ones whose checkpoints it keeps (retired jobs, stored in
 * coordinator.pb). Who may reach a checkpoint follows from its owner
 * tenant alone: an admin, or a principal of that tenant (reading: readers
 * too; deleting: the tenant), or a node restoring the job that saved it.
 * A checkpoint of a tenant another principal cannot read is not found, as
 * if it did not exist.
 *
 * This file holds the rules and the records of retired jobs; it calls
 * nothing of the coordinator's. What happens to a retired job's directory
 * (moved aside, removed by retention) is ckpt_retire.c.
 *
 * Everything here runs on the loop thread, except coord__ckpt_owner and
 * coord__ckpt_allowed, which read only their ckpt_access. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "coord_impl.h"

/* ------------------------------------------------------------------------ */
/* Who owns what                                                            */
/* ------------------------------------------------------------------------ */

static int compare_owners(const void *a, const void *b) {
  const ckpt_owner *x = a, *y = b;
  return x->job_id < y->job_id ? -1 : x->job_id > y->job_id;
}

int coord__ckpt_access(const coord *c, const coord_caller *who, const cjob *for_job,
                       ckpt_access *a) {
  memset(a, 0, sizeof *a);
  a->who = *who;
  if (for_job != NULL) {
    a->for_job_id = for_job->msg->id;
    snprintf(a->for_tenant, sizeof a->for_tenant, "%s", for_job->msg->tenant);
  }
  size_t n = c->njobs + c->nretired;
  a->owners = calloc(n ? n : 1, sizeof *a->owners);
  if (a->owners == NULL)
    return -ENOMEM;
  for (size_t i = 0; i < c->njobs; i++) {
    a->owners[a->nowners].job_id = c->jobs[i]->msg->id;
    snprintf(a->owners[a->nowners++].tenant, sizeof a->owners[0].tenant, "%s",
             c->jobs[i]->msg->tenant);
  }
  for (size_t i = 0; i < c->nretired; i++) {
    a->owners[a->nowners].job_id = c->retired[i].id;
    snprintf(a->owners[a->nowners++].tenant, sizeof a->owners[0].tenant, "%s",
             c->retired[i].tenant);
  }
  qsort(a->owners, a->nowners, sizeof *a->owners, compare_owners);
  return 0;
}

void coord__ckpt_access_free(ckpt_access *a) {
  free(a->owners);
  a->owners = NULL;
  a->nowners = 0;
}

const char *coord__ckpt_owner(const ckpt_access *a, uint64_t job_id, const char *manifest_tenant) {
  ckpt_owner key = {.job_id = job_id};
  const ckpt_owner *known =
      a->nowners > 0 ? bsearch(&key, a->owners, a->nowners, sizeof *a->owners, compare_owners)
                     : NULL;
  if (known != NULL)
    return known->tenant;
  return manifest_tenant != NULL ? manifest_tenant : "";
}

int coord__ckpt_allowed(const ckpt_access *a, uint64_t job_id, const char *manifest_tenant,
                        ckpt_want want) {
  const coord_caller *who = &a->who;
  if (who->trusted || who->role == AUTH_ADMIN)
    return 0;
  const char *owner = coord__ckpt_owner(a, job_id, manifest_tenant);
  int same_tenant = owner[0] != '\0' && strcmp(owner, who->tenant) == 0;
  switch (who->role) {
  case AUTH_NODE:
    /* A node restores the job it acts for from that job's checkpoints,
     * or from its tenant's; it reads, lists and deletes nothing else. */
    if (want == CKPT_READ && a->for_job_id != 0 &&
        (job_id == a->for_job_id || (owner[0] != '\0' && strcmp(owner, a->for_tenant) == 0)))
      return 0;
    return RPC_NOT_FOUND;
  case AUTH_TENANT:
    return same_tenant ? 0 : RPC_NOT_FOUND;
  case AUTH_READER:
    if (!same_tenant)
      return RPC_NOT_FOUND;
    return want == CKPT_READ ? 0 : RPC_PERMISSION_DENIED;
  default:
    return RPC_NOT_FOUND;
  }
}

/* ------------------------------------------------------------------------ */
/* Checks that read a manifest                                              */
/* ------------------------------------------------------------------------ */

/* Whether access may delete the checkpoint at path, by its manifest's
 * owner (read here, in line: one small file). A directory whose manifest
 * does not decode has no known owner: an admin's to remove. Returns 0 or
 * the status (coord__ckpt_allowed's). */
int coord__ckpt_may_delete(const ckpt_access *access, const char *path) {
  if (access->who.trusted || access->who.role == AUTH_ADMIN)
    return 0;
  ckpt_manifest m;
  char why[256];
  if (ckpt_manifest_load(path, CKPT_MANIFEST_NAME, 0, &m, why, sizeof why) != 0)
    return RPC_NOT_FOUND;
  int status = coord__ckpt_allowed(access, m.job_id, m.tenant, CKPT_DELETE);
  ckpt_manifest_free(&m);
  return status;
}

/* Whether j saved its directory's checkpoint name (by the manifest's job
 * id): a directory not moved aside when an earlier job of the name was
 * deleted (docs/checkpoints.md, "Ownership") may hold that job's too. */
int coord__ckpt_saved_by(const coord *c, const cjob *j, const char *name) {
  char path[PATH_MAX + 2 * CTL_NAME_MAX_BYTES + 2], why[256];
  snprintf(path, sizeof path, "%.3500s/%.64s/%.64s", c->options.checkpoint_dir, j->msg->name, name);
  ckpt_manifest m;
  if (ckpt_manifest_load(path, CKPT_MANIFEST_NAME, 0, &m, why, sizeof why) != 0)
    return 0;
  int own = m.job_id == j->msg->id;
  ckpt_manifest_free(&m);
  return own;
}

/* ------------------------------------------------------------------------ */
/* Retired jobs: the records                                                */
/* ------------------------------------------------------------------------ */

retired_job *coord__retired_find(coord *c, uint64_t id) {
  for (size_t i = 0; i < c->nretired; i++)
    if (c->retired[i].id == id)
      return &c->retired[i];
  return NULL;
}

void coord__retired_drop(coord *c, retired_job *r) {
  size_t i = (size_t)(r - c->retired);
  memmove(&c->retired[i], &c->retired[i + 1], (c->nretired - i - 1) * sizeof *c->retired);
  c->nretired--;
}

static int add_retired(coord *c, const retired_job *r) {
  retired_job *grown = realloc(c->retired, (c->nretired + 1) * sizeof *grown);
  if (grown == NULL)
    return -ENOMEM;
  c->retired = grown;
  c->retired[c->nretired++] = *r;
  return 0;
}

void coord__retired_dir(const coord *c, const retired_job *r, int moved, char out[PATH_MAX]) {
  if (moved)
    snprintf(out, PATH_MAX, "%.3500s/%.64s@%" PRIu64, c->options.checkpoint_dir, r->name, r->id);
  else
    snprintf(out, PATH_MAX, "%.3500s/%.64s", c->options.checkpoint_dir, r->name);
}

int coord__ckpt_retire(coord *c, const cjob *j, int64_t now_unix_ms) {
  if (c->options.checkpoint_dir[0] == '\0')
    return 0;
  retired_job r = {.id = j->msg->id, .deleted_unix_ms = now_unix_ms};
  snprintf(r.name, sizeof r.name, "%s", j->msg->name);
  snprintf(r.tenant, sizeof r.tenant, "%s", j->msg->tenant);
  /* A job that never saved has no directory, and nothing to keep. (A
   * save in flight has made it already.) */
  char dir[PATH_MAX];
  struct stat st;
  coord__retired_dir(c, &r, 0, dir);
  if (lstat(dir, &st) != 0 && errno == ENOENT)
    return 0;
  return add_retired(c, &r);
}

void coord__ckpt_unretire(coord *c, uint64_t id) {
  retired_job *r = coord__retired_find(c, id);
  if (r != NULL)
    coord__retired_drop(c, r);
}

/* ------------------------------------------------------------------------ */
/* The state file                                                           */
/* ------------------------------------------------------------------------ */

int coord__ckpt_retired_load(coord *c, const Zerod__V1__CoordinatorState *state, char *err,
                             size_t err_bytes) {
  for (size_t i = 0; i < state->n_retired; i++) {
    const Zerod__V1__RetiredJob *s = state->retired[i];
    char why[256];
    if (s == NULL || ctl_check_retired_job(s, why, sizeof why) != 0) {
      snprintf(err, err_bytes, "%s is corrupt: %s", c->state_path, s ? why : "empty record");
      return -EBADMSG;
    }
    if (coord__retired_find(c, s->id) != NULL) {
      snprintf(err, err_bytes, "%s is corrupt: deleted job id %" PRIu64 " is stored twice",
               c->state_path, s->id);
      return -EBADMSG;
    }
    retired_job r = {.id = s->id, .deleted_unix_ms = s->deleted_unix_ms, .moved = s->moved};
    snprintf(r.name, sizeof r.name, "%s", s->name);
    snprintf(r.tenant, sizeof r.tenant, "%s", s->tenant);
    if (add_retired(c, &r) != 0) {
      snprintf(err, err_bytes, "out of memory loading %s", c->state_path);
      return -ENOMEM;
    }
  }
  return 0;
}

void coord__ckpt_retired_free(coord *c) {
  free(c->retired);
  c->retired = NULL;
  c->nretired = 0;
}
