"""A receiver whose transfers wait for a registry check, and what the tests read of its
registry calls."""

from __future__ import annotations

from kvwire.errors import ErrorCode
from kvwire.session.receiver import (
    BLOCK_ENTRY_BYTES,
    ReceiverConfig,
    RegistryCheck,
)
from kvwire.wire import TransferReset
from kvwire.wire.frames import BlockVersion
from tests.session.receiver_harness import SECRET, Harness

BLOCKS = tuple(BlockVersion(block=f"i:{i}".encode(), version=3) for i in range(1, 9))
BLOCKS_BYTES = sum(2 * len(b.block) + BLOCK_ENTRY_BYTES for b in BLOCKS)  # (what a call's block list counts)
Key = tuple[bytes, int]


def gated_harness(**config: object) -> Harness:
    return Harness(ReceiverConfig(secret=SECRET, registry=True, **config))  # type: ignore[arg-type]


def checks(h: Harness) -> list[Key]:
    return [e.key for e in h.of(RegistryCheck)]


def refusals(h: Harness) -> list[TransferReset]:
    return [e for e in h.client_of(TransferReset) if e.code == ErrorCode.LIMIT_EXCEEDED]
