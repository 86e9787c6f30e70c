/* flags: zerod's command lines as tables (docs/architecture.md, "Folders").
 *
 * zerod has two command lines: `zerod [standalone]` and `zerod node` share
 * one (flags_node), `zerod coordinator` has its own (flags_coordinator).
 * Each is a table with one row per flag: its name, the environment
 * variable read when it is not given, its default, its lines of the usage
 * text, and the parser that checks a value and converts it. A flag wins
 * over its variable, and the variable over the default.
 *
 * Nothing here starts anything or touches a file: the tables can be read
 * and every value parsed without a daemon (tests/unit/test_flags.c). What
 * needs the filesystem or the network (directories, export roots,
 * listeners) is resolved by the modes from the text given here.
 *
 * flags.c reads command lines through a table, flags_table.c holds the
 * two tables. Included by them, by the modes (mode_node.c,
 * mode_coordinator.c), start.c and tests/unit/test_flags.c. */
#ifndef ZEROD_FLAGS_H
#define ZEROD_FLAGS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "coord.h"

#define ZEROD_VERSION "0.1.0"

/* Every flag of either command line. */
typedef enum flag_id {
  /* zerod [standalone] and zerod node */
  FLAG_RANKS,
  FLAG_MAX_RANKS,
  FLAG_DEVICE,
  FLAG_DIR,
  FLAG_SOCKET,
  FLAG_SOCKET_GROUP,
  FLAG_THREADS_PER_RANK,
  FLAG_COLLECTIVE_TIMEOUT,
  FLAG_MAX_LIVE_BYTES,
  FLAG_MAX_SESSIONS,
  FLAG_MAX_PINNED_VERSIONS,
  FLAG_BASE_CACHE_BYTES,
  FLAG_NVME_DIR,
  FLAG_REPLICA_DIR,
  FLAG_COORDINATOR,
  FLAG_NAME,
  FLAG_COMM_HOST,
  FLAG_VERSION,
  /* zerod coordinator */
  FLAG_LISTEN,
  FLAG_STATE_DIR,
  FLAG_LEASE_TTL,
  FLAG_RETAIN_DELETED_CHECKPOINTS,
  FLAG_STALL_TIMEOUT,
  /* both (standalone runs a coordinator too) */
  FLAG_CHECKPOINT_DIR,
  FLAG_CHECKPOINT_TIMEOUT,
  FLAG_JOB_IDLE_TTL,
  FLAG_DRAIN_TIMEOUT,
  FLAG_EXPORT_ROOT,
  FLAG_FILE_MODE,
  FLAG_HEALTH_LISTEN,
  FLAG_METRICS_LISTEN,
  FLAG_LOG_LEVEL,
  FLAG_LOG_FORMAT,
  /* the control plane's security (docs/security.md): a node's client
   * side, the coordinator's listener */
  FLAG_TLS_CA,
  FLAG_TLS_CERT,
  FLAG_TLS_KEY,
  FLAG_TLS_SERVER_NAME,
  FLAG_AUTH_TOKEN_FILE,
  FLAG_TLS_CLIENT_CA,
  FLAG_TLS_REQUIRE_CLIENT_CERT,
  FLAG_AUTH_FILE,
  FLAG_INSECURE,
  FLAG_HELP,
  FLAG_COUNT
} flag_id;

typedef struct flag flag;

/* Checks text and converts it into *number (an integer, milliseconds,
 * bytes, a file mode or an enum value, as the flag says). 0, or -1 when
 * text is not a valid value. */
typedef int flag_parse_fn(const flag *f, const char *text, int64_t *number);

struct flag {
  flag_id id;
  const char *name;           /* "ranks" for --ranks */
  int takes_value;            /* 0: a switch, such as --insecure */
  const char *env;            /* read when the flag is not given; NULL: none */
  const char *fallback;       /* the default, parsed as a value would be; NULL: none, or
                               * one the mode computes (the help says which) */
  flag_parse_fn *parse;       /* NULL: any text */
  int64_t lo, hi;             /* flag_parse_int's range; flag_parse_text's longest */
  const char *const *choices; /* flag_parse_choice's, NULL-terminated */
  const char *expected;       /* what a bad value's error says is expected */
  const char *help;           /* its lines of the usage text, verbatim */
};

/* One command line: its flags in the order of the usage text, which they
 * make up between usage_head and usage_tail. */
typedef struct flag_table {
  const char *usage_head, *usage_tail;
  const flag *flags;
  size_t n_flags;
  /* The order getopt_long is given the flags in (it lists an ambiguous
   * abbreviation's candidates in that order); NULL: the table's. */
  const char *const *getopt_order;
} flag_table;

extern const flag_table flags_node;        /* zerod [standalone], zerod node */
extern const flag_table flags_coordinator; /* zerod coordinator */

/* The parsers of the tables' flags. */
flag_parse_fn flag_parse_int, flag_parse_size, flag_parse_choice, flag_parse_text,
    flag_parse_log_level, flag_parse_log_format, flag_parse_file_mode, flag_parse_listen,
    flag_parse_coordinator, flag_parse_node_name, flag_parse_seconds_ms, flag_parse_duration_ms;

/* The flags as given on a command line. */
typedef struct flag_given {
  const char *value[FLAG_COUNT]; /* NULL: not given; "" for a switch given */
  /* --export-root, repeated: one more than allowed, to say there are too many */
  const char *export_roots[COORD_MAX_EXPORT_ROOTS + 1];
  unsigned n_export_roots;
} flag_given;

/* What flags_parse_argv found. */
enum { FLAGS_OK, FLAGS_HELP, FLAGS_VERSION, FLAGS_UNKNOWN };

/* Reads argv's options (getopt_long: an unknown one is reported on
 * stderr by getopt, and optind is then the first word that is not an
 * option) into *given, which it clears first. Stops at the first --help
 * or --version and says so. */
int flags_parse_argv(const flag_table *t, int argc, char **argv, flag_given *given);

/* flags_parse_argv, answered: --help prints the usage on stdout,
 * --version the version, an unknown option the usage on stderr. Returns
 * -1 when the daemon goes on, else the exit status (0, or 2). */
int flags_read_argv(const flag_table *t, int argc, char **argv, flag_given *given);

/* Prints t's usage text. */
void flags_usage(const flag_table *t, FILE *out);

/* The row of id in t, or NULL when t has no such flag. */
const flag *flag_find(const flag_table *t, flag_id id);

/* id's text: as given, else its environment variable, else its default;
 * NULL when there is none. */
const char *flag_text(const flag_table *t, const flag_given *given, flag_id id);

/* The errors below go to stderr as one line, "zerod: invalid --NAME
 * 'VALUE' (EXPECTED)", and the functions return 2, zerod's exit status
 * for a bad command line. */

/* Parses text as a value of id into *number (left alone when the flag has
 * no parser). 0, or 2 with the error printed. */
int flag_check(const flag_table *t, flag_id id, const char *text, int64_t *number);

/* flag_text, then flag_check when there is a text: 0 with *text (NULL:
 * none) and *number set, or 2 with the error printed. */
int flag_value(const flag_table *t, const flag_given *given, flag_id id, const char **text,
               int64_t *number);

/* Prints that value is not a valid value of name (a flag's, with its
 * dashes, or an environment variable's); returns 2. */
int flag_invalid(const char *name, const char *value, const char *expected);

#endif /* ZEROD_FLAGS_H */
