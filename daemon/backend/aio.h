/* aio: asynchronous reads and writes of one file at given offsets, for the
 * offload tier (rank/tier.c): a step reads the next chunk of optimizer
 * state while it updates this one and writes the last one back.
 *
 * io_uring (liburing) where the kernel allows it; where it does not (a
 * container's seccomp profile may forbid io_setup/io_uring_setup), every
 * request is done at once with pread/pwrite, which is correct and only
 * slower (ZEROD_AIO_ENGINE=pread in the environment chooses it). The file
 * is opened with O_DIRECT where its filesystem takes it
 * (not tmpfs): the page cache then holds none of it, so the memory a job
 * uses stays its staging buffers. With O_DIRECT, offsets, sizes and buffer
 * addresses must be multiples of AIO_ALIGN; callers keep to that always.
 *
 * Requests belong to slots (0..slots-1, a caller's buffer each): a slot's
 * requests are waited for together. Not thread-safe: one thread (a rank's
 * executor) uses a file. */
#ifndef ZEROD_AIO_H
#define ZEROD_AIO_H

#include <stddef.h>
#include <stdint.h>

#define AIO_ALIGN 4096u

typedef struct aio_file aio_file;

/* Opens (creating, mode 0600 unless mode says otherwise) path for reading
 * and writing, with room for slots slots of at most per_slot requests in
 * flight each. Returns 0 or a negative errno with err set. */
int aio_file_open(const char *path, unsigned mode, unsigned slots, unsigned per_slot,
                  aio_file **out, char *err, size_t err_bytes);

/* "io_uring" or "pread" (the fallback), and whether O_DIRECT is on. */
const char *aio_file_engine(const aio_file *f);
int aio_file_direct(const aio_file *f);

/* Sets the file's size; growing allocates the blocks (fallocate: -ENOSPC
 * now rather than at a write) and reads back zeros. */
int aio_file_resize(aio_file *f, uint64_t bytes);

/* Queues a read into, or a write from, buf of bytes at offset for slot. It
 * goes to the kernel at the next aio_file_submit or aio_file_wait (or at
 * once, without io_uring). Returns 0 or a negative errno (the request was
 * not queued). buf must stay until the slot is waited for. */
int aio_file_read(aio_file *f, unsigned slot, void *buf, size_t bytes, uint64_t offset);
int aio_file_write(aio_file *f, unsigned slot, const void *buf, size_t bytes, uint64_t offset);

/* Hands the queued requests to the kernel. Returns 0 or a negative errno. */
int aio_file_submit(aio_file *f);

/* Waits until every request of slot is done. Returns 0, or the first
 * error of the slot's requests (-EIO for one that moved fewer bytes than
 * asked, even after a retry of the rest), which clears it. */
int aio_file_wait(aio_file *f, unsigned slot);

/* Waits for what is in flight, closes. */
void aio_file_close(aio_file *f);

#endif /* ZEROD_AIO_H */
