"""``auto`` on measured goodput over a long path: a stint lasts until its codec has a
sample (at least a few round trips of the path), and one that ended without a sample
leaves no stale rate deciding the lead."""

from __future__ import annotations

import itertools

from tests.control.chooser_helpers import CHUNK, GB, measure_all, measured_chooser


def test_a_stint_lasts_round_trips_of_the_path_until_its_codec_has_a_sample() -> None:
    # 100 ms path: int4's acknowledgements come only after a few round trips (here never);
    # its stint goes on past stint_max (8 chunks, 34 ms) for a few round trips (STINT_ROUND_TRIPS),
    # and once over without a sample, int4's old rate is dropped, not kept to decide.
    ch = measured_chooser()
    ch.observe_path_rtt(0.1)
    true = {"raw": 2 * GB, "int8": 0.5 * GB, "int4": 1 * GB}
    now = measure_all(ch, true, 0.0)
    assert ch.leader == "raw"
    sent: list[tuple[str, float]] = []
    for _ in range(3000):
        codec = ch.choose(40e9, now=now).codec
        sent.append((codec, now))
        now += CHUNK / true[codec]
        if codec == "raw":
            ch.observe_delivered(codec, CHUNK, now)  # int4's never come back
        if codec == "int4" and "int4" not in ch.meter.measured:
            break
    first = next(i for i, (c, _) in enumerate(sent) if c == "int4")
    stint = [t for _, t in itertools.takewhile(lambda x: x[0] == "int4", sent[first:])]
    assert len(stint) > 8
    assert stint[-1] - stint[0] >= 0.25  # a few round trips, not 8 chunks
    # It ended without a sample: int4 counts as not measured, raw leads on its own rate.
    for _ in range(20):
        codec = ch.choose(40e9, now=now).codec
        if codec != "int4":
            break
        now += CHUNK / true[codec]
    assert "int4" not in ch.meter.measured
    assert ch.leader == "raw"


def test_a_stint_with_a_sample_ends_at_it_on_a_long_path() -> None:
    ch = measured_chooser()
    ch.observe_path_rtt(0.1)
    true = {"raw": 2 * GB, "int8": 0.5 * GB, "int4": 1 * GB}
    now = measure_all(ch, true, 0.0)
    codecs: list[str] = []
    for _ in range(2000):
        codec = ch.choose(40e9, now=now).codec
        codecs.append(codec)
        now += CHUNK / true[codec]
        ch.observe_delivered(codec, CHUNK, now)
    # Acknowledged at once, a stint has its sample after 3 chunks (the first starts the clock).
    lengths = [len(list(g)) for c, g in itertools.groupby(codecs) if c != "raw"]
    assert lengths and max(lengths) <= 8
