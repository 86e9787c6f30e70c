"""The CPU optimizer kernels against torch.optim, an implementation nobody
here wrote.

Each case starts ours and torch's from the same fp32 weights, feeds both
the same fp32 gradients for 50 steps, and compares the weights and the
optimizer state after every step. Both round every operation to fp32, so
they may differ by the last bit where the two evaluate an expression in a
different order or fuse a multiply-add; the criterion is the issue's:
maximum relative difference <= 1e-6, where the relative difference of an
element is |ours - torch| / max(|torch|, FLOOR) and FLOOR = 1e-3 keeps
elements that pass through zero from dividing by nothing (the weights are
N(0, 1), so the floor only matters for a handful of elements).

That criterion is torch 1.13's, whose formulas the kernels follow (and
match bit for bit). torch 2.x writes Adam's first moment as a lerp and its
AVX-512 sqrt is not correctly rounded (0.75 ulp), so against it the bounds
are the measured drift with a margin: moments 5e-6 (measured 2.7e-6),
weights 2e-5 (1.07e-5), and the fused bf16 working copy is checked against
our own weights (docs/kernels.md).
"""
import zlib

import numpy as np
import pytest
import torch

import zk_ctypes as zk

STEPS = 50
NUMEL = 100_003  # odd, and above the size at which the kernels use both threads
TORCH_1 = int(torch.__version__.split(".")[0]) < 2
TOLERANCE = 1e-6 if TORCH_1 else 5e-6     # the moments (and everything under torch 1.x)
PARAM_TOLERANCE = 1e-6 if TORCH_1 else 2e-5
FLOOR = 1e-3


@pytest.fixture(scope="module")
def kernels():
    k = zk.Kernels(threads=2)
    yield k
    k.close()


def max_rel_diff(ours, theirs):
    ours = np.asarray(ours, dtype=np.float64)
    theirs = np.asarray(theirs, dtype=np.float64)
    return float(np.max(np.abs(ours - theirs) / np.maximum(np.abs(theirs), FLOOR), initial=0.0))


def torch_bf16_bits(t):
    return t.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def run_parity(make_torch_opt, our_step, state_names, seed, grad_dtype=zk.F32, grad_std=1e-2):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(NUMEL).astype(np.float32)
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = make_torch_opt([tp])
    ours = {"param": p0.copy()}
    for name in state_names:
        ours[name] = np.zeros(NUMEL, dtype=np.float32)
    working = np.empty(NUMEL, dtype=np.uint16)
    worst = {name: 0.0 for name in ["param"] + state_names}
    for step in range(1, STEPS + 1):
        g = (rng.standard_normal(NUMEL) * grad_std).astype(np.float32)
        if grad_dtype == zk.BF16:
            g_tensor = torch.from_numpy(g).to(torch.bfloat16)
            our_grad = g_tensor.view(torch.int16).numpy().view(np.uint16).copy()
            tp.grad = g_tensor.float()
        else:
            our_grad = g
            tp.grad = torch.from_numpy(g.copy())
        opt.step()
        our_step(step, ours, our_grad, grad_dtype, working)
        torch_state = opt.state[tp]
        diffs = {"param": max_rel_diff(ours["param"], tp.detach().numpy())}
        for name in state_names:
            diffs[name] = max_rel_diff(ours[name], torch_state[name].numpy())
        for name, d in diffs.items():
            worst[name] = max(worst[name], d)
            bound = PARAM_TOLERANCE if name == "param" else TOLERANCE
            assert d <= bound, f"step {step}: {name} differs from torch by {d:.3g} (relative)"
        # The fused working copy is torch's own fp32 -> bf16 conversion of the
        # weights (of ours where torch's own may differ in the last bit).
        np.testing.assert_array_equal(
            working, torch_bf16_bits(tp if TORCH_1 else torch.from_numpy(ours["param"])))
    print(f"worst relative differences over {STEPS} steps: " +
          ", ".join(f"{k}={v:.3g}" for k, v in worst.items()))
    return worst


ADAM_CASES = [
    # (name, torch class, kwargs, decoupled)
    ("adamw_default", torch.optim.AdamW, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                             weight_decay=1e-2), 1),
    ("adamw_llm", torch.optim.AdamW, dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                         weight_decay=0.1), 1),
    ("adam_l2", torch.optim.Adam, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                      weight_decay=1e-2), 0),
    ("adam_plain", torch.optim.Adam, dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-6,
                                         weight_decay=0.0), 0),
]


@pytest.mark.parametrize("grad_dtype", [zk.F32, zk.BF16], ids=["grad_f32", "grad_bf16"])
@pytest.mark.parametrize("name,cls,kwargs,decoupled", ADAM_CASES, ids=[c[0] for c in ADAM_CASES])
def test_adam_family_matches_torch(kernels, name, cls, kwargs, decoupled, grad_dtype):
    def our_step(step, s, grad, gdt, working):
        hp = zk.AdamHparams(lr=kwargs["lr"], beta1=kwargs["betas"][0], beta2=kwargs["betas"][1],
                            eps=kwargs["eps"], weight_decay=kwargs["weight_decay"],
                            decoupled_weight_decay=decoupled, step=step, grad_scale=1.0)
        kernels.adam_step(hp, s["param"], s["exp_avg"], s["exp_avg_sq"], grad, gdt, working,
                          zk.BF16)

    run_parity(lambda params: cls(params, **kwargs), our_step, ["exp_avg", "exp_avg_sq"],
               seed=zlib.crc32(name.encode()), grad_dtype=grad_dtype)


SGD_CASES = [
    ("sgd_plain_wd", dict(lr=0.01, momentum=0.0, dampening=0.0, weight_decay=1e-4,
                          nesterov=False)),
    ("sgd_momentum", dict(lr=0.01, momentum=0.9, dampening=0.0, weight_decay=0.0,
                          nesterov=False)),
    ("sgd_dampening", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=5e-4,
                           nesterov=False)),
    ("sgd_nesterov", dict(lr=0.01, momentum=0.9, dampening=0.0, weight_decay=1e-4,
                          nesterov=True)),
]


@pytest.mark.parametrize("name,kwargs", SGD_CASES, ids=[c[0] for c in SGD_CASES])
def test_sgd_matches_torch(kernels, name, kwargs):
    has_momentum = kwargs["momentum"] != 0

    def our_step(step, s, grad, gdt, working):
        hp = zk.SgdHparams(lr=kwargs["lr"], momentum=kwargs["momentum"],
                           dampening=kwargs["dampening"], weight_decay=kwargs["weight_decay"],
                           nesterov=int(kwargs["nesterov"]), step=step, grad_scale=1.0)
        kernels.sgd_step(hp, s["param"], s["momentum_buffer"] if has_momentum else None, grad,
                         gdt, working, zk.BF16)

    run_parity(lambda params: torch.optim.SGD(params, **kwargs), our_step,
               ["momentum_buffer"] if has_momentum else [], seed=zlib.crc32(name.encode()),
               grad_std=1e-1)


def test_loss_scale_removal_matches_torch_unscale(kernels):
    """grad_scale fuses GradScaler's unscale (grad * (1/scale), rounded to
    fp32) into the step; the result must equal unscaling first."""
    scale = 65536.0

    def our_step(step, s, grad, gdt, working):
        hp = zk.AdamHparams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                            decoupled_weight_decay=1, step=step, grad_scale=1.0 / scale)
        scaled = (grad * np.float32(scale)).astype(np.float32)
        kernels.adam_step(hp, s["param"], s["exp_avg"], s["exp_avg_sq"], scaled, gdt, working,
                          zk.BF16)

    run_parity(lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2), our_step,
               ["exp_avg", "exp_avg_sq"], seed=7)
