/* names.h: the one copy of the name rules of zerod's protocols, shared by
 * the daemon (the coordinator's decoders, the node's flags, the IPC frame
 * checks) and the clients (zerodctl), which do not link each other.
 *
 * A name (node, job, tenant, checkpoint) is 1..ZD_NAME_MAX_BYTES bytes of
 * [A-Za-z0-9._-] (control.proto). A checkpoint's name also does not start
 * with '.' and holds none of the coordinator's marks of unfinished saves
 * and deletes (".tmp-", ".deleting-"; docs/checkpoints.md). A job's
 * directory name is a name other than "." and "..". Header only. */
#ifndef ZEROD_PROTO_NAMES_H
#define ZEROD_PROTO_NAMES_H

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#define ZD_NAME_MAX_BYTES 64

static inline bool zd_name_char(char ch) {
  return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
         ch == '.' || ch == '_' || ch == '-';
}

static inline bool zd_valid_name(const char *s) {
  if (s == NULL || s[0] == '\0')
    return false;
  size_t len = 0;
  for (; s[len] != '\0'; len++)
    if (!zd_name_char(s[len]) || len >= ZD_NAME_MAX_BYTES)
      return false;
  return true;
}

static inline bool zd_valid_checkpoint_name(const char *s) {
  return zd_valid_name(s) && s[0] != '.' && strstr(s, ".tmp-") == NULL &&
         strstr(s, ".deleting-") == NULL;
}

static inline bool zd_valid_job_dir_name(const char *s) {
  return zd_valid_name(s) && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

#endif /* ZEROD_PROTO_NAMES_H */
