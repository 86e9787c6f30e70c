/* safetensors files (see ckpt.h): the header decoded and validated, tensors
 * read as fp32 (a job initialised from a Hugging Face model), and files
 * written in fp32 or bf16 (a checkpoint exported for PyTorch).
 *
 * A file is 8 bytes of little-endian header size N, N bytes of JSON, then
 * the data region; each tensor's "data_offsets" are relative to the
 * region's start. Besides what the format's own description requires of a
 * header (known dtypes, sizes that match shapes, offsets in bounds), the
 * reference implementation also requires that the tensors, taken in
 * offset order, tile the data region exactly: the first starts at 0, each
 * starts where the previous one ends, and the last ends at the end of the
 * file. That refuses overlapping tensors (one write through a mapping
 * would change two tensors) and bytes that belong to no tensor (room to
 * hide data in a file that looks like weights), so it is enforced here
 * too, and files written here satisfy it by construction. */
#include "ckpt.h"
#include "ckpt_io.h"
#include "fsutil.h"
#include "filemode.h"
#include "little_endian.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "zk.h"

#define METADATA_KEY "__metadata__"
/* Conversions go through a buffer of this many bytes of file data. */
#define CONVERT_BUFFER_BYTES (1u << 20)

typedef struct dtype_info {
  const char *name;
  st_dtype dtype;
  unsigned elem_bytes;
} dtype_info;

/* The dtypes of the format. Only the float ones convert to fp32; the rest
 * are listed so that a file holding, say, an int64 position buffer beside
 * its weights still opens. */
static const dtype_info dtypes[] = {
    {"F32", ST_F32, 4},    {"BF16", ST_BF16, 2},     {"F16", ST_F16, 2},       {"F64", ST_F64, 8},
    {"I8", ST_OTHER, 1},   {"U8", ST_OTHER, 1},      {"I16", ST_OTHER, 2},     {"U16", ST_OTHER, 2},
    {"I32", ST_OTHER, 4},  {"U32", ST_OTHER, 4},     {"I64", ST_OTHER, 8},     {"U64", ST_OTHER, 8},
    {"BOOL", ST_OTHER, 1}, {"F8_E4M3", ST_OTHER, 1}, {"F8_E5M2", ST_OTHER, 1},
};
#define NDTYPES (sizeof dtypes / sizeof dtypes[0])

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

static const dtype_info *find_dtype(const char *name) {
  for (size_t i = 0; i < NDTYPES; i++)
    if (strcmp(dtypes[i].name, name) == 0)
      return &dtypes[i];
  return NULL;
}

/* numel of a shape and its size in bytes, or -1 when either overflows. */
static int shape_size(const uint64_t *shape, unsigned ndim, unsigned elem_bytes, uint64_t *numel,
                      uint64_t *bytes) {
  uint64_t n = 1;
  for (unsigned d = 0; d < ndim; d++) {
    if (n != 0 && shape[d] > UINT64_MAX / n)
      return -1;
    n *= shape[d];
  }
  if (n > UINT64_MAX / elem_bytes)
    return -1;
  *numel = n;
  *bytes = n * elem_bytes;
  return 0;
}

static int compare_by_name(const void *a, const void *b) {
  return strcmp(((const st_tensor *)a)->name, ((const st_tensor *)b)->name);
}

static int compare_by_offsets(const void *a, const void *b) {
  const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
  if (x->begin != y->begin)
    return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end)
    return x->end < y->end ? -1 : 1;
  return 0;
}

/* ------------------------------------------------------------------------
 * Header decoding
 * ------------------------------------------------------------------------ */

static int decode_metadata(json_t *value, char *err, size_t err_bytes) {
  /* The reference implementation reads it as an optional map, so null is
   * as good as absent. */
  if (json_is_null(value))
    return 0;
  if (!json_is_object(value))
    return ckpt_fail(err, err_bytes, -EBADMSG, "\"" METADATA_KEY "\" is not an object");
  const char *key;
  json_t *entry;
  json_object_foreach(value, key, entry) {
    if (!json_is_string(entry))
      return ckpt_fail(err, err_bytes, -EBADMSG,
                       "\"" METADATA_KEY "\" value of \"%.64s\" is not a string", key);
  }
  return 0;
}

static int get_index(json_t *array, size_t i, uint64_t *out) {
  json_t *v = json_array_get(array, i);
  if (!json_is_integer(v) || json_integer_value(v) < 0)
    return -1;
  *out = (uint64_t)json_integer_value(v);
  return 0;
}

static int decode_tensor(const char *name, json_t *obj, uint64_t data_bytes, st_tensor *t,
                         char *err, size_t err_bytes) {
  if (name[0] == '\0')
    return ckpt_fail(err, err_bytes, -EBADMSG, "a tensor has an empty name");
  if ((t->name = strdup(name)) == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "out of memory");
  if (!json_is_object(obj))
    return ckpt_fail(err, err_bytes, -EBADMSG, "tensor '%.128s' is not an object", name);
  const char *key;
  json_t *value;
  json_object_foreach(obj, key, value) {
    if (strcmp(key, "dtype") != 0 && strcmp(key, "shape") != 0 && strcmp(key, "data_offsets") != 0)
      return ckpt_fail(err, err_bytes, -EBADMSG, "tensor '%.128s' has an unknown key \"%.64s\"",
                       name, key);
  }
  json_t *dtype = json_object_get(obj, "dtype"), *shape = json_object_get(obj, "shape"),
         *offsets = json_object_get(obj, "data_offsets");
  if (!json_is_string(dtype))
    return ckpt_fail(err, err_bytes, -EBADMSG, "tensor '%.128s' has no \"dtype\" string", name);
  const dtype_info *info = find_dtype(json_string_value(dtype));
  if (info == NULL)
    return ckpt_fail(err, err_bytes, -EBADMSG, "tensor '%.128s' has an unknown dtype \"%.16s\"",
                     name, json_string_value(dtype));
  t->dtype = info->dtype;
  snprintf(t->dtype_name, sizeof t->dtype_name, "%s", info->name);
  t->elem_bytes = info->elem_bytes;
  if (!json_is_array(shape) || json_array_size(shape) > CKPT_MAX_TENSOR_DIM)
    return ckpt_fail(err, err_bytes, -EBADMSG,
                     "tensor '%.128s': \"shape\" is not a list of at most %d dimensions", name,
                     CKPT_MAX_TENSOR_DIM);
  t->ndim = (unsigned)json_array_size(shape);
  for (unsigned d = 0; d < t->ndim; d++)
    if (get_index(shape, d, &t->shape[d]) != 0)
      return ckpt_fail(err, err_bytes, -EBADMSG,
                       "tensor '%.128s': \"shape\"[%u] is not a non-negative integer", name, d);
  uint64_t bytes;
  if (shape_size(t->shape, t->ndim, t->elem_bytes, &t->numel, &bytes) != 0)
    return ckpt_fail(err, err_bytes, -EBADMSG, "tensor '%.128s': its shape has too many elements",
                     name);
  if (!json_is_array(offsets) || json_array_size(offsets) != 2 ||
      get_index(offsets, 0, &t->begin) != 0 || get_index(offsets, 1, &t->end) != 0 ||
      t->begin > t->end)
    return ckpt_fail(err, err_bytes, -EBADMSG,
                     "tensor '%.128s': \"data_offsets\" is not [begin, end] with 0 <= begin <= end",
                     name);
  if (t->end > data_bytes)
    return ckpt_fail(err, err_bytes, -ERANGE,
                     "tensor '%.128s': data_offsets [%" PRIu64 ", %" PRIu64
                     "] are out of bounds of the %" PRIu64 "-byte data",
                     name, t->begin, t->end, data_bytes);
  if (t->end - t->begin != bytes)
    return ckpt_fail(err, err_bytes, -EBADMSG,
                     "tensor '%.128s': data_offsets hold %" PRIu64 " bytes, but %" PRIu64
                     " elements of %s need %" PRIu64,
                     name, t->end - t->begin, t->numel, t->dtype_name, bytes);
  return 0;
}

/* The tiling rule of the file comment: in offset order, no overlap and no
 * hole, from 0 to data_bytes. */
static int check_tiling(const st_file *f, char *err, size_t err_bytes) {
  const st_tensor **order = malloc((f->ntensors > 0 ? f->ntensors : 1) * sizeof *order);
  if (order == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "out of memory");
  for (unsigned i = 0; i < f->ntensors; i++)
    order[i] = &f->tensors[i];
  qsort(order, f->ntensors, sizeof *order, compare_by_offsets);
  uint64_t covered = 0;
  const char *previous = NULL;
  int rc = 0;
  for (unsigned i = 0; i < f->ntensors && rc == 0; i++) {
    const st_tensor *t = order[i];
    if (t->begin < covered)
      rc = ckpt_fail(err, err_bytes, -EBADMSG,
                     "tensor '%.128s' (bytes %" PRIu64 "..%" PRIu64 ") overlaps tensor '%.128s'",
                     t->name, t->begin, t->end, previous);
    else if (t->begin > covered)
      rc = ckpt_fail(err, err_bytes, -EBADMSG,
                     "data bytes %" PRIu64 "..%" PRIu64
                     " before tensor '%.128s' belong to no tensor",
                     covered, t->begin, t->name);
    covered = t->end;
    previous = t->name;
  }
  if (rc == 0 && covered != f->data_bytes)
    rc = ckpt_fail(err, err_bytes, -EBADMSG,
                   "data bytes %" PRIu64 "..%" PRIu64 " at the end belong to no tensor", covered,
                   f->data_bytes);
  free(order);
  return rc;
}

static int decode_header(json_t *root, st_file *out, char *err, size_t err_bytes) {
  if (!json_is_object(root))
    return ckpt_fail(err, err_bytes, -EBADMSG, "header is not a JSON object");
  size_t count = json_object_size(root);
  if (json_object_get(root, METADATA_KEY) != NULL)
    count--;
  if (count > 0 && (out->tensors = calloc(count, sizeof *out->tensors)) == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "out of memory for %zu tensors", count);
  const char *key;
  json_t *value;
  int rc = 0;
  json_object_foreach(root, key, value) {
    if (strcmp(key, METADATA_KEY) == 0) {
      rc = decode_metadata(value, err, err_bytes);
    } else {
      /* Counted first, so that st_file_free frees a partly decoded one. */
      st_tensor *t = &out->tensors[out->ntensors++];
      rc = decode_tensor(key, value, out->data_bytes, t, err, err_bytes);
    }
    if (rc != 0)
      return rc;
  }
  if (out->ntensors > 1)
    qsort(out->tensors, out->ntensors, sizeof *out->tensors, compare_by_name);
  /* JSON_REJECT_DUPLICATES already refused repeated keys; this keeps the
   * promise of unique names independent of that flag. */
  for (unsigned i = 1; i < out->ntensors; i++)
    if (strcmp(out->tensors[i - 1].name, out->tensors[i].name) == 0)
      return ckpt_fail(err, err_bytes, -EBADMSG, "two tensors are named '%.128s'",
                       out->tensors[i].name);
  return check_tiling(out, err, err_bytes);
}

int st_header_decode(const char *json, size_t len, uint64_t data_bytes, st_file *out, char *err,
                     size_t err_bytes) {
  memset(out, 0, sizeof *out);
  if (len > CKPT_MAX_ST_HEADER_BYTES)
    return ckpt_fail(err, err_bytes, -ERANGE, "header of %zu bytes, more than the %u allowed", len,
                     CKPT_MAX_ST_HEADER_BYTES);
  json_error_t jerr;
  json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
  if (root == NULL)
    return ckpt_fail(err, err_bytes, -EBADMSG, "header is not valid JSON: %s (line %d, column %d)",
                     jerr.text, jerr.line, jerr.column);
  out->data_start = 8 + (uint64_t)len;
  out->data_bytes = data_bytes;
  int rc = decode_header(root, out, err, err_bytes);
  json_decref(root);
  if (rc != 0)
    st_file_free(out);
  return rc;
}

void st_file_free(st_file *f) {
  if (f == NULL)
    return;
  for (unsigned i = 0; f->tensors != NULL && i < f->ntensors; i++)
    free(f->tensors[i].name);
  free(f->tensors);
  memset(f, 0, sizeof *f);
}

/* ------------------------------------------------------------------------
 * Reading
 * ------------------------------------------------------------------------ */

static int open_checked(int fd, const char *name, st_file *out, char *err, size_t err_bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0)
    return ckpt_fail(err, err_bytes, -errno, "%s: %s", name, strerror(errno));
  if (!S_ISREG(st.st_mode))
    return ckpt_fail(err, err_bytes, -EINVAL, "%s: not a regular file", name);
  uint64_t file_bytes = (uint64_t)st.st_size;
  if (file_bytes < 8)
    return ckpt_fail(err, err_bytes, -ERANGE,
                     "%s: truncated: %" PRIu64 " bytes, less than the 8-byte header size", name,
                     file_bytes);
  uint8_t prefix[8];
  int rc = fsutil_pread_all(fd, prefix, sizeof prefix, 0);
  if (rc != 0)
    return rc > 0 ? ckpt_fail(err, err_bytes, -ERANGE, "%s: truncated while reading", name)
                  : ckpt_fail(err, err_bytes, rc, "%s: %s", name, strerror(-rc));
  uint64_t header_bytes = le_get64(prefix);
  if (header_bytes > CKPT_MAX_ST_HEADER_BYTES)
    return ckpt_fail(err, err_bytes, -ERANGE,
                     "%s: header of %" PRIu64 " bytes, more than the %u allowed", name,
                     header_bytes, CKPT_MAX_ST_HEADER_BYTES);
  if (header_bytes > file_bytes - 8)
    return ckpt_fail(err, err_bytes, -ERANGE,
                     "%s: header size %" PRIu64 " is larger than the file (%" PRIu64 " bytes)",
                     name, header_bytes, file_bytes);
  char *header = malloc(header_bytes > 0 ? (size_t)header_bytes : 1);
  if (header == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  rc = fsutil_pread_all(fd, header, (size_t)header_bytes, 8);
  if (rc != 0) {
    free(header);
    return rc > 0 ? ckpt_fail(err, err_bytes, -ERANGE, "%s: truncated while reading", name)
                  : ckpt_fail(err, err_bytes, rc, "%s: %s", name, strerror(-rc));
  }
  rc = st_header_decode(header, (size_t)header_bytes, file_bytes - 8 - header_bytes, out, err,
                        err_bytes);
  free(header);
  if (rc != 0)
    ckpt_prefix_error(err, err_bytes, name);
  return rc;
}

int st_open(const char *path, st_file *out, int *fd, char *err, size_t err_bytes) {
  memset(out, 0, sizeof *out);
  *fd = -1;
  const char *name = ckpt_base_name(path);
  int file = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (file < 0)
    return ckpt_fail(err, err_bytes, -errno, "%s: %s", name, strerror(errno));
  int rc = open_checked(file, name, out, err, err_bytes);
  if (rc != 0) {
    close(file);
    return rc;
  }
  *fd = file;
  return 0;
}

const st_tensor *st_find(const st_file *f, const char *name) {
  size_t lo = 0, hi = f->ntensors;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int order = strcmp(name, f->tensors[mid].name);
    if (order == 0)
      return &f->tensors[mid];
    if (order < 0)
      hi = mid;
    else
      lo = mid + 1;
  }
  return NULL;
}

int st_read_f32(int fd, const st_file *f, const st_tensor *t, uint64_t from, uint64_t to,
                float *dst, char *err, size_t err_bytes) {
  if (t->dtype == ST_OTHER)
    return ckpt_fail(err, err_bytes, -EINVAL,
                     "tensor '%.128s' is %s, which does not convert to fp32", t->name,
                     t->dtype_name);
  if (from > to || to > t->numel)
    return ckpt_fail(err, err_bytes, -ERANGE,
                     "tensor '%.128s': elements %" PRIu64 "..%" PRIu64 " are outside 0..%" PRIu64,
                     t->name, from, to, t->numel);
  if (t->end > f->data_bytes)
    return ckpt_fail(err, err_bytes, -ERANGE, "tensor '%.128s' is outside the file's data",
                     t->name);
  uint64_t offset = f->data_start + t->begin + from * t->elem_bytes;
  uint64_t count = to - from;
  int rc;
  if (t->dtype == ST_F32) {
    /* Little-endian floats, as the file has them: read in place. */
    rc = fsutil_pread_all(fd, dst, (size_t)(count * 4), offset);
    if (rc != 0)
      return rc > 0 ? ckpt_fail(err, err_bytes, -ERANGE, "tensor '%.128s': file truncated", t->name)
                    : ckpt_fail(err, err_bytes, rc, "tensor '%.128s': %s", t->name, strerror(-rc));
    return 0;
  }
  uint8_t *chunk = malloc(CONVERT_BUFFER_BYTES);
  if (chunk == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "out of memory");
  const uint64_t chunk_numel = CONVERT_BUFFER_BYTES / t->elem_bytes;
  rc = 0;
  while (count > 0 && rc == 0) {
    size_t n = (size_t)(count < chunk_numel ? count : chunk_numel);
    rc = fsutil_pread_all(fd, chunk, n * t->elem_bytes, offset);
    if (rc != 0) {
      rc = rc > 0 ? ckpt_fail(err, err_bytes, -ERANGE, "tensor '%.128s': file truncated", t->name)
                  : ckpt_fail(err, err_bytes, rc, "tensor '%.128s': %s", t->name, strerror(-rc));
      break;
    }
    if (t->dtype == ST_F64) {
      for (size_t i = 0; i < n; i++) {
        double v;
        memcpy(&v, chunk + 8 * i, sizeof v);
        dst[i] = (float)v; /* round to nearest, like torch's .float() */
      }
    } else {
      rc = zk_cast(NULL, dst, ZK_F32, chunk, t->dtype == ST_BF16 ? ZK_BF16 : ZK_F16, n);
      if (rc != 0)
        rc = ckpt_fail(err, err_bytes, rc, "tensor '%.128s': conversion failed", t->name);
    }
    dst += n;
    offset += n * t->elem_bytes;
    count -= n;
  }
  free(chunk);
  return rc;
}

/* ------------------------------------------------------------------------
 * Writing
 * ------------------------------------------------------------------------ */

/* The JSON header for tensors at consecutive offsets, with the metadata
 * first, as the reference implementation writes it. */
static json_t *build_header(const st_tensor *tensors, unsigned ntensors, json_t *metadata,
                            uint64_t *data_bytes, char *err, size_t err_bytes) {
  json_t *root = json_object();
  if (root == NULL || (metadata != NULL && json_object_set(root, METADATA_KEY, metadata) != 0)) {
    json_decref(root);
    ckpt_fail(err, err_bytes, -ENOMEM, "out of memory");
    return NULL;
  }
  uint64_t offset = 0;
  for (unsigned i = 0; i < ntensors; i++) {
    const st_tensor *t = &tensors[i];
    uint64_t numel, bytes;
    unsigned elem = t->dtype == ST_F32 ? 4 : 2;
    int ok = shape_size(t->shape, t->ndim, elem, &numel, &bytes) == 0 &&
             bytes <= (uint64_t)INT64_MAX - offset;
    if (!ok) {
      json_decref(root);
      ckpt_fail(err, err_bytes, -EINVAL, "tensor '%.128s' is too large", t->name);
      return NULL;
    }
    json_t *shape = json_array(), *offsets = json_array(), *obj = json_object();
    ok = shape != NULL && offsets != NULL && obj != NULL;
    for (unsigned d = 0; ok && d < t->ndim; d++)
      ok = t->shape[d] <= (uint64_t)INT64_MAX &&
           json_array_append_new(shape, json_integer((json_int_t)t->shape[d])) == 0;
    ok = ok && json_array_append_new(offsets, json_integer((json_int_t)offset)) == 0 &&
         json_array_append_new(offsets, json_integer((json_int_t)(offset + bytes))) == 0 &&
         json_object_set_new(obj, "dtype", json_string(t->dtype == ST_F32 ? "F32" : "BF16")) == 0 &&
         json_object_set(obj, "shape", shape) == 0 &&
         json_object_set(obj, "data_offsets", offsets) == 0 &&
         json_object_set(root, t->name, obj) == 0;
    json_decref(shape);
    json_decref(offsets);
    json_decref(obj);
    if (!ok) {
      json_decref(root);
      ckpt_fail(err, err_bytes, -EINVAL, "tensor '%.128s': cannot encode its header entry",
                t->name);
      return NULL;
    }
    offset += bytes;
  }
  *data_bytes = offset;
  return root;
}

static int check_write_args(const st_tensor *tensors, unsigned ntensors, const char *metadata_json,
                            json_t **metadata, char *err, size_t err_bytes) {
  *metadata = NULL;
  for (unsigned i = 0; i < ntensors; i++) {
    const st_tensor *t = &tensors[i];
    if (t->name == NULL || t->name[0] == '\0' || strcmp(t->name, METADATA_KEY) == 0)
      return ckpt_fail(err, err_bytes, -EINVAL, "tensor %u has no name, or the name " METADATA_KEY,
                       i);
    if (t->dtype != ST_F32 && t->dtype != ST_BF16)
      return ckpt_fail(err, err_bytes, -EINVAL, "tensor '%.128s': only F32 and BF16 are written",
                       t->name);
    if (t->ndim > CKPT_MAX_TENSOR_DIM)
      return ckpt_fail(err, err_bytes, -EINVAL, "tensor '%.128s' has more than %d dimensions",
                       t->name, CKPT_MAX_TENSOR_DIM);
  }
  const char **names = malloc((ntensors > 0 ? ntensors : 1) * sizeof *names);
  if (names == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "out of memory");
  for (unsigned i = 0; i < ntensors; i++)
    names[i] = tensors[i].name;
  /* Sort the names to find a repeat: a JSON object cannot hold two. */
  for (unsigned i = 1; i < ntensors; i++)
    for (unsigned j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
      const char *swap = names[j];
      names[j] = names[j - 1];
      names[j - 1] = swap;
    }
  int rc = 0;
  for (unsigned i = 1; i < ntensors && rc == 0; i++)
    if (strcmp(names[i - 1], names[i]) == 0)
      rc = ckpt_fail(err, err_bytes, -EINVAL, "two tensors are named '%.128s'", names[i]);
  free(names);
  if (rc != 0 || metadata_json == NULL)
    return rc;
  json_error_t jerr;
  *metadata = json_loads(metadata_json, JSON_REJECT_DUPLICATES, &jerr);
  if (*metadata == NULL)
    return ckpt_fail(err, err_bytes, -EINVAL, "metadata is not valid JSON: %s", jerr.text);
  if ((rc = decode_metadata(*metadata, err, err_bytes)) != 0) {
    json_decref(*metadata);
    *metadata = NULL;
    return -EINVAL;
  }
  return 0;
}

/* Writes the data of tensor i after asking fill for its values. A failure
 * of fill keeps fill's own message. */
static int write_tensor(int fd, const char *name, uint64_t *offset, const st_tensor *t, unsigned i,
                        st_fill_fn fill, void *arg, char *err, size_t err_bytes) {
  uint64_t numel = 0, bytes = 0;
  if (shape_size(t->shape, t->ndim, 4, &numel, &bytes) != 0 || numel > SIZE_MAX / 4)
    return ckpt_fail(err, err_bytes, -ENOMEM, "tensor '%.128s' does not fit in memory", t->name);
  float *values = malloc(numel > 0 ? (size_t)numel * 4 : 1);
  uint16_t *converted = t->dtype == ST_BF16 ? malloc(CONVERT_BUFFER_BYTES) : NULL;
  if (values == NULL || (t->dtype == ST_BF16 && converted == NULL)) {
    free(values);
    free(converted);
    return ckpt_fail(err, err_bytes, -ENOMEM, "out of memory for tensor '%.128s'", t->name);
  }
  int rc = fill(arg, i, values, numel, err, err_bytes);
  if (rc > 0)
    rc = ckpt_fail(err, err_bytes, -EINVAL, "filling tensor '%.128s' failed", t->name);
  if (rc == 0 && t->dtype == ST_F32) {
    if ((rc = fsutil_pwrite_all(fd, values, (size_t)numel * 4, *offset)) != 0)
      rc = ckpt_fail(err, err_bytes, rc, "%s.tmp: %s", name, strerror(-rc));
    *offset += numel * 4;
  }
  const size_t chunk_numel = CONVERT_BUFFER_BYTES / 2;
  for (uint64_t done = 0; rc == 0 && t->dtype == ST_BF16 && done < numel;) {
    size_t n = (size_t)(numel - done < chunk_numel ? numel - done : chunk_numel);
    if ((rc = zk_cast(NULL, converted, ZK_BF16, values + done, ZK_F32, n)) != 0)
      rc = ckpt_fail(err, err_bytes, rc, "tensor '%.128s': conversion to bf16 failed", t->name);
    else if ((rc = fsutil_pwrite_all(fd, converted, n * 2, *offset)) != 0)
      rc = ckpt_fail(err, err_bytes, rc, "%s.tmp: %s", name, strerror(-rc));
    *offset += n * 2;
    done += n;
  }
  free(converted);
  free(values);
  return rc;
}

int st_write_at(int dir_fd, const char *name, const st_tensor *tensors, unsigned ntensors,
                const char *metadata_json, st_fill_fn fill, void *arg, char *err,
                size_t err_bytes) {
  json_t *metadata;
  int rc = check_write_args(tensors, ntensors, metadata_json, &metadata, err, err_bytes);
  if (rc != 0) {
    ckpt_prefix_error(err, err_bytes, name);
    return rc;
  }
  uint64_t data_bytes;
  json_t *root = build_header(tensors, ntensors, metadata, &data_bytes, err, err_bytes);
  json_decref(metadata);
  if (root == NULL) {
    ckpt_prefix_error(err, err_bytes, name);
    return -EINVAL;
  }
  char *json = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
  json_decref(root);
  if (json == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  /* Padding the header with spaces to a multiple of 8 aligns the data
   * region, so that a reader may map it and use the floats in place. */
  size_t json_len = strlen(json), header_len = (json_len + 7) / 8 * 8;
  uint8_t *header = malloc(8 + header_len);
  char *tmp = malloc(strlen(name) + 5);
  if (header == NULL || tmp == NULL) {
    free(json);
    free(header);
    free(tmp);
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  }
  le_put64(header, (uint64_t)header_len);
  memcpy(header + 8, json, json_len);
  memset(header + 8 + json_len, ' ', header_len - json_len);
  free(json);
  snprintf(tmp, strlen(name) + 5, "%s.tmp", name);

  /* The file is written next to its name and renamed into place, all
   * relative to dir_fd: never through a symbolic link, and a name that is
   * one (or a hard link to a file elsewhere) is replaced, not written
   * through. A .tmp left by a crash is removed first rather than
   * truncated, for the same reason. */
  if (unlinkat(dir_fd, tmp, 0) != 0 && errno != ENOENT) {
    rc = ckpt_fail(err, err_bytes, -errno, "%s.tmp: %s", name, strerror(errno));
    free(header);
    free(tmp);
    return rc;
  }
  int fd =
      openat(dir_fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, filemode_file());
  if (fd < 0) {
    rc = ckpt_fail(err, err_bytes, -errno, "%s.tmp: %s", name, strerror(errno));
    free(header);
    free(tmp);
    return rc;
  }
  uint64_t offset = 8 + header_len;
  if ((rc = filemode_fix_file(fd)) != 0)
    rc = ckpt_fail(err, err_bytes, rc, "%s.tmp: fchmod: %s", name, strerror(-rc));
  else if ((rc = fsutil_pwrite_all(fd, header, (size_t)offset, 0)) != 0)
    rc = ckpt_fail(err, err_bytes, rc, "%s.tmp: %s", name, strerror(-rc));
  free(header);
  for (unsigned i = 0; rc == 0 && i < ntensors; i++)
    rc = write_tensor(fd, name, &offset, &tensors[i], i, fill, arg, err, err_bytes);
  if (rc == 0 && offset != 8 + header_len + data_bytes)
    rc = ckpt_fail(err, err_bytes, -EIO, "%s.tmp: wrote %" PRIu64 " bytes, expected %" PRIu64, name,
                   offset, 8 + header_len + data_bytes);
  if (rc == 0 && fsync(fd) != 0)
    rc = ckpt_fail(err, err_bytes, -errno, "%s.tmp: fsync: %s", name, strerror(errno));
  if (close(fd) != 0 && rc == 0)
    rc = ckpt_fail(err, err_bytes, -errno, "%s.tmp: close: %s", name, strerror(errno));
  if (rc == 0 && renameat(dir_fd, tmp, dir_fd, name) != 0)
    rc = ckpt_fail(err, err_bytes, -errno, "%s: rename: %s", name, strerror(errno));
  if (rc == 0 && fsync(dir_fd) != 0)
    rc = ckpt_fail(err, err_bytes, -errno, "%s: fsync of its directory: %s", name, strerror(errno));
  if (rc != 0)
    unlinkat(dir_fd, tmp, 0);
  free(tmp);
  return rc;
}

int st_write(const char *path, const st_tensor *tensors, unsigned ntensors,
             const char *metadata_json, st_fill_fn fill, void *arg, char *err, size_t err_bytes) {
  const char *name = ckpt_base_name(path);
  const char *slash = strrchr(path, '/');
  char *dir =
      slash == NULL ? strdup(".") : strndup(path, slash == path ? 1 : (size_t)(slash - path));
  if (dir == NULL)
    return ckpt_fail(err, err_bytes, -ENOMEM, "%s: out of memory", name);
  int dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  int rc = dir_fd < 0 ? ckpt_fail(err, err_bytes, -errno, "%s: %s", dir, strerror(errno)) : 0;
  free(dir);
  if (rc == 0) {
    rc = st_write_at(dir_fd, name, tensors, ntensors, metadata_json, fill, arg, err, err_bytes);
    close(dir_fd);
  }
  return rc;
}
