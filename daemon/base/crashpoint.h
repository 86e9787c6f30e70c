/* crash points: named places where a test can make the process die.
 *
 * ZEROD_CRASH_AT=<name> (or <name>@N: the N-th time) in a daemon's
 * environment makes crash_point(name)
 * log an error line and kill the process with SIGKILL, as a power cut or an
 * OOM kill would, at a phase that timing alone cannot hit reliably (between
 * two fsyncs of a checkpoint save, say). Unset, a crash point costs one
 * comparison of a cached pointer. The names are listed in docs/daemon.md
 * ("Crash points"); tests/integration/test_checkpoint_crash.py uses them. */
#ifndef ZEROD_CRASHPOINT_H
#define ZEROD_CRASHPOINT_H

void crash_point(const char *name);

/* Whether ZEROD_CRASH_AT names this point (a caller may have work to do
 * first, e.g. wait for a write to land, that it skips otherwise). */
int crash_point_armed(const char *name);

#endif /* ZEROD_CRASHPOINT_H */
