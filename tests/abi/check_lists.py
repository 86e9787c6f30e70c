"""The lists the ABI rests on agree with each other and with the library
(the test abi.exports; docs/client.md, "ABI policy"):

- the functions zerod.h declares ZD_API, the symbols the version script
  (client/libzerod.map) lists, and the functions the built libzerod.so
  exports (nm -D --defined-only) are the same set, each exported under a
  version node of the map, the first of which is ZEROD_<ABI>;
- the library's SONAME is libzerod.so.<ABI>, and the Python bindings
  declare that ABI;
- the structs the ABI check lets grow at their end (client/abi/
  libzerod.abignore) are exactly the structs of zerod.h whose first field is
  struct_size: a struct without it is never let through.

    check_lists.py SOURCE_DIR LIBRARY ABI_VERSION
"""

import re
import subprocess
import sys
from pathlib import Path


def fail(message: str) -> None:
    print("FAIL: " + message, file=sys.stderr)
    sys.exit(1)


def same(what: str, left_name: str, left: set, right_name: str, right: set) -> None:
    if left != right:
        fail("%s: only in %s: %s; only in %s: %s" % (
            what, left_name, sorted(left - right) or "-", right_name, sorted(right - left) or "-"))


def header_functions(header: str) -> set:
    return set(re.findall(r"^ZD_API\b[^(]*?\b(zd_\w+)\s*\(", header, re.M))


def sized_structs(header: str) -> set:
    return set(re.findall(r"^typedef struct (zd_\w+) \{\n\s*size_t struct_size;", header, re.M))


def map_nodes(text: str) -> list:
    """[(node, [symbols])] of a version script, in order."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    nodes = []
    for node, body in re.findall(r"(\w[\w.]*)\s*\{(.*?)\}\s*[\w.]*\s*;", text, re.S):
        globals_part = body.split("local:")[0].replace("global:", "")
        nodes.append((node, [s.strip() for s in globals_part.split(";") if s.strip()]))
    return nodes


def main() -> None:
    source, library, abi = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    header = (source / "client/include/zerod.h").read_text()
    declared = header_functions(header)
    if len(declared) < 30:
        fail("found only %d ZD_API functions in zerod.h: the pattern no longer matches" %
             len(declared))

    nodes = map_nodes((source / "client/libzerod.map").read_text())
    if not nodes or nodes[0][0] != "ZEROD_" + abi:
        fail("client/libzerod.map's first version node is %s, not ZEROD_%s" %
             (nodes[0][0] if nodes else "missing", abi))
    listed = {symbol: node for node, symbols in nodes for symbol in symbols}
    same("exported functions", "zerod.h (ZD_API)", declared, "client/libzerod.map", set(listed))

    nm = subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True, text=True,
                        check=True).stdout
    exported = {}
    for line in nm.splitlines():
        fields = line.split()
        if len(fields) != 3 or fields[1] == "A":  # "A": the version nodes themselves
            continue
        name, _, version = fields[2].partition("@@")
        exported[name] = version
    same("exported functions", "client/libzerod.map", set(listed), library, set(exported))
    for name, version in sorted(exported.items()):
        if version != listed[name]:
            fail("%s is exported as %s@@%s, the map puts it in %s" %
                 (name, name, version or "(no version)", listed[name]))

    readelf = subprocess.run(["readelf", "-d", library], capture_output=True, text=True,
                             check=True, env={"LC_ALL": "C"}).stdout
    soname = re.search(r"\(SONAME\).*\[(.*)\]", readelf)
    if soname is None or soname.group(1) != "libzerod.so." + abi:
        fail("%s's SONAME is %s, not libzerod.so.%s" %
             (library, soname.group(1) if soname else "missing", abi))
    python_abi = re.search(r"^ABI_VERSION = (\d+)$",
                           (source / "client/python/zerod/_lib.py").read_text(), re.M)
    if python_abi is None or python_abi.group(1) != abi:
        fail("client/python/zerod/_lib.py declares ABI_VERSION %s, not %s" %
             (python_abi.group(1) if python_abi else "nothing", abi))

    sized = sized_structs(header)
    if len(sized) < 10:
        fail("found only %d structs with struct_size in zerod.h: the pattern no longer matches" %
             len(sized))
    suppressions = (source / "client/abi/libzerod.abignore").read_text()
    allowed = re.search(r"^\s*name_regexp = \^\(([\w|]+)\)\$$", suppressions, re.M)
    if allowed is None:
        fail("client/abi/libzerod.abignore has no name_regexp = ^(a|b|...)$ line")
    same("structs that may grow at their end", "zerod.h (struct_size first)", sized,
         "client/abi/libzerod.abignore", set(allowed.group(1).split("|")))
    print("ok: %d functions in zerod.h, the map and %s (ZEROD_%s, SONAME libzerod.so.%s); "
          "%d sized structs in zerod.h and the suppressions" %
          (len(declared), library, abi, abi, len(sized)))


if __name__ == "__main__":
    main()
