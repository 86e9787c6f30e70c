/* ckpt_manifest: manifest.json (and layout.json) encoded, loaded and
 * stored (ckpt.h, ckpt_manifest_*); decoding and the name rules are in
 * ckpt_manifest_decode.c. The other parts of the formats: ckpt_shard.c
 * (the shard file's layout and header), ckpt_shard_writer.c,
 * ckpt_shard_reader.c, ckpt_source.c (a directory read by ranges),
 * ckpt_safetensors.c, ckpt_hash.c, ckpt_io.c.
 *
 * manifest.json, format_version 2. Keys are written in this order and all
 * are required; unknown keys are refused (a new key means a new
 * format_version, which is checked before anything else so that an old
 * reader says "unsupported format_version" rather than "unknown key").
 * Version 1 is read too: it is version 2 without "tenant".
 *
 *   {
 *     "format": "zerod-checkpoint",
 *     "format_version": 2,
 *     "job": "<path-safe name>",         the saving job's name
 *     "job_id": <u>,
 *     "tenant": "<tenant>" | "",         the owner: 1..64 of [A-Za-z0-9._-], or none
 *     "name": "<path-safe name>",        the checkpoint's name
 *     "created_unix_ms": <i64>,
 *     "step": <u>,
 *     "version": <u>,
 *     "world_size": <1..4096>,
 *     "config": {"optimizer": "adamw" | "adam" | "sgd", "lr": <r>, "beta1": <r>,
 *                "beta2": <r>, "eps": <r>, "weight_decay": <r>, "momentum": <r>,
 *                "dampening": <r>, "nesterov": <bool>,
 *                "working_dtype": "fp32" | "bf16" | "fp16", "max_grad_norm": <r>},
 *     "states": ["master", "moment1", "moment2"],
 *     "units": [{"name": "<name>", "numel": <u>, "padded_numel": <u>, "shard_numel": <u>,
 *                "tensors": [{"name": "<name>", "shape": [<u>, ...], "offset": <u>,
 *                             "frozen": <bool>}, ...]}, ...],
 *     "files": [{"name": "rank-00000-of-00002.zdshard", "bytes": <u>,
 *                "xxh64": "<16 lower-case hex digits>"}, ...]
 *   }
 *
 * <u> is a JSON integer in [0, 2^63 - 1] (jansson holds integers as long
 * long, so every value up to there survives exactly, unlike a double).
 * <r> is a finite JSON number, written with 17 significant digits so that
 * it reads back bit for bit. "states" is "master" followed by the moments
 * the job keeps, in that order. Path-safe names (job and checkpoint, which
 * name directories) are 1..255 bytes without '/' and not "." or "..".
 * Unit and tensor names are 1..256 bytes: exactly what the IPC protocol
 * lets a worker register (proto/frame.c), so that any job can be saved.
 * "units[].numel" is the end of the unit's last tensor; "files" has one
 * entry per rank, whose "bytes" must equal the size the units imply. A
 * layout (layout.json, CKPT_DECODE_NO_FILES) is the same without "files";
 * decoding with that flag ignores a "files" member, so a complete manifest
 * also reads as a layout. */
#include "ckpt.h"
#include "ckpt_impl.h"
#include "ckpt_io.h"
#include "fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

/* ------------------------------------------------------------------------
 * Manifest encoding
 * ------------------------------------------------------------------------ */

/* JSON integers are long long in jansson: larger values have no encoding
 * (NULL, which makes the whole encode fail). */
static json_t *json_u64(uint64_t v) {
  return v <= (uint64_t)INT64_MAX ? json_integer((json_int_t)v) : NULL;
}

/* Each helper takes ownership of value, as json_object_set_new does, and
 * turns a NULL value (out of memory, or nothing JSON can hold: a non-finite
 * real, a string that is not UTF-8) into a failure the caller sees once.
 * They are chained with &&, so a container built before the chain is passed
 * as json_incref(container) and released after it whether or not the
 * chain got that far. */
static int set(json_t *obj, const char *key, json_t *value) {
  return value != NULL && json_object_set_new(obj, key, value) == 0;
}

static int append(json_t *array, json_t *value) {
  return value != NULL && json_array_append_new(array, value) == 0;
}

static json_t *encode_config(const ckpt_config *c) {
  json_t *o = json_object();
  if (o == NULL)
    return NULL;
  /* The fixed-size strings need not be NUL-terminated by a careless
   * caller; bound them. */
  int ok =
      set(o, "optimizer", json_stringn(c->optimizer, strnlen(c->optimizer, sizeof c->optimizer))) &&
      set(o, "lr", json_real(c->lr)) && set(o, "beta1", json_real(c->beta1)) &&
      set(o, "beta2", json_real(c->beta2)) && set(o, "eps", json_real(c->eps)) &&
      set(o, "weight_decay", json_real(c->weight_decay)) &&
      set(o, "momentum", json_real(c->momentum)) && set(o, "dampening", json_real(c->dampening)) &&
      set(o, "nesterov", json_boolean(c->nesterov)) &&
      set(o, "working_dtype",
          json_stringn(c->working_dtype, strnlen(c->working_dtype, sizeof c->working_dtype))) &&
      set(o, "max_grad_norm", json_real(c->max_grad_norm));
  if (!ok) {
    json_decref(o);
    return NULL;
  }
  return o;
}

static json_t *encode_tensor(const ckpt_tensor *t) {
  json_t *o = json_object(), *shape = json_array();
  int ok = o != NULL && shape != NULL && t->ndim <= CKPT_MAX_TENSOR_DIM;
  for (unsigned d = 0; ok && d < t->ndim; d++)
    ok = append(shape, json_u64(t->shape[d]));
  ok = ok && set(o, "name", t->name != NULL ? json_string(t->name) : NULL) &&
       set(o, "shape", json_incref(shape)) && set(o, "offset", json_u64(t->offset)) &&
       set(o, "frozen", json_boolean(t->frozen));
  json_decref(shape);
  if (!ok) {
    json_decref(o);
    return NULL;
  }
  return o;
}

static json_t *encode_unit(const ckpt_unit *u) {
  json_t *o = json_object(), *tensors = json_array();
  int ok = o != NULL && tensors != NULL && (u->ntensors == 0 || u->tensors != NULL);
  for (unsigned i = 0; ok && i < u->ntensors; i++)
    ok = append(tensors, encode_tensor(&u->tensors[i]));
  ok = ok && set(o, "name", u->name != NULL ? json_string(u->name) : NULL) &&
       set(o, "numel", json_u64(u->numel)) && set(o, "padded_numel", json_u64(u->padded_numel)) &&
       set(o, "shard_numel", json_u64(u->shard_numel)) && set(o, "tensors", json_incref(tensors));
  json_decref(tensors);
  if (!ok) {
    json_decref(o);
    return NULL;
  }
  return o;
}

static json_t *encode_file(const ckpt_file_entry *f) {
  char hex[17];
  snprintf(hex, sizeof hex, "%016" PRIx64, f->xxh64);
  json_t *o = json_object();
  if (o == NULL)
    return NULL;
  if (!(set(o, "name", f->name != NULL ? json_string(f->name) : NULL) &&
        set(o, "bytes", json_u64(f->bytes)) && set(o, "xxh64", json_string(hex)))) {
    json_decref(o);
    return NULL;
  }
  return o;
}

/* "feedback": {"kind", "nodes", "numel": [per unit]}. */
static json_t *encode_feedback(const ckpt_manifest *m) {
  json_t *o = json_object(), *numel = json_array();
  int ok = o != NULL && numel != NULL && (m->nunits == 0 || m->feedback.numel != NULL);
  for (unsigned u = 0; ok && u < m->nunits; u++)
    ok = append(numel, json_u64(m->feedback.numel[u]));
  ok = ok && set(o, "kind", json_string(m->feedback.kind)) &&
       set(o, "nodes", json_integer(m->feedback.nodes)) && set(o, "numel", json_incref(numel));
  json_decref(numel);
  if (!ok) {
    json_decref(o);
    return NULL;
  }
  return o;
}

static json_t *encode_manifest(const ckpt_manifest *m) {
  json_t *root = json_object();
  if (root == NULL)
    return NULL;
  /* This code writes the current version only, whatever the struct says:
   * the version describes the text, not the caller's data. */
  int ok = ckpt__tenant_problem(m->tenant, strnlen(m->tenant, sizeof m->tenant)) == NULL &&
           set(root, "format", json_string(MANIFEST_FORMAT)) &&
           set(root, "format_version", json_integer(CKPT_MANIFEST_VERSION)) &&
           set(root, "job", m->job != NULL ? json_string(m->job) : NULL) &&
           set(root, "job_id", json_u64(m->job_id)) &&
           set(root, "tenant", json_string(m->tenant)) &&
           set(root, "name", m->name != NULL ? json_string(m->name) : NULL) &&
           set(root, "created_unix_ms", json_integer(m->created_unix_ms)) &&
           set(root, "step", json_u64(m->step)) && set(root, "version", json_u64(m->version)) &&
           set(root, "world_size", json_integer(m->world_size)) &&
           set(root, "config", encode_config(&m->config));
  json_t *states = ok ? json_array() : NULL;
  ok = ok && append(states, json_string("master")) &&
       (!m->has_moment1 || append(states, json_string("moment1"))) &&
       (!m->has_moment2 || append(states, json_string("moment2")));
  if (states != NULL) {
    ok = ok && set(root, "states", json_incref(states));
    json_decref(states);
  }
  if (ok && m->feedback.kind[0] != '\0')
    ok = set(root, "feedback", encode_feedback(m));
  json_t *units = ok ? json_array() : NULL;
  ok = ok && (m->nunits == 0 || m->units != NULL);
  for (unsigned u = 0; ok && u < m->nunits; u++)
    ok = append(units, encode_unit(&m->units[u]));
  if (units != NULL) {
    ok = ok && set(root, "units", json_incref(units));
    json_decref(units);
  }
  if (ok && m->files != NULL) {
    json_t *files = json_array();
    for (uint32_t k = 0; files != NULL && ok && k < m->world_size; k++)
      ok = append(files, encode_file(&m->files[k]));
    ok = ok && files != NULL && set(root, "files", json_incref(files));
    json_decref(files);
  }
  if (!ok) {
    json_decref(root);
    return NULL;
  }
  return root;
}

char *ckpt_manifest_encode(const ckpt_manifest *m, size_t *len) {
  json_t *root = encode_manifest(m);
  if (root == NULL)
    return NULL;
  /* Insertion order (which jansson keeps) and 17 significant digits make
   * the text a function of the manifest alone. */
  char *text = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
  json_decref(root);
  if (text == NULL)
    return NULL;
  size_t text_len = strlen(text);
  char *out = malloc(text_len + 2);
  if (out != NULL) {
    memcpy(out, text, text_len);
    out[text_len] = '\n'; /* a text file ends with a newline */
    out[text_len + 1] = '\0';
    *len = text_len + 1;
  }
  free(text);
  return out;
}

/* ------------------------------------------------------------------------
 * Manifest files
 * ------------------------------------------------------------------------ */

int ckpt_manifest_load(const char *dir, const char *file, int flags, ckpt_manifest *out, char *err,
                       size_t err_bytes) {
  memset(out, 0, sizeof *out);
  const char *name = ckpt_base_name(file);
  char *path = ckpt_join_path(dir, file);
  if (path == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  /* O_NOFOLLOW here and for every file of a checkpoint: a checkpoint's
   * files are regular files in its directory, never links to elsewhere. */
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  free(path);
  if (fd < 0)
    return ckpt_fail(err, err_bytes, -errno, "%s: %s", name, strerror(errno));
  char *text = NULL;
  struct stat st;
  int rc = 0;
  if (fstat(fd, &st) != 0) {
    rc = ckpt_fail(err, err_bytes, -errno, "%s: %s", name, strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    rc = ckpt_fail(err, err_bytes, -EINVAL, "%s: not a regular file", name);
  } else if ((uint64_t)st.st_size > CKPT_MAX_MANIFEST_BYTES) {
    rc = ckpt_fail(err, err_bytes, -ERANGE, "%s: %lld bytes, more than the %u a manifest may have",
                   name, (long long)st.st_size, CKPT_MAX_MANIFEST_BYTES);
  } else if ((text = malloc((size_t)st.st_size + 1)) == NULL) {
    rc = ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  } else if ((rc = fsutil_pread_all(fd, text, (size_t)st.st_size, 0)) != 0) {
    rc = rc > 0 ? ckpt_fail(err, err_bytes, -ERANGE, "%s: truncated while reading", name)
                : ckpt_fail(err, err_bytes, rc, "%s: %s", name, strerror(-rc));
  }
  close(fd);
  if (rc == 0) {
    rc = ckpt_manifest_decode(text, (size_t)st.st_size, flags, out, err, err_bytes);
    if (rc != 0)
      ckpt_prefix_error(err, err_bytes, name);
  }
  free(text);
  return rc;
}

/* Names a failed fsutil_replace the way a manifest's store always has:
 * the temporary file, or the manifest itself for the rename. */
static int replace_failed(int rc, const char *step, const char *name, char *err, size_t err_bytes) {
  if (rc == -ENOMEM && strcmp(step, "alloc") == 0)
    return ckpt_fail(err, err_bytes, rc, "%s: out of memory", name);
  if (strcmp(step, "rename") == 0)
    return ckpt_fail(err, err_bytes, rc, "%s: rename: %s", name, strerror(-rc));
  if (strcmp(step, "open") == 0 || strcmp(step, "write") == 0)
    return ckpt_fail(err, err_bytes, rc, "%s.tmp: %s", name, strerror(-rc));
  return ckpt_fail(err, err_bytes, rc, "%s.tmp: %s: %s", name, step, strerror(-rc));
}

int ckpt_manifest_store(const char *dir, const char *file, const ckpt_manifest *m, char *err,
                        size_t err_bytes) {
  const char *name = ckpt_base_name(file);
  size_t len;
  char *text = ckpt_manifest_encode(m, &len);
  if (text == NULL)
    return ckpt_fail(err, err_bytes, -EINVAL,
                     "%s: cannot encode the manifest: out of memory, or a value JSON cannot hold "
                     "(a missing name or one that is not UTF-8, an integer above 2^63 - 1, a "
                     "number that is not finite)",
                     name);
  /* Never write what would not load again: the same checks as a reader's. */
  ckpt_manifest check;
  int rc = ckpt_manifest_decode(text, len, m->files == NULL ? CKPT_DECODE_NO_FILES : 0, &check, err,
                                err_bytes);
  if (rc != 0) {
    ckpt_prefix_error(err, err_bytes, name);
    free(text);
    return rc;
  }
  ckpt_manifest_free(&check);
  char *path = ckpt_join_path(dir, file);
  if (path == NULL) {
    free(text);
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  }
  const char *step;
  rc = fsutil_replace(path, text, len, &step);
  free(path);
  free(text);
  if (rc != 0)
    return replace_failed(rc, step, name, err, err_bytes);
  /* The directory too, so that the rename survives a crash. */
  rc = fsutil_fsync_dir(dir, &step);
  if (rc != 0)
    return strcmp(step, "open") == 0
               ? ckpt_fail(err, err_bytes, rc, "%s: %s", dir, strerror(-rc))
               : ckpt_fail(err, err_bytes, rc, "%s: fsync: %s", dir, strerror(-rc));
  return 0;
}
