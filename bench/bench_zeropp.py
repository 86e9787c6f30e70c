#!/usr/bin/env python3
"""bench_zeropp: ZeRO++ on a 2-node loopback cluster, on against off.

A coordinator and two `zerod node` daemons with 2 ranks each, on this
machine; the example LM (examples/python/train_lm.py, 4 worker processes,
global rank = node * 2 + local rank) trains for --steps steps with the same
seed, batches and max_live_bytes, once per setting:

  off   hierarchical collectives, fp32 on every hop;
  on    qwZ (int8 weights, blocks of 256), qgZ (int4 gradient sums between
        nodes) and hpZ (secondary partitions over each node's 2 ranks).

Per run: steps/s (the slowest rank's training time), what node a's ranks
sent between nodes (Job.stats, level "cross", by collective) and node-level
bytes, and rank 0's final training and validation losses. Prints one JSON
line per run, then one with the ratios on/off. Loopback on one machine
moves bytes at memory speed, so the time ratio shows what quantizing
costs here, not what a network would gain; the byte ratios are what a
network would carry. No pass or fail on timings; the loss check (within
2% of off) is reported as a field.

    /usr/bin/python3 bench/bench_zeropp.py [--steps 300] [--max-live-bytes 12M]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "integration"))
import ctlproto  # noqa: E402  (the control-plane modules, generated from the .proto files)
from bench_cluster import free_port  # noqa: E402

import grpc  # noqa: E402

BIN = Path(os.environ.get("ZEROD_BIN_DIR", REPO_ROOT / "build" / "release" / "bin"))
TRAIN_LM = REPO_ROOT / "examples" / "python" / "train_lm.py"
TOKEN = "bench-zeropp"
NODES, RANKS = ("a", "b"), 2


def log(message: str) -> None:
    print(f"bench_zeropp: {message}", file=sys.stderr, flush=True)


def wait_for(what: str, predicate, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"bench_zeropp: timed out waiting for {what}")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    return int(text)


class ZeroCluster:
    """The coordinator and the node daemons, and the jobs made on them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs = []
        mods = ctlproto.load()
        self.pb, self.ipc = mods.control, mods.ipc
        self.address = "127.0.0.1:%d" % free_port()
        self.start("coordinator", ["coordinator", "--listen", self.address, "--state-dir",
                                   str(tmp / "coord"), "--lease-ttl", "5"])
        self.channel = grpc.insecure_channel(self.address)
        self.jobs = mods.control_grpc.JobsStub(self.channel)
        cluster = mods.control_grpc.ClusterStub(self.channel)
        self.sockets = []
        for name in NODES:
            d = tmp / ("node-" + name)
            self.start("node-" + name, ["node", "--coordinator", self.address, "--name",
                                        "node-" + name, "--ranks", str(RANKS), "--dir", str(d),
                                        "--threads-per-rank", "1"])
            self.sockets.append(d / "zerod.sock")
        wait_for("2 members", lambda: len(cluster.GetView(self.pb.GetViewRequest()).members)
                 == len(NODES))

    def start(self, name: str, args) -> None:
        log_file = open(self.tmp / (name + ".log"), "w")
        self.procs.append(subprocess.Popen([str(BIN / "zerod")] + args, stderr=log_file,
                                           stdout=log_file))

    def create_job(self, name: str, args, **zeropp) -> None:
        ipc = self.ipc
        # The hyper-parameters train_lm.py asks for, so that its attach agrees.
        config = ipc.JobConfig(
            optimizer=ipc.OptimizerConfig(kind=ipc.OPTIMIZER_ADAMW, lr=args.lr, beta1=0.9,
                                          beta2=0.95, eps=1e-8, weight_decay=0.1,
                                          has_weight_decay=True),
            max_grad_norm=1.0, max_live_bytes=args.max_live_bytes, **zeropp)
        self.jobs.CreateJob(self.pb.CreateJobRequest(
            name=name, config=config, nodes=len(NODES), ranks_per_node=RANKS, token=TOKEN),
            timeout=30)
        wait_for(f"job {name} to be ready",
                 lambda: self.jobs.GetJob(self.pb.GetJobRequest(name=name), timeout=10).state
                 == self.pb.JOB_STATE_READY)

    def train(self, name: str, args) -> dict:
        """Runs the LM's 4 workers on the job; returns their results by rank."""
        results = self.tmp / (name + ".json")
        procs = []
        for sock in self.sockets:
            for r in range(RANKS):
                out = open(self.tmp / f"{name}-{sock.parent.name}-{r}.out", "w")
                procs.append(subprocess.Popen(
                    [sys.executable, str(TRAIN_LM), "--worker", "--local-rank", str(r),
                     "--socket", str(sock), "--job", name, "--token", TOKEN,
                     "--steps", str(args.steps), "--lr", str(args.lr), "--eval-every", "0",
                     "--sample-bytes", "0", "--log-every", str(max(args.steps // 5, 1)),
                     "--threads", "1", "--result-json", str(results)],
                    stdout=out, stderr=subprocess.STDOUT))
        for p in procs:
            if p.wait(timeout=3600) != 0:
                outs = sorted(self.tmp.glob(f"{name}-*.out"))
                raise SystemExit("bench_zeropp: a worker failed:\n" +
                                 "\n".join(o.read_text()[-2000:] for o in outs))
        by_rank = {}
        for r in range(len(NODES) * RANKS):
            by_rank[r] = json.loads(Path(f"{results}.rank{r}").read_text())
        return by_rank

    def close(self) -> None:
        self.channel.close()
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            p.wait(timeout=60)


def summarize(name: str, by_rank: dict) -> dict:
    slowest = max(r["train_s"] for r in by_rank.values())
    steps = by_rank[0]["steps"]
    node_a = [by_rank[r]["collective_bytes"] for r in range(RANKS)]

    def total(key: str) -> int:
        return sum(b.get(key, 0) for b in node_a)

    return {"bench": "zeropp", "run": name, "steps": steps,
            "steps_per_s": round(steps / slowest, 3),
            "cross_all_gather_bytes": total("cross/all_gather"),
            "cross_reduce_scatter_bytes": total("cross/reduce_scatter"),
            "node_all_gather_bytes": total("node/all_gather"),
            "final_loss": round(by_rank[0]["final_loss"], 4),
            "val_loss": round(by_rank[0]["val_loss"], 4) if by_rank[0]["val_loss"] else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-live-bytes", type=parse_size, default=parse_size("12M"),
                   help="per rank, both runs: below the model's gathered size, so that the "
                   "backward pass gathers again (hpZ's case)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="zerod-bench-zeropp-") as tmp_name:
        cluster = ZeroCluster(Path(tmp_name))
        try:
            runs = {}
            for name, zeropp in (("off", {}),
                                 ("on", {"quantized_weights": True, "quantized_gradients": 4,
                                         "hpz_partition_size": RANKS})):
                log(f"{name}: {args.steps} steps of the LM on {len(NODES)} nodes x {RANKS} ranks")
                cluster.create_job(name, args, **zeropp)
                runs[name] = summarize(name, cluster.train(name, args))
                print(json.dumps(runs[name]), flush=True)
        finally:
            cluster.close()
    off, on = runs["off"], runs["on"]

    def ratio(key: str):
        return round(on[key] / off[key], 3) if off[key] else None

    loss_key = "val_loss" if off["val_loss"] and on["val_loss"] else "final_loss"
    loss_change = (on[loss_key] - off[loss_key]) / off[loss_key]
    print(json.dumps({"bench": "zeropp", "what": "on_over_off",
                      "steps_per_s": ratio("steps_per_s"),
                      "cross_all_gather_bytes": ratio("cross_all_gather_bytes"),
                      "cross_reduce_scatter_bytes": ratio("cross_reduce_scatter_bytes"),
                      "loss": loss_key, "loss_change": round(loss_change, 4),
                      "loss_within_2_percent": abs(loss_change) <= 0.02}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
