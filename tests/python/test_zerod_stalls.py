"""Stalls (docs/daemon.md, "Stalls"): a rank that waits in a collective for
a peer whose worker sent nothing is reported by the coordinator, naming
the rank it waits for and what that rank last did, and the report clears
once the peer arrives."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest

import zerod
from conftest import binary, cluster, ctl, job, start_daemon, wait_for  # noqa: F401 (fixture)

TENSORS = [("w", (4, 8), False)]


def stalled(d, job):
    proc = subprocess.run([binary("zerodctl"), "-c", "unix:%s/control.sock" % d.dir, "jobs",
                           "get", job, "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["stalled"]


def stalled_jobs(d):
    """zerod_coordinator_stalled_jobs, scraped from the daemon's metrics."""
    port = re.search(r'msg="metrics listening" address=\S+ port=(\d+)', d.read_log()).group(1)
    with urllib.request.urlopen("http://127.0.0.1:%s/metrics" % port, timeout=10) as r:
        text = r.read().decode()
    return float(re.search(r"^zerod_coordinator_stalled_jobs (\S+)$", text, re.M).group(1))


def test_a_rank_waiting_for_an_idle_peer_is_reported_naming_the_peer(start_daemon):
    d = start_daemon(ranks=2, timeout_s=120, extra=["--metrics-listen", "127.0.0.1:0"])
    clients = [zerod.Client(d.socket) for _ in range(2)]
    jobs = [clients[r].attach("stall", rank=r) for r in range(2)]
    values = np.zeros(32, dtype=np.float32)
    # Rank 0 registers a unit (a collective over both ranks); rank 1's
    # worker sends nothing more after its attach.
    done = threading.Event()
    errors = []

    def register_rank0():
        try:
            jobs[0].register("u", TENSORS, init="rank0", values=values)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        done.set()

    t = threading.Thread(target=register_rank0)
    t.start()
    wait_for("the stall report", lambda: stalled(d, "stall") != "", timeout_s=30)
    report = stalled(d, "stall")
    assert re.fullmatch(r"rank 0 waits \d+\.\d s in \w+ #\d+ for rank 1 \(in no collective, "
                        r"last op attach \d+\.\d s ago\)", report), report
    assert 'msg="job stalled in a collective" job=stall' in d.read_log()
    assert stalled_jobs(d) == 1
    assert not done.is_set()
    # Rank 1 arrives: the collective completes, and the report clears.
    jobs[1].register("u", TENSORS, init="rank0")
    t.join(timeout=60)
    assert done.is_set() and not errors, errors
    wait_for("the stall to clear", lambda: stalled(d, "stall") == "", timeout_s=30)
    assert 'msg="job no longer stalled" job=stall' in d.read_log()
    assert stalled_jobs(d) == 0
    for job, client in zip(jobs, clients):
        job.detach()
        client.close()


def test_past_the_stall_timeout_every_rank_fails_naming_the_stall(cluster):
    """With the coordinator's --stall-timeout at 3 s, rank 0 waiting for rank
    1's idle worker is failed at about 3 s (not at the collective timeout,
    60 s here) with the report naming rank 1; rank 1's next call fails
    with it too; once both have gone, the job is reset and they train on."""
    cluster.start_coordinator(extra=["--stall-timeout", "3s"])
    node = cluster.start_node("solo", ranks=2, timeout_s=60)
    wait_for("solo to join", lambda: "solo" in ctl(cluster, "members").stdout)
    ctl(cluster, "jobs", "create", "hang", "--nodes", "1", "--ranks-per-node", "2", "--token", "t")
    wait_for("hang to be ready", lambda: job(cluster, "hang")["state"] == "ready")
    clients = [zerod.Client(node.socket) for _ in range(2)]
    jobs = [clients[r].attach("hang", rank=r, token="t") for r in range(2)]
    values = np.zeros(32, dtype=np.float32)
    start = time.monotonic()
    with pytest.raises(zerod.Error) as failed:
        jobs[0].register("u", TENSORS, init="rank0", values=values)
    waited = time.monotonic() - start
    assert waited < 30, waited
    message = str(failed.value)
    assert re.search(r"job 'hang' stalled: rank 0 waits \d+\.\d s in \w+ #\d+ for rank 1 "
                     r"\(in no collective, last op attach \d+\.\d s ago\) \(failed by the "
                     r"coordinator's stall timeout\)", message), message
    with pytest.raises(zerod.Error) as also:
        jobs[1].register("u", TENSORS, init="rank0")
    assert "job 'hang' stalled: rank 0 waits" in str(also.value), str(also.value)
    for c in clients:
        c.close()
    # A reset generation: both attach again and train.
    clients = [zerod.Client(node.socket) for _ in range(2)]
    jobs = wait_for("the job reset", lambda: _attach_all(clients, "hang"))
    threads = [threading.Thread(target=jobs[r].register, args=("u", TENSORS),
                                kwargs={"init": "rank0", "values": values if r == 0 else None})
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    results = [None, None]

    def step(r):
        results[r] = jobs[r].step().step
    threads = [threading.Thread(target=step, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [1, 1], results
    for c in clients:
        c.close()


def _attach_all(clients, name):
    try:
        return [clients[r].attach(name, rank=r, token="t") for r in range(2)]
    except zerod.Error:
        return None
