/* zerodctl_scale: `jobs scale` (zerodctl_impl.h; docs/redundancy.md,
 * "Scaling"): a job with redundancy moves onto the nodes named. */
#include <string.h>

#include "zerodctl_impl.h"

/* jobs scale NAME NODE,NODE...: the new placement, in rank order. */
int ctl__cmd_jobs_scale(ctl *c, int argc, char **argv) {
  (void)argc;
  static char names[CTL_MAX_NODES][CTL_NAME_MAX_BYTES + 1];
  char *pointers[CTL_MAX_NODES];
  size_t n = 0;
  for (const char *p = argv[1];;) {
    size_t len = strcspn(p, ",");
    if (len == 0 || len > CTL_NAME_MAX_BYTES || n == CTL_MAX_NODES)
      return ctl__usage_error("jobs scale: invalid nodes '%s': expected up to %d node names, "
                              "comma-separated",
                              argv[1], CTL_MAX_NODES);
    memcpy(names[n], p, len);
    names[n][len] = '\0';
    if (!ctl__valid_name(names[n]))
      return ctl__usage_error("jobs scale: invalid node name '%s'", names[n]);
    pointers[n] = names[n];
    n++;
    if (p[len] == '\0')
      break;
    p += len + 1;
  }
  Zerod__V1__ScaleJobRequest request = ZEROD__V1__SCALE_JOB_REQUEST__INIT;
  request.name = argv[0];
  request.n_node_names = n;
  request.node_names = pointers;
  return ctl__call_job(c, "/zerod.v1.Jobs/ScaleJob", &request.base);
}
