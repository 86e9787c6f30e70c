"""Upgrades keep state (issue 37): a standalone daemon told to stop
(SIGTERM, as Kubernetes does before replacing a pod) saves every job that
holds state before it goes, and the next daemon on the same state
directory restores them, so the workers attach again and train on from
the step they were at. A job of 2 ranks is restarted twice mid-training
and ends bit-identical to the same training without restarts.

The workers are chaos_worker.py's: they attach again after every error
and step with gradients that depend on the step alone."""

import os
import subprocess

import numpy as np

from conftest import (binary, cluster, ctl, job, python, start_daemon, wait_for,  # noqa: F401
                      worker_env)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "chaos_worker.py")
TOKEN = "upgrade-token"


def zerodctl(d, *args):
    proc = subprocess.run([binary("zerodctl"), "-c", "unix:%s/control.sock" % d.dir] + list(args),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def progress(tmp_path):
    """The step the workers have reached (their --progress files): the
    coordinator's view of a job's step lags by a heartbeat."""
    steps = []
    for f in tmp_path.glob("progress-*"):
        try:
            steps.append(int(f.read_text()))
        except ValueError:  # being written
            pass
    return max(steps, default=0)


def stop_at(tmp_path, until):
    """Ends the training a little past where the workers are: both read
    the new target well before they reach it, so they stop at one step."""
    until.write_text(str(progress(tmp_path) + 50))


def train(d, name, out, tmp_path, until):
    """Two workers of job `name` to the step in file `until`; the worker
    processes."""
    zerodctl(d, "jobs", "create", name, "--ranks-per-node", "2", "--token", TOKEN,
             "--optimizer", "adamw", "--lr", "0.01")
    return [subprocess.Popen(
        [python(), WORKER, "--socket", d.socket, "--job", name, "--token", TOKEN, "--rank",
         str(r), "--seed", "7", "--until-file", str(until), "--out",
         str(tmp_path / ("%s-%d.npy" % (out, r))), "--give-up-s", "60", "--progress",
         str(tmp_path / ("progress-%d" % r))],
        env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)]


def assert_like_reference(tmp_path, until, name, procs, start_reference):
    """Ends the training of job `name` (its two workers procs), then trains
    a reference without faults (start_reference() starts its workers, job
    "ref") to the same step: each rank's parameters must be equal, bit for
    bit."""
    stop_at(tmp_path, until)
    finish(procs)
    steps = {open(str(tmp_path / ("%s-%d.npy.step" % (name, r)))).read() for r in range(2)}
    assert len(steps) == 1, steps
    got = [np.load(tmp_path / ("%s-%d.npy" % (name, r))) for r in range(2)]
    until.write_text(steps.pop())
    finish(start_reference())
    for r in range(2):
        np.testing.assert_array_equal(got[r], np.load(tmp_path / ("ref-%d.npy" % r)))


def finish(procs):
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err


def test_a_restarted_daemon_resumes_its_jobs_bit_identically(start_daemon, tmp_path):
    d = start_daemon(ranks=2, extra=["--drain-timeout", "60s"])
    until = tmp_path / "until"
    until.write_text(str(1 << 40))
    procs = train(d, "roll", "roll", tmp_path, until)
    for restart in range(2):
        at = progress(tmp_path) + 50
        wait_for("step %d" % at, lambda: progress(tmp_path) >= at, timeout_s=120)
        d.stop()  # SIGTERM: drains, then stops (and must exit 0)
        log = d.log_path.read_text()
        assert log.count("drained: every job with state saved") == restart + 1, log
        assert 'msg="saving the job before stopping" job=roll node=' in log, log
        d.start()  # the same --dir
    # (A restart right after a restore may come before its "recovered"
    # line: the job is saved again at the restored step.)
    wait_for("recovered", lambda: "recovered from a checkpoint" in d.read_log(), timeout_s=60)
    assert_like_reference(tmp_path, until, "roll", procs,
                          lambda: train(d, "ref", "ref", tmp_path, until))


def test_a_job_without_state_is_kept_and_not_waited_for(start_daemon):
    d = start_daemon(ranks=1)  # the default drain
    zerodctl(d, "jobs", "create", "empty", "--ranks-per-node", "1", "--token", TOKEN)
    d.stop()
    assert "jobs_saving=0" in d.log_path.read_text()
    d.start()
    # The job itself is kept: the coordinator's record survives the restart.
    assert "empty" in zerodctl(d, "jobs", "list")


def test_a_node_stopped_by_sigterm_has_its_jobs_saved_and_restored(cluster, tmp_path):
    """zerod node drains too: the coordinator saves the jobs of a node that
    is stopping; when the node is back, the job (on two nodes) is rebuilt
    on both and restored from that save, and trains on bit-identically."""
    cluster.start_coordinator()
    a = cluster.start_node("node-a", ranks=1, extra=["--drain-timeout", "60s"])
    b = cluster.start_node("node-b", ranks=1)
    wait_for("2 members", lambda: "node-b" in ctl(cluster, "members").stdout and
             "node-a" in ctl(cluster, "members").stdout)
    until = tmp_path / "until"
    until.write_text(str(1 << 40))

    def workers(name):
        ctl(cluster, "jobs", "create", name, "--node", "node-a,node-b", "--ranks-per-node", "1",
            "--token", TOKEN, "--optimizer", "adamw", "--lr", "0.01")
        wait_for(name + " ready", lambda: job(cluster, name)["state"] == "ready")
        return [subprocess.Popen(
            [python(), WORKER, "--socket", n.socket, "--job", name, "--token", TOKEN, "--seed",
             "11", "--until-file", str(until), "--out", str(tmp_path / ("%s-%s.npy" % (name, i))),
             "--give-up-s", "120", "--progress", str(tmp_path / ("progress-%d" % i))],
            env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i, n in enumerate((a, b))]

    procs = workers("wide")
    wait_for("step 50", lambda: progress(tmp_path) >= 50, timeout_s=120)
    a.stop()  # SIGTERM: the coordinator saves "wide", then the node stops
    log = a.log_path.read_text()
    assert "drained: every job with state saved" in log, log
    assert 'msg="saving the job before stopping" job=wide node=node-a' in \
        cluster.coordinator.read_log()
    a.start()
    wait_for("the restore", lambda: "recovered from a checkpoint" in
             cluster.coordinator.read_log(), timeout_s=120)
    assert_like_reference(tmp_path, until, "wide", procs, lambda: workers("ref"))
