/* libzerod: buffers (client_impl.h) - the mappings of gathered and gradient
 * buffers and the views into them, gathers, gradient buffers, reduces, and
 * the ordering of GPU buffers with the daemon. */
#include "client_impl.h"

/* ------------------------------------------------------------------------
 * Buffers and views
 * ------------------------------------------------------------------------ */

static buffer_mapping *mapping_find(zd_client *client, buffer_kind kind, uint32_t buffer_id) {
  for (size_t i = 0; i < client->mapping_count; i++) {
    if (client->mappings[i].kind == kind && client->mappings[i].buffer_id == buffer_id)
      return &client->mappings[i];
  }
  return NULL;
}

/* Adds an entry to the cache, or replaces `found` (the old buffer behind
 * the same id). Takes the mapping's resources either way. */
static zd_status store_mapping(zd_client *client, buffer_mapping *found,
                               const buffer_mapping *mapping, const char *what,
                               buffer_mapping **out, int *replaced) {
  if (found != NULL) {
    /* The daemon replaced the buffer behind this id with one of another
     * size; views of the old one are only valid until their release. */
    client__mapping_free(found);
    *found = *mapping;
    *replaced = 1;
    *out = found;
    return ZD_OK;
  }
  if (client->mapping_count == client->mapping_capacity) {
    size_t capacity = client->mapping_capacity ? client->mapping_capacity * 2 : 16;
    buffer_mapping *mappings = realloc(client->mappings, capacity * sizeof *mappings);
    if (mappings == NULL) {
      buffer_mapping dropped = *mapping;
      client__mapping_free(&dropped);
      return client__set_error(ZD_E_NOMEM, "%s: out of memory", what);
    }
    client->mappings = mappings;
    client->mapping_capacity = capacity;
  }
  client->mappings[client->mapping_count] = *mapping;
  *out = &client->mappings[client->mapping_count++];
  return ZD_OK;
}

/* Opens a GPU buffer from its CUDA IPC handles, on the calling thread's
 * current device (cudaIpcOpenMemHandle maps it there, with peer access
 * where the daemon's device is another). */
static zd_status open_cuda_buffer(zd_client *client, buffer_kind kind, uint32_t buffer_id,
                                  uint64_t buffer_bytes, const cuda_handles *cuda,
                                  buffer_mapping *found, const char *what, buffer_mapping **out,
                                  int *replaced) {
  if (found != NULL && found->device >= 0 && found->bytes == buffer_bytes) {
    *out = found; /* the handles of a buffer already open: nothing new */
    return ZD_OK;
  }
  if (buffer_bytes == 0 || (uint64_t)(size_t)buffer_bytes != buffer_bytes)
    return client__protocol_error(client, what, "GPU buffer %u has an invalid size %llu",
                                  (unsigned)buffer_id, (unsigned long long)buffer_bytes);
  char why[512] = "";
  const zk_cuda_api *api = client__cuda_api(why, sizeof why);
  if (api == NULL)
    return client__set_error(
        ZD_E_FAILED_PRECONDITION,
        "%s: zerod keeps this job on GPU %d (zerod --device cuda), but this process "
        "cannot use CUDA: %s",
        what, cuda->device, why);
  buffer_mapping mapping = {.kind = kind,
                            .buffer_id = buffer_id,
                            .bytes = (size_t)buffer_bytes,
                            .fd = -1,
                            .device = cuda->device};
  if (api->ipc_mem_open(cuda->mem_handle, &mapping.base) != 0)
    return client__set_error(ZD_E_IO, "%s: opening GPU buffer %u (device %d, %llu bytes): %s", what,
                             (unsigned)buffer_id, cuda->device, (unsigned long long)buffer_bytes,
                             api->last_error());
  if (api->ipc_event_open(cuda->event_handle, &mapping.event) != 0) {
    zd_status status = client__set_error(ZD_E_IO, "%s: opening the event of GPU buffer %u: %s",
                                         what, (unsigned)buffer_id, api->last_error());
    api->ipc_mem_close(mapping.base);
    return status;
  }
  return store_mapping(client, found, &mapping, what, out, replaced);
}

/* Finds or creates the entry of a buffer. A descriptor (or a GPU buffer's
 * handles) comes only the first time this session sees a buffer id; later
 * replies name it. With keep_fd the descriptor is kept for stable-address
 * mapping and nothing is mapped here; otherwise the buffer is mapped once
 * and the descriptor closed. *replaced is set when a descriptor replaced
 * the buffer behind a known id, so that whoever mapped the old one maps
 * again. */
static zd_status take_buffer(zd_client *client, buffer_kind kind, uint32_t buffer_id,
                             uint64_t buffer_bytes, int *fds, unsigned nfds,
                             const cuda_handles *cuda, int keep_fd, const char *what,
                             buffer_mapping **out, int *replaced) {
  *replaced = 0;
  buffer_mapping *found = mapping_find(client, kind, buffer_id);
  if (cuda->present && nfds > 0) {
    client__close_fds(fds, nfds);
    return client__protocol_error(client, what,
                                  "reply carries both a descriptor and GPU handles for buffer %u",
                                  (unsigned)buffer_id);
  }
  if (cuda->present)
    return open_cuda_buffer(client, kind, buffer_id, buffer_bytes, cuda, found, what, out,
                            replaced);
  if (found != NULL && found->device < 0 && (keep_fd ? found->fd < 0 : found->base == NULL))
    found = NULL; /* never happens in one session: stable_addresses is per job */
  if (nfds == 0) {
    if (found == NULL)
      return client__protocol_error(client, what,
                                    "reply names buffer %u without a descriptor, and this "
                                    "session has not seen that buffer",
                                    (unsigned)buffer_id);
    if (found->bytes != buffer_bytes)
      return client__protocol_error(
          client, what, "buffer %u is %llu bytes, but was mapped with %zu", (unsigned)buffer_id,
          (unsigned long long)buffer_bytes, found->bytes);
    *out = found;
    return ZD_OK;
  }

  int fd = fds[0];
  if (found != NULL && found->device < 0 && found->bytes == buffer_bytes) {
    close(fd);
    *out = found;
    return ZD_OK;
  }
  /* Mapping past the end of a memfd would turn every later access into
   * SIGBUS, so the size is checked before the worker can touch it. */
  struct stat st;
  if (buffer_bytes == 0 || (uint64_t)(size_t)buffer_bytes != buffer_bytes || fstat(fd, &st) != 0 ||
      (uint64_t)st.st_size < buffer_bytes) {
    close(fd);
    return client__protocol_error(client, what, "buffer %u descriptor is smaller than %llu bytes",
                                  (unsigned)buffer_id, (unsigned long long)buffer_bytes);
  }
  buffer_mapping mapping = {.kind = kind,
                            .buffer_id = buffer_id,
                            .base = NULL,
                            .bytes = (size_t)buffer_bytes,
                            .fd = keep_fd ? fd : -1,
                            .device = -1};
  if (!keep_fd) {
    int prot = kind == BUFFER_GRAD ? PROT_READ | PROT_WRITE : PROT_READ;
    void *base = mmap(NULL, (size_t)buffer_bytes, prot, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);
    if (base == MAP_FAILED)
      return client__set_error(ZD_E_IO, "%s: mmap of buffer %u (%llu bytes): %s", what,
                               (unsigned)buffer_id, (unsigned long long)buffer_bytes,
                               strerror(err));
    mapping.base = base;
  }
  return store_mapping(client, found, &mapping, what, out, replaced);
}

/* The buffer mapped (or opened) once and cached by id: every buffer of a
 * job without stable addresses, every gradient buffer, every GPU buffer. */
static zd_status map_buffer(zd_client *client, buffer_kind kind, uint32_t buffer_id,
                            uint64_t buffer_bytes, int *fds, unsigned nfds,
                            const cuda_handles *cuda, const char *what,
                            buffer_mapping **mapping_out) {
  int replaced;
  return take_buffer(client, kind, buffer_id, buffer_bytes, fds, nfds, cuda, 0, what, mapping_out,
                     &replaced);
}

/* Whether a reply's buffer is a GPU buffer: its handles came with it, or
 * they came before. */
static int is_cuda_buffer(zd_client *client, buffer_kind kind, uint32_t buffer_id,
                          const cuda_handles *cuda) {
  const buffer_mapping *mapping = mapping_find(client, kind, buffer_id);
  return cuda->present || (mapping != NULL && mapping->device >= 0);
}

/* Copies a reply's CudaBuffer (checked by frame.c: 64-byte handles, a
 * device in range) before the reply is freed. */
static void copy_cuda_handles(const Zerod__V1__CudaBuffer *in, cuda_handles *out) {
  memset(out, 0, sizeof *out);
  if (in == NULL)
    return;
  out->present = 1;
  out->device = in->device;
  memcpy(out->mem_handle, in->mem_handle.data, sizeof out->mem_handle);
  memcpy(out->event_handle, in->event_handle.data, sizeof out->event_handle);
}

/* Maps a stable-address job's gathered buffer over the unit's own range
 * and returns the range's address, the same for every gather of the unit.
 * A unit gathered again into the buffer it still maps keeps the mapping. */
static zd_status map_stable(zd_client *client, client_unit *unit, uint32_t buffer_id,
                            uint64_t buffer_bytes, int *fds, unsigned nfds, const char *what,
                            void **base_out, size_t *bytes_out) {
  buffer_mapping *mapping;
  int replaced;
  static const cuda_handles no_cuda = {0};
  zd_status status = take_buffer(client, BUFFER_GATHERED, buffer_id, buffer_bytes, fds, nfds,
                                 &no_cuda, 1, what, &mapping, &replaced);
  if (status != ZD_OK)
    return status;
  /* The whole range is mapped, so the buffer must hold the whole layout:
   * a range page wholly past the end of the memfd would raise SIGBUS. */
  uint64_t layout_bytes = client__unit_gathered_bytes(unit);
  if (buffer_bytes < layout_bytes)
    return client__protocol_error(
        client, what, "buffer %u is %llu bytes, less than the unit's %llu-byte layout",
        (unsigned)buffer_id, (unsigned long long)buffer_bytes, (unsigned long long)layout_bytes);
  if ((status = client__unit_reserve_range(unit, what)) != ZD_OK)
    return status;
  if (unit->held_gather_buffer != buffer_id || replaced) {
    void *base = mmap(unit->stable_base, unit->stable_bytes, PROT_READ,
                      MAP_SHARED | MAP_FIXED | MAP_POPULATE, mapping->fd, 0);
    if (base == MAP_FAILED) {
      int err = errno;
      unit->held_gather_buffer = 0;
      client__unit_cover_range(unit, what);
      return client__set_error(ZD_E_IO, "%s: mmap of buffer %u at the unit's stable address %p: %s",
                               what, (unsigned)buffer_id, unit->stable_base, strerror(err));
    }
  }
  *base_out = unit->stable_base;
  *bytes_out = buffer_bytes < unit->stable_bytes ? (size_t)buffer_bytes : unit->stable_bytes;
  return ZD_OK;
}

/* The daemon freed these buffers: each is unmapped, its kept descriptor
 * closed (so that this process no longer keeps the memory alive), and its
 * id forgotten. The daemon drops only buffers this session does not hold,
 * and numbers both kinds from one counter, so every entry with the id goes,
 * except one that a view handed out still points into and may still use by
 * contract (a gathered view until its release, a gradient view until its
 * reduce): unmapping that would crash the worker for a daemon bug, so the
 * entry stays, until zd_close. */
static void forget_dropped_buffers(zd_client *client, const uint32_t *buffer_ids, size_t count) {
  if (count == 0)
    return;
  /* One pass over the units marks the held entries, so that the cost is
   * linear in units plus dropped ids times entries, however long the list
   * (the daemon drops many buffers at once when it trims its pool). */
  for (size_t i = 0; i < client->mapping_count; i++)
    client->mappings[i].held = 0;
  for (const zd_job *job = client->jobs; job != NULL; job = job->next) {
    for (size_t u = 0; u < job->unit_count; u++) {
      const client_unit *unit = &job->units[u];
      buffer_mapping *mapping;
      if (unit->held_gather_buffer != 0 &&
          (mapping = mapping_find(client, BUFFER_GATHERED, unit->held_gather_buffer)) != NULL)
        mapping->held = 1;
      if (unit->held_grad_buffer != 0 &&
          (mapping = mapping_find(client, BUFFER_GRAD, unit->held_grad_buffer)) != NULL)
        mapping->held = 1;
    }
  }
  for (size_t d = 0; d < count; d++) {
    size_t i = 0;
    while (i < client->mapping_count) {
      buffer_mapping *mapping = &client->mappings[i];
      if (mapping->buffer_id != buffer_ids[d] || mapping->held) {
        i++;
        continue;
      }
      client__mapping_free(mapping);
      client->mappings[i] = client->mappings[--client->mapping_count];
    }
  }
}

/* Closes every GPU buffer's handles (at detach: the daemon may free the
 * allocations once the session has ended, and an importer should not keep
 * handles to freed memory open). Shared-memory mappings stay until
 * zd_close, as views may still point into them. */
void client__close_cuda_buffers(zd_client *client) {
  size_t i = 0;
  while (i < client->mapping_count) {
    if (client->mappings[i].device < 0) {
      i++;
      continue;
    }
    client__mapping_free(&client->mappings[i]);
    client->mappings[i] = client->mappings[--client->mapping_count];
  }
}

/* Points the unit's tensor table into a buffer and fills the view (as far
 * as the caller's struct_size reaches: client_sized.c). Every tensor must
 * lie inside the buffer, or the worker would read past it. gpu is the GPU
 * buffer's entry, or NULL for shared memory. */
static zd_status fill_view(zd_client *client, client_unit *unit, zd_tensor_view *tensors,
                           void *base, uint64_t buffer_bytes, zd_dtype dtype, uint64_t version,
                           const buffer_mapping *gpu, const char *what, zd_view *out) {
  size_t elem_bytes = client__dtype_bytes(dtype);
  for (unsigned t = 0; t < unit->ntensors; t++) {
    uint64_t end = tensors[t].offset + tensors[t].numel;
    if (end > buffer_bytes / elem_bytes)
      return client__protocol_error(client, what,
                                    "tensor %s (elements %llu..%llu, %s) lies outside the "
                                    "%llu-byte buffer",
                                    tensors[t].name, (unsigned long long)tensors[t].offset,
                                    (unsigned long long)end, client__dtype_name(dtype),
                                    (unsigned long long)buffer_bytes);
    tensors[t].data = (char *)base + tensors[t].offset * elem_bytes;
  }
  zd_view view = ZD_VIEW_INIT;
  view.base = base;
  view.bytes = (size_t)buffer_bytes;
  view.dtype = dtype;
  view.version = version;
  view.ntensors = unit->ntensors;
  view.tensors = tensors;
  view.device = gpu != NULL ? gpu->device : -1;
  view.event = gpu != NULL ? gpu->event : NULL;
  client__sized_out_write(out, &view, sizeof view);
  return ZD_OK;
}

/* ------------------------------------------------------------------------
 * Gather, release, gradients, reduce
 * ------------------------------------------------------------------------ */

zd_status client__gather_async(zd_job *job, zd_unit unit_id, int delta, zd_pending *out) {
  char what[64];
  snprintf(what, sizeof what, "gather unit %u", (unsigned)unit_id);
  if (out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "%s: out is NULL", what);
  zd_status status = SIZED_OUT_CHECK(out, zd_pending, unit, what, "ZD_PENDING_INIT");
  if (status != ZD_OK)
    return status;
  client_unit *unit;
  if ((status = client__unit_call_begin(job, unit_id, "gather", 0, what, sizeof what, &unit)) !=
      ZD_OK)
    return status;
  Zerod__V1__GatherRequest request = ZEROD__V1__GATHER_REQUEST__INIT;
  request.unit_id = unit_id;
  request.delta = delta != 0;
  uint64_t request_id;
  status = client__send(job->client, ZEROD__V1__MSG_TYPE__MSG_GATHER, &request.base, NULL, 0, 1,
                        what, &request_id);
  if (status != ZD_OK)
    return status;
  zd_pending pending = ZD_PENDING_INIT;
  pending.request_id = request_id;
  pending.unit = unit_id;
  client__sized_out_write(out, &pending, sizeof pending);
  return ZD_OK;
}

zd_status zd_gather_async(zd_job *job, zd_unit unit_id, zd_pending *out) {
  return client__gather_async(job, unit_id, 0, out);
}

/* A delta gather's answer, kept on the unit (zd_delta.changed). */
static zd_status take_delta(client_unit *unit, const Zerod__V1__GatherReply *reply,
                            client_delta *out, const char *what) {
  memset(out, 0, sizeof *out);
  out->delta = reply->delta;
  out->from = reply->delta_from;
  out->block_bytes = reply->block_bytes;
  if (!reply->delta)
    return ZD_OK;
  uint8_t *bits = malloc(reply->changed_blocks.len ? reply->changed_blocks.len : 1);
  if (bits == NULL)
    return client__set_error(ZD_E_RESOURCE_EXHAUSTED, "%s: out of memory", what);
  memcpy(bits, reply->changed_blocks.data, reply->changed_blocks.len);
  free(unit->delta_bits);
  unit->delta_bits = bits;
  out->bits = bits;
  out->bits_bytes = reply->changed_blocks.len;
  return ZD_OK;
}

zd_status zd_gather_wait(zd_job *job, const zd_pending *caller_pending, zd_view *out) {
  return client__gather_wait(job, caller_pending, out, NULL);
}

zd_status client__gather_wait(zd_job *job, const zd_pending *caller_pending, zd_view *out,
                              client_delta *delta) {
  if (caller_pending == NULL || out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "gather: pending and out must not be NULL");
  zd_pending local_pending, *pending = &local_pending;
  zd_status status = client__copy_sized_struct(pending, sizeof *pending, caller_pending,
                                               SIZED_THROUGH(zd_pending, unit), "gather: pending",
                                               "ZD_PENDING_INIT");
  if (status != ZD_OK)
    return status;
  char what[64];
  snprintf(what, sizeof what, "gather unit %u", (unsigned)pending->unit);
  /* Before the wait: a view refused after it would leave the unit gathered
   * on the daemon's side with nothing to show for it. */
  if ((status = SIZED_OUT_CHECK(out, zd_view, base, what, "ZD_VIEW_INIT")) != ZD_OK)
    return status;
  if ((status = client__job_check(job, what)) != ZD_OK)
    return status;
  zd_client *client = job->client;
  client_unit *unit = client__job_find_unit(job, pending->unit);
  if (unit == NULL || pending->request_id == 0 ||
      client__expected_find(client, pending->request_id) < 0)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "%s: no gather in flight with request id %llu (waited twice?)", what,
                             (unsigned long long)pending->request_id);

  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__wait(client, pending->request_id, ZEROD__V1__MSG_TYPE__MSG_GATHER_REPLY, what,
                        &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__GatherReply *reply = (const Zerod__V1__GatherReply *)reply_msg;
  uint32_t buffer_id = reply->buffer_id;
  uint64_t buffer_bytes = reply->buffer_bytes;
  uint64_t version = reply->version;
  uint32_t reply_unit = reply->unit_id;
  cuda_handles cuda;
  copy_cuda_handles(reply->cuda, &cuda);
  /* The protocol has drops handled before the rest of the reply. */
  forget_dropped_buffers(client, reply->dropped_buffer_ids, reply->n_dropped_buffer_ids);
  if (delta != NULL && reply_unit == pending->unit)
    status = take_delta(unit, reply, delta, what);
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (reply_unit != pending->unit) {
    client__close_fds(fds, nfds);
    return client__protocol_error(client, what, "gather reply is for unit %u", reply_unit);
  }
  /* The daemon holds the unit now, whatever happens to the mapping below:
   * the worker must release it either way. */
  unit->gather_hold = GATHER_HOLD_HELD;
  if (status != ZD_OK) {
    client__close_fds(fds, nfds);
    return status;
  }
  void *base = NULL;
  size_t view_bytes = (size_t)buffer_bytes;
  buffer_mapping *gpu = NULL;
  /* GPU memory cannot be mapped at a reserved host address: a GPU buffer
   * is always used where CUDA opened it, stable_addresses or not. */
  if (job->stable_addresses && !is_cuda_buffer(client, BUFFER_GATHERED, buffer_id, &cuda)) {
    status = map_stable(client, unit, buffer_id, buffer_bytes, fds, nfds, what, &base, &view_bytes);
  } else {
    buffer_mapping *mapping;
    status = map_buffer(client, BUFFER_GATHERED, buffer_id, buffer_bytes, fds, nfds, &cuda, what,
                        &mapping);
    if (status == ZD_OK) {
      base = mapping->base;
      gpu = mapping->device >= 0 ? mapping : NULL;
    }
  }
  if (status != ZD_OK)
    return status;
  unit->held_gather_buffer = buffer_id;
  status = fill_view(client, unit, unit->gather_tensors, base, view_bytes, unit->working_dtype,
                     version, gpu, what, out);
  if (status != ZD_OK)
    return status;
  return client__finish(client);
}

zd_status zd_gather(zd_job *job, zd_unit unit_id, zd_view *out) {
  char what[64];
  snprintf(what, sizeof what, "gather unit %u", (unsigned)unit_id);
  if (out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "%s: out is NULL", what);
  zd_status status = SIZED_OUT_CHECK(out, zd_view, base, what, "ZD_VIEW_INIT");
  if (status != ZD_OK)
    return status;
  zd_pending pending = ZD_PENDING_INIT;
  status = zd_gather_async(job, unit_id, &pending);
  if (status != ZD_OK)
    return status;
  return zd_gather_wait(job, &pending, out);
}

static void remember_no_reply(zd_client *client, uint64_t request_id, zd_unit unit,
                              const char *kind) {
  client->no_reply[client->no_reply_next].request_id = request_id;
  client->no_reply[client->no_reply_next].unit = unit;
  client->no_reply[client->no_reply_next].kind = kind;
  client->no_reply_next = (client->no_reply_next + 1) % NO_REPLY_RING;
}

/* Release is on every layer's critical path, so it costs one send and no
 * round trip: it goes out with NO_REPLY. So that its errors are still this
 * call's, the library makes the daemon's checks first: a unit it does not
 * know is ZD_E_NOT_FOUND, one it knows is not gathered (never gathered,
 * released already, let go by a restore) ZD_E_FAILED_PRECONDITION, and
 * neither is sent. What is left for the daemon to refuse is its own state
 * (its request limit, its memory, its shutdown): such an error is kept as
 * a deferred error for the next call that waits (zerod.h says how to tell
 * it apart). */
zd_status zd_release(zd_job *job, zd_unit unit_id) {
  char what[64];
  client_unit *unit;
  zd_status status = client__unit_call_begin(job, unit_id, "release", 0, what, sizeof what, &unit);
  if (status != ZD_OK)
    return status;
  if (unit->gather_hold == GATHER_HOLD_NONE)
    return client__set_error(ZD_E_FAILED_PRECONDITION,
                             "%s: unit %s is not gathered (no gather's reply was taken since it "
                             "was last released)",
                             what, unit->name);
  zd_client *client = job->client;
  /* The worker is done with the view: a stable range stops mapping the
   * daemon's buffer before the daemon may reuse or free it. */
  zd_status cover_status = ZD_OK;
  if (job->stable_addresses && unit->held_gather_buffer != 0)
    cover_status = client__unit_cover_range(unit, what);
  unit->held_gather_buffer = 0;
  Zerod__V1__ReleaseRequest request = ZEROD__V1__RELEASE_REQUEST__INIT;
  request.unit_id = unit_id;
  uint64_t request_id;
  status = client__send(client, ZEROD__V1__MSG_TYPE__MSG_RELEASE, &request.base, NULL, 0, 0, what,
                        &request_id);
  if (status != ZD_OK)
    return status;
  unit->gather_hold = GATHER_HOLD_NONE;
  remember_no_reply(client, request_id, unit_id, "release");
  /* The release went out all the same; the error says what happened to the
   * range (set by unit_cover_range). */
  return cover_status;
}

zd_status zd_grad_buffer(zd_job *job, zd_unit unit_id, zd_view *out) {
  char what[64];
  snprintf(what, sizeof what, "grad buffer unit %u", (unsigned)unit_id);
  if (out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "%s: out is NULL", what);
  zd_status status = SIZED_OUT_CHECK(out, zd_view, base, what, "ZD_VIEW_INIT");
  if (status != ZD_OK)
    return status;
  client_unit *unit;
  if ((status = client__unit_call_begin(job, unit_id, "grad buffer", 1, what, sizeof what,
                                        &unit)) != ZD_OK)
    return status;
  zd_client *client = job->client;
  Zerod__V1__GradBufferRequest request = ZEROD__V1__GRAD_BUFFER_REQUEST__INIT;
  request.unit_id = unit_id;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(client, ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_GRAD_BUFFER_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__GradBufferReply *reply = (const Zerod__V1__GradBufferReply *)reply_msg;
  uint32_t buffer_id = reply->buffer_id;
  uint64_t buffer_bytes = reply->buffer_bytes;
  uint32_t reply_unit = reply->unit_id;
  cuda_handles cuda;
  copy_cuda_handles(reply->cuda, &cuda);
  forget_dropped_buffers(client, reply->dropped_buffer_ids, reply->n_dropped_buffer_ids);
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (reply_unit != unit_id) {
    client__close_fds(fds, nfds);
    return client__protocol_error(client, what, "grad buffer reply is for unit %u", reply_unit);
  }
  buffer_mapping *mapping;
  status =
      map_buffer(client, BUFFER_GRAD, buffer_id, buffer_bytes, fds, nfds, &cuda, what, &mapping);
  if (status != ZD_OK)
    return status;
  unit->held_grad_buffer = buffer_id;
  status =
      fill_view(client, unit, unit->grad_tensors, mapping->base, buffer_bytes, unit->grad_dtype,
                job->version, mapping->device >= 0 ? mapping : NULL, what, out);
  if (status != ZD_OK)
    return status;
  return client__finish(client);
}

/* Sends a REDUCE of the unit; with wait, waits for its reply. Without, the
 * request goes out with NO_REPLY, like a release: the daemon runs a rank's
 * requests in order, so the unit's next gradient buffer (or the step) is
 * answered only once this reduce has read the buffer, and an error is
 * reported by the next call that waits for the daemon. */
static zd_status reduce_unit(zd_job *job, zd_unit unit_id, int wait) {
  char what[64];
  client_unit *unit;
  zd_status status = client__unit_call_begin(job, unit_id, "reduce", 1, what, sizeof what, &unit);
  if (status != ZD_OK)
    return status;
  Zerod__V1__ReduceRequest request = ZEROD__V1__REDUCE_REQUEST__INIT;
  request.unit_id = unit_id;
  if (wait) {
    ProtobufCMessage *reply_msg;
    int fds[ZD_FRAME_MAX_FDS];
    unsigned nfds;
    status = client__call(job->client, ZEROD__V1__MSG_TYPE__MSG_REDUCE, &request.base, NULL, 0,
                          ZEROD__V1__MSG_TYPE__MSG_REDUCE_REPLY, what, &reply_msg, fds, &nfds);
    if (status != ZD_OK)
      return status;
    protobuf_c_message_free_unpacked(reply_msg, NULL);
  } else {
    uint64_t request_id;
    status = client__send(job->client, ZEROD__V1__MSG_TYPE__MSG_REDUCE, &request.base, NULL, 0, 0,
                          what, &request_id);
    if (status != ZD_OK)
      return status;
    remember_no_reply(job->client, request_id, unit_id, "reduce");
  }
  /* The gradient buffer is consumed: the next backward asks for one again. */
  unit->held_grad_buffer = 0;
  return wait ? client__finish(job->client) : ZD_OK;
}

zd_status zd_reduce(zd_job *job, zd_unit unit_id) {
  return reduce_unit(job, unit_id, 1);
}

zd_status zd_reduce_async(zd_job *job, zd_unit unit_id) {
  return reduce_unit(job, unit_id, 0);
}

/* ------------------------------------------------------------------------
 * GPU buffers: ordering with the daemon
 * ------------------------------------------------------------------------ */

/* A view of shared memory needs no ordering (the daemon's work on it is
 * complete when the reply arrives), so both calls accept it and do nothing:
 * a worker can call them whatever the daemon's device. */
static zd_status view_event_call(const zd_view *caller_view, void *stream, int record,
                                 const char *what) {
  if (caller_view == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "%s: view is NULL", what);
  zd_view local_view, *view = &local_view;
  zd_status status = client__copy_sized_struct(view, sizeof *view, caller_view,
                                               SIZED_THROUGH(zd_view, event), what, "ZD_VIEW_INIT");
  if (status != ZD_OK)
    return status;
  if (view->device < 0)
    return ZD_OK;
  const zk_cuda_api *api = client__cuda_api(NULL, 0);
  if (api == NULL || view->event == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "%s: the view is not a GPU buffer of this process", what);
  int rc =
      record ? api->event_record(view->event, stream) : api->stream_wait_event(stream, view->event);
  if (rc != 0)
    return client__set_error(ZD_E_IO, "%s: %s", what, api->last_error());
  return ZD_OK;
}

zd_status zd_view_stream_wait(const zd_view *view, void *stream) {
  return view_event_call(view, stream, 0, "view stream wait");
}

zd_status zd_view_stream_done(const zd_view *view, void *stream) {
  return view_event_call(view, stream, 1, "view stream done");
}
