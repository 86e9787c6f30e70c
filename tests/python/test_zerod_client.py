"""The zerod package's core API against a real daemon: zero-copy views,
the step, errors carrying the daemon's message, and installation with
pip."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
import zipfile

import numpy as np
import pytest

import zerod
from conftest import PACKAGE_DIR, start_daemon  # noqa: F401 (fixture)


def test_the_owner_token_comes_from_zerod_token(start_daemon, monkeypatch):
    """token=None takes $ZEROD_TOKEN (how Kubernetes passes it); with
    neither, the daemon says a token is required, not that it is wrong; a
    token given wins over the environment."""
    monkeypatch.delenv("ZEROD_TOKEN", raising=False)
    daemon = start_daemon(ranks=1)
    with zerod.Client(daemon.socket) as client:
        client.attach("owned", token="secret").detach()
    monkeypatch.setenv("ZEROD_TOKEN", "secret")
    with zerod.Client(daemon.socket) as client:
        client.attach("owned", create=False).detach()
    with zerod.Client(daemon.socket) as client:
        with pytest.raises(zerod.PermissionDeniedError) as err:
            client.attach("owned", token="")
        assert "requires a token" in err.value.message, err.value.message
    monkeypatch.delenv("ZEROD_TOKEN")
    with zerod.Client(daemon.socket) as client:
        with pytest.raises(zerod.PermissionDeniedError) as err:
            client.attach("owned")
        message = err.value.message
        assert "requires a token" in message and "ZEROD_TOKEN" in message, message
        assert "does not match" not in message, message
    monkeypatch.setenv("ZEROD_TOKEN", "guess")
    with zerod.Client(daemon.socket) as client:
        with pytest.raises(zerod.PermissionDeniedError, match="token does not match job 'owned'"):
            client.attach("owned")
        client.attach("owned", token="secret").detach()


def test_views_are_zero_copy_and_read_only(start_daemon):
    daemon = start_daemon(ranks=1)
    with zerod.Client(daemon.socket) as client:
        job = client.attach("j", config=zerod.JobConfig(optimizer="sgd", lr=0.5))
        assert (job.rank, job.world_size, job.version, job.read_only) == (0, 1, 0, False)
        w = np.arange(12, dtype=np.float32).reshape(3, 4)
        b = np.array([1.0, -1.0], dtype=np.float32)
        unit = job.register("layer", [("w", (3, 4)), ("b", (2,))], values=[w, b])
        assert [t.name for t in unit.tensors] == ["w", "b"]
        assert unit.tensors[1].offset % 16 == 0 and unit.dtype == "float32"
        with unit.gather() as g:
            arrays = g.arrays()
            np.testing.assert_array_equal(arrays["w"], w)
            np.testing.assert_array_equal(arrays["b"], b)
            with pytest.raises(ValueError):
                arrays["w"][0, 0] = 1.0
            # numpy and torch views share the one mapping.
            t = g.tensors()["w"]
            assert t.data_ptr() == arrays["w"].ctypes.data
        grads = unit.grad_buffer()
        arrays = grads.arrays()
        arrays["w"][...] = 1.0
        arrays["b"][...] = 2.0
        unit.reduce()
        result = job.step()
        assert (result.step, result.version, result.skipped) == (1, 1, False)
        assert result.grad_norm == pytest.approx(np.sqrt(12 * 1.0 + 2 * 4.0))
        with unit.gather() as g:
            assert g.version == 1
            np.testing.assert_allclose(g.arrays()["w"], w - 0.5)
            np.testing.assert_allclose(g.arrays()["b"], b - 1.0)
        state = job.state_dict()
        np.testing.assert_allclose(state["w"], w - 0.5)


def test_errors_carry_the_daemons_message(start_daemon, monkeypatch):
    monkeypatch.delenv("ZEROD_TOKEN", raising=False)
    daemon = start_daemon(ranks=1)
    with zerod.Client(daemon.socket) as client:
        client.attach("owned", token="secret").detach()
    with zerod.Client(daemon.socket) as client:
        with pytest.raises(zerod.PermissionDeniedError) as err:
            client.attach("owned", token="wrong")
        assert "does not match job 'owned'" in err.value.message and err.value.status == -6
    with zerod.Client(daemon.socket) as client:
        job = client.attach("owned", token="secret")
        with pytest.raises(zerod.InvalidArgumentError, match="initial values: 3 values for 4 elements"):
            job.register("u", [("w", (4,))], values=np.zeros(3, dtype=np.float32))
        with pytest.raises(zerod.InvalidArgumentError, match="adamw, adam or sgd"):
            zerod.JobConfig(optimizer="lamb")._to_c()
    with pytest.raises(zerod.UnavailableError):
        zerod.Client(os.path.join(str(daemon.dir), "missing.sock"))


def test_step_error_names_the_step_once(start_daemon):
    """The daemon's message is the detail; libzerod adds the request's name
    once ("step: step: ..." before)."""
    daemon = start_daemon(ranks=1)
    with zerod.Client(daemon.socket) as client:
        job = client.attach("j")
        for bad in ({"lr": 0.0}, {"lr": -1.0}, {"max_grad_norm": -1.0}):
            with pytest.raises(zerod.InvalidArgumentError) as err:
                job.step(**bad)
            assert err.value.message == ("step: lr must be > 0, max_grad_norm >= 0 and "
                                         "grad_scale >= 0 and finite")
        assert job.step(lr=0.5).step == 1  # the session goes on


def test_attach_to_a_job_with_another_config_warns(start_daemon):
    daemon = start_daemon(ranks=1)
    with zerod.Client(daemon.socket) as client:
        first = client.attach("cfg", config=zerod.JobConfig(optimizer="sgd", lr=0.25))
        assert first.attach_warning is None
        first.detach()
    with zerod.Client(daemon.socket) as client:
        with pytest.warns(UserWarning, match=r"lr 0\.5 \(the job's 0\.25\)") as caught:
            job = client.attach("cfg", config=zerod.JobConfig(optimizer="sgd", lr=0.5))
        assert len(caught) == 1 and job.attach_warning == str(caught[0].message)
        assert "optimizer" not in job.attach_warning
        job.detach()
    with zerod.Client(daemon.socket) as client, warnings.catch_warnings():
        warnings.simplefilter("error")
        job = client.attach("cfg", config=zerod.JobConfig(optimizer="sgd", lr=0.25))
        assert job.attach_warning is None


def test_zeropp_settings_reach_the_job(start_daemon):
    """The ZeRO++ switches travel to the daemon and back (the job's config),
    the daemon's own checks answer through the client, and STATS reports
    the pool (no secondary partitions on one node)."""
    daemon = start_daemon(ranks=1)
    config = zerod.JobConfig(quantized_weights=True, quantization_block=64,
                             quantized_gradients=4, hpz_partition_size=2)
    with zerod.Client(daemon.socket) as client:
        job = client.attach("zpp", config=config)
        unit = job.register("u", [("w", (64,))], values=np.ones(64, dtype=np.float32))
        unit.gather()
        unit.release()
        stats = job.stats()
        assert stats[0]["pool_bytes"] > 0 and stats[0]["secondary_bytes"] == 0, stats
        job.detach()
    with zerod.Client(daemon.socket) as client:
        with pytest.warns(UserWarning, match=r"hpz_partition_size 1 \(the job's 2\)"):
            job = client.attach("zpp", config=zerod.JobConfig(
                quantized_weights=True, quantization_block=64, quantized_gradients=4))
        job.detach()
    with zerod.Client(daemon.socket) as client:
        with pytest.raises(zerod.InvalidArgumentError, match="needs hierarchical collectives"):
            client.attach("flat", config=zerod.JobConfig(collectives="flat",
                                                         hpz_partition_size=2))
    with pytest.raises(zerod.InvalidArgumentError, match="hpz_partition_size"):
        zerod.JobConfig(hpz_partition_size=-1)._to_c()


def test_attach_takes_torchruns_environment(start_daemon, monkeypatch):
    """Without a rank, attach takes torchrun's LOCAL_RANK; WORLD_SIZE must
    be the job's; a RANK other than the job's global rank warns."""
    daemon = start_daemon(ranks=2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with zerod.Client(daemon.socket) as client:
        job = client.attach("env")
        assert job.rank == 1
        job.detach()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with zerod.Client(daemon.socket) as client:
        with pytest.raises(zerod.InvalidArgumentError, match="WORLD_SIZE is 3 but job env has 2"):
            client.attach("env")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with zerod.Client(daemon.socket) as client:
        with pytest.warns(UserWarning, match="RANK is 0 but this worker is rank 1"):
            job = client.attach("env")
        job.detach()
    monkeypatch.setenv("LOCAL_RANK", "one")
    with zerod.Client(daemon.socket) as client:
        with pytest.raises(zerod.InvalidArgumentError, match="LOCAL_RANK='one'"):
            client.attach("env")
        job = client.attach("env", rank=0)  # an explicit rank wins
        assert job.rank == 0


def test_optimizer_state_reads_back_and_loads(start_daemon):
    """READ_STATE returns a unit's fp32 weights and AdamW moments, packed;
    LOAD_UNIT puts them (and the step count) into another job, which then
    steps to the same bits as the first."""
    daemon = start_daemon(ranks=1)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    grads = [rng.standard_normal(18).astype(np.float32) for _ in range(2)]
    config = zerod.JobConfig(lr=0.01, betas=(0.9, 0.999), weight_decay=0.1)

    def step(job, unit, g):
        buf = unit.grad_buffer().arrays()
        buf["w"][...] = g[:15].reshape(5, 3)
        buf["b"][...] = g[15:]
        unit.reduce()
        job.step()

    with zerod.Client(daemon.socket) as client:
        job = client.attach("a", config=config)
        unit = job.register("u", [("w", (5, 3)), ("b", (3,))], values=[w, b])
        step(job, unit, grads[0])
        m, at = unit.read_state("exp_avg")
        v, _ = unit.read_state("exp_avg_sq")
        weights, _ = unit.read_state("weights")
        assert at == 1 and m.dtype == np.float32 and m.shape == (18,)
        # Step 1 of AdamW from zero moments, in fp32.
        np.testing.assert_array_equal(m, np.float32(0.1) * grads[0])
        np.testing.assert_array_equal(v, (np.float32(0.001) * grads[0]) * grads[0])
        with unit.gather() as g:
            np.testing.assert_array_equal(weights, np.concatenate(
                [g.arrays()["w"].ravel(), g.arrays()["b"]]))
        step(job, unit, grads[1])
        final_a = unit.read_state("weights")[0]
        with pytest.raises(zerod.InvalidArgumentError, match="state must be one of"):
            unit.read_state("momentum")
    with zerod.Client(daemon.socket) as client:
        job = client.attach("b", config=config)
        unit = job.register("u", [("w", (5, 3)), ("b", (3,))], init="zeros")
        unit.load(weights)
        unit.load(m, state="exp_avg")
        assert unit.load(v, state="exp_avg_sq", step=1) == 1  # moments leave the version
        step(job, unit, grads[1])
        np.testing.assert_array_equal(unit.read_state("weights")[0], final_a)
        assert unit.read_state("exp_avg")[1] == 2
    with zerod.Client(daemon.socket) as client:
        job = client.attach("plain-sgd", config=zerod.JobConfig(optimizer="sgd", lr=0.1))
        unit = job.register("u", [("w", (4,))], init="zeros")
        with pytest.raises(zerod.InvalidArgumentError, match=r"\(sgd\) keeps no momentum_buffer"):
            unit.read_state("momentum_buffer")
        with pytest.raises(zerod.InvalidArgumentError, match="keeps no exp_avg_sq"):
            unit.load(np.zeros(4, np.float32), state="exp_avg_sq")
        assert unit.read_state("weights")[0].tolist() == [0.0] * 4  # the session goes on


def test_parameter_groups_are_checked_like_a_config(start_daemon):
    daemon = start_daemon(ranks=1)
    with zerod.Client(daemon.socket) as client:
        job = client.attach("groups", config=zerod.JobConfig(optimizer="sgd", lr=0.1))
        unit = job.register("u", [("w", (4,)), ("b", (2,))], init="zeros")
        with pytest.raises(zerod.InvalidArgumentError, match=r"group 1: invalid weight decay -1"):
            job.set_groups([{}, {"weight_decay": -1.0}], {unit.id: [0, 1]})
        with pytest.raises(zerod.InvalidArgumentError, match="keeps momentum buffers"):
            job.set_groups([{}, {"momentum": 0.9}], {unit.id: [0, 1]})
        with pytest.raises(zerod.InvalidArgumentError, match=r"tensor 'b' of unit 'u' is in group 2"):
            job.set_groups([{}, {}], {unit.id: [0, 2]})
        with pytest.raises(zerod.InvalidArgumentError, match="has 2 tensors, 1 groups given"):
            job.set_groups([{}, {}], {unit.id: [0]})
        job.set_groups([{"lr": 0.1}, {"lr": 0.5}], {unit.id: [0, 1]})
        grads = unit.grad_buffer().arrays()
        grads["w"][...] = 1.0
        grads["b"][...] = 1.0
        unit.reduce()
        with pytest.raises(zerod.InvalidArgumentError, match="1 group learning rates for 2"):
            job.step(group_lrs=[0.1])
        job.step()
        # SGD: each tensor moved by its own group's lr.
        np.testing.assert_array_equal(unit.read_state()[0],
                                      np.array([-0.1] * 4 + [-0.5] * 2, dtype=np.float32))


def test_loss_scale_hysteresis_and_minimum(start_daemon):
    """DeepSpeed's hysteresis (two overflows before a backoff) and minimum,
    and growth after the window, on an fp16 job's own steps."""
    daemon = start_daemon(ranks=1)
    config = zerod.JobConfig(optimizer="sgd", lr=0.1, dtype="float16", loss_scale=8.0,
                             loss_scale_window=2, loss_scale_hysteresis=2, loss_scale_min=4.0)
    with zerod.Client(daemon.socket) as client:
        job = client.attach("scaled", config=config)
        unit = job.register("u", [("w", (4,))], init="zeros")
        assert job.loss_scale == 8.0
        seen = []
        for value in (np.inf, np.inf, 1.0, np.nan, np.inf, np.inf, 1.0, 1.0):
            unit.grad_buffer().arrays()["w"][...] = value
            unit.reduce()
            result = job.step()
            seen.append((result.skipped, result.loss_scale))
        assert seen == [(True, 8.0), (True, 4.0), (False, 4.0), (True, 4.0), (True, 4.0),
                        (True, 4.0), (False, 4.0), (False, 8.0)], seen
        # Three good steps at scale 4, each dividing the gradient 1.0 by it.
        assert unit.read_state()[0].tolist()[0] == pytest.approx(-3 * 0.1 / 4)


def test_pip_install(tmp_path, start_daemon):
    """`pip wheel client/python` builds a platform wheel with libzerod.so in
    it (the package's build step runs CMake; here on this build tree, named
    relative to the repository's root as the README does, from another
    directory); a fresh virtual environment (the system's site packages for
    numpy) that installs it imports zerod from there and trains a step
    without ZEROD_LIBRARY."""
    source = tmp_path / "src"
    # A copy, so that the build's by-products stay out of the checkout.
    shutil.copytree(PACKAGE_DIR, source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info",
                                                                        "build"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(PACKAGE_DIR)))
    build_tree = os.path.dirname(os.path.dirname(os.path.abspath(os.environ["ZEROD_LIBRARY"])))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZEROD_LIBRARY")}
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "--no-index", "-q", "-w", str(wheels),
                            str(source)], capture_output=True, text=True, cwd=str(tmp_path),
                           env=dict(env, ZEROD_SOURCE_DIR=root,
                                    ZEROD_CMAKE_BUILD_DIR=os.path.relpath(build_tree, root)))
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("zerod-*.whl")
    trains_from_a_venv(tmp_path, wheel, env, start_daemon)


def test_wheel_builds_from_source_with_cmake(tmp_path, start_daemon):
    """`python -m build --wheel` of the package configures the zerod project
    with CMake in a build directory of its own and builds only libzerod
    (not the daemon, whose executable is also called zerod), and the wheel
    trains from a fresh virtual environment."""
    pytest.importorskip("build", reason="python3-build (scripts/deps.sh test installs it)")
    source = tmp_path / "src"
    shutil.copytree(PACKAGE_DIR, source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info",
                                                                        "build"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ZEROD_LIBRARY", "ZEROD_CMAKE_BUILD_DIR")}
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                            "-o", str(wheels), str(source)], capture_output=True, text=True,
                           env=dict(env, ZEROD_SOURCE_DIR=os.path.dirname(os.path.dirname(
                               os.path.abspath(PACKAGE_DIR)))))
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    assert "--target zerod-library" in built.stdout, built.stdout[-4000:]
    assert not (source / "build" / "cmake" / "bin" / "zerod").exists()  # the library alone
    (wheel,) = wheels.glob("zerod-*.whl")
    trains_from_a_venv(tmp_path, wheel, env, start_daemon)


def trains_from_a_venv(tmp_path, wheel, env, start_daemon):
    """A platform wheel with libzerod.so inside, installed into a fresh
    virtual environment (the system's site packages for numpy), imports
    zerod from there and trains a step without ZEROD_LIBRARY."""
    assert not wheel.name.endswith("-any.whl"), wheel.name  # it carries a shared object
    with zipfile.ZipFile(wheel) as z:
        assert "zerod/lib/libzerod.so" in z.namelist()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps",
                          "--no-index", "-q", str(wheel)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    daemon = start_daemon(ranks=1)
    program = (
        "import sys, numpy as np, zerod, zerod._lib as L\n"
        "lib = L.load()\n"
        "print(zerod.__file__); print(lib._name)\n"
        "with zerod.Client(sys.argv[1]) as c:\n"
        "    job = c.attach('wheel', config=zerod.JobConfig(optimizer='sgd', lr=0.5))\n"
        "    u = job.register('u', [('w', (4,))], values=np.ones(4, np.float32))\n"
        "    u.grad_buffer().arrays()['w'][...] = 1.0\n"
        "    u.reduce()\n"
        "    print(job.step().step, u.read_state()[0].tolist())\n")
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", program, daemon.socket],
                           capture_output=True, text=True, cwd=str(tmp_path), env=env)
    assert probe.returncode == 0, probe.stderr
    module, library, result = probe.stdout.splitlines()
    assert module.startswith(str(venv)) and library.startswith(str(venv)), probe.stdout
    assert result == "1 [0.5, 0.5, 0.5, 0.5]"


def test_pip_install_without_the_project_says_what_it_needs(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(PACKAGE_DIR, source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info",
                                                                        "build"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ZEROD_CMAKE_BUILD_DIR", "ZEROD_SOURCE_DIR")}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "--no-index", "-w", str(tmp_path / "w"),
                            str(source)], capture_output=True, text=True, env=env)
    assert built.returncode != 0
    assert "set ZEROD_SOURCE_DIR to a zerod checkout" in built.stdout + built.stderr
    # A build tree that is not one says so, with where a relative one was looked for.
    env["ZEROD_SOURCE_DIR"] = os.path.dirname(os.path.dirname(os.path.abspath(PACKAGE_DIR)))
    env["ZEROD_CMAKE_BUILD_DIR"] = "no/such/build"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "--no-index", "-w", str(tmp_path / "w"),
                            str(source)], capture_output=True, text=True, env=env)
    assert built.returncode != 0
    assert "not a configured CMake build tree" in built.stdout + built.stderr
    assert os.path.join(env["ZEROD_SOURCE_DIR"], "no/such/build") in built.stdout + built.stderr


def rss_anon(pid):
    """The process's anonymous resident memory in bytes (its own heap and
    mappings; shared-memory buffers are RssShmem)."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/%d/status" % pid)


def test_nvme_offload_trains_a_job_over_the_memory_quota(start_daemon):
    """A job whose AdamW state (16 bytes per element) is over its
    max_host_bytes quota is refused; with offload_optimizer nvme only the
    gradient accumulator and the working copy (8 bytes) count, and it
    trains. The daemon's anonymous memory grows by those and the staging
    buffers, where the in-memory job of the same unit grows by the whole
    state, and a checkpoint save or restore of it adds nothing like its
    state; the stats and zerodctl (jobs get, top) say where the state
    is."""
    from conftest import binary
    n = 4 << 20
    daemon = start_daemon(ranks=1, extra=["--metrics-listen", "127.0.0.1:0"])
    ctl = [binary("zerodctl"), "-c", "unix:%s" % (daemon.dir / "control.sock")]
    for name, extra in [("mem", []), ("nv", ["--offload-optimizer", "nvme",
                                             "--offload-buffer-count", "3",
                                             "--offload-buffer-size", "65536"])]:
        subprocess.run(ctl + ["jobs", "create", name, "--max-host-bytes", "48M",
                              "--token", "t"] + extra, check=True, capture_output=True)

    def register(name):
        client = zerod.Client(daemon.socket)
        job = client.attach(name, rank=0, token="t")
        return client, job, job.register("u", [("w", (n,))], init="zeros")

    client = zerod.Client(daemon.socket)
    job = client.attach("mem", rank=0, token="t")
    with pytest.raises(zerod.ResourceExhaustedError, match="max_host_bytes quota"):
        job.register("u", [("w", (n,))], init="zeros")
    client.close()
    # The staging buffers count too: 64 of 1 Mi elements for master, m
    # and v are 768 MiB, which no unit fits beside under 48 MiB.
    subprocess.run(ctl + ["jobs", "create", "wide", "--max-host-bytes", "48M", "--token", "t",
                          "--offload-optimizer", "nvme", "--offload-buffer-count", "64",
                          "--offload-buffer-size", "1048576"], check=True, capture_output=True)
    with zerod.Client(daemon.socket) as client:
        job = client.attach("wide", rank=0, token="t")
        with pytest.raises(zerod.ResourceExhaustedError,
                           match=r"max_host_bytes quota of 50331648 bytes per rank \(805306368 in "
                                 r"use, 805306368 of them offload_optimizer's staging buffers\)"):
            job.register("tiny", [("w", (1024,))], init="zeros")

    def grown(name):
        before = rss_anon(daemon.proc.pid)
        client, job, unit = register(name)
        for _ in range(3):
            unit.grad_buffer().arrays()["w"][...] = 1.0
            unit.reduce()
            job.step()
        after = rss_anon(daemon.proc.pid)
        stats = job.stats()[0]
        client.close()
        return after - before, stats

    offloaded, stats = grown("nv")
    assert stats["state_bytes"] == 8 * n
    assert stats["tier_bytes"] == 3 * 4 * n
    subprocess.run(ctl + ["jobs", "create", "free", "--token", "t"], check=True,
                   capture_output=True)
    in_memory, mem_stats = grown("free")  # no quota, state in memory
    assert mem_stats["state_bytes"] == 16 * n and mem_stats["tier_bytes"] == 0
    # Both also hold the reduce's fp32 scratch (4 bytes per element); the
    # offloaded job's master and moments are not in memory, its staging is.
    staging_bytes = 3 * 3 * 65536 * 4
    assert offloaded <= 8 * n + 4 * n + staging_bytes + (4 << 20), (offloaded, in_memory)
    assert in_memory >= 16 * n, (offloaded, in_memory)
    got = subprocess.run(ctl + ["jobs", "get", "nv"], check=True, capture_output=True, text=True)
    assert "optimizer state: on disk (nvme)" in got.stdout, got.stdout
    # zerodctl top: the shards' memory and their bytes on disk apart.
    port = re.search(r'msg="metrics listening" address=\S+ port=(\d+)', daemon.read_log()).group(1)
    top = subprocess.run([binary("zerodctl"), "top", "--metrics", "127.0.0.1:" + port, "--once",
                          "--interval", "0.2", "--json", "--job", "nv"], capture_output=True,
                         text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    rank = json.loads(top.stdout)["ranks"][0]
    assert (rank["shard_bytes"], rank["shard_disk_bytes"]) == (8 * n, 12 * n), rank
    # A save of the offloaded job copies its state on disk, not into
    # memory: 12 bytes per element that the anonymous memory never sees.
    before = rss_anon(daemon.proc.pid)
    saved = subprocess.run(ctl + ["checkpoint", "save", "nv", "s1"], capture_output=True,
                           text=True)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert rss_anon(daemon.proc.pid) - before < 2 * n, (before, rss_anon(daemon.proc.pid))
    manifest = daemon.dir / "checkpoints" / "nv" / "s1" / "manifest.json"
    assert manifest.exists()
    # Its restore stages what it reads in a file beside the tier file.
    before = rss_anon(daemon.proc.pid)
    restored = subprocess.run(ctl + ["checkpoint", "restore", "nv", "s1"], capture_output=True,
                              text=True)
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert rss_anon(daemon.proc.pid) - before < 2 * n, (before, rss_anon(daemon.proc.pid))


class MemoryCgroup:
    """A memory cgroup of its own (v2 where its memory controller is on,
    else v1) with a limit on what its processes charge from now on."""

    def __init__(self, name, limit):
        self.path = None
        for root, limit_file, peak_file in [
                ("/sys/fs/cgroup", "memory.max", "memory.peak"),
                ("/sys/fs/cgroup/memory", "memory.limit_in_bytes",
                 "memory.max_usage_in_bytes")]:
            if root == "/sys/fs/cgroup" and "memory" not in self._read(
                    os.path.join(root, "cgroup.controllers")).split():
                continue
            if not os.path.isfile(os.path.join(root, "cgroup.procs")):
                continue
            path = os.path.join(root, name)
            try:
                os.mkdir(path)
                with open(os.path.join(path, limit_file), "w") as f:
                    f.write(str(limit))
                swap = os.path.join(path, "memory.memsw.limit_in_bytes")
                if os.path.exists(swap):  # no swapping out of the limit
                    with open(swap, "w") as f:
                        f.write(str(limit))
                swap = os.path.join(path, "memory.swap.max")
                if os.path.exists(swap):
                    with open(swap, "w") as f:
                        f.write("0")
            except OSError as e:
                self.why = "cannot make a memory cgroup under %s: %s" % (root, e)
                if os.path.isdir(path):
                    os.rmdir(path)
                continue
            self.path, self.peak_file = path, peak_file
            return
        if not hasattr(self, "why"):
            self.why = "no memory cgroup controller here"

    @staticmethod
    def _read(path):
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return ""

    def add(self, pid):
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def peak(self):
        text = self._read(os.path.join(self.path, self.peak_file)).strip()
        return int(text) if text else None

    def remove(self):
        if self.path is not None:
            os.rmdir(self.path)  # empty once its processes are gone


def test_nvme_offload_trains_a_model_larger_than_the_daemons_memory_limit(start_daemon):
    """The daemon in a memory cgroup whose limit is below the job's
    optimizer state: with the state on disk it trains (bf16, so the
    gradients and working copy it keeps are 6 bytes per element against
    the 18 an in-memory job would hold), and the kernel never had to kill
    it. Eight units of 4 Mi elements: 384 MiB of master weights and
    moments under a 352 MiB limit on what the daemon allocates after it
    started."""
    units, numel = 8, 4 << 20
    state_bytes = 12 * units * numel            # master, m, v: on disk
    kept = 6 * units * numel                    # gradient accumulator, bf16 working copy
    limit = 352 << 20
    assert state_bytes > limit and 18 * units * numel > limit
    cgroup = MemoryCgroup("zerod-test-%d" % os.getpid(), limit)
    if cgroup.path is None:
        pytest.skip(cgroup.why)
    daemon = None
    try:
        daemon = start_daemon(ranks=1)
        # What it holds already stays charged where it was; the limit is
        # on what it allocates from here on.
        cgroup.add(daemon.proc.pid)
        config = zerod.JobConfig(dtype="bfloat16", max_live_bytes=64 << 20, offload_optimizer={
            "device": "nvme", "buffer_count": 3, "buffer_size": 256 << 10})
        with zerod.Client(daemon.socket) as client:
            job = client.attach("big", rank=0, config=config)
            handles = [job.register("u%d" % k, [("w", (numel,))], init="zeros")
                       for k in range(units)]
            one = np.uint16(0x3F80)  # 1.0 in bf16
            for _ in range(3):
                for unit in handles:
                    unit.gather()
                    unit.release()
                    unit.grad_buffer().arrays()["w"][...] = one
                    unit.reduce()
                result = job.step()
            assert result.step == 3
            stats = job.stats()[0]
            assert stats["state_bytes"] == kept
            assert stats["tier_bytes"] >= state_bytes
            # AdamW's first step moves every weight by lr (1e-3) against
            # the gradient's sign; the next two by about as much again.
            w = handles[-1].read_state()[0]
            assert np.all(w < -2.5e-3) and np.all(w > -3.5e-3), (w.min(), w.max())
        assert daemon.alive(), daemon.read_log()
        peak = cgroup.peak()
        if peak is not None:
            assert peak <= limit
            print("daemon's peak memory after start: %.0f MiB of a %.0f MiB limit; "
                  "optimizer state %.0f MiB" % (peak / 2**20, limit / 2**20, state_bytes / 2**20))
        daemon.stop()
    finally:
        if daemon is not None and daemon.alive():
            daemon.kill()
        cgroup.remove()


def test_nvme_offload_full_disk_is_a_clear_error(start_daemon, tmp_path):
    """A tier directory with no room (a 4 MiB tmpfs) refuses the unit that
    does not fit at its registration, with the disk's words, and the
    daemon goes on: a unit that fits trains once the job has reset."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs",
                              str(nvme)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here: %s" % mounted.stderr.strip())
    try:
        daemon = start_daemon(ranks=1, extra=["--nvme-dir", str(nvme)])
        config = zerod.JobConfig(optimizer="sgd", lr=0.5, offload_optimizer={
            "device": "nvme", "buffer_count": 2, "buffer_size": 1024})
        with zerod.Client(daemon.socket) as client:
            job = client.attach("full", rank=0, config=config)
            with pytest.raises(zerod.ResourceExhaustedError,
                               match=r"no room for the optimizer state of unit 'big'.*on disk"):
                job.register("big", [("w", (2 << 20,))], init="zeros")  # 8 MiB
        with zerod.Client(daemon.socket) as client:  # the job reset when its worker left
            job = client.attach("full", rank=0, config=config)
            unit = job.register("small", [("w", (4096,))], values=np.ones(4096, np.float32))
            unit.grad_buffer().arrays()["w"][...] = 1.0
            unit.reduce()
            assert job.step().step == 1
            assert unit.read_state()[0][:4].tolist() == [0.5, 0.5, 0.5, 0.5]
        assert "No space left on device" in daemon.read_log()
        daemon.stop()
    finally:
        subprocess.run(["umount", str(nvme)], capture_output=True)


def test_stats_count_the_bytes_each_collective_moved(start_daemon):
    """Two ranks in one daemon: every unit gather, gradient reduce and step
    shows in the counters, at the node level only, with the exact payload
    bytes (a unit's padded fp32 buffer per gather and per reduce)."""
    import threading

    daemon = start_daemon(ranks=2)
    n = 1000
    results, errors = {}, []
    # Both ranks have had their last step answered (so counted) before
    # either asks.
    done = threading.Barrier(2, timeout=60)

    def rank(r):
        try:
            with zerod.Client(daemon.socket) as client:
                job = client.attach("stats", rank=r,
                                    config=zerod.JobConfig(optimizer="sgd", lr=0.1))
                unit = job.register("layer", [("w", (n,))], init="zeros")
                for _ in range(3):
                    with unit.gather():
                        pass
                    grads = unit.grad_buffer()
                    grads.arrays()["w"][...] = 1.0
                    unit.reduce()
                    job.step()
                done.wait()
                results[r] = (job.stats(), unit.padded_numel)
        except Exception as e:  # reported on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    stats, padded = results[0]
    assert [s["rank"] for s in stats] == [0, 1] and all(s["step"] == 3 for s in stats)
    unit_bytes = padded * 4
    for s in stats:
        c = s["counters"]
        assert all(level == "node" for level, _ in c), c
        # The first gather of each step is an all-gather (the step made the
        # cached copy stale); gradients go once per step.
        assert c[("node", "all_gather")] == {"bytes": 3 * unit_bytes, "calls": 3}, c
        assert c[("node", "reduce_scatter")] == {"bytes": 3 * unit_bytes, "calls": 3}, c
        assert c[("node", "control")]["calls"] >= 3  # a norm per step, layout checks
        assert ("node", "broadcast") not in c  # zeros: no initial values to send
