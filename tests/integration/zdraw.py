"""A raw client of zerod's IPC protocol for black-box tests.

It speaks the wire format directly (docs/protocol.md): the 24-byte header
built with struct and the protobuf payloads hand-encoded, so the tests can
send frames libzerod would never send (bad magic, oversize lengths, garbage
payloads, wrong descriptor counts) and kill themselves at chosen points.
"""

import os
import socket
import struct

MAGIC = 0x5049445A
VERSION = 1
HEADER = struct.Struct("<IHHQIBBH")

ERROR, NOTICE = 1, 2
ATTACH, ATTACH_REPLY = 16, 17
REGISTER_UNIT, REGISTER_UNIT_REPLY = 18, 19
GATHER, GATHER_REPLY = 20, 21
RELEASE, RELEASE_REPLY = 22, 23
GRAD_BUFFER, GRAD_BUFFER_REPLY = 24, 25
REDUCE, REDUCE_REPLY = 26, 27
STEP, STEP_REPLY = 28, 29
DETACH, DETACH_REPLY = 30, 31
UNITS, UNITS_REPLY = 32, 33
PIN, PIN_REPLY = 34, 35
LOAD_UNIT, LOAD_UNIT_REPLY = 36, 37
STATS, STATS_REPLY = 38, 39

READ_WRITE, READ_ONLY = 0, 1
NO_REPLY = 0x01

STATUS = {
    0: "OK", 1: "INVALID_ARGUMENT", 2: "NOT_FOUND", 3: "ALREADY_EXISTS",
    4: "FAILED_PRECONDITION", 5: "RESOURCE_EXHAUSTED", 6: "PERMISSION_DENIED",
    7: "UNAVAILABLE", 8: "INTERNAL", 9: "ABORTED", 10: "PROTOCOL",
}

INIT_FROM_RANK0, INIT_SEEDED_NORMAL, INIT_ZEROS = 1, 2, 3


# --- protobuf encoding ------------------------------------------------------

def varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_varint(num, v):
    return varint(num << 3) + varint(v)


def field_bytes(num, data):
    if isinstance(data, str):
        data = data.encode()
    return varint((num << 3) | 2) + varint(len(data)) + data


def field_double(num, v):
    return varint((num << 3) | 1) + struct.pack("<d", v)


def decode(payload):
    """Decodes a protobuf payload into {field: [values]} (varints as int,
    length-delimited as bytes, fixed64 as bytes)."""
    fields, i = {}, 0
    while i < len(payload):
        key, i = _read_varint(payload, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _read_varint(payload, i)
        elif wt == 1:
            v, i = payload[i:i + 8], i + 8
        elif wt == 2:
            n, i = _read_varint(payload, i)
            v, i = payload[i:i + n], i + n
        elif wt == 5:
            v, i = payload[i:i + 4], i + 4
        else:
            raise ValueError("wire type %d" % wt)
        fields.setdefault(num, []).append(v)
    return fields


def _read_varint(b, i):
    shift = v = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return v, i


def attach_request(job, local_rank, create=True, token="", working_bf16=False,
                   max_live_bytes=0, optimizer=None, read_only=False, pin=False):
    config = b""
    if working_bf16:
        config += field_varint(2, 2)
    if max_live_bytes:
        config += field_varint(3, max_live_bytes)
    if optimizer is not None:
        config += field_bytes(1, optimizer)
    msg = field_varint(1, 1) + field_bytes(2, job) + field_varint(3, local_rank)
    if token:
        msg += field_bytes(4, token)
    if read_only:
        msg += field_varint(5, READ_ONLY)
    if create:
        msg += field_varint(6, 1)
    if config:
        msg += field_bytes(7, config)
    if pin:
        msg += field_varint(8, 1)
    return msg


def read_only_attach_request(job, token="", pin=False):
    """An ATTACH for a read-only session: no create, no rank."""
    return attach_request(job, 0, create=False, token=token, read_only=True, pin=pin)


def tensor_spec(name, shape, frozen=False):
    msg = field_bytes(1, name) + b"".join(field_varint(2, d) for d in shape)
    if frozen:
        msg += field_varint(3, 1)
    return msg


def register_request(name, tensors, init=INIT_ZEROS, seed=0, std=0.0):
    msg = field_bytes(1, name)
    for t in tensors:
        msg += field_bytes(2, tensor_spec(*t))
    msg += field_varint(3, init)
    if seed:
        msg += field_varint(4, seed)
    if std:
        msg += field_double(5, std)
    return msg


def unit_request(unit_id):
    return field_varint(1, unit_id) if unit_id else b""


def repeated_varints(values):
    """A repeated integer field as decode() returns it, packed or not."""
    out = []
    for v in values:
        if isinstance(v, int):
            out.append(v)
            continue
        i = 0
        while i < len(v):
            n, i = _read_varint(v, i)
            out.append(n)
    return out


def unit_table(fields):
    """Decodes a UnitsReply: ([unit dict], version). Each unit has id, name,
    numel, padded_numel, shard_numel, working_dtype and tensors, a list of
    (name, shape, offset, numel)."""
    units = []
    for raw in fields.get(1, []):
        u = decode(raw)
        tensors = []
        for t in u.get(5, []):
            t = decode(t)
            shape = tuple(repeated_varints(t.get(2, [])))
            tensors.append((t[1][0].decode(), shape, t.get(3, [0])[0], t.get(4, [0])[0]))
        units.append({"id": u.get(1, [0])[0], "name": u.get(9, [b""])[0].decode(),
                      "numel": u.get(2, [0])[0], "padded_numel": u.get(3, [0])[0],
                      "shard_numel": u.get(4, [0])[0], "working_dtype": u.get(6, [0])[0],
                      "existed": u.get(8, [0])[0], "tensors": tensors})
    return units, fields.get(2, [0])[0]


# --- framing ----------------------------------------------------------------

def header(msg_type, request_id, payload_len, fd_count=0, flags=0,
           magic=MAGIC, version=VERSION, reserved=0):
    return HEADER.pack(magic, version, msg_type, request_id, payload_len,
                       fd_count, flags, reserved)


class Closed(Exception):
    pass


class Conn:
    def __init__(self, path, timeout=30.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.next_id = 1

    def close(self):
        self.sock.close()

    def send_raw(self, data, fds=()):
        if fds:
            socket.send_fds(self.sock, [data], list(fds))
        else:
            self.sock.sendall(data)

    def send(self, msg_type, payload=b"", fds=(), flags=0, request_id=None):
        if request_id is None:
            request_id = self.next_id
            self.next_id += 1
        self.send_raw(header(msg_type, request_id, len(payload), len(fds), flags)
                      + payload, fds)
        return request_id

    def _recv_exact(self, n):
        buf = b""
        fds = []
        while len(buf) < n:
            data, got_fds, _, _ = socket.recv_fds(self.sock, n - len(buf), 4)
            if not data:
                raise Closed()
            buf += data
            fds += got_fds
        return buf, fds

    def recv(self):
        """Returns (type, request_id, fields, fds); raises Closed at EOF."""
        head, fds = self._recv_exact(HEADER.size)
        magic, version, msg_type, rid, length, nfds, flags, _ = HEADER.unpack(head)
        assert magic == MAGIC and version == VERSION
        payload, more = self._recv_exact(length) if length else (b"", [])
        return msg_type, rid, decode(payload), fds + more

    def call(self, msg_type, payload=b"", fds=(), flags=0):
        rid = self.send(msg_type, payload, fds, flags)
        while True:
            t, r, fields, got = self.recv()
            if r == rid:
                return t, fields, got
            for fd in got:
                os.close(fd)

    def expect_ok(self, msg_type, payload=b"", fds=()):
        t, fields, got = self.call(msg_type, payload, fds)
        if t == ERROR:
            raise AssertionError("expected a reply to type %d, got %s: %s" % (
                msg_type, status_of(fields), message_of(fields)))
        return fields, got


def rank_stats(fields):
    """A STATS reply's ranks: [{"rank", "step", "counters": {(level,
    collective): (bytes, calls)}, "pool_bytes", "secondary_bytes"}]."""
    ranks = []
    for raw in fields.get(1, []):
        r = decode(raw)
        counters = {}
        for c in r.get(3, []):
            c = decode(c)
            counters[(c[1][0].decode(), c[2][0].decode())] = (c.get(3, [0])[0],
                                                              c.get(4, [0])[0])
        ranks.append({"rank": r.get(1, [0])[0], "step": r.get(2, [0])[0],
                      "counters": counters, "pool_bytes": r.get(4, [0])[0],
                      "secondary_bytes": r.get(5, [0])[0]})
    return ranks


def status_of(fields):
    return STATUS.get(fields.get(1, [0])[0], "?")


def message_of(fields):
    return fields.get(2, [b""])[0].decode(errors="replace")


def memfd_with(data):
    fd = os.memfd_create("zdraw-init")
    os.write(fd, data)
    return fd
