"""The emulated network (scripts/netcluster.py, issue 39) stays working: a
coordinator and node-a in one network namespace, node-b in another, linked
through a shaped veth pair (1 Gbit/s each way, 198.18.0.0/15 addresses), a
job on both nodes trained by a worker in each node's namespace, bit for bit
against the reference that the loopback cluster matches too
(test_cluster.py). Not timed. Skips where namespaces cannot be made (not
root, no veth or tbf)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import binary, run_worker

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import netcluster  # noqa: E402

MODEL = ["--hidden", "128", "--batch", "48", "--steps", "20", "--log-every", "5"]
TOKEN = "netns-test-token"
PORT = 7171


def wait(what, predicate, logs, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting for %s\n%s" % (
        what, "\n".join(p.read_text()[-3000:] for p in logs if p.exists())))


def test_two_nodes_in_namespaces_train_like_one_process(tmp_path):
    why = netcluster.available()
    if why is not None:
        pytest.skip(why)
    with netcluster.NetCluster(nodes=2, rate="1gbit") as net:
        coord = "%s:%d" % (net.address(0), PORT)
        logs = [tmp_path / "coordinator.log", tmp_path / "node-a.log", tmp_path / "node-b.log"]
        net.popen(0, [binary("zerod"), "coordinator", "--listen", coord, "--insecure",
                      "--state-dir", str(tmp_path / "state")], stderr=open(logs[0], "w"))
        sockets, replica_dirs = [], []
        for i, name in enumerate(("node-a", "node-b")):
            d = tmp_path / name
            d.mkdir()
            replica_dirs.append(tempfile.mkdtemp(prefix="zerod-netns-", dir="/dev/shm"))
            sockets.append(str(d / "zerod.sock"))
            net.popen(i, [binary("zerod"), "node", "--ranks", "1", "--dir", str(d),
                          "--coordinator", coord, "--insecure", "--name", name,
                          "--comm-host", net.address(i), "--replica-dir", replica_dirs[-1]],
                      stderr=open(logs[i + 1], "w"))

        def ctl(*args):
            return net.run(0, [binary("zerodctl"), "-c", coord, "--insecure"] + list(args),
                           capture_output=True, text=True, timeout=60)

        try:
            wait("two members", lambda: ctl("members").stdout.count("node-") >= 2, logs, 30)
            made = ctl("jobs", "create", "mlp", "--nodes", "2", "--token", TOKEN)
            assert made.returncode == 0, made.stderr
            wait("the job", lambda: "state: ready" in ctl("jobs", "get", "mlp").stdout, logs)
            dump = tmp_path / "netns.bin"
            procs = []
            for i in range(2):
                args = [binary("zerod-mlp-train"), "--socket", sockets[i], "--job", "mlp",
                        "--local-rank", "0", "--token", TOKEN] + MODEL
                if i == 0:
                    args += ["--dump", str(dump)]
                procs.append(net.popen(i, args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True))
            for p in procs:
                out, err = p.communicate(timeout=600)
                assert p.returncode == 0, "worker failed:\n%s\n%s\n%s" % (
                    out, err, "\n".join(x.read_text()[-3000:] for x in logs))
            # The ranks' Gloo connections ran over the shaped link.
            assert "198.18.0.2" in logs[2].read_text() or "198.18.0.2" in logs[1].read_text()
        finally:
            net.close()
            for d in replica_dirs:
                subprocess.run(["rm", "-rf", d])
    run_worker([binary("zerod-mlp-reference"), "--world", "2", "--compare", str(dump),
                "--tolerance", "0", "--ranks-per-node", "1"] + MODEL)
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                          text=True).stdout.split() if n.startswith(net.tag)]
