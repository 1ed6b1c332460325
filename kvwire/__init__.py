"""kvwire: move LLM KV caches between machines over ordinary TCP."""

from kvwire.errors import (
    AuthenticationError,
    ConnectionLostError,
    ErrorCode,
    IncompatiblePeerError,
    KvwireError,
    LimitExceededError,
    ProtocolError,
    StaleVersionError,
    TransferAbortedError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.spec import KVCache, KVSpec, Layer

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "ConnectionLostError",
    "ErrorCode",
    "IncompatiblePeerError",
    "KVCache",
    "KVSpec",
    "KvwireError",
    "Layer",
    "LimitExceededError",
    "ProtocolError",
    "StaleVersionError",
    "TransferAbortedError",
    "TransferTimeoutError",
    "UsageError",
    "__version__",
]
