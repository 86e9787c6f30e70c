"""`zerodctl jobs create NAME --deepspeed-config FILE` on a standalone daemon
(DIR/control.sock): the file's settings reach the job, the options given
override them, what the file has that zerod does not use is one line on
stderr, and a bad file is a usage error (exit 2) naming the key. The
Python reader's agreement is tests/python/test_zerod_deepspeed.py."""

import json
import os
import subprocess

from conftest import binary

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "deepspeed")


def zerodctl(daemon, *args):
    proc = subprocess.run(
        [binary("zerodctl"), "--coordinator", "unix:%s/control.sock" % daemon.dir] + list(args),
        capture_output=True, text=True, timeout=30)
    return proc.returncode, proc.stdout, proc.stderr


def config_of(daemon, job):
    rc, out, err = zerodctl(daemon, "jobs", "get", job, "--json")
    assert rc == 0, err
    return json.loads(out)["config"]


def test_the_file_configures_the_job_and_reports_what_it_ignores(start_daemon):
    d = start_daemon(ranks=2)
    rc, out, err = zerodctl(d, "jobs", "create", "zpp", "--ranks-per-node", "2",
                            "--deepspeed-config", os.path.join(DATA, "zeropp_sgd_static_fp16.json"),
                            "--json")
    assert rc == 0, err
    assert err == ("zerodctl: ignored DeepSpeed keys: communication_data_type, fp16.auto_cast, "
                   "gradient_accumulation_steps, train_micro_batch_size_per_gpu, "
                   "zero_allow_untested_optimizer, zero_optimization.overlap_comm, "
                   "zero_optimization.reduce_bucket_size, "
                   "zero_optimization.stage3_max_live_parameters, "
                   "zero_optimization.stage3_prefetch_bucket_size\n")
    config = json.loads(out)["job"]["config"]
    assert config["optimizer"] == {"kind": "sgd", "lr": 0.05, "beta1": 0.9, "beta2": 0.999,
                                   "eps": 1e-8,
                                   "weight_decay": 0.0001, "has_weight_decay": True,
                                   "momentum": 0.9, "dampening": 0.1, "nesterov": False}
    assert (config["precision"], config["loss_scale"], config["loss_scale_min"],
            config["loss_scale_growth"]) == ("fp16", 1024, 1024, 1)
    assert (config["quantized_weights"], config["quantized_gradients"],
            config["hpz_partition_size"], config["max_grad_norm"]) == (True, 4, 2, 0.5)
    # As the daemon runs it: every default filled in.
    got = config_of(d, "zpp")
    assert got["loss_scale_window"] == 1000 and got["loss_scale_hysteresis"] == 2
    assert got["loss_scale_backoff"] == 0.5 and got["optimizer"]["eps"] == 1e-8


def test_options_given_override_the_file(start_daemon):
    d = start_daemon(ranks=1)
    os.makedirs(os.path.join(str(d.dir), "nvme", "llama-run"))
    rc, _, err = zerodctl(d, "jobs", "create", "lm", "--deepspeed-config",
                          os.path.join(DATA, "zero3_nvme_bf16.json"), "--lr", "0.01",
                          "--precision", "fp32", "--offload-buffer-count", "2",
                          "--max-grad-norm", "0")
    assert rc == 0, err
    assert err.startswith("zerodctl: ignored DeepSpeed keys: gradient_accumulation_steps, ")
    assert err.count("\n") == 1, err
    config = config_of(d, "lm")
    assert config["optimizer"]["lr"] == 0.01 and config["optimizer"]["beta2"] == 0.95
    assert config["precision"] == "fp32" and config["max_grad_norm"] == 0
    assert (config["offload_optimizer"], config["nvme_path"], config["offload_buffer_count"],
            config["offload_pin_memory"]) == ("nvme", "llama-run", 2, True)


def test_a_zero_stage_below_3_is_noted_and_auto_values_are_listed(start_daemon, tmp_path):
    d = start_daemon(ranks=1)
    rc, _, err = zerodctl(d, "jobs", "create", "hf", "--deepspeed-config",
                          os.path.join(DATA, "hf_zero2_fp16_auto.json"))
    assert rc == 0, err
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert "gradient_clipping (auto), optimizer.params.betas (auto)" in lines[0]
    assert lines[1] == ("zerodctl: note: zero_optimization.stage 2: zerod shards parameters, "
                        "gradients and optimizer states alike (as stage 3)")
    config = config_of(d, "hf")
    assert config["optimizer"]["kind"] == "adamw" and config["optimizer"]["lr"] == 0.001
    assert config["loss_scale"] == 4096 and config["loss_scale_window"] == 500
    # A file with nothing zerod ignores says nothing.
    quiet = tmp_path / "quiet.json"
    quiet.write_text('{"bf16": {"enabled": true}, "gradient_clipping": 1.0}')
    rc, _, err = zerodctl(d, "jobs", "create", "quiet", "--deepspeed-config", str(quiet))
    assert rc == 0 and err == "", err
    assert config_of(d, "quiet")["precision"] == "bf16"


def test_a_bad_file_is_a_usage_error(start_daemon, tmp_path):
    d = start_daemon(ranks=1)
    missing = str(tmp_path / "missing.json")
    rc, out, err = zerodctl(d, "jobs", "create", "x", "--deepspeed-config", missing)
    assert (rc, out) == (2, "")
    assert err == ("zerodctl: jobs create: --deepspeed-config '%s': No such file or directory\n"
                   % missing)
    broken = tmp_path / "broken.json"
    broken.write_text('{"optimizer": {"type": "AdamW",\n "params": {"lr": 1e-4,}}}')
    rc, _, err = zerodctl(d, "jobs", "create", "x", "--deepspeed-config", str(broken))
    assert rc == 2 and "': not JSON: " in err and "(line 2)" in err, err
    large = tmp_path / "large.json"
    large.write_text('{"x": "%s"}' % ("a" * (1 << 20)))
    rc, _, err = zerodctl(d, "jobs", "create", "x", "--deepspeed-config", str(large))
    assert rc == 2 and err.endswith("': larger than 1048576 bytes\n"), err
    # Control characters in a key reach the terminal as '?'.
    odd = tmp_path / "odd.json"
    odd.write_text('{"a\\u001b[31m": 1}')
    rc, _, err = zerodctl(d, "jobs", "create", "odd", "--deepspeed-config", str(odd))
    assert rc == 0 and err.startswith("zerodctl: ignored DeepSpeed keys: a?[31m\n"), err
    # The option is jobs create's.
    rc, _, err = zerodctl(d, "jobs", "list", "--deepspeed-config", missing)
    assert rc == 2 and "option '--deepspeed-config' belongs to jobs create" in err, err
    rc, out, _ = zerodctl(d, "jobs", "list", "--json")
    assert [j["name"] for j in json.loads(out)["jobs"]] == ["odd"]
