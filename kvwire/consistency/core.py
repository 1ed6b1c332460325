"""The sans-IO prefix registry: per-block versions, in-flight leases, and notifications.

Nothing here reads a clock or does I/O. Every time-dependent method takes ``now`` (float
seconds on whatever monotonic clock the caller uses) so tests can drive lease expiry exactly.
The asyncio memory backend wraps this class; the Redis backend implements the same rules in
Lua (see :mod:`kvwire.consistency.redis_layout`) and the shared test-suite holds both to them.

The rules (the contract both backends keep):

* Every block has a version, an integer that only grows, drawn from one registry-wide
  counter (so a version is never handed out twice, even for different blocks). An unknown
  block has version 0 and is not complete.
* Only ``commit`` and ``invalidate`` give a block a version, a new one each time. After
  ``commit`` the block is *complete* at that version; after ``invalidate`` it is not
  complete (no data exists for the new version). ``publish`` confirms that a block is
  complete at exactly the given version and changes nothing: a version above the block's
  own was issued to another block or to none, and is refused (one above the last handed
  out raises), so no writer makes data fresh under a version the block was not given.
* Versions stay below ``2**53`` (exact in Lua and JSON): a commit or invalidation that would
  need a version past :data:`MAX_VERSION` is refused, changing nothing.
* A block is *fresh* at version ``v`` iff it is complete and its version is exactly ``v``.
  Anything else (older, never issued, invalidated, unknown) is stale: fail closed.
* ``begin`` starts only blocks that are neither complete nor in flight under a live lease;
  a block is in flight under at most one live lease at a time.
* A commit succeeds only while its lease is live and still holds every block it started;
  otherwise nothing changes and the blocks it still holds are freed.
"""

from __future__ import annotations

import heapq
import numbers
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvwire.consistency.blocks import BlockId, block_from_key, block_key, block_pairs, unique_keys
from kvwire.consistency.errors import LeaseExpiredError
from kvwire.errors import LimitExceededError, StaleVersionError, UsageError

VersionedBlock = tuple[BlockId, int]
"""A block id with a version: what lookup, commit, invalidate_many and watch return."""


@dataclass(frozen=True, slots=True)
class Lease:
    """The result of ``begin``: which blocks the caller now computes, and which not.

    ``started``: blocks this lease owns (marked in flight); compute them, then ``commit``.
    ``busy``: blocks in flight under another live lease; someone else computes them.
    ``complete``: blocks already complete, with their version; nothing to compute.
    ``expires_at`` is on the registry's clock (loop time for memory, Redis TIME for Redis)
    and is informational; the registry decides expiry itself.
    """

    lease_id: str
    owner: str
    ttl: float
    expires_at: float
    started: tuple[BlockId, ...] = ()
    busy: tuple[BlockId, ...] = ()
    complete: tuple[VersionedBlock, ...] = ()


@dataclass(slots=True)
class BlockState:
    """What the registry holds for one block (introspection and tests)."""

    version: int = 0
    complete: bool = False
    lease_id: str | None = None


@dataclass(slots=True)
class _LeaseRecord:
    owner: str
    expires_at: float
    keys: list[str] = field(default_factory=list)


#: Outdated expiry entries the heap may hold beyond twice the live leases (see _push_expiry).
_HEAP_SLACK = 64


def new_lease_id() -> str:
    """A fresh random lease id (96 bits; collisions are not a practical concern)."""
    return secrets.token_hex(12)


#: Longest lease ttl, seconds (a year): a lease is held while a block is computed; a longer
#: one is a mistake, and past about 9e12 s Redis cannot store the lease's expiry at all.
MAX_TTL = 365 * 24 * 3600.0


def check_ttl(ttl: object) -> float:
    """``ttl`` as a float, or :class:`UsageError` if it is not a positive number of seconds
    up to :data:`MAX_TTL` (a ``str``, ``None`` or ``bool`` is not a number of seconds)."""
    if isinstance(ttl, bool) or not isinstance(ttl, numbers.Real):
        raise UsageError(f"lease ttl must be a number of seconds, not {type(ttl).__name__}")
    value = float(ttl)
    if not (0.0 < value <= MAX_TTL):
        raise UsageError(f"lease ttl must be a positive number of seconds up to {MAX_TTL:.0f}, not {ttl!r}")
    return value


def check_lease(lease: object) -> Lease:
    """``lease`` if it is a :class:`Lease`, else :class:`UsageError`."""
    if not isinstance(lease, Lease):
        raise UsageError(f"a lease is what begin returned (a Lease), not {type(lease).__name__}")
    return lease


#: Highest version a registry hands out (``2**53 - 1``): versions stay exact in Lua (doubles)
#: and in JSON.
MAX_VERSION = 2**53 - 1


def check_version(version: object) -> int:
    """``version`` if it is an int in ``[0, MAX_VERSION]``, else :class:`UsageError`."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise UsageError(f"a version is a non-negative int below 2**53, not {version!r}")
    return version


def exhausted_error(count: int) -> LimitExceededError:
    """The error of a commit or invalidation needing ``count`` versions past :data:`MAX_VERSION`."""
    return LimitExceededError(
        f"the registry's version counter is exhausted: no {count} new version(s) below 2**53 are left"
    )


def never_issued_error(block: object, version: int, last: int) -> UsageError:
    """The error of a publish of a version above the last one the registry handed out."""
    return UsageError(
        f"publish confirms versions this registry issued: block {block!r} version {version} "
        f"is above the last one it handed out ({last})"
    )


def pairs_keys(pairs: Iterable[tuple[object, int]]) -> list[tuple[str, int]]:
    """Validated ``(canonical key, version)`` pairs; :class:`UsageError` naming what is wrong
    (not a list of pairs, an entry not a pair, a bad block id or version)."""
    return [(block_key(block), check_version(version)) for block, version in block_pairs(pairs)]


def stale_error(stale: Sequence[BlockId], what: str = "stale") -> StaleVersionError:
    """The error for a list of stale blocks (first few named)."""
    shown = ", ".join(repr(b) for b in stale[:4])
    more = f" and {len(stale) - 4} more" if len(stale) > 4 else ""
    return StaleVersionError(f"{what}: {shown}{more}")


class RegistryCore:
    """The registry state machine. Not thread-safe; one owner drives it."""

    def __init__(self) -> None:
        self._blocks: dict[str, BlockState] = {}
        self._leases: dict[str, _LeaseRecord] = {}
        # (expires_at, lease_id); entries may be outdated by renew/commit, checked on pop.
        self._expiries: list[tuple[float, str]] = []
        self._seq = 0
        self._events: list[VersionedBlock] = []

    # ---- time -----------------------------------------------------------------------

    def expire(self, now: float) -> list[str]:
        """Drop every lease whose expiry is ``<= now``; frees its blocks. Returns their ids."""
        dropped: list[str] = []
        while self._expiries and self._expiries[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiries)
            rec = self._leases.get(lease_id)
            if rec is None or rec.expires_at > now:
                continue  # committed/released, or renewed (a newer heap entry exists)
            self._drop_lease(lease_id, rec)
            dropped.append(lease_id)
        return dropped

    def next_expiry(self) -> float | None:
        """The earliest time a live lease may expire (a timer hint), or None."""
        while self._expiries:
            at, lease_id = self._expiries[0]
            rec = self._leases.get(lease_id)
            if rec is not None and rec.expires_at == at:
                return at
            heapq.heappop(self._expiries)
        return None

    def _push_expiry(self, at: float, lease_id: str) -> None:
        """Queue a lease's expiry.  Entries outdated by a renew, a commit or a release stay
        in the heap until their time; once they outnumber the live leases the heap is
        rebuilt from those, so it stays within twice their number (plus a constant) however
        often leases are renewed or committed before they expire."""
        heapq.heappush(self._expiries, (at, lease_id))
        if len(self._expiries) > 2 * len(self._leases) + _HEAP_SLACK:
            self._expiries = [(rec.expires_at, lid) for lid, rec in self._leases.items()]
            heapq.heapify(self._expiries)

    def _drop_lease(self, lease_id: str, rec: _LeaseRecord) -> None:
        for key in rec.keys:
            state = self._blocks.get(key)
            if state is not None and state.lease_id == lease_id:
                state.lease_id = None
        del self._leases[lease_id]

    # ---- leases ---------------------------------------------------------------------

    def begin(
        self,
        blocks: Iterable[object],
        *,
        owner: str,
        ttl: float,
        now: float,
        lease_id: str | None = None,
    ) -> Lease:
        """Mark the blocks that need computing as in flight under a new lease."""
        ttl = check_ttl(ttl)
        keys = unique_keys(blocks)
        self.expire(now)
        lease_id = lease_id or new_lease_id()
        if lease_id in self._leases:
            raise UsageError(f"lease id {lease_id!r} is already in use")
        expires_at = now + ttl
        started: list[str] = []
        busy: list[BlockId] = []
        complete: list[VersionedBlock] = []
        for key in keys:
            state = self._blocks.setdefault(key, BlockState())
            if state.lease_id is not None:
                busy.append(block_from_key(key))
            elif state.complete:
                complete.append((block_from_key(key), state.version))
            else:
                state.lease_id = lease_id
                started.append(key)
        if started:
            self._leases[lease_id] = _LeaseRecord(owner, expires_at, started)
            self._push_expiry(expires_at, lease_id)
        return Lease(
            lease_id=lease_id,
            owner=owner,
            ttl=ttl,
            expires_at=expires_at,
            started=tuple(block_from_key(k) for k in started),
            busy=tuple(busy),
            complete=tuple(complete),
        )

    def commit(self, lease: Lease, *, now: float) -> list[VersionedBlock]:
        """Complete every block ``lease`` started; returns ``[(block, new_version)]``.

        Raises :class:`LeaseExpiredError` if the lease is not live, or
        :class:`StaleVersionError` if some block was invalidated or taken over while in
        flight, or is not one the lease holds; in both cases nothing is committed and the
        lease is gone, every block it held freed.  A lease narrowed before committing
        (``dataclasses.replace`` with fewer ``started``) commits the blocks it names; the
        lease's other blocks are freed.  One naming no blocks commits nothing (``[]``, as
        for a lease that started nothing) and ends the lease, every block it held freed.
        """
        check_lease(lease)
        keys = unique_keys(lease.started)
        if not keys:
            rec = self._leases.get(lease.lease_id)
            if rec is not None:  # narrowed to no blocks: the lease ends
                self._drop_lease(lease.lease_id, rec)
            return []
        self.expire(now)
        rec = self._leases.get(lease.lease_id)
        if rec is None:
            raise LeaseExpiredError(f"lease {lease.lease_id} ({lease.owner}) is no longer live")
        lost = [k for k in keys if not self._held(k, lease.lease_id)]
        if lost:
            self._drop_lease(lease.lease_id, rec)
            raise stale_error([block_from_key(k) for k in lost], "blocks changed while in flight")
        self._reserve(len(keys))
        out: list[VersionedBlock] = []
        for key in keys:
            state = self._blocks[key]
            self._seq += 1
            state.version = self._seq
            state.complete = True
            state.lease_id = None
            item = (block_from_key(key), state.version)
            out.append(item)
            self._events.append(item)
        self._drop_lease(lease.lease_id, rec)  # frees what a narrowed lease left out
        return out

    def _held(self, key: str, lease_id: str) -> bool:
        state = self._blocks.get(key)
        return state is not None and state.lease_id == lease_id

    def renew(self, lease: Lease, *, ttl: float, now: float) -> Lease:
        """Extend a live lease to ``now + ttl``; :class:`LeaseExpiredError` if not live."""
        check_lease(lease)
        ttl = check_ttl(ttl)
        if not lease.started:
            return replace(lease, ttl=ttl, expires_at=now + ttl)
        self.expire(now)
        rec = self._leases.get(lease.lease_id)
        if rec is None:
            raise LeaseExpiredError(f"lease {lease.lease_id} ({lease.owner}) is no longer live")
        rec.expires_at = now + ttl
        self._push_expiry(rec.expires_at, lease.lease_id)
        return replace(lease, ttl=ttl, expires_at=rec.expires_at)

    def release(self, lease: Lease, *, now: float) -> None:
        """Give up a lease: its blocks stop being in flight. No error if already gone."""
        check_lease(lease)
        self.expire(now)
        rec = self._leases.get(lease.lease_id)
        if rec is not None:
            self._drop_lease(lease.lease_id, rec)

    # ---- versions -------------------------------------------------------------------

    def lookup(self, blocks: Iterable[object]) -> list[VersionedBlock]:
        """The longest prefix of ``blocks`` (in order, duplicates dropped, first occurrence
        kept) whose blocks are all complete."""
        out: list[VersionedBlock] = []
        for key in unique_keys(blocks):
            state = self._blocks.get(key)
            if state is None or not state.complete:
                break
            out.append((block_from_key(key), state.version))
        return out

    def invalidate(self, block: object) -> int:
        """Give ``block`` a new version with no data behind it; returns the version.

        Holders of any older version become stale, and an in-flight lease loses the block
        (its commit will fail), because it was computed against the invalidated state.
        """
        return self.invalidate_many([block])[0][1]

    def invalidate_many(self, blocks: Iterable[object]) -> list[VersionedBlock]:
        """:meth:`invalidate` each block (duplicates once); returns ``[(block, version)]``."""
        keys = unique_keys(blocks)
        self._reserve(len(keys))
        out: list[VersionedBlock] = []
        for key in keys:
            state = self._blocks.setdefault(key, BlockState())
            self._seq += 1
            state.version = self._seq
            state.complete = False
            state.lease_id = None
            item = (block_from_key(key), state.version)
            out.append(item)
            self._events.append(item)
        return out

    def _reserve(self, count: int) -> None:
        """Raise :class:`LimitExceededError` unless ``count`` more versions fit below 2**53."""
        if self._seq + count > MAX_VERSION:
            raise exhausted_error(count)

    def publish(self, pairs: Iterable[tuple[object, int]]) -> list[BlockId]:
        """Confirm blocks received at given versions; returns the rejected ones.

        ``(block, v)`` is accepted iff the block is complete at exactly ``v`` (fresh): a
        confirmation, which changes nothing and may be repeated.  Anything else is rejected:
        an older version (superseded), an invalidated or unknown block, and a version above
        the block's current one, which was issued to another block or to none (only a commit
        or an invalidation gives a block a version), so a writer cannot make its data fresh
        under a version the block was never given.

        A ``v`` above the last version this registry handed out was never issued at all:
        the call raises :class:`UsageError` and changes nothing.
        """
        items = pairs_keys(pairs)
        for key, version in items:
            if version > self._seq:
                raise never_issued_error(block_from_key(key), version, self._seq)
        return [block_from_key(key) for key, version in items if not self._fresh(key, version)]

    def superseded(self, pairs: Iterable[tuple[object, int]]) -> list[BlockId]:
        """The blocks :meth:`publish` would reject now, without changing anything; a version
        above the last one handed out (which publish refuses) is listed too: the blocks not
        fresh, as :meth:`stale`.

        A receiver asks this when a transfer announces its blocks, to refuse stale data
        before it moves; :meth:`publish` at completion stays the authoritative check.
        """
        return self.stale(pairs)

    def _fresh(self, key: str, version: int) -> bool:
        state = self._blocks.get(key)
        return state is not None and state.complete and state.version == version

    def stale(self, pairs: Iterable[tuple[object, int]]) -> list[BlockId]:
        """The blocks of ``pairs`` that are not fresh at the given version, in order."""
        return [block_from_key(key) for key, version in pairs_keys(pairs) if not self._fresh(key, version)]

    def check(self, block: object, version: int) -> None:
        """Raise :class:`StaleVersionError` unless ``block`` is fresh at ``version``."""
        if self.stale([(block, version)]):
            raise self.stale_reason(block, version)

    def stale_reason(self, block: object, version: int) -> StaleVersionError:
        """The error explaining why ``(block, version)`` is not fresh."""
        state = self._blocks.get(block_key(block)) or BlockState()
        return explain_stale(block, version, state.version, state.complete)

    # ---- notifications and introspection --------------------------------------------

    def take_events(self) -> list[VersionedBlock]:
        """The ``(block, version)`` changes since the last call (commits, invalidations)."""
        events, self._events = self._events, []
        return events

    def state(self, block: object) -> BlockState:
        """A copy of what the registry holds for ``block``."""
        state = self._blocks.get(block_key(block))
        return replace(state) if state is not None else BlockState()

    def live_leases(self, now: float) -> dict[str, float]:
        """``{lease_id: expires_at}`` of the leases live at ``now``."""
        self.expire(now)
        return {lid: rec.expires_at for lid, rec in self._leases.items()}


def explain_stale(
    block: object, version: int, current: int, complete: bool, *, earlier_server: bool = False
) -> StaleVersionError:
    """A :class:`StaleVersionError` saying why ``block`` at ``version`` is not fresh;
    ``earlier_server``: the block was committed under an earlier tenure of the Redis server
    (``<run_id>/<master_replid>``: the server restarted or failed over since, or began a new
    replication history, as when a replica attaches to a primary holding no replication
    backlog), so it is not complete there."""
    if current == 0:
        why = "never committed (unknown to the registry, or begun and not committed)"
    elif version < current:
        why = f"older than the registry's version {current}"
    elif version > current:
        why = f"never issued (the registry holds version {current})"
    elif earlier_server:
        why = (
            "committed under an earlier tenure of the Redis server (it restarted or failed over,"
            " or began a new replication history); recompute it"
        )
    elif not complete:
        why = "invalidated or not yet committed"
    else:
        why = "fresh"
    return StaleVersionError(f"block {block!r} version {version} is {why}")


__all__ = [
    "MAX_VERSION",
    "BlockState",
    "Lease",
    "RegistryCore",
    "VersionedBlock",
    "check_lease",
    "check_ttl",
    "check_version",
    "exhausted_error",
    "explain_stale",
    "never_issued_error",
    "new_lease_id",
    "pairs_keys",
    "stale_error",
]
