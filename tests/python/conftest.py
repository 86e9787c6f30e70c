"""Fixtures of the Python client tests: the real-daemon fixtures of
tests/integration (loaded under another module name), and the paths the
worker processes need."""

import importlib.util
import json
import os
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "zerod_integration_fixtures", os.path.join(HERE, "..", "integration", "conftest.py"))
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)

start_daemon = fixtures.start_daemon
cluster = fixtures.cluster
binary = fixtures.binary
run_worker = fixtures.run_worker
wait_for = fixtures.wait_for

PACKAGE_DIR = os.path.join(HERE, "..", "..", "client", "python")


def worker_env():
    """The environment a worker process needs to import zerod and find
    libzerod and the test models."""
    env = dict(os.environ)
    paths = [PACKAGE_DIR, HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def python():
    return sys.executable


def ctl(c, *args, check=True):
    """zerodctl against cluster c's coordinator; with check, it must
    succeed."""
    proc = subprocess.run([binary("zerodctl"), "-c", c.coordinator.address] + list(args),
                          capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, "zerodctl %s: %s%s" % (" ".join(args), proc.stdout,
                                                              proc.stderr)
    return proc


def job(c, name):
    """`zerodctl jobs get NAME --json` of cluster c."""
    return json.loads(ctl(c, "jobs", "get", name, "--json").stdout)


def run_threads(*targets, timeout_s=120):
    """Calls each target on a thread of its own, all at once (the ranks of a
    job in one process, each with its own client); waits for them and fails
    with every exception they raised."""
    errors = []

    def one(target):
        try:
            target()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert not any(t.is_alive() for t in threads), "a thread is still running"
    assert not errors, errors
