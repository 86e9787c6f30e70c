"""Workers that die in the middle of gather, reduce and step.

The daemon must keep running, tell the dead worker's peers (an error, not a
hang), free the buffers of the job once nobody is attached to it, keep
serving a second job that trains at the same time, and let new workers
attach to the first job and go on from the state it kept.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = [sys.executable, os.path.join(HERE, "fault_worker.py")]
TIMEOUT_S = 5


def spawn(socket, job, rank, steps, die_at=None, die_step=0):
    args = WORKER + [socket, job, str(rank), str(steps)]
    if die_at:
        args += [die_at, str(die_step)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=HERE))


def finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.parametrize("die_at", ["gather", "reduce", "step"])
def test_worker_killed_mid_operation(start_daemon, die_at):
    d = start_daemon(ranks=2, timeout_s=TIMEOUT_S)
    other = [spawn(d.socket, "other", r, 1500) for r in range(2)]
    survivor = spawn(d.socket, "victim", 1, 100000)
    started = time.monotonic()
    doomed = spawn(d.socket, "victim", 0, 100000, die_at, 3)

    rc, out, err = finish(doomed)
    assert rc == -9, "the doomed worker should have killed itself: %s %s" % (out, err)
    rc, out, err = finish(survivor)
    waited = time.monotonic() - started
    assert rc == 3 and "ERROR ABORTED" in out, (rc, out, err)
    assert "disconnected" in out or "failed" in out, out
    assert waited < TIMEOUT_S + 30, "the peer waited %.1f s for its error" % waited

    for proc in other:
        rc, out, err = finish(proc)
        assert rc == 0 and out.strip().endswith("OK 1500"), (rc, out, err)
    assert d.alive()

    # Nobody is attached to the failed job: it resets and frees its buffers.
    deadline = time.monotonic() + 20
    while d.memfds("victim") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d.memfds("victim") == [], d.memfds("victim")

    # New workers attach to the same job and train on from its state.
    again = [spawn(d.socket, "victim", r, 2) for r in range(2)]
    results = [finish(p) for p in again]
    for rc, out, err in results:
        assert rc == 0 and "OK" in out, (rc, out, err, d.read_log())
    version = int(results[0][1].split()[-1])
    assert version >= 2 + 3, "the job should have kept its steps (version %d)" % version


def test_sole_worker_killed_leaves_job_usable(start_daemon):
    d = start_daemon(ranks=1, timeout_s=TIMEOUT_S)
    rc, out, err = finish(spawn(d.socket, "solo", 0, 100, "reduce", 2))
    assert rc == -9
    rc, out, err = finish(spawn(d.socket, "solo", 0, 3))
    assert rc == 0 and out.strip().endswith("OK 5"), (rc, out, err, d.read_log())
    assert "worker lost" in d.read_log()


def test_sigterm_while_training_tells_the_workers_and_exits_cleanly(start_daemon):
    d = start_daemon(ranks=2, timeout_s=TIMEOUT_S)
    workers = [spawn(d.socket, "busy", r, 1000000) for r in range(2)]
    for w in workers:
        assert w.stdout.readline().strip() == "READY"
    time.sleep(0.5)
    started = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=TIMEOUT_S + 30) == 0, d.read_log()
    assert time.monotonic() - started < TIMEOUT_S + 10
    for w in workers:
        rc, out, err = finish(w)
        # Told by a Notice or an error reply, or cut off: never a hang.
        assert rc in (1, 3), (rc, out, err)
    log = d.read_log()
    assert 'msg="shutting down" reason=SIGTERM' in log and "msg=stopped" in log, log
    assert not os.path.exists(d.socket)


def test_peer_that_never_attaches_times_out_the_registration(start_daemon):
    # Rank 1's worker never comes: rank 0's unit registration waits for it
    # in a collective that times out. The worker gets that error; the
    # daemon lives on (it used to dereference the descriptor that never
    # came) and serves the job once both ranks are there.
    d = start_daemon(ranks=2, timeout_s=3)
    rc, out, err = finish(spawn(d.socket, "half", 0, 2))
    assert rc == 3 and "ERROR" in out, (rc, out, err, d.read_log())
    assert "timed out" in out or "rank 1" in out, out
    assert d.alive()
    both = [spawn(d.socket, "fresh", r, 2) for r in range(2)]
    for proc in both:
        rc, out, err = finish(proc)
        assert rc == 0 and "OK" in out, (rc, out, err, d.read_log())
