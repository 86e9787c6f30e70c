/* The coordinator checks a job config with the node's rules (model/config.c)
 * and nothing else: for every config in a table, ctl_check_job_config, a
 * decoded CreateJob request and a stored job accept exactly what
 * job_config_from_proto + job_config_finish accept, and refuse the rest
 * with the node's message. The table holds each of the node's refusals,
 * the values where an earlier second copy of the rules in ctl_decode.c
 * disagreed with the node (infinities, dampening), and configs with two
 * faults (which one is reported). A second copy of the rules with other
 * ranges, messages or order fails here. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "config.h"
#include "ctl_decode.h"
#include "rpc.h"

/* One row: a JobConfig as a client would send it. no_optimizer leaves the
 * OptimizerConfig out; null_config sends no JobConfig at all. */
typedef struct row {
  const char *what;
  int null_config, no_optimizer;
  int kind;
  double lr, beta1, beta2, eps, weight_decay;
  int has_weight_decay;
  double momentum, dampening;
  int nesterov;
  int dtype;
  double max_grad_norm;
  uint64_t max_live_bytes;
  int collectives;
  uint32_t hpz;
} row;

#define SGD   ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_SGD
#define ADAM  ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAM
#define ADAMW ZEROD__V1__OPTIMIZER_KIND__OPTIMIZER_ADAMW
#define F16   ZEROD__V1__DTYPE__DTYPE_F16
#define BF16  ZEROD__V1__DTYPE__DTYPE_BF16
#define FLAT  ZEROD__V1__COLLECTIVES__COLLECTIVES_FLAT

static const row rows[] = {
    /* Accepted. */
    {"no config", .null_config = 1},
    {"empty config", .no_optimizer = 1},
    {"empty optimizer", .kind = 0},
    {"adamw", .kind = ADAMW, .lr = 3e-4, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.1,
     .has_weight_decay = 1, .max_grad_norm = 1, .dtype = BF16, .max_live_bytes = 1 << 20},
    {"adam, explicit zero decay", .kind = ADAM, .has_weight_decay = 1},
    {"sgd nesterov", .kind = SGD, .lr = 0.1, .momentum = 0.9, .nesterov = 1},
    {"sgd dampening", .kind = SGD, .momentum = 0.9, .dampening = 0.5},
    {"adam ignores nesterov", .kind = ADAM, .nesterov = 1},
    {"betas at zero", .beta1 = -0.0, .beta2 = -0.0},
    {"eps zero", .eps = 0},
    {"negative dampening", .kind = SGD, .momentum = 0.9, .dampening = -1},
    /* Refused: where an earlier copy in ctl_decode.c disagreed with the
     * node (it refused them, the node did not). */
    {"infinite eps", .eps = INFINITY},
    {"infinite momentum", .kind = SGD, .momentum = INFINITY},
    {"infinite max_grad_norm", .max_grad_norm = INFINITY},
    {"nan dampening", .kind = SGD, .momentum = 0.9, .dampening = NAN},
    {"infinite dampening", .kind = SGD, .momentum = 0.9, .dampening = -INFINITY},
    /* Refused: one fault each. */
    {"negative lr", .lr = -1},
    {"infinite lr", .lr = INFINITY},
    {"nan lr", .lr = NAN},
    {"beta1 one", .beta1 = 1},
    {"beta2 above one", .beta2 = 1.5},
    {"negative beta1", .beta1 = -0.1},
    {"nan beta2", .beta2 = NAN},
    {"negative eps", .eps = -1e-8},
    {"nan eps", .eps = NAN},
    {"negative weight decay", .weight_decay = -0.01, .has_weight_decay = 1},
    {"infinite weight decay", .weight_decay = INFINITY, .has_weight_decay = 1},
    {"negative momentum", .kind = SGD, .momentum = -0.9},
    {"negative max_grad_norm", .max_grad_norm = -1},
    {"nan max_grad_norm", .no_optimizer = 1, .max_grad_norm = NAN},
    {"nesterov without momentum", .kind = SGD, .nesterov = 1},
    {"nesterov with dampening", .kind = SGD, .momentum = 0.9, .dampening = 0.1, .nesterov = 1},
    {"unknown optimizer", .kind = 9},
    {"f16 working copy", .dtype = F16},
    {"unknown working dtype", .dtype = 9},
    {"unknown dtype", .no_optimizer = 1, .dtype = 17},
    /* Refused: two faults; the node's order decides which is reported. */
    {"bad dtype and bad lr", .lr = -1, .dtype = 9},
    {"unknown optimizer and bad max_grad_norm", .kind = 9, .max_grad_norm = -1},
    {"bad lr and bad betas", .lr = -1, .beta1 = 2},
    {"bad eps and bad momentum", .kind = SGD, .eps = -1, .momentum = -1},
    {"hpz, hierarchical", .hpz = 1},
    {"hpz on flat collectives", .hpz = 2, .collectives = FLAT},
    {"hpz off on flat collectives", .hpz = 1, .collectives = FLAT},
    {"hpz over the limit", .hpz = 5000},
};

typedef struct built {
  Zerod__V1__JobConfig config;
  Zerod__V1__OptimizerConfig optimizer;
} built;

static const Zerod__V1__JobConfig *build(const row *r, built *b) {
  if (r->null_config)
    return NULL;
  zerod__v1__job_config__init(&b->config);
  zerod__v1__optimizer_config__init(&b->optimizer);
  b->config.working_dtype = (Zerod__V1__Dtype)r->dtype;
  b->config.max_grad_norm = r->max_grad_norm;
  b->config.max_live_bytes = r->max_live_bytes;
  b->config.collectives = (Zerod__V1__Collectives)r->collectives;
  b->config.hpz_partition_size = r->hpz;
  if (!r->no_optimizer) {
    Zerod__V1__OptimizerConfig *o = &b->optimizer;
    o->kind = (Zerod__V1__OptimizerKind)r->kind;
    o->lr = r->lr;
    o->beta1 = r->beta1;
    o->beta2 = r->beta2;
    o->eps = r->eps;
    o->weight_decay = r->weight_decay;
    o->has_weight_decay = r->has_weight_decay;
    o->momentum = r->momentum;
    o->dampening = r->dampening;
    o->nesterov = r->nesterov;
    b->config.optimizer = o;
  }
  return &b->config;
}

/* What the node says of the config: 0 or -EINVAL and its message. */
static int node_check(const Zerod__V1__JobConfig *pc, char *err, size_t err_bytes) {
  job_config c;
  int rc = job_config_from_proto(pc, &c, err, err_bytes);
  if (rc == 0)
    rc = job_config_finish(&c, (uint64_t)1 << 30, err, err_bytes);
  return rc;
}

static void test_check_job_config_is_the_nodes_rule(void **state) {
  (void)state;
  int refused = 0;
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    built b;
    const Zerod__V1__JobConfig *pc = build(&rows[i], &b);
    char want[256] = "", got[256] = "";
    int want_rc = node_check(pc, want, sizeof want);
    int got_rc = ctl_check_job_config(pc, got, sizeof got);
    if (got_rc != want_rc || (want_rc != 0 && strcmp(got, want) != 0))
      fail_msg("%s: the node says %d '%s', the coordinator %d '%s'", rows[i].what, want_rc, want,
               got_rc, got);
    refused += want_rc != 0;
  }
  /* The table's refusals are refusals (a node that accepts everything
   * would agree with a coordinator that does too). */
  assert_int_equal(refused, 30);
}

/* The same through CreateJob's decoder: the bytes a client sends. */
static void test_create_job_refuses_what_the_node_refuses(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    built b;
    Zerod__V1__CreateJobRequest req = ZEROD__V1__CREATE_JOB_REQUEST__INIT;
    req.name = "j";
    req.nodes = 1;
    req.ranks_per_node = 1;
    req.config = (Zerod__V1__JobConfig *)build(&rows[i], &b);
    char want[256] = "", got[256] = "";
    int want_rc = node_check(req.config, want, sizeof want);
    size_t n = protobuf_c_message_get_packed_size(&req.base);
    uint8_t *bytes = malloc(n ? n : 1);
    assert_non_null(bytes);
    protobuf_c_message_pack(&req.base, bytes);
    ProtobufCMessage *out = NULL;
    int rc = ctl_decode(CTL_CREATE_JOB, bytes, n, &out, got, sizeof got);
    free(bytes);
    if (want_rc == 0 && rc != 0)
      fail_msg("%s: the node accepts it, CreateJob refuses it: %s", rows[i].what, got);
    if (want_rc != 0 && (rc != RPC_INVALID_ARGUMENT || strcmp(got, want) != 0))
      fail_msg("%s: the node says '%s', CreateJob %d '%s'", rows[i].what, want, rc, got);
    ctl_free(out);
  }
}

/* And a stored job, with the job's name before the node's message. */
static void test_stored_job_refuses_what_the_node_refuses(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    built b;
    Zerod__V1__RankPlacement placement = ZEROD__V1__RANK_PLACEMENT__INIT;
    placement.node = "n0";
    placement.ranks = 1;
    Zerod__V1__RankPlacement *placements[] = {&placement};
    Zerod__V1__Job job = ZEROD__V1__JOB__INIT;
    job.name = "j";
    job.id = 1;
    job.nodes = 1;
    job.ranks_per_node = 1;
    job.world_size = 1;
    job.n_placement = 1;
    job.placement = placements;
    job.config = (Zerod__V1__JobConfig *)build(&rows[i], &b);
    Zerod__V1__StoredJob stored = ZEROD__V1__STORED_JOB__INIT;
    stored.job = &job;
    stored.token = "tok";
    char node[256] = "", want[300] = "", got[512] = "";
    int want_rc = node_check(job.config, node, sizeof node);
    snprintf(want, sizeof want, "job 'j': %s", node);
    int rc = ctl_check_stored_job(&stored, got, sizeof got);
    if (want_rc == 0 && rc != 0)
      fail_msg("%s: the node accepts it, the stored job is refused: %s", rows[i].what, got);
    if (want_rc != 0 && (rc != -EINVAL || strcmp(got, want) != 0))
      fail_msg("%s: want '%s', got %d '%s'", rows[i].what, want, rc, got);
  }
}

/* An absent weight decay is the default whatever the field holds (the
 * wire cannot carry this; a C caller can). */
static void test_absent_weight_decay_is_ignored(void **state) {
  (void)state;
  Zerod__V1__OptimizerConfig o = ZEROD__V1__OPTIMIZER_CONFIG__INIT;
  o.kind = SGD;
  o.weight_decay = -1;
  Zerod__V1__JobConfig pc = ZEROD__V1__JOB_CONFIG__INIT;
  pc.optimizer = &o;
  char err[256] = "";
  assert_int_equal(node_check(&pc, err, sizeof err), 0);
  assert_int_equal(ctl_check_job_config(&pc, err, sizeof err), 0);
}

/* ctl_decode of msg packed, as a client sends it: the status, with the
 * message in err. */
static int decode(const char *path, const ProtobufCMessage *msg, char *err, size_t err_bytes) {
  size_t n = protobuf_c_message_get_packed_size(msg);
  uint8_t *bytes = malloc(n ? n : 1);
  assert_non_null(bytes);
  protobuf_c_message_pack(msg, bytes);
  ProtobufCMessage *out = NULL;
  err[0] = '\0';
  int rc = ctl_decode(path, bytes, n, &out, err, err_bytes);
  free(bytes);
  ctl_free(out);
  return rc;
}

/* A job on a base may leave nodes and ranks_per_node 0 (the base's: the
 * coordinator fills them in); a job without one may not, and no job may
 * be its own base. */
static void test_create_job_on_a_base(void **state) {
  (void)state;
  Zerod__V1__JobConfig config = ZEROD__V1__JOB_CONFIG__INIT;
  config.base_job = "llama";
  Zerod__V1__CreateJobRequest req = ZEROD__V1__CREATE_JOB_REQUEST__INIT;
  req.name = "lora";
  req.config = &config;
  char err[256];
  assert_int_equal(decode(CTL_CREATE_JOB, &req.base, err, sizeof err), 0);
  char *names[] = {"n1", "n2"};
  req.n_node_names = 2;
  req.node_names = names;
  assert_int_equal(decode(CTL_CREATE_JOB, &req.base, err, sizeof err), 0);
  req.nodes = 3;
  assert_int_equal(decode(CTL_CREATE_JOB, &req.base, err, sizeof err), RPC_INVALID_ARGUMENT);
  assert_string_equal(err, "node_names lists 2 nodes but nodes is 3");
  req.nodes = 0;
  req.n_node_names = 0;
  config.base_job = "lora";
  assert_int_equal(decode(CTL_CREATE_JOB, &req.base, err, sizeof err), RPC_INVALID_ARGUMENT);
  assert_string_equal(err, "job 'lora' cannot be its own base (config.base_job)");
  config.base_job = "";
  assert_int_equal(decode(CTL_CREATE_JOB, &req.base, err, sizeof err), RPC_INVALID_ARGUMENT);
  assert_string_equal(err, "nodes is 0 (1..64)");
}

/* FreezeJob: a job name, and at most 64 tenant names to share with, none
 * twice. */
static void test_freeze_job_request(void **state) {
  (void)state;
  Zerod__V1__FreezeJobRequest req = ZEROD__V1__FREEZE_JOB_REQUEST__INIT;
  char err[256];
  assert_int_equal(decode(CTL_FREEZE_JOB, &req.base, err, sizeof err), RPC_INVALID_ARGUMENT);
  assert_string_equal(err, "name is missing (1..64 bytes of [A-Za-z0-9._-])");
  req.name = "llama";
  req.public_ = 1;
  assert_int_equal(decode(CTL_FREEZE_JOB, &req.base, err, sizeof err), 0);
  char *tenants[CTL_MAX_SHARED_WITH + 1];
  char names[CTL_MAX_SHARED_WITH + 1][8];
  for (int i = 0; i <= CTL_MAX_SHARED_WITH; i++) {
    snprintf(names[i], sizeof names[i], "t%d", i);
    tenants[i] = names[i];
  }
  req.shared_with = tenants;
  req.n_shared_with = CTL_MAX_SHARED_WITH;
  assert_int_equal(decode(CTL_FREEZE_JOB, &req.base, err, sizeof err), 0);
  req.n_shared_with = CTL_MAX_SHARED_WITH + 1;
  assert_int_equal(decode(CTL_FREEZE_JOB, &req.base, err, sizeof err), RPC_INVALID_ARGUMENT);
  assert_string_equal(err, "shared_with lists 65 tenants (at most 64)");
  char *twice[] = {"team-b", "team-b"};
  req.shared_with = twice;
  req.n_shared_with = 2;
  assert_int_equal(decode(CTL_FREEZE_JOB, &req.base, err, sizeof err), RPC_INVALID_ARGUMENT);
  assert_string_equal(err, "tenant 'team-b' is listed twice in shared_with");
  char *bad[] = {"team b"};
  req.shared_with = bad;
  req.n_shared_with = 1;
  assert_int_equal(decode(CTL_FREEZE_JOB, &req.base, err, sizeof err), RPC_INVALID_ARGUMENT);
  assert_true(strstr(err, "shared_with[] must be 1..64 bytes") != NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_check_job_config_is_the_nodes_rule),
      cmocka_unit_test(test_create_job_refuses_what_the_node_refuses),
      cmocka_unit_test(test_stored_job_refuses_what_the_node_refuses),
      cmocka_unit_test(test_absent_weight_decay_is_ignored),
      cmocka_unit_test(test_create_job_on_a_base),
      cmocka_unit_test(test_freeze_job_request),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
