/* ckpt_retire: what becomes of a deleted job's checkpoints
 * (docs/checkpoints.md, "Ownership"; the records and the owner rules are
 * ckpt_owner.c).
 *
 * When a job is deleted its checkpoint directory <name> is moved to
 * <name>@<id>, so that a new job of the name starts with none of them and
 * cannot collide with their names. The move waits until the job's nodes
 * have let it go and no save, restore or export reads or writes there;
 * until it is done the name cannot be taken. Checks by owner do not depend
 * on the move: a directory that was not moved (a crash between the two, a
 * directory from before this version) is still read by owner. A retired
 * job is forgotten when its last checkpoint goes: deleted by its tenant,
 * or, with --retain-deleted-checkpoints, removed that long after the job's
 * deletion.
 *
 * On the loop thread. A rename and a directory fsync per move are left in
 * line, as for a checkpoint's delete (ckpt_catalog.c); removals go to the
 * thread pool. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "coord_impl.h"
#include "ctl_decode.h"
#include "log.h"

void coord__ckpt_retired_gone(coord *c, uint64_t id) {
  retired_job *r = coord__retired_find(c, id);
  if (r == NULL)
    return;
  LOG_INFOF("deleted job's checkpoints all gone", "job=%s id=%" PRIu64, r->name, r->id);
  coord__retired_drop(c, r);
  char err[PATH_MAX + 256];
  if (coord__state_save(c, err, sizeof err) != 0)
    LOG_WARNF("cannot write the state; the record of a deleted job stays until the next write",
              "err=\"%s\"", err);
}

/* ------------------------------------------------------------------------ */
/* Retired jobs: moving their directories                                   */
/* ------------------------------------------------------------------------ */

/* What retire_move did. */
enum { MOVE_WAITS = 0, MOVE_DONE = 1, MOVE_NOTHING = 2 };

/* Moves r's directory <name> to <name>@<id> if nothing holds it. Returns
 * MOVE_DONE (r->moved is set), MOVE_NOTHING (there is no directory: no
 * checkpoint to keep), or MOVE_WAITS with the reason in why. */
static int retire_move(coord *c, retired_job *r, char *why, size_t why_bytes) {
  char from[PATH_MAX], to[PATH_MAX];
  coord__retired_dir(c, r, 0, from);
  coord__retired_dir(c, r, 1, to);
  struct stat st;
  if (coord__find_job(c, r->name) != NULL) {
    snprintf(why, why_bytes, "its nodes have not let the job go yet");
    return MOVE_WAITS;
  }
  if (lstat(from, &st) != 0 && errno == ENOENT)
    return MOVE_NOTHING; /* removed by hand, or the last checkpoint deleted */
  if (coord__ckpt_dir_busy(c, from)) {
    snprintf(why, why_bytes, "a save, restore or export is using %.3500s", from);
    return MOVE_WAITS;
  }
  int rc = renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE);
  if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) {
    /* A filesystem without RENAME_NOREPLACE (some network ones): look
     * first; only an operator could race this. */
    if (lstat(to, &st) == 0)
      errno = EEXIST;
    else
      rc = rename(from, to);
  }
  if (rc != 0) {
    int errnum = errno;
    if (errnum != EEXIST && errnum != ENOTEMPTY) {
      snprintf(why, why_bytes, "cannot rename %.1500s to %.1500s: %s", from, to, strerror(errnum));
      return MOVE_WAITS;
    }
    /* Ids do not repeat (coord__ckpt_init starts them above every
     * <name>@<id> it finds), so only an operator's copy can be there: it
     * is left alone, and the old directory stays as it is, read by owner. */
    LOG_ERRORF("a deleted job's checkpoint directory cannot move: the target exists; left in place",
               "from=%s to=%s", from, to);
  } else {
    int fd = open(c->options.checkpoint_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fsync(fd) != 0)
      LOG_WARNF("deleted job's checkpoints moved, but the directory not synced",
                "path=%s err=\"%s\"", c->options.checkpoint_dir, strerror(errno));
    if (fd >= 0)
      close(fd);
    LOG_INFOF("deleted job's checkpoints moved", "job=%s id=%" PRIu64 " path=%s", r->name, r->id,
              to);
  }
  r->moved = 1;
  return MOVE_DONE;
}

/* Takes a retired job's move one step: moved, forgotten (nothing to
 * keep), or still waiting (why). Returns whether the records changed. */
static int retire_step(coord *c, size_t *i, char *why, size_t why_bytes) {
  retired_job *r = &c->retired[*i];
  int done = retire_move(c, r, why, why_bytes);
  if (done == MOVE_NOTHING) {
    LOG_INFOF("deleted job left no checkpoint", "job=%s id=%" PRIu64, r->name, r->id);
    coord__retired_drop(c, r); /* *i now names the next */
    return 1;
  }
  (*i)++;
  return done == MOVE_DONE;
}

void coord__ckpt_retire_pending(coord *c) {
  int changed = 0;
  size_t i = 0;
  while (i < c->nretired) {
    if (c->retired[i].moved) {
      i++;
      continue;
    }
    char why[PATH_MAX + 64];
    changed |= retire_step(c, &i, why, sizeof why);
  }
  if (!changed)
    return;
  char err[PATH_MAX + 256];
  if (coord__state_save(c, err, sizeof err) != 0)
    LOG_WARNF("cannot write the state after moving a deleted job's checkpoints; the move is "
              "found again at the next start",
              "err=\"%s\"", err);
}

int coord__ckpt_name_free(coord *c, const char *name, char *err, size_t err_bytes) {
  size_t i = 0;
  while (i < c->nretired) {
    retired_job *r = &c->retired[i];
    if (r->moved || strcmp(r->name, name) != 0) {
      i++;
      continue;
    }
    char why[PATH_MAX + 64] = "";
    uint64_t id = r->id;
    if (retire_step(c, &i, why, sizeof why)) {
      char failed[PATH_MAX + 256];
      if (coord__state_save(c, failed, sizeof failed) != 0)
        LOG_WARNF("cannot write the state after moving a deleted job's checkpoints", "err=\"%s\"",
                  failed);
      continue;
    }
    snprintf(err, err_bytes,
             "the name '%s' is not free yet: the checkpoints of its deleted job (id %" PRIu64
             ") are still to be moved to %s@%" PRIu64 " (%s); retry shortly",
             name, id, name, id, why);
    return RPC_UNAVAILABLE;
  }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Retention of deleted jobs' checkpoints                                   */
/* ------------------------------------------------------------------------ */

void coord__ckpt_retention(coord *c, int64_t now_unix_ms) {
  int64_t keep_ms = c->options.retain_deleted_checkpoints_ms;
  if (keep_ms <= 0)
    return;
  size_t i = 0;
  while (i < c->nretired) {
    retired_job *r = &c->retired[i];
    char dir[PATH_MAX], gone[PATH_MAX + 64];
    if (!r->moved || now_unix_ms - r->deleted_unix_ms < keep_ms) {
      i++;
      continue;
    }
    coord__retired_dir(c, r, 1, dir);
    if (coord__ckpt_dir_busy(c, dir)) {
      i++; /* an export or a restore reads it: next time */
      continue;
    }
    /* Out of every listing at once; its files go on the thread pool (the
     * mark has a crash remove them at the next start). */
    snprintf(gone, sizeof gone, "%s.deleting-%" PRIu64, dir, c->ckpt.next_id++);
    if (rename(dir, gone) == 0) {
      LOG_INFOF("deleted job's checkpoints removed: past --retain-deleted-checkpoints",
                "job=%s id=%" PRIu64 " deleted_unix_ms=%" PRId64, r->name, r->id,
                r->deleted_unix_ms);
      coord__ckpt_remove_tree(c, gone, "retention of a deleted job");
    } else if (errno != ENOENT) {
      LOG_WARNF("cannot remove a deleted job's checkpoints", "path=%s err=\"%s\"", dir,
                strerror(errno));
      i++;
      continue;
    }
    coord__ckpt_retired_gone(c, r->id); /* r is gone: i now names the next */
  }
}

/* A checkpoint of a deleted job was removed: when it was the last one,
 * its directory goes, and with it the coordinator's record of the job
 * (ckpt_owner.c). */
void coord__ckpt_removed(coord *c, const char *removed) {
  char parent[PATH_MAX];
  snprintf(parent, sizeof parent, "%s", removed);
  char *slash = strrchr(parent, '/');
  if (slash == NULL)
    return;
  *slash = '\0';
  const char *base = strrchr(parent, '/');
  uint64_t id;
  if (base == NULL || !ctl_parse_checkpoint_dir(base + 1, NULL, &id) || id == 0 ||
      strncmp(parent, c->options.checkpoint_dir, (size_t)(base - parent)) != 0 ||
      c->options.checkpoint_dir[base - parent] != '\0')
    return;
  if (coord__ckpt_dir_busy(c, parent) || rmdir(parent) != 0)
    return; /* it still holds checkpoints (ENOTEMPTY), or is in use */
  coord__ckpt_retired_gone(c, id);
}
