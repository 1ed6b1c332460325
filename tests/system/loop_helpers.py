"""What the event loop's exception handler sees while a test runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any


@asynccontextmanager
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """Collects what the event loop's exception handler sees (an exception escaping a
    protocol callback or a task); the test asserts the list is empty."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    try:
        yield seen
    finally:
        loop.set_exception_handler(old)
