/* coord_locate: LocateJob, where a job is served, for a node that follows
 * it for its own read-only sessions (docs/subscribe.md, "Across nodes").
 *
 * The caller is a node (authz.c); what admits it to this job is the token
 * one of its workers presented, checked here against the job's owner and
 * read tokens, so a node learns where a job is only for a worker that may
 * read it. The node that hosts the job checks the token again when the
 * follower attaches there. */
#include <stdio.h>
#include <string.h>

#include "coord_impl.h"
#include "digest.h"

/* Whether token admits a read-only session of j: its owner token or one
 * of its read tokens, by hash, compared in constant time. */
static int token_admits(const cjob *j, const char *token) {
  char hash[DIGEST_HEX_BYTES];
  digest_sha256_hex(token, hash);
  int ok = digest_hex_equal(j->token_sha256, hash);
  for (size_t i = 0; i < j->n_read_tokens; i++)
    ok |= digest_hex_equal(j->read_tokens[i], hash);
  return ok;
}

static void on_locate_job(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  Zerod__V1__LocateJobRequest *req = coord__begin(c, call, CTL_LOCATE_JOB, request, request_bytes);
  if (req == NULL)
    return;
  cjob *j = coord__find_job(c, req->name);
  char address[COORD_ADDR_BYTES] = "";
  if (j == NULL || j->deleting) {
    coord__finish_error(call, RPC_NOT_FOUND, "no job named '%s'", req->name);
  } else if (!token_admits(j, req->token)) {
    coord__finish_error(call, RPC_PERMISSION_DENIED,
                        "the token admits no session of job '%s' (neither its owner token nor a "
                        "read token)",
                        req->name);
  } else if (j->msg->n_placement != 1) {
    coord__finish_error(call, RPC_FAILED_PRECONDITION,
                        "job '%s' has ranks on %zu nodes; a node follows jobs whose ranks are all "
                        "on one node",
                        req->name, j->msg->n_placement);
  } else {
    const char *node = j->msg->placement[0]->node;
    coord__replica_address(c, node, address, sizeof address);
    if (address[0] == '\0') {
      coord__finish_error(call, RPC_UNAVAILABLE,
                          "node '%s', which hosts job '%s', is not a member now (or serves no "
                          "replicas); try again",
                          node, req->name);
    } else {
      Zerod__V1__LocateJobReply reply = ZEROD__V1__LOCATE_JOB_REPLY__INIT;
      reply.job_id = j->msg->id;
      reply.node = (char *)node;
      reply.replica_address = address;
      coord__finish_message(call, &reply.base);
    }
  }
  ctl_free(&req->base);
}

int coord__locate_register(coord *c, rpc_server *server) {
  static const coord_method methods[] = {
      {CTL_LOCATE_JOB, RPC_UNARY, on_locate_job},
  };
  return coord__add_methods(c, server, methods, sizeof methods / sizeof methods[0]);
}
