/* client_impl.h: what the files of libzerod share; not installed.
 *
 * From the top down: a file calls only files below it (no call cycles;
 * layout.cycles checks the built objects).
 *
 *   client.c         connect and close (zd_close detaches what is left)
 *   client_step.c    steps, parameter groups, gradient norms, checkpoints,
 *                    detach
 *   client_buffer.c  buffer mappings and views, gathers, gradient buffers,
 *                    reduces, GPU buffers' ordering
 *   client_unit.c    stable address ranges, registration, pins, loads and
 *                    state reads
 *   client_attach.c  attach, the job handle's accessors and unit table
 *   client_conn.c    the connection: requests, replies, the stash,
 *                    deferred errors, a lost connection
 *   client_status.c  the one table between the wire's Status codes and
 *                    zd_status, and zd_strerror
 *   client_sized.c   structs that carry their size (struct_size): reading
 *                    the caller's inputs, writing its outputs
 *   client_base.c    the last error, dtypes, fds and mappings released,
 *                    the CUDA module
 *
 * The types below are the library's state; the client__ functions are its
 * helpers, defined in the file their section names. */
#ifndef ZEROD_CLIENT_IMPL_H
#define ZEROD_CLIENT_IMPL_H

#include "zerod.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "cuda/zk_cuda.h"
#include "frame.h"

/* The longest message a failed call leaves for zd_last_error. */
#define LAST_ERROR_BYTES 1024

/* ------------------------------------------------------------------------
 * Types
 * ------------------------------------------------------------------------ */

/* A frame read while waiting for another request's reply, kept for the
 * caller that waits for it (an asynchronous gather). */
typedef struct stashed_frame {
  struct stashed_frame *next;
  zd_frame_header header;
  uint8_t *payload;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
} stashed_frame;

/* Gathered buffers are mapped read-only and gradient buffers read-write, so
 * the two kinds are cached apart; a daemon that numbered both kinds from the
 * same counter, or from separate ones, is served correctly either way. */
typedef enum buffer_kind { BUFFER_GATHERED = 0, BUFFER_GRAD = 1 } buffer_kind;

/* One buffer the daemon sent. Usually it is mapped once (base) and its
 * descriptor closed. A stable-address job's gathered buffers are instead
 * mapped into each unit's own range at every gather, so their descriptor is
 * kept (fd) and base is NULL. A GPU buffer is opened once from its CUDA IPC
 * handles: base is then the device pointer in this process, device the
 * daemon's ordinal and event the buffer's interprocess event. Any entry
 * lives until the daemon lists the buffer as dropped, or until zd_close (a
 * GPU buffer's: until zd_detach). */
typedef struct buffer_mapping {
  buffer_kind kind;
  uint32_t buffer_id;
  void *base;
  size_t bytes;
  int fd;      /* -1 unless kept */
  int device;  /* GPU buffer: the CUDA ordinal; -1 for shared memory */
  void *event; /* GPU buffer: the opened cudaEvent_t */
  int held;    /* scratch of forget_dropped_buffers */
} buffer_mapping;

/* A reply's CudaBuffer, copied out before the reply is freed. */
typedef struct cuda_handles {
  int present;
  int device;
  uint8_t mem_handle[ZK_CUDA_IPC_HANDLE_BYTES];
  uint8_t event_handle[ZK_CUDA_IPC_HANDLE_BYTES];
} cuda_handles;

/* What this client knows of a unit (registered or listed): the placements,
 * and three tensor tables: gathered and gradient, whose data pointers are
 * filled in by each gather / grad_buffer call, and the layout handed out by
 * zd_job_unit_info, whose data pointers stay NULL. The names and shapes are
 * owned here and shared by all tables. */
typedef struct client_unit {
  zd_unit unit_id;
  char *name;
  unsigned ntensors;
  uint64_t numel;
  uint64_t padded_numel;
  zd_dtype working_dtype;
  zd_dtype grad_dtype;
  char **tensor_names;
  uint64_t *shapes; /* every tensor's dims, back to back */
  zd_tensor_view *gather_tensors;
  zd_tensor_view *grad_tensors;
  zd_tensor_view *info_tensors;
  /* The buffers behind the views handed out and still valid by contract:
   * the gathered one until zd_release, the gradient one until zd_reduce
   * (0: none). A buffer named here is never unmapped when dropped. */
  uint32_t held_gather_buffer;
  uint32_t held_grad_buffer;
  /* Whether the daemon holds the unit gathered for this session, as far as
   * the library can tell: a gather's reply was taken and no release or
   * restore came since. zd_release refuses a unit known not to be held
   * itself (the daemon would refuse it too, but only after the call had
   * returned); GATHER_HOLD_UNSURE, after a restore that failed, sends the
   * release and lets the daemon decide. */
  enum { GATHER_HOLD_NONE = 0, GATHER_HOLD_HELD, GATHER_HOLD_UNSURE } gather_hold;
  /* Stable-address jobs: the unit's reserved range, page-rounded to its
   * gathered layout (NULL until reserved). While the unit is gathered it
   * maps held_gather_buffer; otherwise it is PROT_NONE anonymous memory. */
  void *stable_base;
  size_t stable_bytes;
  /* The blocks the last delta gather wrote (zd_delta.changed), or NULL. */
  uint8_t *delta_bits;
} client_unit;

/* What a delta gather's reply said (client_buffer.c to client_watch.c). */
typedef struct client_delta {
  int delta;
  uint64_t from;
  uint32_t block_bytes;
  const uint8_t *bits;
  size_t bits_bytes;
} client_delta;
/* zd_gather_async and zd_gather_wait, with a delta gather (delta != NULL:
 * its answer). */
zd_status client__gather_async(zd_job *job, zd_unit unit_id, int delta, zd_pending *out);
zd_status client__gather_wait(zd_job *job, const zd_pending *pending, zd_view *out,
                              client_delta *delta);

struct zd_job {
  zd_client *client;
  struct zd_job *next; /* the client's list of jobs, freed by zd_close */
  char *name;
  int attached;
  int read_only;
  int pinned; /* read-only and serving one version: `version` is it */
  int stable_addresses;
  unsigned rank;
  unsigned world_size;
  uint64_t version;
  double loss_scale;    /* for the next step's loss; 0: none */
  zd_job_config config; /* the job's, as the attach reply had it */
  char *attach_warning; /* AttachReply.warning; NULL if none */
  client_unit *units;   /* sorted by unit id */
  size_t unit_count;
  size_t unit_capacity;
  zd_unit *changed; /* zd_watch's last list of units (zd_update.changed) */
};

/* Requests sent without a reply (releases, asynchronous reduces) are
 * remembered for a while, only so that an error answering one can name the
 * request and unit it was about. */
#define NO_REPLY_RING 64

struct zd_client {
  int sock;
  int dead;
  char dead_reason[LAST_ERROR_BYTES];
  zd_status dead_status; /* what calls on a dead client return; 0: ZD_E_UNAVAILABLE */
  uint64_t next_request_id;
  zd_frame_reader reader;

  /* Ids of requests whose reply has not been consumed yet. */
  uint64_t *expected_ids;
  size_t expected_count;
  size_t expected_capacity;
  stashed_frame *stash_head;

  struct {
    uint64_t request_id;
    zd_unit unit;
    const char *kind; /* "release", "reduce" */
  } no_reply[NO_REPLY_RING];
  unsigned no_reply_next;

  zd_status deferred_status; /* ZD_OK when there is none */
  char deferred_message[LAST_ERROR_BYTES];

  buffer_mapping *mappings;
  size_t mapping_count;
  size_t mapping_capacity;

  zd_job *jobs;

  /* Nanoseconds spent in client__wait since the last STEP went out: the
   * worker's stalls on the daemon, sent with the next STEP
   * (StepRequest.worker_wait_ns) for its exposed-communication figures. */
  uint64_t wait_ns;
};

/* ------------------------------------------------------------------------
 * Helpers, by the file that defines them
 * ------------------------------------------------------------------------ */

/* client_attach.c: the job handle and its unit table */
void client__job_free(zd_job *job);
void client__unit_free(client_unit *unit);
zd_status client__job_check(const zd_job *job, const char *what);
zd_status client__job_check_writable(const zd_job *job, const char *what);
client_unit *client__job_find_unit(zd_job *job, zd_unit unit_id);
void client__job_insert_unit(zd_job *job, const client_unit *unit);
zd_status client__job_reserve_units(zd_job *job, size_t more, const char *what);
zd_status client__unit_call_begin(zd_job *job, zd_unit unit_id, const char *verb, int writable,
                                  char *what, size_t what_bytes, client_unit **unit);

/* client_unit.c: stable address ranges */
zd_status client__unit_cover_range(client_unit *unit, const char *what);
uint64_t client__unit_gathered_bytes(const client_unit *unit);
zd_status client__unit_reserve_range(client_unit *unit, const char *what);

/* client_buffer.c: GPU buffers */
void client__close_cuda_buffers(zd_client *client);

/* client_conn.c: the connection */
zd_status client__call(zd_client *client, uint16_t type, const ProtobufCMessage *request,
                       const int *fds, unsigned nfds, uint16_t reply_type, const char *what,
                       ProtobufCMessage **reply, int *reply_fds, unsigned *reply_nfds);
zd_status client__send(zd_client *client, uint16_t type, const ProtobufCMessage *msg,
                       const int *fds, unsigned nfds, int expect_reply, const char *what,
                       uint64_t *request_id_out);
zd_status client__wait(zd_client *client, uint64_t request_id, uint16_t reply_type,
                       const char *what, ProtobufCMessage **reply, int *fds, unsigned *nfds);
zd_status client__finish(zd_client *client);
zd_status client__protocol_error(zd_client *client, const char *what, const char *format, ...)
    __attribute__((format(printf, 3, 4)));
/* The error of a call on a lost connection: its status and reason. */
zd_status client__dead_error(const zd_client *client, const char *what);
int client__expected_find(const zd_client *client, uint64_t request_id);
/* Closes the socket and frees what the connection holds (the stash, the
 * ids of requests waiting for replies). */
void client__conn_close(zd_client *client);

/* client_status.c */
zd_status client__status_from_wire(int wire_status);
int client__status_to_wire(zd_status status);

/* client_sized.c. SIZED_THROUGH(type, field) is the struct_size of a
 * caller's struct that ends with `field`: the least a call accepts where
 * the fields up to it are needed. */
#define SIZED_THROUGH(type, field) (offsetof(type, field) + sizeof(((type *)0)->field))
zd_status client__copy_sized_struct(void *dst, size_t dst_bytes, const void *src, size_t min_bytes,
                                    const char *what, const char *initialiser);
zd_status client__sized_array_stride(const void *array, unsigned count, size_t min_bytes,
                                     size_t max_bytes, const char *what, const char *array_name,
                                     const char *initialiser, size_t *stride_out);
void client__sized_array_element(void *dst, size_t dst_bytes, const void *array, size_t stride,
                                 unsigned index);
zd_status client__sized_out_check(const void *out, size_t min_bytes, size_t max_bytes,
                                  const char *what, const char *initialiser);
/* client__sized_out_check of an output struct of `type`. */
#define SIZED_OUT_CHECK(out, type, first_field, what, initialiser)                                 \
  client__sized_out_check((out), SIZED_THROUGH(type, first_field), sizeof(type), (what),           \
                          (initialiser))
void client__sized_out_write(void *out, const void *full, size_t full_bytes);

/* client_base.c */
zd_status client__set_error(zd_status status, const char *format, ...)
    __attribute__((format(printf, 2, 3)));
/* Puts back a last error saved from zd_last_error (zd_close). */
void client__restore_error(const char *saved);
const zk_cuda_api *client__cuda_api(char *why, size_t why_bytes);
size_t client__dtype_bytes(zd_dtype dtype);
int client__dtype_from_proto(int proto_dtype, zd_dtype *out);
const char *client__dtype_name(zd_dtype dtype);
void client__close_fds(int *fds, unsigned nfds);
void client__mapping_free(buffer_mapping *mapping);
uint64_t client__page_round(uint64_t bytes);

#endif /* ZEROD_CLIENT_IMPL_H */
