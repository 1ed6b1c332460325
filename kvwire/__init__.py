"""kvwire: move LLM KV caches between machines over ordinary TCP."""

from kvwire.errors import (
    AuthenticationError,
    ConnectionLostError,
    ErrorCode,
    IncompatiblePeerError,
    KvwireError,
    LimitExceededError,
    ProtocolError,
    RegistryUnavailableError,
    StaleVersionError,
    TransferAbortedError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.spec import KVCache, KVSpec, Layer
from kvwire.aio import Peer, Receipt, Server, Transfer, connect, serve

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
    "Peer",
    "Receipt",
    "Server",
    "Transfer",
    "connect",
    "serve",
    "LimitExceededError",
    "ProtocolError",
    "RegistryUnavailableError",
    "StaleVersionError",
    "TransferAbortedError",
    "TransferTimeoutError",
    "UsageError",
    "__version__",
]
