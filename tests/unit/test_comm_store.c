/* The in-process rendezvous store (store.h, store_mem): waits for keys
 * set by another thread and their timeouts, replacing and deleting keys,
 * oversized keys, and a stopped store ending the waits for missing keys. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "test_clock.h"

#include "comm.h"
#include "comm_fixtures.h"
#include "store.h"

/* ---- store_mem ------------------------------------------------------------- */

typedef struct delayed_set {
  store *st;
  int delay_ms;
} delayed_set;

static void *set_after_delay(void *arg) {
  delayed_set *ds = arg;
  sleep_ms(ds->delay_ms);
  ds->st->ops->set(ds->st, "late/key", "hello", 5);
  return NULL;
}

static void test_store_get_waits_for_a_key_set_by_another_thread(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  delayed_set ds = {st, 50};
  pthread_t writer;
  assert_int_equal(pthread_create(&writer, NULL, set_after_delay, &ds), 0);
  void *value = NULL;
  size_t value_bytes = 0;
  double started_ms = now_ms();
  assert_int_equal(st->ops->get(st, "late/key", &value, &value_bytes, 5000), 0);
  double waited_ms = now_ms() - started_ms;
  pthread_join(writer, NULL);
  assert_int_equal(value_bytes, 5);
  assert_memory_equal(value, "hello", 5);
  if (waited_ms < 30 || waited_ms > 4000)
    fail_msg("get should have returned when the key was set (~50 ms), took %.0f ms", waited_ms);
  free(value);
  st->ops->destroy(st);
}

static void test_store_get_times_out_on_a_missing_key(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  void *value = NULL;
  size_t value_bytes = 0;
  double started_ms = now_ms();
  assert_int_equal(st->ops->get(st, "missing", &value, &value_bytes, 100), -ETIMEDOUT);
  double waited_ms = now_ms() - started_ms;
  if (waited_ms < 95 || waited_ms > 2000)
    fail_msg("get should time out after 100 ms, took %.0f ms", waited_ms);
  /* A zero timeout only looks. */
  started_ms = now_ms();
  assert_int_equal(st->ops->get(st, "missing", &value, &value_bytes, 0), -ETIMEDOUT);
  assert_true(now_ms() - started_ms < 50);
  assert_null(value);
  st->ops->destroy(st);
}

static void test_store_set_replaces_and_keeps_many_keys(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  char key[64];
  /* Enough keys to grow the table several times. */
  for (int i = 0; i < 2000; i++) {
    snprintf(key, sizeof key, "k/%d", i);
    assert_int_equal(st->ops->set(st, key, &i, sizeof i), 0);
  }
  int replaced = -7;
  assert_int_equal(st->ops->set(st, "k/5", &replaced, sizeof replaced), 0);
  assert_int_equal(st->ops->set(st, "empty", NULL, 0), 0);
  for (int i = 0; i < 2000; i++) {
    snprintf(key, sizeof key, "k/%d", i);
    void *value = NULL;
    size_t value_bytes = 0;
    assert_int_equal(st->ops->get(st, key, &value, &value_bytes, 0), 0);
    assert_int_equal(value_bytes, sizeof(int));
    int got;
    memcpy(&got, value, sizeof got);
    assert_int_equal(got, i == 5 ? replaced : i);
    free(value);
  }
  void *value = NULL;
  size_t value_bytes = 99;
  assert_int_equal(st->ops->get(st, "empty", &value, &value_bytes, 0), 0);
  assert_int_equal(value_bytes, 0);
  assert_non_null(value);
  free(value);
  st->ops->destroy(st);
}

static void test_store_delete_prefix_removes_only_matching_keys(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  const char *keys[] = {"job/7/a", "job/7/b", "job/70/a", "job/8/a"};
  for (size_t i = 0; i < 4; i++)
    assert_int_equal(st->ops->set(st, keys[i], "x", 1), 0);
  assert_int_equal(st->ops->delete_prefix(st, "job/7/"), 0);
  const int present[] = {0, 0, 1, 1};
  for (size_t i = 0; i < 4; i++) {
    void *value = NULL;
    size_t value_bytes = 0;
    int rc = st->ops->get(st, keys[i], &value, &value_bytes, 0);
    if (present[i] ? rc != 0 : rc != -ETIMEDOUT)
      fail_msg("after delete_prefix(\"job/7/\"), get(\"%s\") returned %d", keys[i], rc);
    free(value);
  }
  st->ops->destroy(st);
}

static void test_store_rejects_oversized_keys(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  char *long_key = xmalloc(4096);
  memset(long_key, 'k', 4095);
  long_key[4095] = '\0';
  assert_int_equal(st->ops->set(st, long_key, "x", 1), -ENAMETOOLONG);
  free(long_key);
  st->ops->destroy(st);
}

/* A stopping daemon's rendezvous must not wait for peers that stop too:
 * a wait for a missing key gives up when the store stops, and later ones
 * at once; keys that are there are still read. */
static void test_store_stop_ends_waits_for_missing_keys(void **state) {
  store *st = NULL;
  assert_int_equal(store_mem_create(&st), 0);
  assert_int_equal(st->ops->set(st, "there", "x", 1), 0);
  stopping_store ss = {st, 50};
  pthread_t stopper;
  assert_int_equal(pthread_create(&stopper, NULL, stop_after_delay, &ss), 0);
  void *value = NULL;
  size_t value_bytes = 0;
  double started_ms = now_ms();
  assert_int_equal(st->ops->get(st, "missing", &value, &value_bytes, 20000), -ECANCELED);
  double waited_ms = now_ms() - started_ms;
  pthread_join(stopper, NULL);
  if (waited_ms > 2000)
    fail_msg("get should give up when the store stops (~50 ms), took %.0f ms", waited_ms);
  started_ms = now_ms();
  assert_int_equal(st->ops->get(st, "missing", &value, &value_bytes, 20000), -ECANCELED);
  assert_true(now_ms() - started_ms < 50);
  assert_int_equal(st->ops->get(st, "there", &value, &value_bytes, 20000), 0);
  assert_int_equal(value_bytes, 1);
  free(value);
  st->ops->destroy(st);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_store_get_waits_for_a_key_set_by_another_thread),
      cmocka_unit_test(test_store_get_times_out_on_a_missing_key),
      cmocka_unit_test(test_store_set_replaces_and_keeps_many_keys),
      cmocka_unit_test(test_store_delete_prefix_removes_only_matching_keys),
      cmocka_unit_test(test_store_rejects_oversized_keys),
      cmocka_unit_test(test_store_stop_ends_waits_for_missing_keys),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
