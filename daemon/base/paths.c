/* paths.c - where a local daemon lives when nobody says (paths.h). */
#include "paths.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int fits(int n, size_t bytes) {
  return n > 0 && (size_t)n < bytes ? 0 : -ENAMETOOLONG;
}

static const char *nonempty_env(const char *name) {
  const char *v = getenv(name);
  return v != NULL && v[0] == '/' ? v : NULL; /* XDG: relative values are ignored */
}

int zpath_default_dir(char *out, size_t out_bytes) {
  const char *state = nonempty_env("XDG_STATE_HOME");
  if (state != NULL)
    return fits(snprintf(out, out_bytes, "%s/zerod", state), out_bytes);
  if (geteuid() == 0)
    return fits(snprintf(out, out_bytes, "%s", ZPATH_SYSTEM_DIR), out_bytes);
  const char *home = nonempty_env("HOME");
  if (home != NULL)
    return fits(snprintf(out, out_bytes, "%s/.local/state/zerod", home), out_bytes);
  return fits(snprintf(out, out_bytes, "/tmp/zerod-%u", (unsigned)geteuid()), out_bytes);
}

static int add(char out[ZPATH_CANDIDATES][ZPATH_MAX], int n, const char *dir, const char *file) {
  char path[ZPATH_MAX];
  if (fits(snprintf(path, sizeof path, "%s/%s", dir, file), sizeof path) != 0)
    return n;
  for (int i = 0; i < n; i++)
    if (strcmp(out[i], path) == 0)
      return n;
  memcpy(out[n], path, strlen(path) + 1);
  return n + 1;
}

int zpath_candidates(const char *file, char out[ZPATH_CANDIDATES][ZPATH_MAX]) {
  char dir[ZPATH_MAX];
  int n = 0;
  if (zpath_default_dir(dir, sizeof dir) == 0)
    n = add(out, n, dir, file);
  n = add(out, n, ZPATH_SYSTEM_DIR, file);
  return add(out, n, ZPATH_RUNTIME_DIR, file);
}

int zpath_find(const char *file, char *out, size_t out_bytes, char *tried, size_t tried_bytes) {
  char all[ZPATH_CANDIDATES][ZPATH_MAX];
  int n = zpath_candidates(file, all), found = -1;
  size_t used = 0;
  if (tried != NULL && tried_bytes > 0)
    tried[0] = '\0';
  for (int i = 0; i < n; i++) {
    struct stat st;
    if (found < 0 && stat(all[i], &st) == 0)
      found = i;
    if (tried != NULL && used < tried_bytes) {
      int w = snprintf(tried + used, tried_bytes - used, "%s%s", i > 0 ? ", " : "", all[i]);
      used += w > 0 ? (size_t)w : 0;
    }
  }
  snprintf(out, out_bytes, "%s", all[found >= 0 ? found : 0]);
  return found >= 0;
}
