/* zerodctl top: a live table of the jobs and ranks that daemons report
 * on their /metrics (docs/zerodctl.md, "top"). */
#ifndef ZEROD_TOP_H
#define ZEROD_TOP_H

/* argv[0] is "top"; the options follow. Returns zerodctl's exit status. */
int ctl_top(int argc, char **argv);

#endif /* ZEROD_TOP_H */
