"""A read-only Python attachment reads a training job's weights while two
worker processes keep training it: pinned, every unit comes from one
version; its writes are refused."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch

import zerod
import zerod.torch
from conftest import python, start_daemon, worker_env  # noqa: F401 (fixture)
from torch_models import TinyLM

HERE = os.path.dirname(os.path.abspath(__file__))


def workers(daemon, steps, dump):
    return [subprocess.Popen([python(), os.path.join(HERE, "torch_worker.py"), "--socket",
                              daemon.socket, "--rank", str(r), "--steps", str(steps), "--dump",
                              str(dump)],
                             env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for r in range(2)]


def finish(procs):
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs


def assert_same(a, b):
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_pinned_reader_while_training(start_daemon, tmp_path):
    daemon = start_daemon(ranks=2)
    finish(workers(daemon, 5, tmp_path / "v5.pt"))
    at5 = torch.load(tmp_path / "v5.pt")

    client = zerod.Client(daemon.socket)
    reader = client.attach("t", read_only=True, pin=True)
    assert reader.read_only and reader.version == 5
    assert_same(dict(zerod.torch.state_dict_from(reader)),
                {k: v for k, v in at5.items() if k != "gain"})

    latest = zerod.Client(daemon.socket).attach("t", read_only=True, pin=False)
    latest.list_units()
    procs = workers(daemon, 150, tmp_path / "final.pt")
    # Read the pinned weights over and over while training moves on; stop
    # once the job is well past version 5 (or the trainers are done).
    reads, seen = 0, 5
    while seen < 40 and any(p.poll() is None for p in procs):
        assert_same(dict(zerod.torch.state_dict_from(reader)),
                    {k: v for k, v in at5.items() if k != "gain"})
        reads += 1
        with latest.units[-1].gather() as g:
            seen = g.version
    assert reads > 0 and seen > 5, "the reads did not overlap training"

    # Writes are refused; the session keeps working.
    with pytest.raises(zerod.PermissionDeniedError, match="read-only"):
        reader.step()
    with pytest.raises(zerod.PermissionDeniedError, match="read-only"):
        reader.register("x", [("w", (4,))], init="zeros")
    with pytest.raises(zerod.PermissionDeniedError, match="read-only"):
        reader.units[0].grad_buffer()
    with pytest.raises(zerod.ShardingError, match="read-only"):
        zerod.torch.Optimizer(zerod.torch.shard(TinyLM(), reader))

    # A later pin: every unit comes from that one version.
    version = reader.pin()
    assert version > 5
    for unit in reader.units:
        with unit.gather() as g:
            assert g.version == version
    finish(procs)
    final = torch.load(tmp_path / "final.pt")
    assert reader.pin() == 155
    assert_same(dict(zerod.torch.state_dict_from(reader)),
                {k: v for k, v in final.items() if k != "gain"})

    # An eval copy of the model runs on the pinned weights.
    model = zerod.torch.shard(TinyLM(), reader)
    reference = TinyLM()
    reference.load_state_dict(final)
    tokens = torch.arange(16).reshape(2, 8)
    with torch.no_grad():
        assert float(model(tokens, tokens)) == float(reference(tokens, tokens))
    client.close()
