/* libzerod's shared memory with a fake daemon (client/client.c; the fake
 * is client_fixtures.c's): rank 0's initial values go out in a memfd, a
 * gathered view points at the unit's placements in shared memory, replies
 * are matched to gathers by request id, gradient buffers are shared and
 * writable, buffers the daemon drops are unmapped unless a view still
 * uses them, and with stable addresses a unit keeps one address whatever
 * buffer holds it.
 *
 * Mappings are checked in /proc/self (maps and fd): every memfd the fake
 * makes has its own name, and the fake keeps one mapping and one
 * descriptor of each, so whatever else shows up belongs to libzerod. */
#include <dirent.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "frame.h"
#include "zerod.h"

#include "client_fixtures.h"

/* ------------------------------------------------------------------------
 * Helpers for the worker side
 * ------------------------------------------------------------------------ */

/* How many mappings of this process map the fake's memfd `name`: the
 * fake's own, plus libzerod's. */
static int count_mappings(const char *needle) {
  FILE *maps = fopen("/proc/self/maps", "r");
  assert_non_null(maps);
  char line[512];
  int count = 0;
  while (fgets(line, sizeof line, maps) != NULL)
    count += strstr(line, needle) != NULL;
  fclose(maps);
  return count;
}

/* /proc/self/maps is read a page at a time, and a mapping that the fake
 * daemon's thread adds or removes meanwhile can make a line appear twice or
 * not at all: count until two reads agree. */
static int mappings_of(const fake_daemon *fake, const char *name) {
  const char *needle = memfd_name(fake, name);
  int count = count_mappings(needle);
  for (int tries = 0; tries < 10; tries++) {
    int again = count_mappings(needle);
    if (again == count)
      break;
    count = again;
  }
  return count;
}

/* How many open descriptors of this process name the fake's memfd `name`:
 * the fake's own, plus those libzerod keeps. */
static int descriptors_of(const fake_daemon *fake, const char *name) {
  const char *needle = memfd_name(fake, name);
  DIR *dir = opendir("/proc/self/fd");
  assert_non_null(dir);
  int count = 0;
  struct dirent *entry;
  while ((entry = readdir(dir)) != NULL) {
    char path[300], target[256];
    snprintf(path, sizeof path, "/proc/self/fd/%s", entry->d_name);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n <= 0)
      continue;
    target[n] = '\0';
    count += strstr(target, needle) != NULL;
  }
  closedir(dir);
  return count;
}

/* ------------------------------------------------------------------------
 * Tests
 * ------------------------------------------------------------------------ */

static void test_rank0_sends_init_values_in_a_memfd(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  register_unit(job, "layer0");
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->init_fd_count, 1);
  assert_true(fake->init_values_match);
  fake_destroy(fake);
}

static void test_gather_view_points_at_placements(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view view = ZD_VIEW_INIT;
  if (zd_gather(job, unit, &view) != ZD_OK)
    fail_msg("gather: %s", zd_last_error());
  assert_int_equal(view.dtype, ZD_F32);
  assert_int_equal(view.bytes, BUFFER_BYTES);
  assert_int_equal(view.version, 7);
  assert_int_equal(view.ntensors, 2);
  assert_string_equal(view.tensors[0].name, "w");
  assert_string_equal(view.tensors[1].name, "b");
  assert_ptr_equal(view.tensors[0].data, view.base);
  assert_ptr_equal(view.tensors[1].data, (char *)view.base + BIAS_OFFSET * sizeof(float));
  assert_int_equal(view.tensors[0].ndim, 2);
  assert_int_equal(view.tensors[0].shape[0], 3);
  assert_int_equal(view.tensors[0].shape[1], 5);
  assert_int_equal(view.tensors[1].numel, 3);
  assert_int_equal(view.tensors[1].offset, BIAS_OFFSET);
  /* Shared memory: no device, no event, and nothing to order. */
  assert_int_equal(view.device, -1);
  assert_null(view.event);
  assert_int_equal(zd_view_stream_wait(&view, NULL), ZD_OK);
  assert_int_equal(zd_view_stream_done(&view, NULL), ZD_OK);
  const float *weights = view.tensors[0].data;
  const float *bias = view.tensors[1].data;
  assert_true(weights[4] == 1004.0f);
  assert_true(bias[2] == 1000.0f + BIAS_OFFSET + 2);
  assert_int_equal(zd_release(job, unit), ZD_OK);

  /* The second reply carries no descriptor: the cached mapping serves, and
   * it is shared memory, so the daemon's writes show through. */
  fake->gathered[0][0] = -1.0f;
  zd_view again = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &again), ZD_OK);
  assert_ptr_equal(again.base, view.base);
  assert_true(((const float *)again.tensors[0].data)[0] == -1.0f);
  assert_int_equal(zd_release(job, unit), ZD_OK);
  zd_close(client);
  fake_join(fake);
  assert_int_equal(fake->release_frames, 2);
  assert_int_equal(fake->release_no_reply_flags, 2);
  fake_destroy(fake);
}

static void test_out_of_order_replies_are_matched_by_id(void **state) {
  fake_daemon *fake = fake_create();
  fake->reorder_gathers = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit first = register_unit(job, "layer0");
  zd_unit second = register_unit(job, "layer1");
  zd_pending first_pending = ZD_PENDING_INIT, second_pending = ZD_PENDING_INIT;
  assert_int_equal(zd_gather_async(job, first, &first_pending), ZD_OK);
  assert_int_equal(zd_gather_async(job, second, &second_pending), ZD_OK);
  assert_true(second_pending.request_id > first_pending.request_id);
  /* The fake answers the second gather first: waiting for the first must
   * stash that reply for the second wait. */
  zd_view first_view = ZD_VIEW_INIT, second_view = ZD_VIEW_INIT;
  assert_int_equal(zd_gather_wait(job, &first_pending, &first_view), ZD_OK);
  assert_true(((const float *)first_view.tensors[0].data)[1] == 1001.0f);
  assert_int_equal(zd_gather_wait(job, &second_pending, &second_view), ZD_OK);
  assert_true(((const float *)second_view.tensors[0].data)[1] == 2001.0f);
  assert_ptr_not_equal(first_view.base, second_view.base);
  /* Waiting twice for the same gather is a caller error, not a hang. */
  assert_int_equal(zd_gather_wait(job, &first_pending, &first_view), ZD_E_INVALID_ARGUMENT);
  assert_message_contains("no gather in flight");
  zd_close(client);
  fake_destroy(fake);
}

static void test_grad_buffer_is_shared_and_writable(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view gathered = ZD_VIEW_INIT;
  assert_int_equal(zd_gather(job, unit, &gathered), ZD_OK);
  zd_view grad = ZD_VIEW_INIT;
  assert_int_equal(zd_grad_buffer(job, unit, &grad), ZD_OK);
  /* The fake reuses buffer id 10 for both kinds: they are cached apart. */
  assert_ptr_not_equal(grad.base, gathered.base);
  assert_int_equal(grad.dtype, ZD_F32);
  float *bias_grad = grad.tensors[1].data;
  assert_ptr_equal(bias_grad, (float *)grad.base + BIAS_OFFSET);
  bias_grad[0] = 1.5f;
  bias_grad[2] = 2.0f;
  assert_int_equal(zd_reduce(job, unit), ZD_OK);
  assert_true(fake->reduce_grad_sum == 3.5f);
  assert_int_equal(zd_release(job, unit), ZD_OK);

  zd_step_options options = ZD_STEP_OPTIONS_INIT;
  options.set_lr = 1;
  options.lr = 1e-4;
  zd_step_result result = ZD_STEP_RESULT_INIT;
  assert_int_equal(zd_step(job, &options, &result), ZD_OK);
  assert_int_equal(result.step, 1);
  assert_true(result.grad_norm == 2.5);
  assert_int_equal(zd_job_version(job), result.version);
  assert_int_equal(zd_detach(job), ZD_OK);
  assert_int_equal(zd_step(job, NULL, NULL), ZD_E_FAILED_PRECONDITION);
  zd_close(client);
  fake_destroy(fake);
}

static void test_dropped_buffers_are_unmapped(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit first = register_unit(job, "layer0");
  zd_unit second = register_unit(job, "layer1");
  zd_view view = ZD_VIEW_INIT;
  gather_ok(job, first, &view);
  assert_int_equal(zd_release(job, first), ZD_OK);
  zd_view grad = ZD_VIEW_INIT;
  assert_int_equal(zd_grad_buffer(job, second, &grad), ZD_OK);
  assert_int_equal(zd_reduce(job, second), ZD_OK);
  assert_int_equal(mappings_of(fake, "gather-0"), 2);
  assert_int_equal(mappings_of(fake, "grad-1"), 2);

  /* A gather reply drops the released gathered buffer, a gradient reply
   * the reduced gradient buffer. */
  fake->drop_ids[0] = BUFFER_ID + first;
  fake->ndrop_ids = 1;
  gather_ok(job, second, &view);
  assert_int_equal(mappings_of(fake, "gather-0"), 1);
  assert_int_equal(zd_release(job, second), ZD_OK);
  fake->drop_ids[0] = BUFFER_ID + second;
  fake->ndrop_ids = 1;
  assert_int_equal(zd_grad_buffer(job, first, &grad), ZD_OK);
  assert_int_equal(mappings_of(fake, "grad-1"), 1);
  assert_int_equal(mappings_of(fake, "gather-1"), 1);
  assert_int_equal(zd_reduce(job, first), ZD_OK);

  /* The id was forgotten: the daemon sends the buffer again, and it is
   * mapped afresh. */
  gather_ok(job, first, &view);
  assert_true(first_weight(&view) == 1000.0f);
  assert_int_equal(mappings_of(fake, "gather-0"), 2);
  zd_close(client);
  assert_int_equal(mappings_of(fake, "gather-0"), 1);
  fake_destroy(fake);
}

static void test_dropped_buffer_a_view_still_uses_is_kept(void **state) {
  /* A daemon must not drop a buffer the session holds; if one does, the
   * worker's views keep working rather than crash. */
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit first = register_unit(job, "layer0");
  zd_unit second = register_unit(job, "layer1");
  zd_view gathered = ZD_VIEW_INIT;
  gather_ok(job, first, &gathered);
  zd_view grad = ZD_VIEW_INIT;
  fake->drop_ids[0] = BUFFER_ID + first;
  fake->ndrop_ids = 1;
  assert_int_equal(zd_grad_buffer(job, second, &grad), ZD_OK);
  assert_int_equal(mappings_of(fake, "gather-0"), 2);
  assert_true(first_weight(&gathered) == 1000.0f);
  fake->drop_ids[0] = BUFFER_ID + second;
  fake->ndrop_ids = 1;
  zd_view other = ZD_VIEW_INIT;
  gather_ok(job, second, &other);
  assert_int_equal(mappings_of(fake, "grad-1"), 2);
  ((float *)grad.tensors[1].data)[0] = 4.0f;
  assert_int_equal(zd_reduce(job, second), ZD_OK);
  assert_true(fake->reduce_grad_sum == 4.0f);
  zd_close(client);
  fake_destroy(fake);
}

static void test_stable_addresses_keep_a_unit_at_one_address(void **state) {
  fake_daemon *fake = fake_create();
  fake->alternate_gather_buffers = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 0, 0, 1);
  zd_unit unit = register_unit(job, "layer0");
  register_unit(job, "layer1");

  zd_view first = ZD_VIEW_INIT;
  gather_ok(job, unit, &first); /* buffer ALT_BUFFER_ID */
  assert_true(first_weight(&first) == 5000.0f);
  assert_string_equal(perms_at(first.base, fake, "alt-0"), "r--s");
  assert_ptr_equal(first.tensors[1].data, (float *)first.base + BIAS_OFFSET);
  assert_int_equal(first.bytes, BUFFER_BYTES);
  void *base = first.base;
  assert_int_equal(zd_release(job, unit), ZD_OK);
  /* Released: the range is inaccessible and maps no daemon memory, but the
   * descriptor is kept to map the buffer again. */
  assert_string_equal(perms_at(base, fake, NULL), "---p");
  assert_int_equal(mappings_of(fake, "alt-0"), 1);
  assert_int_equal(descriptors_of(fake, "alt-0"), 2);

  zd_view second = ZD_VIEW_INIT;
  gather_ok(job, unit, &second); /* buffer BUFFER_ID: another id, same address */
  assert_ptr_equal(second.base, base);
  assert_ptr_equal(second.tensors[0].data, base);
  assert_true(first_weight(&second) == 1000.0f);
  assert_true(((const float *)second.tensors[1].data)[2] == 1000.0f + BIAS_OFFSET + 2);
  assert_string_equal(perms_at(base, fake, "gather-0"), "r--s");
  /* Shared memory: the daemon's writes show through. */
  fake->gathered[0][1] = -2.0f;
  assert_true(((const float *)second.tensors[0].data)[1] == -2.0f);

  /* Gathering again without a release (this fake allows it) into the same
   * buffer keeps the mapping. */
  fake->alternate_gather_buffers = 0;
  zd_view again = ZD_VIEW_INIT;
  gather_ok(job, unit, &again);
  assert_ptr_equal(again.base, base);
  assert_true(first_weight(&again) == 1000.0f);
  assert_string_equal(perms_at(base, fake, "gather-0"), "r--s");
  assert_int_equal(zd_release(job, unit), ZD_OK);
  assert_string_equal(perms_at(base, fake, NULL), "---p");

  /* Another unit has a range of its own. */
  zd_view other = ZD_VIEW_INIT;
  gather_ok(job, 1, &other);
  assert_ptr_not_equal(other.base, base);
  assert_true(first_weight(&other) == 2000.0f);
  assert_int_equal(zd_release(job, 1), ZD_OK);

  /* Gradient views are unaffected (mapped once, read-write). */
  zd_view grad = ZD_VIEW_INIT;
  assert_int_equal(zd_grad_buffer(job, unit, &grad), ZD_OK);
  assert_string_equal(perms_at(grad.base, fake, "grad-0"), "rw-s");
  assert_int_equal(zd_reduce(job, unit), ZD_OK);

  /* Re-gathering restores access. */
  fake->alternate_gather_buffers = 1;
  gather_ok(job, unit, &again);
  assert_ptr_equal(again.base, base);
  assert_true(first_weight(&again) == 5000.0f);
  assert_string_equal(perms_at(base, fake, "alt-0"), "r--s");

  /* zd_close unmaps the ranges and closes the kept descriptors. */
  zd_close(client);
  assert_int_equal(mappings_of(fake, "alt-0"), 1);
  assert_int_equal(descriptors_of(fake, "alt-0"), 1);
  assert_int_equal(descriptors_of(fake, "gather-0"), 1);
  assert_int_equal(descriptors_of(fake, "gather-1"), 1);
  fake_destroy(fake);
}

static void test_stable_addresses_close_dropped_descriptors(void **state) {
  fake_daemon *fake = fake_create();
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 0, 0, 1);
  zd_unit first = register_unit(job, "layer0");
  zd_unit second = register_unit(job, "layer1");
  zd_view view = ZD_VIEW_INIT;
  gather_ok(job, first, &view);
  void *base = view.base;
  assert_int_equal(zd_release(job, first), ZD_OK);
  assert_int_equal(descriptors_of(fake, "gather-0"), 2);
  fake->drop_ids[0] = BUFFER_ID + first;
  fake->ndrop_ids = 1;
  gather_ok(job, second, &view);
  assert_int_equal(descriptors_of(fake, "gather-0"), 1);
  assert_int_equal(zd_release(job, second), ZD_OK);
  /* The daemon sends the buffer again; the unit's address is the same. */
  gather_ok(job, first, &view);
  assert_ptr_equal(view.base, base);
  assert_true(first_weight(&view) == 1000.0f);
  assert_int_equal(descriptors_of(fake, "gather-0"), 2);
  zd_close(client);
  assert_int_equal(descriptors_of(fake, "gather-0"), 1);
  fake_destroy(fake);
}

static void test_stable_addresses_on_a_read_only_job(void **state) {
  fake_daemon *fake = fake_create();
  fake->alternate_gather_buffers = 1;
  fake->units_registered = 1;
  snprintf(fake->unit_names[0], sizeof fake->unit_names[0], "embed");
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_with(client, 1, 1, 1);
  assert_int_equal(zd_list_units(job, NULL), ZD_OK);
  zd_view first = ZD_VIEW_INIT, second = ZD_VIEW_INIT;
  gather_ok(job, 0, &first);
  assert_int_equal(zd_release(job, 0), ZD_OK);
  assert_string_equal(perms_at(first.base, fake, NULL), "---p");
  gather_ok(job, 0, &second);
  assert_ptr_equal(second.base, first.base);
  assert_true(first_weight(&second) == 1000.0f);
  assert_string_equal(perms_at(second.base, fake, "gather-0"), "r--s");
  zd_close(client);
  fake_destroy(fake);
}

static void test_without_stable_addresses_each_buffer_keeps_its_mapping(void **state) {
  fake_daemon *fake = fake_create();
  fake->alternate_gather_buffers = 1;
  fake_start(fake);
  zd_client *client = connect_to(fake);
  zd_job *job = attach_job(client);
  zd_unit unit = register_unit(job, "layer0");
  zd_view first = ZD_VIEW_INIT, second = ZD_VIEW_INIT, third = ZD_VIEW_INIT;
  gather_ok(job, unit, &first);
  assert_int_equal(zd_release(job, unit), ZD_OK);
  gather_ok(job, unit, &second);
  assert_int_equal(zd_release(job, unit), ZD_OK);
  /* Two buffers, two cached mappings; released ones stay mapped, and the
   * descriptors are closed once mapped. */
  assert_ptr_not_equal(first.base, second.base);
  assert_string_equal(perms_at(first.base, fake, "alt-0"), "r--s");
  assert_string_equal(perms_at(second.base, fake, "gather-0"), "r--s");
  assert_int_equal(descriptors_of(fake, "alt-0"), 1);
  assert_int_equal(descriptors_of(fake, "gather-0"), 1);
  gather_ok(job, unit, &third);
  assert_ptr_equal(third.base, first.base);
  assert_true(first_weight(&third) == 5000.0f);
  assert_int_equal(mappings_of(fake, "alt-0"), 2);
  zd_close(client);
  assert_int_equal(mappings_of(fake, "alt-0"), 1);
  assert_int_equal(mappings_of(fake, "gather-0"), 1);
  fake_destroy(fake);
}

int main(void) {
  signal(SIGPIPE, on_sigpipe);
  /* No test here may depend on whether this machine has a GPU. */
  setenv("ZEROD_CUDA_MODULE", "/nonexistent/libzerod_cuda.so", 1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rank0_sends_init_values_in_a_memfd),
      cmocka_unit_test(test_gather_view_points_at_placements),
      cmocka_unit_test(test_out_of_order_replies_are_matched_by_id),
      cmocka_unit_test(test_grad_buffer_is_shared_and_writable),
      cmocka_unit_test(test_dropped_buffers_are_unmapped),
      cmocka_unit_test(test_dropped_buffer_a_view_still_uses_is_kept),
      cmocka_unit_test(test_stable_addresses_keep_a_unit_at_one_address),
      cmocka_unit_test(test_stable_addresses_close_dropped_descriptors),
      cmocka_unit_test(test_stable_addresses_on_a_read_only_job),
      cmocka_unit_test(test_without_stable_addresses_each_buffer_keeps_its_mapping),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
