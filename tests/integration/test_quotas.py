"""Quotas (docs/security.md, "Quotas"), against a real coordinator and node.

- A tenant's quotas (the principals file's quota line): a job over its
  jobs, sessions or byte quotas is refused RESOURCE_EXHAUSTED naming the
  quota, and no job is made; a job that leaves unset a per-job quota its
  tenant's limit needs is refused INVALID_ARGUMENT.
- A job's quotas on its node: a unit whose shard state would pass
  max_host_bytes is refused naming it, and nothing is published (the same
  name registers afterwards with another layout); a session over
  max_sessions is refused naming it.
"""

import grpc

import zdraw as z
from test_security import Caller, token_file, wait_for, write_principals

OWNER = "quota-owner-token"
KIB = 1024


def create(c, name, nodes=1, ranks=1, **quotas):
    pb = c.pb
    return c.call(c.jobs.CreateJob, pb.CreateJobRequest(
        name=name, nodes=nodes, ranks_per_node=ranks, token=OWNER,
        quotas=pb.Quotas(**quotas) if quotas else None))


def wait_all_ready(admin):
    """Every job built on its node (a node stopped while a job's Gloo
    communicator is still connecting waits out the collective timeout)."""
    pb = admin.pb
    wait_for(lambda: all(j.state == pb.JOB_STATE_READY for j in admin.call(
        admin.jobs.ListJobs, pb.ListJobsRequest())[1].jobs), "every job to be ready")


def test_tenant_quotas(cluster, tmp_path):
    principals = write_principals(tmp_path / "principals", [
        "quota team-a jobs=2 host-bytes=1M sessions=3",
        "quota team-b jobs=0"])
    coord = cluster.start_coordinator(extra=["--auth-file", str(principals)])
    cluster.start_node("node-a", ranks=2,
                       extra=["--auth-token-file", token_file(tmp_path, "node-a")])
    channel = grpc.insecure_channel(coord.address)
    alice, bob, admin = (Caller(channel, who) for who in ("alice", "bob", "admin"))
    pb = admin.pb
    wait_for(lambda: len(admin.call(admin.cluster.GetView, pb.GetViewRequest())[1].members) == 1,
             "node-a to join")

    def jobs():
        return sorted(j.name for j in admin.call(admin.jobs.ListJobs, pb.ListJobsRequest())[1].jobs)

    # A per-job quota the tenant's limit needs must be set.
    code, _, details = create(alice, "a0", max_sessions=1)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "quotas.max_host_bytes" in details, details
    code, _, details = create(alice, "a0", max_host_bytes=256 * KIB)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_sessions" in details, details
    # 2 ranks x 256 KiB = 512 KiB of the 1 MiB; 2 of the 3 sessions.
    code, reply, details = create(alice, "a1", ranks=2, max_host_bytes=256 * KIB, max_sessions=2)
    assert code == grpc.StatusCode.OK, details
    # 2 x 384 KiB more would be 1.25 MiB.
    code, _, details = create(alice, "a2", ranks=2, max_host_bytes=384 * KIB, max_sessions=1)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "host-bytes quota is 1048576" in details and "use 524288" in details, details
    # 2 more sessions would be 4 of 3.
    code, _, details = create(alice, "a2", ranks=2, max_host_bytes=128 * KIB, max_sessions=2)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "sessions quota is 3" in details
    code, _, details = create(alice, "a2", ranks=2, max_host_bytes=128 * KIB, max_sessions=1)
    assert code == grpc.StatusCode.OK, details
    # The third job of a tenant allowed two.
    code, _, details = create(alice, "a3", max_host_bytes=KIB, max_sessions=1)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "jobs quota is 2" in details, details
    code, _, details = create(bob, "b1")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "team-b's jobs quota is 0" in details
    assert jobs() == ["a1", "a2"]
    # A deleted job gives its share back.
    assert alice.call(alice.jobs.DeleteJob, pb.DeleteJobRequest(name="a1"))[0] == \
        grpc.StatusCode.OK
    wait_for(lambda: jobs() == ["a2"], "a1 to be gone")
    code, _, details = create(alice, "a3", ranks=2, max_host_bytes=384 * KIB, max_sessions=2)
    assert code == grpc.StatusCode.OK, details
    # An admin's job of no tenant counts against nobody.
    assert create(admin, "free", ranks=2)[0] == grpc.StatusCode.OK
    wait_all_ready(admin)
    channel.close()


def test_tenant_byte_quotas_of_each_kind(cluster, tmp_path):
    principals = write_principals(tmp_path / "principals", [
        "quota team-a device-bytes=1G live-bytes=64M"])
    coord = cluster.start_coordinator(extra=["--auth-file", str(principals)])
    cluster.start_node("node-a", ranks=2,
                       extra=["--auth-token-file", token_file(tmp_path, "node-a")])
    channel = grpc.insecure_channel(coord.address)
    alice = Caller(channel, "alice")
    pb = alice.pb
    wait_for(lambda: len(alice.call(alice.cluster.GetView, pb.GetViewRequest())[1].members) == 1,
             "node-a to join")
    mib = 1024 * 1024
    code, _, details = create(alice, "d1", ranks=2, max_device_bytes=256 * mib,
                              max_live_bytes=16 * mib)
    assert code == grpc.StatusCode.OK, details
    code, _, details = create(alice, "d2", ranks=2, max_device_bytes=512 * mib,
                              max_live_bytes=8 * mib)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "device-bytes quota" in details, details
    code, _, details = create(alice, "d2", ranks=2, max_device_bytes=128 * mib,
                              max_live_bytes=32 * mib)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "live-bytes quota" in details, details
    # The job's config may carry the live budget instead of its quotas.
    code, _, details = alice.call(alice.jobs.CreateJob, pb.CreateJobRequest(
        name="d2", nodes=1, ranks_per_node=2, quotas=pb.Quotas(max_device_bytes=128 * mib),
        config=alice.ipc.JobConfig(max_live_bytes=8 * mib)))
    assert code == grpc.StatusCode.OK, details
    names = [j.name for j in alice.call(alice.jobs.ListJobs, pb.ListJobsRequest())[1].jobs]
    assert names == ["d1", "d2"]
    wait_all_ready(alice)
    channel.close()


def test_job_quotas_on_the_node(cluster, tmp_path):
    cluster.start_coordinator()
    node = cluster.start_node("node-q", ranks=2)
    channel = grpc.insecure_channel(cluster.coordinator.address)
    admin = Caller(channel, None)  # no principals configured: every caller is trusted
    pb = admin.pb
    wait_for(lambda: len(admin.call(admin.cluster.GetView, pb.GetViewRequest())[1].members) == 1,
             "node-q to join")
    # AdamW keeps 16 bytes per element (master, gradient, two moments):
    # 64 KiB is 4096 elements of one rank's shard.
    code, _, details = create(admin, "q", ranks=1, max_host_bytes=64 * KIB, max_sessions=1)
    assert code == grpc.StatusCode.OK, details
    wait_for(lambda: admin.call(admin.jobs.GetJob, pb.GetJobRequest(name="q"))[1].state
             == pb.JOB_STATE_READY, "job q to be ready")

    conn = z.Conn(node.socket)
    t, fields, _ = conn.call(z.ATTACH, z.attach_request("q", 0, create=False, token=OWNER))
    assert t == z.ATTACH_REPLY, z.message_of(fields)
    conn.expect_ok(z.REGISTER_UNIT, z.register_request("small", [("w", (2048,))]))
    t, fields, _ = conn.call(z.REGISTER_UNIT, z.register_request("big", [("w", (4096,))]))
    assert t == z.ERROR and z.status_of(fields) == "RESOURCE_EXHAUSTED", z.message_of(fields)
    message = z.message_of(fields)
    assert "max_host_bytes" in message and "65536" in message and "32768 in use" in message, \
        message
    # Nothing of 'big' was published: the name takes another layout.
    fields, _ = conn.expect_ok(z.REGISTER_UNIT, z.register_request("big", [("w", (1024,))]))
    # A second session on the node is over max_sessions=1 (the job has one
    # rank here; a read-only session counts too).
    other = z.Conn(node.socket)
    t, fields, _ = other.call(z.ATTACH, z.read_only_attach_request("q", token=OWNER))
    assert t == z.ERROR and z.status_of(fields) == "RESOURCE_EXHAUSTED"
    assert "max_sessions quota (1)" in z.message_of(fields), z.message_of(fields)
    other.close()
    conn.close()
    channel.close()
