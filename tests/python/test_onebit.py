"""One-bit compression with error feedback: the CPU kernel
(kernels/cpu/onebit.c) against the numpy reference (onebit_ref.py), bit for
bit, over several rounds whose errors carry over; and what error feedback is
for: the decoded sums of many rounds track the sums of the inputs."""

import numpy as np
import pytest

import onebit_ref
import zk_ctypes


@pytest.fixture(scope="module")
def zk():
    k = zk_ctypes.Kernels(threads=2)
    yield k
    k.close()


@pytest.mark.parametrize("block,numel", [(8, 8), (16, 100), (2048, 10000), (64, 5000)])
def test_kernel_matches_the_reference_round_after_round(zk, block, numel):
    rng = np.random.default_rng(block * 7919 + numel)
    error = np.zeros(numel, dtype=np.float32)
    ref_error = error.copy()
    for _ in range(5):
        x = (rng.standard_normal(numel) * rng.uniform(0.01, 10)).astype(np.float32)
        x[rng.integers(0, numel, size=3)] = 0.0
        data = zk.onebit_encode(block, x, error)
        ref_data, ref_error = onebit_ref.encode(block, x, ref_error)
        assert data.size == onebit_ref.nbytes(block, numel)
        assert np.array_equal(data, ref_data)
        assert np.array_equal(error.view(np.uint32), ref_error.view(np.uint32))
        y = zk.onebit_decode(block, data, numel)
        assert np.array_equal(y.view(np.uint32), onebit_ref.decode(block, data, numel).view(
            np.uint32))
        # Decoded plus the new error is x plus the old error, up to a
        # rounding of each.
        assert np.all(np.abs(np.abs(y) - np.abs(y[0])) >= 0)


def test_error_feedback_carries_what_a_round_loses(zk):
    rng = np.random.default_rng(3)
    numel, block = 4096, 256
    error = np.zeros(numel, dtype=np.float32)
    sent = np.zeros(numel, dtype=np.float64)
    total = np.zeros(numel, dtype=np.float64)
    for _ in range(200):
        x = rng.standard_normal(numel).astype(np.float32) * 0.1 + 0.01
        total += x
        sent += zk.onebit_decode(block, zk.onebit_encode(block, x, error), numel)
    # What was sent differs from what was given by the error still held,
    # not by 200 rounds of losses: bounded by one round's magnitude.
    assert np.allclose(sent + error, total, atol=1e-3)
    assert np.max(np.abs(error)) < 2.0


def test_a_non_finite_block_decodes_to_nan_and_keeps_its_error(zk):
    block = 8
    x = np.ones(24, dtype=np.float32)
    x[9] = np.inf
    error = np.full(24, 0.25, dtype=np.float32)
    data = zk.onebit_encode(block, x, error)
    y = zk.onebit_decode(block, data, 24)
    assert np.all(np.isnan(y[8:16])) and np.all(np.isfinite(y[:8])) and np.all(np.isfinite(y[16:]))
    assert np.all(error[8:16] == 0.25)
    assert np.all(error[:8] == 0.0)  # 1.25 everywhere: decoded exactly


def test_sizes_are_checked(zk):
    x = np.zeros(16, dtype=np.float32)
    error = np.zeros(16, dtype=np.float32)
    assert zk.lib.zk_onebit_bytes(12, 16) == 0  # not a multiple of 8
    with pytest.raises(OSError):
        zk.onebit_decode(8, np.zeros(3, dtype=np.uint8), 16)
    data = zk.onebit_encode(8, x, error)
    assert data.size == 2 * 4 + 2


def test_a_frozen_second_moment_stays_and_keeps_its_bias_correction(zk):
    """1-bit Adam's optimizer (zk_adam_hparams.v_frozen_at): past the
    freeze step v is left bit for bit as it was and corrected as at the
    freeze step; before it the step is plain AdamW."""
    rng = np.random.default_rng(11)
    n, lr, b1, b2, eps, wd, k = 10007, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3
    p = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 0.01).astype(np.float32)
    v = (rng.random(n) * 1e-4).astype(np.float32)
    g = (rng.standard_normal(n) * 0.1).astype(np.float32)
    plain = [a.copy() for a in (p, m, v)]
    zk.adam_step(zk_ctypes.AdamHparams(lr, b1, b2, eps, wd, 1, k, 1.0, 0), *plain, g, zk_ctypes.F32)
    at_freeze = [a.copy() for a in (p, m, v)]
    zk.adam_step(zk_ctypes.AdamHparams(lr, b1, b2, eps, wd, 1, k, 1.0, k), *at_freeze, g,
                 zk_ctypes.F32)
    for a, b in zip(plain, at_freeze):  # the freeze step itself is exact Adam
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    t = k + 4
    frozen = [a.copy() for a in (p, m, v)]
    zk.adam_step(zk_ctypes.AdamHparams(lr, b1, b2, eps, wd, 1, t, 1.0, k), *frozen, g,
                 zk_ctypes.F32)
    assert np.array_equal(frozen[2].view(np.uint32), v.view(np.uint32))
    m64 = b1 * m.astype(np.float64) + (1 - b1) * g
    want = (p * (1 - lr * wd) - lr / (1 - b1 ** t) * m64 /
            (np.sqrt(v.astype(np.float64)) / np.sqrt(1 - b2 ** k) + eps))
    assert np.allclose(frozen[1], m64, rtol=1e-5, atol=1e-9)
    assert np.allclose(frozen[0], want, rtol=1e-5, atol=1e-6)
