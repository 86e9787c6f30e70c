"""What zerod.h promises a worker, held to: settings the ranks must send
alike are compared across the ranks before they take effect (a mismatch
fails every rank, naming the field, and changes nothing); the loss scale
follows DeepSpeed's update_scale; a restore keeps parameter groups and the
loss scale and moves the job's version; a relative nvme_path is inside
--nvme-dir; a second default-named save at one step keeps the eight-digit
step."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

import zerod
from conftest import start_daemon  # noqa: F401 (fixture)


def on_two_ranks(daemon, name, config, body):
    """Runs body(job, unit, rank) for ranks 0 and 1 of job `name`, each on
    a thread of its own with its own connection, after registering one unit
    of two tensors (w: 4, b: 4; zeros). Returns each rank's result; raises
    the first unexpected exception."""
    results, errors = [None, None], []

    def rank(r):
        try:
            with zerod.Client(daemon.socket) as client:
                job = client.attach(name, rank=r, config=config)
                unit = job.register("layer", [("w", (4,)), ("b", (4,))], init="zeros")
                results[r] = body(job, unit, r)
        except BaseException as e:  # noqa: BLE001 - pytest.fail too, reported on the test thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a rank did not finish: the ranks waited for each other"
    if errors:
        raise errors[0]
    return results


def refusal(call):
    """The InvalidArgumentError's message of call(), which must raise it."""
    with pytest.raises(zerod.InvalidArgumentError) as info:
        call()
    return str(info.value)


def set_unit_gradients(unit, value):
    grads = unit.grad_buffer().arrays()
    grads["w"][...] = value
    grads["b"][...] = value
    unit.reduce()


def test_ranks_that_send_different_parameter_groups_are_refused_naming_the_field(start_daemon):
    daemon = start_daemon(ranks=2)

    def body(job, unit, r):
        seen = {}
        # The case: rank 0 gives group 1 lr 2e-2, rank 1 3e-2.
        seen["lr"] = refusal(lambda: job.set_groups(
            [{"lr": 0.1}, {"lr": 0.2 if r == 0 else 0.3}], {unit.id: [0, 1]}))
        seen["betas"] = refusal(lambda: job.set_groups(
            [{"lr": 0.1}, {"lr": 0.2, "momentum": 0.5 if r == 0 else 0.25}], {unit.id: [0, 1]}))
        seen["tensors"] = refusal(lambda: job.set_groups(
            [{"lr": 0.1}, {"lr": 0.2}], {unit.id: [0, 1] if r == 0 else [1, 0]}))
        seen["count"] = refusal(lambda: job.set_groups(
            [{"lr": 0.1}, {"lr": 0.2}] if r == 0 else [{"lr": 0.1}], {}))
        seen["invalid"] = refusal(lambda: job.set_groups(
            [{"lr": 0.1}, {"weight_decay": -1.0 if r == 0 else 0.0}], {unit.id: [0, 1]}))
        # Nothing changed: the same groups on both ranks then work, each
        # tensor moving by its own group's lr.
        job.set_groups([{"lr": 0.1}, {"lr": 0.5}], {unit.id: [0, 1]})
        set_unit_gradients(unit, 1.0)
        result = job.step(grad_scale=2.0)  # the two ranks' gradients averaged
        return seen, result.step, unit.read_state()[0]

    config = zerod.JobConfig(optimizer="sgd", lr=0.1, momentum=0.9)
    results = on_two_ranks(daemon, "groups", config, body)
    for r, (seen, step, weights) in enumerate(results):
        assert re.search(r"different parameter groups: groups\[1\]\.lr differ", seen["lr"]), seen
        assert "groups[1].momentum differ" in seen["betas"], seen
        assert "tensor_groups differ" in seen["tensors"], seen
        assert re.search(r"ngroups, groups\[1\]\.lr", seen["count"]), seen
        if r == 0:
            assert "group 1: invalid weight decay -1" in seen["invalid"], seen
        else:
            assert "another rank's parameter groups was refused (1 of 2 ranks)" in seen["invalid"]
        assert step == 1
        np.testing.assert_allclose(weights, [-0.1] * 4 + [-0.5] * 4, rtol=1e-6)


def test_ranks_that_send_different_step_options_are_refused_naming_the_field(start_daemon):
    daemon = start_daemon(ranks=2)

    def body(job, unit, r):
        set_unit_gradients(unit, 1.0)
        seen = {
            "lr": refusal(lambda: job.step(lr=0.2 if r == 0 else 0.3, grad_scale=2.0)),
            "max_grad_norm": refusal(lambda: job.step(max_grad_norm=1.0 + r, grad_scale=2.0)),
            "grad_scale": refusal(lambda: job.step(grad_scale=2.0 + r)),
            "only_one_sets": refusal(lambda: job.step(lr=0.2 if r == 0 else None,
                                                      grad_scale=2.0)),
            "invalid": refusal(lambda: job.step(lr=-1.0 if r == 1 else 0.2, grad_scale=2.0)),
            "grad_norm": refusal(lambda: job.grad_norm(grad_scale=2.0 + r)),
        }
        job.set_groups([{"lr": 0.1}, {"lr": 0.1}], {unit.id: [0, 1]})
        seen["group_lr"] = refusal(lambda: job.step(group_lrs=[0.1, 0.2 + r], grad_scale=2.0))
        # Nothing changed: the gradients are still there, the step count
        # is 0, and the agreed step uses the job's lr 0.1.
        result = job.step(grad_scale=2.0)
        return seen, result.step, unit.read_state()[0]

    config = zerod.JobConfig(optimizer="sgd", lr=0.1)
    results = on_two_ranks(daemon, "steps", config, body)
    for r, (seen, step, weights) in enumerate(results):
        for field in ("lr", "max_grad_norm", "grad_scale", "group_lr"):
            assert "the ranks sent different step options: %s differ" % field in seen[field], seen
        assert "step options: lr differ" in seen["only_one_sets"], seen
        assert "different grad_norm request: grad_scale differ" in seen["grad_norm"], seen
        if r == 1:
            assert "lr must be > 0" in seen["invalid"], seen
        else:
            assert "another rank's step options was refused (1 of 2 ranks)" in seen["invalid"]
        assert step == 1
        np.testing.assert_allclose(weights, [-0.1] * 8, rtol=1e-6)


class DeepSpeedLossScaler:
    """DeepSpeed's DynamicLossScaler.update_scale (consecutive_hysteresis
    off, its default), written from its documented behaviour."""

    def __init__(self, scale, window, hysteresis, minimum, factor=2.0):
        self.scale, self.window, self.minimum, self.factor = scale, window, minimum, factor
        self.delayed_shift = self.hysteresis = hysteresis
        self.iteration, self.last_overflow = 0, -1

    def update(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.hysteresis == 1:
                self.scale = max(self.scale / self.factor, self.minimum)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iteration
        elif (self.iteration - self.last_overflow) % self.window == 0:
            self.hysteresis = self.delayed_shift
            self.scale *= self.factor
        self.iteration += 1


def test_loss_scale_follows_deepspeeds_update_scale(start_daemon):
    """A model whose gradients overflow whenever the loss scale is above
    2**10, from 2**16 with hysteresis 2: the same skips and the same scale
    at every step as DeepSpeed's scaler. (zerod restored the hysteresis at
    every backoff: 12 skips on the way down where DeepSpeed has 7, and 18
    in all where it has 14.)"""
    daemon = start_daemon(ranks=1)
    config = zerod.JobConfig(optimizer="sgd", lr=0.1, dtype="float16", loss_scale=2.0 ** 16,
                             loss_scale_window=4, loss_scale_hysteresis=2, loss_scale_min=1.0)
    reference = DeepSpeedLossScaler(2.0 ** 16, window=4, hysteresis=2, minimum=1.0)
    expected, seen = [], []
    with zerod.Client(daemon.socket) as client:
        job = client.attach("scaled", config=config)
        unit = job.register("u", [("w", (4,))], init="zeros")
        for _ in range(30):
            overflow = job.loss_scale > 2.0 ** 10
            assert overflow == (reference.scale > 2.0 ** 10)
            unit.grad_buffer().arrays()["w"][...] = np.inf if overflow else 1.0
            unit.reduce()
            result = job.step()
            reference.update(overflow)
            seen.append((result.skipped, result.loss_scale))
            expected.append((overflow, reference.scale))
    assert seen == expected
    # Down to 2**10 in 7 skips; then each growth to 2**11 overflows twice
    # (the growth restored the hysteresis).
    assert [skipped for skipped, _ in seen[:8]] == [True] * 7 + [False]
    assert sum(skipped for skipped, _ in seen) == 14


def test_restore_keeps_groups_and_loss_scale_and_moves_the_version(start_daemon):
    daemon = start_daemon(ranks=1)
    config = zerod.JobConfig(optimizer="sgd", lr=0.1, dtype="float16", loss_scale=8.0,
                             loss_scale_window=1000)
    with zerod.Client(daemon.socket) as client:
        job = client.attach("restored", config=config)
        unit = job.register("layer", [("w", (4,)), ("b", (4,))], init="zeros")
        job.set_groups([{"lr": 0.1}, {"lr": 0.5}], {unit.id: [0, 1]})
        set_unit_gradients(unit, job.loss_scale)  # an unscaled gradient of 1
        job.step()
        job.save_checkpoint("one")
        set_unit_gradients(unit, np.inf)
        assert job.step().skipped
        assert job.loss_scale == 4.0
        before = job.version
        info = job.restore_checkpoint("one")
        assert info.step == 1
        # A restore writes new weights: a new version, which the job says.
        assert job.version == before + 1
        with unit.gather() as g:
            assert g.version == job.version
        # The groups and the scale stay as they were before the restore.
        assert job.loss_scale == 4.0
        set_unit_gradients(unit, job.loss_scale)
        result = job.step()
        assert (result.step, result.version) == (2, job.version)
        np.testing.assert_allclose(unit.read_state()[0], [-0.2] * 4 + [-1.0] * 4, rtol=1e-3)


def test_relative_nvme_path_is_inside_the_nvme_dir(start_daemon, tmp_path):
    nvme = tmp_path / "nvme"
    (nvme / "tiers").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    daemon = start_daemon(ranks=1, extra=["--nvme-dir", str(nvme)])
    with zerod.Client(daemon.socket) as client:
        job = client.attach("tiered", config=zerod.JobConfig(offload_optimizer={
            "device": "nvme", "nvme_path": "tiers", "buffer_count": 2, "buffer_size": 1024}))
        job.register("u", [("w", (4096,))], init="zeros")
        assert any((nvme / "tiers").iterdir()), "the tier file is not in --nvme-dir/tiers"
    with zerod.Client(daemon.socket) as client:
        with pytest.raises(zerod.Error, match=r"nvme_path \.\./elsewhere is outside"):
            client.attach("escapes", config=zerod.JobConfig(offload_optimizer={
                "device": "nvme", "nvme_path": "../elsewhere"}))


def test_a_second_default_named_save_at_one_step_keeps_eight_digits(start_daemon):
    daemon = start_daemon(ranks=1)
    with zerod.Client(daemon.socket) as client:
        job = client.attach("named", config=zerod.JobConfig(optimizer="sgd", lr=0.1))
        job.register("u", [("w", (4,))], init="zeros")
        first = job.save_checkpoint()
        second = job.save_checkpoint()
        assert first.name == "step-00000000"
        assert re.fullmatch(r"step-00000000-\d+", second.name), second.name
