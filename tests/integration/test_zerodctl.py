"""zerodctl against a real coordinator, as a black box.

A `zerod coordinator` on a free loopback port, fake nodes joined through
grpcio (modules generated from the .proto files by ctlproto.py), and the
zerodctl binary run as a user or a script would: human tables, --json
objects parsed and checked, and the failure contract (exit 1 for a failed
call, 2 for a usage error, one line on stderr and nothing else).
"""

import json
import os
import re
import subprocess
import time

import grpc
import pytest

import ctlproto
from conftest import Coordinator, binary, free_port

LEASE_TTL_S = 60  # the fake nodes never heartbeat; they must outlive the test
GIB = 1 << 30


class FakeNodes:
    """Nodes that Join through grpcio and then stay silent (long lease)."""

    def __init__(self, address):
        modules = ctlproto.load()
        self.pb = modules.control
        self.channel = grpc.insecure_channel(address)
        self.cluster = modules.control_grpc.ClusterStub(self.channel)
        self.jobs = modules.control_grpc.JobsStub(self.channel)

    def join(self, name, ranks=1, devices=(), memory_bytes=16 * GIB):
        pb = self.pb
        node = pb.NodeInfo(
            name=name, address="10.1.0.%d" % (len(name) + ranks), ranks=ranks,
            devices=[pb.Device(kind=kind, index=i, name=dev_name, memory_bytes=mem)
                     for i, (kind, dev_name, mem) in enumerate(devices)],
            memory_bytes=memory_bytes, version="0.1.0")
        return self.cluster.Join(pb.JoinRequest(node=node), timeout=10)

    def close(self):
        self.channel.close()


@pytest.fixture
def coordinator(tmp_path):
    c = Coordinator(tmp_path, lease_ttl_s=LEASE_TTL_S)
    yield c
    c.stop()


@pytest.fixture
def nodes(coordinator):
    n = FakeNodes(coordinator.address)
    yield n
    n.close()


def ctl(*args, address=None, env=None, timeout=60):
    """Runs zerodctl; returns (returncode, stdout, stderr)."""
    full_env = dict(os.environ)
    full_env.pop("ZEROD_COORDINATOR", None)
    full_env.pop("GRPC_VERBOSITY", None)
    full_env.update(env or {})
    argv = [binary("zerodctl")]
    if address is not None:
        argv += ["--coordinator", address]
    proc = subprocess.run(argv + list(args), capture_output=True, text=True, timeout=timeout,
                          env=full_env)
    return proc.returncode, proc.stdout, proc.stderr


def ok(*args, address):
    rc, out, err = ctl(*args, address=address)
    assert rc == 0 and err == "", "zerodctl %s: exit %d\nstdout:\n%s\nstderr:\n%s" % (
        " ".join(args), rc, out, err)
    return out


def ok_json(*args, address):
    out = ok("--json", *args, address=address)
    assert out.count("\n") == 1 and out.endswith("\n"), "not one JSON line: %r" % out
    return json.loads(out)


def failure(expected_rc, *args, address=None, env=None, timeout=60):
    """Runs a zerodctl command that must fail; returns its one stderr line."""
    rc, out, err = ctl(*args, address=address, env=env, timeout=timeout)
    assert rc == expected_rc, "zerodctl %s: expected exit %d, got %d\nstdout:\n%s\nstderr:\n%s" % (
        " ".join(args), expected_rc, rc, out, err)
    assert out == "", "nothing on stdout expected, got %r" % out
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), "one line on stderr expected, got %r" % err
    assert lines[0].startswith("zerodctl: "), lines[0]
    return lines[0]


def columns(header):
    """Start offsets of a table's columns, from its header line."""
    return [m.start() for m in re.finditer(r"\S+", header)]


# ---------------------------------------------------------------------------
# health
# ---------------------------------------------------------------------------

def test_health_is_serving(coordinator):
    assert ok("health", address=coordinator.address) == "SERVING\n"
    assert ok_json("health", address=coordinator.address) == {"service": "",
                                                               "status": "serving"}


def test_coordinator_comes_from_the_environment(coordinator):
    rc, out, err = ctl("health", env={"ZEROD_COORDINATOR": coordinator.address})
    assert (rc, out, err) == (0, "SERVING\n", "")


# ---------------------------------------------------------------------------
# members
# ---------------------------------------------------------------------------

def test_members_table_lists_the_joined_nodes(coordinator, nodes):
    nodes.join("node-b", ranks=1, memory_bytes=8 * GIB)
    nodes.join("node-a", ranks=2, devices=[("cpu", "", 0), ("cpu", "", 0)],
               memory_bytes=int(15.6 * GIB))
    out = ok("members", address=coordinator.address)
    lines = out.splitlines()
    assert re.fullmatch(r"epoch: \d+", lines[0]), out
    assert lines[1].split() == ["NAME", "ADDRESS", "RANKS", "DEVICES", "MEMORY", "LEASE",
                                "JOINED"], out
    rows = lines[2:]
    assert [r.split()[0] for r in rows] == ["node-a", "node-b"], out
    # Aligned: every cell starts where its column's header starts.
    starts = columns(lines[1])
    for row in rows:
        for col, start in enumerate(starts):
            assert row[start] != " " and (start == 0 or row[start - 1] == " "), (
                "column %d of %r is not aligned with the header\n%s" % (col, row, out))
    a = rows[0]
    assert "cpu:2" in a and "15.6 GiB" in a, out
    lease = a[starts[5]:].split()[0]
    assert re.fullmatch(r"\d+\.\ds", lease) and 0 < float(lease[:-1]) <= LEASE_TTL_S, out
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", a[starts[6]:].strip()), out
    assert "8.0 GiB" in rows[1], out
    assert not any(line != line.rstrip() for line in lines), "trailing blanks:\n" + out


def assert_ints(obj, *keys):
    """Counts are JSON integers: 3, never 3.0 (bool is not a count)."""
    for key in keys:
        assert type(obj[key]) is int, (key, obj[key])


def test_members_json(coordinator, nodes):
    joined = nodes.join("node-a", ranks=2, devices=[("cpu", "", 0), ("cpu", "", 0)],
                        memory_bytes=GIB)
    view = ok_json("members", address=coordinator.address)
    assert set(view) == {"epoch", "members"} and view["epoch"] >= 1
    assert_ints(view, "epoch")
    [m] = view["members"]
    assert m["name"] == "node-a" and m["ranks"] == 2 and m["memory_bytes"] == GIB
    assert m["version"] == "0.1.0" and m["address"].startswith("10.1.0.")
    assert [d["kind"] for d in m["devices"]] == ["cpu", "cpu"]
    assert 0 < m["lease_remaining_ms"] <= LEASE_TTL_S * 1000
    assert m["joined_unix_ms"] > 0 and isinstance(m["joined_unix_ms"], int)
    # A 64-bit id is a string (jq and JavaScript would round a number),
    # exactly the session the coordinator gave the node: a random 64-bit
    # value, so a double would lose its low digits.
    assert m["session"] == str(joined.session), (m["session"], joined.session)
    assert_ints(m, "ranks", "memory_bytes", "joined_unix_ms", "lease_remaining_ms")
    assert_ints(m["devices"][0], "index", "memory_bytes")


def test_json_strings_round_trip(coordinator, nodes):
    """Quotes, backslashes and UTF-8 from the coordinator come back as
    sent (it refuses control characters in names)."""
    name = 'dev "0" \\ é ✓'
    nodes.join("node-a", devices=[("cpu", name, 0)])
    [m] = ok_json("members", address=coordinator.address)["members"]
    assert m["devices"][0]["name"] == name, m["devices"]


def test_ids_survive_a_reader_of_doubles(coordinator, nodes):
    """The session parsed as a double, as jq and JavaScript parse a number,
    is rounded; the string zerodctl prints is not."""
    sessions = [nodes.join("node-%d" % i).session for i in range(8)]
    printed = {m["name"]: m["session"] for m in ok_json(
        "members", address=coordinator.address)["members"]}
    assert sorted(printed.values()) == sorted(str(s) for s in sessions)
    # Sessions are random 64-bit values: at least one of 8 is past 2^53,
    # where a double cannot hold every integer.
    big = [s for s in sessions if s > 2 ** 53]
    assert big and any(int(float(s)) != s for s in big), sessions


# ---------------------------------------------------------------------------
# jobs
# ---------------------------------------------------------------------------

def test_jobs_create_list_get_delete(coordinator, nodes):
    addr = coordinator.address
    nodes.join("node-a", ranks=2)
    nodes.join("node-b", ranks=2)

    created = ok_json("jobs", "create", "llm", "--nodes", "2", "--ranks-per-node", "2",
                      "--optimizer", "adamw", "--lr", "0.0003", "--betas", "0.9,0.95",
                      "--weight-decay", "0.1", "--eps", "1e-6", "--precision", "bf16",
                      "--max-grad-norm", "1.0", "--max-live-bytes", "512M",
                      "--collectives", "flat", "--token", "llm-secret", address=addr)
    assert created["token"] == "llm-secret"
    job = created["job"]
    assert job["name"] == "llm" and job["world_size"] == 4
    # The id is a string equal to the coordinator's id; counts are ints.
    by_grpc = nodes.jobs.GetJob(nodes.pb.GetJobRequest(name="llm"), timeout=10)
    assert job["id"] == str(by_grpc.id) and by_grpc.id > 0, (job["id"], by_grpc.id)
    assert_ints(job, "nodes", "ranks_per_node", "world_size", "step", "epoch",
                "created_unix_ms", "jobs_on_base", "replica_step")
    assert_ints(job["placement"][0], "first_rank", "ranks")
    assert_ints(job["config"], "quantization_block", "max_live_bytes", "hpz_partition_size")
    assert job["nodes"] == 2 and job["ranks_per_node"] == 2
    assert job["placement"] == [{"node": "node-a", "first_rank": 0, "ranks": 2},
                                {"node": "node-b", "first_rank": 2, "ranks": 2}]
    opt = job["config"]["optimizer"]
    assert opt["kind"] == "adamw" and opt["lr"] == 0.0003
    assert (opt["beta1"], opt["beta2"], opt["eps"]) == (0.9, 0.95, 1e-6)
    assert opt["weight_decay"] == 0.1 and opt["has_weight_decay"] is True
    assert job["config"]["precision"] == "bf16"
    assert job["config"]["collectives"] == "flat"
    assert job["config"]["max_grad_norm"] == 1.0
    assert job["config"]["max_live_bytes"] == 512 << 20
    assert job["state"] in ("creating", "ready", "degraded")

    # Human output: the job, then the token on its own line.
    out = ok("jobs", "create", "small", "--node", "node-b", "--optimizer", "sgd",
             "--momentum", "0.9", "--offload-optimizer", "nvme", "--offload-buffer-count", "3",
             "--offload-buffer-size", "2048", address=addr)
    assert ("optimizer state: on disk (nvme) in the nodes' --nvme-dir, 3 buffers of 2048 "
            "elements") in out.splitlines(), out
    lines = out.splitlines()
    assert "name: small" in lines and "optimizer: sgd" in lines and "world size: 1" in lines
    tokens = [line for line in lines if line.startswith("token: ")]
    assert len(tokens) == 1 and len(tokens[0]) > len("token: "), out
    assert "  node-b: rank 0" in lines, out

    listed = ok_json("jobs", "list", address=addr)
    assert [j["name"] for j in listed["jobs"]] == ["llm", "small"]
    assert listed["jobs"][0]["config"]["precision"] == "bf16"
    assert listed["jobs"][1]["config"]["optimizer"]["kind"] == "sgd"
    assert listed["jobs"][1]["config"]["optimizer"]["momentum"] == 0.9
    assert listed["jobs"][1]["placement"] == [{"node": "node-b", "first_rank": 0, "ranks": 1}]
    small = listed["jobs"][1]["config"]
    assert (small["offload_optimizer"], small["nvme_path"], small["offload_buffer_count"],
            small["offload_buffer_size"]) == ("nvme", "", 3, 2048)
    assert listed["jobs"][0]["config"]["offload_optimizer"] == "none"

    table = ok("jobs", "list", address=addr).splitlines()
    assert table[0].split() == ["NAME", "STATE", "WORLD", "NODES", "OPTIMIZER", "PRECISION",
                                "STEP", "BASE", "REASON"]
    llm = table[1].split()
    assert llm[0] == "llm" and llm[2] == "4" and llm[3] == "node-a,node-b", table
    assert llm[4:6] == ["adamw", "bf16"], table

    # Reals in their shortest exact form: 0.9, not 0.90000000000000002.
    raw = ok("--json", "jobs", "get", "llm", address=addr)
    assert '"lr":0.0003,"beta1":0.9,"beta2":0.95,"eps":1e-6,' in raw, raw
    got = ok_json("jobs", "get", "llm", address=addr)
    assert got["name"] == "llm" and got["id"] == job["id"]
    assert got["placement"] == job["placement"] and got["config"] == job["config"]
    assert "token" not in got

    described = ok("jobs", "get", "llm", address=addr).splitlines()
    for line in ("name: llm", "world size: 4", "placement:", "  node-a: ranks 0-1",
                 "  node-b: ranks 2-3", "optimizer: adamw", "lr: 0.0003", "betas: 0.9,0.95",
                 "precision: bf16", "collectives: flat", "max grad norm: 1",
                 "optimizer state: in memory (none)",
                 "max live bytes: 512.0 MiB"):
        assert line in described, "%r missing from:\n%s" % (line, "\n".join(described))

    assert ok_json("jobs", "delete", "llm", address=addr) == {"deleted": "llm"}
    assert ok("jobs", "delete", "small", address=addr) == "deleted job small\n"
    assert ok_json("jobs", "list", address=addr) == {"jobs": []}
    assert ok("jobs", "list", address=addr).splitlines()[0].startswith("NAME")
    line = failure(1, "jobs", "get", "llm", address=addr)
    assert "NOT_FOUND" in line


def test_options_after_the_command_and_before_it_agree(coordinator, nodes):
    nodes.join("node-a")
    ok("jobs", "create", "j1", address=coordinator.address)
    a = ok_json("jobs", "get", "j1", address=coordinator.address)
    rc, out, err = ctl("jobs", "get", "j1", "--json", "--coordinator", coordinator.address,
                       "--timeout", "5")
    assert rc == 0 and err == "" and json.loads(out) == a


# ---------------------------------------------------------------------------
# Failures: exit status and one line on stderr
# ---------------------------------------------------------------------------

def test_unknown_job_is_not_found(coordinator):
    line = failure(1, "jobs", "get", "no-such-job", address=coordinator.address)
    assert line.startswith("zerodctl: jobs get: NOT_FOUND: "), line
    line = failure(1, "--json", "jobs", "delete", "no-such-job", address=coordinator.address)
    assert "NOT_FOUND" in line, line


def test_duplicate_create_is_already_exists(coordinator, nodes):
    nodes.join("node-a")
    ok("jobs", "create", "dup", address=coordinator.address)
    line = failure(1, "jobs", "create", "dup", address=coordinator.address)
    assert line.startswith("zerodctl: jobs create: ALREADY_EXISTS: "), line


def test_create_without_room_fails_with_the_coordinators_reason(coordinator, nodes):
    nodes.join("node-a", ranks=1)
    line = failure(1, "jobs", "create", "big", "--nodes", "3", address=coordinator.address)
    assert line.startswith("zerodctl: jobs create: "), line


@pytest.mark.parametrize("args", [
    ["--bogus", "members"],
    ["members", "--nodes", "2"],
    ["jobs"],
    ["jobs", "frobnicate"],
    ["jobs", "get"],
    ["jobs", "get", "bad name"],
    ["jobs", "create", "x", "--nodes", "zero"],
    ["jobs", "create", "x", "--optimizer", "lion"],
    ["jobs", "create", "x", "--betas", "0.9"],
    ["jobs", "create", "x", "--precision", "fp8"],
    ["jobs", "create", "x", "--collectives", "ring"],
    ["jobs", "create", "x", "--max-live-bytes", "lots"],
    ["--timeout", "-1", "health"],
    ["--coordinator", "no-port", "health"],
    ["health", "a", "b"],
    ["launch"],
    [],
])
def test_usage_errors_exit_2(coordinator, args):
    failure(2, *args, address=None if "--coordinator" in args else coordinator.address)


def test_help_and_version():
    rc, out, err = ctl("--help")
    assert rc == 0 and err == "" and "jobs create" in out and "members" in out
    rc, out, err = ctl("jobs", "create", "--help")
    assert rc == 0 and err == "" and "--ranks-per-node" in out and "--deepspeed-config" in out
    rc, out, err = ctl("--version")
    assert rc == 0 and err == "" and re.fullmatch(r"zerodctl \d+\.\d+\.\d+\n", out)


def test_unreachable_coordinator_fails_within_the_timeout():
    address = "127.0.0.1:%d" % free_port()
    t0 = time.monotonic()
    line = failure(1, "--timeout", "3", "members", address=address)
    elapsed = time.monotonic() - t0
    assert line.startswith("zerodctl: cannot reach the coordinator at %s: " % address), line
    assert "UNAVAILABLE" in line, line
    assert elapsed < 3 + 5, "took %.1fs with --timeout 3" % elapsed


def test_stopped_coordinator_is_unavailable_not_a_hang(tmp_path):
    c = Coordinator(tmp_path, lease_ttl_s=LEASE_TTL_S)
    address = c.address
    c.stop()
    t0 = time.monotonic()
    line = failure(1, "--timeout", "2", "jobs", "list", address=address)
    assert "cannot reach the coordinator" in line, line
    assert time.monotonic() - t0 < 2 + 5
