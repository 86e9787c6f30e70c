"""A gRPC client written on raw HTTP/2 frames, as an attacker would write
one: it opens streams with their headers and no request message (the call
then waits for one), may leave the server's SETTINGS unacknowledged (so
that SETTINGS_MAX_CONCURRENT_STREAMS never binds it), may connect from
another loopback address, and tells how each stream ended.

Only what the tests need of HTTP/2: no padding or priority sent, one
header block per HEADERS frame (CONTINUATION read), flow control opened
wide at the start. Header blocks are HPACK (python3-hpack), which keeps
the dynamic tables of both directions in step as long as every block is
encoded and decoded in order.
"""

import socket
import struct
import time
import urllib.parse

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20


def frame(ftype, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + \
        struct.pack(">I", stream) + payload


def grpc_message(payload):
    """A gRPC length-prefixed message (uncompressed)."""
    return b"\0" + struct.pack(">I", len(payload)) + payload


class Ended:
    """How a stream ended: its grpc-status (None if it was reset) and
    grpc-message, or the RST_STREAM error code."""

    def __init__(self, status, message, reset_code=None):
        self.status, self.message, self.reset_code = status, message, reset_code

    def __repr__(self):
        return "Ended(status=%r, message=%r, reset=%r)" % (self.status, self.message,
                                                           self.reset_code)


class Connection:
    def __init__(self, port, host="127.0.0.1", ack_settings=True, source=None, timeout=10):
        self.sock = socket.create_connection(
            (host, port), timeout=timeout,
            source_address=(source, 0) if source is not None else None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ack_settings = ack_settings
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.decoder.max_allowed_table_size = 1 << 16
        self.inbox = b""
        self.next_stream = 1
        self.ended = {}  # stream id -> Ended
        self.block = {}  # stream id -> header block being continued
        self.goaway = None
        self.closed = False
        self.settings_seen = 0
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0) +
                          frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", (1 << 31) - 1 - 65535)))

    def _headers_frame(self, path, token):
        sid = self.next_stream
        self.next_stream += 2
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
                   (":authority", "localhost"), ("content-type", "application/grpc"),
                   ("te", "trailers")]
        if token is not None:
            headers.append(("authorization", "Bearer " + token))
        return sid, frame(HEADERS, END_HEADERS, sid, self.encoder.encode(headers))

    def open_stream(self, path, token=None, message=None):
        """Opens a call: its headers, and the request message only when
        message (bytes) is given. Returns the stream id."""
        sid, out = self._headers_frame(path, token)
        if message is not None:
            out += frame(DATA, END_STREAM, sid, grpc_message(message))
        self.sock.sendall(out)
        return sid

    def open_streams(self, n, path, token=None):
        """Opens n calls without their request message, in one write."""
        opened = [self._headers_frame(path, token) for _ in range(n)]
        self.sock.sendall(b"".join(out for _, out in opened))
        return [sid for sid, _ in opened]

    def _headers_done(self, sid, flags, block):
        fields = dict(self.decoder.decode(block))
        if flags & END_STREAM:
            status = fields.get("grpc-status")
            message = urllib.parse.unquote(fields.get("grpc-message", ""))
            self.ended[sid] = Ended(int(status) if status is not None else None, message)

    def _handle(self, ftype, flags, sid, payload):
        if ftype == SETTINGS and not flags & ACK:
            self.settings_seen += 1
            if self.ack_settings:
                self.sock.sendall(frame(SETTINGS, ACK, 0))
        elif ftype == PING and not flags & ACK:
            self.sock.sendall(frame(PING, ACK, 0, payload))
        elif ftype in (HEADERS, CONTINUATION):
            if ftype == HEADERS:
                if flags & PADDED:
                    pad = payload[0]
                    payload = payload[1:len(payload) - pad]
                if flags & PRIORITY_FLAG:
                    payload = payload[5:]
                self.block[sid] = (flags, payload)
            else:
                first_flags, so_far = self.block[sid]
                self.block[sid] = (first_flags, so_far + payload)
            if flags & END_HEADERS:
                first_flags, block = self.block.pop(sid)
                self._headers_done(sid, first_flags, block)
        elif ftype == DATA:
            if flags & END_STREAM and sid not in self.ended:
                self.ended[sid] = Ended(None, "stream ended without trailers")
        elif ftype == RST_STREAM:
            if sid not in self.ended:
                self.ended[sid] = Ended(None, "reset", struct.unpack(">I", payload)[0])
        elif ftype == GOAWAY:
            self.goaway = struct.unpack(">II", payload[:8])

    def pump(self, seconds, until=None):
        """Reads and handles frames for up to seconds, or until until()
        is true. Returns when the connection closes too."""
        deadline = time.monotonic() + seconds
        while not self.closed and (until is None or not until()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.sock.settimeout(min(left, 0.2))
            try:
                chunk = self.sock.recv(1 << 20)
            except socket.timeout:
                continue
            except ConnectionError:
                self.closed = True
                break
            if not chunk:
                self.closed = True
                break
            self.inbox += chunk
            while len(self.inbox) >= 9:
                length = int.from_bytes(self.inbox[:3], "big")
                if len(self.inbox) < 9 + length:
                    break
                ftype, flags = self.inbox[3], self.inbox[4]
                sid = struct.unpack(">I", self.inbox[5:9])[0] & 0x7FFFFFFF
                payload = self.inbox[9:9 + length]
                self.inbox = self.inbox[9 + length:]
                self._handle(ftype, flags, sid, payload)

    def pump_until_ended(self, ids, seconds):
        ids = list(ids)
        self.pump(seconds, until=lambda: all(i in self.ended for i in ids))
        return [self.ended.get(i) for i in ids]

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
