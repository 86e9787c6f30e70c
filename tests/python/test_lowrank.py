"""Low-rank (PowerSGD) compression: the CPU kernels (kernels/cpu/lowrank.c)
against the numpy reference (lowrank_ref.py), bit for bit and for any number
of threads; what the factors are for (a rank-r matrix comes back whole); and
the cross-node round with error feedback, whose running sums track the true
ones where the same round without it drifts away."""

import errno

import numpy as np
import pytest

import lowrank_ref
import zk_ctypes


@pytest.fixture(scope="module")
def zk():
    k = zk_ctypes.Kernels(threads=2)
    yield k
    k.close()


@pytest.fixture(scope="module")
def zk3():
    k = zk_ctypes.Kernels(threads=3)
    yield k
    k.close()


def bits(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def same_bits(a, b):
    return np.array_equal(bits(a), bits(b))


def random(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# (rows, cols, rank): 40 x 2000 gives back several column blocks per task;
# rank 4100 is past back's block of columns (one column per block).
SHAPES = [(1, 1, 1), (7, 13, 3), (64, 100, 4), (300, 257, 8), (40, 2000, 8), (2, 3, 4100)]


@pytest.mark.parametrize("rows,cols,rank", SHAPES)
def test_kernels_match_the_reference_for_any_thread_count(zk, zk3, rows, cols, rank):
    rng = np.random.default_rng(rows * 7919 + cols * 31 + rank)
    M = random(rng, rows, cols, scale=rng.uniform(0.01, 10))
    M[rng.integers(0, rows), rng.integers(0, cols)] = 0.0
    Q = random(rng, cols, rank)
    P_ref = lowrank_ref.project(M, Q)
    small = rank <= 64  # the reference's Gram-Schmidt is a Python loop over rank^2
    if small:
        Phat_ref = lowrank_ref.orthonormalize(P_ref)
    else:
        Phat_ref = P_ref / np.float32(np.max(np.abs(P_ref)) or 1)
    Qn_ref = lowrank_ref.back(M, Phat_ref)
    base = random(rng, rows * cols)
    for k in (zk, zk3):
        P = k.lowrank_project(M, Q)
        assert same_bits(P, P_ref)
        if small:
            k.lowrank_orthonormalize(P)
            assert same_bits(P, Phat_ref)
        assert same_bits(k.lowrank_back(M, Phat_ref), Qn_ref)
        for numel in sorted({rows * cols, max(rows * cols - cols // 2 - 1, 0), 1}):
            for mode in ("set", "add", "subtract"):
                out = base.copy()
                k.lowrank_expand(Phat_ref, Qn_ref, numel, out, mode)
                want = lowrank_ref.expand(Phat_ref, Qn_ref, numel, out=base, mode=mode)
                assert same_bits(out, want), (numel, mode)


def test_a_null_pool_gives_the_same_bits(zk):
    rng = np.random.default_rng(5)
    M, Q = random(rng, 300, 257), random(rng, 257, 8)
    P = np.empty((300, 8), dtype=np.float32)
    assert zk.lib.zk_lowrank_project(None, zk_ctypes._ptr(M), 300, 257, zk_ctypes._ptr(Q), 8,
                                     zk_ctypes._ptr(P)) == 0
    assert same_bits(P, zk.lowrank_project(M, Q))


def test_orthonormalize_past_the_rank_of_the_rows_matches_the_reference(zk, zk3):
    rng = np.random.default_rng(17)
    for rows, rank in [(3, 6), (1, 4), (5, 9)]:
        P = random(rng, rows, rank)
        want = lowrank_ref.orthonormalize(P)
        for k in (zk, zk3):
            got = P.copy()
            k.lowrank_orthonormalize(got)
            assert same_bits(got, want)
        # The first rows columns are orthonormal; the rest hold what
        # rounding left of them, normalized, or zero.
        head = want[:, :rows].astype(np.float64)
        assert np.allclose(head.T @ head, np.eye(rows), atol=1e-5)


def test_orthonormalize_makes_orthonormal_columns_and_keeps_a_zero_column(zk):
    rng = np.random.default_rng(23)
    P = random(rng, 500, 6, scale=3.0)
    P[:, 2] = 0.0
    want = lowrank_ref.orthonormalize(P)
    zk.lowrank_orthonormalize(P)
    assert same_bits(P, want)
    assert np.all(bits(P[:, 2]) == 0)
    live = P[:, [0, 1, 3, 4, 5]].astype(np.float64)
    assert np.allclose(live.T @ live, np.eye(5), atol=1e-5)


def test_a_rank_r_matrix_comes_back_from_one_warm_started_pass(zk):
    rng = np.random.default_rng(29)
    rows, cols, r = 120, 90, 4
    A, B = random(rng, rows, r), random(rng, cols, r)
    M = (A.astype(np.float64) @ B.T.astype(np.float64)).astype(np.float32)
    Q = random(rng, cols, r)
    P = zk.lowrank_project(M, Q)
    zk.lowrank_orthonormalize(P)
    Qn = zk.lowrank_back(M, P)
    out = np.full(rows * cols, np.nan, dtype=np.float32)
    zk.lowrank_expand(P, Qn, rows * cols, out, "set")
    err = np.linalg.norm(out.reshape(rows, cols) - M) / np.linalg.norm(M)
    assert err < 1e-4


def kernel_round(k, partials, errors_in, qs, rows, cols, rank):
    """lowrank_ref.round built from the kernels, the way the daemon does."""
    N, s = len(partials), partials[0][0].size
    qs = [[q.copy() for q in row] for row in qs]
    errors = [[np.zeros(s, dtype=np.float32) for _ in range(N)] for _ in range(N)]
    sent = [[None] * N for _ in range(N)]
    for m in range(N):
        for n in range(N):
            if n == m:
                continue
            M = lowrank_ref.pad(partials[m][n] + errors_in[m][n], rows, cols)
            P = k.lowrank_project(M, qs[m][n])
            k.lowrank_orthonormalize(P)
            qs[m][n] = k.lowrank_back(M, P)
            e = M.reshape(-1).copy()
            k.lowrank_expand(P, qs[m][n], s, e, "subtract")
            errors[m][n] = e[:s]
            sent[m][n] = (P, qs[m][n])
    recv = []
    for n in range(N):
        out = partials[n][n].copy()
        for m in range(N):
            if m != n:
                k.lowrank_expand(sent[m][n][0], sent[m][n][1], s, out, "add")
        recv.append(out)
    return recv, errors, qs


def test_the_kernels_run_the_reference_round_bit_for_bit(zk):
    rng = np.random.default_rng(31)
    N, s, rows, cols, rank = 3, 230, 12, 20, 3
    errors = [[random(rng, s, scale=0.1) if m != n else np.zeros(s, np.float32)
               for n in range(N)] for m in range(N)]
    qs = [[random(rng, cols, rank) for _ in range(N)] for _ in range(N)]
    partials = [[random(rng, s) for _ in range(N)] for _ in range(N)]
    recv, new_errors, new_qs = lowrank_ref.round(partials, errors, qs, rows, cols, rank)
    got_recv, got_errors, got_qs = kernel_round(zk, partials, errors, qs, rows, cols, rank)
    for n in range(N):
        assert same_bits(got_recv[n], recv[n])
        for m in range(N):
            assert same_bits(got_errors[m][n], new_errors[m][n])
            assert same_bits(got_qs[m][n], new_qs[m][n])


def run_rounds(feedback, rounds=50):
    """2 nodes, slices of 1000 elements as 25 x 40 matrices, rank 2. Each
    round's partials are a fixed full-rank signal plus noise. Returns the
    gap between the running sums of what each node received and of the true
    totals after each round, the mean norm of one round's totals, the
    running sums and the last errors."""
    rng = np.random.default_rng(41)
    N, s, rows, cols, rank = 2, 1000, 25, 40, 2
    signal = [[random(rng, s, scale=0.5) for _ in range(N)] for _ in range(N)]
    errors = [[np.zeros(s, np.float32) for _ in range(N)] for _ in range(N)]
    qs = [[random(rng, cols, rank) for _ in range(N)] for _ in range(N)]
    sent = np.zeros((N, s))
    total = np.zeros((N, s))
    gaps, norms = [], []
    for _ in range(rounds):
        partials = [[signal[m][n] + random(rng, s) for n in range(N)] for m in range(N)]
        if not feedback:
            errors = [[np.zeros(s, np.float32) for _ in range(N)] for _ in range(N)]
        recv, errors, qs = lowrank_ref.round(partials, errors, qs, rows, cols, rank)
        this = [sum(partials[m][n].astype(np.float64) for m in range(N)) for n in range(N)]
        for n in range(N):
            sent[n] += recv[n]
            total[n] += this[n]
        gaps.append(np.linalg.norm(sent - total))
        norms.append(np.linalg.norm(this))
    return np.array(gaps), np.mean(norms), sent, total, errors


def test_error_feedback_keeps_the_running_sums_together():
    gaps, one_round, sent, total, errors = run_rounds(feedback=True)
    # What was received differs from the truth by the errors still held
    # (nothing is lost, only delayed) ...
    for n in range(2):
        held = sum(errors[m][n].astype(np.float64) for m in range(2) if m != n)
        assert np.allclose(sent[n] + held, total[n], atol=1e-3)
    # ... which stay within a few rounds' size and stop growing (measured:
    # about 2.8 rounds from round 20 on, through round 100).
    assert gaps.max() < 4 * one_round
    assert gaps[-10:].max() < 1.25 * gaps[20:30].max()
    # Without error feedback the same rounds drift apart, round after round
    # (what each round loses of the fixed signal adds up).
    lost, _, _, _, _ = run_rounds(feedback=False)
    assert lost[-1] > 3 * lost[9]
    assert lost[-1] > 4 * gaps[-1]


def test_nan_and_inf_in_m_reach_the_expanded_output(zk):
    rng = np.random.default_rng(43)
    rows, cols, rank = 30, 20, 3
    for bad in (np.nan, np.inf):
        M = random(rng, rows, cols)
        M[4, 7] = bad
        P = zk.lowrank_project(M, random(rng, cols, rank))
        zk.lowrank_orthonormalize(P)
        Qn = zk.lowrank_back(M, P)
        out = M.reshape(-1).copy()
        zk.lowrank_expand(P, Qn, rows * cols, out, "subtract")
        assert np.isnan(out[4 * cols + 7])
        ref = lowrank_ref.orthonormalize(lowrank_ref.project(M, random(rng, cols, rank)))
        assert np.isnan(ref).any()


def test_bad_arguments_are_refused(zk):
    lib, pool, ptr = zk.lib, zk.pool, zk_ctypes._ptr
    M = np.ones((4, 5), dtype=np.float32)
    Q = np.ones((5, 2), dtype=np.float32)
    P = np.ones((4, 2), dtype=np.float32)
    out = np.zeros(20, dtype=np.float32)
    EINVAL = -errno.EINVAL
    big = 1 << 62
    # NULL where there are elements, and rank 0.
    assert lib.zk_lowrank_project(pool, None, 4, 5, ptr(Q), 2, ptr(P)) == EINVAL
    assert lib.zk_lowrank_project(pool, ptr(M), 4, 5, None, 2, ptr(P)) == EINVAL
    assert lib.zk_lowrank_project(pool, ptr(M), 4, 5, ptr(Q), 2, None) == EINVAL
    assert lib.zk_lowrank_project(pool, ptr(M), 4, 5, ptr(Q), 0, ptr(P)) == EINVAL
    assert lib.zk_lowrank_project(pool, ptr(M), big, big, ptr(Q), 2, ptr(P)) == EINVAL
    assert lib.zk_lowrank_back(pool, None, 4, 5, ptr(P), 2, ptr(Q)) == EINVAL
    assert lib.zk_lowrank_back(pool, ptr(M), 4, 5, None, 2, ptr(Q)) == EINVAL
    assert lib.zk_lowrank_back(pool, ptr(M), 4, 5, ptr(P), 2, None) == EINVAL
    assert lib.zk_lowrank_back(pool, ptr(M), 4, 5, ptr(P), 0, ptr(Q)) == EINVAL
    assert lib.zk_lowrank_back(pool, ptr(M), 4, big, ptr(P), 2, ptr(Q)) == EINVAL
    assert lib.zk_lowrank_orthonormalize(pool, None, 4, 2) == EINVAL
    assert lib.zk_lowrank_orthonormalize(pool, ptr(P), 4, 0) == EINVAL
    assert lib.zk_lowrank_orthonormalize(pool, ptr(P), big, 4) == EINVAL
    assert lib.zk_lowrank_expand(pool, None, ptr(Q), 4, 5, 2, 20, ptr(out), 0) == EINVAL
    assert lib.zk_lowrank_expand(pool, ptr(P), None, 4, 5, 2, 20, ptr(out), 0) == EINVAL
    assert lib.zk_lowrank_expand(pool, ptr(P), ptr(Q), 4, 5, 2, 20, None, 0) == EINVAL
    assert lib.zk_lowrank_expand(pool, ptr(P), ptr(Q), 4, 5, 0, 20, ptr(out), 0) == EINVAL
    assert lib.zk_lowrank_expand(pool, ptr(P), ptr(Q), 4, 5, 2, 21, ptr(out), 0) == EINVAL
    assert lib.zk_lowrank_expand(pool, ptr(P), ptr(Q), 4, 5, 2, 20, ptr(out), 3) == EINVAL
    # Nothing refused touched anything.
    assert np.all(P == 1) and np.all(Q == 1) and np.all(out == 0)
    # Empty arrays may be NULL: nothing to read or write.
    assert lib.zk_lowrank_project(pool, None, 0, 5, ptr(Q), 2, None) == 0
    assert lib.zk_lowrank_back(pool, None, 4, 0, ptr(P), 2, None) == 0
    assert lib.zk_lowrank_orthonormalize(pool, None, 0, 3) == 0
    assert lib.zk_lowrank_expand(pool, ptr(P), ptr(Q), 4, 5, 2, 0, None, 0) == 0
    # No columns: every sum is empty, so P is zeros.
    assert lib.zk_lowrank_project(pool, None, 4, 0, None, 2, ptr(P)) == 0
    assert np.all(bits(P) == 0)
