"""Exchange with the ecosystem (docs/checkpoints.md, "safetensors"): real
standalone daemons and workers, checked with the real `safetensors` library
from PyPI (scripts/deps.sh test installs it) and PyTorch.

- Export (Checkpoints.Export, `zerodctl export`) of a checkpoint or of a
  live job: the file loads with safetensors.torch.load_file and holds the
  gathered master weights exactly (fp32), or rounded to nearest even (bf16).
- Restore from a .safetensors file that safetensors.torch.save_file wrote:
  the job's master weights become the file's, moments zero, step 0; a
  missing or mis-shaped tensor is refused naming it, and the job keeps its
  state.
"""

import json
import os
import subprocess

import grpc
import pytest

try:
    import safetensors
    import safetensors.torch
    import torch
except ImportError as e:  # a missing library is a broken setup, not a skip
    raise ImportError("%s: run scripts/deps.sh test (safetensors comes from PyPI)" % e)

from conftest import binary
from test_checkpoint import HEADER, load_checkpoint, save, restore, listed, stub, train, wait_ready


@pytest.fixture
def start_daemon(start_daemon, tmp_path):
    """conftest's, with tmp_path as the export root: the tests export to
    and restore from files there."""
    def start(ranks=1, timeout_s=10, extra=()):
        return start_daemon(ranks, timeout_s, ["--export-root", str(tmp_path)] + list(extra))
    return start


def export(daemon, job, path, checkpoint="", dtype="fp32", overwrite=False, timeout=120):
    pb, ck, _ = stub(daemon)
    dt = pb.control.EXPORT_DTYPE_BF16 if dtype == "bf16" else pb.control.EXPORT_DTYPE_F32
    return ck.Export(pb.control.ExportRequest(job=job, checkpoint=checkpoint, path=str(path),
                                              dtype=dt, overwrite=overwrite), timeout=timeout)


def full_weights(path):
    """{tensor name: fp32 torch tensor of its registered shape} from the
    shard files of a checkpoint, and the manifest."""
    manifest, units = load_checkpoint(path)
    out = {}
    for unit in manifest["units"]:
        master = torch.frombuffer(bytearray(units[unit["name"]]["master"]), dtype=torch.float32)
        for t in unit["tensors"]:
            n = 1
            for s in t["shape"]:
                n *= s
            out[t["name"]] = master[t["offset"]:t["offset"] + n].reshape(t["shape"])
    return out, manifest


def moments_of(path):
    manifest, units = load_checkpoint(path)
    return {u: {s: v for s, v in states.items() if s != "master"} for u, states in units.items()}


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name


def test_export_of_checkpoint_loads_exactly(start_daemon, tmp_path):
    d = start_daemon(ranks=2)
    train(d, 2, "ex", 5)
    cp = save(d, "ex", "five").checkpoint
    want, manifest = full_weights(cp.path)
    assert len(want) >= 2

    out = tmp_path / "five.safetensors"
    reply = export(d, "ex", out, checkpoint="five")
    assert reply.path == str(out) and reply.step == 5 and reply.tensors == len(want)
    assert reply.bytes == os.path.getsize(out) and reply.checkpoint == cp.path
    assert_same(safetensors.torch.load_file(str(out)), want)
    with safetensors.safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "zerod.job": "ex", "zerod.step": "5",
                                "zerod.checkpoint": "five"}
        # Tensors in manifest order: units by id, tensors by offset.
        order = [t["name"] for u in manifest["units"] for t in u["tensors"]]
        assert list(f.keys()) == sorted(order)  # safe_open lists keys sorted

    # bf16: the fp32 master weights rounded to nearest even, as torch rounds.
    half = tmp_path / "five-bf16.safetensors"
    reply = export(d, "ex", half, checkpoint="ex/five", dtype="bf16")
    assert reply.bytes < os.path.getsize(out)
    assert_same(safetensors.torch.load_file(str(half)),
                {k: v.to(torch.bfloat16) for k, v in want.items()})


def test_export_of_live_job_matches_a_save(start_daemon, tmp_path):
    d = start_daemon(ranks=2)
    train(d, 2, "live", 4)
    wait_ready(d, "live")
    out = tmp_path / "live.safetensors"
    reply = export(d, "live", out)
    assert reply.step == 4 and reply.checkpoint == ""
    got = safetensors.torch.load_file(str(out))
    # Nothing trained in between: a save now holds the same weights.
    cp = save(d, "live", "now").checkpoint
    assert cp.step == 4
    assert_same(got, full_weights(cp.path)[0])
    # The export's temporary checkpoint is gone, and never listed.
    assert [c.name for c in listed(d, "live")] == ["now"]
    assert os.listdir(os.path.dirname(cp.path)) == ["now"]


def test_zerodctl_export(start_daemon, tmp_path):
    d = start_daemon(ranks=1)
    train(d, 1, "cli", 3)
    wait_ready(d, "cli")
    ctl = [binary("zerodctl"), "--coordinator", "unix:%s/control.sock" % d.dir]
    # A relative FILE is taken inside the coordinator's export root, not
    # zerodctl's directory.
    proc = subprocess.run(ctl + ["--json", "export", "cli", "cli.safetensors"], cwd=d.dir,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout)
    assert reply["path"] == str(tmp_path / "cli.safetensors") and reply["step"] == 3
    assert reply["dtype"] == "fp32" and reply["checkpoint"] == ""
    first = safetensors.torch.load_file(reply["path"])
    # The file exists: refused without --overwrite, replaced with it.
    proc = subprocess.run(ctl + ["export", "cli", "cli.safetensors"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "exists" in proc.stderr, proc.stderr
    save(d, "cli", "c")
    proc = subprocess.run(ctl + ["export", "cli", str(tmp_path / "cli.safetensors"),
                                 "--checkpoint", "c", "--dtype", "bf16", "--overwrite"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "bf16" in proc.stdout and "step" in proc.stdout
    assert_same(safetensors.torch.load_file(str(tmp_path / "cli.safetensors")),
                {k: v.to(torch.bfloat16) for k, v in first.items()})
    # Usage errors are caught before anything is sent.
    for args, words in [(["export", "cli", "x", "--dtype", "fp16"], "--dtype"),
                        (["export", "cli"], "usage"),
                        (["checkpoint", "list", "--overwrite"], "belongs to export"),
                        # The first misplaced option is named, of each command's.
                        (["members", "--nodes", "2", "--lr", "0.1"],
                         "option '--nodes' belongs to jobs create"),
                        (["jobs", "create", "x", "--dtype", "bf16"],
                         "option '--dtype' belongs to export")]:
        proc = subprocess.run(ctl + args, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and words in proc.stderr, (args, proc.stderr)


def test_export_errors(start_daemon, tmp_path):
    d = start_daemon(ranks=2)
    train(d, 2, "err", 2)
    cp = save(d, "err", "c").checkpoint
    cases = [
        (dict(path=tmp_path / "no-such-dir" / "x.safetensors", checkpoint="c"),
         grpc.StatusCode.NOT_FOUND, "no-such-dir"),
        (dict(path=tmp_path / "x.safetensors", checkpoint="missing"),
         grpc.StatusCode.NOT_FOUND, "missing"),
        (dict(path=str(tmp_path) + "/../x.safetensors", checkpoint="c"),
         grpc.StatusCode.PERMISSION_DENIED, "'..'"),
        (dict(path=str(tmp_path) + "/", checkpoint="c"),
         grpc.StatusCode.INVALID_ARGUMENT, "names a directory"),
        (dict(path=tmp_path, checkpoint="c", overwrite=True),
         grpc.StatusCode.INVALID_ARGUMENT, "is a directory"),
    ]
    for kwargs, code, words in cases:
        with pytest.raises(grpc.RpcError) as e:
            export(d, "err", **kwargs)
        assert e.value.code() == code and words in e.value.details(), (kwargs, e.value)
    # A safetensors file is not a checkpoint to export.
    out = tmp_path / "c.safetensors"
    export(d, "err", out, checkpoint="c")
    with pytest.raises(grpc.RpcError) as e:
        export(d, "err", tmp_path / "again.safetensors", checkpoint=str(out))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "safetensors file already" in e.value.details()
    # A damaged shard: DATA_LOSS naming the file, and no file written.
    shard = os.path.join(cp.path, "rank-00001-of-00002.zdshard")
    data = bytearray(open(shard, "rb").read())
    data[4096 + 8] ^= 0x40
    open(shard, "wb").write(bytes(data))
    bad = tmp_path / "bad.safetensors"
    with pytest.raises(grpc.RpcError) as e:
        export(d, "err", bad, checkpoint="c")
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    assert "rank-00001-of-00002.zdshard" in e.value.details()
    assert not bad.exists() and not (tmp_path / "bad.safetensors.tmp").exists()


def registered(d, job, tmp_path):
    """The job's tensors (name -> shape), from a save of it."""
    weights, _ = full_weights(save(d, job, "layout").checkpoint.path)
    return {k: tuple(v.shape) for k, v in weights.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_initialise_job_from_file_written_by_safetensors(start_daemon, tmp_path, dtype):
    d = start_daemon(ranks=2)
    train(d, 2, "init", 2)  # the workers register the units
    shapes = registered(d, "init", tmp_path)
    g = torch.Generator().manual_seed(7)
    tensors = {name: torch.randn(shape, generator=g).to(dtype) for name, shape in shapes.items()}
    tensors["extra.unused"] = torch.zeros(3)  # tensors the job lacks are ignored
    path = tmp_path / "hf.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})

    assert restore(d, "init", str(path)).step == 0
    cp = save(d, "init", "imported").checkpoint
    assert cp.step == 0
    got, _ = full_weights(cp.path)
    assert_same(got, {k: tensors[k].to(torch.float32) for k in shapes})
    for unit, states in moments_of(cp.path).items():
        for state, values in states.items():
            assert values == bytes(len(values)), (unit, state)
    # Workers train on from the imported weights.
    out = train(d, 2, "init", 2)
    assert "done: 2 steps" in out


def untouched_bytes(path):
    """{(unit, state): the master and moment bytes of a checkpoint that lie
    in no tensor (alignment gaps between tensors, padding at the end of the
    last rank's shard), gathered from every rank's file}."""
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    world, states = manifest["world_size"], manifest["states"]
    files = [open(os.path.join(path, f["name"]), "rb").read() for f in manifest["files"]]
    out, offset = {}, 0
    for unit in manifest["units"]:
        shard_bytes = unit["shard_numel"] * 4
        covered = bytearray(shard_bytes * world)
        for t in unit["tensors"]:
            n = 4
            for d in t["shape"]:
                n *= d
            covered[t["offset"] * 4:t["offset"] * 4 + n] = b"\x01" * n
        for k, state in enumerate(states):
            at = HEADER + offset + k * shard_bytes
            full = b"".join(files[r][at:at + shard_bytes] for r in range(world))
            out[(unit["name"], state)] = bytes(b for b, c in zip(full, covered) if not c)
        offset += shard_bytes * len(states)
    return out


def test_restores_leave_gaps_and_padding_zero(start_daemon, tmp_path, monkeypatch):
    """A restore stages the values in memory the rank then keeps as its own
    (docs/checkpoints.md); what no read fills, the gaps between tensors and
    the padding, must be zero there as in a fresh job. The daemon's heap is
    made dirty (glibc's MALLOC_PERTURB_, ASan's fill of every allocation)
    so that memory left unwritten shows."""
    monkeypatch.setenv("MALLOC_PERTURB_", "165")
    asan = os.environ.get("ASAN_OPTIONS", "")
    monkeypatch.setenv("ASAN_OPTIONS", (asan + ":" if asan else "") + "max_malloc_fill_size=" +
                       str(1 << 28))
    d = start_daemon(ranks=2)
    hidden = ["--hidden", "50"]  # a 50x50 weight: a 12-element gap before its bias
    train(d, 2, "gaps", 2, extra=hidden)
    shapes = registered(d, "gaps", tmp_path)
    first = save(d, "gaps", "first").checkpoint
    gaps = untouched_bytes(first.path)
    assert sum(len(v) for v in gaps.values()) > 0, "the model has no gaps or padding to check"
    assert all(v == bytes(len(v)) for v in gaps.values())

    g = torch.Generator().manual_seed(3)
    path = tmp_path / "gaps.safetensors"
    safetensors.torch.save_file({n: torch.randn(s, generator=g) for n, s in shapes.items()},
                                str(path))
    for source in (str(path), first.name, str(path)):
        assert restore(d, "gaps", source).step in (0, first.step)
        for key, values in untouched_bytes(save(d, "gaps").checkpoint.path).items():
            assert values == bytes(len(values)), "%s of unit %s after restoring %s" % (
                key[1], key[0], source)
    assert "done: 2 steps" in train(d, 2, "gaps", 2, extra=hidden)


def test_missing_or_misshaped_tensor_is_named_and_changes_nothing(start_daemon, tmp_path):
    d = start_daemon(ranks=2)
    train(d, 2, "named", 2)
    shapes = registered(d, "named", tmp_path)
    before, _ = full_weights(save(d, "named", "before").checkpoint.path)
    victim = sorted(shapes)[0]

    missing = {k: torch.ones(s) for k, s in shapes.items() if k != victim}
    path = tmp_path / "missing.safetensors"
    safetensors.torch.save_file(missing, str(path))
    with pytest.raises(grpc.RpcError) as e:
        restore(d, "named", str(path))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'%s'" % victim in e.value.details() and "is not in" in e.value.details()

    wrong = {k: torch.ones(s) for k, s in shapes.items()}
    wrong[victim] = torch.ones(tuple(shapes[victim]) + (2,))
    path = tmp_path / "misshaped.safetensors"
    safetensors.torch.save_file(wrong, str(path))
    with pytest.raises(grpc.RpcError) as e:
        restore(d, "named", str(path))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'%s'" % victim in e.value.details() and "shape" in e.value.details()

    after, _ = full_weights(save(d, "named", "after").checkpoint.path)
    assert_same(after, before)
