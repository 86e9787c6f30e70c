/* The model library's unit layouts (daemon/model/layout.c): tensor
 * offsets and shard sizes, frozen flags, refusals, the descriptor diff and
 * the tensor description used in mismatch errors. The job configs are
 * test_model.c's. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include "layout.h"

/* ------------------------------------------------------------------------
 * unit_layout_build
 * ------------------------------------------------------------------------ */

/* Up to 4 tensors with up to 3 dimensions each. */
typedef struct layout_spec {
  const char *names[4];
  uint64_t shapes[4][3];
  unsigned ndims[4];
  int frozen[4];
} layout_spec;

static int build(const char *name, const layout_spec *s, unsigned n, int world, uint64_t tag,
                 unit_layout **out, char *err, size_t err_bytes) {
  const uint64_t *shapes[4];
  for (unsigned t = 0; t < 4; t++)
    shapes[t] = s->shapes[t];
  return unit_layout_build(name, n, s->names, shapes, s->ndims, s->frozen, world, tag, out, err,
                           err_bytes);
}

static unit_layout *build_ok(const char *name, const layout_spec *s, unsigned n, int world,
                             uint64_t tag) {
  unit_layout *l = NULL;
  char err[256] = "";
  int rc = build(name, s, n, world, tag, &l, err, sizeof err);
  if (rc != 0)
    fail_msg("unit_layout_build refused: %s", err);
  return l;
}

static void expect_build_refused(const layout_spec *s, unsigned n, const char *want) {
  unit_layout *l = NULL;
  char err[256] = "";
  assert_int_equal(build("u", s, n, 2, 0, &l, err, sizeof err), -EINVAL);
  assert_null(l);
  assert_string_equal(err, want);
}

/* 3, 17 and 16 elements: 0, then the next multiples of 16. */
static const layout_spec three = {
    .names = {"a", "b", "c"},
    .shapes = {{3}, {17}, {4, 4}},
    .ndims = {1, 1, 2},
    .frozen = {0, 7, 0},
};

static void test_layout_aligns_tensor_offsets(void **state) {
  (void)state;
  unit_layout *l = build_ok("u", &three, 3, 1, 0);
  assert_string_equal(l->name, "u");
  assert_int_equal(l->ntensors, 3);
  assert_int_equal(l->tensors[0].offset, 0);
  assert_int_equal(l->tensors[1].offset, 16);
  assert_int_equal(l->tensors[2].offset, 48);
  for (unsigned t = 0; t < 3; t++)
    assert_int_equal(l->tensors[t].offset % JOB_ALIGN_NUMEL, 0);
  assert_int_equal(l->tensors[0].numel, 3);
  assert_int_equal(l->tensors[1].numel, 17);
  assert_int_equal(l->tensors[2].numel, 16);
  assert_int_equal(l->tensors[2].ndim, 2);
  assert_int_equal(l->tensors[2].shape[0], 4);
  assert_int_equal(l->tensors[2].shape[1], 4);
  assert_int_equal(l->numel, 64);
  assert_int_equal(l->packed_numel, 36);
  unit_layout_free(l);
}

static void test_layout_pads_to_a_multiple_of_the_world(void **state) {
  (void)state;
  for (int world = 1; world <= 7; world++) {
    unit_layout *l = build_ok("u", &three, 3, world, 0);
    uint64_t step = (uint64_t)world * JOB_ALIGN_NUMEL;
    assert_int_equal(l->padded_numel % step, 0);
    assert_true(l->padded_numel >= l->numel);
    assert_true(l->padded_numel < l->numel + step);
    assert_int_equal(l->shard_numel * (uint64_t)world, l->padded_numel);
    assert_int_equal(l->shard_numel % JOB_ALIGN_NUMEL, 0);
    unit_layout_free(l);
  }
  /* 64 elements: 1 rank x 64, 3 ranks x 32 (96), 5 ranks x 16 (80). */
  unit_layout *l = build_ok("u", &three, 3, 3, 0);
  assert_int_equal(l->padded_numel, 96);
  assert_int_equal(l->shard_numel, 32);
  unit_layout_free(l);
  l = build_ok("u", &three, 3, 5, 0);
  assert_int_equal(l->padded_numel, 80);
  assert_int_equal(l->shard_numel, 16);
  unit_layout_free(l);
}

static void test_layout_keeps_frozen_flags(void **state) {
  (void)state;
  unit_layout *l = build_ok("u", &three, 3, 2, 0);
  assert_int_equal(l->tensors[0].frozen, 0);
  assert_int_equal(l->tensors[1].frozen, 1); /* any non-zero flag is 1 */
  assert_int_equal(l->tensors[2].frozen, 0);
  unit_layout_free(l);
}

static void test_layout_scalar_has_one_element(void **state) {
  (void)state;
  layout_spec s = {.names = {"s"}, .ndims = {0}};
  unit_layout *l = build_ok("u", &s, 1, 4, 0);
  assert_int_equal(l->tensors[0].numel, 1);
  assert_int_equal(l->numel, 1);
  assert_int_equal(l->padded_numel, 4 * JOB_ALIGN_NUMEL);
  assert_int_equal(l->shard_numel, JOB_ALIGN_NUMEL);
  unit_layout_free(l);
}

static void test_layout_rejects_a_repeated_tensor_name(void **state) {
  (void)state;
  layout_spec s = {.names = {"w", "b", "w"}, .shapes = {{2}, {2}, {2}}, .ndims = {1, 1, 1}};
  expect_build_refused(&s, 3, "unit 'u': tensor name 'w' appears twice");
}

static void test_layout_rejects_a_zero_dimension(void **state) {
  (void)state;
  layout_spec s = {.names = {"w", "b"}, .shapes = {{2}, {3, 0}}, .ndims = {1, 2}};
  expect_build_refused(&s, 2, "unit 'u' tensor 'b': dimension 1 is 0 (must be 1..2^48)");
}

static void test_layout_rejects_a_tensor_over_2_48_elements(void **state) {
  (void)state;
  layout_spec s = {.names = {"w"}, .shapes = {{1u << 24, 1u << 24, 2}}, .ndims = {3}};
  expect_build_refused(&s, 1, "unit 'u' tensor 'w': dimension 2 is 2 (must be 1..2^48)");
  /* One dimension of 2^48 + 1 on its own. */
  layout_spec one = {.names = {"w"}, .shapes = {{((uint64_t)1 << 48) + 1}}, .ndims = {1}};
  expect_build_refused(&one, 1,
                       "unit 'u' tensor 'w': dimension 0 is 281474976710657 (must be 1..2^48)");
}

static void test_layout_accepts_exactly_2_48_elements(void **state) {
  (void)state;
  layout_spec s = {.names = {"w"}, .shapes = {{(uint64_t)1 << 48}}, .ndims = {1}};
  unit_layout *l = build_ok("u", &s, 1, 64, 0);
  assert_int_equal(l->numel, (uint64_t)1 << 48);
  assert_int_equal(l->padded_numel, (uint64_t)1 << 48);
  unit_layout_free(l);
}

static void test_layout_rejects_a_unit_over_2_48_elements(void **state) {
  (void)state;
  /* Each tensor fits; together (with the alignment) they do not. */
  uint64_t half = ((uint64_t)1 << 47) + 1;
  layout_spec s = {.names = {"a", "b"}, .shapes = {{half}, {half}}, .ndims = {1, 1}};
  expect_build_refused(&s, 2, "unit 'u' has more than 2^48 elements");
}

/* ------------------------------------------------------------------------
 * unit_layout_diff
 * ------------------------------------------------------------------------ */

static int32_t diff(const unit_layout *a, const unit_layout *b) {
  return unit_layout_diff(a->descriptor, a->descriptor_bytes, b->descriptor, b->descriptor_bytes);
}

static void test_diff_of_equal_descriptors_is_minus_one(void **state) {
  (void)state;
  unit_layout *a = build_ok("u", &three, 3, 2, 5);
  unit_layout *b = build_ok("u", &three, 3, 2, 5);
  assert_int_equal(diff(a, b), -1);
  assert_int_equal(diff(a, a), -1);
  assert_int_equal(unit_layout_diff(NULL, 0, NULL, 0), -1);
  unit_layout_free(a);
  unit_layout_free(b);
}

static void test_descriptor_does_not_depend_on_the_world(void **state) {
  (void)state;
  unit_layout *a = build_ok("u", &three, 3, 1, 0);
  unit_layout *b = build_ok("u", &three, 3, 8, 0);
  assert_int_equal(diff(a, b), -1);
  unit_layout_free(a);
  unit_layout_free(b);
}

static void test_diff_finds_the_unit_chunk(void **state) {
  (void)state;
  unit_layout *a = build_ok("u", &three, 3, 2, 0);
  unit_layout *name = build_ok("v", &three, 3, 2, 0);
  unit_layout *tag = build_ok("u", &three, 3, 2, 1);
  unit_layout *fewer = build_ok("u", &three, 2, 2, 0);
  assert_int_equal(diff(a, name), 0);
  assert_int_equal(diff(a, tag), 0);
  assert_int_equal(diff(a, fewer), 0); /* the tensor count is the unit's */
  unit_layout_free(a);
  unit_layout_free(name);
  unit_layout_free(tag);
  unit_layout_free(fewer);
}

static void test_diff_finds_the_first_differing_tensor(void **state) {
  (void)state;
  unit_layout *a = build_ok("u", &three, 3, 2, 0);
  layout_spec s = three;
  s.shapes[1][0] = 18; /* tensor 1's shape */
  unit_layout *shape = build_ok("u", &s, 3, 2, 0);
  assert_int_equal(diff(a, shape), 2);
  s = three;
  s.frozen[2] = 1; /* tensor 2's flag */
  unit_layout *frozen = build_ok("u", &s, 3, 2, 0);
  assert_int_equal(diff(a, frozen), 3);
  assert_int_equal(diff(frozen, a), 3);
  s = three;
  s.names[0] = "z"; /* tensor 0's name, and tensor 2's flag after it */
  s.frozen[2] = 1;
  unit_layout *renamed = build_ok("u", &s, 3, 2, 0);
  assert_int_equal(diff(a, renamed), 1);
  unit_layout_free(a);
  unit_layout_free(shape);
  unit_layout_free(frozen);
  unit_layout_free(renamed);
}

static void test_diff_of_a_truncated_descriptor(void **state) {
  (void)state;
  unit_layout *a = build_ok("u", &three, 3, 2, 0);
  /* The first two chunks (unit, tensor 0) of a, then nothing: chunk 2 is
   * missing on one side. */
  size_t cut = 0;
  for (int chunk = 0; chunk < 2; chunk++) {
    uint32_t len = 0;
    for (int i = 0; i < 4; i++)
      len |= (uint32_t)a->descriptor[cut + (size_t)i] << (8 * i);
    cut += 4 + len;
  }
  assert_int_equal(unit_layout_diff(a->descriptor, a->descriptor_bytes, a->descriptor, cut), 2);
  assert_int_equal(unit_layout_diff(a->descriptor, cut, a->descriptor, a->descriptor_bytes), 2);
  /* A chunk cut inside its bytes differs where it is cut. */
  assert_int_equal(unit_layout_diff(a->descriptor, a->descriptor_bytes, a->descriptor, cut + 5), 2);
  assert_int_equal(unit_layout_diff(a->descriptor, a->descriptor_bytes, a->descriptor, 0), 0);
  unit_layout_free(a);
}

/* ------------------------------------------------------------------------
 * unit_layout_describe_tensor
 * ------------------------------------------------------------------------ */

static void test_describe_tensor(void **state) {
  (void)state;
  layout_spec s = {.names = {"w", "b", "s"},
                   .shapes = {{3, 4, 5}, {5}},
                   .ndims = {3, 1, 0},
                   .frozen = {0, 1, 0}};
  unit_layout *l = build_ok("u", &s, 3, 2, 0);
  char out[128];
  unit_layout_describe_tensor(l, 0, out, sizeof out);
  assert_string_equal(out, "'w' shape [3,4,5]");
  unit_layout_describe_tensor(l, 1, out, sizeof out);
  assert_string_equal(out, "'b' shape [5] frozen");
  unit_layout_describe_tensor(l, 2, out, sizeof out);
  assert_string_equal(out, "'s' shape []");
  unit_layout_free(l);
}

static void test_describe_tensor_out_of_range_is_none(void **state) {
  (void)state;
  unit_layout *l = build_ok("u", &three, 3, 2, 0);
  char out[64];
  unit_layout_describe_tensor(l, 3, out, sizeof out);
  assert_string_equal(out, "(none)");
  unit_layout_describe_tensor(l, -1, out, sizeof out);
  assert_string_equal(out, "(none)");
  unit_layout_describe_tensor(NULL, 0, out, sizeof out);
  assert_string_equal(out, "(none)");
  unit_layout_free(l);
}

static void test_describe_tensor_is_cut_to_the_buffer(void **state) {
  (void)state;
  layout_spec s = {.names = {"weight"}, .shapes = {{1000, 1000, 1000}}, .ndims = {3}};
  unit_layout *l = build_ok("u", &s, 1, 2, 0);
  char out[32];
  memset(out, 'x', sizeof out);
  unit_layout_describe_tensor(l, 0, out, 8);
  assert_string_equal(out, "'weight");
  assert_int_equal(out[8], 'x'); /* nothing written past out_bytes */
  unit_layout_describe_tensor(l, 0, out, 22);
  assert_string_equal(out, "'weight' shape [1000,");
  unit_layout_free(l);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layout_aligns_tensor_offsets),
      cmocka_unit_test(test_layout_pads_to_a_multiple_of_the_world),
      cmocka_unit_test(test_layout_keeps_frozen_flags),
      cmocka_unit_test(test_layout_scalar_has_one_element),
      cmocka_unit_test(test_layout_rejects_a_repeated_tensor_name),
      cmocka_unit_test(test_layout_rejects_a_zero_dimension),
      cmocka_unit_test(test_layout_rejects_a_tensor_over_2_48_elements),
      cmocka_unit_test(test_layout_accepts_exactly_2_48_elements),
      cmocka_unit_test(test_layout_rejects_a_unit_over_2_48_elements),
      cmocka_unit_test(test_diff_of_equal_descriptors_is_minus_one),
      cmocka_unit_test(test_descriptor_does_not_depend_on_the_world),
      cmocka_unit_test(test_diff_finds_the_unit_chunk),
      cmocka_unit_test(test_diff_finds_the_first_differing_tensor),
      cmocka_unit_test(test_diff_of_a_truncated_descriptor),
      cmocka_unit_test(test_describe_tensor),
      cmocka_unit_test(test_describe_tensor_out_of_range_is_none),
      cmocka_unit_test(test_describe_tensor_is_cut_to_the_buffer),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
