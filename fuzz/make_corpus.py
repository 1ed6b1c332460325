"""Write the seed corpora of valid frames: fuzz/corpus/frames, fuzz/corpus/server and
fuzz/corpus/session.

    python fuzz/make_corpus.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import handshake_bytes

from kvwire.wire import (
    Accept,
    Ack,
    Auth,
    Begin,
    BlockVersion,
    Challenge,
    Chunk,
    Credit,
    DecodeCost,
    GoAway,
    Hello,
    Ping,
    Pong,
    Report,
    Reset,
    Welcome,
    frame_bytes,
)

HERE = Path(__file__).resolve().parent

BEGIN = Begin(
    transfer_id=1, num_layers=2, num_kv_heads=1, head_dim=4, dtype_id=1, model="m",
    request_id="req-1", meta=b'{"prompt_tokens":8}', blocks=(BlockVersion(block=b"i7", version=3),),
)


def chunk(layer: int, kind: int, start: int, count: int, tokens: int = 8, tid: int = 1) -> Chunk:
    return Chunk(
        transfer_id=tid, layer=layer, kind=kind, codec_id=0, token_start=start, token_count=count,
        layer_tokens=tokens, params=b"", payload=bytes(range(8 * count)),
    )


SINGLE = {
    "hello": Hello(min_version=1, max_version=1, nonce=b"n" * 32, session_id=bytes(16), stream_index=0,
                   max_frame_size=1 << 22, codecs=("raw", "fp8"), fingerprint=bytes(16)),
    "challenge": Challenge(version=1, nonce=b"c" * 32),
    "auth": Auth(proof=b"p" * 32),
    "welcome": Welcome(session_id=b"S" * 16, max_frame_size=1 << 22, window=1 << 25, max_transfers=64,
                       codecs=("raw",), proof=b"w" * 32),
    "begin": BEGIN,
    "accept": Accept(transfer_id=1, layer_limit=2),
    "chunk": chunk(0, 0, 0, 4),
    "ack": Ack(transfer_id=1, layer=0, kind=0, token_start=0),
    "credit": Credit(transfer_id=1, layer_limit=2),
    "reset": Reset(transfer_id=1, code=12, message="cancelled"),
    "ping": Ping(opaque=42),
    "pong": Pong(opaque=42),
    "report": Report(transport_ns_per_mib=314_573, decode=(DecodeCost(codec_id=1, ns_per_melem=209_715),)),
    "goaway": GoAway(code=1, message="bye"),
}


def whole_transfer(begin: Begin = BEGIN) -> bytes:
    """BEGIN then every chunk of a 2-layer, 8-token transfer (two chunks per K and V)."""
    out = frame_bytes(begin)
    for layer in range(2):
        for kind in (0, 1):
            for start in (0, 4):
                out += frame_bytes(chunk(layer, kind, start, 4, tid=begin.transfer_id))
    return out


def session_seeds() -> dict[str, bytes]:
    """fuzz_session: byte 0 (0x80 fixes CRCs, 0x40 closes at the end, low 6 bits: read
    size), byte 1 (what the application does), byte 2 (fake seconds per read), frames."""
    begin = Begin(
        transfer_id=1, num_layers=2, num_kv_heads=1, head_dim=4, dtype_id=1, model="m",
        request_id="req-1", meta=b'{"prompt_tokens":8}', blocks=(BlockVersion(block=b"i:7", version=3),),
    )
    begin2 = Begin(
        transfer_id=2, num_layers=2, num_kv_heads=1, head_dim=4, dtype_id=1, model="m",
        request_id="req-2", meta=b"", blocks=(),
    )
    one, two = whole_transfer(begin), whole_transfer(begin2)
    return {
        "transfer_take": b"\xbf\x03\x00" + one,
        "transfer_hold": b"\xbf\x00\x00" + one,
        "transfer_split_close": b"\xc6\x03\x00" + one,
        "two_transfers": b"\xbf\x01\x00" + one + two,
        "registry_ok": b"\xbf\x0b\x00" + one,
        "registry_stale": b"\xbf\x1b\x00" + one,
        "registry_publish_fails": b"\xbf\x2b\x00" + one,
        "abort": b"\xbf\x07\x00" + one,
        "second_stream": b"\x8f\x43\x00" + one,
        "resume": b"\xcf\x83\x00" + one[: len(one) // 2],
        "slow_clock": b"\xbf\x02\x05" + one,
        "reset_by_client": b"\xbf\x03\x00" + frame_bytes(begin)
        + frame_bytes(chunk(0, 0, 0, 4)) + frame_bytes(Reset(transfer_id=1, code=12, message="x"))
        + frame_bytes(chunk(0, 0, 4, 4)),
        "duplicate_begin": b"\xbf\x03\x00" + frame_bytes(begin) + frame_bytes(begin) + one,
    }


def main() -> None:
    frames_dir = HERE / "corpus" / "frames"
    server_dir = HERE / "corpus" / "server"
    frames_dir.mkdir(parents=True, exist_ok=True)
    server_dir.mkdir(parents=True, exist_ok=True)
    # fuzz_frames: byte 0 picks the size limit (top bit: fix CRCs), byte 1 the read size
    for name, frame in SINGLE.items():
        (frames_dir / name).write_bytes(b"\x83\x40" + frame_bytes(frame))
    (frames_dir / "transfer").write_bytes(b"\x83\x40" + whole_transfer())
    # fuzz_server: byte 0 < 0x80 starts authenticated, 0x40 fixes CRCs, low 6 bits: read size
    transfer = whole_transfer()
    (server_dir / "transfer").write_bytes(b"\x7f" + transfer)
    (server_dir / "transfer_split").write_bytes(b"\x46" + transfer)
    (server_dir / "ping_reset").write_bytes(
        b"\x7f" + frame_bytes(BEGIN) + frame_bytes(Ping(opaque=1))
        + frame_bytes(Reset(transfer_id=1, code=12, message="x")) + frame_bytes(GoAway(code=0, message=""))
    )
    (server_dir / "duplicate_chunk").write_bytes(
        b"\x7f" + frame_bytes(BEGIN) + frame_bytes(chunk(0, 0, 0, 4)) + frame_bytes(chunk(0, 0, 0, 4))
    )
    hello, auth = handshake_bytes()
    (server_dir / "preauth_handshake").write_bytes(b"\xff" + hello + auth + transfer)
    for name in ("chunk", "begin", "credit", "ack", "report"):
        (server_dir / f"single_{name}").write_bytes(b"\x7f" + frame_bytes(SINGLE[name]))
    session_dir = HERE / "corpus" / "session"
    session_dir.mkdir(parents=True, exist_ok=True)
    for name, seed in session_seeds().items():
        (session_dir / name).write_bytes(seed)
    print(
        f"wrote {len(list(frames_dir.iterdir()))} frame seeds, {len(list(server_dir.iterdir()))} server seeds, "
        f"{len(list(session_dir.iterdir()))} session seeds"
    )


if __name__ == "__main__":
    main()
