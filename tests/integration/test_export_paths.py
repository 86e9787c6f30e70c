"""Where Export may write and Restore may read (docs/checkpoints.md, "Where
files may be read and written"), against a real standalone daemon:

- An export outside the export roots, through "..", through a symbolic link
  to a directory outside planted in a root, or onto a symbolic link at the
  target name (overwrite or not) is PERMISSION_DENIED, and the file outside
  is untouched: its content and its mode.
- A restore from a path outside the roots, or through a symbolic link, is
  PERMISSION_DENIED; so is an export that reads such a checkpoint.
- What is written is mode 0600 (directories 0700), or --file-mode's.
- With no --export-root, the checkpoint directory is the only root, and a
  relative export path is taken inside it.
"""

import os
import shutil
import stat
import subprocess

import grpc
import pytest

from conftest import binary
from test_checkpoint import restore, save, stub, train, wait_ready

PRECIOUS = b"precious bytes that no export may touch"


def export(daemon, job, path, checkpoint="", overwrite=False, timeout=120):
    pb, ck, _ = stub(daemon)
    return ck.Export(pb.control.ExportRequest(job=job, checkpoint=checkpoint, path=str(path),
                                              overwrite=overwrite), timeout=timeout)


def mode_of(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def expect_denied(call, *args, fragment, **kwargs):
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kwargs)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
    assert fragment in e.value.details(), e.value.details()
    return e.value.details()


@pytest.fixture
def places(tmp_path):
    """tmp/exports, the root, with two planted links; tmp/outside with a
    victim file (mode 0644)."""
    exports = tmp_path / "exports"
    outside = tmp_path / "outside"
    exports.mkdir()
    outside.mkdir()
    victim = outside / "victim.safetensors"
    victim.write_bytes(PRECIOUS)
    os.chmod(victim, 0o644)
    (exports / "evil").symlink_to(outside)
    (exports / "link.safetensors").symlink_to(victim)
    return exports, outside, victim


def assert_untouched(exports, outside, victim):
    assert victim.read_bytes() == PRECIOUS and mode_of(victim) == 0o644
    assert sorted(os.listdir(outside)) == ["victim.safetensors"]
    assert os.path.islink(exports / "link.safetensors")
    assert os.readlink(exports / "link.safetensors") == str(victim)


def test_export_stays_inside_the_export_roots(start_daemon, places):
    exports, outside, victim = places
    d = start_daemon(extra=["--export-root", str(exports)])
    train(d, 1, "p", 2)
    wait_ready(d, "p")
    save(d, "p", "c")
    roots = "(%s)" % exports
    for checkpoint in ("c", ""):  # of a checkpoint, and of the live state
        for overwrite in (False, True):
            expect_denied(export, d, "p", victim, checkpoint=checkpoint, overwrite=overwrite,
                          fragment="export path %s is outside the export roots %s" % (victim,
                                                                                       roots))
            expect_denied(export, d, "p", "%s/../outside/victim.safetensors" % exports,
                          checkpoint=checkpoint, overwrite=overwrite, fragment="'..'")
            expect_denied(export, d, "p", "../outside/victim.safetensors",
                          checkpoint=checkpoint, overwrite=overwrite, fragment="'..'")
            expect_denied(export, d, "p", exports / "evil" / "victim.safetensors",
                          checkpoint=checkpoint, overwrite=overwrite,
                          fragment="through a symbolic link at %s/evil" % exports)
            expect_denied(export, d, "p", exports / "evil" / "new.safetensors",
                          checkpoint=checkpoint, overwrite=overwrite,
                          fragment="through a symbolic link at %s/evil" % exports)
            expect_denied(export, d, "p", exports / "link.safetensors", checkpoint=checkpoint,
                          overwrite=overwrite, fragment="is a symbolic link")
            assert_untouched(exports, outside, victim)
    assert sorted(os.listdir(exports)) == ["evil", "link.safetensors"]

    # Inside the root: written, mode 0600; a relative path lands in the root.
    reply = export(d, "p", exports / "ok.safetensors", checkpoint="c")
    assert reply.path == str(exports / "ok.safetensors")
    assert mode_of(exports / "ok.safetensors") == 0o600
    reply = export(d, "p", "sub-less.safetensors")
    assert reply.path == str(exports / "sub-less.safetensors")
    assert mode_of(exports / "sub-less.safetensors") == 0o600
    # Doubled slashes and "." are harmless and dropped.
    reply = export(d, "p", "%s//./ok.safetensors" % exports, checkpoint="c", overwrite=True)
    assert reply.path == str(exports / "ok.safetensors")
    assert_untouched(exports, outside, victim)


def test_restore_reads_only_inside_the_roots(start_daemon, places, tmp_path):
    exports, outside, victim = places
    d = start_daemon(extra=["--export-root", str(exports)])
    train(d, 1, "r", 2)
    wait_ready(d, "r")
    cp = save(d, "r", "c").checkpoint
    export(d, "r", exports / "w.safetensors", checkpoint="c")
    # Inside the roots: the export root and the checkpoint directory.
    assert restore(d, "r", str(exports / "w.safetensors")).step == 0
    assert restore(d, "r", cp.path).step == 2

    # The same files outside, and reached through links inside.
    shutil.copy(exports / "w.safetensors", outside / "w.safetensors")
    shutil.copytree(cp.path, outside / "c")
    (exports / "alias.safetensors").symlink_to(outside / "w.safetensors")
    (exports / "alias-dir").symlink_to(outside / "c")
    roots = "(%s, %s)" % (os.path.dirname(os.path.dirname(cp.path)), exports)
    for source in (outside / "w.safetensors", outside / "c"):
        expect_denied(restore, d, "r", str(source),
                      fragment="checkpoint path %s is outside the roots" % source)
        assert roots in expect_denied(restore, d, "r", str(source), fragment="outside")
    expect_denied(restore, d, "r", str(exports / "evil" / "w.safetensors"),
                  fragment="through a symbolic link at %s/evil" % exports)
    expect_denied(restore, d, "r", str(exports / "evil" / "c"),
                  fragment="through a symbolic link at %s/evil" % exports)
    expect_denied(restore, d, "r", str(exports / "alias.safetensors"),
                  fragment="is a symbolic link")
    expect_denied(restore, d, "r", str(exports / "alias-dir"), fragment="is a symbolic link")
    expect_denied(restore, d, "r", "%s/../outside/c" % exports, fragment="'..'")
    # Export reads its source with the same rules.
    expect_denied(export, d, "r", exports / "x.safetensors", checkpoint=str(outside / "c"),
                  fragment="outside the roots")
    expect_denied(export, d, "r", exports / "x.safetensors", checkpoint=str(exports / "alias-dir"),
                  fragment="is a symbolic link")
    assert not (exports / "x.safetensors").exists()
    # The job kept the state it had.
    assert save(d, "r", "after").checkpoint.step == 2


def test_default_root_is_the_checkpoint_dir_and_file_mode_applies(start_daemon, tmp_path):
    d = start_daemon(extra=["--file-mode", "0640"])
    train(d, 1, "m", 2)
    wait_ready(d, "m")
    root = os.path.realpath(str(d.dir / "checkpoints"))
    outside = tmp_path / "elsewhere.safetensors"
    expect_denied(export, d, "m", outside,
                  fragment="export path %s is outside the export roots (%s)" % (outside, root))
    assert not outside.exists()
    reply = export(d, "m", "rel.safetensors")
    assert reply.path == os.path.join(root, "rel.safetensors")
    assert mode_of(reply.path) == 0o640
    cp = save(d, "m", "c").checkpoint
    assert mode_of(cp.path) == 0o750 and mode_of(os.path.dirname(cp.path)) == 0o750
    for name in os.listdir(cp.path):
        assert mode_of(os.path.join(cp.path, name)) == 0o640, name


def test_checkpoint_files_are_private_by_default(start_daemon):
    d = start_daemon()
    train(d, 1, "q", 1)
    wait_ready(d, "q")
    cp = save(d, "q", "c").checkpoint
    assert mode_of(cp.path) == 0o700 and mode_of(os.path.dirname(cp.path)) == 0o700
    names = os.listdir(cp.path)
    assert "manifest.json" in names and any(n.endswith(".zdshard") for n in names)
    for name in names:
        assert mode_of(os.path.join(cp.path, name)) == 0o600, name
    reply = export(d, "q", "q.safetensors", checkpoint="c")
    assert mode_of(reply.path) == 0o600
    # Never into a job's checkpoint directory: not over a manifest, not
    # next to it, even with overwrite.
    manifest = os.path.join(cp.path, "manifest.json")
    before = open(manifest, "rb").read()
    for target in [manifest, os.path.join(cp.path, "x.safetensors"),
                   os.path.join(os.path.dirname(cp.path), "y.safetensors"), "q/c/manifest.json"]:
        expect_denied(export, d, "q", target, checkpoint="c", overwrite=True,
                      fragment="inside a job's directory of the checkpoint directory")
    assert open(manifest, "rb").read() == before
    assert not os.path.exists(os.path.join(cp.path, "x.safetensors"))


@pytest.mark.parametrize("args, code, words", [
    (["coordinator", "--export-root", "/nonexistent/zerod-root"], 1, "--export-root"),
    (["coordinator", "--file-mode", "0666"], 2, "--file-mode"),
    (["coordinator", "--file-mode", "rw"], 2, "--file-mode"),
    (["node", "--coordinator", "127.0.0.1:1", "--export-root", "/tmp"], 2, "--export-root"),
    (["--file-mode", "04600"], 2, "--file-mode"),
])
def test_bad_flags_are_refused_at_start(tmp_path, args, code, words):
    if args[0] == "coordinator":
        args = args + ["--state-dir", str(tmp_path / "state"), "--listen", "127.0.0.1:0"]
    else:
        args = args + ["--dir", str(tmp_path / "d")]
    proc = subprocess.run([binary("zerod")] + args, capture_output=True, text=True, timeout=30)
    assert proc.returncode == code and words in proc.stderr, (proc.returncode, proc.stderr)
