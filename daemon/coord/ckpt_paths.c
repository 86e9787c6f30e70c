/* ckpt_paths: the paths clients give the Checkpoints service
 * (coord_ckpt.h; confine.h; docs/checkpoints.md, "Where files may be read
 * and written"). A checkpoint a Restore or an Export reads, named by its
 * job and name or by a path, is resolved to a canonical path inside the
 * checkpoint directory or an export root, reached through no symbolic
 * link; the file an Export writes must lie in an export root, in a
 * directory that exists, and is written relative to that directory. What
 * a source holds (its manifest, its owner, its shard files' sizes) is
 * checked here too, on the thread pool, before anything reads it.
 *
 * Resolving runs on the loop; the checks of a source and the export's
 * target run on the thread pool (they stat and open files). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "confine.h"
#include "coord_ckpt.h"

/* The roots Export may write in: the export roots, or the checkpoint
 * directory if none is configured. Returns how many. */
unsigned coord__ckpt_write_roots(const coord *c, const char **roots) {
  if (c->options.n_export_roots == 0) {
    roots[0] = c->options.checkpoint_dir;
    return 1;
  }
  for (unsigned i = 0; i < c->options.n_export_roots; i++)
    roots[i] = c->options.export_roots[i];
  return c->options.n_export_roots;
}

/* The roots a checkpoint named by its path may be read from: the
 * checkpoint directory and the export roots (what an Export wrote may be
 * restored). Returns how many. */
static unsigned read_roots(const coord *c, const char **roots) {
  roots[0] = c->options.checkpoint_dir;
  for (unsigned i = 0; i < c->options.n_export_roots; i++)
    roots[i + 1] = c->options.export_roots[i];
  return 1 + c->options.n_export_roots;
}

/* "a, b, c", for messages. */
static void roots_text(const char *const *roots, unsigned nroots, char *out, size_t out_bytes) {
  size_t len = 0;
  out[0] = '\0';
  for (unsigned i = 0; i < nroots && len < out_bytes; i++) {
    int n = snprintf(out + len, out_bytes - len, "%s%s", i > 0 ? ", " : "", roots[i]);
    if (n < 0)
      break;
    len += (size_t)n;
  }
}

/* Places a client's path in roots (what names them, "export roots", is
 * for messages): out gets the canonical path (root, then the rest of
 * path, normalized) and *root_len the root's length in it. what ("export
 * path") names the path in messages. Text only: nothing is opened.
 * Returns 0, or a gRPC status with the reason in err. */
int coord__ckpt_place_path(const char *what, const char *path, const char *const *roots,
                           unsigned nroots, const char *roots_name, char *out, size_t out_bytes,
                           size_t *root_len, char *err, size_t err_bytes) {
  char rel[PATH_MAX];
  char allowed[1024];
  int root = confine_locate(path, roots, nroots, rel, sizeof rel);
  if (root < 0) {
    roots_text(roots, nroots, allowed, sizeof allowed);
    if (root == -EACCES)
      snprintf(err, err_bytes, "%s %s is outside the %s (%s)", what, path, roots_name, allowed);
    else if (root == -EPERM)
      snprintf(err, err_bytes, "%s %s has a '..' component: it must name a file inside the %s (%s)",
               what, path, roots_name, allowed);
    else
      snprintf(err, err_bytes, "%s %s: %s", what, path,
               root == -ENAMETOOLONG ? "too long" : "not a path");
    return root == -EACCES || root == -EPERM ? RPC_PERMISSION_DENIED : RPC_INVALID_ARGUMENT;
  }
  const char *r = roots[root];
  int root_is_slash = strcmp(r, "/") == 0;
  int n = snprintf(out, out_bytes, "%s%s%s", root_is_slash ? "" : r,
                   rel[0] != '\0' || root_is_slash ? "/" : "", rel);
  if (n < 0 || (size_t)n >= out_bytes || (size_t)n > CTL_PATH_MAX_BYTES) {
    snprintf(err, err_bytes, "%s %s: too long", what, path);
    return RPC_INVALID_ARGUMENT;
  }
  *root_len = strlen(r);
  return 0;
}

/* Opens the directory that holds the last component of path (canonical,
 * its root the first root_len bytes) from its root, never following a
 * symbolic link (confine_open_parent). Returns 0 with *dir_fd (to close)
 * and *name pointing into path, or a gRPC status with the reason in
 * result. */
static int open_parent(const char *what, const char *path, size_t root_len, int *dir_fd,
                       const char **name, work_result *result) {
  char root[PATH_MAX];
  snprintf(root, sizeof root, "%.*s", (int)root_len, path);
  const char *rel = path + root_len;
  if (*rel == '/')
    rel++;
  int root_fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (root_fd < 0)
    return coord__ckpt_work_fail(
        result, errno == ENOENT ? RPC_FAILED_PRECONDITION : coord__ckpt_io_status(errno),
        "cannot open the root %s: %s", root, strerror(errno));
  size_t bad_len = 0;
  int rc = confine_open_parent(root_fd, rel, dir_fd, name, &bad_len);
  close(root_fd);
  if (rc == 0)
    return 0;
  int bad = (int)((size_t)(rel - path) + bad_len); /* the failed component, in path */
  switch (rc) {
  case -ELOOP:
    return coord__ckpt_work_fail(
        result, RPC_PERMISSION_DENIED,
        "%s %s goes through a symbolic link at %.*s, which is never followed", what, path, bad,
        path);
  case -ENOENT:
  case -ENOTDIR:
    return coord__ckpt_work_fail(result, RPC_NOT_FOUND, "%.*s: no such directory (it must exist)",
                                 bad, path);
  case -EACCES:
  case -EPERM:
    return coord__ckpt_work_fail(result, RPC_PERMISSION_DENIED, "%s %s: cannot open %.*s: %s", what,
                                 path, bad, path, strerror(-rc));
  default:
    return coord__ckpt_work_fail(result, coord__ckpt_io_status(-rc), "%s %s: cannot open %.*s: %s",
                                 what, path, bad, path, strerror(-rc));
  }
}

/* Checks a checkpoint to read (a directory or a .safetensors file) at
 * path, canonical, inside a root: no component of it, the last included,
 * is a symbolic link. missing words NOT_FOUND ("%s" is path). Returns 0 or
 * a gRPC status with the reason in err. */
static int check_source_path(const char *path, size_t root_len, const char *missing, char *err,
                             size_t err_bytes) {
  work_result result = {0};
  int dir_fd;
  const char *name;
  if (open_parent("checkpoint path", path, root_len, &dir_fd, &name, &result) != 0) {
    if (result.status == RPC_NOT_FOUND)
      snprintf(err, err_bytes, missing, path);
    else
      snprintf(err, err_bytes, "%s", result.message);
    return result.status;
  }
  struct stat st;
  int rc = fstatat(dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 ? 0 : -errno;
  close(dir_fd);
  if (rc == -ENOENT || rc == -ENOTDIR) {
    snprintf(err, err_bytes, missing, path);
    return RPC_NOT_FOUND;
  }
  if (rc != 0) {
    snprintf(err, err_bytes, "cannot stat %s: %s", path, strerror(-rc));
    return rc == -EACCES ? RPC_PERMISSION_DENIED : coord__ckpt_io_status(-rc);
  }
  if (S_ISLNK(st.st_mode)) {
    snprintf(err, err_bytes, "checkpoint path %s is a symbolic link, which is never followed",
             path);
    return RPC_PERMISSION_DENIED;
  }
  return 0;
}

/* Resolves a RestoreRequest.checkpoint (or ExportRequest.checkpoint) of
 * job into the canonical path of the checkpoint (in out): a name is
 * looked up in the checkpoint directory; a path must lie inside the
 * checkpoint directory or an export root, without "..", and is read
 * through no symbolic link. The path travels to the nodes, which must
 * find the same thing, and Delete recognizes it. Returns 0 or a status
 * with the reason in err. */
int coord__ckpt_resolve_source(const coord *c, const char *job, const char *ref, char *out,
                               size_t out_bytes, char *err, size_t err_bytes) {
  char other_job[CTL_CKPT_DIR_MAX_BYTES + 1], name[CTL_NAME_MAX_BYTES + 1];
  const char *roots[COORD_MAX_EXPORT_ROOTS + 1];
  size_t root_len = strlen(c->options.checkpoint_dir);
  const char *missing = "no checkpoint at %s";
  int status;
  switch (ctl_parse_checkpoint_ref(ref, other_job, name)) {
  case CTL_REF_NAME:
    coord__ckpt_path_format(out, out_bytes, "%s/%s/%s", c->options.checkpoint_dir, job, name);
    break;
  case CTL_REF_JOB_NAME:
    coord__ckpt_path_format(out, out_bytes, "%s/%s/%s", c->options.checkpoint_dir, other_job, name);
    break;
  case CTL_REF_PATH:
    status = coord__ckpt_place_path("checkpoint path", ref, roots, read_roots(c, roots),
                                    "roots checkpoints are read from", out, out_bytes, &root_len,
                                    err, err_bytes);
    if (status != 0)
      return status;
    missing = "%s: no such checkpoint or file";
    break;
  default:
    snprintf(err, err_bytes, "invalid checkpoint reference");
    return RPC_INVALID_ARGUMENT;
  }
  if ((status = check_source_path(out, root_len, missing, err, err_bytes)) != 0)
    return status;
  const char *base = strrchr(out, '/');
  base = base != NULL ? base + 1 : out;
  if (strstr(base, ".tmp-") != NULL || strstr(base, ".deleting-") != NULL) {
    snprintf(err, err_bytes, "%s is an unfinished save or a deleted checkpoint", out);
    return RPC_NOT_FOUND;
  }
  return 0;
}

/* The source of a Restore or an Export, stat'ed. Returns 0 or the status
 * in result. */
int coord__ckpt_stat_source(const char *source, struct stat *st, work_result *result) {
  if (lstat(source, st) == 0)
    return 0;
  if (errno == ENOENT || errno == ENOTDIR)
    return coord__ckpt_work_fail(result, RPC_NOT_FOUND, "no checkpoint at %s", source);
  return coord__ckpt_work_fail(
      result, errno == EACCES ? RPC_PERMISSION_DENIED : coord__ckpt_io_status(errno),
      "cannot stat %s: %s", source, strerror(errno));
}

/* A checkpoint directory about to be read (Restore, Export): its manifest
 * decodes, its owner is one access may read (ckpt_owner.c; one it may not
 * is "no checkpoint", as a missing one), and every shard file has the
 * size the manifest says (checksums are the readers' to verify, as they
 * read). Returns 0 with the saved step and world size, or the status in
 * result. */
int coord__ckpt_check_dir(const char *source, const ckpt_access *access, uint64_t *step,
                          uint32_t *world_size, work_result *result) {
  char path[PATH_MAX + CTL_FILE_MAX_BYTES + 2];
  struct stat st;
  snprintf(path, sizeof path, "%s/%s", source, CKPT_MANIFEST_NAME);
  if (stat(path, &st) != 0)
    return errno == ENOENT
               ? coord__ckpt_work_fail(result, RPC_NOT_FOUND, "%s is not a checkpoint (no %s)",
                                       source, CKPT_MANIFEST_NAME)
               : coord__ckpt_work_fail(result, coord__ckpt_io_status(errno), "cannot stat %s: %s",
                                       path, strerror(errno));
  ckpt_manifest m;
  char err[CKPT_MESSAGE_BYTES - 64];
  int rc = ckpt_manifest_load(source, CKPT_MANIFEST_NAME, 0, &m, err, sizeof err);
  if (rc != 0)
    return coord__ckpt_work_fail(result, rc == -ENOENT ? RPC_NOT_FOUND : RPC_DATA_LOSS, "%s", err);
  if (coord__ckpt_allowed(access, m.job_id, m.tenant, CKPT_READ) != 0) {
    ckpt_manifest_free(&m);
    return coord__ckpt_work_fail(result, RPC_NOT_FOUND, "no checkpoint at %s", source);
  }
  *step = m.step;
  *world_size = m.world_size;
  for (uint32_t r = 0; r < m.world_size && result->status == 0; r++) {
    const ckpt_file_entry *f = &m.files[r];
    snprintf(path, sizeof path, "%s/%s", source, f->name);
    if (stat(path, &st) != 0) {
      if (errno == ENOENT)
        coord__ckpt_work_fail(result, RPC_DATA_LOSS, "%s: missing", f->name);
      else
        coord__ckpt_work_fail(result, coord__ckpt_io_status(errno), "cannot stat %s: %s", path,
                              strerror(errno));
    } else if (!S_ISREG(st.st_mode)) {
      coord__ckpt_work_fail(result, RPC_DATA_LOSS, "%s: not a regular file", f->name);
    } else if ((uint64_t)st.st_size < f->bytes) {
      coord__ckpt_work_fail(result, RPC_DATA_LOSS,
                            "%s: truncated: %" PRIu64 " of %" PRIu64 " bytes", f->name,
                            (uint64_t)st.st_size, f->bytes);
    } else if ((uint64_t)st.st_size > f->bytes) {
      coord__ckpt_work_fail(result, RPC_DATA_LOSS,
                            "%s: too long: %" PRIu64 " bytes, the manifest says %" PRIu64, f->name,
                            (uint64_t)st.st_size, f->bytes);
    }
  }
  ckpt_manifest_free(&m);
  return result->status;
}

/* Opens the directory an export writes in and checks the name it will
 * write (export_spec): the directory exists and is reached through no
 * symbolic link, and the name is not a symbolic link, a directory or
 * anything but a regular file, nor an existing file unless overwrite.
 * Returns 0 with *dir_fd (to close) and *name, or the status in result. */
int coord__ckpt_export_target_open(const export_spec *ex, int *dir_fd, const char **name,
                                   work_result *result) {
  const char *path = ex->path;
  if (open_parent("export path", path, ex->root_len, dir_fd, name, result) != 0)
    return result->status;
  struct stat st;
  int status = 0;
  if (fstatat(*dir_fd, *name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (S_ISLNK(st.st_mode))
      status =
          coord__ckpt_work_fail(result, RPC_PERMISSION_DENIED,
                                "export path %s is a symbolic link, which is never written through "
                                "(remove it to write there)",
                                path);
    else if (S_ISDIR(st.st_mode))
      status = coord__ckpt_work_fail(result, RPC_INVALID_ARGUMENT, "%s is a directory", path);
    else if (!S_ISREG(st.st_mode))
      status =
          coord__ckpt_work_fail(result, RPC_INVALID_ARGUMENT, "%s is not a regular file", path);
    else if (!ex->overwrite)
      status = coord__ckpt_work_fail(result, RPC_ALREADY_EXISTS,
                                     "%s exists (overwrite replaces it)", path);
  } else if (errno != ENOENT) {
    status = coord__ckpt_work_fail(result, coord__ckpt_io_status(errno), "cannot stat %s: %s", path,
                                   strerror(errno));
  }
  if (status != 0)
    close(*dir_fd);
  return status;
}

/* Writes the checkpoint in dir to the safetensors file of ex, checked
 * first by export_target_open; the file is written and renamed into place
 * relative to the directory opened there (st_write_at), so that a
 * symbolic link swapped in after the check is replaced, not followed. On
 * the thread pool. Returns 0 or the status in result. */
int coord__ckpt_export_to_file(const char *dir, const export_spec *ex, const char *label,
                               ckpt_export_info *info, work_result *result) {
  int dir_fd;
  const char *name;
  if (coord__ckpt_export_target_open(ex, &dir_fd, &name, result) != 0)
    return result->status;
  char err[CKPT_MESSAGE_BYTES - 64];
  int rc = ckpt_export(dir, dir_fd, name, ex->dtype, label, info, err, sizeof err);
  close(dir_fd);
  if (rc == 0)
    return 0;
  /* Reading: a missing, damaged or short shard file. Writing: the file's
   * own errors (no space, no permission). */
  int status = rc == -EBADMSG || rc == -ERANGE || rc == -ENOENT ? RPC_DATA_LOSS
               : rc == -EACCES || rc == -EPERM                  ? RPC_PERMISSION_DENIED
               : rc == -EINVAL                                  ? RPC_INVALID_ARGUMENT
                                                                : coord__ckpt_io_status(-rc);
  return coord__ckpt_work_fail(result, status, "export to %s failed: %s", ex->path, err);
}
