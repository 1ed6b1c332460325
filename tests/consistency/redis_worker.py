"""One of the processes of test_many_processes_no_lost_update (run as a script)."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections import defaultdict

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.errors import StaleVersionError


async def main(url: str, namespace: str, seed: int, ops: int) -> None:
    rng = random.Random(seed)
    versions: list[tuple[int, int]] = []
    seen: dict[int, list[int]] = defaultdict(list)
    busy = 0
    async with await RedisRegistry.connect(url, namespace=namespace) as reg:
        done = 0
        while done < ops:
            blocks = rng.sample(range(8), rng.randint(1, 3))
            if rng.random() < 0.3:
                block, version = (await reg.invalidate_many(blocks[:1]))[0]
                versions.append((int(block), version))
                seen[int(block)].append(version)
                done += 1
                continue
            lease = await reg.begin(blocks, owner=f"p{seed}", ttl=5.0)
            busy += len(lease.busy)
            done += 1
            try:
                committed = await reg.commit(lease)
            except StaleVersionError:
                committed = []  # invalidated by another process while in flight
            done += 1
            for block, version in committed:
                versions.append((int(block), version))
                seen[int(block)].append(version)
            for block, version in await reg.lookup(blocks):
                seen[int(block)].append(version)
    json.dump({"versions": versions, "seen": seen, "busy": busy}, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
