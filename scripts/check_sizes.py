#!/usr/bin/env python3
"""check_sizes.py: no source file over its line limit, no C function over
150 lines (docs/architecture.md, "Layout").

    scripts/check_sizes.py [ROOT]

Limits: C and C++ under daemon/, client/, kernels/ and proto/ (benchmarks
and generated code aside): 900 lines a file, 150 a function. The unit
tests' C (tests/unit/): 900 lines a file (a test's function may be long).
Python under client/python/zerod/torch/: 500 lines a module. Prints every
file and function over its limit and exits 1 if there is one.

A C function is found by its shape in this project's clang-format style:
a line at column 0 that ends a declarator with `{` (not a struct, union,
enum or initializer), up to the next line that is `}` alone. That is
exactly how .clang-format lays functions out, so nothing is missed.
"""

import os
import re
import sys

C_DIRS = ("daemon", "client", "kernels", "proto")
C_EXT = (".c", ".cc", ".cu", ".h")
FILE_LIMIT = 900
FUNCTION_LIMIT = 150
TEST_DIR = os.path.join("tests", "unit")
PY_DIR = os.path.join("client", "python", "zerod", "torch")
PY_LIMIT = 500

START = re.compile(r"^(?!typedef|struct|union|enum|static const|const )[A-Za-z_].*\)\s*(const\s*)?\{$")


def c_files(root):
    for top in C_DIRS:
        for path, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [d for d in dirs if d not in ("python", "build")]
            for name in sorted(files):
                if name.endswith(C_EXT) and ".pb-c." not in name:
                    yield os.path.join(path, name)


def long_functions(lines):
    """(name, first line, length) of every function over the limit."""
    found, start, name = [], None, None
    for i, line in enumerate(lines):
        if start is None and START.match(line) and "=" not in line.split("(")[0]:
            start = i
            name = re.findall(r"([A-Za-z_]\w*)\s*\(", line)[0:1] or ["?"]
            name = name[0]
        elif start is not None and line.rstrip() == "}":
            length = i - start + 1
            if length > FUNCTION_LIMIT:
                found.append((name, start + 1, length))
            start = None
        elif start is not None and START.match(line):
            start, name = i, (re.findall(r"([A-Za-z_]\w*)\s*\(", line) or ["?"])[0]
    return found


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    problems = []
    for path in c_files(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        rel = os.path.relpath(path, root)
        if len(lines) - 1 > FILE_LIMIT:
            problems.append("%s: %d lines (limit %d)" % (rel, len(lines) - 1, FILE_LIMIT))
        for name, line, length in long_functions(lines):
            problems.append("%s:%d: %s is %d lines (limit %d)" %
                            (rel, line, name, length, FUNCTION_LIMIT))
    test_dir = os.path.join(root, TEST_DIR)
    for name in sorted(os.listdir(test_dir)) if os.path.isdir(test_dir) else []:
        if name.endswith(C_EXT):
            with open(os.path.join(test_dir, name), encoding="utf-8", errors="replace") as f:
                count = len(f.read().split("\n")) - 1
            if count > FILE_LIMIT:
                problems.append("%s: %d lines (limit %d)" %
                                (os.path.join(TEST_DIR, name), count, FILE_LIMIT))
    py_dir = os.path.join(root, PY_DIR)
    for name in sorted(os.listdir(py_dir)) if os.path.isdir(py_dir) else []:
        if name.endswith(".py"):
            with open(os.path.join(py_dir, name), encoding="utf-8") as f:
                count = len(f.read().split("\n")) - 1
            if count > PY_LIMIT:
                problems.append("%s: %d lines (limit %d)" %
                                (os.path.join(PY_DIR, name), count, PY_LIMIT))
    for p in problems:
        print(p)
    if problems:
        print("check_sizes: %d over their limits" % len(problems))
        return 1
    print("check_sizes: every file and function within its limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
