"""The coordinator, black box: a real `zerod coordinator` process driven over
gRPC by fake nodes and operators that use only the .proto files (ctlproto).

Every test starts its own coordinator on a free loopback port with its own
state directory. At teardown the coordinator gets SIGTERM and must exit 0
without a sanitizer report. Timing assertions are loose on purpose: the
machines that run this are small and shared.
"""

import hashlib
import os
import queue
import re
import signal
import subprocess
import threading
import time

import grpc
import pytest

import ctlproto
import conftest
from conftest import binary

pb = ctlproto.load()
C = pb.control
S = grpc.StatusCode

TTL_S = 2.0  # lease TTL of the coordinators under test


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------

class Coordinator(conftest.Coordinator):
    """conftest's coordinator with grpcio stubs on its address."""

    def __init__(self, tmp_path, ttl_s=TTL_S, state_dir=None, extra=()):
        self.channel = None
        super().__init__(tmp_path, lease_ttl_s=ttl_s, state_dir=state_dir, extra=extra)

    def start(self):
        super().start()
        self.channel = grpc.insecure_channel(self.address)
        self.cluster = pb.control_grpc.ClusterStub(self.channel)
        self.jobs = pb.control_grpc.JobsStub(self.channel)
        self.kv = pb.control_grpc.RendezvousStub(self.channel)
        self.health = pb.health_grpc.HealthStub(self.channel)

    def kill(self):
        self.channel.close()
        super().kill()

    def stop(self):
        self.channel.close()
        super().stop()


@pytest.fixture
def coordinator(tmp_path):
    started = []

    def start(ttl_s=TTL_S, state_dir=None):
        d = Coordinator(tmp_path, ttl_s, state_dir)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def coord(coordinator):
    return coordinator()


class WatchStream:
    """One Watch call, read by a thread into a queue (None marks its end)."""

    def __init__(self, call, name):
        self.call = call
        self.name = name
        self.events = queue.Queue()
        self.end = None  # (code, details) once the stream ended
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for event in self.call:
                self.events.put(event)
            self.end = (S.OK, "")
        except grpc.RpcError as e:
            self.end = (e.code(), e.details())
        self.events.put(None)

    def next_event(self, timeout=15):
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("node %s got no watch event in %ss" % (self.name, timeout))

    def event_where(self, predicate, timeout=20):
        """Reads events until one satisfies predicate; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("node %s: no matching watch event" % self.name)
            event = self.next_event(left)
            if event is None:
                raise AssertionError("node %s: watch ended %s" % (self.name, self.end))
            if predicate(event):
                return event

    def wait_end(self, timeout=15):
        wait_for(lambda: self.end is not None, timeout, "node %s's watch to end" % self.name)
        return self.end


class FakeNode:
    """A node as the coordinator sees it: joins, heartbeats from a thread with
    its job reports, and (optionally) watches, collecting events."""

    def __init__(self, coord, name, ranks=2):
        self.coord = coord
        self.name = name
        self.ranks = ranks
        self.reports = {}  # job -> (ready, error, step)
        self.beating = threading.Event()
        self.stopped = threading.Event()
        self.thread = None
        self.heartbeat_errors = queue.Queue()
        self.lock = threading.Lock()
        self.w = None  # the latest WatchStream
        self.join()

    def join(self):
        reply = self.coord.cluster.Join(C.JoinRequest(node=C.NodeInfo(
            name=self.name, address="127.0.0.1", ranks=self.ranks, version="test")), timeout=10)
        self.session = reply.session
        return reply

    def heartbeat(self):
        with self.lock:
            jobs = [C.JobStatus(job=j, ready=r, error=e, step=s)
                    for j, (r, e, s) in sorted(self.reports.items())]
        return self.coord.cluster.Heartbeat(
            C.HeartbeatRequest(node=self.name, session=self.session, jobs=jobs), timeout=10)

    def start_heartbeats(self):
        self.beating.set()
        if self.thread is None:
            self.thread = threading.Thread(target=self._beat, daemon=True)
            self.thread.start()

    def stop_heartbeats(self):
        self.beating.clear()

    def _beat(self):
        while not self.stopped.is_set():
            if self.beating.is_set():
                try:
                    self.heartbeat()
                except grpc.RpcError as e:
                    self.heartbeat_errors.put(e.code())
            self.stopped.wait(self.coord.lease_ttl_s / 8)

    def report(self, job, ready=True, error="", step=0):
        with self.lock:
            self.reports[job] = (ready, error, step)

    def unreport(self, job):
        with self.lock:
            del self.reports[job]

    def watch(self):
        """Opens a Watch (replacing self.w) and returns its first event."""
        self.w = WatchStream(self.coord.cluster.Watch(
            C.WatchRequest(node=self.name, session=self.session)), self.name)
        return self.w.next_event()

    def event_where(self, predicate, timeout=20):
        return self.w.event_where(predicate, timeout)

    def close(self):
        self.stopped.set()
        if self.w is not None:
            self.w.call.cancel()


@pytest.fixture
def nodes():
    made = []

    def make(coord, name, ranks=2, heartbeat=True):
        n = FakeNode(coord, name, ranks)
        if heartbeat:
            n.start_heartbeats()
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def expect_error(code, fn, *args, fragment=None, **kw):
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)
    assert info.value.code() == code, "expected %s, got %s: %s" % (
        code, info.value.code(), info.value.details())
    if fragment is not None:
        assert fragment in info.value.details(), info.value.details()
    return info.value.details()


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for " + what)
        time.sleep(0.05)


def job_state(coord, name):
    return coord.jobs.GetJob(C.GetJobRequest(name=name), timeout=10)


def wait_job_state(coord, name, state, timeout=20):
    return wait_for(lambda: (lambda j: j if j.state == state else None)(job_state(coord, name)),
                    timeout, "job %s to be %s" % (name, C.JobState.Name(state)))


def create_job(coord, name, nodes=1, ranks_per_node=1, **kw):
    return coord.jobs.CreateJob(C.CreateJobRequest(
        name=name, nodes=nodes, ranks_per_node=ranks_per_node, **kw), timeout=10)


# ---------------------------------------------------------------------------
# Health
# ---------------------------------------------------------------------------

def test_health_serves_the_server_and_every_service(coord):
    serving = pb.health.HealthCheckResponse.SERVING
    for service in ("", "zerod.v1.Cluster", "zerod.v1.Jobs", "zerod.v1.Rendezvous",
                    "grpc.health.v1.Health"):
        reply = coord.health.Check(pb.health.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == serving, "service %r: %s" % (service, reply)


def test_health_of_an_unknown_service_is_not_found(coord):
    expect_error(S.NOT_FOUND, coord.health.Check,
                 pb.health.HealthCheckRequest(service="zerod.v1.NoSuchService"), timeout=10)


# ---------------------------------------------------------------------------
# Membership
# ---------------------------------------------------------------------------

def test_join_returns_session_lease_and_a_sorted_view(coord, nodes):
    b = nodes(coord, "node-b")
    a = nodes(coord, "node-a", ranks=4)
    view = coord.cluster.GetView(C.GetViewRequest(), timeout=10)
    assert [m.node.name for m in view.members] == ["node-a", "node-b"]
    assert view.epoch == 2
    by_name = {m.node.name: m for m in view.members}
    assert by_name["node-a"].session == a.session and by_name["node-b"].session == b.session
    assert a.session != b.session
    assert by_name["node-a"].node.ranks == 4
    for m in view.members:
        assert 0 < m.lease_remaining_ms <= TTL_S * 1000
        assert m.joined_unix_ms > 0


def test_join_of_a_live_name_is_already_exists(coord, nodes):
    a = nodes(coord, "a")
    details = expect_error(S.ALREADY_EXISTS, coord.cluster.Join,
                           C.JoinRequest(node=C.NodeInfo(name="a", address="x", ranks=1)),
                           timeout=10)
    assert "node 'a' is already a member (session %d" % a.session in details, details
    assert "lease expires in" in details


@pytest.mark.parametrize("node, fragment", [
    (C.NodeInfo(name="", address="h", ranks=1), "node.name"),
    (C.NodeInfo(name="bad name", address="h", ranks=1), "node.name"),
    (C.NodeInfo(name="x" * 65, address="h", ranks=1), "node.name"),
    (C.NodeInfo(name="a", address="", ranks=1), "node.address"),
    (C.NodeInfo(name="a", address="h" * 256, ranks=1), "node.address"),
    (C.NodeInfo(name="a", address="h", ranks=0), "node.ranks"),
    (C.NodeInfo(name="a", address="h", ranks=65), "node.ranks"),
    (None, "node is missing"),
])
def test_join_rejects_malformed_node_info(coord, node, fragment):
    request = C.JoinRequest(node=node) if node is not None else C.JoinRequest()
    expect_error(S.INVALID_ARGUMENT, coord.cluster.Join, request, timeout=10, fragment=fragment)
    assert len(coord.cluster.GetView(C.GetViewRequest(), timeout=10).members) == 0


def test_garbage_bytes_are_invalid_argument(coord):
    for method in ("/zerod.v1.Cluster/Join", "/zerod.v1.Jobs/CreateJob",
                   "/zerod.v1.Rendezvous/Put"):
        call = coord.channel.unary_unary(method)
        expect_error(S.INVALID_ARGUMENT, call, b"\xff\xff\xff\xff\x0f", timeout=10)
    # The coordinator is still fine.
    coord.health.Check(pb.health.HealthCheckRequest(), timeout=10)


def raw_request(message, placeholder, replacement):
    """message serialized with the bytes of `replacement` (NULs, invalid
    UTF-8: Python's protobuf refuses to serialize those in a str field) in
    place of `placeholder`, which must be as long."""
    assert len(placeholder.encode()) == len(replacement)
    data = message.SerializeToString()
    assert data.count(placeholder.encode()) == 1
    return data.replace(placeholder.encode(), replacement)


def call_raw(coord, method, data):
    """Calls method with request bytes as they are (identity serializers)."""
    return coord.channel.unary_unary(method)(data, timeout=10)


def test_strings_with_a_nul_byte_are_invalid_argument_and_do_not_name_another_job(coord, nodes):
    """protobuf-c would cut "a\0zzz" to "a": the coordinator refuses such
    strings in the bytes, so GetJob and DeleteJob of "a\0zzz" never reach
    job "a", which is still there afterwards."""
    nodes(coord, "n0")
    create_job(coord, "a")
    for method, message, placeholder, replacement, field in [
        ("/zerod.v1.Jobs/CreateJob",
         C.CreateJobRequest(name="aXb", nodes=1, ranks_per_node=1), "aXb", b"a\x00b",
         "field 'name' of zerod.v1.CreateJobRequest contains a NUL byte at byte 1"),
        ("/zerod.v1.Jobs/GetJob", C.GetJobRequest(name="aXzzz"), "aXzzz", b"a\x00zzz",
         "field 'name' of zerod.v1.GetJobRequest contains a NUL byte at byte 1"),
        ("/zerod.v1.Jobs/DeleteJob", C.DeleteJobRequest(name="aXzzz"), "aXzzz", b"a\x00zzz",
         "field 'name' of zerod.v1.DeleteJobRequest contains a NUL byte at byte 1"),
        ("/zerod.v1.Checkpoints/Export",
         C.ExportRequest(job="a", path="/tmp/x.safetensorsXjunk"), "/tmp/x.safetensorsXjunk",
         b"/tmp/x.safetensors\x00junk",
         "field 'path' of zerod.v1.ExportRequest contains a NUL byte at byte 18"),
        # Invalid UTF-8 the same way: a surrogate, in a nested repeated field.
        ("/zerod.v1.Cluster/Join",
         C.JoinRequest(node=C.NodeInfo(name="n9", address="h", ranks=1, devices=[
             C.Device(kind="cpu", name="ok"), C.Device(kind="cpu", name="XYZ")])),
         "XYZ", b"\xed\xa0\x80",
         "field 'node.devices[1].name' of zerod.v1.JoinRequest is not valid UTF-8 (at byte 0)"),
    ]:
        data = raw_request(message, placeholder, replacement)
        details = expect_error(S.INVALID_ARGUMENT, call_raw, coord, method, data)
        assert details == field, "%s: %s" % (method, details)
    # Job "a" was neither read nor deleted in place of "a\0zzz".
    assert job_state(coord, "a").name == "a"
    assert [j.name for j in coord.jobs.ListJobs(C.ListJobsRequest(), timeout=10).jobs] == ["a"]
    assert "n9" not in [m.node.name for m in
                        coord.cluster.GetView(C.GetViewRequest(), timeout=10).members]
    # Valid multi-byte UTF-8 passes the check: an unknown service, not a
    # refused request.
    expect_error(S.NOT_FOUND, coord.health.Check,
                 pb.health.HealthCheckRequest(service="zerod.v1.\u00e9\u20ac\U0001f600"),
                 timeout=10)


def test_heartbeat_keeps_a_member_past_its_ttl(coord, nodes):
    a = nodes(coord, "a")
    time.sleep(TTL_S * 2)
    view = coord.cluster.GetView(C.GetViewRequest(), timeout=10)
    assert [m.node.name for m in view.members] == ["a"]
    assert view.members[0].session == a.session
    reply = a.heartbeat()
    assert reply.lease_ttl_ms == int(TTL_S * 1000) and reply.epoch == view.epoch


def test_heartbeat_of_unknown_node_or_session_is_not_found(coord, nodes):
    a = nodes(coord, "a")
    details = expect_error(S.NOT_FOUND, coord.cluster.Heartbeat,
                           C.HeartbeatRequest(node="a", session=a.session + 1), timeout=10)
    assert details == ("node 'a' is not a member (lease expired or coordinator restarted); "
                       "join again")
    expect_error(S.NOT_FOUND, coord.cluster.Heartbeat,
                 C.HeartbeatRequest(node="ghost", session=1), timeout=10)


def test_member_that_stops_heartbeating_leaves_and_its_watch_ends(coord, nodes):
    a = nodes(coord, "a")
    b = nodes(coord, "b")
    a.watch()
    b.watch()
    epoch = coord.cluster.GetView(C.GetViewRequest(), timeout=10).epoch
    a.stop_heartbeats()
    started = time.monotonic()
    view = wait_for(lambda: (lambda v: v if [m.node.name for m in v.members] == ["b"] else None)(
        coord.cluster.GetView(C.GetViewRequest(), timeout=10)), TTL_S + 10, "a to leave")
    assert time.monotonic() - started < TTL_S + 10
    assert view.epoch == epoch + 1
    # a's stream ends NOT_FOUND; b hears of the new view.
    end = a.w.wait_end()
    assert end[0] == S.NOT_FOUND and "lease expired" in end[1], end
    b.event_where(lambda e: e.view.epoch == epoch + 1 and len(e.view.members) == 1)
    # a's heartbeats are refused from now on; it may join again.
    expect_error(S.NOT_FOUND, a.heartbeat)
    a.join()
    assert len(coord.cluster.GetView(C.GetViewRequest(), timeout=10).members) == 2


def test_leave_removes_the_member_and_bumps_the_epoch(coord, nodes):
    a = nodes(coord, "a")
    nodes(coord, "b")
    epoch = coord.cluster.GetView(C.GetViewRequest(), timeout=10).epoch
    expect_error(S.NOT_FOUND, coord.cluster.Leave,
                 C.LeaveRequest(node="a", session=a.session ^ 1), timeout=10)
    coord.cluster.Leave(C.LeaveRequest(node="a", session=a.session), timeout=10)
    view = coord.cluster.GetView(C.GetViewRequest(), timeout=10)
    assert [m.node.name for m in view.members] == ["b"] and view.epoch == epoch + 1


def test_watch_of_a_non_member_is_not_found(coord):
    call = coord.cluster.Watch(C.WatchRequest(node="ghost", session=7))
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == S.NOT_FOUND


def test_a_second_watch_replaces_the_first(coord, nodes):
    a = nodes(coord, "a")
    first = a.watch()
    assert first.view.members[0].node.name == "a"
    old = a.w
    a.watch()
    # The old stream ended (ABORTED); the new one keeps receiving.
    assert old.wait_end()[0] == S.ABORTED, old.end
    nodes(coord, "b")
    a.event_where(lambda e: len(e.view.members) == 2)


# ---------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------

def test_watch_delivers_assignments_when_a_job_is_created(coord, nodes):
    a = nodes(coord, "a", ranks=2)
    b = nodes(coord, "b", ranks=2)
    c = nodes(coord, "c", ranks=2)
    first = a.watch()
    assert len(first.assignments) == 0
    c.watch()
    reply = create_job(coord, "train", nodes=2, ranks_per_node=2)
    assert len(reply.token) == 32 and re.fullmatch("[0-9a-f]{32}", reply.token)
    job = reply.job
    assert [(p.node, p.first_rank, p.ranks) for p in job.placement] == [("a", 0, 2), ("b", 2, 2)]
    assert job.world_size == 4 and job.id >= 1 and job.epoch >= 1
    assert job.state == C.JOB_STATE_CREATING
    assert job.reason == "waiting for nodes a, b to build the job's ranks"
    event = a.event_where(lambda e: len(e.assignments) == 1)
    assignment = event.assignments[0]
    assert assignment.job.name == "train" and assignment.token == ""
    # Only the token's hash leaves the coordinator after CreateJob.
    assert assignment.token_sha256 == hashlib.sha256(reply.token.encode()).hexdigest()
    assert (assignment.first_rank, assignment.ranks) == (0, 2)
    event = b.watch()  # a watch opened later gets the assignment at once
    assert [x.first_rank for x in event.assignments] == [2]
    # c has no ranks of the job: whatever it hears carries no assignment.
    while not c.w.events.empty():
        e = c.w.events.get()
        assert e is None or len(e.assignments) == 0


def test_job_goes_creating_ready_degraded_and_ready_again(coord, nodes):
    a = nodes(coord, "a")
    b = nodes(coord, "b")
    a.watch()
    create_job(coord, "j", nodes=2, ranks_per_node=2)
    assert job_state(coord, "j").state == C.JOB_STATE_CREATING
    a.report("j", ready=True, step=5)
    wait_for(lambda: job_state(coord, "j").reason == "waiting for node b to build the job's ranks",
             15, "a's report")
    b.report("j", ready=True, step=3)
    job = wait_job_state(coord, "j", C.JOB_STATE_READY)
    assert job.reason == "" and job.step == 3
    a.event_where(lambda e: e.assignments and e.assignments[0].job.state == C.JOB_STATE_READY)
    epoch = job.epoch

    # b's lease expires: the job degrades and names it.
    b.stop_heartbeats()
    job = wait_job_state(coord, "j", C.JOB_STATE_DEGRADED, timeout=TTL_S + 15)
    assert job.reason == "node 'b' left the cluster (lease expired)"
    assert job.epoch > epoch, "the rendezvous epoch moves when the world breaks"
    a.event_where(lambda e: e.assignments and e.assignments[0].job.state == C.JOB_STATE_DEGRADED)

    # b re-joins: still degraded until it reports the job ready again.
    b.join()
    b.report("j", ready=False)
    b.start_heartbeats()
    time.sleep(0.5)
    job = job_state(coord, "j")
    assert job.state == C.JOB_STATE_DEGRADED and "re-joined" in job.reason, job
    b.report("j", ready=True)
    wait_job_state(coord, "j", C.JOB_STATE_READY)


def test_a_node_reporting_an_error_degrades_the_job(coord, nodes):
    a = nodes(coord, "a")
    create_job(coord, "j", nodes=1)
    a.report("j", ready=False, error="communicator failed: connection refused")
    job = wait_job_state(coord, "j", C.JOB_STATE_DEGRADED)
    assert job.reason == "node 'a': communicator failed: connection refused"
    a.report("j", ready=True)
    wait_job_state(coord, "j", C.JOB_STATE_READY)


def test_create_job_places_on_named_nodes_and_keeps_the_token(coord, nodes):
    for name in ("a", "b", "c"):
        nodes(coord, name, ranks=4)
    reply = create_job(coord, "j", nodes=2, ranks_per_node=3, node_names=["c", "a"],
                       token="my-secret-token",
                       config=pb.ipc.JobConfig(optimizer=pb.ipc.OptimizerConfig(
                           kind=pb.ipc.OPTIMIZER_SGD, lr=0.1, momentum=0.9)),
                       quotas=C.Quotas(max_live_bytes=1 << 20))
    assert reply.token == "my-secret-token"
    assert [(p.node, p.first_rank) for p in reply.job.placement] == [("c", 0), ("a", 3)]
    assert reply.job.config.optimizer.kind == pb.ipc.OPTIMIZER_SGD
    assert reply.job.config.optimizer.lr == pytest.approx(0.1)
    assert reply.job.quotas.max_live_bytes == 1 << 20


def test_create_job_errors(coord, nodes):
    nodes(coord, "a", ranks=2)
    nodes(coord, "b", ranks=1)
    create_job(coord, "j", nodes=1, ranks_per_node=2)
    expect_error(S.ALREADY_EXISTS, create_job, coord, "j", fragment="job 'j' already exists")
    details = expect_error(S.FAILED_PRECONDITION, create_job, coord, "k", nodes=3,
                           ranks_per_node=1)
    assert details == "job needs 3 nodes that can host 1 ranks each; 2 are members", details
    expect_error(S.FAILED_PRECONDITION, create_job, coord, "k", nodes=2, ranks_per_node=2,
                 fragment="1 of the 2 members can")
    expect_error(S.FAILED_PRECONDITION, create_job, coord, "k", nodes=1, node_names=["zz"],
                 fragment="node 'zz' is not a member")
    expect_error(S.FAILED_PRECONDITION, create_job, coord, "k", nodes=1, ranks_per_node=2,
                 node_names=["b"], fragment="node 'b'")
    for kw, fragment in [
        (dict(name="bad/name"), "name"),
        (dict(name=""), "name"),
        (dict(nodes=0), "nodes"),
        (dict(nodes=65), "nodes"),
        (dict(ranks_per_node=0), "ranks_per_node"),
        (dict(nodes=8, ranks_per_node=9), "at most 64"),
        (dict(nodes=2, node_names=["a"]), "node_names"),
        (dict(nodes=2, node_names=["a", "a"]), "twice"),
        (dict(token="has space"), "token"),
        (dict(config=pb.ipc.JobConfig(optimizer=pb.ipc.OptimizerConfig(lr=-1))),
         "learning rate"),
        (dict(config=pb.ipc.JobConfig(optimizer=pb.ipc.OptimizerConfig(beta1=1.5))), "betas"),
        (dict(config=pb.ipc.JobConfig(working_dtype=9)), "precision"),
        (dict(config=pb.ipc.JobConfig(optimizer=pb.ipc.OptimizerConfig(kind=9))),
         "unknown optimizer"),
        (dict(config=pb.ipc.JobConfig(optimizer=pb.ipc.OptimizerConfig(
            kind=pb.ipc.OPTIMIZER_SGD, nesterov=True))), "nesterov"),
    ]:
        args = dict(name="k", nodes=1, ranks_per_node=1)
        args.update(kw)
        expect_error(S.INVALID_ARGUMENT, coord.jobs.CreateJob, C.CreateJobRequest(**args),
                     timeout=10, fragment=fragment)
    names = [j.name for j in coord.jobs.ListJobs(C.ListJobsRequest(), timeout=10).jobs]
    assert names == ["j"], names


def test_get_list_and_delete_jobs(coord, nodes):
    a = nodes(coord, "a", ranks=4)
    for name in ("zeta", "alpha", "mid"):
        create_job(coord, name)
    listed = coord.jobs.ListJobs(C.ListJobsRequest(), timeout=10).jobs
    assert [j.name for j in listed] == ["alpha", "mid", "zeta"]
    assert len({j.id for j in listed}) == 3
    details = expect_error(S.NOT_FOUND, coord.jobs.GetJob, C.GetJobRequest(name="nope"),
                           timeout=10)
    assert details == "no job named 'nope'"
    expect_error(S.NOT_FOUND, coord.jobs.DeleteJob, C.DeleteJobRequest(name="nope"), timeout=10)
    expect_error(S.INVALID_ARGUMENT, coord.jobs.GetJob, C.GetJobRequest(name="a b"), timeout=10)

    # a reports "mid": deleting it leaves it DELETING until a stops reporting it.
    a.watch()
    a.report("mid", ready=True)
    wait_job_state(coord, "mid", C.JOB_STATE_READY)
    coord.jobs.DeleteJob(C.DeleteJobRequest(name="mid"), timeout=10)
    assert job_state(coord, "mid").state == C.JOB_STATE_DELETING
    a.event_where(lambda e: sorted(x.job.name for x in e.assignments) == ["alpha", "zeta"])
    expect_error(S.NOT_FOUND, coord.kv.Put, C.PutRequest(job="mid", key="k"), timeout=10)
    expect_error(S.ALREADY_EXISTS, create_job, coord, "mid", fragment="being deleted")
    a.unreport("mid")
    wait_for(lambda: [j.name for j in coord.jobs.ListJobs(C.ListJobsRequest(), timeout=10).jobs]
             == ["alpha", "zeta"], 15, "mid to disappear")
    # "alpha" is reported by nobody: it disappears at once.
    coord.jobs.DeleteJob(C.DeleteJobRequest(name="alpha"), timeout=10)
    expect_error(S.NOT_FOUND, coord.jobs.GetJob, C.GetJobRequest(name="alpha"), timeout=10)
    # The name is free again.
    create_job(coord, "mid")


# ---------------------------------------------------------------------------
# Rendezvous
# ---------------------------------------------------------------------------

def test_rendezvous_put_get_and_delete_by_prefix(coord, nodes):
    nodes(coord, "a")
    create_job(coord, "j")
    kv = coord.kv
    kv.Put(C.PutRequest(job="j", epoch=1, key="rank/0", value=b"addr0"), timeout=10)
    kv.Put(C.PutRequest(job="j", epoch=1, key="rank/1", value=b"addr1"), timeout=10)
    kv.Put(C.PutRequest(job="j", epoch=1, key="nccl-id", value=bytes(range(256)) * 4), timeout=10)
    kv.Put(C.PutRequest(job="j", epoch=2, key="rank/0", value=b"other epoch"), timeout=10)
    assert kv.Get(C.GetRequest(job="j", epoch=1, key="rank/0"), timeout=10).value == b"addr0"
    assert kv.Get(C.GetRequest(job="j", epoch=2, key="rank/0"), timeout=10).value == b"other epoch"
    assert kv.Get(C.GetRequest(job="j", epoch=1, key="nccl-id"),
                  timeout=10).value == bytes(range(256)) * 4
    kv.Put(C.PutRequest(job="j", epoch=1, key="rank/0", value=b"new"), timeout=10)
    assert kv.Get(C.GetRequest(job="j", epoch=1, key="rank/0"), timeout=10).value == b"new"
    expect_error(S.NOT_FOUND, kv.Get, C.GetRequest(job="j", epoch=1, key="missing"), timeout=10)

    reply = kv.Delete(C.DeleteRequest(job="j", epoch=1, key="rank/", prefix=True), timeout=10)
    assert reply.deleted == 2
    expect_error(S.NOT_FOUND, kv.Get, C.GetRequest(job="j", epoch=1, key="rank/1"), timeout=10)
    assert kv.Get(C.GetRequest(job="j", epoch=2, key="rank/0"), timeout=10).value == b"other epoch"
    assert kv.Delete(C.DeleteRequest(job="j", epoch=1, key="nccl-id"), timeout=10).deleted == 1
    assert kv.Delete(C.DeleteRequest(job="j", epoch=1, key="nccl-id"), timeout=10).deleted == 0


def test_rendezvous_errors(coord, nodes):
    nodes(coord, "a")
    create_job(coord, "j")
    kv = coord.kv
    expect_error(S.NOT_FOUND, kv.Put, C.PutRequest(job="nope", key="k", value=b"v"), timeout=10,
                 fragment="no job named 'nope'")
    expect_error(S.NOT_FOUND, kv.Get, C.GetRequest(job="nope", key="k"), timeout=10)
    expect_error(S.INVALID_ARGUMENT, kv.Put, C.PutRequest(job="j", key="", value=b"v"),
                 timeout=10, fragment="key")
    expect_error(S.INVALID_ARGUMENT, kv.Put, C.PutRequest(job="j", key="k" * 513), timeout=10,
                 fragment="key")
    expect_error(S.INVALID_ARGUMENT, kv.Put,
                 C.PutRequest(job="j", key="k", value=b"x" * ((1 << 20) + 1)), timeout=10,
                 fragment="value")
    kv.Put(C.PutRequest(job="j", key="k" * 512, value=b"x" * (1 << 20)), timeout=10)
    expect_error(S.INVALID_ARGUMENT, kv.Get, C.GetRequest(job="", key="k"), timeout=10)


def test_rendezvous_get_waits_for_a_put(coord, nodes):
    nodes(coord, "a")
    create_job(coord, "j")
    result = {}

    def waiter():
        try:
            result["value"] = coord.kv.Get(
                C.GetRequest(job="j", epoch=3, key="nccl-unique-id", wait=True), timeout=30).value
        except grpc.RpcError as e:
            result["error"] = (e.code(), e.details())

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive(), result
    coord.kv.Put(C.PutRequest(job="j", epoch=3, key="nccl-unique-id", value=b"id!"), timeout=10)
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert result == {"value": b"id!"}


def test_rendezvous_get_wait_ends_at_its_deadline(coord, nodes):
    nodes(coord, "a")
    create_job(coord, "j")
    started = time.monotonic()
    expect_error(S.DEADLINE_EXCEEDED, coord.kv.Get,
                 C.GetRequest(job="j", epoch=1, key="never", wait=True), timeout=1.0)
    assert time.monotonic() - started < 15
    # The dropped waiter does not get in the way of later calls.
    coord.kv.Put(C.PutRequest(job="j", epoch=1, key="never", value=b"now"), timeout=10)
    assert coord.kv.Get(C.GetRequest(job="j", epoch=1, key="never", wait=True),
                        timeout=10).value == b"now"


def test_deleting_a_job_ends_its_waiting_gets(coord, nodes):
    nodes(coord, "a")
    create_job(coord, "j")
    result = {}

    def waiter():
        try:
            coord.kv.Get(C.GetRequest(job="j", key="k", wait=True), timeout=30)
        except grpc.RpcError as e:
            result["code"] = e.code()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)
    coord.jobs.DeleteJob(C.DeleteJobRequest(name="j"), timeout=10)
    thread.join(timeout=20)
    assert result.get("code") == S.NOT_FOUND, result


# ---------------------------------------------------------------------------
# Durable state, restarts and shutdown
# ---------------------------------------------------------------------------

def test_jobs_survive_a_sigkill_and_nodes_join_again(coordinator, nodes):
    coord = coordinator()
    a = nodes(coord, "a")
    b = nodes(coord, "b")
    created = create_job(coord, "j", nodes=2, ranks_per_node=2, token="tok-123")
    create_job(coord, "k", nodes=1)
    coord.jobs.DeleteJob(C.DeleteJobRequest(name="k"), timeout=10)
    a.stop_heartbeats()
    b.stop_heartbeats()
    coord.kill()
    assert not os.path.exists(coord.state_dir / "coordinator.pb.tmp")

    coord.start()
    listed = coord.jobs.ListJobs(C.ListJobsRequest(), timeout=10).jobs
    assert [j.name for j in listed] == ["j"]
    job = listed[0]
    assert job.id == created.job.id and job.state == C.JOB_STATE_CREATING
    assert list(job.placement) == list(created.job.placement)
    assert "join" in job.reason, job.reason
    # The nodes' sessions are gone: heartbeats say so, and they join again.
    for n in (a, b):
        expect_error(S.NOT_FOUND, n.heartbeat, fragment="join again")
        n.join()
        n.report("j", ready=True)
        n.start_heartbeats()
    wait_job_state(coord, "j", C.JOB_STATE_READY)
    event = a.watch()
    assert event.assignments[0].token_sha256 == hashlib.sha256(b"tok-123").hexdigest()
    # Ids are never reused after a restart.
    assert create_job(coord, "new").job.id > created.job.id


def test_a_corrupt_state_file_stops_the_coordinator_from_starting(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "coordinator.pb").write_bytes(b"\xff\xff\xff garbage")
    proc = subprocess.run([binary("zerod"), "coordinator", "--listen", "127.0.0.1:0",
                           "--state-dir", str(state)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert "corrupt" in proc.stderr, proc.stderr
    assert (state / "coordinator.pb").read_bytes() == b"\xff\xff\xff garbage"


def test_a_state_file_of_another_format_version_is_refused(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "coordinator.pb").write_bytes(C.CoordinatorState(format_version=99)
                                           .SerializeToString())
    proc = subprocess.run([binary("zerod"), "coordinator", "--listen", "127.0.0.1:0",
                           "--state-dir", str(state)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "format version 99" in proc.stderr, proc.stderr


def test_a_state_file_with_a_nul_in_a_job_name_is_refused(tmp_path):
    """The state file is bytes from outside too: a job name with a NUL in
    it would load as the name before the NUL."""
    state = tmp_path / "state"
    state.mkdir()
    data = raw_request(C.CoordinatorState(format_version=1, next_job_id=2, jobs=[
        C.StoredJob(job=C.Job(name="aXb", id=1), token="t")]), "aXb", b"a\x00b")
    (state / "coordinator.pb").write_bytes(data)
    proc = subprocess.run([binary("zerod"), "coordinator", "--listen", "127.0.0.1:0",
                           "--state-dir", str(state)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert ("coordinator.pb is corrupt: field 'jobs[0].job.name' of zerod.v1.CoordinatorState "
            "contains a NUL byte at byte 1") in proc.stderr, proc.stderr


def test_a_failed_state_write_fails_the_rpc_and_changes_nothing(coord, nodes):
    nodes(coord, "a")
    create_job(coord, "kept")
    # A directory where the temporary file goes makes the write fail (as a
    # full disk would), whatever our privileges.
    (coord.state_dir / "coordinator.pb.tmp").mkdir()
    before = (coord.state_dir / "coordinator.pb").read_bytes()
    expect_error(S.UNAVAILABLE, create_job, coord, "lost", fragment="Is a directory")
    expect_error(S.UNAVAILABLE, coord.jobs.DeleteJob, C.DeleteJobRequest(name="kept"),
                 timeout=10)
    assert [j.name for j in coord.jobs.ListJobs(C.ListJobsRequest(), timeout=10).jobs] == [
        "kept"]
    assert job_state(coord, "kept").state != C.JOB_STATE_DELETING
    assert (coord.state_dir / "coordinator.pb").read_bytes() == before
    (coord.state_dir / "coordinator.pb.tmp").rmdir()
    create_job(coord, "lost")


def test_sigterm_ends_watches_and_waits_and_exits_cleanly(coord, nodes):
    a = nodes(coord, "a")
    create_job(coord, "j")
    a.watch()
    result = {}

    def waiter():
        try:
            coord.kv.Get(C.GetRequest(job="j", key="k", wait=True), timeout=60)
        except grpc.RpcError as e:
            result["code"] = e.code()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)
    coord.proc.send_signal(signal.SIGTERM)
    assert coord.proc.wait(timeout=60) == 0, coord.read_log()
    thread.join(timeout=20)
    assert result.get("code") == S.UNAVAILABLE, result
    assert a.w.wait_end()[0] == S.UNAVAILABLE, a.w.end
    log = coord.read_log()
    assert "AddressSanitizer" not in log and "runtime error" not in log, log
    assert 'msg=stopped' in log, log
