"""``crc32c_scatter`` takes its buffers as any iterable (a list, a tuple, a generator) and
leaves the caller's sequence as it was: the compiled function works on a copy of it, as
``kvwire.aio._sendq`` does, so a buffer whose ``__buffer__`` method (Python 3.12+) changes
the caller's list cannot free what it reads.  Both implementations are checked (the
compiled one where built)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import crc32c as package
import pytest

from kvwire.wire import crc

Scatter = Callable[..., tuple[int, int, int]]


def _impls() -> list[Scatter]:
    impls: list[Scatter] = [crc._crc32c_scatter]
    if crc.ext is not None:
        impls.append(crc.ext.crc32c_scatter)
    return impls


@pytest.mark.parametrize("impl", _impls(), ids=lambda f: f.__module__)
def test_a_list_a_tuple_or_an_iterable_of_buffers(impl: Scatter) -> None:
    bufs: list[Any] = [b"abcd", bytearray(b"efgh"), memoryview(b"ijkl")]
    want = package.crc32c(b"abcdefghijkl", 5)
    assert impl(bufs, 12, 5) == (want, 3, 0)
    assert impl(tuple(bufs), 12, 5) == (want, 3, 0)
    assert impl(iter(bufs), 12, 5) == (want, 3, 0)
    assert impl((b for b in bufs), 10, 5) == (package.crc32c(b"abcdefghij", 5), 2, 2)
    assert bufs == [b"abcd", bytearray(b"efgh"), memoryview(b"ijkl")]  # the list is left as it was
    with pytest.raises(TypeError):
        impl(7, 1)
