/* Fuzz target: the safetensors reader (daemon/ckpt_safetensors.c), fed the
 * files a user may point a job at.
 *
 * The first input byte picks what the rest is:
 *   mode 0: a whole file image: 8-byte size prefix, header, data. The
 *     header is decoded as st_open would, and when it is accepted the image
 *     is also opened through a memfd and every tensor that converts is read
 *     as fp32, to show that no header it accepts makes a read go wrong;
 *   mode 1: the header's JSON alone, for a data region whose size the
 *     next byte gives (so the fuzzer can work on the JSON without also
 *     having to get the prefix right);
 *   mode 2: a header built from the input's choices (dtypes known and not,
 *     shapes near the overflow edges, offsets that tile the data or leave
 *     a hole, overlap or run past it, metadata good and bad), which
 *     reaches every rule on plain pseudo-random input.
 * Decoding must never crash, leak or read outside the buffer; a refusal
 * must say why and leave nothing allocated; and an accepted header must
 * keep its promises: names unique and sorted, offsets within the data and
 * matching shape and dtype, tensors tiling the data exactly. The units a
 * job with none would take from an accepted header (st_units_build) hold
 * every tensor once, each unit the tensors of one module. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ckpt.h"
#include "ckpt_job.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* ------------------------------------------------------------------------ */
/* The checks                                                               */
/* ------------------------------------------------------------------------ */

/* The units a job with none takes from f: every tensor in exactly one,
 * a unit's tensors of one module (the name up to the last '.'). */
static void check_units(const st_file *f) {
  unit_layout **units = NULL;
  unsigned n = 0;
  char err[512] = "";
  int rc = st_units_build(f, 2, &units, &n, err, sizeof err);
  if (rc != 0) {
    if (units != NULL || n != 0 || err[0] == '\0')
      abort();
    return; /* a name or shape no unit can take: refused, saying why */
  }
  unsigned seen = 0;
  for (unsigned u = 0; u < n; u++) {
    const unit_layout *l = units[u];
    for (unsigned t = 0; t < l->ntensors; t++) {
      const char *name = l->tensors[t].name, *dot = strrchr(name, '.');
      size_t len = dot != NULL ? (size_t)(dot - name) : 0;
      if (st_find(f, name) == NULL ||
          (len > 0 ? strlen(l->name) != len || strncmp(l->name, name, len) != 0
                   : strcmp(l->name, "<root>") != 0))
        abort();
      seen++;
    }
    unit_layout_free(units[u]);
  }
  free(units);
  if (seen != f->ntensors)
    abort();
}

static void check_invariants(const st_file *f, uint64_t header_bytes, uint64_t data_bytes) {
  if (f->data_start != 8 + header_bytes || f->data_bytes != data_bytes)
    abort();
  uint64_t covered = 0;
  for (unsigned i = 0; i < f->ntensors; i++) {
    const st_tensor *t = &f->tensors[i];
    if (t->name == NULL || t->name[0] == '\0' || t->ndim > CKPT_MAX_TENSOR_DIM)
      abort();
    if (i > 0 && strcmp(f->tensors[i - 1].name, t->name) >= 0)
      abort(); /* sorted, unique */
    if (st_find(f, t->name) != t)
      abort();
    if (t->begin > t->end || t->end > data_bytes || t->elem_bytes == 0)
      abort();
    uint64_t numel = 1;
    for (unsigned d = 0; d < t->ndim; d++)
      numel *= t->shape[d]; /* cannot wrap: the decoder checked */
    if (numel != t->numel || t->end - t->begin != numel * t->elem_bytes)
      abort();
    covered += t->end - t->begin;
  }
  if (covered != data_bytes)
    abort(); /* tiled exactly: no hole, no overlap */
}

static int decode(const char *header, size_t header_bytes, uint64_t data_bytes) {
  /* An exact-size copy, so that AddressSanitizer sees any over-read. */
  char *exact = malloc(header_bytes ? header_bytes : 1);
  if (exact == NULL)
    return -1;
  memcpy(exact, header, header_bytes);
  st_file f;
  char err[512] = "";
  int rc = st_header_decode(exact, header_bytes, data_bytes, &f, err, sizeof err);
  free(exact);
  if (rc != 0) {
    if (rc > 0 || err[0] == '\0' || f.tensors != NULL || f.ntensors != 0)
      abort();
    return rc;
  }
  check_invariants(&f, header_bytes, data_bytes);
  check_units(&f);
  st_file_free(&f);
  return 0;
}

/* The image in a memfd, opened by path and read tensor by tensor. */
static void read_image(const uint8_t *image, size_t size) {
  int memfd = memfd_create("fuzz_safetensors", MFD_CLOEXEC);
  if (memfd < 0)
    return;
  if (write(memfd, image, size) != (ssize_t)size) {
    close(memfd);
    return;
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", memfd);
  st_file f;
  int fd;
  char err[512] = "";
  if (st_open(path, &f, &fd, err, sizeof err) != 0)
    abort(); /* its header decoded a moment ago */
  for (unsigned i = 0; i < f.ntensors; i++) {
    const st_tensor *t = &f.tensors[i];
    float *out = malloc(t->numel > 0 ? (size_t)t->numel * 4 : 1);
    if (out == NULL)
      continue;
    int rc = st_read_f32(fd, &f, t, 0, t->numel, out, err, sizeof err);
    if ((rc != 0) != (t->dtype == ST_OTHER))
      abort(); /* every float tensor reads; nothing else converts */
    if (t->numel > 0 && st_read_f32(fd, &f, t, t->numel, t->numel + 1, out, err, sizeof err) == 0)
      abort();
    free(out);
  }
  close(fd);
  st_file_free(&f);
  close(memfd);
}

static void fuzz_image(const uint8_t *image, size_t size) {
  if (size < 8)
    return;
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; i--)
    header_bytes = header_bytes << 8 | image[i];
  if (header_bytes > size - 8)
    return; /* st_open refuses it before decoding */
  if (decode((const char *)image + 8, (size_t)header_bytes, size - 8 - header_bytes) == 0)
    read_image(image, size);
}

/* ------------------------------------------------------------------------ */
/* The generator                                                            */
/* ------------------------------------------------------------------------ */

typedef struct source {
  const uint8_t *at;
  size_t left;
} source;

static uint8_t take(source *s) {
  if (s->left == 0)
    return 0;
  s->left--;
  return *s->at++;
}

#define TEXT_CAP 8192

typedef struct text {
  char bytes[TEXT_CAP];
  size_t len;
} text;

__attribute__((format(printf, 2, 3))) static void put(text *t, const char *fmt, ...) {
  if (t->len >= TEXT_CAP)
    return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(t->bytes + t->len, TEXT_CAP - t->len, fmt, ap);
  va_end(ap);
  if (n > 0)
    t->len = t->len + (size_t)n < TEXT_CAP ? t->len + (size_t)n : TEXT_CAP - 1;
}

static void fuzz_generated(const uint8_t *bytes, size_t nbytes) {
  static const char *const dtypes[] = {"F32",  "BF16",    "F16",     "F64", "I8",  "U8",
                                       "I16",  "U16",     "I32",     "U32", "I64", "U64",
                                       "BOOL", "F8_E4M3", "F8_E5M2", "F4",  "f32", ""};
  static const unsigned sizes[] = {4, 2, 2, 8, 1, 1, 2, 2, 4, 4, 8, 8, 1, 1, 1, 1, 4, 1};
  static const char *const names[] = {"w", "b", "model.layers.0.weight", "", "__metadata__", "w"};
  static const uint64_t dims[] = {0, 1, 2, 3, 4096, 1ull << 32, 1ull << 62, UINT64_MAX};
  source s = {bytes, nbytes};
  text *t = malloc(sizeof *t);
  if (t == NULL)
    return;
  t->len = 0;
  put(t, "{");
  uint8_t meta = take(&s);
  if (meta < 64)
    put(t, "\"__metadata__\":%s,",
        meta < 32   ? "{\"format\":\"pt\"}"
        : meta < 48 ? "null"
                    : "{\"n\":1}");
  unsigned ntensors = take(&s) % 5;
  uint64_t offset = 0;
  for (unsigned i = 0; i < ntensors; i++) {
    uint8_t pick = take(&s);
    unsigned d = pick % (sizeof dtypes / sizeof dtypes[0]);
    unsigned ndim = take(&s) % 10;
    uint64_t numel = 1;
    int wrapped = 0;
    if (i > 0)
      put(t, ",");
    if (pick >= 240)
      put(t, "\"%s%u\":{\"dtype\":\"%s\",\"shape\":[", names[pick % 6], i, dtypes[d]);
    else
      put(t, "\"t%u\":{\"dtype\":\"%s\",\"shape\":[", i, dtypes[d]);
    for (unsigned k = 0; k < ndim; k++) {
      uint8_t b = take(&s);
      uint64_t dim = b < 200 ? 1u + b % 6u : dims[b % (sizeof dims / sizeof dims[0])];
      if (dim != 0 && numel > UINT64_MAX / dim)
        wrapped = 1;
      numel *= dim;
      put(t, "%s%llu", k ? "," : "", (unsigned long long)dim);
    }
    uint64_t bytes_needed = wrapped ? 1 : numel * sizes[d];
    uint8_t place = take(&s);
    uint64_t begin = place < 200 ? offset : place < 220 ? offset + 1 : offset - (offset > 0);
    uint64_t end = begin + bytes_needed + (place == 255);
    put(t, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)begin, (unsigned long long)end);
    offset = end;
  }
  put(t, "}");
  uint8_t slack = take(&s);
  uint64_t data_bytes = slack < 220 ? offset : slack < 240 ? offset + 1 : offset - (offset > 0);
  /* Bounded by the offsets written, which come from small dims unless an
   * edge value made them huge; a huge region is only a number here. */
  decode(t->bytes, t->len, data_bytes);
  free(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  switch (data[0] % 3) {
  case 0:
    fuzz_image(data + 1, size - 1);
    break;
  case 1:
    if (size >= 2)
      decode((const char *)data + 2, size - 2, data[1]);
    break;
  default:
    fuzz_generated(data + 1, size - 1);
    break;
  }
  return 0;
}
