/* job_states.h: the one word for each job state (control.proto JobState),
 * as zerodctl prints it and the coordinator's messages and metrics say it;
 * shared by the daemon and zerodctl, which do not link each other. Header
 * only. */
#ifndef ZEROD_PROTO_JOB_STATES_H
#define ZEROD_PROTO_JOB_STATES_H

#include "zerod/v1/control.pb-c.h"

static inline const char *zd_job_state_word(Zerod__V1__JobState state) {
  switch (state) {
  case ZEROD__V1__JOB_STATE__JOB_STATE_CREATING:
    return "creating";
  case ZEROD__V1__JOB_STATE__JOB_STATE_READY:
    return "ready";
  case ZEROD__V1__JOB_STATE__JOB_STATE_DEGRADED:
    return "degraded";
  case ZEROD__V1__JOB_STATE__JOB_STATE_DELETING:
    return "deleting";
  default:
    return "unspecified";
  }
}

#endif /* ZEROD_PROTO_JOB_STATES_H */
