#!/usr/bin/env python3
"""The PyTorch transformer example through zerod against torch DDP and FSDP2 (Gloo).

In one run, trains the same model (examples/python/lm.py), with the same
global batches, ranks and threads, for the same number of steps:

  zerod  a standalone daemon with R ranks and R worker processes, the code
         of examples/python/train_lm.py (the benchmark starts it the same way);
  ddp    torch.nn.parallel.DistributedDataParallel on Gloo, R processes;
  fsdp2  torch FSDP2 (fully_shard, one per block and one for the rest) on
         Gloo, with torch 2.6 or later (run the benchmark with that torch's
         Python: `make bench` does, from the virtual environment that
         `scripts/deps.sh torch2` makes);
  fsdp   torch FSDP on Gloo, if this torch can run it on CPU (torch 1.13
         cannot: the benchmark says why in a "skipped" line).

Each backend first runs --warmup-steps steps that are not timed, then
--steps timed steps. Figures, per backend: steps/s over the timed steps
(of the slowest rank), each process's peak RSS (VmHWM from
/proc/PID/status, read just before it exits), and the peak over time of the
summed PSS of all the backend's processes (workers, and the daemon for
zerod), sampled every --sample-ms (50 ms, or longer where reading them
would take more than a tenth of a core) from /proc/PID/smaps_rollup. PSS splits
shared pages between the processes that map them, so memory the daemon
shares with its workers is counted once.

Prints one JSON line per backend and one with the ratios zerod / ddp. With
--rounds N > 1 the backends alternate (zerod, ddp, zerod, ...) and each
figure is the median of the rounds. There is no pass or fail on timings.

    /usr/bin/python3 bench/bench_torch_lm.py [--steps 20] [--warmup-steps 3] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "examples" / "python"))

from launch import Cluster, LaunchError  # noqa: E402

KIB_PER_MIB = 1024.0
TORCH = "torch ?"  # the version the workers run, set by main

# A one-process FSDP step on CPU with Gloo; its last line of output says
# what failed, if anything.
FSDP_PROBE = r"""
import os, sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
model = FullyShardedDataParallel(torch.nn.Linear(8, 8))
model(torch.ones(2, 8)).sum().backward()
print("ok")
"""

# The same with FSDP2's fully_shard (torch 2.6 and later).
FSDP2_PROBE = r"""
import os, sys, tempfile
import torch, torch.distributed as dist
try:
    from torch.distributed.fsdp import fully_shard
except Exception as e:
    sys.exit("no torch.distributed.fsdp.fully_shard (FSDP2 needs torch 2.6 or later; "
             "scripts/deps.sh torch2 makes .venv-torch2 with one): %s" % type(e).__name__)
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
model = fully_shard(torch.nn.Linear(8, 8))
model(torch.ones(2, 8)).sum().backward()
print("ok")
"""

BLAS_PROBE = r"""
import torch
torch.ones(4, 4) @ torch.ones(4, 4)
libs = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libblas" in l or "openblas" in l})
print(" ".join(libs))
"""


def log(message: str) -> None:
    print(f"bench_torch_lm: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Probes
# --------------------------------------------------------------------------


def probe(code: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout_s, env=env)


def fsdp_unavailable_reason(code: str = FSDP_PROBE) -> Optional[str]:
    """None if FSDP (or FSDP2) runs one CPU step with Gloo here; else what went wrong."""
    try:
        result = probe(code)
    except subprocess.TimeoutExpired:
        return "a one-process FSDP step on CPU did not finish in 120 s"
    if result.returncode == 0 and result.stdout.strip().endswith("ok"):
        return None
    lines = [l for l in result.stderr.strip().splitlines() if l.strip()]
    return f"{torch_version()}: " + (lines[-1] if lines else f"exit status {result.returncode}")


def torch_version() -> str:
    """'torch 1.13.1 on Python 3.11.2'."""
    result = probe("import sys, torch; print(torch.__version__, sys.version.split()[0])")
    versions = result.stdout.split()
    return f"torch {versions[0]} on Python {versions[1]}" if len(versions) == 2 else "torch ?"


def torch_blas() -> str:
    """Which BLAS library torch multiplies matrices with (netlib, openblas, ...)."""
    libs = probe(BLAS_PROBE).stdout.split()
    if any("openblas" in lib for lib in libs):
        return "openblas"
    if any("/blas/libblas" in lib for lib in libs):
        return "netlib (reference)"
    return " ".join(libs) or "unknown"


# --------------------------------------------------------------------------
# Memory sampling
# --------------------------------------------------------------------------


def pss_kib(pid: int) -> int:
    """A process's proportional set size in KiB; 0 once it has exited."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def vmhwm_kib(pid: int) -> int:
    """A process's peak resident set (VmHWM) in KiB; 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class PssSampler(threading.Thread):
    """Samples the summed PSS of a set of processes; keeps the peak.

    Reading smaps_rollup walks the process's page tables: about 8 ms for a
    400 MB worker here, so three processes every 50 ms would take 40% of
    one of this machine's two cores from the training being measured. The
    period therefore stretches to `max_duty` of the time a pass takes
    (10x the pass with the default 0.1); `mean_period_ms` says what it was.
    """

    def __init__(self, pids: List[int], period_s: float, max_duty: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pids = list(pids)
        self.period_s = period_s
        self.max_duty = max_duty
        self.peak_kib = 0
        self.samples = 0
        self._t_start = time.monotonic()
        self._t_stop = self._t_start
        self._stop_event = threading.Event()

    def run(self) -> None:
        self._t_start = time.monotonic()
        while not self._stop_event.is_set():
            t0 = time.monotonic()
            self.peak_kib = max(self.peak_kib, sum(pss_kib(pid) for pid in self.pids))
            self.samples += 1
            pass_s = time.monotonic() - t0
            self._stop_event.wait(max(self.period_s - pass_s, pass_s / self.max_duty - pass_s))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self._t_stop = time.monotonic()

    @property
    def mean_period_ms(self) -> float:
        return 1000.0 * (self._t_stop - self._t_start) / max(1, self.samples)


# --------------------------------------------------------------------------
# One backend, one round
# --------------------------------------------------------------------------


def worker_argv(args: argparse.Namespace, result_json: str) -> List[str]:
    """train_lm.py's arguments: warmup + timed steps, no evaluation or sample."""
    return ["--ranks", str(args.ranks), "--steps", str(args.warmup_steps + args.steps),
            "--batch", str(args.batch), "--context", str(args.context),
            "--d-model", str(args.d_model), "--layers", str(args.layers), "--heads", str(args.heads),
            "--threads", str(args.threads), "--seed", str(args.seed),
            "--eval-every", "0", "--eval-batches", "0", "--sample-bytes", "0",
            "--log-every", str(10 ** 9), "--result-json", result_json]


def timed_rate(step_end_s: List[float], warmup_steps: int) -> float:
    """Steps per second over the steps after the first `warmup_steps` (at least 1:
    the clock starts when the last warmup step ends)."""
    return (len(step_end_s) - warmup_steps) / (step_end_s[-1] - step_end_s[warmup_steps - 1])


def run_backend(backend: str, args: argparse.Namespace, workdir: Path) -> Dict:
    """Trains once with `backend`; its figures."""
    result_json = str(workdir / f"{backend}.json")
    cluster = Cluster(backend, args.ranks, worker_argv(args, result_json), zerod_bin=args.zerod_bin,
                      daemon_threads=args.threads, rank0_stdout=subprocess.DEVNULL, quiet=True)
    with cluster:
        sampler = PssSampler(cluster.pids(), args.sample_ms / 1000.0)
        sampler.start()
        try:
            cluster.wait()
        finally:
            sampler.stop()
        peak_rss = {}
        if cluster.daemon is not None:
            peak_rss["zerod"] = vmhwm_kib(cluster.daemon.pid)
        cluster.stop_daemon()
    results = [json.loads(Path(f"{result_json}.rank{r}").read_text()) for r in range(args.ranks)]
    for r in results:
        peak_rss[f"rank{r['rank']}"] = r["peak_rss_kib"]
    rate = min(timed_rate(r["step_end_s"], args.warmup_steps) for r in results)
    return {"steps_per_s": rate, "peak_pss_kib": sampler.peak_kib,
            "pss_period_ms": sampler.mean_period_ms,
            "peak_rss_kib": peak_rss, "params": results[0]["params"],
            "final_loss_rank0": next(r["final_loss"] for r in results if r["rank"] == 0)}


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


BENCH_NAMES = {"zerod": "zerod", "ddp": "torch_ddp_gloo", "fsdp2": "torch_fsdp2_gloo",
               "fsdp": "torch_fsdp_gloo"}
PROBES = {"fsdp": FSDP_PROBE, "fsdp2": FSDP2_PROBE}


def mib(kib: float) -> float:
    return round(kib / KIB_PER_MIB, 1)


def summary(backend: str, rounds: List[Dict], args: argparse.Namespace, blas: str) -> Dict:
    """The JSON line of one backend: medians over the rounds."""
    rates = [r["steps_per_s"] for r in rounds]
    pss = [r["peak_pss_kib"] for r in rounds]
    rate = statistics.median(rates)
    names = sorted(rounds[0]["peak_rss_kib"])
    return {
        "bench": "torch_lm", "backend": BENCH_NAMES[backend], "params": rounds[0]["params"],
        "ranks": args.ranks, "threads": args.threads, "global_batch": args.batch,
        "context": args.context, "steps": args.steps, "warmup_steps": args.warmup_steps,
        "blas": blas, "torch": TORCH, "metric": "steps/s", "value": round(rate, 3),
        "tokens_per_s": round(rate * args.batch * args.context),
        "peak_pss_mib": mib(statistics.median(pss)),
        "peak_rss_mib": {n: mib(statistics.median(r["peak_rss_kib"][n] for r in rounds)) for n in names},
        "pss_period_ms": round(statistics.median(r["pss_period_ms"] for r in rounds)),
        "final_loss_rank0": round(rounds[0]["final_loss_rank0"], 4),
        "rounds": len(rounds), "values": [round(v, 3) for v in rates],
        "peak_pss_mib_values": [mib(v) for v in pss],
    }


def ratio_line(zerod: Dict, other: Dict, backend: str) -> Dict:
    return {
        "bench": f"torch_lm_zerod_vs_{backend}", "metric": "steps/s", "value": zerod["value"],
        "baseline": other["backend"], "baseline_value": other["value"],
        "ratio": round(zerod["value"] / other["value"], 3),
        "peak_pss_mib": zerod["peak_pss_mib"], "baseline_peak_pss_mib": other["peak_pss_mib"],
        "peak_pss_ratio": round(zerod["peak_pss_mib"] / other["peak_pss_mib"], 3),
        "torch": zerod["torch"],
    }


def emit(line: Dict) -> None:
    print(json.dumps(line, separators=(",", ":")), flush=True)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="zerod vs torch DDP (Gloo) on the transformer example",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps per backend")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds; figures are medians")
    p.add_argument("--backends", default="zerod,ddp,fsdp2,fsdp",
                   help="comma-separated: zerod, ddp, fsdp2, fsdp")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker, kernel "
                   "threads per daemon rank")
    p.add_argument("--batch", type=int, default=16, help="global batch, in sequences")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-ms", type=float, default=50.0,
                   help="PSS sampling period (stretched so that sampling takes at most 10%% of a core)")
    p.add_argument("--zerod-bin", help="the zerod binary (default: $ZEROD_BIN_DIR/zerod, "
                   "else build/release/bin/zerod)")
    args = p.parse_args()
    if args.steps < 1 or args.warmup_steps < 1 or args.rounds < 1:
        p.error("--steps, --warmup-steps and --rounds must be at least 1")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - set(BENCH_NAMES)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}: choose from zerod, ddp, fsdp2, fsdp")
    return args


def main() -> int:
    global TORCH
    args = parse_args()
    TORCH = torch_version()
    blas = torch_blas()
    backends = list(args.backends)
    failed = False
    for fsdp in ("fsdp2", "fsdp"):
        if fsdp in backends:
            reason = fsdp_unavailable_reason(PROBES[fsdp])
            if reason is not None:
                backends.remove(fsdp)
                emit({"bench": "torch_lm", "backend": BENCH_NAMES[fsdp], "skipped": reason})
    rounds: Dict[str, List[Dict]] = {b: [] for b in backends}
    with tempfile.TemporaryDirectory(prefix="zerod-bench-lm-") as workdir:
        for round_index in range(args.rounds):
            for backend in list(backends):
                log(f"round {round_index + 1}/{args.rounds}: {backend}, {args.ranks} ranks, "
                    f"{args.warmup_steps} + {args.steps} steps")
                t0 = time.monotonic()
                try:
                    rounds[backend].append(run_backend(backend, args, Path(workdir)))
                except (LaunchError, OSError, ValueError) as e:
                    emit({"bench": "torch_lm", "backend": BENCH_NAMES[backend], "error": str(e)})
                    backends.remove(backend)
                    failed = True
                    continue
                log(f"{backend}: {rounds[backend][-1]['steps_per_s']:.3f} steps/s, "
                    f"{time.monotonic() - t0:.0f} s in all")
    lines = {b: summary(b, rounds[b], args, blas) for b in backends}
    for line in lines.values():
        emit(line)
    for other in ("ddp", "fsdp2", "fsdp"):
        if "zerod" in lines and other in lines:
            emit(ratio_line(lines["zerod"], lines[other], other))
    return 1 if failed else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
