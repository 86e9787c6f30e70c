"""What the control plane tells a user to do works when done.

Each hint is provoked as a user would meet it; every flag (--x) and
environment variable (ZEROD_X) it names is taken from the message itself
and then used, with zerodctl and with zerod node as the hint says: a
flag that does not exist, or one that does not do what the hint says,
fails here.
"""

import re

from conftest import binary, run_worker
from test_security import TOKENS, pki, sha, token_file, wait_for, write_principals  # noqa: F401


def named(message):
    return set(re.findall(r"--[a-z][a-z-]*", message)), set(re.findall(r"\bZEROD_[A-Z_]+", message))


def members(ctl):
    return run_worker(ctl + ["members"]).stdout


def test_the_no_credentials_hint_names_what_works(cluster, pki, tmp_path, monkeypatch):
    principals = write_principals(tmp_path / "principals", [
        "ops-cert admin - cert:ops", "node-b node - cert:node-b"])
    coord = cluster.start_coordinator(extra=[
        "--auth-file", str(principals), "--tls-cert", str(pki / "server.crt"),
        "--tls-key", str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.crt")])
    tls = ["--tls-ca", str(pki / "ca.crt")]
    ctl = [binary("zerodctl"), "-c", coord.address] + tls

    proc = run_worker(ctl + ["jobs", "list"], check=False)
    assert proc.returncode != 0 and "no credentials" in proc.stderr, proc.stderr
    flags, variables = named(proc.stderr)
    assert flags == {"--auth-token-file", "--tls-cert", "--tls-key"}, proc.stderr
    assert variables == {"ZEROD_AUTH_TOKEN"}, proc.stderr

    # zerodctl, each way the hint names.
    run_worker(ctl + ["--auth-token-file", token_file(tmp_path, "admin"), "jobs", "list"])
    monkeypatch.setenv("ZEROD_AUTH_TOKEN", TOKENS["admin"])
    run_worker(ctl + ["jobs", "list"])
    monkeypatch.delenv("ZEROD_AUTH_TOKEN")
    certificate = ["--tls-cert", str(pki / "ops.crt"), "--tls-key", str(pki / "ops.key")]
    run_worker(ctl + certificate + ["jobs", "list"])

    # zerod node, each way too.
    admin = ctl + certificate
    cluster.start_node("node-a", extra=tls + ["--auth-token-file", token_file(tmp_path, "node-a")])
    monkeypatch.setenv("ZEROD_AUTH_TOKEN", TOKENS["node-c"])
    cluster.start_node("node-c", extra=tls)
    monkeypatch.delenv("ZEROD_AUTH_TOKEN")
    cluster.start_node("node-b", extra=tls + ["--tls-cert", str(pki / "node-b.crt"),
                                              "--tls-key", str(pki / "node-b.key")])
    wait_for(lambda: all(n in members(admin) for n in ("node-a", "node-b", "node-c")),
             "the three nodes to join")

    # Every flag it names is in both programs' --help.
    for program in ([binary("zerodctl"), "--help"], [binary("zerod"), "node", "--help"]):
        text = run_worker(program, check=False)
        help_text = text.stdout + text.stderr
        for flag in flags:
            assert flag in help_text, (program, flag)
        for variable in variables:
            assert variable in help_text, (program, variable)


def test_the_export_root_hint_names_a_flag_of_the_coordinator(cluster, tmp_path):
    principals = write_principals(tmp_path / "principals")
    coord = cluster.start_coordinator(extra=["--auth-file", str(principals)])
    ctl = [binary("zerodctl"), "-c", coord.address, "--auth-token-file",
           token_file(tmp_path, "alice")]
    run_worker(ctl + ["jobs", "create", "h", "--nodes", "1", "--ranks-per-node", "1"],
               check=False)  # no node: the job waits, which is enough to export from
    proc = run_worker(ctl + ["export", "h", "team-a/h.safetensors", "--checkpoint", "x"],
                      check=False)
    assert proc.returncode != 0 and "--export-root" in proc.stderr, proc.stderr
    flags, _ = named(proc.stderr)
    help_text = run_worker([binary("zerod"), "coordinator", "--help"], check=False)
    for flag in flags:
        assert flag in help_text.stdout + help_text.stderr, flag
    # And the flag does what the hint says: with it, the same export gets
    # past the rule (to the missing checkpoint).
    coord.stop()
    exports = tmp_path / "exports"
    exports.mkdir()
    coord2 = cluster.start_coordinator(extra=["--auth-file", str(principals),
                                              "--export-root", str(exports)])
    ctl[2] = coord2.address
    proc = run_worker(ctl + ["export", "h", "team-a/h.safetensors", "--checkpoint", "x"],
                      check=False)
    assert "PERMISSION_DENIED" not in proc.stderr and "NOT_FOUND" in proc.stderr, proc.stderr


def test_the_quota_hint_names_zerodctl_flags(cluster, tmp_path):
    principals = write_principals(tmp_path / "principals",
                                  ["quota team-a jobs=4 host-bytes=1G"])
    coord = cluster.start_coordinator(extra=["--auth-file", str(principals)])
    cluster.start_node("node-a", extra=["--auth-token-file", token_file(tmp_path, "node-a")])
    ctl = [binary("zerodctl"), "-c", coord.address, "--auth-token-file",
           token_file(tmp_path, "alice")]
    create = ctl + ["jobs", "create", "q", "--nodes", "1", "--ranks-per-node", "1"]
    proc = run_worker(create, check=False)
    assert proc.returncode != 0, proc.stdout
    flags, _ = named(proc.stderr)
    assert flags == {"--max-host-bytes"}, proc.stderr
    wait_for(lambda: "node-a" in run_worker(ctl + ["members"]).stdout, "node-a to join")
    run_worker(create + ["--max-host-bytes", "64M"])
