"""docs/consistency.md's allow-list ACL names every command the registry's Lua scripts run
(Redis checks each command a script runs against the user's ACL): ``COMMIT`` and
``INVALIDATE`` run ``SETRANGE`` (a write that changes nothing, before their first
``PUBLISH``), and an ACL without ``+setrange`` makes them fail closed.  The example ACL is
read from the docs, checked against every ``redis.call('X'`` of ``redis_layout.py``, and
given to a real Redis user that then runs every registry call and a watcher."""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import RegistryUnavailableError
from tests.consistency.conftest import RedisServer

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "consistency.md"
LAYOUT = ROOT / "kvwire" / "consistency" / "redis_layout.py"
# What the client sends itself, outside the scripts (registry_redis.py).
CLIENT_COMMANDS = {"evalsha", "eval", "ping", "time", "subscribe"}


def _script_commands() -> set[str]:
    return {name.lower() for name in re.findall(r"redis\.p?call\(\s*'([A-Za-z]+)'", LAYOUT.read_text("utf-8"))}


def _doc_acl() -> list[str]:
    """The docs' example ``ACL SETUSER`` line, split into words."""
    lines = [line for line in DOC.read_text("utf-8").splitlines() if line.startswith("ACL SETUSER ")]
    assert len(lines) == 1, lines
    return lines[0].split()


def test_the_scripts_commands_are_found() -> None:
    assert {"setrange", "publish", "info", "time", "hset"} <= _script_commands()


def test_the_docs_acl_allows_every_command_the_scripts_and_the_client_run() -> None:
    allowed = {word[1:].lower() for word in _doc_acl() if word.startswith("+")}
    missing = (_script_commands() | CLIENT_COMMANDS) - allowed
    assert not missing, f"docs/consistency.md's ACL lacks {sorted(missing)}"
    prose = DOC.read_text("utf-8")
    for name in _script_commands():
        assert f"`{name.upper()}`" in prose, name
    assert "`+setrange`" in prose  # the upgrade note


async def _acl_user(raw: object, namespace: str, *, drop: str = "") -> tuple[str, str]:
    words = _doc_acl()
    user = f"kv-{uuid.uuid4().hex}"
    args = [user if word == "kv" else word.replace("{ns}", "{" + namespace + "}") for word in words[2:]]
    args = [word for word in args if word != drop]
    await raw.execute_command("ACL", "SETUSER", *args)  # type: ignore[attr-defined]
    password = next(word[1:] for word in args if word.startswith(">"))
    return user, password


async def test_a_user_with_the_docs_acl_runs_every_registry_call(redis_server: RedisServer) -> None:
    import redis.asyncio as aioredis

    namespace = f"acl-{uuid.uuid4().hex}"
    raw = aioredis.from_url(redis_server.url)
    user, password = await _acl_user(raw, namespace)
    reg = await RedisRegistry.connect(
        f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0", namespace=namespace
    )
    try:
        async with reg.watch() as watcher:
            lease = await reg.begin([b"a", b"b"], owner="p", ttl=60)
            lease = await reg.renew(lease, ttl=60)
            committed = await reg.commit(lease)
            assert [await asyncio.wait_for(anext(watcher), 10) for _ in range(2)] == committed
            assert await reg.lookup([b"a", b"b"]) == committed
            assert await reg.check_many(committed) == []
            await reg.check(*committed[0])
            assert await reg.publish(committed) == []
            assert await reg.superseded(committed) == []
            va = await reg.invalidate(b"a")
            assert await asyncio.wait_for(anext(watcher), 10) == (b"a", va)
            await reg.invalidate_many([b"b"])
            assert await reg.check_many(committed) == [b"a", b"b"]  # both stale
            await reg.release(await reg.begin([b"c"], owner="p", ttl=60))
            assert (await reg.begin([b"c"], owner="q", ttl=60)).started == (b"c",)
    finally:
        await reg.close()
        await raw.execute_command("ACL", "DELUSER", user)
        await raw.aclose()


async def test_without_setrange_commit_and_invalidate_fail_closed(redis_server: RedisServer) -> None:
    """An allow-list ACL written before the scripts ran ``SETRANGE``: nothing changes."""
    import redis.asyncio as aioredis

    namespace = f"acl-{uuid.uuid4().hex}"
    raw = aioredis.from_url(redis_server.url)
    user, password = await _acl_user(raw, namespace, drop="+setrange")
    reg = await RedisRegistry.connect(
        f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0", namespace=namespace
    )
    try:
        lease = await reg.begin([b"a"], owner="p", ttl=60)
        with pytest.raises(RegistryUnavailableError):
            await reg.commit(lease)
        with pytest.raises(RegistryUnavailableError):
            await reg.invalidate(b"a")
        assert await reg.lookup([b"a"]) == []
        assert await raw.get(reg.layout.seq) is None  # no version handed out
        await raw.execute_command("ACL", "SETUSER", user, "+setrange")
        assert [b for b, _ in await reg.commit(lease)] == [b"a"]  # the lease stayed live
    finally:
        await reg.close()
        await raw.execute_command("ACL", "DELUSER", user)
        await raw.aclose()
