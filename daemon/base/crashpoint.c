/* Crash points (see crashpoint.h). */
#include "crashpoint.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

static pthread_once_t once = PTHREAD_ONCE_INIT;
static char armed[128];    /* the environment's name, or "" */
static long armed_hit = 1; /* "<name>@N": the N-th time it is reached */
static _Atomic long hits;

static void read_env(void) {
  const char *v = getenv("ZEROD_CRASH_AT");
  if (v == NULL || v[0] == '\0' || strlen(v) >= sizeof armed)
    return;
  snprintf(armed, sizeof armed, "%s", v);
  char *at = strchr(armed, '@');
  if (at != NULL) {
    *at = '\0';
    armed_hit = strtol(at + 1, NULL, 10);
    if (armed_hit < 1)
      armed_hit = 1;
  }
}

int crash_point_armed(const char *name) {
  pthread_once(&once, read_env);
  return armed[0] != '\0' && strcmp(armed, name) == 0;
}

void crash_point(const char *name) {
  pthread_once(&once, read_env);
  if (armed[0] == '\0' || strcmp(armed, name) != 0 || atomic_fetch_add(&hits, 1) + 1 != armed_hit)
    return;
  LOG_ERRORF("crash point reached; killing this process", "point=%s env=ZEROD_CRASH_AT", name);
  raise(SIGKILL);
}
