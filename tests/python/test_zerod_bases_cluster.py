"""Jobs on a base across two nodes (docs/bases.md): a coordinator and two
node daemons of one rank each on loopback. A base made by a job whose
ranks are on both nodes, frozen; a LoRA job on it (its ranks on the base's
nodes) must end bit-identical to the same job with a private copy of the
base's weights; a second LoRA job on it gathers the base's units from each
node's cache."""

from __future__ import annotations

import json
import os
import subprocess

import torch

from conftest import binary, cluster, python, wait_for, worker_env  # noqa: F401 (fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "lora_worker.py")
TOKEN = "bases-cluster-token"


def ctl(c, *args):
    proc = subprocess.run([binary("zerodctl"), "-c", c.coordinator.address] + list(args),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, "zerodctl %s: %s%s" % (" ".join(args), proc.stdout, proc.stderr)
    return proc.stdout


def ready(c, job):
    return "state: ready" in ctl(c, "jobs", "get", job)


def run_ranks(nodes, tmp_path, job, *extra):
    """One worker per node, at once; their output files in rank order."""
    procs = []
    for i, node in enumerate(nodes):
        out = str(tmp_path / ("%s-%d.pt" % (job, i)))
        cmd = [python(), WORKER, "--socket", node.socket, "--job", job, "--token", TOKEN,
               "--out", out] + list(extra)
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=worker_env()), cmd, out))
    outs = []
    for proc, cmd, out in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, "%s\n%s\n%s\n%s" % (
            cmd, stdout, stderr, "\n".join(n.read_log()[-2000:] for n in nodes))
        outs.append(out)
    return outs


def test_lora_jobs_on_a_base_across_two_nodes_match_a_private_copy(cluster, tmp_path):
    cluster.start_coordinator()
    nodes = [cluster.start_node("node-%s" % n, ranks=1) for n in "ab"]
    wait_for("2 members", lambda: ctl(cluster, "members").count("node-") >= 2)

    ctl(cluster, "jobs", "create", "base", "--nodes", "2", "--ranks-per-node", "1",
        "--token", TOKEN)
    wait_for("base to be ready", lambda: ready(cluster, "base"))
    weights = run_ranks(nodes, tmp_path, "base", "--produce", "--steps", "3")[0]
    ctl(cluster, "jobs", "freeze", "base")
    for node in nodes:
        wait_for("%s to freeze the base" % node.name,
                 lambda: 'msg="job frozen: it is a base now" job=base' in node.read_log())

    on_base = []
    for name in ("lora-1", "lora-2"):
        ctl(cluster, "jobs", "create", name, "--base", "base", "--token", TOKEN)
        wait_for(name + " to be ready", lambda: ready(cluster, name))
        on_base.append(run_ranks(nodes, tmp_path, name, "--base", "base",
                                 "--weights-seed", "7"))
    ctl(cluster, "jobs", "create", "private", "--nodes", "2", "--ranks-per-node", "1",
        "--token", TOKEN)
    wait_for("private to be ready", lambda: ready(cluster, "private"))
    private = run_ranks(nodes, tmp_path, "private", "--init", weights)

    base_bytes = sum(v.numel() * 4 for v in torch.load(weights).values())
    for rank in range(2):
        a, b = torch.load(on_base[0][rank]), torch.load(private[rank])
        assert a["losses"] == b["losses"], (rank, a["losses"], b["losses"])
        assert list(a["state"]) == list(b["state"])
        for key in a["state"]:
            assert torch.equal(a["state"][key], b["state"][key]), (rank, key)
        second = torch.load(on_base[1][rank])
        assert second["losses"] == a["losses"]
        assert a["from_base"] and not b["from_base"]
        # Each node's cache served the second job the base's units: its
        # all-gathers moved at least the whole base less than the first
        # job's, which gathered the base once (the adapters' are alike).
        saved = a["all_gather_bytes"] - second["all_gather_bytes"]
        assert saved >= base_bytes, (rank, a["all_gather_bytes"], second["all_gather_bytes"],
                                     base_bytes)
    assert a["losses"][-1] < a["losses"][0]


def base_checkpoint(c, name):
    return json.loads(ctl(c, "jobs", "get", name, "--json"))["base_checkpoint"]


def test_a_restarted_node_gets_its_base_back_from_the_coordinators_checkpoint(cluster,
                                                                             tmp_path):
    """The base's node is SIGKILLed and restarted: it rebuilds the base's
    ranks with no shards, the coordinator (its own process, its state on
    disk) restores the base from the base's checkpoint, and a LoRA job
    afterwards trains exactly as one did before."""
    cluster.start_coordinator()
    node = cluster.start_node("node-a", ranks=1)
    wait_for("1 member", lambda: "node-a" in ctl(cluster, "members"))
    ctl(cluster, "jobs", "create", "base", "--ranks-per-node", "1", "--token", TOKEN)
    wait_for("base to be ready", lambda: ready(cluster, "base"))
    run_ranks([node], tmp_path, "base", "--produce", "--steps", "3")
    ctl(cluster, "jobs", "freeze", "base")
    wait_for("the base's checkpoint", lambda: base_checkpoint(cluster, "base") != "")
    ctl(cluster, "jobs", "create", "lora-1", "--base", "base", "--token", TOKEN)
    wait_for("lora-1 to be ready", lambda: ready(cluster, "lora-1"))
    before = run_ranks([node], tmp_path, "lora-1", "--base", "base", "--weights-seed", "7")

    node.restart()
    wait_for("the base's restore", lambda: 'msg="checkpoint restored" job=base '
             in cluster.coordinator.read_log(), timeout_s=60)
    assert 'msg="restore ordered" job=base' in node.read_log()
    ctl(cluster, "jobs", "create", "lora-2", "--base", "base", "--token", TOKEN)
    wait_for("lora-2 to be ready", lambda: ready(cluster, "lora-2"))
    after = run_ranks([node], tmp_path, "lora-2", "--base", "base", "--weights-seed", "7")
    a, b = torch.load(before[0]), torch.load(after[0])
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), key
