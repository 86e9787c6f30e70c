"""Exceptions raised by the zerod package.

Every failed call of libzerod raises a subclass of :class:`Error` that
carries the library's status code and the detailed message, which is
usually the daemon's own (``zd_last_error``).
"""

from __future__ import annotations

from typing import Dict, Type


class Error(Exception):
    """A zerod call failed. ``status`` is the libzerod status (negative),
    ``code`` its name (``"NOT_FOUND"``), ``message`` the detail."""

    code = "ERROR"

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class InvalidArgumentError(Error, ValueError):
    code = "INVALID_ARGUMENT"


class NotFoundError(Error, LookupError):
    code = "NOT_FOUND"


class AlreadyExistsError(Error):
    code = "ALREADY_EXISTS"


class FailedPreconditionError(Error):
    code = "FAILED_PRECONDITION"


class ResourceExhaustedError(Error):
    code = "RESOURCE_EXHAUSTED"


class PermissionDeniedError(Error, PermissionError):
    code = "PERMISSION_DENIED"


class UnavailableError(Error, ConnectionError):
    """The daemon is not running, has gone away, or is shutting down."""

    code = "UNAVAILABLE"


class InternalError(Error):
    code = "INTERNAL"


class AbortedError(Error):
    """The job failed (for example a peer rank died or timed out)."""

    code = "ABORTED"


class ProtocolError(Error):
    code = "PROTOCOL"


class NoMemoryError(Error, MemoryError):
    code = "NOMEM"


class IOError_(Error, OSError):
    code = "IO"


class ShardingError(Error):
    """zerod.torch cannot shard or use a module as asked."""

    code = "SHARDING"


BY_STATUS: Dict[int, Type[Error]] = {
    -1: InvalidArgumentError,
    -2: NotFoundError,
    -3: AlreadyExistsError,
    -4: FailedPreconditionError,
    -5: ResourceExhaustedError,
    -6: PermissionDeniedError,
    -7: UnavailableError,
    -8: InternalError,
    -9: AbortedError,
    -10: ProtocolError,
    -11: NoMemoryError,
    -12: IOError_,
}
