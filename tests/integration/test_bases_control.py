"""Bases through the control plane (docs/bases.md), as zerodctl users see
them: FreezeJob, CreateJob on a base, DeleteJob of a base in use, and who
may do which.

- A standalone daemon (its in-process coordinator on DIR/control.sock):
  freeze a ready job and see it in `bases list`; its node hears of it
  through the same Watch path as a cluster's; a job created on it runs on
  its nodes with its world and dtype, anything else is refused naming the
  field; a job that is no base, a missing base, a base on a base and a
  base in use are refused with what to do.
- A coordinator with principals and two fake nodes (grpcio, the .proto
  files only): a base follows its placement, order included; another
  tenant builds on it only once it is shared (--share) or public, and can
  neither freeze it over nor delete it; a job still being created cannot be
  frozen; the base, its sharing and the jobs on it survive a restart of the
  coordinator (its state file).
"""

import hashlib
import json
import os
import subprocess

import grpc
import pytest

import ctlproto
from conftest import Coordinator, binary, wait_for


def run_ctl(target, *args, token_file=None):
    """zerodctl against target (HOST:PORT or unix:PATH): (rc, stdout, stderr)."""
    env = dict(os.environ)
    for name in ("ZEROD_COORDINATOR", "GRPC_VERBOSITY", "ZEROD_AUTH_TOKEN",
                 "ZEROD_AUTH_TOKEN_FILE"):
        env.pop(name, None)
    argv = [binary("zerodctl"), "--coordinator", target]
    if token_file is not None:
        argv += ["--auth-token-file", token_file]
    proc = subprocess.run(argv + list(args), capture_output=True, text=True, timeout=60, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def ok(target, *args, token_file=None):
    rc, out, err = run_ctl(target, *args, token_file=token_file)
    assert rc == 0 and err == "", "zerodctl %s: exit %d\n%s%s" % (" ".join(args), rc, out, err)
    return out


def ok_json(target, *args, token_file=None):
    return json.loads(ok(target, "--json", *args, token_file=token_file))


def refused(target, *args, token_file=None):
    """A call that fails (exit 1): its one error line."""
    rc, out, err = run_ctl(target, *args, token_file=token_file)
    assert rc == 1 and out == "", "zerodctl %s: exit %d\n%s%s" % (" ".join(args), rc, out, err)
    assert len(err.splitlines()) == 1, err
    return err.strip()


def table(out):
    """A zerodctl table as {first column: cells}."""
    lines = out.splitlines()
    return {line.split()[0]: line.split() for line in lines[1:]}, lines[0].split()


# ---------------------------------------------------------------------------
# Standalone
# ---------------------------------------------------------------------------

def test_freeze_build_on_and_delete_a_base_in_standalone(start_daemon):
    d = start_daemon(ranks=2)
    ctl = "unix:%s/control.sock" % d.dir

    def state(name):
        return ok_json(ctl, "jobs", "get", name)["state"]

    ok(ctl, "jobs", "create", "llama", "--ranks-per-node", "2")
    wait_for("llama to be ready", lambda: state("llama") == "ready")

    # Not yet a base: nothing builds on it.
    line = refused(ctl, "jobs", "create", "early", "--base", "llama")
    assert line == ("zerodctl: jobs create: FAILED_PRECONDITION: job 'llama' is not a base "
                    "(zerodctl jobs freeze llama)"), line
    assert "NOT_FOUND: no job named 'nope'" in refused(ctl, "jobs", "freeze", "nope")
    assert ok_json(ctl, "bases", "list") == {"bases": []}

    frozen = ok_json(ctl, "jobs", "freeze", "llama")
    assert (frozen["name"], frozen["frozen"], frozen["shared_with"], frozen["public"]) == \
        ("llama", True, [], False)
    bases = ok_json(ctl, "bases", "list")["bases"]
    assert [(b["name"], b["jobs_on_base"], b["world_size"]) for b in bases] == [("llama", 0, 2)]
    # The node hears it through its Watch stream, as a cluster's nodes do.
    wait_for("the node to freeze llama",
             lambda: 'msg="job frozen: it is a base now" job=llama' in d.read_log())

    # A base saves like any job, but nothing restores into it; a new job
    # restored from its checkpoint and frozen is a second base.
    ok(ctl, "checkpoint", "save", "llama", "c0")
    line = refused(ctl, "checkpoint", "restore", "llama", "c0")
    assert "FAILED_PRECONDITION: job 'llama' is a frozen base" in line, line
    ok(ctl, "jobs", "create", "llama2", "--ranks-per-node", "2")
    wait_for("llama2 to be ready", lambda: state("llama2") == "ready")
    ok(ctl, "checkpoint", "restore", "llama2", "llama/c0")
    assert ok_json(ctl, "jobs", "freeze", "llama2")["frozen"] is True
    ok(ctl, "jobs", "delete", "llama2")

    # A job on it: the base's node, ranks per node and dtype by default.
    lora = ok_json(ctl, "jobs", "create", "lora", "--base", "llama")["job"]
    assert lora["placement"] == frozen["placement"]
    assert (lora["ranks_per_node"], lora["world_size"]) == (2, 2)
    assert (lora["config"]["base_job"], lora["config"]["precision"]) == ("llama", "fp32")
    assert lora["frozen"] is False
    described = ok(ctl, "jobs", "get", "lora").splitlines()
    assert "base: llama" in described, described
    described = ok(ctl, "jobs", "get", "llama").splitlines()
    assert "frozen: yes (a base), shared with no other tenant; 1 job on it" in described, described

    # Anything else than the base's shape is refused, naming the field.
    assert refused(ctl, "jobs", "create", "bad", "--base", "llama", "--ranks-per-node", "1") == \
        "zerodctl: jobs create: INVALID_ARGUMENT: ranks_per_node is 1; base 'llama' has 2"
    assert refused(ctl, "jobs", "create", "bad", "--base", "llama", "--precision", "bf16") == \
        ("zerodctl: jobs create: INVALID_ARGUMENT: config.working_dtype is bf16; base 'llama' "
         "has f32")
    assert refused(ctl, "jobs", "create", "bad", "--base", "missing") == \
        "zerodctl: jobs create: NOT_FOUND: base job 'missing' does not exist"
    line = refused(ctl, "jobs", "freeze", "lora")
    assert "FAILED_PRECONDITION: job 'lora' is on base 'llama'" in line, line
    assert refused(ctl, "jobs", "create", "bad", "--base", "lora") == \
        ("zerodctl: jobs create: FAILED_PRECONDITION: job 'lora' is not a base "
         "(zerodctl jobs freeze lora)")

    rows, header = table(ok(ctl, "bases", "list"))
    assert header == ["NAME", "TENANT", "STATE", "WORLD", "NODES", "SHARED_WITH", "JOBS",
                      "CHECKPOINT"]
    assert list(rows) == ["llama"] and rows["llama"][header.index("JOBS")] == "1", rows
    # No unit was ever registered: there is nothing to save, so no checkpoint.
    assert rows["llama"][header.index("CHECKPOINT")] == "-", rows
    rows, header = table(ok(ctl, "jobs", "list"))
    assert rows["llama"][header.index("BASE")] == "frozen"
    assert rows["lora"][header.index("BASE")] == "llama"

    # A base in use stays; once its jobs are deleted it goes.
    assert refused(ctl, "jobs", "delete", "llama") == \
        ("zerodctl: jobs delete: FAILED_PRECONDITION: base 'llama' is used by job lora; "
         "delete it first")
    assert ok_json(ctl, "jobs", "get", "llama")["frozen"] is True
    ok(ctl, "jobs", "delete", "lora")
    ok(ctl, "jobs", "delete", "llama")
    wait_for("both jobs to go", lambda: ok_json(ctl, "jobs", "list") == {"jobs": []})


# ---------------------------------------------------------------------------
# A coordinator with principals, and fake nodes
# ---------------------------------------------------------------------------

TOKENS = {
    "admin": "admin-secret-bases-0",
    "alice": "alice-secret-bases-1",  # tenant team-a: owns the base
    "bob": "bob-secret-bases-2",  # tenant team-b
    "carol": "carol-secret-bases-3",  # tenant team-c
    "nodes": "nodes-secret-bases-4",  # the node principal "*"
}
LEASE_TTL_S = 60  # the fake nodes heartbeat when told to; they must outlive the test


def sha(token):
    return hashlib.sha256(token.encode()).hexdigest()


class FakeNodes:
    """Nodes as the coordinator sees them: they join and, when asked,
    heartbeat with every job they were told of reported ready."""

    def __init__(self, address):
        modules = ctlproto.load()
        self.pb = modules.control
        self.stubs = modules.control_grpc
        self.md = (("authorization", "Bearer " + TOKENS["nodes"]),)
        self.connect(address)

    def connect(self, address):
        self.channel = grpc.insecure_channel(address)
        self.cluster = self.stubs.ClusterStub(self.channel)
        self.sessions = {}

    def join(self, name, ranks=2):
        node = self.pb.NodeInfo(name=name, address="127.0.0.1", ranks=ranks, version="test")
        reply = self.cluster.Join(self.pb.JoinRequest(node=node), metadata=self.md, timeout=10)
        self.sessions[name] = reply.session

    def report_ready(self, *jobs):
        for name, session in self.sessions.items():
            self.cluster.Heartbeat(self.pb.HeartbeatRequest(
                node=name, session=session,
                jobs=[self.pb.JobStatus(job=j, ready=True) for j in jobs]),
                metadata=self.md, timeout=10)

    def close(self):
        self.channel.close()


@pytest.fixture
def secured(tmp_path):
    """A coordinator with principals, nodes n1 and n2 joined (2 ranks
    each), and a token file per principal."""
    principals = tmp_path / "principals"
    principals.write_text("\n".join([
        "admin admin  -      token-sha256:%s" % sha(TOKENS["admin"]),
        "alice tenant team-a token-sha256:%s" % sha(TOKENS["alice"]),
        "bob   tenant team-b token-sha256:%s" % sha(TOKENS["bob"]),
        "carol tenant team-c token-sha256:%s" % sha(TOKENS["carol"]),
        "*     node   -      token-sha256:%s" % sha(TOKENS["nodes"]),
    ]) + "\n")
    files = {}
    for who, token in TOKENS.items():
        path = tmp_path / ("%s.token" % who)
        path.write_text(token + "\n")
        files[who] = str(path)
    coord = Coordinator(tmp_path, lease_ttl_s=LEASE_TTL_S,
                        extra=["--auth-file", str(principals)])
    nodes = FakeNodes(coord.address)
    nodes.join("n1")
    nodes.join("n2")
    yield coord, nodes, files
    nodes.close()
    coord.stop()


def test_bases_across_tenants_and_a_coordinator_restart(secured):
    coord, nodes, files = secured
    addr = coord.address

    def as_(who, *args):
        return ok(addr, *args, token_file=files[who])

    def as_json(who, *args):
        return ok_json(addr, *args, token_file=files[who])

    def refused_as(who, *args):
        return refused(addr, *args, token_file=files[who])

    # A base placed n2 first: jobs on it follow that order.
    as_("alice", "jobs", "create", "base", "--node", "n2,n1")
    # Still being created (no node has reported it): not yet a base.
    line = refused_as("alice", "jobs", "freeze", "base")
    assert line == ("zerodctl: jobs freeze: FAILED_PRECONDITION: job 'base' is creating, not "
                    "ready: only a ready job can be frozen"), line
    nodes.report_ready("base")
    assert as_json("alice", "jobs", "get", "base")["state"] == "ready"
    # Only its owner (or an admin) freezes it.
    line = refused_as("bob", "jobs", "freeze", "base")
    assert "PERMISSION_DENIED: tenant bob of tenant team-b may not freeze job 'base'" in line
    as_("alice", "jobs", "freeze", "base")

    mine = as_json("alice", "jobs", "create", "mine", "--base", "base")["job"]
    assert [p["node"] for p in mine["placement"]] == ["n2", "n1"]
    assert (mine["tenant"], mine["ranks_per_node"]) == ("team-a", 1)
    line = refused_as("alice", "jobs", "create", "swapped", "--base", "base", "--node", "n1,n2")
    assert line == ("zerodctl: jobs create: INVALID_ARGUMENT: node_names[0] is 'n1'; base "
                    "'base' has 'n2' there (a job on a base runs on its nodes, in its order)"), line

    # Another tenant: neither reads nor builds on it without a grant.
    assert as_json("bob", "bases", "list") == {"bases": []}
    assert refused_as("bob", "jobs", "create", "theirs", "--base", "base") == \
        ("zerodctl: jobs create: PERMISSION_DENIED: tenant 'team-b' may not build on base "
         "'base' (owner 'team-a')")
    # Shared with team-b: bob reads it and builds on it; carol still not.
    shared = as_json("alice", "jobs", "freeze", "base", "--share", "team-b")
    assert (shared["shared_with"], shared["public"]) == (["team-b"], False)
    assert [b["name"] for b in as_json("bob", "bases", "list")["bases"]] == ["base"]
    theirs = as_json("bob", "jobs", "create", "theirs", "--base", "base")["job"]
    assert theirs["tenant"] == "team-b" and theirs["config"]["base_job"] == "base"
    assert "PERMISSION_DENIED: tenant 'team-c' may not build on base 'base'" in \
        refused_as("carol", "jobs", "create", "carols", "--base", "base")
    # A tenant it is shared with may neither freeze it over nor delete it.
    assert "PERMISSION_DENIED" in refused_as("bob", "jobs", "freeze", "base", "--public")
    assert "PERMISSION_DENIED" in refused_as("bob", "jobs", "delete", "base")
    # Public: every tenant.
    as_("alice", "jobs", "freeze", "base", "--public")
    as_("carol", "jobs", "create", "carols", "--base", "base")
    # Its owner sees every job on it, whoever owns them.
    assert as_json("alice", "jobs", "get", "base")["jobs_on_base"] == 3

    # The coordinator restarts: the base, its sharing and the jobs on it
    # come back from its state file.
    coord.stop()
    coord.start()
    nodes.close()
    nodes.connect(coord.address)
    nodes.join("n1")
    nodes.join("n2")
    base = as_json("admin", "jobs", "get", "base")
    assert (base["frozen"], base["public"], base["jobs_on_base"]) == (True, True, 3), base
    assert as_json("admin", "jobs", "get", "theirs")["config"]["base_job"] == "base"
    line = refused_as("alice", "jobs", "delete", "base")
    assert line == ("zerodctl: jobs delete: FAILED_PRECONDITION: base 'base' is used by jobs "
                    "carols, mine, theirs; delete them first"), line
    # Freezing again replaces the sharing: no longer public, team-c only.
    again = as_json("alice", "jobs", "freeze", "base", "--share", "team-c")
    assert (again["shared_with"], again["public"]) == (["team-c"], False)
    assert "PERMISSION_DENIED" in refused_as("bob", "jobs", "create", "more", "--base", "base")
    as_("carol", "jobs", "create", "more", "--base", "base")
    for job, who in [("carols", "carol"), ("more", "carol"), ("mine", "alice"),
                     ("theirs", "bob")]:
        as_(who, "jobs", "delete", job)
    as_("alice", "jobs", "delete", "base")
