"""Jobs on a base through zerod.torch (docs/python.md, "Jobs on a base"): a
plain model sharded into a job that is then frozen (the base), and LoRA
jobs whose frozen layers are the base's units and whose adapters are their
own. Each LoRA job must end bit-identical (fp32, one rank: deterministic)
to the same job run with a private copy of the base (the base's weights as
the job's own frozen units); writes to base units are refused."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

import zerod
import zerod.torch
from conftest import binary, python, start_daemon, wait_for, worker_env  # noqa: F401 (fixture)
from torch_models import Block, TinyLM, batch

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "lora_worker.py")
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "python", "lora_jobs.py")
HAVE_PEFT = importlib.util.find_spec("peft") is not None
NO_PEFT = "peft is not installed here (scripts/deps.sh torch2 puts it in the torch2 lane)"


def zerodctl(daemon, *args):
    proc = subprocess.run([binary("zerodctl"), "-c", "unix:%s/control.sock" % daemon.dir]
                          + list(args), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, "zerodctl %s: %s%s" % (" ".join(args), proc.stdout, proc.stderr)
    return proc.stdout


def make_base(daemon, tmp_path, name="base", units="per-module", steps=3):
    """The base producer: shards the plain TinyLM into job `name`, trains it
    `steps` steps (so the base is not the initial weights), saves its
    weights for the private copies, detaches and freezes the job. Returns
    the weights file."""
    client = zerod.Client(daemon.socket)
    job = client.attach(name, rank=0, config=zerod.JobConfig(lr=1e-2, weight_decay=0.0))
    model = zerod.torch.shard(TinyLM(seed=0), job, units=[Block] if units == "blocks" else units)
    opt = zerod.torch.Optimizer(model)
    for step in range(steps):
        tokens, targets = batch(step, 8, seed=99)
        model(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    weights = str(tmp_path / ("%s.pt" % name))
    torch.save(model.state_dict(), weights)
    job.detach()
    client.close()
    zerodctl(daemon, "jobs", "freeze", name)
    return weights


def worker(daemon, tmp_path, job, base=None, init="", **kw):
    """The command of a LoRA worker (lora_worker.py) and its output file.
    On a base its local frozen weights are another model's (seed 7): only
    the base's may reach its forward passes."""
    out = str(tmp_path / ("%s.pt" % job))
    cmd = [python(), WORKER, "--socket", daemon.socket, "--job", job, "--out", out]
    if base:
        cmd += ["--base", base, "--weights-seed", "7"]
    else:
        cmd += ["--init", init]
    for key, value in kw.items():
        cmd += ["--" + key.replace("_", "-"), str(value)]
    return cmd, out


def run(cmd, out):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(), timeout=300)
    assert proc.returncode == 0, "%s\nstdout:\n%s\nstderr:\n%s" % (cmd, proc.stdout, proc.stderr)
    return torch.load(out)


def assert_identical(a, b):
    assert a["losses"] == b["losses"]
    assert list(a["state"]) == list(b["state"])
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), key


def plan_names(model, units="per-module", base=False):
    from zerod.torch._plan import _plan, _split_base

    plan = _plan(model, units)
    if base:
        plan = _split_base(plan, zerod.torch.base_name)
    return {u.name: (u.names, [tuple(s) for s in u.shapes]) for u in plan
            if not base or u.from_base}


@pytest.mark.parametrize("units", ["per-module", "blocks"])
@pytest.mark.parametrize("kind", ["plain", "peft"])
def test_the_frozen_units_are_named_as_the_plain_models(kind, units):
    if kind == "peft" and not HAVE_PEFT:
        pytest.skip(NO_PEFT)
    sys.path.insert(0, HERE)
    from lora_worker import lora_model

    policy = [Block] if units == "blocks" else units
    assert plan_names(lora_model(kind, "", 0, 1), policy, base=True) == \
        plan_names(TinyLM(), policy)


def test_lora_linear_starts_as_its_layer_and_trains_only_the_adapters():
    torch.manual_seed(0)
    linear = nn.Linear(6, 5)
    x = torch.randn(3, 6)
    expected = linear(x)
    lora = zerod.torch.LoRALinear(linear, r=2, alpha=4)
    assert lora.weight is linear.weight and lora.scaling == 2.0
    assert torch.equal(lora(x), expected)  # B starts at zero
    lora(x).sum().backward()
    assert linear.weight.grad is None and linear.bias.grad is None
    assert lora.lora_A.grad is not None and lora.lora_B.grad is not None
    model = zerod.torch.apply_lora(TinyLM(), ["up", "down"], r=2)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["blocks.%d.%s.lora_%s" % (b, m, ab) for b in range(2)
                         for m in ("up", "down") for ab in "AB"]
    with pytest.raises(zerod.InvalidArgumentError, match="no nn.Linear"):
        zerod.torch.apply_lora(TinyLM(), ["nothing"])


def test_lora_job_on_a_base_matches_a_private_copy(start_daemon, tmp_path):
    d = start_daemon(ranks=1)
    weights = make_base(d, tmp_path)
    on_base = run(*worker(d, tmp_path, "lora-base", base="base"))
    private = run(*worker(d, tmp_path, "lora-private", init=weights))
    # The frozen layers are the base's units, the adapters the job's own.
    assert "blocks.0.up" in on_base["from_base"] and "embed" in on_base["from_base"]
    assert "blocks.0.up#own" in on_base["own"]
    assert not any(name.endswith("#own") for name in on_base["from_base"])
    assert private["from_base"] == []
    assert_identical(on_base, private)
    # The adapters trained, and the frozen weights are still the base's.
    assert on_base["losses"][-1] < on_base["losses"][0]
    assert float(on_base["state"]["blocks.1.down.lora_B"].abs().max()) > 0
    base = torch.load(weights)
    for key, value in base.items():
        assert torch.equal(on_base["state"][key], value), key


def test_three_concurrent_lora_jobs_match_their_runs_alone(start_daemon, tmp_path):
    d = start_daemon(ranks=1)
    weights = make_base(d, tmp_path)
    procs = []
    for i in range(3):
        cmd, out = worker(d, tmp_path, "lora-%d" % i, base="base", data_seed=i + 1)
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=worker_env()), cmd, out))
    together = []
    for proc, cmd, out in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, "%s\n%s\n%s" % (cmd, stdout, stderr)
        together.append(torch.load(out))
    for i in range(3):
        alone = run(*worker(d, tmp_path, "alone-%d" % i, init=weights, data_seed=i + 1))
        assert_identical(together[i], alone)
    # Different data, different adapters.
    assert not torch.equal(together[0]["state"]["blocks.0.up.lora_B"],
                           together[1]["state"]["blocks.0.up.lora_B"])


def test_block_units_split_into_the_base_part_and_the_jobs(start_daemon, tmp_path):
    d = start_daemon(ranks=1)
    weights = make_base(d, tmp_path, units="blocks")
    on_base = run(*worker(d, tmp_path, "lora-base", base="base", units="blocks"))
    private = run(*worker(d, tmp_path, "lora-private", init=weights, units="blocks"))
    assert on_base["from_base"] == ["<root>", "blocks.0", "blocks.1"]
    assert on_base["own"] == ["blocks.0#own", "blocks.1#own"]
    assert_identical(on_base, private)


def lora_on_base(d, job="lora"):
    client = zerod.Client(d.socket)
    attached = client.attach(job, rank=0, config=zerod.JobConfig(lr=1e-2, base_job="base"))
    model = zerod.torch.apply_lora(TinyLM(seed=7), ["up", "down"], r=4, alpha=8)
    return client, attached, zerod.torch.shard(model, attached, base=True)


def test_base_units_are_read_only(start_daemon, tmp_path):
    d = start_daemon(ranks=1)
    make_base(d, tmp_path)
    client, job, model = lora_on_base(d)
    unit = job.unit("blocks.0.up")
    assert unit.from_base and "from the base" in repr(unit)
    own = job.unit("blocks.0.up#own")
    assert not own.from_base
    assert [t.name for t in own.tensors] == ["blocks.0.up.lora_A", "blocks.0.up.lora_B"]
    with pytest.raises(zerod.FailedPreconditionError):
        unit.grad_buffer()
    with pytest.raises(zerod.FailedPreconditionError):
        unit.load(np.zeros(unit.numel_packed, dtype=np.float32))
    with unit.gather() as gathered:
        assert not gathered.array().flags.writeable
    own.grad_buffer()  # the job's own units take gradients as ever
    own.reduce()
    # load_state_dict leaves the base's units alone and loads the adapters.
    state = model.state_dict()
    state["blocks.0.up.lora_B"] = torch.full_like(state["blocks.0.up.lora_B"], 0.5)
    state["blocks.0.up.weight"] = torch.zeros_like(state["blocks.0.up.weight"])
    model.load_state_dict(state)
    after = model.state_dict()
    assert torch.equal(after["blocks.0.up.lora_B"], state["blocks.0.up.lora_B"])
    assert not torch.equal(after["blocks.0.up.weight"], state["blocks.0.up.weight"])
    job.detach()
    client.close()
    # A write into a base unit's gathered tensor faults: the mapping is
    # read-only (in a process of its own, which it kills).
    code = ("import zerod, torch\n"
            "c = zerod.Client(%r)\n"
            "j = c.attach('writer', rank=0, config=zerod.JobConfig(base_job='base'))\n"
            "u = j.register('blocks.0.up', [('blocks.0.up.weight', (64, 32), True),\n"
            "                               ('blocks.0.up.bias', (64,), True)], from_base=True)\n"
            "t = u.gather().tensors()['blocks.0.up.weight']\n"
            "print('gathered', flush=True)\n"
            "t.add_(1.0)\n"
            "print('wrote', flush=True)\n" % d.socket)
    proc = subprocess.run([python(), "-c", code], capture_output=True, text=True,
                          env=worker_env(), timeout=120)
    assert "gathered" in proc.stdout and "wrote" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode in (-signal.SIGSEGV, -signal.SIGBUS), proc.returncode


def base_checkpoint(d, name="base"):
    """The checkpoint the coordinator saved of a freshly frozen base, once
    it is stored in the job ("" until then)."""
    return wait_for("base %s to be saved" % name, lambda: json.loads(
        zerodctl(d, "jobs", "get", name, "--json"))["base_checkpoint"], timeout_s=60)


def test_a_restarted_daemon_restores_its_base_from_the_bases_checkpoint(start_daemon, tmp_path):
    d = start_daemon(ranks=1)
    weights = make_base(d, tmp_path)
    name = base_checkpoint(d)
    assert name.startswith("step-00000003"), name
    before = run(*worker(d, tmp_path, "lora-a", base="base"))
    # The base's checkpoint stays while the base does.
    proc = subprocess.run([binary("zerodctl"), "-c", "unix:%s/control.sock" % d.dir,
                           "checkpoint", "delete", "base", name],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert ("FAILED_PRECONDITION: checkpoint 'base/%s' holds base 'base': its nodes are "
            "restored from it after a restart (delete the base first)" % name) in proc.stderr
    d.restart()  # SIGKILL: every shard in memory is gone
    wait_for("the base's restore",
             lambda: 'msg="checkpoint restored" job=base ' in d.read_log(), timeout_s=60)
    listed = zerodctl(d, "bases", "list")
    assert name in listed, listed
    # A new job on the restored base trains exactly as one did before the
    # restart, and sees the base's weights.
    after = run(*worker(d, tmp_path, "lora-b", base="base"))
    assert_identical(before, after)
    for key, value in torch.load(weights).items():
        assert torch.equal(after["state"][key], value), key
    # Restored once: it is whole again, so the next ticks leave it be.
    time.sleep(1.0)
    assert d.read_log().count("recovery started") == 1, d.read_log()[-4000:]


def write_safetensors(path, tensors):
    """A .safetensors file of fp32 tensors, by name, written by hand (the
    torch2 lane has no safetensors package)."""
    header, blobs, at = {}, [], 0
    for name in sorted(tensors):
        data = tensors[name].detach().to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    encoded = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def test_a_base_made_from_a_safetensors_file(start_daemon, tmp_path):
    """A job with no units restored from a safetensors file takes one unit
    per module from it (tensors by name: "bias" before "weight", not the
    model's order); frozen, it is a base that a LoRA job refers to by name
    and trains on exactly as on a private copy of those weights."""
    d = start_daemon(ranks=1, extra=["--export-root", str(tmp_path)])
    model = TinyLM(seed=3)
    weights = str(tmp_path / "weights.pt")
    torch.save(model.state_dict(), weights)
    source = str(tmp_path / "model.safetensors")
    write_safetensors(source, model.state_dict())
    zerodctl(d, "jobs", "create", "st-base", "--ranks-per-node", "1", "--token", "st-token")
    zerodctl(d, "checkpoint", "restore", "st-base", source)
    zerodctl(d, "jobs", "freeze", "st-base")
    client = zerod.Client(d.socket)
    job = client.attach("st-base", rank=0, token="st-token")
    units = {u.name: [t.name for t in u.tensors] for u in job.list_units()}
    job.detach()
    client.close()
    assert units["blocks.0.up"] == ["blocks.0.up.bias", "blocks.0.up.weight"], units
    # Every module's unit, and the buffer the file also has ("gain", at the
    # root), which no job refers to.
    assert set(units) == set(plan_names(TinyLM())) | {"<root>"}, units
    assert units["<root>"] == ["gain"], units
    on_base = run(*worker(d, tmp_path, "lora-st", base="st-base"))
    private = run(*worker(d, tmp_path, "lora-st-private", init=weights))
    assert_identical(on_base, private)
    # A base its job's quota cannot hold is refused as it is made (by the
    # restore that would make its units), not at a job's first gather.
    zerodctl(d, "jobs", "create", "st-small", "--ranks-per-node", "1",
             "--max-host-bytes", "4096", "--token", "st-token")
    proc = subprocess.run([binary("zerodctl"), "-c", "unix:%s/control.sock" % d.dir,
                           "checkpoint", "restore", "st-small", source],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, proc.stdout
    assert "RESOURCE_EXHAUSTED" in proc.stderr and "over the job's max_host_bytes quota of " \
        "4096 bytes per rank" in proc.stderr, proc.stderr
    client = zerod.Client(d.socket)
    job = client.attach("st-small", rank=0, token="st-token")
    assert job.list_units() == []
    job.detach()
    client.close()
    # A file that is not a model's is refused naming it, and nothing is made.
    bad = str(tmp_path / "bad.safetensors")
    with open(bad, "wb") as f:
        f.write(struct.pack("<Q", 10 ** 6) + b"{}")
    zerodctl(d, "jobs", "create", "st-bad", "--ranks-per-node", "1")
    proc = subprocess.run([binary("zerodctl"), "-c", "unix:%s/control.sock" % d.dir,
                           "checkpoint", "restore", "st-bad", bad],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "bad.safetensors" in proc.stderr, proc.stderr


def test_reference_that_does_not_match_the_base_is_refused(start_daemon, tmp_path):
    d = start_daemon(ranks=1)
    make_base(d, tmp_path)
    client = zerod.Client(d.socket)
    job = client.attach("wrong", rank=0, config=zerod.JobConfig(base_job="base"))
    with pytest.raises(zerod.InvalidArgumentError, match="blocks.0.up"):
        job.register("blocks.0.up", [("blocks.0.up.weight", (64, 16), True),
                                     ("blocks.0.up.bias", (64,), True)], from_base=True)
    client.close()


def test_shard_on_a_base_needs_a_job_with_a_base(start_daemon):
    d = start_daemon(ranks=1)
    client = zerod.Client(d.socket)
    job = client.attach("nobase", rank=0)
    model = zerod.torch.apply_lora(TinyLM(), ["up"], r=2)
    with pytest.raises(zerod.ShardingError, match="no base"):
        zerod.torch.shard(model, job, base=True)
    client.close()


@pytest.mark.skipif(not HAVE_PEFT, reason=NO_PEFT)
def test_peft_lora_trains_on_a_base(start_daemon, tmp_path):
    d = start_daemon(ranks=1)
    weights = make_base(d, tmp_path)
    on_base = run(*worker(d, tmp_path, "peft-base", base="base", lora="peft"))
    private = run(*worker(d, tmp_path, "peft-private", init=weights, lora="peft"))
    assert "blocks.0.up" in on_base["from_base"]
    assert "base_model.model.blocks.0.up.lora_A.default" in on_base["own"]
    assert_identical(on_base, private)
    assert on_base["losses"][-1] < on_base["losses"][0]
    key = "base_model.model.blocks.1.down.lora_B.default.weight"
    assert float(on_base["state"][key].abs().max()) > 0


def test_lora_jobs_example_runs(start_daemon, tmp_path):
    proc = subprocess.run([python(), EXAMPLE, "--zerod-bin", binary("zerod"), "--steps", "5"],
                          capture_output=True, text=True, env=worker_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for tenant in ("team-a", "team-b", "team-c"):
        assert "[%s] done:" % tenant in proc.stdout, proc.stdout
