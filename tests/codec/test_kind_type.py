"""A chunk's ``kind`` is a TensorKind or an int that is not a bool (docs/codecs.md, Input
rules): a float, a bool or a numpy float equal to 0 or 1 is the caller's UsageError at
every codec entry point, not K or V.  (The enum's lookup is by hash and equality, so
``TensorKind(1.0)`` and ``TensorKind(True)`` were V.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvwire.codec import Codec, TensorKind, available_codecs, get_codec
from kvwire.codec import gpu as g
from kvwire.errors import UsageError

ALL = available_codecs()
SHAPE = (4, 2, 8)
NOT_INTS = [0.0, 1.0, -0.0, True, False, np.float64(1.0), np.float32(0.0), np.True_, np.False_, 1 + 0j,
            np.array([1])]
INTS = [0, 1, np.int64(0), np.int8(1), np.uint32(1), TensorKind.K, TensorKind.V]


def _entry_points(name: str, kind: Any, chunk_kind: TensorKind) -> list[tuple[str, Callable[[], Any]]]:
    """Every call of codec ``name`` that takes a kind, each given ``kind`` (the chunk
    decoded is one encoded as ``chunk_kind``)."""
    codec = get_codec(name)
    x = np.linspace(-1, 1, 4 * 2 * 8, dtype=np.float16).reshape(SHAPE)
    chunk = codec.encode(x, chunk_kind)
    spans = np.array([0, x.nbytes], np.int64)
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("encode", lambda: codec.encode(x, kind)),
        ("decode", lambda: codec.decode(chunk.params, chunk.payload, shape=SHAPE, dtype="float16", kind=kind)),
    ]
    if hasattr(codec, "encode_numpy"):
        calls.append(("encode_numpy", lambda: codec.encode_numpy(x, kind)))
    if hasattr(codec, "decode_numpy"):
        calls.append(("decode_numpy", lambda: codec.decode_numpy(chunk.params, chunk.payload, shape=SHAPE,
                                                                 dtype="float16", kind=kind)))
    # (raw's range calls are copies that never look at the kind: test_codec_arguments.py)
    if type(codec).encode_ranges is not Codec.encode_ranges and not name.startswith("raw"):
        calls.append(("encode_ranges", lambda: codec.encode_ranges(
            x.reshape(-1).view(np.uint8).data, spans.data, SHAPE, "float16", kind)))
    if type(codec).decode_ranges is not Codec.decode_ranges and not name.startswith("raw"):
        base = bytearray(x.nbytes)
        calls.append(("decode_ranges", lambda: codec.decode_ranges(
            chunk.params, chunk.payload, memoryview(base), spans.data, shape=SHAPE, dtype="float16", kind=kind)))
    return calls


@pytest.mark.parametrize("kind", NOT_INTS, ids=repr)
def test_tensor_kind_refuses_what_is_not_an_int(kind: Any) -> None:
    with pytest.raises(UsageError, match=r"kind must be TensorKind\.K or TensorKind\.V \(0 or 1\), got "):
        TensorKind(kind)


@pytest.mark.parametrize("kind", INTS, ids=repr)
def test_tensor_kind_takes_a_kind_or_an_int(kind: Any) -> None:
    got = TensorKind(kind)
    assert type(got) is TensorKind and got == int(kind)
    assert TensorKind(got) is got


@pytest.mark.parametrize("kind", [2, -1, np.int64(7)], ids=repr)
def test_an_int_other_than_0_or_1_is_still_refused(kind: Any) -> None:
    with pytest.raises(UsageError, match=r"kind must be TensorKind\.K or TensorKind\.V \(0 or 1\), got "):
        TensorKind(kind)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("kind", [0.0, 1.0, True, False, np.float64(1.0)], ids=repr)
def test_every_codec_entry_point_refuses_a_float_or_bool_kind(name: str, kind: Any) -> None:
    calls = _entry_points(name, kind, TensorKind.V)
    assert {"encode", "decode"} <= {what for what, _ in calls}
    for what, call in calls:
        try:
            call()
        except UsageError as exc:
            # (int4's decode names itself: "int4: unknown tensor kind 1.0")
            assert "kind" in str(exc) and repr(kind) in str(exc), (what, str(exc))
        else:
            pytest.fail(f"{name} {what} took kind {kind!r}")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("kind", [np.int64(1), np.uint8(0), TensorKind.V, 0], ids=repr)
def test_every_codec_entry_point_takes_an_int_kind(name: str, kind: Any) -> None:
    for _what, call in _entry_points(name, kind, TensorKind(int(kind))):
        call()


@pytest.mark.parametrize("kind", [0.0, 1.0, True, np.float64(1.0)], ids=repr)
def test_the_gpu_int4_plans_refuse_a_float_or_bool_kind(kind: Any) -> None:
    with pytest.raises(UsageError, match="kind must be"):
        g.plan_encode("int4", 32, (64, 2, 16), "float16", kind, 32, x_aligned=True)
    with pytest.raises(UsageError, match="kind must be"):
        g.plan_decode("int4", bytes([32]), (64, 2, 16), "float16", kind, out_aligned=True)
