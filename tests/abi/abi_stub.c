/* A stand-in for libzerod whose ABI is one copy of zerod.h: tests/abi
 * builds it from the baseline header and from copies of it with one change
 * each, and check_abi_selftest.sh requires the ABI check to pass or fail on
 * each as the ABI policy says (docs/client.md). The functions do nothing;
 * only their types matter, and between them they take every struct of the
 * header. */
#include "zerod.h"

ZD_API zd_status zd_attach(zd_client *client, const zd_attach_options *options, zd_job **out) {
  return ZD_E_INTERNAL;
}

ZD_API zd_status zd_register_unit(zd_job *job, const zd_unit_desc *desc, zd_unit *out) {
  return ZD_E_INTERNAL;
}

ZD_API zd_status zd_gather_async(zd_job *job, zd_unit unit, zd_pending *out) {
  return ZD_E_INTERNAL;
}

ZD_API zd_status zd_gather_wait(zd_job *job, const zd_pending *pending, zd_view *out) {
  return ZD_E_INTERNAL;
}

ZD_API zd_status zd_job_unit_info(const zd_job *job, unsigned index, zd_unit_info *out) {
  return ZD_E_INTERNAL;
}

ZD_API zd_status zd_job_stats(zd_job *job, zd_rank_stats *out, unsigned max, unsigned *nranks) {
  return ZD_E_INTERNAL;
}

ZD_API zd_status zd_set_groups(zd_job *job, const zd_param_group *groups, unsigned ngroups,
                               const zd_unit *units, const unsigned *const *tensor_groups,
                               unsigned nunits) {
  return ZD_E_INTERNAL;
}

ZD_API zd_status zd_step(zd_job *job, const zd_step_options *options, zd_step_result *out) {
  return ZD_E_INTERNAL;
}

#ifndef ABI_STUB_WITHOUT_CHECKPOINT
ZD_API zd_status zd_checkpoint_save(zd_job *job, const char *name, zd_checkpoint_info *info) {
  return ZD_E_INTERNAL;
}
#endif

#ifdef ABI_STUB_WITH_NEW_FUNCTION
ZD_API zd_status zd_abi_stub_new_function(zd_job *job, zd_view *out);
ZD_API zd_status zd_abi_stub_new_function(zd_job *job, zd_view *out) {
  return ZD_E_INTERNAL;
}
#endif

ZD_API const char *zd_strerror(zd_status status) {
  return "";
}
