#!/usr/bin/env python3
"""Runs a program of an unpacked OCI image the way the image says to.

    oci_exec.py BUNDLE [--env NAME=VALUE]... [-- ARGV...]

BUNDLE is what `umoci unpack` wrote: rootfs/ and the runtime config.json it
derived from the image's config. This applies the parts of config.json that
decide what the program sees of the image, as an OCI runtime would: it
chroots into rootfs, changes to process.cwd, sets process.rlimits and
no_new_privs, drops to process.user (uid, gid, additionalGids; every
capability goes with root) and execs ARGV, or process.args (the image's
Entrypoint + Cmd) when ARGV is empty, with process.env plus the --env
values. Namespaces, cgroups and mounts are not made here: the caller (run_image_test.sh)
runs in its own mount namespace with /proc and /dev mounted in rootfs, and
shares the host's network and IPC, as the manifests' hostIPC pods do.
"""

import ctypes
import json
import os
import resource
import sys

PR_SET_NO_NEW_PRIVS = 38


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    bundle = argv[1]
    rest = argv[2:]
    extra_env = []
    while rest and rest[0] == "--env":
        if len(rest) < 2 or "=" not in rest[1]:
            print("oci_exec.py: --env needs NAME=VALUE", file=sys.stderr)
            return 2
        extra_env.append(rest[1])
        rest = rest[2:]
    if rest and rest[0] == "--":
        rest = rest[1:]

    with open(os.path.join(bundle, "config.json")) as f:
        config = json.load(f)
    process = config["process"]
    args = rest or process["args"]
    env = dict(item.split("=", 1) for item in process.get("env", []) + extra_env)
    user = process["user"]

    for limit in process.get("rlimits", []):
        resource.setrlimit(getattr(resource, limit["type"]), (limit["soft"], limit["hard"]))
    os.chroot(os.path.join(bundle, config["root"]["path"]))
    os.chdir(process.get("cwd", "/"))
    if process.get("noNewPrivileges"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.setgroups(user.get("additionalGids", []))
    os.setgid(user["gid"])
    os.setuid(user["uid"])
    os.execvpe(args[0], args, env)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
