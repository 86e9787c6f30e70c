/* Fuzz target: the Prometheus text reader of zerodctl top (client/
 * promtext.c), fed what a hostile or broken /metrics endpoint could send.
 *
 * Random bytes almost never form a sample line, so the first input byte
 * picks how the text is made. Odd: the rest of the input is the text, raw.
 * Even: every further byte picks a token of the format's alphabet (names,
 * braces, quotes, escapes, numbers, NaN and Inf, comments, newlines), so
 * random inputs reach labels, escapes and values. A text that parses must
 * hold only what the grammar allows (names of the right characters, no
 * label twice), and written back in the format it must parse again to the
 * same samples; nothing may crash, leak or read outside its buffer. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "promtext.h"
#include "fuzz_text.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const tokens[] = {
    "zerod_step", "rank",  "le",  "a",    "_",     ":",        "9",
    "{",          "}",     "=",   "\"",   ",",     " ",        "\t",
    "\n",         "\r",    "\\",  "\\n",  "\\\"",  "\\\\",     "1",
    "1.5",        "-2e-3", "NaN", "+Inf", "-Inf",  "#",        "# HELP x y\n",
    "x{",         "\"v\"", "0x1", "inf",  "1e999", "\xc3\xa9",
};
#define NTOKENS (sizeof tokens / sizeof tokens[0])

static int name_ok(const char *s, int colons) {
  if (s[0] == '\0' || (s[0] >= '0' && s[0] <= '9'))
    return 0;
  for (const char *p = s; *p != '\0'; p++)
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
          *p == '_' || (colons && *p == ':')))
      return 0;
  return 1;
}

/* The set in the format again, label values escaped. */
static char *write_back(const prom_set *set, size_t *len) {
  char *buf = NULL;
  FILE *out = open_memstream(&buf, len);
  if (out == NULL)
    abort();
  for (size_t i = 0; i < set->n; i++) {
    const prom_sample *s = &set->samples[i];
    fputs(s->name, out);
    if (s->nlabels > 0) {
      fputc('{', out);
      for (size_t l = 0; l < s->nlabels; l++) {
        fprintf(out, "%s%s=\"", l ? "," : "", s->labels[l].name);
        for (const char *c = s->labels[l].value; *c != '\0'; c++) {
          if (*c == '\\' || *c == '"')
            fputc('\\', out);
          if (*c == '\n')
            fputs("\\n", out);
          else
            fputc(*c, out);
        }
        fputc('"', out);
      }
      fputc('}', out);
    }
    fprintf(out, " %.17g\n", s->value);
  }
  fclose(out);
  return buf;
}

static int same_value(double a, double b) {
  return (isnan(a) && isnan(b)) || a == b;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0)
    return 0;
  size_t len;
  char *text = fuzz_text(data, size, tokens, NTOKENS, &len);
  prom_set set;
  char err[256];
  if (prom_parse(text, len, &set, err, sizeof err) == 0) {
    for (size_t i = 0; i < set.n; i++) {
      const prom_sample *s = &set.samples[i];
      if (!name_ok(s->name, 1) || strlen(s->name) > PROM_MAX_NAME || s->nlabels > PROM_MAX_LABELS)
        abort();
      for (size_t l = 0; l < s->nlabels; l++) {
        if (!name_ok(s->labels[l].name, 0) || strlen(s->labels[l].value) > PROM_MAX_VALUE)
          abort();
        for (size_t k = 0; k < l; k++)
          if (strcmp(s->labels[k].name, s->labels[l].name) == 0)
            abort();
        if (prom_label_value(s, s->labels[l].name) != s->labels[l].value)
          abort();
      }
    }
    size_t again_len;
    char *again = write_back(&set, &again_len);
    prom_set round;
    if (prom_parse(again, again_len, &round, err, sizeof err) != 0 || round.n != set.n)
      abort();
    for (size_t i = 0; i < set.n; i++) {
      const prom_sample *a = &set.samples[i], *b = &round.samples[i];
      if (strcmp(a->name, b->name) != 0 || a->nlabels != b->nlabels ||
          !same_value(a->value, b->value))
        abort();
      for (size_t l = 0; l < a->nlabels; l++)
        if (strcmp(a->labels[l].name, b->labels[l].name) != 0 ||
            strcmp(a->labels[l].value, b->labels[l].value) != 0)
          abort();
    }
    prom_set_free(&round);
    free(again);
    prom_set_free(&set);
  } else if (set.n != 0 || set.samples != NULL || err[0] == '\0') {
    abort(); /* a failure leaves nothing and says why */
  }
  free(text);
  return 0;
}
