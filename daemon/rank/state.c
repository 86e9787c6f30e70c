/* READ_STATE: a unit's fp32 weights or one of its optimizer moments, whole,
 * for a worker that saves them (zerod.torch's Optimizer.state_dict). Every
 * rank all-gathers the shards and answers with its own copy, packed the way
 * LOAD_UNIT takes them back: the tensors' values back to back, without the
 * layout's alignment gaps and padding. */
#include "exec_impl.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shm.h"

/* Outcomes of the local checks, exchanged before the gather so that every
 * rank fails or none does. */
enum { READ_OK = 0, READ_NO_MEMORY = 1 };

void exec__handle_read_state(rank_state *rs, exec_op *op) {
  Zerod__V1__ReadStateRequest *req = (Zerod__V1__ReadStateRequest *)op->request;
  if (exec__op_job_failed(rs, op))
    return;
  unit_layout *l;
  shard *sh = exec__lookup_shard(rs, op, req->unit_id, &l);
  if (sh == NULL || exec__refuse_base_unit(op, sh, l, "read_state"))
    return;
  /* The checks below come out alike on every rank (same job, same unit),
   * so answering here leaves no rank waiting in the gather. */
  if (!exec__has_state(rs, req->state)) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
               "read_state of unit '%s': the job's optimizer (%s) keeps no %s", l->name,
               job_optimizer_name(rs->job->config.optimizer), exec__state_name(rs, req->state));
    return;
  }
  if (!device_is_host(rs->dev)) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
               "read_state of unit '%s': not available on GPU ranks yet", l->name);
    return;
  }
  int32_t *codes = calloc((size_t)rs->job->world_size, sizeof *codes);
  if (codes == NULL) {
    job_fail(rs->job, rs->generation, "rank %d: out of memory", rs->rank);
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  codes[rs->rank] = exec__grow_scratch(rs, l->padded_numel, 0) == 0 ? READ_OK : READ_NO_MEMORY;
  int rc = exec__host_all_gather(rs, codes, sizeof *codes);
  if (rc != 0) {
    exec__op_comm_failed(rs, op, "read_state (check)", rc);
    goto done;
  }
  for (int r = 0; r < rs->job->world_size; r++)
    if (codes[r] != READ_OK) {
      exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
                 "read_state of unit '%s': rank %d is out of memory", l->name, r);
      goto done;
    }
  size_t shard_bytes = l->shard_numel * sizeof(float);
  /* A tier's read error still takes part in the gather, so that no peer
   * waits; the job fails with it. */
  int read_rc =
      exec__state_get(rs, sh, l, req->state, rs->scratch + (size_t)rs->rank * l->shard_numel);
  if (read_rc != 0)
    job_fail(rs->job, rs->generation, "rank %d: read_state of unit '%s': %s", rs->rank, l->name,
             strerror(-read_rc));
  rc = exec__host_all_gather(rs, rs->scratch, shard_bytes);
  if (rc == 0 && read_rc != 0) {
    exec__op_device_failed(rs, op, "read_state", read_rc);
    goto done;
  }
  if (rc != 0) {
    exec__op_comm_failed(rs, op, "read_state", rc);
    goto done;
  }
  /* The values are every rank's now; what follows is this rank's alone. */
  uint64_t numel = l->packed_numel;
  char name[96];
  snprintf(name, sizeof name, "zerod-%.64s-r%d-state", rs->job->name, rs->rank);
  shm_region region;
  rc = shm_region_create(&region, name, numel * sizeof(float));
  if (rc != 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
               "read_state of unit '%s': cannot create a %llu-byte shared-memory region: %s",
               l->name, (unsigned long long)(numel * sizeof(float)), strerror(-rc));
    goto done;
  }
  float *out = region.base;
  uint64_t at = 0;
  for (unsigned t = 0; t < l->ntensors; t++) {
    memcpy(out + at, rs->scratch + l->tensors[t].offset, l->tensors[t].numel * sizeof(float));
    at += l->tensors[t].numel;
  }
  op->reply_fd = dup(region.fd);
  int dup_errno = errno;
  shm_region_destroy(&region);
  if (op->reply_fd < 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
               "read_state of unit '%s': cannot pass the values: %s", l->name, strerror(dup_errno));
    goto done;
  }
  Zerod__V1__ReadStateReply reply = ZEROD__V1__READ_STATE_REPLY__INIT;
  reply.unit_id = l->id;
  reply.state = (Zerod__V1__UnitState)req->state;
  reply.step = atomic_load(&rs->step);
  reply.numel = numel;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_READ_STATE_REPLY, &reply.base);
done:
  free(codes);
}
