"""A training worker for the zerod.torch tests: attaches to a job as one
rank, shards TinyLM, trains with torch_models.train and saves the full
state_dict (rank 0) with torch.save."""

from __future__ import annotations

import argparse
import sys

import torch

import zerod
import zerod.torch
from torch_models import TinyLM, train


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--job", default="t")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--schedule", action="store_true")
    p.add_argument("--tie", action="store_true")
    p.add_argument("--units", default="per-module")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--dump", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    client = zerod.Client(args.socket)
    job = client.attach(args.job, rank=args.rank,
                        config=zerod.JobConfig(lr=args.lr, weight_decay=0.01))
    model = TinyLM(tie=args.tie)
    units = "per-module" if args.units == "per-module" else [type(model.blocks[0])]
    model = zerod.torch.shard(model, job, units=units)
    opt = zerod.torch.Optimizer(model)
    losses = train(model, opt, args.steps, args.batch, rank=args.rank, world=job.world_size,
                   accum=args.accum, clip=args.clip, use_schedule=args.schedule, zerod_opt=True)
    state = model.state_dict()
    if args.rank == 0 and args.dump:
        torch.save(state, args.dump)
    print("rank %d: loss %.4f -> %.4f, version %d" % (args.rank, losses[0], losses[-1],
                                                      job.version), flush=True)
    job.detach()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
