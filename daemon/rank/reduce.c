/* REDUCE: a unit's gradients, reduce-scattered from every rank's gradient
 * buffer into each rank's fp32 accumulator for its shard. */
#include "exec_impl.h"

#include "pool.h"

void exec__handle_reduce(rank_state *rs, exec_op *op) {
  Zerod__V1__ReduceRequest *req = (Zerod__V1__ReduceRequest *)op->request;
  if (exec__op_job_failed(rs, op))
    return;
  unit_layout *l;
  shard *sh = exec__lookup_shard(rs, op, req->unit_id, &l);
  if (sh == NULL || exec__refuse_base_unit(op, sh, l, "reduce"))
    return;
  if (sh->grad_buf < 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION,
               "reduce of unit '%s' without a gradient buffer (ask for it with grad_buffer first)",
               l->name);
    return;
  }
  pool_buf *b = &rs->bufs[sh->grad_buf];
  if (exec__grow_scratch(rs, rs->job->config.working_dtype == ZK_F32 ? 0 : l->padded_numel,
                         l->shard_numel) != 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, "out of memory for reduce");
    return;
  }
  /* fp32 gradients are reduced in the worker's buffer itself (its contents
   * are undefined after the reduce, as documented); lower precisions are
   * widened first so the sum is taken in fp32. On a GPU rank the stream
   * first waits for the worker's "gradient written" record of the buffer's
   * event, and records it again once the daemon has read the buffer. */
  device *dev = rs->dev;
  float *send = b->buf.base;
  int err = device_buffer_wait(dev, &b->buf);
  if (err == 0 && rs->job->config.working_dtype != ZK_F32) {
    err = device_cast(dev, rs->scratch, ZK_F32, b->buf.base, rs->job->config.working_dtype,
                      l->padded_numel);
    send = rs->scratch;
  }
  for (unsigned k = 0; k < sh->nzero_ranges && err == 0; k++)
    err = device_zero(dev, send + sh->zero_ranges[k].begin,
                      (sh->zero_ranges[k].end - sh->zero_ranges[k].begin) * sizeof(float));
  if (err != 0) {
    exec__op_device_failed(rs, op, "reduce", err);
    return;
  }
  /* qgZ or bf16 gradients: how a hierarchical communicator's cross-node
   * half travels (any other communicator reduces exactly). */
  const job_config *config = &rs->job->config;
  comm_wire wire = {.format = COMM_WIRE_F32, .block = config->quantization_block};
  if (config->quantized_gradients == 8)
    wire.format = COMM_WIRE_INT8;
  else if (config->quantized_gradients == 4)
    wire.format = COMM_WIRE_INT4;
  else if (config->gradient_comm_dtype == ZK_BF16)
    wire.format = COMM_WIRE_BF16;
  if (exec__onebit_wire(rs, sh, l, &wire) != 0 || exec__lowrank_wire(rs, sh, l, &wire) != 0) {
    exec_error(op, ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED,
               "out of memory for the compression state (error feedback) of unit '%s'", l->name);
    return;
  }
  err = comm_reduce_scatter_f32_wire(rs->comm, send, rs->shard_scratch, l->shard_numel, &wire);
  if (err != 0) {
    exec__op_comm_failed(rs, op, "reduce_scatter", err);
    return;
  }
  rank_metrics_collective(rs, RANK_REDUCE_SCATTER);
  err = device_accumulate(dev, sh->grad_acc, rs->shard_scratch, l->shard_numel);
  if (err == 0)
    err = device_buffer_publish(dev, &b->buf);
  if (err == 0)
    err = device_sync(dev);
  if (err != 0) {
    exec__op_device_failed(rs, op, "reduce", err);
    return;
  }
  pool_unref(rs, b);
  b->unit = -1;
  sh->grad_buf = -1;
  Zerod__V1__ReduceReply reply = ZEROD__V1__REDUCE_REPLY__INIT;
  reply.unit_id = req->unit_id;
  exec_reply(op, ZEROD__V1__MSG_TYPE__MSG_REDUCE_REPLY, &reply.base);
}
