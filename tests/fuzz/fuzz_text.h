/* fuzz_text.h - a fuzz input made into text, for the targets of text
 * readers (fuzz_promtext, fuzz_deepspeed).
 *
 * Random bytes almost never form a well-formed line, so the first input
 * byte picks how the text is made. Odd: the rest of the input is the text,
 * raw. Even: every further byte picks one of the target's tokens, so random
 * inputs reach the deeper parts of the grammar. size must be at least 1;
 * the caller frees the text (NUL-terminated, *len bytes before the NUL). */
#ifndef ZEROD_FUZZ_TEXT_H
#define ZEROD_FUZZ_TEXT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline char *fuzz_text(const uint8_t *data, size_t size, const char *const *tokens,
                              size_t ntokens, size_t *len) {
  char *text = NULL;
  if (data[0] & 1) {
    *len = size - 1;
    text = malloc(*len + 1);
    memcpy(text, data + 1, *len);
    text[*len] = '\0';
    return text;
  }
  FILE *out = open_memstream(&text, len);
  for (size_t i = 1; i < size; i++)
    fputs(tokens[data[i] % ntokens], out);
  fclose(out);
  return text;
}

#endif /* ZEROD_FUZZ_TEXT_H */
