/* Checkpoint formats (see ckpt.h): XXH64 hashing, manifest.json, shard
 * files written and read block by block, and checkpoint directories read
 * by element ranges. ckpt_safetensors.c has the safetensors part.
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
 * also reads as a layout.
 */
#include "ckpt.h"
#include "ckpt_impl.h"
#include "ckpt_io.h"
#include "filemode.h"

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

#define MANIFEST_FORMAT     "zerod-checkpoint"
#define MAX_PATH_NAME_BYTES 255u /* job and checkpoint names become directory names */
#define MAX_NAME_BYTES      256u /* unit and tensor names: ZD_MAX_NAME_BYTES of the protocol */

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
 * Manifest decoding
 *
 * Every check names where it failed ("units[2].tensors[0]: ...") and
 * returns -EBADMSG; the caller frees whatever was filled in so far, which
 * is why arrays are zeroed when allocated and their counts set at once.
 * ------------------------------------------------------------------------ */

__attribute__((format(printf, 4, 5))) static int bad(char *err, size_t err_bytes, const char *where,
                                                     const char *fmt, ...) {
  if (err != NULL && err_bytes > 0) {
    char what[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(err, err_bytes, "%s: %s", where, what);
  }
  return -EBADMSG;
}

static int check_keys(json_t *obj, const char *const *known, size_t nknown, const char *where,
                      char *err, size_t err_bytes) {
  const char *key;
  json_t *value;
  json_object_foreach(obj, key, value) {
    size_t i = 0;
    while (i < nknown && strcmp(key, known[i]) != 0)
      i++;
    if (i == nknown)
      return bad(err, err_bytes, where, "unknown key \"%.64s\"", key);
  }
  return 0;
}

static int get_member(json_t *obj, const char *key, const char *where, json_t **out, char *err,
                      size_t err_bytes) {
  *out = json_object_get(obj, key);
  if (*out == NULL)
    return bad(err, err_bytes, where, "missing \"%s\"", key);
  return 0;
}

/* An integer in [0, max]; max is at most INT64_MAX, the largest a JSON
 * integer can be here. */
static int get_uint(json_t *obj, const char *key, uint64_t max, const char *where, uint64_t *out,
                    char *err, size_t err_bytes) {
  json_t *value;
  int rc = get_member(obj, key, where, &value, err, err_bytes);
  if (rc != 0)
    return rc;
  if (!json_is_integer(value))
    return bad(err, err_bytes, where, "\"%s\" is not an integer", key);
  json_int_t v = json_integer_value(value);
  if (v < 0)
    return bad(err, err_bytes, where, "\"%s\" is negative (%" JSON_INTEGER_FORMAT ")", key, v);
  if ((uint64_t)v > max)
    return bad(err, err_bytes, where, "\"%s\" is %" JSON_INTEGER_FORMAT ", more than %" PRIu64, key,
               v, max);
  *out = (uint64_t)v;
  return 0;
}

static int get_real(json_t *obj, const char *key, const char *where, double *out, char *err,
                    size_t err_bytes) {
  json_t *value;
  int rc = get_member(obj, key, where, &value, err, err_bytes);
  if (rc != 0)
    return rc;
  if (!json_is_number(value))
    return bad(err, err_bytes, where, "\"%s\" is not a number", key);
  *out = json_number_value(value);
  return 0;
}

static int get_bool(json_t *obj, const char *key, const char *where, int *out, char *err,
                    size_t err_bytes) {
  json_t *value;
  int rc = get_member(obj, key, where, &value, err, err_bytes);
  if (rc != 0)
    return rc;
  if (!json_is_boolean(value))
    return bad(err, err_bytes, where, "\"%s\" is not true or false", key);
  *out = json_is_true(value);
  return 0;
}

static int get_string(json_t *obj, const char *key, const char *where, const char **out,
                      size_t *len, char *err, size_t err_bytes) {
  json_t *value;
  int rc = get_member(obj, key, where, &value, err, err_bytes);
  if (rc != 0)
    return rc;
  if (!json_is_string(value))
    return bad(err, err_bytes, where, "\"%s\" is not a string", key);
  *out = json_string_value(value);
  *len = json_string_length(value);
  return 0;
}

/* Why a name is refused, or NULL. jansson refuses "\u0000" without
 * JSON_ALLOW_NUL, but the length check keeps that from mattering. */
static const char *name_problem(const char *name, size_t len, int path_safe) {
  if (len == 0)
    return "is empty";
  if (len > (path_safe ? MAX_PATH_NAME_BYTES : MAX_NAME_BYTES))
    return path_safe ? "is longer than 255 bytes" : "is longer than 256 bytes";
  if (memchr(name, '\0', len) != NULL)
    return "contains a NUL byte";
  if (path_safe && memchr(name, '/', len) != NULL)
    return "contains '/'";
  if (path_safe && (strcmp(name, ".") == 0 || strcmp(name, "..") == 0))
    return "is \".\" or \"..\"";
  return NULL;
}

const char *ckpt__tenant_problem(const char *tenant, size_t len) {
  if (len > CKPT_TENANT_MAX_BYTES)
    return "is longer than 64 bytes";
  for (size_t i = 0; i < len; i++) {
    char ch = tenant[i];
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
          ch == '.' || ch == '_' || ch == '-'))
      return "holds a character other than [A-Za-z0-9._-]";
  }
  return NULL;
}

static int get_tenant(json_t *obj, const char *where, char out[CKPT_TENANT_MAX_BYTES + 1],
                      char *err, size_t err_bytes) {
  const char *tenant = NULL;
  size_t len = 0;
  int rc = get_string(obj, "tenant", where, &tenant, &len, err, err_bytes);
  if (rc != 0)
    return rc;
  const char *problem = ckpt__tenant_problem(tenant, len);
  if (problem != NULL)
    return bad(err, err_bytes, where, "\"tenant\" %s", problem);
  memcpy(out, tenant, len);
  out[len] = '\0';
  return 0;
}

static int get_name(json_t *obj, const char *key, int path_safe, const char *where, char **out,
                    char *err, size_t err_bytes) {
  const char *name = NULL; /* set when rc == 0; GCC -O3 cannot see it */
  size_t len = 0;
  int rc = get_string(obj, key, where, &name, &len, err, err_bytes);
  if (rc != 0)
    return rc;
  const char *problem = name_problem(name, len, path_safe);
  if (problem != NULL)
    return bad(err, err_bytes, where, "\"%s\" %s", key, problem);
  *out = strdup(name);
  if (*out == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", where);
  return 0;
}

static int compare_names(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The first name that appears twice among n, or NULL; -ENOMEM as *rc. */
static const char *duplicate_name(char **names, size_t n, int *rc) {
  *rc = 0;
  if (n < 2)
    return NULL;
  char **sorted = malloc(n * sizeof *sorted);
  if (sorted == NULL) {
    *rc = -ENOMEM;
    return NULL;
  }
  memcpy(sorted, names, n * sizeof *sorted);
  qsort(sorted, n, sizeof *sorted, compare_names);
  const char *dup = NULL;
  for (size_t i = 1; i < n && dup == NULL; i++)
    if (strcmp(sorted[i - 1], sorted[i]) == 0)
      dup = sorted[i];
  free(sorted);
  return dup;
}

static int decode_config(json_t *obj, ckpt_config *c, char *err, size_t err_bytes) {
  static const char *const keys[] = {
      "optimizer", "lr",        "beta1",    "beta2",         "eps",          "weight_decay",
      "momentum",  "dampening", "nesterov", "working_dtype", "max_grad_norm"};
  const char *where = "config";
  if (!json_is_object(obj))
    return bad(err, err_bytes, where, "is not an object");
  int rc = check_keys(obj, keys, sizeof keys / sizeof keys[0], where, err, err_bytes);
  const char *text = NULL;
  size_t len = 0;
  if (rc == 0 && (rc = get_string(obj, "optimizer", where, &text, &len, err, err_bytes)) == 0) {
    if (strcmp(text, "adamw") != 0 && strcmp(text, "adam") != 0 && strcmp(text, "sgd") != 0)
      return bad(err, err_bytes, where, "\"optimizer\" is not \"adamw\", \"adam\" or \"sgd\"");
    snprintf(c->optimizer, sizeof c->optimizer, "%s", text);
  }
  if (rc == 0 && (rc = get_string(obj, "working_dtype", where, &text, &len, err, err_bytes)) == 0) {
    if (strcmp(text, "fp32") != 0 && strcmp(text, "bf16") != 0 && strcmp(text, "fp16") != 0)
      return bad(err, err_bytes, where, "\"working_dtype\" is not \"fp32\", \"bf16\" or \"fp16\"");
    snprintf(c->working_dtype, sizeof c->working_dtype, "%s", text);
  }
  if (rc == 0)
    rc = get_real(obj, "lr", where, &c->lr, err, err_bytes);
  if (rc == 0)
    rc = get_real(obj, "beta1", where, &c->beta1, err, err_bytes);
  if (rc == 0)
    rc = get_real(obj, "beta2", where, &c->beta2, err, err_bytes);
  if (rc == 0)
    rc = get_real(obj, "eps", where, &c->eps, err, err_bytes);
  if (rc == 0)
    rc = get_real(obj, "weight_decay", where, &c->weight_decay, err, err_bytes);
  if (rc == 0)
    rc = get_real(obj, "momentum", where, &c->momentum, err, err_bytes);
  if (rc == 0)
    rc = get_real(obj, "dampening", where, &c->dampening, err, err_bytes);
  if (rc == 0)
    rc = get_bool(obj, "nesterov", where, &c->nesterov, err, err_bytes);
  if (rc == 0)
    rc = get_real(obj, "max_grad_norm", where, &c->max_grad_norm, err, err_bytes);
  return rc;
}

static int decode_states(json_t *states, ckpt_manifest *m, char *err, size_t err_bytes) {
  if (!json_is_array(states) || json_array_size(states) == 0 || json_array_size(states) > 3 ||
      !json_is_string(json_array_get(states, 0)) ||
      strcmp(json_string_value(json_array_get(states, 0)), "master") != 0)
    return bad(err, err_bytes, "states",
               "is not a list that starts with \"master\" (then \"moment1\", \"moment2\")");
  /* The moments may be absent (SGD without momentum has none) but keep
   * their order, which is the order of the data in the shard files. */
  int next = 1;
  for (size_t i = 1; i < json_array_size(states); i++) {
    const char *state = json_string_value(json_array_get(states, i));
    if (state != NULL && strcmp(state, "moment1") == 0 && next <= 1) {
      m->has_moment1 = 1;
      next = 2;
    } else if (state != NULL && strcmp(state, "moment2") == 0 && next <= 2) {
      m->has_moment2 = 1;
      next = 3;
    } else {
      return bad(err, err_bytes, "states",
                 "entry %zu is not \"moment1\" or \"moment2\" in that order, each once", i);
    }
  }
  return 0;
}

static int decode_tensor(json_t *obj, const char *where, uint64_t *prev_end, ckpt_tensor *t,
                         char *err, size_t err_bytes) {
  static const char *const keys[] = {"name", "shape", "offset", "frozen"};
  if (!json_is_object(obj))
    return bad(err, err_bytes, where, "is not an object");
  int rc = check_keys(obj, keys, sizeof keys / sizeof keys[0], where, err, err_bytes);
  if (rc == 0)
    rc = get_name(obj, "name", 0, where, &t->name, err, err_bytes);
  json_t *shape = NULL;
  if (rc == 0)
    rc = get_member(obj, "shape", where, &shape, err, err_bytes);
  if (rc != 0)
    return rc;
  if (!json_is_array(shape))
    return bad(err, err_bytes, where, "\"shape\" is not a list");
  if (json_array_size(shape) > CKPT_MAX_TENSOR_DIM)
    return bad(err, err_bytes, where, "\"shape\" has more than %d dimensions", CKPT_MAX_TENSOR_DIM);
  t->ndim = (unsigned)json_array_size(shape);
  t->numel = 1;
  for (unsigned d = 0; d < t->ndim; d++) {
    json_t *dim = json_array_get(shape, d);
    if (!json_is_integer(dim) || json_integer_value(dim) < 0)
      return bad(err, err_bytes, where, "\"shape\"[%u] is not a non-negative integer", d);
    t->shape[d] = (uint64_t)json_integer_value(dim);
    if (t->numel != 0 && t->shape[d] > UINT64_MAX / t->numel)
      return bad(err, err_bytes, where, "\"shape\" has more than 2^64 elements");
    t->numel *= t->shape[d];
  }
  if ((rc = get_uint(obj, "offset", (uint64_t)INT64_MAX, where, &t->offset, err, err_bytes)) != 0 ||
      (rc = get_bool(obj, "frozen", where, &t->frozen, err, err_bytes)) != 0)
    return rc;
  if (t->numel > UINT64_MAX - t->offset)
    return bad(err, err_bytes, where, "offset + numel overflows");
  if (t->offset < *prev_end)
    return bad(err, err_bytes, where,
               "starts at element %" PRIu64 ", before the end of the previous tensor (%" PRIu64
               "): tensors must be in offset order and not overlap",
               t->offset, *prev_end);
  *prev_end = t->offset + t->numel;
  return 0;
}

static int decode_unit(json_t *obj, unsigned index, uint32_t world_size, ckpt_unit *u, char *err,
                       size_t err_bytes) {
  static const char *const keys[] = {"name", "numel", "padded_numel", "shard_numel", "tensors"};
  char where[64];
  snprintf(where, sizeof where, "units[%u]", index);
  if (!json_is_object(obj))
    return bad(err, err_bytes, where, "is not an object");
  int rc = check_keys(obj, keys, sizeof keys / sizeof keys[0], where, err, err_bytes);
  json_t *tensors = NULL;
  if (rc == 0)
    rc = get_name(obj, "name", 0, where, &u->name, err, err_bytes);
  if (rc == 0)
    rc = get_uint(obj, "numel", (uint64_t)INT64_MAX, where, &u->numel, err, err_bytes);
  if (rc == 0)
    rc =
        get_uint(obj, "padded_numel", (uint64_t)INT64_MAX, where, &u->padded_numel, err, err_bytes);
  if (rc == 0)
    rc = get_uint(obj, "shard_numel", (uint64_t)INT64_MAX, where, &u->shard_numel, err, err_bytes);
  if (rc == 0)
    rc = get_member(obj, "tensors", where, &tensors, err, err_bytes);
  if (rc != 0)
    return rc;
  if (!json_is_array(tensors))
    return bad(err, err_bytes, where, "\"tensors\" is not a list");
  size_t ntensors = json_array_size(tensors);
  if (ntensors > UINT_MAX)
    return bad(err, err_bytes, where, "too many tensors");
  if (ntensors > 0) {
    u->tensors = calloc(ntensors, sizeof *u->tensors);
    if (u->tensors == NULL)
      return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", where);
    u->ntensors = (unsigned)ntensors;
  }
  uint64_t end = 0;
  for (unsigned i = 0; i < u->ntensors; i++) {
    char tensor_where[96];
    snprintf(tensor_where, sizeof tensor_where, "%s.tensors[%u]", where, i);
    rc = decode_tensor(json_array_get(tensors, i), tensor_where, &end, &u->tensors[i], err,
                       err_bytes);
    if (rc != 0)
      return rc;
  }
  if (u->numel != end)
    return bad(err, err_bytes, where,
               "\"numel\" is %" PRIu64 ", but its last tensor ends at element %" PRIu64, u->numel,
               end);
  if (u->shard_numel > UINT64_MAX / world_size || u->shard_numel * world_size != u->padded_numel)
    return bad(err, err_bytes, where,
               "\"padded_numel\" %" PRIu64 " is not \"shard_numel\" %" PRIu64
               " times world_size %" PRIu32,
               u->padded_numel, u->shard_numel, world_size);
  if (u->padded_numel < u->numel)
    return bad(err, err_bytes, where,
               "\"padded_numel\" %" PRIu64 " is less than \"numel\" %" PRIu64, u->padded_numel,
               u->numel);
  char **names = malloc((ntensors > 0 ? ntensors : 1) * sizeof *names);
  if (names == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", where);
  for (unsigned i = 0; i < u->ntensors; i++)
    names[i] = u->tensors[i].name;
  const char *dup = duplicate_name(names, ntensors, &rc);
  free(names);
  if (rc != 0)
    return ckpt_fail(err, err_bytes, rc, "%s: out of memory", where);
  if (dup != NULL)
    return bad(err, err_bytes, where, "two tensors are named \"%.256s\"", dup);
  return 0;
}

static int decode_files(json_t *files, ckpt_manifest *m, char *err, size_t err_bytes) {
  static const char *const keys[] = {"name", "bytes", "xxh64"};
  if (!json_is_array(files))
    return bad(err, err_bytes, "files", "is not a list");
  if (json_array_size(files) != m->world_size)
    return bad(err, err_bytes, "files", "has %zu entries for world_size %" PRIu32,
               json_array_size(files), m->world_size);
  m->files = calloc(m->world_size, sizeof *m->files);
  if (m->files == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "files: out of memory");
  uint64_t expect_bytes = ckpt_shard_file_bytes(m);
  for (uint32_t k = 0; k < m->world_size; k++) {
    ckpt_file_entry *f = &m->files[k];
    json_t *obj = json_array_get(files, k);
    char where[32], expect_name[40];
    snprintf(where, sizeof where, "files[%" PRIu32 "]", k);
    ckpt_shard_name(k, m->world_size, expect_name, sizeof expect_name);
    if (!json_is_object(obj))
      return bad(err, err_bytes, where, "is not an object");
    const char *name = NULL, *hex = NULL; /* set when rc == 0; GCC -O3 cannot see it */
    size_t name_len = 0, hex_len = 0;
    int rc = check_keys(obj, keys, sizeof keys / sizeof keys[0], where, err, err_bytes);
    if (rc == 0)
      rc = get_string(obj, "name", where, &name, &name_len, err, err_bytes);
    if (rc == 0 && strcmp(name, expect_name) != 0)
      return bad(err, err_bytes, where, "\"name\" is \"%.64s\", expected \"%s\"", name,
                 expect_name);
    if (rc == 0)
      rc = get_uint(obj, "bytes", (uint64_t)INT64_MAX, where, &f->bytes, err, err_bytes);
    if (rc == 0 && f->bytes != expect_bytes)
      return bad(err, err_bytes, where,
                 "\"bytes\" is %" PRIu64 ", but the units make a shard file of %" PRIu64 " bytes",
                 f->bytes, expect_bytes);
    if (rc == 0)
      rc = get_string(obj, "xxh64", where, &hex, &hex_len, err, err_bytes);
    if (rc != 0)
      return rc;
    if (hex_len != 16 || strspn(hex, "0123456789abcdef") != 16)
      return bad(err, err_bytes, where, "\"xxh64\" is not 16 lower-case hexadecimal digits");
    f->xxh64 = strtoull(hex, NULL, 16);
    if ((f->name = strdup(name)) == NULL)
      return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", where);
  }
  return 0;
}

static int decode_manifest(json_t *root, int flags, ckpt_manifest *m, char *err, size_t err_bytes) {
  static const char *const keys[] = {
      "format",  "format_version", "job",    "job_id", "name",  "created_unix_ms", "step",
      "version", "world_size",     "config", "states", "units", "files",           "tenant"};
  /* Version 1 has every key but the last. */
  size_t nkeys = sizeof keys / sizeof keys[0];
  const char *where = "manifest";
  if (!json_is_object(root))
    return bad(err, err_bytes, where, "is not a JSON object");
  const char *format = NULL;
  size_t format_len = 0;
  uint64_t version = 0, world_size = 0;
  int rc = get_string(root, "format", where, &format, &format_len, err, err_bytes);
  if (rc == 0 && strcmp(format, MANIFEST_FORMAT) != 0)
    return bad(err, err_bytes, where, "\"format\" is not \"" MANIFEST_FORMAT "\"");
  if (rc == 0)
    rc = get_uint(root, "format_version", (uint64_t)INT64_MAX, where, &version, err, err_bytes);
  if (rc == 0 && (version == 0 || version > CKPT_MANIFEST_VERSION))
    return bad(err, err_bytes, where, "unsupported format_version %" PRIu64 " (this is %d)",
               version, CKPT_MANIFEST_VERSION);
  if (rc == 0)
    rc = check_keys(root, keys, version == 1 ? nkeys - 1 : nkeys, where, err, err_bytes);
  if (rc != 0)
    return rc;
  m->format_version = (uint32_t)version;
  json_t *created, *config, *states, *units, *files = NULL;
  if ((rc = get_name(root, "job", 1, where, &m->job, err, err_bytes)) != 0 ||
      (rc = get_uint(root, "job_id", (uint64_t)INT64_MAX, where, &m->job_id, err, err_bytes)) !=
          0 ||
      (version >= 2 && (rc = get_tenant(root, where, m->tenant, err, err_bytes)) != 0) ||
      (rc = get_name(root, "name", 1, where, &m->name, err, err_bytes)) != 0 ||
      (rc = get_member(root, "created_unix_ms", where, &created, err, err_bytes)) != 0)
    return rc;
  if (!json_is_integer(created))
    return bad(err, err_bytes, where, "\"created_unix_ms\" is not an integer");
  m->created_unix_ms = json_integer_value(created);
  if ((rc = get_uint(root, "step", (uint64_t)INT64_MAX, where, &m->step, err, err_bytes)) != 0 ||
      (rc = get_uint(root, "version", (uint64_t)INT64_MAX, where, &m->version, err, err_bytes)) !=
          0 ||
      (rc = get_uint(root, "world_size", MAX_WORLD_SIZE, where, &world_size, err, err_bytes)) != 0)
    return rc;
  if (world_size == 0)
    return bad(err, err_bytes, where, "\"world_size\" is 0");
  m->world_size = (uint32_t)world_size;
  if ((rc = get_member(root, "config", where, &config, err, err_bytes)) != 0 ||
      (rc = decode_config(config, &m->config, err, err_bytes)) != 0 ||
      (rc = get_member(root, "states", where, &states, err, err_bytes)) != 0 ||
      (rc = decode_states(states, m, err, err_bytes)) != 0 ||
      (rc = get_member(root, "units", where, &units, err, err_bytes)) != 0)
    return rc;
  if (!(flags & CKPT_DECODE_NO_FILES) &&
      (rc = get_member(root, "files", where, &files, err, err_bytes)) != 0)
    return rc;

  if (!json_is_array(units))
    return bad(err, err_bytes, where, "\"units\" is not a list");
  size_t nunits = json_array_size(units);
  if (nunits > UINT_MAX)
    return bad(err, err_bytes, where, "too many units");
  if (nunits > 0) {
    m->units = calloc(nunits, sizeof *m->units);
    if (m->units == NULL)
      return ckpt_fail(err, err_bytes, -ENOMEM, "units: out of memory");
    m->nunits = (unsigned)nunits;
  }
  /* Every offset in a shard file must fit an off_t: sum the data with
   * overflow checks before any caller multiplies. */
  uint64_t data_bytes = 0, file_bytes;
  for (unsigned u = 0; u < m->nunits; u++) {
    if ((rc = decode_unit(json_array_get(units, u), u, m->world_size, &m->units[u], err,
                          err_bytes)) != 0)
      return rc;
    uint64_t unit_bytes_max = UINT64_MAX / (4 * ckpt_nstates(m));
    if (m->units[u].shard_numel > unit_bytes_max ||
        m->units[u].shard_numel * 4 * ckpt_nstates(m) > UINT64_MAX - data_bytes)
      return bad(err, err_bytes, "units", "the shard files would be larger than 2^64 bytes");
    data_bytes += m->units[u].shard_numel * 4 * ckpt_nstates(m);
  }
  if (ckpt__shard_file_bytes(data_bytes, &file_bytes) != 0)
    return bad(err, err_bytes, "units", "the shard files would be larger than 2^63 - 1 bytes");
  char **names = malloc((nunits > 0 ? nunits : 1) * sizeof *names);
  if (names == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "units: out of memory");
  for (unsigned u = 0; u < m->nunits; u++)
    names[u] = m->units[u].name;
  const char *dup = duplicate_name(names, nunits, &rc);
  free(names);
  if (rc != 0)
    return ckpt_fail(err, err_bytes, rc, "units: out of memory");
  if (dup != NULL)
    return bad(err, err_bytes, "units", "two units are named \"%.256s\"", dup);
  return files != NULL ? decode_files(files, m, err, err_bytes) : 0;
}

int ckpt_manifest_decode(const char *text, size_t len, int flags, ckpt_manifest *out, char *err,
                         size_t err_bytes) {
  memset(out, 0, sizeof *out);
  if ((flags & ~CKPT_DECODE_NO_FILES) != 0)
    return ckpt_fail(err, err_bytes, -EINVAL, "unknown decode flags 0x%x", (unsigned)flags);
  if (len > CKPT_MAX_MANIFEST_BYTES)
    return ckpt_fail(err, err_bytes, -ERANGE, "manifest of %zu bytes, more than the %u allowed",
                     len, CKPT_MAX_MANIFEST_BYTES);
  json_error_t jerr;
  json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
  if (root == NULL)
    return ckpt_fail(err, err_bytes, -EBADMSG, "not valid JSON: %s (line %d, column %d)", jerr.text,
                     jerr.line, jerr.column);
  int rc = decode_manifest(root, flags, out, err, err_bytes);
  json_decref(root);
  if (rc != 0)
    ckpt_manifest_free(out);
  return rc;
}

void ckpt_manifest_free(ckpt_manifest *m) {
  if (m == NULL)
    return;
  free(m->job);
  free(m->name);
  for (unsigned u = 0; m->units != NULL && u < m->nunits; u++) {
    for (unsigned i = 0; m->units[u].tensors != NULL && i < m->units[u].ntensors; i++)
      free(m->units[u].tensors[i].name);
    free(m->units[u].tensors);
    free(m->units[u].name);
  }
  free(m->units);
  for (uint32_t k = 0; m->files != NULL && k < m->world_size; k++)
    free(m->files[k].name);
  free(m->files);
  memset(m, 0, sizeof *m);
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
  } else if ((rc = ckpt_pread_all(fd, text, (size_t)st.st_size, 0)) != 0) {
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

static int fsync_dir(const char *dir, char *err, size_t err_bytes) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return ckpt_fail(err, err_bytes, -errno, "%s: %s", dir, strerror(errno));
  int rc =
      fsync(fd) == 0 ? 0 : ckpt_fail(err, err_bytes, -errno, "%s: fsync: %s", dir, strerror(errno));
  close(fd);
  return rc;
}

/* Writes path.tmp whole, fsyncs it and renames it to path, so that path
 * is either the old file or the complete new one. The directory is
 * fsynced by the caller (ckpt_manifest_store, st_write). */
static int write_replace(const char *path, const void *bytes, size_t len, const char *name,
                         char *err, size_t err_bytes) {
  size_t path_len = strlen(path);
  char *tmp = malloc(path_len + 5);
  if (tmp == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  memcpy(tmp, path, path_len);
  memcpy(tmp + path_len, ".tmp", 5);
  /* O_TRUNC, not O_EXCL: a .tmp left by a crash is ours to replace. */
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, filemode_file());
  int rc = 0;
  if (fd < 0) {
    rc = ckpt_fail(err, err_bytes, -errno, "%s.tmp: %s", name, strerror(errno));
    free(tmp);
    return rc;
  }
  if ((rc = filemode_fix_file(fd)) != 0)
    rc = ckpt_fail(err, err_bytes, rc, "%s.tmp: fchmod: %s", name, strerror(-rc));
  else if ((rc = ckpt_pwrite_all(fd, bytes, len, 0)) != 0)
    rc = ckpt_fail(err, err_bytes, rc, "%s.tmp: %s", name, strerror(-rc));
  else if (fsync(fd) != 0)
    rc = ckpt_fail(err, err_bytes, -errno, "%s.tmp: fsync: %s", name, strerror(errno));
  if (close(fd) != 0 && rc == 0)
    rc = ckpt_fail(err, err_bytes, -errno, "%s.tmp: close: %s", name, strerror(errno));
  if (rc == 0 && rename(tmp, path) != 0)
    rc = ckpt_fail(err, err_bytes, -errno, "%s: rename: %s", name, strerror(errno));
  if (rc != 0)
    unlink(tmp);
  free(tmp);
  return rc;
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
  rc = write_replace(path, text, len, name, err, err_bytes);
  free(path);
  free(text);
  return rc == 0 ? fsync_dir(dir, err, err_bytes) : rc;
}
