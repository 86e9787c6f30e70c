/* promtext: a reader of Prometheus' text exposition format (version
 * 0.0.4), for zerodctl top, which reads the daemons' /metrics.
 *
 * The text comes from the network, so the reader trusts nothing: every
 * line is checked against the format's grammar (names, quoted and escaped
 * label values, a value, an optional timestamp), sizes are bounded, and a
 * malformed line fails the whole text with its line number. Comments
 * (# HELP, # TYPE) are skipped; zerodctl knows the types it reads. */
#ifndef ZEROD_PROMTEXT_H
#define ZEROD_PROMTEXT_H

#include <stddef.h>

#define PROM_MAX_LABELS  32      /* per sample */
#define PROM_MAX_NAME    256     /* bytes of a metric or label name */
#define PROM_MAX_VALUE   4096    /* bytes of a label value, unescaped */
#define PROM_MAX_SAMPLES 1000000 /* per text */

typedef struct prom_label {
  char *name, *value;
} prom_label;

typedef struct prom_sample {
  char *name;
  prom_label *labels;
  size_t nlabels;
  double value;
} prom_sample;

typedef struct prom_set {
  prom_sample *samples;
  size_t n;
} prom_set;

/* Parses len bytes of text (no NUL needed; one is an error). 0 with the
 * samples in *out (free with prom_set_free), or -EINVAL with "line N: why"
 * in err, or -ENOMEM. *out is empty on failure. */
int prom_parse(const char *text, size_t len, prom_set *out, char *err, size_t err_bytes);
void prom_set_free(prom_set *set);

/* The value of the sample's label name, or NULL. */
const char *prom_label_value(const prom_sample *s, const char *name);

#endif /* ZEROD_PROMTEXT_H */
