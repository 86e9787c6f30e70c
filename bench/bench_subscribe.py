#!/usr/bin/env python3
"""Subscribers of a training job's versions, on one node (issue 38).

In one run, on this machine: one `zerod standalone --ranks 1` daemon, a
trainer process (the numpy API: --units units of --unit-mib MiB of fp32,
AdamW, a constant gradient) and subscriber processes (Client.subscribe:
each update gathers every changed unit, which lands in the subscriber's
shared-memory buffers, and releases it).

Figures, one JSON line each (bench, ratio, target, direction, met, and the
raw values):

  subscribe_update_vs_memcpy   the time from the trainer's step returning
      to the subscriber holding every unit of that version (watch answered,
      every unit gathered: W bytes copied from the rank's shards into its
      buffers), median over --updates updates with the trainer pausing
      between steps so that each update is measured alone, against a numpy
      copy of W bytes between two arrays faulted in beforehand, in the
      subscriber's process (median of as many). Both clocks are
      CLOCK_MONOTONIC, one clock for every process. Target <= 1.5 (max).
  subscribe_trainer_steps     the trainer's steps/s over --steps steps with
      --subscribers subscribers reading every version (every unit
      gathered), against the same steps with none, run one after the other
      on fresh jobs. Target >= 0.95 (min). On a machine with fewer cores
      than processes this counts the subscribers' own copies (W bytes each
      per version) competing for the CPU with the trainer, which the daemon
      does not bound (it bounds their memory: one pinned copy per version a
      subscriber still reads; a waiting subscriber pins nothing).
      pin_copies_per_step: the copies of W the rank made per step into
      versions a subscriber was still reading (zerod_pin_snapshot_bytes_total).
  subscribe_trainer_steps_watch_only  the same with subscribers that follow
      every version but read nothing (zerodctl jobs watch): what following
      costs the trainer, without the subscribers' copies. Target >= 0.95.

A target not met is reported as met: false. A subscriber on another node
is bench_follow.py's.

    python bench/bench_subscribe.py [--units 8] [--unit-mib 8] [--updates 15] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("ZEROD_BIN_DIR", ROOT / "build" / "release" / "bin"))

TRAINER = r"""
import json, sys, time, numpy as np, zerod
socket, job, units, numel, steps, pause, ready = sys.argv[1:8]
units, numel, steps, pause = int(units), int(numel), int(steps), float(pause)
with zerod.Client(socket) as c:
    j = c.attach(job, create="fresh", config=zerod.JobConfig(optimizer="adamw", lr=1e-3))
    us = [j.register("u%d" % i, [("w", (numel,))], init="zeros") for i in range(units)]
    open(ready, "w").close()
    print(json.dumps({"version": j.version, "t": time.monotonic()}), flush=True)
    t0 = time.monotonic()
    for _ in range(steps):
        time.sleep(pause)
        for u in us:
            u.grad_buffer().array()[...] = 0.001
            u.reduce()
        r = j.step()
        print(json.dumps({"version": r.version, "t": time.monotonic()}), flush=True)
    print(json.dumps({"steps_per_s": steps / (time.monotonic() - t0 - steps * pause)}), flush=True)
"""

SUBSCRIBER = r"""
import json, sys, time, numpy as np, zerod
socket, job, measure_copy, ready = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
read = sys.argv[5] == "1"
copies = []
with zerod.Client(socket) as c, c.subscribe(job, timeout_s=5) as sub:
    open(ready, "w").close()
    for update in sub:
        nbytes = 0
        for unit in update.units if read else []:
            with unit.gather() as g:
                nbytes += g.nbytes
        print(json.dumps({"version": update.version, "t": time.monotonic(), "bytes": nbytes,
                          "skipped": update.skipped}), flush=True)
        if measure_copy and nbytes:
            a = np.ones(nbytes // 4, np.float32)
            b = np.zeros_like(a)
            t = time.monotonic()
            np.copyto(b, a)
            copies.append(time.monotonic() - t)
print(json.dumps({"copies": copies}), flush=True)
"""


def start_daemon(tmp: Path) -> subprocess.Popen:
    d = tmp / "zerod"
    d.mkdir()
    log = open(tmp / "zerod.log", "w")
    proc = subprocess.Popen([str(BIN / "zerod"), "standalone", "--ranks", "1", "--dir", str(d),
                             "--threads-per-rank", "1", "--metrics-listen", "127.0.0.1:0"],
                            stderr=log)
    deadline = time.monotonic() + 30
    while not (d / "zerod.sock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("bench_subscribe: zerod did not start: " + (tmp / "zerod.log").read_text())
        time.sleep(0.05)
    proc.socket = str(d / "zerod.sock")  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while True:
        m = re.search(r'msg="metrics listening" address=\S+ port=(\d+)',
                      (tmp / "zerod.log").read_text())
        if m:
            proc.metrics_port = int(m.group(1))  # type: ignore[attr-defined]
            return proc
        if time.monotonic() > deadline:
            raise SystemExit("bench_subscribe: no metrics listener")
        time.sleep(0.05)


def pin_copies(daemon, job: str) -> float:
    """zerod_pin_snapshot_bytes_total of the job's rank 0: what subscribers
    still reading made the rank copy into their pinned versions."""
    url = "http://127.0.0.1:%d/metrics" % daemon.metrics_port
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^zerod_pin_snapshot_bytes_total\{zerod_job="%s",rank="0"\} (\S+)$' % job,
                  text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_file(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit("bench_subscribe: %s never appeared" % path)
        time.sleep(0.01)


def lines(text: str):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def run(socket: str, tmp: Path, job: str, args, steps: int, pause: float, subscribers: int,
        measure_copy: bool, read: bool = True):
    env = dict(os.environ, ZEROD_QUIET="1")
    numel = args.unit_mib * (1 << 20) // 4
    ready = tmp / ("%s.ready" % job)
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, socket, job, str(args.units),
                                str(numel), str(steps), str(pause), str(ready)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_file(ready)
    subs = []
    for i in range(subscribers):
        sready = tmp / ("%s.sub%d.ready" % (job, i))
        subs.append(subprocess.Popen([sys.executable, "-c", SUBSCRIBER, socket, job,
                                      "1" if measure_copy else "0", str(sready),
                                      "1" if read else "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env))
        wait_file(sready)
    out, err = trainer.communicate(timeout=1800)
    if trainer.returncode != 0:
        raise SystemExit("bench_subscribe: trainer failed: " + err)
    sub_out = []
    for s in subs:
        o, e = s.communicate(timeout=120)
        if s.returncode != 0:
            raise SystemExit("bench_subscribe: subscriber failed: " + e)
        sub_out.append(lines(o))
    return lines(out), sub_out


def report(bench, ratio, target, direction, **raw):
    met = ratio <= target if direction == "max" else ratio >= target
    print(json.dumps(dict({"bench": bench, "ratio": round(ratio, 4), "target": target,
                           "direction": direction, "met": met}, **raw)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--units", type=int, default=8)
    p.add_argument("--unit-mib", type=int, default=8)
    p.add_argument("--updates", type=int, default=15)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--subscribers", type=int, default=4)
    args = p.parse_args()
    w = args.units * args.unit_mib << 20
    with tempfile.TemporaryDirectory(prefix="bench-subscribe-") as t:
        tmp = Path(t)
        daemon = start_daemon(tmp)
        try:
            trained, subs = run(daemon.socket, tmp, "latency", args, args.updates, 0.3, 1, True)
            done = {x["version"]: x["t"] for x in trained if "version" in x}
            got = [x for x in subs[0] if "version" in x and x["version"] in done and x["bytes"] == w]
            latency = [x["t"] - done[x["version"]] for x in got]
            copies = [x for x in subs[0] if "copies" in x][0]["copies"][-len(got):]
            lat, mem = statistics.median(latency), statistics.median(copies)
            report("subscribe_update_vs_memcpy", lat / mem, 1.5, "max", bytes=w,
                   update_ms=round(lat * 1e3, 3), memcpy_ms=round(mem * 1e3, 3),
                   updates=len(latency), gbytes_per_s=round(w / lat / 1e9, 3))

            def rate(out):
                return [x for x in out if "steps_per_s" in x][0]["steps_per_s"]

            # The trainer alone before and after the runs with subscribers
            # (the baseline is their mean: the machine drifts).
            alone = rate(run(daemon.socket, tmp, "alone", args, args.steps, 0.0, 0, False)[0])
            followed, subs = run(daemon.socket, tmp, "followed", args, args.steps, 0.0,
                                 args.subscribers, False)
            followed_copies = pin_copies(daemon, "followed")
            watched, watchers = run(daemon.socket, tmp, "watched", args, args.steps, 0.0,
                                    args.subscribers, False, read=False)
            watched_copies = pin_copies(daemon, "watched")
            again = rate(run(daemon.socket, tmp, "again", args, args.steps, 0.0, 0, False)[0])
            base = (alone + again) / 2
            with_subs = rate(followed)
            seen = [len([x for x in s if "version" in x]) for s in subs]
            report("subscribe_trainer_steps", with_subs / base, 0.95, "min", bytes=w,
                   steps=args.steps, steps_per_s_alone=round(base, 3),
                   steps_per_s_alone_runs=[round(alone, 3), round(again, 3)],
                   steps_per_s_with_subscribers=round(with_subs, 3),
                   pin_copies_per_step=round(followed_copies / w / args.steps, 3),
                   subscribers=args.subscribers, updates_seen=seen, cores=os.cpu_count())
            with_watchers = rate(watched)
            seen = [len([x for x in s if "version" in x]) for s in watchers]
            report("subscribe_trainer_steps_watch_only", with_watchers / base, 0.95, "min",
                   bytes=w, steps=args.steps, steps_per_s_alone=round(base, 3),
                   steps_per_s_with_watchers=round(with_watchers, 3),
                   pin_copies_per_step=round(watched_copies / w / args.steps, 3),
                   subscribers=args.subscribers, updates_seen=seen, cores=os.cpu_count())
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)


if __name__ == "__main__":
    main()
