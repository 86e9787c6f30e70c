/* zerodctl_args: zerodctl's checks of what the user typed
 * (zerodctl_impl.h).
 *
 * Names, checkpoint references, numbers, the coordinator's address and
 * tokens are checked here before anything is sent, so that a mistake is
 * a usage error (exit status 2) that names the argument, not a call that
 * fails. The rules follow control.proto's limits. Calls zerodctl_output.c
 * only. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "zerodctl_impl.h"

#include "names.h"

/* ------------------------------------------------------------------------ */
/* Argument checks                                                          */
/* ------------------------------------------------------------------------ */

/* Names of nodes and jobs: 1..64 bytes of [A-Za-z0-9._-] (control.proto). */
bool ctl__valid_name(const char *s) {
  return zd_valid_name(s);
}

/* Checkpoint names: names that do not start with '.' and do not contain
 * the coordinator's marks of unfinished saves and deletes
 * (docs/checkpoints.md). */
bool ctl__valid_checkpoint_name(const char *s) {
  return zd_valid_checkpoint_name(s);
}

/* Job names that name a directory of checkpoints. */
bool ctl__valid_job_dir_name(const char *s) {
  return zd_valid_job_dir_name(s);
}

/* A job's checkpoint directory: a job's name, or a deleted job's
 * "<job>@<id>" (id: 1..19 digits, no leading zero), as List shows it. */
bool ctl__valid_checkpoint_dir(const char *s) {
  const char *at = strchr(s, '@');
  if (at == NULL)
    return ctl__valid_job_dir_name(s);
  char job[CTL_NAME_MAX_BYTES + 1];
  size_t job_bytes = (size_t)(at - s), digits = strlen(at + 1);
  if (job_bytes == 0 || job_bytes > CTL_NAME_MAX_BYTES || digits == 0 || digits > 19 ||
      at[1] == '0' || strspn(at + 1, "0123456789") != digits)
    return false;
  memcpy(job, s, job_bytes);
  job[job_bytes] = '\0';
  return ctl__valid_job_dir_name(job);
}

/* What `checkpoint restore` accepts: NAME, JOB/NAME, or an absolute path
 * (on the coordinator's and the nodes' filesystem, so never made absolute
 * here). */
bool ctl__valid_checkpoint_ref(const char *s) {
  if (s[0] == '/')
    return strlen(s) <= CTL_PATH_MAX_BYTES;
  const char *slash = strchr(s, '/');
  if (slash == NULL)
    return ctl__valid_checkpoint_name(s);
  char dir[CTL_NAME_MAX_BYTES + 24];
  size_t dir_bytes = (size_t)(slash - s);
  if (dir_bytes == 0 || dir_bytes >= sizeof dir)
    return false;
  memcpy(dir, s, dir_bytes);
  dir[dir_bytes] = '\0';
  return ctl__valid_checkpoint_dir(dir) && ctl__valid_checkpoint_name(slash + 1);
}

int ctl__parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out) {
  char *end;
  errno = 0;
  if (s[0] == '-' || s[0] == '+')
    return -1;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi)
    return -1;
  *out = (uint32_t)v;
  return 0;
}

/* A finite number in [lo, hi]; hi_open excludes hi itself. */
int ctl__parse_double(const char *s, double lo, double hi, bool hi_open, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno != 0 || end == s || *end != '\0' || v != v || v < lo || v > hi || (hi_open && v == hi))
    return -1;
  *out = v;
  return 0;
}

/* --timeout: seconds, fractions allowed, optional "s" suffix. */
int ctl__parse_timeout(const char *s, double *out) {
  char text[64];
  size_t len = strlen(s);
  if (len == 0 || len >= sizeof text)
    return -1;
  memcpy(text, s, len + 1);
  if (text[len - 1] == 's')
    text[len - 1] = '\0';
  double v;
  if (ctl__parse_double(text, 0, CTL_MAX_TIMEOUT_S, false, &v) != 0 || !(v > 0))
    return -1;
  *out = v;
  return 0;
}

/* HOST:PORT, HOST a name, an IPv4 address or a bracketed IPv6 address; or
 * unix:PATH, a standalone daemon's control socket (DIR/control.sock). */
bool ctl__valid_target(const char *s) {
  size_t len = strlen(s);
  if (len == 0 || len > CTL_TARGET_MAX_BYTES)
    return false;
  if (strncmp(s, "unix:", 5) == 0)
    return s[5] != '\0';
  const char *colon = strrchr(s, ':');
  if (colon == NULL || colon == s)
    return false;
  uint32_t port;
  if (ctl__parse_u32(colon + 1, 1, 65535, &port) != 0)
    return false;
  if (s[0] == '[')
    return colon[-1] == ']' && colon - s > 2;
  for (const char *p = s; p < colon; p++) {
    char ch = *p;
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
          ch == '.' || ch == '-' || ch == '_'))
      return false;
  }
  return true;
}

bool ctl__valid_token(const char *s) {
  size_t len = strlen(s);
  if (len == 0 || len > CTL_TOKEN_MAX_BYTES)
    return false;
  for (; *s != '\0'; s++)
    if ((unsigned char)*s <= 0x20 || (unsigned char)*s >= 0x7f)
      return false;
  return true;
}

/* ------------------------------------------------------------------------ */
/* The arguments of commands                                                */
/* ------------------------------------------------------------------------ */

/* Checks the arguments and options of `export` before anything is sent. */
int ctl__check_export_args(const ctl *c, char **argv) {
  if (!ctl__valid_job_dir_name(argv[0]))
    return ctl__usage_error(
        "export: invalid job name '%s': expected 1..64 characters [A-Za-z0-9._-]", argv[0]);
  if (argv[1][0] == '\0' || strlen(argv[1]) > CTL_PATH_MAX_BYTES)
    return ctl__usage_error("export: FILE must be a path of 1..%d bytes", CTL_PATH_MAX_BYTES);
  if (c->export_checkpoint != NULL && !ctl__valid_checkpoint_ref(c->export_checkpoint))
    return ctl__usage_error("export: invalid --checkpoint '%s': expected NAME, JOB/NAME or an "
                            "absolute path to a checkpoint directory",
                            c->export_checkpoint);
  if (c->export_dtype != NULL && strcmp(c->export_dtype, "fp32") != 0 &&
      strcmp(c->export_dtype, "bf16") != 0)
    return ctl__usage_error("export: invalid --dtype '%s': expected fp32 or bf16", c->export_dtype);
  return 0;
}

/* Checks the arguments of a `checkpoint` command before anything is sent. */
int ctl__check_checkpoint_args(const char *command, int argc, char **argv) {
  /* List and Delete also name a deleted job's checkpoints: <job>@<id>. */
  int any_dir =
      strcmp(command, "checkpoint list") == 0 || strcmp(command, "checkpoint delete") == 0;
  if (argc > 0 &&
      !(any_dir ? ctl__valid_checkpoint_dir(argv[0]) : ctl__valid_job_dir_name(argv[0])))
    return ctl__usage_error("%s: invalid job name '%s': expected 1..64 characters [A-Za-z0-9._-]%s",
                            command, argv[0], any_dir ? ", or a deleted job's <job>@<id>" : "");
  if (argc < 2)
    return 0;
  if (strcmp(command, "checkpoint restore") == 0) {
    if (!ctl__valid_checkpoint_ref(argv[1]))
      return ctl__usage_error(
          "%s: invalid checkpoint '%s': expected NAME, JOB/NAME, JOB@ID/NAME or "
          "an absolute path to a checkpoint directory or a .safetensors file",
          command, argv[1]);
    return 0;
  }
  if (!ctl__valid_checkpoint_name(argv[1]))
    return ctl__usage_error(
        "%s: invalid checkpoint name '%s': expected 1..64 characters "
        "[A-Za-z0-9._-], not starting with '.', without '.tmp-' or '.deleting-'",
        command, argv[1]);
  if (strcmp(command, "checkpoint save") == 0 && strncmp(argv[1], "auto-", 5) == 0)
    return ctl__usage_error(
        "%s: checkpoint names starting with 'auto-' are for periodic checkpoints", command);
  return 0;
}
