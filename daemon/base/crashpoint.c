/* Crash points (see crashpoint.h). */
#include "crashpoint.h"

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

static pthread_once_t once = PTHREAD_ONCE_INIT;
static const char *armed; /* the environment's value, or NULL */

static void read_env(void) {
  const char *v = getenv("ZEROD_CRASH_AT");
  armed = v != NULL && v[0] != '\0' ? v : NULL;
}

void crash_point(const char *name) {
  pthread_once(&once, read_env);
  if (armed == NULL || strcmp(armed, name) != 0)
    return;
  LOG_ERRORF("crash point reached; killing this process", "point=%s env=ZEROD_CRASH_AT", name);
  raise(SIGKILL);
}
