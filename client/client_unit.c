/* libzerod: units (client_impl.h) - the address ranges of stable_addresses,
 * registration, the job's unit table, pins, loads and state reads. */
#include "client_impl.h"

/* ------------------------------------------------------------------------
 * Stable addresses
 *
 * A job attached with stable_addresses gives each unit an address range of
 * its own, reserved once (PROT_NONE, no memory behind it). A gather maps the
 * daemon's buffer over the range with MAP_FIXED, whichever buffer id the
 * daemon picked this time, and a release maps inaccessible anonymous memory
 * back over it, so that between gathers the worker's views fault instead of
 * reading stale values, and no mapping keeps the daemon's buffer alive. The
 * buffers' descriptors are kept (buffer_mapping.fd) to map them again.
 * ------------------------------------------------------------------------ */

#define STABLE_RESERVE_FLAGS (MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)

/* Bytes of the unit's gathered layout: what its range must hold. */
uint64_t client__unit_gathered_bytes(const client_unit *unit) {
  return unit->padded_numel * client__dtype_bytes(unit->working_dtype);
}

/* Reserves the unit's range if it has none yet. Registration and listing
 * try this and ignore a failure (the unit is known all the same); the
 * gather that needs the range tries again and reports it. */
zd_status client__unit_reserve_range(client_unit *unit, const char *what) {
  if (unit->stable_base != NULL)
    return ZD_OK;
  /* padded_numel is at most 2^49 (frame.c, check_listed_unit), so this
   * cannot wrap; a range that large simply fails to map. */
  uint64_t range_bytes = client__page_round(client__unit_gathered_bytes(unit));
  if ((uint64_t)(size_t)range_bytes != range_bytes)
    return client__set_error(ZD_E_NOMEM,
                             "%s: the unit's %llu-byte range does not fit the address space", what,
                             (unsigned long long)range_bytes);
  void *base = mmap(NULL, (size_t)range_bytes, PROT_NONE, STABLE_RESERVE_FLAGS, -1, 0);
  if (base == MAP_FAILED)
    return client__set_error(ZD_E_NOMEM,
                             "%s: reserving the unit's %llu-byte address range: mmap: %s", what,
                             (unsigned long long)range_bytes, strerror(errno));
  unit->stable_base = base;
  unit->stable_bytes = (size_t)range_bytes;
  return ZD_OK;
}

/* Makes the unit's range inaccessible again. A failed MAP_FIXED may leave
 * the range unmapped, where a later mmap of anyone's could land; a later
 * MAP_FIXED of ours would then destroy that mapping, so on failure the range
 * is given up entirely, and the next gather reserves a new one. */
zd_status client__unit_cover_range(client_unit *unit, const char *what) {
  if (unit->stable_base == NULL)
    return ZD_OK;
  void *covered = mmap(unit->stable_base, unit->stable_bytes, PROT_NONE,
                       STABLE_RESERVE_FLAGS | MAP_FIXED, -1, 0);
  if (covered != MAP_FAILED)
    return ZD_OK;
  int err = errno;
  munmap(unit->stable_base, unit->stable_bytes);
  unit->stable_base = NULL;
  unit->stable_bytes = 0;
  return client__set_error(
      ZD_E_IO,
      "%s: making the unit's address range inaccessible: mmap: %s (the range was "
      "unmapped; the unit's next gather maps it at a new address)",
      what, strerror(err));
}

/* ------------------------------------------------------------------------
 * Register
 * ------------------------------------------------------------------------ */

/* Writes rank 0's values (initial ones, or ones to load) into a fresh memfd
 * for the daemon to read. A memfd rather than the socket because bulk data
 * never crosses the socket (the frame cap is 4 MiB, units are often
 * larger). */
static zd_status make_init_memfd(const float *values, uint64_t numel, const char *what,
                                 int *fd_out) {
  if (numel > SIZE_MAX / sizeof(float))
    return client__set_error(ZD_E_INVALID_ARGUMENT, "%s: unit too large", what);
  size_t total_bytes = (size_t)numel * sizeof(float);
  int fd = memfd_create("zerod-values", MFD_CLOEXEC);
  if (fd < 0)
    return client__set_error(ZD_E_IO, "%s: memfd_create: %s", what, strerror(errno));
  if (ftruncate(fd, (off_t)total_bytes) != 0) {
    int err = errno;
    close(fd);
    return client__set_error(ZD_E_IO, "%s: ftruncate of the values memfd to %zu bytes: %s", what,
                             total_bytes, strerror(err));
  }
  const char *bytes = (const char *)values;
  size_t written_bytes = 0;
  while (written_bytes < total_bytes) {
    ssize_t n =
        pwrite(fd, bytes + written_bytes, total_bytes - written_bytes, (off_t)written_bytes);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      int err = n < 0 ? errno : EIO;
      close(fd);
      return client__set_error(ZD_E_IO, "%s: writing the values memfd: %s", what, strerror(err));
    }
    written_bytes += (size_t)n;
  }
  *fd_out = fd;
  return ZD_OK;
}

/* Keeps the reply's placements and builds the unit's tensor tables. */
static zd_status unit_from_reply(client_unit *unit, const char *unit_name,
                                 const Zerod__V1__RegisterUnitReply *reply, zd_client *client,
                                 const char *what) {
  memset(unit, 0, sizeof *unit);
  unit->unit_id = reply->unit_id;
  unit->numel = reply->numel;
  unit->padded_numel = reply->padded_numel;
  if (client__dtype_from_proto(reply->working_dtype, &unit->working_dtype) != 0 ||
      client__dtype_from_proto(reply->grad_dtype, &unit->grad_dtype) != 0)
    return client__protocol_error(client, what, "unknown dtype in the register reply");
  size_t ntensors = reply->n_tensors;
  size_t total_dims = 0;
  for (size_t t = 0; t < ntensors; t++)
    total_dims += reply->tensors[t]->n_shape;
  unit->name = strdup(unit_name);
  unit->tensor_names = calloc(ntensors, sizeof *unit->tensor_names);
  unit->shapes = calloc(total_dims ? total_dims : 1, sizeof *unit->shapes);
  unit->gather_tensors = calloc(ntensors, sizeof *unit->gather_tensors);
  unit->grad_tensors = calloc(ntensors, sizeof *unit->grad_tensors);
  unit->info_tensors = calloc(ntensors, sizeof *unit->info_tensors);
  if (unit->name == NULL || unit->tensor_names == NULL || unit->shapes == NULL ||
      unit->gather_tensors == NULL || unit->grad_tensors == NULL || unit->info_tensors == NULL)
    return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
  unit->ntensors = (unsigned)ntensors;
  uint64_t *dims = unit->shapes;
  for (size_t t = 0; t < ntensors; t++) {
    const Zerod__V1__TensorPlacement *placement = reply->tensors[t];
    if ((unit->tensor_names[t] = strdup(placement->name)) == NULL)
      return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
    if (placement->n_shape > 0)
      memcpy(dims, placement->shape, placement->n_shape * sizeof *dims);
    zd_tensor_view view = {.name = unit->tensor_names[t],
                           .data = NULL,
                           .shape = dims,
                           .ndim = (unsigned)placement->n_shape,
                           .numel = placement->numel,
                           .offset = placement->offset};
    unit->gather_tensors[t] = view;
    unit->grad_tensors[t] = view;
    unit->info_tensors[t] = view;
    dims += placement->n_shape;
  }
  return ZD_OK;
}

/* The most units a job has (the daemon's limit, docs/protocol.md). */
#define MAX_UNITS_PER_JOB 65536
#define MAX_WORLD_SIZE    64 /* ranks of a job (the daemon's JOB_MAX_WORLD) */

/* frame.c checks a RegisterUnitReply's placements when it decodes one, but
 * not the same message nested in a UnitsReply, so a listed unit gets the
 * same checks here, and a name: every tensor lies inside the unit, and the
 * unit's sizes keep every byte count far from wrapping. Returns what is
 * wrong, or NULL. */
static const char *check_listed_unit(const Zerod__V1__RegisterUnitReply *unit) {
  const uint64_t max_numel = (uint64_t)1 << 48;
  if (unit->name == NULL || unit->name[0] == '\0' ||
      strnlen(unit->name, ZD_MAX_NAME_BYTES + 1) > ZD_MAX_NAME_BYTES)
    return "unit name is empty or longer than 256 bytes";
  if (unit->n_tensors == 0 || unit->n_tensors > ZD_MAX_TENSORS_PER_UNIT)
    return "unit has no tensors, or more than 4096";
  if (unit->numel > unit->padded_numel || unit->padded_numel > 2 * max_numel)
    return "numel above padded_numel, or padded_numel above 2^49";
  for (size_t t = 0; t < unit->n_tensors; t++) {
    const Zerod__V1__TensorPlacement *placement = unit->tensors[t];
    if (placement->name == NULL || placement->name[0] == '\0' ||
        strnlen(placement->name, ZD_MAX_NAME_BYTES + 1) > ZD_MAX_NAME_BYTES)
      return "tensor name is empty or longer than 256 bytes";
    if (placement->n_shape > ZD_MAX_DIMS)
      return "tensor has more than 8 dimensions";
    uint64_t numel = 1;
    for (size_t d = 0; d < placement->n_shape; d++) {
      if (placement->shape[d] == 0 || placement->shape[d] > max_numel / numel)
        return "tensor has a zero-sized dimension or more than 2^48 elements";
      numel *= placement->shape[d];
    }
    if (placement->numel != numel)
      return "tensor placement numel does not match its shape";
    if (placement->offset > unit->numel || numel > unit->numel - placement->offset)
      return "tensor placement lies outside the unit";
  }
  return NULL;
}

/* Whether a listed unit is the one this job already knows by its id. */
static int unit_matches_reply(const client_unit *unit, const Zerod__V1__RegisterUnitReply *reply) {
  zd_dtype working_dtype, grad_dtype;
  if (client__dtype_from_proto(reply->working_dtype, &working_dtype) != 0 ||
      client__dtype_from_proto(reply->grad_dtype, &grad_dtype) != 0)
    return 0;
  if (strcmp(unit->name, reply->name) != 0 || unit->ntensors != reply->n_tensors ||
      unit->numel != reply->numel || unit->padded_numel != reply->padded_numel ||
      unit->working_dtype != working_dtype || unit->grad_dtype != grad_dtype)
    return 0;
  for (unsigned t = 0; t < unit->ntensors; t++) {
    const Zerod__V1__TensorPlacement *placement = reply->tensors[t];
    const zd_tensor_view *known = &unit->info_tensors[t];
    if (strcmp(known->name, placement->name) != 0 || known->offset != placement->offset ||
        known->numel != placement->numel || known->ndim != placement->n_shape ||
        (placement->n_shape > 0 &&
         memcmp(known->shape, placement->shape, placement->n_shape * sizeof *known->shape) != 0))
      return 0;
  }
  return 1;
}

static zd_status check_unit_desc(const zd_unit_desc *desc, uint64_t *numel_out) {
  if (desc->name == NULL || desc->name[0] == '\0' || strlen(desc->name) > ZD_MAX_NAME_BYTES)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "register unit: name must be 1..%d bytes",
                             ZD_MAX_NAME_BYTES);
  if (desc->tensors == NULL || desc->ntensors == 0 || desc->ntensors > ZD_MAX_TENSORS_PER_UNIT)
    return client__set_error(
        ZD_E_INVALID_ARGUMENT, "register unit %s: needs 1..%d tensors (tensors %s, ntensors %u)",
        desc->name, ZD_MAX_TENSORS_PER_UNIT, desc->tensors ? "set" : "NULL", desc->ntensors);
  if ((int)desc->init < 0 || desc->init > ZD_INIT_ZEROS)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "register unit %s: unknown init mode %d",
                             desc->name, (int)desc->init);
  /* The cap keeps every byte count (numel * 4) far from overflowing. */
  const uint64_t max_numel = (uint64_t)1 << 48;
  uint64_t unit_numel = 0;
  for (unsigned t = 0; t < desc->ntensors; t++) {
    const zd_tensor_desc *tensor = &desc->tensors[t];
    if (tensor->name == NULL || tensor->name[0] == '\0' || strlen(tensor->name) > ZD_MAX_NAME_BYTES)
      return client__set_error(ZD_E_INVALID_ARGUMENT,
                               "register unit %s: tensor %u name must be 1..%d bytes", desc->name,
                               t, ZD_MAX_NAME_BYTES);
    if (tensor->ndim > ZD_MAX_DIMS || (tensor->ndim > 0 && tensor->shape == NULL))
      return client__set_error(ZD_E_INVALID_ARGUMENT,
                               "register unit %s: tensor %s needs a shape of at most %d dims",
                               desc->name, tensor->name, ZD_MAX_DIMS);
    uint64_t numel = 1;
    for (unsigned d = 0; d < tensor->ndim; d++) {
      if (tensor->shape[d] == 0 || tensor->shape[d] > max_numel / numel)
        return client__set_error(
            ZD_E_INVALID_ARGUMENT,
            "register unit %s: tensor %s dim %u is 0 or the tensor has more than "
            "2^48 elements",
            desc->name, tensor->name, d);
      numel *= tensor->shape[d];
    }
    unit_numel += numel;
    if (unit_numel > max_numel)
      return client__set_error(ZD_E_INVALID_ARGUMENT, "register unit %s: more than 2^48 elements",
                               desc->name);
  }
  *numel_out = unit_numel;
  return ZD_OK;
}

/* Copies the caller's tensor descriptions, element by element at the
 * caller's stride, into an array of this library's zd_tensor_desc (freed
 * by the caller), so that the rest of the registration reads one layout. */
static zd_status copy_tensor_descs(const zd_unit_desc *desc, zd_tensor_desc **out) {
  *out = NULL;
  if (desc->tensors == NULL || desc->ntensors == 0 || desc->ntensors > ZD_MAX_TENSORS_PER_UNIT)
    return ZD_OK; /* check_unit_desc says what is wrong */
  size_t stride;
  zd_status status = client__sized_array_stride(
      desc->tensors, desc->ntensors, SIZED_THROUGH(zd_tensor_desc, ndim), sizeof(zd_tensor_desc),
      "register unit: desc", "tensors", "ZD_TENSOR_DESC_INIT", &stride);
  if (status != ZD_OK)
    return status;
  zd_tensor_desc *tensors = calloc(desc->ntensors, sizeof *tensors);
  if (tensors == NULL)
    return client__set_error(ZD_E_NOMEM, "register unit: out of memory");
  for (unsigned t = 0; t < desc->ntensors; t++)
    client__sized_array_element(&tensors[t], sizeof tensors[t], desc->tensors, stride, t);
  *out = tensors;
  return ZD_OK;
}

/* zd_register_unit with the caller's description in this library's
 * layout. */
static zd_status register_unit(zd_job *job, zd_unit_desc desc, zd_unit *out) {
  zd_status status;
  uint64_t unit_numel = 0;
  if ((status = check_unit_desc(&desc, &unit_numel)) != ZD_OK)
    return status;
  char what[ZD_MAX_NAME_BYTES + 32];
  snprintf(what, sizeof what, "register unit %s", desc.name);
  if ((status = client__job_check_writable(job, what)) != ZD_OK)
    return status;
  zd_client *client = job->client;
  zd_init init = desc.init == 0 ? ZD_INIT_FROM_RANK0 : desc.init;
  int sends_values = init == ZD_INIT_FROM_RANK0 && job->rank == 0 && !desc.from_base;
  if (sends_values && desc.init_values == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "%s: ZD_INIT_FROM_RANK0 on rank 0 needs init_values", what);
  if ((status = client__job_reserve_units(job, 1, what)) != ZD_OK)
    return status;

  Zerod__V1__TensorSpec *specs = calloc(desc.ntensors, sizeof *specs);
  Zerod__V1__TensorSpec **spec_ptrs = calloc(desc.ntensors, sizeof *spec_ptrs);
  if (specs == NULL || spec_ptrs == NULL) {
    free(specs);
    free(spec_ptrs);
    return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
  }
  for (unsigned t = 0; t < desc.ntensors; t++) {
    Zerod__V1__TensorSpec spec = ZEROD__V1__TENSOR_SPEC__INIT;
    /* protobuf-c's structs are not const-correct; packing only reads. */
    spec.name = (char *)desc.tensors[t].name;
    spec.n_shape = desc.tensors[t].ndim;
    spec.shape = (uint64_t *)desc.tensors[t].shape;
    spec.frozen = desc.tensors[t].frozen != 0;
    specs[t] = spec;
    spec_ptrs[t] = &specs[t];
  }
  Zerod__V1__RegisterUnitRequest request = ZEROD__V1__REGISTER_UNIT_REQUEST__INIT;
  request.name = (char *)desc.name;
  request.n_tensors = desc.ntensors;
  request.tensors = spec_ptrs;
  request.init = (Zerod__V1__InitMode)init;
  request.seed = desc.seed;
  request.init_std = desc.init_std;
  request.from_base = desc.from_base != 0;

  int init_fd = -1;
  if (sends_values)
    status = make_init_memfd(desc.init_values, unit_numel, what, &init_fd);
  ProtobufCMessage *reply_msg = NULL;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds = 0;
  if (status == ZD_OK)
    status = client__call(client, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT, &request.base, &init_fd,
                          init_fd >= 0 ? 1 : 0, ZEROD__V1__MSG_TYPE__MSG_REGISTER_UNIT_REPLY, what,
                          &reply_msg, fds, &nfds);
  /* The daemon has its own reference to the memfd once sendmsg returns. */
  if (init_fd >= 0)
    close(init_fd);
  free(specs);
  free(spec_ptrs);
  if (status != ZD_OK)
    return status;

  const Zerod__V1__RegisterUnitReply *reply = (const Zerod__V1__RegisterUnitReply *)reply_msg;
  if (reply->n_tensors != desc.ntensors) {
    size_t got = reply->n_tensors;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    return client__protocol_error(client, what, "reply has %zu tensors, the request had %u", got,
                                  desc.ntensors);
  }
  if (client__job_find_unit(job, reply->unit_id) != NULL) {
    /* Registering the same unit twice on one session returns its state;
     * the earlier entry already describes it. */
    *out = reply->unit_id;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    return client__finish(client);
  }
  client_unit unit;
  status = unit_from_reply(&unit, desc.name, reply, client, what);
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (status != ZD_OK) {
    client__unit_free(&unit);
    return status;
  }
  if (job->stable_addresses)
    client__unit_reserve_range(&unit, what);
  client__job_insert_unit(job, &unit);
  *out = unit.unit_id;
  return client__finish(client);
}

zd_status zd_register_unit(zd_job *job, const zd_unit_desc *caller_desc, zd_unit *out) {
  if (caller_desc == NULL || out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "register unit: desc and out must not be NULL");
  zd_unit_desc desc;
  zd_status status = client__copy_sized_struct(&desc, sizeof desc, caller_desc,
                                               SIZED_THROUGH(zd_unit_desc, ntensors),
                                               "register unit: desc", "ZD_UNIT_DESC_INIT");
  if (status != ZD_OK)
    return status;
  zd_tensor_desc *tensors;
  if ((status = copy_tensor_descs(&desc, &tensors)) != ZD_OK)
    return status;
  if (tensors != NULL)
    desc.tensors = tensors;
  status = register_unit(job, desc, out);
  free(tensors);
  return status;
}

/* ------------------------------------------------------------------------
 * List, pin, load
 * ------------------------------------------------------------------------ */

zd_status zd_list_units(zd_job *job, unsigned *count) {
  char what[ZD_MAX_JOB_NAME_BYTES + 32];
  snprintf(what, sizeof what, "list units of job %s", job != NULL ? job->name : "(null)");
  zd_status status = client__job_check(job, what);
  if (status != ZD_OK)
    return status;
  zd_client *client = job->client;
  Zerod__V1__UnitsRequest request = ZEROD__V1__UNITS_REQUEST__INIT;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(client, ZEROD__V1__MSG_TYPE__MSG_UNITS, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_UNITS_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__UnitsReply *reply = (const Zerod__V1__UnitsReply *)reply_msg;
  if (reply->n_units > MAX_UNITS_PER_JOB) {
    size_t listed = reply->n_units;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    return client__protocol_error(client, what,
                                  "the listing has %zu units, more than the %d a job has", listed,
                                  MAX_UNITS_PER_JOB);
  }
  if ((status = client__job_reserve_units(job, reply->n_units, what)) != ZD_OK) {
    protobuf_c_message_free_unpacked(reply_msg, NULL);
    return status;
  }
  /* Units this job knows already (registered, or listed before) keep their
   * entries, whose tables views may point into; the listing must agree
   * with them. A failure half way leaves the units added so far, each
   * complete. */
  for (size_t u = 0; u < reply->n_units; u++) {
    const Zerod__V1__RegisterUnitReply *listed = reply->units[u];
    const char *why = check_listed_unit(listed);
    client_unit *known = why == NULL ? client__job_find_unit(job, listed->unit_id) : NULL;
    if (why == NULL && known != NULL && !unit_matches_reply(known, listed))
      why = "its layout differs from the unit this job knows by that id";
    if (why != NULL) {
      unsigned unit_id = listed->unit_id;
      protobuf_c_message_free_unpacked(reply_msg, NULL);
      return client__protocol_error(client, what, "unit %u in the listing: %s", unit_id, why);
    }
    if (known != NULL)
      continue;
    client_unit unit;
    status = unit_from_reply(&unit, listed->name, listed, client, what);
    if (status != ZD_OK) {
      client__unit_free(&unit);
      protobuf_c_message_free_unpacked(reply_msg, NULL);
      return status;
    }
    if (job->stable_addresses)
      client__unit_reserve_range(&unit, what);
    client__job_insert_unit(job, &unit);
  }
  /* A pinned job's version is the pinned one, which only zd_pin moves. */
  if (!job->pinned)
    job->version = reply->version;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (count != NULL)
    *count = (unsigned)job->unit_count;
  return client__finish(client);
}

zd_status zd_pin(zd_job *job, uint64_t *version) {
  char what[ZD_MAX_JOB_NAME_BYTES + 32];
  snprintf(what, sizeof what, "pin job %s", job != NULL ? job->name : "(null)");
  zd_status status = client__job_check(job, what);
  if (status != ZD_OK)
    return status;
  if (!job->read_only)
    return client__set_error(
        ZD_E_FAILED_PRECONDITION,
        "%s: only read-only jobs pin a version; this one is attached read-write and "
        "follows its own steps",
        what);
  Zerod__V1__PinRequest request = ZEROD__V1__PIN_REQUEST__INIT;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(job->client, ZEROD__V1__MSG_TYPE__MSG_PIN, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_PIN_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  job->version = ((const Zerod__V1__PinReply *)reply_msg)->version;
  job->pinned = 1;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (version != NULL)
    *version = job->version;
  return client__finish(job->client);
}

/* A counter's name from the daemon, into a fixed field: refused when it
 * does not fit (a daemon that sends one is broken). */
static int copy_name(char *to, size_t to_bytes, const char *from) {
  size_t n = strlen(from);
  if (n == 0 || n >= to_bytes)
    return -1;
  memcpy(to, from, n + 1);
  return 0;
}

zd_status zd_job_stats(zd_job *job, zd_rank_stats *out, unsigned max, unsigned *nranks) {
  char what[ZD_MAX_JOB_NAME_BYTES + 32];
  snprintf(what, sizeof what, "stats of job %s", job != NULL ? job->name : "(null)");
  zd_status status = client__job_check(job, what);
  if (status != ZD_OK)
    return status;
  if ((out == NULL && max > 0) || nranks == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "%s: out (for max > 0) and nranks must not be NULL", what);
  /* The first sized zd_rank_stats is the smallest a caller can have. */
  size_t stride = max > 0 ? out[0].struct_size : 0;
  if (max > 0 && stride < offsetof(zd_rank_stats, host_state_bytes) + sizeof(uint64_t))
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "%s: out[0].struct_size is %zu (set it with ZD_RANK_STATS_INIT)", what,
                             stride);
  Zerod__V1__StatsRequest request = ZEROD__V1__STATS_REQUEST__INIT;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(job->client, ZEROD__V1__MSG_TYPE__MSG_STATS, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_STATS_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__StatsReply *reply = (const Zerod__V1__StatsReply *)reply_msg;
  const char *why = reply->n_ranks > MAX_WORLD_SIZE ? "more ranks than a job has" : NULL;
  for (size_t r = 0; why == NULL && r < reply->n_ranks; r++) {
    const Zerod__V1__RankStats *rank = reply->ranks[r];
    if (rank->n_counters > ZD_MAX_COLLECTIVE_COUNTERS) {
      why = "more counters than there are levels and collectives";
      break;
    }
    if (r >= max)
      continue;
    zd_rank_stats entry, *o = &entry;
    memset(o, 0, sizeof *o);
    o->struct_size = stride;
    o->rank = rank->rank;
    o->step = rank->step;
    o->pool_bytes = rank->pool_bytes;
    o->secondary_bytes = rank->secondary_bytes;
    o->state_bytes = rank->state_bytes;
    o->tier_bytes = rank->tier_bytes;
    o->host_state_bytes = rank->host_state_bytes;
    o->comm_seconds = rank->comm_seconds;
    o->wait_seconds = rank->wait_seconds;
    o->exposed_comm_seconds = rank->exposed_comm_seconds;
    o->ncounters = (unsigned)rank->n_counters;
    for (size_t k = 0; k < rank->n_counters; k++) {
      const Zerod__V1__CollectiveCounter *c = rank->counters[k];
      if (copy_name(o->counters[k].level, sizeof o->counters[k].level, c->level) != 0 ||
          copy_name(o->counters[k].collective, sizeof o->counters[k].collective, c->collective) !=
              0) {
        why = "a counter's name is empty or too long";
        break;
      }
      o->counters[k].bytes = c->bytes;
      o->counters[k].calls = c->calls;
    }
    memcpy((char *)out + r * stride, o, stride < sizeof *o ? stride : sizeof *o);
  }
  size_t listed = reply->n_ranks;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (why != NULL)
    return client__protocol_error(job->client, what, "the stats reply has %s", why);
  *nranks = (unsigned)listed;
  return client__finish(job->client);
}

zd_status zd_load_unit(zd_job *job, zd_unit unit_id, const float *values, uint64_t *version) {
  return zd_load_state(job, unit_id, ZD_STATE_WEIGHTS, values, NULL, version);
}

static uint64_t unit_values_numel(const client_unit *unit) {
  uint64_t numel = 0;
  for (unsigned t = 0; t < unit->ntensors; t++)
    numel += unit->info_tensors[t].numel;
  return numel;
}

/* unit_call_begin of a writable call on one of the unit's states. */
static zd_status state_call_begin(zd_job *job, zd_unit unit_id, const char *verb,
                                  zd_unit_state state, char *what, size_t what_bytes,
                                  client_unit **unit) {
  zd_status status = client__unit_call_begin(job, unit_id, verb, 1, what, what_bytes, unit);
  if (status == ZD_OK && ((int)state < ZD_STATE_WEIGHTS || state > ZD_STATE_MOMENT2))
    status = client__set_error(ZD_E_INVALID_ARGUMENT, "%s: unknown state %d", what, (int)state);
  return status;
}

zd_status zd_load_state(zd_job *job, zd_unit unit_id, zd_unit_state state, const float *values,
                        const uint64_t *step, uint64_t *version) {
  char what[64];
  client_unit *unit;
  zd_status status = state_call_begin(job, unit_id, "load", state, what, sizeof what, &unit);
  if (status != ZD_OK)
    return status;
  /* Like ZD_INIT_FROM_RANK0: rank 0 sends every tensor's values back to
   * back, without the layout's alignment gaps; the others send nothing. */
  int sends_values = job->rank == 0;
  if (sends_values && values == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "%s: rank 0 must pass the unit's values (values is NULL)", what);
  uint64_t values_numel = unit_values_numel(unit);
  int values_fd = -1;
  if (sends_values && (status = make_init_memfd(values, values_numel, what, &values_fd)) != ZD_OK)
    return status;
  Zerod__V1__LoadUnitRequest request = ZEROD__V1__LOAD_UNIT_REQUEST__INIT;
  request.unit_id = unit_id;
  request.state = (Zerod__V1__UnitState)state;
  request.set_step = step != NULL;
  request.step = step != NULL ? *step : 0;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(job->client, ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT, &request.base, &values_fd,
                        values_fd >= 0 ? 1 : 0, ZEROD__V1__MSG_TYPE__MSG_LOAD_UNIT_REPLY, what,
                        &reply_msg, fds, &nfds);
  /* The daemon has its own reference to the memfd once sendmsg returns. */
  if (values_fd >= 0)
    close(values_fd);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__LoadUnitReply *reply = (const Zerod__V1__LoadUnitReply *)reply_msg;
  uint32_t reply_unit = reply->unit_id;
  uint64_t reply_version = reply->version;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (reply_unit != unit_id)
    return client__protocol_error(job->client, what, "load reply is for unit %u", reply_unit);
  job->version = reply_version;
  if (version != NULL)
    *version = reply_version;
  return client__finish(job->client);
}

zd_status zd_read_state(zd_job *job, zd_unit unit_id, zd_unit_state state, float *out, size_t numel,
                        uint64_t *step) {
  char what[64];
  client_unit *unit;
  zd_status status =
      state_call_begin(job, unit_id, "read state of", state, what, sizeof what, &unit);
  if (status != ZD_OK)
    return status;
  uint64_t want = unit_values_numel(unit);
  if (out == NULL || numel != want)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "%s: out must hold the unit's %llu values (numel %zu)", what,
                             (unsigned long long)want, numel);
  Zerod__V1__ReadStateRequest request = ZEROD__V1__READ_STATE_REQUEST__INIT;
  request.unit_id = unit_id;
  request.state = (Zerod__V1__UnitState)state;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(job->client, ZEROD__V1__MSG_TYPE__MSG_READ_STATE, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_READ_STATE_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__ReadStateReply *reply = (const Zerod__V1__ReadStateReply *)reply_msg;
  uint32_t reply_unit = reply->unit_id;
  uint64_t reply_numel = reply->numel, reply_step = reply->step;
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  const char *bad = reply_unit != unit_id ? "the reply is for another unit"
                    : nfds != 1           ? "the reply carries no values"
                    : reply_numel != want ? "the reply's value count is not the unit's"
                                          : NULL;
  if (bad != NULL) {
    for (unsigned i = 0; i < nfds; i++)
      close(fds[i]);
    return client__protocol_error(job->client, what, "%s", bad);
  }
  /* pread, never mmap: like the daemon with a worker's descriptors. */
  size_t bytes = (size_t)want * sizeof(float), done = 0;
  while (done < bytes) {
    ssize_t got = pread(fds[0], (char *)out + done, bytes - done, (off_t)done);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0) {
      int err = got < 0 ? errno : EIO;
      close(fds[0]);
      return client__set_error(ZD_E_IO, "%s: reading the values: %s", what, strerror(err));
    }
    done += (size_t)got;
  }
  close(fds[0]);
  if (step != NULL)
    *step = reply_step;
  return client__finish(job->client);
}
