#!/usr/bin/env python3
"""A worker of the chaos run (chaos.py): local rank 0 (--rank) of a job on one node.
Attaches (again after every error: its job was rebuilt, moved or restored
under it), registers the job's one unit if it has none, and steps with the
gradient `grads(seed, step, rank)` until the job's step is --until (or the
number in --until-file, read at each step; --progress names a file that
gets the step after each); then
writes the parameters to --out (numpy .npy), and the step they are of to
--out.step, and exits 0. Exits 3 if the
node no longer hosts the job for --give-up-s (it was moved away)."""

import argparse
import os
import sys
import time

import numpy as np

import zerod

NUMEL = 4000


def grads(seed, step, rank):
    return np.random.default_rng([seed, step, rank]).standard_normal(NUMEL).astype(np.float32)


def initial(seed):
    return np.random.default_rng([seed, 0, 99]).standard_normal(NUMEL).astype(np.float32)


def until(args):
    """The step to train to: --until-file's number (the chaos run moves it
    once it stops killing), else --until."""
    if args.until_file is not None:
        try:
            with open(args.until_file) as f:
                return int(f.read())
        except (OSError, ValueError):
            pass
    return args.until


def train(args):
    with zerod.Client(args.socket) as client:
        job = client.attach(args.job, rank=args.rank, token=args.token, create=False)
        units = job.units
        unit = units[0] if units else job.register("u", [("w", (NUMEL,))],
                                                   values=initial(args.seed))
        step = job.stats()[0]["step"]
        while step < until(args):
            unit.grad_buffer().arrays()["w"][...] = grads(args.seed, step + 1, job.rank)
            unit.reduce()
            step = job.step().step
            if args.progress is not None:
                with open(args.progress, "w") as f:
                    f.write(str(step))
        # The job may be past the target when the target moves (the
        # coordinator's step lags): the step it stopped at goes beside.
        with open(args.out + ".step", "w") as f:
            f.write(str(step))
        np.save(args.out + ".tmp.npy", job.state_dict()["w"])
        os.replace(args.out + ".tmp.npy", args.out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--progress", help="a file the step reached is written to after each step")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--until", type=int, default=1 << 60)
    ap.add_argument("--until-file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--give-up-s", type=float, default=30.0)
    args = ap.parse_args()
    last_ok = time.monotonic()
    while True:
        try:
            train(args)
            return 0
        except zerod.NotFoundError:
            if time.monotonic() - last_ok > args.give_up_s:
                print("job %s is not on this node any more" % args.job, file=sys.stderr)
                return 3
        except zerod.Error as e:
            last_ok = time.monotonic()
            print("retrying after: %s" % e, file=sys.stderr)
        except OSError as e:  # the node's socket is gone (the node was killed)
            print("retrying after: %s" % e, file=sys.stderr)
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
