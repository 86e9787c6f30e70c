"""Health probes (grpc.health.v1, Check and Watch), as Kubernetes' gRPC
probes and grpc_health_probe call them:

- `zerod node --health-listen`: NOT_SERVING while the node has not joined
  its cluster, SERVING once it has, NOT_SERVING again while it drains
  (SIGTERM), and a Watch stream sees each change.
- A standalone daemon is SERVING once ready.
- The coordinator: Check and Watch, SERVICE_UNKNOWN for an unknown
  service on a Watch, NOT_FOUND on a Check.
"""

import re
import signal
import time

import grpc
import pytest

import ctlproto
from conftest import free_port

SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3


def health_port(daemon):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = re.search(r'msg="health listening" address=\S+ port=(\d+)', daemon.read_log())
        if m:
            return int(m.group(1))
        time.sleep(0.02)
    raise AssertionError("no health listener:\n" + daemon.read_log())


def check(address, service=""):
    mods = ctlproto.load()
    with grpc.insecure_channel(address) as ch:
        return mods.health_grpc.HealthStub(ch).Check(
            mods.health.HealthCheckRequest(service=service), timeout=5).status


def wait_status(address, want, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = check(address)
            if last == want:
                return
        except grpc.RpcError as e:
            last = e.code()
        time.sleep(0.05)
    raise AssertionError("health stayed %r, wanted %r" % (last, want))


def test_node_probe_follows_membership_and_drain(cluster):
    port = free_port()
    # The node starts first: its coordinator is not there yet.
    cluster.coordinator = type("Pending", (), {"address": "127.0.0.1:%d" % port})()
    node = cluster.start_node("probed", extra=["--health-listen", "127.0.0.1:0"])
    address = "127.0.0.1:%d" % health_port(node)
    assert check(address) == NOT_SERVING
    assert check(address, "zerod.v1.Node") == NOT_SERVING
    mods = ctlproto.load()
    ch = grpc.insecure_channel(address)
    watch = mods.health_grpc.HealthStub(ch).Watch(mods.health.HealthCheckRequest(), timeout=60)
    seen = [next(watch).status]
    assert seen == [NOT_SERVING]
    cluster.start_coordinator(port=port)
    seen.append(next(watch).status)
    assert seen == [NOT_SERVING, SERVING]
    assert check(address) == SERVING
    # Draining: NOT_SERVING, then the stream ends.
    node.proc.send_signal(signal.SIGTERM)
    statuses = []
    with pytest.raises(grpc.RpcError) as e:
        for reply in watch:
            statuses.append(reply.status)
    assert statuses == [NOT_SERVING], statuses
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    ch.close()
    node.proc.wait(timeout=30)
    assert node.proc.returncode == 0


def test_standalone_probe_and_unknown_service(start_daemon):
    d = start_daemon(extra=["--health-listen", "127.0.0.1:0"])
    address = "127.0.0.1:%d" % health_port(d)
    wait_status(address, SERVING)
    with pytest.raises(grpc.RpcError) as e:
        check(address, "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_coordinator_check_and_watch(cluster):
    coord = cluster.start_coordinator()
    assert check(coord.address) == SERVING
    assert check(coord.address, "zerod.v1.Jobs") == SERVING
    mods = ctlproto.load()
    with grpc.insecure_channel(coord.address) as ch:
        stub = mods.health_grpc.HealthStub(ch)
        known = stub.Watch(mods.health.HealthCheckRequest(service="zerod.v1.Cluster"), timeout=10)
        assert next(known).status == SERVING
        unknown = stub.Watch(mods.health.HealthCheckRequest(service="nope"), timeout=10)
        assert next(unknown).status == SERVICE_UNKNOWN
        known.cancel()
        unknown.cancel()


def test_coordinator_probe_listener_in_plain_text(cluster, tmp_path):
    """With TLS on its main port, the coordinator's probes use a listener
    of their own (Kubernetes' gRPC probes speak no TLS)."""
    import subprocess
    d = tmp_path / "pki"
    d.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "s.key", "-out",
                    "s.crt", "-days", "1", "-subj", "/CN=localhost"],
                   cwd=d, check=True, capture_output=True)
    coord = cluster.start_coordinator(extra=[
        "--tls-cert", str(d / "s.crt"), "--tls-key", str(d / "s.key"),
        "--health-listen", "127.0.0.1:0"])
    address = "127.0.0.1:%d" % health_port(coord)
    assert check(address) == SERVING
    assert check(address, "zerod.v1.Jobs") == SERVING
    # The main port is TLS only: a plain-text probe gets nothing there.
    with pytest.raises(grpc.RpcError):
        check(coord.address)
    mods = ctlproto.load()
    ch = grpc.insecure_channel(address)
    watch = mods.health_grpc.HealthStub(ch).Watch(mods.health.HealthCheckRequest(), timeout=30)
    assert next(watch).status == SERVING
    coord.proc.send_signal(signal.SIGTERM)
    statuses = []
    with pytest.raises(grpc.RpcError) as e:
        for reply in watch:
            statuses.append(reply.status)
    assert statuses == [NOT_SERVING] and e.value.code() == grpc.StatusCode.UNAVAILABLE
    ch.close()
    coord.proc.wait(timeout=30)
    assert coord.proc.returncode == 0
