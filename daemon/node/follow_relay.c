/* follow_relay: the hosting node's side of a follower (docs/subscribe.md,
 * "Across nodes"): a FOLLOW connection of the replica transport carries
 * the IPC frames of one read-only session, which this relay passes to the
 * daemon's own Unix socket and back, on the connection's thread.
 *
 * The relay is a client of its own daemon, so the session it carries is an
 * ordinary read-only session: the daemon checks its token, pins its
 * versions, parks its watches and counts it in the job's quotas, exactly as
 * for a local reader. What the relay adds is what a TCP stream cannot
 * carry: a GATHER's buffer travels as a descriptor locally, so the relay
 * maps it and sends its bytes after the reply (a u64 length, then the
 * blocks a delta gather wrote, in block order, or the whole buffer).
 *
 * It passes only what a read-only session needs (ATTACH first, read-only
 * and not creating; then UNITS, WATCH, GATHER, RELEASE, PIN, DETACH), both
 * ways at once (a follower keeps its next gather in flight while the
 * bytes of the last are sent), and stops at the first frame it would not
 * pass, a broken stream, or the daemon going away. */
#include "follow.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon.h"
#include "frame.h"
#include "little_endian.h"
#include "log.h"
#include "pin.h"
#include "replica_net_impl.h"

/* How long the relay waits on a silent side: a follower sends a WATCH at
 * least every FOLLOW_MAX_WATCH_MS, which the daemon answers within it. */
#define RELAY_IPC_TIMEOUT_MS (FOLLOW_MAX_WATCH_MS + 60000)
#define RELAY_IDLE_MS        RELAY_IPC_TIMEOUT_MS
#define RELAY_MAX_BUFFERS    4096

typedef struct relay_map {
  uint32_t id;
  uint8_t *base;
  size_t bytes;
} relay_map;

typedef struct relay {
  int net, ipc;
  zd_frame_reader net_reader, ipc_reader;
  relay_map *maps;
  size_t nmaps;
  int attached;
  char job[ZD_MAX_JOB_NAME_BYTES + 1];
} relay;

static int connect_ipc(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path)
    return -ENAMETOOLONG;
  strcpy(addr.sun_path, path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -errno;
  if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
    int rc = -errno;
    close(fd);
    return rc;
  }
  replica__sock_setup(fd, RELAY_IPC_TIMEOUT_MS);
  return fd;
}

/* Sends a frame as received (payload may be NULL), with no descriptor. */
static int send_raw(int sock, const zd_frame_header *h, const uint8_t *payload) {
  zd_frame_header out = *h;
  out.fd_count = 0;
  uint8_t header[ZD_FRAME_HEADER_BYTES];
  zd_frame_header_encode(&out, header);
  int rc = replica__send_all(sock, header, sizeof header);
  if (rc == 0 && h->payload_bytes > 0)
    rc = replica__send_all(sock, payload, h->payload_bytes);
  return rc;
}

/* An Error frame to the follower, for a request the relay will not pass. */
static void send_refusal(relay *r, uint64_t request_id, const char *message) {
  Zerod__V1__Error e = ZEROD__V1__ERROR__INIT;
  e.status = ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT;
  e.message = (char *)message;
  zd_frame_send(r->net, ZEROD__V1__MSG_TYPE__MSG_ERROR, request_id, 0, &e.base, NULL, 0, 1000);
  LOG_WARNF("follower refused", "job=%s reason=\"%s\"", r->job, message);
}

/* Whether the follower may send this request now; why not in why. */
static int passable(relay *r, const zd_frame_header *h, const uint8_t *payload, const char **why) {
  ProtobufCMessage *msg = NULL;
  if (h->flags != 0 || h->fd_count != 0) {
    *why = "a follower's requests carry no flags and no descriptors";
    return 0;
  }
  if (h->type == ZEROD__V1__MSG_TYPE__MSG_ATTACH) {
    if (r->attached) {
      *why = "one ATTACH per follower connection";
      return 0;
    }
    if (zd_msg_unpack(h->type, payload, h->payload_bytes, &msg, why) != 0)
      return 0;
    Zerod__V1__AttachRequest *a = (Zerod__V1__AttachRequest *)msg;
    int ok = a->mode == ZEROD__V1__ATTACH_MODE__ATTACH_READ_ONLY && !a->create;
    snprintf(r->job, sizeof r->job, "%s", a->job);
    protobuf_c_message_free_unpacked(msg, NULL);
    *why = "a follower attaches read-only and creates nothing";
    return ok;
  }
  if (!r->attached) {
    *why = "a follower attaches first";
    return 0;
  }
  switch (h->type) {
  case ZEROD__V1__MSG_TYPE__MSG_UNITS:
  case ZEROD__V1__MSG_TYPE__MSG_GATHER:
  case ZEROD__V1__MSG_TYPE__MSG_RELEASE:
  case ZEROD__V1__MSG_TYPE__MSG_PIN:
  case ZEROD__V1__MSG_TYPE__MSG_DETACH:
    return 1;
  case ZEROD__V1__MSG_TYPE__MSG_WATCH:
    if (zd_msg_unpack(h->type, payload, h->payload_bytes, &msg, why) != 0)
      return 0;
    int ok = ((Zerod__V1__WatchVersionRequest *)msg)->timeout_ms <= FOLLOW_MAX_WATCH_MS;
    protobuf_c_message_free_unpacked(msg, NULL);
    *why = "a follower's WATCH waits at most 60 s";
    return ok;
  default:
    *why = "not a request of a read-only session";
    return 0;
  }
}

static relay_map *map_of(relay *r, uint32_t id) {
  for (size_t i = 0; i < r->nmaps; i++)
    if (r->maps[i].id == id)
      return &r->maps[i];
  return NULL;
}

static void unmap(relay *r, uint32_t id) {
  relay_map *m = map_of(r, id);
  if (m == NULL)
    return;
  munmap(m->base, m->bytes);
  *m = r->maps[--r->nmaps];
}

/* The buffer of a GatherReply, mapped from its descriptor the first time. */
static relay_map *reply_buffer(relay *r, const Zerod__V1__GatherReply *g, int fd) {
  relay_map *m = map_of(r, g->buffer_id);
  if (m != NULL)
    return m->bytes == g->buffer_bytes ? m : NULL;
  if (fd < 0 || r->nmaps == RELAY_MAX_BUFFERS || g->buffer_bytes == 0)
    return NULL;
  void *base = mmap(NULL, g->buffer_bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED)
    return NULL;
  relay_map *grown = realloc(r->maps, (r->nmaps + 1) * sizeof *grown);
  if (grown == NULL) {
    munmap(base, g->buffer_bytes);
    return NULL;
  }
  r->maps = grown;
  m = &r->maps[r->nmaps++];
  *m = (relay_map){.id = g->buffer_id, .base = base, .bytes = g->buffer_bytes};
  return m;
}

size_t follow_nblocks(const Zerod__V1__GatherReply *g) {
  size_t block = g->block_bytes ? g->block_bytes : PIN_DELTA_BLOCK_BYTES;
  return (g->buffer_bytes + block - 1) / block;
}

size_t follow_block_span(const Zerod__V1__GatherReply *g, size_t b, size_t *at) {
  size_t block = g->block_bytes ? g->block_bytes : PIN_DELTA_BLOCK_BYTES;
  int listed = b / 8 < g->changed_blocks.len && (g->changed_blocks.data[b / 8] >> (b % 8)) & 1;
  *at = b * block;
  if ((g->delta && !listed) || *at >= g->buffer_bytes)
    return 0;
  return g->buffer_bytes - *at < block ? g->buffer_bytes - *at : block;
}

uint64_t follow_gathered_bytes(const Zerod__V1__GatherReply *g) {
  uint64_t total = 0;
  size_t at;
  for (size_t b = 0; b < follow_nblocks(g); b++)
    total += follow_block_span(g, b, &at);
  return total;
}

/* The bytes of a gather after its reply, behind their u64 length. */
static int send_gathered(relay *r, const Zerod__V1__GatherReply *g, const relay_map *m) {
  uint8_t length[8];
  le_put64(length, follow_gathered_bytes(g));
  int rc = replica__send_all(r->net, length, sizeof length);
  for (size_t b = 0, at, n; rc == 0 && b < follow_nblocks(g); b++)
    if ((n = follow_block_span(g, b, &at)) > 0)
      rc = replica__send_all(r->net, m->base + at, n);
  return rc;
}

/* A GatherReply: dropped buffers unmapped, the reply passed on without its
 * descriptor, then the buffer's bytes. */
static int pass_gather_reply(relay *r, const zd_frame_header *h, const uint8_t *payload, int fd) {
  ProtobufCMessage *msg = NULL;
  const char *why = NULL;
  if (zd_msg_unpack(h->type, payload, h->payload_bytes, &msg, &why) != 0)
    return -EPROTO;
  Zerod__V1__GatherReply *g = (Zerod__V1__GatherReply *)msg;
  for (size_t i = 0; i < g->n_dropped_buffer_ids; i++)
    unmap(r, g->dropped_buffer_ids[i]);
  relay_map *m = g->cuda == NULL ? reply_buffer(r, g, fd) : NULL;
  int rc = m == NULL ? -EPROTO : send_raw(r->net, h, payload);
  if (rc == 0)
    rc = send_gathered(r, g, m);
  protobuf_c_message_free_unpacked(msg, NULL);
  return rc;
}

/* One frame of the daemon's to the follower: a GatherReply with its
 * buffer's bytes, anything else as it is. 0, or -1 to stop. */
static int pass_daemon_frame(relay *r) {
  const char *why = NULL;
  int rc = zd_frame_read(&r->ipc_reader, r->ipc, &why);
  if (rc <= 0)
    return rc == 0 ? 0 : -1;
  zd_frame_header h;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  zd_frame_reader_take(&r->ipc_reader, &h, &payload, fds, &nfds);
  if (h.type == ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY)
    rc = pass_gather_reply(r, &h, payload, nfds > 0 ? fds[0] : -1);
  else
    rc = send_raw(r->net, &h, payload);
  for (unsigned i = 0; i < nfds; i++)
    close(fds[i]);
  if (rc == 0 && h.type == ZEROD__V1__MSG_TYPE__MSG_ATTACH_REPLY)
    r->attached = 1;
  free(payload);
  return rc == 0 ? 0 : -1;
}

/* One request of the follower's, passed to the daemon. 0, or -1 to stop
 * (a request the relay does not pass, a broken stream). */
static int pass_follower_frame(relay *r) {
  const char *why = NULL;
  zd_frame_header h;
  uint8_t *payload;
  int rc = zd_frame_read_plain(&r->net_reader, r->net, &h, &payload, &why);
  if (rc <= 0)
    return rc == 0 ? 0 : -1;
  if (!passable(r, &h, payload, &why)) {
    send_refusal(r, h.request_id, why);
    free(payload);
    return -1;
  }
  rc = send_raw(r->ipc, &h, payload);
  free(payload);
  return rc == 0 ? 0 : -1;
}

/* Both ways at once, so that a follower's next gather is on its way to
 * the daemon (which copies it) while this one's bytes are being sent: until
 * either side goes, or the follower is silent for RELAY_IDLE_MS. A DETACH
 * is passed on, and the daemon's answer to it ends the session. */
static void relay_loop(relay *r) {
  for (;;) {
    struct pollfd p[2] = {{.fd = r->net, .events = POLLIN}, {.fd = r->ipc, .events = POLLIN}};
    int n = poll(p, 2, RELAY_IDLE_MS);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return;
    if (p[1].revents) {
      do {
        if (pass_daemon_frame(r) != 0)
          return;
      } while (zd_frame_reader_pending(&r->ipc_reader));
    }
    if (p[0].revents) {
      do {
        if (pass_follower_frame(r) != 0)
          return;
      } while (zd_frame_reader_pending(&r->net_reader));
    }
  }
}

void follow_relay(void *ctx, int fd) {
  zdaemon *d = ctx;
  relay r = {.net = fd, .ipc = connect_ipc(d->options.socket_path)};
  if (r.ipc < 0) {
    LOG_WARNF("follower refused", "reason=\"cannot reach this daemon's socket: %s\"",
              strerror(-r.ipc));
    return;
  }
  zd_frame_reader_init(&r.net_reader);
  zd_frame_reader_init(&r.ipc_reader);
  LOG_INFOF("follower connected", "fd=%d", fd);
  relay_loop(&r);
  LOG_INFOF("follower gone", "job=%s", r.job);
  close(r.ipc);
  while (r.nmaps > 0)
    unmap(&r, r.maps[0].id);
  free(r.maps);
  zd_frame_reader_reset(&r.net_reader);
  zd_frame_reader_reset(&r.ipc_reader);
}
