/* zerodctl_deepspeed: a DeepSpeed JSON config read into a job's config, for
 * `zerodctl jobs create --deepspeed-config FILE` (zerodctl_create.c) and
 * its fuzz target (tests/fuzz/fuzz_deepspeed.c). The mapping is the Python
 * package's JobConfig.from_deepspeed (client/python/zerod/_deepspeed.py),
 * key for key and message for message; docs/zerodctl.md has its table. */
#ifndef ZEROD_ZERODCTL_DEEPSPEED_H
#define ZEROD_ZERODCTL_DEEPSPEED_H

#include <stddef.h>

#include "zerod/v1/ipc.pb-c.h"

#define CTL_DS_MAX_BYTES  (1 << 20) /* a config file, at most */
#define CTL_DS_PATH_BYTES 256       /* offload_optimizer.nvme_path, with its NUL */

/* What a read leaves besides the fields it sets. */
typedef struct ctl_deepspeed {
  char nvme_path[CTL_DS_PATH_BYTES]; /* the offload config's nvme_path points here */
  char *ignored;                     /* "a.b, c (auto)", sorted; NULL if nothing; owned */
  char note[160];                    /* ZeRO stages 0 to 2: zerod shards everything; or "" */
  char error[512];                   /* why a read failed */
} ctl_deepspeed;

/* Reads the DeepSpeed config text (len bytes, JSON) into config, whose
 * optimizer must point to an OptimizerConfig, and offload (config's
 * offload_optimizer then points to it when the text has an offload key):
 * only the fields the text sets are written. Returns 0, or -1 with
 * ds->error naming the key at fault. Free ds with ctl__deepspeed_free
 * either way. */
int ctl__deepspeed_read(const char *text, size_t len, Zerod__V1__JobConfig *config,
                        Zerod__V1__OffloadConfig *offload, ctl_deepspeed *ds);
void ctl__deepspeed_free(ctl_deepspeed *ds);

#endif
