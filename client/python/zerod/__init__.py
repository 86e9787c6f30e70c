"""zerod: train through a zerod daemon from Python.

The daemon (one per node) owns the sharded parameters and optimizer state;
this package attaches to it through libzerod::

    import zerod
    client = zerod.Client()                      # $ZEROD_SOCKET, else the local daemon
    job = client.attach("lm", rank=0, config=zerod.JobConfig(lr=3e-4))
    unit = job.register("layer0", [("w", (4, 8)), ("b", (8,))], values=[w, b])
    with unit.gather() as g:                     # zero-copy views of shared memory
        w = g.arrays()["w"]
    ...

For PyTorch modules see :mod:`zerod.torch`.
"""

from .client import (Buffer, CheckpointInfo, Client, Gathered, Job, JobConfig, StepResult, TensorInfo, Unit,
                     default_socket)
from .errors import (AbortedError, AlreadyExistsError, Error, FailedPreconditionError,
                     InternalError, InvalidArgumentError, NoMemoryError, NotFoundError,
                     PermissionDeniedError, ProtocolError, ResourceExhaustedError, ShardingError,
                     UnavailableError)
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, NVMeOffloadPolicy, OffloadPolicy
from ._subscribe import Delta, Subscription, Update

__version__ = "0.1.0"

__all__ = [
    "AbortedError", "AlreadyExistsError", "Buffer", "CheckpointInfo", "Client", "CPUOffloadPolicy",
    "Error", "FailedPreconditionError", "MixedPrecisionPolicy", "NVMeOffloadPolicy", "OffloadPolicy",
    "Gathered", "InternalError", "InvalidArgumentError", "Job", "JobConfig", "NoMemoryError",
    "NotFoundError", "PermissionDeniedError", "ProtocolError", "ResourceExhaustedError",
    "ShardingError", "StepResult", "Subscription", "TensorInfo", "UnavailableError", "Unit",
    "Update", "Delta", "default_socket",
]
