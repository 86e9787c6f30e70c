"""deploy/components/cert-manager: it renders into either overlay; its
Certificates write exactly the Secrets the pods mount, with the names the
pods dial; the issuer chain is whole; and certificates made as cert-manager
would make them from these specs (openssl, the same subject, names, usages
and CA flag) carry a real node's mutual TLS connection to a real
coordinator under the flags the rendered pods pass."""

import os
import re
import subprocess
import time

import pytest

from deploy_common import BIN, OVERLAYS, container, find, render, render_with_components, validate

CERT_MANAGER = "cert-manager.io/v1"


def rendered(tmp_path, overlay):
    return render_with_components(tmp_path, overlay, "cert-manager")


def of_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs
            if d["kind"] == kind and d["apiVersion"] == CERT_MANAGER}


def flag(args, name):
    values = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    assert len(values) == 1, (name, args)
    return values[0]


def secret_mounts(docs, kind, name, container_name):
    """({secret name: mount path}, args) of a pod template's container."""
    pod = find(docs, kind, name)["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    c = container(pod, container_name)
    return {secrets[m["name"]]: m["mountPath"] for m in c["volumeMounts"]
            if m["name"] in secrets}, c["args"]


def daemons(docs):
    """The coordinator's and the nodes' (secret mounts, args)."""
    return (secret_mounts(docs, "StatefulSet", "zerod-coordinator", "coordinator"),
            secret_mounts(docs, "DaemonSet", "zerod-node", "node"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_component_renders_and_validates(overlay, tmp_path):
    docs = rendered(tmp_path, overlay)
    def key(d):
        return (d["kind"], d["metadata"]["name"])
    added = sorted(set(map(key, docs)) - set(map(key, render(overlay))))
    assert added == [("Certificate", "zerod-ca"), ("Certificate", "zerod-coordinator"),
                     ("Certificate", "zerod-node"), ("Issuer", "zerod-ca"),
                     ("Issuer", "zerod-selfsigned")], added
    validate(tmp_path, f"{overlay}-cert-manager", docs)  # Kubernetes' own kinds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_certificates_are_the_secrets_the_pods_mount(overlay, tmp_path):
    docs = rendered(tmp_path, overlay)
    certs, issuers = of_kind(docs, "Certificate"), of_kind(docs, "Issuer")
    namespace = find(docs, "Namespace", "zerod")["metadata"]["name"]
    for d in list(certs.values()) + list(issuers.values()):
        assert d["metadata"]["namespace"] == namespace

    (coord_mounts, coord_args), (node_mounts, node_args) = daemons(docs)
    coord, node = certs["zerod-coordinator"]["spec"], certs["zerod-node"]["spec"]
    # Each pod reads tls.crt, tls.key and ca.crt, the keys cert-manager writes,
    # from the Secret its Certificate names.
    for spec, mounts, args, flags in (
            (coord, coord_mounts, coord_args, ("--tls-cert", "--tls-key", "--tls-client-ca")),
            (node, node_mounts, node_args, ("--tls-cert", "--tls-key", "--tls-ca"))):
        where = mounts[spec["secretName"]]
        assert [flag(args, f) for f in flags] == [
            where + "/tls.crt", where + "/tls.key", where + "/ca.crt"], args
    # The coordinator's certificate covers the name the nodes dial, and every
    # name of its Service; the usages fit each side.
    service = find(docs, "Service", "zerod-coordinator")["metadata"]["name"]
    dialled = flag(node_args, "--coordinator").rsplit(":", 1)[0]
    assert dialled in coord["dnsNames"]
    assert set(coord["dnsNames"]) == {service, f"{service}.{namespace}",
                                      f"{service}.{namespace}.svc",
                                      f"{service}.{namespace}.svc.cluster.local"}
    assert "server auth" in coord["usages"] and "client auth" in node["usages"]
    for spec in (coord, node):
        assert spec["privateKey"]["rotationPolicy"] == "Always"
        assert parse_hours(spec["renewBefore"]) < parse_hours(spec["duration"])

    # The chain: leaves from the CA Issuer, whose Secret is the CA
    # Certificate's, itself from the self-signed Issuer.
    ca_issuer = coord["issuerRef"]["name"]
    assert node["issuerRef"]["name"] == ca_issuer
    ca_cert = [c for c in certs.values()
               if c["spec"]["secretName"] == issuers[ca_issuer]["spec"]["ca"]["secretName"]]
    assert len(ca_cert) == 1 and ca_cert[0]["spec"]["isCA"] is True
    assert "selfSigned" in issuers[ca_cert[0]["spec"]["issuerRef"]["name"]]["spec"]
    for spec in (coord, node, ca_cert[0]["spec"]):
        assert spec["issuerRef"]["kind"] == "Issuer"
        assert spec["issuerRef"]["group"] == "cert-manager.io"


def parse_hours(duration):
    m = re.fullmatch(r"(\d+)h", duration)
    assert m, duration
    return int(m.group(1))


# ---------------------------------------------------------------------------
# Issued as cert-manager would, used by real daemons


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def issue(d, name, spec, ca):
    """A certificate from a Certificate's spec: subject, DNS names, extended
    usages, signed by ca (the CA's files in d), written as cert-manager's
    Secret would hold it: name/tls.crt, tls.key, ca.crt."""
    out = os.path.join(d, name)
    os.makedirs(out)
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=" + spec["commonName"], cwd=out)
    eku = {"server auth": "serverAuth", "client auth": "clientAuth"}
    lines = ["extendedKeyUsage=" + ",".join(eku[u] for u in spec["usages"] if u in eku),
             "keyUsage=digitalSignature,keyEncipherment"]
    if spec.get("dnsNames"):
        lines.append("subjectAltName=" + ",".join("DNS:" + n for n in spec["dnsNames"]))
    with open(os.path.join(out, "ext"), "w") as f:
        f.write("\n".join(lines) + "\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", os.path.join(d, ca, "tls.crt"), "-CAkey",
            os.path.join(d, ca, "tls.key"), "-CAcreateserial", "-days", "2", "-extfile", "ext",
            "-out", "tls.crt", cwd=out)
    with open(os.path.join(d, ca, "tls.crt")) as src, open(os.path.join(out, "ca.crt"), "w") as f:
        f.write(src.read())


def as_here(args, mounts, secrets_dir):
    """The pod's TLS flags with each Secret's mount path replaced by the
    directory issue() wrote it to."""
    out = []
    for a in args:
        if a.startswith("--tls"):
            for secret, path in mounts.items():
                a = a.replace(path + "/", os.path.join(secrets_dir, secret) + "/")
            out.append(a)
    return out


def test_issued_certificates_carry_a_node_to_the_coordinator(tmp_path):
    docs = rendered(tmp_path, "cpu")
    certs = of_kind(docs, "Certificate")
    d = str(tmp_path / "secrets")
    ca = certs["zerod-ca"]["spec"]
    os.makedirs(os.path.join(d, ca["secretName"]))
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "tls.key", "-out", "tls.crt", "-days", "2", "-subj",
            "/CN=" + ca["commonName"], cwd=os.path.join(d, ca["secretName"]))
    for name in ("zerod-coordinator", "zerod-node"):
        issue(d, certs[name]["spec"]["secretName"], certs[name]["spec"], ca["secretName"])

    (coord_mounts, coord_args), (node_mounts, node_args) = daemons(docs)
    dialled = flag(node_args, "--coordinator").rsplit(":", 1)[0]
    log_path = tmp_path / "coordinator.log"
    procs = []
    try:
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen(
                [os.path.join(BIN, "zerod"), "coordinator", "--listen", "127.0.0.1:0",
                 "--state-dir", str(tmp_path / "state"), "--tls-require-client-cert",
                 "--insecure"] + as_here(coord_args, coord_mounts, d), stderr=log))
        address = wait_for_log(log_path, r'msg="coordinator listening" address=(127\.0\.0\.1:\d+)')
        node_log = tmp_path / "node.log"
        node_dir = tmp_path / "node"
        node_dir.mkdir()
        with open(node_log, "w") as log:
            # The name the pod dials, checked against the certificate.
            procs.append(subprocess.Popen(
                [os.path.join(BIN, "zerod"), "node", "--coordinator", address, "--name", "n1",
                 "--dir", str(node_dir), "--ranks", "1", "--tls-server-name", dialled]
                + as_here(node_args, node_mounts, d), stderr=log))
        wait_for_log(log_path, r'msg="node joined" node=(n1)')
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=60)


def wait_for_log(path, pattern, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text())
        if m:
            return m.group(1)
        time.sleep(0.05)
    raise AssertionError("no %s in:\n%s" % (pattern, path.read_text()))
