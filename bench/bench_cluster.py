#!/usr/bin/env python3
"""bench_cluster: a 3-node cluster on loopback against one standalone daemon.

In one run:
  - join-to-ready: from starting 3 node daemons (a coordinator already up)
    to CreateJob's job being READY (every rank's communicator built through
    the coordinator's rendezvous), and CreateJob-to-ready alone;
  - steps/s of the MLP example on 3 nodes x 1 rank against a standalone
    daemon with 3 ranks, same model and steps (the baseline).
Prints JSON lines. ZEROD_BIN_DIR names the build's bin/ directory.
"""

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
import ctlproto  # noqa: E402  (generates the control-plane modules from the .proto files)

import grpc  # noqa: E402

BIN = os.environ.get("ZEROD_BIN_DIR", os.path.join(HERE, "..", "build", "release", "bin"))
MODEL = ["--hidden", "512", "--batch", "48", "--steps", "60", "--log-every", "1000"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, predicate, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.002)
    raise SystemExit("bench_cluster: timed out waiting for %s" % what)


def start(args, log_path):
    return subprocess.Popen([os.path.join(BIN, "zerod")] + args, stderr=open(log_path, "w"))


def stop(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=60)


def train(sockets_and_ranks, job, token):
    """Runs one worker per rank; returns the wall time of the slowest."""
    procs = []
    t0 = time.monotonic()
    for sock, local_rank in sockets_and_ranks:
        procs.append(subprocess.Popen(
            [os.path.join(BIN, "zerod-mlp-train"), "--socket", sock, "--job", job,
             "--local-rank", str(local_rank), "--token", token] + MODEL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit("bench_cluster: worker failed: " + err)
    return time.monotonic() - t0


def main():
    steps = int(MODEL[MODEL.index("--steps") + 1])
    mods = ctlproto.load()
    pb, ipc, pb_grpc = mods.control, mods.ipc, mods.control_grpc
    with tempfile.TemporaryDirectory(prefix="zerod-bench-cluster-") as tmp:
        # Baseline: one standalone daemon with 3 ranks.
        sa_dir = os.path.join(tmp, "standalone")
        sa = start(["standalone", "--ranks", "3", "--dir", sa_dir, "--threads-per-rank", "1"],
                   os.path.join(tmp, "standalone.log"))
        sa_sock = os.path.join(sa_dir, "zerod.sock")
        wait_for("the standalone socket", lambda: os.path.exists(sa_sock))
        sa_s = train([(sa_sock, r) for r in range(3)], "mlp", "t")
        stop([sa])

        port = free_port()
        addr = "127.0.0.1:%d" % port
        coord = start(["coordinator", "--listen", addr, "--state-dir",
                       os.path.join(tmp, "coord"), "--lease-ttl", "5"],
                      os.path.join(tmp, "coord.log"))
        coord_log = os.path.join(tmp, "coord.log")
        wait_for("the coordinator", lambda: "coordinator listening" in open(coord_log).read())
        channel = grpc.insecure_channel(addr)
        jobs = pb_grpc.JobsStub(channel)
        cluster = pb_grpc.ClusterStub(channel)

        t0 = time.monotonic()
        nodes = []
        for name in ("a", "b", "c"):
            d = os.path.join(tmp, "node-" + name)
            nodes.append((start(["node", "--coordinator", addr, "--name", "node-" + name,
                                 "--ranks", "1", "--dir", d, "--threads-per-rank", "1"],
                                os.path.join(tmp, "node-%s.log" % name)),
                          os.path.join(d, "zerod.sock")))
        wait_for("3 members", lambda: len(cluster.GetView(pb.GetViewRequest()).members) == 3)
        joined_s = time.monotonic() - t0
        t1 = time.monotonic()
        jobs.CreateJob(pb.CreateJobRequest(
            name="mlp", nodes=3, ranks_per_node=1, token="t",
            config=ipc.JobConfig(optimizer=ipc.OptimizerConfig(kind=ipc.OPTIMIZER_ADAMW, lr=1e-3))))
        wait_for("the job to be ready", lambda: jobs.GetJob(pb.GetJobRequest(name="mlp")).state
                 == pb.JOB_STATE_READY)
        ready_s = time.monotonic()
        print(json.dumps({"bench": "cluster", "what": "join_to_ready_3_nodes",
                          "seconds": round(ready_s - t0, 3), "join_s": round(joined_s, 3),
                          "create_to_ready_s": round(ready_s - t1, 3)}))

        cl_s = train([(sock, 0) for _, sock in nodes], "mlp", "t")
        stop([p for p, _ in nodes] + [coord])
        channel.close()
    print(json.dumps({"bench": "cluster", "what": "mlp_steps_per_s_3_ranks",
                      "cluster_3x1": round(steps / cl_s, 2), "standalone_3": round(steps / sa_s, 2),
                      "ratio": round(sa_s / cl_s, 3)}))


if __name__ == "__main__":
    main()
