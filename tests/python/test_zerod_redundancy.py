"""In-memory redundancy (docs/redundancy.md): a coordinator and `zerod
node`s of two ranks each on loopback, a job with redundancy 1 on three of
them. One node is SIGKILLed while the workers train; the job is re-placed
(on the two nodes left, or on a spare node) and restored from the
in-memory copies, with no disk read, and the workers attach again and
train on. No step any worker saw completed is lost, and the result is
bit-identical to a reference: one that saves a checkpoint at the step the
job was recovered at and restores it into a job of the new world size, or
for a spare node, one that was never interrupted."""

from __future__ import annotations

import re
import threading
import time

import numpy as np

import zerod
from conftest import cluster, ctl, job, wait_for  # noqa: F401 (fixture)

TOKEN = "redundancy-token"
NUMEL = 6000
TENSORS = [("w", (NUMEL,))]


def grads(step, rank):
    """Rank `rank`'s gradient for step `step`: the same in every run."""
    return np.random.default_rng(step * 1009 + rank).standard_normal(NUMEL).astype(np.float32)


def initial():
    return np.random.default_rng(7).standard_normal(NUMEL).astype(np.float32)


class Worker(threading.Thread):
    """A worker of local rank `local` on `node`: attaches (again, after its
    job failed under it, until `deadline_s`), registers the unit if the job
    has none, and steps until the job's step is `until`; then keeps the
    job's parameters in `result`. Stops at its first error once `stop` is
    set (its node is gone)."""

    def __init__(self, node, name, local, until, stop=None, deadline_s=120):
        super().__init__(daemon=True)
        self.node, self.name_, self.local, self.until = node, name, local, until
        self.stop = stop or threading.Event()
        self.deadline = time.monotonic() + deadline_s
        self.result = None
        self.errors = []
        self.rank = None
        self.completed = 0  # the highest step a step call returned
        self.before_loss = None  # ... when the first error came
        self.at_errors = []  # ... at each error after a step

    def run(self):
        while time.monotonic() < self.deadline:
            try:
                self.train()
                return
            except zerod.Error as e:
                if not self.errors:
                    self.before_loss = self.completed
                if not self.errors or self.completed != self.at_errors[-1]:
                    self.at_errors.append(self.completed)
                self.errors.append(str(e))
                if self.stop.is_set():
                    return
                time.sleep(0.2)

    def train(self):
        with zerod.Client(self.node.socket) as client:
            job = client.attach(self.name_, rank=self.local, token=TOKEN, create=False)
            self.rank = (job.rank, job.world_size)
            units = job.units
            unit = units[0] if units else job.register("u", TENSORS, values=initial())
            step = job.stats()[0]["step"]
            while step < self.until:
                unit.grad_buffer().arrays()["w"][...] = grads(step + 1, job.rank)
                unit.reduce()
                step = job.step().step
                self.completed = max(self.completed, step)
            self.result = job.state_dict()["w"]


def train(nodes, name, until, ranks_per_node=2):
    workers = [Worker(n, name, r, until) for n in nodes for r in range(ranks_per_node)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
        assert w.result is not None, w.errors
    return workers


def start_job(cluster, name, nodes, extra=()):
    ctl(cluster, "jobs", "create", name, "--node", ",".join(n.name for n in nodes),
        "--ranks-per-node", "2", "--token", TOKEN, "--optimizer", "adamw", "--lr", "0.01",
        *extra)
    wait_for(name + " to be ready", lambda: job(cluster, name)["state"] == "ready")


def kill_mid_training(cluster, nodes, lost, until):
    """Starts workers of job r on nodes; once it has an in-memory copy,
    SIGKILLs node `lost` (its workers stop). Returns the workers."""
    stop = threading.Event()
    workers = [Worker(n, "r", local, until, stop=stop if n is lost else None)
               for n in nodes for local in range(2)]
    for w in workers:
        w.start()
    wait_for("an in-memory copy", lambda: job(cluster, "r")["replica_step"] >= 5, timeout_s=60)
    stop.set()
    lost.kill()
    return workers


def recovered_at(cluster, world_size, workers):
    """The step job r was recovered at from its in-memory copy, checking
    that no step any of the workers saw completed was lost."""
    info = wait_for("r's recovery", lambda: job(cluster, "r")["last_recovery"] and
                    job(cluster, "r"), timeout_s=60)
    m = re.fullmatch(r"state lost on a node; restored from the in-memory copy of step (\d+) on %d "
                     r"ranks: no completed step lost" % world_size, info["last_recovery"])
    assert m, info["last_recovery"]
    at = int(m.group(1))
    # No step any worker saw completed is lost: every worker had its
    # first error (the loss) at or before the step recovered.
    before = [w.before_loss for w in workers]
    assert all(b is not None and b <= at for b in before), (before, at)
    return at


def finished(workers, world_size):
    """The parameters the workers ended with (all alike)."""
    for w in workers:
        assert w.result is not None, w.errors
        assert w.rank[1] == world_size, w.rank
        np.testing.assert_array_equal(w.result, workers[0].result)
    return workers[0].result


def handover(cluster, old, new, nodes):
    """Job `old`'s state, saved to a checkpoint, restored into a new job
    `new` on nodes (old is deleted first: its nodes host new's ranks)."""
    ctl(cluster, "checkpoint", "save", old, "handover")
    old_id = job(cluster, old)["id"]
    ctl(cluster, "jobs", "delete", old)  # its checkpoints move to old@<id>
    start_job(cluster, new, nodes)
    wait_for("%s's checkpoints moved" % old, lambda: ctl(
        cluster, "checkpoint", "restore", new, "%s@%s/handover" % (old, old_id),
        check=False).returncode == 0)


def test_a_lost_node_is_recovered_from_memory_onto_the_nodes_left(cluster):
    cluster.start_coordinator(lease_ttl_s=2.0)
    nodes = [cluster.start_node("node-%s" % n, ranks=2, timeout_s=30) for n in "abc"]
    wait_for("3 members", lambda: ctl(cluster, "members").stdout.count("node-") >= 3)
    start_job(cluster, "r", nodes, ["--redundancy", "1"])
    until = 400
    workers = kill_mid_training(cluster, nodes, nodes[1], until)
    for w in workers:
        w.join()
    at = recovered_at(cluster, 4, workers)
    final = finished(workers[:2] + workers[4:], 4)

    # The reference: the same training on three nodes up to the step the
    # job was recovered at, saved, and restored into a job of two nodes.
    nodes[1] = cluster.start_node("node-b", ranks=2, timeout_s=30)
    wait_for("node-b back", lambda: ctl(cluster, "members").stdout.count("node-") >= 3)
    ctl(cluster, "jobs", "delete", "r")
    start_job(cluster, "ref", nodes)
    train(nodes, "ref", at)
    handover(cluster, "ref", "ref2", [nodes[0], nodes[2]])
    reference = train([nodes[0], nodes[2]], "ref2", until)
    np.testing.assert_array_equal(final, reference[0].result)


def test_a_spare_node_takes_over_a_lost_nodes_ranks(cluster):
    """With a fourth node idle, the lost node's ranks move there: the world
    keeps its six ranks, and the result is that of training never
    interrupted."""
    cluster.start_coordinator(lease_ttl_s=2.0)
    nodes = [cluster.start_node("node-%s" % n, ranks=2, timeout_s=30) for n in "abcd"]
    wait_for("4 members", lambda: ctl(cluster, "members").stdout.count("node-") >= 4)
    start_job(cluster, "r", nodes[:3], ["--redundancy", "1"])
    until = 300
    workers = kill_mid_training(cluster, nodes[:3], nodes[1], until)
    # The orchestrator starts the lost node's workers on the spare.
    workers += [Worker(nodes[3], "r", local, until) for local in range(2)]
    for w in workers[6:]:
        w.start()
    for w in workers:
        w.join()
    recovered_at(cluster, 6, workers[:6])
    placement = [p["node"] for p in job(cluster, "r")["placement"]]
    assert placement == ["node-a", "node-d", "node-c"], placement
    final = finished(workers[:2] + workers[4:], 6)

    ctl(cluster, "jobs", "delete", "r")
    start_job(cluster, "ref", [nodes[0], nodes[3], nodes[2]])
    reference = train([nodes[0], nodes[3], nodes[2]], "ref", until)
    np.testing.assert_array_equal(final, reference[0].result)


def recovery_step(cluster, world_size, after=None):
    """The step of job r's newest recovery from memory onto world_size ranks
    (a recovery other than `after`)."""
    def newest():
        text = job(cluster, "r")["last_recovery"]
        m = re.fullmatch(r"state lost on a node; restored from the in-memory copy of step (\d+) "
                         r"on %d ranks: no completed step lost" % world_size, text)
        return m and text != after and (int(m.group(1)), text)
    return wait_for("r's recovery onto %d ranks" % world_size, newest, timeout_s=60)


def test_a_job_grows_and_drains_between_steps_bit_exactly(cluster):
    """A job on two nodes grows to three (the third node's workers attach)
    and then drains one of the first two: each move re-shards the newest
    in-memory copy, losing no completed step, and the result is that of a
    reference saved and restored into each world at the same steps."""
    cluster.start_coordinator(lease_ttl_s=2.0)
    nodes = [cluster.start_node("node-%s" % n, ranks=2, timeout_s=30) for n in "abc"]
    wait_for("3 members", lambda: ctl(cluster, "members").stdout.count("node-") >= 3)
    start_job(cluster, "r", nodes[:2], ["--redundancy", "1"])
    until = 600
    stop_b = threading.Event()
    workers = [Worker(n, "r", local, until, stop=stop_b if n is nodes[1] else None)
               for n in nodes[:2] for local in range(2)]
    for w in workers:
        w.start()
    wait_for("step 30", lambda: job(cluster, "r")["replica_step"] >= 30, timeout_s=60)
    ctl(cluster, "jobs", "scale", "r", "node-a,node-b,node-c")
    workers += [Worker(nodes[2], "r", local, until) for local in range(2)]
    for w in workers[4:]:
        w.start()
    grown, text = recovery_step(cluster, 6)
    assert all(w.at_errors and w.at_errors[0] <= grown for w in workers[:4]), (
        [w.at_errors for w in workers], grown)

    wait_for("60 more steps", lambda: job(cluster, "r")["replica_step"] >= grown + 60,
             timeout_s=60)
    stop_b.set()
    ctl(cluster, "jobs", "scale", "r", "node-a,node-c")
    drained, _ = recovery_step(cluster, 4, after=text)
    for w in workers:
        w.join()
    for w in workers[:2] + workers[4:]:
        assert w.at_errors[-1] <= drained, ([w.at_errors for w in workers], drained)
    final = finished(workers[:2] + workers[4:], 4)

    # The reference: saved and restored into each world at those steps.
    ctl(cluster, "jobs", "delete", "r")
    start_job(cluster, "ref", nodes[:2])
    train(nodes[:2], "ref", grown)
    handover(cluster, "ref", "ref3", nodes)
    train(nodes, "ref3", drained)
    handover(cluster, "ref3", "ref2", [nodes[0], nodes[2]])
    reference = train([nodes[0], nodes[2]], "ref2", until)
    np.testing.assert_array_equal(final, reference[0].result)


def test_in_memory_copies_count_in_the_jobs_host_quota(cluster):
    """A unit whose shard state fits the job's max_host_bytes per rank but
    not with its two in-memory copies (its own and the peer's) is refused
    for a job with redundancy, and accepted for the same job without."""
    cluster.start_coordinator(lease_ttl_s=2.0)
    nodes = [cluster.start_node("node-%s" % n, ranks=1, timeout_s=30) for n in "ab"]
    wait_for("2 members", lambda: ctl(cluster, "members").stdout.count("node-") >= 2)
    # 8192 floats: 4096 a rank; AdamW's state 16 bytes an element (64 KiB)
    # and the copies 2 x 12 bytes (96 KiB): 100,000 bytes fit the first only.
    tensors = [("w", (8192,))]
    for name, extra in (("with", ["--redundancy", "1"]), ("without", [])):
        ctl(cluster, "jobs", "create", name, "--node", "node-a,node-b", "--ranks-per-node", "1",
            "--token", TOKEN, "--optimizer", "adamw", "--max-host-bytes", "100000", *extra)
        wait_for(name, lambda: job(cluster, name)["state"] == "ready")
        outcome = [None, None]

        def register(r):
            try:
                with zerod.Client(nodes[r].socket) as client:
                    j = client.attach(name, token=TOKEN, create=False)
                    j.register("u", tensors, init="zeros")
                    outcome[r] = "ok"
            except zerod.Error as e:
                outcome[r] = e
        threads = [threading.Thread(target=register, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        if extra:
            for e in outcome:
                assert isinstance(e, zerod.ResourceExhaustedError), outcome
            assert any("in-memory copies" in str(e) and "max_host_bytes" in str(e)
                       for e in outcome), outcome
        else:
            assert outcome == ["ok", "ok"], outcome
        ctl(cluster, "jobs", "delete", name)


MODEL_LOCK = threading.Lock()


class TorchWorker(threading.Thread):
    """A zerod.torch worker of job `name` on `node` (TinyLM, its rank's share
    of each step's batch) training to step `until`; after a failure of the
    job under it, ShardedModule.recover() and on from the step it returns.
    Stops at its first error once `stop` is set (its node is gone)."""

    def __init__(self, node, name, until, stop=None):
        super().__init__(daemon=True)
        self.node, self.name_, self.until = node, name, until
        self.stop = stop or threading.Event()
        self.result, self.errors, self.recovered_at = None, [], []

    def run(self):
        import torch
        import zerod.torch as zt
        from torch_models import TinyLM, batch

        torch.set_num_threads(1)
        client = zerod.Client(self.node.socket)
        try:
            job = client.attach(self.name_, token=TOKEN, create=False)
            with MODEL_LOCK:  # TinyLM seeds torch's one global generator
                local = TinyLM(seed=3)
            model = zt.shard(local, job)
            opt = zt.Optimizer(model)
            step = job.stats()[0]["step"]
            while step < self.until:
                try:
                    tokens, targets = batch(step + 1, 12, model.job.rank, model.job.world_size)
                    model(tokens, targets).backward()
                    opt.step()
                    opt.zero_grad()
                    step = opt.last_step.step
                except zerod.Error as e:
                    self.errors.append(str(e))
                    if self.stop.is_set():
                        return
                    step = model.recover(timeout_s=120)
                    self.recovered_at.append(step)
            self.result = {k: v.clone() for k, v in model.state_dict().items()}
        except zerod.Error as e:
            self.errors.append(str(e))
        finally:
            client.close()


def torch_train(nodes, name, until):
    workers = [TorchWorker(n, name, until) for n in nodes]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=600)
        assert w.result is not None, w.errors
    return workers[0].result


def test_zerod_torch_goes_on_through_model_recover(cluster):
    """zerod.torch workers of a job with redundancy on three nodes; one node
    is SIGKILLed; the others call model.recover() when their step fails and
    train on re-sharded onto two nodes, ending as a reference that saved
    at the recovered step and restored into two nodes does."""
    cluster.start_coordinator(lease_ttl_s=2.0)
    nodes = [cluster.start_node("node-%s" % n, ranks=1, timeout_s=30) for n in "abc"]
    wait_for("3 members", lambda: ctl(cluster, "members").stdout.count("node-") >= 3)
    ctl(cluster, "jobs", "create", "r", "--node", "node-a,node-b,node-c", "--ranks-per-node",
        "1", "--token", TOKEN, "--optimizer", "adamw", "--lr", "0.01", "--redundancy", "1")
    wait_for("r to be ready", lambda: job(cluster, "r")["state"] == "ready")
    until = 160
    stop_b = threading.Event()
    workers = [TorchWorker(n, "r", until, stop=stop_b if n is nodes[1] else None) for n in nodes]
    for w in workers:
        w.start()
    wait_for("an in-memory copy", lambda: job(cluster, "r")["replica_step"] >= 20, timeout_s=120)
    stop_b.set()
    nodes[1].kill()
    for w in workers:
        w.join(timeout=600)
    survivors = [workers[0], workers[2]]
    for w in survivors:
        assert w.result is not None, w.errors
        assert len(w.recovered_at) == 1, (w.recovered_at, w.errors)
    at = survivors[0].recovered_at[0]
    assert survivors[1].recovered_at == [at]
    assert job(cluster, "r")["world_size"] == 2
    for key, value in survivors[0].result.items():
        assert torch_equal(value, survivors[1].result[key]), key

    nodes[1] = cluster.start_node("node-b", ranks=1, timeout_s=30)
    wait_for("node-b back", lambda: ctl(cluster, "members").stdout.count("node-") >= 3)
    ctl(cluster, "jobs", "delete", "r")
    ctl(cluster, "jobs", "create", "ref", "--node", "node-a,node-b,node-c", "--ranks-per-node",
        "1", "--token", TOKEN, "--optimizer", "adamw", "--lr", "0.01")
    wait_for("ref to be ready", lambda: job(cluster, "ref")["state"] == "ready")
    torch_train(nodes, "ref", at)
    ctl(cluster, "checkpoint", "save", "ref", "handover")
    ref_id = job(cluster, "ref")["id"]
    ctl(cluster, "jobs", "delete", "ref")
    ctl(cluster, "jobs", "create", "ref2", "--node", "node-a,node-c", "--ranks-per-node", "1",
        "--token", TOKEN, "--optimizer", "adamw", "--lr", "0.01")
    wait_for("ref2 to be ready", lambda: job(cluster, "ref2")["state"] == "ready")
    wait_for("ref's checkpoints moved", lambda: ctl(
        cluster, "checkpoint", "restore", "ref2", "ref@%s/handover" % ref_id,
        check=False).returncode == 0)
    reference = torch_train([nodes[0], nodes[2]], "ref2", until)
    for key, value in survivors[0].result.items():
        assert torch_equal(value, reference[key]), key


def torch_equal(a, b):
    import torch
    return bool(torch.equal(a, b))
