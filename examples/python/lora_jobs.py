#!/usr/bin/env python3
"""Three tenants fine-tune LoRA adapters on one frozen base at once.

    /usr/bin/python3 examples/python/lora_jobs.py           # daemon, base, 3 jobs

1. Starts `zerod standalone --ranks 1` in a temporary directory (or uses a
   running one: --socket, with its control socket --control).
2. Makes the base: a job "base" whose worker (this process) shards a small
   GPT (lm.py, all its weights) with zerod.torch, pretrains it a few steps
   on the repository's text and detaches; then `zerodctl jobs freeze base
   --share team-a,team-b,team-c` makes it a base that those tenants may
   build on. Its state stays in the daemon, once.
3. Creates one job per tenant on the base (`zerodctl jobs create lora-team-a
   --tenant team-a --token ... --base base`) and starts its worker: a
   process that builds the same GPT, adds LoRA adapters to the attention's
   qkv and the MLP's first layer (zerod.torch.apply_lora), and shards it
   with base=True: the frozen layers are the base's units, read from the
   node's shared read-only cache, the adapters are the job's own. Each
   tenant trains on its own text (team-a: the daemon's C sources, team-b:
   the Python package, team-c: the docs) and prints its progress.
4. Prints the control plane's list of jobs, stops the daemon.

The three workers run at the same time and hold no copy of the base: the
weights in their local model are never used (they could be anything).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import torch

import lm
from launch import LaunchError, _die_with_parent, _stop, find_zerod_binary, status_text

CLIENT_PYTHON = lm.REPO_ROOT / "client" / "python"
if CLIENT_PYTHON.is_dir() and str(CLIENT_PYTHON) not in sys.path:
    sys.path.append(str(CLIENT_PYTHON))  # the package next to this daemon, unless installed
import zerod  # noqa: E402
import zerod.torch  # noqa: E402

TENANTS = {"team-a": ["daemon/**/*.c"], "team-b": ["client/python/**/*.py"],
           "team-c": ["README.md", "docs/*.md"]}
CONFIG = lm.LMConfig(context=64, d_model=128, n_layers=2, n_heads=4)
BATCH = 8


def text_of(patterns: List[str]) -> torch.Tensor:
    """The repository's files matching `patterns`, as bytes (synthetic text
    when the checkout has none)."""
    files = sorted({f for p in patterns for f in lm.REPO_ROOT.glob(p) if f.is_file()})
    text = b"\n\n".join(f.read_bytes() for f in files)
    if len(text) < 4096:
        text = lm.synthetic_text(64 * 1024, seed=len(patterns))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def make_base(socket: str, steps: int) -> None:
    """The base's producer: the plain model, all weights, sharded into job
    "base" and pretrained on every tenant's text; then it detaches (the
    job and its state stay in the daemon)."""
    data = torch.cat([text_of(p) for p in TENANTS.values()])
    client = zerod.Client(socket)
    job = client.attach("base", rank=0, config=zerod.JobConfig(lr=3e-3, weight_decay=0.0))
    model = zerod.torch.shard(lm.build_model(CONFIG, seed=0), job, units=[lm.Block])
    opt = zerod.torch.Optimizer(model)
    first = last = 0.0
    for step in range(steps):
        inputs, targets = lm.get_batch(data, step, 0, 1, BATCH, CONFIG.context, seed=7)
        loss = lm.lm_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        first, last = (float(loss) if step == 0 else first), float(loss)
    print("== base: GPT of %s parameters in %d units, pretrained %d steps (loss %.3f -> %.3f)"
          % (f"{lm.count_parameters(model):,}", len(model.units), steps, first, last), flush=True)
    job.detach()
    client.close()


def lora_worker(args: argparse.Namespace) -> int:
    """A tenant's LoRA job on the base (one process, rank 0 of 1)."""
    torch.set_num_threads(1)
    tag = "[%s]" % args.tenant
    model = lm.GPT(CONFIG)  # the frozen weights come from the base: these are never used
    torch.manual_seed(sum(args.tenant.encode()))
    zerod.torch.apply_lora(model, ["qkv", "fc"], r=args.lora_rank, alpha=2.0 * args.lora_rank)
    client = zerod.Client(args.socket)
    job = client.attach(args.job, rank=0, token=args.token, create=False)
    model = zerod.torch.shard(model, job, units=[lm.Block], base=True)
    opt = zerod.torch.Optimizer(model, lr=args.lr)
    base_units = [u for u in model.units if u.from_base]
    own = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = lm.count_parameters(model)
    print("%s job %s on base %s: %d units from the base, %d of its own (%s trainable "
          "parameters of %s)" % (tag, job.name, job.effective_config.base_job, len(base_units),
                                 len(model.units) - len(base_units), f"{own:,}", f"{total:,}"),
          flush=True)
    data = text_of(TENANTS[args.tenant])
    losses = []
    for step in range(args.steps):
        inputs, targets = lm.get_batch(data, step, 0, 1, BATCH, CONFIG.context, seed=11)
        loss = lm.lm_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print("%s step %d/%d loss %.3f" % (tag, step + 1, args.steps, losses[-1]), flush=True)
    k = max(1, min(5, len(losses) // 2))
    print("%s done: %d steps, mean loss of the first %d %.3f, of the last %d %.3f" %
          (tag, args.steps, k, sum(losses[:k]) / k, k, sum(losses[-k:]) / k), flush=True)
    job.detach()
    client.close()
    return 0


def zerodctl(binary: Path, control: str, *args: str) -> str:
    proc = subprocess.run([str(binary), "-c", control, *args], capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0:
        raise LaunchError("zerodctl %s failed (%s): %s" % (" ".join(args),
                                                            status_text(proc.returncode),
                                                            (proc.stderr or proc.stdout).strip()))
    return proc.stdout


def start_daemon(binary: Path, state: Path) -> subprocess.Popen:
    log = open(state / "zerod.log", "wb")
    daemon = subprocess.Popen([str(binary), "standalone", "--ranks", "1", "--dir", str(state),
                               "--threads-per-rank", "1", "--log-level", "warn"],
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                              preexec_fn=_die_with_parent, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 20
    while not (state / "zerod.sock").exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            _stop(daemon, signal.SIGTERM, 5.0)
            raise LaunchError("zerod did not start:\n" +
                              (state / "zerod.log").read_text(errors="replace")[-2000:])
        time.sleep(0.05)
    print("== zerod standalone (1 CPU rank), state in %s" % state, flush=True)
    return daemon


def run(args: argparse.Namespace) -> int:
    zerod_bin = find_zerod_binary(args.zerod_bin)
    zerodctl_bin = zerod_bin.parent / "zerodctl"
    state: Optional[Path] = None
    daemon = None
    workers: List[subprocess.Popen] = []
    try:
        if args.socket:
            socket, control = args.socket, args.control
        else:
            state = Path(tempfile.mkdtemp(prefix="zerod-lora-"))
            daemon = start_daemon(zerod_bin, state)
            socket, control = str(state / "zerod.sock"), "unix:%s" % (state / "control.sock")
        torch.set_num_threads(1)
        make_base(socket, args.base_steps)
        zerodctl(zerodctl_bin, control, "jobs", "freeze", "base", "--share", ",".join(TENANTS))
        print("== base frozen, shared with %s" % ", ".join(TENANTS), flush=True)
        for tenant in TENANTS:
            job, token = "lora-%s" % tenant, secrets.token_hex(16)
            zerodctl(zerodctl_bin, control, "jobs", "create", job, "--tenant", tenant,
                     "--token", token, "--base", "base", "--lr", str(args.lr),
                     "--weight-decay", "0")
            workers.append(subprocess.Popen(
                [sys.executable, __file__, "--role", "lora", "--socket", socket, "--job", job,
                 "--token", token, "--tenant", tenant, "--steps", str(args.steps),
                 "--lr", str(args.lr), "--lora-rank", str(args.lora_rank),
                 "--log-every", str(args.log_every)],
                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        print("== %d LoRA jobs training at once" % len(workers), flush=True)
        for tenant, worker in zip(TENANTS, workers):
            if worker.wait() != 0:
                raise LaunchError("the worker of %s exited with %s" %
                                  (tenant, status_text(worker.returncode)))
        print("== zerodctl bases list\n" + zerodctl(zerodctl_bin, control, "bases", "list").rstrip(),
              flush=True)
        if daemon is not None:
            code = _stop(daemon, signal.SIGTERM, 15.0)
            daemon = None
            if code != 0:
                raise LaunchError("zerod exited with %s on SIGTERM" % status_text(code))
        return 0
    except LaunchError as e:
        print("lora_jobs: %s" % e, file=sys.stderr)
        return 1
    finally:
        for worker in workers:
            _stop(worker, signal.SIGTERM, 5.0)
        if daemon is not None:
            _stop(daemon, signal.SIGTERM, 15.0)
        if state is not None:
            shutil.rmtree(state, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="steps of each LoRA job")
    p.add_argument("--base-steps", type=int, default=30, help="pretraining steps of the base")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--zerod-bin", help="the daemon (default: $ZEROD_BIN_DIR/zerod, else "
                   "build/release/bin/zerod); zerodctl is taken from its directory")
    p.add_argument("--socket", help="use a running daemon: its worker socket")
    p.add_argument("--control", default="unix:.zerod/control.sock",
                   help="with --socket: its control plane (zerodctl -c)")
    p.add_argument("--role", choices=["launcher", "lora"], default="launcher",
                   help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--token", help=argparse.SUPPRESS)
    p.add_argument("--tenant", help=argparse.SUPPRESS)
    args = p.parse_args()
    return lora_worker(args) if args.role == "lora" else run(args)


if __name__ == "__main__":
    sys.exit(main())
