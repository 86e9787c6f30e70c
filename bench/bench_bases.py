#!/usr/bin/env python3
"""3 LoRA jobs on one shared base against private copies and FSDP2 (issue 35).

In one run, on this machine, trains the same LoRA model (a stack of
--layers transformer-like MLP blocks, LayerNorm -> Linear(d, d) -> GELU ->
Linear(d, d) with a residual, LoRA of rank --lora-rank on every Linear) as
--jobs jobs at once, each in its own worker process, three ways:

  shared   one `zerod standalone --ranks 1` daemon; a producer process
           shards the plain model into job "base" and detaches, `zerodctl
           jobs freeze base` makes it a base, then each job attaches with
           JobConfig(base_job="base") and shards its LoRA model with
           zerod.torch.shard(..., base=True): the frozen weights are the
           base's units (the node's read-only cache), the adapters the
           job's own. Its local model is made on the meta device and
           materialized uninitialized (to_empty): the worker never holds
           the base's values;
  private  the same daemon and jobs without a base: each job registers the
           base's weights as its own frozen units (shard(..., base=False)),
           so the daemon holds one copy per job;
  fsdp2    torch FSDP2 (fully_shard on each block, then on the model; the
           base frozen through requires_grad=False; Gloo on CPU), each job
           a process group of its own of the same world size (1), with
           torch 2.4 or later (the other Python gets a "skipped" line).

World size: 1 rank per job (the daemon has 1 CPU rank), because this
machine has 2 cores: 3 jobs of 2 ranks would be 6 workers and 2 daemon
ranks on them. Every worker runs torch with 1 thread, the daemon 1 kernel
thread per rank. Each job runs --warmup-steps untimed steps, waits until
every job has, then runs --steps timed steps at the same time as the
others.

Figures, one JSON line each (bench, ratio, target, direction, met, and the
raw values with their units):

  bases_collective_bytes   per step per job over the timed steps: zerod
      shared's all_gather + reduce_scatter bytes (Job.stats(), after minus
      before the timed steps) against what FSDP2 moves for the same job,
      computed from the parameter sizes: the frozen base's bytes in the
      compute dtype (fp32) all-gathered, plus the adapters' bytes
      all-gathered and reduce-scattered: what each rank gathers per step at
      any world size of 2 or more, counting one gather of each unit (FSDP2
      gathers the blocks again for backward, reshard_after_forward, so the
      computed figure is the smaller and the target the harder). The count
      of FSDP2's own all_gather_single and reduce_scatter_single calls
      (wrapped) is there too: 0, since FSDP2 skips its collectives at world
      size 1. Target <= 0.1 (max).
  bases_peak_memory        the peak over time of the summed PSS of the
      daemon and the workers (sampled; shared pages counted once), shared
      against private. Target <= 0.5 (max). The sum of each process's peak
      RSS (VmHWM) is there too: it counts the pages the daemon shares with
      its workers (gathered buffers, the base's cache) once per process.
  bases_steps_per_s        steps/s per job (the mean of the jobs' rates
      over the timed steps), shared against private. Target >= 1.0 (min).
  bases_steps_per_s_fsdp2  the same, shared against fsdp2. Target >= 1.0.

A target not met is reported as met: false.

    python bench/bench_bases.py [--steps 12] [--warmup-steps 2] [--layers 12] [--d-model 2048]

The defaults (12 blocks of 2 x 2048 x 2048: a 384 MiB fp32 base, 3 MiB of
adapters, 16 rows per step) make the base large against what torch itself
takes per process (about 0.25 GB resident with torch 1.13, 0.55 GB with
torch 2.15) and keep the run near a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO_ROOT / "examples" / "python"))

from bench_torch_lm import PssSampler, emit, mib, vmhwm_kib  # noqa: E402
from launch import LaunchError, _die_with_parent, _stop, find_zerod_binary, status_text  # noqa: E402

MODES = ("shared", "private", "fsdp2")
TARGETS = {  # figure: (target, direction)
    "bases_collective_bytes": (0.1, "max"),
    "bases_peak_memory": (0.5, "max"),
    "bases_steps_per_s": (1.0, "min"),
    "bases_steps_per_s_fsdp2": (1.0, "min"),
}
FSDP2_PROBE = ("import torch.distributed.fsdp as f, sys; "
               "sys.exit(0 if hasattr(f, 'fully_shard') else 1)")


def log(message: str) -> None:
    print(f"bench_bases: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# The workers (this file with --role)
# --------------------------------------------------------------------------


def build_model(args: argparse.Namespace, lora: bool, meta: bool = False):
    """The plain model (seed 0: the base's values), or with LoRA on every
    Linear; `meta`: made on the meta device and materialized uninitialized
    (its frozen values are the base's; only the adapters are drawn)."""
    import torch
    from torch import nn

    from zerod.torch import LoRALinear, apply_lora

    class Block(nn.Module):
        def __init__(self, d: int, device: str) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d, device=device)
            self.up = nn.Linear(d, d, device=device)
            self.down = nn.Linear(d, d, device=device)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Stack(nn.Module):
        def __init__(self, d: int, layers: int, device: str) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(d, device) for _ in range(layers))
            self.norm = nn.LayerNorm(d, device=device)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    torch.manual_seed(0)
    model = Stack(args.d_model, args.layers, "meta" if meta else "cpu")
    if lora:
        torch.manual_seed(1000 + args.index)
        apply_lora(model, ["up", "down"], r=args.lora_rank, alpha=2.0 * args.lora_rank)
    if meta:
        model = model.to_empty(device="cpu")
        torch.manual_seed(1000 + args.index)
        for module in model.modules():
            if isinstance(module, LoRALinear):
                nn.init.kaiming_uniform_(module.lora_A, a=5 ** 0.5)
                nn.init.zeros_(module.lora_B)
    return model, Block


def batch(args: argparse.Namespace, step: int):
    import torch

    g = torch.Generator().manual_seed(args.index * 100003 + step)
    x = torch.randn(args.batch, args.d_model, generator=g)
    return x, torch.tanh(x.flip(1))


def stepper(args: argparse.Namespace, model, opt):
    """One training step of `model` (its loss); the same for every mode."""
    import torch

    def step_fn(step: int) -> float:
        x, y = batch(args, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())
    return step_fn


def wait_for_go(args: argparse.Namespace) -> None:
    Path(args.workdir, f"ready.{args.index}").touch()
    go = Path(args.workdir, "go")
    while not go.exists():
        time.sleep(0.005)


def train(args: argparse.Namespace, model, step_fn, snapshot) -> Dict:
    """Warm-up, the barrier, the timed steps; the figures."""
    for step in range(args.warmup_steps):
        step_fn(step)
    before = snapshot()
    wait_for_go(args)
    t0 = time.monotonic()
    loss = 0.0
    for step in range(args.warmup_steps, args.warmup_steps + args.steps):
        loss = step_fn(step)
    elapsed = time.monotonic() - t0
    after = snapshot()
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    own = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"steps_per_s": args.steps / elapsed, "final_loss": loss,
            "bytes": {k: (after[k] - before.get(k, 0)) / args.steps for k in after},
            "base_bytes": frozen, "adapter_bytes": own}


def zerod_worker(args: argparse.Namespace) -> Dict:
    import torch

    import zerod
    import zerod.torch

    torch.set_num_threads(1)
    shared = args.role == "shared"
    model, block = build_model(args, lora=True, meta=shared)
    client = zerod.Client(args.socket)
    job = client.attach(f"lora-{args.index}", rank=0, config=zerod.JobConfig(
        lr=1e-3, weight_decay=0.0, base_job="base" if shared else ""))
    model = zerod.torch.shard(model, job, units=[block], base=shared)
    opt = zerod.torch.Optimizer(model)

    step_fn = stepper(args, model, opt)

    def snapshot() -> Dict[str, int]:
        totals: Dict[str, int] = {}
        for rank in job.stats():
            for (_level, collective), c in rank["counters"].items():
                totals[collective] = totals.get(collective, 0) + c["bytes"]
        return totals

    result = train(args, model, step_fn, snapshot)
    result["units_from_base"] = sum(1 for u in model.units if u.from_base)
    result["units_own"] = sum(1 for u in model.units if not u.from_base)
    job.detach()
    client.close()
    return result


def fsdp2_worker(args: argparse.Namespace) -> Dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    counted = {"all_gather": 0, "reduce_scatter": 0}

    def counting(name: str, key: str, tensor_arg: str):
        real = getattr(dist, name)

        def wrapper(*a, **kw):
            tensor = kw.get(tensor_arg, a[0] if tensor_arg == "output" else a[1] if len(a) > 1
                            else None)
            if tensor is not None:
                counted[key] += tensor.numel() * tensor.element_size()
            return real(*a, **kw)
        setattr(dist, name, wrapper)

    # FSDP2 calls these through torch.distributed at each collective: the
    # gathered (whole) tensor and the reduce-scatter's whole input, as
    # zerod's counters count them.
    counting("all_gather_single", "all_gather", "output")
    counting("reduce_scatter_single", "reduce_scatter", "input")
    store = dist.FileStore(str(Path(args.workdir, f"store.{args.index}")), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model, block = build_model(args, lora=True)
    for module in model.modules():
        if isinstance(module, block):
            fully_shard(module)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                            weight_decay=0.0)

    step_fn = stepper(args, model, opt)

    result = train(args, model, step_fn, lambda: dict(counted))
    dist.destroy_process_group()
    return result


def base_producer(args: argparse.Namespace) -> Dict:
    """Shards the plain model into job "base" and detaches (the launcher
    freezes it)."""
    import torch

    import zerod
    import zerod.torch

    torch.set_num_threads(1)
    model, block = build_model(args, lora=False)
    client = zerod.Client(args.socket)
    job = client.attach("base", rank=0, config=zerod.JobConfig(lr=1e-3, weight_decay=0.0))
    zerod.torch.shard(model, job, units=[block])
    job.detach()
    client.close()
    return {}


def worker_main(args: argparse.Namespace) -> int:
    client_python = REPO_ROOT / "client" / "python"
    if str(client_python) not in sys.path:
        sys.path.append(str(client_python))
    roles = {"base": base_producer, "shared": zerod_worker, "private": zerod_worker,
             "fsdp2": fsdp2_worker}
    result = roles[args.role](args)
    result["peak_rss_kib"] = vmhwm_kib(os.getpid())
    Path(args.result).write_text(json.dumps(result))
    return 0


# --------------------------------------------------------------------------
# The launcher
# --------------------------------------------------------------------------


class Run:
    """One mode's processes in a temporary directory; stops them all on exit."""

    def __init__(self, args: argparse.Namespace, mode: str) -> None:
        self.args = args
        self.mode = mode
        self.dir = Path(tempfile.mkdtemp(prefix=f"zerod-bench-bases-{mode}-"))
        self.daemon: Optional[subprocess.Popen] = None
        self.workers: List[subprocess.Popen] = []

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        for w in self.workers:
            _stop(w, signal.SIGTERM, 5.0)
        if self.daemon is not None:
            _stop(self.daemon, signal.SIGTERM, 15.0)
        shutil.rmtree(self.dir, ignore_errors=True)

    def worker(self, role: str, index: int) -> subprocess.Popen:
        a = self.args
        cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role,
               "--index", str(index), "--workdir", str(self.dir),
               "--result", str(self.dir / f"result.{role}.{index}.json"),
               "--socket", str(self.dir / "zerod.sock"), "--steps", str(a.steps),
               "--warmup-steps", str(a.warmup_steps), "--d-model", str(a.d_model),
               "--layers", str(a.layers), "--batch", str(a.batch),
               "--lora-rank", str(a.lora_rank)]
        env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                   OMP_NUM_THREADS="1")
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=_die_with_parent)

    def start_daemon(self) -> None:
        log_file = open(self.dir / "zerod.log", "wb")
        self.daemon = subprocess.Popen(
            [str(self.args.zerod_bin), "standalone", "--ranks", "1", "--dir", str(self.dir),
             "--threads-per-rank", "1", "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            preexec_fn=_die_with_parent, start_new_session=True)
        log_file.close()
        deadline = time.monotonic() + 20
        while not (self.dir / "zerod.sock").exists():
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise LaunchError("zerod did not start" + self.log_tail())
            time.sleep(0.05)

    def log_tail(self) -> str:
        try:
            lines = (self.dir / "zerod.log").read_text(errors="replace").splitlines()[-15:]
        except OSError:
            return ""
        return "\nlast lines of the zerod log:\n" + "\n".join(lines) if lines else ""

    def check(self, procs: List[subprocess.Popen]) -> None:
        if self.daemon is not None and self.daemon.poll() is not None:
            raise LaunchError(f"zerod exited ({status_text(self.daemon.returncode)})"
                              + self.log_tail())
        for p in procs:
            if p.poll() not in (None, 0):
                raise LaunchError(f"a {self.mode} worker exited with "
                                  f"{status_text(p.returncode)}" + self.log_tail())

    def wait_all(self, procs: List[subprocess.Popen], until=None, timeout_s: float = 600) -> None:
        """Until every proc has exited 0 (or `until()` holds)."""
        deadline = time.monotonic() + timeout_s
        while not (until() if until else all(p.poll() == 0 for p in procs)):
            self.check(procs)
            if time.monotonic() > deadline:
                raise LaunchError(f"the {self.mode} workers did not finish in {timeout_s:.0f} s")
            time.sleep(0.02)

    def make_base(self) -> Dict:
        producer = self.worker("base", 0)
        self.wait_all([producer])
        ctl = Path(self.args.zerod_bin).parent / "zerodctl"
        proc = subprocess.run([str(ctl), "-c", f"unix:{self.dir / 'control.sock'}", "jobs",
                               "freeze", "base"], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise LaunchError("zerodctl jobs freeze base: " + (proc.stderr or proc.stdout))
        return json.loads((self.dir / "result.base.0.json").read_text())

    def run(self) -> Dict:
        a = self.args
        producer = {}
        if self.mode != "fsdp2":
            self.start_daemon()
        if self.mode == "shared":
            producer = self.make_base()
        self.workers = [self.worker(self.mode, i) for i in range(a.jobs)]
        pids = ([self.daemon.pid] if self.daemon else []) + [w.pid for w in self.workers]
        sampler = PssSampler(pids, a.sample_ms / 1000.0)
        sampler.start()
        try:
            ready = [self.dir / f"ready.{i}" for i in range(a.jobs)]
            self.wait_all(self.workers, until=lambda: all(r.exists() for r in ready))
            (self.dir / "go").touch()
            self.wait_all(self.workers)
        finally:
            sampler.stop()
        daemon_rss = 0
        if self.daemon is not None:
            daemon_rss = vmhwm_kib(self.daemon.pid)
            code = _stop(self.daemon, signal.SIGTERM, 15.0)
            self.daemon = None
            if code != 0:
                raise LaunchError(f"zerod exited with {status_text(code)} on SIGTERM")
        jobs = [json.loads((self.dir / f"result.{self.mode}.{i}.json").read_text())
                for i in range(a.jobs)]
        rss = {"zerod": daemon_rss} if daemon_rss else {}
        rss.update({f"job{i}": j["peak_rss_kib"] for i, j in enumerate(jobs)})
        return {"jobs": jobs, "peak_pss_kib": sampler.peak_kib, "peak_rss_kib": rss,
                "producer_peak_rss_kib": producer.get("peak_rss_kib"),
                "steps_per_s": sum(j["steps_per_s"] for j in jobs) / len(jobs),
                "bytes_per_step": {k: sum(j["bytes"][k] for j in jobs) / len(jobs)
                                   for k in jobs[0]["bytes"]}}


def figure(name: str, value: float, baseline: float, **raw) -> Dict:
    target, direction = TARGETS[name]
    ratio = value / baseline if baseline else float("inf")
    met = ratio <= target if direction == "max" else ratio >= target
    return {"bench": name, "ratio": round(ratio, 4), "target": target, "direction": direction,
            "met": bool(met), **raw}


def report(args: argparse.Namespace, runs: Dict[str, Dict]) -> None:
    machine = {"cores": os.cpu_count(), "ranks_per_job": 1, "jobs": args.jobs,
               "torch_threads_per_worker": 1}
    model = {"layers": args.layers, "d_model": args.d_model, "lora_rank": args.lora_rank,
             "batch": args.batch, "steps": args.steps, "warmup_steps": args.warmup_steps}
    shared, private, fsdp2 = (runs.get(m) for m in MODES)
    if shared:
        job = shared["jobs"][0]
        base, adapters = job["base_bytes"], job["adapter_bytes"]
        zd = sum(v for k, v in shared["bytes_per_step"].items()
                 if k in ("all_gather", "reduce_scatter"))
        computed = base + 2 * adapters
        raw = {"unit": "bytes/step/job", "shared": round(zd),
               "shared_by_collective": {k: round(v) for k, v in shared["bytes_per_step"].items()},
               "fsdp2_computed": computed, "base_bytes": base, "adapter_bytes": adapters,
               "note": "shared and private: Job.stats() all_gather + reduce_scatter bytes "
                       "over the timed steps; fsdp2_computed (the ratio's baseline) = the "
                       "frozen base's fp32 bytes all-gathered once + the adapters' bytes "
                       "all-gathered and reduce-scattered, from the parameter sizes (what "
                       "each rank gathers per step at any world size >= 2; FSDP2 gathers the "
                       "blocks again for backward, which it leaves out); fsdp2_counted = "
                       "what FSDP2's all_gather_single/reduce_scatter_single calls moved: "
                       "0 at world size 1, where FSDP2 skips its collectives"}
        if private:
            raw["private"] = round(sum(v for k, v in private["bytes_per_step"].items()
                                       if k in ("all_gather", "reduce_scatter")))
            raw["private_by_collective"] = {k: round(v) for k, v in
                                            private["bytes_per_step"].items()}
        if fsdp2:
            raw["fsdp2_counted"] = round(sum(fsdp2["bytes_per_step"].values()))
        emit(figure("bases_collective_bytes", zd, computed, **raw, **machine))
    if shared and private:
        emit(figure("bases_peak_memory", shared["peak_pss_kib"], private["peak_pss_kib"],
                    unit="MiB", shared_peak_pss=mib(shared["peak_pss_kib"]),
                    private_peak_pss=mib(private["peak_pss_kib"]),
                    fsdp2_peak_pss=mib(fsdp2["peak_pss_kib"]) if fsdp2 else None,
                    shared_rss_sum=mib(sum(shared["peak_rss_kib"].values())),
                    private_rss_sum=mib(sum(private["peak_rss_kib"].values())),
                    fsdp2_rss_sum=mib(sum(fsdp2["peak_rss_kib"].values())) if fsdp2 else None,
                    shared_peak_rss={k: mib(v) for k, v in shared["peak_rss_kib"].items()},
                    private_peak_rss={k: mib(v) for k, v in private["peak_rss_kib"].items()},
                    base_producer_peak_rss=mib(shared["producer_peak_rss_kib"] or 0),
                    note="the ratio: the peak over time of the summed PSS of the daemon "
                         "and the workers (sampled); *_rss_sum: the sum of each process's "
                         "VmHWM, which counts pages shared between the daemon and a worker "
                         "(gathered buffers, the base cache) in both; shared workers make "
                         "their local model on the meta device (no copy of the base), "
                         "private ones make the base's values and hand them to the daemon; "
                         "the base's producer exited before the jobs started and is not in "
                         "the sums",
                    **machine))
        emit(figure("bases_steps_per_s", shared["steps_per_s"], private["steps_per_s"],
                    unit="steps/s per job", shared=round(shared["steps_per_s"], 3),
                    private=round(private["steps_per_s"], 3),
                    shared_jobs=[round(j["steps_per_s"], 3) for j in shared["jobs"]],
                    private_jobs=[round(j["steps_per_s"], 3) for j in private["jobs"]],
                    shared_final_losses=[j["final_loss"] for j in shared["jobs"]],
                    private_final_losses=[j["final_loss"] for j in private["jobs"]],
                    shared_units_from_base=shared["jobs"][0]["units_from_base"],
                    **machine, **model))
    if shared and fsdp2:
        emit(figure("bases_steps_per_s_fsdp2", shared["steps_per_s"], fsdp2["steps_per_s"],
                    unit="steps/s per job", shared=round(shared["steps_per_s"], 3),
                    fsdp2=round(fsdp2["steps_per_s"], 3),
                    fsdp2_jobs=[round(j["steps_per_s"], 3) for j in fsdp2["jobs"]],
                    note="the FSDP2 jobs ran at once, each its own process group of world "
                         "size 1", **machine))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="timed steps per job")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first")
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="rows per step")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--sample-ms", type=float, default=50.0, help="PSS sampling period")
    p.add_argument("--zerod-bin", help="the daemon (default: $ZEROD_BIN_DIR/zerod, else "
                   "build/release/bin/zerod); zerodctl is taken from its directory")
    p.add_argument("--role", choices=["launcher", "base"] + list(MODES), default="launcher",
                   help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 1 or args.warmup_steps < 1 or args.jobs < 1:
        p.error("--steps, --warmup-steps and --jobs must be at least 1")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(set(args.modes) - set(MODES))}")
    return args


def main() -> int:
    args = parse_args()
    if args.role != "launcher":
        return worker_main(args)
    args.zerod_bin = str(find_zerod_binary(args.zerod_bin))
    torch = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True).stdout.strip() or "?"
    runs: Dict[str, Dict] = {}
    failed = False
    for mode in args.modes:
        if mode == "fsdp2" and subprocess.run([sys.executable, "-c", FSDP2_PROBE],
                                              capture_output=True).returncode:
            emit({"bench": "bases_fsdp2", "skipped": f"torch {torch} has no "
                  "torch.distributed.fsdp.fully_shard (FSDP2: torch 2.4 or later, "
                  "the .venv-torch2 run)"})
            continue
        log(f"{mode}: {args.jobs} jobs, {args.warmup_steps} + {args.steps} steps")
        t0 = time.monotonic()
        try:
            with Run(args, mode) as run:
                runs[mode] = run.run()
        except (LaunchError, OSError, ValueError) as e:
            emit({"bench": f"bases_{mode}", "error": str(e)})
            failed = True
            continue
        log(f"{mode}: {runs[mode]['steps_per_s']:.3f} steps/s per job, "
            f"{time.monotonic() - t0:.0f} s in all")
    report(args, runs)
    return 1 if failed else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
