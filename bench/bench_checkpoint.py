#!/usr/bin/env python3
"""bench_checkpoint: checkpoints through the service, each against raw I/O of
the same bytes on the same filesystem, measured in the same run.

A standalone daemon with 2 ranks; 2 zerod-mlp-train workers train the
example MLP (default hidden 2048, 8 layers: 25.7M parameters, 309 MB of
fp32 master weights and AdamW moments over the two ranks). Each round:

  - while the workers train: Checkpoints.Save; a raw sequential write of
    the same number of bytes (the shard files together) into the same
    checkpoint directory, 8 MiB pwrites and an fsync; and the same bytes as
    two files written at once on two threads (the shape of the save's I/O:
    one writer per rank). One after the other, in an order that rotates
    from round to round;
  - once the workers have finished their steps and detached: the same
    three with the job idle (its copy is taken at once);
  - Checkpoints.Restore of the first checkpoint (Restore requires the
    workers detached) and raw reads of the same bytes (one file, two files
    at once), each with the files' pages dropped from the page cache first
    (posix_fadvise DONTNEED), the order rotating too.

Figures (medians over the rounds; one untimed warm-up round first):
  save MB/s = checkpoint bytes / SaveReply.total_ms against the raw writes
  (target >= 0.8); SaveReply.stall_ms (the longest time a rank held its
  steps to copy its state out) against total_ms; restore MB/s = bytes /
  RestoreReply.total_ms against the raw reads (target >= 0.8); where a
  save's and a restore's time went, from the daemon's log (debug level:
  waiting for the step to end, the copy, the shard writes, the commit; the
  reads, the install), the save from the copy on (bytes / (copy + writes +
  commit), the save's own work without the wait for the step's end), how
  many ranks' copies went into memory their writer faulted in beforehand
  and how much of it was faulted in when they took it; and rank 0's step
  times from its output: steps with
  nothing running beside them, steps overlapping a save, steps overlapping
  a raw write, and the training time a save cost (its steps' time beyond
  that of quiet steps).

Prints JSON lines. ZEROD_BIN_DIR names the build's bin/ directory; the
files go in a new directory under --dir (default $ZEROD_BENCH_CKPT_DIR, else
the build directory above bin/, which is on a disk where /tmp may be a
tmpfs); it is removed at the end (--keep keeps it, with the daemon's log).
The daemon's state directory, which holds its sockets, is a short one of
its own under $TMPDIR or /tmp: a Unix socket's path is at most 107 bytes,
which a checkout in a deep directory would exceed.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
import ctlproto  # noqa: E402  (generates the control-plane modules from the .proto files)

import grpc  # noqa: E402

BIN = os.environ.get("ZEROD_BIN_DIR", os.path.join(HERE, "..", "build", "release", "bin"))
CHUNK = 8 << 20
JOB = "ckpt"


def fail(msg):
    raise SystemExit("bench_checkpoint: " + msg)


def fs_type(path):
    out = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def mount_source(path):
    """The mount holding path (longest mount point prefix): device and fs."""
    best = ("", "?", "?")
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mnt = fields[4]
            rest = line.split(" - ", 1)[1].split()
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, rest[1], rest[0])
    return best[1], best[2]


def drop_cache(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(paths, sizes, data):
    """Writes each file (a new one, 8 MiB pwrites, fsync) on its own thread;
    returns the wall time of all of them."""
    def one(path, size):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        at = 0
        while at < size:
            at += os.pwrite(fd, data[at:min(size, at + CHUNK)], at)
        os.fsync(fd)
        os.close(fd)

    threads = [threading.Thread(target=one, args=(p, s)) for p, s in zip(paths, sizes)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


def raw_read(paths, sizes, buf):
    """Reads each file (8 MiB preads into a pre-faulted buffer) on its own
    thread, cold; returns the wall time."""
    drop_cache(paths)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def one(path, size, base):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        at = 0
        while at < size:
            n = os.preadv(fd, [buf[base + at:base + min(size, at + CHUNK)]], at)
            if n <= 0:
                fail("short read of " + path)
            at += n
        os.close(fd)

    threads = [threading.Thread(target=one, args=(p, s, o))
               for p, s, o in zip(paths, sizes, offsets)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


def remove(paths):
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)
    os.sync()


class Steps:
    """Rank 0's step lines, each with the time it was read."""

    LINE = re.compile(r"^step (\d+)/(\d+) .* step_ms ([0-9.]+)")

    def __init__(self, proc):
        self.steps = []  # (end time, step, step_ms)
        self.thread = threading.Thread(target=self.run, args=(proc,), daemon=True)
        self.thread.start()

    def run(self, proc):
        for line in proc.stdout:
            m = self.LINE.match(line)
            if m:
                self.steps.append((time.monotonic(), int(m.group(1)), float(m.group(3))))

    def count(self):
        return len(self.steps)


def start_workers(args, sock):
    common = [os.path.join(BIN, "zerod-mlp-train"), "--socket", sock, "--job", JOB,
              "--hidden", str(args.hidden), "--layers", str(args.layers), "--batch",
              str(args.batch), "--steps", str(args.steps), "--log-every", "1"]
    procs = []
    for rank in range(2):
        procs.append(subprocess.Popen(common + ["--local-rank", str(rank)],
                                      stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    return procs, Steps(procs[0])


def wait_workers(procs, steps):
    for p in procs:
        p.wait(timeout=1800)  # rank 0's stdout is read by `steps`
        err = p.stderr.read()
        p.stderr.close()
        if p.returncode != 0:
            fail("worker exited %d: %s" % (p.returncode, err))
    steps.thread.join(timeout=10)


def wait_for(what, predicate, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            fail("timed out waiting for " + what)
        time.sleep(0.01)


LOG_LINE = re.compile(r'^ts=(\S+) level=\S+ msg=("[^"]*"|\S+)(.*)$')


def log_events(path, since):
    """(wall time, msg, {key: value}) of the daemon's log lines at or after
    `since` (time.time()), at millisecond resolution."""
    out = []
    with open(path) as f:
        for line in f:
            m = LOG_LINE.match(line)
            if not m:
                continue
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                tzinfo=datetime.timezone.utc).timestamp()
            if t < since - 0.002:
                continue
            fields = dict(kv.split("=", 1) for kv in m.group(3).split() if "=" in kv)
            out.append((t, m.group(2).strip('"'), fields))
    return out


def save_breakdown(events, t_req):
    """Where a save's time went, from the daemon's log (debug level): the
    wait for the end of the step, the copy (stall), the shard writes, and
    the commit (manifest, fsyncs, rename)."""
    copies = [(t, f) for t, msg, f in events if msg == "shard copied for a save"][:2]
    copied = [(t, float(f["ms"])) for t, f in copies]
    saved = [t for t, msg, f in events if msg == "shard saved"]
    done = [t for t, msg, f in events if msg == "checkpoint saved"]
    if len(copied) < 2 or len(saved) < 2 or not done:
        return None
    copied, saved = copied[:2], saved[:2]
    copy_start = min(t - ms / 1e3 for t, ms in copied)
    copy_end = max(t for t, _ in copied)
    return {"wait_ms": (copy_start - t_req) * 1e3, "copy_ms": (copy_end - copy_start) * 1e3,
            "write_ms": (max(saved) - copy_end) * 1e3, "commit_ms": (done[0] - max(saved)) * 1e3,
            # copies into memory the rank's writer faulted in beforehand
            "staged": sum(f.get("staged") == "1" for _, f in copies),
            # of that memory, the part faulted in before the rank took it
            "faulted": [int(f["faulted"]) / max(1, int(f["bytes"])) for t, msg, f in events
                        if msg == "memory for a save's copy faulted in"][:2]}


def restore_breakdown(events):
    t = {msg: t for t, msg, f in reversed(events)}
    keys = ("checkpoint restore started", "checkpoint restore read; committing",
            "checkpoint restored")
    if not all(k in t for k in keys):
        return None
    return {"read_ms": (t[keys[1]] - t[keys[0]]) * 1e3,
            "install_ms": (t[keys[2]] - t[keys[1]]) * 1e3}


def rounded(parts):
    """A breakdown for printing: times to the millisecond, fractions to 2 places."""
    return {k: [round(x, 2) for x in v] if isinstance(v, list) else round(v)
            for k, v in (parts or {}).items()}


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def r1(x):
    """Rounded for printing; None (JSON null) for no value."""
    return None if x != x else round(x, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50, help="steps per round per worker")
    ap.add_argument("--dir", default=os.environ.get("ZEROD_BENCH_CKPT_DIR",
                                                    os.path.join(BIN, "..")))
    ap.add_argument("--verbose", action="store_true", help="per-round figures on stderr")
    ap.add_argument("--keep", action="store_true", help="keep the directory (the daemon's log)")
    args = ap.parse_args()

    mods = ctlproto.load()
    pb = mods.control
    tmp = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=os.path.abspath(args.dir))
    device, fs = mount_source(tmp)
    fs = fs_type(tmp) if fs == "?" else fs
    if fs == "tmpfs":
        print("bench_checkpoint: WARNING: %s is a tmpfs: nothing reaches a disk; pass --dir"
              % tmp, file=sys.stderr)
    state = tempfile.mkdtemp(prefix="zerod-bench-")  # sockets: a short path (see above)
    ckpt_dir = os.path.join(tmp, "checkpoints")
    log_path = os.path.join(tmp, "zerod.log")
    daemon = subprocess.Popen(
        [os.path.join(BIN, "zerod"), "standalone", "--ranks", "2", "--dir", state,
         "--threads-per-rank", "1", "--checkpoint-dir", ckpt_dir, "--log-level", "debug"],
        stderr=open(log_path, "w"))
    sock = os.path.join(state, "zerod.sock")
    try:
        wait_for("the daemon's socket", lambda: os.path.exists(sock) or daemon.poll() is not None)
        if daemon.poll() is not None:
            fail("zerod exited:\n" + open(log_path).read())
        channel = grpc.insecure_channel("unix:%s/control.sock" % state)
        ck = mods.control_grpc.CheckpointsStub(channel)
        jobs = mods.control_grpc.JobsStub(channel)
        run(args, pb, ck, jobs, sock, tmp, ckpt_dir, fs, device, log_path)
        channel.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(state, ignore_errors=True)
        if args.keep:
            print("bench_checkpoint: kept " + tmp, file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def run(args, pb, ck, jobs, sock, tmp, ckpt_dir, fs, device, log_path):
    raw_one = [os.path.join(ckpt_dir, "raw.bin")]
    raw_two = [os.path.join(ckpt_dir, "raw-0.bin"), os.path.join(ckpt_dir, "raw-1.bin")]
    data = None
    rbuf = None
    rows = []
    for rnd in range(-1, args.rounds):  # -1: warm-up, not reported
        procs, steps = start_workers(args, sock)
        wait_for("the first steps", lambda: steps.count() >= 4 or any(
            p.poll() is not None for p in procs))
        if steps.count() < 4:
            wait_workers(procs, steps)
            fail("the workers stopped before their 4th step")
        row = {"round": rnd}

        def do_save():
            os.sync()
            row["save_wall"] = time.time()
            t0 = time.monotonic()
            reply = ck.Save(pb.SaveRequest(job=JOB, name="r%d" % (rnd + 1)), timeout=600)
            row["save_window"] = (t0, time.monotonic())
            row["save_alive"] = all(p.poll() is None for p in procs)
            row["reply"] = reply

        row["raw_windows"] = []

        def do_raw_write():
            os.sync()
            t0 = time.monotonic()
            row["raw_write_s"] = raw_write(raw_one, [total], data)
            row["raw_windows"].append((t0, time.monotonic()))
            remove(raw_one)

        def do_raw_write2():
            os.sync()
            t0 = time.monotonic()
            row["raw_write2_s"] = raw_write(raw_two, half, data)
            row["raw_windows"].append((t0, time.monotonic()))
            remove(raw_two)

        if data is None:
            do_save()  # the warm-up round learns the size here
            total = row["reply"].checkpoint.bytes
            half = [total // 2, total - total // 2]
            data = memoryview(os.urandom(total))
            rbuf = bytearray(data)  # pre-faulted: the raw reads' destination
            rbuf_view = memoryview(rbuf)
            ops = [do_raw_write, do_raw_write2]
        else:
            ops = [do_save, do_raw_write, do_raw_write2]
            ops = ops[rnd % 3:] + ops[:rnd % 3]
        for op in ops:
            time.sleep(0.5)  # a few steps apart
            op()
        if not all(p.poll() is None for p in procs):
            print("bench_checkpoint: round %d: the workers finished before the writes did; "
                  "raise --steps" % rnd, file=sys.stderr)
        wait_workers(procs, steps)
        reply = row["reply"]
        row_total = reply.checkpoint.bytes
        if row_total != total:
            fail("checkpoint size changed: %d, was %d" % (row_total, total))

        # The same with the job idle (workers detached: the copy is taken
        # at once, and nothing else wants the CPUs).
        def do_save_idle():
            os.sync()
            row["idle_wall"] = time.time()
            row["idle_reply"] = ck.Save(pb.SaveRequest(job=JOB, name="i%d" % (rnd + 1)),
                                        timeout=600)

        def do_raw_write_idle():
            os.sync()
            row["idle_raw_write_s"] = raw_write(raw_one, [total], data)
            remove(raw_one)

        def do_raw_write2_idle():
            os.sync()
            row["idle_raw_write2_s"] = raw_write(raw_two, half, data)
            remove(raw_two)

        ops = [do_save_idle, do_raw_write_idle, do_raw_write2_idle]
        for op in ops[rnd % 3:] + ops[:rnd % 3]:
            op()

        # Restore, cold, against raw reads of the same bytes, cold.
        raw_write(raw_one, [total], data)  # the files the raw reads read
        raw_write(raw_two, half, data)
        shards = [os.path.join(reply.checkpoint.path, f)
                  for f in sorted(os.listdir(reply.checkpoint.path)) if f.endswith(".zdshard")]

        def do_restore():
            os.sync()
            drop_cache(shards)
            row["restore_wall"] = time.time()
            t0 = time.monotonic()
            r = ck.Restore(pb.RestoreRequest(job=JOB, checkpoint=reply.checkpoint.name),
                           timeout=600)
            row["restore_s"] = time.monotonic() - t0
            row["restore_reply"] = r

        def do_raw_read():
            os.sync()
            row["raw_read_s"] = raw_read(raw_one, [total], rbuf_view)

        def do_raw_read2():
            os.sync()
            row["raw_read2_s"] = raw_read(raw_two, half, rbuf_view)

        ops = [do_restore, do_raw_read, do_raw_read2]
        for op in ops[rnd % 3:] + ops[:rnd % 3]:
            op()
        if bytes(rbuf_view[:total // 2]) != bytes(data[:total // 2]):
            fail("raw read back different bytes")
        remove(raw_one + raw_two)
        for name in (reply.checkpoint.name, row["idle_reply"].checkpoint.name):
            ck.Delete(pb.DeleteCheckpointRequest(job=JOB, name=name), timeout=60)
        wait_for("the checkpoint's removal", lambda: not [
            d for d in os.listdir(os.path.join(ckpt_dir, JOB)) if d[0] in "ri"])
        os.sync()

        # Rank 0's steps: those overlapping the save, the raw write, or
        # neither (the first 3 of the round, and attach, left out).
        s0, s1 = row["save_window"]
        row["steps_save"], row["steps_raw"], row["steps_quiet"] = [], [], []
        for end, step, ms in steps.steps[3:]:
            begin = end - ms / 1e3
            if begin < s1 and end > s0:
                row["steps_save"].append(ms)
            elif any(begin < w1 and end > w0 for w0, w1 in row["raw_windows"]):
                row["steps_raw"].append(ms)
            else:
                row["steps_quiet"].append(ms)
        row["save_parts"] = save_breakdown(log_events(log_path, row["save_wall"]),
                                           row["save_wall"])
        row["idle_parts"] = save_breakdown(log_events(log_path, row["idle_wall"]),
                                           row["idle_wall"])
        row["restore_parts"] = restore_breakdown(log_events(log_path, row["restore_wall"]))
        if args.verbose:
            print("round %d: save %s; idle save %s (%d ms; raw %.0f, 2 files %.0f); restore %s" % (
                rnd, rounded(row["save_parts"]), rounded(row["idle_parts"]),
                row["idle_reply"].total_ms, row["idle_raw_write_s"] * 1e3,
                row["idle_raw_write2_s"] * 1e3,
                rounded(row["restore_parts"])), file=sys.stderr)
            print("round %d: save total_ms %d stall_ms %d (%s) raw write %.0f ms (2 files %.0f);"
                  " restore total_ms %d (%.0f ms here) raw read %.0f ms (2 files %.0f);"
                  " steps quiet %.0f / save %s / raw %s ms" % (
                      rnd, reply.total_ms, reply.stall_ms,
                      "training" if row["save_alive"] else "NOT training",
                      row["raw_write_s"] * 1e3, row["raw_write2_s"] * 1e3,
                      row["restore_reply"].total_ms, row["restore_s"] * 1e3,
                      row["raw_read_s"] * 1e3, row["raw_read2_s"] * 1e3,
                      median(row["steps_quiet"]), [round(x) for x in row["steps_save"]],
                      [round(x) for x in row["steps_raw"]]), file=sys.stderr)
        if rnd >= 0:
            rows.append(row)
    report(args, rows, total, fs, device, tmp)


def report(args, rows, total, fs, device, tmp):
    def mbps(seconds):
        return total / seconds / 1e6

    params = (256 * args.hidden + args.hidden + (args.layers - 2) * (args.hidden ** 2 + args.hidden)
              + 16 * args.hidden + 16)
    print(json.dumps({"bench": "checkpoint_env", "dir": tmp, "fs": fs, "device": device,
                      "ranks": 2, "hidden": args.hidden, "layers": args.layers,
                      "batch": args.batch, "params": params, "checkpoint_bytes": total,
                      "rounds": len(rows), "cpus": os.cpu_count()}))
    save_ms = [r["reply"].total_ms for r in rows]
    stall_ms = [r["reply"].stall_ms for r in rows]
    raw_w = [r["raw_write_s"] for r in rows]
    raw_w2 = [r["raw_write2_s"] for r in rows]
    save = median([mbps(ms / 1e3) for ms in save_ms])
    raw = save_raw = median([mbps(s) for s in raw_w])
    print(json.dumps({
        "bench": "checkpoint_save", "metric": "MB/s", "bytes": total,
        "value": round(save, 1), "total_ms": median(save_ms),
        "baseline": "raw_pwrite_8m_fsync", "baseline_value": round(raw, 1),
        "ratio": round(save / raw, 3), "target": 0.8,
        "baseline2": "raw_2_files_parallel",
        "baseline2_value": round(median([mbps(s) for s in raw_w2]), 1),
        "ratio2": round(save / median([mbps(s) for s in raw_w2]), 3),
        "during_training": sum(r["save_alive"] for r in rows), "rounds": len(rows), "fs": fs}))
    idle_ms = [r["idle_reply"].total_ms for r in rows]
    idle = median([mbps(ms / 1e3) for ms in idle_ms])
    idle_raw = median([mbps(r["idle_raw_write_s"]) for r in rows])
    idle_raw2 = median([mbps(r["idle_raw_write2_s"]) for r in rows])
    line = {"bench": "checkpoint_save_idle", "metric": "MB/s", "bytes": total,
            "value": round(idle, 1), "total_ms": median(idle_ms),
            "stall_ms": median([r["idle_reply"].stall_ms for r in rows]),
            "baseline": "raw_pwrite_8m_fsync", "baseline_value": round(idle_raw, 1),
            "ratio": round(idle / idle_raw, 3), "target": 0.8,
            "baseline2": "raw_2_files_parallel", "baseline2_value": round(idle_raw2, 1),
            "ratio2": round(idle / idle_raw2, 3), "rounds": len(rows), "fs": fs}
    parts = [r["idle_parts"] for r in rows if r["idle_parts"]]
    for k in ("wait_ms", "copy_ms", "write_ms", "commit_ms"):
        line[k] = round(median([p[k] for p in parts]), 1) if parts else None
    if parts:
        w = median([mbps(p["write_ms"] / 1e3) for p in parts])
        line.update({"write_MB/s": round(w, 1), "write_ratio2": round(w / idle_raw2, 3)})
    print(json.dumps(line))
    ratios = [r["reply"].stall_ms / max(1, r["reply"].total_ms) for r in rows]
    print(json.dumps({
        "bench": "checkpoint_save_stall", "stall_ms": median(stall_ms),
        "total_ms": median(save_ms), "ratio": round(median(ratios), 3),
        "stall_ms_max": max(stall_ms), "rounds": len(rows)}))
    rest_ms = [r["restore_reply"].total_ms for r in rows]
    rest = median([mbps(ms / 1e3) for ms in rest_ms])
    raw_r = median([mbps(r["raw_read_s"]) for r in rows])
    raw_r2 = median([mbps(r["raw_read2_s"]) for r in rows])
    print(json.dumps({
        "bench": "checkpoint_restore", "metric": "MB/s", "bytes": total, "cache": "cold",
        "value": round(rest, 1), "total_ms": median(rest_ms),
        "client_ms": round(median([r["restore_s"] * 1e3 for r in rows]), 1),
        "baseline": "raw_pread_8m", "baseline_value": round(raw_r, 1),
        "ratio": round(rest / raw_r, 3), "target": 0.8,
        "baseline2": "raw_2_files_parallel", "baseline2_value": round(raw_r2, 1),
        "ratio2": round(rest / raw_r2, 3), "rounds": len(rows), "fs": fs}))
    parts = [r["save_parts"] for r in rows if r["save_parts"]]
    if parts:
        line = {"bench": "checkpoint_save_breakdown", "rounds": len(parts)}
        for k in ("wait_ms", "copy_ms", "write_ms", "commit_ms"):
            line[k] = round(median([p[k] for p in parts]), 1)
        # The ranks' writers alone (2 files at once), against the raw write
        # of two files at once.
        w = median([mbps(p["write_ms"] / 1e3) for p in parts])
        line.update({"write_MB/s": round(w, 1), "baseline": "raw_2_files_parallel",
                     "baseline_value": round(median([mbps(s) for s in raw_w2]), 1),
                     "ratio": round(w / median([mbps(s) for s in raw_w2]), 3)})
        # The save from the copy on (copy, writes, commit), without the
        # wait for the step to end: what the save's own work takes.
        f = median([mbps((p["copy_ms"] + p["write_ms"] + p["commit_ms"]) / 1e3) for p in parts])
        line.update({"from_copy_MB/s": round(f, 1), "from_copy_ratio": round(f / save_raw, 3),
                     "from_copy_ratio2": round(f / median([mbps(s) for s in raw_w2]), 3),
                     "copies_staged": "%d/%d" % (sum(p["staged"] for p in parts), 2 * len(parts)),
                     "staged_faulted_in": r1(100 * median([x for p in parts for x in p["faulted"]]))})
        print(json.dumps(line))
    parts = [r["restore_parts"] for r in rows if r["restore_parts"]]
    if parts:
        line = {"bench": "checkpoint_restore_breakdown", "rounds": len(parts)}
        for k in ("read_ms", "install_ms"):
            line[k] = round(median([p[k] for p in parts]), 1)
        rd = median([mbps(p["read_ms"] / 1e3) for p in parts])
        line.update({"read_MB/s": round(rd, 1), "baseline": "raw_2_files_parallel",
                     "baseline_value": round(raw_r2, 1), "ratio": round(rd / raw_r2, 3)})
        print(json.dumps(line))
    quiet = [ms for r in rows for ms in r["steps_quiet"]]
    during = [ms for r in rows for ms in r["steps_save"]]
    raw = [ms for r in rows for ms in r["steps_raw"]]
    q = median(quiet)
    # Training time a save cost rank 0: its steps' time beyond quiet steps.
    lost = [sum(r["steps_save"]) - q * len(r["steps_save"]) for r in rows]
    print(json.dumps({
        "bench": "checkpoint_train_steps", "step_ms_quiet": r1(q),
        "step_ms_during_save": r1(median(during)),
        "step_ms_during_save_max": round(max(during), 1) if during else None,
        "steps_during_save": len(during),
        "step_ms_during_raw_write": r1(median(raw)), "steps_during_raw_write": len(raw),
        "lost_ms_per_save": r1(median(lost)), "stall_ms": median(stall_ms),
        "rounds": len(rows)}))


if __name__ == "__main__":
    main()
