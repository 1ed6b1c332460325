"""The receiver works out the wire ids of the codecs it accepts once, when it is made
(a frozenset every CHUNK is checked against), not as chunks in them arrive."""

from __future__ import annotations

from kvwire.codec import available_codecs, get_codec
from kvwire.session.receiver import ReceiverConfig, ReceiverCore
from tests.session.receiver_harness import SECRET


def test_the_accepted_codec_ids_are_known_before_any_chunk() -> None:
    core = ReceiverCore(ReceiverConfig(secret=SECRET, codecs=("raw", "fp8")))
    assert core._codecs_accepted == frozenset({get_codec("raw").codec_id, get_codec("fp8").codec_id})
    assert isinstance(core._codecs_accepted, frozenset)


def test_every_registered_codec_named_is_accepted_and_no_other() -> None:
    names = tuple(available_codecs())
    core = ReceiverCore(ReceiverConfig(secret=SECRET, codecs=names))
    assert core._codecs_accepted == frozenset(get_codec(n).codec_id for n in names)
    only_raw = ReceiverCore(ReceiverConfig(secret=SECRET, codecs=("raw", "no-such-codec")))
    assert only_raw._codecs_accepted == frozenset({get_codec("raw").codec_id})
