/* replica_net_impl: what the replica transport's client and codec
 * (replica_net.c) share with its server (replica_server.c): the error
 * text, whole sends and receives on sockets with timeouts, the copies
 * between a file and a socket, and the steps of a file made durable. */
#ifndef ZEROD_REPLICA_NET_IMPL_H
#define ZEROD_REPLICA_NET_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "replica_net.h"

/* Files are copied through a buffer of this size. */
#define REPLICA_CHUNK_BYTES (1u << 20)

/* Formats err (if not NULL) and returns rc. */
int replica__fail(char *err, size_t err_bytes, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void replica__reply_encode(uint8_t buf[REPLICA_REPLY_BYTES], int status, uint64_t bytes,
                           const char *message);

/* Whole transfers on a socket, going on after EINTR and short ones: 0,
 * -ETIMEDOUT once a wait passes the socket's timeout, -EPIPE when the
 * peer closes before the end (recv), or a negative errno. Never SIGPIPE. */
int replica__send_all(int fd, const void *buf, size_t bytes);
int replica__recv_all(int fd, void *buf, size_t bytes);
/* SO_RCVTIMEO and SO_SNDTIMEO of timeout_ms, TCP_NODELAY. */
void replica__sock_setup(int fd, int timeout_ms);
/* Splits "host:port" or "[v6]:port" (port_out NULL: addr is a host
 * alone, a v6 literal with or without brackets). 0 or -EINVAL. */
int replica__split_addr(const char *addr, char *host, size_t host_bytes, const char **port_out);

/* The copies, from offset 0, through buf (REPLICA_CHUNK_BYTES). With
 * watch, send_file stops with -ECANCELED once the peer has something to
 * say. *failed names the side that failed: "read" or "send", "receive"
 * or "write". */
int replica__send_file(int sock, int file_fd, uint64_t bytes, uint8_t *buf, int watch,
                       const char **failed);
int replica__recv_file(int sock, int file_fd, uint64_t bytes, uint8_t *buf, const char **failed);
/* Opens path for writing with the file mode, made exact: an fd or a
 * negative errno. flags: O_EXCL or O_TRUNC. */
int replica__create_file(const char *path, int flags);
/* fsync, close, rename tmp to path, fsync dir; tmp is removed if the
 * rename was not reached. 0 or a negative errno, *failed the step. */
int replica__commit_file(int fd, const char *tmp, const char *path, const char *dir,
                         const char **failed);

#endif /* ZEROD_REPLICA_NET_IMPL_H */
