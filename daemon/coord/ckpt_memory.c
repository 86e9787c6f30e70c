/* ckpt_memory: in-memory redundancy (coord_ckpt.h; docs/redundancy.md).
 *
 * The ranks of a job with redundancy copy their state at the end of every
 * redundancy_every_steps-th step into their node's replica directory
 * (tmpfs), and the node copies it to its buddy, the next node of the job's
 * placement (rank/replicate.c, node/replica.c); the coordinator hands each
 * node the job's replica key and its buddy's address in the Assignment.
 * Nodes report the copies they hold in every heartbeat (JobStatus.replicas):
 * the newest step of which every rank's file and the layout are held by
 * some live node is the job's in-memory copy (Job.replica_step).
 *
 * When a node of such a job leaves the cluster, the job is re-placed on
 * the nodes that are left (coord__mem_node_lost): its world shrinks, every
 * node rebuilds its ranks at the new epoch, and once they are ready with
 * no units the recovery (ckpt_recover.c) restores the newest in-memory copy
 * (coord__mem_restore_start), re-sharded onto the new world, each node
 * fetching the files it lacks from the nodes that hold them. Nothing is
 * read from disk. Loop thread only. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "coord_ckpt.h"
#include "log.h"

int coord__mem_enabled(const cjob *j) {
  const Zerod__V1__CheckpointPolicy *p = j->msg->checkpoint_policy;
  return p != NULL && p->redundancy != 0;
}

void coord__replica_address(const coord *c, const char *node, char *out, size_t out_bytes) {
  const member *m = coord__find_member(c, node);
  out[0] = '\0';
  if (m == NULL || m->info->replica_port == 0)
    return;
  const char *host = m->info->address[0] != '\0' ? m->info->address : "127.0.0.1";
  if (strchr(host, ':') != NULL)
    snprintf(out, out_bytes, "[%s]:%u", host, m->info->replica_port);
  else
    snprintf(out, out_bytes, "%s:%u", host, m->info->replica_port);
}

/* The placement index of the node that placement node at copies its
 * in-memory copies to: the next one, in placement order, that is a member
 * serving replicas; -1 when there is none. */
static long buddy_of(const coord *c, const cjob *j, size_t at) {
  size_t n = j->msg->n_placement;
  for (size_t k = 1; k < n; k++) {
    size_t b = (at + k) % n;
    char addr[COORD_ADDR_BYTES];
    coord__replica_address(c, j->msg->placement[b]->node, addr, sizeof addr);
    if (addr[0] != '\0')
      return (long)b;
  }
  return -1;
}

void coord__mem_assignment(const coord *c, cjob *j, size_t at, Zerod__V1__Assignment *a,
                           char *buddy, size_t buddy_bytes) {
  buddy[0] = '\0';
  if (!coord__mem_enabled(j))
    return;
  mem_copy *m = &j->ckpt.mem;
  if (!m->have_key && coord__random_bytes(m->key, sizeof m->key) == 0)
    m->have_key = 1;
  if (!m->have_key)
    return;
  a->replica_key.data = m->key;
  a->replica_key.len = sizeof m->key;
  long b = buddy_of(c, j, at);
  if (b >= 0)
    coord__replica_address(c, j->msg->placement[b]->node, buddy, buddy_bytes);
  a->replica_buddy = buddy;
}

/* ------------------------------------------------------------------------ */
/* The copies the nodes hold                                                */
/* ------------------------------------------------------------------------ */

/* Whether the live members' reports hold every rank's file of j's copy of
 * step (of a world of world_size ranks) and its layout. */
static int step_complete(const coord *c, const cjob *j, uint64_t step, uint32_t world_size) {
  uint64_t held = 0;
  int layout = 0;
  for (size_t i = 0; i < c->nmembers; i++) {
    const job_report *r = coord__find_report(c->members[i], j->msg->name);
    for (size_t k = 0; r != NULL && k < r->nreplicas; k++) {
      if (r->replicas[k].step != step || r->replicas[k].world_size != world_size)
        continue;
      held |= r->replicas[k].ranks;
      layout |= r->replicas[k].layout;
    }
  }
  uint64_t all = world_size >= 64 ? ~0ull : (1ull << world_size) - 1;
  return layout && world_size > 0 && (held & all) == all;
}

/* The newest step of j's complete in-memory copies, with the world that
 * made them; 0 when none. */
static uint64_t newest_copy(const coord *c, const cjob *j, uint32_t *world_size) {
  uint64_t best = 0;
  *world_size = 0;
  for (size_t i = 0; i < c->nmembers; i++) {
    const job_report *r = coord__find_report(c->members[i], j->msg->name);
    for (size_t k = 0; r != NULL && k < r->nreplicas; k++) {
      uint64_t step = r->replicas[k].step;
      if (step > best && step_complete(c, j, step, r->replicas[k].world_size)) {
        best = step;
        *world_size = r->replicas[k].world_size;
      }
    }
  }
  return best;
}

/* The node of j's placement whose ranks of j failed at the job's epoch (a
 * worker died in a collective, a peer's connection broke), with its
 * reason; NULL when none did, or a node is being rebuilt already. */
static const char *failed_node(const coord *c, const cjob *j, const char **error) {
  const char *failed = NULL;
  for (size_t i = 0; i < j->msg->n_placement; i++) {
    if (j->marks[i].departed)
      return NULL;
    const member *m = coord__find_member(c, j->msg->placement[i]->node);
    const job_report *r = m != NULL ? coord__find_report(m, j->msg->name) : NULL;
    if (failed == NULL && r != NULL && r->error[0] != '\0' && r->epoch == j->epoch) {
      failed = j->msg->placement[i]->node;
      *error = r->error;
    }
  }
  return failed;
}

/* A job with a copy whose ranks failed on a node is rebuilt on the same
 * nodes and restored from the copy, as after a node loss: a failure that
 * broke its collectives leaves ranks at different points of a step. */
static void rebuild_failed(coord *c, cjob *j) {
  const char *error = NULL;
  const char *failed = failed_node(c, j, &error);
  if (failed == NULL)
    return;
  /* The placement's strings go with the message coord__mem_replace
   * replaces. */
  char node[CTL_NAME_MAX_BYTES + 1];
  snprintf(node, sizeof node, "%s", failed);
  const char *nodes[CTL_MAX_RANKS];
  for (size_t i = 0; i < j->msg->n_placement; i++)
    nodes[i] = j->msg->placement[i]->node;
  char why[256], err[512];
  snprintf(why, sizeof why, "node '%s': %.120s; rebuilt from the in-memory copy of step %" PRIu64,
           node, error, j->ckpt.mem.step);
  uint64_t step = j->step;
  if (coord__mem_replace(c, j, nodes, j->msg->n_placement, why, err, sizeof err) != 0) {
    LOG_ERRORF("failed job not rebuilt", "job=%s err=\"%s\"", j->msg->name, err);
    return;
  }
  j->step_at_loss = step;
  j->epoch++; /* a new rendezvous: nothing of the broken one is read */
  LOG_INFOF("job rebuilt after its ranks failed", "job=%s node=%s memory_step=%" PRIu64,
            j->msg->name, node, j->ckpt.mem.step);
  coord__derive_job(c, j); /* not reconcile: the tick walks the jobs */
  coord__mark_job_watches(c, j);
}

void coord__mem_tick(coord *c, cjob *j) {
  uint32_t world = 0;
  uint64_t step = coord__mem_enabled(j) ? newest_copy(c, j, &world) : 0;
  if (step != j->ckpt.mem.step)
    coord__mark_job_watches(c, j);
  j->ckpt.mem.step = step;
  if (step != 0 && !j->deleting && !j->msg->frozen &&
      j->state == ZEROD__V1__JOB_STATE__JOB_STATE_DEGRADED)
    rebuild_failed(c, j);
}

/* ------------------------------------------------------------------------ */
/* Restores                                                                 */
/* ------------------------------------------------------------------------ */

/* The holders of o's restore of the copy of step (of a world of n ranks),
 * as messages pointing into o: per saved rank, the replica servers of the
 * live members that report its file (at most two). */
static int restore_holders(const coord *c, const cjob *j, ckpt_order *o, uint64_t step,
                           uint32_t n) {
  o->mem_holders = calloc(n, sizeof *o->mem_holders);
  o->mem_holder_msgs = calloc(n, sizeof *o->mem_holder_msgs);
  o->mem_holder_ptrs = calloc(n, sizeof *o->mem_holder_ptrs);
  o->mem_addrs = calloc(2 * (size_t)n, sizeof *o->mem_addrs);
  if (o->mem_holders == NULL || o->mem_holder_msgs == NULL || o->mem_holder_ptrs == NULL ||
      o->mem_addrs == NULL)
    return -1;
  for (uint32_t r = 0; r < n; r++) {
    Zerod__V1__ReplicaHolders *h = &o->mem_holder_msgs[r];
    zerod__v1__replica_holders__init(h);
    h->addresses = &o->mem_addrs[2 * (size_t)r];
    for (size_t i = 0; i < c->nmembers && h->n_addresses < 2; i++) {
      const job_report *rep = coord__find_report(c->members[i], j->msg->name);
      int held = 0;
      for (size_t k = 0; rep != NULL && k < rep->nreplicas && !held; k++)
        held = rep->replicas[k].step == step && rep->replicas[k].world_size == n &&
               (rep->replicas[k].ranks >> r & 1);
      char *slot = o->mem_holders[r][h->n_addresses];
      coord__replica_address(c, c->members[i]->info->name, slot, COORD_ADDR_BYTES);
      if (held && slot[0] != '\0')
        h->addresses[h->n_addresses++] = slot;
    }
    o->mem_holder_ptrs[r] = h;
  }
  return 0;
}

int coord__mem_restore_start(coord *c, cjob *j) {
  uint32_t world = 0;
  uint64_t step = newest_copy(c, j, &world);
  if (step == 0)
    return -1;
  ckpt_order *o = coord__ckpt_order_new(c, j, ORDER_RESTORE);
  if (o == NULL || restore_holders(c, j, o, step, world) != 0) {
    if (o != NULL)
      coord__ckpt_order_free(c, o);
    LOG_WARNF("in-memory restore not started: out of memory", "job=%s", j->msg->name);
    return -1;
  }
  o->memory = 1;
  o->recovery = 1;
  snprintf(o->dir, sizeof o->dir, "memory-%08" PRIu64, step);
  zerod__v1__restore_order__init(&o->restore_msg);
  o->restore_msg.id = o->id;
  o->restore_msg.source = "";
  o->restore_msg.format = ZEROD__V1__RESTORE_FORMAT__RESTORE_FORMAT_CHECKPOINT;
  o->restore_msg.memory = 1;
  o->restore_msg.memory_step = step;
  o->restore_msg.n_holders = world;
  o->restore_msg.holders = o->mem_holder_ptrs;
  o->phase = PHASE_RUNNING;
  coord__ckpt_order_set_deadline(c, o, NULL);
  LOG_INFOF("recovery started from the in-memory copies",
            "job=%s order=%" PRIu64 " step=%" PRIu64 " saved_world_size=%u world_size=%u "
            "step_at_loss=%" PRIu64,
            j->msg->name, o->id, step, world, j->msg->world_size, j->step_at_loss);
  coord__mark_job_watches(c, j);
  return 0;
}

/* ------------------------------------------------------------------------ */
/* A node lost                                                              */
/* ------------------------------------------------------------------------ */

/* Stores j placed on nodes (n names, each with the job's ranks per node,
 * in rank order), and marks every one of them to build the job afresh
 * (why says why): until each reports it ready at the job's epoch, the job
 * is degraded (coord_registry.c), and once all have, it is recovered from
 * its newest in-memory copy (ckpt_recover.c). 0, or an RPC status with
 * err and nothing changed. */
int coord__mem_replace(coord *c, cjob *j, const char *const *nodes, size_t n, const char *why,
                       char *err, size_t err_bytes) {
  Zerod__V1__RankPlacement *entries = calloc(n ? n : 1, sizeof *entries);
  Zerod__V1__RankPlacement **placement = calloc(n ? n : 1, sizeof *placement);
  node_mark *marks = calloc(n ? n : 1, sizeof *marks);
  int status = RPC_RESOURCE_EXHAUSTED;
  snprintf(err, err_bytes, "coordinator out of memory");
  if (entries != NULL && placement != NULL && marks != NULL) {
    Zerod__V1__Job changed = *j->msg;
    uint32_t rpn = j->msg->ranks_per_node;
    for (size_t i = 0; i < n; i++) {
      zerod__v1__rank_placement__init(&entries[i]);
      entries[i].node = (char *)nodes[i];
      entries[i].first_rank = (uint32_t)i * rpn;
      entries[i].ranks = rpn;
      placement[i] = &entries[i];
    }
    changed.placement = placement;
    changed.n_placement = n;
    changed.nodes = (uint32_t)n;
    changed.world_size = (uint32_t)n * rpn;
    status = coord__job_store(c, j, &changed, err, err_bytes);
  }
  free(entries);
  free(placement);
  if (status != 0) {
    free(marks);
    return status;
  }
  for (size_t i = 0; i < n; i++) {
    marks[i].departed = 1;
    snprintf(marks[i].reason, sizeof marks[i].reason, "%s", why);
  }
  free(j->marks);
  j->marks = marks;
  return 0;
}

/* A member that may take over a lost node's ranks of j: one serving
 * in-memory copies, not among j's nodes, with room for j's ranks per node
 * beside the ranks other jobs have there. The first by name, or NULL. */
static const char *spare_node(const coord *c, const cjob *j) {
  for (size_t i = 0; i < c->nmembers; i++) {
    const Zerod__V1__NodeInfo *info = c->members[i]->info;
    if (info->replica_port == 0 || coord__placement_of(j, info->name) >= 0)
      continue;
    uint64_t used = j->msg->ranks_per_node;
    for (size_t k = 0; k < c->njobs; k++) {
      long at = c->jobs[k]->deleting ? -1 : coord__placement_of(c->jobs[k], info->name);
      if (at >= 0)
        used += c->jobs[k]->msg->placement[at]->ranks;
    }
    if (used <= info->ranks)
      return info->name;
  }
  return NULL;
}

int coord__mem_node_lost(coord *c, cjob *j, size_t at, const char *reason) {
  if (!coord__mem_enabled(j) || j->ckpt.mem.step == 0 || j->msg->n_placement < 2 || j->msg->frozen)
    return 0;
  const char *nodes[CTL_MAX_RANKS];
  size_t n = 0;
  const char *spare = spare_node(c, j);
  for (size_t i = 0; i < j->msg->n_placement; i++)
    if (i != at || spare != NULL)
      nodes[n++] = i == at ? spare : j->msg->placement[i]->node;
  char why[256], err[512];
  if (spare != NULL)
    snprintf(why, sizeof why,
             "%s; its ranks move to spare node '%s' from the in-memory copy of step %" PRIu64,
             reason, spare, j->ckpt.mem.step);
  else
    snprintf(why, sizeof why,
             "%s; re-sharding onto %zu node%s from the in-memory copy of step %" PRIu64, reason, n,
             n == 1 ? "" : "s", j->ckpt.mem.step);
  uint64_t step_at_loss = j->step;
  if (coord__mem_replace(c, j, nodes, n, why, err, sizeof err) != 0) {
    LOG_ERRORF("job not re-placed after a node loss: it waits for the node", "job=%s err=\"%s\"",
               j->msg->name, err);
    return 0;
  }
  LOG_INFOF("job re-placed after a node loss",
            "job=%s spare=%s nodes=%zu world_size=%u memory_step=%" PRIu64 " step_at_loss=%" PRIu64,
            j->msg->name, spare != NULL ? spare : "-", n, j->msg->world_size, j->ckpt.mem.step,
            step_at_loss);
  return 1;
}
