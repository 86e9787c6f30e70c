/* The coordinator's durable state (coord_impl.h): coordinator.pb in
 * --state-dir, a CoordinatorState message that holds the jobs (without
 * their derived state), the records of deleted jobs whose checkpoints are
 * kept (ckpt_owner.c) and the next job id.
 *
 * The file is written whole and atomically whenever a job is created or
 * deleted, a read token issued, or a deleted job's record changes: a
 * temporary file, fsync, rename over the old one, fsync of the directory.
 * The write blocks the loop: a few kilobytes, on rare operator actions
 * whose answer must wait until the state is durable anyway. It is read
 * once, at coord_create; a file that cannot be read in full or does not
 * decode is an error, never silently dropped. An in-memory coordinator
 * (zerod standalone: no --state-dir) writes nothing. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "coord_impl.h"
#include "ctl_decode.h"
#include "digest.h"
#include "filemode.h"
#include "fsutil.h"

/* Writes the jobs (without the deleting ones and skip, plus add), the
 * retired jobs and next_job_id to coordinator.pb atomically: a temporary
 * file, fsync, rename over the old one, fsync of the directory. On failure the old file
 * is intact and err holds the reason. Blocks the loop (see the top of the
 * file). Returns 0 or a negative errno. */
int coord__state_write(coord *c, const cjob *add, const cjob *skip, uint64_t next_job_id, char *err,
                       size_t err_bytes) {
  if (c->options.state_dir[0] == '\0')
    return 0; /* an in-memory coordinator */
  size_t cap = c->njobs + 1;
  Zerod__V1__StoredJob *stored = calloc(cap, sizeof *stored);
  Zerod__V1__StoredJob **pointers = calloc(cap, sizeof *pointers);
  Zerod__V1__Job *jobs = calloc(cap, sizeof *jobs);
  Zerod__V1__RetiredJob *retired = NULL, **retired_pointers = NULL;
  uint8_t *buf = NULL;
  int rc = -ENOMEM;
  const char *step = "pack";
  if (stored == NULL || pointers == NULL || jobs == NULL)
    goto out;
  size_t count = 0;
  for (size_t i = 0; i <= c->njobs; i++) {
    const cjob *j = i < c->njobs ? c->jobs[i] : add;
    if (j == NULL || j == skip || j->deleting || (c->options.durable_bases_only && !j->msg->frozen))
      continue;
    /* State and reason are derived, never stored; the epoch is. */
    jobs[count] = *j->msg;
    jobs[count].state = ZEROD__V1__JOB_STATE__JOB_STATE_UNSPECIFIED;
    jobs[count].reason = (char *)"";
    jobs[count].step = j->step;
    jobs[count].epoch = j->epoch;
    zerod__v1__stored_job__init(&stored[count]);
    stored[count].job = &jobs[count];
    stored[count].token_sha256 = j->token_sha256;
    stored[count].n_read_token_sha256 = j->n_read_tokens;
    stored[count].read_token_sha256 = (char **)j->read_token_ptrs;
    pointers[count] = &stored[count];
    count++;
  }
  Zerod__V1__CoordinatorState state = ZEROD__V1__COORDINATOR_STATE__INIT;
  state.format_version = COORD_STATE_FORMAT;
  state.next_job_id = next_job_id;
  state.n_jobs = count;
  state.jobs = pointers;
  retired = calloc(c->nretired ? c->nretired : 1, sizeof *retired);
  retired_pointers = calloc(c->nretired ? c->nretired : 1, sizeof *retired_pointers);
  if (retired == NULL || retired_pointers == NULL)
    goto out;
  for (size_t i = 0; i < c->nretired; i++) {
    const retired_job *r = &c->retired[i];
    zerod__v1__retired_job__init(&retired[i]);
    retired[i].name = (char *)r->name;
    retired[i].id = r->id;
    retired[i].tenant = (char *)r->tenant;
    retired[i].deleted_unix_ms = r->deleted_unix_ms;
    retired[i].moved = r->moved;
    retired_pointers[i] = &retired[i];
  }
  state.n_retired = c->nretired;
  state.retired = retired_pointers;
  size_t len = zerod__v1__coordinator_state__get_packed_size(&state);
  buf = malloc(len ? len : 1);
  if (buf == NULL)
    goto out;
  zerod__v1__coordinator_state__pack(&state, buf);

  /* coordinator.pb.tmp written, fsynced and renamed over coordinator.pb
   * (fsutil_replace), then the directory fsynced: the rename is durable
   * only once the directory is. If that fsync fails the new file may or
   * may not survive a crash; the caller reports the error and keeps its
   * old state in memory, and the next write settles the file again. */
  rc = fsutil_replace(c->state_path, buf, len, &step);
  if (rc == 0) {
    rc = fsutil_fsync_dir(c->options.state_dir, NULL);
    step = "fsync directory";
  }
  if (rc != 0)
    snprintf(err, err_bytes, "cannot save the coordinator state (%s %s): %s", step,
             strcmp(step, "rename") == 0 || strncmp(step, "fsync d", 7) == 0 ? c->state_path
                                                                             : c->tmp_path,
             strerror(-rc));
out:
  if (rc == -ENOMEM)
    snprintf(err, err_bytes, "cannot save the coordinator state: out of memory");
  free(buf);
  free(stored);
  free(pointers);
  free(jobs);
  free(retired);
  free(retired_pointers);
  return rc;
}

int coord__job_store(coord *c, cjob *j, const Zerod__V1__Job *changed, char *err,
                     size_t err_bytes) {
  Zerod__V1__Job *fresh = coord__message_copy(&changed->base);
  if (fresh == NULL) {
    snprintf(err, err_bytes, "coordinator out of memory");
    return RPC_RESOURCE_EXHAUSTED;
  }
  Zerod__V1__Job *old = j->msg;
  j->msg = fresh;
  if (coord__state_write(c, NULL, NULL, c->next_job_id, err, err_bytes) != 0) {
    j->msg = old;
    ctl_free(&fresh->base);
    return RPC_UNAVAILABLE;
  }
  ctl_free(&old->base);
  return 0;
}

int coord__state_save(coord *c, char *err, size_t err_bytes) {
  return coord__state_write(c, NULL, NULL, c->next_job_id, err, err_bytes);
}

static int compare_jobs(const void *a, const void *b) {
  return strcmp((*(cjob *const *)a)->msg->name, (*(cjob *const *)b)->msg->name);
}

/* Loads coordinator.pb. A missing file is an empty state; anything that
 * cannot be read in full, or is not a valid CoordinatorState of our format,
 * is an error (the operator decides; we never start over silently). */
int coord__state_load(coord *c, char *err, size_t err_bytes) {
  uint8_t *buf = NULL;
  Zerod__V1__CoordinatorState *state = NULL;
  int rc = 0;
  int fd = open(c->state_path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT)
      return 0;
    rc = -errno;
    snprintf(err, err_bytes, "cannot open %s: %s", c->state_path, strerror(errno));
    return rc;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    rc = -errno;
    snprintf(err, err_bytes, "cannot stat %s: %s", c->state_path, strerror(errno));
    goto out;
  }
  if (!S_ISREG(st.st_mode) || st.st_size > (off_t)COORD_MAX_STATE_BYTES) {
    rc = -EFBIG;
    snprintf(err, err_bytes, "%s is not a regular file of at most %u bytes", c->state_path,
             COORD_MAX_STATE_BYTES);
    goto out;
  }
  size_t len = (size_t)st.st_size;
  buf = malloc(len ? len : 1);
  if (buf == NULL) {
    rc = -ENOMEM;
    snprintf(err, err_bytes, "out of memory reading %s", c->state_path);
    goto out;
  }
  for (size_t done = 0; done < len;) {
    ssize_t n = read(fd, buf + done, len - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      rc = n == 0 ? -EIO : -errno;
      snprintf(err, err_bytes, "cannot read %s: %s", c->state_path,
               n == 0 ? "file shrank while reading" : strerror(errno));
      goto out;
    }
    done += (size_t)n;
  }
  /* The file is outside bytes too: its strings are checked as a request's
   * are, so that a job name with a NUL in it cannot come back as another. */
  char why[384];
  ProtobufCMessage *decoded = NULL;
  if (ctl_decode_message(&zerod__v1__coordinator_state__descriptor, buf, len, &decoded, why,
                         sizeof why) != 0) {
    rc = -EBADMSG;
    snprintf(err, err_bytes, "%s is corrupt: %s", c->state_path, why);
    goto out;
  }
  state = (Zerod__V1__CoordinatorState *)decoded;
  if (state->format_version != COORD_STATE_FORMAT) {
    rc = -EBADMSG;
    snprintf(err, err_bytes, "%s has format version %u (this coordinator reads %d)", c->state_path,
             state->format_version, COORD_STATE_FORMAT);
    goto out;
  }
  if (state->n_jobs > COORD_MAX_JOBS) {
    rc = -EBADMSG;
    snprintf(err, err_bytes, "%s holds %zu jobs (at most %d)", c->state_path, state->n_jobs,
             COORD_MAX_JOBS);
    goto out;
  }
  c->jobs = calloc(state->n_jobs ? state->n_jobs : 1, sizeof *c->jobs);
  if (c->jobs == NULL) {
    rc = -ENOMEM;
    snprintf(err, err_bytes, "out of memory loading %s", c->state_path);
    goto out;
  }
  uint64_t next_id = state->next_job_id ? state->next_job_id : 1;
  for (size_t i = 0; i < state->n_jobs; i++) {
    const Zerod__V1__StoredJob *s = state->jobs[i];
    if (s == NULL || ctl_check_stored_job(s, why, sizeof why) != 0) {
      rc = -EBADMSG;
      snprintf(err, err_bytes, "%s is corrupt: %s", c->state_path, s ? why : "empty job");
      goto out;
    }
    Zerod__V1__Job *copy = coord__message_copy(&s->job->base);
    /* Files from before tokens were hashed hold the token itself. */
    char hashed[DIGEST_HEX_BYTES];
    if (s->token_sha256[0] == '\0')
      digest_sha256_hex(s->token, hashed);
    cjob *j = copy != NULL
                  ? coord__job_new(copy, s->token_sha256[0] != '\0' ? s->token_sha256 : hashed)
                  : NULL;
    if (j == NULL) {
      ctl_free(copy ? &copy->base : NULL);
      rc = -ENOMEM;
      snprintf(err, err_bytes, "out of memory loading %s", c->state_path);
      goto out;
    }
    c->jobs[c->njobs++] = j;
    for (size_t t = 0; t < s->n_read_token_sha256; t++) {
      if (coord__job_add_read_token(j, s->read_token_sha256[t]) != 0) {
        rc = -ENOMEM;
        snprintf(err, err_bytes, "out of memory loading %s", c->state_path);
        goto out;
      }
    }
    if (j->msg->id >= next_id)
      next_id = j->msg->id + 1;
  }
  if ((rc = coord__ckpt_retired_load(c, state, err, err_bytes)) != 0)
    goto out;
  for (size_t i = 0; i < c->nretired; i++)
    if (c->retired[i].id >= next_id)
      next_id = c->retired[i].id + 1;
  qsort(c->jobs, c->njobs, sizeof *c->jobs, compare_jobs);
  for (size_t i = 1; i < c->njobs; i++) {
    if (strcmp(c->jobs[i - 1]->msg->name, c->jobs[i]->msg->name) == 0) {
      rc = -EBADMSG;
      snprintf(err, err_bytes, "%s is corrupt: job '%s' is stored twice", c->state_path,
               c->jobs[i]->msg->name);
      goto out;
    }
  }
  c->next_job_id = next_id;
out:
  if (state != NULL)
    zerod__v1__coordinator_state__free_unpacked(state, NULL);
  free(buf);
  close(fd);
  return rc;
}
