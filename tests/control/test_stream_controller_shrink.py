"""StreamController's shrink on a simple model (fake time): a per-stream rate that fell
must not keep the count shrinking and growing back."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvwire.control import StreamController, StreamSample, StreamVerdict

G = 1e9


def run(cap: Callable[[float], float], link: Callable[[float], float], seconds: float = 30.0,
        ctl: StreamController | None = None) -> tuple[list[tuple[float, StreamVerdict, int]], float]:
    """Each stream carries at most ``cap(t)`` (its window over its RTT), all of them
    ``link(t)``; a stream is window-limited when the caps, not the link, bound the total.
    One evaluation every 0.25 s. Returns the changes and the share of what the best count
    (8 streams) would have delivered."""
    ctl = ctl or StreamController(max_streams=8)
    t, changes, carried, ideal = 0.0, [], 0.0, 0.0
    for _ in range(int(seconds / 0.25)):
        t += 0.25
        n, c, total_link = ctl.streams, cap(t), link(t)
        total = min(total_link, n * c)
        carried += total
        ideal += min(total_link, 8 * c)
        sample = StreamSample(delivery_rate_bps=total / n, window_limited=n * c <= total_link)
        d = ctl.evaluate([sample] * n, t)
        if d.verdict is not StreamVerdict.HOLD:
            changes.append((t, d.verdict, d.streams))
    return changes, carried / ideal


def test_a_per_stream_rate_that_fell_does_not_keep_the_count_moving() -> None:
    """5 Gbit/s per stream for 2 s (a short RTT), then 2 (the RTT grew), on a 7 Gbit/s
    link: the 5 Gbit/s kept as the best shrank 4 streams to 3 and grew them back every
    1.25 s for good (47 changes in 30 s, 96.7 % of the link). The shrink that fails is
    undone, and the best becomes what a stream carries now."""
    changes, share = run(cap=lambda t: 5 * G if t < 2 else 2 * G, link=lambda t: 7 * G)
    assert len(changes) <= 6
    assert [v for _, v, _ in changes].count(StreamVerdict.SHRINK) <= 1
    assert changes[-1][2] == 4
    assert share >= 0.99


def test_a_steady_per_stream_rate_grows_once_and_holds() -> None:
    changes, share = run(cap=lambda t: 2 * G, link=lambda t: 7 * G)
    assert [(v, n) for _, v, n in changes] == [(StreamVerdict.GROW, 2), (StreamVerdict.GROW, 3),
                                             (StreamVerdict.GROW, 4)]
    assert share >= 0.98


def test_a_needless_stream_is_still_given_up() -> None:
    """Streams that can each carry 5 Gbit/s on a link that drops from 20 to 6: two
    suffice, and the count comes down to them, failed shrink or not."""
    changes, _ = run(cap=lambda t: 5 * G, link=lambda t: 20 * G if t < 3 else 6 * G, seconds=15.0)
    assert changes[-1][2] == 2
    assert [v for _, v, _ in changes].count(StreamVerdict.SHRINK) >= 2


def test_the_best_rate_is_that_of_the_last_best_window_seconds() -> None:
    """A rate one stream showed more than ``best_window`` seconds ago no longer says
    fewer streams would do once a lower one was shown since."""
    ctl = StreamController(initial_streams=3, max_streams=4, interval=0.25, shrink_patience=60)  # best_window 10 s
    t = 0.0

    def one_limited(rate: float) -> StreamVerdict:
        nonlocal t
        t += 0.25
        limited = [StreamSample(delivery_rate_bps=rate, window_limited=True)]
        return ctl.evaluate(limited + [StreamSample(delivery_rate_bps=G, window_limited=False)] * 2, t).verdict

    assert one_limited(4 * G) is StreamVerdict.HOLD
    assert one_limited(1.2 * G) is StreamVerdict.HOLD  # the newest best, behind 4 Gbit/s
    verdicts = []
    for _ in range(80):  # link-limited at 3 Gbit/s for 20 s: 2 x 4 >= 1.25 x 3, but 15 s later
        t += 0.25
        verdicts.append(ctl.evaluate([StreamSample(delivery_rate_bps=G, window_limited=False)] * 3, t).verdict)
    assert StreamVerdict.SHRINK not in verdicts and ctl.streams == 3  # 2 x 1.2 < 1.25 x 3


def test_the_newest_best_counts_however_old() -> None:
    """Streams added on a fast link are given up when it slows, however long after the
    last window-limited sample: 5 Gbit/s per stream, a 12 Gbit/s link falling to 6 at
    30 s. Before, every best older than ``best_window`` was dropped, none was left, and
    the 3 streams stayed for good (the shrink at 30 s came only for a fall within 10 s)."""
    for drop in (8.0, 30.0):
        changes, _ = run(cap=lambda t: 5 * G, link=lambda t, at=drop: 12 * G if t < at else 6 * G, seconds=40.0)
        assert [(v, n) for _, v, n in changes] == [(StreamVerdict.GROW, 2), (StreamVerdict.GROW, 3),
                                                 (StreamVerdict.SHRINK, 2)]
        assert changes[-1][0] == drop


def test_a_stale_best_costs_one_failed_shrink() -> None:
    """The newest best may be stale: 5 Gbit/s per stream on a 12 Gbit/s link (3 streams,
    window-limited only on the way up), then at 20 s 2.5 per stream on a 6 Gbit/s link,
    with no window-limited sample between. The shrink the 5 Gbit/s allows fails, is
    undone at once, and the best becomes what a stream carries now: no shrink after it."""
    changes, share = run(cap=lambda t: 5 * G if t < 20 else 2.5 * G, link=lambda t: 12 * G if t < 20 else 6 * G,
                         seconds=60.0)
    assert [(v, n) for _, v, n in changes] == [(StreamVerdict.GROW, 2), (StreamVerdict.GROW, 3),
                                             (StreamVerdict.SHRINK, 2), (StreamVerdict.GROW, 3)]
    assert share >= 0.99


def test_a_failed_shrink_is_not_tried_again_within_the_backoff() -> None:
    ctl = StreamController(initial_streams=4, max_streams=4, interval=0.25, shrink_patience=2, backoff=5.0)
    t = 0.0

    def evaluate(*samples: tuple[float, bool]) -> StreamVerdict:
        nonlocal t
        t += 0.25
        return ctl.evaluate([StreamSample(delivery_rate_bps=r, window_limited=w) for r, w in samples], t).verdict

    fast = (5 * G, True)  # one stream window-limited at 5 Gbit/s, the others not: 7 in all
    mixed = (fast, (G * 2 / 3, False), (G * 2 / 3, False), (G * 2 / 3, False))
    link = ((1.75 * G, False),) * 4
    assert evaluate(*mixed) is StreamVerdict.HOLD
    assert evaluate(*link) is StreamVerdict.SHRINK  # 3 x 5 >= 1.25 x 7
    failed = t + 0.25
    assert evaluate(*((2 * G, True),) * 3) is StreamVerdict.GROW  # 3 streams carry 2 each: back to 4
    verdicts = []
    while t < failed + 4.5:
        verdicts.append(evaluate(*mixed))  # 5 Gbit/s again on one stream: the best again
    assert StreamVerdict.SHRINK not in verdicts and ctl.streams == 4  # before: shrank at once
    while t < failed + 6.0 and ctl.streams == 4:
        evaluate(*mixed)
    assert ctl.streams == 3  # the backoff is over


def test_a_best_window_that_is_not_a_finite_number_ge_0_is_refused() -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="best_window"):
            StreamController(best_window=bad)
