/* zerodctl_bases: `jobs freeze` and `bases list` (zerodctl_impl.h;
 * docs/bases.md).
 *
 * A base is a frozen job: `jobs freeze` makes one of a ready job, with the
 * tenants it is shared with (--share) or every tenant (--public), and
 * prints it as `jobs get` does; `bases list` shows the frozen jobs the
 * caller may read, with the number of live jobs built on each. Calls
 * zerodctl_jobs.c (how a job prints), zerodctl_args.c, zerodctl_call.c
 * and zerodctl_output.c. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "job_states.h"
#include "zerodctl_impl.h"

/* The most tenants --share may name (control.proto's FreezeJobRequest;
 * the coordinator's limit). */
#define CTL_MAX_SHARED_WITH 64

/* Splits --share into tenant names (checked, none twice) in names. */
static int split_share(const char *share, char names[][CTL_NAME_MAX_BYTES + 1], size_t *n) {
  *n = 0;
  for (const char *p = share;;) {
    size_t len = strcspn(p, ",");
    if (len == 0 || len > CTL_NAME_MAX_BYTES)
      return ctl__usage_error("jobs freeze: invalid --share '%s': expected tenant names of "
                              "1..64 characters [A-Za-z0-9._-], comma-separated",
                              share);
    if (*n == CTL_MAX_SHARED_WITH)
      return ctl__usage_error("jobs freeze: --share names more than %d tenants",
                              CTL_MAX_SHARED_WITH);
    memcpy(names[*n], p, len);
    names[*n][len] = '\0';
    if (!ctl__valid_job_dir_name(names[*n]))
      return ctl__usage_error("jobs freeze: invalid --share '%s': expected tenant names of "
                              "1..64 characters [A-Za-z0-9._-], comma-separated",
                              share);
    for (size_t k = 0; k < *n; k++)
      if (strcmp(names[k], names[*n]) == 0)
        return ctl__usage_error("jobs freeze: tenant '%s' is named twice in --share", names[k]);
    (*n)++;
    if (p[len] == '\0')
      return 0;
    p += len + 1;
  }
}

int ctl__check_freeze_args(const ctl *c) {
  static char names[CTL_MAX_SHARED_WITH][CTL_NAME_MAX_BYTES + 1];
  size_t n;
  return c->freeze_share != NULL ? split_share(c->freeze_share, names, &n) : 0;
}

int ctl__cmd_jobs_freeze(ctl *c, int argc, char **argv) {
  (void)argc;
  static char names[CTL_MAX_SHARED_WITH][CTL_NAME_MAX_BYTES + 1];
  char *pointers[CTL_MAX_SHARED_WITH];
  size_t n = 0;
  if (c->freeze_share != NULL) {
    int rc = split_share(c->freeze_share, names, &n);
    if (rc != 0)
      return rc;
  }
  for (size_t i = 0; i < n; i++)
    pointers[i] = names[i];
  Zerod__V1__FreezeJobRequest request = ZEROD__V1__FREEZE_JOB_REQUEST__INIT;
  request.name = argv[0];
  request.n_shared_with = n;
  request.shared_with = pointers;
  request.public_ = c->freeze_public;
  return ctl__call_job(c, "/zerod.v1.Jobs/FreezeJob", &request.base);
}

/* A row of `bases list`: the frozen jobs only. */
static bool base_row(const Zerod__V1__Job *job, char cells[][TABLE_CELL_BYTES]) {
  if (!job->frozen || cells == NULL)
    return job->frozen;
  snprintf(cells[0], TABLE_CELL_BYTES, "%s", job->name);
  snprintf(cells[1], TABLE_CELL_BYTES, "%s", job->tenant[0] != '\0' ? job->tenant : "-");
  snprintf(cells[2], TABLE_CELL_BYTES, "%s", zd_job_state_word(job->state));
  snprintf(cells[3], TABLE_CELL_BYTES, "%" PRIu32, job->world_size);
  ctl__format_job_nodes(job, cells[4], TABLE_CELL_BYTES);
  if (job->public_)
    snprintf(cells[5], TABLE_CELL_BYTES, "public");
  else if (job->n_shared_with == 0)
    snprintf(cells[5], TABLE_CELL_BYTES, "-");
  else
    ctl__format_sharing(job, cells[5], TABLE_CELL_BYTES);
  snprintf(cells[6], TABLE_CELL_BYTES, "%" PRIu32, job->jobs_on_base);
  /* "-": not saved yet (docs/bases.md, "Restarts"). */
  snprintf(cells[7], TABLE_CELL_BYTES, "%s",
           job->base_checkpoint[0] != '\0' ? job->base_checkpoint : "-");
  return true;
}

int ctl__cmd_bases_list(ctl *c, int argc, char **argv) {
  (void)argc;
  (void)argv;
  static const char *const headers[] = {"NAME",  "TENANT",      "STATE", "WORLD",
                                        "NODES", "SHARED_WITH", "JOBS",  "CHECKPOINT"};
  return ctl__list_jobs(c, "bases", headers, 8, base_row);
}
