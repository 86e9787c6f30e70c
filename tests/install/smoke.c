/* smoke.c - a program built against an installed libzerod, the way a user
 * builds one: `cc smoke.c $(pkg-config --cflags --libs zerod)`
 * (tests/install/check_install.sh). It needs no daemon: it checks that the
 * header and the library agree on a few calls and that the library it runs
 * with is the installed one, not the build tree's.
 *
 *   smoke EXPECTED_LIBDIR
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include <zerod.h>

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: smoke EXPECTED_LIBDIR\n");
    return 2;
  }
  Dl_info info;
  if (dladdr((void *)zd_strerror, &info) == 0 || info.dli_fname == NULL) {
    fprintf(stderr, "smoke: dladdr(zd_strerror) failed\n");
    return 1;
  }
  if (strncmp(info.dli_fname, argv[1], strlen(argv[1])) != 0) {
    fprintf(stderr, "smoke: libzerod loaded from %s, not from %s\n", info.dli_fname, argv[1]);
    return 1;
  }
  printf("libzerod: %s\n", info.dli_fname);

  const char *name = zd_strerror(ZD_E_UNAVAILABLE);
  if (name == NULL || name[0] == '\0') {
    fprintf(stderr, "smoke: zd_strerror(ZD_E_UNAVAILABLE) is empty\n");
    return 1;
  }
  printf("zd_strerror(ZD_E_UNAVAILABLE): %s\n", name);

  /* No daemon listens there: the call must fail cleanly with a reason. */
  zd_client *client = NULL;
  zd_status rc = zd_connect("/nonexistent/zerod-install-smoke.sock", &client);
  if (rc == ZD_OK) {
    fprintf(stderr, "smoke: zd_connect to a nonexistent socket succeeded\n");
    zd_close(client);
    return 1;
  }
  printf("zd_connect: %s: %s\n", zd_strerror(rc), zd_last_error());
  return 0;
}
