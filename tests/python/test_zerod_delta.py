"""Delta updates (docs/subscribe.md, "Deltas"): a subscriber holding
version v gets to v+k by copying only the blocks the daemon says changed.
Applied deltas must give exactly the weights a full read gives, and the
trainer's own; blocks left untouched must be those whose values did not
change."""

import numpy as np
import pytest

import zerod
from conftest import start_daemon  # noqa: F401 (fixture)

ROWS, COLS = 256, 1024  # 1 MiB of f32: 16 blocks of 64 KiB, 16 rows each
ROWS_PER_BLOCK = 65536 // (COLS * 4)


class SparseTrainer:
    """A one-rank job stepping plain SGD (no momentum, no weight decay) with
    gradients that are zero outside chosen rows: rows with a zero gradient
    keep their values, so only their blocks change."""

    def __init__(self, socket, job="delta"):
        self.client = zerod.Client(socket)
        self.job = self.client.attach(job, create="fresh", config=zerod.JobConfig(
            optimizer="sgd", lr=0.05, weight_decay=0.0))
        rng = np.random.default_rng(1)
        self.unit = self.job.register("dense", [("weight", (ROWS, COLS)), ("bias", (COLS,))],
                                      values=rng.standard_normal(ROWS * COLS + COLS)
                                      .astype(np.float32))

    def step(self, rows, bias=False):
        grads = self.unit.grad_buffer().arrays()
        grads["weight"][...] = 0.0
        grads["weight"][rows, :] = 1.0
        grads["bias"][...] = 1.0 if bias else 0.0
        self.unit.reduce()
        return self.job.step().version

    def weights(self):
        values, _ = self.unit.read_state()
        return {"weight": values[:ROWS * COLS].reshape(ROWS, COLS), "bias": values[ROWS * COLS:]}

    def close(self):
        self.client.close()


def blocks_of_rows(rows):
    return sorted({r // ROWS_PER_BLOCK for r in rows})


def assert_same(target, weights):
    for name, values in weights.items():
        assert np.array_equal(target[name].view(np.uint32), values.view(np.uint32)), name


def test_applied_deltas_equal_full_reads_and_the_trainers_weights(start_daemon):
    daemon = start_daemon(ranks=1)
    trainer = SparseTrainer(daemon.socket)
    target = {"weight": np.zeros((ROWS, COLS), np.float32), "bias": np.zeros(COLS, np.float32)}
    try:
        with zerod.Client(daemon.socket) as c, c.subscribe("delta", timeout_s=10) as sub:
            first = sub.next(timeout_s=0)
            assert first.apply(target) == ROWS * COLS + COLS  # nothing held: every element
            assert_same(target, trainer.weights())

            # One version on: only the rows stepped (blocks 0 and 9) change.
            trainer.step([3, 150])
            update = sub.next()
            copied = update.apply(target)
            assert copied == 2 * ROWS_PER_BLOCK * COLS, copied
            assert_same(target, trainer.weights())
            assert_same(target, update.read())

            # Three versions on at once (a slow subscriber): the union of what
            # they changed, the bias (the unit's last block) among it.
            trainer.step([0])
            trainer.step([200, 201])
            trainer.step([17], bias=True)
            update = sub.next()
            assert update.skipped == 2
            before = target["weight"].copy()
            copied = update.apply(target)
            blocks = blocks_of_rows([0, 200, 201, 17]) + [ROWS // ROWS_PER_BLOCK]
            assert copied == (len(blocks) - 1) * ROWS_PER_BLOCK * COLS + COLS, (copied, blocks)
            assert_same(target, trainer.weights())
            changed_rows = np.flatnonzero((before != target["weight"]).any(axis=1))
            assert set(changed_rows) == {0, 200, 201, 17}
    finally:
        trainer.close()


def test_the_changed_blocks_of_a_delta_gather(start_daemon):
    daemon = start_daemon(ranks=1)
    trainer = SparseTrainer(daemon.socket)
    try:
        with zerod.Client(daemon.socket) as c:
            reader = c.attach("delta", read_only=True, pin=True, create=False)
            reader.list_units()
            unit = reader.unit("dense")
            with unit.gather(delta=True) as g:
                assert g.delta.full and g.delta.from_version is None
                v0 = g.version
            trainer.step([40, 41, 100])
            reader.pin()
            with unit.gather(delta=True) as g:
                assert not g.delta.full and g.delta.from_version == v0
                assert g.delta.block_bytes == 65536
                assert g.delta.nblocks == -(-g.nbytes // 65536)
                assert list(g.delta.blocks) == blocks_of_rows([40, 41, 100])
                assert g.delta.runs(4) == [(2 * 16384, 3 * 16384), (6 * 16384, 7 * 16384)]
                assert np.array_equal(g.arrays()["weight"], trainer.weights()["weight"])
                v1 = g.version
            # Gathered again at the same version: nothing to write.
            with unit.gather(delta=True) as g:
                assert g.delta.from_version == v1 and len(g.delta.blocks) == 0
            # A plain gather after it reads the same buffer.
            with unit.gather() as g:
                assert g.delta is None
                assert np.array_equal(g.arrays()["bias"], trainer.weights()["bias"])
            # A load that rewrites one row changes that row's block only.
            w = trainer.weights()
            w["weight"][255, 7] += 1.0
            trainer.unit.load([w["weight"], w["bias"]])
            reader.pin()
            with unit.gather(delta=True) as g:
                assert list(g.delta.blocks) == [255 // ROWS_PER_BLOCK]
                assert g.arrays()["weight"][255, 7] == w["weight"][255, 7]
            reader.detach()
    finally:
        trainer.close()


def test_a_read_write_job_refuses_delta_gathers(start_daemon):
    daemon = start_daemon(ranks=1)
    trainer = SparseTrainer(daemon.socket)
    try:
        with pytest.raises(zerod.FailedPreconditionError, match="read-only"):
            trainer.unit.gather(delta=True)
    finally:
        trainer.close()


def test_follow_copies_only_the_changed_blocks(start_daemon):
    torch = pytest.importorskip("torch")
    from zerod.torch import load_update

    daemon = start_daemon(ranks=1)
    trainer = SparseTrainer(daemon.socket)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(ROWS, COLS))
            self.bias = torch.nn.Parameter(torch.zeros(COLS))

    model = Model()
    try:
        with zerod.Client(daemon.socket) as c, c.subscribe("delta", timeout_s=10) as sub:
            assert load_update(model, sub.next(timeout_s=0)) == ROWS * COLS + COLS
            trainer.step([64])
            assert load_update(model, sub.next()) == ROWS_PER_BLOCK * COLS
            w = trainer.weights()
            assert torch.equal(model.weight.detach(), torch.from_numpy(w["weight"]))
            assert torch.equal(model.bias.detach(), torch.from_numpy(w["bias"]))
    finally:
        trainer.close()
