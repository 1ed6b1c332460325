"""Versioned prefix-block registry: which KV blocks are complete, in flight, or stale.

The sans-IO core (:class:`RegistryCore`) holds the rules; the backends with one async
interface (:class:`Registry`) live in ``kvwire.aio``: ``MemoryRegistry`` (embedded, one
process) and ``RedisRegistry`` (several processes/machines sharing one Redis). They are
re-exported here lazily, so the core modules import neither asyncio nor ``kvwire.aio``
themselves and redis-py is loaded only once ``RedisRegistry`` is named (importing this
package still runs ``kvwire/__init__.py``, which imports ``kvwire.aio``).  ``__all__`` (and
so ``from kvwire.consistency import *`` and ``dir()``) names ``RedisRegistry`` only where
redis-py is installed; without it, naming ``RedisRegistry`` raises ImportError saying how
to install it. See docs/consistency.md.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from kvwire.consistency.blocks import BlockId, BlockLike, block_from_key, block_key, canonical
from kvwire.consistency.core import BlockState, Lease, RegistryCore, VersionedBlock
from kvwire.consistency.errors import (
    LeaseExpiredError,
    NotificationsLostError,
    RegistryUnavailableError,
)
from kvwire.consistency.registry import DEFAULT_TTL, Registry, Watcher

# Resolved on first access (PEP 562) so this package has no static import of kvwire.aio.
_LAZY = {
    "MemoryRegistry": "kvwire.aio.registry_memory",
    "RedisRegistry": "kvwire.aio.registry_redis",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "DEFAULT_TTL",
    "BlockId",
    "BlockLike",
    "BlockState",
    "Lease",
    "LeaseExpiredError",
    "MemoryRegistry",
    "NotificationsLostError",
    "Registry",
    "RegistryCore",
    "RegistryUnavailableError",
    "VersionedBlock",
    "Watcher",
    "block_from_key",
    "block_key",
    "canonical",
]
# Without redis-py (the [redis] extra) naming RedisRegistry raises an ImportError that says
# how to install it, so a star-import or dir() (inspect, help()) must not name it there.
if importlib.util.find_spec("redis") is not None:
    __all__.append("RedisRegistry")
