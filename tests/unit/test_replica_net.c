/* The replica transport between nodes (daemon/node/replica_net.c and
 * replica_server.c): a server on a scratch root, files put and got back,
 * the requests it refuses (and that nothing is written then), names the
 * client refuses before sending, peers that go away or go silent midway,
 * and a stop while connections are open. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include <cmocka.h>

#include "clock.h"
#include "replica_net.h"

#define JOB        7
#define SAVE       3
#define TIMEOUT_MS 5000

/* snprintf into a buffer that must hold the whole text. */
static void pathf(char *out, size_t out_bytes, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void pathf(char *out, size_t out_bytes, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(out, out_bytes, fmt, ap);
  va_end(ap);
  if (n < 0 || (size_t)n >= out_bytes)
    fail_msg("a path or command longer than %zu bytes", out_bytes);
}

typedef struct fixture {
  char dir[PATH_MAX];  /* scratch: root/ and the client's files */
  char root[PATH_MAX]; /* the server's replica root */
  replica_server *server;
  char addr[64];
  uint8_t key[REPLICA_KEY_BYTES];
} fixture;

/* Job JOB's key is 0, 1, ..., 31; no other job is known. */
static int key_of(void *ctx, uint64_t job_id, uint8_t key[REPLICA_KEY_BYTES]) {
  (void)ctx;
  if (job_id != JOB)
    return -ENOENT;
  for (int i = 0; i < REPLICA_KEY_BYTES; i++)
    key[i] = (uint8_t)i;
  return 0;
}

static int setup(void **state) {
  fixture *f = calloc(1, sizeof *f);
  const char *base = getenv("TMPDIR") != NULL ? getenv("TMPDIR") : "/tmp";
  pathf(f->dir, sizeof f->dir, "%s/test_replica_net.XXXXXX", base);
  if (mkdtemp(f->dir) == NULL)
    return -1;
  pathf(f->root, sizeof f->root, "%s/root", f->dir);
  mkdir(f->root, 0700);
  key_of(NULL, JOB, f->key);
  char err[256] = "";
  if (replica_server_start(NULL, 0, f->root, key_of, NULL, &f->server, err, sizeof err) != 0) {
    fprintf(stderr, "replica_server_start: %s\n", err);
    return -1;
  }
  pathf(f->addr, sizeof f->addr, "127.0.0.1:%d", replica_server_port(f->server));
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  replica_server_stop(f->server);
  char cmd[PATH_MAX + 16];
  pathf(cmd, sizeof cmd, "rm -rf '%s'", f->dir);
  int rc = system(cmd);
  free(f);
  return rc == 0 ? 0 : -1;
}

static void path_in(const fixture *f, const char *name, char *out, size_t out_bytes) {
  pathf(out, out_bytes, "%s/%s", f->dir, name);
}

/* Writes bytes of seeded pseudo-random data to path. */
static void write_random(const char *path, size_t bytes, uint64_t seed) {
  uint8_t *buf = malloc(bytes);
  assert_non_null(buf);
  for (size_t i = 0; i < bytes; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    buf[i] = (uint8_t)(seed >> 56);
  }
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, buf, bytes), (ssize_t)bytes);
  close(fd);
  free(buf);
}

static void expect_same(const char *a, const char *b) {
  char cmd[2 * PATH_MAX + 32];
  pathf(cmd, sizeof cmd, "cmp -s '%s' '%s'", a, b);
  if (system(cmd) != 0)
    fail_msg("%s and %s differ", a, b);
}

static void expect_missing(const char *path) {
  struct stat st;
  if (lstat(path, &st) == 0)
    fail_msg("%s exists, expected it missing", path);
}

/* The number of entries in dir (not . and ..); 0 if it does not exist. */
static int entries(const char *dir) {
  char cmd[PATH_MAX + 64];
  pathf(cmd, sizeof cmd, "ls -A '%s' 2>/dev/null | wc -l", dir);
  FILE *p = popen(cmd, "r");
  int n = -1;
  assert_non_null(p);
  assert_int_equal(fscanf(p, "%d", &n), 1);
  pclose(p);
  return n;
}

static void save_path(const fixture *f, const char *name, char *out, size_t out_bytes) {
  pathf(out, out_bytes, "%s/%d/%d/%s", f->root, JOB, SAVE, name);
}

/* A socket connected to the fixture's server. */
static int raw_connect(const fixture *f) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_port = htons((uint16_t)replica_server_port(f->server))};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

static void raw_header(const fixture *f, int op, uint64_t bytes, uint8_t out[]) {
  replica_request r = {.op = op, .job_id = JOB, .save_id = SAVE, .bytes = bytes};
  strcpy(r.name, "shard.zdshard");
  memcpy(r.key, f->key, sizeof r.key);
  replica_request_encode(&r, out);
}

/* Sends header and returns the reply's status, its message in msg. */
static int raw_request(const fixture *f, const uint8_t *header, char msg[REPLICA_MESSAGE_BYTES]) {
  int fd = raw_connect(f);
  assert_int_equal(send(fd, header, REPLICA_REQUEST_BYTES, MSG_NOSIGNAL), REPLICA_REQUEST_BYTES);
  uint8_t reply[REPLICA_REPLY_BYTES];
  assert_int_equal(recv(fd, reply, sizeof reply, MSG_WAITALL), REPLICA_REPLY_BYTES);
  close(fd);
  memcpy(msg, reply + 12, REPLICA_MESSAGE_BYTES);
  msg[REPLICA_MESSAGE_BYTES - 1] = '\0';
  return (int32_t)(reply[0] | reply[1] << 8 | reply[2] << 16 | (uint32_t)reply[3] << 24);
}

/* ------------------------------------------------------------------------
 * Round trips
 * ------------------------------------------------------------------------ */

static void test_put_then_get_gives_the_file_back(void **state) {
  fixture *f = *state;
  char src[PATH_MAX], dst[PATH_MAX], held[PATH_MAX], err[256] = "";
  path_in(f, "src", src, sizeof src);
  path_in(f, "dst", dst, sizeof dst);
  write_random(src, 20u << 20, 1);
  int rc =
      replica_put(f->addr, f->key, JOB, SAVE, "rank0.zdshard", src, TIMEOUT_MS, err, sizeof err);
  if (rc != 0)
    fail_msg("put: %d %s", rc, err);
  save_path(f, "rank0.zdshard", held, sizeof held);
  expect_same(src, held);
  struct stat st;
  assert_int_equal(stat(held, &st), 0);
  assert_int_equal(st.st_mode & 0777, 0600);
  pathf(held, sizeof held, "%s/%d", f->root, JOB);
  assert_int_equal(stat(held, &st), 0);
  assert_int_equal(st.st_mode & 0777, 0700);
  pathf(held, sizeof held, "%s/%d/%d", f->root, JOB, SAVE);
  assert_int_equal(entries(held), 1); /* no temporary file left beside it */

  rc = replica_get(f->addr, f->key, JOB, SAVE, "rank0.zdshard", dst, TIMEOUT_MS, err, sizeof err);
  if (rc != 0)
    fail_msg("get: %d %s", rc, err);
  expect_same(src, dst);
  strcat(dst, ".tmp");
  expect_missing(dst);
}

static void test_put_replaces_and_empty_files_travel(void **state) {
  fixture *f = *state;
  char src[PATH_MAX], dst[PATH_MAX], held[PATH_MAX], err[256] = "";
  path_in(f, "src", src, sizeof src);
  path_in(f, "dst", dst, sizeof dst);
  write_random(src, 1000, 2);
  assert_int_equal(replica_put(f->addr, f->key, JOB, SAVE, "a", src, TIMEOUT_MS, err, sizeof err),
                   0);
  write_random(src, 0, 3);
  assert_int_equal(replica_put(f->addr, f->key, JOB, SAVE, "a", src, TIMEOUT_MS, err, sizeof err),
                   0);
  save_path(f, "a", held, sizeof held);
  expect_same(src, held);
  assert_int_equal(replica_get(f->addr, f->key, JOB, SAVE, "a", dst, TIMEOUT_MS, err, sizeof err),
                   0);
  expect_same(src, dst);
}

static void test_ipv6_addresses_in_brackets(void **state) {
  fixture *f = *state;
  replica_server *s6;
  char err[256] = "", addr[64], src[PATH_MAX], dst[PATH_MAX];
  if (replica_server_start("::1", 0, f->root, key_of, NULL, &s6, err, sizeof err) != 0) {
    print_message("no IPv6 loopback here (%s): skipped\n", err);
    skip();
  }
  pathf(addr, sizeof addr, "[::1]:%d", replica_server_port(s6));
  path_in(f, "src", src, sizeof src);
  path_in(f, "dst", dst, sizeof dst);
  write_random(src, 4096, 4);
  int rc = replica_put(addr, f->key, JOB, SAVE, "v6", src, TIMEOUT_MS, err, sizeof err);
  if (rc == 0)
    rc = replica_get(addr, f->key, JOB, SAVE, "v6", dst, TIMEOUT_MS, err, sizeof err);
  replica_server_stop(s6);
  if (rc != 0)
    fail_msg("[::1]: %d %s", rc, err);
  expect_same(src, dst);
}

/* ------------------------------------------------------------------------
 * Refusals
 * ------------------------------------------------------------------------ */

static void test_wrong_key_is_refused_and_nothing_written(void **state) {
  fixture *f = *state;
  char src[PATH_MAX], dst[PATH_MAX], job_dir[PATH_MAX], err[256] = "";
  path_in(f, "src", src, sizeof src);
  path_in(f, "dst", dst, sizeof dst);
  write_random(src, 8u << 20, 5); /* refused while the body is still being sent */
  uint8_t bad[REPLICA_KEY_BYTES];
  memcpy(bad, f->key, sizeof bad);
  bad[31] ^= 1;
  int rc = replica_put(f->addr, bad, JOB, SAVE, "x", src, TIMEOUT_MS, err, sizeof err);
  assert_int_equal(rc, -EACCES);
  if (strstr(err, "bad key") == NULL)
    fail_msg("the error does not name the key: %s", err);
  pathf(job_dir, sizeof job_dir, "%s/%d", f->root, JOB);
  expect_missing(job_dir);
  rc = replica_get(f->addr, bad, JOB, SAVE, "x", dst, TIMEOUT_MS, err, sizeof err);
  assert_int_equal(rc, -EACCES);
  expect_missing(dst);
}

static void test_unknown_job_is_refused(void **state) {
  fixture *f = *state;
  char src[PATH_MAX], err[256] = "";
  path_in(f, "src", src, sizeof src);
  write_random(src, 100, 6);
  int rc = replica_put(f->addr, f->key, 99, SAVE, "x", src, TIMEOUT_MS, err, sizeof err);
  assert_int_equal(rc, -EACCES);
  if (strstr(err, "unknown job 99") == NULL)
    fail_msg("unexpected error: %s", err);
  assert_int_equal(entries(f->root), 0);
}

static void test_get_of_a_missing_file_is_enoent(void **state) {
  fixture *f = *state;
  char dst[PATH_MAX], err[256] = "";
  path_in(f, "dst", dst, sizeof dst);
  int rc = replica_get(f->addr, f->key, JOB, SAVE, "nothing", dst, TIMEOUT_MS, err, sizeof err);
  assert_int_equal(rc, -ENOENT);
  expect_missing(dst);
  strcat(dst, ".tmp");
  expect_missing(dst);
}

static const char *const bad_names[] = {
    "../x",
    ".hidden",
    "a/b",
    "",
    "a..b",
    "sp ace",
    "0123456789012345678901234567890123456789012345678901234567890123", /* 64 */
};
#define N_BAD_NAMES (sizeof bad_names / sizeof bad_names[0])

static void test_bad_names_are_refused_by_the_client(void **state) {
  fixture *f = *state;
  char src[PATH_MAX], dst[PATH_MAX], err[256];
  path_in(f, "src", src, sizeof src);
  path_in(f, "dst", dst, sizeof dst);
  write_random(src, 100, 7);
  for (size_t i = 0; i < N_BAD_NAMES; i++) {
    /* Port 1: nothing listens, so an error that is not about the name
     * would mean the client tried to connect. */
    err[0] = '\0';
    assert_int_equal(
        replica_put("127.0.0.1:1", f->key, JOB, SAVE, bad_names[i], src, 100, err, sizeof err),
        -EINVAL);
    assert_non_null(strstr(err, "bad name"));
    err[0] = '\0';
    assert_int_equal(
        replica_get("127.0.0.1:1", f->key, JOB, SAVE, bad_names[i], dst, 100, err, sizeof err),
        -EINVAL);
    assert_non_null(strstr(err, "bad name"));
  }
  assert_true(replica_name_valid("rank-0_of.8.zdshard"));
}

static void test_bad_headers_are_refused_by_the_server(void **state) {
  fixture *f = *state;
  uint8_t header[REPLICA_REQUEST_BYTES];
  char msg[REPLICA_MESSAGE_BYTES];
  for (size_t i = 0; i < N_BAD_NAMES; i++) {
    raw_header(f, REPLICA_OP_PUT, 0, header);
    memset(header + 36, 0, REPLICA_NAME_BYTES);
    memcpy(header + 36, bad_names[i], strlen(bad_names[i])); /* the 64-byte one: no NUL */
    assert_int_equal(raw_request(f, header, msg), -EINVAL);
    if (strstr(msg, "bad name") == NULL)
      fail_msg("'%s': %s", bad_names[i], msg);
  }
  raw_header(f, REPLICA_OP_PUT, 0, header);
  header[36 + 20] = 'x'; /* after the name's NUL */
  assert_int_equal(raw_request(f, header, msg), -EINVAL);
  raw_header(f, REPLICA_OP_PUT, 0, header);
  header[0] = 'X';
  assert_int_equal(raw_request(f, header, msg), -EINVAL);
  assert_non_null(strstr(msg, "magic"));
  raw_header(f, 4, 0, header);
  assert_int_equal(raw_request(f, header, msg), -EINVAL);
  assert_non_null(strstr(msg, "op 4"));
  /* FOLLOW: a server without a relay serves none; one with bytes is bad. */
  raw_header(f, REPLICA_OP_FOLLOW, 0, header);
  assert_int_equal(raw_request(f, header, msg), -ENOTSUP);
  assert_non_null(strstr(msg, "no followers"));
  raw_header(f, REPLICA_OP_FOLLOW, 5, header);
  assert_int_equal(raw_request(f, header, msg), -EINVAL);
  assert_non_null(strstr(msg, "FOLLOW with bytes"));
  raw_header(f, REPLICA_OP_PUT, 0, header);
  header[4] = 2;
  assert_int_equal(raw_request(f, header, msg), -EINVAL);
  assert_non_null(strstr(msg, "version 2"));
  raw_header(f, REPLICA_OP_PUT, REPLICA_MAX_FILE_BYTES + 1, header);
  assert_int_equal(raw_request(f, header, msg), -EFBIG);
  raw_header(f, REPLICA_OP_GET, 5, header);
  assert_int_equal(raw_request(f, header, msg), -EINVAL);
  assert_int_equal(entries(f->root), 0);
}

/* ------------------------------------------------------------------------
 * Peers that go away, stop
 * ------------------------------------------------------------------------ */

static void test_half_a_put_leaves_nothing_and_the_server_goes_on(void **state) {
  fixture *f = *state;
  uint8_t header[REPLICA_REQUEST_BYTES];
  raw_header(f, REPLICA_OP_PUT, 1u << 20, header);
  int fd = raw_connect(f);
  assert_int_equal(send(fd, header, sizeof header, MSG_NOSIGNAL), (ssize_t)sizeof header);
  static uint8_t half[300000];
  assert_int_equal(send(fd, half, sizeof half, MSG_NOSIGNAL), (ssize_t)sizeof half);
  close(fd);
  char dir[PATH_MAX], held[PATH_MAX], src[PATH_MAX], err[256] = "";
  pathf(dir, sizeof dir, "%s/%d/%d", f->root, JOB, SAVE);
  uint64_t deadline = clock_now_ns() + 5000000000ull;
  while (entries(dir) != 0 && clock_now_ns() < deadline)
    nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL);
  assert_int_equal(entries(dir), 0); /* the temporary file is gone too */
  save_path(f, "shard.zdshard", held, sizeof held);
  expect_missing(held);

  path_in(f, "src", src, sizeof src);
  write_random(src, 1u << 20, 8);
  assert_int_equal(
      replica_put(f->addr, f->key, JOB, SAVE, "shard.zdshard", src, TIMEOUT_MS, err, sizeof err),
      0);
  expect_same(src, held);
}

/* A fake peer on a listening socket: answers a GET with a reply that
 * promises `promise` bytes, sends `sent` of them and closes; promise 0:
 * reads the request and says nothing until the client gives up. */
typedef struct fake_peer {
  int listen_fd, port;
  uint64_t promise, sent;
  pthread_t thread;
} fake_peer;

static void *fake_peer_main(void *arg) {
  fake_peer *p = arg;
  int fd = accept(p->listen_fd, NULL, NULL);
  uint8_t header[REPLICA_REQUEST_BYTES], reply[REPLICA_REPLY_BYTES] = {0};
  recv(fd, header, sizeof header, MSG_WAITALL);
  if (p->promise == 0) {
    recv(fd, header, 1, 0); /* until the client closes */
  } else {
    for (int i = 0; i < 8; i++)
      reply[4 + i] = (uint8_t)(p->promise >> (8 * i));
    send(fd, reply, sizeof reply, MSG_NOSIGNAL);
    uint8_t *body = calloc(1, p->sent);
    send(fd, body, p->sent, MSG_NOSIGNAL);
    free(body);
  }
  close(fd);
  return NULL;
}

static void fake_peer_start(fake_peer *p) {
  p->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  socklen_t len = sizeof sa;
  assert_int_equal(bind(p->listen_fd, (struct sockaddr *)&sa, sizeof sa), 0);
  assert_int_equal(listen(p->listen_fd, 4), 0);
  getsockname(p->listen_fd, (struct sockaddr *)&sa, &len);
  p->port = ntohs(sa.sin_port);
  assert_int_equal(pthread_create(&p->thread, NULL, fake_peer_main, p), 0);
}

static void test_a_peer_dying_mid_get_is_an_error_and_leaves_nothing(void **state) {
  fixture *f = *state;
  fake_peer p = {.promise = 1u << 20, .sent = 1000};
  fake_peer_start(&p);
  char addr[64], dst[PATH_MAX], err[256] = "";
  pathf(addr, sizeof addr, "127.0.0.1:%d", p.port);
  path_in(f, "dst", dst, sizeof dst);
  int rc = replica_get(addr, f->key, JOB, SAVE, "x", dst, TIMEOUT_MS, err, sizeof err);
  pthread_join(p.thread, NULL);
  close(p.listen_fd);
  assert_int_equal(rc, -EPIPE);
  assert_non_null(strstr(err, "closed"));
  expect_missing(dst);
  strcat(dst, ".tmp");
  expect_missing(dst);
}

static void test_a_silent_peer_times_out(void **state) {
  fixture *f = *state;
  fake_peer p = {.promise = 0};
  fake_peer_start(&p);
  char addr[64], dst[PATH_MAX], err[256] = "";
  pathf(addr, sizeof addr, "127.0.0.1:%d", p.port);
  path_in(f, "dst", dst, sizeof dst);
  uint64_t t0 = clock_now_ns();
  int rc = replica_get(addr, f->key, JOB, SAVE, "x", dst, 200, err, sizeof err);
  uint64_t took_ms = (clock_now_ns() - t0) / 1000000;
  pthread_join(p.thread, NULL);
  close(p.listen_fd);
  assert_int_equal(rc, -ETIMEDOUT);
  assert_true(took_ms < 3000);
  expect_missing(dst);
}

static void test_stop_with_idle_connections_returns(void **state) {
  fixture *f = *state;
  int fds[4];
  for (int i = 0; i < 4; i++)
    fds[i] = raw_connect(f);
  uint8_t header[REPLICA_REQUEST_BYTES];
  raw_header(f, REPLICA_OP_PUT, 1u << 20, header);
  send(fds[3], header, sizeof header, MSG_NOSIGNAL); /* one mid-PUT */
  nanosleep(&(struct timespec){.tv_nsec = 100000000}, NULL);
  uint64_t t0 = clock_now_ns();
  replica_server_stop(f->server);
  f->server = NULL;
  assert_true(clock_now_ns() - t0 < 3000000000ull);
  for (int i = 0; i < 4; i++)
    close(fds[i]);
  char dir[PATH_MAX];
  pathf(dir, sizeof dir, "%s/%d/%d", f->root, JOB, SAVE);
  assert_int_equal(entries(dir), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_put_then_get_gives_the_file_back, setup, teardown),
      cmocka_unit_test_setup_teardown(test_put_replaces_and_empty_files_travel, setup, teardown),
      cmocka_unit_test_setup_teardown(test_ipv6_addresses_in_brackets, setup, teardown),
      cmocka_unit_test_setup_teardown(test_wrong_key_is_refused_and_nothing_written, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_unknown_job_is_refused, setup, teardown),
      cmocka_unit_test_setup_teardown(test_get_of_a_missing_file_is_enoent, setup, teardown),
      cmocka_unit_test_setup_teardown(test_bad_names_are_refused_by_the_client, setup, teardown),
      cmocka_unit_test_setup_teardown(test_bad_headers_are_refused_by_the_server, setup, teardown),
      cmocka_unit_test_setup_teardown(test_half_a_put_leaves_nothing_and_the_server_goes_on, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_a_peer_dying_mid_get_is_an_error_and_leaves_nothing,
                                      setup, teardown),
      cmocka_unit_test_setup_teardown(test_a_silent_peer_times_out, setup, teardown),
      cmocka_unit_test_setup_teardown(test_stop_with_idle_connections_returns, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
