"""Fixtures that run real zerod daemons and workers.

ZEROD_BIN_DIR (set by ctest) names the build's bin/ directory with zerod and
the example workers. Each daemon gets its own temporary state directory and
socket; at teardown it is stopped with SIGTERM and must exit 0 without a
sanitizer report.
"""

import os
import signal
import subprocess
import time

import pytest

BIN = os.environ.get("ZEROD_BIN_DIR", os.path.join(os.path.dirname(__file__),
                                                   "../../build/release/bin"))


def binary(name):
    path = os.path.join(BIN, name)
    if not os.path.exists(path):
        pytest.fail("%s not built (ZEROD_BIN_DIR=%s)" % (name, BIN))
    return path


class Daemon:
    def __init__(self, tmp_path, ranks, timeout_s, extra):
        self.dir = tmp_path / ("zerod-%d" % time.monotonic_ns())
        self.dir.mkdir()
        self.socket = str(self.dir / "zerod.sock")
        self.log_path = self.dir / "zerod.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [binary("zerod"), "standalone", "--ranks", str(ranks), "--dir", str(self.dir),
             "--collective-timeout", str(timeout_s), "--threads-per-rank", "1"] + extra,
            stderr=self.log)
        deadline = time.monotonic() + 20
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise AssertionError("zerod exited early:\n" + self.read_log())
            if time.monotonic() > deadline:
                raise AssertionError("zerod did not create its socket:\n" + self.read_log())
            time.sleep(0.02)

    def read_log(self):
        self.log.flush()
        return self.log_path.read_text()

    def alive(self):
        return self.proc.poll() is None

    def memfds(self, job):
        """Names of the daemon's memfd descriptors that belong to `job`."""
        names = []
        fd_dir = "/proc/%d/fd" % self.proc.pid
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith("/memfd:zerod-%s-" % job):
                names.append(target)
        return names

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("zerod did not stop on SIGTERM:\n" + self.read_log())
        self.log.close()
        log = self.log_path.read_text()
        assert "AddressSanitizer" not in log and "runtime error" not in log, log
        assert self.proc.returncode == 0, "zerod exited %d:\n%s" % (self.proc.returncode, log)
        assert not os.path.exists(self.socket), "socket file left behind"


@pytest.fixture
def start_daemon(tmp_path):
    daemons = []

    def start(ranks=1, timeout_s=10, extra=()):
        d = Daemon(tmp_path, ranks, timeout_s, list(extra))
        daemons.append(d)
        return d

    yield start
    for d in daemons:
        d.stop()


def run_worker(args, timeout=300, check=True):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError("%s exited %d\nstdout:\n%s\nstderr:\n%s" % (
            " ".join(args), proc.returncode, proc.stdout, proc.stderr))
    return proc
