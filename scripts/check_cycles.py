#!/usr/bin/env python3
"""Checks that no two files of a folder call each other, from the built objects.

scripts/check_layers.py reads #include lines, and a prototype declared in a
header of the wrong file hides a call from it. This check reads what the
linker sees instead: for every object file that CMake built from a source
under daemon/, client/, kernels/ or proto/ (BUILD/<top>/CMakeFiles/<target>.dir/
<path>.o), `nm` lists the global symbols it defines and the ones it leaves
undefined. Inside one source folder (daemon/node, daemon/rank, client, ...),
file A depends on file B when A uses a symbol that B defines. The check fails
when that graph has a cycle (a file that is called by another calls back into
it, directly or through a chain), and lists every cycle it finds with the
symbols of each edge. Folders are checked on their own: calls across folders
are the layering's business (check_layers.py).

Usage: check_cycles.py BUILD_DIR [--allow FOLDER]... [--nm NM] [--graph]

--allow FOLDER (e.g. daemon/coord) reports that folder's cycles but does not
fail on them; it exists for folders whose split is still under way, and the
goal is to pass none. --graph prints every folder's file graph.
It prints what it checked and exits 1 with one paragraph per cycle.
"""
import argparse
import os
import subprocess
import sys

# Where CMake puts the objects of the sources under each of these folders.
TOPS = ("daemon", "client", "kernels", "proto")

# Most cycles listed per folder: a tangled folder has exponentially many.
MAX_CYCLES_PER_FOLDER = 100


def source_root(build):
    """The source tree the build directory was configured from (its
    CMakeCache.txt), or None (not a CMake build directory)."""
    try:
        with open(os.path.join(build, "CMakeCache.txt"), encoding="utf-8") as f:
            for line in f:
                if line.startswith("CMAKE_HOME_DIRECTORY:"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return None


def objects(build, stale):
    """Yields (folder, file, object path) for every object built from a
    source under one of TOPS; folder is the source's folder relative to the
    repository (daemon/node), file its name (ipc.c). A source compiled into
    two targets appears once per target. The build system leaves the
    object of a source that was removed or renamed behind: when the source
    tree is known, an object whose source is in neither it nor the build
    directory (generated sources) is skipped and appended to stale."""
    root = source_root(build)
    for top in TOPS:
        cmakefiles = os.path.join(build, top, "CMakeFiles")
        if not os.path.isdir(cmakefiles):
            continue
        for target in sorted(os.listdir(cmakefiles)):
            if not target.endswith(".dir"):
                continue
            tdir = os.path.join(cmakefiles, target)
            for dirpath, _, files in os.walk(tdir):
                rel = os.path.relpath(dirpath, tdir)
                if "__" in rel.split(os.sep):
                    continue  # a source from outside this top folder
                for f in sorted(files):
                    if not f.endswith(".o"):
                        continue
                    src = f[: -len(".o")]
                    folder = top if rel == "." else os.path.join(top, rel)
                    if root is not None and not any(
                            os.path.exists(os.path.join(base, folder, src))
                            for base in (root, build)):
                        stale.append(os.path.join(dirpath, f))
                        continue
                    yield folder.replace(os.sep, "/"), src, os.path.join(dirpath, f)


def nm_symbols(nm, path):
    """(defined, undefined) global symbol names of one object file."""
    out = subprocess.run([nm, "-g", "--format=posix", path], check=True,
                         capture_output=True, text=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2 or line.endswith(":"):
            continue
        name, kind = parts[0], parts[1]
        if kind in ("U", "w", "v"):
            undefined.add(name)  # weak undefined (w, v) is a use too
        else:
            defined.add(name)
    return defined, undefined


def strongly_connected(graph):
    """Tarjan's algorithm: the graph's strongly connected components."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def simple_cycles(graph, nodes, limit):
    """Every elementary cycle among nodes (one strongly connected component),
    each once, starting at its smallest node; at most limit of them."""
    cycles = []
    order = sorted(nodes)
    for i, start in enumerate(order):
        allowed = set(order[i:])
        path = [start]

        def walk(v):
            for w in sorted(graph.get(v, ())):
                if len(cycles) >= limit:
                    return
                if w == start:
                    cycles.append(path + [start])
                elif w in allowed and w not in path:
                    path.append(w)
                    walk(w)
                    path.pop()

        walk(start)
        if len(cycles) >= limit:
            break
    return cycles


def folder_graphs(build, nm):
    """folder -> (graph, edge symbols): graph maps each file to the files of
    its folder it uses; symbols[(a, b)] the names a uses from b."""
    defs, uses = {}, {}
    nobjects = 0
    stale = []
    for folder, src, path in objects(build, stale):
        nobjects += 1
        d, u = nm_symbols(nm, path)
        defs.setdefault(folder, {}).setdefault(src, set()).update(d)
        uses.setdefault(folder, {}).setdefault(src, set()).update(u)
    result = {}
    for folder in sorted(defs):
        definer = {}
        for src, names in defs[folder].items():
            for name in names:
                definer.setdefault(name, set()).add(src)
        graph = {src: set() for src in defs[folder]}
        symbols = {}
        for src, names in uses[folder].items():
            for name in names:
                for other in definer.get(name, ()):
                    if other != src:
                        graph[src].add(other)
                        symbols.setdefault((src, other), set()).add(name)
        result[folder] = (graph, symbols)
    return result, nobjects, stale


def describe(cycle, symbols):
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        names = sorted(symbols[(a, b)])
        shown = ", ".join(names[:4]) + (f", +{len(names) - 4}" if len(names) > 4 else "")
        steps.append(f"    {a} -> {b}  ({shown})")
    return steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", help="the CMake build directory (build/release)")
    ap.add_argument("--allow", action="append", default=[], metavar="FOLDER",
                    help="report FOLDER's cycles without failing (e.g. daemon/coord)")
    ap.add_argument("--nm", default=os.environ.get("NM", "nm"))
    ap.add_argument("--graph", action="store_true", help="print every folder's file graph")
    args = ap.parse_args(argv)

    graphs, nobjects, stale = folder_graphs(args.build, args.nm)
    for path in stale:
        print(f"check_cycles: skipped {path}: its source is gone (a stale object)")
    if nobjects == 0:
        print(f"check_cycles: no objects under {args.build}/{{{','.join(TOPS)}}}/CMakeFiles: "
              "build first")
        return 1

    failed, pending = 0, 0
    nedges = 0
    for folder, (graph, symbols) in graphs.items():
        nedges += sum(len(v) for v in graph.values())
        if args.graph:
            for src in sorted(graph):
                if graph[src]:
                    print(f"{folder}/{src} -> {', '.join(sorted(graph[src]))}")
        for comp in strongly_connected(graph):
            if len(comp) < 2:
                continue
            cycles = simple_cycles(graph, comp, MAX_CYCLES_PER_FOLDER)
            allowed = folder in args.allow
            tag = "known pending (--allow)" if allowed else "error"
            for cycle in cycles:
                print(f"check_cycles: {tag}: cycle in {folder}: {' -> '.join(cycle)}")
                for line in describe(cycle, symbols):
                    print(line)
            if len(cycles) >= MAX_CYCLES_PER_FOLDER:
                print(f"check_cycles: {folder}: more cycles among {', '.join(comp)} not listed")
            if allowed:
                pending += len(cycles)
            else:
                failed += len(cycles)

    unknown = [f for f in args.allow if f not in graphs]
    for f in unknown:
        print(f"check_cycles: --allow {f}: no such folder among the objects")
    print(f"check_cycles: {nobjects} objects, {len(graphs)} folders, {nedges} file edges; "
          f"{failed} cycles, {pending} in allowed folders")
    return 1 if failed or unknown else 0


if __name__ == "__main__":
    sys.exit(main())
