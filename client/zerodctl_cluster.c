/* zerodctl_cluster: the commands about the cluster itself
 * (zerodctl_impl.h).
 *
 * members (the coordinator's view: its epoch and live nodes) and health
 * (grpc.health.v1: exit status 0 only when SERVING). Calls
 * zerodctl_call.c and zerodctl_output.c. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "zerodctl_impl.h"

/* ------------------------------------------------------------------------ */
/* members                                                                  */
/* ------------------------------------------------------------------------ */

/* "cuda:8", "cpu:1,cuda:2", in order of first appearance; "" for none. */
static void format_devices(const Zerod__V1__NodeInfo *node, char *out, size_t out_bytes) {
  out[0] = '\0';
  size_t used = 0;
  for (size_t i = 0; node != NULL && i < node->n_devices; i++) {
    const char *kind = node->devices[i]->kind;
    bool seen = false;
    for (size_t k = 0; k < i && !seen; k++)
      seen = strcmp(node->devices[k]->kind, kind) == 0;
    if (seen)
      continue;
    size_t count = 0;
    for (size_t k = i; k < node->n_devices; k++)
      count += strcmp(node->devices[k]->kind, kind) == 0;
    int n = snprintf(out + used, out_bytes - used, "%s%s:%zu", used ? "," : "",
                     kind[0] ? kind : "?", count);
    if (n < 0 || (size_t)n >= out_bytes - used)
      break;
    used += (size_t)n;
  }
}

static void json_member(json_out *j, const Zerod__V1__Member *m) {
  static const Zerod__V1__NodeInfo no_node = ZEROD__V1__NODE_INFO__INIT;
  const Zerod__V1__NodeInfo *node = m->node != NULL ? m->node : &no_node;
  ctl__json_open(j, NULL, '{');
  ctl__json_str(j, "name", node->name);
  ctl__json_str(j, "address", node->address);
  ctl__json_u64(j, "ranks", node->ranks);
  ctl__json_open(j, "devices", '[');
  for (size_t d = 0; d < node->n_devices; d++) {
    const Zerod__V1__Device *dev = node->devices[d];
    ctl__json_open(j, NULL, '{');
    ctl__json_str(j, "kind", dev->kind);
    ctl__json_u64(j, "index", dev->index);
    ctl__json_str(j, "name", dev->name);
    ctl__json_u64(j, "memory_bytes", dev->memory_bytes);
    ctl__json_close(j, '}');
  }
  ctl__json_close(j, ']');
  ctl__json_u64(j, "memory_bytes", node->memory_bytes);
  ctl__json_str(j, "version", node->version);
  ctl__json_id(j, "session", m->session);
  ctl__json_i64(j, "joined_unix_ms", m->joined_unix_ms);
  ctl__json_i64(j, "lease_remaining_ms", m->lease_remaining_ms);
  ctl__json_close(j, '}');
}

int ctl__cmd_members(ctl *c, int argc, char **argv) {
  Zerod__V1__GetViewRequest request = ZEROD__V1__GET_VIEW_REQUEST__INIT;
  Zerod__V1__View *view;
  int rc = ctl__call(c, "/zerod.v1.Cluster/GetView", &request.base, &zerod__v1__view__descriptor,
                     (ProtobufCMessage **)&view);
  if (rc != 0)
    return rc;

  if (c->json) {
    json_out j = {.out = stdout};
    ctl__json_open(&j, NULL, '{');
    ctl__json_u64(&j, "epoch", view->epoch);
    ctl__json_open(&j, "members", '[');
    for (size_t i = 0; i < view->n_members; i++)
      json_member(&j, view->members[i]);
    ctl__json_close(&j, ']');
    ctl__json_close(&j, '}');
    zerod__v1__view__free_unpacked(view, NULL);
    return 0;
  }

  static const char *const headers[] = {"NAME",   "ADDRESS", "RANKS", "DEVICES",
                                        "MEMORY", "LEASE",   "JOINED"};
  table t;
  ctl__table_init(&t, 7, headers);
  for (size_t i = 0; i < view->n_members && rc == 0; i++) {
    const Zerod__V1__Member *m = view->members[i];
    char cells[7][TABLE_CELL_BYTES];
    const Zerod__V1__NodeInfo *node = m->node;
    snprintf(cells[0], TABLE_CELL_BYTES, "%s", node != NULL ? node->name : "");
    snprintf(cells[1], TABLE_CELL_BYTES, "%s", node != NULL ? node->address : "");
    snprintf(cells[2], TABLE_CELL_BYTES, "%" PRIu32, node != NULL ? node->ranks : 0);
    format_devices(node, cells[3], TABLE_CELL_BYTES);
    ctl__format_bytes(node != NULL ? node->memory_bytes : 0, cells[4], TABLE_CELL_BYTES);
    if (m->lease_remaining_ms > 0)
      snprintf(cells[5], TABLE_CELL_BYTES, "%.1fs", (double)m->lease_remaining_ms / 1000.0);
    else
      snprintf(cells[5], TABLE_CELL_BYTES, "expired");
    ctl__format_unix_ms(m->joined_unix_ms, cells[6], TABLE_CELL_BYTES);
    if (ctl__table_add_row(&t, cells) != 0)
      rc = ctl__fail_line(CTL_EXIT_FAILED, "%s: %s", c->command, strerror(ENOMEM));
  }
  if (rc == 0) {
    printf("epoch: %" PRIu64 "\n", view->epoch);
    ctl__table_print(&t, stdout);
  }
  ctl__table_free(&t);
  zerod__v1__view__free_unpacked(view, NULL);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* health                                                                   */
/* ------------------------------------------------------------------------ */

int ctl__cmd_health(ctl *c, int argc, char **argv) {
  Grpc__Health__V1__HealthCheckRequest request = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  request.service = argc > 0 ? argv[0] : "";
  Grpc__Health__V1__HealthCheckResponse *reply;
  int rc =
      ctl__call(c, "/grpc.health.v1.Health/Check", &request.base,
                &grpc__health__v1__health_check_response__descriptor, (ProtobufCMessage **)&reply);
  if (rc != 0)
    return rc;
  Grpc__Health__V1__HealthCheckResponse__ServingStatus status = reply->status;
  grpc__health__v1__health_check_response__free_unpacked(reply, NULL);
  if (c->json) {
    json_out j = {.out = stdout};
    ctl__json_open(&j, NULL, '{');
    ctl__json_str(&j, "service", request.service);
    ctl__json_str(&j, "status", ctl__serving_status_name(status, true));
    ctl__json_close(&j, '}');
  } else {
    printf("%s\n", ctl__serving_status_name(status, false));
  }
  if (status != GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING)
    return ctl__fail_line(CTL_EXIT_FAILED, "%s: the coordinator at %s is %s", c->command,
                          c->coordinator, ctl__serving_status_name(status, false));
  return 0;
}
