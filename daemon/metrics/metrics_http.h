/* metrics_http: a registry served over HTTP for Prometheus (GET /metrics),
 * by libmicrohttpd on threads of its own.
 *
 * A scrape asks the loop to run the registry's collectors (metrics.h) and
 * waits for them, at most a second (a busy loop then leaves the collected
 * values one scrape old), renders the registry and answers. The process's
 * own figures (process_resident_memory_bytes, process_cpu_seconds_total,
 * process_open_fds, process_start_time_seconds; the names every
 * Prometheus client library uses) are refreshed on each scrape too.
 *
 * Start and stop on the loop thread. */
#ifndef ZEROD_METRICS_HTTP_H
#define ZEROD_METRICS_HTTP_H

#include <stddef.h>
#include <uv.h>

#include "metrics.h"

typedef struct metrics_http metrics_http;

/* Serves m on addr (HOST:PORT, [V6]:PORT or :PORT for every address; port
 * 0 picks a free one, returned in *port). 0, or a negative errno with the
 * reason in err. */
int metrics_http_start(uv_loop_t *loop, metrics *m, const char *addr, metrics_http **out, int *port,
                       char *err, size_t err_bytes);
/* Stops serving (scrapes in progress are answered first) and frees h once
 * its loop handle is closed. */
void metrics_http_stop(metrics_http *h);

#endif /* ZEROD_METRICS_HTTP_H */
