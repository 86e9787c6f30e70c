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

static json_t *json_device(const Zerod__V1__Device *dev) {
  json_t *o = json_object();
  json_object_set_new(o, "kind", ctl__json_str(dev->kind));
  json_object_set_new(o, "index", ctl__json_count(dev->index));
  json_object_set_new(o, "name", ctl__json_str(dev->name));
  json_object_set_new(o, "memory_bytes", ctl__json_count(dev->memory_bytes));
  return o;
}

static json_t *json_member(const Zerod__V1__Member *m) {
  static const Zerod__V1__NodeInfo no_node = ZEROD__V1__NODE_INFO__INIT;
  const Zerod__V1__NodeInfo *node = m->node != NULL ? m->node : &no_node;
  json_t *o = json_object(), *devices = json_array();
  for (size_t d = 0; d < node->n_devices; d++)
    json_array_append_new(devices, json_device(node->devices[d]));
  json_object_set_new(o, "name", ctl__json_str(node->name));
  json_object_set_new(o, "address", ctl__json_str(node->address));
  json_object_set_new(o, "ranks", ctl__json_count(node->ranks));
  json_object_set_new(o, "devices", devices);
  json_object_set_new(o, "memory_bytes", ctl__json_count(node->memory_bytes));
  json_object_set_new(o, "version", ctl__json_str(node->version));
  json_object_set_new(o, "session", ctl__json_id(m->session));
  json_object_set_new(o, "joined_unix_ms", json_integer(m->joined_unix_ms));
  json_object_set_new(o, "lease_remaining_ms", json_integer(m->lease_remaining_ms));
  return o;
}

int ctl__cmd_members(ctl *c, int argc, char **argv) {
  Zerod__V1__GetViewRequest request = ZEROD__V1__GET_VIEW_REQUEST__INIT;
  Zerod__V1__View *view;
  int rc = ctl__call(c, "/zerod.v1.Cluster/GetView", &request.base, &zerod__v1__view__descriptor,
                     (ProtobufCMessage **)&view);
  if (rc != 0)
    return rc;

  if (c->json) {
    /* The epoch is a counter from 1, bumped per membership change: a
     * count, not an id. */
    json_t *members = json_array();
    for (size_t i = 0; i < view->n_members; i++)
      json_array_append_new(members, json_member(view->members[i]));
    json_t *o = json_pack("{soso}", "epoch", ctl__json_count(view->epoch), "members", members);
    zerod__v1__view__free_unpacked(view, NULL);
    return ctl__json_print(o);
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
    rc = ctl__json_print(json_pack("{soso}", "service", ctl__json_str(request.service), "status",
                                   ctl__json_str(ctl__serving_status_name(status, true))));
  } else {
    printf("%s\n", ctl__serving_status_name(status, false));
  }
  if (status != GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING)
    return ctl__fail_line(CTL_EXIT_FAILED, "%s: the coordinator at %s is %s", c->command,
                          c->coordinator, ctl__serving_status_name(status, false));
  return rc;
}
