/* zerodctl jobs watch: a job's versions as they come, through the local
 * node daemon (docs/zerodctl.md, "jobs watch"; docs/subscribe.md). */
#ifndef ZEROD_ZERODCTL_WATCH_H
#define ZEROD_ZERODCTL_WATCH_H

/* argv[0] is "watch"; the job and the options follow. Returns zerodctl's
 * exit status. */
int ctl_watch(int argc, char **argv);

#endif /* ZEROD_ZERODCTL_WATCH_H */
