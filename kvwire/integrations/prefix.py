"""A prompt's prefix blocks, named and versioned in the registry, for engine connectors.

An engine connector that is given a registry (:mod:`kvwire.consistency`) names the full
prompt blocks it sends, so the receiving side can refuse a cache whose blocks were
invalidated meanwhile (new weights, an evicted prefix):

- :func:`prefix_block_ids`: block ``i``'s id is a chained SHA-256 over the token ids of
  blocks ``0..i`` (so it names the whole prefix up to it), seeded with the block size and
  an optional salt (e.g. the model name).  Both sides derive the same ids from the prompt.
- :func:`name_blocks` (sender): ``begin`` + ``commit`` on the registry; blocks already
  complete keep their version, the others get a new one.  Returns ``(block, version)``
  for the longest run of blocks it could name (it stops at a block another lease is
  computing): the ``blocks=`` of :meth:`kvwire.Peer.send`.
- :func:`verify_blocks` (receiver): the reason to refuse a received cache, or None when
  it names exactly the expected blocks and the registry holds every one fresh at the
  announced version (``check_many``; fails closed).
- :class:`SyncRegistry`: the same on a :class:`kvwire.sync.Bridge`, for synchronous hooks.

No engine is imported here.  See docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, SupportsIndex, TypeVar

import numpy as np

from kvwire.consistency import BlockId, BlockLike, Lease, Registry
from kvwire.consistency.blocks import block_key, block_pairs, canonical
from kvwire.errors import KvwireError, RegistryUnavailableError, TransferTimeoutError, UsageError
from kvwire.session.options import check_index
from kvwire.sync import Bridge

T = TypeVar("T")

_SEED = b"kvwire-prefix-v1"


def prefix_block_ids(
    tokens: Sequence[SupportsIndex] | np.ndarray[Any, Any],
    block_size: SupportsIndex,
    num_blocks: SupportsIndex,
    *,
    salt: bytes = b"",
) -> list[bytes]:
    """The ids of the first ``num_blocks`` blocks of ``tokens`` (``block_size`` tokens each).

    ``tokens``: a sequence of token ids, each an integer in ``[-2**63, 2**63)`` (Python
    ints or numpy integers; a list, tuple or 1-D array); ``block_size`` and ``num_blocks``:
    integers (a numpy integer too, not a float or bool); ``salt``: bytes (e.g. the model
    name, encoded).  Anything else is a :class:`~kvwire.UsageError`: a float token (``1.5``)
    is refused, never truncated into another token's id.  Only the tokens of the named
    blocks are read.
    """
    size = check_index("block_size", block_size, 1, _TOKEN_LIMIT - 1)
    count = check_index("num_blocks", num_blocks, 0, _TOKEN_LIMIT - 1)
    if not isinstance(salt, bytes | bytearray | memoryview):
        raise UsageError(f"salt must be bytes (e.g. the model name, encoded), not {type(salt).__name__}")
    need = count * size
    try:
        if isinstance(tokens, str | bytes | bytearray | memoryview):
            raise TypeError
        have = len(tokens)
    except TypeError:
        raise UsageError(f"tokens must be a sequence of token ids, not {type(tokens).__name__}") from None
    if need > have:
        raise UsageError(f"{count} blocks of {size} need {need} tokens, got {have}")
    data = memoryview(_token_bytes(tokens, need))
    h = hashlib.sha256(_SEED + size.to_bytes(8, "little") + hashlib.sha256(salt).digest()).digest()
    ids = []
    step = 8 * size
    for i in range(count):
        hasher = hashlib.sha256(h)
        hasher.update(data[i * step:(i + 1) * step])
        h = hasher.digest()
        ids.append(h)
    return ids


_TOKEN_LIMIT = 2**63


def _token_bytes(tokens: Sequence[SupportsIndex] | np.ndarray[Any, Any], need: int) -> bytes:
    """The first ``need`` of ``tokens`` as little-endian int64s; :class:`UsageError` for a
    token that is not an integer in ``[-2**63, 2**63)``.  An integer array (or a list numpy
    reads as one, with no bool in it) is converted at once; anything else token by token."""
    try:
        head: Any = tokens[:need]
    except (TypeError, KeyError, ValueError):  # a mapping, something that does not slice
        raise UsageError(f"tokens must be a sequence of token ids, not {type(tokens).__name__}") from None
    array: Any = None
    # numpy reads a list mixing bools with ints as ints (True as token 1): such a list goes
    # token by token, where a bool is refused as it is alone.
    if isinstance(head, np.ndarray) or not {bool, np.bool_} & set(map(type, head)):
        with contextlib.suppress(ValueError, TypeError, OverflowError):
            array = np.asarray(head)
    if array is not None and array.ndim == 1 and len(array) == need:
        if array.dtype.kind == "i":
            return array.astype("<i8", copy=False).tobytes()  # type: ignore[no-any-return]
        if array.dtype.kind == "u" and (need == 0 or int(array.max()) < _TOKEN_LIMIT):
            return array.astype("<i8").tobytes()  # type: ignore[no-any-return]
    # Another dtype (floats, objects, bools, text) or an unsigned token past int64: each
    # token checked on its own, from the caller's objects (not numpy's lossy reading).
    out = bytearray()
    for i, token in enumerate(head):
        if isinstance(token, bool | np.bool_):
            raise UsageError(f"token {i} is a bool, not a token id")
        try:
            value = operator.index(token)
        except TypeError:
            raise UsageError(f"token {i} is not an integer token id: {token!r:.40}") from None
        if not -_TOKEN_LIMIT <= value < _TOKEN_LIMIT:
            raise UsageError(f"token {i} is outside [-2**63, 2**63): {value}")
        out += value.to_bytes(8, "little", signed=True)
    if len(out) != 8 * need:
        raise UsageError(f"tokens gave {len(out) // 8} of the {need} token ids asked for")
    return bytes(out)


async def name_blocks(
    registry: Registry, blocks: Iterable[BlockLike], *, owner: str, ttl: float = 30.0
) -> list[tuple[BlockId, int]]:
    """``(block, version)`` for the blocks a sender holds: complete ones at their version,
    the others committed now at a new one; stops at the first block another live lease is
    computing.  Raises :class:`~kvwire.StaleVersionError` if a block changed meanwhile.

    ``blocks`` is read once (a generator will do) and checked before anything is begun: a
    bad id is a :class:`~kvwire.UsageError` that leaves the registry as it was.  The blocks
    are returned in their canonical form (a ``bytearray`` or ``memoryview`` id as
    ``bytes``).

    A commit that fails or is cancelled (a caller's timeout) releases the lease before the
    error goes on, so its blocks are not left in flight, unnameable by other producers,
    for the rest of ``ttl``."""
    ids = _block_ids(blocks, "blocks")
    lease = await registry.begin(ids, owner=owner, ttl=ttl)
    versions: dict[str, int] = {block_key(b): v for b, v in lease.complete}
    if lease.started:
        try:
            versions.update((block_key(b), v) for b, v in await registry.commit(lease))
        except BaseException:
            await _release(registry, lease)
            raise
    named: list[tuple[BlockId, int]] = []
    for block in ids:
        version = versions.get(block_key(block))
        if version is None:
            break
        named.append((block, version))
    return named


def _block_ids(blocks: Iterable[object], name: str) -> list[BlockId]:
    """``blocks`` (read once) as a list of canonical block ids; :class:`UsageError` unless
    it is an iterable of block ids (a lone id, as ``unique_keys``, is refused)."""
    if isinstance(blocks, str | bytes | bytearray | memoryview):
        raise UsageError(f"{name} is a list of block ids, not a single id")
    try:
        entries = list(blocks)
    except TypeError:
        raise UsageError(f"{name} is a list of block ids, not {type(blocks).__name__}") from None
    return [canonical(block) for block in entries]


async def _release(registry: Registry, lease: Lease) -> None:
    """Release ``lease`` after its commit failed or was cancelled (errors ignored: the
    lease then ends with its ttl).  Not shielded here (this package imports no asyncio):
    the registries kvwire ships finish a release that a second cancellation interrupts
    (``MemoryRegistry.release`` never suspends; ``RedisRegistry.release`` runs in a task of
    its own).  With another registry, a second cancellation may leave the lease to its ttl."""
    with contextlib.suppress(Exception):
        await registry.release(lease)


async def verify_blocks(
    registry: Registry, expected: Iterable[BlockLike], announced: Iterable[tuple[BlockLike, int]]
) -> str | None:
    """None if ``announced`` names exactly ``expected`` (in order), every one fresh; else why not.

    Each argument is read once (a generator will do); :class:`~kvwire.UsageError` unless
    ``expected`` is an iterable of block ids and ``announced`` one of ``(block, version)``
    pairs."""
    wanted = [block_key(b) for b in _block_ids(expected, "expected")]
    pairs = block_pairs(announced, "announced")
    names = [block_key(b) for b, _ in pairs]
    if names != wanted:
        return f"the cache names {len(names)} prefix blocks that are not the {len(wanted)} of this prompt"
    stale = await registry.check_many(pairs)
    if stale:
        return f"{len(stale)} of its {len(wanted)} prefix blocks are stale"
    return None


#: The registry timeouts one :meth:`SyncRegistry.name` may take on a
#: :class:`~kvwire.consistency.RedisRegistry` whose Redis stalls: its begin waits for the
#: releases still running (one), its BEGIN (one), then either the release of a BEGIN whose
#: reply did not come or a COMMIT (one) and the release of the lease it did not commit (one).
_NAME_TIMEOUTS = 4


class SyncRegistry:
    """A registry used from synchronous code: its calls run on ``bridge``'s loop.

    Each call is bounded by ``timeout`` seconds; one not done by then is cancelled (a
    lease it began released) and raises :class:`~kvwire.RegistryUnavailableError`, as a
    registry that does not answer does.  :meth:`connect` sets the bound past the worst case
    of the Redis registry's own timeouts, so those fire first and say what did not answer.
    """

    def __init__(self, registry: Registry, bridge: Bridge, *, timeout: float = 10.0) -> None:
        self.registry = registry
        self.bridge = bridge
        self.timeout = timeout

    @classmethod
    def connect(cls, url: str, bridge: Bridge, *, namespace: str = "kvwire", timeout: float = 5.0,
                max_connections: int | None = None) -> SyncRegistry:
        """A :class:`~kvwire.consistency.RedisRegistry` at ``url`` on ``bridge``; ``timeout``
        is the registry's (each reply from Redis), ``max_connections`` the size of its
        pool of connections (an int >= 1; None: the registry's default, 100; a
        ``max_connections`` in ``url`` is not used either way)."""
        from kvwire.aio.registry_redis import RedisRegistry

        pool: dict[str, Any] = {} if max_connections is None else {"max_connections": max_connections}
        registry = _run(bridge, RedisRegistry.connect(url, namespace=namespace, timeout=timeout, **pool),
                        timeout + 5.0, "connect")
        return cls(registry, bridge, timeout=_NAME_TIMEOUTS * timeout + 1.0)

    def name(self, blocks: Iterable[BlockLike], *, owner: str, ttl: float = 30.0) -> list[tuple[BlockId, int]]:
        return _run(self.bridge, name_blocks(self.registry, blocks, owner=owner, ttl=ttl), self.timeout, "naming blocks")

    def verify(self, expected: Iterable[BlockLike], announced: Iterable[tuple[BlockLike, int]]) -> str | None:
        return _run(self.bridge, verify_blocks(self.registry, expected, announced), self.timeout, "checking blocks")

    def close(self) -> None:
        """Close the registry's connection (errors while closing are ignored)."""
        if not self.bridge.closed:
            with contextlib.suppress(KvwireError):
                self.bridge.run(self.registry.close(), self.timeout)


def _run(bridge: Bridge, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
    """``coro`` run on ``bridge``; not done within ``timeout`` (cancelled then), it is a
    :class:`RegistryUnavailableError`, not the bridge's :class:`TransferTimeoutError`."""
    try:
        return bridge.run(coro, timeout)
    except TransferTimeoutError as exc:
        raise RegistryUnavailableError(f"registry: {what} not done within {timeout:g} s") from exc


__all__ = ["SyncRegistry", "name_blocks", "prefix_block_ids", "verify_blocks"]
