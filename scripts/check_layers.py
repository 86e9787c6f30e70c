#!/usr/bin/env python3
"""Checks the daemon's layering (docs/architecture.md, "Layers").

Every `#include "x.h"` in daemon/ is resolved to the folder that holds x.h
(headers outside daemon/, such as frame.h, zk.h or the generated protobuf
headers, are not daemon folders and are left alone). The check fails when:

  - a folder includes a header of a folder it may not depend on (the
    allowed edges are ALLOWED below: each folder lists the folders it may
    include from, directly);
  - the folders' include graph has a cycle (implied by the above, but
    checked on its own so that a wrong ALLOWED table cannot hide one);
  - two modules include each other's headers, directly or through a longer
    chain, inside or across folders (x.c, x.h and a private x_impl.h are
    one module);
  - a header name is found in two folders (includes would be ambiguous);
  - main.c is included by anything, or a folder includes the binary's.

Run from anywhere: `scripts/check_layers.py [--graph]`. It prints what it
checked and exits 1 with one line per violation.
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "daemon")

# folder -> the folders its files may include headers from (besides its own).
ALLOWED = {
    "base": set(),
    "rpc": {"base"},
    "metrics": {"base"},
    "model": set(),
    "ckpt": {"model", "base", "rpc"},
    "backend": {"base", "rpc"},
    "rank": {"backend", "ckpt", "model", "metrics", "base", "rpc"},
    "coord": {"ckpt", "model", "metrics", "rpc", "base"},
    "node": {"rank", "coord", "backend", "ckpt", "model", "metrics", "rpc", "base"},
    # the binary: main.c, and cli/, its command lines and modes
    "cli": {"node", "rank", "coord", "backend", "ckpt", "model", "metrics", "rpc", "base"},
    ".": {"cli", "node", "rank", "coord", "backend", "ckpt", "model", "metrics", "rpc", "base"},
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def sources():
    for folder, _, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        for f in files:
            if f.endswith((".c", ".h", ".cc")):
                yield rel, f


def module(name):
    """The module a file belongs to: x.c and x.h are module x, and so is a
    private header x_impl.h shared by x's files."""
    stem = os.path.splitext(name)[0]
    return stem[: -len("_impl")] if stem.endswith("_impl") else stem


def find_cycle(graph):
    """Returns one cycle of the directed graph as a list of nodes, or None."""
    state = {}
    stack = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def main():
    files = list(sources())
    owner = {}
    errors = []
    for folder, f in files:
        if f.endswith(".h"):
            if f in owner and owner[f] != folder:
                errors.append(f"header {f} is in both {owner[f]}/ and {folder}/")
            owner[f] = folder

    folder_graph = {}
    module_graph = {}
    nincludes = 0
    for folder, f in files:
        text = open(os.path.join(ROOT, folder, f), encoding="utf-8").read()
        me = (folder, module(f))
        module_graph.setdefault(me, set())
        for inc in INCLUDE.findall(text):
            base = os.path.basename(inc)
            if base not in owner or inc != base:
                continue  # not a daemon header (proto, kernels, generated)
            nincludes += 1
            target = owner[base]
            if target != folder:
                folder_graph.setdefault(folder, set()).add(target)
                if target not in ALLOWED.get(folder, set()):
                    errors.append(f"{folder}/{f} includes {target}/{base}: "
                                  f"{folder}/ may include only from "
                                  f"{', '.join(sorted(ALLOWED.get(folder, ()))) or 'itself'}")
            them = (target, module(base))
            if them != me:
                module_graph[me].add(them)

    cycle = find_cycle(folder_graph)
    if cycle:
        errors.append("folder cycle: " + " -> ".join(cycle))
    cycle = find_cycle(module_graph)
    if cycle:
        errors.append("module cycle: " + " -> ".join(f"{d}/{m}" for d, m in cycle))

    if "--graph" in sys.argv:
        for folder in sorted(folder_graph):
            print(f"{folder} -> {', '.join(sorted(folder_graph[folder]))}")
    print(f"check_layers: {len(files)} files, {nincludes} includes of daemon headers, "
          f"{len(folder_graph)} folders with outside includes")
    for e in errors:
        print("check_layers: " + e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
