#!/usr/bin/env python3
"""Self-test of scripts/check_cycles.py (ctest layout.cycles_selftest).

Compiles tiny C files into a build tree laid out as CMake lays out zerod's
(BUILD/daemon/CMakeFiles/<target>.dir/<folder>/<file>.c.o) in a temporary
directory, runs the check on it, and pins what it must say: a two-file
cycle and a three-file cycle are reported with the symbols of each edge and
fail the check; a file that only calls into a cycle is not part of it;
--allow turns a folder's cycles into a report that passes; a folder with
calls one way only passes; the object of a source that is gone is skipped;
an empty build directory fails.

Usage: test_check_cycles.py [--cc CC] [--nm NM]
"""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "scripts", "check_cycles.py")

FAILURES = []


def expect(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILURES.append(what)


def build_tree(root, cc, folder, sources):
    """Compiles {name: code} into root/daemon/CMakeFiles/zd_t.dir/folder/."""
    objdir = os.path.join(root, "daemon", "CMakeFiles", "zd_t.dir", folder)
    os.makedirs(objdir, exist_ok=True)
    for name, code in sources.items():
        src = os.path.join(root, name)
        with open(src, "w") as f:
            f.write(code)
        subprocess.run([cc, "-c", "-O0", src, "-o", os.path.join(objdir, name + ".o")],
                       check=True)


def check(root, nm, *extra):
    r = subprocess.run([sys.executable, SCRIPT, root, "--nm", nm, *extra],
                       capture_output=True, text=True)
    print(r.stdout, end="")
    return r.returncode, r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    ap.add_argument("--nm", default=os.environ.get("NM", "nm"))
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="check_cycles.") as tmp:
        # a.c <-> b.c, and c.c calls a.c without being called back.
        two = os.path.join(tmp, "two")
        build_tree(two, args.cc, "pair", {
            "a.c": "int b_up(int);\nint a_down(int x) { return x ? b_up(x - 1) : 0; }\n",
            "b.c": "int a_down(int);\nint b_up(int x) { return a_down(x) + 1; }\n",
            "c.c": "int a_down(int);\nint c_top(void) { return a_down(3); }\n",
        })
        rc, out = check(two, args.nm)
        expect(rc == 1, "a two-file cycle fails the check")
        expect("error: cycle in daemon/pair: a.c -> b.c -> a.c" in out,
               "the two-file cycle is named with its folder and files")
        expect("a.c -> b.c  (b_up)" in out and "b.c -> a.c  (a_down)" in out,
               "each edge of the cycle names the symbol it uses")
        expect(not any("c.c" in line for line in out.splitlines() if "cycle in" in line),
               "a file that only calls into the cycle is not part of it")

        rc, out = check(two, args.nm, "--allow", "daemon/pair")
        expect(rc == 0 and "known pending (--allow): cycle in daemon/pair" in out,
               "--allow reports the folder's cycle and passes")
        rc, out = check(two, args.nm, "--allow", "daemon/nothere")
        expect(rc == 1 and "--allow daemon/nothere: no such folder" in out,
               "--allow of an unknown folder fails")

        # x.c -> y.c -> z.c -> x.c: one three-file cycle.
        three = os.path.join(tmp, "three")
        build_tree(three, args.cc, "ring", {
            "x.c": "void y_f(void);\nvoid x_f(void) { y_f(); }\n",
            "y.c": "void z_f(void);\nvoid y_f(void) { z_f(); }\n",
            "z.c": "void x_f(void);\nvoid z_f(void) { x_f(); }\n",
        })
        rc, out = check(three, args.nm)
        expect(rc == 1 and "cycle in daemon/ring: x.c -> y.c -> z.c -> x.c" in out,
               "a three-file cycle is reported whole")

        # One way only: p.c calls q.c, q.c calls nothing of p.c.
        oneway = os.path.join(tmp, "oneway")
        build_tree(oneway, args.cc, "line", {
            "p.c": "int q_f(void);\nint p_f(void) { return q_f(); }\n",
            "q.c": "static int q_helper(void) { return 1; }\nint q_f(void) { return q_helper(); }\n",
        })
        rc, out = check(oneway, args.nm)
        expect(rc == 0 and "0 cycles" in out, "calls one way only pass")

        # A renamed source leaves its object behind: with the source tree
        # known (CMakeCache.txt), the stale object is skipped, so its
        # symbols make no edge.
        renamed = os.path.join(tmp, "renamed")
        build_tree(renamed, args.cc, "moved", {
            "old.c": "int new_f(void);\nint old_f(void) { return new_f(); }\n",
            "new.c": "int old_f(void);\nint new_f(void) { return 1; }\nint g(void) { return old_f(); }\n",
        })
        srcdir = os.path.join(tmp, "src")
        os.makedirs(os.path.join(srcdir, "daemon", "moved"))
        open(os.path.join(srcdir, "daemon", "moved", "new.c"), "w").close()
        with open(os.path.join(renamed, "CMakeCache.txt"), "w") as f:
            f.write(f"CMAKE_HOME_DIRECTORY:INTERNAL={srcdir}\n")
        rc, out = check(renamed, args.nm)
        expect(rc == 0 and "skipped" in out and "old.c.o: its source is gone" in out,
               "an object whose source is gone is skipped, not read")

        rc, out = check(os.path.join(tmp, "empty"), args.nm)
        expect(rc == 1 and "build first" in out, "a build directory without objects fails")

    if FAILURES:
        print(f"test_check_cycles: {len(FAILURES)} failed")
        return 1
    print("test_check_cycles: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
