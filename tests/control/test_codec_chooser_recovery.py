"""``auto`` after a path slowed down for a while and came back, where the compact codec
that led meanwhile is slower than the restored path: its encoder then paces the sender,
the estimate is that pace (app-limited), and raw must still get to show what the path
carries (the model's raw probe, measured goodput's stints); and what that costs where the
compact codec really is the better one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvwire.control import CodecCandidate, CodecChooser, codec_choice
from kvwire.control.goodput import GoodputMeter
from tests.control import estsim

GB = 1e9
MIB = 1 << 20
G = estsim.GBIT
RATIOS = {"raw": 1.0, "int4": 0.375}
ENCODE = {"int4": 2 * GB}  # KV bytes/s: 0.75 GB/s of wire, 6 Gbit/s
DECODE = {"int4": 6 * GB}


# -- the model's raw probe ---------------------------------------------------------------------------


def _model(**kw: Any) -> CodecChooser:
    return CodecChooser([CodecCandidate(name="raw", size_ratio=1.0),
                         CodecCandidate(name="int4", size_ratio=0.375, encode_bytes_per_s=2 * GB)],
                        pipeline="full", probe_interval=0.1, **kw)


def test_the_raw_probe_of_an_app_limited_path_lasts_a_round_trip_of_it() -> None:
    """One raw chunk among int4's was measured at the rate sent over the round trip
    before it, mostly int4's encoder's; raw goes on until a choice made a round trip of
    the path after the first, so that the last raw chunk's sample is raw's."""
    c = _model()
    c.observe_path_rtt(0.002)
    assert c.choose(8e9).codec == "int4"  # 1 GB/s of wire: int4 (encoder-bound) delivers 2
    # a chunk goes on the wire every 0.8 ms (raw at 40 Gbit/s)
    got = [c.choose(8e9, app_limited=True, now=5.0 + i * 0.0008) for i in range(7)]
    assert [(x.codec, x.probe) for x in got] == [("raw", True)] * 4 + [("int4", False)] * 3
    # the next run no sooner than probe_interval after this one began, nor than its
    # length (2.4 ms, from the first raw choice to the last) over RAW_RUN_SHARE
    after = 5.0 + max(0.1, 0.0024 / codec_choice.RAW_RUN_SHARE)
    assert [c.choose(8e9, app_limited=True, now=t).codec for t in (5.05, after - 1e-6)] == ["int4"] * 2
    again = c.choose(8e9, app_limited=True, now=after + 1e-6)
    assert (again.codec, again.probe) == ("raw", True)
    # a path of unknown length: one chunk, as before
    u = _model()
    got = [u.choose(8e9, app_limited=True, now=5.0 + i * 0.0008) for i in range(3)]
    assert [x.codec for x in got] == ["raw", "int4", "int4"]


def test_a_run_stops_when_raw_is_chosen_and_long_runs_are_spaced_by_their_length() -> None:
    c = _model()
    c.observe_path_rtt(0.02)  # a long path: a run spans 20 ms
    times = [1.0 + i * 0.004 for i in range(8)]
    got = [c.choose(8e9, app_limited=True, now=t).codec for t in times]
    assert got == ["raw"] * 6 + ["int4"] * 2  # the choice at 1.020 is the last of the run
    # 20 ms of raw: the next run no sooner than 20 ms / RAW_RUN_SHARE later
    wait = 0.020 / codec_choice.RAW_RUN_SHARE
    assert not any(c.choose(8e9, app_limited=True, now=1.0 + wait * f).probe for f in (0.5, 0.9, 0.99))
    assert c.choose(8e9, app_limited=True, now=1.0 + wait + 1e-9).codec == "raw"
    # the path turned out fast: the model chooses raw itself, and the run ends there
    r = _model()
    r.observe_path_rtt(0.002)
    r.observe_transport(1 << 20, 0.0, "raw")  # (on a short path raw is held until this is measured)
    assert r.choose(8e9, app_limited=True, now=2.0).probe
    choice = r.choose(80e9, now=2.0008)
    assert (choice.codec, choice.probe) == ("raw", False)
    after = r.choose(8e9, now=2.0016)  # the path slow again: int4, and no raw from the run
    assert (after.codec, after.probe) == ("int4", False)


# -- measured goodput --------------------------------------------------------------------------------


def _measured(**kw: Any) -> CodecChooser:
    kw.setdefault("meter", GoodputMeter(sample_acks=2, min_acks=2))
    return CodecChooser.from_ratios(RATIOS, measure_goodput=True, tolerance=0.05, hysteresis=0.03,
                                    explore_after=40, **kw)


class Driver:
    """One chunk at a time, acknowledged at once at its codec's true rate, with the
    estimate and app-limited flag the phase gives."""

    def __init__(self, ch: CodecChooser) -> None:
        self.ch, self.now = ch, 0.0
        self.sent: list[str] = []

    def run(self, chunks: int, true: dict[str, float], bandwidth_bps: float, app_limited: bool) -> list[str]:
        out = []
        for _ in range(chunks):
            codec = self.ch.choose(bandwidth_bps, app_limited=app_limited, now=self.now).codec
            self.now += 4 * MIB / true[codec]
            self.ch.observe_delivered(codec, 4 * MIB, self.now)
            out.append(codec)
        self.sent += out
        return out


def test_an_app_limited_estimate_does_not_keep_raw_from_being_explored() -> None:
    """int4 leads at its encoder's 2 GB/s, whose 6 Gbit/s of wire is the estimate. Raw at
    twice that, 1.5 GB/s, is below int4: while the path sets the pace at that rate raw is
    not explored, but while int4's encoder does (app-limited) the path may carry far
    more, and raw is explored (it delivers 5)."""
    ch = _measured()
    d = Driver(ch)
    d.run(100, {"raw": 5 * GB, "int4": 2 * GB}, 40e9, app_limited=False)
    d.run(300, {"raw": 0.25 * GB, "int4": 0.67 * GB}, 2e9, app_limited=False)  # the path fell to 2 Gbit/s
    assert ch.leader == "int4"
    true = {"raw": 5 * GB, "int4": 2 * GB}
    sent = d.run(3000, true, 6e9, app_limited=False)  # (longer than any wait)
    assert "raw" not in sent and ch.meter.rate("int4") == pytest.approx(2 * GB)
    sent = d.run(100, true, 6e9, app_limited=True)
    assert "raw" in sent[:10] and ch.leader == "raw"


def test_a_wait_is_cut_when_the_path_grew_since_the_measurement() -> None:
    """Raw led a 40 Gbit/s path that fell to 2: measured there far behind int4, it waits
    what its stints cost (up to explore_max, 2560 chunks: 4.5 s at int4's 2 GB/s). Once
    the path is PATH_GROWTH times faster than it was since, that measurement says
    nothing of it: raw waits explore_after chunks."""
    ch = _measured()
    d = Driver(ch)
    d.run(100, {"raw": 5 * GB, "int4": 2 * GB}, 40e9, app_limited=False)
    assert ch.leader == "raw"
    d.run(200, {"raw": 0.25 * GB, "int4": 0.67 * GB}, 2e9, app_limited=False)
    assert ch.leader == "int4"
    # (not app-limited here, and raw at twice the estimate catches int4: only raw's wait
    # can hold it back)
    sent = d.run(100, {"raw": 5 * GB, "int4": 2 * GB}, 3.9e9, app_limited=False)
    assert "raw" not in sent  # less than twice the lowest: the wait holds
    sent = d.run(100, {"raw": 5 * GB, "int4": 2 * GB}, 40e9, app_limited=False)
    assert "raw" in sent and sent.index("raw") <= 40 + 1 and ch.leader == "raw"
    assert codec_choice.PATH_GROWTH == 2.0
    # an app-limited estimate is the sender's pace: it does not count as the lowest
    ch = _measured()
    d = Driver(ch)
    d.run(100, {"raw": 5 * GB, "int4": 2 * GB}, 40e9, app_limited=False)
    d.run(200, {"raw": 0.25 * GB, "int4": 0.67 * GB}, 2e9, app_limited=False)
    d.run(100, {"raw": 0.25 * GB, "int4": 0.67 * GB}, 0.2e9, app_limited=True)
    sent = d.run(200, {"raw": 0.25 * GB, "int4": 0.67 * GB}, 2e9, app_limited=False)
    assert "raw" not in sent


def test_raw_never_measured_is_not_held_back_by_an_app_limited_estimate() -> None:
    """A long path starts with int4, which leads at its encoder's pace, app-limited: raw,
    rated by the model on that pace (0.75 GB/s, below half of int4's 2), waited what a
    stint that far behind costs (2560 chunks); the estimate is no bound of the path, and
    raw is explored as any codec never measured."""
    ch = _measured()
    ch.observe_path_rtt(0.02)
    d = Driver(ch)
    sent = d.run(200, {"raw": 5 * GB, "int4": 2 * GB}, 6e9, app_limited=True)
    assert sent[0] == "int4" and "raw" in sent[:60] and ch.leader == "raw"


# -- in a pipeline with the estimator ---------------------------------------------------------------


def _transient(t: float) -> float:
    """40 Gbit/s, 2 for t in [1, 3)."""
    return 2 * G if 1 <= t < 3 else 40 * G


def test_the_model_goes_back_to_raw_once_the_path_is_back() -> None:
    """r8c: 2 ms, 40 Gbit/s down to 2 for two seconds. int4 was kept at its encoder's
    2 GB/s for good (its raw probes were measured at 14 Gbit/s); raw, 5 GB/s, is back
    within a second."""
    ch = estsim.chooser(RATIOS, ENCODE, DECODE)
    run = estsim.run(ch, _transient, ratio=RATIOS, encode=ENCODE, decode=DECODE, seconds=5.0)
    assert run.goodput(2.5, 3.0) >= 0.6 * GB  # int4 while the path is slow
    later = run.sent(4.0, 5.0)
    assert later.count("raw") >= 0.95 * len(later)
    assert run.goodput(4.0, 5.0) >= 4.8 * GB


def test_measured_goodput_goes_back_to_raw_once_the_path_is_back() -> None:
    """r8b: the same with auto_codec="measured": int4 was kept at 2 GB/s for good (raw
    never explored again after the drop)."""
    ch = estsim.chooser(RATIOS, ENCODE, DECODE, measure_goodput=True, tolerance=0.05, hysteresis=0.10)
    run = estsim.run(ch, _transient, ratio=RATIOS, encode=ENCODE, decode=DECODE, seconds=5.0)
    assert run.goodput(2.5, 3.0) >= 0.6 * GB
    assert ch.leader == "raw"
    assert run.goodput(4.0, 5.0) >= 4.8 * GB


def _fixed(link_gbps: float, rtt: float, seconds: float) -> estsim.Run:
    only = estsim.chooser({"int4": 0.375}, ENCODE, DECODE)
    return estsim.run(only, _steady(link_gbps), ratio=RATIOS, encode=ENCODE, decode=DECODE,
                      seconds=seconds, rtt=rtt)


def test_where_int4_is_the_better_codec_probing_costs_little() -> None:
    """At 1 Gbit/s int4 fills the wire (never app-limited, never probed); at 10 its
    encoder paces the sender (app-limited: raw probes and stints), raw delivers 1.25 GB/s
    against int4's 2. Either way auto delivers within 3% of int4 alone."""
    for link, rtt in ((1.0, 0.002), (10.0, 0.002), (10.0, 0.02)):
        base = _fixed(link, rtt, 4.0).goodput(1.0, 4.0)
        for kw in ({}, {"measure_goodput": True, "tolerance": 0.05, "hysteresis": 0.10}):
            ch = estsim.chooser(RATIOS, ENCODE, DECODE, **kw)
            got = estsim.run(ch, _steady(link), ratio=RATIOS, encode=ENCODE, decode=DECODE,
                             seconds=4.0, rtt=rtt).goodput(1.0, 4.0)
            assert got >= 0.97 * base, (link, rtt, kw, got / base)


def _steady(link_gbps: float) -> Callable[[float], float]:
    return lambda t: link_gbps * G
