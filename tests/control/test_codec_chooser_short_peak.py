"""The model on a short path rates the wire at the estimator's peak, not at the published
estimate (a mean over half a second), but a peak that outlived a drop in capacity no
longer counts: at most PEAK_OVER_ESTIMATE times the estimates of the last
ESTIMATE_MEMORY seconds."""

from __future__ import annotations

from kvwire.control import CodecCandidate, CodecChooser, codec_choice
from tests.control import estsim

GB = 1e9
G = estsim.GBIT


def _short(raw_cpu: float, int4_encode: float) -> CodecChooser:
    """Raw's transport good for ``raw_cpu`` KV bytes/s, int4 encoding at ``int4_encode``;
    a 2 ms path (raw's cost measured: nothing holds raw but the model)."""
    c = CodecChooser([CodecCandidate(name="raw", size_ratio=1.0),
                      CodecCandidate(name="int4", size_ratio=0.25, encode_bytes_per_s=int4_encode)],
                     pipeline="full")
    c.observe_path_rtt(0.002)
    c.observe_transport(64 << 20, (64 << 20) / raw_cpu, "raw")
    return c


def _ticks(start: float, end: float, step: float = 0.01) -> list[float]:
    return [start + i * step for i in range(round((end - start) / step))]


def _chosen(c: CodecChooser, bandwidth_bps: float, now: float, peak_bps: float) -> str:
    """The model's choice (a probe, int4 now and then while raw is chosen, stands for raw:
    here nothing is app-limited, so raw never probes)."""
    choice = c.choose(bandwidth_bps, now=now, peak_bps=peak_bps)
    assert not choice.probe or choice.codec == "int4"
    return "raw" if choice.probe else choice.codec


def test_a_peak_that_outlived_a_drop_in_capacity_stops_counting() -> None:
    """16 Gbit/s falling to 2 over half a second (the estimate's mean following the
    drop), the peak still 16 (its round trips take long behind the queue): raw, rated
    at the peak (2 GB/s against int4's 1), stayed until the peak fell, where it delivers
    0.25. Capped at three times the estimates of the last quarter second, the peak stops
    counting once the estimate has been below a third of it that long."""
    c = _short(raw_cpu=2.5 * GB, int4_encode=1 * GB)
    assert {_chosen(c, 16e9, t, 16e9) for t in _ticks(0.0, 1.0)} == {"raw"}

    def estimate(t: float) -> float:
        return 16e9 - 14e9 * min(1.0, (t - 1.0) / 0.5)

    got = {t: _chosen(c, estimate(t), t, 16e9) for t in _ticks(1.0, 3.0)}
    # raw while the estimates of the last quarter second were within a third of the
    # peak, or three times them carried raw within the hysteresis of int4
    assert {got[t] for t in got if t < 1.3} == {"raw"}
    # int4 once the estimate was below 2.5 Gbit/s a quarter second ago (at t = 1.48):
    # three times that, 7.5 Gbit/s, carries 0.94 GB/s of raw, int4 delivers 1 (5% more)
    assert {got[t] for t in got if t >= 1.48 + 0.25 + 0.015} == {"int4"}
    assert (codec_choice.PEAK_OVER_ESTIMATE, codec_choice.ESTIMATE_MEMORY) == (3.0, 0.25)
    # without a clock: the peak as given
    c = _short(raw_cpu=2.5 * GB, int4_encode=1 * GB)
    assert c.choose(16e9, peak_bps=16e9).codec == "raw"
    assert c.choose(2e9, peak_bps=16e9).codec == "raw"


def test_a_mean_below_the_peak_for_a_reason_other_than_the_paths_keeps_the_peak() -> None:
    """A burst of small transfers, each with its first round trips in the estimate's
    mean: 10-13 Gbit/s of a loopback whose peak is 25. Raw at 25 (3.1 GB/s) beats int4
    (2.5); at the estimate (1.6) it would not."""
    c = _short(raw_cpu=5 * GB, int4_encode=2.5 * GB)
    got = {_chosen(c, 13e9 - 3e9 * (i % 2), t, 25e9) for i, t in enumerate(_ticks(0.0, 3.0))}
    assert got == {"raw"}


def test_a_moment_of_a_low_estimate_keeps_the_peak_and_a_pause_does_not_forget_it() -> None:
    c = _short(raw_cpu=2.5 * GB, int4_encode=1 * GB)
    for t in _ticks(0.0, 1.0):
        c.choose(16e9, now=t, peak_bps=16e9)
    # 2 Gbit/s for a tenth of a second: the estimates of the quarter second before count
    assert {_chosen(c, 2e9, t, 16e9) for t in _ticks(1.0, 1.1)} == {"raw"}
    assert {_chosen(c, 16e9, t, 16e9) for t in _ticks(1.1, 2.0)} == {"raw"}
    # a pause of 3 s between transfers; the next one's first estimate is low: the one from
    # before the pause counts until the new ones span a quarter second
    assert {_chosen(c, 2e9, t, 16e9) for t in _ticks(5.0, 5.2)} == {"raw"}
    assert {_chosen(c, 2e9, t, 16e9) for t in _ticks(5.3, 5.6)} == {"int4"}


def test_after_a_drop_in_a_pipeline_int4_takes_over_within_the_estimates_memory() -> None:
    """r6: 40 Gbit/s falling to 2 at t = 1 over a 2 ms path, the estimator in the loop
    (32 MiB in flight at most). The peak read 40 until t = 2.2 and raw was kept at
    0.27 GB/s; int4 delivers 0.67."""
    ratio = {"raw": 1.0, "int4": 0.375}
    encode, decode = {"int4": 2 * GB}, {"int4": 6 * GB}
    ch = estsim.chooser(ratio, encode, decode)
    run = estsim.run(ch, lambda t: 2 * G if t >= 1 else 40 * G, ratio=ratio, encode=encode, decode=decode,
                     seconds=3.0)
    assert run.goodput(0.5, 1.0) >= 4.9 * GB  # raw before the drop
    first = next(t for t, c, probe in run.choices if t >= 1.0 and c == "int4" and not probe)
    assert first < 1.85
    assert run.goodput(2.0, 2.5) >= 0.6 * GB
