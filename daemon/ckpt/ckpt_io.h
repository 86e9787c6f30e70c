/* ckpt_io: small helpers shared by the files of the checkpoint format
 * library (daemon/ckpt/, and private to it): error messages and paths
 * (whole reads and writes are base/fsutil.h's). Implemented in ckpt_io.c. */
#ifndef ZEROD_CKPT_IO_H
#define ZEROD_CKPT_IO_H

#include <stddef.h>
#include <stdint.h>

/* Writes the message into err (if any) and returns rc. */
__attribute__((format(printf, 4, 5))) int ckpt_fail(char *err, size_t err_bytes, int rc,
                                                    const char *fmt, ...);
/* Puts "prefix: " in front of the message already in err. */
void ckpt_prefix_error(char *err, size_t err_bytes, const char *prefix);
/* The part of path after its last '/', for messages. */
const char *ckpt_base_name(const char *path);
/* dir + "/" + file, malloc'd (NULL: out of memory). */
char *ckpt_join_path(const char *dir, const char *file);

#endif /* ZEROD_CKPT_IO_H */
