/* tier: a rank's optimizer state on disk (tier.h). */
#include "tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "aio.h"
#include "clock.h"
#include "crashpoint.h"
#include "hostmem.h"
#include "device.h"
#include "log.h"

typedef struct rank_tier {
  aio_file *file;
  char path[PATH_MAX];
  char dir[PATH_MAX];
  uint64_t size;  /* bytes given to extents so far */
  unsigned slots; /* buffer_count */
  uint64_t chunk; /* elements per buffer and state */
  int has[JOB_NSTATES];
  unsigned nstates; /* states in an extent: master and the moments */
  float *buffers;   /* slots * nstates * chunk, AIO_ALIGN-aligned */
} rank_tier;

static uint64_t aligned(uint64_t bytes) {
  return (bytes + AIO_ALIGN - 1) / AIO_ALIGN * AIO_ALIGN;
}

int tier_enabled(const job *j) {
  return j->config.offload_device == JOB_OFFLOAD_NVME;
}

uint64_t tier_staging_bytes(const job_config *c) {
  int has[JOB_NSTATES];
  unsigned nstates = (unsigned)job_config_states(c, has);
  return (uint64_t)c->offload_buffer_count * nstates * c->offload_buffer_size * sizeof(float);
}

/* The directory the job's files go in: the job's nvme_path, which must be
 * inside the daemon's --nvme-dir (a relative one is taken inside it), or
 * that directory itself. */
static int tier_root(const job_config *c, const char *root, char *out, size_t out_bytes, char *err,
                     size_t err_bytes) {
  const char *want = c->nvme_path;
  if (root == NULL || root[0] == '\0') {
    snprintf(err, err_bytes, "offload_optimizer nvme: this daemon has no --nvme-dir");
    return -EINVAL;
  }
  if (want[0] == '\0') {
    snprintf(out, out_bytes, "%s", root);
    return 0;
  }
  /* A relative path is inside the directory, not the daemon's working
   * directory. */
  char joined[PATH_MAX];
  if (want[0] != '/') {
    if ((size_t)snprintf(joined, sizeof joined, "%s/%s", root, want) >= sizeof joined) {
      snprintf(err, err_bytes, "offload_optimizer nvme_path %s: path too long", want);
      return -ENAMETOOLONG;
    }
    want = joined;
  }
  char real[PATH_MAX];
  if (realpath(want, real) == NULL) {
    int e = errno;
    snprintf(err, err_bytes, "offload_optimizer nvme_path %s: %s", c->nvme_path, strerror(e));
    return -e;
  }
  size_t n = strlen(root);
  if (strncmp(real, root, n) != 0 || (real[n] != '\0' && real[n] != '/')) {
    snprintf(err, err_bytes, "offload_optimizer nvme_path %s is outside the daemon's --nvme-dir %s",
             c->nvme_path, root);
    return -EPERM;
  }
  snprintf(out, out_bytes, "%s", real);
  return 0;
}

int tier_check(const job_config *c, const char *nvme_dir, char *err, size_t err_bytes) {
  if (c->offload_device != JOB_OFFLOAD_NVME)
    return 0;
  char root[PATH_MAX];
  return tier_root(c, nvme_dir, root, sizeof root, err, err_bytes);
}

static int tier_open(rank_state *rs, const char *nvme_dir, char *err, size_t err_bytes) {
  rank_tier *t = calloc(1, sizeof *t);
  if (t == NULL) {
    snprintf(err, err_bytes, "out of memory");
    return -ENOMEM;
  }
  const job_config *c = &rs->job->config;
  t->nstates = (unsigned)job_config_states(c, t->has);
  t->slots = c->offload_buffer_count;
  t->chunk = c->offload_buffer_size;
  char root[PATH_MAX];
  int rc = tier_root(c, nvme_dir, root, sizeof root, err, err_bytes);
  if (rc == 0 && (snprintf(t->dir, sizeof t->dir, "%s/%s-%llu", root, rs->job->name,
                           (unsigned long long)rs->job->id) >= (int)sizeof t->dir ||
                  snprintf(t->path, sizeof t->path, "%s/rank-%05d.zdtier", t->dir, rs->rank) >=
                      (int)sizeof t->path)) {
    snprintf(err, err_bytes, "offload_optimizer nvme: the path under %s is too long", root);
    rc = -ENAMETOOLONG;
  }
  if (rc == 0 && mkdir(t->dir, 0700) != 0 && errno != EEXIST) {
    rc = -errno;
    snprintf(err, err_bytes, "offload_optimizer nvme: cannot make %s: %s", t->dir, strerror(errno));
  }
  size_t buffer_bytes = (size_t)tier_staging_bytes(c);
  if (rc == 0 && (t->buffers = aligned_alloc(AIO_ALIGN, buffer_bytes)) == NULL) {
    snprintf(err, err_bytes, "offload_optimizer nvme: no memory for %zu bytes of staging buffers",
             buffer_bytes);
    rc = -ENOMEM;
  }
  if (rc == 0)
    rc = aio_file_open(t->path, 0600, t->slots, t->nstates, &t->file, err, err_bytes);
  if (rc != 0) {
    free(t->buffers);
    free(t);
    return rc;
  }
  memset(t->buffers, 0, buffer_bytes);
  rs->tier = t;
  LOG_INFOF("optimizer state on disk",
            "job=%s rank=%d file=%s engine=%s direct=%d buffers=%u "
            "elements=%llu staging_bytes=%zu",
            rs->job->name, rs->rank, t->path, aio_file_engine(t->file), aio_file_direct(t->file),
            t->slots, (unsigned long long)t->chunk, buffer_bytes);
  return 0;
}

int tier_place(rank_state *rs, shard *sh, const unit_layout *l, const char *nvme_dir, char *err,
               size_t err_bytes) {
  int rc = rs->tier == NULL ? tier_open(rs, nvme_dir, err, err_bytes) : 0;
  if (rc != 0)
    return rc;
  rank_tier *t = rs->tier;
  uint64_t stride = aligned(l->shard_numel * sizeof(float));
  uint64_t grown = t->size + stride * t->nstates;
  rc = aio_file_resize(t->file, grown);
  if (rc != 0) {
    snprintf(err, err_bytes, "offload_optimizer nvme: cannot grow %s to %llu bytes: %s", t->path,
             (unsigned long long)grown, strerror(-rc));
    return rc;
  }
  sh->tiered = 1;
  sh->tier_offset = t->size;
  sh->tier_stride = stride;
  t->size = grown;
  rs->tier_bytes += stride * t->nstates;
  return 0;
}

void tier_close(rank_state *rs) {
  rank_tier *t = rs->tier;
  if (t == NULL)
    return;
  aio_file_close(t->file);
  if (unlink(t->path) != 0)
    LOG_WARNF("cannot remove a tier file", "path=%s err=\"%s\"", t->path, strerror(errno));
  (void)rmdir(t->dir); /* the job's last rank here removes it */
  free(t->buffers);
  free(t);
  rs->tier = NULL;
  rs->tier_bytes = 0;
}

/* The index of a state among those an extent holds. */
static unsigned state_index(const rank_tier *t, int state) {
  unsigned k = 0;
  for (int s = 0; s < state; s++)
    k += t->has[s] != 0;
  return k;
}

static float *slot_state(rank_tier *t, unsigned slot, unsigned k) {
  return t->buffers + ((size_t)slot * t->nstates + k) * t->chunk;
}

/* Elements [first, first + count) of a state of a tiered shard (first a
 * multiple of the chunk) through slot 0's first buffer: read into dst, or
 * (dst NULL) written from src (NULL: zeros); dst and src hold that
 * stretch. */
static int state_io(rank_state *rs, const shard *sh, const unit_layout *l, int state,
                    uint64_t first, uint64_t count, float *dst, const float *src) {
  rank_tier *t = rs->tier;
  if (t == NULL || !sh->tiered || state < 0 || state >= JOB_NSTATES || !t->has[state] ||
      first % t->chunk != 0 || first > l->shard_numel || count > l->shard_numel - first)
    return -EINVAL;
  uint64_t base = sh->tier_offset + state_index(t, state) * sh->tier_stride;
  float *buf = slot_state(t, 0, 0);
  for (uint64_t b = first; b < first + count; b += t->chunk) {
    uint64_t n = first + count - b < t->chunk ? first + count - b : t->chunk;
    size_t bytes = aligned(n * sizeof(float));
    uint64_t offset = base + b * sizeof(float);
    int rc;
    if (dst != NULL) {
      rc = aio_file_read(t->file, 0, buf, bytes, offset);
    } else {
      memset(buf, 0, bytes); /* the padding after the last element too */
      if (src != NULL)
        memcpy(buf, src + (b - first), n * sizeof(float));
      rc = aio_file_write(t->file, 0, buf, bytes, offset);
    }
    if (rc == 0)
      rc = aio_file_wait(t->file, 0);
    if (rc != 0)
      return rc;
    if (dst != NULL)
      memcpy(dst + (b - first), buf, n * sizeof(float));
  }
  return 0;
}

int tier_read_state(rank_state *rs, const shard *sh, const unit_layout *l, int state, float *dst) {
  return dst != NULL ? state_io(rs, sh, l, state, 0, l->shard_numel, dst, NULL) : -EINVAL;
}

int tier_write_state(rank_state *rs, const shard *sh, const unit_layout *l, int state,
                     const float *src) {
  return state_io(rs, sh, l, state, 0, l->shard_numel, NULL, src);
}

int tier_write_state_range(rank_state *rs, const shard *sh, const unit_layout *l, int state,
                           uint64_t first, uint64_t count, const float *src) {
  return state_io(rs, sh, l, state, first, count, NULL, src);
}

int tier_chunks(rank_state *rs, uint64_t chunk, int64_t only_unit, tier_chunk **out, size_t *n) {
  size_t cap = 0;
  *out = NULL;
  *n = 0;
  for (uint32_t u = 0; u < rs->nshards; u++) {
    shard *sh = &rs->shards[u];
    if (!shard_has_state(sh) || !(sh->tiered || sh->host_state) ||
        (only_unit >= 0 && (uint32_t)only_unit != u))
      continue;
    uint64_t numel = job_unit(rs->job, u)->shard_numel;
    for (uint64_t b = 0; b < numel; b += chunk) {
      if (*n == cap) {
        cap = cap ? cap * 2 : 64;
        tier_chunk *grown = realloc(*out, cap * sizeof *grown);
        if (grown == NULL) {
          free(*out);
          *out = NULL;
          *n = 0;
          return -ENOMEM;
        }
        *out = grown;
      }
      (*out)[(*n)++] =
          (tier_chunk){.unit = u, .begin = b, .n = numel - b < chunk ? numel - b : chunk};
    }
  }
  return 0;
}

static int queue_io(rank_tier *t, const shard *sh, const tier_chunk *k, unsigned slot, int write) {
  size_t bytes = aligned(k->n * sizeof(float));
  for (unsigned s = 0; s < t->nstates; s++) {
    uint64_t offset = sh->tier_offset + s * sh->tier_stride + k->begin * sizeof(float);
    int rc = write ? aio_file_write(t->file, slot, slot_state(t, slot, s), bytes, offset)
                   : aio_file_read(t->file, slot, slot_state(t, slot, s), bytes, offset);
    if (rc != 0)
      return rc;
  }
  return 0;
}

int tier_stream(rank_state *rs, int64_t only_unit, int write_back, tier_chunk_fn fn, void *arg) {
  rank_tier *t = rs->tier;
  if (t == NULL)
    return 0;
  size_t ntasks;
  tier_chunk *tasks;
  int rc = tier_chunks(rs, t->chunk, only_unit, &tasks, &ntasks);
  if (rc != 0)
    return rc;
  /* Slot i % slots holds chunk i. A chunk's reads go out `ahead` chunks
   * before it is updated; its slot is free again once the write of the
   * chunk before has landed, which is waited for just before the reads
   * (at least one update later). */
  unsigned ahead = t->slots > 2 ? t->slots - 2 : 1;
  double t0 = clock_now_s(), fn_s = 0, wait_s = 0;
  int m1 = t->has[JOB_STATE_MOMENT1], m2 = t->has[JOB_STATE_MOMENT2];
  size_t issued = 0;
  for (size_t i = 0; i < ntasks && rc == 0; i++) {
    while (rc == 0 && issued < ntasks && issued <= i + ahead) {
      unsigned slot = (unsigned)(issued % t->slots);
      rc = aio_file_wait(t->file, slot); /* the slot's last write */
      if (rc == 0)
        rc = queue_io(t, &rs->shards[tasks[issued].unit], &tasks[issued], slot, 0);
      issued++;
    }
    if (rc == 0)
      rc = aio_file_submit(t->file);
    unsigned slot = (unsigned)(i % t->slots);
    double w0 = clock_now_s();
    if (rc == 0)
      rc = aio_file_wait(t->file, slot);
    double w1 = clock_now_s();
    wait_s += w1 - w0;
    if (rc != 0)
      break;
    shard *sh = &rs->shards[tasks[i].unit];
    float *master = slot_state(t, slot, 0);
    float *mom1 = m1 ? slot_state(t, slot, 1) : NULL;
    float *mom2 = m2 ? slot_state(t, slot, (unsigned)(1 + (m1 != 0))) : NULL;
    rc = fn(arg, rs, sh, job_unit(rs->job, tasks[i].unit), tasks[i].begin, tasks[i].n, master, mom1,
            mom2);
    fn_s += clock_now_s() - w1;
    if (rc == 0 && write_back)
      rc = queue_io(t, sh, &tasks[i], slot, 1);
    if (rc == 0)
      rc = aio_file_submit(t->file);
    if (rc == 0 && write_back && i == ntasks / 2 && crash_point_armed("offload-step-midway")) {
      rc = aio_file_wait(t->file, slot);
      crash_point("offload-step-midway");
    }
  }
  /* Everything in flight lands before the buffers are touched again. */
  for (unsigned s = 0; s < t->slots; s++) {
    int wrc = aio_file_wait(t->file, s);
    if (rc == 0)
      rc = wrc;
  }
  free(tasks);
  LOG_DEBUGF("tier streamed",
             "job=%s rank=%d chunks=%zu write_back=%d ms=%.1f work_ms=%.1f wait_ms=%.1f",
             rs->job->name, rs->rank, ntasks, write_back, (clock_now_s() - t0) * 1e3, fn_s * 1e3,
             wait_s * 1e3);
  return rc;
}

/* len bytes from src_fd at src to dst_fd at dst: copy_file_range, and
 * read/write through buf (bytes of room) where it is not supported. */
static int copy_range(int src_fd, uint64_t src, int dst_fd, uint64_t dst, uint64_t len, void *buf,
                      size_t buf_bytes) {
  while (len > 0) {
    loff_t in = (loff_t)src, out = (loff_t)dst;
    ssize_t n = copy_file_range(src_fd, &in, dst_fd, &out, len, 0);
    if (n < 0 && (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP)) {
      n = pread(src_fd, buf, len < buf_bytes ? len : buf_bytes, (off_t)src);
      if (n > 0 && pwrite(dst_fd, buf, (size_t)n, (off_t)dst) != n)
        n = -1;
    }
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return n == 0 ? -EIO : -errno;
    src += (uint64_t)n;
    dst += (uint64_t)n;
    len -= (uint64_t)n;
  }
  return 0;
}

int tier_staging_file(rank_state *rs, const char *nvme_dir) {
  char err[512];
  int rc = rs->tier == NULL ? tier_open(rs, nvme_dir, err, sizeof err) : 0;
  if (rc != 0)
    return rc;
  char path[PATH_MAX];
  if (snprintf(path, sizeof path, "%s/rank-%05d.restore", rs->tier->dir, rs->rank) >=
      (int)sizeof path)
    return -ENAMETOOLONG;
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    return -errno;
  unlink(path);
  return fd;
}

void *tier_snapshot(rank_state *rs, unit_layout *const *units, unsigned n, uint64_t bytes,
                    int *err) {
  rank_tier *t = rs->tier;
  *err = 0;
  char path[PATH_MAX];
  if (t == NULL ||
      snprintf(path, sizeof path, "%s/rank-%05d.snap", t->dir, rs->rank) >= (int)sizeof path) {
    *err = t == NULL ? -EINVAL : -ENAMETOOLONG;
    return NULL;
  }
  /* The tier file is written with O_DIRECT, which keeps the page cache
   * out of date for nothing: a plain descriptor reads what is on disk. */
  int src = open(t->path, O_RDONLY | O_CLOEXEC);
  int dst = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  void *data = NULL;
  int rc = src < 0 || dst < 0 ? -errno : 0;
  if (rc == 0 && ftruncate(dst, (off_t)(HOSTMEM_SHARED_FILE_OFFSET + bytes)) != 0)
    rc = -errno;
  uint64_t at = HOSTMEM_SHARED_FILE_OFFSET;
  size_t room = (size_t)t->slots * t->nstates * t->chunk * sizeof(float);
  for (unsigned k = 0; rc == 0 && k < n; k++) {
    const shard *sh = &rs->shards[units[k]->id];
    uint64_t len = units[k]->shard_numel * sizeof(float);
    for (unsigned s = 0; rc == 0 && s < t->nstates; s++) {
      rc = copy_range(src, sh->tier_offset + s * sh->tier_stride, dst, at, len, t->buffers, room);
      at += len;
    }
  }
  if (rc == 0 && (data = hostmem_shared_map_file(dst, bytes)) == NULL)
    rc = -errno;
  if (src >= 0)
    close(src);
  if (dst >= 0)
    close(dst);
  unlink(path); /* the mapping keeps the pages; the space goes with it */
  *err = rc;
  return data;
}

static int cast_chunk(void *arg, rank_state *rs, shard *sh, const unit_layout *l, uint64_t begin,
                      uint64_t n, float *master, float *m1, float *m2) {
  (void)arg;
  (void)l;
  (void)m1;
  (void)m2;
  zk_dtype w = rs->job->config.working_dtype;
  return device_cast(rs->dev, (uint8_t *)sh->working + begin * zk_dtype_size(w), w, master, ZK_F32,
                     n);
}

int tier_refresh_working(rank_state *rs, const unit_layout *l, shard *sh) {
  return tier_stream(rs, (int64_t)l->id, 0, cast_chunk, NULL);
}

/* Whether name is a file this module makes: rank-<digits>.zdtier, a
 * save's copy (.snap) or a restore's staging (.restore). */
static int tier_file_name(const char *name) {
  if (strncmp(name, "rank-", 5) != 0)
    return 0;
  const char *p = name + 5;
  while (*p >= '0' && *p <= '9')
    p++;
  return p > name + 5 &&
         (strcmp(p, ".zdtier") == 0 || strcmp(p, ".snap") == 0 || strcmp(p, ".restore") == 0);
}

void tier_sweep(const char *root) {
  DIR *top = opendir(root);
  if (top == NULL)
    return;
  unsigned files = 0;
  uint64_t bytes = 0;
  struct dirent *e;
  while ((e = readdir(top)) != NULL) {
    if (e->d_name[0] == '.' || strchr(e->d_name, '-') == NULL)
      continue;
    char dir[PATH_MAX];
    if (snprintf(dir, sizeof dir, "%s/%s", root, e->d_name) >= (int)sizeof dir)
      continue;
    DIR *d = opendir(dir);
    if (d == NULL)
      continue;
    struct dirent *f;
    while ((f = readdir(d)) != NULL) {
      char path[PATH_MAX];
      struct stat st;
      if (!tier_file_name(f->d_name) ||
          snprintf(path, sizeof path, "%s/%s", dir, f->d_name) >= (int)sizeof path ||
          lstat(path, &st) != 0 || !S_ISREG(st.st_mode))
        continue;
      if (unlink(path) == 0) {
        files++;
        bytes += (uint64_t)st.st_blocks * 512;
      }
    }
    closedir(d);
    (void)rmdir(dir); /* only if that emptied it */
  }
  closedir(top);
  if (files > 0)
    LOG_INFOF("removed optimizer state files a daemon that died left", "dir=%s files=%u bytes=%llu",
              root, files, (unsigned long long)bytes);
}
