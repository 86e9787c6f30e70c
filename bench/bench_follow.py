#!/usr/bin/env python3
"""A subscriber on a node that does not host the job (issue 38,
docs/subscribe.md "Across nodes"), against a raw TCP transfer of the same
bytes on the same loopback.

In one run, on this machine: a `zerod coordinator`, two `zerod node`
daemons of one rank (node-a, node-b) on 127.0.0.1, a job placed on node-a
(--units units of --unit-mib MiB of fp32, AdamW: every step changes every
block, so each version moves W bytes whole), a trainer process attached to
node-a, and a subscriber process attached to node-b's daemon, which
follows the job from node-a (one FOLLOW connection; node-a's relay reads
the version into a read-only session's buffers and streams them; node-b
writes them into its copy of the job, and the subscriber gathers them
from there).

Figure, one JSON line (bench, ratio, target, direction, met, raw values):

  follow_update_vs_tcp   the time from the trainer's step returning to the
      subscriber on node-b holding every unit of that version, median over
      --updates updates (the trainer pauses between steps so each update is
      measured alone), against the time to send W bytes from one process
      to another over a loopback TCP connection and receive them into a
      buffer faulted in beforehand (median of as many, same run). Both
      clocks are CLOCK_MONOTONIC. Target <= 1.3 (max).

The update pays, besides the transfer, node-a's copy of W into its
read-only session's buffers, node-b's copy of W into the subscriber's
buffers, and the watch round trips; on 2 cores these copies are not
overlapped with the transfer. A target not met is reported as met: false.

    python bench/bench_follow.py [--units 8] [--unit-mib 8] [--updates 9]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("ZEROD_BIN_DIR", ROOT / "build" / "release" / "bin"))
TOKEN = "bench-follow"

TRAINER = r"""
import json, sys, time, zerod
socket, job, token, units, numel, steps, pause = sys.argv[1:8]
units, numel, steps, pause = int(units), int(numel), int(steps), float(pause)
with zerod.Client(socket) as c:
    j = c.attach(job, token=token)
    us = [j.register("u%d" % i, [("w", (numel,))], init="zeros") for i in range(units)]
    print(json.dumps({"version": j.version, "t": time.monotonic()}), flush=True)
    for _ in range(steps):
        time.sleep(pause)
        for u in us:
            u.grad_buffer().array()[...] = 0.001
            u.reduce()
        r = j.step()
        print(json.dumps({"version": r.version, "t": time.monotonic()}), flush=True)
"""

SUBSCRIBER = r"""
import json, sys, time, zerod
socket, job, token, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with zerod.Client(socket) as c, c.subscribe(job, token=token, timeout_s=120) as sub:
    for n, update in enumerate(sub):
        nbytes = 0
        for unit in update.units:
            g = unit.gather()
            nbytes += g.nbytes
            g.release()
        print(json.dumps({"version": update.version, "t": time.monotonic(), "bytes": nbytes}),
              flush=True)
        if n >= count:
            break
"""


def lines(text: str):
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client" / "python")] +
                                      [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    e.setdefault("ZEROD_LIBRARY", str(BIN.parent / "lib" / "libzerod.so"))
    return e


def wait(what, predicate, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise SystemExit("bench_follow: timed out waiting for " + what)


class Cluster:
    def __init__(self, tmp: Path):
        self.tmp, self.procs, self.dirs = tmp, [], []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = "127.0.0.1:%d" % self.port

    def spawn(self, name, args):
        log = open(self.tmp / (name + ".log"), "w")
        self.procs.append(subprocess.Popen([str(BIN / "zerod")] + args, stderr=log))

    def start(self):
        self.spawn("coordinator", ["coordinator", "--listen", self.address, "--state-dir",
                                   str(self.tmp / "state")])
        for name in ("node-a", "node-b"):
            replicas = tempfile.mkdtemp(prefix="zerod-bench-", dir="/dev/shm")
            self.dirs.append(replicas)
            (self.tmp / name).mkdir()
            self.spawn(name, ["node", "--ranks", "1", "--dir", str(self.tmp / name),
                              "--coordinator", self.address, "--name", name,
                              "--replica-dir", replicas, "--log-level",
                              os.environ.get("BENCH_FOLLOW_LOG", "info")])
        wait("two members", lambda: self.ctl("members").count("node-") >= 2)

    def socket(self, name):
        return str(self.tmp / name / "zerod.sock")

    def ctl(self, *args):
        p = subprocess.run([str(BIN / "zerodctl"), "-c", self.address] + list(args),
                           capture_output=True, text=True, timeout=60)
        return p.stdout if p.returncode == 0 else ""

    def stop(self):
        if os.environ.get("BENCH_FOLLOW_LOG") == "debug":  # node-b's fetch of each version
            for line in (self.tmp / "node-b.log").read_text().splitlines():
                if "follower installed" in line:
                    print(line, file=sys.stderr)
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


def follow_latencies(c: Cluster, args) -> list:
    numel = args.unit_mib * (1 << 20) // 4
    c.ctl("jobs", "create", "live", "--node", "node-a", "--token", TOKEN)
    wait("the job", lambda: "state: ready" in c.ctl("jobs", "get", "live"))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, c.socket("node-a"), "live", TOKEN,
                                str(args.units), str(numel), str(args.updates + 1), "1.5"],
                               stdout=subprocess.PIPE, text=True, env=env())
    first = json.loads(trainer.stdout.readline())
    sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, c.socket("node-b"), "live", TOKEN,
                            str(args.updates + 1)], stdout=subprocess.PIPE, text=True, env=env())
    t_out, _ = trainer.communicate(timeout=600)
    s_out, _ = sub.communicate(timeout=600)
    if trainer.returncode != 0 or sub.returncode != 0:
        raise SystemExit("bench_follow: the trainer or the subscriber failed")
    stepped = {x["version"]: x["t"] for x in [first] + lines(t_out)}
    got = {x["version"]: x for x in lines(s_out)}
    w = args.units * numel * 4
    return [got[v]["t"] - stepped[v] for v in sorted(got)
            if v in stepped and v != first["version"] and got[v]["bytes"] >= w]


def tcp_seconds(nbytes: int, reps: int) -> list:
    """A loopback TCP transfer of nbytes from a child process into a
    buffer faulted in beforehand, timed at the receiver from the sender's
    first byte request to the last byte."""
    sender = r"""
import socket, sys
port, nbytes, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
data = bytes(nbytes)
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(reps):
    s.recv(1)
    s.sendall(data)
"""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        child = subprocess.Popen([sys.executable, "-c", sender, str(listener.getsockname()[1]),
                                  str(nbytes), str(reps)])
        conn, _ = listener.accept()
        buf = bytearray(nbytes)
        view = memoryview(buf)
        out = []
        with conn:
            for _ in range(reps):
                t0 = time.monotonic()
                conn.sendall(b"g")
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:], nbytes - got)
                    if n == 0:
                        raise SystemExit("bench_follow: the TCP sender went away")
                    got += n
                out.append(time.monotonic() - t0)
        child.wait(timeout=60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--unit-mib", type=int, default=8)
    ap.add_argument("--updates", type=int, default=9)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="zerod-bench-follow-") as d:
        c = Cluster(Path(d))
        try:
            c.start()
            latencies = follow_latencies(c, args)
        finally:
            c.stop()
    w = args.units * args.unit_mib << 20
    tcp = tcp_seconds(w, max(len(latencies), 5))
    if not latencies:
        raise SystemExit("bench_follow: no whole update was measured")
    update, raw = statistics.median(latencies), statistics.median(tcp)
    ratio = update / raw
    print(json.dumps({"bench": "follow_update_vs_tcp", "ratio": round(ratio, 4), "target": 1.3,
                      "direction": "max", "met": ratio <= 1.3, "bytes": w,
                      "update_ms": round(update * 1e3, 2), "tcp_ms": round(raw * 1e3, 2),
                      "updates": len(latencies),
                      "update_gbps": round(w / update / 1e9, 2),
                      "tcp_gbps": round(w / raw / 1e9, 2)}))


if __name__ == "__main__":
    main()
