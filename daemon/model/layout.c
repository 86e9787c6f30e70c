/* Unit layouts: tensors laid out back to back in one flat buffer, padded
 * to a multiple of the world, and the canonical descriptor ranks compare
 * (layout.h). */
#include "layout.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The descriptor is a sequence of chunks, [u32 length][bytes]: first the
 * unit (name, tensor count, initialisation tag), then one per tensor (name,
 * dims, frozen). Comparing chunk by chunk finds the first differing tensor,
 * which the layout-mismatch error names. */
typedef struct desc_writer {
  uint8_t *buf;
  size_t len, cap;
  int failed;
} desc_writer;

static void desc_put(desc_writer *w, const void *data, size_t bytes) {
  if (w->failed)
    return;
  if (w->len + bytes > w->cap) {
    size_t cap = w->cap ? w->cap * 2 : 256;
    while (cap < w->len + bytes)
      cap *= 2;
    uint8_t *grown = realloc(w->buf, cap);
    if (grown == NULL) {
      w->failed = 1;
      return;
    }
    w->buf = grown;
    w->cap = cap;
  }
  memcpy(w->buf + w->len, data, bytes);
  w->len += bytes;
}

static void desc_u64(desc_writer *w, uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; i++)
    b[i] = (uint8_t)(v >> (8 * i));
  desc_put(w, b, 8);
}

static void desc_str(desc_writer *w, const char *s) {
  desc_u64(w, strlen(s));
  desc_put(w, s, strlen(s));
}

static size_t desc_chunk_begin(desc_writer *w) {
  uint8_t zero[4] = {0};
  desc_put(w, zero, 4);
  return w->len;
}

static void desc_chunk_end(desc_writer *w, size_t start) {
  if (w->failed)
    return;
  uint32_t n = (uint32_t)(w->len - start);
  for (int i = 0; i < 4; i++)
    w->buf[start - 4 + (size_t)i] = (uint8_t)(n >> (8 * i));
}

static uint64_t round_up(uint64_t x, uint64_t m) {
  return (x + m - 1) / m * m;
}

int unit_layout_build(const char *name, unsigned ntensors, const char *const *tensor_names,
                      const uint64_t *const *shapes, const unsigned *ndims, const int *frozen,
                      int world_size, uint64_t init_tag, unit_layout **out, char *err,
                      size_t err_bytes) {
  unit_layout *l = calloc(1, sizeof *l);
  if (l == NULL)
    return -ENOMEM;
  l->name = strdup(name);
  l->ntensors = ntensors;
  l->tensors = calloc(ntensors, sizeof *l->tensors);
  if (l->name == NULL || l->tensors == NULL) {
    unit_layout_free(l);
    return -ENOMEM;
  }
  desc_writer w = {0};
  size_t chunk = desc_chunk_begin(&w);
  desc_str(&w, name);
  desc_u64(&w, ntensors);
  desc_u64(&w, init_tag);
  desc_chunk_end(&w, chunk);

  /* 2^48 elements is far beyond any host's memory; the bound keeps every
   * later byte count (x 4 bytes x world) from overflowing 64 bits. */
  const uint64_t max_numel = (uint64_t)1 << 48;
  uint64_t offset = 0;
  for (unsigned t = 0; t < ntensors; t++) {
    tensor_layout *tl = &l->tensors[t];
    tl->name = strdup(tensor_names[t]);
    if (tl->name == NULL) {
      free(w.buf);
      unit_layout_free(l);
      return -ENOMEM;
    }
    for (unsigned k = 0; k < t; k++) {
      if (strcmp(l->tensors[k].name, tl->name) == 0) {
        snprintf(err, err_bytes, "unit '%s': tensor name '%s' appears twice", name, tl->name);
        free(w.buf);
        unit_layout_free(l);
        return -EINVAL;
      }
    }
    tl->ndim = ndims[t];
    tl->frozen = frozen[t] != 0;
    if (!tl->frozen)
      l->trainable = 1;
    uint64_t numel = 1;
    for (unsigned d = 0; d < tl->ndim; d++) {
      tl->shape[d] = shapes[t][d];
      if (tl->shape[d] == 0 || numel > max_numel / tl->shape[d]) {
        snprintf(err, err_bytes, "unit '%s' tensor '%s': dimension %u is %llu (must be 1..2^48)",
                 name, tl->name, d, (unsigned long long)tl->shape[d]);
        free(w.buf);
        unit_layout_free(l);
        return -EINVAL;
      }
      numel *= tl->shape[d];
    }
    tl->numel = numel;
    offset = round_up(offset, JOB_ALIGN_NUMEL);
    tl->offset = offset;
    offset += numel;
    l->packed_numel += numel;
    if (offset > max_numel) {
      snprintf(err, err_bytes, "unit '%s' has more than 2^48 elements", name);
      free(w.buf);
      unit_layout_free(l);
      return -EINVAL;
    }
    chunk = desc_chunk_begin(&w);
    desc_str(&w, tl->name);
    desc_u64(&w, tl->ndim);
    for (unsigned d = 0; d < tl->ndim; d++)
      desc_u64(&w, tl->shape[d]);
    desc_u64(&w, (uint64_t)tl->frozen);
    desc_chunk_end(&w, chunk);
  }
  if (w.failed) {
    free(w.buf);
    unit_layout_free(l);
    return -ENOMEM;
  }
  l->numel = offset;
  l->padded_numel = round_up(offset, (uint64_t)world_size * JOB_ALIGN_NUMEL);
  l->shard_numel = l->padded_numel / (uint64_t)world_size;
  l->descriptor = w.buf;
  l->descriptor_bytes = w.len;
  *out = l;
  return 0;
}

void unit_layout_free(unit_layout *l) {
  if (l == NULL)
    return;
  if (l->tensors != NULL)
    for (unsigned t = 0; t < l->ntensors; t++)
      free(l->tensors[t].name);
  free(l->tensors);
  free(l->name);
  free(l->descriptor);
  free(l);
}

/* The first chunk index where two descriptors differ, or -1 if equal. */
int32_t unit_layout_diff(const uint8_t *a, size_t a_bytes, const uint8_t *b, size_t b_bytes) {
  size_t pa = 0, pb = 0;
  for (int32_t chunk = 0;; chunk++) {
    if (pa >= a_bytes && pb >= b_bytes)
      return -1;
    if (pa + 4 > a_bytes || pb + 4 > b_bytes)
      return chunk;
    uint32_t la = 0, lb = 0;
    for (int i = 0; i < 4; i++) {
      la |= (uint32_t)a[pa + (size_t)i] << (8 * i);
      lb |= (uint32_t)b[pb + (size_t)i] << (8 * i);
    }
    if (la != lb || pa + 4 + la > a_bytes || pb + 4 + lb > b_bytes ||
        memcmp(a + pa + 4, b + pb + 4, la) != 0)
      return chunk;
    pa += 4 + la;
    pb += 4 + lb;
  }
}

/* Describes tensor `index` of a layout for an error message. */
void unit_layout_describe_tensor(const unit_layout *l, int32_t index, char *out, size_t out_bytes) {
  if (l == NULL || index < 0 || (unsigned)index >= l->ntensors) {
    snprintf(out, out_bytes, "(none)");
    return;
  }
  const tensor_layout *t = &l->tensors[index];
  int n = snprintf(out, out_bytes, "'%s' shape [", t->name);
  for (unsigned d = 0; d < t->ndim && n > 0 && (size_t)n < out_bytes; d++)
    n += snprintf(out + n, out_bytes - (size_t)n, "%s%llu", d ? "," : "",
                  (unsigned long long)t->shape[d]);
  if (n > 0 && (size_t)n < out_bytes)
    snprintf(out + n, out_bytes - (size_t)n, "]%s", t->frozen ? " frozen" : "");
}

int tensor_specs_init(tensor_specs *s, unsigned n) {
  unsigned k = n ? n : 1;
  *s = (tensor_specs){.n = n,
                      .names = calloc(k, sizeof *s->names),
                      .shapes = calloc(k, sizeof *s->shapes),
                      .ndims = calloc(k, sizeof *s->ndims),
                      .frozen = calloc(k, sizeof *s->frozen)};
  if (s->names == NULL || s->shapes == NULL || s->ndims == NULL || s->frozen == NULL) {
    tensor_specs_free(s);
    return -ENOMEM;
  }
  return 0;
}

void tensor_specs_free(tensor_specs *s) {
  free(s->names);
  free(s->shapes);
  free(s->ndims);
  free(s->frozen);
  *s = (tensor_specs){0};
}

int unit_layout_build_specs(const char *name, const tensor_specs *s, int world_size,
                            uint64_t init_tag, unit_layout **out, char *err, size_t err_bytes) {
  return unit_layout_build(name, s->n, s->names, s->shapes, s->ndims, s->frozen, world_size,
                           init_tag, out, err, err_bytes);
}
