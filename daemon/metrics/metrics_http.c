/* /metrics over HTTP with libmicrohttpd (metrics_http.h). */
#include "metrics_http.h"

#include <dirent.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "log.h"

/* A scrape waits this long for the loop to run the collectors. */
#define COLLECT_WAIT_MS 1000

struct metrics_http {
  uv_loop_t *loop;
  metrics *registry;
  struct MHD_Daemon *daemon;
  uv_async_t async; /* a scrape asks the loop to collect */

  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint64_t requested, collected; /* collection rounds asked for and done */
  int stopping;

  /* process_* */
  metric_series *resident, *virtual_bytes, *cpu, *fds, *max_fds, *start_time;
  double start_time_s;
};

/* ---- process_* ------------------------------------------------------------- */

static metric_series *process_gauge(metrics *m, metric_type type, const char *name,
                                    const char *help) {
  return metric_series_get(metrics_family(m, type, name, help, NULL, NULL, 0), NULL);
}

/* The process's start, in seconds since the epoch, from /proc/self/stat's
 * start time in clock ticks after boot and the boot time in /proc/stat. */
static double process_start_time(void) {
  double boot = 0, ticks = (double)sysconf(_SC_CLK_TCK);
  unsigned long long start = 0;
  FILE *f = fopen("/proc/stat", "r");
  if (f != NULL) {
    char line[256];
    while (fgets(line, sizeof line, f) != NULL)
      if (sscanf(line, "btime %lf", &boot) == 1)
        break;
    fclose(f);
  }
  f = fopen("/proc/self/stat", "r");
  if (f != NULL) {
    char buf[1024];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    /* Field 22 (starttime), counted after the command's closing ')'. */
    const char *p = strrchr(buf, ')');
    for (int field = 2; p != NULL && field < 22; field++)
      p = strchr(p + 1, ' ');
    if (p != NULL)
      start = strtoull(p + 1, NULL, 10);
  }
  return ticks > 0 ? boot + (double)start / ticks : boot;
}

static void process_update(metrics_http *h) {
  long page = sysconf(_SC_PAGESIZE);
  unsigned long long size = 0, resident = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (f != NULL) {
    if (fscanf(f, "%llu %llu", &size, &resident) != 2)
      size = resident = 0;
    fclose(f);
  }
  metric_set(h->resident, (double)resident * (double)page);
  metric_set(h->virtual_bytes, (double)size * (double)page);
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) == 0)
    metric_set(h->cpu, (double)ru.ru_utime.tv_sec + (double)ru.ru_stime.tv_sec +
                           ((double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_usec) * 1e-6);
  int fds = 0;
  DIR *d = opendir("/proc/self/fd");
  if (d != NULL) {
    while (readdir(d) != NULL)
      fds++;
    closedir(d);
    fds -= 3; /* ".", ".." and the directory's own descriptor */
  }
  metric_set(h->fds, fds);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0)
    metric_set(h->max_fds, (double)rl.rlim_cur);
  metric_set(h->start_time, h->start_time_s);
}

/* ---- Scrapes ---------------------------------------------------------------- */

/* Loop thread: run the collectors for every scrape waiting. */
static void on_collect(uv_async_t *async) {
  metrics_http *h = async->data;
  pthread_mutex_lock(&h->mutex);
  uint64_t round = h->requested;
  pthread_mutex_unlock(&h->mutex);
  metrics_collect(h->registry);
  pthread_mutex_lock(&h->mutex);
  h->collected = round;
  pthread_cond_broadcast(&h->cond);
  pthread_mutex_unlock(&h->mutex);
}

/* A scrape's thread: ask the loop to collect and wait for it. */
static void collect_on_loop(metrics_http *h) {
  struct timespec deadline = clock_deadline_ms(COLLECT_WAIT_MS);
  pthread_mutex_lock(&h->mutex);
  if (!h->stopping) {
    uint64_t round = ++h->requested;
    uv_async_send(&h->async);
    while (h->collected < round && !h->stopping)
      if (pthread_cond_timedwait(&h->cond, &h->mutex, &deadline) == ETIMEDOUT)
        break;
  }
  pthread_mutex_unlock(&h->mutex);
}

static enum MHD_Result answer_text(struct MHD_Connection *c, unsigned status, const char *text) {
  struct MHD_Response *r =
      MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_MUST_COPY);
  if (r == NULL)
    return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; charset=utf-8");
  if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
    MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  enum MHD_Result rc = MHD_queue_response(c, status, r);
  MHD_destroy_response(r);
  return rc;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_bytes, void **state) {
  (void)version;
  (void)upload_data;
  metrics_http *h = cls;
  /* The first call for a request comes with its headers only: answer on
   * the next, once any body (refused below) has been seen. */
  if (*state == NULL) {
    *state = h;
    return MHD_YES;
  }
  if (*upload_bytes != 0) {
    *upload_bytes = 0; /* no body is wanted: dropped, then refused */
    return MHD_YES;
  }
  if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
    return answer_text(c, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET and HEAD are served\n");
  if (strcmp(url, "/") == 0)
    return answer_text(c, MHD_HTTP_OK, "zerod: Prometheus metrics are at /metrics\n");
  if (strcmp(url, "/metrics") != 0)
    return answer_text(c, MHD_HTTP_NOT_FOUND, "not found: the metrics are at /metrics\n");

  collect_on_loop(h);
  process_update(h);
  char *text;
  size_t len;
  if (metrics_render(h->registry, &text, &len) != 0)
    return answer_text(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
  struct MHD_Response *r = MHD_create_response_from_buffer_with_free_callback(len, text, free);
  if (r == NULL) {
    free(text);
    return MHD_NO;
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                          "text/plain; version=0.0.4; charset=utf-8");
  enum MHD_Result rc = MHD_queue_response(c, MHD_HTTP_OK, r);
  MHD_destroy_response(r);
  return rc;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
  (void)cls;
  char line[512];
  vsnprintf(line, sizeof line, fmt, ap);
  size_t n = strlen(line);
  while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
    line[--n] = '\0';
  char quoted[600];
  LOG_WARNF("metrics server", "err=%s", log_quote(line, quoted, sizeof quoted));
}

/* ---- Start and stop ---------------------------------------------------------- */

/* HOST:PORT, [V6]:PORT or :PORT into an address to bind. */
static int resolve(const char *addr, struct sockaddr_storage *out, socklen_t *out_len, char *err,
                   size_t err_bytes) {
  const char *colon = strrchr(addr, ':');
  if (colon == NULL || colon[1] == '\0') {
    snprintf(err, err_bytes, "'%s' is not HOST:PORT", addr);
    return -EINVAL;
  }
  char host[256];
  size_t host_len = (size_t)(colon - addr);
  if (host_len >= sizeof host) {
    snprintf(err, err_bytes, "host name too long");
    return -EINVAL;
  }
  memcpy(host, addr, host_len);
  host[host_len] = '\0';
  if (host_len >= 2 && host[0] == '[' && host[host_len - 1] == ']') {
    memmove(host, host + 1, host_len - 2);
    host[host_len - 2] = '\0';
  }
  char *end;
  long port = strtol(colon + 1, &end, 10);
  if (*end != '\0' || port < 0 || port > 65535) {
    snprintf(err, err_bytes, "bad port in '%s'", addr);
    return -EINVAL;
  }
  struct addrinfo hints = {
      .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
  struct addrinfo *res = NULL;
  int rc = getaddrinfo(host[0] != '\0' ? host : NULL, colon + 1, &hints, &res);
  if (rc != 0 || res == NULL) {
    snprintf(err, err_bytes, "cannot resolve '%s': %s", host, gai_strerror(rc));
    return -EINVAL;
  }
  memcpy(out, res->ai_addr, res->ai_addrlen);
  *out_len = res->ai_addrlen;
  freeaddrinfo(res);
  return 0;
}

int metrics_http_start(uv_loop_t *loop, metrics *m, const char *addr, metrics_http **out, int *port,
                       char *err, size_t err_bytes) {
  *out = NULL;
  err[0] = '\0';
  struct sockaddr_storage sa;
  socklen_t sa_len;
  int rc = resolve(addr, &sa, &sa_len, err, err_bytes);
  if (rc != 0)
    return rc;
  metrics_http *h = calloc(1, sizeof *h);
  if (h == NULL)
    return -ENOMEM;
  h->loop = loop;
  h->registry = m;
  pthread_mutex_init(&h->mutex, NULL);
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&h->cond, &attr);
  pthread_condattr_destroy(&attr);
  h->resident = process_gauge(m, METRIC_GAUGE, "process_resident_memory_bytes",
                              "Resident memory size in bytes.");
  h->virtual_bytes = process_gauge(m, METRIC_GAUGE, "process_virtual_memory_bytes",
                                   "Virtual memory size in bytes.");
  h->cpu = process_gauge(m, METRIC_COUNTER, "process_cpu_seconds_total",
                         "Total user and system CPU time spent in seconds.");
  h->fds = process_gauge(m, METRIC_GAUGE, "process_open_fds", "Number of open file descriptors.");
  h->max_fds =
      process_gauge(m, METRIC_GAUGE, "process_max_fds", "Maximum number of open file descriptors.");
  h->start_time = process_gauge(m, METRIC_GAUGE, "process_start_time_seconds",
                                "Start time of the process since unix epoch in seconds.");
  h->start_time_s = process_start_time();

  rc = uv_async_init(loop, &h->async, on_collect);
  if (rc != 0) {
    snprintf(err, err_bytes, "%s", uv_strerror(rc));
    pthread_mutex_destroy(&h->mutex);
    pthread_cond_destroy(&h->cond);
    free(h);
    return rc;
  }
  h->async.data = h;
  /* A thread per connection: a scrape may wait for the loop, and a
   * Prometheus server keeps one connection per target. */
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                   MHD_USE_ERROR_LOG | (sa.ss_family == AF_INET6 ? MHD_USE_IPv6 : 0);
  /* The logger first: options before it would log through MHD's own. */
  h->daemon = MHD_start_daemon(flags, 0, NULL, NULL, on_request, h, MHD_OPTION_EXTERNAL_LOGGER,
                               on_mhd_log, NULL, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                               MHD_OPTION_CONNECTION_LIMIT, 32u, MHD_OPTION_CONNECTION_TIMEOUT, 30u,
                               MHD_OPTION_END);
  if (h->daemon == NULL) {
    snprintf(err, err_bytes, "cannot listen on %s (in use, or not an address of this host?)", addr);
    metrics_http_stop(h);
    return -EADDRINUSE;
  }
  const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_BIND_PORT);
  *port = info != NULL ? info->port : 0;
  *out = h;
  return 0;
}

static void on_closed(uv_handle_t *handle) {
  metrics_http *h = handle->data;
  metric_series_put(h->resident);
  metric_series_put(h->virtual_bytes);
  metric_series_put(h->cpu);
  metric_series_put(h->fds);
  metric_series_put(h->max_fds);
  metric_series_put(h->start_time);
  pthread_mutex_destroy(&h->mutex);
  pthread_cond_destroy(&h->cond);
  free(h);
}

void metrics_http_stop(metrics_http *h) {
  if (h == NULL)
    return;
  pthread_mutex_lock(&h->mutex);
  h->stopping = 1;
  pthread_cond_broadcast(&h->cond);
  pthread_mutex_unlock(&h->mutex);
  /* Joins the server's threads: nothing sends to the async handle after. */
  if (h->daemon != NULL)
    MHD_stop_daemon(h->daemon);
  h->daemon = NULL;
  uv_close((uv_handle_t *)&h->async, on_closed);
}
