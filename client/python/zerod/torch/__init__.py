"""zerod.torch: train a torch.nn.Module whose parameters live in zerod.

::

    job = zerod.Client().attach("lm", rank=local_rank, config=zerod.JobConfig(lr=3e-4))
    model = zerod.torch.shard(model, job, units=[Block])
    opt = zerod.torch.Optimizer(model)
    for x, y in data:
        loss = model(x, y)
        loss.backward()            # gradients go to the daemon unit by unit
        model.clip_grad_norm_(1.0)  # optional, applied inside the step
        opt.step()                 # the daemon's AdamW/Adam/SGD step
        opt.zero_grad()

How it works (FSDP's scheme, with the daemon holding the shards):

* :func:`shard` groups the parameters into units (one per module with
  parameters, or per module chosen by `units`), registers every unit with
  the daemon (rank 0's values become everyone's initial values) and
  replaces each parameter's data with a placeholder of its shape that
  takes no memory: one NaN, broadcast (so ``numel()``, ``shape`` and
  parameter counts stay those of the model, as with FSDP2, and reading the
  values outside a forward pass gives NaN, not numbers that look right;
  :meth:`ShardedModule.state_dict` gathers the real ones).
* A forward pre-hook on a unit's module gathers the unit and points its
  parameters at the gathered buffer (shared memory, no copy); the forward
  hook releases it and puts the placeholders back.
* A hook on the module's outputs gathers the unit again when backward
  reaches it. The gathered view always lies at the same address
  (``stable_addresses``), so tensors that autograd saved during the forward
  pass, views of the weights included, read the right values.
* When every parameter of the unit has its gradient, the gradients are
  copied into the unit's gradient buffer and reduced into the daemon's
  accumulators, the parameters' ``.grad`` is cleared and the unit released.

On a job with a base (``JobConfig(base_job=...)``), ``shard(model, job,
base=True)`` takes the frozen parameters from the base (shared, read-only,
never given a gradient) and makes only the trainable ones (LoRA adapters:
:func:`apply_lora` or peft's) the job's units.

Every rank must run the same forward and backward program (the same units
in the same order): gathers and reduces are collectives of the job.
"""

from __future__ import annotations

from ._checkpoint import load, save, state_dict_from
from ._clip import clip_grad_norm_, patch_clip_grad_norm_
from ._follow import follow, load_update
from ._module import ShardedModule, shard
from ._optim import Optimizer
from ._plan import UnitsPolicy, base_name
from .lora import LoRALinear, apply_lora

__all__ = ["follow", "load_update", "shard", "ShardedModule", "Optimizer", "state_dict_from",
           "save", "load", "clip_grad_norm_", "patch_clip_grad_norm_", "UnitsPolicy", "base_name",
           "LoRALinear", "apply_lora"]
