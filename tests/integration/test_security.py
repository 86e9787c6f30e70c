"""The control plane's security (docs/security.md), tried as outside
clients would: grpcio stubs generated from the .proto files only.

- Every RPC, called with no credentials, as another tenant, as a reader of
  the job's tenant, as its owner and as an admin, answers the documented
  code; no reply to a principal that is not the job's node carries the
  job's owner token.
- A coordinator serving mutual TLS trains a job end to end through a node
  that joins with its client certificate; a node whose certificate another
  CA signed cannot join, and plain TCP gets nowhere.
- 5,000 streams held on one connection leave health checks and heartbeats
  answering, and no node is evicted.
"""

import hashlib
import json
import os
import re
import subprocess
import time

import grpc
import pytest

import ctlproto
import zdraw as z
from conftest import binary, run_worker

OK = grpc.StatusCode.OK
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED
NOT_FOUND = grpc.StatusCode.NOT_FOUND

TOKENS = {
    "admin": "admin-secret-0123",
    "alice": "alice-secret-4567",  # tenant team-a: owns the jobs
    "bob": "bob-secret-89ab",  # tenant team-b
    "ann": "ann-secret-cdef",  # reader of team-a
    "node-a": "node-a-secret-1111",
    "node-c": "node-c-secret-2222",  # a node no job is placed on
    "node-b": "node-b-secret-3333",  # the TLS test's node (a principal there only)
}
OWNER_TOKEN = "owner-token-of-job-sec"  # the job's token, for workers


def sha(token):
    return hashlib.sha256(token.encode()).hexdigest()


def write_principals(path, extra_lines=()):
    lines = [
        "# name role tenant credential",
        "admin  admin  -      token-sha256:%s" % sha(TOKENS["admin"]),
        "alice  tenant team-a token-sha256:%s" % sha(TOKENS["alice"]),
        "bob    tenant team-b token-sha256:%s" % sha(TOKENS["bob"]),
        "ann    reader team-a token-sha256:%s" % sha(TOKENS["ann"]),
        "node-a node   -      token-sha256:%s" % sha(TOKENS["node-a"]),
        "node-c node   -      token-sha256:%s" % sha(TOKENS["node-c"]),
    ] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def token_file(tmp_path, who):
    path = tmp_path / ("%s.token" % who)
    path.write_text(TOKENS[who] + "\n")
    return str(path)


class Caller:
    """Every service of the coordinator, as one principal."""

    def __init__(self, channel, who):
        mods = ctlproto.load()
        self.pb, self.ipc, self.health_pb = mods.control, mods.ipc, mods.health
        g = mods.control_grpc
        self.cluster = g.ClusterStub(channel)
        self.jobs = g.JobsStub(channel)
        self.kv = g.RendezvousStub(channel)
        self.ckpt = g.CheckpointsStub(channel)
        self.health = mods.health_grpc.HealthStub(channel)
        self.md = () if who is None else (("authorization", "Bearer " + TOKENS[who]),)
        self.replies = []  # every reply message, serialized

    def call(self, method, request, timeout=10):
        """Returns (code, reply or None, details)."""
        try:
            reply = method(request, metadata=self.md, timeout=timeout)
        except grpc.RpcError as e:
            return e.code(), None, e.details()
        self.replies.append(reply.SerializeToString())
        return OK, reply, ""

    def stream(self, method, request, timeout=3):
        """First message of a server stream: (code, message or None)."""
        call = method(request, metadata=self.md, timeout=timeout)
        try:
            for message in call:
                self.replies.append(message.SerializeToString())
                call.cancel()
                return OK, message
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                return OK, None
            return e.code(), None
        return OK, None


@pytest.fixture
def secured(cluster, tmp_path):
    """A coordinator with principals on loopback, node-a joined with its
    token, and job 'sec' of tenant team-a made by alice, ready."""
    principals = write_principals(tmp_path / "principals")
    exports = tmp_path / "exports"
    exports.mkdir()
    coord = cluster.start_coordinator(extra=["--auth-file", str(principals),
                                             "--export-root", str(exports)])
    coord.exports = exports
    node = cluster.start_node("node-a", ranks=1,
                              extra=["--auth-token-file", token_file(tmp_path, "node-a")])
    channel = grpc.insecure_channel(coord.address)
    callers = {who: Caller(channel, who) for who in [None] + list(TOKENS)}
    admin = callers["admin"]
    wait_for(lambda: any(m.node.name == "node-a" for m in admin.call(
        admin.cluster.GetView, admin.pb.GetViewRequest())[1].members), "node-a to join")
    alice = callers["alice"]
    code, reply, details = alice.call(alice.jobs.CreateJob, alice.pb.CreateJobRequest(
        name="sec", nodes=1, ranks_per_node=1, token=OWNER_TOKEN))
    assert code == OK, details
    assert reply.job.tenant == "team-a"
    alice.replies.clear()  # CreateJob's reply is the one that gives the creator the token
    wait_for(lambda: admin.call(admin.jobs.GetJob, admin.pb.GetJobRequest(name="sec"))[1].state
             == admin.pb.JOB_STATE_READY, "job sec to be ready")
    yield callers, coord, node
    channel.close()


def wait_for(predicate, what, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


# (who, expected code) for each caller of the table below.
WHO = [None, "bob", "ann", "alice", "admin"]


def expect(none, other_tenant, reader, owner, admin):
    return dict(zip(WHO, [none, other_tenant, reader, owner, admin]))


def test_every_rpc_checks_its_caller(secured):
    callers, coord, node = secured
    pb = callers["admin"].pb
    ipc = callers["admin"].ipc
    ckpt_dir = coord.state_dir / "checkpoints"

    def row(name, build, codes, fresh=None):
        """Calls build(caller) for every caller in WHO; fresh() first
        re-makes what a successful call consumed."""
        for who in WHO:
            if fresh is not None:
                fresh()
            c = callers[who]
            code, reply, details = build(c)
            assert code == codes[who], "%s as %s: %s %s" % (name, who, code, details)
            if code == DENIED:
                assert details, "%s as %s: no message" % (name, who)

    # Jobs
    row("GetJob", lambda c: c.call(c.jobs.GetJob, pb.GetJobRequest(name="sec")),
        expect(UNAUTHENTICATED, DENIED, OK, OK, OK))
    row("GetJob of a job that does not exist",
        lambda c: c.call(c.jobs.GetJob, pb.GetJobRequest(name="nope")),
        expect(UNAUTHENTICATED, NOT_FOUND, NOT_FOUND, NOT_FOUND, NOT_FOUND))
    for who, sees in [("bob", False), ("ann", True), ("alice", True), ("admin", True)]:
        c = callers[who]
        code, reply, _ = c.call(c.jobs.ListJobs, pb.ListJobsRequest())
        assert code == OK
        assert ("sec" in [j.name for j in reply.jobs]) == sees, who
    assert callers[None].call(callers[None].jobs.ListJobs, pb.ListJobsRequest())[0] == \
        UNAUTHENTICATED

    # Only tenants and admins create; a tenant only for itself.
    def create(c, name, tenant=""):
        return c.call(c.jobs.CreateJob, pb.CreateJobRequest(
            name=name, nodes=1, ranks_per_node=1, tenant=tenant))

    def delete_job(name):
        callers["admin"].call(callers["admin"].jobs.DeleteJob, pb.DeleteJobRequest(name=name))
        wait_for(lambda: callers["admin"].call(callers["admin"].jobs.GetJob,
                                               pb.GetJobRequest(name=name))[0] == NOT_FOUND,
                 "job %s to be gone" % name)

    for who, code in [(None, UNAUTHENTICATED), ("ann", DENIED), ("node-a", DENIED)]:
        assert create(callers[who], "made")[0] == code, who
    assert create(callers["bob"], "made", tenant="team-a")[0] == DENIED
    code, reply, _ = create(callers["admin"], "made", tenant="team-b")
    assert code == OK and reply.job.tenant == "team-b"
    delete_job("made")

    # DeleteJob: each success consumes the job, so it is made again first.
    def fresh_victim():
        if callers["admin"].call(callers["admin"].jobs.GetJob,
                                 pb.GetJobRequest(name="victim"))[0] == OK:
            return
        code, _, details = create(callers["alice"], "victim")
        assert code == OK, details

    def delete_victim(c):
        result = c.call(c.jobs.DeleteJob, pb.DeleteJobRequest(name="victim"))
        if result[0] == OK:
            wait_for(lambda: callers["admin"].call(callers["admin"].jobs.GetJob,
                                                   pb.GetJobRequest(name="victim"))[0]
                     == NOT_FOUND, "victim to be gone")
        return result

    # Read tokens: a reader's way to attach read-only sessions.
    row("IssueReadToken", lambda c: c.call(c.jobs.IssueReadToken,
                                           pb.IssueReadTokenRequest(job="sec")),
        expect(UNAUTHENTICATED, DENIED, OK, OK, OK))
    ann = callers["ann"]
    code, issued, _ = ann.call(ann.jobs.IssueReadToken, pb.IssueReadTokenRequest(job="sec"))
    read_token = issued.token
    assert code == OK and len(read_token) == 32 and read_token != OWNER_TOKEN

    def attach(read_only):
        conn = z.Conn(node.socket)
        payload = (z.read_only_attach_request("sec", token=read_token) if read_only
                   else z.attach_request("sec", 0, create=False, token=read_token))
        t, fields, _ = conn.call(z.ATTACH, payload)
        conn.close()
        return t, fields

    # The node learns the token's hash with the job's next watch event.
    wait_for(lambda: attach(True)[0] == z.ATTACH_REPLY, "the read token to reach node-a")
    t, fields = attach(False)
    assert t == z.ERROR and z.status_of(fields) == "PERMISSION_DENIED"
    assert "read-only sessions only" in z.message_of(fields), z.message_of(fields)
    ann.replies.clear()  # IssueReadToken's replies hold read tokens, never owner tokens

    # LocateJob: where a job is, for a node following it for its own
    # read-only sessions; a node (or an admin) with a token of the job.
    def locate(c, token=OWNER_TOKEN, name="sec"):
        return c.call(c.jobs.LocateJob, pb.LocateJobRequest(name=name, token=token))

    row("LocateJob", locate, expect(UNAUTHENTICATED, DENIED, DENIED, DENIED, OK))
    code, where, _ = locate(callers["node-a"], token=read_token)
    assert code == OK and where.node == "node-a" and where.replica_address, (code, where)
    code, _, details = locate(callers["node-a"], token="not-a-token-of-sec")
    assert code == DENIED and "token" in details, details
    assert locate(callers["node-a"], name="nope")[0] == NOT_FOUND

    row("DeleteJob", delete_victim, expect(UNAUTHENTICATED, DENIED, DENIED, OK, OK),
        fresh=fresh_victim)

    # Checkpoints: save (owner), list (reader), restore (owner), export
    # (reader), delete (owner).
    counter = [0]

    def save(c):
        counter[0] += 1
        return c.call(c.ckpt.Save, pb.SaveRequest(job="sec", name="s%d" % counter[0]),
                      timeout=60)

    row("Save", save, expect(UNAUTHENTICATED, DENIED, DENIED, OK, OK))
    saved = sorted(p.name for p in (ckpt_dir / "sec").iterdir())
    assert len(saved) == 2, saved
    row("List checkpoints of a job",
        lambda c: c.call(c.ckpt.List, pb.ListCheckpointsRequest(job="sec")),
        expect(UNAUTHENTICATED, DENIED, OK, OK, OK))
    for who, sees in [("bob", 0), ("ann", 2), ("alice", 2), ("admin", 2)]:
        c = callers[who]
        code, reply, _ = c.call(c.ckpt.List, pb.ListCheckpointsRequest())
        assert code == OK and len(reply.checkpoints) == sees, who
    row("Restore", lambda c: c.call(c.ckpt.Restore, pb.RestoreRequest(
        job="sec", checkpoint=saved[0]), timeout=60),
        expect(UNAUTHENTICATED, DENIED, DENIED, OK, OK))
    row("Restore from a path", lambda c: c.call(c.ckpt.Restore, pb.RestoreRequest(
        job="sec", checkpoint=str(ckpt_dir / "sec" / saved[0])), timeout=60),
        expect(UNAUTHENTICATED, DENIED, DENIED, DENIED, OK))
    # A node saves and restores the jobs placed on it, for their workers
    # (CHECKPOINT): from their own checkpoints only. Another node cannot.
    node_a, node_c, alice = callers["node-a"], callers["node-c"], callers["alice"]
    code, reply, details = node_a.call(node_a.ckpt.Save, pb.SaveRequest(job="sec", name="by-node"),
                                       timeout=60)
    assert code == OK and reply.checkpoint.name == "by-node", details
    code, _, details = node_c.call(node_c.ckpt.Save, pb.SaveRequest(job="sec", name="by-c"))
    assert code == DENIED and "node node-c may not save job 'sec'" in details, details
    assert node_a.call(node_a.ckpt.Restore, pb.RestoreRequest(job="sec", checkpoint="by-node"),
                       timeout=60)[0] == OK
    assert node_c.call(node_c.ckpt.Restore, pb.RestoreRequest(job="sec", checkpoint="by-node"),
                       timeout=60)[0] == DENIED
    for source in [str(ckpt_dir / "sec" / "by-node"), "victim2/x"]:
        code, _, details = node_a.call(node_a.ckpt.Restore, pb.RestoreRequest(
            job="sec", checkpoint=source), timeout=60)
        assert code == DENIED, (source, details)
    assert node_a.call(node_a.ckpt.Delete, pb.DeleteCheckpointRequest(
        job="sec", name="by-node"))[0] == DENIED
    assert alice.call(alice.ckpt.Delete, pb.DeleteCheckpointRequest(
        job="sec", name="by-node"))[0] == OK
    # Each tenant's exports go in its own directory of the export root,
    # made at start with the daemon's directory mode.
    exports = coord.exports
    assert (exports / "team-a").is_dir() and (exports / "team-b").is_dir()
    assert (exports / "team-a").stat().st_mode & 0o777 == 0o700
    row("Export", lambda c: c.call(c.ckpt.Export, pb.ExportRequest(
        job="sec", checkpoint=saved[0], path="team-a/w.safetensors", overwrite=True),
        timeout=60), expect(UNAUTHENTICATED, DENIED, OK, OK, OK))
    assert (exports / "team-a" / "w.safetensors").stat().st_size > 0
    for who in ["ann", "alice"]:
        c = callers[who]
        for path in ["team-b/w.safetensors", "w.safetensors", str(exports / "w.safetensors"),
                     str(ckpt_dir / "w.safetensors")]:
            code, _, details = c.call(c.ckpt.Export, pb.ExportRequest(
                job="sec", checkpoint=saved[0], path=path), timeout=60)
            assert code == DENIED and "team-a" in details, (who, path, details)
    admin = callers["admin"]
    code, _, details = admin.call(admin.ckpt.Export, pb.ExportRequest(
        job="sec", checkpoint=saved[0], path=str(exports / "all.safetensors")), timeout=60)
    assert code == OK, details  # an admin writes anywhere in the roots
    # The owner deletes the first checkpoint, the admin the second.
    victims = {id(callers["admin"]): saved[1]}
    row("Delete checkpoint", lambda c: c.call(c.ckpt.Delete, pb.DeleteCheckpointRequest(
        job="sec", name=victims.get(id(c), saved[0]))),
        expect(UNAUTHENTICATED, DENIED, DENIED, OK, OK))
    assert not (ckpt_dir / "sec" / saved[0]).exists()

    # Rendezvous: the job's nodes and admins only.
    kv_codes = {None: UNAUTHENTICATED, "alice": DENIED, "ann": DENIED, "node-c": DENIED,
                "node-a": OK, "admin": OK}
    for who, want in kv_codes.items():
        c = callers[who]
        key = "sec-test-%s" % who
        assert c.call(c.kv.Put, pb.PutRequest(job="sec", epoch=99, key=key, value=b"v"))[0] \
            == want, who
        assert c.call(c.kv.Get, pb.GetRequest(job="sec", epoch=99, key=key))[0] == want, who
        assert c.call(c.kv.Delete, pb.DeleteRequest(job="sec", epoch=99, key=key))[0] == want

    # Cluster: a node principal acts only as its own node; Watch (which
    # carries owner tokens) is a node's alone, not even an admin's.
    info = pb.NodeInfo(name="node-a", address="127.0.0.1", ranks=1)
    for who, want in [(None, UNAUTHENTICATED), ("alice", DENIED), ("admin", DENIED),
                      ("node-c", DENIED)]:
        c = callers[who]
        assert c.call(c.cluster.Join, pb.JoinRequest(node=info))[0] == want, who
        assert c.call(c.cluster.Heartbeat, pb.HeartbeatRequest(node="node-a", session=1))[0] \
            == want, who
        assert c.stream(c.cluster.Watch, pb.WatchRequest(node="node-a", session=1))[0] == want
        assert c.call(c.cluster.Leave, pb.LeaveRequest(node="node-a", session=1))[0] == (
            NOT_FOUND if who == "admin" else want), who
    # Sessions are shown to nodes and admins only.
    admin = callers["admin"]
    session = [m.session for m in admin.call(admin.cluster.GetView, pb.GetViewRequest())[1]
               .members if m.node.name == "node-a"][0]
    assert session != 0
    for who in ["alice", "ann", "bob"]:
        c = callers[who]
        code, view, _ = c.call(c.cluster.GetView, pb.GetViewRequest())
        assert code == OK and all(m.session == 0 for m in view.members), who
    # The real node's Watch has the token; anyone else's never does.
    node_caller = callers["node-a"]
    code, event = node_caller.stream(node_caller.cluster.Watch,
                                     pb.WatchRequest(node="node-a", session=session))
    assert code == OK and any(a.token_sha256 == sha(OWNER_TOKEN) for a in event.assignments)
    for who, c in callers.items():
        if who in ("node-a",):
            continue
        for reply in c.replies:
            assert OWNER_TOKEN.encode() not in reply, "a reply to %s holds the token" % who
    # The coordinator keeps the token's hash only, on disk too.
    state = (coord.state_dir / "coordinator.pb").read_bytes()
    assert OWNER_TOKEN.encode() not in state and sha(OWNER_TOKEN).encode() in state
    assert read_token.encode() not in state and sha(read_token).encode() in state

    # Health needs no credentials (probes).
    h = callers[None]
    assert h.call(h.health.Check, h.health_pb.HealthCheckRequest())[0] == OK

    # Every changing call left an audit line: who, what, the result.
    log = coord.read_log()
    assert 'msg=audit method=/zerod.v1.Jobs/DeleteJob principal=bob job=victim ' \
        'status=PERMISSION_DENIED' in log, log
    assert 'msg=audit method=/zerod.v1.Jobs/DeleteJob principal=alice job=victim status=OK' in log
    assert re.search(r'method=/zerod.v1.Checkpoints/Save principal=admin job=sec checkpoint=s5 status=OK', log), log


def test_bad_credentials_are_refused(secured, tmp_path):
    callers, coord, node = secured
    pb = callers["admin"].pb
    channel = grpc.insecure_channel(coord.address)
    stub = ctlproto.load().control_grpc.JobsStub(channel)
    for md, words in [((("authorization", "Bearer not-a-known-token"),), "not one of"),
                      ((("authorization", "Basic YWxhZGRpbjpvcGVuc2VzYW1l"),), "Bearer"),
                      ((("authorization", "Bearer "),), "Bearer")]:
        with pytest.raises(grpc.RpcError) as e:
            stub.GetJob(pb.GetJobRequest(name="sec"), metadata=md, timeout=10)
        assert e.value.code() == UNAUTHENTICATED and words in e.value.details(), md
    channel.close()
    # A principals file with a mistake stops the coordinator at start,
    # naming the line.
    bad = tmp_path / "bad-principals"
    bad.write_text("alice tenant - token-sha256:%s\n" % sha("x"))
    proc = subprocess.run([binary("zerod"), "coordinator", "--listen", "127.0.0.1:0",
                           "--state-dir", str(tmp_path / "bad-state"), "--auth-file", str(bad)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "bad-principals:1:" in proc.stderr and "tenant" in proc.stderr, proc.stderr


def test_plain_transport_needs_loopback_or_insecure(tmp_path):
    args = [binary("zerod"), "coordinator", "--listen", "0.0.0.0:0",
            "--state-dir", str(tmp_path / "state")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--insecure" in proc.stderr, proc.stderr
    proc = subprocess.run([binary("zerod"), "node", "--coordinator", "192.0.2.1:7070",
                           "--dir", str(tmp_path / "node")], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "TLS" in proc.stderr, proc.stderr
    proc = subprocess.run([binary("zerodctl"), "-c", "192.0.2.1:7070", "jobs", "list"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--insecure" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------
# TLS
# ---------------------------------------------------------------------------

def openssl(*args, cwd):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", name + ".key", "-out", name + ".crt", "-days", "2",
            "-subj", "/CN=" + name, cwd=d)


def make_cert(d, ca, name, cn):
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + cn, cwd=d)
    ext = os.path.join(d, name + ".ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".crt", "-CAkey", ca + ".key",
            "-CAcreateserial", "-out", name + ".crt", "-days", "2", "-extfile", ext, cwd=d)


@pytest.fixture
def pki(tmp_path):
    d = tmp_path / "pki"
    d.mkdir()
    make_ca(str(d), "ca")
    make_ca(str(d), "rogue-ca")
    make_cert(str(d), "ca", "server", "coordinator")
    make_cert(str(d), "ca", "node-b", "node-b")
    make_cert(str(d), "ca", "ops", "ops")
    make_cert(str(d), "rogue-ca", "rogue", "node-b")
    return d


@pytest.mark.parametrize("mode", ["tls", "mtls"])
def test_tls_cluster_trains(cluster, pki, tmp_path, mode):
    """TLS: the node and zerodctl verify the coordinator and authenticate
    with bearer tokens. Mutual TLS: with their certificates, which the
    coordinator requires."""
    if mode == "mtls":
        principals = write_principals(tmp_path / "principals",
                                      ["node-b node  - cert:node-b", "ops admin - cert:ops"])
        client_auth = ["--tls-client-ca", str(pki / "ca.crt"), "--tls-require-client-cert"]
        node_auth = ["--tls-cert", str(pki / "node-b.crt"), "--tls-key", str(pki / "node-b.key")]
        ctl_auth = ["--tls-cert", str(pki / "ops.crt"), "--tls-key", str(pki / "ops.key")]
    else:
        principals = write_principals(tmp_path / "principals", [
            "node-b node - token-sha256:%s" % sha(TOKENS["node-b"])])
        client_auth = []
        node_auth = ["--auth-token-file", token_file(tmp_path, "node-b")]
        ctl_auth = ["--auth-token-file", token_file(tmp_path, "admin")]
    cluster.start_coordinator(extra=[
        "--auth-file", str(principals), "--tls-cert", str(pki / "server.crt"),
        "--tls-key", str(pki / "server.key")] + client_auth)
    coord = cluster.coordinator
    # By IP, checking the certificate's DNS name (--tls-server-name): no
    # resolver involved (c-ares leaks a few bytes on exit under ASan).
    address = coord.address
    tls = ["--tls-ca", str(pki / "ca.crt"), "--tls-server-name", "localhost"]
    node = cluster.start_node("node-b", ranks=2, extra=tls + node_auth)
    ctl = [binary("zerodctl"), "-c", address] + tls + ctl_auth
    deadline = time.monotonic() + 30
    while "node-b" not in run_worker(ctl + ["members"], check=False).stdout:
        assert time.monotonic() < deadline, node.read_log()
        time.sleep(0.1)
    run_worker(ctl + ["jobs", "create", "tls-job", "--ranks-per-node", "2", "--lr", "0.01",
                      "--token", OWNER_TOKEN])
    deadline = time.monotonic() + 30
    while "ready" not in run_worker(ctl + ["jobs", "get", "tls-job"]).stdout:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    procs = [subprocess.Popen(
        [binary("zerod-mlp-train"), "--socket", node.socket, "--job", "tls-job",
         "--local-rank", str(r), "--token", OWNER_TOKEN, "--hidden", "64", "--batch", "16",
         "--steps", "10", "--log-every", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, out + err
    # The step reaches the coordinator with the node's next heartbeat.
    deadline = time.monotonic() + 30
    while json.loads(run_worker(ctl + ["--json", "jobs", "get", "tls-job"]).stdout)["step"] != 10:
        assert time.monotonic() < deadline, node.read_log()
        time.sleep(0.1)

    # A plain-text client gets nowhere either way.
    mods = ctlproto.load()
    ch = grpc.insecure_channel(address)
    with pytest.raises(grpc.RpcError):
        mods.control_grpc.ClusterStub(ch).GetView(mods.control.GetViewRequest(), timeout=5)
    ch.close()
    if mode == "tls":
        # A TLS client without a token is refused by the policy instead.
        ch = grpc.secure_channel(address, grpc.ssl_channel_credentials(
            root_certificates=(pki / "ca.crt").read_bytes()))
        with pytest.raises(grpc.RpcError) as e:
            mods.control_grpc.JobsStub(ch).ListJobs(mods.control.ListJobsRequest(), timeout=5)
        assert e.value.code() == UNAUTHENTICATED
        ch.close()
        return
    # Without a client certificate, or with one from another CA, nothing
    # gets through.
    for creds in [grpc.ssl_channel_credentials(root_certificates=(pki / "ca.crt").read_bytes()),
                  grpc.ssl_channel_credentials(
                      root_certificates=(pki / "ca.crt").read_bytes(),
                      private_key=(pki / "rogue.key").read_bytes(),
                      certificate_chain=(pki / "rogue.crt").read_bytes())]:
        ch = grpc.secure_channel(address, creds)
        with pytest.raises(grpc.RpcError) as e:
            mods.control_grpc.ClusterStub(ch).GetView(mods.control.GetViewRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ch.close()
    rogue = cluster.start_node("node-b2", ranks=1, extra=tls + [
        "--tls-cert", str(pki / "rogue.crt"), "--tls-key", str(pki / "rogue.key")])
    time.sleep(2)
    members = run_worker(ctl + ["members"]).stdout
    assert "node-b2" not in members and "node-b" in members, members
    assert rogue.alive()


# ---------------------------------------------------------------------------
# Exhaustion
# ---------------------------------------------------------------------------

def test_flood_of_streams_leaves_health_and_heartbeats(secured):
    callers, coord, node = secured
    pb = callers["admin"].pb
    mods = ctlproto.load()
    # Its own connection: grpcio would otherwise share one between the
    # channels of this process, as another client process would not.
    own = [("grpc.use_local_subchannel_pool", 1)]
    flood = grpc.insecure_channel(coord.address, options=own)
    kv = mods.control_grpc.RendezvousStub(flood)
    md = (("authorization", "Bearer " + TOKENS["node-a"]),)
    # 5,000 rendezvous Gets that wait, on one connection.
    held = [kv.Get.future(pb.GetRequest(job="sec", epoch=7, key="never-%d" % i, wait=True),
                          metadata=md, timeout=60) for i in range(5000)]
    time.sleep(1.0)
    try:
        other = grpc.insecure_channel(coord.address, options=own)
        health = mods.health_grpc.HealthStub(other)
        admin = Caller(other, "admin")
        t0 = time.monotonic()
        for _ in range(20):
            health.Check(mods.health.HealthCheckRequest(), timeout=5)
            code, view, details = admin.call(admin.cluster.GetView, pb.GetViewRequest())
            assert code == OK, details
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        # Three lease TTLs (2 s each) with the flood held: node-a stays.
        time.sleep(max(0.0, 6.0 - elapsed))
        code, view, _ = admin.call(admin.cluster.GetView, pb.GetViewRequest())
        assert code == OK and [m.node.name for m in view.members] == ["node-a"]
        code, job, _ = admin.call(admin.jobs.GetJob, pb.GetJobRequest(name="sec"))
        assert job.state == pb.JOB_STATE_READY, job.reason
        assert "evict" not in coord.read_log() and "lease expired" not in coord.read_log()
        other.close()
    finally:
        for f in held:
            f.cancel()
        flood.close()


def test_listener_recovers_after_running_out_of_descriptors(cluster):
    """gRPC closes its listener for good on EMFILE; the coordinator notices
    and listens again, and answers within 5 s of descriptors being free."""
    import resource
    import socket
    coord = cluster.start_coordinator()
    resource.prlimit(coord.proc.pid, resource.RLIMIT_NOFILE, (64, 64))
    held = []
    try:
        for _ in range(120):
            held.append(socket.create_connection(("127.0.0.1", coord.port), timeout=5))
        wait_for(lambda: "Failed accept4" in coord.read_log(), "the coordinator to hit EMFILE")
    finally:
        for s in held:
            s.close()
    freed = time.monotonic()
    mods = ctlproto.load()
    while True:
        ch = grpc.insecure_channel(coord.address, options=[("grpc.use_local_subchannel_pool", 1)])
        try:
            reply = mods.health_grpc.HealthStub(ch).Check(mods.health.HealthCheckRequest(),
                                                          timeout=1)
            assert reply.status == mods.health.HealthCheckResponse.SERVING
            break
        except grpc.RpcError:
            assert time.monotonic() - freed < 5.0, coord.read_log()
        finally:
            ch.close()
    assert "rpc server listening again" in coord.read_log()


def test_one_principal_cannot_take_every_call(secured):
    """Many connections of one principal: past 1024 calls in flight its
    calls are refused, naming it; other principals and heartbeats go on."""
    callers, coord, node = secured
    pb = callers["admin"].pb
    mods = ctlproto.load()
    md = (("authorization", "Bearer " + TOKENS["node-a"]),)
    own = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(coord.address, options=own) for _ in range(11)]
    held = []
    try:
        for n, ch in enumerate(channels):
            kv = mods.control_grpc.RendezvousStub(ch)
            held += [kv.Get.future(pb.GetRequest(job="sec", epoch=7, key="k%d-%d" % (n, i),
                                                 wait=True), metadata=md, timeout=30)
                     for i in range(100)]
        # 1100 asked, 1024 allowed: the rest end at once.
        wait_for(lambda: sum(f.done() for f in held) >= 1100 - 1024, "refusals")
        refused = [f for f in held if f.done()]
        assert all(f.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for f in refused)
        assert "principal node-a has 1024 calls in flight" in refused[0].details()
        alice = callers["alice"]
        code, _, details = alice.call(alice.jobs.GetJob, pb.GetJobRequest(name="sec"))
        assert code == OK, details
        time.sleep(3)  # over a lease TTL: heartbeats of node-a went through
        admin = callers["admin"]
        view = admin.call(admin.cluster.GetView, pb.GetViewRequest())[1]
        assert [m.node.name for m in view.members] == ["node-a"]
    finally:
        for f in held:
            f.cancel()
        for ch in channels:
            ch.close()
