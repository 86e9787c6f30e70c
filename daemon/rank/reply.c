/* Replies: the frames a rank's ops answer with (exec_reply, exec_error,
 * the unit and config replies) and how an op fails when the job, the
 * device or the communicator did. */
#include "exec_impl.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "frame.h"
#include "log.h"

void exec_reply(exec_op *op, uint16_t type, const ProtobufCMessage *msg) {
  op->status = ZEROD__V1__STATUS__STATUS_OK;
  if (op->session == NULL || (op->flags & ZD_FRAME_F_NO_REPLY)) {
    if (op->reply_fd >= 0) {
      close(op->reply_fd);
      op->reply_fd = -1;
    }
    return;
  }
  unsigned nfds = op->reply_fd >= 0 ? 1 : 0;
  if (zd_frame_encode(type, op->request_id, 0, nfds, msg, &op->reply_frame, &op->reply_bytes) !=
      0) {
    op->reply_frame = NULL;
    op->status = ZEROD__V1__STATUS__STATUS_INTERNAL;
  }
}

void exec_error(exec_op *op, int status, const char *fmt, ...) {
  char message[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof message, fmt, ap);
  va_end(ap);
  op->status = status;
  if (op->reply_fd >= 0) {
    close(op->reply_fd);
    op->reply_fd = -1;
  }
  free(op->reply_frame);
  op->reply_frame = NULL;
  if (op->session == NULL)
    return;
  Zerod__V1__Error err = ZEROD__V1__ERROR__INIT;
  err.status = (Zerod__V1__Status)status;
  err.message = message;
  if (zd_frame_encode(ZEROD__V1__MSG_TYPE__MSG_ERROR, op->request_id, 0, 0, &err.base,
                      &op->reply_frame, &op->reply_bytes) != 0)
    op->reply_frame = NULL;
}

int exec_unit_reply(const job *j, const unit_layout *l, Zerod__V1__RegisterUnitReply *reply) {
  Zerod__V1__TensorPlacement *placements = calloc(l->ntensors, sizeof *placements);
  Zerod__V1__TensorPlacement **ptrs = calloc(l->ntensors, sizeof *ptrs);
  if (placements == NULL || ptrs == NULL) {
    free(placements);
    free(ptrs);
    return -ENOMEM;
  }
  for (unsigned t = 0; t < l->ntensors; t++) {
    zerod__v1__tensor_placement__init(&placements[t]);
    placements[t].name = l->tensors[t].name;
    placements[t].n_shape = l->tensors[t].ndim;
    placements[t].shape = (uint64_t *)l->tensors[t].shape;
    placements[t].offset = l->tensors[t].offset;
    placements[t].numel = l->tensors[t].numel;
    ptrs[t] = &placements[t];
  }
  reply->unit_id = l->id;
  reply->name = l->name;
  reply->numel = l->numel;
  reply->padded_numel = l->padded_numel;
  reply->shard_numel = l->shard_numel;
  reply->n_tensors = l->ntensors;
  reply->tensors = ptrs;
  reply->working_dtype = job_dtype_to_proto(j->config.working_dtype);
  reply->grad_dtype = job_dtype_to_proto(j->config.working_dtype);
  return 0;
}

void exec_unit_reply_free(Zerod__V1__RegisterUnitReply *reply) {
  if (reply->tensors != NULL && reply->n_tensors > 0)
    free(reply->tensors[0]); /* the placements, one block */
  free(reply->tensors);
  reply->tensors = NULL;
  reply->n_tensors = 0;
}

void exec_job_config(const job *j, double lr, double max_grad_norm, job_config_msg *out) {
  job_config_to_proto(&j->config, out);
  out->optimizer.lr = lr;
  out->config.max_grad_norm = max_grad_norm;
}

/* Checks the job's failure state; answers ABORTED and returns 1 if failed. */
int exec__op_job_failed(rank_state *rs, exec_op *op) {
  char reason[512];
  if (!job_failed(rs->job, rs->generation, reason, sizeof reason) && rs->comm != NULL)
    return 0;
  if (rs->comm == NULL && !job_failed(rs->job, rs->generation, reason, sizeof reason))
    snprintf(reason, sizeof reason, "rank %d has no communicator", rs->rank);
  exec_error(op, ZEROD__V1__STATUS__STATUS_ABORTED, "job '%s' failed: %s", rs->job->name, reason);
  return 1;
}

/* Passes a device call's result through, noting a failure so that the
 * collective it belongs to reports the device's error (exec__op_comm_failed). */
int exec__dev_call(rank_state *rs, int rc) {
  if (rc != 0)
    rs->failed_on_device = 1;
  return rc;
}

/* The rank's device failed (a GPU error is usually sticky, and the ranks'
 * states would drift apart): the job fails, and the op is answered. */
void exec__op_device_failed(rank_state *rs, exec_op *op, const char *what, int err) {
  job_fail(rs->job, rs->generation, "rank %d: %s: %s", rs->rank, what, device_last_error(rs->dev));
  char reason[512] = "";
  job_failed(rs->job, rs->generation, reason, sizeof reason);
  LOG_ERRORF("device failed", "job=%s rank=%d op=%s err=%d", rs->job->name, rs->rank, what, err);
  exec_error(op, ZEROD__V1__STATUS__STATUS_INTERNAL, "job '%s' failed: %s", rs->job->name, reason);
}

/* A collective failed: the job is failed for every rank (the communicator is
 * broken), and this op is answered with the reason. */
void exec__op_comm_failed(rank_state *rs, exec_op *op, const char *what, int err) {
  job_fail(rs->job, rs->generation, "rank %d: %s: %s", rs->rank, what,
           rs->failed_on_device ? device_last_error(rs->dev)
           : rs->comm != NULL   ? comm_last_error(rs->comm)
                                : strerror(-err));
  char reason[512] = "";
  job_failed(rs->job, rs->generation, reason, sizeof reason);
  if (atomic_load(&rs->stopping)) /* aborted by the daemon's stop, not a failure */
    LOG_INFOF("collective aborted; zerod is stopping", "job=%s rank=%d op=%s", rs->job->name,
              rs->rank, what);
  else
    LOG_ERRORF("collective failed", "job=%s rank=%d op=%s err=%d", rs->job->name, rs->rank, what,
               err);
  exec_error(op, ZEROD__V1__STATUS__STATUS_ABORTED, "job '%s' failed: %s", rs->job->name, reason);
}
