/* Fuzz target: zerodctl's DeepSpeed config reader (client/
 * zerodctl_deepspeed.c), fed what a broken or hostile --deepspeed-config
 * file could hold.
 *
 * Random bytes almost never form a JSON object with the keys the reader
 * knows, so the first input byte picks how the text is made. Odd: the rest
 * of the input is the text, raw. Even: every further byte picks a token of
 * a DeepSpeed config (the known keys, "auto", numbers of each kind,
 * brackets, separators), so random inputs reach the mapping and its
 * refusals. A read that succeeds must leave only values the mapping makes
 * (its dtypes, its offload devices and optimizers, 0 or 4 bit qgZ, a
 * NUL-terminated nvme_path of its own); a read that fails must say
 * why and leave no list; nothing may crash, leak or read outside its
 * buffer. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zerodctl_deepspeed.h"
#include "fuzz_text.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const tokens[] = {
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"zero_optimization\"",
    "\"stage\"",
    "\"offload_optimizer\"",
    "\"device\"",
    "\"nvme_path\"",
    "\"buffer_count\"",
    "\"buffer_size\"",
    "\"pin_memory\"",
    "\"zero_quantized_weights\"",
    "\"zero_quantized_gradients\"",
    "\"zero_hpz_partition_size\"",
    "\"optimizer\"",
    "\"type\"",
    "\"params\"",
    "\"lr\"",
    "\"betas\"",
    "\"eps\"",
    "\"weight_decay\"",
    "\"adam_w_mode\"",
    "\"momentum\"",
    "\"nesterov\"",
    "\"bf16\"",
    "\"fp16\"",
    "\"enabled\"",
    "\"loss_scale\"",
    "\"initial_scale_power\"",
    "\"hysteresis\"",
    "\"min_loss_scale\"",
    "\"gradient_clipping\"",
    "\"auto\"",
    "\"AdamW\"",
    "\"sgd\"",
    "\"nvme\"",
    "\"cpu\"",
    "\"x\\u001b\"",
    "true",
    "false",
    "null",
    "0",
    "3",
    "-1",
    "2.5",
    "1e8",
    "1e400",
    "64",
    "4294967296",
};
#define NTOKENS (sizeof tokens / sizeof tokens[0])

/* What a successful read may leave. */
static void check_config(const Zerod__V1__JobConfig *config,
                         const Zerod__V1__OffloadConfig *offload, const ctl_deepspeed *ds) {
  if (config->working_dtype != ZEROD__V1__DTYPE__DTYPE_UNSPECIFIED &&
      config->working_dtype != ZEROD__V1__DTYPE__DTYPE_BF16 &&
      config->working_dtype != ZEROD__V1__DTYPE__DTYPE_F16)
    abort();
  if (config->quantized_gradients != 0 && config->quantized_gradients != 4)
    abort();
  if (config->offload_optimizer != NULL && config->offload_optimizer != offload)
    abort();
  if (config->offload_optimizer != NULL &&
      (offload->device < ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NONE ||
       offload->device > ZEROD__V1__OFFLOAD_DEVICE__OFFLOAD_DEVICE_NVME))
    abort();
  /* Untouched (protobuf-c's empty string), or the reader's own copy. */
  if (offload->nvme_path[0] != '\0' &&
      (offload->nvme_path != ds->nvme_path || strlen(ds->nvme_path) >= CTL_DS_PATH_BYTES))
    abort();
  int kind = config->optimizer->kind;
  if (kind < ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAMW ||
      kind > ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD)
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0)
    return 0;
  size_t len;
  char *text = fuzz_text(data, size, tokens, NTOKENS, &len);
  Zerod__V1__OptimizerConfig optimizer = ZEROD__V1__OPTIMIZER_CONFIG__INIT;
  Zerod__V1__JobConfig config = ZEROD__V1__JOB_CONFIG__INIT;
  Zerod__V1__OffloadConfig offload = ZEROD__V1__OFFLOAD_CONFIG__INIT;
  config.optimizer = &optimizer;
  ctl_deepspeed ds;
  if (ctl__deepspeed_read(text, len, &config, &offload, &ds) == 0) {
    check_config(&config, &offload, &ds);
    if (ds.error[0] != '\0')
      abort();
  } else if (ds.error[0] == '\0' || ds.ignored != NULL) {
    abort(); /* a failure says why and lists nothing */
  }
  ctl__deepspeed_free(&ds);
  free(text);
  return 0;
}
