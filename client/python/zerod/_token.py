"""The owner token an attach sends: the caller's, else ``$ZEROD_TOKEN``.

Kubernetes hands a worker its job's owner token in ``ZEROD_TOKEN``
(deploy/examples/train-job.yaml); ``Client.attach(token=None)`` uses it, as
libzerod's ``zd_attach`` does for a NULL token. A token given wins, ``""``
included (no token, whatever the environment says).
"""

from __future__ import annotations

import os
from typing import Optional

ENV = "ZEROD_TOKEN"


def resolve(token: Optional[str]) -> Optional[str]:
    """`token`, or ``$ZEROD_TOKEN`` when it is None (None when unset)."""
    return token if token is not None else os.environ.get(ENV)


def encode(token: Optional[str]) -> bytes:
    """The resolved token as the C string zd_attach gets: never NULL, so
    that the library does not look at the environment again."""
    resolved = resolve(token)
    return resolved.encode() if resolved else b""
