"""A measuring codec chooser and chunks acknowledged at each codec's true rate."""

from __future__ import annotations

from kvwire.control import CodecChooser
from kvwire.control.goodput import GoodputMeter

GB = 1e9
MIB = 1 << 20
CHUNK = 4 * MIB


def measured_chooser(**kw: float) -> CodecChooser:
    return CodecChooser.from_ratios(
        {"raw": 1.0, "int8": 0.516, "int4": 0.375}, meter=GoodputMeter(sample_acks=2, min_acks=2),
        measure_goodput=True, hysteresis=0.03, tolerance=0.05, explore_after=4, stint_max=8, **kw)


def measure_all(ch: CodecChooser, true: dict[str, float], now: float, chunks: int = 600) -> float:
    """Chunks acknowledged at once at their codec's true rate, until each codec is measured."""
    for _ in range(chunks):
        codec = ch.choose(40e9, now=now).codec
        now += CHUNK / true[codec]
        ch.observe_delivered(codec, CHUNK, now)
    assert set(ch.meter.measured) == set(true)
    return now
