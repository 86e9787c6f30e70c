/* replica_net: the node-to-node transport of in-memory checkpoint replicas
 * (docs/protocol.md, "Replica transport"). Each node runs a small TCP
 * server over its replica directory (root/<job_id>/<save_id>/<name>); a
 * node pushes a copy of its shard files to a buddy with replica_put and,
 * after a failure, fetches what it lacks with replica_get.
 *
 * One request per connection, authenticated by the job's key (32 bytes
 * that only the job's nodes know), compared in constant time. The server
 * is plain POSIX: one accept thread and one detached thread per
 * connection, at most REPLICA_MAX_CONNS at once (more wait in the
 * listen backlog). The client calls block; timeout_ms bounds every wait
 * (the connect, each send and each receive), so a peer that stalls or dies
 * is an error, never a hang, while a large transfer that keeps moving
 * takes as long as it needs. Neither side ever leaves a partial file
 * under its final name. */
#ifndef ZEROD_REPLICA_NET_H
#define ZEROD_REPLICA_NET_H

#include <stddef.h>
#include <stdint.h>

#define REPLICA_KEY_BYTES  32
#define REPLICA_NAME_BYTES 64 /* the name field; names are 1 to 63 bytes */
#define REPLICA_MAX_CONNS  16
/* A PUT larger than this is refused (64 GiB). */
#define REPLICA_MAX_FILE_BYTES (64ull << 30)

/* The wire: a request header, then (PUT) the file; a reply header, then
 * (GET) the file. Sizes in bytes. */
#define REPLICA_REQUEST_BYTES 132 /* magic, version, op, 3 x u64, name, key */
#define REPLICA_REPLY_BYTES   212 /* status, bytes, message */
#define REPLICA_MESSAGE_BYTES 200
#define REPLICA_VERSION       1

enum { REPLICA_OP_PUT = 1, REPLICA_OP_GET = 2, REPLICA_OP_FOLLOW = 3 };
/* FOLLOW connections a server serves at once (each holds a connection
 * slot for as long as its follower follows). */
#define REPLICA_MAX_FOLLOWS 8

typedef struct replica_server replica_server;

/* The key of job_id, if this node knows the job: 0 and key filled, else
 * -ENOENT. Called from connection threads (the callee locks). */
typedef int (*replica_key_fn)(void *ctx, uint64_t job_id, uint8_t key[REPLICA_KEY_BYTES]);

/* Listens on host:port (port 0: any; host NULL: 127.0.0.1; an IPv6
 * literal with or without brackets); files live under
 * root/<job_id>/<save_id>/<name>; root must exist. Directories are made
 * with the directory mode and files with the file mode (filemode.h:
 * 0700 and 0600 unless the operator says otherwise). Returns 0, or a
 * negative errno with the reason in err. */
int replica_server_start(const char *host, int port, const char *root, replica_key_fn key_fn,
                         void *ctx, replica_server **out, char *err, size_t err_bytes);
int replica_server_port(const replica_server *s);
/* FOLLOW (docs/subscribe.md, "Across nodes"): after the header (name
 * "follow", bytes 0, no key: what admits the follower is the job token in
 * the stream) and an OK reply, the connection carries a read-only IPC
 * session, relayed by fn on the connection's thread until it returns
 * (follow_relay.c). Without fn a FOLLOW is refused. Set once, before
 * followers come. */
typedef void (*replica_follow_fn)(void *ctx, int fd);
void replica_server_set_follow(replica_server *s, replica_follow_fn fn, void *ctx);
/* Stops accepting, shuts every connection down, waits for its threads. */
void replica_server_stop(replica_server *s);

/* Sends the file at path to addr ("host:port", "[v6]:port") as
 * root/<job_id>/<save_id>/<name> there; returns once the peer has it
 * durably renamed into place (0) or an error (-errno; the peer's reason
 * in err, e.g. "bad key"). A bad name is refused before connecting
 * (-EINVAL); an unknown job or a wrong key is -EACCES, a stalled peer
 * -ETIMEDOUT, one that closes midway -EPIPE. */
int replica_put(const char *addr, const uint8_t key[REPLICA_KEY_BYTES], uint64_t job_id,
                uint64_t save_id, const char *name, const char *path, int timeout_ms, char *err,
                size_t err_bytes);
/* Fetches root/<job_id>/<save_id>/<name> from addr into dest_path
 * (written to dest_path.tmp, fsynced, renamed; removed on failure);
 * -ENOENT if the peer does not have it, other errors as replica_put's. */
int replica_get(const char *addr, const uint8_t key[REPLICA_KEY_BYTES], uint64_t job_id,
                uint64_t save_id, const char *name, const char *dest_path, int timeout_ms,
                char *err, size_t err_bytes);

/* Opens a FOLLOW connection to addr: 0 with *fd (blocking, every wait
 * bounded by timeout_ms) once the peer accepted it, or a negative errno
 * with the peer's reason in err. */
int replica_follow_open(const char *addr, int timeout_ms, int *fd, char *err, size_t err_bytes);

/* A request header. */
typedef struct replica_request {
  int op;
  uint64_t job_id, save_id, bytes;
  char name[REPLICA_NAME_BYTES];
  uint8_t key[REPLICA_KEY_BYTES];
} replica_request;

/* 1 if name may be a replica file's name: [A-Za-z0-9._-]{1,63}, no "..",
 * not starting with '.'. */
int replica_name_valid(const char *name);
/* Writes r as REPLICA_REQUEST_BYTES bytes; the caller checks the name. */
void replica_request_encode(const replica_request *r, uint8_t buf[REPLICA_REQUEST_BYTES]);
/* The request header's decoder (outside bytes: fuzzed). buf must hold
 * exactly REPLICA_REQUEST_BYTES. Returns 0, -EFBIG for a PUT over
 * REPLICA_MAX_FILE_BYTES, or -EINVAL with the reason in err (bad magic,
 * version, op, name, or a GET with bytes). */
int replica_request_decode(const uint8_t *buf, size_t len, replica_request *out, char *err,
                           size_t err_bytes);

#endif /* ZEROD_REPLICA_NET_H */
