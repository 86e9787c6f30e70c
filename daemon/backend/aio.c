/* aio: asynchronous file reads and writes (aio.h), on io_uring or, where
 * the kernel refuses it, on pread/pwrite. */
#include "aio.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct aio_request {
  int in_use;
  int write;
  unsigned slot;
  uint8_t *buf;
  size_t bytes;
  uint64_t offset;
} aio_request;

typedef struct aio_slot {
  unsigned pending;
  int error;
} aio_slot;

struct aio_file {
  int fd;
  int direct;
  int uring_ok;
  struct io_uring ring;
  unsigned queued; /* prepared, not yet submitted */
  unsigned nslots;
  aio_slot *slots;
  unsigned nrequests;
  aio_request *requests;
};

/* The rest of a transfer the kernel cut short, or the whole of it without
 * io_uring: plain pread/pwrite until done. */
static int transfer(int fd, int write, uint8_t *buf, size_t bytes, uint64_t offset) {
  while (bytes > 0) {
    ssize_t n =
        write ? pwrite(fd, buf, bytes, (off_t)offset) : pread(fd, buf, bytes, (off_t)offset);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return -errno;
    if (n == 0)
      return -EIO; /* a read past the end: the file is shorter than its extents */
    buf += n;
    bytes -= (size_t)n;
    offset += (uint64_t)n;
  }
  return 0;
}

int aio_file_open(const char *path, unsigned mode, unsigned slots, unsigned per_slot,
                  aio_file **out, char *err, size_t err_bytes) {
  *out = NULL;
  aio_file *f = calloc(1, sizeof *f);
  if (f == NULL || slots == 0 || per_slot == 0) {
    free(f);
    snprintf(err, err_bytes, "out of memory");
    return -ENOMEM;
  }
  f->fd = -1;
  f->nslots = slots;
  f->nrequests = slots * per_slot;
  f->slots = calloc(slots, sizeof *f->slots);
  f->requests = calloc(f->nrequests, sizeof *f->requests);
  if (f->slots == NULL || f->requests == NULL) {
    aio_file_close(f);
    snprintf(err, err_bytes, "out of memory");
    return -ENOMEM;
  }
  f->fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, mode ? mode : 0600);
  f->direct = f->fd >= 0;
  if (f->fd < 0 && errno == EINVAL) /* a filesystem without O_DIRECT (tmpfs) */
    f->fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, mode ? mode : 0600);
  if (f->fd < 0) {
    int e = errno;
    snprintf(err, err_bytes, "cannot open %s: %s", path, strerror(e));
    aio_file_close(f);
    return -e;
  }
  unsigned entries = 1;
  while (entries < f->nrequests)
    entries *= 2;
  const char *engine = getenv("ZEROD_AIO_ENGINE"); /* "pread": never io_uring */
  f->uring_ok = (engine == NULL || strcmp(engine, "pread") != 0) &&
                io_uring_queue_init(entries, &f->ring, 0) == 0;
  *out = f;
  return 0;
}

const char *aio_file_engine(const aio_file *f) {
  return f->uring_ok ? "io_uring" : "pread";
}

int aio_file_direct(const aio_file *f) {
  return f->direct;
}

int aio_file_resize(aio_file *f, uint64_t bytes) {
  /* Growing allocates the blocks now, in one piece where the filesystem
   * can (extents written later in interleaved order would be scattered
   * and read back slowly), and a full disk fails here, not in a step. */
  struct stat st;
  if (fstat(f->fd, &st) != 0)
    return -errno;
  if ((uint64_t)st.st_size < bytes) {
    int rc = fallocate(f->fd, 0, st.st_size, (off_t)(bytes - (uint64_t)st.st_size));
    if (rc == 0)
      return 0;
    if (errno != EOPNOTSUPP)
      return -errno;
  }
  return ftruncate(f->fd, (off_t)bytes) == 0 ? 0 : -errno;
}

static aio_request *free_request(aio_file *f) {
  for (unsigned i = 0; i < f->nrequests; i++)
    if (!f->requests[i].in_use)
      return &f->requests[i];
  return NULL;
}

/* Takes one completion off the ring (waiting for it) and books it. */
static int reap_one(aio_file *f) {
  struct io_uring_cqe *cqe;
  int rc = io_uring_wait_cqe(&f->ring, &cqe);
  if (rc < 0)
    return rc;
  aio_request *r = &f->requests[io_uring_cqe_get_data64(cqe)];
  int res = cqe->res;
  io_uring_cqe_seen(&f->ring, cqe);
  int error = 0;
  if (res < 0)
    error = res;
  else if ((size_t)res < r->bytes) /* cut short: the rest, synchronously */
    error =
        transfer(f->fd, r->write, r->buf + res, r->bytes - (size_t)res, r->offset + (uint64_t)res);
  aio_slot *s = &f->slots[r->slot];
  if (error != 0 && s->error == 0)
    s->error = error;
  s->pending--;
  r->in_use = 0;
  return 0;
}

int aio_file_submit(aio_file *f) {
  if (!f->uring_ok || f->queued == 0)
    return 0;
  int rc = io_uring_submit(&f->ring);
  if (rc < 0)
    return rc;
  f->queued = 0;
  return 0;
}

static int queue(aio_file *f, unsigned slot, int write, void *buf, size_t bytes, uint64_t offset) {
  if (slot >= f->nslots)
    return -EINVAL;
  if (f->direct &&
      ((uintptr_t)buf % AIO_ALIGN != 0 || bytes % AIO_ALIGN != 0 || offset % AIO_ALIGN != 0))
    return -EINVAL;
  aio_slot *s = &f->slots[slot];
  if (!f->uring_ok) {
    int rc = transfer(f->fd, write, buf, bytes, offset);
    if (rc != 0 && s->error == 0)
      s->error = rc;
    return 0;
  }
  aio_request *r = free_request(f);
  while (r == NULL) { /* every request in flight: wait for one */
    int rc = aio_file_submit(f);
    if (rc == 0)
      rc = reap_one(f);
    if (rc != 0)
      return rc;
    r = free_request(f);
  }
  struct io_uring_sqe *sqe = io_uring_get_sqe(&f->ring);
  if (sqe == NULL) {
    int rc = aio_file_submit(f);
    if (rc != 0)
      return rc;
    sqe = io_uring_get_sqe(&f->ring);
    if (sqe == NULL)
      return -EBUSY;
  }
  *r = (aio_request){
      .in_use = 1, .write = write, .slot = slot, .buf = buf, .bytes = bytes, .offset = offset};
  if (write)
    io_uring_prep_write(sqe, f->fd, buf, (unsigned)bytes, offset);
  else
    io_uring_prep_read(sqe, f->fd, buf, (unsigned)bytes, offset);
  io_uring_sqe_set_data64(sqe, (uint64_t)(r - f->requests));
  s->pending++;
  f->queued++;
  return 0;
}

int aio_file_read(aio_file *f, unsigned slot, void *buf, size_t bytes, uint64_t offset) {
  return queue(f, slot, 0, buf, bytes, offset);
}

int aio_file_write(aio_file *f, unsigned slot, const void *buf, size_t bytes, uint64_t offset) {
  return queue(f, slot, 1, (void *)buf, bytes, offset);
}

int aio_file_wait(aio_file *f, unsigned slot) {
  if (slot >= f->nslots)
    return -EINVAL;
  aio_slot *s = &f->slots[slot];
  int rc = aio_file_submit(f);
  while (rc == 0 && s->pending > 0)
    rc = reap_one(f);
  if (rc != 0)
    return rc;
  int error = s->error;
  s->error = 0;
  return error;
}

void aio_file_close(aio_file *f) {
  if (f == NULL)
    return;
  if (f->uring_ok) {
    for (unsigned s = 0; s < f->nslots; s++)
      (void)aio_file_wait(f, s);
    io_uring_queue_exit(&f->ring);
  }
  if (f->fd >= 0)
    close(f->fd);
  free(f->slots);
  free(f->requests);
  free(f);
}
