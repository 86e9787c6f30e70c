/* zerodctl jobs watch (zerodctl_watch.h): follows a job's versions as a
 * subscriber of the local node daemon (libzerod's zd_watch on a read-only
 * attachment), printing one line per version it moves to: the version,
 * the job's step, the units that changed and how many versions went by
 * unseen. It reads nothing but the unit list; it pins one version at a
 * time, which costs the trainer at most one copy of the model while the
 * watch holds it (docs/subscribe.md). */
#include "zerodctl_watch.h"

#include <getopt.h>
#include <jansson.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "zerod.h"

enum { WATCH_EXIT_OK = 0, WATCH_EXIT_FAILED = 1, WATCH_EXIT_USAGE = 2 };

/* Each wait is at most this long, so an interrupt is seen within it. */
#define WATCH_SLICE_MS 500

typedef struct watch_options {
  const char *job, *socket, *token;
  long count;       /* updates to print; 0: until interrupted */
  double timeout_s; /* with no new version for this long: exit 1; 0: never */
  bool json;
} watch_options;

static volatile sig_atomic_t interrupted;

static void on_interrupt(int sig) {
  (void)sig;
  interrupted = 1;
}

static const char usage[] =
    "usage: zerodctl jobs watch JOB [--socket PATH] [--token TOKEN] [--count N]\n"
    "                              [--timeout SECONDS] [--json]\n"
    "\n"
    "Follows JOB's versions through the local node daemon (a read-only\n"
    "subscriber), one line per version: the version, the job's step, the units\n"
    "that changed, and the versions published meanwhile that it skipped.\n"
    "\n"
    "  -s, --socket PATH     the node daemon's socket [ZEROD_SOCKET, default: a\n"
    "                        local zerod's in its default --dir]\n"
    "      --token TOKEN     the job's owner or read token [ZEROD_TOKEN]\n"
    "  -n, --count N         stop after N versions [default: until interrupted]\n"
    "  -t, --timeout SECONDS exit 1 when no new version comes for this long\n"
    "                        [default: wait forever]\n"
    "  -j, --json            one JSON object per version\n"
    "  -h, --help            print this help and exit\n";

static int usage_error(const char *fmt, const char *arg) {
  fprintf(stderr, "zerodctl jobs watch: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, " (zerodctl jobs watch --help)\n");
  return WATCH_EXIT_USAGE;
}

static int parse(int argc, char **argv, watch_options *o) {
  static const struct option longs[] = {{"socket", required_argument, NULL, 's'},
                                        {"token", required_argument, NULL, 'k'},
                                        {"count", required_argument, NULL, 'n'},
                                        {"timeout", required_argument, NULL, 't'},
                                        {"json", no_argument, NULL, 'j'},
                                        {"help", no_argument, NULL, 'h'},
                                        {NULL, 0, NULL, 0}};
  *o = (watch_options){.socket = getenv("ZEROD_SOCKET")};
  optind = 1;
  int opt;
  while ((opt = getopt_long(argc, argv, "s:n:t:jh", longs, NULL)) != -1) {
    char *end;
    switch (opt) {
    case 's':
      o->socket = optarg;
      break;
    case 'k':
      o->token = optarg;
      break;
    case 'n':
      o->count = strtol(optarg, &end, 10);
      if (*end != '\0' || o->count < 1)
        return usage_error("--count %s: expected a whole number of versions, 1 or more", optarg);
      break;
    case 't':
      o->timeout_s = strtod(optarg, &end);
      if (*end != '\0' || !(o->timeout_s > 0) || o->timeout_s > 86400)
        return usage_error("--timeout %s: expected seconds, over 0 and at most 86400", optarg);
      break;
    case 'j':
      o->json = true;
      break;
    case 'h':
      fputs(usage, stdout);
      exit(WATCH_EXIT_OK);
    default:
      return WATCH_EXIT_USAGE;
    }
  }
  if (optind != argc - 1)
    return usage_error("%s", optind >= argc ? "which job? give its name" : "one job only");
  o->job = argv[optind];
  return 0;
}

static void utc_now(char *out, size_t out_bytes) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  size_t n = strftime(out, out_bytes, "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(out + n, out_bytes - n, ".%03ldZ", ts.tv_nsec / 1000000);
}

/* The job's unit names by unit id, for one update's line (the library's
 * table, which zd_watch keeps up to date): NULL where no unit has the id,
 * *count the table's length; NULL and 0 when out of memory. */
static const char **unit_names(const zd_job *job, zd_unit *count) {
  unsigned n = zd_job_unit_count(job);
  zd_unit top = 0;
  for (unsigned i = 0; i < n; i++) {
    zd_unit_info info = ZD_UNIT_INFO_INIT;
    if (zd_job_unit_info(job, i, &info) == ZD_OK && info.unit >= top)
      top = info.unit + 1;
  }
  const char **names = calloc(top ? top : 1, sizeof *names);
  *count = names != NULL ? top : 0;
  for (unsigned i = 0; names != NULL && i < n; i++) {
    zd_unit_info info = ZD_UNIT_INFO_INIT;
    if (zd_job_unit_info(job, i, &info) == ZD_OK)
      names[info.unit] = info.name;
  }
  return names;
}

static const char *name_of(const char **names, zd_unit count, zd_unit id) {
  return id < count && names[id] != NULL ? names[id] : "?";
}

static void print_update(const watch_options *o, const zd_job *job, const zd_update *u) {
  char when[40];
  utc_now(when, sizeof when);
  zd_unit count;
  const char **names = unit_names(job, &count);
  if (o->json) {
    json_t *units = json_array();
    for (unsigned i = 0; i < u->nchanged; i++)
      json_array_append_new(units, json_string(name_of(names, count, u->changed[i])));
    json_t *line = json_pack("{s:s, s:I, s:I, s:I, s:o, s:s}", "job", o->job, "version",
                             (json_int_t)u->version, "step", (json_int_t)u->step, "skipped",
                             (json_int_t)u->skipped, "units", units, "time", when);
    char *text = json_dumps(line, JSON_COMPACT);
    if (text != NULL)
      puts(text);
    free(text);
    json_decref(line);
  } else {
    printf("%s  version %llu  step %llu  skipped %llu  units %u:", when,
           (unsigned long long)u->version, (unsigned long long)u->step,
           (unsigned long long)u->skipped, u->nchanged);
    for (unsigned i = 0; i < u->nchanged && i < 8; i++)
      printf("%s%s", i ? ", " : " ", name_of(names, count, u->changed[i]));
    printf("%s\n", u->nchanged > 8 ? ", ..." : "");
  }
  free(names);
  fflush(stdout);
}

static int fail(const char *what) {
  fprintf(stderr, "zerodctl jobs watch: %s: %s\n", what, zd_last_error());
  return WATCH_EXIT_FAILED;
}

/* Waits for the next version in slices (so an interrupt is seen), up to
 * o->timeout_s. Returns ZD_OK with *u filled (timed_out set if none came),
 * or an error. */
static zd_status next_version(const watch_options *o, zd_job *job, uint64_t held, zd_update *u) {
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    zd_status st = zd_watch(job, held, WATCH_SLICE_MS, u);
    if (st != ZD_OK || !u->timed_out || interrupted)
      return st;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double waited = (double)(now.tv_sec - t0.tv_sec) + (double)(now.tv_nsec - t0.tv_nsec) / 1e9;
    if (o->timeout_s > 0 && waited >= o->timeout_s)
      return ZD_OK;
  }
}

int ctl_watch(int argc, char **argv) {
  watch_options o;
  int rc = parse(argc, argv, &o);
  if (rc != 0)
    return rc;
  signal(SIGINT, on_interrupt);
  signal(SIGTERM, on_interrupt);
  zd_client *client = NULL;
  if (zd_connect(o.socket, &client) != ZD_OK)
    return fail("connect");
  zd_attach_options attach = ZD_ATTACH_OPTIONS_INIT;
  attach.job = o.job;
  attach.token = o.token;
  attach.read_only = 1;
  attach.pin = 1;
  zd_job *job = NULL;
  if (zd_attach(client, &attach, &job) != ZD_OK) {
    rc = fail("attach");
    zd_close(client);
    return rc;
  }
  uint64_t held = ZD_NO_VERSION;
  long printed = 0;
  while (!interrupted && (o.count == 0 || printed < o.count)) {
    zd_update u = ZD_UPDATE_INIT;
    if (next_version(&o, job, held, &u) != ZD_OK) {
      rc = fail("watch");
      break;
    }
    if (interrupted)
      break;
    if (u.timed_out) {
      fprintf(stderr, "zerodctl jobs watch: no new version of job %s in %g s\n", o.job,
              o.timeout_s);
      rc = WATCH_EXIT_FAILED;
      break;
    }
    print_update(&o, job, &u);
    held = u.version;
    printed++;
  }
  zd_detach(job);
  zd_close(client);
  return rc;
}
