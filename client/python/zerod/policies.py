"""Typed policies for a job's config, as PyTorch users know them from
FSDP2 (``MixedPrecisionPolicy``, ``OffloadPolicy``/``CPUOffloadPolicy``)
and DeepSpeed (``offload_optimizer``)::

    config = zerod.JobConfig(
        lr=3e-4,
        mixed_precision=zerod.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        offload_optimizer=zerod.NVMeOffloadPolicy(nvme_path="lm", buffer_count=4))

The string and dict forms (``dtype="bfloat16"``,
``offload_optimizer={"device": "nvme", ...}``) stay accepted; a dtype may be
a torch dtype, a numpy dtype or its name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

import numpy as np

from .errors import InvalidArgumentError

# The dtypes a job's working copy and gradient exchange can take, by name.
_NAMES = ("float32", "bfloat16", "float16")


def dtype_name(value: Any, field: str) -> str:
    """The name ("float32", "bfloat16", "float16") of a dtype given as that
    name, a torch dtype (``torch.bfloat16``) or a numpy dtype; an
    InvalidArgumentError naming `field` otherwise."""
    if isinstance(value, str):
        name = value
    elif type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        name = str(value)[len("torch."):]  # torch.bfloat16 -> "bfloat16"
    else:
        try:
            name = np.dtype(value).name
        except TypeError:
            name = ""
    if name not in _NAMES:
        raise InvalidArgumentError("%s must be float32, bfloat16 or float16 (a name, a torch "
                                   "dtype or a numpy dtype), not %r" % (field, value))
    return name


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision, for a job: ``param_dtype`` is the working
    copy the workers gather and compute in (the daemon keeps the fp32
    master weights and moments either way; float16 turns on dynamic loss
    scaling); ``reduce_dtype`` is what the gradients' partial sums cross
    nodes in (float32, the default, or bfloat16). None: the job's default
    (float32)."""

    param_dtype: Optional[Any] = None
    reduce_dtype: Optional[Any] = None


@dataclass(frozen=True)
class OffloadPolicy:
    """Where a job's optimizer state lives (DeepSpeed's
    ``offload_optimizer``): ``device`` "none" (the rank's memory), "cpu"
    (host memory: a GPU rank steps on the CPU) or "nvme" (a file per rank
    under the daemon's ``--nvme-dir``, ``nvme_path`` inside it), streamed
    through ``buffer_count`` buffers (0: 4) of ``buffer_size`` elements (0:
    1048576), page-locked with ``pin_memory``."""

    device: str = "none"
    nvme_path: str = ""
    buffer_count: int = 0
    buffer_size: int = 0
    pin_memory: bool = False

    def as_dict(self) -> Dict[str, Any]:
        """The dict form JobConfig.offload_optimizer also takes."""
        return asdict(self)


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """FSDP2's CPUOffloadPolicy: the optimizer state in host memory, the
    staging buffers page-locked (``pin_memory``, True as in FSDP2)."""

    device: str = "cpu"
    pin_memory: bool = True


@dataclass(frozen=True)
class NVMeOffloadPolicy(OffloadPolicy):
    """ZeRO-Infinity's tier: the optimizer state in a file per rank under
    the daemon's ``--nvme-dir`` (``nvme_path``: a directory inside it)."""

    device: str = "nvme"
