"""The coordinator's side of checkpoints, black box: a real `zerod
coordinator` driven over gRPC (modules generated from the .proto files) by
fake nodes and operators, and zerodctl.

The fake nodes play the nodes' part of the protocol (docs/checkpoints.md)
with files they make up: they see SaveOrder and RestoreOrder in their Watch
events, write shard files of the right size and rank 0's layout.json into
the order's directory, and report ShardReports in their heartbeats. That
pins what the coordinator does with the reports (the manifest, the
rename, every failure path) without the real node side; the real thing is
tested end to end elsewhere. Manifests are written here as the JSON that
daemon/ckpt/ckpt_manifest.c documents.

Every test starts its own coordinator (state directory in tmp_path; the
checkpoints under STATE/checkpoints), which must exit 0 on SIGTERM with no
sanitizer report.
"""

import json
import os
import re
import subprocess
import threading
import time

import grpc
import pytest

import ctlproto
import test_coordinator as tc
from conftest import binary

pb = ctlproto.load()
C = pb.control
S = grpc.StatusCode

expect_error = tc.expect_error
wait_for = tc.wait_for

# The fake checkpoints' one unit: 10 fp32 master values, no moments.
UNIT_NUMEL = 10
BLOCK_BYTES = 1 << 20


def shard_name(rank, world):
    return "rank-%05d-of-%05d.zdshard" % (rank, world)


def shard_numel(world):
    return (UNIT_NUMEL + world - 1) // world


def shard_bytes(world):
    """The size daemon/ckpt/ckpt_shard.c gives a shard file of the fake layout: header,
    data, one checksum per 1 MiB block, footer."""
    data = shard_numel(world) * 4
    blocks = (data + BLOCK_BYTES - 1) // BLOCK_BYTES
    return 4096 + data + 8 * blocks + 8


def manifest(job, name, step, world, files=True, job_id=1, created=1795265747352):
    m = {
        "format": "zerod-checkpoint",
        "format_version": 1,
        "job": job,
        "job_id": job_id,
        "name": name,
        "created_unix_ms": created,
        "step": step,
        "version": step,
        "world_size": world,
        "config": {"optimizer": "adamw", "lr": 0.001, "beta1": 0.9, "beta2": 0.999,
                   "eps": 1e-08, "weight_decay": 0.01, "momentum": 0.0, "dampening": 0.0,
                   "nesterov": False, "working_dtype": "fp32", "max_grad_norm": 0.0},
        "states": ["master"],
        "units": [{"name": "fc1", "numel": UNIT_NUMEL,
                   "padded_numel": shard_numel(world) * world,
                   "shard_numel": shard_numel(world),
                   "tensors": [{"name": "fc1.weight", "shape": [UNIT_NUMEL], "offset": 0,
                                "frozen": False}]}],
    }
    if files:
        m["files"] = [{"name": shard_name(r, world), "bytes": shard_bytes(world),
                       "xxh64": "%016x" % (0x1234 + r)} for r in range(world)]
    return m


def make_checkpoint(root, job, name, step=10, world=1, shard_sizes=None):
    """A complete-looking checkpoint directory (zeros for shard data)."""
    d = root / job / name
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps(manifest(job, name, step, world)))
    for r in range(world):
        size = shard_bytes(world) if shard_sizes is None else shard_sizes[r]
        (d / shard_name(r, world)).write_bytes(b"\0" * size)
    return d


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------

class Coordinator(tc.Coordinator):
    """test_coordinator's coordinator with a Checkpoints stub."""

    def start(self):
        super().start()
        self.ckpt = pb.control_grpc.CheckpointsStub(self.channel)

    @property
    def checkpoints(self):
        return self.state_dir / "checkpoints"


class CkptNode(tc.FakeNode):
    """A fake node that also plays the checkpoint protocol: its heartbeats
    carry ShardReports, and a thread answers the orders in its Watch
    events with on_save(assignment, order) and on_restore(assignment,
    order), each returning the node's reports for the order (or None to
    stay silent)."""

    def __init__(self, coord, name, ranks=1):
        self.saves = {}  # job -> [ShardReport]
        self.restores = {}
        self.on_save = None
        self.on_restore = None
        self.events = []
        self.handled = set()
        super().__init__(coord, name, ranks)

    def heartbeat(self):
        with self.lock:
            jobs = [C.JobStatus(job=j, ready=r, error=e, step=s,
                                saves=self.saves.get(j, []), restores=self.restores.get(j, []))
                    for j, (r, e, s) in sorted(self.reports.items())]
        return self.coord.cluster.Heartbeat(
            C.HeartbeatRequest(node=self.name, session=self.session, jobs=jobs), timeout=10)

    def serve(self):
        self._handle(self.watch())
        stream = self.w

        def loop():
            while True:
                event = stream.events.get()
                if event is None:
                    return
                self._handle(event)

        threading.Thread(target=loop, daemon=True).start()

    def _handle(self, event):
        with self.lock:
            self.events.append(event)
        for a in event.assignments:
            job = a.job.name
            for order in a.saves:
                if ("save", order.id) in self.handled or self.on_save is None:
                    continue
                self.handled.add(("save", order.id))
                reports = self.on_save(a, order)
                if reports is not None:
                    with self.lock:
                        self.saves[job] = reports
            if a.HasField("restore") and self.on_restore is not None:
                key = ("restore", a.restore.id, a.restore.commit)
                if key not in self.handled:
                    self.handled.add(key)
                    reports = self.on_restore(a, a.restore)
                    if reports is not None:
                        with self.lock:
                            self.restores[job] = reports

    def latest_assignment(self, job):
        with self.lock:
            for event in reversed(self.events):
                for a in event.assignments:
                    if a.job.name == job:
                        return a
        return None


def writes_shards(step, write_files=True, write_layout=True, steps=None, errors=None, extra=0):
    """on_save: writes the node's shard files (and rank 0's layout) and
    reports them done. steps: rank -> step (default step); errors: rank ->
    (code, message); extra: bytes added to every file on disk."""
    def handle(a, order):
        world = a.job.world_size
        reports = []
        for r in range(a.first_rank, a.first_rank + a.ranks):
            if errors and r in errors:
                code, message = errors[r]
                reports.append(C.ShardReport(id=order.id, rank=r, done=True, error=message,
                                             code=code))
                continue
            rank_step = (steps or {}).get(r, step)
            if write_files:
                with open(os.path.join(order.dir, shard_name(r, world)), "wb") as f:
                    f.write(b"\0" * (shard_bytes(world) + extra))
            if r == 0 and write_layout:
                with open(os.path.join(order.dir, "layout.json"), "w") as f:
                    json.dump(manifest(a.job.name, "layout", rank_step, world, files=False,
                                       job_id=a.job.id), f)
            reports.append(C.ShardReport(id=order.id, rank=r, done=True, step=rank_step,
                                         file=shard_name(r, world), bytes=shard_bytes(world),
                                         xxh64=0xabc + r, stall_ms=10 * (r + 1)))
        return reports
    return handle


def restores_to(step, errors=None, commit_errors=None):
    """on_restore: reads (phase 1), then installs on commit (phase 2)."""
    def handle(a, order):
        reports = []
        for r in range(a.first_rank, a.first_rank + a.ranks):
            table = commit_errors if order.commit else errors
            if table and r in table:
                code, message = table[r]
                reports.append(C.ShardReport(id=order.id, rank=r, done=True, error=message,
                                             code=code))
            else:
                reports.append(C.ShardReport(id=order.id, rank=r, done=True, step=step,
                                             committed=order.commit))
        return reports
    return handle


@pytest.fixture
def coordinator(tmp_path):
    started = []

    def start(state_dir=None, extra=()):
        # The tests export to and restore from files in tmp_path.
        c = Coordinator(tmp_path, tc.TTL_S, state_dir,
                        extra=["--export-root", str(tmp_path)] + list(extra))
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


@pytest.fixture
def coord(coordinator):
    return coordinator()


@pytest.fixture
def nodes():
    made = []

    def make(coord, name, ranks=1):
        n = CkptNode(coord, name, ranks)
        n.start_heartbeats()
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def ready_job(coord, nodes, job="j", nodes_count=2, ranks_per_node=1, step=10, **kw):
    """A job on fresh serving nodes n0.., reported ready at step."""
    made = [nodes(coord, "n%d" % i, ranks=ranks_per_node) for i in range(nodes_count)]
    for n in made:
        n.serve()
    tc.create_job(coord, job, nodes=nodes_count, ranks_per_node=ranks_per_node, **kw)
    for n in made:
        n.report(job, ready=True, step=step)
    tc.wait_job_state(coord, job, C.JOB_STATE_READY)
    return made


def entries(path):
    return sorted(os.listdir(path)) if os.path.exists(path) else []


def listed(coord, job=""):
    return [(c.job, c.name, c.step) for c in
            coord.ckpt.List(C.ListCheckpointsRequest(job=job), timeout=10).checkpoints]


# ---------------------------------------------------------------------------
# Requests the decoder refuses, and errors before anything is ordered
# ---------------------------------------------------------------------------

def test_health_serves_the_checkpoints_service(coord):
    reply = coord.health.Check(pb.health.HealthCheckRequest(service="zerod.v1.Checkpoints"),
                               timeout=10)
    assert reply.status == pb.health.HealthCheckResponse.SERVING


@pytest.mark.parametrize("job, name, fragment", [
    ("", "x", "job is missing"),
    ("bad job", "x", "job must be"),
    ("..", "x", "cannot name a checkpoint directory"),
    ("j", "bad name", "name must be"),
    ("j", "x" * 65, "name must be"),
    ("j", ".hidden", "reserved"),
    ("j", "x.tmp-3", "reserved"),
    ("j", "x.deleting-3", "reserved"),
    ("j", "auto-00000010", "periodic"),
])
def test_save_refuses_malformed_requests(coord, job, name, fragment):
    expect_error(S.INVALID_ARGUMENT, coord.ckpt.Save, C.SaveRequest(job=job, name=name),
                 timeout=10, fragment=fragment)


@pytest.mark.parametrize("call, request_", [
    ("Delete", C.DeleteCheckpointRequest(job="j", name="")),
    ("Delete", C.DeleteCheckpointRequest(job="j", name="a.tmp-1")),
    ("Delete", C.DeleteCheckpointRequest(job=".", name="a")),
    ("List", C.ListCheckpointsRequest(job="no good")),
    ("Restore", C.RestoreRequest(job="j", checkpoint="")),
    ("Restore", C.RestoreRequest(job="j", checkpoint="a/b/c")),
    ("Restore", C.RestoreRequest(job="j", checkpoint="../x")),
    ("Restore", C.RestoreRequest(job="j", checkpoint="relative/../x")),
    ("Restore", C.RestoreRequest(job="j", checkpoint="x.deleting-5")),
    ("Restore", C.RestoreRequest(job="j", checkpoint="/tmp/a\nb")),
    ("Restore", C.RestoreRequest(job="j", checkpoint="/" + "x" * 4000)),
    ("Export", C.ExportRequest(job="j", path="")),
    ("Export", C.ExportRequest(job="j", path="/tmp/a\nb.safetensors")),
    ("Export", C.ExportRequest(job="j", path="/" + "x" * 4000)),
    ("Export", C.ExportRequest(job="j", path="/tmp/x.safetensors", dtype=7)),
    ("Export", C.ExportRequest(job="j", path="/tmp/x.safetensors", checkpoint="a/b/c")),
    ("Export", C.ExportRequest(job="", path="/tmp/x.safetensors")),
])
def test_other_methods_refuse_malformed_requests(coord, call, request_):
    expect_error(S.INVALID_ARGUMENT, getattr(coord.ckpt, call), request_, timeout=10)


def test_garbage_bytes_are_invalid_argument(coord):
    for method in ("Save", "List", "Delete", "Restore", "Export"):
        call = coord.channel.unary_unary("/zerod.v1.Checkpoints/" + method)
        expect_error(S.INVALID_ARGUMENT, call, b"\xff\xff\xff\xff\x0f", timeout=10)


def test_unknown_jobs_and_checkpoints_are_not_found(coord):
    expect_error(S.NOT_FOUND, coord.ckpt.Save, C.SaveRequest(job="ghost"), timeout=10,
                 fragment="no job named 'ghost'")
    expect_error(S.NOT_FOUND, coord.ckpt.Restore, C.RestoreRequest(job="ghost", checkpoint="x"),
                 timeout=10, fragment="no job named 'ghost'")
    expect_error(S.NOT_FOUND, coord.ckpt.Delete, C.DeleteCheckpointRequest(job="ghost", name="x"),
                 timeout=10, fragment="job 'ghost' has no checkpoint named 'x'")
    # Checkpoints outlive jobs: listing a job nobody knows is an empty list.
    assert listed(coord, "ghost") == []


def test_a_job_that_is_not_ready_cannot_save_or_restore(coord, nodes):
    nodes(coord, "n0")
    tc.create_job(coord, "j")  # the node never reports it ready
    details = expect_error(S.FAILED_PRECONDITION, coord.ckpt.Save, C.SaveRequest(job="j"),
                           timeout=10)
    assert details.startswith("job 'j' is not ready (creating: waiting for node n0"), details
    expect_error(S.FAILED_PRECONDITION, coord.ckpt.Restore,
                 C.RestoreRequest(job="j", checkpoint="x"), timeout=10, fragment="not ready")
    assert entries(coord.checkpoints / "j") == []


def test_save_of_an_existing_name_is_already_exists(coord, nodes):
    ready_job(coord, nodes)
    make_checkpoint(coord.checkpoints, "j", "best")
    expect_error(S.ALREADY_EXISTS, coord.ckpt.Save, C.SaveRequest(job="j", name="best"),
                 timeout=10, fragment="job 'j' already has a checkpoint named 'best'")
    assert entries(coord.checkpoints / "j") == ["best"]


# ---------------------------------------------------------------------------
# List, Delete and the start-up cleanup
# ---------------------------------------------------------------------------

def test_list_shows_complete_checkpoints_only_in_order(coord):
    root = coord.checkpoints
    make_checkpoint(root, "b", "late", step=30, world=2)
    make_checkpoint(root, "b", "early", step=5)
    make_checkpoint(root, "b", "also-5", step=5)
    make_checkpoint(root, "a", "x", step=7)
    # Not checkpoints: unfinished save and delete, a broken manifest, a
    # directory without one, a plain file, a hidden name.
    make_checkpoint(root, "a", "x.tmp-17")
    make_checkpoint(root, "a", "y.deleting-18")
    broken = make_checkpoint(root, "a", "broken")
    (broken / "manifest.json").write_text('{"format": "zerod-checkpoint", "format_ver')
    (root / "a" / "empty").mkdir()
    (root / "a" / "file").write_text("not a directory")
    make_checkpoint(root, "a", ".hidden")
    reply = coord.ckpt.List(C.ListCheckpointsRequest(), timeout=10)
    assert [(c.job, c.name, c.step) for c in reply.checkpoints] == [
        ("a", "x", 7), ("b", "also-5", 5), ("b", "early", 5), ("b", "late", 30)]
    late = reply.checkpoints[-1]
    assert late.path == str(root / "b" / "late")
    assert late.world_size == 2 and late.bytes == 2 * shard_bytes(2)
    assert late.created_unix_ms == 1795265747352 and late.job_id == 1
    assert listed(coord, "a") == [("a", "x", 7)]
    log = coord.read_log()
    assert "skipped a checkpoint directory whose manifest does not decode" in log, log
    assert "broken" in log


def test_delete_removes_the_checkpoint_and_nothing_else(coord):
    root = coord.checkpoints
    make_checkpoint(root, "j", "one", step=1)
    make_checkpoint(root, "j", "two", step=2)
    coord.ckpt.Delete(C.DeleteCheckpointRequest(job="j", name="one"), timeout=10)
    assert listed(coord, "j") == [("j", "two", 2)]
    wait_for(lambda: entries(root / "j") == ["two"], 10, "the deleted files to go")
    expect_error(S.NOT_FOUND, coord.ckpt.Delete, C.DeleteCheckpointRequest(job="j", name="one"),
                 timeout=10)
    # A directory with a final name but no valid manifest can be deleted too.
    (root / "j" / "junk").mkdir()
    coord.ckpt.Delete(C.DeleteCheckpointRequest(job="j", name="junk"), timeout=10)
    wait_for(lambda: entries(root / "j") == ["two"], 10, "junk to go")


def test_start_removes_what_a_crash_left(coordinator, tmp_path):
    state = tmp_path / "state"
    root = state / "checkpoints"
    make_checkpoint(root, "j", "kept", step=3)
    make_checkpoint(root, "j", "step.tmp-12345")
    (root / "j" / "auto.tmp-99" / "sub").mkdir(parents=True)
    make_checkpoint(root, "k", "old.deleting-7")
    coord = coordinator(state_dir=state)
    assert entries(root / "j") == ["kept"]
    assert entries(root / "k") == []
    log = coord.read_log()
    assert log.count("removed an unfinished checkpoint save") == 2, log
    assert log.count("removed an unfinished checkpoint delete") == 1, log
    assert listed(coord) == [("j", "kept", 3)]


# ---------------------------------------------------------------------------
# Restore: checks before anything is ordered
# ---------------------------------------------------------------------------

def assert_no_order_was_sent(node, job):
    a = node.latest_assignment(job)
    assert a is not None and not a.HasField("restore") and len(a.saves) == 0, a


def test_restore_refuses_a_truncated_or_overlong_shard_file(coord, nodes):
    made = ready_job(coord, nodes)
    full = shard_bytes(1)
    make_checkpoint(coord.checkpoints, "j", "short", shard_sizes=[full - 100])
    make_checkpoint(coord.checkpoints, "j", "long", shard_sizes=[full + 1])
    details = expect_error(S.DATA_LOSS, coord.ckpt.Restore,
                           C.RestoreRequest(job="j", checkpoint="short"), timeout=10)
    assert details == "%s: truncated: %d of %d bytes" % (shard_name(0, 1), full - 100, full), \
        details
    details = expect_error(S.DATA_LOSS, coord.ckpt.Restore,
                           C.RestoreRequest(job="j", checkpoint="long"), timeout=10)
    assert details == "%s: too long: %d bytes, the manifest says %d" % (
        shard_name(0, 1), full + 1, full), details
    time.sleep(0.5)
    assert_no_order_was_sent(made[0], "j")


def test_restore_source_errors(coord, nodes, tmp_path):
    ready_job(coord, nodes)
    root = coord.checkpoints
    expect_error(S.NOT_FOUND, coord.ckpt.Restore, C.RestoreRequest(job="j", checkpoint="nope"),
                 timeout=10, fragment="no checkpoint at")
    (root / "j" / "empty").mkdir(parents=True)
    expect_error(S.NOT_FOUND, coord.ckpt.Restore, C.RestoreRequest(job="j", checkpoint="empty"),
                 timeout=10, fragment="is not a checkpoint (no manifest.json)")
    broken = make_checkpoint(root, "j", "broken")
    (broken / "manifest.json").write_text("{}")
    expect_error(S.DATA_LOSS, coord.ckpt.Restore, C.RestoreRequest(job="j", checkpoint="broken"),
                 timeout=10, fragment="manifest.json")
    lost = make_checkpoint(root, "other", "lost", world=2)
    os.unlink(lost / shard_name(1, 2))
    expect_error(S.DATA_LOSS, coord.ckpt.Restore,
                 C.RestoreRequest(job="j", checkpoint="other/lost"), timeout=10,
                 fragment="%s: missing" % shard_name(1, 2))
    expect_error(S.NOT_FOUND, coord.ckpt.Restore,
                 C.RestoreRequest(job="j", checkpoint=str(tmp_path / "absent")), timeout=10)
    text = tmp_path / "weights.bin"
    text.write_bytes(b"\0" * 64)
    expect_error(S.INVALID_ARGUMENT, coord.ckpt.Restore,
                 C.RestoreRequest(job="j", checkpoint=str(text)), timeout=10,
                 fragment="neither a checkpoint directory nor a .safetensors file")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x64\0\0\0\0\0\0\0{")  # a 100-byte header that is not there
    expect_error(S.DATA_LOSS, coord.ckpt.Restore,
                 C.RestoreRequest(job="j", checkpoint=str(bad)), timeout=10)
    unfinished = make_checkpoint(root, "j", "x.tmp-4")
    expect_error(S.NOT_FOUND, coord.ckpt.Restore,
                 C.RestoreRequest(job="j", checkpoint=str(unfinished)), timeout=10,
                 fragment="unfinished save or a deleted checkpoint")


# ---------------------------------------------------------------------------
# Save and Restore with fake nodes
# ---------------------------------------------------------------------------

def test_save_writes_the_manifest_and_renames_the_directory(coord, nodes):
    made = ready_job(coord, nodes, step=42)
    for n in made:
        n.on_save = writes_shards(42)
    reply = coord.ckpt.Save(C.SaveRequest(job="j"), timeout=30)
    cp = reply.checkpoint
    assert (cp.job, cp.name, cp.step, cp.world_size) == ("j", "step-00000042", 42, 2)
    assert cp.bytes == 2 * shard_bytes(2) and cp.job_id >= 1 and cp.created_unix_ms > 0
    assert cp.path == str(coord.checkpoints / "j" / "step-00000042")
    assert reply.stall_ms == 20 and reply.total_ms >= 0
    assert sorted(os.listdir(cp.path)) == ["manifest.json", shard_name(0, 2), shard_name(1, 2)]
    m = json.loads(open(os.path.join(cp.path, "manifest.json")).read())
    assert m["name"] == "step-00000042" and m["job"] == "j" and m["step"] == 42
    assert m["files"] == [{"name": shard_name(r, 2), "bytes": shard_bytes(2),
                           "xxh64": "%016x" % (0xabc + r)} for r in range(2)]
    assert entries(coord.checkpoints / "j") == ["step-00000042"]
    # The order went to both nodes with one directory, and leaves them.
    orders = [o for e in made[0].events for a in e.assignments for o in a.saves]
    assert orders and orders[0].dir.startswith(str(coord.checkpoints / "j" / "step.tmp-"))
    wait_for(lambda: all(len(n.latest_assignment("j").saves) == 0 for n in made), 10,
             "the order to leave the assignments")
    assert listed(coord) == [("j", "step-00000042", 42)]
    # Same step again: the name gets the order id.
    reply = coord.ckpt.Save(C.SaveRequest(job="j"), timeout=30)
    assert re.fullmatch(r"step-00000042-\d+", reply.checkpoint.name), reply.checkpoint.name
    # A name as asked.
    reply = coord.ckpt.Save(C.SaveRequest(job="j", name="best"), timeout=30)
    assert reply.checkpoint.name == "best"


def mode_of(path):
    return os.stat(path).st_mode & 0o7777


@pytest.mark.parametrize("file_mode, dir_mode", [(None, 0o700), ("0640", 0o750)])
def test_what_the_coordinator_writes_has_the_file_mode(coordinator, nodes, file_mode, dir_mode):
    coord = coordinator(extra=["--file-mode", file_mode] if file_mode else [])
    made = ready_job(coord, nodes, step=42)
    for n in made:
        n.on_save = writes_shards(42)
    cp = coord.ckpt.Save(C.SaveRequest(job="j", name="m"), timeout=30).checkpoint
    want = 0o600 if file_mode is None else int(file_mode, 8)
    assert mode_of(coord.state_dir / "coordinator.pb") == want
    assert mode_of(os.path.join(cp.path, "manifest.json")) == want
    assert mode_of(cp.path) == dir_mode and mode_of(coord.checkpoints / "j") == dir_mode


def test_a_rank_error_fails_the_save_and_removes_its_directory(coord, nodes):
    made = ready_job(coord, nodes)
    made[0].on_save = writes_shards(10)
    made[1].on_save = writes_shards(10, errors={1: (8, "rank-00001-of-00002.zdshard: "
                                                       "No space left on device")})
    details = expect_error(S.RESOURCE_EXHAUSTED, coord.ckpt.Save, C.SaveRequest(job="j"),
                           timeout=30)
    assert details == "rank 1: rank-00001-of-00002.zdshard: No space left on device", details
    wait_for(lambda: entries(coord.checkpoints / "j") == [], 10, "the temporary directory to go")
    wait_for(lambda: len(made[0].latest_assignment("j").saves) == 0, 10, "the order to go")
    # The job is free again.
    made[1].on_save = writes_shards(10)
    coord.ckpt.Save(C.SaveRequest(job="j", name="again"), timeout=30)


def test_ranks_at_different_steps_fail_the_save(coord, nodes):
    made = ready_job(coord, nodes)
    made[0].on_save = writes_shards(10)
    made[1].on_save = writes_shards(11)
    details = expect_error(S.FAILED_PRECONDITION, coord.ckpt.Save, C.SaveRequest(job="j"),
                           timeout=30)
    assert details == "ranks saved different steps: rank 0 at 10, rank 1 at 11; retry", details
    wait_for(lambda: entries(coord.checkpoints / "j") == [], 10, "the temporary directory to go")


def test_shards_the_coordinator_cannot_see_fail_the_save(coord, nodes):
    made = ready_job(coord, nodes, nodes_count=1)
    made[0].on_save = writes_shards(10, write_files=False)
    expect_error(S.FAILED_PRECONDITION, coord.ckpt.Save, C.SaveRequest(job="j"), timeout=30,
                 fragment="filesystem that every node shares")
    wait_for(lambda: entries(coord.checkpoints / "j") == [], 10, "the temporary directory to go")


def test_a_shard_of_the_wrong_size_fails_the_save(coord, nodes):
    made = ready_job(coord, nodes, nodes_count=1)
    made[0].on_save = writes_shards(10, extra=3)
    expect_error(S.DATA_LOSS, coord.ckpt.Save, C.SaveRequest(job="j"), timeout=30,
                 fragment="bytes on disk, rank 0 reported")


def test_a_save_past_its_deadline_is_dropped(coord, nodes):
    made = ready_job(coord, nodes)  # the nodes never answer
    t0 = time.monotonic()
    expect_error(S.DEADLINE_EXCEEDED, coord.ckpt.Save, C.SaveRequest(job="j"), timeout=2)
    assert time.monotonic() - t0 < 10
    wait_for(lambda: entries(coord.checkpoints / "j") == [], 10, "the temporary directory to go")
    wait_for(lambda: len(made[0].latest_assignment("j").saves) == 0, 10, "the order to go")
    for n in made:
        n.on_save = writes_shards(10)
    coord.ckpt.Save(C.SaveRequest(job="j"), timeout=30)


def test_one_order_at_a_time_and_a_lost_node_fails_it(coord, nodes):
    made = ready_job(coord, nodes)
    result = {}

    def save():
        try:
            coord.ckpt.Save(C.SaveRequest(job="j"), timeout=60)
            result["ok"] = True
        except grpc.RpcError as e:
            result["error"] = (e.code(), e.details())

    thread = threading.Thread(target=save)
    thread.start()
    wait_for(lambda: made[0].latest_assignment("j") is not None and
             len(made[0].latest_assignment("j").saves) == 1, 10, "the save order")
    expect_error(S.FAILED_PRECONDITION, coord.ckpt.Save, C.SaveRequest(job="j", name="x"),
                 timeout=10, fragment="has a save in flight")
    expect_error(S.FAILED_PRECONDITION, coord.ckpt.Restore,
                 C.RestoreRequest(job="j", checkpoint="x"), timeout=10, fragment="in flight")
    made[1].stop_heartbeats()  # its lease expires: the job degrades
    thread.join(timeout=30)
    code, details = result["error"]
    assert code == S.UNAVAILABLE, result
    assert "job 'j' is no longer ready (degraded: node 'n1' left the cluster" in details, details
    wait_for(lambda: entries(coord.checkpoints / "j") == [], 10, "the temporary directory to go")


def test_restore_reads_then_commits(coord, nodes):
    made = ready_job(coord, nodes, step=3)
    make_checkpoint(coord.checkpoints, "j", "good", step=77, world=2)
    for n in made:
        n.on_restore = restores_to(77)
    reply = coord.ckpt.Restore(C.RestoreRequest(job="j", checkpoint="good"), timeout=30)
    assert reply.step == 77 and reply.total_ms >= 0
    phases = [(a.restore.commit, a.restore.source, a.restore.format)
              for e in made[1].events for a in e.assignments if a.HasField("restore")]
    source = str(coord.checkpoints / "j" / "good")
    assert phases[0] == (False, source, C.RESTORE_FORMAT_CHECKPOINT), phases
    assert phases[-1][0] is True, phases
    wait_for(lambda: not made[0].latest_assignment("j").HasField("restore"), 10,
             "the order to go")


def test_a_rank_error_fails_the_restore_before_commit(coord, nodes):
    made = ready_job(coord, nodes)
    make_checkpoint(coord.checkpoints, "j", "good", step=5, world=2)
    made[0].on_restore = restores_to(5)
    made[1].on_restore = restores_to(5, errors={1: (15, "rank-00001-of-00002.zdshard: block 0: "
                                                        "checksum mismatch")})
    details = expect_error(S.DATA_LOSS, coord.ckpt.Restore,
                           C.RestoreRequest(job="j", checkpoint="good"), timeout=30)
    assert details.startswith("rank 1: rank-00001-of-00002.zdshard: block 0"), details
    commits = [a.restore.commit for e in made[0].events for a in e.assignments
               if a.HasField("restore")]
    assert True not in commits
    # The checkpoint is untouched.
    assert listed(coord, "j") == [("j", "good", 5)]


def test_a_checkpoint_being_restored_cannot_be_deleted(coord, nodes):
    ready_job(coord, nodes)  # the nodes never answer the restore
    make_checkpoint(coord.checkpoints, "j", "good", step=5, world=2)
    result = {}

    def restore():
        try:
            coord.ckpt.Restore(C.RestoreRequest(job="j", checkpoint="good"), timeout=4)
        except grpc.RpcError as e:
            result["code"] = e.code()

    thread = threading.Thread(target=restore)
    thread.start()
    time.sleep(1)
    expect_error(S.FAILED_PRECONDITION, coord.ckpt.Delete,
                 C.DeleteCheckpointRequest(job="j", name="good"), timeout=10,
                 fragment="is being restored from checkpoint 'j/good'")
    thread.join(timeout=30)
    assert result["code"] == S.DEADLINE_EXCEEDED

    def deleted():
        try:
            coord.ckpt.Delete(C.DeleteCheckpointRequest(job="j", name="good"), timeout=10)
            return True
        except grpc.RpcError as e:
            assert e.code() == S.FAILED_PRECONDITION, e  # until the server saw the deadline
            return False

    wait_for(deleted, 10, "the restore to end and the delete to succeed")


def test_periodic_checkpoints_keep_the_newest(coord, nodes):
    policy = C.CheckpointPolicy(every_steps=5, keep=2)
    made = ready_job(coord, nodes, nodes_count=1, step=0, checkpoint_policy=policy)
    job = tc.job_state(coord, "j")
    assert (job.checkpoint_policy.every_steps, job.checkpoint_policy.keep) == (5, 2)
    time.sleep(1)  # the schedule starts from the step the job has when first seen ready
    steps = {"now": 0}
    made[0].on_save = lambda a, order: writes_shards(steps["now"])(a, order)
    for step in (5, 10, 15):
        steps["now"] = step
        made[0].report("j", ready=True, step=step)
        wait_for(lambda: ("j", "auto-%08d" % step, step) in listed(coord, "j"), 20,
                 "auto-%08d" % step)
    wait_for(lambda: listed(coord, "j") == [("j", "auto-00000010", 10),
                                            ("j", "auto-00000015", 15)], 10,
             "the oldest periodic checkpoint to go")
    wait_for(lambda: entries(coord.checkpoints / "j") == ["auto-00000010", "auto-00000015"], 10,
             "its files to go")
    assert "periodic checkpoint saved" in coord.read_log()


# ---------------------------------------------------------------------------
# zerodctl
# ---------------------------------------------------------------------------

def ctl(coord, *args, timeout=60):
    env = dict(os.environ)
    env.pop("ZEROD_COORDINATOR", None)
    env.pop("GRPC_VERBOSITY", None)
    proc = subprocess.run([binary("zerodctl"), "--coordinator", coord.address] + list(args),
                          capture_output=True, text=True, timeout=timeout, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def test_zerodctl_checkpoint_commands(coord, nodes):
    made = ready_job(coord, nodes, step=42)
    for n in made:
        n.on_save = writes_shards(42)
    rc, out, err = ctl(coord, "checkpoint", "save", "j")
    assert rc == 0 and err == "", (rc, out, err)
    lines = out.splitlines()
    for line in ("job: j", "name: step-00000042", "step: 42", "size: 8.1 KiB", "stall: 20 ms"):
        assert line in lines, out
    assert any(line.startswith("total: ") for line in lines), out
    rc, out, err = ctl(coord, "--json", "checkpoint", "save", "j", "best")
    assert rc == 0 and err == "", (rc, out, err)
    saved = json.loads(out)
    assert saved["checkpoint"]["name"] == "best" and saved["checkpoint"]["step"] == 42
    # job_id is a 64-bit id: a string, the job's; counts are JSON integers.
    job_id = coord.jobs.GetJob(C.GetJobRequest(name="j"), timeout=10).id
    assert saved["checkpoint"]["job_id"] == str(job_id), saved
    for key in ("step", "world_size", "bytes", "created_unix_ms"):
        assert type(saved["checkpoint"][key]) is int, (key, saved)
    assert type(saved["stall_ms"]) is int and type(saved["total_ms"]) is int, saved
    assert saved["stall_ms"] == 20 and set(saved) == {"checkpoint", "stall_ms", "total_ms"}

    rc, out, err = ctl(coord, "checkpoint", "list")
    assert rc == 0 and err == "", (rc, out, err)
    table = out.splitlines()
    assert table[0].split() == ["JOB", "NAME", "STEP", "WORLD", "SIZE", "CREATED", "TENANT"], out
    assert [row.split()[:4] for row in table[1:]] == [["j", "best", "42", "2"],
                                                      ["j", "step-00000042", "42", "2"]], out
    rc, out, err = ctl(coord, "--json", "checkpoint", "list", "j")
    assert rc == 0 and [c["name"] for c in json.loads(out)["checkpoints"]] == [
        "best", "step-00000042"]

    for n in made:
        n.on_restore = restores_to(42)
    rc, out, err = ctl(coord, "checkpoint", "restore", "j", "best")
    assert rc == 0 and err == "" and out.startswith("restored job j from best: step 42 in "), out
    rc, out, err = ctl(coord, "--json", "checkpoint", "delete", "j", "best")
    assert (rc, err) == (0, "") and json.loads(out) == {"job": "j", "deleted": "best"}
    rc, out, err = ctl(coord, "checkpoint", "delete", "j", "step-00000042")
    assert (rc, out, err) == (0, "deleted checkpoint step-00000042 of job j\n", "")
    rc, out, err = ctl(coord, "--json", "checkpoint", "list")
    assert (rc, json.loads(out)) == (0, {"checkpoints": []})


def test_zerodctl_checkpoint_failures(coord, nodes, tmp_path):
    ready_job(coord, nodes, nodes_count=1)
    make_checkpoint(coord.checkpoints, "j", "short", shard_sizes=[100])
    rc, out, err = ctl(coord, "checkpoint", "restore", "j", "short")
    assert rc == 1 and out == "" and err == (
        "zerodctl: checkpoint restore: DATA_LOSS: %s: truncated: 100 of %d bytes\n" % (
            shard_name(0, 1), shard_bytes(1))), err
    rc, out, err = ctl(coord, "checkpoint", "save", "ghost")
    assert rc == 1 and err == "zerodctl: checkpoint save: NOT_FOUND: no job named 'ghost'\n", err
    rc, out, err = ctl(coord, "checkpoint", "delete", "j", "nope")
    assert rc == 1 and "NOT_FOUND" in err
    for args in (["checkpoint"], ["checkpoint", "frob"], ["checkpoint", "save"],
                 ["checkpoint", "save", "j", "auto-1"], ["checkpoint", "save", "j", "a.tmp-1"],
                 ["checkpoint", "delete", "j"], ["checkpoint", "restore", "j", "rel/a/b"],
                 ["checkpoint", "list", "bad name"], ["checkpoint", "list", "--nodes", "2"]):
        rc, out, err = ctl(coord, *args)
        assert rc == 2 and out == "" and len(err.splitlines()) == 1, (args, rc, out, err)


def test_zerodctl_jobs_create_with_a_checkpoint_policy(coord, nodes):
    nodes(coord, "n0")
    rc, out, err = ctl(coord, "jobs", "create", "p", "--checkpoint-every-steps", "100",
                       "--checkpoint-every-seconds", "600", "--checkpoint-keep", "3")
    assert rc == 0 and "checkpoints: every 100 steps or 600 s, keep 3" in out.splitlines(), out
    rc, out, err = ctl(coord, "--json", "jobs", "get", "p")
    assert json.loads(out)["checkpoint_policy"] == {"every_steps": 100, "every_seconds": 600,
                                                    "keep": 3, "redundancy": 0,
                                                    "redundancy_every_steps": 1}
    rc, out, err = ctl(coord, "jobs", "create", "q")
    assert rc == 0 and "checkpoints: off" in out.splitlines(), out
    rc, out, err = ctl(coord, "jobs", "create", "r", "--checkpoint-keep", "3")
    assert rc == 2 and "--checkpoint-keep needs" in err, err
    rc, out, err = ctl(coord, "jobs", "create", "r", "--checkpoint-every-steps", "0")
    assert rc == 2, err


def test_shutdown_fails_a_save_in_flight_and_removes_its_directory(coord, nodes):
    made = ready_job(coord, nodes)  # the nodes never answer
    result = {}
    channel = grpc.insecure_channel(coord.address)  # outlives coord.stop()'s channel

    def save():
        try:
            pb.control_grpc.CheckpointsStub(channel).Save(C.SaveRequest(job="j"), timeout=60)
        except grpc.RpcError as e:
            result["error"] = (e.code(), e.details())

    thread = threading.Thread(target=save)
    thread.start()
    wait_for(lambda: made[0].latest_assignment("j") is not None and
             len(made[0].latest_assignment("j").saves) == 1, 10, "the save order")
    assert len(entries(coord.checkpoints / "j")) == 1
    for n in made:
        n.close()
    coord.stop()  # SIGTERM: exits 0 without a sanitizer report
    thread.join(timeout=30)
    channel.close()
    assert result["error"] == (S.UNAVAILABLE, "coordinator shutting down"), result
    assert entries(coord.checkpoints / "j") == []


# ---------------------------------------------------------------------------
# Export (the files are the fake nodes' zeros, not shard files: the
# coordinator's part up to reading them; real exports: test_safetensors.py)
# ---------------------------------------------------------------------------

def test_export_refusals_before_anything_is_ordered(coord, nodes, tmp_path):
    made = ready_job(coord, nodes, nodes_count=1)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"taken")
    expect_error(S.ALREADY_EXISTS, coord.ckpt.Export, C.ExportRequest(job="j", path=str(out)),
                 timeout=10, fragment="overwrite")
    expect_error(S.NOT_FOUND, coord.ckpt.Export,
                 C.ExportRequest(job="j", path=str(tmp_path / "none" / "x.safetensors")),
                 timeout=10, fragment="no such directory")
    expect_error(S.INVALID_ARGUMENT, coord.ckpt.Export,
                 C.ExportRequest(job="j", path=str(tmp_path), overwrite=True), timeout=10,
                 fragment="is a directory")
    expect_error(S.NOT_FOUND, coord.ckpt.Export,
                 C.ExportRequest(job="ghost", path=str(tmp_path / "g.safetensors")), timeout=10,
                 fragment="no job named 'ghost'")
    expect_error(S.NOT_FOUND, coord.ckpt.Export,
                 C.ExportRequest(job="j", checkpoint="nope", path=str(tmp_path / "n.safetensors")),
                 timeout=10, fragment="no checkpoint at")
    assert_no_order_was_sent(made[0], "j")
    assert out.read_bytes() == b"taken"
    assert entries(coord.checkpoints / "j") == []


def test_export_of_a_live_job_saves_into_a_temporary_directory_and_removes_it(coord, nodes,
                                                                              tmp_path):
    made = ready_job(coord, nodes)
    for n in made:
        n.on_save = writes_shards(10)
    out = tmp_path / "live.safetensors"
    # The fake shards are zeros: the save completes, the export's reading
    # refuses them (no shard header), and nothing is left anywhere.
    expect_error(S.DATA_LOSS, coord.ckpt.Export, C.ExportRequest(job="j", path=str(out)),
                 timeout=30, fragment="export to %s failed" % out)
    orders = [o for e in made[0].events for a in e.assignments for o in a.saves]
    assert orders and orders[0].dir.startswith(str(coord.checkpoints / "j" / "export.tmp-"))
    wait_for(lambda: entries(coord.checkpoints / "j") == [], 10, "the temporary directory to go")
    assert listed(coord, "j") == []
    assert not out.exists() and not (tmp_path / "live.safetensors.tmp").exists()
    # A rank's error fails the export as it fails a save; the job is free after.
    made[1].on_save = writes_shards(10, errors={1: (8, "No space left on device")})
    expect_error(S.RESOURCE_EXHAUSTED, coord.ckpt.Export, C.ExportRequest(job="j", path=str(out)),
                 timeout=30, fragment="rank 1: No space left on device")
    wait_for(lambda: entries(coord.checkpoints / "j") == [], 10, "the temporary directory to go")
    made[1].on_save = writes_shards(10)
    coord.ckpt.Save(C.SaveRequest(job="j", name="after"), timeout=30)
    assert listed(coord, "j") == [("j", "after", 10)]
