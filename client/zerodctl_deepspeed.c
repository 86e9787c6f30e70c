/* zerodctl_deepspeed: a DeepSpeed JSON config read into a job's config
 * (zerodctl_deepspeed.h).
 *
 * The document is walked once: every key whose dotted path is in the
 * schema is type-checked (a wrong type is an error naming the key), every
 * other key is ignored and reported (the top-most unknown path, its
 * subtree with it), and a known key whose value is "auto" (DeepSpeed's
 * Hugging Face integration fills those in) counts as absent and is
 * reported as "path (auto)"; null counts as absent. Then the known values
 * are mapped; what no longer applies (the other optimizer's
 * hyper-parameters, fp16's loss scaling when fp16 is off) is reported with
 * the reason. The Python package's reader (zerod/_deepspeed.py) is the
 * same walk. Calls only jansson. */
#include "zerodctl_deepspeed.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

enum { DS_OBJ, DS_NUM, DS_INT, DS_BOOL, DS_STR, DS_PAIR };

typedef struct ds_key {
  const char *path;
  int kind;
  double lo, hi; /* DS_INT's range */
} ds_key;

#define U32 0, 4294967295.0
#define ZO  "zero_optimization."
#define OFF ZO "offload_optimizer."
#define OP  "optimizer.params."

static const ds_key schema[] = {
    {"zero_optimization", DS_OBJ, U32},
    {ZO "stage", DS_INT, 0, 3},
    {ZO "offload_optimizer", DS_OBJ, U32},
    {OFF "device", DS_STR, U32},
    {OFF "nvme_path", DS_STR, U32},
    {OFF "buffer_count", DS_INT, U32},
    {OFF "buffer_size", DS_INT, 0, 9007199254740992.0},
    {OFF "pin_memory", DS_BOOL, U32},
    {ZO "zero_quantized_weights", DS_BOOL, U32},
    {ZO "zero_quantized_gradients", DS_BOOL, U32},
    {ZO "zero_hpz_partition_size", DS_INT, U32},
    {"optimizer", DS_OBJ, U32},
    {"optimizer.type", DS_STR, U32},
    {"optimizer.params", DS_OBJ, U32},
    {OP "lr", DS_NUM, U32},
    {OP "betas", DS_PAIR, U32},
    {OP "eps", DS_NUM, U32},
    {OP "weight_decay", DS_NUM, U32},
    {OP "adam_w_mode", DS_BOOL, U32},
    {OP "momentum", DS_NUM, U32},
    {OP "dampening", DS_NUM, U32},
    {OP "nesterov", DS_BOOL, U32},
    {OP "freeze_step", DS_INT, U32},
    {"bf16", DS_OBJ, U32},
    {"bf16.enabled", DS_BOOL, U32},
    {"fp16", DS_OBJ, U32},
    {"fp16.enabled", DS_BOOL, U32},
    {"fp16.loss_scale", DS_NUM, U32},
    {"fp16.initial_scale_power", DS_INT, 0, 63},
    {"fp16.loss_scale_window", DS_INT, U32},
    {"fp16.hysteresis", DS_INT, U32},
    {"fp16.min_loss_scale", DS_NUM, U32},
    {"gradient_clipping", DS_NUM, U32},
};
#define N_KEYS (sizeof schema / sizeof schema[0])

/* A read under way: the known values found, the ignored keys. */
typedef struct ds_read {
  const json_t *found[N_KEYS];
  char **ignored;
  size_t n_ignored, capacity;
  ctl_deepspeed *ds;
} ds_read;

static int key_index(const char *path) {
  for (size_t i = 0; i < N_KEYS; i++)
    if (strcmp(schema[i].path, path) == 0)
      return (int)i;
  return -1;
}

/* The value found at path (a schema path), or NULL. */
static const json_t *get(const ds_read *r, const char *path) {
  int k = key_index(path);
  return k < 0 ? NULL : r->found[k];
}

static double get_number(const ds_read *r, const char *path, double absent) {
  const json_t *v = get(r, path);
  return v != NULL ? json_number_value(v) : absent;
}

static bool get_bool(const ds_read *r, const char *path, bool absent) {
  const json_t *v = get(r, path);
  return v != NULL ? json_is_true(v) : absent;
}

__attribute__((format(printf, 2, 3))) static int fail(ds_read *r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->ds->error, sizeof r->ds->error, fmt, ap);
  va_end(ap);
  return -1;
}

/* Records "path" or "path (reason)" as ignored. */
static int ignore(ds_read *r, const char *path, const char *reason) {
  if (r->n_ignored == r->capacity) {
    size_t capacity = r->capacity ? 2 * r->capacity : 16;
    char **grown = realloc(r->ignored, capacity * sizeof *grown);
    if (grown == NULL)
      return fail(r, "out of memory");
    r->ignored = grown;
    r->capacity = capacity;
  }
  size_t bytes = strlen(path) + (reason != NULL ? strlen(reason) + 3 : 0) + 1;
  char *entry = malloc(bytes);
  if (entry == NULL)
    return fail(r, "out of memory");
  snprintf(entry, bytes, reason != NULL ? "%s (%s)" : "%s", path, reason);
  r->ignored[r->n_ignored++] = entry;
  return 0;
}

static bool finite_number(const json_t *v) {
  return json_is_number(v) && isfinite(json_number_value(v));
}

/* Checks v, found at schema[k], against its kind. */
static int check(ds_read *r, size_t k, const json_t *v) {
  const ds_key *key = &schema[k];
  switch (key->kind) {
  case DS_OBJ:
    return json_is_object(v) ? 0 : fail(r, "%s must be an object", key->path);
  case DS_NUM:
    return finite_number(v) ? 0 : fail(r, "%s must be a number", key->path);
  case DS_BOOL:
    return json_is_boolean(v) ? 0 : fail(r, "%s must be true or false", key->path);
  case DS_STR:
    return json_is_string(v) ? 0 : fail(r, "%s must be a string", key->path);
  case DS_PAIR:
    if (json_is_array(v) && json_array_size(v) == 2 && finite_number(json_array_get(v, 0)) &&
        finite_number(json_array_get(v, 1)))
      return 0;
    return fail(r, "%s must be a list of two numbers", key->path);
  default: {
    double x = finite_number(v) ? json_number_value(v) : -1;
    if (!finite_number(v) || x != floor(x) || x < key->lo || x > key->hi)
      return fail(r, "%s must be an integer from %.0f to %.0f", key->path, key->lo, key->hi);
    return 0;
  }
  }
}

static int walk(ds_read *r, const json_t *object, const char *prefix) {
  const char *name;
  json_t *v;
  json_object_foreach((json_t *)object, name, v) {
    size_t bytes = strlen(prefix) + strlen(name) + 2; /* and a "." for an object's keys */
    char *path = malloc(bytes);
    if (path == NULL)
      return fail(r, "out of memory");
    snprintf(path, bytes, "%s%s", prefix, name);
    int k = key_index(path), rc = 0;
    if (k < 0)
      rc = ignore(r, path, NULL);
    else if (json_is_string(v) && strcmp(json_string_value(v), "auto") == 0)
      rc = ignore(r, path, "auto");
    else if (!json_is_null(v) && (rc = check(r, (size_t)k, v)) == 0) {
      r->found[k] = v;
      if (json_is_object(v))
        rc = walk(r, v, strcat(path, "."));
    }
    free(path);
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* zero_optimization: the stage's note, offload_optimizer and ZeRO++. */
static int map_zero(ds_read *r, Zerod__V1__JobConfig *config, Zerod__V1__OffloadConfig *offload) {
  int stage = (int)get_number(r, ZO "stage", 3);
  if (stage != 3)
    snprintf(r->ds->note, sizeof r->ds->note,
             "zero_optimization.stage %d: zerod shards parameters, gradients and optimizer "
             "states alike (as stage 3)",
             stage);
  static const char *const offload_keys[] = {"device", "nvme_path", "buffer_count", "buffer_size",
                                             "pin_memory"};
  for (size_t i = 0; i < sizeof offload_keys / sizeof offload_keys[0]; i++) {
    char path[64];
    snprintf(path, sizeof path, OFF "%s", offload_keys[i]);
    if (get(r, path) != NULL)
      config->offload_optimizer = offload;
  }
  if (config->offload_optimizer == offload) {
    const json_t *device = get(r, OFF "device");
    const char *name = device != NULL ? json_string_value(device) : "none";
    if (strcmp(name, "none") == 0)
      offload->device = ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NONE;
    else if (strcmp(name, "cpu") == 0)
      offload->device = ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_CPU;
    else if (strcmp(name, "nvme") == 0)
      offload->device = ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME;
    else
      return fail(r, OFF "device must be 'cpu', 'nvme' or 'none'");
    const json_t *path = get(r, OFF "nvme_path");
    if (path != NULL && json_string_length(path) >= CTL_DS_PATH_BYTES)
      return fail(r, OFF "nvme_path is longer than %d bytes", CTL_DS_PATH_BYTES - 1);
    if (path != NULL && strlen(json_string_value(path)) > 0) {
      snprintf(r->ds->nvme_path, sizeof r->ds->nvme_path, "%s", json_string_value(path));
      offload->nvme_path = r->ds->nvme_path;
    }
    offload->buffer_count = (uint32_t)get_number(r, OFF "buffer_count", 0);
    offload->buffer_size = (uint64_t)get_number(r, OFF "buffer_size", 0);
    offload->pin_memory = get_bool(r, OFF "pin_memory", false);
  }
  if (get(r, ZO "zero_quantized_weights") != NULL)
    config->quantized_weights = get_bool(r, ZO "zero_quantized_weights", false);
  /* DeepSpeed's qgZ sends int4 blocks between nodes. */
  if (get_bool(r, ZO "zero_quantized_gradients", false))
    config->quantized_gradients = 4;
  if (get(r, ZO "zero_hpz_partition_size") != NULL)
    config->hpz_partition_size = (uint32_t)get_number(r, ZO "zero_hpz_partition_size", 0);
  return 0;
}

/* optimizer: its type (DeepSpeed's Adam is AdamW unless adam_w_mode is
 * false; OneBitAdam is AdamW with 1-bit compression after freeze_step,
 * DeepSpeed's default 100000) and the params that type takes; the others
 * are ignored. */
static int map_optimizer(ds_read *r, Zerod__V1__JobConfig *config) {
  Zerod__V1__OptimizerConfig *optimizer = config->optimizer;
  static const char *const sgd_params[] = {"momentum", "dampening", "nesterov"};
  static const char *const adam_params[] = {"betas", "eps", "adam_w_mode"};
  const json_t *type = get(r, "optimizer.type");
  const char *kind = "adamw";
  if (type != NULL) {
    const char *name = json_string_value(type);
    if (strcasecmp(name, "onebitadam") == 0)
      config->onebit_freeze_step = (uint32_t)get_number(r, OP "freeze_step", 100000);
    else if (strcasecmp(name, "adamw") != 0 && strcasecmp(name, "adam") != 0 &&
             strcasecmp(name, "sgd") != 0)
      return fail(r, "optimizer.type '%s' is not supported: AdamW, Adam, OneBitAdam or SGD", name);
    kind = strcasecmp(name, "sgd") == 0 ? "sgd" : strcasecmp(name, "adam") == 0 ? "adam" : kind;
  }
  if (config->onebit_freeze_step == 0 && get(r, OP "freeze_step") != NULL) {
    r->found[key_index(OP "freeze_step")] = NULL;
    if (ignore(r, OP "freeze_step", "not for this optimizer.type") != 0)
      return -1;
  }
  if (strcmp(kind, "adam") == 0 && get_bool(r, OP "adam_w_mode", true))
    kind = "adamw";
  bool sgd = strcmp(kind, "sgd") == 0;
  optimizer->kind = sgd                         ? ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD
                    : strcmp(kind, "adam") == 0 ? ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAM
                                                : ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAMW;
  char reason[32];
  snprintf(reason, sizeof reason, "not for %s", kind);
  for (size_t i = 0; i < 6; i++) {
    const char *name = i < 3 ? adam_params[i] : sgd_params[i - 3];
    char path[64];
    snprintf(path, sizeof path, OP "%s", name);
    int k = key_index(path);
    if (r->found[k] != NULL && (i >= 3) != sgd) {
      r->found[k] = NULL;
      if (ignore(r, path, reason) != 0)
        return -1;
    }
  }
  optimizer->lr = get_number(r, OP "lr", optimizer->lr);
  const json_t *betas = get(r, OP "betas");
  if (betas != NULL) {
    optimizer->beta1 = json_number_value(json_array_get(betas, 0));
    optimizer->beta2 = json_number_value(json_array_get(betas, 1));
  }
  if (get(r, OP "weight_decay") != NULL) {
    optimizer->weight_decay = get_number(r, OP "weight_decay", 0);
    optimizer->has_weight_decay = true;
  }
  optimizer->eps = get_number(r, OP "eps", optimizer->eps);
  optimizer->momentum = get_number(r, OP "momentum", optimizer->momentum);
  optimizer->dampening = get_number(r, OP "dampening", optimizer->dampening);
  optimizer->nesterov = get_bool(r, OP "nesterov", optimizer->nesterov);
  return 0;
}

/* bf16 or fp16, and fp16's loss scaling: what the file leaves out takes
 * DeepSpeed's defaults, not zerod's; a static scale is one never grown
 * nor backed off below itself. */
static int map_precision(ds_read *r, Zerod__V1__JobConfig *config) {
  static const char *const scaling[] = {"loss_scale", "initial_scale_power", "loss_scale_window",
                                        "hysteresis", "min_loss_scale"};
  bool bf16 = get_bool(r, "bf16.enabled", false), fp16 = get_bool(r, "fp16.enabled", false);
  if (bf16 && fp16)
    return fail(r, "bf16.enabled and fp16.enabled are both true: enable one");
  if (bf16)
    config->working_dtype = ZEROD__V1__DTYPE__DTYPE_BF16;
  if (!fp16) {
    for (size_t i = 0; i < sizeof scaling / sizeof scaling[0]; i++) {
      char path[64];
      snprintf(path, sizeof path, "fp16.%s", scaling[i]);
      if (get(r, path) != NULL && ignore(r, path, "fp16 not enabled") != 0)
        return -1;
    }
    return 0;
  }
  config->working_dtype = ZEROD__V1__DTYPE__DTYPE_F16;
  double fixed = get_number(r, "fp16.loss_scale", 0);
  if (fixed < 0)
    return fail(r, "fp16.loss_scale must be 0 (dynamic) or more");
  config->loss_scale_window = (uint32_t)get_number(r, "fp16.loss_scale_window", 1000);
  config->loss_scale_hysteresis = (uint32_t)get_number(r, "fp16.hysteresis", 2);
  if (fixed > 0) {
    config->loss_scale = config->loss_scale_min = fixed;
    config->loss_scale_growth = 1;
  } else {
    config->loss_scale = ldexp(1, (int)get_number(r, "fp16.initial_scale_power", 16));
    config->loss_scale_min = get_number(r, "fp16.min_loss_scale", 1);
  }
  return 0;
}

static int compare_entries(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* ds->ignored: the entries sorted, joined with ", ". */
static int join_ignored(ds_read *r) {
  if (r->n_ignored == 0)
    return 0;
  qsort(r->ignored, r->n_ignored, sizeof *r->ignored, compare_entries);
  size_t bytes = 1;
  for (size_t i = 0; i < r->n_ignored; i++)
    bytes += strlen(r->ignored[i]) + 2;
  r->ds->ignored = malloc(bytes);
  if (r->ds->ignored == NULL)
    return fail(r, "out of memory");
  r->ds->ignored[0] = '\0';
  for (size_t i = 0; i < r->n_ignored; i++) {
    if (i > 0)
      strcat(r->ds->ignored, ", ");
    strcat(r->ds->ignored, r->ignored[i]);
  }
  return 0;
}

int ctl__deepspeed_read(const char *text, size_t len, Zerod__V1__JobConfig *config,
                        Zerod__V1__OffloadConfig *offload, ctl_deepspeed *ds) {
  *ds = (ctl_deepspeed){0};
  ds_read r = {.ds = ds};
  json_error_t error;
  json_t *doc = json_loadb(text, len, JSON_DECODE_ANY, &error);
  int rc;
  if (doc == NULL)
    rc = fail(&r, "not JSON: %s (line %d)", error.text, error.line);
  else if (!json_is_object(doc))
    rc = fail(&r, "the document must be a JSON object");
  else {
    rc = walk(&r, doc, "");
    if (rc == 0)
      rc = map_zero(&r, config, offload);
    if (rc == 0)
      rc = map_optimizer(&r, config);
    if (rc == 0)
      rc = map_precision(&r, config);
    if (rc == 0 && get(&r, "gradient_clipping") != NULL)
      config->max_grad_norm = get_number(&r, "gradient_clipping", 0);
    if (rc == 0)
      rc = join_ignored(&r);
  }
  for (size_t i = 0; i < r.n_ignored; i++)
    free(r.ignored[i]);
  free(r.ignored);
  json_decref(doc);
  return rc;
}

void ctl__deepspeed_free(ctl_deepspeed *ds) {
  free(ds->ignored);
  ds->ignored = NULL;
}
