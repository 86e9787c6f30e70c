"""Recovery of a job whose node restarts (docs/checkpoints.md, "Recovery"):
a coordinator and one node daemon on loopback. The node is SIGKILLed and
restarted, losing every shard in memory; the coordinator restores each of
its jobs from the job's newest checkpoint on its own, says how many steps
were lost, and keeps workers out until then. Training then goes on from
the checkpoint exactly as it did the first time from that step."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import torch

from conftest import cluster, ctl, job, python, wait_for, worker_env  # noqa: F401 (fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "lora_worker.py")
TOKEN = "recovery-token"


def train(node, tmp_path, name, tag, steps, init):
    """A worker of job `name` (TinyLM with LoRA, its frozen weights the
    job's own units from `init`) for `steps` steps; its output."""
    out = str(tmp_path / ("%s-%s.pt" % (name, tag)))
    cmd = [python(), WORKER, "--socket", node.socket, "--job", name, "--token", TOKEN,
           "--init", init, "--steps", str(steps), "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(), timeout=300)
    assert proc.returncode == 0, "%s\n%s\n%s\n%s" % (cmd, proc.stdout, proc.stderr,
                                                     node.read_log()[-3000:])
    return torch.load(out)


def test_a_job_whose_node_restarts_comes_back_from_its_newest_checkpoint(cluster, tmp_path):
    cluster.start_coordinator()
    node = cluster.start_node("node-a", ranks=1)
    wait_for("the node", lambda: "node-a" in ctl(cluster, "members").stdout)
    init = str(tmp_path / "init.pt")
    from torch_models import TinyLM

    torch.save(TinyLM(seed=5).state_dict(), init)
    for name in ("train", "reference", "unsaved"):
        ctl(cluster, "jobs", "create", name, "--ranks-per-node", "1", "--token", TOKEN)
        wait_for(name + " to be ready", lambda: job(cluster, name)["state"] == "ready")
        train(node, tmp_path, name, "first", 4, init)
    saved = json.loads(ctl(cluster, "checkpoint", "save", "train", "--json").stdout)
    assert saved["checkpoint"]["step"] == 4, saved
    # Both go on 3 steps from step 4; the reference's are what the
    # recovered job must do again after losing them.
    want = train(node, tmp_path, "reference", "then", 3, init)
    lost = train(node, tmp_path, "train", "then", 3, init)
    assert lost["losses"] == want["losses"]
    # The coordinator knows the step from the node's heartbeats.
    wait_for("train's step 7", lambda: job(cluster, "train")["step"] == 7)

    node.restart()  # SIGKILL: every shard in memory is gone
    coordinator_log = cluster.coordinator.read_log
    wait_for("the recovery of train",
             lambda: 'msg="recovered from a checkpoint" job=train step=4 lost_steps=3'
             in coordinator_log())
    assert 'msg="job rebuilt here after its state was lost: no worker until it is recovered" ' \
        'job=train' in node.read_log()
    got = job(cluster, "train")
    assert got["step"] == 4, got
    assert got["last_recovery"] == ("state lost on a node at step 7; restored from the "
                                    "checkpoint of step 4: 3 steps lost"), got
    described = ctl(cluster, "jobs", "get", "train").stdout
    assert "last recovery: state lost on a node at step 7" in described, described
    # A job with no checkpoint starts empty, and says so.
    wait_for("unsaved to be settled", lambda: job(cluster, "unsaved")["last_recovery"] != "")
    assert job(cluster, "unsaved")["last_recovery"] == \
        "state lost on a node at step 4; no checkpoint: started empty"

    again = train(node, tmp_path, "train", "again", 3, init)
    assert again["losses"] == want["losses"]
    for key in want["state"]:
        assert torch.equal(again["state"][key], want["state"][key]), key


def train_ranks(nodes, tmp_path, name, tag, steps, init):
    """One worker per node (a rank each) of job `name`, at once; their
    outputs in rank order."""
    procs = []
    for i, node in enumerate(nodes):
        out = str(tmp_path / ("%s-%s-%d.pt" % (name, tag, i)))
        cmd = [python(), WORKER, "--socket", node.socket, "--job", name, "--token", TOKEN,
               "--init", init, "--steps", str(steps), "--out", out]
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=worker_env()), cmd, out))
    outs = []
    for proc, cmd, out in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, "%s\n%s\n%s" % (cmd, stdout, stderr)
        outs.append(torch.load(out))
    return outs


def test_a_job_across_nodes_is_rebuilt_when_its_lost_node_comes_back(cluster, tmp_path):
    """Node b of a 2-node job is SIGKILLed and restarted: once it is a member
    again, both nodes build the job's ranks afresh (node a drops the ranks
    it kept), and the coordinator restores the job from its newest
    checkpoint; training goes on exactly as it did from that step."""
    cluster.start_coordinator()
    nodes = [cluster.start_node("node-%s" % n, ranks=1) for n in "ab"]
    wait_for("2 members", lambda: ctl(cluster, "members").stdout.count("node-") >= 2)
    init = str(tmp_path / "init.pt")
    from torch_models import TinyLM

    torch.save(TinyLM(seed=6).state_dict(), init)
    for name in ("wide", "wide-ref"):
        ctl(cluster, "jobs", "create", name, "--nodes", "2", "--ranks-per-node", "1", "--token",
            TOKEN)
        wait_for(name + " to be ready", lambda: job(cluster, name)["state"] == "ready")
        train_ranks(nodes, tmp_path, name, "first", 3, init)
    ctl(cluster, "checkpoint", "save", "wide")
    want = train_ranks(nodes, tmp_path, "wide-ref", "then", 2, init)
    train_ranks(nodes, tmp_path, "wide", "then", 2, init)
    wait_for("wide's step 5", lambda: job(cluster, "wide")["step"] == 5)

    nodes[1].restart()
    wait_for("the recovery of wide",
             lambda: 'msg="recovered from a checkpoint" job=wide step=3 lost_steps=2'
             in cluster.coordinator.read_log())
    assert 'msg="job rebuilt: its ranks here start afresh" job=wide' in \
        nodes[0].read_log()
    assert job(cluster, "wide")["state"] == "ready"
    again = train_ranks(nodes, tmp_path, "wide", "again", 2, init)
    for rank in range(2):
        assert again[rank]["losses"] == want[rank]["losses"], rank
        for key in want[rank]["state"]:
            assert torch.equal(again[rank]["state"][key], want[rank]["state"][key]), (rank, key)


def test_a_stopped_node_is_named_and_its_peers_fail_cleanly(cluster, tmp_path):
    """Node b of a 2-node job is SIGSTOPped mid-training: once its lease (2 s)
    runs out the coordinator names it in the job's reason, and the worker on
    node a fails with that reason: its collective was ended for it, not by
    the collective timeout (60 s here), whose error would name no node."""
    cluster.start_coordinator(lease_ttl_s=2.0)
    nodes = [cluster.start_node("node-%s" % n, ranks=1, timeout_s=60) for n in "ab"]
    wait_for("2 members", lambda: ctl(cluster, "members").stdout.count("node-") >= 2)
    init = str(tmp_path / "init.pt")
    from torch_models import TinyLM

    torch.save(TinyLM(seed=8).state_dict(), init)
    ctl(cluster, "jobs", "create", "hang", "--nodes", "2", "--ranks-per-node", "1", "--token",
        TOKEN)
    wait_for("hang to be ready", lambda: job(cluster, "hang")["state"] == "ready")
    procs = []
    for i, node in enumerate(nodes):
        cmd = [python(), WORKER, "--socket", node.socket, "--job", "hang", "--token", TOKEN,
               "--init", init, "--steps", "100000", "--out", str(tmp_path / ("hang-%d.pt" % i))]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=worker_env()))
    wait_for("training", lambda: job(cluster, "hang")["step"] >= 3, timeout_s=120)
    nodes[1].proc.send_signal(signal.SIGSTOP)
    try:
        wait_for("node-b to be named", lambda: "node 'node-b' left the cluster"
                 in job(cluster, "hang")["reason"], timeout_s=20)
        assert job(cluster, "hang")["state"] == "degraded"
        out, err = procs[0].communicate(timeout=300)
        assert procs[0].returncode != 0
        assert "node 'node-b' left the cluster" in err, err[-2000:]
        assert "timed out" not in err, err[-2000:]
    finally:
        nodes[1].proc.send_signal(signal.SIGCONT)
        procs[1].kill()
        procs[1].communicate()
