"""Floods of the control plane from outside, as docs/security.md
("Exhaustion") says each is survived. The attacker is a raw HTTP/2 client
(h2raw.py): it opens calls with their headers and never sends the request
message, the one thing a gRPC library would not let it do, so that each
call would hold a slot for as long as the attacker likes.

- Without credentials, a flood on Heartbeat or ListJobs holds nothing:
  every call is refused UNAUTHENTICATED as it arrives, while a real node
  heartbeats (it is never evicted) and tenants and the admin are answered.
- Health checks need no credentials: theirs is a small budget apart, per
  connection and per source address, and a call that sends no request in
  2 s is ended.
- A tenant holding 1,200 calls has 1,024 of them; the rest, and its next
  call, are refused naming it; other principals are answered; the held
  calls end after 10 s without a request, and then it is answered again.
- A connection that never acknowledges the server's SETTINGS still holds
  at most 100 calls; the others are refused at once.
"""

import threading
import time

import grpc
import pytest

import ctlproto
import h2raw
from test_security import TOKENS, Caller, secured, wait_for  # noqa: F401 (fixture)

OK = grpc.StatusCode.OK
RESOURCE_EXHAUSTED = 8
UNAUTHENTICATED = 16
DEADLINE_EXCEEDED = 4

HEARTBEAT = "/zerod.v1.Cluster/Heartbeat"
LIST_JOBS = "/zerod.v1.Jobs/ListJobs"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def own_channel(coord):
    # Its own connection: grpcio would otherwise share one between the
    # channels of this process, as another client process would not.
    return grpc.insecure_channel(coord.address, options=[("grpc.use_local_subchannel_pool", 1)])


def ended_on(conns):
    """Reads what has come on each connection; the streams ended so far."""
    for c in conns:
        c.pump(0.05)
    return sum(len(c.ended) for c in conns)


class Legit:
    """The callers who must keep being answered: an admin, a tenant and
    an anonymous health check, each call with a 5 s deadline."""

    def __init__(self, coord, callers):
        self.channel = own_channel(coord)
        self.admin = Caller(self.channel, "admin")
        self.alice = Caller(self.channel, "alice")
        self.bob = Caller(self.channel, "bob")
        self.mods = ctlproto.load()
        self.health = self.mods.health_grpc.HealthStub(self.channel)

    def check(self):
        pb = self.admin.pb
        code, view, details = self.admin.call(self.admin.cluster.GetView, pb.GetViewRequest(),
                                              timeout=5)
        assert code == OK, details
        assert [m.node.name for m in view.members] == ["node-a"], view
        code, job, details = self.alice.call(self.alice.jobs.GetJob, pb.GetJobRequest(name="sec"),
                                             timeout=5)
        assert code == OK, details
        code, _, details = self.bob.call(self.bob.jobs.ListJobs, pb.ListJobsRequest(), timeout=5)
        assert code == OK, details
        reply = self.health.Check(self.mods.health.HealthCheckRequest(), timeout=5)
        assert reply.status == self.mods.health.HealthCheckResponse.SERVING
        return job

    def close(self):
        self.channel.close()


@pytest.mark.parametrize("method", [HEARTBEAT, LIST_JOBS])
def test_calls_without_credentials_hold_nothing(secured, method):
    callers, coord, node = secured
    pb = callers["admin"].pb
    # 60 connections x 100 calls, none with a request: refused as they arrive.
    conns = [h2raw.Connection(coord.port) for _ in range(60)]
    legit = Legit(coord, callers)
    try:
        waves = [c.open_streams(100, method) for c in conns]
        for c, ids in zip(conns, waves):
            ended = c.pump_until_ended(ids, 20)
            assert all(e is not None and e.status == UNAUTHENTICATED for e in ended), \
                [e for e in ended if e is None or e.status != UNAUTHENTICATED][:3]
        assert "--auth-token-file" in conns[0].ended[waves[0][0]].message

        # The same flood, kept up for three lease TTLs (2 s each) while a
        # real node heartbeats and others call.
        stop = threading.Event()
        sent = [0]

        def flood():
            while not stop.is_set():
                for c in conns:
                    ids = c.open_streams(100, method)
                    sent[0] += len(ids)
                    c.pump_until_ended(ids, 5)

        flooder = threading.Thread(target=flood)
        flooder.start()
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 6.5:
                job = legit.check()
                assert job.state == pb.JOB_STATE_READY, job.reason
                time.sleep(0.2)
        finally:
            stop.set()
            flooder.join()
        assert sent[0] >= 6000, sent[0]  # it did flood meanwhile
        log = coord.read_log()
        assert "lease expired" not in log and "evict" not in log
        # Refusals are logged at most once a second, not once each.
        refused_lines = [ln for ln in log.splitlines() if 'msg="call refused"' in ln]
        assert 0 < len(refused_lines) < 40, len(refused_lines)
        assert "unlogged_since_last=" in refused_lines[-1]
    finally:
        legit.close()
        for c in conns:
            c.close()


def test_health_checks_without_credentials_have_a_small_budget(secured):
    callers, coord, node = secured
    mods = ctlproto.load()
    request = mods.health.HealthCheckRequest().SerializeToString()
    conns = []
    legit = Legit(coord, callers)
    try:
        # One connection: 4 calls without a request are held, the rest refused.
        first = h2raw.Connection(coord.port)
        conns.append(first)
        ids = first.open_streams(10, HEALTH_CHECK)
        # Streams of one connection arrive in order: the first 4 are held.
        refused = first.pump_until_ended(ids[4:], 30)
        first.pump(0.5)
        assert not any(i in first.ended for i in ids[:4]), first.ended
        assert all(e.status == RESOURCE_EXHAUSTED and "without credentials" in e.message
                   for e in refused), refused
        held = [i for i in ids if i not in first.ended]
        # More connections from 127.0.0.1: at most 16 held in all.
        for _ in range(4):
            c = h2raw.Connection(coord.port)
            conns.append(c)
            c.open_streams(4, HEALTH_CHECK)
        wait_for(lambda: ended_on(conns[1:]) >= 4, "the refusals by address")
        for c in conns[1:]:
            c.pump(0.5)  # and no more than those
        refused_by_address = [e for c in conns[1:] for e in c.ended.values()]
        assert len(refused_by_address) == 4, refused_by_address
        assert all("127.0.0.1 has 16 calls without credentials" in e.message
                   for e in refused_by_address), refused_by_address
        # Another source address still gets its health check answered, and
        # so do callers with credentials.
        other = h2raw.Connection(coord.port, source="127.0.0.2")
        conns.append(other)
        sid = other.open_stream(HEALTH_CHECK, message=request)
        (answer,) = other.pump_until_ended([sid], 5)
        assert answer is not None and answer.status == 0, answer
        legit.check()
        # The held calls sent no request: ended after 2 s (the wait is only
        # an upper bound for a loaded machine).
        ended = first.pump_until_ended(held, 30)
        assert all(e is not None and e.status == DEADLINE_EXCEEDED for e in ended), ended
        assert "did not arrive within 2000 ms" in ended[0].message
        # Their slots are free again.
        sid = first.open_stream(HEALTH_CHECK, message=request)
        (answer,) = first.pump_until_ended([sid], 5)
        assert answer is not None and answer.status == 0, answer
    finally:
        legit.close()
        for c in conns:
            c.close()


def test_a_tenant_above_its_cap_is_refused_by_name(secured):
    callers, coord, node = secured
    pb = callers["admin"].pb
    conns = [h2raw.Connection(coord.port) for _ in range(12)]
    legit = Legit(coord, callers)
    try:
        # 1,200 calls of alice in the state before their request.
        waves = [c.open_streams(100, LIST_JOBS, token=TOKENS["alice"]) for c in conns]
        wait_for(lambda: ended_on(conns) >= 176, "the refusals", timeout_s=30)
        for c in conns:
            c.pump(0.5)  # and no more than those
        refused = [e for c in conns for e in c.ended.values()]
        assert len(refused) == 1200 - 1024, len(refused)
        assert all(e.status == RESOURCE_EXHAUSTED for e in refused), refused[:3]
        assert "principal alice has 1024 calls in flight (at most 1024)" in refused[0].message
        # Its next call, by any means, is refused by name too.
        code, _, details = legit.alice.call(legit.alice.jobs.GetJob, pb.GetJobRequest(name="sec"))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "principal alice" in details
        # Everyone else goes on.
        code, _, details = legit.bob.call(legit.bob.jobs.ListJobs, pb.ListJobsRequest(), timeout=5)
        assert code == OK, details
        code, view, details = legit.admin.call(legit.admin.cluster.GetView, pb.GetViewRequest(),
                                               timeout=5)
        assert code == OK and [m.node.name for m in view.members] == ["node-a"], details
        # Held without a request, the calls end after 10 s, and alice is
        # answered again.
        held = [(c, i) for c, ids in zip(conns, waves) for i in ids if i not in c.ended]
        assert len(held) == 1024
        deadline = time.monotonic() + 40
        for c in conns:
            c.pump(max(0.1, deadline - time.monotonic()),
                   until=lambda c=c: len(c.ended) == 100)
        ended = [c.ended.get(i) for c, i in held]
        assert all(e is not None and e.status == DEADLINE_EXCEEDED for e in ended), \
            [e for e in ended if e is None or e.status != DEADLINE_EXCEEDED][:3]
        code, _, details = legit.alice.call(legit.alice.jobs.GetJob, pb.GetJobRequest(name="sec"))
        assert code == OK, details
    finally:
        legit.close()
        for c in conns:
            c.close()


def test_a_connection_that_never_acks_settings_is_held_to_the_stream_limit(secured):
    callers, coord, node = secured
    legit = Legit(coord, callers)
    rogue = h2raw.Connection(coord.port, ack_settings=False)
    try:
        rogue.pump(0.5)
        assert rogue.settings_seen >= 1  # the server said 100; we never agreed
        ids = rogue.open_streams(4092, LIST_JOBS, token=TOKENS["bob"])
        rogue.pump(60, until=lambda: len(rogue.ended) >= 4092 - 100)
        rogue.pump(0.5)
        refused = list(rogue.ended.values())
        assert len(refused) == 4092 - 100, len(refused)
        assert all(e.status == RESOURCE_EXHAUSTED and "has 100 calls in flight (at most 100)"
                   in e.message for e in refused), refused[:3]
        # Others are answered meanwhile: bob too, on another connection.
        legit.check()
        code, _, details = legit.bob.call(legit.bob.jobs.ListJobs,
                                          legit.bob.pb.ListJobsRequest(), timeout=5)
        assert code == OK, details
        held = [i for i in ids if i not in rogue.ended]
        assert len(held) == 100
    finally:
        legit.close()
        rogue.close()
