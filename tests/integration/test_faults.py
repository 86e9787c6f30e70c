"""Workers that die in the middle of gather, reduce and step.

The daemon must keep running, tell the dead worker's peers (an error, not a
hang), free the buffers of the job once nobody is attached to it, keep
serving a second job that trains at the same time, and let new workers
attach to the first job and go on from the state it kept. And SIGTERM stops
it within 2 s whatever it is doing, a collective that cannot complete
included.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

import zdraw as z

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


# SIGTERM must end the daemon within this, in every state: a rank blocked
# in a collective or a rendezvous must not wait out the collective timeout
# (60 s here, the default).
SHUTDOWN_S = 2.0
COLLECTIVE_TIMEOUT_S = 60


def wait_log(daemon, text, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while text not in daemon.read_log():
        assert time.monotonic() < deadline, "no %r in the log:\n%s" % (text, daemon.read_log())
        time.sleep(0.02)


def assert_exits_quickly_on_sigterm(daemon, state):
    started = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    # A daemon that waits out the collective timeout still exits; the
    # assertion below then says how long it took.
    rc = daemon.proc.wait(timeout=COLLECTIVE_TIMEOUT_S + 60)
    took = time.monotonic() - started
    log = daemon.read_log()
    assert rc == 0, "zerod exited %d:\n%s" % (rc, log)
    assert took < SHUTDOWN_S, "zerod took %.1f s to stop on SIGTERM (%s):\n%s" % (
        took, state, log[-4000:])
    assert "msg=stopped" in log


def raw_attach(daemon, job, rank, **kw):
    c = z.Conn(daemon.socket, timeout=120)
    c.expect_ok(z.ATTACH, z.attach_request(job, rank, **kw))
    return c


@pytest.mark.parametrize("state", ["idle", "training", "after_reset", "reset_behind_collectives",
                                   "blocked_in_collective"])
def test_sigterm_stops_the_daemon_within_2s(start_daemon, state):
    d = start_daemon(ranks=2, timeout_s=COLLECTIVE_TIMEOUT_S)
    workers, conns = [], []
    if state == "idle":
        # A job that trained, its workers gone: nothing runs.
        for proc in [spawn(d.socket, "idle", r, 2) for r in range(2)]:
            rc, out, err = finish(proc)
            assert rc == 0, (out, err)
    elif state == "training":
        workers = [spawn(d.socket, "busy", r, 10 ** 6) for r in range(2)]
        for w in workers:
            assert w.stdout.readline().strip() == "READY"
        time.sleep(0.5)
    elif state == "after_reset":
        # Rank 0's worker dies in a reduce; rank 1's gets ABORTED and goes;
        # the job resets and builds new communicators: SIGTERM then.
        workers = [spawn(d.socket, "reset", 1, 10 ** 6)]
        rc, out, err = finish(spawn(d.socket, "reset", 0, 10 ** 6, "reduce", 3))
        assert rc == -9, (out, err)
        wait_log(d, 'msg="job reset" job=reset')
    elif state == "reset_behind_collectives":
        # Both ranks wait in collectives that cannot complete (rank 0 in a
        # gather's all-gather, rank 1 in a step's all-reduce) when both
        # workers die: the job resets, and its new communicators queue
        # behind those collectives, which only the timeout would end.
        conns = [raw_attach(d, "stuck", r) for r in range(2)]
        request = z.register_request("u", (("w", (64,)),), z.INIT_ZEROS)
        ids = [c.send(z.REGISTER_UNIT, request) for c in conns]
        replies = [c.recv() for c in conns]
        assert [(t, rid) for t, rid, _, _ in replies] == [(z.REGISTER_UNIT_REPLY, i) for i in ids]
        conns[0].send(z.GATHER, z.unit_request(replies[0][2].get(1, [0])[0]))
        conns[1].send(z.STEP)
        time.sleep(0.5)
        for c in conns:
            c.close()
        wait_log(d, 'msg="job reset" job=stuck')
    else:
        # Rank 1's worker registers a unit, a collective; rank 0's worker
        # never comes.
        conns = [raw_attach(d, "alone", 1)]
        conns[0].send(z.REGISTER_UNIT, z.register_request("u", (("w", (64,)),), z.INIT_ZEROS))
        time.sleep(0.5)
    assert_exits_quickly_on_sigterm(d, state)
    for c in conns:
        c.close()
    for w in workers:
        rc, out, err = finish(w)
        assert rc in (1, 3), (rc, out, err)  # told, or cut off: never a hang


def test_sigterm_stops_a_node_blocked_in_a_collective_within_2s(cluster):
    # A job across two nodes: node a's rank waits in a collective for node
    # b's rank, whose worker never comes. Nothing on node a can wake it but
    # the abort of its communicator.
    from test_cluster import TOKEN, Control

    cluster.start_coordinator()
    a = cluster.start_node("node-a", ranks=1, timeout_s=COLLECTIVE_TIMEOUT_S)
    cluster.start_node("node-b", ranks=1, timeout_s=COLLECTIVE_TIMEOUT_S)
    ctl = Control(cluster.coordinator.address)
    try:
        ctl.wait("2 members", lambda: ctl.members()[0] == ["node-a", "node-b"])
        ctl.create_job("spread", 2, 1, ["node-a", "node-b"])
        ctl.wait_state("spread", "JOB_STATE_READY")
    finally:
        ctl.close()
    c = raw_attach(a, "spread", 0, create=False, token=TOKEN)
    c.send(z.REGISTER_UNIT, z.register_request("u", (("w", (64,)),), z.INIT_ZEROS))
    time.sleep(0.5)
    assert_exits_quickly_on_sigterm(a, "a rank in a collective with a rank on another node")
    c.close()
