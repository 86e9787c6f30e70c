/* libzerod: the client library that training workers link.
 *
 * A worker connects to its node's zerod daemon over a Unix socket, attaches
 * to a job as one local rank, registers the units (layers) of its model, and
 * then, every step: gathers each unit's full parameters into shared memory
 * (zd_gather), computes, releases them (zd_release), writes the unit's
 * gradient into a gradient buffer (zd_grad_buffer) and hands it back
 * (zd_reduce), and finally asks for an optimizer step (zd_step), which is a
 * collective over all ranks of the job.
 *
 * Evaluation, inference and weight-sync processes attach read-only instead
 * (zd_attach_options.read_only): they list the units the trainers
 * registered (zd_list_units), gather and release them, and may pin one
 * version for a consistent pass over the model (zd_pin).
 *
 * Conventions (as in libuv and NCCL):
 * - every call returns a zd_status: ZD_OK (0) or a negative code;
 *   zd_strerror() names the code and zd_last_error() returns the detailed
 *   message of the calling thread's last failed call (usually the daemon's);
 *   "Statuses" below says which codes each call returns;
 * - handles are opaque; results go through out-parameters;
 * - a zd_client is used by one thread at a time (calls on one client are
 *   not synchronised); use one client per worker thread if needed;
 * - every call is safe against a daemon that has gone away: it fails with
 *   ZD_E_UNAVAILABLE instead of crashing or raising SIGPIPE;
 * - memory returned in views (zd_view) belongs to the library; a view may
 *   be used only until the matching zd_release (gathered) or zd_reduce
 *   (gradient). After that the daemon may reuse the buffer for other values
 *   or free it, and the library then unmaps it, so touching an old view can
 *   fault. The tensor tables a view points to (names, shapes) stay valid
 *   until zd_close. With zd_attach_options.stable_addresses a unit's
 *   gathered view keeps its address across gathers instead (see there).
 * - a daemon started with --device cuda keeps a job's buffers in GPU
 *   memory: views then hold device pointers (zd_view.device >= 0) and are
 *   ordered with the daemon through CUDA events (zd_view_stream_wait,
 *   zd_view_stream_done; docs/client.md, "GPU buffers").
 */
#ifndef ZEROD_H
#define ZEROD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ZD_API __attribute__((visibility("default")))

/* Statuses. A call returns the errors it caused itself. One fault has one
 * status whether the library or the daemon notices it: the protocol's
 * Status codes map to the zd_status of the same name (ZD_E_NOT_FOUND is
 * STATUS_NOT_FOUND, and so on), and the library's own checks use the code
 * the daemon gives the same fault (a unit id the job does not know is
 * ZD_E_NOT_FOUND from every call). Each call below lists the codes it
 * returns for its own reasons; besides those:
 * - any call with a job or client: ZD_E_INVALID_ARGUMENT for a NULL
 *   handle or out-parameter, or a sized struct whose struct_size the call
 *   cannot use; ZD_E_FAILED_PRECONDITION on a detached job;
 * - any call that talks to the daemon: ZD_E_UNAVAILABLE (the daemon is not
 *   there, went away or is shutting down; the client is dead), ZD_E_PROTOCOL
 *   (the daemon broke the protocol; the client is dead), ZD_E_NOMEM,
 *   ZD_E_INTERNAL (a daemon bug, or a status code this library does not
 *   know);
 * - the collectives (the calls that say so): ZD_E_ABORTED when the job
 *   failed (a peer rank died or timed out);
 * - deferred errors: the two requests sent without a reply, zd_reduce_async
 *   and zd_release, cannot return what the daemon answers later. Such an
 *   error is returned by the next call that waits for the daemon, once that
 *   call's own work is done, and only then; zd_last_error() then starts
 *   with the earlier request ("reduce unit 3: ...", "release unit 3: ..."),
 *   which is how it is told apart from the call's own failure. zd_release
 *   checks what the daemon would refuse itself, so only the daemon's own
 *   state (its limit on requests in flight, its memory) can be deferred. */
typedef enum zd_status {
  ZD_OK = 0,
  ZD_E_INVALID_ARGUMENT = -1,
  ZD_E_NOT_FOUND = -2,
  ZD_E_ALREADY_EXISTS = -3,
  ZD_E_FAILED_PRECONDITION = -4,
  ZD_E_RESOURCE_EXHAUSTED = -5,
  ZD_E_PERMISSION_DENIED = -6,
  ZD_E_UNAVAILABLE = -7, /* daemon not running, gone, or shutting down */
  ZD_E_INTERNAL = -8,
  ZD_E_ABORTED = -9,   /* the job failed (e.g. a peer rank timed out) */
  ZD_E_PROTOCOL = -10, /* malformed frame; the connection is closed */
  ZD_E_NOMEM = -11,
  ZD_E_IO = -12, /* a system call failed; the message names it */
} zd_status;

typedef enum zd_dtype { ZD_F32 = 1, ZD_BF16 = 2, ZD_F16 = 3 } zd_dtype;

typedef enum zd_optimizer { ZD_ADAMW = 1, ZD_ADAM = 2, ZD_SGD = 3 } zd_optimizer;

typedef enum zd_init {
  ZD_INIT_FROM_RANK0 = 1, /* rank 0 passes fp32 values, broadcast to all */
  ZD_INIT_SEEDED_NORMAL = 2,
  ZD_INIT_ZEROS = 3,
} zd_init;

/* Every struct a caller allocates and passes carries its own size, its
 * first field struct_size, so that later headers can add fields at its end
 * without a new soname (docs/client.md, "ABI policy"). Initialise each with
 * its ZD_*_INIT: struct_size set, every other field zero (the default).
 * The library reads no field of an input past the caller's struct_size
 * (those read as zero), and writes no byte of an output at or past it. A
 * struct_size the call cannot use (too small for the fields it needs, or
 * larger than this library's struct: a program built against a newer
 * zerod.h, or a struct never initialised) is ZD_E_INVALID_ARGUMENT before
 * the call does anything (zd_job_stats alone accepts a larger one, see
 * there). Arrays of sized structs are read with element 0's struct_size as
 * the stride, which every element must carry. Two structs
 * carry no size and never change while the soname is libzerod.so.1:
 * zd_tensor_view, which only the library allocates (in tables the caller
 * indexes), and zd_collective_counter, which zd_rank_stats embeds.
 *
 * ZD_SIZED_INIT is designated in C so that -Wextra does not warn about the
 * fields left out. */
#ifdef __cplusplus
#define ZD_SIZED_INIT(type)                                                                        \
  { sizeof(type) }
#else
#define ZD_SIZED_INIT(type)                                                                        \
  { .struct_size = sizeof(type) }
#endif

typedef struct zd_client zd_client;
typedef struct zd_job zd_job;

/* Job configuration, used when zd_attach creates the job (attaching to an
 * existing job with another one gets a warning, zd_job_attach_warning).
 * Zero fields take the defaults of torch.optim. Initialise with
 * ZD_JOB_CONFIG_INIT so that struct_size is set. */
/* How the collectives of a job whose ranks span nodes are built (a job on
 * one node shares memory between its ranks either way). Hierarchical (the
 * default): each node's ranks first, then across nodes, N slices crossing
 * where a flat communicator sends W; gradient sums node by node (the same
 * bits run to run). Flat: one communicator over every rank, sums in rank
 * order, bit-identical to one process summing the ranks in order. */
typedef enum zd_collectives {
  ZD_COLLECTIVES_DEFAULT = 0,
  ZD_COLLECTIVES_HIERARCHICAL = 1,
  ZD_COLLECTIVES_FLAT = 2,
} zd_collectives;

/* Where a job's optimizer state lives (DeepSpeed's offload_optimizer). */
typedef enum zd_offload_device {
  ZD_OFFLOAD_DEFAULT = 0, /* none */
  ZD_OFFLOAD_NONE = 1,    /* the rank's device memory (host memory on CPU ranks) */
  ZD_OFFLOAD_CPU = 2,     /* host memory, the step on the CPU (CPU ranks: the same as none) */
  ZD_OFFLOAD_NVME = 3,    /* a file per rank under the daemon's --nvme-dir, the step on the CPU */
} zd_offload_device;

typedef struct zd_job_config {
  size_t struct_size;
  zd_optimizer optimizer; /* default AdamW */
  double lr, beta1, beta2, eps;
  double weight_decay; /* used when has_weight_decay, else the default */
  int has_weight_decay;
  double momentum, dampening;
  int nesterov;
  zd_dtype working_dtype;  /* F32 (default) or BF16 */
  uint64_t max_live_bytes; /* 0: the daemon's default */
  double max_grad_norm;    /* 0: no clipping */
  zd_collectives collectives;
  /* ZeRO++ qwZ, for a job whose ranks span nodes: units are all-gathered as
   * int8 blocks of quantization_block elements (0: 256), each with an fp32
   * scale, and dequantized into the gathered buffer (every element within
   * half a step, 0.5001 * max|block| / 127, of its master weight). */
  int quantized_weights;
  unsigned quantization_block;
  /* ZeRO++ qgZ, for a hierarchical job on several nodes: 0 (off), 8 or 4:
   * each node's partial gradient sums cross nodes as int8/int4 blocks and
   * are summed in fp32 after. Without it, gradient_comm_dtype ZD_BF16
   * sends them in bf16 (default ZD_F32: exact). */
  unsigned quantized_gradients;
  zd_dtype gradient_comm_dtype;
  /* ZeRO++ hpZ, for a hierarchical job of host ranks on several nodes: 0
   * or 1 (off), or the job's ranks per node. A unit's first gather at a
   * version keeps each rank's 1/L slice of it (counted in max_live_bytes,
   * evicted like a cached gather); a later gather of that version while
   * the slices are kept (the backward pass) stays inside the node. */
  unsigned hpz_partition_size;
  /* Dynamic loss scaling, as DeepSpeed's DynamicLossScaler.update_scale:
   * loss_scale is the initial scale, 0: 65536 with a ZD_F16 working copy
   * and off otherwise, negative: off. An overflow (a step skipped) uses up
   * one of the hysteresis's overflows while more than one is left, else
   * multiplies the scale by backoff (not below min) and leaves the
   * hysteresis used up; window good steps after the last overflow multiply
   * it by growth and restore the hysteresis. Zero other fields: window
   * 2000, growth 2, backoff 0.5, hysteresis 1, min 1. The scale is the
   * job's runtime state: a checkpoint restore keeps it, a restart of the
   * daemon starts again from loss_scale. */
  double loss_scale;
  unsigned loss_scale_window;
  double loss_scale_growth, loss_scale_backoff;
  unsigned loss_scale_hysteresis;
  double loss_scale_min;
  /* offload_optimizer: ZD_OFFLOAD_NVME keeps the fp32 master weights and
   * the moments in a file per rank under the daemon's --nvme-dir
   * (nvme_path: a directory inside it, a relative one taken inside it;
   * "": the directory itself), streamed
   * through offload_buffer_count (0: 4) buffers of offload_buffer_size (0:
   * 1048576; a multiple of 1024) elements per state at each step; only the
   * gradient accumulator and the working copy stay in memory. On GPU ranks
   * ZD_OFFLOAD_CPU and _NVME keep those two on the GPU and run the step on
   * the CPU, chunk by chunk through the same buffers (gradients down,
   * working copy up); offload_pin_memory makes the buffers page-locked, so
   * the copies overlap the CPU's work. */
  zd_offload_device offload_device;
  char nvme_path[256];
  unsigned offload_buffer_count;
  uint64_t offload_buffer_size;
  int offload_pin_memory; /* GPU ranks: page-locked staging */
  /* A base (docs/bases.md): the name of a frozen job (zerodctl jobs
   * freeze) on the same nodes, with the same world size and working dtype,
   * whose units this job registers with zd_unit_desc.from_base. "": none. */
  char base_job[65]; /* up to 64 bytes and the NUL */
  /* ABI 1.4. 1-bit Adam (DeepSpeed's OneBitAdam freeze_step), for an Adam
   * or AdamW job on several nodes with hierarchical collectives: 0 (off),
   * or the exact steps after which the second moment is frozen and each
   * node's partial gradient sums cross nodes as signs with an fp32 scale
   * per quantization_block elements (a multiple of 8), with error feedback
   * (docs/compression.md). Not with quantized_gradients or bf16 gradients. */
  unsigned onebit_freeze_step;
  /* ABI 1.5. Low-rank (PowerSGD) gradient compression, for a job on
   * several nodes with hierarchical collectives: 0 (off), or the rank r
   * (1..64) of the two factors each node's partial gradient sums for
   * another node's slice cross nodes as, with error feedback and a warm
   * start (docs/compression.md). Not with quantized_gradients, bf16
   * gradients or onebit_freeze_step. */
  unsigned powersgd_rank;
  /* ABI 1.5. With powersgd_rank: the steps whose reduces stay exact before
   * the compression starts (torch's start_powerSGD_iter); 0: from the
   * first step. */
  unsigned powersgd_start_step;
} zd_job_config;

#define ZD_JOB_CONFIG_INIT ZD_SIZED_INIT(zd_job_config)

typedef struct zd_attach_options {
  size_t struct_size;
  const char *job; /* job name */
  unsigned local_rank;
  /* The job's owner token (or a read token, read-only). NULL: the
   * environment's ZEROD_TOKEN (how Kubernetes hands a worker its job's
   * token), none when unset; "": none, whatever the environment says. */
  const char *token;
  /* Read-only (eval, inference, weight sync): no rank is taken, the job
   * must exist, units are listed with zd_list_units instead of registered,
   * and registration, gradient buffers, reduce, step and load are refused
   * with ZD_E_PERMISSION_DENIED by the library itself, without asking the
   * daemon. Gathers and releases take part in no collective. Views are
   * mapped read-only (gathered views are, for every job). */
  int read_only;
  /* ZD_ATTACH_EXISTING (0): the job must exist (ZD_E_NOT_FOUND names it);
   * ZD_CREATE_OR_RESUME (1): create it with `config` if it does not exist,
   * else resume it where it is (zd_job_version: its completed steps);
   * ZD_CREATE_FRESH (2): create it, or join it while no step is done, but
   * refuse one that has trained (ZD_E_FAILED_PRECONDITION). */
  int create;
  const zd_job_config *config;
  /* Read-only only (ignored for read-write jobs): serve every gather from
   * one version, pinned at attach and moved to the latest by zd_pin, so a
   * pass over all units sees one consistent model while training goes on;
   * zd_job_version returns the pinned version. 0: each gather reads the
   * latest version (zd_view.version says which). */
  int pin;
  /* Each unit's gathered view always lies at the same address for this job
   * handle: the library reserves an address range per unit, maps the
   * daemon's buffer there at zd_gather / zd_gather_wait, and makes the range
   * inaccessible (PROT_NONE) when the unit is released. Frameworks can then
   * keep tensors, and views derived from them, over a unit's memory across
   * release and re-gather (as FSDP does by resizing storage). Costs one
   * mmap per gather and one per release. Gathering a unit the library still
   * maps (no release in between) keeps the mapping. The range is the unit's
   * padded_numel elements of its dtype, rounded up to whole pages; touching
   * it while the unit is released faults (SIGSEGV). The ranges are unmapped
   * by zd_close. Gradient views are not affected. */
  int stable_addresses;
  /* A job this attach creates on a standalone daemon gets this many ranks
   * (a launcher's world size; at most the daemon's --max-ranks); 0: the
   * daemon's --ranks. Ignored for a job that exists (zd_job_world_size says
   * its own) and in a cluster. Since ABI 1.1. */
  unsigned world_size;
} zd_attach_options;

#define ZD_ATTACH_EXISTING  0
#define ZD_CREATE_OR_RESUME 1
#define ZD_CREATE_FRESH     2

#define ZD_ATTACH_OPTIONS_INIT ZD_SIZED_INIT(zd_attach_options)

typedef struct zd_tensor_desc {
  size_t struct_size; /* ZD_TENSOR_DESC_INIT, in every element of the array */
  const char *name;
  const uint64_t *shape;
  unsigned ndim;
  int frozen;
} zd_tensor_desc;

#define ZD_TENSOR_DESC_INIT ZD_SIZED_INIT(zd_tensor_desc)

typedef struct zd_unit_desc {
  size_t struct_size;
  const char *name;
  const zd_tensor_desc *tensors;
  unsigned ntensors;
  zd_init init;
  uint64_t seed;
  double init_std;
  /* ZD_INIT_FROM_RANK0 on rank 0: the tensors' fp32 values back to back, in
   * order (sum of numel floats). Ignored on other ranks. */
  const float *init_values;
  /* The job's base's unit of this name (zd_job_config.base_job): tensors
   * must be the base's (names, shapes, frozen flags; a mismatch is
   * ZD_E_INVALID_ARGUMENT naming the unit and the field), init and
   * init_values are ignored. The unit is frozen and shared: its gathers are
   * served from the node's read-only base cache (the view's memory is
   * mapped read-only; writing it faults), and zd_grad_buffer, zd_reduce
   * and zd_load_unit on it are ZD_E_FAILED_PRECONDITION. */
  int from_base;
} zd_unit_desc;

#define ZD_UNIT_DESC_INIT ZD_SIZED_INIT(zd_unit_desc)

/* An element of the tensor tables the library hands out (zd_view.tensors,
 * zd_unit_info.tensors). Only the library allocates it, so it has no
 * struct_size: its layout is fixed for as long as the soname is
 * libzerod.so.1. */
typedef struct zd_tensor_view {
  const char *name;
  void *data; /* inside the unit's buffer */
  const uint64_t *shape;
  unsigned ndim;
  uint64_t numel;
  uint64_t offset; /* elements from the start of the flat buffer */
} zd_tensor_view;

/* A unit's gathered or gradient buffer, as the worker sees it.
 *
 * device is -1 for a buffer in shared memory (base and the tensors' data
 * are host addresses), or the CUDA ordinal of a GPU buffer (a daemon
 * started with --device cuda; local rank i's buffers are on GPU i, as the
 * daemon numbers its devices): base and the tensors' data are then device
 * pointers, opened in this process on the device that was current on the
 * calling thread at the first gather or zd_grad_buffer of the buffer (make
 * GPU `device` current before them). event is the buffer's cudaEvent_t,
 * owned by the library, for zd_view_stream_wait / zd_view_stream_done;
 * NULL for shared memory. Initialise with ZD_VIEW_INIT. */
typedef struct zd_view {
  size_t struct_size;
  void *base;
  size_t bytes;
  zd_dtype dtype;
  uint64_t version; /* gathered: the version the values come from */
  unsigned ntensors;
  const zd_tensor_view *tensors;
  int device;
  void *event;
} zd_view;

#define ZD_VIEW_INIT ZD_SIZED_INIT(zd_view)

typedef struct zd_step_options {
  size_t struct_size;
  /* Every rank of the job must send the same options: they are compared
   * across the ranks (in the step's all-reduce) before any takes effect.
   * Options that differ, or one rank's invalid options, fail the step on
   * every rank with ZD_E_INVALID_ARGUMENT naming the field ("lr",
   * "group_lr", "max_grad_norm", "grad_scale"); nothing changes and the
   * reduced gradients stay for the next zd_step. */
  int set_lr;
  double lr;
  int set_max_grad_norm;
  double max_grad_norm;
  double grad_scale; /* 0 or 1: none */
  /* Every parameter group's learning rate from this step on (zd_set_groups;
   * ngroup_lr 0: unchanged, else the number of groups). */
  const double *group_lr;
  unsigned ngroup_lr;
} zd_step_options;

#define ZD_STEP_OPTIONS_INIT ZD_SIZED_INIT(zd_step_options)

/* What zd_step returns; initialise with ZD_STEP_RESULT_INIT. */
typedef struct zd_step_result {
  size_t struct_size;
  uint64_t step;
  uint64_t version;
  double grad_norm;
  int skipped;
  double loss_scale; /* the scale for the next step's loss; 0: no loss scaling */
} zd_step_result;

#define ZD_STEP_RESULT_INIT ZD_SIZED_INIT(zd_step_result)

typedef uint32_t zd_unit; /* unit id, from zd_register_unit */

/* A unit's layout, as the daemon placed it. Tensor views in `tensors` have
 * data == NULL; their offsets are elements from the start of a gathered
 * buffer. Valid until zd_close. Initialise with ZD_UNIT_INFO_INIT. */
typedef struct zd_unit_info {
  size_t struct_size;
  zd_unit unit;
  const char *name;
  unsigned ntensors;
  const zd_tensor_view *tensors;
  uint64_t numel;        /* flat length, alignment gaps included */
  uint64_t padded_numel; /* gathered buffers hold this many elements */
  zd_dtype dtype;        /* of gathered and gradient buffers */
} zd_unit_info;

#define ZD_UNIT_INFO_INIT ZD_SIZED_INIT(zd_unit_info)

/* A pending asynchronous gather (zd_gather_async fills it in, zd_gather_wait
 * reads it). Initialise with ZD_PENDING_INIT. */
typedef struct zd_pending {
  size_t struct_size;
  uint64_t request_id;
  zd_unit unit;
} zd_pending;

#define ZD_PENDING_INIT ZD_SIZED_INIT(zd_pending)

/* The default socket path: $ZEROD_SOCKET, else the first that exists of
 * the user's state directory's zerod.sock (root: /var/lib/zerod; others:
 * $XDG_STATE_HOME/zerod or ~/.local/state/zerod), /var/lib/zerod/zerod.sock
 * and /run/zerod/zerod.sock, else the first of them. The string is the
 * calling thread's until its next call. */
ZD_API const char *zd_default_socket(void);

/* Connects to the daemon at socket_path (NULL: zd_default_socket()).
 * Statuses: ZD_E_INVALID_ARGUMENT (a path longer than a Unix socket's),
 * ZD_E_UNAVAILABLE (nothing listens there), ZD_E_IO, ZD_E_NOMEM. */
ZD_API zd_status zd_connect(const char *socket_path, zd_client **out);

/* Detaches every job still attached (errors ignored), closes the
 * connection, unmaps every buffer and stable-address range, closes the
 * buffer descriptors it kept, and frees the client and its jobs. After
 * this no view, job or pending handle of the client may be used. Accepts
 * NULL. */
ZD_API void zd_close(zd_client *client);

/* Attaches to a job (one attached job per connection: attach another job on
 * another zd_connect). The zd_job belongs to the client and stays valid,
 * even after zd_detach, until zd_close. options->config may be NULL (the
 * defaults); it is only used when the job is created (see
 * zd_job_attach_warning and zd_job_effective_config).
 * Statuses: ZD_E_INVALID_ARGUMENT (a job name or token out of bounds, a
 * config field out of range), ZD_E_NOT_FOUND (no such job and not
 * `create`; always for read-only), ZD_E_ALREADY_EXISTS (another session
 * holds this rank), ZD_E_PERMISSION_DENIED (no token for a job that has
 * one, or a token that does not match: the message says which),
 * ZD_E_FAILED_PRECONDITION (this connection is attached already),
 * ZD_E_RESOURCE_EXHAUSTED (the daemon's session or job limits), ZD_E_ABORTED
 * (the job failed and has not been reset). */
ZD_API zd_status zd_attach(zd_client *client, const zd_attach_options *options, zd_job **out);

/* Global rank and world size of an attached job (a read-only job takes no
 * rank: its rank is whatever the daemon reports). zd_job_version is the
 * version last seen (attach, step, listing, load), or the pinned one for a
 * pinned read-only job. Each accepts NULL (and returns 0). */
ZD_API unsigned zd_job_rank(const zd_job *job);
ZD_API unsigned zd_job_world_size(const zd_job *job);
ZD_API uint64_t zd_job_version(const zd_job *job);
ZD_API int zd_job_read_only(const zd_job *job);
/* The loss scale the next step's loss is to be multiplied by (the rank's,
 * from the attach reply and each step's); 0: the job scales no loss. */
ZD_API double zd_job_loss_scale(const zd_job *job);

/* The job's effective config, as the daemon sent it in reply to the attach
 * (its defaults filled in; lr and max_grad_norm as the rank had them then):
 * the one the job trains with, whatever options->config the attach passed,
 * which is used only when the attach creates the job. out->struct_size must
 * be set (ZD_JOB_CONFIG_INIT); fields past it are left alone. Works on a
 * detached job too. Statuses: ZD_E_INVALID_ARGUMENT only. */
ZD_API zd_status zd_job_effective_config(const zd_job *job, zd_job_config *out);
/* The daemon's warning about this attach, or NULL if it gave none: the job
 * existed with a config other than options->config, which was therefore
 * not used; the text names the fields that differ (zd_job_effective_config
 * has the job's). Belongs to the library; valid until zd_close. */
ZD_API const char *zd_job_attach_warning(const zd_job *job);

/* Fetches the job's unit table from the daemon, so that a read-only job can
 * gather units it did not register (a read-write job knows its own). Units
 * already known keep their entries (a listing that contradicts one is a
 * protocol error). Sets *count to the number of units known (may be NULL).
 * Statuses: ZD_E_RESOURCE_EXHAUSTED (the table does not fit in a frame). */
ZD_API zd_status zd_list_units(zd_job *job, unsigned *count);
/* Units known to this job handle (registered or listed), by index in id
 * order. zd_job_unit_info fails with ZD_E_INVALID_ARGUMENT for an index at
 * or past zd_job_unit_count; what it returns belongs to the library and
 * stays valid until zd_close. Both work on a detached job too.
 * zd_job_unit_info's statuses: ZD_E_INVALID_ARGUMENT only. */
ZD_API unsigned zd_job_unit_count(const zd_job *job);
ZD_API zd_status zd_job_unit_info(const zd_job *job, unsigned index, zd_unit_info *out);

/* Read-only jobs (ZD_E_FAILED_PRECONDITION otherwise): pins the latest
 * version for every later gather and sets *version (may be NULL); a job
 * attached without `pin` is pinned from then on. Units gathered before keep
 * their old values until gathered again. Statuses: ZD_E_FAILED_PRECONDITION
 * (a read-write job). */
ZD_API zd_status zd_pin(zd_job *job, uint64_t *version);

/* What zd_watch returns (initialise with ZD_UPDATE_INIT). version: the
 * version now pinned, or after_version when the wait timed out (timed_out
 * 1, nothing else changes). skipped: versions published after
 * after_version and before version, which this subscriber never sees (a
 * slow subscriber goes straight to the latest; nothing queues). changed:
 * the units to read for this update, in id order: those whose values
 * changed after after_version, and those no earlier zd_watch of this
 * session listed (new units); owned by the library, valid until the next
 * zd_watch of the job or zd_close. step: the job's completed steps when
 * the daemon answered (the step that made version may still be finishing
 * its write, and is counted once done). ABI 1.2. */
typedef struct zd_update {
  size_t struct_size;
  uint64_t version;
  int timed_out;
  uint64_t skipped;
  uint64_t step;
  unsigned nchanged;
  const zd_unit *changed;
} zd_update;

#define ZD_UPDATE_INIT ZD_SIZED_INIT(zd_update)

/* zd_watch's after_version for a subscriber that holds no version yet. */
#define ZD_NO_VERSION UINT64_MAX

/* Read-only jobs (subscribers, docs/subscribe.md): waits until the job has
 * a version above after_version (the one the caller holds; ZD_NO_VERSION:
 * none, answered at once with every unit listed), at
 * most timeout_ms (0: answer at once; at most 24 h), then pins the latest
 * version as zd_pin does, so that every unit gathered for this update
 * comes from that one version, and says which units to read. New units
 * are added to the job's unit table (zd_job_unit_info). Statuses:
 * ZD_E_FAILED_PRECONDITION (a read-write job), ZD_E_INVALID_ARGUMENT (a
 * timeout out of range), ZD_E_ABORTED (the job failed; watch again once it
 * has reset), ZD_E_UNAVAILABLE (the daemon is stopping). */
ZD_API zd_status zd_watch(zd_job *job, uint64_t after_version, int timeout_ms, zd_update *out);

/* What a delta gather changed (zd_gather_delta; initialise with
 * ZD_DELTA_INIT). full: the buffer was filled whole (the session's first
 * gather of the unit, or its buffer was let go or its last fill failed):
 * read every byte. Otherwise the buffer held from_version's values, the
 * version of the unit's previous gather in this session, and only the
 * blocks set in changed were written: block b is bytes [b * block_bytes,
 * (b + 1) * block_bytes) of the view (the last one shorter), set when
 * bit b % 8 of changed[b / 8] is 1; nchanged counts them. A caller that
 * holds from_version's values elsewhere (a model in GPU memory) brings
 * them to the view's version by copying those blocks only. changed is
 * owned by the library, valid until the unit's next gather or zd_close.
 * ABI 1.3. */
typedef struct zd_delta {
  size_t struct_size;
  int full;
  uint64_t from_version;
  size_t block_bytes;
  size_t nblocks;
  size_t nchanged;
  const uint8_t *changed;
} zd_delta;

#define ZD_DELTA_INIT ZD_SIZED_INIT(zd_delta)

/* Read-only jobs (subscribers, docs/subscribe.md, "Deltas"): zd_gather,
 * with the daemon comparing the unit's buffer with the version it serves
 * block by block and writing only the blocks that differ, which *delta
 * lists. Statuses: zd_gather's, and ZD_E_FAILED_PRECONDITION (a read-write
 * job). */
ZD_API zd_status zd_gather_delta(zd_job *job, zd_unit unit, zd_view *out, zd_delta *delta);

/* What one rank's collectives moved since the job was created on its node
 * (zd_job_stats): per communicator level ("node": between ranks on that
 * node; "cross": between nodes, in a hierarchical collective; "world": a
 * flat communicator spanning nodes) and collective
 * ("all_gather": units gathered, "reduce_scatter": gradients, "broadcast":
 * initial values and loads, "control": small host collectives such as
 * layout checks and gradient norms), the payload bytes on that rank and
 * the calls. Only non-zero counters are listed. */
#define ZD_MAX_COLLECTIVE_COUNTERS 16

/* Embedded in zd_rank_stats (an array of ZD_MAX_COLLECTIVE_COUNTERS), so
 * it has no struct_size: its layout is fixed for as long as the soname is
 * libzerod.so.1. */
typedef struct zd_collective_counter {
  char level[16];
  char collective[24];
  uint64_t bytes;
  uint64_t calls;
} zd_collective_counter;

typedef struct zd_rank_stats {
  size_t struct_size; /* out[0]'s: set by the caller (ZD_RANK_STATS_INIT) */
  unsigned rank;      /* global */
  uint64_t step;      /* completed optimizer steps */
  unsigned ncounters;
  zd_collective_counter counters[ZD_MAX_COLLECTIVE_COUNTERS];
  /* The rank's buffer pool after its last request (gathered units,
   * gradient buffers, hpZ secondary partitions; at most the job's
   * max_live_bytes), and the secondary partitions among them. */
  uint64_t pool_bytes;
  uint64_t secondary_bytes;
  /* The rank's shards (master weights, moments, gradient accumulators,
   * working copies): bytes in its memory, and in its tier file
   * (offload_optimizer nvme); on a GPU rank with offload_optimizer cpu,
   * the master weights and moments in host memory (not in state_bytes). */
  uint64_t state_bytes;
  uint64_t tier_bytes;
  uint64_t host_state_bytes;
  /* ABI 1.4. Communication against compute since the job started on this
   * node, in seconds (docs/daemon.md, "Exposed communication"): the time
   * the rank spent in collectives; the time its worker waited for the
   * daemon's answers (libzerod counts the waits between steps and sends
   * them with each zd_step; each step's own time is the daemon's); and the
   * part of those waits that was communication (the waits between steps,
   * and the collectives run while a step request waited). A caller built
   * before 1.4, or a daemon before it, leaves them out or zero. */
  double comm_seconds;
  double wait_seconds;
  double exposed_comm_seconds;
} zd_rank_stats;

#define ZD_RANK_STATS_INIT ZD_SIZED_INIT(zd_rank_stats)

/* The counters of every rank of the job on the daemon this job is attached
 * to, in rank order: the first `max` into out, and how many ranks there
 * are into *nranks. Read-write and read-only jobs alike. out is an array
 * of max entries of out[0].struct_size bytes each (sizeof(zd_rank_stats)
 * of the caller's header: fields added later are left out for a caller
 * built before them); every entry written gets that struct_size.
 * Statuses: ZD_E_RESOURCE_EXHAUSTED (the daemon's memory). */
ZD_API zd_status zd_job_stats(zd_job *job, zd_rank_stats *out, unsigned max, unsigned *nranks);

/* Sets a registered unit's values from rank 0's fp32 values (the tensors'
 * values back to back in order, as ZD_INIT_FROM_RANK0 takes them; ignored
 * and may be NULL on other ranks, NULL on rank 0 is ZD_E_INVALID_ARGUMENT).
 * A collective over the job's ranks: the master weights and the working
 * copy change, the optimizer state does not, and the job's version goes up
 * by one (*version, may be NULL). Statuses: as zd_load_state. */
ZD_API zd_status zd_load_unit(zd_job *job, zd_unit unit, const float *values, uint64_t *version);

/* torch.optim's parameter groups: each its own hyper-parameters, the job's
 * algorithm. Zero lr, beta1, beta2 and eps are the job's; weight_decay is
 * the job's unless has_weight_decay; momentum, dampening and nesterov are
 * taken as given. Initialise each with ZD_PARAM_GROUP_INIT. */
typedef struct zd_param_group {
  size_t struct_size;
  double lr, beta1, beta2, eps;
  double weight_decay;
  int has_weight_decay;
  double momentum, dampening;
  int nesterov;
} zd_param_group;

#define ZD_PARAM_GROUP_INIT ZD_SIZED_INIT(zd_param_group)

/* The job's parameter groups (1..64) and, for each listed unit, the group
 * of each of its tensors (tensor_groups[i]: that unit's tensor count of
 * indices, in its tensor order); units left out are all in group 0. The
 * steps that follow run each tensor with its group's hyper-parameters;
 * zd_step_options.group_lr sets their learning rates. Each group is
 * checked like a job config (ZD_E_INVALID_ARGUMENT names the group or
 * tensor). Every rank must send the same, in any order of units: the
 * requests are compared across the ranks (one all-reduce) before anything
 * changes, and groups that differ fail the call on every rank with
 * ZD_E_INVALID_ARGUMENT naming the fields ("groups[1].lr", "ngroups",
 * "tensor_groups"); a rank whose own request is invalid fails with its
 * reason and the others with "another rank's parameter groups was
 * refused". The groups last while the job's ranks do on this daemon: a
 * checkpoint restore keeps them, a restart of the daemon does not (send
 * them again).
 * Statuses: ZD_E_INVALID_ARGUMENT (no groups, more than 64, a NULL array or
 * tensor_groups[i], a bad hyper-parameter, a tensor in a group that does
 * not exist, a unit listed twice, groups that differ between the ranks or
 * another rank's refused), ZD_E_NOT_FOUND (a unit this job does not know),
 * ZD_E_PERMISSION_DENIED (read-only), ZD_E_ABORTED. */
ZD_API zd_status zd_set_groups(zd_job *job, const zd_param_group *groups, unsigned ngroups,
                               const zd_unit *units, const unsigned *const *tensor_groups,
                               unsigned nunits);

/* The global L2 norm of the gradients the job's ranks have reduced since
 * the last step, divided by grad_scale (0 or 1: none) and the loss scale,
 * as the next zd_step will see them: what torch.nn.utils.clip_grad_norm_
 * returns. Collective over the job's ranks, which must pass the same
 * grad_scale. Statuses: ZD_E_INVALID_ARGUMENT (a negative or non-finite
 * grad_scale, or one that differs between the ranks: every rank fails,
 * naming it), ZD_E_PERMISSION_DENIED (read-only), ZD_E_ABORTED. */
ZD_API zd_status zd_grad_norm(zd_job *job, double grad_scale, double *norm);

/* A service checkpoint the workers take or restore themselves, as
 * torch.distributed.checkpoint's save and load: every rank of the job
 * calls it, between the same two steps, with the same name, and each call
 * returns once the checkpoint is durable (or the job restored) or the call
 * failed. It is the checkpoint `zerodctl checkpoint save` would take
 * (docs/checkpoints.md): every rank's shard of the fp32 master weights and
 * optimizer state, under <checkpoint-dir>/<job>/<name>/. The info is
 * initialised with ZD_CHECKPOINT_INFO_INIT. */
typedef struct zd_checkpoint_info {
  size_t struct_size;
  char name[65];    /* the checkpoint saved or restored */
  uint64_t step;    /* saved: the step it holds; restored: the job's step now */
  int64_t stall_ms; /* saved: longest time a rank held training to copy its state */
  int64_t total_ms; /* from the call to the coordinator's answer */
} zd_checkpoint_info;

#define ZD_CHECKPOINT_INFO_INIT ZD_SIZED_INIT(zd_checkpoint_info)

/* Saves the job as checkpoint `name` of the job (1..64 of [A-Za-z0-9._-],
 * not starting with '.'; NULL or "" gives step-<step>). ZD_E_ALREADY_EXISTS
 * if the job has a checkpoint of that name, ZD_E_FAILED_PRECONDITION when
 * another save or restore of the job is in flight or the ranks did not
 * call alike. info may be NULL. Other statuses: ZD_E_INVALID_ARGUMENT (the
 * name), ZD_E_RESOURCE_EXHAUSTED (a full disk), ZD_E_UNAVAILABLE (no
 * coordinator answer), ZD_E_PERMISSION_DENIED (read-only), ZD_E_ABORTED. */
ZD_API zd_status zd_checkpoint_save(zd_job *job, const char *name, zd_checkpoint_info *info);

/* Restores the job from its own checkpoint `name`: master weights,
 * optimizer state and step (the parameter groups and the loss scale stay
 * as they are). Buffers the worker gathered are released first; gather
 * again after. ZD_E_NOT_FOUND without such a checkpoint; on any failure
 * the job keeps its state. info may be NULL. Other statuses: those of
 * zd_checkpoint_save, and ZD_E_INTERNAL for a damaged checkpoint. */
ZD_API zd_status zd_checkpoint_restore(zd_job *job, const char *name, zd_checkpoint_info *info);

/* A unit's fp32 arrays in the daemon (zd_load_state, zd_read_state). */
typedef enum zd_unit_state {
  ZD_STATE_WEIGHTS = 0, /* the master weights */
  ZD_STATE_MOMENT1 = 1, /* Adam/AdamW exp_avg; SGD with momentum: momentum_buffer */
  ZD_STATE_MOMENT2 = 2, /* Adam/AdamW exp_avg_sq */
} zd_unit_state;

/* zd_load_unit for any state: rank 0's values (packed as zd_load_unit's)
 * become the unit's weights (the version goes up) or one of its optimizer
 * moments (it does not). With step non-NULL the job's completed-step count
 * becomes *step on every rank (all ranks must pass the same), so that the
 * next step's bias correction continues from a saved optimizer's. A moment
 * the job's optimizer does not keep is ZD_E_INVALID_ARGUMENT. Collective.
 * Statuses: ZD_E_INVALID_ARGUMENT (rank 0 without values, a state the
 * optimizer does not keep, ranks passing different steps), ZD_E_NOT_FOUND
 * (a unit this job does not know), ZD_E_RESOURCE_EXHAUSTED,
 * ZD_E_PERMISSION_DENIED (read-only), ZD_E_IO (the values' memfd),
 * ZD_E_ABORTED. */
ZD_API zd_status zd_load_state(zd_job *job, zd_unit unit, zd_unit_state state, const float *values,
                               const uint64_t *step, uint64_t *version);

/* Reads a unit's weights or one of its optimizer moments in fp32, whole
 * (gathered from every rank's shard), into out: the tensors' values back to
 * back, as zd_load_state takes them; numel must be their sum (the unit's
 * tensors' numel). *step (may be NULL) gets the job's completed steps.
 * Collective over the job's ranks; host ranks only for now. Statuses:
 * ZD_E_INVALID_ARGUMENT (numel is not the unit's, a state the optimizer
 * does not keep), ZD_E_NOT_FOUND (a unit this job does not know),
 * ZD_E_RESOURCE_EXHAUSTED, ZD_E_PERMISSION_DENIED (read-only), ZD_E_ABORTED. */
ZD_API zd_status zd_read_state(zd_job *job, zd_unit unit, zd_unit_state state, float *out,
                               size_t numel, uint64_t *step);

/* Registers a unit (a collective: every rank registers the same units in
 * the same order). A layout that differs between ranks fails with
 * ZD_E_INVALID_ARGUMENT naming the unit and the first differing tensor.
 * Other statuses: ZD_E_INVALID_ARGUMENT (a description out of bounds, rank
 * 0 without init_values), ZD_E_ALREADY_EXISTS (the name is registered with
 * another layout), ZD_E_RESOURCE_EXHAUSTED, ZD_E_PERMISSION_DENIED
 * (read-only), ZD_E_IO (the values' memfd), ZD_E_ABORTED. */
ZD_API zd_status zd_register_unit(zd_job *job, const zd_unit_desc *desc, zd_unit *out);

/* Gathers a unit's full parameters (working precision). Collective on a
 * read-write job; a read-only job gathers on its own.
 * zd_gather_async only sends the request, so that the gather overlaps the
 * caller's compute; each pending gather is waited for exactly once, and
 * replies are matched by request id whatever order they come in.
 * Statuses: ZD_E_NOT_FOUND (a unit this job does not know; read-only: one
 * not yet registered on every rank), ZD_E_FAILED_PRECONDITION (the unit is
 * gathered already: release it first), ZD_E_RESOURCE_EXHAUSTED (the buffer
 * would pass max_live_bytes), ZD_E_INVALID_ARGUMENT (zd_gather_wait: no
 * such gather in flight), ZD_E_IO (mapping the buffer), ZD_E_ABORTED. */
ZD_API zd_status zd_gather(zd_job *job, zd_unit unit, zd_view *out);
ZD_API zd_status zd_gather_async(zd_job *job, zd_unit unit, zd_pending *out);
ZD_API zd_status zd_gather_wait(zd_job *job, const zd_pending *pending, zd_view *out);

/* Releases a gathered unit: one whose gather's reply was taken (zd_gather,
 * zd_gather_wait). It costs one send and no round trip; the library checks
 * what the daemon would refuse before sending, so the errors a release
 * causes are its own. Statuses: ZD_E_NOT_FOUND (a unit this job does not
 * know), ZD_E_FAILED_PRECONDITION (the unit is not gathered: never, or
 * released already, or let go by a restore; nothing is sent), ZD_E_IO (a
 * stable-address range could not be covered again; the release was sent).
 * An error the daemon still answers (its own state: requests in flight,
 * memory) is a deferred error, returned by the next call that waits. */
ZD_API zd_status zd_release(zd_job *job, zd_unit unit);

/* The unit's gradient buffer (zeroed by the caller as needed; working
 * precision), valid until zd_reduce. Statuses: ZD_E_NOT_FOUND (a unit this
 * job does not know), ZD_E_RESOURCE_EXHAUSTED (max_live_bytes),
 * ZD_E_PERMISSION_DENIED (read-only), ZD_E_IO (mapping the buffer). */
ZD_API zd_status zd_grad_buffer(zd_job *job, zd_unit unit, zd_view *out);

/* Reduce-scatters the gradient buffer into the ranks' fp32 accumulators
 * (several reduces before a step accumulate). Collective. Statuses:
 * ZD_E_NOT_FOUND (a unit this job does not know), ZD_E_FAILED_PRECONDITION
 * (no zd_grad_buffer of the unit since its last reduce),
 * ZD_E_PERMISSION_DENIED (read-only), ZD_E_ABORTED. */
ZD_API zd_status zd_reduce(zd_job *job, zd_unit unit);
/* zd_reduce without waiting: one send, no round trip, so the worker's
 * backward pass goes on while the daemon reduces. The gradient buffer
 * belongs to the daemon until the unit's next zd_grad_buffer returns (the
 * daemon answers a rank's requests in order, so that call, like the step,
 * waits for the reduce). An error is reported by the next call that waits
 * for the daemon, naming the reduce (a deferred error, see "Statuses").
 * Collective, like zd_reduce. Its own statuses: ZD_E_NOT_FOUND (a unit
 * this job does not know), ZD_E_PERMISSION_DENIED (read-only). */
ZD_API zd_status zd_reduce_async(zd_job *job, zd_unit unit);

/* GPU buffers (zd_view.device >= 0): the daemon and the worker use a buffer
 * in turn on their own CUDA streams, ordered by the buffer's interprocess
 * event instead of a host synchronisation.
 *
 * zd_view_stream_wait makes `stream` (a cudaStream_t; NULL: the legacy
 * default stream) wait until the daemon is done with the buffer: call it
 * after zd_gather / zd_grad_buffer and before the first kernel that reads
 * the gathered values or writes the gradient.
 *
 * zd_view_stream_done records that the work enqueued on `stream` so far is
 * the worker's last use of the buffer: call it after the last kernel that
 * reads a gathered view and before zd_release, and after the last kernel
 * that writes a gradient view and before zd_reduce / zd_reduce_async. The
 * daemon's stream waits for it before it reuses the gathered buffer or
 * reads the gradient. (Synchronising the stream before those calls works
 * too, at the cost of a host wait.)
 *
 * Both return ZD_OK at once for a view of shared memory, so a worker can
 * call them whatever the daemon's device; ZD_E_IO if CUDA fails,
 * ZD_E_INVALID_ARGUMENT for a view that is not one of this process's GPU
 * buffers. */
ZD_API zd_status zd_view_stream_wait(const zd_view *view, void *stream);
ZD_API zd_status zd_view_stream_done(const zd_view *view, void *stream);

/* Optimizer step over all units (collective). options and out may be NULL.
 * Statuses: ZD_E_INVALID_ARGUMENT (lr <= 0, negative or non-finite
 * arguments, group_lr NULL or of another length than the groups, options
 * that differ between the ranks or another rank's refused: see
 * zd_step_options), ZD_E_PERMISSION_DENIED (read-only), ZD_E_ABORTED. */
ZD_API zd_status zd_step(zd_job *job, const zd_step_options *options, zd_step_result *out);

/* Detaches from the job; the handle stays allocated (calls on it fail with
 * ZD_E_FAILED_PRECONDITION) until zd_close. The handles of GPU buffers are
 * closed here (their views are no longer valid); shared memory stays
 * mapped until zd_close. Statuses: only the common ones. */
ZD_API zd_status zd_detach(zd_job *job);

ZD_API const char *zd_strerror(zd_status status);

/* The detailed message of this thread's last failed call ("" if none). */
ZD_API const char *zd_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* ZEROD_H */
