/* activity: what each of a job's local ranks is doing, for the node's
 * heartbeat (JobStatus.ranks; docs/daemon.md, "Stalls"): the collective it
 * is in and for how long, and the op its executor last began. Read from
 * the ranks' counters (rank_state.activity, last_op) on the loop thread,
 * while the executors run. */
#ifndef ZEROD_ACTIVITY_H
#define ZEROD_ACTIVITY_H

#include "job.h"
#include "zerod/v1/control.pb-c.h"

/* Fills st->ranks for j's local ranks. *owned: what they point to, for
 * activity_reports_free after the heartbeat is encoded (NULL and no
 * ranks if out of memory). */
void activity_reports(job *j, Zerod__V1__JobStatus *st, void **owned);
void activity_reports_free(void *owned);

#endif /* ZEROD_ACTIVITY_H */
