"""JobConfig's typed policies (zerod.policies: FSDP2's MixedPrecisionPolicy
and OffloadPolicy shapes, dtypes as torch or numpy dtypes) give the same
config as the string and dict forms, which stay accepted."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import zerod
from conftest import start_daemon  # noqa: F401 (fixture)


def c_bytes(config):
    c = config._to_c()
    return bytes(ctypes.string_at(ctypes.addressof(c), ctypes.sizeof(c)))


def test_typed_policies_make_the_same_config_as_strings_and_dicts():
    torch = pytest.importorskip("torch")
    typed = zerod.JobConfig(
        mixed_precision=zerod.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.bfloat16),
        offload_optimizer=zerod.CPUOffloadPolicy(buffer_count=3))
    strings = zerod.JobConfig(dtype="bfloat16", gradient_comm_dtype="bfloat16",
                              offload_optimizer={"device": "cpu", "buffer_count": 3,
                                                 "pin_memory": True})
    assert c_bytes(typed) == c_bytes(strings)
    assert c_bytes(zerod.JobConfig(dtype=torch.float16)) == c_bytes(zerod.JobConfig(dtype="float16"))
    assert c_bytes(zerod.JobConfig(dtype=np.float16)) == c_bytes(zerod.JobConfig(dtype="float16"))
    nvme = zerod.JobConfig(offload_optimizer=zerod.NVMeOffloadPolicy(nvme_path="lm"))
    assert c_bytes(nvme) == c_bytes(zerod.JobConfig(offload_optimizer={"device": "nvme",
                                                                       "nvme_path": "lm"}))


def test_a_bad_or_doubled_dtype_names_the_field():
    with pytest.raises(zerod.InvalidArgumentError, match="mixed_precision.param_dtype must be"):
        zerod.JobConfig(mixed_precision=zerod.MixedPrecisionPolicy(param_dtype=np.int8))._to_c()
    with pytest.raises(zerod.InvalidArgumentError, match="^dtype must be"):
        zerod.JobConfig(dtype="float64")._to_c()
    with pytest.raises(zerod.InvalidArgumentError, match="both given"):
        zerod.JobConfig(dtype="float16",
                        mixed_precision=zerod.MixedPrecisionPolicy(param_dtype="bfloat16"))._to_c()
    with pytest.raises(zerod.InvalidArgumentError, match="gradient_comm_dtype must be"):
        zerod.JobConfig(mixed_precision=zerod.MixedPrecisionPolicy(reduce_dtype="float16"))._to_c()


def test_a_job_made_from_policies_runs_them(start_daemon):
    daemon = start_daemon(ranks=1)
    config = zerod.JobConfig(lr=0.1, optimizer="sgd",
                             mixed_precision=zerod.MixedPrecisionPolicy(param_dtype="bfloat16"),
                             offload_optimizer=zerod.OffloadPolicy(device="cpu", buffer_count=2))
    with zerod.Client(daemon.socket) as client:
        job = client.attach("typed", config=config)
        effective = job.effective_config
        assert effective.dtype == "bfloat16"
        assert effective.offload_optimizer["device"] == "cpu"
        assert effective.offload_optimizer["buffer_count"] == 2
        unit = job.register("u", [("w", (4,))], init="zeros")
        assert unit.dtype == "bfloat16"
