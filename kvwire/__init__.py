"""kvwire: move LLM KV caches between machines over ordinary TCP."""

from kvwire._extensions import extensions
from kvwire.aio import Peer, Receipt, Server, Transfer, connect, serve
from kvwire.errors import (
    AuthenticationError,
    ConnectionLostError,
    ErrorCode,
    FrameTooLargeError,
    IncompatiblePeerError,
    IntegrityError,
    KvwireError,
    LimitExceededError,
    ProtocolError,
    RegistryUnavailableError,
    StaleVersionError,
    TransferAbortedError,
    TransferTimeoutError,
    UnrepresentableValuesError,
    UsageError,
)
from kvwire.spec import KVCache, KVSpec, Layer

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "ConnectionLostError",
    "ErrorCode",
    "FrameTooLargeError",
    "IncompatiblePeerError",
    "IntegrityError",
    "KVCache",
    "KVSpec",
    "KvwireError",
    "Layer",
    "LimitExceededError",
    "Peer",
    "ProtocolError",
    "Receipt",
    "RegistryUnavailableError",
    "Server",
    "StaleVersionError",
    "Transfer",
    "TransferAbortedError",
    "TransferTimeoutError",
    "UnrepresentableValuesError",
    "UsageError",
    "__version__",
    "connect",
    "extensions",
    "serve",
]
