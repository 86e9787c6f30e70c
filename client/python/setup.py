"""Builds the zerod package with libzerod.so inside it.

The Python code calls libzerod (the C client library) through ctypes, so a
wheel carries the library as zerod/lib/libzerod.so, built here with the
repository's CMake project:

- ``ZEROD_CMAKE_BUILD_DIR`` names a configured build tree: its ``zerod``
  target is built (a no-op when it is current) and its library copied. A
  relative path is taken from the repository's root (``ZEROD_SOURCE_DIR``,
  default: the repository this directory belongs to), not from the shell's
  working directory, which pip does not pass on (it runs this script in the
  package's directory): ``ZEROD_CMAKE_BUILD_DIR=build/release pip install
  client/python`` means the checkout's ``build/release``;
- otherwise the project at ``ZEROD_SOURCE_DIR`` (default: the repository
  this directory belongs to) is configured in a build directory of its own
  (``build/cmake`` here) with only what the library needs, and built.

A source tree without the project (a copy of this directory alone) and no
build tree named is an error that says so. The library links the system's
libprotobuf-c, so the wheel built here (tagged py3-none-linux_x86_64: the
Python code is version-independent, the library is not) is for the
distribution it was built on; ``scripts/wheel.sh`` (``make wheel``) repairs
it with auditwheel into a manylinux wheel that carries libprotobuf-c and
needs only glibc.
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:  # setuptools >= 70.1 has its own; before, the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
LIBRARY = "libzerod.so"


def _run(cmd):
    print("zerod: " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def _source_dir() -> Path:
    explicit = os.environ.get("ZEROD_SOURCE_DIR")
    root = Path(explicit) if explicit else HERE.parent.parent
    cmakelists = root / "CMakeLists.txt"
    if not cmakelists.is_file() or "project(zerod" not in cmakelists.read_text():
        raise SystemExit(
            "zerod: building the package needs libzerod from zerod's CMake project, and %s is "
            "not it: set ZEROD_SOURCE_DIR to a zerod checkout, or ZEROD_CMAKE_BUILD_DIR to a "
            "configured build tree" % root)
    return root


def _named_build_tree(tree: str) -> Path:
    """ZEROD_CMAKE_BUILD_DIR as a path, a relative one from the repository's
    root; an error naming both unless it is a configured build tree."""
    build = Path(tree)
    if not build.is_absolute():
        build = _source_dir() / build
    if not (build / "CMakeCache.txt").is_file():
        raise SystemExit(
            "zerod: ZEROD_CMAKE_BUILD_DIR=%s is %s, which is not a configured CMake build tree "
            "(no CMakeCache.txt; a relative path is taken from the repository's root): "
            "configure it first (make, or cmake -S . -B %s), or unset ZEROD_CMAKE_BUILD_DIR"
            % (tree, build, tree))
    return build


def build_library() -> Path:
    """Builds libzerod and returns the path of the shared object."""
    tree = os.environ.get("ZEROD_CMAKE_BUILD_DIR")
    if tree:
        build = _named_build_tree(tree)
    else:
        source = _source_dir()
        build = HERE / "build" / "cmake"
        if not (build / "CMakeCache.txt").exists():
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            _run(["cmake", "-S", source, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release",
                  "-DZEROD_TESTS=OFF", "-DZEROD_BENCH=OFF", "-DZEROD_CUDA=OFF"])
    _run(["cmake", "--build", build, "--target", "zerod-library"])
    library = build / "lib" / LIBRARY
    if not library.exists():
        raise SystemExit("zerod: the build made no %s" % library)
    return library.resolve()


class BuildWithLibrary(build_py):
    """build_py, plus libzerod.so in the package's lib/ directory."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "zerod" / "lib"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(build_library(), target / LIBRARY)


class BinaryDistribution(Distribution):
    """The wheel holds a shared object: platform-specific, not pure Python."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """py3-none-PLATFORM: the package calls the library through ctypes, so
    one wheel serves every Python 3 of its platform, not only the one that
    built it (a cp311-cp311 tag would refuse Python 3.12)."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(cmdclass={"build_py": BuildWithLibrary, "bdist_wheel": PlatformWheel},
      distclass=BinaryDistribution)
