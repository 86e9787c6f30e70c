"""Certificates rotate without a restart (docs/security.md, "Rotating
certificates"): the coordinator's TLS files replaced in place (as the
kubelet swaps a renewed Secret's files) are read at the next handshake, so
a client that trusts only the new CA connects and one that trusts only the
old one no longer does; files that do not go together (a key that is not
the certificate's) are not taken, with a warning, and the previous
material keeps serving. Mutual TLS: a renewed client CA takes effect the
same way."""

import os
import shutil
import time

from conftest import binary, run_worker, wait_for
from test_security import make_ca, make_cert, pki, write_principals  # noqa: F401 (fixture)


def install(live, src_dir, name, key_from=None):
    """Replaces live/tls.crt and tls.key with name's, each by a rename (a
    reader never sees half a file)."""
    for ext, src in (("crt", name), ("key", key_from or name)):
        tmp = os.path.join(live, "tls.%s.tmp" % ext)
        shutil.copyfile(os.path.join(src_dir, "%s.%s" % (src, ext)), tmp)
        os.replace(tmp, os.path.join(live, "tls.%s" % ext))


def health(address, ca):
    return run_worker([binary("zerodctl"), "-c", address, "--tls-ca", str(ca),
                       "--tls-server-name", "localhost", "health"], check=False)


def test_a_renewed_certificate_is_served_without_a_restart(cluster, pki, tmp_path):
    d = str(pki)
    make_ca(d, "ca2")
    make_cert(d, "ca2", "server2", "coordinator")
    live = tmp_path / "live"
    live.mkdir()
    install(str(live), d, "server")
    coord = cluster.start_coordinator(extra=["--tls-cert", str(live / "tls.crt"), "--tls-key",
                                             str(live / "tls.key"), "--insecure"])
    assert health(coord.address, pki / "ca.crt").returncode == 0
    assert health(coord.address, pki / "ca2.crt").returncode != 0

    install(str(live), d, "server2")
    wait_for("the renewed certificate",
             lambda: health(coord.address, pki / "ca2.crt").returncode == 0, timeout_s=20)
    assert health(coord.address, pki / "ca.crt").returncode != 0
    assert "TLS certificate reloaded" in coord.read_log()

    # A certificate with another's key: refused, the renewed one stays.
    install(str(live), d, "server", key_from="server2")
    assert health(coord.address, pki / "ca2.crt").returncode == 0
    wait_for("the refusal", lambda: "were not taken" in coord.read_log())
    assert "is not the certificate" in coord.read_log()
    assert coord.proc.poll() is None


def test_a_node_presents_its_renewed_certificate_without_a_restart(cluster, pki, tmp_path):
    """Mutual TLS: the node's own certificate, renewed in place under a new
    CA, is what its next connection presents (gRPC's file watcher reads it
    again every few seconds). The coordinator, restarted trusting only the
    new CA, takes the node back; the node itself was never restarted."""
    d = str(pki)
    make_ca(d, "ca2")
    make_cert(d, "ca2", "node-b-renewed", "node-b")
    make_cert(d, "ca2", "ops2", "ops")
    principals = write_principals(tmp_path / "principals",
                                  ["node-b node - cert:node-b", "ops admin - cert:ops"])
    client_ca = tmp_path / "client-ca.crt"
    shutil.copyfile(pki / "ca.crt", client_ca)
    coord = cluster.start_coordinator(extra=[
        "--auth-file", str(principals), "--tls-cert", str(pki / "server.crt"),
        "--tls-key", str(pki / "server.key"), "--tls-client-ca", str(client_ca),
        "--tls-require-client-cert"])
    live = tmp_path / "node-live"
    live.mkdir()
    install(str(live), d, "node-b")
    tls = ["--tls-ca", str(pki / "ca.crt"), "--tls-server-name", "localhost"]
    node = cluster.start_node("node-b", ranks=1, extra=tls + [
        "--tls-cert", str(live / "tls.crt"), "--tls-key", str(live / "tls.key")])

    def members(ops):
        return run_worker([binary("zerodctl"), "-c", coord.address] + tls + [
            "--tls-cert", str(pki / (ops + ".crt")), "--tls-key", str(pki / (ops + ".key")),
            "members"], check=False)
    wait_for("node-b to join", lambda: "node-b" in members("ops").stdout)
    # The server's name is still checked with a client certificate.
    wrong = run_worker([binary("zerodctl"), "-c", coord.address, "--tls-ca", str(pki / "ca.crt"),
                        "--tls-server-name", "not-the-coordinator", "--tls-cert",
                        str(pki / "ops.crt"), "--tls-key", str(pki / "ops.key"), "health"],
                       check=False)
    assert wrong.returncode != 0, wrong.stdout

    install(str(live), d, "node-b-renewed")
    time.sleep(7)  # over the watcher's period (RPC_TLS_REFRESH_S, 5 s)
    shutil.copyfile(pki / "ca2.crt", client_ca)
    coord.kill()
    coord.start()
    wait_for("node-b back with its renewed certificate",
             lambda: "node=node-b" in coord.read_log() and "node-b" in members("ops2").stdout,
             timeout_s=30)
    assert node.alive()
    assert "node=node-b" in coord.read_log(), coord.read_log()
    assert members("ops").returncode != 0  # the old CA's client is refused now
