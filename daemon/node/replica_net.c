/* The replica transport between nodes (see replica_net.h).
 *
 * Wire format, every integer little-endian, one request per connection:
 *
 *   request (132 bytes)             reply (212 bytes)
 *     0  magic "ZDRP"                 0  status   i32 (0 or -errno)
 *     4  version  u32 (1)             4  bytes    u64 (GET: the file's size)
 *     8  op       u32 (1 PUT, 2 GET) 12  message  200 bytes, NUL padded
 *    12  job_id   u64
 *    20  save_id  u64
 *    28  bytes    u64 (PUT: the file's size; GET: 0)
 *    36  name     64 bytes, NUL padded ([A-Za-z0-9._-]{1,63}, no "..",
 *                 not starting with '.')
 *   100  key      32 bytes, the job's
 *
 * op 3 is FOLLOW (name "follow", bytes 0, key unused): after an OK reply
 * the connection carries IPC frames (docs/protocol.md) of one read-only
 * session, relayed by the server to its daemon (follow_relay.c).
 *
 * PUT: the request, then `bytes` raw bytes; the server writes
 * <dir>/<name>.tmp-<random>, fsyncs it, renames it to <dir>/<name>, fsyncs
 * the directory and only then replies, so a 0 means the file is durable.
 * GET: the request; the reply (bytes = the file's size), then the file.
 * A refused request (bad header, unknown job, bad key, a missing file, a
 * failed write) gets a reply with status and message, and the connection
 * is closed; nothing is written. A refusal can come while a PUT's body is
 * still being sent: the client watches for it between chunks, and the
 * server reads and drops what still comes for a moment before closing,
 * so that the reply is not lost to a reset. */
#include "replica_net.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "filemode.h"
#include "fsutil.h"
#include "little_endian.h"
#include "replica_net_impl.h"

/* The client's timeout when the caller gives none. */
#define DEFAULT_TIMEOUT_MS 30000
/* What a name may be, as the refusals say it. */
#define NAME_RULE "[A-Za-z0-9._-]{1,63}, no '..', not starting with '.'"

int replica__fail(char *err, size_t err_bytes, int rc, const char *fmt, ...) {
  if (err != NULL && err_bytes > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_bytes, fmt, ap);
    va_end(ap);
  }
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Codec                                                                    */
/* ------------------------------------------------------------------------ */

int replica_name_valid(const char *name) {
  size_t n = strnlen(name, REPLICA_NAME_BYTES);
  if (n == 0 || n >= REPLICA_NAME_BYTES || name[0] == '.' || strstr(name, "..") != NULL)
    return 0;
  for (size_t i = 0; i < n; i++) {
    char c = name[i];
    if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
          c == '_' || c == '-'))
      return 0;
  }
  return 1;
}

void replica_request_encode(const replica_request *r, uint8_t buf[REPLICA_REQUEST_BYTES]) {
  memset(buf, 0, REPLICA_REQUEST_BYTES);
  memcpy(buf, "ZDRP", 4);
  le_put32(buf + 4, REPLICA_VERSION);
  le_put32(buf + 8, (uint32_t)r->op);
  le_put64(buf + 12, r->job_id);
  le_put64(buf + 20, r->save_id);
  le_put64(buf + 28, r->bytes);
  memcpy(buf + 36, r->name, strnlen(r->name, REPLICA_NAME_BYTES - 1));
  memcpy(buf + 100, r->key, REPLICA_KEY_BYTES);
}

/* The name field: NUL-terminated, zero after the NUL (one encoding per
 * name), and a valid name. */
static int decode_name(const uint8_t *field, char out[REPLICA_NAME_BYTES]) {
  const uint8_t *nul = memchr(field, 0, REPLICA_NAME_BYTES);
  if (nul == NULL)
    return -EINVAL;
  for (const uint8_t *p = nul; p < field + REPLICA_NAME_BYTES; p++)
    if (*p != 0)
      return -EINVAL;
  memcpy(out, field, REPLICA_NAME_BYTES);
  return replica_name_valid(out) ? 0 : -EINVAL;
}

int replica_request_decode(const uint8_t *buf, size_t len, replica_request *out, char *err,
                           size_t err_bytes) {
  memset(out, 0, sizeof *out);
  if (len != REPLICA_REQUEST_BYTES)
    return replica__fail(err, err_bytes, -EINVAL, "request header of %zu bytes, expected %d", len,
                         REPLICA_REQUEST_BYTES);
  if (memcmp(buf, "ZDRP", 4) != 0)
    return replica__fail(err, err_bytes, -EINVAL, "bad magic (not a replica request)");
  uint32_t version = le_get32(buf + 4), op = le_get32(buf + 8);
  if (version != REPLICA_VERSION)
    return replica__fail(err, err_bytes, -EINVAL, "unsupported version %u (this node speaks %d)",
                         version, REPLICA_VERSION);
  if (op != REPLICA_OP_PUT && op != REPLICA_OP_GET && op != REPLICA_OP_FOLLOW)
    return replica__fail(err, err_bytes, -EINVAL, "unknown op %u", op);
  out->op = (int)op;
  out->job_id = le_get64(buf + 12);
  out->save_id = le_get64(buf + 20);
  out->bytes = le_get64(buf + 28);
  if (decode_name(buf + 36, out->name) != 0) {
    out->name[0] = '\0';
    return replica__fail(err, err_bytes, -EINVAL, "bad name (wanted " NAME_RULE ")");
  }
  if (op != REPLICA_OP_PUT && out->bytes != 0)
    return replica__fail(err, err_bytes, -EINVAL, "%s with bytes %llu (must be 0)",
                         op == REPLICA_OP_GET ? "GET" : "FOLLOW", (unsigned long long)out->bytes);
  if (out->bytes > REPLICA_MAX_FILE_BYTES)
    return replica__fail(err, err_bytes, -EFBIG, "file of %llu bytes is over the 64 GiB limit",
                         (unsigned long long)out->bytes);
  memcpy(out->key, buf + 100, REPLICA_KEY_BYTES);
  return 0;
}

void replica__reply_encode(uint8_t buf[REPLICA_REPLY_BYTES], int status, uint64_t bytes,
                           const char *message) {
  memset(buf, 0, REPLICA_REPLY_BYTES);
  le_put32(buf, (uint32_t)status);
  le_put64(buf + 4, bytes);
  memcpy(buf + 12, message, strnlen(message, REPLICA_MESSAGE_BYTES - 1));
}

/* ------------------------------------------------------------------------ */
/* Sockets                                                                  */
/* ------------------------------------------------------------------------ */

/* A timed-out SO_RCVTIMEO/SO_SNDTIMEO wait reads as EAGAIN. */
static int sock_errno(void) {
  return errno == EAGAIN || errno == EWOULDBLOCK ? -ETIMEDOUT : -errno;
}

int replica__send_all(int fd, const void *buf, size_t bytes) {
  const uint8_t *p = buf;
  while (bytes > 0) {
    ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return n < 0 ? sock_errno() : -EIO;
    p += n;
    bytes -= (size_t)n;
  }
  return 0;
}

/* -EPIPE when the peer closes first. */
int replica__recv_all(int fd, void *buf, size_t bytes) {
  uint8_t *p = buf;
  while (bytes > 0) {
    ssize_t n = recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return n < 0 ? sock_errno() : -EPIPE;
    p += n;
    bytes -= (size_t)n;
  }
  return 0;
}

void replica__sock_setup(int fd, int timeout_ms) {
  struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Splits "host:port" or "[v6]:port"; host may also be a bare v6 literal
 * when port is not wanted (port_out NULL). */
int replica__split_addr(const char *addr, char *host, size_t host_bytes, const char **port_out) {
  const char *end = strrchr(addr, ':'), *start = addr;
  if (addr[0] == '[') {
    const char *close = strchr(addr, ']');
    if (close == NULL || (port_out != NULL && close + 1 != end))
      return -EINVAL;
    start = addr + 1;
    end = close;
  } else if (port_out == NULL) {
    end = addr + strlen(addr);
  }
  if (end == NULL || end == start || (size_t)(end - start) >= host_bytes)
    return -EINVAL;
  memcpy(host, start, (size_t)(end - start));
  host[end - start] = '\0';
  if (port_out != NULL) {
    *port_out = end + (addr[0] == '[' ? 2 : 1);
    if (**port_out == '\0')
      return -EINVAL;
  }
  return 0;
}

/* One non-blocking connect, waited for at most timeout_ms. */
static int connect_one(const struct addrinfo *ai, int timeout_ms) {
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return -errno;
  int rc = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 ? 0 : -errno;
  if (rc == -EINPROGRESS) {
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int n;
    while ((n = poll(&p, 1, timeout_ms)) < 0 && errno == EINTR)
      ;
    int so = 0;
    socklen_t len = sizeof so;
    if (n == 0)
      rc = -ETIMEDOUT;
    else if (n < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &len) != 0)
      rc = -errno;
    else
      rc = -so;
  }
  if (rc == 0 && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
    rc = -errno;
  if (rc != 0) {
    close(fd);
    return rc;
  }
  replica__sock_setup(fd, timeout_ms);
  return fd;
}

/* A connected socket to addr (every address getaddrinfo gives, in turn),
 * or a negative errno with the reason in err. */
static int connect_addr(const char *addr, int timeout_ms, char *err, size_t err_bytes) {
  char host[256];
  const char *port;
  if (replica__split_addr(addr, host, sizeof host, &port) != 0)
    return replica__fail(err, err_bytes, -EINVAL, "bad address '%s' (want host:port)", addr);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res;
  int gai = getaddrinfo(host, port, &hints, &res);
  if (gai != 0)
    return replica__fail(err, err_bytes, -EHOSTUNREACH, "resolve %s: %s", addr, gai_strerror(gai));
  int fd = -EHOSTUNREACH;
  for (struct addrinfo *ai = res; ai != NULL && fd < 0; ai = ai->ai_next)
    fd = connect_one(ai, timeout_ms);
  freeaddrinfo(res);
  if (fd < 0)
    return replica__fail(err, err_bytes, fd, "connect %s: %s", addr, strerror(-fd));
  return fd;
}

/* ------------------------------------------------------------------------ */
/* Copies                                                                   */
/* ------------------------------------------------------------------------ */

/* Sends bytes of file_fd from offset 0. With watch, stops with -ECANCELED
 * as soon as the peer has something to say (an early refusal). *failed:
 * "read" or "send". */
static int send_file_chunks(int sock, int file_fd, uint64_t bytes, uint8_t *buf, int watch,
                            const char **failed);

int replica__send_file(int sock, int file_fd, uint64_t bytes, uint8_t *buf, int watch,
                       const char **failed) {
  /* sendfile has no MSG_NOSIGNAL: a peer gone raises SIGPIPE, blocked on
   * this thread meanwhile and taken back after, so that no process using
   * this file dies of it (the daemon ignores it anyway). */
  sigset_t pipe_set, old;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
  int rc = send_file_chunks(sock, file_fd, bytes, buf, watch, failed);
  if (!sigismember(&old, SIGPIPE)) {
    struct timespec none = {0, 0};
    while (sigtimedwait(&pipe_set, NULL, &none) > 0) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return rc;
}

static int send_file_chunks(int sock, int file_fd, uint64_t bytes, uint8_t *buf, int watch,
                            const char **failed) {
  for (uint64_t off = 0; off < bytes;) {
    struct pollfd p = {.fd = sock, .events = POLLIN};
    if (watch && poll(&p, 1, 0) > 0) {
      *failed = "send";
      return -ECANCELED;
    }
    size_t n = bytes - off < REPLICA_CHUNK_BYTES ? (size_t)(bytes - off) : REPLICA_CHUNK_BYTES;
    /* From the page cache to the socket, not through buf: a copy is a
     * pass over the whole state at every step (docs/redundancy.md). */
    off_t at = (off_t)off;
    ssize_t sent = sendfile(sock, file_fd, &at, n);
    if (sent < 0 && errno == EINTR)
      continue;
    if (sent < 0 && (errno == EINVAL || errno == ENOSYS)) {
      /* No sendfile for this pair: through buf. */
      int rc = fsutil_pread_all(file_fd, buf, n, off);
      if (rc != 0) {
        *failed = "read";
        return rc == 1 ? -EIO : rc; /* 1: the file shrank under us */
      }
      if ((rc = replica__send_all(sock, buf, n)) != 0) {
        *failed = "send";
        return rc;
      }
      sent = (ssize_t)n;
    } else if (sent < 0) {
      *failed = errno == EAGAIN || errno == EWOULDBLOCK || errno == EPIPE || errno == ECONNRESET ||
                        errno == ETIMEDOUT
                    ? "send"
                    : "read";
      return errno == EAGAIN || errno == EWOULDBLOCK ? -ETIMEDOUT : -errno;
    } else if (sent == 0) {
      *failed = "read";
      return -EIO; /* the file shrank under us */
    }
    off += (uint64_t)sent;
  }
  return 0;
}

/* Receives bytes into file_fd from offset 0. *failed: "receive" or
 * "write". */
/* Moves bytes from sock into file_fd at *off through a pipe (splice: the
 * socket's pages are not copied to user space on the way). 0, 1 when
 * splice cannot serve this pair (nothing consumed), or a negative errno
 * with *failed. */
static int splice_file(int sock, int file_fd, uint64_t bytes, uint64_t *off, const char **failed) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0)
    return 1;
  fcntl(pipe_fds[1], F_SETPIPE_SZ, REPLICA_CHUNK_BYTES);
  int rc = 0;
  while (*off < bytes && rc == 0) {
    size_t want = bytes - *off < REPLICA_CHUNK_BYTES ? (size_t)(bytes - *off) : REPLICA_CHUNK_BYTES;
    ssize_t in = splice(sock, NULL, pipe_fds[1], NULL, want, SPLICE_F_MOVE);
    if (in < 0 && errno == EINTR)
      continue;
    if (in < 0 && (errno == EINVAL || errno == ENOSYS) && *off == 0) {
      rc = 1;
      break;
    }
    if (in <= 0) {
      *failed = "receive";
      rc = in < 0 ? (errno == EAGAIN || errno == EWOULDBLOCK ? -ETIMEDOUT : -errno) : -EPIPE;
      break;
    }
    for (ssize_t left = in; left > 0 && rc == 0;) {
      loff_t at = (loff_t)*off;
      ssize_t out = splice(pipe_fds[0], NULL, file_fd, &at, (size_t)left, SPLICE_F_MOVE);
      if (out < 0 && errno == EINTR)
        continue;
      if (out <= 0) {
        *failed = "write";
        rc = out < 0 ? -errno : -EIO;
        break;
      }
      left -= out;
      *off += (uint64_t)out;
    }
  }
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  return rc;
}

int replica__recv_file(int sock, int file_fd, uint64_t bytes, uint8_t *buf, const char **failed) {
  uint64_t start = 0;
  int spliced = splice_file(sock, file_fd, bytes, &start, failed);
  if (spliced <= 0)
    return spliced;
  for (uint64_t off = start; off < bytes;) {
    size_t want = bytes - off < REPLICA_CHUNK_BYTES ? (size_t)(bytes - off) : REPLICA_CHUNK_BYTES;
    ssize_t n = recv(sock, buf, want, 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      *failed = "receive";
      return n < 0 ? sock_errno() : -EPIPE;
    }
    int rc = fsutil_pwrite_all(file_fd, buf, (size_t)n, off);
    if (rc != 0) {
      *failed = "write";
      return rc;
    }
    off += (uint64_t)n;
  }
  return 0;
}

/* Opens a new file with the file mode, made exact. */
int replica__create_file(const char *path, int flags) {
  int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | flags, filemode_file());
  if (fd < 0)
    return -errno;
  int rc = filemode_fix_file(fd);
  if (rc != 0) {
    close(fd);
    unlink(path);
    return rc;
  }
  return fd;
}

/* fsync, close, rename into place, fsync the directory; tmp is removed
 * on failure. *failed names the step. */
int replica__commit_file(int fd, const char *tmp, const char *path, const char *dir,
                         const char **failed) {
  int rc = 0;
  if (fsync(fd) != 0) {
    rc = -errno;
    *failed = "fsync";
  }
  if (close(fd) != 0 && rc == 0) {
    rc = -errno;
    *failed = "close";
  }
  if (rc == 0 && rename(tmp, path) != 0) {
    rc = -errno;
    *failed = "rename";
  }
  if (rc != 0) {
    unlink(tmp);
    return rc;
  }
  return fsutil_fsync_dir(dir, failed);
}

/* ------------------------------------------------------------------------ */
/* Client                                                                   */
/* ------------------------------------------------------------------------ */

static int bad_name(char *err, size_t err_bytes) {
  return replica__fail(err, err_bytes, -EINVAL, "bad name (wanted " NAME_RULE ")");
}

/* Connects and sends the request header. */
static int client_open(const char *addr, const replica_request *r, int timeout_ms, char *err,
                       size_t err_bytes) {
  int fd = connect_addr(addr, timeout_ms, err, err_bytes);
  if (fd < 0)
    return fd;
  uint8_t header[REPLICA_REQUEST_BYTES];
  replica_request_encode(r, header);
  int rc = replica__send_all(fd, header, sizeof header);
  if (rc != 0) {
    close(fd);
    return replica__fail(err, err_bytes, rc, "send to %s: %s", addr, strerror(-rc));
  }
  return fd;
}

/* Reads the reply: 0 with *status and *bytes, the peer's message in err
 * when the status is an error; or a negative errno of the reading. */
static int read_reply(int fd, const char *addr, int *status, uint64_t *bytes, char *err,
                      size_t err_bytes) {
  uint8_t reply[REPLICA_REPLY_BYTES];
  int rc = replica__recv_all(fd, reply, sizeof reply);
  if (rc != 0)
    return replica__fail(err, err_bytes, rc, "reply from %s: %s", addr,
                         rc == -EPIPE ? "connection closed" : strerror(-rc));
  *status = (int32_t)le_get32(reply);
  *bytes = le_get64(reply + 4);
  if (*status > 0 || *status < -4095 || *bytes > REPLICA_MAX_FILE_BYTES)
    return replica__fail(err, err_bytes, -EPROTO, "reply from %s: malformed", addr);
  if (*status != 0) {
    reply[REPLICA_REPLY_BYTES - 1] = 0;
    replica__fail(err, err_bytes, 0, "%s: %s", addr, (const char *)reply + 12);
  }
  return 0;
}

static int client_timeout(int timeout_ms) {
  return timeout_ms > 0 ? timeout_ms : DEFAULT_TIMEOUT_MS;
}

/* Sends the body and reads the reply; a refusal that comes while sending
 * wins over the send's own error. */
static int put_body(int sock, const char *addr, int file, uint64_t size, char *err,
                    size_t err_bytes) {
  uint8_t *buf = malloc(REPLICA_CHUNK_BYTES);
  if (buf == NULL)
    return replica__fail(err, err_bytes, -ENOMEM, "out of memory");
  const char *failed = "";
  int rc = replica__send_file(sock, file, size, buf, 1, &failed);
  free(buf);
  if (rc != 0 && strcmp(failed, "read") == 0)
    return replica__fail(err, err_bytes, rc, "read: %s", strerror(-rc));
  int status;
  uint64_t bytes;
  int rrc = read_reply(sock, addr, &status, &bytes, err, err_bytes);
  if (rrc == 0 && status != 0)
    return status;
  if (rrc == 0 && (rc == -ECANCELED || bytes != size))
    return replica__fail(err, err_bytes, -EPROTO, "reply from %s: success before the whole file",
                         addr);
  if (rc != 0)
    return replica__fail(err, err_bytes, rc, "send to %s: %s", addr, strerror(-rc));
  return rrc;
}

int replica_put(const char *addr, const uint8_t key[REPLICA_KEY_BYTES], uint64_t job_id,
                uint64_t save_id, const char *name, const char *path, int timeout_ms, char *err,
                size_t err_bytes) {
  replica_request r = {.op = REPLICA_OP_PUT, .job_id = job_id, .save_id = save_id};
  if (!replica_name_valid(name))
    return bad_name(err, err_bytes); /* before connecting */
  strcpy(r.name, name);
  memcpy(r.key, key, REPLICA_KEY_BYTES);
  int file = open(path, O_RDONLY | O_CLOEXEC);
  struct stat st;
  if (file < 0 || fstat(file, &st) != 0) {
    int rc = -errno;
    if (file >= 0)
      close(file);
    return replica__fail(err, err_bytes, rc, "%s: %s", path, strerror(-rc));
  }
  r.bytes = (uint64_t)st.st_size;
  int rc = r.bytes > REPLICA_MAX_FILE_BYTES
               ? replica__fail(err, err_bytes, -EFBIG, "%s: over the 64 GiB limit", path)
               : client_open(addr, &r, client_timeout(timeout_ms), err, err_bytes);
  if (rc >= 0) {
    int sock = rc;
    rc = put_body(sock, addr, file, r.bytes, err, err_bytes);
    close(sock);
  }
  close(file);
  OPENSSL_cleanse(r.key, sizeof r.key);
  return rc;
}

/* Receives the file into dest_path.tmp and renames it into place. */
static int get_body(int sock, uint64_t bytes, const char *dest_path, char *err, size_t err_bytes) {
  char tmp[PATH_MAX], dir[PATH_MAX];
  if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", dest_path) >= sizeof tmp)
    return replica__fail(err, err_bytes, -ENAMETOOLONG, "%s: path too long", dest_path);
  snprintf(dir, sizeof dir, "%s", dest_path);
  char *slash = strrchr(dir, '/');
  if (slash == NULL)
    strcpy(dir, ".");
  else
    slash[slash == dir ? 1 : 0] = '\0';
  uint8_t *buf = malloc(REPLICA_CHUNK_BYTES);
  int file = buf != NULL ? replica__create_file(tmp, O_TRUNC) : -ENOMEM;
  if (file < 0) {
    free(buf);
    return replica__fail(err, err_bytes, file, "create %s: %s", tmp, strerror(-file));
  }
  const char *failed = "";
  int rc = replica__recv_file(sock, file, bytes, buf, &failed);
  free(buf);
  if (rc != 0) {
    close(file);
    unlink(tmp);
    return replica__fail(err, err_bytes, rc, "%s %s: %s", failed, dest_path,
                         rc == -EPIPE ? "the peer closed before the whole file" : strerror(-rc));
  }
  if ((rc = replica__commit_file(file, tmp, dest_path, dir, &failed)) != 0)
    return replica__fail(err, err_bytes, rc, "%s %s: %s", failed, dest_path, strerror(-rc));
  return 0;
}

int replica_get(const char *addr, const uint8_t key[REPLICA_KEY_BYTES], uint64_t job_id,
                uint64_t save_id, const char *name, const char *dest_path, int timeout_ms,
                char *err, size_t err_bytes) {
  replica_request r = {.op = REPLICA_OP_GET, .job_id = job_id, .save_id = save_id};
  if (!replica_name_valid(name))
    return bad_name(err, err_bytes); /* before connecting */
  strcpy(r.name, name);
  memcpy(r.key, key, REPLICA_KEY_BYTES);
  int sock = client_open(addr, &r, client_timeout(timeout_ms), err, err_bytes);
  OPENSSL_cleanse(r.key, sizeof r.key);
  if (sock < 0)
    return sock;
  int status;
  uint64_t bytes;
  int rc = read_reply(sock, addr, &status, &bytes, err, err_bytes);
  if (rc == 0)
    rc = status != 0 ? status : get_body(sock, bytes, dest_path, err, err_bytes);
  close(sock);
  return rc;
}

int replica_follow_open(const char *addr, int timeout_ms, int *fd, char *err, size_t err_bytes) {
  replica_request r = {.op = REPLICA_OP_FOLLOW};
  strcpy(r.name, "follow");
  int sock = client_open(addr, &r, client_timeout(timeout_ms), err, err_bytes);
  if (sock < 0)
    return sock;
  int status;
  uint64_t bytes;
  int rc = read_reply(sock, addr, &status, &bytes, err, err_bytes);
  if (rc == 0 && status != 0)
    rc = status;
  if (rc != 0) {
    close(sock);
    return rc;
  }
  *fd = sock;
  return 0;
}
