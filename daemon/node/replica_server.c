/* The replica transport's server (see replica_net.h; the wire format is
 * described at the top of replica_net.c): one accept thread, a detached
 * thread per connection, each serving one request. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "fsutil.h"
#include "log.h"
#include "replica_net_impl.h"

/* How long the server waits on a silent peer before freeing its slot. */
#define SERVER_TIMEOUT_MS 30000
/* How long a refusal waits for the client to stop sending and close. */
#define DRAIN_MS 1000

struct replica_server {
  int listen_fd, wake[2], port;
  char root[PATH_MAX];
  replica_key_fn key_fn;
  void *ctx;
  pthread_t acceptor;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* a slot freed, or stopping */
  int stopping, nconns;
  int fds[REPLICA_MAX_CONNS];  /* the connections' sockets; -1: free */
  replica_follow_fn follow_fn; /* FOLLOW's relay, or NULL */
  void *follow_ctx;
  int nfollows; /* FOLLOW connections being relayed */
};

typedef struct conn {
  replica_server *s;
  int fd, slot;
} conn;

/* Answers status and message, then reads and drops what the client still
 * sends until it closes (at most DRAIN_MS): closing with unread bytes
 * would reset the connection and could lose the reply. */
static void refuse(int fd, int status, const char *message, uint64_t job_id) {
  char quoted[REPLICA_MESSAGE_BYTES + 8];
  LOG_WARNF("replica request refused", "job=%llu reason=%s", (unsigned long long)job_id,
            log_quote(message, quoted, sizeof quoted));
  uint8_t reply[REPLICA_REPLY_BYTES];
  replica__reply_encode(reply, status, 0, message);
  if (replica__send_all(fd, reply, sizeof reply) != 0)
    return;
  shutdown(fd, SHUT_WR);
  uint8_t sink[16384];
  int64_t deadline = clock_now_ms() + DRAIN_MS;
  for (int64_t left = DRAIN_MS; left > 0; left = deadline - clock_now_ms()) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, (int)left) <= 0 || recv(fd, sink, sizeof sink, 0) <= 0)
      return;
  }
}

static int check_key(replica_server *s, const replica_request *r, char *why, size_t why_bytes) {
  uint8_t want[REPLICA_KEY_BYTES];
  if (s->key_fn(s->ctx, r->job_id, want) != 0)
    return replica__fail(why, why_bytes, -EACCES, "unknown job %llu",
                         (unsigned long long)r->job_id);
  int differ = CRYPTO_memcmp(want, r->key, REPLICA_KEY_BYTES);
  OPENSSL_cleanse(want, sizeof want);
  return differ ? replica__fail(why, why_bytes, -EACCES, "bad key for job %llu",
                                (unsigned long long)r->job_id)
                : 0;
}

/* The save's directory under the root, and a path in it. */
static int save_dir(const replica_server *s, const replica_request *r, char *out, size_t bytes) {
  int n = snprintf(out, bytes, "%s/%llu/%llu", s->root, (unsigned long long)r->job_id,
                   (unsigned long long)r->save_id);
  return n > 0 && (size_t)n < bytes ? 0 : -ENAMETOOLONG;
}

static void serve_put(replica_server *s, int fd, const replica_request *r, uint8_t *buf) {
  char dir[PATH_MAX], tmp[PATH_MAX], path[PATH_MAX], why[REPLICA_MESSAGE_BYTES];
  uint64_t nonce = 0;
  if (getrandom(&nonce, sizeof nonce, 0) != sizeof nonce)
    nonce = clock_now_ns() ^ (uint64_t)(uintptr_t)buf;
  int rc = save_dir(s, r, dir, sizeof dir);
  if (rc == 0 && ((size_t)snprintf(tmp, sizeof tmp, "%s/%s.tmp-%016llx", dir, r->name,
                                   (unsigned long long)nonce) >= sizeof tmp ||
                  (size_t)snprintf(path, sizeof path, "%s/%s", dir, r->name) >= sizeof path))
    rc = -ENAMETOOLONG;
  if (rc != 0) {
    refuse(fd, rc, "root path too long", r->job_id);
    return;
  }
  if ((rc = fsutil_mkdir_p(dir)) != 0) {
    replica__fail(why, sizeof why, rc, "mkdir %llu/%llu: %s", (unsigned long long)r->job_id,
                  (unsigned long long)r->save_id, strerror(-rc));
    refuse(fd, rc, why, r->job_id);
    return;
  }
  int file = replica__create_file(tmp, O_EXCL);
  if (file < 0) {
    replica__fail(why, sizeof why, file, "create %s: %s", r->name, strerror(-file));
    refuse(fd, file, why, r->job_id);
    return;
  }
  const char *failed = "";
  rc = replica__recv_file(fd, file, r->bytes, buf, &failed);
  if (rc != 0) {
    close(file);
    unlink(tmp);
    if (strcmp(failed, "write") == 0) { /* the peer is still there: tell it */
      replica__fail(why, sizeof why, rc, "write %s: %s", r->name, strerror(-rc));
      refuse(fd, rc, why, r->job_id);
    }
    return; /* the peer went away: nothing to answer */
  }
  if ((rc = replica__commit_file(file, tmp, path, dir, &failed)) != 0) {
    replica__fail(why, sizeof why, rc, "%s %s: %s", failed, r->name, strerror(-rc));
    refuse(fd, rc, why, r->job_id);
    return;
  }
  uint8_t reply[REPLICA_REPLY_BYTES];
  replica__reply_encode(reply, 0, r->bytes, "");
  replica__send_all(fd, reply, sizeof reply);
}

static void serve_get(replica_server *s, int fd, const replica_request *r, uint8_t *buf) {
  char path[PATH_MAX], why[REPLICA_MESSAGE_BYTES];
  char dir[PATH_MAX];
  int rc = save_dir(s, r, dir, sizeof dir);
  if (rc == 0 && (size_t)snprintf(path, sizeof path, "%s/%s", dir, r->name) >= sizeof path)
    rc = -ENAMETOOLONG;
  if (rc != 0) {
    refuse(fd, rc, "root path too long", r->job_id);
    return;
  }
  int file = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  rc = file < 0 ? -errno : 0;
  struct stat st;
  if (rc == 0 && fstat(file, &st) != 0)
    rc = -errno;
  else if (rc == 0 && !S_ISREG(st.st_mode))
    rc = -EINVAL;
  if (rc != 0) {
    if (file >= 0)
      close(file);
    replica__fail(why, sizeof why, rc, "%s %llu/%llu/%s",
                  rc == -ENOENT ? "no such file" : strerror(-rc), (unsigned long long)r->job_id,
                  (unsigned long long)r->save_id, r->name);
    refuse(fd, rc, why, r->job_id);
    return;
  }
  uint8_t reply[REPLICA_REPLY_BYTES];
  replica__reply_encode(reply, 0, (uint64_t)st.st_size, "");
  const char *failed;
  if (replica__send_all(fd, reply, sizeof reply) == 0)
    replica__send_file(fd, file, (uint64_t)st.st_size, buf, 0, &failed);
  close(file);
}

/* FOLLOW: a read-only session relayed to the daemon for as long as the
 * follower stays, within REPLICA_MAX_FOLLOWS. */
static void serve_follow(replica_server *s, int fd) {
  pthread_mutex_lock(&s->mu);
  replica_follow_fn fn = s->follow_fn;
  int room = s->nfollows < REPLICA_MAX_FOLLOWS;
  if (fn != NULL && room)
    s->nfollows++;
  pthread_mutex_unlock(&s->mu);
  if (fn == NULL) {
    refuse(fd, -ENOTSUP, "this node serves no followers", 0);
    return;
  }
  if (!room) {
    refuse(fd, -EBUSY, "this node already serves as many followers as it may (8)", 0);
    return;
  }
  uint8_t reply[REPLICA_REPLY_BYTES];
  replica__reply_encode(reply, 0, 0, "");
  if (replica__send_all(fd, reply, sizeof reply) == 0)
    fn(s->follow_ctx, fd);
  pthread_mutex_lock(&s->mu);
  s->nfollows--;
  pthread_mutex_unlock(&s->mu);
}

void replica_server_set_follow(replica_server *s, replica_follow_fn fn, void *ctx) {
  pthread_mutex_lock(&s->mu);
  s->follow_fn = fn;
  s->follow_ctx = ctx;
  pthread_mutex_unlock(&s->mu);
}

/* One request: the header, its checks, then the op. */
static void serve(replica_server *s, int fd) {
  uint8_t header[REPLICA_REQUEST_BYTES];
  if (replica__recv_all(fd, header, sizeof header) != 0)
    return; /* gone, silent or stopped before a whole header */
  replica_request r;
  char why[REPLICA_MESSAGE_BYTES];
  int rc = replica_request_decode(header, sizeof header, &r, why, sizeof why);
  if (rc == 0 && r.op == REPLICA_OP_FOLLOW) {
    serve_follow(s, fd);
    return;
  }
  if (rc == 0)
    rc = check_key(s, &r, why, sizeof why);
  if (rc != 0) {
    refuse(fd, rc, why, r.job_id);
    return;
  }
  uint8_t *buf = malloc(REPLICA_CHUNK_BYTES);
  if (buf == NULL) {
    refuse(fd, -ENOMEM, "out of memory", r.job_id);
    return;
  }
  if (r.op == REPLICA_OP_PUT)
    serve_put(s, fd, &r, buf);
  else
    serve_get(s, fd, &r, buf);
  free(buf);
}

/* Frees the connection's slot; the server may be freed once this unlocks,
 * so the thread touches nothing of it after. */
static void *conn_main(void *arg) {
  conn c = *(conn *)arg;
  free(arg);
  serve(c.s, c.fd);
  pthread_mutex_lock(&c.s->mu);
  c.s->fds[c.slot] = -1; /* closed under the lock: stop never shuts down a reused fd */
  close(c.fd);
  c.s->nconns--;
  pthread_cond_broadcast(&c.s->cv);
  pthread_mutex_unlock(&c.s->mu);
  return NULL;
}

static void start_conn(replica_server *s, int fd) {
  conn *c = malloc(sizeof *c);
  pthread_mutex_lock(&s->mu);
  int slot = 0;
  while (slot < REPLICA_MAX_CONNS && s->fds[slot] >= 0)
    slot++;
  if (c == NULL || s->stopping || slot == REPLICA_MAX_CONNS) {
    pthread_mutex_unlock(&s->mu);
    free(c);
    close(fd);
    return;
  }
  s->fds[slot] = fd;
  s->nconns++;
  pthread_mutex_unlock(&s->mu);
  replica__sock_setup(fd, SERVER_TIMEOUT_MS);
  *c = (conn){.s = s, .fd = fd, .slot = slot};
  pthread_attr_t attr;
  pthread_t thread;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&thread, &attr, conn_main, c) != 0) {
    free(c);
    pthread_mutex_lock(&s->mu);
    s->fds[slot] = -1;
    close(fd);
    s->nconns--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
  }
  pthread_attr_destroy(&attr);
}

/* Accepts while a slot is free (the rest wait in the backlog) until
 * stop writes to the wake pipe. */
static void *accept_main(void *arg) {
  replica_server *s = arg;
  for (;;) {
    pthread_mutex_lock(&s->mu);
    while (!s->stopping && s->nconns == REPLICA_MAX_CONNS)
      pthread_cond_wait(&s->cv, &s->mu);
    int stopping = s->stopping;
    pthread_mutex_unlock(&s->mu);
    struct pollfd p[2] = {{.fd = s->listen_fd, .events = POLLIN},
                          {.fd = s->wake[0], .events = POLLIN}};
    if (stopping || (poll(p, 2, -1) < 0 && errno != EINTR) || p[1].revents != 0)
      return NULL;
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd >= 0)
      start_conn(s, fd);
    else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
      nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL); /* do not spin */
  }
}

/* A listening, non-blocking socket on host:port. */
static int listen_on(const char *host, int port, char *err, size_t err_bytes) {
  char name[256], service[16];
  if (replica__split_addr(host, name, sizeof name, NULL) != 0)
    return replica__fail(err, err_bytes, -EINVAL, "bad listen host '%s'", host);
  snprintf(service, sizeof service, "%d", port);
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
  struct addrinfo *res;
  int gai = getaddrinfo(name, service, &hints, &res);
  if (gai != 0)
    return replica__fail(err, err_bytes, -EADDRNOTAVAIL, "resolve %s: %s", host, gai_strerror(gai));
  int fd = -EADDRNOTAVAIL, one = 1;
  for (struct addrinfo *ai = res; ai != NULL && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      fd = -errno;
      continue;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
      int rc = -errno;
      close(fd);
      fd = rc;
    }
  }
  freeaddrinfo(res);
  if (fd < 0)
    return replica__fail(err, err_bytes, fd, "listen on %s:%d: %s", host, port, strerror(-fd));
  return fd;
}

static int bound_port(int fd) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0)
    return -errno;
  return ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                  : ntohs(((struct sockaddr_in *)&ss)->sin_port);
}

int replica_server_start(const char *host, int port, const char *root, replica_key_fn key_fn,
                         void *ctx, replica_server **out, char *err, size_t err_bytes) {
  struct stat st;
  if (root == NULL || key_fn == NULL || port < 0 || port > 65535)
    return replica__fail(err, err_bytes, -EINVAL, "replica server: bad arguments");
  if (stat(root, &st) != 0 || !S_ISDIR(st.st_mode))
    return replica__fail(err, err_bytes, -ENOTDIR, "replica root %s: not a directory", root);
  replica_server *s = calloc(1, sizeof *s);
  if (s == NULL)
    return replica__fail(err, err_bytes, -ENOMEM, "replica server: out of memory");
  if (strlen(root) >= sizeof s->root - 128) {
    free(s);
    return replica__fail(err, err_bytes, -ENAMETOOLONG, "replica root too long");
  }
  strcpy(s->root, root);
  s->key_fn = key_fn;
  s->ctx = ctx;
  for (int i = 0; i < REPLICA_MAX_CONNS; i++)
    s->fds[i] = -1;
  s->wake[0] = s->wake[1] = -1;
  s->listen_fd = listen_on(host != NULL ? host : "127.0.0.1", port, err, err_bytes);
  int rc = s->listen_fd < 0 ? s->listen_fd : 0;
  if (rc == 0 && pipe2(s->wake, O_CLOEXEC) != 0)
    rc = replica__fail(err, err_bytes, -errno, "replica server: pipe: %s", strerror(errno));
  if (rc == 0 && (s->port = bound_port(s->listen_fd)) < 0)
    rc = replica__fail(err, err_bytes, s->port, "replica server: getsockname: %s",
                       strerror(-s->port));
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  if (rc == 0 && (rc = -pthread_create(&s->acceptor, NULL, accept_main, s)) != 0)
    replica__fail(err, err_bytes, rc, "replica server: thread: %s", strerror(-rc));
  if (rc != 0) {
    if (s->listen_fd >= 0)
      close(s->listen_fd);
    if (s->wake[0] >= 0) {
      close(s->wake[0]);
      close(s->wake[1]);
    }
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
    return rc;
  }
  *out = s;
  return 0;
}

int replica_server_port(const replica_server *s) {
  return s->port;
}

void replica_server_stop(replica_server *s) {
  if (s == NULL)
    return;
  pthread_mutex_lock(&s->mu);
  s->stopping = 1;
  for (int i = 0; i < REPLICA_MAX_CONNS; i++)
    if (s->fds[i] >= 0)
      shutdown(s->fds[i], SHUT_RDWR); /* wakes its thread's recv or send */
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  ssize_t w;
  while ((w = write(s->wake[1], "x", 1)) < 0 && errno == EINTR)
    ;
  pthread_join(s->acceptor, NULL);
  pthread_mutex_lock(&s->mu);
  while (s->nconns > 0)
    pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
  close(s->listen_fd);
  close(s->wake[0]);
  close(s->wake[1]);
  pthread_cond_destroy(&s->cv);
  pthread_mutex_destroy(&s->mu);
  free(s);
}
