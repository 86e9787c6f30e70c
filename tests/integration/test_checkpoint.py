"""Checkpoints end to end (docs/architecture.md, docs/checkpoints.md): real
standalone daemons, real workers (zerod-mlp-train), the Checkpoints service
over gRPC from the .proto files, and the files on disk read back here.

The files are read with a small reader of the format written in this file
(header, data, block table, footer; manifest.json), so what is compared is
what is on disk: master weights and optimizer state, bit for bit.
"""

import json
import os
import struct
import subprocess
import time

import grpc
import pytest

import ctlproto
from conftest import binary, run_worker

HEADER = 4096


def stub(daemon):
    pb = ctlproto.load()
    channel = grpc.insecure_channel("unix:%s/control.sock" % daemon.dir)
    return pb, pb.control_grpc.CheckpointsStub(channel), pb.control_grpc.JobsStub(channel)


def wait_ready(daemon, job, timeout_s=20):
    pb, _, jobs = stub(daemon)
    deadline = time.monotonic() + timeout_s
    while True:
        j = jobs.GetJob(pb.control.GetJobRequest(name=job), timeout=10)
        if j.state == pb.control.JOB_STATE_READY:
            return j
        if time.monotonic() > deadline:
            raise AssertionError("job %s not ready: %s %s" % (job, j.state, j.reason))
        time.sleep(0.05)


def save(daemon, job, name="", timeout=120):
    wait_ready(daemon, job)  # a job made by an attach is ready once its node has reported
    pb, ck, _ = stub(daemon)
    return ck.Save(pb.control.SaveRequest(job=job, name=name), timeout=timeout)


def restore(daemon, job, checkpoint, timeout=120):
    pb, ck, _ = stub(daemon)
    return ck.Restore(pb.control.RestoreRequest(job=job, checkpoint=checkpoint), timeout=timeout)


def listed(daemon, job=""):
    pb, ck, _ = stub(daemon)
    return ck.List(pb.control.ListCheckpointsRequest(job=job), timeout=30).checkpoints


def job_step(daemon, job):
    pb, _, jobs = stub(daemon)
    return jobs.GetJob(pb.control.GetJobRequest(name=job), timeout=10).step


def wait_step(daemon, job, step, timeout_s=20):
    """Waits until GetJob says `step`: the node reports it in its next
    heartbeat (every lease TTL / 3, 3.3 s in a standalone daemon)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = job_step(daemon, job)
        if got == step:
            return
        if time.monotonic() > deadline:
            raise AssertionError("GetJob says step %d, expected %d" % (got, step))
        time.sleep(0.1)


def train(daemon, ranks, job, steps, extra=(), background=False):
    args = [binary("zerod-mlp-train"), "--socket", daemon.socket, "--job", job, "--steps",
            str(steps), "--hidden", "64", "--batch", "8"] + list(extra)
    procs = [subprocess.Popen(args + ["--local-rank", str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    if background:
        return procs
    return finish(procs)


def finish(procs):
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, "worker exited %d: %s%s" % (p.returncode, out, err)
        outs.append(out)
    return outs[0]


def load_checkpoint(path):
    """{unit name: {state: full fp32 values as bytes (numel elements)}}, and the manifest."""
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    states = manifest["states"]
    world = manifest["world_size"]
    files = [open(os.path.join(path, f["name"]), "rb").read() for f in manifest["files"]]
    for f, entry in zip(files, manifest["files"]):
        assert len(f) == entry["bytes"]
    out = {}
    offset = 0
    for unit in manifest["units"]:
        shard_bytes = unit["shard_numel"] * 4
        out[unit["name"]] = {}
        for k, state in enumerate(states):
            at = HEADER + offset + k * shard_bytes
            full = b"".join(files[r][at:at + shard_bytes] for r in range(world))
            out[unit["name"]][state] = full[:unit["numel"] * 4]
        offset += shard_bytes * len(states)
    return manifest, out


def test_round_trip_is_bit_exact(start_daemon, tmp_path):
    d = start_daemon(ranks=2)
    train(d, 2, "rt", 10)
    first = save(d, "rt", "after10")
    assert first.checkpoint.step == 10 and first.checkpoint.world_size == 2
    train(d, 2, "rt", 10)
    second = save(d, "rt", "after20")
    assert second.checkpoint.step == 20
    names = [c.name for c in listed(d, "rt")]
    assert names == ["after10", "after20"]

    reply = restore(d, "rt", "after10")
    assert reply.step == 10
    train(d, 2, "rt", 10)
    third = save(d, "rt", "replayed")
    assert third.checkpoint.step == 20
    m2, want = load_checkpoint(second.checkpoint.path)
    m3, got = load_checkpoint(third.checkpoint.path)
    assert m2["states"] == ["master", "moment1", "moment2"]
    assert got == want  # master weights and both Adam moments, bit for bit


def test_get_job_step_counts_completed_steps_across_a_restore(start_daemon):
    # JobStatus.step is completed optimizer steps, not the rank's version
    # (which the restore moves up too): after a restore it is the
    # checkpoint's step, and training goes on counting from there.
    d = start_daemon(ranks=2)
    train(d, 2, "steps", 4)
    wait_step(d, "steps", 4)
    assert save(d, "steps", "at4").checkpoint.step == 4
    train(d, 2, "steps", 3)
    wait_step(d, "steps", 7)
    assert restore(d, "steps", "at4").step == 4
    assert job_step(d, "steps") == 4
    out = train(d, 2, "steps", 2)
    assert "done: 2 steps" in out
    wait_step(d, "steps", 6)


def test_save_while_training_and_restore(start_daemon):
    d = start_daemon(ranks=2)
    procs = train(d, 2, "live", 400, background=True)
    time.sleep(1.0)
    reply = save(d, "live", "")
    finish(procs)
    step = reply.checkpoint.step
    assert 0 < step <= 400
    assert reply.checkpoint.name == "step-%08d" % step
    assert reply.stall_ms <= reply.total_ms
    restore(d, "live", reply.checkpoint.name)
    again = save(d, "live", "check")
    assert again.checkpoint.step == step
    assert load_checkpoint(again.checkpoint.path)[1] == load_checkpoint(reply.checkpoint.path)[1]


@pytest.mark.parametrize("ranks", [3, 2, 1])
def test_reshard_from_four_ranks(start_daemon, tmp_path, ranks):
    shared = tmp_path / "checkpoints"
    src = start_daemon(ranks=4, extra=["--checkpoint-dir", str(shared)])
    train(src, 4, "big", 5)
    saved = save(src, "big", "four").checkpoint
    src.stop()
    _, want = load_checkpoint(saved.path)

    dst = start_daemon(ranks=ranks, extra=["--checkpoint-dir", str(shared)])
    pb, _, jobs = stub(dst)
    jobs.CreateJob(pb.control.CreateJobRequest(name="big", nodes=1, ranks_per_node=ranks,
                                               token="tok"), timeout=30)
    wait_ready(dst, "big")
    assert restore(dst, "big", saved.path).step == 5
    resaved = save(dst, "big", "resharded").checkpoint
    assert resaved.world_size == ranks
    assert load_checkpoint(resaved.path)[1] == want
    # Workers attach to the restored units and train on.
    out = train(dst, ranks, "big", 2,
                extra=["--no-create", "--token", "tok", "--batch", str(4 * ranks)])
    assert "done: 2 steps" in out


def test_corrupt_checkpoint_is_refused_and_changes_nothing(start_daemon):
    d = start_daemon(ranks=2)
    train(d, 2, "bad", 3)
    good = save(d, "bad", "good").checkpoint
    train(d, 2, "bad", 2)
    later = save(d, "bad", "later").checkpoint
    _, before = load_checkpoint(later.path)
    path = os.path.join(good.path, "rank-00001-of-00002.zdshard")
    data = bytearray(open(path, "rb").read())
    data[HEADER + 100] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(grpc.RpcError) as e:
        restore(d, "bad", "good")
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    assert "rank-00001-of-00002.zdshard" in e.value.details()
    # Truncated: refused before any rank reads.
    open(path, "wb").write(bytes(data[:len(data) // 2]))
    with pytest.raises(grpc.RpcError) as e:
        restore(d, "bad", "good")
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    assert "truncated" in e.value.details()
    # The job is as it was: saving again gives the same state.
    assert load_checkpoint(save(d, "bad", "after").checkpoint.path)[1] == before


def test_restore_refused_while_workers_attached(start_daemon):
    d = start_daemon(ranks=1)
    train(d, 1, "busy", 2)
    save(d, "busy", "c")
    procs = train(d, 1, "busy", 10 ** 7, background=True)
    deadline = time.monotonic() + 20
    while d.read_log().count('msg="worker attached"') < 2:
        assert time.monotonic() < deadline, d.read_log()
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as e:
        restore(d, "busy", "c")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "attached" in e.value.details()
    for p in procs:
        p.kill()
        p.wait()
