"""A stream's connect that fails with any exception ends as that stream's failure: open()
fails with a kvwire error at once (never waits past connect_timeout, never leaves a task
whose exception nobody retrieved), a resume gives up after its attempts, and the error's
text always gives a reason."""

from __future__ import annotations

import asyncio
import gc
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, cast

import pytest
import uvloop

import kvwire
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)

# Generous: each test fails at once when fixed, and hangs without a bound when not.
BOUND = 20.0


class _Failing:
    """A loop whose create_connection raises ``failure`` (``None``: connects as usual)."""

    failure: BaseException | None = None

    async def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self.failure is not None:
            raise self.failure
        return await super().create_connection(*args, **kwargs)  # type: ignore[misc]


class FailingAsyncioLoop(_Failing, asyncio.SelectorEventLoop):
    pass


class FailingUvloop(_Failing, uvloop.Loop):  # type: ignore[misc]
    pass


LOOPS = {"asyncio": FailingAsyncioLoop, "uvloop": FailingUvloop}


def run(loop_class: type[_Failing], main: Callable[[], Coroutine[Any, Any, None]]) -> list[dict[str, Any]]:
    """Run ``main()`` on a fresh ``loop_class`` loop; return what reached the loop's
    exception handler (a task's exception never retrieved, a callback's)."""
    unhandled: list[dict[str, Any]] = []

    async def checked() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unhandled.append(ctx))
        try:
            await main()
        finally:
            gc.collect()  # a task that ended with an exception nobody retrieved says so now
            await asyncio.sleep(0)

    with asyncio.Runner(loop_factory=cast(Callable[[], asyncio.AbstractEventLoop], loop_class)) as runner:
        runner.run(checked())
    return unhandled


@pytest.mark.parametrize("failure", [RuntimeError("injected"), AttributeError("'str' object has no attribute 'wrap_bio'")],
                         ids=["RuntimeError", "AttributeError"])
@pytest.mark.parametrize("loop_class", LOOPS.values(), ids=LOOPS.keys())
def test_an_unexpected_exception_while_connecting_fails_open_at_once(
    loop_class: type[_Failing], failure: Exception
) -> None:
    seen: list[tuple[BaseException, int]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, _Failing)
        loop.failure = failure
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            peer = kvwire.connect("127.0.0.1", server.port, secret=SECRET, connect_timeout=BOUND)
            with pytest.raises(kvwire.ConnectionLostError) as caught:
                # well before connect_timeout: the failure is known at once
                await asyncio.wait_for(peer.open(), BOUND / 2)
            seen.append((caught.value, server.port))
            assert peer.closed

    assert run(loop_class, main) == []
    (err, port), = seen
    assert str(err) == f"cannot connect to 127.0.0.1:{port}: {type(failure).__name__}: {failure}"
    assert err.__cause__ is failure


@pytest.mark.parametrize("loop_class", LOOPS.values(), ids=LOOPS.keys())
def test_a_usage_error_while_connecting_is_raised_as_it_is(loop_class: type[_Failing]) -> None:
    failure = kvwire.UsageError("not usable")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, _Failing)
        loop.failure = failure
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            peer = kvwire.connect("127.0.0.1", server.port, secret=SECRET, connect_timeout=BOUND)
            with pytest.raises(kvwire.UsageError) as caught:
                await asyncio.wait_for(peer.open(), BOUND / 2)
            assert caught.value is failure

    assert run(loop_class, main) == []


@pytest.mark.parametrize(("failure", "text"), [
    pytest.param(failure, text, id=type(failure).__name__) for failure, text in [
        (ConnectionResetError(), "cannot connect to 127.0.0.1:{port}: ConnectionResetError"),
        (OSError(), "cannot connect to 127.0.0.1:{port}: OSError"),
        (ssl.SSLError(), "TLS handshake with 127.0.0.1:{port} failed: SSLError"),  # str() is '()'
        (ssl.SSLCertVerificationError(), "TLS certificate verification failed: SSLCertVerificationError"),
        (RuntimeError(), "cannot connect to 127.0.0.1:{port}: RuntimeError"),
    ]
])
def test_a_failure_without_a_text_is_named_by_its_type(failure: Exception, text: str) -> None:
    """Not 'cannot connect to 127.0.0.1:35303: ' (a reset during TLS gave an empty reason)."""
    seen: list[tuple[BaseException, int]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, _Failing)
        loop.failure = failure
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            peer = kvwire.connect("127.0.0.1", server.port, secret=SECRET, connect_timeout=BOUND)
            with pytest.raises(kvwire.KvwireError) as caught:
                await asyncio.wait_for(peer.open(), BOUND / 2)
            seen.append((caught.value, server.port))

    assert run(FailingAsyncioLoop, main) == []
    (err, port), = seen
    assert str(err) == text.format(port=port)


@pytest.mark.parametrize("loop_class", LOOPS.values(), ids=LOOPS.keys())
def test_a_resume_whose_connects_fail_unexpectedly_gives_up(loop_class: type[_Failing]) -> None:
    """A stream broken after open(), reconnected on a loop whose connects raise
    RuntimeError: the session tries max_reconnects times and is lost (a send fails with
    ConnectionLostError), never waiting for a connect that ended without telling."""
    layers = make_layers(SPEC.num_layers, 64, SPEC.num_kv_heads, SPEC.head_dim, seed=3)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, _Failing)
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, connect_timeout=BOUND,
                                      reconnect_backoff=0.01, max_reconnects=2) as peer:
                await asyncio.wait_for(peer.send("before", SPEC, layers), BOUND)
                loop.failure = RuntimeError("injected")
                transport = peer.streams[0].transport
                assert transport is not None
                transport.abort()
                with pytest.raises(kvwire.ConnectionLostError):
                    await asyncio.wait_for(peer.send("after", SPEC, layers), BOUND)
                assert peer.core.broken is not None

    assert run(loop_class, main) == []
