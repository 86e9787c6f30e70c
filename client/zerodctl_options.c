/* zerodctl_options: zerodctl's options (zerodctl_impl.h).
 *
 * The options may come before or after the command. Each is parsed here,
 * with one usage error line for a mistake that names the option as the
 * user spelled it; jobs create's are kept as given (create_options) for
 * zerodctl_create.c to check, and an option that belongs to one command is
 * remembered so that another command can refuse it. Calls
 * zerodctl_args.c and zerodctl_output.c. */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "zerodctl_impl.h"

enum {
  OPT_VERSION = 1000,
  OPT_NODES,
  OPT_RANKS_PER_NODE,
  OPT_NODE,
  OPT_DEEPSPEED_CONFIG,
  OPT_OPTIMIZER,
  OPT_LR,
  OPT_WEIGHT_DECAY,
  OPT_BETAS,
  OPT_EPS,
  OPT_MOMENTUM,
  OPT_PRECISION,
  OPT_COLLECTIVES,
  OPT_QUANTIZED_WEIGHTS,
  OPT_QUANTIZATION_BLOCK,
  OPT_QUANTIZED_GRADIENTS,
  OPT_GRADIENT_COMM_DTYPE,
  OPT_HPZ_PARTITION_SIZE,
  OPT_ONEBIT_FREEZE_STEP,
  OPT_POWERSGD_RANK,
  OPT_POWERSGD_START_STEP,
  OPT_OFFLOAD,
  OPT_NVME_PATH,
  OPT_OFFLOAD_BUFFER_COUNT,
  OPT_OFFLOAD_BUFFER_SIZE,
  OPT_OFFLOAD_PIN_MEMORY,
  OPT_MAX_GRAD_NORM,
  OPT_MAX_LIVE_BYTES,
  OPT_MAX_HOST_BYTES,
  OPT_MAX_DEVICE_BYTES,
  OPT_MAX_SESSIONS,
  OPT_TOKEN,
  OPT_TENANT,
  OPT_BASE,
  OPT_EVERY_STEPS,
  OPT_EVERY_SECONDS,
  OPT_KEEP,
  OPT_REDUNDANCY,
  OPT_REDUNDANCY_EVERY,
  OPT_CHECKPOINT,
  OPT_DTYPE,
  OPT_OVERWRITE,
  /* jobs freeze */
  OPT_SHARE,
  OPT_PUBLIC,
  /* how to reach the coordinator (any command) */
  OPT_TLS_CA,
  OPT_TLS_CERT,
  OPT_TLS_KEY,
  OPT_TLS_SERVER_NAME,
  OPT_AUTH_TOKEN_FILE,
  OPT_INSECURE,
};

static const struct option long_options[] = {
    {"coordinator", required_argument, NULL, 'c'},
    {"json", no_argument, NULL, 'j'},
    {"timeout", required_argument, NULL, 't'},
    {"help", no_argument, NULL, 'h'},
    {"version", no_argument, NULL, OPT_VERSION},
    /* jobs create */
    {"nodes", required_argument, NULL, OPT_NODES},
    {"ranks-per-node", required_argument, NULL, OPT_RANKS_PER_NODE},
    {"node", required_argument, NULL, OPT_NODE},
    {"deepspeed-config", required_argument, NULL, OPT_DEEPSPEED_CONFIG},
    {"optimizer", required_argument, NULL, OPT_OPTIMIZER},
    {"lr", required_argument, NULL, OPT_LR},
    {"weight-decay", required_argument, NULL, OPT_WEIGHT_DECAY},
    {"betas", required_argument, NULL, OPT_BETAS},
    {"eps", required_argument, NULL, OPT_EPS},
    {"momentum", required_argument, NULL, OPT_MOMENTUM},
    {"precision", required_argument, NULL, OPT_PRECISION},
    {"collectives", required_argument, NULL, OPT_COLLECTIVES},
    {"quantized-weights", no_argument, NULL, OPT_QUANTIZED_WEIGHTS},
    {"quantization-block", required_argument, NULL, OPT_QUANTIZATION_BLOCK},
    {"quantized-gradients", required_argument, NULL, OPT_QUANTIZED_GRADIENTS},
    {"gradient-comm-dtype", required_argument, NULL, OPT_GRADIENT_COMM_DTYPE},
    {"hpz-partition-size", required_argument, NULL, OPT_HPZ_PARTITION_SIZE},
    {"onebit-adam", required_argument, NULL, OPT_ONEBIT_FREEZE_STEP},
    {"powersgd-rank", required_argument, NULL, OPT_POWERSGD_RANK},
    {"powersgd-start", required_argument, NULL, OPT_POWERSGD_START_STEP},
    {"offload-optimizer", required_argument, NULL, OPT_OFFLOAD},
    {"nvme-path", required_argument, NULL, OPT_NVME_PATH},
    {"offload-buffer-count", required_argument, NULL, OPT_OFFLOAD_BUFFER_COUNT},
    {"offload-buffer-size", required_argument, NULL, OPT_OFFLOAD_BUFFER_SIZE},
    {"offload-pin-memory", no_argument, NULL, OPT_OFFLOAD_PIN_MEMORY},
    {"max-grad-norm", required_argument, NULL, OPT_MAX_GRAD_NORM},
    {"max-live-bytes", required_argument, NULL, OPT_MAX_LIVE_BYTES},
    {"max-host-bytes", required_argument, NULL, OPT_MAX_HOST_BYTES},
    {"max-device-bytes", required_argument, NULL, OPT_MAX_DEVICE_BYTES},
    {"max-sessions", required_argument, NULL, OPT_MAX_SESSIONS},
    {"token", required_argument, NULL, OPT_TOKEN},
    {"tenant", required_argument, NULL, OPT_TENANT},
    {"base", required_argument, NULL, OPT_BASE},
    {"checkpoint-every-steps", required_argument, NULL, OPT_EVERY_STEPS},
    {"checkpoint-every-seconds", required_argument, NULL, OPT_EVERY_SECONDS},
    {"checkpoint-keep", required_argument, NULL, OPT_KEEP},
    {"redundancy", required_argument, NULL, OPT_REDUNDANCY},
    {"redundancy-every-steps", required_argument, NULL, OPT_REDUNDANCY_EVERY},
    /* export */
    {"checkpoint", required_argument, NULL, OPT_CHECKPOINT},
    {"dtype", required_argument, NULL, OPT_DTYPE},
    {"overwrite", no_argument, NULL, OPT_OVERWRITE},
    /* jobs freeze */
    {"share", required_argument, NULL, OPT_SHARE},
    {"public", no_argument, NULL, OPT_PUBLIC},
    {"tls-ca", required_argument, NULL, OPT_TLS_CA},
    {"tls-cert", required_argument, NULL, OPT_TLS_CERT},
    {"tls-key", required_argument, NULL, OPT_TLS_KEY},
    {"tls-server-name", required_argument, NULL, OPT_TLS_SERVER_NAME},
    {"auth-token-file", required_argument, NULL, OPT_AUTH_TOKEN_FILE},
    {"insecure", no_argument, NULL, OPT_INSECURE},
    {NULL, 0, NULL, 0},
};

/* Records one `jobs create` option; returns 0 or the usage exit status. */
static int set_create_option(create_options *o, int opt, const char *value, const char *spelled) {
  const char **slot = NULL;
  switch (opt) {
  case OPT_NODES:
    slot = &o->nodes;
    break;
  case OPT_RANKS_PER_NODE:
    slot = &o->ranks_per_node;
    break;
  case OPT_DEEPSPEED_CONFIG:
    slot = &o->deepspeed_config;
    break;
  case OPT_OPTIMIZER:
    slot = &o->optimizer;
    break;
  case OPT_LR:
    slot = &o->lr;
    break;
  case OPT_WEIGHT_DECAY:
    slot = &o->weight_decay;
    break;
  case OPT_BETAS:
    slot = &o->betas;
    break;
  case OPT_EPS:
    slot = &o->eps;
    break;
  case OPT_MOMENTUM:
    slot = &o->momentum;
    break;
  case OPT_PRECISION:
    slot = &o->precision;
    break;
  case OPT_COLLECTIVES:
    slot = &o->collectives;
    break;
  case OPT_QUANTIZED_WEIGHTS:
    slot = &o->quantized_weights;
    value = "on";
    break;
  case OPT_QUANTIZATION_BLOCK:
    slot = &o->quantization_block;
    break;
  case OPT_QUANTIZED_GRADIENTS:
    slot = &o->quantized_gradients;
    break;
  case OPT_GRADIENT_COMM_DTYPE:
    slot = &o->gradient_comm_dtype;
    break;
  case OPT_HPZ_PARTITION_SIZE:
    slot = &o->hpz_partition_size;
    break;
  case OPT_ONEBIT_FREEZE_STEP:
    slot = &o->onebit_freeze_step;
    break;
  case OPT_POWERSGD_RANK:
    slot = &o->powersgd_rank;
    break;
  case OPT_POWERSGD_START_STEP:
    slot = &o->powersgd_start_step;
    break;
  case OPT_OFFLOAD:
    slot = &o->offload;
    break;
  case OPT_NVME_PATH:
    slot = &o->nvme_path;
    break;
  case OPT_OFFLOAD_BUFFER_COUNT:
    slot = &o->offload_buffer_count;
    break;
  case OPT_OFFLOAD_BUFFER_SIZE:
    slot = &o->offload_buffer_size;
    break;
  case OPT_OFFLOAD_PIN_MEMORY:
    slot = &o->offload_pin_memory;
    value = "on";
    break;
  case OPT_MAX_GRAD_NORM:
    slot = &o->max_grad_norm;
    break;
  case OPT_MAX_LIVE_BYTES:
    slot = &o->max_live_bytes;
    break;
  case OPT_MAX_HOST_BYTES:
    slot = &o->max_host_bytes;
    break;
  case OPT_MAX_DEVICE_BYTES:
    slot = &o->max_device_bytes;
    break;
  case OPT_MAX_SESSIONS:
    slot = &o->max_sessions;
    break;
  case OPT_TOKEN:
    slot = &o->token;
    break;
  case OPT_TENANT:
    slot = &o->tenant;
    break;
  case OPT_BASE:
    slot = &o->base;
    break;
  case OPT_EVERY_STEPS:
    slot = &o->every_steps;
    break;
  case OPT_EVERY_SECONDS:
    slot = &o->every_seconds;
    break;
  case OPT_KEEP:
    slot = &o->keep;
    break;
  case OPT_REDUNDANCY:
    slot = &o->redundancy;
    break;
  case OPT_REDUNDANCY_EVERY:
    slot = &o->redundancy_every;
    break;
  case OPT_NODE:
    if (o->n_node_lists == CTL_MAX_NODES)
      return ctl__usage_error("jobs create: --node given more than %d times", CTL_MAX_NODES);
    o->node_lists[o->n_node_lists++] = value;
    break;
  default:
    return ctl__usage_error("unknown option '%s'", spelled);
  }
  if (slot != NULL)
    *slot = value;
  return 0;
}

/* The option as the user spelled it, for messages: "--nodes" (also from
 * "--nodes=3"), "-c". */
static void option_spelling(int opt, int long_index, const char *arg, char *out, size_t out_bytes) {
  if (long_index >= 0)
    snprintf(out, out_bytes, "--%s", long_options[long_index].name);
  else if (arg != NULL && strncmp(arg, "--", 2) == 0)
    snprintf(out, out_bytes, "%.*s", (int)strcspn(arg, "="), arg);
  else if (opt > 0 && opt < 128)
    snprintf(out, out_bytes, "-%c", opt);
  else
    snprintf(out, out_bytes, "%s", arg != NULL ? arg : "?");
}

/* ------------------------------------------------------------------------ */
/* The command line's options                                               */
/* ------------------------------------------------------------------------ */

int ctl__parse_options(int argc, char **argv, ctl *c, ctl_options *o) {
  char spelled[64];
  *o = (ctl_options){.owned = {{"jobs create", OPT_NODES, OPT_REDUNDANCY_EVERY, ""},
                               {"export", OPT_CHECKPOINT, OPT_OVERWRITE, ""},
                               {"jobs freeze", OPT_SHARE, OPT_PUBLIC, ""}}};

  opterr = 0; /* our own one-line messages */
  int opt, long_index = -1;
  while ((opt = getopt_long(argc, argv, ":c:jt:h", long_options, &long_index)) != -1) {
    /* After an error getopt names the option in optopt (0: an unknown long
     * option) and argv[optind - 1] is the word it was reading. */
    const char *word = optind > 0 && optind <= argc ? argv[optind - 1] : NULL;
    if (opt == '?' || opt == ':')
      option_spelling(optopt, -1, word, spelled, sizeof spelled);
    else
      option_spelling(opt, long_index, word, spelled, sizeof spelled);
    long_index = -1;
    switch (opt) {
    case 'c':
      c->coordinator = optarg;
      break;
    case 'j':
      c->json = true;
      break;
    case 't':
      if (ctl__parse_timeout(optarg, &c->timeout_s) != 0)
        return ctl__usage_error("invalid --timeout '%s': expected seconds, > 0 and <= %g", optarg,
                                CTL_MAX_TIMEOUT_S);
      o->timeout_given = true;
      break;
    case 'h':
      o->help = true;
      break;
    case OPT_VERSION:
      o->version = true;
      break;
    case OPT_TLS_CA:
      c->tls.ca_file = optarg;
      break;
    case OPT_TLS_CERT:
      c->tls.cert_file = optarg;
      break;
    case OPT_TLS_KEY:
      c->tls.key_file = optarg;
      break;
    case OPT_TLS_SERVER_NAME:
      c->tls.server_name = optarg;
      break;
    case OPT_AUTH_TOKEN_FILE:
      o->token_file = optarg;
      break;
    case OPT_INSECURE:
      o->insecure = true;
      break;
    case OPT_CHECKPOINT:
    case OPT_DTYPE:
    case OPT_OVERWRITE:
      if (opt == OPT_CHECKPOINT)
        c->export_checkpoint = optarg;
      else if (opt == OPT_DTYPE)
        c->export_dtype = optarg;
      else
        c->export_overwrite = true;
      break;
    case OPT_SHARE:
      c->freeze_share = optarg;
      break;
    case OPT_PUBLIC:
      c->freeze_public = true;
      break;
    case ':':
      return ctl__usage_error("option '%s' needs a value (see zerodctl --help)", spelled);
    case '?':
      if (optopt != 0 && word != NULL && strncmp(word, "--", 2) == 0)
        return ctl__usage_error("option '%s' takes no value (see zerodctl --help)", spelled);
      return ctl__usage_error("unknown option '%s' (see zerodctl --help)", spelled);
    default: {
      int rc = set_create_option(&o->create, opt, optarg, spelled);
      if (rc != 0)
        return rc;
      break;
    }
    }
    for (size_t i = 0; i < sizeof o->owned / sizeof o->owned[0]; i++)
      if (opt >= o->owned[i].first_opt && opt <= o->owned[i].last_opt &&
          o->owned[i].given[0] == '\0')
        snprintf(o->owned[i].given, sizeof o->owned[i].given, "%s", spelled);
  }
  return 0;
}

int ctl__check_owned_options(const ctl_options *o, const char *command) {
  for (size_t i = 0; i < sizeof o->owned / sizeof o->owned[0]; i++)
    if (o->owned[i].given[0] != '\0' && strcmp(command, o->owned[i].command) != 0)
      return ctl__usage_error("%s: option '%s' belongs to %s", command, o->owned[i].given,
                              o->owned[i].command);
  return 0;
}
