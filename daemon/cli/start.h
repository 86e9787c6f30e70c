/* start: what both of zerod's modes do as they start: process settings
 * from the flags, the directories they name, the probe and metrics
 * listeners. Included by mode_node.c and mode_coordinator.c. Runs on the
 * main thread, before and as the loop starts. */
#ifndef ZEROD_START_H
#define ZEROD_START_H

#include <stddef.h>
#include <uv.h>

#include "coord.h"
#include "flags.h"
#include "health.h"
#include "metrics.h"
#include "metrics_http.h"
#include "rpc.h"

/* --log-level and --log-format (or their variables), before anything is
 * logged. 0, or 2 with the error printed. */
int start_log(const flag_table *t, const flag_given *given);

/* --file-mode (or ZEROD_FILE_MODE): set for the whole process, before
 * anything is written. 0, or 2 with the error printed. */
int start_file_mode(const flag_table *t, const flag_given *given);

/* --export-root, repeated, else its variable (directories separated by
 * ':'): directories that exist, made canonical, into co. 0, or the exit
 * status with the error printed. */
int start_export_roots(const flag_table *t, const flag_given *flags, coord_options *co);

/* The checkpoint directory: v (the flag, else its variable), else
 * fallback/checkpoints; created, made absolute, into out. 0, or the exit
 * status with the error printed. */
int start_checkpoint_dir(const char *v, const char *fallback, char *out, size_t out_bytes);

/* Takes the state directory's lock file (one process per directory) and
 * writes our pid into it. 0, or -1 with the error printed. */
int start_lock_state_dir(const char *lock_path, const char *dir, int *fd_out);

/* Raises the soft limit on open files to the hard one: a daemon's
 * connections and buffers each hold a descriptor. */
void start_raise_fd_limit(void);

/* Catches SIGINT and SIGTERM on loop with cb, data on both handles. 0,
 * or a libuv error with neither handle open (only the first init can
 * fail: it makes the loop's signal pipe; a failed start closes both). */
int start_stop_signals(uv_loop_t *loop, uv_signal_t *sigint, uv_signal_t *sigterm, uv_signal_cb cb,
                       void *data);

/* --health-listen: a server of its own that serves grpc.health.v1 alone,
 * on loop, not yet serving. 0, or 1 with the reason on stderr; on failure
 * *server may still need its shutdown. */
int start_health_listener(uv_loop_t *loop, const char *addr, const char *const *services,
                          size_t nservices, rpc_server **server, health **h, int *port);

/* --metrics-listen: a registry (with zerod_build_info) served over HTTP
 * on loop. Nothing when addr is NULL or empty. 0, or 1 with the reason
 * on stderr. */
int start_metrics(uv_loop_t *loop, const char *addr, const char *mode, metrics **m,
                  metrics_http **http);

#endif /* ZEROD_START_H */
