"""Training through a real daemon with real worker processes equals the
single-process reference (same data split, the same CPU kernels).

fp32: bit-identical for 1, 2 and 4 ranks (tolerance 0): the ranks of a job
on one node share memory (comm_local.c) and sum gradients in rank order,
as the reference does.
"""

import os
import subprocess

import pytest

from conftest import binary, run_worker

# A smaller model than the demo's keeps the sanitizer build quick.
MODEL = ["--hidden", "256", "--batch", "32", "--steps", "20", "--log-every", "5"]


def train(d, job, ranks, tmp_path, extra=()):
    dump = tmp_path / ("%s.bin" % job)
    procs = []
    for r in range(ranks):
        args = [binary("zerod-mlp-train"), "--socket", d.socket, "--job", job,
                "--local-rank", str(r)] + MODEL + list(extra)
        if r == 0:
            args += ["--dump", str(dump)]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, "worker failed:\n%s\n%s\n%s" % (out, err, d.read_log())
    return dump


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_training_matches_reference(start_daemon, tmp_path, ranks):
    d = start_daemon(ranks=ranks, timeout_s=60)
    dump = train(d, "mlp%d" % ranks, ranks, tmp_path)
    ref = run_worker([binary("zerod-mlp-reference"), "--world", str(ranks), "--compare",
                      str(dump), "--tolerance", "0"] + MODEL)
    assert "max relative difference" in ref.stdout or ref.stdout, ref.stdout


@pytest.mark.parametrize("extra", [["--bf16"], ["--max-grad-norm", "0.5"],
                                   ["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.01"]],
                         ids=["bf16", "clipping", "sgd"])
def test_training_variants_match_reference(start_daemon, tmp_path, extra):
    d = start_daemon(ranks=2, timeout_s=60)
    dump = train(d, "variant", 2, tmp_path, extra)
    run_worker([binary("zerod-mlp-reference"), "--world", "2", "--compare", str(dump),
                "--tolerance", "1e-6"] + MODEL + extra)


def test_two_jobs_train_side_by_side(start_daemon, tmp_path):
    d = start_daemon(ranks=2, timeout_s=60)
    procs = []
    for job in ("left", "right"):
        for r in range(2):
            args = [binary("zerod-mlp-train"), "--socket", d.socket, "--job", job,
                    "--local-rank", str(r), "--seed", "7" if job == "left" else "8"] + MODEL
            if r == 0:
                args += ["--dump", str(tmp_path / (job + ".bin"))]
            procs.append(subprocess.Popen(args, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, out + err
    for job, seed in (("left", "7"), ("right", "8")):
        run_worker([binary("zerod-mlp-reference"), "--world", "2", "--seed", seed,
                    "--compare", str(tmp_path / (job + ".bin"))] + MODEL)


def test_units_are_prefetched_in_the_recorded_order(start_daemon, tmp_path):
    """After the first step every rank all-gathers the next unit of the
    recorded order while its worker computes; results are unchanged."""
    d = start_daemon(ranks=2, timeout_s=60, extra=["--log-level", "debug"])
    dump = train(d, "prefetch", 2, tmp_path)
    log = d.read_log()
    for rank in range(2):
        assert "msg=prefetched job=prefetch rank=%d" % rank in log, log[-2000:]
    run_worker([binary("zerod-mlp-reference"), "--world", "2", "--compare", str(dump)] + MODEL)
