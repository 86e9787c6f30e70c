#!/usr/bin/env python3
"""zerod's fused CPU AdamW against DeepSpeed's CPUAdam, in the same run.

Both optimizers step the same flat fp32 arrays (param, exp_avg, exp_avg_sq,
grad; by default 22,369,621 parameters, the 256 MiB of p+m+v that
bench/bench_kernels.c uses) with the same hyper-parameters (AdamW, lr 1e-3,
betas 0.9/0.999, eps 1e-8, weight decay 0.01, bias correction):

  zerod      zk_adam_step from build/release/lib/libzerod_kernels.so through
             ctypes, on a zk_pool of N threads (zk_pool_create, as
             bench_kernels does), writing the bf16 working copy in the same
             pass (30 bytes of memory traffic per parameter);
  deepspeed  the lowest-level call of the JIT-built cpu_adam op,
             ds_opt_adam.adam_update on the flat tensors (what
             DeepSpeedCPUAdam.step calls per parameter), on N OpenMP threads
             (OMP_NUM_THREADS and torch.set_num_threads; OMP_WAIT_POLICY
             passive, or idle OpenMP threads spin into zerod's next call and
             slow its 2-thread step by a third). Where the op has
             adam_update_copy (older DeepSpeed) and it accepts a CPU bf16 or
             fp16 tensor, that call is timed instead, so that DeepSpeed
             writes the half-precision copy too ("deepspeed_copy").

The baseline of the target (ratio >= 1.0) is DeepSpeed with its copy:
without a copy in DeepSpeed's call (0.19 has none), its step followed by
the separate cast that ZeRO-Offload does after it
(bf16_params.copy_(fp32_params)), timed in the same loop. A second line
(`..._without_copy`, no target) compares with DeepSpeed's step alone, which
writes 2 bytes per parameter fewer.

Before timing, both take one step (step 1) from identical random inputs and
the largest absolute difference of the fp32 parameters is reported
("max_abs_diff"): the two compute the same update, in float, in a different
order of operations. Timings alternate zerod, deepspeed, ... on the same
buffers after one warm-up step each; each figure is the median of --reps.

Prints one JSON line per thread count, or one "skipped" line (exit 0) where
DeepSpeed cannot be imported or its op cannot be built.

    .venv-torch2/bin/python bench/bench_cpuadam.py [--numel N] [--reps N]
"""

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_LIB = os.path.join(HERE, "..", "build", "release", "lib", "libzerod_kernels.so")
BENCH = "adamw_vs_deepspeed_cpuadam"
LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
ZK_F32, ZK_BF16 = 0, 1


class AdamHparams(ctypes.Structure):
    """zk_adam_hparams (kernels/zk.h)."""

    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double),
                ("beta2", ctypes.c_double), ("eps", ctypes.c_double),
                ("weight_decay", ctypes.c_double), ("decoupled_weight_decay", ctypes.c_int),
                ("step", ctypes.c_int64), ("grad_scale", ctypes.c_double),
                ("v_frozen_at", ctypes.c_int64)]


def emit(record):
    print(json.dumps(record), flush=True)


def load_zerod(path):
    lib = ctypes.CDLL(path)
    lib.zk_pool_create.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
    lib.zk_pool_destroy.argtypes = [ctypes.c_void_p]
    lib.zk_adam_step.argtypes = [ctypes.c_void_p, ctypes.POINTER(AdamHparams)] + [
        ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return lib


def zerod_step(lib, pool, step, p, m, v, g, w):
    hp = AdamHparams(LR, BETA1, BETA2, EPS, WD, 1, step, 1.0)
    rc = lib.zk_adam_step(pool, ctypes.byref(hp), p.data_ptr(), m.data_ptr(), v.data_ptr(),
                          g.data_ptr(), ZK_F32, w.data_ptr(), ZK_BF16, p.numel())
    if rc != 0:
        raise OSError(-rc, "zk_adam_step failed")


def load_deepspeed():
    """(version, op module, seconds to build or load it), or a reason string.

    DeepSpeed's logger writes to the sys.stdout it finds at import: point
    that at stderr, so that stdout carries only the JSON lines."""
    with contextlib.redirect_stdout(sys.stderr):
        try:
            import deepspeed
            from deepspeed.ops.op_builder import CPUAdamBuilder
        except Exception as exc:  # any import failure means no comparison
            return f"cannot import deepspeed: {type(exc).__name__}: {exc}"
        t0 = time.perf_counter()
        try:
            op = CPUAdamBuilder().load(verbose=False)
        except Exception as exc:
            return f"deepspeed {deepspeed.__version__}: cpu_adam op did not build: {exc}"
        return deepspeed.__version__, op, time.perf_counter() - t0


def find_copy(torch, op, opt_id):
    """The dtype DeepSpeed's adam_update_copy writes on CPU, or None."""
    if not hasattr(op, "adam_update_copy"):
        return None
    for dtype in (torch.bfloat16, torch.float16):
        p, g, m, v = (torch.zeros(64) for _ in range(4))
        try:
            op.adam_update_copy(opt_id, 1, LR, BETA1, BETA2, EPS, WD, True, p, g, m, v,
                                torch.zeros(64, dtype=dtype))
            return dtype
        except Exception:  # CUDA-only in the versions that have it
            continue
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=256 * 1024 * 1024 // 12)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    # Read by the OpenMP runtime when it starts: set before torch loads it.
    # Idle OpenMP threads otherwise spin after each of DeepSpeed's parallel
    # loops and take the CPU from zerod's pool in the next call.
    os.environ["OMP_NUM_THREADS"] = str(max(threads))
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")

    loaded = load_deepspeed()
    if isinstance(loaded, str):
        emit({"bench": BENCH, "skipped": loaded})
        return 0
    version, op, load_s = loaded
    import torch

    lib = load_zerod(os.environ.get("ZEROD_KERNELS_LIB", DEFAULT_LIB))
    opt_id = 1
    op.create_adam(opt_id, LR, BETA1, BETA2, EPS, WD, True, False)
    copy_dtype = find_copy(torch, op, opt_id)
    copy_name = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "none"}[copy_dtype]

    # Same computation: one step from identical random inputs.
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen) * 0.1
    g = torch.randn(n, generator=gen) * 1e-3
    m = torch.randn(n, generator=gen) * 1e-4
    v = torch.rand(n, generator=gen) * 1e-6
    w = torch.empty(n, dtype=torch.bfloat16)
    half = torch.empty(n, dtype=copy_dtype or torch.bfloat16)
    dp, dm, dv = p.clone(), m.clone(), v.clone()
    pool = ctypes.c_void_p()
    if lib.zk_pool_create(max(threads), ctypes.byref(pool)) != 0:
        raise OSError("zk_pool_create failed")
    zerod_step(lib, pool, 1, p, m, v, g, w)
    lib.zk_pool_destroy(pool)
    torch.set_num_threads(max(threads))

    def ds_step(step, dp, dm, dv):
        if copy_dtype is None:
            op.adam_update(opt_id, step, LR, BETA1, BETA2, EPS, WD, True, dp, g, dm, dv)
        else:
            op.adam_update_copy(opt_id, step, LR, BETA1, BETA2, EPS, WD, True, dp, g, dm, dv,
                                half)

    ds_step(1, dp, dm, dv)
    max_abs_diff = (p - dp).abs().max().item()
    del dp, dm, dv

    # Timing: both on the same buffers, alternating.
    step = {"zerod": 1, "ds": 1}
    for nthreads in threads:
        torch.set_num_threads(nthreads)
        pool = ctypes.c_void_p()
        if lib.zk_pool_create(nthreads, ctypes.byref(pool)) != 0:
            raise OSError("zk_pool_create failed")

        def run_zerod():
            step["zerod"] += 1
            zerod_step(lib, pool, step["zerod"], p, m, v, g, w)

        def run_ds():
            step["ds"] += 1
            ds_step(step["ds"], p, m, v)

        def run_ds_copy():
            run_ds()
            half.copy_(p)

        ops = [run_zerod, run_ds] + ([run_ds_copy] if copy_dtype is None else [])
        times = [[] for _ in ops]
        for fn in ops:  # warm-up
            fn()
        for _ in range(args.reps):
            for fn, t in zip(ops, times):
                t0 = time.perf_counter()
                fn()
                t.append(time.perf_counter() - t0)
        lib.zk_pool_destroy(pool)
        zerod_s, ds_s = statistics.median(times[0]), statistics.median(times[1])
        # The target's baseline is DeepSpeed with its copy: in the call where
        # the op has one, else its step followed by the cast ZeRO-Offload does.
        with_copy_s = ds_s if copy_dtype is not None else statistics.median(times[2])
        common = {"threads": nthreads, "numel": n, "zerod_s": round(zerod_s, 5),
                  "deepspeed_version": version, "deepspeed_copy": copy_name,
                  "deepspeed_call": "adam_update" if copy_dtype is None else "adam_update_copy",
                  "max_abs_diff": max_abs_diff, "deepspeed_op_load_s": round(load_s, 1),
                  "reps": args.reps}
        emit(dict({"bench": BENCH, "deepspeed_with_copy_s": round(with_copy_s, 5),
                   "ratio": round(with_copy_s / zerod_s, 3), "target": 1.0, "direction": "min",
                   "met": with_copy_s / zerod_s >= 1.0}, **common))
        if copy_dtype is None:
            # DeepSpeed's step alone writes 2 bytes per parameter fewer than
            # zerod's: no target, the figure says what the copy costs.
            emit(dict({"bench": BENCH + "_without_copy", "deepspeed_s": round(ds_s, 5),
                       "ratio": round(ds_s / zerod_s, 3)}, **common))
    op.destroy_adam(opt_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
