/* filemode: the permissions of the files and directories the daemon
 * writes (checkpoint shard files, manifests, exported safetensors files,
 * the coordinator's state file, and the directories that hold them).
 *
 * One setting for the whole process, like the umask it replaces: set
 * once from --file-mode at startup, before any thread runs, and read from
 * any thread after. The default is 0600 (directories 0700): the daemon
 * runs as root in a container and shares its filesystems with tenants,
 * so nothing is readable by others unless the operator says so.
 *
 * The mode is exact: files and directories are made with it and then
 * fchmod'ed, so that a umask (which only removes bits) cannot change it. */
#ifndef ZEROD_FILEMODE_H
#define ZEROD_FILEMODE_H

#include <sys/types.h>

#define FILEMODE_DEFAULT 0600

/* Parses an octal mode such as "0640". Accepted: permission bits only
 * (no setuid, setgid or sticky), the owner's read and write (the daemon
 * reads back what it writes), and no write for others. Returns 0 or
 * -EINVAL. */
int filemode_parse(const char *text, mode_t *out);
/* Sets the mode (one that filemode_parse accepts). Call before threads. */
void filemode_set(mode_t file_mode);
/* The mode of files (default 0600). */
mode_t filemode_file(void);
/* The mode of directories: the file mode with x wherever it has r, and
 * the owner's rwx (default 0700; 0640 gives 0750). */
mode_t filemode_dir(void);

/* fchmod(fd, the file mode). Returns 0 or a negative errno. */
int filemode_fix_file(int fd);
/* mkdirat(dir_fd, name) with the directory mode, made exact. Returns 0,
 * or a negative errno (-EEXIST if it exists: then it is left as it is). */
int filemode_mkdirat(int dir_fd, const char *name);

#endif /* ZEROD_FILEMODE_H */
