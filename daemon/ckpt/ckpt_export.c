/* Export of a checkpoint's master weights to one safetensors file (ckpt.h). */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "ckpt_io.h"

/* The tensors of the file, in order, and where each one lives. */
typedef struct export_ctx {
  ckpt_source *source;
  unsigned *unit_of; /* [tensors] */
  const ckpt_tensor **tensor_of;
} export_ctx;

static int fill_tensor(void *arg, unsigned i, float *dst, uint64_t numel, char *err,
                       size_t err_bytes) {
  export_ctx *x = arg;
  const ckpt_tensor *t = x->tensor_of[i];
  if (numel != t->numel) {
    snprintf(err, err_bytes, "tensor '%.128s': %" PRIu64 " elements asked, %" PRIu64 " saved",
             t->name, numel, t->numel);
    return -EINVAL;
  }
  return ckpt_source_read(x->source, x->unit_of[i], CKPT_MASTER, t->offset, t->offset + t->numel,
                          dst, err, err_bytes);
}

/* {"format": "pt", "zerod.job": ..., "zerod.step": ..., "zerod.checkpoint": ...}:
 * "format" is what safetensors.torch writes; values are strings, as
 * safetensors requires. */
static char *export_metadata(const ckpt_manifest *m, const char *label) {
  json_t *md = json_object();
  char step[24];
  snprintf(step, sizeof step, "%" PRIu64, m->step);
  if (md == NULL || json_object_set_new(md, "format", json_string("pt")) != 0 ||
      json_object_set_new(md, "zerod.job", json_string(m->job)) != 0 ||
      json_object_set_new(md, "zerod.step", json_string(step)) != 0 ||
      (label != NULL && json_object_set_new(md, "zerod.checkpoint", json_string(label)) != 0)) {
    json_decref(md);
    return NULL;
  }
  char *text = json_dumps(md, JSON_COMPACT | JSON_PRESERVE_ORDER);
  json_decref(md);
  return text;
}

int ckpt_export(const char *dir, int out_dir_fd, const char *out_name, st_dtype dtype,
                const char *label, ckpt_export_info *out, char *err, size_t err_bytes) {
  memset(out, 0, sizeof *out);
  if (dtype != ST_F32 && dtype != ST_BF16) {
    snprintf(err, err_bytes, "%s: only F32 and BF16 are exported", out_name);
    return -EINVAL;
  }
  ckpt_source *source = NULL;
  int rc = ckpt_source_open(dir, &source, err, err_bytes);
  if (rc != 0)
    return rc;
  const ckpt_manifest *m = ckpt_source_manifest(source);
  unsigned n = 0;
  for (unsigned u = 0; u < m->nunits; u++)
    n += m->units[u].ntensors;
  export_ctx x = {.source = source};
  st_tensor *tensors = calloc(n > 0 ? n : 1, sizeof *tensors);
  x.unit_of = calloc(n > 0 ? n : 1, sizeof *x.unit_of);
  x.tensor_of = calloc(n > 0 ? n : 1, sizeof *x.tensor_of);
  char *metadata = export_metadata(m, label);
  if (tensors == NULL || x.unit_of == NULL || x.tensor_of == NULL || metadata == NULL) {
    snprintf(err, err_bytes, "%s: out of memory", out_name);
    rc = -ENOMEM;
    goto done;
  }
  unsigned i = 0;
  for (unsigned u = 0; u < m->nunits; u++) {
    for (unsigned k = 0; k < m->units[u].ntensors; k++, i++) {
      const ckpt_tensor *t = &m->units[u].tensors[k];
      tensors[i].name = t->name;
      tensors[i].dtype = dtype;
      tensors[i].ndim = t->ndim;
      memcpy(tensors[i].shape, t->shape, sizeof t->shape);
      tensors[i].numel = t->numel;
      x.unit_of[i] = u;
      x.tensor_of[i] = t;
    }
  }
  rc = st_write_at(out_dir_fd, out_name, tensors, n, metadata, fill_tensor, &x, err, err_bytes);
  if (rc == 0) {
    struct stat st;
    out->tensors = n;
    out->step = m->step;
    out->bytes =
        fstatat(out_dir_fd, out_name, &st, AT_SYMLINK_NOFOLLOW) == 0 ? (uint64_t)st.st_size : 0;
  }
done:
  free(metadata);
  free(x.tensor_of);
  free(x.unit_of);
  free(tensors);
  ckpt_source_close(source);
  return rc;
}
