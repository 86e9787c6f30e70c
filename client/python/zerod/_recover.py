"""Attaching again to a job rebuilt under its worker (docs/redundancy.md):
the retry loop behind Client.reattach and Job.recover."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .errors import AbortedError, Error, IOError_, NotFoundError, UnavailableError

if TYPE_CHECKING:
    from .client import Client, Job

# What the daemon answers while a job is being recovered or rebuilt: the
# attach is tried again.
RETRYABLE = (UnavailableError, NotFoundError, AbortedError, IOError_)


def reattach(client: "Client", job: "Job", timeout_s: float) -> "Job":
    """Detaches `job`, then attaches to it again as it was attached until
    `timeout_s`, with a fresh connection between tries (the old one may
    have gone with the job: a daemon restart)."""
    try:
        job.detach()
    except Error:
        pass
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client._handle is None:
                client._connect()
            return client.attach(job.name, create=False, **job._attach_args)
        except RETRYABLE:
            if time.monotonic() >= deadline:
                raise
        client.close()
        time.sleep(0.1)
