"""A Redis user that may not publish to the namespace's events channel (an ACL without
``&{ns}:events``; Redis 7's default for a new user, ``acl-pubsub-default resetchannels``):
COMMIT and INVALIDATE raise RegistryUnavailableError and change nothing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import RegistryUnavailableError
from tests.consistency.conftest import RedisServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def no_channel_user(redis_server: RedisServer) -> AsyncIterator[str]:
    """A user with every key and command but no pub/sub channel (Redis 6.2 and later)."""
    import redis.asyncio as aioredis

    name = f"kv-{uuid.uuid4().hex}"
    raw = aioredis.from_url(redis_server.url)
    try:
        await raw.execute_command("ACL", "SETUSER", name, "on", ">pw", "~*", "+@all", "resetchannels")
        yield name
    finally:
        await raw.execute_command("ACL", "DELUSER", name)
        await raw.aclose()


async def test_a_user_denied_the_events_channel_commits_and_invalidates_nothing(
    redis_server: RedisServer, no_channel_user: str
) -> None:
    """The scripts published each block's change after writing it: the denial, raised at
    the first PUBLISH, left the first block committed (or invalidated) and the others as
    they were (Redis does not undo a script's writes), against "all or nothing".  Every
    PUBLISH now comes before the first write."""
    import redis.asyncio as aioredis

    namespace = f"acl-{uuid.uuid4().hex}"
    url = f"redis://{no_channel_user}:pw@127.0.0.1:{redis_server.port}/0"
    admin = await RedisRegistry.connect(redis_server.url, namespace=namespace)
    denied = await RedisRegistry.connect(url, namespace=namespace)
    raw = aioredis.from_url(redis_server.url)
    try:
        fresh = await admin.commit(await admin.begin([b"x", b"y"], owner="p"))
        seq = await raw.get(admin.layout.seq)
        lease = await denied.begin([b"a", b"b", b"c"], owner="p", ttl=60)
        assert lease.started == (b"a", b"b", b"c")
        with pytest.raises(RegistryUnavailableError, match="publish"):
            await denied.commit(lease)
        assert await admin.lookup([b"a", b"b", b"c"]) == []
        assert (await admin.begin([b"a", b"b", b"c"], owner="q")).busy == (b"a", b"b", b"c")  # still the lease's
        with pytest.raises(RegistryUnavailableError, match="publish"):
            await denied.invalidate_many([b"x", b"y"])
        assert await admin.check_many(fresh) == []  # neither invalidated
        assert await raw.get(admin.layout.seq) == seq  # no version handed out
        # granted the channel, the same lease commits
        await raw.execute_command("ACL", "SETUSER", no_channel_user, f"&{admin.layout.channel}")
        async with admin.watch() as watcher:
            committed = await denied.commit(lease)
            assert [b for b, _ in committed] == [b"a", b"b", b"c"]
            assert [await asyncio.wait_for(anext(watcher), 10) for _ in range(3)] == committed
        assert await admin.lookup([b"a", b"b", b"c"]) == committed
    finally:
        await denied.close()
        await admin.close()
        await raw.aclose()
