"""The manylinux wheel (scripts/wheel.sh) installs into a bare Debian root
holding only python3 and pip, and trains there against a daemon outside it,
bit-identical to the same training through the checkout's package.

The root is made with mmdebstrap (the essential set, python3 and
python3-pip, nothing else: no libprotobuf-c, no numpy), so the wheel must
carry every library libzerod needs beyond glibc; numpy, the package's one
dependency, comes as the host's pip downloads it from PyPI. numpy's
manylinux wheel needs libstdc++ (which the manylinux policies let a wheel
take from the system), so the root holds libstdc++6 too; libzerod itself
needs nothing but glibc and the wheel's own copy of libprotobuf-c, which
the test checks in its ELF header. Needs root
(mmdebstrap's root mode, chroot, a private mount namespace); CI runs as root.
"""

import glob
import os
import shutil
import subprocess
import sys

import pytest

from conftest import start_daemon  # noqa: F401 (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLIBC = {"libc.so.6", "ld-linux-x86-64.so.2", "libm.so.6", "libpthread.so.0", "libdl.so.2",
         "librt.so.1"}
NUMPY = "numpy==2.4.6"  # a wheel for CPython 3.11 (Debian 12's), as scripts/deps.sh pins it

# An AdamW regression: every step gathers the weights, computes the
# gradient of a fixed least-squares problem with numpy and hands it back.
# Prints where zerod, libzerod and libprotobuf-c were loaded from, the loss
# before and after, and the final weights' bytes in hex.
TRAIN = r"""
import math, sys, numpy as np, zerod
socket, job_name = sys.argv[1], sys.argv[2]
# Products by math.fsum (correctly rounded), not BLAS: the wheel's numpy and
# the checkout's link different BLAS builds, whose sums differ in the last
# bits, and the weights of both runs are compared bit for bit.
def matvec(a, v):
    return np.array([math.fsum(float(p) * float(q) for p, q in zip(row, v)) for row in a],
                    dtype=np.float32)
rng = np.random.default_rng(7)
x = rng.standard_normal((64, 16)).astype(np.float32)
y = matvec(x, rng.standard_normal(16).astype(np.float32))
with zerod.Client(socket) as c:
    job = c.attach(job_name, create="fresh",
                   config=zerod.JobConfig(optimizer="adamw", lr=0.05, weight_decay=0.01))
    u = job.register("w", [("w", (16,))], values=np.zeros(16, np.float32))
    for _ in range(25):
        with u.gather() as g:
            w = g.arrays()["w"].copy()
        u.grad_buffer().arrays()["w"][...] = (2.0 / len(x)) * matvec(x.T, matvec(x, w) - y)
        u.reduce()
        job.step()
    final = u.read_state()[0]
    loss = float(np.mean((x @ final - y) ** 2))
    job.detach()
maps = open("/proc/self/maps").read().split()
print(zerod.__file__)
print(sorted({m for m in maps if "libzerod" in m or "libprotobuf-c" in m}))
print(float(np.mean(y ** 2)), loss)
print(final.tobytes().hex())
"""


def need_root_tools():
    if os.geteuid() != 0:
        pytest.skip("mmdebstrap's root mode and chroot need root (CI runs as root)")
    for tool in ("mmdebstrap", "chroot", "unshare"):
        assert shutil.which(tool), "%s not found: scripts/deps.sh test installs it" % tool


def build_tree():
    return os.path.dirname(os.path.abspath(os.environ["ZEROD_BIN_DIR"]))


def make_wheel(out):
    made = subprocess.run([os.path.join(ROOT, "scripts", "wheel.sh"), build_tree()],
                          capture_output=True, text=True, env=dict(os.environ, ZEROD_WHEEL_DIR=str(out)))
    assert made.returncode == 0, made.stdout + made.stderr
    (wheel,) = glob.glob(str(out / "zerod-*-py3-none-manylinux_*_x86_64.whl"))
    return wheel


def needed(library):
    """The DT_NEEDED entries of an ELF shared object, sorted."""
    dynamic = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True)
    return sorted(line.split("[", 1)[1].split("]", 1)[0]
                  for line in dynamic.stdout.splitlines() if "(NEEDED)" in line)


def make_bare_root(path):
    """bookworm's essential set with python3, python3-pip and libstdc++6, as
    the images' root file systems are made (scripts/image_lib.sh)."""
    log = str(path) + ".log"
    made = subprocess.run(
        ["bash", "-c", '. "$0" && mmdebstrap_root bookworm "$1" "$2" "" python3 python3-pip '
         'libstdc++6', os.path.join(ROOT, "scripts", "image_lib.sh"), str(path), log],
        capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]


def in_root(root, daemon_dir, *argv):
    """argv under chroot ROOT with a clean environment, DAEMON_DIR bound at
    /run/zerod and a /proc, in a mount namespace of its own (both gone with
    the process)."""
    script = ('mount --bind "$1" "$2/run/zerod" && mount -t proc proc "$2/proc" && shift 2 && '
              'exec chroot "$@"')
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         str(daemon_dir), str(root), str(root), *argv],
        capture_output=True, text=True, timeout=600,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/root",
             "LANG": "C.UTF-8"})


def test_manylinux_wheel_installs_and_trains_in_a_bare_root(tmp_path, start_daemon):
    need_root_tools()
    wheels = tmp_path / "wheels"
    wheel = make_wheel(wheels)
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                          "--no-deps", "-d", str(wheels), NUMPY], capture_output=True, text=True)
    assert got.returncode == 0, got.stdout + got.stderr

    root = tmp_path / "root"
    make_bare_root(root)
    assert not glob.glob(str(root / "usr/lib/x86_64-linux-gnu/libprotobuf-c*")), "not bare"
    assert not glob.glob(str(root / "usr/lib/python3/dist-packages/numpy")), "not bare"
    (root / "run" / "zerod").mkdir(parents=True, exist_ok=True)
    shutil.copytree(wheels, root / "wheels")

    daemon = start_daemon(ranks=1)
    pip = in_root(root, daemon.dir, "python3", "-m", "pip", "install", "-q",
                  "--break-system-packages", "--root-user-action=ignore", "--no-index",
                  "--find-links", "/wheels", "/wheels/" + os.path.basename(wheel))
    assert pip.returncode == 0, pip.stdout + pip.stderr

    (root / "train.py").write_text(TRAIN)
    bare = in_root(root, daemon.dir, "python3", "/train.py", "/run/zerod/zerod.sock", "bare")
    assert bare.returncode == 0, bare.stdout + bare.stderr + daemon.read_log()
    module, libraries, losses, weights = bare.stdout.splitlines()
    assert module.startswith("/usr/local/lib/python3"), module
    assert "/zerod/lib/libzerod.so" in libraries, libraries
    assert "/zerod.libs/libprotobuf-c-" in libraries, libraries  # the wheel's own copy
    (library,) = glob.glob(str(root / "usr/local/lib/python3*/dist-packages/zerod/lib/libzerod.so"))
    # glibc's, and the wheel's libprotobuf-c under its hashed name
    others = [lib for lib in needed(library) if lib not in GLIBC]
    assert len(others) == 1 and others[0].startswith("libprotobuf-c-"), needed(library)

    # The same training through the checkout's package, on the same daemon.
    (tmp_path / "train.py").write_text(TRAIN)
    here = subprocess.run([sys.executable, str(tmp_path / "train.py"), daemon.socket, "checkout"],
                          capture_output=True, text=True, timeout=600)
    assert here.returncode == 0, here.stdout + here.stderr
    before, after = map(float, losses.split())
    assert after < 0.1 * before, losses  # it trained
    assert weights == here.stdout.splitlines()[3]
