"""The daemon against malformed and out-of-state input, over a real socket.

Every class of bad input gets an error reply or a closed session, never a
crash: after each test the daemon still serves a well-behaved client, and
it must stop cleanly (the fixture checks exit status and sanitizer logs).
"""

import mmap
import os
import socket
import struct
import threading

import pytest

import zdraw as z


def attach(daemon, job="j", rank=0, **kw):
    c = z.Conn(daemon.socket)
    c.expect_ok(z.ATTACH, z.attach_request(job, rank, **kw))
    return c


def register(conn, name="u", tensors=(("w", (4, 8)),), init=z.INIT_ZEROS, **kw):
    fields, _ = conn.expect_ok(z.REGISTER_UNIT, z.register_request(name, tensors, init, **kw))
    return fields.get(1, [0])[0]


def assert_error(reply, status, *fragments):
    t, fields, fds = reply
    assert t == z.ERROR, "expected an error, got message type %d" % t
    assert z.status_of(fields) == status, z.message_of(fields)
    for fragment in fragments:
        assert fragment in z.message_of(fields), z.message_of(fields)
    for fd in fds:
        os.close(fd)


def assert_serving(daemon):
    """A fresh client can still attach, register and gather."""
    c = attach(daemon, job="healthy")
    unit = register(c, "probe", (("p", (16,)),))
    fields, fds = c.expect_ok(z.GATHER, z.unit_request(unit))
    for fd in fds:
        os.close(fd)
    c.expect_ok(z.DETACH)
    c.close()


def expect_closed(conn):
    """Reads until EOF; returns the errors received before it."""
    errors = []
    try:
        while True:
            t, _, fields, fds = conn.recv()
            for fd in fds:
                os.close(fd)
            if t == z.ERROR:
                errors.append(z.status_of(fields))
    except (z.Closed, ConnectionResetError):
        return errors


def test_short_header_then_eof_is_dropped(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    c.send_raw(z.header(z.ATTACH, 1, 10)[:10])
    c.sock.shutdown(socket.SHUT_WR)
    assert expect_closed(c) == []
    assert_serving(d)


def test_bad_magic_is_answered_with_protocol_error_and_closed(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    c.send_raw(z.header(z.ATTACH, 1, 0, magic=0xDEADBEEF))
    assert expect_closed(c) == ["PROTOCOL"]
    assert_serving(d)


def test_bad_version_and_reserved_bits_are_protocol_errors(start_daemon):
    d = start_daemon()
    for bad in (z.header(z.ATTACH, 1, 0, version=9), z.header(z.ATTACH, 1, 0, reserved=1),
                z.header(z.ATTACH, 1, 0, flags=0x80)):
        c = z.Conn(d.socket)
        c.send_raw(bad)
        assert expect_closed(c) == ["PROTOCOL"]
    assert_serving(d)


def test_oversize_length_is_refused_before_reading_it(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    c.send_raw(z.header(z.ATTACH, 1, 0xFFFFFFFF))
    assert expect_closed(c) == ["PROTOCOL"]
    assert_serving(d)


def test_garbage_protobuf_is_answered_and_the_session_goes_on(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    garbage = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"
    assert_error(c.call(z.ATTACH, garbage), "INVALID_ARGUMENT", "malformed")
    c.expect_ok(z.ATTACH, z.attach_request("j", 0))
    c.close()
    assert_serving(d)


@pytest.mark.parametrize("job, token, message", [
    # protobuf-c would cut the name at the NUL: "a\0b" would attach to "a".
    (b"a\x00b", b"", "field 'job' of zerod.v1.AttachRequest contains a NUL byte at byte 1"),
    (b"j", b"tok\x00en", "field 'token' of zerod.v1.AttachRequest contains a NUL byte at byte 3"),
    (b"j\xc0\xaf", b"", "field 'job' of zerod.v1.AttachRequest is not valid UTF-8 (at byte 1)"),
    (b"j", b"\xed\xa0\x80", "field 'token' of zerod.v1.AttachRequest is not valid UTF-8 (at byte 0)"),
])
def test_attach_with_a_nul_or_invalid_utf8_string_is_refused(start_daemon, job, token, message):
    d = start_daemon()
    # Job "a" exists, so a name cut at the NUL would find it.
    owner = attach(d, job="a")
    c = z.Conn(d.socket)
    assert_error(c.call(z.ATTACH, z.attach_request(job, 0, token=token)), "INVALID_ARGUMENT",
                 message)
    # The session goes on: a well-formed attach on the same connection works.
    c.expect_ok(z.ATTACH, z.attach_request("j", 0))
    c.close()
    # And a string inside a nested, repeated field: RegisterUnit's tensors[1].name.
    bad_unit = z.register_request("u", (("w", (4,)), ("x", (4,))))
    bad_unit = bad_unit.replace(b"\x0a\x01x", b"\x0a\x01\x00", 1)
    assert_error(owner.call(z.REGISTER_UNIT, bad_unit), "INVALID_ARGUMENT",
                 "field 'tensors[1].name' of zerod.v1.RegisterUnitRequest contains a NUL byte")
    owner.expect_ok(z.DETACH)
    owner.close()
    assert_serving(d)


def test_unknown_and_reply_types_are_refused(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    assert_error(c.call(999), "INVALID_ARGUMENT", "999")
    assert_error(c.call(z.GATHER_REPLY), "INVALID_ARGUMENT", "not a request")
    assert_error(c.call(z.ERROR), "INVALID_ARGUMENT")
    c.close()
    assert_serving(d)


def test_request_id_zero_is_refused(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    c.send(z.ATTACH, z.attach_request("j", 0), request_id=0)
    t, rid, fields, _ = c.recv()
    assert t == z.ERROR and z.status_of(fields) == "INVALID_ARGUMENT"
    c.close()


def test_descriptor_on_a_request_that_takes_none_is_refused_and_closed(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    fd = z.memfd_with(b"x" * 64)
    assert_error(c.call(z.ATTACH, z.attach_request("j", 0), fds=[fd]), "INVALID_ARGUMENT",
                 "descriptor")
    os.close(fd)
    c.close()
    assert_serving(d)


def test_header_fd_count_without_descriptors_closes_the_session(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    payload = z.attach_request("j", 0)
    c.send_raw(z.header(z.ATTACH, 1, len(payload), fd_count=1) + payload)
    assert expect_closed(c) == ["PROTOCOL"]
    assert_serving(d)


def test_bounds_violations_are_invalid_argument(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    assert_error(c.call(z.ATTACH, z.attach_request("bad/name", 0)), "INVALID_ARGUMENT")
    assert_error(c.call(z.ATTACH, z.attach_request("x" * 65, 0)), "INVALID_ARGUMENT")
    c.expect_ok(z.ATTACH, z.attach_request("j", 0))
    too_many_dims = (("w", (1,) * 9),)
    assert_error(c.call(z.REGISTER_UNIT, z.register_request("u", too_many_dims)),
                 "INVALID_ARGUMENT")
    assert_error(c.call(z.REGISTER_UNIT, z.register_request("u", (("w", (4, 0)),))),
                 "INVALID_ARGUMENT")
    assert_error(c.call(z.REGISTER_UNIT, z.register_request("u", ())), "INVALID_ARGUMENT")
    assert_error(c.call(z.REGISTER_UNIT, z.register_request("u", (("w", (2,)), ("w", (3,))))),
                 "INVALID_ARGUMENT", "twice")
    c.close()
    assert_serving(d)


def test_requests_in_the_wrong_state_fail_precondition(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    assert_error(c.call(z.GATHER, z.unit_request(0)), "FAILED_PRECONDITION", "attach")
    c.expect_ok(z.ATTACH, z.attach_request("j", 0))
    assert_error(c.call(z.ATTACH, z.attach_request("j", 0)), "FAILED_PRECONDITION", "already")
    assert_error(c.call(z.GATHER, z.unit_request(7)), "NOT_FOUND", "unknown unit")
    unit = register(c)
    assert_error(c.call(z.RELEASE, z.unit_request(unit)), "FAILED_PRECONDITION", "not hold")
    assert_error(c.call(z.REDUCE, z.unit_request(unit)), "FAILED_PRECONDITION", "gradient")
    _, fds = c.expect_ok(z.GATHER, z.unit_request(unit))
    for fd in fds:
        os.close(fd)
    assert_error(c.call(z.GATHER, z.unit_request(unit)), "FAILED_PRECONDITION", "already")
    c.expect_ok(z.DETACH)
    c.close()


def test_unknown_job_without_create_and_missing_or_wrong_token(start_daemon):
    d = start_daemon()
    c = z.Conn(d.socket)
    assert_error(c.call(z.ATTACH, z.attach_request("nope", 0, create=False)), "NOT_FOUND",
                 "nope")
    owner = attach(d, job="secret", token="s3cret")
    assert_error(c.call(z.ATTACH, z.attach_request("secret", 0, token="guess")),
                 "PERMISSION_DENIED", "token does not match job 'secret'")
    # No token for a job that has one: it is required, and how to give it.
    assert_error(c.call(z.ATTACH, z.attach_request("secret", 0)), "PERMISSION_DENIED",
                 "requires a token", "ZEROD_TOKEN", "--token")
    # A token for a job without one (a ZEROD_TOKEN left set).
    other = attach(d, job="open", token="")
    assert_error(c.call(z.ATTACH, z.attach_request("open", 0, token="s3cret")),
                 "PERMISSION_DENIED", "has no token")
    other.close()
    assert_error(c.call(z.ATTACH, z.attach_request("secret", 5, token="s3cret")),
                 "INVALID_ARGUMENT", "local rank 5")
    owner.close()
    c.close()


def test_attaching_to_a_rank_already_taken_is_refused(start_daemon):
    d = start_daemon()
    first = attach(d, job="j", rank=0)
    second = z.Conn(d.socket)
    assert_error(second.call(z.ATTACH, z.attach_request("j", 0)), "ALREADY_EXISTS", "pid")
    first.expect_ok(z.DETACH)
    first.close()
    # The rank is free again once its worker has detached.
    for _ in range(100):
        t, fields, _ = second.call(z.ATTACH, z.attach_request("j", 0))
        if t == z.ATTACH_REPLY:
            break
    assert t == z.ATTACH_REPLY
    second.close()


def test_gathering_past_max_live_bytes_is_refused_and_changes_nothing(start_daemon):
    d = start_daemon()
    c = attach(d, job="small", max_live_bytes=96 * 1024)
    a = register(c, "a", (("w", (12288,)),))  # 48 KiB
    b = register(c, "b", (("w", (12288,)),))
    _, fds = c.expect_ok(z.GATHER, z.unit_request(a))
    for fd in fds:
        os.close(fd)
    t, fields, _ = c.call(z.GRAD_BUFFER, z.unit_request(b))
    assert t == z.GRAD_BUFFER_REPLY
    assert_error(c.call(z.GATHER, z.unit_request(b)), "RESOURCE_EXHAUSTED", "max_live_bytes")
    # Releasing makes room; nothing else changed.
    c.expect_ok(z.RELEASE, z.unit_request(a))
    _, fds = c.expect_ok(z.GATHER, z.unit_request(b))
    for fd in fds:
        os.close(fd)
    c.expect_ok(z.DETACH)
    c.close()


def test_layout_mismatch_names_the_unit_and_the_tensor(start_daemon):
    d = start_daemon(ranks=2)
    conns = [attach(d, job="m", rank=r) for r in range(2)]
    shapes = [(4, 8), (4, 9)]
    replies = [None, None]

    def reg(r):
        tensors = (("ok.bias", (8,)), ("layer.weight", shapes[r]))
        replies[r] = conns[r].call(z.REGISTER_UNIT, z.register_request("layer", tensors))

    threads = [threading.Thread(target=reg, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in range(2):
        assert_error(replies[r], "INVALID_ARGUMENT", "layer", "#1")
    # Rank 1 sees its own differing tensor in the message.
    assert "layer.weight" in z.message_of(replies[1][1])
    # The job is still usable: a matching registration succeeds.
    ok = [None, None]

    def reg_ok(r):
        ok[r] = conns[r].call(z.REGISTER_UNIT, z.register_request("layer", (("w", (4, 8)),)))

    threads = [threading.Thread(target=reg_ok, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert ok[0][0] == z.REGISTER_UNIT_REPLY and ok[1][0] == z.REGISTER_UNIT_REPLY
    for c in conns:
        c.close()


def test_initial_values_from_rank0_land_in_the_gathered_buffer(start_daemon):
    d = start_daemon()
    c = attach(d, job="init")
    values = [float(i) - 3.5 for i in range(10)]
    fd = z.memfd_with(struct.pack("<10f", *values))
    fields, _ = c.expect_ok(z.REGISTER_UNIT,
                            z.register_request("u", (("a", (3,)), ("b", (7,))),
                                               init=z.INIT_FROM_RANK0), fds=[fd])
    os.close(fd)
    unit = fields.get(1, [0])[0]
    fields, fds = c.expect_ok(z.GATHER, z.unit_request(unit))
    assert len(fds) == 1
    size = fields[3][0]
    m = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
    # Tensor b starts at the next 16-element boundary.
    got = struct.unpack("<3f", m[0:12]) + struct.unpack("<7f", m[64:92])
    assert list(got) == values
    m.close()
    os.close(fds[0])
    # A short init file is refused with the sizes in the message.
    fd = z.memfd_with(b"\0" * 8)
    assert_error(c.call(z.REGISTER_UNIT, z.register_request("v", (("a", (4,)),),
                                                            init=z.INIT_FROM_RANK0), fds=[fd]),
                 "INVALID_ARGUMENT", "16 bytes")
    os.close(fd)
    c.close()


def test_the_socket_is_private_to_the_user(start_daemon):
    d = start_daemon()
    assert os.stat(d.socket).st_mode & 0o777 == 0o600


def test_reduces_accumulate_until_the_step(start_daemon):
    """Two reduces of a gradient of ones, then one SGD step with lr 1:
    every weight moves by -2, and the step reports the norm of the summed
    gradient (sqrt(16 * 2^2) = 8)."""
    d = start_daemon()
    sgd = z.field_varint(1, 3) + z.field_double(2, 1.0)
    c = attach(d, job="accumulate", optimizer=sgd)
    unit = register(c, "u", (("w", (16,)),))
    for _ in range(2):
        fields, fds = c.expect_ok(z.GRAD_BUFFER, z.unit_request(unit))
        if fds:
            grad = mmap.mmap(fds[0], fields[3][0])
            os.close(fds[0])
        grad[0:64] = struct.pack("<16f", *([1.0] * 16))
        c.expect_ok(z.REDUCE, z.unit_request(unit))
    fields, _ = c.expect_ok(z.STEP)
    assert fields[1][0] == 1 and fields[2][0] == 1  # step, version
    assert struct.unpack("<d", fields[3][0])[0] == 8.0
    fields, fds = c.expect_ok(z.GATHER, z.unit_request(unit))
    assert fields[4][0] == 1  # served from version 1
    m = mmap.mmap(fds[0], fields[3][0], prot=mmap.PROT_READ)
    assert struct.unpack("<16f", m[0:64]) == (-2.0,) * 16
    m.close()
    os.close(fds[0])
    grad.close()
    c.close()


def test_a_burst_of_pipelined_requests_is_answered_in_full(start_daemon):
    """200 requests in one write (more than the daemon reads per wakeup,
    most of them already buffered by its reader) all get their replies."""
    d = start_daemon()
    c = attach(d, job="burst")
    burst = b"".join(z.header(z.GATHER, 1000 + i, 2) + z.unit_request(99) for i in range(200))
    c.send_raw(burst)
    seen = set()
    while len(seen) < 200:
        t, rid, fields, fds = c.recv()
        assert t == z.ERROR and z.status_of(fields) == "NOT_FOUND"
        seen.add(rid)
    assert seen == set(range(1000, 1200))
    c.close()
    assert_serving(d)


def test_attach_with_another_config_gets_a_warning_and_the_jobs_config(start_daemon):
    # The config of an attach that does not create the job is not used; one
    # that differs from the job's is reported in AttachReply.warning (field
    # 9) and in a warn line of the daemon's log, naming the fields.
    def lr(value):
        return z.field_double(2, value)  # OptimizerConfig.lr

    d = start_daemon()
    c = attach(d, job="cfg", optimizer=lr(0.25))
    c.expect_ok(z.DETACH)
    c.close()
    c = z.Conn(d.socket)
    fields, _ = c.expect_ok(z.ATTACH, z.attach_request("cfg", 0, optimizer=lr(0.5),
                                                       max_live_bytes=1 << 20))
    warning = fields.get(9, [b""])[0].decode()
    assert warning.startswith("job 'cfg' exists with another config; this attach's was not "
                              "used: lr 0.5 (the job's 0.25), max_live_bytes 1048576 (the job's "), \
        warning
    config = z.decode(fields[5][0])
    assert struct.unpack("<d", z.decode(config[1][0])[2][0])[0] == 0.25  # the job's lr
    c.expect_ok(z.DETACH)
    c.close()
    log = d.read_log()
    assert ('level=warn msg="attach config differs from the job\'s; the job\'s is used" '
            'job=cfg rank=0 pid=') in log, log
    assert "fields=lr,max_live_bytes\n" in log, log
    # The same config, or none, says nothing.
    for same in (z.attach_request("cfg", 0, optimizer=lr(0.25)), z.attach_request("cfg", 0)):
        c = z.Conn(d.socket)
        fields, _ = c.expect_ok(z.ATTACH, same)
        assert 9 not in fields
        c.expect_ok(z.DETACH)
        c.close()
    assert d.read_log().count("attach config differs") == 1
