/* client_watch: zd_watch, a read-only job's subscriber waiting for the
 * next version, and zd_gather_delta, its reads of what changed
 * (docs/subscribe.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_impl.h"

/* Keeps the reply's unit list on the job (zd_update.changed) and learns
 * units the library has not listed yet (registered since the attach). */
static zd_status take_changed(zd_job *job, const Zerod__V1__WatchVersionReply *reply,
                              const char *what) {
  zd_unit *ids = NULL;
  if (reply->n_changed_units > 0) {
    ids = malloc(reply->n_changed_units * sizeof *ids);
    if (ids == NULL)
      return client__set_error(ZD_E_RESOURCE_EXHAUSTED, "%s: out of memory", what);
    memcpy(ids, reply->changed_units, reply->n_changed_units * sizeof *ids);
  }
  free(job->changed);
  job->changed = ids;
  for (size_t i = 0; i < reply->n_changed_units; i++)
    if (client__job_find_unit(job, ids[i]) == NULL)
      return zd_list_units(job, NULL);
  return ZD_OK;
}

zd_status zd_watch(zd_job *job, uint64_t after_version, int timeout_ms, zd_update *out) {
  char what[ZD_MAX_JOB_NAME_BYTES + 32];
  snprintf(what, sizeof what, "watch job %s", job != NULL ? job->name : "(null)");
  zd_status status = client__job_check(job, what);
  if (status != ZD_OK)
    return status;
  if (out == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "%s: out is NULL", what);
  if ((status = SIZED_OUT_CHECK(out, zd_update, changed, what, "ZD_UPDATE_INIT")) != ZD_OK)
    return status;
  if (!job->read_only)
    return client__set_error(ZD_E_FAILED_PRECONDITION,
                             "%s: only read-only jobs watch for versions; this one is attached "
                             "read-write and makes its own",
                             what);
  if (timeout_ms < 0 || (unsigned)timeout_ms > ZD_MAX_WATCH_TIMEOUT_MS)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "%s: timeout_ms %d is out of range (0 to %u, 24 h)", what, timeout_ms,
                             ZD_MAX_WATCH_TIMEOUT_MS);
  Zerod__V1__WatchVersionRequest request = ZEROD__V1__WATCH_VERSION_REQUEST__INIT;
  request.after_version = after_version;
  request.timeout_ms = (uint32_t)timeout_ms;
  ProtobufCMessage *reply_msg;
  int fds[ZD_FRAME_MAX_FDS];
  unsigned nfds;
  status = client__call(job->client, ZEROD__V1__MSG_TYPE__MSG_WATCH, &request.base, NULL, 0,
                        ZEROD__V1__MSG_TYPE__MSG_WATCH_REPLY, what, &reply_msg, fds, &nfds);
  if (status != ZD_OK)
    return status;
  const Zerod__V1__WatchVersionReply *reply = (const Zerod__V1__WatchVersionReply *)reply_msg;
  zd_update result = ZD_UPDATE_INIT;
  result.version = reply->version;
  result.timed_out = reply->timed_out;
  if (!reply->timed_out) {
    job->version = reply->version;
    job->pinned = 1;
    result.skipped = reply->skipped;
    result.step = reply->step;
    status = take_changed(job, reply, what);
    result.nchanged = status == ZD_OK ? (unsigned)reply->n_changed_units : 0;
    result.changed = status == ZD_OK ? job->changed : NULL;
  }
  protobuf_c_message_free_unpacked(reply_msg, NULL);
  if (status != ZD_OK)
    return status;
  client__sized_out_write(out, &result, sizeof result);
  return client__finish(job->client);
}

static size_t count_bits(const uint8_t *bits, size_t bytes) {
  size_t n = 0;
  for (size_t i = 0; i < bytes; i++)
    n += (size_t)__builtin_popcount(bits[i]);
  return n;
}

zd_status zd_gather_delta(zd_job *job, zd_unit unit, zd_view *out, zd_delta *delta) {
  char what[64];
  snprintf(what, sizeof what, "delta gather unit %u", (unsigned)unit);
  zd_status status = client__job_check(job, what);
  if (status != ZD_OK)
    return status;
  if (out == NULL || delta == NULL)
    return client__set_error(ZD_E_INVALID_ARGUMENT, "%s: out and delta must not be NULL", what);
  if ((status = SIZED_OUT_CHECK(out, zd_view, base, what, "ZD_VIEW_INIT")) != ZD_OK ||
      (status = SIZED_OUT_CHECK(delta, zd_delta, changed, what, "ZD_DELTA_INIT")) != ZD_OK)
    return status;
  if (!job->read_only)
    return client__set_error(ZD_E_FAILED_PRECONDITION,
                             "%s: delta gathers are for read-only jobs; this one is attached "
                             "read-write",
                             what);
  zd_pending pending = ZD_PENDING_INIT;
  if ((status = client__gather_async(job, unit, 1, &pending)) != ZD_OK)
    return status;
  client_delta answer;
  if ((status = client__gather_wait(job, &pending, out, &answer)) != ZD_OK)
    return status;
  zd_delta result = ZD_DELTA_INIT;
  result.full = !answer.delta;
  result.block_bytes = answer.block_bytes;
  if (answer.block_bytes == 0)
    return client__protocol_error(job->client, what, "the delta gather's reply has no block size");
  result.nblocks = (out->bytes + answer.block_bytes - 1) / answer.block_bytes;
  if (answer.delta) {
    result.from_version = answer.from;
    result.changed = answer.bits;
    result.nchanged = count_bits(answer.bits, answer.bits_bytes);
  }
  client__sized_out_write(delta, &result, sizeof result);
  return ZD_OK;
}
