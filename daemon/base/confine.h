/* confine: paths that come from a client, kept inside configured root
 * directories (docs/checkpoints.md, "Where files may be read and written").
 *
 * Two steps, because a check on the text alone is not enough: a symbolic
 * link planted inside a root can point anywhere, and one swapped in after
 * a check (a race) would be followed by a later open(2) of the whole path.
 *
 *  1. confine_locate: on the text, which root holds the path and what is
 *     left of it (its components, normalized). ".." is refused outright,
 *     not resolved: it is never needed to name a file inside a root.
 *  2. confine_open_parent: from a directory descriptor of that root, each
 *     component but the last is opened with openat(O_DIRECTORY |
 *     O_NOFOLLOW), so that no symbolic link on the way is ever followed.
 *     The caller then works on the last component relative to the
 *     descriptor it got (fstatat with AT_SYMLINK_NOFOLLOW, openat with
 *     O_NOFOLLOW, renameat), never on the path again.
 *
 * The roots themselves are trusted (an operator's configuration): they are
 * opened as given, symbolic links in them included. */
#ifndef ZEROD_CONFINE_H
#define ZEROD_CONFINE_H

#include <stddef.h>

/* Which of roots holds path, with the rest of path (its components joined
 * by single '/', without "." or empty components, "" for a root itself)
 * in rel_out. roots are absolute paths without a trailing '/' (except "/"
 * itself), as realpath(3) gives them. An absolute path belongs to the
 * first root it starts with, followed by '/' or its end; a relative path
 * is taken inside roots[0]. Returns the root's index, or:
 *   -EINVAL        path is empty, or nroots is 0 for a relative path
 *   -EPERM         path has a ".." component
 *   -EACCES        path is absolute and inside no root
 *   -ENAMETOOLONG  a component is longer than NAME_MAX, or the rest does
 *                  not fit rel_bytes */
int confine_locate(const char *path, const char *const *roots, unsigned nroots, char *rel_out,
                   size_t rel_bytes);

/* Opens the directory that holds rel's last component, from root_fd,
 * never following a symbolic link: each component before the last is
 * opened with openat(O_DIRECTORY | O_NOFOLLOW). rel is what
 * confine_locate made (no "..", no empty components). On success
 * *dir_fd_out is that directory (O_RDONLY; the caller closes it) and
 * *name_out points at the last component inside rel ("." for rel ""). On
 * failure nothing is open, *bad_len_out (if not NULL) is the length of
 * rel's prefix up to the component that failed, and the return is:
 *   -ELOOP    that component is a symbolic link
 *   -ENOTDIR  it is not a directory
 *   -EPERM    rel has a ".." component (never made by confine_locate)
 *   or openat's negative errno (-ENOENT: it does not exist). */
int confine_open_parent(int root_fd, const char *rel, int *dir_fd_out, const char **name_out,
                        size_t *bad_len_out);

#endif /* ZEROD_CONFINE_H */
