/* The coordinator (see coord.h): its lifecycle. coord_create loads the
 * state file and the checkpoint directory and starts the timers,
 * coord_register puts the services of the files below on a server, and
 * coord_shutdown and coord_destroy take it all down.
 *
 * The work is in the files below, one job each (docs/architecture.md):
 * the registry of members and jobs (coord_registry.c), the call plumbing
 * (coord_call.c), the durable state (coord_state.c), membership and
 * leases (coord_cluster.c), jobs and quotas (coord_jobs.c), the
 * rendezvous KV (coord_kv.c), and the Checkpoints service (coord_ckpt.c
 * and the ckpt_*.c files), on the same state (coord_impl.h).
 *
 * Nothing here blocks the loop but the state file's read at start. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coord_impl.h"
#include "filemode.h"
#include "health.h"
#include "log.h"

/* ------------------------------------------------------------------------ */
/* Health                                                                   */
/* ------------------------------------------------------------------------ */

static const char *const health_services[] = {
    "",
    "zerod.v1.Cluster",
    "zerod.v1.Jobs",
    "zerod.v1.Rendezvous",
    "zerod.v1.Checkpoints",
    "grpc.health.v1.Health",
};

/* ------------------------------------------------------------------------ */
/* Lifecycle                                                                */
/* ------------------------------------------------------------------------ */

/* Each tenant's directory in the first export root, where its exports go
 * (authz.c), made if missing with the daemon's directory mode. */
static int make_tenant_dirs(coord *c, char *err, size_t err_bytes) {
  if (c->auth == NULL || c->options.n_export_roots == 0)
    return 0;
  const char *root = c->options.export_roots[0];
  int fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    snprintf(err, err_bytes, "cannot open the export root %s: %s", root, strerror(e));
    return -e;
  }
  int rc = 0;
  for (size_t i = 0; i < auth_count(c->auth) && rc == 0; i++) {
    const char *tenant = auth_at(c->auth, i)->tenant;
    if (tenant[0] == '\0')
      continue;
    rc = filemode_mkdirat(fd, tenant);
    if (rc == -EEXIST)
      rc = 0;
    if (rc != 0)
      snprintf(err, err_bytes, "cannot make the tenant directory %s/%s: %s", root, tenant,
               strerror(-rc));
  }
  close(fd);
  return rc;
}

/* The lease sweep, the checkpoints' deadlines and schedule, and idle
 * jobs' expiry (last: it may delete a job, which stays listed while it is
 * deleted). */
static void on_lease_timer(uv_timer_t *timer) {
  coord *c = timer->data;
  coord__cluster_sweep(c);
  coord__ckpt_tick(c);
  uint64_t now = uv_now(c->loop);
  for (size_t i = 0; i < c->njobs; i++)
    coord__job_idle_tick(c, c->jobs[i], now);
}

int coord_create(uv_loop_t *loop, const coord_options *options, coord **out, char *err,
                 size_t err_bytes) {
  *out = NULL;
  if (options->lease_ttl_ms <= 0) {
    snprintf(err, err_bytes, "the lease TTL must be > 0");
    return -EINVAL;
  }
  coord *c = calloc(1, sizeof *c);
  if (c == NULL) {
    snprintf(err, err_bytes, "out of memory");
    return -ENOMEM;
  }
  int rc;
  c->loop = loop;
  c->hooks.assignment = coord__ckpt_assignment;
  c->hooks.node_lost = coord__mem_node_lost;
  c->hooks.job_changed = coord__ckpt_job_changed;
  c->hooks.job_freed = coord__kv_job_freed;
  c->hooks.jobs_forgotten = coord__ckpt_retire_pending;
  c->hooks.ckpt_removed = coord__ckpt_removed;
  c->options = *options;
  c->next_job_id = 1;
  snprintf(c->state_path, sizeof c->state_path, "%s/coordinator.pb", options->state_dir);
  snprintf(c->tmp_path, sizeof c->tmp_path, "%s/coordinator.pb.tmp", options->state_dir);
  if (options->auth_file[0] != '\0') {
    if ((rc = auth_load(options->auth_file, &c->auth, err, err_bytes)) != 0)
      goto fail;
    LOG_INFOF("principals loaded", "path=%s principals=%zu", options->auth_file,
              auth_count(c->auth));
  }
  if ((rc = make_tenant_dirs(c, err, err_bytes)) != 0)
    goto fail;

  if (options->state_dir[0] == '\0')
    goto loaded; /* in memory only */
  /* Create the directory and its parents. */
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s", options->state_dir);
  for (char *p = path + 1;; p++) {
    if (*p != '/' && *p != '\0')
      continue;
    char saved = *p;
    *p = '\0';
    if ((rc = filemode_mkdirat(AT_FDCWD, path)) != 0 && rc != -EEXIST) {
      snprintf(err, err_bytes, "cannot create %s: %s", path, strerror(-rc));
      goto fail;
    }
    *p = saved;
    if (saved == '\0')
      break;
  }
  /* A crash during a write leaves the temporary file; the state is the
   * renamed file, so the leftover is dropped. */
  if (unlink(c->tmp_path) == 0)
    LOG_INFOF("removed an unfinished state write", "path=%s", c->tmp_path);
  if ((rc = coord__state_load(c, err, err_bytes)) != 0)
    goto fail;
  /* Recovered jobs wait for their nodes to re-join and report. */
  for (size_t i = 0; i < c->njobs; i++)
    coord__derive_job(c, c->jobs[i]);
loaded:
  if ((rc = coord__ckpt_init(c, err, err_bytes)) != 0)
    goto fail;
  /* Deleted jobs whose checkpoints a crash kept from moving aside. */
  coord__ckpt_retire_pending(c);
  if (c->njobs != 0)
    LOG_INFOF("recovered jobs", "jobs=%zu next_job_id=%" PRIu64 " path=%s", c->njobs,
              c->next_job_id, c->state_path);

  /* uv_timer_init only fills in the handle; it cannot fail. */
  uv_timer_init(loop, &c->lease_timer);
  uv_timer_init(loop, &c->flush_timer);
  c->open_handles = 2;
  c->lease_timer.data = c;
  c->flush_timer.data = c;
  uint64_t period = (uint64_t)options->lease_ttl_ms / 4;
  if (period > COORD_SWEEP_MAX_MS)
    period = COORD_SWEEP_MAX_MS;
  if (period == 0)
    period = 1;
  uv_timer_start(&c->lease_timer, on_lease_timer, period, period);
  *out = c;
  return 0;
fail:
  for (size_t i = 0; i < c->njobs; i++)
    coord__job_free(c, c->jobs[i]);
  free(c->jobs);
  auth_free(c->auth);
  coord__ckpt_retired_free(c);
  free(c);
  return rc;
}

int coord_register(coord *c, rpc_server *server) {
  int rc = coord__cluster_register(c, server);
  if (rc == 0)
    rc = coord__jobs_register(c, server);
  if (rc == 0)
    rc = coord__bases_register(c, server);
  if (rc == 0)
    rc = coord__locate_register(c, server);
  if (rc == 0)
    rc = coord__kv_register(c, server);
  if (rc != 0)
    return rc;
  /* Health (Check and Watch): SERVING until coord_shutdown. */
  rc = health_register(server, health_services, sizeof health_services / sizeof health_services[0],
                       &c->health);
  if (rc != 0)
    return rc;
  health_set(c->health, 1);
  /* These answer while other clients flood the server (rpc.h). */
  rpc_server_set_priority(server, CTL_HEARTBEAT);
  rpc_server_set_priority(server, CTL_JOIN);
  rpc_server_set_priority(server, CTL_WATCH);
  /* Callers are named as their calls arrive, and counted by that name. */
  rc = rpc_server_set_identify(server, coord__identify, c, c->auth ? auth_count(c->auth) : 0);
  if (rc != 0)
    return rc;
  return coord__ckpt_register(c, server);
}

static void on_timer_closed(uv_handle_t *handle) {
  coord *c = handle->data;
  c->open_handles--;
}

void coord_shutdown(coord *c) {
  if (c == NULL || c->shutting_down)
    return;
  c->shutting_down = 1;
  health_shutdown(c->health);
  for (size_t i = 0; i < c->nmembers; i++)
    coord__watch_end(c->members[i], RPC_UNAVAILABLE, "coordinator shutting down");
  for (size_t i = 0; i < c->njobs; i++)
    coord__kv_waiters_end(c->jobs[i], RPC_UNAVAILABLE, "coordinator shutting down");
  coord__ckpt_shutdown(c);
  uv_close((uv_handle_t *)&c->lease_timer, on_timer_closed);
  uv_close((uv_handle_t *)&c->flush_timer, on_timer_closed);
}

void coord_destroy(coord *c) {
  if (c == NULL)
    return;
  if (c->open_handles != 0)
    LOG_ERRORF("coordinator freed with open timers", "handles=%d", c->open_handles);
  health_free(c->health);
  coord__ckpt_destroy(c);
  for (size_t i = 0; i < c->nmembers; i++)
    coord__member_free(c->members[i]);
  free(c->members);
  for (size_t i = 0; i < c->njobs; i++)
    coord__job_free(c, c->jobs[i]);
  free(c->jobs);
  auth_free(c->auth);
  coord__ckpt_retired_free(c);
  free(c);
}
