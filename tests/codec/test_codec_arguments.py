"""Arguments of the wrong type or value are the caller's UsageError, found before anything
is sized, allocated or decoded; a peer's payload that cannot be right is its ProtocolError."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.codec import Int4Codec, TensorKind
from kvwire.errors import UsageError


@pytest.mark.parametrize("group", [16.0, 32.5, "32", np.float32(8), True, None, 0, 256, -1])
def test_int4_group_must_be_an_int_in_range(group: Any) -> None:
    # A float group was taken and failed at the first encode with a TypeError; a string
    # failed the range comparison with one.
    with pytest.raises(UsageError, match="group size must be an int"):
        Int4Codec(group)


@settings(max_examples=40, deadline=None)
@given(group=st.integers(1, 255), numpy_int=st.booleans())
def test_int4_group_takes_any_integer_in_range(group: int, numpy_int: bool) -> None:
    codec = Int4Codec(np.int64(group) if numpy_int else group)  # type: ignore[arg-type]
    assert type(codec.group) is int and codec.group == group
    x = np.linspace(-1, 1, 4 * 2 * 8, dtype=np.float16).reshape(4, 2, 8)
    chunk = codec.encode(x, TensorKind.K)
    assert chunk.params == bytes([group])

