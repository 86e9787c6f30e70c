"""The chaos run, short (chaos.py; `make chaos` runs it for minutes): two
jobs of two tenants on three of four nodes, a node or a worker killed every
few seconds; each job ends bit-identical to a run without faults, and no
daemon keeps what the jobs held."""

from __future__ import annotations

import os

import numpy as np

from chaos import Chaos
from conftest import cluster  # noqa: F401 (fixture)


def test_two_jobs_survive_killed_nodes_and_workers(cluster, tmp_path):
    chaos = Chaos(cluster, tmp_path, seed=int(os.environ.get("ZEROD_CHAOS_SEED", "1")))
    try:
        chaos.start()
        chaos.run(duration_s=float(os.environ.get("ZEROD_CHAOS_SECONDS", "40")),
                  every_s=float(os.environ.get("ZEROD_CHAOS_EVERY_S", "8")))
        assert len(chaos.kills) >= 2, chaos.kills
        results = chaos.finish(more_steps=20)
    except AssertionError:
        print("kills:", chaos.kills)
        raise
    finally:
        chaos.stop_workers()
    print("kills:", chaos.kills, "final steps:", {n: s for n, (_, s) in results.items()})
    refs = chaos.reference({n: s for n, (_, s) in results.items()})
    for name, (params, _) in results.items():
        np.testing.assert_array_equal(params, refs[name], err_msg=name)
    assert chaos.leaks() == {}
