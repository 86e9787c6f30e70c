/* ckpt_exports: Export (coord_ckpt.h; docs/checkpoints.md, "Export"):
 * a checkpoint written as one safetensors file where the caller asked,
 * inside an export root (ckpt_paths.c).
 *
 * An Export of a stored checkpoint reads its files alone (the job need
 * not exist): the checks and the write run on the thread pool, and the
 * export stays listed in coord.ckpt.exports until done, so that nothing
 * deletes or moves what it reads. An Export of a job's state now is a
 * save (ckpt_save.c) into a temporary checkpoint, which the save's commit
 * exports and removes. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "coord_ckpt.h"
#include "ctl_decode.h"
#include "log.h"

static void export_run(ckpt_work *base) {
  export_work *w = (export_work *)base;
  struct stat st;
  uint64_t step;
  uint32_t world_size;
  w->result.status = 0;
  if (coord__ckpt_stat_source(w->source, &st, &w->result) == 0) {
    if (!S_ISDIR(st.st_mode))
      coord__ckpt_work_fail(
          &w->result, RPC_INVALID_ARGUMENT,
          coord__ckpt_ends_with(w->source, ".safetensors")
              ? "%s is a safetensors file already; Export reads checkpoint directories"
              : "%s is not a checkpoint directory",
          w->source);
    else if (coord__ckpt_check_dir(w->source, &w->access, &step, &world_size, &w->result) == 0)
      coord__ckpt_export_to_file(w->source, &w->export, strrchr(w->source, '/') + 1, &w->info,
                                 &w->result);
  }
  w->total_ms = coord__ckpt_elapsed_ms(w->started_ns);
}

static void export_done(ckpt_work *base) {
  export_work *w = (export_work *)base;
  coord *c = w->base.c;
  for (export_work **p = &c->ckpt.exports; *p != NULL; p = &(*p)->next) {
    if (*p == w) {
      *p = w->next;
      break;
    }
  }
  if (w->result.status != 0) {
    LOG_WARNF("export failed", "source=%s path=%s error=\"%s\"", w->source, w->export.path,
              w->result.message);
    coord__metrics_checkpoint(c, "export", 0, 0, 0);
  } else {
    coord__metrics_checkpoint(c, "export", 1, (double)w->total_ms / 1e3, w->info.bytes);
    LOG_INFOF("checkpoint exported",
              "source=%s step=%" PRIu64 " tensors=%u bytes=%" PRIu64 " total_ms=%" PRId64
              " path=%s",
              w->source, w->info.step, w->info.tensors, w->info.bytes, w->total_ms, w->export.path);
  }
  if (w->call != NULL && w->result.status != 0) {
    rpc_call_set_cancel(w->call, NULL, NULL);
    rpc_call_finish(w->call, w->result.status, w->result.message, NULL, 0);
  } else if (w->call != NULL) {
    coord__ckpt_export_reply(w->call, w->export.path, &w->info, w->total_ms, w->source);
  }
  coord__ckpt_access_free(&w->access);
  free(w);
}

static void on_export_cancelled(rpc_call *call, void *arg) {
  export_work *w = arg;
  w->call = NULL;
  rpc_call_finish(call, rpc_call_remaining_ms(call) <= 0 ? RPC_DEADLINE_EXCEEDED : RPC_CANCELLED,
                  "export ended (the file may still be written)", NULL, 0);
}

static void on_export(rpc_call *call, const uint8_t *request, size_t request_bytes, void *arg) {
  coord *c = arg;
  coord_caller who;
  Zerod__V1__ExportRequest *req =
      coord__begin_as(c, call, CTL_EXPORT, request, request_bytes, &who);
  if (req == NULL)
    return;
  char err[PATH_MAX + 256];
  int status = 0;
  export_spec ex = {.dtype =
                        req->dtype == ZEROD__V1__EXPORT_DTYPE__EXPORT_DTYPE_BF16 ? ST_BF16 : ST_F32,
                    .overwrite = req->overwrite};
  const char *roots[COORD_MAX_EXPORT_ROOTS];
  size_t path_len = strlen(req->path);
  if (c->options.checkpoint_dir[0] == '\0') {
    snprintf(err, sizeof err, "this coordinator has no checkpoint directory");
    status = RPC_FAILED_PRECONDITION;
  } else if (path_len > 0 && req->path[path_len - 1] == '/') {
    snprintf(err, sizeof err, "export path %s names a directory; it must name a file", req->path);
    status = RPC_INVALID_ARGUMENT;
  } else {
    /* Relative: inside the first export root. */
    status = coord__ckpt_place_path("export path", req->path, roots,
                                    coord__ckpt_write_roots(c, roots), "export roots", ex.path,
                                    sizeof ex.path, &ex.root_len, err, sizeof err);
    /* Never into a job's checkpoint directory, whose files an export
     * would replace: <checkpoint-dir>/FILE is fine, <checkpoint-dir>/X/...
     * is not (X is, or may become, a job's). */
    size_t ckpt_len = strlen(c->options.checkpoint_dir);
    if (status == 0 && strncmp(ex.path, c->options.checkpoint_dir, ckpt_len) == 0 &&
        ex.path[ckpt_len] == '/' && strchr(ex.path + ckpt_len + 1, '/') != NULL) {
      snprintf(err, sizeof err,
               "export path %.1500s is inside a job's directory of the checkpoint directory "
               "%.1500s, whose "
               "files an export must not replace",
               ex.path, c->options.checkpoint_dir);
      status = RPC_PERMISSION_DENIED;
    }
  }
  if (status == 0 && req->checkpoint[0] == '\0') {
    /* The job's state now: saved into a temporary checkpoint, which the
     * commit exports and removes. */
    cjob *j = NULL;
    work_result target = {0};
    int dir_fd;
    const char *name;
    status = coord__ckpt_order_precheck(c, req->job, &j, err, sizeof err);
    /* Checked again before writing; here so that a mistake costs no save. */
    if (status == 0 && (status = coord__ckpt_export_target_open(&ex, &dir_fd, &name, &target)) != 0)
      snprintf(err, sizeof err, "%s", target.message);
    else if (status == 0)
      close(dir_fd);
    if (status == 0)
      status = coord__ckpt_save_start(c, j, "", call, 0, &ex, err, sizeof err);
  } else if (status == 0) {
    export_work *w = calloc(1, sizeof *w);
    if (w == NULL || coord__ckpt_access(c, &who, NULL, &w->access) != 0) {
      snprintf(err, sizeof err, "coordinator out of memory");
      status = RPC_RESOURCE_EXHAUSTED;
    } else {
      status = coord__ckpt_resolve_source(c, req->job, req->checkpoint, w->source, sizeof w->source,
                                          err, sizeof err);
    }
    if (status == 0) {
      w->base.run = export_run;
      w->base.done = export_done;
      w->call = call;
      w->export = ex;
      w->started_ns = uv_hrtime();
      w->next = c->ckpt.exports;
      c->ckpt.exports = w;
      rpc_call_set_cancel(call, on_export_cancelled, w);
      LOG_INFOF("export started", "source=%s path=%s dtype=%s", w->source, ex.path,
                ex.dtype == ST_BF16 ? "bf16" : "fp32");
      coord__ckpt_queue_work(c, &w->base);
    } else {
      if (w != NULL)
        coord__ckpt_access_free(&w->access);
      free(w);
    }
  }
  if (status != 0)
    coord__finish_error(call, status, "%s", err);
  ctl_free(&req->base);
}

int coord__ckpt_exports_register(coord *c, rpc_server *server) {
  static const coord_method methods[] = {{CTL_EXPORT, RPC_UNARY, on_export}};
  return coord__add_methods(c, server, methods, sizeof methods / sizeof methods[0]);
}
