"""Fixtures that run real zerod daemons and workers.

ZEROD_BIN_DIR (set by ctest) names the build's bin/ directory with zerod and
the example workers. Each daemon gets its own temporary state directory and
socket; at teardown it is stopped with SIGTERM and must exit 0 without a
sanitizer report.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
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
    def __init__(self, tmp_path, ranks, timeout_s, extra, mode="standalone", env=None):
        self.dir = tmp_path / ("zerod-%d" % time.monotonic_ns())
        self.dir.mkdir()
        self.socket = str(self.dir / "zerod.sock")
        self.log_path = self.dir / "zerod.log"
        self.args = [binary("zerod"), mode, "--ranks", str(ranks), "--dir", str(self.dir),
                     "--collective-timeout", str(timeout_s), "--threads-per-rank", "1"] + extra
        self.env = None if env is None else {**os.environ, **env}
        self.start()

    def start(self):
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.args, stderr=self.log, env=self.env)
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

    def kill(self):
        """SIGKILL: nothing is cleaned up (the socket file stays)."""
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def restart(self):
        """SIGKILL, then the same command on the same directory (its state
        and checkpoints), as a node that crashed and came back; the log
        goes on in the same file."""
        self.kill()
        os.unlink(self.socket)
        self.start()

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
        if self.log.closed:
            return  # killed
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

    def start(ranks=1, timeout_s=10, extra=(), env=None):
        d = Daemon(tmp_path, ranks, timeout_s, list(extra), env=env)
        daemons.append(d)
        return d

    yield start
    stop_all(daemons)


def stop_all(processes):
    """Stops every process in order, even when one fails its checks (a
    crashed daemon must not leave the others running), and then raises the
    first failure."""
    failures = []
    for p in processes:
        try:
            p.stop()
        except Exception as e:  # noqa: BLE001 - reported after the others stop
            failures.append(e)
    if failures:
        raise failures[0]


def wait_for(what, predicate, timeout_s=30):
    """Polls predicate every 50 ms until it returns something true, and
    returns that; fails naming what it waited for after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def run_worker(args, timeout=300, check=True):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError("%s exited %d\nstdout:\n%s\nstderr:\n%s" % (
            " ".join(args), proc.returncode, proc.stdout, proc.stderr))
    return proc


def free_port():
    """A TCP port that was free a moment ago (for a coordinator that must
    come back on the same address after a restart)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Coordinator:
    """A real `zerod coordinator` on loopback with its own state directory.

    The first start listens on a free port (127.0.0.1:0, read back from the
    log); restarts keep that port, so clients and nodes find it again. Each
    start has its own log file; read_log() reads the current one."""

    def __init__(self, tmp_path, lease_ttl_s=2.0, state_dir=None, extra=(), port=0):
        self.dir = tmp_path / ("coordinator-%d" % time.monotonic_ns())
        self.dir.mkdir()
        self.state_dir = state_dir or self.dir / "state"
        self.lease_ttl_s = lease_ttl_s
        self.extra = list(extra)
        self.port = port
        self.address = None
        self.logs = []
        self.proc = None
        self.start()

    def start(self):
        log_path = self.dir / ("coordinator-%d.log" % len(self.logs))
        self.logs.append(log_path)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [binary("zerod"), "coordinator", "--listen", "127.0.0.1:%d" % self.port,
             "--state-dir", str(self.state_dir), "--lease-ttl", str(self.lease_ttl_s)]
            + self.extra,
            stderr=self.log)
        deadline = time.monotonic() + 30
        while True:
            m = re.search(r'msg="coordinator listening" address=127\.0\.0\.1:(\d+)',
                          self.read_log())
            if m:
                self.port = int(m.group(1))
                self.address = "127.0.0.1:%d" % self.port
                return
            if self.proc.poll() is not None:
                raise AssertionError("coordinator exited %d early:\n%s" % (
                    self.proc.returncode, self.read_log()))
            if time.monotonic() > deadline:
                raise AssertionError("coordinator did not start:\n" + self.read_log())
            time.sleep(0.02)

    def read_log(self):
        self.log.flush()
        return self.logs[-1].read_text()

    def kill(self):
        """SIGKILL: no chance to clean up, like a crash."""
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def stop(self):
        """SIGTERM (unless it already exited): it must exit 0 with no
        sanitizer report."""
        if self.log.closed:
            return  # killed
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("coordinator did not stop on SIGTERM:\n" + self.read_log())
        self.log.close()
        log = self.logs[-1].read_text()
        for report in ("AddressSanitizer", "LeakSanitizer", "runtime error"):
            assert report not in log, log
        assert self.proc.returncode == 0, "coordinator exited %d:\n%s" % (
            self.proc.returncode, log)


@pytest.fixture
def cluster(tmp_path):
    """Starts a coordinator and node daemons; stops them all at teardown
    (nodes first, so that they leave cleanly)."""

    class Cluster:
        def __init__(self):
            self.coordinator = None
            self.nodes = []

        def start_coordinator(self, lease_ttl_s=2.0, extra=(), port=0):
            self.coordinator = Coordinator(tmp_path, lease_ttl_s, extra=extra, port=port)
            return self.coordinator

        def start_node(self, name, ranks=1, timeout_s=20, extra=()):
            # In-memory copies (docs/redundancy.md) on tmpfs, one
            # directory per node and test: node names repeat across tests.
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
            replicas = tempfile.mkdtemp(prefix="zerod-test-%s-" % name, dir=shm)
            self.replica_dirs.append(replicas)
            d = Daemon(tmp_path, ranks, timeout_s,
                       ["--coordinator", self.coordinator.address, "--name", name,
                        "--replica-dir", replicas] + list(extra), mode="node")
            d.name = name
            d.replica_dir = replicas
            self.nodes.append(d)
            return d

    c = Cluster()
    c.replica_dirs = []
    yield c
    try:
        stop_all(c.nodes + ([c.coordinator] if c.coordinator is not None else []))
    finally:
        for path in c.replica_dirs:  # a node killed leaves its own
            shutil.rmtree(path, ignore_errors=True)
