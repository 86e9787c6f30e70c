"""JobConfig.from_deepspeed and `zerodctl jobs create --deepspeed-config`
read DeepSpeed JSON configs alike: the mapping of each key, what is ignored
(and why), the errors naming the key, and, through a standalone daemon, the
same job config from both readers for the configs of tests/data/deepspeed."""

from __future__ import annotations

import json
import os
import subprocess
import warnings

import pytest

import zerod
from conftest import binary, start_daemon  # noqa: F401 (fixture)

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "deepspeed")
FILES = sorted(f for f in os.listdir(DATA) if f.endswith(".json"))


def read(doc, strict=False):
    """(JobConfig, the warnings' texts)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = zerod.JobConfig.from_deepspeed(doc, strict=strict)
    return config, [str(w.message) for w in caught]


def bad(doc):
    """The error of a config that must fail, without its "DeepSpeed config: " prefix."""
    with pytest.raises(zerod.InvalidArgumentError) as e:
        zerod.JobConfig.from_deepspeed(doc)
    assert e.value.message.startswith("DeepSpeed config: "), e.value.message
    return e.value.message[len("DeepSpeed config: "):]


def test_the_zero3_nvme_bf16_file():
    config, said = read(os.path.join(DATA, "zero3_nvme_bf16.json"))
    assert (config.optimizer, config.lr, config.betas, config.eps, config.weight_decay) == (
        "adamw", 3e-4, (0.9, 0.95), 1e-8, 0.1)
    assert config.dtype == "bfloat16" and config.max_grad_norm == 1.0
    assert config.offload_optimizer == {"device": "nvme", "nvme_path": "llama-run",
                                        "buffer_count": 4, "buffer_size": 1048576,
                                        "pin_memory": True}
    assert said == ["ignored DeepSpeed keys: gradient_accumulation_steps, scheduler, "
                    "steps_per_print, train_batch_size, train_micro_batch_size_per_gpu, "
                    "wall_clock_breakdown, zero_optimization.contiguous_gradients, "
                    "zero_optimization.offload_optimizer.fast_init, "
                    "zero_optimization.offload_param, zero_optimization.overlap_comm, "
                    "zero_optimization.reduce_bucket_size, "
                    "zero_optimization.stage3_gather_16bit_weights_on_model_save, "
                    "zero_optimization.stage3_max_live_parameters, "
                    "zero_optimization.stage3_max_reuse_distance, "
                    "zero_optimization.stage3_param_persistence_threshold, "
                    "zero_optimization.stage3_prefetch_bucket_size, "
                    "zero_optimization.sub_group_size"]


def test_the_hugging_face_file_auto_values_are_absent_and_reported():
    config, said = read(os.path.join(DATA, "hf_zero2_fp16_auto.json"))
    # "Adam" is DeepSpeed's AdamW unless adam_w_mode is false; its params
    # are all "auto": zerod's defaults.
    assert config.optimizer == "adamw" and config.lr is None and config.weight_decay is None
    assert config.max_grad_norm == 0.0
    assert config.dtype == "float16"
    assert (config.loss_scale, config.loss_scale_window, config.loss_scale_hysteresis,
            config.loss_scale_min, config.loss_scale_growth) == (4096.0, 500, 2, 1.0, 0.0)
    assert config.offload_optimizer == {"device": "cpu", "pin_memory": True}
    assert len(said) == 2, said
    assert "gradient_clipping (auto)" in said[0] and "optimizer.params.lr (auto)" in said[0]
    assert "optimizer.params.torch_adam," in said[0] and "scheduler," in said[0]
    assert said[1] == ("zero_optimization.stage 2: zerod shards parameters, gradients and "
                       "optimizer states alike (as stage 3)")


def test_the_zeropp_sgd_static_fp16_file():
    config, said = read(os.path.join(DATA, "zeropp_sgd_static_fp16.json"))
    assert (config.optimizer, config.lr, config.momentum, config.dampening, config.nesterov,
            config.weight_decay) == ("sgd", 0.05, 0.9, 0.1, False, 1e-4)
    # A static loss scale: never grown, never backed off below itself.
    assert (config.dtype, config.loss_scale, config.loss_scale_min,
            config.loss_scale_growth) == ("float16", 1024.0, 1024.0, 1.0)
    assert config.quantized_weights and config.quantized_gradients == 4
    assert config.hpz_partition_size == 2 and config.max_grad_norm == 0.5
    assert len(said) == 1 and "fp16.auto_cast" in said[0] and "communication_data_type" in said[0]


def test_defaults_and_what_applies_to_each_optimizer():
    config, said = read({})
    assert config == zerod.JobConfig() and said == []
    config, said = read({"optimizer": {"type": "ADAM", "params": {"adam_w_mode": False,
                                                                  "momentum": 0.9}}})
    assert config.optimizer == "adam" and config.momentum == 0.0
    assert said == ["ignored DeepSpeed keys: optimizer.params.momentum (not for adam)"]
    config, said = read({"optimizer": {"type": "SGD", "params": {"betas": [0.8, 0.9],
                                                                 "eps": 1e-6}}})
    assert config.optimizer == "sgd" and config.betas == (0.9, 0.999)
    assert said == ["ignored DeepSpeed keys: optimizer.params.betas (not for sgd), "
                    "optimizer.params.eps (not for sgd)"]
    # fp16 off: its loss scaling is reported, not applied.
    config, said = read({"fp16": {"enabled": False, "loss_scale_window": 100}, "bf16": None})
    assert config.dtype == "float32" and config.loss_scale_window == 0
    assert said == ["ignored DeepSpeed keys: fp16.loss_scale_window (fp16 not enabled)"]
    # fp16 with nothing else: DeepSpeed's defaults (2^16, window 1000, hysteresis 2).
    config, _ = read({"fp16": {"enabled": True}})
    assert (config.loss_scale, config.loss_scale_window, config.loss_scale_hysteresis,
            config.loss_scale_min) == (65536.0, 1000, 2, 1.0)
    # Integers may be written as integral reals, as DeepSpeed's examples do.
    config, _ = read({"zero_optimization": {"offload_optimizer": {"device": "cpu",
                                                                  "buffer_size": 2.048e3}}})
    assert config.offload_optimizer["buffer_size"] == 2048
    assert isinstance(config.offload_optimizer["buffer_size"], int)


def test_strict_refuses_what_would_be_ignored():
    with pytest.raises(zerod.InvalidArgumentError,
                       match=r"keys zerod does not use: optimizer.params.lr \(auto\), "
                             r"train_batch_size$"):
        zerod.JobConfig.from_deepspeed({"train_batch_size": 8,
                                        "optimizer": {"params": {"lr": "auto"}}}, strict=True)
    config, _ = read({"gradient_clipping": 2}, strict=True)
    assert config.max_grad_norm == 2.0


# Each config that must fail, and its error (the same from zerodctl).
ERRORS = [
    ([1, 2], "the document must be a JSON object"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type 'Lamb' is not supported: AdamW, Adam, OneBitAdam or SGD"),
    ({"optimizer": {"params": {"lr": "0.1"}}}, "optimizer.params.lr must be a number"),
    ({"optimizer": {"params": {"betas": [0.9]}}},
     "optimizer.params.betas must be a list of two numbers"),
    ({"optimizer": {"params": {"nesterov": 1}}}, "optimizer.params.nesterov must be true or false"),
    ({"optimizer": []}, "optimizer must be an object"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be an integer from 0 to 3"),
    ({"zero_optimization": {"offload_optimizer": {"buffer_count": 2.5}}},
     "zero_optimization.offload_optimizer.buffer_count must be an integer from 0 to 4294967295"),
    ({"zero_optimization": {"offload_optimizer": {"device": "disk"}}},
     "zero_optimization.offload_optimizer.device must be 'cpu', 'nvme' or 'none'"),
    ({"zero_optimization": {"offload_optimizer": {"nvme_path": "x" * 256}}},
     "zero_optimization.offload_optimizer.nvme_path is longer than 255 bytes"),
    ({"zero_optimization": {"zero_quantized_gradients": 8}},
     "zero_optimization.zero_quantized_gradients must be true or false"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}},
     "bf16.enabled and fp16.enabled are both true: enable one"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale must be 0 (dynamic) or more"),
    ({"fp16": {"enabled": "true"}}, "fp16.enabled must be true or false"),
    ({"gradient_clipping": True}, "gradient_clipping must be a number"),
]


@pytest.mark.parametrize("doc,error", ERRORS)
def test_a_wrong_value_names_its_key(doc, error):
    assert bad(doc) == error


def test_a_file_that_is_not_json_says_so(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("{\"fp16\": ")
    assert bad(str(path)).startswith("%s is not JSON: " % path)


def zerodctl(daemon, *args):
    return subprocess.run([binary("zerodctl"), "--coordinator", "unix:%s/control.sock" % daemon.dir]
                          + list(args), capture_output=True, text=True, timeout=30)


def as_ctl_json(c):
    """An effective JobConfig as `zerodctl jobs get --json` spells its config."""
    precisions = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    off = c.offload_optimizer
    out = {"optimizer": {"kind": c.optimizer, "lr": c.lr, "beta1": c.betas[0],
                         "beta2": c.betas[1], "eps": c.eps, "weight_decay": c.weight_decay,
                         "has_weight_decay": True, "momentum": c.momentum,
                         "dampening": c.dampening, "nesterov": c.nesterov},
           "precision": precisions[c.dtype], "collectives": c.collectives,
           "quantized_weights": c.quantized_weights, "quantization_block": c.quantization_block,
           "quantized_gradients": c.quantized_gradients,
           "gradient_comm_dtype": precisions[c.gradient_comm_dtype],
           "hpz_partition_size": c.hpz_partition_size, "offload_optimizer": off["device"],
           "loss_scale": max(c.loss_scale, 0.0), "loss_scale_window": c.loss_scale_window,
           "loss_scale_growth": c.loss_scale_growth,
           "loss_scale_backoff": c.loss_scale_backoff,
           "loss_scale_hysteresis": c.loss_scale_hysteresis,
           "loss_scale_min": c.loss_scale_min, "max_grad_norm": c.max_grad_norm,
           "base_job": c.base_job, "onebit_freeze_step": c.onebit_freeze_step,
           "powersgd_rank": c.powersgd_rank, "powersgd_start_step": c.powersgd_start_step}
    if off["device"] == "nvme":
        out["nvme_path"] = off["nvme_path"]
    if off["device"] in ("cpu", "nvme"):
        out.update(offload_buffer_count=off["buffer_count"],
                   offload_buffer_size=off["buffer_size"], offload_pin_memory=off["pin_memory"])
    return out


@pytest.mark.parametrize("name", FILES)
def test_zerodctl_and_python_make_the_same_job(start_daemon, name):
    """The same file through zerodctl (jobs create, then jobs get --json)
    and through Python (an attach that creates the job): the same config,
    and the same keys reported as ignored."""
    daemon = start_daemon(ranks=2)
    os.makedirs(os.path.join(str(daemon.dir), "nvme", "llama-run"))
    path = os.path.join(DATA, name)
    created = zerodctl(daemon, "jobs", "create", "by-ctl", "--ranks-per-node", "2",
                       "--deepspeed-config", path)
    assert created.returncode == 0, created.stderr + daemon.read_log()
    config, said = read(path)
    ctl_lines = [line[len("zerodctl: "):] for line in created.stderr.splitlines()]
    assert ctl_lines == [s if s.startswith("ignored") else "note: " + s for s in said]
    with zerod.Client(daemon.socket) as client:
        job = client.attach("by-python", rank=0, config=config)
        effective = job.effective_config
        job.detach()
    by_ctl = json.loads(zerodctl(daemon, "jobs", "get", "by-ctl", "--json").stdout)["config"]
    by_python = json.loads(zerodctl(daemon, "jobs", "get", "by-python", "--json").stdout)["config"]
    assert by_ctl == by_python
    by_ctl.pop("max_live_bytes")  # 0 in the job, the daemon's budget in effect
    assert by_ctl == as_ctl_json(effective)


def test_zerodctl_refuses_a_wrong_value_as_python_does(start_daemon, tmp_path):
    daemon = start_daemon(ranks=1)
    for i, (doc, error) in enumerate(ERRORS):
        path = tmp_path / ("bad-%d.json" % i)
        path.write_text(json.dumps(doc))
        proc = zerodctl(daemon, "jobs", "create", "bad", "--deepspeed-config", str(path))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == "zerodctl: jobs create: --deepspeed-config '%s': %s\n" % (
            path, error)
