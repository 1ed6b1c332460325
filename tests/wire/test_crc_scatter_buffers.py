"""``crc32c_scatter`` takes its buffers as any iterable (a list, a tuple, a generator) and
reads the buffers it was given even where getting one runs Python code that changes the
caller's list (a ``__buffer__`` method, Python 3.12+): the compiled function works on a
copy of the sequence, as ``kvwire.aio._sendq`` does.  Both implementations are checked
(the compiled one where built)."""

from __future__ import annotations

import sys
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


@pytest.mark.skipif(sys.version_info < (3, 12), reason="a Python __buffer__ method needs Python 3.12")
@pytest.mark.parametrize("impl", _impls(), ids=lambda f: f.__module__)
def test_a_buffer_that_changes_the_list_while_it_is_read(impl: Scatter) -> None:
    """The buffers given are read, whatever the list becomes meanwhile (the compiled
    function read the list's freed item array before)."""
    lst: list[Any] = []

    class Changes:
        def __buffer__(self, flags: int) -> memoryview:
            lst.clear()  # frees the list's item array
            lst.extend(bytes(1) for _ in range(1000))
            return memoryview(b"abcd")

    keep = Changes()
    lst[:] = [keep, b"efgh", b"ijkl"]
    assert impl(lst, 12) == (package.crc32c(b"abcdefghijkl"), 3, 0)
