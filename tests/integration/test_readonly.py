"""Read-only sessions, pinned versions, the unit table and LOAD_UNIT.

A read-only session attaches to an existing job without a rank, lists its
units, and gathers them from every rank's working copy into buffers of its
own, while the job's workers go on training. With a pin, every gather
serves one version, byte for byte, however far training has moved on.
Everything here speaks the raw protocol (zdraw), plus the example MLP
workers as the training job.
"""

import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import pytest

import zdraw as z
from conftest import binary, run_worker

HERE = os.path.dirname(os.path.abspath(__file__))
SGD_LR1 = z.field_varint(1, 3) + z.field_double(2, 1.0)  # SGD, lr 1, no momentum


# --- helpers ------------------------------------------------------------------

def assert_error(reply, status, *fragments):
    t, fields, fds = reply
    for fd in fds:
        os.close(fd)
    assert t == z.ERROR, "expected an error %s, got message type %d" % (status, t)
    assert z.status_of(fields) == status, (status, z.message_of(fields))
    for fragment in fragments:
        assert fragment in z.message_of(fields), (fragment, z.message_of(fields))


class Session:
    """A raw session that keeps its buffer mappings by buffer id, the way a
    client must (map on a descriptor, unmap on dropped_buffer_ids)."""

    def __init__(self, daemon, attach_payload):
        self.conn = z.Conn(daemon.socket, timeout=120)
        self.maps = {}
        self.seen_ids = set()
        self.dropped = []
        self.attach, _ = self.conn.expect_ok(z.ATTACH, attach_payload)

    def call(self, msg_type, payload=b"", fds=(), flags=0):
        return self.conn.call(msg_type, payload, fds, flags)

    def _take_buffer(self, fields, fds):
        buf_id, size = fields[2][0], fields[3][0]
        if fds:
            assert len(fds) == 1
            if buf_id in self.maps:
                self.maps[buf_id].close()
            self.maps[buf_id] = mmap.mmap(fds[0], size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fds[0])
        assert buf_id in self.maps, "buffer %d named without a descriptor first" % buf_id
        return buf_id

    def _drop(self, ids):
        for buf_id in ids:
            self.dropped.append(buf_id)
            m = self.maps.pop(buf_id, None)
            if m is not None:
                m.close()

    def gather(self, unit):
        """Returns (bytes of the buffer, version, buffer_id)."""
        t, fields, fds = self.call(z.GATHER, z.unit_request(unit))
        if t == z.ERROR:
            for fd in fds:
                os.close(fd)
            raise AssertionError("gather of unit %d: %s: %s" % (
                unit, z.status_of(fields), z.message_of(fields)))
        self._drop(z.repeated_varints(fields.get(5, [])))
        buf_id = self._take_buffer(fields, fds)
        self.seen_ids.add(buf_id)
        return bytes(self.maps[buf_id]), fields.get(4, [0])[0], buf_id

    def gather_reply(self, unit):
        return self.call(z.GATHER, z.unit_request(unit))

    def release(self, unit):
        self.conn.expect_ok(z.RELEASE, z.unit_request(unit))

    def grad_buffer(self, unit):
        fields, fds = self.conn.expect_ok(z.GRAD_BUFFER, z.unit_request(unit))
        self._drop(z.repeated_varints(fields.get(4, [])))
        return self.maps[self._take_buffer(fields, fds)]

    def units(self):
        fields, _ = self.conn.expect_ok(z.UNITS)
        return z.unit_table(fields)

    def pin(self):
        fields, _ = self.conn.expect_ok(z.PIN)
        return fields.get(1, [0])[0]

    def close(self, detach=True):
        if detach:
            try:
                self.conn.expect_ok(z.DETACH)
            except (z.Closed, OSError):
                pass
        for m in self.maps.values():
            m.close()
        self.maps.clear()
        self.conn.close()


def reader(daemon, job, token="", pin=False):
    return Session(daemon, z.read_only_attach_request(job, token=token, pin=pin))


def trainer(daemon, job, rank=0, **kw):
    return Session(daemon, z.attach_request(job, rank, **kw))


def register(session, name, tensors, init=z.INIT_ZEROS, fds=()):
    fields, _ = session.conn.expect_ok(z.REGISTER_UNIT, z.register_request(name, tensors, init),
                                       fds=fds)
    return fields


def on_all_ranks(sessions, fn):
    """Runs fn(rank, session) on every rank at once (collectives need all
    ranks); returns the results by rank, re-raising the first failure."""
    results, errors = [None] * len(sessions), []

    def run(r):
        try:
            results[r] = fn(r, sessions[r])
        except BaseException as e:  # noqa: B902 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    return results


def floats(data, count, offset=0):
    return struct.unpack_from("<%df" % count, data, offset * 4)


def packed_values(buffer, unit):
    """The unit's tensors from a gathered fp32 buffer, back to back (the
    order --dump writes and LOAD_UNIT reads)."""
    return b"".join(buffer[off * 4:(off + numel) * 4] for _, _, off, numel in unit["tensors"])


def bf16s(data, count, offset=0):
    """bf16 values as floats (the upper half of an fp32)."""
    halves = struct.unpack_from("<%dH" % count, data, offset * 2)
    return struct.unpack("<%df" % count, struct.pack("<%dI" % count, *(h << 16 for h in halves)))


def train_steps(session, units, steps, ones_numel, bf16=False):
    """One raw worker: each step gathers and releases every unit, writes a
    gradient of ones, reduces, and steps."""
    one = struct.pack("<H", 0x3F80) if bf16 else struct.pack("<f", 1.0)
    for _ in range(steps):
        for unit in units:
            session.gather(unit)
            session.release(unit)
            grad = session.grad_buffer(unit)
            grad[0:ones_numel[unit] * len(one)] = one * ones_numel[unit]
            session.conn.expect_ok(z.REDUCE, z.unit_request(unit))
        fields, _ = session.conn.expect_ok(z.STEP)
    return fields.get(2, [0])[0]


# --- attaching ------------------------------------------------------------------

def test_read_only_attach_refuses_missing_job_create_and_wrong_token(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    assert_error(c.call(z.ATTACH, z.read_only_attach_request("nosuchjob")), "NOT_FOUND",
                 "nosuchjob")
    owner = trainer(d, "guarded", token="s3cret")
    register(owner, "u", (("w", (8,)),))
    create = z.attach_request("guarded", 0, create=True, token="s3cret", read_only=True)
    assert_error(c.call(z.ATTACH, create), "INVALID_ARGUMENT", "read-only", "create")
    assert_error(c.call(z.ATTACH, z.read_only_attach_request("guarded", token="guess")),
                 "PERMISSION_DENIED", "does not match job 'guarded'")
    assert_error(c.call(z.ATTACH, z.read_only_attach_request("guarded")),
                 "PERMISSION_DENIED", "job 'guarded' requires a token")
    # The right token works on the same connection; no rank is taken, so
    # the owner keeps rank 0 and any local_rank is accepted.
    payload = z.attach_request("guarded", 7, create=False, token="s3cret", read_only=True,
                               pin=True)
    fields, _ = c.expect_ok(z.ATTACH, payload)
    assert fields[7][0] == 1  # read_only
    assert fields[3][0] == 1  # world_size
    assert fields.get(4, [0])[0] == 0 and fields.get(8, [0])[0] == 0  # version, pinned_version
    c.expect_ok(z.DETACH)
    c.close()
    owner.close()


def test_writes_are_refused_and_the_session_and_job_go_on(start_daemon):
    d = start_daemon()
    owner = trainer(d, "job", optimizer=SGD_LR1)
    values = [float(i) for i in range(8)]
    fd = z.memfd_with(struct.pack("<8f", *values))
    fields = register(owner, "u", (("w", (8,)),), init=z.INIT_FROM_RANK0, fds=[fd])
    os.close(fd)
    unit = fields.get(1, [0])[0]
    r = reader(d, "job")
    assert r.attach[7][0] == 1
    refused = [
        (z.REGISTER_UNIT, z.register_request("u", (("w", (8,)),)), "register_unit"),
        (z.REGISTER_UNIT, z.register_request("new", (("w", (8,)),)), "register_unit"),
        (z.GRAD_BUFFER, z.unit_request(unit), "grad_buffer"),
        (z.REDUCE, z.unit_request(unit), "reduce"),
        (z.STEP, b"", "step"),
    ]
    for msg_type, payload, what in refused:
        assert_error(r.call(msg_type, payload), "PERMISSION_DENIED",
                     "%s refused: read-only session" % what)
    fd = z.memfd_with(struct.pack("<8f", *([9.0] * 8)))
    assert_error(r.call(z.LOAD_UNIT, z.unit_request(unit), fds=[fd]), "PERMISSION_DENIED",
                 "load_unit refused: read-only session")
    os.close(fd)
    # The session still reads, and the job still trains.
    data, version, _ = r.gather(unit)
    assert floats(data, 8) == tuple(values) and version == 0
    r.release(unit)
    assert train_steps(owner, [unit], 1, {unit: 8}) == 1
    data, version, _ = r.gather(unit)
    assert version == 1 and floats(data, 8) == tuple(v - 1.0 for v in values)
    r.release(unit)
    # PIN belongs to read-only sessions.
    assert_error(owner.call(z.PIN), "FAILED_PRECONDITION", "read-only")
    r.close()
    owner.close()


def test_release_is_one_way_and_the_reader_detaches_cleanly(start_daemon):
    d = start_daemon()
    owner = trainer(d, "job")
    unit = register(owner, "u", (("w", (64,)),)).get(1, [0])[0]
    r = reader(d, "job")
    for _ in range(3):
        r.gather(unit)
        r.conn.send(z.RELEASE, z.unit_request(unit), flags=z.NO_REPLY)
    assert_error(r.call(z.RELEASE, z.unit_request(unit)), "FAILED_PRECONDITION", "not hold")
    t, fields, _ = r.call(z.DETACH)
    assert t == z.DETACH_REPLY
    with pytest.raises((z.Closed, ConnectionResetError)):
        r.conn.recv()
    r.close(detach=False)
    # The reader's buffers go with it.
    deadline = time.monotonic() + 20
    while [m for m in d.memfds("job") if "-ro" in m] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [m for m in d.memfds("job") if "-ro" in m] == []
    owner.close()


def test_read_only_sessions_count_against_max_sessions(start_daemon):
    d = start_daemon(extra=["--max-sessions", "2"])
    owner = trainer(d, "job")
    r = reader(d, "job")
    # The third is refused with the reason, in a notice, then closed.
    third = z.Conn(d.socket)
    t, _, fields, _ = third.recv()
    assert t == z.NOTICE and z.status_of(fields) == "RESOURCE_EXHAUSTED", (t, fields)
    assert "--max-sessions" in z.message_of(fields), z.message_of(fields)
    with pytest.raises((z.Closed, ConnectionResetError, BrokenPipeError)):
        third.send(z.ATTACH, z.read_only_attach_request("job"))
        third.recv()
    third.close()
    # A worker through libzerod reports that reason, not a closed connection.
    proc = subprocess.run([binary("zerod-mlp-train"), "--socket", d.socket, "--job", "job2",
                           "--local-rank", "0", "--steps", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--max-sessions" in proc.stderr and "refused" in proc.stderr, proc.stderr
    r.close()
    owner.close()


# --- the unit table -----------------------------------------------------------------

def test_units_lists_names_and_placements_in_id_order(start_daemon):
    d = start_daemon(ranks=2)
    ranks = [trainer(d, "table", rank) for rank in range(2)]
    specs = [("embed", (("embed.weight", (10, 3)), ("embed.scale", (3,), True))),
             ("head", (("head.weight", (4, 5)), ("head.bias", (4,))))]
    for name, tensors in specs:
        replies = on_all_ranks(ranks, lambda r, s: register(s, name, tensors))
        # The registration reply carries the unit's name now.
        assert [f[9][0].decode() for f in replies] == [name, name]
    r = reader(d, "table")
    for session in (r, ranks[0]):
        units, version = session.units()
        assert version == 0
        assert [(u["id"], u["name"]) for u in units] == [(0, "embed"), (1, "head")]
        embed, head = units
        assert embed["tensors"] == [("embed.weight", (10, 3), 0, 30),
                                    ("embed.scale", (3,), 32, 3)]
        assert head["tensors"] == [("head.weight", (4, 5), 0, 20), ("head.bias", (4,), 32, 4)]
        assert embed["numel"] == 35 and embed["padded_numel"] == 64
        assert embed["shard_numel"] == 32 and head["existed"] == 1
    r.close()
    for s in ranks:
        s.close()


# --- pinned and latest reads while training goes on ---------------------------------

@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_pinned_and_latest_reads_are_consistent_while_two_ranks_train(start_daemon, bf16):
    """SGD with lr 1 and a gradient of ones on both ranks moves every weight
    by exactly -2 per step, so a buffer of version v must hold -2v in every
    element of every rank's slice (exact in bf16 too at these magnitudes)."""
    d = start_daemon(ranks=2, timeout_s=60)
    ranks = [trainer(d, "sgd", rank, optimizer=SGD_LR1, working_bf16=bf16) for rank in range(2)]
    values = bf16s if bf16 else floats
    numel = {}
    for name, n in (("a", 4096), ("b", 1000)):
        replies = on_all_ranks(ranks, lambda r, s: register(s, name, (("w", (n,)),)))
        numel[replies[0].get(1, [0])[0]] = n
    units = sorted(numel)
    on_all_ranks(ranks, lambda r, s: train_steps(s, units, 2, numel, bf16))

    pinned = reader(d, "sgd", pin=True)
    pinned_version = pinned.attach[8][0]
    assert pinned_version == 2 and pinned.attach[4][0] == 2
    latest = reader(d, "sgd")

    done = threading.Event()
    trained = []

    def train():
        try:
            trained.append(on_all_ranks(ranks,
                                        lambda r, s: train_steps(s, units, 60, numel, bf16)))
        finally:
            done.set()

    worker = threading.Thread(target=train)
    worker.start()
    reads, last_latest, latest_versions = 0, 0, set()
    while not done.is_set() or reads < 4:
        for unit in units:
            data, version, _ = pinned.gather(unit)
            assert version == pinned_version
            assert set(values(data, numel[unit])) == {-2.0 * pinned_version}, unit
            pinned.release(unit)
            data, version, _ = latest.gather(unit)
            assert version >= last_latest, "the latest version went back"
            assert set(values(data, numel[unit])) == {-2.0 * version}, (unit, version)
            latest.release(unit)
            last_latest = version
            latest_versions.add(version)
        reads += 1
    worker.join()
    assert trained and trained[0] == [62, 62]
    # The reads spanned the training (the job moved on under the pin).
    assert max(latest_versions) > pinned_version
    # PIN moves to the latest version; the values follow.
    assert pinned.pin() == 62
    for unit in units:
        data, version, _ = pinned.gather(unit)
        assert version == 62 and set(values(data, numel[unit])) == {-124.0}
        pinned.release(unit)
    pinned.close()
    latest.close()
    for s in ranks:
        s.close()


MLP = ["--hidden", "64", "--batch", "16", "--log-every", "1000"]


def mlp_workers(d, job, steps, dump):
    procs = []
    for rank in range(2):
        args = [binary("zerod-mlp-train"), "--socket", d.socket, "--job", job,
                "--local-rank", str(rank), "--steps", str(steps)] + MLP
        if rank == 0:
            args += ["--dump", str(dump)]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def wait_workers(d, procs):
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, "worker failed:\n%s\n%s\n%s" % (out, err, d.read_log()[-3000:])


def test_reader_pinned_at_k_reads_the_dump_of_step_k_while_training_continues(start_daemon,
                                                                              tmp_path):
    d = start_daemon(ranks=2, timeout_s=60)
    k = 3
    dump_k, dump_final = tmp_path / "k.bin", tmp_path / "final.bin"
    wait_workers(d, mlp_workers(d, "mlp", k, dump_k))
    expected = dump_k.read_bytes()

    r = reader(d, "mlp", pin=True)
    assert r.attach[8][0] == k
    units, version = r.units()
    assert version == k and [u["name"] for u in units] == ["layer0", "layer1", "layer2",
                                                            "layer3"]

    def read_all():
        out = b""
        for unit in units:
            data, served, _ = r.gather(unit["id"])
            assert served == k
            out += packed_values(data, unit)
            r.release(unit["id"])
        return out

    assert read_all() == expected
    more = 40
    procs = mlp_workers(d, "mlp", more, dump_final)
    rounds = 0
    while any(p.poll() is None for p in procs) or rounds < 2:
        assert read_all() == expected, "round %d differs from version %d" % (rounds, k)
        rounds += 1
    wait_workers(d, procs)
    _, version = r.units()
    assert version == k + more
    # Moving the pin: the values are now those of the final dump.
    assert r.pin() == k + more
    final = b""
    for unit in units:
        data, served, _ = r.gather(unit["id"])
        assert served == k + more
        final += packed_values(data, unit)
        r.release(unit["id"])
    assert final == dump_final.read_bytes() and final != expected
    r.close()


def test_unpinned_reader_serves_the_latest_version(start_daemon, tmp_path):
    d = start_daemon(ranks=2, timeout_s=60)
    dump = tmp_path / "w.bin"
    r = None
    wait_workers(d, mlp_workers(d, "latest", 2, tmp_path / "first.bin"))
    r = reader(d, "latest")
    assert r.attach.get(8, [0])[0] == 0 and r.attach[4][0] == 2
    wait_workers(d, mlp_workers(d, "latest", 5, dump))
    units, version = r.units()
    assert version == 7
    got = b""
    for unit in units:
        data, served, _ = r.gather(unit["id"])
        assert served == 7
        got += packed_values(data, unit)
        r.release(unit["id"])
    assert got == dump.read_bytes()
    r.close()


# --- memory -----------------------------------------------------------------------

def test_reader_buffers_are_bounded_by_max_live_bytes(start_daemon):
    d = start_daemon()
    owner = trainer(d, "small", max_live_bytes=96 * 1024)
    a, b, c = (register(owner, n, (("w", (12288,)),)).get(1, [0])[0] for n in "abc")  # 48 KiB
    r = reader(d, "small")
    _, _, id_a = r.gather(a)
    _, _, id_b = r.gather(b)
    assert_error(r.gather_reply(c), "RESOURCE_EXHAUSTED", "max_live_bytes", "read-only")
    # Nothing changed: both are still held, and the readers' buffers do not
    # count against the worker's own pool.
    assert_error(r.gather_reply(a), "FAILED_PRECONDITION", "already gathered")
    owner.gather(a)
    owner.gather(b)
    owner.release(a)
    owner.release(b)
    # A released buffer is evicted to make room, and reported as dropped.
    r.release(a)
    _, _, id_c = r.gather(c)
    assert r.dropped == [id_a] and id_c not in (id_a, id_b)
    r.release(b)
    r.release(c)
    # Gathering a again gets a new buffer id, never one seen before.
    seen = set(r.seen_ids)
    _, _, id_a2 = r.gather(a)
    assert id_a2 not in seen
    # Released and gathered again in the same version: the same buffer, no
    # new descriptor: the session maps it already.
    r.release(a)
    t, fields, fds = r.gather_reply(a)
    assert t == z.GATHER_REPLY and fields[2][0] == id_a2 and fds == []
    r.release(a)
    r.close()
    owner.close()


# --- LOAD_UNIT ----------------------------------------------------------------------

def test_load_unit_sets_values_that_gathers_return_and_training_continues(start_daemon):
    d = start_daemon(ranks=2, timeout_s=30)
    ranks = [trainer(d, "load", rank, optimizer=SGD_LR1) for rank in range(2)]
    tensors = (("w", (40,)), ("frozen", (3,), True))
    unit = on_all_ranks(ranks, lambda r, s: register(s, "u", tensors))[0].get(1, [0])[0]
    pinned = reader(d, "load", pin=True)  # version 0: zeros
    values = [0.5 * i - 7 for i in range(43)]
    packed = struct.pack("<43f", *values)

    def load(fd_for_rank0):
        def fn(rank, s):
            fds = [fd_for_rank0] if rank == 0 and fd_for_rank0 is not None else []
            return s.call(z.LOAD_UNIT, z.unit_request(unit), fds=fds)
        return on_all_ranks(ranks, fn)

    # Errors, the same on both ranks, and the job goes on.
    for reply in on_all_ranks(ranks, lambda r, s: s.call(z.LOAD_UNIT, z.unit_request(9))):
        assert_error(reply, "NOT_FOUND", "unknown unit id 9")
        # The client names the request ("load unit 9: ..."): the daemon's
        # message does not name it again.
        assert "load" not in z.message_of(reply[1]), z.message_of(reply[1])
    for reply in load(None):
        assert_error(reply, "INVALID_ARGUMENT", "rank 0's values", "43")
    short = z.memfd_with(packed[:40])
    for reply in load(short):
        assert_error(reply, "INVALID_ARGUMENT", "172 bytes expected")
    os.close(short)

    fd = z.memfd_with(packed)
    replies = load(fd)
    os.close(fd)
    for t, fields, _ in replies:
        assert t == z.LOAD_UNIT_REPLY and fields.get(1, [0])[0] == unit and fields[2][0] == 1
    expected = floats(packed, 40) + (0.0,) * 8 + floats(packed, 3, 40)
    # The workers' gathered copies of version 0 are not served again.
    for data, version, _ in on_all_ranks(ranks, lambda r, s: s.gather(unit)):
        assert version == 1 and floats(data, 51) == expected
    on_all_ranks(ranks, lambda r, s: s.release(unit))
    latest = reader(d, "load")
    data, version, _ = latest.gather(unit)
    assert version == 1 and floats(data, 51) == expected
    latest.release(unit)
    # The pin taken before the load still reads version 0 (copy on write).
    data, version, _ = pinned.gather(unit)
    assert version == 0 and set(floats(data, 51)) == {0.0}
    pinned.release(unit)

    # One SGD step from the loaded values: w moves by -2, the frozen tensor
    # stays, the optimizer counted the step.
    on_all_ranks(ranks, lambda r, s: train_steps(s, [unit], 1, {unit: 51}))
    for data, version, _ in on_all_ranks(ranks, lambda r, s: s.gather(unit)):
        assert version == 2
        assert floats(data, 40) == tuple(v - 2.0 for v in values[:40])
        assert floats(data, 3, 48) == tuple(values[40:])
    on_all_ranks(ranks, lambda r, s: s.release(unit))
    for s in [pinned, latest] + ranks:
        s.close()


# --- failures -----------------------------------------------------------------------

READER_SCRIPT = r"""
import os, signal, sys
import zdraw as z
conn = z.Conn(sys.argv[1], timeout=120)
conn.expect_ok(z.ATTACH, z.read_only_attach_request(sys.argv[2], pin=True))
fields, _ = conn.expect_ok(z.UNITS)
units = [u["id"] for u in z.unit_table(fields)[0]]
for i in range(int(sys.argv[3])):
    for u in units:
        t, fields, fds = conn.call(z.GATHER, z.unit_request(u))
        assert t == z.GATHER_REPLY, z.message_of(fields)
        for fd in fds:
            os.close(fd)
        conn.call(z.RELEASE, z.unit_request(u))
    conn.call(z.PIN)
print("READY", flush=True)
for u in units:
    conn.send(z.GATHER, z.unit_request(u))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_killing_a_reader_mid_gather_loses_nothing(start_daemon, tmp_path):
    d = start_daemon(ranks=2, timeout_s=60)
    model = ["--hidden", "256", "--batch", "32", "--log-every", "1000"]
    dump = tmp_path / "w.bin"
    procs = []
    for rank in range(2):
        args = [binary("zerod-mlp-train"), "--socket", d.socket, "--job", "victim",
                "--local-rank", str(rank), "--steps", "40"] + model
        if rank == 0:
            args += ["--dump", str(dump)]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    # Readers attach once the units exist, read for a while, then die with
    # gathers in flight.
    deadline = time.monotonic() + 120
    while True:
        probe = z.Conn(d.socket)
        t, fields, _ = probe.call(z.ATTACH, z.read_only_attach_request("victim"))
        ready = t == z.ATTACH_REPLY and len(z.unit_table(probe.expect_ok(z.UNITS)[0])[0]) == 4
        probe.close()
        if ready:
            break
        assert t == z.ATTACH_REPLY or z.status_of(fields) == "NOT_FOUND", z.message_of(fields)
        assert time.monotonic() < deadline, d.read_log()[-2000:]
        time.sleep(0.05)
    env = dict(os.environ, PYTHONPATH=HERE)
    for rounds in (1, 3, 5):
        killed = subprocess.run([sys.executable, "-c", READER_SCRIPT, d.socket, "victim",
                                 str(rounds)], capture_output=True, text=True, timeout=300,
                                env=env)
        assert killed.returncode == -signal.SIGKILL, (killed.stdout, killed.stderr)
        assert "READY" in killed.stdout
    wait_workers(d, procs)
    # The training is exactly the reference: nothing was lost or disturbed.
    run_worker([binary("zerod-mlp-reference"), "--world", "2", "--steps", "40", "--compare",
                str(dump), "--tolerance", "1e-6"] + model)
    # The dead readers' buffers are gone.
    deadline = time.monotonic() + 20
    while [m for m in d.memfds("victim") if "-ro" in m] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [m for m in d.memfds("victim") if "-ro" in m] == []
    assert "reader disconnected" in d.read_log()
    assert d.alive()


def test_a_reader_does_not_hold_back_the_reset_of_a_failed_job(start_daemon):
    d = start_daemon(ranks=2, timeout_s=5)
    ranks = [trainer(d, "f", rank, optimizer=SGD_LR1) for rank in range(2)]
    unit = on_all_ranks(ranks, lambda r, s: register(s, "u", (("w", (4096,)),)))[0].get(1, [0])[0]
    on_all_ranks(ranks, lambda r, s: train_steps(s, [unit], 3, {unit: 4096}))
    r = reader(d, "f", pin=True)
    before, version, _ = r.gather(unit)
    r.release(unit)
    assert version == 3 and set(floats(before, 4096)) == {-6.0}

    def gather_until(status):
        """Gathers until the answer is `status` (OK or an error); the other
        answer seen meanwhile is the one the job's previous state gives."""
        deadline = time.monotonic() + 30
        while True:
            t, fields, fds = r.gather_reply(unit)
            for fd in fds:
                os.close(fd)
            if t == z.GATHER_REPLY:
                r.release(unit)
                if status == "OK":
                    return fields
            elif status != "OK":
                assert z.status_of(fields) == status, z.message_of(fields)
                return fields
            else:
                assert z.status_of(fields) == "ABORTED", z.message_of(fields)
            assert time.monotonic() < deadline, "still no %s" % status
            time.sleep(0.05)

    # Rank 0's worker vanishes while rank 1's is attached: the job fails, and
    # the reader is refused like everyone else.
    ranks[0].close(detach=False)
    assert "disconnected" in z.message_of(gather_until("ABORTED"))
    # The last worker leaves: the job resets although the reader stays, and
    # the reader reads its pinned version again.
    ranks[1].close(detach=False)
    fields = gather_until("OK")
    assert fields[4][0] == 3 and bytes(r.maps[fields[2][0]]) == before
    # New workers carry on from the kept state.
    ranks = [trainer(d, "f", rank) for rank in range(2)]
    on_all_ranks(ranks, lambda rr, s: register(s, "u", (("w", (4096,)),)))
    assert on_all_ranks(ranks, lambda rr, s: train_steps(s, [unit], 2, {unit: 4096})) == [5, 5]
    assert r.pin() == 5
    data, version, _ = r.gather(unit)
    assert version == 5 and set(floats(data, 4096)) == {-10.0}
    r.release(unit)
    r.close()
    for s in ranks:
        s.close()
