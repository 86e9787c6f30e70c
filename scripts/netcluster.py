#!/usr/bin/env python3
"""An emulated network for a zerod cluster on one machine (issue 39,
docs/benchmarks.md "Emulated networks").

Each node gets a network namespace of its own, linked to a switch (a
bridge in one more namespace) by a veth pair; both ends of each pair are
shaped with a token bucket (`tc qdisc ... tbf rate R`), so a node's link
carries at most R each way. Node i has 198.18.0.(i+1)/24 on eth0 (the
benchmarking range, RFC 2544; nothing is routed out of the namespaces, so
no traffic leaves the machine). Processes run in a node's namespace with
`ip netns exec`; their Unix sockets and files are the machine's, as on
one host.

Everything is made under one tag (zd<pid>, or given) and removed by
close(), which also runs at exit and on failure; namespaces a run of the
same tag left behind are removed first. Needs root (CI runs as root) and
a kernel with veth, bridge and tbf; `available()` says why not.

    with NetCluster(nodes=2, rate="1gbit") as net:
        p = net.popen(0, ["zerod", "coordinator", "--listen", net.address(0) + ":7070"])
        print(net.tcp_seconds(0, 1, 64 << 20))   # the link's raw TCP transfer

    python3 scripts/netcluster.py check             # can namespaces be made here?
    python3 scripts/netcluster.py tcp --rate 100mbit --mib 16
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import signal
import subprocess
import sys
import time
from typing import List, Optional, Sequence

SUBNET = "198.18.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip"] + list(args), capture_output=True, text=True, check=check)


def available() -> Optional[str]:
    """None when namespaces, veth pairs, a bridge and tbf can be made here;
    else why not (for a test's skip message)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    probe = NetCluster(nodes=1, rate="1gbit", tag="zdprobe%d" % os.getpid())
    try:
        probe.open()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        return "cannot make network namespaces here: %s" % detail.strip()
    finally:
        probe.close()
    return None


def _rate_bits(rate: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if m is None:
        raise ValueError("rate %r: expected e.g. 100mbit, 1gbit, 10gbit" % rate)
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


class NetCluster:
    """`nodes` namespaces on a switch, each link shaped to `rate` each way
    (None: unlimited veth)."""

    def __init__(self, nodes: int = 2, rate: Optional[str] = None, tag: Optional[str] = None):
        if not 1 <= nodes <= 16:
            raise ValueError("1 to 16 nodes")
        self.nodes = nodes
        self.rate = rate
        self.tag = tag or "zd%d" % os.getpid()
        self.procs: List[subprocess.Popen] = []
        self._open = False

    # Names ---------------------------------------------------------------
    def ns(self, i: int) -> str:
        return "%sn%d" % (self.tag, i)

    @property
    def switch(self) -> str:
        return "%ss" % self.tag

    def address(self, i: int) -> str:
        return "%s.%d" % (SUBNET, i + 1)

    # Making and removing -------------------------------------------------
    def _shape(self, ns: str, dev: str) -> None:
        if self.rate is None:
            return
        bits = _rate_bits(self.rate)
        # A bucket of 5 ms at the rate (at least 64 KiB): enough for the
        # kernel's timer granularity at 10 Gbit/s, small enough to shape.
        burst = max(64 << 10, bits // 8 // 200)
        _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
            self.rate, "burst", str(burst), "latency", "100ms")

    def open(self) -> "NetCluster":
        self._sweep()
        self._open = True
        atexit.register(self.close)
        _ip("netns", "add", self.switch)
        _ip("netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge")
        _ip("netns", "exec", self.switch, "ip", "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, outer = self.ns(i), "%sv%d" % (self.tag, i)
            _ip("netns", "add", ns)
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", outer, "netns", self.switch)
            _ip("netns", "exec", self.switch, "ip", "link", "set", outer, "master", "br0")
            _ip("netns", "exec", self.switch, "ip", "link", "set", outer, "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", self.address(i) + "/24", "dev", "eth0")
            _ip("netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            self._shape(ns, "eth0")            # the node's sends
            self._shape(self.switch, outer)    # what the node receives
        return self

    def _sweep(self) -> None:
        listed = _ip("netns", "list", check=False).stdout
        for line in listed.splitlines():
            name = line.split()[0] if line.split() else ""
            if re.fullmatch(re.escape(self.tag) + r"(s|n\d+)", name):
                _ip("netns", "del", name, check=False)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        if self._open:
            self._sweep()
            self._open = False

    def __enter__(self) -> "NetCluster":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # Running -------------------------------------------------------------
    def argv(self, i: int, argv: Sequence[str]) -> List[str]:
        return ["ip", "netns", "exec", self.ns(i)] + list(argv)

    def popen(self, i: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Starts argv in node i's namespace; close() stops it."""
        p = subprocess.Popen(self.argv(i, argv), **kw)
        self.procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(i, argv), **kw)

    def tcp_seconds(self, src: int, dst: int, nbytes: int, reps: int = 3) -> List[float]:
        """A raw TCP transfer of nbytes from node src to node dst over the
        link, timed at the receiver (first request byte to last byte
        received into a buffer faulted in beforehand): the physical limit
        the cluster's own transfers are measured against."""
        receiver = r"""
import socket, sys, time
host, nbytes, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
l = socket.socket(); l.bind((host, 0)); l.listen(1)
print(l.getsockname()[1], flush=True)
c, _ = l.accept()
buf = bytearray(nbytes); view = memoryview(buf)
for _ in range(reps):
    t0 = time.monotonic(); c.sendall(b"g"); got = 0
    while got < nbytes:
        n = c.recv_into(view[got:], nbytes - got)
        if n == 0: raise SystemExit("sender gone")
        got += n
    print(time.monotonic() - t0, flush=True)
"""
        sender = r"""
import socket, sys
host, port, nbytes, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = bytes(nbytes); s = socket.create_connection((host, port))
for _ in range(reps):
    s.recv(1); s.sendall(data)
"""
        r = subprocess.Popen(self.argv(dst, [sys.executable, "-c", receiver, self.address(dst),
                                             str(nbytes), str(reps)]),
                             stdout=subprocess.PIPE, text=True)
        port = r.stdout.readline().strip()
        s = subprocess.Popen(self.argv(src, [sys.executable, "-c", sender, self.address(dst), port,
                                             str(nbytes), str(reps)]))
        out, _ = r.communicate(timeout=600)
        s.wait(timeout=60)
        if r.returncode != 0 or s.returncode != 0:
            raise RuntimeError("netcluster: the TCP transfer failed")
        return [float(x) for x in out.split()]

    def tcp_both_seconds(self, a: int, b: int, nbytes: int, reps: int = 3) -> List[float]:
        """nbytes each way at once between nodes a and b, as a collective
        between two nodes moves them (each direction's ACKs then queue
        behind the other's data in the shaped links): per repetition, the
        slower of the two transfers."""
        import threading

        out: List[List[float]] = [[], []]

        def one(k: int, src: int, dst: int) -> None:
            out[k] = self.tcp_seconds(src, dst, nbytes, reps)

        threads = [threading.Thread(target=one, args=(0, a, b)),
                   threading.Thread(target=one, args=(1, b, a))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [max(x, y) for x, y in zip(out[0], out[1])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["check", "tcp"])
    ap.add_argument("--rate", default=None, help="e.g. 100mbit, 1gbit (default: unlimited)")
    ap.add_argument("--mib", type=int, default=16)
    args = ap.parse_args()
    why = available()
    if args.what == "check":
        print(why or "network namespaces: available")
        return 0 if why is None else 1
    if why is not None:
        print(why, file=sys.stderr)
        return 1
    with NetCluster(nodes=2, rate=args.rate) as net:
        secs = net.tcp_seconds(0, 1, args.mib << 20)
        best = min(secs)
        print("%s: %d MiB in %.3f s (%.2f Gbit/s)" % (args.rate or "unlimited", args.mib, best,
                                                   (args.mib << 20) * 8 / best / 1e9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
