"""Stateful property test: several clients interleave operations; a model checks safety.

Checked after every step: no lookup returns a version older than one already committed or
invalidated (lookup matches the model exactly); publish confirms only a block's own complete
version, changing nothing; versions handed out only grow and are never handed out twice; no
block is in flight under two live leases; a commit from a lease that lost a block or expired
fails. With the memory backend the clock is injected,
so expiry is exact; on Redis short leases use real time and the model allows "may have
expired" until a wait longer than their ttl has passed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvwire.aio.registry_memory import MemoryRegistry
from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import Lease, LeaseExpiredError, Registry
from kvwire.errors import StaleVersionError, UsageError
from tests.consistency.conftest import RedisServer

T = TypeVar("T")
LONG = 3600.0
BLOCKS = st.lists(st.integers(0, 5), min_size=1, max_size=4)
OWNERS = st.sampled_from(["prefill-a", "prefill-b", "prefill-c"])


@dataclass
class ModelLease:
    lease: Lease
    short: bool
    dead: bool = False  # certainly expired


class RegistryMachine(RuleBasedStateMachine):
    redis_url: ClassVar[str | None] = None  # None: memory backend with an injected clock
    short_ttl: ClassVar[float] = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.now = 0.0
        self.exact = self.redis_url is None
        self.reg: Registry
        if self.redis_url is None:
            self.reg = MemoryRegistry(clock=lambda: self.now)
        else:
            self.reg = self.run(
                RedisRegistry.connect(self.redis_url, namespace=f"sm-{uuid.uuid4().hex}")
            )
        self.version: dict[int, int] = {}
        self.complete: dict[int, bool] = {}
        self.holder: dict[int, str] = {}
        self.leases: dict[str, ModelLease] = {}
        self.max_version = 0

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.reg.close())
        self.loop.close()

    def _new_version(self, block: int, version: int) -> None:
        # versions from the shared counter: strictly above everything handed out so far
        assert version > self.max_version
        assert version > self.version.get(block, 0)
        self.max_version = version
        self.version[block] = version

    def _maybe_live(self, lease_id: str) -> bool:
        m = self.leases.get(lease_id)
        return m is not None and not m.dead

    def _surely_live(self, m: ModelLease) -> bool:
        return not m.dead and (self.exact or not m.short)

    @rule(blocks=BLOCKS, owner=OWNERS, short=st.booleans())
    def begin(self, blocks: list[int], owner: str, short: bool) -> None:
        ttl = self.short_ttl if short else LONG
        lease = self.run(self.reg.begin(blocks, owner=owner, ttl=ttl))
        assert sorted([*lease.started, *lease.busy, *(b for b, _ in lease.complete)]) == sorted(
            set(blocks)
        )
        for block in lease.started:
            assert not self.complete.get(block, False)
            old = self.holder.get(block)
            if old is not None and old in self.leases:
                # never in flight twice: the previous holder must be (possibly) expired
                assert not self._surely_live(self.leases[old])
            self.holder[block] = lease.lease_id
        for block in lease.busy:
            assert self._maybe_live(self.holder.get(block, ""))
        for block, version in lease.complete:
            assert self.complete.get(block) and self.version[block] == version
        if lease.started:
            self.leases[lease.lease_id] = ModelLease(lease, short)

    def _pick(self, index: int) -> ModelLease | None:
        if not self.leases:
            return None
        return self.leases[sorted(self.leases)[index % len(self.leases)]]

    @rule(index=st.integers(0, 50))
    def commit(self, index: int) -> None:
        m = self._pick(index)
        if m is None:
            return
        lease = m.lease
        del self.leases[lease.lease_id]
        owns_all = all(self.holder.get(b) == lease.lease_id for b in lease.started)
        try:
            result = self.run(self.reg.commit(lease))
        except LeaseExpiredError:
            assert not self._surely_live(m) or not owns_all
            result = None
        except StaleVersionError:
            assert not owns_all
            result = None
        else:
            assert owns_all and not m.dead, "a dead or superseded lease committed"
            assert [b for b, _ in result] == list(lease.started)
            for block, version in result:
                self._new_version(int(block), version)
                self.complete[int(block)] = True
        for block in lease.started:
            if self.holder.get(int(block)) == lease.lease_id:
                del self.holder[int(block)]

    @rule(index=st.integers(0, 50))
    def release(self, index: int) -> None:
        m = self._pick(index)
        if m is None:
            return
        del self.leases[m.lease.lease_id]
        self.run(self.reg.release(m.lease))
        for block in m.lease.started:
            if self.holder.get(int(block)) == m.lease.lease_id:
                del self.holder[int(block)]

    @rule(block=st.integers(0, 5))
    def invalidate(self, block: int) -> None:
        version = self.run(self.reg.invalidate(block))
        self._new_version(block, version)
        self.complete[block] = False
        self.holder.pop(block, None)

    @rule(block=st.integers(0, 5), delta=st.integers(-2, 4))
    def publish(self, block: int, delta: int) -> None:
        current = self.version.get(block, 0)
        # delta > 0: the last version handed out (maybe another block's), one below, or
        # above it (never issued)
        version = current + delta if delta <= 0 else self.max_version + delta - 2
        if version < 0:
            return
        if version > self.max_version and not self.exact and self.max_version == 0:
            # Redis before its first version: a new namespace looks like one whose data was
            # lost, so a version up to the clock (here: any small one) may have been handed
            # out before; it is rejected, not refused
            assert self.run(self.reg.publish([(block, version)])) == [block]
            return
        if version > self.max_version:
            with pytest.raises(UsageError, match="above the last one"):
                self.run(self.reg.publish([(block, version)]))
            return  # refused whole: nothing changed, the counter did not move
        rejected = self.run(self.reg.publish([(block, version)]))
        # a confirmation: only the block's own version, complete; nothing changes
        accept = version == current and self.complete.get(block, False)
        assert rejected == ([] if accept else [block])

    @rule(blocks=BLOCKS)
    def lookup(self, blocks: list[int]) -> None:
        expected = []
        for block in dict.fromkeys(blocks):  # duplicates dropped, first occurrence kept
            if not self.complete.get(block, False):
                break
            expected.append((block, self.version[block]))
        assert self.run(self.reg.lookup(blocks)) == expected

    @rule(block=st.integers(0, 5), delta=st.integers(-1, 1))
    def check_many(self, block: int, delta: int) -> None:
        version = max(0, self.version.get(block, 0) + delta)
        fresh = self.complete.get(block, False) and version == self.version[block]
        assert self.run(self.reg.check_many([(block, version)])) == ([] if fresh else [block])

    @rule()
    def wait_past_short_ttl(self) -> None:
        if self.exact:
            self.now += self.short_ttl
        else:
            time.sleep(self.short_ttl * 1.6)
        for m in self.leases.values():
            if m.short:
                m.dead = True

    @rule(dt=st.floats(0.0, 0.5))
    def tick(self, dt: float) -> None:
        if self.exact:
            self.now += dt * self.short_ttl
            # leases begun exactly now + ttl ago are dead at now (inclusive expiry)
            for m in self.leases.values():
                if m.short and m.lease.expires_at <= self.now:
                    m.dead = True

    @invariant()
    def versions_bounded(self) -> None:
        assert all(v <= self.max_version for v in self.version.values())


def test_stateful_memory() -> None:
    run_state_machine_as_test(
        RegistryMachine,
        settings=settings(max_examples=150, stateful_step_count=40, deadline=None),
    )


class RedisMachine(RegistryMachine):
    short_ttl = 0.05


def test_stateful_redis(redis_server: RedisServer) -> None:
    RedisMachine.redis_url = redis_server.url
    run_state_machine_as_test(
        RedisMachine,
        settings=settings(
            max_examples=12,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


pytestmark = pytest.mark.timeout(90)
