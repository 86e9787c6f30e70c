/* nccl.cu - the NCCL entries of libzerod_cuda.so.
 *
 * The module does not link NCCL: libnccl.so.2 is opened with dlopen on first
 * use ($ZEROD_NCCL_LIBRARY if set, else the dynamic linker's search path)
 * and the functions are resolved by name, so the kernels load and run on a
 * GPU machine without NCCL, and nccl_available says why NCCL is missing.
 * The function pointer types come from nccl.h (decltype of each
 * declaration, which does not reference the symbol), so a signature that
 * changes between NCCL versions is a compile error here rather than a crash.
 * Without nccl.h at build time (ZKC_HAVE_NCCL undefined) every entry
 * answers -ENOSYS.
 *
 * Communicators are non-blocking (ncclConfig_t.blocking = 0): init and the
 * collectives return at once, possibly with ncclInProgress, which means
 * "accepted, still being set up or enqueued" and is success here;
 * ncclCommGetAsyncError (nccl_status) tells the caller when a communicator
 * is ready and whether it has failed. This is what lets comm_nccl.c put a
 * timeout on every step instead of hanging inside NCCL on a dead peer.
 *
 * Errors: a negative errno (ncclRemoteError: -ECONNRESET, a bad argument or
 * usage: -EINVAL, the rest: -EIO) and the thread's last error, made of
 * ncclGetErrorString and, where the library has it, ncclGetLastError.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

#ifdef ZKC_HAVE_NCCL

#include <nccl.h>

static_assert(sizeof(ncclUniqueId) == ZK_NCCL_UNIQUE_ID_BYTES,
              "ncclUniqueId is not ZK_NCCL_UNIQUE_ID_BYTES");

/* Non-blocking communicators and ncclCommGetAsyncError's ncclInProgress
 * arrived in NCCL 2.14; older libraries are reported as unavailable. */
#define ZKC_NCCL_MIN_MAJOR 2
#define ZKC_NCCL_MIN_MINOR 14

/* How long nccl_destroy lets ncclCommFinalize flush before aborting. The
 * caller has waited for every collective it issued, so finalizing has
 * little left to do; the bound only matters when a peer vanished after the
 * last collective, and then aborting is the right end anyway. */
#define ZKC_NCCL_FINALIZE_TIMEOUT_MS 10000

/* ---- the library ---------------------------------------------------------- */

struct zkc_nccl_functions {
  decltype(&ncclGetVersion) get_version;
  decltype(&ncclGetErrorString) get_error_string;
  decltype(&ncclGetLastError) get_last_error; /* NULL before NCCL 2.13 */
  decltype(&ncclGetUniqueId) get_unique_id;
  decltype(&ncclCommInitRankConfig) comm_init_rank_config;
  decltype(&ncclCommGetAsyncError) comm_get_async_error;
  decltype(&ncclCommFinalize) comm_finalize;
  decltype(&ncclCommDestroy) comm_destroy;
  decltype(&ncclCommAbort) comm_abort;
  decltype(&ncclAllGather) all_gather;
  decltype(&ncclReduceScatter) reduce_scatter;
  decltype(&ncclAllReduce) all_reduce;
  decltype(&ncclBroadcast) broadcast;
};

static pthread_once_t zkc_nccl_once = PTHREAD_ONCE_INIT;
static zkc_nccl_functions zkc_nccl;
static int zkc_nccl_loaded;
/* Why NCCL is unavailable, or which library was loaded. */
static char zkc_nccl_why[512];

/* dlsym returns a data pointer; POSIX guarantees it converts to a function
 * pointer. */
template <typename Fn> static bool zkc_resolve(void *library, const char *name, Fn *out) {
  void *symbol = dlsym(library, name);
  *out = reinterpret_cast<Fn>(symbol);
  return symbol != NULL;
}

static void zkc_nccl_load(void) {
  const char *path = secure_getenv("ZEROD_NCCL_LIBRARY");
  if (path == NULL || path[0] == '\0')
    path = "libnccl.so.2";
  void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (library == NULL) {
    const char *reason = dlerror();
    snprintf(zkc_nccl_why, sizeof zkc_nccl_why, "cannot open %s: %s", path,
             reason != NULL ? reason : "unknown dynamic loader error");
    return;
  }

  zkc_nccl_functions fns{};
  const char *missing = NULL;
#define ZKC_RESOLVE(field, name)                                                                   \
  do {                                                                                             \
    if (missing == NULL && !zkc_resolve(library, name, &fns.field))                                \
      missing = name;                                                                              \
  } while (0)
  ZKC_RESOLVE(get_version, "ncclGetVersion");
  ZKC_RESOLVE(get_error_string, "ncclGetErrorString");
  ZKC_RESOLVE(get_unique_id, "ncclGetUniqueId");
  ZKC_RESOLVE(comm_init_rank_config, "ncclCommInitRankConfig");
  ZKC_RESOLVE(comm_get_async_error, "ncclCommGetAsyncError");
  ZKC_RESOLVE(comm_finalize, "ncclCommFinalize");
  ZKC_RESOLVE(comm_destroy, "ncclCommDestroy");
  ZKC_RESOLVE(comm_abort, "ncclCommAbort");
  ZKC_RESOLVE(all_gather, "ncclAllGather");
  ZKC_RESOLVE(reduce_scatter, "ncclReduceScatter");
  ZKC_RESOLVE(all_reduce, "ncclAllReduce");
  ZKC_RESOLVE(broadcast, "ncclBroadcast");
#undef ZKC_RESOLVE
  if (missing != NULL) {
    snprintf(zkc_nccl_why, sizeof zkc_nccl_why, "%s has no %s (NCCL older than %d.%d?)", path,
             missing, ZKC_NCCL_MIN_MAJOR, ZKC_NCCL_MIN_MINOR);
    dlclose(library);
    return;
  }
  (void)zkc_resolve(library, "ncclGetLastError", &fns.get_last_error);

  /* Since NCCL 2.9 the code is major * 10000 + minor * 100 + patch. */
  int code = 0;
  if (fns.get_version(&code) != ncclSuccess)
    code = 0;
  int major = code / 10000, minor = code / 100 % 100, patch = code % 100;
  if (code < 10000 || major < ZKC_NCCL_MIN_MAJOR ||
      (major == ZKC_NCCL_MIN_MAJOR && minor < ZKC_NCCL_MIN_MINOR)) {
    snprintf(zkc_nccl_why, sizeof zkc_nccl_why,
             "%s is NCCL version code %d; non-blocking communicators need NCCL %d.%d or newer",
             path, code, ZKC_NCCL_MIN_MAJOR, ZKC_NCCL_MIN_MINOR);
    dlclose(library);
    return;
  }
  /* Loaded for the life of the process, like the module itself: NCCL
   * starts threads of its own that must not lose their code. */
  snprintf(zkc_nccl_why, sizeof zkc_nccl_why, "%s: NCCL %d.%d.%d", path, major, minor, patch);
  zkc_nccl = fns;
  zkc_nccl_loaded = 1;
}

/* 0 once NCCL is loaded, else -ENOSYS and the reason as last error. */
static int zkc_need_nccl(void) {
  pthread_once(&zkc_nccl_once, zkc_nccl_load);
  if (!zkc_nccl_loaded)
    return zkc_fail_text(-ENOSYS, "NCCL is not available: %s", zkc_nccl_why);
  return 0;
}

#define ZKC_NEED_NCCL()                                                                            \
  do {                                                                                             \
    int zkc_rc_ = zkc_need_nccl();                                                                 \
    if (zkc_rc_ != 0)                                                                              \
      return zkc_rc_;                                                                              \
  } while (0)

/* ---- errors --------------------------------------------------------------- */

static int zkc_nccl_errno(ncclResult_t result) {
  switch (result) {
  case ncclSuccess:
    return 0;
  case ncclInProgress:
    return -EAGAIN;
  case ncclRemoteError:
    return -ECONNRESET;
  case ncclInvalidArgument:
  case ncclInvalidUsage:
    return -EINVAL;
  default:
    return -EIO;
  }
}

static int zkc_nccl_fail(ncclResult_t result, const char *what) {
  const char *detail = zkc_nccl.get_last_error != NULL ? zkc_nccl.get_last_error(NULL) : NULL;
  const bool has_detail = detail != NULL && detail[0] != '\0';
  return zkc_fail_text(zkc_nccl_errno(result), "%s: %s%s%s", what,
                       zkc_nccl.get_error_string(result), has_detail ? ": " : "",
                       has_detail ? detail : "");
}

/* A collective on a non-blocking communicator may answer ncclInProgress:
 * accepted, to be enqueued by NCCL; the caller's event after it orders
 * correctly either way. */
static int zkc_nccl_enqueued(ncclResult_t result, const char *what) {
  if (result == ncclSuccess || result == ncclInProgress)
    return 0;
  return zkc_nccl_fail(result, what);
}

static ncclComm_t as_comm(void *comm) {
  return static_cast<ncclComm_t>(comm);
}

static cudaStream_t as_stream(void *stream) {
  return static_cast<cudaStream_t>(stream);
}

/* ---- the entries ---------------------------------------------------------- */

int zkc_nccl_available(char *why, size_t why_len) {
  pthread_once(&zkc_nccl_once, zkc_nccl_load);
  if (why != NULL && why_len > 0)
    snprintf(why, why_len, "%s", zkc_nccl_why);
  return zkc_nccl_loaded ? 0 : -ENOSYS;
}

int zkc_nccl_unique_id(void *id_out) {
  if (id_out == NULL)
    return zkc_fail_text(-EINVAL, "nccl_unique_id: id_out is NULL");
  ZKC_NEED_NCCL();
  ncclUniqueId id;
  ncclResult_t result = zkc_nccl.get_unique_id(&id);
  if (result != ncclSuccess)
    return zkc_nccl_fail(result, "ncclGetUniqueId");
  memcpy(id_out, &id, sizeof id);
  return 0;
}

int zkc_nccl_init(void **comm_out, int world_size, int rank, const void *unique_id) {
  if (comm_out == NULL || unique_id == NULL)
    return zkc_fail_text(-EINVAL, "nccl_init: comm_out and unique_id must not be NULL");
  *comm_out = NULL;
  if (world_size < 1 || rank < 0 || rank >= world_size)
    return zkc_fail_text(-EINVAL, "nccl_init: rank %d is outside [0, %d)", rank, world_size);
  ZKC_NEED_NCCL();
  ncclUniqueId id;
  memcpy(&id, unique_id, sizeof id);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = NULL;
  ncclResult_t result = zkc_nccl.comm_init_rank_config(&comm, world_size, id, rank, &config);
  if (result != ncclSuccess && result != ncclInProgress) {
    int rc = zkc_nccl_fail(result, "ncclCommInitRankConfig");
    /* A non-blocking init may have allocated the communicator before it
     * failed; abort frees it in any state. */
    if (comm != NULL)
      (void)zkc_nccl.comm_abort(comm);
    return rc;
  }
  *comm_out = comm;
  return 0;
}

int zkc_nccl_status(void *comm) {
  if (comm == NULL)
    return zkc_fail_text(-EINVAL, "nccl_status: comm is NULL");
  ZKC_NEED_NCCL();
  ncclResult_t async_result = ncclSuccess;
  ncclResult_t result = zkc_nccl.comm_get_async_error(as_comm(comm), &async_result);
  if (result != ncclSuccess)
    return zkc_nccl_fail(result, "ncclCommGetAsyncError");
  if (async_result == ncclInProgress)
    return -EAGAIN;
  if (async_result != ncclSuccess)
    return zkc_nccl_fail(async_result, "NCCL communicator failed");
  return 0;
}

int zkc_nccl_all_gather(void *comm, const void *send, void *recv, size_t bytes_per_rank,
                        void *stream) {
  if (comm == NULL)
    return zkc_fail_text(-EINVAL, "nccl_all_gather: comm is NULL");
  ZKC_NEED_NCCL();
  return zkc_nccl_enqueued(
      zkc_nccl.all_gather(send, recv, bytes_per_rank, ncclUint8, as_comm(comm), as_stream(stream)),
      "ncclAllGather");
}

int zkc_nccl_reduce_scatter_f32(void *comm, const float *send, float *recv, size_t shard_numel,
                                void *stream) {
  if (comm == NULL)
    return zkc_fail_text(-EINVAL, "nccl_reduce_scatter_f32: comm is NULL");
  ZKC_NEED_NCCL();
  return zkc_nccl_enqueued(zkc_nccl.reduce_scatter(send, recv, shard_numel, ncclFloat32, ncclSum,
                                                   as_comm(comm), as_stream(stream)),
                           "ncclReduceScatter");
}

int zkc_nccl_all_reduce(void *comm, void *buf, size_t count, zk_nccl_dtype dtype, zk_nccl_op op,
                        void *stream) {
  if (comm == NULL)
    return zkc_fail_text(-EINVAL, "nccl_all_reduce: comm is NULL");
  ncclDataType_t nccl_dtype;
  switch (dtype) {
  case ZK_NCCL_F32:
    nccl_dtype = ncclFloat32;
    break;
  case ZK_NCCL_F64:
    nccl_dtype = ncclFloat64;
    break;
  case ZK_NCCL_U8:
    nccl_dtype = ncclUint8;
    break;
  case ZK_NCCL_I64:
    nccl_dtype = ncclInt64;
    break;
  default:
    return zkc_fail_text(-EINVAL, "nccl_all_reduce: unknown dtype %d", (int)dtype);
  }
  ncclRedOp_t nccl_op;
  switch (op) {
  case ZK_NCCL_SUM:
    nccl_op = ncclSum;
    break;
  case ZK_NCCL_MAX:
    nccl_op = ncclMax;
    break;
  case ZK_NCCL_MIN:
    nccl_op = ncclMin;
    break;
  default:
    return zkc_fail_text(-EINVAL, "nccl_all_reduce: unknown op %d", (int)op);
  }
  ZKC_NEED_NCCL();
  return zkc_nccl_enqueued(
      zkc_nccl.all_reduce(buf, buf, count, nccl_dtype, nccl_op, as_comm(comm), as_stream(stream)),
      "ncclAllReduce");
}

int zkc_nccl_broadcast(void *comm, void *buf, size_t bytes, int root, void *stream) {
  if (comm == NULL)
    return zkc_fail_text(-EINVAL, "nccl_broadcast: comm is NULL");
  ZKC_NEED_NCCL();
  return zkc_nccl_enqueued(
      zkc_nccl.broadcast(buf, buf, bytes, ncclUint8, root, as_comm(comm), as_stream(stream)),
      "ncclBroadcast");
}

int zkc_nccl_abort(void *comm) {
  if (comm == NULL)
    return 0;
  ZKC_NEED_NCCL();
  ncclResult_t result = zkc_nccl.comm_abort(as_comm(comm));
  return result == ncclSuccess || result == ncclInProgress ? 0
                                                           : zkc_nccl_fail(result, "ncclCommAbort");
}

static void zkc_sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Finalize flushes what the communicator still has in flight (on a
 * non-blocking one it answers ncclInProgress and finishes in the
 * background, so we poll), then destroy frees it. Any failure, or a
 * finalize that does not end within ZKC_NCCL_FINALIZE_TIMEOUT_MS, ends in
 * an abort: the communicator is always freed. */
int zkc_nccl_destroy(void *comm) {
  if (comm == NULL)
    return 0;
  ZKC_NEED_NCCL();
  ncclComm_t c = as_comm(comm);
  int rc = 0;
  ncclResult_t result = zkc_nccl.comm_finalize(c);
  if (result != ncclSuccess && result != ncclInProgress) {
    rc = zkc_nccl_fail(result, "ncclCommFinalize");
  } else {
    ncclResult_t async_result = ncclInProgress;
    for (long waited_ms = 0;; waited_ms++) {
      result = zkc_nccl.comm_get_async_error(c, &async_result);
      if (result != ncclSuccess) {
        rc = zkc_nccl_fail(result, "ncclCommGetAsyncError (finalize)");
        break;
      }
      if (async_result != ncclInProgress) {
        if (async_result != ncclSuccess)
          rc = zkc_nccl_fail(async_result, "ncclCommFinalize");
        break;
      }
      if (waited_ms >= ZKC_NCCL_FINALIZE_TIMEOUT_MS) {
        rc = zkc_fail_text(-ETIMEDOUT, "ncclCommFinalize: not done after %d ms; aborted",
                           ZKC_NCCL_FINALIZE_TIMEOUT_MS);
        break;
      }
      zkc_sleep_ms(1);
    }
  }
  if (rc != 0) {
    (void)zkc_nccl.comm_abort(c);
    return rc;
  }
  result = zkc_nccl.comm_destroy(c);
  if (result != ncclSuccess && result != ncclInProgress)
    return zkc_nccl_fail(result, "ncclCommDestroy");
  return 0;
}

#else /* !ZKC_HAVE_NCCL */

/* ---- built without nccl.h --------------------------------------------------- */

static const char zkc_no_nccl[] = "the CUDA module was built without nccl.h";

static int zkc_no_nccl_fail(void) {
  return zkc_fail_text(-ENOSYS, "NCCL is not available: %s", zkc_no_nccl);
}

int zkc_nccl_available(char *why, size_t why_len) {
  if (why != NULL && why_len > 0)
    snprintf(why, why_len, "%s", zkc_no_nccl);
  return -ENOSYS;
}

int zkc_nccl_unique_id(void *id_out) {
  return zkc_no_nccl_fail();
}

int zkc_nccl_init(void **comm_out, int world_size, int rank, const void *unique_id) {
  if (comm_out != NULL)
    *comm_out = NULL;
  return zkc_no_nccl_fail();
}

int zkc_nccl_status(void *comm) {
  return zkc_no_nccl_fail();
}

int zkc_nccl_all_gather(void *comm, const void *send, void *recv, size_t bytes_per_rank,
                        void *stream) {
  return zkc_no_nccl_fail();
}

int zkc_nccl_reduce_scatter_f32(void *comm, const float *send, float *recv, size_t shard_numel,
                                void *stream) {
  return zkc_no_nccl_fail();
}

int zkc_nccl_all_reduce(void *comm, void *buf, size_t count, zk_nccl_dtype dtype, zk_nccl_op op,
                        void *stream) {
  return zkc_no_nccl_fail();
}

int zkc_nccl_broadcast(void *comm, void *buf, size_t bytes, int root, void *stream) {
  return zkc_no_nccl_fail();
}

int zkc_nccl_abort(void *comm) {
  return comm == NULL ? 0 : zkc_no_nccl_fail();
}

int zkc_nccl_destroy(void *comm) {
  return comm == NULL ? 0 : zkc_no_nccl_fail();
}

#endif /* ZKC_HAVE_NCCL */
