"""``auto`` on measured goodput through a ProbeRTT drain: acknowledgements while the
sender holds data back (the estimator's ``hold_limited``) are in no codec's goodput."""

from __future__ import annotations

from kvwire.control.goodput import GoodputMeter
from tests.control.chooser_helpers import CHUNK, GB, measure_all, measured_chooser


def test_acknowledgements_during_a_drain_are_in_no_codecs_goodput() -> None:
    # Raw leads at 5 GB/s, int8 measured at 3; a ProbeRTT drain (hold_limited) slows the
    # acknowledgements to a trickle for 200 ms: raw keeps its rate and the lead, and
    # int8 is not explored sooner for it.
    ch = measured_chooser()
    true = {"raw": 5 * GB, "int8": 3 * GB, "int4": 2 * GB}
    now = measure_all(ch, true, 0.0)
    assert ch.leader == "raw"
    for _ in range(200):  # until no stint is under way
        codec = ch.choose(40e9, now=now).codec
        now += CHUNK / true[codec]
        ch.observe_delivered(codec, CHUNK, now)
        if codec == "raw" and ch._stint is None:
            break
    rate = ch.meter.rate("raw")
    assert rate is not None and rate > 4.5 * GB
    # The drain: the sender holds back; chunks in flight come back, then a trickle.
    for i in range(40):
        now += CHUNK / true["raw"] if i < 4 else 0.005
        ch.observe_delivered("raw", CHUNK, now, held=True)
    rate = ch.meter.rate("raw")
    assert rate is not None and rate > 4.5 * GB
    assert ch.choose(40e9, now=now).codec == "raw"
    assert ch.leader == "raw"
    # After the hold, raw's next run measures it again at its pace.
    for _ in range(10):
        ch.observe_delivered("raw", CHUNK, now)
        now += CHUNK / true["raw"]
    rate = ch.meter.rate("raw")
    assert rate is not None and rate > 4.5 * GB


def test_the_meter_ends_its_run_at_a_hold_and_starts_none_during_it() -> None:
    meter = GoodputMeter(sample_acks=4, min_acks=2)
    meter.chosen("raw")
    t = 0.0
    for _ in range(3):  # the run's clock starts at the first; two more count
        t += 0.001
        meter.on_ack("raw", 1000, t)
    for _ in range(10):  # a hold: the run ends there (a short sample of 1 MB/s), no new one
        t += 0.1
        meter.on_ack("raw", 1000, t, held=True)
    assert meter.samples("raw") == 1
    assert meter.rate("raw") == 1000 * 2 / 0.002
    t += 0.001
    meter.on_ack("raw", 1000, t)  # starts the next run's clock
    for _ in range(4):
        t += 0.001
        meter.on_ack("raw", 1000, t)
    assert meter.samples("raw") == 2
    assert abs((meter.rate("raw") or 0) - 1e6) < 1
