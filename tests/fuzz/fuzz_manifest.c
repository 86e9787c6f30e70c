/* Fuzz target: the checkpoint manifest decoder
 * (daemon/ckpt/ckpt_manifest_decode.c), fed what a damaged or hostile
 * manifest.json or layout.json could hold.
 *
 * Every input is decoded both as a manifest and as a layout
 * (CKPT_DECODE_NO_FILES). Decoding must never crash, leak or read outside
 * the buffer; a refusal must say why and leave nothing allocated; and a
 * manifest it accepts must encode, decode again, and encode to the very
 * same bytes (the encoder is deterministic and loses nothing).
 *
 * Random bytes are seldom JSON, let alone a manifest whose sizes agree, so
 * with bit 7 of the first byte set the rest of the input instead steers a
 * generator: a manifest struct with values drawn mostly from the edges the
 * validators check (names like "", "..", "a/b" and 256 bytes; tenants
 * none, 64 bytes, or with a '/' or a space; world sizes
 * 0, 1, 4096, 4097; counts around 2^63 and 2^64; tensors that overlap,
 * leave gaps, or run past their unit), encoded by ckpt_manifest_encode,
 * and then sometimes damaged at one byte. That reaches every rule on
 * plain pseudo-random input, as the replay build runs it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* ------------------------------------------------------------------------ */
/* The checks                                                               */
/* ------------------------------------------------------------------------ */

static void check_text(const char *text, size_t len, int flags) {
  ckpt_manifest m;
  char err[512] = "";
  int rc = ckpt_manifest_decode(text, len, flags, &m, err, sizeof err);
  if (rc != 0) {
    if (rc > 0 || err[0] == '\0' || m.job != NULL || m.units != NULL || m.files != NULL)
      abort(); /* a refusal says why and leaves nothing behind */
    return;
  }
  if ((flags & CKPT_DECODE_NO_FILES) && m.files != NULL)
    abort();
  size_t first_len, second_len;
  char *first = ckpt_manifest_encode(&m, &first_len);
  if (first == NULL)
    abort(); /* everything a decode accepts is encodable */
  ckpt_manifest again;
  if (ckpt_manifest_decode(first, first_len, flags, &again, err, sizeof err) != 0)
    abort(); /* and what it encodes decodes */
  char *second = ckpt_manifest_encode(&again, &second_len);
  if (second == NULL || second_len != first_len || memcmp(first, second, first_len) != 0)
    abort();
  if (ckpt_shard_data_bytes(&again) != ckpt_shard_data_bytes(&m))
    abort();
  free(first);
  free(second);
  ckpt_manifest_free(&again);
  ckpt_manifest_free(&m);
}

static void check_both(const char *text, size_t len) {
  check_text(text, len, 0);
  check_text(text, len, CKPT_DECODE_NO_FILES);
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

static uint64_t pick_integer(source *s) {
  static const uint64_t edges[] = {0,          1,          2,
                                   3,          7,          24,
                                   4096,       4097,       1ull << 20,
                                   1ull << 32, 1ull << 53, (1ull << 53) + 1,
                                   1ull << 61, INT64_MAX,  (uint64_t)INT64_MAX + 1,
                                   UINT64_MAX};
  uint8_t b = take(s);
  if (b < 192)
    return b < 128 ? b % 9 : edges[b % (sizeof edges / sizeof edges[0])];
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v = v << 8 | take(s);
  return v;
}

static double pick_double(source *s) {
  static const double edges[] = {0, 1e-3, 0.1, 0.9, 0.999, 1e-8, 1, -1, -0.0, 1e308, 5e-324};
  uint8_t b = take(s);
  return edges[b % (sizeof edges / sizeof edges[0])];
}

static char *pick_name(source *s, int unit_scope) {
  static const char *const names[] = {"w",   "b",      "layer.0",  "",         ".",    "..",
                                      "a/b", "x\x01y", "\xc3\xa9", "\xff\xfe", "embed"};
  uint8_t b = take(s);
  if (b >= 240) {
    /* Around the length limits: 255, 256, 257 bytes. */
    size_t len = 255 + b % 3;
    char *long_name = malloc(len + 1);
    if (long_name != NULL) {
      memset(long_name, 'n', len);
      long_name[len] = '\0';
    }
    return long_name;
  }
  if (!unit_scope && b < 120)
    return strdup(b % 2 ? "job" : "step-100");
  return strdup(names[b % (sizeof names / sizeof names[0])]);
}

static void pick_string(source *s, char *out, size_t out_bytes, const char *const *choices,
                        size_t nchoices) {
  snprintf(out, out_bytes, "%s", choices[take(s) % nchoices]);
}

/* A manifest struct that is mostly consistent, with values from the
 * edges; NULL names (out of memory) make the encoder refuse it. */
static void generate(source *s, ckpt_manifest *m) {
  static const char *const optimizers[] = {"adamw", "adam", "sgd", "lion", ""};
  static const char *const dtypes[] = {"fp32", "bf16", "fp8"};
  static const uint32_t worlds[] = {1, 2, 3, 4, 8, 4096, 4097, 0};
  memset(m, 0, sizeof *m);
  m->job = pick_name(s, 0);
  m->name = pick_name(s, 0);
  m->job_id = pick_integer(s);
  /* The owner: none, names at the edge of the alphabet, and ones the
   * decoder refuses (the encoder must refuse them too). */
  static const char *const tenants[] = {"",    "team-a", "T.e_n-4",  "a/b",
                                        "x y", "..",     "\xc3\xa9", "t\x01"};
  pick_string(s, m->tenant, sizeof m->tenant, tenants, sizeof tenants / sizeof tenants[0]);
  if (take(s) == 255)
    memset(m->tenant, 't', CKPT_TENANT_MAX_BYTES); /* the longest: 64 bytes */
  m->created_unix_ms = (int64_t)pick_integer(s);
  m->step = pick_integer(s);
  m->version = pick_integer(s);
  m->world_size = worlds[take(s) % (sizeof worlds / sizeof worlds[0])];
  pick_string(s, m->config.optimizer, sizeof m->config.optimizer, optimizers, 5);
  pick_string(s, m->config.working_dtype, sizeof m->config.working_dtype, dtypes, 3);
  m->config.lr = pick_double(s);
  m->config.beta1 = pick_double(s);
  m->config.beta2 = pick_double(s);
  m->config.eps = pick_double(s);
  m->config.weight_decay = pick_double(s);
  m->config.momentum = pick_double(s);
  m->config.dampening = pick_double(s);
  m->config.max_grad_norm = pick_double(s);
  uint8_t bits = take(s);
  m->config.nesterov = bits & 1;
  m->has_moment1 = (bits >> 1) & 1;
  m->has_moment2 = (bits >> 2) & 1;
  m->nunits = take(s) % 4;
  m->units = calloc(m->nunits > 0 ? m->nunits : 1, sizeof *m->units);
  if (m->units == NULL) {
    m->nunits = 0;
    return;
  }
  /* A compressing job's state for some kind and node count (one that does
   * not divide the world, or an unknown kind, is refused by the encoder's
   * check) and counts per unit. */
  if ((bits >> 3) & 1) {
    static const char *const kinds[] = {"onebit", "powersgd", "topk"};
    pick_string(s, m->feedback.kind, sizeof m->feedback.kind, kinds, 3);
    m->feedback.nodes = (uint32_t)(take(s) % 5);
    m->feedback.numel = calloc(m->nunits > 0 ? m->nunits : 1, sizeof *m->feedback.numel);
    for (unsigned u = 0; m->feedback.numel != NULL && u < m->nunits; u++)
      m->feedback.numel[u] = take(s) < 224 ? take(s) : pick_integer(s);
  }
  for (unsigned u = 0; u < m->nunits; u++) {
    ckpt_unit *unit = &m->units[u];
    unit->name = pick_name(s, 1);
    unit->ntensors = take(s) % 4;
    unit->tensors = calloc(unit->ntensors > 0 ? unit->ntensors : 1, sizeof *unit->tensors);
    if (unit->tensors == NULL) {
      unit->ntensors = 0;
      continue;
    }
    uint64_t end = 0;
    for (unsigned i = 0; i < unit->ntensors; i++) {
      ckpt_tensor *t = &unit->tensors[i];
      t->name = pick_name(s, 1);
      t->ndim = take(s) % (CKPT_MAX_TENSOR_DIM + 1);
      t->numel = 1;
      for (unsigned d = 0; d < t->ndim; d++) {
        t->shape[d] = take(s) < 224 ? 1u + take(s) % 5u : pick_integer(s);
        t->numel *= t->shape[d];
      }
      uint8_t placement = take(s);
      t->offset = placement < 160 ? end : placement < 200 ? end + 1 : end - 1 + (end == 0);
      if (placement >= 248)
        t->offset = pick_integer(s);
      t->frozen = placement & 1;
      end = t->offset + t->numel;
    }
    uint8_t shape = take(s);
    unit->numel = shape < 200 ? end : end + 1;
    uint32_t world = m->world_size ? m->world_size : 1;
    unit->shard_numel = (unit->numel + world - 1) / world + (shape % 4 == 0);
    unit->padded_numel = unit->shard_numel * world + (shape >= 250);
    if (shape == 255)
      unit->shard_numel = pick_integer(s);
  }
  /* Files for thousands of ranks are slow to check (tens of milliseconds
   * an input) and add nothing over a few: every rank's entry takes the
   * same path. Large worlds get none, so that a campaign of 10^7 inputs
   * is not spent on a few of them (libFuzzer keeps and mutates them). */
  uint8_t files = take(s);
  if (files < 64 || m->world_size == 0 || m->world_size > 8)
    return;
  m->files = calloc(m->world_size, sizeof *m->files);
  if (m->files == NULL)
    return;
  for (uint32_t k = 0; k < m->world_size; k++) {
    char name[40];
    ckpt_shard_name(files == 64 && k == 0 ? 1 : k, m->world_size, name, sizeof name);
    m->files[k].name = strdup(name);
    m->files[k].bytes = ckpt_shard_file_bytes(m) + (files == 65);
    m->files[k].xxh64 = (uint64_t)k * 0x9e3779b97f4a7c15ull;
  }
}

static void fuzz_generated(const uint8_t *bytes, size_t nbytes) {
  source s = {bytes, nbytes};
  ckpt_manifest m;
  generate(&s, &m);
  size_t len;
  char *text = ckpt_manifest_encode(&m, &len);
  ckpt_manifest_free(&m);
  if (text == NULL)
    return;
  /* Sometimes damage one byte with a character that matters to JSON. */
  static const char damage[] = "\"{}[],:-09 .e\\x";
  uint8_t how = take(&s);
  if (how >= 192 && len > 0) {
    size_t at = ((size_t)take(&s) << 8 | take(&s)) % len;
    text[at] = damage[how % (sizeof damage - 1)];
  }
  /* An exact-size copy, so that AddressSanitizer sees any over-read. */
  char *exact = malloc(len ? len : 1);
  if (exact != NULL) {
    memcpy(exact, text, len);
    check_both(exact, len);
    free(exact);
  }
  free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  if (data[0] & 0x80) {
    fuzz_generated(data + 1, size - 1);
    return 0;
  }
  size_t len = size - 1;
  char *text = malloc(len ? len : 1);
  if (text == NULL)
    return 0;
  memcpy(text, data + 1, len);
  check_both(text, len);
  free(text);
  return 0;
}
