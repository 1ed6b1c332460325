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


@pytest.mark.parametrize("mtu", [0, 575, 65536])
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


# -- kernel mode: tbf's rate ------------------------------------------------------------------


def test_tbf_is_given_the_line_rate_less_the_framing_it_does_not_count() -> None:
    from kvwire.bench.netns import tbf_rate

    # tbf counts a full segment as its 1500-byte IP packet and 14-byte Ethernet header
    assert tbf_rate(10e9, 1500) == pytest.approx(10e9 * 1514 / 1538)
    assert tbf_rate(10e9, 9000) == pytest.approx(10e9 * 9014 / 9038)
    assert tbf_rate(10e9, 1500, "payload") == pytest.approx(10e9 * 1514 / 1448)
    assert tbf_rate(10e9, None) == 10e9
    with pytest.raises(ValueError, match="MTU"):
        tbf_rate(10e9, 100)


def test_the_tc_command_of_an_ethernet_link_and_of_a_plain_one() -> None:
    from kvwire.bench.netns import NetnsLink

    framed = NetnsLink(rate_bps=1e9, burst_bytes=300_000, mtu=1500)
    cmd = framed._tc_shape("kvwx", 1e9, "replace")
    assert cmd[:7] == ["tc", "qdisc", "replace", "dev", "kvwx", "root", "tbf"]
    assert cmd[cmd.index("rate") + 1] == f"{int(1e9 * 1514 / 1538)}bit"
    assert cmd[cmd.index("burst") + 1] == "300000"
    # other callers (benchmarks/peers.py) keep tbf at the rate they give
    plain = NetnsLink(rate_bps=1e9, burst_bytes=300_000)
    assert plain.mtu is None
    cmd = plain._tc_shape("kvwx", 1e9, "change")
    assert cmd[cmd.index("rate") + 1] == "1000000000bit"


def test_the_veths_payload_is_its_bytes_less_the_headers_of_each_packet() -> None:
    from kvwire.bench.netns import VETH_HEADERS, payload_of

    assert VETH_HEADERS == 14 + 20 + 32
    # two offload packets of 10 segments each, and a pure ACK
    assert payload_of(2 * (66 + 14480) + 66, 3) == 2 * 14480
    assert payload_of(0, 0) == 0


# -- the bench's configuration and report -------------------------------------------------------


def test_the_bench_takes_an_mtu_and_a_link_layer() -> None:
    from kvwire.bench.runner import BenchConfig
    from kvwire.errors import UsageError

    cfg = BenchConfig(link_bps=10e9)
    assert (cfg.link_layer, cfg.mtu) == ("ethernet", 1500)
    assert cfg.payload_share == pytest.approx(1448 / 1538)
    assert BenchConfig(link_bps=10e9, mtu=9000).payload_share == pytest.approx(8948 / 9038)
    assert BenchConfig(link_bps=10e9, link_layer="payload").payload_share == 1.0
    with pytest.raises(UsageError, match="--mtu"):
        BenchConfig(link_bps=10e9, mtu=70000)
    with pytest.raises(UsageError, match="--link-layer"):
        BenchConfig(link_bps=10e9, link_layer="atm")


def test_the_table_names_what_the_link_carries_of_tcp_payload() -> None:
    from kvwire.bench.command import _capacity_text

    r = {"link_gbps": 10.0, "link_layer": "ethernet", "mtu": 1500, "payload_capacity_gbps": 10 * 1448 / 1538}
    assert _capacity_text(r) == "9.415 Gbit/s (Ethernet, MTU 1500)"
    assert _capacity_text({**r, "link_layer": "payload", "payload_capacity_gbps": 10.0}) == "10 Gbit/s (--link-layer payload)"


def test_the_header_line_names_the_line_rate_and_the_payload_it_carries() -> None:
    from kvwire.bench.command import _where
    from kvwire.bench.runner import BenchConfig

    where = _where(BenchConfig(model="tiny", link_bps=10e9, mtu=9000))
    assert where == "emulated link 10 Gbit/s Ethernet, MTU 9000 (9.9 Gbit/s of TCP payload), RTT 0 s"


def test_the_help_describes_mtu_and_link_layer(capsys: pytest.CaptureFixture[str]) -> None:
    from kvwire.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--mtu BYTES" in out and "--link-layer {ethernet,payload}" in out
    assert "(MTU-52)/(MTU+38)" in out
