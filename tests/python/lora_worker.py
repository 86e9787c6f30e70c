"""A LoRA training worker for the tests of jobs on a base
(test_zerod_bases.py): TinyLM with LoRA on its blocks' linears (the plain
zerod.torch.lora module or peft's), trained on a base (--base NAME) or on a
private copy of the base's weights (--init FILE, the job's own frozen
units); saves the losses and the model's full state_dict with torch.save."""

from __future__ import annotations

import argparse
import sys

import torch

import zerod
import zerod.torch
from torch_models import Block, TinyLM, batch

TARGETS = ["up", "down"]
RANK, ALPHA = 4, 8.0


def lora_model(kind: str, init: str, weights_seed: int, adapter_seed: int) -> torch.nn.Module:
    """TinyLM with `init`'s weights (a plain state_dict file; "": the
    weights of TinyLM(seed=weights_seed)), frozen, with LoRA adapters drawn
    from `adapter_seed`."""
    model = TinyLM(seed=weights_seed)
    if init:
        model.load_state_dict(torch.load(init))
    torch.manual_seed(adapter_seed)
    if kind == "plain":
        return zerod.torch.apply_lora(model, TARGETS, r=RANK, alpha=ALPHA)
    import peft

    for p in model.parameters():
        p.requires_grad_(False)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def produce(args) -> int:
    """The base producer of a job whose ranks are on several nodes (one
    per node): the plain model trained a few steps, its weights saved."""
    client = zerod.Client(args.socket)
    job = client.attach(args.job, rank=0, token=args.token or None,
                        config=zerod.JobConfig(lr=1e-2, weight_decay=0.0))
    model = zerod.torch.shard(TinyLM(seed=args.weights_seed), job, units="per-module")
    opt = zerod.torch.Optimizer(model)
    for step in range(args.steps):
        tokens, targets = batch(step, 8, seed=99)
        model(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    torch.save(model.state_dict(), args.out)
    job.detach()
    client.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--base", default="", help="the base job; none: a private copy")
    p.add_argument("--init", default="", help="the private copy's weights (a state_dict file)")
    p.add_argument("--weights-seed", type=int, default=0)
    p.add_argument("--lora", choices=["plain", "peft"], default="plain")
    p.add_argument("--units", choices=["per-module", "blocks"], default="per-module")
    p.add_argument("--data-seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True)
    p.add_argument("--token", default="", help="the job's owner token")
    p.add_argument("--produce", action="store_true",
                   help="fill a base instead: the plain TinyLM sharded into --job and trained "
                        "--steps steps; --out gets its weights")
    args = p.parse_args()
    if args.produce:
        return produce(args)
    torch.set_num_threads(1)
    model = lora_model(args.lora, args.init, args.weights_seed, 1000 + args.data_seed)
    client = zerod.Client(args.socket)
    job = client.attach(args.job, rank=0, token=args.token or None, config=zerod.JobConfig(
        lr=1e-2, weight_decay=0.0, base_job=args.base))
    units = "per-module" if args.units == "per-module" else [Block]
    model = zerod.torch.shard(model, job, units=units, base=bool(args.base))
    opt = zerod.torch.Optimizer(model)
    losses = []
    for step in range(args.steps):
        tokens, targets = batch(step, 8, seed=args.data_seed)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        print("step %d loss %.6f" % (step, losses[-1]), flush=True)
    gathered = sum(c["bytes"] for r in job.stats() for (level, kind), c in r["counters"].items()
                   if kind == "all_gather")
    torch.save({"losses": losses, "state": model.state_dict(), "all_gather_bytes": gathered,
                "from_base": sorted(u.name for u in model.units if u.from_base),
                "own": sorted(u.name for u in model.units if not u.from_base)}, args.out)
    job.detach()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
