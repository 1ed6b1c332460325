"""``crc32c_scatter``: the pure-Python fallback (``crc._crc32c_scatter``, what runs without
the extension) gives what the compiled function gives on odd arguments too: the same
result, or an exception of the same type.  ``value`` is taken modulo 2**32 even where no
byte is read (``nbytes`` 0), and ``nbytes`` must be an index-sized integer (a float is a
TypeError).  The comparison needs the compiled function; the fallback runs there with
the ``crc32c`` package's function per buffer, as it does without the extension."""

from __future__ import annotations

from typing import Any

import crc32c as package
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvwire.wire import crc
from tests.conftest import needs_extension

EXT = "kvwire.wire._crc32c"

buffer = st.one_of(
    st.binary(max_size=40),
    st.binary(max_size=40).map(bytearray),
    st.binary(max_size=40).map(memoryview),
    st.integers(1, 12).map(lambda n: np.arange(n, dtype=np.float32)),
    st.integers(1, 4).map(lambda n: np.arange(4 * n, dtype=np.uint8).reshape(n, 4)),
    st.integers(2, 24).map(lambda n: np.arange(n, dtype=np.uint8)[::2]),  # not contiguous
    st.integers(2, 24).map(lambda n: memoryview(bytes(n))[::2]),  # not contiguous
    st.sampled_from(["ab", 7, None, 1.5]),  # not buffers
)
buffers = st.one_of(
    st.lists(buffer, max_size=5),
    st.lists(buffer, max_size=5).map(tuple),
    st.sampled_from([7, None, "abc", b"abc"]),
)
integer = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-5, 200),
    st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**32 - 1, 2**32, True, False]),
)
number = st.one_of(integer, st.sampled_from([2.0, 0.0, -1.0, 1.5, "3", None]))


def outcome(fn: Any, bufs: Any, nbytes: Any, value: Any, with_value: bool) -> Any:
    if isinstance(bufs, list):
        bufs = list(bufs)  # each call gets its own list
    try:
        return fn(bufs, nbytes, value) if with_value else fn(bufs, nbytes)
    except Exception as exc:  # the type is what is compared
        return type(exc)


@needs_extension(crc.ext is not None, EXT)
@settings(max_examples=400, deadline=None)
@given(bufs=buffers, nbytes=number, value=number, with_value=st.booleans())
@example(bufs=[b"ab"], nbytes=0, value=-1, with_value=True)
@example(bufs=[], nbytes=0, value=2**40, with_value=True)
@example(bufs=[b"ab"], nbytes=2.0, value=0, with_value=False)
@example(bufs=[b"ab"], nbytes=2**63, value=0, with_value=False)
@example(bufs=[np.arange(12, dtype=np.uint8)[::2]], nbytes=3, value=0, with_value=False)
def test_the_fallback_gives_what_the_compiled_function_gives(
    bufs: Any, nbytes: Any, value: Any, with_value: bool,
) -> None:
    assert crc.ext is not None
    compiled = outcome(crc.ext.crc32c_scatter, bufs, nbytes, value, with_value)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(crc, "crc32c", package.crc32c)
        fallback = outcome(crc._crc32c_scatter, bufs, nbytes, value, with_value)
    assert fallback == compiled


@pytest.mark.parametrize(("args", "want"), [
    (([b"ab"], 0, -1), (0xFFFFFFFF, 0, 0)),
    (([], 0, 2**40 + 5), (5, 0, 0)),
    ((iter([b"ab"]), 2), (crc.crc32c(b"ab"), 1, 0)),
])
def test_value_is_taken_modulo_2_32_and_buffers_may_be_any_iterable(args: tuple[Any, ...], want: Any) -> None:
    assert crc._crc32c_scatter(*args) == want


def test_nbytes_must_be_an_index() -> None:
    with pytest.raises(TypeError):
        crc._crc32c_scatter([b"ab"], 2.0)
