/* bench_ckpt_fs: which filesystem bench_ckpt's files are on, for its
 * report (a tmpfs makes "cold" reads warm). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include "bench_ckpt.h"

const char *fs_name(long type) {
  switch ((unsigned long)type) {
  case 0xEF53:
    return "ext4";
  case 0x58465342:
    return "xfs";
  case 0x9123683E:
    return "btrfs";
  case 0x01021994:
    return "tmpfs";
  case 0x794c7630:
    return "overlayfs";
  case 0x6969:
    return "nfs";
  case 0x2FC12FC1:
    return "zfs";
  case 0xF2F52010:
    return "f2fs";
  case 0x65735546:
    return "fuse";
  default:
    return "other";
  }
}

/* The source of the mount that holds dir (e.g. /dev/vda), from
 * /proc/self/mountinfo, matched by device number. */
void mount_source(const char *dir, char *out, size_t out_bytes) {
  snprintf(out, out_bytes, "?");
  struct stat st;
  FILE *f = fopen("/proc/self/mountinfo", "r");
  if (f == NULL || stat(dir, &st) != 0) {
    if (f != NULL)
      fclose(f);
    return;
  }
  char line[4096], want[32];
  snprintf(want, sizeof want, "%u:%u", major(st.st_dev), minor(st.st_dev));
  while (fgets(line, sizeof line, f) != NULL) {
    char id[32], parent[32], devno[32];
    if (sscanf(line, "%31s %31s %31s", id, parent, devno) != 3 || strcmp(devno, want) != 0)
      continue;
    char *sep = strstr(line, " - ");
    char fstype[64], source[256];
    if (sep != NULL && sscanf(sep + 3, "%63s %255s", fstype, source) == 2) {
      snprintf(out, out_bytes, "%s", source);
      break;
    }
  }
  fclose(f);
}
