"""A real cluster on loopback: a coordinator, node daemons that join it
(distinct sockets and Gloo ports), and worker processes on every node.

- Training through 3 nodes equals the single-process reference bit for
  bit: summing in rank order with flat collectives, node by node with the
  default hierarchical ones, whose all-gathers and reduce-scatters send N,
  not W, slices between nodes (the ranks' counters, zd_job_stats).
- Membership: a SIGKILLed node leaves the view within its lease TTL, its job
  turns degraded with a reason, its workers on the other nodes get an error
  instead of hanging, and another job goes on; a restarted coordinator still
  lists the jobs and the nodes re-join it; a restarted node re-joins.

The control plane is driven through Python grpcio with modules generated
from the .proto files only (ctlproto.py).
"""

import math
import mmap
import os
import re
import struct
import subprocess
import time

import grpc
import pytest

import ctlproto
import zdraw as z
from conftest import binary, run_worker

# Small enough for the sanitizer build; the global batch divides by 3 and 6.
MODEL = ["--hidden", "128", "--batch", "48", "--steps", "20", "--log-every", "5"]
TOKEN = "cluster-test-token"


class Control:
    """The coordinator's services, through grpcio."""

    def __init__(self, address):
        mods = ctlproto.load()
        self.pb, self.ipc = mods.control, mods.ipc
        self.channel = grpc.insecure_channel(address)
        self.jobs = mods.control_grpc.JobsStub(self.channel)
        self.cluster = mods.control_grpc.ClusterStub(self.channel)

    def close(self):
        self.channel.close()

    def create_job(self, name, nodes, ranks_per_node, node_names=(), collectives=0, **config):
        pb, ipc = self.pb, self.ipc
        config = ipc.JobConfig(optimizer=ipc.OptimizerConfig(kind=ipc.OPTIMIZER_ADAMW, lr=1e-3),
                               collectives=collectives, **config)
        return self.jobs.CreateJob(pb.CreateJobRequest(
            name=name, config=config, nodes=nodes, ranks_per_node=ranks_per_node,
            node_names=list(node_names), token=TOKEN), timeout=10)

    def job(self, name):
        return self.jobs.GetJob(self.pb.GetJobRequest(name=name), timeout=10)

    def state(self, name):
        return self.pb.JobState.Name(self.job(name).state)

    def members(self):
        view = self.cluster.GetView(self.pb.GetViewRequest(), timeout=10)
        return sorted(m.node.name for m in view.members), view.epoch

    def wait(self, what, predicate, timeout_s=30):
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                last = predicate()
                if last:
                    return last
            except grpc.RpcError as e:  # e.g. the coordinator is restarting
                last = e
            time.sleep(0.05)
        raise AssertionError("timed out waiting for %s (last: %r)" % (what, last))

    def wait_state(self, name, state, timeout_s=30):
        self.wait("job %s to be %s" % (name, state),
                  lambda: self.state(name) == state, timeout_s)


@pytest.fixture
def control(cluster):
    made = []

    def make():
        c = Control(cluster.coordinator.address)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def start_workers(node, job, nranks, dump=None, extra=()):
    procs = []
    for r in range(nranks):
        args = [binary("zerod-mlp-train"), "--socket", node.socket, "--job", job,
                "--local-rank", str(r), "--token", TOKEN] + MODEL + list(extra)
        if dump is not None and r == 0:
            args += ["--dump", str(dump)]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def finish(procs, nodes, timeout=600):
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append((p.returncode, out, err))
    for rc, out, err in results:
        assert rc == 0, "worker failed:\n%s\n%s\n%s" % (
            out, err, "\n".join(n.read_log()[-3000:] for n in nodes))
    return results


def stats_of(out):
    """{(rank, level, collective): (bytes, calls)} from --stats lines."""
    found = {}
    for line in out.splitlines():
        f = line.split()
        if f[:1] == ["stats"]:
            found[(int(f[2]), f[4], f[6])] = (int(f[8]), int(f[10]))
    return found


@pytest.mark.parametrize("ranks_per_node,collectives", [(1, "hierarchical"), (2, "hierarchical"),
                                                        (2, "flat")])
def test_three_nodes_train_like_one_process(cluster, control, tmp_path, ranks_per_node,
                                            collectives):
    cluster.start_coordinator()
    nodes = [cluster.start_node("node-%s" % n, ranks=ranks_per_node) for n in "abc"]
    ctl = control()
    ctl.wait("3 members", lambda: ctl.members()[0] == ["node-a", "node-b", "node-c"])
    reply = ctl.create_job("mlp", 3, ranks_per_node, collectives=getattr(
        ctl.ipc, "COLLECTIVES_" + collectives.upper()))
    world = 3 * ranks_per_node
    assert reply.job.world_size == world
    assert [(p.node, p.first_rank, p.ranks) for p in reply.job.placement] == [
        ("node-%s" % n, i * ranks_per_node, ranks_per_node) for i, n in enumerate("abc")]
    ctl.wait_state("mlp", "JOB_STATE_READY")

    # Node a hosts global rank 0, which writes the dump.
    dump = tmp_path / "cluster.bin"
    procs = []
    for i, node in enumerate(nodes):
        procs += start_workers(node, "mlp", ranks_per_node, dump if i == 0 else None,
                               extra=["--stats"])
    results = finish(procs, nodes)
    # Bit for bit, against a reference that sums as the communicator does:
    # in rank order (flat), or node by node (hierarchical).
    grouping = ["--ranks-per-node", str(ranks_per_node)] if collectives == "hierarchical" else []
    run_worker([binary("zerod-mlp-reference"), "--world", str(world), "--compare", str(dump),
                "--tolerance", "0"] + grouping + MODEL)
    # Node a's ranks: what crossed between nodes, and what stayed inside.
    stats = stats_of(results[0][1])
    for rank in range(ranks_per_node):
        gathers = {lv: stats.get((rank, lv, "all_gather"), (0, 0))[0]
                   for lv in ("node", "cross", "world")}
        reduces = {lv: stats.get((rank, lv, "reduce_scatter"), (0, 0))[0]
                   for lv in ("node", "cross", "world")}
        if collectives == "flat":
            assert gathers["world"] > 0 and gathers["node"] == gathers["cross"] == 0, stats
            assert reduces["world"] > 0 and reduces["cross"] == 0, stats
        else:
            # N slices cross between nodes where the whole unit is W: 1/L.
            assert gathers["world"] == 0 and gathers["cross"] > 0, stats
            assert gathers["cross"] * ranks_per_node == gathers["node"], stats
            assert reduces["cross"] * ranks_per_node == reduces["node"], stats
    # The nodes report their progress with their heartbeats.
    ctl.wait("the step to be reported", lambda: ctl.job("mlp").step >= 20)


def test_workers_save_and_restore_checkpoints_across_nodes(cluster, control, tmp_path):
    """The workers of a job on two nodes take a service checkpoint themselves
    after step 10 (zd_checkpoint_save: node a asks the coordinator, node b
    reads the answer from the rendezvous store) and train on to step 20;
    workers started again restore it (zd_checkpoint_restore, with every
    worker attached and waiting) and train steps 11..20 again: the same
    bits as the first run."""
    coord = cluster.start_coordinator()
    nodes = [cluster.start_node("node-%s" % n, ranks=2) for n in "ab"]
    ctl = control()
    ctl.wait("2 members", lambda: ctl.members()[0] == ["node-a", "node-b"])
    ctl.create_job("ck", 2, 2)
    ctl.wait_state("ck", "JOB_STATE_READY")

    straight, resumed = tmp_path / "straight.bin", tmp_path / "resumed.bin"
    procs = []
    for i, node in enumerate(nodes):
        procs += start_workers(node, "ck", 2, straight if i == 0 else None,
                               extra=["--save-at", "10"])
    results = finish(procs, nodes)
    assert "saved checkpoint step-00000010: step 10" in results[0][1], results[0][1]
    saved = coord.state_dir / "checkpoints" / "ck" / "step-00000010"
    assert sorted(p.name for p in saved.iterdir()) == [
        "manifest.json"] + ["rank-%05d-of-00004.zdshard" % r for r in range(4)]

    procs = []
    for i, node in enumerate(nodes):
        procs += start_workers(node, "ck", 2, resumed if i == 0 else None,
                               extra=["--restore", "step-00000010"])
    results = finish(procs, nodes)
    out = results[0][1]
    assert "restored checkpoint step-00000010: step 10" in out, out
    assert "done: 10 steps" in out, out
    assert resumed.read_bytes() == straight.read_bytes()

    # A checkpoint the job does not have: every worker gets the error, on
    # both nodes, and the job stays ready.
    procs = []
    for node in nodes:
        procs += start_workers(node, "ck", 2, extra=["--restore", "nope"])
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 1 and "NOT_FOUND" in err and "nope" in err, (out, err)
    ctl.wait_state("ck", "JOB_STATE_READY")


def test_nvme_offload_across_nodes_trains_like_memory(cluster, control, tmp_path):
    """A job of 2 nodes x 2 ranks whose optimizer state is in each rank's
    tier file (offload_optimizer nvme, small buffers: many chunks) trains
    to the bytes of the same job in memory; each node has its ranks' files
    while it runs."""
    cluster.start_coordinator()
    nodes = [cluster.start_node("node-%s" % n, ranks=2) for n in "ab"]
    ctl = control()
    ctl.wait("2 members", lambda: ctl.members()[0] == ["node-a", "node-b"])
    ipc = ctl.ipc
    ctl.create_job("mem", 2, 2)
    ctl.create_job("nv", 2, 2, offload_optimizer=ipc.OffloadConfig(
        device=ipc.OFFLOAD_DEVICE_NVME, buffer_count=3, buffer_size=4096))
    ctl.wait_state("mem", "JOB_STATE_READY")
    ctl.wait_state("nv", "JOB_STATE_READY")
    dumps = {}
    for job in ("mem", "nv"):
        dumps[job] = tmp_path / ("%s.bin" % job)
        procs = []
        for i, node in enumerate(nodes):
            procs += start_workers(node, job, 2, dumps[job] if i == 0 else None)
        finish(procs, nodes)
    assert dumps["nv"].read_bytes() == dumps["mem"].read_bytes()
    for node, ranks in zip(nodes, ((0, 1), (2, 3))):
        files = sorted(p.name for p in (node.dir / "nvme").glob("nv-*/rank-*.zdtier"))
        assert files == ["rank-%05d.zdtier" % r for r in ranks], files


def final_loss(out):
    m = re.search(r"^done: \d+ steps, loss [\d.]+ -> ([\d.]+)", out, re.M)
    assert m, out
    return float(m.group(1))


def test_zeropp_quantizes_what_crosses_nodes(cluster, control, tmp_path):
    """ZeRO++ on 2 nodes x 2 ranks: with qwZ the weights cross between nodes
    as int8 blocks (at most 0.53x the bytes of bf16 gathers), with int4 qgZ
    the gradients do (at most 0.3x the bytes of bf16 gradients), counted by
    the ranks; training with either lands within 2% of the loss without."""
    cluster.start_coordinator()
    nodes = [cluster.start_node("node-%s" % n, ranks=2) for n in "ab"]
    ctl = control()
    ctl.wait("2 members", lambda: ctl.members()[0] == ["node-a", "node-b"])
    runs = {}
    for name, config in (("plain", {}), ("bf16", {"working_dtype": ctl.ipc.DTYPE_BF16}),
                         ("qwz", {"quantized_weights": True}),
                         ("bf16grads", {"gradient_comm_dtype": ctl.ipc.DTYPE_BF16}),
                         ("qgz4", {"quantized_gradients": 4})):
        ctl.create_job(name, 2, 2, **config)
        ctl.wait_state(name, "JOB_STATE_READY")
        procs = []
        for node in nodes:
            procs += start_workers(node, name, 2, extra=["--stats"])
        results = finish(procs, nodes)
        # Bytes per call: a worker reads the counters when it is done, and
        # its peer rank may still be running a prefetch, so totals may
        # differ by a call from run to run; a call's bytes do not.
        stats = stats_of(results[0][1])
        gather = stats[(0, "cross", "all_gather")]
        reduce = stats[(0, "cross", "reduce_scatter")]
        runs[name] = (final_loss(results[0][1]), gather[0] / gather[1], reduce[0] / reduce[1])
    plain_loss, fp32_gather, fp32_grads = runs["plain"]
    _, bf16_gather, _ = runs["bf16"]
    qwz_loss, qwz_gather, _ = runs["qwz"]
    assert bf16_gather == fp32_gather / 2, runs
    assert qwz_gather <= 0.53 * bf16_gather, runs
    assert abs(qwz_loss - plain_loss) <= 0.02 * plain_loss, runs
    bf16_grads = runs["bf16grads"][2]
    qgz_loss, _, qgz_grads = runs["qgz4"]
    assert bf16_grads == fp32_grads / 2, runs
    assert qgz_grads <= 0.3 * bf16_grads, runs
    assert abs(qgz_loss - plain_loss) <= 0.02 * plain_loss, runs


def test_quantized_weights_stay_within_half_a_step(cluster, control):
    """Every gathered element of a qwZ job is within 0.5001 * max|block| /
    127 of the value registered, every rank sees the same values, and they
    are not simply the registered ones."""
    cluster.start_coordinator()
    nodes = [cluster.start_node("node-%s" % n, ranks=1) for n in "ab"]
    ctl = control()
    ctl.wait("2 members", lambda: ctl.members()[0] == ["node-a", "node-b"])
    block = 64
    ctl.create_job("q", 2, 1, quantized_weights=True, quantization_block=block)
    ctl.wait_state("q", "JOB_STATE_READY")
    n = 1000
    values = [math.sin(i * 0.37) * (1 + (i // 100)) ** 2 for i in range(n)]
    conns = []
    for node in nodes:
        c = z.Conn(node.socket)
        c.expect_ok(z.ATTACH, z.attach_request("q", 0, token=TOKEN))
        conns.append(c)
    fd = z.memfd_with(struct.pack("<%df" % n, *values))
    request = z.register_request("u", (("w", (n,)),), init=z.INIT_FROM_RANK0)
    rid0 = conns[0].send(z.REGISTER_UNIT, request, fds=[fd])
    rid1 = conns[1].send(z.REGISTER_UNIT, request)
    os.close(fd)
    units = []
    for c, rid in ((conns[0], rid0), (conns[1], rid1)):
        t, got_rid, fields, _ = c.recv()
        assert t == z.REGISTER_UNIT_REPLY and got_rid == rid, z.message_of(fields)
        units.append(fields.get(1, [0])[0])
    ids = [c.send(z.GATHER, z.unit_request(u)) for c, u in zip(conns, units)]
    gathered = []
    for c, rid in zip(conns, ids):
        t, got_rid, fields, fds = c.recv()
        assert t == z.GATHER_REPLY and got_rid == rid and len(fds) == 1, z.message_of(fields)
        m = mmap.mmap(fds[0], fields[3][0], prot=mmap.PROT_READ)
        gathered.append(struct.unpack("<%df" % n, m[:4 * n]))
        m.close()
        os.close(fds[0])
    assert gathered[0] == gathered[1]
    # Each rank quantized its own shard: its blocks start at its first
    # element (the padding past n is zero).
    shard = fields[3][0] // 4 // 2
    exact = 0
    blocks = [(s0, min(s0 + block, first + shard, n))
              for first in (0, shard) for s0 in range(first, first + shard, block) if s0 < n]
    for start, end in blocks:
        worst = max(abs(v) for v in values[start:end])
        bound = 0.5001 * worst / 127
        for i in range(start, end):
            assert abs(gathered[0][i] - values[i]) <= bound, (i, gathered[0][i], values[i])
            exact += gathered[0][i] == struct.unpack("<f", struct.pack("<f", values[i]))[0]
    assert exact < n // 2, "the values were not quantized"
    for c in conns:
        c.close()


class Ranks:
    """Raw sessions, one per rank of a job, driven in lockstep: a request
    goes to every rank before any reply is read (collectives)."""

    def __init__(self, nodes, job, ranks_per_node):
        self.fds = {}  # buffer id -> the descriptor its first gather passed
        self.conns = []
        for node in nodes:
            for r in range(ranks_per_node):
                c = z.Conn(node.socket)
                c.expect_ok(z.ATTACH, z.attach_request(job, r, token=TOKEN))
                self.conns.append(c)

    def all(self, msg_type, payload):
        """Sends payload to every rank, then returns the replies' (fields,
        fds) in rank order."""
        ids = [c.send(msg_type, payload) for c in self.conns]
        out = []
        for c, rid in zip(self.conns, ids):
            t, got_rid, fields, got = c.recv()
            assert got_rid == rid and t == msg_type + 1, (t, z.message_of(fields))
            out.append((fields, got))
        return out

    def gather(self, unit, numel):
        """Gathers unit on every rank, reads its first numel floats on each,
        and releases it."""
        values = []
        for fields, fds in self.all(z.GATHER, z.unit_request(unit)):
            if fds:  # the first gather into a buffer passes its descriptor
                self.fds[fields[2][0]] = fds[0]
            m = mmap.mmap(self.fds[fields[2][0]], fields[3][0], prot=mmap.PROT_READ)
            values.append(m[:4 * numel])
            m.close()
        self.all(z.RELEASE, z.unit_request(unit))
        return values

    def stats(self, node_index, ranks_per_node):
        fields, _ = self.conns[node_index * ranks_per_node].expect_ok(z.STATS)
        return z.rank_stats(fields)

    def close(self):
        for c in self.conns:
            c.close()
        for fd in self.fds.values():
            os.close(fd)


def cross_gathered(stats):
    return sum(r["counters"].get(("cross", "all_gather"), (0, 0))[0] for r in stats)


def node_gathered(stats):
    return sum(r["counters"].get(("node", "all_gather"), (0, 0))[0] for r in stats)


def test_hpz_keeps_backward_gathers_inside_the_node(cluster, control):
    """ZeRO++ hpZ on 2 nodes x 2 ranks: after a unit's gather across nodes
    (the forward) and the eviction of its buffer, its next gather at the
    same version (the backward) is made from the node's secondary
    partition: no bytes cross between nodes, the values are the forward's
    bit for bit, and the slices are counted in the pool under
    max_live_bytes. Without hpZ the same gather crosses nodes again."""
    cluster.start_coordinator()
    nodes = [cluster.start_node("node-%s" % n, ranks=2) for n in "ab"]
    ctl = control()
    ctl.wait("2 members", lambda: ctl.members()[0] == ["node-a", "node-b"])
    numel = 4096  # a 16 KiB gathered buffer, an 8 KiB slice per rank
    # Room for one gathered buffer and both units' slices, not two buffers.
    cap = 36 * 1024
    for name, hpz in (("hpz", 2), ("nohpz", 1)):
        ctl.create_job(name, 2, 2, hpz_partition_size=hpz, max_live_bytes=cap)
        ctl.wait_state(name, "JOB_STATE_READY")
        ranks = Ranks(nodes, name, 2)
        units = []
        for u in ("a", "b"):
            request = z.register_request(u, (("w", (numel,)),), init=z.INIT_SEEDED_NORMAL,
                                         seed=7, std=0.5)
            replies = ranks.all(z.REGISTER_UNIT, request)
            units.append(replies[0][0].get(1, [0])[0])
        # Forward: a, then b (whose buffer evicts a's).
        forward_a = ranks.gather(units[0], numel)
        ranks.gather(units[1], numel)
        before = [ranks.stats(n, 2) for n in (0, 1)]
        # Backward: b (cached), then a.
        ranks.gather(units[1], numel)
        backward_a = ranks.gather(units[0], numel)
        after = [ranks.stats(n, 2) for n in (0, 1)]
        assert backward_a == forward_a and len(set(forward_a)) == 1
        crossed = sum(cross_gathered(a) - cross_gathered(b) for a, b in zip(after, before))
        inside = sum(node_gathered(a) - node_gathered(b) for a, b in zip(after, before))
        for r in after[0] + after[1]:
            assert r["pool_bytes"] <= cap, r
        if hpz > 1:
            assert crossed == 0 and inside == 4 * 4 * numel, (before, after)
            for r in after[0] + after[1]:
                assert r["secondary_bytes"] == 2 * 4 * numel // 2, r
        else:
            assert crossed > 0, (before, after)
            assert all(r["secondary_bytes"] == 0 for r in after[0] + after[1]), after
        ranks.close()
    # The secondary group is the ranks of one node.
    with pytest.raises(grpc.RpcError) as e:
        ctl.create_job("odd", 2, 2, hpz_partition_size=4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ranks_per_node" in e.value.details(), e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        ctl.create_job("flat", 2, 2, hpz_partition_size=2, collectives=ctl.ipc.COLLECTIVES_FLAT)
    assert "hierarchical" in e.value.details(), e.value.details()


def test_hpz_trains_like_without(cluster, control, tmp_path):
    """Training an 8-layer MLP on 2 nodes x 2 ranks with hpZ, under a
    max_live_bytes that evicts gathered layers before the backward pass
    needs them: the same parameters bit for bit as without hpZ, and fewer
    gathers cross between nodes (the backward's come from the slices)."""
    cluster.start_coordinator()
    nodes = [cluster.start_node("node-%s" % n, ranks=2) for n in "ab"]
    ctl = control()
    ctl.wait("2 members", lambda: ctl.members()[0] == ["node-a", "node-b"])
    cap = 500 * 1024  # about 7 of the 8 layers' gathered buffers
    crossing = {}
    for name, hpz in (("hpz", 2), ("nohpz", 1)):
        ctl.create_job(name, 2, 2, hpz_partition_size=hpz, max_live_bytes=cap)
        ctl.wait_state(name, "JOB_STATE_READY")
        procs = []
        for i, node in enumerate(nodes):
            procs += start_workers(node, name, 2, tmp_path / (name + ".bin") if i == 0 else None,
                                   extra=["--stats", "--layers", "8"])
        results = finish(procs, nodes)
        stats = stats_of(results[0][1])
        crossing[name] = stats[(0, "cross", "all_gather")][1]
    assert (tmp_path / "hpz.bin").read_bytes() == (tmp_path / "nohpz.bin").read_bytes()
    assert crossing["hpz"] < crossing["nohpz"], crossing


def test_unassigned_job_and_wrong_rank_are_refused(cluster, control):
    cluster.start_coordinator()
    a = cluster.start_node("node-a", ranks=1)
    ctl = control()
    ctl.wait("a member", lambda: ctl.members()[0] == ["node-a"])
    proc = run_worker([binary("zerod-mlp-train"), "--socket", a.socket, "--job", "nope",
                       "--token", TOKEN] + MODEL, check=False)
    assert proc.returncode != 0
    assert "coordinator" in proc.stderr and "nope" in proc.stderr, proc.stderr
    ctl.create_job("one", 1, 1)
    ctl.wait_state("one", "JOB_STATE_READY")
    proc = run_worker([binary("zerod-mlp-train"), "--socket", a.socket, "--job", "one",
                       "--local-rank", "1", "--token", TOKEN] + MODEL, check=False)
    assert proc.returncode != 0 and "local rank 1" in proc.stderr, proc.stderr
    proc = run_worker([binary("zerod-mlp-train"), "--socket", a.socket, "--job", "one",
                       "--token", "wrong"] + MODEL, check=False)
    assert proc.returncode != 0 and "token" in proc.stderr, proc.stderr


def test_killed_node_degrades_its_job_and_others_go_on(cluster, control, tmp_path):
    coord = cluster.start_coordinator(lease_ttl_s=1.5)
    a, b, c = (cluster.start_node("node-%s" % n, ranks=1, timeout_s=60) for n in "abc")
    ctl = control()
    ctl.wait("3 members", lambda: len(ctl.members()[0]) == 3)
    ctl.create_job("doomed", 3, 1)
    ctl.create_job("bystander", 2, 1, node_names=["node-a", "node-b"])
    ctl.wait_state("doomed", "JOB_STATE_READY")
    ctl.wait_state("bystander", "JOB_STATE_READY")

    # The doomed job's workers train for a long time; node c dies under them.
    long_run = ["--steps", "100000"]
    doomed = (start_workers(a, "doomed", 1, extra=long_run) +
              start_workers(b, "doomed", 1, extra=long_run) +
              start_workers(c, "doomed", 1, extra=long_run))
    time.sleep(2)
    _, epoch_before = ctl.members()
    killed_at = time.monotonic()
    c.kill()
    for p in doomed[2:]:
        p.kill()

    names = ctl.wait("node-c to leave the view",
                     lambda: ctl.members()[0] if "node-c" not in ctl.members()[0] else None,
                     timeout_s=coord.lease_ttl_s * 3 + 5)
    left_after = time.monotonic() - killed_at
    assert names == ["node-a", "node-b"]
    assert left_after < coord.lease_ttl_s + 2.0, left_after
    assert ctl.members()[1] > epoch_before
    ctl.wait_state("doomed", "JOB_STATE_DEGRADED")
    assert "node-c" in ctl.job("doomed").reason

    # The survivors' workers fail with an error instead of hanging (well
    # within the 60 s collective timeout).
    for p in doomed[:2]:
        out, err = p.communicate(timeout=30)
        assert p.returncode != 0, out + err
        assert "failed" in err or "aborted" in err.lower(), err

    # The other job, on the surviving nodes, trains to the end.
    dump = tmp_path / "bystander.bin"
    finish(start_workers(a, "bystander", 1, dump) + start_workers(b, "bystander", 1), [a, b])
    run_worker([binary("zerod-mlp-reference"), "--world", "2", "--compare", str(dump),
                "--tolerance", "1e-6"] + MODEL)

    # A restarted node joins again under the same name.
    cluster.start_node("node-c", ranks=1)
    ctl.wait("node-c back", lambda: "node-c" in ctl.members()[0])


def test_coordinator_restart_keeps_jobs_and_nodes_rejoin(cluster, control):
    coord = cluster.start_coordinator(lease_ttl_s=1.5)
    a = cluster.start_node("node-a", ranks=1)
    b = cluster.start_node("node-b", ranks=1)
    ctl = control()
    ctl.wait("2 members", lambda: len(ctl.members()[0]) == 2)
    ctl.create_job("kept", 2, 1)
    ctl.wait_state("kept", "JOB_STATE_READY")
    job_id = ctl.job("kept").id

    coord.kill()
    coord.start()
    job = ctl.wait("the job after the restart", lambda: ctl.job("kept"))
    assert job.id == job_id and job.world_size == 2
    ctl.wait("nodes back in the view", lambda: ctl.members()[0] == ["node-a", "node-b"])
    ctl.wait_state("kept", "JOB_STATE_READY")
    for n in (a, b):
        assert "joining again" in n.read_log() or "joined the cluster" in n.read_log()


def test_killed_worker_fails_its_job_on_every_node(cluster, control):
    """A worker that dies mid-training (its node stays up) fails the job on
    every node at once rather than at the 60 s collective timeout, and the
    job turns degraded with the reason."""
    cluster.start_coordinator()
    a = cluster.start_node("node-a", ranks=1, timeout_s=60)
    b = cluster.start_node("node-b", ranks=1, timeout_s=60)
    ctl = control()
    ctl.wait("2 members", lambda: len(ctl.members()[0]) == 2)
    ctl.create_job("w", 2, 1)
    ctl.wait_state("w", "JOB_STATE_READY")
    procs = (start_workers(a, "w", 1, extra=["--steps", "100000"]) +
             start_workers(b, "w", 1, extra=["--steps", "100000"]))
    time.sleep(2)
    procs[1].kill()
    procs[1].wait()
    out, err = procs[0].communicate(timeout=30)
    assert procs[0].returncode != 0, out + err
    ctl.wait_state("w", "JOB_STATE_DEGRADED")
    # The first node to report names its error (the lost peer, or the
    # worker that disconnected).
    reason = ctl.job("w").reason
    assert reason.startswith("node 'node-") and ("lost" in reason or "disconnected" in reason), \
        reason
    # Attaching again is refused with the reason; the job does not reset.
    proc = run_worker([binary("zerod-mlp-train"), "--socket", a.socket, "--job", "w",
                       "--token", TOKEN] + MODEL, check=False)
    assert proc.returncode != 0 and "re-create" in proc.stderr, proc.stderr
CAP_KIB = 600
