/* What a job's local ranks are doing (activity.h). */
#include "activity.h"

#include <stdlib.h>

#include "clock.h"
#include "exec.h"

typedef struct activity_block {
  Zerod__V1__RankActivity *items;
  Zerod__V1__RankActivity **pointers;
} activity_block;

static uint64_t ms_since(uint64_t now_ns, uint64_t then_ns) {
  return then_ns != 0 && now_ns > then_ns ? (now_ns - then_ns) / 1000000 : 0;
}

void activity_reports(job *j, Zerod__V1__JobStatus *st, void **owned) {
  *owned = NULL;
  size_t n = j->nranks > 0 ? (size_t)j->nranks : 1;
  activity_block *b = calloc(1, sizeof *b);
  if (b == NULL || (b->items = calloc(n, sizeof *b->items)) == NULL ||
      (b->pointers = calloc(n, sizeof *b->pointers)) == NULL) {
    activity_reports_free(b);
    return;
  }
  uint64_t now = clock_now_ns();
  for (int r = 0; r < j->nranks; r++) {
    rank_state *rs = &j->ranks[r];
    Zerod__V1__RankActivity *a = &b->items[r];
    zerod__v1__rank_activity__init(a);
    a->rank = (uint32_t)rs->rank;
    a->collectives = __atomic_load_n(&rs->activity.calls, __ATOMIC_RELAXED);
    int op = __atomic_load_n(&rs->activity.op, __ATOMIC_ACQUIRE);
    a->collective = (char *)comm_act_name(op);
    if (op != COMM_ACT_NONE)
      a->waiting_ms = ms_since(now, __atomic_load_n(&rs->activity.since_ns, __ATOMIC_RELAXED));
    uint64_t last_ns = atomic_load(&rs->last_op_ns);
    a->last_op = last_ns != 0 ? (char *)exec_op_name(atomic_load(&rs->last_op)) : (char *)"";
    a->last_op_ms = ms_since(now, last_ns);
    b->pointers[r] = a;
  }
  st->n_ranks = (size_t)j->nranks;
  st->ranks = b->pointers;
  *owned = b;
}

void activity_reports_free(void *owned) {
  activity_block *b = owned;
  if (b == NULL)
    return;
  free(b->items);
  free(b->pointers);
  free(b);
}
