/* standalone_daemon.h - a real `zerod standalone` for the C tests that talk
 * to one through libzerod: started in a fresh directory under /tmp (its
 * socket, log and checkpoints in it), CPU ranks, stopped with SIGTERM and
 * a clean exit required. It includes neither cmocka nor zerod.h, so that a
 * worker built against another copy of the header (tests/abi) can use it:
 * each function returns 0 or -1 after saying why on stderr. */
#ifndef ZEROD_TESTS_STANDALONE_DAEMON_H
#define ZEROD_TESTS_STANDALONE_DAEMON_H

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

typedef struct standalone_daemon {
  pid_t pid;
  char dir[64];
  char socket[128];
  char log[128];
} standalone_daemon;

static inline void standalone_daemon_print_log(const standalone_daemon *d) {
  FILE *f = fopen(d->log, "r");
  if (f == NULL)
    return;
  char line[1024];
  fprintf(stderr, "---- %s ----\n", d->log);
  while (fgets(line, sizeof line, f) != NULL)
    fputs(line, stderr);
  fclose(f);
}

/* Starts `binary standalone --ranks ranks ...` with `extra` (NULL or a
 * NULL-terminated list of more arguments, e.g. "--device", "cuda") and
 * waits (a minute at most) for its socket. */
static inline int standalone_daemon_start_with(standalone_daemon *d, const char *binary, int ranks,
                                               const char *const *extra) {
  snprintf(d->dir, sizeof d->dir, "/tmp/zerod-test-XXXXXX");
  if (mkdtemp(d->dir) == NULL) {
    fprintf(stderr, "mkdtemp %s: %s\n", d->dir, strerror(errno));
    return -1;
  }
  snprintf(d->socket, sizeof d->socket, "%s/zerod.sock", d->dir);
  snprintf(d->log, sizeof d->log, "%s/zerod.log", d->dir);
  char ranks_arg[16];
  snprintf(ranks_arg, sizeof ranks_arg, "%d", ranks);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, d->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  char *argv[32] = {(char *)binary, "standalone",         "--ranks", ranks_arg,     "--dir",
                    d->dir,         "--threads-per-rank", "1",       "--log-level", "info"};
  int argc = 10;
  for (int k = 0; extra != NULL && extra[k] != NULL && argc < 31; k++)
    argv[argc++] = (char *)extra[k];
  argv[argc] = NULL;
  int rc = posix_spawn(&d->pid, binary, &actions, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    fprintf(stderr, "posix_spawn %s: %s\n", binary, strerror(rc));
    d->pid = -1;
    return -1;
  }
  for (int waited_ms = 0;; waited_ms += 20) {
    struct stat st;
    if (stat(d->socket, &st) == 0)
      return 0;
    int status;
    if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
      standalone_daemon_print_log(d);
      fprintf(stderr, "%s exited early (status %d)\n", binary, status);
      d->pid = -1;
      return -1;
    }
    if (waited_ms > 60000) {
      standalone_daemon_print_log(d);
      fprintf(stderr, "%s did not create its socket in 60 s\n", binary);
      return -1;
    }
    usleep(20000);
  }
}

/* Starts `binary standalone --ranks ranks` (standalone_daemon_start_with). */
static inline int standalone_daemon_start(standalone_daemon *d, const char *binary, int ranks) {
  return standalone_daemon_start_with(d, binary, ranks, NULL);
}

static inline int standalone_daemon_remove_entry(const char *path, const struct stat *st, int type,
                                                 struct FTW *ftw) {
  (void)st;
  (void)type;
  (void)ftw;
  remove(path);
  return 0;
}

/* SIGTERM and a clean exit within a minute (else SIGKILL and -1); the
 * directory is removed either way. */
static inline int standalone_daemon_stop(standalone_daemon *d) {
  int failed = 0;
  if (d->pid > 0) {
    kill(d->pid, SIGTERM);
    int status = 0;
    for (int waited_ms = 0;; waited_ms += 20) {
      if (waitpid(d->pid, &status, WNOHANG) == d->pid)
        break;
      if (waited_ms > 60000) {
        kill(d->pid, SIGKILL);
        waitpid(d->pid, &status, 0);
        fprintf(stderr, "zerod did not stop on SIGTERM\n");
        failed = 1;
        break;
      }
      usleep(20000);
    }
    if (!failed && (!WIFEXITED(status) || WEXITSTATUS(status) != 0)) {
      fprintf(stderr, "zerod exited with status %d\n", status);
      failed = 1;
    }
    if (failed)
      standalone_daemon_print_log(d);
  }
  d->pid = -1;
  nftw(d->dir, standalone_daemon_remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  return failed ? -1 : 0;
}

#endif /* ZEROD_TESTS_STANDALONE_DAEMON_H */
