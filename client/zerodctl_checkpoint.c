/* zerodctl_checkpoint: the checkpoint commands and export
 * (zerodctl_impl.h).
 *
 * checkpoint save, list, delete and restore, and export: one call each to
 * the coordinator's Checkpoints service. Save, restore and export wait
 * for the whole job (600 s unless --timeout, set by the entry). Their
 * arguments were checked before (zerodctl_args.c). Calls zerodctl_call.c
 * and zerodctl_output.c. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "zerodctl_impl.h"

/* ------------------------------------------------------------------------ */
/* checkpoint                                                               */
/* ------------------------------------------------------------------------ */

static json_t *json_checkpoint(const Zerod__V1__Checkpoint *cp) {
  json_t *o = json_object();
  json_object_set_new(o, "job", ctl__json_str(cp->job));
  json_object_set_new(o, "name", ctl__json_str(cp->name));
  json_object_set_new(o, "path", ctl__json_str(cp->path));
  json_object_set_new(o, "step", ctl__json_count(cp->step));
  json_object_set_new(o, "world_size", ctl__json_count(cp->world_size));
  json_object_set_new(o, "bytes", ctl__json_count(cp->bytes));
  json_object_set_new(o, "created_unix_ms", json_integer(cp->created_unix_ms));
  json_object_set_new(o, "job_id", ctl__json_id(cp->job_id));
  json_object_set_new(o, "tenant", ctl__json_str(cp->tenant));
  return o;
}

int ctl__cmd_checkpoint_save(ctl *c, int argc, char **argv) {
  Zerod__V1__SaveRequest request = ZEROD__V1__SAVE_REQUEST__INIT;
  request.job = argv[0];
  request.name = argc > 1 ? argv[1] : "";
  Zerod__V1__SaveReply *reply;
  int rc = ctl__call(c, "/zerod.v1.Checkpoints/Save", &request.base,
                     &zerod__v1__save_reply__descriptor, (ProtobufCMessage **)&reply);
  if (rc != 0)
    return rc;
  if (reply->checkpoint == NULL) {
    zerod__v1__save_reply__free_unpacked(reply, NULL);
    return ctl__fail_line(CTL_EXIT_FAILED, "%s: the coordinator's reply has no checkpoint",
                          c->command);
  }
  const Zerod__V1__Checkpoint *cp = reply->checkpoint;
  if (c->json) {
    json_t *o = json_object();
    json_object_set_new(o, "checkpoint", json_checkpoint(cp));
    json_object_set_new(o, "stall_ms", json_integer(reply->stall_ms));
    json_object_set_new(o, "total_ms", json_integer(reply->total_ms));
    rc = ctl__json_print(o);
  } else {
    char text[64];
    ctl__print_field("job", "%s", cp->job);
    ctl__print_field("name", "%s", cp->name);
    ctl__print_field("step", "%" PRIu64, cp->step);
    ctl__print_field("size", "%s", ctl__format_bytes(cp->bytes, text, sizeof text));
    ctl__print_field("stall", "%s", ctl__format_ms(reply->stall_ms, text, sizeof text));
    ctl__print_field("total", "%s", ctl__format_ms(reply->total_ms, text, sizeof text));
    ctl__print_field("path", "%s", cp->path);
  }
  zerod__v1__save_reply__free_unpacked(reply, NULL);
  return rc;
}

int ctl__cmd_checkpoint_list(ctl *c, int argc, char **argv) {
  Zerod__V1__ListCheckpointsRequest request = ZEROD__V1__LIST_CHECKPOINTS_REQUEST__INIT;
  request.job = argc > 0 ? argv[0] : "";
  Zerod__V1__ListCheckpointsReply *reply;
  int rc = ctl__call(c, "/zerod.v1.Checkpoints/List", &request.base,
                     &zerod__v1__list_checkpoints_reply__descriptor, (ProtobufCMessage **)&reply);
  if (rc != 0)
    return rc;
  if (c->json) {
    json_t *list = json_array();
    for (size_t i = 0; i < reply->n_checkpoints; i++)
      json_array_append_new(list, json_checkpoint(reply->checkpoints[i]));
    zerod__v1__list_checkpoints_reply__free_unpacked(reply, NULL);
    return ctl__json_print(json_pack("{so}", "checkpoints", list));
  }
  static const char *const headers[] = {"JOB",  "NAME",    "STEP",  "WORLD",
                                        "SIZE", "CREATED", "TENANT"};
  table t;
  ctl__table_init(&t, 7, headers);
  for (size_t i = 0; i < reply->n_checkpoints && rc == 0; i++) {
    const Zerod__V1__Checkpoint *cp = reply->checkpoints[i];
    char cells[7][TABLE_CELL_BYTES];
    snprintf(cells[0], TABLE_CELL_BYTES, "%s", cp->job);
    snprintf(cells[1], TABLE_CELL_BYTES, "%s", cp->name);
    snprintf(cells[2], TABLE_CELL_BYTES, "%" PRIu64, cp->step);
    snprintf(cells[3], TABLE_CELL_BYTES, "%" PRIu32, cp->world_size);
    ctl__format_bytes(cp->bytes, cells[4], TABLE_CELL_BYTES);
    ctl__format_unix_ms(cp->created_unix_ms, cells[5], TABLE_CELL_BYTES);
    snprintf(cells[6], TABLE_CELL_BYTES, "%s", cp->tenant[0] != '\0' ? cp->tenant : "-");
    if (ctl__table_add_row(&t, cells) != 0)
      rc = ctl__fail_line(CTL_EXIT_FAILED, "%s: %s", c->command, strerror(ENOMEM));
  }
  if (rc == 0)
    ctl__table_print(&t, stdout);
  ctl__table_free(&t);
  zerod__v1__list_checkpoints_reply__free_unpacked(reply, NULL);
  return rc;
}

int ctl__cmd_checkpoint_delete(ctl *c, int argc, char **argv) {
  Zerod__V1__DeleteCheckpointRequest request = ZEROD__V1__DELETE_CHECKPOINT_REQUEST__INIT;
  request.job = argv[0];
  request.name = argv[1];
  Zerod__V1__DeleteCheckpointReply *reply;
  int rc = ctl__call(c, "/zerod.v1.Checkpoints/Delete", &request.base,
                     &zerod__v1__delete_checkpoint_reply__descriptor, (ProtobufCMessage **)&reply);
  if (rc != 0)
    return rc;
  zerod__v1__delete_checkpoint_reply__free_unpacked(reply, NULL);
  if (c->json)
    return ctl__json_print(
        json_pack("{soso}", "job", ctl__json_str(argv[0]), "deleted", ctl__json_str(argv[1])));
  printf("deleted checkpoint %s of job %s\n", argv[1], argv[0]);
  return 0;
}

int ctl__cmd_checkpoint_restore(ctl *c, int argc, char **argv) {
  Zerod__V1__RestoreRequest request = ZEROD__V1__RESTORE_REQUEST__INIT;
  request.job = argv[0];
  request.checkpoint = argv[1];
  Zerod__V1__RestoreReply *reply;
  int rc = ctl__call(c, "/zerod.v1.Checkpoints/Restore", &request.base,
                     &zerod__v1__restore_reply__descriptor, (ProtobufCMessage **)&reply);
  if (rc != 0)
    return rc;
  if (c->json) {
    json_t *o = json_object();
    json_object_set_new(o, "job", ctl__json_str(argv[0]));
    json_object_set_new(o, "checkpoint", ctl__json_str(argv[1]));
    json_object_set_new(o, "step", ctl__json_count(reply->step));
    json_object_set_new(o, "total_ms", json_integer(reply->total_ms));
    rc = ctl__json_print(o);
  } else {
    char text[64];
    char line[CTL_ERROR_LINE_BYTES];
    snprintf(line, sizeof line, "restored job %s from %s: step %" PRIu64 " in %s", argv[0], argv[1],
             reply->step, ctl__format_ms(reply->total_ms, text, sizeof text));
    ctl__sanitize_line(line);
    printf("%s\n", line);
  }
  zerod__v1__restore_reply__free_unpacked(reply, NULL);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* export                                                                   */
/* ------------------------------------------------------------------------ */

int ctl__cmd_export(ctl *c, int argc, char **argv) {
  (void)argc;
  Zerod__V1__ExportRequest request = ZEROD__V1__EXPORT_REQUEST__INIT;
  request.job = argv[0];
  request.checkpoint = c->export_checkpoint != NULL ? (char *)c->export_checkpoint : "";
  request.dtype = c->export_dtype != NULL && strcmp(c->export_dtype, "bf16") == 0
                      ? ZEROD__V1__EXPORT_DTYPE__EXPORT_DTYPE_BF16
                      : ZEROD__V1__EXPORT_DTYPE__EXPORT_DTYPE_F32;
  request.overwrite = c->export_overwrite;
  /* The coordinator writes the file, inside its export roots: a relative
   * path is sent as it is, and taken inside the first of them
   * (docs/checkpoints.md, "Where files may be read and written"). */
  request.path = argv[1];
  Zerod__V1__ExportReply *reply;
  int rc = ctl__call(c, "/zerod.v1.Checkpoints/Export", &request.base,
                     &zerod__v1__export_reply__descriptor, (ProtobufCMessage **)&reply);
  if (rc != 0)
    return rc;
  const char *dtype = request.dtype == ZEROD__V1__EXPORT_DTYPE__EXPORT_DTYPE_BF16 ? "bf16" : "fp32";
  if (c->json) {
    json_t *o = json_object();
    json_object_set_new(o, "job", ctl__json_str(argv[0]));
    json_object_set_new(o, "path", ctl__json_str(reply->path));
    json_object_set_new(o, "checkpoint", ctl__json_str(reply->checkpoint));
    json_object_set_new(o, "dtype", ctl__json_str(dtype));
    json_object_set_new(o, "step", ctl__json_count(reply->step));
    json_object_set_new(o, "tensors", ctl__json_count(reply->tensors));
    json_object_set_new(o, "bytes", ctl__json_count(reply->bytes));
    json_object_set_new(o, "total_ms", json_integer(reply->total_ms));
    rc = ctl__json_print(o);
  } else {
    char text[64];
    ctl__print_field("job", "%s", argv[0]);
    ctl__print_field("source", "%s",
                     reply->checkpoint[0] != '\0' ? reply->checkpoint : "(live state)");
    ctl__print_field("step", "%" PRIu64, reply->step);
    ctl__print_field("tensors", "%" PRIu32 " (%s)", reply->tensors, dtype);
    ctl__print_field("size", "%s", ctl__format_bytes(reply->bytes, text, sizeof text));
    ctl__print_field("total", "%s", ctl__format_ms(reply->total_ms, text, sizeof text));
    ctl__print_field("path", "%s", reply->path);
  }
  zerod__v1__export_reply__free_unpacked(reply, NULL);
  return rc;
}
