/* hostmem (daemon/base/hostmem.c), the buffers of a save's copy and a
 * restore's staging: zeroed memory not yet faulted in, populating that
 * keeps what the memory holds, populate-ahead beside a writer and over
 * ranges (whole pages only), 64-byte aligned arrays whose big ones are
 * mappings given back when freed, and shared buffers that live until the
 * last reference. */
#include <sys/mman.h>
#include <unistd.h>

#include "testutil.h"

#include "hostmem.h"

/* Pages of [p, p + bytes) in memory now (mincore). */
static size_t resident_pages(void *p, size_t bytes) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE), n = (bytes + page - 1) / page, in = 0;
  unsigned char *vec = malloc(n);
  assert_non_null(vec);
  assert_int_equal(mincore(p, bytes, vec), 0);
  for (size_t i = 0; i < n; i++)
    in += vec[i] & 1;
  free(vec);
  return in;
}

static void test_hostmem_gives_zeroed_memory_not_yet_faulted_in(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = 64 * page + 123;
  uint8_t *p = hostmem_alloc(bytes);
  assert_non_null(p);
  assert_int_equal(resident_pages(p, bytes), 0);
  for (size_t i = 0; i < bytes; i++)
    assert_int_equal(p[i], 0);
  memset(p, 0xa5, bytes); /* every byte asked for is there */
  assert_int_equal(resident_pages(p, bytes), 65);
  hostmem_free(p, bytes);
  hostmem_free(NULL, bytes);
  uint8_t *none = hostmem_alloc(0); /* a page, freed with the same size */
  assert_non_null(none);
  hostmem_free(none, 0);
}

static void test_hostmem_populate_keeps_what_the_memory_holds(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = 256 * page;
  uint8_t *p = hostmem_alloc(bytes);
  assert_non_null(p);
  for (size_t i = 0; i < bytes / 2; i++) /* half written, half never touched */
    p[i] = (uint8_t)(i * 31 + 7);
  int rc = hostmem_populate(p, bytes);
  if (rc == -EINVAL) {
    hostmem_free(p, bytes);
    skip(); /* before Linux 5.14: nothing is populated, pages fault as written */
  }
  assert_int_equal(rc, 0);
  assert_int_equal(resident_pages(p, bytes), 256);
  for (size_t i = 0; i < bytes; i++)
    assert_int_equal(p[i], i < bytes / 2 ? (uint8_t)(i * 31 + 7) : 0);
  hostmem_free(p, bytes);
}

static void test_hostmem_populate_ahead_faults_in_beside_a_writer(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = 24u << 20, npages = bytes / page;
  uint8_t *probe = hostmem_alloc(page);
  assert_non_null(probe);
  int supported = hostmem_populate(probe, page) == 0;
  hostmem_free(probe, page);
  if (!supported)
    skip();
  /* Alone, it faults in the whole buffer. */
  uint8_t *p = hostmem_alloc(bytes);
  assert_non_null(p);
  hostmem_ahead *a = hostmem_populate_ahead(p, bytes);
  assert_non_null(a);
  for (int i = 0; i < 1000 && resident_pages(p, bytes) < npages; i++)
    usleep(10000);
  assert_int_equal(resident_pages(p, bytes), npages);
  hostmem_populate_stop(a);
  hostmem_free(p, bytes);
  /* With a writer going through the same pages meanwhile, every byte
   * written stays written, and stop returns with the thread gone. */
  p = hostmem_alloc(bytes);
  assert_non_null(p);
  a = hostmem_populate_ahead(p, bytes);
  assert_non_null(a);
  for (size_t at = 0; at < bytes; at += 4096)
    for (size_t i = at; i < at + 4096; i++)
      p[i] = (uint8_t)(i * 13 + 1);
  hostmem_populate_stop(a);
  for (size_t i = 0; i < bytes; i++)
    if (p[i] != (uint8_t)(i * 13 + 1))
      fail_msg("byte %zu is %u", i, p[i]);
  hostmem_free(p, bytes);
  /* Stopped at once, before it is through. */
  p = hostmem_alloc(bytes);
  assert_non_null(p);
  hostmem_populate_stop(hostmem_populate_ahead(p, bytes));
  hostmem_populate_stop(NULL);
  hostmem_free(p, bytes);
}

static void test_hostmem_populate_ahead_ranges_faults_in_whole_pages_only(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  uint8_t *a = hostmem_alloc(6 * page), *b = hostmem_alloc(3 * page);
  assert_non_null(a);
  assert_non_null(b);
  if (hostmem_populate(a, page) != 0) {
    hostmem_free(a, 6 * page);
    hostmem_free(b, 3 * page);
    skip();
  }
  memset(b, 0x3c, 3 * page);
  /* In the order given: a's pages 2 and 3 by an unaligned range (pages 1
   * and 4 only partly in it), all of b (already resident: its
   * bytes stay), and a range inside one page, which is left alone. */
  const hostmem_range ranges[] = {
      {a + page + 100, 4 * page - 200}, {b, 3 * page}, {a + 5 * page + 8, page - 16}};
  hostmem_ahead *h = hostmem_populate_ahead_ranges(ranges, 3);
  assert_non_null(h);
  for (int i = 0; i < 1000 && resident_pages(a + 2 * page, 2 * page) < 2; i++)
    usleep(10000);
  hostmem_populate_stop(h);
  unsigned char vec[6];
  assert_int_equal(mincore(a, 6 * page, vec), 0);
  const unsigned char want[6] = {1, 0, 1, 1, 0, 0}; /* page 0: the probe above */
  for (int i = 0; i < 6; i++)
    if ((vec[i] & 1) != want[i])
      fail_msg("page %d of the first buffer: resident %d, expected %d", i, vec[i] & 1, want[i]);
  for (size_t i = 0; i < 3 * page; i++)
    assert_int_equal(b[i], 0x3c);
  /* Nothing with a whole page: no thread. */
  assert_null(hostmem_populate_ahead_ranges(&ranges[2], 1));
  assert_null(hostmem_populate_ahead_ranges(NULL, 0));
  hostmem_free(a, 6 * page);
  hostmem_free(b, 3 * page);
}

static void test_hostmem_arrays_are_aligned_and_big_ones_are_given_back(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t sizes[] = {0, 1, 63, 4096 + 8, (1u << 20) - 64, 1u << 20, (3u << 20) + 4};
  for (unsigned i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    size_t bytes = sizes[i];
    uint8_t *p = hostmem_array_alloc(bytes);
    assert_non_null(p);
    assert_int_equal((uintptr_t)p % 64, 0);
    int mapped = hostmem_array_mapped(p);
    assert_int_equal(mapped, bytes >= (1u << 20));
    size_t padded = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
    if (mapped) { /* fresh from the kernel: zero, and page-aligned */
      assert_int_equal((uintptr_t)p % page, 0);
      for (size_t b = 0; b < padded; b++)
        assert_int_equal(p[b], 0);
    }
    for (size_t b = 0; b < padded; b++) /* all of it, padding included, is ours */
      p[b] = (uint8_t)(b * 7 + i);
    for (size_t b = 0; b < padded; b++)
      assert_int_equal(p[b], (uint8_t)(b * 7 + i));
    hostmem_array_free(p);
    if (mapped) { /* unmapped at once, not kept by an allocator */
      unsigned char vec[1];
      errno = 0;
      assert_int_equal(mincore(p, page, vec), -1);
      assert_int_equal(errno, ENOMEM);
    }
  }
  hostmem_array_free(NULL);
}

static void test_hostmem_shared_buffer_lives_until_the_last_reference(void **state) {
  (void)state;
  size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = 3 * page + 5;
  uint8_t *p = hostmem_shared_alloc(bytes);
  assert_non_null(p);
  for (size_t i = 0; i < bytes; i++)
    assert_int_equal(p[i], 0);
  memset(p, 0x5a, bytes);
  hostmem_shared_ref(p);   /* a second holder (the writer faulting it in) */
  hostmem_shared_unref(p); /* the first lets go: still there */
  unsigned char vec[4];
  assert_int_equal(mincore(p, bytes, vec), 0);
  for (size_t i = 0; i < bytes; i++)
    assert_int_equal(p[i], 0x5a);
  hostmem_shared_unref(p); /* the last: unmapped */
  errno = 0;
  assert_int_equal(mincore(p, bytes, vec), -1);
  assert_int_equal(errno, ENOMEM);
  hostmem_shared_unref(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hostmem_gives_zeroed_memory_not_yet_faulted_in),
      cmocka_unit_test(test_hostmem_populate_keeps_what_the_memory_holds),
      cmocka_unit_test(test_hostmem_populate_ahead_faults_in_beside_a_writer),
      cmocka_unit_test(test_hostmem_populate_ahead_ranges_faults_in_whole_pages_only),
      cmocka_unit_test(test_hostmem_arrays_are_aligned_and_big_ones_are_given_back),
      cmocka_unit_test(test_hostmem_shared_buffer_lives_until_the_last_reference),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
