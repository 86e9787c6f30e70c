/* Collectives on host values (outcome codes, descriptors, norms, step
 * counts) between the ranks of a job, through the rank's communicator: a
 * GPU rank passes them through a host staging buffer. */
#include "exec_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* Outcome codes, step counts, layout descriptors and the gradient norm live
 * in host memory. A host rank's communicator (Gloo) takes them in place; a
 * GPU rank's (NCCL) takes device memory only, so they pass through a
 * staging area on the rank's device, copied there and back. A failed copy
 * is a failed collective: the job fails either way. */
static int staging_reserve(rank_state *rs, size_t bytes) {
  if (bytes <= rs->staging_bytes)
    return 0;
  device_free(rs->dev, rs->staging);
  rs->staging = NULL;
  rs->staging_bytes = 0;
  int rc = device_alloc(rs->dev, bytes, &rs->staging);
  if (rc == 0)
    rs->staging_bytes = bytes;
  return rc;
}

/* The bytes a control collective moved, in the rank's counters. */
static int counted(rank_state *rs, int rc) {
  rank_metrics_collective(rs, RANK_CONTROL);
  return rc;
}

/* recv holds world_size * bytes_per_rank; this rank's part is taken from
 * recv + rank * bytes_per_rank (the in-place form of comm_all_gather). */
int exec__host_all_gather(rank_state *rs, void *recv, size_t bytes_per_rank) {
  uint8_t *mine = (uint8_t *)recv + (size_t)rs->rank * bytes_per_rank;
  size_t total = (size_t)rs->job->world_size * bytes_per_rank;
  if (device_is_host(rs->dev))
    return counted(rs, comm_all_gather(rs->comm, mine, recv, bytes_per_rank));
  int rc = exec__dev_call(rs, staging_reserve(rs, total));
  uint8_t *staged_mine = (uint8_t *)rs->staging + (size_t)rs->rank * bytes_per_rank;
  if (rc == 0)
    rc = exec__dev_call(rs, device_upload(rs->dev, staged_mine, mine, bytes_per_rank));
  if (rc == 0)
    rc = comm_all_gather(rs->comm, staged_mine, rs->staging, bytes_per_rank);
  if (rc == 0)
    rc = exec__dev_call(rs, device_download(rs->dev, recv, rs->staging, total));
  return counted(rs, rc);
}

int exec__host_broadcast(rank_state *rs, void *buf, size_t bytes, int root) {
  if (device_is_host(rs->dev))
    return counted(rs, comm_broadcast(rs->comm, buf, bytes, root));
  int rc = exec__dev_call(rs, staging_reserve(rs, bytes));
  if (rc == 0 && rs->rank == root)
    rc = exec__dev_call(rs, device_upload(rs->dev, rs->staging, buf, bytes));
  if (rc == 0)
    rc = comm_broadcast(rs->comm, rs->staging, bytes, root);
  if (rc == 0 && rs->rank != root)
    rc = exec__dev_call(rs, device_download(rs->dev, buf, rs->staging, bytes));
  return counted(rs, rc);
}

int exec__host_all_reduce_f64(rank_state *rs, double *buf, size_t count, comm_op op) {
  if (device_is_host(rs->dev))
    return counted(rs, comm_all_reduce(rs->comm, buf, count, COMM_F64, op));
  size_t bytes = count * sizeof *buf;
  int rc = exec__dev_call(rs, staging_reserve(rs, bytes));
  if (rc == 0)
    rc = exec__dev_call(rs, device_upload(rs->dev, rs->staging, buf, bytes));
  if (rc == 0)
    rc = comm_all_reduce(rs->comm, rs->staging, count, COMM_F64, op);
  if (rc == 0)
    rc = exec__dev_call(rs, device_download(rs->dev, buf, rs->staging, bytes));
  return counted(rs, rc);
}

int exec__all_reduce_agreed(rank_state *rs, exec_op *op, double *values, size_t count,
                            const agree_set *a, int refusal_status, const char *refusal,
                            const char *what) {
  /* The step's (3 values and 4 fields) fits on the stack, so a step
   * allocates nothing; parameter groups' (500-odd fields) do not. */
  double small[64];
  size_t total = count + agree_values(a);
  double *buf = total <= sizeof small / sizeof *small ? small : malloc(total * sizeof *buf);
  if (buf == NULL)
    return -ENOMEM;
  if (count > 0)
    memcpy(buf, values, count * sizeof *buf);
  agree_put(a, buf + count);
  int rc = exec__host_all_reduce_f64(rs, buf, total, COMM_SUM);
  char why[384];
  agree_verdict verdict = AGREE_SAME;
  if (rc == 0) {
    if (count > 0)
      memcpy(values, buf, count * sizeof *buf);
    verdict = agree_check(a, buf + count, (unsigned)rs->job->world_size, why, sizeof why);
  }
  if (buf != small)
    free(buf);
  if (rc != 0)
    return rc;
  if (verdict == AGREE_SAME)
    return 0;
  if (verdict == AGREE_REFUSED && a->refused)
    exec_error(op, refusal_status, "%s", refusal);
  else if (verdict == AGREE_REFUSED)
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
               "another rank's %s was refused (%s): every rank's must be valid and the same, "
               "and nothing changed",
               what, why);
  else
    exec_error(op, ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT,
               "the ranks sent different %s: %s differ; every rank must send the same, and "
               "nothing changed",
               what, why);
  return 1;
}
