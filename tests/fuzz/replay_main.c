/* Runs a libFuzzer target without libFuzzer: on the files named on the
 * command line and the files in the directories named there (a corpus,
 * seeds or crash reproducers), or, with no arguments, on a fixed series of
 * pseudo-random inputs. This keeps every fuzz target built and exercised by
 * ctest (and under ASan/UBSan in the sanitizer build) on machines where
 * clang's libFuzzer is not installed. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) {
    perror(path);
    return 1;
  }
  static uint8_t buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  LLVMFuzzerTestOneInput(buf, n);
  return 0;
}

/* Runs every regular file of a directory (a libFuzzer corpus is flat).
 * Returns 1 if one could not be read; counts the inputs run in *runs. */
static int run_dir(const char *path, int *runs) {
  DIR *d = opendir(path);
  if (d == NULL) {
    perror(path);
    return 1;
  }
  int failed = 0;
  struct dirent *e;
  char file[4096];
  while ((e = readdir(d)) != NULL) {
    struct stat st;
    snprintf(file, sizeof file, "%s/%s", path, e->d_name);
    if (e->d_name[0] == '.' || stat(file, &st) != 0 || !S_ISREG(st.st_mode))
      continue;
    failed |= run_file(file);
    (*runs)++;
  }
  closedir(d);
  return failed;
}

int main(int argc, char **argv) {
  if (argc > 1) {
    int failed = 0, runs = 0;
    for (int i = 1; i < argc; i++) {
      struct stat st;
      if (stat(argv[i], &st) == 0 && S_ISDIR(st.st_mode)) {
        failed |= run_dir(argv[i], &runs);
      } else {
        failed |= run_file(argv[i]);
        runs++;
      }
    }
    printf("replayed %d input(s)\n", runs);
    return failed || runs == 0;
  }
  uint64_t state = 0x5eed;
  static uint8_t buf[1 << 16];
  const int runs = 20000;
  for (int r = 0; r < runs; r++) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    size_t size = (size_t)(state >> 33) % sizeof buf;
    for (size_t i = 0; i < size; i++) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      buf[i] = (uint8_t)(state >> 56);
    }
    /* Small element counts and blocks make size agreement, and so the
     * decoding path, common. */
    if (size >= 6 && r % 2 == 0) {
      buf[1] = (uint8_t)(buf[1] % 64);
      buf[2] = 0;
      buf[4] = 0;
      buf[5] = 0;
    }
    LLVMFuzzerTestOneInput(buf, size);
  }
  printf("%d passed, 0 failed: random inputs\n", runs);
  return 0;
}
