#!/usr/bin/env python3
"""Trains a small byte-level transformer language model through zerod.

    python3 examples/python/train_lm.py                 # daemon + 2 workers, 200 steps
    python3 examples/python/train_lm.py --backend plain --steps 30
    python3 examples/python/train_lm.py --backend ddp   # torch DDP on Gloo, for comparison

By default this starts a standalone zerod daemon with 2 CPU ranks in a
temporary directory and 2 worker processes (this script with --worker),
each of which trains its share of every global batch through the daemon:
zerod holds the sharded parameters and AdamW state, gathers each block's
weights for the forward and backward passes, averages the gradients over the
ranks and steps the optimizer. Rank 0 shows the progress, the validation
loss, a sample of generated text and the throughput; then the workers
detach, the daemon is stopped with SIGTERM, and the exit status says whether
everything worked.

`--backend plain` trains the same model on the same global batches in this
one process with torch.optim.AdamW, as a reference; `--backend ddp` uses
torch's DistributedDataParallel on Gloo with the same number of processes.

Under torchrun every process is a worker (rank and world size from torchrun's
environment); the zerod backend then attaches to a running daemon:

    zerod standalone --ranks 2 &
    python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
        examples/python/train_lm.py --socket .zerod/zerod.sock

(torchrun, through the Python that has zerod installed: a venv's
`.venv/bin/python -m torch.distributed.run`, where /usr/bin/torchrun would
not see the venv's packages; `--nproc_per_node` is the spelling torch 1.13
and 2.x both know.)
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple


def _threads_from_argv(argv: List[str]) -> str:
    """The value of --threads in `argv`, before argparse has run ("1" if absent)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
        if arg == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
    return "1"


# OpenBLAS, where Debian's alternatives select it as torch's BLAS, starts its
# own threads, which torch.set_num_threads does not limit; it reads this
# before torch is imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", _threads_from_argv(sys.argv))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import lm  # noqa: E402
from launch import Cluster, LaunchError, find_zerod_binary  # noqa: E402
from progress import Progress, format_count  # noqa: E402

BACKENDS = ("zerod", "ddp", "plain", "fsdp", "fsdp2")
CLIENT_PYTHON = lm.REPO_ROOT / "client" / "python"


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="zerod",
                   help="zerod: through a zerod daemon; ddp: torch DDP on Gloo; plain: one "
                        "process, no zerod; fsdp: torch FSDP on Gloo (needs a torch whose "
                        "FSDP runs on CPU; torch 1.13's does not); fsdp2: torch's "
                        "fully_shard on Gloo (torch 2.6 or later)")
    p.add_argument("--ranks", type=int, default=2, help="worker processes (zerod, ddp, fsdp, fsdp2)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="global batch, in sequences")
    p.add_argument("--context", type=int, default=128, help="sequence length, in bytes")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tie", action="store_true", help="tie the LM head to the token embedding")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--lr-warmup", type=int, default=20, help="steps of linear warmup")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr (cosine)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batches")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (and "
                   "kernel threads per rank of the daemon)")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    p.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps (0: off)")
    p.add_argument("--eval-batches", type=int, default=2,
                   help="validation batches (of --batch sequences); 0: no validation")
    p.add_argument("--sample-bytes", type=int, default=160, help="bytes to generate at the end (0: none)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    p.add_argument("--prompt", default="The daemon ", help="start of the generated sample")
    p.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"), default="none",
                   help="zerod: where the daemon keeps the fp32 master weights and AdamW's "
                        "moments (nvme: a file per rank under the daemon's --nvme-dir, streamed "
                        "through each step)")
    p.add_argument("--ddp-powersgd-rank", type=int, default=0, metavar="R",
                   help="ddp: compress the gradient all-reduce with torch's PowerSGD "
                        "communication hook at rank R (exact for the first 2 steps, then "
                        "low-rank with error feedback); 0: off")
    p.add_argument("--zerod-bin", help="the zerod binary (default: $ZEROD_BIN_DIR/zerod, "
                   "else build/release/bin/zerod)")
    p.add_argument("--socket", help="attach to this running daemon instead of starting one")
    p.add_argument("--job", default="lm", help="zerod job name")
    p.add_argument("--token", default=os.environ.get("ZEROD_TOKEN"),
                   help="the job's owner token (a job made by `zerodctl jobs create`; "
                   "default $ZEROD_TOKEN)")
    p.add_argument("--result-json", help="(benchmarks) each worker writes its figures to "
                   "this path with .rankR appended")
    # Internal: set by the launcher for its worker processes.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: a worker of its world
        args.worker = True
        args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        args.world_size = args.ranks = int(os.environ.get("WORLD_SIZE", "1"))
        if args.backend == "zerod" and args.socket is None:
            p.error("under torchrun the zerod backend attaches to a running daemon: pass --socket")
    for name in ("ranks", "steps", "batch", "context", "threads", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.ddp_powersgd_rank < 0:
        p.error("--ddp-powersgd-rank must be 0 (off) or more")
    if args.ddp_powersgd_rank > 0 and args.backend != "ddp":
        p.error("--ddp-powersgd-rank needs --backend ddp")
    if args.backend != "plain" and args.batch % args.ranks != 0:
        p.error(f"--batch {args.batch} is not a multiple of --ranks {args.ranks}")
    return args


def model_config(args: argparse.Namespace) -> lm.LMConfig:
    return lm.LMConfig(context=args.context, d_model=args.d_model, n_layers=args.layers,
                       n_heads=args.heads, tie=args.tie)


# --------------------------------------------------------------------------
# Backends: how the model, its optimizer and the ranks are set up
# --------------------------------------------------------------------------


@dataclass
class Backend:
    """A model ready to train, its optimizer, and this process's rank.

    `clip_in_worker` says whether the worker clips the gradients itself (torch)
    or the optimizer does it in its step (zerod, from the job's
    max_grad_norm); `grad_norm` then returns the norm of the last step.
    """

    model: torch.nn.Module
    eval_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    rank: int
    world_size: int
    clip_in_worker: bool = True
    grad_norm: Callable[[], Optional[float]] = lambda: None
    closers: List[Callable[[], None]] = field(default_factory=list)
    # zerod: this rank's collective bytes by "level/collective" (Job.stats).
    collective_bytes: Callable[[], Dict[str, int]] = lambda: {}
    # zerod: this rank's seconds in collectives, its worker's waits, and the
    # communication among them (Job.stats; docs/daemon.md).
    comm_times: Callable[[], Dict[str, float]] = lambda: {}
    # zerod: the job's units, each {"padded_numel": N, "shapes": [[...], ...]}.
    units: Callable[[], List[Dict[str, Any]]] = lambda: []

    def close(self) -> None:
        """Releases the backend's resources, most recent first."""
        while self.closers:
            self.closers.pop()()


def torch_adamw(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    """torch's AdamW with the hyper-parameters the zerod job gets."""
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=args.weight_decay)


def setup_plain(model: torch.nn.Module, args: argparse.Namespace) -> Backend:
    """One process, the whole global batch, torch's AdamW: the reference."""
    return Backend(model, model, torch_adamw(model.parameters(), args), rank=0, world_size=1)


def _init_gloo(args: argparse.Namespace) -> None:
    """Joins the torch.distributed group through the launcher's FileStore
    (torchrun's environment when there is no store)."""
    import torch.distributed as dist

    if args.store is None:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        return

    store = dist.FileStore(args.store, args.world_size)
    dist.init_process_group("gloo", store=store, rank=args.local_rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=120))


def setup_ddp(model: torch.nn.Module, args: argparse.Namespace) -> Backend:
    """torch DDP on Gloo: every rank holds all the weights and AdamW state."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _init_gloo(args)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights
    if args.ddp_powersgd_rank > 0:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

        # Error feedback and warm start need start_powerSGD_iter > 1 (torch
        # asserts it): the first 2 steps all-reduce the exact gradients.
        state = powerSGD.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=args.ddp_powersgd_rank,
                                       start_powerSGD_iter=2, use_error_feedback=True,
                                       warm_start=True)
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    return Backend(ddp, model, torch_adamw(ddp.parameters(), args), rank=dist.get_rank(),
                   world_size=dist.get_world_size(), closers=[dist.destroy_process_group])


def setup_fsdp(model: torch.nn.Module, args: argparse.Namespace) -> Backend:
    """torch FSDP on Gloo, one FSDP unit per block (needs a torch whose FSDP runs on CPU)."""
    import functools

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    _init_gloo(args)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={lm.Block})
    sharded = FullyShardedDataParallel(model, auto_wrap_policy=policy)
    return Backend(sharded, sharded, torch_adamw(sharded.parameters(), args), rank=dist.get_rank(),
                   world_size=dist.get_world_size(), closers=[dist.destroy_process_group])


def setup_fsdp2(model: torch.nn.Module, args: argparse.Namespace) -> Backend:
    """FSDP2 (torch.distributed.fsdp.fully_shard, torch 2.6+) on Gloo: each block
    sharded on its own, then the rest of the model; AdamW on the DTensor shards."""
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        raise SystemExit(f"--backend fsdp2 needs torch 2.6 or later (this is {torch.__version__}): {e}")
    _init_gloo(args)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, lm.Block):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Backend(model, model, torch_adamw(model.parameters(), args), rank=dist.get_rank(),
                   world_size=dist.get_world_size(), closers=[dist.destroy_process_group])


def setup_zerod(model: torch.nn.Module, args: argparse.Namespace) -> Backend:
    """Attaches to the daemon, shards the model by block and makes the optimizer.

    The daemon runs AdamW with the job's hyper-parameters and clips to the
    job's max_grad_norm in its step; the LambdaLR schedule sets the
    learning rate of each step through param_groups[0]["lr"].
    """
    if CLIENT_PYTHON.is_dir() and str(CLIENT_PYTHON) not in sys.path:
        sys.path.append(str(CLIENT_PYTHON))  # the package next to this daemon, unless installed
    import zerod
    import zerod.torch

    client = zerod.Client(args.socket)
    backend_closers: List[Callable[[], None]] = [client.close]
    try:
        config = zerod.JobConfig(optimizer="adamw", lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                 weight_decay=args.weight_decay, max_grad_norm=args.clip,
                                 offload_optimizer={"device": args.offload_optimizer})
        job = client.attach(args.job, rank=args.local_rank, token=args.token, create=True,
                            config=config)
        backend_closers.append(job.detach)
        sharded = zerod.torch.shard(model, job, units=[lm.Block])
        optimizer = zerod.torch.Optimizer(sharded)
    except BaseException:
        for close in reversed(backend_closers):
            close()
        raise

    def collective_bytes() -> Dict[str, int]:
        mine = [r for r in job.stats() if r["rank"] == job.rank]
        return {f"{level}/{kind}": c["bytes"]
                for r in mine for (level, kind), c in r["counters"].items()}

    def comm_times() -> Dict[str, float]:
        mine = [r for r in job.stats() if r["rank"] == job.rank]
        return {k: mine[0][k] for k in ("comm_seconds", "wait_seconds", "exposed_comm_seconds")
                if mine and k in mine[0]}

    def units() -> List[Dict[str, Any]]:
        return [{"padded_numel": u.padded_numel, "shapes": [list(t.shape) for t in u.tensors]}
                for u in job.units]

    return Backend(sharded, sharded, optimizer, rank=job.rank, world_size=job.world_size,
                   clip_in_worker=False, grad_norm=lambda: optimizer.last_step.grad_norm,
                   closers=backend_closers, collective_bytes=collective_bytes,
                   comm_times=comm_times, units=units)


SETUP = {"plain": setup_plain, "ddp": setup_ddp, "fsdp": setup_fsdp, "fsdp2": setup_fsdp2,
         "zerod": setup_zerod}


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


@dataclass
class RunResult:
    """What one process measured; written as JSON for the benchmarks."""

    rank: int
    world_size: int
    backend: str
    params: int
    steps: int
    step_end_s: List[float]  # time.monotonic() at the end of each step
    train_s: float  # seconds in training steps (evaluation excluded)
    final_loss: float
    val_loss: Optional[float]
    peak_rss_kib: int = 0
    collective_bytes: Dict[str, int] = field(default_factory=dict)
    # Backend.comm_times after the first step and at the end (zerod only).
    comm_times_first: Dict[str, float] = field(default_factory=dict)
    comm_times: Dict[str, float] = field(default_factory=dict)
    # With --result-json: the bytes this rank moved between nodes (zerod's
    # "cross" level) after each step.
    cross_bytes_by_step: List[int] = field(default_factory=list)
    units: List[Dict[str, Any]] = field(default_factory=list)  # Backend.units (zerod only)


def peak_rss_kib(pid: str = "self") -> int:
    """VmHWM of a process (its peak resident set), in KiB; 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reference_blas_hint() -> Optional[str]:
    """A hint when torch multiplies matrices with the reference (netlib) BLAS.

    Debian's torch uses whichever libblas.so.3 the alternatives system
    selects; the reference one is about ten times slower than OpenBLAS.
    """
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    if "/blas/libblas.so" in maps:
        return ("note: torch is using the reference BLAS (netlib), which is slow; "
                "`apt-get install libopenblas0-pthread` makes this run about 10x faster")
    return None


class Reporter:
    """Rank 0's output: progress bar, log lines and the summary. Other ranks print nothing."""

    def __init__(self, active: bool, args: argparse.Namespace) -> None:
        self.active = active
        self.args = args
        self.bar: Optional[Progress] = None

    def say(self, message: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.log(message)
        else:
            print(message, flush=True)

    def start_bar(self, steps: int, tokens_per_step: int) -> None:
        if self.active:
            self.bar = Progress(steps, units_per_step=tokens_per_step, every=max(50, self.args.log_every))

    def update(self, step: int, loss: float, val: Optional[float] = None) -> None:
        if self.bar is not None:
            self.bar.update(step, loss=loss, val=val)

    def end_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def train(backend: Backend, args: argparse.Namespace, params: int, report: Reporter) -> RunResult:
    """Runs the training loop, the final evaluation and the sample.

    `params` is the model's size, counted before the backend took it over
    (a zerod-sharded parameter is empty outside a forward or backward pass).
    """
    cfg = model_config(args)
    train_data, val_data = lm.split_corpus(lm.load_corpus())
    # Every rank evaluates the same batches (a zerod forward pass is a collective).
    val_set = lm.val_batches(val_data, args.eval_batches, args.batch, cfg.context) if args.eval_batches else []
    schedule = lm.lr_lambda_warmup_cosine(args.lr_warmup, args.steps, args.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(backend.optimizer, schedule)
    tokens_per_step = args.batch * cfg.context

    report.say(f"model: {lm.describe(cfg, params)}")
    report.say(f"data: {len(train_data):,} training and {len(val_data):,} validation bytes "
               f"(README.md and docs/*.md)")
    report.say(f"training: {args.steps} steps, global batch {args.batch} x {cfg.context} tokens "
               f"on {backend.world_size} rank{'s' if backend.world_size != 1 else ''} ({args.backend}), AdamW lr {args.lr:g} "
               f"(warmup {args.lr_warmup}, cosine), clip {args.clip:g}")
    if backend.world_size > 1:
        report.say("(the loss shown is rank 0's, on its share of each batch; the gradient norm is global)")
    report.start_bar(args.steps, tokens_per_step)

    step_end_s: List[float] = []
    comm_times_first: Dict[str, float] = {}
    cross_bytes_by_step: List[int] = []
    train_s = 0.0
    loss_value = float("nan")
    for step in range(args.steps):
        t0 = time.monotonic()
        lr = backend.optimizer.param_groups[0]["lr"]
        loss_value, grad_norm = train_step(backend, args, train_data, step)
        scheduler.step()
        now = time.monotonic()
        step_end_s.append(now)
        train_s += now - t0
        if step == 0:
            comm_times_first = backend.comm_times()
        if args.result_json:
            cross_bytes_by_step.append(sum(v for k, v in backend.collective_bytes().items()
                                           if k.startswith("cross/")))

        done = step + 1
        val = None
        if args.eval_every and args.eval_batches and done % args.eval_every == 0 and done < args.steps:
            val = lm.evaluate(backend.eval_model, val_set)
        report.update(done, loss_value, val)
        if done % args.log_every == 0 or done == args.steps:
            norm = f" grad-norm {grad_norm:.3f}" if grad_norm is not None else ""
            val_text = f" val {val:.3f}" if val is not None else ""
            report.say(f"step {done:>{len(str(args.steps))}}/{args.steps} loss {loss_value:.3f}"
                       f"{val_text} lr {lr:.2e}{norm} tok/s {format_count(tokens_per_step * done / train_s)}")
    report.end_bar()

    val_loss = lm.evaluate(backend.eval_model, val_set) if val_set else None
    if val_loss is not None:
        report.say(f"validation loss {val_loss:.3f} ({val_loss / 0.6931471805599453:.2f} bits per byte)")
    if args.sample_bytes > 0:
        sample = lm.generate(backend.eval_model, args.prompt.encode(), args.sample_bytes, cfg.context,
                             temperature=args.temperature, seed=args.seed)
        how = "greedy" if args.temperature <= 0 else f"temperature {args.temperature:g}"
        report.say(f"sample ({how}):\n{args.prompt}{lm.printable(sample)}")
    report.say(f"trained {args.steps} steps in {train_s:.1f} s: "
               f"{format_count(tokens_per_step * args.steps / train_s)} tokens/s, "
               f"{args.steps / train_s:.2f} steps/s")
    return RunResult(rank=backend.rank, world_size=backend.world_size, backend=args.backend,
                     params=params, steps=args.steps, step_end_s=step_end_s, train_s=train_s,
                     final_loss=loss_value, val_loss=val_loss,
                     collective_bytes=backend.collective_bytes(),
                     comm_times_first=comm_times_first, comm_times=backend.comm_times(),
                     cross_bytes_by_step=cross_bytes_by_step, units=backend.units())


def train_step(backend: Backend, args: argparse.Namespace, train_data: torch.Tensor,
               step: int) -> Tuple[float, Optional[float]]:
    """One optimizer step on this rank's share of the global batch; (loss, grad norm)."""
    cfg = model_config(args)
    inputs, targets = lm.get_batch(train_data, step, backend.rank, backend.world_size,
                                   args.batch, cfg.context, args.seed)
    loss = lm.lm_loss(backend.model(inputs), targets)
    loss.backward()
    grad_norm = None
    if backend.clip_in_worker:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(backend.model.parameters(), args.clip))
    backend.optimizer.step()
    backend.optimizer.zero_grad()
    if grad_norm is None:
        grad_norm = backend.grad_norm()
    return loss.item(), grad_norm


def run_worker(args: argparse.Namespace) -> int:
    """Trains in this process (one rank of a run, or the whole plain run)."""
    torch.set_num_threads(args.threads)
    report = Reporter(active=args.local_rank == 0, args=args)
    model = lm.build_model(model_config(args), args.seed)
    params = lm.count_parameters(model)
    hint = reference_blas_hint()
    if hint:
        report.say(hint)
    backend = SETUP[args.backend](model, args)
    try:
        result = train(backend, args, params, report)
    finally:
        backend.close()
    if args.result_json:
        result.peak_rss_kib = peak_rss_kib()
        Path(f"{args.result_json}.rank{result.rank}").write_text(json.dumps(result.__dict__))
    return 0


# --------------------------------------------------------------------------
# The launcher
# --------------------------------------------------------------------------


def run_launcher(args: argparse.Namespace, argv: List[str]) -> int:
    """Starts the daemon and the workers, waits for them, and stops everything."""
    if args.backend == "zerod" and args.socket is None:
        find_zerod_binary(args.zerod_bin)  # fail early, with the hint to build it
    # Every worker gets our arguments; the launcher's own flags follow them.
    cluster = Cluster(args.backend, args.ranks, argv, zerod_bin=args.zerod_bin,
                      socket=args.socket, daemon_threads=args.threads)
    atexit.register(cluster.close)
    with cluster:
        cluster.wait()
        if cluster.daemon is not None:
            cluster.stop_daemon()
            print("== zerod stopped", flush=True)
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    who = f"worker rank {args.local_rank}" if args.worker else "train_lm"
    try:
        if args.worker or args.backend == "plain":
            return run_worker(args)
        return run_launcher(args, argv)
    except KeyboardInterrupt:
        if not args.worker:  # the workers got the same Ctrl-C; only the launcher says so
            newline = "\n" if sys.stderr.isatty() else ""
            print(f"{newline}train_lm: interrupted", file=sys.stderr)
        return 130
    except LaunchError as e:
        print(f"train_lm: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"{who}: {e} (torch: use /usr/bin/python3 or another Python with torch; "
              f"zerod: the package is in {CLIENT_PYTHON})", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the last line should say what failed, and where
        if not type(e).__module__.startswith("zerod"):
            traceback.print_exc()
        print(f"{who}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
