"""Subscribers on a node that does not host the job (docs/subscribe.md,
"Across nodes"): a coordinator and two node daemons on loopback; the job
trains on node-a, subscribers attach to node-b's daemon, which follows the
job from node-a (one FOLLOW connection, one read-only session there,
deltas) and serves them from its own memory. Every update a subscriber on
node-b gets must equal the trainer's weights at that version, bit for bit;
two subscribers on node-b share one follower; a wrong token is refused
with the hosting node's reason; when node-a goes, node-b's sessions fail
with a reason and the trainer lost nothing."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

import zerod
from conftest import cluster, wait_for  # noqa: F401 (fixture)
from conftest import ctl as _ctl

TOKEN = "follow-token"
ROWS, COLS = 128, 512  # 256 KiB of f32: 4 blocks of 64 KiB


def ctl(c, *args):
    return _ctl(c, *args).stdout


def ready(c, job):
    return "state: ready" in ctl(c, "jobs", "get", job)


class Trainer:
    """Rank 0 (of 1) of job `job` on node's daemon: plain SGD with gradients
    on chosen rows only (a row's block changes, the others keep their
    bits); records the fp32 weights (the working copy) at each version."""

    def __init__(self, node, job):
        self.client = zerod.Client(node.socket)
        self.job = self.client.attach(job, token=TOKEN)
        rng = np.random.default_rng(3)
        self.unit = self.job.register("dense", [("weight", (ROWS, COLS)), ("bias", (COLS,))],
                                      values=rng.standard_normal(ROWS * COLS + COLS)
                                      .astype(np.float32))
        self.frozen = self.job.register("embed", [("table", (8, COLS), True)],
                                        values=rng.standard_normal(8 * COLS).astype(np.float32))
        self.weights = {self.job.version: self.snapshot()}

    def snapshot(self):
        values, _ = self.unit.read_state()
        table, _ = self.frozen.read_state()
        return {"weight": values[:ROWS * COLS].reshape(ROWS, COLS), "bias": values[ROWS * COLS:],
                "table": table.reshape(8, COLS)}

    def step(self, rows):
        grads = self.unit.grad_buffer().arrays()
        grads["weight"][...] = 0.0
        grads["weight"][rows, :] = 1.0
        grads["bias"][...] = 0.5
        self.unit.reduce()
        version = self.job.step().version
        self.weights[version] = self.snapshot()
        return version

    def close(self):
        self.client.close()


def same(values, weights):
    for name, want in weights.items():
        got = values[name]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


def start(cluster, job="live", create=True):
    cluster.start_coordinator()
    a = cluster.start_node("node-a", ranks=1)
    b = cluster.start_node("node-b", ranks=1, extra=("--log-level", "debug"))
    wait_for("2 members", lambda: ctl(cluster, "members").count("node-") >= 2)
    if create:
        ctl(cluster, "jobs", "create", job, "--node", "node-a", "--optimizer", "sgd", "--lr",
            "0.05", "--token", TOKEN)
        wait_for(job + " to be ready", lambda: ready(cluster, job))
    return a, b


def test_a_subscriber_on_another_node_gets_the_trainers_bits(cluster):
    a, b = start(cluster)
    trainer = Trainer(a, "live")
    target = {"weight": np.zeros((ROWS, COLS), np.float32), "bias": np.zeros(COLS, np.float32),
              "table": np.zeros((8, COLS), np.float32)}
    seen = []
    try:
        with zerod.Client(b.socket) as c, c.subscribe("live", token=TOKEN, timeout_s=20) as sub:
            first = sub.next(timeout_s=0)
            assert first.apply(target) == ROWS * COLS + COLS + 8 * COLS
            same(target, trainer.weights[first.version])
            assert {u.name for u in first.units} == {"dense", "embed"}
            for k in range(6):
                version = trainer.step([k * 20, 127 - k])
                update = sub.next()
                while update.version < version:  # node-b may show an older one first
                    same(update.read(), {n: w for n, w in trainer.weights[update.version].items()
                                         if n != "table"})
                    update.apply(target)
                    update = sub.next()
                assert update.version == version
                assert [u.name for u in update.units] == ["dense"]  # the frozen one never again
                update.apply(target)
                same(target, trainer.weights[version])
                seen.append(version)
        # node-a served one read-only session for node-b: the follower.
        assert len(re.findall(r'msg="reader attached" job=live', a.read_log())) == 1
        assert 'msg="following a job" job=live' in b.read_log()
        # node-b fetched each step's changed blocks only: at most three of
        # the weight's four (two stepped rows) and the bias's.
        fetched = [int(n) for n in re.findall(
            r'msg="follower installed a version" job=live version=\d+ units=1 bytes=(\d+) ms=\d+',
            b.read_log())]
        assert len(fetched) >= 6, fetched
        assert all(0 < n <= 3 * 65536 + 4096 for n in fetched), fetched
    finally:
        trainer.close()
    assert len(seen) == 6


def test_two_subscribers_on_a_node_share_one_follower(cluster):
    a, b = start(cluster)
    trainer = Trainer(a, "live")
    results, errors = {}, []

    def follow(name):
        try:
            with zerod.Client(b.socket) as c, c.subscribe("live", token=TOKEN,
                                                          timeout_s=20) as sub:
                for update in sub:
                    values = update.read()
                    if update.version in trainer.weights:
                        results.setdefault(name, []).append((update.version, values))
                    if update.step >= 5:
                        return
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=follow, args=(n,)) for n in ("x", "y")]
    try:
        for t in threads:
            t.start()
        wait_for("both subscribers to attach",
                 lambda: b.read_log().count('msg="reader attached" job=live') >= 2)
        for k in range(5):
            trainer.step([k])
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        for name in ("x", "y"):
            assert results.get(name), name
            for version, values in results[name]:
                want = trainer.weights[version]
                for tensor, got in values.items():
                    assert np.array_equal(got.view(np.uint32), want[tensor].view(np.uint32))
        assert len(re.findall(r'msg="reader attached" job=live', a.read_log())) == 1
    finally:
        trainer.close()


def test_refusals_come_back_with_the_hosting_nodes_reason(cluster):
    a, b = start(cluster)
    trainer = Trainer(a, "live")
    try:
        with zerod.Client(b.socket) as c:
            with pytest.raises(zerod.PermissionDeniedError, match="token"):
                c.attach("live", read_only=True, token="not-the-token", create=False)
            with pytest.raises(zerod.NotFoundError, match="no job named 'absent'"):
                c.attach("absent", read_only=True, token=TOKEN, create=False)
        # The trainer is untouched.
        version = trainer.step([1])
        assert version in trainer.weights
    finally:
        trainer.close()


def test_losing_the_hosting_node_fails_the_followers_sessions(cluster):
    a, b = start(cluster)
    trainer = Trainer(a, "live")
    with zerod.Client(b.socket) as c, c.subscribe("live", token=TOKEN, timeout_s=20) as sub:
        sub.next(timeout_s=0).read()
        trainer.close()
        a.kill()
        with pytest.raises((zerod.AbortedError, zerod.UnavailableError), match="node-a|lost"):
            for _ in range(50):
                sub.next(timeout_s=1)
    wait_for("node-b to stop following",
             lambda: 'msg="stopped following a job" job=live' in b.read_log(), timeout_s=40)
