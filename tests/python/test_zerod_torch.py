"""zerod.torch against plain PyTorch: the same model, data and seed trained
through a real daemon and with torch.optim.AdamW must end with the same
parameters; errors must name what went wrong."""

from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest
import torch
from torch import nn

import zerod
import zerod.torch
from conftest import python, start_daemon, worker_env  # noqa: F401 (fixture)
from torch_models import Block, TinyLM, batch, train

torch.set_num_threads(1)
LR = 1e-2
WEIGHT_DECAY = 0.01


def plain(steps=20, batch=8, **kw):
    model = TinyLM(tie=kw.pop("tie", False))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = train(model, opt, steps, batch, **kw)
    return model.state_dict(), losses


def attach(daemon, job="t", rank=0, **config):
    client = zerod.Client(daemon.socket)
    cfg = zerod.JobConfig(lr=LR, weight_decay=WEIGHT_DECAY, **config)
    return client, client.attach(job, rank=rank, config=cfg)


def through_zerod(daemon, steps=20, batch=8, units="per-module", tie=False, **kw):
    client, job = attach(daemon)
    model = zerod.torch.shard(TinyLM(tie=tie), job, units=units)
    opt = zerod.torch.Optimizer(model)
    losses = train(model, opt, steps, batch, zerod_opt=True, **kw)
    state = model.state_dict()
    job.detach()
    client.close()
    return state, losses, opt


def max_rel_diff(a, b):
    """The largest max|a - b| / max|b| over the tensors of two state dicts
    (each tensor's error relative to its own scale)."""
    assert list(a) == list(b)
    worst = 0.0
    for key in a:
        assert a[key].shape == b[key].shape, key
        diff = float((a[key].float() - b[key].float()).abs().max())
        worst = max(worst, diff / max(float(b[key].float().abs().max()), 1e-12))
    return worst


def test_one_rank_matches_torch_adamw(start_daemon):
    expected, plain_losses = plain()
    got, losses, opt = through_zerod(start_daemon(ranks=1))
    assert max_rel_diff(got, expected) <= 1e-5
    assert losses[-1] < losses[0]
    assert opt.last_step.step == 20 and opt.last_step.version == 20
    # The buffer stays local and comes back in the state dict.
    assert torch.equal(got["gain"], expected["gain"])


@pytest.mark.parametrize("units", ["per-module", "blocks", "callable"])
def test_unit_policies_agree(start_daemon, units):
    policy = {"per-module": "per-module", "blocks": [Block],
              "callable": lambda m, name: name.startswith("blocks.") and name.count(".") == 1}[units]
    expected, _ = plain(steps=5)
    got, _, _ = through_zerod(start_daemon(ranks=1), steps=5, units=policy)
    assert max_rel_diff(got, expected) <= 1e-5


def test_accumulation_clipping_schedule_match_torch(start_daemon):
    kw = dict(steps=20, accum=3, clip=0.05, use_schedule=True)
    expected, _ = plain(**kw)
    got, _, opt = through_zerod(start_daemon(ranks=1), **kw)
    assert max_rel_diff(got, expected) <= 1e-5
    # The clip was active: the norm before clipping is above the bound.
    assert opt.last_step.grad_norm > 0.05


def decay_groups(model, lr):
    """The usual recipe: no weight decay on norms and biases, and those at
    twice the learning rate (so that both hyper-parameters differ)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or ".norm" in name or name.startswith("norm")
         else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 2 * lr}]


def test_param_groups_match_torch_adamw(start_daemon):
    """Two parameter groups (no decay on norms and biases, another lr) and a
    per-group LambdaLR schedule: the weights of torch.optim.AdamW with the
    same groups, and the optimizer state has both groups."""
    lambdas = [lambda s: 1.0, lambda s: 0.8 ** s]
    reference = TinyLM()
    opt = torch.optim.AdamW(decay_groups(reference, LR), lr=LR)
    steps_from(reference, opt, 0, 10, sched=torch.optim.lr_scheduler.LambdaLR(opt, lambdas))
    client, job = attach(start_daemon(ranks=1))
    model = zerod.torch.shard(TinyLM(), job)
    zopt = zerod.torch.Optimizer(model, decay_groups(model.module, LR), lr=LR)
    steps_from(model, zopt, 0, 10, sched=torch.optim.lr_scheduler.LambdaLR(zopt, lambdas))
    assert max_rel_diff(model.state_dict(), reference.state_dict()) <= 1e-6
    saved = zopt.state_dict()
    assert [g["weight_decay"] for g in saved["param_groups"]] == [0.1, 0.0]
    assert [len(g["params"]) for g in saved["param_groups"]] == [
        len(g["params"]) for g in opt.state_dict()["param_groups"]]
    with pytest.raises(zerod.ShardingError, match="takes its parameter groups when it is made"):
        zopt.add_param_group({"params": []})
    with pytest.raises(zerod.InvalidArgumentError, match="are in no group"):
        zerod.torch.Optimizer(model, decay_groups(model.module, LR)[:1])
    with pytest.raises(zerod.InvalidArgumentError, match="unknown optimizer options"):
        zerod.torch.Optimizer(model, lr=LR, amsgrad=True)
    client.close()


def test_optimizer_keyword_defaults_reach_the_daemon(start_daemon):
    """Optimizer(model, weight_decay=0.0) on a job made with 0.01 steps
    as torch.optim.AdamW(weight_decay=0.0) does, not as the job's config."""
    reference = TinyLM()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    steps_from(reference, opt, 0, 5)
    client, job = attach(start_daemon(ranks=1))  # weight_decay=WEIGHT_DECAY
    model = zerod.torch.shard(TinyLM(), job)
    steps_from(model, zerod.torch.Optimizer(model, lr=LR, weight_decay=0.0), 0, 5)
    assert max_rel_diff(model.state_dict(), reference.state_dict()) <= 1e-6
    client.close()


def test_fp16_loss_scaling_follows_grad_scaler(start_daemon):
    """An fp16 working copy with dynamic loss scaling, overflows injected at
    chosen steps: the daemon skips the same steps and moves the scale the
    same way as torch.amp.GradScaler (init 1024, growth every 3 good steps,
    backoff 0.5), and the steps it takes train."""
    if not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"):
        pytest.skip("torch %s has no CPU GradScaler (torch.amp.GradScaler: torch 2.3 or "
                    "later; the torch 2 lane runs this)" % torch.__version__)
    overflow = {2, 3, 9}
    steps = 14
    reference = TinyLM()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=3)
    expected = []
    for step in range(steps):
        tokens, targets = batch(step, 8)
        loss = reference(tokens, targets) * (float("inf") if step in overflow else 1.0)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        expected.append((scale, scaler.get_scale() < scale))
    client, job = attach(start_daemon(ranks=1), dtype="float16", loss_scale=1024.0,
                         loss_scale_window=3)
    model = zerod.torch.shard(TinyLM().to(torch.float16), job)
    zopt = zerod.torch.Optimizer(model)
    got, losses = [], []
    for step in range(steps):
        tokens, targets = batch(step, 8)
        loss = model(tokens, targets)
        losses.append(float(loss))
        scale = zopt.loss_scale
        zopt.scale(loss * (float("inf") if step in overflow else 1.0)).backward()
        zopt.step()
        zopt.zero_grad()
        got.append((scale, zopt.last_step.skipped))
    assert got == expected
    assert zopt.last_step.step == steps - len(overflow)
    assert losses[-1] < losses[0]
    client.close()


def test_torch_clip_grad_norm_clips_a_sharded_model(start_daemon):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), c) on a sharded
    model, after the opt-in zerod.torch.patch_clip_grad_norm_(), returns the
    global norm (the daemon's, of every rank's gradients) and the step clips
    by it: the norms and weights of a plain torch run."""
    restore = zerod.torch.patch_clip_grad_norm_()
    try:
        clip_through_torchs_name(start_daemon)
    finally:
        restore()
    assert torch.nn.utils.clip_grad_norm_ is not zerod.torch.clip_grad_norm_


def clip_through_torchs_name(start_daemon):
    reference = TinyLM()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    client, job = attach(start_daemon(ranks=1))
    model = zerod.torch.shard(TinyLM(), job)
    zopt = zerod.torch.Optimizer(model)
    for step in range(8):
        tokens, targets = batch(step, 8)
        norms = []
        for m, o in ((reference, opt), (model, zopt)):
            m(tokens, targets).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
            o.step()
            o.zero_grad()
        assert norms[1] == pytest.approx(norms[0], rel=1e-5), (step, norms)
        assert norms[0] > 0.05  # the clip acts
    assert max_rel_diff(model.state_dict(), reference.state_dict()) <= 1e-5
    with pytest.raises(zerod.ShardingError, match="pass model.parameters"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[:1], 1.0)
    # Other parameters still go to torch's own function.
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 4.0)
    assert float(torch.nn.utils.clip_grad_norm_([p], 1.0)) == pytest.approx(48 ** 0.5)
    client.close()


def test_model_clip_grad_norm_clips_without_touching_torch(start_daemon):
    """FSDP's form, model.clip_grad_norm_(c): the same norms and weights as
    a plain torch run; importing zerod.torch left torch's function alone."""
    assert torch.nn.utils.clip_grad_norm_ is zerod.torch._clip._torch_clip_grad_norm_
    reference = TinyLM()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    client, job = attach(start_daemon(ranks=1))
    model = zerod.torch.shard(TinyLM(), job)
    zopt = zerod.torch.Optimizer(model)
    for step in range(4):
        tokens, targets = batch(step, 8)
        reference(tokens, targets).backward()
        expected = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
        model(tokens, targets).backward()
        got = float(model.clip_grad_norm_(0.05))
        assert got == pytest.approx(expected, rel=1e-5), step
        for o in (opt, zopt):
            o.step()
            o.zero_grad()
    assert max_rel_diff(model.state_dict(), reference.state_dict()) <= 1e-5
    client.close()


def test_tied_weights(start_daemon):
    expected, _ = plain(steps=10, tie=True)
    got, _, _ = through_zerod(start_daemon(ranks=1), steps=10, tie=True)
    assert max_rel_diff(got, expected) <= 1e-5
    assert torch.equal(got["embed.weight"], got["head.weight"])


def test_two_ranks_match_torch_on_the_combined_batch(start_daemon, tmp_path):
    daemon = start_daemon(ranks=2)
    dump = tmp_path / "state.pt"
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([python(), os.path.join(here, "torch_worker.py"), "--socket",
                               daemon.socket, "--rank", str(r), "--steps", "20", "--batch", "8",
                               "--lr", str(LR), "--dump", str(dump)],
                              env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    expected, _ = plain(steps=20, batch=8)
    got = torch.load(dump)
    # Each rank's loss is the mean over its half of the batch and the daemon
    # averages the two gradients: the mean over the whole batch, up to
    # float rounding in a different order of summation.
    assert max_rel_diff(got, expected) <= 5e-5  # measured: 4.4e-6


def test_state_dict_round_trip(start_daemon):
    client, job = attach(start_daemon(ranks=1))
    model = zerod.torch.shard(TinyLM(), job)
    fresh = TinyLM(seed=7)
    model.load_state_dict(fresh.state_dict())
    got = model.state_dict()
    assert max_rel_diff(got, fresh.state_dict()) == 0
    # The loaded values are what the next forward uses.
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with torch.no_grad():
        assert float(model(tokens, tokens)) == float(fresh(tokens, tokens))
    # And a plain model loads what state_dict returned.
    plain_model = TinyLM(seed=3)
    plain_model.load_state_dict(got)
    with pytest.raises(RuntimeError, match="missing keys"):
        model.load_state_dict({"embed.weight": got["embed.weight"]})
    # strict=False loads what the dict has and keeps the rest.
    model.load_state_dict({"embed.weight": torch.zeros(64, 32)}, strict=False)
    partial = model.state_dict()
    assert torch.equal(partial["embed.weight"], torch.zeros(64, 32))
    assert torch.equal(partial["head.weight"], got["head.weight"])
    with pytest.raises(RuntimeError, match=r"size mismatch for head\.weight"):
        model.load_state_dict({**got, "head.weight": torch.zeros(3, 3)})
    client.close()


def steps_from(model, opt, first, count, batch_size=8, sched=None):
    for step in range(first, first + count):
        tokens, targets = batch(step, batch_size)
        model(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def trained(daemon, name, steps, seed=0):
    """Job `name` with TinyLM(seed) sharded into it, after `steps` steps:
    (client, model, optimizer)."""
    client, job = attach(daemon, job=name)
    model = zerod.torch.shard(TinyLM(seed=seed), job)
    opt = zerod.torch.Optimizer(model)
    steps_from(model, opt, 0, steps)
    return client, model, opt


def test_optimizer_state_saves_and_resumes_bit_exact(start_daemon, tmp_path):
    """torch.save of the model's and the optimizer's state_dict after 3
    steps, torch.load into a fresh job and model, 3 more steps: the same
    bits as 6 steps without a stop. The optimizer state has torch.optim's
    keys and shapes, and its moments agree with torch.optim.AdamW's."""
    daemon = start_daemon(ranks=1)
    client, model, _ = trained(daemon, "straight", 6)
    straight = model.state_dict()
    client.close()

    client, model, opt = trained(daemon, "first", 3)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = opt.state_dict()
    client.close()

    reference = TinyLM()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    steps_from(reference, torch_opt, 0, 3)
    theirs = torch_opt.state_dict()
    assert sorted(saved["state"]) == sorted(theirs["state"])
    for index, entry in theirs["state"].items():
        assert sorted(saved["state"][index]) == sorted(entry), index
        assert float(saved["state"][index]["step"]) == float(entry["step"]) == 3.0
        for name in ("exp_avg", "exp_avg_sq"):
            ours, want = saved["state"][index][name], entry[name]
            assert ours.shape == want.shape and ours.dtype == torch.float32
            scale = float(want.abs().max())
            assert float((ours - want).abs().max()) <= 1e-5 * scale, (index, name)
    assert saved["param_groups"][0]["params"] == theirs["param_groups"][0]["params"]

    loaded = torch.load(tmp_path / "ckpt.pt")
    client, model, opt = trained(daemon, "resumed", 0, seed=5)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["opt"])
    steps_from(model, opt, 3, 3)
    assert max_rel_diff(model.state_dict(), straight) == 0
    with pytest.raises(zerod.ShardingError, match="parameters were stepped"):
        bad = {"state": {**loaded["opt"]["state"]}, "param_groups": loaded["opt"]["param_groups"]}
        bad["state"][0] = {**bad["state"][0], "step": torch.tensor(7.0)}
        opt.load_state_dict(bad)
    with pytest.raises(zerod.ShardingError, match="has 1 parameters"):
        opt.load_state_dict({"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]})
    client.close()


def on_ranks(daemon, ranks, body, job="svc", **config):
    """Runs body(rank, model, opt) on `ranks` threads, each attached as one
    rank of `job` with TinyLM sharded (the library's calls leave the GIL, so
    the ranks' collectives meet); returns the results by rank and re-raises
    the first failure."""
    results, errors = [None] * ranks, []
    barrier = threading.Barrier(ranks)
    # Built here, one after another: TinyLM seeds torch's global generator,
    # which threads building theirs at once would interleave.
    modules = [TinyLM() for _ in range(ranks)]

    def run(rank):
        client = None
        try:
            client, job_ = attach(daemon, job=job, rank=rank, **config)
            model = zerod.torch.shard(modules[rank], job_)
            opt = zerod.torch.Optimizer(model)
            barrier.wait()
            results[rank] = body(rank, model, opt)
        except BaseException as e:  # noqa: B902 (re-raised below)
            errors.append(e)
            barrier.abort()
        finally:
            if client is not None:
                client.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def test_service_checkpoint_saves_and_restores_in_training(start_daemon):
    """zerod.torch.save takes a service checkpoint from inside the training
    loop of two ranks (the daemon writes the shards; nothing is gathered);
    after 3 more steps zerod.torch.load brings the job back to it, and the
    same 3 steps again give the same bits. Failed calls change nothing."""
    daemon = start_daemon(ranks=2)

    def body(rank, model, opt):
        steps_from(model, opt, 0, 3)
        at_save = model.state_dict()
        moments = opt.state_dict()["state"]
        info = zerod.torch.save(model, "mid")
        assert (info.name, info.step) == ("mid", 3)
        steps_from(model, opt, 3, 3)
        straight = model.state_dict()
        assert max_rel_diff(straight, at_save) > 0

        info = zerod.torch.load(opt, "mid")  # the Optimizer names the job too
        assert (info.name, info.step) == ("mid", 3)
        assert max_rel_diff(model.state_dict(), at_save) == 0
        restored = opt.state_dict()["state"]
        for index, entry in moments.items():
            for key, value in entry.items():
                assert torch.equal(restored[index][key], value), (index, key)
        steps_from(model, opt, 3, 3)
        assert max_rel_diff(model.state_dict(), straight) == 0

        # A checkpoint that is not there, or a name taken: an error on every
        # rank, and the job goes on from where it was.
        with pytest.raises(zerod.NotFoundError, match="nope"):
            zerod.torch.load(model, "nope")
        with pytest.raises(zerod.AlreadyExistsError, match="mid"):
            zerod.torch.save(model, "mid")
        with pytest.raises(zerod.InvalidArgumentError, match="not a checkpoint of this job"):
            zerod.torch.load(model, "other/mid")
        # Ranks that disagree: refused on both, nothing saved.
        with pytest.raises(zerod.FailedPreconditionError, match="named different checkpoints"):
            zerod.torch.save(model, "a%d" % rank)
        assert max_rel_diff(model.state_dict(), straight) == 0
        unnamed = zerod.torch.save(model)
        steps_from(model, opt, 6, 1)
        return unnamed

    unnamed = on_ranks(daemon, 2, body)
    assert unnamed[0] == unnamed[1]
    assert (unnamed[0].name, unnamed[0].step) == ("step-00000006", 6)
    saved = sorted(p.name for p in (daemon.dir / "checkpoints" / "svc").iterdir())
    assert saved == ["mid", "step-00000006"]
    manifest = json.loads((daemon.dir / "checkpoints" / "svc" / "mid" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 2


def test_service_checkpoint_resumes_in_a_new_daemon(start_daemon, tmp_path):
    """The usual resume: a daemon that saved (zerod.torch.save) is gone; a
    new one with the same checkpoint directory, a fresh job of the same
    name, a model initialised differently, zerod.torch.load, and the next
    steps give the bits of a run that never stopped."""
    ckpt = tmp_path / "ckpt"
    first = start_daemon(ranks=1, extra=["--checkpoint-dir", str(ckpt)])
    client, model, opt = trained(first, "lm", 3)
    assert zerod.torch.save(opt, "resume").step == 3
    steps_from(model, opt, 3, 3)
    straight = model.state_dict()
    client.close()
    first.stop()

    second = start_daemon(ranks=1, extra=["--checkpoint-dir", str(ckpt)])
    client, model, opt = trained(second, "lm", 0, seed=5)
    assert max_rel_diff(model.state_dict(), straight) > 0
    info = zerod.torch.load(model, "resume")
    assert (info.name, info.step) == ("resume", 3)
    steps_from(model, opt, 3, 3)
    assert max_rel_diff(model.state_dict(), straight) == 0
    client.close()


NVME = {"device": "nvme", "buffer_count": 3, "buffer_size": 1024}


def offloaded(daemon, name, steps, offload=NVME, seed=0, **config):
    """Job `name` with TinyLM(seed) sharded into it and its optimizer state
    placed by `offload`, after `steps` steps: (client, model, optimizer)."""
    client = zerod.Client(daemon.socket)
    config.setdefault("lr", LR)
    config.setdefault("weight_decay", WEIGHT_DECAY)
    job = client.attach(name, rank=0, config=zerod.JobConfig(offload_optimizer=offload, **config))
    module = TinyLM(seed=seed)
    if config.get("dtype") == "bfloat16":
        module = module.to(torch.bfloat16)
    model = zerod.torch.shard(module, job)
    opt = zerod.torch.Optimizer(model)
    steps_from(model, opt, 0, steps)
    return client, model, opt


@pytest.mark.parametrize("config,states", [
    ({}, 3),                                       # AdamW: master, exp_avg, exp_avg_sq
    ({"dtype": "bfloat16"}, 3),                    # a bf16 working copy of its own
    ({"optimizer": "sgd", "momentum": 0.9}, 2),    # master, momentum_buffer
    ({"optimizer": "sgd", "weight_decay": 0.0}, 1),  # master alone
])
def test_nvme_offload_trains_like_memory(start_daemon, config, states):
    """offload_optimizer nvme: the master weights and moments live in a file
    of the rank's, streamed through three 1024-element buffers per state
    (many chunks, crossing units), and training gives the bits of the
    in-memory job: weights, moments and steps, for each optimizer and
    working precision. The file has each unit's master and moments,
    4 KiB-aligned, and goes with the daemon."""
    daemon = start_daemon(ranks=1)
    client, model, opt = offloaded(daemon, "mem", 6, offload=None, **config)
    want, want_state = model.state_dict(), opt.state_dict()
    client.close()

    client, model, opt = offloaded(daemon, "nv", 6, **config)
    assert opt._job.effective_config.offload_optimizer == {
        "device": "nvme", "nvme_path": "", "buffer_count": 3, "buffer_size": 1024,
        "pin_memory": False}
    assert max_rel_diff(model.state_dict(), want) == 0
    got_state = opt.state_dict()
    for index, entry in want_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(got_state["state"][index][key], value), (index, key)
    (tier,) = (daemon.dir / "nvme").glob("nv-*/rank-00000.zdtier")
    assert tier.stat().st_size == sum(states * ((4 * u.padded_numel + 4095) // 4096 * 4096)
                                      for u in opt._job.units)
    assert opt._job.stats()[0]["tier_bytes"] == tier.stat().st_size
    client.close()
    daemon.stop()
    assert not tier.exists() and not tier.parent.exists()


def test_nvme_offload_on_two_ranks(start_daemon):
    """Two ranks, each with its own tier file, train to the bits of two
    ranks in memory."""
    daemon = start_daemon(ranks=2)

    def body(rank, model, opt):
        steps_from(model, opt, 0, 4)
        return model.state_dict()

    want = on_ranks(daemon, 2, body, job="mem2")
    got = on_ranks(daemon, 2, body, job="nv2", offload_optimizer=NVME)
    assert max_rel_diff(got[0], want[0]) == 0 and max_rel_diff(got[1], want[1]) == 0
    assert len(list((daemon.dir / "nvme").glob("nv2-*/rank-0000[01].zdtier"))) == 2


def test_nvme_offload_checkpoints_and_survives_a_crash(start_daemon, tmp_path):
    """A job with its optimizer state on disk saves a service checkpoint at
    step 3; the daemon is killed in the middle of step 5 (half the tier
    file written); a new daemon, a fresh job, load of the checkpoint and
    steps 4..6 again give the bits of a run that never stopped. The dead
    daemon's tier file is removed when the new one starts. The checkpoint
    also restores into a job that keeps its state in memory."""
    ckpt = tmp_path / "ckpt"
    nvme = tmp_path / "nvme"
    daemon = start_daemon(ranks=1)
    client, model, _ = offloaded(daemon, "straight", 6, offload=None)
    straight = model.state_dict()
    client.close()

    doomed = start_daemon(ranks=1, extra=["--checkpoint-dir", str(ckpt), "--nvme-dir", str(nvme)],
                          env={"ZEROD_CRASH_AT": "offload-step-midway@5"})
    client, model, opt = offloaded(doomed, "lm", 3)
    assert zerod.torch.save(model, "at3").step == 3
    steps_from(model, opt, 3, 1)
    with pytest.raises(zerod.Error):
        steps_from(model, opt, 4, 1)
    doomed.proc.wait(timeout=30)
    assert "crash point reached" in doomed.read_log()
    assert list(nvme.glob("lm-*/rank-*.zdtier"))  # left by the dead daemon
    client.close()
    doomed.kill()

    for offload in (NVME, None):
        again = start_daemon(ranks=1, extra=["--checkpoint-dir", str(ckpt), "--nvme-dir", str(nvme)])
        assert not list(nvme.glob("lm-*/rank-*.zdtier"))
        client, model, opt = offloaded(again, "lm", 0, offload=offload, seed=5)
        assert zerod.torch.load(model, "at3").step == 3
        steps_from(model, opt, 3, 3)
        assert max_rel_diff(model.state_dict(), straight) == 0, offload
        client.close()
        again.stop()


def test_nvme_offload_config_errors(start_daemon, tmp_path):
    daemon = start_daemon(ranks=1)
    client = zerod.Client(daemon.socket)
    cases = [
        ({"device": "nvme", "nvme_path": str(tmp_path)}, "outside the daemon's --nvme-dir"),
        ({"device": "nvme", "buffer_size": 1000}, "buffer_size 1000"),
        ({"device": "nvme", "buffer_count": 1}, "buffer_count 1"),
        ({"device": "cpu", "nvme_path": "x"}, "nvme_path is for device nvme"),
    ]
    for offload, message in cases:
        with pytest.raises(zerod.InvalidArgumentError, match=message):
            client.attach("bad", rank=0, config=zerod.JobConfig(offload_optimizer=offload))
    with pytest.raises(zerod.InvalidArgumentError, match="device must be"):
        client.attach("bad", rank=0, config=zerod.JobConfig(offload_optimizer={"device": "disk"}))
    with pytest.raises(zerod.InvalidArgumentError, match="not both yet"):
        client.attach("bad", rank=0, config=zerod.JobConfig(
            quantized_weights=True, offload_optimizer={"device": "nvme"}))
    # A directory inside the root is accepted, and the files go there.
    inside = daemon.dir / "nvme" / "fast"
    inside.mkdir()
    job = client.attach("ok", rank=0, config=zerod.JobConfig(
        offload_optimizer={"device": "nvme", "nvme_path": str(inside)}))
    model = zerod.torch.shard(TinyLM(), job)
    assert list(inside.glob("ok-*/rank-00000.zdtier"))
    del model
    client.close()


def test_distributed_checkpoint_saves_and_resumes(start_daemon, tmp_path):
    """torch.distributed.checkpoint (DCP) saves the model's and the
    optimizer's state_dicts (plain tensors, torch.optim's layout) and loads
    them in place into a fresh job's: training resumes to the same bits."""
    try:
        import torch.distributed.checkpoint as dcp
        dcp.save, dcp.load  # noqa: B018 (torch 2.2 and later)
    except (ImportError, AttributeError):
        pytest.skip("torch %s has no torch.distributed.checkpoint.save/load (torch 2.2 or later; "
                    "the torch 2 lane runs this)" % torch.__version__)
    import warnings as w
    daemon = start_daemon(ranks=1)
    client, model, _ = trained(daemon, "straight", 6)
    straight = model.state_dict()
    client.close()
    client, model, opt = trained(daemon, "first", 3)
    with w.catch_warnings():
        w.simplefilter("ignore")  # "torch.distributed is not initialized": one process
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=str(tmp_path / "dcp"))
    client.close()
    client, model, opt = trained(daemon, "resumed", 0, seed=4)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with w.catch_warnings():
        w.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    steps_from(model, opt, 3, 3)
    assert max_rel_diff(model.state_dict(), straight) == 0
    client.close()


def test_optimizer_state_keeps_the_fp32_master_of_a_bf16_job(start_daemon, tmp_path):
    """A bf16 working copy rounds the model's state_dict; the optimizer's
    carries the fp32 master, so a resumed run still matches bit for bit."""
    daemon = start_daemon(ranks=1)
    runs = {}
    for name, stop in (("straight", None), ("first", 2)):
        client, job = attach(daemon, job=name, dtype="bfloat16")
        model = zerod.torch.shard(TinyLM().to(torch.bfloat16), job)
        opt = zerod.torch.Optimizer(model)
        steps_from(model, opt, 0, 4 if stop is None else stop)
        runs[name] = (model.state_dict(), opt.state_dict())
        client.close()
    model_state, opt_state = runs["first"]
    entry = opt_state["state"][0]
    assert entry["master"].dtype == torch.float32 and entry["master"].shape == entry["exp_avg"].shape
    assert next(iter(model_state.values())).dtype == torch.bfloat16
    torch.save(runs["first"], tmp_path / "bf16.pt")
    model_state, opt_state = torch.load(tmp_path / "bf16.pt")
    client, job = attach(daemon, job="resumed", dtype="bfloat16")
    model = zerod.torch.shard(TinyLM(seed=9).to(torch.bfloat16), job)
    opt = zerod.torch.Optimizer(model)
    model.load_state_dict(model_state)
    opt.load_state_dict(opt_state)
    steps_from(model, opt, 2, 2)
    assert max_rel_diff(model.state_dict(), runs["straight"][0]) == 0
    assert max_rel_diff({k: v["master"] for k, v in opt.state_dict()["state"].items()},
                        {k: v["master"] for k, v in runs["straight"][1]["state"].items()}) == 0
    client.close()


@pytest.mark.parametrize("how", ["no_sync", "set_requires_gradient_sync"])
def test_no_sync_accumulates_without_collectives(start_daemon, how):
    """Two ranks, four micro-batches a step, the first three under no_sync
    (or with gradient sync off): what reducing every micro-batch gives (the
    ranks' sums in another order: to 1e-5), with a quarter of the reduces."""
    daemon = start_daemon(ranks=2)
    results = {}
    for mode in ("every", how):
        out = [None, None]
        # Built here: TinyLM seeds torch's global generator, which two
        # threads must not share.
        plain_models = [TinyLM(), TinyLM()]

        def run(rank):
            client, job = attach(daemon, job=mode, rank=rank)
            model = zerod.torch.shard(plain_models[rank], job)
            opt = zerod.torch.Optimizer(model)
            for step in range(3):
                for micro in range(4):
                    tokens, targets = batch(step * 4 + micro, 16, rank, 2)
                    last = micro == 3
                    if mode == "no_sync" and not last:
                        with model.no_sync():
                            (model(tokens, targets) / 4).backward()
                    else:
                        if mode == "set_requires_gradient_sync":
                            model.set_requires_gradient_sync(last)
                        (model(tokens, targets) / 4).backward()
                opt.step()
                opt.zero_grad()
            state = model.state_dict()
            calls = sum(c["calls"] for r in job.stats() if r["rank"] == rank
                        for (level, kind), c in r["counters"].items() if kind == "reduce_scatter")
            out[rank] = (state, calls)
            client.close()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert out[0] is not None and out[1] is not None, "a rank failed (see its thread)"
        results[mode] = out[0]
    every, quiet = results["every"], results[how]
    assert max_rel_diff(quiet[0], every[0]) <= 1e-5  # measured: 1.2e-6
    assert quiet[1] > 0 and quiet[1] * 4 == every[1], (quiet[1], every[1])


def test_step_refuses_gradients_left_in_no_sync(start_daemon):
    client, job = attach(start_daemon(ranks=1))
    model = zerod.torch.shard(TinyLM(), job)
    opt = zerod.torch.Optimizer(model)
    tokens, targets = batch(0, 4)
    with model.no_sync():
        model(tokens, targets).backward()
    with pytest.raises(zerod.ShardingError, match="accumulated under no_sync"):
        opt.step()
    model(tokens, targets).backward()
    opt.step()  # the next synchronizing backward reduces the sum
    client.close()


def test_sharded_parameters_keep_their_shapes(start_daemon):
    """After shard, parameters keep their shapes and numel (parameter counts
    are the model's), take no memory, and read as NaN outside a forward
    pass; state_dict() has the values."""
    client, job = attach(start_daemon(ranks=1))
    reference = TinyLM()
    shapes = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    count = sum(p.numel() for p in reference.parameters())
    values = {n: p.detach().clone() for n, p in reference.named_parameters()}
    model = zerod.torch.shard(reference, job)
    assert {n: tuple(p.shape) for n, p in model.module.named_parameters()} == shapes
    assert sum(p.numel() for p in model.parameters()) == count
    first = next(iter(model.parameters())).data.data_ptr()
    for p in model.parameters():  # all one element, broadcast
        assert p.data.stride() == (0,) * p.dim() and p.data.data_ptr() == first
        assert torch.isnan(p.data).all()
    state = model.state_dict()
    for name, value in values.items():
        assert torch.equal(state[name], value), name
    tokens = torch.zeros(2, 8, dtype=torch.long)
    model(tokens, tokens).backward()
    assert all(torch.isnan(p.data).all() for p in model.parameters())
    client.close()


def test_torchrun_launches_the_example(start_daemon, tmp_path):
    """`python -m torch.distributed.run --nproc_per_node 2 examples/python/train_lm.py
    --socket S` (torchrun):
    each process is a worker, its rank from torchrun's environment, and
    both train through the daemon (with the example's
    --offload-optimizer nvme: the state in the ranks' tier files)."""
    daemon = start_daemon(ranks=2)
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python",
                           "train_lm.py")
    env = worker_env()
    env.pop("ZEROD_TOKEN", None)
    proc = subprocess.run(
        # --redirects/--tee 1: torch 1.13's launcher on Python 3.11 cannot parse
        # its own default "0" (Std.NONE is no longer iterated), so say 1 (stdout).
        [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--redirects", "1", "--tee", "1", "--log_dir", str(tmp_path / "logs"), example, "--socket", daemon.socket, "--job", "torchrun", "--steps", "3",
         "--batch", "4", "--context", "32", "--d-model", "32", "--layers", "1", "--heads", "2",
         "--eval-every", "0", "--sample-bytes", "0", "--log-every", "1",
         "--offload-optimizer", "nvme", "--result-json", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trained 3 steps" in proc.stdout, proc.stdout
    ranks = sorted(json.loads((tmp_path / ("run.rank%d" % r)).read_text())["rank"]
                   for r in range(2))
    assert ranks == [0, 1]
    assert "optimizer state on disk" in daemon.read_log()


def test_parameter_replaced_after_sharding(start_daemon):
    client, job = attach(start_daemon(ranks=1))
    model = zerod.torch.shard(TinyLM(), job)
    model.module.head.weight = nn.Parameter(torch.zeros(3, 3))
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(zerod.ShardingError, match=r"head\.weight was replaced.*\(64, 32\).*\(3, 3\)"):
        model(tokens, tokens)
    client.close()


def test_parameter_data_changed_after_sharding(start_daemon):
    client, job = attach(start_daemon(ranks=1))
    model = zerod.torch.shard(TinyLM(), job)
    model.module.blocks[0].up.weight.data = torch.zeros(5, 32)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(zerod.ShardingError, match=r"blocks\.0\.up\.weight changed"):
        model(tokens, tokens)
    client.close()


def test_layout_mismatch_names_the_tensor(start_daemon):
    daemon = start_daemon(ranks=1)
    client, job = attach(daemon)
    zerod.torch.shard(TinyLM(), job)
    job.detach()
    client.close()

    class Wider(TinyLM):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(32, 65, bias=False)

    client, job = attach(daemon)
    with pytest.raises(zerod.AlreadyExistsError, match="head"):
        zerod.torch.shard(Wider(), job)
    client.close()


def test_daemon_not_running(tmp_path):
    with pytest.raises(zerod.UnavailableError, match="nothing.sock"):
        zerod.Client(tmp_path / "nothing.sock")


def test_wrong_job_name(start_daemon):
    daemon = start_daemon(ranks=1)
    client = zerod.Client(daemon.socket)
    with pytest.raises(zerod.NotFoundError, match="no-such-job"):
        client.attach("no-such-job", create=False)
    with pytest.raises(zerod.NotFoundError, match="no-such-job"):
        client.attach("no-such-job", read_only=True)
    client.close()
