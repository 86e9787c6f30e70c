/* paths.h - where a local daemon lives when nobody says (docs/daemon.md,
 * "Where a daemon lives").
 *
 * The daemon's state directory (lock file, sockets, standalone's control
 * socket and records) defaults to one place per user, never the working
 * directory: $XDG_STATE_HOME/zerod where that is set, else root's
 * /var/lib/zerod, another user's $HOME/.local/state/zerod, else
 * /tmp/zerod-<uid>. Clients (libzerod, zerodctl) look for a daemon's file
 * there, then in root's directory, then in /run/zerod (the image's), and
 * take the first that exists, so a daemon started with no --dir is found
 * from any directory by any user it lets in.
 *
 * Compiled into zerod (zd_base) and into libzerod (hidden); libc only. */
#ifndef ZEROD_BASE_PATHS_H
#define ZEROD_BASE_PATHS_H

#include <stddef.h>

#define ZPATH_MAX         256
#define ZPATH_CANDIDATES  3
#define ZPATH_SYSTEM_DIR  "/var/lib/zerod"
#define ZPATH_RUNTIME_DIR "/run/zerod"

/* The default state directory of a daemon run by this process's user.
 * 0, or -ENAMETOOLONG. */
int zpath_default_dir(char *out, size_t out_bytes);

/* Where a client looks for `file` of a local daemon, in order, without
 * repeats: the count written (at least 1). */
int zpath_candidates(const char *file, char out[ZPATH_CANDIDATES][ZPATH_MAX]);

/* The first candidate for `file` that exists (1), else the first
 * candidate (0); `tried`, when not NULL, lists them all, ", "-separated,
 * for an error message. */
int zpath_find(const char *file, char *out, size_t out_bytes, char *tried, size_t tried_bytes);

#endif /* ZEROD_BASE_PATHS_H */
