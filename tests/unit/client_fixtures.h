/* client_fixtures.h - what the libzerod tests share (test_client.c,
 * test_client_errors.c, test_client_jobs.c): a fake daemon, a thread that
 * serves one connection on a Unix socket in a temporary directory, speaks
 * the real framing (proto/frame.h), and misbehaves on request (closes the
 * connection, answers with errors, out of order, with undecodable frames,
 * with shutdown notices); and the worker side's helpers: attach, register,
 * gather, and what /proc/self says about the fake's memfds.
 *
 * cmocka is not thread-safe, so the fake daemon never asserts: it records
 * what it saw in its struct, and the test thread checks after the fact.
 * The test thread changes the fake's behaviour only between calls, while
 * the fake waits for the next request.
 *
 * Every memfd the fake makes has its own name, and the fake keeps one
 * mapping and one descriptor of each, so whatever else shows up in
 * /proc/self (maps and fd) belongs to libzerod. */
#ifndef ZEROD_TESTS_CLIENT_FIXTURES_H
#define ZEROD_TESTS_CLIENT_FIXTURES_H

#include <pthread.h>
#include <signal.h>
#include <stdint.h>

#include "frame.h"
#include "zerod.h"

/* ------------------------------------------------------------------------
 * The fake daemon
 * ------------------------------------------------------------------------ */

/* Every unit the fake registers has the same layout: "w" [3, 5] at element
 * 0, an alignment gap, "b" [3] at element 16, padded to 32 elements. */
#define UNIT_NUMEL        19
#define UNIT_PADDED_NUMEL 32
#define BIAS_OFFSET       16
#define MAX_UNITS         4
#define BUFFER_BYTES      (UNIT_PADDED_NUMEL * sizeof(float))

typedef struct fake_daemon {
  unsigned serial; /* in the memfds' names, apart from earlier fakes' */
  char dir[64];
  char path[96];
  int listen_fd;
  int conn_fd;
  pthread_t thread;
  int joined;

  /* What to do wrong, set by the test before connecting. */
  int close_after_attach;
  Zerod__V1__Status attach_error;
  int reorder_gathers;       /* hold the first gather, answer the second first */
  int gather_unknown_buffer; /* answer gathers naming an unseen buffer, no fd */
  int release_error;         /* answer releases with an Error */
  int reduce_error;          /* answer reduces with an Error */
  int reduce_no_reply_flags; /* reduces that came with NO_REPLY */
  int step_notice;           /* answer a step with a shutdown notice */
  int step_garbage;          /* answer a step with a payload that does not decode */
  Zerod__V1__Status gather_error;
  /* The attached rank and world size (0: rank 0 of 1). */
  unsigned attach_rank;
  unsigned attach_world_size;
  int attach_read_only_lie;     /* answer read_only the other way round */
  int attach_config;            /* send a config (SGD, see fake_attach_config) */
  const char *attach_warning;   /* AttachReply.warning; NULL: none */
  uint64_t latest_version;      /* the job's version (attach, units, pin); 0: 3 */
  uint64_t pinned_version;      /* AttachReply.pinned_version */
  int alternate_gather_buffers; /* switch each unit's buffer at every gather */
  int list_bad_placement;       /* list tensor "b" outside its unit */
  int list_other_layout;        /* list tensor "b" at another offset */
  uint32_t drop_ids[4];         /* dropped_buffer_ids of the next buffer reply */
  unsigned ndrop_ids;
  /* Answer gathers as a GPU daemon would: CUDA IPC handles in the reply
   * (1), or handles and a descriptor both (2). */
  int gather_cuda;

  /* Shared memory the fake hands out, one gathered and one gradient
   * buffer per unit; the fake keeps its own mappings to check writes. */
  int gathered_fd[MAX_UNITS];
  float *gathered[MAX_UNITS];
  int gathered_sent[MAX_UNITS];
  int grad_fd[MAX_UNITS];
  float *grad[MAX_UNITS];
  int grad_sent[MAX_UNITS];
  /* With alternate_gather_buffers: a second gathered buffer per unit, id
   * ALT_BUFFER_ID + unit, values 5000 * (unit + 1) + i. */
  int alt_fd[MAX_UNITS];
  float *alt[MAX_UNITS];
  int alt_sent[MAX_UNITS];
  int gather_uses_alt[MAX_UNITS];

  /* The job's units, by id: registered, or set by the test before start. */
  char unit_names[MAX_UNITS][32];

  /* What the fake saw, checked by the test afterwards. */
  unsigned units_registered;
  int init_fd_count;
  int init_values_match;
  unsigned release_frames;
  unsigned release_no_reply_flags;
  float reduce_grad_sum;
  uint64_t held_gather_id;
  uint32_t held_gather_unit;
  uint64_t step_version;
  int garbage_written;
  unsigned frames_by_type[64];
  int attach_mode;
  int attach_pin;
  char attach_token[64]; /* the owner token the attach sent */
  int load_fd_count;
  int load_values_match;
  uint32_t load_unit;
  /* WATCH: the answer (watch_timed_out, or watch_version with the units
   * watch_changed[0..nwatch_changed)) and what the request asked. */
  uint64_t watch_version;
  int watch_timed_out;
  uint32_t watch_changed[4];
  unsigned nwatch_changed;
  uint64_t watch_after;
  uint32_t watch_timeout_ms;
} fake_daemon;

#define BUFFER_ID     10 /* + unit, for gathered and gradient buffers alike */
#define ALT_BUFFER_ID 20 /* + unit */

/* SIGPIPEs this process received; main() counts them with on_sigpipe. */
extern volatile sig_atomic_t sigpipe_count;
/* The SIGPIPE handler: counts, so that a test can show there were none. */
void on_sigpipe(int signo);

/* A fake with its socket bound and listening and its buffers made; not yet serving. */
fake_daemon *fake_create(void);
/* Starts serving; the configuration flags must be set before this. */
void fake_start(fake_daemon *fake);
/* Waits for the serving thread, which ends when the connection does. */
void fake_join(fake_daemon *fake);
/* Joins the fake, then frees it with its buffers, socket and directory. */
void fake_destroy(fake_daemon *fake);

/* The tensors of every unit the tests register: "w" [3, 5] and "b" [3]. */
extern const zd_tensor_desc unit_tensors[2];
/* Attaches to job "test", creating it with the default config. */
zd_job *attach_job(zd_client *client);
/* Registers unit name with rank 0's values 0.5, 1.5, ...; its handle. */
zd_unit register_unit(zd_job *job, const char *name);
/* Connects to the fake. */
zd_client *connect_to(fake_daemon *fake);
/* Fails unless zd_last_error() contains needle. */
void assert_message_contains(const char *needle);
/* Attaches to job "test" with the given flags (the job exists). */
zd_job *attach_with(zd_client *client, int read_only, int pin, int stable_addresses);
/* The /proc name of the fake's memfd `name` (for example "gather-0"). */
const char *memfd_name(const fake_daemon *fake, const char *name);
/* The permissions of the mapping holding addr if it maps the fake's memfd `name`. */
const char *perms_at(const void *addr, const fake_daemon *fake, const char *name);
/* Gathers unit into view, failing the test on an error. */
void gather_ok(zd_job *job, zd_unit unit, zd_view *view);
/* The first element of a view's first tensor. */
float first_weight(const zd_view *view);

#endif /* ZEROD_TESTS_CLIENT_FIXTURES_H */
