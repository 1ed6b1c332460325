"""atheris harness: the frame decoder.  Only kvwire.ProtocolError may escape ``feed``.

    python fuzz/fuzz_frames.py fuzz/corpus/frames -runs=20000
"""

from __future__ import annotations

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports():
    import kvwire
    from kvwire.wire import FrameDecoder

from _common import fix_crcs

LIMITS = (16, 1024, 16 * 1024, 64 * 1024)


def TestOneInput(data: bytes) -> None:
    if len(data) < 2:
        return
    max_body = LIMITS[data[0] % len(LIMITS)]  # byte 0, low bits: the body size limit
    step = data[1] + 1  # byte 1: the size of each read
    rest = data[2:]
    if data[0] & 0x80:  # byte 0, top bit: fix every CRC so the body parsers are reached
        rest = fix_crcs(rest)
    dec = FrameDecoder(max_body)
    for i in range(0, len(rest), step):
        try:
            got = dec.feed(rest[i : i + step])
        except kvwire.ProtocolError:
            return
        for _frame, size in got:
            assert size >= 12, size
        assert dec.buffered <= max_body + 12, (dec.buffered, max_body)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
