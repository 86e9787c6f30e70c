/* test_agree.c - the comparison of settings across ranks (daemon/rank/agree.c):
 * each rank's fields summed as an all-reduce would, and the verdict every
 * rank reaches from the same sums. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "agree.h"

#define MAX_RANKS  4
#define MAX_FIELDS 12

/* One rank's settings: values of the fields "f0", "f1", ... */
typedef struct rank_settings {
  double values[MAX_FIELDS];
  int refused;
} rank_settings;

static void fill(agree_set *a, agree_field *storage, unsigned nfields, const rank_settings *r) {
  agree_init(a, storage, MAX_FIELDS);
  a->refused = r->refused;
  for (unsigned f = 0; f < nfields; f++)
    agree_add_f64(a, r->values[f], "f%u", f);
}

/* The ranks' contributions summed (the all-reduce), then rank 0's verdict
 * and every other rank's, which must be the same. */
static agree_verdict verdict(const rank_settings *ranks, unsigned nranks, unsigned nfields,
                             char *why, size_t why_bytes) {
  agree_field storage[MAX_RANKS][MAX_FIELDS];
  agree_set sets[MAX_RANKS];
  size_t n = 0;
  double sums[1 + MAX_FIELDS * AGREE_VALUES_PER_FIELD] = {0};
  for (unsigned r = 0; r < nranks; r++) {
    fill(&sets[r], storage[r], nfields, &ranks[r]);
    n = agree_values(&sets[r]);
    assert_int_equal(n, 1 + nfields * AGREE_VALUES_PER_FIELD);
    double mine[1 + MAX_FIELDS * AGREE_VALUES_PER_FIELD];
    agree_put(&sets[r], mine);
    for (size_t i = 0; i < n; i++)
      sums[i] += mine[i];
  }
  agree_verdict first = agree_check(&sets[0], sums, nranks, why, why_bytes);
  for (unsigned r = 1; r < nranks; r++) {
    char other[256];
    assert_int_equal(agree_check(&sets[r], sums, nranks, other, sizeof other), first);
    assert_string_equal(other, why);
  }
  return first;
}

static void test_the_same_settings_agree(void **state) {
  (void)state;
  rank_settings ranks[3] = {{{1e-2, 0.9, 0.0}, 0}, {{1e-2, 0.9, 0.0}, 0}, {{1e-2, 0.9, 0.0}, 0}};
  char why[256];
  assert_int_equal(verdict(ranks, 3, 3, why, sizeof why), AGREE_SAME);
  assert_string_equal(why, "");
  /* One rank alone always agrees with itself. */
  assert_int_equal(verdict(ranks, 1, 3, why, sizeof why), AGREE_SAME);
}

static void test_a_difference_is_named_on_every_rank(void **state) {
  (void)state;
  /* The case: rank 0 lr 1e-2, rank 1 lr 2e-2. */
  rank_settings ranks[2] = {{{1e-2, 0.9}, 0}, {{2e-2, 0.9}, 0}};
  char why[256];
  assert_int_equal(verdict(ranks, 2, 2, why, sizeof why), AGREE_DIFFERENT);
  assert_string_equal(why, "f0");
  /* 0.0 and -0.0 are different bits, and so different settings. */
  rank_settings zeros[2] = {{{0.0}, 0}, {{-0.0}, 0}};
  assert_int_equal(verdict(zeros, 2, 1, why, sizeof why), AGREE_DIFFERENT);
}

/* Three ranks whose digests' mean is one of them (a sum alone would let
 * the middle rank think all agree): the squares catch it on every rank. */
static void test_a_symmetric_difference_is_caught(void **state) {
  (void)state;
  agree_field storage[3][1];
  agree_set sets[3];
  for (int r = 0; r < 3; r++) {
    agree_init(&sets[r], storage[r], 1);
    agree_add_digest(&sets[r], (uint64_t)(r + 1) * 0x0001000100010001ull, "f");
  }
  double sums[1 + AGREE_VALUES_PER_FIELD] = {0}, mine[1 + AGREE_VALUES_PER_FIELD];
  for (int r = 0; r < 3; r++) {
    agree_put(&sets[r], mine);
    for (int i = 0; i < 1 + AGREE_VALUES_PER_FIELD; i++)
      sums[i] += mine[i];
  }
  char why[64];
  for (int r = 0; r < 3; r++)
    assert_int_equal(agree_check(&sets[r], sums, 3, why, sizeof why), AGREE_DIFFERENT);
}

static void test_a_refusal_wins_and_is_counted(void **state) {
  (void)state;
  rank_settings ranks[3] = {{{1.0}, 0}, {{5.0}, 1}, {{1.0}, 0}};
  char why[256];
  assert_int_equal(verdict(ranks, 3, 1, why, sizeof why), AGREE_REFUSED);
  assert_string_equal(why, "1 of 3 ranks");
}

static void test_many_differences_are_listed_then_counted(void **state) {
  (void)state;
  rank_settings ranks[2] = {{{0}, 0}, {{0}, 0}};
  for (int f = 0; f < MAX_FIELDS; f++)
    ranks[1].values[f] = 1.0;
  char why[256];
  assert_int_equal(verdict(ranks, 2, MAX_FIELDS, why, sizeof why), AGREE_DIFFERENT);
  assert_string_equal(why, "f0, f1, f2, f3, f4, f5, f6, f7 and 4 more");
}

/* Fields past the storage fold into the last one, which still differs. */
static void test_fields_past_capacity_still_count(void **state) {
  (void)state;
  agree_field storage[2][2];
  agree_set sets[2];
  for (int r = 0; r < 2; r++) {
    agree_init(&sets[r], storage[r], 2);
    agree_add_f64(&sets[r], 1.0, "a");
    agree_add_f64(&sets[r], 2.0, "b");
    agree_add_f64(&sets[r], r == 0 ? 3.0 : 4.0, "c");
  }
  assert_int_equal(agree_values(&sets[0]), 1 + 2 * AGREE_VALUES_PER_FIELD);
  double sums[1 + 2 * AGREE_VALUES_PER_FIELD] = {0}, mine[1 + 2 * AGREE_VALUES_PER_FIELD];
  for (int r = 0; r < 2; r++) {
    agree_put(&sets[r], mine);
    for (int i = 0; i < 1 + 2 * AGREE_VALUES_PER_FIELD; i++)
      sums[i] += mine[i];
  }
  char why[64];
  assert_int_equal(agree_check(&sets[0], sums, 2, why, sizeof why), AGREE_DIFFERENT);
  assert_string_equal(why, "b");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_the_same_settings_agree),
      cmocka_unit_test(test_a_difference_is_named_on_every_rank),
      cmocka_unit_test(test_a_symmetric_difference_is_caught),
      cmocka_unit_test(test_a_refusal_wins_and_is_counted),
      cmocka_unit_test(test_many_differences_are_listed_then_counted),
      cmocka_unit_test(test_fields_past_capacity_still_count),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
