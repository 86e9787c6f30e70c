"""Checkpoints belong to the tenant and the job (by id) that saved them, and
keep that owner after the job is deleted (docs/checkpoints.md,
"Ownership"): tried as tenant B would try to reach tenant A's weights.

- A deletes job 'shared-name' after saving 'secret': the directory moves
  to shared-name@<id>. B cannot list, export, restore or delete it, by
  any name, whether or not B then makes a job 'shared-name' itself; its
  refusals say NOT_FOUND, as for a checkpoint that does not exist. A (and
  A's reader, for reading) still reach it; A deletes it, and the record
  goes with it.
- The reverse: what B leaves under the name never shows in A's new job.
- A coordinator restart keeps the owners (the state file's records), even
  for a manifest that names no tenant.
- A directory that was not moved aside (from before this version, or a
  move that could not happen) is still read by owner.
- --retain-deleted-checkpoints removes a deleted job's checkpoints after
  that long, and forgets them.
"""

import json
import shutil
import time

import grpc
import pytest

import ctlproto
from test_security import TOKENS, Caller, token_file, wait_for, write_principals

OK = grpc.StatusCode.OK
NOT_FOUND = grpc.StatusCode.NOT_FOUND
DENIED = grpc.StatusCode.PERMISSION_DENIED


class World:
    """A coordinator with principals and an export root, node-a joined."""

    def __init__(self, cluster, tmp_path, extra=()):
        self.tmp_path = tmp_path
        principals = write_principals(tmp_path / "principals")
        self.exports = tmp_path / "exports"
        self.exports.mkdir(exist_ok=True)
        self.extra = ["--auth-file", str(principals), "--export-root", str(self.exports)] + \
            list(extra)
        self.cluster = cluster
        self.coord = cluster.start_coordinator(extra=self.extra)
        self.node = cluster.start_node(
            "node-a", ranks=1, extra=["--auth-token-file", token_file(tmp_path, "node-a")])
        self.connect()
        self.pb = self.admin.pb
        self.ckpt_dir = self.coord.state_dir / "checkpoints"
        wait_for(lambda: self.members() == ["node-a"], "node-a to join")

    def connect(self):
        self.channel = grpc.insecure_channel(self.coord.address)
        for who in ("admin", "alice", "bob", "ann"):
            setattr(self, who, Caller(self.channel, who))

    def members(self):
        code, view, _ = self.admin.call(self.admin.cluster.GetView, self.admin.pb.GetViewRequest())
        return [m.node.name for m in view.members] if code == OK else []

    def restart_coordinator(self):
        self.channel.close()
        self.coord.stop()
        self.coord.start()
        self.connect()
        wait_for(lambda: self.members() == ["node-a"], "node-a to join again")

    def job(self, name):
        code, job, _ = self.admin.call(self.admin.jobs.GetJob, self.pb.GetJobRequest(name=name))
        return job if code == OK else None

    def create_ready(self, who, name):
        code, reply, details = who.call(who.jobs.CreateJob, self.pb.CreateJobRequest(
            name=name, nodes=1, ranks_per_node=1))
        assert code == OK, details
        wait_for(lambda: (self.job(name) or self.pb.Job()).state == self.pb.JOB_STATE_READY,
                 "job %s to be ready" % name)
        return reply.job.id

    def save(self, who, job, name):
        code, reply, details = who.call(who.ckpt.Save, self.pb.SaveRequest(job=job, name=name),
                                        timeout=60)
        assert code == OK, details
        return reply.checkpoint

    def delete_job(self, who, name):
        code, _, details = who.call(who.jobs.DeleteJob, self.pb.DeleteJobRequest(name=name))
        assert code == OK, details
        wait_for(lambda: self.job(name) is None, "job %s to be gone" % name)

    def listed(self, who, job=""):
        code, reply, details = who.call(who.ckpt.List, self.pb.ListCheckpointsRequest(job=job))
        assert code == OK, details
        return [(c.job, c.name, c.tenant) for c in reply.checkpoints]

    def export(self, who, job, checkpoint, path):
        return who.call(who.ckpt.Export, self.pb.ExportRequest(
            job=job, checkpoint=checkpoint, path=path), timeout=60)

    def restore(self, who, job, checkpoint):
        return who.call(who.ckpt.Restore, self.pb.RestoreRequest(job=job, checkpoint=checkpoint),
                        timeout=60)

    def delete(self, who, job, name):
        return who.call(who.ckpt.Delete, self.pb.DeleteCheckpointRequest(job=job, name=name))

    def close(self):
        self.channel.close()


@pytest.fixture
def world(cluster, tmp_path):
    w = World(cluster, tmp_path)
    yield w
    w.close()


def refused_as_missing(result):
    code, _, details = result
    assert code == NOT_FOUND, (code, details)
    assert "secret" in details or "no checkpoint" in details, details
    return details


def test_a_deleted_jobs_checkpoints_stay_with_their_tenant(world):
    w = world
    a_id = w.create_ready(w.alice, "shared-name")
    w.save(w.alice, "shared-name", "secret")
    w.delete_job(w.alice, "shared-name")
    moved = "shared-name@%d" % a_id
    wait_for(lambda: (w.ckpt_dir / moved / "secret" / "manifest.json").exists(),
             "the directory to move aside")
    assert not (w.ckpt_dir / "shared-name").exists()
    manifest = json.loads((w.ckpt_dir / moved / "secret" / "manifest.json").read_text())
    assert (manifest["format_version"], manifest["tenant"], manifest["job_id"]) == (
        3, "team-a", a_id)

    # B, by every name, with no job of that name.
    for ref in ("secret", moved + "/secret"):
        refused_as_missing(w.export(w.bob, "shared-name", ref, "team-b/stolen.safetensors"))
    assert not (w.exports / "team-b" / "stolen.safetensors").exists()
    assert w.listed(w.bob) == [] and w.listed(w.bob, "shared-name") == []
    assert w.listed(w.bob, moved) == []
    refused_as_missing(w.delete(w.bob, moved, "secret"))

    # B makes a job of the same name: it inherits nothing.
    b_id = w.create_ready(w.bob, "shared-name")
    assert b_id != a_id
    assert w.listed(w.bob, "shared-name") == []
    for ref in ("secret", moved + "/secret"):
        refused_as_missing(w.restore(w.bob, "shared-name", ref))
        refused_as_missing(w.export(w.bob, "shared-name", ref, "team-b/stolen.safetensors"))
    refused_as_missing(w.delete(w.bob, "shared-name", "secret"))
    refused_as_missing(w.delete(w.bob, moved, "secret"))
    assert (w.ckpt_dir / moved / "secret" / "manifest.json").exists()

    # A and its reader still reach it; the admin sees whose it is. (The
    # job 'shared-name' is bob's now: listing it by that name is his.)
    assert w.listed(w.alice) == [(moved, "secret", "team-a")]
    assert w.listed(w.ann, moved) == [(moved, "secret", "team-a")]
    code, _, _ = w.alice.call(w.alice.ckpt.List, w.pb.ListCheckpointsRequest(job="shared-name"))
    assert code == DENIED
    assert (moved, "secret", "team-a") in w.listed(w.admin)
    code, reply, details = w.export(w.alice, "shared-name", moved + "/secret",
                                    "team-a/kept.safetensors")
    assert code == OK, details
    assert (w.exports / "team-a" / "kept.safetensors").stat().st_size > 0
    w.create_ready(w.alice, "a2")
    code, _, details = w.restore(w.alice, "a2", moved + "/secret")
    assert code == OK, details
    code, _, details = w.delete(w.ann, moved, "secret")
    assert code == DENIED and "may not delete" in details, details
    # The last checkpoint deleted, the directory and the record go.
    code, _, details = w.delete(w.alice, moved, "secret")
    assert code == OK, details
    wait_for(lambda: not (w.ckpt_dir / moved).exists(), "the emptied directory to go")
    w.restart_coordinator()
    assert w.listed(w.admin, moved) == []


def test_what_another_tenant_left_never_shows_in_a_new_job(world):
    w = world
    b_id = w.create_ready(w.bob, "shared-name")
    w.save(w.bob, "shared-name", "planted")
    w.delete_job(w.bob, "shared-name")
    w.create_ready(w.alice, "shared-name")
    assert w.listed(w.alice, "shared-name") == []
    assert w.listed(w.alice) == []
    refused_as_missing(w.restore(w.alice, "shared-name", "planted"))
    # The name of bob's checkpoint is free in alice's job.
    w.save(w.alice, "shared-name", "planted")
    assert w.listed(w.alice, "shared-name") == [("shared-name", "planted", "team-a")]
    assert w.listed(w.bob) == [("shared-name@%d" % b_id, "planted", "team-b")]


def test_owners_survive_a_restart_from_the_state_file(world):
    w = world
    a_id = w.create_ready(w.alice, "gone")
    w.save(w.alice, "gone", "secret")
    w.delete_job(w.alice, "gone")
    moved = w.ckpt_dir / ("gone@%d" % a_id)
    wait_for(lambda: moved.exists(), "the directory to move aside")
    # Made a version 1 manifest, which names no tenant: the owner can come
    # only from the coordinator's record of the deleted job.
    path = moved / "secret" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["tenant"]
    manifest["format_version"] = 1
    path.write_text(json.dumps(manifest))
    w.restart_coordinator()
    assert w.listed(w.alice) == [(moved.name, "secret", "team-a")]
    assert w.listed(w.bob) == []
    refused_as_missing(w.export(w.bob, "gone", moved.name + "/secret",
                                "team-b/stolen.safetensors"))
    # A new job gets an id that no deleted job's directory has.
    assert w.create_ready(w.bob, "gone") > a_id


def test_a_directory_not_moved_aside_is_still_read_by_owner(world):
    w = world
    a_id = w.create_ready(w.alice, "a-job")
    w.save(w.alice, "a-job", "mine")
    b_id = w.create_ready(w.bob, "b-job")
    # A checkpoint of team-a's in b-job's directory, as a directory from
    # before this version could hold one.
    shutil.copytree(w.ckpt_dir / "a-job" / "mine", w.ckpt_dir / "b-job" / "planted")
    assert w.listed(w.bob, "b-job") == []
    refused_as_missing(w.restore(w.bob, "b-job", "planted"))
    refused_as_missing(w.delete(w.bob, "b-job", "planted"))
    assert ("b-job", "planted", "team-a") in w.listed(w.admin)
    # A version 1 manifest of a job the coordinator does not know: no
    # owner is known, so an admin's alone.
    orphan = w.ckpt_dir / "b-job" / "orphan"
    shutil.copytree(w.ckpt_dir / "a-job" / "mine", orphan)
    manifest = json.loads((orphan / "manifest.json").read_text())
    del manifest["tenant"]
    manifest.update(format_version=1, job_id=a_id + b_id + 100)
    (orphan / "manifest.json").write_text(json.dumps(manifest))
    assert w.listed(w.alice) == [("a-job", "mine", "team-a"), ("b-job", "planted", "team-a")]
    assert w.listed(w.bob) == []
    assert ("b-job", "orphan", "") in w.listed(w.admin)
    # A job whose directory cannot move (the target exists) is deleted all
    # the same, its name is free again, and the checkpoints stay by owner.
    (w.ckpt_dir / ("a-job@%d" % a_id)).mkdir()
    w.delete_job(w.alice, "a-job")
    wait_for(lambda: "target exists" in w.coord.read_log(), "the move to be tried")
    w.create_ready(w.bob, "a-job")
    assert w.listed(w.bob, "a-job") == []
    assert ("a-job", "mine", "team-a") in w.listed(w.alice)


def test_retention_removes_a_deleted_jobs_checkpoints(cluster, tmp_path):
    w = World(cluster, tmp_path, extra=["--retain-deleted-checkpoints", "3s"])
    try:
        a_id = w.create_ready(w.alice, "brief")
        w.save(w.alice, "brief", "c1")
        w.save(w.alice, "brief", "c2")
        deleted_at = time.monotonic()
        w.delete_job(w.alice, "brief")
        moved = w.ckpt_dir / ("brief@%d" % a_id)
        wait_for(lambda: moved.exists(), "the directory to move aside")
        assert [c[1] for c in w.listed(w.alice)] == ["c1", "c2"]
        # Renamed to brief@<id>.deleting-<n>, then removed: both gone.
        wait_for(lambda: not any(p.name.startswith("brief@") for p in w.ckpt_dir.iterdir()),
                 "retention to remove them", timeout_s=20)
        assert time.monotonic() - deleted_at >= 2.5
        assert w.listed(w.admin) == []
        assert "past --retain-deleted-checkpoints" in w.coord.read_log()
    finally:
        w.close()
