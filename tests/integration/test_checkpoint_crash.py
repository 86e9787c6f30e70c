"""Crash consistency and a full disk for checkpoint saves
(docs/checkpoints.md, "Crashes and restarts"; docs/daemon.md, "Crash points").

A daemon started with ZEROD_CRASH_AT=<point> kills itself with SIGKILL the
first time a save reaches that point (daemon/crashpoint.c), which is how
each phase of a save is hit exactly:

  node-shard-write        a rank's shard file half written (the model is big
                          enough that every shard is two 8 MiB chunks)
  node-shard-written      the shard written and synced, not yet reported
  coord-shards-done       every rank reported; no manifest yet
  coord-manifest-written  the manifest written and synced; not renamed
  coord-renamed           renamed into place and synced; not answered

Three ways to crash, each test on every point where it makes sense:

- standalone: the whole daemon (node and its in-process coordinator) dies;
- cluster, the coordinator dies (its own process) while the node lives on;
- cluster, the node dies while the coordinator lives on.

Each test saves a checkpoint A with nothing armed, restarts the process to
be killed armed, saves B and sees the call fail and the process die of
SIGKILL, then restarts it without the variable and checks: List never shows
B (except after coord-renamed, where B is complete and must be listed and
right), no `.tmp-` directory is left, A's files are untouched, A restores
and the restored state is A's bit for bit (saved again and read back from
disk with test_checkpoint's reader), and a new save works.

A full disk (a small tmpfs as the checkpoint directory; or, where mounting
is not permitted, ENOSPC injected into the daemon's writes by an LD_PRELOAD
shim built here; both run where they can): Save fails with
RESOURCE_EXHAUSTED naming the file and the problem, the workers train on
through it, the failed save's directory is removed and its space given
back, A is listed, untouched and restores bit for bit once there is room.
"""

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import warnings

import grpc
import pytest

import ctlproto
from conftest import binary
from test_checkpoint import load_checkpoint

pb = ctlproto.load()
C = pb.control
S = grpc.StatusCode

JOB = "crash"
TOKEN = "crash-test-token"
RANKS = 2
# 2.4M parameters (the example MLP's default width): 14 MiB of master
# weights and Adam moments per rank, so each shard file is written in two
# 8 MiB chunks and node-shard-write fires with the file half written.
MODEL = ["--hidden", "1024", "--batch", "8"]
NODE_POINTS = ["node-shard-write", "node-shard-written"]
COORD_POINTS = ["coord-shards-done", "coord-manifest-written", "coord-renamed"]
CRASHED = 'msg="crash point reached; killing this process" point=%s'
# A node's stop saves its jobs first (the drain): one more checkpoint in the
# directories these tests account for entry by entry.
NO_DRAIN = ["--drain-timeout", "0"]
CLEANED = 'msg="removed an unfinished checkpoint save"'


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def environment(**values):
    """Sets environment variables for the processes started inside."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            last = predicate()
            if last:
                return last
        except grpc.RpcError as e:  # a coordinator still starting, say
            last = e
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for %s (last: %r)" % (what, last))
        time.sleep(0.05)


class Control:
    """The Jobs and Checkpoints services of a coordinator (its own process,
    or a standalone daemon's control socket)."""

    def __init__(self, target):
        self.channel = grpc.insecure_channel(target)
        self.jobs = pb.control_grpc.JobsStub(self.channel)
        self.ckpt = pb.control_grpc.CheckpointsStub(self.channel)

    def close(self):
        self.channel.close()

    def create_job(self):
        config = pb.ipc.JobConfig(optimizer=pb.ipc.OptimizerConfig(kind=pb.ipc.OPTIMIZER_ADAMW,
                                                                  lr=1e-3))
        wait_for(lambda: self.jobs.CreateJob(C.CreateJobRequest(
            name=JOB, config=config, nodes=1, ranks_per_node=RANKS, token=TOKEN),
            timeout=10) is not None, 20, "the job to be created")
        self.wait_ready()  # built on the node: workers may attach

    def wait_ready(self, timeout_s=60):
        def ready():
            j = self.jobs.GetJob(C.GetJobRequest(name=JOB), timeout=10)
            return j.state == C.JOB_STATE_READY
        wait_for(ready, timeout_s, "job %s to be ready" % JOB)

    def save(self, name, timeout=60):
        self.wait_ready()
        return self.ckpt.Save(C.SaveRequest(job=JOB, name=name), timeout=timeout)

    def restore(self, name, timeout=60):
        self.wait_ready()
        return self.ckpt.Restore(C.RestoreRequest(job=JOB, checkpoint=name), timeout=timeout)

    def wait_recovered(self, step, lost_at=None, timeout_s=60):
        """The coordinator restored the job by itself, from the checkpoint of
        step (its node came back without its state); with lost_at, the
        recovery of a loss at that step (not an earlier recovery's text,
        left from before)."""
        want = "restored from the checkpoint of step %d" % step
        if lost_at is not None:
            want = "state lost on a node at step %d; %s" % (lost_at, want)

        def recovered():
            j = self.jobs.GetJob(C.GetJobRequest(name=JOB), timeout=10)
            return j.state == C.JOB_STATE_READY and want in j.last_recovery and j.step == step
        wait_for(recovered, timeout_s, "job %s to be recovered at step %d" % (JOB, step))

    def listed(self):
        reply = self.ckpt.List(C.ListCheckpointsRequest(job=JOB), timeout=10)
        return [(c.name, c.step) for c in reply.checkpoints]


@pytest.fixture
def controls():
    made = []

    def make(target):
        c = Control(target)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def workers(socket, steps):
    args = [binary("zerod-mlp-train"), "--socket", socket, "--job", JOB, "--no-create",
            "--token", TOKEN, "--steps", str(steps), "--log-every", str(steps)] + MODEL
    return [subprocess.Popen(args + ["--local-rank", str(r)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for r in range(RANKS)]


def finish(procs, steps):
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, "worker exited %d:\n%s%s" % (p.returncode, out, err)
        outs.append(out)
    assert "done: %d steps" % steps in outs[0], outs[0]  # rank 0 reports


def train(socket, steps):
    finish(workers(socket, steps), steps)


def entries(path):
    return sorted(os.listdir(path)) if os.path.exists(path) else []


def file_hashes(path):
    """{file name: sha256} of a checkpoint directory: what it holds on disk."""
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


class Saved:
    """A checkpoint as it was when saved: its files' hashes and its state
    (every unit's master weights and moments, read from the shard files)."""

    def __init__(self, checkpoint):
        self.name = checkpoint.name
        self.step = checkpoint.step
        self.path = checkpoint.path
        self.files = file_hashes(self.path)
        self.state = load_checkpoint(self.path)[1]
        assert self.state and all(len(v) for u in self.state.values() for v in u.values())

    def assert_untouched(self):
        assert file_hashes(self.path) == self.files, "checkpoint %s changed on disk" % self.name


def assert_state(ctl, name, want):
    """Saves the job as `name` and checks that it holds want's state, bit for
    bit: the restored state is the saved one."""
    reply = ctl.save(name)
    assert reply.checkpoint.step == want.step
    got = load_checkpoint(reply.checkpoint.path)[1]
    assert got.keys() == want.state.keys()
    for unit in want.state:
        assert got[unit] == want.state[unit], "unit %s differs from checkpoint %s" % (
            unit, want.name)


def expect_crash(proc, log, point, timeout=60):
    """The process is gone with SIGKILL, at point (its log says so)."""
    proc.wait(timeout=timeout)
    text = log()
    assert proc.returncode == -signal.SIGKILL, "exited %d, not killed at %s:\n%s" % (
        proc.returncode, point, text[-4000:])
    assert CRASHED % point in text, text[-4000:]


def assert_leftover(job_dir, point, a):
    """What the crash left, before anything cleans up: A, and B as far as
    the save got (coord-renamed: B complete, under its final name)."""
    left = entries(job_dir)
    if point == "coord-renamed":
        assert left == ["a", "b"], left
        assert entries(job_dir / "b") == sorted(a.files), entries(job_dir / "b")
        return
    assert len(left) == 2 and left[0] == "a" and left[1].startswith("b.tmp-"), left
    tmp = job_dir / left[1]
    sizes = {n: os.path.getsize(tmp / n) for n in entries(tmp) if n.endswith(".zdshard")}
    full = os.path.getsize(os.path.join(a.path, "rank-00000-of-%05d.zdshard" % RANKS))
    files = set(entries(tmp))
    if point == "node-shard-write":  # a shard cut short
        assert "manifest.json" not in files and min(sizes.values()) < full, (files, sizes)
    elif point == "node-shard-written":  # a shard complete, not reported
        assert "manifest.json" not in files and full in sizes.values(), (files, sizes)
    elif point == "coord-shards-done":  # every shard, rank 0's layout
        assert "layout.json" in files and "manifest.json" not in files, files
        assert len(sizes) == RANKS and set(sizes.values()) == {full}, sizes
    else:  # coord-manifest-written: the manifest instead of the layout
        assert files == set(a.files), files


def assert_clean(job_dir, ctl, a, point, step_b):
    """After the restart: no temporary directory, List shows A (and B only
    if it was renamed into place), A's files are as saved."""
    want = [("a", a.step)] + ([("b", step_b)] if point == "coord-renamed" else [])
    assert entries(job_dir) == [n for n, _ in want]
    assert ctl.listed() == want
    a.assert_untouched()


# ---------------------------------------------------------------------------
# Standalone: the whole daemon dies
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("point", NODE_POINTS + COORD_POINTS)
def test_standalone_daemon_killed_during_a_save(start_daemon, controls, tmp_path, point):
    ckdir = tmp_path / "checkpoints"
    job_dir = ckdir / JOB

    def start(env=None):
        with environment(**(env or {})):
            # No drain at stop: its save would be one more checkpoint in
            # the directory this test accounts for entry by entry.
            d = start_daemon(ranks=RANKS, timeout_s=30,
                             extra=["--checkpoint-dir", str(ckdir)] + NO_DRAIN)
        ctl = controls("unix:%s/control.sock" % d.dir)
        ctl.create_job()
        return d, ctl

    d, ctl = start()
    train(d.socket, 3)
    a = Saved(ctl.save("a").checkpoint)
    assert a.step == 3
    d.stop()

    # Armed: a new daemon (another --dir, so not the old one's jobs) starts
    # from A, trains on and dies saving B.
    d, ctl = start({"ZEROD_CRASH_AT": point})
    assert ctl.restore("a").step == 3
    train(d.socket, 2)
    with pytest.raises(grpc.RpcError) as e:
        ctl.save("b")
    assert e.value.code() == S.UNAVAILABLE, e.value
    expect_crash(d.proc, d.read_log, point)
    d.log.close()  # the fixture's stop() skips a killed daemon
    assert_leftover(job_dir, point, a)

    d, ctl = start()
    if point != "coord-renamed":
        assert CLEANED in d.read_log()
    assert_clean(job_dir, ctl, a, point, 5)
    if point == "coord-renamed":
        # B is complete: it restores, and it is the state that training
        # from A reaches in 2 steps (training is deterministic).
        b = Saved(next(c for c in ctl.ckpt.List(C.ListCheckpointsRequest(job=JOB),
                                                 timeout=10).checkpoints if c.name == "b"))
        assert ctl.restore("b").step == 5
        assert_state(ctl, "b-again", b)
        assert ctl.restore("a").step == 3
        train(d.socket, 2)
        assert_state(ctl, "b-replayed", b)
    assert ctl.restore("a").step == 3
    assert_state(ctl, "c", a)
    train(d.socket, 1)  # and training goes on from A


# ---------------------------------------------------------------------------
# A cluster: the coordinator dies, the node lives on
# ---------------------------------------------------------------------------

def cluster_with_a(cluster, controls):
    """A coordinator and one node with the job trained 3 steps and saved
    as checkpoint a: (coordinator, node, the job's checkpoint directory,
    controls, a)."""
    coord = cluster.start_coordinator(lease_ttl_s=1.5)
    node = cluster.start_node("n", ranks=RANKS, timeout_s=30, extra=NO_DRAIN)
    job_dir = coord.state_dir / "checkpoints" / JOB
    ctl = controls(coord.address)
    ctl.create_job()
    train(node.socket, 3)
    a = Saved(ctl.save("a").checkpoint)
    assert a.step == 3
    return coord, node, job_dir, ctl, a


@pytest.mark.parametrize("point", COORD_POINTS)
def test_coordinator_killed_during_a_save(cluster, controls, point):
    coord, node, job_dir, ctl, a = cluster_with_a(cluster, controls)

    # The coordinator holds no training state: it is restarted armed (the
    # job is in its state directory), the node joins it again and trains on.
    coord.stop()
    with environment(ZEROD_CRASH_AT=point):
        coord.start()
    ctl = controls(coord.address)  # a new channel: no reconnection backoff
    train(node.socket, 2)
    with pytest.raises(grpc.RpcError) as e:
        ctl.save("b")
    assert e.value.code() == S.UNAVAILABLE, e.value
    expect_crash(coord.proc, coord.read_log, point)
    coord.log.close()  # the fixture's stop() skips a killed coordinator
    assert node.alive()
    assert_leftover(job_dir, point, a)

    coord.start()
    ctl = controls(coord.address)
    if point != "coord-renamed":
        assert CLEANED in coord.read_log()
    wait_for(lambda: ctl.listed() is not None, 20, "the coordinator")
    assert_clean(job_dir, ctl, a, point, 5)
    if point == "coord-renamed":
        # B is complete and is the node's state: nothing trained since.
        b = Saved(next(c for c in ctl.ckpt.List(C.ListCheckpointsRequest(job=JOB),
                                                 timeout=10).checkpoints if c.name == "b"))
        assert_state(ctl, "b-again", b)
    # The node dropped the order it never heard the end of: A restores and
    # new saves work.
    assert ctl.restore("a").step == 3
    assert_state(ctl, "c", a)
    train(node.socket, 1)
    assert ctl.save("d").checkpoint.step == 4


# ---------------------------------------------------------------------------
# A cluster: the node dies, the coordinator lives on
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("point", NODE_POINTS)
def test_node_killed_during_a_save(cluster, controls, point):
    coord, node, job_dir, ctl, a = cluster_with_a(cluster, controls)

    # Restarted armed: the node comes back with the job's ranks empty, so
    # the coordinator restores A (its newest checkpoint) by itself; the job
    # trains on and dies saving B.
    node.stop()
    with environment(ZEROD_CRASH_AT=point):
        node = cluster.start_node("n", ranks=RANKS, timeout_s=30, extra=NO_DRAIN)
    ctl.wait_recovered(3)
    train(node.socket, 2)
    with pytest.raises(grpc.RpcError) as e:
        ctl.save("b")
    expect_crash(node.proc, node.read_log, point)
    node.log.close()  # the fixture's stop() skips a killed node
    # The coordinator fails the save once the node's lease runs out, and
    # removes its directory itself.
    assert e.value.code() == S.UNAVAILABLE, e.value
    assert "node 'n' left the cluster" in e.value.details(), e.value.details()
    wait_for(lambda: entries(job_dir) == ["a"], 20, "the failed save's directory to go")
    assert ctl.listed() == [("a", 3)]
    a.assert_untouched()

    node = cluster.start_node("n", ranks=RANKS, timeout_s=30, extra=NO_DRAIN)
    ctl.wait_recovered(3, lost_at=5)
    assert_state(ctl, "c", a)
    train(node.socket, 1)
    assert ctl.save("d").checkpoint.step == 4
    assert ctl.listed() == [("a", 3), ("c", 3), ("d", 4)]


# ---------------------------------------------------------------------------
# A full disk
# ---------------------------------------------------------------------------

# An LD_PRELOAD shim for where mounting a tmpfs is not permitted: a file
# opened for writing at a path that contains $ZD_ENOSPC_MATCH while the
# file $ZD_ENOSPC_FLAG exists takes no data (write, pwrite: ENOSPC), as on
# a full filesystem.
ENOSPC_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static volatile unsigned char full[1 << 16];

static int mark(int fd, const char *path, int flags) {
  if (fd >= 0 && fd < (int)sizeof full) {
    const char *match = getenv("ZD_ENOSPC_MATCH"), *flag = getenv("ZD_ENOSPC_FLAG");
    full[fd] = (flags & O_ACCMODE) != O_RDONLY && match != NULL && flag != NULL &&
               strstr(path, match) != NULL && access(flag, F_OK) == 0;
  }
  return fd;
}

static int is_full(int fd) {
  if (fd < 0 || fd >= (int)sizeof full || !full[fd])
    return 0;
  errno = ENOSPC;
  return 1;
}

#define NEXT(name) ((__typeof__(&name))dlsym(RTLD_NEXT, #name))
#define MODE(flags) \
  mode_t mode = 0; \
  if ((flags) & (O_CREAT | O_TMPFILE)) { \
    va_list ap; \
    va_start(ap, flags); \
    mode = va_arg(ap, mode_t); \
    va_end(ap); \
  }

int open(const char *path, int flags, ...) {
  MODE(flags);
  return mark(NEXT(open)(path, flags, mode), path, flags);
}
int open64(const char *path, int flags, ...) {
  MODE(flags);
  return mark(NEXT(open64)(path, flags, mode), path, flags);
}
int openat(int dir, const char *path, int flags, ...) {
  MODE(flags);
  return mark(NEXT(openat)(dir, path, flags, mode), path, flags);
}
int openat64(int dir, const char *path, int flags, ...) {
  MODE(flags);
  return mark(NEXT(openat64)(dir, path, flags, mode), path, flags);
}
int close(int fd) {
  if (fd >= 0 && fd < (int)sizeof full)
    full[fd] = 0;
  return NEXT(close)(fd);
}
ssize_t write(int fd, const void *buf, size_t n) {
  return is_full(fd) ? -1 : NEXT(write)(fd, buf, n);
}
ssize_t pwrite(int fd, const void *buf, size_t n, off_t at) {
  return is_full(fd) ? -1 : NEXT(pwrite)(fd, buf, n, at);
}
ssize_t pwrite64(int fd, const void *buf, size_t n, off64_t at) {
  return is_full(fd) ? -1 : NEXT(pwrite64)(fd, buf, n, at);
}
"""


class FullDisk:
    """A checkpoint directory that can be made full and given room again.

    tmpfs: a tmpfs of its own, shrunk to what is used plus a quarter of a
    checkpoint (so no shard of the next one fits) and grown again.
    injected: a directory on the test's filesystem; the daemon runs with
    ENOSPC_SHIM, which refuses writes into `.tmp-` directories while full."""

    def __init__(self, how, tmp_path):
        self.how = how
        self.dir = tmp_path / "checkpoints"
        self.dir.mkdir()
        self.env = {}
        self.mounted = False
        if how == "tmpfs":
            proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g,mode=0700", "tmpfs",
                                   str(self.dir)], capture_output=True, text=True)
            if proc.returncode == 0:
                self.mounted = True
                return
            warnings.warn("cannot mount a tmpfs (%s): ENOSPC is injected instead" %
                          proc.stderr.strip())
            self.how = "injected"
        cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or "gcc"]
        src = tmp_path / "enospc.c"
        src.write_text(ENOSPC_SHIM)
        lib = tmp_path / "libenospc.so"
        subprocess.run(cc + ["-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl"],
                       check=True)
        self.flag = tmp_path / "disk-is-full"
        asan = os.environ.get("ASAN_OPTIONS", "")
        self.env = {"LD_PRELOAD": str(lib), "ZD_ENOSPC_MATCH": ".tmp-",
                    "ZD_ENOSPC_FLAG": str(self.flag),
                    # The shim comes before the sanitizer's runtime.
                    "ASAN_OPTIONS": (asan + ":" if asan else "") + "verify_asan_link_order=0"}

    def used(self):
        st = os.statvfs(self.dir)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def fill(self, checkpoint_bytes):
        if self.mounted:
            size = (self.used() + checkpoint_bytes // 4 + 4095) // 4096 * 4096
            subprocess.run(["mount", "-o", "remount,size=%d" % size, str(self.dir)], check=True)
        else:
            self.flag.write_text("")

    def make_room(self):
        if self.mounted:
            subprocess.run(["mount", "-o", "remount,size=1g", str(self.dir)], check=True)
        else:
            self.flag.unlink()

    def close(self):
        if self.mounted and subprocess.run(["umount", str(self.dir)]).returncode != 0:
            subprocess.run(["umount", "-l", str(self.dir)], check=True)


@pytest.fixture(params=["tmpfs", "injected"])
def full_disk(request, tmp_path):
    disk = FullDisk(request.param, tmp_path)
    yield disk
    disk.close()


def test_disk_full_fails_the_save_and_training_goes_on(full_disk, start_daemon, controls):
    # full_disk comes first: it is unmounted after the daemon has stopped.
    with environment(**full_disk.env):
        d = start_daemon(ranks=RANKS, timeout_s=30,
                         extra=["--checkpoint-dir", str(full_disk.dir)])
    ctl = controls("unix:%s/control.sock" % d.dir)
    ctl.create_job()
    job_dir = full_disk.dir / JOB
    train(d.socket, 3)
    a = Saved(ctl.save("a").checkpoint)
    used = full_disk.used()
    full_disk.fill(sum(os.path.getsize(os.path.join(a.path, f)) for f in a.files))

    # A save while the workers train: it fails, they do not notice.
    steps = 30
    procs = workers(d.socket, steps)
    wait_for(lambda: d.read_log().count('msg="worker attached"') == 2 * RANKS, 30,
             "the workers to attach")
    for name in ("b", "b2"):  # and the node is not stuck after the first
        with pytest.raises(grpc.RpcError) as e:
            ctl.save(name)
        assert e.value.code() == S.RESOURCE_EXHAUSTED, e.value
        details = e.value.details()
        assert re.fullmatch(r"rank [0-9]+: (rank-[0-9]{5}-of-%05d\.zdshard|layout\.json(\.tmp)?): "
                            r"No space left on device" % RANKS, details), details
    finish(procs, steps)
    train(d.socket, 2)
    # The failed saves' directories are removed, their space given back;
    # A is as it was.
    wait_for(lambda: entries(job_dir) == ["a"], 20, "the failed saves' directories to go")
    if full_disk.mounted:
        wait_for(lambda: full_disk.used() <= used, 20, "the space to be given back")
    assert ctl.listed() == [("a", 3)]
    a.assert_untouched()
    assert "No space left on device" in d.read_log()

    # With room again: A restores bit for bit, saves work.
    full_disk.make_room()
    assert ctl.restore("a").step == 3
    assert_state(ctl, "c", a)
    assert ctl.listed() == [("a", 3), ("c", 3)]
