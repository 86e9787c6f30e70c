"""How an attach treats the job (create it, resume it, refuse it), what it
says about it, and the detach at a clean exit.

- ``create=True`` creates a missing job and resumes one that exists;
  ``create=False`` attaches only to a job that exists (a typo is
  :class:`zerod.NotFoundError`); ``create="fresh"`` creates it, or joins it
  while none of its steps is done (its other ranks attaching), and refuses
  one that has trained (:class:`zerod.FailedPreconditionError`).
- A job an attach creates on a standalone daemon gets the launcher's
  ``WORLD_SIZE`` ranks (``world_size=`` overrides; neither: the daemon's
  ``--ranks``), at most the daemon's ``--max-ranks``.
- Local rank 0 says on stderr which step the job starts or resumes at
  (``ZEROD_QUIET=1`` silences it).
- Clients still open when the interpreter exits are closed (their jobs
  detached) first, so a script that ends normally is not a "worker lost".
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from typing import Any, Optional, Union

from .errors import InvalidArgumentError

ATTACH_EXISTING, CREATE_OR_RESUME, CREATE_FRESH = 0, 1, 2


def create_mode(create: Union[bool, str], read_only: bool) -> int:
    """libzerod's zd_attach_options.create for `create`."""
    if read_only or create is False:
        return ATTACH_EXISTING
    if create is True:
        return CREATE_OR_RESUME
    if create == "fresh":
        return CREATE_FRESH
    raise InvalidArgumentError("create must be True, False or 'fresh', got %r" % (create,))


def world_size_to_ask(world_size: Optional[int], launcher_world_size: Optional[int]) -> int:
    """The ranks a creating attach asks for; 0 leaves it to the daemon."""
    if world_size is not None:
        if int(world_size) < 1:
            raise InvalidArgumentError("world_size must be at least 1, got %r" % (world_size,))
        return int(world_size)
    return launcher_world_size or 0


def announce(job: Any, local_rank: int, read_only: bool) -> None:
    """Local rank 0's one line about where the job starts."""
    if read_only or local_rank != 0 or os.environ.get("ZEROD_QUIET", "") not in ("", "0"):
        return
    step = int(job.version)
    if step == 0:
        line = "zerod: job %s: starting at step 0 (%d ranks)" % (job.name, job.world_size)
    else:
        line = ("zerod: job %s exists: resuming it at step %d (%d ranks); create='fresh' refuses "
                "a trained job, zerodctl jobs delete %s starts over"
                % (job.name, step, job.world_size, job.name))
    print(line, file=sys.stderr, flush=True)


_OPEN: "weakref.WeakSet[Any]" = weakref.WeakSet()


def track(client: Any) -> None:
    """Closes `client` at interpreter exit if it is still open."""
    _OPEN.add(client)


@atexit.register
def _close_open_clients() -> None:
    for client in list(_OPEN):
        try:
            client.close()
        except Exception:  # noqa: BLE001 - exiting anyway; the daemon notices the socket
            pass


__all__ = ["create_mode", "world_size_to_ask", "announce", "track", "ATTACH_EXISTING",
           "CREATE_OR_RESUME", "CREATE_FRESH"]
