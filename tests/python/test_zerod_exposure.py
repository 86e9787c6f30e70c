"""Exposed communication (docs/daemon.md, "Exposed communication"): each
rank's time in collectives, its worker's waits, and the communication
among those waits, in Job.stats() and the metrics.

Two ranks of one job, each a thread with its own client. One rank holds
back from a collective for DELAY seconds; the other, already in it, waits:
that wait is communication it could not hide. The bounds below are what
the deliberate delay forces (at least half of it), not speeds."""

import re
import time
import urllib.request

import numpy as np

import zerod
from conftest import run_threads, start_daemon  # noqa: F401 (fixture)

TENSORS = [("w", (64, 64), False)]
DELAY = 0.6
FORCED = DELAY / 2


def run_ranks(d, body):
    """Attaches ranks 0 and 1 of job 'exp', each with its own client, and
    runs body(job) for both at once; returns the jobs and clients."""
    clients = [zerod.Client(d.socket) for _ in range(2)]
    jobs = [clients[r].attach("exp", rank=r) for r in range(2)]
    run_threads(*(lambda j=j: body(j) for j in jobs))
    return jobs, clients


def mine(job):
    return [r for r in job.stats() if r["rank"] == job.rank][0]


def step(job, hold=0.0, hold_step=0.0):
    """One step of unit 'u': gather, release, gradients, reduce, step;
    holding back `hold` seconds before the gather and `hold_step` before
    the step."""
    u = job.unit("u")
    time.sleep(hold)
    g = u.gather()
    g.release()
    u.grad_buffer().array()[...] = 0.5
    u.reduce()
    time.sleep(hold_step)
    job.step()


def metric(d, name, rank):
    port = re.search(r'msg="metrics listening" address=\S+ port=(\d+)', d.read_log()).group(1)
    with urllib.request.urlopen("http://127.0.0.1:%s/metrics" % port, timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^%s\{zerod_job="exp",rank="%d"\} (\S+)$' % (name, rank), text, re.M)
    assert m, "%s of rank %d not in the metrics" % (name, rank)
    return float(m.group(1))


def test_a_wait_for_a_late_peer_is_exposed_communication(start_daemon):
    d = start_daemon(ranks=2, timeout_s=120, extra=["--metrics-listen", "127.0.0.1:0"])
    values = np.ones(64 * 64, dtype=np.float32)

    def setup(job):
        job.register("u", TENSORS, init="rank0", values=values if job.rank == 0 else None)
        step(job)

    jobs, clients = run_ranks(d, setup)
    before = [mine(j) for j in jobs]
    for b in before:
        assert b["step"] == 1
        assert b["comm_seconds"] > 0
        assert 0 <= b["exposed_comm_seconds"] <= b["wait_seconds"]

    # Rank 1 holds back from its gather: rank 0 waits in the all-gather
    # for it, between steps, and says so with its next step.
    run_threads(lambda: step(jobs[0]), lambda: step(jobs[1], hold=DELAY))
    after = [mine(j) for j in jobs]
    waited = [after[r]["exposed_comm_seconds"] - before[r]["exposed_comm_seconds"]
              for r in range(2)]
    assert waited[0] >= FORCED, (before, after)
    assert after[0]["comm_seconds"] - before[0]["comm_seconds"] >= FORCED
    # Rank 1 did not wait: its hold was its own time, not the daemon's.
    assert waited[1] < DELAY - 0.1, (before, after)
    for a in after:
        assert a["step"] == 2
        assert 0 <= a["exposed_comm_seconds"] <= a["wait_seconds"]
    assert metric(d, "zerod_exposed_comm_seconds_total", 0) >= after[0]["exposed_comm_seconds"] - 1e-6
    assert metric(d, "zerod_worker_wait_seconds_total", 0) >= metric(
        d, "zerod_exposed_comm_seconds_total", 0)
    assert metric(d, "zerod_comm_seconds_total", 0) > 0

    # Rank 1 holds back its step: rank 0's step request waits in the
    # gradient norm's all-reduce, inside the step.
    before = after
    run_threads(lambda: step(jobs[0]), lambda: step(jobs[1], hold_step=DELAY))
    after = [mine(j) for j in jobs]
    assert after[0]["exposed_comm_seconds"] - before[0]["exposed_comm_seconds"] >= FORCED
    assert after[0]["wait_seconds"] - before[0]["wait_seconds"] >= FORCED
    for job, client in zip(jobs, clients):
        job.detach()
        client.close()
