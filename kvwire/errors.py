"""The exceptions a kvwire user catches.

Every error raised through the public API derives from :class:`KvwireError`.  Errors
that travel on the wire carry an :class:`~kvwire.wire.ErrorCode`, so the peer that
caused a failure and the peer that saw it raise the same class.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TypeVar


class ErrorCode(IntEnum):
    """Wire error codes (u16), carried by GOAWAY and RESET frames. See docs/protocol.md."""

    NO_ERROR = 0x0000
    PROTOCOL_ERROR = 0x0001
    INTEGRITY_ERROR = 0x0002
    FRAME_TOO_LARGE = 0x0003
    AUTHENTICATION_FAILED = 0x0004
    UNSUPPORTED_VERSION = 0x0005
    INCOMPATIBLE_SPEC = 0x0006
    UNSUPPORTED_CODEC = 0x0007
    FLOW_CONTROL_ERROR = 0x0008
    STALE_VERSION = 0x0009
    TIMEOUT = 0x000A
    LIMIT_EXCEEDED = 0x000B
    CANCELLED = 0x000C
    INTERNAL_ERROR = 0x000D
    UNKNOWN_SESSION = 0x000E
    DUPLICATE_TRANSFER = 0x000F
    SESSION_LOST = 0x0010
    REGISTRY_UNAVAILABLE = 0x0011


class KvwireError(Exception):
    """Root of every error kvwire raises."""

    code: ErrorCode = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str = "", *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class ProtocolError(KvwireError):
    """The peer broke the protocol (malformed frame, bad CRC, unexpected frame)."""

    code = ErrorCode.PROTOCOL_ERROR


class FrameTooLargeError(ProtocolError):
    """A frame header announced more bytes than the negotiated maximum."""

    code = ErrorCode.FRAME_TOO_LARGE


class IntegrityError(ProtocolError):
    """A frame's CRC32C did not match its bytes."""

    code = ErrorCode.INTEGRITY_ERROR


class AuthenticationError(KvwireError):
    """The shared-secret handshake failed (wrong secret, replay, or forged proof)."""

    code = ErrorCode.AUTHENTICATION_FAILED


class IncompatiblePeerError(KvwireError):
    """The peers cannot talk: protocol version, KV layout, or codec mismatch."""

    code = ErrorCode.INCOMPATIBLE_SPEC


class StaleVersionError(KvwireError):
    """A prefix block's version is older than the one the registry holds."""

    code = ErrorCode.STALE_VERSION


class TransferTimeoutError(KvwireError, TimeoutError):
    """A deadline passed: handshake, idle stream, transfer, or an ``expect()`` wait.

    Also a :class:`TimeoutError`, so ``except TimeoutError`` catches it.
    """

    code = ErrorCode.TIMEOUT


class ConnectionLostError(KvwireError, ConnectionError):
    """The connection closed or broke before the operation finished.

    Also a :class:`ConnectionError`, so ``except ConnectionError`` catches it.
    """

    code = ErrorCode.NO_ERROR


class LimitExceededError(KvwireError):
    """A configured limit (transfers, peers, buffered bytes) would be exceeded."""

    code = ErrorCode.LIMIT_EXCEEDED


class TransferAbortedError(KvwireError):
    """The transfer was aborted: the sender's producer failed or it cancelled, or the
    receiving application gave up on it (``transfer.abort()``, leaving ``async for``,
    a timed-out ``collect()``)."""

    code = ErrorCode.CANCELLED


class RegistryUnavailableError(KvwireError):
    """The prefix registry could not be reached or answered with an error.

    The registry fails closed: nothing is reported fresh unless the registry confirmed
    it, so callers must treat this error as "unverified, do not use".
    """

    code = ErrorCode.REGISTRY_UNAVAILABLE


class UsageError(KvwireError, ValueError):
    """Local misuse of the API (bad arguments); never caused by the peer."""

    code = ErrorCode.INTERNAL_ERROR


class UnrepresentableValuesError(UsageError):
    """The values of a tensor cannot be carried by the named codec; ``raw`` carries them.

    Raised by the quantizers (``fp8``, ``int8``, ``int4``, with or without an entropy
    stage; numpy, compiled and GPU paths alike) for NaN or infinity, and by ``int4`` for a
    group whose value range exceeds float32.  A :class:`UsageError`, so ``except
    UsageError`` catches it too; ``codec="auto"`` catches exactly this class and sends
    such a chunk ``raw`` (docs/codecs.md).
    """


_BY_CODE: dict[ErrorCode, type[KvwireError]] = {
    ErrorCode.PROTOCOL_ERROR: ProtocolError,
    ErrorCode.INTEGRITY_ERROR: IntegrityError,
    ErrorCode.FRAME_TOO_LARGE: FrameTooLargeError,
    ErrorCode.AUTHENTICATION_FAILED: AuthenticationError,
    ErrorCode.UNSUPPORTED_VERSION: IncompatiblePeerError,
    ErrorCode.INCOMPATIBLE_SPEC: IncompatiblePeerError,
    ErrorCode.UNSUPPORTED_CODEC: IncompatiblePeerError,
    ErrorCode.FLOW_CONTROL_ERROR: ProtocolError,
    ErrorCode.STALE_VERSION: StaleVersionError,
    ErrorCode.TIMEOUT: TransferTimeoutError,
    ErrorCode.LIMIT_EXCEEDED: LimitExceededError,
    ErrorCode.CANCELLED: TransferAbortedError,
    ErrorCode.INTERNAL_ERROR: KvwireError,
    ErrorCode.UNKNOWN_SESSION: ConnectionLostError,
    ErrorCode.DUPLICATE_TRANSFER: ProtocolError,
    ErrorCode.SESSION_LOST: ConnectionLostError,
    ErrorCode.REGISTRY_UNAVAILABLE: RegistryUnavailableError,
}


_E = TypeVar("_E", bound=BaseException)


def detached(error: _E) -> _E:
    """``error`` as something to keep, or to raise again: without the traceback, context
    and cause raising it attached, whose frames would keep their locals alive (a chunk's
    payload, a layer's buffer, a caller's arrays) for as long as the error is kept.  An
    error raised again and again (a transfer's or a broken peer's, at every call) would
    otherwise gather every caller's frames: raise ``detached(err)``.  It changes ``error``
    itself: its cause and context are gone for every holder, so it is meant for errors
    whose text already says what happened (kvwire's own)."""
    error.__traceback__ = error.__context__ = error.__cause__ = None
    return error


def error_from_code(code: int, message: str) -> KvwireError:
    """The exception a wire error code stands for (unknown codes -> ProtocolError).

    Both peers build their errors through this table, so the side that raised an error
    and the side that received its code raise the same class.
    """
    try:
        ecode = ErrorCode(code)
    except ValueError:
        return ProtocolError(f"peer error 0x{code:04x}: {message}", code=ErrorCode.PROTOCOL_ERROR)
    cls = _BY_CODE.get(ecode, KvwireError)
    return cls(message or f"{ecode.name} (no message given)", code=ecode)
