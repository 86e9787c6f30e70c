/* test_cuda_ipc.c - the version 2 device entries of libzerod_cuda.so:
 * streams, events, asynchronous copies, and CUDA IPC between two processes
 * on one GPU, the way the daemon and a worker share buffers and order their
 * work (docs/architecture.md).
 *
 * The two-process test runs this program a second time as the importer.
 * CUDA does not survive fork(): a child that inherits an initialised
 * runtime must not touch it. So the child is started with posix_spawn, which
 * execs at once without copying the parent's address space, and gets one
 * end of a socketpair (its number on the command line) over which the
 * handles and the results travel as fixed-size messages.
 *
 * Without a usable GPU the program prints one "SKIP: ..." line and exits 77
 * (ctest's SKIP_RETURN_CODE), unless ZEROD_REQUIRE_GPU=1 makes that a
 * failure.
 */
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpu_testutil.h"

extern char **environ;

#define IMPORTER_FLAG "--ipc-importer"
/* The work queued before the exporter's event: 64 rounds over 256 MiB, some
 * 30 GB of memory traffic, tens of milliseconds even on an H100. The
 * importer is already running when it is queued, so an importer that did
 * not wait for the event would read the buffer before the fill lands. */
#define IPC_BYTES          ((size_t)64 << 20)
#define DELAY_NUMEL        ((size_t)64 << 20)
#define DELAY_ROUNDS       64
#define EXPORTER_FILL      0x5a
#define IMPORTER_FILL      0xc3
#define MESSAGE_TIMEOUT_MS 60000

/* ------------------------------------------------------------------------ */
/* Messages between the two processes                                       */
/* ------------------------------------------------------------------------ */

typedef struct exporter_msg {
  uint8_t mem_handle[ZK_CUDA_IPC_HANDLE_BYTES];
  uint8_t event_handle[ZK_CUDA_IPC_HANDLE_BYTES];
  uint64_t bytes;
  uint8_t fill;
} exporter_msg;

typedef struct importer_msg {
  int32_t status; /* 0, or the failing step's negative errno */
  char message[768];
  uint8_t event_handle[ZK_CUDA_IPC_HANDLE_BYTES];
} importer_msg;

/* Writes or reads exactly bytes, waiting at most MESSAGE_TIMEOUT_MS for
 * each chunk; 0 or -1 (the peer died, closed, or stalled). */
static int transfer_all(int fd, void *buf, size_t bytes, int writing) {
  uint8_t *p = buf;
  while (bytes > 0) {
    struct pollfd pfd = {.fd = fd, .events = writing ? POLLOUT : POLLIN};
    if (poll(&pfd, 1, MESSAGE_TIMEOUT_MS) <= 0)
      return -1;
    ssize_t n = writing ? write(fd, p, bytes) : read(fd, p, bytes);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    bytes -= (size_t)n;
  }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* The importer (the child process)                                         */
/* ------------------------------------------------------------------------ */

/* Records the first failure of the importer in its reply. */
#define IMPORTER_STEP(reply, call)                                                                 \
  do {                                                                                             \
    int step_rc_ = (call);                                                                         \
    if (step_rc_ != 0 && (reply)->status == 0) {                                                   \
      (reply)->status = step_rc_;                                                                  \
      snprintf((reply)->message, sizeof(reply)->message, "%s returned %d: %s", #call, step_rc_,    \
               cu->last_error());                                                                  \
    }                                                                                              \
  } while (0)

/* Starts CUDA and says it is ready (or why not); then opens the exporter's
 * buffer and event, waits for the event on its own stream, checks the
 * exporter's bytes, overwrites them, and hands back an event of its own
 * recorded after the write. Stays until the exporter says it has waited on
 * that event, then unmaps the buffer. */
static int importer_main(int fd) {
  importer_msg ready = {0};
  char why[512];
  void *stream = NULL, *imported_event = NULL, *own_event = NULL, *buf = NULL;
  int rc = zk_cuda_load(&cu, why, sizeof why);
  if (rc != 0) {
    ready.status = rc;
    snprintf(ready.message, sizeof ready.message, "importer: zk_cuda_load: %s", why);
    transfer_all(fd, &ready, sizeof ready, 1);
    return 1;
  }
  IMPORTER_STEP(&ready, cu->set_device(0));
  IMPORTER_STEP(&ready, cu->stream_create(&stream));
  if (transfer_all(fd, &ready, sizeof ready, 1) != 0 || ready.status != 0)
    return 1;

  importer_msg reply = {0};
  exporter_msg request;
  if (transfer_all(fd, &request, sizeof request, 0) != 0)
    return 2;
  uint8_t *host = malloc(request.bytes);
  if (host == NULL) {
    reply.status = -ENOMEM;
    snprintf(reply.message, sizeof reply.message, "importer: out of memory");
  }
  IMPORTER_STEP(&reply, cu->ipc_mem_open(request.mem_handle, &buf));
  IMPORTER_STEP(&reply, cu->ipc_event_open(request.event_handle, &imported_event));
  IMPORTER_STEP(&reply, cu->stream_wait_event(stream, imported_event));
  IMPORTER_STEP(&reply, cu->copy_to_host_async(host, buf, request.bytes, stream));
  IMPORTER_STEP(&reply, cu->synchronize(stream));
  if (reply.status == 0)
    for (size_t i = 0; i < request.bytes; i++)
      if (host[i] != request.fill) {
        reply.status = -EILSEQ;
        snprintf(reply.message, sizeof reply.message,
                 "importer: byte %zu of %" PRIu64 " is 0x%02x, want the exporter's 0x%02x "
                 "(did the stream wait for the exporter's event?)",
                 i, request.bytes, host[i], request.fill);
        break;
      }
  IMPORTER_STEP(&reply, cu->memset_async(buf, IMPORTER_FILL, request.bytes, stream));
  IMPORTER_STEP(&reply, cu->event_create(&own_event, 1));
  IMPORTER_STEP(&reply, cu->event_record(own_event, stream));
  IMPORTER_STEP(&reply, cu->ipc_event_handle(own_event, reply.event_handle));
  if (transfer_all(fd, &reply, sizeof reply, 1) != 0)
    return 2;

  /* The exporter has waited on our event (and its stream may still be
   * waiting) until it says so: only then may the event go. */
  uint8_t done;
  int exit_code = transfer_all(fd, &done, 1, 0) == 0 ? 0 : 2;
  importer_msg closing = {0};
  if (buf != NULL)
    IMPORTER_STEP(&closing, cu->ipc_mem_close(buf));
  if (own_event != NULL)
    IMPORTER_STEP(&closing, cu->event_destroy(own_event));
  if (imported_event != NULL)
    IMPORTER_STEP(&closing, cu->event_destroy(imported_event));
  if (stream != NULL)
    IMPORTER_STEP(&closing, cu->stream_destroy(stream));
  if (transfer_all(fd, &closing, sizeof closing, 1) != 0)
    exit_code = 2;
  free(host);
  return exit_code;
}

/* ------------------------------------------------------------------------ */
/* The exporter (the test process)                                          */
/* ------------------------------------------------------------------------ */

static pid_t spawn_importer(int child_fd) {
  char fd_arg[16];
  snprintf(fd_arg, sizeof fd_arg, "%d", child_fd);
  char *const argv[] = {"test_cuda_ipc", IMPORTER_FLAG, fd_arg, NULL};
  pid_t pid;
  int rc = posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ);
  if (rc != 0)
    fail_msg("posix_spawn of the importer failed: %s", strerror(rc));
  return pid;
}

static int wait_importer(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR)
      return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Queues enough work on stream that what follows it runs well after the
 * host has moved on. */
static float *queue_delay(void *stream) {
  float *work = dev_alloc(DELAY_NUMEL * sizeof(float));
  CU_OK(cu->memset_async(work, 0, DELAY_NUMEL * sizeof(float), stream));
  for (int round = 0; round < DELAY_ROUNDS; round++)
    CU_OK(cu->scale(stream, work, 1.0f, DELAY_NUMEL, NULL));
  return work;
}

static void test_ipc_buffer_and_events_order_two_processes(void **state) {
  int fds[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  /* Our end must not leak into the child, or its EOF would never come. */
  assert_int_equal(fcntl(fds[0], F_SETFD, FD_CLOEXEC), 0);
  pid_t pid = spawn_importer(fds[1]);
  close(fds[1]);

  CU_OK(cu->set_device(0));
  void *stream = NULL, *exported_event = NULL, *imported_event = NULL;
  CU_OK(cu->stream_create(&stream));
  uint8_t *buf = dev_alloc(IPC_BYTES);
  CU_OK(cu->memset(buf, 0, IPC_BYTES));
  /* memset runs on the legacy default stream, which a non-blocking stream
   * does not wait for. */
  CU_OK(cu->synchronize(NULL));
  CU_OK(cu->event_create(&exported_event, 1));

  importer_msg ready;
  if (transfer_all(fds[0], &ready, sizeof ready, 0) != 0)
    fail_msg("the importer did not start (exit status %d)", wait_importer(pid));
  if (ready.status != 0)
    fail_msg("importer failed to start (%d): %s", ready.status, ready.message);

  /* The fill lands only after the delay: the importer sees it only if its
   * stream really waits on our event. */
  float *delay = queue_delay(stream);
  CU_OK(cu->memset_async(buf, EXPORTER_FILL, IPC_BYTES, stream));
  CU_OK(cu->event_record(exported_event, stream));

  exporter_msg request = {.bytes = IPC_BYTES, .fill = EXPORTER_FILL};
  CU_OK(cu->ipc_mem_handle(buf, request.mem_handle));
  CU_OK(cu->ipc_event_handle(exported_event, request.event_handle));
  assert_int_equal(transfer_all(fds[0], &request, sizeof request, 1), 0);

  importer_msg reply;
  if (transfer_all(fds[0], &reply, sizeof reply, 0) != 0)
    fail_msg("no reply from the importer (exit status %d)", wait_importer(pid));
  if (reply.status != 0)
    fail_msg("importer failed (%d): %s", reply.status, reply.message);

  /* Now the other direction: our stream waits on the importer's event. */
  CU_OK(cu->ipc_event_open(reply.event_handle, &imported_event));
  CU_OK(cu->stream_wait_event(stream, imported_event));
  uint8_t *host = xmalloc(IPC_BYTES);
  CU_OK(cu->copy_to_host_async(host, buf, IPC_BYTES, stream));
  CU_OK(cu->synchronize(stream));
  for (size_t i = 0; i < IPC_BYTES; i++)
    if (host[i] != IMPORTER_FILL)
      fail_msg("byte %zu of %zu is 0x%02x, want the importer's 0x%02x", i, IPC_BYTES, host[i],
               IMPORTER_FILL);

  uint8_t done = 1;
  assert_int_equal(transfer_all(fds[0], &done, 1, 1), 0);
  importer_msg closing;
  assert_int_equal(transfer_all(fds[0], &closing, sizeof closing, 0), 0);
  if (closing.status != 0)
    fail_msg("importer cleanup (ipc_mem_close, event_destroy) failed (%d): %s", closing.status,
             closing.message);
  assert_int_equal(wait_importer(pid), 0);
  close(fds[0]);

  CU_OK(cu->event_destroy(imported_event));
  CU_OK(cu->event_destroy(exported_event));
  CU_OK(cu->stream_destroy(stream));
  dev_free(delay);
  dev_free(buf);
  free(host);
}

/* ------------------------------------------------------------------------ */
/* One process                                                              */
/* ------------------------------------------------------------------------ */

static void test_ipc_open_rejects_garbage_handles(void **state) {
  CU_OK(cu->set_device(0));
  uint8_t garbage[ZK_CUDA_IPC_HANDLE_BYTES];
  memset(garbage, 0xa5, sizeof garbage);
  void *ptr = (void *)0x1;
  int rc = cu->ipc_mem_open(garbage, &ptr);
  if (rc >= 0)
    fail_msg("ipc_mem_open of a garbage handle returned %d", rc);
  assert_null(ptr);
  if (cu->last_error()[0] == '\0')
    fail_msg("ipc_mem_open failed without saying why");
  void *event = (void *)0x1;
  rc = cu->ipc_event_open(garbage, &event);
  if (rc >= 0)
    fail_msg("ipc_event_open of a garbage handle returned %d", rc);
  assert_null(event);
  /* The failures are not sticky: the device still works. */
  void *buf = dev_alloc(64);
  CU_OK(cu->memset(buf, 0, 64));
  dev_free(buf);
}

static void test_event_query_reports_completion(void **state) {
  CU_OK(cu->set_device(0));
  void *stream = NULL, *event = NULL;
  CU_OK(cu->stream_create(&stream));
  CU_OK(cu->event_create(&event, 0));
  float *delay = queue_delay(stream);
  CU_OK(cu->event_record(event, stream));
  int rc, pending_polls = 0;
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  while ((rc = cu->event_query(event)) == -EAGAIN) {
    pending_polls++;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec - start.tv_sec > 30)
      fail_msg("event still pending after 30 s");
    usleep(100);
  }
  if (rc != 0)
    fail_msg("event_query returned %d (%s)", rc, cu->last_error());
  printf("# event pending for %d polls before completing\n", pending_polls);
  /* A completed event stays complete, and waiting on it returns at once. */
  assert_int_equal(cu->event_query(event), 0);
  CU_OK(cu->event_synchronize(event));
  CU_OK(cu->event_destroy(event));
  CU_OK(cu->stream_destroy(stream));
  dev_free(delay);
}

static void test_async_copies_round_trip_on_a_stream(void **state) {
  int device = -1;
  CU_OK(cu->set_device(0));
  CU_OK(cu->get_device(&device));
  assert_int_equal(device, 0);
  void *stream = NULL;
  CU_OK(cu->stream_create(&stream));
  const size_t bytes = 4097;
  uint8_t *src = xmalloc(bytes), *dst = xmalloc(bytes);
  for (size_t i = 0; i < bytes; i++)
    src[i] = (uint8_t)(i * 7 + 3);
  uint8_t *dev = dev_alloc(bytes);
  CU_OK(cu->copy_to_device_async(dev, src, bytes, stream));
  /* The middle third is overwritten, in stream order after the copy. */
  CU_OK(cu->memset_async(dev + bytes / 3, 0x11, bytes / 3, stream));
  CU_OK(cu->copy_to_host_async(dst, dev, bytes, stream));
  CU_OK(cu->synchronize(stream));
  for (size_t i = 0; i < bytes; i++) {
    uint8_t want = i >= bytes / 3 && i < 2 * (bytes / 3) ? 0x11 : src[i];
    if (dst[i] != want)
      fail_msg("byte %zu is 0x%02x, want 0x%02x", i, dst[i], want);
  }
  /* Empty copies are no-ops, NULL buffers are refused. */
  CU_OK(cu->copy_to_host_async(NULL, NULL, 0, stream));
  assert_int_equal(cu->copy_to_host_async(NULL, dev, 1, stream), -EINVAL);
  assert_int_equal(cu->stream_destroy(NULL), -EINVAL);
  CU_OK(cu->stream_destroy(stream));
  dev_free(dev);
  free(src);
  free(dst);
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], IMPORTER_FLAG) == 0)
    return importer_main(atoi(argv[2]));
  /* A dying importer must fail the test, not kill it. */
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_async_copies_round_trip_on_a_stream),
      cmocka_unit_test(test_event_query_reports_completion),
      cmocka_unit_test(test_ipc_open_rejects_garbage_handles),
      cmocka_unit_test(test_ipc_buffer_and_events_order_two_processes),
  };
  return gpu_test_main("cuda_ipc", tests, sizeof tests / sizeof tests[0]);
}
