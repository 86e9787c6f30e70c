"""zerod standalone runs the coordinator in-process: zerodctl and any gRPC
client reach it on DIR/control.sock.

The standalone daemon is a member of its own coordinator; jobs created by
workers' attaches are listed there, jobs created with zerodctl are built by
the daemon, and deleting a job fails its workers and removes it.
"""

import json
import os
import subprocess
import time

import grpc

import ctlproto
from conftest import binary, run_worker


def zerodctl(daemon, *args, check=True):
    proc = subprocess.run(
        [binary("zerodctl"), "--coordinator", "unix:%s/control.sock" % daemon.dir] + list(args),
        capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise AssertionError("zerodctl %s exited %d: %s%s\n%s" % (
            " ".join(args), proc.returncode, proc.stdout, proc.stderr, daemon.read_log()))
    return proc


def jobs(daemon):
    return {j["name"]: j for j in json.loads(zerodctl(daemon, "jobs", "list", "--json").stdout)["jobs"]}


def wait_for(what, predicate, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for " + what)
        time.sleep(0.05)


def train(daemon, ranks, job="mlp", steps=5, extra=()):
    """Runs `ranks` zerod-mlp-train workers to completion; returns rank 0's stdout."""
    args = [binary("zerod-mlp-train"), "--socket", daemon.socket, "--job", job, "--steps",
            str(steps), "--hidden", "64", "--batch", "8"] + list(extra)
    others = [subprocess.Popen(args + ["--local-rank", str(r)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True) for r in range(1, ranks)]
    out = run_worker(args + ["--local-rank", "0"], timeout=120)
    for p in others:
        assert p.wait(timeout=60) == 0, p.stderr.read()
    return out.stdout


def test_standalone_serves_the_control_plane(start_daemon):
    d = start_daemon(ranks=2)
    members = json.loads(zerodctl(d, "members", "--json").stdout)
    assert len(members["members"]) == 1
    assert members["members"][0]["ranks"] == 2
    assert zerodctl(d, "health").stdout.strip() == "SERVING"
    assert jobs(d) == {}

    # An external client that only has the .proto files, on the unix socket.
    pb = ctlproto.load()
    with grpc.insecure_channel("unix:%s/control.sock" % d.dir) as channel:
        health = pb.health_grpc.HealthStub(channel)
        reply = health.Check(pb.health.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == pb.health.HealthCheckResponse.SERVING


def test_jobs_created_by_workers_are_listed(start_daemon):
    d = start_daemon(ranks=2)
    out = train(d, 2, steps=6)
    assert "done: 6 steps" in out
    listed = jobs(d)
    assert set(listed) == {"mlp"}
    job = listed["mlp"]
    assert job["state"] == "ready", job
    assert job["world_size"] == 2
    # The step comes with the daemon's heartbeats (every lease TTL / 3).
    wait_for("the step to be reported", lambda: jobs(d)["mlp"]["step"] == 6, timeout_s=15)


def test_job_created_with_zerodctl_is_built_and_trains(start_daemon, monkeypatch):
    monkeypatch.delenv("ZEROD_TOKEN", raising=False)
    d = start_daemon(ranks=2)
    created = json.loads(zerodctl(d, "jobs", "create", "ctl", "--ranks-per-node", "2",
                                  "--token", "s3cret", "--json").stdout)
    assert created["token"] == "s3cret"
    wait_for("the job to be ready", lambda: jobs(d)["ctl"]["state"] == "ready")
    out = train(d, 2, job="ctl", steps=3, extra=["--no-create", "--token", "s3cret"])
    assert "done: 3 steps" in out
    # The wrong token is refused by the daemon that built the job; no token
    # at all is refused as missing, saying how to give one.
    worker = [binary("zerod-mlp-train"), "--socket", d.socket, "--job", "ctl", "--no-create",
              "--steps", "1", "--hidden", "64", "--batch", "8"]
    bad = run_worker(worker + ["--token", "wrong"], check=False)
    assert bad.returncode != 0
    assert "token does not match job 'ctl'" in bad.stderr, bad.stderr
    none = run_worker(worker, check=False)
    assert none.returncode != 0
    assert "requires a token" in none.stderr and "ZEROD_TOKEN" in none.stderr, none.stderr
    # The worker passes no token: libzerod sends $ZEROD_TOKEN.
    monkeypatch.setenv("ZEROD_TOKEN", "s3cret")
    assert "done: 2 steps" in train(d, 2, job="ctl", steps=2, extra=["--no-create"])


def test_deleted_job_goes_and_its_name_can_be_reused(start_daemon):
    d = start_daemon(ranks=1)
    train(d, 1, job="gone", steps=2)
    first_id = jobs(d)["gone"]["id"]
    assert "deleted job gone" in zerodctl(d, "jobs", "delete", "gone").stdout
    # Nobody is attached: the daemon drops it at once and reports so.
    wait_for("the deletion to complete", lambda: "gone" not in jobs(d), timeout_s=10)
    assert 'msg="job removed" job=gone' in d.read_log()
    # A new attach makes a new job, not the deleted one back.
    train(d, 1, job="gone", steps=2)
    assert jobs(d)["gone"]["id"] != first_id


def thread_names(pid):
    names = []
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            pass  # exited meanwhile
    return names


def job_threads(pid):
    """The threads that belong to jobs: executors, their kernel pools and
    the threads they start (named by the daemon; the rest are the daemon's
    own, gRPC's and libuv's threadpool, which start lazily and stay)."""
    return [n for n in thread_names(pid) if n in ("zd-exec", "zd-kernel")]


def resident_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmRSS:")))


def test_deleted_job_is_freed_at_once_not_at_exit(start_daemon):
    # A deleted job's executors and kernel threads are joined and its
    # memory returned as soon as nobody uses it: a long-running daemon
    # where jobs come and go must not keep every job it ever had.
    d = start_daemon(ranks=2, extra=["--threads-per-rank", "2"])
    pid = d.proc.pid
    assert job_threads(pid) == []
    rss_before = resident_kib(pid)
    train(d, 2, job="big", steps=2, extra=["--hidden", "1024"])
    # Two executors, each with one kernel pool worker besides itself (and
    # Gloo's threads, which take their creator's name, zd-exec).
    names = job_threads(pid)
    assert names.count("zd-exec") >= 2 and names.count("zd-kernel") == 2, thread_names(pid)
    rss_with_job = resident_kib(pid)
    zerodctl(d, "jobs", "delete", "big")
    wait_for("the job to be freed", lambda: 'msg="job freed" job=big' in d.read_log(), timeout_s=10)
    assert job_threads(pid) == [], thread_names(pid)
    # Its shards (two ranks of a 1024-wide MLP: master weights, Adam
    # moments, accumulators, buffers: about 60 MB) were given back: at least
    # half of what the job added (the allocator and gRPC keep some).
    rss_after = resident_kib(pid)
    assert rss_after < rss_before + (rss_with_job - rss_before) // 2, \
        (rss_before, rss_with_job, rss_after)
    # The daemon goes on serving: the name makes a new job that trains.
    train(d, 2, job="big", steps=2)


def test_state_dir_too_deep_for_the_control_socket_says_the_limit(tmp_path):
    # DIR/control.sock is 120 bytes, over a Unix socket path's 107; the
    # workers' socket is elsewhere and short. The daemon refuses to start
    # and names the limit, before it tries to listen.
    socket_path = str(tmp_path / "w.sock")
    depth = 120 - len(str(tmp_path)) - len("/control.sock") - 1
    assert depth > 0, "tmp_path is too long for this test: %s" % tmp_path
    state = tmp_path / ("d" * depth)
    control = str(state / "control.sock")
    assert len(control) == 120
    proc = subprocess.run([binary("zerod"), "standalone", "--dir", str(state), "--socket",
                           socket_path], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert ("socket path '%s' is longer than 107 bytes" % control) in proc.stderr, proc.stderr
    assert "in use" not in proc.stderr
    assert not os.path.exists(socket_path)
