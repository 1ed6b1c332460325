"""``--link`` is an Ethernet line rate: the emulator charges TCP payload as the frames
that carry it, kernel mode's tbf is set so the same payload crosses, and the report's
utilization is the TCP payload carried against what the link can carry of it."""

from __future__ import annotations

import pytest

from kvwire.bench import emulator
from kvwire.bench.emulator import LinkEmulator, payload_share, wire_per_payload_byte


def test_full_segments_carry_1448_of_every_1538_wire_bytes_at_mtu_1500() -> None:
    assert wire_per_payload_byte(1500) == pytest.approx(1538 / 1448)
    assert payload_share(1500) == pytest.approx(0.94148, abs=1e-5)
    assert payload_share(9000) == pytest.approx(8948 / 9038)
    assert wire_per_payload_byte(None) == payload_share(None) == 1.0


@pytest.mark.parametrize("mtu", [0, 575, 65537])
def test_an_mtu_outside_the_sane_range_is_refused(mtu: int) -> None:
    with pytest.raises(ValueError, match="MTU"):
        LinkEmulator("127.0.0.1", 9, rate_bps=1e9, mtu=mtu)


def _forward_policy(**kwargs: object) -> emulator._LinkPolicy:
    link = LinkEmulator("127.0.0.1", 9, burst=0.0, **kwargs)  # type: ignore[arg-type]
    forward, _ = link._policies(None)  # type: ignore[arg-type]
    return forward


@pytest.mark.parametrize(("mtu", "seconds"), [(1500, 1538 / 1448), (9000, 9038 / 8948), (None, 1.0)])
def test_the_emulator_charges_payload_as_the_ethernet_frames_that_carry_it(
    mtu: int | None, seconds: float
) -> None:
    # a second of the link's rate in TCP payload, handed over at t = 0 in 1448-byte reads
    policy = _forward_policy(rate_bps=8e6, mtu=mtu)
    through = [policy.when(0.0, 1448) for _ in range(1_000_000 // 1448)]
    assert through == sorted(through)
    assert through[-1] == pytest.approx(seconds * (1_000_000 // 1448) * 1448 / 1e6)


def test_a_saturated_ethernet_link_passes_rate_times_the_payload_share() -> None:
    # one read of 10 MB, cut into pieces: the last leaves when rate x share has carried it
    policy = _forward_policy(rate_bps=10e9, mtu=1500)
    pieces = policy.pieces(0.0, 10_000_000)
    assert sum(n for n, _ in pieces) == 10_000_000
    payload_bps = 10_000_000 * 8 / pieces[-1][1]
    assert payload_bps == pytest.approx(10e9 * 1448 / 1538)
    # a piece is about PIECE_TIME of the link: its payload, not its wire bytes
    assert pieces[0][0] == int(10e9 / 8 * emulator.PIECE_TIME * 1448 / 1538)
    assert pieces[0][1] == pytest.approx(emulator.PIECE_TIME, rel=1e-6)


def test_the_payload_link_layer_charges_payload_bytes_at_the_rate() -> None:
    policy = _forward_policy(rate_bps=10e9)
    pieces = policy.pieces(0.0, 10_000_000)
    assert 10_000_000 * 8 / pieces[-1][1] == pytest.approx(10e9)


def test_a_schedule_step_is_charged_the_same_framing() -> None:
    # 1 s at 8 Mbit/s then 16 Mbit/s: 1.5 MB of wire bytes cross by t = 1.25 s
    policy = _forward_policy(schedule=[(0.0, 8e6), (1.0, 16e6)], mtu=1500)
    payload = int(1_500_000 * 1448 / 1538)
    assert policy.when(0.0, payload) == pytest.approx(1.25, abs=1e-6)
