"""Subscribers (docs/subscribe.md): a read-only attachment that follows a
training job's versions. Each update pins one version; every unit read for
it must equal the trainer's own weights at that version, bit for bit; a
slow subscriber skips to the latest and is told how many it missed; the
units listed are those that changed (or that it has not read); a killed
subscriber costs the trainer nothing."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import zerod
from conftest import start_daemon  # noqa: F401 (fixture)

HIDDEN = 64


def grad_of(step, w):
    """A deterministic gradient for step `step` (what a worker would hand back)."""
    rng = np.random.default_rng(step)
    return (w * 0.1 + rng.standard_normal(w.shape)).astype(np.float32)


class Trainer:
    """A one-rank read-write job with a trainable unit ("dense") and a
    frozen one ("embed"), stepping with SGD; records its weights at each
    version (read_state: the fp32 master, which is the working copy in fp32)."""

    def __init__(self, socket, job="sub"):
        self.client = zerod.Client(socket)
        self.job = self.client.attach(job, create="fresh",
                                      config=zerod.JobConfig(optimizer="sgd", lr=0.05))
        rng = np.random.default_rng(0)
        self.dense = self.job.register("dense", [("weight", (HIDDEN, HIDDEN)), ("bias", (HIDDEN,))],
                                       values=rng.standard_normal(HIDDEN * HIDDEN + HIDDEN)
                                       .astype(np.float32))
        self.embed = self.job.register("embed", [("table", (16, HIDDEN), True)],
                                       values=rng.standard_normal(16 * HIDDEN).astype(np.float32))
        self.weights = {self.job.version: self.snapshot()}

    def snapshot(self):
        return {"dense": self.dense.read_state()[0], "embed": self.embed.read_state()[0]}

    def step(self, n, pause_s=0.0):
        for _ in range(n):
            time.sleep(pause_s)
            w, _ = self.dense.read_state()
            self.dense.grad_buffer().arrays()["weight"][...] = grad_of(
                self.job.version, w[:HIDDEN * HIDDEN]).reshape(HIDDEN, HIDDEN)
            self.dense.grad_buffer().arrays()["bias"][...] = 1.0
            self.dense.reduce()
            result = self.job.step()
            self.weights[result.version] = self.snapshot()

    def close(self):
        self.client.close()


def packed(update_values, unit):
    """A unit's tensors back to back, as read_state returns them."""
    return np.concatenate([update_values[t.name].reshape(-1) for t in unit.tensors])


def test_every_update_is_one_version_of_the_trainers_weights(start_daemon):
    daemon = start_daemon(ranks=1)
    trainer = Trainer(daemon.socket)
    seen = {}
    errors = []

    def subscribe():
        try:
            with zerod.Client(daemon.socket) as c, c.subscribe("sub", timeout_s=10) as sub:
                held = None
                for update in sub:
                    values = update.read()
                    seen[update.version] = (update, values)
                    assert update.skipped == (0 if held is None else update.version - held - 1)
                    held = update.version
                    if update.version % 3 == 0:
                        time.sleep(0.05)  # slow now and then: versions go by unseen
                    if update.step >= 40:
                        return
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    reader = threading.Thread(target=subscribe)
    reader.start()
    time.sleep(0.3)
    trainer.step(40, pause_s=0.02)
    reader.join(timeout=60)
    assert not errors, errors
    assert not reader.is_alive()
    assert len(seen) >= 5
    versions = sorted(seen)
    first = seen[versions[0]][0]
    assert {u.name for u in first.units} == {"dense", "embed"}  # the first brings everything
    for v in versions:
        update, values = seen[v]
        want = trainer.weights[v]
        if v != versions[0]:
            assert [u.name for u in update.units] == ["dense"], v  # embed is frozen
        for unit in update.units:
            got = packed(values, unit)
            assert got.tobytes() == want[unit.name].tobytes(), (v, unit.name)
    # Skips were reported and add up: every version is either seen or skipped.
    assert sum(seen[v][0].skipped for v in versions[1:]) + len(versions) == versions[-1] - versions[0] + 1
    trainer.close()


def test_changed_units_follow_loads_and_new_units(start_daemon):
    daemon = start_daemon(ranks=1)
    trainer = Trainer(daemon.socket)
    with zerod.Client(daemon.socket) as c:
        job = c.attach("sub", read_only=True, create=False)
        first = job.watch()
        assert sorted(u.name for u in first.units) == ["dense", "embed"]
        for u in first.units:
            u.gather().release()
        trainer.step(1)
        update = job.watch(first.version, timeout_s=10)
        assert [u.name for u in update.units] == ["dense"]  # embed is frozen
        # A load changes the unit it writes, frozen or not.
        trainer.embed.load(np.zeros(16 * HIDDEN, np.float32))
        update2 = job.watch(update.version, timeout_s=10)
        assert [u.name for u in update2.units] == ["embed"]
        assert not update2.read()["table"].any()
        # A unit registered later is listed as one this session has not read.
        trainer.job.register("late", [("x", (8,))], values=np.ones(8, np.float32))
        trainer.step(1)
        update3 = job.watch(update2.version, timeout_s=10)
        assert sorted(u.name for u in update3.units) == ["dense", "late"]
        assert update3.read()["x"].tolist() == [1.0] * 8
        # Nothing new: the wait times out, and says so with None.
        t0 = time.monotonic()
        assert job.watch(update3.version, timeout_s=0.3) is None
        assert time.monotonic() - t0 >= 0.25
    trainer.close()


def test_watch_refusals(start_daemon):
    daemon = start_daemon(ranks=1)
    trainer = Trainer(daemon.socket)
    with pytest.raises(zerod.FailedPreconditionError, match="read-only"):
        trainer.job.watch()
    with zerod.Client(daemon.socket) as c:
        job = c.attach("sub", read_only=True, create=False)
        with pytest.raises(ValueError, match="out of range"):
            job.watch(timeout_s=-1)
        with pytest.raises(zerod.NotFoundError):
            c.subscribe("no-such-job")
    trainer.close()


SUBSCRIBER = r"""
import sys, zerod
with zerod.Client(sys.argv[1]) as c, c.subscribe("sub", timeout_s=60) as sub:
    for update in sub:
        update.read()
        print(update.version, flush=True)
"""


def test_a_killed_subscriber_costs_the_trainer_nothing(start_daemon, tmp_path):
    daemon = start_daemon(ranks=1)
    trainer = Trainer(daemon.socket)
    script = tmp_path / "subscriber.py"
    script.write_text(SUBSCRIBER)
    env = dict(os.environ, ZEROD_QUIET="1")
    procs = [subprocess.Popen([sys.executable, str(script), daemon.socket], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        assert p.stdout.readline().strip()  # each has its first update
    trainer.step(5)
    procs[0].send_signal(signal.SIGKILL)  # parked in a watch, or reading
    trainer.step(5)
    procs[1].send_signal(signal.SIGKILL)
    trainer.step(5)
    for p in procs:
        p.kill()
        p.wait()
    # The trainer's weights are those of the same steps with no subscriber.
    alone = start_daemon(ranks=1)
    reference = Trainer(alone.socket)
    reference.step(15)
    assert trainer.snapshot()["dense"].tobytes() == reference.snapshot()["dense"].tobytes()
    assert daemon.alive()
    # A new subscriber gets the latest version.
    with zerod.Client(daemon.socket) as c:
        update = c.attach("sub", read_only=True, create=False).watch()
        assert update.version == trainer.job.version
        assert "read-only session" not in daemon.read_log() or "error" not in daemon.read_log()
    trainer.close()
    reference.close()


def test_follow_loads_each_version_into_a_plain_torch_module(start_daemon):
    torch = pytest.importorskip("torch")
    import zerod.torch as zt

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(HIDDEN, HIDDEN))
            self.bias = torch.nn.Parameter(torch.zeros(HIDDEN))
            self.table = torch.nn.Parameter(torch.zeros(16, HIDDEN))

    daemon = start_daemon(ranks=1)
    trainer = Trainer(daemon.socket)
    model = Net()
    worker = threading.Thread(target=trainer.step, args=(20,), kwargs={"pause_s": 0.02})
    worker.start()
    followed = []
    for update in zt.follow(model, "sub", socket=daemon.socket, timeout_s=10):
        deadline = time.monotonic() + 10
        while update.version not in trainer.weights:  # the trainer records after its step
            assert time.monotonic() < deadline
            time.sleep(0.001)
        want = trainer.weights[update.version]
        got = torch.cat([model.weight.detach().reshape(-1), model.bias.detach()]).numpy()
        assert got.tobytes() == want["dense"].tobytes(), update.version
        assert model.table.detach().numpy().tobytes() == want["embed"].tobytes()
        followed.append(update.version)
        if update.step >= 20:
            break
    worker.join()
    assert len(followed) >= 3 and followed == sorted(followed)

    # A model that is not the job's is refused with the tensor's name, untouched.
    other = torch.nn.Linear(HIDDEN, HIDDEN)  # weight and bias fit; no table
    before = other.weight.detach().clone()
    with pytest.raises(KeyError, match="table"):
        next(zt.follow(other, "sub", socket=daemon.socket, timeout_s=10))
    assert torch.equal(other.weight.detach(), before)
    trainer.close()


def test_zerodctl_jobs_watch_prints_each_version(start_daemon):
    import json

    from conftest import binary

    daemon = start_daemon(ranks=1)
    trainer = Trainer(daemon.socket)
    watch = subprocess.Popen([binary("zerodctl"), "jobs", "watch", "sub", "--socket", daemon.socket,
                              "--json", "--count", "4", "--timeout", "30"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = json.loads(watch.stdout.readline())
    assert first["version"] == trainer.job.version and first["skipped"] == 0
    assert sorted(first["units"]) == ["dense", "embed"] and first["job"] == "sub"
    trainer.step(3, pause_s=0.3)
    out, err = watch.communicate(timeout=60)
    assert watch.returncode == 0, err
    lines = [first] + [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 4
    for prev, line in zip(lines, lines[1:]):
        assert line["version"] == prev["version"] + 1 + line["skipped"]
        assert line["units"] == ["dense"] and line["step"] >= 1
    # No new version: a clear line and exit 1; a job that is not there: exit 1.
    quiet = subprocess.run([binary("zerodctl"), "jobs", "watch", "sub", "--socket", daemon.socket,
                            "--count", "2", "--timeout", "0.5"], capture_output=True, text=True)
    assert quiet.returncode == 1 and "no new version of job sub in 0.5 s" in quiet.stderr
    assert quiet.stdout.count("version") == 1
    missing = subprocess.run([binary("zerodctl"), "jobs", "watch", "nope", "--socket",
                              daemon.socket], capture_output=True, text=True)
    assert missing.returncode == 1 and "nope" in missing.stderr
    usage = subprocess.run([binary("zerodctl"), "jobs", "watch"], capture_output=True, text=True)
    assert usage.returncode == 2 and "which job?" in usage.stderr
    trainer.close()


def test_pinned_versions_are_capped_with_a_reason(start_daemon):
    """--max-pinned-versions: a reader pinned at an old version holds one of
    the job's pinned versions; a new pin past the cap is refused, naming the
    flag; moving the old reader on makes room."""
    daemon = start_daemon(ranks=1, extra=["--max-pinned-versions", "1"])
    trainer = Trainer(daemon.socket)
    old = zerod.Client(daemon.socket)
    reader = old.attach("sub", read_only=True, create=False)  # pins the current version
    trainer.step(1)
    with zerod.Client(daemon.socket) as c:
        with pytest.raises(zerod.ResourceExhaustedError, match="--max-pinned-versions"):
            c.attach("sub", read_only=True, create=False)
    assert reader.pin() == trainer.job.version  # moving on lets the old version go
    with zerod.Client(daemon.socket) as c:
        assert c.attach("sub", read_only=True, create=False).version == trainer.job.version
    reader.detach()
    old.close()
    trainer.close()


def test_a_stopping_daemon_answers_waiting_watches(start_daemon):
    """SIGTERM with subscribers parked in a watch: each gets UNAVAILABLE at
    once (not at its timeout), and the daemon exits cleanly (the fixture
    checks its status and the sanitizer's silence)."""
    daemon = start_daemon(ranks=1, extra=["--drain-timeout", "0"])
    trainer = Trainer(daemon.socket)
    results = []

    def wait():
        try:
            with zerod.Client(daemon.socket) as c:
                job = c.attach("sub", read_only=True, create=False)
                held = job.watch().version
                results.append(job.watch(held, timeout_s=60))
        except zerod.Error as e:
            results.append(e)

    waiters = [threading.Thread(target=wait) for _ in range(3)]
    for w in waiters:
        w.start()
    time.sleep(0.5)
    trainer.close()
    t0 = time.monotonic()
    daemon.stop()
    for w in waiters:
        w.join(timeout=30)
    assert time.monotonic() - t0 < 20
    assert len(results) == 3 and all(isinstance(r, zerod.UnavailableError) for r in results), results


def pin_snapshot_bytes(daemon):
    """zerod_pin_snapshot_bytes_total of job "sub", rank 0, from the
    daemon's /metrics."""
    import re
    import urllib.request

    port = int(re.search(r'msg="metrics listening" address=\S+ port=(\d+)',
                         daemon.read_log()).group(1))
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^zerod_pin_snapshot_bytes_total\{zerod_job="sub",rank="0"\} (\S+)$', text,
                  re.M)
    assert m, text
    return float(m.group(1))


def test_a_waiting_subscriber_costs_no_copy_a_reading_one_does(start_daemon):
    """A subscriber parked in a watch holds no pin, so the trainer's step
    copies nothing for it (zerod_pin_snapshot_bytes_total stays 0); a
    session pinned at the version the step overwrites makes the rank copy
    its slices into the pin first."""
    daemon = start_daemon(ranks=1, extra=["--metrics-listen", "127.0.0.1:0"])
    trainer = Trainer(daemon.socket)
    with zerod.Client(daemon.socket) as c:
        sub = c.attach("sub", read_only=True, create=False)
        held = sub.watch().version  # pinned now
        waiter = threading.Thread(target=sub.watch, args=(held,), kwargs={"timeout_s": 10})
        waiter.start()
        time.sleep(0.3)  # parked: its pin let go
        trainer.step(1)
        waiter.join()
    assert pin_snapshot_bytes(daemon) == 0
    with zerod.Client(daemon.socket) as c:
        c.attach("sub", read_only=True, create=False)  # pinned, reading nothing yet
        trainer.step(1)
        copied = pin_snapshot_bytes(daemon)
    units = (HIDDEN * HIDDEN + HIDDEN) + 16 * HIDDEN  # one rank: every element, fp32
    assert units * 4 <= copied < units * 4 + 4096, copied
    trainer.close()
