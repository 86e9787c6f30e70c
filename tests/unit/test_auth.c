/* The principals file (coord/auth.c), bearer tokens from files and the
 * addresses that may serve plain text (rpc/tls.c).
 *
 * - A good file yields each principal with its role, tenant and
 *   credential; a token finds its principal by SHA-256 and a wrong one
 *   (one byte off, a prefix, the hash itself) finds none; a certificate
 *   name finds its principal.
 * - Each kind of mistake is refused with the file and line it is on.
 * - Token files: blanks and the newline are dropped; empty, spaced or
 *   over-long tokens are refused.
 * - rpc_address_is_local says yes only for this host's addresses. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "auth.h"
#include "digest.h"
#include "rpc.h"

static char dir[] = "/tmp/zerod-test-auth-XXXXXX";

static int setup(void **state) {
  (void)state;
  return mkdtemp(dir) == NULL ? -1 : 0;
}

static int teardown(void **state) {
  (void)state;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  return system(cmd) == 0 ? 0 : -1;
}

/* Writes text to dir/name and returns the path (static buffer). */
static const char *write_file(const char *name, const char *text) {
  static char path[256];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
  return path;
}

static void test_good_file(void **state) {
  (void)state;
  char admin[65], alice[65], nodes[65], text[1024];
  digest_sha256_hex("admin-token", admin);
  digest_sha256_hex("alice-token", alice);
  digest_sha256_hex("node-token", nodes);
  snprintf(text, sizeof text,
           "# the cluster's principals\n"
           "\n"
           "ops    admin  -      token-sha256:%s   # the on-call\n"
           "alice\ttenant\tteam-a\ttoken-sha256:%s\n"
           "dash   reader team-a cert:dashboard.team-a\n"
           "*      node   -      token-sha256:%s\n"
           "node-1 node   -      cert:node-1\n",
           admin, alice, nodes);
  auth_table *t = NULL;
  char err[256] = "";
  assert_int_equal(auth_load(write_file("good", text), &t, err, sizeof err), 0);
  assert_int_equal(auth_count(t), 5);

  const auth_principal *p = auth_by_token(t, "alice-token", strlen("alice-token"));
  assert_non_null(p);
  assert_string_equal(p->name, "alice");
  assert_int_equal(p->role, AUTH_TENANT);
  assert_string_equal(p->tenant, "team-a");
  assert_int_equal(auth_index(t, p), 1);
  p = auth_by_token(t, "admin-token", strlen("admin-token"));
  assert_non_null(p);
  assert_int_equal(p->role, AUTH_ADMIN);
  assert_string_equal(p->tenant, "");
  p = auth_by_token(t, "node-token", strlen("node-token"));
  assert_non_null(p);
  assert_string_equal(p->name, "*");
  assert_int_equal(p->role, AUTH_NODE);

  /* Near misses find nobody. */
  assert_null(auth_by_token(t, "alice-tokem", strlen("alice-tokem")));
  assert_null(auth_by_token(t, "alice-toke", strlen("alice-toke")));
  assert_null(auth_by_token(t, alice, strlen(alice)));
  assert_null(auth_by_token(t, "", 0));

  p = auth_by_cert(t, "dashboard.team-a");
  assert_non_null(p);
  assert_int_equal(p->role, AUTH_READER);
  assert_string_equal(p->tenant, "team-a");
  assert_string_equal(auth_by_cert(t, "node-1")->name, "node-1");
  assert_null(auth_by_cert(t, "node-2"));
  assert_null(auth_by_cert(t, "dashboard.team-"));
  /* A token principal is not found by a certificate of its name. */
  assert_null(auth_by_cert(t, "alice"));
  auth_free(t);
}

static void test_mistakes_name_their_line(void **state) {
  (void)state;
  char h[65];
  digest_sha256_hex("x", h);
  char other[65];
  digest_sha256_hex("y", other);
  struct {
    const char *text;
    const char *words; /* in the message, after "FILE:LINE: " */
    int line;
  } cases[] = {
      {"a admin -\n", "expected 4 fields", 1},
      {"# ok\na boss - cert:a\n", "unknown role 'boss'", 2},
      {"a/b admin - cert:a\n", "bad name 'a/b'", 1},
      {"* admin - cert:a\n", "bad name '*'", 1},
      {"a tenant - cert:a\n", "a tenant needs a tenant name", 1},
      {"a reader .. cert:a\n", "a reader needs a tenant name", 1},
      {"a admin team cert:a\n", "a admin has no tenant", 1},
      {"a admin - password:x\n", "bad credential", 1},
      {"a admin - token-sha256:abc\n", "bad credential", 1},
      {"a admin - cert:\n", "bad credential", 1},
      {"a admin - cert:a extra\n", "more than 4 fields", 1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *path = write_file("bad", cases[i].text);
    auth_table *t = (auth_table *)1;
    char err[512] = "", want[300];
    assert_int_equal(auth_load(path, &t, err, sizeof err), -EINVAL);
    assert_null(t);
    snprintf(want, sizeof want, "%s:%d: %s", path, cases[i].line, cases[i].words);
    if (strncmp(err, want, strlen(want)) != 0)
      fail_msg("case %zu: got '%s', want '%s...'", i, err, want);
  }
  /* Duplicates: a name, a token, a certificate. */
  char text[512];
  snprintf(text, sizeof text, "a admin - token-sha256:%s\na node - token-sha256:%s\n", h, other);
  auth_table *t = NULL;
  char err[512];
  assert_int_equal(auth_load(write_file("dup", text), &t, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, ":2: principal 'a' is defined twice"));
  snprintf(text, sizeof text, "a admin - token-sha256:%s\nb node - token-sha256:%s\n", h, h);
  assert_int_equal(auth_load(write_file("dup", text), &t, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, ":2: 'b' has the same credential as 'a'"));
  assert_int_equal(
      auth_load(write_file("dup", "a admin - cert:x\nb node - cert:x\n"), &t, err, sizeof err),
      -EINVAL);
  assert_non_null(strstr(err, "same credential"));
  /* A missing file. */
  snprintf(text, sizeof text, "%s/none", dir);
  assert_int_equal(auth_load(text, &t, err, sizeof err), -ENOENT);
  assert_non_null(strstr(err, "cannot read the principals file"));
}

static void test_quota_lines(void **state) {
  (void)state;
  auth_table *t = NULL;
  char err[512] = "";
  const char *text = "quota team-a jobs=4 sessions=16 host-bytes=64G live-bytes=512M\n"
                     "quota team-b jobs=0   # none at all\n"
                     "ops admin - cert:ops\n";
  assert_int_equal(auth_load(write_file("quotas", text), &t, err, sizeof err), 0);
  assert_int_equal(auth_count(t), 1); /* quota lines are not principals */
  const auth_quota *q = auth_quota_of(t, "team-a");
  assert_non_null(q);
  assert_int_equal(q->limited, (1u << AUTH_QUOTA_JOBS) | (1u << AUTH_QUOTA_SESSIONS) |
                                   (1u << AUTH_QUOTA_HOST_BYTES) | (1u << AUTH_QUOTA_LIVE_BYTES));
  assert_int_equal(q->limit[AUTH_QUOTA_JOBS], 4);
  assert_int_equal(q->limit[AUTH_QUOTA_SESSIONS], 16);
  assert_int_equal(q->limit[AUTH_QUOTA_HOST_BYTES], 64ull << 30);
  assert_int_equal(q->limit[AUTH_QUOTA_LIVE_BYTES], 512ull << 20);
  q = auth_quota_of(t, "team-b");
  assert_non_null(q);
  assert_int_equal(q->limited, 1u << AUTH_QUOTA_JOBS);
  assert_int_equal(q->limit[AUTH_QUOTA_JOBS], 0);
  assert_null(auth_quota_of(t, "team-c"));
  auth_free(t);

  struct {
    const char *text, *words;
  } bad[] = {
      {"quota\n", "a quota line is"},
      {"quota ..\n", "a quota line is"},
      {"quota t jobs\n", "'jobs' is not key=value"},
      {"quota t cpus=4\n", "unknown quota 'cpus'"},
      {"quota t jobs=-1\n", "jobs must be a count"},
      {"quota t jobs=2 jobs=3\n", "quota 'jobs' is given twice"},
      {"quota t host-bytes=lots\n", "host-bytes must be a size"},
      {"quota t jobs=1\nquota t jobs=2\n", "tenant t has two quota lines"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    t = NULL;
    assert_int_not_equal(auth_load(write_file("badq", bad[i].text), &t, err, sizeof err), 0);
    assert_null(t);
    if (strstr(err, bad[i].words) == NULL)
      fail_msg("case %zu: got '%s', want '%s'", i, err, bad[i].words);
  }
}

static void test_token_files(void **state) {
  (void)state;
  char token[RPC_MAX_TOKEN_BYTES + 1], err[512];
  assert_int_equal(rpc_read_token_file(write_file("t1", "  s3cret-token \r\n# more\n"), token,
                                       sizeof token, err, sizeof err),
                   0);
  assert_string_equal(token, "s3cret-token");
  const char *bad[] = {"", "\n", "two words\n", "tab\there\n"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    assert_int_equal(
        rpc_read_token_file(write_file("t2", bad[i]), token, sizeof token, err, sizeof err),
        -EINVAL);
  char *longest = malloc(RPC_MAX_TOKEN_BYTES + 2);
  memset(longest, 'x', RPC_MAX_TOKEN_BYTES);
  longest[RPC_MAX_TOKEN_BYTES] = '\0';
  assert_int_equal(
      rpc_read_token_file(write_file("t3", longest), token, sizeof token, err, sizeof err), 0);
  assert_int_equal(strlen(token), RPC_MAX_TOKEN_BYTES);
  longest[RPC_MAX_TOKEN_BYTES] = 'x';
  longest[RPC_MAX_TOKEN_BYTES + 1] = '\0';
  assert_int_equal(
      rpc_read_token_file(write_file("t3", longest), token, sizeof token, err, sizeof err),
      -EINVAL);
  free(longest);
}

static void test_local_addresses(void **state) {
  (void)state;
  const char *local[] = {"127.0.0.1:7070", "127.1.2.3:1",      "localhost:7070",       "[::1]:7070",
                         "unix:/tmp/x",    "ipv4:127.0.0.1:5", "dns:///localhost:7070"};
  const char *remote[] = {
      "0.0.0.0:7070", "10.0.0.1:7070",           "[::]:7070", "example.com:7070",
      "128.0.0.1:1",  "localhost.example.com:1", "",          ":7070"};
  for (size_t i = 0; i < sizeof local / sizeof local[0]; i++)
    if (!rpc_address_is_local(local[i]))
      fail_msg("%s should be local", local[i]);
  for (size_t i = 0; i < sizeof remote / sizeof remote[0]; i++)
    if (rpc_address_is_local(remote[i]))
      fail_msg("%s should not be local", remote[i]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_good_file),       cmocka_unit_test(test_mistakes_name_their_line),
      cmocka_unit_test(test_quota_lines),     cmocka_unit_test(test_token_files),
      cmocka_unit_test(test_local_addresses),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
