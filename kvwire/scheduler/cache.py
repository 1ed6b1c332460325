"""A prefix cache over fixed-size KV blocks, evicting the least recently used block.

The blocks of one prefix are refreshed last block first, so the first block is the most
recently used of them and eviction takes a prefix from its end: a partly evicted prefix
keeps the leading blocks that are still of use."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PrefixCache"]


class PrefixCache:
    """LRU over block ids; a hit is the longest run of leading blocks present.

    Only a *complete* prefix is reusable: KV of block ``i`` depends on every token before
    it, so a present block after a missing one is of no use. A lookup or insert refreshes
    a prefix's blocks from the last to the first, so of one prefix the tail is evicted
    before the head (and a prompt longer than the cache keeps its first blocks).
    """

    __slots__ = ("_blocks", "capacity_blocks", "evictions")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity_blocks = capacity_blocks
        self.evictions = 0
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def peek(self, hash_ids: Sequence[int]) -> int:
        """Number of leading blocks present, without touching their recency (what a
        scheduler sees when it places a request; the prefill's own lookup touches them)."""
        hit = 0
        for h in hash_ids:
            if h not in self._blocks:
                break
            hit += 1
        return hit

    def lookup(self, hash_ids: Sequence[int]) -> int:
        """Number of leading blocks present; they become most recently used, the first
        block most of all."""
        hit = self.peek(hash_ids)
        for h in reversed(hash_ids[:hit]):
            self._blocks.move_to_end(h)
        return hit

    def insert(self, hash_ids: Sequence[int]) -> None:
        """Store (or refresh) the blocks of a computed or received prefix."""
        if self.capacity_blocks == 0:
            return
        blocks = self._blocks
        for h in reversed(hash_ids):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
            self.evictions += 1
