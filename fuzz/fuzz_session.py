"""atheris harness: the receiving session core (``kvwire.session.ReceiverCore``).

Each input drives a fresh core whose first connection a real handshake with a known secret
(fixed nonces) has already opened (a clone of one opened once), so the fuzzer spends its time on what an authenticated
client can send; the application around the core is driven by the input too.

Input layout:

- byte 0: bit 7 fixes every frame's CRC (so mutated bodies reach the session logic);
  bit 6 sends ``b""`` (the peer closed) after the last read; the low 6 bits + 1 are the
  size of each read;
- byte 1, what the application does: bit 0 takes every layer as soon as it is ready;
  bit 1 claims every transfer that arrives; bit 2 aborts every transfer that arrives;
  bit 3 turns the registry gate on; bit 4 answers registry checks "stale"; bit 5 answers
  registry publishes with an error; bit 6 opens a second stream of the session (a replayed
  handshake naming it) after the first read; bit 7 replays the handshake on a new
  connection after the peer closed (a resume);
- byte 2: seconds of fake time that pass after each read (timers fire as they fall due);
- the rest: the byte stream of the first connection after its AUTH.

Properties: nothing escapes ``receive_data`` or ``handle_timer``; every ``TransferFailed``
carries a ``KvwireError``; ``buffered_bytes`` stays within ``0..max_buffer_bytes``; and once
every transfer has been taken or aborted (and the timers have fired) it is back to 0.

    python fuzz/fuzz_session.py fuzz/corpus/session -runs=20000
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports():
    import kvwire
    from kvwire.session import receiver as rx

from _common import SECRET, Cloner, check_cloner, fix_crcs, fixed_nonce, session_handshake_bytes
from make_corpus import session_seeds

# A new session (stream 0), a second stream of it (stream 1), stream 0 again (a resume).
(HELLO, AUTH), (HELLO2, AUTH2), (HELLO3, AUTH3) = session_handshake_bytes()


def opened_core(registry: bool) -> rx.ReceiverCore:
    """A core whose connection 1 the recorded handshake has opened (a new session)."""
    core = rx.ReceiverCore(
        rx.ReceiverConfig(
            secret=SECRET, max_frame_size=64 * 1024, window=128 * 1024, max_transfers=4,
            max_sessions=4, max_streams=4, max_tokens=4096, transfer_buffer_bytes=4096,
            max_layer_bytes=64 * 1024, max_chunk_bytes=32 * 1024, max_buffer_bytes=96 * 1024,
            registry=registry,
        ),
        nonce_source=fixed_nonce,
    )
    core.connection_made(1, 0.0)
    for part in (HELLO, AUTH):
        core.receive_data(1, part, 0.0)
        core.data_to_send(1)
    while core.next_event() is not None:
        pass
    assert not core.is_closed(1)
    return core


# Each input starts from a clone of one of these (the same state as replaying HELLO and
# AUTH, at a fraction of the cost).  Checked here: a clone equals a replayed handshake, and
# using a clone leaves the original as it was.
CLONE = {registry: Cloner(opened_core(registry)) for registry in (False, True)}
for _registry, _cloner in CLONE.items():
    check_cloner(
        _cloner, functools.partial(opened_core, _registry),
        lambda core: core.receive_data(1, session_seeds()["transfer_take"][3:], 0.0),
    )


def TestOneInput(data: bytes) -> None:
    if len(data) < 3:
        return
    mode, app, tick, rest = data[0], data[1], data[2], data[3:]
    if mode & 0x80:
        rest = fix_crcs(rest)
    step = (mode & 0x3F) + 1
    core = CLONE[bool(app & 0x08)]()
    limit = core.config.max_buffer_bytes
    now = 0.0
    keys: dict[tuple[bytes, int], bool] = {}  # arrived transfer -> still alive
    ready: list[tuple[tuple[bytes, int], int]] = []

    def application() -> None:
        while (ev := core.next_event()) is not None:
            if isinstance(ev, rx.TransferArrived):
                keys[ev.key] = True
                if app & 0x02:
                    core.claim(ev.key, now)
                if app & 0x04:
                    core.abort(ev.key, "fuzz", now)
            elif isinstance(ev, rx.LayerReady):
                ready.append((ev.key, ev.layer))
            elif isinstance(ev, rx.TransferFailed):
                assert isinstance(ev.error, kvwire.KvwireError), ev.error
                keys[ev.key] = False
            elif isinstance(ev, rx.RegistryCheck):
                core.registry_checked(ev.key, [ev.blocks[0][0]] if app & 0x10 else [], None, now)
            elif isinstance(ev, rx.RegistryPublish):
                err = kvwire.KvwireError("registry down") if app & 0x20 else None
                core.registry_published(ev.key, err, now)
        if app & 0x01:
            while ready:
                key, layer = ready.pop()
                with contextlib.suppress(kvwire.KvwireError):
                    core.take_layer(key, layer, now)
        assert 0 <= core.buffered_bytes <= limit, core.buffered_bytes

    def feed(cid: int, chunk: bytes) -> None:
        core.receive_data(cid, chunk, now)
        core.data_to_send(cid)
        application()

    def tick_timers() -> None:
        nonlocal now
        if tick:
            now += tick
            timer = core.get_timer()
            if timer is not None and timer <= now:
                core.handle_timer(now)
                application()

    for i in range(0, len(rest), step):
        feed(1, rest[i : i + step])
        if i == 0 and app & 0x40:
            core.connection_made(2, now)
            feed(2, HELLO2)
            feed(2, AUTH2)
        tick_timers()
    if mode & 0x40:
        feed(1, b"")
        if app & 0x80:
            core.connection_made(3, now)
            feed(3, HELLO3)
            feed(3, AUTH3)
        tick_timers()

    # The application lets go of everything: take what is ready, abort the rest.
    while ready:
        key, layer = ready.pop()
        with contextlib.suppress(kvwire.KvwireError):
            core.take_layer(key, layer, now)
    for key in list(keys):
        core.abort(key, "done", now)
    application()
    for cid in core.connections:
        feed(cid, b"")
    now += 1e6
    core.handle_timer(now)
    application()
    assert core.buffered_bytes == 0, (core.buffered_bytes, keys)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
