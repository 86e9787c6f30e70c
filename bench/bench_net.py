#!/usr/bin/env python3
"""bench_net: the example LM on two nodes over an emulated network
(issue 39; scripts/netcluster.py), ZeRO++ off and on, at several link rates.

For each rate: two network namespaces joined through a bridge by veth
pairs shaped with `tbf rate R` both ways (198.18.0.0/24, nothing leaves the
machine); the coordinator and node a (2 ranks) in one, node b (2 ranks) in
the other; the example LM (examples/python/train_lm.py, 4 workers, each in
its node's namespace) trains --steps steps with the same seed, once per
setting, as bench_zeropp.py does on loopback:

  off     hierarchical collectives, fp32 on every hop;
  on      qwZ (int8 weights), qgZ (int4 gradient sums between nodes), hpZ;
  onebit  qwZ and hpZ, and 1-bit Adam instead of qgZ: --onebit-warmup exact
          steps, then gradient sums between nodes as signs with error
          feedback (docs/compression.md; bytes per step after the warm-up
          in `cross_bytes_per_step_after_warmup`);
  powersgd  qwZ and hpZ, and low-rank (PowerSGD) compression of the
          gradient sums between nodes at rank --powersgd-rank instead of
          qgZ (`zerodctl jobs create --powersgd-rank R --powersgd-start K`:
          K exact steps first, --powersgd-start, default 0).

The baseline of each rate, measured in the same run over the same link, is
a raw TCP transfer between the two namespaces. First, per rate, one large
unit (--collective-mib, fp32, one rank per node, flat collectives):
the median reduce (reduce-scatter) and gather after a step (all-gather),
each moving half the unit each way, against raw TCP transfers of that
half each way at once (figure net_collective: ratio = TCP time /
collective time, target >= 0.85, min; the one-way time is printed too).

Per run, one JSON line (`net`), over steps 2..N: the slowest rank's step
time; the bytes node a's ranks moved between nodes per step (both
directions, as zd_job_stats counts them at the "cross" level); the bytes
node a's link carried per step (`wire_bytes_per_step`: its eth0's received
and sent bytes, read from the namespace every 10 ms during the run and
interpolated at rank 0's step ends; with TCP/IP headers, ACKs and the
daemons' control traffic, and the only byte figure of the DDP runs); the
time of one direction's half of them at the raw TCP rate
(`link_s_per_direction`); per step, the time the ranks spent in
collectives (`comm_s`), the part of it the workers waited for
(`exposed_comm_s`, Job.stats: docs/daemon.md, "Exposed communication") and
the compute-only step (`compute_s` = step - exposed). The overlap target
(ratio = step / max(compute_s, link_s_per_direction) <= 1.1, max) is met
when the step costs no more than its compute or its link, whichever is
longer. Then, unless --no-ddp, torch DDP on Gloo (train_lm.py --backend
ddp, the same 4 workers in the same namespaces; run `ddp`) and, with
--powersgd-rank R > 0, DDP with torch's PowerSGD communication hook at
rank R (train_lm.py --ddp-powersgd-rank R; run `ddp_powersgd`: exact
all-reduces for its first 2 steps, then low-rank with error feedback; its
link bytes per step over steps 3..N in `wire_bytes_per_step_after_warmup`).
Then the ratios: `net_vs_ddp` (each zerod run's steps/s over DDP's, target
>= 1.0, and >= 2.3 for ZeRO++ on at 100 Mbit/s), on/off, and for the
powersgd run `net_powersgd_vs_ddp_powersgd` (its steps/s over DDP with
PowerSGD at the same rank, target >= 1.0) and `net_powersgd_vs_on` (its
steps/s over ZeRO++ on's, int4 qgZ, target >= 1.0), and `net_lowrank_bytes`:
its gradient reduces' cross-node bytes (`cross_reduce_bytes_per_step`:
reduce-scatters and all-to-alls) over off's, against the bound r (m + n) /
(m n) over the job's units as the daemon reads them (max).

    sudo python3 bench/bench_net.py [--rates 100mbit,1gbit,10gbit,none] [--steps 20]
                                    [--powersgd-rank 4]

Needs root (network namespaces); prints a skip line and exits 0 without.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import netcluster  # noqa: E402

BIN = Path(os.environ.get("ZEROD_BIN_DIR", ROOT / "build" / "release" / "bin"))
TRAIN_LM = ROOT / "examples" / "python" / "train_lm.py"
TOKEN = "bench-net"
RANKS = 2
PORT = 7272
# train_lm.py --ddp-powersgd-rank: torch's PowerSGD hook all-reduces the exact
# gradients for this many steps (start_powerSGD_iter), then compresses.
DDP_POWERSGD_EXACT_STEPS = 2


def log(message: str) -> None:
    print(f"bench_net: {message}", file=sys.stderr, flush=True)


class JobRejected(Exception):
    """`zerodctl jobs create` failed; the message is its stderr."""


class WireBytes:
    """The bytes node 0's link carries (its eth0's received + sent bytes,
    from /proc/<pid>/net/dev of a process in its namespace), sampled every
    `interval_s` by a thread between start() and stop(); at(t) interpolates
    them at time.monotonic() t, the clock train_lm.py's step ends are on."""

    def __init__(self, pid: int, interval_s: float = 0.01) -> None:
        self.path, self.interval_s = "/proc/%d/net/dev" % pid, interval_s
        self.times: list = []
        self.counts: list = []
        self._stop = threading.Event()
        self._thread = None

    def read(self) -> int:
        with open(self.path) as f:
            for line in f:
                name, _, fields = line.partition(":")
                if name.strip() == "eth0":
                    v = fields.split()
                    return int(v[0]) + int(v[8])  # rx_bytes, tx_bytes
        raise RuntimeError("bench_net: no eth0 in " + self.path)

    def _sample(self) -> None:
        while True:
            t, n = time.monotonic(), self.read()
            self.times.append(t)
            self.counts.append(n)
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> "WireBytes":
        self.times, self.counts = [], []
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.times.append(time.monotonic())
        self.counts.append(self.read())

    def at(self, t: float) -> float:
        i = bisect.bisect_right(self.times, t)
        if i == 0:
            return float(self.counts[0])
        if i == len(self.times):
            return float(self.counts[-1])
        t0, t1 = self.times[i - 1], self.times[i]
        c0, c1 = self.counts[i - 1], self.counts[i]
        return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)


class NetRun:
    """A coordinator and two nodes in a NetCluster, and jobs trained on them."""

    def __init__(self, net: netcluster.NetCluster, tmp: Path) -> None:
        self.net, self.tmp = net, tmp
        self.coord = "%s:%d" % (net.address(0), PORT)
        self.replicas = []
        self.spawn(0, "coordinator", ["coordinator", "--listen", self.coord, "--insecure",
                                      "--state-dir", str(tmp / "coord"), "--lease-ttl", "5"])
        self.sockets = []
        for i, name in enumerate(("node-a", "node-b")):
            d = tmp / name
            d.mkdir()
            self.replicas.append(tempfile.mkdtemp(prefix="zerod-bench-net-", dir="/dev/shm"))
            self.spawn(i, name, ["node", "--coordinator", self.coord, "--insecure", "--name", name,
                                 "--ranks", str(RANKS), "--dir", str(d), "--threads-per-rank",
                                 "1", "--comm-host", net.address(i), "--replica-dir",
                                 self.replicas[-1]])
            self.sockets.append(d / "zerod.sock")
        self.wait("2 members", lambda: self.ctl("members").count("node-") >= 2)
        # A process in node a's namespace, whose /proc/<pid>/net/dev is the
        # namespace's: what WireBytes reads.
        self.wire = WireBytes(net.popen(0, ["sleep", "infinity"]).pid)

    def spawn(self, i: int, name: str, args) -> None:
        out = open(self.tmp / (name + ".log"), "w")
        self.net.popen(i, [str(BIN / "zerod")] + args, stderr=out, stdout=out)

    def ctl_run(self, *args) -> subprocess.CompletedProcess:
        return self.net.run(0, [str(BIN / "zerodctl"), "-c", self.coord, "--insecure"] +
                            list(args), capture_output=True, text=True, timeout=60)

    def ctl(self, *args) -> str:
        p = self.ctl_run(*args)
        return p.stdout if p.returncode == 0 else ""

    def wait(self, what: str, predicate, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise SystemExit(f"bench_net: timed out waiting for {what}")

    def create_job(self, name: str, args, mode: str) -> None:
        extra = {"off": [],
                 "on": ["--quantized-weights", "--quantized-gradients", "4",
                        "--hpz-partition-size", str(RANKS)],
                 "onebit": ["--quantized-weights", "--hpz-partition-size", str(RANKS),
                            "--onebit-adam", str(args.onebit_warmup)],
                 "powersgd": ["--quantized-weights", "--hpz-partition-size", str(RANKS),
                              "--powersgd-rank", str(args.powersgd_rank),
                              "--powersgd-start", str(args.powersgd_start)]}[mode]
        # The hyper-parameters train_lm.py asks for, so that its attach agrees.
        made = self.ctl_run("jobs", "create", name, "--nodes", "2", "--ranks-per-node",
                            str(RANKS), "--token", TOKEN, "--optimizer", "adamw", "--lr",
                            str(args.lr), "--betas", "0.9,0.95", "--eps", "1e-8",
                            "--weight-decay", "0.1", "--max-grad-norm", "1.0",
                            "--max-live-bytes", args.max_live_bytes, *extra)
        if made.returncode != 0:
            why = (made.stderr.strip() or made.stdout.strip()).splitlines()
            raise JobRejected(why[-1] if why else f"zerodctl exit status {made.returncode}")
        self.wait(f"job {name}", lambda: "state: ready" in self.ctl("jobs", "get", name))

    def train(self, name: str, args) -> dict:
        """train_lm.py's 4 workers on job `name`, each attached to its node's
        daemon; their results by rank."""
        return self._workers(name, args, lambda i, r: [
            "--worker", "--local-rank", str(r), "--socket", str(self.sockets[i]), "--job", name,
            "--token", TOKEN])

    def train_ddp(self, args, name: str = "ddp", powersgd_rank: int = 0) -> dict:
        """The same training with torch DDP on Gloo (train_lm.py --backend
        ddp): 4 worker processes, ranks 0-1 in node a's namespace and 2-3 in
        node b's, rendezvous through a FileStore both can reach, Gloo bound
        to the namespace's link (GLOO_SOCKET_IFNAME); with powersgd_rank >
        0, through torch's PowerSGD hook at that rank."""
        store = self.tmp / (name + "-store")
        hook = ["--ddp-powersgd-rank", str(powersgd_rank)] if powersgd_rank > 0 else []
        return self._workers(name, args, lambda i, r: [
            "--backend", "ddp", "--worker", "--local-rank", str(i * RANKS + r), "--world-size",
            str(2 * RANKS), "--ranks", str(2 * RANKS), "--store", str(store), *hook],
            env=dict(os.environ, GLOO_SOCKET_IFNAME="eth0"))

    def _workers(self, name: str, args, role, env=None) -> dict:
        """Runs train_lm.py for local rank r of node i (role(i, r): the
        arguments that say who it is) in node i's namespace, all at once,
        with the run's common arguments; their results by global rank."""
        results = self.tmp / (name + ".json")
        procs = []
        self.wire.start()
        for i in range(2):
            for r in range(RANKS):
                out = open(self.tmp / f"{name}-{i}-{r}.out", "w")
                procs.append(self.net.popen(i, [
                    sys.executable, str(TRAIN_LM), *role(i, r),
                    "--steps", str(args.steps), "--lr", str(args.lr), "--eval-every", "0",
                    "--sample-bytes", "0", "--log-every", str(max(args.steps // 5, 1)),
                    "--threads", "1", "--result-json", str(results)],
                    stdout=out, stderr=subprocess.STDOUT, env=env))
        try:
            for p in procs:
                if p.wait(timeout=7200) != 0:
                    outs = sorted(self.tmp.glob(f"{name}-*.out"))
                    raise SystemExit(f"bench_net: a {name} worker failed:\n" +
                                     "\n".join(o.read_text()[-2000:] for o in outs))
        finally:
            self.wire.stop()
        return {r: json.loads(Path(f"{results}.rank{r}").read_text()) for r in range(2 * RANKS)}

    def close(self) -> None:
        self.net.close()
        for d in self.replicas:
            shutil.rmtree(d, ignore_errors=True)


# One rank per node: a unit of `numel` fp32 split in halves, so that each
# reduce (reduce-scatter) and each gather after a step (all-gather) sends
# numel * 2 bytes each way between the nodes.
COLLECTIVES = r"""
import json, sys, time, zerod
socket, job, token, numel, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
with zerod.Client(socket) as c:
    j = c.attach(job, token=token)
    u = j.register("w", [("w", (numel,))], init="zeros")
    out = {"reduce": [], "gather": []}
    for _ in range(reps + 1):
        u.grad_buffer().array()[...] = 0.001
        t0 = time.monotonic(); u.reduce(); t1 = time.monotonic()
        j.step()
        t2 = time.monotonic(); g = u.gather(); t3 = time.monotonic(); g.release()
        out["reduce"].append(t1 - t0); out["gather"].append(t3 - t2)
    mine = [r for r in j.stats() if r["rank"] == j.rank]
    counted = {"%s/%s" % key: c["bytes"] for r in mine for key, c in r["counters"].items()}
    print(json.dumps(dict({k: v[1:] for k, v in out.items()}, counted=counted)), flush=True)
"""


def collectives(rate: str, run: "NetRun", net: netcluster.NetCluster, args) -> None:
    """The cross-node reduce-scatter and all-gather of one large unit
    against raw TCP transfers of the same bytes over the same link: each
    way at once (what the collective moves; the baseline of the ratio) and
    one way only."""
    numel = args.collective_mib << 18
    made = run.ctl("jobs", "create", "bw", "--nodes", "2", "--ranks-per-node", "1", "--token",
                   TOKEN, "--optimizer", "sgd", "--collectives", "flat", "--max-live-bytes", "1G")
    if not made:
        raise SystemExit("bench_net: cannot create job bw")
    run.wait("job bw", lambda: "state: ready" in run.ctl("jobs", "get", "bw"))
    procs = [run.net.popen(i, [sys.executable, "-c", COLLECTIVES, str(run.sockets[i]), "bw",
                               TOKEN, str(numel), str(args.reps)], stdout=subprocess.PIPE,
                           text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "client" /
                                                                            "python")))
             for i in range(2)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit("bench_net: a collectives worker failed")
    times = json.loads(outs[0].strip().splitlines()[-1])
    per_direction = numel * 2
    both = sorted(net.tcp_both_seconds(0, 1, per_direction, args.reps))
    raw = both[len(both) // 2]
    one_way = sorted(net.tcp_seconds(0, 1, per_direction, args.reps))[args.reps // 2]
    for kind in ("reduce", "gather"):
        t = sorted(times[kind])[len(times[kind]) // 2]
        ratio = raw / t
        print(json.dumps({"bench": "net_collective", "rate": rate, "collective":
                          {"reduce": "reduce_scatter", "gather": "all_gather"}[kind],
                          "bytes_per_direction": per_direction, "seconds": round(t, 4),
                          "raw_tcp_both_ways_seconds": round(raw, 4),
                          "raw_tcp_one_way_seconds": round(one_way, 4), "ratio": round(ratio, 3),
                          "counted_bytes_per_call": {k: v // (args.reps + 1) for k, v in
                                                     times["counted"].items()},
                          "target": 0.85, "direction": "min", "met": ratio >= 0.85}),
              flush=True)


def reduce_bytes(by_rank: dict) -> int:
    """Node a's ranks' cross-node bytes of the gradient reduces over the
    run: the reduce-scatters (exact) and all-to-alls (qgZ, 1-bit, low-rank
    factors), as zd_job_stats counts them (each collective's whole buffer)."""
    return sum(by_rank[r]["collective_bytes"].get(k, 0) for r in range(RANKS)
               for k in ("cross/reduce_scatter", "cross/all_to_all"))


def lowrank_bound(units: list, world: int, nodes: int, rank: int) -> float:
    """r (m + n) / (m n) of the reduces' exact bytes, over the job's units,
    with each unit's slice read as daemon/rank/lowrank.c reads it (cols: the
    last dimension of its largest tensor of 2+ dimensions, else about the
    square root; a unit whose factors exceed half its slice stays exact):
    the issue's target for the low-rank run's reduce bytes against exact."""
    exact = compressed = 0
    for u in units:
        s = u["padded_numel"] // world
        big = [sh for sh in u["shapes"] if len(sh) >= 2]
        largest = max(big, key=lambda sh: (math.prod(sh), -big.index(sh)), default=None)
        cols = min(largest[-1] if largest else math.ceil(math.sqrt(s)), s)
        rows = -(-s // cols)
        exact += nodes * s
        compressed += nodes * ((rows + cols) * rank if 2 * rank * (rows + cols) <= s else s)
    return compressed / exact


def summarize(rate: str, name: str, by_rank: dict, tcp_bps: float, warmup: int = 0,
              wire: "WireBytes | None" = None, extra: "dict | None" = None) -> dict:
    """One run's line. Times are over steps 2..N (the first step registers
    the units and is left out): the slowest rank's step time, and per rank
    its exposed communication per step (Job.stats: the worker's waits that
    were communication) and so its compute-only step (step - exposed); the
    overlap figure compares the step with the larger of the slowest
    compute-only step and the link time of the step's bytes. `warmup`: the
    run's exact steps before it compresses (0: none, or compressed from the
    first); `wire`: node a's link bytes during the run; `extra`: fields to
    add to the line."""
    steps = by_rank[0]["steps"]
    timed = steps - 1
    step_s = max((r["step_end_s"][-1] - r["step_end_s"][0]) / timed for r in by_rank.values())
    ends = by_rank[0]["step_end_s"]
    wired = dict(extra or {})
    if wire is not None:
        wired["wire_bytes_per_step"] = int((wire.at(ends[-1]) - wire.at(ends[0])) / timed)
    sent = sum(v for r in range(RANKS) for k, v in by_rank[r]["collective_bytes"].items()
               if k.startswith("cross/"))
    per_step = sent / steps
    # Both directions are counted; between two nodes all-gathers and
    # reduce-scatters move the same bytes each way, and the link is full
    # duplex: a direction's share is half.
    link_s = per_step / 2 / tcp_bps

    def per_step_of(r: dict, key: str) -> float:
        return (r["comm_times"][key] - r["comm_times_first"][key]) / timed

    if name.startswith("ddp"):  # no counters: the steps/s and the link's bytes only
        if wire is not None and 0 < warmup < steps:  # PowerSGD: steps warmup+1..N, compressed
            wired["wire_bytes_per_step_after_warmup"] = int(
                (wire.at(ends[-1]) - wire.at(ends[warmup - 1])) / (steps - warmup))
        return {"bench": "net", "rate": rate, "run": name, "steps": steps,
                "steps_per_s": round(1 / step_s, 3), "step_s": round(step_s, 3),
                "tcp_gbps": round(tcp_bps * 8 / 1e9, 3),
                "final_loss": round(by_rank[0]["final_loss"], 4),
                "val_loss": by_rank[0]["val_loss"] and round(by_rank[0]["val_loss"], 4),
                **wired}

    if warmup > 0:  # 1-bit Adam: the bytes per step once compressed, steps warmup+1..N
        after = sum(by_rank[r]["cross_bytes_by_step"][-1] -
                    by_rank[r]["cross_bytes_by_step"][warmup] for r in range(RANKS))
        after_warmup = {"cross_bytes_per_step_after_warmup": int(after / (steps - 1 - warmup))}
    else:
        after_warmup = {}
    exposed = max(per_step_of(r, "exposed_comm_seconds") for r in by_rank.values())
    compute = max((r["step_end_s"][-1] - r["step_end_s"][0]) / timed -
                  per_step_of(r, "exposed_comm_seconds") for r in by_rank.values())
    comm = max(per_step_of(r, "comm_seconds") for r in by_rank.values())
    bound = max(compute, link_s)
    return {"bench": "net", "rate": rate, "run": name, "steps": steps,
            "steps_per_s": round(1 / step_s, 3), "step_s": round(step_s, 3),
            "cross_bytes_per_step": int(per_step),
            "cross_reduce_bytes_per_step": int(reduce_bytes(by_rank) / steps),
            "link_s_per_direction": round(link_s, 3),
            "comm_s": round(comm, 3), "exposed_comm_s": round(exposed, 3),
            "compute_s": round(compute, 3), "tcp_gbps": round(tcp_bps * 8 / 1e9, 3),
            "final_loss": round(by_rank[0]["final_loss"], 4),
            "val_loss": by_rank[0]["val_loss"] and round(by_rank[0]["val_loss"], 4),
            "ratio": round(step_s / bound, 3), "target": 1.1, "direction": "max",
            "met": step_s <= 1.1 * bound, **after_warmup, **wired}


def one_rate(rate: str, args) -> None:
    shaped = None if rate == "none" else rate
    with tempfile.TemporaryDirectory(prefix="zerod-bench-net-") as tmp_name:
        net = netcluster.NetCluster(nodes=2, rate=shaped).open()
        run = None
        try:
            nbytes = 16 << 20
            tcp_bps = nbytes / min(net.tcp_seconds(0, 1, nbytes))
            run = NetRun(net, Path(tmp_name))
            if args.collective_mib > 0:
                collectives(rate, run, net, args)
            rows = {}
            for name in args.runs:
                log(f"{rate}: {name}, {args.steps} steps on 2 nodes x {RANKS} ranks")
                try:
                    run.create_job(name, args, name)
                except JobRejected as e:
                    raise SystemExit(f"bench_net: cannot create job {name}: {e}")
                # onebit: the bytes per step after its exact steps too;
                # powersgd has none (compressed from the first step).
                by_rank = run.train(name, args)
                extra = None
                if name == "powersgd":
                    bound = lowrank_bound(by_rank[0]["units"], 2 * RANKS, 2, args.powersgd_rank)
                    extra = {"powersgd_rank": args.powersgd_rank,
                             "lowrank_bound": bound}
                warmup = {"onebit": args.onebit_warmup, "powersgd": args.powersgd_start}
                rows[name] = summarize(rate, name, by_rank, tcp_bps, warmup.get(name, 0),
                                       run.wire, extra)
                print(json.dumps(rows[name]), flush=True)
            if args.ddp:
                ddps = [("ddp", 0)] + ([("ddp_powersgd", args.powersgd_rank)]
                                       if args.powersgd_rank > 0 else [])
                for name, rank in ddps:
                    hook = f", PowerSGD rank {rank}" if rank else ""
                    log(f"{rate}: torch DDP (Gloo{hook}), {args.steps} steps on 2 nodes x "
                        f"{RANKS} ranks")
                    rows[name] = summarize(
                        rate, name, run.train_ddp(args, name, rank), tcp_bps,
                        DDP_POWERSGD_EXACT_STEPS if rank else 0, run.wire,
                        {"powersgd_rank": rank} if rank else None)
                    print(json.dumps(rows[name]), flush=True)
        finally:
            if run is not None:
                run.close()
            net.close()
    if "off" in rows and "on" in rows:
        off, on = rows["off"], rows["on"]
        print(json.dumps({"bench": "net", "rate": rate, "what": "on_over_off",
                          "steps_per_s": round(on["steps_per_s"] / off["steps_per_s"], 3),
                          "cross_bytes": round(on["cross_bytes_per_step"] /
                                               max(off["cross_bytes_per_step"], 1), 3),
                          "loss_change": round((on["final_loss"] - off["final_loss"]) /
                                               off["final_loss"], 4)}), flush=True)
    if "ddp" in rows:
        ddp = rows["ddp"]
        for name, target in (("off", 1.0), ("on", 2.3 if rate == "100mbit" else 1.0),
                             ("onebit", 1.0), ("powersgd", 1.0)):
            if name not in rows:
                continue
            ratio = rows[name]["steps_per_s"] / ddp["steps_per_s"]
            print(json.dumps({"bench": "net_vs_ddp", "rate": rate, "run": name,
                              "ratio": round(ratio, 3), "target": target, "direction": "min",
                              "met": ratio >= target}), flush=True)
    # Low-rank: zerod's against DDP's PowerSGD hook at the same rank, and
    # against ZeRO++'s int4 gradient sums.
    for figure, baseline in (("net_powersgd_vs_ddp_powersgd", "ddp_powersgd"),
                             ("net_powersgd_vs_on", "on")):
        if "powersgd" not in rows or baseline not in rows:
            continue
        ratio = rows["powersgd"]["steps_per_s"] / rows[baseline]["steps_per_s"]
        print(json.dumps({"bench": figure, "rate": rate, "run": "powersgd",
                          "baseline": baseline, "powersgd_rank": args.powersgd_rank,
                          "ratio": round(ratio, 3), "target": 1.0, "direction": "min",
                          "met": ratio >= 1.0}), flush=True)
    # The low-rank run's reduce bytes against exact fp32 (off), and the
    # bound r (m + n) / (m n) over the job's units.
    if "powersgd" in rows and "off" in rows:
        low, off = rows["powersgd"], rows["off"]
        ratio = low["cross_reduce_bytes_per_step"] / max(off["cross_reduce_bytes_per_step"], 1)
        print(json.dumps({"bench": "net_lowrank_bytes", "rate": rate, "run": "powersgd",
                          "baseline": "off", "powersgd_rank": args.powersgd_rank,
                          "ratio": round(ratio, 6), "target": round(low["lowrank_bound"], 6),
                          "direction": "max", "met": ratio <= low["lowrank_bound"] * (1 + 1e-9)}),
              flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="100mbit,1gbit,10gbit,none")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-live-bytes", default="12M")
    p.add_argument("--collective-mib", type=int, default=32,
                   help="the unit of the collectives figure (0: none)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--onebit-warmup", type=int, default=5,
                   help="1-bit Adam's exact steps in the onebit run (0: no such run)")
    p.add_argument("--powersgd-rank", type=int, default=4,
                   help="the rank of the powersgd run (zerod's low-rank compression) and of "
                        "the ddp_powersgd run (DDP with torch's PowerSGD hook); 0: neither")
    p.add_argument("--powersgd-start", type=int, default=0,
                   help="the powersgd run's exact steps before it compresses")
    p.add_argument("--runs", default="off,on,onebit,powersgd",
                   help="the zerod runs, of off,on,onebit,powersgd (onebit needs "
                        "--onebit-warmup > 0, powersgd --powersgd-rank > 0)")
    p.add_argument("--no-ddp", dest="ddp", action="store_false",
                   help="leave out the torch DDP baseline")
    args = p.parse_args()
    args.runs = [r for r in args.runs.split(",") if r and
                 (r != "onebit" or args.onebit_warmup > 0) and
                 (r != "powersgd" or args.powersgd_rank > 0)]
    unknown = set(args.runs) - {"off", "on", "onebit", "powersgd"}
    if unknown:
        p.error("unknown runs: " + ", ".join(sorted(unknown)))
    why = netcluster.available()
    if why is not None:
        print(json.dumps({"bench": "net", "skipped": why}))
        return 0
    for rate in args.rates.split(","):
        one_rate(rate, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
