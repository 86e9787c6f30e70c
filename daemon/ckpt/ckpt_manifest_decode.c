/* ckpt_manifest_decode: manifest.json and layout.json read back and
 * checked (ckpt.h, ckpt_manifest_decode and ckpt_manifest_free; the
 * format is described in ckpt_manifest.c), and the rules for the names
 * in them.
 *
 * Every check names where it failed ("units[2].tensors[0]: ...") and
 * returns -EBADMSG; the caller frees whatever was filled in so far, which
 * is why arrays are zeroed when allocated and their counts set at once. */
#include "names.h"
#include "ckpt.h"
#include "ckpt_impl.h"
#include "ckpt_io.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#define MAX_PATH_NAME_BYTES 255u /* job and checkpoint names become directory names */
#define MAX_NAME_BYTES      256u /* unit and tensor names: ZD_MAX_NAME_BYTES of the protocol */

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
  for (size_t i = 0; i < len; i++)
    if (!zd_name_char(tenant[i]))
      return "holds a character other than [A-Za-z0-9._-]";
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

/* "feedback" (version 3, optional, after the units): {"kind": "onebit" or
 * "powersgd", "nodes": a divisor of world_size, "numel": one count per
 * unit}. */
static int decode_feedback(json_t *root, ckpt_manifest *m, char *err, size_t err_bytes) {
  static const char *const keys[] = {"kind", "nodes", "numel"};
  static const char *const where = "feedback";
  json_t *fb = json_object_get(root, "feedback"), *numel;
  if (fb == NULL)
    return 0;
  if (!json_is_object(fb))
    return bad(err, err_bytes, where, "is not an object");
  const char *kind = NULL;
  size_t kind_len = 0;
  uint64_t nodes = 0;
  int rc = check_keys(fb, keys, 3, where, err, err_bytes);
  if (rc == 0)
    rc = get_string(fb, "kind", where, &kind, &kind_len, err, err_bytes);
  if (rc == 0 && strcmp(kind, "onebit") != 0 && strcmp(kind, "powersgd") != 0)
    return bad(err, err_bytes, where, "\"kind\" is not \"onebit\" or \"powersgd\"");
  if (rc == 0)
    rc = get_uint(fb, "nodes", m->world_size, where, &nodes, err, err_bytes);
  if (rc == 0 && (nodes == 0 || m->world_size % nodes != 0))
    return bad(err, err_bytes, where, "\"nodes\" %" PRIu64 " does not divide world_size %" PRIu32,
               nodes, m->world_size);
  if (rc == 0)
    rc = get_member(fb, "numel", where, &numel, err, err_bytes);
  if (rc != 0)
    return rc;
  if (!json_is_array(numel) || json_array_size(numel) != m->nunits)
    return bad(err, err_bytes, where, "\"numel\" is not a list of one count per unit");
  m->feedback.numel = calloc(m->nunits > 0 ? m->nunits : 1, sizeof *m->feedback.numel);
  if (m->feedback.numel == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "feedback: out of memory");
  for (unsigned u = 0; u < m->nunits; u++) {
    json_t *v = json_array_get(numel, u);
    if (!json_is_integer(v) || json_integer_value(v) < 0)
      return bad(err, err_bytes, where, "\"numel\"[%u] is not a count", u);
    m->feedback.numel[u] = (uint64_t)json_integer_value(v);
  }
  snprintf(m->feedback.kind, sizeof m->feedback.kind, "%s", kind);
  m->feedback.nodes = (uint32_t)nodes;
  return 0;
}

static int decode_manifest(json_t *root, int flags, ckpt_manifest *m, char *err, size_t err_bytes) {
  static const char *const keys[] = {"format",     "format_version",  "job",     "job_id",
                                     "name",       "created_unix_ms", "step",    "version",
                                     "world_size", "config",          "states",  "units",
                                     "files",      "tenant",          "feedback"};
  /* Version 1 has every key but the last two, version 2 all but the last. */
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
    rc = check_keys(root, keys, version < 3 ? nkeys - 3 + (size_t)version : nkeys, where, err,
                    err_bytes);
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
  if ((rc = decode_feedback(root, m, err, err_bytes)) != 0)
    return rc;
  for (unsigned u = 0; m->feedback.numel != NULL && u < m->nunits; u++) {
    if (m->feedback.numel[u] > (UINT64_MAX - data_bytes) / 4)
      return bad(err, err_bytes, "feedback", "the shard files would be larger than 2^64 bytes");
    data_bytes += m->feedback.numel[u] * 4;
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
  free(m->feedback.numel);
  for (uint32_t k = 0; m->files != NULL && k < m->world_size; k++)
    free(m->files[k].name);
  free(m->files);
  memset(m, 0, sizeof *m);
}
